"""Timers that write :class:`~flowexec.profiler.records.Span` records.

On CUDA a job is timed by two events recorded on the stream that runs it (before its first op,
after its last). Nothing synchronises in the steady state: :meth:`JobTimer.flush` hands back the
spans whose events the device has completed (``event.query()``) and keeps the rest for a later
flush, so a step's spans may come one flush late; :meth:`JobTimer.finish` (the end of a run of
recorded steps, where the records are written) waits for the device and returns the rest.
Events come from a pool and go back to it once read, so a span creates no CUDA event.

Clock anchoring: at the first span of a run the timer synchronises once, records an anchor event,
spins on it and reads the host clock the moment it completes; every event of the run is that host
time plus its device distance from the anchor (``anchor.elapsed_time(ev)``). A run longer than
``reanchor_s`` (1 s) is re-anchored at a flush — one synchronisation per second, not per step —
which bounds the error of a drifting device clock to (drift rate x ``reanchor_s``): at the tens of
ppm of a quartz clock, tens of µs at most. :meth:`finish` anchors again and keeps the measured
drift of the run in :attr:`JobTimer.drift_ns`. (Anchoring to the host time at which an event was
*recorded* would be off by however long the queue ahead of it was.) On the CPU the host clock is
the device clock and every span is complete at its end. :data:`NULL_TIMER` does nothing, so code
can always call a timer.

>>> import torch
>>> t = JobTimer(torch.device("cpu"), rank=0, host="h")
>>> tok = t.begin(step=0, stage=0, kind="F", micro=0)
>>> t.end(tok)
>>> [s.label for s in t.flush()]
['0F0']
>>> t.finish()
[]
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any, Protocol

import torch

from .records import Span


class DeviceEvents(Protocol):
    """Where a :class:`JobTimer` gets its device events (CUDA; a fake one in the tests)."""

    def event(self) -> Any:
        """A new timing event (``record()``, ``query()``, ``elapsed_time(other)`` in ms)."""

    def synchronize(self) -> None:
        """Wait until the device has finished everything queued."""


_STREAMS: dict[tuple[int, int, int], Any] = {}  # torch.cuda.Stream objects by (id, device, type)


class _TimingEvent(torch.cuda.Event):
    """A timing event whose ``record()`` finds the current stream through one C call and a cache:
    ``torch.cuda.current_stream()`` builds a Python ``Stream`` on every call, most of the ~10 µs
    a record cost on the H200 host (``benchmarks/timer_probe.py``)."""

    def __new__(cls, index: int) -> "_TimingEvent":
        ev = super().__new__(cls, enable_timing=True)
        ev._index = index
        return ev

    def __init__(self, index: int) -> None:  # torch.cuda.Event's own __init__ takes other arguments
        pass

    def record(self, stream: Any = None) -> None:
        if stream is None:
            key = torch._C._cuda_getCurrentStream(self._index)
            stream = _STREAMS.get(key)
            if stream is None:
                stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        torch._C._CudaEventBase.record(self, stream)


class _DriverEvent:
    """A timing event through the CUDA driver (ctypes): a record is one driver call, where
    ``torch.cuda.Event.record`` costs about 3 µs on the H200's host (pybind, device guard,
    Python stream). Same methods as ``torch.cuda.Event`` as far as :class:`JobTimer` uses them."""

    __slots__ = ("h", "src")

    def __init__(self, h: int, src: "DriverEvents") -> None:
        self.h, self.src = h, src

    def record(self, stream: Any = None) -> None:
        src = self.src
        code = src.rec(self.h, src.raw(src.index) if stream is None else stream.cuda_stream)
        if code:
            src.fail(code, "cuEventRecord")

    def query(self) -> bool:
        code = self.src.query(self.h)
        if code == 0:
            return True
        if code != _NOT_READY:
            self.src.fail(code, "cuEventQuery")
        return False

    def elapsed_time(self, other: "_DriverEvent") -> float:
        src = self.src
        code = src.elapsed(src.ms_ref, self.h, other.h)
        if code:
            src.fail(code, "cuEventElapsedTime")
        return src.ms.value


_NOT_READY = 600  # CUDA_ERROR_NOT_READY
# Spans a recording timer lets wait before a flush reads their events (``JobTimer(batch=...)``):
# the trainer's records of a step or two, read in one go.
FLUSH_BATCH = 64


class DriverEvents:
    """:class:`DeviceEvents` of one CUDA device through the driver (:class:`_DriverEvent`); its
    events live as long as it does. ``JobTimer`` takes it where libcuda loads, else
    :class:`CudaEvents`."""

    def __init__(self, device: torch.device) -> None:
        import ctypes
        import weakref

        from .. import _cuda_native as cn

        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        d = cn.driver()
        cn.ensure_context(self.index)
        self.rec, self.query, self.elapsed = d.cuEventRecord, d.cuEventQuery, d.cuEventElapsedTime
        self.raw = torch._C._cuda_getCurrentRawStream
        self.ms = ctypes.c_float()
        self.ms_ref = ctypes.byref(self.ms)
        self._cn = cn
        self._handles: list[int] = []
        weakref.finalize(self, _destroy, d, self._handles)

    def event(self) -> _DriverEvent:
        h = self._cn.timing_event_create()
        self._handles.append(h)
        return _DriverEvent(h, self)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def fail(self, code: int, call: str) -> None:
        raise self._cn.CudaDriverError(code, call)


def _destroy(d: Any, handles: list[int]) -> None:
    for h in handles:
        d.cuEventDestroy_v2(h)


def device_events(device: torch.device) -> DeviceEvents:
    """The cheapest :class:`DeviceEvents` this machine has for ``device``: the driver's, or
    torch's where libcuda cannot be loaded directly."""
    try:
        return DriverEvents(device)
    except (OSError, AttributeError, RuntimeError):
        return CudaEvents(device)


