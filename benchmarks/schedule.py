"""An LR schedule over 1,000 steps in graph mode: no re-capture, and the step time of a constant LR.

Two identical training steps (an MLP, default AdamW: foreach, step counts made lazily on the
first call) are compiled with ``@flowexec.compile(mode="graph")``; one trains with OneCycleLR —
lr and betas[0] change on every step, fed to the CUDA graph from buffers it reads in place —
the other at a constant lr. They run in alternating rounds of 100 steps (each round timed with one
sync at its end, the scheduler's own step outside the timed call), so both see the same drift
of the lent host. Reported: programs captured and RecaptureWarnings over the 1,000 scheduled
steps (both must be 1 and 0), the median step time of each, their ratio, and the noise: the
spread of the constant runs' rounds around their median. Also timed: eager steps of each, for scale.

The scheduled step is built and captured first unless ``--constant-first``. The first graph
flowexec captures in a process runs ~0.7% slower whatever it holds (docs/training.md), so run
both orders, or ``--prime``: a throwaway constant-lr copy is captured first.

    PYTHONPATH=. python3 benchmarks/schedule.py            # writes benchmarks/results/schedule.json
    PYTHONPATH=. python3 benchmarks/schedule.py --constant-first --out DIR
    PYTHONPATH=. python3 benchmarks/schedule.py --prime [--constant-first] --out DIR
    PYTHONPATH=. python3 benchmarks/schedule.py --width 1024 --depth 8
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flowexec  # noqa: E402


def make(width: int, depth: int, device: torch.device, scheduled: bool, steps: int,
         compiled: bool) -> tuple[Callable[[], Any], Callable[[], None], Any]:
    """(one training step, the scheduler's step or a no-op, the executable or None)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # The constant run steps the same scheduler over an optimizer of its own (one unused
    # parameter): both loops pay the scheduler's Python, only one feeds new values to its graph.
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1, device=device))], lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt if scheduled else other, max_lr=1e-2, total_steps=steps + 10)
    x = torch.randn(64, width, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    fn = flowexec.compile(step, mode="graph") if compiled else step
    return (lambda: fn(x, y)), sched.step, (fn if compiled else None)


def timed_rounds(step: Callable[[], Any], after: Callable[[], None], rounds: int, per_round: int,
                 sync: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Per round: µs per step of the loop (calls and scheduler steps, the device's time included
    by one sync at the round's end), and µs of host time inside the calls alone."""
    steps, calls = [], []
    for _ in range(rounds):
        sync()
        start = time.perf_counter_ns()
        spent = 0
        for _ in range(per_round):
            t0 = time.perf_counter_ns()
            step()
            spent += time.perf_counter_ns() - t0
            after()
        sync()
        steps.append((time.perf_counter_ns() - start) / per_round / 1e3)
        calls.append(spent / per_round / 1e3)
    return steps, calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--constant-first", action="store_true",
                    help="build and capture the constant-lr step before the scheduled one")
    ap.add_argument("--prime", action="store_true",
                    help="capture a throwaway constant-lr copy of the step first: the first graph flowexec captures "
                         "in a process runs ~0.7%% slower, whatever it is (benchmarks/probes/first_graph.py), so "
                         "that neither timed loop is that graph")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/schedule.py measures graph mode: it needs CUDA")
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    per_round = 100
    rounds = args.steps // per_round
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "PYTHONPATH=. python3 benchmarks/schedule.py " + " ".join(sys.argv[1:]),
        "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown"),
        "model": f"MLP {args.depth}x{args.width}, batch 64, AdamW (default: foreach, lazy state)",
        "schedule": "OneCycleLR (lr and betas[0] change every step)", "steps": args.steps,
        "captured_first": "constant" if args.constant_first else "scheduled",
        "primed": args.prime,
    }
    from flowexec.runtime import fastcall

    res["call_check"] = fastcall.status()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = {}
        if args.prime:  # kept alive, as the timed ones are
            built[None] = make(args.width, args.depth, dev, False, args.steps, True)
            for _ in range(3):
                built[None][0](), built[None][1]()
        for scheduled in (False, True) if args.constant_first else (True, False):
            built[scheduled] = make(args.width, args.depth, dev, scheduled, args.steps, True)
            for _ in range(3):  # eager first call (lazy AdamW state), capture, one replay
                built[scheduled][0](), built[scheduled][1]()
        (sched_step, sched_after, sched_exe), (const_step, const_after, _) = built[True], built[False]
        sched_us: list[float] = []
        const_us: list[float] = []
        sched_call: list[float] = []
        const_call: list[float] = []
        for _ in range(rounds):  # alternating rounds: both see the same drift of the host
            a, b = timed_rounds(sched_step, sched_after, 1, per_round, sync)
            sched_us, sched_call = sched_us + a, sched_call + b
            a, b = timed_rounds(const_step, const_after, 1, per_round, sync)
            const_us, const_call = const_us + a, const_call + b
    recaptures = [str(w.message) for w in caught if issubclass(w.category, flowexec.RecaptureWarning)]
    res["scheduled_programs"] = sum(map(len, sched_exe._cache.values()))
    res["recapture_warnings"] = recaptures
    res["scheduled_native_path"] = bool(sched_exe._native is not None and sched_exe._native.guarded)
    feeds = sched_exe._last.guards.feeds if sched_exe._last.guards is not None else None
    res["fed"] = [s.name for s in feeds.slots] if feeds is not None else []
    # how the values reach the graph: its own kernel node (runtime/feed_node.py) or a copy before each replay
    res["fed_by"] = "graph kernel node" if feeds is not None and feeds.writers else "copy before the replay"
    # (the buffers are keyed by the parameters' device, with its index: cuda:0)
    res["lr_fed_now"] = float(next(iter(feeds.buffers.values()))[0]) if feeds is not None else None
    res["scheduled_us_rounds"] = sched_us
    res["constant_us_rounds"] = const_us
    med_s, med_c = statistics.median(sched_us), statistics.median(const_us)
    res["scheduled_us"], res["constant_us"] = med_s, med_c
    res["scheduled_over_constant"] = med_s / med_c
    res["noise"] = (max(const_us) - min(const_us)) / med_c  # the constant runs' own spread
    res["within_noise"] = abs(med_s / med_c - 1) <= res["noise"]
    res["scheduled_call_host_us"] = statistics.median(sched_call)  # inside the call: checks, feeds, replay
    res["constant_call_host_us"] = statistics.median(const_call)
    res["scheduled_call_host_us_rounds"], res["constant_call_host_us_rounds"] = sched_call, const_call
    # eager, for scale
    e_step, e_after, _ = make(args.width, args.depth, dev, True, args.steps, False)
    e_step(), e_after()
    res["eager_scheduled_us"] = statistics.median(timed_rounds(e_step, e_after, 3, per_round, sync)[0])
    res["eager_over_flowexec_scheduled"] = res["eager_scheduled_us"] / med_s
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "schedule.json")
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_rounds")}, indent=1))
    print(f"wrote {path}")
    if res["scheduled_programs"] != 1 or recaptures:
        sys.exit("FAIL: the schedule re-captured")


if __name__ == "__main__":
    main()
