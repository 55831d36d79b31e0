"""An optimizer's state made by its own initialisation before the first capture
(``first_step="prefill"``, flowexec.optim_state): eager's state to the bit, the steps' program
captured on the first call, no state for a parameter without a gradient, and every other
optimizer left to the first step's program."""
from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec import optim_state
from flowexec.models import make_mlp, make_step
from helpers import assert_close_rel


def _train_both(exe, eager, steps: int) -> None:
    """``steps`` calls of each on the same batches, the losses compared."""
    for _ in range(steps):
        x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
        torch.testing.assert_close(exe(x, y), eager(x, y), rtol=1e-5, atol=1e-6)


PREFILLED = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam_for_loop_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False, amsgrad=True),
    "adam_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-2, maximize=True, weight_decay=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam_foreach": lambda ps: torch.optim.RAdam(ps, lr=1e-2, foreach=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),  # (test_first_step's)
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=2),
}


def _twins(make_opt, with_unused: bool = False):
    torch.manual_seed(0)
    m1 = make_mlp(16, 2)
    if with_unused:  # a parameter the loss never reaches: eager's first step makes it no state
        m1.register_parameter("unused", torch.nn.Parameter(torch.randn(3)))
    m2 = copy.deepcopy(m1)
    return m1, make_opt(m1.parameters()), m2, make_opt(m2.parameters())


def _same_state(o1: torch.optim.Optimizer, o2: torch.optim.Optimizer) -> None:
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert list(s1["state"]) == list(s2["state"])
    for k in s1["state"]:
        assert list(s1["state"][k]) == list(s2["state"][k]), k
        for key, a in s1["state"][k].items():
            b = s2["state"][k][key]
            assert (a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape), (k, key)
            assert_close_rel(b, a, 1e-5, f"state {k} {key}")  # (as test_first_step's: centred RMSprop's
            # momentum divides by the square root of a variance near zero, so single elements differ by rounding)
    assert s1["param_groups"] == s2["param_groups"]


@pytest.mark.parametrize("name", list(PREFILLED))
def test_prefilled_state_then_eager_steps_are_eager_s_to_the_bit(name) -> None:
    """Without flowexec: the state prefill makes is what eager's first step makes, so eager's
    steps after it give eager's parameters and state exactly."""
    m1, o1, m2, o2 = _twins(PREFILLED[name])
    made = optim_state.prefill(o2)
    assert len(made) == len(list(m2.parameters())) and all(p.grad is None for p in m2.parameters())
    s1, s2 = make_step(m1, o1, F.cross_entropy, set_to_none=True), make_step(m2, o2, F.cross_entropy, set_to_none=True)
    for _ in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
        assert torch.equal(s1(x, y), s2(x, y))
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)
    for (p, a), (q, b) in zip(o1.state.items(), o2.state.items()):
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", list(PREFILLED))
@pytest.mark.parametrize("mode", ["trace", "threaded"])
def test_prefill_captures_the_steps_on_the_first_call_and_trains_as_eager(name, mode) -> None:
    m1, o1, m2, o2 = _twins(PREFILLED[name], with_unused=True)
    eager = make_step(m1, o1, F.cross_entropy, set_to_none=True)
    exe = flowexec.compile(make_step(m2, o2, F.cross_entropy, set_to_none=True), mode=mode, first_step="prefill")
    with warnings.catch_warnings():
        warnings.simplefilter("error", flowexec.RecaptureWarning)  # (one program: the steps')
        for k in range(4):
            x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
            torch.testing.assert_close(exe(x, y), eager(x, y), rtol=1e-5, atol=1e-6)
            if k == 0:  # the steps' program, captured at once: no first step's program
                assert exe.first_step_prefilled and exe.first_step_program is None
                assert exe.build_seconds is not None
                assert m2.unused not in o2.state and m2.unused.grad is None  # as eager leaves it
    assert sum(len(v) for v in exe._cache.values()) == 1
    _same_state(o1, o2)
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)


