"""The backend found by name (issue 37): ``torch.compile(model, backend="flowexec")`` without
``import flowexec`` (the ``torch_dynamo_backends`` entry point pyproject.toml declares), and
Hugging Face's ``Trainer`` training with ``TrainingArguments(torch_compile_backend="flowexec")``
against the eager Trainer."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import flowexec  # noqa: F401  (the Trainer test's process: accelerate learns the name)

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


@pytest.mark.timeout(600)
def test_hf_trainer_trains_with_the_flowexec_backend(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from accelerate.utils import DynamoBackend

    assert DynamoBackend("FLOWEXEC").value == "FLOWEXEC"  # accelerate accepts the name
    import flowexec.backend as backend

    built: list[object] = []
    init = backend.GraphProgram.__init__

    def counting(self, *a, **k):
        built.append(self)
        init(self, *a, **k)

    def train(compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
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
            output_dir=str(tmp_path / ("c" if compiled else "e")), use_cpu=True, max_steps=6,
            per_device_train_batch_size=4, learning_rate=5e-3, lr_scheduler_type="linear", warmup_steps=2,
            logging_steps=1, report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0,
            disable_tqdm=True, **extra)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, [p.detach().clone() for p in model.parameters()]

    eager_losses, eager_params = train(False)
    backend.GraphProgram.__init__ = counting
    try:
        losses, params = train(True)
    finally:
        backend.GraphProgram.__init__ = init
        torch._dynamo.reset()
    assert built, "the Trainer did not run its model through the flowexec backend"
    assert len(losses) == len(eager_losses) == 6
    for k, (a, b) in enumerate(zip(losses, eager_losses)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), f"loss {k}: {a} vs eager {b}"
    for k, (p, q) in enumerate(zip(params, eager_params)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"parameter {k}: {m}")
    assert eager_losses[0] != eager_losses[-1]  # (it trained: the comparison above is not of untouched weights)
