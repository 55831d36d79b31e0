"""Schedules side by side before anything runs: for a number of ranks and micro-batches, each
named schedule's (or your plan's) simulated step time, bubble and activations held per rank.
``flowexec schedules`` prints it.

Costs are per micro-batch of one rank's layers, so that schedules with several stages a rank
(Interleaved1F1B, ZBV: each stage holds 1/v of them) compare on the same model: their jobs cost
``costs / v``, and their activations count in micro-batches of a rank's layers.

>>> rows = compare(4, 8)
>>> [(r.name, round(r.bubble, 3)) for r in rows]  # doctest: +NORMALIZE_WHITESPACE
[('FThenB', 0.273), ('1F1B', 0.273), ('Eager1F1B', 0.273), ('Interleaved1F1B', 0.158),
 ('ZBH1', 0.111), ('ZBV', 0.059)]
>>> rows[1].activations  # 1F1B: rank r holds p - r micro-batches
(4.0, 3.0, 2.0, 1.0)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from .schedules import NAMES, Plan, format_schedule, get_schedule, most_held, parse_schedule, placement, simulate


@dataclass(frozen=True, slots=True)
class Row:
    """One schedule's simulation: ``makespan`` and ``bubble`` (None with ``error``, why it does
    not fit), ``activations``: the most micro-batches of a rank's layers each rank holds at once."""

    name: str
    stages_per_rank: int
    makespan: float | None = None
    bubble: float | None = None
    activations: tuple[float, ...] = ()
    error: str | None = None


def compare(n_ranks: int, n_micro: int, costs: tuple[float, float, float] = (1.0, 1.0, 1.0), latency: float = 0.0,
            names: Sequence[str] = NAMES, plans: Mapping[str, Plan] | None = None) -> list[Row]:
    """A :class:`Row` per schedule in ``names`` (built for ``n_ranks`` and ``n_micro``), then
    per plan in ``plans`` (as given; every rank must hold as many stages). ``costs = (T_F, T_I,
    T_W)`` of a micro-batch through one rank's layers (a full backward costs T_I + T_W);
    ``latency``: each message's. Raises ValueError for a bad plan or bad costs.

    >>> [(r.name, r.makespan, r.activations) for r in compare(2, 4, names=["1F1B", "ZBV"])]
    [('1F1B', 15.0, (2.0, 1.0)), ('ZBV', 12.5, (2.0, 2.0))]
    """
    rows = []
    for name in names:
        make = get_schedule(name)
        try:
            plan = make(n_ranks, n_micro)
        except ValueError as e:
            rows.append(Row(name, 0, error=str(e)))
            continue
        rows.append(_row(name, plan, costs, latency))
    for name, plan in (plans or {}).items():
        rows.append(_row(name, plan, costs, latency))
    return rows


def _row(name: str, plan: Plan, costs: tuple[float, float, float], latency: float) -> Row:
    owner = placement(plan)
    held = {r: sum(1 for s in owner if owner[s] == r) for r in plan}
    v = held[min(plan)]
    if set(held.values()) != {v} or v == 0:
        # each stage is charged 1/v of a rank's costs: only sound if every rank holds v stages
        raise ValueError(f"{name}: every rank must hold as many stages to compare on a rank's costs, got "
                         + ", ".join(f"rank {r}: {k}" for r, k in sorted(held.items())))
    sim = simulate(plan, (costs[0] / v, costs[1] / v, costs[2] / v), latency)
    return Row(name, v, sim.makespan, sim.bubble, tuple(most_held(plan[r], sim.end) / v for r in sorted(plan)))


