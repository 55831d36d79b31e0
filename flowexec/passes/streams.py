"""Streams and events: which stream runs each op, and waits that order them, none implied by the others.

Planned statically from the program's dependency edges, as seed 000's reviewers asked (not
from a first run). Three pure functions:

* :func:`assign_streams` — an op continues the stream of a predecessor whose stream it follows
  directly (the predecessor is still that stream's last op); an op that no predecessor hands
  its stream to (a root, or a second successor of a fork) starts on the least recently used
  stream. A chain of dependent ops therefore stays on one stream and needs no event;
  independent branches spread over up to ``n_streams`` streams.
* :func:`plan_events` — per op, the waits its cross-stream dependencies need, pruned with
  vector clocks: a dependency is left out when an earlier wait on the op's stream, or another
  wait of the same op, already orders it (waiting on a later point of a stream covers every
  earlier point of it, and whatever that point had waited for). An event is recorded after
  exactly the ops some wait names. No wait of the plan is implied by the others; the plan is
  not always the smallest possible, which could wait earlier on an event that covers more.
* :func:`stream_uses` — for each value the plan frees, the streams other than the one that
  allocated its storage that used it, so the runtime can ``record_stream`` them before the
  ``del`` (frees are then stream-safe: the caching allocator reuses the block only after
  those streams' work).

Stream 0 is whatever stream is current when the program runs; the runtime forks the other
streams from it on entry and joins them back before returning.

Example (two independent branches, joined)::

    >>> deps = ((), (), (0, 1))
    >>> streams = assign_streams(deps, 2)
    >>> streams
    (0, 1, 0)
    >>> plan_events(deps, streams)
    EventPlan(waits=((), (), (0,)), records=((), (0,), ()), n_events=1)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from ..program import Program, Role


def assign_streams(deps: Sequence[Sequence[int]], n_streams: int) -> tuple[int, ...]:
    """A stream in ``range(n_streams)`` for each op (see the module docstring)."""
    if n_streams < 1:
        raise ValueError(f"n_streams must be at least 1, not {n_streams}")
    if n_streams == 1:
        return (0,) * len(deps)
    stream: list[int] = []
    tail: dict[int, int] = {}  # stream -> index of its last op so far
    for j, d in enumerate(deps):
        heads = [i for i in d if tail.get(stream[i]) == i]
        if heads:  # continue a chain; at a join, the lowest stream's (the caller's, where it can)
            s = min(stream[i] for i in heads)
        elif j == 0:
            s = 0
        else:  # a root or a fork: the stream idle longest (never used first, lowest first)
            s = min(range(n_streams), key=lambda k: (tail.get(k, -1), k))
        stream.append(s)
        tail[s] = j
    return tuple(stream)


@dataclass(frozen=True)
class EventPlan:
    """Per op: event ids to wait on before it, event ids to record after it."""

    waits: tuple[tuple[int, ...], ...]
    records: tuple[tuple[int, ...], ...]
    n_events: int


def plan_events(deps: Sequence[Sequence[int]], streams: Sequence[int]) -> EventPlan:
    """The pruned waits and records that order every cross-stream dependency."""
    n_streams = max(streams, default=0) + 1
    seq: list[int] = []  # position of each op on its stream, from 1 (0: the entry fork)
    clock: list[tuple[int, ...]] = []  # per op: the last position of each stream ordered before its end
    known = [[0] * n_streams for _ in range(n_streams)]  # per stream: what its last op has ordered
    count = [0] * n_streams
    waited: list[list[int]] = []  # per op: op indices waited on
    for j, d in enumerate(deps):
        s = streams[j]
        now = known[s]
        latest: dict[int, int] = {}
        for i in d:  # per other stream, its latest dependency not yet ordered for stream s
            t = streams[i]
            if t != s and now[t] < seq[i] and (t not in latest or seq[i] > seq[latest[t]]):
                latest[t] = i
        cands = list(latest.values())
        keep = [c for c in cands
                if not any(o != c and clock[o][streams[c]] >= seq[c] for o in cands)]
        keep.sort()
        merged = list(now)
        for w in keep:
            merged = [max(a, b) for a, b in zip(merged, clock[w])]
        count[s] += 1
        merged[s] = count[s]
        seq.append(count[s])
        clock.append(tuple(merged))
        known[s] = merged
        waited.append(keep)
    event_of: dict[int, int] = {}
    for keep in waited:
        for i in keep:
            if i not in event_of:
                event_of[i] = len(event_of)
    waits = tuple(tuple(event_of[i] for i in keep) for keep in waited)
    records = tuple((event_of[i],) if i in event_of else () for i in range(len(deps)))
    return EventPlan(waits, records, len(event_of))


def unordered(deps: Sequence[Sequence[int]], streams: Sequence[int], plan: EventPlan) -> list[tuple[int, int]]:
    """The dependency edges ``(i, j)`` that ``plan`` leaves unordered (none, for a sound plan).

    Checked by walking the order the plan gives, independently of :func:`plan_events`: program
    order on each stream, the entry fork, and each wait's edge from the op that records its
    event.
    """
    n = len(deps)
    recorder = {e: i for i, rec in enumerate(plan.records) for e in rec}
    prev_on: dict[int, int] = {}
    before: list[set[int]] = []  # per op: every op ordered before it
    for j in range(n):
        s = streams[j]
        preds = set()
        if s in prev_on:
            p = prev_on[s]
            preds |= before[p] | {p}
        for e in plan.waits[j]:
            r = recorder[e]
            preds |= before[r] | {r}
        before.append(preds)
        prev_on[s] = j
    return [(i, j) for j, d in enumerate(deps) for i in d if i not in before[j]]


def _caller_groups(prog: Program, groups: Sequence[int]) -> set[int]:
    """Groups rooted in an input, state or a constant: the caller's storage, never freed here
    (the exit join orders it for the caller)."""
    return {groups[v.id] for v in prog.values if v.role is not Role.TEMP}


def _freed_elsewhere(prog: Program, groups: Sequence[int]) -> set[int]:
    """Groups the plan never frees: the caller's, and the outputs' (the caller frees those)."""
    return _caller_groups(prog, groups) | {groups[r.id] for r in prog.outputs if hasattr(r, "id")}


def _walk(prog: Program, groups: Sequence[int], streams: Sequence[int]) -> Iterator[tuple[dict[int, int], dict[int, set[int]]]]:
    """After each op: the stream that allocated each group so far, and the streams that
    touched it (the same two dicts, updated in place)."""
    alloc: dict[int, int] = {}
    touched: dict[int, set[int]] = {}
    for op, s in zip(prog.ops, streams):
        for r in op.refs():
            touched.setdefault(groups[r], set()).add(s)
        for o in op.outputs:
            if o >= 0:
                alloc.setdefault(groups[o], s)
                touched.setdefault(groups[o], set()).add(s)
        yield alloc, touched


def _after_all(prog: Program, groups: Sequence[int], streams: Sequence[int]) -> tuple[dict[int, int], dict[int, set[int]]]:
    """:func:`_walk`'s dicts once every op has run."""
    final: tuple[dict[int, int], dict[int, set[int]]] = ({}, {})
    for final in _walk(prog, groups, streams):
        pass
    return final


