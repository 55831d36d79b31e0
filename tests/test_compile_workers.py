"""Regions compiled in worker processes first (flowexec.compile_workers): how many workers, the
recipe a worker builds its graph from, cache keys equal to this process's, and failures that
leave the region to this process."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

import flowexec
from flowexec import compile_workers, inductor, verdict_cache
from flowexec.capture import capture
from flowexec.compile_workers import Job, cold_jobs, compile_in_processes, processes_for
from flowexec.errors import OptionError
from flowexec.inductor import GraphRecipe, InductorCompiler, graph_of, recipe_of, region_graph
from flowexec.passes.regions import find_regions

pytestmark = pytest.mark.timeout(300)


def test_how_many_workers_compile_the_cold_regions():
    """auto: workers only for a CUDA program with at least MIN_COLD cold regions on a host of 8
    CPUs or more, a quarter of its CPUs, at most 8; a number is taken as asked (never more
    workers than regions)."""
    rows = [  # cold, cuda, cpus, setting -> workers
        (0, True, 16, "auto", 0),
        (3, True, 16, "auto", 0),
        (4, True, 16, "auto", 4),
        (23, True, 16, "auto", 4),
        (23, True, 64, "auto", 8),
        (23, True, 4, "auto", 0),
        (23, False, 16, "auto", 0),
        (23, False, 2, "2", 2),
        (1, False, 2, "2", 1),
        (23, True, 16, "0", 0),
    ]
    got = [(c, cu, n, s, processes_for(c, cu, n, s)) for c, cu, n, s, _ in rows]
    assert got == rows


def test_local_ranks_share_the_host_s_cpus(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert compile_workers.host_cpus() == 64
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert compile_workers.host_cpus() == 8
    assert processes_for(23, True) == 2  # (8 CPUs: a quarter of them)


@pytest.mark.parametrize("value", ["-1", "many", "1.5", "65"])
def test_a_bad_worker_setting_names_the_choices(monkeypatch, value):
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", value)
    with pytest.raises(OptionError, match="'auto' .* from 0"):
        compile_workers.setting()


def _zero_input_ops(x):
    # arange and zeros take no tensor: an FX graph module's own pickling traces its code again,
    # runs them and keeps their results as tensor constants; the recipe keeps them as ops
    n = torch.arange(x.shape[0], dtype=x.dtype)
    return (x * n[:, None] + torch.zeros(x.shape)).relu().sum(0)


def test_a_recipe_pickles_and_builds_the_region_s_graph():
    prog = capture(_zero_input_ops, (torch.randn(4, 8),)).program
    (r,) = find_regions(prog)
    recipe = recipe_of(prog, r)
    again = pickle.loads(pickle.dumps(recipe))
    assert isinstance(again, GraphRecipe) and again == recipe
    gm = graph_of(again)
    assert gm.code == region_graph(prog, r).code
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]  # no tensor constant
    assert "arange" in gm.code and "zeros" in gm.code


def _fresh_cache(monkeypatch, path) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    monkeypatch.setattr(verdict_cache, "_shared", {})


def _regions_writing_an_input(x, w):
    # a region that computes, and one that writes the caller's tensor in place (an optimizer's
    # kind): the worker compiles both as this process would
    h = (x.sin() * 2).relu() @ w
    w.mul_(0.5).add_(h.mean(0).tanh())
    return h.exp().sum()


def test_regions_compiled_by_a_worker_are_loaded_from_the_cache_here(tmp_path, monkeypatch):
    """A build with a worker: the worker compiles each cold region, this process then finds
    every one in the cache (Inductor's AOT cache hits, no miss: its keys are this process's),
    ``explain()`` says so, a second look finds none cold (their output checks are kept), and
    the fused program equals eager, the input it writes included."""
    from torch._dynamo.utils import counters

    _fresh_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "1")
    comp = InductorCompiler()
    monkeypatch.setattr(flowexec.fusion, "_compiler", comp)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    prog = capture(_regions_writing_an_input, (x, w.clone())).program
    regions = find_regions(prog)
    n = len(regions)
    assert n >= 2 and any(r.mutated for r in regions)
    assert len(cold_jobs(prog, regions, comp)) == n
    counters.clear()
    exe = flowexec.compile(_regions_writing_an_input, mode="trace", fuse="inductor")
    w_eager, w_mine = w.clone(), w.clone()
    for _ in range(2):
        torch.testing.assert_close(exe(x, w_mine), _regions_writing_an_input(x, w_eager))
        torch.testing.assert_close(w_mine, w_eager)
    assert comp.worker_jobs == n and not comp.worker_failures and comp.worker_seconds > 0
    aot = dict(counters["aot_autograd"])
    assert aot.get("autograd_cache_hit") == n and not aot.get("autograd_cache_miss"), aot
    assert exe.plan.stats()["fused_regions"] == n
    assert f"({n} regions first in worker processes)" in exe.explain().splitlines()[0]
    assert cold_jobs(prog, regions, InductorCompiler()) == []  # checked and kept: nothing cold now


def test_a_region_a_worker_refuses_is_left_to_this_process_with_why(tmp_path, monkeypatch):
    """A job the worker cannot compile (an unknown op) comes back with the reason; a worker
    that dies mid-job (the op exits the process) fails that job, and nothing waits on it."""
    _fresh_cache(monkeypatch, tmp_path)
    metas = (capture(lambda x: x.sin(), (torch.randn(4),)).program.values[0].meta,)
    no_such_op = ("aten.no_such_op.default", (inductor.Local(0),), (), (1,), False)
    unknown = Job("unknown", GraphRecipe(1, (no_such_op,), (1,)), metas)
    dies = Job("dies", GraphRecipe(1, ((os._exit, (3,), (), (1,), False),), (1,)), metas)
    failed = compile_in_processes([unknown, dies], 1)
    assert set(failed) == {"unknown", "dies"}, failed
    assert "no_such_op" in failed["unknown"] and failed["dies"].startswith("worker exited"), failed


def test_prestarted_workers_are_taken_first_and_the_rest_stopped(tmp_path, monkeypatch):
    """Workers started before the capture (a cold cache's, so that their start overlaps it) are
    the ones a build's jobs go to; those it does not take stop when the build ends."""
    _fresh_cache(monkeypatch, tmp_path)
    compile_workers.prestart(2)
    started = list(compile_workers._prestarted)
    assert len(started) == 2 and all(w.proc.poll() is None for w in started)
    metas = (capture(lambda x: x.sin(), (torch.randn(4),)).program.values[0].meta,)
    no_such_op = ("aten.no_such_op.default", (inductor.Local(0),), (), (1,), False)
    failed = compile_in_processes([Job("unknown", GraphRecipe(1, (no_such_op,), (1,)), metas)], 1)
    assert "no_such_op" in failed["unknown"]  # (answered by a prestarted worker, which has now exited)
    assert started[0].proc.poll() is not None and compile_workers._prestarted == [started[1]]
    flowexec.fusion.release_compile_workers()
    assert compile_workers._prestarted == [] and started[1].proc.wait(10) is not None


def test_workers_are_prestarted_only_for_a_cache_no_build_has_filled(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "1")
    _fresh_cache(monkeypatch, tmp_path / "cold")
    flowexec.fusion.prestart_compile_workers()
    assert len(compile_workers._prestarted) == 1
    flowexec.fusion.release_compile_workers()
    _fresh_cache(monkeypatch, tmp_path / "warm")
    inductor.output_checks().put("a region", True)
    flowexec.fusion.prestart_compile_workers()
    assert compile_workers._prestarted == []
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "0")
    _fresh_cache(monkeypatch, tmp_path / "cold2")
    flowexec.fusion.prestart_compile_workers()
    assert compile_workers._prestarted == []
