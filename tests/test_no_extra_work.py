"""A captured step runs what eager runs (issue 36, "no extra work").

Library code branches on ``torch.compiler.is_compiling()``: optimizers need it to keep step
counts on the device, while a model library (Hugging Face's masking, GQA) takes a different,
costlier path under it — an explicit mask and repeated keys where eager passes ``is_causal`` to
one attention kernel. Capture tells libraries they are compiled only inside optimizer steps,
and everywhere only when the model reads a tensor on the host without it.
"""
from __future__ import annotations

import collections
from typing import Any
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import flowexec
import flowexec.capture
import flowexec.executable
import flowexec.parking
from flowexec.capture import HostReadError, capture
from helpers import zero_first_step

# Ops that launch no kernel (profiler markers, which capture drops, among them), or that make_fx
# writes in place of eager's (a constant is copied where eager lifts a fresh tensor).
_NOT_WORK = {"aten.detach.default", "<built-in function getitem>", "aten.lift_fresh_copy.default",
             "aten.lift_fresh.default", "profiler._record_function_enter_new.default",
             "profiler._record_function_exit._RecordFunction"}


class _LibraryAttention(torch.nn.Module):
    """Causal attention written as Hugging Face's sdpa path is: an explicit boolean mask when
    compiling, ``is_causal`` otherwise; and (``host_read``) a padding mask dropped after a host
    check ``torch.all(mask)`` that only the compiled path skips."""

    def __init__(self, host_read: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)
        self.host_read = host_read

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.host_read and pad is not None and not torch.compiler.is_compiling() and bool(pad.all()):
            pad = None  # nothing padded: the mask can go (a host read, as HF's _ignore_causal_mask_sdpa)
        if torch.compiler.is_compiling() or pad is not None:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            if pad is not None:
                mask = mask & pad[:, None, None, :]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, 16))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _masked_step(m: torch.nn.Module, o: torch.optim.Optimizer):
    """A training step of ``m`` on (x, padding mask) with ``o``."""
    def step(x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        o.zero_grad()
        loss = m(x, pad).square().mean()
        loss.backward()
        o.step()
        return loss.detach()
    return step


def _work(ops: collections.Counter[str]) -> dict[str, int]:
    return {k: n for k, n in sorted(ops.items()) if k not in _NOT_WORK}


def _eager_and_captured_ops(model: torch.nn.Module) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """The ops of a forward and backward of ``model``: (eager's, the captured program's)."""
    x = torch.randn(2, 6, 16)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    step(x)  # gradients exist, as on every step after the first
    with _Count() as eager:
        step(x)
    prog = capture(step, (x,)).program
    return eager.ops, collections.Counter(op.name for op in prog.ops)


def test_a_captured_forward_and_backward_runs_the_ops_eager_runs() -> None:
    eager, captured = _eager_and_captured_ops(_LibraryAttention())
    assert _work(captured) == _work(eager)
    assert not any("tril" in name or "logical_and" in name for name in captured)


def test_a_model_that_reads_a_mask_on_the_host_is_captured_on_the_compiled_path_and_matches_eager() -> None:
    model, ref = _LibraryAttention(host_read=True), _LibraryAttention(host_read=True)
    # (SGD: the keys' bias gets a zero gradient up to rounding, which Adam would turn into full steps)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(2, 6, 16, generator=g), torch.ones(2, 6, dtype=torch.bool)) for _ in range(4)]

    exe = flowexec.compile(_masked_step(model, opt))
    eager = _masked_step(ref, ref_opt)
    for x, pad in data:
        torch.testing.assert_close(exe(x, pad), eager(x, pad), rtol=1e-5, atol=1e-6)
    names = [op.name for op in exe.program.ops]  # the program captured (after the eager first call)
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in names or any("attention" in n for n in names)
    assert any("tril" in n for n in names), "captured on the compiled path: the explicit mask"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_whole_step_with_fused_adamw_runs_eagers_ops_and_one_cast_of_the_fed_lr() -> None:
    """The benchmarks' step (fused AdamW) as flowexec.compile captures it: eager's ops, except
    that the lr is a fed tensor (a schedule changes it without a new capture), which the fused
    kernel takes as float32 — one 1-element cast a step."""
    model = _LibraryAttention()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    x = torch.randn(2, 6, 16)
    step = zero_first_step(model, opt)
    exe = flowexec.compile(step)
    exe(x)  # eager (the optimizer's state is made), then captured
    exe(x)
    with _Count() as eager:
        step(x)
    captured = collections.Counter(op.name for op in exe.program.ops)
    want = _work(eager.ops)
    want["aten._fused_adamw_.tensor_lr"] = want.pop("aten._fused_adamw_.default")
    want["aten._to_copy.default"] = want.get("aten._to_copy.default", 0) + 1
    assert _work(captured) == want


def test_a_host_read_under_an_autocast_decorated_forward_is_the_models_and_is_captured_again() -> None:
    """A forward decorated with ``torch.autocast`` (or ``torch.amp.custom_fwd``) runs below a
    frame of torch/amp: its host read is still the model's, so the capture is traced again with
    the flag set (not refused as an optimizer's or GradScaler's read)."""

    class Decorated(_LibraryAttention):
        @torch.autocast("cpu", enabled=False)
        def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
            return super().forward(x, pad)

    model, ref = Decorated(host_read=True), Decorated(host_read=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    exe, eager = flowexec.compile(_masked_step(model, opt)), _masked_step(ref, ref_opt)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, pad = torch.randn(2, 6, 16, generator=g), torch.ones(2, 6, dtype=torch.bool)
        torch.testing.assert_close(exe(x, pad), eager(x, pad), rtol=1e-5, atol=1e-6)
    assert any("tril" in op.name for op in exe.program.ops)


def test_torch_optims_functional_api_outside_optimizer_step_matches_eager() -> None:
    """torch.optim.adam.adam called directly (as torch.distributed's functional optimizers do):
    no Optimizer.step hook sets the compiling flag, so its step counts are read on the host; the
    capture is traced again with the flag set throughout and keeps them on the device."""
    from torch.optim.adam import adam

    def make():
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 4)
        params = list(m.parameters())
        moments = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        steps = [torch.zeros(()) for _ in params]

        def step(x: torch.Tensor) -> torch.Tensor:
            for p in params:
                p.grad = None
            loss = m(x).square().mean()
            loss.backward()
            with torch.no_grad():
                adam(params, [p.grad for p in params], *moments, [], steps, foreach=True, amsgrad=False,
                     beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.0, eps=1e-8, maximize=False)
            return loss.detach()
        return m, step

    (model, step), (ref, ref_step) = make(), make()
    exe = flowexec.compile(step)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(4):
        torch.testing.assert_close(exe(x), ref_step(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-5, atol=1e-6)


class _Events(TorchDispatchMode):
    """Appends each matrix product's name to ``log`` (the forward's first marks its start)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            self.log.append("matmul")
        return func(*args, **(kwargs or {}))


def test_a_gradient_zero_grad_drops_is_freed_before_the_forward_and_is_no_input() -> None:
    """zero_grad(set_to_none=True) at the top of the step frees last step's gradients before the
    forward in eager; a captured step neither takes them as inputs (graph mode would copy each
    into a buffer of its own) nor holds them through its run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    step, ref_step = zero_first_step(model, opt, F.cross_entropy), zero_first_step(ref, ref_opt, F.cross_entropy)
    exe = flowexec.compile(step)
    for _ in range(3):  # eager first (momentum buffers), then captured with .grad set
        loss, ref_loss = exe(x, y), ref_step(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert len(exe.program.inputs) == 2  # x and y: no gradient
    log: list[str] = []
    weakref.finalize(model[0].weight.grad, log.append, "old gradient freed")
    with _Events(log):
        exe(x, y)
    assert log.index("old gradient freed") < log.index("matmul"), log
    ref_step(x, y)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_gradients_a_step_accumulates_into_stay_inputs() -> None:
    """Without zero_grad in the step, the program reads last call's gradients: they stay inputs."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)

    def accumulate(x):
        loss = model(x).square().mean()
        loss.backward()
        return loss

    model(x).sum().backward()
    exe = flowexec.compile(accumulate)
    exe(x)
    assert len(exe.program.inputs) == 1 + 2  # x, then weight.grad and bias.grad


class _GradBytes(TorchDispatchMode):
    """Writes the storage bytes of some parameters' gradients of now (-1: freed) at each matrix
    product into a text sink (one the capture's recorder does not take for state fn reads)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.refs = [weakref.ref(p.grad) for p in params]  # (weak: a holder is not parked)
        self.out = io.StringIO()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            self.out.write(repr([-1 if r() is None else r().untyped_storage().nbytes() for r in self.refs]) + "\n")
        return func(*args, **(kwargs or {}))


def _sgd_pair() -> tuple[torch.nn.Module, Any, Any, torch.Tensor, torch.Tensor]:
    """A model with a zero_grad-first SGD step, its eager twin's step, and a batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    step = zero_first_step(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), F.cross_entropy)
    ref_step = zero_first_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), F.cross_entropy)
    return model, step, ref_step, torch.randn(32, 8), torch.randint(0, 4, (32,))


def test_capture_parks_last_steps_gradients_off_the_device_until_the_run_reads_them(monkeypatch) -> None:
    """Capture runs the step while last step's gradients are its inputs; eager's zero_grad has
    freed them by the forward. Capture parks them in host memory (on CPU parking saves nothing,
    so here it is forced on); the step equals eager's."""
    monkeypatch.setattr(flowexec.parking, "on_a_device", lambda t: True)
    monkeypatch.setattr(flowexec.capture, "_FAKE_CAPTURE", False)  # (a fake capture holds no activations: it parks nothing)
    model, step, ref_step, x, y = _sgd_pair()
    exe = flowexec.compile(step)
    torch.testing.assert_close(exe(x, y), ref_step(x, y))  # eager: momentum buffers, gradients
    probe = _GradBytes(list(model.parameters()))
    with probe:
        torch.testing.assert_close(exe(x, y), ref_step(x, y), rtol=1e-5, atol=1e-6)  # captured here
    assert probe.out.getvalue().splitlines()[0] == "[0, 0, 0, 0]"  # the forward's first matmul
    for _ in range(3):
        torch.testing.assert_close(exe(x, y), ref_step(x, y), rtol=1e-5, atol=1e-6)


def test_the_gradients_a_new_program_discards_stay_parked_through_planning_and_go_with_zero_grad(monkeypatch) -> None:
    """After capture the step's old gradients wait in host memory while the program is planned
    (kernel timings, graph mode's warm-up and capture) and go with the run's zero_grad. One
    that something else holds (here the test) is never parked: parking moves memory, and the
    holder may rely on its address (a CUDA graph writing its outputs there). compile_for, which
    takes no step, gives back what it parked."""
    monkeypatch.setattr(flowexec.parking, "on_a_device", lambda t: True)
    monkeypatch.setattr(flowexec.capture, "_FAKE_CAPTURE", False)  # (a fake capture holds no activations: it parks nothing)
    model, step, ref_step, x, y = _sgd_pair()
    exe = flowexec.compile(step)
    torch.testing.assert_close(exe(x, y), ref_step(x, y))  # eager: momentum buffers, gradients
    seen: list[list[int]] = []
    plan_for = flowexec.executable.plan_for

    def planning(prog, *a, **kw):
        seen.append([p.grad.untyped_storage().nbytes() for p in model.parameters()])
        return plan_for(prog, *a, **kw)

    monkeypatch.setattr(flowexec.executable, "plan_for", planning)
    held = model[0].weight.grad
    values, where = held.clone(), held.data_ptr()
    log: list[str] = []
    weakref.finalize(model[2].weight.grad, log.append, "freed")
    torch.testing.assert_close(exe(x, y), ref_step(x, y), rtol=1e-5, atol=1e-6)  # captured and run
    assert seen == [[512, 0, 0, 0]] and log == ["freed"]
    assert held.data_ptr() == where and torch.equal(held, values)  # the holder's, untouched
    del held
    exe2 = flowexec.compile(step)
    refs = [weakref.ref(p.grad) for p in model.parameters()]
    values = [p.grad.clone() for p in model.parameters()]
    exe2.compile_for(x, y)
    assert len(seen) == 2 and seen[1] == [0, 0, 0, 0]
    assert all(p.grad is r() for p, r in zip(model.parameters(), refs))
    assert all(torch.equal(p.grad, v) for p, v in zip(model.parameters(), values))


def test_a_call_that_raises_after_capture_gives_its_parked_gradients_back(monkeypatch) -> None:
    """A capture's call that fails after the build (here its RecaptureWarning made an error, as
    pytest's filterwarnings=error does) takes no step: the gradients parked for its run come
    back with their values, and stay back when the executable is dropped."""
    import gc
    import warnings

    monkeypatch.setattr(flowexec.parking, "on_a_device", lambda t: True)
    monkeypatch.setattr(flowexec.capture, "_FAKE_CAPTURE", False)  # (a fake capture holds no activations: it parks nothing)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    exe = flowexec.compile(zero_first_step(model, opt, F.cross_entropy))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    exe(x, y), exe(x, y)  # eager (lazy state), then captured
    values = [p.grad.clone() for p in model.parameters()]
    opt.param_groups[0]["betas"] = (0.85, 0.999)  # captured again, on the foreach path
    with warnings.catch_warnings():
        warnings.simplefilter("error", flowexec.RecaptureWarning)
        with pytest.raises(flowexec.RecaptureWarning):
            exe(x, y)
    del exe
    gc.collect()
    for p, v in zip(model.parameters(), values):
        assert p.grad.untyped_storage().nbytes() == v.numel() * 4 and torch.equal(p.grad, v)


def test_a_model_on_the_meta_device_is_captured_without_parking() -> None:
    """Meta tensors have no bytes to park (nor to copy to the host)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def accumulate(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()

    exe = flowexec.compile(accumulate)
    for _ in range(3):
        assert exe(x, y).device.type == "meta"
    assert len(exe.program.inputs) == 2 + 4  # x, y, then the four gradients it adds to


def test_a_gradient_at_an_address_a_graph_writes_is_not_parked(monkeypatch) -> None:
    """A CUDA graph's static outputs (marked stable) keep their address: capture leaves them
    where they are, and the step still equals eager's."""
    from flowexec.storage import mark_stable

    monkeypatch.setattr(flowexec.parking, "on_a_device", lambda t: True)
    monkeypatch.setattr(flowexec.capture, "_FAKE_CAPTURE", False)  # (a fake capture holds no activations: it parks nothing)
    model, step, ref_step, x, y = _sgd_pair()
    exe = flowexec.compile(step)
    torch.testing.assert_close(exe(x, y), ref_step(x, y))
    mark_stable(model[2].bias.grad)
    probe = _GradBytes(list(model.parameters()))
    with probe:
        torch.testing.assert_close(exe(x, y), ref_step(x, y), rtol=1e-5, atol=1e-6)
    assert probe.out.getvalue().splitlines()[0] == "[0, 0, 0, 16]"


def test_a_parked_gradient_the_step_accumulates_into_comes_back_before_it_is_read(monkeypatch) -> None:
    """Without zero_grad the step adds to last step's gradients and clips them: each comes back
    from host memory at the first op that reads it, and the step equals eager's."""
    monkeypatch.setattr(flowexec.parking, "on_a_device", lambda t: True)
    monkeypatch.setattr(flowexec.capture, "_FAKE_CAPTURE", False)  # (a fake capture holds no activations: it parks nothing)
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(16, 8)

    def make(m: torch.nn.Module):
        def accumulate(x):
            loss = m(x).square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            return loss
        return accumulate

    exe, eager = flowexec.compile(make(model)), make(ref)
    torch.testing.assert_close(exe(x), eager(x))  # a program that makes the gradients
    probe = _GradBytes(list(model.parameters()))
    with probe:  # one that adds to them: captured with them parked
        torch.testing.assert_close(exe(x), eager(x))
    assert probe.out.getvalue().splitlines()[0] == "[0, 0]"
    for _ in range(3):
        torch.testing.assert_close(exe(x), eager(x))
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert len(exe.program.inputs) == 1 + 2  # x, then the two gradients it reads


class _PackedCheck(torch.nn.Module):
    """Hugging Face's packed-sequence check (masking_utils.find_packed_sequence_indices): a host
    read of positions made by ``arange`` (many elements), then ``is_causal`` where it passes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = _LibraryAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        packed = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        if not torch.compiler.is_compiling() and (packed[:, -1] == 0).all():
            return self.inner(x)
        return self.inner(x, torch.ones(x.shape[:2], dtype=torch.bool))  # (the packed path: a mask)


def test_a_host_read_of_values_made_from_constants_is_answered_as_in_eager() -> None:
    """A read of a tensor made from constants alone has every call's value: capture answers it
    and stays on eager's path (no explicit mask), where a retry under the compiling flag would
    take the compiled one."""
    eager, captured = _eager_and_captured_ops(_PackedCheck())
    assert not any("tril" in n for n in captured), "took the compiled path"
    want = {k: n for k, n in _work(eager).items() if k not in (  # the check itself is answered, not run
        "aten.arange.default", "aten.unsqueeze.default", "aten.sub.Tensor", "aten.cat.default", "aten.ne.Scalar",
        "aten.cumsum.default", "aten.select.int", "aten.eq.Scalar", "aten.all.default", "aten._local_scalar_dense.default",
        "aten.slice.Tensor")}
    got = {k: n for k, n in _work(captured).items() if k in want}
    assert got == want


def test_a_host_read_of_a_random_draw_is_refused_not_baked() -> None:
    """A random draw reads no tensor, yet differs per call: reading it on the host cannot be
    answered once for good."""
    lin = torch.nn.Linear(4, 4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = lin(x)
        return y * 2 if bool(torch.rand(8).sum() > 4) else y

    with pytest.raises(HostReadError):
        capture(fn, (torch.randn(3, 4),))


class _Output(dict):
    """A model's output record as Hugging Face's ModelOutput is: a dict with attribute access."""

    def __getattr__(self, name: str) -> torch.Tensor:
        return self[name]

    def total(self) -> torch.Tensor:
        return self["a"] + self["b"]


def test_an_output_record_a_step_makes_is_not_kept_as_guarded_state() -> None:
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        y = lin(x)
        out = _Output(a=y.sin(), b=y.cos())
        loss = out.total().square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    exe = flowexec.compile(step)
    x = torch.randn(3, 4)
    for _ in range(3):
        exe(x)
    assert exe.build_seconds is not None  # captured, not refused as tensors left in Python state


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.2),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
], ids=["sgd", "sgd_momentum_wd", "adamw_foreach"])
def test_a_whole_step_runs_no_op_whose_result_nothing_uses(make_opt) -> None:
    """The host reads an optimizer makes of its lifted hyperparameters (``lr != 0``) are answered
    from their numbers; the comparisons they traced (and a fake capture's constants before them)
    are not run per step: every op of the program is read by a later op, returned or writes
    state."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    exe, ref_step = zero_first_step(model, make_opt(model.parameters())), zero_first_step(ref, make_opt(ref.parameters()))
    exe = flowexec.compile(exe)
    for _ in range(3):
        x = torch.randn(5, 8)
        torch.testing.assert_close(exe(x), ref_step(x), rtol=1e-5, atol=1e-6)
    prog = exe.program
    read = {r for op in prog.ops for r in op.refs()} | {o.id for o in prog.outputs if isinstance(o, flowexec.program.Ref)}
    for op in prog.ops:
        outs = [o for o in op.outputs if o >= 0]
        writes = flowexec.program.written_args(op.target) if hasattr(op.target, "_schema") else ()
        assert writes or not outs or any(o in read for o in outs), f"{op.name}: nothing uses its result"
    assert "aten.ne.Scalar" not in {op.name for op in prog.ops}


def _dropped(fn, *args) -> list[str]:
    from flowexec.passes.dead_code import drop_dead_ops

    prog = capture(fn, args).program
    kept = {id(op.target) for op in drop_dead_ops(prog).ops}
    return [op.name for op in prog.ops if id(op.target) not in kept]


def test_dropping_unused_ops_keeps_writes_others_see_random_draws_and_assertions() -> None:
    def unused_sum(x):
        x.sum()
        return x * 2

    def write_to_input(x):
        x.add_(1)  # its result unused; the caller's x changes
        return x.sum()

    def write_through_a_view_read_later(x):
        t = x * 2
        v = t.view(-1)
        t.add_(1)  # v, returned, sees it
        return v

    def unused_draw(x):
        torch.rand(3)  # advances the generator: the next draw depends on it
        return x + torch.rand(3)

    assert _dropped(unused_sum, torch.ones(3)) == ["aten.sum.default"]
    assert _dropped(write_to_input, torch.ones(3)) == []
    assert _dropped(write_through_a_view_read_later, torch.ones(3)) == []
    assert "aten.rand.default" not in _dropped(unused_draw, torch.ones(3))
    x = torch.ones(3)
    torch.testing.assert_close(flowexec.compile(write_through_a_view_read_later)(x), (x * 2 + 1).view(-1))


def test_a_write_through_a_view_of_a_parked_gradient_is_undone_wherever_it_comes_back(monkeypatch):
    """A real capture parks last step's gradients (here all of them, as CUDA's would be) and
    brings one back, at a new address, when an op reads it: often an address a temporary of the
    run had just freed. The capture took a view of that gradient for memory of the run's own and
    left a write through it in place: the first call then applied it twice."""
    monkeypatch.setattr(flowexec.capture, "_FAKE_CAPTURE", False)  # (a fake capture parks nothing)
    for trial in range(20):
        m = torch.nn.Linear(256, 1, bias=False)
        m.weight.grad = torch.ones(1, 256)

        def step(x):
            t = x * 2  # a temporary, freed before the gradient comes back
            s = t.sum()
            del t
            m.weight.grad.view(-1).mul_(2)
            return s

        capture(step, [torch.randn(256)], guarded=True, park=lambda g: True)
        assert torch.equal(m.weight.grad, torch.ones(1, 256)), trial
