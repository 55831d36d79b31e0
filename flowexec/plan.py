"""ExecutionPlan: the analysed program, one Instruction per op, ready to lower.

Planning is separate from running: ``build_plan`` composes the passes once; the interpreter
only reads the result. Instruction records already carry the fields later run modes fill
(stream, events to wait on and record) so those modes slot in without a new record type.

Example::

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: (x * 2).relu().sum(), torch.randn(8))
    >>> exe.plan.stats()["ops"], exe.plan.stats()["frees"]
    (3, 2)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import OptionError
from .passes.dependencies import alias_groups, dependencies, mutated_state
from .passes.liveness import Liveness, analyse_liveness
from .program import Op, Program, lint

GC_MODES = ("fast", "none")


@dataclass(frozen=True, slots=True)
class Instruction:
    """One planned op: what to run, on which stream, which events, what to drop after."""

    op: Op
    deps: tuple[int, ...] = ()  # indices of instructions that must finish first
    stream: int = 0  # 0 = the device's current stream
    waits: tuple[int, ...] = ()  # event ids to wait on before running
    records: tuple[int, ...] = ()  # event ids to record after running
    frees: tuple[int, ...] = ()  # value ids dropped after running


@dataclass(frozen=True)
class ExecutionPlan:
    """The program plus every analysis result the runtime needs."""

    program: Program
    instructions: tuple[Instruction, ...]
    groups: tuple[int, ...]
    liveness: Liveness
    mutated: tuple[int, ...]  # input/state values the program writes in place
    gc: str

    def stats(self) -> dict[str, Any]:
        """Counts that summarise the plan: ops, values, frees, planned peak bytes …"""
        p = self.program
        return {
            "ops": len(p.ops),
            "values": len(p.values),
            "inputs": len(p.inputs),
            "state": len(p.state),
            "frees": sum(len(i.frees) for i in self.instructions),
            "mutated_state": len(self.mutated),
            "planned_peak_bytes": self.liveness.peak_bytes,
            "max_live_intermediates": max(self.liveness.live_after, default=0),
            "gc": self.gc,
        }


def build_plan(prog: Program, gc: str = "fast") -> ExecutionPlan:
    """Lint the program and run every pass once."""
    if gc not in GC_MODES:
        raise OptionError(f"gc={gc!r} is not a garbage-collection mode; valid: {', '.join(GC_MODES)}")
    lint(prog)
    groups = alias_groups(prog)
    deps = dependencies(prog, groups)
    live = analyse_liveness(prog, groups, drop=(gc != "none"))
    instrs = tuple(Instruction(op, deps[op.index], frees=live.frees[op.index]) for op in prog.ops)
    return ExecutionPlan(prog, instrs, groups, live, mutated_state(prog, groups), gc)
