"""Which ops can be compiled together: fusible ops, and convex regions of them.

A *fusible* op is one a kernel compiler (Inductor) generates code for: pointwise math,
reductions, norms, softmax and losses, pooling, the optimizer's elementwise ``_foreach_`` math,
views, copies on one device. Everything else stays a library call: matrix products,
convolutions, attention, fused optimizers, collectives, host copies, random ops (their
numbers must be eager's), flowexec's own kernels, ops with data-dependent shapes.

A *region* is a set of fusible ops that can run as one instruction: it is **convex** in the
program's dependency graph (no path leaves the region and comes back), so the ops outside can
be ordered entirely before or after it, and no two regions reach each other. :func:`find_regions`
grows regions greedily in program order (an op merges the regions of those of its producers
that can merge, and joins them), cuts any cycle left between regions, and
:func:`order_with_regions` gives an order of the program in which each region's ops are
adjacent. Both are pure functions of the program.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> def f(x, w):
    ...     h = torch.nn.functional.layer_norm(x, (8,)).relu() + 1
    ...     return (h @ w).sigmoid() * 2
    >>> prog = capture(f, (torch.randn(4, 8), torch.randn(8, 8))).program
    >>> [[prog.ops[i].name.split(".")[1] for i in r.ops] for r in find_regions(prog)]
    [['native_layer_norm', 'relu', 'add'], ['sigmoid', 'mul']]
"""
from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from ..program import Op, Program, Ref
from .copy_in import dense_layout
from .dependencies import alias_groups, chain_ordered_anyway, dependencies, read_write_sets
from .streams import is_view_op

# Fusible ops that carry no `pointwise` or `reduction` tag (by overload packet name).
_FUSIBLE_NAMES = frozenset({
    "native_layer_norm", "native_layer_norm_backward", "native_group_norm", "native_group_norm_backward",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "cudnn_batch_norm",
    "cudnn_batch_norm_backward", "batch_norm_backward",
    "_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data",
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
    "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "avg_pool2d", "avg_pool2d_backward",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward",
    "embedding", "index", "index_select", "gather", "cat", "stack", "constant_pad_nd",
    "_to_copy", "copy", "clone", "fill", "zero", "zeros_like", "ones_like", "full_like", "empty_like",
    "new_zeros", "new_ones", "new_full", "new_empty", "zeros", "ones", "full", "empty", "scalar_tensor",
    "arange", "_unsafe_view", "lift_fresh_copy", "where", "masked_fill",
    "sum", "mean", "amax", "amin", "var", "var_mean", "std", "prod", "any", "all", "logsumexp",
    "cumsum",
})
# Never fused, whatever their tags: metadata-changing in-place ops and stream bookkeeping.
_NEVER = frozenset({"set_", "resize_", "resize_as_", "record_stream", "as_strided_", "_local_scalar_dense"})
_COMPLEX = (torch.complex32, torch.complex64, torch.complex128)


@dataclass(frozen=True, slots=True)
class Region:
    """Ops (positions, in program order) that one fused instruction will run.

    ``inputs``: the tensor values it reads and does not make (in first-use order);
    ``outputs``: the values it makes that anything after it reads, or the program returns;
    ``aliases``: per output, the position in ``inputs`` of the input it *is* (an in-place op's
    result: ``x.add_(y)`` returns ``x``), or -1 for a value the region computes;
    ``mutated``: positions in ``inputs`` of values whose memory it writes in place.
    """

    ops: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    aliases: tuple[int, ...]
    mutated: tuple[int, ...]

    @property
    def computed(self) -> tuple[int, ...]:
        """The outputs the compiled kernel returns (those that are not an input)."""
        return tuple(o for o, a in zip(self.outputs, self.aliases) if a < 0)


def _functional_name(op: Op) -> str:
    """The overload packet's name without the trailing ``_`` of an in-place variant."""
    target = op.target
    name = getattr(target, "_opname", "") or ""
    return name[:-1] if name.endswith("_") and not name.startswith("__") else name


