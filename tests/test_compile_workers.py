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


def test_how_many_workers_compile_the_cold_regions(monkeypatch):
    """auto: workers only for a CUDA program with at least MIN_COLD cold regions (MIN_COLD_STARTED
    where workers were started before the capture) on a host of 8 CPUs or more, a quarter of
    its CPUs, at most 8; a number is taken as asked (never more workers than regions)."""
    rows = [  # cold, cuda, cpus, setting -> workers
        (0, True, 16, "auto", 0),
        (7, True, 16, "auto", 0),
        (8, True, 16, "auto", 4),
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
    monkeypatch.setattr(compile_workers, "_prestarted", [object()])  # (one started before the capture)
    assert [processes_for(c, True, 16) for c in (1, 2, 3)] == [0, 2, 3]


def test_local_ranks_share_the_cpus_this_process_may_run_on(monkeypatch):
    """The CPUs are this process's (its affinity), divided among torchrun's local ranks and
    pytest-xdist's workers."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    for name in ("LOCAL_WORLD_SIZE", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert compile_workers.host_cpus() == 64
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert compile_workers.host_cpus() == 8
    assert processes_for(23, True) == 2  # (8 CPUs: a quarter of them)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert compile_workers.host_cpus() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert compile_workers.host_cpus() == 1


def test_workers_by_default_only_for_a_cuda_program_on_a_large_host(monkeypatch):
    """``auto`` unset: workers for a CUDA program with enough cold regions on a host of 8 CPUs
    or more (their share: a quarter), none on the CPU or a small host; ``0`` turns them off."""
    monkeypatch.delenv("FLOWEXEC_COMPILE_PROCESSES", raising=False)
    monkeypatch.setattr(compile_workers, "_disabled", [])
    assert compile_workers.setting() == "auto"
    assert processes_for(23, True, cpus=16, setting=compile_workers.setting()) == 4
    assert processes_for(23, False, cpus=16, setting=compile_workers.setting()) == 0
    assert processes_for(23, True, cpus=4, setting=compile_workers.setting()) == 0
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "0")
    assert processes_for(23, True, cpus=16, setting=compile_workers.setting()) == 0


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


def _graph_from_program(prog, region):
    """A region's FX graph built straight from the program's ops (region_graph's construction
    before recipes), to hold the recipe's graph to."""
    import operator

    from flowexec.program import Ref

    g = torch.fx.Graph()
    env = {v: g.placeholder(f"x{k}") for k, v in enumerate(region.inputs)}

    def arg(a):
        if isinstance(a, Ref):
            return env[a.id] if a.id in env else prog.consts[a.id]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a

    for i in region.ops:
        op = prog.ops[i]
        node = g.call_function(op.target, tuple(arg(a) for a in op.args), {k: arg(v) for k, v in op.kwargs})
        if op.unpack:
            for j, o in enumerate(op.outputs):
                if o >= 0:
                    env[o] = g.call_function(operator.getitem, (node, j))
        elif op.outputs and op.outputs[0] >= 0:
            env[op.outputs[0]] = node
    g.output(tuple(env[o] for o in region.computed))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_recipe_pickles_and_builds_the_region_s_graph():
    """The recipe survives pickling and builds the graph the program's ops make, ops that take
    no tensor included (an FX module's own pickling would bake them in as constants)."""
    from flowexec.models import Block, lm_loss, make_step

    prog = capture(_zero_input_ops, (torch.randn(4, 8),)).program
    m = Block()
    step = make_step(m, torch.optim.AdamW(m.parameters(), foreach=True), lm_loss)
    x = torch.randint(0, 50, (2, 16))
    step(x, x)  # (the optimizer's state made: the capture is a step's after it)
    train = capture(step, (x, x)).program
    cases = [(prog, r) for r in find_regions(prog)] + [(train, r) for r in find_regions(train)]
    assert len(cases) >= 5
    for p, r in cases:
        recipe = recipe_of(p, r)
        again = pickle.loads(pickle.dumps(recipe))
        assert isinstance(again, GraphRecipe) and again == recipe
        gm = graph_of(again)
        assert gm.code == _graph_from_program(p, r).code
        assert not [n for n in gm.graph.nodes if n.op == "get_attr"]  # no tensor constant
    gm = region_graph(prog, find_regions(prog)[0])
    assert "arange" in gm.code and "zeros" in gm.code


def _fresh_cache(monkeypatch, path) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
    monkeypatch.setattr(verdict_cache, "_shared", {})


def _regions_writing_an_input(x, w):
    # a region that computes and writes the caller's tensor in place (an optimizer's kind), and
    # one after a matrix product: the worker compiles both as this process would
    h = (x.sin() * 2).relu()
    w.mul_(0.5).add_(h.mean(0).tanh())
    return (h @ w).exp().sum()


def test_regions_compiled_by_a_worker_are_loaded_from_the_cache_here(tmp_path, monkeypatch):
    """A build with a worker: the worker compiles each cold region, this process then finds
    every one in the cache (Inductor's AOT cache hits, no miss: its keys are this process's),
    ``explain()`` says so, a second look finds none cold (their output checks are kept), and
    the fused program equals eager, the input it writes included."""
    from torch._dynamo.utils import counters

    _fresh_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "1")
    monkeypatch.setattr(compile_workers, "THIS_PROCESS_COMPILES", False)  # (the worker takes every job)
    comp = InductorCompiler()
    monkeypatch.setattr(flowexec.fusion, "_compiler", comp)
    x, w = torch.randn(4, 8), torch.randn(8)
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


