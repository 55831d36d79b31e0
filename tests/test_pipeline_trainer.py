"""PipelineTrainer on gloo ranks (spawned or under torchrun, each with a timeout): every schedule
trains like the unsplit model in one process; bad set-ups fail at construction; a failing rank
ends every rank with its error; the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flowexec.pipeline import PipelineError, PipelineTrainer, parse_schedule, spawn
from flowexec.pipeline.demo import Config, eager_reference, stage_modules, train_worker
from helpers import clipped_sgd, sgd_losses

pytestmark = pytest.mark.timeout(300)
SCHEDULES = ["FThenB", "1F1B", "Eager1F1B", "Interleaved1F1B", "ZBH1", "ZBV"]
SMALL = Config(width=16, blocks=8, batch=16, n_micro=4, steps=3, lr=0.1, threads=1)


def _every_schedule(rank: int, world: int, cfg_dict: dict, compile: bool) -> dict:
    out = {}
    for name in SCHEDULES:
        cfg = Config(**{**cfg_dict, "schedule": name, "compile": compile})
        out[name] = train_worker(rank, world, asdict(cfg))
    return out


def _check_against_one_process(res: list[dict], world: int) -> None:
    for name in SCHEDULES:
        cfg = Config(**{**asdict(SMALL), "schedule": name})
        losses, model = eager_reference(cfg)
        want = [list(s.parameters()) for s in stage_modules(cfg, world, model)]
        held = sorted(s for r in range(world) for s in res[r][name]["stages"])
        assert held == list(range(len(want))), name
        for r in range(world):
            for s, got in res[r][name]["params"].items():
                for a, b in zip(got, want[s], strict=True):
                    torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        last = [r for r in range(world) if res[r][name]["losses"]]
        assert len(last) == 1 and res[last[0]][name]["losses"] == pytest.approx(losses, rel=1e-5), name
        if name == "ZBV":
            assert last == [0]  # the V puts the last stage back on rank 0


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_trains_as_one_process(world, compile, ranks):
    res = ranks(world).run(_every_schedule, asdict(SMALL), compile, timeout=120)
    _check_against_one_process(res, world)
    spans = res[0]["ZBH1"]["spans"][-1]
    kinds = {s.kind for s in spans}
    assert {"F", "I", "W", "OPT", "step", "wait"} <= kinds and all(s.end_ns >= s.start_ns for s in spans)


def _with_input_layer_and_head(rank: int, world: int, cfg_dict: dict) -> dict:
    return {name: train_worker(rank, world, asdict(Config(**{**cfg_dict, "schedule": name})))
            for name in ("1F1B", "Interleaved1F1B", "ZBV")}


def test_an_input_layer_and_a_head_go_to_the_first_and_last_stages_and_train_as_one_process(ranks):
    # The benchmark's model: stage 0 also holds the input layer, the last stage the head
    # (split's balance), so that the stages cost the same.
    cfg = Config(width=16, blocks=4, in_width=12, out_width=8, batch=16, n_micro=4, steps=3, lr=0.1, threads=1,
                 compile=True)
    assert [len(s) for s in stage_modules(cfg, 2)] == [3, 3]
    assert [len(s) for s in stage_modules(Config(**{**asdict(cfg), "schedule": "zbv"}), 2)] == [2, 1, 1, 2]
    res = ranks(2).run(_with_input_layer_and_head, asdict(cfg), timeout=120)
    want = list(eager_reference(cfg)[1].parameters())
    for name in ("1F1B", "Interleaved1F1B", "ZBV"):
        got = {s: ps for r in range(2) for s, ps in res[r][name]["params"].items()}
        flat = [p for s in sorted(got) for p in got[s]]
        assert len(flat) == len(want), name
        for a, b in zip(flat, want):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _bad_set_ups(rank: int, world: int) -> dict:
    errors = {}
    mods = [torch.nn.Linear(4, 4) for _ in range(4)]
    cases = {
        "zbv on 1 stage per rank": dict(stages=mods[:2], schedule="ZBV"),
        "1f1b on 4 stages": dict(stages=mods, schedule="1F1B"),
        "plan for 3 ranks": dict(stages=mods[:3], schedule=parse_schedule(
            "rank 0: 0F0 0B0\nrank 1: 1F0 1B0\nrank 2: 2F0 2B0"), microbatches=1),
        "unknown": dict(stages=mods[:2], schedule="dualpipe"),
        "deadlock": dict(stages=mods[:2], schedule=parse_schedule("rank 0: 0B0 0F0\nrank 1: 1F0 1B0"), microbatches=1),
    }
    for what, kw in cases.items():
        try:
            PipelineTrainer(loss_fn=F.mse_loss, compile=False, **{"microbatches": 4, **kw})
        except (ValueError, TypeError) as e:
            errors[what] = str(e)
    # tuples of tensors and float64 between stages, an integer tensor that needs no gradient
    torch.manual_seed(0)
    first, second = _TwoOut().double(), _TakesTwo().double()
    t = PipelineTrainer([first, second], schedule="zbh1", microbatches=2, loss_fn=F.mse_loss, compile=False,
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    losses = [t.step(x, y) for _ in range(2)]
    mine = first if rank == 0 else second
    return {"errors": errors, "params": [p.detach().clone() for p in mine.parameters()],
            "losses": [float(v) for v in losses if v is not None]}


class _TwoOut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x), torch.tanh(self.b(x)), (x[:, 0] > 0).long()  # an integer tensor: no gradient


class _TakesTwo(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Linear(7, 4)

    def forward(self, u, v, idx):
        return self.c(torch.cat([u, v], 1)) + idx[:, None].to(u.dtype) * 0.01


class _LowPrecisionOut(torch.nn.Module):
    """Sends its activation to the next stage as bfloat16, float16 and float8 at once."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h.to(torch.bfloat16), h.to(torch.float16), h.to(torch.float8_e4m3fn)


