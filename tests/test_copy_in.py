"""Per-call inputs copied in by the program itself (passes/copy_in.py, runtime/staging.py's
CopyInNodes): the rewrite against eager, the copy's lifetime, which inputs qualify, the memcpy
node found and re-pointed (a stand-in for CUDA's runtime bindings), and graph mode's wiring on
CPU with stand-in graphs (the GPU tests run the real nodes: tests/gpu/test_memory_gpu.py)."""
from __future__ import annotations

import gc
import types
import weakref
from typing import Any

import torch

from flowexec.build import plan_for
from flowexec.capture import capture
from flowexec.passes.copy_in import copy_inputs_in, inputs_to_copy_in
from flowexec.runtime.interpreter import lower_trace
from test_staging import stand_in_graphs  # noqa: F401  (a fixture: graph mode on CPU)


def _fn(w: torch.Tensor) -> Any:
    def fn(x: torch.Tensor, y: torch.Tensor) -> Any:
        h = (x.to(torch.float64) @ w).relu()  # x's only reader: the cast, as autocast's first op
        return h * y, y.t()
    return fn


def test_a_copied_in_input_is_read_by_its_copy_alone_which_dies_after_its_last_reader():
    w = torch.randn(4, 4, dtype=torch.float64)
    x, y = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)
    prog = capture(_fn(w), (x, y)).program
    plan = plan_for(prog, "trace", copied_in=(0, 1))
    p = plan.program
    assert [op.name for op in p.ops[:2]] == ["aten.clone.default", "aten.clone.default"]
    readers = {vid: [op.index for op in p.ops if vid in op.refs()] for vid in p.inputs}
    assert readers == {p.inputs[0]: [0], p.inputs[1]: [1]}
    x_in = p.ops[0].outputs[0]
    cast = next(op.index for op in p.ops if x_in in op.refs())
    assert x_in in plan.liveness.frees[cast]  # the copy goes as soon as the cast has read it
    out = lower_trace(plan)(x, y)
    want = _fn(w)(x, y)
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert out[1].data_ptr() != y.data_ptr()  # an output that was a view of the input: of its copy now
    assert copy_inputs_in(prog, ()) is prog


def test_only_plain_dense_unwritten_unshared_inputs_are_copied_in():
    state = torch.zeros(3)
    param = torch.nn.Parameter(torch.ones(3))

    def fn(a, b, c, d, e, f):
        a.add_(1)  # written: read in place, never copied
        return a + b + c[0] + d.sum() + e + f + state + param

    base = torch.randn(6)
    a, b, d, e, f = torch.randn(3), torch.randn(3), torch.randn(3, 4)[:, 0], torch.randn(3), torch.randn(3)
    c = base[:3].view(1, 3)
    tensors = [a, b, c, d, e, f]
    prog = capture(fn, tensors).program
    got = inputs_to_copy_in(prog, tensors, borrowed=[4], on_device=lambda t: True)
    # a written, d strided (not dense), e borrowed by the caller
    assert got == (1, 2, 5)
    assert inputs_to_copy_in(prog, tensors) == ()  # on the CPU: nothing (no node to re-point)
    lazy = [a, b._neg_view(), c, d, e, f]  # a lazy negation: its copy is a kernel
    assert inputs_to_copy_in(prog, lazy, borrowed=[4], on_device=lambda t: True) == (2, 5)


class FakeRuntime:
    """cuda-bindings' runtime as CopyInNodes uses it: memcpy nodes with (dst, src, bytes)."""

    class cudaError_t:
        cudaSuccess = 0

    class cudaGraphNodeType:
        cudaGraphNodeTypeMemcpy = 1

    class cudaMemcpyKind:
        cudaMemcpyDeviceToDevice = "d2d"

    def __init__(self, nodes: dict[str, tuple[int, int, int]]) -> None:
        self.nodes = nodes
        self.calls: list[tuple] = []

    def cudaGraph_t(self, init_value: int) -> int:
        return init_value

    cudaGraphExec_t = cudaGraph_t

    def cudaGraphGetNodes(self, g: int, n: int) -> tuple:
        return 0, list(self.nodes) + ["kernel"], len(self.nodes) + 1

    def cudaGraphNodeGetType(self, node: str) -> tuple:
        return 0, 1 if node in self.nodes else 0

    def cudaGraphMemcpyNodeGetParams(self, node: str) -> tuple:
        dst, src, count = self.nodes[node]
        ptr = lambda p: types.SimpleNamespace(ptr=p)  # noqa: E731
        return 0, types.SimpleNamespace(dstPtr=ptr(dst), srcPtr=ptr(src),
                                        extent=types.SimpleNamespace(width=count, height=1, depth=1))

    def cudaGraphExecMemcpyNodeSetParams1D(self, exe, node, dst, src, count, kind) -> tuple:
        self.calls.append((node, dst, src, count))
        return (0,)


class Graph:
    def raw_cuda_graph(self) -> int:
        return 1

    def raw_cuda_graph_exec(self) -> int:
        return 2


