"""Training-step time: eager vs torch.compile vs flowexec (trace, graph), side by side in one run.

Rows (GPU): the reference MLP (8×256, batch 32, SGD) — eager, raw CUDA graph of the eager step,
the make_fx ATen graph run as generated Python, torch.compile default, flowexec trace and graph,
build time, peak memory; the transformer block (Adam); Hugging Face GPT-2 at two sizes through
torch.compile backends (eager, inductor, cudagraphs, flowexec graph), with every warm-up.

    PYTHONPATH=. python3 benchmarks/step_time.py --out benchmarks/results

Writes step_time.json (device, versions, date, every figure). Ratios are what to compare:
absolute times drift between machines.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flowexec  # noqa: E402
from flowexec.runtime.cuda_graph import capture_graph, graph_node_count  # noqa: E402
from flowexec.models import Block, lm_loss, make_lm_step, make_mlp, make_step  # noqa: E402


def interleaved(fns: dict[str, Callable[[], Any]], sync: Callable[[], None], rounds: int, per_round: int) -> dict[str, float]:
    """Median µs per call of each fn, timed in alternating rounds so host drift hits all alike."""
    times: dict[str, list[int]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            for _ in range(per_round):
                t0 = time.perf_counter_ns()
                fn()
                sync()
                times[k].append(time.perf_counter_ns() - t0)
    return {k: statistics.median(v) / 1e3 for k, v in times.items()}


def peak_bytes(fn: Callable[[], Any], dev: torch.device) -> int | None:
    """Peak memory one step adds on top of what is allocated before it (state, other rows)."""
    if dev.type != "cuda":
        return None
    import gc
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base



def guarded(out: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # a failing row is reported, the others still run
        out[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        traceback.print_exc()
        return None


def _rounds(n: int) -> tuple[int, int]:
    """(rounds, calls per round) for about n timed calls per row.

    25 calls per slice: the first calls after switching rows run with cold host caches, which
    penalises Python-heavy rows against a bare graph replay when slices are short."""
    per = 25
    return max(n // per, 3), per


def add_compiled_rows(fns: dict[str, Callable[[], Any]], r: dict[str, Any], fresh: Callable[[], Callable[..., Any]],
                      x: torch.Tensor, y: torch.Tensor, dev: torch.device, sync: Callable[[], None]) -> None:
    """Rows for torch.compile (inductor) and flowexec trace/graph of the same step, plus their build facts."""
    def compile_row() -> None:
        s = torch.compile(fresh())
        t0 = time.perf_counter()
        for _ in range(3):
            s(x, y)
        sync()
        r["inductor_warmup_s"] = time.perf_counter() - t0
        fns["inductor"] = lambda: s(x, y)
    torch._dynamo.reset()
    guarded(r, "inductor", compile_row)

    for mode in ("trace", "graph") if dev.type == "cuda" else ("trace",):
        def fx_mode(mode: str = mode) -> None:
            s = fresh()
            t0 = time.perf_counter()
            exe = flowexec.compile(s, x, y, mode=mode)
            sync()
            r[f"flowexec_{mode}_build_s"] = time.perf_counter() - t0
            r[f"flowexec_{mode}_peak_bytes"] = peak_bytes(lambda: exe(x, y), dev)
            r[f"flowexec_{mode}_plan"] = exe.plan.stats()
            fns[f"flowexec_{mode}"] = lambda: exe(x, y)
            if mode == "graph":  # the graph's own input buffers, filled once: no staging copies
                runner = exe._last.runner.first
                r["flowexec_graph_nodes"] = graph_node_count(runner.graph) if runner.staging is not None else None
                bx, by = exe.input_buffers[:2]  # (x, y: the call's tensor leaves come first)
                assert bx.shape == x.shape and by.shape == y.shape, (bx.shape, by.shape)
                bx.copy_(x), by.copy_(y)
                fns["flowexec_graph_static_inputs"] = lambda: exe(bx, by)
        guarded(r, f"flowexec_{mode}", fx_mode)


def eager_row(fresh: Callable[[], Callable[..., Any]], x: torch.Tensor, y: torch.Tensor,
              dev: torch.device) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """The table's first row (eager) and its peak memory."""
    step = fresh()
    fns: dict[str, Callable[[], Any]] = {"eager": lambda: step(x, y)}
    return fns, {"eager_peak_bytes": peak_bytes(fns["eager"], dev)}


