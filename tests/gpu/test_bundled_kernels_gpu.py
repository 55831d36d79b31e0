"""A fused build's cache entries carry their Triton kernels (flowexec.inductor._Batch): a cold
build whose kernels compile in Inductor's worker pool (their waits put off to the block's end)
writes entries from which a warm process loads the kernels ready to launch. Skipped without CUDA."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
import torch
from torch._dynamo.utils import counters
from torch._inductor.async_compile import AsyncCompile
import flowexec
from flowexec.models import Block, lm_loss

if sys.argv[1] == "cold":  # (Inductor's pool up first: every kernel then builds there, its wait put off)
    AsyncCompile.warm_pool()
    AsyncCompile.wait_pool_ready()
torch.manual_seed(0)
model = Block().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)


def step(x, y):
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


x = torch.randint(0, 50, (4, 16), device="cuda")
run = flowexec.compile(step, mode="graph", fuse="inductor")
loss = run(x, x).item()
print(json.dumps({"loss": loss, "fused": run.plan.stats()["fused_regions"],
                  "triton": counters["inductor"]["async_compile_cache_miss"],
                  "from_bundles": counters["inductor"]["async_compile_cache_hit"],
                  "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
                  "bundled": counters["inductor"]["triton_bundler_save_kernel"],
                  "launchers": counters["inductor"]["triton_bundler_load_static_autotuner"]}))
"""


def _run(where: Path, phase: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(where)]), FLOWEXEC_COMPILE_PROCESSES="0",
               TORCHINDUCTOR_CACHE_DIR=str(where / "inductor"), TRITON_CACHE_DIR=str(where / "triton"))
    done = subprocess.run([sys.executable, str(where / "train.py"), phase], env=env, capture_output=True, text=True,
                          timeout=280, cwd=where)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_warm_build_loads_every_triton_kernel_from_the_cold_builds_entries(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    cold = _run(tmp_path, "cold")
    warm = _run(tmp_path, "warm")
    assert cold["fused"] >= 3 and cold["triton"] >= 3, cold
    assert cold["bundled"] > 0, cold  # (the kernels' binaries went into the entries)
    assert warm["fx_hits"] >= warm["fused"] == cold["fused"], (cold, warm)
    # The warm process's entries brought the kernels ready to launch (Inductor's static
    # launcher: no Triton compile, no load from Triton's cache): at least one per region. Before
    # 07c7a5a the entries held none of the kernels the pool built (on an H100 at c1c0f4c the 13
    # entries of this step held 22 launchers for its 23 kernels, and the warm process loaded all
    # 22: benchmarks/probes/bundles.py).
    assert warm["launchers"] >= warm["fused"], (cold, warm)
    assert warm["loss"] == cold["loss"]
