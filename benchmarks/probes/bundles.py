"""What a fused build's FX cache entries bundle (flowexec.inductor._Batch): a cold build of a
transformer block's graph-mode step on a fresh cache with Inductor's pool up, then each entry
unpickled (kernel binaries, statically launchable autotuners), then a warm process's Triton
requests and where they were answered. Writes bundles.json under --out.

    python3 benchmarks/probes/bundles.py --out /tmp/b
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys
import torch
from torch._dynamo.utils import counters
from torch._inductor.async_compile import AsyncCompile
import flowexec
from flowexec.models import Block, lm_loss, make_step
if sys.argv[1] == "cold":
    AsyncCompile.warm_pool(); AsyncCompile.wait_pool_ready()
from torch._inductor.triton_bundler import TritonBundler
seen = []
real = TritonBundler.read_and_emit  # (a staticmethod: read from the class, a plain function)
def read_and_emit(bundle):
    seen.append((len(bundle.kernel_artifacts), len(bundle.static_autotuners)))
    return real(bundle)
TritonBundler.read_and_emit = staticmethod(read_and_emit)
torch.manual_seed(0)
model = Block().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
step = make_step(model, opt, lm_loss, set_to_none=True)
x = torch.randint(0, 50, (4, 16), device="cuda")
run = flowexec.compile(step, mode="graph", fuse="inductor")
loss = run(x, x).item()
print(json.dumps({"loss": loss, "fused": run.plan.stats()["fused_regions"], "read_and_emit": seen, "counters": {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cache", help="an empty directory for the caches (default: a new temporary one)")
    a = p.parse_args()
    where = a.cache or tempfile.mkdtemp(prefix="bundles_")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, FLOWEXEC_COMPILE_PROCESSES="0",
               TORCHINDUCTOR_CACHE_DIR=os.path.join(where, "inductor"), TRITON_CACHE_DIR=os.path.join(where, "triton"))
    res: dict = {}
    for phase in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-c", CHILD, phase], env=env, capture_output=True, text=True, timeout=300)
        res[phase] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-3000:]}
        if phase == "cold":
            entries = []
            fx = os.path.join(where, "inductor", "fxgraph")
            for d, _, files in os.walk(fx):
                for f in files:
                    try:
                        with open(os.path.join(d, f), "rb") as fh:
                            g = pickle.load(fh)
                        b = getattr(g, "_triton_bundle", None)
                        entries.append({"file": f[:12], "artifacts": len(b.kernel_artifacts) if b else None,
                                        "static": len(b.static_autotuners) if b else None})
                    except Exception as e:
                        entries.append({"file": f[:12], "error": repr(e)[:200]})
            res["entries"] = entries
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bundles.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps({"entries": res.get("entries"), "warm_read": res["warm"].get("read_and_emit")})[:3000])


if __name__ == "__main__":
    main()
