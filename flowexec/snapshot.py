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

Pinning is slow all the same (~0.6 GB/s on the H200's host: 2.4 s of a GPT-2 124M warm build
for the capture's 1.5 GB, 0.9 s more for graph mode's warm-up). Where the device has room
below the peak it has already reached, the copies stay there instead (:class:`DeviceRoom`):
a copy on the device costs microseconds, and the peak does not move.

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
from typing import Callable, Iterable, Sequence

import torch

_BLOCK = 256 << 20  # bytes of pinned memory per block: a power of two, as torch's cache rounds to
_ALIGN = 256


def in_blocks(t: torch.Tensor) -> bool:
    """Whether a tensor's copy goes to the pinned blocks (a CUDA tensor's) rather than a clone."""
    return t.is_cuda


def _new_block(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def block_sizes(sizes: Iterable[int]) -> list[int]:
    """The pinned blocks (bytes each) that copies of ``sizes`` bytes, taken in that order, are cut
    from (as :meth:`HostSnapshot._take` cuts them): one of its own for a copy larger than a
    block, else shared blocks of ``_BLOCK``.

        >>> block_sizes([100, 300 << 20, 200])
        [268435456, 314572800]
    """
    out: list[int] = []
    used = None
    for n in sizes:
        if n > 0:
            new, _, used = _place(used, n)
            if new:
                out.append(new)
    return out


def _place(used: int | None, nbytes: int) -> tuple[int, int, int | None]:
    """Where a copy of ``nbytes`` goes, ``used`` bytes being taken from the last shared block
    (None: there is none yet): (the size of a block to pin for it, 0 where it fits the last
    one; its start in its block; the last shared block's bytes taken after it). A copy larger
    than a block has one of its own; others are aligned to ``_ALIGN`` in shared blocks."""
    if nbytes > _BLOCK:
        return nbytes, 0, used
    start = None if used is None else -(-used // _ALIGN) * _ALIGN
    if start is None or start + nbytes > _BLOCK:
        return _BLOCK, 0, nbytes
    return 0, start, start + nbytes


def prepin(sizes: Iterable[int]) -> threading.Thread | None:
    """Pin the blocks that a snapshot of copies of ``sizes`` bytes will take (:func:`block_sizes`)
    on a thread, and free them into torch's pinned-memory cache, where that snapshot's blocks are
    then found instead of pinned. Pinning runs at ~1 GB/s on the lent GPU hosts (GPT-2 124M's
    1.5 GB of parameters and AdamW state: 1.5 s of a warm first call in graph mode, its
    warm-up's snapshot, by the sampled stacks on an H100) while the interpreter is free for the
    capture that runs meanwhile: torch releases it while it allocates. Returns the thread (None
    where there is nothing to pin), which the snapshot's taker joins first (a CUDA graph's
    capture allows no pinning beside it); a failure leaves the snapshot to pin its own."""
    blocks = block_sizes(sizes)
    if not blocks:
        return None

    def pin() -> None:
        try:
            held = [_new_block(n) for n in blocks]  # (all at once: each frees into the cache below)
            del held
        except Exception:  # (out of pinnable memory, say: the snapshot pins what it can itself)
            pass

    thread = threading.Thread(target=pin, name="flowexec-prepin", daemon=True)
    thread.start()
    return thread


def extent(t: torch.Tensor) -> int:
    """Elements from a tensor's first to one past its last (its strides' reach)."""
    return strided_extent(t.shape, t.stride())


def strided_extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from the first to one past the last of a strided layout (0 where it holds none)."""
    if not all(shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, stride))


def _room_on(device: torch.device) -> int:
    """Bytes between what is allocated on ``device`` now and the most it has held so far."""
    return torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)


class DeviceRoom:
    """How many bytes of snapshot copies may wait on their own CUDA device without lifting its
    peak: half the room between what is allocated there and the most it has held so far
    (``room``: :func:`_room_on`), less ``ahead``, what the run still to come will allocate on
    top (graph mode's warm-up: the plan's peak). The other half is left for what the rest of
    the run allocates beside the copies (an optimizer's temporaries after its first in-place
    write). The room is read again when a copy does not fit, at most once every 16 misses.
    While ``open`` is False every copy goes to host memory (a capture opens it once its
    backward is over).

    A training step's capture saves the parameters and optimizer state at the optimizer step,
    after the backward freed the activations that set the peak: GPT-2 124M at 8 x 1024 has
    ~10 GiB of room for 1.5 GB of copies; a large model at a small batch has little, and its
    copies go to pinned host memory as before.

        >>> DeviceRoom(ahead=0, room=lambda device: 100).take(torch.device("cuda", 0), 40)
        True
        >>> DeviceRoom(ahead=60, room=lambda device: 100).take(torch.device("cuda", 0), 40)
        False
    """

    def __init__(self, ahead: int = 0, room: Callable[[torch.device], int] = _room_on, open: bool = True) -> None:
        self.ahead = ahead
        self._room = room
        # (a capture opens it once its backward is over: a copy made earlier would sit under the
        # activations still to come, which take the room up to the peak again)
        self.open = open
        self._budget: dict[torch.device, int] = {}
        self._used: dict[torch.device, int] = {}
        self._misses = 0

    def take(self, device: torch.device, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` may go on ``device`` (counted against it if so)."""
        if not self.open:
            return False
        used = self._used.get(device, 0)
        budget = self._budget.get(device)
        if budget is None or (used + nbytes > budget and self._misses % 16 == 0):
            # (what is allocated now includes the copies already taken: they stay counted)
            budget = self._budget[device] = used + max(0, self._room(device) - self.ahead) // 2
        if used + nbytes > budget:
            self._misses += 1
            return False
        self._used[device] = used + nbytes
        return True


class HostSnapshot:
    """``(tensor, copy)`` pairs, the copies in host memory: CUDA tensors' in pinned blocks,
    others' beside them (a clone); with ``device_room``, a CUDA tensor's copy stays on its
    device where the room allows (:class:`DeviceRoom`). :meth:`restore` copies each back, last
    saved first."""

    def __init__(self, tensors: Iterable[torch.Tensor] = (), device_room: DeviceRoom | None = None) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._blocks: list[torch.Tensor] = []
        self._used: int | None = None  # bytes taken from the last shared block (None: none yet)
        self._taking = threading.Lock()  # guards _blocks, _used and the device room
        self.device_room = device_room
        self.on_device = 0  # bytes of copies kept on a device
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
        nbytes = extent(t) * t.element_size()
        with self._taking:  # (the autograd engine's device threads save concurrently, one per GPU)
            here = self.device_room is not None and self.device_room.take(t.device, nbytes)
            if here:
                self.on_device += nbytes
            else:
                raw = self._take(nbytes)
        if here:
            saved = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            saved.copy_(t)
            self.pairs.append((t, saved))
            return
        saved = raw.view(t.dtype).as_strided(t.shape, t.stride())
        saved.copy_(t, non_blocking=True)
        self.pairs.append((t, saved))

    def _take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned memory, aligned, from the last block or a new one (:func:`_place`)."""
        new, start, self._used = _place(self._used, nbytes)
        if nbytes > _BLOCK:  # (a block of its own: not shared)
            return _new_block(new)
        if new:
            self._blocks.append(_new_block(new))
        return self._blocks[-1][start:start + nbytes]

    def restore(self) -> None:
        """Copy every saved value back into its tensor (the last saved first)."""
        with torch.no_grad():
            for t, saved in reversed(self.pairs):
                t.copy_(saved, non_blocking=saved.is_pinned() or saved.device == t.device)

    def __len__(self) -> int:
        return len(self.pairs)
