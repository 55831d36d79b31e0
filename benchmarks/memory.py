"""Memory, planned against achieved, in one run: the figures of docs/memory.md.

* per model (the MLP, the transformer block; training steps in trace mode): planned peak, lower
  bound, achieved peak (CUDA allocator statistics; tracked storages on CPU) with memory="normal"
  and "planned" and each order; arena size against the arena's lower bound; eager's peak;
* graph mode (CUDA): peak during a replay and memory held between calls;
* GPT-2 (transformers) through the torch.compile backend: eager, trace and graph peaks;
* GPipe-order micro-batches through the backend's graph mode: memory held and reserved between
  steps, and time per step, against eager (the 348 / 69 MiB case of the former microbatch.py,
  docs/history.md), also with memory="planned" (the micro-batches'
  graphs of one program share its arena) and with pool="shared" (every graph in one pool, through
  PyTorch's CUDA-graph trees), next to the stock cudagraphs backend (trees too);
* main-thread time per step, gc="async" against "fast", on a model of many small intermediates.

    PYTHONPATH=. python3 benchmarks/memory.py --out benchmarks/results            # GPU, < 3 min
    PYTHONPATH=. python3 benchmarks/memory.py --device cpu --quick --out /tmp/mem  # CPU smoke run

Writes memory.json (memory_cpu_quick.json for the CPU smoke run).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from host_meta import host_meta  # noqa: E402
import flowexec  # noqa: E402
from flowexec.models import Block, lm_loss, make_mlp, make_step  # noqa: E402
from flowexec.runtime.gc import collector  # noqa: E402
from flowexec.runtime.memtrack import achieved_peak, measure_memory  # noqa: E402

MiB = 2 ** 20


def _known(model: torch.nn.Module, opt: torch.optim.Optimizer, args: tuple) -> list[Any]:
    known: list[Any] = list(model.parameters()) + [p.grad for p in model.parameters() if p.grad is not None]
    known += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return known + [a for a in args if isinstance(a, torch.Tensor)]


def model_rows(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    """Trace-mode training steps: planned / lower bound / achieved / arena, per memory mode and order."""
    if quick:
        mlp, bx = make_mlp(64, 3), 32
        block, bt = Block(dim=32), (2, 16)
    else:
        mlp, bx = make_mlp(1024, 8), 2048
        block, bt = Block(vocab=512, dim=512, heads=8, seq=256), (16, 256)
    cases = {
        "mlp": (mlp, lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), F.cross_entropy,
                lambda: (torch.randn(bx, mlp[0].in_features, device=dev), torch.randint(0, 10, (bx,), device=dev))),
        "transformer_block": (block, lambda ps: torch.optim.Adam(ps, lr=1e-3, foreach=True, capturable=dev.type == "cuda"),
                              lm_loss, lambda: (torch.randint(0, block.emb.num_embeddings, bt, device=dev),
                                                torch.randint(0, block.emb.num_embeddings, bt, device=dev))),
    }
    rows = []
    for name, (model, make_opt, loss_fn, batch) in cases.items():
        model = model.to(dev)
        opt = make_opt(model.parameters())
        step = make_step(model, opt, loss_fn)
        args = batch()
        step(*args)  # optimizer state exists before capture
        eager_peak, _ = achieved_peak(lambda: step(*args), _known(model, opt, args), dev)
        rows.append({"model": name, "run": "eager", "achieved_peak_bytes": eager_peak})
        for memory in ("normal", "planned"):
            for order in ("program", "memory"):
                for gc_mode in (("fast", "async") if memory == "normal" and order == "program" else ("fast",)):
                    exe = flowexec.compile(step, *args, memory=memory, order=order, gc=gc_mode)
                    exe(*args)
                    r = measure_memory(exe, *args)
                    r.pop("result")
                    st = exe.plan.stats()
                    rows.append({"model": name, "run": "trace", "memory": memory, "order": order, "gc": gc_mode, **r,
                                 "arena_lower_bound_bytes": st.get("arena_lower_bound_bytes", 0),
                                 "arena_over_lower_bound": (st["arena_bytes"] / st["arena_lower_bound_bytes"]
                                                            if st.get("arena_lower_bound_bytes") else None),
                                 "unplanned_buffers": st.get("unplanned_buffers")})
        if dev.type == "cuda":
            exe = None  # the last trace-mode executable (its arena) must not die after `before`
            gc.collect()
            for memory in ("normal", "planned"):
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                exe = flowexec.compile(step, *args, mode="graph", memory=memory)
                exe(*args)
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated() - before
                peak, _ = achieved_peak(lambda: exe(*args), (), dev)
                rows.append({"model": name, "run": "graph", "memory": memory, "replay_peak_bytes": peak,
                             "held_between_calls_bytes": held,
                             "reserved_bytes": torch.cuda.memory_reserved()})
                exe = None
                gc.collect()
                torch.cuda.empty_cache()
        print(name, "done", flush=True)
    return rows


def gpt2_rows(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    """GPT-2 training steps through the backend: eager, trace, graph peaks."""
    try:
        import transformers
    except ImportError:
        return [{"skipped": "transformers is not installed"}]
    if quick:
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        shape = (2, 12)
    else:
        cfg = transformers.GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=256,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        shape = (8, 256)
    rows = []
    modes = ["eager", "trace"] + (["graph"] if dev.type == "cuda" else [])
    for mode in modes:
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = transformers.GPT2LMHeadModel(cfg).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        run = model if mode == "eager" else torch.compile(model, backend="flowexec", options={"mode": mode})
        ids = torch.randint(0, cfg.vocab_size, shape, device=dev)

        def step() -> Any:
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(run(input_ids=ids, use_cache=False).logits.flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            return loss

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                step()
            peak, _ = achieved_peak(step, _known(model, opt, (ids,)), dev)
        rows.append({"model": "gpt2", "run": mode, "achieved_peak_bytes": peak,
                     "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters())})
        print("gpt2", mode, "done", flush=True)
    return rows


def _private_pool_bytes() -> int:
    """Bytes of CUDA memory reserved in graph pools (every segment not of the default pool): what
    only CUDA graphs can use. Private-pool graphs keep one pool each, the trees one per device."""
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))


def _touch_blas(dev: torch.device) -> None:
    """Let cuBLAS and cuBLASLt keep their workspaces for the current stream (the caching
    allocator counts them): CUDA-graph trees free every workspace around each warm-up and
    recording, so without this a tree row's memory between steps would come out short by them."""
    a = torch.ones(8, 8, device=dev)
    (a @ a + torch.addmm(a[0], a, a)).sum().item()


