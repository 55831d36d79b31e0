"""Pipeline schedules as data: per rank, the ordered jobs it runs, in a compact text form.

A :class:`Job` is one stage's forward (``F``), full backward (``B``), input-gradient half of the
backward (``I``), weight-gradient half (``W``) of one micro-batch, or the stage's optimizer step
(``OPT``). Its text form is ``<stage><kind><micro>``: ``1F3`` is stage 1's forward of micro-batch
3, ``0I2`` / ``0W2`` the two halves of stage 0's backward of micro-batch 2, ``2OPT`` stage 2's
optimizer step. A **plan** maps each rank to its jobs in order; which stages a rank holds follows
from its jobs (:func:`placement`): one stage per rank, ``r, r+p, ...`` for interleaved schedules,
``r`` and ``2p-1-r`` (a V) for ZBV.

A schedule is a pure function ``(n_ranks, n_micro, n_stages=None) -> plan`` (:data:`SCHEDULES`,
:func:`get_schedule`; names are case-insensitive, ``"FThenB"`` is GPipe); any function of that
shape, or a plan written by hand (:func:`parse_schedule`), will do. :func:`simulate` checks a plan
before anything runs — every dependency across stages and kinds, each job exactly once, no
deadlock (naming the stuck jobs) — and times it with per-kind costs and a transfer latency.

>>> print(format_schedule(one_f_one_b(2, 3)))
rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
>>> simulate(one_f_one_b(2, 3)).bubble
0.25
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

KINDS = ("F", "B", "I", "W", "OPT")
_JOB_RE = re.compile(r"(\d+)(?:([FBIW])(\d+)|(OPT))")


@dataclass(frozen=True, slots=True)
class Job:
    """One job of a plan (``str``: ``"1F3"``, ``"0I2"``, ``"1OPT"``); ``micro`` is None for ``OPT``."""

    stage: int
    kind: str
    micro: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}" + ("" if self.micro is None else str(self.micro))

    @staticmethod
    def parse(text: str) -> Job:
        """``Job.parse("1F3") == Job(1, "F", 3)``, ``Job.parse("0OPT") == Job(0, "OPT")``;
        anything else is a ValueError naming the text."""
        m = _JOB_RE.fullmatch(text.strip())
        if m is None:
            raise ValueError(f"{text!r} is not a job: expected <stage><F|B|I|W><micro-batch> (e.g. 1F3, 0I2) "
                             "or <stage>OPT")
        return Job(int(m[1]), "OPT") if m[4] else Job(int(m[1]), m[2], int(m[3]))


Plan = Mapping[int, Sequence[Job]]
Schedule = Plan  # the old name


def format_schedule(plan: Plan) -> str:
    """One line per rank: ``rank 0: 0F0 0F1 0B0 ...`` (the inverse of :func:`parse_schedule`)."""
    return "\n".join(f"rank {r}: " + " ".join(map(str, jobs)) for r, jobs in sorted(plan.items()))


def parse_schedule(text: str) -> dict[int, tuple[Job, ...]]:
    """Read a plan back from :func:`format_schedule`'s text.

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


def placement(plan: Plan) -> dict[int, int]:
    """Stage -> the rank that runs its jobs (an error names a stage found on two ranks)."""
    owner: dict[int, int] = {}
    for r, jobs in sorted(plan.items()):
        for j in jobs:
            if owner.setdefault(j.stage, r) != r:
                raise ValueError(f"stage {j.stage} is on ranks {owner[j.stage]} and {r}")
    return owner


def loop_placement(n_ranks: int, n_stages: int) -> dict[int, int]:
    """Stages ``r, r+p, r+2p, ...`` on rank ``r`` (interleaved schedules)."""
    return {s: s % n_ranks for s in range(n_stages)}


def v_placement(n_ranks: int, n_stages: int) -> dict[int, int]:
    """Stages ``r`` and ``2p-1-r`` on rank ``r`` (the V of ZBV: rank 0 holds the first and last)."""
    return {s: s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(n_stages)}


