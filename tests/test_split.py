"""The backward split as a program pass: forward/backward partition, I and W programs, kept values."""
from __future__ import annotations

import copy

import pytest
import torch

from flowexec.models import PreNormBlock

from flowexec.errors import CaptureError
from flowexec.pipeline.split import capture_stage, format_kept
from flowexec.plan import build_plan
from flowexec.runtime.interpreter import lower_trace


def Block(d: int = 16, heads: int = 2) -> torch.nn.Module:
    """A pre-norm transformer block (flowexec.models.PreNormBlock)."""
    return PreNormBlock(d, heads)


class Shared(torch.nn.Module):
    """One Linear applied twice: its weight's gradient sums two uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def run_jobs(cap, x, g):
    """F, then B, and separately I then W, on the captured programs; returns (outputs, B grads, I+W grads)."""
    run = {k: lower_trace(build_plan(p)) for k, p in
           [("F", cap.forward), ("B", cap.backward), ("I", cap.split.i_program), ("W", cap.split.w_program)]}
    f = run["F"](*x)
    saved = f[cap.n_outputs:]
    b = run["B"](*saved, *g)
    i = run["I"](*saved, *g)
    vals = dict(zip(cap.saved, saved))
    vals.update(zip(cap.split.i_kept, i[cap.split.n_input_grads:]))
    w = run["W"](*[vals[v] for v in cap.split.w_inputs])
    return f[:cap.n_outputs], b, i[:cap.split.n_input_grads] + w


def conv_stage() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3), torch.nn.ReLU())


@pytest.mark.parametrize("make, shape", [(Block, (2, 5, 16)), (Shared, (3, 8)), (conv_stage, (2, 3, 6, 6))],
                         ids=["transformer_block", "shared_weight", "conv_batchnorm"])
def test_i_and_w_give_the_full_backward_and_eager(make, shape):
    torch.manual_seed(0)
    mod = make().double()
    x = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn(*shape, dtype=torch.float64)
    cap = capture_stage(mod, (x,))
    outs, b, iw = run_jobs(cap, (x,), (g,))
    assert len(iw) == len(b) == 1 + len(list(mod.parameters()))
    for got, full in zip(iw, b):
        assert torch.equal(got, full)  # bitwise: the same ops on the same values
    xx = x.clone().requires_grad_(True)
    y = mod(xx)
    ref = torch.autograd.grad(y, [xx, *mod.parameters()], g)
    assert torch.allclose(outs[0], y, rtol=0, atol=1e-12)
    for got, want in zip(b, ref):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
    # W makes every weight gradient (none is made by I and handed over)
    assert cap.split.n_input_grads == 1
    assert all("(returned)" not in k.readers for k in cap.split.kept)


def test_fused_norm_backward_is_split_between_i_and_w():
    torch.manual_seed(0)
    cap = capture_stage(Block().double(), (torch.randn(2, 5, 16, dtype=torch.float64),))
    masks = {job: [op.args[7] for op in prog.ops if op.name == "aten.native_layer_norm_backward.default"]
             for job, prog in (("B", cap.backward), ("I", cap.split.i_program), ("W", cap.split.w_program))}
    assert masks == {"B": [[True, True, True]] * 2, "I": [[True, False, False]] * 2, "W": [[False, True, True]] * 2}

    class NormOfWeight(torch.nn.Module):  # the norm's input gradient feeds a weight gradient only
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
            self.ln = torch.nn.LayerNorm(4).double()

        def forward(self, x):
            return x * self.ln(self.p)

    mod = NormOfWeight()
    x, g = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    cap = capture_stage(mod, (x,))
    # both halves would be W's: the op stays whole there, run once
    assert [op.args[7] for op in cap.split.w_program.ops if op.name == "aten.native_layer_norm_backward.default"] == \
        [[True, True, True]]
    assert not any(op.name == "aten.native_layer_norm_backward.default" for op in cap.split.i_program.ops)
    _, b, iw = run_jobs(cap, (x,), (g,))
    assert all(torch.equal(p, q) for p, q in zip(iw, b))


def test_shared_weight_gets_one_gradient_summing_both_uses():
    torch.manual_seed(1)
    mod = Shared().double()
    x, g = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    cap = capture_stage(mod, (x,))
    assert [p is q for p, q in zip(cap.params, mod.parameters())] == [True, True]
    _, _, iw = run_jobs(cap, (x,), (g,))
    # By hand: y = W tanh(W x + b) + b
    w, bias = mod.lin.weight, mod.lin.bias
    h = x @ w.T + bias
    t = torch.tanh(h)
    gh = (g @ w) * (1 - t * t)
    dw = g.T @ t + gh.T @ x
    assert torch.allclose(iw[1], dw, rtol=0, atol=1e-12)
    assert torch.allclose(iw[2], g.sum(0) + gh.sum(0), rtol=0, atol=1e-12)
    # the accumulation of the two uses is W's work
    assert any(op.name == "aten.add.Tensor" for op in cap.split.w_program.ops)


MLP_KEPT = """\
value          type        from   read by W
gelu           f32[4, 16]  saved  detach
grad_output0   f32[4, 3]   seed   t, sum.dim_IntList
detach         f32[4, 8]   input  detach
gelu_backward  f32[4, 16]  I      t, sum.dim_IntList
4 values, 688 bytes"""


def test_kept_values_table_for_an_mlp_stage():
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    cap = capture_stage(stage, (torch.randn(4, 8),))
    assert format_kept(cap.split) == MLP_KEPT
    # what F saves: the input, the first layer's pre-activation (gelu_backward reads it) and gelu
    assert [cap.backward.values[v].name for v in cap.saved] == ["gelu", "addmm", "detach"]
    # the pre-activation only I reads: it is not kept for W
    assert "addmm" not in {k.name for k in cap.split.kept}
    # the views of the weights (t()) are remade in the backward, not saved
    assert all(cap.backward.values[v].meta.shape[0] == 4 for v in cap.saved)


def test_first_stage_without_input_gradient_has_no_i_work():
    stage = torch.nn.Linear(4, 2)
    cap = capture_stage(stage, (torch.randn(3, 4),), input_grads=False)
    assert cap.input_grad_positions == () and len(cap.split.i_program.ops) == 0


def test_last_stage_loss_and_scaled_gradients():
    torch.manual_seed(0)
    stage = torch.nn.Linear(4, 2).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    cap = capture_stage(stage, (x,), loss_fn=torch.nn.functional.mse_loss, target=y)
    run = {k: lower_trace(build_plan(p)) for k, p in [("F", cap.forward), ("B", cap.backward)]}
    f = run["F"](x, y)
    b = run["B"](*f[1:], torch.tensor(0.25, dtype=torch.float64))
    xx = x.clone().requires_grad_(True)
    loss = torch.nn.functional.mse_loss(stage(xx), y)
    ref = torch.autograd.grad(loss * 0.25, [xx, *stage.parameters()])
    assert torch.allclose(f[0], loss, rtol=0, atol=1e-12)
    for got, want in zip(b, ref):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_batchnorm_buffers_update_in_the_forward_only():
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU())
    eager = copy.deepcopy(stage)
    x, g = torch.randn(8, 4), torch.randn(8, 6)
    cap = capture_stage(stage, (x,))
    assert torch.equal(stage[1].running_mean, eager[1].running_mean)  # capture leaves no trace
    outs, b, iw = run_jobs(cap, (x,), (g,))
    xx = x.clone().requires_grad_(True)
    y = eager(xx)
    ref = torch.autograd.grad(y, [xx, *eager.parameters()], g)
    assert torch.allclose(outs[0], y, atol=1e-6)
    for got, want in zip(iw, ref):
        assert torch.allclose(got, want, atol=1e-5)
    # run_jobs ran the forward once: the running statistics moved once, as eager's did
    assert torch.allclose(stage[1].running_mean, eager[1].running_mean, atol=1e-7)
    assert stage[1].num_batches_tracked.item() == eager[1].num_batches_tracked.item() == 1


def test_dropout_is_refused_clearly():
    stage = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    with pytest.raises(CaptureError, match=r"random op \(aten\.\w*dropout|bernoulli.*compile=False"):
        capture_stage(stage, (torch.randn(2, 4),))
    stage.eval()  # no dropout: fine
    capture_stage(stage, (torch.randn(2, 4),))


def test_unsupported_stages_fail_with_the_reason():
    class Dict(torch.nn.Module):
        def forward(self, x):
            return x * 2, 3

    with pytest.raises(CaptureError, match="stage output 1 is a int"):
        capture_stage(Dict(), (torch.randn(2),))
    with pytest.raises(CaptureError, match="only floating-point inputs have gradients"):
        capture_stage(torch.nn.Embedding(5, 2), (torch.tensor([1, 2]),), input_grads=[True])
    with pytest.raises(CaptureError, match="needs an example target"):
        capture_stage(torch.nn.Linear(2, 2), (torch.randn(1, 2),), loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(CaptureError, match="example input 0 is a float"):
        capture_stage(torch.nn.Linear(2, 2), (1.0,))
