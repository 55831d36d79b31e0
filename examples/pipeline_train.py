"""Train a model pipeline-parallel with flowexec under torchrun: a schedule, AdamW with a cosine
learning rate, the gradient clipped by the whole model's norm, a validation loss, and a
checkpoint per rank that a later run resumes from.

    torchrun --standalone --nproc-per-node 2 examples/pipeline_train.py --steps 40 --stop-after 20 --save ckpt/
    torchrun --standalone --nproc-per-node 2 examples/pipeline_train.py --steps 40 --resume ckpt/
    torchrun --standalone --nproc-per-node 2 examples/pipeline_train.py --save ckpt/ --save-every 10  # ckpt/step10/ ...
    torchrun --standalone --nproc-per-node 4 examples/pipeline_train.py --data-parallel 2   # 2 pipelines of 2
    # GPUs (one process a GPU): add --backend nccl; several machines: torchrun --nnodes M ...

The task is synthetic (fit y = sin(x A) B from random x), so the script runs anywhere; swap in
your model and data loader. Every rank builds the same model (same seed) and calls every method
of the trainer; with --data-parallel each replica trains on its own part of every batch and
evaluates the whole validation batch; the rank holding replica 0's last stage prints.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flowexec.pipeline import PipelineTrainer, split


def make_model(width: int, depth: int) -> torch.nn.Sequential:
    """An input layer, ``depth`` residual-free MLP blocks and a head."""
    layers = [torch.nn.Linear(32, width), torch.nn.GELU()]
    for _ in range(depth):
        layers += [torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.GELU())]
    layers += [torch.nn.Linear(width, 16)]
    return torch.nn.Sequential(*layers)


def batch(step: int, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch on every rank for a step (a real loader would feed stage 0 and the last
    stage only)."""
    g = torch.Generator().manual_seed(1000 + step)
    teacher = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=teacher) / 32 ** 0.5, torch.randn(64, 16, generator=teacher) / 8
    x = torch.randn(rows, 32, generator=g)
    return x.to(device), (torch.sin(x @ a) @ b).to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="the run's steps in all (the learning rate's schedule)")
    ap.add_argument("--stop-after", type=int, default=0, help="stop at this step (as if interrupted; 0: at --steps)")
    ap.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B, Eager1F1B, Interleaved1F1B, ZBH1 or ZBV")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches a step")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--eager", action="store_true", help="eager stages (compile=False)")
    ap.add_argument("--backend", default="gloo", help="gloo (CPUs) or nccl (GPUs)")
    ap.add_argument("--save", default="", help="a folder for the checkpoint at the end (a file per rank)")
    ap.add_argument("--save-every", type=int, default=0,
                    help="also save every this many steps, into <--save>/step<N>/ (0: only at the end)")
    ap.add_argument("--resume", default="", help="a folder a run saved into: continue from there")
    ap.add_argument("--data-parallel", type=int, default=1, help="replicas of the pipeline (they split the ranks)")
    args = ap.parse_args()
    if args.save_every and not args.save:
        ap.error("--save-every needs --save (the folder the checkpoints go into)")
    if args.batch % (args.data_parallel * args.micro):
        ap.error(f"--batch {args.batch} must split into --data-parallel {args.data_parallel} parts of "
                 f"--micro {args.micro} equal micro-batches")

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same model on every rank
    two_a_rank = args.schedule.lower() in ("interleaved1f1b", "zbv")
    pipeline_ranks = world // args.data_parallel
    trainer = PipelineTrainer(split(make_model(args.width, args.depth), pipeline_ranks * (2 if two_a_rank else 1)),
                              schedule=args.schedule, microbatches=args.micro, loss_fn=F.mse_loss,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr),
                              max_grad_norm=args.max_grad_norm, compile=not args.eager,
                              data_parallel=args.data_parallel)
    rows = args.batch // args.data_parallel  # this replica's part of every batch
    part = slice(trainer.replica * rows, (trainer.replica + 1) * rows)
    schedulers = {s: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
                  for s, opt in trainer.optimizers.items() if opt is not None}
    if args.resume:
        state = torch.load(os.path.join(args.resume, f"rank{rank}.pt"), map_location=trainer.device)
        trainer.load_state_dict(state["trainer"])
        for s, sched in schedulers.items():
            sched.load_state_dict(state["schedulers"][s])

    def save(folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        torch.save({"trainer": trainer.state_dict(),
                    "schedulers": {s: sched.state_dict() for s, sched in schedulers.items()}},
                   os.path.join(folder, f"rank{rank}.pt"))

    end = min(args.stop_after or args.steps, args.steps)
    for step in range(trainer.step_count, end):
        x, y = batch(step, args.batch, trainer.device)
        loss = trainer.step(x[part], y[part])
        for sched in schedulers.values():
            sched.step()
        if loss is not None and trainer.replica == 0 and (step % 5 == 0 or step == end - 1):
            print(f"step {step}: loss {loss.item():.5f}, gradient norm {trainer.grad_norm.item():.4f}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < end:
            save(os.path.join(args.save, f"step{step + 1}"))
    val = trainer.evaluate(*batch(-1, args.batch, trainer.device))
    if val is not None and trainer.replica == 0:
        print(f"validation loss after {end} steps: {val.item():.8f}", flush=True)
    if args.save:
        save(args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
