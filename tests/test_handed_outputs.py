"""Copy-on-overwrite of graph-mode outputs (the logic is device-independent)."""
from __future__ import annotations

import torch

from flowexec.runtime.cuda_graph import HandedOutputs


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
