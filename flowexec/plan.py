"""ExecutionPlan: the analysed program, one Instruction per op, ready to lower.

Planning is separate from running: ``build_plan`` composes the passes once; the interpreter
only reads the result. With ``streams > 1`` the plan also says which CUDA stream runs each op,
which events it waits on and records (``passes/streams.py``: statically pruned) and which
streams each freed value must be recorded on before its ``del``.

Example::

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: (x * 2).relu().sum(), torch.randn(8))
    >>> exe.plan.stats()["ops"], exe.plan.stats()["frees"]
    (3, 2)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .errors import OptionError, whole_number
from .passes.dependencies import alias_groups, dependencies, mutated_state
from .passes.liveness import Liveness, analyse_liveness, peak_of
from .passes.memory import MemoryPlan
from .passes.streams import assign_streams, exit_uses, plan_events, side_outputs, stream_uses
from .program import Op, Program, Role, lint

GC_MODES = ("fast", "async", "none")
MEMORY_MODES = ("normal", "planned")  # planned: intermediates in one arena per device (passes/memory.py)
ORDERS = ("program", "memory")  # memory: the memory-aware order of passes/order.py


def check_gc(gc: str, mode: str = "trace", streams: int = 1) -> None:
    """An OptionError for a collector that is not one, or one that cannot serve this run mode:
    ``async`` drops values on a worker thread, which a CUDA-graph capture on the caller's thread
    is not ready for (with several streams the runner records the streams before the hand-over)."""
    if gc not in GC_MODES:
        raise OptionError(f"gc={gc!r} is not a garbage-collection mode; valid: {', '.join(GC_MODES)}")
    if gc == "async" and mode != "trace":
        raise OptionError(f"gc='async' runs in trace mode only (got mode={mode!r}); use gc='fast' there")


@dataclass(frozen=True, slots=True)
class Instruction:
    """One planned op: what to run, on which stream, which events, what to drop after."""

    op: Op
    deps: tuple[int, ...] = ()  # indices of instructions that must finish first
    stream: int = 0  # 0 = the device's current stream
    waits: tuple[int, ...] = ()  # event ids to wait on before running
    records: tuple[int, ...] = ()  # event ids to record after running
    frees: tuple[int, ...] = ()  # value ids dropped after running
    stream_uses: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (freed value, other streams that used it)


@dataclass(frozen=True)
class ExecutionPlan:
    """The program plus every analysis result the runtime needs."""

    program: Program
    instructions: tuple[Instruction, ...]
    groups: tuple[int, ...]
    liveness: Liveness
    mutated: tuple[int, ...]  # input/state values the program writes in place
    gc: str
    n_streams: int = 1  # streams the ops were spread over (0: the caller's current stream)
    n_events: int = 0
    side_outputs: tuple[int, ...] = ()  # outputs whose storage a side stream allocated
    exit_uses: tuple[tuple[int, tuple[int, ...]], ...] = ()  # stream_uses of values dying at return (gc="none")
    memory: MemoryPlan | None = None  # memory="planned": arena offsets (passes/memory.py)
    gc_backlog_bytes: int = 0  # gc="async": most bytes handed to the worker and not yet dropped
    order: str = "program"

    def planned_peak_bytes(self) -> int:
        """The planned peak of the whole call: the arenas plus the peak of what still allocates."""
        if self.memory is None:
            return self.liveness.peak_bytes
        placed = {self.groups[v] for v in self.memory.values}
        rest = [b for b in self.liveness.buffers if b.group not in placed]
        return sum(self.memory.arena_bytes) + peak_of(rest, len(self.program.ops))

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
            "planned_peak_bytes": self.planned_peak_bytes(),
            "lower_bound_bytes": self.liveness.lower_bound_bytes,
            **(_arena_stats(self.memory) if self.memory is not None else {}),
            "order": self.order,
            "max_live_intermediates": max(self.liveness.live_after, default=0),
            "gc": self.gc,
            "streams": self.n_streams,
            "events": self.n_events,
        }


def _arena_stats(m: MemoryPlan) -> dict[str, Any]:
    return {"arena_bytes": sum(m.arena_bytes), "arena_lower_bound_bytes": sum(m.lower_bound_bytes),
            "planned_buffers": len(m.placements), "unplanned_buffers": len(m.unplanned)}


def build_plan(prog: Program, gc: str = "fast", streams: int = 1, memory: str = "normal",
               order: str = "program", gc_backlog: float | int = 0.1) -> ExecutionPlan:
    """Lint the program and run every pass once; ``streams``: spread ops over up to that many
    CUDA streams (1: every op on the caller's stream, no events); ``memory="planned"``: give
    intermediates offsets in an arena; ``order="memory"``: reorder ops to lower the peak;
    ``gc_backlog`` (gc="async"): the worker's backlog bound, bytes (int) or a fraction of the
    planned peak (float)."""
    whole_number("streams", streams, 1)
    check_gc(gc, streams=streams)
    if memory not in MEMORY_MODES:
        raise OptionError(f"memory={memory!r} is not a memory mode; valid: {', '.join(MEMORY_MODES)}")
    if order not in ORDERS:
        raise OptionError(f"order={order!r} is not an op order; valid: {', '.join(ORDERS)}")
    if isinstance(gc_backlog, bool) or not isinstance(gc_backlog, (int, float)) or gc_backlog < 0:
        raise OptionError(f"gc_backlog must be a number of bytes (int) or a fraction of the planned peak (float) "
                          f">= 0, not {gc_backlog!r}")
    lint(prog)
    if order == "memory":
        from .passes.order import order_for_memory

        prog = order_for_memory(prog)
    plan = _build(prog, gc, streams)
    extra: dict[str, Any] = {"order": order}
    if memory == "planned":
        from .passes.memory import arena_buffers, plan_memory

        where = [i.stream for i in plan.instructions] if plan.n_streams > 1 else None
        # Lifetimes end at the last use whatever the collector: an arena block needs no free.
        groups, buffers = arena_buffers(prog, plan.groups, plan.liveness.last_use)
        extra["memory"] = plan_memory(prog, groups, buffers, [i.deps for i in plan.instructions], where)
    plan = dataclasses.replace(plan, **extra)
    if gc == "async":
        limit = gc_backlog if isinstance(gc_backlog, int) else int(gc_backlog * plan.planned_peak_bytes())
        plan = dataclasses.replace(plan, gc_backlog_bytes=limit)
    return plan


def _build(prog: Program, gc: str, streams: int) -> ExecutionPlan:
    groups = alias_groups(prog)
    # Arguments on one storage are one buffer to the dependencies only where several streams
    # need ordering that program order gives one stream (liveness and the mutated set never).
    shared = streams > 1 and bool(prog.shared_storage)
    deps = dependencies(prog, alias_groups(prog, shared=True) if shared else groups)
    live = analyse_liveness(prog, groups, drop=(gc != "none"))
    if streams == 1:
        instrs = tuple(Instruction(op, deps[op.index], frees=live.frees[op.index]) for op in prog.ops)
        return ExecutionPlan(prog, instrs, groups, live, mutated_state(prog, groups), gc)
    where = assign_streams(deps, streams)
    events = plan_events(deps, where)
    uses = stream_uses(prog, groups, where, live.frees)
    instrs = tuple(Instruction(op, deps[op.index], where[op.index], events.waits[op.index],
                               events.records[op.index], live.frees[op.index], uses[op.index])
                   for op in prog.ops)
    freed = {v for f in live.frees for v in f}
    at_exit = [v.id for v in prog.values if v.role is Role.TEMP and v.id not in live.protected and v.id not in freed]
    return ExecutionPlan(prog, instrs, groups, live, mutated_state(prog, groups), gc,
                         max(where, default=0) + 1, events.n_events, side_outputs(prog, groups, where),
                         exit_uses(prog, groups, where, at_exit))
