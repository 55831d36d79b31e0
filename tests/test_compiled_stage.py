"""CompiledRunner (trace mode on CPU) against eager autograd, in arbitrary job orders."""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

from flowexec.errors import CaptureError, InputError, OptionError, RecaptureWarning
from flowexec.pipeline.compiled import CompiledRunner
from helpers import eager_stage_grads, play_jobs as play


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


class TwoWay(torch.nn.Module):
    """Tuple in, tuple out: a residual stream and a side input; one output has no gradient path
    from the params (the side input passed through scaled)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.gelu(self.a(x)) + side
        return self.b(torch.layer_norm(h, (6,))), side * 2


def two_way_setup(order):
    """A seeded TwoWay, its eager twin, the micro-batches ``order`` names, their inputs and
    output grads, and a CompiledRunner of the model."""
    torch.manual_seed(0)
    mod = TwoWay()
    ref_mod = copy.deepcopy(mod)
    micros = sorted({int(j[1:]) for j in order.split()})
    xs = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in micros]
    gs = [(torch.randn(4, 6), torch.randn(4, 6)) for _ in micros]
    return mod, ref_mod, micros, xs, gs, CompiledRunner(mod, example_inputs=xs[0])


@pytest.mark.parametrize("order", ["F0 F1 I1 I0 W0 W1", "F0 B0 F1 F2 I2 B1 W2", "F0 F1 F2 I0 I1 W1 I2 W0 W2"])
def test_jobs_in_any_order_give_eager_gradients(order):
    mod, ref_mod, micros, xs, gs, runner = two_way_setup(order)
    assert runner.mode == "trace" and runner.parameters == list(mod.parameters())
    outs, gins = play(runner, order, xs, gs)
    r_outs, r_gins, r_grads = eager_stage_grads(ref_mod, xs, gs)
    for m in micros:
        for got, want in zip(outs[m], r_outs[m]):
            assert rel_err(got, want) <= 1e-5
        for got, want in zip(gins[m], r_gins[m]):
            assert rel_err(got, want) <= 1e-5
    for p, want in zip(mod.parameters(), r_grads):
        assert rel_err(p.grad, want) <= 1e-5
    assert runner.in_flight == {}


def test_state_between_i_and_w_is_only_what_w_reads():
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 16)
    runner = CompiledRunner(mod, example_inputs=(x,))
    runner.forward(0, (x,))
    after_f = runner.kept_bytes(0)
    runner.backward_input(0, (torch.randn(8, 16),))
    assert runner.in_flight == {0: "I"}
    assert set(runner._micros[0].values) == set(runner.capture.split.w_inputs)
    after_i = runner.kept_bytes(0)
    # F saves x, addmm (the pre-activation) and gelu; W needs x, gelu, the output gradient and
    # gelu_backward's result — not the pre-activation
    assert after_f == (8 * 16 + 8 * 64 + 8 * 64) * 4
    assert after_i == (8 * 16 + 8 * 64 + 8 * 16 + 8 * 64) * 4
    runner.backward_weight(0)
    assert runner.in_flight == {}


def test_last_stage_returns_the_unscaled_loss_and_backpropagates_the_scaled_one():
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh())
    ref = copy.deepcopy(mod)
    loss_fn = torch.nn.functional.mse_loss
    xs = [torch.randn(4, 5) for _ in range(2)]
    ys = [torch.randn(4, 3) for _ in range(2)]
    runner = CompiledRunner(mod, example_inputs=(xs[0],), loss_fn=loss_fn, loss_scale=0.5)
    (l0,) = runner.forward(0, (xs[0],), target=ys[0])
    (l1,) = runner.forward(1, (xs[1],), target=ys[1])
    (g1,) = runner.backward_input(1, None)
    (g0,) = runner.backward(0, None)
    runner.backward_weight(1)
    for m, (loss, gx) in enumerate([(l0, g0), (l1, g1)]):
        xr = xs[m].clone().requires_grad_(True)
        want = loss_fn(ref(xr), ys[m])
        (want * 0.5).backward()
        assert rel_err(loss, want) <= 1e-6 and not loss.requires_grad
        assert rel_err(gx, xr.grad) <= 1e-5
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-5


def test_gradients_add_to_existing_grads_and_none_grad_outputs_count_as_zeros():
    torch.manual_seed(0)
    mod = TwoWay()
    ref = copy.deepcopy(mod)
    for p, q in zip(mod.parameters(), ref.parameters()):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    x = (torch.randn(4, 6), torch.randn(4, 6))
    g = torch.randn(4, 6)
    runner = CompiledRunner(mod, example_inputs=x)
    runner.forward(0, x)
    gx, gside = runner.backward(0, (g, None))
    xr = [t.clone().requires_grad_(True) for t in x]
    ref(*xr)[0].backward(g)
    assert rel_err(gx, xr[0].grad) <= 1e-5 and rel_err(gside, xr[1].grad) <= 1e-5
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-5


def test_first_stage_inputs_get_no_gradient():
    mod = torch.nn.Linear(3, 3)
    runner = CompiledRunner(mod, example_inputs=(torch.randn(2, 3),), input_grads=False)
    runner.forward(0, (torch.randn(2, 3),))
    assert runner.backward_input(0, (torch.ones(2, 3),)) == (None,)
    runner.backward_weight(0)
    assert mod.weight.grad is not None


def test_bfloat16_stage_matches_eager():
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).to(torch.bfloat16)
    ref = copy.deepcopy(mod)
    x, g = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    runner = CompiledRunner(mod, example_inputs=(x,))
    (y,) = runner.forward(0, (x,))
    (gx,) = runner.backward_input(0, (g,))
    runner.backward_weight(0)
    xr = x.clone().requires_grad_(True)
    yr = ref(xr)
    yr.backward(g)
    assert y.dtype == torch.bfloat16 and torch.equal(y, yr.detach())
    assert rel_err(gx, xr.grad) <= 1e-2
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.bfloat16 and rel_err(p.grad, q.grad) <= 1e-2


def test_clear_errors():
    mod = torch.nn.Linear(3, 3)
    runner = CompiledRunner(mod, example_inputs=(torch.randn(2, 3),))
    with pytest.raises(InputError, match=r"input 0 is torch.float32 \[5, 3\].*compiled for torch.float32 \[2, 3\]"):
        runner.forward(0, (torch.randn(5, 3),))
    with pytest.raises(InputError, match="I job of micro-batch 0: its forward has not run"):
        runner.backward_input(0, (torch.ones(2, 3),))
    runner.forward(0, (torch.randn(2, 3),))
    with pytest.raises(InputError, match="micro-batch 0's forward ran already"):
        runner.forward(0, (torch.randn(2, 3),))
    with pytest.raises(InputError, match="W job of micro-batch 0: it follows I, but the last job of that micro-batch was F"):
        runner.backward_weight(0)
    with pytest.raises(InputError, match=r"grad_outputs\[0\] is torch.float32 \[2, 2\]"):
        runner.backward(0, (torch.ones(2, 2),))
    with pytest.raises(InputError, match="needs grad_outputs"):
        runner.backward(0, None)
    with pytest.raises(OptionError, match="mode='graph' replays CUDA graphs"):
        CompiledRunner(mod, example_inputs=(torch.randn(2, 3),), mode="graph")
    with pytest.raises(OptionError, match="mode='eager' is not a run mode"):
        CompiledRunner(mod, example_inputs=(torch.randn(2, 3),), mode="eager")
    with pytest.raises(CaptureError, match="random op"):
        CompiledRunner(torch.nn.Dropout(0.5), example_inputs=(torch.randn(2, 3),))
    last = CompiledRunner(mod, example_inputs=(torch.randn(2, 3),), loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(InputError, match="needs a target"):
        last.forward(0, (torch.randn(2, 3),))


class FakeGraph:
    """Stands in for CudaGraphRunner on CPU to check graph mode's slot logic: its outputs are
    buffers rewritten by every call (as a replay rewrites a graph's), staged inputs are copied
    into buffers of its own, and a borrowed input must come at the address it was captured with."""

    def __init__(self, run, example_inputs, mutated, borrow, state=(), warmup=1, keep_borrowed=True):
        self.run, self.borrow = run, list(borrow)
        self.ptrs = [a.data_ptr() if b else None for a, b in zip(example_inputs, borrow)]
        self.static = [None if b else a.clone() for a, b in zip(example_inputs, borrow)]
        snapshot = [(t, t.clone()) for t in mutated]
        self.outs = [o.clone() for o in run(*[a if b else s for a, b, s in zip(example_inputs, borrow, self.static)])]
        for t, saved in snapshot:  # capture leaves the state as it was, as CudaGraphRunner does
            t.copy_(saved)

    def __call__(self, args):
        for i, (a, b) in enumerate(zip(args, self.borrow)):
            if b:
                assert a.data_ptr() == self.ptrs[i], f"borrowed input {i} is not where the graph read it"
            else:
                self.static[i].copy_(a)
        outs = self.run(*[a if b else s for a, b, s in zip(args, self.borrow, self.static)])
        for buf, o in zip(self.outs, outs):
            buf.copy_(o)
        return list(self.outs)


@pytest.mark.parametrize("order, slots", [("F0 F1 I1 I0 W0 W1", 2), ("F0 F1 F2 I0 B1 W0 F3 I2 I3 W3 W2", 3)])
def test_graph_mode_slots_keep_micro_batches_apart(monkeypatch, order, slots):
    import flowexec.runtime.cuda_graph as cg

    monkeypatch.setattr(cg, "CudaGraphRunner", FakeGraph)
    mod, ref_mod, micros, xs, gs, runner = two_way_setup(order)
    runner.mode = "graph"  # the slot logic, over FakeGraph
    for step in range(2):  # the second step reuses the slots
        for p in mod.parameters():
            p.grad = None
        ref_mod.zero_grad(set_to_none=True)
        outs, gins = {}, {}
        for job in order.split():
            kind, m = job[0], int(job[1:])
            if kind == "F":
                outs[m] = [t.clone() for t in runner.forward(m, xs[m])]  # a slot's buffers are rewritten later
            elif kind in "BI":
                res = (runner.backward if kind == "B" else runner.backward_input)(m, gs[m])
                gins[m] = [t.clone() for t in res]
            else:
                runner.backward_weight(m)
        r_outs, r_gins, r_grads = eager_stage_grads(ref_mod, xs, gs)
        for m in micros:
            for got, want in zip(outs[m] + gins[m], r_outs[m] + r_gins[m]):
                assert rel_err(got, want) <= 1e-5
        for p, want in zip(mod.parameters(), r_grads):
            assert rel_err(p.grad, want) <= 1e-5
    assert runner.graph_slots == slots


class _Scaled(torch.nn.Module):
    """Batch norm (train/eval) and a plain attribute the forward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6, bias=False)
        self.norm = torch.nn.BatchNorm1d(6)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)) / self.temperature)