class _LowPrecisionIn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Linear(4, 4)

    def forward(self, b, h, f):
        return self.c(b.float() + h.float() + f.float())


def _low_precision(rank: int, world: int) -> dict:
    out = {}
    for compile in (False, True):
        torch.manual_seed(0)
        first, second = _LowPrecisionOut(), _LowPrecisionIn()
        t = PipelineTrainer([first, second], schedule="1F1B", microbatches=2, loss_fn=F.mse_loss, compile=compile,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), timeout=60)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
        for _ in range(2):
            t.step(x, y)
        out[compile] = [p.detach().clone() for p in (first if rank == 0 else second).parameters()]
    return out


def test_float_dtypes_travel_between_stages_with_their_gradients(ranks):
    res = ranks(2).run(_low_precision, timeout=120)
    torch.manual_seed(0)
    first, second = _LowPrecisionOut(), _LowPrecisionIn()
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.5)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    for _ in range(2):
        opt.zero_grad()
        for xm, ym in zip(x.chunk(2), y.chunk(2)):  # per micro-batch: the low-precision casts round per element
            (F.mse_loss(second(*first(xm)), ym) / 2).backward()
        opt.step()
    for compile in (False, True):
        got = res[0][compile] + res[1][compile]
        for a, b in zip(got, [*first.parameters(), *second.parameters()], strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"compile={compile}: {m}")


