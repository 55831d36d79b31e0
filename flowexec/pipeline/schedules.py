"""Pipeline schedules as data: per rank, the ordered jobs it runs, in a compact text form.

A job is one stage's forward (``F``) or backward (``B``) of one micro-batch; ``1F3`` is stage 1's
forward of micro-batch 3. A schedule maps each rank to its jobs in order; with one stage per
rank, rank ``r`` runs stage ``r``. Schedules are built by pure functions (``gpipe``,
``one_f_one_b``), printed one rank per line (``format_schedule``), read back (``parse_schedule``)
and checked before anything runs (``simulate``: every job's inputs come from a job that can run
first, or the schedule would deadlock).

>>> print(format_schedule(one_f_one_b(2, 3)))
rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
>>> simulate(one_f_one_b(2, 3)).bubble
0.25
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

KINDS = ("F", "B")


@dataclass(frozen=True, slots=True)
class Job:
    """One stage's forward or backward of one micro-batch (``str``: ``"1F3"``)."""

    stage: int
    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro}"

    @staticmethod
    def parse(text: str) -> Job:
        """``Job.parse("1F3") == Job(1, "F", 3)``; anything else is a ValueError naming the text."""
        m = re.fullmatch(r"(\d+)([FB])(\d+)", text.strip())
        if m is None:
            raise ValueError(f"{text!r} is not a job: expected <stage><F|B><micro-batch>, e.g. 1F3")
        return Job(int(m[1]), m[2], int(m[3]))


Schedule = Mapping[int, Sequence[Job]]


def gpipe(n_stages: int, n_micro: int) -> dict[int, tuple[Job, ...]]:
    """All forwards, then all backwards (GPipe, "FThenB"): activations of every micro-batch
    are held at once.

    >>> print(format_schedule(gpipe(2, 2)))
    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1F1 1B0 1B1
    """
    _check_sizes(n_stages, n_micro)
    return {s: tuple(Job(s, "F", m) for m in range(n_micro)) + tuple(Job(s, "B", m) for m in range(n_micro))
            for s in range(n_stages)}


