"""The native front door of flowexec.kernels.lerp on CUDA: C++ forward, C++ autograd node and
driver launches of the Triton kernels, against float64 and against the Python launch path.

Skipped without CUDA. The first call of a shape runs in Python and plans the forward natively,
the second plans the backward, from the third on a call is native both ways.
"""
from __future__ import annotations

import importlib
import itertools

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from test_lerp_gpu import SHAPES, assert_matches, inputs  # noqa: E402  (tests/gpu is on sys.path: rootdir import)

if torch.cuda.is_available():
    from flowexec.kernels import lerp

    L = importlib.import_module("flowexec.kernels.lerp")
    _native = importlib.import_module("flowexec.kernels._native")


def native_plan(x, y, w):
    plan = L._plan(x, y, w if isinstance(w, torch.Tensor) else None)
    assert plan.native is not None, "the native path was not installed"
    return plan


def run(x, y, w, g=None):
    out = lerp(x, y, w)
    g = torch.randn_like(out) if g is None else g
    ins = [t for t in (x, y, w) if isinstance(t, torch.Tensor) and t.requires_grad]
    return out, torch.autograd.grad(out, ins, g), g


def test_extension_builds_with_cuda():
    mod = _native.load(cuda=True)
    assert mod is not None and mod.with_cuda


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "x".join(map(str, s[1])))
def test_native_matches_float64(shapes, dtype):
    for _ in range(4):
        x, y, w = inputs(*shapes, dtype)
        out, grads, g = run(x, y, w)
        assert_matches(x, y, w, out, grads, g)
    assert out.grad_fn.name() == "FlowexecLerpBackward"
    assert native_plan(x, y, w).has_native_backward(3 if shapes[2] is None else 7)


@pytest.mark.parametrize("deterministic", [True, False], ids=["partial-sums", "atomic-sums"])
def test_native_and_python_paths_give_the_same_bits(deterministic):
    """Partial sums: every path gives the same bits. Atomic sums (the default for this pattern)
    add in whatever order programs finish: the same values up to rounding."""
    L.clear_plans()  # other tests may have planned these shapes: start from the Python path
    x, y, w = inputs((16, 1, 1, 1), (16, 3, 64, 64), (3, 1, 64), torch.float32)
    g = torch.randn(16, 3, 64, 64, device="cuda")
    torch.use_deterministic_algorithms(deterministic)
    try:
        results = [(o, *gr) for o, gr, _ in (run(x, y, w, g) for _ in range(4))]
    finally:
        torch.use_deterministic_algorithms(False)
    tol = 0 if deterministic else 1e-5
    assert L._plan(x, y, w).acc_layout() is not None
    assert results[-1][0].grad_fn.name() == "FlowexecLerpBackward"
    assert results[0][0].grad_fn.name() != "FlowexecLerpBackward"
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("needs", [n for n in itertools.product([False, True], repeat=3) if any(n)])
def test_native_gradient_subsets(needs):
    for _ in range(3):
        x, y, w = inputs((6, 1, 50), (6, 20, 50), (20, 1), torch.float32, needs)
        out, grads, g = run(x, y, w)
        assert_matches(x, y, w, out, grads, g)
    assert native_plan(x, y, w).has_native_backward(sum(1 << i for i, n in enumerate(needs) if n))


def test_native_node_semantics_on_cuda():
    x, y, w = inputs((4, 100), (4, 100), (100,), torch.float64)
    for _ in range(3):
        lerp(x, y, w).sum().backward()  # an expanded (stride-0) output gradient
    torch.testing.assert_close(w.grad, 3 * (y - x).detach().sum(0))
    assert torch.autograd.gradgradcheck(lambda a, b, c: lerp(a, b, c), (x[:2, :5], y[:2, :5], w[:5]))
    out = lerp(x, y, w)
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(torch.ones_like(out))


def test_native_on_a_side_stream_and_misaligned_views():
    x, y, w = inputs((8, 1001), (8, 1001), (1001,), torch.float32)
    for _ in range(3):
        run(x, y, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out, grads, g = run(x, y, w)
        assert out.grad_fn.name() == "FlowexecLerpBackward"
    torch.cuda.current_stream().wait_stream(s)
    assert_matches(x, y, w, out, grads, g)
    base = torch.randn(8 * 1001 + 1, device="cuda")
    xm = base[1:].view(8, 1001).requires_grad_()  # 4 bytes off: the Python path
    out, grads, g = run(xm, y, w)
    assert out.grad_fn.name() != "FlowexecLerpBackward"
    assert_matches(xm, y, w, out, grads, g)
