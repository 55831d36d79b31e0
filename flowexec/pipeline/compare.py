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

import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from .schedules import Plan, Simulation, format_schedule, get_schedule, parse_schedule, placement, simulate

NAMES = ("FThenB", "1F1B", "Eager1F1B", "Interleaved1F1B", "ZBH1", "ZBV")


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
    per plan in ``plans`` (as given). ``costs = (T_F, T_B, T_W)`` of a micro-batch through one
    rank's layers (a full backward costs T_B + T_W); ``latency``: each message's."""
    rows = []
    for name in names:
        try:
            plan = get_schedule(name)(n_ranks, n_micro)
        except ValueError as e:
            rows.append(Row(name, 0, error=str(e)))
            continue
        rows.append(_row(name, plan, costs, latency))
    for name, plan in (plans or {}).items():
        rows.append(_row(name, plan, costs, latency))
    return rows


def _row(name: str, plan: Plan, costs: tuple[float, float, float], latency: float) -> Row:
    owner = placement(plan)
    v = len(owner) // len(plan)
    sim = simulate(plan, tuple(c / v for c in costs), latency)  # type: ignore[arg-type]
    return Row(name, v, sim.makespan, sim.bubble, tuple(_held(plan, sim, r) / v for r in sorted(plan)))


def _held(plan: Plan, sim: Simulation, rank: int) -> int:
    """The most micro-batches' activations rank ``rank`` holds at once over all its stages: from a
    forward's end to the end of that micro-batch's last backward job there (B, or W)."""
    events = sorted((sim.end[j], 1 if j.kind == "F" else -1) for j in plan[rank] if j.kind in ("F", "B", "W"))
    held = best = 0
    for _, d in events:
        held += d
        best = max(best, held)
    return best


def format_comparison(rows: Sequence[Row], n_ranks: int, n_micro: int, costs: tuple[float, float, float],
                      latency: float) -> str:
    """The rows as a text table, a heading with the sizes and costs, and one line per error."""
    t_f, t_b, t_w = costs
    lines = [f"{n_ranks} ranks, {n_micro} micro-batches; a micro-batch through a rank's layers costs "
             f"F {t_f:g}, I {t_b:g}, W {t_w:g} (B = I + W); a message {latency:g}",
             f"{'schedule':<16} {'stages a rank':>13} {'step':>8} {'bubble':>7}  activations held, rank 0 1 ..."]
    for r in rows:
        if r.error is not None:
            lines.append(f"{r.name:<16} does not fit: {r.error}")
            continue
        held = " ".join(f"{a:g}" for a in r.activations)
        lines.append(f"{r.name:<16} {r.stages_per_rank:>13} {r.makespan:>8.4g} {r.bubble:>7.1%}  {held}")
    return "\n".join(lines)


def schedules_command(n_ranks: int | None, n_micro: int | None, costs: str, latency: float, show: Sequence[str],
                      plan_files: Sequence[str]) -> str:
    """``flowexec schedules``: the comparison for the sizes given (default 4 ranks, 8
    micro-batches; with ``plan_files``, the plans' own sizes), then each schedule in ``show``
    and each plan as a job table. Raises ValueError naming a bad option, file or plan."""
    try:
        parsed = tuple(float(c) for c in costs.split(","))
    except ValueError:
        parsed = ()
    if len(parsed) != 3:
        raise ValueError(f"--costs takes three numbers T_F,T_I,T_W, got {costs!r}")
    plans: dict[str, Plan] = {}
    for path in plan_files:
        with open(path) as f:
            text = f.read()
        try:
            plans[path] = parse_schedule(text)
            simulate(plans[path])  # a bad or deadlocking plan is named with its file
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    for path, plan in plans.items():  # the plans set the sizes the named schedules are built for
        p, m = len(plan), 1 + max(j.micro for js in plan.values() for j in js if j.micro is not None)
        if (n_ranks or p) != p or (n_micro or m) != m:
            given = " ".join(f"--{k} {v}" for k, v in (("ranks", n_ranks), ("micro", n_micro)) if v)
            raise ValueError(f"{path} has {p} ranks and {m} micro-batches, but {given} was given: leave it out to "
                             "compare at the plan's sizes")
        n_ranks, n_micro = p, m
    n_ranks, n_micro = n_ranks or 4, n_micro or 8
    if n_ranks < 1 or n_micro < 1 or latency < 0:
        raise ValueError("--ranks and --micro must be at least 1 and --latency at least 0")
    c = (parsed[0], parsed[1], parsed[2])
    rows = compare(n_ranks, n_micro, c, latency, plans={os.path.basename(k): v for k, v in plans.items()})
    out = [format_comparison(rows, n_ranks, n_micro, c, latency)]
    for name in show:
        out += ["", f"{name}:", format_schedule(get_schedule(name)(n_ranks, n_micro))]
    for path, plan in plans.items():
        out += ["", f"{path}:", format_schedule(plan)]
    return "\n".join(out)


__all__ = ["NAMES", "Row", "compare", "format_comparison", "schedules_command"]