def test_bad_set_ups_fail_at_construction_and_tuples_travel(ranks):
    # On the kept ranks: every bad set-up is refused by the constructor's checks, before any
    # transfer or posted failure, and each rank returns its errors; no rank fails.
    res = ranks(2).run(_bad_set_ups, timeout=60)
    err = res[0]["errors"]
    assert "ZBV runs 2 stages per rank: it needs 4 stages on 2 ranks, got 2" in err["zbv on 1 stage per rank"]
    assert "1F1B runs 1 stage per rank" in err["1f1b on 4 stages"]
    assert "has jobs for ranks [0, 1, 2], but the group has 2 ranks" in err["plan for 3 ranks"]
    assert "unknown schedule 'dualpipe'" in err["unknown"]
    assert "deadlocks: rank 0 waits at 0B0" in err["deadlock"]
    assert res[1]["errors"] == err  # every rank fails the same way, before any transfer
    torch.manual_seed(0)
    first, second = _TwoOut().double(), _TakesTwo().double()
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.5)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = F.mse_loss(second(*first(x)), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert res[1]["losses"] == pytest.approx(losses, rel=1e-12)
    for a, b in zip(res[0]["params"] + res[1]["params"], [*first.parameters(), *second.parameters()], strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12)


def _fails_in_step(rank: int, world: int) -> str:
    def loss_fn(out, y):
        if rank == 1 and loss_fn.calls == 5:
            raise ValueError("bad target on rank 1")
        loss_fn.calls += 1
        return F.mse_loss(out, y)

    loss_fn.calls = 0
    t = PipelineTrainer([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], schedule="1F1B", microbatches=4,
                        loss_fn=loss_fn, compile=False, timeout=60)
    try:
        for _ in range(3):
            t.step(torch.randn(8, 4), torch.randn(8, 4))
    except Exception as e:  # report it instead of raising, so that both ranks' errors come back
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_failing_rank_ends_every_rank_with_its_error():
    import time

    t0 = time.monotonic()
    res = spawn(_fails_in_step, 2, timeout=60)
    assert res[1] == "ValueError: bad target on rank 1"
    assert res[0].startswith("PipelineError: rank 0 stopped waiting for the output gradient of stage 0")
    assert res[0].endswith("rank 1 failed: ValueError: bad target on rank 1")
    assert time.monotonic() - t0 < 60  # not the 60 s timeout: the failure ends the wait


class _FailsAtCall(torch.nn.Linear):
    """A Linear whose forward raises at its ``n``-th call (on the rank that holds it)."""

    def __init__(self, n: int) -> None:
        super().__init__(4, 4)
        self.n, self.calls = n, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.n:
            raise ValueError("bad input on rank 0")
        return super().forward(x)


def _fails_on_rank_0(rank: int, world: int) -> str:
    t = PipelineTrainer([_FailsAtCall(7), torch.nn.Linear(4, 4)], schedule="1F1B", microbatches=4,
                        loss_fn=F.mse_loss, compile=False, timeout=60)
    try:
        for _ in range(3):
            t.step(torch.randn(8, 4), torch.randn(8, 4))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_failing_rank_0_is_named_on_the_others():
    # Rank 0 used to host the group's store, which went with it: the others saw only a closed
    # connection. spawn keeps the store in the parent (torchrun's agent does the same).
    res = spawn(_fails_on_rank_0, 2, timeout=60)
    assert res[0] == "ValueError: bad input on rank 0"
    assert res[1].startswith("PipelineError: rank 1 stopped waiting for the input of stage 1"), res[1]
    assert res[1].endswith("rank 0 failed: ValueError: bad input on rank 0"), res[1]


TORCHRUN_SCRIPT = """
import json, sys, torch, torch.distributed as dist, torch.nn.functional as F
from flowexec.pipeline import PipelineTrainer, split
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)])
trainer = PipelineTrainer(split(model, 4), schedule="interleaved1f1b", microbatches=4, loss_fn=F.mse_loss,
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), compile=False)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
losses = [trainer.step(x, y) for _ in range(3)]
rank = dist.get_rank()
out = {"rank": rank, "stages": trainer.local, "losses": [float(v) for v in losses if v is not None],
       "params": {s: [p.tolist() for p in trainer.modules[s].parameters()] for s in trainer.local}}
json.dump(out, open(sys.argv[1] + f".{rank}", "w"))
dist.destroy_process_group()
"""


def test_torchrun_two_processes(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    assert res[0]["stages"] == [0, 2] and res[1]["stages"] == [1, 3]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    losses = sgd_losses(model, x, y, 3)
    assert res[1]["losses"] == pytest.approx(losses, rel=1e-5)
    for r in res:
        for s, ps in r["params"].items():
            for a, b in zip(ps, model[int(s)].parameters(), strict=True):
                torch.testing.assert_close(torch.tensor(a), b.detach(), rtol=1e-5, atol=1e-6)


TORCHRUN_FAILING_SCRIPT = """
import time, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("bad data on rank 1")
time.sleep(300)  # a host wait that never looks at the peers: a CUDA sync behind a stuck NCCL receive
"""


def test_torchrun_ends_a_rank_that_cannot_see_its_peer_fail(tmp_path):
    # A check of the launcher, which docs/pipeline.md (Failure) relies on, not of flowexec: on
    # NCCL a receive blocks the GPU, not the host, so the trainer cannot see a peer fail and the
    # launcher ends the run. torchrun stops the other ranks when one fails and names it as the
    # root cause, its traceback above.
    script = tmp_path / "fail.py"
    script.write_text(TORCHRUN_FAILING_SCRIPT)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 100  # far from rank 0's 300 s sleep
    assert proc.returncode != 0
    assert "ValueError: bad data on rank 1" in proc.stderr, proc.stderr[-3000:]
    root = proc.stderr.split("Root Cause")[1]
    assert "rank      : 1" in root, root[:1000]


def test_cli_zbh1_on_two_ranks(tmp_path, capsys):
    from flowexec.cli import main

    out = tmp_path / "jobs.json"
    assert main(["pipeline", "--schedule", "zbh1", "--ranks", "2", "--micro", "2", "--steps", "2",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step 1: loss" in text and "bubble" in text and "largest relative difference" in text
    assert float(text.split("largest relative difference ")[1].split()[0]) <= 1e-5
    events = json.loads(out.read_text())["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X" and e["tid"] == 1 and e["pid"] == 1 and e["args"]["step"] == 0]
    assert names == ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1", "0OPT"]


def test_cli_refuses_an_unwritable_trace_path_before_training(capsys):
    from flowexec.cli import main

    assert main(["pipeline", "--steps", "1", "--out", "/nonexistent/dir/x.json"]) == 2
    err = capsys.readouterr().err
    assert "flowexec pipeline:" in err and "No such file or directory" in err


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("bad batch on rank 1")
    x = torch.zeros(1)
    dist.recv(x, 1)  # never sent: the failure above, not this wait, must end the run
    return rank


def _exits_quietly(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(0)
    return rank


def test_spawn_reports_the_failing_rank():
    with pytest.raises(PipelineError, match="rank 1 failed: ValueError: bad batch on rank 1"):
        spawn(_fails_on_rank_1, 2, timeout=30)
    with pytest.raises(PipelineError, match=r"ended without a result: rank 1 \(exit code 0\)"):
        spawn(_exits_quietly, 2, timeout=60)


def _pid(rank: int, world: int) -> int:
    return os.getpid()


def test_kept_ranks_run_again_in_the_same_processes_until_a_run_fails():
    from flowexec.pipeline.launch import Ranks

    with Ranks(2, timeout=30) as kept:
        first = kept.run(_pid)
        assert kept.run(_pid) == first and len(set(first)) == 2 and os.getpid() not in first
        with pytest.raises(PipelineError, match="rank 1 failed: ValueError: bad batch on rank 1"):
            kept.run(_fails_on_rank_1)
        assert kept.closed
        with pytest.raises(PipelineError, match="closed"):
            kept.run(_pid)


def _tied(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    tied = torch.nn.Linear(8, 8)
    stages = [torch.nn.Sequential(tied, torch.nn.Tanh()), torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()),
              torch.nn.Sequential(tied, torch.nn.Tanh()), torch.nn.Linear(8, 8)]
    trainer = PipelineTrainer(stages, schedule="Interleaved1F1B", microbatches=2, loss_fn=F.mse_loss, compile=True,
                              timeout=60)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    for _ in range(2):
        trainer.step(x, y)
    return {s: [p.grad.clone() for p in trainer.modules[s].parameters()] for s in trainer.local}


def test_weight_tied_between_two_stages_of_a_rank_gets_both_gradients(ranks):
    res = ranks(2).run(_tied, timeout=120)  # rank 0 holds stages 0 and 2, both the tied Linear
    torch.manual_seed(0)
    tied = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(tied, torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), tied, torch.nn.Tanh(),
                                torch.nn.Linear(8, 8))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    F.mse_loss(model(x), y).backward()
    for got in (res[0][0], res[0][2]):  # no optimizer: the second step's .grad is one step's gradient
        torch.testing.assert_close(got[0], tied.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], tied.bias.grad, rtol=1e-5, atol=1e-6)


def _tied_model() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    tied = torch.nn.Linear(8, 8)
    return [torch.nn.Sequential(tied, torch.nn.Tanh()), torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()),
            torch.nn.Sequential(tied, torch.nn.Tanh()), torch.nn.Linear(8, 8)]


def _tied_trained(rank: int, world: int) -> dict:
    out = {}
    for schedule in ("Interleaved1F1B", "ZBV"):  # the tied stages 0 and 2: on rank 0 / on ranks 0 and 1
        for compile in (False, True):
            stages = _tied_model()
            trainer = PipelineTrainer(stages, schedule=schedule, microbatches=2, loss_fn=F.mse_loss, compile=compile,
                                      optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01), timeout=60)
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            for _ in range(3):
                trainer.step(x, y)
            out[schedule, compile] = {s: [p.detach().clone() for p in trainer.modules[s].parameters()]
                                      for s in trainer.local}
    return out


def test_a_tied_weight_is_stepped_once_with_its_whole_gradient_on_one_rank_or_across_ranks(ranks):
    res = ranks(2).run(_tied_trained, timeout=120)
    stages = _tied_model()
    model = torch.nn.Sequential(*stages)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)  # the tied weight once: one state, one step
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for key in res[0]:
        got = {s: ps for r in range(2) for s, ps in res[r][key].items()}
        assert sorted(got) == [0, 1, 2, 3], key
        for s, ps in got.items():
            for a, b in zip(ps, stages[s].parameters(), strict=True):
                torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{key} stage {s}: {m}")


