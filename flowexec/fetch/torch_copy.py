"""``torch``, the back-end that needs nothing beyond torch: ``copy_(non_blocking=True)`` into
pinned memory and a ``torch.cuda.Event`` per slot. It is the fallback where the driver paths do
not load (no ``libcuda.so.1`` to open, a build whose device is not NVIDIA's); on the H200 it
measured 3-4x slower than ``.item()`` (docs/fetch.md), so choosing it warns."""
from __future__ import annotations

import torch

from .slots import SLOT, SlotView, Slots, Spec


class TorchSlots(Slots):
    """``n`` slots in one pinned tensor, a copy and an event each."""

    name = "torch"

    def __init__(self, device_index: int, n: int) -> None:
        self.device_index = device_index
        self._host = torch.zeros(n * SLOT, dtype=torch.uint8, pin_memory=True)
        base = self._host.data_ptr()
        self.views = [SlotView(base + i * SLOT) for i in range(n)]
        self._events = [torch.cuda.Event() for _ in range(n)]
        self._dst: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._seq = 0

    def _stream(self, raw: int) -> torch.cuda.Stream:
        s = self._streams.get(raw)
        if s is None:
            s = (torch.cuda.default_stream(self.device_index) if raw == 0
                 else torch.cuda.ExternalStream(raw, device=self.device_index))
            self._streams[raw] = s
        return s

    def write(self, i: int, t: torch.Tensor, spec: Spec, seq: int, stream: int) -> None:
        dst = self._dst.get((i, t.dtype))
        if dst is None:
            dst = self._host[i * SLOT:i * SLOT + spec.nbytes].view(t.dtype).view(())
            self._dst[(i, t.dtype)] = dst
        s = self._stream(stream)
        with torch.cuda.stream(s):
            dst.copy_(t.reshape(()), non_blocking=True)
            self._events[i].record(s)

    def ready(self, i: int, seq: int) -> bool:
        return self._events[i].query()

    def order(self, consumer: int, producer: int) -> None:
        self._stream(consumer).wait_stream(self._stream(producer))
