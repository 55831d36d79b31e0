"""Pipeline-parallel training steps on CPU with gloo: flowexec.pipeline against
torch.distributed.pipelining, side by side in alternating rounds on the same machine.

flowexec runs each stage's module eagerly, or (``flowexec compiled``) through
``torch.compile(backend="flowexec")``. The set-up of ``../shared/reference/torch_pipelining_gloo.py``: 2 ranks, 4 blocks of
Linear(256) + tanh (2 per rank), batch 64 in 8 micro-batches, MSE; every implementation also
zero the gradients and takes an SGD step, with one intra-op thread per rank (2 ranks on the
2-core CI machine). Per round and implementation: a fresh pair of processes, 8 steps, the median
of the last 6 per rank; the figure is the median over rounds of rank 0's. flowexec's job
timeline of its last round is saved beside the results (``--trace``).

    python3 benchmarks/pipeline_gloo.py --out benchmarks/results/pipeline_gloo.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from host_meta import host_meta  # noqa: E402
from flowexec.pipeline import bubble, spawn  # noqa: E402
from flowexec.pipeline.demo import Config, blocks, data, stage_slice, train_worker  # noqa: E402
from flowexec.pipeline.timeline import save  # noqa: E402

TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def torch_worker(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """The same training with torch.distributed.pipelining (one stage per rank)."""
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    cfg = Config(**cfg_dict)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    model = blocks(cfg)
    mine = torch.nn.Sequential(*(model[i] for i in stage_slice(cfg, rank, world)))
    stage = PipelineStage(mine, rank, world, torch.device("cpu"))
    sched = get_schedule_class(TORCH_NAMES[cfg.schedule])(stage, n_microbatches=cfg.n_micro, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(mine.parameters(), lr=cfg.lr)
    x, y = data(cfg)
    out: dict[str, Any] = {"step_s": [], "losses": []}
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        opt.step()
        out["step_s"].append(time.perf_counter() - t0)
        if losses:
            out["losses"].append(sum(float(v.detach()) for v in losses) / len(losses))
    out["params"] = [p.detach().clone() for p in mine.parameters()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline_gloo.json"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trace", default=None, help="where to save flowexec's job timeline (default: beside --out)")
    args = ap.parse_args()
    base = Config(steps=args.steps, threads=1)
    impls = [(name, sched) for sched in ("gpipe", "1f1b") for name in ("flowexec", "flowexec compiled", "torch")]
    rounds: dict[str, list[dict[str, Any]]] = {f"{n} {s}": [] for n, s in impls}
    last_jobs: dict[str, Any] = {}
    for r in range(args.rounds):
        for name, sched in (impls if r % 2 == 0 else impls[::-1]):
            cfg = replace(base, schedule=sched, backend="flowexec" if name == "flowexec compiled" else "")
            res = spawn(torch_worker if name == "torch" else train_worker, 2, asdict(cfg), timeout=120)
            med = [statistics.median(res[k]["step_s"][2:]) * 1e3 for k in range(2)]
            row = {"rank0_ms": med[0], "rank1_ms": med[1], "losses": res[1]["losses"]}
            if name != "torch":
                jobs = {k: res[k]["jobs"][2:] for k in range(2)}
                row["bubble"] = bubble(jobs)
                if name == "flowexec":
                    last_jobs[sched] = jobs
            rounds[f"{name} {sched}"].append(row)
            print(f"round {r} {name} {sched}: rank 0 {med[0]:.1f} ms, rank 1 {med[1]:.1f} ms", flush=True)
    summary = {}
    for sched in ("gpipe", "1f1b"):
        f = statistics.median(x["rank0_ms"] for x in rounds[f"flowexec {sched}"])
        t = statistics.median(x["rank0_ms"] for x in rounds[f"torch {sched}"])
        lf, lt = rounds[f"flowexec {sched}"][0]["losses"], rounds[f"torch {sched}"][0]["losses"]
        fc = statistics.median(x["rank0_ms"] for x in rounds[f"flowexec compiled {sched}"])
        lc = rounds[f"flowexec compiled {sched}"][0]["losses"]
        summary[sched] = {"flowexec_ms": f, "torch_ms": t, "speedup": t / f,
                          "flowexec_compiled_ms": fc, "speedup_compiled": t / fc,
                          "losses_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(lf + lc, lt + lt, strict=True)),
                          "flowexec_bubble_rank0": statistics.median(x["bubble"][0] for x in rounds[f"flowexec {sched}"])}
        print(f"{sched}: flowexec {f:.1f} ms, torch.distributed.pipelining {t:.1f} ms: {t / f:.2f}x", flush=True)
    res_json = {**host_meta(f"python3 benchmarks/pipeline_gloo.py --rounds {args.rounds} --steps {args.steps}"),
                "config": asdict(base), "rounds": rounds, "summary": summary}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res_json, fh, indent=1)
    trace = args.trace or os.path.splitext(args.out)[0] + "_trace_1f1b.json"
    save(last_jobs["1f1b"], trace)
    print(f"wrote {args.out} and {trace}")


if __name__ == "__main__":
    main()
