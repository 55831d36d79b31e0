"""Substitute flowexec's fused Triton lerp for ATen's in captured programs.

``aten.lerp.Scalar`` / ``aten.lerp.Tensor`` on eligible values (a CUDA device, float16,
bfloat16, float32 or float64, one dtype for all operands) become ``flowexec::lerp``, whose
kernel loads each operand at its own broadcast shape. With ``inplace=True`` the in-place
``aten.lerp_`` (an Adam-style moment update, ``exp_avg.lerp_(grad, 1 - beta1)``) becomes
``flowexec::lerp_``: the same forward kernel writing into ``self``, with the same alias schema,
so dependencies and liveness read it as they read ATen's. Executables apply the out-of-place
rewrite in graph mode on CUDA by default (there the kernel's GPU time is what counts, and it
measured at or below ATen's forward in benchmarks/results/ops.json); ``fuse_lerp=True/False``
forces it either way, and ``fuse_lerp="all"`` adds the in-place rewrite, which is opt-in until
it is measured on a GPU in a training step.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> prog = capture(lambda a, b: torch.lerp(a, b, 0.25), (torch.zeros(4), torch.ones(4))).program
    >>> [op.name for op in substitute_lerp(prog, devices=("cpu",)).ops]
    ['flowexec.lerp.default']
"""
from __future__ import annotations

import dataclasses

import torch

from ..program import Op, Program, Ref

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TARGETS = ("aten.lerp.Scalar", "aten.lerp.Tensor")
_INPLACE_TARGETS = ("aten.lerp_.Scalar", "aten.lerp_.Tensor")


def _eligible(op: Op, prog: Program, devices: tuple[str, ...], targets: tuple[str, ...]) -> bool:
    if op.name not in targets or op.kwargs or len(op.args) != 3 or not isinstance(op.args[0], Ref):
        return False
    operands = [a for a in op.args if isinstance(a, Ref)]
    metas = [prog.values[a.id].meta for a in operands] + [prog.values[op.outputs[0]].meta]
    if any(m is None for m in metas):
        return False
    dtypes = {m.dtype for m in metas}
    return len(dtypes) == 1 and dtypes.pop() in _DTYPES and all(m.device.type in devices for m in metas) \
        and all(len(m.shape) <= 4 for m in metas)


def substitute_lerp(prog: Program, devices: tuple[str, ...] = ("cuda",), inplace: bool = False) -> Program:
    """A new Program with eligible ``aten.lerp`` ops replaced by ``flowexec::lerp`` (and, with
    ``inplace``, ``aten.lerp_`` by ``flowexec::lerp_``)."""
    from .. import kernels  # noqa: F401  registers torch.ops.flowexec.lerp and lerp_

    targets = _TARGETS + (_INPLACE_TARGETS if inplace else ())
    ops = []
    changed = False
    for op in prog.ops:
        if _eligible(op, prog, devices, targets):
            fused = torch.ops.flowexec.lerp_.default if op.name in _INPLACE_TARGETS else torch.ops.flowexec.lerp.default
            x, y, w = op.args
            args = (x, y, None, float(w)) if op.name.endswith("Scalar") else (x, y, w, 0.0)
            op = Op(op.index, fused, args, (), op.outputs, False, op.source)
            changed = True
        ops.append(op)
    return dataclasses.replace(prog, ops=tuple(ops)) if changed else prog
