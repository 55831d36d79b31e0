"""The ``fuse=`` option: fused instructions compiled by Inductor, for every front door.

``flowexec.compile``, the ``torch.compile`` backend and pipeline stages call
:func:`fuse_for` on a captured program before planning: with ``fuse="inductor"`` each region
of fusible ops (:mod:`flowexec.passes.regions`) becomes one op whose kernel Inductor compiled
(:mod:`flowexec.inductor`), with one compiler per process so that equal regions of any program
share a kernel. ``fuse=None`` (the default) means Inductor where it measured faster — programs
on a CUDA device (``benchmarks/scale.py``) — and ATen ops on the CPU; ``False`` never fuses.

Under ``FLOWEXEC_DEBUG=1`` every kernel checks its first call against the region's ATen ops on
copies of the same inputs; a kernel that differs is replaced by those ATen ops for good and
says why in ``explain()``.

Example::

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: (x.sin() * 2).relu().sum(), torch.randn(8), fuse="inductor")  # doctest: +SKIP
    >>> exe.plan.stats()["fused_regions"]  # doctest: +SKIP
    1
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from .errors import OptionError
from .passes.fuse import FusionReport, fuse_program
from .passes.streams import cuda_devices
from .program import Program

FUSE_CHOICES = ("inductor", False, None)
_compiler: Any = None


def check_fuse(fuse: Any) -> str | bool | None:
    """``fuse`` checked: ``"inductor"``, ``False`` or ``None`` (an OptionError names the choices)."""
    if fuse is True:
        return "inductor"
    if fuse not in FUSE_CHOICES or (fuse is not None and not isinstance(fuse, (str, bool))):
        raise OptionError(f"fuse={fuse!r} is not a fusion choice; valid: 'inductor' (regions of pointwise ops, "
                          "reductions, norms ... compiled by Inductor), False (ATen ops as captured), None (the "
                          "default: Inductor on CUDA, where it measured faster, ATen ops on the CPU)")
    return fuse


def wants_fusion(prog: Program, fuse: str | bool | None) -> bool:
    """Whether ``fuse`` fuses this program: ``None`` decides by device (CUDA: yes)."""
    if fuse is None:
        return bool(cuda_devices(prog))
    return fuse == "inductor"


def compiler() -> Any:
    """The process's Inductor compiler (kernels shared by every program of this process)."""
    global _compiler
    if _compiler is None:
        from .inductor import InductorCompiler

        _compiler = InductorCompiler()
    return _compiler


def fuse_for(prog: Program, fuse: str | bool | None) -> tuple[Program, FusionReport | None]:
    """``prog`` with its regions fused when ``fuse`` asks for it (see the module's docstring),
    and the report (None when nothing was asked)."""
    if not wants_fusion(prog, check_fuse(fuse)):
        return prog, None
    comp = compiler()
    before = comp.seconds
    with _Progress() as bar:
        fused, report = fuse_program(prog, comp.compile, progress=bar.update)
    report = FusionReport(report.regions, comp.seconds - before)
    if os.environ.get("FLOWEXEC_DEBUG") == "1":
        for op in fused.ops:
            check = getattr(op.target, "check_first_call", None)
            if check is not None:
                check()
    return fused, report


class _Progress:
    """A progress bar on a terminal while regions compile (rich), nothing elsewhere; a compile
    that took longer than a few seconds says so once on stderr either way."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._t0 = time.perf_counter()
        self._total = 0

    def __enter__(self) -> _Progress:
        return self

    def update(self, done: int, total: int) -> None:
        self._total = total
        if self._bar is None and total > 1 and sys.stderr.isatty() and time.perf_counter() - self._t0 > 0.5:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()
            self._task = self._bar.add_task("flowexec: compiling fused regions", total=total)
        if self._bar is not None:
            self._bar.update(self._task, completed=done)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
        seconds = time.perf_counter() - self._t0
        if seconds > 5 and exc[0] is None:
            print(f"flowexec: compiled {self._total} fused regions in {seconds:.1f} s", file=sys.stderr)


def fused_kernels(prog: Program) -> list[Any]:
    """The fused kernels a program calls, in order."""
    from .inductor import FusedKernel

    return [op.target for op in prog.ops if isinstance(op.target, FusedKernel)]

