"""Micro-batches whose forwards all run before their backwards (GPipe order), through the
torch.compile backend: eager vs flowexec trace vs flowexec graph, side by side in one run.

In graph mode a forward replay would overwrite the buffers that an earlier micro-batch's saved
tensors live in while its backward is still pending, so each micro-batch in flight runs on a
forward graph of its own (up to the backend's cache_size) and each backward replays the graph
that reads its forward's buffers in place; nothing is copied. The per-micro-batch order (forward, backward, forward, ...) replays
every graph, and is timed too for comparison. The row of graph mode also counts re-capture
warnings over the timed steps (0 expected).

    PYTHONPATH=. python3 benchmarks/microbatch.py --out benchmarks/results

Writes microbatch.json (device, versions, date, every figure).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flowexec.models import make_mlp  # noqa: E402
from step_time import interleaved  # noqa: E402


def make_step(model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], gpipe: bool) -> Callable[[], None]:
    """One SGD step over ``data``: all forwards then all backwards (``gpipe``), or each
    micro-batch's forward and backward in turn."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if gpipe:
            losses = [F.cross_entropy(model(x), y) for x, y in data]
            for loss in losses:
                loss.backward()
        else:
            for x, y in data:
                F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="folder for microbatch.json")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=32, help="rows per micro-batch")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    base = make_mlp(256, 8).to(dev)
    data = [(torch.randn(args.batch, 256, device=dev), torch.randint(0, 10, (args.batch,), device=dev))
            for _ in range(args.micro)]
    modes = ["trace", "graph"] if dev.type == "cuda" else ["trace"]
    fns: dict[str, Callable[[], None]] = {}
    for gpipe in (True, False):
        order = "gpipe" if gpipe else "per-micro-batch"
        fns[f"eager, {order}"] = make_step(copy.deepcopy(base), data, gpipe)
        for mode in modes:
            torch._dynamo.reset()
            c = torch.compile(copy.deepcopy(base), backend="flowexec", options={"mode": mode})
            fns[f"flowexec {mode}, {order}"] = make_step(c, data, gpipe)
    for fn in fns.values():  # compile, capture and warm every row before timing
        for _ in range(3):
            fn()
        sync()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        times = interleaved(fns, sync, args.rounds, args.per_round)
    recaptured = [str(w.message) for w in said if "capturing the graph again" in str(w.message)]
    recaptures = len(recaptured)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": "PYTHONPATH=. python3 benchmarks/microbatch.py " + " ".join(sys.argv[1:]),
        "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown"),  # the device machine's git may be stale
        "model": "MLP 8x256, SGD", "micro_batches": args.micro, "batch": args.batch,
        "step_us": times, "recapture_warnings_while_timed": recaptures,
        "recapture_messages": sorted(set(recaptured)),
        "speedup_vs_eager": {k: times[f"eager, {k.split(', ')[1]}"] / v for k, v in times.items()},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "microbatch.json"), "w") as f:
        json.dump(out, f, indent=1)
    for k, v in times.items():
        print(f"{k:38s} {v:9.1f} µs  {out['speedup_vs_eager'][k]:.2f}×")
    print(f"re-capture warnings while timed: {recaptures}")
    for m in sorted(set(recaptured)):
        print("  ", m)


if __name__ == "__main__":
    main()