def one_f_one_b(n_stages: int, n_micro: int) -> dict[int, tuple[Job, ...]]:
    """1F1B: stage ``s`` runs ``n_stages - 1 - s`` forwards ahead (warm-up), then alternates one
    forward and one backward, then drains the backwards; it holds at most ``n_stages - s``
    micro-batches' activations instead of all of them."""
    _check_sizes(n_stages, n_micro)
    out = {}
    for s in range(n_stages):
        warm = min(n_stages - 1 - s, n_micro)
        jobs = [Job(s, "F", m) for m in range(warm)]
        for m in range(n_micro - warm):
            jobs += [Job(s, "F", warm + m), Job(s, "B", m)]
        jobs += [Job(s, "B", m) for m in range(n_micro - warm, n_micro)]
        out[s] = tuple(jobs)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def format_schedule(schedule: Schedule) -> str:
    """One line per rank: ``rank 0: 0F0 0F1 0B0 ...``."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, jobs)) for r, jobs in sorted(schedule.items()))


def parse_schedule(text: str) -> dict[int, tuple[Job, ...]]:
    """The inverse of :func:`format_schedule`.

    >>> parse_schedule("rank 0: 0F0 0B0\\nrank 1: 1F0 1B0")[1]
    (Job(stage=1, kind='F', micro=0), Job(stage=1, kind='B', micro=0))
    """
    out: dict[int, tuple[Job, ...]] = {}
    for line in filter(str.strip, text.splitlines()):
        m = re.fullmatch(r"\s*rank (\d+):(.*)", line)
        if m is None:
            raise ValueError(f"{line!r} is not a schedule line: expected 'rank <r>: <jobs>'")
        out[int(m[1])] = tuple(Job.parse(t) for t in m[2].split())
    return out


@dataclass(frozen=True)
class Simulation:
    """A schedule run on unit-time jobs (a backward costs ``backward_cost`` units): when each job
    starts and ends, and the share of the makespan each rank sits idle on average."""

    start: dict[Job, int]
    end: dict[Job, int]
    makespan: int
    bubble: float


def simulate(schedule: Schedule, backward_cost: int = 1) -> Simulation:
    """Check a schedule and time it on unit jobs.

    Each rank runs its jobs in order; ``sF m`` needs ``(s-1)F m``, ``sB m`` needs ``sF m`` and
    ``(s+1)B m`` (the last stage's backward starts from its own forward's loss). Raises
    ValueError for a schedule that repeats or misses a job, puts a stage on two ranks, or would
    deadlock (naming the job each stuck rank waits on).

    >>> simulate({0: [Job(0, "B", 0), Job(0, "F", 0)]})
    Traceback (most recent call last):
    ...
    ValueError: schedule deadlocks: rank 0 waits at 0B0 for 0F0
    """
    if backward_cost < 1:
        raise ValueError(f"backward_cost must be at least 1, got {backward_cost!r}")
    jobs = [j for js in schedule.values() for j in js]
    if not jobs:
        raise ValueError("the schedule has no jobs")
    if any(j.micro < 0 or j.stage < 0 or j.kind not in KINDS for j in jobs):
        raise ValueError(f"bad job {next(str(j) for j in jobs if j.micro < 0 or j.stage < 0 or j.kind not in KINDS)}")
    if len(set(jobs)) != len(jobs):
        dup = next(str(j) for j in jobs if jobs.count(j) > 1)
        raise ValueError(f"schedule runs {dup} twice")
    owner: dict[int, int] = {}
    for r, js in schedule.items():
        for j in js:
            if owner.setdefault(j.stage, r) != r:
                raise ValueError(f"stage {j.stage} is on ranks {owner[j.stage]} and {r}")
            if j.stage != r:  # what PipelineStage runs: stage r on rank r
                raise ValueError(f"rank {r} has job {j}: each rank runs the stage of its own number")
    stages = sorted(owner)
    if stages != list(range(len(stages))):
        raise ValueError(f"stages must be 0..{len(stages) - 1}, got {stages}")
    n_micro = 1 + max(j.micro for j in jobs)
    want = {Job(s, k, m) for s in stages for k in KINDS for m in range(n_micro)}
    if set(jobs) != want:
        raise ValueError(f"schedule misses {sorted(map(str, want - set(jobs)))[:4]}")
    last = stages[-1]

    def needs(j: Job) -> tuple[Job, ...]:
        if j.kind == "F":
            return (Job(j.stage - 1, "F", j.micro),) if j.stage else ()
        return (Job(j.stage, "F", j.micro),) + ((Job(j.stage + 1, "B", j.micro),) if j.stage < last else ())

    end: dict[Job, int] = {}
    start: dict[Job, int] = {}
    pos = {r: 0 for r in schedule}
    free = {r: 0 for r in schedule}
    while len(end) < len(jobs):
        moved = False
        for r, js in schedule.items():
            while pos[r] < len(js) and all(d in end for d in needs(js[pos[r]])):
                j = js[pos[r]]
                start[j] = max([free[r], *(end[d] for d in needs(j))])
                end[j] = free[r] = start[j] + (backward_cost if j.kind == "B" else 1)
                pos[r] += 1
                moved = True
        if not moved:
            stuck = [(r, js[pos[r]]) for r, js in sorted(schedule.items()) if pos[r] < len(js)]
            raise ValueError("schedule deadlocks: " + "; ".join(
                f"rank {r} waits at {j} for {', '.join(str(d) for d in needs(j) if d not in end)}" for r, j in stuck))
    makespan = max(end.values())
    busy = sum(end[j] - start[j] for j in jobs)
    return Simulation(start, end, makespan, 1 - busy / (makespan * len(schedule)))


def _check_sizes(n_stages: int, n_micro: int) -> None:
    for name, v in (("n_stages", n_stages), ("n_micro", n_micro)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
