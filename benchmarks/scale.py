"""One training step at the sizes people train (issue 36): eager, torch.compile, reduce-overhead,
the flowexec backend and ``flowexec.compile`` of the whole step, every variant in a fresh process.

Models: GPT-2 124M (Hugging Face config, batch 8 x 1024), ResNet-50 (torchvision, batch 64 at
224 x 224, channels_last) and a Llama-style decoder (transformers' LlamaForCausalLM, ~207M
parameters: 12 layers, 1024 wide, 16 heads with 8 key/value heads, SwiGLU 2816, vocabulary
32,000, batch 8 x 1024). The step is the anchors' (``../shared/reference/scale_anchors_gpu.py``):
``zero_grad(set_to_none=True)``, forward under bf16 autocast, cross-entropy in float32,
``backward()``, ``AdamW(fused=True).step()``; TF32 on; the median of 30 steps, each followed by a
synchronize, after 5 untimed ones.

Variants (one fresh process each, with a fresh TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR):

- ``eager``; ``inductor`` (``torch.compile(model)``); ``reduce_overhead``
  (``torch.compile(model, mode="reduce-overhead")``); ``backend``
  (``torch.compile(model, backend="flowexec", options={"mode": "graph"})``, "trace" on a CPU):
  the model compiled, the optimizer eager, as in the anchors;
- ``fx_trace``, ``fx_trace_fused``, ``fx_graph``, ``fx_graph_fused``: ``flowexec.compile`` of the
  whole step function (zero_grad, forward, backward, optimizer step) in trace / graph mode with
  ``fuse=False`` / ``fuse="inductor"``, with flowexec's defaults otherwise. Its first call,
  timed as ``first_call_s``, makes AdamW's state as flowexec's default does (since f463ca8:
  AdamW's own initialisation before the first capture, which then captures the steps);
  ``SCALE_FIRST_STEP=planned`` runs the first step's program instead and the second call
  captures the steps (every run from b730040 to f463ca8), ``SCALE_FIRST_STEP=eager`` runs fn
  eagerly (every run before b730040).

Per variant: median step (ms); build time (s): torch.compile's 3 warm-up steps, eager's too, and
for flowexec the calls after the first up to the one that captured (capture, fusion, plan,
CUDA-graph capture), on a cold compile cache; for ``inductor`` and the fused flowexec variants
also ``build_s_warm``, the same build in another fresh process on the cache the cold one filled;
peak memory (``torch.cuda.max_memory_allocated`` over the process, read after the timed steps);
kernels in one step (torch.profiler; the JSON says what was counted for CUDA-graph replays);
FLOPs of one step (FlopCounterMode over one eager step of the same model in that process) and
MFU against a dense bf16 matmul peak measured in the same run; the first 5 steps' losses,
checked against eager's (``loss_check``); what its cold builds compiled (``cache_census``: Triton
compiles, Inductor's kernels and modules). A variant that fails records its error.

Per model: ``vs_torch_compile`` = the better step time of ``inductor`` and ``reduce_overhead``
divided by the best flowexec whole-step variant's; ``peak_vs_eager`` = that variant's peak
divided by eager's.

    PYTHONPATH=. python3 benchmarks/scale.py --models gpt2_124m                # one model (see --estimate)
    PYTHONPATH=. python3 benchmarks/scale.py --models resnet50 --variants eager,inductor -o $OUT/r.json
    PYTHONPATH=. python3 benchmarks/scale.py --merge $OUT/a.json $OUT/b.json -o benchmarks/results/scale.json
    PYTHONPATH=. python3 benchmarks/scale.py --device cpu --tiny               # the logic, on a CPU
    python3 benchmarks/scale.py --estimate --models gpt2_124m,resnet50         # the time it would take

Writes ``$OUT/scale.json`` (or benchmarks/results/scale.json; ``scale_cpu.json`` on a CPU) after
every variant, so a run cut short keeps what finished. The parent process imports no torch.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import math
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODELS = ("gpt2_124m", "resnet50", "llama_207m")
VARIANTS = ("eager", "inductor", "reduce_overhead", "backend", "fx_trace", "fx_trace_fused", "fx_graph",
            "fx_graph_fused")
TORCH_COMPILE = ("inductor", "reduce_overhead")
WHOLE_STEP = ("fx_trace", "fx_trace_fused", "fx_graph", "fx_graph_fused")
CUDA_ONLY = ("reduce_overhead", "fx_graph", "fx_graph_fused")
WARM = ("inductor", "fx_trace_fused", "fx_graph_fused")  # re-built on the cache their cold run filled
CHECKED_STEPS = 5  # steps whose loss is kept, all before timing
LOSS_RTOL = 0.02  # bf16 autocast: kernels that round differently move the loss by ~1e-3

# Seconds a variant's process takes on an H200 (cold build, 30 steps, profile, FLOP count, startup),
# and its warm-cache rebuild: guesses from the anchors' warm-ups until a run of this script has
# measured them (then the output file's ``process_s`` is used instead).
EST_H200 = {
    "gpt2_124m": {"eager": 20, "inductor": 55, "reduce_overhead": 50, "backend": 90, "fx_trace": 45,
                  "fx_trace_fused": 100, "fx_graph": 50, "fx_graph_fused": 100},
    "resnet50": {"eager": 20, "inductor": 75, "reduce_overhead": 65, "backend": 110, "fx_trace": 50,
                 "fx_trace_fused": 120, "fx_graph": 55, "fx_graph_fused": 120},
    "llama_207m": {"eager": 25, "inductor": 65, "reduce_overhead": 60, "backend": 100, "fx_trace": 50,
                   "fx_trace_fused": 110, "fx_graph": 55, "fx_graph_fused": 110},
}
EST_WARM_H200 = {"inductor": 30, "fx_trace_fused": 40, "fx_graph_fused": 45}


# --------------------------------------------------------------------------------------------
# The child: one variant of one model, in a fresh process (everything below imports torch lazily)
# --------------------------------------------------------------------------------------------

class Workload:
    """A model, its batch and its loss; ``units`` (tokens or images) per step."""

    def __init__(self, module: Any, x: Any, y: Any, loss: Callable[..., Any], desc: str, units: int, unit: str) -> None:
        self.module, self.x, self.y, self.loss, self.desc, self.units, self.unit = module, x, y, loss, desc, units, unit


def build(model: str, dev: Any, tiny: bool) -> Workload:
    """The model at its benchmark size (``tiny``: a few-layer version of the same family)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if model == "gpt2_124m":  # as the anchors: Hugging Face GPT-2 small, dropout 0
        from transformers import GPT2Config, GPT2LMHeadModel

        size = (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=211, n_positions=32) if tiny else
                dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024))
        b, t = (2, 32) if tiny else (8, 1024)
        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **size)
        m = GPT2LMHeadModel(cfg).to(dev)
        x = torch.randint(0, cfg.vocab_size, (b, t), device=dev)

        def lm_loss(f: Any, x: Any, y: Any) -> Any:
            return F.cross_entropy(f(input_ids=x, use_cache=False).logits.flatten(0, 1).float(), y.flatten())
        return Workload(m, x, x, lm_loss, f"transformers GPT2LMHeadModel {size}, batch {b} x {t}", b * t, "tokens")
    if model == "llama_207m":  # a Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped KV
        from transformers import LlamaConfig, LlamaForCausalLM

        size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=32) if tiny else
                dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1024))
        b, t = (2, 32) if tiny else (8, 1024)
        cfg = LlamaConfig(attention_dropout=0.0, tie_word_embeddings=False, **size)
        m = LlamaForCausalLM(cfg).to(dev)
        x = torch.randint(0, cfg.vocab_size, (b, t), device=dev)

        def llama_loss(f: Any, x: Any, y: Any) -> Any:
            return F.cross_entropy(f(input_ids=x, use_cache=False).logits.flatten(0, 1).float(), y.flatten())
        attn = getattr(m.config, "_attn_implementation", "?")
        return Workload(m, x, x, llama_loss, f"transformers LlamaForCausalLM {size}, attention {attn}, batch {b} x {t}",
                        b * t, "tokens")
    if model == "resnet50":
        cl = torch.channels_last
        if tiny:  # torchvision is not on every CPU machine (PyPI's breaks beside some torch builds)
            m = standin_resnet().to(dev).to(memory_format=cl)
            x = torch.randn(4, 3, 32, 32, device=dev).to(memory_format=cl)
            y = torch.randint(0, 10, (4,), device=dev)
            desc = ("STAND-IN, not torchvision: a hand-written bottleneck ResNet (2 blocks, conv/batch norm/ReLU, "
                    "the same step structure), batch 4 at 32 x 32, channels_last")
        else:
            import torchvision

            m = torchvision.models.resnet50().to(dev).to(memory_format=cl)
            x = torch.randn(64, 3, 224, 224, device=dev).to(memory_format=cl)
            y = torch.randint(0, 1000, (64,), device=dev)
            desc = f"torchvision {torchvision.__version__} resnet50, batch 64 at 224 x 224, channels_last"

        def image_loss(f: Any, x: Any, y: Any) -> Any:
            return F.cross_entropy(f(x).float(), y)
        return Workload(m, x, y, image_loss, desc, x.shape[0], "images")
    raise SystemExit(f"unknown model {model!r}; choose from {', '.join(MODELS)}")


