"""Where a pipeline rank's idle time goes: the bubble of ``benchmarks/pipeline_gloo.py``'s
configuration (flowexec, compiled stages) taken apart from the trainer's own spans.

Per rank and step (after ``--skip``), the step span is cut into
- ``jobs``: F/B/I/W/OPT (the busy time of the bubble figure);
- ``recv wait``: inside a receive wait (the rank had nothing to do but wait for a peer);
- ``host between jobs``: the rest of the gaps between two jobs (taking a receive, handing a
  send to the send thread, the trainer's loop);
- ``step start``: from the step span's start to the first job, less the waits in it (resetting
  gradients, posting the step's receives);
- ``step end``: from the last job to the step span's end (draining the send thread, waiting for
  the sends, the timer's flush);
and, outside the step span, ``between steps`` (the caller's loop and ``step()``'s checks) —
which the bubble does not count, but which the peer may wait for.

For every receive that waited, the *transfer* is the time from the end of the peer's job that
produced the message to the end of the wait (the message's arrival as this rank saw it); its
median is the pipeline's effective latency. A gloo ping-pong of the same message size on the
same machine (``--pingpong``) gives what the transport alone costs.

The ideal at the measured costs is ``simulate`` of the plan at every stage's median job costs,
``opt_cost`` the measured optimizer time, and ``latency`` zero or the measured transfer; each
rank's simulated idle against its measured idle says what the schedule explains.

    python3 benchmarks/pipeline_idle.py --steps 8 --skip 3            # ~30 s on 2 cores
    python3 benchmarks/pipeline_idle.py --out benchmarks/results/pipeline_idle.json --trace /tmp/idle_trace.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from host_meta import host_meta  # noqa: E402
from pipeline_common import add_model_args, model_config, model_for, stage_job_costs  # noqa: E402
from flowexec.pipeline import get_schedule, simulate, spawn  # noqa: E402
from flowexec.pipeline.demo import stages_per_rank, train_worker  # noqa: E402
from flowexec.pipeline.schedules import with_optimizer  # noqa: E402

JOBS = ("F", "B", "I", "W", "OPT")


def _overlap(a0: int, a1: int, spans: list[Any]) -> int:
    return sum(max(0, min(a1, s.end_ns) - max(a0, s.start_ns)) for s in spans)


def decompose(spans: list[Any]) -> dict[str, float]:
    """One rank's one step: ms per category (see the module text)."""
    step = next(s for s in spans if s.kind == "step")
    jobs = sorted((s for s in spans if s.kind in JOBS), key=lambda s: s.start_ns)
    waits = [s for s in spans if s.kind == "wait"]
    sends = [s for s in spans if s.kind == "send"]
    out = {"step": step.duration_ns, "jobs": sum(j.duration_ns for j in jobs), "recv wait": 0, "host between jobs": 0,
           "send hand-off": sum(s.duration_ns for s in sends), "step start": 0, "step end": 0, "step start wait": 0}
    lead_wait = _overlap(step.start_ns, jobs[0].start_ns, waits)
    out["step start wait"] = lead_wait
    out["step start"] = jobs[0].start_ns - step.start_ns - lead_wait
    for a, b in zip(jobs, jobs[1:]):
        w = _overlap(a.end_ns, b.start_ns, waits)
        out["recv wait"] += w
        out["host between jobs"] += b.start_ns - a.end_ns - w
    out["step end"] = step.end_ns - jobs[-1].end_ns
    return {k: v / 1e6 for k, v in out.items()}


