"""Graph mode with state passed as arguments: read in place against copied in and back (CUDA).

An Adam-like step (moment lerp, second moment, parameter update, EMA lerp) whose parameter,
moments and EMA are *arguments* the step writes in place, at two state sizes, side by side in
one run (alternating rounds, median µs per call, each call followed by a sync):

* ``eager``: the step in PyTorch;
* ``graph, same tensors``: ``flowexec.compile(..., mode="graph")`` called with the tensors it was
  compiled with: the graph reads and writes them where they are;
* ``graph, staged``: the same executable where the written arguments are copied into the
  graph's buffers and back each call (what graph mode did for every argument before; reached
  here by compiling with copies and allowing no second borrowing graph);
* ``graph, borrow=(1,)``: also the gradient (read only, the same tensor each call) read in place,
  by the ``borrow`` option, instead of copied in by the graph's memcpy node;
* ``raw CUDA graph``: the eager step captured by ``torch.cuda.graph`` and replayed: the yardstick
  for any graph of these kernels.

Every variant's state is checked against eager's after the run.

    PYTHONPATH=. python3 benchmarks/graph_inputs.py --out benchmarks/results/graph_inputs.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flowexec  # noqa: E402
from flowexec.runtime.cuda_graph import capture_graph  # noqa: E402
from ops import run_meta  # noqa: E402
from step_time import interleaved  # noqa: E402


def step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, ema: torch.Tensor) -> torch.Tensor:
    m.lerp_(g, 0.1)
    v.mul_(0.999).addcmul_(g, g, value=0.001)
    p.sub_(1e-3 * m / (v.sqrt() + 1e-8))
    ema.lerp_(p, 0.01)
    return p[0]


def measure(n: int) -> dict[str, Any]:
    torch.manual_seed(0)
    init = [torch.randn(n, device="cuda") for _ in range(3)] + [torch.rand(n, device="cuda"), torch.randn(n, device="cuda")]
    states = {k: [t.clone() for t in init] for k in ("eager", "graph, same tensors", "graph, staged",
                                                     "graph, borrow=(1,)", "raw CUDA graph")}
    g = init[1]

    same = states["graph, same tensors"]
    exe_same = flowexec.compile(step, *same, mode="graph")

    staged = states["graph, staged"]
    exe_staged = flowexec.compile(step, *[t.clone() for t in staged], mode="graph")
    exe_staged._last.runner.max_borrowing = 1  # calls with other tensors than the example's: staged
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flowexec.RecaptureWarning)  # it says so once; expected here
        exe_staged(*staged)

    bo = states["graph, borrow=(1,)"]
    exe_borrow = flowexec.compile(step, bo[0], g, *bo[2:], mode="graph", borrow=(1,))

    raw = states["raw CUDA graph"]
    raw_graph = capture_graph(lambda: step(raw[0], g, raw[2], raw[3], raw[4]), warmup=0)[0]  # no warm-up: no step taken

    e = states["eager"]
    fns = {
        "eager": lambda: step(e[0], g, e[2], e[3], e[4]),
        "graph, same tensors": lambda: exe_same(same[0], g, same[2], same[3], same[4]),
        "graph, staged": lambda: exe_staged(staged[0], g, staged[2], staged[3], staged[4]),
        "graph, borrow=(1,)": lambda: exe_borrow(bo[0], g, bo[2], bo[3], bo[4]),
        "raw CUDA graph": raw_graph.replay,
    }
    fns["eager"]()  # every variant has now taken one step
    fns["graph, same tensors"]()
    fns["graph, borrow=(1,)"]()
    fns["raw CUDA graph"]()
    us = interleaved(fns, torch.cuda.synchronize, rounds=5, per_round=40)
    steps = 1 + 5 * 40
    errors = {}
    for k, st in states.items():  # p, m, v, ema against eager's after the same number of steps
        errors[k] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(
            [st[i] for i in (0, 2, 3, 4)], [e[i] for i in (0, 2, 3, 4)]))
    return {"elements": n, "state_MiB_each": n * 4 / 2**20, "steps": steps, "us": us,
            "speedup_vs_eager": {k: us["eager"] / v for k, v in us.items()},
            "graphs": {"same tensors": exe_same._last.runner.graph_count,
                       "staged": exe_staged._last.runner.graph_count},
            "max_rel_error_vs_eager": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "graph_inputs.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/graph_inputs.py needs a CUDA device")
    res: dict[str, Any] = {**run_meta("PYTHONPATH=. python3 benchmarks/graph_inputs.py"), "cases": {}}
    for n in (1 << 20, 1 << 24):  # 4 MiB and 64 MiB per state tensor
        res["cases"][f"{n * 4 >> 20} MiB"] = row = measure(n)
        print(f"{row['state_MiB_each']:.0f} MiB: " + ", ".join(f"{k} {v:.1f} µs" for k, v in row["us"].items())
              + f"; graphs {row['graphs']}; errors {row['max_rel_error_vs_eager']}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
