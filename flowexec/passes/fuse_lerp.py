"""Substitute flowexec's fused Triton lerp for ATen's in captured programs.

``aten.lerp.Scalar`` / ``aten.lerp.Tensor`` on eligible values (a CUDA device, float16,
bfloat16, float32 or float64, one dtype for all operands) become ``flowexec::lerp``, whose
kernel loads each operand at its own broadcast shape. The in-place ``lerp_`` is left alone:
the fused op is out of place, and a copy back would cost more memory traffic than it saves.
Executables apply the pass in graph mode on CUDA by default (there the kernel's GPU time is
what counts, and it measured at or below ATen's forward in benchmarks/results/ops.json);
``fuse_lerp=True/False`` forces it either way.

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


def _eligible(op: Op, prog: Program, devices: tuple[str, ...]) -> bool:
    if op.name not in _TARGETS or op.kwargs or len(op.args) != 3:
        return False
    operands = [a for a in op.args if isinstance(a, Ref)]
    metas = [prog.values[a.id].meta for a in operands] + [prog.values[op.outputs[0]].meta]
    if any(m is None for m in metas):
        return False
    dtypes = {m.dtype for m in metas}
    return len(dtypes) == 1 and dtypes.pop() in _DTYPES and all(m.device.type in devices for m in metas) \
        and all(len(m.shape) <= 4 for m in metas)


def substitute_lerp(prog: Program, devices: tuple[str, ...] = ("cuda",)) -> Program:
    """A new Program with eligible ``aten.lerp`` ops replaced by ``flowexec::lerp``."""
    from .. import kernels  # noqa: F401  registers torch.ops.flowexec.lerp

    fused = torch.ops.flowexec.lerp.default
    ops = []
    changed = False
    for op in prog.ops:
        if _eligible(op, prog, devices):
            x, y, w = op.args
            args = (x, y, None, float(w)) if op.name.endswith("Scalar") else (x, y, w, 0.0)
            op = Op(op.index, fused, args, (), op.outputs, False, op.source)
            changed = True
        ops.append(op)
    return dataclasses.replace(prog, ops=tuple(ops)) if changed else prog
