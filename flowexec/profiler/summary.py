"""What a person looks at first: per rank, how busy it was, its bubble, each job kind's mean
duration, and the schedule's theoretical bubble beside the measured one.

A step's window is the same for every rank: from the first job any rank started in that step
to the last job any rank ended (on rank 0's clock, after the merge) — the time the pipeline
took for the step, which is what a schedule's theoretical bubble is a share of. Jobs here are
the schedule's (``F`` ``B`` ``I`` ``W``); the optimizer step (``OPT``) after them is reported
with its mean duration but kept out of the windows, as the theory keeps it out. A rank is busy
while one of its jobs runs and it is not blocked in a receive (``wait`` spans are idle: the job
was issued but had nothing to work on). Its bubble is the rest of the windows: ``1 - busy``.

>>> from .records import Span
>>> sp = lambda r, k, m, a, b, stream="compute": Span(r, "h", 1, 0, r, k, m, stream, a, b, "host")
>>> spans = [sp(0, "F", 0, 0, 10), sp(0, "B", 0, 30, 50), sp(1, "F", 0, 10, 20), sp(1, "B", 0, 20, 30)]
>>> [(s.rank, round(s.busy, 2), round(s.bubble, 2)) for s in summarize(spans)]
[(0, 0.6, 0.4), (1, 0.4, 0.6)]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .records import JOB_KINDS, Span

PIPELINE_KINDS = ("F", "B", "I", "W")  # the schedule's jobs: what windows and bubbles are made of


@dataclass(frozen=True)
class RankSummary:
    """One rank's figures over the recorded steps (times in ns, shares in 0..1)."""

    rank: int
    steps: int
    window_ns: int
    busy_ns: int
    wait_ns: int
    mean_ns: dict[str, float] = field(default_factory=dict)   # job kind -> mean duration
    count: dict[str, int] = field(default_factory=dict)       # job kind -> how many
    theory_bubble: float | None = None

    @property
    def busy(self) -> float:
        return self.busy_ns / self.window_ns if self.window_ns else 0.0

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy if self.window_ns else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "steps": self.steps, "window_ns": self.window_ns, "busy_ns": self.busy_ns,
                "wait_ns": self.wait_ns, "busy": self.busy, "bubble": self.bubble, "mean_ns": self.mean_ns,
                "count": self.count, "theory_bubble": self.theory_bubble}


def union_ns(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``[start, end)`` intervals as sorted disjoint intervals.

    >>> union_ns([(5, 9), (0, 3), (2, 4), (9, 10)])
    [(0, 4), (5, 10)]
    """
    out: list[list[int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv: Iterable[tuple[int, int]]) -> int:
    return sum(b - a for a, b in iv)


def _minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``a`` without ``b`` (both disjoint and sorted)."""
    out = []
    for s, e in a:
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


def _clip(iv: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(a, lo), min(b, hi)) for a, b in iv if b > lo and a < hi]


def step_windows(spans: Iterable[Span]) -> dict[int, tuple[int, int]]:
    """Per step, ``(first job start, last job end)`` over all ranks (schedule jobs only)."""
    out: dict[int, tuple[int, int]] = {}
    for s in spans:
        if s.kind in PIPELINE_KINDS:
            a, b = out.get(s.step, (s.start_ns, s.end_ns))
            out[s.step] = (min(a, s.start_ns), max(b, s.end_ns))
    return out


def summarize(spans: Iterable[Span], theory: float | Mapping[int, float] | None = None) -> list[RankSummary]:
    """Per rank (in order), the figures of ``spans`` (merged: on one clock). ``theory``: the
    schedule's bubble, one figure or one per rank."""
    spans = list(spans)
    windows = step_windows(spans)
    out = []
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]
        busy = wait = window = 0
        for step, (lo, hi) in windows.items():
            jobs = union_ns((s.start_ns, s.end_ns) for s in mine if s.step == step and s.kind in PIPELINE_KINDS)
            waits = union_ns((s.start_ns, s.end_ns) for s in mine if s.step == step and s.kind == "wait")
            window += hi - lo
            busy += _length(_clip(_minus(jobs, waits), lo, hi))
            wait += _length(_clip(waits, lo, hi))
        durs: dict[str, list[int]] = {}
        for s in mine:
            if s.kind in JOB_KINDS:
                durs.setdefault(s.kind, []).append(s.duration_ns)
        kinds = [k for k in JOB_KINDS if k in durs]
        th = theory.get(rank) if isinstance(theory, Mapping) else theory
        out.append(RankSummary(rank, len({s.step for s in mine if s.kind in JOB_KINDS}), window, busy, wait,
                               {k: sum(durs[k]) / len(durs[k]) for k in kinds}, {k: len(durs[k]) for k in kinds},
                               th))
    return out


def format_summary(rows: list[RankSummary], at_costs: Mapping[int, float] | None = None) -> str:
    """The summary as a plain-text table (what ``flowexec timeline`` prints); ``at_costs``: per
    rank the schedule's bubble at the measured job times, as a column.

    >>> print(format_summary([RankSummary(0, 1, 100, 60, 5, {"F": 10.0}, {"F": 1}, 0.5)]))
    rank  steps  busy  bubble  theory  wait  mean per job kind
       0      1   60%     40%     50%    5%  F 0.000 ms
    """
    extra = "  at job times" if at_costs else ""
    lines = [f"rank  steps  busy  bubble  theory{extra}  wait  mean per job kind"]
    for r in rows:
        th = "-" if r.theory_bubble is None else f"{r.theory_bubble:.0%}"
        col = f"  {at_costs[r.rank]:>12.0%}" if at_costs and r.rank in at_costs else ("  " + " " * 12 if extra else "")
        wait = r.wait_ns / r.window_ns if r.window_ns else 0.0
        kinds = ", ".join(f"{k} {v / 1e6:.3f} ms" for k, v in r.mean_ns.items())
        lines.append(f"{r.rank:>4}  {r.steps:>5}  {r.busy:>4.0%}  {r.bubble:>6.0%}  {th:>6}{col}  {wait:>4.0%}  {kinds}")
    return "\n".join(lines)