def format_comparison(rows: Sequence[Row], n_ranks: int, n_micro: int, costs: tuple[float, float, float],
                      latency: float) -> str:
    """The rows as a text table under a heading with the sizes and costs; a schedule that does
    not fit gets its reason instead of figures.

    >>> print(format_comparison(compare(2, 4, names=["1F1B"]), 2, 4, (1, 1, 1), 0))
    2 ranks, 4 micro-batches; a micro-batch through a rank's layers costs F 1, I 1, W 1 (B = I + W); a message 0
    schedule         stages a rank     step  bubble  activations held, rank 0 1 ...
    1F1B                         1       15   20.0%  2 1
    """
    t_f, t_b, t_w = costs
    lines = [f"{n_ranks} ranks, {n_micro} micro-batches; a micro-batch through a rank's layers costs "
             f"F {t_f:g}, I {t_b:g}, W {t_w:g} (B = I + W); a message {latency:g}",
             f"{'schedule':<16} {'stages a rank':>13} {'step':>8} {'bubble':>7}  activations held, rank 0 1 ..."]
    for r in rows:
        if r.error is not None:
            lines.append(f"{r.name:<16} does not fit: {r.error}")
            continue
        held = " ".join(f"{a:g}" for a in r.activations)
        lines.append(f"{r.name:<16} {r.stages_per_rank:>13} {r.makespan:>8.6g} {r.bubble:>7.1%}  {held}")
    return "\n".join(lines)


def schedules_command(n_ranks: int | None, n_micro: int | None, costs: str, latency: float, show: Sequence[str],
                      plan_files: Sequence[str]) -> str:
    """``flowexec schedules``: the comparison for the sizes given (default 4 ranks, 8
    micro-batches; with ``plan_files``, the plans' own sizes), then each schedule in ``show``
    and each plan as a job table. Raises ValueError naming a bad option, file or plan.

    >>> print(schedules_command(2, 2, "1,1,1", 0.0, ["1F1B"], []).splitlines()[-3:])
    ['1F1B:', 'rank 0: 0F0 0F1 0B0 0B1', 'rank 1: 1F0 1B0 1F1 1B1']
    """
    for flag, value in (("--ranks", n_ranks), ("--micro", n_micro)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    try:
        c = tuple(float(x) for x in costs.split(","))
    except ValueError:
        c = ()
    if len(c) != 3 or not all(math.isfinite(x) and x >= 0 for x in c) or c[0] + c[1] <= 0:
        raise ValueError(f"--costs takes three finite numbers T_F,T_I,T_W, none negative and T_F + T_I above 0, got "
                         f"{costs!r}")
    if not math.isfinite(latency) or latency < 0:
        raise ValueError(f"--latency must be a finite number >= 0, got {latency}")
    plans: dict[str, Plan] = {}
    sizes: tuple[str, int, int] | None = None  # the first plan's file, ranks and micro-batches
    for path in plan_files:
        try:
            with open(path, encoding="utf-8") as f:
                plan = parse_schedule(f.read())
            simulate(plan)  # a bad or deadlocking plan is named with its file
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: {e}") from None
        p, m = len(plan), 1 + max(j.micro for js in plan.values() for j in js if j.micro is not None)
        if sizes is None:
            given = " and ".join(f"--{k} {v}" for k, v, w in (("ranks", n_ranks, p), ("micro", n_micro, m))
                                 if v is not None and v != w)
            if given:
                raise ValueError(f"{path} has {p} ranks and {m} micro-batches, but {given} was given: leave it out "
                                 "to compare at the plan's sizes")
            sizes = (path, p, m)
        elif (p, m) != sizes[1:]:
            raise ValueError(f"{path} has {p} ranks and {m} micro-batches, {sizes[0]} {sizes[1]} and {sizes[2]}: "
                             "compare plans of one size at a time")
        plans[path] = plan
    n_ranks, n_micro = (sizes[1], sizes[2]) if sizes else (n_ranks or 4, n_micro or 8)
    t = (c[0], c[1], c[2])
    names = [os.path.basename(k) for k in plans]  # a row each, by file name unless two share one
    labels = {k: (os.path.basename(k) if names.count(os.path.basename(k)) == 1 else k) for k in plans}
    rows = compare(n_ranks, n_micro, t, latency, plans={labels[k]: v for k, v in plans.items()})
    out = [format_comparison(rows, n_ranks, n_micro, t, latency)]
    for name in show:
        make = get_schedule(name)  # an unknown name is an error; one that does not fit is said
        try:
            table = format_schedule(make(n_ranks, n_micro))
        except ValueError as e:
            table = f"does not fit: {e}"
        out += ["", f"{name}:", table]
    for path, plan in plans.items():
        out += ["", f"{path}:", format_schedule(plan)]
    return "\n".join(out)


__all__ = ["Row", "compare", "format_comparison", "schedules_command"]
