"""Copy-on-overwrite of graph-mode outputs (the logic is device-independent)."""
from __future__ import annotations

import pytest
import torch

from flowexec.runtime.outputs import HandedOutputs


def test_unheld_outputs_are_reused_without_copies():
    bufs = [torch.zeros(4), torch.zeros(2)]
    h = HandedOutputs(bufs)
    first = [a.data_ptr() for a in h.aliases]
    for step in range(5):
        outs = list(h.aliases)  # what a call hands out
        del outs  # the caller drops them
        h.release()
        for b in bufs:
            b.fill_(float(step))
    assert h.moved == 0
    assert [a.data_ptr() for a in h.aliases] == first


def test_held_output_keeps_its_value_and_later_calls_get_fresh_aliases():
    buf = torch.zeros(3)
    h = HandedOutputs([buf])
    kept = h.aliases[0]  # the caller keeps last call's output
    h.release()
    buf.fill_(7.0)  # the next replay overwrites the buffer
    assert torch.equal(kept, torch.zeros(3)) and h.moved == 1
    assert h.aliases[0] is not kept and h.aliases[0].data_ptr() == buf.data_ptr()
    assert torch.equal(h.aliases[0], torch.full((3,), 7.0))


def test_output_held_only_from_cpp_side_is_protected():
    buf = torch.ones(2)
    p = torch.nn.Parameter(torch.zeros(2))
    h = HandedOutputs([buf])
    p.grad = h.aliases[0]  # autograd's AccumulateGrad keeps the tensor like this
    h.release()
    buf.fill_(5.0)
    assert torch.equal(p.grad, torch.ones(2)) and h.moved == 1


def _fresh(buf: torch.Tensor, params: list[torch.nn.Parameter]) -> HandedOutputs:
    return HandedOutputs([buf], fresh=[0], candidates=lambda: params)


def _call(h: HandedOutputs) -> torch.Tensor:
    return h.hand_out()[0]


def _backward_into(p: torch.nn.Parameter, h: HandedOutputs) -> None:
    """A backward whose gradient for ``p`` is the graph's output, as AOTAutograd hands it to autograd."""
    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.sum()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            return _call(h)
    Node.apply(p).backward()


def test_fresh_output_is_adopted_by_accumulate_grad_without_a_copy():
    buf = torch.full((3,), 2.0)
    p = torch.nn.Parameter(torch.zeros(3))
    h = _fresh(buf, [p])
    _backward_into(p, h)  # AccumulateGrad adopts a gradient nobody else references
    assert p.grad.data_ptr() == buf.data_ptr()
    h.release()  # p.grad still holds the buffer: it gets a private copy first
    buf.fill_(9.0)
    assert torch.equal(p.grad, torch.full((3,), 2.0)) and p.grad.data_ptr() != buf.data_ptr() and h.moved == 1


def test_fresh_output_dropped_by_zero_grad_costs_nothing():
    buf = torch.ones(2)
    p = torch.nn.Parameter(torch.zeros(2))
    h = _fresh(buf, [p])
    for _ in range(3):
        _backward_into(p, h)
        assert p.grad.data_ptr() == buf.data_ptr()
        p.grad = None  # zero_grad(set_to_none=True)
        h.release()
    assert h.moved == 0


def test_fresh_output_held_directly_is_moved():
    buf = torch.ones(2)
    h = _fresh(buf, [])
    kept = _call(h)  # e.g. returned by torch.autograd.grad and kept
    h.release()
    buf.fill_(4.0)
    assert torch.equal(kept, torch.ones(2)) and h.moved == 1


def test_fresh_output_held_by_a_stranger_warns():
    buf = torch.ones(2)
    h = _fresh(buf, [])
    stranger = _call(h).detach()  # a second tensor on the same memory, not findable
    with pytest.warns(RuntimeWarning, match="clone gradients you keep"):
        h.release()
    assert stranger.data_ptr() == buf.data_ptr()


def test_saved_outputs_are_watched_apart_from_the_others():
    """watch_saved(first): saved_held() says whether an output from position ``first`` on (what
    autograd saves for backward) is held; release(saved_checked=True) then moves only the others
    that are held, and release() all of them."""
    bufs = [torch.zeros(2), torch.zeros(2), torch.zeros(2)]
    h = HandedOutputs(bufs)
    h.watch_saved(1)
    assert not h.saved_held()
    user = h.aliases[0]  # the caller keeps the user output: not a saved tensor
    assert not h.saved_held()
    saved = h.aliases[2]  # autograd holds a saved tensor (a C++ reference does as well)
    assert h.saved_held()
    del saved
    assert not h.saved_held()
    saved = h.aliases[1]  # held after the check: release(saved_checked=True) trusts the check
    h.release(saved_checked=True)
    assert h.moved == 1 and user.data_ptr() != bufs[0].data_ptr()  # the user output, only
    assert saved.data_ptr() == bufs[1].data_ptr()
    h.release()
    assert h.moved == 2 and saved.data_ptr() != bufs[1].data_ptr()
