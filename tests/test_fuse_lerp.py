"""The lerp substitution pass: which ops it rewrites, and that programs still equal eager."""
from __future__ import annotations

import torch

import flowexec
from flowexec.capture import capture
from flowexec.passes.fuse_lerp import substitute_lerp
from flowexec.plan import build_plan
from flowexec.runtime.interpreter import lower_trace
from helpers import assert_close_rel


def f(x, y, w):
    a = torch.lerp(x, y, 0.3)           # Scalar weight: rewritten
    b = torch.lerp(a, y, w)             # Tensor weight, broadcast: rewritten
    c = b.clone().lerp_(x, 0.5)         # in place: left to ATen
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
