"""Copies of tensors in host memory, to put them back from.

A capture runs the step for real and undoes what it wrote; graph mode's warm-up runs it again
and undoes that too. For a training step what is written is the parameters and the optimizer
state (GPT-2 124M: 1.5 GB), which must not wait on the GPU (they would sit on top of the
step's peak). :class:`HostSnapshot` keeps a CUDA tensor's copy in pinned memory cut from a few
large blocks: pinning a block per tensor cost 1.7 s for GPT-2's 939 tensors on the H200, and
pageable copies ran at ~1.3 GB/s. The blocks go back to torch's pinned-memory cache when the
snapshot is dropped, so the next snapshot of the same build (the warm-up's after the
capture's) pins nothing. A copy is queued on the current stream; restoring queues the copy
back on the current stream, so both keep the stream's order without waiting on the host.

    >>> import torch
    >>> t = torch.ones(2)
    >>> snap = HostSnapshot()
    >>> snap.save(t)
    >>> _ = t.add_(1)
    >>> snap.restore()
    >>> t
    tensor([1., 1.])
"""
from __future__ import annotations

import threading
from typing import Iterable

import torch

_BLOCK = 256 << 20  # bytes of pinned memory per block: a power of two, as torch's cache rounds to
_ALIGN = 256


def in_blocks(t: torch.Tensor) -> bool:
    """Whether a tensor's copy goes to the pinned blocks (a CUDA tensor's) rather than a clone."""
    return t.is_cuda


def _new_block(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def extent(t: torch.Tensor) -> int:
    """Elements from a tensor's first to one past its last (its strides' reach)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


class HostSnapshot:
    """``(tensor, copy)`` pairs, the copies in host memory: CUDA tensors' in pinned blocks,
    others' beside them (a clone). :meth:`restore` copies each back, last saved first."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._blocks: list[torch.Tensor] = []
        self._used = 0  # bytes taken from the last block
        self._taking = threading.Lock()  # guards _blocks and _used
        for t in tensors:
            self.save(t)

    def save(self, t: torch.Tensor) -> None:
        """Keep a copy of ``t`` as it is now (queued on the current stream for a CUDA tensor)."""
        t = t.detach()
        if not in_blocks(t):
            self.pairs.append((t, t.clone()))
            return
        if t.is_conj() or t.is_neg():
            # Its memory, not its lazily conjugated or negated values: after an async copy torch
            # applies the flag to the host copy at once, before the copy has landed in it.
            t = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                     t.shape, t.stride())
        if not t.numel():  # (no block for nothing)
            self.pairs.append((t, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)))
            return
        with self._taking:  # (the autograd engine's device threads save concurrently, one per GPU)
            raw = self._take(extent(t) * t.element_size())
        saved = raw.view(t.dtype).as_strided(t.shape, t.stride())
        saved.copy_(t, non_blocking=True)
        self.pairs.append((t, saved))

    def _take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned memory, aligned, from the last block or a new one."""
        if nbytes > _BLOCK:  # a tensor larger than a block has one of its own
            return _new_block(nbytes)
        start = -(-self._used // _ALIGN) * _ALIGN
        if not self._blocks or start + nbytes > _BLOCK:
            self._blocks.append(_new_block(_BLOCK))
            start = 0
        self._used = start + nbytes
        return self._blocks[-1][start:start + nbytes]

    def restore(self) -> None:
        """Copy every saved value back into its tensor (the last saved first)."""
        with torch.no_grad():
            for t, saved in reversed(self.pairs):
                t.copy_(saved, non_blocking=saved.is_pinned())

    def __len__(self) -> int:
        return len(self.pairs)
