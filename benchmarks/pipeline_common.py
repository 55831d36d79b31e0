"""What the pipeline benchmarks share: the same training through torch.distributed.pipelining
(one rank's worker), the bubble a rank measured from its job spans, and the theory."""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from flowexec.pipeline import get_schedule, simulate
from flowexec.pipeline.demo import Config, data, stage_modules, stages_per_rank

# flowexec schedule -> the torch.distributed.pipelining schedule class run beside it
# (torch has no Eager1F1B: its 1F1B, the schedule it varies, runs beside it)
TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B",
               "zbh1": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "eager1f1b": "1F1B"}
SCHEDULES = ["gpipe", "1f1b", "interleaved1f1b", "zbh1", "zbv"]  # the default run: the five


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model and batch options the CPU pipeline benchmarks share."""
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--in-width", type=int, default=768,
                    help="the input layer's features (0: none); with --out-width it evens out the stages' costs")
    ap.add_argument("--out-width", type=int, default=512, help="the output head's features (0: none)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=0, help="Linear(width) + tanh blocks (0: 4 a rank)")


def model_config(args: argparse.Namespace, **fields: Any) -> Config:
    """The run's :class:`Config` from :func:`add_model_args`' options: ``--blocks`` (4 a rank
    by default), one intra-op thread, SGD at 0.01."""
    return Config(width=args.width, in_width=args.in_width, out_width=args.out_width,
                  blocks=args.blocks or 4 * args.ranks,
                  batch=args.batch, n_micro=args.micro, threads=1, lr=0.01, **fields)


def model_for(base: Config, sched: str, compile: bool = True) -> Config:
    """The run's configuration for ``sched``: ZBV's V puts the first and the last stage on rank 0,
    so there the input layer and the head would both load rank 0 (with the default 8 blocks, 14
    products a micro-batch against rank 1's 12): ZBV runs the blocks alone (rank 0: 11, rank 1: 12)."""
    if sched == "zbv":
        base = replace(base, in_width=0, out_width=0)
    return replace(base, schedule=sched, compile=compile)


def torch_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """The same model, micro-batches, loss, SGD and placement through torch.distributed.pipelining."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    cfg = Config(**cfg_dict)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev = torch.device(cfg.device or "cpu")
    mods = [m.to(dev) for m in stage_modules(cfg, world)]
    plan = get_schedule(cfg.schedule)(world, cfg.n_micro, len(mods))
    local = sorted({j.stage for j in plan[rank]})  # the placement flowexec uses (loop or V)
    stages = [PipelineStage(mods[s], s, len(mods), dev) for s in local]
    cls = get_schedule_class(TORCH_NAMES[cfg.schedule])
    single = stages_per_rank(cfg.schedule) == 1 and cfg.schedule != "zbh1"
    sched = cls(stages[0] if single else stages, n_microbatches=cfg.n_micro, loss_fn=F.mse_loss)
    params = [p for s in local for p in mods[s].parameters()]
    opt = torch.optim.SGD(params, lr=cfg.lr)
    x, y = (t.to(dev) for t in data(cfg))
    has_first, has_last = 0 in local, len(mods) - 1 in local
    out: dict[str, Any] = {"step_s": [], "losses": []}
    for _ in range(cfg.steps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if has_last else {}
        sched.step(x, **kwargs) if has_first else sched.step(**kwargs)
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        out["step_s"].append(time.perf_counter() - t0)
        if losses:
            out["losses"].append(sum(float(v.detach()) for v in losses) / len(losses))
    out["params"] = {s: [p.detach().cpu().clone() for p in mods[s].parameters()] for s in local}
    return out


def measured_bubble(spans_per_step: list[list[Any]], skip: int) -> float:
    """Median over the steps after ``skip`` of 1 - (time in jobs) / (step time), one rank."""
    vals = []
    for spans in spans_per_step[skip:]:
        step = sum(s.duration_ns for s in spans if s.kind == "step")
        busy = sum(s.duration_ns for s in spans if s.kind in ("F", "B", "I", "W", "OPT"))
        if step:
            vals.append(1 - busy / step)
    return statistics.median(vals) if vals else float("nan")


def stage_job_costs(spans_per_step: list[list[Any]], skip: int) -> dict[int, dict[str, float]]:
    """Median duration (ms) of each job kind per stage a rank ran after ``skip`` steps."""
    by: dict[int, dict[str, list[float]]] = {}
    for spans in spans_per_step[skip:]:
        for s in spans:
            if s.kind in ("F", "B", "I", "W"):
                by.setdefault(s.stage, {}).setdefault(s.kind, []).append(s.duration_ns / 1e6)
    return {st: {k: statistics.median(v) for k, v in kinds.items()} for st, kinds in by.items()}


def job_costs(spans_per_step: list[list[Any]], skip: int) -> dict[str, float]:
    """Median duration (ms) of each job kind a rank ran after ``skip`` steps."""
    by: dict[str, list[float]] = {}
    for spans in spans_per_step[skip:]:
        for s in spans:
            if s.kind in ("F", "B", "I", "W"):
                by.setdefault(s.kind, []).append(s.duration_ns / 1e6)
    return {k: statistics.median(v) for k, v in by.items()}


def theory_bubble(schedule: str, world: int, n_micro: int, costs: dict[str, float] | None = None,
                  stage_costs: dict[int, dict[str, float]] | None = None) -> float:
    """The plan's bubble in simulate: equal costs, or (T_F, T_B, T_W) from measured job times
    (a full backward's time split in half where only B was measured), or ``stage_costs``: the
    measured cost of every job kind on every stage (stages of unequal cost)."""
    plan = get_schedule(schedule)(world, n_micro, world * stages_per_rank(schedule))
    if stage_costs:
        return simulate(plan, stage_costs=stage_costs).bubble
    if costs:
        t_f = costs.get("F", 1.0)
        if "I" in costs:
            t_b, t_w = costs["I"], costs.get("W", 0.0)
        else:
            t_b = t_w = costs.get("B", 2 * t_f) / 2
        return simulate(plan, costs=(t_f, t_b, t_w)).bubble
    return simulate(plan).bubble