def standin_resnet() -> Any:
    """A small ResNet of torchvision's bottleneck blocks (1x1, 3x3, 1x1 convs, batch norm, ReLU,
    a projected shortcut), for ``--tiny`` where torchvision is not installed."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            return self.relu(self.body(x) + self.down(x))

    return nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                         nn.MaxPool2d(2), Bottleneck(16, 8, 1), Bottleneck(32, 16, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(dev: Any) -> dict[str, Any]:
    """Dense bf16 matmul throughput (TFLOP/s): the best of square products timed back to back
    (CUDA events on a GPU, the host clock on a CPU); the MFU's denominator."""
    import torch

    sizes, reps = ((8192, 16384), 10) if dev.type == "cuda" else ((256, 512), 5)
    best: dict[str, Any] = {"tflops": 0.0}
    g = torch.Generator(device=dev).manual_seed(1)  # the global RNG stays as build() seeds it
    for n in sizes:
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16, generator=g)
        c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.mm(a, b, out=c)
        sync(dev)
        if dev.type == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(reps):
                torch.mm(a, b, out=c)
            t1.record()
            sync(dev)
            sec = t0.elapsed_time(t1) / 1e3 / reps
        else:
            s = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b, out=c)
            sec = (time.perf_counter() - s) / reps
        tflops = 2 * n**3 / sec / 1e12
        if tflops > best["tflops"]:
            best = {"tflops": tflops, "n": n, "dtype": "bfloat16", "reps": reps,
                    "how": "torch.mm(n x n, n x n) back to back, "
                           + ("CUDA events" if dev.type == "cuda" else "host clock")}
        del a, b, c
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return best


