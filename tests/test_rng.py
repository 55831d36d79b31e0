"""The random generator's state inside a program (flowexec/rng.py): torch.utils.checkpoint's
recompute draws the masks the forward drew, as in eager; random ops on worker threads draw in
their captured order."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

import flowexec
from flowexec.capture import capture
from helpers import assert_same_state, assert_seeded_calls_match, twin


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 16)) for _ in range(2))
        self.out = torch.nn.Linear(16, 5)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + ckpt.checkpoint(b, x, use_reentrant=self.reentrant)
        return self.out(x)


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


@pytest.mark.timeout(240)
@pytest.mark.parametrize("options", [dict(mode="trace"), dict(mode="threaded", streams=2),
                                     dict(mode="trace", fuse="inductor")], ids=["trace", "threaded", "fused"])
def test_checkpointed_dropout_recomputes_the_forward_s_masks(options: dict) -> None:
    """Without the generator's state in the program, the recompute drew fresh masks each call:
    the parameters drifted ~4e-2 from eager in 4 steps, with equal losses."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(Checkpointed(reentrant=False), lambda p: torch.optim.AdamW(p, lr=1e-2))
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    assert_seeded_calls_match(_step(m1, o1), flowexec.compile(_step(m2, o2), **options), x, y)
    assert_same_state(m1, m2)


def test_the_program_holds_the_state_ops_in_captured_order_with_the_draws() -> None:
    torch.manual_seed(0)
    m = Checkpointed(reentrant=False)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))

    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss.detach()

    prog = capture(fn, (x, y)).program
    kinds = [op.name.split(".")[1] for op in prog.ops
             if torch.Tag.nondeterministic_seeded in getattr(op.target, "tags", ())]
    # each block: state saved, its forward's draw; in the backward (blocks in reverse): state
    # saved (fork_rng), restored, the recompute's draw, the later state put back
    assert kinds == ["get_rng_state", "bernoulli_"] * 2 + ["get_rng_state", "set_rng_state", "bernoulli_",
                                                            "set_rng_state"] * 2


def test_outside_a_capture_the_torch_functions_are_torch_s() -> None:
    capture(lambda x: x * 2, (torch.ones(2),))  # (installs the routing)
    state = torch.get_rng_state()
    a = torch.rand(3)
    torch.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    assert type(torch.get_rng_state()) is torch.Tensor and state.dtype == torch.uint8


@pytest.mark.timeout(120)
def test_random_ops_on_worker_threads_draw_in_captured_order() -> None:
    """Two dropouts on parallel branches, one per worker thread, drew in whichever order the
    threads reached them."""
    w1, w2 = torch.randn(64, 64), torch.randn(64, 64)

    def fn(x: torch.Tensor) -> torch.Tensor:
        a = F.dropout(torch.tanh(x @ w1) @ w1, 0.5)
        b = F.dropout(torch.sigmoid(x @ w2) @ w2, 0.5)
        return a * 2 + b

    x = torch.randn(64, 64)
    exe = flowexec.compile(fn, x, mode="threaded", streams=2)
    assert exe.plan.n_streams == 2
    assert_seeded_calls_match(fn, exe, x, calls=8)


