"""Fed hyperparameters written by the graph itself: an LR schedule adds nothing to a step's
device time.

A schedule's new values (``flowexec/hyperparams.py``'s :class:`~flowexec.hyperparams.Feeds`)
used to be copied into the device buffer the program reads, in stream order before the next
replay: on the H200 that copy and the latency around it left the device idle 2.6-2.9 µs before
each replay whose values changed. The same copy as the graph's own memcpy node cost the same,
and so did a copy on a side stream that the graph waited on through external events (it also
tied the host to the device: ``docs/training.md``).

Here the values travel as *kernel parameters*. In graph mode the runner of a program that reads
fed values launches a one-thread kernel (``fx_put<n>``: ``dst[i] = v_i``, the ``v_i`` passed by
value) on a branch that forks from the program's stream at its start and joins it before the
first instruction that reads a fed value (``lower_trace``'s ``hooks``), so it runs beside the
forward. The captured graph holds it as a kernel node; a change of values rewrites that node's
parameters (``cuGraphExecKernelNodeSetParams``), which CUDA applies from the next launch on
while launches already queued keep theirs. Nothing is copied or launched between replays, the
host never waits for the device, and each replay writes its own values just before its
optimizer reads them: a replay launched before a change reads the old values, one launched after
it the new, as eager would.

Only plans on one stream take this path, with one CUDA buffer of fed values and a driver that
has the kernel-node calls; others keep the copy before each call. A graph whose node is not
found raises (its replays would keep the captured values).
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Any, Callable

import torch

from .. import _cuda_native as nat
from ..plan import ExecutionPlan

MAX_WORDS = 16  # values per kernel (a buffer of more is written by several)
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


def put_ptx(n: int) -> str:
    """PTX of ``fx_put<n>(u64* dst, u64 v0, ..., u64 v<n-1>)``: one thread stores the ``n``
    words it was passed (float64 values, as bits) at ``dst``."""
    params = ", ".join([".param .u64 p_dst"] + [f".param .u64 p_v{i}" for i in range(n)])
    body = "".join(f"\tld.param.u64 %rd2, [p_v{i}];\n\tst.global.u64 [%rd1+{8 * i}], %rd2;\n" for i in range(n))
    return (f".visible .entry fx_put{n}({params})\n{{\n\t.reg .b64 %rd<3>;\n"
            f"\tld.param.u64 %rd0, [p_dst];\n\tcvta.to.global.u64 %rd1, %rd0;\n{body}\tret;\n}}\n")


def put_module_ptx() -> str:
    """The PTX module of ``fx_put1`` .. ``fx_put<MAX_WORDS>`` (PTX ISA 6.0, sm_50: any driver JITs it)."""
    return ".version 6.0\n.target sm_50\n.address_size 64\n" + "".join(put_ptx(n) for n in range(1, MAX_WORDS + 1))


_functions: dict[int, dict[int, int]] = {}


def put_functions(device_index: int) -> dict[int, int]:
    """``{n: CUfunction of fx_put<n>}`` for 1 <= n <= MAX_WORDS, loaded once per device."""
    fns = _functions.get(device_index)
    if fns is None:
        d = nat.driver()
        nat.ensure_context(device_index)
        mod = ctypes.c_void_p()
        nat.check(d.cuModuleLoadData(ctypes.byref(mod), put_module_ptx().encode() + b"\0"), "cuModuleLoadData(fx_put)")
        fns = {}
        for n in range(1, MAX_WORDS + 1):
            f = ctypes.c_void_p()
            nat.check(d.cuModuleGetFunction(ctypes.byref(f), mod, f"fx_put{n}".encode()), "cuModuleGetFunction")
            fns[n] = f.value
        _functions[device_index] = fns
    return fns


class KernelNodeParams(ctypes.Structure):
    """CUDA_KERNEL_NODE_PARAMS_v2 (its first fields are the v1 struct's)."""

    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class _Chunk:
    """One ``fx_put<n>`` launch: words ``[start, start + n)`` of the buffer, its parameter
    values (the destination, then the words) and the pointers to them that CUDA reads;
    :meth:`fill` copies the words in from the host copy at ``host`` (addresses fixed at build)."""

    def __init__(self, fn: int, dst: int, start: int, n: int, host: int) -> None:
        self.start, self.n = start, n
        self.values = (ctypes.c_uint64 * (n + 1))(dst + 8 * start)
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * (n + 1))(*[base + 8 * i for i in range(n + 1)])
        self.params = KernelNodeParams(fn, 1, 1, 1, 1, 1, 1, 0, ctypes.addressof(self.pointers), None, None, None)
        self._copy = (base + 8, host + 8 * start, 8 * n)

    def fill(self) -> None:
        ctypes.memmove(*self._copy)


