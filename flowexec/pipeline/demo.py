"""A small pipeline-parallel training run: blocks of ``Linear(width) + tanh``, MSE against random
targets, SGD, through :class:`~.trainer.PipelineTrainer` on local ranks. The set-up of
``../shared/reference/torch_pipelining_gloo.py`` by default (4 blocks of 256, batch 64, 8
micro-batches), so that flowexec and ``torch.distributed.pipelining`` can be timed side by side
(``benchmarks/pipeline_gloo.py``), the tests' check against one process (``eager_reference``),
and the profiled run of ``flowexec demo --out`` (``profile_pipeline``).
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .schedules import STAGES_PER_RANK, get_schedule, simulate
from .trainer import PipelineTrainer, split


@dataclass(frozen=True)
class Config:
    width: int = 256
    blocks: int = 4
    batch: int = 64
    n_micro: int = 8
    schedule: str = "1f1b"
    steps: int = 6
    lr: float = 0.05
    seed: int = 0
    threads: int = 0  # intra-op threads per rank (0: torch's default)
    compile: bool = False  # stages as flowexec programs (CompiledRunner) instead of eager autograd
    profile: bool = True  # record job spans (JobTimer)
    device: str = ""  # "" : the trainer's default (cuda:LOCAL_RANK on NCCL, else the CPU)
    in_width: int = 0  # > 0: an input layer Linear(in_width, width) + tanh before the blocks, on the first stage
    out_width: int = 0  # > 0: an output head Linear(width, out_width) after the blocks, on the last stage


def stages_per_rank(schedule: str) -> int:
    get_schedule(schedule)  # an unknown name fails here, with the list of names
    return STAGES_PER_RANK[schedule.lower().replace("-", "").replace("_", "")] or 2


def blocks(cfg: Config) -> torch.nn.Sequential:
    """The whole model, the same in every process (seeded): the input layer (if ``in_width``),
    ``blocks`` blocks of ``Linear(width) + tanh``, the output head (if ``out_width``)."""
    torch.manual_seed(cfg.seed)
    w = cfg.width
    layers = [torch.nn.Sequential(torch.nn.Linear(cfg.in_width, w), torch.nn.Tanh())] if cfg.in_width else []
    layers += [torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.Tanh()) for _ in range(cfg.blocks)]
    layers += [torch.nn.Linear(w, cfg.out_width)] if cfg.out_width else []
    return torch.nn.Sequential(*layers)


def layers_per_stage(cfg: Config, n: int) -> list[int]:
    """The blocks as evenly as they go over ``n`` stages, the input layer on the first, the head
    on the last (``split``'s ``balance``)."""
    if cfg.blocks < n:
        raise ValueError(f"{cfg.blocks} blocks cannot fill {n} stages")
    sizes = [cfg.blocks // n + (i < cfg.blocks % n) for i in range(n)]
    sizes[0] += bool(cfg.in_width)
    sizes[-1] += bool(cfg.out_width)
    return sizes


def stage_modules(cfg: Config, world: int, model: torch.nn.Sequential | None = None) -> list[torch.nn.Module]:
    """``model`` (default: a fresh :func:`blocks`) cut into the stages ``cfg.schedule`` runs on
    ``world`` ranks: the same cut for the pipeline and for a reference trained in one process."""
    n = world * stages_per_rank(cfg.schedule)
    if cfg.blocks < n:
        raise ValueError(f"{cfg.blocks} blocks cannot fill {n} stages ({cfg.schedule} on {world} ranks)")
    return split(blocks(cfg) if model is None else model, n, balance=layers_per_stage(cfg, n))


def data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return (torch.randn(cfg.batch, cfg.in_width or cfg.width, generator=g),
            torch.randn(cfg.batch, cfg.out_width or cfg.width, generator=g))


def train_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of the run (``launch.spawn(train_worker, 2, asdict(cfg))``): per step the time
    and this rank's spans; the last stage's mean losses; the local stages' parameters."""
    from ..profiler.timers import JobTimer

    cfg = Config(**cfg_dict)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    trainer = PipelineTrainer(stage_modules(cfg, world), schedule=cfg.schedule, microbatches=cfg.n_micro,
                              loss_fn=F.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=cfg.lr),
                              compile=cfg.compile, device=cfg.device or None, timeout=120)
    if cfg.profile:
        trainer.timer = JobTimer(trainer.device, rank=rank)
    cuda = trainer.device.type == "cuda"
    x, y = data(cfg)
    out: dict[str, Any] = {"step_s": [], "spans": [], "losses": [], "stages": trainer.local}
    for _ in range(cfg.steps):
        if cuda:
            torch.cuda.synchronize(trainer.device)
        t0 = time.perf_counter()
        loss = trainer.step(x, y)
        if cuda:
            torch.cuda.synchronize(trainer.device)
        out["step_s"].append(time.perf_counter() - t0)
        out["spans"].append(trainer.spans)
        if loss is not None:
            out["losses"].append(float(loss))
    if cfg.profile and out["spans"]:  # on CUDA the last steps' spans come after them: with the last entry
        out["spans"][-1] = out["spans"][-1] + trainer.timer.finish()
    out["params"] = {s: [p.detach().cpu().clone() for p in trainer.modules[s].parameters()] for s in trainer.local}
    return out


def eager_reference(cfg: Config, device: torch.device | str = "cpu") -> tuple[list[float], torch.nn.Sequential]:
    """The same training in one process on the whole batch, on ``device``: losses per step and
    the trained model (``stage_modules(cfg, world, model)`` cuts it as the pipeline does)."""
    model = blocks(cfg).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    x, y = (t.to(device) for t in data(cfg))
    losses = []
    for _ in range(cfg.steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model


def profiled_worker(rank: int, world: int, cfg_dict: dict[str, Any], directory: str, record: list[int] | None) -> dict:
    """One rank: train ``cfg.steps`` steps with ``PipelineTrainer(..., profile=record)``,
    recording the steps in ``record`` into ``directory`` (``None``: no profiler at all).
    Returns the records' path, the losses and each step's ns."""
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
    """``flowexec demo --out DIR``'s pipeline part: a 2-rank gloo pipeline of a small model trained
    with profiling on for a few steps, once per schedule. Each rank records the steps in
    ``record`` into ``DIR/records/<schedule>/rank<r>.jsonl``; they are merged into
    ``DIR/trace.json`` and ``DIR/timeline.html`` (``trace-<schedule>.json`` ... after the first).
    The records' meta carries the schedule's theoretical bubble (:mod:`.theory`), so the page
    shows it beside the measured one. Returns per schedule its paths and summary."""
    from ..profiler.command import theory_of
    from ..profiler.merge import merge_dir
    from ..profiler.page import write_page
    from ..profiler.summary import summarize
    from ..profiler.trace import write_trace
    from .launch import spawn
    from .theory import theory_at_measured_costs

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


def run_cli(schedule: str, ranks: int, micro: int, steps: int, out: str, compile: bool = False) -> None:
    """``flowexec pipeline``: train on ``ranks`` local gloo processes, print each step and the
    bubble per rank, save the job timeline and check the result against one process."""
    from .launch import spawn
    from .timeline import bubble, save

    open(out, "a").close()  # an unwritable path fails now, not after training
    v = stages_per_rank(schedule)
    cfg = Config(blocks=max(4, ranks * v), batch=8 * micro, n_micro=micro, schedule=schedule, steps=steps, threads=1,
                 compile=compile)
    print(f"{schedule}: {ranks} ranks x {v} stage{'s' * (v > 1)}, {cfg.blocks} blocks of Linear({cfg.width}) + tanh, "
          f"batch {cfg.batch} in {micro} micro-batches, {steps} steps (gloo, CPU; "
          f"{'compiled' if compile else 'eager'} stages)", flush=True)
    res = spawn(train_worker, ranks, asdict(cfg), timeout=120)
    last = next(r for r in range(ranks) if res[r]["losses"])
    for k in range(steps):
        print(f"step {k}: loss {res[last]['losses'][k]:.6f}, " + ", ".join(
            f"rank {r} {res[r]['step_s'][k] * 1e3:.1f} ms" for r in range(ranks)))
    spans = [s for r in range(ranks) for step in res[r]["spans"] for s in step]
    warm = [s for s in spans if s.step > 0] or spans  # the first step also sets up and allocates
    ideal = simulate(get_schedule(schedule)(ranks, micro, ranks * v)).bubble
    print("bubble (idle share of each rank's steps after the first): "
          + ", ".join(f"rank {r} {b:.0%}" for r, b in bubble(warm).items())
          + f"; the schedule's at equal job costs and no latency: {ideal:.0%} (flowexec schedules compares them)")
    losses, _ = eager_reference(cfg)
    worst = max(abs(a - b) / abs(b) for a, b in zip(res[last]["losses"], losses))
    print(f"losses against one process: largest relative difference {worst:.1e}")
    save(spans, out)
    print(f"job timeline: {out} (open in https://ui.perfetto.dev)")


__all__ = ["Config", "asdict", "blocks", "data", "eager_reference", "layers_per_stage", "profile_pipeline", "profiled_worker",
           "stage_modules", "train_worker"]
