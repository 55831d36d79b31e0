"""Compile workers on CUDA (flowexec.compile_workers): Triton regions compiled in worker
processes are found in Inductor's cache here, and the fused graph-mode step trains as eager."""
from __future__ import annotations

import pytest
import torch

import flowexec
from flowexec import compile_workers, verdict_cache
from flowexec.inductor import InductorCompiler

from helpers import assert_close_rel, assert_same_state, block_adam_twins

pytestmark = pytest.mark.timeout(400)


@pytest.mark.parametrize("here_too", [False, True], ids=["workers", "workers_and_here"])
def test_a_cold_graph_step_compiles_its_regions_in_workers_and_trains_as_eager(tmp_path, monkeypatch, here_too):
    """A transformer block's Adam step in graph mode on a cold cache, two workers: they start
    before the capture, compile every cold region (Triton kernels), each is an AOT cache hit
    here, nothing fails, and the losses and parameters are eager's. With this process taking
    jobs too (the default), the regions are split between them (on this small block this
    process may take them all before the workers have started), with the same results."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(verdict_cache, "_shared", {})
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "2")
    monkeypatch.setattr(compile_workers, "_disabled", [])
    monkeypatch.setattr(compile_workers, "THIS_PROCESS_COMPILES", here_too)
    comp = InductorCompiler()
    monkeypatch.setattr(flowexec.fusion, "_compiler", comp)
    m1, m2, s1, s2, data = block_adam_twins(4)
    exe = flowexec.compile(s2, mode="graph", fuse="inductor")
    counters.clear()
    # (data[1:]: the same three steps after block_adam_twins' eager one as test_fuse_gpu's
    # fused graph step, held to the same tolerance; with a fourth step of Adam at lr 1e-2 a
    # layer norm's weight gradient was 1.02e-5 from eager's on an H100 (40dca79) and an H200
    # (8a897b8))
    losses = [(exe(x, y).clone(), s1(x, y)) for x, y in data[1:]]
    # (the workers first: a run on a GPU host then says whether and why they did nothing)
    assert compile_workers.off_reason() is None, compile_workers.off_reason()
    assert (comp.worker_jobs + comp.worker_jobs_here if here_too else comp.worker_jobs) > 0
    assert not comp.worker_failures and (here_too or not comp.worker_jobs_here), comp.worker_failures
    assert comp.worker_misses == 0
    for k, (got, want) in enumerate(losses):
        assert_close_rel(got, want, 1e-5, f"loss {k}")
    assert_same_state(m1, m2, 1e-5)
    assert exe.plan.stats()["fused_regions"] >= 5, exe.explain()
    assert counters["aot_autograd"]["autograd_cache_hit"] >= len(comp.worker_sent)
    assert not comp.worker_jobs or "worker processes" in exe.explain().splitlines()[0]
