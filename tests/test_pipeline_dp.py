"""PipelineTrainer(data_parallel=k): k replicas of a pipeline on gloo ranks, each fed its own
part of the batch, train like the unsplit model on the whole batch in one process; with a weight
tied across ranks and the clip; a timeline per replica; bad replica counts are refused."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from flowexec.pipeline import PipelineTrainer
from helpers import clipped_sgd

pytestmark = pytest.mark.timeout(300)

SCHEDULES = (("FThenB", 1), ("1F1B", 1), ("Eager1F1B", 1), ("ZBH1", 1), ("Interleaved1F1B", 2),
             ("ZBV", 2))  # and stages a rank


def _model(n_stages: int) -> list[torch.nn.Module]:
    """``n_stages`` stages of 8 -> 8 with a weight tied between the first and the last (one
    stage: used twice there); the first keeps a parameter that never gets a gradient."""
    torch.manual_seed(0)
    tied = torch.nn.Linear(8, 8)
    stages = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(n_stages)]
    stages[0] = torch.nn.Sequential(tied, torch.nn.Tanh())
    stages[-1] = torch.nn.Sequential(*stages[-1], tied, torch.nn.Tanh(), torch.nn.Linear(8, 8))
    stages[0].register_parameter("unused", torch.nn.Parameter(torch.ones(2)))
    return stages


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(24, 8, generator=g), torch.randn(24, 8, generator=g)


def _replicas(rank: int, world: int, dp: int, out_dir: str) -> dict:
    x, y = _data()
    out: dict = {"refused": []}
    for bad in (3, 0, True, 1.5):  # refused before any collective, so every rank goes on
        try:
            PipelineTrainer(_model(2), schedule="1F1B", microbatches=2, loss_fn=F.mse_loss, data_parallel=bad)
        except ValueError as e:
            out["refused"].append(str(e))
    for schedule, v in SCHEDULES:
        for compile in (False, True):
            t = PipelineTrainer(_model(v * world // dp), schedule=schedule, microbatches=2, loss_fn=F.mse_loss, compile=compile,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), max_grad_norm=0.05,
                                data_parallel=dp, timeout=90)
            part = slice(t.replica * 24 // dp, (t.replica + 1) * 24 // dp)  # this replica's rows
            losses, norms = [], []
            for _ in range(3):
                loss = t.step(x[part], y[part])
                losses.append(None if loss is None else float(loss))
                norms.append(float(t.grad_norm))
            out[schedule, compile] = {"rank": t.rank, "replica": t.replica, "losses": losses, "norms": norms,
                                      "params": {s: [p.detach().clone() for p in t.modules[s].parameters()]
                                                 for s in t.local},
                                      "evaluated": t.evaluate(x[part], y[part])}
    t = PipelineTrainer(_model(world // dp), schedule="1F1B", microbatches=2, loss_fn=F.mse_loss, data_parallel=dp,
                        timeout=90)
    part = slice(t.replica * 24 // dp, (t.replica + 1) * 24 // dp)
    with t.profiling(out_dir):
        t.step(x[part], y[part])
    out["routed"] = _routed_run(world, dp)
    return out


class _Route(torch.nn.Module):
    """A micro-batch takes ``a`` or ``b`` by the sign of its first input: the other one gets no
    gradient (``.grad`` None on eager stages), and which one differs between replicas."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x) if x[0, 0] > 0 else self.b(x))


def _routed_model(seed: int) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [torch.nn.Sequential(_Route()), torch.nn.Sequential(torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8))]


def _routed_data() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data()
    x[:, 0] = x[:, 0].abs() * torch.tensor([1.0] * 12 + [-1.0] * 12)  # replica 0 takes a, replica 1 b
    return x, y


