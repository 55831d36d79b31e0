"""Capture on fake tensors (the default): fn runs on fake tensors, so the capture computes
nothing, writes nothing and holds no activations; what a fake run cannot do, a real run does."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

import flowexec
import flowexec.capture as capture
from helpers import assert_close_rel


class _Seen(torch.nn.Module):
    """A linear layer that notes whether each forward saw a fake tensor (F) or a real one (R),
    in a text sink: state the capture's guards do not take for what fn reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)
        self.seen = io.StringIO()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.write("F" if is_fake(x) else "R")
        return self.lin(x)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


@pytest.mark.parametrize("fused,first_step,seen", [(False, "planned", "FF"), (True, "planned", "FF"),
                                                   (False, "eager", "RF")])
def test_a_training_step_is_captured_on_fake_tensors_and_trains_as_eager(fused, first_step, seen) -> None:
    """Both programs (the first step's, which makes AdamW's state, and the steps') are captured
    on fake tensors; with ``first_step="eager"`` the first call runs the model for real."""
    torch.manual_seed(0)
    model, ref = _Seen(), _Seen()
    ref.load_state_dict(model.state_dict())
    exe = flowexec.compile(_step(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)),
                           first_step=first_step)
    ref_step = _step(ref, torch.optim.AdamW(ref.parameters(), lr=0.1, fused=fused))
    data = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(4)]
    for x, y in data:
        assert_close_rel(exe(x, y), ref_step(x, y), 1e-5, "loss")
    assert exe.capture_run == "fake"
    assert model.seen.getvalue() == seen
    assert_close_rel(model.lin.weight, ref.lin.weight, 1e-5, "weight")


def test_what_a_fake_run_cannot_do_a_real_run_does_and_says_why() -> None:
    """An op with no fake kernel (a custom op registered without one): the fake run fails, the
    real run captures it, ``capture_run`` names the reason, and the answer is eager's; the failed
    fake run leaves no fake gradient on a parameter."""
    lib = torch.library.Library("flowexec_test_fake", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 4))

    def step(x: torch.Tensor) -> torch.Tensor:
        w.grad = None
        loss = (torch.ops.flowexec_test_fake.twice(x) @ w).square().mean()
        loss.backward()
        return w.grad.clone()

    exe = flowexec.compile(step)
    x = torch.randn(3, 8)
    got = exe(x)
    assert exe.capture_run.startswith("real (a fake run could not:") and "twice" in exe.capture_run
    assert w.grad is None or not is_fake(w.grad)
    torch.testing.assert_close(got, step(x))