def _clipped(rank: int, world: int) -> dict:
    out = {}
    for schedule in ("1F1B", "Interleaved1F1B", "ZBV"):  # the tied weight on ranks 0 and 1 / on rank 0 / on 0 and 1
        for compile in (False, True):
            stages = _tied_model()
            if schedule == "1F1B":  # one stage a rank: stages 0-1 and 2-3 joined
                stages = [torch.nn.Sequential(stages[0], stages[1]), torch.nn.Sequential(stages[2], stages[3])]
            trainer = PipelineTrainer(stages, schedule=schedule, microbatches=2, loss_fn=F.mse_loss, compile=compile,
                                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), max_grad_norm=0.05,
                                      timeout=60)
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
            norms = []
            for _ in range(3):
                trainer.step(x, y)
                norms.append(float(trainer.grad_norm))
            out[schedule, compile] = ({s: [p.detach().clone() for p in trainer.modules[s].parameters()]
                                       for s in trainer.local}, norms)
    from flowexec.pipeline.timeline import chrome_trace
    from flowexec.profiler.timers import JobTimer

    trainer.timer = JobTimer(trainer.device, rank=rank)  # the last one (ZBV, compiled): the clip in the timeline
    trainer.step(x, y)
    out["trace"] = [(e["name"], e["tid"]) for e in chrome_trace(trainer.spans)["traceEvents"] if e["ph"] == "X"]
    return out


