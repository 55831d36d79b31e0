"""The pipeline's job timeline from :class:`~flowexec.profiler.records.Span` records: every
rank's jobs of every step on one time axis as a Chrome/Perfetto trace (one process per rank,
pid = rank + 1; a lane for jobs, one for receive waits; a mark at each step's start), and the
bubble each rank saw. (The profiler package's exporters read the same spans; this is the small
view ``flowexec pipeline`` saves.)

Ranks on one machine share ``perf_counter_ns``'s clock, so their stamps line up as they are.

>>> from flowexec.profiler.records import Span
>>> def s(rank, kind, stage, micro, a, b, stream="compute"):
...     return Span(rank=rank, host="h", pid=1, step=0, stage=stage, kind=kind, micro=micro, stream=stream,
...                 start_ns=a, end_ns=b, clock="host")
>>> spans = [s(0, "step", None, None, 0, 50_000), s(0, "F", 0, 0, 0, 10_000), s(0, "B", 0, 0, 30_000, 50_000),
...          s(1, "step", None, None, 10_000, 30_000), s(1, "F", 1, 0, 10_000, 20_000), s(1, "B", 1, 0, 20_000, 30_000)]
>>> [e["name"] for e in chrome_trace(spans)["traceEvents"] if e["ph"] == "X"]
['0F0', '0B0', '1F0', '1B0']
>>> {r: round(b, 2) for r, b in bubble(spans).items()}
{0: 0.4, 1: 0.0}
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Iterable

from ..profiler.records import JOB_KINDS, Span

_COLOURS = {"F": "thread_state_running", "B": "rail_response", "I": "rail_response", "W": "rail_animation",
            "OPT": "rail_idle", "clip": "rail_idle", "average": "rail_idle", "wait": "thread_state_iowait",
            "send": "generic_work", "isend": "good"}
_LANES = {"wait": 2, "send": 3, "isend": 4}
_STEP_LEVEL = {"clip", "average"}  # the step end's work on the jobs' lane, no stage (the clip, the replicas' average)


def chrome_trace(spans: Iterable[Span]) -> dict[str, Any]:
    """The Trace Event Format of ``spans`` (times relative to the earliest span)."""
    spans = list(spans)
    t0 = min((s.start_ns + s.offset_ns for s in spans), default=0)
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in spans}):
        pid = rank + 1  # Perfetto treats pid 0 (the kernel's swapper) specially
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "jobs"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2, "args": {"name": "waiting to receive"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 3, "args": {"name": "sends handed over"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 4, "args": {"name": "send thread: isend calls"}})
    for s in sorted(spans, key=lambda s: (s.rank, s.start_ns)):
        ts = (s.start_ns + s.offset_ns - t0) / 1e3
        if s.kind == "step":
            events.append({"ph": "i", "s": "p", "name": f"step {s.step}", "pid": s.rank + 1, "tid": 1, "ts": ts})
        elif s.kind in JOB_KINDS or s.kind in _LANES or s.kind in _STEP_LEVEL:
            events.append({"ph": "X", "name": _label(s), "cat": s.kind,
                           "pid": s.rank + 1, "tid": _LANES.get(s.kind, 1), "cname": _COLOURS[s.kind],
                           "ts": ts, "dur": s.duration_ns / 1e3, "args": {"step": s.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _label(s: Span) -> str:
    if s.kind in _LANES or s.kind in _STEP_LEVEL:
        return s.name or s.kind
    return f"{s.stage}{s.kind}{'' if s.micro is None else s.micro}"  # 1F3, 0OPT: the plan's text form


def bubble(spans: Iterable[Span]) -> dict[int, float]:
    """Per rank, the share of its steps' time (the ``step`` spans) not spent in jobs."""
    step = defaultdict(int)
    busy = defaultdict(int)
    for s in spans:
        if s.kind == "step":
            step[s.rank] += s.duration_ns
        elif s.kind in JOB_KINDS:
            busy[s.rank] += s.duration_ns
    return {r: 1 - busy[r] / step[r] if step[r] else 0.0 for r in sorted(step)}


def save(spans: Iterable[Span], path: str) -> None:
    """Write :func:`chrome_trace` as JSON (open it in https://ui.perfetto.dev)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(spans), f)
