"""Activations recomputed after the peak (passes/recompute.py, ``recompute=``): what is chosen,
that the planned peak drops, that nothing differs from eager, and when it must not happen."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import flowexec
from flowexec.capture import capture
from flowexec.errors import OptionError
from flowexec.models import Block, lm_loss
from flowexec.passes.dependencies import alias_groups
from flowexec.passes.liveness import analyse_liveness
from flowexec.passes.recompute import _Round, recompute_activations
from flowexec.passes.regions import find_regions
from flowexec.passes.streams import is_view_op
from helpers import assert_close_rel

pytestmark = pytest.mark.timeout(600)


def _layers(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return [(torch.randn(16, 64, requires_grad=True), torch.randn(64, 16, requires_grad=True)) for _ in range(n)]


def _mixed_step(layers):
    """Three layers of ``gelu(x @ w1) @ w2`` with both products in bf16: each layer keeps its
    GELU output's cast and its bf16 weight for the backward, and the float32 cast of its output
    for the next layer's."""
    def step(x):
        for w1, w2 in layers:
            x = (F.gelu(x @ w1).to(torch.bfloat16) @ w2.to(torch.bfloat16)).float()
        x.sum().backward()
    return step


def _peak(prog) -> int:
    return analyse_liveness(prog, alias_groups(prog)).peak_bytes


def test_what_is_recomputed_where_the_backward_reads_it():
    """Read as a table: bytes freed at the peak, bytes kept alive longer for it, the ops run
    again (views aside). The last layer's values are read at the peak itself and stay."""
    prog = capture(_mixed_step(_layers()), (torch.randn(64, 16),)).program
    new, done = recompute_activations(prog)
    table = [f"{d.nbytes} {d.kept} " + " ".join(new.ops[i].name.split(".")[1] for i in d.ops
                                                 if not is_view_op(new.ops[i].target)) for d in done]
    assert table == [
        "8192 0 gelu _to_copy",  # layer 1's activation, from its product (which GELU's backward reads)
        "8192 0 gelu _to_copy",  # layer 2's
        "4096 2048 _to_copy",  # layer 2's float32 input, from layer 1's bf16 output (kept: 2048 bytes)
        "4096 2048 _to_copy",
        "2048 0 _to_copy",  # layer 1's bf16 weight, from the parameter
        "2048 0 _to_copy",
    ]
    assert _peak(new) < _peak(prog)
    for d in done:  # each copy is made just before the backward's first read, from what is there
        assert all(i < d.at for i in d.ops) and all(new.ops[i].recomputed for i in d.ops)
        assert not new.ops[d.at].recomputed
    assert "recomputed" in str(new)


