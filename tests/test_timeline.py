"""The timeline: records file format, merge across hosts, the Trace Event Format export, the
summary figures, and the `flowexec timeline` command (all CPU, synthetic records)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from flowexec.cli import main
from flowexec.profiler.io import Header, RecordWriter, rank_file, read_records, write_records
from flowexec.profiler.merge import merge_dir, merge_spans
from flowexec.profiler.records import Span
from flowexec.profiler.summary import summarize
from flowexec.profiler.timers import JobTimer
from flowexec.profiler.trace import trace_events

from timeline_data import WAIT_NS, pipeline_spans

# catapult's color_scheme.js reserved names: the only cname values chrome://tracing accepts
CHROME_COLOURS = set("""thread_state_uninterruptible thread_state_iowait thread_state_running thread_state_runnable
thread_state_sleeping thread_state_unknown background_memory_dump light_memory_dump detailed_memory_dump
vsync_highlight_color generic_work good bad terrible black grey white yellow olive rail_response rail_animation
rail_idle rail_load startup heap_dump_stack_frame heap_dump_object_type heap_dump_child_node_arrow cq_build_running
cq_build_passed cq_build_failed cq_build_abandoned cq_build_attempt_runnig cq_build_attempt_passed
cq_build_attempt_failed""".split())


def test_trace_follows_the_trace_event_format():
    spans = merge_spans(pipeline_spans())
    events = json.loads(json.dumps(trace_events(spans)))["traceEvents"]  # survives JSON as is
    assert {e["ph"] for e in events} == {"M", "X", "i", "s", "f"}
    for e in events:
        assert isinstance(e["name"], str) and e["name"]
        assert type(e["pid"]) is int and type(e["tid"]) is int and e["pid"] >= 1, e
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["cname"] in CHROME_COLOURS and e["cat"], e
    # slices on one thread nest or are apart, never partly overlap (Perfetto drops those)
    rows: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for key, iv in rows.items():
        iv.sort(key=lambda t: (t[0], -t[1]))
        open_: list[float] = []
        for a, b in iv:
            while open_ and open_[-1] <= a:
                open_.pop()
            assert not open_ or b <= open_[-1], f"slices partly overlap on thread {key}: ends {open_[-1]}, {(a, b)}"
            open_.append(b)
    # metadata: each rank a named process, each row used a named thread
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs) == [1, 2] and procs[1].startswith("rank 0 (hostA")
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] in "Xi"}
    assert used <= set(threads)
    for pid in (1, 2):  # receives posted up front overlap: they take extra lanes
        names = {threads[(pid, t)] for p, t in used if p == pid}
        assert {"steps", "compute", "transfers", "transfers 2", "waits"} <= names, names
        assert names - {"steps", "compute", "waits"} == {n for n in names if n.startswith("transfers")}
    # slices named like `F mb3`, the kind as cat, the rest in args
    jobs = [e for e in events if e["ph"] == "X" and e["cat"] in ("F", "B")]
    assert len(jobs) == 2 * 2 * 8 and all(e["name"] == f"{e['cat']} mb{e['args']['micro']}" for e in jobs)
    assert all(e["args"]["stage"] == e["pid"] - 1 and e["args"]["step"] in (10, 11) for e in jobs)
    assert len({e["cname"] for e in events if e["ph"] == "X"}) == len({e["cat"] for e in events if e["ph"] == "X"})
    # flows: one s and one f per id, from a send slice on one rank to a receive slice on the other
    xs = [e for e in events if e["ph"] == "X"]

    def slice_at(e, cat):
        return [x for x in xs if x["pid"] == e["pid"] and x["tid"] == e["tid"] and x["cat"] == cat
                and x["ts"] <= e["ts"] <= x["ts"] + x["dur"]]

    by_id: dict[int, dict[str, dict]] = {}
    for e in events:
        if e["ph"] in "sf":
            assert e["ph"] not in by_id.setdefault(e["id"], {}), f"flow {e['id']} has two {e['ph']} events"
            by_id[e["id"]][e["ph"]] = e
    assert len(by_id) == 2 * 2 * 4  # every transfer: 4 forward activations down, 4 gradients up, 2 steps
    for fid, pair in by_id.items():
        assert set(pair) == {"s", "f"} and pair["f"]["bp"] == "e"
        s, f = pair["s"], pair["f"]
        assert s["pid"] != f["pid"]
        (send,), (recv,) = slice_at(s, "send"), slice_at(f, "recv")
        assert send["args"]["tag"] == recv["args"]["tag"] and send["args"]["step"] == recv["args"]["step"]
        assert send["args"]["peer"] == recv["pid"] - 1 and recv["args"]["peer"] == send["pid"] - 1


def test_step_lines_cover_their_jobs():
    events = trace_events(merge_spans(pipeline_spans()))["traceEvents"]
    steps = {(e["pid"], e["args"]["step"]): e for e in events if e["ph"] == "X" and e["cat"] == "step"}
    assert sorted(steps) == [(1, 10), (1, 11), (2, 10), (2, 11)]
    lines = {(e["pid"], e["name"]): e["ts"] for e in events if e["ph"] == "i"}
    for e in events:
        if e["ph"] == "X" and e["cat"] != "step":
            st = steps[(e["pid"], e["args"]["step"])]
            assert st["ts"] <= e["ts"] and e["ts"] + e["dur"] <= st["ts"] + st["dur"] + 1e-6, e
    for (pid, step), st in steps.items():  # the instant line at each step's start
        assert lines[(pid, f"step {step}")] == st["ts"]
    assert steps[(1, 10)]["ts"] + steps[(1, 10)]["dur"] < steps[(1, 11)]["ts"]


def test_merge_puts_two_hosts_with_known_offsets_where_they_belong(tmp_path):
    # rank 1's clock reads 7.3 s behind rank 0's; its spans carry the measured offset
    truth = pipeline_spans(offsets=(0, 0))
    recorded = pipeline_spans(offsets=(0, 7_300_000_123))
    assert [s.start_ns for s in recorded if s.rank == 1][0] == [s.start_ns for s in truth if s.rank == 1][0] - 7_300_000_123
    for r in (0, 1):
        write_records(rank_file(str(tmp_path), r), Header(r, ("hostA", "hostB")[r], 100 + r, (0, 7_300_000_123)[r], 900),
                      [s for s in recorded if s.rank == r])
    merged = merge_dir(str(tmp_path))
    assert merged.spans == merge_spans(truth)
    assert all(s.offset_ns == 0 for s in merged.spans)
    assert merged.headers[1].clock_offset_ns == 7_300_000_123 and merged.headers[1].clock_rtt_ns == 900
    # and so every receive ends after the send that feeds it began
    from flowexec.profiler.trace import pair_flows
    pairs = pair_flows(merged.spans)
    assert len(pairs) == 16 and all(a.start_ns < b.end_ns for a, b in pairs)


def _sp(r, step, kind, micro, a, b, stream="compute"):
    return Span(r, "h", 1, step, r, kind, micro, stream, a, b, "host")


def test_summary_figures_match_a_hand_computed_example():
    one = [  # one step of 2 ranks (ns); rank 0 waits 5 in B0, rank 1 waits 2 in F0
        _sp(0, 0, "F", 0, 0, 10), _sp(0, 0, "F", 1, 10, 20), _sp(0, 0, "B", 0, 40, 60), _sp(0, 0, "wait", 0, 40, 45, "wait"),
        _sp(0, 0, "B", 1, 70, 90), _sp(0, 0, "OPT", None, 90, 100),
        _sp(1, 0, "F", 0, 10, 20), _sp(1, 0, "wait", 0, 10, 12, "wait"), _sp(1, 0, "B", 0, 20, 40),
        _sp(1, 0, "F", 1, 40, 50), _sp(1, 0, "B", 1, 50, 70), _sp(1, 0, "OPT", None, 90, 100),
        _sp(1, 0, "send", 0, 40, 45, "comm"),  # transfers are neither busy nor idle by themselves
    ]
    spans = one + [Span(**{**s.to_dict(), "step": 1, "start_ns": s.start_ns + 1000, "end_ns": s.end_ns + 1000})
                   for s in one]
    r0, r1 = summarize(spans, theory={0: 0.2, 1: 0.25})
    # the window is F/B from 0 to 90 in each step: 180; rank 0 busy 10+10+(20-5)+20 = 55 per step
    assert (r0.steps, r0.window_ns, r0.busy_ns, r0.wait_ns) == (2, 180, 110, 10)
    assert (r1.steps, r1.window_ns, r1.busy_ns, r1.wait_ns) == (2, 180, 116, 4)  # 8 + 20 + 10 + 20 = 58
    assert r0.busy == pytest.approx(55 / 90) and r0.bubble == pytest.approx(35 / 90)
    assert r1.bubble == pytest.approx(32 / 90)
    assert r0.mean_ns == {"F": 10, "B": 20, "OPT": 10} and r0.count == {"F": 4, "B": 4, "OPT": 2}
    assert (r0.theory_bubble, r1.theory_bubble) == (0.2, 0.25)


def test_summary_of_the_synthetic_pipeline_is_near_its_schedule_theory():
    from flowexec.pipeline.schedules import one_f_one_b, simulate

    rows = summarize(merge_spans(pipeline_spans()))
    theory = simulate(one_f_one_b(2, 4), costs=(1.0, 1.0, 1.0)).bubble
    # jobs are 20 µs short of their slots and wait 15 µs: the measured bubble is a bit above theory
    for r in rows:
        assert theory < r.bubble < theory + 0.03, (r, theory)


def test_records_file_round_trips_and_bad_files_are_named(tmp_path):
    spans = pipeline_spans()[:5]
    p = write_records(str(tmp_path / "rank0.jsonl"), Header(0, "hostA", 100, 5, 6, {"schedule": "1f1b"}),
                      [s for s in spans if s.rank == 0])
    hdr, back = read_records(p)
    assert hdr == Header(0, "hostA", 100, 5, 6, {"schedule": "1f1b"}) and back == [s for s in spans if s.rank == 0]
    first = json.loads(open(p).readline())
    assert (first["schema"], first["version"], first["type"]) == ("flowexec-timeline", 1, "header")
    lines = open(p).read().splitlines()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "rank0.jsonl").write_text(lines[0].replace('"version": 1', '"version": 9') + "\n")
    with pytest.raises(ValueError, match="schema version 9"):
        read_records(str(bad / "rank0.jsonl"))
    d = json.loads(lines[1])
    del d["kind"]
    (bad / "rank0.jsonl").write_text(lines[0] + "\n" + json.dumps(d) + "\n")
    with pytest.raises(ValueError, match=r"rank0.jsonl:2: span record lacks field 'kind'"):
        read_records(str(bad / "rank0.jsonl"))
    (bad / "rank0.jsonl").write_text('{"not": "records"}\n')
    with pytest.raises(ValueError, match="not a flowexec timeline records file"):
        merge_dir(str(bad))


def test_writer_appends_a_step_at_a_time(tmp_path):
    w = RecordWriter(str(tmp_path / "rank0.jsonl"), Header(0, "h", 1))
    w.write([_sp(0, 0, "F", 0, 0, 10)])
    assert len(read_records(w.path)[1]) == 1  # on disk already: a run that dies keeps its steps
    w.write([_sp(0, 1, "F", 0, 20, 30)])
    assert [s.step for s in read_records(w.close())[1]] == [0, 1]


def test_cpu_job_timer_stamps_host_times_issue_and_offset():
    t = JobTimer(torch.device("cpu"), rank=3, host="h", offset_ns=42)
    a = t.begin(step=5, stage=1, kind="F", micro=2)
    b = t.begin(step=5, stage=1, kind="send", micro=2, stream="comm", peer=2, tag=4)
    t.end(b)
    t.end(a)
    t.begin(step=5, stage=1, kind="B", micro=2)  # never ended: not a measurement
    f, s = t.flush()
    assert (f.rank, f.step, f.kind, f.micro, f.clock, f.offset_ns) == (3, 5, "F", 2, "host", 42)
    assert f.issue_ns <= f.start_ns <= s.start_ns <= s.end_ns <= f.end_ns
    assert (s.peer, s.tag, s.stream) == (2, 4, "comm")
    assert t.flush() == []


def test_timeline_merge_command_writes_trace_and_page(tmp_path, capsys):
    spans = pipeline_spans(offsets=(0, 123_456))
    for r in (0, 1):
        write_records(rank_file(str(tmp_path), r), Header(r, "h", 1, (0, 123_456)[r], 10,
                      {"schedule": "1f1b", "n_ranks": 2, "n_stages": 2, "n_micro": 4, "theory_bubble": 0.2}),
                      [s for s in spans if s.rank == r])
    out, html = str(tmp_path / "t.json"), str(tmp_path / "t.html")
    assert main(["timeline", "merge", str(tmp_path), "-o", out, "--html", html]) == 0
    text = capsys.readouterr().out
    # the command line hands the pipeline's simulation to the profiler: the column of the theory at job times
    assert "rank  steps  busy  bubble  theory  at job times" in text
    assert f"trace: {out}" in text and f"page: {html}" in text
    assert len([e for e in json.load(open(out))["traceEvents"] if e["ph"] == "X"]) == len(spans) + 4
    assert os.path.getsize(html) > 5000
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["timeline", "merge", str(empty), "-o", out]) == 2
    assert "no records (*.jsonl) to merge" in capsys.readouterr().err


def test_a_step_the_trainer_timed_is_the_step_slice():
    spans = [_sp(0, 4, "F", 0, 100, 200), Span(0, "h", 1, 4, None, "step", None, "compute", 50, 260, "host")]
    ev = trace_events(spans)["traceEvents"]
    steps = [e for e in ev if e["ph"] == "X" and e["cat"] == "step"]
    assert len(steps) == 1 and (steps[0]["name"], steps[0]["ts"], steps[0]["dur"]) == ("step 4", 0.0, 0.21)
    rows = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert rows[steps[0]["tid"]] == "steps"


def test_theory_at_measured_job_times_simulates_the_named_schedule():
    from flowexec.pipeline.schedules import one_f_one_b, simulate
    from flowexec.pipeline.theory import theory_at_measured_costs

    spans = merge_spans(pipeline_spans())  # F 0.98 ms, B 1.98 ms: the theory at those costs
    got = theory_at_measured_costs({"schedule": "1f1b", "n_ranks": 2, "n_micro": 4}, spans)
    sim = simulate(one_f_one_b(2, 4), costs=(980_000.0, 1_980_000.0, 0.0))
    assert got == {r: sim.idle[r] / sim.makespan for r in (0, 1)}
    assert 0 < got[0] < 0.5
    assert theory_at_measured_costs({"n_micro": 4}, spans) is None  # no schedule named


def test_step_profiler_records_its_steps_and_writes_between_recorded_runs(tmp_path):
    from flowexec.profiler import NULL_TIMER, StepProfiler

    prof = StepProfiler(str(tmp_path), steps=range(1, 3), device="cpu", meta={"schedule": "1f1b"})
    written = []
    for k in range(4):
        with prof.step(k) as t:
            assert (t is NULL_TIMER) == (k not in (1, 2))
            t.end(t.begin(step=k, stage=0, kind="F", micro=0))
        written.append(len(read_records(rank_file(str(tmp_path), 0))[1]))
    assert written == [0, 0, 2, 2]  # nothing is written inside the recorded steps: after step 2, at once
    hdr, spans = read_records(prof.close())
    assert [s.step for s in spans] == [1, 2] and prof.recorded == [1, 2] and hdr.meta == {"schedule": "1f1b"}
