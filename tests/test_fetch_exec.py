"""Executables returning scalar outputs as Fetch handles (asynchronous fetches)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.models import make_mlp, make_step


def test_fetch_handles_return_each_steps_loss():
    torch.manual_seed(0)
    model = make_mlp(16, 2)
    twin = make_mlp(16, 2)
    twin.load_state_dict(model.state_dict())
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    eager = make_step(twin, torch.optim.SGD(twin.parameters(), lr=0.1), F.cross_entropy)
    data = [(torch.randn(4, 16), torch.randint(0, 10, (4,))) for _ in range(12)]
    exe = flowexec.compile(step, *data[0], fetch=[0], fetch_slots=4)  # ring wraps around 3 times
    handles = [exe(x, y) for x, y in data]
    assert all(isinstance(h, flowexec.Fetch) for h in handles)
    want = [eager(x, y).item() for x, y in data]
    assert [h.result() for h in handles] == pytest.approx(want, rel=1e-6)


def test_fetch_true_picks_one_element_outputs_and_bad_index():
    f = lambda x: (x.sum(), x * 2)  # noqa: E731
    exe = flowexec.compile(f, torch.ones(3), fetch=True)
    s, y = exe(torch.ones(3))
    assert isinstance(s, flowexec.Fetch) and s.result() == 3.0 and torch.equal(y, torch.full((3,), 2.0))
    with pytest.raises(flowexec.OptionError, match="output 1 is not a one-element"):
        flowexec.compile(f, torch.ones(3), fetch=[1])
