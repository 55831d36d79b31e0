"""The examples run as their docstrings say (torchrun, 2 gloo ranks on the CPU, small sizes)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "pipeline_train.py")


def _torchrun(*args: str, procs: int = 2) -> str:
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                           EXAMPLE, "--width", "32", "--depth", "2", *args],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _validation(out: str) -> float:
    found = re.findall(r"validation loss after \d+ steps: ([0-9.]+)", out)
    assert len(found) == 1, out  # printed once, by the last stage's rank
    return float(found[0])


def test_pipeline_train_example_trains_and_resumes_where_it_stopped(tmp_path):
    """A ZBV run saving every 4 steps; a run resumed from its step-4 checkpoint ends where it
    ended. A 1F1B run stopped after 4 steps and resumed ends there too (the schedules train the
    same model: one reference run serves both)."""
    straight = _torchrun("--schedule", "ZBV", "--steps", "8", "--save", str(tmp_path / "zbv"), "--save-every", "4")
    assert sorted(os.listdir(tmp_path / "zbv")) == ["rank0.pt", "rank1.pt", "step4"]
    assert sorted(os.listdir(tmp_path / "zbv" / "step4")) == ["rank0.pt", "rank1.pt"]
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", straight)]
    assert losses[-1] < losses[0]  # it learns
    resumed = _torchrun("--schedule", "ZBV", "--steps", "8", "--resume", str(tmp_path / "zbv" / "step4"))
    assert "step 0:" not in resumed and "step 5:" in resumed and "step 7:" in resumed
    assert _validation(resumed) == pytest.approx(_validation(straight), rel=1e-6)

    first = _torchrun("--schedule", "1F1B", "--steps", "8", "--stop-after", "4", "--save", str(tmp_path / "1f1b"))
    assert sorted(os.listdir(tmp_path / "1f1b")) == ["rank0.pt", "rank1.pt"]
    assert "step 0:" in first and "step 5:" not in first
    assert _validation(first) != pytest.approx(_validation(straight), rel=1e-3)
    resumed = _torchrun("--schedule", "1F1B", "--steps", "8", "--resume", str(tmp_path / "1f1b"))
    assert "step 0:" not in resumed and "step 7:" in resumed
    assert _validation(resumed) == pytest.approx(_validation(straight), rel=1e-5)


def _one_process(steps: int) -> float:
    """The example's training in eager PyTorch, one process, whole batches (its defaults: AdamW
    at 3e-3 with a cosine schedule over the run, the gradient clipped to norm 1 over the whole
    model, 64 rows a batch): the validation loss after ``steps`` steps."""
    spec = importlib.util.spec_from_file_location("pipeline_train_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # (its main() runs only as a script)
    cpu = torch.device("cpu")
    with torch.random.fork_rng():
        torch.manual_seed(0)  # as every rank seeds before making the model
        model = example.make_model(32, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    for step in range(steps):
        x, y = example.batch(step, 64, cpu)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    with torch.no_grad():
        x, y = example.batch(-1, 64, cpu)
        return F.mse_loss(model(x), y).item()


def test_pipeline_train_example_with_two_replicas_trains_as_one_pipeline():
    """4 ranks as 2 replicas of a 2-rank pipeline, each on half of every batch: the model
    trained in one process on the whole batches (the gradients' average is the whole batch's
    gradient). (Eager PyTorch here rather than a third torchrun launch of one pipeline: the
    resume test above runs the pipeline alone.)"""
    two = _torchrun("--schedule", "ZBH1", "--steps", "3", "--data-parallel", "2", procs=4)
    assert _validation(two) == pytest.approx(_one_process(3), rel=1e-5)
