"""CompiledRunner in graph mode (each job a CUDA-graph replay) against eager autograd."""
from __future__ import annotations

import copy

import pytest
import torch

from flowexec.models import PreNormBlock

from flowexec.pipeline.compiled import CompiledRunner
from helpers import assert_close_rel, eager_stage_grads, play_jobs as play

DEV = "cuda"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def Block(d: int = 64, heads: int = 4) -> torch.nn.Module:
    """A pre-norm transformer block (flowexec.models.PreNormBlock)."""
    return PreNormBlock(d, heads)


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, side: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(torch.tanh(self.lin(x)) + side), side.sin()


@pytest.mark.parametrize("make, inputs, order, slots", [
    (lambda: torch.nn.Sequential(Block(), Block()), lambda: (torch.randn(2, 16, 64, device=DEV),),
     "F0 F1 I1 I0 W0 W1", 2),
    (Shared, lambda: (torch.randn(8, 32, device=DEV), torch.randn(8, 32, device=DEV)),
     "F0 F1 F2 I0 B1 W0 I2 W2", 3),
    (Shared, lambda: (torch.randn(8, 32, device=DEV), torch.randn(8, 32, device=DEV)),
     "F0 I0 W0 F1 B1 F2 I2 W2", 1),
], ids=["block_zb_order", "shared_weight_mixed", "one_in_flight"])
def test_graph_mode_jobs_match_eager_over_two_steps(make, inputs, order, slots):
    mod = make().to(DEV)
    ref = copy.deepcopy(mod)
    micros = sorted({int(j[1:]) for j in order.split()})
    runner = CompiledRunner(mod, example_inputs=inputs())
    assert runner.mode == "graph"
    held = None
    for step in range(2):  # the second step replays the slots the first captured
        xs = [inputs() for _ in micros]
        gs = [tuple(torch.randn_like(t) for t in x) for x in xs]
        for p, q in zip(mod.parameters(), ref.parameters()):
            p.grad = q.grad = None
        outs, gins = play(runner, order, xs, gs)
        r_outs, r_gins, _ = eager_stage_grads(ref, xs, gs)
        for m in micros:
            for got, want in zip(outs[m], r_outs[m]):
                assert rel_err(got, want) <= 1e-5
            for got, want in zip(gins[m], r_gins[m]):
                assert rel_err(got, want) <= 1e-5
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad) <= 1e-5
        if step == 0:
            held = (outs[micros[0]][0], r_outs[micros[0]][0])
    # an output held across the next replay of its slot kept its value (copy-on-overwrite)
    assert rel_err(*held) <= 1e-5
    assert runner.graph_slots == slots  # one graph set per micro-batch in flight, reused by the second step


def test_graph_mode_last_stage_with_batchnorm_and_loss_scale():
    mod = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 4)).to(DEV)
    ref = copy.deepcopy(mod)
    loss_fn = torch.nn.functional.cross_entropy
    xs = [torch.randn(8, 16, device=DEV) for _ in range(3)]
    ys = [torch.randint(0, 4, (8,), device=DEV) for _ in range(3)]
    runner = CompiledRunner(mod, example_inputs=(xs[0],), loss_fn=loss_fn, loss_scale=1 / 3)
    losses = [runner.forward(m, (xs[m],), target=ys[m])[0] for m in range(3)]
    gx = [runner.backward(m, None)[0] for m in (2, 0, 1)]
    for m in range(3):
        xr = xs[m].clone().requires_grad_(True)
        loss = loss_fn(ref(xr), ys[m])
        (loss / 3).backward()
        assert rel_err(losses[m], loss) <= 1e-5
        assert rel_err(gx[(2, 0, 1).index(m)], xr.grad) <= 1e-5
    for p, q in zip(mod.parameters(), ref.parameters()):
        # (the first bias's gradient is zero up to rounding before batch norm, and the stage's
        # fused batch-norm backward rounds otherwise than eager's: a floor, not noise over noise)
        assert_close_rel(p.grad, q.grad, tol=1e-5, floor=1e-6)
    # capture and warm-up left no trace: the statistics moved once per forward, as eager's did
    assert rel_err(mod[1].running_mean, ref[1].running_mean) <= 1e-5
    assert mod[1].num_batches_tracked.item() == ref[1].num_batches_tracked.item() == 3


def test_graph_mode_bfloat16_and_caller_reusing_its_buffers():
    mod = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).to(DEV, torch.bfloat16)
    ref = copy.deepcopy(mod)
    x = torch.randn(16, 64, device=DEV, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    runner = CompiledRunner(mod, example_inputs=(x,))
    runner.forward(0, (x,))
    xr = x.clone().requires_grad_(True)
    ref(xr).backward(g)
    x.zero_()  # the caller reuses its receive buffers: the runner copied what it needs
    (gx,) = runner.backward_input(0, (g,))
    g.zero_()
    runner.backward_weight(0)
    assert gx.dtype == torch.bfloat16 and rel_err(gx, xr.grad) <= 1e-2
    for p, q in zip(mod.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-2
