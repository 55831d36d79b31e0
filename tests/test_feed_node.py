"""Fed hyperparameters written by the graph itself (runtime/feed_node.py): the runner's hooks,
where the join goes, the kernel's parameters as the driver reads them, the node's lookup and
rewrite, and the hand-over from the checks, on CPU with a stand-in driver (the GPU tests run the
real kernel node: tests/gpu/test_training_gpu.py)."""
from __future__ import annotations

import ctypes
import gc
import shutil
import subprocess
from typing import Any

import pytest
import torch

import flowexec
from flowexec.build import plan_for
from flowexec.capture import capture
from flowexec.runtime.feed_node import first_reader, node_hooks
from flowexec.runtime.interpreter import lower_trace
from test_staging import stand_in_graphs  # noqa: F401  (a fixture: graph mode on CPU)
from test_training import _step_of


def test_hooks_run_before_their_instruction_and_before_the_return():
    state = torch.zeros(1)

    def fn(x: torch.Tensor) -> torch.Tensor:
        state.add_(1)
        state.mul_(10)
        return x + state

    cap = capture(fn, (torch.ones(1),))
    plan = plan_for(cap.program, "trace")
    names = [ins.op.name for ins in plan.instructions]
    mul = names.index("aten.mul_.Tensor")
    seen: list[tuple[str, float]] = []
    run = lower_trace(plan, hooks={mul: lambda: seen.append(("before mul_", state.item())),
                                   len(names): lambda: seen.append(("end", state.item()))})
    state.zero_()
    run(torch.ones(1))
    assert seen == [("before mul_", 1.0), ("end", 10.0)]


class Recorder:
    """A stand-in FeedNode: what the runner, the checks and graph mode asked of it."""

    def __init__(self, buffer: torch.Tensor, host: Any) -> None:
        self.buffer = buffer
        self.calls: list[Any] = []

    def put(self) -> None:
        self.calls.append("put")

    def join(self) -> None:
        self.calls.append("join")

    def bind(self, graph: Any) -> None:
        self.calls.append(("bind", graph))

    def upload(self, host: torch.Tensor) -> None:
        self.calls.append(("upload", host.tolist()))


