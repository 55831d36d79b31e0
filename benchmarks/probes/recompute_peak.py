"""What recomputing activations does to a training step's planned peak (a probe, not a benchmark):
one scale.py model at a chosen batch, compiled with ``recompute=False`` and ``True`` (fused or
not), each from the same weights: the plan's peak of intermediates, what was recomputed, the
losses of a few steps (which must agree within bf16 rounding) and the build phases. On CUDA
also the measured peak of a step after the build.

    PYTHONPATH=. python3 benchmarks/probes/recompute_peak.py --model gpt2_124m --batch 2 --seq 1024 \\
        --device cpu [--fuse inductor|off] [--mode trace] [--out DIR]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]
import flowexec  # noqa: E402
import scale  # noqa: E402  (the models, their losses and the anchors' step)
from host_meta import host_meta  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2_124m", choices=scale.MODELS)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (language models)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fuse", default="inductor", choices=("inductor", "off"))
    ap.add_argument("--mode", default="trace")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    w = scale.build(a.model, dev, False)
    x, y = (w.x[:a.batch, :a.seq], w.y[:a.batch, :a.seq]) if w.x.dim() == 2 else (w.x[:a.batch], w.y[:a.batch])
    x, y = x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x.contiguous(), y.contiguous()
    meta = host_meta(" ".join([sys.executable] + sys.argv))
    res = {"probe": "recompute_peak", **meta,
           "model": w.desc, "batch": list(x.shape), "options": {"fuse": a.fuse, "mode": a.mode}, "runs": {}}
    for recompute in (False, True):
        m = copy.deepcopy(w.module)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        step = scale.make_step(scale.Workload(m, x, y, w.loss, w.desc, w.units, w.unit), m, opt, dev)
        step(x, y)  # the optimizer's state exists before capture
        t0 = time.perf_counter()
        exe = flowexec.compile(step, mode=a.mode, fuse="inductor" if a.fuse == "inductor" else False,
                               recompute=recompute)
        losses = [exe(x, y).item() for _ in range(a.steps)]
        run = {"build_s": time.perf_counter() - t0, "losses": losses, "build_phases": exe.build_phases,
               **{k: v for k, v in exe.plan.stats().items() if k in (
                   "ops", "fused_regions", "fused_kernels", "planned_peak_bytes", "recomputed_buffers",
                   "recomputed_bytes")}}
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            exe(x, y)
            torch.cuda.synchronize()
            run["step_peak_bytes"] = torch.cuda.max_memory_allocated()
        res["runs"][f"recompute={recompute}"] = run
        print(f"recompute={recompute}: planned peak {run['planned_peak_bytes'] / 2**20:.0f} MiB, "
              f"{run['recomputed_buffers']} buffers recomputed, losses {[round(v, 5) for v in losses]}", flush=True)
        del exe, m, opt, step
    off, on = (res["runs"][f"recompute={r}"] for r in (False, True))
    res["planned_peak_ratio"] = on["planned_peak_bytes"] / off["planned_peak_bytes"]
    res["loss_max_rel_diff"] = max(abs(p - q) / abs(q) for p, q in zip(on["losses"], off["losses"]))
    print(f"planned peak x{res['planned_peak_ratio']:.3f}; losses within {res['loss_max_rel_diff']:.2g}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"recompute_peak_{a.model}.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
