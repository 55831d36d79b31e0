"""Fused instructions compiled by Inductor (C++ on the CPU): regions, programs and runs against eager."""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings

import flowexec
from flowexec import inductor
from flowexec.capture import capture
from flowexec.errors import OptionError
from flowexec.models import Block, lm_loss, make_mlp, make_step
import flowexec.passes.fuse
from flowexec.passes import regions
from flowexec.passes.regions import edges, find_regions, order_with_regions
from flowexec.pipeline.compiled import CompiledRunner
from helpers import assert_close_rel, assert_same_state, assert_stage_jobs_match_eager, sgd_losses
from test_verify import program_of, recipes


def names(prog, region):
    return " ".join(prog.ops[i].name.split(".")[1] for i in region.ops)


def test_regions_of_a_small_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prog = capture(make_step(model, opt, F.cross_entropy), (torch.randn(4, 8), torch.randint(0, 4, (4,)))).program
    got = [names(prog, r) for r in find_regions(prog)]
    # Library ops (addmm, mm) cut the regions and views ride along; each region writes its
    # gradient into .grad (add_); the optimizer's one add_ per parameter stays an ATen op.
    assert got == [
        "native_layer_norm gelu detach",
        "_log_softmax nll_loss_forward ones_like detach nll_loss_backward detach _log_softmax_backward_data sum view "
        "detach add_",
        "gelu_backward detach detach detach native_layer_norm_backward detach detach t sum view detach add_",
    ]


@settings(max_examples=80, deadline=None)
@given(recipe=recipes())
def test_regions_are_convex_and_their_order_keeps_every_dependency(recipe):
    _, prog = program_of(recipe)
    regions = find_regions(prog, min_ops=1)
    deps = edges(prog)
    succ = {i: set() for i in range(len(prog.ops))}
    for i, d in enumerate(deps):
        for p in d:
            succ[p].add(i)
    for r in regions:
        inside = set(r.ops)
        # No path leaves the region and comes back: walk from every outside successor.
        stack = [s for i in r.ops for s in succ[i] if s not in inside]
        seen = set()
        while stack:
            j = stack.pop()
            assert j not in inside, f"region {r.ops} is not convex"
            if j not in seen:
                seen.add(j)
                stack.extend(succ[j])
    order = [i for step in order_with_regions(prog, regions) for i in step]
    pos = {i: k for k, i in enumerate(order)}
    assert sorted(order) == list(range(len(prog.ops)))
    assert all(pos[p] < pos[i] for i, d in enumerate(deps) for p in d)


def mlp_twins(momentum=0.9):
    torch.manual_seed(0)
    m1 = make_mlp(32, 3, 5)
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=momentum)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=momentum)
    s1, s2 = make_step(m1, o1, F.cross_entropy), make_step(m2, o2, F.cross_entropy)
    data = [(torch.randn(16, 32), torch.randint(0, 5, (16,))) for _ in range(4)]
    s1(*data[0]), s2(*data[0])  # momentum buffers exist before capture
    return m1, m2, s1, s2, data


@pytest.mark.parametrize("opts", [{}, {"mode": "threaded", "streams": 2}, {"streams": 2},
                                  {"memory": "planned"}, {"gc": "async"}],
                         ids=["trace", "threaded", "cpu-streams", "planned", "async-gc"])
def test_fused_mlp_step_equals_eager(opts):
    m1, m2, s1, s2, data = mlp_twins()
    exe = flowexec.compile(s2, *data[0], fuse="inductor", **opts)
    st = exe.plan.stats()
    assert st["fused_regions"] >= 3 and st["fusion_fallbacks"] == 0
    if exe.plan.n_streams > 1:
        assert flowexec.verify_plan(exe.program, exe.plan) == []
    for x, y in data:
        assert_close_rel(exe(x, y), s1(x, y), 1e-5, "loss")
    assert_same_state(m1, m2, 1e-5)


def test_fused_transformer_block_adam_equals_eager():
    torch.manual_seed(0)
    m1 = Block()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.Adam(m1.parameters(), lr=1e-3, foreach=True)
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-3, foreach=True)
    s1, s2 = make_step(m1, o1, lm_loss), make_step(m2, o2, lm_loss)
    data = [(torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))) for _ in range(3)]
    s1(*data[0]), s2(*data[0])
    exe = flowexec.compile(s2, *data[0], fuse="inductor")
    assert exe.plan.stats()["fused_regions"] >= 5
    for x, y in data:
        assert_close_rel(exe(x, y), s1(x, y), 1e-5, "loss")
    assert_same_state(m1, m2, 1e-5)


def test_equal_regions_share_one_kernel_and_explain_lists_them():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Tanh())
                                   for _ in range(4)])
    x = torch.randn(4, 8)
    exe = flowexec.compile(lambda x: layers(x) * 2, x, fuse="inductor")
    st = exe.plan.stats()
    assert st["fused_regions"] == 4 and st["fused_kernels"] == 2, st  # the last block's region also has the * 2
    # The build's time, by phase: the compiler's share is the fusion report's (the regions
    # compiled here), and the phases add up to the whole build.
    phases = exe.build_phases
    assert sorted(phases) == ["capture", "fuse_compile", "lower", "plan", "runner"]
    assert phases["fuse_compile"] == exe.plan.fusion.compile_seconds > 0 and min(phases.values()) >= 0
    assert abs(sum(phases.values()) - exe.build_seconds) < 0.05 * exe.build_seconds
    assert exe.build_peaks == {"capture": None, "plan": None, "runner": None}  # no CUDA here
    text = exe.explain()
    assert text.splitlines()[0].startswith("4 fused regions (2 kernels") and text.count("shared") == 2
    assert "native_layer_norm, tanh" in text  # the program text names what a fused op runs
    with torch.no_grad():
        torch.testing.assert_close(exe(x), layers(x) * 2)


def test_refused_regions_are_split_on_facts_computed_once_per_program(monkeypatch):
    """Every refused region is split in two and tried again; the splits read the program's
    alias groups and readers, computed once per program (they were computed again for each
    split: 5.9 s of a CPU GPT-2 build with 108 splits)."""
    from flowexec.passes import fuse as fuse_pass
    from flowexec.passes.regions import _Facts

    computed = []
    real = _Facts.compute
    monkeypatch.setattr(_Facts, "compute", staticmethod(lambda prog: computed.append(prog) or real(prog)))
    prog = capture(lambda x: ((x.sin() * 2).relu().cos() + 1).exp().sum(), (torch.randn(16),)).program
    _, report = fuse_pass.fuse_program(prog, lambda p, r: "refused (test)")  # refuses every half too
    assert len(report.regions) >= 3 and all(not r.fused for r in report.regions)  # split down to the smallest
    assert computed == [prog]
    other = capture(lambda x: (x.sin() * 2).relu().sum(), (torch.randn(4),)).program
    fuse_pass.fuse_program(other, lambda p, r: None)
    assert computed == [prog, other]  # (a new program's own)


def test_a_region_inductor_refuses_keeps_its_aten_ops_and_says_why(monkeypatch):
    real = inductor.compile_graph

    def refuse_norms(gm, metas, want=(), key=None):
        if any("layer_norm" in str(n.target) for n in gm.graph.nodes):
            raise NotImplementedError("no kernel for this region (test)")
        return real(gm, metas, want, key)

    monkeypatch.setattr(inductor, "compile_graph", refuse_norms)
    monkeypatch.setattr(flowexec.fusion, "_compiler", None)  # a compiler of this test's own
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    exe = flowexec.compile(lambda x: (net(x).relu() * 2).sum(), x, fuse="inductor")
    st = exe.plan.stats()
    assert st["fusion_fallbacks"] == 1 and st["fused_regions"] == 1
    assert "fallback: NotImplementedError: no kernel for this region (test)" in exe.explain()
    assert "aten.native_layer_norm" in str(exe.program)
    with torch.no_grad():
        torch.testing.assert_close(exe(x), (net(x).relu() * 2).sum())


