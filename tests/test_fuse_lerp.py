"""The lerp substitution pass: which ops it rewrites, and that programs still equal eager."""
from __future__ import annotations

import pytest
import torch

import flowexec
from flowexec.capture import capture
from flowexec.passes.dependencies import alias_groups, mutated_state, read_write_sets
from flowexec.passes.fuse_lerp import substitute_lerp
from flowexec.plan import build_plan
from flowexec.runtime.interpreter import lower_trace
from helpers import assert_close_rel


def f(x, y, w):
    a = torch.lerp(x, y, 0.3)           # Scalar weight: rewritten
    b = torch.lerp(a, y, w)             # Tensor weight, broadcast: rewritten
    c = b.clone().lerp_(x, 0.5)         # in place: rewritten only with inplace=True
    d = torch.lerp(x.double(), y.double(), 0.5)  # f64: rewritten
    return b.sum() + c.sum() + d.sum().float()


def test_rewrites_out_of_place_lerps_only_on_chosen_devices():
    args = (torch.randn(4, 8), torch.randn(4, 8), torch.rand(8))
    prog = capture(f, args).program
    assert substitute_lerp(prog) is prog  # default: CUDA only, these are CPU values
    names = [op.name for op in substitute_lerp(prog, devices=("cpu",)).ops]
    assert names.count("flowexec.lerp.default") == 3
    assert names.count("aten.lerp_.Scalar") == 1 and "aten.lerp.Scalar" not in names


def test_rewritten_program_equals_eager():
    torch.manual_seed(0)
    args = (torch.randn(4, 8), torch.randn(4, 8), torch.rand(8))
    prog = substitute_lerp(capture(f, args).program, devices=("cpu",))
    run = lower_trace(build_plan(prog))
    assert_close_rel(run(*args)[0], f(*args))


def test_option_controls_the_pass():
    args = (torch.randn(4, 8), torch.randn(4, 8), torch.rand(8))
    names = lambda exe: [op.name for op in exe.program.ops]  # noqa: E731
    assert "aten.lerp.Scalar" in names(flowexec.compile(f, *args))  # trace mode on CPU: off
    assert "aten.lerp.Scalar" in names(flowexec.compile(f, *args, fuse_lerp=True))  # CPU values: not eligible



def test_only_faster_keeps_full_size_and_small_lerps_on_aten():
    def g(x, y, w, ema, small):
        a = torch.lerp(x, y, 0.3)       # every operand full-size: ATen's kernel ties
        b = torch.lerp(a, y, w)         # broadcast weight, 2**20 elements: rewritten
        ema.lerp_(y, w)                 # the same in place: rewritten
        ema.lerp_(x, x)                 # full-size weight: ATen's wins, kept
        small.lerp_(small, w[:8])       # broadcast but 64 elements: kept
        return b.sum() + ema.sum() + small.sum()

    args = (torch.randn(1024, 1024), torch.randn(1024, 1024), torch.rand(1024), torch.randn(1024, 1024),
            torch.randn(8, 8))
    prog = capture(g, args).program
    new = substitute_lerp(prog, devices=("cpu",), inplace=True, only_faster=True)
    names = [op.name for op in new.ops]
    assert names.count("flowexec.lerp.default") == 1 and names.count("aten.lerp.Scalar") == 1
    assert names.count("flowexec.lerp_.default") == 1 and names.count("aten.lerp_.Tensor") == 2
    run = lower_trace(build_plan(new))
    mine, theirs = [a.clone() for a in args], [a.clone() for a in args]
    assert_close_rel(run(*mine)[0], g(*theirs))
    torch.testing.assert_close(mine[3], theirs[3])
    torch.testing.assert_close(mine[4], theirs[4])


@pytest.mark.parametrize("option, mode, want", [
    (None, "graph", {"inplace": True, "only_faster": True}), (None, "trace", None),
    (True, "trace", {"inplace": True, "only_faster": True}), ("all", "trace", {"inplace": True, "only_faster": False}),
    (False, "graph", None)])
def test_fuse_lerp_option_chooses_what_the_pass_rewrites(option, mode, want, monkeypatch):
    from flowexec import build
    from flowexec.passes import fuse_lerp

    seen = []
    monkeypatch.setattr(fuse_lerp, "substitute_lerp", lambda prog, **kw: seen.append(kw) or prog)
    prog = capture(ema_step, (torch.randn(4, 8), torch.randn(4, 8))).program
    assert build.rewrite_program(prog, mode, option) is prog
    assert seen == ([want] if want else [])


def ema_step(p, ema):
    ema.lerp_(p, 0.1)                   # an EMA / Adam-moment update of a caller's tensor
    return (ema * 2).sum()


def test_inplace_rewrite_keeps_aliasing_and_mutation():
    args = (torch.randn(4, 8), torch.randn(4, 8))
    prog = capture(ema_step, args).program
    assert substitute_lerp(prog, devices=("cpu",)) is prog  # in place is opt-in
    new = substitute_lerp(prog, devices=("cpu",), inplace=True)
    names = [op.name for op in new.ops]
    assert "flowexec.lerp_.default" in names and "aten.lerp_.Scalar" not in names
    # The fused op declares the same alias as aten.lerp_: same groups, same reads and writes,
    # and the caller's tensor is still known to be written.
    assert alias_groups(new) == alias_groups(prog)
    assert read_write_sets(new) == read_write_sets(prog)
    assert mutated_state(new) == mutated_state(prog) != ()


def test_inplace_rewritten_program_mutates_like_eager():
    torch.manual_seed(0)
    p, ema = torch.randn(4, 8), torch.randn(4, 8)
    prog = substitute_lerp(capture(ema_step, (p, ema.clone())).program, devices=("cpu",), inplace=True)
    run = lower_trace(build_plan(prog))
    mine, theirs = ema.clone(), ema.clone()
    got = run(p, mine)[0]
    want = ema_step(p, theirs)
    assert_close_rel(got, want)
    torch.testing.assert_close(mine, theirs)  # the caller's tensor was updated in place


def test_fuse_lerp_all_option_and_bad_values():
    args = (torch.randn(4, 8), torch.randn(4, 8))
    exe = flowexec.compile(ema_step, *args, fuse_lerp="all")  # CPU values: nothing is eligible
    assert "aten.lerp_.Scalar" in [op.name for op in exe.program.ops]
    with pytest.raises(ValueError, match="fuse_lerp"):
        flowexec.compile(ema_step, *args, fuse_lerp="yes")
