"""gc="async": the values a plan frees are dropped on one worker thread; results equal eager."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.models import make_mlp, make_step
from flowexec.runtime.gc import AsyncCollector, collector
from helpers import assert_close_rel, assert_same_state, twin

pytestmark = pytest.mark.timeout(60)


class _Tracked:
    """Records the thread that drops it."""

    dropped_on: list[int] = []

    def __del__(self) -> None:
        _Tracked.dropped_on.append(threading.get_ident())


def test_the_collector_drops_on_its_own_thread_in_order():
    c = AsyncCollector()
    _Tracked.dropped_on = []
    order: list[int] = []

    class Numbered:
        def __init__(self, k: int) -> None:
            self.k = k

        def __del__(self) -> None:
            order.append(self.k)

    for k in range(50):
        c.collect((Numbered(k), _Tracked()))
    assert c.drain(timeout=10)
    assert order == list(range(50))
    assert set(_Tracked.dropped_on) == {c.thread.ident} and c.thread.ident != threading.get_ident()


def test_trace_mode_with_async_gc_trains_like_eager():
    torch.manual_seed(0)
    (m1, o1), (m2, o2) = twin(make_mlp(16, 2), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    eager, mine = make_step(m1, o1, F.mse_loss), make_step(m2, o2, F.mse_loss)
    data = [(torch.randn(8, 16), torch.randn(8, 10)) for _ in range(5)]
    eager(*data[0]), mine(*data[0])
    exe = flowexec.compile(mine, *data[0], gc="async")
    before = collector()._handed + collector().inline
    for x, y in data[1:]:
        assert_close_rel(exe(x, y), eager(x, y), what="loss")
    assert_same_state(m1, m2)
    from flowexec.runtime.gc import handed_frees

    sites = sum(1 for vals, _ in handed_frees(exe.plan) if vals)
    # one hand-over per free site per call (queued, or refused by the backlog bound and freed inline)
    assert sites > 0 and collector()._handed + collector().inline - before == sites * 4
    assert collector().drain(timeout=10)


def test_async_plans_free_what_fast_plans_free():
    from flowexec.capture import capture
    from flowexec.plan import build_plan
    from flowexec.runtime.interpreter import lower_trace

    def f(x):
        a = x * 2
        b = a + 1
        return b.sin().sum()

    prog = capture(f, (torch.randn(4),)).program
    fast, slow = build_plan(prog, "fast"), build_plan(prog, "async")
    assert [i.frees for i in fast.instructions] == [i.frees for i in slow.instructions]
    seen: list[tuple] = []
    x = torch.randn(4)
    import flowexec.runtime.gc as G

    real = G._COLLECTOR
    spy = type("Spy", (), {"bounded": lambda self, limit: lambda v, n: seen.append(v)})()
    G._COLLECTOR = spy
    try:
        run = lower_trace(slow)
        got = run(x)
    finally:
        G._COLLECTOR = real
    torch.testing.assert_close(got[0], f(x))
    # a, b die with their storages (handed over); the sum's input is b + 1, also a storage
    assert [len(v) for v in seen] == [len(i.frees) for i in slow.instructions if i.frees]
    assert len(seen) == 3
    assert all(isinstance(t, torch.Tensor) for v in seen for t in v)


def test_async_gc_is_refused_where_it_cannot_run():
    with pytest.raises(flowexec.OptionError, match=r"gc='async' runs in trace mode only \(got mode='graph'\)"):
        flowexec.compile(lambda x: x * 2, torch.ones(2), mode="graph", gc="async")
    with pytest.raises(flowexec.OptionError, match="gc='slow' is not a garbage-collection mode; valid: fast, async, none"):
        flowexec.compile(lambda x: x * 2, torch.ones(2), gc="slow")
    torch._dynamo.reset()
    bad = torch.compile(lambda x: x * 2, backend="flowexec", options={"mode": "graph", "gc": "async"})
    with pytest.raises(Exception, match="gc='async' runs in trace mode"):
        bad(torch.ones(2))


def test_backend_with_async_gc_trains_like_eager():
    torch._dynamo.reset()
    torch.manual_seed(1)
    (m1, o1), (m2, o2) = twin(make_mlp(16, 2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    eager = make_step(m1, o1, F.mse_loss)
    mine = make_step(torch.compile(m2, backend="flowexec", options={"gc": "async"}), o2, F.mse_loss)
    for _ in range(3):
        x, y = torch.randn(8, 16), torch.randn(8, 10)
        assert_close_rel(mine(x, y), eager(x, y), what="loss")
    assert_same_state(m1, m2)
    assert collector().drain(timeout=10)


# One child process checks two things, each reported on its own: a process importing torch and
# flowexec costs seconds, and neither check needs a process without the other's.
_CHILD = """
import json, os, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
import flowexec
from flowexec.runtime.gc import collector

