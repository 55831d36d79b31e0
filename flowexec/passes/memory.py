"""Arena offsets (``memory="planned"``): every intermediate gets a fixed place in one buffer per device.

The plan is made offline, from the program, as XLA's buffer assignment and TFLite's planner do:
each storage the program allocates (a :class:`~flowexec.passes.liveness.Buffer`: an alias
group, so views share their base's place) has a lifetime; two buffers *conflict* when neither
is over before the other starts. :func:`assign_offsets` places buffers greedily, best-fit, in
four orders — by decreasing size (XLA's spatial order), by start (its temporal order), by
decreasing lifetime and by decreasing size × lifetime — each best-fit and first-fit, and keeps
the smallest arena.

Over several streams, "over before" means *happens before*: a block is reused only when every
use of its previous tenant, on every stream, is ordered before the new writer by what the plan
makes the streams do — program order on each stream, and an event wait after the record it
waits for (:func:`event_order`). The plan's dependency edges are not that order: the events
are pruned over data edges (a view-only op gets no wait, so a chain through one orders
nothing), and a dependency that no wait carries orders nothing on the device. Between calls
the join at exit and the fork at entry order every use before the next call's first writer;
``flowexec.verify_plan`` checks both, treating values that share arena bytes as one storage.

Which buffers are planned: the lowering makes an op write into its arena view through the op's
``out=`` overload, so a buffer is planned when its allocating op has one (one ``Tensor(a!) out``
argument, the other arguments as the functional op's) and returns one tensor. The others
allocate as usual and are listed in :attr:`MemoryPlan.unplanned` with the reason: ops with
several outputs (``native_layer_norm``, ``native_batch_norm``, ``nll_loss_forward`` …), ops
without an ``out=`` overload, outputs of the program (they outlive the call), buffers some op
reads through explicit strides (``as_strided``: an arena view is laid out contiguously), and
buffers whose shape or strides an op changes in place (``transpose_``: the arena view, made once,
would keep the change into the next call).

Example::

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: (x * 2).exp().sum(), torch.ones(256), memory="planned")
    >>> m = exe.plan.memory
    >>> m.arena_bytes, [p.offset for p in m.placements]
    ((2048,), [0, 1024])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..program import Program, Ref
from .liveness import Buffer, peak_of

CPU_ALIGNMENT = 64  # a cache line; also every dtype's alignment
CUDA_ALIGNMENT = 512  # the caching allocator's rounding: vectorised kernels assume it
_STRIDED_READERS = frozenset({"aten.as_strided.default", "aten.as_strided_.default", "aten._reshape_alias.default",
                              "aten.set_.source_Storage_storage_offset", "aten.set_.source_Tensor",
                              "aten.resize_.default", "aten.as_strided_scatter.default"})


def arena_buffers(prog: Program, groups: Sequence[int], last_use: Sequence[int]) -> tuple[Buffer, ...]:
    """The buffers the arena plans over, by the plan's alias groups: lifetimes end at the last
    use whatever the collector, since an arena block needs no free."""
    from .liveness import buffer_lifetimes

    return buffer_lifetimes(prog, tuple(groups), list(last_use), drop=True)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one planned buffer lives: ``offset`` bytes into arena ``arena``."""

    root: int  # the value its op writes through out=
    group: int
    arena: int
    offset: int
    nbytes: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The arena plan: arena sizes per device, a placement per planned buffer, the rest."""

    devices: tuple[torch.device, ...]
    arena_bytes: tuple[int, ...]  # per device
    placements: tuple[Placement, ...]
    unplanned: tuple[tuple[int, str], ...]  # (root value, why it allocates normally)
    lower_bound_bytes: tuple[int, ...]  # per device: the largest sum of planned bytes live at once
    alignment: tuple[int, ...]
    out_overloads: dict[int, tuple[Any, str]]  # root value -> (out= overload, its out argument's name)
    values: frozenset[int] = frozenset()  # every value whose storage lies in an arena
    strategy: tuple[str, ...] = ()  # per device: which order and fit gave the smallest arena ("size/best", "start/first" …)


def out_variant(target: Any) -> tuple[Any, str] | None:
    """The ``out=`` overload of ``target`` (an OpOverload returning one tensor) and the name of
    its out argument, or None: one ``Tensor(a!)`` out argument, every other argument as the
    functional op's (name and type)."""
    if target in _OUT_CACHE:
        return _OUT_CACHE[target]
    found = None
    schema = getattr(target, "_schema", None)
    if (schema is not None and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor"
            and schema.returns[0].alias_info is None and not schema.is_mutable):
        want = [(a.name, str(a.type)) for a in schema.arguments]
        packet = target.overloadpacket
        for name in packet.overloads():
            ov = getattr(packet, name)
            s = ov._schema
            outs = [a for a in s.arguments if a.is_out]
            if len(outs) == 1 and [(a.name, str(a.type)) for a in s.arguments if not a.is_out] == want:
                found = (ov, outs[0].name)
                break
    _OUT_CACHE[target] = found
    return found


