"""What is alive when a whole-step graph's build peaks above eager's (a probe, not a benchmark).

``scale.py``'s ResNet-50 fused graph step peaks 2.9 MiB above eager's step, during the build's
runner phase (warm-up and CUDA-graph capture: ``exe.build_peaks``); its replays peak far lower.
This builds the same step as ``scale.py`` (an eager step first, then ``flowexec.compile``) with
torch's allocator history on from the start, walks the trace to the moment the allocated bytes
peak, and reports the peak, eager's own peak (the first step's, from the same trace), and the
blocks alive at the build's peak: the largest ones and those allocated after the eager step,
each with its size, stream, age and the innermost frames of its allocation.

    PYTHONPATH=. python3 benchmarks/probes/build_peak.py [--model resnet50] [--variant fx_graph_fused] [--out DIR]

On a CPU, ``--tiny --device cpu`` only checks that the script runs (no allocator history there).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]
from ops import run_meta, write_result  # noqa: E402
from scale import build, flowexec_options, make_step  # noqa: E402


def frames_of(ev: dict[str, Any], n: int = 6) -> list[str]:
    """The innermost ``n`` Python frames of an allocation, skipping torch's own plumbing."""
    out = []
    for f in ev.get("frames", []):
        name = f.get("filename", "")
        if "/torch/utils/" in name or "/torch/_ops.py" in name or name.endswith("_contextlib.py"):
            continue
        out.append(f"{os.path.basename(name)}:{f.get('line')}:{f.get('name')}")
        if len(out) == n:
            break
    return out


def walk(trace: list[dict[str, Any]]) -> tuple[int, int, dict[int, dict[str, Any]]]:
    """(index of the peak event, peak bytes, the blocks alive just after it) over a trace
    recorded from an empty allocator: ``alloc`` adds a block, ``free_completed`` removes it."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at = -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak, at = total, i
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    alive: dict[int, dict[str, Any]] = {}
    for ev in trace[:at + 1]:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            alive.pop(ev["addr"], None)
    return at, peak, alive


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--variant", default="fx_graph_fused")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    command = "PYTHONPATH=. python3 benchmarks/probes/build_peak.py " + " ".join(sys.argv[1:])
    res: dict[str, Any] = run_meta(command) if cuda else {"device": "cpu", "command": command}
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks="python")
    import flowexec

    w = build(a.model, dev, a.tiny)
    opt = torch.optim.AdamW(w.module.parameters(), lr=1e-4, fused=cuda)
    step = make_step(w, w.module, opt, dev)
    step(w.x, w.y)  # the eager step (optimizer state made), as scale.py
    if cuda:
        torch.cuda.synchronize()
        res["eager_step_peak_bytes"] = torch.cuda.max_memory_allocated()
    t_build = time.time()
    exe = flowexec.compile(step, **flowexec_options(a.variant))
    for _ in range(3):
        exe(w.x, w.y)
        if getattr(exe, "build_seconds", None) is not None:
            break
    if cuda:
        torch.cuda.synchronize()
    res["build_peaks"] = getattr(exe, "build_peaks", None)
    res["build_phases"] = getattr(exe, "build_phases", None)
    if not cuda:
        write_result(a.out, "build_peak.json", res)
        return
    res["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    res["trace_events"] = len(trace)
    at, peak, alive = walk(trace)
    res["trace_peak_bytes"] = peak
    built_from = t_build * 1e6
    res["peak_event"] = {k: trace[at].get(k) for k in ("action", "size", "stream", "time_us")}
    res["peak_event"]["after_build_start_s"] = (trace[at]["time_us"] - built_from) / 1e6
    res["peak_event"]["frames"] = frames_of(trace[at], 12)

    def row(ev: dict[str, Any]) -> dict[str, Any]:
        return {"bytes": ev["size"], "stream": ev.get("stream"), "age_s": (trace[at]["time_us"] - ev["time_us"]) / 1e6,
                "allocated_after_build_start": ev["time_us"] >= built_from, "frames": frames_of(ev)}
    blocks = sorted(alive.values(), key=lambda e: -e["size"])
    res["alive_at_peak"] = {"blocks": len(blocks), "bytes": sum(e["size"] for e in blocks),
                            "bytes_allocated_before_build": sum(e["size"] for e in blocks if e["time_us"] < built_from)}
    res["largest_alive"] = [row(e) for e in blocks[:25]]
    res["alive_from_the_build"] = [row(e) for e in blocks if e["time_us"] >= built_from][:60]
    print({k: v for k, v in res.items() if k not in ("largest_alive", "alive_from_the_build")}, flush=True)
    for r in res["alive_from_the_build"][:25]:
        print(r, flush=True)
    write_result(a.out, "build_peak.json", res)


if __name__ == "__main__":
    main()
