"""Micro-batches whose forwards all run before their backwards (GPipe order), through the
torch.compile backend: eager vs flowexec trace vs flowexec graph, side by side in one run.

In graph mode a forward replay would overwrite the buffers that an earlier micro-batch's saved
tensors live in while its backward is still pending, so each micro-batch in flight runs on a
forward graph of its own (up to the backend's cache_size) and each backward replays the graph
that reads its forward's buffers in place; nothing is copied. The per-micro-batch order
(forward, backward, forward, ...) is timed beside it. Re-capture warnings over the timed steps
are counted (0 expected). ``--memory`` also builds each row in a process of its own and records
the memory it reserves (CUDA graph pools included) and allocates.

    PYTHONPATH=. python3 benchmarks/microbatch.py --out benchmarks/results [--memory]

Writes microbatch.json (device, versions, date, every figure).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
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


def build_rows(base: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], dev: torch.device,
               only: str | None = None) -> dict[str, Callable[[], None]]:
    """Every row's step (or the row named ``only``): eager, and the backend in each mode, for
    both orders."""
    modes = ["trace", "graph"] if dev.type == "cuda" else ["trace"]
    fns: dict[str, Callable[[], None]] = {}
    for gpipe in (True, False):
        order = "gpipe" if gpipe else "per-micro-batch"
        for name, mode in [(f"eager, {order}", None)] + [(f"flowexec {m}, {order}", m) for m in modes]:
            if only is not None and name != only:
                continue
            model = copy.deepcopy(base)
            if mode is not None:
                torch._dynamo.reset()
                model = torch.compile(model, backend="flowexec", options={"mode": mode})
            fns[name] = make_step(model, data, gpipe)
    return fns


def row_memory(name: str, micro: int, batch: int) -> dict[str, float | None]:
    """One row's memory in a process of its own (so that rows share no cached blocks): MiB
    reserved by the caching allocator (CUDA graph pools included) and allocated after three
    warm steps, and the peak allocated, over what the model and data take; None on CPU."""
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-row", name, "--micro", str(micro), "--batch", str(batch)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"memory of row {name!r} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1])


def _measure_row(name: str, micro: int, batch: int) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base, data = _model_and_data(dev, micro, batch)
    if dev.type != "cuda":
        print(json.dumps({"reserved_MiB": None, "allocated_MiB": None, "peak_allocated_MiB": None}))
        return
    torch.cuda.synchronize()
    reserved0, allocated0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (fn,) = build_rows(base, data, dev, only=name).values()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    mib = 1 << 20
    print(json.dumps({"reserved_MiB": (torch.cuda.memory_reserved() - reserved0) / mib,
                      "allocated_MiB": (torch.cuda.memory_allocated() - allocated0) / mib,
                      "peak_allocated_MiB": (torch.cuda.max_memory_allocated() - allocated0) / mib}))


def _model_and_data(dev: torch.device, micro: int, batch: int) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    base = make_mlp(256, 8).to(dev)
    data = [(torch.randn(batch, 256, device=dev), torch.randint(0, 10, (batch,), device=dev)) for _ in range(micro)]
    return base, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="folder for microbatch.json")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=32, help="rows per micro-batch")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=30)
    ap.add_argument("--memory", action="store_true", help="also each row's memory, in a process of its own")
    ap.add_argument("--memory-row", help=argparse.SUPPRESS)  # the child process of --memory
    args = ap.parse_args()
    if args.memory_row:
        _measure_row(args.memory_row, args.micro, args.batch)
        return
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    base, data = _model_and_data(dev, args.micro, args.batch)
    fns = build_rows(base, data, dev)
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
    if args.memory:
        out["memory"] = {name: row_memory(name, args.micro, args.batch) for name in fns}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "microbatch.json"), "w") as f:
        json.dump(out, f, indent=1)
    for k, v in times.items():
        mem = out.get("memory", {}).get(k, {}).get("reserved_MiB")
        print(f"{k:38s} {v:9.1f} µs  {out['speedup_vs_eager'][k]:.2f}×" + (f"  {mem:8.1f} MiB reserved" if mem is not None else ""))
    print(f"re-capture warnings while timed: {recaptures}")
    for m in sorted(set(recaptured)):
        print("  ", m)


if __name__ == "__main__":
    main()
