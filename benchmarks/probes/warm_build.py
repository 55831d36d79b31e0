"""Where a warm rebuild's seconds go, and what moves them (issue 36: a few seconds with a warm cache).

For each model: one cold build of a variant (it fills a fresh compile cache), then a warm rebuild
in a fresh process on that cache for each setting (environment overrides, ``;``-separated; an
empty one is the default), each recording flowexec's build phases. Each child is
``benchmarks/scale.py``'s, in its "build" phase (no timed steps).

    python3 benchmarks/probes/warm_build.py --models resnet50,gpt2_124m \\
        --settings ";TORCHINDUCTOR_COMPILE_THREADS=1" --out $OUT [--sample]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import scale  # noqa: E402  (benchmarks/scale.py: its children, caches and environment record)


# what each build's record keeps of its child's figures
# (first_call_s: a flowexec variant's first call, the first step's program where it makes optimizer
# state; build_s: the second call's, which captures the steps)
RECORDED = ("build_s", "first_call_s", "first_step", "first_step_build_phases", "first_step_plan_passes",
            "flowexec_build_phases", "flowexec_plan_passes", "first_call_inductor_times", "build_inductor_times",
            "first_call_compile_workers", "build_compile_workers",
            "process_s",
            "error")


KEPT = (*RECORDED, "build_samples", "first_call_samples")


def _build_in_child(m: str, a: argparse.Namespace, cache: str, logdir: str, env: dict[str, str],
                    tag: str) -> dict:
    """One build of model ``m`` in a fresh child on ``cache``, with ``env`` set; with --sample
    its two calls' stacks are kept flat under OUT (the device tool leaves deeper folders
    behind) as samples_<model>_<variant>_<tag>[_first_call].collapsed."""
    saved = dict(os.environ)
    os.environ.update(env)
    if a.sample:
        os.makedirs(a.out, exist_ok=True)
        os.environ["SCALE_SAMPLE_DIR"] = a.out
    try:
        got = scale.run_child(m, a.variant, a, "build", cache, False, logdir)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    made = f"{m}_{a.variant}_build"
    for suffix in ("", "_first"):
        path = os.path.join(a.out, f"{made}{suffix}.collapsed")
        if a.sample and os.path.exists(path):
            kept = f"samples_{m}_{a.variant}_{tag}{'_first_call' if suffix else ''}.collapsed"
            os.replace(path, os.path.join(a.out, kept))
    return got


def _with_env(setting: str):
    pairs = [kv.split("=", 1) for kv in setting.split(",") if kv.strip()]
    return {k.strip(): v.strip() for k, v in pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,gpt2_124m")
    ap.add_argument("--variant", default="fx_graph_fused")
    ap.add_argument("--settings", default="", help="';'-separated settings, each KEY=VAL[,KEY=VAL]; '' = default")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--sample", action="store_true",
                    help="sample each build's stack, cold and warm, first call and build (probes/sampler.py): "
                         "functions' shares of its wall time in the JSON, collapsed stacks in "
                         "OUT/samples_<model>_<variant>_{cold,warm_<setting>}[_first_call].collapsed")
    a = ap.parse_args()
    a.steps = 5
    settings = a.settings.split(";") if a.settings else [""]
    out = {"probe": "warm_build", "command": " ".join([sys.executable] + sys.argv), "commit": os.environ.get(
        "FLOWEXEC_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "models": {}}
    logdir = os.path.join(a.out, "warm_build_logs")
    for m in a.models.split(","):
        cache = tempfile.mkdtemp(prefix=f"warm_build_{m}_")
        rec = out["models"][m] = {}
        try:
            cold = _build_in_child(m, a, cache, logdir, {}, "cold")
            rec["cold"] = {k: cold.get(k) for k in KEPT if k in cold}
            print(f"{m} cold: {cold.get('build_s')} s {cold.get('flowexec_build_phases')}", flush=True)
            for setting in settings:
                tag = "".join(c if c.isalnum() else "-" for c in setting) or "default"
                w = _build_in_child(m, a, cache, logdir, _with_env(setting), f"warm_{tag}")
                rec[setting or "default"] = {k: w.get(k) for k in KEPT if k in w}
                print(f"{m} warm [{setting or 'default'}]: {w.get('build_s')} s {w.get('flowexec_build_phases')}",
                      flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    path = os.path.join(a.out, "warm_build.json")
    scale.write(out, path)
    print("wrote", path)


if __name__ == "__main__":
    main()
