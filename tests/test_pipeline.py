"""Pipeline schedules as readable tables, their simulation against the bubble formulas, plan
checks, and the eager stage runner against autograd (one process, no group)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from flowexec.pipeline import (NAMES, SCHEDULES, Job, PipelineTrainer, check, eager_1f1b, format_schedule,
                               get_schedule, gpipe, interleaved_1f1b, make_runner, one_f_one_b, parse_schedule,
                               placement, simulate, split, split_batch, with_optimizer, zbh1, zbv)

pytestmark = pytest.mark.timeout(120)

GOLDEN = {
    ("fthenb", 2, 3, None): """
rank 0: 0F0 0F1 0F2 0B0 0B1 0B2
rank 1: 1F0 1F1 1F2 1B0 1B1 1B2""",
    ("1f1b", 3, 4, None): """
rank 0: 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
rank 1: 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3""",
    ("eager1f1b", 3, 6, None): """
rank 0: 0F0 0F1 0F2 0F3 0F4 0B0 0F5 0B1 0B2 0B3 0B4 0B5
rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5
rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4 2F5 2B5""",
    ("interleaved1f1b", 2, 4, 4): """
rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3""",
    ("zbh1", 3, 4, None): """
rank 0: 0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
rank 1: 1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
rank 2: 2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3""",
    ("zbv", 2, 4, None): """
rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3
rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3""",
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: f"{k[0]}-p{k[1]}-m{k[2]}")
def test_schedules_as_tables(key):
    name, p, m, n = key
    plan = get_schedule(name)(p, m, n)
    assert format_schedule(plan) == GOLDEN[key].strip()
    assert parse_schedule(format_schedule(plan)) == plan
    simulate(plan)  # every golden plan is valid


def test_job_text_round_trips():
    for text in ("0F1", "1I0", "1W0", "12B34", "3OPT"):
        assert str(Job.parse(text)) == text
    assert Job.parse("3OPT") == Job(3, "OPT", None)
    with pytest.raises(ValueError, match="'0X1' is not a job"):
        Job.parse("0X1")
    with pytest.raises(ValueError, match="is not a schedule line"):
        parse_schedule("0F0 0B0")


def test_names_are_case_insensitive_and_fthenb_is_gpipe():
    assert get_schedule("FThenB") is get_schedule("gpipe") is get_schedule("GPipe") is gpipe
    assert get_schedule("ZBH1") is zbh1 and get_schedule("zbv") is zbv and get_schedule("Interleaved1F1B") is interleaved_1f1b
    with pytest.raises(ValueError, match="unknown schedule 'dualpipe'.*FThenB"):
        get_schedule("dualpipe")


def test_placements():
    assert placement(interleaved_1f1b(3, 6, 9)) == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2, 6: 0, 7: 1, 8: 2}
    assert placement(zbv(3, 6)) == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}  # the V: rank r holds r and 2p-1-r


def _idle(sim):
    (v,) = set(round(x, 9) for x in sim.idle.values()) or {None}
    return v


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (3, 1), (4, 16)])
def test_1f1b_bubble_matches_theory(p, m):
    """Equal costs T: 1F1B and GPipe idle (p-1)(T_F+T_B+T_W) per rank: bubble (p-1)/(m+p-1)."""
    for make in (gpipe, one_f_one_b):
        sim = simulate(make(p, m))
        assert sim.makespan == 3 * (m + p - 1)
        assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))
    # unequal costs, and a latency per hop: the formula holds with the hop added to each job's wait
    sim = simulate(one_f_one_b(p, m), costs=(1.0, 1.5, 0.5))
    assert max(sim.idle.values()) == pytest.approx((p - 1) * 3.0)


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (3, 6), (4, 5), (3, 2), (1, 3)])
def test_eager_1f1b_pays_the_latency_only_to_fill_and_drain(p, m):
    """Eager1F1B: 1F1B's bubble with no latency; rank r holds 2(p-r)-1 micro-batches' activations
    (1F1B: p-r), all of them where m is smaller. With a latency L a message below half a
    micro-batch's work and m >= 2p-1, only the fill and the drain wait for messages (2(p-1) L),
    where 1F1B waits on every micro-batch."""
    assert simulate(eager_1f1b(p, m)).bubble == pytest.approx((p - 1) / (m + p - 1))
    assert simulate(eager_1f1b(p, m)).peak_activations == {r: min(2 * (p - r) - 1, m) for r in range(p)}
    assert simulate(one_f_one_b(p, m)).peak_activations == {r: min(p - r, m) for r in range(p)}
    if m >= 2 * p - 1 and p > 1:
        for lat in (0.1, 0.5, 1.5):
            eager, plain = simulate(eager_1f1b(p, m), latency=lat), simulate(one_f_one_b(p, m), latency=lat)
            assert eager.makespan == pytest.approx(3 * (m + p - 1) + 2 * (p - 1) * lat)
            assert plain.makespan - eager.makespan >= (m - 2) * lat - 1e-9
    for r in range(p):  # a clamped rank runs every forward first
        assert [j.kind for j in eager_1f1b(p, m)[r]][:min(2 * (p - r) - 1, m)] == ["F"] * min(2 * (p - r) - 1, m)


def test_every_schedule_has_one_name():
    assert {get_schedule(n) for n in NAMES} == set(SCHEDULES.values())
    assert get_schedule("Eager1F1B") is eager_1f1b and get_schedule("eager-1f1b") is eager_1f1b


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (3, 6)])
def test_zbh1_idles_a_third_of_1f1b(p, m):
    """ZB-H1 idles (p-1)(T_F+T_B-T_W): a third of 1F1B's (p-1)(T_F+T_B+T_W) when the three are equal."""
    assert _idle(simulate(zbh1(p, m))) == p - 1 == _idle(simulate(one_f_one_b(p, m))) / 3
    t_f, t_b, t_w = 1.0, 1.2, 0.8
    sim = simulate(zbh1(p, m), costs=(t_f, t_b, t_w))
    assert max(sim.idle.values()) == pytest.approx((p - 1) * (t_f + t_b - t_w))
    # 1F1B's activations on the first rank (p micro-batches, held until their W)
    assert simulate(zbh1(p, m)).peak_activations[0] == simulate(one_f_one_b(p, m)).peak_activations[0] == min(p, m)


