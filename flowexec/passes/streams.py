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
from .dependencies import UNANNOTATED_ALIASES


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


# -- view-only ops, value edges, the naive plan ---------------------------------------------

_VIEW_CACHE: dict = {}


def stream_groups(prog: Program, shared: bool = False) -> tuple[int, ...]:
    """:func:`~flowexec.passes.dependencies.alias_groups` (which also joins ``_unsafe_view`` and
    the ``unsafe_split`` family, ``UNANNOTATED_ALIASES``), with every result of a view-only op
    (:func:`is_view_op`) joined to the storage of its first tensor argument. One stream never
    needed this; several do, since a view's consumer must be ordered after whoever wrote the
    storage."""
    from .dependencies import _find, alias_groups

    base = alias_groups(prog, shared=shared)
    parent = list(base)
    for op in prog.ops:
        if not is_view_op(op.target):
            continue
        src = next(op.refs(), None)
        if src is None:
            continue
        for o in op.outputs:
            if o >= 0:
                ra, rb = _find(parent, src), _find(parent, o)
                if ra != rb:
                    parent[max(ra, rb)] = min(ra, rb)
    return tuple(_find(parent, i) for i in range(len(parent)))


def is_view_op(target: object) -> bool:
    """Whether an op only makes views, as its schema says: it writes nothing and every tensor it
    returns aliases an argument (``aten.view``, ``t``, ``transpose``, ``expand``, ``slice``,
    ``split`` …). Such an op reads metadata only, so on a stream it needs no wait for the data of
    what it views. ``_unsafe_view`` is not one (:func:`stream_rw_sets`)."""
    hit = _VIEW_CACHE.get(target)
    if hit is None:
        schema = getattr(target, "_schema", None)
        hit = bool(schema is not None and schema.returns
                   and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
                   and not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))
        _VIEW_CACHE[target] = hit
    return hit


def _dispatcher_write_view(target: object) -> bool:
    """A view at run time whose schema has no alias annotation (``_unsafe_view``, ``unsafe_split``:
    ``dependencies.UNANNOTATED_ALIASES``): its results share its argument's storage, and the
    CUDA sanitizer, which reads schemas, counts the op as writing that storage (argument and
    results)."""
    return str(target) in UNANNOTATED_ALIASES


def stream_rw_sets(prog: Program, groups: Sequence[int]) -> tuple[tuple[frozenset[int], frozenset[int]], ...]:
    """:func:`~flowexec.passes.dependencies.read_write_sets` over ``groups`` (:func:`stream_groups`),
    with each unannotated view (:func:`_dispatcher_write_view`) writing the storage it views.

    As PyTorch's CUDA sanitizer sees it: a consumer on another stream that reads through such a
    view is then ordered after the view op (the last access on the producer's stream), not only
    after the producer, at the same count of events (the view follows its producer on its
    stream), so the sanitizer reports no race; planner and verifier use the same sets, so every
    wait stays necessary in both.
    """
    from .dependencies import read_write_sets

    rw = list(read_write_sets(prog, tuple(groups)))
    for op in prog.ops:
        if _dispatcher_write_view(op.target):
            reads, writes = rw[op.index]
            rw[op.index] = (reads, writes | {groups[o] for o in op.outputs if o >= 0} | reads)
    return tuple(rw)


