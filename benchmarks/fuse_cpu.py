"""Fusion on the CPU: a captured training step in trace mode with ``fuse="inductor"`` (Inductor's
C++ kernels) against ``fuse=False`` (ATen ops) and eager, side by side in one run.

This decides ``fuse=None``'s choice on the CPU (flowexec/fusion.py): fusion is the default
there only where it measures faster. Steps: the reference MLP (8 x 256, batch 32, SGD), the
transformer block (Adam, foreach) and a 2-layer Hugging Face GPT-2 (64 wide, batch 4 x 64,
AdamW foreach) when transformers is installed; each from the same initial state.

    PYTHONPATH=. python3 benchmarks/fuse_cpu.py --out benchmarks/results

Writes fuse_cpu.json (host, versions, date, commit; per step the median µs of each row, the
ratios, the regions and the build seconds).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import flowexec  # noqa: E402
from flowexec.models import Block, lm_loss, make_mlp, make_step  # noqa: E402
from host_meta import host_meta  # noqa: E402
from ops import write_result  # noqa: E402
from step_time import interleaved  # noqa: E402


def mlp() -> tuple[Callable[[], Any], tuple[Any, ...]]:
    torch.manual_seed(0)
    base = make_mlp()

    def fresh() -> Callable[..., Any]:
        m = copy.deepcopy(base)
        return make_step(m, torch.optim.SGD(m.parameters(), lr=0.01), F.cross_entropy)
    return fresh, (torch.randn(32, 256), torch.randint(0, 10, (32,)))


def block() -> tuple[Callable[[], Any], tuple[Any, ...]]:
    torch.manual_seed(0)
    base = Block(vocab=512, dim=128, heads=4, seq=64)

    def fresh() -> Callable[..., Any]:
        m = copy.deepcopy(base)
        return make_step(m, torch.optim.Adam(m.parameters(), lr=1e-3, foreach=True), lm_loss)
    return fresh, (torch.randint(0, 512, (8, 64)), torch.randint(0, 512, (8, 64)))


def gpt2() -> tuple[Callable[[], Any], tuple[Any, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = GPT2LMHeadModel(cfg)

    def fresh() -> Callable[..., Any]:
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)

        def step(ids: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(input_ids=ids, use_cache=False).logits.flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            return loss
        return step
    return fresh, (torch.randint(0, 1000, (4, 64)),)


def bench(fresh: Callable[[], Callable[..., Any]], args: tuple[Any, ...], rounds: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    fns: dict[str, Callable[[], Any]] = {}
    eager = fresh()
    eager(*args)  # optimizer state, as the compiled rows have it
    fns["eager"] = lambda: eager(*args)
    for name, fuse in (("aten", False), ("fused", "inductor")):
        step = fresh()
        step(*args)
        t0 = time.perf_counter()
        exe = flowexec.compile(step, *args, fuse=fuse)
        r[f"{name}_build_s"] = time.perf_counter() - t0
        if exe.plan.fusion is not None:
            r["regions"] = exe.plan.fusion.counts()
        r[f"{name}_ops"] = exe.plan.stats()["ops"]
        fns[name] = lambda exe=exe: exe(*args)
    for fn in fns.values():
        for _ in range(5):
            fn()
    r.update({f"{k}_us": v for k, v in interleaved(fns, lambda: None, rounds, 10).items()})
    r["fused_vs_aten"] = r["aten_us"] / r["fused_us"]
    r["fused_vs_eager"] = r["eager_us"] / r["fused_us"]
    r["aten_vs_eager"] = r["eager_us"] / r["aten_us"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for fuse_cpu.json")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out: dict[str, Any] = host_meta("benchmarks/fuse_cpu.py")
    out["threads"] = 1
    steps = {"mlp_8x256_sgd": mlp, "block_adam": block}
    try:
        import transformers  # noqa: F401
        steps["gpt2_tiny_adamw"] = gpt2
    except ImportError:
        out["gpt2_tiny_adamw"] = "skipped: transformers is not installed"
    for name, make in steps.items():
        fresh, a = make()
        out[name] = bench(fresh, a, args.rounds)
        r = out[name]
        print(f"{name:16s} eager {r['eager_us']:9.1f} µs  aten {r['aten_us']:9.1f}  fused {r['fused_us']:9.1f}  "
              f"fused/aten {r['fused_vs_aten']:.2f}x  fused/eager {r['fused_vs_eager']:.2f}x", flush=True)
    write_result(args.out, "fuse_cpu.json", out)


if __name__ == "__main__":
    main()