@pytest.mark.parametrize("p, m, v", [(2, 8, 2), (4, 8, 2), (4, 16, 2), (2, 8, 4), (3, 6, 3)])
def test_interleaved_bubble_divides_by_v(p, m, v):
    """v stages per rank, each job 1/v of a rank's work: bubble (p-1)/v / (m + (p-1)/v)."""
    sim = simulate(interleaved_1f1b(p, m, p * v), costs=(1 / v, 1 / v, 1 / v))
    assert sim.bubble == pytest.approx(((p - 1) / v) / (m + (p - 1) / v))
    assert max(sim.idle.values()) == pytest.approx(simulate(one_f_one_b(p, m)).idle[0] / v)
    with pytest.raises(ValueError, match="9 micro-batches on 4 ranks do not split into 2 rounds; 8 or 10 do"):
        interleaved_1f1b(4, 9, 8)


@pytest.mark.parametrize("p, m", [(2, 7), (2, 9), (3, 7), (4, 9), (4, 13)])
def test_interleaved_names_micro_batch_counts_that_fit(p, m):
    with pytest.raises(ValueError) as err:
        interleaved_1f1b(p, m)
    lo, hi = (int(k) for k in re.search(r"; (\d+) or (\d+) do", str(err.value)).groups())
    assert lo < m < hi
    for k in (lo, hi):  # the advice can be followed
        check(interleaved_1f1b(p, k))


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (3, 6)])
def test_zbv_has_no_bubble_beyond_the_fill(p, m):
    """Equal costs: no rank idles after its first input arrives; the makespan is the lower bound
    (the last rank's first forward waits p-1 forwards) and each rank's idle is that fill."""
    sim = simulate(zbv(p, m))
    work = 2 * m * 3  # two stages, F + I + W per micro-batch
    assert sim.makespan == (p - 1) + work
    for r in range(p):
        jobs = zbv(p, m)[r]
        first = min(sim.start[j] for j in jobs)
        last = max(sim.end[j] for j in jobs)
        assert last - first == work  # busy from its first job to its last
    assert sim.bubble < simulate(zbh1(p, m), costs=(2, 2, 2)).bubble  # ZBH1 on the same work per rank


def test_simulate_latency_and_activations():
    # every hop adds the latency: 1F1B on 2 ranks, m = 1: F, hop, F+loss, B, hop, B
    sim = simulate(one_f_one_b(2, 1), costs=(1, 1, 1), latency=0.5)
    assert sim.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    assert simulate(gpipe(4, 8)).peak_activations == {0: 8, 1: 8, 2: 8, 3: 8}
    assert simulate(one_f_one_b(4, 8)).peak_activations == {0: 4, 1: 3, 2: 2, 3: 1}


def test_bad_plans_are_named():
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits at 0B0 for 0F0, 1B0; rank 1 waits at 1F0 for 0F0"):
        simulate(parse_schedule("rank 0: 0B0 0F0\nrank 1: 1F0 1B0"))
    with pytest.raises(ValueError, match="runs 0F0 twice"):
        simulate(parse_schedule("rank 0: 0F0 0F0 0B0"))
    with pytest.raises(ValueError, match=r"misses \['0B1'\]"):
        simulate(parse_schedule("rank 0: 0F0 0F1 0B0"))
    with pytest.raises(ValueError, match=r"misses \['0W0'\]"):
        simulate(parse_schedule("rank 0: 0F0 0I0"))
    with pytest.raises(ValueError, match="both a full backward and a split one"):
        simulate(parse_schedule("rank 0: 0F0 0B0 0I0 0W0"))
    with pytest.raises(ValueError, match="stage 0 is on ranks 0 and 1"):
        simulate(parse_schedule("rank 0: 0F0\nrank 1: 0B0"))
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits at 0W0 for 0I0"):
        simulate(parse_schedule("rank 0: 0F0 0W0 0I0"))
    with pytest.raises(ValueError, match="n_micro must be a whole number >= 1, got 0"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="no jobs"):
        simulate({})
    with pytest.raises(ValueError, match="bad job 0F-1"):
        simulate({0: [Job(0, "F", -1), Job(0, "B", -1)]})
    with pytest.raises(ValueError, match="ZBV runs 2 stages per rank: it needs 4 stages on 2 ranks, got 2"):
        zbv(2, 4, 2)
    with pytest.raises(ValueError, match="1F1B runs 1 stage per rank"):
        one_f_one_b(2, 4, 4)
    # a user's own plan, written as text, runs through the same checks; OPT waits for the backwards
    own = parse_schedule("rank 0: 0F0 0F1 0B1 0B0 0OPT\nrank 1: 1F0 1F1 1B1 1B0 1OPT")
    assert check(own)[Job(0, "OPT")] == (Job(0, "B", 0), Job(0, "B", 1))
    simulate(own)
    with pytest.raises(ValueError, match="deadlocks: rank 0 waits at 0OPT for 0B1"):
        simulate(parse_schedule("rank 0: 0F0 0F1 0B0 0OPT 0B1"))