def kernel_summary(prof: Any, cuda: bool) -> dict[str, Any]:
    """What one profiled step ran: CUDA kernels (and copies, memsets, graph launches, launch
    calls) on a GPU; ATen ops called from outside other ATen ops on a CPU; and the count and
    time of each by name (``by_name``: what a captured step runs beyond eager, and where a
    fused step's GPU time goes against torch.compile's)."""
    from collections import Counter

    from torch.autograd import DeviceType

    kernels: Counter[str] = Counter()
    kernel_us: Counter[str] = Counter()
    memcpy = memset = graph_launches = launch_calls = top_ops = 0
    first_us, last_us = float("inf"), 0.0
    for e in prof.events():
        name = e.name
        if e.device_type == DeviceType.CUDA:
            first_us, last_us = min(first_us, e.time_range.start), max(last_us, e.time_range.end)
            if name.startswith("Memcpy"):
                memcpy += 1
            elif name.startswith("Memset"):
                memset += 1
            else:
                kernels[name] += 1
                kernel_us[name] += e.time_range.elapsed_us()
        elif "GraphLaunch" in name:
            graph_launches += 1
        elif "LaunchKernel" in name:
            launch_calls += 1
        elif name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")):
            top_ops += 1
            if not cuda:  # the CPU's "kernels": its outermost ATen ops, by name
                kernels[name] += 1
                kernel_us[name] += e.time_range.elapsed_us()
    if not cuda:
        out = {"kernels_per_step": None, "aten_ops_per_step": top_ops,
               "counted": "CPU: no kernels; aten_ops_per_step counts ATen ops not called from another ATen op"}
        out["by_name"] = {k: {"count": c, "us": kernel_us[k]} for k, c in kernels.most_common()}
        return out
    n = sum(kernels.values())
    out: dict[str, Any] = {"kernels_per_step": n, "gpu_kernel_ms": sum(kernel_us.values()) / 1e3,
                           # first device record's start to the last one's end: kernel time plus the gaps
                           "gpu_span_ms": (last_us - first_us) / 1e3 if n else None,
                           "memcpy_per_step": memcpy, "memset_per_step": memset, "graph_launches": graph_launches,
                           "kernel_launch_calls": launch_calls}
    if graph_launches == 0:
        out["counted"] = "CUDA kernel activity records (CUPTI) of one step, all launched from the host"
    elif n > launch_calls:
        out["counted"] = (f"CUDA kernel activity records (CUPTI) of one step, including the kernels inside its "
                          f"{graph_launches} CUDA-graph replay(s): CUPTI reported {n - launch_calls} more kernels "
                          f"than the host launched ({launch_calls})")
    else:
        out["counted"] = (f"CUPTI reported no kernels inside the {graph_launches} CUDA-graph replay(s): the count is "
                          f"the kernels launched outside graphs only; this step's graph kernels are NOT counted")
        out["graph_kernels_visible"] = False
    out["by_name"] = {k: {"count": c, "us": kernel_us[k]} for k, c in kernels.most_common()}
    return out


def profile_step(call: Callable[[], Any], dev: Any) -> dict[str, Any]:
    """:func:`kernel_summary` of one call of ``call`` (a step, already warm)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    with profile(activities=acts) as p:
        call()
        sync(dev)
    return kernel_summary(p, dev.type == "cuda")


def make_step(w: Workload, f: Any, opt: Any, dev: Any) -> Callable[[Any, Any], Any]:
    """The anchors' step over ``f`` (the model, or a compiled form of it); returns the loss."""
    import torch

    def step(x: Any, y: Any) -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = w.loss(f, x, y)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def env_meta(dev: Any) -> dict[str, Any]:
    import torch

    sys.path.insert(0, HERE)
    from host_meta import host_meta

    meta = host_meta("")
    meta.pop("command")
    # (where set, PYTHONPYCACHEPREFIX: bytecode read from there, as an install that carries it;
    # a torch installed without bytecode and read-only compiles what it imports in every process)
    meta["pycache_prefix"] = sys.pycache_prefix
    meta["host_cpu"] = meta.pop("device")
    meta["device"] = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    meta["cuda"] = torch.version.cuda
    from importlib.metadata import PackageNotFoundError, version

    for name in ("triton", "transformers", "torchvision"):  # (read without importing them)
        try:
            meta[name] = version(name)
        except PackageNotFoundError:  # torchvision on the CPU machine
            meta[name] = None
    return meta


def flowexec_options(variant: str) -> dict[str, Any]:
    """The variant's options: its mode and fusion, and ``SCALE_FIRST_STEP`` where set (else
    flowexec's default first step)."""
    _, mode, *fused = variant.split("_")
    first = {"first_step": os.environ["SCALE_FIRST_STEP"]} if os.environ.get("SCALE_FIRST_STEP") else {}
    return {"mode": mode, "fuse": "inductor" if fused else False, **first}


