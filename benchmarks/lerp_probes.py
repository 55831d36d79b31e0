"""Probes behind docs/kernels.md's case-3, forward and host-time analyses (CUDA).

``l2``: does the backward find the forward's inputs in L2? Per-kernel times of forward +
``autograd.grad`` with the backward right after the forward ("adjacent") and with a 256 MiB
memset between them ("flushed between"), for cases 1, 3 and 4 and three configs; and PyTorch's
``g * y`` right after ``-y`` (the same main bytes as case 3's forward and backward, warm).

``forward``: the forward kernel alone against PyTorch's under load and store hints, tiles and
whole-tile masks, for the flat cases.

``inplace``: ``torch.ops.flowexec.lerp_`` against ATen's ``lerp_`` (kernel time and wall) on
Adam/EMA-like shapes and weights, and a graph-mode step of two in-place lerps with the default
rewrite and with ``fuse_lerp="all"``: what ``passes/fuse_lerp.py``'s default rests on.

    PYTHONPATH=. python3 benchmarks/lerp_probes.py l2 --out benchmarks/results/probes/lerp_l2.json
    PYTHONPATH=. python3 benchmarks/lerp_probes.py forward --out benchmarks/results/probes/lerp_forward.json
    PYTHONPATH=. python3 benchmarks/lerp_probes.py inplace --out benchmarks/results/probes/lerp_inplace.json

``fwdwall``: the forward alone (cases 4, 1, the float weight, 4 bfloat16), PyTorch's against ours
with and without the L1-bypassing loads and the streaming store, in five alternating rounds, three
ways: wall (``do_bench``), CUDA-graph replay (no host launch) and kernel time; and the kernel time
of forward + backward (does the forward's variant change the backward after it?).
``hostprof``: profiler traces of case 1's forward + ``autograd.grad`` (PyTorch, ours, ``t * 2``),
autograd's multithreading on and off, written beside the JSON.

``atomics``: case 3 and case 1 with the reduced gradients added into zeroed outputs by atomics in
the backward kernel (no final pass), against the shipped partial sums + final pass, per kernel.

``contention``: case 3's backward kernel alone, atomic against partial sums, for each subset of
gradients (which gradient's atomic adds cost time: dx's, whose 16 floats share one cache line).

``persistent``: a persistent flat forward (``num_SMs * k`` programs striding over blocks, Triton's
software pipelining over ``num_stages``) against PyTorch's forward and ours, per kernel, for 45
blocks/programs/stages/warps settings; the question was whether a forward can beat PyTorch's
vectorized kernel on the flat cases (it did not: ``probes/lerp_flat_forward_persistent_852d96f.json``).

    PYTHONPATH=. python3 benchmarks/lerp_probes.py persistent --out benchmarks/results/probes/lerp_flat_forward_persistent.json

``hosttime``: where the host time of case 1's and case 3's forward + ``autograd.grad`` goes,
from timestamps: Python's around the forward and the ``autograd.grad`` call, and the native
path's own (forward in C++, the backward node's entry, launch and exit, on the engine's worker
thread), in do_bench's setting (256 MiB memset before each call, events around it) and with the
device idle (a synchronize after each call). PyTorch, the floor ops and flowexec with its
backward launch, all launches, or direct allocations left out, in five alternating rounds.

    PYTHONPATH=. python3 benchmarks/lerp_probes.py hosttime --out benchmarks/results/probes/lerp_hosttime.json

``alternation``: why calls measure slower in ``ops.py``'s call-by-call alternation than in
do_bench's run of one function: event and host times of each implementation alone, all four
alternating, four copies of one alternating, and pairs (cases 1 and 3).

    PYTHONPATH=. python3 benchmarks/lerp_probes.py alternation --out benchmarks/results/probes/lerp_alternation.json

``tma``: the case-4 forward (and its bfloat16 variant), PyTorch's and ours against TMA-descriptor
kernels (tile or persistent) and inline-PTX 16-byte loads with the ``L2::256B`` prefetch-size hint.

    PYTHONPATH=. python3 benchmarks/lerp_probes.py tma --out benchmarks/results/probes/lerp_tma.json

``hints``: the fastest ``tma`` load (``L1::no_allocate``) against L1 and L2 hints and ``tl.load``'s
cache modifiers and eviction policies in the same kernel, each followed by a kernel that reads the
three operands again (what the backward finds in L2 after such a forward).

    PYTHONPATH=. python3 benchmarks/lerp_probes.py hints --out benchmarks/results/probes/lerp_hints.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lerp_kernels import per_kernel  # noqa: E402
from ops import EXTRA, REFERENCE, alternating_orders, calls, make_inputs, run_meta  # noqa: E402

L = importlib.import_module("flowexec.kernels.lerp")
CASES = {c.name: c for c in REFERENCE + EXTRA}


def _keep_correct(fns: dict[str, Any], out: torch.Tensor, ref: torch.Tensor) -> dict[str, dict[str, list]]:
    """Run each variant once into ``out`` (filled with NaN first); one that fails to compile or
    computes something else than ``ref`` leaves ``fns`` and is recorded with its error."""
    row: dict[str, dict[str, list]] = {}
    for vn, fn in list(fns.items()):
        try:
            out.fill_(float("nan"))
            torch.testing.assert_close(fn(), ref)
        except Exception as e:
            row[vn] = {"error": [f"{type(e).__name__}: {str(e)[-600:]}"]}
            del fns[vn]
    return row


def probe_l2() -> dict[str, Any]:
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    res: dict[str, Any] = {}
    for name in ("case1", "case3", "case4"):
        x, y, w, go = make_inputs(CASES[name], "cuda")
        ins = [t for t in (x, y, w) if isinstance(t, torch.Tensor)]
        for vn, ch in {"shipped": {}, "no .cs": {"fwd_stream_store": False}, "reverse": {"bwd_reverse": True}}.items():
            with L.configured(**ch):
                def adjacent() -> Any:
                    return torch.autograd.grad(L.lerp(x, y, w), ins, go)

                def flushed() -> Any:
                    out = L.lerp(x, y, w)
                    flush.zero_()  # per_kernel leaves this fill kernel out of the times
                    return torch.autograd.grad(out, ins, go)

                res[f"{name} {vn}"] = {"adjacent": per_kernel(adjacent), "flushed between": per_kernel(flushed)}
            print(name, vn, res[f"{name} {vn}"], flush=True)
        yd = y.detach()

        def warm_gy() -> Any:
            torch.neg(yd)
            return go * yd

        res[f"{name} neg-then-gy"] = per_kernel(warm_gy)
    return res


FORWARD_VARIANTS: dict[str, dict[str, Any]] = {
    "shipped": {}, "no even tiles": {"even_tiles": False}, "tile1024": {"fwd_tile": {2: 2048, 4: 1024, 8: 512}},
    "no .cs store": {"fwd_stream_store": False},
}


def probe_forward() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name in ("case4", "case4-bf16", "float-weight", "case1"):
        x, y, w, _ = make_inputs(CASES[name], "cuda")
        xd, yd = x.detach(), y.detach()
        wd = w.detach() if isinstance(w, torch.Tensor) else w
        row = res[name] = {"torch": per_kernel(lambda: torch.lerp(xd, yd, wd))["total"]}
        for vn, ch in FORWARD_VARIANTS.items():
            with L.configured(**ch):
                row[vn] = per_kernel(lambda: L.lerp(xd, yd, wd))["total"]
        row["torch again"] = per_kernel(lambda: torch.lerp(xd, yd, wd))["total"]
        print(name, row, flush=True)
    return res


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


def probe_inplace() -> dict[str, Any]:
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


def probe_persistent() -> dict[str, Any]:
    import itertools

    import triton
    import triton.language as tl

    @triton.jit
    def fwd_persistent(x_ptr, y_ptr, w_ptr, o_ptr, w_s, N, W_MODE: tl.constexpr, BLOCK: tl.constexpr,
                       STAGES: tl.constexpr):
        # W_MODE 0: full weight, 1: a one-element tensor, 2: the float w_s.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        if W_MODE == 1:
            wsc = tl.load(w_ptr).to(tl.float32)
        else:
            wsc = w_s
        for b in tl.range(pid, N // BLOCK, nprog, num_stages=STAGES):
            offs = b * BLOCK + tl.arange(0, BLOCK)
            xv = tl.load(x_ptr + offs).to(tl.float32)
            yv = tl.load(y_ptr + offs).to(tl.float32)
            wv = tl.load(w_ptr + offs).to(tl.float32) if W_MODE == 0 else wsc
            d = yv - xv
            r = tl.where(tl.abs(wv) < 0.5, xv + wv * d, yv - d * (1.0 - wv))
            tl.store(o_ptr + offs, r.to(o_ptr.dtype.element_ty), cache_modifier=".cs")

    res: dict[str, Any] = {}
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ("case4", "float-weight", "case1"):
        x, y, w, _ = make_inputs(CASES[name], "cuda")
        xd, yd = x.detach(), y.detach()
        wd = w.detach() if isinstance(w, torch.Tensor) else w
        mode = 2 if not isinstance(wd, torch.Tensor) else (1 if wd.numel() == 1 else 0)
        wt = wd if isinstance(wd, torch.Tensor) else xd
        ws = float(wd) if mode == 2 else 0.0
        o, n = torch.empty_like(xd), xd.numel()
        ref = torch.lerp(xd, yd, wd)
        settings = [(b, k, s, nw) for b, k, s, nw in itertools.product((1024, 2048, 4096), (1, 2, 4), (1, 2, 3), (4, 8))
                    if n % b == 0 and not (b == 1024 and nw == 8)]
        row: dict[str, list[float]] = {}
        res[name] = row
        for rnd in range(2):  # two alternating rounds
            row.setdefault("torch", []).append(per_kernel(lambda: torch.lerp(xd, yd, wd))["total"])
            row.setdefault("shipped", []).append(per_kernel(lambda: L.lerp(xd, yd, wd))["total"])
            for b, k, s, nw in settings:
                grid = (min(nsm * k, n // b),)

                def fn(b: int = b, s: int = s, nw: int = nw, grid: tuple = grid) -> None:
                    fwd_persistent[grid](xd, yd, wt, o, ws, n, mode, b, s, num_warps=nw)
                if rnd == 0:
                    fn()
                    torch.testing.assert_close(o, ref)
                row.setdefault(f"b{b} k{k} s{s} w{nw}", []).append(per_kernel(fn)["total"])
        print(name, sorted((sum(v) / 2, k) for k, v in row.items())[:6], flush=True)
    return res


# At e8706d8 (probes/lerp_forward_wall_l1bypass_e8706d8.json) the variants were the shipped
# forward with the since-reverted fwd_l1_bypass on, and with it off.
# At 44b1a46 the variants were the shipped forward and "no .cs store" ({"fwd_stream_store": False}),
# for cases 4, 1, the float weight and 4 in bfloat16. Since then: the operands a three-full-operand
# forward loads evict-first (``flat3_evict``), which only such calls take.
FWD_WALL_VARIANTS: dict[str, dict[str, Any]] = {
    "shipped": {}, "evict-first x, y, w": {"flat3_evict": 7}, "evict-first x, y": {"flat3_evict": 3},
    "evict-first w": {"flat3_evict": 4}, "evict-first x": {"flat3_evict": 1}}
FWD_WALL_CASES = ("case4", "case4-bf16")


def probe_fwdwall() -> dict[str, Any]:
    """The forward alone, PyTorch's against ours and variants, three ways in alternating rounds:
    wall (``do_bench``: L2 flushed, events around the call), the same call replayed from a CUDA
    graph (no host launch in the figure) and the profiler's kernel time."""
    from ops import bench

    res: dict[str, Any] = {}
    for name in FWD_WALL_CASES:
        x, y, w, go = make_inputs(CASES[name], "cuda")
        xd, yd = x.detach(), y.detach()
        wd = w.detach() if isinstance(w, torch.Tensor) else w
        ins = [t for t in (x, y, w) if isinstance(t, torch.Tensor) and t.requires_grad]
        row: dict[str, dict[str, list[float]]] = {}
        res[name] = row
        for order in alternating_orders(["torch", *FWD_WALL_VARIANTS], 5):
            for vn in order:
                ch = {} if vn == "torch" else FWD_WALL_VARIANTS[vn]
                fn = (lambda: torch.lerp(xd, yd, wd)) if vn == "torch" else (lambda: L.lerp(xd, yd, wd))
                with L.configured(**ch):
                    for _ in range(3):
                        fn()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        fn()
                    r = row.setdefault(vn, {})
                    r.setdefault("wall", []).append(bench(fn))
                    r.setdefault("graph replay", []).append(bench(g.replay))
                    r.setdefault("kernel", []).append(per_kernel(fn)["total"])
                    # forward + backward by kernel time: does the forward's variant change the backward?
                    f = torch.lerp if vn == "torch" else L.lerp
                    r.setdefault("kernels fwd+bwd", []).append(
                        per_kernel(lambda: torch.autograd.grad(f(x, y, w), ins, go))["total"])
                    del g
        med = {vn: {k: sorted(v)[2] for k, v in r.items()} for vn, r in row.items()}
        res[name + " medians"] = med
        print(name, med, flush=True)
    return res


