"""Multi-stream runs (``streams > 1``) on CUDA against eager (run on the lent GPU)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.models import make_mlp, make_step

from helpers import assert_close_rel, assert_same_state, block_adam_twins

torch.backends.cuda.matmul.allow_tf32 = False


def branches_fn():
    torch.manual_seed(0)
    br = [[torch.randn(256, 256, device="cuda") / 16 for _ in range(6)] for _ in range(4)]

    def f(x):
        outs = []
        for ws in br:
            h = x
            for w in ws:
                h = F.silu(h @ w)
            outs.append(h)
        return torch.cat(outs, -1), outs[1].sum()

    return f


@pytest.mark.parametrize("mode", ["trace", "graph"])
def test_independent_branches_on_four_streams_match_eager(mode):
    f = branches_fn()
    x = torch.randn(8, 256, device="cuda")
    # (eager's kernels on four streams: fused regions, tested in test_fuse_gpu.py, would join
    # the branches' SiLUs into Triton kernels that round otherwise)
    exe = flowexec.compile(f, x, mode=mode, streams=4, fuse=False)
    assert exe.plan.stats()["streams"] == 4 and exe.plan.stats()["events"] >= 3
    kept = []
    for _ in range(3):
        x = torch.randn(8, 256, device="cuda")
        got = exe(x)
        assert_close_rel(got, f(x))
        kept.append((got, [t.clone() for t in got]))
    torch.cuda.synchronize()
    for got, snapshot in kept:  # outputs held across calls stay valid
        assert all(torch.equal(a, b) for a, b in zip(got, snapshot))


def _sgd_mlp_twins():
    """Two identical small MLPs with SGD, their training steps and four batches."""
    torch.manual_seed(0)
    m1 = make_mlp(64, 4).cuda()
    m2 = copy.deepcopy(m1)
    s1 = make_step(m1, torch.optim.SGD(m1.parameters(), lr=0.1), F.cross_entropy)
    s2 = make_step(m2, torch.optim.SGD(m2.parameters(), lr=0.1), F.cross_entropy)
    data = [(torch.randn(16, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")) for _ in range(4)]
    return m1, m2, s1, s2, data


@pytest.mark.parametrize("streams", [2, 4])
def test_mlp_training_step_on_streams_matches_eager(streams):
    m1, m2, s1, s2, data = _sgd_mlp_twins()
    exe = flowexec.compile(s2, *data[0], mode="graph", streams=streams)
    assert exe.plan.stats()["streams"] > 1
    for x, y in data:
        assert_close_rel(exe(x, y), s1(x, y))
    assert_same_state(m1, m2)


def test_block_adam_trace_on_streams_matches_eager():
    # trace mode: real frees across streams every call (record_stream), Adam state written in place
    m1, m2, s1, s2, data = block_adam_twins(5)
    exe = flowexec.compile(s2, *data[0], mode="trace", streams=3)
    assert exe.plan.stats()["events"] > 0
    for x, y in data[1:]:
        assert_close_rel(exe(x, y), s1(x, y))
    assert_same_state(m1, m2, tol=1e-5)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the caller's stream is current again


def test_an_output_dropped_on_one_caller_stream_is_not_reused_by_a_call_from_another():
    # The output is made on a side stream and recorded on the caller's stream (side_outputs).
    # A call from a second caller stream is not ordered after the first caller's late read by
    # its fork; without that record its side-stream allocations would take the output's block
    # while the read is still queued, and the read would see the second call's values.
    torch.manual_seed(0)
    w0, w1 = (torch.randn(256, 256, device="cuda") / 16 for _ in range(2))

    def g(x):
        a = F.silu(x @ w0)  # the caller's stream
        b = F.silu(x @ w1)  # a side stream: a root while stream 0 is busy with a's chain
        return a * 2, b * 2

    x1, x2 = torch.randn(8, 256, device="cuda"), torch.randn(8, 256, device="cuda") * 10
    exe = flowexec.compile(g, x1, mode="trace", streams=2)
    assert exe.plan.side_outputs  # b * 2 is made on stream 1
    want = g(x1)[1]
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(10):
        with torch.cuda.stream(sa):
            out = exe(x1)[1]
            torch.cuda._sleep(2_000_000)  # the first caller reads out late
            snap = out.clone()
        del out
        with torch.cuda.stream(sb):
            exe(x2)
        torch.cuda.synchronize()
        torch.testing.assert_close(snap, want, rtol=1e-5, atol=1e-5)


def test_copy_heavy_step_auto_puts_copies_on_a_copy_stream_in_graph_mode_and_matches_eager():
    torch.manual_seed(0)
    ws = [torch.randn(256, 256, device="cuda") / 16 for _ in range(3)]
    hosts = [torch.empty(64, 256, pin_memory=True) for _ in range(3)]

    def step(x):
        h = x
        for w, hb in zip(ws, hosts):
            h = torch.tanh(h @ w)
            hb.copy_(h, non_blocking=True)
        return h

    for mode, streams in (("trace", "auto"), ("trace", 2), ("graph", "auto")):
        x = torch.randn(64, 256, device="cuda")
        exe = flowexec.compile(step, x, mode=mode, streams=streams)
        # trace mode is host-bound: "auto" keeps the copies on one stream there (passes/streams.py)
        want_roles = ("compute",) if (mode, streams) == ("trace", "auto") else ("compute", "d2h")
        assert exe.plan.stats()["stream_roles"] == want_roles
        assert flowexec.verify_plan(exe.plan.program, exe.plan) == []
        for _ in range(3):
            x = torch.randn(64, 256, device="cuda")
            got = exe(x)
            torch.cuda.synchronize()
            got_host = [h.clone() for h in hosts]
            want = step(x)
            torch.cuda.synchronize()
            assert_close_rel(got, want)
            for a, b in zip(got_host, hosts):
                assert_close_rel(a, b)


@pytest.mark.parametrize("streams", [1, 3, "auto"])
def test_threaded_mode_on_cuda_matches_eager(streams):
    f = branches_fn()
    x = torch.randn(8, 256, device="cuda")
    exe = flowexec.compile(f, x, mode="threaded", streams=streams)
    for _ in range(3):
        x = torch.randn(8, 256, device="cuda")
        assert_close_rel(exe(x), f(x))
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_threaded_mlp_training_step_on_cuda_matches_eager():
    m1, m2, s1, s2, data = _sgd_mlp_twins()
    exe = flowexec.compile(s2, *data[0], mode="threaded", streams=3)
    for x, y in data:
        assert_close_rel(exe(x, y), s1(x, y))
    assert_same_state(m1, m2)


def test_pruned_and_naive_plans_both_verify_on_the_training_step():
    from flowexec.capture import capture
    from flowexec.plan import build_plan

    m1, m2, s1, s2, data = block_adam_twins(2)
    prog = capture(s2, data[1]).program
    for prune in (True, False):
        plan = build_plan(prog, streams=4, prune=prune)
        assert flowexec.verify_plan(prog, plan) == []
    st = build_plan(prog, streams=4).stats()
    assert st["waits"] < st["naive_waits"] == st["cross_stream_edges"]
