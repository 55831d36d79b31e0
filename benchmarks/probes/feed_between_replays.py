"""What a fed value's upload costs the device between two CUDA-graph replays (a probe, not a
benchmark): one graph of 200 small kernels (about a small training step) replayed 1,000 times,
with nothing between replays, a stream memory write, a
pinned copy plus an event (the ring), or the copy captured into the graph as its first node.

    PYTHONPATH=. python3 benchmarks/probes/feed_between_replays.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]
from flowexec.runtime.stream_writes import StreamWrites, _batch_mem_op  # noqa: E402
from ops import run_meta  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--kernels", type=int, default=200)
    a = ap.parse_args()
    x = torch.randn(64, 256, device="cuda")
    buf = torch.zeros(5, dtype=torch.float64, device="cuda")
    pinned = torch.zeros(5, dtype=torch.float64).pin_memory()

    def body(copy_first: bool) -> None:
        if copy_first:
            buf.copy_(pinned, non_blocking=True)
        y = x
        for _ in range(a.kernels):
            y = y * 1.0001
        x.copy_(y)

    graphs = {}
    for name, first in (("plain", False), ("in_graph_copy", True)):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body(first)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body(first)
        graphs[name] = g
    fn = _batch_mem_op()
    w_default = StreamWrites(buf, fn)
    vals = np.arange(5, dtype=np.float64)
    ring = [torch.zeros(5, dtype=torch.float64).pin_memory() for _ in range(4)]
    events = [torch.cuda.Event() for _ in range(4)]
    turn = [0]

    def ring_copy() -> None:
        k = turn[0] = (turn[0] + 1) % 4
        events[k].synchronize()
        ring[k].copy_(torch.from_numpy(vals))
        buf.copy_(ring[k], non_blocking=True)
        events[k].record()

    variants = {
        "nothing": ("plain", None),
        "stream_write": ("plain", lambda: w_default.write(vals)),
        "pinned_copy_and_event": ("plain", ring_copy),
        "copy_node_in_graph": ("in_graph_copy", None),
    }
    rounds: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(7):
        for k, (gname, before) in variants.items():
            replay = graphs[gname].replay
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(1000):
                if before is not None:
                    before()
                replay()
            torch.cuda.synchronize()
            rounds[k].append((time.perf_counter_ns() - t0) / 1000 / 1e3)
    res = run_meta("PYTHONPATH=. python3 benchmarks/probes/feed_between_replays.py")
    res["kernels_per_graph"] = a.kernels
    res["us_per_replay"] = {k: statistics.median(v) for k, v in rounds.items()}
    res["rounds"] = rounds
    base = res["us_per_replay"]["nothing"]
    res["extra_us"] = {k: v - base for k, v in res["us_per_replay"].items()}
    print(json.dumps({"us_per_replay": res["us_per_replay"], "extra_us": res["extra_us"]}, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "feed_between_replays.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
