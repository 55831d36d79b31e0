"""Warm builds of several checkouts, alternated on one warm cache: what a change moves in a warm
build, each checkout's runs interleaved with the others' so that the host's drift falls on all.

One cold build (the first checkout's) fills a fresh compile cache; then ``--rounds`` rounds, each
a warm build of every checkout in turn, each in a fresh process (``benchmarks/scale.py``'s child,
"build" phase, with that checkout's ``scale.py`` and flowexec), no sampler. Writes
``OUT/warm_alternate.json``: per run, the checkout, its commit, the first call's seconds and the
build's phases.

    python3 benchmarks/probes/warm_alternate.py --trees /path/to/before,/path/to/after \\
        --models gpt2_124m --variant fx_trace_fused --device cpu --rounds 3 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import scale  # noqa: E402  (benchmarks/scale.py: this checkout's, for writing the results)

CHILD = """
import argparse, json, sys
sys.path.insert(0, {bench!r})
import scale
a = argparse.Namespace(device={device!r}, steps=5, tiny={tiny!r}, timeout={timeout!r})
res = scale.run_child({model!r}, {variant!r}, a, "build", {cache!r}, False, {logs!r})
print("RESULT " + json.dumps({{k: res.get(k) for k in ("first_call_s", "flowexec_build_phases", "error")}}))
"""


def _commit(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build(tree: str, model: str, a: argparse.Namespace, cache: str) -> dict:
    """One build of ``model`` with checkout ``tree``'s code, in a fresh process on ``cache``."""
    code = CHILD.format(bench=os.path.join(tree, "benchmarks"), device=a.device, tiny=a.tiny, timeout=a.timeout,
                        model=model, variant=a.variant, cache=cache, logs=os.path.join(a.out, "warm_alternate_logs"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.path.join(tree, "tests")]))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    rec = json.loads(line[7:]) if line else {"error": (p.stderr or p.stdout)[-2000:]}
    phases = rec.get("flowexec_build_phases") or {}
    return {"tree": tree, "commit": _commit(tree), **rec, "phases_sum": round(sum(phases.values()), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="','-separated checkouts (the first fills the cache)")
    ap.add_argument("--models", default="gpt2_124m")
    ap.add_argument("--variant", default="fx_trace_fused")
    ap.add_argument("--device", default="cpu", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1400)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    trees = [os.path.abspath(t) for t in a.trees.split(",")]
    out = {"probe": "warm_alternate", "command": " ".join([sys.executable] + sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "models": {}}
    os.makedirs(a.out, exist_ok=True)
    for m in a.models.split(","):
        cache = tempfile.mkdtemp(prefix=f"warm_alternate_{m}_")
        runs = out["models"][m] = []
        try:
            runs.append({"cold": True, **build(trees[0], m, a, cache)})
            print(json.dumps(runs[-1]), flush=True)
            for r in range(a.rounds):
                for tree in trees:
                    runs.append({"round": r, **build(tree, m, a, cache)})
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    path = os.path.join(a.out, "warm_alternate.json")
    scale.write(out, path)
    print("wrote", path)


if __name__ == "__main__":
    main()