_OUT_CACHE: dict[Any, tuple[Any, str] | None] = {}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def happens_before(deps: Sequence[Sequence[int]], where: Sequence[int] | None = None) -> list[int]:
    """Per op, a bitset of the ops ordered before it by a DAG ``deps`` whose every edge is
    enforced, closed transitively, plus program order on its own stream. Not a plan's order:
    a plan enforces only the edges its events carry (use :func:`instruction_order`)."""
    anc: list[int] = []
    last_on: dict[int, int] = {}
    for i, d in enumerate(deps):
        bits = 0
        preds = list(d)
        if where is not None and where[i] in last_on:
            preds.append(last_on[where[i]])
        for j in preds:
            bits |= anc[j] | (1 << j)
        anc.append(bits)
        if where is not None:
            last_on[where[i]] = i
    return anc


def event_order(streams: Sequence[int], waits: Sequence[Sequence[int]], records: Sequence[Sequence[int]]) -> list[int]:
    """Per op, a bitset of the ops that happen before it when the plan runs: program order on
    its stream, and for each event it waits on, the latest op issued before it (ops are issued
    in program order) that records that event, with everything before that op.

    Example (op 2 on stream 1 waits for op 0's event; op 1 is unordered with op 2)::

        >>> [bin(b) for b in event_order([0, 0, 1], [(), (), (7,)], [(7,), (), ()])]
        ['0b0', '0b1', '0b1']
    """
    anc: list[int] = []
    last_on: dict[int, int] = {}
    last_record: dict[int, int] = {}
    for i, s in enumerate(streams):
        preds = [last_on[s]] if s in last_on else []
        preds += [last_record[e] for e in waits[i] if e in last_record]
        bits = 0
        for j in preds:
            bits |= anc[j] | (1 << j)
        anc.append(bits)
        last_on[s] = i
        for e in records[i]:
            last_record[e] = i
    return anc


def instruction_order(instructions: Sequence[Any]) -> list[int] | None:
    """:func:`event_order` of a plan's instructions, or None when every op is on one stream."""
    streams = [i.stream for i in instructions]
    if len(set(streams)) <= 1:
        return None
    return event_order(streams, [i.waits for i in instructions], [i.records for i in instructions])


def conflict_test(buffers: Sequence[Buffer], anc: list[int] | None,
                  metadata_only: frozenset[int] = frozenset()) -> Callable[[int, int], bool]:
    """``conflicts(a, b)`` for buffer indices: both may be live at once. Without ``anc`` (one
    stream) lifetimes are intervals of program order; with it (:func:`event_order`), a is over
    before b only if every use of a is ordered before b's allocating op. ``metadata_only``: ops
    that touch no bytes (views), left out of the uses."""
    if anc is None:
        return lambda a, b: not (buffers[a].end < buffers[b].start or buffers[b].end < buffers[a].start)
    masks = [sum(1 << u for u in b.uses if u not in metadata_only) for b in buffers]

    def conflicts(a: int, b: int) -> bool:
        ba, bb = buffers[a], buffers[b]
        a_first = masks[a] & ~anc[bb.start] == 0 and ba.start != bb.start
        b_first = masks[b] & ~anc[ba.start] == 0 and ba.start != bb.start
        return not (a_first or b_first)

    return conflicts