def _training_step() -> tuple[Any, Any, Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = _step_of(model, opt)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    step(x, y)  # the optimizer's state exists before capture
    return step, x, y, opt


def test_the_values_join_the_program_before_the_optimizer_reads_them():
    step, x, y, _ = _training_step()
    exe = flowexec.compile(step, x, y, mode="trace")
    plan, feeds = exe.plan, exe.guards.feeds
    buffer = next(iter(feeds.buffers.values()))
    pos = first_reader(plan, buffer)
    storage = buffer.untyped_storage().data_ptr()
    fed = {vid for vid, t in plan.program.state.items() if t.untyped_storage().data_ptr() == storage}
    reads = [k for k, ins in enumerate(plan.instructions) if fed.intersection(ins.op.refs())]
    assert pos == reads[0]
    # after the whole backward: every matrix product comes before it
    mms = [k for k, ins in enumerate(plan.instructions) if ins.op.name.startswith(("aten.mm", "aten.addmm"))]
    assert mms and max(mms) < pos


def _as_cuda_feeds(monkeypatch: Any, feeds: Any) -> tuple[torch.device, torch.Tensor]:
    """The CPU feeds standing for a GPU's: a buffer apart from its host copy, under a CUDA key."""
    (cpu, buffer), = feeds.buffers.items()
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(feeds, "buffers", {cuda: torch.zeros_like(buffer)})
    monkeypatch.setattr(feeds, "host_tensors", {cuda: feeds.host_tensors[cpu]})
    monkeypatch.setattr(feeds, "hosts", {cuda: feeds.hosts[cpu]})
    for s in feeds.slots:
        monkeypatch.setattr(s, "device", cuda)
    monkeypatch.setattr(feeds, "staging", {cuda: [torch.zeros_like(buffer) for _ in range(2)]})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    # the fed buffer's views in the program are still the CPU buffer's: look for those
    monkeypatch.setattr(flowexec.runtime.feed_node, "first_reader", lambda p, b: first_reader(p, buffer))
    return cuda, buffer


def test_node_hooks_hand_a_device_buffer_to_the_graph_node(monkeypatch):
    step, x, y, opt = _training_step()
    exe = flowexec.compile(step, x, y, mode="trace")
    plan, feeds = exe.plan, exe.guards.feeds
    assert node_hooks(plan, feeds) is None  # a CPU buffer: the program reads the host copy itself
    cuda, buffer = _as_cuda_feeds(monkeypatch, feeds)
    made: list[Recorder] = []
    hooks, node = node_hooks(plan, feeds, make=lambda b, h: made.append(Recorder(b, h)) or made[-1])
    assert made == [node] and feeds.writers == {cuda: node}
    assert hooks == {0: node.put, first_reader(plan, buffer): node.join}  # forked at the start
    run = lower_trace(plan, hooks=hooks)
    run(*exe._last.tensors([x, y]))
    assert node.calls == ["put", "join"]
    opt.param_groups[0]["lr"] = 5e-3  # a scheduler's step: the check hands the change over
    assert feeds.refresh() == -1
    assert node.calls[-1][0] == "upload" and 5e-3 in node.calls[-1][1]
    assert feeds.buffers[cuda].abs().sum() == 0  # nothing copied on the program's stream


def test_without_driver_support_the_copy_before_the_call_stays(monkeypatch):
    step, x, y, _ = _training_step()
    exe = flowexec.compile(step, x, y, mode="trace")
    plan, feeds = exe.plan, exe.guards.feeds
    _as_cuda_feeds(monkeypatch, feeds)

    def old_driver(b: Any, h: Any) -> Any:
        raise RuntimeError("FeedNode: this CUDA driver lacks the kernel-node parameter calls")
    assert node_hooks(plan, feeds, make=old_driver) is None and not feeds.writers


def _natively_checked_lr() -> tuple[Any, Any, dict[str, float]]:
    """(feeds of one lr whose buffer stands apart from its host copy, as a GPU's does; their
    guard set with the C++ check attached; the param group) — skipped without the extension."""
    from flowexec.guards import GuardSet
    from flowexec.hyperparams import FeedSlot, Feeds
    from flowexec.runtime import fastcall

    if fastcall.load() is None:
        pytest.skip("native extension not built (python -m flowexec.runtime.build_native)")
    cpu = torch.device("cpu")
    group = {"lr": 0.1}
    feeds = Feeds.build([FeedSlot("lr", group, "lr", -1, 0)], {cpu: torch.tensor([0.1], dtype=torch.float64)})
    feeds.buffers[cpu] = torch.tensor([0.1], dtype=torch.float64)
    gs = GuardSet((), feeds)
    gs.attach(fastcall.guard_checker(gs))
    return feeds, gs, group


def test_the_native_check_hands_a_change_to_the_graph_node():
    feeds, gs, group = _natively_checked_lr()
    cpu = torch.device("cpu")
    buf = feeds.buffers[cpu]
    node = Recorder(buf, None)
    feeds.writers[cpu] = node
    feeds.uploaders[cpu].append(lambda: feeds.upload(cpu))
    group["lr"] = 0.25
    assert gs.native().check() == -1
    assert node.calls == [("upload", [0.25])] and buf.item() == 0.1  # C++ wrote the host copy, the node the rest


def test_the_native_check_takes_back_a_change_whose_upload_was_interrupted():
    feeds, gs, group = _natively_checked_lr()
    cpu = torch.device("cpu")
    node = Recorder(feeds.buffers[cpu], None)
    feeds.writers[cpu] = node
    interrupt = [True]

    def upload() -> None:
        if interrupt.pop():
            raise KeyboardInterrupt
        feeds.upload(cpu)
    feeds.uploaders[cpu].append(upload)
    group["lr"] = 0.25
    with pytest.raises(KeyboardInterrupt):
        gs.native().check()
    assert feeds.host_tensors[cpu].item() == 0.1  # taken back: the next check sees the change
    interrupt.append(False)
    assert gs.native().check() == -1 and node.calls == [("upload", [0.25])]


def test_graph_mode_lowers_its_runner_with_the_hooks_and_binds_the_graph(monkeypatch, stand_in_graphs):
    """Graph mode asks feed_node for hooks, the runner it captures calls them, and the captured
    graph is handed to the node (on the CPU with stand-in graphs)."""
    from flowexec.executable import Executable
    from flowexec.runtime import feed_node

    node = Recorder(None, None)
    asked: list[Any] = []

    def hooks(plan: Any, feeds: Any, make: Any = None) -> Any:
        asked.append(feeds)
        return {0: node.put, len(plan.instructions): node.join}, node
    monkeypatch.setattr(feed_node, "node_hooks", hooks)
    step, x, y, _ = _training_step()
    exe = Executable(step, "graph", "fast", {}).compile_for(x, y)
    assert asked == [exe.guards.feeds]
    assert node.calls[-1] == ("bind", stand_in_graphs[-1])  # after warm-up and capture ran the hooks
    assert node.calls[:2] == ["put", "join"]
    n = len(node.calls)
    exe(x, y)  # a replay of the stand-in graph re-runs the body
    assert node.calls[n:] == ["put", "join"]


# ------------------------------------------------------------------ the kernel and its node
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="no ptxas here")
@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_the_put_kernels_assemble(tmp_path, arch: str):
    from flowexec.runtime.feed_node import MAX_WORDS, put_module_ptx

    src = tmp_path / "fx_put.ptx"
    src.write_text(put_module_ptx())
    r = subprocess.run(["ptxas", f"-arch={arch}", str(src), "-o", str(tmp_path / "a.cubin")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"fx_put{MAX_WORDS}(" in put_module_ptx()


class FakeDriver:
    """libcuda as FeedNode uses it, on host memory: a launch of ``fx_put<n>`` stores its
    parameters' words at the destination (read through ``kernelParams`` as the driver reads
    them); a graph is a list of kernel nodes whose parameters a replay applies the same way."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.nodes: dict[int, tuple[int, list[int]]] = {}  # node -> (func, [dst, words...])

    @staticmethod
    def words(func: int, pointers: int) -> list[int]:
        n = func % 100  # the stand-in CUfunction of fx_put<n> is 1000 + n
        ptrs = (ctypes.c_void_p * (n + 1)).from_address(pointers)
        return [ctypes.c_uint64.from_address(p).value for p in ptrs]

    @staticmethod
    def store(vals: list[int]) -> None:
        dst, words = vals[0], vals[1:]
        ctypes.memmove(dst, (ctypes.c_uint64 * len(words))(*words), 8 * len(words))

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, shm, stream, params, extra) -> int:
        vals = self.words(fn, params)
        self.log.append(("launch", stream, fn))
        if stream == "capturing":  # a launch under capture becomes a node, run at each replay
            self.nodes[len(self.nodes) + 7] = (fn, vals)
        else:
            self.store(vals)
        return 0

    def cuGraphGetNodes(self, graph, nodes, count) -> int:
        if nodes is None:
            count._obj.value = len(self.nodes) + 1  # and one node of another kind
        else:
            for k, n in enumerate([3] + list(self.nodes)):
                nodes[k] = n
        return 0

    def cuGraphNodeGetType(self, node, kind) -> int:
        kind._obj.value = 0 if node in self.nodes else 5
        return 0

    def cuGraphKernelNodeGetParams_v2(self, node, prm) -> int:
        prm._obj.func = self.nodes[node][0]
        return 0

    def cuGraphExecKernelNodeSetParams_v2(self, exe, node, prm) -> int:
        from flowexec.runtime.feed_node import KernelNodeParams

        p = ctypes.cast(prm, ctypes.POINTER(KernelNodeParams)).contents
        self.nodes[node] = (p.func, self.words(p.func, p.kernelParams))  # copied now, as CUDA does
        self.log.append(("set", exe, node))
        return 0

    def replay(self) -> None:
        for fn, vals in self.nodes.values():
            self.store(vals)


@pytest.fixture
def fake_node(monkeypatch):
    """(FeedNode over a CPU buffer of 20 values on a stand-in driver, the driver, the host copy,
    the stream switch that makes launches 'captured')."""
    from flowexec import _cuda_native as nat
    from flowexec.runtime import feed_node

    drv = FakeDriver()
    monkeypatch.setattr(nat, "driver", lambda: drv)
    monkeypatch.setattr(nat, "ensure_context", lambda i: None)
    monkeypatch.setattr(nat, "stream_create", lambda: 0)
    monkeypatch.setattr(feed_node, "put_functions", lambda i: {n: 1000 + n for n in range(1, 17)})
    mode = {"stream": "eager"}

    class Stream:
        def __init__(self, handle: int, device: Any = None) -> None:
            self.cuda_stream = handle

        def wait_event(self, ev: Any) -> None:
            drv.log.append(("branch waits", ev.name))

        def __getattribute__(self, name: str) -> Any:
            return mode["stream"] if name == "cuda_stream" else object.__getattribute__(self, name)

    class Main:
        def wait_event(self, ev: Any) -> None:
            drv.log.append(("program waits", ev.name))

    names = iter(["forked", "written"])

    class Event:
        def __init__(self) -> None:
            self.name = next(names)

        def record(self, stream: Any) -> None:
            drv.log.append(("record", self.name, "program" if isinstance(stream, Main) else "branch"))

    monkeypatch.setattr(torch.cuda, "ExternalStream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: Main())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    buffer = torch.zeros(20, dtype=torch.float64)
    host = torch.arange(20, dtype=torch.float64) / 8
    return feed_node.FeedNode(buffer, host), drv, host, mode


class Graph:
    def raw_cuda_graph(self) -> int:
        return 11

    def raw_cuda_graph_exec(self) -> int:
        return 12


def test_the_put_writes_the_values_of_its_launch_on_a_branch(fake_node):
    node, drv, host, _ = fake_node
    assert [(c.start, c.n) for c in node.chunks] == [(0, 16), (16, 4)]
    node.put(), node.join()
    assert node.buffer.tolist() == host.tolist()
    assert drv.log == [("record", "forked", "program"), ("branch waits", "forked"), ("launch", "eager", 1016),
                       ("launch", "eager", 1004), ("record", "written", "branch"), ("program waits", "written")]


def test_a_change_rewrites_the_bound_nodes_and_reaches_the_next_replay_only(fake_node):
    node, drv, host, mode = fake_node
    mode["stream"] = "capturing"
    node.put(), node.join()  # captured: two nodes holding the values of now
    graph = Graph()
    node.bind(graph)
    assert len(node.graphs) == 1 and sorted(k for _, k in node.graphs[0][2]) == [0, 1]
    assert node.buffer.abs().sum() == 0  # nothing ran yet
    drv.replay()
    assert node.buffer.tolist() == host.tolist()
    host.mul_(-1)  # a schedule's step: the feeds wrote the host copy
    node.upload(host)
    assert node.buffer.tolist() == (-host).tolist()  # nothing written outside the graph
    assert [e[0] for e in drv.log[-2:]] == ["set", "set"]
    drv.replay()
    assert node.buffer.tolist() == host.tolist()


def test_a_graph_without_its_nodes_is_refused_and_a_dropped_graph_is_let_go(fake_node):
    node, drv, host, mode = fake_node
    with pytest.raises(RuntimeError, match="holds 0 of the 2 kernel nodes"):
        node.bind(Graph())  # captured from a runner without the hooks
    mode["stream"] = "capturing"
    node.put()
    graph = Graph()
    node.bind(graph)
    del graph
    gc.collect()
    node.upload(host)
    assert node.graphs == [] and not any(e[0] == "set" for e in drv.log)
