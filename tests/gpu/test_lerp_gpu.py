"""flowexec.kernels.lerp on CUDA: compiled Triton kernels against float64, launch paths, CUDA graphs.

Skipped without CUDA. Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest tests/gpu/test_lerp_gpu.py``.
"""
from __future__ import annotations

import contextlib

import importlib
import itertools

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

if torch.cuda.is_available():
    from flowexec.kernels import lerp

    L = importlib.import_module("flowexec.kernels.lerp")
    launch = importlib.import_module("flowexec.kernels._launch")
    _native = importlib.import_module("flowexec.kernels._native")

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5, torch.float64: 1e-10}
SHAPES = [  # (x, y, w or None for a float weight): each reference pattern and odd sizes
    ((16, 1024), (16, 1024), (1,)),
    ((16, 1, 1, 1), (16, 3, 44, 44), (3, 1, 44)),
    ((7, 333), (7, 333), (7, 333)),
    ((5, 1, 37), (1, 9, 37), (5, 9, 1)),
    ((3000,), (2, 3000), ()),
    ((4, 77), (4, 77), None),
    ((1, 130000), (3, 1), (3, 130000)),
]


def inputs(xs, ys, ws, dtype, needs=(True, True, True), dev="cuda"):
    x = torch.randn(xs, device=dev, dtype=dtype).requires_grad_(needs[0])
    y = torch.randn(ys, device=dev, dtype=dtype).requires_grad_(needs[1])
    w = 0.7 if ws is None else torch.rand(ws, device=dev, dtype=dtype).requires_grad_(needs[2])
    return x, y, w


def assert_matches(x, y, w, out, grads, g):
    xd, yd = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    wd = w.detach().double().requires_grad_() if isinstance(w, torch.Tensor) else w
    ref = torch.lerp(xd, yd, wd)
    want = [(t, r) for t, r in zip((x, y, w), (xd, yd, wd)) if isinstance(t, torch.Tensor) and t.requires_grad]
    rgrads = torch.autograd.grad(ref, [r for _, r in want], g.double()) if want else ()
    tol = TOL[x.dtype]
    for a, b in zip([out, *grads], [ref, *rgrads]):
        assert a.shape == b.shape
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * (1 + b.abs().max().item()))


@pytest.mark.parametrize("scheme", [0, 1 << 16], ids=["final-pass", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "x".join(map(str, s[1])))
def test_matches_float64(shapes, dtype, scheme):
    with L.configured(atomic_max=scheme):
        for _ in range(2):  # the first call compiles and launches normally, the second launches directly
            x, y, w = inputs(*shapes, dtype)
            out = lerp(x, y, w)
            g = torch.randn_like(out)
            ins = [t for t in (x, y, w) if isinstance(t, torch.Tensor)]
            assert_matches(x, y, w, out, torch.autograd.grad(out, ins, g), g)


@pytest.mark.parametrize("needs", [n for n in itertools.product([False, True], repeat=3) if any(n)])
def test_gradient_subsets(needs):
    x, y, w = inputs((6, 1, 50), (6, 20, 50), (20, 1), torch.float32, needs)
    out = lerp(x, y, w)
    g = torch.randn_like(out)
    ins = [t for t in (x, y, w) if t.requires_grad]
    assert_matches(x, y, w, out, torch.autograd.grad(out, ins, g), g)


def test_misaligned_views_take_the_normal_launch():
    base = torch.randn(4 * 1001 + 1, device="cuda")
    x = base[1:].view(4, 1001).requires_grad_()  # 4-byte offset: not 16-byte aligned
    y = torch.randn(4, 1001, device="cuda", requires_grad=True)
    w = torch.rand(1001, device="cuda", requires_grad=True)
    for xx in (torch.randn(4, 1001, device="cuda", requires_grad=True), x):  # aligned first, then not
        out = lerp(xx, y, w)
        g = torch.randn_like(out)
        assert_matches(xx, y, w, out, torch.autograd.grad(out, (xx, y, w), g), g)


def test_cuda_graph_replay():
    x, y, w = inputs((16, 1, 1, 1), (16, 3, 24, 24), (3, 1, 24), torch.float32)
    g = torch.randn(16, 3, 24, 24, device="cuda")

    def step():
        out = lerp(x, y, w)
        return (out, *torch.autograd.grad(out, (x, y, w), g))

    # Detached: a live eager graph would keep AccumulateGrad nodes bound to the default
    # stream, and autograd would then sync with that stream during capture (an error).
    # Capture takes the partial sums (a graph could replay a backward without the forward
    # that zeroes the atomic buffer): the eager reference and the warm-up use them too, in
    # deterministic mode, so that the graph must give the same bits.
    torch.use_deterministic_algorithms(True)
    try:
        eager = [t.detach() for t in step()]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):  # by the third call a call is native both ways (final-pass plans)
                step()
    finally:
        torch.use_deterministic_algorithms(False)
    torch.cuda.current_stream().wait_stream(s)
    native = L._plan(x, y, w).native
    if _native.ENABLED:  # so the capture below records native launches
        assert native is not None and native.has_backward(7)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_cuda_graph_capture_after_a_warm_up_with_atomic_sums():
    """The usual way to capture (warm up on a side stream, as torch.cuda.graph's docs and
    make_graphed_callables do, then capture): the warm-up runs the atomic scheme, and the capture
    must then plan, compile and record the partial-sum forward and backward it has not run yet."""
    L.clear_plans()
    x, y, w = inputs((16, 1, 1, 1), (16, 3, 24, 24), (3, 1, 24), torch.float32)
    g = torch.randn(16, 3, 24, 24, device="cuda")

    def step():
        out = lerp(x, y, w)
        return (out, *torch.autograd.grad(out, (x, y, w), g))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    plan = L._plan(x, y, w)
    assert plan.acc_layout() is not None and plan.backward_plan((True, True, True), atomic=True).main.compiled
    assert plan.backward_plan((True, True, True)).main.compiled is None  # the partial sums: not run yet
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    with torch.no_grad():  # new values in the captured inputs: the replay must follow them
        for t in (x, y, w, g):
            t.copy_(torch.randn_like(t) if t is not w else torch.rand_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(x, y, w, static[0], static[1:], g)


def test_direct_and_normal_launch_agree():
    x, y, w = inputs((16, 1, 1, 1), (16, 3, 64, 64), (3, 1, 64), torch.float32)
    g = torch.randn(16, 3, 64, 64, device="cuda")
    results = []
    with _native.python_path(), deterministic():  # the Python front door's launch paths, partial sums
        for direct in (False, True, True):
            launch.DIRECT_LAUNCH = direct
            try:
                out = lerp(x, y, w)
                results.append((out, *torch.autograd.grad(out, (x, y, w), g)))
            finally:
                launch.DIRECT_LAUNCH = True
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # deterministic: same bits


@contextlib.contextmanager
def deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def test_atomic_sums_on_cuda():
    """The default for float32/float64 patterns with reduced gradients: the forward zeroes a
    buffer, the backward adds into it; a retained graph's second backward, deterministic mode
    and the partial-sum scheme agree with it; the gradients are views of that one buffer."""
    x, y, w = inputs((16, 1, 1, 1), (16, 3, 64, 64), (3, 1, 64), torch.float32)
    g = torch.randn(16, 3, 64, 64, device="cuda")
    for _ in range(3):  # Python, then native forward, then native both ways
        out = lerp(x, y, w)
        first = torch.autograd.grad(out, (x, y, w), g, retain_graph=True)
        again = torch.autograd.grad(out, (x, y, w), g)
        for a, b in zip(first, again):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plan = L._plan(x, y, w)
    assert plan.acc_layout() is not None and (not _native.ENABLED or plan.native.has_backward_atomic(7))
    assert first[0].untyped_storage().data_ptr() == first[2].untyped_storage().data_ptr()  # dx, dw: one buffer
    with deterministic():
        det = torch.autograd.grad(lerp(x, y, w), (x, y, w), g)
    for a, b in zip(first, det):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert_matches(x, y, w, out, first, g)


def test_reference_cases_full_size():
    cases = [((16, 102400), (16, 102400), (1,), torch.float32), ((16, 204800), (16, 204800), (1,), torch.float64),
             ((16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), torch.float32),
             ((16, 102400), (16, 102400), (16, 102400), torch.float32)]
    for xs, ys, ws, dtype in cases:
        x, y, w = inputs(xs, ys, ws, dtype)
        out = lerp(x, y, w)
        g = torch.randn_like(out)
        assert_matches(x, y, w, out, torch.autograd.grad(out, (x, y, w), g), g)


def test_registered_op_on_cuda():
    x, y, w = inputs((8, 300), (300,), (8, 1), torch.bfloat16)
    out = torch.ops.flowexec.lerp(x, y, w, 0.0)
    g = torch.randn_like(out)
    assert_matches(x, y, w, out, torch.autograd.grad(out, (x, y, w), g), g)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 48 * 2**30,
                    reason="needs about 40 GiB of GPU memory")
