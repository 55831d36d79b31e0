"""Activations recomputed where the backward reads them instead of kept across the peak (``recompute=``).

A training step peaks where the forward ends: every activation the backward will read is
held there. Many are cheap to make again from values held there anyway: a bf16 copy of a
parameter (autocast's cast, from the parameter itself), GELU's output (from its input, which
GELU's backward reads), a layer norm's output (from its input, which its backward reads).
torch.compile's partitioner keeps such values out of what the forward saves and recomputes
them in the backward, and Inductor fuses the recomputation into the backward's kernels; that
is most of why its GPT-2 124M step peaks at 8.9 GiB where eager's peaks at 12.2.

:func:`recompute_activations` does the same on a captured program, before fusion, so that
the fusion pass puts each recomputation into the region of the backward op that reads it. It
takes the program's peak position (the storages live there, :mod:`.liveness`), and for each
storage live across it but read by no op at it, largest first, it asks whether the values the
backward reads from it can be made again just before the backward's first read of it (before
the run of fusible ops that ends in that read, whose region then takes them in): by
repeating the (cheap, deterministic, writing nothing: :func:`recomputable`) ops that made them,
from values that are available at that point — inputs, state, or intermediates alive there
anyway, or themselves recomputed, up to a few ops deep, or kept alive until then at the cost
of their bytes. A storage is recomputed where what it frees at the peak exceeds what it keeps
alive there, and nothing it or its sources depend on is written in place between (a parameter
the optimizer updates is read before its update). Then the peak is found again, for a few
rounds. Every later read of a recomputed value reads the copy, so the original dies at its
last forward read.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> w = torch.randn(64, 64, requires_grad=True)
    >>> def step(x):
    ...     h = (x @ w).tanh()          # tanh's output is saved for its backward and for w's gradient
    ...     (h @ w).sum().backward()
    >>> prog, done = recompute_activations(capture(step, (torch.randn(64, 64),)).program)
    >>> [(d.nbytes, [prog.ops[i].name for i in d.ops]) for d in done]  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..program import Op, Program, Ref, Role, Value, lint, written_args
from .dependencies import read_write_sets
from .liveness import Buffer, analyse_liveness, peak_position
from .regions import fusible
from .streams import is_view_op, stream_groups

_UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
DEPTH = 6  # how many ops back a source may be recomputed rather than kept (GPT-2's tanh GELU: x -> tanh is five)
ROUNDS = 4  # peaks found again after each round's recomputations
# Bytes a recomputation may read per byte it frees at the peak: a parameter's bf16 cast reads 2
# (its float32 source), GELU's five ops ~5; a norm recomputed for its 4-KiB statistics ~1,000
WORK = 8


@dataclass(frozen=True, slots=True)
class Recomputed:
    """One storage no longer held across the peak: its ``root`` value and ``nbytes``; the
    ops (positions in the program the pass returned) that make its values again, just
    before the op at ``at`` first reads them; ``kept``: bytes of sources held longer for it."""

    root: int
    nbytes: int
    ops: tuple[int, ...]
    at: int
    kept: int


def recomputable(op: Op, prog: Program) -> bool:
    """Whether ``op`` may run a second time with the same result and nothing else changed: an
    op a kernel compiler would fuse (pointwise, reductions, norms, casts, views), deterministic,
    writing no argument, not an allocation of uninitialised memory and not a foreach op."""
    target = op.target
    if not isinstance(target, torch._ops.OpOverload) or not fusible(op, prog):
        return False
    name = target._opname
    return not (name in _UNINITIALIZED or name.startswith("_foreach_") or written_args(target))


class _Round:
    """One round's facts about the program and the recomputations it has chosen so far."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog
        # One group per storage: inputs and state on one storage count as one (a write to either
        # changes both), and so do ``_unsafe_view`` and split results with their source, which
        # alias_groups leaves apart (their schemas hide the alias)
        self.groups = stream_groups(prog, shared=True)
        n = len(prog.ops)
        self.n = n
        self.live = analyse_liveness(prog, self.groups)
        self.peak_at, self.peak = peak_position(self.live.buffers, n)
        self.producer = [-1] * len(prog.values)
        self.reads: dict[int, list[tuple[int, int]]] = {}  # group -> (position, value) of each read
        self.writes: dict[int, list[int]] = {}  # group -> positions writing it in place
        for op, (_, w) in zip(prog.ops, read_write_sets(prog, self.groups)):
            for o in op.outputs:
                if o >= 0:
                    self.producer[o] = op.index
            for r in op.refs():
                self.reads.setdefault(self.groups[r], []).append((op.index, r))
            for g in w:
                self.writes.setdefault(g, []).append(op.index)
        out_groups = {self.groups[o.id] for o in prog.outputs if isinstance(o, Ref)}
        self.end: dict[int, int] = {}  # group -> last position it is alive (n: to the end)
        for b in self.live.buffers:
            self.end[b.group] = n if b.output else b.end
        for v in prog.values:
            g = self.groups[v.id]
            if v.role is not Role.TEMP or g in out_groups:
                self.end[g] = n
        self.nbytes = {b.group: b.nbytes for b in self.live.buffers}
        self.freed: dict[int, int] = {}  # group -> position after which its original is gone
        self.copies: dict[int, int] = {}  # value -> position its recomputed copy is made at
        self.chosen: list[tuple[int, tuple[int, ...], Buffer, int]] = []  # (position, ops, buffer, bytes kept)

    def written_between(self, g: int, lo: int, hi: int) -> bool:
        return any(lo < w < hi for w in self.writes.get(g, ()))

    def written_after(self, g: int, lo: int) -> bool:
        return any(w > lo for w in self.writes.get(g, ()))

    def available(self, v: int, reader: int, at: int) -> int | None:
        """Bytes held longer at the peak to read value ``v`` at ``at`` where the op at position
        ``reader`` read it (0: alive there anyway), or None where it cannot be read there."""
        g = self.groups[v]
        if self.written_between(g, reader, at):
            return None  # the op would read other contents than it did
        if v in self.copies and self.copies[v] <= at:
            return 0
        if g in self.freed and self.freed[g] < at:
            return None  # its storage is freed before at, and v was not made again
        end = self.end.get(g, self.n)
        if end >= at:
            return 0
        return self.nbytes.get(g, 0) if end < self.peak_at < at else 0

    def cost(self, v: int, reader: int, at: int, depth: int, freeing: int,
             plan: dict[int, tuple[str, int]]) -> int | None:
        """Least bytes held at the peak to have ``v`` at ``at``: read as it is, or made again by
        its producer from sources that are (only that, for a value of the group ``freeing``);
        ``plan`` records the choice (value -> ("keep"|"make", bytes))."""
        if v in plan:
            return 0  # (counted once)
        keep = None if self.groups[v] == freeing else self.available(v, reader, at)
        p = self.producer[v]
        # (every output of the copy stands in for the original's after it: none may be written)
        if keep != 0 and depth < DEPTH and p >= 0 and recomputable(self.prog.ops[p], self.prog) \
                and not any(self.written_after(self.groups[o], p) for o in self.prog.ops[p].outputs if o >= 0):
            trial = dict(plan)
            trial[v] = ("make", 0)
            total: int | None = 0
            for r in dict.fromkeys(self.prog.ops[p].refs()):
                if self.prog.values[r].meta is None:
                    continue
                c = self.cost(r, p, at, depth + 1, freeing, trial)
                if c is None:
                    total = None
                    break
                total += c
            if total is not None and (keep is None or total < keep):
                plan.update(trial)
                plan[v] = ("make", total)
                return total
        if keep is None:
            return None
        plan[v] = ("keep", keep)
        return keep

    def work(self, ops: tuple[int, ...]) -> int:
        """Bytes the ops at ``ops`` read, views aside: what recomputing them costs."""
        return sum(self.prog.values[r].meta.nbytes for i in ops if not is_view_op(self.prog.ops[i].target)
                   for r in dict.fromkeys(self.prog.ops[i].refs()) if self.prog.values[r].meta is not None)

    def consider(self, buf: Buffer) -> None:
        """Recompute ``buf``'s values read after the peak, where that frees more than it keeps."""
        g = buf.group
        reads = self.reads.get(g, [])
        if buf.output or buf.nbytes == 0 or any(p == self.peak_at for p, _ in reads) or buf.start >= self.peak_at:
            return
        late = [(p, v) for p, v in reads if p > self.peak_at]
        if not late or self.written_after(g, buf.start):
            return
        at = min(p for p, _ in late)
        # Made before the run of fusible ops that ends in the first read (after the peak): the
        # region the backward grows there then starts with the copies, and takes them in
        while at - 1 > self.peak_at and not self.prog.ops[at - 1].recomputed \
                and fusible(self.prog.ops[at - 1], self.prog):
            at -= 1
        early = [p for p, _ in reads if p < self.peak_at]
        plan: dict[int, tuple[str, int]] = {}
        total = 0
        for v in dict.fromkeys(v for _, v in late):
            c = self.cost(v, self.producer[v], at, 0, g, plan)
            if c is None:
                return
            total += c
        made = tuple(sorted({self.producer[v] for v, (how, _) in plan.items() if how == "make"}))
        if total >= buf.nbytes or WORK * (buf.nbytes - total) < self.work(made):
            return
        for v, (how, _) in plan.items():
            if how == "make":
                self.copies[v] = at
            else:  # a source read at ``at``: alive until then
                sg = self.groups[v]
                self.end[sg] = max(self.end.get(sg, self.n), at)
                self.reads.setdefault(sg, []).append((at, v))
        self.freed[g] = max(early, default=buf.start)
        self.end[g] = self.freed[g]
        self.chosen.append((at, made, buf, total))


