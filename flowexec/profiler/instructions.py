"""Where a trace-mode call's time goes: each instruction's host time, as a table and a timeline.

:func:`profile` compiles ``fn`` in trace mode (or takes an :class:`~flowexec.Executable` built in
trace mode) and runs it ``runs`` times through a copy of its generated runner that stamps
``time.perf_counter_ns()`` after every instruction (and the frees that follow it): an
instruction's time is everything the runner did since the previous stamp — its stream switches
and waits, the call, its frees. A stamp costs about 0.08 µs (200 tiny adds on the 2-core CPU
machine: 633 µs per call unstamped, 649 stamped).

What it measures is host time. On the CPU that is where the work happens; on CUDA it is the
time to *launch* each op (the host cost trace mode pays per op), not the kernel's time on the
device — read those with ``torch.profiler``. Graph mode has no per-op host cost to show: the
whole program is one replay.

:meth:`Timeline.save` writes the Chrome trace-event format (open it in https://ui.perfetto.dev
or ``chrome://tracing``): one lane per stream of the plan, one slice per instruction per run,
named by its op and carrying its text form and source line, and a marker at each run's start.

Example::

    >>> import torch, flowexec
    >>> tl = flowexec.profile(lambda x: (x @ x).relu().sum(), torch.randn(64, 64), runs=3)
    >>> len(tl.records) == 3 * len(tl.plan.instructions)
    True
    >>> print(tl.table(top=1).splitlines()[0])  # doctest: +ELLIPSIS
    | # | op | source | µs per run | share |
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..plan import ExecutionPlan
from ..program import format_op


@dataclass(frozen=True)
class OpTime:
    """One instruction in one run: start (µs from the first run's start) and duration."""

    index: int
    run: int
    start_us: float
    dur_us: float


@dataclass(frozen=True)
class Timeline:
    """Per-instruction host times of ``runs`` calls of one plan."""

    plan: ExecutionPlan
    records: tuple[OpTime, ...]
    run_us: tuple[float, ...]  # each whole call, as the caller saw it

    def per_run_us(self) -> list[float]:
        """Mean µs per run of each instruction."""
        total = [0.0] * len(self.plan.instructions)
        for r in self.records:
            total[r.index] += r.dur_us
        n = max(len(self.run_us), 1)
        return [t / n for t in total]

    def top(self, n: int = 10) -> list[tuple[int, str, str, float, float]]:
        """The ``n`` costliest instructions: (index, op text, source, mean µs per run, share of
        the instructions' total)."""
        mean = self.per_run_us()
        whole = sum(mean) or 1.0
        prog = self.plan.program
        out = []
        for i in sorted(range(len(mean)), key=lambda k: -mean[k])[:n]:
            op = self.plan.instructions[i].op
            text = format_op(op, prog).split("  #")[0]
            out.append((i, text if len(text) <= 70 else text[:67] + "...", op.source or "–", mean[i], mean[i] / whole))
        return out

    def summary(self) -> str:
        """Totals: instructions, their µs per run, and the whole call's median."""
        runs = sorted(self.run_us)
        return (f"{len(self.plan.instructions)} instructions, {sum(self.per_run_us()):.1f} µs per run in them; "
                f"whole call {runs[len(runs) // 2]:.1f} µs (median of {len(runs)})")

    def table(self, top: int = 10) -> str:
        """The ``top`` instructions by mean time per run, as a Markdown table, and the totals."""
        rows = ["| # | op | source | µs per run | share |", "|---|---|---|---|---|"]
        rows += [f"| {i} | `{text}` | {src} | {us:.1f} | {share:.0%} |" for i, text, src, us, share in self.top(top)]
        return "\n".join(rows + ["", self.summary()])

    def chrome_trace(self) -> dict[str, Any]:
        """The timeline in Chrome's trace-event format (``ts`` and ``dur`` in µs)."""
        prog = self.plan.program
        streams = sorted({i.stream for i in self.plan.instructions})
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "flowexec trace run (host time)"}}]
        for s in streams:
            lane = "caller's stream" if s == 0 else f"stream {s}"
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": lane}})
        starts: dict[int, float] = {}
        for r in self.records:
            ins = self.plan.instructions[r.index]
            starts.setdefault(r.run, r.start_us)
            events.append({"name": ins.op.name, "cat": "op", "ph": "X", "pid": 0, "tid": ins.stream,
                           "ts": r.start_us, "dur": r.dur_us,
                           "args": {"instruction": r.index, "run": r.run, "op": format_op(ins.op, prog),
                                    "source": ins.op.source}})
        for run, ts in sorted(starts.items()):
            events.append({"name": f"run {run}", "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": ts})
        return {"traceEvents": events, "displayTimeUnit": "ns"}

    def save(self, path: str) -> str:
        """Write :meth:`chrome_trace` as JSON to ``path``; returns ``path``."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path


def profile(fn: Callable[..., Any], *args: Any, runs: int = 5, warmup: int = 1, **options: Any) -> Timeline:
    """Run ``fn`` (or a trace-mode :class:`~flowexec.Executable`) ``warmup + runs`` times on
    ``args`` through a runner that stamps every instruction; returns the ``runs`` timed calls.

    ``fn`` runs for real, with its in-place updates (a training step takes ``warmup + runs``
    steps), exactly as calling the compiled function would. ``options`` go to
    :func:`flowexec.compile` when ``fn`` is not compiled yet.
    """
    from .. import executable as ex
    from ..errors import OptionError
    from ..runtime.interpreter import lower_trace

    if runs < 1 or warmup < 0:
        raise OptionError(f"profile needs runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    exe = fn if isinstance(fn, ex.Executable) else ex.compile(fn, *args, mode="trace", **options)
    if exe.mode != "trace":
        raise OptionError("profile times trace mode's instructions; a graph-mode call is one CUDA graph replay "
                          "(use torch.profiler for its kernels)")
    compiled = exe._lookup(args)
    plan = compiled.plan
    if plan.on_workers:
        raise OptionError("profile times trace mode's instructions on the caller's thread; this plan runs on "
                          "worker threads (CPU streams or threaded mode): profile it with streams=1")
    clock = [0] * (len(plan.instructions) + 1)
    timed = lower_trace(plan, clock=clock)
    kept = compiled.runner
    compiled.runner = lambda targs: timed(*targs)
    records: list[OpTime] = []
    whole: list[float] = []
    sync = _synchronizer(args)
    origin = None
    try:
        for k in range(warmup + runs):
            sync()
            t0 = time.perf_counter_ns()
            exe(*args)
            sync()
            t1 = time.perf_counter_ns()
            if k < warmup:
                continue
            origin = clock[0] if origin is None else origin
            whole.append((t1 - t0) / 1e3)
            records += [OpTime(i, k - warmup, (clock[i] - origin) / 1e3, (clock[i + 1] - clock[i]) / 1e3)
                        for i in range(len(plan.instructions))]
    finally:
        compiled.runner = kept
    return Timeline(plan, tuple(records), tuple(whole))


def _synchronizer(args: Any) -> Callable[[], None]:
    """Waits for the device of the first CUDA tensor argument (a run's figures then hold only
    its own host time); nothing on the CPU."""
    import torch

    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return lambda d=a.device: torch.cuda.synchronize(d)
    return lambda: None