def test_host_reads_of_constants_and_of_lifted_hyperparameters_are_answered_in_a_fake_run() -> None:
    """A value made from constants alone (an arange) read on the host, and AdamW's host reads of
    its lifted hyperparameters (``weight_decay != 0``): answered from real twins and from the
    numbers, so the run stays fake, and trains as eager."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())

    def make(m: torch.nn.Module):
        opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01, foreach=True)

        def step(x: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            n = int(torch.arange(4).sum().item())  # 6, every call
            loss = m(x).square().mean() * n
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    exe, ref_step = flowexec.compile(make(model)), make(ref)
    for _ in range(3):
        x = torch.randn(5, 8)
        assert_close_rel(exe(x), ref_step(x), 1e-5, "loss")
    assert exe.capture_run == "fake"


def test_code_that_asks_whether_a_tensor_of_constants_is_fake_takes_eager_s_path() -> None:
    """Integer and boolean tensors made from constants (positions, masks) reach fn as their real
    twins: a library that takes another path for a fake tensor (transformers' ``is_tracing``
    before its packed-sequence check) takes the one eager takes, and the run stays fake."""
    from torch._subclasses.fake_tensor import FakeTensor

    def fn(x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[-1]).unsqueeze(0)
        packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        if not isinstance(packed, FakeTensor) and bool((packed[:, -1] == 0).all()):
            return x * 2 + pos  # eager's path: one sequence
        return x * 3 + pos  # what a tracer that cannot read the mask does

    x = torch.randn(2, 6)
    exe = flowexec.compile(fn, x, mode="trace")
    for _ in range(2):
        x = torch.randn(2, 6)
        torch.testing.assert_close(exe(x), fn(x))
    assert exe.capture_run == "fake"
    assert not any("cumsum" in op.name for op in exe.program.ops)  # (folded: the program reads pos)


def test_a_tensor_of_constants_written_in_place_or_returned_is_made_anew_by_each_call() -> None:
    """The graph traces a folded tensor's fake: a write in place to it is an op of every call
    (not a write to a constant of the program), and one fn returns is a new tensor per call
    (not the same one, which a caller's write would reach), views of one another as eager's."""
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        idx = torch.arange(3)
        idx.add_(1)
        return x[idx] * 2, idx, idx[1:]

    exe = flowexec.compile(fn, torch.randn(5), mode="trace")
    x = torch.randn(5)
    first = exe(x)
    torch.testing.assert_close(first, fn(x))
    first[1].add_(10)
    assert first[2].tolist() == [12, 13]  # a view of the first, as eager's
    again = exe(x)
    torch.testing.assert_close(again, fn(x))
    assert again[1].data_ptr() != first[1].data_ptr()
    assert exe.capture_run == "fake"

    def view_only(x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # (its base is not returned)
        idx = torch.arange(4)
        return x[idx[:3]] * 2, idx[1:]

    exe = flowexec.compile(view_only, torch.randn(5), mode="trace")
    torch.testing.assert_close(exe(x), view_only(x))
    assert exe.capture_run == "fake"


def test_a_tensor_of_constants_fn_keeps_is_state_a_program_cannot_update() -> None:
    """A folded tensor fn keeps in Python state (an attribute of a plain object) is refused as
    any tensor fn made and kept is: a compiled call would not assign it again."""
    class Holder:
        mask = torch.ones(3, dtype=torch.bool)
    h = Holder()

    def fn(x: torch.Tensor) -> torch.Tensor:
        h.mask = torch.ones(3, dtype=torch.bool)
        return x * h.mask

    exe = flowexec.compile(fn, mode="trace")
    x = torch.randn(3)
    torch.testing.assert_close(exe(x), fn(x))  # (run as fn: state it makes on a first call)
    with pytest.raises(flowexec.CaptureError, match=r"left 1 tensor\(s\) it created in Python state"):
        exe(x)


def test_an_empty_tensor_of_constants_leaves_other_writes_in_place_fake() -> None:
    """An empty folded tensor has no storage (the key every fake tensor has): a write in place
    to any other tensor keeps the run fake."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        none = torch.zeros(0, dtype=torch.long)
        y = x * 2
        y.relu_()
        return y.sum() + none.numel()

    exe = flowexec.compile(fn, torch.randn(5), mode="trace")
    x = torch.randn(5)
    torch.testing.assert_close(exe(x), fn(x))
    assert exe.capture_run == "fake"

def test_an_hf_gpt2_step_captured_fake_runs_the_ops_of_a_real_capture(monkeypatch) -> None:
    """Hugging Face GPT-2 (no attention mask, no cache: a training step): the fake capture's
    program runs the real capture's ops less the folded constants; it builds no explicit causal
    mask, so SDPA keeps its causal kernel."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False

    def step(ids: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        logits = model(ids).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), ids.view(-1))
        loss.backward()
        return loss.detach()

    ids = torch.randint(0, 100, (2, 16))
    ops = {}
    for fake in (True, False):
        monkeypatch.setattr(capture, "_FAKE_CAPTURE", fake)
        exe = flowexec.compile(step, ids, mode="trace")
        assert exe.capture_run == ("fake" if fake else "real")
        ops[fake] = {op.name for op in exe.program.ops}
        torch.testing.assert_close(exe(ids), step(ids))
    assert ops[True] <= ops[False], ops[True] - ops[False]

def test_a_real_capture_is_one_switch_away(monkeypatch) -> None:
    monkeypatch.setattr(capture, "_FAKE_CAPTURE", False)
    exe = flowexec.compile(lambda x: (x * 2).sum(), torch.ones(3), mode="trace")
    assert exe.capture_run == "real"


_ATEN = torch.ops.aten
# (op, a real tensor it writes in place, its other arguments; None: a constant made in the run)
_WRITES = [
    (_ATEN.add_.Tensor, torch.tensor(5.0), (1,)),  # a CPU step count += 1: run for real
    (_ATEN.add_.Tensor, torch.tensor(5.0), (None,)),
    (_ATEN._foreach_add_.Tensor, [torch.tensor(5.0), torch.tensor(6.0)], (None,)),  # Adam's CPU step counts
    (_ATEN._foreach_add_.Scalar, [torch.tensor(5.0)], (1,)),
    (_ATEN.mul_.Tensor, torch.ones(3), (None,)),
    (_ATEN.mul_.Scalar, torch.ones(3), (2.0,)),
    (_ATEN._foreach_mul_.Scalar, [torch.ones(3), torch.ones(2)], (2.0,)),  # foreach weight decay
    (_ATEN._foreach_mul_.Tensor, [torch.ones(3), torch.ones(2)], (None,)),
    (_ATEN.lerp_.Scalar, torch.ones(3), (torch.zeros(3), 0.5)),
    (_ATEN.zero_.default, torch.ones(3), ()),
]


@pytest.mark.parametrize("op, written, rest", _WRITES,
                         ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else "")
def test_fake_run_knows_which_ops_a_fake_trace_runs_on_real_tensors(op, written, rest) -> None:
    """``runs_for_real`` against make_fx's fake tracing itself (as a capture runs it: closure
    tensors real, constants made in the run): where it says an op of real tensors runs on fake
    copies, the real tensor keeps its value (the capture keeps no undo copy of it); where the
    op does write it, it says so (the capture's undo log puts it back)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from flowexec.fake_run import runs_for_real

    tensors = written if isinstance(written, list) else [written]
    before = [t.clone() for t in tensors]
    said = []

    def traced(x: torch.Tensor) -> torch.Tensor:
        args = [torch.tensor(2.0) if a is None else a for a in rest]
        said.append(runs_for_real(op, [*tensors, *(a for a in args if isinstance(a, torch.Tensor))]))
        op(written, *args)
        return x + 1

    # (the capture's fake mode: no fallback kernels, which would run the real op on real tensors)
    mode = FakeTensorMode(allow_fallback_kernels=False, allow_non_fake_inputs=True)
    make_fx(traced, tracing_mode="fake", _allow_non_fake_inputs=True)(mode.from_tensor(torch.zeros(2)))
    changed = any(not torch.equal(t, b) for t, b in zip(tensors, before))
    assert not changed or said[0], f"{op} wrote a real tensor that runs_for_real calls untouched"


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=0.01, foreach=True),
], ids=["adamw_foreach", "sgd_momentum_foreach"])
def test_a_fake_capture_of_a_foreach_optimizer_keeps_no_undo_copies(make_opt, monkeypatch) -> None:
    """The foreach steps' writes of parameters and state (weight decay, the second moment's
    decay) run on fake copies: the capture copies nothing to put back, and trains as eager."""
    from flowexec import snapshot

    saved = io.StringIO()  # (a sink the capture's guards do not take for what fn reads)
    real_save = snapshot.HostSnapshot.save
    monkeypatch.setattr(snapshot.HostSnapshot, "save", lambda self, t: (saved.write("s"), real_save(self, t))[1])
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    exe, ref_step = flowexec.compile(_step(model, make_opt(model.parameters()))), _step(ref, make_opt(ref.parameters()))
    for _ in range(4):
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        assert_close_rel(exe(x, y), ref_step(x, y), 1e-5, "loss")
    assert exe.capture_run == "fake"
    assert saved.getvalue() == ""
    assert_close_rel(model.weight, ref.weight, 1e-5, "weight")


