"""Garbage collectors on CPU: a chain of elementwise ops over 64 MiB tensors (each intermediate
dies one op later), eager against flowexec's trace mode with ``gc="fast"`` (drop at last use,
on the caller's thread) and ``gc="async"`` (dropped on one worker thread), in alternating rounds,
with 1 and 2 intra-op threads. A 64 MiB CPU tensor returns its pages to the kernel when freed,
which is what the async collector takes off the caller's thread.

    python3 benchmarks/gc_cpu.py --out benchmarks/results/gc_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from host_meta import host_meta  # noqa: E402
import flowexec  # noqa: E402
from flowexec.runtime.gc import collector  # noqa: E402


def chain(x: torch.Tensor) -> torch.Tensor:
    a = x * 1.5
    b = a + 0.5
    c = b * b
    d = c - a
    e = d.abs()
    f = e.sqrt()
    g = f * 0.25
    h = g + b
    return h.sum()


def step_ms(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gc_cpu.json"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    x = torch.randn(args.mib * 2**20 // 4)
    fns = {"eager": lambda: chain(x),
           "trace, gc=fast": flowexec.compile(chain, x, gc="fast"),
           "trace, gc=async": flowexec.compile(chain, x, gc="async")}
    want = chain(x)
    for name, fn in fns.items():
        got = fn() if name == "eager" else fn(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    res: dict[str, Any] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        calls = {n: (f if n == "eager" else (lambda f=f: f(x))) for n, f in fns.items()}
        rounds: dict[str, list[float]] = {n: [] for n in calls}
        for r in range(args.rounds):
            for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                rounds[name].append(step_ms(calls[name], args.calls))
                collector().drain()  # the async collector's backlog does not spill into the next timing
        med = {n: statistics.median(v) for n, v in rounds.items()}
        res[f"{threads} thread(s)"] = {"rounds_ms": rounds, "median_ms": med,
                                       "async_vs_fast": med["trace, gc=fast"] / med["trace, gc=async"],
                                       "async_vs_eager": med["eager"] / med["trace, gc=async"]}
        print(f"{threads} thread(s): " + ", ".join(f"{n} {v:.1f} ms" for n, v in med.items()), flush=True)
    out = {**host_meta(f"python3 benchmarks/gc_cpu.py --rounds {args.rounds} --calls {args.calls} --mib {args.mib}"),
           "results": res}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
