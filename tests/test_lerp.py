"""flowexec.kernels.lerp on the CPU: the Triton kernels in Triton's interpreter, and the PyTorch path.

Every check compares against torch.lerp and its gradients computed in float64 from the same
inputs. Hypothesis draws the broadcast pattern (ranks 0-4, any operand size-1 or missing dims,
a tensor or a float weight), the dtype, which inputs require gradients, and small tile sizes so
that multi-block grids, row splits, partial sums and both final-reduction modes all run.
"""
from __future__ import annotations

import importlib
import itertools
import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Triton fixes interpreter mode when it is imported. Only where no GPU could use compiled
    # kernels in this process (CI), and only if nothing imported Triton before us.
    os.environ["TRITON_INTERPRET"] = "1"

import flowexec.kernels  # noqa: E402
from flowexec.kernels import lerp  # noqa: E402

L = importlib.import_module("flowexec.kernels.lerp")  # the module (``lerp`` is the function)
needs_triton = pytest.mark.skipif(not L.interpreter_active(), reason="needs triton in interpreter mode: run "
                                  "with TRITON_INTERPRET=1, or this file before anything imports triton")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5, torch.float64: 1e-10}
SETTINGS = settings(max_examples=100, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def make_inputs(xs, ys, ws, dtype, needs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(xs, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(needs[0])
    y = torch.randn(ys, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(needs[1])
    if ws is None:
        w = float(torch.rand((), generator=gen) * 1.4 - 0.2)  # both sides of 0.5, and outside [0, 1]
    else:
        w = (torch.rand(ws, generator=gen, dtype=torch.float64) * 1.4 - 0.2).to(dtype).requires_grad_(needs[2])
    return x, y, w


def reference(x, y, w, g):
    """torch.lerp and autograd in float64 on the same (rounded) input values."""
    xd, yd = (t.detach().double().requires_grad_() for t in (x, y))
    wd = w.detach().double().requires_grad_() if isinstance(w, torch.Tensor) else w
    out = torch.lerp(xd, yd, wd)
    ins = [xd, yd] + ([wd] if isinstance(wd, torch.Tensor) else [])
    grads = torch.autograd.grad(out, ins, g.double())
    return out, grads


def _scale(t):
    return t.abs().max().item() if t.numel() else 0.0


def check(x, y, w, dtype, *, run=None):
    """Run lerp forward and backward for the inputs that need grads; compare with float64."""
    run = run or lerp
    out = run(x, y, w)
    assert out.dtype == dtype
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    wanted = [t for t in (x, y, w) if isinstance(t, torch.Tensor) and t.requires_grad]
    got = torch.autograd.grad(out, wanted, g) if wanted else ()
    ref_out, ref_grads = reference(x, y, w, g)
    tol = TOL[dtype]
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol * (1 + _scale(ref_out)))
    ref_by_input = dict(zip(["x", "y", "w"], ref_grads))
    names = [n for n, t in zip("xyw", (x, y, w)) if isinstance(t, torch.Tensor) and t.requires_grad]
    for name, t, gr in zip(names, wanted, got):
        ref = ref_by_input[name]
        assert gr.shape == t.shape and gr.dtype == t.dtype, name
        torch.testing.assert_close(gr.double(), ref, rtol=tol, atol=tol * (1 + _scale(ref)),
                                   msg=lambda m: f"grad of {name}: {m}")


@st.composite
def broadcast_cases(draw):
    """Shapes of x, y, w (None = Python float) that broadcast, with every size-1/missing pattern."""
    rank = draw(st.integers(0, 4))
    base = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))

    def operand():
        r = draw(st.integers(0, rank))
        return tuple(d if draw(st.booleans()) else 1 for d in base[rank - r:])

    xs, ys = operand(), operand()
    ws = None if draw(st.booleans()) and draw(st.booleans()) else operand()
    dtype = draw(st.sampled_from(DTYPES))
    needs = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    tile = draw(st.sampled_from([2, 4, 16, 4096]))
    knobs = dict(full_tile_loads=draw(st.booleans()), bwd_reverse=draw(st.booleans()),
                 flat_programs=draw(st.booleans()), even_tiles=draw(st.booleans()),
                 bwd_loads_first=draw(st.booleans()), bwd_stream=draw(st.booleans()),
                 bwd_joint_flush=draw(st.booleans()), fwd_plane=draw(st.booleans()), final_cols=draw(st.sampled_from([1, 16])),
                 atomic_max=draw(st.sampled_from([0, 1 << 16])), flat3_evict=draw(st.sampled_from([{}, {2: 7, 4: 7, 8: 7}])))
    return xs, ys, ws, dtype, needs, tile, knobs


@needs_triton
@SETTINGS
@given(broadcast_cases())
def test_triton_kernels_match_float64(case):
    xs, ys, ws, dtype, needs, tile, knobs = case
    x, y, w = make_inputs(xs, ys, ws, dtype, needs)
    with L.triton_on_cpu(), L.configured(tile={2: tile, 4: tile, 8: tile}, plane_tile={2: tile, 4: tile, 8: tile},
                                          flat3_tile={4: tile}, programs_per_sm=2,
                                          **knobs):
        plan = L._plan(x, y, w if isinstance(w, torch.Tensor) else None)
        assert plan.use_triton or plan.numel == 0  # the test must exercise the kernels
        check(x, y, w, dtype)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(broadcast_cases())
def test_pytorch_path_matches_float64(case):
    xs, ys, ws, dtype, needs, _, _ = case
    x, y, w = make_inputs(xs, ys, ws, dtype, needs)
    assert not L._plan(x, y, w if isinstance(w, torch.Tensor) else None).use_triton
    check(x, y, w, dtype)


REFERENCE_CASES = {  # the four reference cases' broadcast patterns, scaled down for the interpreter
    "case1": ((4, 500), (4, 500), (1,), torch.float32),
    "case2": ((4, 600), (4, 600), (1,), torch.float64),
    "case3": ((4, 1, 1, 1), (4, 3, 12, 12), (3, 1, 12), torch.float32),
    "case4": ((4, 500), (4, 500), (4, 500), torch.float32),
}


SCHEMES = {"final-pass": dict(atomic_max=0), "atomic": dict(atomic_max=1 << 16)}


@needs_triton
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("name", sorted(REFERENCE_CASES))
def test_reference_patterns(name, scheme):
    xs, ys, ws, dtype = REFERENCE_CASES[name]
    x, y, w = make_inputs(xs, ys, ws, dtype, (True, True, True))
    with L.triton_on_cpu(), L.configured(tile={4: 128, 8: 128}, **SCHEMES[scheme]):
        plan = L._plan(x, y, w)
        # cases 1-3 have reduced gradients: the atomic scheme applies to them (float32/float64)
        assert (plan.acc_layout() is not None) == (scheme == "atomic" and name != "case4")
        check(x, y, w, dtype)


@needs_triton
def test_atomic_sums_once_per_forward():
    """The forward zeroes the buffer its backward adds into: a second backward through the same
    graph (retain_graph), a backward in deterministic mode and one with atomics switched off all
    sum partials instead, and agree with the first."""
    xs, ys, ws, dtype = REFERENCE_CASES["case3"]
    with L.triton_on_cpu(), L.configured(tile={4: 128, 8: 128}):
        x, y, w = make_inputs(xs, ys, ws, dtype, (True, True, True))
        g = torch.randn(4, 3, 12, 12)
        out = lerp(x, y, w)
        assert out.grad_fn is not None and L._plan(x, y, w).acc_layout() is not None
        first = torch.autograd.grad(out, (x, y, w), g, retain_graph=True)
        again = torch.autograd.grad(out, (x, y, w), g)
        for a, b in zip(first, again):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.use_deterministic_algorithms(True)
        try:
            out = lerp(x, y, w)
            det = torch.autograd.grad(out, (x, y, w), g)
        finally:
            torch.use_deterministic_algorithms(False)
        for a, b in zip(first, det):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert [t.shape for t in first] == [x.shape, y.shape, w.shape]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_accumulate_in_float32(dtype):
    # 4096 terms per weight element: a float16/bfloat16 running sum would be far off.
    x, y, w = make_inputs((64, 64), (64, 64), (1,), dtype, (True, True, True))
    with L.triton_on_cpu(), L.configured(tile={2: 256}):
        check(x, y, w, dtype)


@needs_triton
def test_noncontiguous_inputs_and_expanded_grad():
    x = torch.randn(6, 5, dtype=torch.float64).t().requires_grad_()  # [5, 6], transposed
    y = torch.randn(5, 6, dtype=torch.float64)[:, ::1].requires_grad_()
    w = torch.rand(1, 6, dtype=torch.float64).requires_grad_()
    with L.triton_on_cpu():
        out = lerp(x, y, w)
        out.sum().backward()  # the gradient arrives as an expanded (stride-0) tensor
    xd, yd, wd = (t.detach().clone().requires_grad_() for t in (x, y, w))
    torch.lerp(xd, yd, wd).sum().backward()
    for a, b in ((x, xd), (y, yd), (w, wd)):
        torch.testing.assert_close(a.grad, b.grad)


def test_more_than_four_coalesced_dims_falls_back_correctly():
    shapes = ((2, 1, 2, 1, 2, 1), (1, 2, 1, 2, 1, 2), (2, 2, 2, 2, 2, 2))
    with L.triton_on_cpu():
        x, y, w = make_inputs(*shapes, torch.float64, (True, True, True))
        assert not L._plan(x, y, w).use_triton
        check(x, y, w, torch.float64)


def test_empty_and_zero_dim():
    with L.triton_on_cpu():
        x, y, w = make_inputs((0, 3), (1, 3), (3,), torch.float32, (True, True, True))
        check(x, y, w, torch.float32)
        x, y, w = make_inputs((), (), (), torch.float32, (True, True, True))
        check(x, y, w, torch.float32)


@pytest.mark.parametrize("shapes", [((3, 1), (1, 4), (3, 4)), ((2, 3), (3,), ()), ((4,), (4,), None)])
def test_gradcheck_pytorch_path(shapes):
    x, y, w = make_inputs(*shapes, torch.float64, (True, True, True))
    inputs = (x, y, w) if isinstance(w, torch.Tensor) else (x, y)
    fn = (lambda a, b, c: lerp(a, b, c)) if isinstance(w, torch.Tensor) else (lambda a, b: lerp(a, b, w))
    assert torch.autograd.gradcheck(fn, inputs)


@needs_triton
def test_gradcheck_triton_kernels():
    x, y, w = make_inputs((2, 1, 3), (1, 2, 3), (2, 1, 1), torch.float64, (True, True, True))
    with L.triton_on_cpu(), L.configured(tile={8: 2}):
        assert torch.autograd.gradcheck(lambda a, b, c: lerp(a, b, c), (x, y, w))


def test_registered_op_and_its_autograd():
    x, y, w = make_inputs((3, 4), (4,), (3, 1), torch.float32, (True, True, True))
    with L.triton_on_cpu():
        check(x, y, w, torch.float32, run=lambda a, b, c: torch.ops.flowexec.lerp(a, b, c, 0.0))
        x, y, _ = make_inputs((3, 4), (4,), None, torch.float32, (True, False, False))
        check(x, y, 0.75, torch.float32, run=lambda a, b, c: torch.ops.flowexec.lerp(a, b, None, c))


def test_opcheck():
    x, y, w = make_inputs((3, 4), (4,), (3, 1), torch.float32, (True, True, True))
    torch.library.opcheck(torch.ops.flowexec.lerp.default, (x, y, w, 0.0))
    torch.library.opcheck(torch.ops.flowexec.lerp.default, (x, y, None, 0.25))
    m = torch.randn(3, 4)  # the in-place op: schema (mutation, alias), autograd, fake, AOT dispatch
    torch.library.opcheck(torch.ops.flowexec.lerp_.default, (m, y.detach(), None, 0.25))
    torch.library.opcheck(torch.ops.flowexec.lerp_.default, (m, torch.randn(3, 4), w.detach(), 0.0))


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_tracing_records_the_op(mode):
    from torch.fx.experimental.proxy_tensor import make_fx

    x, y, w = make_inputs((3, 4), (4,), (3, 1), torch.float32, (False, False, False))
    gm = make_fx(lambda a, b, c: lerp(a, b, c), tracing_mode=mode)(x, y, w)
    assert any(n.target is torch.ops.flowexec.lerp.default for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x, y, w), torch.lerp(x, y, w))


