"""Streams as worker threads: each stream runs its queue in order, events order them.

The same multi-stream plan that runs on CUDA streams runs here on threads: stream ``k`` is a
worker thread that takes items from its queue in order (an op, a wait, a record, a release);
an event is recorded when the recording stream's worker reaches the record (after the op
before it *returned*: on the CPU that is when its work is done) and a wait blocks its worker
until then. So CI runs multi-stream plans for real: a missing wait is a race that a random
delay in the workers can expose (``jitter``), not a no-op.

Two ways of feeding the workers, one machinery:

* ``issue="host"`` (trace mode on CPU with ``streams > 1``): the caller's thread walks the plan
  in program order and appends each item to its stream's queue, as a CUDA runner launches
  kernels into streams; then it joins.
* ``issue="lists"`` (``mode="threaded"``): each side stream's worker is handed its whole list
  once per call (one append per stream) and the caller's thread runs stream 0's; an op runs when the count of its unmet cross-stream
  dependencies (the plan's pruned waits) is zero, each met when its recorder's worker gets
  there. On CUDA each worker launches onto its own CUDA stream and a wait is also a
  ``wait_event`` on the CUDA event the recorder recorded, so the host order and the device
  order both hold.

Workers spin (``spin_us``, 200 µs by default, yielding the GIL) before blocking (on their
queue, or on the event's condition: the record wakes them). Every wait
has a timeout (``timeout_s``) whose error names the instruction; an exception on a worker is
raised on the caller's thread by the join, naming the op and the user's line
(:func:`~flowexec.runtime.interpreter.explain_failure`); the other workers drop the rest of
that call's items.

Values live in one slot table per runner. A freed value's slot is cleared after its last use
on the freeing stream, or — where other streams used it too (``Instruction.stream_uses``, from
:func:`~flowexec.passes.streams.release_streams`) — when the last of those streams has passed
its release item (on CUDA each release also records the tensor on that stream's CUDA stream,
so the caching allocator waits for its kernels).

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> from flowexec.plan import build_plan
    >>> f = lambda x: x.sin() * 2 + x.cos() * 3
    >>> plan = build_plan(capture(f, (torch.ones(3),)).program, streams=2)
    >>> run = lower_workers(plan)
    >>> torch.allclose(run(torch.ones(3))[0], f(torch.ones(3)))
    True
"""
from __future__ import annotations

import atexit
import collections
import itertools
import threading
import time
import weakref
from typing import Any, Callable

import torch

from ..errors import ExecutionError, OptionError
from ..plan import ExecutionPlan
from ..program import Ref, format_op
from .arena import bind_arenas, out_call
from .interpreter import _Renderer, callable_of, explain_failure
from .streams import side_streams

DEFAULT_SPIN_US = 200.0
DEFAULT_TIMEOUT_S = 60.0
_counter = itertools.count()
_sleep = time.sleep
_now = time.perf_counter


class _Abort(Exception):
    """Raised inside a worker's wait when another worker failed: stop this call."""


class CpuEvent:
    """An event between worker threads: ``record`` marks it done for the current call when the
    recording worker reaches it; ``query`` says whether it is; a wait blocks until it is."""

    __slots__ = ("done", "cuda", "cond", "waiters")

    def __init__(self, cuda: bool = False) -> None:
        self.done = 0  # the call number of the last completed record
        self.cuda = torch.cuda.Event() if cuda else None
        self.cond = threading.Condition(threading.Lock())
        self.waiters = 0  # workers blocked on it (past their spin): the record wakes them

    def mark(self, call: int) -> None:
        """Recorded for ``call``: wake the workers that stopped spinning on it."""
        self.done = call
        if self.waiters:  # a waiter counts itself under the lock before its last check: none is missed
            with self.cond:
                self.cond.notify_all()

    def query(self, call: int) -> bool:
        return self.done >= call