def fusible(op: Op, prog: Program) -> bool:
    """Whether a kernel compiler should generate ``op``'s code (see the module's docstring)."""
    target = op.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
        return False
    name = target._opname
    if name in _NEVER:
        return False
    tags = target.tags
    if torch.Tag.nondeterministic_seeded in tags or torch.Tag.inplace_view in tags:
        return False
    metas = [prog.values[r].meta for r in op.refs()] + [prog.values[o].meta for o in op.outputs if o >= 0]
    real = [m for m in metas if m is not None]
    if not real or len({m.device for m in real}) != 1:
        return False  # copies between devices, host scalars in device math: library ops
    if any(m.dtype in _COMPLEX for m in real):
        return False
    if is_view_op(target):
        return True
    if name == "index" and any(m.dtype == torch.bool for m in real):
        return False  # a mask's result has a data-dependent shape
    functional = _functional_name(op)
    if name.startswith("_foreach_"):
        return True
    if torch.Tag.dynamic_output_shape in tags and name != "index":
        return False
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags:
        return True
    return name in _FUSIBLE_NAMES or functional in _FUSIBLE_NAMES or _pointwise_functional(target)


def _pointwise_functional(target: torch._ops.OpOverload) -> bool:
    """An in-place op (``add_``) whose functional overload (``add``) is pointwise."""
    name = target._opname
    if not name.endswith("_"):
        return False
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    return overload is not None and torch.Tag.pointwise in overload.tags


def edges(prog: Program, groups: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], ...]:
    """Per op, the ops it must follow: the dependency pass's edges (over alias groups) plus the
    producer of every value it reads (a view's reader follows the view op itself); a recomputed
    op (passes/recompute.py) also follows the op before its batch, so that no order of regions
    runs it before the peak it was moved past (its sources are ready long before); and random
    ops (with the generator-state ops of flowexec/rng.py) follow the one captured before them,
    which no buffer orders: regions placed in another order drew a checkpoint's recompute mask
    before its generator state was restored."""
    groups = groups if groups is not None else alias_groups(prog)
    deps = chain_ordered_anyway(prog, dependencies(prog, groups))
    producer = {o: op.index for op in prog.ops for o in op.outputs if o >= 0}
    out = []
    before = -1  # the last op that is not recomputed
    for op in prog.ops:
        d = set(deps[op.index]) | {producer[r] for r in op.refs() if r in producer}
        if op.recomputed and before >= 0:
            d.add(before)
        elif not op.recomputed:
            before = op.index
        out.append(tuple(sorted(d)))
    return tuple(out)


@dataclass(frozen=True)
class _Facts:
    """What every region's inputs and outputs are read from, computed once per program."""

    groups: tuple[int, ...]
    rw: tuple[tuple[frozenset[int], frozenset[int]], ...]  # per op: alias groups read, written
    readers: dict[int, tuple[int, ...]]  # value -> the ops that read it
    returned: frozenset[int]  # values the program returns

    @staticmethod
    def of(prog: Program) -> _Facts:
        """The facts of ``prog``, computed once per program object (its ops and values do not
        change; its state's storages are read as they are at the first call, which a fusion
        pass makes): the pass splits every refused region with them, and a CPU GPT-2 124M
        had 108 splits, 5.9 s of recomputing them."""
        last = _last_facts[0]  # (one read: another thread may replace it)
        if last is not None and last[0]() is prog:
            return last[1]
        facts = _Facts.compute(prog)
        _last_facts[0] = (weakref.ref(prog), facts)
        return facts

    @staticmethod
    def compute(prog: Program) -> _Facts:
        groups = alias_groups(prog)
        readers: dict[int, list[int]] = {}
        for op in prog.ops:
            for r in op.refs():
                readers.setdefault(r, []).append(op.index)
        return _Facts(groups, read_write_sets(prog, groups), {v: tuple(u) for v, u in readers.items()},
                      frozenset(o.id for o in prog.outputs if isinstance(o, Ref)))


_last_facts: list[tuple[weakref.ref[Program], _Facts] | None] = [None]


def alias_groups_of(prog: Program) -> tuple[int, ...]:
    """:func:`~flowexec.passes.dependencies.alias_groups` of ``prog``, as the region passes
    computed them (once per program)."""
    return _Facts.of(prog).groups


