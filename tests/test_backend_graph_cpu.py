"""The backend's graph mode on CPU: GraphProgram's choice of graphs (per parameter set, per
micro-batch in flight, staging) with real AOTAutograd graphs, real HandedOutputs and gradients
checked against eager. A stand-in runner takes the place of CudaGraphRunner: what a CUDA graph
does to memory it does too (outputs are fixed buffers that each replay overwrites, borrowed
inputs are read where they were at capture and not held, other inputs are copied into
buffers), and a replay runs the lowered program. The GPU tests run the same scenarios on CUDA
graphs (tests/gpu/test_core_gpu.py)."""
from __future__ import annotations

import copy
import gc
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from flowexec.models import make_mlp
from flowexec.storage import mark_stable
from flowexec.runtime.outputs import HandedOutputs
from helpers import assert_same_state, record_graph_programs


def _view_of(storage: torch.UntypedStorage, like: torch.Tensor) -> torch.Tensor:
    """A new tensor on ``like``'s memory: holds the storage, not ``like`` itself."""
    return torch.empty(0, dtype=like.dtype).set_(storage, like.storage_offset(), like.shape, like.stride())


class CpuGraphRunner:
    """CudaGraphRunner's memory behaviour without CUDA (see the module docstring)."""

    captures = 0

    def __init__(self, run, example_inputs, mutated, borrow, mutated_inputs=(), warmup=1, fresh_outputs=(),
                 grad_candidates=None, keep_borrowed=True, **_: Any) -> None:
        CpuGraphRunner.captures += 1
        self.run = run
        tensors = [i for i, a in enumerate(example_inputs) if isinstance(a, torch.Tensor)]
        self._staged = [i for i in tensors if not borrow[i]]
        self._borrowed = [(i, example_inputs[i].data_ptr()) for i in tensors if borrow[i]]
        # Borrowed inputs are read where they are: kept as their memory, not as the tensors.
        self._reads = {i: (example_inputs[i].untyped_storage(), example_inputs[i].detach()) for i, _ in self._borrowed}
        self.static_inputs = list(example_inputs)
        for i in self._staged:
            self.static_inputs[i] = example_inputs[i].detach().clone()
        self._mutated_inputs = [i for i in mutated_inputs if i in self._staged]
        snapshot = [(t, t.detach().clone()) for t in mutated]
        outs = run(*self._inputs())
        with torch.no_grad():
            for t, saved in snapshot:
                t.copy_(saved)
        if not keep_borrowed:
            for i, _ in self._borrowed:
                self.static_inputs[i] = None
        self._reads = {i: (s, _view_of(s, t)) for i, (s, t) in self._reads.items()}
        input_storages = {a.untyped_storage().data_ptr() for a in example_inputs if isinstance(a, torch.Tensor)}
        self._protect = [i for i, o in enumerate(outs)
                         if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in input_storages]
        for i in self._protect:
            mark_stable(outs[i])
        self._buffers = outs
        self.outputs = HandedOutputs([outs[i] for i in self._protect],
                                     fresh=[k for k, i in enumerate(self._protect) if i in set(fresh_outputs)],
                                     candidates=grad_candidates, outputs=outs, positions=self._protect)

    def _inputs(self) -> list[Any]:
        return [self._reads[i][1] if i in self._reads else a for i, a in enumerate(self.static_inputs)]

    def matches(self, args) -> bool:
        return not self.moved(args)

    def moved(self, args) -> list[int]:
        return [i for i, ptr in self._borrowed if args[i].data_ptr() != ptr]

    def __call__(self, args, saved_checked: bool = False) -> list[Any]:
        self.outputs.release(saved_checked)
        for i in self._staged:  # in-graph memcpy nodes: no version counter either
            static = self.static_inputs[i]
            if args[i].data_ptr() != static.data_ptr():
                with torch.autograd._unsafe_preserve_version_counter(static):
                    static.copy_(args[i])
        with torch.no_grad():
            new = self.run(*self._inputs())
            for i in self._protect:  # the replay writes the same buffers, version counters untouched
                buf = self._buffers[i]
                if new[i].data_ptr() != buf.data_ptr():
                    with torch.autograd._unsafe_preserve_version_counter(buf):
                        buf.copy_(new[i])
        for i in self._mutated_inputs:
            args[i].copy_(self.static_inputs[i])
        return self.outputs.hand_out()


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Graph mode through the backend on CPU, with CpuGraphRunner; yields the GraphPrograms made
    (``record_graph_programs``)."""
    import flowexec.backend as backend
    import flowexec.runtime.cuda_graph as cuda_graph

    monkeypatch.setattr(cuda_graph, "CudaGraphRunner", CpuGraphRunner)
    monkeypatch.setattr(backend, "_cuda_available", lambda: True)  # the backend's check for mode="graph"
    made = record_graph_programs(monkeypatch)
    torch._dynamo.reset()
    CpuGraphRunner.captures = 0
    yield made  # (program, placeholder names, output names), filled as the test compiles
    torch._dynamo.reset()
    gc.collect()


def _data(n: int, width: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(4, width), torch.randint(0, 10, (4,))) for _ in range(n)]


@pytest.mark.parametrize("cache_size", [8, 1])
def test_gpipe_order_matches_eager(cpu_graphs, cache_size):
    """Three micro-batches, all forwards then all backwards, two steps with SGD: parameters and
    gradients equal eager's. With room, each micro-batch in flight gets a forward graph of its
    own and nothing is copied; with one graph, saved tensors are moved out and a staging graph
    copies them in for the backward."""
    torch.manual_seed(0)
    m1 = make_mlp(16, 2)
    m2 = copy.deepcopy(m1)
    c2 = torch.compile(m2, backend="flowexec", options={"mode": "graph", "cache_size": cache_size})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (m1, m2)]
    data = _data(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*boxed")
        for m in (m1, c2):  # one micro-batch first: both graphs captured reading in place
            F.cross_entropy(m(data[0][0]), data[0][1]).backward()
        for step in range(3):
            for m, opt in ((m1, opts[0]), (c2, opts[1])):
                losses = [F.cross_entropy(m(x), y) for x, y in data]  # every forward first
                for loss in losses:
                    loss.backward()
                del losses
                if step < 2:
                    opt.step()
                    opt.zero_grad()
    assert_same_state(m1, m2)
    (fw, _, _), (bw, _, _) = cpu_graphs
    assert bw.forward is fw and fw.saved_from == 1
    if cache_size >= 3:
        assert len(fw.graph_runners) == 3 and len(bw.graph_runners) == 3 and bw.staged_calls == 0
        assert sum(r.outputs.moved for r in fw.graph_runners) == 0
    else:
        assert len(fw.graph_runners) == 1 and fw.graph_runners[0].outputs.moved > 0
        assert bw.staged_calls == 6 and len(bw.staging_runners) == 1


def test_per_micro_batch_order_replays_one_graph_each(cpu_graphs):
    """Each backward right after its forward: one forward and one backward graph serve every
    call (nothing is held at the next forward), gradients accumulated as in eager."""
    torch.manual_seed(0)
    m1 = make_mlp(16, 2)
    m2 = copy.deepcopy(m1)
    c2 = torch.compile(m2, backend="flowexec", options={"mode": "graph"})
    for x, y in _data(4):
        F.cross_entropy(m1(x), y).backward()
        F.cross_entropy(c2(x), y).backward()
    assert_same_state(m1, m2)
    (fw, _, _), (bw, _, _) = cpu_graphs
    assert len(fw.graph_runners) == 1 and len(bw.graph_runners) == 1 and CpuGraphRunner.captures == 2
    assert fw.graph_runners[0].outputs.moved == 0


def test_two_modules_of_one_class_take_turns(cpu_graphs):
    """Two modules of one class taking turns, two micro-batches accumulated each: one graph per
    parameter set and program, said once (the second module's parameters), results as eager."""
    torch.manual_seed(0)
    eager = [make_mlp(16, 2) for _ in range(2)]
    mine = [copy.deepcopy(m) for m in eager]
    compiled = [torch.compile(m, backend="flowexec", options={"mode": "graph"}) for m in mine]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (*eager, *mine)]
    data = _data(2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(3):
            for k in range(2):
                for model, opt in ((eager[k], opts[k]), (compiled[k], opts[2 + k])):
                    for x, y in data:
                        F.cross_entropy(model(x), y).backward()
                    if step < 2:
                        opt.step()
                        opt.zero_grad()
    for e, m in zip(eager, mine):
        assert_same_state(e, m)
    recaptured = [str(w.message) for w in said if "capturing the graph again" in str(w.message)]
    forwards = [g for g, _, _ in cpu_graphs if g.forward is None]
    assert sum(len(f.graph_runners) for f in forwards) == 2
    if len(forwards) == 1:  # Dynamo shared the program between the two modules
        assert len(recaptured) == 1 and "a parameter" in recaptured[0], recaptured
    else:
        assert not recaptured


def _refusing(monkeypatch: Any, refuses: Any) -> None:
    """CpuGraphRunner in CudaGraphRunner's place, the n-th capture (from 1) refused by CUDA where
    ``refuses(n)`` (as a host tensor copied to the device in a captured program is: "Cannot copy
    between CPU and CUDA tensors during CUDA graph capture")."""
    import flowexec.runtime.cuda_graph as cuda_graph

    captures = [0]

    class Refusing(CpuGraphRunner):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            captures[0] += 1
            if refuses(captures[0]):
                raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
                                   "tensor is pinned")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cuda_graph, "CudaGraphRunner", Refusing)


