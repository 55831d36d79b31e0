"""One pipeline stage's jobs on one device: F, I, W and the full backward B, each through
flowexec's CompiledRunner (graph mode on CUDA: a job is a CUDA-graph replay; trace mode on
CPU) against eager PyTorch, and the cost of splitting the backward (I + W against B).

Eager jobs: F = ``stage(x)`` with ``x.requires_grad``; B = ``torch.autograd.backward(out, g)``;
I = ``torch.autograd.grad(out, x, g, retain_graph=True)``; W = ``torch.autograd.grad(out,
params, g)`` (what ``EagerRunner`` does). Parameter gradients accumulate in ``.grad`` in both
implementations. The stage: ``--blocks`` pre-norm transformer blocks (attention, layer norm,
GELU MLP) of width ``--d``, ``--heads`` heads, micro-batch ``--batch`` × ``--seq`` tokens.

Each job is timed alone: the device is synchronised, the job runs, the device is synchronised
again (wall time, so host overhead counts), and CUDA events around the job give the device
span as well. Rounds alternate eager and flowexec; figures are medians over every timed
iteration of every round. Before timing, one F/I/W of each implementation is compared (output,
input gradient, parameter gradients: relative error).

    PYTHONPATH=. python3 benchmarks/pipeline_jobs.py --out benchmarks/results          # GPU, ~1 min
    PYTHONPATH=. python3 benchmarks/pipeline_jobs.py --device cpu --quick --out /tmp   # CPU smoke
    PYTHONPATH=. python3 benchmarks/pipeline_jobs.py --device cpu --blocks 2 --d 256 --heads 4 --seq 64 --batch 4 --iters 10 --out benchmarks/results   # CPU figure
"""
from __future__ import annotations

import argparse
import copy
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
from flowexec.models import PreNormBlock  # noqa: E402
from flowexec.pipeline.compiled import CompiledRunner  # noqa: E402

KINDS = ("F", "I", "W", "B")


Block = PreNormBlock


