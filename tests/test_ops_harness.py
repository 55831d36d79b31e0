"""benchmarks/ops.py's call-by-call alternating wall times, on the host clock (no GPU): who is
called when, what is sampled, and what the per-case summary holds."""
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


class Recorder:
    """A timer whose events, flushes and calls land in one log, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.clock = 0.0
        rec = self

        class Event:
            def __init__(self) -> None:
                self.t = None

            def record(self) -> None:
                self.t = rec.clock
                rec.log.append("event")

            def elapsed_time(self, end: Event) -> float:
                return end.t - self.t

        self.timer = (Event, lambda: self.log.append("flush"), lambda: self.log.append("sync"))

    def fn(self, name: str, ms: float):
        def call() -> None:
            self.log.append(name)
            self.clock += ms

        return call


def test_calls_take_turns_in_rotating_order(ops):
    rec = Recorder()
    fns = {"a": rec.fn("a", 1.0), "b": rec.fn("b", 2.0), "c": rec.fn("c", 3.0)}
    got = ops.bench_alternating(fns, calls=3, warmup=2, timer=rec.timer)
    calls = [e for e in rec.log if e in fns]
    assert calls == ["a", "b", "c"] * 2 + ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # each timed call: flush, start event, the call, end event; one sync after warm-up, one at the end
    timed = rec.log[rec.log.index("sync") + 1:]
    assert timed[-1] == "sync" and rec.log.count("sync") == 2
    assert timed[:-1] == [e for n in ["a", "b", "c", "b", "c", "a", "c", "a", "b"] for e in ("flush", "event", n, "event")]
    assert got == {"a": [1000.0] * 3, "b": [2000.0] * 3, "c": [3000.0] * 3}  # ms of the events -> µs
    host: dict = {}
    ops.bench_alternating(fns, calls=4, warmup=0, timer=rec.timer, host=host)
    assert sorted(host) == ["a", "b", "c"] and all(len(v) == 4 and min(v) >= 0 for v in host.values())


def test_alternating_walls_summarises_every_implementation(ops):
    case = ops.Case("tiny", (4, 8), (4, 8), (1,), torch.float32)
    row: dict = {}
    out = ops.alternating_walls(case, "cpu", row, turns=10, segments=5, timer=ops.host_timer())
    assert row["alternating"] is out and out["turns"] == 10
    for impl in ("torch", "flowexec", "floor", "floor3"):
        for key in ("wall_fwd_bwd_us", "wall_fwd_us"):
            s = out[impl][key]
            assert s["q1"] <= s["median"] <= s["q3"] and len(s["segment_medians"]) == 5
    t, f = out["torch"]["wall_fwd_bwd_us"], out["flowexec"]["wall_fwd_bwd_us"]
    assert out["speedup"]["wall_fwd_bwd_us"] == pytest.approx(t["median"] / f["median"])
    assert out["segment_speedups"] == pytest.approx([a / b for a, b in zip(t["segment_medians"], f["segment_medians"])])
    assert out["bound3"] == pytest.approx(t["median"] / out["floor3"]["wall_fwd_bwd_us"]["median"])


def test_bench_alternating_rejects_nothing_silently(ops):
    """A call that raises stops the measurement with its own error (no partial figures)."""
    def boom() -> None:
        raise ValueError("bad call")

    with pytest.raises(ValueError, match="bad call"):
        ops.bench_alternating({"ok": lambda: None, "boom": boom}, calls=2, warmup=1, timer=ops.host_timer())


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
    run = os.path.join(os.path.dirname(_PATH), "results", "ops_ed6d148_r15.json")
    report.pool_lerp([run, run])
    out = capsys.readouterr().out
    table = out[out.index("Forward alone"):].splitlines()
    assert "| case1 | 30 | 1.1906 | 1.1405–1.1950 | 0 | 0 of 2 |" in table
    assert "| case4 | 30 | 1.0029 | 1.0027–1.0525 | 6 | 0 of 2 |" in table


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
