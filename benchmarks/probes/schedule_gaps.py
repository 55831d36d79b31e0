"""Where a scheduled step's extra device time goes (a probe, not a benchmark): the loops of
``benchmarks/schedule.py`` (OneCycleLR against a constant lr, graph mode) under torch.profiler,
and from the device's own timestamps, per step: the span from one replay's first kernel to
the next one's, the idle gap before each replay's first kernel, and the fed values' copies.

    PYTHONPATH=. python3 benchmarks/probes/schedule_gaps.py [--out DIR] [--steps 200]

schedule.py measured 5.6 µs a step more with the schedule; the same pinned copy and event
between two replays of a plain graph cost 1.9 µs (results/probes/feed_between_replays_dd62bb6.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]
from ops import run_meta, write_result  # noqa: E402
from schedule import make  # noqa: E402


def device_events(prof: Any) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel and memcpy/memset the device ran, in order."""
    out = []
    for e in prof.events():
        kind = str(getattr(e, "device_type", ""))
        if "CUDA" not in kind:
            continue
        start = e.time_range.start
        out.append((float(start), float(start + e.device_time), e.name))
    return sorted(out)


def summarize(events: list[tuple[float, float, str]], kernels_per_step: int) -> dict[str, Any]:
    """Per step (``kernels_per_step`` device events of the graph, copies apart): spans and gaps."""
    copies = [e for e in events if "Memcpy" in e[2] or "memcpy" in e[2]]
    work = [e for e in events if e not in copies]
    firsts = work[::kernels_per_step]
    spans = [b[0] - a[0] for a, b in zip(firsts, firsts[1:])]
    ends = [work[i - 1][1] for i in range(kernels_per_step, len(work), kernels_per_step)]
    gaps = [f[0] - e for f, e in zip(firsts[1:], ends)]
    return {
        "device_events": len(events), "copies": len(copies),
        "copy_us_median": statistics.median([c[1] - c[0] for c in copies]) if copies else None,
        "span_us_median": statistics.median(spans) if spans else None,
        "gap_before_replay_us_median": statistics.median(gaps) if gaps else None,
        "gap_before_replay_us_p90": sorted(gaps)[int(0.9 * len(gaps))] if gaps else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    res: dict[str, Any] = run_meta("PYTHONPATH=. python3 benchmarks/probes/schedule_gaps.py")
    for name, scheduled in (("scheduled", True), ("constant", False)):
        step, after, _ = make(256, 8, dev, scheduled, a.steps + 20, True)
        for _ in range(10):  # eager first call, capture, warm replays
            step(), after()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p1:  # one replay alone: its kernel count
            step()
            torch.cuda.synchronize()
        after()
        alone = device_events(p1)
        per_step = len([e for e in alone if "emcpy" not in e[2]])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                step(), after()
            torch.cuda.synchronize()
        res[name] = {"kernels_per_step": per_step, **summarize(device_events(prof), per_step)}
        print(name, json.dumps(res[name]), flush=True)
    write_result(a.out, "schedule_gaps.json", res)


if __name__ == "__main__":
    main()
