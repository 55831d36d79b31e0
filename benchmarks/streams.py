"""Streams: flowexec's statically planned multi-stream runs against one stream, side by side.

Workload (b) of ``../shared/reference/streams_anchors_gpu.py``: four independent branches of six
small matmul + SiLU (batch 8, 256 wide), concatenated; the reference ran them from one CUDA
graph on one stream (177.8 µs) and on four streams forked and joined by hand (60.0 µs), each
replay followed by a synchronize. Rows: eager; those two hand-made graphs, rebuilt here; flowexec
graph and trace mode with ``streams=1`` and ``streams=4``. Then the reference MLP training step
(8×256, batch 32, SGD) in graph mode with 1, 2 and 4 streams, to show what streams do to a
step with little parallelism (every flowexec row checked against eager first), and the GPT-2
tiny and small training steps through the torch.compile backend in graph mode with 1 and 4
streams.

Issue 26's sections, in the same run: (a) a copy-heavy step (6 x (1024x1024 matmul + tanh),
batch 256, every activation copied to pinned host memory) with ``streams="auto"`` (graph mode:
copies on a d2h copy stream; trace mode: one stream, its host cost of stream calls would
exceed the overlap) against eager, against the same step without copies and against its
copies alone (this step is bound by the copy engine: its copies take longer than its compute),
and the same at the reference's shape (``copy_heavy_large``: 8 x (2048x4096 @ 4096x4096 +
tanh), compute-bound); (b) the host time
the event calls of a step cost, pruned plan against the naive one (one event per
cross-stream edge), with both counts; (c) threaded mode against trace mode on the MLP step
and on the four-branch model; (d) graph mode with branches on four streams against one (the
branches section). ``--device cpu``: threaded mode with 2 CPU streams against trace mode on
four independent branches of small matmuls, beside trace mode with 1 and 2 intra-op threads.

    PYTHONPATH=. python3 benchmarks/streams.py --out benchmarks/results            # GPU, ~3 min
    PYTHONPATH=. python3 benchmarks/streams.py --device cpu --out benchmarks/results

Writes streams.json (GPU) or streams_cpu.json (device, versions, date, commit, plan sizes,
every figure).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import time
import datetime
import functools
import json
import os
import platform
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flowexec  # noqa: E402
from flowexec.models import make_mlp, make_step  # noqa: E402
from flowexec.runtime.cuda_graph import capture_graph  # noqa: E402
from step_time import interleaved  # noqa: E402

B, D = 8, 256


def branch(ws: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    for w in ws:
        h = F.silu(h @ w)
    return h


def by_hand_four_streams(br: list[list[torch.Tensor]], streams: list[torch.cuda.Stream]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference's hand-written fork and join over four streams."""
    def fn(xs: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        ev = main.record_event()
        outs: list[Any] = [None] * len(br)
        for i, (s, ws) in enumerate(zip(streams, br)):
            with torch.cuda.stream(s):
                s.wait_event(ev)
                outs[i] = branch(ws, xs)
        for s in streams:
            main.wait_stream(s)
        return torch.cat(outs, -1)
    return fn


def reserved_by(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()`` and the MiB the caching allocator reserved during it (CUDA graph pools included)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.memory_reserved() - before) / 2**20


def branch_rows(dev: torch.device, r: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    xs = torch.randn(B, D, device=dev)
    br = [[torch.randn(D, D, device=dev) / 16 for _ in range(6)] for _ in range(4)]

    def one_stream(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(ws, x) for ws in br], -1)

    want = one_stream(xs)
    rows: dict[str, Callable[[], Any]] = {"eager": lambda: one_stream(xs)}
    g1 = capture_graph(lambda: one_stream(xs))[0]
    rows["cuda graph, one stream"] = g1.replay
    g4 = capture_graph(lambda: by_hand_four_streams(br, [torch.cuda.Stream() for _ in br])(xs))[0]
    rows["cuda graph, four streams by hand"] = g4.replay
    for mode in ("graph", "trace"):
        for n in (1, 4):
            exe, mib = reserved_by(lambda: flowexec.compile(one_stream, xs, mode=mode, streams=n))
            r[f"flowexec {mode}, streams={n} reserved_MiB"] = mib
            torch.testing.assert_close(exe(xs), want, rtol=1e-5, atol=1e-5)
            r[f"flowexec {mode}, streams={n} plan"] = {k: exe.plan.stats()[k] for k in ("ops", "streams", "events")}
            rows[f"flowexec {mode}, streams={n}"] = (lambda exe=exe: exe(xs))
    return rows


def step_rows(dev: torch.device, r: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    base = make_mlp(256, 8).to(dev)
    x, y = torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
    rows: dict[str, Callable[[], Any]] = {}
    ref_model = copy.deepcopy(base)
    ref = make_step(ref_model, torch.optim.SGD(ref_model.parameters(), lr=1e-3), F.cross_entropy)
    rows["eager step"] = lambda: ref(x, y)
    for n in (1, 2, 4):
        m = copy.deepcopy(base)
        step = make_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), F.cross_entropy)
        exe, mib = reserved_by(lambda: flowexec.compile(step, x, y, mode="graph", streams=n))
        r[f"flowexec graph step, streams={n} reserved_MiB"] = mib
        check = copy.deepcopy(base)
        check_step = make_step(check, torch.optim.SGD(check.parameters(), lr=1e-3), F.cross_entropy)
        for _ in range(2):  # same losses and parameters as eager from the same start
            torch.testing.assert_close(exe(x, y), check_step(x, y), rtol=1e-5, atol=1e-5)
        for p, q in zip(m.parameters(), check.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)
        r[f"flowexec graph step, streams={n} plan"] = {k: exe.plan.stats()[k] for k in ("ops", "streams", "events")}
        rows[f"flowexec graph step, streams={n}"] = (lambda exe=exe: exe(x, y))
    return rows