def probe_hostprof(out_dir: str) -> dict[str, Any]:
    """Where the host time of case 1's forward + ``autograd.grad`` goes, by thread: profiler traces
    (CPU and CUDA activity, autograd's multithreading on and off) of 30 calls each of PyTorch,
    flowexec and the floor op ``t * 2``, written next to the JSON; the JSON keeps per-thread sums
    of the top-level CPU events and the most expensive events by name."""
    from torch.profiler import ProfilerActivity, profile

    x, y, w, go = make_inputs(CASES["case1"], "cuda")
    t = go.detach().clone().requires_grad_()
    fns = {"torch": lambda: torch.autograd.grad(torch.lerp(x, y, w), (x, y, w), go),
           "flowexec": lambda: torch.autograd.grad(L.lerp(x, y, w), (x, y, w), go),
           "floor": lambda: torch.autograd.grad(t * 2, (t,), go)}
    res: dict[str, Any] = {}
    for mt in (True, False):
        for name, fn in fns.items():
            with torch.autograd.set_multithreading_enabled(mt):
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(30):
                        fn()
                    torch.cuda.synchronize()
            key = f"{name} {'mt' if mt else 'st'}"
            path = os.path.join(out_dir, f"hostprof_{name}_{'mt' if mt else 'st'}.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
            by_name: dict[str, float] = {}
            for e in ev:
                if e.get("cat") in ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver"):
                    by_name[f"{e.get('tid')}|{e.get('cat')}|{e['name'][:60]}"] = by_name.get(
                        f"{e.get('tid')}|{e.get('cat')}|{e['name'][:60]}", 0.0) + e["dur"] / 30
            res[key] = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:40])
            print(key, list(res[key].items())[:12], flush=True)
    return res


