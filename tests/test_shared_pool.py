"""pool="shared" on CPU: option checks, the calling convention flowexec uses for PyTorch's
CUDA-graph trees, and the guard that keeps held outputs valid across generations.

No CUDA here, so a stand-in takes the place of ``cudagraphify_impl`` (``FakeTrees``): it checks
the convention the real one relies on (the model called with a list it must empty; static
inputs listed) and does to memory what the trees' fast path does: a new generation starts at a
new ``torch.compile`` invocation with no forward pending its backward; within one, the k-th
call of a function is a node of its own (micro-batches in flight get their own memory), and
after the first call each node's outputs are one set of buffers that every later call of it
writes again and returns. The GPU tests run the real trees (tests/gpu/test_shared_pool_gpu.py)."""
from __future__ import annotations

import copy
import re
import gc
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.errors import OptionError
from flowexec.models import make_mlp
from helpers import assert_close_rel, assert_same_state, record_graph_programs

pytestmark = pytest.mark.timeout(300)


class FakeTrees:
    """``cudagraphify_impl`` and the tree manager's generation test, without CUDA."""

    def __init__(self) -> None:
        self.functions: list[dict[str, Any]] = []
        self.gen: int | None = None
        self.pending = False
        self.seq: dict[int, int] = {}  # calls of each function in this generation

    def cudagraphify_impl(self, model, inputs, static_input_idxs, *, device_index, is_backward, is_inference, **kw):
        from torch._dynamo.mutation_guard import GenerationTracker

        assert isinstance(kw.get("stack_traces"), list), "warm-up nodes assert a list when a generation ends"
        assert len(kw.get("placeholders", ())) == len(inputs), "the trees' messages index placeholders by input"
        info = {"static": list(static_input_idxs), "backward": is_backward, "inference": is_inference,
                "keywords": sorted(kw), "static_params": [], "calls": 0}
        self.functions.append(info)
        nodes: dict[int, list[Any]] = {}  # k-th call in a generation -> that node's buffers
        fid = len(self.functions)

        def fn(args: list[Any]) -> list[Any]:
            assert isinstance(args, list)
            if self.can_start_new_generation():
                self.seq.clear()
            k = self.seq[fid] = self.seq.get(fid, -1) + 1
            buffers = nodes.get(k)
            info["static_params"] = [isinstance(args[i], torch.nn.Parameter) for i in info["static"]]
            inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            out = model(args)
            assert args == [], "the model must empty the list it is given (the trees' boxed convention)"
            info["calls"] += 1
            self.gen, self.pending = GenerationTracker.generation, not (is_backward or is_inference)
            if buffers is None:  # warm-up: the model's own outputs; fresh ones become the buffers
                buffers = nodes[k] = [o if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs
                           else None for o in out]
                return list(out)
            for b, o in zip(buffers, out):  # the fast path: the same tensors, written again
                if b is not None:
                    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(b):
                        b.copy_(o)
            return [b if b is not None else o for b, o in zip(buffers, out)]
        return fn

    def can_start_new_generation(self) -> bool:
        from torch._dynamo.mutation_guard import GenerationTracker

        return GenerationTracker.generation != self.gen and not self.pending


@pytest.fixture
def fake_trees(monkeypatch):
    """Shared-pool graph mode through the backend on CPU with :class:`FakeTrees`."""
    import torch._inductor.cudagraph_trees as trees

    import flowexec.backend as backend
    import flowexec.passes.streams as streams
    import flowexec.runtime.graph_trees as graph_trees

    fake = FakeTrees()
    monkeypatch.setattr(trees, "cudagraphify_impl", fake.cudagraphify_impl)
    monkeypatch.setattr(trees, "get_manager", lambda index, create_if_none_exists=True: fake)
    monkeypatch.setattr(backend, "_cuda_available", lambda: True)
    cpu_as_cuda = lambda prog: {torch.device("cuda", 0)}  # noqa: E731 (the one device a tree is of)
    monkeypatch.setattr(backend, "cuda_devices", cpu_as_cuda)
    monkeypatch.setattr(streams, "cuda_devices", cpu_as_cuda)
    monkeypatch.setattr(graph_trees, "skip_reason", lambda gm: None)  # it would see CPU nodes
    monkeypatch.setattr(graph_trees, "program_skip_reason", lambda prog, devices: None)
    monkeypatch.setattr(graph_trees, "_HELD", {})
    fake.made = record_graph_programs(monkeypatch)
    torch._dynamo.reset()
    yield fake
    torch._dynamo.reset()
    gc.collect()


def _compile_shared(m: torch.nn.Module) -> Any:
    return torch.compile(m, backend="flowexec", options={"mode": "graph", "pool": "shared"})


# -- options ---------------------------------------------------------------------------------

