"""Whether pinning host memory on a thread (snapshot.prepin) overlaps Python work on the main
thread, or takes the interpreter from it (issue 36's warm build: the warm-up's snapshot blocks
are pinned while the capture traces).

Each case on a cold pinned-memory cache, best of ``--rounds``: the pinning alone; a tracing
workload alone (``make_fx`` of a small MLP's forward and backward, pure Python and fake
tensors, as a capture is); both at once, the pinning on a thread. Overlap: the workload's time
beside the pinning against alone, and the whole against the two summed.

    python3 benchmarks/probes/prepin_overlap.py --gib 1.5 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import scale  # noqa: E402  (its write)
from host_meta import host_meta  # noqa: E402

from flowexec import snapshot  # noqa: E402


def trace_workload(reps: int) -> None:
    """Tracing of a small MLP's step with fake tensors, ``reps`` times (the interpreter's work)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> list[torch.Tensor]:
        loss = torch.relu(x @ w1).matmul(w2).square().mean()
        return list(torch.autograd.grad(loss, (w1, w2)))

    for _ in range(reps):
        with FakeTensorMode():
            x = torch.randn(64, 256)
            w1 = torch.randn(256, 256, requires_grad=True)
            w2 = torch.randn(256, 256, requires_grad=True)
            make_fx(step)(x, w1, w2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.5, help="host memory to pin (GPT-2 124M's state: 1.5)")
    ap.add_argument("--reps", type=int, default=200, help="traces in the workload (~1-2 s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("prepin_overlap: pinned memory needs CUDA")
    torch.cuda.init()
    trace_workload(2)  # (imports and first-call costs out of the timed rounds)
    sizes = [snapshot._BLOCK] * max(1, round(a.gib * (1 << 30) / snapshot._BLOCK))
    cases: dict[str, list[dict[str, float]]] = {"pin": [], "trace": [], "both": []}
    for _ in range(a.rounds):
        torch._C._host_emptyCache()
        t = time.perf_counter()
        snapshot.prepin(sizes).join()
        cases["pin"].append({"wall_s": time.perf_counter() - t})
        t = time.perf_counter()
        trace_workload(a.reps)
        cases["trace"].append({"wall_s": time.perf_counter() - t})
        torch._C._host_emptyCache()
        t = time.perf_counter()
        thread = snapshot.prepin(sizes)
        trace_workload(a.reps)
        traced = time.perf_counter() - t
        thread.join()
        cases["both"].append({"wall_s": time.perf_counter() - t, "trace_s": traced})
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in cases.items()}
    summary = {
        "pin_s": best["pin"]["wall_s"], "trace_s": best["trace"]["wall_s"],
        "both_wall_s": best["both"]["wall_s"], "trace_beside_pin_s": best["both"]["trace_s"],
        "overlap": "full where both_wall_s ~ max(pin_s, trace_s); none where it is their sum",
    }
    out = {"probe": "prepin_overlap", **host_meta(" ".join(sys.argv)), "gpu": torch.cuda.get_device_name(),
           "bytes": sum(sizes), "rounds": cases, "summary": summary}
    scale.write(out, os.path.join(a.out, "prepin_overlap.json"))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
