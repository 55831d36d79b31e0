"""Which ops must run before which: aliasing, read/write sets, dependency edges.

Values that share memory (views, in-place results, two state handles on one storage) form an
*alias group*. An op reads every group it takes and writes the groups its schema marks
``(a!)``. Op j depends on op i < j when j reads what i wrote (RAW), writes what i read (WAR)
or writes what i wrote (WAW) — the orders a multi-stream or threaded run must keep.

Example::

    >>> import torch, flowexec
    >>> from flowexec.passes import dependencies
    >>> def f(x):
    ...     y = x.mul(2); x.add_(1); return y
    >>> exe = flowexec.compile(f, torch.ones(3))
    >>> dependencies(exe.program)  # add_ writes x after mul read it
    ((), (0,))
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..program import Program, Ref, Role, written_args


def _find(parent: list[int], i: int) -> int:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


def _arg_values(op_args: tuple[Any, ...], kwargs: tuple, schema: torch.FunctionSchema, with_pos: bool = False) -> list[tuple[Any, list[int]]]:
    """(schema argument — or (position, argument) — , value ids passed to it) per argument holding refs."""
    kw = dict(kwargs)
    out = []
    for i, arg in enumerate(schema.arguments):
        val = op_args[i] if i < len(op_args) else kw.get(arg.name)
        ids = [r.id for r in (val if isinstance(val, (list, tuple)) else [val]) if isinstance(r, Ref)]
        if ids:
            out.append(((i, arg) if with_pos else arg, ids))
    return out


def _is_list(t: Any) -> bool:
    return isinstance(t, torch.ListType)


# Ops whose results may share their input's storage although their schema does not say so:
# ``_unsafe_view`` returns a view of a contiguous input, the ``unsafe_split`` family views of
# its pieces (a GRU's gates on the CPU). Their results join their first argument's group: an
# arena block or a freed buffer under them would be overwritten while they are read.
UNANNOTATED_ALIASES = frozenset({"aten._unsafe_view.default", "aten.unsafe_split.Tensor",
                                 "aten.unsafe_split_with_sizes.default", "aten.unsafe_chunk.default"})


def alias_groups(prog: Program, shared: bool = False) -> tuple[int, ...]:
    """A group id per value: equal ids share (or may share) memory (views by their schema, and
    :data:`UNANNOTATED_ALIASES`). ``shared``: also the inputs and state whose example tensors
    shared a storage at capture (``Program.shared_storage``), which several streams must order
    although program order covers them on one."""
    parent = list(range(len(prog.values)))

    def union(a: int, b: int) -> None:
        ra, rb = _find(parent, a), _find(parent, b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for a, b in prog.shared_storage if shared else ():  # inputs and state on one storage at capture
        union(a, b)
    by_storage: dict[int, int] = {}
    for vid, t in prog.state.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in by_storage:
            union(by_storage[ptr], vid)
        else:
            by_storage[ptr] = vid
    for op in prog.ops:
        schema = getattr(op.target, "_schema", None)
        if schema is None:
            continue
        if op.name in UNANNOTATED_ALIASES and isinstance(op.args[0], Ref):
            for vid in op.outputs:
                if vid >= 0:
                    union(op.args[0].id, vid)
            continue
        args = _arg_values(op.args, op.kwargs, schema)
        rets = list(zip(schema.returns, op.outputs))
        if op.unpack and len(schema.returns) == 1 and _is_list(schema.returns[0].type):
            rets = [(schema.returns[0], vid) for vid in op.outputs]  # split/unbind: every element is a view
        for ret, vid in rets:
            if vid < 0 or ret.alias_info is None:
                continue
            sets = ret.alias_info.before_set
            if not sets and _is_list(ret.type):
                # ``Tensor(a)[]``: the element's alias set is not exposed to Python; the argument
                # marked ``(a -> *)`` is the one its elements view.
                sets = {s for _, ids in args for s in (_.alias_info.before_set if _.alias_info else ())}
            for arg, ids in args:
                if arg.alias_info is not None and sets & arg.alias_info.before_set:
                    for i in ids:
                        union(i, vid)
    return tuple(_find(parent, i) for i in range(len(parent)))


def read_write_sets(prog: Program, groups: tuple[int, ...] | None = None) -> tuple[tuple[frozenset[int], frozenset[int]], ...]:
    """Per op: (alias groups read, alias groups written in place)."""
    groups = groups if groups is not None else alias_groups(prog)
    group = groups.__getitem__
    nothing: frozenset[int] = frozenset()
    result = []
    for op in prog.ops:
        reads = frozenset(map(group, op.refs()))
        schema = getattr(op.target, "_schema", None)
        wpos = written_args(op.target) if schema is not None else ()
        if not wpos:  # (most ops: no argument's walk needed)
            result.append((reads, nothing))
            continue
        writes: set[int] = set()
        for (pos, _), ids in _arg_values(op.args, op.kwargs, schema, with_pos=True):
            if pos in wpos:
                writes.update(map(group, ids))
        result.append((reads, frozenset(writes)))
    return tuple(result)


def dependencies(prog: Program, groups: tuple[int, ...] | None = None,
                 rw: Sequence[tuple[frozenset[int], frozenset[int]]] | None = None) -> tuple[tuple[int, ...], ...]:
    """Per op, the sorted indices of earlier ops it must follow (RAW, WAR, WAW); ``rw``: the
    read and write sets to use instead of :func:`read_write_sets` (streams count more writes)."""
    groups = groups if groups is not None else alias_groups(prog)
    rw = rw if rw is not None else read_write_sets(prog, groups)
    last_writer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    deps: list[tuple[int, ...]] = []
    for i, op in enumerate(prog.ops):
        reads, writes = rw[i]
        d: set[int] = set()
        for g in reads:
            if g in last_writer:
                d.add(last_writer[g])
        for g in writes:
            if g in last_writer:
                d.add(last_writer[g])
            d.update(readers.get(g, ()))
        d.discard(i)
        deps.append(tuple(sorted(d)))
        for g in reads - writes:
            readers.setdefault(g, []).append(i)
        for g in writes:
            last_writer[g] = i
            readers[g] = []
        for vid in op.outputs:
            if vid >= 0 and groups[vid] not in last_writer:
                last_writer[groups[vid]] = i  # creation counts as the first write
    return tuple(deps)


def mutated_state(prog: Program, groups: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """State and input values whose memory some op writes in place."""
    groups = groups if groups is not None else alias_groups(prog)
    written = set()
    for _, w in read_write_sets(prog, groups):
        written |= w
    return tuple(v.id for v in prog.values if v.role in (Role.STATE, Role.INPUT) and groups[v.id] in written)


def ordered_anyway(prog: Program) -> list[int]:
    """Ops whose relative order must stay as captured although no buffer says so: random ops
    (they draw from one generator; also ``flowexec::get_rng_state`` / ``set_rng_state``, which
    carry the same tag) and ops without a schema (opaque callables)."""
    keep = []
    for op in prog.ops:
        tags = getattr(op.target, "tags", ())
        if getattr(op.target, "_schema", None) is None or torch.Tag.nondeterministic_seeded in tags:
            keep.append(op.index)
    return keep


def chain_ordered_anyway(prog: Program, deps: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """``deps`` with each of :func:`ordered_anyway`'s ops depending on the one before it: what
    ops on several worker threads need (one thread, or CUDA streams issued from one host thread
    in program order, draw in captured order without it)."""
    chain = ordered_anyway(prog)
    out = [tuple(d) for d in deps]
    for a, b in zip(chain, chain[1:]):
        if a not in out[b]:
            out[b] = tuple(sorted((*out[b], a)))
    return tuple(out)

