"""Aligned matrix products: pad a product's dimensions to what tensor-core kernels need.

cuBLAS picks its fast kernels when every leading dimension of a product is a multiple of 16
bytes (8 bf16 / fp16 elements, 4 fp32 ones); a vocabulary of 50,257 makes a language model's
head and both its gradient products run on old, slow kernels. As Inductor's ``pad_mm`` does,
:func:`pad_matrix_products` rewrites ``mm`` / ``addmm`` / ``bmm`` whose sizes are misaligned
into the product of zero-padded operands, sliced back to the original size: the slice is a
view, so the rest of the program reads the same values (a column slice has the padded row
stride: :func:`~flowexec.passes.metas.propagate_metas` re-derives every later value's strides,
and a product whose consumers cannot view such a result keeps that dimension unpadded). An
operand that is a transpose (``t``) of a value is padded before the transpose, and a detached
alias as its source, so the two gradient products of one weight share one padded gradient and
the forward's product and the backward's one padded weight. The pads are pointwise ops: with
``fuse="inductor"`` they join the region that makes their operand, which then writes the
padded layout directly.

Which products to pad is the caller's choice (``should_pad``): executables measure both forms
on the GPU once per shape (``flowexec.fusion.pad_for``) and never pad on the CPU.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> prog = capture(lambda a, b: (a @ b).relu(), (torch.randn(4, 5), torch.randn(5, 6))).program
    >>> padded = pad_matrix_products(prog, lambda case: True)
    >>> [op.name.split(".")[1] for op in padded.ops]
    ['constant_pad_nd', 'constant_pad_nd', 'mm', 'slice', 'relu']
    >>> padded.values[padded.outputs[0].id].meta.shape
    (4, 6)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..program import Op, Program, Ref, Role, Value
from .metas import MetaError, propagate_metas
from .streams import is_view_op

aten = torch.ops.aten
_PRODUCTS = {"aten.mm.default": "mm", "aten.addmm.default": "addmm", "aten.bmm.default": "bmm"}
_TRANSPOSES = ("aten.t.default", "aten.transpose.int")
_ALIASES = ("aten.detach.default", "aten.alias.default")  # the same values, shape and strides as their source


@dataclass(frozen=True, slots=True)
class PadCase:
    """One product to decide on: its kind, sizes (``batch`` 0 for 2-D), dtype, device, the
    padded sizes it would get, and whether each operand is column-major (``a_t``, ``b_t``: a
    transpose's view, as a weight gradient's ``t(grad_out)``). The layout decides which size is
    a leading dimension: ``t(g)`` of a ``[8192, 50257]`` gradient has ``m`` = 50,257 as its
    leading dimension, where a row-major ``[50257, 8192]`` operand has an aligned 8,192."""

    kind: str
    batch: int
    m: int
    k: int
    n: int
    dtype: torch.dtype
    device: torch.device
    padded: tuple[int, int, int]
    a_t: bool = False
    b_t: bool = False


def alignment(dtype: torch.dtype) -> int:
    """Elements per 16 bytes: what a leading dimension must be a multiple of."""
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


def pad_cases(prog: Program) -> list[tuple[int, PadCase]]:
    """(op position, case) for every product with a misaligned size (float dtypes only)."""
    out = []
    for op in prog.ops:
        kind = _PRODUCTS.get(op.name)
        if kind is None or op.kwargs:
            continue
        a, b = (op.args[1], op.args[2]) if kind == "addmm" else (op.args[0], op.args[1])
        if not (isinstance(a, Ref) and isinstance(b, Ref)):
            continue
        ma, mb = prog.values[a.id].meta, prog.values[b.id].meta
        if ma is None or mb is None or not ma.dtype.is_floating_point or ma.dtype == torch.float64:
            continue
        al = alignment(ma.dtype)
        m, k, n = ma.shape[-2], ma.shape[-1], mb.shape[-1]
        padded = (_up(m, al), _up(k, al), _up(n, al))
        if padded != (m, k, n):
            out.append((op.index, PadCase(kind, ma.shape[0] if kind == "bmm" else 0, m, k, n, ma.dtype, ma.device, padded,
                                          _column_major(ma.shape, ma.stride), _column_major(mb.shape, mb.stride))))
    return out


def _column_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a product's operand is laid out column-major in its last two dimensions (a
    transpose's view: its rows are the leading dimension)."""
    return len(stride) >= 2 and stride[-1] != 1 and stride[-2] == 1 and shape[-1] > 1


def pad_matrix_products(prog: Program, should_pad: Callable[[PadCase], bool]) -> Program:
    """``prog`` with every misaligned product for which ``should_pad(case)`` is true computed on
    zero-padded operands and sliced back (see the module's docstring).

    A product whose column slice (N padded) reaches an op that cannot take its strides (a view
    merging its rows), or a program output (the caller expects eager's strides), keeps N as it is.
    """
    chosen = {i: c for i, c in pad_cases(prog) if should_pad(c)}
    no_n: set[int] = set()
    while chosen:
        rewritten, made_by = _rewrite(prog, chosen, no_n)
        try:
            out = propagate_metas(rewritten)
        except MetaError as e:
            culprits = _products_upstream(rewritten, [e.op], made_by) - no_n
            if not culprits:
                raise
            no_n |= culprits
        else:
            changed = [o.id for o in prog.outputs if isinstance(o, Ref) and prog.values[o.id].meta is not None
                       and out.values[o.id].meta.stride != prog.values[o.id].meta.stride]
            culprits = _products_upstream(out, changed, made_by, values=True) - no_n
            if not culprits:
                return _drop_dead_views(out)
            no_n |= culprits
        chosen = {i: c for i, c in chosen.items() if i not in no_n or c.padded[:2] != (c.m, c.k)}
    return prog


