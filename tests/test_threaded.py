"""Threaded mode and CPU streams on the core models: the training-step tests of test_core.py
run again (their bodies, not copies) with every op on worker threads — threaded mode, CPU
streams with ``streams=3`` and ``streams="auto"`` — and errors, timeouts and options."""
from __future__ import annotations

import pytest
import torch

import flowexec
import test_core
from flowexec.capture import capture
from flowexec.plan import build_plan
from flowexec.runtime.cpu_streams import lower_workers

RUNS = {
    "threaded": {"mode": "threaded", "streams": 3},
    "threaded_auto": {"mode": "threaded", "streams": "auto"},
    "trace_streams3": {"streams": 3},
    "trace_auto": {"streams": "auto"},
}
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("name", list(test_core.CASES))
def test_core_steps_match_eager_on_workers(name, run, monkeypatch):
    real = flowexec.compile
    made = []

    def compile_with(fn, *args, **kw):
        made.append(real(fn, *args, **{**RUNS[run], **kw}))
        return made[-1]

    monkeypatch.setattr(flowexec, "compile", compile_with)
    test_core.test_compile_matches_eager(name)
    plan = made[0].plan
    assert plan.on_workers
    if run != "threaded_auto" and run != "trace_auto":
        assert plan.n_streams == 3 and plan.n_events > 0
    assert flowexec.verify_plan(plan.program, plan) == []


@pytest.mark.parametrize("run", ["threaded", "trace_streams3"])
@pytest.mark.parametrize("name", list(test_core.CASES))
def test_backend_steps_match_eager_on_workers(name, run, monkeypatch):
    real = torch.compile

    def compile_with(model, backend=None, options=None, **kw):
        return real(model, backend=backend, options={**(options or {}), **RUNS[run]}, **kw)

    monkeypatch.setattr(torch, "compile", compile_with)
    test_core.test_backend_matches_eager(name)


def branchy(x):
    a = (x @ x).relu()
    b = x.sin() * 3
    return a + b, b.sum()


def test_threaded_outputs_match_and_plan_runs_each_stream_on_its_thread():
    x = torch.randn(16, 16)
    exe = flowexec.compile(branchy, x, mode="threaded", streams=2)
    for _ in range(5):
        x = torch.randn(16, 16)
        got, want = exe(x), branchy(x)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


def test_an_exception_on_a_worker_names_the_op_and_line():
    def f(x, idx):
        a = x.sin()
        b = x.cos()[idx]  # fails for a bad index, on a worker
        return a, b

    x = torch.randn(4)
    for mode in ("threaded", "trace"):
        exe = flowexec.compile(f, x, torch.tensor([1]), mode=mode, streams=2)
        with pytest.raises(flowexec.ExecutionError, match=r"aten\.index.*test_threaded\.py:\d+.*IndexError"):
            exe(x, torch.tensor([9]))
        got = exe(x, torch.tensor([2]))  # the workers go on with the next call
        torch.testing.assert_close(got[1], x.cos()[torch.tensor([2])])


def test_a_wait_that_never_ends_times_out_naming_the_instruction():
    x = torch.randn(4)
    plan = build_plan(capture(lambda x: x.sin() + x.cos(), (x,)).program, streams=2, mode="threaded")
    j = next(j for j, i in enumerate(plan.instructions) if i.waits)
    import flowexec.runtime.cpu_streams as cs

    orig = cs._record
    cs._record = lambda pool, e, s: None  # events are never recorded
    try:
        with pytest.raises(flowexec.ExecutionError, match=rf"timed out after 0.3 s waiting for event 0 on stream 0 "
                                                          rf"before op #{j} .*aten\.add"):
            lower_workers(plan, issue="lists", timeout_s=0.3)(x)
    finally:
        cs._record = orig


def test_options_are_checked():
    x = torch.randn(4)
    with pytest.raises(flowexec.OptionError, match="gc='async' runs in trace mode only"):
        flowexec.compile(branchy, x, mode="threaded", gc="async")
    exe = flowexec.compile(lambda x: x.sin() + x.cos(), x, mode="threaded", streams=2, spin_us=0, wait_timeout=5)
    torch.testing.assert_close(exe(x), x.sin() + x.cos())
    with pytest.raises(flowexec.OptionError, match="valid: trace, graph, threaded"):
        flowexec.compile(branchy, x, mode="async")
