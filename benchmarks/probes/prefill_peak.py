"""What is alive when a graph-mode first call peaks, with ``first_step="planned"`` or
``"prefill"`` (a probe, not a benchmark): the scenario of ``tests/gpu/test_prefill_gpu.py``'s
peak test (flowexec.models.Block, fused AdamW, two calls) with torch's allocator history on
from the start. Reports the peak over the two calls, the call it falls in, each call's
``build_peaks``, and the blocks alive at the peak, largest first, with the innermost frames of
their allocation.

    PYTHONPATH=. python3 benchmarks/probes/prefill_peak.py --first-step prefill [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks"), os.path.dirname(os.path.abspath(__file__))]
from build_peak import frames_of, walk  # noqa: E402
from ops import run_meta, write_result  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--first-step", default="prefill", choices=("planned", "prefill"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import flowexec
    from flowexec.models import Block, lm_loss

    res: dict[str, Any] = run_meta("PYTHONPATH=. python3 benchmarks/probes/prefill_peak.py " + " ".join(sys.argv[1:]))
    torch.manual_seed(0)
    model = Block(vocab=512, dim=256, seq=256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    exe = flowexec.compile(step, mode="graph", first_step=a.first_step)
    x, y = (torch.randint(0, 512, (8, 256), device="cuda") for _ in range(2))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    starts = []
    for k in range(2):
        starts.append(time.time() * 1e6)
        torch.cuda.reset_peak_memory_stats()
        exe(x, y)
        torch.cuda.synchronize()
        res[f"call{k}_peak_above_base"] = torch.cuda.max_memory_allocated() - base
        res[f"call{k}_build_peaks"] = {kk: (v - base if v is not None else None) for kk, v in exe.build_peaks.items()} \
            if exe._first is not None else None
    res["first_step_prefilled"] = exe.first_step_prefilled
    res["first_step_fallback"] = exe.first_step_fallback
    res["capture_run"] = exe.capture_run
    res["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    at, peak, alive = walk(trace)  # (from the history's start: the bytes above base)
    t_at = trace[at]["time_us"]
    res["trace_peak_above_base"] = peak
    res["peak_in_call"] = max(k for k, s in enumerate(starts) if s <= t_at) if t_at >= starts[0] else None
    res["peak_event_frames"] = frames_of(trace[at], 14)
    blocks = sorted(alive.values(), key=lambda e: -e["size"])
    res["alive_at_peak"] = [{"bytes": e["size"], "age_s": (t_at - e["time_us"]) / 1e6, "frames": frames_of(e, 8)}
                            for e in blocks[:30]]
    print({k: v for k, v in res.items() if k != "alive_at_peak"}, flush=True)
    for r in res["alive_at_peak"]:
        print(r, flush=True)
    write_result(a.out, f"prefill_peak_{a.first_step}.json", res)


if __name__ == "__main__":
    main()