def test_debug_flag_checks_a_kernel_against_its_aten_ops(monkeypatch):
    real = inductor.compile_graph

    def wrong(gm, metas, want=(), key=None):
        fn = real(gm, metas)  # (no output check: the wrong values must reach the first-call check)
        return lambda *a: [o + 1 for o in fn(*a)]  # a miscompiled kernel

    monkeypatch.setattr(inductor, "compile_graph", wrong)
    monkeypatch.setattr(flowexec.fusion, "_compiler", None)
    monkeypatch.setenv("FLOWEXEC_DEBUG", "1")
    x = torch.randn(16)
    exe = flowexec.compile(lambda x: (x.sin() * 3).exp() - 1, x, fuse="inductor")
    torch.testing.assert_close(exe(x), (x.sin() * 3).exp() - 1)  # the first call is checked: ATen's answer
    torch.testing.assert_close(exe(x), (x.sin() * 3).exp() - 1)  # and the ATen ops run from then on
    assert "fallback: miscompiled (output 0: max difference 1" in exe.explain()


def test_bad_fuse_and_pad_values_name_the_choices():
    with pytest.raises(OptionError, match="'inductor'.*False.*None"):
        flowexec.compile(lambda x: x + 1, torch.ones(2), fuse="triton")
    with pytest.raises(OptionError, match="None.*True.*False"):
        flowexec.compile(lambda x: x + 1, torch.ones(2), pad="yes")
    with pytest.raises(Exception, match="fusion choice"):  # Dynamo wraps it in BackendCompilerFailed
        torch.compile(torch.nn.Linear(2, 2), backend="flowexec", options={"fuse": 1})(torch.ones(2))


def test_fusion_is_off_on_the_cpu_by_default_and_on_for_cuda_graph_mode_only():
    from flowexec.fusion import wants_fusion

    exe = flowexec.compile(lambda x: (x.sin() * 2).relu(), torch.randn(8))
    assert "fused_regions" not in exe.plan.stats()
    assert exe.explain().startswith("no fusion")
    with torch._subclasses.fake_tensor.FakeTensorMode():  # a CUDA program's metadata, on any machine
        cuda = capture(lambda x: (x.sin() * 2).relu(), (torch.empty(8, device="cuda"),)).program
    assert [wants_fusion(cuda, None, m) for m in ("graph", "trace", "threaded")] == [True, False, False]
    assert wants_fusion(exe.program, "inductor", "trace") and not wants_fusion(cuda, False, "graph")


def test_backend_with_fusion_gives_eager_gradients():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    net2 = copy.deepcopy(net)
    fast = torch.compile(net2, backend="flowexec", options={"fuse": "inductor"})
    for _ in range(2):
        x = torch.randn(4, 8)
        net(x).square().mean().backward()
        fast(x).square().mean().backward()
    assert_same_state(net, net2, 1e-5)


def test_fused_pipeline_stage_jobs_give_eager_gradients():
    torch.manual_seed(0)
    stage = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.GELU(), torch.nn.Linear(12, 6))
    ref = copy.deepcopy(stage)
    xs = [(torch.randn(4, 6),) for _ in range(2)]
    gs = [(torch.randn(4, 6),) for _ in range(2)]
    runner = CompiledRunner(stage, example_inputs=xs[0], fuse="inductor")
    assert all(p.fusion is not None for p in runner.plans.values())
    assert runner.plans["F"].stats()["fused_regions"] >= 1 and runner.plans["I"].stats()["fused_regions"] >= 1
    assert_stage_jobs_match_eager(runner, stage, ref, "F0 F1 I1 I0 W0 W1", xs, gs)


def test_pad_true_aligns_products_keeps_answers_and_output_strides_and_pads_a_gradient_once():
    torch.manual_seed(0)
    w = torch.randn(50, 12)

    def f(x, g):
        y = (x @ w.t()).view(2, 3, 50).sum()  # N = 50 padded: the row view still fits the padded rows
        z = F.linear(x, w, torch.ones(50))  # an output: N stays 50, so it keeps eager's strides
        gx = g @ w  # K = 50 padded on both operands
        gw = g.t() @ x  # M = 50: g padded once, shared with gx through the transpose
        return y, z, gx, gw

    x, g = torch.randn(6, 12), torch.randn(6, 50)
    exe = flowexec.compile(f, x, g, pad=True, fuse=False)
    prog = exe.program
    shapes = [[prog.values[r].meta.shape for r in op.refs()] for op in prog.ops
              if op.name in ("aten.mm.default", "aten.addmm.default")]
    assert shapes == [[(8, 12), (12, 52)], [(50,), (8, 12), (12, 50)], [(8, 52), (52, 12)], [(52, 8), (8, 12)]]
    pads_of_g = [op for op in prog.ops if op.name == "aten.constant_pad_nd.default" and op.args[0].id == prog.inputs[1]]
    assert len(pads_of_g) == 1
    got, want = exe(x, g), f(x, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
        assert a.stride() == b.stride()
    assert "constant_pad_nd" not in str(flowexec.compile(f, x, g).program)  # on the CPU nothing is padded by default


def test_a_detached_alias_of_a_padded_operand_shares_its_pad():
    """The backward reads autocast's copy of a weight through ``detach(t(w16))``: padded as
    ``t(w16)`` is, so the forward's product and the backward's share one padded copy of it (and
    ``g``, misaligned in K for both, one of its own)."""
    w = torch.randn(12, 50)

    def f(g):
        w16 = w * 2  # (an intermediate, as autocast's cast is)
        return g @ w16.t(), g @ w16.t().detach()

    g = torch.randn(8, 50)
    exe = flowexec.compile(f, g, pad=True, fuse=False)
    pads = [op for op in exe.program.ops if op.name == "aten.constant_pad_nd.default"]
    assert len(pads) == 2, exe.program
    for a, b in zip(exe(g), f(g)):
        torch.testing.assert_close(a, b)


def test_a_padding_case_is_timed_with_its_operands_layout():
    """A weight gradient's ``t(g) @ x`` has the vocabulary as its first operand's leading
    dimension, which a row-major stand-in of the same sizes would not (an aligned 8,192 on
    GPT-2's head, where the program's product ran cuBLAS's slow misaligned kernel and the
    verdict said padding did not pay): the case records each operand's layout, and the timed
    operands, plain and padded, are laid out as the program's."""
    from flowexec import fusion
    from flowexec.passes.pad import pad_cases

    w = torch.randn(50, 12)
    x, g = torch.randn(6, 12), torch.randn(6, 50)
    prog = flowexec.compile(lambda x, g: (g @ w, g.t() @ x, x @ w.t()), x, g, pad=False, fuse=False).program
    layouts = {}
    for i, case in pad_cases(prog):
        a, b = (prog.values[r].meta for r in prog.ops[i].refs())
        ta, tb = fusion._operands(case)
        assert (ta.shape, ta.stride(), tb.shape, tb.stride()) == (a.shape, a.stride, b.shape, b.stride)
        layouts[(case.m, case.k, case.n)] = (case.a_t, case.b_t)
        pa = fusion._padded(ta, case.padded[0], case.padded[1], case.a_t)
        assert pa.shape == case.padded[:2] and (pa.stride() == (1, case.padded[0])) == case.a_t
        torch.testing.assert_close(pa[:case.m, :case.k], ta)
    assert layouts == {(6, 50, 12): (False, False), (50, 6, 12): (True, False), (6, 12, 50): (False, True)}
    assert "A^T" in fusion.pad_key(next(c for _, c in pad_cases(prog) if c.a_t))


def test_metas_after_padding_rerun_only_what_the_rewrite_changed():
    """After padding a language model's head, propagate_metas re-derives what running every op
    on fake tensors gives, and an op whose inputs kept their metas is not run again: a stride
    planted on an unrelated value stays, where running everything corrects it."""
    from flowexec.passes.metas import propagate_metas
    from flowexec.passes.pad import _rewrite, pad_cases

    torch.manual_seed(0)
    model = Block(vocab=50, dim=32, heads=4, seq=16)
    step = make_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), lm_loss)
    ids = torch.randint(0, 50, (3, 16))
    step(ids, ids)  # the optimizer's state
    prog = flowexec.compile(step, ids, ids, pad=False, fuse=False).program
    cases = dict(pad_cases(prog))
    assert cases  # the vocabulary of 50 is misaligned
    rewritten, _ = _rewrite(prog, cases, set())
    every = propagate_metas(rewritten, everything=True)
    assert [v.meta for v in propagate_metas(rewritten).values] == [v.meta for v in every.values]
    first = next(op for op in prog.ops if op.outputs[0] >= 0 and prog.values[op.outputs[0]].meta is not None
                 and len(prog.values[op.outputs[0]].meta.shape) == 2)
    vid = first.outputs[0]
    meta = prog.values[vid].meta
    planted = dataclasses.replace(meta, stride=(1, meta.shape[0]))  # not what the op makes
    values = list(rewritten.values)
    values[vid] = dataclasses.replace(values[vid], meta=planted)
    wrong = dataclasses.replace(rewritten, values=tuple(values))
    assert propagate_metas(wrong).values[vid].meta == planted
    assert propagate_metas(wrong, everything=True).values[vid].meta == meta