def time_rows(fns: dict[str, Callable[[], Any]], r: dict[str, Any], sync: Callable[[], None], n: int, warm: int) -> None:
    for fn in fns.values():
        for _ in range(warm):
            fn()
    rounds, per = _rounds(n)
    r.update({f"{k}_us": v for k, v in interleaved(fns, sync, rounds, per).items()})


def bench_mlp(dev: torch.device, n: int, out: dict[str, Any]) -> None:
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    base = make_mlp().to(dev)
    x = torch.randn(32, 256, device=dev)
    y = torch.randint(0, 10, (32,), device=dev)

    def fresh() -> Callable[..., torch.Tensor]:
        m = copy.deepcopy(base)
        s = make_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), F.cross_entropy)
        s(x, y)  # steady state, as eager's timed steps see it: the .grad tensors exist
        return s

    fns, r = eager_row(fresh, x, y, dev)
    if dev.type == "cuda":
        raw = fresh()
        raw_graph = capture_graph(lambda: raw(x, y), keep_graph=True)[0]
        fns["raw_cuda_graph"] = raw_graph.replay
        r["raw_cuda_graph_nodes"] = graph_node_count(raw_graph)

    def fx_row() -> None:
        from torch.fx.experimental.proxy_tensor import make_fx

        s = fresh()
        t0 = time.perf_counter()
        gm = make_fx(s)(x, y)
        r["make_fx_trace_s"] = time.perf_counter() - t0
        r["make_fx_nodes"] = len(gm.graph.nodes)

        def run_gm() -> None:
            with torch.no_grad():  # the graph holds its backward: no autograd needed
                gm(x, y)
        fns["make_fx_python"] = run_gm
    guarded(r, "make_fx", fx_row)

    add_compiled_rows(fns, r, fresh, x, y, dev, sync)
    time_rows(fns, r, sync, n, 20)
    out["mlp"] = r
    print("mlp", json.dumps(r, indent=1), flush=True)


def bench_block(dev: torch.device, n: int, out: dict[str, Any]) -> None:
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    base = Block(vocab=512, dim=256, heads=8, seq=64).to(dev)
    x = torch.randint(0, 512, (16, 64), device=dev)
    y = torch.randint(0, 512, (16, 64), device=dev)

    def fresh() -> Callable[..., torch.Tensor]:
        m = copy.deepcopy(base)
        s = make_step(m, torch.optim.Adam(m.parameters(), lr=1e-3, foreach=True), lm_loss)
        s(x, y)  # Adam creates its state on the first step
        return s

    fns, r = eager_row(fresh, x, y, dev)

    add_compiled_rows(fns, r, fresh, x, y, dev, sync)
    time_rows(fns, r, sync, n, 10)
    out["transformer_block"] = r
    print("block", json.dumps(r, indent=1), flush=True)