def test_a_tensor_a_failed_fake_run_cached_on_a_module_is_put_back() -> None:
    """A module caching a float tensor made from constants (rotary tables): the fake run's
    refusal (a tensor left in Python state) puts the attribute back, so no fake tensor stays
    there; the first call runs fn, and the next captures, as eager."""
    class Rot(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cos = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.cos is None:
                self.cos = torch.cos(torch.arange(x.shape[0]) * 0.1)
            return x * self.cos

    m = Rot()
    exe = flowexec.compile(m, torch.randn(5), mode="trace")
    assert m.cos is None
    for _ in range(3):
        x = torch.randn(5)
        got = exe(x)
        assert not is_fake(got) and not is_fake(m.cos)
        torch.testing.assert_close(got, m(x))


def test_a_fake_tensor_left_in_a_cache_is_refused_by_the_real_run() -> None:
    """A cache the fake run filled (functools.lru_cache is no state flowexec can put back): the
    real run that follows refuses the fake tensor it would bake in, and says what to do."""
    import functools

    @functools.lru_cache
    def table(n: int) -> torch.Tensor:
        return torch.cos(torch.arange(n) * 0.1)

    exe = flowexec.compile(lambda x: x * table(x.shape[0]), mode="trace")
    with pytest.raises(flowexec.CaptureError, match="fake tensor kept in Python state"):
        for _ in range(2):
            exe(torch.randn(6))


def test_a_host_read_of_a_constant_written_with_the_call_s_values_is_refused() -> None:
    """A mask made from constants, then written through a view with values of the call: a host
    read of it (or of a view) is the call's, never the capture's (fake and real runs)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(5, dtype=torch.bool)
        mask[:3] = x[:3] > 0
        return x * 2 if mask.all() else x * 3

    exe = flowexec.compile(fn, mode="trace")
    with pytest.raises(flowexec.CaptureError, match="reads a tensor's value on the host"):
        exe(torch.tensor([-1.0, 1, 1, 1, 1]))


def test_a_folded_tensor_written_with_the_call_s_values_is_captured_for_real() -> None:
    """fn holds a folded tensor's real twin; a write of the call's values into it would leave
    the twin stale for what fn reads of it without dispatch: a real run captures instead."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        t = torch.arange(3)
        t.add_((x > 0).long())
        return x * t

    exe = flowexec.compile(fn, torch.ones(3), mode="trace")
    assert "writes values of the call into a tensor made from constants" in exe.capture_run
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(exe(x), fn(x))


def test_reads_that_do_not_dispatch_are_answered_for_constants_and_refused_otherwise() -> None:
    """``tolist()``/``numpy()`` do not dispatch: of a tensor made from constants (a literal, an
    arange) they are answered as eager would; of a tensor of the call they are refused as
    ``.item()`` is (a real run would bake the first call's value into the program)."""
    def of_constants(x: torch.Tensor) -> torch.Tensor:
        k, n = torch.tensor([2, 1]).tolist()
        return x[torch.tensor(k)] * n + float(torch.arange(4).numpy().sum())

    exe = flowexec.compile(of_constants, torch.randn(5), mode="trace")
    x = torch.randn(5)
    torch.testing.assert_close(exe(x), of_constants(x))
    assert exe.capture_run == "fake"
    for read in (lambda x: x * x.tolist()[0], lambda x: x * float(x.numpy()[0])):
        with pytest.raises(flowexec.CaptureError, match="reads a tensor's value on the host"):
            flowexec.compile(read, torch.tensor([2.0, 1.0]), mode="trace")


def test_a_bad_fake_capture_setting_names_the_choices():
    """FLOWEXEC_FAKE_CAPTURE takes 1 (the default), 0 or cpu; anything else stops the import
    with an error that says so, rather than quietly choosing one."""
    env = {**os.environ, "FLOWEXEC_FAKE_CAPTURE": "yes"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", "import flowexec"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=root)
    assert run.returncode != 0
    assert "FLOWEXEC_FAKE_CAPTURE='yes': expected 1 (the default), 0 or cpu" in run.stderr
    env["FLOWEXEC_FAKE_CAPTURE"] = "0"
    run = subprocess.run([sys.executable, "-c", "import flowexec.capture as c; print(c._FAKE_CAPTURE)"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert run.stdout.strip() == "False", run.stderr


def test_a_dead_folded_tensor_s_id_reused_by_a_later_one_keeps_both_twins_apart():
    """Integer tensors made from constants reach fn as real twins (capture._CaptureGuard._fold);
    once fn drops one, Python reuses its fake's id for a later fake. A lookup by that id alone
    then found the dead one's entry: the later tensor's twin was never recorded and its host
    read failed (the capture ran for real), or was answered with another tensor's values. The
    capture stays fake over hundreds of such tensors and the program computes eager's value."""
    def f(x):
        total = 0
        for k in range(300):
            a = torch.arange(k % 5 + 2)
            b = (torch.arange(4) + k) * 2
            total += int(b.sum()) + int(a[-1])
        return x * total

    exe = flowexec.compile(f, torch.ones(3), mode="trace")
    assert exe.capture_run == "fake"
    torch.testing.assert_close(exe(torch.ones(3)), f(torch.ones(3)))


def test_each_op_keeps_the_line_that_issued_it_through_a_backward():
    """Autograd's engine asks fake tensors their device (``prim.device``: two in three of a fake
    GPT-2 step's dispatches); the capture must not take those queries for ops, or the program's
    ops lose the source lines explain() and the timeline show (every op after the backward
    began lost its line; 18 of a GPT-2 step's 1,855 ops kept theirs)."""
    import inspect

    w = torch.nn.Parameter(torch.randn(4, 4))

    def f(x):
        w.grad = None
        y = torch.tanh(x @ w).sum()  # forward
        y.backward()  # backward
        return y.detach()  # result

    exe = flowexec.compile(f, torch.randn(3, 4), mode="trace")
    assert exe.capture_run == "fake"
    lines, start = inspect.getsourcelines(f)
    line = {ln.split("# ")[-1].strip(): f"test_fake_capture.py:{start + k}" for k, ln in enumerate(lines) if "  # " in ln}
    got = [(op.name, op.source) for op in exe.program.ops]
    assert {src for _, src in got} == set(line.values()), got
    assert ("aten.tanh_backward.default", line["backward"]) in got and got[-1][1] == line["result"], got



def test_a_tensor_of_constants_at_a_freed_written_storage_s_address_is_still_a_constant(monkeypatch):
    """A host read of a tensor made from constants alone is answered at capture (each call's
    answer is the same); one whose memory was written with the call's values is refused. A
    real capture took the written storage's address for its memory, and once that storage was
    freed a new tensor of constants there had its read refused (the compile failed)."""
    def f(x):
        total = 0
        for _ in range(20):
            y = torch.zeros(4)
            y.add_(x)  # the call's values: y is no constant
            del y  # (freed: its address comes back)
            total += int(torch.arange(4).sum())  # a constant: 6 on every call
        return x * total

    for fake in (False, True):
        monkeypatch.setattr(capture, "_FAKE_CAPTURE", fake)
        exe = flowexec.compile(f, torch.ones(4), mode="trace")
        assert exe.capture_run == ("fake" if fake else "real")
        torch.testing.assert_close(exe(torch.full((4,), 2.0)), f(torch.full((4,), 2.0)))


def _flat_pair(flat: torch.Tensor) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """Two parameters on one storage, as an RNN's flattened weights are."""
    return torch.nn.Parameter(flat[:8].view(2, 4)), torch.nn.Parameter(flat[8:])


@pytest.mark.parametrize("fake", [True, False])
def test_set_from_a_storage_views_what_is_on_it_at_each_call(fake, monkeypatch) -> None:
    """``t.set_(storage, ...)`` (cuDNN's RNNs call it on their packed weights) is recorded as a
    view of whatever is on that storage: a parameter's memory is read in place, as the
    parameter is, and an input's or a value's is viewed anew at each call. fx cannot hold a
    storage as an argument: the capture failed with "argument of type: UntypedStorage"."""
    monkeypatch.setattr(capture, "_FAKE_CAPTURE", fake)
    torch.manual_seed(0)
    flat = torch.randn(12)

    def make():
        w, b = _flat_pair(flat.clone())
        opt = torch.optim.SGD([w, b], lr=0.1)

        def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            opt.zero_grad()
            whole = torch.empty(0).set_(w.untyped_storage())  # both parameters, flat
            tail = torch.empty(0).set_(b.untyped_storage(), 8, (2, 2))  # b, through the storage
            y = x * 2
            on_y = torch.empty(0).set_(y.untyped_storage(), 1, (3,), (2,))  # a value of the run
            on_x = torch.empty(0).set_(x.untyped_storage(), 4, (2, 4))  # the call's input, within it
            loss = ((x @ whole[:8].view(4, 2)).sum(1) * tail.flatten()[:3]).pow(2).sum() + on_y.sum()
            (loss + b.sum()).backward()
            opt.step()
            return loss.detach(), on_x * 3
        return step, (w, b)

    eager, ref = make()
    step, params = make()
    exe = flowexec.compile(step, mode="trace")
    for _ in range(4):
        x = torch.randn(3, 4)
        for got, want in zip(exe(x), eager(x)):
            torch.testing.assert_close(got, want)
    assert exe.capture_run == ("fake" if fake else "real")
    for p, q in zip(params, ref):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("case,says", [
    ("other dtype", "no tensor of dtype torch.int32 of the run is on"),
    ("dead value", "a storage of the run that no live tensor is on"),
    ("whole argument storage", "an argument's storage past the argument itself"),
    ("past the argument", "an argument's storage past the argument itself")])
def test_set_from_a_storage_a_program_cannot_view_is_refused(case, says) -> None:
    """What ``set_(storage)`` cannot be recorded as: a storage viewed as a dtype no tensor of
    the run on it has; the memory of a value of the run whose tensor is gone (it was taken for
    state, and every call returned the capture's values); and an argument's storage past the
    argument (its size is no part of a call's signature: a bigger storage did not capture again
    and the program summed the capture's length)."""
    def f(x: torch.Tensor) -> torch.Tensor:
        if case == "other dtype":
            halves = (x * 2).view(torch.int16)
            return torch.empty(0, dtype=torch.int32).set_(halves.untyped_storage()) + halves.sum()
        if case == "dead value":
            return torch.empty(0).set_((x * 2).untyped_storage()) + 1
        if case == "whole argument storage":
            return torch.empty(0).set_(x.untyped_storage()).sum()
        return torch.empty(0).set_(x.untyped_storage(), 1, (4,)).sum()

    with pytest.raises(flowexec.CaptureError, match=says):
        flowexec.compile(f, mode="trace")(torch.arange(8.0)[:4])


def test_set_from_a_storage_takes_a_tensor_of_its_dtype_on_it() -> None:
    """Of the tensors of the run on a storage, one of the dtype set_ asks for (a float value
    viewed as int32 beside it): it was refused where the first found had another dtype."""
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        bits = y.view(torch.int32)
        return torch.empty(0, dtype=torch.int32).set_(y.untyped_storage()) + bits

    x = torch.randn(4)
    torch.testing.assert_close(flowexec.compile(f, mode="trace")(x), f(x))