def test_with_optimizer_puts_opt_after_each_stages_last_backward():
    assert format_schedule(with_optimizer(zbv(1, 1))) == "rank 0: 0F0 1F0 1I0 1W0 1OPT 0I0 0W0 0OPT"


def _stage():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.LayerNorm(6), torch.nn.Linear(6, 6))


class _Tied(torch.nn.Module):
    """A weight used twice in one stage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("make", [_stage, _Tied], ids=["block", "shared weight"])
def test_eager_runner_i_plus_w_is_the_full_backward(make):
    torch.manual_seed(1)
    x, gy = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    grads = {}
    for how in ("B", "IW", "autograd"):
        torch.manual_seed(2)
        mod = make().double()
        xx = x.clone().requires_grad_(True)
        if how == "autograd":
            mod(xx).backward(gy)
            grads[how] = (xx.grad, [p.grad for p in mod.parameters()])
            continue
        r = make_runner(mod, example_inputs=(x.clone().requires_grad_(True),), compile=False)
        (out,) = r.forward(0, (x,))
        assert not out.requires_grad
        if how == "B":
            (gx,) = r.backward(0, (gy,))
        else:
            (gx,) = r.backward_input(0, (gy,))
            assert all(p.grad is None for p in mod.parameters())  # I leaves the weights alone
            r.backward_weight(0)
        grads[how] = (gx, [p.grad for p in mod.parameters()])
    for how in ("B", "IW"):
        torch.testing.assert_close(grads[how][0], grads["autograd"][0], rtol=1e-12, atol=1e-12)
        for a, b in zip(grads[how][1], grads["autograd"][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_eager_runner_last_stage_and_errors():
    lin = torch.nn.Linear(3, 2)
    r = make_runner(lin, example_inputs=(torch.zeros(2, 3),), loss_fn=F.mse_loss, loss_scale=0.5, compile=False)
    x, y = torch.randn(2, 3), torch.randn(2, 2)
    (loss,) = r.forward(0, (x,), target=y)
    assert loss.item() == pytest.approx(F.mse_loss(lin(x), y).item())
    assert r.backward(0, None) == (None,)  # stage 0: its inputs need no gradient
    want = torch.autograd.grad(0.5 * F.mse_loss(lin(x), y), lin.weight)[0]
    torch.testing.assert_close(lin.weight.grad, want)
    with pytest.raises(RuntimeError, match="backward of micro-batch 3 before its forward"):
        r.backward(3, None)
    with pytest.raises(RuntimeError, match="W of micro-batch 0 before its I"):
        r.backward_weight(0)


def test_split_and_split_batch():
    seq = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(5)])
    parts = split(seq, 3)
    assert [len(p) for p in parts] == [2, 2, 1] and parts[0][0] is seq[0]
    with pytest.raises(ValueError, match="cannot cut 5 layers into 6 stages"):
        split(seq, 6)
    with pytest.raises(TypeError, match="nn.Sequential"):
        split(torch.nn.Linear(2, 2), 2)
    parts = split(seq, 3, balance=[1, 3, 1])
    assert [len(p) for p in parts] == [1, 3, 1] and parts[1][0] is seq[1] and parts[2][0] is seq[4]
    for bad in ([2, 2], [2, 2, 2], [0, 4, 1], [1.5, 2.5, 1]):
        with pytest.raises(ValueError, match=r"balance=.* each of the 3 stages at least one layer and add up to"):
            split(seq, 3, balance=bad)
    with pytest.raises(ValueError, match="a batch of 5 does not split into 2"):
        split_batch(torch.ones(5, 2), 2)
    a, b = split_batch((torch.zeros(4, 1), torch.ones(4, 3)), 2)
    assert a[0].shape == (2, 1) and b[1].shape == (2, 3)


def test_trainer_without_a_process_group_says_how_to_start_one():
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node N"):
        PipelineTrainer([torch.nn.Linear(2, 2)], loss_fn=F.mse_loss, compile=False)