class _Worker:
    """One stream: a daemon thread that runs the items of its queue in order."""

    def __init__(self, pool: WorkerPool, index: int) -> None:
        # a weak reference: the thread must not keep the pool (and its plan) alive
        self.pool_ref, self.index = weakref.ref(pool), index
        self.spin_s = pool.spin_s
        self.closed = False
        self.q: collections.deque = collections.deque()
        self.wake = threading.Event()
        self.sleeping = False
        self.finished = 0  # call number of the last call this worker finished
        self.current = -1  # the instruction it runs or waits before, for messages
        self.stream: Any = None  # CUDA: the stream it launches onto during this call
        self.thread = threading.Thread(target=self._loop, name=f"flowexec-stream-{index}", daemon=True)
        self.thread.start()

    def push(self, item: Any) -> None:
        self.q.append(item)
        if self.sleeping:
            self.wake.set()

    def push_all(self, items: Any) -> None:
        self.q.extend(items)
        if self.sleeping:
            self.wake.set()

    def _next(self) -> Any:
        q = self.q
        spin_end = _now() + self.spin_s
        while True:
            try:
                return q.popleft()
            except IndexError:
                pass
            if _now() < spin_end:
                _sleep(0)  # yields the GIL to whoever is to fill the queue
                continue
            self.wake.clear()
            self.sleeping = True
            if not q:  # push sets wake after its append if it saw sleeping: no wake is missed
                self.wake.wait(1.0)
            self.sleeping = False
            if self.closed:
                return None

    def _loop(self) -> None:
        torch._C._set_grad_enabled(False)  # grad mode is per thread: the program holds its backward
        while True:
            item = self._next()
            pool = self.pool_ref()
            if item is None or pool is None:
                return
            fn, idx = item
            if pool.failed is not None and idx != _END:
                continue  # another worker failed: drop the rest of this call
            try:
                if pool.jitter is not None:
                    pool.jitter()
                self.current = idx
                fn()
            except _Abort:
                pass
            except BaseException as e:  # noqa: BLE001  reaches the caller through the join
                pool.fail(idx, e, self.index)


_END = -2  # the index of the end-of-call item

# Every worker still alive at exit is stopped and joined before the interpreter finalizes: a
# daemon thread that finalization stops while it is inside torch (a CUDA launch, a free) aborts
# the process ("terminate called without an active exception", seen on the H200 at exit).
_LIVE_WORKERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_all_workers(timeout_s: float = 5.0) -> None:
    workers = list(_LIVE_WORKERS)
    for w in workers:
        w.closed = True
        w.wake.set()
    deadline = time.monotonic() + timeout_s
    for w in workers:
        w.thread.join(max(0.0, deadline - time.monotonic()))