def test_clear_errors():
    with pytest.raises(ValueError, match="powers of two.*final_cols"):
        L.LerpConfig(final_cols=24)
    x = torch.randn(3)
    with pytest.raises(TypeError, match="flowexec::lerp.*dtype"):
        lerp(x, torch.randn(3, dtype=torch.float64), 0.5)
    with pytest.raises(ValueError, match="flowexec::lerp.*broadcast"):
        lerp(x, torch.randn(4), 0.5)
    with pytest.raises(TypeError, match="flowexec::lerp.*not supported"):
        lerp(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32), 0.5)


def test_canonicalize():
    c = L.canonicalize
    assert c((16, 3, 244, 244), [(16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244)]) == ((16, 3, 244, 244), (8, 15, 5))
    assert c((16, 102400), [(16, 102400), (16, 102400), (1,)]) == ((1, 1, 1, 1638400), (1, 1, 0))
    assert c((2, 3, 4), [(2, 3, 4), (3, 4), None]) == ((1, 1, 2, 12), (3, 1, 0))
    assert c((), [(), (), None]) == ((1, 1, 1, 1), (0, 0, 0))
    assert c((2, 2, 2, 2, 2), [(2, 1, 2, 1, 2), (1, 2, 1, 2, 1), None]) is None


@needs_triton
def test_planned_tiles_by_pattern():
    """The forward kernel, its programs and the backward tile the planner picks for the
    reference patterns (defaults: docs/kernels.md says where each number comes from)."""
    f32, bf16 = torch.float32, torch.bfloat16
    full = (16, 102400)
    table = {  # (x, y, w or None, dtype): (forward kernel, forward programs, backward BM x BN,
        #                                  operands loaded evict-first: bits x 1, y 2, w 4)
        (full, full, full, f32): ("_lerp_fwd_kernel", 1600, (1, 1024), 3),  # flat3_tile, flat3_evict
        (full, full, full, bf16): ("_lerp_fwd_kernel", 400, (1, 4096), 0),
        (full, full, (1,), f32): ("_lerp_fwd_kernel", 800, (1, 2048), 0),
        (full, full, None, f32): ("_lerp_fwd_kernel", 800, (1, 2048), 0),
        ((16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244), f32): ("_lerp_fwd_plane_kernel", 2832, (8, 256), None),
    }
    with L.triton_on_cpu():
        for (xs, ys, ws, dtype), want in table.items():
            p = L._Plan(torch.Size(xs), torch.Size(ys), torch.Size(ws) if ws else None, dtype, torch.device("cpu"))
            evict = p.fwd_tail[-1] if p.fwd.fn.__name__ == "_lerp_fwd_kernel" else None
            assert (p.fwd.fn.__name__, p.fwd.grid, (p.bm, p.bn), evict) == want, (xs, ys, ws, dtype)
        with L.configured(flat3_tile={}):  # no special case: the dtype's tile
            p = L._Plan(torch.Size(full), torch.Size(full), torch.Size(full), f32, torch.device("cpu"))
            assert (p.fwd.grid, p.bn) == (800, 2048)


