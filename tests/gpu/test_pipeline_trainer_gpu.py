"""PipelineTrainer on 2 GPUs with NCCL (skipped without 2 GPUs): every schedule, eager and
compiled stages, trains like the whole model on one GPU."""
from __future__ import annotations

import io
import os
from dataclasses import asdict, replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import clipped_sgd

os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on shared hosts
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"), pytest.mark.timeout(600)]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
SCHEDULES = ["FThenB", "1F1B", "Eager1F1B", "Interleaved1F1B", "ZBH1", "ZBV"]


def _worker(rank: int, world: int, cfg_dict: dict, compile: bool) -> dict:
    from flowexec.pipeline.demo import Config, train_worker

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for name in SCHEDULES:
        cfg = replace(Config(**cfg_dict), schedule=name, compile=compile, device=f"cuda:{rank}")
        out[name] = train_worker(rank, world, asdict(cfg))
    return out


def _stage_params_on_one_gpu(cfg: Any, world: int) -> list[list[torch.Tensor]]:
    """The whole model trained on one GPU, its parameters cut into the stages of ``world`` ranks."""
    from flowexec.pipeline.demo import eager_reference, stage_modules

    return [list(s.parameters()) for s in stage_modules(cfg, world, eager_reference(cfg, "cuda")[1])]


@two_gpus
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_two_gpus_every_schedule_trains_as_one_gpu(compile):
    from flowexec.pipeline import spawn
    from flowexec.pipeline.demo import Config

    torch.backends.cuda.matmul.allow_tf32 = False
    base = Config(width=64, blocks=4, batch=32, n_micro=4, steps=3, lr=0.1)
    res = spawn(_worker, 2, asdict(base), compile, backend="nccl", timeout=240)
    for name in SCHEDULES:
        want = _stage_params_on_one_gpu(replace(base, schedule=name), 2)
        for r in range(2):
            for s, got in res[r][name]["params"].items():
                for a, b in zip(got, want[s], strict=True):
                    torch.testing.assert_close(a, b.detach().cpu(), rtol=1e-5, atol=1e-6)
        spans = res[0][name]["spans"][-1]
        assert spans and all(s.clock == "cuda" for s in spans)


def _one_rank(rank: int, world: int, cfg_dict: dict) -> dict:
    """Every schedule on one NCCL rank (all stages local: ZBV and Interleaved1F1B hold 2), graph-mode
    stages, then a weight tied between the two stages of ZBV's V with Adam."""
    from flowexec.pipeline import PipelineTrainer
    from flowexec.pipeline.demo import Config, train_worker

    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for name in SCHEDULES:
        for compile in (False, True):
            cfg = replace(Config(**cfg_dict), schedule=name, compile=compile, device="cuda:0")
            out[name, compile] = train_worker(rank, world, asdict(cfg))
    for compile in (False, True):
        stages = _tied_stages()
        t = PipelineTrainer(stages, schedule="ZBV", microbatches=2, loss_fn=F.mse_loss, compile=compile,
                            optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01), timeout=120)
        x, y = _tied_data()
        for _ in range(3):
            t.step(x, y)
        out["tied", compile] = [p.detach().cpu().clone() for s in stages for p in s.parameters()]
        stages = _tied_stages()  # the same, clipped by the gradient norm, with SGD
        t = PipelineTrainer(stages, schedule="ZBV", microbatches=2, loss_fn=F.mse_loss, compile=compile,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), max_grad_norm=0.05, timeout=120)
        norms = []
        for _ in range(3):
            t.step(x, y)
            norms.append(float(t.grad_norm))
        out["clipped", compile] = ([p.detach().cpu().clone() for s in stages for p in s.parameters()], norms)
        out["evaluated", compile] = t.evaluate(x, y).cpu()  # forward only, after the clipped steps
        # a checkpoint after 2 steps, loaded into a trainer of other weights (graph-mode stages read
        # their parameters in place), then 1 step: as 3 steps straight (the "tied" run above)
        first = PipelineTrainer(_tied_stages(), schedule="ZBV", microbatches=2, loss_fn=F.mse_loss, compile=compile,
                                optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01), timeout=120)
        for _ in range(2):
            first.step(x, y)
        saved = io.BytesIO()
        torch.save(first.state_dict(), saved)
        torch.manual_seed(5)
        other = torch.nn.Linear(16, 16)
        stages = [torch.nn.Sequential(other, torch.nn.Tanh()), torch.nn.Sequential(other, torch.nn.Tanh())]
        second = PipelineTrainer(stages, schedule="ZBV", microbatches=2, loss_fn=F.mse_loss, compile=compile,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01), timeout=120)
        second.step(x, y)  # set up (graphs captured) on the other weights before the load
        second.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
        second.step(x, y)
        out["resumed", compile] = [p.detach().cpu().clone() for s in stages for p in s.parameters()]
    return out


