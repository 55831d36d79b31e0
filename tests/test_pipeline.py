"""Pipeline parallelism on CPU: schedules as readable tables, their simulation, the stage runner
against one process, and two gloo ranks (spawned, with timeouts) against eager training."""
from __future__ import annotations

import json
import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flowexec.pipeline import (Job, PipelineError, PipelineStage, bubble, chrome_trace, format_schedule, gpipe,
                               one_f_one_b, parse_schedule, simulate, spawn, split_batch)
from flowexec.pipeline.demo import Config, eager_reference, stage_slice, train_worker

pytestmark = pytest.mark.timeout(180)


def test_schedules_as_tables():
    assert format_schedule(gpipe(2, 3)) == (
        "rank 0: 0F0 0F1 0F2 0B0 0B1 0B2\n"
        "rank 1: 1F0 1F1 1F2 1B0 1B1 1B2")
    assert format_schedule(one_f_one_b(3, 4)) == (
        "rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3\n"
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3\n"
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3")
    assert format_schedule(one_f_one_b(3, 1)) == "rank 0: 0F0 0B0\nrank 1: 1F0 1B0\nrank 2: 2F0 2B0"
    for sched in (gpipe(3, 5), one_f_one_b(4, 6)):
        assert parse_schedule(format_schedule(sched)) == sched


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (3, 1), (4, 16)])
def test_simulated_bubble_matches_theory(p, m):
    """On unit jobs both schedules finish in 2(m + p - 1) units with bubble (p - 1) / (m + p - 1)."""
    for make in (gpipe, one_f_one_b):
        sim = simulate(make(p, m))
        assert sim.makespan == 2 * (m + p - 1)
        assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))
    sim = simulate(one_f_one_b(2, 2))
    assert {str(j): (sim.start[j], sim.end[j]) for j in sim.start} == {
        "0F0": (0, 1), "0F1": (1, 2), "0B0": (3, 4), "0B1": (5, 6),
        "1F0": (1, 2), "1B0": (2, 3), "1F1": (3, 4), "1B1": (4, 5)}


def test_bad_schedules_are_named():
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits at 0B0 for 0F0, 1B0; rank 1 waits at 1F0 for 0F0"):
        simulate(parse_schedule("rank 0: 0B0 0F0\nrank 1: 1F0 1B0"))
    with pytest.raises(ValueError, match="runs 0F0 twice"):
        simulate(parse_schedule("rank 0: 0F0 0F0 0B0"))
    with pytest.raises(ValueError, match=r"misses \['0B1'\]"):
        simulate(parse_schedule("rank 0: 0F0 0F1 0B0"))
    with pytest.raises(ValueError, match="stage 0 is on ranks 0 and 1"):
        simulate(parse_schedule("rank 0: 0F0\nrank 1: 0B0"))
    with pytest.raises(ValueError, match="'0X1' is not a job"):
        Job.parse("0X1")
    with pytest.raises(ValueError, match="is not a schedule line"):
        parse_schedule("0F0 0B0")
    with pytest.raises(ValueError, match="n_micro must be a whole number >= 1, got 0"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="no jobs"):
        simulate({})
    with pytest.raises(ValueError, match="backward_cost must be at least 1"):
        simulate(gpipe(2, 2), backward_cost=0)
    with pytest.raises(ValueError, match="rank 0 has job 1F0: each rank runs the stage of its own number"):
        simulate(parse_schedule("rank 0: 1F0 1B0\nrank 1: 0F0 0B0"))
    with pytest.raises(ValueError, match="bad job 0F-1"):
        simulate({0: [Job(0, "F", -1), Job(0, "B", -1)]})


def test_one_stage_accumulates_the_mean_loss_gradient():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    st = PipelineStage(model, 0, 1, loss_fn=F.mse_loss)
    st.setup((2, 6))
    res = st.run(gpipe(1, 4)[0], inputs=split_batch(x, 4), targets=split_batch(y, 4))
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    for a, b in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(res.losses) == 4 and [j[0] for j in res.jobs] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"]