def atomics_variant(x: torch.Tensor, y: torch.Tensor, w: Any, go: torch.Tensor,
                    needs: tuple[bool, bool, bool] | None = None) -> dict[str, Any]:
    """Backward launches of the shipped plan for every gradient: ``shipped()`` (partials + final
    pass) and ``atomic(zero)`` (reduced gradients added into zeroed outputs with atomics; ``zero``
    False leaves the zeroing out, as if the forward had done it). Returns the callables and the
    output tensors each writes."""
    xd, yd = x.detach(), y.detach()
    wd = w.detach() if isinstance(w, torch.Tensor) else None
    wv = 0.0 if isinstance(w, torch.Tensor) else float(w)
    plan = L._plan(xd, yd, wd)
    needs = needs or (True, True, wd is not None)
    bw = plan.backward_plan(needs)
    xs, ys, wt = L._operands(xd, yd, wd)
    g = go.contiguous()
    outs = {k: tuple(torch.empty_like(t) if need else g for t, need in zip((xs, ys, wt), needs))
            for k in ("shipped", "atomic")}
    part = g.new_empty(max(bw.part_numel, 1), dtype=plan.part_dtype)
    hi, lo = L._split_weight(wv, plan.acc_f64)

    bwa = plan.backward_plan(needs, atomic=True)

    def main(b: Any, o: tuple) -> None:  # the backward's main kernel into outputs o
        b.main(b.main_args(g, xs, ys, wt, *o, part, g, hi, lo), True)

    def shipped_main() -> None:
        main(bw, outs["shipped"])

    def shipped() -> None:
        shipped_main()
        if bw.final is not None:
            bw.final(bw.final_args(part, *outs["shipped"]), True)

    red = [o for o, gr in zip(outs["atomic"], bw.grads) if gr is not None and gr.red]

    def atomic(zero: bool = True) -> None:
        if zero:
            for o in red:
                o.zero_()
        main(bwa, outs["atomic"])
    return {"shipped": shipped, "shipped_main": shipped_main, "atomic": atomic, "outs": outs, "red": red, "needs": needs}