def _routed_run(world: int, dp: int) -> dict:
    """Eager stages, no clip, no tie: replicas built from other seeds (replica 0's weights win),
    a branch that each replica's data takes differently, a BatchNorm."""
    x, y = _routed_data()
    replica = torch.distributed.get_rank() // (world // dp)
    stages = _routed_model(100 + replica)
    t = PipelineTrainer(stages, schedule="1F1B", microbatches=2, loss_fn=F.mse_loss, compile=False,
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), data_parallel=dp, timeout=90)
    part = slice(t.replica * 24 // dp, (t.replica + 1) * 24 // dp)
    for _ in range(3):
        t.step(x[part], y[part])
    return {s: {k: v.clone() for k, v in t.modules[s].state_dict().items()} for s in t.local}


def _routed_reference() -> list[dict]:
    """One process: replica 0's model, each step the four micro-batches of the whole batch in
    turn, each loss over 4 (the pipeline's micro-batch losses, averaged over the replicas)."""
    stages = _routed_model(100)
    model = torch.nn.Sequential(*stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _routed_data()
    for _ in range(3):
        opt.zero_grad()
        for xm, ym in zip(x.chunk(4), y.chunk(4)):
            (F.mse_loss(model(xm), ym) / 4).backward()
        opt.step()
    return [s.state_dict() for s in stages]


def _reference(n: int, dp: int) -> tuple[list[torch.Tensor], list[float], float, list[float]]:
    """The unsplit model on the whole batch: parameters after 3 steps (the tied one at both its
    places), the clip's norms, the loss before the first step, and the loss of each replica's
    part after the last."""
    stages = _model(n)
    model = torch.nn.Sequential(*stages)
    x, y = _data()
    with torch.no_grad():
        first = float(F.mse_loss(model(x), y))
    norms = [float(v) for v in clipped_sgd(model, x, y, steps=3, lr=0.5, max_norm=0.05)]
    with torch.no_grad():
        parts = [float(F.mse_loss(model(x[d * 24 // dp:(d + 1) * 24 // dp]), y[d * 24 // dp:(d + 1) * 24 // dp]))
                 for d in range(dp)]
    return [p for s in stages for p in s.parameters()], norms, first, parts


def test_replicas_train_as_one_process_on_the_whole_batch(tmp_path, ranks):
    """2 replicas of a 2-rank pipeline on 4 gloo ranks."""
    world, dp = 4, 2
    res = ranks(world).run(_replicas, dp, str(tmp_path), timeout=280)
    p = world // dp
    assert res[0].pop("refused") == ["data_parallel=3 replicas do not split the group's 4 ranks evenly",
                                      "data_parallel must be a whole number >= 1, got 0",
                                      "data_parallel must be a whole number >= 1, got True",
                                      "data_parallel must be a whole number >= 1, got 1.5"]
    for (schedule, v), compile in [(s, c) for s in SCHEDULES for c in (False, True)]:
        key = (schedule, compile)
        want, norms, first, parts = _reference(v * p, dp)
        for r in range(world):
            assert (res[r][key]["replica"], res[r][key]["rank"]) == divmod(r, p), key
            assert res[r][key]["norms"] == pytest.approx(norms, rel=1e-5), (key, r)
        for d in range(dp):  # every replica ends with the same parameters, those of one process
            got = {s: ps for r in range(d * p, (d + 1) * p) for s, ps in res[r][key]["params"].items()}
            flat = [t for s in sorted(got) for t in got[s]]
            assert len(flat) == len(want), key
            for a, b in zip(flat, want, strict=True):
                torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{key} replica {d}: {m}")
        # each replica's last rank has its own part's loss; their mean is the whole batch's
        last = [res[r][key] for r in range(world) if res[r][key]["losses"][0] is not None]
        assert sorted(x["replica"] for x in last) == list(range(dp)), key
        assert sum(x["losses"][0] for x in last) / dp == pytest.approx(first, rel=1e-5), key
        for x in last:  # evaluate: the replica's part through the trained model
            assert float(x["evaluated"]) == pytest.approx(parts[x["replica"]], rel=1e-5), key
    # replica 0's weights everywhere, a branch only one replica took, BatchNorm's statistics: replica 0's
    want = _routed_reference()
    for r in range(world):
        for s, state in res[r]["routed"].items():
            for k, v in state.items():
                if "running" in k or "num_batches" in k:
                    torch.testing.assert_close(v, res[r % p]["routed"][s][k], msg=lambda m: f"rank {r} {k}: {m}")
                else:
                    torch.testing.assert_close(v, want[s][k], rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {r} {k}: {m}")
    # a timeline per replica, its ranks numbered within the pipeline
    for d in range(dp):
        files = sorted(os.listdir(tmp_path / f"replica{d}"))
        assert files == [f"rank{r}.jsonl" for r in range(p)], files
        for r in range(p):  # every rank's step ends with the replicas' average
            with open(tmp_path / f"replica{d}" / f"rank{r}.jsonl") as f:
                text = f.read()
            assert '"average"' in text, text[:500]