def test_more_than_2_to_the_31_elements():
    # One flat row longer than 2**31: column offsets must be computed in 64 bits.
    n = 2**31 + 3 * 4096 + 8
    x = torch.randn(n, device="cuda", dtype=torch.float16).requires_grad_()
    y = torch.randn(n, device="cuda", dtype=torch.float16).requires_grad_()
    out = lerp(x, y, 0.3)
    worst = (out.float() - torch.lerp(x.detach(), y.detach(), 0.3).float()).abs().max().item()
    assert worst <= 2e-3, worst
    tail = slice(n - 5000, n)  # past 2**31
    assert torch.equal(out[tail], torch.lerp(x.detach()[tail], y.detach()[tail], 0.3))
    g = torch.ones_like(out)
    dx, dy = torch.autograd.grad(out, (x, y), g)
    assert torch.all(dx == 0.7).item() and torch.all(dy == 0.3).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", [((16, 3, 44, 44), (16, 3, 44, 44), (3, 1, 44)), ((7, 333), (333,), None),
                                    ((4, 1000), (4, 1000), (4, 1000))], ids=["bcast-w", "float-w", "full"])
def test_inplace_op_matches_aten(shapes, dtype):
    xs, ys, ws = shapes
    x, y, w = inputs(xs, ys, ws, dtype, needs=(False, False, False))
    wt, wv = (None, w) if isinstance(w, float) else (w, 0.0)
    for _ in range(2):  # the second call launches directly
        want = x.clone().lerp_(y, w)
        got = torch.ops.flowexec.lerp_(x, y, wt, wv)
        assert got is x
        torch.testing.assert_close(x, want, rtol=TOL[dtype], atol=TOL[dtype])


def test_inplace_rewrite_in_a_graph_mode_step():
    import flowexec

    def ema_step(p, ema):
        ema.lerp_(p, 0.1)
        return (ema * 2).sum()

    p = torch.randn(64, 256, device="cuda")
    ema = torch.randn(64, 256, device="cuda")
    exe = flowexec.compile(ema_step, p, ema.clone(), mode="graph", fuse_lerp="all")
    assert "flowexec.lerp_.default" in [op.name for op in exe.program.ops]
    mine, theirs = ema.clone(), ema.clone()
    for _ in range(3):
        got = exe(p, mine)
        want = ema_step(p, theirs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
