"""Probe: where a JobTimer span's cost goes on CUDA (the breakdown behind profiler_overhead.py's
job-timer row), each piece timed alone in a tight loop, then the MLP trace step's loop with the
timer's pieces switched on one by one.

    PYTHONPATH=. python3 benchmarks/timer_probe.py --out DIR     # DIR/timer_probe.json

Micro rows (µs per call, median of 5 rounds of ``n`` calls): perf_counter_ns; the driver's
cuEventRecord through ctypes (idle stream, and behind a queued 2 ms sleep kernel),
cuEventElapsedTime, cuEventQuery; then for each kind of timer events (native: the C++ event
clock; ctypes: the driver through ctypes; torch: torch.cuda.Event) a record, a read, a JobTimer
begin+end+flush in the steady state (events back from the pool), finish of 50 spans.
Loop rows (µs per step, 50 steps back to back, finish counted; the host's time to issue them
and the device's time from an event before the first step to one after the last): off; two
bare driver records per step; the job timer on each kind of events.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from host_meta import host_meta  # noqa: E402

import flowexec  # noqa: E402
from flowexec import _cuda_native as cn  # noqa: E402
from flowexec.models import make_mlp, make_step  # noqa: E402
from flowexec.profiler.timers import FLUSH_BATCH, CudaEvents, DriverEvents, JobTimer, NativeEvents  # noqa: E402


def per_call(fn: Callable[[], Any], n: int, rounds: int = 5, before: Callable[[], Any] | None = None) -> float:
    out = []
    for _ in range(rounds):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out.append((time.perf_counter_ns() - t0) / 1e3 / n)
        torch.cuda.synchronize()
    return statistics.median(out)


def _sources(dev: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        out["native"] = NativeEvents(dev)
    except RuntimeError as e:
        print(f"native event clock: {e}", flush=True)
    out["ctypes"] = DriverEvents(dev)
    out["torch"] = CudaEvents(dev)
    return out


def micro(dev: torch.device) -> dict[str, float]:
    d = cn.driver()
    cn.ensure_context(dev.index or 0)
    raw = torch._C._cuda_getCurrentRawStream
    s = raw(dev.index or 0)
    h = cn.timing_event_create()
    h2 = cn.timing_event_create()
    ms = ctypes.c_float()
    ref = ctypes.byref(ms)
    rec = d.cuEventRecord
    n = 5000
    out: dict[str, float] = {}
    out["perf_counter_ns"] = per_call(time.perf_counter_ns, n)
    out["raw_stream_lookup"] = per_call(lambda: raw(0), n)
    out["cuEventRecord_ctypes_idle"] = per_call(lambda: rec(h, s), n)
    # Behind queued work: a long sleep kernel first, so every record lands on a busy stream.
    out["cuEventRecord_ctypes_busy"] = per_call(lambda: rec(h, s), 500, before=lambda: torch.cuda._sleep(2_000_000))
    rec(h, s)
    rec(h2, s)
    torch.cuda.synchronize()
    out["cuEventElapsedTime_ctypes"] = per_call(lambda: d.cuEventElapsedTime(ref, h, h2), n)
    out["cuEventQuery_ctypes"] = per_call(lambda: d.cuEventQuery(h2), n)
    for name, src in _sources(dev).items():
        def rec_release() -> None:
            src.release([src.record()])
        out[f"{name}_record_release"] = per_call(rec_release, n)
        a, b = src.record(), src.record()
        torch.cuda.synchronize()
        out[f"{name}_offsets_ns_per_event"] = per_call(lambda: src.offsets_ns(a, [b] * 50), 200) / 50
        timer = JobTimer(dev, batch=FLUSH_BATCH, events=src)

        def bef() -> None:
            t = timer.begin(step=0, stage=0, kind="F", micro=0)
            timer.end(t)
            timer.flush()
        for _ in range(200):
            bef()
        out[f"{name}_timer_begin_end_flush"] = per_call(bef, 2000, rounds=3)  # incl. reading every 64th
        timer.finish()
        times: list[float] = []
        for _ in range(5):
            for _ in range(50):
                t = timer.begin(step=0, stage=0, kind="F", micro=0)
                timer.end(t)
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            timer.finish()
            times.append((time.perf_counter_ns() - t0) / 1e3)
        out[f"{name}_timer_finish_50_spans_us"] = statistics.median(times)
    cn.driver().cuEventDestroy_v2(h)
    cn.driver().cuEventDestroy_v2(h2)
    return out


def loops(dev: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_mlp(256, 3).to(dev)
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.01), F.cross_entropy)
    x, y = torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
    exe = flowexec.compile(step, x, y, mode="trace")
    timers = {name: JobTimer(dev, batch=FLUSH_BATCH, events=src) for name, src in _sources(dev).items()}
    na, nb = cn.timing_event_create(), cn.timing_event_create()
    rec, raw = cn.driver().cuEventRecord, torch._C._cuda_getCurrentRawStream
    g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 50

    def loop(kind: str) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        g0.record()
        timer = timers.get(kind)
        for k in range(n):
            if kind == "off":
                exe(x, y)
            elif kind == "events_only":  # two bare driver records (ctypes) a step: the floor
                rec(na, raw(0))
                exe(x, y)
                rec(nb, raw(0))
            else:
                tok = timer.begin(step=k, stage=0, kind="F", micro=0)
                exe(x, y)
                timer.end(tok)
                timer.flush()
        t_loop = time.perf_counter_ns()
        g1.record()
        if timer is not None:
            timer.finish()
        torch.cuda.synchronize()
        t1 = time.perf_counter_ns()
        device_us[kind].append(g0.elapsed_time(g1) * 1e3 / n)
        issue_us[kind].append((t_loop - t0) / 1e3 / n)
        return (t1 - t0) / 1e3 / n

    kinds = ("off", "events_only", *timers)
    issue_us: dict[str, list[float]] = {k: [] for k in kinds}
    device_us: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:
        loop(k)
        issue_us[k].clear()
        device_us[k].clear()
    res: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(15):
        for k in kinds:
            res[k].append(loop(k))
    out: dict[str, Any] = {"steps_per_loop": n, "us_per_step": {k: statistics.median(v) for k, v in res.items()},
                           "issue_us_per_step": {k: statistics.median(v) for k, v in issue_us.items()},
                           "device_us_per_step": {k: statistics.median(v) for k, v in device_us.items()},
                           "rounds": res}
    off = out["us_per_step"]["off"]
    out["overhead_vs_off"] = {k: v / off - 1 for k, v in out["us_per_step"].items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    res: dict[str, Any] = {**host_meta(" ".join(sys.argv)), "gpu": torch.cuda.get_device_name(dev)}
    res["micro_us"] = micro(dev)
    print(json.dumps(res["micro_us"], indent=1), flush=True)
    res["mlp_loop"] = loops(dev)
    print(json.dumps({k: v for k, v in res["mlp_loop"].items() if k != "rounds"}, indent=1), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "timer_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
