"""A fused build's cache entries carry their Triton kernels (flowexec.inductor._Batch): a cold
build whose kernels compile in Inductor's worker pool (their waits put off to the block's end)
writes entries from which a warm process loads the kernels ready to launch. Runs
``benchmarks/probes/bundles.py`` (a transformer block's fused graph step, cold then warm, each in
a fresh process) and checks what it found. Skipped without CUDA."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def test_a_warm_build_loads_every_triton_kernel_from_the_cold_builds_entries(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "bundles.py"), "--out", str(tmp_path),
                           "--cache", str(tmp_path / "cache")], capture_output=True, text=True, timeout=580, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((tmp_path / "bundles.json").read_text())
    cold, warm = found["cold"], found["warm"]
    assert "error" not in cold and "error" not in warm, (cold.get("error"), warm.get("error"))
    ccold, cwarm = cold["counters"]["inductor"], warm["counters"]["inductor"]
    assert cold["fused"] >= 3 and ccold.get("async_compile_cache_miss", 0) >= 3, cold
    assert ccold.get("triton_bundler_save_kernel", 0) > 0, cold  # (the kernels' binaries went into the entries)
    assert cwarm.get("fxgraph_cache_hit", 0) >= warm["fused"] == cold["fused"], (cold, warm)
    # The warm process's entries brought the kernels ready to launch (Inductor's static
    # launcher: no Triton compile, no load from Triton's cache): at least one per region. Before
    # 07c7a5a the entries held none of the kernels the pool built (on an H100 at c1c0f4c the 13
    # entries of this step held 22 launchers for its 23 kernels, and the warm process loaded all
    # 22: benchmarks/probes/bundles.py).
    assert cwarm.get("triton_bundler_load_static_autotuner", 0) >= warm["fused"], (cold, warm)
    assert warm["loss"] == cold["loss"]