def test_fused_convnet_with_batch_norm_updates_running_stats_as_eager():
    from flowexec.models import ConvNet

    torch.manual_seed(0)
    m1 = ConvNet()
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
    s1, s2 = make_step(m1, o1, F.cross_entropy), make_step(m2, o2, F.cross_entropy)
    data = [(torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))) for _ in range(3)]
    s1(*data[0]), s2(*data[0])
    exe = flowexec.compile(s2, *data[0], fuse="inductor")
    fused = [r for r in exe.plan.fusion.regions if r.fused]
    assert any("aten.native_batch_norm.default" in r.ops for r in fused)  # the forward norm is in a kernel
    assert any("aten.native_batch_norm_backward.default" in r.ops for r in fused)
    for x, y in data:
        assert_close_rel(exe(x, y), s1(x, y), 1e-5, "loss")
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert_close_rel(b, a, 1e-5, n)  # a conv bias before a norm has a gradient of ~1e-8 noise: compare weights
    for (n, a), b in zip(m1.named_buffers(), m2.buffers()):
        assert_close_rel(b, a, 1e-5, n)  # running mean and variance, batch counts


def _norm_blocks() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.GELU())
                                 for _ in range(4)])


def _fused_pipeline(rank: int, world: int, schedule: str) -> dict:
    from flowexec.pipeline import PipelineTrainer, split

    torch.set_num_threads(1)
    trainer = PipelineTrainer(split(_norm_blocks(), 2), schedule=schedule, microbatches=4, loss_fn=F.mse_loss,
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), fuse="inductor", timeout=240)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    losses = [trainer.step(x, y) for _ in range(3)]
    return {"losses": [float(v) for v in losses if v is not None],
            "params": {s: [p.detach().clone() for p in trainer.modules[s].parameters()] for s in trainer.local},
            "fused": {s: {k: p.stats().get("fused_regions", 0) for k, p in r.plans.items()}
                      for s, r in trainer.runners.items()}}


@pytest.mark.timeout(300)
def test_a_pipeline_of_fused_i_w_split_stages_trains_as_one_process():
    from flowexec.pipeline import spawn

    res = spawn(_fused_pipeline, 2, "ZBH1", timeout=280)
    model = _norm_blocks()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    want_losses = sgd_losses(model, x, y, 3)
    fused = [per for r in res for per in r["fused"].values()]
    assert all(per["F"] and per["B"] and per["I"] + per["W"] for per in fused), fused  # each job's program fused
    got = {s: ps for r in res for s, ps in r["params"].items()}
    want = [list(model[:2].parameters()), list(model[2:].parameters())]
    for s in (0, 1):
        for a, b in zip(got[s], want[s], strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    assert res[1]["losses"] == pytest.approx(want_losses, rel=1e-5)


def _one_region(fn=lambda x: (torch.tanh(x) * 3).relu() + 1, shape=(4, 8)):
    prog = capture(fn, (torch.randn(*shape, dtype=torch.float32),)).program
    (r,) = find_regions(prog)
    return prog, r


def _built_as_a_new_process(prog, r, monkeypatch):
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})  # (as a new process reads them)
    metas = [prog.values[v].meta for v in r.inputs]
    want = [prog.values[v].meta for v in r.computed]
    return inductor.compile_graph(inductor.region_graph(prog, r), metas, want, key=inductor.region_key(prog, r))


def test_a_checked_region_loads_its_cache_entry_without_compile_fx(tmp_path, monkeypatch):
    """A region whose output check passed keeps the key of its entry in Inductor's cache; a later
    build (a new process: the kept verdicts read again) loads the entry by it without calling
    ``compile_fx``, and computes what eager does. An entry that is gone from the cache, or a
    key that names nothing, is compiled again as before."""
    import shutil

    from flowexec import inductor_entries

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    prog, r = _one_region()
    compiles: list[int] = []
    real = inductor.inductor_compile
    monkeypatch.setattr(inductor, "inductor_compile", lambda gm, m: compiles.append(1) or real(gm, m))

    def build():
        return _built_as_a_new_process(prog, r, monkeypatch)
    x = torch.randn(4, 8)
    expect = (torch.tanh(x) * 3).relu() + 1
    first = build()
    assert len(compiles) == 1 and len(inductor_entries.kept_entries()) == 1
    loaded = build()
    assert len(compiles) == 1, "the second build compiled: it should have loaded the kept entry"
    for k in (first, loaded):
        torch.testing.assert_close(k(x)[0], expect)
    shutil.rmtree(tmp_path / "cache" / "aotautograd")  # (the entry gone: compiled again, and kept anew)
    again = build()
    assert len(compiles) == 2
    torch.testing.assert_close(again(x)[0], expect)
    shutil.rmtree(tmp_path / "cache" / "fxgraph")  # (AOTAutograd's entry there, the kernel's gone)
    torch.testing.assert_close(build()(x)[0], expect)
    assert len(compiles) == 3
    name = next(iter(inductor_entries.kept_entries()._load()))
    inductor_entries.kept_entries().put(name, "a key that names no entry")
    assert inductor_entries.load_entry("a key that names no entry") is None
    torch.testing.assert_close(build()(x)[0], expect)
    assert len(compiles) == 4
    # (a custom pass in Inductor's configuration is a function its own keys hash and the kept
    # name cannot: every region compiles while one is set)
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: None):
        assert inductor_entries.entry_name("a check") is None
        torch.testing.assert_close(build()(x)[0], expect)
    assert len(compiles) == 5


def test_a_second_try_s_seconds_are_counted_once(monkeypatch):
    """A region Inductor refused is compiled again in another form, which counts its own
    seconds; the first try's count must not hold them too (a cold CPU GPT-2 build's ``plan``
    phase came out negative: ``fuse_compile`` had counted a second try twice)."""
    import time

    prog, r = _one_region()

    def refused(*args, **kwargs):
        raise TypeError("refused")

    def second_try(self, key, prog, region):
        t0 = time.perf_counter()
        time.sleep(0.2)
        self.seconds += time.perf_counter() - t0  # (as _compile_again counts its own)
        return None
    monkeypatch.setattr(inductor, "compile_graph", refused)
    monkeypatch.setattr(inductor.InductorCompiler, "with_forced_strides", second_try)
    comp = inductor.InductorCompiler()
    t0 = time.perf_counter()
    got = comp.prepare(prog, r)
    wall = time.perf_counter() - t0
    assert got == "TypeError: refused"
    assert comp.seconds <= wall, (comp.seconds, wall)


