"""``gc="async"``: values a plan frees are dropped on one background thread, not the caller's.

Freeing is not always cheap: a CPU tensor above glibc's mmap threshold returns its pages to the
kernel when it dies (64 MiB took 4.2 ms on the 2-core CI machine), and the fast collector pays
that inside the step, at the value's last use. The async collector hands the dying values to a
single worker thread instead: the runner appends them to a deque (atomic under the GIL, no lock
taken) and wakes the worker, which drops its references while the caller goes on with the next
op (PyTorch releases the GIL inside ops, so the two run at once on two cores). The price is
memory: a value lives until the worker reaches it, so a step's peak can be higher than with the
fast collector.

>>> c = AsyncCollector()
>>> c.collect((object(),))
>>> c.drain(timeout=5)
True
"""
from __future__ import annotations

import atexit
import collections
import os
import threading
import time
from typing import Any


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
        self._thread = threading.Thread(target=self._work, name="flowexec-gc", daemon=True)
        self._thread.start()

    def collect(self, values: Any) -> None:
        """Hand over ``values`` (a tuple holding the last references the runner had)."""
        self._handed += 1
        self._queue.append(values)
        self._wake.set()

    def _work(self) -> None:
        queue, wake = self._queue, self._wake
        while True:
            wake.wait()
            wake.clear()  # before draining: a value appended from here on sets it again
            while queue:
                item = queue.popleft()
                del item  # the free, on this thread
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
