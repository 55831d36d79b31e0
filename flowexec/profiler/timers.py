"""Timers that write :class:`~flowexec.profiler.records.Span` records.

On CUDA a job is timed by events recorded on the stream that runs it (before its first op, after
its last), read once after the step — :meth:`JobTimer.flush` is the only synchronisation — and
anchored to the host clock with one event whose host time is known. On the CPU the host clock is
the device clock. :data:`NULL_TIMER` does nothing, so code can always call a timer.

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

    def __init__(self, device: torch.device | str, rank: int = 0, host: str | None = None) -> None:
        self.device = torch.device(device)
        self.rank = rank
        self.host = host or socket.gethostname()
        self.pid = os.getpid()
        self._cuda = self.device.type == "cuda"
        self._open: list[list[Any]] = []
        self._anchor: tuple[Any, int] | None = None

    def begin(self, *, step: int, stage: int | None, kind: str, micro: int | None, stream: str = "compute",
              peer: int | None = None, tag: int | None = None, name: str | None = None) -> list[Any]:
        """Start a span; returns the token to pass to :meth:`end`."""
        issue = time.perf_counter_ns()
        if self._cuda:
            if self._anchor is None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self._anchor = (ev, time.perf_counter_ns())
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
            anchor_ev, anchor_ns = self._anchor  # type: ignore[misc]
            torch.cuda.synchronize(self.device)
            to_ns = lambda ev: anchor_ns + int(anchor_ev.elapsed_time(ev) * 1e6)  # noqa: E731
            self._anchor = None
        else:
            to_ns = lambda t: t  # noqa: E731
        out = []
        for step, stage, kind, micro, stream, peer, tag, name, issue, start, end in toks:
            if end is None:
                continue  # a span that never ended (its job raised) is not a measurement
            out.append(Span(rank=self.rank, host=self.host, pid=self.pid, step=step, stage=stage, kind=kind,
                            micro=micro, stream=stream, start_ns=to_ns(start), end_ns=to_ns(end),
                            clock="cuda" if self._cuda else "host", issue_ns=issue, peer=peer, tag=tag, name=name))
        return out