class FeedNode:
    """One CUDA device's fed values, written by a kernel node of each graph that reads them.

    ``buffer``: the packed float64 buffer the program reads; ``host``: its host copy (what the
    values are now). :meth:`put` and :meth:`join` are the runner's hooks; :meth:`bind` finds
    the node in a captured graph; :meth:`upload` hands changed values to the bound nodes.

    >>> put_ptx(1).splitlines()[0]
    '.visible .entry fx_put1(.param .u64 p_dst, .param .u64 p_v0)'
    """

    def __init__(self, buffer: torch.Tensor, host: torch.Tensor) -> None:
        if any(t.dtype != torch.float64 or not t.is_contiguous() for t in (buffer, host)) or host.shape != buffer.shape:
            raise ValueError("FeedNode: a contiguous float64 buffer and a contiguous float64 host copy of its shape")
        d = nat.driver()
        if d.cuGraphKernelNodeGetParams_v2 is None or d.cuGraphExecKernelNodeSetParams_v2 is None:
            raise RuntimeError("FeedNode: this CUDA driver lacks the kernel-node parameter calls")
        self.device = buffer.device
        self.buffer = buffer
        self.host = host  # (its values, as the bits the kernel stores, are read at its address)
        fns = put_functions(buffer.device.index if buffer.device.index is not None else torch.cuda.current_device())
        n = buffer.numel()
        self.chunks = [_Chunk(fns[min(MAX_WORDS, n - s)], buffer.data_ptr(), s, min(MAX_WORDS, n - s),
                              host.data_ptr()) for s in range(0, n, MAX_WORDS)]
        self._fns = {c.params.func: k for k, c in enumerate(self.chunks)}
        self._launch = d.cuLaunchKernel
        self._set = d.cuGraphExecKernelNodeSetParams_v2
        # A stream of its own (torch's pooled streams may be the program's or the capture's),
        # never destroyed: the allocator records an event on it when the buffer is freed, which
        # may be after this object is gone (one stream per program that writes fed values).
        self.stream = torch.cuda.ExternalStream(nat.stream_create(), device=self.device)
        buffer.record_stream(self.stream)  # written there: not reused while a put is queued
        self.forked, self.written = torch.cuda.Event(), torch.cuda.Event()
        self.graphs: list[tuple[Any, int, list[tuple[int, int]]]] = []  # (graph ref, exec, [(node, chunk)])

    def put(self) -> None:
        """The runner's first call: fork, and write the values now on the branch."""
        main = torch.cuda.current_stream(self.device)
        self.forked.record(main)
        self.stream.wait_event(self.forked)
        s = self.stream.cuda_stream
        for c in self.chunks:
            c.fill()
            nat.check(self._launch(c.params.func, 1, 1, 1, 1, 1, 1, 0, s, ctypes.addressof(c.pointers), None),
                      "cuLaunchKernel(fx_put)")
        self.written.record(self.stream)

    def join(self) -> None:
        """The runner's call before the first reader: the values are in the buffer."""
        torch.cuda.current_stream(self.device).wait_event(self.written)

    def bind(self, graph: torch.cuda.CUDAGraph) -> None:
        """Find this feed's nodes in ``graph`` (captured from the hooked runner with
        ``keep_graph``); a later :meth:`upload` rewrites them. Raises if any is missing."""
        d = nat.driver()
        g = ctypes.c_void_p(graph.raw_cuda_graph())
        count = ctypes.c_size_t(0)
        nat.check(d.cuGraphGetNodes(g, None, ctypes.byref(count)), "cuGraphGetNodes")
        nodes = (ctypes.c_void_p * count.value)()
        nat.check(d.cuGraphGetNodes(g, nodes, ctypes.byref(count)), "cuGraphGetNodes")
        found: list[tuple[int, int]] = []
        kind, prm = ctypes.c_int(), KernelNodeParams()
        for node in nodes:
            if d.cuGraphNodeGetType(node, ctypes.byref(kind)) or kind.value != _KERNEL_NODE:
                continue
            if d.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(prm)) == 0 and prm.func in self._fns:
                found.append((node, self._fns[prm.func]))
        if sorted(k for _, k in found) != list(range(len(self.chunks))):
            raise RuntimeError(f"flowexec: the captured graph holds {len(found)} of the {len(self.chunks)} kernel "
                               "nodes that write its fed hyperparameters; its replays would keep the captured values")
        self.graphs = [e for e in self.graphs if e[0]() is not None]
        self.graphs.append((weakref.ref(graph), graph.raw_cuda_graph_exec(), found))

    def upload(self, host: torch.Tensor) -> None:
        """The values changed (``host``, this feed's host copy, holds them): every bound graph
        writes them from its next launch on. (An unbound runner's :meth:`put` reads them itself.)"""
        for c in self.chunks:
            c.fill()
        if any(ref() is None for ref, _, _ in self.graphs):  # a dropped graph: its exec is gone with it
            self.graphs = [e for e in self.graphs if e[0]() is not None]
        for _, exe, found in self.graphs:
            for node, k in found:
                nat.check(self._set(exe, node, ctypes.byref(self.chunks[k].params)),
                          "cuGraphExecKernelNodeSetParams(fx_put)")


