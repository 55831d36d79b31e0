"""What profiling costs: on against off.

1. The CPU pipeline step, 2 gloo ranks (4 blocks of Linear(256) + tanh, batch 64 in 4
   micro-batches, 1F1B, one thread per rank): every step recorded (the job records, the
   optimizer's timer, the flush and the JSON-lines write per step) against no profiler, in
   alternating rounds of fresh process pairs; the figure is the median step of rank 0 over the
   last steps of each round, then the median over rounds.
2. The demo's MLP step (3 x 256, batch 32, SGD) in trace mode, per call: plain; under
   ``flowexec.profile`` with host stamps per instruction; with device times (a CUDA event per
   instruction; CUDA only) — what per-instruction timing costs.
3. A job timer around that whole step, the way a user's loop runs: ``steps`` steps back to back
   (no synchronisation between them), the timer on for all of them with ``begin``/``end`` and a
   ``flush`` per step as the trainer does, ``finish`` after the last (the end of a recorded run,
   counted), against the same loop with the timer off, in alternating rounds; µs per step. The
   cost per job the pipeline pays, ≤ 2% is the aim.
4. (CUDA) The same timer around graph-mode jobs, what a pipeline's jobs are on CUDA: one
   CUDA-graph replay per job (an MLP step, 4 x 2048, batch 2048).
Overheads are the median over rounds of each round's on/off ratio (the two measured back to
back; the host's speed moves between rounds).

    python3 benchmarks/profiler_overhead.py --out benchmarks/results/profiler_overhead.json
    python3 benchmarks/profiler_overhead.py --device cpu --quick --out /tmp/po.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from host_meta import host_meta  # noqa: E402

import flowexec  # noqa: E402
from flowexec.models import make_mlp, make_step  # noqa: E402
from flowexec.profiler import JobTimer  # noqa: E402
from flowexec.profiler.timers import FLUSH_BATCH, CudaEvents, DriverEvents  # noqa: E402


def paired(on: list[float], off: list[float]) -> float:
    """Median over rounds of (on / off - 1), each round's two figures measured back to back: the
    host's speed moves between rounds (±30% on the lent machine), so ratios within a round are
    what compares."""
    return statistics.median(a / b - 1 for a, b in zip(on, off))


def pipeline_overhead(rounds: int, steps: int) -> dict[str, Any]:
    from flowexec.pipeline.launch import spawn
    from flowexec.pipeline.demo import Config, profiled_worker

    cfg = Config(width=256, blocks=4, batch=64, n_micro=4, schedule="1f1b", steps=steps, threads=1)
    med: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            with tempfile.TemporaryDirectory() as d:
                res = spawn(profiled_worker, 2, asdict(cfg), d, None if mode == "off" else list(range(steps)),
                            timeout=300)
            med[mode].append(statistics.median(res[0]["step_ns"][2:]) / 1e6)
    off, on = statistics.median(med["off"]), statistics.median(med["on"])
    return {"what": "2-rank gloo 1F1B step, every step recorded vs no profiler (rank 0, ms)",
            "off_ms": off, "on_ms": on, "overhead": paired(med["on"], med["off"]),
            "overhead_of_medians": on / off - 1, "rounds_off_ms": med["off"], "rounds_on_ms": med["on"]}


def timed_loop(exe: Any, args: tuple[Any, ...], timer: JobTimer | None, n: int, sync: Any) -> float:
    """µs per step of ``n`` calls back to back (the device drained before and after), each a
    job of ``timer`` when there is one (begin, call, end, flush; ``finish`` after the last,
    counted)."""
    sync()
    t0 = time.perf_counter_ns()
    for k in range(n):
        if timer is not None:
            tok = timer.begin(step=k, stage=0, kind="F", micro=0)
            exe(*args)
            timer.end(tok)
            timer.flush()
        else:
            exe(*args)
    if timer is not None:
        timer.finish()
    sync()
    return (time.perf_counter_ns() - t0) / 1e3 / n


def _timed(fn, sync, n: int) -> float:
    out = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter_ns()
        fn()
        sync()
        out.append(time.perf_counter_ns() - t0)
    return statistics.median(out) / 1e3


def mlp_overhead(dev: torch.device, runs: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_mlp(256, 3).to(dev)
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.01), F.cross_entropy)
    x, y = torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
    exe = flowexec.compile(step, x, y, mode="trace")
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for _ in range(10):
        exe(x, y)
    out: dict[str, Any] = {"what": "demo MLP step (3 x 256, batch 32, SGD), trace mode, µs per call (median); job_timer_us and "
                                   "loop_off_us: µs per step of loop_steps steps back to back, timer on / off",
                           "instructions": len(exe.plan.instructions)}
    rows: dict[str, list[float]] = {"plain": [], "host_stamps": [], "device_times": [], "job_timer": []}
    # As the trainer's recording sets it up (flowexec.profiler.recording: the native event clock
    # where it is built), and, on CUDA, the same timer on the driver through ctypes and on
    # torch.cuda.Event, for comparison.
    timers = {"on": JobTimer(dev, batch=FLUSH_BATCH)}
    if dev.type == "cuda":
        timers["on_ctypes_events"] = JobTimer(dev, batch=FLUSH_BATCH, events=DriverEvents(dev))
        timers["on_torch_events"] = JobTimer(dev, batch=FLUSH_BATCH, events=CudaEvents(dev))
        timers["on_flush_each_step"] = JobTimer(dev)
    timer = timers["on"]
    n_loop = 10 if runs < 100 else 50

    def loop(mode: str) -> float:
        return timed_loop(exe, (x, y), timers.get(mode), n_loop, sync)

    for mode in ("off", *timers):  # warm: the pool's events, the allocator
        loop(mode)
    loop_rows: dict[str, list[float]] = {"off": [], **{m: [] for m in timers}}
    for _ in range(max(5, runs // 10)):  # alternating rounds, so that drift hits all alike
        for mode in loop_rows:
            loop_rows[mode].append(loop(mode))
    for _ in range(3):  # alternate, so that drift hits all alike
        rows["plain"].append(_timed(lambda: exe(x, y), sync, runs))
        rows["host_stamps"].append(statistics.median(flowexec.profile(exe, x, y, runs=runs, device_times=False).run_us))
        if dev.type == "cuda":
            rows["device_times"].append(statistics.median(flowexec.profile(exe, x, y, runs=runs, device_times=True).run_us))
    rows["loop_off"], rows["job_timer"] = loop_rows["off"], loop_rows["on"]
    out["loop_steps"] = n_loop
    out["rounds_loop_off_us"], out["rounds_loop_on_us"] = loop_rows["off"], loop_rows["on"]
    out["events_created"] = timer.events_created
    for k, v in rows.items():
        if v:
            out[f"{k}_us"] = statistics.median(v)
    plain = out["plain_us"]
    for k in ("host_stamps", "device_times"):
        if f"{k}_us" in out:
            out[f"{k}_overhead"] = out[f"{k}_us"] / plain - 1
    out["job_timer_overhead"] = paired(loop_rows["on"], loop_rows["off"])  # against the same loop, timer off
    out["job_timer_overhead_of_medians"] = out["job_timer_us"] / out["loop_off_us"] - 1
    out["job_timer_events"] = type(timer._events).__name__ if timer._events is not None else "host clock"
    for mode in timers:
        if mode != "on":
            out[f"rounds_loop_{mode}_us"] = loop_rows[mode]
            out[f"job_timer_{mode}_overhead"] = paired(loop_rows[mode], loop_rows["off"])
    if "device_times_us" in out:
        out["device_times_us_per_instruction"] = (out["device_times_us"] - plain) / out["instructions"]
    return out


def graph_job_overhead(dev: torch.device, rounds: int) -> dict[str, Any]:
    """The job timer around graph-mode jobs, what a pipeline's jobs are on CUDA (one CUDA-graph
    replay each): an MLP training step (4 x 2048, batch 2048) in graph mode, 50 back to back,
    the timer on (begin/end/flush per job, finish counted) against off, paired rounds."""
    torch.manual_seed(0)
    model = make_mlp(2048, 4).to(dev)
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.01), F.cross_entropy)
    x, y = torch.randn(2048, 2048, device=dev), torch.randint(0, 10, (2048,), device=dev)
    exe = flowexec.compile(step, x, y, mode="graph")
    timer = JobTimer(dev, batch=FLUSH_BATCH)
    n = 50

    def loop(on: bool) -> float:
        return timed_loop(exe, (x, y), timer if on else None, n, lambda: torch.cuda.synchronize(dev))
    for on in (False, True, False, True):
        loop(on)
    rows: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        rows["off"].append(loop(False))
        rows["on"].append(loop(True))
    return {"what": "job timer around graph-mode jobs: MLP step 4 x 2048, batch 2048, one CUDA-graph replay "
                    "per job, 50 back to back; µs per job", "off_us": statistics.median(rows["off"]),
            "on_us": statistics.median(rows["on"]), "overhead": paired(rows["on"], rows["off"]),
            "rounds_off_us": rows["off"], "rounds_on_us": rows["on"],
            "events": type(timer._events).__name__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and runs (a smoke test)")
    ap.add_argument("--skip-pipeline", action="store_true", help="only the MLP step (the GPU machine)")
    args = ap.parse_args()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    res: dict[str, Any] = {**host_meta(" ".join(sys.argv)), "torch_device": str(dev)}
    if dev.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(dev)
    res["mlp"] = mlp_overhead(dev, 20 if args.quick else 200)
    print(json.dumps(res["mlp"], indent=1), flush=True)
    if dev.type == "cuda":
        res["graph_jobs"] = graph_job_overhead(dev, 5 if args.quick else 15)
        print(json.dumps({k: v for k, v in res["graph_jobs"].items() if not k.startswith("rounds")}, indent=1), flush=True)
    if not args.skip_pipeline:
        res["pipeline"] = pipeline_overhead(1 if args.quick else 9, 6 if args.quick else 12)
        print(json.dumps(res["pipeline"], indent=1), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
