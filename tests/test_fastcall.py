"""The C++ call check (flowexec/runtime/fastcall.py) against the Python path it shortcuts.

Soundness: whatever the C++ check lets through, the Python checks (structure key, Dynamo's
TensorGuards, borrowed addresses, staged storages) let through too, over random calls made by
perturbing a signature. Usefulness: an unchanged call passes it, and an executable's hot loop
runs on it with the same results as eager.
"""
from __future__ import annotations

import random

import pytest
import torch

import flowexec
from flowexec.runtime import fastcall
from flowexec.runtime.borrowed import BorrowedAddresses
from flowexec.signature import flatten, tree_of


@pytest.fixture(scope="module")
def mod():
    m = fastcall.load()
    if m is None:  # CI's set-up builds it; a fresh checkout builds it here (about 30 s)
        m = fastcall.build()
    assert fastcall.status() == "native"
    return m


def _python_accepts(ref_args, args, borrowed: BorrowedAddresses, guard) -> bool:
    """The Python path's verdict for ``args`` against the signature of ``ref_args``."""
    ref_leaves, ref_key = flatten(ref_args, {})
    try:
        leaves, key = flatten(args, {})
    except flowexec.FlowexecError:
        return False
    if key != ref_key:
        return False
    tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
    if len(tensors) != len([a for a in ref_leaves if isinstance(a, torch.Tensor)]) or not guard.check(*tensors):
        return False
    return borrowed.matches(tensors) and borrowed.unshared(tensors, frozenset()) is True


def _perturb(rng: random.Random, ps: list, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None):
    ps = list(ps)
    k = rng.randrange(len(ps))
    what = rng.choice(["same", "clone", "dtype", "shape", "transpose", "grad", "param", "share", "share_borrowed",
                       "short", "tuple", "none", "scalar", "x_clone", "y_view_x"])
    if what == "clone":
        ps[k] = ps[k].clone()  # another address for a borrowed input
    elif what == "dtype":
        ps[k] = ps[k].double()
    elif what == "shape":
        ps[k] = torch.zeros(ps[k].shape[0] + 1, *ps[k].shape[1:])
    elif what == "transpose" and ps[k].dim() == 2:
        ps[k] = ps[k].t()
    elif what == "grad":
        ps[k] = ps[k].detach().requires_grad_(not ps[k].requires_grad)
    elif what == "param":
        ps[k] = torch.nn.Parameter(ps[k].detach().clone())
    elif what == "share":
        x = y.view(-1)[: x.numel()].view(x.shape) if y.numel() >= x.numel() and y.dtype == x.dtype else x
    elif what == "share_borrowed":
        p = ps[k]
        if p.numel() >= x.numel() and p.dtype == x.dtype:
            x = p.detach().reshape(-1)[: x.numel()].view(x.shape)
    elif what == "short":
        ps = ps[:-1]
    elif what == "tuple":
        return (tuple(ps), x, y, mask)
    elif what == "none":
        mask = None if mask is not None else torch.ones(2)
    elif what == "scalar":
        return (ps, x, 1.0, mask)
    elif what == "x_clone":
        x = x.clone()  # staged: another address is fine
    elif what == "y_view_x":
        y = x.view(-1)[: y.numel()].view(y.shape) if x.numel() >= y.numel() else y
    return (ps, x, y, mask)


def test_native_check_is_never_looser_than_the_python_path(mod):
    from torch._C._dynamo.guards import TensorGuards

    rng = random.Random(0)
    accepted = rejected = 0
    for trial in range(40):
        shapes = [(rng.randint(1, 4), rng.randint(1, 4)) if rng.random() < 0.7 else (rng.randint(1, 5),)
                  for _ in range(rng.randint(1, 6))]
        ps = [torch.nn.Parameter(torch.randn(*s)) if rng.random() < 0.5 else torch.randn(*s) for s in shapes]
        x, y = torch.randn(3, 2), torch.randn(4)
        mask = torch.ones(2) if rng.random() < 0.5 else None
        ref = (ps, x, y, mask)
        tree, leaves, _ = tree_of(ref, {})
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        borrow = [k < len(ps) for k in range(len(tensors))]
        borrowed = BorrowedAddresses(tensors, borrow)
        assert borrowed.unshared(tensors, frozenset()) is True
        guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])
        fc = fastcall.make(None, None, tree, leaves, tensors, borrowed)
        assert fc is not None
        got = fc.check(ref)
        assert got is not None and all(a is b for a, b in zip(got, tensors)) and len(got) == len(tensors)
        for _ in range(25):
            args = _perturb(rng, ps, x, y, mask)
            native = fc.check(args)
            python = _python_accepts(ref, args, borrowed, guard)
            if native is not None:
                assert python, f"trial {trial}: the C++ check let through a call the Python path refuses"
                flat = [a for a in flatten(args, {})[0] if isinstance(a, torch.Tensor)]
                assert len(native) == len(flat) and all(a is b for a, b in zip(native, flat))
                accepted += 1
            else:
                rejected += 1
    assert accepted > 100 and rejected > 100  # both branches were exercised


def test_layouts_it_does_not_take_keep_the_python_path():
    assert fastcall.layout_of(tree_of(({"w": torch.ones(1)},), {})[0], [torch.ones(1)]) is None
    assert fastcall.layout_of(tree_of((torch.ones(1),), {"s": torch.ones(1)})[0], [torch.ones(1)] * 2) is None
    assert fastcall.layout_of(tree_of((torch.ones(1), 2.0), {})[0], [torch.ones(1), 2.0]) is None
    assert fastcall.layout_of(tree_of(([torch.ones(1)], None), {})[0], [torch.ones(1), None]) == [2, 2, 1, 1, -1, -2]


def test_an_executable_runs_its_hot_loop_on_the_native_check(mod):
    torch.manual_seed(0)
    ws = [torch.randn(8, 8) for _ in range(3)]

    def step(params, x):
        h = x
        for w in params:
            h = torch.tanh(h @ w)
        with torch.no_grad():
            for w in params:
                w.mul_(0.5)
        return h.sum()

    ref_ws = [w.clone() for w in ws]
    x = torch.randn(4, 8)
    exe = flowexec.compile(step, ws, x)
    for _ in range(3):
        got, want = exe(ws, x), step(ref_ws, x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert exe._native is not None  # the third call took the C++ check
    for a, b in zip(ws, ref_ws):
        torch.testing.assert_close(a, b)
    # Another structure fails the check and re-captures through the Python path, as before.
    with pytest.warns(flowexec.RecaptureWarning):
        torch.testing.assert_close(exe(ws[:2], x), step(ref_ws[:2], x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(exe(ws, x), step(ref_ws, x), rtol=1e-6, atol=1e-6)


def test_status_names_why_it_is_off(monkeypatch):
    monkeypatch.setattr(fastcall, "_STATE", {})
    monkeypatch.setenv("FLOWEXEC_NATIVE", "0")
    assert fastcall.load() is None and "FLOWEXEC_NATIVE=0" in fastcall.status()


def test_a_profiler_that_swaps_the_runner_is_not_bypassed(mod):
    w = torch.randn(16, 16)
    exe = flowexec.compile(lambda x: torch.tanh(x @ w).sum(), torch.randn(8, 16))
    x = torch.randn(8, 16)
    for _ in range(3):
        exe(x)
    assert exe._native is not None
    tl = flowexec.profile(exe, x, runs=3)
    # every instruction of every run was stamped by the profiler's runner, not skipped past it
    assert len(tl.records) == 3 * len(exe.plan.instructions)
    assert sum(r.dur_us for r in tl.records) > 0 and len({r.start_us for r in tl.records}) > 1
