"""Instruction-level profiles through the timeline's records and exporters: host times on the
CPU, device lanes per stream and event flows (a multi-stream plan with synthetic device times:
the CUDA path itself is tests/gpu/test_profiler_gpu.py), and the device-start rule."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import flowexec
from flowexec.capture import capture
from flowexec.models import make_mlp, make_step
from flowexec.plan import build_plan
from flowexec.profiler.instructions import OpTime, Timeline, _event_edges, device_starts
from flowexec.profiler.page import page_data
from flowexec.profiler.trace import trace_events


def three_branches(x):
    return x.sin() * 2 + x.cos() * 3 + x.exp()


def test_cpu_profile_exports_as_spans_through_the_trace_and_page():
    torch.manual_seed(0)
    model = make_mlp(32, 2)
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    tl = flowexec.profile(step, torch.randn(8, 32), torch.randint(0, 10, (8,)), runs=2)
    assert tl.device == ()  # no device times on the CPU: host time is device time
    spans = tl.spans()
    n = len(tl.plan.instructions)
    assert len(spans) == 2 * n and {s.stream for s in spans} == {"host"} and {s.step for s in spans} == {0, 1}
    assert [s.name for s in spans[:n]] == [i.op.name for i in tl.plan.instructions]
    ev = trace_events(spans)["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X" and e["cat"] == "op"]
    assert len(xs) == 2 * n and all(e["cname"] == "generic_work" for e in xs)
    assert {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"} == {"steps", "stream host"}
    data = page_data(spans)
    assert data["ranks"][0]["rows"] == ["stream host"] and len(data["spans"]) == 2 * n


def test_multi_stream_profile_has_a_device_lane_per_stream_and_a_flow_per_event_wait():
    plan = build_plan(capture(three_branches, (torch.randn(4),)).program, streams=3)
    edges = _event_edges(plan)
    assert len(edges) == sum(len(i.waits) for i in plan.instructions) > 0
    n = len(plan.instructions)
    host = tuple(OpTime(i, r, 100.0 * r + i, 1.0) for r in range(2) for i in range(n))
    dev = tuple(OpTime(i, r, 100.0 * r + i + 0.5, 2.0) for r in range(2) for i in range(n))
    tl = Timeline(plan, host, (50.0, 50.0), dev)
    ev = tl.chrome_trace()["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name" and e["tid"] >= 100}
    assert sorted(lanes) == [100, 101, 102]
    by_stream = {}
    for e in ev:
        if e["ph"] == "X" and e["cat"] == "device":
            by_stream.setdefault(e["tid"], set()).add(plan.instructions[e["args"]["instruction"]].stream)
    assert by_stream == {100 + s: {s} for s in range(3)}
    flows = [e for e in ev if e["ph"] in "sf"]
    ids = {}
    for e in flows:
        ids.setdefault(e["id"], []).append(e["ph"])
    assert len(ids) == 2 * len(edges) and all(sorted(v) == ["f", "s"] for v in ids.values())
    # the same through the shared records: a row per device stream, flows as span pairs
    spans = tl.spans()
    assert {s.stream for s in spans} == {"host", "cuda s0", "cuda s1", "cuda s2"}
    pairs = tl.flows()
    assert len(pairs) == 2 * len(edges)
    for a, b in pairs:
        assert a.clock == b.clock == "cuda" and a.stream != b.stream and a.step == b.step
    ev = trace_events(spans, flows=pairs)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    arrows = [e for e in ev if e["ph"] in "sf"]
    assert len(arrows) == 2 * len(pairs)
    assert all(rows[e["tid"]].startswith(("stream cuda s0", "stream cuda s1", "stream cuda s2")) for e in arrows)


def test_device_start_follows_stream_order_event_waits_and_issue_time():
    plan = build_plan(capture(three_branches, (torch.randn(4),)).program, streams=3)
    # the plan: 0 sin s0, 1 mul s0, 2 cos s1, 3 mul s1 records e0, 4 add s0 waits e0, 5 exp s2 records e1,
    # 6 add s0 waits e1
    assert [(i.stream, i.waits, i.records) for i in plan.instructions] == [
        (0, (), ()), (0, (), ()), (1, (), ()), (1, (), (0,)), (0, (0,), ()), (2, (), (1,)), (0, (1,), ())]
    issue = [0, 15, 2, 3, 4, 5, 6]  # instruction 1 was launched late, at 15
    end = [10, 20, 50, 60, 70, 90, 100]
    assert device_starts(plan, issue, end, entry_ns=0) == [
        0,   # first on s0: the run's entry
        15,  # after 0 (10) on s0, but not before its launch
        2,   # first on s1: its launch
        50,  # after 2 on s1
        60,  # after 1 on s0 (20), and after e0, recorded when 3 ended (60)
        5,   # first on s2
        90,  # after 4 on s0 (70), and e1, recorded when 5 ended (90)
    ]
