"""Fusion: each region of fusible ops becomes one op whose kernel a compiler generated.

:func:`fuse_program` finds the regions (:mod:`flowexec.passes.regions`), orders the program so
that each region's ops are adjacent, asks ``compile_region`` for a kernel per region and puts
it in the region's place as one :class:`~flowexec.program.Op`: its arguments are the region's
inputs, its outputs the values the rest of the program reads. A region the compiler refuses
keeps its ATen ops. Value ids do not change (the ops a fused op replaced leave their values
unused), so every pass after this one — liveness and GC, streams and events, verify, memory —
reads the fused program as it reads any other, and the text form shows both.

The compiler is a parameter (executables pass :class:`flowexec.inductor.InductorCompiler`'s
``compile``); the pass itself only rewrites data.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> prog = capture(lambda x, w: ((x @ w).relu() * 2).sum(), (torch.randn(4, 4), torch.randn(4, 4))).program
    >>> fused, report = fuse_program(prog, lambda p, r: None)  # a compiler that refuses everything
    >>> [r.status for r in report.regions], len(fused.ops) == len(prog.ops)
    (['fallback: not compiled'], True)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..program import Op, Program, Ref
from .regions import Region, find_regions, order_with_regions, split_region, without_gapped_views, work_count


@dataclass(frozen=True, slots=True)
class RegionReport:
    """What became of one region: its kernel's name (shared by equal regions), its ops, and
    ``status``: ``compiled``, ``shared`` (an equal region's kernel) or ``fallback: why``."""

    name: str
    ops: tuple[str, ...]  # the ATen ops' names, in order
    n_inputs: int
    n_outputs: int
    status: str
    source: str = ""
    kernel: Any = field(default=None, compare=False)  # the kernel, whose own status a later check may change

    @property
    def fused(self) -> bool:
        return not self.status.startswith("fallback")

    @property
    def current_status(self) -> str:
        """``status``, or the kernel's verdict once a first-call check has run (FLOWEXEC_DEBUG=1)."""
        checked = getattr(self.kernel, "status", "compiled")
        return self.status if checked == "compiled" else checked


@dataclass(frozen=True)
class FusionReport:
    """The regions of one program and what became of each; ``compile_seconds``: time in the
    compiler; ``worker_jobs``: regions compiled first in worker processes (flowexec.compile_workers),
    ``worker_jobs_here``: the cold ones this process compiled meanwhile;
    ``workers_off``: why those workers were turned off for the process by the pass's end (None: they
    were not)."""

    regions: tuple[RegionReport, ...] = ()
    compile_seconds: float = 0.0
    worker_jobs: int = 0
    workers_off: str | None = None
    worker_jobs_here: int = 0  # cold regions this process compiled beside its workers

    def counts(self) -> dict[str, int]:
        fused = [r for r in self.regions if r.fused]
        return {"fused_regions": len(fused), "fused_kernels": len({r.name for r in fused}),
                "fused_aten_ops": sum(len(r.ops) for r in fused),
                "fusion_fallbacks": len(self.regions) - len(fused)}

    def table(self) -> str:
        """One line per region: kernel, ATen ops, inputs → outputs, status, source line."""
        rows = []
        for r in self.regions:
            ops = ", ".join(dict.fromkeys(n.split(".")[1] if n.count(".") >= 2 else n for n in r.ops))
            src = f"  # {r.source}" if r.source else ""
            rows.append(f"{r.name:>10}  {len(r.ops):3d} ops  {r.n_inputs} -> {r.n_outputs}  {r.current_status:<10} "
                        f"{ops}{src}")
        c = self.counts()
        head = (f"{c['fused_regions']} fused regions ({c['fused_kernels']} kernels, {c['fused_aten_ops']} ATen ops), "
                f"{c['fusion_fallbacks']} fallbacks; {self.compile_seconds:.1f} s compiling")
        here = f", {self.worker_jobs_here} here beside them" if self.worker_jobs_here else ""
        if self.worker_jobs:
            head += f" ({self.worker_jobs} regions first in worker processes{here})"
        if self.workers_off:
            head += f"; compile workers turned off: {self.workers_off}"
        return "\n".join([head, *rows])


def fuse_program(prog: Program, compile_region: Callable[[Program, Region], Any],
                 regions: Sequence[Region] | None = None, progress: Callable[[int, int], None] | None = None,
                 min_ops: int = 2) -> tuple[Program, FusionReport]:
    """``prog`` with each region whose kernel ``compile_region(prog, region)`` returns replaced
    by one op calling that kernel (a string or None instead: the region keeps its ATen ops, and
    the string says why); and the report. A refused region is tried again first without the
    views whose outputs leave it with gaps (:func:`~flowexec.passes.regions.without_gapped_views`:
    a compiler that computes just a slice returns it compact), then, of at least ``2 * min_ops``
    ops that do work, as two halves (recursively), so that one op the compiler cannot take keeps
    only itself and its neighbours out.

    ``progress(done, total)`` is called after each region.
    """
    pending = list(find_regions(prog) if regions is None else regions)
    done: list[Region] = []
    kernels: dict[int, Any] = {}
    reports: list[RegionReport] = []
    seen: set[str] = set()
    total = len(pending)
    while pending:
        r = pending.pop(0)
        kernel = compile_region(prog, r)
        names = tuple(prog.ops[i].name for i in r.ops)
        source = next((prog.ops[i].source for i in r.ops if prog.ops[i].source), "")
        if kernel is None or isinstance(kernel, str):
            peeled = without_gapped_views(prog, r)
            if peeled is not None:  # (a slice may have come back compact: its base goes out, the slice after)
                pending.insert(0, peeled)
                continue
            if work_count(prog, r.ops) >= 2 * min_ops:  # refused: the halves may compile
                pending[:0] = split_region(prog, r)
                total += 1
                continue
            why = kernel or "not compiled"
            reports.append(RegionReport("-", names, len(r.inputs), len(r.outputs), f"fallback: {why}", source))
        else:
            kname = getattr(kernel, "__name__", "fused")
            reports.append(RegionReport(kname, names, len(r.inputs), len(r.outputs),
                                        "shared" if kname in seen else "compiled", source, kernel))
            seen.add(kname)
            kernels[r.ops[0]] = kernel
        done.append(r)
        if progress is not None:
            progress(len(done), total)
    regions = tuple(sorted(done, key=lambda r: r.ops[0]))
    by_head = {r.ops[0]: r for r in regions}
    ops: list[Op] = []
    for step in order_with_regions(prog, regions):
        r = by_head.get(step[0])
        if r is not None and step[0] in kernels:
            source = next((prog.ops[i].source for i in r.ops if prog.ops[i].source), "")
            ops.append(Op(len(ops), kernels[step[0]], tuple(Ref(v) for v in r.inputs), (), r.outputs, True, source))
        else:
            ops += [dataclasses.replace(prog.ops[i], index=len(ops) + k) for k, i in enumerate(step)]
    return dataclasses.replace(prog, ops=tuple(ops)), FusionReport(tuple(reports))