def test_double_backward_uses_differentiable_formulas():
    x, y, w = make_inputs((3, 4), (4,), (3, 1), torch.float64, (True, True, True))
    assert torch.autograd.gradgradcheck(lambda a, b, c: lerp(a, b, c), (x, y, w))
    if L.interpreter_active():
        with L.triton_on_cpu():
            assert torch.autograd.gradgradcheck(lambda a, b, c: lerp(a, b, c), (x, y, w))



# ----------------------------------------------------------------------------- native front door
# The C++ forward and autograd node (flowexec/kernels/csrc/lerp_native.cpp), CPU flavour: its
# launches reach the same Triton kernels in the interpreter through a hook that decodes the
# parameter blocks the C++ side packed. The first call of a shape runs in Python and plans the
# forward natively, the second plans the backward, the third is native both ways.
_native = importlib.import_module("flowexec.kernels._native")
needs_native = pytest.mark.skipif(not _native.ENABLED, reason="FLOWEXEC_NATIVE=0")
NATIVE_CASES = {
    "case1": ((4, 1024), (4, 1024), (1,), torch.float32),  # two programs: partial sums or atomics
    "case3": ((4, 1, 1, 1), (4, 3, 12, 12), (3, 1, 12), torch.float32),
    "case4": ((4, 96), (4, 96), (4, 96), torch.float32),
    "float-weight-f64": ((5, 33), (5, 33), None, torch.float64),
    "bf16-rows": ((6, 1), (6, 40), (1, 40), torch.bfloat16),
    "scalar-operands": ((), (7,), (), torch.float16),
}


