"""CPU streams with real event semantics, under random delays in the workers: a branchy
program run 1,000 times equals the one-stream run; with one wait left out, the same harness
sees a wrong result (or a missing value) — and the verifier names the hazard either way."""
from __future__ import annotations

import random
import time

import pytest
import torch

import flowexec
from flowexec.capture import capture
from flowexec.passes.verify import verify_plan, without_wait
from flowexec.plan import build_plan
from flowexec.runtime.cpu_streams import CpuEvent, lower_workers

pytestmark = pytest.mark.timeout(300)


def branchy(x, y):
    a = x * 2          # branch 1
    b = y + 1          # branch 2
    c = b.sin()
    a.add_(c)          # waits for branch 2
    d = (x - y).exp()  # branch 3
    b.mul_(d)          # written after c read it (WAR) and after d (RAW)
    return a + b, c.sum(), d


def jitter(seed):
    rng = random.Random(seed)

    def delay():
        if rng.random() < 0.5:
            time.sleep(rng.random() * 1e-4)
    return delay


def test_a_thousand_jittered_runs_equal_the_one_stream_run():
    x, y = torch.randn(4), torch.randn(4)
    prog = capture(branchy, (x, y)).program
    want = flowexec.compile(branchy, x, y)(x, y)
    for issue in ("host", "lists"):
        plan = build_plan(prog, streams=3)
        assert plan.n_streams == 3 and plan.n_events >= 2 and verify_plan(prog, plan) == []
        run = lower_workers(plan, issue=issue, jitter=jitter(1), spin_us=20)
        for _ in range(500):  # 500 host-issued + 500 threaded
            got = run(x, y)
            assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_with_one_wait_left_out_the_harness_or_the_verifier_sees_it():
    x, y = torch.randn(4), torch.randn(4)
    prog = capture(branchy, (x, y)).program
    want = flowexec.compile(branchy, x, y)(x, y)
    plan = build_plan(prog, streams=3)
    waits = [(j, k) for j, i in enumerate(plan.instructions) for k in range(len(i.waits))]
    assert waits
    seen_by_runs = 0
    for j, k in waits:
        assert verify_plan(prog, without_wait(plan, j, k)), (j, k)  # the verifier always names it
        run = lower_workers(plan, issue="host", jitter=jitter(j), spin_us=20, drop_waits={(j, k)}, timeout_s=5)
        wrong = False
        for _ in range(300):
            try:
                got = run(x, y)
            except flowexec.ExecutionError:  # a value not made yet (None) or a broken one
                wrong = True
                break
            if not all(torch.equal(g, w) for g, w in zip(got, want)):
                wrong = True
                break
        seen_by_runs += wrong
    assert seen_by_runs >= 1, "the delays exposed none of the missing waits"


def test_events_record_wait_and_query_across_threads():
    import threading

    ev = CpuEvent()
    assert not ev.query(1)
    t = threading.Timer(0.05, lambda: ev.mark(1))
    t.start()
    from flowexec.runtime.cpu_streams import WorkerPool

    pool = WorkerPool(1, 1, spin_us=10, timeout_s=5)
    pool.events[0] = ev
    pool.call = 1
    pool.wait_event(0, "in the test")  # blocks until the other thread records
    assert ev.query(1)
    pool.timeout_s = 0.05
    pool.call = 2
    with pytest.raises(flowexec.ExecutionError, match="timed out after 0.05 s waiting for event 0 in the test"):
        pool.wait_event(0, "in the test")
    pool.close()


def test_a_value_used_on_several_streams_is_released_by_each():
    w = torch.randn(8, 8)

    def f(x):
        h = x.sin()              # read by two other streams, freed after its last use
        return (h @ w).relu() + (h @ w.t()).tanh() + h.cos()

    x = torch.randn(8, 8)
    plan = build_plan(capture(f, (x,)).program, streams=3)
    assert any(ks for i in plan.instructions for _, ks in i.stream_uses)
    run = lower_workers(plan, jitter=jitter(3), spin_us=20)
    for _ in range(200):
        torch.testing.assert_close(run(x)[0], f(x))


def test_workers_are_stopped_and_joined_at_exit():
    # A daemon worker still inside torch when the interpreter finalizes aborts the process
    # (seen on the H200); the atexit hook stops and joins every live worker first.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import threading, torch, flowexec
        from flowexec.runtime import cpu_streams
        f = lambda x: (x.sin() @ x.cos()) + (x.cos() @ x.sin())
        exe = flowexec.compile(f, torch.randn(64, 64), mode="threaded", streams=2)
        exe(torch.randn(64, 64))
        workers = list(cpu_streams._LIVE_WORKERS)
        assert workers and all(w.thread.is_alive() for w in workers)
        cpu_streams._stop_all_workers()
        assert not any(w.thread.is_alive() for w in workers), "a worker outlived the exit hook"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
