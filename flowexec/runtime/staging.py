"""Per-call inputs staged by memcpy nodes inside a captured CUDA graph (see :class:`StagingNodes`)."""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from ..passes.copy_in import dense


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


class _MemcpyNodes:
    """Memcpy nodes of an instantiated graph, one per argument position in ``index``, whose
    sources a call re-points (``src``: what each reads now): what :class:`StagingNodes` and
    :class:`CopyInNodes` share."""

    def __init__(self, rt: Any, graph_exec: Any, index: Sequence[int], nodes: Sequence[Any], dst: Sequence[int],
                 nbytes: Sequence[int], src: Sequence[int]) -> None:
        self.rt = rt
        self.exec = graph_exec
        self.index = list(index)  # argument positions
        self.nodes, self.dst, self.nbytes, self.src = list(nodes), list(dst), list(nbytes), list(src)
        self.pairs = list(enumerate(self.index))
        self._d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice

    def _aim(self, k: int, ptr: int) -> None:
        """Node ``k`` reads ``ptr`` from the graph's next launch on (queued replays keep theirs)."""
        _check(self.rt, self.rt.cudaGraphExecMemcpyNodeSetParams1D(self.exec, self.nodes[k], self.dst[k], ptr,
                                                                   self.nbytes[k], self._d2d)[0],
               "cudaGraphExecMemcpyNodeSetParams1D")
        self.src[k] = ptr


class StagingNodes(_MemcpyNodes):
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
        """``entries``: (argument position, memcpy node, static buffer, source address now; -1: disabled)."""
        self.statics = [st for _, _, st, _ in entries]
        super().__init__(rt, graph_exec, [i for i, _, _, _ in entries], [node for _, node, _, _ in entries],
                         [st.data_ptr() for st in self.statics], [st.numel() * st.element_size() for st in self.statics],
                         [src for _, _, _, src in entries])

    @classmethod
    def from_graph(cls, rt: Any, graph: torch.cuda.CUDAGraph, statics: dict[int, torch.Tensor],
                   example: dict[int, torch.Tensor]) -> StagingNodes:
        """Find the memcpy node of each staged input by its (static buffer, example) addresses."""
        by_addr: dict[tuple[int, int], Any] = {}
        for node, dst, src, _ in _memcpy_nodes(rt, graph):
            by_addr.setdefault((dst, src), node)
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
        self._aim(k, ptr)


class CopyInNodes(_MemcpyNodes):
    """Per-call inputs that the program copies in itself (``passes/copy_in.py``): in the graph
    the program's ``clone`` of each is a memcpy node from the captured tensor into the graph's
    pool, where the plan frees the copy after its last reader. A call re-points the node's
    source at its own tensor (``cudaGraphExecMemcpyNodeSetParams1D``, only future launches see
    it); a tensor laid out otherwise than the captured one is first copied into that layout, and
    that copy held until the next call (the replay reads it)."""

    def __init__(self, rt: Any, graph_exec: Any, entries: Sequence[tuple[int, Any, int, torch.Tensor]]) -> None:
        """``entries``: (argument position, memcpy node, its destination address, example)."""
        super().__init__(rt, graph_exec, [i for i, _, _, _ in entries], [node for _, node, _, _ in entries],
                         [dst for _, _, dst, _ in entries], [ex.numel() * ex.element_size() for _, _, _, ex in entries],
                         [ex.data_ptr() for _, _, _, ex in entries])
        self.layout = [(ex.shape, ex.stride(), ex.dtype) for _, _, _, ex in entries]
        self.held: list[torch.Tensor | None] = [None] * len(entries)

    @classmethod
    def from_graph(cls, rt: Any, graph: torch.cuda.CUDAGraph, examples: dict[int, torch.Tensor]) -> CopyInNodes | None:
        """The memcpy node that reads each example (by its address and size), or None when one
        has none, or more than one (the copy became a kernel: the graph reads the address itself)."""
        found: dict[int, list[tuple[Any, int]]] = {}
        for node, dst, src, count in _memcpy_nodes(rt, graph):
            found.setdefault(src, []).append((node, dst, count))
        entries = []
        for i, ex in examples.items():
            nodes = [(n, d) for n, d, c in found.get(ex.data_ptr(), []) if c == ex.numel() * ex.element_size()]
            if len(nodes) != 1:
                return None
            entries.append((i, nodes[0][0], nodes[0][1], ex))
        return cls(rt, rt.cudaGraphExec_t(init_value=graph.raw_cuda_graph_exec()), entries)

    def point(self, args: Sequence[Any]) -> None:
        """Aim every node at this call's argument (hot path: one pointer compare per input)."""
        src, held = self.src, self.held
        for k, i in self.pairs:
            a = args[i]
            if a.data_ptr() != src[k] or held[k] is not None:
                self.repoint(k, a)

    def repoint(self, k: int, a: torch.Tensor) -> None:
        shape, stride, dtype = self.layout[k]
        if a.stride() == stride and a.dtype == dtype and dense(a):
            self.held[k] = None
        else:  # (the signature keeps shape and dtype; strides may differ)
            a = self.held[k] = torch.empty_strided(shape, stride, dtype=dtype, device=a.device).copy_(a)
        if a.data_ptr() != self.src[k]:
            self._aim(k, a.data_ptr())


def _memcpy_nodes(rt: Any, graph: torch.cuda.CUDAGraph) -> list[tuple[Any, int, int, int]]:
    """(node, destination, source, bytes) of each 1-D memcpy node of a graph kept with ``keep_graph``."""
    g = rt.cudaGraph_t(init_value=graph.raw_cuda_graph())
    err, _, n = rt.cudaGraphGetNodes(g, 0)
    err, nodes, n = rt.cudaGraphGetNodes(g, n)
    _check(rt, err, "cudaGraphGetNodes")
    out = []
    for node in nodes:
        err, kind = rt.cudaGraphNodeGetType(node)
        if err != rt.cudaError_t.cudaSuccess or kind != rt.cudaGraphNodeType.cudaGraphNodeTypeMemcpy:
            continue
        err, prm = rt.cudaGraphMemcpyNodeGetParams(node)
        if err == rt.cudaError_t.cudaSuccess:
            count = int(prm.extent.width) * max(1, int(prm.extent.height)) * max(1, int(prm.extent.depth))
            out.append((node, int(prm.dstPtr.ptr), int(prm.srcPtr.ptr), count))
    return out


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
