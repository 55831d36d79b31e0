"""Graph mode's precomputed borrowed-input checks on real CUDA graphs (tests/test_borrowed.py
runs the same on CPU with stand-in graphs): a moved parameter, a tensor on a borrowed one's
storage passed as a staged argument, a new tensor object at the captured address."""
from __future__ import annotations

import warnings

import pytest
import torch

import flowexec
from helpers import assert_close_rel

from test_borrowed import _step

torch.backends.cuda.matmul.allow_tf32 = False


def _both(exe, ps, ref, x, xref=None):
    assert_close_rel(exe(ps, x), _step(ref, x if xref is None else xref), what="loss")
    assert_close_rel(ps, ref, what="params")


def test_borrowed_checks_on_cuda_graphs():
    torch.manual_seed(0)
    ps = [torch.randn(4, device="cuda") for _ in range(3)]
    ref = [p.clone() for p in ps]
    exe = flowexec.compile(_step, ps, torch.randn(4, device="cuda"), mode="graph")  # borrows ps themselves
    with warnings.catch_warnings():
        warnings.simplefilter("error", flowexec.RecaptureWarning)
        for _ in range(3):
            _both(exe, ps, ref, torch.randn(4, device="cuda"))
        q = torch.empty(0, device="cuda").set_(ps[1].untyped_storage(), 0, (4,), (1,))
        _both(exe, [ps[0], q, ps[2]], ref, x := torch.randn(4, device="cuda"))  # same address: same graph
    assert exe._last.runner.graph_count == 1
    ps[1].data = ps[1].data.clone()  # moved: a second graph borrows it there
    _both(exe, ps, ref, torch.randn(4, device="cuda"))
    assert exe._last.runner.graph_count == 2
    with pytest.warns(flowexec.RecaptureWarning, match="storage"):  # x is ps[0]: staged apart would be wrong
        _both(exe, ps, ref, ps[0], ref[0])
