"""benchmarks/scale.py on the CPU: the tiny path of one model, each variant in its own process,
writes the results file the GPU run writes, and its ratios come from the variants' figures
(no timing assertions)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import scale  # noqa: E402  (the parent's side imports no torch)

VARIANTS = ("eager", "fx_trace", "backend")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    # The ResNet stand-in: no transformers import, so each variant's process starts quickly.
    out = tmp_path_factory.mktemp("scale") / "scale.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scale.py"), "--device", "cpu", "--tiny",
                           "--models", "resnet50", "--variants", ",".join(VARIANTS), "--no-warm", "--steps", "3",
                           "-o", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vs_torch_compile" in proc.stdout  # the table was printed
    with open(out) as fh:
        return json.load(fh)


def test_tiny_run_writes_every_figure(tiny_run: dict) -> None:
    for key in ("device", "torch", "python", "date", "commit", "command", "matmul_peak", "models"):
        assert key in tiny_run, key
    assert tiny_run["device"] == "cpu" and tiny_run["matmul_peak"]["tflops"] > 0
    mod = tiny_run["models"]["resnet50"]
    assert "STAND-IN" in mod["model_desc"]  # torchvision's ResNet-50 is not what ran
    assert set(mod["variants"]) == set(VARIANTS)
    for name, v in mod["variants"].items():
        assert "error" not in v, (name, v["error"])
        for key in ("step_ms", "build_s", "peak_gib", "profile", "flops_per_step", "mfu", "losses", "loss_check",
                    "process_s", "cache_census"):
            assert key in v, (name, key)
        assert len(v["losses"]) == scale.CHECKED_STEPS
        assert v["timed_steps"] == 3
        assert v["mfu"] == pytest.approx(v["flops_per_step"] / (v["step_ms"] / 1e3) / (v["matmul_peak_tflops"] * 1e12))
        assert v["profile"]["aten_ops_per_step"] > 0
    assert mod["variants"]["eager"]["loss_check"]["reference"]
    for name in ("fx_trace", "backend"):
        assert mod["variants"][name]["loss_check"]["ok"] is True, mod["variants"][name]["loss_check"]
    fx = mod["variants"]["fx_trace"]
    # flowexec's default first step: AdamW's state prefilled, so the first call captures the steps
    assert fx["options"] == {"mode": "trace", "fuse": False, "first_step": "prefill"} and fx["calls_to_capture"] == 0
    assert fx["first_step"] == "prefilled" and fx["first_call_s"] > 0
    assert fx["plan"]["ops"] > 0


def test_the_cache_census_counts_what_each_compiler_left(tmp_path) -> None:
    """Triton's cache: a directory per compile (its binary beside its IR), launchers as shared
    libraries; Inductor's: kernels' sources, wrappers and C++ libraries."""
    def put(rel: str, text: str = "") -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    put("triton/AAA/triton_poi_0.cubin"), put("triton/AAA/triton_poi_0.ptx")
    put("triton/BBB/triton_red_1.cubin"), put("triton/CCC/triton_red_1.hsaco")
    put("triton/DDD/__triton_launcher.so"), put("triton/DDD/__triton_launcher.c")
    put("inductor/ab/cab.py", "@triton.jit\ndef triton_poi_0(): pass\n")
    put("inductor/cd/ccd.py", "def call(args): pass\n")
    put("inductor/ef/cef.so"), put("inductor/ef/__init__.py"), put("inductor/fxgraph/ab/entry")
    assert scale.cache_census(str(tmp_path)) == {
        "triton_compiles": 3, "triton_host_modules": 1, "inductor_triton_kernels": 1, "inductor_wrappers": 1,
        "inductor_libraries": 1}
    assert scale.cache_census(str(tmp_path / "nothing")) == dict.fromkeys(
        ("triton_compiles", "triton_host_modules", "inductor_triton_kernels", "inductor_wrappers",
         "inductor_libraries"), 0)


def test_ratios_come_from_the_numbers(tiny_run: dict, tmp_path) -> None:
    mod = tiny_run["models"]["resnet50"]
    vs = mod["variants"]
    # no torch.compile variant ran: no speed ratio, and the file says why
    assert mod["vs_torch_compile"] is None and "torch.compile" in mod["ratios_missing"]
    assert mod["best_flowexec"] == "fx_trace"
    assert mod["peak_vs_eager"] == pytest.approx(vs["fx_trace"]["peak_gib"] / vs["eager"]["peak_gib"])
    # a second part with torch.compile's rows (made up here), merged: the ratio is recomputed
    fake = {"step_ms": 2 * vs["fx_trace"]["step_ms"], "peak_gib": 1.0, "losses": vs["eager"]["losses"]}
    part = {"commit": tiny_run["commit"], "date": tiny_run["date"], "command": "made up",
            "models": {"resnet50": {"variants": {"inductor": dict(fake),
                                                 "reduce_overhead": dict(fake, step_ms=fake["step_ms"] * 3)}}}}
    a, b, merged = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    a.write_text(json.dumps(tiny_run))
    b.write_text(json.dumps(part))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scale.py"), "--merge", str(a), str(b),
                           "-o", str(merged)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    m = json.loads(merged.read_text())["models"]["resnet50"]
    assert m["best_torch_compile"] == "inductor" and m["vs_torch_compile"] == pytest.approx(2.0)
    assert set(m["variants"]) == set(VARIANTS) | {"inductor", "reduce_overhead"}
    assert m["variants"]["inductor"]["loss_check"]["ok"] is True


def test_a_failed_or_wrong_variant_is_not_the_best() -> None:
    ok = {"step_ms": 10.0, "peak_gib": 2.0, "losses": [5.0, 4.9]}
    out = {"models": {"m": {"variants": {
        "eager": {"step_ms": 30.0, "peak_gib": 4.0, "losses": [5.0, 4.9]},
        "inductor": dict(ok, step_ms=12.0),
        "reduce_overhead": {"error": "Traceback ...\nRuntimeError: boom"},
        "fx_graph": dict(ok, step_ms=5.0, losses=[5.0, 7.0]),  # fast, but its loss is off
        "fx_trace": dict(ok, step_ms=8.0),
        "fx_trace_fused": dict(ok, step_ms=4.0, losses=[5.0, float("nan")]),  # fastest, but NaN
    }}}}
    scale.finalize(out)
    m = out["models"]["m"]
    assert m["variants"]["fx_graph"]["loss_check"]["ok"] is False
    assert m["variants"]["fx_trace_fused"]["loss_check"] == {"steps": 2, "max_rel_diff": None, "rtol": scale.LOSS_RTOL,
                                                              "ok": False, "why": "a loss is not finite"}
    assert (m["best_torch_compile"], m["best_flowexec"]) == ("inductor", "fx_trace")
    assert m["vs_torch_compile"] == pytest.approx(12.0 / 8.0) and m["peak_vs_eager"] == pytest.approx(0.5)
    assert "FAILED" in scale.table(out) and "BAD" in scale.table(out)
