"""Liveness: when each value is last used, what to drop after each op, planned peak memory.

Computed once at build time (the run loop only looks the results up), in the manner of
torch.fx's ``last_use`` map. Inputs, state, constants and outputs are never dropped; a value
no op reads is dropped right after the op that made it.

Example::

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: x.exp().sum(), torch.ones(4))
    >>> exe.plan.liveness.frees  # exp's result dies after sum (op 1)
    ((), (1,))
"""
from __future__ import annotations

from dataclasses import dataclass

from ..program import Program, Ref, Role


@dataclass(frozen=True, slots=True)
class Liveness:
    """Side table of liveness facts, indexed by op position or value id."""

    last_use: tuple[int, ...]  # per value: index of the last op reading it (-1: never read)
    frees: tuple[tuple[int, ...], ...]  # per op: values dropped right after it
    live_after: tuple[int, ...]  # per op: intermediates alive once its frees are done
    peak_bytes: int  # planned peak of intermediate memory (alias groups counted once)
    protected: frozenset[int]  # values never dropped
    # The largest sum of live bytes over the schedule when every buffer dies at its last use:
    # what no allocator or arena can go under for this order (equal to peak_bytes under gc="fast").
    lower_bound_bytes: int = 0
    buffers: tuple[Buffer, ...] = ()  # the storages this program allocates, with their lifetimes


@dataclass(frozen=True, slots=True)
class Buffer:
    """One storage an op of the program allocates: an alias group rooted in an intermediate.

    ``start``: position of the op that allocates it (``root`` is the value it returns);
    ``end``: the last position any member is read (``n_ops`` when a member is an output);
    ``uses``: every position that reads or writes a member.
    """

    group: int
    root: int
    start: int
    end: int
    nbytes: int
    output: bool  # a member is returned: the storage outlives the call
    uses: tuple[int, ...] = ()


def buffer_lifetimes(prog: Program, groups: tuple[int, ...], last_use: list[int] | tuple[int, ...],
                     drop: bool = True) -> tuple[Buffer, ...]:
    """The program's own storages (alias groups not rooted in inputs, state or constants), each
    with its allocating op, its last use and its size (the largest storage among members: a
    view's meta carries its base's storage size, so views are counted once)."""
    n_ops = len(prog.ops)
    producer = [-1] * len(prog.values)
    uses: dict[int, set[int]] = {}
    for op in prog.ops:
        for o in op.outputs:
            if o >= 0:
                producer[o] = op.index
                uses.setdefault(groups[o], set()).add(op.index)
        for r in op.refs():
            uses.setdefault(groups[r], set()).add(op.index)
    out_ids = {o.id for o in prog.outputs if isinstance(o, Ref)}
    foreign = {groups[v.id] for v in prog.values if v.role is not Role.TEMP}
    info: dict[int, list[int]] = {}  # group -> [start, end, nbytes, root, output]
    for v in prog.values:
        g = groups[v.id]
        if v.role is not Role.TEMP or g in foreign or producer[v.id] < 0:
            continue
        out = v.id in out_ids
        end = n_ops if out or not drop else max(last_use[v.id], producer[v.id])
        nbytes = v.meta.nbytes if v.meta else 0
        rec = info.get(g)
        if rec is None:
            info[g] = [producer[v.id], end, nbytes, v.id, out]
            continue
        rec[1] = max(rec[1], end)
        rec[2] = max(rec[2], nbytes)
        rec[4] = rec[4] or out
        if producer[v.id] < rec[0]:
            rec[0], rec[3] = producer[v.id], v.id
    return tuple(Buffer(g, r[3], r[0], r[1], r[2], bool(r[4]), tuple(sorted(uses.get(g, ()))))
                 for g, r in sorted(info.items(), key=lambda kv: kv[1][0]))


def peak_position(buffers: tuple[Buffer, ...] | list[Buffer], n_ops: int) -> tuple[int, int]:
    """(the first position where it is reached, bytes) of the largest sum of bytes of buffers
    live at one op (a buffer is live from ``start`` to ``end`` inclusive, so an op's inputs and
    outputs count together; one that outlives the ops is live at the last)."""
    delta = [0] * (n_ops + 2)
    for b in buffers:
        delta[b.start] += b.nbytes
        delta[b.end + 1] -= b.nbytes
    at = peak = cur = 0
    for i in range(n_ops):
        cur += delta[i]
        if cur > peak:
            at, peak = i, cur
    return at, peak


def peak_of(buffers: tuple[Buffer, ...] | list[Buffer], n_ops: int) -> int:
    """The largest sum of bytes of buffers live at one op (:func:`peak_position`)."""
    return peak_position(buffers, n_ops)[1]


def analyse_liveness(prog: Program, groups: tuple[int, ...], drop: bool = True) -> Liveness:
    """Last use of every value, the fast-GC free lists, live counts and planned peak bytes.

    ``drop=False`` plans for a run that keeps every intermediate to the end (``gc="none"``).
    """
    n_ops = len(prog.ops)
    last_use = [-1] * len(prog.values)
    producer = [-1] * len(prog.values)
    for op in prog.ops:
        for r in op.refs():
            last_use[r] = op.index
        for o in op.outputs:
            if o >= 0:
                producer[o] = op.index
    out_ids = {o.id for o in prog.outputs if isinstance(o, Ref)}
    protected = frozenset(
        v.id for v in prog.values if v.role is not Role.TEMP or v.id in out_ids
    )
    frees: list[list[int]] = [[] for _ in range(n_ops)]
    for v in prog.values:
        if v.id in protected or producer[v.id] < 0 or not drop:
            continue
        frees[max(last_use[v.id], producer[v.id])].append(v.id)

    # Live intermediates after each op (value-level: what the interpreter still references).
    live_after = []
    alive = 0
    for i, op in enumerate(prog.ops):
        alive += sum(1 for o in op.outputs if o >= 0 and o not in protected)
        alive -= len(frees[i])
        live_after.append(alive)

    # Planned memory (storage level): a group allocated by an op lives until the last use of
    # any member; groups rooted in inputs/state are not ours to plan; outputs live to the end.
    planned = buffer_lifetimes(prog, groups, last_use, drop)
    ideal = planned if drop else buffer_lifetimes(prog, groups, last_use, True)
    return Liveness(tuple(last_use), tuple(tuple(f) for f in frees), tuple(live_after),
                    peak_of(planned, n_ops), protected, peak_of(ideal, n_ops), planned)