def with_optimizer(plan: Plan) -> dict[int, tuple[Job, ...]]:
    """``plan`` with an ``OPT`` job for every stage that has none, right after that stage's last
    backward job on its rank (so that a stage which finishes early steps its optimizer early)."""
    out = {}
    for r, jobs in plan.items():
        have = {j.stage for j in jobs if j.kind == "OPT"}
        last = {j.stage: i for i, j in enumerate(jobs) if j.kind in ("B", "W")}
        after: dict[int, list[Job]] = defaultdict(list)
        for s, i in last.items():
            if s not in have:
                after[i].append(Job(s, "OPT"))
        out[r] = tuple(x for i, j in enumerate(jobs) for x in (j, *after.get(i, ())))
    return out


# -- schedules ---------------------------------------------------------------------------------
def _check_sizes(n_ranks: int, n_micro: int, n_stages: int | None, per_rank: int | None, name: str) -> int:
    for what, v in (("n_ranks", n_ranks), ("n_micro", n_micro)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be a whole number >= 1, got {v!r}")
    n_stages = n_ranks * (per_rank or 1) if n_stages is None else n_stages
    if not isinstance(n_stages, int) or n_stages < n_ranks or n_stages % n_ranks:
        raise ValueError(f"{name}: {n_stages} stages do not split evenly over {n_ranks} ranks")
    if per_rank is not None and n_stages != per_rank * n_ranks:
        raise ValueError(f"{name} runs {per_rank} stage{'s' * (per_rank > 1)} per rank: it needs "
                         f"{per_rank * n_ranks} stages on {n_ranks} ranks, got {n_stages}")
    return n_stages


def gpipe(n_ranks: int, n_micro: int, n_stages: int | None = None) -> dict[int, tuple[Job, ...]]:
    """All forwards, then all backwards (GPipe, "FThenB"): the activations of every micro-batch
    are held at once. One stage per rank.

    >>> print(format_schedule(gpipe(2, 2)))
    rank 0: 0F0 0F1 0B0 0B1
    rank 1: 1F0 1F1 1B0 1B1
    """
    _check_sizes(n_ranks, n_micro, n_stages, 1, "FThenB")
    return {s: tuple(Job(s, "F", m) for m in range(n_micro)) + tuple(Job(s, "B", m) for m in range(n_micro))
            for s in range(n_ranks)}


def one_f_one_b(n_ranks: int, n_micro: int, n_stages: int | None = None) -> dict[int, tuple[Job, ...]]:
    """1F1B: rank ``r`` runs ``p - 1 - r`` forwards ahead (warm-up), then alternates one forward
    and one backward, then drains the backwards; it holds at most ``p - r`` micro-batches'
    activations instead of all of them. One stage per rank."""
    _check_sizes(n_ranks, n_micro, n_stages, 1, "1F1B")
    return {s: _one_f_one_b_rank(s, n_ranks, n_micro, zero_bubble=False) for s in range(n_ranks)}


def eager_1f1b(n_ranks: int, n_micro: int, n_stages: int | None = None) -> dict[int, tuple[Job, ...]]:
    """Eager1F1B (PaddlePaddle's ``pipeline_scheduler_Eager1F1B`` pass): 1F1B whose rank ``r``
    runs ``2(p - r) - 1`` forwards before its first backward (1F1B: ``p - r``), then one
    backward and one forward, then drains (where ``n_micro`` is smaller, rank ``r`` runs them
    all first, as FThenB; Paddle refuses such counts). Every activation leaves a job earlier
    than in 1F1B, so with stages of equal cost a message's latency is paid only to fill and
    drain the pipeline, where 1F1B on 2 ranks waits it on every micro-batch. The same bubble as
    1F1B without latency; rank ``r`` holds up to ``2(p - r) - 1`` micro-batches' activations
    instead of ``p - r`` (the last rank is 1F1B's). With stages of unequal cost on 3 or more
    ranks it can be slower than 1F1B (an extra forward queued on a slow middle stage delays the
    backward the rank before it waits for): ``simulate(..., stage_costs=...)`` tells. One stage
    per rank.

    >>> print(format_schedule(eager_1f1b(2, 4)))
    rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
    """
    _check_sizes(n_ranks, n_micro, n_stages, 1, "Eager1F1B")
    return {s: _one_f_one_b_rank(s, n_ranks, n_micro, zero_bubble=False, warm=2 * (n_ranks - 1 - s))
            for s in range(n_ranks)}


def zbh1(n_ranks: int, n_micro: int, n_stages: int | None = None) -> dict[int, tuple[Job, ...]]:
    """ZB-H1 (Zero Bubble PP, arXiv 2401.10241): 1F1B's order of forwards and input-gradient
    halves (``I``), with rank ``r`` deferring the weight halves (``W``) of its first ``r``
    micro-batches to the end, where they fill the drain's bubble. Bubble (p-1)(T_F+T_B-T_W)
    against 1F1B's (p-1)(T_F+T_B+T_W), at 1F1B's activation count. One stage per rank.

    >>> print(format_schedule(zbh1(2, 2)))
    rank 0: 0F0 0F1 0I0 0W0 0I1 0W1
    rank 1: 1F0 1I0 1F1 1I1 1W0 1W1
    """
    _check_sizes(n_ranks, n_micro, n_stages, 1, "ZBH1")
    return {s: _one_f_one_b_rank(s, n_ranks, n_micro, zero_bubble=True) for s in range(n_ranks)}


def _one_f_one_b_rank(r: int, p: int, m: int, zero_bubble: bool, warm: int | None = None) -> tuple[Job, ...]:
    """Rank ``r``'s jobs: ``warm`` forwards (1F1B: ``p - 1 - r``), then pairs of a forward and a
    backward (I, and W after it but for the first ``r`` with ``zero_bubble``), then the drain."""
    warm = min(p - 1 - r if warm is None else warm, m)
    back = "I" if zero_bubble else "B"
    jobs = [Job(r, "F", i) for i in range(warm)]
    order = [(Job(r, "F", warm + i), Job(r, back, i)) for i in range(m - warm)]
    order += [(None, Job(r, back, i)) for i in range(m - warm, m)]
    w = 0
    for k, (f, b) in enumerate(order):
        jobs += [x for x in (f, b) if x is not None]
        if zero_bubble and k >= r:  # the first r weight halves wait for the drain
            jobs.append(Job(r, "W", w))
            w += 1
    jobs += [Job(r, "W", i) for i in range(w, m)] if zero_bubble else []
    return tuple(jobs)


def interleaved_1f1b(n_ranks: int, n_micro: int, n_stages: int | None = None) -> dict[int, tuple[Job, ...]]:
    """Interleaved 1F1B (Megatron-LM, arXiv 2104.04473): ``v = n_stages / n_ranks`` stages per
    rank (rank ``r`` holds ``r, r+p, ...``; default v = 2), forwards taken depth-first in rounds
    of ``p`` micro-batches; bubble ``(p-1)/v`` jobs' worth instead of ``p-1``. ``n_micro`` must
    be a multiple of the rounds ``max(1, n_micro // p)`` (any multiple of ``p`` is).

    >>> print(format_schedule(interleaved_1f1b(2, 2)))
    rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
    rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1
    """
    n_stages = 2 * n_ranks if n_stages is None else n_stages
    _check_sizes(n_ranks, n_micro, n_stages, None, "Interleaved1F1B")
    return _interleaved(n_ranks, n_micro, n_stages // n_ranks, zero_bubble=False)


def _interleaved(p: int, m: int, v: int, zero_bubble: bool) -> dict[int, tuple[Job, ...]]:
    rounds = max(1, m // p)
    per_round = m // rounds
    if m % rounds:
        # The rule depends on m itself (m // p rounds of equal size), so name counts that fit.
        fits = [k for k in range(max(1, m - 2 * p), m + 2 * p + 1) if k % max(1, k // p) == 0]
        lo, hi = max(k for k in fits if k < m), min(k for k in fits if k > m)
        raise ValueError(f"interleaved schedules run n_micro // n_ranks rounds of equal size: {m} micro-batches "
                         f"on {p} ranks do not split into {rounds} rounds; {lo} or {hi} do (any multiple of "
                         f"{p} does)")
    out = {}
    for r in range(p):
        # The last rank runs (v-1) rounds of forwards ahead; each rank before it 2 more (1 for ZB).
        warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
        total = m * v

        def fwd_stage(k: int) -> int:
            return ((k // per_round) % v) * p + r

        def bwd_stage(k: int) -> int:
            return (v - 1 - (k // per_round) % v) * p + r

        nf: dict[int, int] = defaultdict(int)
        nb: dict[int, int] = defaultdict(int)
        nw: dict[int, int] = defaultdict(int)
        jobs: list[Job] = []
        backs: list[int] = []  # stage of each backward, in order, for the weight halves

        def f(k: int) -> None:
            s = fwd_stage(k)
            jobs.append(Job(s, "F", nf[s]))
            nf[s] += 1

        def b(k: int) -> None:
            s = bwd_stage(k)
            jobs.append(Job(s, "I" if zero_bubble else "B", nb[s]))
            nb[s] += 1
            backs.append(s)

        def w() -> None:
            s = backs[sum(nw.values())]
            jobs.append(Job(s, "W", nw[s]))
            nw[s] += 1

        for k in range(warm):
            f(k)
        for k in range(total - warm):
            f(warm + k)
            b(k)
            if zero_bubble and k >= r:
                w()
        for k in range(total - warm, total):
            b(k)
            if zero_bubble and k >= r:
                w()
        while zero_bubble and sum(nw.values()) < len(backs):
            w()
        out[r] = tuple(jobs)
    return out


def zbv(n_ranks: int, n_micro: int, n_stages: int | None = None) -> dict[int, tuple[Job, ...]]:
    """ZB-V (Zero Bubble PP, section 6): two stages per rank in a V (rank ``r`` holds ``r`` and
    ``2p-1-r``, so rank 0 runs the first and the last stage), forwards, input- and weight-gradient
    halves ordered so that with T_F = T_B = T_W no rank idles but for the pipeline's fill (the
    last rank's first input arrives after p-1 forwards): the makespan is that lower bound.
    The order is the one of the paper's code (as in torch.distributed.pipelining's
    ScheduleZBVZeroBubble).

    >>> print(format_schedule(zbv(1, 2)))
    rank 0: 0F0 1F0 1I0 1W0 0F1 0I0 0W0 1F1 1I1 1W1 0I1 0W1
    """
    _check_sizes(n_ranks, n_micro, n_stages, 2, "ZBV")
    p, big = n_ranks, max(2 * n_ranks - 1, n_micro)  # built for at least 2p-1 micro-batches, then cut
    out = {}
    for r in range(p):
        c0, c1 = r, 2 * p - 1 - r
        cnt = {("F", c0): 0, ("F", c1): 0, ("I", c0): 0, ("I", c1): 0, ("W", c0): 0, ("W", c1): 0}
        jobs: list[Job] = []

        def add(kind: str, s: int) -> None:
            jobs.append(Job(s, kind, cnt[kind, s]))
            cnt[kind, s] += 1

        for _ in range(2 * (p - r) - 1):
            add("F", c0)
        for _ in range(r):
            add("F", c1)
            add("F", c0)
        for _ in range(p - r):
            add("F", c1), add("I", c1), add("W", c1)
        while cnt["F", c1] < cnt["F", c0] or cnt["F", c0] < big:
            if cnt["F", c0] < big:
                add("F", c0)
            add("I", c0), add("W", c0)
            add("F", c1), add("I", c1), add("W", c1)
        for _ in range(r):
            add("I", c0), add("I", c1)
        for _ in range(p - r):
            add("I", c0), add("W", c0)
        while cnt["W", c1] < cnt["I", c1]:
            add("W", c1)
        while cnt["W", c0] < cnt["I", c0]:
            add("W", c0)
        out[r] = tuple(j for j in jobs if j.micro < n_micro)  # type: ignore[operator]
    return out


SCHEDULES: dict[str, Callable[..., dict[int, tuple[Job, ...]]]] = {
    "gpipe": gpipe, "fthenb": gpipe, "1f1b": one_f_one_b, "eager1f1b": eager_1f1b,
    "interleaved1f1b": interleaved_1f1b, "zbh1": zbh1, "zbv": zbv}
#: The named schedules, one name each (``SCHEDULES`` also holds aliases), in the order tables list them.
NAMES = ("FThenB", "1F1B", "Eager1F1B", "Interleaved1F1B", "ZBH1", "ZBV")
#: Stages per rank each named schedule runs (None: any whole number; Interleaved1F1B's default is 2).
STAGES_PER_RANK = {"gpipe": 1, "fthenb": 1, "1f1b": 1, "eager1f1b": 1, "interleaved1f1b": None, "zbh1": 1,
                   "zbv": 2}


def get_schedule(name: str) -> Callable[..., dict[int, tuple[Job, ...]]]:
    """The schedule function called ``name`` (case-insensitive; ``-`` and ``_`` ignored)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(NAMES)} (FThenB is also GPipe), or "
                         "pass a function (n_ranks, n_micro, n_stages) -> plan, or a plan")
    return SCHEDULES[key]


# -- checking and timing -------------------------------------------------------------------------
@dataclass(frozen=True)
class Simulation:
    """A plan run on ideal ranks: when each job starts and ends; ``makespan``; ``bubble``, the
    share of ``makespan x ranks`` no job runs; ``idle`` per rank (``makespan`` minus its busy
    time); ``peak_activations`` per stage, the most micro-batches whose forward has run and whose
    last backward job has not (what the stage holds)."""

    start: dict[Job, float]
    end: dict[Job, float]
    makespan: float
    bubble: float
    idle: dict[int, float]
    peak_activations: dict[int, int]


def dependencies(plan: Plan) -> dict[Job, tuple[Job, ...]]:
    """The jobs each job of a checked plan waits for: ``sFm`` on ``(s-1)Fm``; ``sBm`` / ``sIm``
    on ``sFm`` and the input-gradient job (B or I) of ``(s+1, m)``; ``sWm`` on ``sIm``;
    ``sOPT`` on every last backward job (B or W) of stage s."""
    jobs = {j for js in plan.values() for j in js}
    last = max(j.stage for j in jobs)
    grad = {(j.stage, j.micro): j for j in jobs if j.kind in ("B", "I")}
    done = defaultdict(list)
    for j in jobs:
        if j.kind in ("B", "W"):
            done[j.stage].append(j)
    out: dict[Job, tuple[Job, ...]] = {}
    for j in jobs:
        if j.kind == "F":
            out[j] = (Job(j.stage - 1, "F", j.micro),) if j.stage else ()
        elif j.kind in ("B", "I"):
            out[j] = (Job(j.stage, "F", j.micro),) + ((grad[j.stage + 1, j.micro],) if j.stage < last else ())
        elif j.kind == "W":
            out[j] = (Job(j.stage, "I", j.micro),)
        else:
            out[j] = tuple(sorted(done[j.stage], key=lambda x: x.micro))  # type: ignore[arg-type,return-value]
    return out


def check(plan: Plan) -> dict[Job, tuple[Job, ...]]:
    """Check a plan's jobs (not yet their order): raises ValueError for an empty plan, a bad or
    repeated job, a stage on two ranks, stages that are not 0..S-1, a (stage, micro-batch) that
    misses its forward or has neither one B nor one I and one W, or a stage with two OPT jobs.
    Returns the dependencies (:func:`dependencies`)."""
    jobs = [j for js in plan.values() for j in js]
    if not jobs:
        raise ValueError("the plan has no jobs")
    for j in jobs:
        if j.stage < 0 or j.kind not in KINDS or (j.kind == "OPT") != (j.micro is None) or (
                j.micro is not None and j.micro < 0):
            raise ValueError(f"bad job {j}")
    seen: set[Job] = set()
    for j in jobs:
        if j in seen:
            raise ValueError(f"the plan runs {j} twice")
        seen.add(j)
    owner = placement(plan)
    stages = sorted(owner)
    if stages != list(range(len(stages))):
        raise ValueError(f"stages must be 0..{len(stages) - 1}, got {stages}")
    micros = [j.micro for j in jobs if j.micro is not None]
    if not micros:
        raise ValueError("the plan has no forward or backward jobs")
    n_micro = 1 + max(micros)
    missing = []
    for s in stages:
        for m in range(n_micro):
            has = {k for k in ("F", "B", "I", "W") if Job(s, k, m) in seen}
            if "F" not in has:
                missing.append(f"{s}F{m}")
            if has & {"B", "I", "W"} not in ({"B"}, {"I", "W"}):
                if "B" in has and has & {"I", "W"}:
                    raise ValueError(f"stage {s} micro-batch {m} has both a full backward and a split one")
                missing += [f"{s}B{m}"] if not has & {"I", "W"} else [f"{s}{k}{m}" for k in "IW" if k not in has]
    if missing:
        raise ValueError(f"the plan misses {missing[:6]}")
    return dependencies(plan)


def most_held(jobs: Iterable[Job], end: Mapping[Job, float]) -> int:
    """The most micro-batches' activations held at once by ``jobs`` (of one stage, or all of a
    rank's stages) ending at ``end``: from a forward's end to the end of that micro-batch's last
    backward job there (B, or W after I). At a tie, releases count first.

    >>> f, b = Job(0, "F", 0), Job(0, "B", 0)
    >>> most_held([f, b, Job(0, "F", 1), Job(0, "B", 1)], {f: 1, b: 2, Job(0, "F", 1): 2, Job(0, "B", 1): 3})
    1
    """
    events = sorted((end[j], 1 if j.kind == "F" else -1) for j in jobs if j.kind in ("F", "B", "W"))
    held = best = 0
    for _, d in events:
        held += d
        best = max(best, held)
    return best


def simulate(plan: Plan, costs: tuple[float, float, float] = (1.0, 1.0, 1.0), latency: float = 0.0,
             opt_cost: float = 0.0, stage_costs: Mapping[int, Mapping[str, float]] | None = None) -> Simulation:
    """Check ``plan`` and time it: each rank runs its jobs in order, a job starts when its rank is
    free and its dependencies (:func:`dependencies`) have ended, ``latency`` later for one on
    another rank. ``costs = (T_F, T_B, T_W)``: forward, input-gradient half (I), weight half (W);
    a full backward (B) costs ``T_B + T_W``. ``stage_costs``: per stage, costs by job kind
    (``{0: {"F": 3.6, "B": 4.8}}``, measured ones) that replace ``costs`` for that stage and
    kind: stages of unequal cost (a first stage makes no input gradient). Raises ValueError for a bad plan (:func:`check`) or
    one that would deadlock, naming the job each stuck rank waits at and what it waits for.

    >>> simulate({0: [Job(0, "B", 0), Job(0, "F", 0)]})
    Traceback (most recent call last):
    ...
    ValueError: plan deadlocks: rank 0 waits at 0B0 for 0F0
    """
    t_f, t_b, t_w = costs
    if not all(math.isfinite(c) for c in (*costs, latency)) or min(costs) < 0 or t_f + t_b <= 0 or latency < 0:
        raise ValueError(f"costs must be finite and >= 0 with T_F + T_B > 0, and latency finite and >= 0, got "
                         f"{costs}, {latency}")
    needs = check(plan)
    owner = placement(plan)
    cost = {"F": t_f, "B": t_b + t_w, "I": t_b, "W": t_w, "OPT": opt_cost}
    end: dict[Job, float] = {}
    start: dict[Job, float] = {}
    pos = {r: 0 for r in plan}
    free = {r: 0.0 for r in plan}
    n_jobs = sum(len(js) for js in plan.values())
    while len(end) < n_jobs:
        moved = False
        for r, js in plan.items():
            while pos[r] < len(js) and all(d in end for d in needs[js[pos[r]]]):
                j = js[pos[r]]
                start[j] = max([free[r], *(end[d] + (latency if owner[d.stage] != r else 0.0) for d in needs[j])])
                c = stage_costs.get(j.stage, {}).get(j.kind) if stage_costs else None
                end[j] = free[r] = start[j] + (cost[j.kind] if c is None else c)
                pos[r] += 1
                moved = True
        if not moved:
            stuck = [(r, js[pos[r]]) for r, js in sorted(plan.items()) if pos[r] < len(js)]
            raise ValueError("plan deadlocks: " + "; ".join(
                f"rank {r} waits at {j} for {', '.join(str(d) for d in needs[j] if d not in end)}" for r, j in stuck))
    makespan = max(end.values())
    busy = {r: sum(end[j] - start[j] for j in js) for r, js in plan.items()}
    peak = {s: most_held((j for j in plan[owner[s]] if j.stage == s), end) for s in sorted(owner)}
    return Simulation(start, end, makespan, 1 - sum(busy.values()) / (makespan * len(plan)),
                      {r: makespan - b for r, b in busy.items()}, peak)
