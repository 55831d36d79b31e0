"""Timers that write :class:`~flowexec.profiler.records.Span` records.

On CUDA a job is timed by two events recorded on the stream that runs it (before its first op,
after its last). Nothing synchronises in the steady state: :meth:`JobTimer.flush` hands back the
spans whose events the device has completed (``event.query()``) and keeps the rest for a later
flush, so a step's spans may come one flush late; :meth:`JobTimer.finish` (the end of a run of
recorded steps, where the records are written) waits for the device and returns the rest.
Events come from a pool and go back to it once read, so a span creates no CUDA event. The
events are the native extension's event clock where it is built (:class:`NativeEvents`: the
driver called from C++), else the driver through ctypes, else ``torch.cuda.Event``.

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
from typing import Any, Callable, Protocol

import torch

from .records import Span


class DeviceEvents(Protocol):
    """Where a :class:`JobTimer` gets its device events: handles to timing events, recorded on
    the current stream, read in batches and handed back for reuse (CUDA; fakes in the tests)."""

    created: int  # events made so far (the rest are reused)

    def record(self) -> Any:
        """Record a free timing event on the current stream; returns its handle."""

    def done(self, h: Any) -> bool:
        """Whether the device has passed event ``h`` (never waits)."""

    def offsets_ns(self, anchor: Any, hs: list[Any]) -> list[int]:
        """Device nanoseconds from ``anchor`` to each of ``hs`` (all complete)."""

    def release(self, hs: list[Any]) -> None:
        """Hand read events back for reuse."""

    def synchronize(self) -> None:
        """Wait until the device has finished everything queued."""


_CLOCK_FUNCTIONS = ("cuEventCreate", "cuEventRecord", "cuEventQuery", "cuEventElapsedTime", "cuEventDestroy_v2",
                    "cuGetErrorName")


def driver_functions(index: int) -> dict[str, int]:
    """Addresses of the driver functions the native event clock calls (libcuda via ctypes),
    with ``index``'s context current on this thread."""
    import ctypes

    from .. import _cuda_native as cn

    d = cn.driver()
    cn.ensure_context(index)
    return {n: ctypes.cast(getattr(d, n), ctypes.c_void_p).value for n in _CLOCK_FUNCTIONS}  # type: ignore[misc]


class NativeEvents:
    """:class:`DeviceEvents` of one CUDA device through the native extension's ``EventClock``
    (``runtime/csrc/eventclock.cpp``): the driver's own functions called from C++, so a record
    is one pybind call (no ctypes conversion, no Python event object) and a batch of reads is
    one call. Raises RuntimeError where the extension is not built."""

    def __init__(self, device: torch.device, *, functions: dict[str, int] | None = None,
                 current_stream: Callable[[int], int] | None = None) -> None:
        """``functions`` (the driver's by default): addresses of ``cuEventCreate``,
        ``cuEventRecord``, ``cuEventQuery``, ``cuEventElapsedTime``, ``cuEventDestroy_v2``,
        ``cuGetErrorName``; ``current_stream(device index)`` the raw stream to record on
        (torch's current stream by default). The tests pass stand-ins for both."""
        from ..runtime import fastcall

        mod = fastcall.load()
        if mod is None or not hasattr(mod, "EventClock"):
            raise RuntimeError(f"native event clock unavailable: {fastcall.status()}")
        self.device = device
        if functions is None:
            self.index = device.index if device.index is not None else torch.cuda.current_device()
            functions = driver_functions(self.index)
        else:
            self.index = device.index or 0
        self.clock = mod.EventClock(*(functions[n] for n in _CLOCK_FUNCTIONS))
        self._rec = self.clock.record
        self._raw = current_stream or torch._C._cuda_getCurrentRawStream
        self.done, self.offsets_ns, self.release = self.clock.done, self.clock.offsets_ns, self.clock.release

    @property
    def created(self) -> int:
        return self.clock.created

    def record(self) -> int:
        return self._rec(self._raw(self.index))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


_NOT_READY = 600  # CUDA_ERROR_NOT_READY
# Spans a recording timer lets wait before a flush reads their events (``JobTimer(batch=...)``):
# the trainer's records of a step or two, read in one go.
FLUSH_BATCH = 64


class DriverEvents:
    """:class:`DeviceEvents` of one CUDA device through the driver by ctypes (where the native
    extension is not built): handles are the driver's ``CUevent`` values; they live as long as
    this object does."""

    def __init__(self, device: torch.device) -> None:
        import ctypes
        import weakref

        from .. import _cuda_native as cn

        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        d = cn.driver()
        cn.ensure_context(self.index)
        self._rec, self._query, self._elapsed = d.cuEventRecord, d.cuEventQuery, d.cuEventElapsedTime
        self._raw = torch._C._cuda_getCurrentRawStream
        self._ms = ctypes.c_float()
        self._ms_ref = ctypes.byref(self._ms)
        self._cn = cn
        self._handles: list[int] = []
        self._free: list[int] = []
        self.created = 0
        weakref.finalize(self, _destroy, d, self._handles)

    def record(self) -> int:
        if self._free:
            h = self._free.pop()
        else:
            h = self._cn.timing_event_create()
            self._handles.append(h)
            self.created += 1
        code = self._rec(h, self._raw(self.index))
        if code:
            self._free.append(h)
            raise self._cn.CudaDriverError(code, "cuEventRecord")
        return h

    def done(self, h: int) -> bool:
        code = self._query(h)
        if code == 0:
            return True
        if code != _NOT_READY:
            raise self._cn.CudaDriverError(code, "cuEventQuery")
        return False

    def offsets_ns(self, anchor: int, hs: list[int]) -> list[int]:
        out = []
        for h in hs:
            code = self._elapsed(self._ms_ref, anchor, h)
            if code:
                raise self._cn.CudaDriverError(code, "cuEventElapsedTime")
            out.append(round(self._ms.value * 1e6))
        return out

    def release(self, hs: list[int]) -> None:
        self._free += hs

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def _destroy(d: Any, handles: list[int]) -> None:
    for h in handles:
        d.cuEventDestroy_v2(h)


