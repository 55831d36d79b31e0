"""The program text form, the passes (as readable tables) and liveness against the plan."""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

import flowexec
from flowexec.models import make_mlp, make_step
from flowexec.passes import alias_groups, dependencies, read_write_sets
from flowexec.runtime.interpreter import Interpreter


def test_program_text_form():
    exe = flowexec.compile(lambda a, b: (a @ b).relu(), torch.randn(2, 3), torch.randn(3, 4))
    assert str(exe.program).splitlines() == [
        "program(a0: f32[2, 3] cpu, a1: f32[3, 4] cpu) -> (v3)",
        "  v2: f32[2, 4] cpu = aten.mm.default(a0, a1)  # test_plan.py:16",
        "  v3: f32[2, 4] cpu = aten.relu.default(v2)  # test_plan.py:16",
    ]


def test_dependencies_with_views_and_inplace():
    def f(x):
        y = x.mul(2)        # 0 reads x
        v = x.view(-1)      # 1 view of x (alias)
        v.add_(1)           # 2 writes x through the view: after 0 (WAR) and 1
        z = x.sum()         # 3 reads x: after 2 (RAW)
        return y, z

    exe = flowexec.compile(f, torch.ones(2, 2))
    prog = exe.program
    names = [op.name.split(".")[1] for op in prog.ops]
    assert names == ["mul", "view", "add_", "sum"]
    assert dependencies(prog) == ((), (), (0, 1), (2,))
    groups = alias_groups(prog)
    x, view_out = prog.inputs[0], prog.ops[1].outputs[0]
    assert groups[x] == groups[view_out]
    reads, writes = read_write_sets(prog)[2]
    assert writes == {groups[x]}


def test_stats_and_frees_table():
    exe = flowexec.compile(lambda x: (x * 2).exp().sum(), torch.randn(8))
    # op0 mul -> v1, op1 exp -> v2 (v1 dead after op1), op2 sum -> v3 (output)
    assert exe.plan.liveness.frees == ((), (1,), (2,))
    assert exe.plan.liveness.live_after == (1, 1, 0)
    stats = exe.plan.stats()
    assert stats["ops"] == 3 and stats["frees"] == 2 and stats["planned_peak_bytes"] == 64
    none = flowexec.compile(lambda x: (x * 2).exp().sum(), torch.randn(8), gc="none").plan
    assert none.stats()["frees"] == 0 and none.liveness.live_after == (1, 2, 2)
    assert none.stats()["planned_peak_bytes"] == 68  # nothing freed: 32 (mul) + 32 (exp) + 4 (sum)


def test_live_intermediates_never_exceed_plan():
    torch.manual_seed(0)
    model = make_mlp(32, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = make_step(model, opt, F.cross_entropy)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    exe = flowexec.compile(step, x, y)
    plan = exe.plan
    temps = {v.id for v in plan.program.values if v.role.value == "temp"} - plan.liveness.protected
    refs: dict[int, weakref.ref] = {}
    seen = []

    def on_step(i, env):
        for op_out in plan.instructions[i].op.outputs:
            if op_out in temps and env[op_out] is not None:
                refs[op_out] = weakref.ref(env[op_out])
        # Values whose tensors are still alive anywhere (not just in the slot table).
        alive = sum(1 for vid, r in refs.items() if r() is not None and env[vid] is not None)
        seen.append(alive)
        assert alive <= plan.liveness.live_after[i], f"after op {i}: {alive} live > planned {plan.liveness.live_after[i]}"

    Interpreter(plan).run(x, y, on_step=on_step)
    assert max(seen) == max(plan.liveness.live_after) > 0
    # The fast GC really drops: with gc="none" far more stay alive.
    assert plan.stats()["frees"] > 0.8 * plan.stats()["ops"]


def test_trace_runner_frees_tensors_at_last_use():
    # Memory-level check: an intermediate's storage is released during the run, not at the end.
    big = 1 << 16
    exe = flowexec.compile(lambda x: ((x + 1) * 2).sum() + x.mean(), torch.randn(big))
    src = exe._last.runner.__closure__  # noqa: SLF001  (the generated source is what runs)
    run = [c.cell_contents for c in src if callable(getattr(c.cell_contents, "source", None)) or hasattr(c.cell_contents, "source")][0]
    assert "del v1" in run.source and "del v2" in run.source



def test_a_plan_says_where_its_building_went_step_by_step() -> None:
    """``pass_seconds``: each rewrite ``build.plan_for`` applied, in order, and ``build_plan``
    (graph mode adds ``copy_in`` where the program copies an input in itself)."""
    exe = flowexec.compile(lambda x: (x * 2).relu().sum(), torch.randn(4))
    names = [name for name, _ in exe.plan.pass_seconds]
    assert names == ["dead_code", "lerp", "recompute", "pad", "fuse", "build_plan"]
    assert all(s >= 0 for _, s in exe.plan.pass_seconds)
