"""The ``fuse=`` and ``pad=`` options: fused instructions compiled by Inductor and aligned
matrix products, for every front door.

``flowexec.compile``, the ``torch.compile`` backend and pipeline stages call
:func:`fuse_for` on a captured program before planning: with ``fuse="inductor"`` each region
of fusible ops (:mod:`flowexec.passes.regions`) becomes one op whose kernel Inductor compiled
(:mod:`flowexec.inductor`), with one compiler per process so that equal regions of any program
share a kernel. ``fuse=None`` (the default) means Inductor where it measured faster — programs
on a CUDA device in graph mode (``benchmarks/scale.py``) — and ATen ops elsewhere (trace mode,
the CPU); ``False`` never fuses.

:func:`pad_for` runs first (``passes/pad.py``): ``pad=None`` (the default) pads a misaligned
matrix product on a CUDA device where padding measured faster on that device (both forms timed
once per shape, dtype, device and versions, the verdict kept beside Inductor's cache), ``True``
pads every misaligned product, ``False`` none.

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
from typing import Any, Callable, Sequence

import torch

from .errors import OptionError
from .passes.fuse import FusionReport, fuse_program
from .passes.pad import PadCase, pad_matrix_products
from .passes.regions import Region, find_regions
from .passes.streams import cuda_devices
from .program import Program
from .verdict_cache import shared_cache

FUSE_CHOICES = ("inductor", False, None)
PAD_CHOICES = (None, True, False)
_compiler: Any = None


def check_fuse(fuse: Any) -> str | bool | None:
    """``fuse`` checked: ``"inductor"``, ``False`` or ``None`` (an OptionError names the choices)."""
    if fuse is True:
        return "inductor"
    if fuse not in FUSE_CHOICES or (fuse is not None and not isinstance(fuse, (str, bool))):
        raise OptionError(f"fuse={fuse!r} is not a fusion choice; valid: 'inductor' (regions of pointwise ops, "
                          "reductions, norms ... compiled by Inductor), False (ATen ops as captured), None (the "
                          "default: Inductor in graph mode on CUDA, where it measured faster, ATen ops elsewhere)")
    return fuse


def wants_fusion(prog: Program, fuse: str | bool | None, mode: str = "graph") -> bool:
    """Whether ``fuse`` fuses this program: ``None`` fuses a CUDA program in graph mode, where
    ``benchmarks/scale.py`` measured it faster on every model (in trace mode the host launches
    each Triton kernel: ResNet-50's fused trace step took 2.3x the unfused one)."""
    if fuse is None:
        return mode == "graph" and bool(cuda_devices(prog))
    return fuse == "inductor"


def compiler() -> Any:
    """The process's Inductor compiler (kernels shared by every program of this process)."""
    global _compiler
    if _compiler is None:
        from .inductor import InductorCompiler

        _compiler = InductorCompiler()
    return _compiler


def warm_compile_workers() -> None:
    """Start Inductor's compile workers now (each imports torch: seconds), as torch.compile does
    before Dynamo traces, so that they are ready when the regions' kernels are generated; a
    kernel generated before they are ready compiles in this process, one at a time. Triton's
    workers only: C++ kernels compile on threads."""
    from torch._inductor import async_compile

    from .inductor_keys import keep_process_keys

    keep_process_keys(cpu=False)  # (first: the pool's start computes torch_key for its helper process)
    warm = getattr(async_compile, "maybe_warm_pool", None)
    if warm is not None:
        warm()


def fuse_for(prog: Program, fuse: str | bool | None, mode: str = "graph") -> tuple[Program, FusionReport | None]:
    """``prog`` with its regions fused when ``fuse`` asks for it in run mode ``mode`` (see the
    module's docstring), and the report (None when nothing was asked)."""
    if not wants_fusion(prog, check_fuse(fuse), mode):
        return prog, None
    from . import compile_workers

    comp = compiler()
    before, jobs_before, here_before = comp.seconds + comp.worker_seconds, comp.worker_jobs, comp.worker_jobs_here
    regions = find_regions(prog)
    with _Progress() as bar:
        compile_cold_in_workers(prog, regions, comp, bar.worked)
        while True:  # (again where a kernel failed only at the end: that region keeps its ATen ops)
            with comp.together(progress=bar.waited) as late:
                fused, report = fuse_program(prog, comp.compile, regions=regions, progress=bar.update)
            if not late:
                break
    if comp.worker_misses:  # (a setting not mirrored: the workers' regions were compiled here again)
        compile_workers.turn_off(f"{comp.worker_misses} regions they compiled were not found in Inductor's cache "
                                 "here (a setting differs between this process and its workers)")
    report = FusionReport(report.regions, comp.seconds + comp.worker_seconds - before, comp.worker_jobs - jobs_before,
                          compile_workers.off_reason(), comp.worker_jobs_here - here_before)
    if os.environ.get("FLOWEXEC_DEBUG") == "1":
        for op in fused.ops:
            check = getattr(op.target, "check_first_call", None)
            if check is not None:
                check()
    return fused, report


def compile_cold_in_workers(prog: Program, regions: Sequence[Region], comp: Any,
                            progress: Callable[[int, int], None] | None = None) -> dict[str, str]:
    """Compile the regions this build would otherwise generate here
    (:func:`~flowexec.compile_workers.cold_jobs`) in worker processes first, where
    ``FLOWEXEC_COMPILE_PROCESSES`` asks for any (:mod:`flowexec.compile_workers`), this process
    taking jobs from the same queue meanwhile (its kernels are then ready: the pass finds them);
    returns those no worker compiled, with why (they compile here as before). An error of the
    workers' own turns them off for the process (a warning says why): they only ever save time."""
    from . import compile_workers

    try:
        wanted = compile_workers.setting()
        cuda = bool(cuda_devices(prog))
        if compile_workers.processes_for(len(regions), cuda, setting=wanted) == 0 or not compile_workers.caches_on():
            return {}  # (none even were every region cold: not worth looking which are)
        jobs = compile_workers.cold_jobs(prog, regions, comp)
        n = compile_workers.processes_for(len(jobs), cuda, setting=wanted)
        if n == 0:
            return {}
        mine: set[str] = set()

        def here(job: Any) -> None:  # (this process's own compile, as the pass would do it later)
            if job.region is not None:
                mine.add(job.key)
                comp.prepare(prog, regions[job.region])  # (named by the pass, in its order)

        here_too = here if compile_workers.THIS_PROCESS_COMPILES else None
        t0, here_s = time.perf_counter(), comp.seconds
        unavailable = ""
        try:
            with comp.together():  # (this process's kernels build while it takes more jobs; one refused
                try:               # at the block's end is gone or replaced: the pass compiles it again)
                    failed = compile_workers.compile_in_processes(jobs, n, progress, here_too)
                except compile_workers.WorkersUnavailable as e:  # (this process's kernels stand)
                    failed, unavailable = {}, f"{type(e).__name__}: {e}"
        except Exception as e:  # (not the regions': the workers' own; the regions compile here)
            compile_workers.turn_off(f"{type(e).__name__}: {e}"[:300])
            return {}
        finally:  # (counted as compile time, also where it was spent in vain; this process's own is in seconds)
            comp.worker_seconds += time.perf_counter() - t0 - (comp.seconds - here_s)
        comp.worker_jobs_here += len(mine)
        if unavailable:
            compile_workers.turn_off(unavailable[:300])
            return {}
        sent = [j for j in jobs if j.key not in mine]
        comp.worker_jobs += len(sent)
        comp.worker_failures.update(failed)
        comp.worker_sent.update(j.key for j in sent if j.key not in failed)
        return failed
    finally:
        release_compile_workers()  # (those prestart_compile_workers started that this build left)


def release_compile_workers() -> None:
    """Stop the compile workers :func:`prestart_compile_workers` started that no build took."""
    compile_workers = sys.modules.get("flowexec.compile_workers")  # (none started where it was never imported)
    if compile_workers is not None:
        compile_workers.release_prestarted()


def prestart_compile_workers() -> None:
    """Start the compile workers a cold build on CUDA would use (:func:`compile_cold_in_workers`)
    before the capture, which their start (importing torch: seconds) then overlaps, where this
    cache directory has no region's kept check yet (a cache no build has filled; a warm build
    stops them unused once it sees nothing to compile)."""
    from . import compile_workers
    from .inductor import output_checks

    n = compile_workers.processes_for(compile_workers.MIN_COLD * 64, True, setting=compile_workers.setting())
    if n and not len(output_checks()):
        compile_workers.prestart(n)


class _Progress:
    """A progress bar on a terminal while regions compile (rich), nothing elsewhere; a compile
    that took longer than a few seconds says so once on stderr either way."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._t0 = time.perf_counter()
        self._total = 0
        self._what = ""

    def __enter__(self) -> _Progress:
        return self

    def update(self, done: int, total: int) -> None:
        """``done`` of ``total`` regions generated (their kernels compile in the background)."""
        self._total = total
        self._show(done, total, "generating fused regions")

    def worked(self, done: int, total: int) -> None:
        """``done`` of ``total`` regions compiled by worker processes."""
        self._show(done, total, "compiling regions in worker processes and here")

    def waited(self, done: int, total: int) -> None:
        """``done`` of ``total`` regions' kernels built."""
        self._show(done, total, "compiling their kernels")

    def _show(self, done: int, total: int, what: str) -> None:
        if self._bar is None and total > 1 and sys.stderr.isatty() and time.perf_counter() - self._t0 > 0.5:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()
        if self._bar is not None:
            if self._task is None or self._what != what:
                self._task = self._bar.add_task(f"flowexec: {what}", total=total)
                self._what = what
            self._bar.update(self._task, completed=done, total=total)

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


def check_pad(pad: Any) -> bool | None:
    """``pad`` checked: None, True or False (an OptionError names the choices)."""
    if pad not in PAD_CHOICES or not isinstance(pad, (bool, type(None))):
        raise OptionError(f"pad={pad!r} is not a padding choice; valid: None (default: pad a misaligned matrix product "
                          "on CUDA where padding measured faster), True (every misaligned one), False (none)")
    return pad


def pad_for(prog: Program, pad: bool | None) -> Program:
    """``prog`` with its misaligned matrix products padded as ``pad`` asks (module docstring)."""
    pad = check_pad(pad)
    if pad is False:
        return prog
    if pad is True:
        return pad_matrix_products(prog, lambda case: True)
    return pad_matrix_products(prog, _measured_faster)


def _measured_faster(case: PadCase) -> bool:
    """On CUDA: whether the padded product, with its operands' pads, timed at most 0.9 of the
    misaligned one (timed once per case, device and versions: the verdict is kept beside
    Inductor's cache, :mod:`flowexec.verdict_cache`); elsewhere never."""
    if case.device.type != "cuda" or not torch.cuda.is_available():
        return False
    return kept_verdict(case, lambda: _time_padded(case) <= 0.9 * _time_plain(case))


def pad_key(case: PadCase) -> str:
    """What decides a padding verdict: the product's sizes and dtype, the device, torch's and
    CUDA's versions, whether float32 products may use TF32 and half ones reduced-precision sums."""
    dev = case.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    mm = torch.backends.cuda.matmul
    return (f"{name} | torch {torch.__version__} cuda {torch.version.cuda} tf32 {mm.allow_tf32} reduced "
            f"fp16 {mm.allow_fp16_reduced_precision_reduction} bf16 {mm.allow_bf16_reduced_precision_reduction} "
            f"| {case.kind} batch {case.batch} m {case.m} k {case.k} n {case.n} {case.dtype} -> {case.padded}"
            + " A^T" * case.a_t + " B^T" * case.b_t)


def kept_verdict(case: PadCase, measure: Callable[[], bool]) -> bool:
    """The verdict on ``case`` from the process's verdicts (read once from the disk), else
    ``measure()``'s, kept there (keyed by :func:`pad_key`: a process may change TF32 between
    builds)."""
    cache = shared_cache("pad_verdicts")
    key = pad_key(case)
    hit = cache.get(key)
    if hit is None:
        hit = bool(measure())
        cache.put(key, hit)
    return hit


def _operand(case: PadCase, rows: int, cols: int, transposed: bool) -> torch.Tensor:
    """A ``[rows, cols]`` operand (batched for bmm) laid out as the program's: a column-major
    one is a transpose's view of a row-major ``[cols, rows]`` tensor."""
    lead = (case.batch,) if case.batch else ()
    gen = torch.Generator(device=case.device).manual_seed(0)  # (not the default one, which fn draws from)
    if transposed:
        return torch.randn(*lead, cols, rows, dtype=case.dtype, device=case.device, generator=gen).transpose(-1, -2)
    return torch.randn(*lead, rows, cols, dtype=case.dtype, device=case.device, generator=gen)


def _operands(case: PadCase) -> tuple[torch.Tensor, torch.Tensor]:
    return _operand(case, case.m, case.k, case.a_t), _operand(case, case.k, case.n, case.b_t)


def _padded(x: torch.Tensor, rows: int, cols: int, transposed: bool) -> torch.Tensor:
    """``x`` zero-padded to ``[rows, cols]`` as the pass pads it: a transpose's source is
    padded, so the padded operand keeps the program's layout."""
    pad = torch.nn.functional.pad
    r, c = x.shape[-2:]
    if transposed:
        return pad(x.transpose(-1, -2), [0, rows - r, 0, cols - c]).transpose(-1, -2)
    return pad(x, [0, cols - c, 0, rows - r])


def _time_plain(case: PadCase) -> float:
    a, b = _operands(case)
    return _gpu_time(lambda: torch.matmul(a, b))


def _time_padded(case: PadCase) -> float:
    a, b = _operands(case)
    m2, k2, n2 = case.padded
    return _gpu_time(lambda: torch.matmul(_padded(a, m2, k2, case.a_t), _padded(b, k2, n2, case.b_t)))


def _gpu_time(fn: Any, reps: int = 10) -> float:
    """Median milliseconds of ``fn`` on the current stream (CUDA events), after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