GPT2_SIZES = {  # step_time.py's configs: (config, batch, sequence)
    "gpt2_tiny": (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=32), 2, 16),
    "gpt2_small": (dict(n_layer=4, n_embd=256, n_head=4, vocab_size=5000, n_positions=128), 8, 128),
}


def gpt2_rows(size: str, dev: torch.device, r: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """GPT-2 (step_time.py's ``size`` config) through the torch.compile backend in graph mode,
    one stream against four; AdamW stays eager, as in step_time."""
    import functools

    import transformers

    from flowexec.models import make_lm_step

    cfg_kw, b, t = GPT2_SIZES[size]
    cfg = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **cfg_kw)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).to(dev)
    ids = torch.randint(0, cfg_kw["vocab_size"], (b, t), device=dev)
    rows: dict[str, Callable[[], Any]] = {}
    for name, options in (("eager", None), ("flowexec graph, streams=1", {"mode": "graph"}),
                          ("flowexec graph, streams=4", {"mode": "graph", "streams": 4})):
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        torch._dynamo.reset()
        fwd = m if options is None else torch.compile(m, backend="flowexec", options=options)
        rows[name] = functools.partial(make_lm_step(fwd, opt), ids)
        r[f"{name} reserved_MiB"] = reserved_by(lambda: [rows[name]() for _ in range(3)])[1]  # compiles and captures
    return rows