def bench_hf(dev: torch.device, n: int, out: dict[str, Any], backends: list[str], profile: bool = False) -> None:
    """GPT-2 training steps; every backend's model stays alive and the timing rounds alternate."""
    from transformers import GPT2Config, GPT2LMHeadModel

    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    for name in ("cache_size_limit", "recompile_limit"):  # one entry per backend on one class
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    sizes = [("tiny", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=32), 2, 16),
             ("small", dict(n_layer=4, n_embd=256, n_head=4, vocab_size=5000, n_positions=128), 8, 128)]
    for tag, cfg, b, t in sizes:
        torch._dynamo.reset()
        torch.manual_seed(0)
        base = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **cfg)).to(dev)
        ids = torch.randint(0, cfg["vocab_size"], (b, t), device=dev)
        r: dict[str, Any] = {}
        steps: dict[str, Callable[[], Any]] = {}
        fwd_bwds: dict[str, Callable[[], Any]] = {}
        for backend in backends:
            m = copy.deepcopy(base)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            if backend == "eager":
                fwd = m
            elif backend.startswith("flowexec"):
                fwd = torch.compile(m, backend="flowexec", options={"mode": backend.split("_")[1]})
            else:
                fwd = torch.compile(m, backend=backend)

            step = functools.partial(make_lm_step(fwd, opt), ids)

            def fwd_bwd(fwd: Any = fwd, opt: Any = opt) -> None:  # the step without the optimizer
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(fwd(input_ids=ids, use_cache=False).logits.flatten(0, 1), ids.flatten()).backward()

            def warm(backend: str = backend, step: Any = step) -> None:
                t0 = time.perf_counter()
                for _ in range(3):
                    step()
                sync()
                r[f"{backend}_warmup_s"] = time.perf_counter() - t0
                for _ in range(10):
                    step()
            if guarded(r, backend, lambda: (warm(), True)[1]):
                steps[backend], fwd_bwds[backend] = step, fwd_bwd
            print(tag, backend, {k: v for k, v in r.items() if k.startswith(backend)}, flush=True)
        rounds, per = _rounds(n)
        r.update({f"{k}_us": v for k, v in interleaved(steps, sync, rounds, per).items()})
        r.update({f"{k}_fwd_bwd_us": v for k, v in interleaved(fwd_bwds, sync, max(rounds // 2, 3), per).items()})
        if profile and "flowexec_graph" in steps:
            from torch.profiler import ProfilerActivity, profile as prof
            with prof(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(5):
                    steps["flowexec_graph"]()
                sync()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        out[f"hf_gpt2_{tag}"] = r
        print(tag, json.dumps(r, indent=1), flush=True)


def _functional_step(model: torch.nn.Module, lr: float) -> Callable[..., torch.Tensor]:
    """The MLP's SGD step with the parameters as arguments (torch.func style): forward through
    ``functional_call``, ``autograd.grad``, an in-place ``_foreach_add_`` update."""
    names = [n for n, _ in model.named_parameters()]

    def step(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, dict(zip(names, params)), (x,))
        loss = F.cross_entropy(out, y)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-lr)
        return loss.detach()
    return step


def bench_calling(dev: torch.device, n: int, out: dict[str, Any]) -> None:
    """The MLP step with its parameters as closure state, as positional arguments and as one list
    argument: graph mode (trace mode on CPU) against that form's eager step and raw CUDA graph;
    then the host cost of a call with 1, 20 and 200 tensor arguments."""
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    mode = "graph" if dev.type == "cuda" else "trace"
    torch.manual_seed(0)
    base = make_mlp().to(dev)
    x = torch.randn(32, 256, device=dev)
    y = torch.randint(0, 10, (32,), device=dev)
    from flowexec.runtime import fastcall

    # "native": calls are checked in one C++ call (runtime/fastcall.py); else why not
    r: dict[str, Any] = {"mode": mode, "n_params": len(list(base.parameters())), "call_check": fastcall.status()}
    fns: dict[str, Callable[[], Any]] = {}

    def closure() -> tuple[Callable[[], Any], Callable[[], Any]]:
        m = copy.deepcopy(base)
        s = make_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), F.cross_entropy)
        s(x, y)
        return (lambda: s(x, y)), (lambda: s(x, y))

    def positional() -> tuple[Callable[[], Any], Callable[[], Any]]:
        m = copy.deepcopy(base)
        f = _functional_step(m, 1e-3)
        ps = list(m.parameters())
        g = lambda *a: f(list(a[:-2]), a[-2], a[-1])  # noqa: E731
        return (lambda: g(*ps, x, y)), (lambda: g(*ps, x, y))

    def as_list() -> tuple[Callable[[], Any], Callable[[], Any]]:
        m = copy.deepcopy(base)
        f = _functional_step(m, 1e-3)
        ps = list(m.parameters())
        return (lambda: f(ps, x, y)), (lambda: f(ps, x, y))

    def compiled(form: str) -> Callable[[], Any]:
        m = copy.deepcopy(base)
        ps = list(m.parameters())
        if form == "closure":
            s = make_step(m, torch.optim.SGD(m.parameters(), lr=1e-3), F.cross_entropy)
            s(x, y)
            exe = flowexec.compile(s, x, y, mode=mode)
            call = lambda: exe(x, y)  # noqa: E731
        elif form == "positional":
            f = _functional_step(m, 1e-3)
            exe = flowexec.compile(lambda *a: f(list(a[:-2]), a[-2], a[-1]), *ps, x, y, mode=mode)
            call = lambda: exe(*ps, x, y)  # noqa: E731
        else:
            exe = flowexec.compile(_functional_step(m, 1e-3), ps, x, y, mode=mode)
            call = lambda: exe(ps, x, y)  # noqa: E731
        if mode == "graph":
            first = exe._last.runner.first
            r[f"{form}_graph_borrowed_inputs"] = len(first._borrowed)
            r[f"{form}_graph_tensor_inputs"] = len(first.static_inputs)
            try:  # the graph is kept only where in-graph staging needs it (as in bench_mlp)
                r[f"{form}_graph_nodes"] = graph_node_count(first.graph) if first.staging is not None else None
            except Exception as e:  # a figure for the record only: the timing rows go on
                r[f"{form}_graph_nodes_error"] = f"{type(e).__name__}: {e}"[:200]
        r[f"{form}_flowexec_build_s"] = exe.build_seconds
        return call

    for form, make in (("closure", closure), ("positional", positional), ("list", as_list)):
        def rows(form: str = form, make: Any = make) -> None:
            eager, for_graph = make()
            fns[f"{form}_eager"] = eager
            if dev.type == "cuda":
                for_graph()  # the step's own eager warm-up, then its raw graph
                fns[f"{form}_raw_cuda_graph"] = capture_graph(for_graph, keep_graph=True)[0].replay
            fns[f"{form}_flowexec_{mode}"] = compiled(form)
        guarded(r, form, rows)
    time_rows(fns, r, sync, n, 20)
    for form in ("closure", "positional", "list"):
        f = r.get(f"{form}_flowexec_{mode}_us")
        if f:
            r[f"{form}_eager_over_flowexec"] = r[f"{form}_eager_us"] / f
            if r.get(f"{form}_raw_cuda_graph_us"):
                r[f"{form}_flowexec_over_raw_graph"] = f / r[f"{form}_raw_cuda_graph_us"]
    r["call_overhead_us"] = call_overhead(dev)
    r["guard_overhead_us"] = guard_overhead(dev)
    out["calling"] = r
    print("calling", json.dumps(r, indent=1), flush=True)


def _per_call(f: Callable[[], Any], sync: Callable[[], None], calls: int) -> float:
    """µs a call of ``f`` takes: the best of 5 rounds of ``calls // 5`` after 200 warm-up calls,
    one sync per round (on a GPU: the host's time, where the kernels are shorter)."""
    for _ in range(200):
        f()
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(calls // 5):
            f()
        sync()
        best = min(best, (time.perf_counter_ns() - t0) / (calls // 5) / 1e3)
    return best


def call_overhead(dev: torch.device, counts: tuple[int, ...] = (1, 20, 200), calls: int = 4000) -> dict[str, float]:
    """Host µs a call of ``x0 + 1`` takes with 1, 20, 200 tensor arguments (flat, and as one
    list), in trace and (CUDA) graph mode, against eager ``x + 1``: the best of 5 rounds, one
    sync per round, so on a GPU it is the host's time (the kernel is a few µs). The issue's
    figures before this change (CPU, trace): 3.9 µs for 1 argument, 12.3 µs for 21."""
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    per_call = functools.partial(_per_call, sync=sync, calls=calls)
    x = torch.ones(4, device=dev)
    res = {"eager_x_plus_1": per_call(lambda: x + 1)}
    for mode in ("trace", "graph") if dev.type == "cuda" else ("trace",):
        for k in counts:
            xs = [torch.ones(4, device=dev) for _ in range(k)]
            # Graph mode reads every argument in place (borrow): the figure is the call path's
            # host time, not staging copies of 200 tensors on the device.
            opts = {"borrow": tuple(range(k))} if mode == "graph" else {}
            flat = flowexec.compile(lambda *a: a[0] + 1, *xs, mode=mode, **opts)
            res[f"{mode}_{k}_args"] = per_call(lambda: flat(*xs))
            try:  # (a flowexec before pytree arguments refuses the list: the flat rows still compare)
                listed = flowexec.compile(lambda a: a[0] + 1, xs, mode=mode, **opts)
                res[f"{mode}_list_of_{k}"] = per_call(lambda: listed(xs))
            except flowexec.FlowexecError as e:
                res[f"{mode}_list_of_{k}_error"] = str(e)[:200]
    return res


class _Knobs(torch.nn.Module):
    """A module whose forward reads ``k`` plain float attributes: a capture guards each one."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.names = tuple(f"knob{i}" for i in range(k))
        for n in self.names:
            setattr(self, n, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for n in self.names:
            total += getattr(self, n)
        return x + (1.0 + total)


def guard_overhead(dev: torch.device, counts: tuple[int, ...] = (0, 10, 100), calls: int = 4000) -> dict[str, Any]:
    """Host µs a call of ``x + c`` takes when its capture read 0, 10 and 100 module attributes
    (each a guard checked before the call, in C++ where the native extension is built), in trace
    and (CUDA) graph mode, the guard count of each program, and the cost per 10 guards (the
    slope between the first and the last count): the best of 5 rounds, one sync per round."""
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    per_call = functools.partial(_per_call, sync=sync, calls=calls)
    x = torch.ones(4, device=dev)
    res: dict[str, Any] = {}
    for mode in ("trace", "graph") if dev.type == "cuda" else ("trace",):
        for k in counts:
            knobs = _Knobs(k)
            exe = flowexec.compile(lambda a: knobs(a), x, mode=mode)
            res[f"{mode}_{k}_attributes"] = per_call(lambda: exe(x))
            guards = exe._last.guards
            res[f"{mode}_{k}_attributes_guards"] = len(guards) if guards is not None else 0
            res[f"{mode}_{k}_attributes_native"] = bool(exe._native is not None and exe._native.guarded)
        lo, hi = counts[0], counts[-1]
        dn = res[f"{mode}_{hi}_attributes_guards"] - res[f"{mode}_{lo}_attributes_guards"]
        if dn:
            res[f"{mode}_us_per_10_guards"] = (res[f"{mode}_{hi}_attributes"] - res[f"{mode}_{lo}_attributes"]) / dn * 10
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--only", default="mlp,block,hf,calling")
    ap.add_argument("--calling", action="store_true",
                    help="only the calling-convention rows and the per-call overhead (about 1 min on a GPU)")
    ap.add_argument("--profile", action="store_true", help="print a CPU profile of one GPT-2 tiny flowexec step")
    ap.add_argument("--hf-backends", default="eager,inductor,cudagraphs,flowexec_graph,flowexec_trace")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "PYTHONPATH=. python3 benchmarks/step_time.py " + " ".join(sys.argv[1:]),
        "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown"),  # (scripts/gpu_batch.sh sets it)
    }
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        pass
    only = {"calling"} if args.calling else set(args.only.split(","))
    if "mlp" in only:
        bench_mlp(dev, args.n, out)
    if "block" in only:
        bench_block(dev, max(args.n // 2, 30), out)
    if "calling" in only:
        bench_calling(dev, args.n, out)
    if "hf" in only:
        bench_hf(dev, max(args.n // 2, 30), out, args.hf_backends.split(","), args.profile)
    os.makedirs(args.out, exist_ok=True)
    name = "step_time_calling" if args.calling else "step_time"
    path = os.path.join(args.out, f"{name}.json" if dev.type == "cuda" else f"{name}_cpu.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {path}")
    summarize(out)


def summarize(out: dict[str, Any]) -> None:
    m = out.get("mlp", {})
    def ratio(a: str, b: str, d: dict[str, Any]) -> str:
        return f"{d[a] / d[b]:.2f}" if d.get(a) and d.get(b) else "n/a"
    print("\n== summary ==")
    print(f"MLP: eager/graph {ratio('eager_us', 'flowexec_graph_us', m)}x, graph/raw_graph {ratio('flowexec_graph_us', 'raw_cuda_graph_us', m)} "
          f"(static inputs {ratio('flowexec_graph_static_inputs_us', 'raw_cuda_graph_us', m)}), "
          f"trace/make_fx {ratio('flowexec_trace_us', 'make_fx_python_us', m)}, build {m.get('flowexec_trace_build_s', 'n/a')} s, "
          f"peak trace/eager {ratio('flowexec_trace_peak_bytes', 'eager_peak_bytes', m)}")
    c = out.get("calling", {})
    for form in ("closure", "positional", "list"):
        if f"{form}_eager_us" in c:
            print(f"MLP params as {form}: eager/flowexec {c.get(f'{form}_eager_over_flowexec', 0):.2f}x (goal >= 8), "
                  f"flowexec/raw graph {c.get(f'{form}_flowexec_over_raw_graph', float('nan')):.3f} (goal <= 1.05)")
    if "call_overhead_us" in c:
        print("call overhead (µs):", {k: round(v, 2) for k, v in c["call_overhead_us"].items() if isinstance(v, float)})
    for tag in ("tiny", "small"):
        h = out.get(f"hf_gpt2_{tag}", {})
        print(f"GPT-2 {tag}: eager/fx_graph {ratio('eager_us', 'flowexec_graph_us', h)}x, inductor/fx_graph {ratio('inductor_us', 'flowexec_graph_us', h)}x, "
              f"cudagraphs/fx_graph {ratio('cudagraphs_us', 'flowexec_graph_us', h)}x, warmups fx {h.get('flowexec_graph_warmup_s')} cg {h.get('cudagraphs_warmup_s')}")


if __name__ == "__main__":
    main()
