"""Where the host time of an eager lerp forward+backward goes, flowexec against PyTorch (CUDA).

Small tensors ([16, 1024], w [1]) so that every figure is host-bound: each is the time per call
of 3000 back-to-back calls followed by one synchronize.

    PYTHONPATH=. python3 benchmarks/lerp_host.py --out benchmarks/results/lerp_host.json

Figures: forward with grad-requiring inputs (``*_fwd_grad``), one forward launch with tensors
or raw pointers as arguments, the backward implementation alone, forward + ``autograd.grad``
(``*_fwd_grad3``: flowexec's native front door, measured in three rounds alternating with
PyTorch; ``python_fwd_grad3``: the Python path with the native one switched off) and
``autograd.grad`` alone on a retained graph (``*_grad3_only``). ``torch_mul_grad`` (``x * 2``
and its backward) is about the least any CUDA autograd op costs on the machine.

``split`` times the pieces against the floor op ``t * 2`` in five alternating rounds, with
autograd's multithreading on and off: the forwards alone; ``autograd.grad`` on retained graphs
for flowexec's gradients one set at a time (``x``, ``y``, ``w``, ``xy``, ``xyw``), for ``t * 2``
and for empty Python nodes returning one or three gradients (``noop1``, ``noop3``); and forward
+ ``autograd.grad``. With multithreading off every node runs on the calling thread, so the
difference between the two is the engine's hand-off to its CUDA worker thread and back.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
L = importlib.import_module("flowexec.kernels.lerp")


def loop_us(fn: Callable[[], Any], n: int = 3000, warm: int = 100) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def measure() -> dict[str, Any]:
    dev = "cuda"
    x = torch.randn(16, 1024, device=dev, requires_grad=True)
    y = torch.randn(16, 1024, device=dev, requires_grad=True)
    w = torch.rand(1, device=dev, requires_grad=True)
    go = torch.randn(16, 1024, device=dev)
    b: dict[str, Any] = {}
    b["fx_fwd_grad"] = loop_us(lambda: L.lerp(x, y, w))
    b["torch_fwd_grad"] = loop_us(lambda: torch.lerp(x, y, w))
    with torch.no_grad():
        p = L._plan(x, y, w)
        xd, yd, wd = x.detach(), y.detach(), w.detach()
        outd = torch.empty_like(xd)
        fargs = p.forward_args(xd, yd, wd, outd, 0.0, 0.0)
        b["fwd_launch_tensors"] = loop_us(lambda: p.fwd(fargs, True))
        ptrs = (xd.data_ptr(), yd.data_ptr(), wd.data_ptr(), outd.data_ptr())
        b["fwd_launch_ints"] = loop_us(lambda: p.fwd(fargs, True, ptrs))
        b["direct_active"] = p.fwd._direct is not None
        b["bwd_impl"] = loop_us(lambda: L._backward_impl(go, xd, yd, wd, 0.0, (True, True, True), p))
    rounds: dict[str, list[float]] = {"torch_fwd_grad3": [], "fx_fwd_grad3": []}
    for _ in range(3):
        rounds["torch_fwd_grad3"].append(loop_us(lambda: torch.autograd.grad(torch.lerp(x, y, w), (x, y, w), go)))
        rounds["fx_fwd_grad3"].append(loop_us(lambda: torch.autograd.grad(L.lerp(x, y, w), (x, y, w), go)))
    for k, v in rounds.items():
        b[k] = sorted(v)[1]
        b[k + "_rounds"] = v
    b["native_active"] = L.lerp(x, y, w).grad_fn.name() == "FlowexecLerpBackward"
    with importlib.import_module("flowexec.kernels._native").python_path():
        b["python_fwd_grad3"] = loop_us(lambda: torch.autograd.grad(L.lerp(x, y, w), (x, y, w), go))
    o = L.lerp(x, y, w)
    b["fx_grad3_only"] = loop_us(lambda: torch.autograd.grad(o, (x, y, w), go, retain_graph=True))
    o2 = torch.lerp(x, y, w)
    b["torch_grad3_only"] = loop_us(lambda: torch.autograd.grad(o2, (x, y, w), go, retain_graph=True))

    class Noop(torch.autograd.Function):  # what any Python autograd node costs
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
            return a.view_as(a)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g
    b["noop_fn_fwd"] = loop_us(lambda: Noop.apply(x))
    b["noop_fn_grad"] = loop_us(lambda: torch.autograd.grad(Noop.apply(x), (x,), go))
    b["torch_mul_grad"] = loop_us(lambda: torch.autograd.grad(x * 2.0, (x,), go))
    b["split"] = split(x, y, w, go, Noop)
    return b


def split(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, go: torch.Tensor, noop: Any) -> dict[str, Any]:
    """Host cost by component against the floor op ``t * 2``, in five alternating rounds (median),
    with autograd's multithreading on (as users run) and off (every node on the calling thread, so
    the figures leave out the engine's hand-off to its CUDA worker thread and back)."""

    class Noop3(torch.autograd.Function):  # an empty node that returns three gradients (one launch)
        @staticmethod
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            return a.view_as(a)

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple:
            return g, g, g.sum().view(1)

    from ops import alternating_orders

    t = go.detach().clone().requires_grad_()
    for subset in ((x,), (y,), (w,), (x, y), (x, y, w)):  # plan every gradient set first
        for _ in range(2):
            torch.autograd.grad(L.lerp(x, y, w), subset, go)
    o, m, n1, n3 = L.lerp(x, y, w), t * 2, noop.apply(x), Noop3.apply(x, y, w)

    def grad(out: torch.Tensor, ins: tuple) -> Callable[[], Any]:
        return lambda: torch.autograd.grad(out, ins, go, retain_graph=True)
    fns: dict[str, Callable[[], Any]] = {
        "fwd floor t*2": lambda: t * 2, "fwd flowexec": lambda: L.lerp(x, y, w),
        "fwd torch.lerp": lambda: torch.lerp(x, y, w),
        "grad floor": grad(m, (t,)), "grad noop1": grad(n1, (x,)), "grad noop3": grad(n3, (x, y, w)),
        "grad fx x": grad(o, (x,)), "grad fx y": grad(o, (y,)), "grad fx w": grad(o, (w,)),
        "grad fx xy": grad(o, (x, y)), "grad fx xyw": grad(o, (x, y, w)),
        "fwd+grad floor": lambda: torch.autograd.grad(t * 2, (t,), go),
        "fwd+grad flowexec": lambda: torch.autograd.grad(L.lerp(x, y, w), (x, y, w), go),
    }
    res: dict[str, Any] = {}
    for mt in (True, False):
        name = "multithreaded" if mt else "single-threaded"
        rounds: dict[str, list[float]] = {}
        with torch.autograd.set_multithreading_enabled(mt):
            for order in alternating_orders(fns, 5):
                for k in order:
                    rounds.setdefault(k, []).append(loop_us(fns[k], n=2000))
        res[name] = {k: sorted(v)[2] for k, v in rounds.items()}
        res[name + " rounds"] = rounds
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "lerp_host.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lerp_host.py measures CUDA launches; run it on a CUDA machine")
    from ops import run_meta

    out = {**run_meta("PYTHONPATH=. python3 benchmarks/lerp_host.py " + " ".join(sys.argv[1:])), "us": measure()}
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