def test_the_placeholder_gradients_are_freed_before_the_build_plans(monkeypatch) -> None:
    """The placeholders a prefilled capture is lent (one gradient's memory per parameter) are
    gone by the time the build plans: graph mode's warm-up runs after planning, and held through
    it they lifted the first call's peak by the parameters' size (GPT-2 124M: 0.46 GiB)."""
    from flowexec import executable

    lent, alive_at_planning = [], []
    lend = optim_state.lend_grads

    def recording_lend(params, like=False):
        got = lend(params, like)
        lent.extend(weakref.ref(g) for _, g in got if like)
        return got

    def checking_plan_for(*a, **k):
        alive_at_planning.append(sum(r() is not None for r in lent))
        return plan_for(*a, **k)

    plan_for = executable.plan_for
    monkeypatch.setattr(optim_state, "lend_grads", recording_lend)
    monkeypatch.setattr(executable, "plan_for", checking_plan_for)
    m1, o1, m2, o2 = _twins(PREFILLED["adamw_foreach"])
    exe = flowexec.compile(make_step(m2, o2, F.cross_entropy, set_to_none=True), first_step="prefill")
    _train_both(exe, make_step(m1, o1, F.cross_entropy, set_to_none=True), 2)
    assert exe.first_step_prefilled and len(lent) == len(list(m2.parameters()))
    assert alive_at_planning == [0]


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # its first buffer is the gradient itself
    lambda ps: type("MyAdam", (torch.optim.Adam,), {})(ps, lr=1e-2),  # a subclass may initialise otherwise
], ids=["sgd_momentum", "adam_subclass"])
def test_other_optimizers_take_the_first_step_s_program(make_opt) -> None:
    m1, o1, m2, o2 = _twins(make_opt)
    assert not optim_state.can_prefill(o2)
    with pytest.raises(ValueError, match="cannot prefill"):
        optim_state.prefill(o2)
    eager = make_step(m1, o1, F.cross_entropy, set_to_none=True)
    exe = flowexec.compile(make_step(m2, o2, F.cross_entropy, set_to_none=True), first_step="prefill")
    _train_both(exe, eager, 3)
    assert not exe.first_step_prefilled and exe.first_step_program is not None
    _same_state(o1, o2)


def test_a_prefill_that_fails_leaves_nothing_behind_and_the_first_step_s_program_runs(monkeypatch) -> None:
    """An initialisation that raises part-way (a fused Adam's device check, say): no state and
    no placeholder gradient is left, and the first call runs the first step's program."""
    m1, o1, m2, o2 = _twins(PREFILLED["adamw_foreach"])
    init, prefill = torch.optim.AdamW._init_group, optim_state.prefill

    def failing_init(self, group, *lists):
        init(self, group, *lists)  # (the state made, then the refusal)
        raise RuntimeError("refused by its own check")
    with monkeypatch.context() as patch:
        patch.setattr(torch.optim.AdamW, "_init_group", failing_init)
        with pytest.raises(RuntimeError, match="refused"):
            optim_state.prefill(o2)
    assert not o2.state and all(p.grad is None for p in m2.parameters())

    def failing_prefill(opt):  # (through the executable: state made, then an error)
        prefill(opt)
        raise RuntimeError("refused after the state was made")
    monkeypatch.setattr(optim_state, "prefill", failing_prefill)
    _check_fallback(m1, o1, m2, o2, "prefill: RuntimeError: refused after")


def test_a_step_that_zeroes_gradients_in_place_takes_the_first_step_s_program() -> None:
    """``zero_grad(set_to_none=False)`` reads ``.grad``: a placeholder would be read as one, so
    the first call runs the first step's program (and says why)."""
    _check_fallback(*_twins(PREFILLED["adamw_foreach"]), "reads .grad", set_to_none=False)


def _check_fallback(m1, o1, m2, o2, reason: str, set_to_none: bool = True) -> None:
    """With first_step="prefill", the first step's program ran (for ``reason``), as eager."""
    eager = make_step(m1, o1, F.cross_entropy, set_to_none=set_to_none)
    exe = flowexec.compile(make_step(m2, o2, F.cross_entropy, set_to_none=set_to_none), first_step="prefill")
    _train_both(exe, eager, 3)
    assert not exe.first_step_prefilled and exe.first_step_program is not None
    assert reason in exe.first_step_fallback, exe.first_step_fallback
    _same_state(o1, o2)


def test_the_warm_up_snapshot_is_pinned_ahead_only_where_the_device_has_no_room_for_it(monkeypatch) -> None:
    """A prefilled graph build pins its warm-up snapshot's blocks ahead (on a thread) for every
    CUDA parameter and state tensor, in bytes, where half the device's room below its peak
    cannot hold them (snapshot.DeviceRoom's share), and pins nothing where it can. Fake CUDA
    tensors stand in for the device's (the decision is the host's)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flowexec import executable

    with FakeTensorMode():
        params = [torch.nn.Parameter(torch.empty(4, 3, device="cuda")), torch.nn.Parameter(torch.empty(5, device="cuda"))]
        opt = torch.optim.AdamW(params)
        for p in params:
            opt.state[p] = {"exp_avg": torch.empty_like(p), "exp_avg_sq": torch.empty_like(p),
                            "step": torch.zeros((), device="cuda")}
    made = [(p, opt) for p in params]
    want = [48, 48, 48, 4, 20, 20, 20, 4]  # (each parameter, then its state, as bytes)
    asked: list[list[int]] = []
    monkeypatch.setattr(executable, "prepin", lambda sizes: asked.append(list(sizes)) or "thread")
    allocated = 1000
    for peak, pins in ((1000 + 2 * sum(want), False), (1000 + 2 * sum(want) - 2, True)):
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None, peak=peak: peak)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
        asked.clear()
        got = executable._prepin_for_warm_up(made)
        assert (got == "thread") == pins and asked == ([want] if pins else [])
    assert executable._prepin_for_warm_up([(torch.nn.Parameter(torch.ones(3)), opt)]) is None  # (no CUDA tensor)
