"""benchmarks/probes/model_sweep.py on the CPU: two of its cases, trained by eager and by
flowexec, compared parameter by parameter, in the results file the GPU run writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "probes"))
import model_sweep  # noqa: E402


@pytest.mark.timeout(240)
def test_the_sweep_compares_every_parameter_and_writes_its_verdicts(tmp_path) -> None:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "probes", "model_sweep.py"), "--device",
                           "cpu", "--cases", "gru,spectral_norm", "--variants", "trace,planned", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "model_sweep_cpu.json") as fh:
        out = json.load(fh)
    assert set(out["results"]) == {"gru", "spectral_norm"}
    for case in out["results"].values():
        assert [case[v]["verdict"] for v in ("trace", "planned")] == ["OK", "OK"], case
    assert "not OK: none" in proc.stdout


def test_a_differing_parameter_is_bad_and_a_key_bias_is_noise() -> None:
    import torch

    eager = ([1.0, 2.0], [("w", torch.zeros(3)), ("attn.k_proj.bias", torch.zeros(2))])
    off = ([1.0, 2.0], [("w", torch.tensor([0.0, 1e-3, 0.0])), ("attn.k_proj.bias", torch.ones(2))])
    r = model_sweep.compare(eager, off, 1e-5)
    assert (r["verdict"], r["worst_state"], r["noise"]) == ("BAD", "w", ["attn.k_proj.bias"])
    assert model_sweep.compare(eager, eager, 1e-5)["verdict"] == "OK"
    assert model_sweep.compare(eager, ([1.0, 2.1], eager[1]), 1e-5)["verdict"] == "BAD"  # a loss apart


def test_a_lone_entry_adam_moved_by_a_part_of_lr_is_noise() -> None:
    """One entry of a large parameter off by less than 2 lr (its first gradient near Adam's eps,
    rounded otherwise by a fused reduction) is noise; two entries, or one off by more, are not."""
    import torch

    def off(*entries: tuple[int, float]) -> tuple[list[float], list[tuple[str, torch.Tensor]]]:
        w = torch.zeros(4096)
        for i, d in entries:
            w[i] = d
        return [1.0], [("w", w)]

    eager = off()
    r = model_sweep.compare(eager, off((7, 4.3e-5)), 1e-5)
    assert r["verdict"] == "OK" and r["noise"] == ["w (1 of 4096 entries, 4.3e-05)"]
    assert model_sweep.compare(eager, off((7, 4.3e-5), (9, 4.3e-5)), 1e-5)["verdict"] == "BAD"
    assert model_sweep.compare(eager, off((7, 3 * model_sweep.LR)), 1e-5)["verdict"] == "BAD"
