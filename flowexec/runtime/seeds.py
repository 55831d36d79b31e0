"""Attention backwards' dropout seeds, handed over where the kernel expects them.

The memory-efficient attention forward with dropout (``aten._scaled_dot_product_efficient_attention``,
``_efficient_attention_forward``; the flash one on ROCm) saves its random stream's seed and
offset for the backward as two int64 scalars: host tensors when it ran outside a CUDA graph
capture, device tensors its kernel fills in when it ran inside one (PyTorch's Note [Seed and
Offset Device]). The backward reads them by its *own* capture status: outside a capture it
dereferences their data pointers on the host, inside one it hands the pointers to the kernel.
(Flash attention on CUDA keeps a two-element ``rng_state`` on the device either way, and so
does cuDNN's attention: the kernels read device memory whatever the status.)

Eager PyTorch and a whole step in one graph always run both sides alike. flowexec may not: the
backend captures a forward graph and a backward graph apart, and a backward graph warms up
(outside capture) on seeds its forward's graph wrote on the device. Read as host memory, that
device pointer crashed the process (T5 through ``backend="flowexec"`` in graph mode, on an
H100). :func:`with_seeds_for_capture` wraps such an op so that it gets what it reads:

- outside a capture, device scalars are read back to the host (a sync, where only warm-up or a
  trace-mode backward after a captured forward meets it);
- inside a capture, host scalars cannot be read at each replay: the capture is refused with
  :class:`SeedsOnHost` (a whole step, or a backend graph, then runs in trace mode;
  ``graph_capture_failed``).

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
# The backwards whose kernels read 0-dim seeds by their own capture status (attention_backward.cu,
# and flash_api.cpp where flash keeps the old seeds: ROCm). The wrapper touches 0-dim seeds only.
CAPTURE_STATUS_SEEDS = frozenset({
    "aten._scaled_dot_product_efficient_attention_backward.default",
    "aten._efficient_attention_backward.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
})


class SeedsOnHost(RuntimeError):
    """A capture refused: an attention backward's saved dropout seeds are host tensors, which a
    CUDA graph's replays would not read again."""


def seed_positions(target: Any) -> tuple[int, int] | None:
    """Where one of :data:`CAPTURE_STATUS_SEEDS` takes the dropout seed and offset its forward
    saved, and None for any other op."""
    schema = getattr(target, "_schema", None)
    if schema is None or str(target) not in CAPTURE_STATUS_SEEDS:
        return None
    names = [a.name for a in schema.arguments]
    if not all(n in names for n in (*SEED_ARGS, "dropout_p")):
        return None
    seed, offset = (names.index(n) for n in SEED_ARGS)
    return seed, offset


def _to_host(seed: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Device seeds (two int64 scalars) read back to the host in one copy (one sync)."""
    both = torch.stack([seed, offset]).cpu()
    return both[0], both[1]


def with_seeds_for_capture(target: Any, fn: Callable[..., Any], op: Any = None) -> Callable[..., Any]:
    """``fn`` (``target``'s entry point), its seed and offset put where ``target`` reads them
    under the current capture status (module docstring), whether passed by position or by name.
    Ops without seeds come back as they are, and so does one whose program record ``op`` (with
    ``args`` and ``kwargs``) drops nothing: its ``dropout_p``, a constant, settled at lowering."""
    where = seed_positions(target)
    if where is None:
        return fn
    names = [a.name for a in target._schema.arguments]
    seed_at, offset_at = where
    dropout_at = names.index("dropout_p")
    if op is not None:
        p = op.args[dropout_at] if len(op.args) > dropout_at else dict(op.kwargs).get("dropout_p", 1.0)
        if not p:
            return fn  # (no dropout: the seeds are never read)
    name = str(target)
    # (looked up once: the lowering wraps an op once, and a CPU-only process never captures)
    capturing = torch.cuda.is_current_stream_capturing if torch.cuda.is_available() else (lambda: False)

    def get(args: tuple[Any, ...], kwargs: dict[str, Any], at: int) -> Any:
        return args[at] if len(args) > at else kwargs.get(names[at])

    def call(*args: Any, **kwargs: Any) -> Any:
        seed = get(args, kwargs, seed_at)
        if not get(args, kwargs, dropout_at) or not isinstance(seed, torch.Tensor):
            return fn(*args, **kwargs)  # (no dropout: the seeds are not read)
        on_device = seed.device.type != "cpu"
        if capturing():
            if not on_device:
                raise SeedsOnHost(
                    f"cannot capture {name} into a CUDA graph: the dropout seed its forward saved is a host "
                    "tensor (the forward ran outside a CUDA graph), which a replay would not read again. Run "
                    "the forward and the backward both in graph mode or both in trace mode")
        elif on_device and seed.dim() == 0:  # (a forward captured in a graph: device scalars)
            host = _to_host(seed, get(args, kwargs, offset_at))
            args, kwargs = list(args), dict(kwargs)
            for at, value in zip((seed_at, offset_at), host):
                if len(args) > at:
                    args[at] = value
                else:
                    kwargs[names[at]] = value
        return fn(*args, **kwargs)
    return call
