"""JobTimer's deferred reading of device events, on the CPU with a fake device: no span is read
before its events completed, none is lost, events are reused, times are anchored."""
from __future__ import annotations

import pytest
import torch

from flowexec.profiler.timers import JobTimer


class FakeDevice:
    """A device whose clock advances 1000 ns per recorded event; while ``busy`` events stay
    pending until :meth:`drain`. Reading an incomplete event raises, as on CUDA; so does
    recording an event that was not handed back."""

    def __init__(self) -> None:
        self.now = 0
        self.busy = False
        self.pending: list[FakeEvent] = []
        self.created = 0
        self.syncs = 0
        self.free: list[FakeEvent] = []
        self.queries = 0

    def record(self) -> FakeEvent:
        if self.free:
            ev = self.free.pop()
        else:
            self.created += 1
            ev = FakeEvent(self)
        ev.record()
        return ev

    def done(self, ev: FakeEvent) -> bool:
        self.queries += 1
        return ev.t is not None

    def offsets_ns(self, anchor: FakeEvent, evs: list[FakeEvent]) -> list[int]:
        return [round(anchor.elapsed_time(ev) * 1e6) for ev in evs]

    def n_free(self) -> int:
        return len(self.free)

    def release(self, evs: list[FakeEvent]) -> None:
        assert not any(ev in self.free for ev in evs), "an event handed back twice"
        self.free += evs

    def synchronize(self) -> None:
        self.syncs += 1
        self.drain()
        self.busy = False  # what it runs next (the anchor) completes at once

    def drain(self) -> None:
        for ev in self.pending:
            ev.t = ev.queued
        self.pending = []


class FakeEvent:
    def __init__(self, dev: FakeDevice) -> None:
        self.dev, self.t, self.queued = dev, None, None

    def record(self) -> None:
        assert self not in self.dev.free, "recorded while in the free pool"
        self.dev.now += 1000
        self.queued, self.t = self.dev.now, None
        if self.dev.busy:
            self.dev.pending.append(self)
        else:
            self.t = self.queued

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, other: FakeEvent) -> float:
        if self.t is None or other.t is None:
            raise RuntimeError("event not complete")
        return (other.t - self.t) / 1e6


@pytest.fixture(params=["python", "native"])
def dev(request):
    """The fake device as Python events, and as the native event clock over a fake driver."""
    if request.param == "python":
        return FakeDevice()
    from flowexec.runtime import fastcall
    from test_event_clock import NativeFake

    if fastcall.load() is None:
        fastcall.build()
    return NativeFake()


def _step(t: JobTimer, k: int, n: int = 3) -> None:
    for m in range(n):
        t.end(t.begin(step=k, stage=0, kind="F", micro=m))


def test_flush_returns_only_completed_spans_and_the_rest_later(dev):
    t = JobTimer(torch.device("cpu"), rank=1, host="h", events=dev, reanchor_s=None)
    _step(t, 0)  # the first span anchors: one synchronisation
    assert dev.syncs == 1
    assert [s.micro for s in t.flush()] == [0, 1, 2]  # the device was idle: all complete
    dev.busy = True
    _step(t, 1)
    assert t.flush() == []  # still on the device: nothing read, nothing waited for
    _step(t, 2)
    dev.drain()
    assert [(s.step, s.micro) for s in t.flush()] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert dev.syncs == 1  # steady state: no synchronisation
    _step(t, 3)
    rest = t.finish()  # the end of the run waits
    assert [(s.step, s.micro) for s in rest] == [(3, 0), (3, 1), (3, 2)] and dev.syncs == 2
    assert t.finish() == [] and t.drift_ns is not None


def test_device_times_are_anchored_and_durations_exact(dev):
    t = JobTimer(torch.device("cpu"), events=dev, reanchor_s=None)
    a = t.begin(step=0, stage=0, kind="F", micro=0)  # anchor at device 1000, start event at 2000
    b = t.begin(step=0, stage=0, kind="send", micro=0, stream="comm")  # 3000
    t.end(b)  # 4000
    t.end(a)  # 5000
    anchor_host = t._anchor[1]
    f, s = t.finish()
    assert (f.clock, f.kind, s.kind) == ("cuda", "F", "send")
    assert (f.start_ns - anchor_host, f.end_ns - anchor_host) == (1000, 4000)
    assert (s.start_ns - anchor_host, s.end_ns - anchor_host) == (2000, 3000)
    assert f.issue_ns >= anchor_host  # issued after the anchor's host reading


def test_events_are_reused_across_steps(dev):
    t = JobTimer(torch.device("cpu"), events=dev, reanchor_s=None)
    for k in range(50):
        _step(t, k)
        assert len(t.flush()) == 3
    assert dev.created <= 8  # anchor + one step's 6 events (+ slack), not 300
    assert t.events_created == dev.created


def test_a_span_that_never_ended_is_dropped_and_its_event_returned(dev):
    t = JobTimer(torch.device("cpu"), events=dev, reanchor_s=None)
    t.begin(step=0, stage=0, kind="B", micro=0)
    t.end(t.begin(step=0, stage=0, kind="F", micro=1))
    assert [s.kind for s in t.flush()] == ["F"]
    assert dev.n_free() == 3 and t._waiting == []


def test_a_long_run_is_reanchored_at_a_flush(dev):
    t = JobTimer(torch.device("cpu"), events=dev, reanchor_s=0.0)  # every flush is "too old"
    _step(t, 0)
    first = t._anchor
    dev.busy = True
    _step(t, 1)
    got = t.flush()  # re-anchoring waits, so step 1 comes now, read against the first anchor
    assert [s.step for s in got] == [0, 0, 0, 1, 1, 1] and dev.syncs >= 2
    assert t._anchor is not None and t._anchor is not first


def test_cpu_timer_needs_no_events():
    t = JobTimer(torch.device("cpu"))
    _step(t, 0)
    assert len(t.flush()) == 3 and t.finish() == [] and t.events_created == 0


@pytest.mark.parametrize("busy", [False, True])
def test_every_span_arrives_by_finish(busy, dev):
    t = JobTimer(torch.device("cpu"), events=dev, reanchor_s=None)
    got = []
    for k in range(5):
        dev.busy = busy
        _step(t, k, 2)
        got += t.flush()
        if k % 2:
            dev.drain()
    got += t.finish()
    assert sorted((s.step, s.micro) for s in got) == [(k, m) for k in range(5) for m in range(2)]
    assert all(s.end_ns >= s.start_ns for s in got)


def test_a_batching_timer_reads_events_only_once_a_batch_waits(dev):
    t = JobTimer(torch.device("cpu"), events=dev, reanchor_s=None, batch=7)
    _step(t, 0)
    dev.queries = 0  # (the anchor's own wait reads its event)
    assert t.flush() == [] and not dev.queries  # 3 spans wait: none read
    _step(t, 1)
    assert t.flush() == [] and not dev.queries  # 6
    _step(t, 2)
    got = t.flush()  # 9 >= 7: all read now
    assert [(s.step, s.micro) for s in got] == [(k, m) for k in range(3) for m in range(3)] and dev.queries
    _step(t, 3)
    assert [s.step for s in t.finish()] == [3, 3, 3]  # the end of a run reads the rest
    assert dev.created <= 2 * 9 + 4  # events still come back to the pool
