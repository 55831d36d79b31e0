"""A small pipeline-parallel training run: blocks of ``Linear(width) + tanh`` split over the
ranks, MSE against random targets, SGD. The same set-up as
``../shared/reference/torch_pipelining_gloo.py`` (4 blocks of 256, batch 64, 8 micro-batches),
so that flowexec and ``torch.distributed.pipelining`` can be timed side by side
(``benchmarks/pipeline_gloo.py``), and the tests' check against one process (``eager_reference``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .schedules import SCHEDULES
from .stage import PipelineStage, split_batch


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
    backend: str = ""  # "flowexec": each stage's module runs through torch.compile(backend="flowexec")


def blocks(cfg: Config) -> list[torch.nn.Module]:
    """The whole model, the same in every process (seeded)."""
    torch.manual_seed(cfg.seed)
    return [torch.nn.Sequential(torch.nn.Linear(cfg.width, cfg.width), torch.nn.Tanh()) for _ in range(cfg.blocks)]


def stage_slice(cfg: Config, rank: int, world: int) -> list[int]:
    """Which blocks rank ``rank`` holds: contiguous, as even as the count allows."""
    if cfg.blocks < world:
        raise ValueError(f"{cfg.blocks} blocks cannot fill {world} stages")
    edges = [round(i * cfg.blocks / world) for i in range(world + 1)]
    return list(range(edges[rank], edges[rank + 1]))


def data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randn(cfg.batch, cfg.width, generator=g), torch.randn(cfg.batch, cfg.width, generator=g)


def train_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of the run (``launch.spawn(train_worker, 2, asdict(cfg))``): per step the time
    and this rank's job records; the last rank's mean losses; this rank's parameters at the end."""
    cfg = Config(**cfg_dict)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = blocks(cfg)
    mine = torch.nn.Sequential(*(model[i] for i in stage_slice(cfg, rank, world)))
    run = torch.compile(mine, backend=cfg.backend) if cfg.backend else mine
    stage = PipelineStage(run, rank, world, loss_fn=F.mse_loss)
    jobs = SCHEDULES[cfg.schedule](world, cfg.n_micro)[rank]
    x, y = data(cfg)
    xs, ys = split_batch(x, cfg.n_micro), split_batch(y, cfg.n_micro)
    stage.setup(xs[0].shape)
    opt = torch.optim.SGD(mine.parameters(), lr=cfg.lr)
    out: dict[str, Any] = {"step_s": [], "jobs": [], "losses": []}
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        res = stage.run(jobs, inputs=xs if rank == 0 else None, targets=ys if rank == world - 1 else None)
        opt.step()
        out["step_s"].append(time.perf_counter() - t0)
        out["jobs"].append(res.jobs)
        if res.losses:
            out["losses"].append(sum(res.losses) / len(res.losses))
    out["params"] = [p.detach().clone() for p in mine.parameters()]
    return out


def eager_reference(cfg: Config) -> tuple[list[float], list[torch.Tensor]]:
    """The same training in one process on the whole batch: losses per step and the parameters."""
    model = torch.nn.Sequential(*blocks(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    x, y = data(cfg)
    losses = []
    for _ in range(cfg.steps):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, [p.detach().clone() for p in model.parameters()]


def run_cli(schedule: str, ranks: int, micro: int, steps: int, out: str, backend: str = "") -> None:
    """``flowexec pipeline``: train on ``ranks`` local gloo processes, print each step and the
    bubble per rank, save the job timeline and check the result against one process."""
    from .launch import spawn
    from .timeline import bubble, save

    open(out, "a").close()  # an unwritable path fails now, not after training

    cfg = Config(blocks=max(4, ranks), batch=8 * micro, n_micro=micro, schedule=schedule, steps=steps, threads=1,
                 backend=backend)
    print(f"{schedule}: {ranks} ranks, {cfg.blocks} blocks of Linear({cfg.width}) + tanh, batch {cfg.batch} in "
          f"{micro} micro-batches, {steps} steps (gloo, CPU; stages "
          f"{'through torch.compile(backend=' + repr(backend) + ')' if backend else 'eager'})", flush=True)
    res = spawn(train_worker, ranks, asdict(cfg), timeout=120)
    for k in range(steps):
        print(f"step {k}: loss {res[-1]['losses'][k]:.6f}, " + ", ".join(
            f"rank {r} {res[r]['step_s'][k] * 1e3:.1f} ms" for r in range(ranks)))
    jobs = {r: res[r]["jobs"] for r in range(ranks)}
    warm = {r: j[1:] or j for r, j in jobs.items()}  # the first step also compiles and allocates
    print("bubble (idle share of each rank's steps after the first): "
          + ", ".join(f"rank {r} {b:.0%}" for r, b in bubble(warm).items()))
    losses, _ = eager_reference(cfg)
    worst = max(abs(a - b) / abs(b) for a, b in zip(res[-1]["losses"], losses))
    print(f"losses against one process: largest relative difference {worst:.1e}")
    save(jobs, out)
    print(f"job timeline: {out} (open in https://ui.perfetto.dev)")


__all__ = ["Config", "asdict", "blocks", "data", "eager_reference", "stage_slice", "train_worker"]
