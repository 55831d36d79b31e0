"""flowexec's profilers and timeline: timers write one record type (:class:`Span`); merge and the
exporters read it.

- :mod:`.instructions`: :func:`profile` — per-instruction times of trace-mode calls (:class:`Timeline`).
- :mod:`.records`: :class:`Span`, the one timed span every timer writes.
- :mod:`.timers`: :class:`JobTimer` (CUDA events on the stream that ran the work, host clock on CPU)
  and :data:`NULL_TIMER` (profiling off).
"""
from __future__ import annotations

from .instructions import OpTime, Timeline, profile
from .records import Span
from .timers import NULL_TIMER, JobTimer

__all__ = ["profile", "Timeline", "OpTime", "Span", "JobTimer", "NULL_TIMER"]
