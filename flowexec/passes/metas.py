"""Re-derive every value's dtype, shape and strides after a rewrite changed some of them.

A rewrite such as padding a matrix product (``passes/pad.py``) hands later ops a result with
other strides than capture recorded (a column slice of a padded product is not contiguous),
and so every view of it. :func:`propagate_metas` runs the program once on fake tensors —
PyTorch's ``FakeTensorMode``: metadata only, no memory, any device — from its inputs' and
state's metas, and returns the program with the metas it saw. A later pass that compiles
kernels for given strides (fusion) then reads the strides the run will have.

Only what a rewrite can have changed runs: an op whose outputs all have metas and whose inputs
kept theirs keeps its outputs' metas (an op's metas follow from its inputs' alone), so padding a
language model's head re-runs the few dozen ops downstream of its products, not the whole step
(0.9 s of a GPT-2 124M build on the H200's host when every op ran). A value an op that runs
reads but nothing ran to make (an input, state, or an unchanged op's output) is made from its
meta, on a storage of its recorded size.

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

from ..program import Program, Ref, TensorMeta, map_nested
from ..snapshot import strided_extent


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


def _on_storage(meta: TensorMeta, mode: Any) -> torch.Tensor:
    """A fake tensor with ``meta``'s strides on a storage of ``meta.nbytes`` (a view's base's
    size, which the views made from it report), or more where those strides need more."""
    if meta.stride is None or meta.nbytes <= 0:
        return fake_tensor(meta, mode)
    item = torch.empty((), dtype=meta.dtype, device="meta").element_size()
    need = strided_extent(meta.shape, meta.stride)
    with mode:
        base = torch.empty(max(-(-meta.nbytes // item), need), dtype=meta.dtype, device=meta.device)
        return base.as_strided(meta.shape, meta.stride)


def propagate_metas(prog: Program, everything: bool = False) -> Program:
    """``prog`` with the metas of the values its ops make re-derived on fake tensors (inputs,
    state and constants keep theirs): of every op with ``everything``, else of the ops with an
    output that has no meta or an input whose meta changed (module docstring). A
    :class:`MetaError` names the op that fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    env: dict[int, Any] = dict(prog.consts)
    changed: set[int] = set()

    def leaf(a: Any) -> Any:
        if isinstance(a, Ref):
            if a.id not in env:  # an input, state, or made by an op that did not run
                meta = prog.values[a.id].meta
                env[a.id] = _on_storage(meta, mode) if meta is not None else None
            return env[a.id]
        return a

    def arg(a: Any) -> Any:
        return map_nested(a, leaf)

    values = list(prog.values)
    with mode, torch.no_grad():
        for op in prog.ops:
            if not (everything or any(o >= 0 and values[o].meta is None for o in op.outputs)
                    or any(r in changed for r in op.refs())):
                continue
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
                        changed.add(vid)
    return dataclasses.replace(prog, values=tuple(values))
