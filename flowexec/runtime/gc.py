"""``gc="async"``: values a plan frees are dropped on one background thread, not the caller's.

Freeing is not always cheap: a CPU tensor above glibc's mmap threshold returns its pages to the
kernel when it dies (64 MiB took 4.2 ms on the 2-core CI machine), and the fast collector pays
that inside the step, at the value's last use. The async collector hands the dying values to a
single worker thread instead: the runner appends them to a deque (atomic under the GIL, no lock
taken) and wakes the worker, which drops its references while the caller goes on with the next
op (PyTorch releases the GIL inside ops, so the two run at once on two cores). The price is
memory: a value lives until the worker reaches it, so a step's peak can be higher than with the
fast collector. So the backlog is bounded in bytes (:meth:`AsyncCollector.bounded`): a plan
hands a free site's values to the worker only while the bytes handed over and not yet dropped
stay under its limit (by default a tenth of the plan's planned peak); past it the caller drops
them itself, at once, as the fast collector would. That back-pressure keeps a step's peak within
the planned peak plus the limit, whatever the worker's lag.

With several CUDA streams the runner records every side stream that used a value on it
(``record_stream``) before handing it over, so the caching allocator reuses the block only once
those streams' work is done, whichever thread drops the last reference.

>>> c = AsyncCollector()
>>> c.collect((object(),))
>>> c.drain(timeout=5)
True
>>> hand = c.bounded(limit=1 << 20)
>>> hand((bytearray(10),), 10)  # under the limit: queued for the worker
True

Only values whose storage dies at a free site are handed over (:func:`handed_frees`): a view
whose base lives on is dropped by the caller, so the worker never holds the last reference of
a storage the backlog's count does not include.
"""
from __future__ import annotations

import atexit
import collections
import os
import threading
import time
from typing import Any, Callable


class AsyncCollector:
    """One daemon thread that drops what it is handed, in order."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        # Also run in a forked child, in place (runners hold the bound ``collect``): the
        # parent's worker thread does not exist there.
        self._queue: collections.deque[Any] = collections.deque()
        self._wake = threading.Event()
        self._handed = 0
        self._dropped = 0
        # Bytes of the backlog: each counter has one writer (the caller's thread, the worker),
        # so their difference is exact without a lock.
        self._bytes_in = 0
        self._bytes_out = 0
        self.inline = 0  # hand-overs refused for the bound (dropped by the caller)
        self._thread = threading.Thread(target=self._work, name="flowexec-gc", daemon=True)
        self._thread.start()

    def collect(self, values: Any) -> None:
        """Hand over ``values`` (a tuple holding the last references the runner had)."""
        self._handed += 1
        self._queue.append(values)
        self._wake.set()

    def bounded(self, limit: int) -> Callable[[Any, int], bool]:
        """A hand-over for one plan: ``hand(values, nbytes)`` queues ``values`` (whose storages,
        ``nbytes`` in all, die with them) unless the backlog would pass ``limit`` bytes; then it
        returns False and the caller's own ``del`` frees them (back-pressure)."""
        queue, wake = self._queue, self._wake

        def hand(values: Any, nbytes: int) -> bool:
            if self._bytes_in - self._bytes_out + nbytes > limit:
                self.inline += 1
                return False
            self._bytes_in += nbytes
            self._handed += 1
            queue.append([values, nbytes])  # a list: collect() hands tuples
            wake.set()
            return True

        return hand

    @property
    def backlog_bytes(self) -> int:
        """Bytes handed over through :meth:`bounded` and not dropped yet."""
        return self._bytes_in - self._bytes_out

    def _work(self) -> None:
        queue, wake = self._queue, self._wake
        while True:
            wake.wait()
            wake.clear()  # before draining: a value appended from here on sets it again
            while queue:
                item = queue.popleft()
                nbytes = item[1] if type(item) is list else 0
                del item  # the free, on this thread
                self._bytes_out += nbytes
                self._dropped += 1

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until everything handed over so far has been dropped; False on timeout."""
        target = self._handed
        deadline = time.monotonic() + timeout
        while self._dropped < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    @property
    def thread(self) -> threading.Thread:
        return self._thread


def handed_frees(plan: Any) -> list[tuple[tuple[int, ...], int]]:
    """Per instruction, (the freed values to hand to the worker, the bytes of storage they
    release). Only values whose storage dies at that instruction are handed over, so the worker
    always holds the last reference of what it is given and the backlog's count is exact: a
    view whose base lives on, a view of an input or of state, an arena block (never released)
    and a non-tensor are dropped by the caller (cheap: no storage is freed)."""
    placed = {plan.groups[v] for v in plan.memory.values} if plan.memory is not None else set()
    ends = {b.group: b for b in plan.liveness.buffers if not b.output and b.group not in placed}
    out = []
    for pos, ins in enumerate(plan.instructions):
        vals = tuple(v for v in ins.frees if (b := ends.get(plan.groups[v])) is not None and b.end == pos)
        out.append((vals, sum(ends[g].nbytes for g in {plan.groups[v] for v in vals})))
    return out


_COLLECTOR: AsyncCollector | None = None
_LOCK = threading.Lock()


def collector() -> AsyncCollector:
    """The process's collector, started on first use. It finishes its backlog before the
    interpreter shuts down (a daemon thread stopped by shutdown in the middle of freeing a
    tensor aborts the process) and starts afresh in a forked child."""
    global _COLLECTOR
    if _COLLECTOR is None:
        with _LOCK:
            if _COLLECTOR is None:
                c = AsyncCollector()
                atexit.register(c.drain)
                if hasattr(os, "register_at_fork"):
                    os.register_at_fork(after_in_child=c._start)
                _COLLECTOR = c
    return _COLLECTOR
