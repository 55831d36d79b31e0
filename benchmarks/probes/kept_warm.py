"""A warm build with and without kept programs, alternating, on one warm cache (docs/kept.md).

One cold process fills a fresh Inductor cache and keeps its program; then ``--rounds`` pairs of
fresh processes build the same step on that cache, one with ``FLOWEXEC_KEEP=0`` (the step is
traced again) and one loading the kept program, each recording its build phases, its first
call and its losses (which must be the cold process's).

    python3 benchmarks/probes/kept_warm.py --device cpu --layers 12 --rounds 2 --fuse
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import scale  # noqa: E402  (its write)
from host_meta import host_meta  # noqa: E402


def child(a: argparse.Namespace) -> None:
    import torch
    import transformers

    import flowexec

    dev = torch.device(a.device)
    cfg = transformers.GPT2Config(n_layer=a.layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")

    def step(x):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        return loss.detach()

    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 50257, (a.batch, a.seq), generator=g).to(dev) for _ in range(3)]
    exe = flowexec.compile(step, mode="graph" if dev.type == "cuda" else "trace",
                           fuse="inductor" if a.fuse else False)
    t = time.perf_counter()
    losses = [exe(xs[0]).item()]
    first = time.perf_counter() - t
    losses += [exe(x).item() for x in xs[1:]]
    print(json.dumps({"first_call_s": first, "build_phases": exe.build_phases, "kept": exe.kept,
                      "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
                      "capture_run": exe.capture_run, "losses": losses}))


def run(a: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--device", a.device, "--layers", str(a.layers),
           "--batch", str(a.batch), "--seq", str(a.seq)] + ["--fuse"] * a.fuse
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--fuse", action="store_true")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results", "probes"))
    a = p.parse_args()
    if a.child:
        return child(a)
    cache = tempfile.mkdtemp(prefix="kept_warm_")
    root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"), FLOWEXEC_KEEP_DIR=os.path.join(cache, "programs"),
               FLOWEXEC_KEEP="1",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cold = run(a, env)
    print("cold", json.dumps(cold)[:300], flush=True)
    rounds = []
    for k in range(a.rounds):
        for keep in ("0", "1"):
            got = run(a, dict(env, FLOWEXEC_KEEP=keep))
            got["FLOWEXEC_KEEP"] = keep
            print(f"round {k} FLOWEXEC_KEEP={keep}", json.dumps(got)[:300], flush=True)
            rounds.append(got)
    same = all(r.get("losses") == cold.get("losses") for r in rounds)
    res = {"benchmark": "kept_warm", "model": f"GPT-2 ({a.layers} layers), batch {a.batch} x {a.seq}",
           "device_arg": a.device, "fuse": a.fuse, "cold": cold, "rounds": rounds,
           "losses_equal_cold": same, **host_meta(" ".join(sys.argv))}
    os.makedirs(a.out, exist_ok=True)
    scale.write(res, os.path.join(a.out, f"kept_warm_{a.device}_gpt2_{res.get('commit', 'unknown')}.json"))


if __name__ == "__main__":
    main()
