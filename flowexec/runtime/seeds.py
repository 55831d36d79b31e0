"""Attention backwards' dropout seeds, handed over where the kernel expects them.

A fused attention forward with dropout (``aten._scaled_dot_product_efficient_attention``, the
flash one, ``_efficient_attention_forward``) saves its random stream's seed and offset for the
backward as two int64 scalars: host tensors when it ran outside a CUDA graph capture, device
tensors its kernel fills in when it ran inside one (PyTorch's Note [Seed and Offset Device]).
The backward reads them by its *own* capture status: outside a capture it dereferences their
data pointers on the host, inside one it hands the pointers to the kernel.

Eager PyTorch and a whole step in one graph always run both sides alike. flowexec may not: the
backend captures a forward graph and a backward graph apart, and a backward graph warms up
(outside capture) on seeds its forward's graph wrote on the device. Read as host memory, that
device pointer crashed the process (T5 through ``backend="flowexec"`` in graph mode, on an
H100). :func:`with_seeds_for_capture` wraps such an op so that it gets what it reads:

- outside a capture, device scalars are read back to the host (a sync, where only warm-up or a
  trace-mode backward after a captured forward meets it);
- inside a capture, host scalars cannot be read at each replay: the capture is refused with an
  error that says so (a whole step then runs in trace mode; ``graph_capture_failed``).

Example::

    >>> import torch
    >>> op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    >>> seed_positions(op)
    (7, 8)
    >>> seed_positions(torch.ops.aten.mm.default) is None
    True
    >>> seed_positions(torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default) is None
    True
"""
from __future__ import annotations

from typing import Any, Callable

import torch

SEED_ARGS = ("philox_seed", "philox_offset")
# The backwards whose kernels read the seeds by their own capture status (attention_backward.cu,
# flash_api.cpp). cuDNN's attention keeps its seeds on the device either way: not listed.
CAPTURE_STATUS_SEEDS = frozenset({
    "aten._scaled_dot_product_efficient_attention_backward.default",
    "aten._efficient_attention_backward.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
})


def seed_positions(target: Any) -> tuple[int, int] | None:
    """Where one of :data:`CAPTURE_STATUS_SEEDS` takes the dropout seed and offset its forward
    saved, and None for any other op."""
    schema = getattr(target, "_schema", None)
    if schema is None or str(target) not in CAPTURE_STATUS_SEEDS:
        return None
    names = [a.name for a in schema.arguments]
    if not all(n in names for n in SEED_ARGS):
        return None
    seed, offset = (names.index(n) for n in SEED_ARGS)
    return seed, offset


def reads_saved_seeds(prog: Any) -> bool:
    """Whether a Program runs an op of :data:`CAPTURE_STATUS_SEEDS`."""
    return any(seed_positions(op.target) is not None for op in prog.ops)


def _dropout_position(target: Any) -> int | None:
    names = [a.name for a in target._schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


def with_seeds_for_capture(target: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (``target``'s entry point), its seed and offset put where ``target`` reads them
    under the current capture status (module docstring). Ops without seeds come back as they are."""
    where = seed_positions(target)
    if where is None:
        return fn
    seed_at, offset_at = where
    dropout_at = _dropout_position(target)
    name = str(target)

    def call(*args: Any, **kwargs: Any) -> Any:
        p = args[dropout_at] if dropout_at is not None and len(args) > dropout_at else kwargs.get("dropout_p", 1.0)
        if len(args) <= offset_at or not p:
            return fn(*args, **kwargs)  # (no dropout: the seeds are not read)
        seed, offset = args[seed_at], args[offset_at]
        on_device = seed.device.type != "cpu"
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if not on_device:
                raise RuntimeError(
                    f"cannot capture {name} into a CUDA graph: the dropout seed its forward saved is a host "
                    "tensor (the forward ran outside a CUDA graph), which a replay would not read again. Run "
                    "the forward and the backward both in graph mode or both in trace mode")
        elif on_device and seed.dim() == 0:  # (a forward captured in a graph: device scalars)
            args = list(args)
            args[seed_at], args[offset_at] = seed.cpu(), offset.cpu()
        return fn(*args, **kwargs)
    return call
