"""Probe: where a JobTimer span's cost goes on CUDA (the breakdown behind profiler_overhead.py's
job-timer row), each piece timed alone in a tight loop, then the MLP trace step's loop with the
timer's pieces switched on one by one.

    PYTHONPATH=. python3 benchmarks/timer_probe.py --out DIR     # DIR/timer_probe.json

Micro rows (µs per call, median of 5 rounds of ``n`` calls): perf_counter_ns; the driver's
cuEventRecord through ctypes (idle stream, and behind a queued 2 ms sleep kernel); the same
through torch.cuda.Event.record; cuEventElapsedTime; the raw current stream lookup;
JobTimer begin+end with no work; flush with nothing ready; finish of 50 spans.
Loop rows (µs per step, 50 steps back to back; the host's time to issue them and the device's
time between an event before the first and after the last): off; events only (two bare driver
records per step; the same with events that keep no timestamp); begin/end (no flush); begin/end/flush; and the whole timer with finish; plus one step with
a synchronisation after it (``plain``) to compare back-to-back against synchronised steps.
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
from flowexec.profiler.timers import FLUSH_BATCH, DriverEvents, JobTimer  # noqa: E402


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
    tev = torch.cuda.Event(enable_timing=True)
    ev = DriverEvents(dev).event()
    n = 5000
    out: dict[str, float] = {}
    out["perf_counter_ns"] = per_call(time.perf_counter_ns, n)
    out["raw_stream_lookup"] = per_call(lambda: raw(0), n)
    out["cuEventRecord_ctypes_idle"] = per_call(lambda: rec(h, s), n)
    # Behind queued work: a long sleep kernel first, so every record lands on a busy stream.
    out["cuEventRecord_ctypes_busy"] = per_call(lambda: rec(h, s), 500, before=lambda: torch.cuda._sleep(2_000_000))
    out["driver_event_record_idle"] = per_call(ev.record, n)
    out["torch_event_record_idle"] = per_call(tev.record, n)
    out["torch_event_record_busy"] = per_call(tev.record, 500, before=lambda: torch.cuda._sleep(2_000_000))
    rec(h, s)
    rec(h2, s)
    torch.cuda.synchronize()
    out["cuEventElapsedTime_ctypes"] = per_call(lambda: d.cuEventElapsedTime(ref, h, h2), n)
    out["cuEventQuery_ctypes"] = per_call(lambda: d.cuEventQuery(h2), n)
    timer = JobTimer(dev, batch=FLUSH_BATCH)
    tok = timer.begin(step=0, stage=0, kind="F", micro=0)  # anchor outside the loop
    timer.end(tok)
    timer.finish()

    def be() -> None:
        t = timer.begin(step=0, stage=0, kind="F", micro=0)
        timer.end(t)
    timer.begin(step=0, stage=0, kind="F", micro=0)  # the run's anchor, outside the timed loop
    def bef() -> None:
        be()
        timer.flush()
    for _ in range(200):
        bef()
    out["timer_begin_end_flush_steady"] = per_call(bef, 2000, rounds=3)  # events come back from the pool
    out["timer_flush_nothing_ready"] = per_call(timer.flush, 2000, rounds=3)
    timer.finish()

    def finish50() -> None:
        for k in range(50):
            be()
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        timer.finish()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    times: list[float] = []
    for _ in range(5):
        finish50()
    out["timer_finish_50_spans_us"] = statistics.median(times)
    cn.driver().cuEventDestroy_v2(h)
    cn.driver().cuEventDestroy_v2(h2)
    return out


def loops(dev: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_mlp(256, 3).to(dev)
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.01), F.cross_entropy)
    x, y = torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
    exe = flowexec.compile(step, x, y, mode="trace")
    timer = JobTimer(dev, batch=FLUSH_BATCH)
    dev_events = DriverEvents(dev)
    ea, eb = dev_events.event(), dev_events.event()
    na, nb = cn.event_create(), cn.event_create()  # no timing: does a timestamp cost the device?
    rec, raw = cn.driver().cuEventRecord, torch._C._cuda_getCurrentRawStream
    g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 50

    def loop(kind: str) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        if kind == "plain":  # synchronised after every step
            for _ in range(n):
                exe(x, y)
                torch.cuda.synchronize()
            issue_us[kind].append(float("nan"))
            return (time.perf_counter_ns() - t0) / 1e3 / n
        g0.record()
        if kind in ("begin_end", "begin_end_flush"):
            timer.begin(step=0, stage=0, kind="F", micro=0)  # anchored before the timed steps
        for k in range(n):
            if kind == "off":
                exe(x, y)
            elif kind == "events_only":
                ea.record()
                exe(x, y)
                eb.record()
            elif kind == "events_only_no_timing":
                rec(na, raw(0))
                exe(x, y)
                rec(nb, raw(0))
            elif kind == "begin_end":
                tok = timer.begin(step=k, stage=0, kind="F", micro=0)
                exe(x, y)
                timer.end(tok)
            else:
                tok = timer.begin(step=k, stage=0, kind="F", micro=0)
                exe(x, y)
                timer.end(tok)
                timer.flush()
        t_loop = time.perf_counter_ns()
        g1.record()
        if kind == "full":
            timer.finish()
        torch.cuda.synchronize()
        t1 = time.perf_counter_ns()
        device_us[kind].append(g0.elapsed_time(g1) * 1e3 / n)
        if kind in ("begin_end", "begin_end_flush"):
            timer.finish()  # outside the timed part: these rows are the per-step pieces
        issue_us[kind].append((t_loop - t0) / 1e3 / n)
        return (t1 - t0) / 1e3 / n

    kinds = ("off", "plain", "events_only", "events_only_no_timing", "begin_end", "begin_end_flush", "full")
    issue_us: dict[str, list[float]] = {k: [] for k in kinds}
    device_us: dict[str, list[float]] = {k: [] for k in kinds if k != "plain"}
    for k in kinds:
        loop(k)
    for k in kinds:
        issue_us[k].clear()
        device_us.get(k, []).clear()
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