def _four_regions(x, w):
    # four regions between matrix products, none equal to another (each its own job), the last
    # the longest (the queue's first)
    h = (x.sin() * 2).relu() @ w
    h = (h.cos() + 1).tanh() @ w
    h = (h.exp() - 1).abs() @ w
    return ((h.sigmoid() * 3 + 1).square() - h).sum()


def test_this_process_compiles_cold_regions_beside_its_workers(tmp_path, monkeypatch):
    """While its worker starts (a fresh interpreter importing torch: seconds), this process takes
    jobs from the same queue and compiles them itself rather than wait: the first job at least
    is its own. Every region is compiled once, by one or the other: those the worker compiled
    are loaded from Inductor's cache here, this process's are its own kernels (no second
    compile, no cache load), the counts say which is which, and the program equals eager."""
    from torch._dynamo.utils import counters

    _fresh_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "1")
    assert compile_workers.THIS_PROCESS_COMPILES
    comp = InductorCompiler()
    monkeypatch.setattr(flowexec.fusion, "_compiler", comp)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    prog = capture(_four_regions, (x, w)).program
    regions = find_regions(prog)
    n = len(regions)
    assert n == 4 and len(cold_jobs(prog, regions, comp)) == n
    counters.clear()
    exe = flowexec.compile(_four_regions, mode="trace", fuse="inductor")
    for _ in range(2):
        torch.testing.assert_close(exe(x, w), _four_regions(x, w), rtol=1e-5, atol=1e-5)  # (a fused sum's order)
    assert comp.worker_jobs_here >= 1 and comp.worker_jobs + comp.worker_jobs_here == n
    assert not comp.worker_failures and comp.worker_misses == 0
    aot = dict(counters["aot_autograd"])
    # (a worker's region: a hit here; this process's own: one miss, compiled once, never loaded)
    assert aot.get("autograd_cache_hit", 0) == comp.worker_jobs, aot
    assert aot.get("autograd_cache_miss", 0) == comp.worker_jobs_here, aot
    assert exe.plan.stats()["fused_regions"] == n and len(comp.kernels) == n
    assert cold_jobs(prog, regions, InductorCompiler()) == []  # (all checked and kept)
    # named in the program's order, as a build without workers names them (the queue's is
    # longest first, and which side takes a job is a race)
    assert [r.name for r in exe.plan.fusion.regions] == [f"fused_{k}" for k in range(n)]
    assert all(k.named for k in comp.kernels.values())
    head = exe.explain().splitlines()[0]
    assert exe.plan.fusion.worker_jobs_here == comp.worker_jobs_here
    assert (f", {comp.worker_jobs_here} here beside them)" in head) == (comp.worker_jobs > 0), head


