"""Fused GPU kernels (Triton) with PyTorch fallbacks, registered as ``torch.library`` ops.

* :func:`lerp` — ``x + w (y - x)`` with broadcasting and a one-pass fused backward;
  the op ``torch.ops.flowexec.lerp`` serves captured graphs.
* :func:`clear_lerp_plans` — forget lerp's plans and release what its native path keeps
  between calls (per-stream slabs for the atomic sums); the next calls plan again.

Example::

    >>> import torch
    >>> from flowexec.kernels import lerp
    >>> lerp(torch.zeros(3), torch.ones(3), 0.25)
    tensor([0.2500, 0.2500, 0.2500])
"""
from __future__ import annotations

from .lerp import LerpConfig, lerp
from .lerp import clear_plans as clear_lerp_plans

__all__ = ["lerp", "LerpConfig", "clear_lerp_plans"]
