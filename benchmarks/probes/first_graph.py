"""Why the first graph flowexec captures in a process runs slower (a probe, not a benchmark).

``schedule_gaps.py`` found that of two identical graph-mode training steps, the one captured
first runs its memcpy nodes as ``memcpy32_post`` kernels (the other: the copy engine's
``Memcpy DtoD``) and its forward GEMMs 0.3-0.4 µs longer each, whichever step it is; a plain
torch graph captured before both changes nothing. This captures the same MLP step (default
AdamW, constant lr) ``--copies`` times under one set of options, times each in alternating
rounds without the profiler (schedule.py's order effect), then profiles 200 replays of each
and reports per copy the kinds of its memcpys and its kernel time against the last copy's
(all are captured before the profiler first runs: if only the first copy differs, the capture
order decides; if all do, the profiler's late start):

    PYTHONPATH=. python3 benchmarks/probes/first_graph.py [--out DIR]
        [--no-stage-in-graph] [--touch-bindings] [--copies 3]

``--no-stage-in-graph`` stages inputs from Python (no memcpy nodes re-pointed through CUDA's
runtime bindings; no ``keep_graph``); ``--touch-bindings`` makes one runtime-bindings call
(``cudaGetDevice``) before anything is captured.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks"), os.path.join(_ROOT, "benchmarks", "probes")]
from ops import run_meta, write_result  # noqa: E402
from schedule import make, timed_rounds  # noqa: E402
from schedule_gaps import compare, profile_loop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--no-stage-in-graph", action="store_true")
    ap.add_argument("--touch-bindings", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cuda")
    res: dict[str, Any] = run_meta("PYTHONPATH=. python3 benchmarks/probes/first_graph.py " + " ".join(sys.argv[1:]))
    if a.no_stage_in_graph:
        from flowexec.runtime import cuda_graph

        init = cuda_graph.CudaGraphRunner.__init__
        cuda_graph.CudaGraphRunner.__init__ = lambda self, *p, **k: init(self, *p, **{**k, "stage_in_graph": False})
    if a.touch_bindings:
        from flowexec.runtime.staging import memcpy_runtime

        rt = memcpy_runtime()
        res["bindings"] = rt is not None and str(rt.cudaGetDevice())
    loops = []
    for _ in range(a.copies):  # all captured before any is profiled
        step, _, _ = make(256, 8, dev, False, a.steps + 20, True)
        for _ in range(3):  # eager first call, capture, a replay
            step()
        loops.append(step)
    # Without the profiler first (CUPTI, once on, may see graphs instantiated before it
    # differently): each copy's step time over alternating rounds, host drift shared.
    rounds: list[list[float]] = [[] for _ in loops]
    for _ in range(7):
        for k, step in enumerate(loops):
            rounds[k] += timed_rounds(step, lambda: None, 1, 100, torch.cuda.synchronize)[0]
    res["step_us_median"] = [statistics.median(r) for r in rounds]
    res["step_us_rounds"] = rounds
    print("µs a step, by copy (no profiler):", [round(x, 1) for x in res["step_us_median"]], flush=True)
    for k, step in enumerate(loops):
        res[f"copy{k}"] = profile_loop(step, lambda: None, a.steps)
    last = res[f"copy{a.copies - 1}"]
    for k in range(a.copies):
        r = res[f"copy{k}"]
        diff = compare(r["positions"], last["positions"])
        print(f"copy {k}: copies {r['copies_per_step_by_kind']}, span {r['span_us_median']:.1f} µs, "
              f"kernels vs the last copy {diff['kernel_us'] if diff else float('nan'):+.2f} µs", flush=True)
    write_result(a.out, "first_graph.json", res)


if __name__ == "__main__":
    main()
