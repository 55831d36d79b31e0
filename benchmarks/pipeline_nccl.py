"""flowexec.pipeline on several GPUs with NCCL (issue #28), under torchrun, one process a GPU:
for every schedule (FThenB, 1F1B, Interleaved1F1B, ZBH1, ZBV), with eager stages and with compiled
stages (CUDA graphs; ``--stages``)

- the parameters after 3 steps against the same training of the whole model on one GPU
  (largest relative error per rank; float32, TF32 off);
- the step time and the bubble each rank measured (1 - time in jobs / step time, from CUDA-event
  job spans), against the plan's simulated bubble at equal and at the measured job costs;
- the step time of the same model, micro-batches and placement through
  torch.distributed.pipelining (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble,
  ZBVZeroBubble).

Sizes on CUDA: blocks of Linear(4096) + tanh, 4 blocks per rank (2 per stage for the two-stage
schedules), batch 256 in 8 micro-batches (the reference set-up of
``../shared/reference/torch_pipelining_nccl.py``). Writes ``pipeline_nccl.json`` in ``--out``
with world_size and device. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).

    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_nccl.py --out benchmarks/results   # ~1-2 min
    torchrun --standalone --nproc-per-node 2 benchmarks/pipeline_nccl.py --device cpu --out /tmp     # the logic, on gloo
"""
from __future__ import annotations

import os

# NVLink multicast can put a shared host's GPUs out of service: keep it off, also for children.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from host_meta import host_meta  # noqa: E402
from pipeline_common import (SCHEDULES, TORCH_NAMES, job_costs, measured_bubble, theory_bubble,  # noqa: E402
                             torch_worker)
from flowexec.pipeline.demo import Config, eager_reference, stage_modules, train_worker  # noqa: E402

SKIP = 2


class _Skip(Exception):
    """torch.distributed.pipelining is timed once per schedule."""


def one_device_reference(cfg: Config, world: int, dev: torch.device) -> list[list[torch.Tensor]]:
    """The whole model trained on one device on the whole batch: parameters per stage."""
    _, model = eager_reference(cfg, dev)
    return [[p.detach().cpu() for p in s.parameters()] for s in stage_modules(cfg, world, model)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--stages", default="eager,compiled",
                    help="flowexec stage runners to time: eager (autograd) and/or compiled (graph mode on CUDA)")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(seconds=120))
        base = Config(width=4096, blocks=4 * world, batch=256, n_micro=8, lr=0.01, device=str(dev))
        name = torch.cuda.get_device_name(dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        base = Config(width=64, blocks=2 * world, batch=32, n_micro=4, lr=0.01, threads=1, device="cpu")
        name = "cpu"
    results: dict[str, Any] = {}
    kinds = [k.strip() for k in args.stages.split(",")]
    for sched, kind in [(s.strip().lower(), k) for s in args.schedules.split(",") for k in kinds]:
        cfg = replace(base, schedule=sched, compile=kind == "compiled")
        row: dict[str, Any] = {"schedule": sched, "stages": kind}
        # 1. parameters after 3 steps against one device
        check = replace(cfg, steps=3, profile=False)
        got = train_worker(rank, world, asdict(check))
        want = one_device_reference(check, world, dev)
        row["param_rel_err"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                                   for s, ps in got["params"].items() for a, b in zip(ps, want[s], strict=True))
        dist.barrier()
        # 2. step time and measured bubble
        timed = train_worker(rank, world, asdict(replace(cfg, steps=args.steps)))
        row["flowexec_step_ms"] = statistics.median(timed["step_s"][SKIP:]) * 1e3
        row["bubble_measured"] = measured_bubble(timed["spans"], SKIP)
        row["job_ms"] = job_costs(timed["spans"], SKIP)
        row["held"] = timed["stages"]
        dist.barrier()
        # 3. torch.distributed.pipelining, the same set-up (once per schedule)
        try:
            if kind != kinds[0]:
                raise _Skip
            ref = torch_worker(rank, world, asdict(replace(cfg, steps=args.steps)))
            row["torch_step_ms"] = statistics.median(ref["step_s"][SKIP:]) * 1e3
        except _Skip:
            pass
        except Exception as e:  # its failure is a result, not the end of the run
            row["torch_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        dist.barrier()
        results[f"{sched} {kind}"] = row
        if rank == 0:
            print(f"{sched} {kind}: rank 0 param err {row['param_rel_err']:.1e}, {row['flowexec_step_ms']:.2f} ms, bubble "
                  f"{row['bubble_measured']:.1%}; torch {TORCH_NAMES[sched]} "
                  f"{row.get('torch_step_ms', float('nan')):.2f} ms", flush=True)
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, results)
    if rank == 0:
        summary = {}
        for key in results:
            sched = key.split()[0]
            rows = [per_rank[r][key] for r in range(world)]
            f = max(x["flowexec_step_ms"] for x in rows)
            first = f"{sched} {kinds[0]}"
            t = max((x["torch_step_ms"] for x in (per_rank[r][first] for r in range(world)) if "torch_step_ms" in x),
                    default=float("nan"))
            summary[key] = {
                "torch_schedule": TORCH_NAMES[sched], "param_rel_err_max": max(x["param_rel_err"] for x in rows),
                "params_match_1e-5": all(x["param_rel_err"] <= 1e-5 for x in rows),
                "flowexec_step_ms": f, "torch_step_ms": t, "speedup_vs_torch": t / f,
                "bubble_measured_per_rank": [x["bubble_measured"] for x in rows],
                "bubble_theory_equal_costs": theory_bubble(sched, world, base.n_micro),
                "bubble_theory_measured_costs": theory_bubble(sched, world, base.n_micro, rows[0]["job_ms"]),
                "torch_error": next((x["torch_error"] for x in rows if "torch_error" in x), None)}
            r = summary[key]
            print(f"{key:24s}: params {'match' if r['params_match_1e-5'] else 'DIFFER'} "
                  f"({r['param_rel_err_max']:.1e}); flowexec {f:.2f} ms vs torch {t:.2f} ms "
                  f"({t / f:.2f}x); bubble " + ", ".join(f"{b:.1%}" for b in r["bubble_measured_per_rank"])
                  + f" (theory {r['bubble_theory_equal_costs']:.1%})", flush=True)
        out = {**host_meta("torchrun --standalone --nproc-per-node %d benchmarks/pipeline_nccl.py %s"
                           % (world, " ".join(sys.argv[1:]))),
               "world_size": world, "device": name, "backend": dist.get_backend(), "config": asdict(base),
               "skip_steps": SKIP, "per_rank": per_rank, "summary": summary}
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "pipeline_nccl.json" if args.device == "cuda" else "pipeline_nccl_cpu.json")
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