def test_a_cold_region_s_kernel_is_collected_without_an_error(tmp_path, monkeypatch):
    """A region compiled cold inside a block writes its cache entry at the block's end from a
    copy of Inductor's compiled graph; when the kernel and that copy are both collected, no
    ``CompiledFxGraph.__del__`` may fail (a copy sharing the module's runner deleted its
    partitions twice: an AttributeError traceback per cold region, at exit)."""
    import gc

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    errors: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: errors.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    prog, r = _one_region()
    comp = inductor.InductorCompiler()
    with comp.together():
        kernel = comp.compile(prog, r)
    x = torch.randn(4, 8)
    torch.testing.assert_close(kernel(x)[0], (torch.tanh(x) * 3).relu() + 1)
    del kernel, comp
    gc.collect()
    assert not errors, errors


def test_new_api_fp32_precision_does_not_refuse_every_region(tmp_path, monkeypatch):
    """torch's new precision API (``torch.backends.cuda.matmul.fp32_precision``, recommended
    since 2.9) makes ``torch.get_float32_matmul_precision()`` raise; entry_name reads it, so
    every region was refused (RuntimeError) though compile_fx compiles it fine."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    prog, r = _one_region()
    before = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        got = inductor.InductorCompiler().compile(prog, r)
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    assert isinstance(got, inductor.FusedKernel), got
    x = torch.randn(4, 8)
    torch.testing.assert_close(got(x)[0], (torch.tanh(x) * 3).relu() + 1)


@pytest.mark.skipif(not hasattr(torch._inductor.codecache.FxGraphHashDetails, "_may_generate_cpu_cpp_code"),
                    reason="this torch's FX graph key does not hash the default dtype (compile_fx loads the same)")
def test_a_region_built_under_another_default_dtype_is_not_loaded_from_the_first_build(tmp_path, monkeypatch):
    """A factory op without a dtype (aten.full) computes in torch's default dtype, which the region's
    key and metas do not show when a cast follows; Inductor's own key (torch 2.13) hashes the
    default dtype, so compile_fx compiles such a region again; the kept name must too, or a build
    under float64 loads the float32 kernel (16777219 rounds to 16777220: 4 where eager gives 3)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    f = lambda x: x + (torch.full((4, 8), 16777219.) - 16777216.).to(torch.int32)
    x = torch.zeros(4, 8)
    before = torch.get_default_dtype()
    try:
        got = {}
        for d in (torch.float32, torch.float64):
            torch.set_default_dtype(d)
            prog, r = _one_region(f)
            got[d] = (_built_as_a_new_process(prog, r, monkeypatch)(x)[0], f(x))
    finally:
        torch.set_default_dtype(before)
    for d, (kernel, eager) in got.items():
        assert torch.equal(kernel, eager), (d, kernel[0, 0].item(), eager[0, 0].item())


@pytest.mark.skipif(not hasattr(torch._inductor.codecache.FxGraphHashDetails, "_may_generate_cpu_cpp_code"),
                    reason="this torch's FX graph key does not hash the C++ kernels' thread count")
def test_a_region_built_with_another_thread_count_is_compiled_for_it(tmp_path, monkeypatch):
    """torch 2.13's FX graph key hashes the thread count a CPU kernel's C++ bakes in
    (``parallel_num_threads()`` while ``cpp.threads`` < 1): compile_fx compiles a region again
    after ``torch.set_num_threads``; a load by the kept name gave the kernel built for the old count."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    prog, r = _one_region(lambda x: (torch.tanh(x) * 3).relu().sum(0) + 1, (64, 4096))
    compiles = []
    real = inductor.inductor_compile
    monkeypatch.setattr(inductor, "inductor_compile", lambda gm, m: compiles.append(1) or real(gm, m))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _built_as_a_new_process(prog, r, monkeypatch)
        _built_as_a_new_process(prog, r, monkeypatch)  # (the same count: may load)
        before = len(compiles)
        torch.set_num_threads(1)
        _built_as_a_new_process(prog, r, monkeypatch)
    finally:
        torch.set_num_threads(threads)
    assert len(compiles) == before + 1, "a build with another thread count loaded the kernel compiled for 2 threads"


def test_region_kernels_go_through_inductors_cache():
    """A region's compile has a key in Inductor's FX graph cache (no bypass), so a second build
    of the same region (a later process: a warm cache) loads the kernel instead of generating it."""
    from torch._dynamo.utils import counters

    prog = capture(lambda x: (torch.tanh(x) * 3).relu() + 1, (torch.randn(4, 8),)).program
    (r,) = find_regions(prog)
    metas = [prog.values[v].meta for v in r.inputs]
    want = [prog.values[v].meta for v in r.computed]
    before = dict(counters["inductor"])
    kernels = [inductor.compile_graph(inductor.region_graph(prog, r), metas, want) for _ in range(2)]
    after = counters["inductor"]
    assert after["fxgraph_cache_bypass"] == before.get("fxgraph_cache_bypass", 0), dict(after)
    assert after["fxgraph_cache_hit"] > before.get("fxgraph_cache_hit", 0), dict(after)
    x = torch.randn(4, 8)
    for k in kernels:
        torch.testing.assert_close(k(x)[0], (torch.tanh(x) * 3).relu() + 1)


def test_a_padding_verdict_is_measured_once_and_kept_beside_inductor_s_cache(tmp_path, monkeypatch):
    """pad=None times a misaligned product once per case, device and versions: a new process
    (fresh in-memory caches) on the same Inductor cache directory reads the verdict from disk;
    another case, another directory or an unreadable file measures again, without an error."""
    from flowexec import fusion
    from flowexec.passes.pad import PadCase

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    case = PadCase("mm", 0, 8192, 768, 50257, torch.bfloat16, torch.device("cpu"), (8192, 768, 50264))
    other = PadCase("mm", 0, 8192, 50257, 768, torch.bfloat16, torch.device("cpu"), (8192, 50264, 768))
    timed = []

    def measure(verdict):
        return lambda: timed.append(verdict) or verdict

    assert fusion.kept_verdict(case, measure(True)) is True
    assert fusion.kept_verdict(other, measure(False)) is False
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})  # as a new process sees it
    assert fusion.kept_verdict(case, measure(False)) is True and fusion.kept_verdict(other, measure(True)) is False
    assert timed == [True, False]
    assert (tmp_path / "a" / "flowexec" / "pad_verdicts.json").exists()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "b"))  # a cold cache: measured again
    assert fusion.kept_verdict(case, measure(False)) is False and timed == [True, False, False]
    (tmp_path / "b" / "flowexec" / "pad_verdicts.json").write_text("{not json")
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    assert fusion.kept_verdict(case, measure(True)) is True and timed[-1] is True


def test_the_verdicts_directory_is_inductor_s_cache_directory_found_without_importing_it(monkeypatch, tmp_path):
    import os

    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from flowexec.verdict_cache import default_directory

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "c"))
    assert default_directory() == os.path.join(cache_dir(), "flowexec")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert default_directory() == os.path.join(default_cache_dir(), "flowexec")


def test_a_failed_verdict_write_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    import os

    from flowexec import verdict_cache

    cache = verdict_cache.VerdictCache("pad_verdicts", str(tmp_path))

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(verdict_cache.json, "dump", full_disk)
    cache.put("case", True)  # no error: kept in memory
    assert cache.get("case") is True and os.listdir(tmp_path) == []


def test_a_vector_instruction_probe_is_kept_until_its_library_changes(tmp_path, monkeypatch) -> None:
    """Inductor's probe of the CPU's vector instructions (a process that loads a small library)
    runs once per library: a new process on the same cache asks the kept verdict; a rebuilt
    library, another cache or a corrupt file probes again, and a failure is never kept."""
    import os

    from flowexec import inductor_keys as inductor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"\x7fELF one")
    probed: list[str] = []

    def probe(verdict):
        return lambda isa, path: probed.append(isa) or verdict

    assert inductor.kept_vec_isa_probe("avx2", str(lib), probe(False)) is False
    assert inductor.kept_vec_isa_probe("avx2", str(lib), probe(True)) is True  # (the failure was not kept)
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})  # as a new process sees it
    assert inductor.kept_vec_isa_probe("avx2", str(lib), probe(False)) is True and probed == ["avx2", "avx2"]
    assert inductor.kept_vec_isa_probe("avx512", str(lib), probe(False)) is False  # another instruction set
    lib.write_bytes(b"\x7fELF two, rebuilt")
    os.utime(lib, ns=(1, 1))
    assert inductor.kept_vec_isa_probe("avx2", str(lib), probe(False)) is False and len(probed) == 4
    assert inductor.kept_vec_isa_probe("avx2", str(tmp_path / "gone.so"), probe(False)) is False  # no key: probed
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "b"))  # a cold cache probes again
    (tmp_path / "b" / "flowexec").mkdir(parents=True)
    (tmp_path / "b" / "flowexec" / "vec_isa_probes.json").write_text("{not json")
    assert inductor.kept_vec_isa_probe("avx2", str(lib), probe(True)) is True and len(probed) == 6
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    assert inductor.kept_vec_isa_probe("avx2", str(lib), probe(False)) is True and len(probed) == 6


def test_inductor_s_vector_instruction_probe_goes_through_the_kept_verdicts(tmp_path, monkeypatch) -> None:
    """A CPU region's compile replaces Inductor's probe once; the replacement keeps a success."""
    from torch._inductor import cpu_vec_isa

    from flowexec import inductor_keys as inductor

    if "_probe_load" not in vars(cpu_vec_isa.VecISA):  # (keep_vec_isa_probes leaves such a torch alone)
        pytest.skip("this torch's Inductor probes vector instructions without VecISA._probe_load (torch 2.11)")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    monkeypatch.setattr(inductor, "_DONE", {})
    calls = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "_probe_load", lambda self, path: calls.append(path) or True)
    inductor.keep_vec_isa_probes()
    inductor.keep_vec_isa_probes()  # (once)
    lib = tmp_path / "probe.so"
    lib.write_bytes(b"\x7fELF")
    isa = cpu_vec_isa.VecAVX2()
    assert isa._probe_load(str(lib)) is True and isa._probe_load(str(lib)) is True and calls == [str(lib)]
    assert inductor.shared_cache("vec_isa_probes").path.startswith(str(tmp_path))


def test_torch_2_11_s_probe_processes_go_through_the_kept_verdicts(tmp_path, monkeypatch) -> None:
    """torch 2.11's ``check_build`` starts the probe's Python process itself (no ``_probe_load``):
    :func:`keep_vec_isa_probes` routes that module's ``subprocess.check_call`` so that a probe
    kept as loaded starts no process, a failed one raises as the process did and is not kept,
    and every other command is the real module's."""
    import subprocess
    import types

    from flowexec import inductor_keys as inductor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    monkeypatch.setattr(inductor, "_DONE", {})
    script = "\nfrom ctypes import cdll\ncdll.LoadLibrary(\"__lib_path__\")\n"
    started: list[list[str]] = []
    verdict = {"ok": False}

    def check_call(cmd, *args, **kwargs):
        started.append(cmd)
        if cmd[-1].startswith("\nfrom ctypes") and not verdict["ok"]:
            raise subprocess.CalledProcessError(1, cmd)
        return 0
    fake_subprocess = types.SimpleNamespace(check_call=check_call, CalledProcessError=subprocess.CalledProcessError,
                                            DEVNULL=subprocess.DEVNULL)
    isa_module = types.SimpleNamespace(VecISA=type("VecISA", (), {"_avx_py_load": script}), subprocess=fake_subprocess)
    monkeypatch.setitem(sys.modules, "torch._inductor.cpu_vec_isa", isa_module)
    monkeypatch.setattr(torch._inductor, "cpu_vec_isa", isa_module, raising=False)
    inductor.keep_vec_isa_probes()
    inductor.keep_vec_isa_probes()  # (once)
    routed = isa_module.subprocess
    assert routed is not fake_subprocess and inductor._DONE["probe"] is fake_subprocess
    lib = tmp_path / "avx2.so"
    lib.write_bytes(b"\x7fELF")
    probe = [sys.executable, "-c", script.replace("__lib_path__", str(lib))]
    assert routed.library_of(probe) == str(lib) and routed.library_of(["cc", "-c", "x.c"]) is None
    with pytest.raises(subprocess.CalledProcessError):  # (a failure raises, as the process's did)
        routed.check_call(probe, stderr=subprocess.DEVNULL)
    verdict["ok"] = True
    assert routed.check_call(probe) == 0 and routed.check_call(probe) == 0
    assert len(started) == 2  # (the failure was not kept; the success was)
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})  # as a new process sees it
    verdict["ok"] = False
    assert routed.check_call(probe) == 0 and len(started) == 2
    assert routed.check_call(["cc", "x.c"]) == 0 and started[-1] == ["cc", "x.c"]  # (not a probe: passed on)
    assert routed.DEVNULL == subprocess.DEVNULL