@pytest.mark.parametrize("options,message", [
    ({"mode": "graph", "pool": "big"}, "pool='big' is not a graph memory pool; valid: 'private'"),
    ({"mode": "trace", "pool": "shared"}, "pool='shared' applies to mode='graph'"),
    ({"mode": "graph", "pool": "shared", "streams": 2}, "streams=2 cannot be combined with it"),
    ({"mode": "graph", "pool": "shared", "warmup": 3}, "warmup=3: with pool='shared' CUDA-graph trees warm"),
])
def test_backend_checks_the_pool_option(options, message):
    torch._dynamo.reset()
    m = torch.compile(torch.nn.Linear(3, 3), backend="flowexec", options=options)
    with pytest.raises(Exception, match=re.escape(message)):
        m(torch.ones(2, 3))
    torch._dynamo.reset()


def test_backend_pool_shared_without_cuda_says_graph_mode_needs_cuda():
    """On CPU pool='shared' is an error, not a no-op: graph mode itself needs CUDA."""
    torch._dynamo.reset()
    m = torch.compile(torch.nn.Linear(3, 3), backend="flowexec", options={"mode": "graph", "pool": "shared"})
    with pytest.raises(Exception, match="mode='graph' captures CUDA graphs, but this machine has no CUDA device"):
        m(torch.ones(2, 3))
    torch._dynamo.reset()


@pytest.mark.parametrize("options,message", [
    ({"pool": "big"}, "pool='big' is not a graph memory pool"),
    ({"pool": "shared"}, "pool='shared' applies to mode='graph'"),
    ({"pool": "shared", "mode": "graph"}, "mode='graph' captures a CUDA graph, but this machine has no CUDA"),
])
def test_compile_checks_the_pool_option(options, message):
    with pytest.raises(OptionError, match=message):
        flowexec.compile(lambda x: x + 1, torch.ones(2), **options)


def test_pool_shared_refuses_fetch_and_streams():
    from flowexec.runtime.graph_trees import check_pool

    with pytest.raises(OptionError, match="fetch cannot be combined with pool='shared'"):
        check_pool("shared", "graph", 1, {"fetch": True})
    with pytest.raises(OptionError, match="streams='auto' cannot be combined"):
        check_pool("shared", "graph", "auto", {})
    assert check_pool("shared", "graph", 1, {"warmup": 1}) == "shared"


def test_missing_trees_api_names_the_torch_version(monkeypatch):
    import torch._inductor.cudagraph_trees as trees

    from flowexec.runtime.graph_trees import tree_api

    monkeypatch.delattr(trees, "cudagraphify_impl")
    with pytest.raises(OptionError, match=re.escape(f"torch {torch.__version__} does not provide")):
        tree_api()


def test_a_signature_off_the_gpu_is_refused_by_the_trees_check():
    from flowexec.runtime.graph_trees import program_skip_reason

    exe = flowexec.compile(lambda x: (x * 2, 1.5), torch.ones(2))
    assert program_skip_reason(exe.program, set()) == "its program is on 0 CUDA devices"
    assert program_skip_reason(exe.program, {torch.device("cuda", 0)}) == "it has values on cpu"


def test_trees_keywords_exist_in_this_torch():
    """The keywords flowexec passes are the ones this torch's cudagraphify takes."""
    from flowexec.runtime.graph_trees import tree_api

    _, accepted = tree_api()
    assert {"device_index", "is_backward", "is_inference", "stack_traces", "placeholders",
            "mutated_input_idxs"} <= accepted


# -- the backend through the stand-in ----------------------------------------------------------