def test_stage_errors():
    lin = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="the last stage needs a loss_fn"):
        PipelineStage(lin, 0, 1)
    with pytest.raises(ValueError, match="stage 3 is not in 0..1"):
        PipelineStage(lin, 3, 2)
    st = PipelineStage(lin, 0, 1, loss_fn=F.mse_loss)
    with pytest.raises(RuntimeError, match="call setup"):
        st.run(gpipe(1, 1)[0], inputs=[torch.ones(1, 2)], targets=[torch.ones(1, 2)])
    st.setup((1, 2))
    with pytest.raises(ValueError, match="needs 2 micro-batch inputs, got 1"):
        st.run(gpipe(1, 2)[0], inputs=[torch.ones(1, 2)], targets=[torch.ones(1, 2)] * 2)
    with pytest.raises(ValueError, match="a batch of 5 does not split into 2"):
        split_batch(torch.ones(5, 2), 2)
    with pytest.raises(ValueError, match=r"micro-batch 1 is torch.float32 \[2, 2\], but setup\(\) was given "
                                         r"torch.float32 \[1, 2\]"):
        st.run(gpipe(1, 2)[0], inputs=[torch.ones(1, 2), torch.ones(2, 2)], targets=[torch.ones(1, 2)] * 2)
    with pytest.raises(ValueError, match="no jobs"):
        st.run([], inputs=[], targets=[])


def test_the_shape_probe_leaves_no_trace():
    """setup() runs the module once to learn its output shape: running statistics and the random
    stream stay as they were."""
    bn = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    st = PipelineStage(bn, 0, 2)  # a first stage: not the last, so it probes
    st.in_spec = ((3, 4), torch.float32)
    before = [b.clone() for b in bn.buffers()]
    torch.manual_seed(5)
    out = st._probe()
    assert out.shape == (3, 4)
    assert all(torch.equal(a, b) for a, b in zip(before, bn.buffers()))
    after_probe = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_probe, torch.rand(3))