def _new_gelu(x):
    """GPT-2's GELU as Hugging Face writes it (``gelu_new``): five ops from x to the tanh."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def test_a_tanh_gelu_is_made_again_from_its_input_so_its_forward_region_writes_its_output_alone():
    """Eager's backward of GPT-2's GELU reads its tanh's output, kept from the forward; made
    again from the GELU's input (which the backward reads anyway) inside the backward's region,
    the forward's region writes the GELU's output alone, as Inductor's kernel does, instead of
    the output and the tanh (on an H100, 71 against Inductor's 38 µs a layer), and the backward's
    reads the input and the incoming gradient. The gradients stay eager's."""
    torch.manual_seed(0)
    layers = [(torch.randn(16, 64, requires_grad=True), torch.randn(64, 16, requires_grad=True)) for _ in range(3)]

    def step(x):
        for w1, w2 in layers:
            x = _new_gelu(x @ w1) @ w2
        x.sum().backward()

    x = torch.randn(64, 16)
    new, done = recompute_activations(capture(step, (x,)).program)
    assert sum(any(new.ops[i].name == "aten.tanh.default" for i in d.ops) for d in done) >= 3  # every layer's, at least
    made_by = {o: op.name.split(".")[1] for op in new.ops for o in op.outputs}
    forward = [r for r in find_regions(new) if any(new.ops[i].name == "aten.tanh.default" for i in r.ops)
               and not any(new.ops[i].name == "aten.tanh_backward.default" for i in r.ops)
               and not any(new.ops[i].recomputed for i in r.ops)]
    assert len(forward) == 3 and all([made_by[v] for v in r.outputs if made_by[v] != "detach"] == ["mul"]
                                     for r in forward)
    backward = [r for r in find_regions(new) if any(new.ops[i].name == "aten.tanh_backward.default" for i in r.ops)]
    assert len(backward) == 3 and all(made_by.get(v) != "tanh" for r in backward for v in r.inputs)
    step(x)
    eager = [[p.grad.clone() for p in w] for w in layers]
    for w in layers:
        for p in w:
            p.grad = None
    exe = flowexec.compile(step, x, recompute=True, fuse=False)
    exe(x)
    for w, e in zip(layers, eager):
        for p, g in zip(w, e):
            assert_close_rel(p.grad, g, 1e-5, "gradient")


def test_a_source_written_in_place_before_the_backward_is_not_read_again():
    """A buffer's exp() feeds a product; the step then adds to the buffer in place before the
    backward: recomputing exp() there would read the new contents. Without the write it is
    recomputed (so the check is what stops it)."""
    def make(write: bool):
        torch.manual_seed(0)
        buf = torch.randn(64, 64)
        ws = [torch.randn(64, 64, requires_grad=True) for _ in range(3)]

        def step(x):
            c = (buf * 0.1).exp()
            for w in ws:
                x = (x @ w).tanh() @ c
            if write:
                buf.add_(1.0)
            x.sum().backward()
            return [w.grad for w in ws]
        return step, buf, ws

    for write in (False, True):
        step, buf, ws = make(write)
        prog = capture(step, (torch.randn(64, 64),)).program
        new, done = recompute_activations(prog)
        names = {new.ops[i].name for d in done for i in d.ops}
        assert ("aten.exp.default" in names) is (not write)
        # and the step's gradients are eager's
        step_e, buf_e, ws_e = make(write)
        x = torch.randn(64, 64)
        want = step_e(x)
        exe = flowexec.compile(step, recompute=True)
        for w in ws:
            w.grad = None
        got = exe(x)
        assert_close_rel(got, want, 1e-5, f"write={write}")


def _block_twins():
    torch.manual_seed(0)
    model = Block(vocab=64, dim=32, heads=4, seq=16)
    return model, copy.deepcopy(model)


def _train(model, fn_of, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(ids, y):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(ids), y)
        loss.backward()
        opt.step()
        return loss.detach()
    f = fn_of(step)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (8, 16), generator=g)
    losses = [f(ids, ids).item() for _ in range(steps)]
    return losses, f


@pytest.mark.parametrize("fuse", [False, "inductor"])
def test_a_transformer_block_trains_as_eager_with_a_lower_planned_peak(fuse):
    """Unfused, the recomputed ops are eager's own ops run again: the same losses and weights.
    Fused, within float32 tolerance; and the recomputed ops sit in no region with ops from
    before them (the fusion pass would otherwise run them in the forward again)."""
    model, ref = _block_twins()
    want, _ = _train(ref, lambda s: s)
    other = copy.deepcopy(model)
    got, exe = _train(model, lambda s: flowexec.compile(s, mode="trace", fuse=fuse, recompute=True))
    _, plain = _train(other, lambda s: flowexec.compile(s, mode="trace", fuse=fuse, recompute=False))
    st, st0 = exe.plan.stats(), plain.plan.stats()
    assert st["recomputed_buffers"] > 0 and st0["recomputed_buffers"] == 0
    assert st["planned_peak_bytes"] < st0["planned_peak_bytes"]
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_rel(p.detach(), q.detach(), 1e-5, "weights")
    if fuse:
        assert st["fused_regions"] > 0


@pytest.mark.parametrize("opts", [{"mode": "threaded", "streams": 2}, {"streams": 2}, {"memory": "planned"},
                                  {"gc": "async"}], ids=["threaded", "cpu-streams", "planned", "async-gc"])