def probe_atomics() -> dict[str, Any]:
    """Case 3 (and case 1) without the final pass: reduced gradients added into zeroed outputs by
    atomics in the backward kernel, against the shipped partial sums + final pass; per kernel, in
    two alternating rounds, with the forward before each (its kernel is part of the fwd+bwd sum)."""
    res: dict[str, Any] = {}
    for name in ("case3", "case1"):
        x, y, w, go = make_inputs(CASES[name], "cuda")
        v = atomics_variant(x, y, w, go)
        ins = [t for t in (x, y, w) if isinstance(t, torch.Tensor)]
        xd, yd = x.detach(), y.detach()
        wd = w.detach() if isinstance(w, torch.Tensor) else w
        v["shipped"]()
        v["atomic"]()
        torch.cuda.synchronize()
        row: dict[str, Any] = {"max_rel_diff": max(
            ((a - b).abs().max() / b.abs().max()).item()
            for a, b, need in zip(v["outs"]["atomic"], v["outs"]["shipped"], v["needs"]) if need)}
        for rnd in range(2):
            row[f"shipped {rnd}"] = per_kernel(lambda: (L.lerp(xd, yd, wd), v["shipped"]()))
            row[f"atomic, zeroing kernels {rnd}"] = per_kernel(lambda: (L.lerp(xd, yd, wd), v["atomic"](True)))
            row[f"atomic, zeroed elsewhere {rnd}"] = per_kernel(lambda: (L.lerp(xd, yd, wd), v["atomic"](False)))
            # As shipped: the forward zeroes the buffer, the backward adds into views of it.
            row[f"as shipped {rnd}"] = per_kernel(lambda: torch.autograd.grad(L.lerp(x, y, w), ins, go))
            with L.configured(atomic_max=0):
                row[f"as shipped, partial sums {rnd}"] = per_kernel(lambda: torch.autograd.grad(L.lerp(x, y, w), ins, go))
        res[name] = row
        print(name, {k: (r["total"] if isinstance(r, dict) else r) for k, r in row.items()}, flush=True)
    return res


def probe_contention() -> dict[str, Any]:
    """Case 3's backward kernel alone, atomic sums against partial sums (the main kernel only; no
    zeroing, no final pass), for gradient subsets: which gradient's atomics cost time? dx is 16
    floats on one cache line that every program adds one value to (528 adds); dw is 732 floats
    that each program adds a 244-wide row to (176 adds per element). Three alternating rounds."""
    x, y, w, go = make_inputs(CASES["case3"], "cuda")
    subsets = {"dx dy dw": (True, True, True), "dx dy": (True, True, False), "dy dw": (False, True, True),
               "dx": (True, False, False), "dw": (False, False, True)}
    variants = {k: atomics_variant(x, y, w, go, needs) for k, needs in subsets.items()}
    res: dict[str, Any] = {}
    for rnd in range(3):
        for k, v in variants.items():
            res[f"{k}: partial sums {rnd}"] = per_kernel(lambda: v["shipped_main"]())
            res[f"{k}: atomic {rnd}"] = per_kernel(lambda: v["atomic"](False))
    print({k: r["total"] for k, r in res.items()}, flush=True)
    return res


# flowexec variants of the hosttime probe: (native launches left out, allocations via the dispatcher)
HOSTTIME_FX = {"flowexec": (0, False), "flowexec, no backward launch": (2, False),
               "flowexec, no launches": (3, False), "flowexec, dispatcher allocations": (0, True)}
STAMPS = tuple(f"{d} {s}" for d in ("fwd", "bwd") for s in ("in", "planned", "views", "allocs", "launched", "out"))


