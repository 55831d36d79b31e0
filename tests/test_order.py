"""order="memory": a valid topological order with a lower planned peak; results equal eager."""
from __future__ import annotations

import pytest
import torch

import flowexec
from flowexec.capture import capture
from flowexec.models import make_step
from flowexec.passes.dead_code import drop_dead_ops
from flowexec.passes.dependencies import alias_groups, dependencies
from flowexec.plan import build_plan
from flowexec.passes.order import greedy_order, order_constraints, order_for_memory, planned_peak
from helpers import assert_close_rel, assert_same_state, twin
from test_core import CASES

pytestmark = pytest.mark.timeout(300)


def branches(x, w):
    # Four branches issued breadth-first, as Python code often does: every branch's 64 KiB
    # intermediate is alive before the first is reduced.
    hs = [(x @ w).exp() * (k + 1) for k in range(4)]
    rs = [h.sin().sum() for h in hs]
    return sum(rs)


def _assert_valid_order(prog, new):
    """Every RAW/WAR/WAW edge and the order of random ops hold in ``new``."""
    key = lambda op: (op.name, repr(op.args), repr(op.kwargs), op.outputs)  # noqa: E731
    pos: dict = {}
    for i, op in enumerate(new.ops):
        pos.setdefault(key(op), []).append(i)
    at = [pos[key(op)].pop(0) for op in prog.ops]
    assert sorted(at) == list(range(len(new.ops)))
    for j, deps in enumerate(order_constraints(prog)):
        for i in deps:
            assert at[i] < at[j], f"op {j} now runs before op {i} it depends on"


def test_memory_order_runs_branches_depth_first_and_lowers_the_peak():
    x, w = torch.randn(64, 64), torch.randn(64, 256)
    prog = capture(branches, (x, w)).program
    new = order_for_memory(prog)
    before, after = planned_peak(prog), planned_peak(new)
    assert after < before, (before, after)
    _assert_valid_order(prog, new)
    exe = flowexec.compile(branches, x, w, order="memory")
    assert exe.plan.stats()["planned_peak_bytes"] == after and exe.plan.stats()["order"] == "memory"
    assert_close_rel(exe(x, w), branches(x, w))


@pytest.mark.parametrize("name", list(CASES))
def test_memory_order_never_raises_the_peak_and_trains_like_eager(name):
    model, make_opt, loss_fn, data = CASES[name]()
    (m1, o1), (m2, o2) = twin(model, make_opt)
    eager, mine = make_step(m1, o1, loss_fn), make_step(m2, o2, loss_fn)
    eager(*data[0]), mine(*data[0])
    exe = flowexec.compile(mine, *data[0], order="memory")
    # one capture for the program-order peak and the order check, as an executable captures
    # (guarded: optimizer hyperparameters fed as tensors, existing gradients as inputs)
    # (without the ops whose results nothing uses, which every plan drops: passes/dead_code.py)
    prog = drop_dead_ops(capture(mine, data[0], guarded=True).program)
    assert exe.plan.stats()["planned_peak_bytes"] <= build_plan(prog).stats()["planned_peak_bytes"]
    _assert_valid_order(prog, exe.program)
    for x, y in data[1:]:
        assert_close_rel(exe(x, y), eager(x, y), what="loss")
    assert_same_state(m1, m2)


def test_random_ops_keep_their_order():
    def f(x):
        a = torch.rand_like(x) * x     # two random draws in independent branches:
        b = torch.rand_like(x).exp()   # their order decides which numbers each gets
        return a.sum() + b.sum()

    prog = capture(f, (torch.ones(256),)).program
    order = greedy_order(prog)
    rand = [k for k, i in enumerate(order) if "rand" in prog.ops[i].name]
    assert [order[k] for k in rand] == sorted(order[k] for k in rand)
    exe = flowexec.compile(f, torch.ones(256), order="memory")
    torch.manual_seed(3)
    got = exe(torch.ones(256))
    torch.manual_seed(3)
    assert_close_rel(got, f(torch.ones(256)))


def test_in_place_writes_stay_after_their_readers():
    def f(x):
        y = x * 2
        s = y.sum()       # reads y before ...
        y.add_(1)         # ... the write (WAR)
        return s + y.sum()

    prog = capture(f, (torch.ones(8),)).program
    new = order_for_memory(prog)
    _assert_valid_order(prog, new)
    assert dependencies(prog, alias_groups(prog))  # the edges exist to be kept
    assert_close_rel(flowexec.compile(f, torch.ones(8), order="memory")(torch.ones(8)), f(torch.ones(8)))


def test_bad_order_and_memory_options_name_the_valid_ones():
    with pytest.raises(flowexec.OptionError, match="order='fastest' is not an op order; valid: program, memory"):
        flowexec.compile(lambda x: x * 2, torch.ones(2), order="fastest")
    with pytest.raises(flowexec.OptionError, match="memory='arena' is not a memory mode; valid: normal, planned"):
        flowexec.compile(lambda x: x * 2, torch.ones(2), memory="arena")
