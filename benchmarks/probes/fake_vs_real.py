"""What a fake capture's program runs that a real capture's does not (issue 36: no extra work).

For each of ``benchmarks/scale.py``'s models, the anchors' training step (bf16 autocast, fused
AdamW where the device has it) is captured twice in this process, once on fake tensors and once
for real (``flowexec.capture._FAKE_CAPTURE``), after an eager first step that makes the
optimizer's state; the probe writes each program's op counts and the ops whose count differs.
A library that branches on whether a tensor is fake shows here: before the fold of constants
(capture._CaptureGuard._fold), HF GPT-2's fake program built an explicit causal mask.

    PYTHONPATH=. python3 benchmarks/probes/fake_vs_real.py --device cpu --tiny --out DIR
    PYTHONPATH=. python3 benchmarks/probes/fake_vs_real.py --device cuda --out DIR   # the figures' sizes

Writes ``fake_vs_real.json`` (device, versions, commit; per model: ops per program, the ops
only one of them runs or runs more often, and how each capture ran).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import scale  # noqa: E402  (benchmarks/scale.py: the models and their step)
from ops import write_result  # noqa: E402


def programs(model: str, dev: Any, tiny: bool) -> dict[str, Any]:
    """The fake and the real capture's op counts of ``model``'s step, and how each ran."""
    import torch

    import flowexec
    import flowexec.capture as capture

    w = scale.build(model, dev, tiny)
    opt = torch.optim.AdamW(w.module.parameters(), lr=1e-4, fused=dev.type == "cuda")
    step = scale.make_step(w, w.module, opt, dev)
    step(w.x, w.y)  # the optimizer's state, as a user's loop has it by the second step
    out: dict[str, Any] = {"desc": w.desc}
    counts = {}
    saved = capture._FAKE_CAPTURE
    try:
        for fake in (True, False):
            capture._FAKE_CAPTURE = fake
            exe = flowexec.compile(step, w.x, w.y, mode="trace", fuse=False)
            counts[fake] = collections.Counter(op.name for op in exe.program.ops)
            out["fake" if fake else "real"] = {"run": exe.capture_run, "ops": sum(counts[fake].values())}
            del exe
    finally:
        capture._FAKE_CAPTURE = saved
    names = sorted(set(counts[True]) | set(counts[False]))
    out["differ"] = {n: {"fake": counts[True][n], "real": counts[False][n]}
                     for n in names if counts[True][n] != counts[False][n]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(scale.MODELS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a few-layer version of each model (on a CPU)")
    ap.add_argument("--out", default=None, help="directory for fake_vs_real.json")
    a = ap.parse_args()
    import torch

    dev = torch.device(a.device)
    res: dict[str, Any] = {"probe": "fake_vs_real", "tiny": a.tiny, **scale.env_meta(dev), "models": {}}
    for model in a.models.split(","):
        r = res["models"][model] = programs(model, dev, a.tiny)
        print(f"{model}: fake {r['fake']['ops']} ops ({r['fake']['run']}), real {r['real']['ops']} ops; "
              f"{len(r['differ'])} op kinds differ", flush=True)
        for n, c in r["differ"].items():
            print(f"    {n}: fake {c['fake']}, real {c['real']}")
    if a.out:
        write_result(a.out, "fake_vs_real.json", res)


if __name__ == "__main__":
    main()
