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
- no later op reads what it writes in place (``detach_`` of a temporary: its alias group), and
  that group holds no input, state or output.

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

from ..program import Op, Program, Ref
from .dependencies import alias_groups, read_write_sets

# ATen ops run for what they do, not for what they return: never dropped.
KEPT = ("aten._assert", "aten._functional_assert", "aten.sym_constrain_range", "aten._print", "aten.record_stream",
        "aten.set_", "aten._local_scalar_dense", "aten.sym_")


def drop_dead_ops(prog: Program) -> Program:
    """``prog`` without the ops whose results nothing uses (see the module's docstring); the
    same object where there is none."""
    groups = alias_groups(prog, shared=True)
    writes = [w for _, w in read_write_sets(prog, groups)]
    used = {o.id for o in prog.outputs if isinstance(o, Ref)}
    # alias groups read later, or seen outside the call (inputs, state, outputs: their writes stay)
    live = {groups[v] for v in (*prog.inputs, *prog.state, *used)}
    keep = [True] * len(prog.ops)
    for k in range(len(prog.ops) - 1, -1, -1):
        op = prog.ops[k]
        if _droppable(op) and not any(o in used for o in op.outputs) and not writes[k] & live:
            keep[k] = False
            continue
        used.update(op.refs())
        live.update(groups[r] for r in op.refs())
    if all(keep):
        return prog
    ops = [op for op, k in zip(prog.ops, keep) if k]
    return dataclasses.replace(prog, ops=tuple(dataclasses.replace(op, index=i) for i, op in enumerate(ops)))


def _droppable(op: Op) -> bool:
    """An ATen op that draws no random numbers, is not run for its effect and makes a value."""
    target = op.target
    return (isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"
            and not op.name.startswith(KEPT) and torch.Tag.nondeterministic_seeded not in target.tags
            and any(o >= 0 for o in op.outputs))