class WorkerPool:
    """``n`` stream workers, the events of one plan, and the per-call bookkeeping."""

    def __init__(self, n: int, n_events: int, spin_us: float = DEFAULT_SPIN_US, timeout_s: float = DEFAULT_TIMEOUT_S,
                 jitter: Callable[[], None] | None = None, cuda: bool = False) -> None:
        self.spin_s = spin_us * 1e-6
        self.timeout_s = timeout_s
        self.jitter = jitter
        self.call = 0
        self.failed: tuple[int, BaseException, int] | None = None
        self.events = [CpuEvent(cuda) for _ in range(n_events)]
        self.done_cond = threading.Condition(threading.Lock())
        self.joining = False  # the caller blocks on done_cond: end-of-call items wake it
        self.workers = [_Worker(self, k) for k in range(n)]
        weakref.finalize(self, WorkerPool._stop, self.workers)
        _LIVE_WORKERS.update(self.workers)

    @staticmethod
    def _stop(workers: list[_Worker]) -> None:
        for w in workers:
            w.closed = True
            w.wake.set()

    def close(self) -> None:
        """Stop the worker threads (they stop by themselves once the pool is collected)."""
        self._stop(self.workers)

    def fail(self, idx: int, exc: BaseException, stream: int) -> None:
        if self.failed is None:
            self.failed = (idx, exc, stream)

    def wait_until(self, ready: Callable[[], bool], what: Callable[[], str], timeout_s: float | None = None) -> None:
        """Spin (yielding the GIL), then sleep with backoff, until ``ready()``; an
        ExecutionError naming ``what()`` after ``timeout_s``; :class:`_Abort` if a worker failed."""
        if ready():
            return
        start = _now()
        spin_end = start + self.spin_s
        while _now() < spin_end:
            _sleep(0)
            if ready():
                return
        pause = 20e-6
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = start + limit
        while not ready():
            if self.failed is not None:
                raise _Abort()
            if _now() > deadline:
                raise ExecutionError(f"timed out after {limit:g} s {what()}")
            _sleep(pause)
            pause = min(pause * 2, 1e-3)

    def wait_event(self, e: int, before: str) -> None:
        """Spin ``spin_us`` (yielding the GIL), then block until the event is recorded for
        this call; an ExecutionError after ``timeout_s``; :class:`_Abort` if a worker failed."""
        ev = self.events[e]
        call = self.call
        if ev.done >= call:
            return
        start = _now()
        spin_end = start + self.spin_s
        while _now() < spin_end:
            _sleep(0)
            if ev.done >= call:
                return
        deadline = start + self.timeout_s
        with ev.cond:
            ev.waiters += 1
            try:
                while ev.done < call:
                    if self.failed is not None:
                        raise _Abort()
                    left = deadline - _now()
                    if left <= 0:
                        raise ExecutionError(f"timed out after {self.timeout_s:g} s waiting for event {e} {before}")
                    ev.cond.wait(min(left, 0.1))  # wakes to see a failure elsewhere
            finally:
                ev.waiters -= 1

    def finish(self, w: _Worker) -> None:
        """End-of-call item of worker ``w``."""
        w.finished = self.call
        if self.joining:
            with self.done_cond:
                self.done_cond.notify_all()

    def run_inline(self, items: Any) -> None:
        """Run a stream's items on the calling thread, as a worker would."""
        for fn, idx in items:
            if self.failed is not None and idx != _END:
                continue
            try:
                fn()
            except _Abort:
                pass
            except BaseException as e:  # noqa: BLE001
                self.fail(idx, e, 0)

    def join(self, plan: ExecutionPlan, describe: Callable[[int], str]) -> None:
        """Wait (spin, then block) for every worker to finish this call; raise what failed
        there. Longer than a wait's timeout, so that a stuck wait reports itself first."""
        call = self.call
        workers = self.workers
        done = lambda: all(w.finished >= call for w in workers)  # noqa: E731
        if not done():
            spin_end = _now() + self.spin_s
            while _now() < spin_end and not done():
                _sleep(0)
        if not done():
            deadline = _now() + 2 * self.timeout_s + 1
            with self.done_cond:
                self.joining = True
                try:
                    while not done():
                        left = deadline - _now()
                        if left <= 0:
                            w = next(w for w in workers if w.finished < call)
                            self.failed = None
                            raise ExecutionError(f"timed out after {2 * self.timeout_s + 1:g} s joining stream "
                                                 f"{w.index}, which is at {describe(w.current)}")
                        self.done_cond.wait(min(left, 0.1))
                finally:
                    self.joining = False
        if self.failed is not None:
            idx, exc, _ = self.failed
            self.failed = None
            if isinstance(exc, ExecutionError) or idx < 0:
                raise exc
            raise explain_failure(plan, idx, exc) from exc


def _describe_ins(plan: ExecutionPlan) -> Callable[[int], str]:
    def describe(idx: int) -> str:
        if idx < 0:
            return "the start of the call"
        op = plan.instructions[idx].op
        src = f" (issued at {op.source})" if op.source else ""
        return f"op #{idx} {format_op(op, plan.program)}{src}"
    return describe


