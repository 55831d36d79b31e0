"""Where a captured step's memory goes on CUDA, phase by phase (a probe, not a benchmark):
eager's step peak, then for each mode the peak of the capture and planning alone
(``compile_for``), of the first run and of a later call, and what capture parked.

    PYTHONPATH=. python3 benchmarks/probes/capture_memory.py [--out DIR]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "benchmarks")]
import flowexec  # noqa: E402
import flowexec.parking as parking  # noqa: E402
from helpers import state_heavy_step  # noqa: E402
from ops import run_meta, write_result  # noqa: E402

MIB = 2**20


def peak_of(f) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    f()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / MIB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    parked_log: list[tuple[int, int]] = []
    park = parking.ParkedGrads.park.__func__

    def logged(cls, grads):
        grads = list(grads)
        p = park(cls, grads)
        parked_log.append((len(p._parked), sum(g.numel() * g.element_size() for g, _ in p._parked.values())))
        parked_log.append((len(grads), -1))
        return p

    parking.ParkedGrads.park = classmethod(logged)
    res: dict = run_meta("PYTHONPATH=. python3 benchmarks/probes/capture_memory.py")
    for mode in ("trace", "graph"):
        model, step, x = state_heavy_step()
        r: dict = {"param_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / MIB}
        r["allocated_before_mib"] = torch.cuda.memory_allocated() / MIB
        r["eager_peak_mib"] = peak_of(lambda: step(x))
        exe = flowexec.compile(step, mode=mode)
        parked_log.clear()
        r["compile_for_peak_mib"] = peak_of(lambda: exe.compile_for(x))
        r["allocated_after_capture_mib"] = torch.cuda.memory_allocated() / MIB
        r["parked"] = list(parked_log)
        r["first_run_peak_mib"] = peak_of(lambda: exe(x))
        r["second_call_peak_mib"] = peak_of(lambda: exe(x))
        r["third_call_peak_mib"] = peak_of(lambda: exe(x))
        r["allocated_end_mib"] = torch.cuda.memory_allocated() / MIB
        res[mode] = r
        print(mode, json.dumps(r), flush=True)
        del exe, step, model, x
        gc.collect()  # (an executable sits in reference cycles: the next mode starts clean)
        torch.cuda.empty_cache()
    write_result(a.out, "capture_memory.json", res)


if __name__ == "__main__":
    main()
