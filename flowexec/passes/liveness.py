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
    # any member; groups rooted in inputs/state or holding an output are not ours to plan.
    group_end: dict[int, int] = {}
    group_bytes: dict[int, int] = {}
    group_start: dict[int, int] = {}
    foreign = {groups[v.id] for v in prog.values if v.role is not Role.TEMP}
    for v in prog.values:
        g = groups[v.id]
        if v.role is not Role.TEMP or g in foreign:
            continue
        end = n_ops if v.id in out_ids or not drop else max(last_use[v.id], producer[v.id])
        group_end[g] = max(group_end.get(g, -1), end)
        if g not in group_start or producer[v.id] < group_start[g]:
            group_start[g] = producer[v.id]
        group_bytes[g] = max(group_bytes.get(g, 0), v.meta.nbytes if v.meta else 0)
    delta = [0] * (n_ops + 2)
    for g, start in group_start.items():
        delta[start] += group_bytes[g]
        delta[group_end[g] + 1] -= group_bytes[g]
    peak = cur = 0
    for d in delta:
        cur += d
        peak = max(peak, cur)
    return Liveness(tuple(last_use), tuple(tuple(f) for f in frees), tuple(live_after), peak, protected)