def test_a_fused_recomputing_step_equals_eager_in_every_run_mode(opts):
    """By default a fused program recomputes; with several streams its plan verifies."""
    model, ref = _block_twins()
    want, _ = _train(ref, lambda s: s)
    got, exe = _train(model, lambda s: flowexec.compile(s, fuse="inductor", **opts))
    assert exe.plan.stats()["recomputed_buffers"] > 0
    if exe.plan.n_streams > 1:
        assert flowexec.verify_plan(exe.program, exe.plan) == []
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close_rel(p.detach(), q.detach(), 1e-5, "weights")


def test_recomputed_ops_join_no_region_of_the_forward():
    """A recomputed op reads forward values, so the fusion pass could join it to the region that
    made them and run it in the forward, freeing nothing: it joins only regions of recomputed
    ops, which the backward's ops then read and join."""
    model, _ = _block_twins()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(ids, y):
        opt.zero_grad(set_to_none=True)
        lm_loss(model(ids), y).backward()
        opt.step()
    ids = torch.randint(0, 64, (8, 16))
    prog = capture(step, (ids, ids)).program
    new, done = recompute_activations(prog)
    assert done
    # where the original peak's op is in the new program (the pass only inserts ops)
    peak = [j for j, op in enumerate(new.ops) if not op.recomputed][_Round(prog).peak_at]
    mixed = 0
    for r in find_regions(new):
        if any(new.ops[i].recomputed for i in r.ops):
            assert min(r.ops) > peak, r.ops  # a region is ordered at its first op: after the peak
            mixed += not all(new.ops[i].recomputed for i in r.ops)
    assert mixed  # (backward ops fuse with the recomputed ops they read)


def test_recompute_is_on_where_the_program_is_fused_and_checked():
    """The default follows fusion (on the CPU: fuse=None fuses nothing, so nothing is
    recomputed); a bad value names the choices."""
    model, _ = _block_twins()
    _, exe = _train(model, lambda s: flowexec.compile(s, mode="trace"), steps=2)
    assert exe.plan.stats()["recomputed_buffers"] == 0
    with pytest.raises(OptionError, match="recompute='yes'.*None.*True.*False"):
        flowexec.compile(lambda x: x + 1, torch.ones(2), recompute="yes")


def test_an_other_output_of_a_recomputed_op_written_later_keeps_its_write():
    """The copy of an op with several outputs stands in for all of them after it: recomputing
    GELU's input ``x - m`` makes ``var_mean`` again (its mean died before the peak), so a later
    ``v.mul_(2)`` on its variance, which nothing recomputed reads, would write the copy while a
    view of the original ``v`` is returned. An op is made again only where none of its outputs
    is written after it."""
    def make():
        torch.manual_seed(0)
        ws = [torch.randn(64, 64, requires_grad=True) for _ in range(4)]

        def step(x):
            with torch.no_grad():
                v, m = torch.var_mean(x, dim=1, keepdim=True)
                flat = v.view(-1)  # (a view of the original, returned after the write)
            h = (x @ ws[0]) * F.gelu(x - m)  # GELU's output: read again by mul's backward
            for w in ws[1:]:
                h = F.gelu(h @ w)
            h.sum().backward()
            with torch.no_grad():
                v.mul_(2)
            return flat, [w.grad for w in ws]
        return step, ws

    x = torch.randn(256, 64)
    want = make()[0](x)
    step, ws = make()
    exe = flowexec.compile(step, recompute=True)
    for w in ws:
        w.grad = None
    assert_close_rel(exe(x), want, 1e-5, "variance and gradients")
    assert exe.plan.stats()["recomputed_buffers"] > 0
    new, done = recompute_activations(capture(step, (x,)).program)
    assert done and not any(new.ops[i].name == "aten.var_mean.correction" for d in done for i in d.ops)


