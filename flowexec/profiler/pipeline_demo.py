"""``flowexec demo --out DIR``'s pipeline part: a 2-rank gloo pipeline of a small model trained
with profiling on for a few steps, merged into ``DIR/trace.json`` and ``DIR/timeline.html``.

Each rank records the chosen steps through :class:`~.session.StepProfiler` into
``DIR/records/<schedule>/rank<r>.jsonl``; the parent merges them. The schedule's theoretical
bubble (``simulate`` on unit jobs, a backward costing two forwards) goes into the records'
meta, so the page shows it beside the measured one.
"""
from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

from .records import Span


def _stage_spans(res: Any, rank: int, step: int, host: str, offset: int) -> list[Span]:
    """The job records of one ``PipelineStage.run`` (name, start, end, ns waited) as spans: the
    job on ``compute`` and, where it waited to receive, the wait on ``wait`` (its first part)."""
    from ..pipeline.schedules import Job

    pid = os.getpid()
    out = []
    for name, a, b, waited in res.jobs:
        job = Job.parse(name)
        out.append(Span(rank, host, pid, step, job.stage, job.kind, job.micro, "compute", a, b, "host", offset))
        if waited:
            out.append(Span(rank, host, pid, step, job.stage, "wait", job.micro, "wait", a, a + waited, "host", offset))
    return out


def profiled_worker(rank: int, world: int, cfg_dict: dict[str, Any], directory: str, record: list[int] | None) -> dict:
    """One rank: train ``cfg.steps`` steps, recording the steps in ``record`` into ``directory``
    (``None``: no profiler at all). Returns the records' path, the losses and each step's ns."""
    import contextlib
    import time

    from .timers import NULL_TIMER

    from ..pipeline.demo import Config, blocks, data, stage_slice
    from ..pipeline.schedules import SCHEDULES, simulate
    from ..pipeline.stage import PipelineStage, split_batch
    from .session import StepProfiler

    cfg = Config(**cfg_dict)
    torch.set_num_threads(max(1, cfg.threads))
    model = blocks(cfg)
    mine = torch.nn.Sequential(*(model[i] for i in stage_slice(cfg, rank, world)))
    stage = PipelineStage(mine, rank, world, loss_fn=F.mse_loss)
    sched = SCHEDULES[cfg.schedule](world, cfg.n_micro)
    sim = simulate(sched, backward_cost=2)
    x, y = data(cfg)
    xs, ys = split_batch(x, cfg.n_micro), split_batch(y, cfg.n_micro)
    stage.setup(xs[0].shape)
    opt = torch.optim.SGD(mine.parameters(), lr=cfg.lr)
    meta = {"schedule": cfg.schedule, "n_stages": world, "n_micro": cfg.n_micro, "device": "cpu",
            "model": f"{cfg.blocks} x Linear({cfg.width}) + tanh, batch {cfg.batch}",
            "theory_bubble": sim.bubble, "theory_backward_cost": 2}
    prof = StepProfiler(directory, record, device="cpu", meta=meta) if record is not None else None
    losses, step_ns = [], []
    for k in range(cfg.steps):
        t0 = time.perf_counter_ns()
        with prof.step(k) if prof else contextlib.nullcontext(NULL_TIMER) as timer:
            opt.zero_grad(set_to_none=False)
            res = stage.run(sched[rank], inputs=xs if rank == 0 else None, targets=ys if rank == world - 1 else None)
            tok = timer.begin(step=k, stage=rank, kind="OPT", micro=None)
            opt.step()
            timer.end(tok)
            if timer.enabled:  # the stage stamps its own jobs on the host clock
                prof.add(k, _stage_spans(res, rank, k, prof.host, prof.timer_.offset_ns))
        step_ns.append(time.perf_counter_ns() - t0)
        losses += [sum(res.losses) / len(res.losses)] if res.losses else []
    path = prof.close() if prof else None
    return {"records": path, "losses": losses, "step_ns": step_ns}


def profile_pipeline(out_dir: str, schedules: tuple[str, ...] = ("1f1b",), steps: int = 5,
                     record: tuple[int, ...] = (2, 3, 4), n_micro: int = 4) -> list[dict[str, Any]]:
    """Run the profiled pipeline once per schedule; returns per schedule its paths and summary."""
    from ..pipeline.demo import Config
    from ..pipeline.launch import spawn
    from .command import theory_of
    from .merge import merge_dir
    from .page import write_page
    from .summary import summarize
    from .trace import write_trace

    results = []
    for i, name in enumerate(schedules):
        cfg = Config(width=256, blocks=4, batch=16 * n_micro, n_micro=n_micro, schedule=name, steps=steps, threads=1)
        rec_dir = os.path.join(out_dir, "records", name)
        os.makedirs(rec_dir, exist_ok=True)
        for old in os.listdir(rec_dir):
            if old.endswith(".jsonl"):
                os.remove(os.path.join(rec_dir, old))
        spawn(profiled_worker, 2, asdict(cfg), rec_dir, list(record), timeout=120)
        merged = merge_dir(rec_dir)
        meta = merged.meta()
        stem = "" if i == 0 else f"-{name}"
        trace = write_trace(merged.spans, os.path.join(out_dir, f"trace{stem}.json"), meta)
        offsets = {r: (h.clock_offset_ns, h.clock_rtt_ns) for r, h in merged.headers.items()}
        page = write_page(merged.spans, os.path.join(out_dir, f"timeline{stem}.html"), meta, offsets)
        results.append({"schedule": name, "trace": trace, "page": page, "records": rec_dir,
                        "theory_bubble": meta.get("theory_bubble"),
                        "summary": [r.to_dict() for r in summarize(merged.spans, theory_of(meta))]})
    return results
