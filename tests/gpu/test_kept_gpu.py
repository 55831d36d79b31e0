"""Kept programs on CUDA: a graph-mode, fused, prefilled AdamW step kept by one process is loaded
by the next, which trains as eager does (and as the process that captured). Skipped without CUDA."""
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
import flowexec
from flowexec.models import Block, lm_loss

torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
model = Block().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def step(x, y):
    opt.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


g = torch.Generator(device="cuda").manual_seed(1)
data = [(torch.randint(0, 50, (4, 16), device="cuda", generator=g), torch.randint(0, 50, (4, 16), device="cuda", generator=g))
        for _ in range(4)]
run = step if "eager" in sys.argv else flowexec.compile(step, mode="graph", fuse="inductor")
losses = []
for x, y in data:
    losses.append(run(x, y).item())
    sched.step()
print(json.dumps({"kept": getattr(run, "kept", None), "capture_run": getattr(run, "capture_run", None),
                  "losses": losses, "params": [p.detach().float().flatten().tolist() for p in model.parameters()]}))
"""


def _run(where: Path, *argv: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(where)]),
               FLOWEXEC_KEEP_DIR=str(where / "programs"), FLOWEXEC_KEEP="1",
               TORCHINDUCTOR_CACHE_DIR=str(where / "inductor"))
    done = subprocess.run([sys.executable, str(where / "train.py"), *argv], env=env, capture_output=True, text=True,
                          timeout=280, cwd=where)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_kept_graph_mode_fused_step_loads_in_a_later_process_and_trains_as_eager(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))

    eager = _run(tmp_path, "eager")
    first = _run(tmp_path)
    second = _run(tmp_path)
    assert first["capture_run"] == "fake" and "; kept " in first["kept"], first["kept"]
    assert second["capture_run"] == "kept" and second["kept"].startswith("loaded "), second["kept"]
    for got in (first, second):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-5)
        for p, q in zip(got["params"], eager["params"]):
            torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-4, atol=1e-4)
    assert second["losses"] == first["losses"]  # (the same program on the same data)
