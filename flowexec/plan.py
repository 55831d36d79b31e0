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
import os
from dataclasses import dataclass
from typing import Any

from .errors import OptionError, whole_number
from .passes.dependencies import alias_groups, chain_ordered_anyway, dependencies, mutated_state
from .passes.fuse import FusionReport
from .passes.liveness import Liveness, analyse_liveness, peak_of
from .passes.memory import MemoryPlan
from .passes.recompute import Recomputed
from .passes.streams import (add_copy_streams, assign_auto, assign_streams, cross_edges, cuda_devices, data_edges,
                             exit_uses, naive_events, plan_events, release_streams, side_outputs, stream_dependencies,
                             stream_groups, stream_uses, value_edges)
from .program import Op, Program, Role, lint

GC_MODES = ("fast", "async", "none")
MEMORY_MODES = ("normal", "planned")  # planned: intermediates in one arena per device (passes/memory.py)
ORDERS = ("program", "memory")  # memory: the memory-aware order of passes/order.py


def check_streams(streams: Any) -> int | str:
    """``streams`` checked: a whole number of at least 1, or ``"auto"`` (an OptionError otherwise)."""
    if streams == "auto" and isinstance(streams, str):
        return streams
    try:
        return whole_number("streams", streams, 1)
    except OptionError:
        raise OptionError(f"streams={streams!r} must be a whole number of at least 1 or 'auto'") from None


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
    # ops run on worker threads (CPU streams, threaded mode): value edges are ordered too, and
    # stream_uses name the other streams that release a freed value's slot
    on_workers: bool = False
    stream_roles: tuple[str, ...] = ("compute",)
    event_counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # cross-stream edges, waits, naive waits, naive events
    memory: MemoryPlan | None = None  # memory="planned": arena offsets (passes/memory.py)
    gc_backlog_bytes: int = 0  # gc="async": most bytes handed to the worker and not yet dropped
    order: str = "program"
    fusion: FusionReport | None = None  # fuse="inductor": the regions and what became of each (passes/fuse.py)
    recomputed: tuple[Recomputed, ...] = ()  # what passes/recompute.py recomputed (recompute=)
    # seconds of each rewrite build.plan_for applied and of build_plan itself (where a build's
    # "plan" phase went); fuse's includes Inductor's compiles (the report's compile_seconds)
    pass_seconds: tuple[tuple[str, float], ...] = ()

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
            "stream_roles": self.stream_roles,
            "cross_stream_edges": self.event_counts[0],
            "waits": self.event_counts[1],
            "naive_waits": self.event_counts[2],
            "naive_events": self.event_counts[3],
            **(self.fusion.counts() if self.fusion is not None else {}),
            "recomputed_buffers": len(self.recomputed),
            "recomputed_bytes": sum(r.nbytes for r in self.recomputed),
        }


def _arena_stats(m: MemoryPlan) -> dict[str, Any]:
    return {"arena_bytes": sum(m.arena_bytes), "arena_lower_bound_bytes": sum(m.lower_bound_bytes),
            "planned_buffers": len(m.placements), "unplanned_buffers": len(m.unplanned)}