def _rewrite(prog: Program, chosen: list[tuple[int, tuple[int, ...], Buffer, int]]) -> tuple[Program, tuple[Recomputed, ...], dict[int, int]]:
    """``prog`` with each chosen recomputation's ops repeated before its position, every later
    read of a recomputed value reading the copy; what was recomputed, and where each of
    ``prog``'s ops went."""
    inserts: dict[int, set[int]] = {}
    for at, made, _, _ in chosen:
        inserts.setdefault(at, set()).update(made)
    values = list(prog.values)
    ops: list[Op] = []
    to: dict[int, int] = {}
    new_at: dict[int, int] = {}  # original position -> its position in the new program
    copies_at: dict[tuple[int, int], int] = {}  # (position, original op) -> new position of its copy

    def swap(a: Any) -> Any:
        if isinstance(a, Ref):
            return Ref(to.get(a.id, a.id))
        if isinstance(a, (list, tuple)):
            return type(a)(swap(x) for x in a)
        return a

    for i, op in enumerate(prog.ops):
        for j in sorted(inserts.get(i, ())):  # (program order is a valid order for the copies)
            src = prog.ops[j]
            outs = []
            for o in src.outputs:
                if o < 0:
                    outs.append(o)
                    continue
                v = values[o]
                copy = Value(len(values), Role.TEMP, v.meta, f"{v.name}_again")
                values.append(copy)
                outs.append(copy.id)
            copies_at[i, j] = len(ops)
            ops.append(Op(len(ops), src.target, swap(src.args), tuple((k, swap(x)) for k, x in src.kwargs),
                          tuple(outs), src.unpack, src.source, recomputed=True))
            for o, c in zip(src.outputs, outs):
                if o >= 0:
                    to[o] = c
        new_at[i] = len(ops)
        ops.append(dataclasses.replace(op, index=len(ops), args=swap(op.args),
                                       kwargs=tuple((k, swap(x)) for k, x in op.kwargs)))
    out = dataclasses.replace(prog, values=tuple(values), ops=tuple(ops))
    lint(out)
    report = tuple(Recomputed(buf.root, buf.nbytes, tuple(copies_at[at, j] for j in made), new_at[at], kept)
                   for at, made, buf, kept in chosen)
    return out, report, new_at


def recompute_activations(prog: Program, rounds: int = ROUNDS) -> tuple[Program, tuple[Recomputed, ...]]:
    """``prog`` with activations recomputed after its peak where that lowers the peak (module
    docstring), and what was recomputed (positions in the returned program)."""
    done: list[Recomputed] = []
    r = _Round(prog)
    for _ in range(rounds):
        for buf in sorted((b for b in r.live.buffers if b.start <= r.peak_at <= b.end), key=lambda b: -b.nbytes):
            r.consider(buf)
        if not r.chosen:
            break
        new, report, shift = _rewrite(prog, r.chosen)
        after = _Round(new)
        if after.peak >= r.peak:  # (a round that lowers nothing is not kept)
            break
        done = [dataclasses.replace(d, ops=tuple(shift[i] for i in d.ops), at=shift[d.at]) for d in done]
        done += report
        prog, r = new, after
    return prog, tuple(done)
