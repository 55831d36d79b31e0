"""What runtime/feed_side.py assumes of CUDA's external event nodes in a graph (a probe):

1. a graph's event-record node counts as the event's most recent record from the launch on:
   a wait issued on another stream right after the launch waits for that replay;
2. a graph's event-wait node waits for the record made before the launch, not for one made
   after it (else a replay could wait for an upload that waits for that replay: a hang);
3. uploads through the pinned ring, the host far ahead, reach each replay in turn.

    PYTHONPATH=. python3 benchmarks/probes/external_events.py [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]
from ops import run_meta, write_result  # noqa: E402

SLEEP = 5_000_000  # GPU cycles: a few ms


def captured(body: Any) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    torch.cuda.synchronize()
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res: dict[str, Any] = run_meta("PYTHONPATH=. python3 benchmarks/probes/external_events.py")
    dev = torch.device("cuda")
    side = torch.cuda.Stream(priority=-1)
    ready, done = torch.cuda.Event(external=True), torch.cuda.Event(external=True)
    ready.record(side), done.record(side)

    # 1. the record node's record counts from the launch
    x, y = torch.zeros(1, device=dev), torch.zeros(1, device=dev)

    def body1() -> None:
        torch.cuda._sleep(SLEEP)
        x.add_(1)
        done.record(torch.cuda.current_stream())
    g1 = captured(body1)
    x.zero_()
    g1.replay()
    side.wait_event(done)
    with torch.cuda.stream(side):
        y.copy_(x)
    torch.cuda.synchronize()
    res["record_node_counts_from_launch"] = y.item() == 1.0

    # 2. the wait node waits for the record made before the launch only
    buf, z = torch.zeros(1, device=dev), torch.zeros(1, device=dev)

    def body2() -> None:
        torch.cuda.current_stream().wait_event(ready)
        z.copy_(buf)
    g2 = captured(body2)
    torch.cuda._sleep(SLEEP)  # the replay starts late ...
    g2.replay()
    with torch.cuda.stream(side):  # ... and a record after its launch lands later still
        torch.cuda._sleep(2 * SLEEP)
        buf.fill_(7)
        ready.record(side)
    torch.cuda.synchronize()
    res["wait_node_binds_at_launch"] = z.item() == 0.0

    # 3. the pinned ring, host ahead: acc sums every uploaded value once
    from flowexec.hyperparams import Feeds, PinnedRing
    from flowexec.runtime.feed_side import SideUpload

    fed = torch.zeros(1, dtype=torch.float64, device=dev)
    acc = torch.zeros(1, dtype=torch.float64, device=dev)
    up = SideUpload(fed, PinnedRing([torch.zeros(1, dtype=torch.float64).pin_memory() for _ in range(Feeds.RING)]))

    def body3() -> None:
        up.wait_ready()
        acc.add_(fed)
        up.record_done()
    g3 = captured(body3)
    acc.zero_()
    n = 2000
    for i in range(1, n + 1):
        up.upload(torch.tensor([float(i)], dtype=torch.float64))
        g3.replay()
    torch.cuda.synchronize()
    res["ring_sum"], res["ring_sum_expected"] = acc.item(), n * (n + 1) / 2
    res["ring_ok"] = res["ring_sum"] == res["ring_sum_expected"]
    print({k: v for k, v in res.items() if k not in ("device", "torch", "triton", "python", "date", "command")})
    write_result(a.out, "external_events.json", res)


if __name__ == "__main__":
    main()