def test_seeding_inside_fn_seeds_every_call_as_eager_does() -> None:
    """``torch.manual_seed`` in fn (a step seeding its augmentation) was not seen: every call
    after the first drew on from where the last one stopped."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(7)
        return x + F.dropout(torch.ones(16), 0.5)

    exe = flowexec.compile(fn, torch.zeros(16))
    want = fn(torch.zeros(16))
    for _ in range(3):
        torch.rand(5)  # (the generator moves between calls)
        torch.testing.assert_close(exe(torch.zeros(16)), want)
    assert "flowexec.manual_seed.default(7)" in str(exe.program)
    assert torch.manual_seed(3) is torch.default_generator  # (outside a capture: torch's own)


# torch 2.11's make_fx takes no torch.Generator argument (``torch.rand(3, generator=g)``): such a
# step is refused there, naming the line.
_NO_GENERATOR_ARGUMENTS = torch.__version__ < (2, 13)


def test_a_generator_of_fn_s_own_is_not_moved_by_the_capture() -> None:
    """The capture's run drew from it and left it moved: every compiled call drew one call ahead of
    eager (the default generators were put back, this one was not)."""
    g = torch.Generator().manual_seed(5)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(3, generator=g)

    want = [fn(torch.zeros(3)) for _ in range(3)]
    g.manual_seed(5)
    if _NO_GENERATOR_ARGUMENTS:
        with pytest.raises(flowexec.CaptureError, match="argument of type.*Generator.*test_rng.py"):
            flowexec.compile(fn, torch.zeros(3))
        return
    exe = flowexec.compile(fn, torch.zeros(3))
    torch.testing.assert_close(torch.stack([exe(torch.zeros(3)) for _ in range(3)]), torch.stack(want))


def test_seeding_a_generator_of_fn_s_own_between_its_draws_is_refused() -> None:
    g = torch.Generator().manual_seed(5)

    def fn(x: torch.Tensor) -> torch.Tensor:
        a = torch.rand(3, generator=g)
        g.manual_seed(1)  # a method of a C type: no compiled call would repeat it
        return x + a + torch.rand(3, generator=g)

    refused = "argument of type.*Generator" if _NO_GENERATOR_ARGUMENTS else "seeds or sets the state of a torch.Generator"
    with pytest.raises(flowexec.CaptureError, match=refused):
        flowexec.compile(fn, torch.zeros(3))


@pytest.mark.timeout(300)
def test_fusion_keeps_the_captured_order_of_draws_and_generator_state() -> None:
    """The fusion pass placed regions by data dependencies alone: under bf16 autocast a
    checkpoint's recompute drew the forward's mask of the next block before that block's forward
    did (parameters 6x further from float32 eager than eager's own bf16 run)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(20, 16), Checkpointed(reentrant=False))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x, y = torch.randint(0, 20, (4, 12)), torch.randint(0, 5, (4, 12))

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    exe = flowexec.compile(step, mode="trace", fuse="inductor")
    exe(x)
    exe(x)  # (the first call makes AdamW's state)
    kinds = [op.name.split(".")[1] for op in exe.plan.program.ops
             if torch.Tag.nondeterministic_seeded in getattr(op.target, "tags", ())]
    assert exe.plan.stats()["fused_regions"] > 0
    assert kinds == ["get_rng_state", "bernoulli_"] * 2 + ["get_rng_state", "set_rng_state", "bernoulli_",
                                                            "set_rng_state"] * 2


@pytest.mark.timeout(240)
def test_checkpointed_dropout_through_the_backend_draws_eager_s_masks() -> None:
    """AOTAutograd hands a checkpointed draw over as ``run_and_save_rng_state`` and its recompute
    as ``run_with_rng_state``, which the backend refused; they become the generator-state ops."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(Checkpointed(reentrant=False), lambda p: torch.optim.AdamW(p, lr=1e-2))
    compiled = torch.compile(m2, backend="flowexec", options={"mode": "trace"})
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))

    assert_seeded_calls_match(_step(m1, o1), _step(compiled, o2), x, y)
    assert_same_state(m1, m2)


def test_a_build_draws_nothing_from_the_generators_fn_draws_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's rewrites time kernels on random operands (padding, on CUDA) and compile with
    Inductor: none of that may move the default generator, or fn's next dropout draws other
    masks than eager's (BERT and T5 in graph mode on CUDA, 2026-12-06). Here a rewrite that
    draws stands for them, as the padding pass's timing does on a GPU."""
    import flowexec.build as build
    from flowexec.fusion import _operands
    from flowexec.passes.pad import PadCase

    pad_for = build.pad_for

    def drawing_pad_for(prog, pad):
        torch.randn(64)
        return pad_for(prog, pad)

    monkeypatch.setattr(build, "pad_for", drawing_pad_for)
    drop = torch.nn.Dropout(0.5)
    fn = lambda x: drop(x) * 2  # noqa: E731
    exe = flowexec.compile(fn)
    torch.manual_seed(0)
    got = [exe(torch.ones(64)) for _ in range(3)]
    torch.manual_seed(0)
    want = [fn(torch.ones(64)) for _ in range(3)]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # the padding pass's own operands come from a generator of their own
    before = torch.random.get_rng_state()
    _operands(PadCase("mm", 0, 5, 3, 7, torch.float32, torch.device("cpu"), (8, 8, 8), False, True))
    assert torch.equal(torch.random.get_rng_state(), before)


class _LayerDrop(torch.nn.Module):
    """LayerDrop as Hugging Face's BART and OPT wrote it (transformers 5.17): one draw per layer
    in training, the layer skipped where the draw falls below ``layerdrop``."""

    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.drop = torch.nn.Dropout(0.2)
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                p = torch.rand([])
                if p < self.layerdrop:  # skip the layer
                    continue
            x = self.drop(torch.tanh(layer(x)))
        return x


@pytest.mark.parametrize("layerdrop", [0.0, 1.5])
def test_a_draw_compared_with_a_bound_it_cannot_cross_is_answered(layerdrop: float) -> None:
    """``torch.rand([]) < 0.0`` is False at every call (and ``< 1.5`` True): the host read is
    answered, the draws stay in the program (the dropout after them draws eager's masks, seeded
    once), and the model trains as eager does. Refused as data-dependent before 2026-12-06."""
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(_LayerDrop(layerdrop), lambda p: torch.optim.AdamW(p, lr=1e-2))

    def make(m, o):
        def step(x):
            o.zero_grad()
            # (a term that needs no layer: at 1.5 every layer is skipped)
            loss = m(x).square().mean() + m.layers[0].bias.square().sum()
            loss.backward()
            o.step()
            return loss
        return step
    eager, exe = make(m1, o1), flowexec.compile(make(m2, o2))
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    want = [eager(x).item() for _ in range(4)] + [torch.rand(3)]
    torch.manual_seed(1)
    got = [exe(x).item() for _ in range(4)] + [torch.rand(3)]
    assert got[:4] == pytest.approx(want[:4], rel=1e-5) and torch.equal(got[4], want[4])
    assert_same_state(m1, m2)


def test_a_draw_a_bound_does_not_settle_is_still_refused() -> None:
    """A layerdrop that a draw can fall below, set between calls: captured again and refused
    (the guard on ``layerdrop`` holds the settled answer's premise); a draw written in place
    (``r.mul_(-1)``) is no longer known to lie in [0, 1]."""
    m = _LayerDrop(0.0)
    exe = flowexec.compile(lambda x: m(x).sum())
    exe(torch.randn(2, 8))
    m.layerdrop = 0.5
    with pytest.warns(flowexec.RecaptureWarning), pytest.raises(flowexec.CaptureError, match="host"):
        exe(torch.randn(2, 8))

    def flipped(x):
        r = torch.rand([])
        r.mul_(-1)
        return x * 2 if r < 0.0 else x

    with pytest.raises(flowexec.CaptureError, match="host"):
        flowexec.compile(flipped)(torch.randn(3))


def test_attention_backwards_that_read_saved_seeds_by_capture_status_are_wrapped() -> None:
    """Every ATen op that takes a forward's saved dropout seeds, and how flowexec hands them
    over (runtime/seeds.py): a new one fails this table until someone reads its kernel."""
    from flowexec.runtime.interpreter import callable_of

    table = {}
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        for overload in getattr(packet, "overloads", lambda: [])():
            op = getattr(packet, overload)
            if "philox_seed" in [a.name for a in op._schema.arguments]:
                table[str(op)] = "0-dim seeds by capture status" if callable_of(op) is not op._op else "as they are"
    known = {
        "aten._efficient_attention_backward.default": "0-dim seeds by capture status",
        "aten._scaled_dot_product_cudnn_attention_backward.default": "as they are",
        "aten._scaled_dot_product_efficient_attention_backward.default": "0-dim seeds by capture status",
        # (on CUDA its seed is a two-element device rng_state the wrapper leaves alone; ROCm's is 0-dim)
        "aten._scaled_dot_product_flash_attention_backward.default": "0-dim seeds by capture status",
        "aten._scaled_dot_product_fused_attention_overrideable_backward.default": "as they are",  # (2.13's, not 2.11's)
    }
    assert table == {op: how for op, how in known.items() if op in table or how != "as they are"}


def _efficient_backward_seen(monkeypatch: Any, capturing: bool) -> tuple[Any, list[Any], list[Any]]:
    """The efficient attention backward's seed wrapper around a recorder, with a stand-in
    device copy (``_to_host``) and capture status: (the wrapped call, the calls it made, the
    seeds copied)."""
    import flowexec.runtime.seeds as seeds

    copied: list[Any] = []

    def to_host(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        copied.append((seed, offset))
        return torch.tensor(7), torch.tensor(9)

    monkeypatch.setattr(seeds, "_to_host", to_host)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    seen: list[Any] = []
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    return seeds.with_seeds_for_capture(op, lambda *a, **k: seen.append((a, k))), seen, copied


def _device_scalar(shape: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.long, device="meta")  # (a scalar off the host, as a graph's are)


def test_device_seeds_outside_a_capture_are_read_back_to_the_host(monkeypatch) -> None:
    """Outside a capture the kernel dereferences the seeds on the host: a forward graph's device
    scalars are copied back first (T5's crash through the backend in graph mode), by position or
    by name; host seeds, no dropout, and a two-element device rng_state go through untouched."""
    call, seen, copied = _efficient_backward_seen(monkeypatch, capturing=False)
    head = [None] * 7
    call(*head, _device_scalar(), _device_scalar(), 0.1, [True] * 4)
    call(*head, philox_seed=_device_scalar(), philox_offset=_device_scalar(), dropout_p=0.1,
         grad_input_mask=[True] * 4)
    assert len(copied) == 2
    assert [int(x) for x in seen[0][0][7:9]] == [7, 9]
    assert [int(seen[1][1][n]) for n in ("philox_seed", "philox_offset")] == [7, 9]
    host, off = torch.tensor(1), torch.tensor(2)
    call(*head, host, off, 0.1, [True] * 4)
    unused = _device_scalar()
    call(*head, unused, _device_scalar(), 0.0, [True] * 4)
    rng_state = _device_scalar((2,))
    call(*head, rng_state, _device_scalar(), 0.1, [True] * 4)
    assert len(copied) == 2
    assert seen[2][0][7] is host and seen[3][0][7] is unused and seen[4][0][7] is rng_state


def test_host_seeds_inside_a_capture_refuse_it(monkeypatch) -> None:
    """Inside a capture the kernel reads the seeds' device memory at each replay: host seeds
    (a forward that ran outside a graph) refuse the capture, which graph mode takes as CUDA's
    refusal (the whole step, or the backend's graph, then runs in trace mode)."""
    from flowexec.errors import ExecutionError
    from flowexec.runtime.cuda_graph import graph_capture_failed
    from flowexec.runtime.seeds import SeedsOnHost

    call, seen, copied = _efficient_backward_seen(monkeypatch, capturing=True)
    head = [None] * 7
    for how in ("position", "name"):
        with pytest.raises(SeedsOnHost) as refused:
            if how == "position":
                call(*head, torch.tensor(1), torch.tensor(2), 0.1, [True] * 4)
            else:
                call(*head, philox_seed=torch.tensor(1), philox_offset=torch.tensor(2), dropout_p=0.1,
                     grad_input_mask=[True] * 4)
        wrapped = ExecutionError("While executing op #3 (in fn at /home/u/no_capture_here.py:2): the op failed")
        wrapped.__cause__ = refused.value
        assert graph_capture_failed(refused.value) and graph_capture_failed(wrapped)
    device = _device_scalar()
    call(*head, device, _device_scalar(), 0.1, [True] * 4)
    assert seen[0][0][7] is device and not copied
    # (an op's failure whose own message mentions capture but whose cause does not is no refusal)
    oom = ExecutionError("While executing op #3 (at /home/u/capture_utils.py:2): CUDA out of memory")
    oom.__cause__ = RuntimeError("CUDA out of memory")
    assert not graph_capture_failed(oom)


def test_an_attention_backward_without_dropout_is_lowered_unwrapped() -> None:
    """The seeds are read only where the op drops: its constant ``dropout_p`` decides at
    lowering, so a backward without dropout pays nothing per call."""
    from types import SimpleNamespace

    from flowexec.runtime.interpreter import callable_of

    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    record = lambda p, by_name=False: SimpleNamespace(  # noqa: E731
        args=(None,) * 9 + (() if by_name else (p,)), kwargs=(("dropout_p", p),) if by_name else ())
    assert callable_of(op, record(0.0)) is op._op and callable_of(op, record(0.0, by_name=True)) is op._op
    assert callable_of(op, record(0.1)) is not op._op and callable_of(op, record(0.1, by_name=True)) is not op._op