def test_inductor_s_code_keys_are_kept_under_the_stamp_of_the_files_they_hash(tmp_path, monkeypatch) -> None:
    """A code key (Inductor's hash of torch's or Triton's files, once a process) is handed to
    Inductor's cache of it in a later process while every file's path, size and time hold; a
    changed or added file, a symbolic link, a corrupt file or a kept value of another form
    computes it again, and nothing is an error."""
    import os

    prefetchable_cache = getattr(importlib.import_module("torch.utils._functools"), "prefetchable_cache", None)
    if prefetchable_cache is None:  # (torch 2.11: its torch_key has no cache to hand a kept key to)
        pytest.skip("this torch has no prefetchable_cache (torch 2.11)")

    from flowexec import inductor_keys

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    tree = tmp_path / "torch"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.py").write_text("a = 1")
    (tree / "sub" / "b.py").write_text("b = 2")
    computed: list[bytes] = []

    def process(value: bytes = b"\x01key"):
        """A new process: fresh in-memory caches and a fresh cache of the key."""
        monkeypatch.setattr("flowexec.verdict_cache._shared", {})
        key_fn = prefetchable_cache(lambda: computed.append(value) or value)
        code_key = inductor_keys.CodeKey("torch_key", key_fn, str(tree), key_fn.set)
        monkeypatch.setattr(inductor_keys, "_code_keys", lambda: [code_key])
        inductor_keys._keep_code_keys()
        return key_fn()

    assert process() == b"\x01key" and len(computed) == 1
    assert process(b"other") == b"\x01key" and len(computed) == 1  # kept: not computed
    (tree / "sub" / "b.py").write_text("b = 22")  # another size
    assert process(b"\x02new") == b"\x02new" and len(computed) == 2
    (tree / "sub" / "c.py").write_text("")  # a file more
    assert process(b"\x03") == b"\x03" and len(computed) == 3
    assert process(b"nope") == b"\x03" and len(computed) == 3
    (tree / "link.py").symlink_to(tree / "a.py")  # no stamp: computed by Inductor, nothing kept
    assert inductor_keys.tree_stamp(str(tree)) is None
    assert process(b"\x04") == b"\x04" and process(b"\x05") == b"\x05" and len(computed) == 5
    os.unlink(tree / "link.py")
    kept = tmp_path / "cache" / "flowexec" / "inductor_keys.json"
    kept.write_text("{not json")
    assert process(b"\x06") == b"\x06" and len(computed) == 6
    kept.write_text(kept.read_text().replace("bytes:", "other:"))  # a value of another form
    assert process(b"\x07") == b"\x07" and len(computed) == 7
    assert process(b"\x08") == b"\x07" and len(computed) == 7


