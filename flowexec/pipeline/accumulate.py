"""Gradient accumulation as a program pass: a backward (or W) program whose last outputs are
weight gradients becomes one that adds them *in place* into accumulators it takes as inputs.

Within a step every micro-batch after the first adds its weight gradients to ``param.grad``.
Eager autograd does that as ``grad += mm(...)``: the matrix product writes a fresh gradient-sized
temporary and a second pass reads it and the accumulator again. :func:`accumulate_gradients`
folds the sum into the product where the gradient is one (``addmm_(acc, a, b)``, through any
transposes between the product and the output), and adds the others (``add_``) at the end: a
weight gradient of a ``Linear`` then costs one GEMM over the accumulator and no temporary,
which on a memory-bound CPU is most of the difference between a backward job and its matrix
products. The values the new program no longer needs (the product, its transposes) are dropped.

Example::

    >>> import torch
    >>> from flowexec.pipeline.split import capture_stage
    >>> cap = capture_stage(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    >>> acc = accumulate_gradients(cap.backward, len(cap.input_grad_positions))
    >>> [op.name for op in acc.ops if op.name.endswith("_.default") or op.name.endswith("_.Tensor")]
    ['aten.addmm_.default', 'aten.add_.Tensor']
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..passes.dependencies import alias_groups
from ..program import Op, Program, Ref, Role, Value, lint
from .split import ancestors, order_edges

_T = torch.ops.aten.t.default
_MM = torch.ops.aten.mm.default
_ADDMM_ = torch.ops.aten.addmm_.default
_ADD_ = torch.ops.aten.add_.Tensor
_COPY_ = torch.ops.aten.copy_.default


def _users(prog: Program) -> dict[int, int]:
    """How many times each value is read by an op or returned."""
    n: dict[int, int] = {}
    for op in prog.ops:
        for r in op.refs():
            n[r] = n.get(r, 0) + 1
    for o in prog.outputs:
        if isinstance(o, Ref):
            n[o.id] = n.get(o.id, 0) + 1
    return n


def _product_of(prog: Program, vid: int, producer: dict[int, int], users: dict[int, int]) -> tuple[int, bool] | None:
    """(index of the ``mm`` op, transposed?) when ``vid`` is ``mm(a, b)`` seen through ``t()``s
    that nothing else reads, else None."""
    flipped = False
    while True:
        p = producer.get(vid)
        if p is None or users.get(vid, 0) != 1:
            return None
        op = prog.ops[p]
        if op.target is _T:
            vid, flipped = op.args[0].id, not flipped
            continue
        return (p, flipped) if op.target is _MM and not op.kwargs else None


def accumulate_gradients(prog: Program, first: int, overwrite: bool = False) -> Program:
    """The program that adds ``prog``'s outputs from position ``first`` on into accumulators.

    It takes ``(*prog.inputs, *accumulators)`` (one per gradient output, of its shape and dtype;
    typically ``param.grad``), writes each gradient into its accumulator in place, and returns
    ``prog.outputs[:first]`` (the input gradients of a backward; nothing for a W program).
    A gradient that is a matrix product (``mm``, through transposes) becomes ``addmm_`` into
    the accumulator, any other an ``add_`` after its last op. ``overwrite=True``: the
    accumulators' old contents are ignored (``addmm_(..., beta=0)``, ``copy_``): the first
    contribution of a step into last step's ``.grad`` buffers, which then need no fresh memory.
    Pure: ``prog`` is not changed.
    """
    grads = [o.id for o in prog.outputs[first:]]
    if not all(isinstance(o, Ref) for o in prog.outputs[first:]):
        raise ValueError("accumulate_gradients: every gradient output must be a value of the program")
    values: list[Value] = list(prog.values)

    def new_value(like: Value, name: str, role: Role = Role.TEMP, shape: tuple[int, ...] | None = None) -> int:
        meta = like.meta if shape is None or like.meta is None else dataclasses.replace(like.meta, shape=shape)
        values.append(Value(len(values), role, meta, name))
        return len(values) - 1

    accs = [new_value(prog.values[g], f"grad_acc{k}", Role.INPUT) for k, g in enumerate(grads)]
    producer = {o: op.index for op in prog.ops for o in op.outputs if o >= 0}
    users = _users(prog)
    at: dict[int, list[Op]] = {}  # op index -> the ops that replace it
    tail: list[Op] = []
    seen: set[int] = set()
    for acc, g in zip(accs, grads):
        found = _product_of(prog, g, producer, users) if g not in seen else None
        seen.add(g)
        if found is None:
            tail.append(Op(0, _COPY_ if overwrite else _ADD_, (Ref(acc), Ref(g)), (),
                           (new_value(values[acc], "copy_" if overwrite else "add_"),)))
            continue
        p, flipped = found
        a, b = prog.ops[p].args
        beta = (("beta", 0),) if overwrite else ()  # BLAS does not read C when beta is 0
        if flipped:  # acc += (a @ b).T  ==  b.T @ a.T
            ta = new_value(values[a.id], "t", shape=tuple(reversed(values[a.id].meta.shape)))
            tb = new_value(values[b.id], "t", shape=tuple(reversed(values[b.id].meta.shape)))
            at[p] = [Op(0, _T, (b,), (), (tb,)), Op(0, _T, (a,), (), (ta,)),
                     Op(0, _ADDMM_, (Ref(acc), Ref(tb), Ref(ta)), beta, (new_value(values[acc], "addmm_"),))]
        else:
            at[p] = [Op(0, _ADDMM_, (Ref(acc), a, b), beta, (new_value(values[acc], "addmm_"),))]
    ops: list[Op] = []
    for op in prog.ops:
        ops.extend(at.get(op.index, [op]))
    ops.extend(tail)
    ops = [dataclasses.replace(op, index=k) for k, op in enumerate(ops)]
    keep_out = tuple(prog.outputs[:first])
    draft = Program(tuple(values), tuple(ops), (*prog.inputs, *accs), keep_out, None, prog.state, prog.consts,
                    prog.shared_storage)
    # Keep what the returned values and the accumulations need; the replaced products go.
    made = {o: op.index for op in ops for o in op.outputs if o >= 0}
    roots = [made[o.id] for o in keep_out if isinstance(o, Ref) and o.id in made]
    roots += [op.index for op in ops if op.target in (_ADDMM_, _ADD_, _COPY_) and op.args[0].id in set(accs)]
    live = ancestors(order_edges(draft, alias_groups(draft)), roots)
    ops = [dataclasses.replace(op, index=k) for k, op in enumerate(op for op in ops if op.index in live)]
    used = {r for op in ops for r in op.refs()} | {o.id for o in keep_out if isinstance(o, Ref)}
    state = {v: t for v, t in prog.state.items() if v in used}
    consts: dict[int, Any] = {v: c for v, c in prog.consts.items() if v in used}
    out = Program(tuple(values), tuple(ops), (*prog.inputs, *accs), keep_out, None, state, consts, prog.shared_storage)
    lint(out)
    return out


__all__ = ["accumulate_gradients"]
