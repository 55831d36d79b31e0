"""Per-call inputs staged by memcpy nodes inside a captured CUDA graph (see :class:`StagingNodes`)."""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch


@functools.lru_cache(maxsize=None)
def memcpy_runtime() -> Any:
    """CUDA's runtime bindings (``cuda-bindings``) where installed and torch keeps captured
    graphs (``CUDAGraph(keep_graph=True)``, ``raw_cuda_graph_exec``): they re-point memcpy nodes.
    None otherwise, and inputs are staged from Python."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    if not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return None
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except (TypeError, RuntimeError):  # torch older than keep_graph, or no CUDA build
        return None
    return runtime


class StagingNodes:
    """Per-call inputs copied by memcpy nodes inside the graph; a call only re-points them.

    Staging an input with a ``copy_`` before each replay costs a launch from Python (about
    7 µs, and 13 µs for a mixed-dtype ``_foreach_copy_``). Instead the graph itself begins with
    one device-to-device memcpy node per staged input, captured from the example input. When a
    call passes a tensor at another address, ``cudaGraphExecMemcpyNodeSetParams1D`` re-points
    that node's source (about 1 µs, and only future launches see it, so replays already queued
    keep their sources); the same address as last time costs nothing; the static buffer itself
    disables the node. Inputs that are not contiguous are copied from Python as before.
    """

    def __init__(self, rt: Any, graph_exec: Any, entries: Sequence[tuple[int, Any, torch.Tensor, int]]) -> None:
        """``entries``: (argument position, memcpy node, static buffer, source address now)."""
        self.rt = rt
        self.exec = graph_exec
        self.index = [i for i, _, _, _ in entries]  # argument positions staged by a node
        self.nodes = [node for _, node, _, _ in entries]
        self.statics = [st for _, _, st, _ in entries]
        self.dst = [st.data_ptr() for st in self.statics]
        self.nbytes = [st.numel() * st.element_size() for st in self.statics]
        self.src = [src for _, _, _, src in entries]  # what each node reads now; -1: disabled
        self.pairs = list(enumerate(self.index))
        self._d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice

    @classmethod
    def from_graph(cls, rt: Any, graph: torch.cuda.CUDAGraph, statics: dict[int, torch.Tensor],
                   example: dict[int, torch.Tensor]) -> StagingNodes:
        """Find the memcpy node of each staged input by its (static buffer, example) addresses."""
        g = rt.cudaGraph_t(init_value=graph.raw_cuda_graph())
        err, _, n = rt.cudaGraphGetNodes(g, 0)
        err, nodes, n = rt.cudaGraphGetNodes(g, n)
        _check(rt, err, "cudaGraphGetNodes")
        by_addr: dict[tuple[int, int], Any] = {}
        for node in nodes:
            err, kind = rt.cudaGraphNodeGetType(node)
            if err == rt.cudaError_t.cudaSuccess and kind == rt.cudaGraphNodeType.cudaGraphNodeTypeMemcpy:
                err, prm = rt.cudaGraphMemcpyNodeGetParams(node)
                if err == rt.cudaError_t.cudaSuccess:
                    by_addr.setdefault((int(prm.dstPtr.ptr), int(prm.srcPtr.ptr)), node)
        entries = []
        for i, st in statics.items():
            node = by_addr.get((st.data_ptr(), example[i].data_ptr()))
            if node is not None:  # not found (e.g. torch copied with a kernel): staged from Python
                entries.append((i, node, st, example[i].data_ptr()))
        return cls(rt, rt.cudaGraphExec_t(init_value=graph.raw_cuda_graph_exec()), entries)

    def point(self, args: Sequence[Any]) -> None:
        """Aim every node at this call's argument (hot path: one pointer compare per input)."""
        src = self.src
        for k, i in self.pairs:
            if args[i].data_ptr() != src[k]:
                self.repoint(k, args[i])

    def repoint(self, k: int, a: torch.Tensor) -> None:
        """Aim node ``k`` at ``a``: re-point, disable (static buffer) or stage from Python (strided)."""
        rt, ptr = self.rt, a.data_ptr()
        if ptr == self.dst[k] or not a.is_contiguous():
            if self.src[k] != -1:
                _check(rt, rt.cudaGraphNodeSetEnabled(self.exec, self.nodes[k], 0)[0], "cudaGraphNodeSetEnabled")
            if ptr != self.dst[k]:
                self.statics[k].copy_(a)  # strided input: staged from Python, every call
            self.src[k] = -1 if ptr != self.dst[k] else ptr
            return
        if self.src[k] == -1 or self.src[k] == self.dst[k]:
            _check(rt, rt.cudaGraphNodeSetEnabled(self.exec, self.nodes[k], 1)[0], "cudaGraphNodeSetEnabled")
        _check(rt, rt.cudaGraphExecMemcpyNodeSetParams1D(self.exec, self.nodes[k], self.dst[k], ptr, self.nbytes[k],
                                                         self._d2d)[0], "cudaGraphExecMemcpyNodeSetParams1D")
        self.src[k] = ptr


def graph_node_count(graph: torch.cuda.CUDAGraph) -> int | None:
    """Nodes in a graph captured with ``keep_graph`` (None without CUDA's runtime bindings)."""
    rt = memcpy_runtime()
    if rt is None:
        return None
    err, _, n = rt.cudaGraphGetNodes(rt.cudaGraph_t(init_value=graph.raw_cuda_graph()), 0)
    return int(n) if err == rt.cudaError_t.cudaSuccess else None


def _check(rt: Any, err: Any, what: str) -> None:
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"flowexec: {what} failed: {err}")