def build_plan(prog: Program, gc: str = "fast", streams: int | str = 1, mode: str = "trace",
               prune: bool = True, workers: bool | None = None, memory: str = "normal",
               order: str = "program", gc_backlog: float | int = 0.1) -> ExecutionPlan:
    """Lint the program and run every pass once.

    ``streams``: spread ops over up to that many compute streams (1: every op on the caller's
    stream, no events; copies between host and device then go to copy streams of their own),
    or ``"auto"`` (copies on copy streams, branches on extra compute streams where their
    estimated cost pays, ``passes/streams.py``). ``mode``: the run mode the plan is for
    (``"threaded"`` runs ops on worker threads). ``workers``: plan for ops on worker threads
    (default: threaded mode, or several streams over a program with no CUDA tensor: CPU
    streams). ``prune=False``: one event per cross-stream edge (the naive plan, for
    comparison). ``memory="planned"``: give intermediates offsets in an arena;
    ``order="memory"``: reorder ops to lower the peak; ``gc_backlog`` (gc="async"): the
    worker's backlog bound, bytes (int) or a fraction of the planned peak (float). Under
    ``FLOWEXEC_DEBUG=1`` every multi-stream plan is verified (``flowexec.verify_plan``) and a
    hazard is an error.
    """
    streams = check_streams(streams)
    check_gc(gc, mode, streams)
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
    plan = _build(prog, gc, streams, mode, prune, workers)
    if gc == "async" and plan.on_workers:
        raise OptionError("gc='async' runs in trace mode on CUDA streams or one CPU stream; threaded mode and CPU "
                          "streams free on their workers (use gc='fast' there)")
    extra: dict[str, Any] = {"order": order}
    if memory == "planned":
        from .passes.memory import arena_buffers, instruction_order, plan_memory

        # Lifetimes end at the last use whatever the collector: an arena block needs no free.
        # Over streams a block is reused only after what the events order (not the deps).
        buffers = arena_buffers(prog, plan.groups, plan.liveness.last_use)
        extra["memory"] = plan_memory(prog, plan.groups, buffers, instruction_order(plan.instructions))
    plan = dataclasses.replace(plan, **extra)
    if memory == "planned" and plan.n_streams > 1 and os.environ.get("FLOWEXEC_DEBUG") == "1":
        from .passes.verify import check_plan

        check_plan(plan)  # again, now that arena blocks are shared storage
    if gc == "async":
        limit = gc_backlog if isinstance(gc_backlog, int) else int(gc_backlog * plan.planned_peak_bytes())
        plan = dataclasses.replace(plan, gc_backlog_bytes=limit)
    return plan


def _build(prog: Program, gc: str, streams: int | str, mode: str, prune: bool, workers: bool | None) -> ExecutionPlan:
    groups = alias_groups(prog)
    cuda = cuda_devices(prog)
    if workers is None:
        workers = mode == "threaded" or (streams != 1 and not cuda)
    # Arguments on one storage are one buffer to the dependencies only where several streams
    # need ordering that program order gives one stream (liveness and the mutated set never).
    shared = streams != 1 and bool(prog.shared_storage)
    deps = dependencies(prog, alias_groups(prog, shared=True) if shared else groups)
    if streams != 1 or workers:  # a view's results on its argument's storage, every one of them
        sgroups = stream_groups(prog, shared)
        deps = stream_dependencies(prog, sgroups)
        if workers:  # (threads draw in any order: random ops keep their captured one)
            deps = chain_ordered_anyway(prog, deps)
    live = analyse_liveness(prog, groups, drop=(gc != "none"))
    if streams == 1 and not workers:
        instrs = tuple(Instruction(op, deps[op.index], frees=live.frees[op.index]) for op in prog.ops)
        return ExecutionPlan(prog, instrs, groups, live, mutated_state(prog, groups), gc)
    device = "cuda" if len(cuda) == 1 else "cpu"
    if streams == "auto":
        where, roles = assign_auto(prog, deps, device, mode)
    else:
        if device == "cuda":
            where, roles = add_copy_streams(prog, deps, streams)
        else:
            where = assign_streams(deps, streams)
            roles = ("compute",) * (max(where, default=0) + 1)
    # view-only ops need no wait (metadata); on worker threads every value must exist first
    edges = value_edges(prog, deps) if workers else data_edges(prog, deps)
    events = plan_events(edges, where) if prune else naive_events(edges, where)
    naive = naive_events(edges, where)
    counts = (len(cross_edges(edges, where)), sum(map(len, events.waits)), sum(map(len, naive.waits)), naive.n_events)
    uses = release_streams(prog, where, live.frees) if workers else stream_uses(prog, sgroups, where, live.frees)
    instrs = tuple(Instruction(op, deps[op.index], where[op.index], events.waits[op.index],
                               events.records[op.index], live.frees[op.index], uses[op.index])
                   for op in prog.ops)
    freed = {v for f in live.frees for v in f}
    at_exit = [v.id for v in prog.values if v.role is Role.TEMP and v.id not in live.protected and v.id not in freed]
    plan = ExecutionPlan(prog, instrs, groups, live, mutated_state(prog, groups), gc,
                         max(where, default=0) + 1, events.n_events,
                         side_outputs(prog, sgroups, where) if device == "cuda" else (),
                         () if workers else exit_uses(prog, sgroups, where, at_exit),
                         workers, roles, counts)
    if os.environ.get("FLOWEXEC_DEBUG") == "1":
        from .passes.verify import check_plan

        check_plan(plan)
    return plan
