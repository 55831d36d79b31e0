"""``flowexec demo --out DIR``'s pipeline part: a 2-rank gloo pipeline of a small model trained
with profiling on for a few steps, merged into ``DIR/trace.json`` and ``DIR/timeline.html``.

Each rank records the chosen steps through :class:`~.recording.StepProfiler` into
``DIR/records/<schedule>/rank<r>.jsonl``; the parent merges them. The schedule's theoretical
bubble (``simulate`` on unit jobs: F, I and W one unit each, a whole backward two) goes into
the records' meta, so the page shows it beside the measured one.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

from ..pipeline.demo import Config, data, stage_modules  # the model, config and batch of `flowexec pipeline`


def theory(schedule: Any, n_ranks: int, n_micro: int) -> tuple[float, dict[int, float]]:
    """The schedule's bubble on ideal ranks (forward, input-gradient and weight-gradient halves
    of a backward all one unit): overall and per rank (idle share of the makespan). ``schedule``:
    a name or a plan (``{rank: jobs}``)."""
    from ..pipeline.schedules import STAGES_PER_RANK, get_schedule, simulate

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


def profiled_worker(rank: int, world: int, cfg_dict: dict[str, Any], directory: str, record: list[int] | None) -> dict:
    """One rank: train ``cfg.steps`` steps with ``PipelineTrainer(..., profile=record)``,
    recording the steps in ``record`` into ``directory`` (``None``: no profiler at all).
    Returns the records' path, the losses and each step's ns."""
    import time

    from ..pipeline.trainer import PipelineTrainer

    cfg = Config(**cfg_dict)
    torch.set_num_threads(max(1, cfg.threads))
    trainer = PipelineTrainer(stage_modules(cfg, world), schedule=cfg.schedule, microbatches=cfg.n_micro,
                              loss_fn=F.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=cfg.lr), compile=False,
                              profile=record, profile_dir=directory)
    x, y = data(cfg)
    losses, step_ns = [], []
    for k in range(cfg.steps):
        t0 = time.perf_counter_ns()
        loss = trainer.step(x, y)
        step_ns.append(time.perf_counter_ns() - t0)
        if loss is not None:
            losses.append(float(loss))
    path = trainer.profiler.close() if trainer.profiler else None
    return {"records": path, "losses": losses, "step_ns": step_ns}


def profile_pipeline(out_dir: str, schedules: tuple[str, ...] = ("1f1b",), steps: int = 5,
                     record: tuple[int, ...] = (2, 3, 4), n_micro: int = 4, width: int = 256) -> list[dict[str, Any]]:
    """Run the profiled pipeline once per schedule; returns per schedule its paths and summary."""
    from ..pipeline.launch import spawn
    from .command import theory_at_measured_costs, theory_of
    from .merge import merge_dir
    from .page import write_page
    from .summary import summarize
    from .trace import write_trace

    results = []
    for i, name in enumerate(schedules):
        cfg = Config(width=width, blocks=4, batch=16 * n_micro, n_micro=n_micro, schedule=name, steps=steps, threads=1)
        rec_dir = os.path.join(out_dir, "records", name)
        os.makedirs(rec_dir, exist_ok=True)
        for old in os.listdir(rec_dir):
            if old.endswith(".jsonl"):
                os.remove(os.path.join(rec_dir, old))
        spawn(profiled_worker, 2, asdict(cfg), rec_dir, list(record), timeout=120)
        merged = merge_dir(rec_dir)
        meta = merged.meta()
        at_costs = theory_at_measured_costs(meta, merged.spans)
        if at_costs is not None:
            meta["theory_bubble_measured_costs"] = at_costs
        stem = "" if i == 0 else f"-{name}"
        trace = write_trace(merged.spans, os.path.join(out_dir, f"trace{stem}.json"), meta)
        offsets = {r: (h.clock_offset_ns, h.clock_rtt_ns) for r, h in merged.headers.items()}
        page = write_page(merged.spans, os.path.join(out_dir, f"timeline{stem}.html"), meta, offsets)
        results.append({"schedule": name, "trace": trace, "page": page, "records": rec_dir,
                        "theory_bubble": meta.get("theory_bubble"), "theory_bubble_measured_costs": at_costs,
                        "summary": [r.to_dict() for r in summarize(merged.spans, theory_of(meta))]})
    return results