MICROBATCH_RUNS = ("eager", "trace", "graph", "graph+planned", "graph+shared", "cudagraphs")


def microbatch_rows(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    """GPipe order (every forward, then every backward) through the backend: memory between steps
    and time per step. Rows: eager; flowexec's trace and graph modes (private pools, with the
    arena, and pool="shared": PyTorch's CUDA-graph trees); the stock cudagraphs backend (trees
    too) as the peer. With trees, outputs replayed on their fast path are tensors over pool memory
    the allocator does not count (``uncounted_tree_output_bytes``), so a row's held bytes are
    allocated plus those."""
    if dev.type != "cuda":
        return [{"skipped": "graph mode needs CUDA"}]
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    from flowexec.runtime.graph_trees import uncounted_output_bytes

    width, batch, n_mb = (1024, 4096, 4) if not quick else (256, 256, 4)
    warm, timed = 3, 10
    rows = []
    for run_name in MICROBATCH_RUNS:
        torch.manual_seed(0)
        torch._dynamo.reset()
        reset_cudagraph_trees()
        gc.collect()
        # CUDA-graph trees free every cuBLAS workspace (one per handle and stream, 32 MiB on the
        # H200) before they record; workspaces earlier rows left on other streams would then
        # leave the count inside this row, below its base. Every row starts without them.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        model = make_mlp(width, 4).to(dev)
        mode, *extra = run_name.split("+")
        options = {"mode": mode, "cache_size": 8, **({"memory": "planned"} if "planned" in extra else {}),
                   **({"pool": "shared"} if "shared" in extra else {})}
        if run_name == "eager":
            run = model
        elif run_name == "cudagraphs":
            run = torch.compile(model, backend="cudagraphs")
        else:
            run = torch.compile(model, backend="flowexec", options=options)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        data = [(torch.randn(batch // n_mb, width, device=dev), torch.randint(0, 10, (batch // n_mb,), device=dev))
                for _ in range(n_mb)]
        _touch_blas(dev)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            losses = [F.cross_entropy(run(x), y) for x, y in data]
            for loss in losses:
                loss.backward()
            opt.step()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(warm):  # trees: warm-up, recording, first replay
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(timed):
                step()
            torch.cuda.synchronize()
            step_s = (time.perf_counter() - t0) / timed
        _touch_blas(dev)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated() - base
        uncounted = uncounted_output_bytes(torch.cuda.current_device()) if "shared" in extra or run_name == "cudagraphs" else 0
        rows.append({"model": f"mlp{width}x4 b{batch} {n_mb} micro-batches gpipe", "run": run_name,
                     "step_ms": step_s * 1e3,
                     "allocated_between_steps_bytes": allocated,
                     "uncounted_tree_output_bytes": uncounted,
                     "held_between_steps_bytes": allocated + (uncounted or 0),
                     "reserved_between_steps_bytes": torch.cuda.memory_reserved(),
                     "graph_pool_reserved_bytes": _private_pool_bytes()})
        print("microbatch", run_name, f"{step_s * 1e3:.2f} ms/step", flush=True)
        del run, model, opt, step
    eager = rows[0]["held_between_steps_bytes"]
    eager_ms = rows[0]["step_ms"]
    for r in rows:
        r["over_eager"] = r["held_between_steps_bytes"] / eager if eager else None
        r["step_time_over_eager"] = r["step_ms"] / eager_ms if eager_ms else None
    torch._dynamo.reset()
    reset_cudagraph_trees()
    return rows


def gc_rows(dev: torch.device, quick: bool) -> list[dict[str, Any]]:
    """Main-thread time per step, async against fast, on many small intermediates."""
    n = 64 if quick else 256

    def many(x: torch.Tensor) -> torch.Tensor:
        for k in range(200):
            x = (x * 1.0001 + 0.001).relu()
        return x.sum()

    x = torch.randn(n, n, device=dev)
    rows = []
    steps = 20 if quick else 200
    for gc_mode in ("fast", "async"):
        exe = flowexec.compile(many, x, gc=gc_mode)
        for _ in range(3):
            exe(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            exe(x)
        host = (time.perf_counter() - t0) / steps
        if dev.type == "cuda":
            torch.cuda.synchronize()
        collector().drain()
        peak = measure_memory(exe, x)["achieved_peak_bytes"]
        rows.append({"model": "200 small elementwise ops", "gc": gc_mode, "main_thread_ms_per_step": host * 1e3,
                     "achieved_peak_bytes": peak})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small models (the CPU smoke run)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    t0 = time.time()
    res: dict[str, Any] = host_meta(" ".join(sys.argv))
    if dev.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(dev)
    res["models"] = model_rows(dev, a.quick)
    res["gpt2_backend"] = gpt2_rows(dev, a.quick)
    res["microbatch_gpipe"] = microbatch_rows(dev, a.quick)
    res["gc_main_thread"] = gc_rows(dev, a.quick)
    res["seconds"] = time.time() - t0
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "memory.json" if dev.type == "cuda" and not a.quick else f"memory_{dev.type}{'_quick' if a.quick else ''}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)
    for section in ("models", "gpt2_backend", "microbatch_gpipe", "gc_main_thread"):
        for r in res[section]:
            print(section, {k: (f"{v / MiB:.2f}MiB" if k.endswith("bytes") and isinstance(v, int) else v) for k, v in r.items()})
    print("wrote", path, f"in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
