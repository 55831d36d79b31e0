"""PipelineTrainer on 2 GPUs with NCCL (skipped without 2 GPUs): every schedule, eager and
compiled stages, trains like the whole model on one GPU."""
from __future__ import annotations

import os
from dataclasses import asdict, replace

import pytest
import torch
import torch.nn.functional as F

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on shared hosts
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs"), pytest.mark.timeout(600)]
SCHEDULES = ["FThenB", "1F1B", "Interleaved1F1B", "ZBH1", "ZBV"]


def _worker(rank: int, world: int, cfg_dict: dict, compile: bool) -> dict:
    from flowexec.pipeline.demo import Config, train_worker

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for name in SCHEDULES:
        cfg = replace(Config(**cfg_dict), schedule=name, compile=compile, device=f"cuda:{rank}")
        out[name] = train_worker(rank, world, asdict(cfg))
    return out


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_two_gpus_every_schedule_trains_as_one_gpu(compile):
    from flowexec.pipeline import spawn, split
    from flowexec.pipeline.demo import Config, blocks, data, stage_modules

    torch.backends.cuda.matmul.allow_tf32 = False
    base = Config(width=64, blocks=4, batch=32, n_micro=4, steps=3, lr=0.1)
    res = spawn(_worker, 2, asdict(base), compile, backend="nccl", timeout=240)
    for name in SCHEDULES:
        cfg = replace(base, schedule=name)
        model = blocks(cfg).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        x, y = (t.cuda() for t in data(cfg))
        for _ in range(cfg.steps):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        want = [list(s.parameters()) for s in split(model, len(stage_modules(cfg, 2)))]
        for r in range(2):
            for s, got in res[r][name]["params"].items():
                for a, b in zip(got, want[s], strict=True):
                    torch.testing.assert_close(a, b.detach().cpu(), rtol=1e-5, atol=1e-6)
        spans = res[0][name]["spans"][-1]
        assert spans and all(s.clock == "cuda" for s in spans)
