"""Where flowexec's whole step differs from eager at scale (issue 36), for one model of
``benchmarks/scale.py`` (default GPT-2 124M): the kernels it runs that eager does not, and what
holds its memory.

One fresh process per variant — ``eager``; ``fx_graph`` and ``fx_trace`` (``flowexec.compile`` of
the whole step, ``fuse=False``); ``fx_graph_fused`` (``fuse="inductor"``) — each records

1. the kernels of one steady step (torch.profiler): count and GPU time per kernel name and per
   family (the kernel's template with the first ``at::native`` functor inside it, so that
   ``direct_copy`` copies and ``CUDAFunctor_add`` adds are told apart); the parent diffs every
   variant against eager (``kernels_vs_eager``: what flowexec runs that eager does not, and the
   reverse);
2. memory (allocated, its running maximum, reserved) after the model and optimizer are built,
   after the eager step that creates the optimizer's state, after ``flowexec.compile(step, x, y)``
   (captures on the examples), after the first compiled call, and the peak of one steady step
   (``reset_peak_memory_stats`` before it); then what is live after that step: the 15 largest
   allocated blocks of ``torch.cuda.memory._snapshot()`` with the Python frames that allocated
   them (history recorded from before the model was built), bytes per memory pool (the default
   pool ``(0, 0)``, CUDA-graph pools otherwise), and the Python-visible CUDA tensors that are not
   parameters, gradients or optimizer state (the 15 largest with an owner found through
   ``gc.get_referrers``) — the rest of the allocated bytes have no Python tensor (a graph pool's
   intermediates).

    PYTHONPATH=. python3 benchmarks/scale_probe.py                      # GPT-2 124M, ~3-4 min on an H200
    PYTHONPATH=. python3 benchmarks/scale_probe.py --model llama_207m --variants eager,fx_graph
    PYTHONPATH=. python3 benchmarks/scale_probe.py --device cpu --tiny  # the logic, on a CPU

Writes ``$OUT/scale_probe_<model>.json`` (else benchmarks/results/).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import scale  # noqa: E402  (imports no torch)

VARIANTS = ("eager", "fx_graph", "fx_trace", "fx_graph_fused")
TOP = 15
NAME_CHARS = 300  # kernel names are templates thousands of characters long


def family(name: str) -> str:
    """A kernel's family: its template (before ``<``) and the first ``at::native`` functor or kernel
    named inside, e.g. ``unrolled_elementwise_kernel[direct_copy_kernel_cuda]``."""
    plain = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    head = plain.split("<", 1)[0].split("(", 1)[0].strip()
    rest = plain[len(head):]
    head = head.rsplit("::", 1)[-1] or head
    inner = [i for i in re.findall(r"at::native::(?:[A-Za-z_]\w*::)*([A-Za-z_]\w*)", rest)
             if i != head and i not in _WRAPPERS]
    if not inner and rest.startswith("<"):  # e.g. cutlass::Kernel2<cutlass_80_tensorop_...>
        inner = [re.split(r"[<>,(]", rest[1:], maxsplit=1)[0].strip()[:100]]
    return f"{head}[{inner[0]}]" if inner and inner[0] else head[:120]


_WRAPPERS = {"gpu_kernel_impl", "gpu_kernel_impl_nocast", "BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor",
             "TensorIteratorBase", "launch_vectorized_kernel", "launch_legacy_kernel"}


def mem_point(dev: Any) -> dict[str, Any]:
    import torch

    if dev.type != "cuda":
        import resource

        return {"rss_max_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    torch.cuda.synchronize()
    return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30}


def short_frames(frames: list[dict[str, Any]], keep: int = 8) -> list[str]:
    """The frames worth reading (flowexec, the benchmark, the model's library), innermost first,
    plus the innermost frame whatever it is."""
    def fmt(f: dict[str, Any]) -> str:
        path = f.get("filename", "?").split("/")
        return f"{'/'.join(path[-3:])}:{f.get('line', '?')} {f.get('name', '?')}"
    mine = [f for f in frames if any(s in f.get("filename", "") for s in
                                     ("flowexec", "benchmarks", "transformers", "torchvision"))]
    out = [fmt(f) for f in frames[:1]] + [fmt(f) for f in mine if f is not frames[0]][:keep - 1]
    return out


def snapshot_summary() -> dict[str, Any]:
    """The largest allocated blocks (with their allocation frames) and bytes per memory pool."""
    import torch

    snap = torch.cuda.memory._snapshot()
    pools: dict[str, dict[str, int]] = {}
    blocks = []
    for seg in snap.get("segments", []):
        pool = str(tuple(seg.get("segment_pool_id", (0, 0))))
        p = pools.setdefault(pool, {"reserved": 0, "allocated": 0, "blocks": 0, "pending_free": 0})
        p["reserved"] += seg.get("total_size", 0)
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":
                p["allocated"] += b["size"]
                p["blocks"] += 1
                blocks.append((b["size"], pool, seg.get("stream"), b.get("frames", [])))
            elif b.get("state") == "active_pending_free":
                p["pending_free"] += b["size"]
    blocks.sort(key=lambda t: -t[0])
    return {"pools_gib": {k: {kk: (vv / 2**30 if kk != "blocks" else vv) for kk, vv in v.items()}
                          for k, v in sorted(pools.items(), key=lambda kv: -kv[1]["allocated"])},
            "pools_note": "pool (0, 0) is the caching allocator's default pool; any other is a CUDA-graph pool",
            "largest_blocks": [{"mib": s / 2**20, "pool": pool, "stream": stream, "frames": short_frames(fr)}
                               for s, pool, stream, fr in blocks[:TOP]]}


def owner_of(t: Any, exclude: set[int], budget: list[int]) -> str:
    """A path from an object that is not a builtin container down to ``t`` (depth <= 4), e.g.
    ``CudaGraphRunner.__dict__['static_outputs'][2]``; '?' when none is found within ``budget[0]``
    calls of ``gc.get_referrers`` (each walks every object: ~50 ms beside transformers and Inductor)."""
    import gc

    frontier: list[tuple[Any, str]] = [(t, "")]
    seen = {id(t)}
    for _ in range(4):
        nxt = []
        for obj, path in frontier:
            if budget[0] <= 0:
                return "?"
            budget[0] -= 1
            for r in gc.get_referrers(obj):
                if id(r) in exclude or id(r) in seen or type(r).__name__ == "frame":
                    continue
                seen.add(id(r))
                if isinstance(r, dict):
                    key = next((repr(k) for k, v in r.items() if v is obj), "?")
                    nxt.append((r, f"[{key}]{path}"))
                elif isinstance(r, (list, tuple)):
                    idx = next((i for i, v in enumerate(r) if v is obj), "?")
                    nxt.append((r, f"[{idx}]{path}"))
                elif type(r).__module__ != "builtins":
                    try:  # an attribute stored inline (no __dict__ object in between)
                        attr = next((f".{k}" for k, v in vars(r).items() if v is obj), "")
                    except TypeError:
                        attr = ""
                    return f"{type(r).__module__}.{type(r).__qualname__}{attr}{path}"
        # a dict that is some object's __dict__: name the object
        for r, path in nxt:
            if isinstance(r, dict) and budget[0] > 0:
                budget[0] -= 1
                for rr in gc.get_referrers(r):
                    if getattr(rr, "__dict__", None) is r:
                        return f"{type(rr).__module__}.{type(rr).__qualname__}.__dict__{path}"
        frontier = nxt
    return "?"


def tensor_census(m: Any, opt: Any, dev: Any) -> dict[str, Any]:
    """Allocated bytes split into parameters, gradients, optimizer state, other Python-visible
    CUDA tensors (the largest with their owners) and the rest (no Python tensor)."""
    import gc

    import torch

    def key(t: Any) -> tuple[int, int]:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()

    groups = {"parameters": [p for p in m.parameters()],
              "gradients": [p.grad for p in m.parameters() if p.grad is not None],
              "optimizer_state": [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]}
    seen: set[tuple[int, int]] = set()
    out: dict[str, Any] = {}
    for g, ts in groups.items():
        ks = {key(t) for t in ts if t.device.type == dev.type} - seen
        seen |= ks
        out[f"{g}_gib"] = sum(n for _, n in ks) / 2**30
    others: dict[tuple[int, int], Any] = {}
    for obj in gc.get_objects():
        try:
            plain = type(obj) in (torch.Tensor, torch.nn.Parameter)  # not fakes or other subclasses
            if plain and obj.device.type == dev.type:
                k = key(obj)
                if k not in seen and k[0] != 0:
                    others.setdefault(k, obj)
        except Exception:  # tensors without storage (subclasses, fakes)
            continue
    out["other_python_tensors_gib"] = sum(n for _, n in others) / 2**30
    if dev.type == "cuda":
        out["allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        out["no_python_tensor_gib"] = out["allocated_gib"] - sum(v for k, v in out.items() if k.endswith("_gib")
                                                                 and k != "allocated_gib")
    largest = sorted(others.items(), key=lambda kv: -kv[0][1])[:TOP]
    exclude = {id(others), id(largest)} | {id(pair) for pair in largest}
    out["largest_other"] = [{"mib": n / 2**20, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                             "owner": owner_of(t, exclude, [8])} for (_, n), t in largest]
    return out


def probe(model: str, variant: str, dev: Any, tiny: bool, history: bool) -> dict[str, Any]:
    import torch

    res: dict[str, Any] = {"model": model, "variant": variant, "memory": {}}
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        if history:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    res["env"] = scale.env_meta(dev)
    mem = res["memory"]
    w = scale.build(model, dev, tiny)
    m, x, y = w.module, w.x, w.y
    res["model_desc"] = w.desc
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    mem["built"] = mem_point(dev)
    step = scale.make_step(w, m, opt, dev)
    step(x, y)
    mem["after_eager_step"] = mem_point(dev)
    if variant == "eager":
        call = step
    else:
        import flowexec

        opts = scale.flowexec_options(variant)
        res["options"] = opts
        t0 = time.perf_counter()
        exe = flowexec.compile(step, x, y, **opts)  # captures on the examples (no step is taken)
        mem["after_compile"] = mem_point(dev) | {"captured": getattr(exe, "build_seconds", None) is not None}
        exe(x, y)
        mem["after_first_call"] = mem_point(dev) | {"captured": getattr(exe, "build_seconds", None) is not None}
        for _ in range(2):  # a flowexec whose first call runs eagerly captures on a later one
            if getattr(exe, "build_seconds", None) is not None:
                break
            exe(x, y)
            mem["after_capturing_call"] = mem_point(dev)
        res["build_s"] = time.perf_counter() - t0
        res["flowexec_build_seconds"] = getattr(exe, "build_seconds", None)
        st = exe.plan.stats()
        res["plan"] = {k: st[k] for k in ("ops", "fused_regions", "fused_kernels", "fusion_fallbacks",
                                          "planned_peak_bytes", "lower_bound_bytes", "frees") if k in st}
        call = exe
    for _ in range(2):
        call(x, y)
    scale.sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    call(x, y)
    scale.sync(dev)
    res["step_ms_one"] = (time.perf_counter() - t0) * 1e3
    mem["steady_step"] = mem_point(dev)
    if dev.type == "cuda":
        mem["steady_step"]["step_peak_gib"] = mem["steady_step"].pop("max_allocated_gib")
        mem["steady_step"]["note"] = "step_peak_gib: max_memory_allocated over one step, reset before it"
    prof = scale.profile_step(lambda: call(x, y), dev, names=True)
    by_name: dict[str, dict[str, float]] = {}
    fams: dict[str, dict[str, float]] = {}
    for name, v in prof.pop("by_name", {}).items():
        for table, k in ((by_name, name[:NAME_CHARS]), (fams, family(name))):
            e = table.setdefault(k, {"count": 0, "us": 0.0})
            e["count"] += v["count"]
            e["us"] += v["us"]
    res["kernels"] = prof | {"by_family": fams, "by_name": by_name}
    if dev.type == "cuda" and history:
        try:
            res["snapshot"] = snapshot_summary()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    res["live"] = tensor_census(m, opt, dev)
    return res


def diff(var: dict[str, Any], ref: dict[str, Any], key: str, n: int) -> dict[str, Any]:
    a, b = var.get(key, {}), ref.get(key, {})
    rows = []
    for k in set(a) | set(b):
        ca, cb = a.get(k, {}).get("count", 0), b.get(k, {}).get("count", 0)
        ua, ub = a.get(k, {}).get("us", 0.0), b.get(k, {}).get("us", 0.0)
        if ca != cb or abs(ua - ub) > 1.0:
            rows.append({"kernel": k, "count": ca - cb, "us": ua - ub, "eager_count": cb})
    more = sorted((r for r in rows if r["count"] > 0), key=lambda r: (-r["count"], -r["us"]))[:n]
    fewer = sorted((r for r in rows if r["count"] < 0), key=lambda r: (r["count"], r["us"]))[:n]
    return {"more_than_eager": more, "fewer_than_eager": fewer}


def child_main(a: argparse.Namespace) -> None:
    res: dict[str, Any] = {"variant": a.variant}
    try:
        import torch

        res = probe(a.model, a.variant, torch.device(a.device), a.tiny, a.history)
    except BaseException:
        res["error"] = scale.tail(traceback.format_exc(), 40)
        print(res["error"], file=sys.stderr, flush=True)
    finally:
        with open(a.result, "w") as fh:
            json.dump(res, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2_124m", choices=scale.MODELS)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--history", action=argparse.BooleanOptionalAction, default=True,
                    help="record allocation stacks (torch.cuda.memory._record_memory_history) for the snapshot")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("-o", "--output", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child_main(a)
    variants = a.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if a.device == "cpu":
        variants = [v for v in variants if not v.startswith("fx_graph")]
    path = a.output or os.path.join(os.environ.get("OUT") or os.path.join(HERE, "results"),
                                    f"scale_probe_{a.model}{'_tiny' if a.tiny else ''}.json")
    out: dict[str, Any] = {"benchmark": "scale_probe", "model": a.model, "tiny": a.tiny,
                           "command": "PYTHONPATH=. python3 benchmarks/scale_probe.py " + " ".join(sys.argv[1:]),
                           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                           "variants": {}}
    cache = tempfile.mkdtemp(prefix="scale_probe_cache_")
    try:
        for v in variants:
            print(f"[{time.strftime('%H:%M:%S')}] {a.model}/{v} ...", flush=True)
            fd, result = tempfile.mkstemp(prefix=f"scale_probe_{v}_", suffix=".json")
            os.close(fd)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", a.model, "--variant", v,
                   "--device", a.device, "--result", result] + ["--tiny"] * a.tiny + ["--no-history"] * (not a.history)
            try:
                res, log, wall, err = scale.spawn(cmd, cache, a.timeout, result)
            finally:
                os.unlink(result)
            res["process_s"] = wall
            if err is not None and "error" not in res:
                res["error"] = err + "\n" + scale.tail(log, 40)
            for k, val in res.pop("env", {}).items():
                out.setdefault(k, val)
            out["variants"][v] = res
            print(f"    {'FAILED: ' + res['error'] if 'error' in res else 'ok'} ({wall:.0f} s)", flush=True)
            ref = out["variants"].get("eager", {}).get("kernels")
            for name, r in out["variants"].items():
                if name != "eager" and ref and r.get("kernels"):
                    k = r["kernels"]
                    count = "kernels_per_step" if ref.get("kernels_per_step") is not None else "aten_ops_per_step"
                    r["kernels_vs_eager"] = {
                        "counted": count,
                        "kernels": (k.get(count) or 0) - (ref.get(count) or 0),
                        "gpu_kernel_ms": (k.get("gpu_kernel_ms") or 0) - (ref.get("gpu_kernel_ms") or 0),
                        "by_family": diff(k, ref, "by_family", 30), "by_name": diff(k, ref, "by_name", 30)}
            scale.write(out, path)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print(f"wrote {path}")
    summary(out)


def summary(out: dict[str, Any]) -> None:
    for name, r in out["variants"].items():
        if "error" in r:
            print(f"{name}: FAILED")
            continue
        k, mem = r.get("kernels", {}), r.get("memory", {})
        steady = mem.get("steady_step", {})
        n, what = k.get("kernels_per_step"), "kernels"
        if n is None:
            n, what = k.get("aten_ops_per_step"), "ATen ops (CPU)"
        print(f"{name}: {n} {what}, {fmt(k.get('gpu_kernel_ms'))} ms GPU; memory "
              + ", ".join(f"{p} {fmt(v.get('allocated_gib'))}" for p, v in mem.items() if isinstance(v, dict))
              + f" GiB; steady step peak {fmt(steady.get('step_peak_gib'))} GiB")
        d = r.get("kernels_vs_eager")
        if d:
            print(f"  vs eager: {d['kernels']:+d} {what}, {d['gpu_kernel_ms']:+.2f} ms GPU; more: "
                  + "; ".join(f"{e['kernel']} {e['count']:+d}" for e in d["by_family"]["more_than_eager"][:6]))
        live = r.get("live")
        if live:
            print("  live after a step (GiB): " + ", ".join(f"{k.removesuffix('_gib')} {v:.2f}" for k, v in live.items()
                                                        if k.endswith("_gib")))


def fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


if __name__ == "__main__":
    main()