def assign_offsets(sizes: Sequence[int], conflicts: Callable[[int, int], bool], order: Sequence[int],
                   alignment: int, first_fit: bool = False) -> tuple[list[int], int]:
    """Best-fit placement of buffers in ``order``: each goes into the smallest gap (between the
    blocks of already-placed buffers it conflicts with) that holds it (``first_fit``: the lowest
    such gap), else past the last one. Returns (offset per buffer, arena size)."""
    offsets = [-1] * len(sizes)
    placed: list[int] = []
    top = 0
    for b in order:
        need = _align(sizes[b], alignment)
        busy = sorted((offsets[p], offsets[p] + _align(sizes[p], alignment)) for p in placed if conflicts(p, b))
        best, best_gap, cur = -1, None, 0
        for lo, hi in busy:
            if lo - cur >= need and (best_gap is None or (lo - cur < best_gap and not first_fit)):
                best, best_gap = cur, lo - cur
            cur = max(cur, hi)
        offsets[b] = best if best >= 0 else cur
        top = max(top, offsets[b] + need)
        placed.append(b)
    return offsets, top


def _row_major(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is the row-major (contiguous) layout of ``shape`` (size-1 dims ignored)."""
    expect = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def plan_memory(prog: Program, groups: Sequence[int], buffers: Sequence[Buffer],
                order: Sequence[int] | None = None) -> MemoryPlan:
    """Place every plannable buffer of ``prog`` in its device's arena (see the module docstring).
    ``order``: when the plan has several streams, its happens-before (:func:`instruction_order`)."""
    strided = {groups[r] for op in prog.ops if op.name in _STRIDED_READERS for r in op.refs()}
    # An arena view is one tensor object, made once for every call: an op that changes its
    # shape or strides in place (transpose_, t_, squeeze_ …: torch's inplace_view tag) would
    # leave the next call's out= writing a tensor of the wrong shape (a GRU's batch_first
    # output, cat then transpose_).
    reshaped = {groups[op.args[0].id]: op.name for op in prog.ops
                if torch.Tag.inplace_view in getattr(op.target, "tags", ()) and op.args and isinstance(op.args[0], Ref)}
    values = prog.values
    root_op = {o: op for op in prog.ops for o in op.outputs if o >= 0}
    planned: list[tuple[Buffer, Any]] = []
    unplanned: list[tuple[int, str]] = []
    outs: dict[int, tuple[Any, str]] = {}
    for b in buffers:
        op = root_op[b.root]
        meta = values[b.root].meta
        why = ""
        if b.output:
            why = "an output of the program (outlives the call)"
        elif meta is None or b.nbytes == 0:
            why = "not a tensor with storage"
        elif op.unpack or len(op.outputs) != 1:
            why = f"{op.name} returns several values (no single out= overload)"
        elif b.group in strided:
            why = "read through explicit strides (as_strided): an arena view is contiguous"
        elif b.group in reshaped:
            why = f"its shape or strides are changed in place ({reshaped[b.group]}): an arena view is made once"
        elif meta.nbytes != _numel(meta.shape) * _itemsize(meta.dtype):
            why = "its storage is not one contiguous tensor of its shape"
        elif meta.stride is not None and not _row_major(meta.shape, meta.stride):
            # (channels_last: a view or kernel after it expects that layout; its readers would
            # see a row-major arena view)
            why = "laid out other than row-major (channels_last): an arena view is row-major"
        else:
            ov = out_variant(op.target)
            if ov is None:
                why = f"{op.name} has no out= overload"
            else:
                outs[b.root] = ov
        if why:
            unplanned.append((b.root, why))
        else:
            planned.append((b, meta.device))
    devices = tuple(sorted({d for _, d in planned}, key=str))
    anc = list(order) if order is not None else None
    views = metadata_ops(prog)
    placements: list[Placement] = []
    sizes_out, bounds, aligns, strategies = [], [], [], []
    for k, dev in enumerate(devices):
        bufs = [b for b, d in planned if d == dev]
        align = CUDA_ALIGNMENT if dev.type == "cuda" else CPU_ALIGNMENT
        conflicts = conflict_test(bufs, anc, views)
        sizes = [b.nbytes for b in bufs]
        by_size = sorted(range(len(bufs)), key=lambda i: (-sizes[i], bufs[i].start))
        by_start = sorted(range(len(bufs)), key=lambda i: (bufs[i].start, -sizes[i]))
        by_length = sorted(range(len(bufs)), key=lambda i: (bufs[i].start - bufs[i].end, -sizes[i]))
        by_area = sorted(range(len(bufs)), key=lambda i: (-(bufs[i].end - bufs[i].start + 1) * sizes[i], bufs[i].start))
        best = None
        for name, order in (("size", by_size), ("start", by_start), ("length", by_length), ("area", by_area)):
            for fit in ("best", "first"):
                offsets, top = assign_offsets(sizes, conflicts, order, align, first_fit=fit == "first")
                if best is None or top < best[1]:
                    best = (offsets, top, f"{name}/{fit}")
        offsets, top, name = best
        placements += [Placement(b.root, b.group, k, offsets[i], b.nbytes, b.start, b.end) for i, b in enumerate(bufs)]
        sizes_out.append(top)
        bounds.append(peak_of(bufs, len(prog.ops)))
        aligns.append(align)
        strategies.append(name)
    placed = {p.group for p in placements}
    inside = frozenset(v for v in range(len(values)) if groups[v] in placed)
    return MemoryPlan(devices, tuple(sizes_out), tuple(placements), tuple(unplanned), tuple(bounds), tuple(aligns),
                      outs, inside, tuple(strategies))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ArenaError(AssertionError):
    """An arena plan breaks an invariant: two buffers live at once overlap, or one is misaligned."""


def metadata_ops(prog: Program) -> frozenset[int]:
    """The ops that touch no bytes (views, :func:`~flowexec.passes.streams.is_view_op`)."""
    from .streams import is_view_op

    return frozenset(op.index for op in prog.ops if is_view_op(op.target))


def check_arena(plan: MemoryPlan, buffers: Sequence[Buffer], order: Sequence[int] | None = None,
                metadata_only: frozenset[int] = frozenset()) -> None:
    """Raise :class:`ArenaError` if two planned buffers that may be live at once overlap in an
    arena, a placement is misaligned, or one runs past its arena's end. ``order``: the plan's
    happens-before over several streams (:func:`instruction_order`)."""
    anc = list(order) if order is not None else None
    by_group = {b.group: b for b in buffers}
    for k in range(len(plan.devices)):
        ps = [p for p in plan.placements if p.arena == k]
        bufs = [by_group[p.group] for p in ps]
        conflicts = conflict_test(bufs, anc, metadata_only)
        for i, p in enumerate(ps):
            if p.offset % plan.alignment[k]:
                raise ArenaError(f"buffer of v{p.root} at offset {p.offset} breaks alignment {plan.alignment[k]}")
            if p.offset + p.nbytes > plan.arena_bytes[k]:
                raise ArenaError(f"buffer of v{p.root} ends at {p.offset + p.nbytes}, past the arena's {plan.arena_bytes[k]} bytes")
            for j in range(i):
                q = ps[j]
                if conflicts(i, j) and p.offset < q.offset + q.nbytes and q.offset < p.offset + p.nbytes:
                    raise ArenaError(f"v{p.root} [{p.offset}, {p.offset + p.nbytes}) and v{q.root} "
                                     f"[{q.offset}, {q.offset + q.nbytes}) overlap while both are live")