def chain(x):
    a = x * 1.5
    b = a + 0.5
    c = b * b
    return (c - a).sum()

# A forked child gets a collector of its own (1 Mi floats).
x = torch.randn(2**20)
exe = flowexec.compile(chain, x, gc="async")
exe(x)
forked = None
if hasattr(os, "fork"):
    pid = os.fork()
    if pid == 0:
        for _ in range(5):
            exe(x)
        ok = collector().thread.is_alive() and collector().drain(timeout=20) and not collector()._queue
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    forked = os.waitstatus_to_exitcode(status)
print(json.dumps({{"forked_child_exit_code": forked}}), flush=True)

# Then this process exits with large frees still queued (16 Mi floats: 64 MiB each).
x = torch.randn(16 * 2**20)
exe = flowexec.compile(chain, x, gc="async")
exe(x)
for _ in range(3):
    exe(x)
"""


@pytest.fixture(scope="module")
def child():
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _CHILD.format(root=root)], capture_output=True, text=True,
                          timeout=120)
    lines = done.stdout.strip().splitlines()
    return done, (json.loads(lines[-1]) if lines else {})


def test_a_process_exits_cleanly_with_frees_still_queued(child):
    """Large frees queued at exit are finished before shutdown (a daemon thread stopped in the
    middle of freeing a 64 MiB tensor aborted the process)."""
    done, _ = child
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_gets_a_collector_of_its_own(child):
    done, report = child
    assert report.get("forked_child_exit_code") == 0, (report, done.stderr[-3000:])


def test_the_backlog_is_bounded_in_bytes():
    c = AsyncCollector()
    release = threading.Event()

    class Blocker:
        def __del__(self) -> None:
            release.wait(20)

    hand = c.bounded(limit=350)
    assert hand((Blocker(),), 0)  # the worker now waits inside this free
    taken = [hand((bytearray(100),), 100) for _ in range(6)]
    assert taken == [True, True, True, False, False, False]  # 300 queued; a fourth would pass 350
    assert c.backlog_bytes == 300 and c.inline == 3
    release.set()
    assert c.drain(timeout=20) and c.backlog_bytes == 0
    assert hand((bytearray(100),), 100)  # room again


def test_async_never_frees_a_value_before_its_last_use():
    """Instrumented: every storage the call creates dies (on whichever thread) only after the
    last op that reads it has returned."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils import _pytree as pytree
    import weakref

    clock = [0]
    last_read: dict[int, int] = {}  # storage token -> clock of the last op reading it
    died: dict[int, int] = {}
    token_of: dict[int, int] = {}
    lock = threading.Lock()

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            with lock:
                clock[0] += 1
                now = clock[0]
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) in token_of:
                    last_read[token_of[id(t.untyped_storage())]] = now
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    if id(s) not in token_of:  # a storage this op created (ids of dead ones are reused)
                        tok = token_of[id(s)] = len(last_read)
                        last_read[tok] = now

                        def gone(k=id(s), tok=tok):
                            died[tok] = clock[0]
                            token_of.pop(k, None)

                        weakref.finalize(s, gone)
            return out

    x = torch.randn(256, 256)

    def f(x):
        a = x * 2
        b = a.exp()
        c = (a + b).tanh()
        d = c @ c
        return (d * b).sum()

    exe = flowexec.compile(f, x, gc="async", gc_backlog=1 << 30)  # everything goes to the worker
    with Probe():
        for _ in range(5):
            exe(x)
        assert collector().drain(timeout=20)
    freed = [k for k in died if k in last_read]
    assert len(freed) >= 5 * 4
    assert all(died[k] >= last_read[k] for k in freed), [(died[k], last_read[k]) for k in freed]


def test_async_peak_is_within_10_percent_of_fast():
    from flowexec.runtime.memtrack import measure_memory

    def many(x):  # many intermediates, each dying one op later
        for k in range(30):
            x = (x * 1.01 + k).relu()
        return x.sum()

    x = torch.randn(256, 256)
    fast = measure_memory(flowexec.compile(many, x), x)["achieved_peak_bytes"]
    slow = measure_memory(flowexec.compile(many, x, gc="async"), x)["achieved_peak_bytes"]
    assert fast > 0 and slow <= 1.1 * fast, (fast, slow)
