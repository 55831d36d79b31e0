"""Op benchmark harness (after Paddle's OP Benchmark): flowexec kernels vs PyTorch, one run.

Per case and implementation: forward, backward and forward+backward wall time as a user calls
them (``triton.testing.do_bench``, median, autograd included; forward and forward+backward in
five rounds (``--rounds``) alternating PyTorch, flowexec and two floor ops, median of the rounds),
GPU time of forward and of forward+backward (one CUDA graph replayed; backward = the difference) and the sum of the
forward+backward kernels' own durations (profiler), the bytes the case must move against the
device-to-device copy bandwidth measured in the same run (memory floor), and speed-ups.
Every case is first checked against float64. Prints a table and writes JSON.

    PYTHONPATH=. python3 benchmarks/ops.py                  # all cases -> benchmarks/results/ops.json
    PYTHONPATH=. python3 benchmarks/ops.py --rounds 15 --cases case1 case2 case3 case4   # steadier wall medians

Ratios are what to compare: absolute times drift between machines.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flowexec.kernels import lerp  # noqa: E402
from flowexec.runtime.cuda_graph import capture_graph  # noqa: E402

L = importlib.import_module("flowexec.kernels.lerp")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    x: tuple[int, ...]
    y: tuple[int, ...]
    w: tuple[int, ...] | float  # a float: weight given as a Python number
    dtype: torch.dtype


REFERENCE = [  # /work/shared/reference/README.md, the four lerp cases
    Case("case1", (16, 102400), (16, 102400), (1,), torch.float32),
    Case("case2", (16, 204800), (16, 204800), (1,), torch.float64),
    Case("case3", (16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float32),
    Case("case4", (16, 102400), (16, 102400), (16, 102400), torch.float32),
]
EXTRA = [
    Case("case1-f16", (16, 102400), (16, 102400), (1,), torch.float16),
    Case("case1-bf16", (16, 102400), (16, 102400), (1,), torch.bfloat16),
    Case("case3-f16", (16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float16),
    Case("case3-bf16", (16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.bfloat16),
    Case("case4-bf16", (16, 102400), (16, 102400), (16, 102400), torch.bfloat16),
    Case("float-weight", (16, 102400), (16, 102400), 0.3, torch.float32),
]
def make_inputs(case: Case, dev: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | float, torch.Tensor]:
    x = torch.randn(case.x, device=dev, dtype=case.dtype, requires_grad=True)
    y = torch.randn(case.y, device=dev, dtype=case.dtype, requires_grad=True)
    w: torch.Tensor | float = case.w
    if not isinstance(case.w, float):
        w = torch.rand(case.w, device=dev, dtype=case.dtype, requires_grad=True)
    shape = torch.broadcast_shapes(case.x, case.y, case.w if not isinstance(case.w, float) else ())
    go = torch.randn(shape, device=dev, dtype=case.dtype)
    return x, y, w, go


def floor_bytes(case: Case) -> tuple[int, int]:
    """Fewest bytes forward and backward must move: each input read once, each output written once."""
    n = lambda s: 0 if isinstance(s, float) else torch.Size(s).numel()  # noqa: E731
    out = torch.broadcast_shapes(case.x, case.y, case.w if not isinstance(case.w, float) else ()).numel()
    isz = case.dtype.itemsize
    fwd = (n(case.x) + n(case.y) + n(case.w) + out) * isz
    w_grad = not isinstance(case.w, float)
    # grad in; w for dx, dy; x, y for dw; dx, dy, dw out
    bwd = (out + n(case.w) + (n(case.x) + n(case.y) if w_grad else 0) + n(case.x) + n(case.y) + n(case.w)) * isz
    return fwd, bwd


def bench(fn: Callable[[], Any]) -> float:
    import triton.testing as tt

    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # µs


def bench_samples(fn: Callable[[], Any]) -> list[float]:
    """``bench``'s samples (µs), one per call: the flush, a start event, the call, an end event."""
    import triton.testing as tt

    return [t * 1e3 for t in tt.do_bench(fn, warmup=25, rep=100, return_mode="all")]


def trimmed_mean(xs: list[float], cut: float = 0.1) -> float:
    """The mean of ``xs`` without its lowest and highest ``cut`` fractions.

    The H200's event samples of a 12 µs forward come in steps of about 0.32 µs (11.04, 11.39,
    11.74...), so a median sits on one step; the mean also sees how often the neighbouring steps
    come up, and trimming keeps the host's rare stalls out of it.

    >>> trimmed_mean([1.0, 2.0, 2.0, 3.0, 100.0], cut=0.2)
    2.3333333333333335
    """
    xs = sorted(xs)
    k = int(len(xs) * cut)
    kept = xs[k:len(xs) - k] or xs
    return sum(kept) / len(kept)