def _warm_native(xs, ys, ws, dtype, needs=(True, True, True)):
    """Three checked calls of one shape (Python; native forward; native both ways): the last inputs."""
    for seed in range(3):
        x, y, w = make_inputs(xs, ys, ws, dtype, needs, seed=seed)
        check(x, y, w, dtype)
    return x, y, w


def _native_plan(x, y, w):
    plan = L._plan(x, y, w if isinstance(w, torch.Tensor) else None)
    assert plan.use_triton and plan.native is not None, "the native path was not installed"
    return plan


@needs_triton
@needs_native
@pytest.mark.timeout(600)
@pytest.mark.parametrize("atomic_max", [1 << 16, 0], ids=["atomic-sums", "partial-sums"])
@pytest.mark.parametrize("name", sorted(NATIVE_CASES))
def test_native_front_door_matches_float64(name, atomic_max):
    xs, ys, ws, dtype = NATIVE_CASES[name]
    with L.triton_on_cpu(native=True), L.configured(atomic_max=atomic_max):
        for call in range(3):
            x, y, w = make_inputs(xs, ys, ws, dtype, (True, True, True), seed=call)
            check(x, y, w, dtype)
        out = lerp(x, y, w)
        assert out.grad_fn.name() == "FlowexecLerpBackward"
        check(x, y, w, dtype)
        mask = 3 if ws is None else 7
        plan = _native_plan(x, y, w)
        # float32/float64 with a final pass to save: the forward zeroes, the backward adds atomically
        atomic = atomic_max > 0 and name in ("case1", "case3")
        assert (plan.acc_layout() is not None) == atomic
        if atomic:
            assert plan.native.has_forward_acc() and plan.native.has_backward_atomic(mask)
            assert not plan.native.has_backward(mask)
        else:
            assert plan.native.has_backward(mask) and not plan.native.has_forward_acc()


@needs_triton
@needs_native
def test_native_allocations_are_tensors_like_atens():
    """The native programs allocate through the caching allocator directly, not through the
    dispatcher: their outputs and gradients must be tensors like the ones ATen's lerp hands out
    (contiguous, same dtype, device, shape, strides and dispatch keys, a resizable output)."""
    with L.triton_on_cpu(native=True):
        x, y, w = _warm_native((4, 1, 1, 1), (4, 3, 12, 12), (3, 1, 12), torch.float32)
        g = torch.randn(4, 3, 12, 12)
        out = lerp(x, y, w)
        assert out.grad_fn.name() == "FlowexecLerpBackward"
        got = (out, *torch.autograd.grad(out, [x, y, w], g))
        ref = torch.lerp(x, y, w)
        want = (ref, *torch.autograd.grad(ref, [x, y, w], g))
        for a, b in zip(got, want):
            assert a.is_contiguous() and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
            assert a.stride() == b.stride() and torch._C._dispatch_keys(a) == torch._C._dispatch_keys(b)
            assert not a.requires_grad or a.grad_fn is not None
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        grown = got[0].detach()  # an output of its own grows like ATen's (a resizable storage)
        grown.resize_(2 * grown.numel()).fill_(1.0)
        assert grown.untyped_storage().nbytes() == 2 * ref.untyped_storage().nbytes()


@needs_triton
@needs_native
def test_native_gradients_share_one_allocation():
    """Two or more allocated gradients are carved out of one allocation: disjoint, 512-byte
    aligned, stolen into ``.grad`` without a copy and independent there."""
    with L.triton_on_cpu(native=True):
        x, y, w = _warm_native(*NATIVE_CASES["case4"])
        g = torch.randn(4, 96)
        out = lerp(x, y, w)
        assert out.grad_fn.name() == "FlowexecLerpBackward"
        dx, dy, dw = torch.autograd.grad(out, [x, y, w], g)
        assert dx.untyped_storage().data_ptr() == dy.untyped_storage().data_ptr() == dw.untyped_storage().data_ptr()
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (dx, dy, dw))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
        assert all((t.data_ptr() - dx.untyped_storage().data_ptr()) % 512 == 0 for t in (dx, dy, dw))
        wd = w.detach()
        torch.testing.assert_close(dx, g * (1 - wd))
        torch.testing.assert_close(dy, g * wd)
        torch.testing.assert_close(dw, g * (y - x).detach())
        for t in (x, y, w):
            t.grad = None
        lerp(x, y, w).backward(g)
        x.grad.add_(1000.0)  # stolen, not copied: each .grad is its own tensor over the shared storage
        torch.testing.assert_close(y.grad, g * wd)
        torch.testing.assert_close(w.grad, g * (y - x).detach())