def find_regions(prog: Program, min_ops: int = 2, exclude: frozenset[int] = frozenset()) -> tuple[Region, ...]:
    """Convex regions of fusible ops, each with at least ``min_ops`` ops that are not views.

    Greedy in program order (:func:`_grow`), then cut where two regions would reach each other
    (:func:`_without_cycles`). ``exclude``: op positions to keep out. A region that would write
    an input which shares memory with another of its inputs, or return a view of an input, is
    refused the ops that do so (the compiler would not see the aliasing): they are retried as
    library ops.
    """
    facts = _Facts.of(prog)
    deps = edges(prog, facts.groups)
    exclude = set(exclude)
    while True:
        regions = _grow(prog, deps, exclude, min_ops)
        regions = [ops for ops in _without_cycles(regions, deps) if work_count(prog, ops) >= min_ops]
        regions = tuple(_with_io(prog, ops, facts) for ops in regions)
        bad = {i for r in regions for i in _aliased_writes(prog, r, facts)}
        if not bad:
            return regions
        exclude |= bad


def _grow(prog: Program, deps: Sequence[Sequence[int]], exclude: set[int], min_ops: int) -> list[list[int]]:
    """Regions grown in program order: a fusible op merges the regions of its fusible producers
    (the latest first, each one that keeps no path running between them or from them to the op
    outside them) and joins them, or starts a region.

    Regions count as one node each: ``up(q)`` is the bit set of region ids upstream of op q's
    node (``ranc[r]`` for a region r, which grows with it; ``mask[r]``: the ids merged into r).
    A region that grows after a later op read its ancestry can leave a cycle behind, which
    :func:`_without_cycles` removes."""
    n = len(prog.ops)
    parent: list[int] = []  # union-find over region ids
    mask: list[int] = []
    ranc: list[int] = []

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    region = [-1] * n
    anc = [0] * n
    # A region holds no op from before the batch of recomputed ops (those inserted together
    # before one op) of any recomputed op it holds: it runs where its first op is, and a
    # forward's region would run the recomputation in the forward, freeing nothing
    first: list[int] = []  # per region id: its first op
    floor: list[int] = []  # per region id: the start of the latest batch of recomputed ops it holds (-1: none)
    batch = -1

    def up(q: int) -> int:
        if region[q] >= 0:
            r = find(region[q])
            return ranc[r] | mask[r]
        return anc[q]

    for op in prog.ops:
        i = op.index
        if op.recomputed and not (i > 0 and prog.ops[i - 1].recomputed):
            batch = i
        own = batch if op.recomputed else -1
        a = 0
        for p in deps[i]:
            a |= up(p)
        anc[i] = a
        if i in exclude or not fusible(op, prog):
            continue
        cands: list[int] = []
        for p in sorted(deps[i], reverse=True):  # the latest producer's region first
            if region[p] >= 0 and find(region[p]) not in cands:
                cands.append(find(region[p]))

        def allowed(rs: list[int]) -> bool:
            if min(first[r] for r in rs) < max([own] + [floor[r] for r in rs]):
                return False  # (an op from before a batch of recomputed ops it would hold)
            bits = 0
            for r in rs:
                bits |= mask[r]
            if any(ranc[r] & (bits & ~mask[r]) for r in rs):  # one candidate reaches another
                return False
            return all(region[q] >= 0 and find(region[q]) in rs or not (up(q) & bits) for q in deps[i])

        chosen: list[int] = []
        for r in cands:  # as many producers' regions as can merge, the latest first
            if allowed(chosen + [r]):
                chosen.append(r)
        if chosen:
            root = chosen[0]
            for r in chosen[1:]:
                parent[r] = root
                mask[root] |= mask[r]
                ranc[root] |= ranc[r]
                first[root] = min(first[root], first[r])
                floor[root] = max(floor[root], floor[r])
            floor[root] = max(floor[root], own)
        else:
            root = len(parent)
            parent.append(root)
            mask.append(1 << root)
            ranc.append(0)
            first.append(i)
            floor.append(own)
        region[i] = root
        ranc[root] |= a & ~mask[root]
    members: dict[int, list[int]] = {}
    for i in range(n):
        if region[i] >= 0:
            members.setdefault(find(region[i]), []).append(i)
    return [ops for _, ops in sorted(members.items(), key=lambda kv: kv[1][0]) if work_count(prog, ops) >= min_ops]


