"""A sampling profiler for one thread: where a stretch of Python spends its wall time, including
inside code that swaps the interpreter's profile hook (cProfile loses Inductor's ``compile_fx``).

A daemon thread reads the watched thread's stack (``sys._current_frames``) every ``interval``
seconds and counts each distinct stack; :meth:`Sampler.collapsed` writes them in the collapsed
format flame-graph tools read (``frame;frame;frame count``), and :meth:`Sampler.inclusive` gives
each function's share of the samples.

    >>> import time
    >>> with Sampler(interval=0.001) as s:
    ...     time.sleep(0.05)
    >>> s.samples > 0 and any("sleep" in k or "<module>" in k for k, _ in s.inclusive(5))
    True
"""
from __future__ import annotations

import collections
import sys
import threading
import time
from types import FrameType
from typing import Any


def _name(f: FrameType) -> str:
    code = f.f_code
    path = code.co_filename
    for cut in ("site-packages/", "/work/main/", "/lib/python3"):
        if cut in path:
            path = path.split(cut, 1)[1]
            break
    return f"{code.co_name} ({path}:{code.co_firstlineno})"


class Sampler:
    """Samples the stack of the thread that enters it, until it exits."""

    def __init__(self, interval: float = 0.002, depth: int = 80) -> None:
        self.interval, self.depth = interval, depth
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._target = 0

    def __enter__(self) -> Sampler:
        self._target = threading.get_ident()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flowexec-sampler")
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            f = sys._current_frames().get(self._target)
            stack = []
            while f is not None and len(stack) < self.depth:
                stack.append(_name(f))
                f = f.f_back
            if stack:
                self.stacks[tuple(reversed(stack))] += 1
                self.samples += 1

    def collapsed(self) -> str:
        """One line per distinct stack, outermost frame first: ``a;b;c count``."""
        return "\n".join(f"{';'.join(s)} {n}" for s, n in self.stacks.most_common())

    def inclusive(self, n: int = 40) -> list[tuple[str, float]]:
        """The ``n`` functions on the most samples (each counted once per sample), with their share."""
        counts: collections.Counter[str] = collections.Counter()
        for stack, k in self.stacks.items():
            for fn in set(stack):
                counts[fn] += k
        total = max(self.samples, 1)
        return [(fn, round(c / total, 4)) for fn, c in counts.most_common(n)]


if __name__ == "__main__":  # a quick look: python3 sampler.py
    with Sampler() as s:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.2:
            sum(range(1000))
    print(s.samples, s.inclusive(3))