def _tied_stages() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    tied = torch.nn.Linear(16, 16)
    return [torch.nn.Sequential(tied, torch.nn.Tanh()), torch.nn.Sequential(tied, torch.nn.Tanh())]


def _tied_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def test_one_gpu_every_schedule_and_a_tied_weight_train_as_one_process():
    """One rank of an NCCL group holds every stage: the trainer's CUDA path (graph-mode stages,
    CUDA-event spans, stages handing over on the device, optimizers) without transfers, which
    need 2 GPUs (the test above)."""
    from flowexec.pipeline import spawn
    from flowexec.pipeline.demo import Config

    torch.backends.cuda.matmul.allow_tf32 = False
    base = Config(width=64, blocks=4, batch=32, n_micro=4, steps=3, lr=0.1)
    res = spawn(_one_rank, 1, asdict(base), backend="nccl", timeout=240)[0]
    for name in SCHEDULES:
        want = _stage_params_on_one_gpu(replace(base, schedule=name), 1)
        for compile in (False, True):
            got = res[name, compile]
            assert sorted(got["params"]) == list(range(len(want))), (name, compile)
            for s, ps in got["params"].items():
                for a, b in zip(ps, want[s], strict=True):
                    torch.testing.assert_close(a, b.detach().cpu(), rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{name} compile={compile}: {m}")
            spans = [sp for step in got["spans"] for sp in step]
            assert spans and all(sp.clock == "cuda" for sp in spans if sp.kind in ("F", "B", "I", "W"))
    stages = _tied_stages()
    model = torch.nn.Sequential(*stages).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = (t.cuda() for t in _tied_data())
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    want = [p.detach().cpu() for s in stages for p in s.parameters()]
    for compile in (False, True):
        for a, b in zip(res["tied", compile], want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"tied compile={compile}: {m}")
        for a, b in zip(res["resumed", compile], want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"resumed compile={compile}: {m}")
    stages = _tied_stages()
    model = torch.nn.Sequential(*stages).cuda()
    norms = [float(n) for n in clipped_sgd(model, x, y, steps=3, lr=0.5, max_norm=0.05)]
    want = [p.detach().cpu() for s in stages for p in s.parameters()]
    with torch.no_grad():
        evaluated = F.mse_loss(model(x), y).cpu()
    for compile in (False, True):
        torch.testing.assert_close(res["evaluated", compile], evaluated, rtol=1e-5, atol=1e-6)
        got, got_norms = res["clipped", compile]
        assert got_norms == pytest.approx(norms, rel=1e-5), compile
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"clipped compile={compile}: {m}")


def _replicas(rank: int, world: int, compile: bool) -> dict:
    """Two replicas of a one-rank pipeline (ZBV's two stages on one GPU each), each on half of
    the batch, graph-mode or eager stages, with the clip."""
    from flowexec.pipeline import PipelineTrainer

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    stages = _tied_stages()
    t = PipelineTrainer(stages, schedule="ZBV", microbatches=2, loss_fn=F.mse_loss, compile=compile,
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), max_grad_norm=0.05, data_parallel=2,
                        timeout=120)
    x, y = _tied_data()
    part = slice(4 * t.replica, 4 * t.replica + 4)
    norms = []
    for _ in range(3):
        t.step(x[part], y[part])
        norms.append(float(t.grad_norm))
    return {"params": [p.detach().cpu().clone() for s in stages for p in s.parameters()], "norms": norms}


@two_gpus
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_two_gpus_two_replicas_train_as_one_gpu_on_the_whole_batch(compile):
    from flowexec.pipeline import spawn

    torch.backends.cuda.matmul.allow_tf32 = False
    res = spawn(_replicas, 2, compile, backend="nccl", timeout=240)
    stages = _tied_stages()
    model = torch.nn.Sequential(*stages).cuda()
    x, y = (t.cuda() for t in _tied_data())
    norms = [float(n) for n in clipped_sgd(model, x, y, steps=3, lr=0.5, max_norm=0.05)]
    want = [p.detach().cpu() for s in stages for p in s.parameters()]
    for r in range(2):
        assert res[r]["norms"] == pytest.approx(norms, rel=1e-5), r
        for a, b in zip(res[r]["params"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"replica {r}: {m}")
