"""Models no issue names, trained by eager and by flowexec side by side: does anything differ?

Each case builds a small model (Hugging Face families at a few layers, torch.nn modules an issue
never used: GRU, LSTM, transformer decoders, spectral norm, checkpointed dropout ...), trains it
for a few steps in eager PyTorch and under ``flowexec.compile`` of the whole step from the same
seeds (each call seeded alike, so dropout draws alike), and compares the losses and every
parameter and buffer. A case either matches (within the tolerance), differs (``BAD``: a silent
wrong answer, the worst outcome), or raises (``ERR``: the message is kept, so a refusal can be
read for whether it says what to do). Through the backend, a case that differs from eager but
matches ``torch.compile(backend="aot_eager")`` while that differs from eager too is ``AS_PEER``:
Dynamo's trace of the model is another program than eager's (BERT under Transformers 5: the
attention mask made while tracing moves SDPA to another kernel, with other dropout draws). It found, on 2026-12-05, the GRU under
``memory="planned"``, the two-layer LSTM, spectral norm and checkpointed dropout
(docs/history.md).

Parameters whose gradient is zero up to rounding (the key bias of attention: softmax ignores a
constant shift) are amplified by Adam into ±lr steps either way; those are reported apart
(``noise``), not as differences.

    PYTHONPATH=. python3 benchmarks/probes/model_sweep.py --device cpu --variants trace,fused --out /tmp
    PYTHONPATH=. python3 benchmarks/probes/model_sweep.py --device cuda --variants graph,graph_fused --out $OUT
    PYTHONPATH=. python3 benchmarks/probes/model_sweep.py --device cuda --autocast bf16 --variants graph_fused
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import flowexec  # noqa: E402
import flowexec.compile_workers  # noqa: E402

LR = 1e-3  # AdamW's, every case

VARIANTS = {
    "trace": dict(mode="trace"), "fused": dict(mode="trace", fuse="inductor"),
    "threaded": dict(mode="threaded", streams=2), "planned": dict(mode="trace", memory="planned", gc="async"),
    "recompute": dict(mode="trace", recompute=True),
    "graph": dict(mode="graph"), "graph_fused": dict(mode="graph", fuse="inductor"),
    # the model through torch.compile's backend (Dynamo's graphs; the step around it eager)
    "backend": dict(backend=dict(mode="trace")), "backend_graph": dict(backend=dict(mode="graph")),
    # backend_graph with one rewrite off: which of fusion and padding a difference follows
    "backend_graph_nofuse": dict(backend=dict(mode="graph", fuse=False)),
    "backend_graph_nopad": dict(backend=dict(mode="graph", pad=False)),
    # the peer: torch.compile's own AOTAutograd without a compiler (what Dynamo's tracing alone does)
    "aot_eager": dict(peer="aot_eager"),
}


def _hf(cls: str, cfg: str, **kw: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        return getattr(transformers, cls)(getattr(transformers, cfg)(**kw))
    return make


_S = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=211,
          max_position_embeddings=64)
HF = {  # name: (maker, inputs kind)
    "bert": (_hf("BertForMaskedLM", "BertConfig", **_S), "lm"),
    "t5": (_hf("T5ForConditionalGeneration", "T5Config", d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
               vocab_size=211, decoder_start_token_id=0, pad_token_id=0), "seq2seq"),
    "bart": (_hf("BartForConditionalGeneration", "BartConfig", d_model=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 vocab_size=211, max_position_embeddings=64), "seq2seq"),
    "opt": (_hf("OPTForCausalLM", "OPTConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                vocab_size=211, max_position_embeddings=64, word_embed_proj_dim=64), "lm"),
    "mistral": (_hf("MistralForCausalLM", "MistralConfig", **_S, num_key_value_heads=2), "lm"),
    "phi": (_hf("PhiForCausalLM", "PhiConfig", **_S), "lm"),
    "gemma": (_hf("GemmaForCausalLM", "GemmaConfig", **_S, num_key_value_heads=2, head_dim=16), "lm"),
    "mixtral": (_hf("MixtralForCausalLM", "MixtralConfig", **_S, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2), "lm"),
    "vit": (_hf("ViTForImageClassification", "ViTConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, image_size=32, patch_size=8, num_labels=10), "image"),
}


class _Tokens(nn.Module):
    """Embedding, ``body`` (batch-first, 16 features in and out), a head over 20 tokens."""

    def __init__(self, body: nn.Module, unpack: bool = False) -> None:
        super().__init__()
        self.e, self.body, self.o, self.unpack = nn.Embedding(20, 16), body, nn.Linear(16, 20), unpack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.e(x))
        return self.o(h[0] if self.unpack else h)


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2),
                                                  nn.Linear(32, 16)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.utils.checkpoint as ckpt

        for b in self.blocks:
            x = x + ckpt.checkpoint(b, x, use_reentrant=False)
        return x


def _decoder() -> nn.Module:
    layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.1, batch_first=True)

    class Dec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.d = nn.TransformerDecoder(layer, 2)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1], device=h.device)
            return self.d(h, h, tgt_mask=mask, tgt_is_causal=True)
    return Dec()


def _spectral() -> nn.Module:
    from torch.nn.utils.parametrizations import spectral_norm

    return nn.Sequential(spectral_norm(nn.Linear(16, 16)), nn.Tanh())


MODULES = {
    "gru": lambda: _Tokens(nn.GRU(16, 16, batch_first=True), unpack=True),
    "lstm2": lambda: _Tokens(nn.LSTM(16, 16, num_layers=2, batch_first=True, dropout=0.1), unpack=True),
    "encoder": lambda: _Tokens(nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1,
                                                                               batch_first=True, norm_first=True), 2)),
    "decoder": lambda: _Tokens(_decoder()),
    "spectral_norm": lambda: _Tokens(_spectral()),
    "checkpointed_dropout": lambda: _Tokens(_Checkpointed()),
}


def batch(kind: str, dev: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        b = dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g), labels=torch.randint(0, 10, (2,), generator=g))
    elif kind == "seq2seq":
        b = dict(input_ids=torch.randint(0, 211, (2, 16), generator=g), labels=torch.randint(0, 211, (2, 12), generator=g))
    elif kind == "lm":
        ids = torch.randint(0, 211, (2, 16), generator=g)
        b = dict(input_ids=ids, labels=ids)
    else:
        ids = torch.randint(0, 20, (4, 12), generator=g)
        b = dict(x=ids, y=ids)
    return {k: v.to(dev) for k, v in b.items()}


def train(name: str, dev: torch.device, options: dict[str, Any] | None, steps: int,
          autocast: torch.dtype | None = None) -> tuple[list[float], list[tuple[str, torch.Tensor]]]:
    """``steps`` AdamW steps of case ``name`` (eager where ``options`` is None; the forward and
    loss under ``torch.autocast`` to ``autocast`` where given): the losses and the final
    parameters and buffers by name."""
    torch.manual_seed(0)
    if name in HF:
        make, kind = HF[name]
        model = make().to(dev)
    else:
        model, kind = MODULES[name]().to(dev), "tokens"
    backend, peer = (options or {}).get("backend"), (options or {}).get("peer")
    if backend is not None or peer is not None:
        torch._dynamo.reset()  # (a fresh cache per case: Dynamo's recompile limits are per process)
    f = (torch.compile(model, backend="flowexec", options=backend) if backend is not None
         else torch.compile(model, backend=peer) if peer is not None else model)
    if name in HF:
        loss_of = lambda b: f(**b).loss  # noqa: E731
    else:
        loss_of = lambda b: F.cross_entropy(f(b["x"]).flatten(0, 1), b["y"].flatten())  # noqa: E731
    model.train()
    b = batch(kind, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(b: dict[str, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_of(b)
        loss.backward()
        opt.step()
        return loss.detach()

    call = step if options is None or backend is not None or peer is not None else flowexec.compile(step, **options)
    losses = []
    for k in range(steps):
        torch.manual_seed(100 + k)
        losses.append(float(call(b)))
    CAPTURE_RUN[0] = getattr(call, "capture_run", None) if call is not step else None
    FUSION[0] = fusion_of(call) if call is not step else None
    return losses, [(n, t.detach().float().cpu().clone()) for n, t in list(model.named_parameters()) + list(model.named_buffers())]


CAPTURE_RUN: list[str | None] = [None]  # the last train()'s Executable.capture_run (fake or real, and why)
FUSION: list[dict[str, Any] | None] = [None]  # the last train()'s fused regions and fallbacks (fusion_of)


def fusion_of(exe: Any) -> dict[str, Any] | None:
    """A fused executable's regions and fallbacks, with each distinct reason a region fell back
    (a fallback runs ATen ops where a kernel was meant to: slower, not wrong)."""
    plan = getattr(exe, "plan", None)
    report = getattr(plan, "fusion", None)
    if report is None:
        return None
    c = report.counts()
    why = sorted({r.current_status.removeprefix("fallback: ")[:200] for r in report.regions if not r.fused})
    return {"fused_regions": c["fused_regions"], "fused_kernels": c["fused_kernels"],
            "fusion_fallbacks": c["fusion_fallbacks"], "fallback_reasons": why}


def compare(eager: Any, mine: Any, tol: float) -> dict[str, Any]:
    (el, es), (ml, ms) = eager, mine
    loss_rel = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(el, ml))
    worst, noise = ("", 0.0), []
    for (n, a), (_, b) in zip(es, ms):
        diff = (a - b).abs()
        d = float(diff.max()) if a.numel() else 0.0
        # a key bias (zero gradient up to rounding): Adam turns its rounding into +-lr steps
        if d > tol and ("key" in n or "in_proj_bias" in n or "k_proj.bias" in n):
            noise.append(n)
            continue
        # A lone entry whose first gradient was near Adam's eps: its first step is g / (|g| + eps),
        # and a kernel's rounding of g (a fused reduction sums in another order) moves it by a part
        # of lr. Seen on the CPU at 7d47d12: T5's and Mistral's fused steps, one entry each in
        # 178,368 / 101,056, 4.3e-5 / 2.3e-5 off, their gradients within 2e-6 relative of eager's.
        if d > tol and d <= 2 * LR and a.numel() >= 1000 and int((diff > tol).sum()) <= max(1, a.numel() // 10_000):
            noise.append(f"{n} ({int((diff > tol).sum())} of {a.numel()} entries, {d:.1e})")
            continue
        worst = max(worst, (n, d), key=lambda t: t[1])
    ok = loss_rel < 1e-4 and worst[1] < tol
    # (where a case differs: each step's losses, and the states with the most entries off)
    off = sorted(((n, int(((a - b).abs() > tol).sum()), a.numel()) for (n, a), (_, b) in zip(es, ms)),
                 key=lambda t: -t[1])
    return {"verdict": "OK" if ok else "BAD", "loss_rel": loss_rel, "worst_state": worst[0], "worst_abs": worst[1],
            "noise": noise, "losses": {"eager": list(el), "mine": list(ml)},
            "most_off": [f"{n}: {k} of {m}" for n, k, m in off[:8] if k]}


def compare_to_reference(ref: Any, eager: Any, mine: Any, slack: float = 2.0) -> dict[str, Any]:
    """Under autocast a fused program keeps float32 between kernels where eager rounds each op's
    result to bfloat16, so the two differ by bfloat16 rounding (Adam turns a gradient's rounding
    into up to ±lr a step): each is compared with float32 eager (``ref``) instead, and the
    program passes where its distance from it is at most ``slack`` times eager's own, for the
    losses and for the parameters and buffers (root of the summed squares, over all of them)."""
    def dist(run: Any) -> tuple[float, float]:
        (rl, rs), (l, st) = ref, run
        loss = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(rl, l))
        state = sum(float((a - b).double().square().sum()) for (_, a), (_, b) in zip(rs, st)) ** 0.5
        return loss, state
    (el, es), (ml, ms) = dist(eager), dist(mine)
    ok = ml <= slack * el + 2e-4 and ms <= slack * es + 1e-6  # (a loss 2e-4 apart: far inside bf16's 8e-3)
    return {"verdict": "OK" if ok else "BAD", "loss_rel": ml, "eager_loss_rel": el, "state_dist": ms,
            "eager_state_dist": es, "worst_state": "", "worst_abs": ms, "noise": [],
            "against": "float32 eager: the program's distance / eager's own"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="", help=f"comma-separated from {', '.join([*HF, *MODULES])} (default all)")
    ap.add_argument("--variants", default="trace,fused", help=f"comma-separated from {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tol", type=float, default=1e-5, help="largest absolute difference of a parameter or buffer "
                    "(without --autocast; with it, each run is measured from float32 eager)")
    ap.add_argument("--autocast", choices=("bf16", "fp16"), default=None, help="forward and loss under torch.autocast")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    dev = torch.device(a.device)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[a.autocast]
    cases = a.cases.split(",") if a.cases else [*HF, *MODULES]
    variants = a.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choices: {', '.join(VARIANTS)}")
    results: dict[str, Any] = {}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"model_sweep_{dev.type}{'_' + a.autocast if a.autocast else ''}.json")

    def write(done: bool) -> None:  # (after every case: a crash, a segfault in one, keeps those before)
        out = {"probe": "model_sweep", "command": " ".join([sys.executable] + sys.argv), "device": str(dev),
               "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "torch": torch.__version__, "commit": os.environ.get("FLOWEXEC_COMMIT", "unknown"),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": a.steps, "tol": a.tol, "autocast": a.autocast,
               "compile_processes": flowexec.compile_workers.setting(),
               "worker_failures": dict(flowexec.fusion.compiler().worker_failures), "finished": done,
               "results": results}
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)

    peers: dict[str, Any] = {}  # a case's run through torch.compile(backend="aot_eager"), where one was needed
    for name in cases:
        rec = results[name] = {}
        try:
            eager = train(name, dev, None, a.steps, autocast)
            ref = train(name, dev, None, a.steps) if autocast else None
        except Exception as e:  # (a model this transformers cannot build)
            rec["eager"] = f"ERR {type(e).__name__}: {e}"[:400]
            print(f"{name:22s} eager ERR {type(e).__name__}: {e}"[:300], flush=True)
            continue
        for v in variants:
            t = time.perf_counter()
            jobs = flowexec.fusion.compiler().worker_jobs
            try:
                mine = train(name, dev, VARIANTS[v], a.steps, autocast)
                rec[v] = compare_to_reference(ref, eager, mine) if autocast else compare(eager, mine, a.tol)
                if rec[v]["verdict"] == "BAD" and "backend" in VARIANTS[v] and not autocast:
                    # Dynamo traces the model's Python, which may branch on tracing (Transformers
                    # materializes an attention mask there, and SDPA then picks another kernel with
                    # other dropout draws): torch.compile's own trace is the program to match.
                    try:  # (the peer's own failure must not turn a BAD into an ERR)
                        peers[name] = peers.get(name) or train(name, dev, VARIANTS["aot_eager"], a.steps)
                    except Exception as e:
                        rec[v]["peer_error"] = f"{type(e).__name__}: {e}"[:300]
                    if name in peers:
                        as_peer = compare(peers[name], mine, a.tol)
                        if as_peer["verdict"] == "OK" and compare(eager, peers[name], a.tol)["verdict"] == "BAD":
                            rec[v]["verdict"] = "AS_PEER"
                            rec[v]["as_peer"] = {k: as_peer[k] for k in ("loss_rel", "worst_state", "worst_abs")}
                rec[v]["capture_run"] = CAPTURE_RUN[0]
                if FUSION[0] is not None:
                    rec[v]["fusion"] = FUSION[0]
                # (regions compiled first by compile workers: FLOWEXEC_COMPILE_PROCESSES)
                rec[v]["worker_jobs"] = flowexec.fusion.compiler().worker_jobs - jobs
            except Exception as e:
                rec[v] = {"verdict": "ERR", "error": f"{type(e).__name__}: {e}"[:600],
                          "where": traceback.format_exc(limit=-2)[-600:]}
            rec[v]["seconds"] = round(time.perf_counter() - t, 1)
            r = rec[v]
            if r["verdict"] == "ERR":
                said = r["error"][:200]
            elif autocast:
                said = (f"from float32: loss rel {r['loss_rel']:.1e} (eager {r['eager_loss_rel']:.1e}), state "
                        f"{r['state_dist']:.1e} (eager {r['eager_state_dist']:.1e})")
            else:
                said = (f"loss rel {r['loss_rel']:.1e}, worst {r['worst_state']} {r['worst_abs']:.1e}"
                        + (f", noise {len(r['noise'])}" if r["noise"] else ""))
            run, fz = r.get("capture_run"), r.get("fusion")
            print(f"{name:22s} {v:12s} {r['verdict']} {said}" + (f" [capture {run[:70]}]" if run else "")
                  + (f" [{fz['fused_regions']} fused, {fz['fusion_fallbacks']} fallbacks]" if fz else ""), flush=True)
            write(False)
    write(True)
    bad = [f"{n}/{v}" for n, r in results.items() for v, x in r.items()
           if isinstance(x, dict) and x["verdict"] not in ("OK", "AS_PEER")]
    print(f"wrote {path}; not OK: {', '.join(bad) or 'none'}")


if __name__ == "__main__":
    main()