def work_count(prog: Program, ops: Sequence[int]) -> int:
    """How many of ``ops`` do work (are not views)."""
    return sum(1 for i in ops if not is_view_op(prog.ops[i].target))


def _without_cycles(regions: list[list[int]], deps: Sequence[Sequence[int]]) -> list[list[int]]:
    """``regions`` with members taken out until no two regions reach each other (each one
    convex is not enough: a reaches b's region and b reaches a's). The member taken out is the
    latest of the latest region on a cycle: what remains of that region stays convex."""
    regions = [list(r) for r in regions]
    while True:
        cycle = _a_cycle(regions, deps)
        if cycle is None:
            return [r for r in regions if r]
        r = max(cycle, key=lambda k: regions[k][-1])
        regions[r].pop()


def _a_cycle(regions: list[list[int]], deps: Sequence[Sequence[int]]) -> list[int] | None:
    """The regions on one cycle of the graph whose nodes are regions and single ops, or None."""
    n = len(deps)
    node = list(range(n))  # region k is node n + k
    for k, r in enumerate(regions):
        for i in r:
            node[i] = n + k
    succ: dict[int, set[int]] = {}
    for i, d in enumerate(deps):
        for p in d:
            if node[p] != node[i]:
                succ.setdefault(node[p], set()).add(node[i])
    state: dict[int, int] = {}  # 1: on the stack, 2: done
    for start in sorted(set(node)):
        if start in state:
            continue
        stack = [(start, iter(sorted(succ.get(start, ()))))]
        path = [start]
        state[start] = 1
        while stack:
            v, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[v] = 2
            elif state.get(nxt) == 1:
                loop = path[path.index(nxt):]
                return [x - n for x in loop if x >= n]
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(sorted(succ.get(nxt, ())))))
                path.append(nxt)
    return None


def _with_io(prog: Program, ops: Sequence[int], facts: _Facts) -> Region:
    inside = set(ops)
    made = {o for i in ops for o in prog.ops[i].outputs if o >= 0}
    inputs: list[int] = []
    seen: set[int] = set()
    for i in ops:
        for r in prog.ops[i].refs():
            if r not in made and r not in seen and prog.values[r].meta is not None:
                seen.add(r)
                inputs.append(r)
    outputs = tuple(sorted(v for v in made if v in facts.returned
                           or any(u not in inside for u in facts.readers.get(v, ()))))
    written = set().union(*(facts.rw[i][1] for i in ops)) if ops else set()
    mutated = tuple(k for k, v in enumerate(inputs) if facts.groups[v] in written)
    same = _same_as_input(prog, ops, inputs)
    return Region(tuple(ops), tuple(inputs), outputs, tuple(same.get(o, -1) for o in outputs), mutated)


def _same_as_input(prog: Program, ops: Sequence[int], inputs: Sequence[int]) -> dict[int, int]:
    """Values the region makes that are one of its inputs: the result of an in-place op whose
    written argument is an input (or such a result), as ``x.add_(y)`` returns ``x``."""
    pos = {v: k for k, v in enumerate(inputs)}
    same: dict[int, int] = {}
    for i in ops:
        op = prog.ops[i]
        schema = getattr(op.target, "_schema", None)
        if schema is None or op.unpack:
            continue
        rets = schema.returns
        if len(rets) != 1 or rets[0].alias_info is None or not rets[0].alias_info.is_write or not op.outputs:
            continue
        sets = rets[0].alias_info.before_set
        for k, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set & sets and k < len(op.args):
                src = op.args[k]
                if isinstance(src, Ref):
                    root = pos.get(src.id, same.get(src.id, -1))
                    if root >= 0 and op.outputs[0] >= 0:
                        same[op.outputs[0]] = root
                break
    return same


