"""flowexec.profile: per-instruction host times of trace-mode runs, the table and the Chrome trace."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.cli import main
from flowexec.models import make_mlp, make_step

from helpers import assert_same_state


def mlp_twins():
    torch.manual_seed(0)
    m1 = make_mlp(32, 2)
    m2 = copy.deepcopy(m1)
    s1 = make_step(m1, torch.optim.SGD(m1.parameters(), lr=0.1), F.cross_entropy)
    s2 = make_step(m2, torch.optim.SGD(m2.parameters(), lr=0.1), F.cross_entropy)
    return m1, m2, s1, s2, (torch.randn(8, 32), torch.randint(0, 10, (8,)))


def test_profile_times_every_instruction_of_every_run_and_steps_like_a_call():
    m1, m2, s1, s2, (x, y) = mlp_twins()
    tl = flowexec.profile(s2, x, y, runs=4, warmup=2)
    n = len(tl.plan.instructions)
    assert len(tl.records) == 4 * n and len(tl.run_us) == 4
    assert [r.index for r in tl.records[:n]] == list(range(n))
    assert all(r.dur_us >= 0 for r in tl.records)
    for run in range(4):  # back to back within a run, and inside the call as the caller timed it
        rs = [r for r in tl.records if r.run == run]
        assert all(abs(a.start_us + a.dur_us - b.start_us) < 1e-6 for a, b in zip(rs, rs[1:]))
        assert sum(r.dur_us for r in rs) <= tl.run_us[run]
    for _ in range(6):  # warmup + runs steps were taken, as six calls would
        s1(x, y)
    assert_same_state(m1, m2)


def test_table_lists_the_costliest_instructions_with_their_shares():
    _, _, _, s2, (x, y) = mlp_twins()
    tl = flowexec.profile(s2, x, y, runs=3)
    top = tl.top(5)
    assert len(top) == 5 and [t[3] for t in top] == sorted((t[3] for t in top), reverse=True)
    mean = tl.per_run_us()
    assert abs(sum(mean) - sum(r.dur_us for r in tl.records) / 3) < 1e-6
    assert all(abs(share - us / sum(mean)) < 1e-9 for _, _, _, us, share in top)
    lines = tl.table(top=5).splitlines()
    assert lines[0] == "| # | op | source | µs per run | share |" and len(lines) == 2 + 5 + 2
    assert lines[-1].startswith(f"{len(tl.plan.instructions)} instructions, ")


def test_chrome_trace_has_a_slice_per_instruction_and_run_on_its_stream_lane(tmp_path):
    _, _, _, s2, (x, y) = mlp_twins()
    tl = flowexec.profile(s2, x, y, runs=2)
    path = tl.save(str(tmp_path / "trace.json"))
    events = json.load(open(path))["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == 2 * len(tl.plan.instructions)
    for e in slices:
        assert set(e) >= {"name", "ph", "pid", "tid", "ts", "dur", "args"} and e["dur"] >= 0 and e["tid"] == 0
        assert e["args"]["op"].startswith(("v", "_")) or "=" in e["args"]["op"]
    assert [e["ts"] for e in slices] == sorted(e["ts"] for e in slices)
    assert {e["name"] for e in events if e["ph"] == "i"} == {"run 0", "run 1"}
    assert {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"} == {"caller's stream"}


def test_profile_names_a_failing_op_and_refuses_graph_mode_and_bad_counts():
    def f(x, idx):
        return x.sin()[idx]

    exe = flowexec.compile(f, torch.randn(4), torch.tensor([1]))
    runner = exe._last.runner
    with pytest.raises(flowexec.ExecutionError, match=r"aten\.index"):
        flowexec.profile(exe, torch.randn(4), torch.tensor([7]), runs=1, warmup=0)
    assert exe._last.runner is runner  # its own runner is back
    with pytest.raises(flowexec.OptionError, match="runs >= 1"):
        flowexec.profile(f, torch.randn(4), torch.tensor([1]), runs=0)
    exe = flowexec.compile(lambda x: x + 1, torch.randn(2))
    exe.mode = "graph"  # as a graph-mode executable would say
    with pytest.raises(flowexec.OptionError, match="one CUDA graph replay"):
        flowexec.profile(exe, torch.randn(2))


def test_profile_command_writes_a_trace(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["profile", "--runs", "2", "--top", "3", "--out", str(out), "--device", "cpu"]) == 0
    assert "instructions" in capsys.readouterr().out
    assert any(e["ph"] == "X" for e in json.load(open(out))["traceEvents"])