@pytest.mark.parametrize("change", ["eval", "attribute", "frozen", "autocast"])
def test_a_stage_captures_again_when_a_value_it_read_changes(change):
    """Between steps, each kind of Python value a stage reads changes; the stage's jobs must
    give eager's outputs and gradients after it (with a RecaptureWarning naming the value), not
    replay the program of the old value."""
    torch.manual_seed(0)
    mod = _Scaled()
    ref = copy.deepcopy(mod)
    runner = CompiledRunner(mod, example_inputs=(torch.randn(8, 6),))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, gy = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
        if step == 1:
            for m in (mod, ref):
                if change == "eval":
                    m.eval()
                elif change == "attribute":
                    m.temperature = 3.0
                elif change == "frozen":
                    m.lin.weight.requires_grad_(False)
        for m in (mod, ref):
            for p in m.parameters():
                p.grad = None
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if change == "autocast" and step >= 1 else contextlib.nullcontext()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ctx:
                (y,) = runner.forward(0, (x,))
                gy = gy.to(y.dtype)  # (bfloat16 under autocast)
                runner.backward(0, (gy,))
                want = ref(x)
            want.backward(gy)
        recaptured = [str(w.message) for w in caught if issubclass(w.category, RecaptureWarning)]
        if step == 1:
            named = {"eval": "training: True -> False", "attribute": "temperature: 1.0 -> 3.0",
                     "frozen": "requires_grad: True -> False", "autocast": "global state"}[change]
            assert len(recaptured) == 1 and named in recaptured[0], recaptured
        else:
            assert not recaptured, recaptured
        torch.testing.assert_close(y, want.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mod.norm.running_mean, ref.norm.running_mean)


