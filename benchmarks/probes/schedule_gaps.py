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
from typing import Any, Callable

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
    is_copy = [("Memcpy" in e[2] or "memcpy" in e[2]) for e in events]
    copies = [e for e, c in zip(events, is_copy) if c]
    work = [e for e, c in zip(events, is_copy) if not c]
    steps = [work[i:i + kernels_per_step] for i in range(0, len(work) - kernels_per_step + 1, kernels_per_step)]
    spans = [b[0][0] - a[0][0] for a, b in zip(steps, steps[1:])]
    gaps = [b[0][0] - a[-1][1] for a, b in zip(steps, steps[1:])]
    # Per position in the replay: the median duration of its kernel and of the idle time before
    # it (what a diff of two loops' tables points at), and where the copies fall.
    positions = [{
        "name": steps[0][k][2][:60],
        "us": statistics.median(s[k][1] - s[k][0] for s in steps),
        "idle_before_us": statistics.median(s[k][0] - s[k - 1][1] for s in steps) if k else None,
    } for k in range(kernels_per_step)] if steps else []
    starts = [s[0][0] for s in steps]
    kinds: dict[str, int] = {}
    for c in copies:
        i = sum(1 for t in starts if t <= c[0])  # the replay the copy follows the start of
        where = "inside" if 0 < i <= len(steps) and c[0] < steps[i - 1][-1][1] else "between"
        key = f"{where}: {c[2][:50]}"
        kinds[key] = kinds.get(key, 0) + 1
    return {
        "device_events": len(events), "copies": len(copies),
        "copies_inside_a_replay": sum(n for k, n in kinds.items() if k.startswith("inside")),
        "copies_per_step_by_kind": {k: v / max(len(steps), 1) for k, v in sorted(kinds.items())},
        "positions": positions,
        "copy_us_median": statistics.median([c[1] - c[0] for c in copies]) if copies else None,
        "span_us_median": statistics.median(spans) if spans else None,
        "gap_before_replay_us_median": statistics.median(gaps) if gaps else None,
        "gap_before_replay_us_p90": sorted(gaps)[int(0.9 * len(gaps))] if gaps else None,
    }


def profile_loop(step: Callable[[], Any], after: Callable[[], None], steps: int) -> dict[str, Any]:
    """``step`` (then ``after``) warmed up (eager first call, capture, replays), one step
    profiled alone for its kernel count, then ``steps`` under the profiler: :func:`summarize`'s
    figures."""
    for _ in range(10):
        step(), after()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p1:
        step()
        torch.cuda.synchronize()
    after()
    per_step = len([e for e in device_events(p1) if "emcpy" not in e[2]])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(), after()
        torch.cuda.synchronize()
    return {"kernels_per_step": per_step, **summarize(device_events(prof), per_step)}


def compare(a_pos: list[dict[str, Any]], b_pos: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Kernel and idle time the first loop spends more than the second, summed over positions,
    and the positions that differ most (None where the loops' kernels do not line up)."""
    if len(a_pos) != len(b_pos) or any(x["name"] != y["name"] for x, y in zip(a_pos, b_pos)):
        return None
    diff = sorted(({"at": k, "name": x["name"], "us": x["us"] - y["us"],
                    "idle_before_us": (x["idle_before_us"] or 0) - (y["idle_before_us"] or 0)}
                   for k, (x, y) in enumerate(zip(a_pos, b_pos))),
                  key=lambda d: -(d["us"] + d["idle_before_us"]))
    return {"kernel_us": sum(d["us"] for d in diff), "idle_inside_us": sum(d["idle_before_us"] for d in diff),
            "top": diff[:8]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--constant-first", action="store_true", help="build, capture and profile the constant loop first")
    ap.add_argument("--prime", action="store_true",
                    help="capture and replay a tiny plain torch graph (a copy and a matmul) before either loop")
    a = ap.parse_args()
    dev = torch.device("cuda")
    res: dict[str, Any] = run_meta("PYTHONPATH=. python3 benchmarks/probes/schedule_gaps.py")
    res["primed"] = a.prime
    if a.prime:  # whether the first graph's memcpy32_post copies are the process's first graph's
        u, v = torch.randn(64, 64, device=dev), torch.empty(64, 64, device=dev)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            v.copy_(u), u @ v
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            v.copy_(u)
            u @ v
        g.replay()
        torch.cuda.synchronize()
    order = (("scheduled", True), ("constant", False))
    for name, scheduled in order[::-1] if a.constant_first else order:
        res[name] = profile_loop(*make(256, 8, dev, scheduled, a.steps + 20, True)[:2], a.steps)
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "positions"}), flush=True)
    # The same two loops in eager mode: what the changed values alone cost the kernels (the
    # weights follow another path; any difference here is the data's, not the feeding's).
    for name, scheduled in (("eager_scheduled", True), ("eager_constant", False)):
        res[name] = profile_loop(*make(256, 8, dev, scheduled, a.steps + 20, False)[:2], a.steps)
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "positions"}), flush=True)
    for a_name, b_name in (("scheduled", "constant"), ("eager_scheduled", "eager_constant")):
        diff = compare(res[a_name]["positions"], res[b_name]["positions"])
        if diff is not None:
            res[f"{a_name}_minus_{b_name}"] = diff
            print(f"{a_name} - {b_name}", json.dumps(diff), flush=True)
    write_result(a.out, "schedule_gaps.json", res)


if __name__ == "__main__":
    main()
