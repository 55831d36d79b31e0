"""Gradient accumulation as a program pass (flowexec/pipeline/accumulate.py) and its use by
CompiledRunner: in-place accumulation into .grad, writing over last step's buffers."""
from __future__ import annotations

import pytest
import torch

from flowexec.pipeline.accumulate import accumulate_gradients
from flowexec.pipeline.compiled import CompiledRunner
from flowexec.pipeline.split import capture_stage
from flowexec.plan import build_plan
from flowexec.runtime.interpreter import lower_trace
from test_split import Block, Shared


def _metas(prog, ids):
    return [prog.values[i].meta for i in ids]


def _rand(metas, fill=None):
    return [torch.full(m.shape, fill, dtype=m.dtype) if fill is not None else torch.randn(m.shape, dtype=m.dtype)
            for m in metas]


@pytest.mark.parametrize("make, shape", [(Block, (2, 5, 16)), (Shared, (3, 8))], ids=["transformer_block", "shared_weight"])
@pytest.mark.parametrize("which", ["B", "W"])
def test_accumulating_programs_add_or_write_exactly_the_gradients(make, shape, which):
    torch.manual_seed(0)
    mod = make().double()
    cap = capture_stage(mod, (torch.randn(*shape, dtype=torch.float64),))
    prog, first = (cap.backward, len(cap.input_grad_positions)) if which == "B" else (cap.split.w_program, 0)
    args = _rand(_metas(prog, prog.inputs))
    plain = lower_trace(build_plan(prog))(*args)
    grads = plain[first:]
    acc = _rand([g for g in (prog.values[o.id].meta for o in prog.outputs[first:])])
    start = [a.clone() for a in acc]
    rest = lower_trace(build_plan(accumulate_gradients(prog, first)))(*args, *acc)
    assert len(rest) == first and all(torch.equal(a, b) for a, b in zip(rest, plain[:first]))
    for a, s, g in zip(acc, start, grads):
        torch.testing.assert_close(a, s + g, rtol=0, atol=1e-12)
    # overwrite: old contents (NaN here) are not read
    over = _rand([a.meta for a in (prog.values[o.id] for o in prog.outputs[first:])], fill=float("nan"))
    lower_trace(build_plan(accumulate_gradients(prog, first, overwrite=True)))(*args, *over)
    for a, g in zip(over, grads):
        torch.testing.assert_close(a, g, rtol=0, atol=1e-12)


def test_linear_weight_gradient_is_one_addmm_into_the_accumulator():
    cap = capture_stage(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()), (torch.randn(2, 4),))
    w = cap.split.w_program
    assert [op.name.replace("aten.", "") for op in w.ops] == [
        "detach.default", "t.default", "mm.default", "t.default", "sum.dim_IntList", "view.default", "t.default"]
    names = [op.name.replace("aten.", "") for op in accumulate_gradients(w, 0).ops]
    # weight: addmm_ into the accumulator (no mm, no gradient-sized temporary); bias: sum, view, add_
    assert names == ["detach.default", "t.default", "addmm_.default", "sum.dim_IntList", "view.default", "add_.Tensor"]
    names = [op.name.replace("aten.", "") for op in accumulate_gradients(w, 0, overwrite=True).ops]
    assert names == ["detach.default", "t.default", "addmm_.default", "sum.dim_IntList", "view.default", "copy_.default"]


def test_compiled_runner_keeps_grad_buffers_across_steps_and_matches_eager():
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)).double()
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4)).double()
    ref.load_state_dict(mod.state_dict())
    r = CompiledRunner(mod, example_inputs=(torch.zeros(3, 6, dtype=torch.float64),))
    ptrs = None
    for step in range(3):
        xs = [torch.randn(3, 6, dtype=torch.float64) for _ in range(3)]
        gs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(3)]
        r.reset_grads()
        ref.zero_grad(set_to_none=True)
        for m, (x, g) in enumerate(zip(xs, gs)):
            r.forward(m, (x,))
            if m == 1:  # I then W on one micro-batch, full B on the others
                r.backward_input(m, (g,))
                r.backward_weight(m)
            else:
                r.backward(m, (g,))
            ref(x).backward(g)
        for p, q in zip(mod.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
        now = [p.grad.data_ptr() for p in mod.parameters()]
        assert ptrs is None or now == ptrs  # the first step's buffers are written over, not replaced
        ptrs = now