@pytest.mark.parametrize("where", ["jobs", "construction"])
def test_grad_mode_does_not_change_a_stages_programs(where):
    """A stage's programs compute their gradients themselves: jobs run under torch.no_grad()
    (or a runner built under it) give eager's gradients, with no capture again."""
    torch.manual_seed(0)
    mod = _Scaled()
    ref = copy.deepcopy(mod)
    with torch.no_grad() if where == "construction" else contextlib.nullcontext():
        runner = CompiledRunner(mod, example_inputs=(torch.randn(8, 6),))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, gy = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
        for m in (mod, ref):
            for p in m.parameters():
                p.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("error", RecaptureWarning)
            with torch.no_grad() if where == "jobs" else contextlib.nullcontext():
                (y,) = runner.forward(0, (x,))
                runner.backward(0, (gy,))
        want = ref(x)
        want.backward(gy)
        torch.testing.assert_close(y, want.detach(), rtol=1e-5, atol=1e-6)
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert p.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_a_stage_that_reads_its_state_on_the_host_is_refused_naming_the_line():
    """Batch norm with momentum=None divides by float(num_batches_tracked), a buffer that grows
    every step: a program cannot keep the first step's value, so the capture names the read."""
    stage = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6, momentum=None))
    with pytest.raises(CaptureError, match=r"batchnorm.py:\d+ \(.*num_batches_tracked"):
        CompiledRunner(stage, example_inputs=(torch.randn(8, 6),))
