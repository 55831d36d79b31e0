"""A schedule's bubble in theory, for a timeline's records: at equal job costs (what the trainer
writes into its records' meta) and at the job costs a timeline measured (what ``flowexec
timeline merge`` and ``flowexec demo --out`` print beside the measured bubble).

Both are :func:`~.schedules.simulate` of the plan; they live here, beside the schedules, so that
the profiler's exporters read a meta dictionary and never import the pipeline.

>>> round(theory("1f1b", 2, 4)[0], 3)
0.2
>>> sorted(pipeline_meta("1f1b", "1f1b", 2, 2, 4, "cpu"))[:3]
['device', 'n_micro', 'n_ranks']
"""
from __future__ import annotations

from typing import Any, Iterable

from ..profiler.records import JOB_KINDS, Span
from .schedules import STAGES_PER_RANK, get_schedule, simulate


def theory(schedule: Any, n_ranks: int, n_micro: int) -> tuple[float, dict[int, float]]:
    """The schedule's bubble on ideal ranks (forward, input-gradient and weight-gradient halves
    of a backward all one unit): overall and per rank (idle share of the makespan). ``schedule``:
    a name or a plan (``{rank: jobs}``)."""
    if isinstance(schedule, str):
        per = STAGES_PER_RANK.get(schedule.lower()) or 1
        schedule = get_schedule(schedule)(n_ranks, n_micro, per * n_ranks)
    plan = {r: tuple(j for j in js if j.kind != "OPT") for r, js in schedule.items()}
    sim = simulate(plan, costs=(1.0, 1.0, 1.0))
    return sim.bubble, {r: sim.idle[r] / sim.makespan for r in sim.idle}


def pipeline_meta(schedule: Any, name: str, n_ranks: int, n_stages: int, n_micro: int, device: Any) -> dict[str, Any]:
    """What a pipeline's records say about the run (the header's ``meta``): the schedule, sizes,
    device and its theoretical bubble."""
    th, per_rank = theory(schedule, n_ranks, n_micro)
    return {"schedule": name, "n_ranks": n_ranks, "n_stages": n_stages, "n_micro": n_micro, "device": str(device),
            "theory_bubble": th, "theory_bubble_per_rank": per_rank, "theory_costs": "F = I = W = 1"}


def theory_at_measured_costs(meta: dict, spans: Iterable[Span]) -> dict[int, float] | None:
    """Per rank, the bubble ``simulate`` predicts for the records' schedule if every job took its
    kind's measured mean (over all ranks): what the schedule costs at these job times, before
    host overhead and transfer latency. None when the meta does not name a schedule."""
    try:
        plan = get_schedule(meta["schedule"])(meta["n_ranks"], meta["n_micro"], meta.get("n_stages"))
    except (KeyError, ValueError, TypeError):
        return None
    durs: dict[str, list[int]] = {}
    for s in spans:
        if s.kind in JOB_KINDS:
            durs.setdefault(s.kind, []).append(s.duration_ns)
    mean = {k: sum(v) / len(v) for k, v in durs.items()}
    if "F" not in mean:
        return None
    if "I" in mean:  # split backward: (T_F, T_I, T_W)
        costs = (mean["F"], mean["I"], mean.get("W", 0.0))
    else:  # whole backwards: T_B + T_W is one B
        costs = (mean["F"], mean.get("B", mean["F"]), 0.0)
    sim = simulate(plan, costs=costs)
    return {r: sim.idle[r] / sim.makespan for r in sim.idle}
