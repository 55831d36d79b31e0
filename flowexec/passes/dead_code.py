"""Ops whose results nothing reads, dropped before planning.

A capture records every op ``fn`` dispatches, including some whose results no later op, output
or write uses: a host read that the capture answered from a lifted hyperparameter
(``weight_decay != 0`` on a tensor that stands for the number) leaves its ``ne`` behind, and a
fake capture's ``torch.tensor`` constants leave a ``lift_fresh_copy`` and ``detach_`` before it.
Eager computes none of them on the device (its hyperparameters are Python numbers), so a
program that ran them would do work eager does not.

An op is dropped only where that cannot change what the program computes:

- its target is an ATen op that draws no random numbers and is not an assertion or another op
  run for its effect (:data:`KEPT`);
- it produces at least one value, and none of them is read later or returned;
- every tensor it writes in place (``detach_`` of a temporary) is a temporary of the program
  whose alias group no later op reads, and that group holds no input, state or output.

Example::

    >>> import torch, flowexec
    >>> from flowexec.capture import capture
    >>> def f(x):
    ...     x.sum()  # computed, never used
    ...     return x * 2
    >>> prog = capture(f, (torch.ones(3),)).program
    >>> [op.name for op in drop_dead_ops(prog).ops]
    ['aten.mul.Tensor']
"""
from __future__ import annotations

import dataclasses

import torch

from ..program import Op, Program, Ref, Role, written_args
from .dependencies import alias_groups

# ATen ops run for what they do, not for what they return: never dropped.
KEPT = ("aten._assert", "aten._functional_assert", "aten.sym_constrain_range", "aten._print", "aten.record_stream",
        "aten.set_", "aten._local_scalar_dense", "aten.sym_")


def drop_dead_ops(prog: Program) -> Program:
    """``prog`` without the ops whose results nothing uses (see the module's docstring); the
    same object where there is none."""
    groups = alias_groups(prog, shared=True)
    used = {o.id for o in prog.outputs if isinstance(o, Ref)}
    pinned = {groups[v] for v in (*prog.inputs, *prog.state, *used)}  # (written: visible outside)
    live = set(pinned)  # alias groups read later (or visible outside)
    keep: list[bool] = [True] * len(prog.ops)
    for k in range(len(prog.ops) - 1, -1, -1):
        op = prog.ops[k]
        if _droppable(op, prog, groups, used, live):
            keep[k] = False
            continue
        for r in op.refs():
            used.add(r)
            live.add(groups[r])
        for o in op.outputs:  # (an in-place op's result aliases what it writes)
            if o >= 0 and o in used:
                live.add(groups[o])
    if all(keep):
        return prog
    ops = [op for op, k in zip(prog.ops, keep) if k]
    return dataclasses.replace(prog, ops=tuple(dataclasses.replace(op, index=i) for i, op in enumerate(ops)))


def _droppable(op: Op, prog: Program, groups: tuple[int, ...], used: set[int], live: set[int]) -> bool:
    target = op.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    if op.name.startswith(KEPT) or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    outs = [o for o in op.outputs if o >= 0]
    if not outs or any(o in used for o in outs):
        return False
    for pos in written_args(target):
        arg = op.args[pos] if pos < len(op.args) else dict(op.kwargs).get(target._schema.arguments[pos].name)
        for r in (arg if isinstance(arg, (list, tuple)) else [arg]):
            if isinstance(r, Ref) and (prog.values[r.id].role is not Role.TEMP or groups[r.id] in live):
                return False
    return True