def transfers(by_rank: list[list[list[Any]]], skip: int) -> list[dict[str, Any]]:
    """Per receive wait that blocked (> 20 µs) while the message was still on its way (its
    hand-off on the peer ended after the wait began): from the end of the peer's job that
    produced it to the wait's end (``transfer_ms``: the message as it arrived here), and where
    the peer's trainer recorded its send thread's ``isend`` calls, that time split into
    ``queued_ms`` (hand-off to the call), ``isend_ms`` (the call) and ``after_ms`` (the call's
    end to the arrival)."""
    ends: dict[tuple[int, int, str, int], int] = {}
    handed: dict[tuple[int, int, int], Any] = {}
    issued: dict[tuple[int, int, int], Any] = {}
    for spans_per_step in by_rank:
        for spans in spans_per_step[skip:]:
            for s in spans:
                if s.kind in JOBS and s.micro is not None:
                    ends[s.step, s.stage, s.kind, s.micro] = s.end_ns
                elif s.kind == "send":
                    handed[s.step, s.rank, s.tag] = s
                elif s.kind == "isend":
                    issued.setdefault((s.step, s.rank, s.tag), s)  # the first tensor's call
    out = []
    for spans_per_step in by_rank:
        for spans in spans_per_step[skip:]:
            tags = {(s.stage, s.micro): s.tag for s in spans if s.kind == "recv"}
            for w in spans:
                if w.kind != "wait" or w.duration_ns < 20_000:
                    continue
                act = w.name.startswith("recv act")
                prod = [ends.get((w.step, w.stage - 1, "F", w.micro))] if act else \
                    [ends.get((w.step, w.stage + 1, k, w.micro)) for k in ("B", "I")]
                prod = [p for p in prod if p is not None]
                key = (w.step, w.peer, tags.get((w.stage, w.micro)))
                h = handed.get(key)
                if not prod or h is None or h.end_ns < w.start_ns:
                    continue  # it was there before the wait began (or is not matched)
                row = {"rank": w.rank, "step": w.step, "what": w.name, "micro": w.micro,
                       "wait_ms": w.duration_ns / 1e6, "transfer_ms": (w.end_ns - prod[0]) / 1e6}
                i = issued.get(key)
                if i is not None:
                    row.update(queued_ms=(i.start_ns - h.end_ns) / 1e6, isend_ms=i.duration_ns / 1e6,
                               after_ms=(w.end_ns - i.end_ns) / 1e6)
                out.append(row)
    return out