def copy_rows(dev: torch.device, r: dict[str, Any], layers: int = 6, batch: int = 256,
              width: int = 1024) -> dict[str, Callable[[], Any]]:
    """(a) The copy-heavy step, with and without its copies, eager and flowexec; and its
    copies alone, eager on one stream (the copy engine's own time: with copies on a side stream
    a step cannot be faster than that, plus its first layer)."""
    torch.manual_seed(0)
    r["workload"] = f"{layers} x ({batch}x{width} @ {width}x{width} + tanh), each activation copied to pinned host"
    ws = [torch.randn(width, width, device=dev) / width ** 0.5 for _ in range(layers)]
    hosts = [torch.empty(batch, width, pin_memory=dev.type == "cuda") for _ in range(layers)]  # made once
    x = torch.randn(batch, width, device=dev)
    acts = [torch.randn(batch, width, device=dev) for _ in range(layers)]

    def copies_alone() -> None:
        for a, hb in zip(acts, hosts):
            hb.copy_(a, non_blocking=True)

    def with_copies(x: torch.Tensor) -> torch.Tensor:
        h = x
        for w, hb in zip(ws, hosts):
            h = torch.tanh(h @ w)
            hb.copy_(h, non_blocking=True)  # the offload / checkpoint pattern
        return h

    def no_copies(x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in ws:
            h = torch.tanh(h @ w)
        return h

    want = with_copies(x)
    torch.cuda.synchronize()
    want_host = [h.clone() for h in hosts]
    rows: dict[str, Callable[[], Any]] = {"eager": lambda: with_copies(x), "eager, no copies": lambda: no_copies(x),
                                          "eager, copies alone": copies_alone}
    for mode in ("trace", "graph") if dev.type == "cuda" else ("trace",):
        for streams in (1, "auto"):
            name = f"flowexec {mode}, streams={streams}"
            try:
                exe = flowexec.compile(with_copies, x, mode=mode, streams=streams)
                for h in hosts:
                    h.zero_()
                torch.testing.assert_close(exe(x), want, rtol=1e-5, atol=1e-5)
                torch.cuda.synchronize()
                for h, w in zip(hosts, want_host):
                    torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5)
                st = exe.plan.stats()
                r[f"{name} plan"] = {k: st[k] for k in ("ops", "streams", "stream_roles", "events", "waits")}
                rows[name] = (lambda exe=exe: exe(x))
            except Exception as e:  # a row that fails is reported, the others still run
                r[f"{name} error"] = f"{type(e).__name__}: {e}"[:500]
        exe = flowexec.compile(no_copies, x, mode=mode)
        rows[f"flowexec {mode}, no copies"] = (lambda exe=exe: exe(x))
    return rows


def host_us(fn: Callable[[], Any], sync: Callable[[], None], calls: int = 400) -> float:
    """Median host µs of one call (the device is synchronised every 8 calls, outside the timing)."""
    import statistics

    ts = []
    for k in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
        if k % 8 == 7:
            sync()
    return statistics.median(ts) / 1e3


def event_host_time(dev: torch.device, r: dict[str, Any]) -> None:
    """(b) Host µs per step spent on event calls: the runner of a plan against the same runner
    with its waits and records left out (timing only: that one's results are not used), for
    the pruned and the naive plan of the MLP training step and of the four-branch model."""
    from flowexec.capture import capture
    from flowexec.plan import build_plan
    from flowexec.runtime.interpreter import lower_trace

    torch.manual_seed(0)
    m = make_mlp(256, 8).to(dev)
    step = make_step(m, torch.optim.SGD(m.parameters(), lr=1e-6), F.cross_entropy)
    x, y = torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
    step(x, y)
    xs = torch.randn(B, D, device=dev)
    br = [[torch.randn(D, D, device=dev) / 16 for _ in range(6)] for _ in range(4)]
    workloads = {"mlp_step": (step, (x, y)), "branches": (lambda v: torch.cat([branch(ws, v) for ws in br], -1), (xs,))}
    sync = torch.cuda.synchronize
    for name, (fn, args) in workloads.items():
        prog = capture(fn, args).program
        out: dict[str, Any] = {}
        for kind, prune in (("pruned", True), ("naive", False)):
            plan = build_plan(prog, streams=4, prune=prune)
            bare = dataclasses.replace(plan, instructions=tuple(dataclasses.replace(i, waits=(), records=())
                                                                for i in plan.instructions), n_events=0)
            run, run_bare = lower_trace(plan), lower_trace(bare)
            for _ in range(20):
                run(*args), run_bare(*args)
            sync()
            t_full = min(host_us(lambda: run(*args), sync) for _ in range(3))
            t_bare = min(host_us(lambda: run_bare(*args), sync) for _ in range(3))
            st = plan.stats()
            out[kind] = {"waits": st["waits"], "events": st["events"], "cross_stream_edges": st["cross_stream_edges"],
                         "host_us_per_step": t_full, "host_us_without_events": t_bare,
                         "event_host_us_per_step": t_full - t_bare}
        n, p = out["naive"]["event_host_us_per_step"], out["pruned"]["event_host_us_per_step"]
        out["pruned_saves"] = (1 - p / n) if n > 0 else None
        r[name] = out
        print(f"events {name:9s} pruned {out['pruned']['waits']} waits / {out['pruned']['events']} events "
              f"{p:7.1f} µs; naive {out['naive']['waits']} / {out['naive']['events']} {n:7.1f} µs", flush=True)