def test_where_no_worker_starts_this_process_s_kernels_stand(tmp_path, monkeypatch):
    """Every worker fails to start (as where this process registered a lowering of its own):
    the jobs this process compiled meanwhile are kept and not compiled again, the workers are
    turned off with the reason, and the program equals eager."""
    from flowexec.compile_workers import pipe

    _fresh_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "1")
    monkeypatch.setattr(compile_workers, "_disabled", [])

    def refuse(self, settings, threads, timeout):
        raise RuntimeError("refused to start, as a test asks")
    monkeypatch.setattr(pipe.Worker, "start", refuse)
    comp = InductorCompiler()
    monkeypatch.setattr(flowexec.fusion, "_compiler", comp)
    compiled: list[str] = []
    real = inductor.inductor_compile
    monkeypatch.setattr(inductor, "inductor_compile", lambda gm, metas: compiled.append(gm.code) or real(gm, metas))
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    exe = flowexec.compile(_four_regions, mode="trace", fuse="inductor")
    with pytest.warns(UserWarning, match="compile workers turned off .*refused to start, as a test asks"):
        got = exe(x, w)
    torch.testing.assert_close(got, _four_regions(x, w), rtol=1e-5, atol=1e-5)
    assert len(compiled) == 4 and comp.worker_jobs_here >= 1 and comp.worker_jobs == 0
    assert [r.name for r in exe.plan.fusion.regions] == [f"fused_{k}" for k in range(4)]


def test_a_worker_still_starting_when_this_process_took_every_job_is_stopped_not_failed(tmp_path, monkeypatch):
    """This process takes the only job at once, while the worker still imports torch: the
    worker is stopped rather than waited for, and that is no failed start (no reason, nothing
    raised, nothing left to compile)."""
    _fresh_cache(monkeypatch, tmp_path)
    prog = capture(lambda x: (x.sin() * 2).relu(), (torch.randn(4),)).program
    (r,) = find_regions(prog)
    job = Job("mine", recipe_of(prog, r), tuple(prog.values[v].meta for v in r.inputs), 0)
    taken: list[str] = []
    started: list = []
    real = compile_workers.Worker

    class Seen(real):
        def __init__(self):
            super().__init__()
            started.append(self)
    monkeypatch.setattr(compile_workers, "Worker", Seen)
    assert compile_in_processes([job], 1, here=lambda j: taken.append(j.key)) == {}
    assert taken == ["mine"] and len(started) == 1
    w = started[0]
    assert not w.ready  # (stopped while it started: it never said ready)
    assert not w.why and not w.taken and (w.proc is None or w.proc.poll() is not None)


def test_a_region_a_worker_refuses_is_left_to_this_process_with_why(tmp_path, monkeypatch):
    """A job the worker cannot compile (an unknown op) comes back with the reason; a worker
    that dies mid-job (the op exits the process) fails that job, and nothing waits on it. What
    a worker prints where it starts (here a sitecustomize) does not reach its answers. Workers
    started before the capture (a cold cache's, so that their start overlaps it) are the ones
    the jobs go to; those no build takes stop when the build ends."""
    _fresh_cache(monkeypatch, tmp_path)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text("print('hi from a sitecustomize')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    compile_workers.prestart(2)
    started = list(compile_workers._prestarted)
    assert len(started) == 2 and all(w.proc.poll() is None for w in started)
    metas = (capture(lambda x: x.sin(), (torch.randn(4),)).program.values[0].meta,)
    no_such_op = ("aten.no_such_op.default", (inductor.Local(0),), (), (1,), False)
    unknown = Job("unknown", GraphRecipe(1, (no_such_op,), (1,)), metas)
    dies = Job("dies", GraphRecipe(1, ((os._exit, (3,), (), (1,), False),), (1,)), metas)
    failed = compile_in_processes([unknown, dies], 1)
    assert set(failed) == {"unknown", "dies"}, failed
    assert "no_such_op" in failed["unknown"] and failed["dies"].startswith("worker exited"), failed
    assert started[0].proc.poll() is not None and compile_workers._prestarted == [started[1]]
    flowexec.fusion.release_compile_workers()
    assert compile_workers._prestarted == [] and started[1].proc.wait(10) is not None


def test_workers_are_prestarted_only_for_a_cache_no_build_has_filled(tmp_path, monkeypatch):
    asked: list[int] = []
    monkeypatch.setattr(compile_workers, "prestart", asked.append)
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "1")
    _fresh_cache(monkeypatch, tmp_path / "cold")
    flowexec.fusion.prestart_compile_workers()
    assert asked == [1]
    _fresh_cache(monkeypatch, tmp_path / "warm")
    inductor.output_checks().put("a region", True)
    flowexec.fusion.prestart_compile_workers()
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "0")
    _fresh_cache(monkeypatch, tmp_path / "cold2")
    flowexec.fusion.prestart_compile_workers()
    assert asked == [1]


