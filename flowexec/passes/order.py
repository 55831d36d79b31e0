"""A memory-aware op order (``order="memory"``): the same program, ops reordered to lower the peak.

Capture records ops in the order Python issued them, which runs parallel branches breadth-first
(every branch's first op, then every branch's second …) and can keep large buffers alive long
after the op that could have consumed them ran. :func:`order_for_memory` list-schedules the
dependency DAG greedily: of the ops whose predecessors have run, it takes the one that adds the
fewest bytes (what it allocates less what dies with it), preferring an op that reads what was
just made (depth-first) and then program order. The result is a valid topological order — every
RAW/WAR/WAW edge of :func:`~flowexec.passes.dependencies.dependencies`, and the program order of
random-number ops (their draws must come in eager's order) and of ops without a schema — and it
is kept only where its planned peak is lower than program order's.

Example::

    >>> import torch, flowexec
    >>> from flowexec.passes.order import order_for_memory
    >>> def f(x):
    ...     a, b = x.exp(), x.sin()      # two branches, issued breadth-first
    ...     return a.sum() + b.sum()
    >>> prog = flowexec.compile(f, torch.ones(1024)).program
    >>> [op.name.split(".")[1] for op in order_for_memory(prog).ops]
    ['exp', 'sum', 'sin', 'sum', 'add']
"""
from __future__ import annotations

import dataclasses

from ..program import Program, lint
from .dependencies import alias_groups, dependencies, ordered_anyway
from .liveness import analyse_liveness, buffer_lifetimes, peak_of


def order_constraints(prog: Program, groups: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """Per op, the ops that must come before it in any order: dependency edges, the op that
    defines each value it takes (the dependency edges are per buffer, and a view's creation is
    not a write of its buffer) and the captured order of random and opaque ops."""
    groups = groups if groups is not None else alias_groups(prog)
    deps = [set(d) for d in dependencies(prog, groups)]
    producer = {o: op.index for op in prog.ops for o in op.outputs if o >= 0}
    for op in prog.ops:
        deps[op.index].update(producer[r] for r in op.refs() if r in producer)
    chain = ordered_anyway(prog)
    for a, b in zip(chain, chain[1:]):
        deps[b].add(a)
    return tuple(tuple(sorted(d)) for d in deps)


def greedy_order(prog: Program, groups: tuple[int, ...] | None = None) -> list[int]:
    """The greedy list schedule: op indices in their new order (see the module docstring)."""
    groups = groups if groups is not None else alias_groups(prog)
    n = len(prog.ops)
    deps = order_constraints(prog, groups)
    live = analyse_liveness(prog, groups)
    bufs = live.buffers
    allocates: list[int] = [0] * n  # bytes an op allocates (the buffers it roots)
    for b in bufs:
        allocates[b.start] += b.nbytes
    remaining: dict[int, int] = {}  # buffer index -> uses not yet scheduled (outputs never die)
    uses_of: list[list[int]] = [[] for _ in range(n)]
    for k, b in enumerate(bufs):
        if not b.output:
            remaining[k] = len(b.uses)
        for u in b.uses:
            uses_of[u].append(k)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [len(d) for d in deps]
    for i, d in enumerate(deps):
        for j in d:
            succ[j].append(i)
    made_at: dict[int, int] = {}  # buffer -> position in the new order where it was allocated
    ready = [i for i in range(n) if indeg[i] == 0]
    order: list[int] = []
    while ready:
        best, best_key = -1, None
        for i in ready:
            freed = sum(bufs[k].nbytes for k in uses_of[i] if remaining.get(k) == 1)
            recent = max((made_at[k] for k in uses_of[i] if k in made_at), default=-1)
            key = (allocates[i] - freed, -recent, i)
            if best_key is None or key < best_key:
                best, best_key = i, key
        ready.remove(best)
        for k in uses_of[best]:
            if k in remaining:
                remaining[k] -= 1
            if bufs[k].start == best:
                made_at[k] = len(order)
        order.append(best)
        for s in succ[best]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(order) != n:  # a cycle cannot come out of a captured program; say so if it does
        raise RuntimeError(f"order_for_memory: dependency cycle among ops {sorted(set(range(n)) - set(order))}")
    return order


def reorder(prog: Program, order: list[int]) -> Program:
    """``prog`` with its ops in ``order`` (old indices), renumbered."""
    ops = tuple(dataclasses.replace(prog.ops[old], index=new) for new, old in enumerate(order))
    return dataclasses.replace(prog, ops=ops)


def planned_peak(prog: Program, groups: tuple[int, ...] | None = None) -> int:
    """The largest sum of live bytes of ``prog`` in its own order (every buffer dying at its last use)."""
    groups = groups if groups is not None else alias_groups(prog)
    return peak_of(buffer_lifetimes(prog, groups, analyse_liveness(prog, groups).last_use), len(prog.ops))


def order_for_memory(prog: Program) -> Program:
    """The program in the greedy memory-aware order where that lowers its planned peak, else as is."""
    groups = alias_groups(prog)
    order = greedy_order(prog, groups)
    if order == list(range(len(prog.ops))):
        return prog
    candidate = reorder(prog, order)
    lint(candidate)  # every value defined before its use
    return candidate if planned_peak(candidate) < planned_peak(prog, groups) else prog
