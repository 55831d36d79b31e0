"""Timers that write :class:`~flowexec.profiler.records.Span` records.

On CUDA a job is timed by events recorded on the stream that runs it (before its first op, after
its last), read once after the step — :meth:`JobTimer.flush` is the only synchronisation — and
anchored to the host clock once per flush: after the device has finished everything, one more
event is recorded and spun on, and the host clock read the moment it completes; every event of
the step is that host time minus its distance to the anchor on the device. (Anchoring to the
host time at which the first event was *recorded* would be off by however long the queue ahead
of it was.) On the CPU the host clock is the device clock. :data:`NULL_TIMER` does nothing, so
code can always call a timer.

>>> import torch
>>> t = JobTimer(torch.device("cpu"), rank=0, host="h")
>>> tok = t.begin(step=0, stage=0, kind="F", micro=0)
>>> t.end(tok)
>>> [s.label for s in t.flush()]
['0F0']
"""
from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch

from .records import Span


class _NullTimer:
    """Profiling off: every method does nothing."""

    enabled = False

    def begin(self, **_: Any) -> None:
        return None

    def end(self, token: Any) -> None:
        return None

    def flush(self) -> list[Span]:
        return []


NULL_TIMER = _NullTimer()


class JobTimer:
    """Times spans of work on ``device`` for one rank; :meth:`flush` returns them as spans."""

    enabled = True

    def __init__(self, device: torch.device | str, rank: int = 0, host: str | None = None,
                 offset_ns: int = 0) -> None:
        self.device = torch.device(device)
        self.rank = rank
        self.host = host or socket.gethostname()
        self.pid = os.getpid()
        self.offset_ns = offset_ns  # this rank's clock to rank 0's (clocks.measure_offset), stamped on every span
        self._cuda = self.device.type == "cuda"
        self._open: list[list[Any]] = []

    def begin(self, *, step: int, stage: int | None, kind: str, micro: int | None, stream: str = "compute",
              peer: int | None = None, tag: int | None = None, name: str | None = None) -> list[Any]:
        """Start a span; returns the token to pass to :meth:`end`."""
        issue = time.perf_counter_ns()
        if self._cuda:
            start: Any = torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = issue
        tok = [step, stage, kind, micro, stream, peer, tag, name, issue, start, None]
        self._open.append(tok)
        return tok

    def end(self, token: list[Any]) -> None:
        """Stop the span ``token`` (on CUDA: an event on the current stream)."""
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            token[10] = ev
        else:
            token[10] = time.perf_counter_ns()

    def flush(self) -> list[Span]:
        """The spans since the last flush (waits for their events on CUDA)."""
        toks, self._open = self._open, []
        if self._cuda and toks:
            anchor_ev, anchor_ns = anchor(self.device)
            to_ns = lambda ev: anchor_ns - round(ev.elapsed_time(anchor_ev) * 1e6)  # noqa: E731
        else:
            to_ns = lambda t: t  # noqa: E731
        out = []
        clock = "cuda" if self._cuda else "host"
        for step, stage, kind, micro, stream, peer, tag, name, issue, start, end in toks:
            if end is None:
                continue  # a span that never ended (its job raised) is not a measurement
            out.append(Span(self.rank, self.host, self.pid, step, stage, kind, micro, stream, to_ns(start), to_ns(end),
                            clock, self.offset_ns, issue, peer, tag, name))
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
