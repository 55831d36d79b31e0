"""The backend found by name (issue 37): ``torch.compile(model, backend="flowexec")`` without
``import flowexec`` (the ``torch_dynamo_backends`` entry point pyproject.toml declares), and
Hugging Face's ``Trainer`` training with ``TrainingArguments(torch_compile_backend="flowexec")``
against the eager Trainer, also without ``import flowexec`` (the wheel's start-up hook)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from typing import Any

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _declared_entry_point() -> tuple[str, str]:
    """(name, object) of the torch_dynamo_backends entry point in pyproject.toml."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    section = re.search(r"^\[project\.entry-points\.torch_dynamo_backends\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml declares no torch_dynamo_backends entry point"
    name, target = re.search(r'^(\w+)\s*=\s*"([^"]+)"', section.group(1), re.M).groups()
    return name, target


@pytest.mark.timeout(300)
def test_torch_compile_finds_the_backend_by_name_without_import(tmp_path) -> None:
    # The entry point as an installed package would declare it (this checkout may be installed
    # elsewhere, or not at all): a dist-info on the path of a fresh interpreter.
    name, target = _declared_entry_point()
    info = tmp_path / "flowexec_entry_point-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flowexec-entry-point\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[torch_dynamo_backends]\n{name} = {target}\n")
    script = textwrap.dedent("""
        import json, sys, torch
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        x = torch.randn(4, 8)
        before = "flowexec" in sys.modules
        out = torch.compile(net, backend="flowexec")(x)
        out.sum().backward()
        grads = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        ref = net(x)
        ref.sum().backward()
        print(json.dumps({"imported_before": before, "loaded_after": "flowexec.backend" in sys.modules,
                          "out": (out - ref).abs().max().item(),
                          "grads": max((g - p.grad).abs().max().item() for g, p in zip(grads, net.parameters()))}))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["imported_before"] is False and got["loaded_after"] is True, got
    assert got["out"] < 1e-6 and got["grads"] < 1e-6, got


def _sources(tmp_path) -> Any:
    """A copy of what the package is built from (builds write build/ and *.egg-info beside it)."""
    src = tmp_path / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md", "_flowexec_accelerate.py"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "flowexec"), src / "flowexec",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    return src


def _built_wheel(tmp_path) -> str:
    """The package as pip builds it (from a copy of the sources: nothing is written into the
    checkout), unpacked into a directory that stands in for site-packages."""
    src = _sources(tmp_path)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(src)], check=True, capture_output=True, timeout=240)
    site_dir = tmp_path / "site"
    with zipfile.ZipFile(next(wheels.glob("flowexec-*.whl"))) as whl:
        whl.extractall(site_dir)
    return str(site_dir)


# A fresh interpreter without site (-S): its packages come from the real site-packages as plain
# path entries (their .pth files unread, so an installed flowexec's hook does not count), and the
# built wheel's directory is added the way site adds site-packages at start-up, .pth included.
_TRAINER = textwrap.dedent("""
    import json, site, sys
    sys.path[:] = [p for p in sys.path if p]
    sys.path += json.loads(sys.argv[2])
    site.addsitedir(sys.argv[1])
    import torch, transformers

    def train(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        g = torch.Generator().manual_seed(1)
        data = []
        for _ in range(24):
            ids = torch.randint(0, 64, (8,), generator=g)
            data.append({"input_ids": ids, "labels": ids.clone()})
        extra = {"torch_compile": True, "torch_compile_backend": "flowexec"} if compiled else {}
        args = transformers.TrainingArguments(
            output_dir=sys.argv[3] + ("/c" if compiled else "/e"), use_cpu=True, max_steps=6,
            per_device_train_batch_size=4, learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=2,
            logging_steps=1, report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0,
            disable_tqdm=True, **extra)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        imported = "flowexec" in sys.modules
        trainer.train()
        return ([h["loss"] for h in trainer.state.log_history if "loss" in h],
                [p.detach().clone() for p in model.parameters()], imported)

    eager_losses, eager_params, _ = train(False)
    losses, params, imported = train(True)
    backend = sys.modules.get("flowexec.backend")
    print(json.dumps({"imported_before_training": imported,
                      "backend_from": getattr(backend, "__file__", None),
                      "losses": losses, "eager_losses": eager_losses,
                      "params": max((p - q).abs().max().item() for p, q in zip(params, eager_params)),
                      "params_scale": max(q.abs().max().item() for q in eager_params)}))
""")


@pytest.mark.timeout(600)
def test_hf_trainer_trains_with_the_flowexec_backend_without_import(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    site_dir = _built_wheel(tmp_path)
    assert os.path.exists(os.path.join(site_dir, "flowexec-accelerate.pth")), "the wheel ships no start-up hook"
    paths = [p for p in sys.path if p and os.path.isdir(p) and os.path.abspath(p) != ROOT]
    res = subprocess.run([sys.executable, "-S", "-c", _TRAINER, site_dir, json.dumps(paths), str(tmp_path)],
                         capture_output=True, text=True, timeout=560, cwd=str(tmp_path),
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["imported_before_training"] is False, got  # accelerate learned the name from the .pth alone
    assert got["backend_from"] and got["backend_from"].startswith(site_dir), got  # the Trainer ran the backend
    losses, eager_losses = got["losses"], got["eager_losses"]
    assert len(losses) == len(eager_losses) == 6
    for k, (a, b) in enumerate(zip(losses, eager_losses)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"loss {k}: {a} vs eager {b}"
    assert got["params"] <= 1e-6 + 1e-5 * got["params_scale"], got
    assert eager_losses[0] != eager_losses[-1]  # (it trained: the comparison above is not of untouched weights)


@pytest.mark.timeout(300)
def test_the_editable_install_ships_the_start_up_hook(tmp_path) -> None:
    """scripts/setup.sh installs flowexec editable (PEP 660): setup.py's editable_wheel puts the
    .pth at that wheel's root too (it overrides a setuptools method that is not public API: this
    says so if a setuptools release stops calling it)."""
    src = _sources(tmp_path)
    out = tmp_path / "editable"
    out.mkdir()
    script = "import sys; from setuptools import build_meta as b; print(b.build_editable(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", script, str(out)], cwd=str(src), capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    name = res.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(out / name) as whl:
        assert "flowexec-accelerate.pth" in whl.namelist(), whl.namelist()


def test_the_start_up_hook_teaches_accelerate_once_loaded() -> None:
    pytest.importorskip("accelerate")
    import _flowexec_accelerate as hook
    from accelerate.utils import DynamoBackend

    assert hook.install()  # accelerate is loaded in this process: taught at once
    assert DynamoBackend("FLOWEXEC").value == "FLOWEXEC"
    assert sum(isinstance(f, hook.AfterAccelerate) for f in sys.meta_path) <= 1