def test_max_grad_norm_clips_by_the_whole_models_norm_as_clip_grad_norm_does(ranks):
    res = ranks(2).run(_clipped, timeout=180)
    stages = _tied_model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    norms = [float(n) for n in clipped_sgd(torch.nn.Sequential(*stages), x, y, steps=3, lr=0.5, max_norm=0.05)]
    want = [p for s in stages for p in s.parameters()]  # the tied weight at both its places
    for r in range(2):  # the clip after the last job, on the jobs' lane, before the optimizers that waited
        jobs = [name for name, tid in res[r].pop("trace") if tid == 1]
        assert jobs[-3:] == ["clip", f"{r}OPT", f"{3 - r}OPT"], jobs
    for key in res[0]:
        for r in range(2):
            assert res[r][key][1] == pytest.approx(norms, rel=1e-5), (key, r)
        got = {s: ps for r in range(2) for s, ps in res[r][key][0].items()}
        flat = [p for s in sorted(got) for p in got[s]]
        assert len(flat) == len(want), key
        for a, b in zip(flat, want, strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_max_grad_norm_must_be_a_positive_number():
    from flowexec.pipeline.step_end import check_max_norm

    import numpy as np

    assert check_max_norm(None) is None and check_max_norm(1) == 1.0
    assert check_max_norm(np.float32(0.5)) == 0.5 and check_max_norm(np.int64(2)) == 2.0
    for bad in (0, -1.0, float("inf"), float("nan"), "1", True):
        with pytest.raises(ValueError, match="max_grad_norm must be a positive finite number"):
            check_max_norm(bad)


def _resumed(rank: int, world: int, path: str) -> dict:
    out = {}
    for schedule, compile in (("ZBV", True), ("Interleaved1F1B", False)):  # the tie across ranks / on rank 0
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)

        def trainer(seed: int) -> PipelineTrainer:
            torch.manual_seed(seed)
            stages = _tied_model() if seed == 0 else [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                                      for _ in range(3)] + [torch.nn.Linear(8, 8)]
            if seed != 0:  # the same tie, other values
                stages[2] = torch.nn.Sequential(stages[0][0], torch.nn.Tanh())
            return PipelineTrainer(stages, schedule=schedule, microbatches=2, loss_fn=F.mse_loss, compile=compile,
                                   optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01), timeout=60)

        straight = trainer(0)
        for _ in range(3):
            straight.step(x, y)
        first = trainer(0)
        for _ in range(2):
            first.step(x, y)
        f = f"{path}.{schedule}.{rank}"
        torch.save(first.state_dict(), f)
        second = trainer(7)
        second.load_state_dict(torch.load(f, weights_only=False))
        second.step(x, y)
        out[schedule] = {"straight": {s: [p.detach().clone() for p in straight.modules[s].parameters()]
                                      for s in straight.local},
                         "resumed": {s: [p.detach().clone() for p in second.modules[s].parameters()]
                                     for s in second.local},
                         "step": second.step_count}
        bad = torch.load(f, weights_only=False)  # one tensor of another shape in the last local stage
        s_bad = max(bad["stages"])
        key = next(iter(bad["stages"][s_bad]))
        bad["stages"][s_bad][key] = torch.zeros(3)
        kept = {s: [p.detach().clone() for p in second.modules[s].parameters()] for s in second.local}
        try:
            second.load_state_dict(bad)
            out[schedule + " bad"] = "loaded"
        except ValueError as e:
            same = all(torch.equal(a, b) for s in second.local
                       for a, b in zip(kept[s], second.modules[s].parameters(), strict=True))
            out[schedule + " bad"] = (str(e), same, s_bad, key)
        try:  # the other rank's checkpoint
            second.load_state_dict(torch.load(f"{path}.{schedule}.{1 - rank}", weights_only=False)
                                   if os.path.exists(f"{path}.{schedule}.{1 - rank}") else {"stages": {9: {}}})
            out[schedule]["wrong"] = "loaded"
        except ValueError as e:
            out[schedule]["wrong"] = str(e)
    return out