def test_code_keys_where_torch_keeps_them_otherwise(tmp_path, monkeypatch) -> None:
    """torch 2.11's shape: no module-level ``triton_key`` in ``codecache`` (its ``get_system``
    calls the function ``triton_compat`` imported from Triton): Triton's key is kept all the
    same, handed over by rebinding the names Inductor and Triton call."""
    pytest.importorskip("triton")
    import triton.runtime.cache as triton_cache
    from torch._inductor import codecache
    from torch._inductor.runtime import triton_compat

    from flowexec import inductor_keys

    computed: list[str] = []

    def triton_key(value="3.x-abc"):
        return computed.append(value) or value

    monkeypatch.delattr(codecache, "triton_key", raising=False)
    monkeypatch.setattr(triton_compat, "HAS_TRITON", True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("a = 1")
    code_keys = inductor_keys._code_keys
    for value in ("3.x-abc", "3.x-other"):  # (a new process each: the second finds the first's kept)
        monkeypatch.setattr("flowexec.verdict_cache._shared", {})
        monkeypatch.setattr(triton_compat, "triton_key", functools.cache(lambda: triton_key(value)))  # (as Triton's)
        monkeypatch.setattr(triton_cache, "triton_key", triton_compat.triton_key)
        keys = code_keys()
        assert [k.name for k in keys] == ["torch_key", "triton_key"]
        monkeypatch.setattr(inductor_keys, "_code_keys", lambda: [keys[1]._replace(root=str(tree))])
        inductor_keys._keep_code_keys()
        got = triton_compat.triton_key()
        assert got == "3.x-abc" and triton_cache.triton_key() == got
    assert computed == ["3.x-abc"]  # (the second process computed nothing)


def test_a_kept_torch_key_where_the_process_computed_one_already(tmp_path, monkeypatch) -> None:
    """torch 2.11's ``torch_key`` cache: a list whose ``set`` asserts where the key was computed
    already in the process (the pool's start computes it): nothing is raised, and the key the
    process computed stands."""
    from flowexec import inductor_keys

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "a.py").write_text("a = 1")

    class ListCache:  # (2.11's: a list, and set asserts it is empty)
        def __init__(self, value):
            self.value, self.cache = value, []

        def __call__(self):
            if not self.cache:
                self.cache.append(self.value)
            return self.cache[0]

        def set(self, value):
            assert len(self.cache) == 0
            self.cache.append(value)

    for value, computed_first in ((b"\x01", False), (b"\x02", True)):
        monkeypatch.setattr("flowexec.verdict_cache._shared", {})
        key_fn = ListCache(value)
        if computed_first:
            key_fn()
        code_key = inductor_keys.CodeKey("torch_key", key_fn, str(tree), key_fn.set)
        monkeypatch.setattr(inductor_keys, "_code_keys", lambda: [code_key])
        inductor_keys._keep_code_keys()
        assert key_fn() == (b"\x02" if computed_first else b"\x01")  # (the second: computed, kept one not set)


def test_a_kept_code_key_is_the_one_inductor_computes() -> None:
    """torch_key as kept (bytes, through its text form) is the value Inductor computes."""
    from torch._inductor import codecache

    from flowexec import inductor_keys

    value = codecache.torch_key()
    assert isinstance(value, bytes) and inductor_keys._parse("bytes:" + value.hex()) == value
    assert inductor_keys._parse("str:3.6.0-abc") == "3.6.0-abc" and inductor_keys._parse("3.6.0") is None
    assert inductor_keys._parse("bytes:zz") is None


def test_a_padding_verdict_follows_tf32_within_a_process(tmp_path, monkeypatch) -> None:
    """The in-process verdicts are keyed as the disk's: a process that turns TF32 off between
    builds times the product again (stand-in timings: padding wins only without TF32)."""
    from flowexec import fusion
    from flowexec.passes.pad import PadCase

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("flowexec.verdict_cache._shared", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some GPU")
    monkeypatch.setattr(fusion, "_time_plain", lambda case: 1.0)
    monkeypatch.setattr(fusion, "_time_padded", lambda case: 2.0 if torch.backends.cuda.matmul.allow_tf32 else 0.5)
    case = PadCase("mm", 0, 8192, 768, 50257, torch.float32, torch.device("cuda"), (8192, 768, 50264))
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert fusion._measured_faster(case) is False
        torch.backends.cuda.matmul.allow_tf32 = False
        assert fusion._measured_faster(case) is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_a_kernel_whose_outputs_differ_from_the_program_s_metas_is_refused():
    """The build runs a region's kernel once and compares what it returns with the metas the
    program expects (a decomposition may compute in another dtype than the ATen kernel)."""
    prog = capture(lambda x: (torch.tanh(x) * 3).relu() + 1, (torch.randn(4, 8),)).program
    (r,) = find_regions(prog)
    metas = [prog.values[v].meta for v in r.inputs]
    (out,) = [prog.values[v].meta for v in r.computed]
    wrong = dataclasses.replace(out, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"output 0 came back as torch.float32 \[4, 8\].*expects torch.float64"):
        inductor.compile_graph(inductor.region_graph(prog, r), metas, [wrong])


def _rotary_then_cache(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A rotary embedding of permuted heads, then concatenated to an empty cache (Mistral's)."""
    q = h.view(2, 16, -1, 16).transpose(1, 2)
    rot = torch.cat([-q[..., 8:], q[..., :8]], dim=-1)
    return torch.cat([torch.tensor([]), q * cos + rot * sin], dim=-2)


def test_a_kernel_returning_other_strides_is_compiled_again_for_the_program_s(monkeypatch):
    """Inductor lays a concatenation of permuted tensors out in their order; the program (eager)
    has it row-major, and later kernels are compiled for that. The first kernel's check refuses
    it; the region is compiled again asking for the program's strides, and that kernel is kept
    (the CPU sweep's Mistral, Phi, Gemma, Mixtral and OPT kept such regions as ATen ops)."""
    args = (torch.randn(32, 32), torch.randn(1, 1, 16, 16), torch.randn(1, 1, 16, 16))
    prog = capture(_rotary_then_cache, args).program
    (r,) = find_regions(prog)
    metas, want = [prog.values[v].meta for v in r.inputs], [prog.values[v].meta for v in r.computed]
    assert want[0].stride == (512, 256, 16, 1)
    with pytest.raises(TypeError, match=r"output 0 came back as torch.float32 \[2, 2, 16, 16\] stride \(512, 16, 32, 1\)"):
        inductor.compile_graph(inductor.region_graph(prog, r), metas, want)
    inductor.compile_graph(inductor.region_graph(prog, r, force_strides=True), metas, want)  # (checked)
    comp = inductor.InductorCompiler()  # (outside a block: refused at once, compiled again at once)
    kernel = comp.compile(prog, r)
    assert isinstance(kernel, inductor.FusedKernel) and not comp.failures, comp.failures
    for forced in (True, False):
        monkeypatch.setattr(flowexec.fusion, "_compiler", None)  # a compiler of this case's own
        if not forced:
            monkeypatch.setattr(inductor.InductorCompiler, "with_forced_strides", lambda self, *a: None)
        exe = flowexec.compile(_rotary_then_cache, *args, fuse="inductor")
        out = exe(*args)
        st = exe.plan.stats()
        if forced:
            assert (st["fused_regions"], st["fusion_fallbacks"]) == (1, 0), st
        else:  # (split until the halves compile: the piece with the concatenation stays ATen ops)
            assert st["fusion_fallbacks"] >= 1 and "came back as" in exe.explain(), st
        assert out.stride() == _rotary_then_cache(*args).stride()
        assert_close_rel(out, _rotary_then_cache(*args), 1e-6)


def _viewed(x):
    return (x * 2).transpose(0, 1).contiguous().view(8, 4).relu() + 1


def _viewed_and_written(x):
    y = (x * 2).transpose(0, 1).contiguous()
    y.view(8, 4).add_(1)
    return y.relu() + 1


@pytest.mark.parametrize("fn, retried", [(_viewed, True), (_viewed_and_written, False)], ids=["view", "written"])
def test_a_region_refused_for_a_view_is_compiled_again_with_reshapes(monkeypatch, tmp_path, fn, retried) -> None:
    """A region Inductor refuses (here: any graph with an aten.view, as a view of its own layout
    refused T5's attention) is compiled again with each view a reshape and equals eager; not
    where the region writes in place (a write through a copied view would miss its base)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    real = inductor.inductor_compile
    graphs: list[set[str]] = []

    def refusing_views(gm, metas):
        names = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        graphs.append(names)
        if "aten.view.default" in names:
            raise ValueError("Cannot view a tensor with shape torch.Size([4, 8]) as a tensor with shape (8, 4)!")
        return real(gm, metas)

    monkeypatch.setattr(inductor, "inductor_compile", refusing_views)
    x = torch.randn(8, 4)
    prog = capture(fn, (x,)).program
    (r,) = find_regions(prog)
    assert any(prog.ops[i].name == "aten.view.default" for i in r.ops)
    comp = inductor.InductorCompiler()
    kernel = comp.compile(prog, r)
    assert isinstance(kernel, inductor.FusedKernel) == retried, kernel
    assert any("aten.reshape.default" in g for g in graphs) == retried
    if not retried:
        assert "Cannot view" in kernel
    monkeypatch.setattr(flowexec.fusion, "_compiler", None)
    exe = flowexec.compile(fn, x, fuse="inductor")
    assert_close_rel(exe(x), fn(x), 1e-6)
    assert (exe.plan.stats()["fusion_fallbacks"] == 0) == retried, exe.explain()


def _result_and_more_of_its_transpose(x):
    y = x * 2 + 1
    return y, (y.t() * 3).exp()


def test_forced_strides_part_an_output_only_from_the_region_s_own_intermediates() -> None:
    """An output asks Inductor for the program's strides (forced) where no other value the
    program sees of the region (an input, another output) shares its memory: ``y`` here shares
    it only with ``y.t()``, an intermediate nothing outside the region reads, so both outputs
    are forced, and both come back as eager's, in its strides."""
    x = torch.randn(8, 4)
    fn = _result_and_more_of_its_transpose
    prog = capture(fn, (x,)).program
    (r,) = find_regions(prog)
    assert len(r.computed) == 2 and any(prog.ops[i].name == "aten.t.default" for i in r.ops), r
    recipe = inductor.recipe_of(prog, r, force_strides=True)
    made = {outs[0]: op for op, _, _, outs, _ in recipe.ops}
    assert [made[k] == inductor._FORCE_STRIDES for k in recipe.returned] == [True, True], recipe.ops
    for g, w in zip(inductor.graph_of(recipe)(x), fn(x)):
        torch.testing.assert_close(g, w)
        assert g.stride() == w.stride()


def _half_rotated(x, c, d):
    # rotate_half's pieces, as the rotary models' backward has them: a slice of a region's own
    # product leaves it (here as a result) with gaps in its layout
    a = x.transpose(1, 2)[..., :8]
    m = a * c
    lo, hi = m[..., :4], m[..., 4:]
    return (-lo).exp().sum(), hi, a * d  # (exp: a sum of positive terms, held to a relative error)


def test_a_slice_a_kernel_returns_compact_leaves_the_region_and_its_base_goes_out(monkeypatch):
    """Inductor computes just the slice and returns it compact, where the program has a slice of
    a wider value (gaps: no strides to force). The refused region is tried again without that
    view, its base leaving instead and the slice taken after it; without this, the halves came
    back in an input's memory and both stayed ATen ops (the CPU sweep's rotary models kept 4
    such pieces each)."""
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, 16, 4, 16, generator=g), torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g))
    want = _half_rotated(*args)
    prog = capture(_half_rotated, args).program
    (r,) = find_regions(prog)
    assert regions.without_gapped_views(prog, r) is not None
    for peel in (True, False):
        monkeypatch.setattr(flowexec.fusion, "_compiler", None)  # a compiler of this case's own
        if not peel:
            monkeypatch.setattr(flowexec.passes.fuse, "without_gapped_views", lambda prog, r: None)
        exe = flowexec.compile(_half_rotated, *args, mode="trace", fuse="inductor")
        got = exe(*args)
        st = exe.plan.stats()
        if peel:
            assert (st["fused_regions"], st["fusion_fallbacks"]) == (1, 0), exe.explain()
        else:
            assert st["fusion_fallbacks"] >= 1 and "came back" in exe.explain(), exe.explain()
        for g, t in zip(got, want):
            assert g.stride() == t.stride()
            assert_close_rel(g, t, 1e-5)
    # a region with no such slice is left alone (nothing to take out)
    plain = capture(lambda x: (x.sin() * 2).relu()[:, :4].exp(), (torch.randn(8, 8),)).program
    assert all(regions.without_gapped_views(plain, q) is None for q in find_regions(plain))