SMALL = Config(width=32, blocks=4, batch=16, n_micro=4, steps=3, lr=0.1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_gloo_ranks_train_as_one_process(schedule):
    cfg = Config(**{**asdict(SMALL), "schedule": schedule})
    res = spawn(train_worker, 2, asdict(cfg), timeout=60)
    losses, params = eager_reference(cfg)
    assert res[1]["losses"] == pytest.approx(losses, rel=1e-5) and res[0]["losses"] == []
    per_block = [params[2 * b:2 * b + 2] for b in range(cfg.blocks)]  # weight, bias per block
    for rank in range(2):
        want = [t for b in stage_slice(cfg, rank, 2) for t in per_block[b]]
        assert len(res[rank]["params"]) == len(want)
        for a, b in zip(res[rank]["params"], want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    jobs = {r: res[r]["jobs"] for r in range(2)}
    assert [j[0] for j in jobs[1][0]] == [str(j) for j in (gpipe if schedule == "gpipe" else one_f_one_b)(2, 4)[1]]
    trace = chrome_trace(jobs)
    json.dumps(trace)  # the format is plain JSON
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    assert len(spans) == 2 * cfg.steps * 2 * cfg.n_micro and min(e["ts"] for e in spans) == 0
    assert {e["pid"] for e in spans} == {1, 2} and all(e["dur"] >= 0 for e in spans)  # pid = rank + 1
    assert all(0 <= b < 1 for b in bubble(jobs).values())


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    x = torch.zeros(1)
    dist.recv(x, 1)  # never sent: the failure above, not this wait, must end the run
    return rank


def _never_sends(rank: int, world: int) -> int:
    if rank == 0:
        dist.recv(torch.zeros(1), 1)
    return rank


def test_a_failing_rank_reaches_the_caller():
    with pytest.raises(PipelineError, match="rank 1 failed: ValueError: bad batch on rank 1"):
        spawn(_fails_on_rank_1, 2, timeout=30)


def test_a_receive_that_never_comes_times_out():
    with pytest.raises(PipelineError, match="rank 0 failed"):
        spawn(_never_sends, 2, timeout=5)


def test_three_ranks_with_a_middle_stage_train_as_one_process():
    cfg = Config(**{**asdict(SMALL), "blocks": 3, "schedule": "1f1b", "steps": 2})
    res = spawn(train_worker, 3, asdict(cfg), timeout=60)
    losses, params = eager_reference(cfg)
    assert res[2]["losses"] == pytest.approx(losses, rel=1e-5)
    got = [t for r in range(3) for t in res[r]["params"]]
    for a, b in zip(got, params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_cli_trains_and_saves_the_timeline(tmp_path, capsys):
    from flowexec.cli import main

    out = tmp_path / "jobs.json"
    assert main(["pipeline", "--schedule", "gpipe", "--micro", "2", "--steps", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step 1: loss" in text and "bubble" in text and "largest relative difference" in text
    names = [e["name"] for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X" and e["tid"] == 1]
    assert names[:4] == ["0F0", "0F1", "0B0", "0B1"] and len(names) == 2 * 2 * 4


def test_stages_through_the_flowexec_backend_train_as_one_process():
    cfg = Config(**{**asdict(SMALL), "schedule": "1f1b", "steps": 2, "backend": "flowexec"})
    res = spawn(train_worker, 2, asdict(cfg), timeout=120)
    losses, params = eager_reference(cfg)
    assert res[1]["losses"] == pytest.approx(losses, rel=1e-5)
    for a, b in zip(res[0]["params"] + res[1]["params"], params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _EveryOther(torch.nn.Module):
    """No parameters, and a non-contiguous output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)[:, ::2]


class _Ignores(torch.nn.Module):
    """A last stage whose output does not depend on its input."""

    def __init__(self) -> None:
        super().__init__()
        self.b = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b.expand(x.shape[0], 4) * 2


def _unusual_stages(rank: int, world: int, last: str) -> dict:
    torch.manual_seed(0)
    mods = [_EveryOther(), torch.nn.Linear(4, 4) if last == "linear" else _Ignores()]
    st = PipelineStage(mods[rank], rank, 2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    st.setup((2, 8))
    st.run(one_f_one_b(2, 2)[rank], inputs=split_batch(x, 2) if rank == 0 else None,
           targets=split_batch(y, 2) if rank == 1 else None)
    return {"grads": [p.grad.clone() for p in mods[rank].parameters()]}


@pytest.mark.parametrize("last", ["linear", "ignores its input"])
def test_stages_without_parameters_or_input_gradients(last):
    res = spawn(_unusual_stages, 2, last, timeout=60)
    torch.manual_seed(0)
    mods = [_EveryOther(), torch.nn.Linear(4, 4) if last == "linear" else _Ignores()]
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    F.mse_loss(mods[1](mods[0](x)), y).backward()
    assert res[0]["grads"] == []
    for a, b in zip(res[1]["grads"], [p.grad for p in mods[1].parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _exits_quietly(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(0)
    return rank


def test_a_rank_that_ends_without_a_result_is_named_at_once():
    import time

    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"ended without a result: rank 1 \(exit code 0\)"):
        spawn(_exits_quietly, 2, timeout=60)
    assert time.monotonic() - t0 < 30  # not the 120 s deadline


def test_a_failed_set_up_reaches_the_caller():
    with pytest.raises(PipelineError, match="rank [01] failed: .*nccl|rank [01] failed: .*NCCL"):
        spawn(_fails_on_rank_1, 2, backend="nccl", timeout=20)


def test_cli_refuses_an_unwritable_trace_path_before_training(capsys):
    from flowexec.cli import main

    assert main(["pipeline", "--steps", "1", "--out", "/nonexistent/dir/x.json"]) == 2
    err = capsys.readouterr().err
    assert "flowexec pipeline:" in err and "No such file or directory" in err
