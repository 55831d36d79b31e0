"""The copy kernel: a one-thread PTX kernel ``fx_read{1,2,4,8,16}`` (``flowexec._cuda_native``)
loads the element, stores it into a host-mapped pinned slot, ``membar.sys``, then stores the
sequence number; the host spins on that number with a plain ctypes read. When it matches, the
payload before it is visible (system fence on the device, in-order loads on x86).

:class:`KernelSlots` launches it with ``cuLaunchKernel`` every time, through cupy's Cython
binding or ctypes (``graph+cupy`` / ``graph+ctypes`` name the launcher). It is what a
``FetchRing`` copies with (its slot changes with every submit) and what ``fast_item`` uses for an
address it sees for the first time; :mod:`.graph` replays captured graphs of the same kernel for
the addresses it sees again.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from .slots import SLOT, Number, SlotView, Slots, Spec, What, wait


def native() -> Any:  # imported lazily: CPU-only use never touches libcuda
    from flowexec import _cuda_native

    return _cuda_native


def stream_check(stream: int) -> None:
    """Raise the producer stream's own CUDA error, if it has one (a wait calls this while it
    sleeps, so a faulted producer is not reported as a timeout)."""
    nat = native()
    err = nat.driver().cuStreamQuery(stream)
    if err not in (0, nat.CUDA_ERROR_NOT_READY):
        raise nat.CudaDriverError(err, f"the producer stream 0x{stream:x} (cuStreamQuery)")


class KernelSlots(Slots):
    """``n`` cuMemHostAlloc'd slots that the fx_read kernel writes: the value, then a sequence
    number."""

    def __init__(self, device_index: int, n: int, launcher: str) -> None:
        nat = self._nat = native()
        nat.ensure_context(device_index)
        self.device_index = device_index
        self.name = f"kernel+{launcher}"
        self._host, self._dev = nat.host_alloc(n * SLOT)
        self.views = [SlotView(self._host + i * SLOT) for i in range(n)]
        self._order_ev = nat.event_create()
        self._seq = 0
        self.check = stream_check
        self._fns = nat.kernels(device_index)
        self._launch = nat.launcher(launcher)
        self._dst = [self._dev + i * SLOT for i in range(n)]
        # Kernel parameters live in preallocated ctypes cells; cuLaunchKernel copies them at the
        # call, so they can be overwritten for the next launch straight away.
        self._p = (ctypes.c_uint64 * 3)()
        a = ctypes.addressof(self._p)
        self._params = (ctypes.c_void_p * 3)(a, a + 8, a + 16)
        self._paddr = ctypes.addressof(self._params)

    def order(self, consumer: int, producer: int) -> None:
        d = self._nat.driver()
        self._nat.check(d.cuEventRecord(self._order_ev, producer), "cuEventRecord")
        self._nat.check(d.cuStreamWaitEvent(consumer, self._order_ev, 0), "cuStreamWaitEvent")

    def write(self, i: int, t: torch.Tensor, spec: Spec, seq: int, stream: int) -> None:
        p = self._p
        p[0], p[1], p[2] = t.data_ptr(), self._dst[i], seq
        err = self._launch(self._fns[spec.nbytes], stream, self._paddr)
        if err:
            self._relaunch(err, spec, stream)

    def _relaunch(self, err: int, spec: Spec, stream: int) -> None:
        nat = self._nat
        if err == nat.CUDA_ERROR_INVALID_CONTEXT:  # a thread with no current context yet
            nat.ensure_context(self.device_index)
            err = self._launch(self._fns[spec.nbytes], stream, self._paddr)
        nat.check(err, "cuLaunchKernel(fx_read)")

    def ready(self, i: int, seq: int) -> bool:
        return self.views[i].seq.value >= seq

    def item(self, t: torch.Tensor, spec: Spec, stream: int, timeout: float, spin: float) -> Number:
        # write() and ready() inlined: fast_item's first sighting of an address takes this path.
        seq = self._seq = self._seq + 1
        p = self._p
        p[0], p[1], p[2] = t.data_ptr(), self._dst[0], seq
        err = self._launch(self._fns[spec.nbytes], stream, self._paddr)
        if err:
            self._relaunch(err, spec, stream)
        v = self.views[0]
        s = v.seq
        n = 0
        while s.value < seq:  # an idle device answers within a few µs: poll without the clock
            n += 1
            if n > 256:  # then the timed spin-then-sleep wait takes over
                wait(self.ready, 0, seq, timeout, spin, self.check, stream, What(t, stream))
                break
        return spec.decode(v)
