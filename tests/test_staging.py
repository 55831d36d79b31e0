"""In-graph staging of per-call inputs: the memcpy-node state machine and the runner's fallback,
on CPU with a recording stand-in for CUDA's runtime bindings (the GPU tests run the real thing)."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from flowexec.runtime import cuda_graph as CG
from flowexec.runtime.staging import StagingNodes


class FakeRuntime:
    """Records the node updates StagingNodes asks for; ``fail`` makes them return an error."""

    class cudaMemcpyKind:
        cudaMemcpyDeviceToDevice = "d2d"

    class cudaError_t:
        cudaSuccess = 0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail = False

    def cudaGraphNodeSetEnabled(self, graph_exec: Any, node: Any, on: int) -> tuple[int]:
        self.calls.append(("enabled", node, on))
        return (700 if self.fail else 0,)

    def cudaGraphExecMemcpyNodeSetParams1D(self, graph_exec: Any, node: Any, dst: int, src: int, nbytes: int,
                                           kind: str) -> tuple[int]:
        self.calls.append(("source", node, src, nbytes))
        return (700 if self.fail else 0,)

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def test_nodes_follow_addresses_buffers_and_strided_inputs():
    rt = FakeRuntime()
    static, example = torch.zeros(4), torch.ones(4)
    st = StagingNodes(rt, "exec", [(0, "n0", static, example.data_ptr())])
    st.point((example,))
    assert rt.take() == []  # the node already reads the example
    a = torch.randn(4)
    st.point((a,))
    assert rt.take() == [("source", "n0", a.data_ptr(), 16)]
    st.point((a,))
    assert rt.take() == []  # same address as last call: nothing to do
    st.point((static,))
    assert rt.take() == [("enabled", "n0", 0)]  # the caller filled the buffer itself
    st.point((static,))
    assert rt.take() == []
    b = torch.randn(4)
    st.point((b,))
    assert rt.take() == [("enabled", "n0", 1), ("source", "n0", b.data_ptr(), 16)]
    strided = torch.randn(8)[::2]
    st.point((strided,))
    assert rt.take() == [("enabled", "n0", 0)] and torch.equal(static, strided)
    strided.fill_(3.0)
    st.point((strided,))  # staged from Python on every call
    assert rt.take() == [] and torch.equal(static, torch.full((4,), 3.0))
    st.point((a,))
    assert rt.take() == [("enabled", "n0", 1), ("source", "n0", a.data_ptr(), 16)]


def test_a_failed_update_names_the_call():
    rt = FakeRuntime()
    st = StagingNodes(rt, "exec", [(0, "n0", torch.zeros(2), 0)])
    rt.fail = True
    with pytest.raises(RuntimeError, match="cudaGraphExecMemcpyNodeSetParams1D failed"):
        st.point((torch.ones(2),))


class FakeGraph:
    """Replays by running the captured body again, as the real graph would re-run its work."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()

    def pool(self) -> None:
        return None


def test_runner_stages_from_python_when_a_copy_is_no_memcpy_node(monkeypatch):
    captures: list[bool] = []

    def fake_capture(fn: Callable[[], Any], warmup: int = 3, pool: Any = None, keep_graph: bool = False):
        captures.append(keep_graph)
        return FakeGraph(fn), fn()
    monkeypatch.setattr(CG, "memcpy_runtime", lambda: FakeRuntime())
    monkeypatch.setattr(CG, "capture_graph", fake_capture)
    monkeypatch.setattr(StagingNodes, "from_graph", classmethod(lambda cls, rt, g, statics, ex: cls(rt, None, [])))
    out = torch.zeros(3)

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        out.copy_(x * 2)
        return [out]
    runner = CG.CudaGraphRunner(run, [torch.ones(3)], [], [False])
    # The graph that read the example in place was dropped: captured again without in-graph copies.
    assert captures == [True, False] and runner.staging is None
    assert torch.equal(runner((torch.full((3,), 5.0),))[0], torch.full((3,), 10.0))