def graph_of(fn: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    return capture_graph(fn)[0]


def kernel_times(fn: Callable[[], Any], reps: int = 20) -> list[list[tuple[str, float]]]:
    """Per repetition, the (name, µs) of each kernel fn launches, L2 flushed before each.

    Each repetition is: flush (zero a 256 MiB buffer), a marker kernel (bitwise_not on one byte,
    which no implementation launches), fn. Kernels are read back from the profiler's trace.
    """
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    marker = torch.zeros(1, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            marker.bitwise_not_()
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    reps_seen: list[list[tuple[str, float]]] = []
    for e in kernels:
        name = e.get("name", "")
        if "bitwise_not" in name:
            reps_seen.append([])
        elif reps_seen and "FillFunctor<int>" not in name:
            reps_seen[-1].append((name, float(e["dur"])))
    return reps_seen


def kernel_sum_us(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median over reps of the summed durations of the kernels fn launches (L2 flushed before each)."""
    sums = sorted(sum(d for _, d in rep) for rep in kernel_times(fn, reps))
    return sums[len(sums) // 2] if sums else float("nan")


def check_case(case: Case, dev: str) -> float:
    """Largest error of out and every gradient, relative to the float64 result's max magnitude."""
    x, y, w, go = make_inputs(case, dev)
    ins = [t for t in (x, y, w) if isinstance(t, torch.Tensor)]
    worst = 0.0
    for _ in range(2):  # the second call takes the direct launch path
        out = lerp(x, y, w)
        grads = torch.autograd.grad(out, ins, go)
        xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
        wd = w.detach().double().requires_grad_() if isinstance(w, torch.Tensor) else w
        ref = torch.lerp(xd, yd, wd)
        rins = [t for t in (xd, yd, wd) if isinstance(t, torch.Tensor)]
        rgrads = torch.autograd.grad(ref, rins, go.double())
        for a, b in zip([out, *grads], [ref, *rgrads]):
            worst = max(worst, ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst


def calls(case: Case, impl: str, dev: str) -> tuple[Callable[[], Any], Callable[[], Any], list[torch.Tensor], torch.Tensor]:
    """Fresh inputs and the two calls timed: forward, and forward + ``autograd.grad``.

    ``impl`` "floor" is ``t * 2`` on one output-sized tensor and its backward: one kernel each way,
    one input. No implementation of lerp's forward + backward can cost the host less (it needs
    at least those launches, a node and the engine's ``autograd.grad``), so PyTorch's wall time
    over this one bounds the wall speed-up any implementation can show on the machine. The bound
    is loose: lerp returns three gradients, which costs the engine more than one does
    (``benchmarks/lerp_host.py``, split).

    ``impl`` "floor3" is the least a three-gradient op costs: ``torch.cat`` of three leaves
    (together the output's size: one of all but two elements, two of one), one kernel forward, a
    backward of views only (no launch). Every gradient that reaches a leaf is a task of its own for
    the engine, so no lerp, which needs a launch in its backward too, can cost the host less.
    """
    x, y, w, go = make_inputs(case, dev)
    if impl == "floor":
        t = go.detach().clone().requires_grad_()
        return (lambda: t * 2), (lambda: torch.autograd.grad(t * 2, [t], go)), [t], go
    if impl == "floor3":
        flat = go.detach().reshape(-1)
        n = flat.numel()
        parts = [flat[a:b].clone().requires_grad_() for a, b in ((0, n - 2), (n - 2, n - 1), (n - 1, n))]
        return (lambda: torch.cat(parts)), (lambda: torch.autograd.grad(torch.cat(parts), parts, flat)), parts, flat
    ins = [t for t in (x, y, w) if isinstance(t, torch.Tensor) and t.requires_grad]
    f = torch.lerp if impl == "torch" else lerp
    return (lambda: f(x, y, w)), (lambda: torch.autograd.grad(f(x, y, w), ins, go)), ins, go


def measure(case: Case, impl: str, dev: str, full: bool = True, walls: bool = True) -> dict[str, float]:
    """GPU, loop and (unless ``walls`` is False: ``interleaved_walls`` takes them) wall times."""
    fwd, fwd_bwd, ins, go = calls(case, impl, dev)
    r: dict[str, float] = {}
    if walls:
        r["wall_fwd_bwd_us"] = bench(fwd_bwd)
        r["wall_fwd_us"] = bench(fwd)
    gf, gfb = graph_of(fwd), graph_of(fwd_bwd)
    r["gpu_fwd_us"] = bench(gf.replay)
    r["gpu_fwd_bwd_us"] = bench(gfb.replay)
    r["gpu_bwd_us"] = r["gpu_fwd_bwd_us"] - r["gpu_fwd_us"]
    r["loop_fwd_bwd_us"] = loop_us(fwd_bwd)
    if full:
        r["loop_fwd_us"] = loop_us(fwd)
        out = fwd()
        r["wall_bwd_us"] = bench(lambda: torch.autograd.grad(out, ins, go, retain_graph=True))
        with torch.no_grad():
            r["wall_fwd_nograd_us"] = bench(fwd)
        r["kernels_fwd_bwd_us"] = kernel_sum_us(fwd_bwd)
    return r


# What the wall figures compare: PyTorch, flowexec and the two floor ops (engine-bound least
# costs, see calls()).
WALL_IMPLS = ("torch", "flowexec", "floor", "floor3")


def alternating_orders(names: Any, rounds: int) -> list[list[Any]]:
    """The order of each of ``rounds`` rounds: as listed, then reversed, and so on (so that host
    drift within a run falls on every name alike).

    >>> alternating_orders("ab", 3)
    [['a', 'b'], ['b', 'a'], ['a', 'b']]
    """
    return [list(names) if r % 2 == 0 else list(names)[::-1] for r in range(rounds)]


def interleaved_walls(case: Case, dev: str, row: dict[str, Any], rounds: int = 5,
                      sampler: Callable[[Callable[[], Any]], list[float]] | None = None) -> dict[str, list[float]]:
    """Wall times of PyTorch, flowexec and the two floor ops measured in alternating rounds (the
    host's speed drifts by tens of percent within a run; alternating puts all under the same
    drift). Per round: each implementation's forward + backward once, then the forwards twice,
    in the round's order and mirrored (A B C D D C B A). A do_bench call of a 12 µs forward reads
    on one of two levels ~0.6 µs apart, set by its place in the sequence of calls, not by the
    implementation (a probe at bd42043, docs/history.md: strictly high, low, high, low...), so a forward
    timed once per round could draw the high level against the other's low one; the mirrored
    pass gives each forward one draw at each place. A forward's figure for the round
    (``wall_fwd_us``) is the mean of its two medians (each also kept: ``wall_fwd_a_us``,
    ``wall_fwd_b_us``), beside the mean of their ``trimmed_mean`` (``wall_fwd_tmean_us``).
    The medians over rounds go into ``row[impl]``; the rounds are returned. ``sampler``
    replaces ``bench_samples`` in tests."""
    sampler = sampler or bench_samples
    fns: dict[str, dict[str, Callable[[], Any]]] = {}
    for impl in WALL_IMPLS:
        fwd, fwd_bwd, _, _ = calls(case, impl, dev)
        fns[impl] = {"wall_fwd_bwd_us": fwd_bwd, "wall_fwd_us": fwd}
    got: dict[str, list[float]] = {}

    def put(impl: str, key: str, value: float) -> None:
        got.setdefault(f"{impl}:{key}", []).append(value)

    for order in alternating_orders(WALL_IMPLS, rounds):
        for impl in order:
            samples = sampler(fns[impl]["wall_fwd_bwd_us"])
            put(impl, "wall_fwd_bwd_us", statistics.median(samples))
            put(impl, "wall_fwd_bwd_tmean_us", trimmed_mean(samples))
        fwd: dict[str, list[list[float]]] = {impl: [] for impl in order}
        for impl in order + order[::-1]:
            fwd[impl].append(sampler(fns[impl]["wall_fwd_us"]))
        for impl, (a, b) in fwd.items():
            put(impl, "wall_fwd_a_us", statistics.median(a))
            put(impl, "wall_fwd_b_us", statistics.median(b))
            put(impl, "wall_fwd_us", (statistics.median(a) + statistics.median(b)) / 2)
            put(impl, "wall_fwd_tmean_us", (trimmed_mean(a) + trimmed_mean(b)) / 2)
    for name, vals in got.items():
        impl, key = name.split(":")
        row.setdefault(impl, {})[key] = sorted(vals)[len(vals) // 2]
    return got


def loop_us(fn: Callable[[], Any], n: int = 200) -> float:
    """Time per call of n back-to-back calls, then one sync (host and device overlapped, L2 warm).

    do_bench flushes L2 with a 256 MiB memset before each call, and the host enqueues the call
    while that memset runs, so for calls that launch in less time than the memset takes do_bench
    sees mostly GPU time. This figure is the other view: a loop's steady-state cost per call.
    """
    fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(best)[2]


def run_meta(command: str) -> dict[str, Any]:
    """What every results file starts with: device, versions, date, the command and the commit
    (``FLOWEXEC_COMMIT``: the device machine's own git may be stale)."""
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "command": command, "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown")}


def write_result(out_dir: str | None, name: str, result: Any) -> None:
    """``result`` as ``out_dir/name`` (indented JSON); nothing where ``out_dir`` is None."""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(result, f, indent=1)


def copy_bandwidth(dev: str) -> float:
    a = torch.empty(2**28, dtype=torch.float32, device=dev)  # 1 GiB
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a))
    return 2 * a.numel() * 4 / (t * 1e-6)


def run_cases(cases: list[Case], dev: str, bw: float, log: Callable[[str], None],
              res: dict[str, Any], save: Callable[[], None], rounds: int = 5) -> dict[str, Any]:
    for case in cases:
        fb, bb = floor_bytes(case)
        row: dict[str, Any] = {
            "x": list(case.x), "y": list(case.y), "w": case.w if isinstance(case.w, float) else list(case.w),
            "dtype": str(case.dtype).replace("torch.", ""), "bytes_fwd": fb, "bytes_bwd": bb,
            "floor_fwd_bwd_us": (fb + bb) / bw * 1e6,
        }
        try:
            row["max_rel_err"] = check_case(case, dev)
            for impl in ("torch", "flowexec"):
                row[impl] = measure(case, impl, dev, walls=False)
            row["wall_rounds"] = interleaved_walls(case, dev, row, rounds)
        except Exception:  # keep going: the other cases still tell something
            row["error"] = traceback.format_exc(limit=4)
            res[case.name] = row
            log(f"{case.name}: FAILED\n{row['error']}")
            continue
        t, fx = row["torch"], row["flowexec"]
        row["speedup"] = {k: t[k] / fx[k] for k in t if k in fx and fx[k] > 0}
        # The most any implementation could gain by wall time here (PyTorch over the floor op).
        row["wall_speedup_bound"] = t["wall_fwd_bwd_us"] / row["floor"]["wall_fwd_bwd_us"]
        # ... and for an op that returns three gradients, as lerp does.
        row["wall_speedup_bound3"] = t["wall_fwd_bwd_us"] / row["floor3"]["wall_fwd_bwd_us"]
        row["flowexec_gpu_over_floor"] = fx["gpu_fwd_bwd_us"] / row["floor_fwd_bwd_us"]
        row["flowexec_kernels_over_floor"] = fx["kernels_fwd_bwd_us"] / row["floor_fwd_bwd_us"]
        row["achieved_fraction_of_copy_bw"] = (fb + bb) / (fx["gpu_fwd_bwd_us"] * 1e-6) / bw
        res[case.name] = row
        log(f"{case.name}: GPU fb {t['gpu_fwd_bwd_us']:.1f} vs {fx['gpu_fwd_bwd_us']:.1f} "
            f"(floor {row['floor_fwd_bwd_us']:.1f}, kernels {fx['kernels_fwd_bwd_us']:.1f}), wall fb "
            f"{t['wall_fwd_bwd_us']:.1f} vs {fx['wall_fwd_bwd_us']:.1f}, loop fb {t['loop_fwd_bwd_us']:.1f} vs "
            f"{fx['loop_fwd_bwd_us']:.1f}, wall bound {row['wall_speedup_bound']:.2f} (three gradients "
            f"{row['wall_speedup_bound3']:.2f}), err {row['max_rel_err']:.1e}")
        save()
    return res


def _compile_job(job: tuple[dict[str, Any], Case]) -> str:
    """Worker: run a case once under a config so its kernels land in Triton's on-disk cache."""
    cfg, case = job
    try:
        with L.configured(**cfg):
            check_case(case, "cuda")
        return "ok"
    except Exception as e:  # reported by the caller; the timed run will show the real error
        return f"{case.name}: {type(e).__name__}: {e}"


def precompile(jobs: list[tuple[dict[str, Any], Case]], log: Callable[[str], None]) -> None:
    """Compile in parallel processes: the timed runs then load kernels from the cache."""
    import multiprocessing as mp

    t0 = time.time()
    with mp.get_context("spawn").Pool(min(len(jobs), max(1, (os.cpu_count() or 2) - 1))) as pool:
        res = pool.map(_compile_job, jobs)
    bad = [r for r in res if r != "ok"]
    log(f"precompiled {len(jobs)} case/config pairs in {time.time() - t0:.1f}s" + (f"; failures: {bad}" if bad else ""))


def direct_launch_active() -> bool:
    return any(getattr(p, "fwd", None) is not None and p.fwd._direct is not None for p in L._PLANS.values())


def table(res: dict[str, Any]) -> str:
    """Two markdown tables of a run's cases: GPU time (forward, backward, forward+backward; bytes
    moved per second against the copy bandwidth measured in the run) and wall time as a user
    calls it (speed-ups, the floor ops' bounds, forward, backward, back-to-back loop, error)."""
    def pair(t: dict[str, float], f: dict[str, float], key: str, prec: int = 1) -> str:
        if key not in t or key not in f:
            return "–"
        return f"{t[key]:.{prec}f} → {f[key]:.{prec}f} µs ({t[key] / f[key]:.2f}×)"

    gpu = ["| case | dtype | GPU fwd, PyTorch → flowexec | GPU bwd | GPU fwd+bwd | memory floor fwd+bwd "
           "| flowexec achieved (of copy bandwidth) | flowexec kernels ÷ floor |",
           "|---|---|---|---|---|---|---|---|"]
    wall = ["| case | wall fwd+bwd, PyTorch → flowexec | wall bound: one / three gradients | wall fwd | wall bwd "
            "| loop fwd+bwd | max rel err |",
            "|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        if "error" in r:
            gpu.append(f"| {name} | {r['dtype']} | failed: see the log |")
            continue
        t, f = r["torch"], r["flowexec"]
        # the floor is the case's bytes at the copy bandwidth
        copy_tbps = (r["bytes_fwd"] + r["bytes_bwd"]) / r["floor_fwd_bwd_us"] / 1e6
        frac = r["achieved_fraction_of_copy_bw"]
        gpu.append(
            f"| {name} | {r['dtype']} | {pair(t, f, 'gpu_fwd_us')} | {pair(t, f, 'gpu_bwd_us')} "
            f"| {pair(t, f, 'gpu_fwd_bwd_us')} | {r['floor_fwd_bwd_us']:.1f} µs "
            f"| {frac * copy_tbps:.2f} TB/s ({frac:.0%} of {copy_tbps:.2f}) "
            f"| {r['flowexec_kernels_over_floor']:.2f} |")
        wall.append(
            f"| {name} | {pair(t, f, 'wall_fwd_bwd_us', 0)} "
            f"| {r.get('wall_speedup_bound', float('nan')):.2f} / {r.get('wall_speedup_bound3', float('nan')):.2f} "
            f"| {pair(t, f, 'wall_fwd_us')} | {pair(t, f, 'wall_bwd_us', 0)} | {pair(t, f, 'loop_fwd_bwd_us', 0)} "
            f"| {r['max_rel_err']:.1e} |")
    return "GPU time (one CUDA graph replayed; backward = fwd+bwd − fwd):\n\n" + "\n".join(gpu) + \
        "\n\nWall time (do_bench median, autograd included):\n\n" + "\n".join(wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ops.json"))
    ap.add_argument("--cases", nargs="*", help="names of the cases to run (default: all)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating rounds of wall times per case (their median is the figure; default 5)")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/ops.py needs a CUDA device")

    dev = "cuda"
    t0 = time.time()
    log = lambda s: print(f"[{time.time() - t0:6.1f}s] {s}", flush=True)  # noqa: E731
    bw = copy_bandwidth(dev)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    command = ("PYTHONPATH=. python3 benchmarks/ops.py" + (f" --rounds {args.rounds}" if args.rounds != 5 else "")
               + (f" --cases {' '.join(args.cases)}" if args.cases else ""))
    result: dict[str, Any] = {**run_meta(command),
                              "copy_bandwidth_TBps": bw / 1e12}
    cases = [c for c in REFERENCE + EXTRA if not args.cases or c.name in args.cases]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save() -> None:  # after every step, so that a run cut short still leaves its figures
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    precompile([({}, case) for case in cases], log)
    with L.configured() as used:
        result["config"] = dataclasses.asdict(used)
        result["cases"] = {}
        run_cases(cases, dev, bw, log, result["cases"], save, args.rounds)
        result["direct_launch_active"] = direct_launch_active()
        result["native_front_door_active"] = importlib.import_module("flowexec.kernels._native").front_door is not None
    save()
    print(f"\n{result['device']}, torch {result['torch']}, triton {result['triton']}, copy {bw / 1e12:.2f} TB/s, "
          f"direct launch {'on' if result['direct_launch_active'] else 'OFF'}\n")
    print(table(result["cases"]))


if __name__ == "__main__":
    main()