def probe_hosttime(iters: int = 300, rounds: int = 5) -> dict[str, Any]:
    """Per call of forward + ``autograd.grad``: intervals between host timestamps (µs, medians over
    all calls of all rounds) and the event-timed GPU span as do_bench reports it."""
    import time

    nat = importlib.import_module("flowexec.kernels._native")
    mod = nat.load(cuda=True)
    if mod is None:
        raise SystemExit("hosttime needs the native extension")
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")  # do_bench's 256 MiB
    ns = time.monotonic_ns  # CLOCK_MONOTONIC, the native stamps' clock
    res: dict[str, Any] = {}
    for name in ("case1", "case3"):
        case = CASES[name]
        impls = {"torch": "torch", "floor": "floor", "floor3": "floor3", **{k: "flowexec" for k in HOSTTIME_FX}}
        fns = {k: calls(case, impl, "cuda") for k, impl in impls.items()}
        got: dict[str, dict[str, list[float]]] = {}
        for order in alternating_orders(fns, rounds):
            for mode in ("do_bench", "idle"):
                for k in order:
                    fwd, _, ins, go = fns[k]
                    skip, disp = HOSTTIME_FX.get(k, (0, False))
                    mod.set_skip_launches(skip)
                    mod.set_dispatch_alloc(disp)
                    mod.set_stamping(k in HOSTTIME_FX)
                    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
                    rows = []
                    for i in range(iters + 20):
                        if mode == "do_bench":
                            flush.zero_()
                        if i >= 20:
                            ev[i - 20][0].record()
                        t0 = ns()
                        out = fwd()
                        t1 = ns()
                        gr = torch.autograd.grad(out, ins, go)
                        t2 = ns()
                        if i >= 20:
                            ev[i - 20][1].record()
                        st = mod.stamps() if k in HOSTTIME_FX else None
                        del out, gr
                        if mode == "idle":
                            torch.cuda.synchronize()
                        if i >= 20:
                            rows.append((t0, t1, t2, st))
                    torch.cuda.synchronize()
                    mod.set_stamping(False)
                    mod.set_skip_launches(0)
                    mod.set_dispatch_alloc(False)
                    r = got.setdefault(f"{k} | {mode}", {})
                    for (t0, t1, t2, st), (a, b) in zip(rows, ev):
                        iv = {"forward": t1 - t0, "autograd.grad": t2 - t1, "both": t2 - t0}
                        if st is not None:
                            s = dict(zip(STAMPS, st))
                            iv["fwd: python before C++"] = s["fwd in"] - t0
                            iv["grad: to the node"] = s["bwd in"] - t1
                            for d in ("fwd", "bwd"):
                                for p0, p1 in zip(STAMPS[:5], STAMPS[1:6]):
                                    iv[f"{d}: {p1[4:]}"] = s[f"{d} {p1[4:]}"] - s[f"{d} {p0[4:]}"]
                            iv["fwd: python after C++"] = t1 - s["fwd out"]
                            iv["grad: after the node"] = t2 - s["bwd out"]
                        for key, v in iv.items():
                            r.setdefault(key, []).append(v / 1e3)
                        r.setdefault("events (do_bench's figure)", []).append(a.elapsed_time(b) * 1e3)
        med = {k: {kk: round(sorted(v)[len(v) // 2], 2) for kk, v in r.items()} for k, r in got.items()}
        res[name] = med
        for k, m in med.items():
            print(name, k, m, flush=True)
    return res


def probe_alternation(turns: int = 2000, rounds: int = 3) -> dict[str, Any]:
    """Why a call measures slower when other implementations' calls come between (``ops.py``'s
    calls alternating) than in do_bench's run of one function: for cases 1 and 3, medians (µs) of
    the event-timed span and of the host time of each call, (a) by do_bench, one implementation
    after another in ``rounds`` alternating rounds; (b) all four alternating call by call; (c) four
    copies of one implementation (inputs of their own) alternating: the procedure without the
    mixing; (d) pairs alternating; (e) host time per call of a plain loop (no flush, no events),
    one implementation's calls on the same inputs against four copies' in turn."""
    import statistics
    import time

    from ops import WALL_IMPLS, bench, bench_alternating

    res: dict[str, Any] = {}
    for name in ("case1", "case3"):
        case = CASES[name]
        r: dict[str, Any] = {}
        made = {i: calls(case, i, "cuda")[1] for i in WALL_IMPLS}
        got: dict[str, list[float]] = {}
        for order in alternating_orders(WALL_IMPLS, rounds):
            for i in order:
                got.setdefault(i, []).append(bench(made[i]))
        r["do_bench rounds"] = {i: statistics.median(v) for i, v in got.items()}
        # host time of do_bench's loop, one function at a time (the same flush and events)
        for i in WALL_IMPLS:
            host: dict[str, list[float]] = {}
            ev = bench_alternating({i: made[i]}, turns, host=host)
            r.setdefault("one at a time", {})[i] = {"events": statistics.median(ev[i]),
                                                    "host": statistics.median(host[i])}
        groups = {"all four": {i: made[i] for i in WALL_IMPLS},
                  **{f"four copies of {i}": {f"{i}#{k}": calls(case, i, "cuda")[1] for k in range(4)} for i in WALL_IMPLS},
                  "torch, flowexec": {i: made[i] for i in ("torch", "flowexec")},
                  "flowexec, floor3": {i: made[i] for i in ("flowexec", "floor3")}}
        for g, fns in groups.items():
            host = {}
            ev = bench_alternating(fns, turns, host=host)
            r[g] = {k: {"events": statistics.median(v), "host": statistics.median(host[k])} for k, v in ev.items()}
        # the same without do_bench's flush and events: host time per call, synchronized at the end
        for i in WALL_IMPLS:
            copies = [calls(case, i, "cuda")[1] for _ in range(4)]
            for label, seq in ((f"host loop, {i} alone", [made[i]] * 4), (f"host loop, four copies of {i}", copies)):
                times = []
                for rep in range(turns // 4 + 20):
                    for fn in seq:
                        t0 = time.perf_counter()
                        fn()
                        if rep >= 20:
                            times.append((time.perf_counter() - t0) * 1e6)
                torch.cuda.synchronize()
                r[label] = statistics.median(times)
        res[name] = r
        print(name, json.dumps(r, indent=None), flush=True)
    return res


def _asm_kernels() -> tuple[Any, Any, Any]:
    """The flat forward three ways: operands through TMA descriptors; through inline-PTX 16-byte
    loads, whose cache hints (``L1::no_allocate``, ``L2::256B``, L2 cache policies) ``tl.load``
    does not emit; and through ``tl.load`` with a cache modifier and eviction policy."""
    import triton
    import triton.language as tl

    @triton.jit
    def fwd_tma(xd, yd, wd, od, R, BM: tl.constexpr, STAGES: tl.constexpr, PERSIST: tl.constexpr):
        pid = tl.program_id(0)
        step = tl.num_programs(0) if PERSIST else R // BM
        for b in tl.range(pid, R // BM, step, num_stages=STAGES):
            xr = xd.load([b * BM, 0])
            xv = xr.to(tl.float32)
            yv = yd.load([b * BM, 0]).to(tl.float32)
            wv = wd.load([b * BM, 0]).to(tl.float32)
            d = yv - xv
            r = tl.where(tl.abs(wv) < 0.5, xv + wv * d, yv - d * (1.0 - wv))
            od.store([b * BM, 0], r.to(xr.dtype))

    @triton.jit
    def _ld4(p, LD: tl.constexpr):
        return tl.inline_asm_elementwise(LD, "=f,=f,=f,=f,l", [p],
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                         is_pure=True, pack=1)

    @triton.jit
    def _one(x, y, w):
        d = y - x
        return tl.where(tl.abs(w) < 0.5, x + w * d, y - d * (1.0 - w))

    @triton.jit
    def _bits(v):
        return v.to(tl.int32, bitcast=True)

    @triton.jit
    def fwd_ptx(x_ptr, y_ptr, w_ptr, o_ptr, LD: tl.constexpr, ST: tl.constexpr, BLOCK: tl.constexpr):
        # float32 only: one pointer per 4 elements, each thread's loads and stores 16 bytes wide.
        # The stored values go in as int32 bits: Triton 3.6 refuses a pointer beside floats there.
        q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK // 4) * 4
        x0, x1, x2, x3 = _ld4(x_ptr + q, LD)
        y0, y1, y2, y3 = _ld4(y_ptr + q, LD)
        w0, w1, w2, w3 = _ld4(w_ptr + q, LD)
        tl.inline_asm_elementwise(ST, "=r,l,r,r,r,r",
                                  [o_ptr + q, _bits(_one(x0, y0, w0)), _bits(_one(x1, y1, w1)),
                                   _bits(_one(x2, y2, w2)), _bits(_one(x3, y3, w3))],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def fwd_tl(x_ptr, y_ptr, w_ptr, o_ptr, CM: tl.constexpr, EV: tl.constexpr, BLOCK: tl.constexpr):
        # The same with tl.load: Triton's cache modifiers and eviction policies, for comparison.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        xv = tl.load(x_ptr + offs, cache_modifier=CM, eviction_policy=EV)
        yv = tl.load(y_ptr + offs, cache_modifier=CM, eviction_policy=EV)
        wv = tl.load(w_ptr + offs, cache_modifier=CM, eviction_policy=EV)
        tl.store(o_ptr + offs, _one(xv, yv, wv))

    return fwd_tma, fwd_ptx, fwd_tl


TMA_SETTINGS = [(bm, 0, 1, nw) for bm in (8, 16, 32) for nw in (4, 8)] + [(16, 1, s, 4) for s in (2, 3)]
# (load, store, block); each asm string is one constant (Triton 3.6 does not concatenate constexpr
# strings inside a kernel).
PTX_SETTINGS = [(ld, st, b) for ld, st in (("ld.global.v4.f32", "st.global.v4.b32"),
                                           ("ld.global.nc.v4.f32", "st.global.v4.b32"),
                                           ("ld.global.L2::128B.v4.f32", "st.global.v4.b32"),
                                           ("ld.global.L2::256B.v4.f32", "st.global.v4.b32"),
                                           ("ld.global.nc.L2::256B.v4.f32", "st.global.v4.b32"),
                                           ("ld.global.L1::no_allocate.L2::256B.v4.f32", "st.global.v4.b32"),
                                           ("ld.global.L2::256B.v4.f32", "st.global.cs.v4.b32"))
                for b in (1024, 2048)]


def probe_tma() -> dict[str, Any]:
    """The case-4 forward (three full float32 operands), PyTorch's against ours and against two
    kinds of kernel this project had not tried: TMA descriptor loads and stores (one tile a program,
    or persistent and software-pipelined), and 16-byte PTX loads with the ``L2::256B`` prefetch-size
    hint. Five alternating rounds, wall (``do_bench``) and the profiler's kernel time."""
    from ops import bench
    from triton.tools.tensor_descriptor import TensorDescriptor

    fwd_tma, fwd_ptx, _ = _asm_kernels()
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    res: dict[str, Any] = {}
    for name in ("case4", "case4-bf16"):
        x, y, w, _ = make_inputs(CASES[name], "cuda")
        xd, yd, wd = x.detach(), y.detach(), w.detach()
        n = xd.numel()
        o = torch.empty_like(xd)
        ref = torch.lerp(xd, yd, wd)
        fns: dict[str, Any] = {"torch": lambda: torch.lerp(xd, yd, wd), "shipped": lambda: L.lerp(xd, yd, wd)}
        v2 = [t.view(n // 256, 256) for t in (xd, yd, wd, o)]
        for bm, persist, stages, nw in TMA_SETTINGS:
            descs = [TensorDescriptor.from_tensor(t, [bm, 256]) for t in v2]
            grid = (min(2 * nsm, n // 256 // bm) if persist else n // 256 // bm,)

            def tma(descs: list = descs, bm: int = bm, persist: int = persist, stages: int = stages, nw: int = nw,
                    grid: tuple = grid) -> Any:
                fwd_tma[grid](*descs, n // 256, bm, stages, persist, num_warps=nw)
                return o
            fns[f"tma {bm}x256 {'persistent s' + str(stages) if persist else 'tile'} w{nw}"] = tma
        if xd.dtype == torch.float32:
            for ld, st, b in PTX_SETTINGS:
                def ptx(lda: str = ld + " {$0, $1, $2, $3}, [$4];", b: int = b,
                        sta: str = st + " [$1], {$2, $3, $4, $5}; mov.u32 $0, 0;") -> Any:
                    fwd_ptx[(n // b,)](xd, yd, wd, o, lda, sta, b, num_warps=4)
                    return o
                fns[f"ptx {ld[10:-7] or 'plain'} / {st[10:-7] or 'plain'} b{b}"] = ptx
        row = res[name] = _keep_correct(fns, o, ref)
        for order in alternating_orders(fns, 5):
            for vn in order:
                r = row.setdefault(vn, {})
                r.setdefault("wall", []).append(bench(fns[vn]))
                r.setdefault("kernel", []).append(per_kernel(fns[vn])["total"])
        med = {vn: {k: sorted(v)[2] for k, v in r.items() if k != "error"} for vn, r in row.items() if "error" not in r}
        res[name + " medians"] = med
        print(name, json.dumps(med, indent=0), {k: v for k, v in row.items() if "error" in v}, flush=True)
    return res


def _policy_load(l2: str) -> str:
    """A 16-byte load that skips L1 and gives L2 an explicit eviction priority (a cache policy)."""
    return ("{ .reg .b64 pol; createpolicy.fractional.L2::" + l2 + ".b64 pol, 1.0; "
            "ld.global.L1::no_allocate.L2::cache_hint.v4.f32 {$0, $1, $2, $3}, [$4], pol; }")


# label -> the load's inline PTX. An evict_last policy is left out: its lines outlive the L2 flush
# between repetitions and make whatever runs after it read fast (it was in the e8706d8 run).
HINT_LOADS = {
    "plain": "ld.global.v4.f32 {$0, $1, $2, $3}, [$4];",
    "L1::no_allocate": "ld.global.L1::no_allocate.v4.f32 {$0, $1, $2, $3}, [$4];",
    "L1::evict_first": "ld.global.L1::evict_first.v4.f32 {$0, $1, $2, $3}, [$4];",
    "L1::no_allocate + L2 evict_normal": _policy_load("evict_normal"),
    "L1::no_allocate + L2 evict_unchanged": _policy_load("evict_unchanged"),
}
HINT_TL = (("", ""), (".cg", ""), ("", "evict_first"))


def probe_hints() -> dict[str, Any]:
    """Which load makes the case-4 forward faster, and what it leaves in L2 for the backward.

    Each variant's forward kernel (PTX loads with L1 and L2 hints, ``tl.load``'s cache modifiers and
    eviction policies, PyTorch's and ours), and the kernel after it: ``torch.addcmul`` reading the
    same three operands again (fast when they stayed in L2, as the backward reads them). Five
    alternating rounds, the profiler's kernel times. Earlier forms of this probe:
    ``probes/lerp_hints_7cbc119.json`` (forward only, with L2 prefetch-size hints and 512-element
    blocks) and ``probes/lerp_hints_reread_e8706d8.json`` (with an evict_last policy, and
    "shipped" the since-reverted ``fwd_l1_bypass`` forward, "shipped no L1 bypass" the shipped one).
    """
    _, fwd_ptx, fwd_tl = _asm_kernels()
    x, y, w, _ = make_inputs(CASES["case4"], "cuda")
    xd, yd, wd = x.detach(), y.detach(), w.detach()
    n = xd.numel()
    o = torch.empty_like(xd)
    st = "st.global.v4.b32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0;"
    fns: dict[str, Any] = {"torch": lambda: torch.lerp(xd, yd, wd), "shipped": lambda: L.lerp(xd, yd, wd)}
    for label, ld in HINT_LOADS.items():
        def ptx(ld: str = ld) -> Any:
            fwd_ptx[(n // 1024,)](xd, yd, wd, o, ld, st, 1024, num_warps=4)
            return o
        fns[f"ptx {label}"] = ptx
    for cm, ev in HINT_TL:
        def tlv(cm: str = cm, ev: str = ev) -> Any:
            fwd_tl[(n // 1024,)](xd, yd, wd, o, cm, ev, 1024, num_warps=4)
            return o
        fns[f"tl.load {cm or 'plain'} {ev or '-'}"] = tlv
    row = _keep_correct(fns, o, torch.lerp(xd, yd, wd))
    for order in alternating_orders(fns, 5):
        for vn in order:
            k = per_kernel(lambda: (fns[vn](), torch.addcmul(xd, yd, wd)))
            times = [v for key, v in k.items() if key != "total"]
            r = row.setdefault(vn, {})
            r.setdefault("kernel", []).append(times[0])
            r.setdefault("re-read after it", []).append(times[1])
    med = {vn: {k: sorted(v)[2] for k, v in r.items()} for vn, r in row.items() if "error" not in r}
    print(json.dumps(med, indent=0), {k: v for k, v in row.items() if "error" in v}, flush=True)
    return {"case4": row, "case4 medians": med}


def probe_levels(calls: int = 24) -> dict[str, Any]:
    """Where the case-4 forward's two wall levels come from (do_bench medians sit ~0.55 µs apart,
    each call on one level for all its samples). Per do_bench call: the median and spread of its
    samples, and what might set the level: the output's address (PyTorch's and ours allocate it;
    ``out=`` variants write into a buffer at chosen offsets) and the SM clock where readable."""
    from ops import bench_samples

    x, y, w, _ = make_inputs(CASES["case4"], "cuda")
    xd, yd, wd = x.detach(), y.detach(), w.detach()
    n = xd.numel()
    big = torch.empty(n + (4 << 20), device="cuda")
    pad = []
    rows: list[dict[str, Any]] = []
    clock = getattr(torch.cuda, "clock_rate", None)
    for i in range(calls):
        pad.append(torch.empty((i * 7919) % 65536 + 1, device="cuda"))  # moves the allocator's next block
        off = [0, 32, 1024, 4096, 65536, 1 << 20][i % 6]
        o = big[off:off + n]
        fns = {"torch": lambda: torch.lerp(xd, yd, wd), "flowexec": lambda: L.lerp(xd, yd, wd),
               "torch out=": lambda: torch.lerp(xd, yd, wd, out=o)}
        for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            addr = fns[name]().data_ptr()
            s = sorted(bench_samples(fns[name]))
            r = {"call": i, "impl": name, "out_addr_mod_2MiB": addr % (2 << 20), "out_offset_elems": off,
                 "median": s[len(s) // 2], "p10": s[len(s) // 10], "p90": s[9 * len(s) // 10], "n": len(s)}
            try:
                r["sm_clock_mhz"] = clock() if clock else None
            except Exception as e:  # pynvml missing: say so once per row, keep measuring
                r["sm_clock_mhz"] = f"unreadable: {type(e).__name__}"
            rows.append(r)
            print(r, flush=True)
    return {"case4": rows}


def probe_flushbuf(calls: int = 16, n: int = 1000) -> dict[str, Any]:
    """Does the flush buffer set the level? do_bench allocates its 256 MB flush buffer anew on
    every call; here do_bench's loop (flush, event, call, event) runs with a fresh buffer per call
    (as do_bench) and with one buffer kept for all calls, PyTorch's forward and ours alternating."""
    x, y, w, _ = make_inputs(CASES["case4"], "cuda")
    xd, yd, wd = x.detach(), y.detach(), w.detach()
    fns = {"torch": lambda: torch.lerp(xd, yd, wd), "flowexec": lambda: L.lerp(xd, yd, wd)}
    kept = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")

    def samples(fn: Any, cache: torch.Tensor) -> list[float]:
        for _ in range(5):
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        torch.cuda.synchronize()
        for s, e in ev:
            cache.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) * 1e3 for s, e in ev)

    rows: list[dict[str, Any]] = []
    for i in range(calls):
        for mode in ("fresh buffer", "kept buffer"):
            for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda") if mode == "fresh buffer" else kept
                s = samples(fns[name], cache)
                r = {"call": i, "mode": mode, "impl": name, "cache_addr_mod_64MiB": cache.data_ptr() % (64 << 20),
                     "median": s[n // 2], "p10": s[n // 10], "p90": s[9 * n // 10]}
                rows.append(r)
                print(r, flush=True)
                del cache
    return {"case4": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", choices=("l2", "forward", "inplace", "persistent", "fwdwall", "hostprof", "atomics", "contention",
                                          "hosttime", "alternation", "tma", "hints", "levels", "flushbuf"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/lerp_probes.py needs a CUDA device")
    res = {**run_meta(f"PYTHONPATH=. python3 benchmarks/lerp_probes.py {args.probe}"),
           "us": {"l2": probe_l2, "forward": probe_forward, "inplace": probe_inplace,
                  "persistent": probe_persistent, "fwdwall": probe_fwdwall, "atomics": probe_atomics, "contention": probe_contention,
                  "hosttime": probe_hosttime, "alternation": probe_alternation, "tma": probe_tma, "hints": probe_hints, "levels": probe_levels, "flushbuf": probe_flushbuf,
                  "hostprof": lambda: probe_hostprof(os.path.dirname(os.path.abspath(args.out)))}[args.probe]()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