def test_a_kernel_that_hands_back_an_input_as_a_new_tensor_is_refused(monkeypatch):
    """Inductor drops a copy it finds to be a no-op, and returned the gradient itself as the
    momentum buffer that momentum SGD makes as ``clone(grad)`` (where the copy was no longer the
    graph's output): each later step's gradient then wrote the buffer. The output check refuses
    a kernel whose computed output is an input's memory."""
    prog = capture(lambda g: (g * 2).relu() + 1, (torch.randn(4, 8),)).program
    (r,) = find_regions(prog)
    metas, want = [prog.values[v].meta for v in r.inputs], [prog.values[v].meta for v in r.computed]
    monkeypatch.setattr(inductor, "inductor_compile", lambda gm, metas: lambda *xs: [xs[0]])
    with pytest.raises(TypeError, match="output 0 came back in the memory of an input"):
        inductor.compile_graph(inductor.region_graph(prog, r), metas, want)


def test_a_passed_output_check_is_kept_so_a_warm_build_runs_no_example(tmp_path, monkeypatch):
    """A region's output check passes once per Inductor cache directory: a new process (fresh
    in-memory verdicts) on the same directory compiles the region without making example
    inputs or running the kernel; another directory checks again, and a failed check is never
    kept."""
    from flowexec import verdict_cache

    prog = capture(lambda x: (torch.tanh(x) * 3).relu() + 1, (torch.randn(4, 8),)).program
    (r,) = find_regions(prog)
    metas = [prog.values[v].meta for v in r.inputs]
    want = [prog.values[v].meta for v in r.computed]
    key = inductor.region_key(prog, r)
    gm = inductor.region_graph(prog, r)
    made = []
    real_example = inductor._example
    monkeypatch.setattr(inductor, "_example", lambda m: made.append(m) or real_example(m))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setattr(verdict_cache, "_shared", {})
    inductor.compile_graph(gm, metas, want, key)
    assert len(made) == 1  # checked on one example input
    monkeypatch.setattr(verdict_cache, "_shared", {})  # as a new process sees it
    kernel = inductor.compile_graph(gm, metas, want, key)
    assert len(made) == 1  # the kept verdict: nothing made, nothing run
    x = torch.randn(4, 8)
    torch.testing.assert_close(kernel(x)[0], (torch.tanh(x) * 3).relu() + 1)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "b"))
    inductor.compile_graph(gm, metas, want, key)
    assert len(made) == 2
    wrong = [dataclasses.replace(want[0], dtype=torch.float64)]
    for _ in range(2):  # refused each time: a failure is not kept as a pass
        with pytest.raises(TypeError, match="came back as"):
            inductor.compile_graph(gm, metas, wrong, key)
    assert len(made) == 4
    assert inductor.output_check_key(key, [*metas, *want]) != inductor.output_check_key(key, [*metas, *wrong])
    # a verdict an older check kept is not this check's (a new test of the outputs: checked again)
    monkeypatch.setattr(inductor, "OUTPUT_CHECK_VERSION", inductor.OUTPUT_CHECK_VERSION + 1)
    monkeypatch.setattr(verdict_cache, "_shared", {})
    inductor.compile_graph(gm, metas, want, key)
    assert len(made) == 5