def test_registrations_differ_only_where_a_function_is_not_torch_s():
    """Inductor adds registrations of its own as it goes (an implicit fallback, a lowering a
    module registers on import; hundreds are partials): one that only one of two processes has
    is no difference (its own cache shares kernels so). A function of a user's on either side
    is, and so is an op both register with different functions (a user's make_fallback)."""
    import functools

    from flowexec.compile_workers.settings import _name, registrations, registrations_differ

    mine = registrations()
    # (partials named by what they wrap; torch 2.11 registers operator.add and its kind themselves)
    assert all(name.startswith(("torch.", "_operator.")) for name in mine.values())
    theirs = dict(mine, **{"lower aten.made_up.default": "torch._inductor.lowering.fallback_handler",
                           "decomp aten.made_up.default": _name(functools.partial(torch._refs.sinh))})
    assert registrations_differ(theirs, mine) is None

    def my_sinh(x):
        return x
    assert "my_sinh (here torch." in registrations_differ(dict(mine, **{"lower aten.sinh.default": _name(my_sinh)}), mine)
    assert "none there" in registrations_differ(mine, dict(mine, **{"lower aten.made_up.default": _name(my_sinh)}))
    # (a make_fallback of an op torch lowers: torch's functions on both sides, but not the same)
    fallback = dict(mine, **{"lower aten.sinh.default": "torch._inductor.lowering.fallback_handler"})
    assert "aten.sinh.default" in registrations_differ(fallback, mine)


def test_workers_refuse_jobs_where_this_process_registered_its_own_lowering(tmp_path, monkeypatch):
    """No cache key reads Inductor's registered lowerings: a worker whose lowerings differ from
    this process's would build a kernel this process would not. It refuses to start, so no job
    is compiled there (a fusion pass then turns the workers off and compiles them here)."""
    from torch._inductor import lowering

    _fresh_cache(monkeypatch, tmp_path)
    aten = torch.ops.aten
    stock = lowering.lowerings[aten.sinh.default]

    def my_sinh(x):  # (this process's own, as a user's register_lowering would be)
        return stock(x)
    monkeypatch.setitem(lowering.lowerings, aten.sinh.default, my_sinh)
    prog = capture(lambda x: (x.sinh() * 2).relu(), (torch.randn(4),)).program
    (r,) = find_regions(prog)
    job = Job("mine", recipe_of(prog, r), tuple(prog.values[v].meta for v in r.inputs))
    with pytest.raises(RuntimeError, match="lowerings"):  # (no worker started: a fusion pass turns them off)
        compile_in_processes([job], 1)


def test_regions_that_miss_the_cache_after_workers_turn_the_workers_off(tmp_path, monkeypatch):
    """Where a region the workers compiled is not found in the cache here (a setting not
    mirrored makes its key differ), the workers only cost time: they are turned off for the
    process, with a warning that says why."""
    _fresh_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(compile_workers, "_disabled", [])
    monkeypatch.setenv("FLOWEXEC_COMPILE_PROCESSES", "0")
    comp = InductorCompiler()
    monkeypatch.setattr(flowexec.fusion, "_compiler", comp)
    fn = lambda x: (x.cos() * 3).relu()  # noqa: E731
    prog = capture(fn, (torch.randn(4),)).program
    comp.worker_sent.update(inductor.region_key(prog, r) for r in find_regions(prog))  # (as if sent)
    exe = flowexec.compile(fn, mode="trace", fuse="inductor")
    with pytest.warns(UserWarning, match="compile workers turned off .* 1 regions they compiled were not found"):
        exe(torch.randn(4))
    assert comp.worker_misses == 1 and compile_workers._disabled
    # (said where a user looks, and where scale.py records it)
    assert "compile workers turned off: 1 regions they compiled" in exe.explain().splitlines()[0]
    assert compile_workers.off_reason().startswith("1 regions they compiled")
    assert processes_for(23, True, cpus=16, setting="2") == 0