def threaded_rows(dev: torch.device, r: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """(c) Threaded mode against trace mode: the MLP step (one stream), the four branches."""
    torch.manual_seed(0)
    base = make_mlp(256, 8).to(dev)
    x, y = torch.randn(32, 256, device=dev), torch.randint(0, 10, (32,), device=dev)
    rows: dict[str, Callable[[], Any]] = {}
    for mode in ("trace", "threaded"):
        m = copy.deepcopy(base)
        step = make_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), F.cross_entropy)
        exe = flowexec.compile(step, x, y, mode=mode)
        rows[f"mlp step, {mode}"] = (lambda exe=exe: exe(x, y))
    xs = torch.randn(B, D, device=dev)
    br = [[torch.randn(D, D, device=dev) / 16 for _ in range(6)] for _ in range(4)]

    def four(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(ws, v) for ws in br], -1)

    want = four(xs)
    for mode, n in (("trace", 1), ("trace", 4), ("threaded", 4), ("trace", "auto"), ("threaded", "auto")):
        exe = flowexec.compile(four, xs, mode=mode, streams=n)
        torch.testing.assert_close(exe(xs), want, rtol=1e-5, atol=1e-5)
        r[f"branches, {mode}, streams={n} plan"] = {k: exe.plan.stats()[k] for k in ("streams", "events")}
        rows[f"branches, {mode}, streams={n}"] = (lambda exe=exe: exe(xs))
    return rows