def test_regions_compiled_together_wait_for_their_kernels_at_the_end():
    """Inside InductorCompiler.together, a region's generated module does not wait for its
    kernels (the compile workers build every region's side by side): each wait is made at the
    block's end, after the last region was generated, and then the kernels run as eager; an
    output check (which runs the kernel) waits there too, and a failed one refuses its region
    only then: its key is reported, its kernel dropped, its reason kept."""
    from torch._inductor.async_compile import AsyncCompile

    progs = [capture(fn, (torch.randn(5, 7),)).program
             for fn in (lambda x: (torch.tanh(x) * 3).relu() + 1, lambda x: (x.sigmoid() - 2).abs() * x)]
    regions = [find_regions(p)[0] for p in progs]
    comp = inductor.InductorCompiler()
    events: list[str] = []
    real_wait = AsyncCompile.wait

    def wait(self, scope):
        events.append("wait")
        real_wait(self, scope)
    mp = pytest.MonkeyPatch()
    mp.setattr(AsyncCompile, "wait", wait)
    wrong = dataclasses.replace(progs[1].values[regions[1].computed[0]].meta, dtype=torch.float64)
    real_graph = inductor.compile_graph
    mp.setattr(inductor, "compile_graph", lambda gm, metas, want=(), key=None:
               real_graph(gm, metas, [wrong] if key == inductor.region_key(progs[1], regions[1]) else want, key))
    try:
        with comp.together() as late:
            kernels = [comp.compile(p, r) for p, r in zip(progs, regions)]
            events.append("generated")
            assert AsyncCompile.wait is not wait  # (the block's own, until its end)
        assert AsyncCompile.wait is wait
    finally:
        mp.undo()
    assert "generated" in events and events.index("generated") < len(events) - 1  # the waits came after
    assert all(e == "wait" for e in events[events.index("generated") + 1:]) and events[0] == "generated"
    key = inductor.region_key(progs[1], regions[1])
    assert late == [key] and key not in comp.kernels and "came back as torch.float32" in comp.failures[key]
    x = torch.randn(5, 7)
    torch.testing.assert_close(kernels[0](x)[0], (torch.tanh(x) * 3).relu() + 1)


def test_a_region_s_cache_entry_is_written_at_the_block_s_end_with_the_kernels_its_wait_resolved(tmp_path, monkeypatch):
    """Inside InductorCompiler.together a region's kernels resolve only at the block's end (the
    waits put off), after Inductor would have bundled them into the region's FX cache entry:
    the entry is written then, holding what resolved in its wait (on CUDA, the Triton binaries
    and launchers a warm build loads instead of compiling; here a kernel the test notes in
    Inductor's bundler during the wait, as a pool's kernel is noted when its future resolves)."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.triton_bundler import TritonBundler

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # (a cold cache: the entry is written)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    (tmp_path / "triton" / "k0").mkdir(parents=True)
    (tmp_path / "triton" / "k0" / "fused.json").write_text("{}")
    saved: list = []
    real_save = FxGraphCache._save_graph

    def save(key, graph, *rest):
        saved.append(graph._triton_bundle)
        real_save(key, graph, *rest)
    monkeypatch.setattr(FxGraphCache, "_save_graph", staticmethod(save))
    real_wait = AsyncCompile.wait

    def wait(self, scope):
        TritonBundler.put("k0", 0)
        real_wait(self, scope)
    monkeypatch.setattr(AsyncCompile, "wait", wait)
    prog = capture(lambda x: (torch.tanh(x) * 5).relu() - 3, (torch.randn(3, 11),)).program
    region = find_regions(prog)[0]
    comp = inductor.InductorCompiler()
    with comp.together():
        kernel = comp.compile(prog, region)
        assert saved == []  # (put off with its wait)
    assert FxGraphCache._save_graph is save  # (Inductor's own again)
    assert len(saved) == 1 and [a.kernel_hash for a in saved[0].kernel_artifacts] == ["k0"], saved
    x = torch.randn(3, 11)
    torch.testing.assert_close(kernel(x)[0], (torch.tanh(x) * 5).relu() - 3)


def test_a_kernel_that_fails_to_build_at_the_block_s_end_leaves_its_region_as_aten_ops(monkeypatch):
    """The fusion pass fuses again where a region was refused only when its kernels were waited
    for: the program keeps that region's ATen ops, says why, and runs as eager."""
    from torch._inductor.async_compile import AsyncCompile

    real_wait = AsyncCompile.wait

    def wait(self, scope):  # a build that fails for the layer norm's kernel (a unique shape: 13)
        if any("layer_norm" in k for k in scope):
            raise RuntimeError("kernel build failed (test)")
        real_wait(self, scope)
    monkeypatch.setattr(AsyncCompile, "wait", wait)
    monkeypatch.setattr(flowexec.fusion, "_compiler", None)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(13, 13), torch.nn.LayerNorm(13), torch.nn.GELU(), torch.nn.Linear(13, 13))
    x = torch.randn(3, 13)
    exe = flowexec.compile(lambda x: (net(x).relu() * 2).sum(), x, fuse="inductor")
    st = exe.plan.stats()
    assert st["fusion_fallbacks"] >= 1 and st["fused_regions"] >= 1, st
    assert "kernel build failed (test)" in exe.explain()
    assert "aten.native_layer_norm" in str(exe.program)
    with torch.no_grad():
        torch.testing.assert_close(exe(x), (net(x).relu() * 2).sum())


def test_a_region_s_inputs_of_one_metadata_share_one_example_in_its_output_check(tmp_path, monkeypatch):
    """The output check reads only the outputs' dtype, shape and strides, so inputs alike share
    one example: a region over parameters, gradients and moments (an optimizer's elementwise
    math) makes one example per distinct metadata, not a copy of each, and is still checked."""
    from flowexec import verdict_cache

    def adam_like(p, g, m, v, lr, wd):  # (lr and wd: one learning rate and decay per column)
        m2 = m * 0.9 + g * 0.1
        v2 = v * 0.99 + g * g * 0.01
        return p * (1 - wd) - lr * m2 / (v2.sqrt() + 1e-8), m2, v2

    args = (*(torch.randn(16, 8) for _ in range(3)), torch.rand(16, 8), torch.rand(8), torch.rand(8))
    prog = capture(adam_like, args).program
    (r,) = find_regions(prog)
    metas = [prog.values[v].meta for v in r.inputs]
    want = [prog.values[v].meta for v in r.computed]
    assert len(metas) == 6
    made = []
    real_example = inductor._example
    monkeypatch.setattr(inductor, "_example", lambda m: made.append(m) or real_example(m))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verdict_cache, "_shared", {})
    kernel = inductor.compile_graph(inductor.region_graph(prog, r), metas, want, inductor.region_key(prog, r))
    assert sorted(tuple(m.shape) for m in made) == [(8,), (16, 8)]
    by_value = dict(zip(prog.inputs, args))
    got = dict(zip(r.computed, kernel(*[by_value[v] for v in r.inputs])))
    for ref, expect in zip(prog.outputs, adam_like(*args)):
        torch.testing.assert_close(got[ref.id], expect)
    with pytest.raises(TypeError, match="came back as"):  # (the shared examples still check the outputs)
        inductor.compile_graph(inductor.region_graph(prog, r), metas,
                               [dataclasses.replace(want[0], dtype=torch.float64), *want[1:]])


def test_an_integer_input_a_region_writes_has_an_example_of_its_own():
    """Floating inputs alike share an example in the output check; integer ones do not: a
    region that advances an integer counter in place and then gathers with an index of the
    counter's metadata would read the written counter as indices (out of bounds: refused on a
    CPU, a device-side assert on CUDA). The check passes and the kernel computes eager's."""
    def step(x, cnt, idx):
        cnt.add_(5)
        m = cnt.float().sum()
        return x[idx] * m

    args = (torch.randn(4, 8), torch.zeros(4, dtype=torch.long), torch.tensor([3, 1, 2, 0]))
    prog = capture(step, args).program
    (r,) = find_regions(prog)
    metas = [prog.values[v].meta for v in r.inputs]
    want = [prog.values[v].meta for v in r.computed]
    assert any(op.name == "aten.index.Tensor" for op in (prog.ops[i] for i in r.ops))
    kernel = inductor.compile_graph(inductor.region_graph(prog, r), metas, want)
    mine, theirs = [a.clone() for a in args], [a.clone() for a in args]
    by_value = dict(zip(prog.inputs, mine))
    got = dict(zip(r.computed, kernel(*[by_value[v] for v in r.inputs])))
    torch.testing.assert_close(got[prog.outputs[0].id], step(*theirs))
    torch.testing.assert_close(mine[1], theirs[1])  # (the counter advanced once, as eager's)