@needs_triton
@needs_native
@pytest.mark.parametrize("name", ["case1", "case3"])
def test_native_atomic_buffers_come_from_one_slab(name):
    """A forward with grad takes the zeroed buffer for its backward's atomic sums from a slab of
    the stream, not an allocation of its own: successive calls get disjoint, 256-byte aligned
    slots of one storage, and the reduced gradients are tensors inside their call's slot."""
    xs, ys, ws, dtype = NATIVE_CASES[name]
    with L.triton_on_cpu(native=True):
        L.clear_plans()  # fresh slabs
        x, y, w = _warm_native(xs, ys, ws, dtype)
        plan = _native_plan(x, y, w)
        assert plan.native.has_forward_acc() and plan.native.has_backward_atomic(7)
        numel, slots = plan.acc_layout()
        reduced = [i for i, v in enumerate(slots) if v is not None]  # case 1: w; case 3: x and w
        got = []
        for seed in range(3):
            g = torch.randn(plan.out_shape, generator=torch.Generator().manual_seed(seed))
            out = lerp(x, y, w)
            assert out.grad_fn.name() == "FlowexecLerpBackward"
            grads = torch.autograd.grad(out, [x, y, w], g)
            for d, want in zip(grads, torch.autograd.grad(torch.lerp(x, y, w), [x, y, w], g)):
                torch.testing.assert_close(d, want)
            got.append([grads[i] for i in reduced])
        storage = {d.untyped_storage().data_ptr() for call in got for d in call}
        assert len(storage) == 1, "the calls' buffers should share one slab"
        base = storage.pop()
        starts = [call[0].data_ptr() for call in got]
        assert all((s - base) % 256 == 0 for s in starts) and len(set(starts)) == 3
        width = numel * x.element_size()
        assert all(b - a >= width for a, b in itertools.pairwise(starts)), (starts, width)
        for call, start in zip(got, starts):  # each gradient at its offset inside its call's slot
            for i, d in zip(reduced, call):
                assert d.shape == torch.Size(plan.shapes[i]) and d.is_contiguous()
                assert d.data_ptr() == start + slots[i][0] * x.element_size()
        # The slab cannot be resized through a gradient in it (that would move the other slots).
        with pytest.raises(RuntimeError, match="not resizable"):
            got[0][0].untyped_storage().resize_(64)
        flowexec.kernels.clear_lerp_plans()  # drops the slabs with the plans: the next calls take a new one
        x, y, w = _warm_native(xs, ys, ws, dtype)
        fresh = torch.autograd.grad(lerp(x, y, w), [x, y, w], torch.randn(plan.out_shape))
        assert fresh[reduced[0]].untyped_storage().data_ptr() != base
        assert all(d.untyped_storage().data_ptr() == base for call in got for d in call)  # still theirs


@needs_triton
@needs_native
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False), (False, False, True),
                                   (True, False, True)])
def test_native_computes_only_required_gradients(needs):
    with L.triton_on_cpu(native=True):
        x, y, w = _warm_native((3, 1, 8), (3, 5, 8), (5, 1), torch.float32, needs)
        mask = sum(1 << i for i, n in enumerate(needs) if n)
        assert _native_plan(x, y, w).has_native_backward(mask)
        assert not _native_plan(x, y, w).has_native_backward(7)
        # autograd.grad(inputs=[w]) asks the node for w's gradient only, although x needs one too
        x, y, w = make_inputs((3, 1, 8), (3, 5, 8), (5, 1), torch.float32, (True, True, True))
        for _ in range(2):
            (dw,) = torch.autograd.grad(lerp(x, y, w), [w], torch.ones(3, 5, 8))
        assert _native_plan(x, y, w).has_native_backward(4)
        ref = torch.autograd.grad(torch.lerp(x, y, w), [w], torch.ones(3, 5, 8))[0]
        torch.testing.assert_close(dw, ref)


@needs_triton
@needs_native
def test_native_node_semantics():
    with L.triton_on_cpu(native=True):
        x, y, w = make_inputs((4, 10), (4, 10), (10,), torch.float64, (True, True, True))
        for _ in range(3):
            lerp(x, y, w).sum().backward()
        assert lerp(x, y, w).grad_fn.name() == "FlowexecLerpBackward"
        # accumulation into .grad over the three backward calls
        torch.testing.assert_close(w.grad, 3 * (y - x).detach().sum(0))
        # double backward: the node switches to differentiable formulas
        assert torch.autograd.gradgradcheck(lambda a, b, c: lerp(a, b, c), (x, y, w))
        # a saved input modified in place is reported, as for any autograd op
        out = lerp(x, y, w)
        with torch.no_grad():
            y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward(torch.ones_like(out))
        # no grad mode: no node
        with torch.no_grad():
            assert lerp(x, y, w).grad_fn is None
        # retain_graph: two backward passes through one node
        out = lerp(x, y, w)
        g1 = torch.autograd.grad(out, [x], torch.ones_like(out), retain_graph=True)[0]
        g2 = torch.autograd.grad(out, [x], torch.ones_like(out))[0]
        torch.testing.assert_close(g1, g2)


