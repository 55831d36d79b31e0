"""The pipeline's job timeline: every rank's jobs of every step on one time axis, as a
Chrome/Perfetto trace (one process per rank, pid = rank + 1; a lane for compute and one for waits to receive,
a colour per job kind, a line at each step's start), and the bubble each rank saw.

Ranks on one machine share ``perf_counter_ns``'s clock (CLOCK_MONOTONIC on Linux), so their
stamps line up as they are; across machines the stamps would need an offset per host.

>>> steps = {0: [[("0F0", 0, 10_000, 0), ("0B0", 30_000, 50_000, 0)]],
...          1: [[("1F0", 10_000, 20_000, 0), ("1B0", 20_000, 30_000, 0)]]}
>>> [e["name"] for e in chrome_trace(steps)["traceEvents"] if e["ph"] == "X"]
['0F0', '0B0', '1F0', '1B0']
>>> round(bubble(steps)[0], 2)
0.4
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

# job records: (name like "1F3", start ns, end ns, ns of that spent waiting to receive)
Steps = Mapping[int, Sequence[Sequence[tuple[str, int, int, int]]]]
_COLOURS = {"F": "thread_state_running", "B": "rail_response", "wait": "thread_state_iowait"}


def chrome_trace(steps: Steps) -> dict[str, Any]:
    """The trace of ``steps`` (per rank, per step, its job records), times relative to the
    earliest stamp of any rank."""
    t0 = min((j[1] for per_rank in steps.values() for step in per_rank for j in step), default=0)
    events: list[dict[str, Any]] = []
    for rank, per_rank in sorted(steps.items()):
        pid = rank + 1  # Perfetto treats pid 0 (the kernel's swapper) specially
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "jobs"}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2, "args": {"name": "waiting to receive"}})
        for k, step in enumerate(per_rank):
            if step:
                events.append({"ph": "i", "s": "p", "name": f"step {k}", "pid": pid, "tid": 1,
                               "ts": (step[0][1] - t0) / 1e3})
            for name, start, end, waited in step:
                kind = "F" if "F" in name else "B"
                events.append({"ph": "X", "name": name, "cat": kind, "pid": pid, "tid": 1, "cname": _COLOURS[kind],
                               "ts": (start - t0) / 1e3, "dur": (end - start) / 1e3, "args": {"step": k}})
                if waited:
                    events.append({"ph": "X", "name": f"recv for {name}", "cat": "wait", "pid": pid, "tid": 2,
                                   "cname": _COLOURS["wait"], "ts": (start - t0) / 1e3, "dur": waited / 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def bubble(steps: Steps) -> dict[int, float]:
    """Per rank, the share of its steps' spans (first job's start to last job's end) not spent
    in jobs, receive waits counted as idle."""
    out = {}
    for rank, per_rank in steps.items():
        span = busy = 0
        for step in per_rank:
            if step:
                span += max(j[2] for j in step) - min(j[1] for j in step)
                busy += sum(j[2] - j[1] - j[3] for j in step)
        out[rank] = 1 - busy / span if span else 0.0
    return out


def save(steps: Steps, path: str) -> None:
    """Write :func:`chrome_trace` as JSON (open it in https://ui.perfetto.dev)."""
    with open(path, "w") as f:
        json.dump(chrome_trace(steps), f)