def pingpong(rank: int, world: int, nbytes: int, reps: int) -> dict[str, Any]:
    """Round trips of an ``nbytes`` float32 message between two gloo ranks (one thread each)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    t = torch.zeros(nbytes // 4)
    peer = 1 - rank
    times = []
    for i in range(reps + 5):
        t0 = time.perf_counter_ns()
        if rank == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
        times.append(time.perf_counter_ns() - t0)
    return {"one_way_ms": statistics.median(times[5:]) / 2e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=3)
    add_model_args(ap)
    ap.add_argument("--eager", action="store_true", help="eager stages (compile=False)")
    ap.add_argument("--pingpong", type=int, default=200, help="round trips of the ping-pong (0: none)")
    ap.add_argument("--out", default="", help="a JSON file for the figures")
    ap.add_argument("--trace", default="", help="a Perfetto trace of the steps analysed")
    args = ap.parse_args()
    cfg = model_for(model_config(args, steps=args.steps), args.schedule.lower(), compile=not args.eager)
    res = spawn(train_worker, args.ranks, asdict(cfg), timeout=300)
    by_rank = [r["spans"] for r in res]
    rows = {k: [decompose(sp) for sp in by_rank[k][args.skip:]] for k in range(args.ranks)}
    med = {k: {c: statistics.median(r[c] for r in rs) for c in rs[0]} for k, rs in rows.items()}
    gaps = {}
    for k in range(args.ranks):
        steps = [next(s for s in sp if s.kind == "step") for sp in by_rank[k][args.skip:]]
        gaps[k] = statistics.median((b.start_ns - a.end_ns) / 1e6 for a, b in zip(steps, steps[1:]))
    # every stage's median job costs, the optimizer's, and the transfers that waited
    stage_costs = {st: c for k in range(args.ranks) for st, c in stage_job_costs(by_rank[k], args.skip).items()}
    opt = [s.duration_ns / 1e6 for sp_steps in by_rank for sp in sp_steps[args.skip:] for s in sp if s.kind == "OPT"]
    opt_ms = statistics.median(opt) if opt else 0.0
    tr = transfers(by_rank, args.skip)
    lat = statistics.median(t["transfer_ms"] for t in tr) if tr else 0.0
    plan = with_optimizer(get_schedule(args.schedule)(args.ranks, args.micro,
                                                      args.ranks * stages_per_rank(args.schedule)))
    sims = {name: simulate(plan, stage_costs=stage_costs, opt_cost=o, latency=l)
            for name, o, l in (("jobs only", 0.0, 0.0), ("+ optimizer", opt_ms, 0.0), ("+ optimizer + transfer", opt_ms, lat))}
    print(f"{args.schedule}, {args.ranks} ranks, batch {args.batch} in {args.micro}, width {args.width}, "
          f"{'eager' if args.eager else 'compiled'} stages; medians over steps {args.skip}..{args.steps - 1}")
    print("stage job costs (ms): " + "; ".join(f"stage {s}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(c.items()))
                                            for s, c in sorted(stage_costs.items())) + f"; OPT {opt_ms:.2f}")
    cats = ["step", "jobs", "recv wait", "step start wait", "host between jobs", "step start", "step end"]
    print(f"{'ms per step':22s}" + "".join(f"{'rank ' + str(k):>10s}" for k in range(args.ranks)))
    for c in cats + ["send hand-off"]:
        print(f"{c:22s}" + "".join(f"{med[k][c]:10.2f}" for k in range(args.ranks)))
    print(f"{'between steps':22s}" + "".join(f"{gaps[k]:10.2f}" for k in range(args.ranks)))
    print(f"{'bubble':22s}" + "".join(f"{1 - med[k]['jobs'] / med[k]['step']:10.1%}" for k in range(args.ranks)))
    for name, sim in sims.items():
        print(f"{'sim ' + name:22s}" + "".join(f"{sim.idle[r] / sim.makespan:10.1%}" for r in sorted(sim.idle))
              + f"   makespan {sim.makespan:.1f} ms, bubble {sim.bubble:.1%}")
    if tr:
        print(f"receives that waited for a message on its way: {len(tr)}; producing job's end to arrival: "
              f"median {lat:.3f} ms, max {max(t['transfer_ms'] for t in tr):.3f} ms")
        split = [t for t in tr if "isend_ms" in t]
        if split:
            print("  of which: " + ", ".join(
                f"{name} median {statistics.median(t[k] for t in split):.3f} / max {max(t[k] for t in split):.3f} ms"
                for name, k in (("queued for the send thread", "queued_ms"), ("isend call", "isend_ms"),
                                ("call end to arrival", "after_ms"))))
    pp = None
    if args.pingpong:
        nbytes = args.batch // args.micro * args.width * 4
        pp = spawn(pingpong, 2, nbytes, args.pingpong, timeout=120)[0]
        print(f"gloo ping-pong, {nbytes // 1024} KiB one way: {pp['one_way_ms']:.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            cmd = "python3 benchmarks/pipeline_idle.py " + " ".join(sys.argv[1:])
            json.dump({**host_meta(cmd.strip()), "config": asdict(cfg), "per_rank_ms": med, "between_steps_ms": gaps, "stage_costs": stage_costs,
                       "opt_ms": opt_ms, "transfers": tr, "pingpong": pp,
                       "sim": {n: {"makespan": s.makespan, "bubble": s.bubble, "idle": s.idle} for n, s in sims.items()}},
                      f, indent=1)
    if args.trace:
        from flowexec.pipeline.timeline import save

        save([s for k in range(args.ranks) for sp in by_rank[k][args.skip:] for s in sp], args.trace)


if __name__ == "__main__":
    main()