def test_an_input_on_the_storage_of_state_written_before_the_backward_is_not_read_again():
    """The step's input is a view of a state buffer (a different tensor on one storage, which
    capture records in ``Program.shared_storage``) that the step adds to before the backward:
    GELU's output, made from the input, cannot be made again there, as the input's contents
    changed with the buffer's."""
    def make():
        torch.manual_seed(0)
        buf = torch.randn(256 * 64)
        ws = [torch.randn(64, 64, requires_grad=True) for _ in range(4)]

        def step(x, z):
            h = (z @ ws[0]) * F.gelu(x * 0.5)  # GELU's output: read again by mul's backward
            for w in ws[1:]:
                h = F.gelu(h @ w)
            buf.add_(1.0)
            h.sum().backward()
            return [w.grad for w in ws]
        return step, buf, ws

    z = torch.randn(256, 64)
    step, buf, _ = make()
    want = step(buf.view(256, 64), z)
    step, buf, ws = make()
    exe = flowexec.compile(step, recompute=True)
    for w in ws:
        w.grad = None
    assert_close_rel(exe(buf.view(256, 64), z), want, 1e-5, "gradients")
    assert exe.plan.stats()["recomputed_buffers"] > 0  # (the later layers' GELUs)
    assert torch.equal(buf, make()[1] + 1.0)


def test_an_op_after_the_backward_does_not_pull_a_recomputed_op_into_the_forward():
    """After the backward, ``a / y`` reads GELU's output ``a``, made again there, and ``y``,
    which a region of the forward made: the division (not recomputed itself) could merge
    both regions into one, which runs where the forward's begins, and the recomputed GELU
    with it. A region that holds recomputed ops holds no op from before them."""
    torch.manual_seed(0)
    w0, w1, wy, *ws = [(torch.randn(64, 64) / 8).requires_grad_() for _ in range(7)]

    def step(x):
        a = F.gelu(x @ w1)
        y = (x @ wy).sigmoid()
        h = (x @ w0) * y + a
        for w in ws:
            h = F.gelu(h @ w)
        h.sum().backward()
        with torch.no_grad():
            return (a / y).mean()
    prog = capture(step, (torch.randn(256, 64),)).program
    new, done = recompute_activations(prog)
    made_again = {o for op in new.ops if op.recomputed for o in op.outputs}
    assert any(op.name == "aten.div.Tensor" and made_again & set(op.refs()) for op in new.ops)
    peak = [j for j, op in enumerate(new.ops) if not op.recomputed][_Round(prog).peak_at]
    for r in find_regions(new):
        if any(new.ops[i].recomputed for i in r.ops):
            assert min(r.ops) > peak, [new.ops[i].name for i in r.ops]


def test_a_source_on_the_storage_of_a_temporary_written_later_is_not_read_again():
    """``_unsafe_view`` shares its argument's storage without saying so in its schema: a write
    to the argument after the forward changes the view. Recomputing from the view after that
    write would read the new contents; the pass groups values by storage, so it does not (and
    does recompute where nothing is written)."""
    def make(write: bool):
        torch.manual_seed(0)
        ws = [torch.randn(64, 64, requires_grad=True) for _ in range(4)]

        def step(x):
            b = x @ ws[0]
            v = torch.ops.aten._unsafe_view(b, [64, 64])
            c = (v * 0.1).exp() * v
            h = (x @ ws[1]) @ c
            for w in ws[2:]:
                h = (h @ w).tanh()
            if write:
                b.add_(1.0)
            h.sum().backward()
            return [w.grad for w in ws]
        return step, ws

    x = torch.randn(64, 64)
    for write in (False, True):
        step, ws = make(write)
        new, done = recompute_activations(capture(step, (x,)).program)
        assert ("aten.exp.default" in {new.ops[i].name for d in done for i in d.ops}) is (not write)
        want = make(write)[0](x)
        for w in ws:
            w.grad = None
        got = flowexec.compile(step, recompute=True)(x)
        assert_close_rel(got, want, 1e-5, f"write={write}")


def test_a_recomputed_op_follows_the_op_before_its_batch_in_every_order():
    """Its sources are ready in the forward; the edge from the op before its batch keeps
    ``order_with_regions`` from running it there whatever waits on it."""
    from flowexec.passes.regions import edges

    new, done = recompute_activations(capture(_mixed_step(_layers()), (torch.randn(64, 16),)).program)
    deps = edges(new)
    for d in done:
        start = min(d.ops)
        while new.ops[start - 1].recomputed:  # (the batch: every copy made before the same op)
            start -= 1
        assert all(start - 1 in deps[i] for i in d.ops)