def _products_upstream(prog: Program, roots: list[int], made_by: dict[int, int], values: bool = False) -> set[int]:
    """The original products (``made_by``: padded value -> product position) whose results reach
    ``roots`` (op positions, or value ids with ``values``) through views and slices alone."""
    producer = {o: op for op in prog.ops for o in op.outputs if o >= 0}
    stack = list(roots) if values else [r.id for i in roots for r in prog.ops[i].refs()]
    found: set[int] = set()
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in made_by:
            found.add(made_by[v])
            continue
        op = producer.get(v)
        if op is not None and is_view_op(op.target):
            stack.extend(op.refs())
    return found


def _drop_dead_views(prog: Program) -> Program:
    """Without the view ops nothing reads any more (a transpose whose product now reads the
    padded operand's)."""
    used = {r for op in prog.ops for r in op.refs()} | {o.id for o in prog.outputs if isinstance(o, Ref)}
    keep = [op for op in prog.ops if not (is_view_op(op.target) and not any(o in used for o in op.outputs if o >= 0))]
    if len(keep) == len(prog.ops):
        return prog
    return dataclasses.replace(prog, ops=tuple(dataclasses.replace(op, index=k) for k, op in enumerate(keep)))


class _Builder:
    def __init__(self, prog: Program) -> None:
        self.prog = prog
        self.values = list(prog.values)
        self.ops: list[Op] = []
        self.pads: dict[tuple[int, tuple[int, ...]], int] = {}
        self.producer = {o: op for op in prog.ops for o in op.outputs if o >= 0}

    def new(self, like: int, suffix: str) -> int:
        v = self.values[like]
        self.values.append(Value(len(self.values), Role.TEMP, None, f"{v.name}_{suffix}"))
        return len(self.values) - 1

    def emit(self, target: Any, args: tuple[Any, ...], out: int, source: str) -> int:
        self.ops.append(Op(len(self.ops), target, args, (), (out,), False, source))
        return out

    def pad(self, vid: int, amounts: tuple[int, ...], source: str) -> int:
        """``vid`` zero-padded at the end of each dimension by ``amounts`` (outermost first);
        a transpose's source is padded instead, and each padding is made once."""
        if not any(amounts):
            return vid
        op = self.producer.get(vid)
        if op is not None and op.name in _ALIASES and isinstance(op.args[0], Ref):
            # (the backward's detached alias of a weight: padded as the weight is, once for both)
            return self.pad(op.args[0].id, amounts, source)
        if op is not None and op.name in _TRANSPOSES and len(amounts) == 2 and isinstance(op.args[0], Ref):
            src = op.args[0].id
            if self.prog.values[src].meta is not None and len(self.prog.values[src].meta.shape) == 2:
                inner = self.pad(src, amounts[::-1], source)
                return self.emit(aten.t.default, (Ref(inner),), self.new(vid, "padT"), source)
        key = (vid, amounts)
        if key not in self.pads:
            spec = [x for d in reversed(amounts) for x in (0, d)]
            self.pads[key] = self.emit(aten.constant_pad_nd.default, (Ref(vid), spec, 0.0), self.new(vid, "pad"), source)
        return self.pads[key]


def _rewrite(prog: Program, chosen: dict[int, PadCase], no_n: set[int]) -> tuple[Program, dict[int, int]]:
    """The program with the chosen products padded, and each padded result's product position."""
    b = _Builder(prog)
    made_by: dict[int, int] = {}
    for op in prog.ops:
        case = chosen.get(op.index)
        if case is None:
            b.ops.append(dataclasses.replace(op, index=len(b.ops)))
            continue
        m2, k2, n2 = case.padded
        if op.index in no_n:
            n2 = case.n
        dm, dk, dn = m2 - case.m, k2 - case.k, n2 - case.n
        lead = (0,) if case.kind == "bmm" else ()
        if case.kind == "addmm":
            bias, x, w = op.args
        else:
            bias, (x, w) = None, op.args
        xa = b.pad(x.id, lead + (dm, dk), op.source)
        wa = b.pad(w.id, lead + (dk, dn), op.source)
        out = op.outputs[0]
        full = b.new(out, "padded")
        made_by[full] = op.index
        if case.kind == "addmm":
            bm = prog.values[bias.id].meta
            bpad = (dn,) if len(bm.shape) == 1 else tuple(d if s != 1 else 0 for d, s in zip((dm, dn), bm.shape))
            b.emit(op.target, (Ref(b.pad(bias.id, bpad, op.source)), Ref(xa), Ref(wa)), full, op.source)
        else:
            b.emit(op.target, (Ref(xa), Ref(wa)), full, op.source)
        cur, rank = full, len(lead) + 2
        cuts = [(rank - 2, case.m, dm), (rank - 1, case.n, dn)]
        cuts = [c for c in cuts if c[2]]
        for j, (dim, size, _) in enumerate(cuts):
            target = out if j == len(cuts) - 1 else b.new(out, "cut")
            cur = b.emit(aten.slice.Tensor, (Ref(cur), dim, 0, size), target, op.source)
        if not cuts:  # K alone was padded: the product is the original value
            b.ops[-1] = dataclasses.replace(b.ops[-1], outputs=(out,))
            made_by[out] = op.index
    return dataclasses.replace(prog, values=tuple(b.values), ops=tuple(b.ops)), made_by
