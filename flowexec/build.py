"""From a captured program to its plan: the one builder every front door uses.

``flowexec.compile`` (executable.py), the ``torch.compile`` backend (backend.py) and pipeline
stages (pipeline/compiled.py) hand :func:`plan_for` the program they captured; it applies the
program rewrites — ops whose results nothing uses dropped (``passes/dead_code.py``), the fused
lerp where it measured faster (:func:`rewrite_program`), padded matrix products and fused
regions (``fusion.pad_for``, ``fusion.fuse_for``) — and plans the result (``plan.build_plan``),
keeping the fusion report and each step's seconds (``pass_seconds``) on the plan. A new
rewrite or pass goes here once and reaches all three.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> plan = plan_for(capture(lambda x: (x * 2).relu(), (torch.randn(4),)).program, "trace")
    >>> plan.stats()["ops"], plan.fusion is None  # on the CPU fusion is asked for, not default
    (2, True)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from .errors import OptionError
from .fusion import check_fuse, fuse_for, pad_for, wants_fusion
from .passes.copy_in import copy_inputs_in
from .passes.dead_code import drop_dead_ops
from .passes.recompute import Recomputed, recompute_activations
from .plan import ExecutionPlan, build_plan
from .program import Program
from .rng import draws_put_back


def rewrite_program(prog: Program, mode: str, fuse_lerp: bool | str | None) -> Program:
    """The fused lerp for ``aten.lerp`` / ``lerp_`` where ``fuse_lerp`` asks for it: None and
    True where the fused kernel measured faster than ATen's (None in graph mode only), "all"
    every eligible one, False none (passes/fuse_lerp.py)."""
    if fuse_lerp not in (None, True, False, "all"):
        raise ValueError(f"fuse_lerp must be None, True, False or 'all', not {fuse_lerp!r}")
    if fuse_lerp or (fuse_lerp is None and mode == "graph"):
        from .passes.fuse_lerp import substitute_lerp

        prog = substitute_lerp(prog, inplace=True, only_faster=fuse_lerp != "all")
    return prog


def plan_for(prog: Program, mode: str, *, gc: str = "fast", streams: int | str = 1, fuse: str | bool | None = None,
             pad: bool | None = None, fuse_lerp: bool | str | None = None, copied_in: Sequence[int] = (),
             recompute: bool | None = None, **plan_options: Any) -> ExecutionPlan:
    """``prog`` rewritten (dead ops dropped; lerp; activations recomputed after the peak,
    ``recompute``: None where it is fused, :func:`recompute_for`; padding, fusion; then the
    inputs at positions ``copied_in`` copied in by the program itself, ``passes/copy_in.py``,
    which graph mode asks for) and planned for run mode ``mode``; ``plan_options`` go to
    :func:`~flowexec.plan.build_plan` (memory, order, gc_backlog, ...)."""
    clock = _Clock()
    # (the rewrites time kernels on random operands and compile with Inductor, which may
    # benchmark: none of it may move the generators fn draws from)
    with draws_put_back():
        prog = clock("dead_code", drop_dead_ops(prog))
        prog = clock("lerp", rewrite_program(prog, mode, fuse_lerp))
        prog, recomputed = clock("recompute", recompute_for(prog, recompute, wants_fusion(prog, check_fuse(fuse), mode)))
        prog = clock("pad", pad_for(prog, pad))
        prog, fusion = clock("fuse", fuse_for(prog, fuse, mode))
    if copied_in:  # (after fusion: the copy must stay a plain copy, the graph's memcpy node)
        prog = clock("copy_in", copy_inputs_in(prog, copied_in))
    plan = clock("build_plan", build_plan(prog, gc, streams, mode=mode, **plan_options))
    return dataclasses.replace(plan, fusion=fusion, recomputed=recomputed, pass_seconds=tuple(clock.seconds))


class _Clock:
    """Seconds since the previous call, kept under a name: ``clock(name, result)`` returns result."""

    def __init__(self) -> None:
        self.seconds: list[tuple[str, float]] = []
        self._last = time.perf_counter()

    def __call__(self, name: str, result: Any) -> Any:
        now = time.perf_counter()
        self.seconds.append((name, round(now - self._last, 6)))
        self._last = now
        return result


def check_recompute(recompute: Any) -> bool | None:
    """``recompute`` checked: None, True or False (an OptionError names the choices)."""
    if recompute not in (None, True, False) or not isinstance(recompute, (bool, type(None))):
        raise OptionError(f"recompute={recompute!r} is not a choice; valid: None (default: where the program is fused, "
                          "recompute cheap activations after the peak where that lowers it), True (also unfused), "
                          "False (never)")
    return recompute


def recompute_for(prog: Program, recompute: bool | None, fused: bool) -> tuple[Program, tuple[Recomputed, ...]]:
    """``prog`` with activations recomputed after its peak (``passes/recompute.py``) where
    ``recompute`` asks: True always, None where the program will be ``fused`` (the recomputing
    ops join the backward's fused kernels; unfused they are extra kernels), False never."""
    if not (check_recompute(recompute) or (recompute is None and fused)):
        return prog, ()
    return recompute_activations(prog)