def test_a_checkpoint_resumes_training_where_it_stopped(tmp_path, ranks):
    res = ranks(2).run(_resumed, str(tmp_path / "ckpt"), timeout=180)
    for r in range(2):
        for schedule in [k for k in res[r] if k.endswith(" bad")]:
            msg, unchanged, stage, key = res[r].pop(schedule)
            assert msg.startswith(f"rank {r}: the checkpoint's stage {stage} does not fit") and key in msg, msg
            assert unchanged  # refused before any stage was written
        for schedule, got in res[r].items():
            assert got["step"] == 3
            assert sorted(got["resumed"]) == sorted(got["straight"])
            for s in got["straight"]:
                for a, b in zip(got["resumed"][s], got["straight"][s], strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{schedule} stage {s}: {m}")
            assert got["wrong"].startswith("this checkpoint holds stages") and "load each rank's own" in got["wrong"], \
                got["wrong"]


def _evaluated(rank: int, world: int) -> dict:
    out = {}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    xv, yv = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)  # another batch size
    for schedule, compile in (("ZBV", True), ("Interleaved1F1B", False), ("1F1B", True)):
        stages = _tied_model()
        if schedule == "1F1B":
            stages = [torch.nn.Sequential(stages[0], stages[1]), torch.nn.Sequential(stages[2], stages[3])]
        t = PipelineTrainer(stages, schedule=schedule, microbatches=2, loss_fn=F.mse_loss, compile=compile,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), timeout=60)
        before = t.evaluate(xv, yv)  # before any step: nothing set up yet
        t.step(x, y)
        outputs = t.evaluate(xv)
        loss = t.evaluate(xv, yv)
        t.step(x, y)  # training goes on as if no evaluation had run
        out[schedule] = {"before": before, "outputs": outputs, "loss": loss,
                         "params": {s: [p.detach().clone() for p in t.modules[s].parameters()] for s in t.local}}
    return out


