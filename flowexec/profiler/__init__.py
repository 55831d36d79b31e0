"""flowexec's profilers and timeline: timers write one record type (:class:`Span`); merge and the
exporters read it.

- :mod:`.instructions`: :func:`profile` — per-instruction times of trace-mode calls (:class:`Timeline`;
  device times on CUDA), :func:`profile_graph` — graph-mode replays (and their kernels).
- :mod:`.records`: :class:`Span`, the one timed span every timer writes.
- :mod:`.timers`: :class:`JobTimer` (CUDA events on the stream that ran the work, host clock on CPU)
  and :data:`NULL_TIMER` (profiling off).
- :mod:`.recording`: :class:`StepProfiler` — the steps to record, clock offsets, the records file.
- :mod:`.clocks` (offsets by ping-pong), :mod:`.io` (the versioned JSON-lines file), :mod:`.merge`,
  :mod:`.trace` (Trace Event Format), :mod:`.page` (the HTML page), :mod:`.summary` (busy, bubble).
  docs/timeline.md describes them.
"""
from __future__ import annotations

from .instructions import GraphProfile, OpTime, Timeline, profile, profile_graph
from .records import Span
from .recording import StepProfiler
from .timers import NULL_TIMER, JobTimer

__all__ = ["profile", "profile_graph", "Timeline", "GraphProfile", "OpTime", "Span", "JobTimer", "NULL_TIMER",
           "StepProfiler"]
