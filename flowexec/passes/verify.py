"""The verifier: every cross-stream hazard a plan leaves unordered, found without the planner.

It reads only the program (which storage each op reads, writes or allocates) and what the
plan tells the runtime to do (stream per op, the events each op records and waits on, the
frees and the streams recorded before them), builds happens-before from that — program order
on each stream, a wait ordered after the latest record of its event issued before it, the
entry fork (every side stream waits on the caller's stream) and the exit join (the caller's
stream waits on every side stream) — over two calls in a row, and reports:

* ``RAW`` / ``WAR`` / ``WAW``: two ops on different streams touch one storage, at least one
  writes it (allocating a fresh buffer counts as writing it), and neither is ordered before
  the other. A view-only op (:func:`~flowexec.passes.streams.is_view_op`) touches metadata
  only and takes part in none.
* ``FREE``: a storage returns to the allocator while another stream's use of it may still be
  pending — on CUDA the block goes back to the pool of the stream that allocated it, so every
  use on another stream must be ordered before that stream's position at the free or be
  recorded (``record_stream``); on worker threads (CPU streams, threaded mode) the slot is
  cleared by the freeing stream unless the other streams that used it release it too.
* ``DEF`` (worker threads only): an op may run before the op that makes one of its values.

With ``memory="planned"`` (``plan.memory``) values that share arena bytes are one storage for
these checks: the arena is cut at every placement's ends into cells, and an op that reads or
writes a value reads or writes its cells, which outlive the call (so a block reused by the next
call is checked too). Freeing an arena value returns nothing to the allocator: no ``FREE``.

Dependencies between calls (this call's last ops on a side stream against the next call's
first ops) are found the same way, in the second of the two calls (``Hazard.next_call``).

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> from flowexec.plan import build_plan
    >>> f = lambda x: x.sin() * 2 + x.cos() * 3
    >>> plan = build_plan(capture(f, (torch.randn(4),)).program, streams=2, workers=True)
    >>> verify_plan(plan.program, plan)
    []
    >>> j = next(j for j, i in enumerate(plan.instructions) if i.waits)  # the add waits for a branch
    >>> [h.kind for h in verify_plan(plan.program, without_wait(plan, j, 0))]
    ['DEF', 'RAW']
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import FlowexecError
from ..program import Program, Role, format_op
from .streams import is_view_op, stream_groups, stream_rw_sets


class HazardError(FlowexecError):
    """A plan leaves a cross-stream hazard unordered (raised under ``FLOWEXEC_DEBUG=1``)."""


@dataclass(frozen=True, slots=True)
class Hazard:
    """Two ops (``first`` before ``second`` in program order; ``next_call``: ``second`` is in
    the following call) that the plan leaves unordered although they must not overlap."""

    kind: str  # "RAW", "WAR", "WAW", "FREE", "DEF"
    first: int
    second: int
    value: int  # a value id on the storage (DEF: the value not made yet)
    streams: tuple[int, int]
    next_call: bool = False

    def describe(self, prog: Program) -> str:
        a, b = prog.ops[self.first], prog.ops[self.second]
        what = {"RAW": "reads what", "WAR": "writes what", "WAW": "writes what", "FREE": "frees storage that",
                "DEF": "takes a value that"}[self.kind]
        tail = {"RAW": "writes", "WAR": "reads", "WAW": "writes", "FREE": "uses", "DEF": "makes"}[self.kind]
        call = " in the next call" if self.next_call else ""
        return (f"{self.kind}: op #{b.index} (stream {self.streams[1]}){call} {what} op #{a.index} "
                f"(stream {self.streams[0]}) {tail} ({prog.values[self.value].label}), unordered\n"
                f"    #{a.index} {format_op(a, prog)}\n    #{b.index} {format_op(b, prog)}")


def _clocks(plan: Any, n_ops: int, calls: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """Per op instance (call * n_ops + index): its position on its stream, and the vector clock
    at its start (the last position of each stream ordered before it)."""
    ins = plan.instructions
    n_streams = max((i.stream for i in ins), default=0) + 1
    seq = [0] * n_streams
    cur = [[0] * n_streams for _ in range(n_streams)]  # per stream: what it has ordered so far
    last_record: dict[int, list[int]] = {}
    pos: list[int] = []
    start: list[tuple[int, ...]] = []
    for _ in range(calls):
        entry = list(cur[0])  # fork: every side stream waits on the caller's stream
        for s in range(1, n_streams):
            cur[s] = [max(a, b) for a, b in zip(cur[s], entry)]
        for j in range(n_ops):
            s = ins[j].stream
            c = cur[s]
            for e in ins[j].waits:
                rec = last_record.get(e)
                if rec is not None:
                    c = [max(a, b) for a, b in zip(c, rec)]
            start.append(tuple(c))
            seq[s] += 1
            c = list(c)
            c[s] = seq[s]
            cur[s] = c
            pos.append(seq[s])
            for e in ins[j].records:
                last_record[e] = c
        for s in range(1, n_streams):  # join: the caller's stream waits on every side stream
            cur[0] = [max(a, b) for a, b in zip(cur[0], cur[s])]
    return pos, start


def verify_plan(program: Program, plan: Any, calls: int = 2) -> list[Hazard]:
    """Every hazard ``plan`` leaves unordered over ``calls`` calls in a row (see the module
    docstring); empty for a sound plan."""
    ins = plan.instructions
    n = len(program.ops)
    if len(ins) != n:
        raise ValueError(f"the plan has {len(ins)} instructions for {n} ops")
    groups = stream_groups(program, shared=bool(program.shared_storage))
    rw = stream_rw_sets(program, groups)  # _unsafe_view writes, as the planner and CUDA sanitizer count
    caller = {groups[v.id] for v in program.values if v.role is not Role.TEMP}
    workers = bool(getattr(plan, "on_workers", False))
    pos, start = _clocks(plan, n, calls)
    stream = [i.stream for i in ins]

    def before(a: int, b: int) -> bool:  # op instance a happens before op instance b
        return stream[a % n] == stream[b % n] and a < b or start[b][stream[a % n]] >= pos[a]

    hazards: list[Hazard] = []

    def report(kind: str, a: int, b: int, vid: int) -> None:
        hazards.append(Hazard(kind, a % n, b % n, vid, (stream[a % n], stream[b % n]), a // n != b // n))

    # representative value per group, for messages
    rep: dict[int, int] = {}
    for v in program.values:
        rep.setdefault(groups[v.id], v.id)
    view = [is_view_op(op.target) for op in program.ops]
    made_by = {o: op.index for op in program.ops for o in op.outputs if o >= 0}
    seen: set[int] = set(caller)
    creates: list[set[int]] = []
    for op in program.ops:
        new = {groups[o] for o in op.outputs if o >= 0 and groups[o] not in seen}
        seen |= new
        creates.append(set() if view[op.index] else new)
    cells = arena_cells(program, plan, groups)
    last_writer: dict[Any, int] = {}
    readers: dict[Any, list[int]] = {}
    for call in range(calls):
        for j in range(n):
            b = call * n + j
            if view[j]:
                reads, writes = frozenset(), frozenset()
            else:
                reads, writes = rw[j]
            writes = set(writes) | creates[j]
            key = (lambda g: g if g in caller else (call, g))
            # storage key -> a value on it (for messages); arena cells are keys of their own
            wk = {key(g): rep[g] for g in writes}
            for g in writes:
                for c in cells.get(g, ()):
                    wk.setdefault(c, rep[g])
            rk = {key(g): rep[g] for g in reads - writes}
            for g in reads - writes:
                for c in cells.get(g, ()):
                    rk.setdefault(c, rep[g])
            for k in wk:
                rk.pop(k, None)
            for k, vid in rk.items():
                w = last_writer.get(k)
                if w is not None and not before(w, b):
                    report("RAW", w, b, vid)
            for k, vid in wk.items():
                w = last_writer.get(k)
                if w is not None and not before(w, b):
                    report("WAW", w, b, vid)
                for r in readers.get(k, ()):
                    if r != b and not before(r, b):
                        report("WAR", r, b, vid)
            for k in rk:
                readers.setdefault(k, []).append(b)
            for k in wk:
                last_writer[k] = b
                readers[k] = []
            if workers:
                for r in program.ops[j].refs():
                    p = made_by.get(r)
                    if p is not None and not before(call * n + p, b):
                        report("DEF", call * n + p, b, r)
        hazards += _free_hazards(program, plan, groups, caller, view, before, call, n, workers)
    return sorted(set(hazards), key=lambda h: (h.next_call, h.second, h.first, h.kind))


def arena_cells(program: Program, plan: Any, groups: Sequence[int]) -> dict[int, tuple[tuple[str, int, int], ...]]:
    """Per storage group (``groups``), the arena cells its values occupy (``("arena", arena,
    cell)``; a cell is a byte range between consecutive placement ends); empty without
    ``plan.memory``."""
    mem = getattr(plan, "memory", None)
    if mem is None or not mem.placements:
        return {}
    agroups = plan.groups
    by_agroup: dict[int, list[tuple[str, int, int]]] = {}
    for k in range(len(mem.devices)):
        ps = [p for p in mem.placements if p.arena == k]
        cuts = sorted({p.offset for p in ps} | {p.offset + p.nbytes for p in ps})
        at = {c: i for i, c in enumerate(cuts)}
        for p in ps:
            by_agroup[p.group] = [("arena", k, c) for c in range(at[p.offset], at[p.offset + p.nbytes])]
    out: dict[int, set[tuple[str, int, int]]] = {}
    for v in range(len(program.values)):
        c = by_agroup.get(agroups[v])
        if c:
            out.setdefault(groups[v], set()).update(c)
    return {g: tuple(sorted(c)) for g, c in out.items()}


def _free_hazards(program: Program, plan: Any, groups: Sequence[int], caller: set[int], view: Sequence[bool],
                  before: Any, call: int, n: int, workers: bool) -> list[Hazard]:
    """``FREE`` hazards of one call: storage released (its last value freed) while a use on
    another stream may be pending and no record or release covers that stream. An arena
    value's free releases nothing (its block is ordered by the arena cells instead)."""
    ins = plan.instructions
    mem = getattr(plan, "memory", None)
    in_arena = {groups[v] for v in mem.values} if mem is not None else set()
    outs = {groups[r.id] for r in program.outputs if hasattr(r, "id")}
    release: dict[int, int] = {}  # group -> op after which its last value is freed
    recorded: dict[int, set[int]] = {}
    for k, i in enumerate(ins):
        for v in i.frees:
            release[groups[v]] = k
        for v, ks in i.stream_uses:
            recorded.setdefault(groups[v], set()).update(ks)
    uses: dict[int, list[int]] = {}
    alloc: dict[int, int] = {}
    for op in program.ops:
        if view[op.index]:
            continue
        for r in op.refs():
            uses.setdefault(groups[r], []).append(op.index)
        for o in op.outputs:
            if o >= 0:
                alloc.setdefault(groups[o], ins[op.index].stream)
                uses.setdefault(groups[o], []).append(op.index)
    found = []
    if workers:  # a value's slot: cleared after its last use unless other streams release it too
        users: dict[int, list[int]] = {}
        for op in program.ops:
            for r in list(op.refs()) + [o for o in op.outputs if o >= 0]:
                users.setdefault(r, []).append(op.index)
        for k, i in enumerate(ins):
            released = dict(i.stream_uses)
            for v in i.frees:
                for u in users.get(v, ()):
                    t = ins[u].stream
                    if t != i.stream and t not in released.get(v, ()) and not before(call * n + u, call * n + k):
                        found.append(Hazard("FREE", u, k, v, (t, i.stream), False))
        return found
    for g, k in release.items():
        if g in caller or g in outs or g not in alloc or g in in_arena:
            continue
        home = alloc[g]
        # the point of the allocating stream that the free follows: its last op up to k
        p = next((q for q in range(k, -1, -1) if ins[q].stream == home), None)
        for u in uses.get(g, ()):
            t = ins[u].stream
            if t == home or t in recorded.get(g, ()):
                continue
            if p is None or not before(call * n + u, call * n + p):
                found.append(Hazard("FREE", u, k, next(v for v in ins[k].frees if groups[v] == g),
                                    (t, ins[k].stream), False))
    return found


def without_wait(plan: Any, op: int, k: int) -> Any:
    """``plan`` with the ``k``-th wait of instruction ``op`` left out (for tests: a pruned plan
    has no wait to spare, so the verifier must then name a hazard)."""
    ins = list(plan.instructions)
    w = ins[op].waits
    ins[op] = dataclasses.replace(ins[op], waits=w[:k] + w[k + 1:])
    return dataclasses.replace(plan, instructions=tuple(ins))


def check_plan(plan: Any) -> None:
    """Raise :class:`HazardError` listing the hazards ``plan`` leaves unordered (none: return)."""
    found = verify_plan(plan.program, plan)
    if found:
        text = "\n".join(h.describe(plan.program) for h in found[:10])
        more = f"\n… and {len(found) - 10} more" if len(found) > 10 else ""
        raise HazardError(f"the plan leaves {len(found)} cross-stream hazard(s) unordered:\n{text}{more}")
