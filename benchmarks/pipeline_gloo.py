"""Pipeline-parallel training steps on CPU with gloo: flowexec.pipeline (PipelineTrainer) beside
torch.distributed.pipelining, the same model, micro-batches, placement and SGD, in alternating
rounds of one run. ``flowexec``: stages as flowexec programs (``compile=True``: CompiledRunner,
trace mode, the I/W split pass, gradients accumulated in place); ``flowexec eager``:
``compile=False`` (EagerRunner, autograd), left out with ``--no-eager``.

Schedules (flowexec vs torch): FThenB vs GPipe, 1F1B vs 1F1B, Interleaved1F1B vs
Interleaved1F1B, ZBH1 vs InterleavedZeroBubble (one stage per rank), ZBV vs ZBVZeroBubble.
``--schedules`` may add Eager1F1B (against torch's 1F1B, which it varies).
Default sizes: 2 ranks; an input layer Linear(768, 1024) + tanh, 8 blocks of Linear(1024) + tanh,
an output head Linear(1024, 512) (one-stage-per-rank schedules: 4 blocks a stage; two-stage ones:
2; the input layer on the first stage, the head on the last: ``split``'s ``balance``), batch 512 in
8 micro-batches of 64 rows, MSE, one intra-op thread per rank: one block's forward is ~1.5-2 ms on a
2-core CPU and the shortest job (an interleaved stage's forward) ~5 ms, so jobs, not gloo messages,
decide the figure. (With 4 blocks, the runs before 2026-12-02's third stop, an interleaved stage was one block
and its 6 messages a micro-batch, each taking CPU from the jobs on 2 cores, put its bubble at
1F1B's.) The input layer and the head even out the stages: the input layer computes its weight
gradient but no input gradient (768 inputs: 1.5 products a micro-batch), the head both (512
outputs: 1.5 products). Without them (``--in-width 0 --out-width 0``, the runs before 2026-12-02's second
stop) stage 0 computes no input gradient for its first layer, its backward is a product short of
the last stage's, and 1F1B idles for that at any speed of the runtime. ZBV runs the blocks
alone: its V puts the first and the last stage on rank 0, which the input layer and the head
would both load (``model_for``). Per round and implementation: a fresh group of processes (both implementations: one
process per rank, one intra-op thread, the same gloo group set-up), ``--steps`` steps, the
median of the steps after the first ``--skip``, per rank; a run's time is its slowest rank's.
The speedup is the median over rounds of torch's time over flowexec's in that round (the two
run next to each other, so the host's drift between rounds cancels; since 2026-12-02, before
that the ratio of the medians, which is kept as ``speedup_of_medians``), with the spread (min,
max) of times over rounds. Rounds alternate the order of the runs. flowexec's bubble per rank is 1 - (time in jobs) / (step time) from its job spans;
theory is ``simulate`` of the same plan at equal costs, at rank 0's measured job costs, and at
every stage's measured costs (a first stage makes no input gradient, so its jobs are cheaper
and its rank idles for that too).

    python3 benchmarks/pipeline_gloo.py --out benchmarks/results/pipeline_gloo.json   # ~25 min on 2 quiet cores
    python3 benchmarks/pipeline_gloo.py --quick                                        # a smoke run, ~1 min

Where a rank's idle time goes (waits, transfers, host time, against ``simulate``):
``benchmarks/pipeline_idle.py`` on the same configuration (docs/pipeline.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from host_meta import host_meta  # noqa: E402
from pipeline_common import (SCHEDULES, TORCH_NAMES, add_model_args, job_costs, measured_bubble,  # noqa: E402
                             model_config, model_for, stage_job_costs, theory_bubble, torch_worker)
from flowexec.pipeline import PipelineError, spawn  # noqa: E402
from flowexec.pipeline.demo import eager_reference, train_worker  # noqa: E402
from flowexec.pipeline.timeline import save  # noqa: E402



def _median_costs(per_round: Any) -> dict[int, dict[str, float]]:
    """Per stage and job kind, the median over rounds of the rounds' median job times."""
    by: dict[int, dict[str, list[float]]] = {}
    for costs in per_round:
        for st, kinds in costs.items():
            for k, v in kinds.items():
                by.setdefault(int(st), {}).setdefault(k, []).append(v)
    return {st: {k: statistics.median(v) for k, v in kinds.items()} for st, kinds in by.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline_gloo.json"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=3, help="steps left out of every median (set-up, heap growth)")
    add_model_args(ap)
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--no-eager", action="store_true", help="leave out flowexec with eager stages (EagerRunner)")
    ap.add_argument("--quick", action="store_true", help="small sizes, 1 round, 4 steps: checks it runs")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.skip, args.width, args.batch = 1, 4, 2, 256, 64
        args.in_width, args.out_width = 192, 128
    SKIP = args.skip
    if not 0 <= SKIP < args.steps:
        raise SystemExit(f"--skip {SKIP} must leave some of the {args.steps} steps")
    scheds = [s.strip().lower() for s in args.schedules.split(",")]
    base = model_config(args, steps=args.steps)
    eager = not args.no_eager
    names = ("flowexec", "flowexec eager", "torch") if eager else ("flowexec", "torch")
    impls = [(impl, s) for s in scheds for impl in names]
    rounds: dict[str, list[dict[str, Any]]] = {f"{i} {s}": [] for i, s in impls}
    failed: dict[str, list[dict[str, Any]]] = {}
    last_spans: dict[str, Any] = {}
    for r in range(args.rounds):
        for impl, sched in (impls if r % 2 == 0 else impls[::-1]):
            cfg = model_for(base, sched, compile=impl == "flowexec")
            try:
                res = spawn(torch_worker if impl == "torch" else train_worker, args.ranks, asdict(cfg), timeout=300)
            except PipelineError as e:  # one run's failure (a peer's gloo path too) loses that run, not the others
                failed.setdefault(f"{impl} {sched}", []).append({"round": r, "error": str(e).splitlines()[0][:500]})
                print(f"round {r} {impl:14s} {sched:15s}: FAILED: {str(e).splitlines()[0][:300]}", flush=True)
                continue
            med = [statistics.median(res[k]["step_s"][SKIP:]) * 1e3 for k in range(args.ranks)]
            last = next(k for k in range(args.ranks) if res[k]["losses"])
            row: dict[str, Any] = {"round": r, "step_ms": med, "ms": max(med), "losses": res[last]["losses"]}
            if impl.startswith("flowexec"):
                row["bubble"] = [measured_bubble(res[k]["spans"], SKIP) for k in range(args.ranks)]
                row["job_ms"] = [job_costs(res[k]["spans"], SKIP) for k in range(args.ranks)]
                row["stage_job_ms"] = {st: c for k in range(args.ranks)
                                       for st, c in stage_job_costs(res[k]["spans"], SKIP).items()}
                if impl == "flowexec":
                    last_spans[sched] = [s for k in range(args.ranks) for step in res[k]["spans"][SKIP:] for s in step]
            rounds[f"{impl} {sched}"].append(row)
            extra = f", bubble {', '.join(f'{b:.0%}' for b in row['bubble'])}" if "bubble" in row else ""
            print(f"round {r} {impl:14s} {sched:15s}: " + ", ".join(f"rank {k} {m:.1f} ms" for k, m in enumerate(med))
                  + extra, flush=True)
    summary: dict[str, Any] = {}
    for sched in scheds:
        if not all(rounds[f"{i} {sched}"] for i in names):
            summary[sched] = {"torch_schedule": TORCH_NAMES[sched], "error": "no successful run of " + ", ".join(
                i for i in names if not rounds[f"{i} {sched}"])}
            print(f"{sched:15s}: {summary[sched]['error']}", flush=True)
            continue
        f = statistics.median(x["ms"] for x in rounds[f"flowexec {sched}"])
        t = statistics.median(x["ms"] for x in rounds[f"torch {sched}"])
        bub = statistics.median(statistics.mean(x["bubble"]) for x in rounds[f"flowexec {sched}"])
        costs = _median_costs({0: x["job_ms"][0]} for x in rounds[f"flowexec {sched}"])[0]
        per_stage = _median_costs(x["stage_job_ms"] for x in rounds[f"flowexec {sched}"])
        # Load from other processes drifts over minutes: the runs of one round are next to each
        # other in time, so the ratio within a round and the best round are kept too.
        by_round = {x["round"]: x["ms"] for x in rounds[f"torch {sched}"]}
        ratios = [by_round[x["round"]] / x["ms"] for x in rounds[f"flowexec {sched}"] if x["round"] in by_round]
        spread = {i: [min(x["ms"] for x in rounds[f"{i} {sched}"]), max(x["ms"] for x in rounds[f"{i} {sched}"])]
                  for i in names}
        lf, lt = rounds[f"flowexec {sched}"][0]["losses"], rounds[f"torch {sched}"][0]["losses"]
        ref_losses, _ = eager_reference(model_for(base, sched))
        summary[sched] = {
            "torch_schedule": TORCH_NAMES[sched], "flowexec_ms": f, "torch_ms": t,
            # The headline: the median of the rounds' ratios (flowexec and torch run next to each
            # other in a round, so a ratio is free of the drift between rounds); the ratio of the
            # medians over all rounds beside it.
            "speedup": statistics.median(ratios) if ratios else t / f, "speedup_of_medians": t / f,
            "bubble_measured": bub, "bubble_theory_equal_costs": theory_bubble(sched, args.ranks, args.micro),
            "bubble_theory_measured_costs": theory_bubble(sched, args.ranks, args.micro, costs), "job_ms_rank0": costs,
            "bubble_theory_measured_stage_costs": theory_bubble(sched, args.ranks, args.micro, stage_costs=per_stage),
            "bubble_measured_per_rank": [statistics.median(x["bubble"][k] for x in rounds[f"flowexec {sched}"])
                                         for k in range(args.ranks)],
            "job_ms_per_stage": per_stage, "ms_spread_over_rounds": spread,
            "speedup_per_round": ratios, "speedup_median_of_rounds": statistics.median(ratios) if ratios else None,
            "speedup_best_rounds": spread["torch"][0] / spread["flowexec"][0],
            "losses_max_rel_diff_vs_one_process": max(abs(a - b) / abs(b) for a, b in zip(lf, ref_losses)),
            "torch_losses_max_rel_diff_vs_one_process": max(abs(a - b) / abs(b) for a, b in zip(lt, ref_losses))}
        if eager:
            e = statistics.median(x["ms"] for x in rounds[f"flowexec eager {sched}"])
            summary[sched].update(flowexec_eager_ms=e, speedup_eager=t / e, bubble_measured_eager=statistics.median(
                statistics.mean(x["bubble"]) for x in rounds[f"flowexec eager {sched}"]))
        s = summary[sched]
        print(f"{sched:15s}: flowexec {f:.1f} ms, torch {TORCH_NAMES[sched]} {t:.1f} ms: "
              f"{s['speedup']:.2f}x (median of the rounds {', '.join(f'{r:.2f}' for r in ratios)}; "
              f"of the medians {t / f:.2f}x); bubble "
              f"{bub:.1%} (theory {s['bubble_theory_equal_costs']:.1%} at equal costs, "
              f"{s['bubble_theory_measured_costs']:.1%} at rank 0's measured ones, "
              f"{s['bubble_theory_measured_stage_costs']:.1%} at every stage's)"
              + (f"; eager stages {s['flowexec_eager_ms']:.1f} ms: {s['speedup_eager']:.2f}x" if eager else ""), flush=True)
    goals = {}
    if all(k in summary and "error" not in summary[k] for k in SCHEDULES):
        goals = {"speedup_ge_1.2_every_schedule": all(summary[k]["speedup"] >= 1.2 for k in SCHEDULES),
                 "1f1b_bubble_le_1.25x_theory": summary["1f1b"]["bubble_measured"]
                 <= 1.25 * summary["1f1b"]["bubble_theory_equal_costs"],
                 "zbh1_bubble_le_0.6x_1f1b": summary["zbh1"]["bubble_measured"]
                 <= 0.6 * summary["1f1b"]["bubble_measured"],
                 "interleaved_bubble_below_1f1b": summary["interleaved1f1b"]["bubble_measured"]
                 < summary["1f1b"]["bubble_measured"]}
        print("goals: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in goals.items()))
    cmd = "python3 benchmarks/pipeline_gloo.py " + " ".join(sys.argv[1:])
    out = {**host_meta(cmd.strip()), "config": asdict(base), "ranks": args.ranks,
           "configs": {s: asdict(model_for(base, s)) for s in scheds},
           "implementations": {"flowexec": "PipelineTrainer(compile=True): CompiledRunner, trace mode",
                               "flowexec eager": "PipelineTrainer(compile=False): EagerRunner, autograd",
                               "torch": "torch.distributed.pipelining, opt.zero_grad(set_to_none=True)"}, "skip_steps": SKIP,
           "rounds": rounds, "failed_runs": failed, "summary": summary, "goals": goals}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    trace = os.path.splitext(args.out)[0] + "_trace_zbh1.json"
    if "zbh1" in last_spans:
        save(last_spans["zbh1"], trace)
    print(f"wrote {args.out}" + (f" and {trace}" if "zbh1" in last_spans else ""))


if __name__ == "__main__":
    main()
