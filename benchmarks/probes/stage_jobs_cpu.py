"""Probe: one pipeline stage's F and B jobs on the CPU, compiled (trace mode) against eager,
alone in one process (no pipeline, no gloo), alternating rounds; then the top ops of each B
from torch.profiler. Question: are compiled stages slower than eager on this CPU?

    python3 benchmarks/probes/stage_jobs_cpu.py [--threads 1] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from flowexec.pipeline.demo import Config, stage_modules  # noqa: E402
from flowexec.pipeline.runner import make_runner  # noqa: E402


def runner(stage: int, compile: bool):
    cfg = Config(width=1024, in_width=768, out_width=512, blocks=8, batch=512, n_micro=8, threads=1, lr=0.01,
                 schedule="1f1b")
    torch.manual_seed(0)
    mod = stage_modules(cfg, 2)[stage]
    x = torch.randn(64, 768) if stage == 0 else torch.randn(64, 1024).requires_grad_(True)
    r = make_runner(mod, example_inputs=(x,), loss_fn=torch.nn.functional.mse_loss if stage == 1 else None,
                    loss_scale=1 / 8, compile=compile)
    return r, x.detach(), torch.randn(64, 1024) if stage == 0 else None, torch.randn(64, 512) if stage == 1 else None


def one_round(r, x, g, y, n_micro=8):
    reset = getattr(r, "reset_grads", None)
    if reset is not None:
        reset()
    else:
        for p in r.parameters:
            p.grad = None
    fs, bs = [], []
    for m in range(n_micro):
        t = time.perf_counter()
        r.forward(m, (x,), y)
        fs.append(time.perf_counter() - t)
        t = time.perf_counter()
        r.backward(m, (g,) if g is not None else None)
        bs.append(time.perf_counter() - t)
    return fs, bs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = {"torch": torch.__version__, "threads": args.threads, "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t")}
    for stage in (0, 1):
        runs = {name: runner(stage, c) for name, c in (("eager", False), ("compiled", True))}
        times = {n: ([], []) for n in runs}
        for k in range(args.rounds):
            for n in (list(runs) if k % 2 == 0 else list(runs)[::-1]):
                fs, bs = one_round(*runs[n])
                if k >= 2:
                    times[n][0].extend(fs)
                    times[n][1].extend(bs)
        row = {n: {"F_ms": statistics.median(f) * 1e3, "B_ms": statistics.median(b) * 1e3} for n, (f, b) in times.items()}
        print(f"stage {stage}: " + "; ".join(f"{n} F {v['F_ms']:.2f} B {v['B_ms']:.2f} ms" for n, v in row.items()), flush=True)
        tops = {}
        for n, args_ in runs.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                one_round(*args_)
            tops[n] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
            print(f"-- stage {stage} {n}, one round (8 F + 8 B):\n{tops[n]}", flush=True)
        res[f"stage{stage}"] = {"median_ms": row, "profile": tops}
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
