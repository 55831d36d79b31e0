"""Kernel-by-kernel GPU time of the fused lerp, its tuning variants, PyTorch and a yardstick (CUDA).

For each reference case (and the float16/bfloat16 variants of cases 3 and 4): the durations of
the kernels of one forward + ``autograd.grad`` (profiler, L2 flushed before each repetition,
median per kernel), for PyTorch, for flowexec with ``LerpConfig()`` as shipped and with one knob
changed at a time, and for three yardsticks: a plain ``g * y`` (an elementwise kernel that moves
the bytes of the backward's largest stream: read ``g`` and ``y``, write one output), one PyTorch
kernel with the forward's streams (read each output-sized input, write the output) and a
1024-element kernel (what any extra launch costs on the GPU). They show what simple kernels
achieve against the memory floor at these sizes.

    PYTHONPATH=. python3 benchmarks/lerp_kernels.py --out benchmarks/results/lerp_kernels.json

``--inplace``: ``torch.ops.flowexec.lerp_`` against ATen's ``lerp_``, and a graph-mode step with
and without ``fuse_lerp`` (``benchmarks/results/lerp_inplace.json``, what the pass's default rests on).

    PYTHONPATH=. python3 benchmarks/lerp_kernels.py --inplace
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ops import EXTRA, REFERENCE, Case, copy_bandwidth, floor_bytes, kernel_times, make_inputs, run_meta  # noqa: E402

L = importlib.import_module("flowexec.kernels.lerp")

VARIANTS: dict[str, dict[str, Any]] = {
    "shipped": {},
    "partial sums + final pass (no atomics)": {"atomic_max": 0},
    "no flat programs": {"flat_programs": False},
    "no full-tile loads": {"full_tile_loads": False},
    "no streaming store": {"fwd_stream_store": False},
    "backward reversed": {"bwd_reverse": True},
    "backward in order": {"bwd_reverse": False},
    "final pass 32 columns": {"final_cols": 32},
    "backward loads after stores": {"bwd_loads_first": False},
    "backward without cache hints": {"bwd_stream": False},
    "dx and dw flushed apart": {"bwd_joint_flush": False},
    "forward in tiles": {"fwd_plane": False},
    "plane tile ×2": {"plane_tile": {2: 4096, 4: 2048, 8: 1024}},
    "tile ÷2": {"tile": {2: 2048, 4: 1024, 8: 512}},
    "tile ×2": {"tile": {2: 8192, 4: 4096, 8: 2048}},
    "8 programs / SM": {"programs_per_sm": 8},
    "backward 8 warps": {"bwd_warps": 8},
    "three full operands: 2048-element tiles (before)": {"flat3_tile": {}},
    "three full operands: no evict-first loads (before)": {"flat3_evict": {}},
    "plane tile ÷2": {"plane_tile": {2: 1024, 4: 512, 8: 256}},
    "forward 2 warps": {"fwd_warps": 2},
    "forward 8 warps": {"fwd_warps": 8},
    "3 programs / SM": {"programs_per_sm": 3},
    "5 programs / SM": {"programs_per_sm": 5},
    "6 programs / SM": {"programs_per_sm": 6},
    "runtime divisions (no magic multipliers)": {"fast_div": False},
    "2-byte tiles of 2048 (case 3 f16 backward: 80 registers, not 168)": {"tile": {2: 2048, 4: 2048, 8: 1024}},
    "plane tile ×2, forward 8 warps": {"plane_tile": {2: 4096, 4: 2048, 8: 1024}, "fwd_warps": 8},
    "backward 8 warps, 2 programs / SM": {"bwd_warps": 8, "programs_per_sm": 2},
    "tile ×2, backward 8 warps, 2 programs / SM": {"tile": {2: 8192, 4: 4096, 8: 2048}, "bwd_warps": 8,
                                                   "programs_per_sm": 2},
}


def per_kernel(fn: Callable[[], Any]) -> dict[str, float]:
    """Median duration per kernel position (µs), and their sum."""
    by_pos: dict[str, list[float]] = {}
    for rep in kernel_times(fn, reps=30):
        for i, (name, dur) in enumerate(rep):
            short = name.split("(")[0].split("<")[0].replace("void ", "")[:40]
            by_pos.setdefault(f"{i}:{short}", []).append(dur)
    out = {k: round(statistics.median(v), 2) for k, v in by_pos.items()}
    out["total"] = round(sum(out.values()), 2)
    return out


def measure(case: Case, bw: float) -> dict[str, Any]:
    x, y, w, go = make_inputs(case, "cuda")
    ins = [t for t in (x, y, w) if isinstance(t, torch.Tensor)]
    fb, bb = floor_bytes(case)
    row: dict[str, Any] = {"floor_fwd_bwd_us": (fb + bb) / bw * 1e6}
    row["torch"] = per_kernel(lambda: torch.autograd.grad(torch.lerp(x, y, w), ins, go))
    yd = y.detach()
    row["yardstick g*y"] = per_kernel(lambda: go * yd)
    row["yardstick g*y floor_us"] = 3 * go.numel() * go.element_size() / bw * 1e6
    # The forward's streams as one PyTorch kernel: read each output-sized input, write the output.
    full = [t.detach() for t in (x, y, w) if isinstance(t, torch.Tensor) and t.shape == go.shape]
    fwd_like = {1: lambda: torch.neg(full[0]), 2: lambda: torch.mul(full[0], full[1]),
                3: lambda: torch.addcmul(full[0], full[1], full[2])}[len(full)]
    row["yardstick fwd-like"] = per_kernel(fwd_like)
    row["yardstick fwd-like floor_us"] = (len(full) + 1) * go.numel() * go.element_size() / bw * 1e6
    tiny = torch.zeros(1024, device="cuda")
    row["yardstick tiny kernel"] = per_kernel(lambda: torch.neg(tiny))
    for name, change in VARIANTS.items():
        with L.configured(**change):
            row[name] = per_kernel(lambda: torch.autograd.grad(L.lerp(x, y, w), ins, go))
    return row


INPLACE_SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype, Any]] = {  # self's shape, dtype, weight
    "[16,102400] f32 w=0.1": ((16, 102400), torch.float32, 0.1),
    "[16,102400] f32 w[1]": ((16, 102400), torch.float32, (1,)),
    "[16,102400] f32 w full": ((16, 102400), torch.float32, "full"),
    "[16,204800] f64 w=0.1": ((16, 204800), torch.float64, 0.1),
    "[16,102400] f16 w=0.1": ((16, 102400), torch.float16, 0.1),
    "[16,102400] bf16 w=0.1": ((16, 102400), torch.bfloat16, 0.1),
    "[16,3,244,244] f32 w[3,1,244]": ((16, 3, 244, 244), torch.float32, (3, 1, 244)),
    "[4096,4096] f32 w[4096]": ((4096, 4096), torch.float32, (4096,)),
    "[256,256] f32 w[256]": ((256, 256), torch.float32, (256,)),
    "[64,256] f32 w=0.1": ((64, 256), torch.float32, 0.1),
}


def inplace() -> dict[str, Any]:
    """``torch.ops.flowexec.lerp_`` against ATen's ``lerp_`` (kernel time in two alternating rounds,
    and wall) on Adam/EMA-like shapes and weights, and a graph-mode step of two in-place lerps with
    ``fuse_lerp=False``, the default and ``"all"``: what ``passes/fuse_lerp.py``'s default rests on."""
    import flowexec
    from ops import bench

    res: dict[str, Any] = {}
    for name, (shape, dt, wk) in INPLACE_SHAPES.items():
        a = torch.randn(shape, device="cuda", dtype=dt)
        b = torch.randn(shape, device="cuda", dtype=dt)
        wt = None if isinstance(wk, float) else torch.rand(shape if wk == "full" else wk, device="cuda", dtype=dt)
        wv = wk if isinstance(wk, float) else 0.0
        aw = wv if wt is None else wt
        want = a.clone().lerp_(b, aw)
        got = a.clone()
        torch.ops.flowexec.lerp_(got, b, wt, wv)
        row = res[name] = {"max_abs_diff": (want.double() - got.double()).abs().max().item()}
        for rnd in range(2):  # two alternating rounds
            row[f"torch kernels {rnd}"] = per_kernel(lambda: a.lerp_(b, aw))["total"]
            row[f"flowexec kernels {rnd}"] = per_kernel(lambda: torch.ops.flowexec.lerp_(a, b, wt, wv))["total"]
        row["torch wall"] = bench(lambda: a.lerp_(b, aw))
        row["flowexec wall"] = bench(lambda: torch.ops.flowexec.lerp_(a, b, wt, wv))
        print(name, row, flush=True)

    def step(p: Any, g: Any, m: Any, w: Any, ema: Any) -> Any:
        m.lerp_(g, w)        # a moment update with a per-column weight (broadcast)
        ema.lerp_(p, 0.01)   # an EMA with a float weight (all operands full-size)
        return (m * ema).sum()

    steps: dict[str, Any] = {}
    for shape in ((16, 102400), (4096, 4096)):
        ts = [torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda"),
              torch.rand(shape[-1], device="cuda"), torch.randn(shape, device="cuda")]
        r: dict[str, Any] = {}
        for opt in (False, None, "all"):
            exe = flowexec.compile(step, *[t.clone() for t in ts], mode="graph", fuse_lerp=opt)
            args = [t.clone() for t in ts]
            exe(*args)
            r[str(opt)] = {"lerp ops": [op.name for op in exe.program.ops if "lerp" in op.name],
                           "kernels": per_kernel(lambda: exe(*args))["total"], "wall": bench(lambda: exe(*args))}
        steps[str(shape)] = r
        print("graph step", shape, r, flush=True)
    res["graph-mode step"] = steps
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default: benchmarks/results/lerp_kernels.json "
                    "(lerp_inplace.json with --inplace)")
    ap.add_argument("--inplace", action="store_true", help="the in-place op against ATen's instead")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/lerp_kernels.py needs a CUDA device")
    here = os.path.join(os.path.dirname(__file__), "results")
    if args.inplace:
        out = args.out or os.path.join(here, "lerp_inplace.json")
        res = {**run_meta("PYTHONPATH=. python3 benchmarks/lerp_kernels.py --inplace"), "us": inplace()}
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        return
    args.out = args.out or os.path.join(here, "lerp_kernels.json")
    bw = copy_bandwidth("cuda")
    res: dict[str, Any] = {**run_meta("PYTHONPATH=. python3 benchmarks/lerp_kernels.py"),
                           "copy_bandwidth_TBps": bw / 1e12, "cases": {}}
    wanted = {"case1", "case2", "case3", "case4", "case3-f16", "case4-bf16"}
    for case in [c for c in REFERENCE + EXTRA if c.name in wanted]:
        res["cases"][case.name] = row = measure(case, bw)
        print(f"{case.name}: floor {row['floor_fwd_bwd_us']:.1f} µs, torch {row['torch']['total']:.1f}, "
              + ", ".join(f"{k} {row[k]['total']:.1f}" for k in VARIANTS), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
