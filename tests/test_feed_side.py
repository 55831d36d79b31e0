"""Fed hyperparameters uploaded beside the program (runtime/feed_side.py): the runner's hooks,
where the wait goes, and the hand-over from the checks, on CPU with stand-in uploads (the GPU
tests run the CUDA events and the side stream: tests/gpu/test_training_gpu.py)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import flowexec
from flowexec.build import plan_for
from flowexec.capture import capture
from flowexec.runtime.feed_side import first_reader, side_hooks
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
    """A stand-in SideUpload: what the runner and the checks asked of it."""

    def __init__(self, buffer: torch.Tensor, staging: Any) -> None:
        self.buffer = buffer
        self.calls: list[Any] = []

    def wait_ready(self) -> None:
        self.calls.append("wait")

    def record_done(self) -> None:
        self.calls.append("done")

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


def test_the_wait_goes_before_the_optimizer_reads_a_fed_value():
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


def test_side_hooks_switch_a_device_buffer_to_the_side_upload(monkeypatch):
    step, x, y, opt = _training_step()
    exe = flowexec.compile(step, x, y, mode="trace")
    plan, feeds = exe.plan, exe.guards.feeds
    assert side_hooks(plan, feeds) is None  # a CPU buffer keeps its copy before the call
    (cpu, buffer), = feeds.buffers.items()
    # The same buffer standing for a GPU's: staging copies, and the key of a CUDA device.
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(feeds, "buffers", {cuda: torch.zeros_like(buffer)})
    monkeypatch.setattr(feeds, "host_tensors", {cuda: feeds.host_tensors[cpu]})
    monkeypatch.setattr(feeds, "hosts", {cuda: feeds.hosts[cpu]})
    for s in feeds.slots:
        monkeypatch.setattr(s, "device", cuda)
    monkeypatch.setattr(feeds, "staging", {cuda: [torch.zeros_like(buffer) for _ in range(2)]})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    # the fed buffer's views in the program are still the CPU buffer's: look for those
    monkeypatch.setattr(flowexec.runtime.feed_side, "first_reader",
                        lambda p, b: first_reader(p, buffer))
    made: list[Recorder] = []
    hooks = side_hooks(plan, feeds, make=lambda b, st: made.append(Recorder(b, st)) or made[-1])
    side, = made
    assert feeds.side == {cuda: side}
    assert set(hooks) == {first_reader(plan, buffer), len(plan.instructions)}
    run = lower_trace(plan, hooks=hooks)
    run(*exe._last.tensors([x, y]))
    assert side.calls == ["wait", "done"]
    opt.param_groups[0]["lr"] = 5e-3  # a scheduler's step: the check hands the change over
    assert feeds.refresh() == -1
    assert side.calls[-1][0] == "upload" and 5e-3 in side.calls[-1][1]
    assert feeds.buffers[cuda].abs().sum() == 0  # nothing copied on the program's stream


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


def test_the_native_check_hands_a_change_to_the_side_upload():
    feeds, gs, group = _natively_checked_lr()
    cpu = torch.device("cpu")
    buf = feeds.buffers[cpu]
    side = Recorder(buf, [])
    feeds.side[cpu] = side
    feeds.uploaders[cpu].append(lambda: feeds.upload(cpu))
    group["lr"] = 0.25
    assert gs.native().check() == -1
    assert side.calls == [("upload", [0.25])] and buf.item() == 0.1  # C++ wrote the host copy, the side the rest


def test_a_torch_without_external_events_keeps_the_copy_before_the_call(monkeypatch):
    step, x, y, _ = _training_step()
    exe = flowexec.compile(step, x, y, mode="trace")
    plan, feeds = exe.plan, exe.guards.feeds
    (cpu, buffer), = feeds.buffers.items()
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(feeds, "buffers", {cuda: buffer})
    monkeypatch.setattr(feeds, "staging", {cuda: [torch.zeros_like(buffer)]})

    def no_external(b: Any, st: Any) -> Any:
        raise TypeError("__new__() got an unexpected keyword argument 'external'")
    assert side_hooks(plan, feeds, make=no_external) is None and not feeds.side


def test_side_upload_waits_for_the_last_readers_and_reuses_a_staging_copy_after_its_copy(monkeypatch):
    """SideUpload's stream and event calls, in order, with stand-ins for torch.cuda's."""
    from flowexec.hyperparams import PinnedRing
    from flowexec.runtime import feed_side

    log: list[tuple[str, ...]] = []
    names = iter(["ready", "done", "copy0", "copy1", "copy2", "copy3"])

    class Stream:
        def __init__(self, device: Any = None, priority: int = 0) -> None:
            log.append(("side stream", str(priority)))

        def wait_event(self, ev: Any) -> None:
            log.append(("side waits", ev.name))

    class Main:
        def wait_event(self, ev: Any) -> None:
            log.append(("program waits", ev.name))

    class Event:
        def __init__(self, external: bool = False) -> None:
            self.name = next(names)

        def record(self, stream: Any) -> None:
            log.append(("record", self.name, "program" if isinstance(stream, Main) else "side"))

        def synchronize(self) -> None:
            log.append(("host waits", self.name))

    main = Main()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(("buffer used on", "side")))
    buffer = torch.zeros(2, dtype=torch.float64)
    side = feed_side.SideUpload(buffer, PinnedRing([torch.zeros(2, dtype=torch.float64) for _ in range(2)]))
    assert log == [("side stream", "-1"), ("buffer used on", "side"), ("record", "ready", "side"),
                   ("record", "done", "side")]
    log.clear()
    side.wait_ready(), side.record_done()
    assert log == [("program waits", "ready"), ("record", "done", "program")]
    log.clear()
    for v in (1.0, 2.0, 3.0):
        side.upload(torch.tensor([v, -v], dtype=torch.float64))
        assert buffer.tolist() == [v, -v]
    assert log == [
        ("side waits", "done"), ("record", "ready", "side"), ("record", "copy0", "side"),
        ("side waits", "done"), ("record", "ready", "side"), ("record", "copy1", "side"),
        # the first staging copy again: only once its copy has passed
        ("host waits", "copy0"), ("side waits", "done"), ("record", "ready", "side"), ("record", "copy2", "side"),
    ]


def test_graph_mode_lowers_its_runner_with_the_side_hooks(monkeypatch, stand_in_graphs):
    """Graph mode asks feed_side for hooks and the runner it captures calls them (on the CPU
    with stand-in graphs; on a GPU the hooks become the graph's event nodes)."""
    from flowexec.executable import Executable
    from flowexec.runtime import feed_side

    calls: list[str] = []
    asked: list[Any] = []

    def hooks(plan: Any, feeds: Any, make: Any = None) -> dict[int, Any]:
        asked.append(feeds)
        return {len(plan.instructions): lambda: calls.append("done")}
    monkeypatch.setattr(feed_side, "side_hooks", hooks)
    step, x, y, _ = _training_step()
    exe = Executable(step, "graph", "fast", {}).compile_for(x, y)
    assert asked == [exe.guards.feeds] and calls  # warm-up and capture ran the hooked runner
    n = len(calls)
    exe(x, y)  # a replay of the stand-in graph re-runs the body
    assert len(calls) == n + 1


def test_the_native_check_takes_back_a_change_whose_upload_was_interrupted():
    feeds, gs, group = _natively_checked_lr()
    cpu = torch.device("cpu")
    side = Recorder(feeds.buffers[cpu], [])
    feeds.side[cpu] = side
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
    assert gs.native().check() == -1 and side.calls == [("upload", [0.25])]
