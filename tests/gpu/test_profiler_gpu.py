"""The profilers on CUDA: job timers anchored to the host clock, per-instruction device times in
trace mode (a lane per stream, event flows), graph-mode replays with kernels."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.models import make_mlp, make_step
from flowexec.profiler import JobTimer
from flowexec.profiler.instructions import profile_graph
from flowexec.profiler.trace import trace_events

pytestmark = pytest.mark.gpu


def test_job_timer_reads_device_times_anchored_to_the_host_clock():
    dev = torch.device("cuda")
    x = torch.randn(2048, 2048, device=dev)
    t = JobTimer(dev, rank=0, host="h")
    torch.cuda.synchronize()
    before = time.perf_counter_ns()
    tok = t.begin(step=0, stage=0, kind="F", micro=0)
    for _ in range(20):
        x = (x @ x).tanh()
    t.end(tok)
    issued_done = time.perf_counter_ns()
    got = t.flush()  # never waits: the matmuls are most likely still running
    (s,) = got + t.finish()
    after = time.perf_counter_ns()
    assert s.clock == "cuda" and before <= s.issue_ns <= s.start_ns + 50_000
    # the matmuls run after they were queued and end before finish returned; they take longer
    # on the device than issuing them did on the host
    assert s.start_ns <= s.end_ns <= after and s.end_ns > issued_done - 50_000
    assert s.duration_ns > 0


def test_driver_events_time_what_torch_events_time():
    from flowexec.profiler.timers import CudaEvents, DriverEvents, NativeEvents
    from flowexec.runtime import fastcall

    dev = torch.device("cuda")
    want = NativeEvents if fastcall.load() is not None else DriverEvents
    assert type(JobTimer(dev)._events) is want  # the default: native where built, else ctypes
    x = torch.randn(2048, 2048, device=dev)
    durations = {}
    sources = {"driver": DriverEvents(dev), "torch": CudaEvents(dev)}
    if fastcall.load() is not None:
        sources["native"] = NativeEvents(dev)
    for name, src in sources.items():
        torch.cuda.synchronize()
        a = src.record()
        for _ in range(20):
            x = (x @ x).tanh()
        b = src.record()
        src.done(b)  # done or not yet: either way it answers without raising
        torch.cuda.synchronize()
        assert src.done(a) and src.done(b)
        durations[name] = src.offsets_ns(a, [b])[0] / 1e6
        src.release([a, b])
    for name in sources:
        assert durations[name] > 0 and 0.5 < durations[name] / durations["torch"] < 2.0, durations
    # on a side stream too: the event lands on the current stream
    s = torch.cuda.Stream()
    t = JobTimer(dev, batch=4)
    spans = []
    with torch.cuda.stream(s):
        for k in range(6):
            tok = t.begin(step=k, stage=0, kind="F", micro=0)
            x = (x @ x).tanh()
            t.end(tok)
            spans += t.flush()
    spans += t.finish()
    assert [sp.step for sp in spans] == list(range(6)) and all(sp.duration_ns > 0 for sp in spans)


def _mlp_step():
    torch.manual_seed(0)
    model = make_mlp(256, 3).cuda()
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    return step, torch.randn(64, 256, device="cuda"), torch.randint(0, 10, (64,), device="cuda")


def test_trace_mode_profile_has_device_times_per_instruction_and_stream():
    step, x, y = _mlp_step()
    tl = flowexec.profile(step, x, y, runs=3, streams=2)
    n = len(tl.plan.instructions)
    assert len(tl.device) == 3 * n
    for r in tl.device:
        assert r.dur_us >= 0
    for run in range(3):  # on each stream, instructions end in order
        for s in range(tl.plan.n_streams):
            ends = [r.start_us + r.dur_us for r in tl.device if r.run == run and tl.plan.instructions[r.index].stream == s]
            assert ends == sorted(ends)
    ev = tl.chrome_trace()["traceEvents"]
    assert any(e["ph"] == "X" and e["cat"] == "device" for e in ev)
    spans = tl.spans()
    t = trace_events(spans, flows=tl.flows())["traceEvents"]
    assert {s.stream for s in spans} >= {"host", "cuda s0"}
    assert len([e for e in t if e["ph"] == "s"]) == len(tl.flows())


def test_graph_mode_profile_is_one_slice_per_replay_with_kernels():
    step, x, y = _mlp_step()
    exe = flowexec.compile(step, x, y, mode="graph")
    gp = profile_graph(exe, x, y, runs=3, kernels=True)
    replays = [s for s in gp.spans if s.stream == "replay"]
    assert len(replays) == 3 and all(s.clock == "cuda" and s.duration_ns > 0 for s in replays)
    kernels = [s for s in gp.spans if s.stream == "kernels"]
    assert kernels and all(s.name for s in kernels)


def test_job_timer_steady_state_reuses_events_and_loses_no_span():
    dev = torch.device("cuda")
    x = torch.randn(1024, 1024, device=dev)
    t = JobTimer(dev, rank=0, host="h")
    got = []
    for k in range(20):
        tok = t.begin(step=k, stage=0, kind="F", micro=0)
        for _ in range(5):
            x = (x @ x).tanh()
        t.end(tok)
        got += t.flush()
    got += t.finish()
    assert [s.step for s in got] == list(range(20))
    assert all(a.end_ns <= b.start_ns + 1_000 for a, b in zip(got, got[1:]))  # one stream: in order
    assert t.drift_ns is not None and abs(t.drift_ns) < 1_000_000
    made = t.events_created
    assert made < 2 * 20 + 2  # events come back to the pool once read
    for k in range(10):  # a second run: every event it needs is in the pool already
        t.end(t.begin(step=k, stage=0, kind="F", micro=0))
        torch.cuda.synchronize()
        assert len(t.flush()) == 1
    assert len(t.finish()) == 0 and t.events_created == made