def test_evaluate_gives_the_models_loss_or_outputs_without_touching_training(ranks):
    res = ranks(2).run(_evaluated, timeout=180)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    xv, yv = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)
    stages = _tied_model()
    model = torch.nn.Sequential(*stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():  # the mean of the micro-batches' losses: equal micro-batches, so the batch's loss
        before = F.mse_loss(model(xv), yv)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    with torch.no_grad():
        outputs, loss = model(xv), F.mse_loss(model(xv), yv)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    want = [p for s in stages for p in s.parameters()]
    for schedule in res[0]:
        last = 0 if schedule == "ZBV" else 1  # ZBV's V ends on rank 0
        got = res[last][schedule]
        other = res[1 - last][schedule]
        assert other["before"] is None and other["loss"] is None and other["outputs"] is None
        torch.testing.assert_close(got["before"], before, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["outputs"], outputs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["loss"], loss, rtol=1e-5, atol=1e-6)
        params = {s: ps for r in range(2) for s, ps in res[r][schedule]["params"].items()}
        flat = [p for s in sorted(params) for p in params[s]]
        for a, b in zip(flat, want, strict=True):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule}: {m}")


class _WithUnused(torch.nn.Module):
    def __init__(self, lin: torch.nn.Linear) -> None:
        super().__init__()
        self.lin = lin
        self.unused = torch.nn.Parameter(torch.ones(3))  # never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def _four_rank_model(n: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    lins = [torch.nn.Linear(8, 8) for _ in range(n)]
    lins[n - 1], lins[n - 2] = lins[0], lins[1]  # two ties: first / last stage, second / second to last
    return [_WithUnused(lin).double() for lin in lins]


_FOUR = (("1F1B", 4), ("Interleaved1F1B", 8), ("ZBV", 8), ("ZBH1", 4))


def _four_data() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(rows, 8, generator=g, dtype=torch.float64) for rows in (16, 16, 20, 20))


def _four_ranks(rank: int, world: int) -> dict:
    out = {}
    x, y, xv, yv = _four_data()
    for schedule, n in _FOUR:
        t = PipelineTrainer(_four_rank_model(n), schedule=schedule, microbatches=4, loss_fn=F.mse_loss, compile=True,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), max_grad_norm=0.05, timeout=90)
        before = t.evaluate(xv, yv)
        norms = []
        for _ in range(2):
            t.step(x, y)
            norms.append(t.grad_norm)
        out[schedule] = {"before": before, "outputs": t.evaluate(xv), "norms": norms,
                         "params": {s: [p.detach().clone() for p in t.modules[s].parameters()] for s in t.local}}
    return out


def test_four_ranks_clip_and_evaluate_a_float64_model_with_ties_as_one_process(ranks):
    # Every placement on 4 ranks (one stage a rank, r and r+p, the V), weights tied across ranks and
    # on one rank, a parameter without a gradient, float64: the norm is summed in float64.
    res = ranks(4).run(_four_ranks, timeout=240)
    x, y, xv, yv = _four_data()
    for schedule, n in _FOUR:
        stages = _four_rank_model(n)
        model = torch.nn.Sequential(*stages)
        with torch.no_grad():
            before = F.mse_loss(model(xv), yv)
        norms = clipped_sgd(model, x, y, steps=2, lr=0.5, max_norm=0.05)
        with torch.no_grad():
            outputs = model(xv)
        last = [r for r in range(4) if n - 1 in res[r][schedule]["params"]][0]
        torch.testing.assert_close(res[last][schedule]["before"], before, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res[last][schedule]["outputs"], outputs, rtol=1e-12, atol=1e-12)
        for r in range(4):
            got = res[r][schedule]["norms"]
            assert all(g.dtype == torch.float64 for g in got), (schedule, r)
            torch.testing.assert_close(torch.stack(got), torch.stack(norms), rtol=1e-12, atol=0)
            for s, ps in res[r][schedule]["params"].items():
                for a, b in zip(ps, stages[s].parameters(), strict=True):
                    torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-12,
                                               msg=lambda m: f"{schedule} stage {s}: {m}")