class CudaEvents:
    """:class:`DeviceEvents` of one CUDA device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()

    def event(self) -> Any:
        return _TimingEvent(self.index)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _NullTimer:
    """Profiling off: every method does nothing."""

    enabled = False

    def begin(self, **_: Any) -> None:
        return None

    def end(self, token: Any) -> None:
        return None

    def flush(self) -> list[Span]:
        return []

    def finish(self) -> list[Span]:
        return []


NULL_TIMER = _NullTimer()


class JobTimer:
    """Times spans of work on ``device`` for one rank; :meth:`flush` returns the completed ones
    as spans, :meth:`finish` all of them (see the module text for the clocks)."""

    enabled = True

    def __init__(self, device: torch.device | str, rank: int = 0, host: str | None = None,
                 offset_ns: int = 0, *, reanchor_s: float | None = 1.0, events: DeviceEvents | None = None,
                 batch: int = 1) -> None:
        """``batch``: on CUDA, :meth:`flush` reads events only once this many spans wait (each
        read is two device calls per span; reading them in one go later keeps them off the
        steps in between)."""
        self.device = torch.device(device)
        self.rank = rank
        self.host = host or socket.gethostname()
        self.pid = os.getpid()
        self.offset_ns = offset_ns  # this rank's clock to rank 0's (clocks.measure_offset), stamped on every span
        self.reanchor_ns = None if reanchor_s is None else int(reanchor_s * 1e9)
        self._events: DeviceEvents | None = events if events is not None else (
            device_events(self.device) if self.device.type == "cuda" else None)
        self.batch = max(1, int(batch))
        self._cuda = self._events is not None
        self._clock = "cuda" if self._cuda else "host"
        self._open: list[list[Any]] = []  # begun since the last flush
        self._waiting: list[list[Any]] = []  # flushed, events not yet completed
        self._pool: list[Any] = []  # events read and free to record again
        self._anchor: tuple[Any, int] | None = None  # (event, host ns at its completion) of this run
        self.drift_ns: int | None = None  # at the last finish: host minus anchored device time of its anchor
        self.events_created = 0

    def _event(self) -> Any:
        if self._pool:
            return self._pool.pop()
        self.events_created += 1
        return self._events.event()  # type: ignore[union-attr]

    def _take_anchor(self) -> tuple[Any, int]:
        """Synchronise, record an event, spin until it is done (a blocking wait would add the
        thread's wake-up latency) and read the host clock at once."""
        self._events.synchronize()  # type: ignore[union-attr]
        ev = self._event()
        ev.record()
        while not ev.query():
            pass
        return ev, time.perf_counter_ns()

    def begin(self, *, step: int, stage: int | None, kind: str, micro: int | None, stream: str = "compute",
              peer: int | None = None, tag: int | None = None, name: str | None = None) -> list[Any]:
        """Start a span; returns the token to pass to :meth:`end`."""
        if self._cuda:
            if self._anchor is None:  # the first span of a run: its one synchronisation
                self._anchor = self._take_anchor()
            issue = time.perf_counter_ns()
            start: Any = self._event()
            start.record()
        else:
            start = issue = time.perf_counter_ns()
        tok = [step, stage, kind, micro, stream, peer, tag, name, issue, start, None, self._anchor]
        self._open.append(tok)
        return tok

    def end(self, token: list[Any]) -> None:
        """Stop the span ``token`` (on CUDA: an event on the current stream)."""
        if self._cuda:
            ev = self._event()
            ev.record()
            token[10] = ev
        else:
            token[10] = time.perf_counter_ns()

    def flush(self) -> list[Span]:
        """The spans whose work has completed, of this flush's and earlier ones' (never waits,
        except to re-anchor a run older than ``reanchor_s``; on CUDA, none until ``batch``
        spans wait)."""
        self._waiting += self._open
        self._open = []
        if not self._cuda:
            return self._resolve(self._waiting, [])
        if self._anchor is not None and self.reanchor_ns is not None and self._waiting \
                and time.perf_counter_ns() - self._anchor[1] > self.reanchor_ns:
            out = self.finish()
            self._anchor = self._take_anchor()
            return out
        if len(self._waiting) < self.batch:
            return []
        done, left = [], []
        for tok in self._waiting:
            end = tok[10]
            (done if end is None or (end.query() and tok[9].query()) else left).append(tok)
        return self._resolve(done, left)

    def finish(self) -> list[Span]:
        """End a run of recorded steps: wait for the device, return every span not yet returned
        and drop the anchor (the next span anchors anew)."""
        self._waiting += self._open
        self._open = []
        if not self._cuda or self._anchor is None:
            return self._resolve(self._waiting, [])
        ev, host = self._take_anchor()
        a_ev, a_host = self._anchor
        self.drift_ns = host - (a_host + round(a_ev.elapsed_time(ev) * 1e6))
        out = self._resolve(self._waiting, [])
        self._pool += [ev, a_ev]
        self._anchor = None
        return out

    def _resolve(self, done: list[list[Any]], left: list[list[Any]]) -> list[Span]:
        self._waiting = left
        out = []
        for step, stage, kind, micro, stream, peer, tag, name, issue, start, end, anch in done:
            if end is None:  # a span that never ended (its job raised) is not a measurement
                if self._cuda:
                    self._pool.append(start)
                continue
            if self._cuda:
                a_ev, a_host = anch
                s_ns = a_host + round(a_ev.elapsed_time(start) * 1e6)
                e_ns = a_host + round(a_ev.elapsed_time(end) * 1e6)
                self._pool += (start, end)
            else:
                s_ns, e_ns = start, end
            out.append(Span(self.rank, self.host, self.pid, step, stage, kind, micro, stream, s_ns, e_ns,
                            self._clock, self.offset_ns, issue, peer, tag, name))
        return out


def anchor(device: torch.device) -> tuple[Any, int]:
    """An event on ``device``'s current stream and the host ``perf_counter_ns`` at which it
    completed: waits for all work queued so far, records the event, spins until it is done (a
    blocking wait would add the thread's wake-up latency) and reads the clock at once."""
    torch.cuda.synchronize(device)
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    while not ev.query():
        pass
    return ev, time.perf_counter_ns()