def device_events(device: torch.device) -> DeviceEvents:
    """The cheapest :class:`DeviceEvents` this machine has for ``device``: the native event
    clock, else the driver's through ctypes, else torch's events."""
    for kind in (NativeEvents, DriverEvents):
        try:
            return kind(device)
        except (OSError, AttributeError, RuntimeError):
            pass
    return CudaEvents(device)


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


class CudaEvents:
    """:class:`DeviceEvents` of one CUDA device through ``torch.cuda.Event`` (handles are the
    events)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._free: list[Any] = []
        self.created = 0

    def record(self) -> Any:
        if self._free:
            ev = self._free.pop()
        else:
            ev = _TimingEvent(self.index)
            self.created += 1
        ev.record()
        return ev

    def done(self, ev: Any) -> bool:
        return ev.query()

    def offsets_ns(self, anchor: Any, evs: list[Any]) -> list[int]:
        return [round(anchor.elapsed_time(ev) * 1e6) for ev in evs]

    def release(self, evs: list[Any]) -> None:
        self._free += evs

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
        if self._events is not None:  # bound once: begin/end are the hot path
            self._record, self._done = self._events.record, self._events.done
        self._open: list[list[Any]] = []  # begun since the last flush
        self._waiting: list[list[Any]] = []  # flushed, events not yet completed
        self._anchor: tuple[Any, int] | None = None  # (event, host ns at its completion) of this run
        self.drift_ns: int | None = None  # at the last finish: host minus anchored device time of its anchor

    @property
    def events_created(self) -> int:
        return 0 if self._events is None else self._events.created

    def _take_anchor(self) -> tuple[Any, int]:
        """Synchronise, record an event, spin until it is done (a blocking wait would add the
        thread's wake-up latency) and read the host clock at once."""
        self._events.synchronize()  # type: ignore[union-attr]
        ev = self._record()
        while not self._done(ev):
            pass
        return ev, time.perf_counter_ns()

    def begin(self, *, step: int, stage: int | None, kind: str, micro: int | None, stream: str = "compute",
              peer: int | None = None, tag: int | None = None, name: str | None = None) -> list[Any]:
        """Start a span; returns the token to pass to :meth:`end`."""
        if self._cuda:
            if self._anchor is None:  # the first span of a run: its one synchronisation
                self._anchor = self._take_anchor()
            issue = time.perf_counter_ns()
            start: Any = self._record()
        else:
            start = issue = time.perf_counter_ns()
        tok = [step, stage, kind, micro, stream, peer, tag, name, issue, start, None, self._anchor]
        self._open.append(tok)
        return tok

    def host_span(self, *, step: int, stage: int | None, kind: str, micro: int | None, stream: str, start_ns: int,
                  end_ns: int, peer: int | None = None, tag: int | None = None, name: str | None = None) -> Span:
        """A span this rank timed on the host clock elsewhere (another thread's call, say),
        stamped like the timer's own."""
        return Span(self.rank, self.host, self.pid, step, stage, kind, micro, stream, start_ns, end_ns, "host",
                    self.offset_ns, None, peer, tag, name)

    def end(self, token: list[Any]) -> None:
        """Stop the span ``token`` (on CUDA: an event on the current stream)."""
        token[10] = self._record() if self._cuda else time.perf_counter_ns()

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
        ready = self._done
        for tok in self._waiting:
            end = tok[10]
            (done if end is None or (ready(end) and ready(tok[9])) else left).append(tok)
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
        self.drift_ns = host - (a_host + self._events.offsets_ns(a_ev, [ev])[0])  # type: ignore[union-attr]
        out = self._resolve(self._waiting, [])
        self._events.release([ev, a_ev])  # type: ignore[union-attr]
        self._anchor = None
        return out

    def _resolve(self, done: list[list[Any]], left: list[list[Any]]) -> list[Span]:
        self._waiting = left
        ended = [tok for tok in done if tok[10] is not None]
        if self._cuda:
            # A span that never ended (its job raised) is not a measurement: its event goes back.
            self._events.release([tok[9] for tok in done if tok[10] is None])  # type: ignore[union-attr]
            times = self._device_times(ended)
        else:
            times = [(tok[9], tok[10]) for tok in ended]
        r, h, p, c, o = self.rank, self.host, self.pid, self._clock, self.offset_ns
        return [Span(r, h, p, step, stage, kind, micro, stream, s_ns, e_ns, c, o, issue, peer, tag, name)
                for (step, stage, kind, micro, stream, peer, tag, name, issue, *_), (s_ns, e_ns) in zip(ended, times)]

    def _device_times(self, toks: list[list[Any]]) -> list[tuple[int, int]]:
        """Host ns of each span's start and end event: one read per run of spans that share an
        anchor (all of them, unless a re-anchor fell between), then the events go back."""
        ev = self._events
        out: list[tuple[int, int]] = []
        i = 0
        while i < len(toks):
            anch = toks[i][11]
            j = i
            while j < len(toks) and toks[j][11] is anch:
                j += 1
            hs = [t[9] for t in toks[i:j]] + [t[10] for t in toks[i:j]]
            ns = ev.offsets_ns(anch[0], hs)  # type: ignore[union-attr]
            n, base = j - i, anch[1]
            out += [(base + ns[k], base + ns[n + k]) for k in range(n)]
            ev.release(hs)  # type: ignore[union-attr]
            i = j
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