def lower_workers(plan: ExecutionPlan, issue: str = "host", spin_us: float = DEFAULT_SPIN_US,
                  timeout_s: float = DEFAULT_TIMEOUT_S, jitter: Callable[[], None] | None = None,
                  drop_waits: set[tuple[int, int]] | None = None) -> Callable[..., list[Any]]:
    """A runner for ``plan`` over worker threads, one per stream (see the module docstring).

    ``issue``: ``"host"`` (the caller appends items in program order) or ``"lists"`` (threaded
    mode: each worker gets its list per call). ``jitter``: called by a worker before every item
    (tests inject random delays). ``drop_waits``: ``(instruction, k)`` waits to leave out (tests:
    a plan with a missing wait). The runner is not reentrant: one call at a time.
    """
    if issue not in ("host", "lists"):
        raise ValueError(f"issue must be 'host' or 'lists', not {issue!r}")
    prog = plan.program
    n_streams = plan.n_streams
    devices = {v.meta.device for v in prog.values if v.meta is not None and v.meta.device.type == "cuda"}
    cuda = bool(devices)
    if cuda and len(devices) > 1:
        raise OptionError(f"threaded mode runs on one device; this program has {sorted(map(str, devices))}")
    pool = WorkerPool(n_streams, plan.n_events, spin_us, timeout_s, jitter, cuda)
    describe = _describe_ins(plan)
    env: list[Any] = [None] * len(prog.values)
    glb: dict[str, Any] = {"__builtins__": __builtins__, "E": env}
    glb.update({f"s{vid}": t for vid, t in prog.state.items()})
    glb.update({f"c{vid}": c for vid, c in prog.consts.items()})
    render = _Renderer(prog, glb)
    outs_into = bind_arenas(plan.memory, prog, glb)  # memory="planned": planned ops write into arena views

    def slot(a: Any) -> str:  # values live in the slot table E (state and constants stay globals)
        if isinstance(a, Ref) and a.id not in prog.state and a.id not in prog.consts:
            return f"E[{a.id}]"
        if isinstance(a, list):
            return "[" + ", ".join(slot(x) for x in a) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(slot(x) + ", " for x in a) + ")"
        return render(a)

    # Release tokens: a value whose slot several streams must pass before it is cleared.
    tokens: dict[int, list[int]] = {}
    width: dict[int, int] = {}
    for ins in plan.instructions:
        for v, ks in ins.stream_uses:
            width[v] = len(ks) + 1
    glb["T"] = tokens

    def release(v: int, on: int) -> None:
        t = tokens[v]
        if cuda:
            val = env[v]
            s = pool.workers[on].stream
            if isinstance(val, torch.Tensor) and val.is_cuda and s is not None:
                val.record_stream(s)
        t.pop()
        if not t:
            env[v] = None

    src: list[str] = []
    items: list[list[tuple[Callable[[], None], int]]] = [[] for _ in range(n_streams)]
    order: list[tuple[int, str]] = []  # (stream, item name) in program order, for issue="host"
    pending_release: dict[int, list[int]] = {k: [] for k in range(n_streams)}

    def add(stream: int, name: str, idx: int) -> None:
        order.append((stream, name, idx))

    if cuda:  # the current CUDA stream is per thread: each worker launches onto its own
        for k in range(n_streams):
            glb[f"start{k}"] = (lambda k=k: torch.cuda.set_stream(pool.workers[k].stream))
            order.append((k, f"start{k}", -1))
    for pos, ins in enumerate(plan.instructions):
        op = ins.op
        s = ins.stream
        for k, e in enumerate(ins.waits):
            if drop_waits and (pos, k) in drop_waits:
                continue
            name = f"w{pos}_{k}"
            glb[name] = (lambda e=e, pos=pos, s=s: _wait(pool, e, pos, s, describe))
            add(s, name, pos)
        fname = f"f{op.index}"
        target, out_arg = out_call(op, outs_into)
        glb[fname] = callable_of(target, op)
        args = [slot(a) for a in op.args] + [f"{k}={slot(v)}" for k, v in op.kwargs]
        if out_arg:  # the arena block is reused only after what the plan's events order (passes/memory.py)
            args.append(out_arg)
        call = f"{fname}({', '.join(args)})"
        if op.unpack:
            names = [f"E[{o}]" if o >= 0 else "_" for o in op.outputs]
            lhs = (", ".join(names) + ("," if len(names) == 1 else "")) if names else "_"
            stmt = f"{lhs} = {call}" if any(o >= 0 for o in op.outputs) else call
        elif op.outputs and op.outputs[0] >= 0:
            stmt = f"E[{op.outputs[0]}] = {call}"
        else:
            stmt = call
        body = [stmt]
        shared = dict(ins.stream_uses)
        for v in ins.frees:
            if v in shared:
                body.append(f"_rel({v}, {s})")
            else:
                body.append(f"E[{v}] = None")
        src.append(f"def i{pos}():\n    " + "\n    ".join(body))
        add(s, f"i{pos}", pos)
        for e in ins.records:
            name = f"r{e}"
            glb[name] = (lambda e=e, s=s: _record(pool, e, s))
            add(s, name, pos)
        for v, ks in ins.stream_uses:  # the other streams release the value where they are now
            for k in ks:
                name = f"rel{v}_{k}"
                glb[name] = (lambda v=v, k=k: release(v, k))
                add(k, name, pos)
    glb["_rel"] = release
    exec(compile("\n".join(src) + "\n", f"<flowexec-workers-{next(_counter)}>", "exec"), glb)
    for k in range(n_streams):
        glb[f"end{k}"] = (lambda w=pool.workers[k]: pool.finish(w))
        order.append((k, f"end{k}", _END))
    for stream, name, idx in order:
        items[stream].append((glb[name], idx))
    lists = [tuple(x) for x in items]
    flat = [(pool.workers[s].push, (glb[name], idx)) for s, name, idx in order]
    inputs = prog.inputs
    outs = prog.outputs
    n_values = len(prog.values)

    set_grad = torch._C._set_grad_enabled
    is_grad = torch.is_grad_enabled

    def begin_cuda() -> Any:
        s0 = torch.cuda.current_stream()
        side = _side(s0.device, n_streams)
        entry = torch.cuda.Event()
        entry.record(s0)
        for k, w in enumerate(pool.workers):
            w.stream = s0 if k == 0 else side[k]
            if k:
                side[k].wait_event(entry)
        return s0, side

    def run(*args: Any) -> list[Any]:
        prev = is_grad()
        set_grad(False)
        pool.call += 1
        for v, k in width.items():
            tokens[v] = [0] * k
        for vid, a in zip(inputs, args):
            env[vid] = a
        token = begin_cuda() if cuda else None
        try:
            if issue == "lists":  # the caller's thread runs stream 0's list itself
                for w, lst in zip(pool.workers[1:], lists[1:]):
                    w.push_all(lst)
                pool.run_inline(lists[0])
            else:
                for push, item in flat:
                    push(item)
            pool.join(plan, describe)
            if cuda:
                s0, side = token
                for k in range(1, n_streams):
                    done = torch.cuda.Event()
                    done.record(side[k])
                    s0.wait_event(done)
                for v in plan.side_outputs:  # made on a side stream: freeing it later waits for the caller's work
                    t = env[v]
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(s0)
            return [env[o.id] if isinstance(o, Ref) and o.id not in prog.state and o.id not in prog.consts
                    else _const(o, prog) for o in outs]
        finally:
            for i in range(n_values):
                env[i] = None
            set_grad(prev)

    run.pool = pool  # type: ignore[attr-defined]
    run.lists = lists  # type: ignore[attr-defined]
    return run


def _const(o: Any, prog: Any) -> Any:
    if isinstance(o, Ref):
        return prog.state.get(o.id, prog.consts.get(o.id))
    return o


def _record(pool: WorkerPool, e: int, s: int) -> None:
    ev = pool.events[e]
    if ev.cuda is not None:
        ev.cuda.record(pool.workers[s].stream)
    ev.mark(pool.call)


def _wait(pool: WorkerPool, e: int, pos: int, s: int, describe: Callable[[int], str]) -> None:
    pool.wait_event(e, f"on stream {s} before {describe(pos)}")
    ev = pool.events[e]
    if ev.cuda is not None:
        pool.workers[s].stream.wait_event(ev.cuda)


def _side(device: torch.device, n: int) -> list[Any]:
    return [None] + side_streams(device, n - 1)