def stream_dependencies(prog: Program, groups: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """:func:`~flowexec.passes.dependencies.dependencies` from :func:`stream_rw_sets`: the
    edges several streams must order."""
    from .dependencies import dependencies

    return dependencies(prog, tuple(groups), stream_rw_sets(prog, groups))


def data_edges(prog: Program, deps: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``deps`` without the edges that touch a view-only op (:func:`is_view_op`): such an op
    neither reads nor writes data, and :func:`~flowexec.passes.dependencies.dependencies` gives
    its consumers their own edges to whoever wrote the storage, so nothing is lost. What is left
    is what device streams must order (the host makes every value in program order)."""
    view = [is_view_op(op.target) for op in prog.ops]
    return tuple(() if view[j] else tuple(i for i in d if not view[i]) for j, d in enumerate(deps))


def value_edges(prog: Program, deps: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """:func:`data_edges` plus, per op, the ops that make the values it takes: where ops run on
    worker threads (CPU streams, threaded mode) a value object exists only once its op has run,
    a view's included."""
    made_by = {o: op.index for op in prog.ops for o in op.outputs if o >= 0}
    data = data_edges(prog, deps)
    return tuple(tuple(sorted(set(data[op.index]) | {made_by[r] for r in op.refs() if r in made_by}))
                 for op in prog.ops)


def cross_edges(deps: Sequence[Sequence[int]], streams: Sequence[int]) -> list[tuple[int, int]]:
    """The dependency edges ``(i, j)`` whose ends are on different streams."""
    return [(i, j) for j, d in enumerate(deps) for i in d if streams[i] != streams[j]]


def naive_events(deps: Sequence[Sequence[int]], streams: Sequence[int]) -> EventPlan:
    """The plan without pruning: one event per cross-stream edge, recorded after its producer
    and waited on before its consumer (seed 000's interpreter before the pruning). Sound, and
    the baseline of ``plan.stats()``'s ``naive_*`` counts and of ``benchmarks/streams.py``."""
    waits: list[list[int]] = [[] for _ in deps]
    records: list[list[int]] = [[] for _ in deps]
    for e, (i, j) in enumerate(cross_edges(deps, streams)):
        records[i].append(e)
        waits[j].append(e)
    return EventPlan(tuple(map(tuple, waits)), tuple(map(tuple, records)), sum(map(len, waits)))


# -- stream roles, and streams="auto" ------------------------------------------------------

ROLES = ("compute", "d2h", "h2d", "comm")


def copy_role(op: object, prog: Program) -> str | None:
    """``"d2h"`` / ``"h2d"`` for a copy between host and CUDA memory (``copy_``, ``_to_copy``),
    ``"comm"`` for a functional collective, None otherwise."""
    name = getattr(op.target, "__name__", "")
    ns = getattr(op.target, "namespace", "")
    if ns == "_c10d_functional":
        return "comm"
    if name not in ("copy_.default", "_to_copy.default", "copy.default", "_copy_from.default"):
        return None

    def dev(a: object) -> object:
        vid = getattr(a, "id", None)
        meta = prog.values[vid].meta if vid is not None else None
        return meta.device.type if meta is not None else None

    if name in ("copy_.default", "_copy_from.default"):  # copy_(dst, src); _copy_from(src, dst)
        dst, src = (op.args[0], op.args[1]) if name == "copy_.default" else (op.args[1], op.args[0])
        d, s = dev(dst), dev(src)
    else:
        s = dev(op.args[0])
        out = op.outputs[0] if op.outputs else -1
        d = prog.values[out].meta.device.type if out >= 0 and prog.values[out].meta is not None else None
    if s == "cuda" and d == "cpu":
        return "d2h"
    if s == "cpu" and d == "cuda":
        return "h2d"
    return None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def op_cost_us(op: object, prog: Program, device: str) -> float:
    """A rough device time for one op, from its kind and sizes: matrix products and
    convolutions by their flops, copies between host and device by the bytes they move over
    the bus, everything else by the bytes it touches, with a floor per launch. Only ratios
    matter (``streams="auto"`` compares a branch with the cost of events)."""
    flops_per_us, bytes_per_us, floor = (3e7, 2e6, 2.0) if device == "cuda" else (2e4, 5e3, 1.0)
    name = getattr(op.target, "__name__", "")
    metas = [prog.values[r].meta for r in op.refs() if prog.values[r].meta is not None]
    outs = [prog.values[o].meta for o in op.outputs if o >= 0 and prog.values[o].meta is not None]
    if is_view_op(op.target) or _dispatcher_write_view(op.target):
        return 0.0
    if device == "cuda" and copy_role(op, prog) in ("d2h", "h2d"):
        # pinned host memory over PCIe: ~33 GB/s per 1 MiB copy on the H200 run (graph mode, copy-heavy step)
        return max(floor, max((m.nbytes for m in metas), default=0) / _BUS_BYTES_PER_US)
    if name.split(".")[0] in ("mm", "addmm", "bmm", "baddbmm", "matmul") and metas and outs:
        a = metas[-2] if name.startswith(("addmm", "baddbmm")) else metas[0]
        k = a.shape[-1] if a.shape else 1
        return max(floor, 2.0 * _numel(outs[0].shape) * k / flops_per_us)
    if name.startswith("convolution") and metas and outs and len(metas) > 1:
        w = metas[1]
        return max(floor, 2.0 * _numel(outs[0].shape) * _numel(w.shape[1:]) / flops_per_us)
    nbytes = sum(m.nbytes for m in metas) + sum(m.nbytes for m in outs)
    return max(floor, nbytes / bytes_per_us)


_BUS_BYTES_PER_US = 3e4

# Host costs of the run modes (µs): (issue per op, per stream call, issued serially by one
# host). A stream call is a stream switch, an event record or wait, or a record_stream before
# a free (:func:`stream_calls`). CUDA trace mode from the H200 run of benchmarks/streams.py:
# ~20 µs per op (four branches, 49 ops: 975 µs; copy-heavy step, 18 ops: 418 µs) and ~7 µs per
# stream call (the copy-heavy step with its 6 copies on a copy stream: 5 calls per copy, 206 µs
# more), so a trace run is usually host-bound and a side stream seldom pays there.
_HOST_COSTS = {("cuda", "trace"): (20.0, 7.0, True), ("cuda", "graph"): (0.0, 0.5, True),
               ("cuda", "threaded"): (8.0, 5.0, False), ("cpu", "trace"): (8.0, 10.0, True),
               ("cpu", "threaded"): (8.0, 10.0, False)}


def stream_calls(deps: Sequence[Sequence[int]], where: Sequence[int]) -> list[int]:
    """Per op, the stream calls a runner makes around it under the pruned plan of ``deps``
    (data edges): a switch where its stream differs from the previous op's, its waits and
    records, and a ``record_stream`` per op of another stream it takes a value from (the value
    is recorded on this stream before its free)."""
    ev = plan_events(deps, where)
    out, prev = [], 0
    for j, d in enumerate(deps):
        out.append(len(ev.waits[j]) + len(ev.records[j]) + len({i for i in d if where[i] != where[j]})
                   + (where[j] != prev))
        prev = where[j]
    return out


def simulate_us(deps: Sequence[Sequence[int]], where: Sequence[int], cost: Sequence[float], host_us: float,
                event_us: float, serial_host: bool) -> float:
    """Estimated time of one run: each stream runs its ops in order, an op starts once its
    dependencies finished (plus ``event_us`` across streams) and — where one host issues every
    op (``serial_host``) — once the host got to it (``host_us`` per op and ``event_us`` per
    stream call, :func:`stream_calls`); otherwise each stream's worker pays those itself."""
    calls = stream_calls(deps, where) if len(set(where)) > 1 else [0] * len(deps)
    t_host = 0.0
    free: dict[int, float] = {}
    finish = [0.0] * len(deps)
    for j, d in enumerate(deps):
        s = where[j]
        ready = 0.0
        issue = host_us + event_us * calls[j]
        if serial_host:
            t_host += issue
            ready = t_host
        for i in d:
            ready = max(ready, finish[i] + (event_us if where[i] != s else 0.0))
        start = max(ready, free.get(s, 0.0))
        finish[j] = free[s] = start + cost[j] + (0.0 if serial_host else issue)
    return max(finish, default=0.0)


def assign_auto(prog: Program, deps: Sequence[Sequence[int]], device: str, mode: str = "trace",
                max_compute: int = 4, min_branch_us: float | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``streams="auto"``: copies between host and device on copy streams, and independent
    branches on extra compute streams, only where the estimate says they pay. Returns (stream
    per op, role per stream).

    Branches are found as :func:`assign_streams` finds them over ``max_compute`` streams (on the
    CPU at most one per core); copies start on one copy stream per direction. A side compute
    stream whose ops' estimated time (:func:`op_cost_us`) is under ``min_branch_us`` (20 µs on
    CUDA, 100 µs on the CPU) goes back to stream 0; then side streams, copy streams included,
    are merged into stream 0 one at a time while :func:`simulate_us` (op costs, the mode's host
    cost per op and per stream call, :data:`_HOST_COSTS`) says the run is no more than 2% slower
    for it; where what is left is not faster than one stream, every op goes to stream 0. So in
    trace mode on CUDA, where the host issuing ops is usually the bottleneck, a copy-heavy step
    stays on one stream; in graph mode its copies go to a copy stream.
    """
    import os

    if device == "cpu":
        max_compute = max(1, min(max_compute, os.cpu_count() or 1))
    if min_branch_us is None:
        min_branch_us = 20.0 if device == "cuda" else 100.0
    host_us, event_us, serial = _HOST_COSTS.get((device, mode), _HOST_COSTS[(device, "trace")])
    edges = data_edges(prog, deps)  # what the event plan orders
    cost = [op_cost_us(op, prog, device) for op in prog.ops]
    compute_ops, where_sub = _assign_compute(prog, deps, max_compute)
    total: dict[int, float] = {}
    for s, j in zip(where_sub, compute_ops):
        total[s] = total.get(s, 0.0) + cost[j]
    cur = [0] * len(prog.ops)
    for s, j in zip(where_sub, compute_ops):
        cur[j] = s if total[s] >= min_branch_us else 0
    role_of = {j: copy_role(op, prog) for j, op in enumerate(prog.ops)}
    copy_ids = {role: max_compute + k for k, role in enumerate(ROLES)}
    for j, role in role_of.items():
        if role is not None:
            cur[j] = copy_ids[role]
    best = simulate_us(edges, cur, cost, host_us, event_us, serial)
    while True:  # greedily merge the side stream whose merge costs least, within 2%
        trials = []
        for s in sorted(set(cur) - {0}):
            merged = [0 if k == s else k for k in cur]
            trials.append((simulate_us(edges, merged, cost, host_us, event_us, serial), merged))
        if not trials:
            break
        t, merged = min(trials, key=lambda x: x[0])
        if t > best * 1.02:
            break
        cur, best = merged, min(best, t)
    if set(cur) != {0} and best >= simulate_us(edges, [0] * len(cur), cost, host_us, event_us, serial):
        cur = [0] * len(cur)
    compute = sorted({s for s in cur if s < max_compute} | {0})
    copies = sorted({s for s in cur if s >= max_compute}, key=lambda s: cur.index(s))  # by first use
    renumber = {s: k for k, s in enumerate(compute + copies)}
    roles = ["compute"] * len(compute) + [ROLES[s - max_compute] for s in copies]
    return tuple(renumber[s] for s in cur), tuple(roles)


def _assign_compute(prog: Program, deps: Sequence[Sequence[int]], n: int) -> tuple[list[int], tuple[int, ...]]:
    """:func:`assign_streams` over the ops that are not copies between host and device (a copy
    hung off a chain must not make the chain's next op look like a fork)."""
    compute_ops = [j for j, op in enumerate(prog.ops) if copy_role(op, prog) is None]
    sub = {j: k for k, j in enumerate(compute_ops)}
    sub_deps = [tuple(sub[i] for i in deps[j] if i in sub) for j in compute_ops]
    return compute_ops, assign_streams(sub_deps, n)


def add_copy_streams(prog: Program, deps: Sequence[Sequence[int]], n_compute: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``streams=N``: N compute streams as :func:`assign_streams` gives them over the compute
    ops, and copies between host and device on copy streams after them (one per direction)."""
    compute_ops, where_sub = _assign_compute(prog, deps, n_compute)
    where = [0] * len(prog.ops)
    for j, s in zip(compute_ops, where_sub):
        where[j] = s
    used = max(where, default=0) + 1
    roles = ["compute"] * used
    role_stream: dict[str, int] = {}
    out = list(where)
    for j, op in enumerate(prog.ops):
        role = copy_role(op, prog)
        if role is not None:
            if role not in role_stream:
                role_stream[role] = len(roles)
                roles.append(role)
            out[j] = role_stream[role]
    # a compute stream left empty by the move would be forked and joined for nothing
    live = sorted(set(out) | {0})
    renumber = {s: k for k, s in enumerate(live)}
    return tuple(renumber[s] for s in out), tuple(roles[s] for s in live)


def release_streams(prog: Program, streams: Sequence[int],
                    frees: Sequence[Sequence[int]]) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]:
    """Worker threads' counterpart of :func:`stream_uses`: per op, for each value freed after
    it, the other streams whose ops took or made that value up to then. The runtime clears the
    value's slot only once each of them has passed that point too (a release item in its
    queue), so a stream never finds a slot another stream emptied early."""
    users: dict[int, set[int]] = {}
    out = []
    for op, s, freed in zip(prog.ops, streams, frees):
        for r in list(op.refs()) + [o for o in op.outputs if o >= 0]:
            users.setdefault(r, set()).add(s)
        out.append(tuple((v, tuple(sorted(users.get(v, set()) - {s}))) for v in freed if users.get(v, set()) - {s}))
    return tuple(out)
