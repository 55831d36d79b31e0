"""The native event clock (runtime/csrc/eventclock.cpp, profiler.timers.NativeEvents) on the CPU:
the C++ calls driver functions by address, and here those addresses are ctypes callbacks that
stand in for the driver (a device clock that advances 1000 ns per record, events pending while
the device is busy, error codes). tests/test_timeline_timer.py runs the JobTimer's tests on it."""
from __future__ import annotations

import ctypes

import pytest
import torch

from flowexec.profiler.timers import JobTimer, NativeEvents
from flowexec.runtime import fastcall

NOT_READY, INVALID_HANDLE = 600, 400
CREATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
ELAPSED = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p)
DESTROY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
NAME = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
_NAMES = {NOT_READY: b"CUDA_ERROR_NOT_READY", INVALID_HANDLE: b"CUDA_ERROR_INVALID_HANDLE"}


@pytest.fixture(scope="module")
def native():
    m = fastcall.load()
    if m is None:  # CI builds it in setup.sh; a fresh checkout builds it here once
        m = fastcall.build()
    assert hasattr(m, "EventClock")
    return m


class FakeDriver:
    """The six driver functions as ctypes callbacks over a fake device."""

    def __init__(self) -> None:
        self.now = 0
        self.busy = False
        self.t: dict[int, int | None] = {}  # event handle -> completed device time (None: pending)
        self.queued: dict[int, int] = {}
        self.streams: list[int] = []
        self.fail_record = 0
        self.destroyed: list[int] = []
        self.syncs = 0

        def create(out, flags):
            h = 1000 + len(self.t)
            self.t[h] = None
            out[0] = h
            return 0

        def record(ev, stream):
            if self.fail_record:
                return self.fail_record
            self.now += 1000
            self.queued[ev] = self.now
            self.t[ev] = None if self.busy else self.now
            self.streams.append(stream or 0)
            return 0

        def query(ev):
            return 0 if self.t[ev] is not None else NOT_READY

        def elapsed(ms, a, b):
            if self.t[a] is None or self.t[b] is None:
                return NOT_READY
            ms[0] = (self.t[b] - self.t[a]) / 1e6
            return 0

        def destroy(ev):
            self.destroyed.append(ev)
            return 0

        def name(code, out):
            out[0] = _NAMES.get(code, b"CUDA_ERROR_UNKNOWN")
            return 0

        self._fns = [CREATE(create), RECORD(record), QUERY(query), ELAPSED(elapsed), DESTROY(destroy), NAME(name)]
        names = ("cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventElapsedTime", "cuEventDestroy_v2",
                 "cuGetErrorName")
        self.functions = {n: ctypes.cast(f, ctypes.c_void_p).value for n, f in zip(names, self._fns)}

    def drain(self) -> None:
        for ev, t in self.queued.items():
            self.t[ev] = t


class NativeFake(NativeEvents):
    """The native clock over a :class:`FakeDriver`, with the handles test_timeline_timer.py's
    FakeDevice has (``busy``, ``drain``, ``syncs``, ``queries``, ``n_free``), so that the
    timer's tests run on both."""

    def __init__(self, drv: FakeDriver | None = None, stream: int = 77) -> None:
        self.drv = drv or FakeDriver()
        super().__init__(torch.device("cpu"), functions=self.drv.functions, current_stream=lambda index: stream)
        self.syncs = 0
        self.queries = 0
        self._clock_done = self.done
        self.done = self._counted_done

    def _counted_done(self, h: int) -> bool:
        self.queries += 1
        return self._clock_done(h)

    @property
    def busy(self) -> bool:
        return self.drv.busy

    @busy.setter
    def busy(self, value: bool) -> None:
        self.drv.busy = value

    def drain(self) -> None:
        self.drv.drain()

    def n_free(self) -> int:
        return self.clock.free

    def synchronize(self) -> None:
        self.syncs += 1
        self.drv.drain()
        self.drv.busy = False


def test_native_clock_records_on_the_current_stream(native):
    ev = NativeFake(stream=77)
    t = JobTimer(torch.device("cpu"), events=ev, reanchor_s=None)
    t.end(t.begin(step=0, stage=0, kind="F", micro=0))
    assert len(t.finish()) == 1 and set(ev.drv.streams) == {77}


def test_native_clock_names_a_failing_driver_call(native):
    ev = NativeFake()
    drv = ev.drv
    h = ev.record()
    drv.fail_record = INVALID_HANDLE
    with pytest.raises(RuntimeError, match=r"cuEventRecord failed: CUDA_ERROR_INVALID_HANDLE \(400\)"):
        ev.record()
    drv.fail_record = 0
    drv.busy = True
    h2 = ev.record()
    assert not ev.done(h2)
    with pytest.raises(RuntimeError, match="cuEventElapsedTime failed: CUDA_ERROR_NOT_READY"):
        ev.offsets_ns(h, [h2])
    with pytest.raises(IndexError, match="no event in slot 99"):
        ev.done(99)


def test_native_clock_destroys_its_events(native):
    ev = NativeFake()
    drv = ev.drv
    ev.release([ev.record(), ev.record()])
    made = sorted(drv.t)
    del ev
    import gc
    gc.collect()
    assert sorted(drv.destroyed) == made
