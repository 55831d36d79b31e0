"""Where a trace-mode call's time goes: each instruction's host time, as a table and a timeline.

:func:`profile` compiles ``fn`` in trace mode (or takes an :class:`~flowexec.Executable` built in
trace mode) and runs it ``runs`` times through a copy of its generated runner that stamps
``time.perf_counter_ns()`` after every instruction (and the frees that follow it): an
instruction's time is everything the runner did since the previous stamp — its stream switches
and waits, the call, its frees. A stamp costs about 0.08 µs (200 tiny adds on the 2-core CPU
machine: 633 µs per call unstamped, 649 stamped).

What it measures is host time. On the CPU that is where the work happens; on CUDA it is the
time to *launch* each op (the host cost trace mode pays per op). On CUDA ``profile`` also
measures **device times** (``device_times=True``, the default there): each stamp also records a
CUDA event on the stream the instruction ran on, read after the run and anchored to the host
clock (:func:`.timers.anchor`), so an instruction's device end is exact and its device start is
the latest of what it had to follow — the previous instruction's end on its stream, the ends of
the instructions whose events it waits on, and the host time it was issued (a kernel cannot
start before its launch) — see :func:`device_starts`. Each planned event record → wait is kept
as a flow (:meth:`Timeline.flows`). Graph mode has no per-op host cost to show: the whole
program is one replay; :func:`profile_graph` times each replay as one slice (with the kernels
of one call from ``torch.profiler`` when asked).

:meth:`Timeline.spans` gives the same :class:`~.records.Span` records the job timeline uses,
so :mod:`.trace` and :mod:`.page` export instruction profiles too (one row per stream).

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
from .records import Span


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
    device: tuple[OpTime, ...] = ()  # on CUDA: each instruction's device time, same origin as ``records``

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
        if self.device:  # a lane per stream on the device, and the event flows between them
            dev = {s: 100 + s for s in streams}
            for s in streams:
                events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": dev[s],
                               "args": {"name": f"device: {'caller' if s == 0 else 'side'} stream {s}"}})
            at = {}
            for r in self.device:
                ins = self.plan.instructions[r.index]
                at[(r.run, r.index)] = (dev[ins.stream], r.start_us, r.dur_us)
                events.append({"name": ins.op.name, "cat": "device", "ph": "X", "pid": 0, "tid": dev[ins.stream],
                               "ts": r.start_us, "dur": r.dur_us, "args": {"instruction": r.index, "run": r.run}})
            fid = 0
            for wait_pos, rec_pos in _event_edges(self.plan):
                for run in range(len(self.run_us)):
                    if (run, rec_pos) in at and (run, wait_pos) in at:
                        fid += 1
                        (t1, s1, d1), (t2, s2, _) = at[(run, rec_pos)], at[(run, wait_pos)]
                        events.append({"name": "event", "cat": "event", "ph": "s", "id": fid, "pid": 0, "tid": t1,
                                       "ts": s1 + d1 / 2})
                        events.append({"name": "event", "cat": "event", "ph": "f", "bp": "e", "id": fid, "pid": 0,
                                       "tid": t2, "ts": s2})
        return {"traceEvents": events, "displayTimeUnit": "ns"}

    def spans(self, rank: int = 0, host: str = "", pid: int = 0) -> list[Span]:
        """The profile as timeline spans (ns from the first run's start): host times on row
        ``host``, device times on a row per stream (``cuda s0``, ``cuda s1`` ...); ``step`` is
        the run, ``kind`` ``"op"``, ``name`` the op."""
        out = []
        for recs, clock in ((self.records, "host"), (self.device, "cuda")):
            for r in recs:
                ins = self.plan.instructions[r.index]
                stream = "host" if clock == "host" else f"cuda s{ins.stream}"
                a = round(r.start_us * 1e3)
                out.append(Span(rank, host, pid, r.run, None, "op", None, stream, a, a + round(r.dur_us * 1e3), clock,
                                name=ins.op.name, tag=r.index))
        return out

    def flows(self, rank: int = 0, host: str = "", pid: int = 0) -> list[tuple[Span, Span]]:
        """Each planned event record → wait in each run, as (recording span, waiting span) of
        :meth:`spans` (device spans where there are, else host)."""
        spans = [s for s in self.spans(rank, host, pid) if s.clock == ("cuda" if self.device else "host")]
        at = {(s.step, s.tag): s for s in spans}
        out = []
        for wait_pos, rec_pos in _event_edges(self.plan):
            for run in range(len(self.run_us)):
                if (run, rec_pos) in at and (run, wait_pos) in at:
                    out.append((at[(run, rec_pos)], at[(run, wait_pos)]))
        return out

    def save(self, path: str) -> str:
        """Write :meth:`chrome_trace` as JSON to ``path``; returns ``path``."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return path


def profile(fn: Callable[..., Any], *args: Any, runs: int = 5, warmup: int = 1, device_times: bool | None = None,
            **options: Any) -> Timeline:
    """Run ``fn`` (or a trace-mode :class:`~flowexec.Executable`) ``warmup + runs`` times on
    ``args`` through a runner that stamps every instruction; returns the ``runs`` timed calls.

    ``fn`` runs for real, with its in-place updates (a training step takes ``warmup + runs``
    steps), exactly as calling the compiled function would. ``options`` go to
    :func:`flowexec.compile` when ``fn`` is not compiled yet. ``device_times`` (default: on
    when an argument is a CUDA tensor) also records a CUDA event per instruction; the host
    figures then include those records (a few µs each): ``device_times=False`` for host times
    alone.
    """
    from .. import executable as ex
    from ..errors import OptionError
    from ..runtime.interpreter import lower_trace

    if runs < 1 or warmup < 0:
        raise OptionError(f"profile needs runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    exe = fn if isinstance(fn, ex.Executable) else ex.compile(fn, *args, mode="trace", **options)
    if exe.mode != "trace":
        raise OptionError("profile times trace mode's instructions; a graph-mode call is one CUDA graph replay "
                          "(flowexec.profiler.profile_graph times replays, with kernels=True their kernels)")
    sync = _synchronizer(args)
    # The warm-up calls come first: a step's first calls can make state (optimizer moments, the
    # .grad tensors) that the program of the calls after them reads, which is the one timed.
    for _ in range(warmup):
        exe(*args)
    sync()
    compiled = exe._lookup(args)
    if compiled is None:  # fn makes state on its first step: this call makes it, eagerly
        exe(*args)
        compiled = exe._lookup(args)
    plan = compiled.plan
    if plan.on_workers:
        raise OptionError("profile times trace mode's instructions on the caller's thread; this plan runs on "
                          "worker threads (CPU streams or threaded mode): profile it with streams=1")
    n = len(plan.instructions)
    cuda_dev = _cuda_device(args)
    if device_times and cuda_dev is None:
        raise OptionError("device_times=True needs a CUDA tensor among the arguments (on the CPU host time is device time)")
    clock: Any = _EventClock(n + 1) if (device_times if device_times is not None else cuda_dev is not None) else [0] * (n + 1)
    timed = lower_trace(plan, clock=clock)
    kept = compiled.runner
    compiled.runner = lambda targs: timed(*targs)
    records: list[OpTime] = []
    device: list[OpTime] = []
    whole: list[float] = []
    origin = None
    try:
        stamps = clock.host if isinstance(clock, _EventClock) else clock
        for k in range(runs):
            stamps[0] = -1  # the timed runner stamps it: still -1 after the call, another program ran
            sync()
            t0 = time.perf_counter_ns()
            exe(*args)
            sync()
            t1 = time.perf_counter_ns()
            if stamps[0] == -1:
                raise OptionError("profile: a timed call ran another program than the one timed (a value the "
                                  "capture read changed between calls); profile with more warmup calls")
            origin = clock[0] if origin is None else origin
            whole.append((t1 - t0) / 1e3)
            records += [OpTime(i, k, (clock[i] - origin) / 1e3, (clock[i + 1] - clock[i]) / 1e3) for i in range(n)]
            if isinstance(clock, _EventClock):
                ends = clock.device_ns(cuda_dev)
                starts = device_starts(plan, clock.host[:n], ends[1:], ends[0])
                device += [OpTime(i, k, (starts[i] - origin) / 1e3, (ends[i + 1] - starts[i]) / 1e3)
                           for i in range(n)]
    finally:
        compiled.runner = kept
    return Timeline(plan, tuple(records), tuple(whole), tuple(device))


class _EventClock:
    """Stands in for the runner's clock list: each stamp (on entry, and after each instruction
    and its frees) also records a CUDA event on the stream current then — the stream the
    instruction ran on. One event per stamp, reused run after run (read after each run)."""

    def __init__(self, n: int) -> None:
        import torch

        self.host = [0] * n
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(n)]

    def __setitem__(self, i: int, ns: int) -> None:
        self.events[i].record()
        self.host[i] = ns

    def __getitem__(self, i: int) -> int:
        return self.host[i]

    def device_ns(self, device: Any) -> list[int]:
        """Each event's device time on the host clock (waits for the device)."""
        from .timers import anchor

        ev0, ns0 = anchor(device)
        return [ns0 - round(e.elapsed_time(ev0) * 1e6) for e in self.events]


def _event_edges(plan: ExecutionPlan) -> list[tuple[int, int]]:
    """``(waiting instruction, recording instruction)`` for every planned event wait: the last
    instruction before the waiter that recorded the event."""
    last: dict[int, int] = {}
    out = []
    for pos, ins in enumerate(plan.instructions):
        out += [(pos, last[e]) for e in ins.waits if e in last]
        for e in ins.records:
            last[e] = pos
    return out


def device_starts(plan: ExecutionPlan, issue_ns: list[int], end_ns: list[int], entry_ns: int) -> list[int]:
    """Each instruction's device start, from its device end events: the latest of the previous
    instruction's end on its stream (the run's entry for the first), the ends of the
    instructions whose events it waits on, and its host issue time (a kernel does not start
    before it is launched) — never after its own end.

    >>> from types import SimpleNamespace as N
    >>> plan = N(instructions=[N(stream=0, waits=(), records=(0,)), N(stream=1, waits=(0,), records=()),
    ...                        N(stream=0, waits=(), records=())])
    >>> device_starts(plan, issue_ns=[0, 5, 6], end_ns=[10, 30, 20], entry_ns=1)
    [1, 10, 10]
    """
    prev: dict[int, int] = {}
    waited: dict[int, list[int]] = {}
    for w, r in _event_edges(plan):
        waited.setdefault(w, []).append(r)
    out = []
    for pos, ins in enumerate(plan.instructions):
        start = max([prev.get(ins.stream, entry_ns), issue_ns[pos], *(end_ns[r] for r in waited.get(pos, ()))])
        out.append(min(start, end_ns[pos]))
        prev[ins.stream] = end_ns[pos]
    return out


def _cuda_device(args: Any) -> Any:
    import torch

    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return a.device
    return None


def _synchronizer(args: Any) -> Callable[[], None]:
    """Waits for the device of the first CUDA tensor argument (a run's figures then hold only
    its own host time); nothing on the CPU."""
    import torch

    for a in args:
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return lambda d=a.device: torch.cuda.synchronize(d)
    return lambda: None


@dataclass(frozen=True)
class GraphProfile:
    """Graph-mode calls: each replay as one span on the device (``cuda``, row ``replay``) and
    its host call (row ``host``); with ``kernels``, one call's kernels from ``torch.profiler``
    on row ``kernels`` (placed from the replay's device start: the profiler keeps its own
    clock)."""

    spans: tuple[Span, ...]
    run_us: tuple[float, ...]

    def save(self, path: str) -> str:
        """Write the spans through :func:`.trace.write_trace`; returns ``path``."""
        from .trace import write_trace

        return write_trace(self.spans, path, {"mode": "graph"})


def profile_graph(exe: Any, *args: Any, runs: int = 5, warmup: int = 1, kernels: bool = False) -> GraphProfile:
    """Time ``runs`` calls of a graph-mode :class:`~flowexec.Executable` (CUDA): per call the
    replay on the device (events on the current stream around it, read after the call) and the
    host call; ``kernels=True`` also runs one more call under ``torch.profiler`` for its kernels."""
    import torch

    from ..errors import OptionError
    from .timers import anchor

    if getattr(exe, "mode", None) != "graph":
        raise OptionError("profile_graph takes a graph-mode Executable (flowexec.compile(..., mode='graph'))")
    dev = _cuda_device(args)
    if dev is None:
        raise OptionError("profile_graph needs CUDA tensors among the arguments (graph mode replays CUDA graphs)")
    if runs < 1 or warmup < 0:
        raise OptionError(f"profile_graph needs runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    spans: list[Span] = []
    whole: list[float] = []
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for k in range(warmup + runs):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter_ns()
        a.record()
        exe(*args)
        b.record()
        t1 = time.perf_counter_ns()
        ev0, ns0 = anchor(dev)
        if k < warmup:
            continue
        run = k - warmup
        whole.append((ns0 - t0) / 1e3)
        da, db = (ns0 - round(e.elapsed_time(ev0) * 1e6) for e in (a, b))
        spans.append(Span(0, "", 0, run, None, "op", None, "host", t0, t1, "host", name="graph call (host)"))
        spans.append(Span(0, "", 0, run, None, "op", None, "replay", da, db, "cuda", issue_ns=t0, name="graph replay"))
    if kernels:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        torch.cuda.synchronize(dev)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            a.record()
            exe(*args)
            b.record()
            torch.cuda.synchronize(dev)
        ev0, ns0 = anchor(dev)
        da = ns0 - round(a.elapsed_time(ev0) * 1e6)
        ks = [e for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA]
        first = min((e.time_range.start for e in ks), default=0)
        run = len(whole)
        for e in ks:
            s0 = da + round((e.time_range.start - first) * 1e3)
            spans.append(Span(0, "", 0, run, None, "op", None, "kernels", s0,
                              s0 + round(e.time_range.elapsed_us() * 1e3), "cuda", name=e.name))
    return GraphProfile(tuple(spans), tuple(whole))
