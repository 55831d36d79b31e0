"""``flowexec demo``: train a built-in MLP on synthetic data through flowexec, beside eager.

The data is a fixed random "teacher" labelling Gaussian inputs, so the loss really falls.
Eager PyTorch runs the same steps on a twin model first, to give the step-time ratio.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

import flowexec

from .models import make_mlp, make_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batches(n: int, device: torch.device, width: int, classes: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(width, classes, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(batch, width, generator=g)
        out.append((x.to(device), (x @ teacher).argmax(1).to(device)))
    return out


WIDTH, DEPTH, CLASSES, BATCH = 256, 3, 10, 32  # the demo's MLP and batch


def _device(device: str | None) -> torch.device:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise flowexec.OptionError("--device cuda asked for, but this machine has no CUDA device")
    return dev


def _sgd_step(model: torch.nn.Module) -> Any:
    return make_step(model, torch.optim.SGD(model.parameters(), lr=0.2), F.cross_entropy)


def run_demo(steps: int = 300, device: str | None = None, out: str | None = None, console: Console | None = None) -> dict[str, Any]:
    """Train through flowexec and eager; return (and print) the figures."""
    console = console or Console()
    dev = _device(device)
    mode = "graph" if dev.type == "cuda" else "trace"
    width, depth, classes, batch = WIDTH, DEPTH, CLASSES, BATCH
    torch.manual_seed(0)
    model = make_mlp(width, depth, classes).to(dev)
    twin = copy.deepcopy(model)
    data = _batches(min(steps, 64), dev, width, classes, batch)

    eager = _sgd_step(twin)
    step = _sgd_step(model)

    console.print(f"[bold]flowexec demo[/]: MLP {depth}×{width}, batch {batch}, SGD, {steps} steps on {dev} (mode={mode})")
    t0 = time.perf_counter()
    exe = flowexec.compile(step, *data[0], mode=mode)
    build_s = time.perf_counter() - t0
    stats = exe.plan.stats()
    console.print(f"captured {stats['ops']} ops, {stats['frees']} frees planned, build {build_s:.2f} s")

    def timed(fn: Any, label: str) -> tuple[list[float], list[float]]:
        losses, times = [], []
        with Progress(TextColumn(f"{label:>8}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                      TimeRemainingColumn(), console=console, transient=False) as bar:
            task = bar.add_task(label, total=steps, loss="-")
            for i in range(steps):
                x, y = data[i % len(data)]
                _sync(dev)
                t = time.perf_counter()
                loss = fn(x, y)
                _sync(dev)
                times.append(time.perf_counter() - t)
                losses.append(float(loss.detach()))
                if i % 10 == 0 or i == steps - 1:
                    bar.update(task, completed=i + 1, loss=f"{losses[-1]:.4f}")
        return losses, times

    eager_losses, eager_times = timed(eager, "eager")
    fx_losses, fx_times = timed(exe, "flowexec")
    skip = min(10, steps // 2)  # warm-up steps
    e_us = statistics.median(eager_times[skip:]) * 1e6
    f_us = statistics.median(fx_times[skip:]) * 1e6
    result = {
        "device": str(dev), "mode": mode, "steps": steps, "build_s": build_s, "plan": stats,
        "eager_step_us": e_us, "flowexec_step_us": f_us, "speedup": e_us / f_us,
        "loss_start": fx_losses[0], "loss_end": fx_losses[-1],
        "eager_loss_start": eager_losses[0], "eager_loss_end": eager_losses[-1],
        "max_loss_diff_vs_eager": max(abs(a - b) for a, b in zip(fx_losses, eager_losses)),
        "torch": torch.__version__,
    }
    table = Table(title="flowexec demo")
    for col in ("", "eager", "flowexec"):
        table.add_column(col, justify="right")
    table.add_row("step time (median)", f"{e_us:.0f} µs", f"{f_us:.0f} µs ({e_us / f_us:.2f}× eager)")
    table.add_row("loss start → end", f"{eager_losses[0]:.4f} → {eager_losses[-1]:.4f}", f"{fx_losses[0]:.4f} → {fx_losses[-1]:.4f}")
    console.print(table)
    console.print(f"largest loss difference from eager over {steps} steps: {result['max_loss_diff_vs_eager']:.2e}")
    if out:
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "demo.json")
        with open(path, "w") as fh:
            json.dump({**result, "losses": fx_losses, "eager_losses": eager_losses}, fh, indent=1)
        console.print(f"wrote {path}")
        result["pipeline_timeline"] = _pipeline_timeline(out, console)
    return result


def _pipeline_timeline(out: str, console: Console) -> list[dict[str, Any]]:
    """``demo --out``'s second part: a profiled 2-rank gloo pipeline, its trace and page in ``out``."""
    from .pipeline.schedules import SCHEDULES
    from .pipeline.demo import profile_pipeline

    schedules = tuple(s for s in ("1f1b", "zbh1") if s in SCHEDULES)
    console.print(f"[bold]pipeline timeline[/]: 2 gloo ranks (CPU), 4 blocks of Linear(1024) + tanh, "
                  f"{' and '.join(schedules)}, 3 steps recorded")
    runs = profile_pipeline(out, schedules, width=1024)  # wide enough that the jobs, not the host, dominate
    for run in runs:
        th, at = run["theory_bubble"], run["theory_bubble_measured_costs"]
        notes = ([f"schedule's theory {th:.0%}"] if th is not None else []) + (
            ["at the measured job times " + ", ".join(f"{v:.0%}" for v in at.values())] if at else [])
        console.print(f"{run['schedule']}: bubble " + ", ".join(f"rank {r['rank']} {r['bubble']:.0%}" for r in run["summary"])
                      + (f" ({'; '.join(notes)})" if notes else ""))
        console.print(f"  trace: {run['trace']} (https://ui.perfetto.dev)\n  page:  {run['page']}")
    return runs


def run_profile(runs: int = 20, device: str | None = None, out: str = "flowexec-trace.json", top: int = 10,
                streams: int = 1, console: Console | None = None) -> Any:
    """``flowexec profile``: the demo's training step in trace mode, each instruction's host time
    over ``runs`` steps; prints the costliest and writes the Chrome trace to ``out``."""
    console = console or Console()
    dev = _device(device)
    torch.manual_seed(0)
    step = _sgd_step(make_mlp(WIDTH, DEPTH, CLASSES).to(dev))
    x, y = _batches(1, dev, WIDTH, CLASSES, BATCH)[0]
    console.print(f"[bold]flowexec profile[/]: the demo's step (MLP {DEPTH}×{WIDTH}, batch {BATCH}, SGD) in trace "
                  f"mode on {dev}, {runs} runs, host time per instruction"
                  + (" (on CUDA: launch time, not kernel time)" if dev.type == "cuda" else ""))
    tl = flowexec.profile(step, x, y, runs=runs, streams=streams)
    table = Table("#", "op", "source", "µs per run", "share")
    for i, text, src, us, share in tl.top(top):
        table.add_row(str(i), text, src, f"{us:.1f}", f"{share:.0%}")
    console.print(table)
    console.print(tl.summary())
    console.print(f"Chrome trace: {tl.save(out)} (open in https://ui.perfetto.dev)")
    return tl