@needs_triton
@needs_native
def test_native_front_door_steps_aside_for_tracing_and_transforms():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.func import grad, vmap

    with L.triton_on_cpu(native=True):
        x, y, w = _warm_native((3, 4), (3, 4), (4,), torch.float64)
        assert lerp(x, y, w).grad_fn.name() == "FlowexecLerpBackward"
        xd, yd, wd = (t.detach() for t in (x, y, w))
        gm = make_fx(lambda a, b, c: lerp(a, b, c))(xd, yd, wd)  # a dispatch mode is active
        assert any(n.target is torch.ops.flowexec.lerp.default for n in gm.graph.nodes)
        got = grad(lambda a: lerp(a, yd, wd).sum())(xd)  # functorch transform
        torch.testing.assert_close(got, (1 - wd).expand(3, 4))
        got = vmap(lambda a, b: lerp(a, b, wd))(xd, yd)
        torch.testing.assert_close(got, torch.lerp(xd, yd, wd))


@needs_triton
@needs_native
def test_native_and_python_paths_with_hooks_dual_and_negated_tensors():
    import gc

    import torch.autograd.forward_ad as fwAD

    with L.triton_on_cpu(native=True):
        x, y, w = _warm_native((4, 96), (4, 96), (96,), torch.float32)
        assert lerp(x, y, w).grad_fn.name() == "FlowexecLerpBackward"
        g = torch.randn(4, 96)
        want = torch.autograd.grad(torch.lerp(x, y, w), [x, y, w], g)
        # a saved-tensor hook that forgets every plan while the native forward runs
        calls: list[int] = []

        def pack(t):
            if not calls:
                L.clear_plans()
                gc.collect()
            calls.append(1)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = lerp(x, y, w)
        assert calls, "the native forward saved no tensors through the hook"
        for a, b in zip(torch.autograd.grad(out, [x, y, w], g), want):
            torch.testing.assert_close(a, b)
        _warm_native((4, 96), (4, 96), (96,), torch.float32)  # plan again
        # saved tensors that come back from an unpack hook in another dtype: ATen formulas, not kernels
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.to(torch.bfloat16), lambda t: t):
            out = lerp(x, y, w)
        assert out.grad_fn.name() == "FlowexecLerpBackward"
        for a, b in zip(torch.autograd.grad(out, [x, y, w], g), want):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * (1 + b.abs().max().item()))
        # forward-mode AD: tangents as torch.lerp gives them
        xd, yd, wd = (t.detach() for t in (x, y, w))
        tx = torch.randn(4, 96)
        with fwAD.dual_level():
            got = fwAD.unpack_dual(lerp(fwAD.make_dual(xd, tx), yd, wd)).tangent
            ref = fwAD.unpack_dual(torch.lerp(fwAD.make_dual(xd, tx), yd, wd)).tangent
        torch.testing.assert_close(got, ref)
        # negated views, forward (native, then the Python path) and as the output gradient
        xn = torch._neg_view(xd)
        torch.testing.assert_close(lerp(xn, yd, wd), torch.lerp(-xd, yd, wd))
        for seed in range(3):
            xs, ys = torch.randn(5, 33), torch.randn(5, 33)
            torch.testing.assert_close(lerp(torch._neg_view(xs), ys, 0.25), torch.lerp(-xs, ys, 0.25))
        out = lerp(x, y, w)
        got = torch.autograd.grad(out, [x, y, w], torch._neg_view(g))
        for a, b in zip(got, torch.autograd.grad(torch.lerp(x, y, w), [x, y, w], -g)):
            torch.testing.assert_close(a, b)
        # vmap over the backward (batched gradients) through the native node
        xg, yg, wg = (t.detach().double().requires_grad_() for t in (x[:2, :5], y[:2, :5], w[:5]))
        for _ in range(3):
            lerp(xg, yg, wg).sum().backward()
        assert torch.autograd.gradcheck(lambda a, b, c: lerp(a, b, c), (xg, yg, wg), check_batched_grad=True)


