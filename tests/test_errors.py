"""Every error the core promises: clear, early, naming what was wrong."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec import CaptureError, ExecutionError, InputError, OptionError


def f(x, y):
    return x @ y


def test_wrong_argument_count():
    exe = flowexec.compile(f, torch.randn(2, 3), torch.randn(3, 4))
    with pytest.raises(InputError, match="expected 2 argument"):
        exe(torch.randn(2, 3))


def test_wrong_shape_dtype_device_past_cache():
    exe = flowexec.compile(f, torch.randn(2, 3), torch.randn(3, 4), cache_size=1)
    with pytest.raises(InputError, match=r"args\[1\]: expected Tensor\(shape=\[3, 4\].*got Tensor\(shape=\[3, 5\]"):
        exe(torch.randn(2, 3), torch.randn(3, 5))
    with pytest.raises(InputError, match=r"args\[0\]: expected .*dtype=torch.float32.*got .*dtype=torch.float64"):
        exe(torch.randn(2, 3, dtype=torch.float64), torch.randn(3, 4))
    with pytest.raises(InputError, match=r"args\[0\]: .*device=cpu.*device=meta"):
        exe(torch.randn(2, 3, device="meta"), torch.randn(3, 4))


def test_non_tensor_where_tensor_expected():
    exe = flowexec.compile(f, torch.randn(2, 3), torch.randn(3, 4))
    with pytest.raises(InputError, match=r"args\[1\]: expected Tensor"):
        exe(torch.randn(2, 3), 3.0)
    with pytest.raises(InputError, match=r"args\[0\]\[1\]: flowexec.compile takes containers .* got object"):
        flowexec.compile(f, [1, object()], torch.randn(3))


def test_unknown_options_list_valid_ones():
    with pytest.raises(OptionError, match="unknown option.*'cache_sise'.*cache_size"):
        flowexec.compile(f, torch.randn(2, 3), torch.randn(3, 4), cache_sise=4)
    with pytest.raises(OptionError, match="mode='fast'.*valid: trace, graph"):
        flowexec.compile(f, torch.randn(2, 3), torch.randn(3, 4), mode="fast")
    with pytest.raises(OptionError, match="gc='eager'.*valid: fast, async, none"):
        flowexec.compile(f, torch.randn(2, 3), torch.randn(3, 4), gc="eager")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_graph_mode_on_cpu_names_the_alternative():
    with pytest.raises(OptionError, match="mode='trace'"):
        flowexec.compile(f, torch.randn(2, 3), torch.randn(3, 4), mode="graph")
    # Dynamo wraps backend errors in BackendCompilerFailed; the message stays ours.
    with pytest.raises(Exception, match="OptionError: mode='graph'.*use mode='trace'"):
        torch._dynamo.reset()
        torch.compile(lambda x: x + 1, backend="flowexec", options={"mode": "graph"})(torch.randn(2))


def test_backend_unknown_option():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown flowexec backend option"):
        torch.compile(lambda x: x * 2, backend="flowexec", options={"modee": "trace"})(torch.randn(2))


@pytest.mark.parametrize("opt,value", [("cache_size", 0), ("cache_size", "8"), ("warmup", -1), ("warmup", 1.5)])
def test_backend_count_options_are_checked(opt, value):
    torch._dynamo.reset()
    with pytest.raises(Exception, match=f"{opt}={value!r} must be a whole number of at least"):
        torch.compile(lambda x: x * 2, backend="flowexec", options={"mode": "trace", opt: value})(torch.randn(2))


def test_data_dependent_control_flow_names_line_and_backend():
    def g(x):
        if x.sum() > 0:  # data-dependent branch
            return x * 2
        return x

    with pytest.raises(CaptureError) as info:
        flowexec.compile(g, torch.randn(4))
    msg = str(info.value)
    assert "test_errors.py:" in msg and "if x.sum() > 0" in msg
    assert 'backend="flowexec"' in msg


def test_item_inside_fn():
    with pytest.raises(CaptureError, match=r"float\(x.max\(\)\)"):
        flowexec.compile(lambda x: x * float(x.max()), torch.randn(4))


def test_state_made_anew_on_every_call_is_refused():
    # (Issue 37: optimizer state made on the first step is no longer refused — the first call runs
    # eagerly, tests/test_training.py — but state made on every call cannot be captured.)
    kept = {}

    def step(x):
        kept["last"] = x * 2  # a tensor fn makes and keeps in Python state on every call
        return x + 1

    exe = flowexec.compile(step)
    exe(torch.randn(3))  # eager: fn creates state that outlives the call
    with pytest.raises(CaptureError, match="made anew on every call"):
        exe(torch.randn(3))


def test_optimizer_host_read_of_its_state_names_the_line_and_the_way_out():
    # (Issue 37: single-tensor Adam now compiles, on its capturable path.) Adagrad's single-tensor
    # step reads a value computed from its step count on the host: no guard can follow that.
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adagrad(model.parameters(), foreach=False)
    model(torch.randn(1, 4)).sum().backward()
    opt.step()

    def step(x):
        opt.zero_grad(set_to_none=False)
        F.mse_loss(model(x), torch.zeros(3, 2)).backward()
        opt.step()

    with pytest.raises(CaptureError, match=r"torch/optim/adagrad.py:\d+ .*foreach=True"):
        flowexec.compile(step, torch.randn(3, 4))


def test_a_host_read_of_state_the_step_changes_is_refused_not_kept():
    # make_fx answers .item() of a tensor fn did not make with its value now: the program would
    # keep that value for good while eager reads the new one on every call.
    count = torch.zeros(())

    def step(x):
        count.add_(torch.tensor(1.0))
        return x * (0.9 ** count.item())

    with pytest.raises(CaptureError, match=r"test_errors.py:\d+ .*count.item\(\).*reads a tensor's value on the host"):
        flowexec.compile(step, torch.ones(2))


def test_execution_error_names_op_and_line():
    idx = torch.tensor([0, 1])
    exe = flowexec.compile(lambda x, i: x[i] * 2, torch.randn(4), idx)
    with pytest.raises(ExecutionError, match=r"While executing op #0 .*aten.index.Tensor.*test_errors.py:\d+"):
        exe(torch.randn(4), torch.tensor([0, 7]))



def test_input_buffers_only_in_graph_mode():
    exe = flowexec.compile(f, torch.randn(2, 3), torch.randn(3, 4))
    with pytest.raises(OptionError, match="graph mode only"):
        exe.input_buffers


def test_a_plan_s_lines_are_readable_where_it_fails_and_in_flowexec_plan_dir(tmp_path, monkeypatch):
    """A plan is generated Python: the error from one of its ops chains the op's own traceback,
    whose frame in the plan shows the plan's line; with ``FLOWEXEC_PLAN_DIR`` the plan's source
    is written there and compiled under that path, so that a crash's ``faulthandler`` stack
    (file and line only) names a line one can open."""
    import traceback

    monkeypatch.setenv("FLOWEXEC_PLAN_DIR", str(tmp_path / "plans"))
    f = flowexec.compile(lambda x, i: x.index_select(0, i) * 2, mode="trace")
    x = torch.randn(4, 3)
    f(x, torch.tensor([0, 1]))
    with pytest.raises(flowexec.ExecutionError) as info:
        f(x, torch.tensor([0, 7]))
    frames = [fr for fr in traceback.extract_tb(info.value.__cause__.__traceback__) if "flowexec-plan-" in fr.filename]
    assert frames and "index_select" in frames[-1].line, frames
    (written,) = list((tmp_path / "plans").iterdir())
    assert frames[-1].filename == str(written)
    lines = written.read_text().splitlines()
    assert "index_select" in lines[frames[-1].lineno - 1]


def test_a_collected_plan_s_source_leaves_linecache():
    """Each plan's generated source goes into ``linecache`` (a traceback through it shows the op's
    line); entries there are never dropped by ``checkcache`` (no mtime), so a process that builds
    plans again and again (a sweep, a server rebuilding per shape) kept every plan's text for good
    after the plan itself was collected."""
    import gc
    import linecache

    import flowexec

    def plans() -> int:
        return sum("flowexec-plan-" in k for k in linecache.cache)

    gc.collect()
    before = plans()
    x = torch.randn(4, 3)
    for _ in range(20):
        f = flowexec.compile(lambda x: (x * 2).sin(), mode="trace")
        f(x)
        del f
    gc.collect()
    assert plans() - before < 5, plans() - before