def test_a_graph_cuda_refuses_to_capture_runs_in_trace_mode_saying_so(cpu_graphs, monkeypatch):
    """Mistral through the backend in graph mode (H100, 09881a3) raised the capture's error to
    the user; the graph now runs as traced, as the whole-step executable's does."""
    _refusing(monkeypatch, lambda n: True)
    torch.manual_seed(0)
    m1 = make_mlp(16, 2)
    m2 = copy.deepcopy(m1)
    c2 = torch.compile(m2, backend="flowexec", options={"mode": "graph"})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (m1, m2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _data(3):
            for m, opt in ((m1, opts[0]), (c2, opts[1])):
                F.cross_entropy(m(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert_same_state(m1, m2)
    said = [str(w.message) for w in caught if "trace mode" in str(w.message)]
    assert said == [said[0], "flowexec: this backward graph runs in trace mode (no CUDA graph), as its forward graph "
                    "does"], said
    assert said[0].startswith("flowexec: the CUDA graph capture of this forward graph failed (Cannot copy between CPU")
    assert said[0].endswith("it runs in trace mode")
    assert [p.mode for p, _, _ in cpu_graphs] == ["trace", "trace"]


def test_a_backward_follows_its_forward_out_of_graph_mode(cpu_graphs, monkeypatch):
    """Three modules of one class share a forward and a backward graph; CUDA refuses the
    forward's second capture (the second module's parameters). That forward runs in trace mode
    from then on, and so must its backward: a backward graph hands its gradient buffers out as
    ``.grad`` where the forward's graphs record the leaves that may hold them, which a
    trace-mode forward does not, so a replay for the next module overwrote the last one's
    ``.grad`` (found by a review of 7109e4f: 2.4e-2 off)."""
    _refusing(monkeypatch, lambda n: n == 2)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.l(x))

    torch.manual_seed(0)
    m1 = torch.nn.Sequential(Block(), Block(), Block())
    m2 = copy.deepcopy(m1)
    for b in m2:
        b.forward = torch.compile(b.forward, backend="flowexec", options={"mode": "graph"})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (m1, m2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            x = torch.randn(4, 8)
            for m, opt in zip((m1, m2), opts):
                m(x).square().sum().backward()
                opt.step()
                opt.zero_grad()
    assert_same_state(m1, m2)
    modes = [(p._role, p.mode, p.forward.mode if p.forward is not None else None) for p, _, _ in cpu_graphs]
    assert ("forward", "trace", None) in modes and ("backward", "trace", "trace") in modes, modes
    assert all(mode == "trace" or fwd == "graph" for role, mode, fwd in modes if role == "backward"), modes


def test_the_backward_of_a_forward_run_as_traced_runs_in_trace_mode(cpu_graphs, monkeypatch):
    """A forward flowexec cannot capture runs as AOTAutograd traced it; no graph of it holds its
    saved tensors or records its leaves, so its backward runs in trace mode (over static sizes
    here: the symbolic test below has its backward in trace mode for another reason)."""
    import flowexec.backend as backend
    from flowexec.errors import CaptureError

    made = backend.program_from_graph
    calls = [0]

    def refuses_the_first(gm: Any, inputs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise CaptureError("unsupported call 'graphsafe_run_with_rng_state' in the captured graph (a stand-in)")
        return made(gm, inputs)

    monkeypatch.setattr(backend, "program_from_graph", refuses_the_first)
    torch.manual_seed(0)
    m1 = make_mlp(16, 2)
    m2 = copy.deepcopy(m1)
    c2 = torch.compile(m2, backend="flowexec", options={"mode": "graph"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in _data(3):
            F.cross_entropy(m1(x), y).backward()
            F.cross_entropy(c2(x), y).backward()
    assert_same_state(m1, m2)
    said = [str(w.message) for w in caught if "flowexec:" in str(w.message)]
    assert any("forward graph runs as Dynamo and AOTAutograd traced it" in w and "(a stand-in)" in w for w in said), said
    assert [p.mode for p, _, _ in cpu_graphs] == ["trace"]  # (the backward's; the forward is no GraphProgram)


def test_a_graph_flowexec_cannot_capture_runs_as_aot_autograd_traced_it(cpu_graphs):
    """A graph over symbolic sizes holds Python arithmetic on them (``operator.mul``), which no
    Program holds: it runs as AOTAutograd traced it (torch.compile's aot_eager), said in a
    warning, instead of failing the user's call (BART in graph mode, H100, 09881a3)."""
    torch.manual_seed(0)
    m1 = torch.nn.Linear(6, 6)
    m2 = copy.deepcopy(m1)

    def f(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).reshape(x.shape[0] * x.shape[1] // 2, -1).sin().sum()

    c2 = torch.compile(lambda x: f(m2, x), backend="flowexec", options={"mode": "graph"}, dynamic=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (4, 6):
            x = torch.randn(n, 6)
            f(m1, x).backward()
            c2(x).backward()
    assert_same_state(m1, m2)
    said = [str(w.message) for w in caught if "as Dynamo and AOTAutograd traced it" in str(w.message)]
    assert said and "unsupported call" in said[0], [str(w.message) for w in caught]


def test_a_refused_recapture_drops_the_graphs_kept_before(cpu_graphs, monkeypatch):
    """A forward whose parameters moved captures again; where CUDA refuses that capture, the
    graph runs in trace mode from then on and lets go of the graphs it kept (their buffers and
    private pools would stay held for nothing)."""
    _refusing(monkeypatch, lambda n: n > 2)  # (the forward's and the backward's first graphs pass)
    torch.manual_seed(0)
    m1 = make_mlp(16, 2)
    m2 = copy.deepcopy(m1)
    c2 = torch.compile(m2, backend="flowexec", options={"mode": "graph"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (x, y), (x2, y2) = _data(2)
        for m in (m1, c2):
            F.cross_entropy(m(x), y).backward()
        (fw, _, _), (bw, _, _) = cpu_graphs
        assert len(fw.graph_runners) == 1 and len(bw.graph_runners) == 1
        with torch.no_grad():
            for p in m2.parameters():
                p.data = p.data.clone()  # (new addresses: the kept graph no longer reads them)
        for m in (m1, c2):
            F.cross_entropy(m(x2), y2).backward()
    assert_same_state(m1, m2)
    assert (fw.mode, fw.graph_runners, bw.mode, bw.graph_runners) == ("trace", [], "trace", [])