def _other_streams(values: Sequence[int], groups: Sequence[int], skip: set[int], alloc: dict[int, int],
                   touched: dict[int, set[int]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    entry = []
    for v in values:
        g = groups[v]
        if g not in skip and g in alloc:
            others = tuple(sorted(touched[g] - {alloc[g]}))
            if others:
                entry.append((v, others))
    return tuple(entry)


def stream_uses(prog: Program, groups: Sequence[int], streams: Sequence[int],
                frees: Sequence[Sequence[int]]) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]:
    """Per op: for each value freed after it, the streams besides its storage's allocating one
    that touched the storage up to then (empty entries left out). Storage that is the caller's
    (inputs, state, constants) or an output's is never freed here."""
    skip = _freed_elsewhere(prog, groups)
    return tuple(_other_streams(freed, groups, skip, alloc, touched)
                 for (alloc, touched), freed in zip(_walk(prog, groups, streams), frees))


def exit_uses(prog: Program, groups: Sequence[int], streams: Sequence[int],
              values: Sequence[int]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """:func:`stream_uses` for ``values`` that the plan never frees (``gc="none"``): they die
    when the run returns, so the runtime records them after the exit join."""
    return _other_streams(values, groups, _freed_elsewhere(prog, groups), *_after_all(prog, groups, streams))


def side_outputs(prog: Program, groups: Sequence[int], streams: Sequence[int]) -> tuple[int, ...]:
    """Output values whose storage a side stream allocated: the runtime marks them used on the
    caller's stream, so that freeing them later waits for the caller's work."""
    alloc = _after_all(prog, groups, streams)[0]
    caller = _caller_groups(prog, groups)
    ids: list[int] = []
    for r in prog.outputs:
        vid = getattr(r, "id", None)
        if vid is not None and groups[vid] not in caller and alloc.get(groups[vid], 0) != 0 and vid not in ids:
            ids.append(vid)
    return tuple(ids)


def cuda_devices(prog: Program) -> set:
    """The CUDA devices of the program's tensor values (several streams need exactly one)."""
    return {v.meta.device for v in prog.values if v.meta is not None and v.meta.device.type == "cuda"}
