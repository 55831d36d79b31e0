"""Re-derive every value's dtype, shape and strides after a rewrite changed some of them.

A rewrite such as padding a matrix product (``passes/pad.py``) hands later ops a result with
other strides than capture recorded (a column slice of a padded product is not contiguous),
and so every view of it. :func:`propagate_metas` runs the program once on fake tensors —
PyTorch's ``FakeTensorMode``: metadata only, no memory, any device — from its inputs' and
state's metas, and returns the program with the metas it saw. A later pass that compiles
kernels for given strides (fusion) then reads the strides the run will have.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> prog = capture(lambda x: x.t().contiguous() + 1, (torch.randn(2, 3),)).program
    >>> [prog.values[o].meta.stride for op in propagate_metas(prog).ops for o in op.outputs]
    [(1, 3), (2, 1), (2, 1)]
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..program import Program, Ref, TensorMeta


def fake_tensor(meta: TensorMeta, mode: Any) -> torch.Tensor:
    """A tensor of fake mode ``mode`` with ``meta``'s dtype, shape, strides (contiguous where
    unknown) and device."""
    stride = meta.stride
    if stride is None:
        stride = tuple(torch.empty(meta.shape, device="meta").stride())
    with mode:
        return torch.empty_strided(meta.shape, stride, dtype=meta.dtype, device=meta.device)


class MetaError(RuntimeError):
    """An op failed on the fake tensors (``op``: its position), e.g. a view of a tensor whose
    new strides it cannot view."""

    def __init__(self, op: int, cause: BaseException) -> None:
        super().__init__(f"op #{op}: {type(cause).__name__}: {cause}")
        self.op = op


def propagate_metas(prog: Program) -> Program:
    """``prog`` with the metas of every value an op makes re-derived on fake tensors (inputs,
    state and constants keep theirs); a :class:`MetaError` names the op that fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    env: dict[int, Any] = {}
    for vid in (*prog.inputs, *prog.state):
        m = prog.values[vid].meta
        env[vid] = fake_tensor(m, mode) if m is not None else None
    for vid, c in prog.consts.items():
        env[vid] = c

    def arg(a: Any) -> Any:
        if isinstance(a, Ref):
            return env[a.id]
        if isinstance(a, list):
            return [arg(x) for x in a]
        if isinstance(a, tuple):
            return tuple(arg(x) for x in a)
        return a

    values = list(prog.values)
    with mode, torch.no_grad():
        for op in prog.ops:
            try:
                out = op.target(*arg(op.args), **{k: arg(v) for k, v in op.kwargs})
            except Exception as e:
                raise MetaError(op.index, e) from e
            outs = list(out) if op.unpack else [out]
            for vid, t in zip(op.outputs, outs):
                if vid < 0:
                    continue
                env[vid] = t
                if isinstance(t, torch.Tensor):
                    old = values[vid].meta
                    try:
                        nbytes = t.untyped_storage().nbytes()
                    except Exception:  # a layout without storage
                        nbytes = old.nbytes if old is not None else 0
                    meta = TensorMeta(t.dtype, tuple(t.shape), t.device, nbytes, tuple(t.stride()))
                    if meta != old:
                        values[vid] = dataclasses.replace(values[vid], meta=meta)
    return dataclasses.replace(prog, values=tuple(values))