def test_the_node_is_found_by_its_source_and_re_pointed_at_each_call_s_tensor():
    from flowexec.runtime.staging import CopyInNodes

    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)  # dense, not contiguous
    rt = FakeRuntime({"copy": (111, x.data_ptr(), x.numel() * 4), "other": (222, 333, 8)})
    nodes = CopyInNodes.from_graph(rt, Graph(), {1: x})
    assert nodes is not None and nodes.nodes == ["copy"] and nodes.dst == [111]
    nodes.point([None, x])
    assert rt.calls == []  # the captured tensor: nothing to do
    x2 = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    nodes.point([None, x2])
    assert rt.calls == [("copy", 111, x2.data_ptr(), x.numel() * 4)]
    nodes.point([None, x2])
    assert len(rt.calls) == 1  # the same address again: free
    x3 = torch.randn(2, 3, 4, 5)  # laid out otherwise: copied into the captured layout, held
    nodes.point([None, x3])
    held = nodes.held[0]
    assert held.stride() == x.stride() and torch.equal(held, x3) and rt.calls[-1][2] == held.data_ptr()
    nodes.point([None, x2])
    assert nodes.held == [None] and rt.calls[-1][2] == x2.data_ptr()
    # no node, or the copy's size not matching: None (the caller plans again without the copy)
    assert CopyInNodes.from_graph(FakeRuntime({"other": (222, 333, 8)}), Graph(), {1: x}) is None
    assert CopyInNodes.from_graph(FakeRuntime({"c": (1, x.data_ptr(), 8)}), Graph(), {1: x}) is None


def test_graph_mode_copies_qualifying_inputs_in_and_points_their_nodes(monkeypatch, stand_in_graphs):
    """On CPU with stand-in graphs (the decision forced: CPU tensors have no node to re-point):
    the plan starts with the copy, the runner holds no copy of the input, each call points the
    node, and a graph without the node is planned again without the copy."""
    from flowexec.executable import Executable
    from flowexec.runtime import cuda_graph, staging

    w = torch.randn(4, 4, dtype=torch.float64)
    x, y = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)
    monkeypatch.setattr(Executable, "_copied_in", lambda self, prog, args, pos: (0,))
    pointed: list[Any] = []

    class Nodes:
        def point(self, args: Any) -> None:
            pointed.append(args[0])
            # A CUDA graph's memcpy node now reads args[0]; the stand-in graph re-runs the body
            # on the runner's list, where the runner keeps nothing for this input: the replay
            # finds args[0] there, and the list is left as the runner keeps it.
            graph = stand_in_graphs[-1]
            body = getattr(graph, "body", graph.fn)
            static = next(c.cell_contents for c in body.__closure__ if isinstance(c.cell_contents, list))

            def replay_body(a: torch.Tensor = args[0]) -> Any:
                kept, static[0] = static[0], a
                try:
                    return body()
                finally:
                    static[0] = kept
            graph.body, graph.fn = body, replay_body
    monkeypatch.setattr(staging, "memcpy_runtime", lambda: "rt")
    monkeypatch.setattr(staging.CopyInNodes, "from_graph", classmethod(lambda cls, rt, g, ex: Nodes()))
    monkeypatch.setattr(cuda_graph, "memcpy_runtime", lambda: "rt")
    monkeypatch.setattr(cuda_graph, "StagingNodes", types.SimpleNamespace(
        from_graph=lambda *a: types.SimpleNamespace(index=[])))
    example = x.clone()
    gone = weakref.ref(example)
    exe = Executable(_fn(w), "graph", "fast", {}).compile_for(example, y)
    del example
    gc.collect()
    assert gone() is None  # nothing of the graph's holds the batch it was captured with
    assert exe.plan.program.ops[0].name == "aten.clone.default"
    runner = exe._last.runner.first
    assert runner.static_inputs[0] is None  # the graph keeps no buffer (nor the caller's tensor) for x
    x2 = torch.randn(3, 4)
    out = exe(x2, y)
    assert pointed[-1] is x2
    torch.testing.assert_close(out[0], _fn(w)(x2, y)[0])
    assert runner.static_inputs[0] is None
    buf = exe.input_buffers[0]  # asked for: made now, in x's layout
    assert buf is not x and buf is not x2 and buf.shape == x.shape and buf.stride() == x.stride()
    x3 = torch.randn(3, 4)
    buf.copy_(x3)
    torch.testing.assert_close(exe(buf, y)[0], _fn(w)(x3, y)[0])
    assert pointed[-1] is buf
    # a graph without the node: planned again without the copy, the input staged as before
    monkeypatch.setattr(staging.CopyInNodes, "from_graph", classmethod(lambda cls, rt, g, ex: None))
    exe = Executable(_fn(w), "graph", "fast", {}).compile_for(x, y)
    assert exe.plan.program.ops[0].name != "aten.clone.default"
    torch.testing.assert_close(exe(x2, y)[0], _fn(w)(x2, y)[0])