def run_variant(model: str, variant: str, dev: Any, tiny: bool, phase: str, res: dict[str, Any],
                steps: int, peak_first: bool, save: Callable[[], None]) -> None:
    """Fill ``res`` with the variant's figures (``phase="build"``: its build time only); ``save``
    writes what is there so far, so that a crash of the profiler keeps the timed figures."""
    import torch

    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    res["env"] = env_meta(dev)
    if peak_first:
        res["matmul_peak"] = matmul_peak(dev)
    w = build(model, dev, tiny)
    m = w.module
    res.update(model_desc=w.desc, params=sum(p.numel() for p in m.parameters()), units_per_step=w.units, unit=w.unit)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    x, y = w.x, w.y
    losses: list[Any] = []  # clones: a graph's output buffer is rewritten by its next replay
    if variant in WHOLE_STEP:
        import flowexec

        opts = flowexec_options(variant)
        step = make_step(w, m, opt, dev)
        exe = flowexec.compile(step, **opts)
        res["options"] = {**opts, "first_step": exe.first_step}  # (what ran: flowexec's default where unset)
        inductor_times()  # (cleared: what the first call's compiles take, below)
        first_sampler = start_sampler(phase)
        # --profile-warm: the warm rebuild under cProfile, where its seconds go (its time then reads
        # ~1.4x): the first call's where it is the build (a prefilled first step), and the build's
        prof = cProfile.Profile() if phase == "build-profiled" else None
        if prof is not None:
            prof.enable()
        t = time.perf_counter()
        # The first call makes AdamW's state: prefilled (flowexec's default), the first call
        # captures the steps and nothing is left to time below; or the first step's program
        # (SCALE_FIRST_STEP=planned) or fn eagerly (=eager), and the build timed below is the
        # second call's, which captures the steps.
        losses.append(exe(x, y).clone())
        sync(dev)
        res["first_call_s"] = time.perf_counter() - t
        if prof is not None:
            prof.disable()
        stop_sampler(first_sampler, res, "first_call_samples", f"{model}_{variant}_{phase}_first.collapsed")
        res["first_step"] = ("planned" if exe.first_step_program is not None else
                             "prefilled" if getattr(exe, "first_step_prefilled", False) else
                             f"eager{f' ({exe.first_step_fallback})' if exe.first_step_fallback else ''}")
        if exe.first_step_program is not None:  # where the first call's seconds went (the rest: its run)
            res["first_step_build_phases"] = exe.first_step_phases
            res["first_step_plan_passes"] = dict(exe.first_step_program.pass_seconds)
        res["first_call_inductor_times"] = inductor_times()
        res["first_call_compile_workers"] = compile_workers_record()
        sampler = start_sampler(phase)
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        calls = 0
        while getattr(exe, "build_seconds", None) is None and calls < 3:  # (a first call may run eagerly)
            losses.append(exe(x, y).clone())
            calls += 1
        sync(dev)
        res["build_s"] = time.perf_counter() - t0
        stop_sampler(sampler, res, "build_samples", f"{model}_{variant}_{phase}.collapsed")
        if prof is not None:
            prof.disable()
            res["build_profile"] = top_functions(prof)
            if os.environ.get("SCALE_PROFILE_DIR"):  # the whole profile, for pstats' callers and callees
                prof.dump_stats(os.path.join(os.environ["SCALE_PROFILE_DIR"], f"{res['model']}_{variant}_warm.prof"))
        if getattr(exe, "build_seconds", None) is None:
            raise RuntimeError(f"flowexec captured nothing in {calls} calls")
        res["build_what"] = (f"flowexec.compile + {calls} call(s) until captured (capture, fusion, plan"
                             f"{', CUDA-graph capture' if opts['mode'] == 'graph' else ''}); after the first call "
                             f"(first_call_s: the first step, {res['first_step']})")
        res["calls_to_capture"] = calls
        res["flowexec_build_seconds"] = exe.build_seconds
        res["flowexec_build_phases"] = exe.build_phases  # where a warm build's seconds go
        res["kept"] = exe.kept  # whether the build loaded a kept program, or captured (and kept) one
        res["capture_run"] = exe.capture_run
        res["flowexec_plan_passes"] = dict(exe.plan.pass_seconds)  # the plan phase by step (fuse: with compiles)
        res["flowexec_build_peaks"] = exe.build_peaks  # after which phase the peak grew
        res["build_inductor_times"] = inductor_times()
        res["build_compile_workers"] = compile_workers_record()
        st = exe.plan.stats()
        res["plan"] = {k: st[k] for k in ("ops", "fused_regions", "fused_kernels", "fusion_fallbacks",
                                          "planned_peak_bytes") if k in st}
        call = exe
    else:
        if variant == "eager":
            f = m
        elif variant == "inductor":
            f = torch.compile(m)
        elif variant == "reduce_overhead":
            f = torch.compile(m, mode="reduce-overhead")
        elif variant == "backend":
            import flowexec  # noqa: F401  registers the backend

            opts = {"mode": "graph" if dev.type == "cuda" else "trace"}
            res["options"] = opts
            f = torch.compile(m, backend="flowexec", options=opts)
        else:
            raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
        call = make_step(w, f, opt, dev)
        t0 = time.perf_counter()
        for _ in range(3):
            losses.append(call(x, y).clone())
        sync(dev)
        res["build_s"] = time.perf_counter() - t0
        res["build_what"] = "3 warm-up steps (as the anchors)" + ("" if variant == "eager" else ", compiling")
    if phase.startswith("build"):
        return
    if dev.type == "cuda":  # where the peak falls: building (warm-up, capture) or the steps after
        res["build_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    while len(losses) < CHECKED_STEPS:
        losses.append(call(x, y).clone())
    res["losses"] = [float(v) for v in losses[:CHECKED_STEPS]]
    ts = []
    for _ in range(steps):
        t = time.perf_counter_ns()
        call(x, y)
        sync(dev)
        ts.append(time.perf_counter_ns() - t)
    res["step_ms"] = statistics.median(ts) / 1e6
    res["step_ms_min"] = min(ts) / 1e6
    res["timed_steps"] = steps
    res["units_per_s"] = w.units / (res["step_ms"] / 1e3)
    if dev.type == "cuda":  # (the profiled step below is one more of the same steps)
        res["steps_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        res["peak_gib"] = max(res["build_peak_gib"], res["steps_peak_gib"])
        res["peak_kind"] = ("torch.cuda.max_memory_allocated over the process, read after the timed steps "
                            "(the larger of build_peak_gib, until built, and steps_peak_gib, after)")
        res["allocated_end_gib"] = torch.cuda.memory_allocated() / 2**30
        res["reserved_end_gib"] = torch.cuda.memory_reserved() / 2**30
    else:
        import resource

        res["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        res["peak_kind"] = "CPU: the process's max RSS (Python, libraries and compilers included)"
    res["stage"] = "timed"
    save()
    try:
        res["profile"] = profile_step(lambda: call(x, y), dev)
    except Exception as e:  # a figure for the record: the rest stands
        res["profile_error"] = tail(f"{type(e).__name__}: {e}")
    if variant != "eager" and variant not in WHOLE_STEP:
        from torch._dynamo.utils import counters

        res["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                         "graph_breaks": sum(counters["graph_break"].values())}
    try:
        from torch.utils.flop_counter import FlopCounterMode

        eager_step = make_step(w, m, opt, dev)
        with FlopCounterMode(display=False) as fc:
            eager_step(x, y)
        sync(dev)
        res["flops_per_step"] = fc.get_total_flops()
    except Exception as e:
        res["flops_error"] = tail(f"{type(e).__name__}: {e}")
    res["stage"] = "done"


def tail(text: str, lines: int = 25, chars: int = 4000) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def inductor_times(n: int = 15) -> dict[str, list[float]]:
    """Inductor's and Dynamo's own timers (``torch._dynamo.utils.compilation_time_metrics``,
    which ``dynamo_timed`` fills: a cache load, a wait on the compile workers, a module's
    codegen) since the last call, which clears them: the ``n`` largest as {name: [calls,
    seconds]}, which sampled stacks, cut at Inductor's worker futures, do not show. The timers
    nest (``compile_fx_inner`` holds ``fx_codegen_and_compile``): their sum means nothing."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    top = sorted(((k, [len(v), round(sum(v), 4)]) for k, v in metrics.items()), key=lambda kv: -kv[1][1])[:n]
    metrics.clear()
    return dict(top)


def start_sampler(phase: str) -> Any:
    """A wall-time stack sampler (probes/sampler.py: Inductor's frames too) where SCALE_SAMPLE_DIR
    asks for one in a build phase, else None."""
    if not (os.environ.get("SCALE_SAMPLE_DIR") and phase.startswith("build")):
        return None
    sys.path.insert(0, os.path.join(HERE, "probes"))
    from sampler import Sampler

    return Sampler().__enter__()


def stop_sampler(sampler: Any, res: dict[str, Any], key: str, name: str) -> None:
    """Stop ``sampler`` (if any): functions' shares in ``res[key]``, stacks in SCALE_SAMPLE_DIR/name."""
    if sampler is None:
        return
    sampler.__exit__(None, None, None)
    res[key] = sampler.inclusive(60)
    with open(os.path.join(os.environ["SCALE_SAMPLE_DIR"], name), "w") as fh:
        fh.write(sampler.collapsed())


def compile_workers_record() -> dict[str, Any]:
    """What flowexec's compile workers did so far in this process (flowexec.compile_workers):
    regions sent, those this process compiled while they ran (``jobs_here``), seconds spent
    meanwhile (also in vain), those they did not compile (the count, a
    reason), and why they were turned off for the process (None: they were not)."""
    from flowexec import compile_workers
    from flowexec.fusion import compiler

    c = compiler()
    return {"setting": compile_workers.setting(), "jobs": c.worker_jobs, "jobs_here": c.worker_jobs_here,
            "seconds": round(c.worker_seconds, 3),
            "failed": len(c.worker_failures), "a_reason": next(iter(c.worker_failures.values()), None),
            "turned_off": compile_workers.off_reason()}


def top_functions(prof: cProfile.Profile, n: int = 40) -> list[str]:
    """The ``n`` functions with the most cumulative time, one line each (cProfile's own format)."""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(n)
    return [ln for ln in buf.getvalue().splitlines() if ln.strip()][-(n + 1):]


def child_main(a: argparse.Namespace) -> None:
    res: dict[str, Any] = {"model": a.model, "variant": a.variant, "phase": a.phase}
    t0 = time.perf_counter()

    def save() -> None:
        res["child_s"] = time.perf_counter() - t0
        with open(a.result, "w") as fh:
            json.dump(res, fh, indent=1)
    try:
        import torch

        dev = torch.device(a.device)
        run_variant(a.model, a.variant, dev, a.tiny, a.phase, res, a.steps, a.matmul_peak, save)
    except BaseException as e:  # the parent records it; the other variants still run
        res["error"] = tail(traceback.format_exc())
        print(res["error"], file=sys.stderr, flush=True)
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        save()


# --------------------------------------------------------------------------------------------
# The parent: runs the children, writes and merges results, computes the ratios
# --------------------------------------------------------------------------------------------

def spawn(cmd: list[str], cache: str, timeout: float, result: str) -> tuple[dict[str, Any], str, float, str | None]:
    """Run a child (a fresh process, its own compile caches under ``cache``, killed with its compile
    workers past ``timeout``); returns what it wrote to ``result``, its output, its wall time and
    an error (None when it exited cleanly)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=ROOT)
    err = None
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and its compile workers
        log, _ = proc.communicate()
        err = f"timed out after {timeout:.0f} s (--timeout)"
    wall = time.perf_counter() - t0
    try:
        with open(result) as fh:
            res = json.load(fh)
    except (OSError, ValueError):
        res = {}
    if err is None and proc.returncode != 0:
        err = f"exit status {proc.returncode}"
    return res, log or "", wall, err


def run_child(model: str, variant: str, a: argparse.Namespace, phase: str, cache: str, peak: bool,
              logdir: str) -> dict[str, Any]:
    """One variant in a fresh process with its own compile caches; the result or its error (the
    child's output is kept under ``logdir`` when it failed)."""
    fd, result = tempfile.mkstemp(prefix=f"scale_{model}_{variant}_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model, "--variant", variant,
           "--device", a.device, "--phase", phase, "--steps", str(a.steps), "--result", result]
    cmd += ["--tiny"] * a.tiny + ["--matmul-peak"] * peak
    try:
        res, log, wall, err = spawn(cmd, cache, a.timeout, result)
    finally:
        os.unlink(result)
    res = {"model": model, "variant": variant, "phase": phase, **res, "process_s": wall}
    if err is not None and res.get("stage") == "timed":  # timed, then the profiler or FLOP count died
        res["crash_after_timing"] = err + "\n" + tail(log)
    elif err is not None and "error" not in res:
        res["error"] = err + "\n" + tail(log)
    if "error" in res:
        os.makedirs(logdir, exist_ok=True)
        with open(os.path.join(logdir, f"{model}_{variant}_{phase}.log"), "w") as fh:
            fh.write(log)
    return res


def estimate(model: str, variant: str, warm: bool, previous: dict[str, Any], tiny: bool) -> tuple[float, str]:
    """Seconds the variant (and its warm rebuild) should take: the last run's, else the guesses."""
    prev = previous.get("models", {}).get(model, {}).get("variants", {}).get(variant, {})
    if prev.get("process_s") and "error" not in prev:
        return prev["process_s"] + (prev.get("warm_process_s", 0) if warm else 0), "last run"
    if tiny:
        return 15 + 30 * ("fused" in variant or variant == "inductor") + 15 * warm, "guess (tiny)"
    return EST_H200.get(model, {}).get(variant, 90) + (EST_WARM_H200.get(variant, 0) if warm else 0), "guess (H200)"


def finalize(out: dict[str, Any]) -> None:
    """Per model: each variant's loss check and MFU, then ``vs_torch_compile`` and
    ``peak_vs_eager`` from the variants' figures (recomputed the same after a merge)."""
    for name, mod in out.get("models", {}).items():
        vs = mod.get("variants", {})
        eager = vs.get("eager", {})
        ref = eager.get("losses") if "error" not in eager else None
        flops = next((v["flops_per_step"] for v in [eager, *vs.values()] if v.get("flops_per_step")), None)
        mod["flops_per_step"] = flops
        for vname, v in vs.items():
            if "error" in v or "skipped" in v:
                continue
            if vname == "eager":
                v["loss_check"] = {"reference": True, "losses": v.get("losses")}
            elif ref and v.get("losses"):
                n = min(len(ref), len(v["losses"]))
                rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(v["losses"][:n], ref[:n])]
                if all(math.isfinite(r) for r in rel):
                    v["loss_check"] = {"steps": n, "max_rel_diff": max(rel), "rtol": LOSS_RTOL,
                                       "ok": max(rel) <= LOSS_RTOL}
                else:  # NaN compares false either way: say so instead of a maximum
                    v["loss_check"] = {"steps": n, "max_rel_diff": None, "rtol": LOSS_RTOL, "ok": False,
                                       "why": "a loss is not finite"}
            else:
                v["loss_check"] = {"ok": None, "why": "no eager run of this model to compare with"}
            f = v.get("flops_per_step") or flops
            peak = v.get("matmul_peak_tflops")
            if f and peak and v.get("step_ms"):
                v["mfu"] = f / (v["step_ms"] / 1e3) / (peak * 1e12)
        usable = {k: v for k, v in vs.items() if v.get("step_ms") and "error" not in v
                  and v.get("loss_check", {}).get("ok") is not False}
        tc = [k for k in TORCH_COMPILE if k in usable]
        fx = [k for k in WHOLE_STEP if k in usable]
        best_tc = min(tc, key=lambda k: usable[k]["step_ms"]) if tc else None
        best_fx = min(fx, key=lambda k: usable[k]["step_ms"]) if fx else None
        mod["best_torch_compile"], mod["best_flowexec"] = best_tc, best_fx
        mod["vs_torch_compile"] = (usable[best_tc]["step_ms"] / usable[best_fx]["step_ms"]
                                   if best_tc and best_fx else None)
        e_peak = usable.get("eager", {}).get("peak_gib")
        mod["peak_vs_eager"] = (usable[best_fx]["peak_gib"] / e_peak
                                if best_fx and e_peak and usable[best_fx].get("peak_gib") else None)
        why = []
        if not best_tc:
            why.append("no torch.compile variant (inductor, reduce_overhead) ran cleanly")
        if not best_fx:
            why.append("no flowexec whole-step variant ran cleanly")
        if not e_peak:
            why.append("no eager peak")
        if why:
            mod["ratios_missing"] = "; ".join(why)
        else:
            mod.pop("ratios_missing", None)


def write(out: dict[str, Any], path: str) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(out, fh, indent=1)
    os.replace(tmp, path)


def fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) and v is not None else "-"


def cache_census(cache: str) -> dict[str, int]:
    """What a variant's builds left in its compile caches (``cache``: :func:`spawn`'s): Triton
    compiles (``triton_compiles``: a kernel in one configuration, each a directory of Triton's
    cache holding a ``.cubin`` or ``.hsaco``), Triton's launchers and utilities built with the
    host's C compiler (``triton_host_modules``), and Inductor's generated sources: Triton
    kernels (``inductor_triton_kernels``), other Python modules (``inductor_wrappers``: a
    graph's wrapper, among them) and C++ libraries (``inductor_libraries``, on a CPU). A cold
    build's compile time goes mostly to the Triton compiles (issue 36: flowexec's regions
    against torch.compile's one graph)."""
    out = dict.fromkeys(("triton_compiles", "triton_host_modules", "inductor_triton_kernels", "inductor_wrappers",
                         "inductor_libraries"), 0)
    for _, _, files in os.walk(os.path.join(cache, "triton")):
        if any(f.endswith((".cubin", ".hsaco")) for f in files):
            out["triton_compiles"] += 1
        elif any(f.endswith(".so") for f in files):
            out["triton_host_modules"] += 1
    for root, _, files in os.walk(os.path.join(cache, "inductor")):
        for f in files:
            if f.endswith(".so"):
                out["inductor_libraries"] += 1
            elif f.endswith(".py") and not f.startswith("__"):
                try:
                    with open(os.path.join(root, f), errors="replace") as fh:
                        kernel = "@triton.jit" in fh.read()
                except OSError:
                    continue
                out["inductor_triton_kernels" if kernel else "inductor_wrappers"] += 1
    return out


def ready_s(v: dict[str, Any], warm: bool = False) -> float | None:
    """Seconds until the steps run as they will: the build, and before it a flowexec variant's
    first call (its first step's own program, which compiles most regions on a cold cache; with
    the state prefilled, the steps' build itself)."""
    suffix = "_warm" if warm else ""
    build = v.get(f"build_s{suffix}")
    if build is None:
        return None
    first = v.get(f"first_call_s{suffix}")
    return build + first if first is not None and v.get("first_step") in ("planned", "prefilled") else build


def table(out: dict[str, Any]) -> str:
    """The results as text; build and warm: :func:`ready_s` on a cold and on a warm cache."""
    rows = [f"{'model':<12} {'variant':<16} {'step ms':>8} {'build s':>8} {'warm s':>7} {'peak GiB':>8} "
            f"{'kernels':>7} {'MFU':>6} {'loss':>5}"]
    for name, mod in out.get("models", {}).items():
        for vname, v in mod.get("variants", {}).items():
            if "error" in v or "skipped" in v:
                first = (v.get("error") or v.get("skipped") or "").strip().splitlines()
                msg = first[-1] if first else ""
                rows.append(f"{name:<12} {vname:<16} {'FAILED' if 'error' in v else 'skipped'}: {msg[:90]}")
                continue
            lc = v.get("loss_check", {})
            loss = "ref" if lc.get("reference") else {True: "ok", False: "BAD", None: "?"}[lc.get("ok")]
            kern = v.get("profile", {}).get("kernels_per_step")
            if kern is None:
                kern = v.get("profile", {}).get("aten_ops_per_step")
            rows.append(f"{name:<12} {vname:<16} {fmt(v.get('step_ms'), '8.2f')} {fmt(ready_s(v), '8.1f')} "
                        f"{fmt(ready_s(v, warm=True), '7.1f')} {fmt(v.get('peak_gib'), '8.2f')} {fmt(kern, '7d')} "
                        f"{fmt(100 * v['mfu'] if v.get('mfu') else None, '5.1f')}% {loss:>5}")
        r = mod.get("vs_torch_compile")
        p = mod.get("peak_vs_eager")
        rows.append(f"{name}: vs_torch_compile {fmt(r, '.3f')} ({mod.get('best_torch_compile')} / "
                    f"{mod.get('best_flowexec')}), peak_vs_eager {fmt(p, '.3f')}"
                    + (f"  [{mod['ratios_missing']}]" if mod.get("ratios_missing") else ""))
    return "\n".join(rows)


def merge(paths: list[str]) -> dict[str, Any]:
    """One results file from partial runs: later files' variants replace earlier ones' of the same
    model and name; the meta is the first file's, with every source listed."""
    out: dict[str, Any] = {}
    sources = []
    for p in paths:
        with open(p) as fh:
            part = json.load(fh)
        sources.append({k: part.get(k) for k in ("commit", "date", "command", "device", "matmul_peak")} | {"file": p})
        if not out:
            out = {k: v for k, v in part.items() if k != "models"}
            out["models"] = {}
        for name, mod in part.get("models", {}).items():
            dst = out["models"].setdefault(name, {"variants": {}})
            for k, v in mod.items():
                if k != "variants" and k not in dst:
                    dst[k] = v
            dst["variants"].update(mod.get("variants", {}))
    out["merged_from"] = sources
    commits = {s["commit"] for s in sources}
    if len(commits) > 1:
        out["merge_warning"] = f"the parts come from different commits: {sorted(map(str, commits))}"
    peaks = [s["matmul_peak"]["tflops"] for s in sources if s.get("matmul_peak")]
    if len(peaks) > 1:
        out["matmul_peak_tflops_per_part"] = peaks  # each variant's MFU uses its own run's peak
    finalize(out)
    return out


def parent_main(a: argparse.Namespace) -> None:
    cpu = a.device == "cpu"
    models = a.models.split(",") if a.models else list(MODELS)
    variants = a.variants.split(",") if a.variants else [v for v in VARIANTS if not (cpu and v in CUDA_ONLY)]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    out_dir = os.environ.get("OUT") or os.path.join(HERE, "results")
    path = a.output or os.path.join(out_dir, "scale_cpu.json" if cpu else "scale.json")
    previous: dict[str, Any] = {}
    if os.path.exists(path):
        try:
            with open(path) as fh:
                previous = json.load(fh)
        except (OSError, ValueError):
            pass
    plan = []
    for m in models:
        for v in variants:
            warm = a.warm and v in WARM and not (cpu and v in CUDA_ONLY)
            plan.append((m, v, warm, *estimate(m, v, warm, previous, a.tiny)))
    total = sum(p[3] for p in plan)
    print(f"scale.py: {len(plan)} variant(s) on {a.device}{' (tiny)' if a.tiny else ''}; estimated "
          f"{total / 60:.1f} min in all", flush=True)
    for m, v, warm, est, src in plan:
        print(f"  {m}/{v}{' + warm rebuild' if warm else ''}: ~{est:.0f} s ({src})", flush=True)
    if a.estimate:
        return
    out: dict[str, Any] = {
        "benchmark": "scale", "command": "PYTHONPATH=. python3 benchmarks/scale.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tiny": a.tiny, "timed_steps": a.steps, "checked_steps": CHECKED_STEPS, "loss_rtol": LOSS_RTOL,
        "step": "zero_grad(set_to_none=True); forward under bf16 autocast; cross-entropy in float32; backward; "
                "AdamW(lr=1e-4, fused=True).step(); TF32 on; median of the timed steps, each followed by a synchronize",
        "models": {},
    }
    logdir = os.path.join(os.path.dirname(path) or ".", "scale_logs")
    peak: dict[str, Any] | None = None
    for m, v, warm, est, _ in plan:
        mod = out["models"].setdefault(m, {"variants": {}})
        if cpu and v in CUDA_ONLY:
            mod["variants"][v] = {"skipped": "needs CUDA (CUDA graphs)"}
            continue
        print(f"[{time.strftime('%H:%M:%S')}] {m}/{v} (~{est:.0f} s) ...", flush=True)
        cache = tempfile.mkdtemp(prefix=f"scale_cache_{m}_{v}_")
        try:
            res = run_child(m, v, a, "full", cache, peak is None, logdir)
            if peak is None and res.get("matmul_peak"):
                peak = res["matmul_peak"]
                out["matmul_peak"] = dict(peak, measured_in=f"{m}/{v}")
            for k, val in res.pop("env", {}).items():  # the first child's device, versions, commit
                out.setdefault(k, val)
            res.pop("matmul_peak", None)
            if peak:
                res["matmul_peak_tflops"] = peak["tflops"]
            res["cache_census"] = cache_census(cache)  # (what the cold build compiled)
            if warm and "error" not in res:
                w = run_child(m, v, a, "build-profiled" if a.profile_warm else "build", cache, False, logdir)
                res["warm_process_s"] = w["process_s"]
                if "error" in w:
                    res["build_s_warm_error"] = w["error"]
                else:
                    res["build_s_warm"] = w.get("build_s")
                    res["flowexec_build_phases_warm"] = w.get("flowexec_build_phases")
                    # (a planned first step's program loads its regions on the warm cache too;
                    # Inductor's times say whether it loaded or compiled them)
                    for key in ("first_call_s", "first_step_build_phases", "first_call_inductor_times",
                                "first_call_compile_workers", "build_inductor_times", "kept", "capture_run"):
                        if w.get(key) is not None:
                            res[f"{key}_warm"] = w[key]
                    if a.profile_warm:  # (the warm figures above were timed under cProfile: ~1.4x)
                        res["flowexec_build_profile_warm"] = w.get("build_profile")
                        res["warm_timed_under_cprofile"] = True
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        for k in ("model_desc", "params", "units_per_step", "unit"):
            if k in res:
                mod.setdefault(k, res[k])
        mod["variants"][v] = res
        finalize(out)
        write(out, path)
        if res.get("crash_after_timing"):
            print("    (its process died after the timed steps: profile or FLOP count missing)", flush=True)
        if "error" in res:
            err = res["error"].replace("\n", "\n      ")
            print(f"    FAILED ({res['process_s']:.0f} s):\n      {err}", flush=True)
        else:
            print(f"    {res.get('step_ms', float('nan')):.2f} ms/step, build {res.get('build_s', float('nan')):.1f} s"
                  + (f" (warm {res['build_s_warm']:.1f} s)" if res.get("build_s_warm") is not None else "")
                  + f", peak {res.get('peak_gib', float('nan')):.2f} GiB, process {res['process_s']:.0f} s", flush=True)
    finalize(out)
    write(out, path)
    print(f"wrote {path}\n\n{table(out)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    ap.add_argument("--variants", default="", help=f"comma-separated, from {', '.join(VARIANTS)} (default: all; "
                                                   "on a CPU those without CUDA graphs)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="a few-layer version of each model (the logic, on a CPU)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 30; 5 with --tiny)")
    ap.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                    help="rebuild inductor and the fused flowexec variants on their warm cache (default on)")
    ap.add_argument("--profile-warm", action="store_true",
                    help="run the warm rebuilds under cProfile and record their costliest functions "
                         "(flowexec_build_profile_warm; their build times then read ~1.4x)")
    ap.add_argument("--timeout", type=float, default=480, help="seconds a variant's process may take")
    ap.add_argument("-o", "--output", default=None, help="results file (default $OUT/scale.json, "
                                                         "else benchmarks/results/scale.json; scale_cpu.json on a CPU)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge partial results files into -o")
    ap.add_argument("--estimate", action="store_true", help="print the estimated time and exit")
    # the child's own arguments
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--phase", default="full", choices=("full", "build", "build-profiled"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--matmul-peak", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps is None:
        a.steps = 5 if a.tiny else 30
    if a.child:
        child_main(a)
    elif a.merge:
        if not a.output:
            raise SystemExit("--merge needs -o OUTPUT")
        out = merge(a.merge)
        write(out, a.output)
        print(f"wrote {a.output}\n\n{table(out)}")
    else:
        parent_main(a)


if __name__ == "__main__":
    main()
