"""An optimizer's first step as a program of its own (``first_step="planned"``, the default):
the call that makes the optimizer's state runs a planned program whose outputs include the new
state entries, bound into the optimizer after the run; the second call captures the steps."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

import flowexec
from flowexec.models import make_mlp, make_step
from helpers import assert_close_rel

OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adam_for_loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),  # its step count read on the host
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),  # first step: the buffer is the gradient
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
}


def _twins(make_opt):
    torch.manual_seed(0)
    m1 = make_mlp(16, 2)
    m2 = copy.deepcopy(m1)
    o1, o2 = make_opt(m1.parameters()), make_opt(m2.parameters())
    return m1, o1, m2, o2


def _assert_same_optimizer_state(o1: torch.optim.Optimizer, o2: torch.optim.Optimizer, tol: float = 1e-5) -> None:
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert list(s1) == list(s2)
    for k in s1:
        assert list(s1[k]) == list(s2[k]), k  # the entries, in eager's order
        for key in s1[k]:
            a, b = s1[k][key], s2[k][key]
            assert not is_fake(b)
            assert_close_rel(b, a, tol, f"state {k} {key}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["trace", "threaded"])
def test_the_first_step_runs_as_a_program_that_makes_the_optimizer_s_state(name, mode) -> None:
    m1, o1, m2, o2 = _twins(OPTIMIZERS[name])
    eager, exe = make_step(m1, o1, F.cross_entropy), flowexec.compile(make_step(m2, o2, F.cross_entropy), mode=mode)
    data = [(torch.randn(8, 16), torch.randint(0, 10, (8,))) for _ in range(4)]
    for k, (x, y) in enumerate(data):
        torch.testing.assert_close(exe(x, y), eager(x, y), rtol=1e-5, atol=1e-6)
        if k == 0:
            assert exe.first_step_program is not None, exe.first_step_fallback
            assert not exe._cache  # the first step's program is not kept for later calls
            names = str(exe.first_step_program.program)
            assert "zeros_like" in names or "clone" in names or "copy" in names, names[:2000]
    _assert_same_optimizer_state(o1, o2)
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)


def test_a_fused_first_step_with_a_planned_arena_trains_as_eager() -> None:
    """The first step's program is planned with the executable's options: fused regions and the
    planned arena as the steps' program."""
    m1, o1, m2, o2 = _twins(OPTIMIZERS["adamw_foreach"])
    eager = make_step(m1, o1, F.cross_entropy)
    exe = flowexec.compile(make_step(m2, o2, F.cross_entropy), fuse="inductor", memory="planned")
    data = [(torch.randn(8, 16), torch.randint(0, 10, (8,))) for _ in range(3)]
    for x, y in data:
        torch.testing.assert_close(exe(x, y), eager(x, y), rtol=1e-5, atol=1e-6)
    assert exe.first_step_program.stats()["fused_regions"] >= 1
    _assert_same_optimizer_state(o1, o2, 1e-4)  # (fused kernels sum in another order: gradients' rounding)


class _LazyAverage:
    """A plain object that makes its tensor on its first update (as a GradScaler makes its scale),
    and counts in a dict how often it made it. (Not every update: a count that each call changes
    is refused at capture, its object holding a tensor or not: tests/test_guards.py.)"""

    def __init__(self) -> None:
        self.avg = None
        self.counts = {"made": 0}

    def update(self, v: torch.Tensor) -> None:
        if self.avg is None:
            self.avg = torch.zeros_like(v)
            self.counts["made"] += 1
        self.avg.mul_(0.9).add_(v, alpha=0.1)


def test_state_a_program_cannot_make_falls_back_to_an_eager_first_step_and_leaves_nothing_behind() -> None:
    """A first step that also makes state outside the optimizer (a plain object's tensor): its
    program is refused (``first_step_fallback`` says why), the objects the capture run changed
    are put back, fn runs eagerly (no fake tensor left, the count as eager's), and the next call
    captures."""
    m1, o1, m2, o2 = _twins(OPTIMIZERS["adamw_foreach"])
    avg1, avg2 = _LazyAverage(), _LazyAverage()

    def step_of(m, o, avg):
        def step(x, y):
            o.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            avg.update(loss.detach())
            return loss.detach()
        return step

    eager, exe = step_of(m1, o1, avg1), flowexec.compile(step_of(m2, o2, avg2))
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    torch.testing.assert_close(exe(x, y), eager(x, y))
    assert exe.first_step_program is None and "made" in exe.first_step_fallback, exe.first_step_fallback
    assert not is_fake(avg2.avg) and avg2.counts == {"made": 1}
    for _ in range(2):
        torch.testing.assert_close(exe(x, y), eager(x, y), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(avg2.avg, avg1.avg)
    assert avg2.counts == avg1.counts == {"made": 1}
    _assert_same_optimizer_state(o1, o2)


def test_first_step_eager_runs_fn_and_bad_values_name_the_choices() -> None:
    m1, o1, m2, o2 = _twins(OPTIMIZERS["adamw_foreach"])
    exe = flowexec.compile(make_step(m2, o2, F.cross_entropy), first_step="eager")
    x, y = torch.randn(8, 16), torch.randint(0, 10, (8,))
    torch.testing.assert_close(exe(x, y), make_step(m1, o1, F.cross_entropy)(x, y))
    assert exe.first_step_program is None and exe.first_step_fallback is None
    with pytest.raises(flowexec.OptionError, match="first_step='later'.*'planned'.*'prefill'.*'eager'"):
        flowexec.compile(make_step(m2, o2, F.cross_entropy), first_step="later")