def _aliased_writes(prog: Program, r: Region, facts: _Facts) -> set[int]:
    """Ops to keep out of ``r`` because the compiler, which takes each input as a buffer of its
    own and returns fresh outputs, would not see an aliasing: a written input that shares
    memory with another input (its writers), and a computed output that views an input or
    another output (the op that makes it)."""
    groups = facts.groups
    written = {groups[r.inputs[k]] for k in r.mutated}
    seen: set[int] = set()
    clash: set[int] = set()
    for v in r.inputs:
        g = groups[v]
        if g in seen and g in written:
            clash.add(g)
        seen.add(g)
    bad = {i for i in r.ops if facts.rw[i][1] & clash}
    made_by = {o: i for i in r.ops for o in prog.ops[i].outputs if o >= 0}
    for o in r.computed:
        g = groups[o]
        if g in seen:
            bad.add(made_by[o])
        seen.add(g)
    return bad


def order_with_regions(prog: Program, regions: Sequence[Region], deps: Sequence[Sequence[int]] | None = None) -> list[list[int]]:
    """The program's ops as a list of steps — a region's ops, or one op — in an order that
    keeps every dependency: regions are convex, so the graph of steps has no cycle. Ties go to
    the step whose first op comes first in the program."""
    deps = deps if deps is not None else edges(prog)
    step_of = list(range(len(prog.ops)))
    steps: dict[int, list[int]] = {i: [i] for i in range(len(prog.ops))}
    for r in regions:
        head = r.ops[0]
        for i in r.ops:
            step_of[i] = head
            steps.pop(i, None)
        steps[head] = list(r.ops)
    preds: dict[int, set[int]] = {s: set() for s in steps}
    for i, d in enumerate(deps):
        for p in d:
            if step_of[p] != step_of[i]:
                preds[step_of[i]].add(step_of[p])
    succs: dict[int, list[int]] = {s: [] for s in steps}
    for s, ps in preds.items():
        for p in ps:
            succs[p].append(s)
    waiting = {s: len(ps) for s, ps in preds.items()}
    ready = [s for s, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    out: list[list[int]] = []
    while ready:
        s = heapq.heappop(ready)
        out.append(steps[s])
        for t in succs[s]:
            waiting[t] -= 1
            if waiting[t] == 0:
                heapq.heappush(ready, t)
    if len(out) != len(steps):
        raise ValueError("regions are not convex: their steps form a cycle")
    return out


def split_region(prog: Program, region: Region) -> tuple[Region, Region]:
    """``region``'s ops in two halves by program order, each a region of its own (a prefix of a
    convex region is convex, and edges only run forward, so no cycle appears)."""
    facts = _Facts.of(prog)
    half = len(region.ops) // 2
    return _with_io(prog, region.ops[:half], facts), _with_io(prog, region.ops[half:], facts)


def without_gapped_views(prog: Program, region: Region) -> Region | None:
    """``region`` without the view ops whose outputs only leave it and leave it with gaps in
    their layout (a slice of a wider value: a kernel whose compiler computes just the slice
    returns it compact, in other strides than the program's); their bases leave it instead and
    the views run after it as library ops. None where there is no such view, or too little
    would be left. Removing an op no op of the region reads keeps the region convex."""
    facts = _Facts.of(prog)
    inside = set(region.ops)

    def gapped_sink(i: int) -> bool:
        op = prog.ops[i]
        if not is_view_op(op.target):
            return False
        outs = [o for o in op.outputs if o >= 0]
        return bool(outs) and all(not any(u in inside for u in facts.readers.get(o, ()))
                                  and _gapped(prog.values[o].meta) for o in outs)

    ops = [i for i in region.ops if not gapped_sink(i)]
    if len(ops) == len(region.ops) or work_count(prog, ops) < 1:
        return None
    return _with_io(prog, ops, facts)


def _gapped(meta: object) -> bool:
    """Whether a value's layout leaves gaps in its memory (a slice of a wider tensor)."""
    shape, stride = getattr(meta, "shape", None), getattr(meta, "stride", None)
    if shape is None or stride is None:
        return False
    return not dense_layout(shape, stride)