class Timer:
    """Wall time (synchronised before and after) and, on CUDA, the device span by events."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, float | None]:
        self.sync()
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            b.record()
        self.sync()
        wall = (time.perf_counter() - t0) * 1e6
        return wall, (a.elapsed_time(b) * 1e3 if self.cuda else None)


class EagerJobs:
    def __init__(self, stage: torch.nn.Module) -> None:
        self.stage = stage
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.state: dict[str, Any] = {}

    def F(self, x: torch.Tensor) -> torch.Tensor:
        xr = x.detach().requires_grad_(True)
        out = self.stage(xr)
        self.state = {"x": xr, "out": out}
        return out.detach()

    def B(self, g: torch.Tensor) -> torch.Tensor:
        torch.autograd.backward(self.state["out"], g)
        return self.state.pop("x").grad

    def I(self, g: torch.Tensor) -> torch.Tensor:  # noqa: E743
        (gx,) = torch.autograd.grad(self.state["out"], self.state["x"], g, retain_graph=True)
        self.state["g"] = g
        return gx

    def W(self) -> None:
        grads = torch.autograd.grad(self.state["out"], self.params, self.state["g"])
        for p, gp in zip(self.params, grads):
            if p.grad is None:
                p.grad = gp
            else:
                p.grad.add_(gp)
        self.state = {}


class FlowexecJobs:
    def __init__(self, stage: torch.nn.Module, x: torch.Tensor, mode: str) -> None:
        self.runner = CompiledRunner(stage, example_inputs=(x,), mode=mode)

    def F(self, x: torch.Tensor) -> torch.Tensor:
        return self.runner.forward(0, (x,))[0]

    def B(self, g: torch.Tensor) -> torch.Tensor:
        return self.runner.backward(0, (g,))[0]

    def I(self, g: torch.Tensor) -> torch.Tensor:  # noqa: E743
        return self.runner.backward_input(0, (g,))[0]

    def W(self) -> None:
        self.runner.backward_weight(0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(eager: EagerJobs, fx: FlowexecJobs, x: torch.Tensor, g: torch.Tensor) -> dict[str, float]:
    """One F/I/W through each; the worst relative errors of outputs and gradients."""
    for p in eager.params + fx.runner.parameters:
        p.grad = None
    ye, yf = eager.F(x), fx.F(x)
    after_f = fx.runner.kept_bytes(0)
    ge, gf = eager.I(g), fx.I(g)
    after_i = fx.runner.kept_bytes(0)
    eager.W()
    fx.W()
    res = {"output": rel_err(yf, ye), "input_grad": rel_err(gf, ge),
           "param_grads": max(rel_err(p.grad, q.grad) for p, q in zip(fx.runner.parameters, eager.params)),
           "held_bytes_after_F": after_f, "held_bytes_after_I": after_i}
    for p in eager.params + fx.runner.parameters:
        p.grad = None
    return res


def time_jobs(jobs: Any, x: torch.Tensor, g: torch.Tensor, timer: Timer, iters: int,
              out: dict[str, list[tuple[float, float | None]]]) -> None:
    """Per iteration: F, I, W timed one by one, then F (untimed) and B timed."""
    for _ in range(iters):
        out["F"].append(timer(lambda: jobs.F(x)))
        out["I"].append(timer(lambda: jobs.I(g)))
        out["W"].append(timer(jobs.W))
        jobs.F(x)
        out["B"].append(timer(lambda: jobs.B(g)))


def summarise(samples: list[tuple[float, float | None]]) -> dict[str, float | None]:
    walls = [w for w, _ in samples]
    dev = [d for _, d in samples if d is not None]
    return {"wall_us": statistics.median(walls), "device_us": statistics.median(dev) if dev else None,
            "n": len(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes and few iterations (a smoke run)")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results", help="directory (or .json path) for the results")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.d, args.heads, args.seq, args.batch, args.rounds, args.iters = 2, 64, 4, 16, 4, 2, 3
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    mode = "graph" if device.type == "cuda" else "trace"
    torch.manual_seed(0)
    stage = torch.nn.Sequential(*[Block(args.d, args.heads) for _ in range(args.blocks)]).to(device, dtype)
    stage_fx = copy.deepcopy(stage)
    x = torch.randn(args.batch, args.seq, args.d, device=device, dtype=dtype)
    g = torch.randn_like(x)
    t0 = time.perf_counter()
    fx = FlowexecJobs(stage_fx, x, mode)
    build_s = time.perf_counter() - t0
    eager = EagerJobs(stage)
    errors = check(eager, fx, x, g)
    timer = Timer(device)
    samples: dict[str, dict[str, list]] = {impl: {k: [] for k in KINDS} for impl in ("eager", "flowexec")}
    for impl, jobs in (("eager", eager), ("flowexec", fx)):  # warm-up (graph mode captures its graphs here)
        time_jobs(jobs, x, g, timer, 2, {k: [] for k in KINDS})
    for r in range(args.rounds):
        order = (("eager", eager), ("flowexec", fx)) if r % 2 == 0 else (("flowexec", fx), ("eager", eager))
        for impl, jobs in order:
            time_jobs(jobs, x, g, timer, args.iters, samples[impl])
    figures = {impl: {k: summarise(v) for k, v in s.items()} for impl, s in samples.items()}
    key = "device_us" if device.type == "cuda" else "wall_us"
    speedup = {k: figures["eager"][k][key] / figures["flowexec"][k][key] for k in KINDS}
    wall_speedup = {k: figures["eager"][k]["wall_us"] / figures["flowexec"][k]["wall_us"] for k in KINDS}
    split_cost = {impl: (f["I"][key] + f["W"][key]) / f["B"][key] for impl, f in figures.items()}
    cap = fx.runner.capture
    meta = host_meta(" ".join(sys.argv))
    if device.type == "cuda":
        meta["device"] = torch.cuda.get_device_name(device)
    result = {
        **meta,
        "config": {"blocks": args.blocks, "d": args.d, "heads": args.heads, "seq": args.seq, "batch": args.batch,
                   "dtype": args.dtype, "mode": mode, "rounds": args.rounds, "iters": args.iters, "quick": args.quick},
        "build_seconds": build_s,
        "programs": {"forward_ops": len(cap.forward.ops), "backward_ops": len(cap.backward.ops),
                     "i_ops": len(cap.split.i_program.ops), "w_ops": len(cap.split.w_program.ops),
                     "saved_values": len(cap.saved), "kept_values": len(cap.split.kept),
                     "graph_slots": fx.runner.graph_slots},
        "max_rel_err": {k: v for k, v in errors.items() if not k.startswith("held")},
        # what one micro-batch holds between its jobs (tensors counted whole)
        "held_bytes": {"after_F": errors["held_bytes_after_F"], "after_I": errors["held_bytes_after_I"]},
        "figure": key,
        "jobs": figures,
        "speedup_vs_eager": speedup,
        "wall_speedup_vs_eager": wall_speedup,
        "split_cost_i_plus_w_over_b": split_cost,
    }
    path = args.out if args.out.endswith(".json") else os.path.join(args.out, f"pipeline_jobs_{device.type}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{meta['device']} {args.dtype} {args.blocks} blocks d={args.d} seq={args.seq} batch={args.batch} ({key}):")
    for k in KINDS:
        e, fl = figures["eager"][k][key], figures["flowexec"][k][key]
        print(f"  {k}: eager {e:9.1f} us  flowexec {fl:9.1f} us  {speedup[k]:.2f}x")
    print(f"  (I+W)/B: eager {split_cost['eager']:.3f}  flowexec {split_cost['flowexec']:.3f}")
    print(f"  held per micro-batch: after F {errors['held_bytes_after_F'] / 2**20:.1f} MiB, "
          f"after I {errors['held_bytes_after_I'] / 2**20:.1f} MiB")
    print(f"  max rel err {result['max_rel_err']}; wrote {path}")


if __name__ == "__main__":
    main()