@needs_triton
@needs_native
def test_native_takes_unusual_tensors_back_to_python():
    with L.triton_on_cpu(native=True):
        x, y, w = _warm_native((6, 9), (6, 9), (9,), torch.float32)
        # a transposed (non-contiguous) input is made contiguous natively
        yt = torch.randn(9, 6).t().requires_grad_()
        check(x, yt, w, torch.float32)
        assert lerp(x, yt, w).grad_fn.name() == "FlowexecLerpBackward"
        # a view 4 bytes into its storage is not 16-byte aligned: the Python path takes it
        xm = torch.randn(6 * 9 + 1)[1:].view(6, 9).requires_grad_()
        check(xm, y, w, torch.float32)
        assert lerp(xm, y, w).grad_fn.name() != "FlowexecLerpBackward"
        # plans forgotten while a native graph is alive: a gradient set never planned goes back to
        # Python, which plans the call afresh
        out = lerp(x, y, w)
        assert out.grad_fn.name() == "FlowexecLerpBackward"
        L.clear_plans()
        g = torch.ones_like(out)
        got = torch.autograd.grad(out, [x, w], g)
        want = torch.autograd.grad(torch.lerp(x, y, w), [x, w], g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.skipif(L.interpreter_active() or not L.HAS_TRITON or torch.cuda.is_available(),
                    reason="the Triton-kernel tests ran in this process")
@pytest.mark.skipif(L.interpreter_active() or not L.HAS_TRITON, reason="the kernel tests ran in this process")
def test_triton_kernels_in_a_fresh_interpreter_process():
    # Triton fixes its interpreter mode when first imported. tests/conftest.py sets it for CPU-only
    # runs; where something imported Triton compiled before this file, the kernel tests above skip
    # here and run in a fresh process.
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", os.path.abspath(__file__)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "needs triton" not in proc.stdout, proc.stdout[-2000:]  # the kernel tests really ran


# ----------------------------------------------------------------------------- the in-place op

INPLACE_SHAPES = [  # (x, y, w or None for a float weight); x has the broadcast shape, as lerp_ needs
    ((4, 3, 12, 12), (4, 3, 12, 12), (3, 1, 12)),
    ((4, 500), (4, 500), (1,)),
    ((4, 500), (500,), None),
    ((6, 7), (6, 7), (6, 7)),
    ((), (), None),
]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", INPLACE_SHAPES, ids=lambda s: "x".join(map(str, s[0])) or "0d")
def test_inplace_op_runs_the_kernel_into_self(shapes, dtype, monkeypatch):
    xs, ys, ws = shapes
    x, y, w = make_inputs(xs, ys, ws, dtype, (False, False, False), seed=3)
    want = x.clone().lerp_(y, w)
    launched = []
    real = L._forward_impl
    monkeypatch.setattr(L, "_forward_impl", lambda *a, **k: launched.append(k.get("out")) or real(*a, **k))
    v0 = x._version
    with L.triton_on_cpu(), L.configured(tile={2: 64, 4: 64, 8: 64}):
        wt, wv = (None, w) if isinstance(w, float) else (w, 0.0)
        got = torch.ops.flowexec.lerp_(x, y, wt, wv)
    assert got is x and x._version > v0
    assert len(launched) == 1 and launched[0] is x  # the kernel wrote into x, not a copy
    tol = TOL[dtype]
    torch.testing.assert_close(x.double(), want.double(), rtol=tol, atol=tol)


@needs_triton
def test_inplace_op_leaves_what_the_kernel_does_not_take_to_aten(monkeypatch):
    launched = []
    real = L._forward_impl
    monkeypatch.setattr(L, "_forward_impl", lambda *a, **k: launched.append(1) or real(*a, **k))
    with L.triton_on_cpu():
        x, y = torch.randn(6, 8).t(), torch.randn(8, 6)  # non-contiguous self: ATen computes it
        want = x.clone().lerp_(y, 0.3)
        torch.ops.flowexec.lerp_(x, y, None, 0.3)
        torch.testing.assert_close(x, want)
        buf = torch.randn(48)
        errors = {  # ATen's own errors reach the caller
            "end overlaps self in part": (buf[:47], buf[1:48]),
            "self smaller than the broadcast": (torch.randn(8), torch.randn(6, 8)),
            "another dtype": (torch.randn(8), torch.randn(8, dtype=torch.float64)),
        }
        with torch.inference_mode():
            inference = torch.randn(8)
        errors["inference tensor outside inference mode"] = (inference, torch.randn(8))
        for name, (x, y) in errors.items():
            with pytest.raises(RuntimeError):
                torch.ops.flowexec.lerp_(x, y, None, 0.3)
    assert launched == []  # every call went to ATen


def test_inplace_op_with_autograd_and_fake_tensors():
    # grad needed: ATen's lerp_ records the node, and the gradient flows
    a = torch.randn(5, requires_grad=True)
    x = a * 1.0
    y = torch.randn(5, requires_grad=True)
    torch.ops.flowexec.lerp_(x, y, None, 0.25)
    x.sum().backward()
    torch.testing.assert_close(a.grad, torch.full((5,), 0.75))
    torch.testing.assert_close(y.grad, torch.full((5,), 0.25))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        f = torch.empty(3, 4)
        assert torch.ops.flowexec.lerp_(f, torch.empty(4), None, 0.5) is f


@needs_triton
def test_inplace_op_bumps_the_version_autograd_checks():
    # A tensor saved for backward and then updated by the kernel: autograd must notice.
    w = torch.randn(4, requires_grad=True)
    m = torch.randn(4)
    out = (w * m).sum()  # saves m
    with torch.no_grad(), L.triton_on_cpu():
        torch.ops.flowexec.lerp_(m, torch.ones(4), None, 0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


@needs_triton
@pytest.mark.parametrize("dual", ["self", "end", "weight"])
def test_inplace_op_carries_forward_ad_tangents(dual):
    import torch.autograd.forward_ad as fwAD

    p, y, w = torch.randn(6), torch.randn(6), torch.rand(6)
    results = []
    with L.triton_on_cpu(), fwAD.dual_level():
        for use_aten in (True, False):
            x = fwAD.make_dual(p.clone(), torch.ones(6)) if dual == "self" else p.clone()
            e = fwAD.make_dual(y, torch.ones(6)) if dual == "end" else y
            wt = fwAD.make_dual(w, torch.ones(6)) if dual == "weight" else w
            if use_aten:
                x.lerp_(e, wt)
            else:
                torch.ops.flowexec.lerp_(x, e, wt, 0.0)
            results.append((x.detach().clone(), fwAD.unpack_dual(x).tangent))
    (want, want_t), (got, got_t) = results
    torch.testing.assert_close(got, want)
    assert got_t is not None
    torch.testing.assert_close(got_t, want_t)


@needs_triton
def test_big_offsets_are_64_bit():
    # Past 2**32 elements with several (i0, i1) planes, strides are products of int32 sizes:
    # the BIG path must form them in 64 bits. Computed offsets only; no memory that size.
    import triton
    import triton.language as tl

    global _KERNELS  # the jit function below finds its callees among this module's globals
    _KERNELS = L._kernels(torch.device("cpu"))

    @triton.jit
    def offsets(out_ptr, n0, n1, n2, n3, S, NB3, rows_per_split, m_nb3, l_nb3, m_s, l_s, m_n1, l_n1):
        i0, i1, s, jn, sx2, sy2, sw2, so2, kx, ky, kw, bx, by, bw, bo, cols, cm, row_lo, row_hi = _KERNELS._program_setup(
            15, 14, 8, n0, n1, n2, n3, S, NB3, rows_per_split, m_nb3, l_nb3, m_s, l_s, m_n1, l_n1, 1, True, 4,
            False, False, False, 7)
        tl.store(out_ptr + 0, by)
        tl.store(out_ptr + 1, bo)
        tl.store(out_ptr + 2, ky)

    n0, n1, n2, n3 = 3, 4, 2**29 + 1, 3
    out = torch.zeros(3, dtype=torch.int64)
    pid_last = n0 * n1 * 1 * 1 - 1  # the program of (i0, i1) = (2, 3): grid S = NB3 = 1
    with L.triton_on_cpu():
        offsets[(pid_last + 1,)](out, n0, n1, n2, n3, 1, 1, n2, *L._division_args(1, 1, n1)[0])
    plane = n2 * n3
    # y keeps d0, d1 and d2 (mask 14): its (i0, i1) = (2, 3) block of n2 rows starts at (2 * n1 + 3) * n2
    assert out.tolist() == [(2 * n1 + 3) * n2, (2 * n1 + 3) * plane, n0 * n1 * n2]


@pytest.mark.parametrize("d", [1, 2, 3, 7, 11, 59, 244, 1000, 65535, 2**20 + 1, 2**30 + 3, 2**31 - 1])
def test_magic_div_matches_integer_division(d: int) -> None:
    """The plan's multiplier and shift divide every program index (0 <= n < 2**31) exactly, in
    the unsigned 32-bit arithmetic the kernels use."""
    m, l = L.magic_div(d)
    assert -2**31 <= m < 2**31 and 0 <= l <= 31
    mu = m % 2**32
    rng = random.Random(d)
    ns = [0, 1, d - 1, d, d + 1, 2 * d - 1, 2**31 - 1] + [rng.randrange(2**31) for _ in range(3000)]
    for n in (n for n in ns if 0 <= n < 2**31):
        assert ((((n * mu) >> 32) + n) % 2**32) >> l == n // d, (d, n)
    with pytest.raises(ValueError, match="divisor 0"):
        L.magic_div(0)


@needs_triton
def test_magic_division_gives_the_bits_of_division() -> None:
    """Programs that find their coordinates by magic multipliers (the default) compute what the
    runtime divisions computed, bit for bit: plane forward, tiled backward, sizes that are not
    powers of two."""
    torch.manual_seed(0)
    x = torch.randn(3, 1, 1, 1, requires_grad=True)
    y = torch.randn(3, 5, 7, 6, requires_grad=True)
    w = torch.rand(5, 1, 6, requires_grad=True)
    g = torch.randn(3, 5, 7, 6)
    res = {}
    for fast in (True, False):
        with L.triton_on_cpu(), L.configured(fast_div=fast):
            plan = L._plan(x.detach(), y.detach(), w.detach())
            assert plan.use_triton and plan.fwd.fn.__name__ == "_lerp_fwd_plane_kernel"
            out = L.lerp(x, y, w)
            res[fast] = (out, *torch.autograd.grad(out, (x, y, w), g))
    ref = torch.lerp(x.double(), y.double(), w.double())
    assert torch.allclose(res[True][0].double(), ref, atol=1e-6)
    for a, b in zip(res[True], res[False]):
        assert torch.equal(a, b)


@needs_triton
@needs_native
@pytest.mark.timeout(600)
@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
@pytest.mark.parametrize("shapes", [((4, 1, 1), (4, 4, 8), (1, 4, 1)), ((2, 3, 1, 1), (2, 1, 5, 7), (1, 3, 5, 1)),
                                    ((1, 8, 1, 70), (2, 8, 1, 1), (2, 8, 33, 70))], ids=str)
def test_atomic_sums_for_non_leaf_inputs(shapes, native):
    """Atomic sums where some gradients take one value per program, some reduced and some not
    (one program per element, written rather than added), for non-leaf inputs whose gradients
    flow on: values match float64 on the Python node, the native forward and native both ways."""
    xs, ys, ws = shapes
    with L.triton_on_cpu(native=native):
        for call in range(3):
            x, y, w = make_inputs(xs, ys, ws, torch.float32, (True, True, True), seed=call)
            ins = [t * 1.0 for t in (x, y, w)]  # non-leaves
            out = lerp(*ins)
            g = torch.randn(out.shape, generator=torch.Generator().manual_seed(call), dtype=torch.float64).float()
            got = torch.autograd.grad(out, ins, g)
            _, ref = reference(x, y, w, g)
            for a, b in zip(got, ref):
                torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * (1 + _scale(b)))
        plan = L._plan(x, y, w)
        assert plan.acc_layout() is not None and any(bw.atomic for bw in plan._backward.values())


def test_a_stale_build_lock_is_removed(tmp_path):
    # A native build killed mid-way leaves cpp_extension's lock; every later load waited on it.
    import os
    import time
    import warnings

    from flowexec.kernels import _native

    lock = tmp_path / "lock"
    lock.write_text("")
    _native._drop_stale_lock(str(tmp_path))
    assert lock.exists()  # a fresh lock belongs to a build in progress
    old = time.time() - _native.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _native._drop_stale_lock(str(tmp_path))
    assert not lock.exists() and any("stale build lock" in str(w.message) for w in seen)
