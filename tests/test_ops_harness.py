"""benchmarks/ops.py's harness and benchmarks/report.py's pooling, on the host clock (no GPU): the
alternating rounds of wall times, the tables read from committed runs, the pooled statistics."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "ops.py")


@pytest.fixture(scope="module")
def ops():
    spec = importlib.util.spec_from_file_location("flowexec_bench_ops", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_table_reads_a_committed_run(ops):
    """Every case of the committed run gets a GPU row (forward, backward, forward+backward, bytes/s
    against the run's copy bandwidth) and a wall row; the achieved fraction is the JSON's own."""
    import json

    with open(os.path.join(os.path.dirname(_PATH), "results", "ops.json")) as fh:
        run = json.load(fh)
    text = ops.table(run["cases"])
    gpu, wall = text.split("Wall time")
    for name, row in run["cases"].items():
        g = next(line for line in gpu.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in g.strip("|").split("|")]
        assert len(cells) == 8 and cells[1] == row["dtype"]
        assert f"{row['flowexec']['gpu_bwd_us']:.1f} µs" in cells[3]
        assert f"({row['achieved_fraction_of_copy_bw']:.0%} of {run['copy_bandwidth_TBps']:.2f})" in cells[6]
        w = next(line for line in wall.splitlines() if line.startswith(f"| {name} |"))
        t, f = row["torch"]["wall_fwd_bwd_us"], row["flowexec"]["wall_fwd_bwd_us"]
        assert f"({t / f:.2f}×)" in w.split("|")[2]


def _report():
    spec = importlib.util.spec_from_file_location(
        "flowexec_bench_report", os.path.join(os.path.dirname(_PATH), "report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_pooled_report_counts_forward_rounds_and_runs(capsys):
    """report.py --pool's forward table, from two committed runs (one of them twice, so pooling
    is visible): per-round ratios pooled, rounds and runs where flowexec's forward was slower."""
    report = _report()
    run = os.path.join(os.path.dirname(_PATH), "results", "ops_fbadecc_r15_c.json")
    report.pool_lerp([run, run])
    out = capsys.readouterr().out
    table = out[out.index("Forward alone"):].splitlines()
    assert "| case1 | 30 | 1.1452 | 1.1425–1.1598 | 0 | 0 of 2 |" in table
    assert "| case4 | 30 | 1.0324 | 1.0051–1.0333 | 6 | 0 of 2 |" in table


def test_cluster_interval_counts_runs_not_rounds():
    """Two runs that disagree leave the pooled median undecided however many rounds each has;
    the same rounds spread over many runs narrow it."""
    report = _report()
    assert report.cluster_interval([[1.2] * 50, [0.9] * 50], draws=400) == (0.9, 1.2)
    lo, hi = report.cluster_interval([[1.2, 0.9, 1.1]] * 40, draws=400)
    assert 1.0 < lo <= hi <= 1.2


def test_trimmed_mean_drops_both_tails(ops):
    assert ops.trimmed_mean([1.0, 2.0, 2.0, 3.0, 100.0], cut=0.2) == pytest.approx(7 / 3)
    assert ops.trimmed_mean([5.0]) == 5.0  # too few to trim
    # samples on two event ticks: the median picks one, the trimmed mean says how often each came
    ticks = [11.36] * 55 + [11.9] * 45
    assert ops.statistics.median(ticks) == 11.36
    assert ops.trimmed_mean(ticks) == pytest.approx((11.36 * 45 + 11.9 * 35) / 80)  # 10 off each end


def test_interleaved_walls_times_forwards_twice_mirrored(ops):
    """Each round: every implementation's forward + backward once in the round's order, then the
    forwards in that order and mirrored (A B C D D C B A); the next round reverses the order. A
    round's forward figure is the mean of its two medians; trimmed means beside them."""
    case = ops.Case("tiny", (4, 8), (4, 8), (1,), torch.float32)
    seen: list[int] = []
    level = iter(range(10**6))

    def sampler(fn):
        seen.append(id(fn))
        fn()
        lv = 2.0 if next(level) % 2 == 0 else 4.0  # calls alternate between two levels
        return [1.0] + [lv] * 6 + [lv + 1] * 2 + [100.0]  # a stall at each end, trimmed

    row: dict = {}
    got = ops.interleaved_walls(case, "cpu", row, rounds=2, sampler=sampler)
    n = len(ops.WALL_IMPLS)
    assert len(seen) == 2 * 3 * n
    r0, r1 = seen[:3 * n], seen[3 * n:]
    fb0, fw0 = r0[:n], r0[n:]
    assert fw0[n:] == fw0[:n][::-1] and set(fw0).isdisjoint(fb0)
    assert r1[:n] == fb0[::-1] and r1[n:2 * n] == fw0[:n][::-1]
    for impl in ops.WALL_IMPLS:
        assert got[f"{impl}:wall_fwd_us"] == [3.0, 3.0]  # one draw at each level, whatever the place
        assert sorted(got[f"{impl}:wall_fwd_a_us"] + got[f"{impl}:wall_fwd_b_us"]) == [2.0, 2.0, 4.0, 4.0]
        assert got[f"{impl}:wall_fwd_tmean_us"] == [pytest.approx(3.25)] * 2
        assert len(got[f"{impl}:wall_fwd_bwd_us"]) == 2 and row[impl]["wall_fwd_us"] == 3.0
