"""The timeline of a real run: two gloo ranks train a small pipeline with profiling on; each
measures its clock offset to rank 0 by ping-pong and writes its records; the merge, trace and
page follow (what `flowexec demo --out` does)."""
from __future__ import annotations

import json

import pytest

from flowexec.profiler.clocks import choose_offset
from flowexec.profiler.io import read_records
from flowexec.pipeline.demo import profile_pipeline


def test_choose_offset_keeps_the_lowest_round_trip():
    # rank 0's clock is 1000 ahead; the second sample's legs were quick and even
    samples = [(0, 1_700, 400), (1_000, 2_010, 1_020), (2_000, 3_300, 2_900)]
    assert choose_offset(samples) == (1_000, 20)
    with pytest.raises(ValueError, match="at least one"):
        choose_offset([])


@pytest.mark.timeout(400)
def test_profiled_two_rank_pipeline_records_every_job_and_merges(tmp_path):
    (run,) = profile_pipeline(str(tmp_path), ("1f1b",), steps=3, record=(1, 2), n_micro=2)
    (h0, s0), (h1, s1) = (read_records(f"{run['records']}/rank{r}.jsonl") for r in (0, 1))
    assert (h0.rank, h1.rank) == (0, 1) and h0.meta["schedule"] == "1f1b" and h0.meta["n_micro"] == 2
    # the ping-pong ran; on one machine the clocks are one, so the estimate is within a round trip
    # of zero and is not applied
    assert h1.clock_rtt_ns > 0 and abs(h1.clock_offset_measured_ns) <= h1.clock_rtt_ns
    assert h1.clock_offset_ns == 0 and h0.clock_offset_ns == 0
    for r, spans in ((0, s0), (1, s1)):
        jobs = sorted((s.step, s.kind, s.micro) for s in spans if s.kind in ("F", "B", "OPT"))
        assert jobs == sorted([(k, kind, m) for k in (1, 2) for kind in "FB" for m in (0, 1)]
                              + [(1, "OPT", None), (2, "OPT", None)]), (r, jobs)
        assert all(s.start_ns <= s.end_ns and s.clock == "host" for s in spans)
        # every message of a step: sent by one rank, received by the other (1F1B, 2 micro-batches)
        for kind in ("send", "recv"):
            assert sorted((s.step, s.micro) for s in spans if s.kind == kind) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    trace = json.load(open(run["trace"]))
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"F mb0", "B mb1", "OPT", "step 1", "step 2", "send mb0", "recv mb1"} <= names
    flows = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    assert len(flows) == 2 * 8 and {e["pid"] for e in flows} == {1, 2}  # 4 messages a step, 2 steps
    assert [r["rank"] for r in run["summary"]] == [0, 1] and all(0 < r["busy"] <= 1 for r in run["summary"])
    assert run["theory_bubble"] == pytest.approx(1 / 3)  # (p - 1) / (m + p - 1) for 1F1B, p = m = 2
    assert "timeline-data" in open(run["page"]).read()


def _context_worker(rank: int, world: int, directory: str) -> list[int]:
    import torch
    import torch.nn.functional as F

    from flowexec.pipeline import PipelineTrainer

    torch.manual_seed(0)
    stages = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    trainer = PipelineTrainer(stages, schedule="1F1B", microbatches=2, loss_fn=F.mse_loss, compile=False)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    trainer.step(x, y)
    with trainer.profiling(directory):
        trainer.step(x, y)
        trainer.step(x, y)
    trainer.step(x, y)
    return trainer.step_count


@pytest.mark.timeout(400)
def test_trainer_profiling_context_records_the_steps_inside_it(tmp_path, ranks):
    from flowexec.profiler.merge import merge_dir

    assert ranks(2).run(_context_worker, str(tmp_path), timeout=120) == [4, 4]
    merged = merge_dir(str(tmp_path))
    assert {s.step for s in merged.spans} == {1, 2}
    assert merged.meta()["schedule"] == "1F1B" and merged.meta()["theory_bubble"] == pytest.approx(1 / 3)
    assert sorted((s.rank, s.step) for s in merged.spans if s.kind == "step") == [(0, 1), (0, 2), (1, 1), (1, 2)]