def first_reader(plan: ExecutionPlan, buffer: torch.Tensor) -> int | None:
    """The position of the first instruction that takes a state value on ``buffer``'s storage
    (a fed value), or None where none does."""
    storage = buffer.untyped_storage().data_ptr()
    on_buffer = {vid for vid, t in plan.program.state.items()
                 if isinstance(t, torch.Tensor) and t.device == buffer.device
                 and t.untyped_storage().data_ptr() == storage}
    if not on_buffer:
        return None
    for pos, ins in enumerate(plan.instructions):
        if on_buffer.intersection(ins.op.refs()):
            return pos
    return None


def node_hooks(plan: ExecutionPlan, feeds: Any, make: Callable[[torch.Tensor, torch.Tensor], Any] = FeedNode
               ) -> tuple[dict[int, Callable[[], None]], Any] | None:
    """(the runner's hooks that let ``feeds``' one CUDA buffer be written by a node of the
    graph, the node's owner, which the feeds now upload through), or None where the plan keeps
    the copy before each call: no CUDA buffer, more than one buffer, a plan on several streams,
    no instruction reading the values, or no driver support."""
    if feeds is None or plan.n_streams != 1 or plan.on_workers or len(feeds.buffers) != 1:
        return None
    (d, buffer), = feeds.buffers.items()
    if d.type != "cuda" or buffer is feeds.host_tensors[d]:
        return None
    pos = first_reader(plan, buffer)
    if pos is None:
        return None
    node = feeds.writers.get(d)
    if node is None:
        try:
            node = make(buffer, feeds.host_tensors[d])
        except (OSError, RuntimeError, ValueError):  # no libcuda, an old driver: the copy before each call
            return None
        feeds.attach_writer(d, node)
    if pos == 0:
        return {0: lambda: (node.put(), node.join())}, node
    return {0: node.put, pos: node.join}, node