def cpu_main(args: argparse.Namespace) -> None:
    """Threaded mode with 2 CPU streams against trace mode on 4 independent branches of small
    matmuls, beside trace mode with 1 and 2 intra-op threads."""
    sys.path.insert(0, os.path.dirname(__file__))
    from host_meta import host_meta

    torch.manual_seed(0)
    n_br, depth, rows_, width = 4, 6, 64, 256
    br = [[torch.randn(width, width) / 16 for _ in range(depth)] for _ in range(n_br)]

    def four(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(ws, v) for ws in br], -1)

    x = torch.randn(rows_, width)
    want = four(x)
    threads0 = torch.get_num_threads()

    def at(threads: int, fn: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: (torch.set_num_threads(threads), fn())

    res: dict[str, Any] = host_meta("PYTHONPATH=. python3 benchmarks/streams.py " + " ".join(sys.argv[1:]))
    res["load_average_1min"] = os.getloadavg()[0]  # other work on the machine skews these figures
    res["workload"] = f"{n_br} branches of {depth} x ({rows_}x{width} @ {width}x{width} + SiLU), concatenated"
    rows: dict[str, Callable[[], Any]] = {"eager, 1 thread": at(1, lambda: four(x))}
    exe1 = flowexec.compile(four, x)
    rows["trace, 1 intra-op thread"] = at(1, lambda: exe1(x))
    rows["trace, 2 intra-op threads"] = at(2, lambda: exe1(x))
    for mode, n in (("threaded", 2), ("threaded", "auto"), ("trace", 2)):
        exe = flowexec.compile(four, x, mode=mode, streams=n)
        torch.set_num_threads(1)
        torch.testing.assert_close(exe(x), want, rtol=1e-5, atol=1e-5)
        res[f"{mode}, streams={n} plan"] = {k: exe.plan.stats()[k] for k in ("streams", "events")}
        rows[f"{mode}, streams={n}, 1 intra-op thread each"] = at(1, lambda exe=exe: exe(x))
    for fn in rows.values():
        for _ in range(5):
            fn()
    times = interleaved(rows, lambda: None, args.rounds, args.per_round)
    torch.set_num_threads(threads0)
    base = "trace, 1 intra-op thread"
    res["us"] = times
    res["vs_" + base] = {k: times[base] / v for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:45s} {v:9.1f} µs  {times[base] / v:5.2f}x trace (1 thread)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "streams_cpu.json"), "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=25)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--gpt2", action="store_true", help="also the GPT-2 rows through the backend (longer)")
    ap.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.per_round = 2, 3
    if args.device == "cpu":
        return cpu_main(args)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/streams.py needs a CUDA device (or --device cpu)")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": "PYTHONPATH=. python3 benchmarks/streams.py " + " ".join(sys.argv[1:]),
        "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown"),  # the device machine's git may be stale
        "timing": "median µs per call including a synchronize, alternating rounds",
    }
    # copy_heavy_large: the reference's offload shape (compute per layer above its copy's time,
    # so a copy stream can hide all but the last copy); ~12 ms a call, hence fewer calls
    builds: dict[str, Callable[..., Any]] = {"branches": branch_rows, "mlp_step": step_rows, "copy_heavy": copy_rows,
                                             "copy_heavy_large": functools.partial(copy_rows, layers=8, batch=2048,
                                                                                   width=4096),
                                             "threaded": threaded_rows}
    fewer = {"copy_heavy_large": (max(2, args.rounds // 4), max(1, args.per_round // 8))}
    if args.gpt2:
        builds.update({size: functools.partial(gpt2_rows, size) for size in GPT2_SIZES})
    # the capture stream's cuBLAS workspace, made before any row's build is measured
    a = torch.randn(8, 8, device=dev)
    capture_graph(lambda: a @ a)
    for name, build in builds.items():
        facts: dict[str, Any] = {}
        rows = build(dev, facts)
        for fn in rows.values():
            for _ in range(10):
                fn()
        sync()
        times = interleaved(rows, sync, *fewer.get(name, (args.rounds, args.per_round)))
        first = next(iter(times))
        res[name] = {"us": times, "vs_" + first: {k: times[first] / v for k, v in times.items()}, **facts}
        for k, v in times.items():
            print(f"{name:9s} {k:36s} {v:9.1f} µs  {times[first] / v:5.2f}× {first}", flush=True)
    res["event_host_time"] = {}
    event_host_time(dev, res["event_host_time"])
    for section in ("copy_heavy", "copy_heavy_large"):
        c = res[section]["us"]
        for mode in ("trace", "graph"):
            auto = c.get(f"flowexec {mode}, streams=auto")
            if auto:
                res[section][f"{mode} auto"] = {"vs eager": c["eager"] / auto,
                                                "over no copies": auto / c[f"flowexec {mode}, no copies"],
                                                "vs streams=1": c.get(f"flowexec {mode}, streams=1", float("nan")) / auto,
                                                "over copies alone": auto / c["eager, copies alone"]}
        print(section, json.dumps({k: v for k, v in res[section].items() if k.endswith(" auto")}), flush=True)
    t = res["threaded"]["us"]
    res["threaded"]["threaded over trace"] = {"mlp step": t["mlp step, threaded"] / t["mlp step, trace"],
                                              "branches (4 streams)": t["branches, threaded, streams=4"] / t["branches, trace, streams=4"]}
    b = res["branches"]["us"]
    res["branches"]["four_over_one"] = {
        "by hand (cuda graph)": b["cuda graph, one stream"] / b["cuda graph, four streams by hand"],
        "flowexec graph": b["flowexec graph, streams=1"] / b["flowexec graph, streams=4"],
        "flowexec trace": b["flowexec trace, streams=1"] / b["flowexec trace, streams=4"],
    }
    print(json.dumps(res["branches"]["four_over_one"], indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "streams.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
