"""Substitute flowexec's fused Triton lerp for ATen's in captured programs.

``aten.lerp.Scalar`` / ``aten.lerp.Tensor`` on eligible values (a CUDA device, float16,
bfloat16, float32 or float64, one dtype for all operands) become ``flowexec::lerp``, whose
kernel loads each operand at its own broadcast shape. With ``inplace=True`` the in-place
``aten.lerp_`` (an Adam-style moment update, ``exp_avg.lerp_(grad, 1 - beta1)``) becomes
``flowexec::lerp_``: the same forward kernel writing into ``self``, with the same alias schema,
so dependencies and liveness read it as they read ATen's.

Executables rewrite by default in graph mode on CUDA, where the kernel's GPU time is what
counts, and only where the fused kernel measured faster than ATen's (``only_faster``): an
operand tensor broadcasts (it is smaller than the output, so ATen's strided iterator loads it
element by element while the fused kernel loads it at its own shape) and the output has at
least 2**20 elements. Smaller tensors, and lerps whose operands all have the output's shape, tie
or lose against ATen's kernel; the measurements are in docs/kernels.md ("In place and the program
pass"). ``fuse_lerp=True`` applies the same selection in every mode, ``"all"`` rewrites every
eligible lerp and lerp_, ``False`` none.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> prog = capture(lambda a, b: torch.lerp(a, b, 0.25), (torch.zeros(4), torch.ones(4))).program
    >>> [op.name for op in substitute_lerp(prog, devices=("cpu",)).ops]
    ['flowexec.lerp.default']
"""
from __future__ import annotations

import dataclasses
import math

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


MIN_NUMEL = 1 << 20  # smaller outputs: not measured faster, left to ATen under only_faster


def _measured_faster(op: Op, prog: Program) -> bool:
    """Where the fused kernel measured faster than ATen's: a broadcast operand, a large output."""
    out = prog.values[op.outputs[0]].meta
    numel = math.prod(out.shape)
    sizes = [math.prod(prog.values[a.id].meta.shape) for a in op.args if isinstance(a, Ref)]
    return numel >= MIN_NUMEL and min(sizes) < numel


def substitute_lerp(prog: Program, devices: tuple[str, ...] = ("cuda",), inplace: bool = False,
                    only_faster: bool = False) -> Program:
    """A new Program with eligible ``aten.lerp`` ops replaced by ``flowexec::lerp`` (and, with
    ``inplace``, ``aten.lerp_`` by ``flowexec::lerp_``); with ``only_faster``, only those whose
    shapes measured faster than ATen's."""
    from .. import kernels  # noqa: F401  registers torch.ops.flowexec.lerp and lerp_

    targets = _TARGETS + (_INPLACE_TARGETS if inplace else ())
    ops = []
    changed = False
    for op in prog.ops:
        if _eligible(op, prog, devices, targets) and (not only_faster or _measured_faster(op, prog)):
            fused = torch.ops.flowexec.lerp_.default if op.name in _INPLACE_TARGETS else torch.ops.flowexec.lerp.default
            x, y, w = op.args
            args = (x, y, None, float(w)) if op.name.endswith("Scalar") else (x, y, w, 0.0)
            op = Op(op.index, fused, args, (), op.outputs, False, op.source)
            changed = True
        ops.append(op)
    return dataclasses.replace(prog, ops=tuple(ops)) if changed else prog
