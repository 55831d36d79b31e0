"""How PipelineTrainer moves messages on gloo (2 spawned ranks, each test with a timeout): the
receive buffers are kept for the run and reused every step, also where a weight's gradient is
the received output gradient itself; a step's receives are posted just before the first job
that takes one; the send thread's isend calls come back as ``isend`` spans when the steps are
timed, and not otherwise."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowexec.pipeline import PipelineTrainer
from flowexec.profiler.timers import JobTimer

pytestmark = pytest.mark.timeout(300)
ROWS, WIDTH, MICRO, STEPS = 4, 8, 4, 3


class AddWeight(torch.nn.Module):
    """``x + w`` with ``w`` shaped like one micro-batch: dL/dw is dL/dy, the gradient the next
    rank sends back, as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(ROWS, WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w


def _stages() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), AddWeight()),
            torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS * MICRO, WIDTH, generator=g), torch.randn(ROWS * MICRO, WIDTH, generator=g)


def _reference() -> list[torch.Tensor]:
    """One process, micro-batch by micro-batch: the gradient of the mean of the micro-batches' losses."""
    stages = _stages()
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = _data()
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(F.mse_loss(stages[1](stages[0](xm)), ym) for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO))) / MICRO
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in params]


def _train(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    x, y = _data()
    for schedule in ("1F1B", "ZBH1"):
        for compile in (False, True):
            stages = _stages()
            t = PipelineTrainer(stages, schedule=schedule, microbatches=MICRO, loss_fn=F.mse_loss, compile=compile,
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), timeout=60)
            t.timer = JobTimer(t.device, rank=rank)
            ptrs = []
            for _ in range(STEPS):
                t.step(x, y)
                ptrs.append(sorted(b.data_ptr() for bufs in t._recv_bufs.values() for b in bufs))
            grads = [p.grad for p in stages[rank].parameters()]
            bufs = [b for bs in t._recv_bufs.values() for b in bs]
            out[schedule, compile] = {
                "params": [p.detach().clone() for p in stages[rank].parameters()],
                "same_buffers_every_step": len(ptrs[0]) > 0 and all(p == ptrs[0] for p in ptrs),
                "grad_shares_a_buffer": any(g is not None and g.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                                            for g in grads for b in bufs),
                "spans": t.spans}
            t._sender.close()
    return out


@pytest.fixture(scope="module")
def trained(ranks) -> list[dict]:
    return ranks(2).run(_train, timeout=120)


def test_reused_receive_buffers_train_as_one_process(trained):
    want = _reference()
    for key in trained[0]:
        got = trained[0][key]["params"] + trained[1][key]["params"]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
        for r in (0, 1):
            assert trained[r][key]["same_buffers_every_step"], (key, r)
        # stage 0's AddWeight: its gradient is what rank 1 sent; .grad must be its own memory
        assert not trained[0][key]["grad_shares_a_buffer"], key


def test_receives_are_posted_before_the_first_job_that_takes_one(trained):
    for key in trained[0]:
        for r in (0, 1):
            spans = trained[r][key]["spans"]
            jobs = sorted((s for s in spans if s.kind in ("F", "B", "I", "W")), key=lambda s: s.start_ns)
            recvs = [s for s in spans if s.kind == "recv"]
            assert recvs, (key, r)
            first_taker = 2 if r == 0 else 0  # rank 0: 0F0 0F1 then 0B0/0I0; rank 1: 1F0
            assert jobs[first_taker].label in ("0B0", "0I0", "1F0"), (key, r, [j.label for j in jobs[:3]])
            posted = min(s.start_ns for s in recvs)
            assert all(j.end_ns <= posted for j in jobs[:first_taker]), (key, r)
            assert posted <= jobs[first_taker].start_ns, (key, r)


def test_send_thread_calls_come_back_as_isend_spans(trained):
    for key in trained[0]:
        for r in (0, 1):
            spans = trained[r][key]["spans"]
            handed = {(s.peer, s.tag): s for s in spans if s.kind == "send"}
            issued = {(s.peer, s.tag): s for s in spans if s.kind == "isend"}
            assert len(handed) == MICRO and handed.keys() == issued.keys(), (key, r)
            for k, s in issued.items():
                assert s.stream == "send thread" and s.stage == handed[k].stage and s.micro == handed[k].micro
                assert s.start_ns >= handed[k].start_ns and s.end_ns >= s.start_ns
                assert s.name == handed[k].name.replace("send", "isend", 1)


def _untimed(rank: int, world: int) -> list:
    x, y = _data()
    t = PipelineTrainer(_stages(), schedule="1F1B", microbatches=MICRO, loss_fn=F.mse_loss, compile=False, timeout=60)
    t.step(x, y)
    t.step(x, y)
    return [t.spans, t._sender.issued()]


def test_untimed_steps_record_no_isend_calls(ranks):
    for spans, stamps in ranks(2).run(_untimed, timeout=60):
        assert spans == [] and stamps == []