def test_gpipe_order_through_trees_matches_eager(fake_trees):
    """Three micro-batches, every forward then every backward, three SGD steps: parameters and
    gradients equal eager's; the forward's static inputs are exactly its parameters, the
    backward's everything before its tangents; the model empties the list it is given."""
    torch.manual_seed(0)
    m1 = make_mlp(16, 2)
    m2 = copy.deepcopy(m1)
    c2 = _compile_shared(m2)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (m1, m2)]
    data = [(torch.randn(4, 16), torch.randint(0, 10, (4,))) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*boxed")
        for step in range(3):
            for m, opt in ((m1, opts[0]), (c2, opts[1])):
                opt.zero_grad(set_to_none=True)
                losses = [F.cross_entropy(m(x), y) for x, y in data]
                for loss in losses:
                    loss.backward()
                del losses
                if step < 2:
                    opt.step()
    assert_same_state(m1, m2)
    fw, bw = fake_trees.functions
    assert not fw["backward"] and not fw["inference"] and bw["backward"]
    assert fw["static"] and all(fw["static_params"]), fw
    assert {"stack_traces", "placeholders", "mutated_input_idxs"} <= set(fw["keywords"])
    (fwp, names, _), (bwp, bw_names, _) = fake_trees.made
    assert bw["static"] == [i for i, n in enumerate(bw_names) if "tangents" not in n]
    assert fw["calls"] == bw["calls"] == 9 and fwp.shared is not None and bwp.shared is not None


def test_held_output_stays_valid_across_a_new_generation(fake_trees):
    """An output kept from one step keeps its values when the next steps replay over its
    memory: it is moved to private memory first. Without that move the stand-in (as the trees'
    fast path) overwrites it, which the second half checks."""
    import flowexec.runtime.graph_trees as graph_trees

    torch.manual_seed(0)
    m = make_mlp(8, 1)
    c = _compile_shared(copy.deepcopy(m))
    xs = [torch.randn(3, 8) for _ in range(4)]
    for x in xs[:2]:  # warm-up, then the graph's buffers in use
        c(x).sum().backward()
    held = c(xs[2])
    held.sum().backward()
    expect = m(xs[2]).detach()
    c(xs[3]).sum().backward()  # a new generation: replays over held's memory
    assert_close_rel(held.detach(), expect, what="held output")
    assert graph_trees.held_outputs(0).moved >= 1

    with pytest.MonkeyPatch.context() as mp:  # the guard off
        mp.setattr(graph_trees.HeldOutputs, "_move_held", lambda self: (self.handed.clear(), self.ptrs.clear()))
        held = c(xs[2])
        held.sum().backward()
        c(xs[3]).sum().backward()
        assert not torch.allclose(held.detach(), expect), "the stand-in should overwrite a held output"


def test_dropped_outputs_cost_nothing_and_kept_grads_move_once(fake_trees):
    """The common loop (grads set to None each step) holds nothing at the next step: nothing is
    moved. Gradients accumulated over steps without zeroing: the .grad tensors (a backward's
    outputs, in the pool) move to private memory once, at the second step, and later backwards
    add into them; they equal eager's."""
    import flowexec.runtime.graph_trees as graph_trees

    torch.manual_seed(0)
    m1 = make_mlp(8, 1)
    c = _compile_shared(copy.deepcopy(m1))
    opt = torch.optim.SGD(c.parameters(), lr=0.1)
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        c(torch.randn(3, 8)).sum().backward()
    assert graph_trees.held_outputs(0).moved == 0
    m2 = c._orig_mod
    m2.load_state_dict(m1.state_dict())
    for p in m2.parameters():
        p.grad = None
    for _ in range(4):
        x = torch.randn(3, 8)
        m1(x).sum().backward()
        c(x).sum().backward()
    assert_same_state(m1, m2)
    assert graph_trees.held_outputs(0).moved == len(list(m2.parameters()))


def test_two_modules_sharing_code_keep_accumulated_grads(fake_trees):
    """Two modules of one class (Dynamo may share one compiled graph between them) taking turns,
    gradients accumulated without zeroing: both modules' .grad tensors are moved out of the pool
    at the next generation, so they equal eager's."""
    torch.manual_seed(0)
    eager = [make_mlp(8, 1) for _ in range(2)]
    mine = [copy.deepcopy(m) for m in eager]
    compiled = [_compile_shared(m) for m in mine]
    for _ in range(3):
        for e, c in zip(eager, compiled):
            x = torch.randn(3, 8)
            e(x).sum().backward()
            c(x).sum().backward()
    for e, m in zip(eager, mine):
        assert_same_state(e, m)


# -- flowexec.compile through the stand-in ------------------------------------------------------

def test_executable_with_shared_pool_trains_like_eager_and_keeps_held_losses(fake_trees):
    """flowexec.compile(..., mode="graph", pool="shared"): one tree function per signature, every
    call its own generation; losses kept across calls keep their values, state equals eager's."""
    import flowexec.runtime.graph_trees as graph_trees
    from flowexec.executable import Executable
    from flowexec.models import make_step

    torch.manual_seed(0)
    m1 = make_mlp(8, 2)
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (m1, m2))
    s1, s2 = make_step(m1, o1, F.cross_entropy), make_step(m2, o2, F.cross_entropy)
    data = [(torch.randn(4, 8), torch.randint(0, 10, (4,))) for _ in range(5)]
    s1(*data[0]), s2(*data[0])  # .grad and momentum exist before capture
    exe = Executable(s2, "graph", "fast", {"pool": "shared"})
    kept = [(exe(x, y), s1(x, y)) for x, y in data[1:]]
    for k, (mine, eager) in enumerate(kept):
        assert_close_rel(mine, eager, what=f"loss {k}")
    assert_same_state(m1, m2)
    (fn,) = fake_trees.functions
    # the parameters and momenta are closure state, which the program reads in place; the existing
    # .grad tensors are inputs after the call's two (issue 37: read from p.grad at each call), which
    # the program writes, so the tree reads them in place too: static
    n_params = len(list(m2.parameters()))
    assert fn["inference"] and fn["calls"] == 4 and fn["static"] == list(range(2, 2 + n_params))
    assert graph_trees.held_outputs(0).moved == 3  # each kept loss, once, at the next call
    with pytest.raises(OptionError, match="trees own the graphs' input buffers"):
        exe.input_buffers
