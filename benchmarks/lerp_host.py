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

The ``parts`` entries split flowexec's cost against that least cost: the native forward called
without the Python wrapper (``native_fwd_direct``), ``autograd.grad`` on retained graphs for one
gradient at a time (``fx_grad_only_y``: one launch, one allocation; ``fx_grad_only_w``: the main
and the final launch, the gradient and the partials; ``fx_grad_only_x``), the same for ``x * 2``
and an empty Python autograd function, one ``empty_like`` and one tiny ``add_``; ``st_*``: some of
those with autograd's multithreading off, which shows what the engine's hand-off to its CUDA
worker thread costs.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
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
        b["fwd_launch_tensors"] = loop_us(lambda: p.fwd((xd, yd, wd, outd, 0.0, 0.0, *p.fwd_tail), True))
        ptrs = (xd.data_ptr(), yd.data_ptr(), wd.data_ptr(), outd.data_ptr())
        b["fwd_launch_ints"] = loop_us(lambda: p.fwd((xd, yd, wd, outd, 0.0, 0.0, *p.fwd_tail), True, ptrs))
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
    b["parts"] = parts(x, y, w, go, Noop)
    return b


def parts(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, go: torch.Tensor, noop: Any) -> dict[str, float]:
    """Host cost by component (see the module docstring), each a loop_us figure."""
    nat = importlib.import_module("flowexec.kernels._native")
    r: dict[str, float] = {}
    front = nat.front_door
    if front is not None:
        assert front(x, y, w, 0.0) is not None, "the shape must be planned natively by now"
        r["native_fwd_direct"] = loop_us(lambda: front(x, y, w, 0.0))
    r["fx_fwd_grad"] = loop_us(lambda: L.lerp(x, y, w))
    o = L.lerp(x, y, w)
    for name, t in (("x", x), ("y", y), ("w", w)):
        torch.autograd.grad(o, (t,), go, retain_graph=True)  # plans this gradient set first
        r[f"fx_grad_only_{name}"] = loop_us(lambda: torch.autograd.grad(o, (t,), go, retain_graph=True))
    m = x * 2.0
    r["torch_mul_grad_only"] = loop_us(lambda: torch.autograd.grad(m, (x,), go, retain_graph=True))
    n = noop.apply(x)
    r["noop_grad_only"] = loop_us(lambda: torch.autograd.grad(n, (x,), go, retain_graph=True))
    xd = x.detach()
    r["empty_like"] = loop_us(lambda: torch.empty_like(xd))
    tiny = torch.zeros(1, device=x.device)
    r["torch_add_"] = loop_us(lambda: tiny.add_(1.0))
    # The engine's hand-off to its CUDA worker thread and back: the same backwards with
    # autograd's multithreading off (every node then runs on the calling thread).
    with torch.autograd.set_multithreading_enabled(False):
        r["st_noop_grad_only"] = loop_us(lambda: torch.autograd.grad(n, (x,), go, retain_graph=True))
        r["st_torch_mul_grad_only"] = loop_us(lambda: torch.autograd.grad(m, (x,), go, retain_graph=True))
        r["st_fx_grad3_only"] = loop_us(lambda: torch.autograd.grad(o, (x, y, w), go, retain_graph=True))
    r["fx_grad3_only"] = loop_us(lambda: torch.autograd.grad(o, (x, y, w), go, retain_graph=True))
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "lerp_host.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lerp_host.py measures CUDA launches; run it on a CUDA machine")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "PYTHONPATH=. python3 benchmarks/lerp_host.py " + " ".join(sys.argv[1:]),
           "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown"), "us": measure()}
    print(json.dumps(out, indent=1))
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
