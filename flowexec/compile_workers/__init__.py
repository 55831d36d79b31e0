"""Regions compiled in worker processes before a fusion pass takes them from Inductor's cache.

Inductor generates a region's kernels in the process that asks for them (lowering, scheduling,
code generation: Python, one region at a time); only the kernels' own builds go to its compile
workers. A cold build of GPT-2 124M's first step spent 22 of its 30 s in the fusion pass on an
H100, generating its regions one after another. Here the regions a build has not compiled
before are first compiled in a few fresh processes, each writing Inductor's on-disk caches
(``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, inherited), while this process takes jobs
from the same queue and compiles them itself (:data:`THIS_PROCESS_COMPILES`; a worker still
starting once it has taken the last job is stopped, not waited for, and no worker starting at
all leaves its kernels standing: :class:`WorkersUnavailable`); the fusion pass then compiles
each region as before and finds it in the cache, as a warm build does (or, one this process
compiled, among its kernels, named only then, in the pass's order). Nothing a worker does
decides a result: a region a worker could not compile is compiled here as if no worker had
tried (and refused here, with Inductor's reason, if it is refused), and any error of the
workers' own only turns them off.

A worker (:mod:`.pipe`) is a fresh interpreter, not a fork: a user's script is not imported
again, and a process that has started CUDA may start workers. It generates its jobs' code one
after another inside one :meth:`~flowexec.inductor.InductorCompiler.together` block, so that
their kernels build side by side on its share of the CPUs, and waits for them when no job is
left. A job is a region's graph as a picklable recipe and its inputs' metas; the worker takes
this process's settings (:mod:`.settings`: configs, backend switches, deterministic mode,
dtype, threads, autocast) so that its cache keys are this process's, and refuses to start
where Inductor's registered lowerings differ from this process's (no cache key reads them).
Where no worker starts, or their regions miss the cache here all the same (a setting not
mirrored), the workers are turned off for the rest of the process, with a warning.

``FLOWEXEC_COMPILE_PROCESSES``: ``auto`` (the default: on a CUDA program with at least
:data:`MIN_COLD` regions to compile (:data:`MIN_COLD_STARTED` where workers were started
before the capture) and at least 8 CPUs, ``cpus // 4`` workers, at most 8; none on the CPU,
where C++ kernels build on threads), or a number of workers (``0``: none). On an H200 at
8a897b8 they took GPT-2 124M's cold first call from 37.8 to 32.0 s (docs/fusion.md).
The CPUs are those this process may run on, divided among torchrun's local ranks or
pytest-xdist's workers. None where Inductor's caches are off, or from a frozen executable.

    >>> processes_for(cold=5, cuda=True, cpus=16, setting="auto")
    0
    >>> processes_for(cold=12, cuda=True, cpus=16, setting="auto")
    4
    >>> processes_for(cold=12, cuda=False, cpus=16, setting="2")
    2
"""
from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import OptionError
from ..inductor import (GraphRecipe, InductorCompiler, inductor_config_text, output_check_key, output_checks, recipe_of,
                        region_key, why_refused)
from ..passes.regions import Region
from ..program import Program, TensorMeta
from .pipe import Worker, frame
from .settings import current_settings

# Fewer cold regions than this compile here sooner than workers start (each imports torch and
# starts CUDA: ~5 s on the GPU hosts, where a region compiles here in ~1 s: a cold GPT-2 124M
# first step, 23 regions in 22 s on an H100); with workers started before the capture, whose
# start it hid, fewer.
MIN_COLD = 8
MIN_COLD_STARTED = 2
MAX_PROCESSES = 8
DEFAULT = "auto"  # (FLOWEXEC_COMPILE_PROCESSES unset: see the module's docstring)
# This process takes jobs too while the workers run (flowexec.fusion's compile; False: it waits)
THIS_PROCESS_COMPILES = True
JOB_TIMEOUT_S = 900.0  # a region's compile (or a worker's start, or its last kernels' wait) that takes longer
_disabled: list[str] = []  # why the workers were turned off for this process (empty: they are not)


class WorkersUnavailable(RuntimeError):
    """No worker started (the reason of the first); the jobs this process compiled meanwhile stand."""


@dataclass(frozen=True)
class Job:
    """One region to compile: its :func:`~flowexec.inductor.region_key`, its graph as a
    :class:`~flowexec.inductor.GraphRecipe` (an FX graph does not pickle faithfully: unpickling
    traces its code again, and an op without tensor inputs, ``arange``, runs then and becomes a
    tensor constant) and its inputs' metas."""

    key: str
    recipe: GraphRecipe
    metas: tuple[TensorMeta, ...]
    region: int | None = None  # its region's index in the list cold_jobs was given (this process's own compile)


def cold_jobs(prog: Program, regions: Sequence[Region], comp: InductorCompiler) -> list[Job]:
    """The regions (one per key) ``comp`` has no kernel or refusal for and this cache directory
    no passed output check for (:func:`~flowexec.inductor.output_checks`): those a build would
    compile rather than load. A region holding a tensor constant or a target other than an ATen
    overload is left out (it compiles here)."""
    kept = output_checks()
    conf = inductor_config_text()
    jobs: dict[str, Job] = {}
    for index, region in enumerate(regions):
        key = region_key(prog, region)
        if key in jobs or key in comp.kernels or key in comp.failures:
            continue
        metas = tuple(prog.values[v].meta for v in region.inputs)
        want = [prog.values[v].meta for v in region.computed]
        if kept.get(output_check_key(key, [*metas, *want], conf)):
            continue
        recipe = recipe_of(prog, region)
        if _sendable(recipe):
            jobs[key] = Job(key, recipe, metas, index)
    return list(jobs.values())


def _sendable(recipe: GraphRecipe) -> bool:
    """Whether a recipe holds only names and plain values (no tensor, no other callable)."""
    def plain(a: Any) -> bool:
        if isinstance(a, (list, tuple)):
            return all(plain(x) for x in a)
        return not isinstance(a, torch.Tensor) and not callable(a)

    return all(isinstance(t, str) and plain(args) and plain([v for _, v in kwargs])
               for t, args, kwargs, _, _ in recipe.ops)


def setting() -> str:
    """``FLOWEXEC_COMPILE_PROCESSES`` checked (an OptionError names the choices)."""
    value = os.environ.get("FLOWEXEC_COMPILE_PROCESSES", DEFAULT).strip().lower()
    if value != "auto" and not (value.isdigit() and int(value) <= 64):
        raise OptionError(f"FLOWEXEC_COMPILE_PROCESSES={value!r}: expected 'auto' (as many as the host and the "
                          "program call for) or a number of worker processes from 0 (none: every region compiles "
                          f"in this process) to 64; the default is {DEFAULT}")
    return value


def host_cpus() -> int:
    """This process's share of the CPUs it may run on: divided among the processes torchrun
    started on this host (``LOCAL_WORLD_SIZE``) or pytest-xdist's workers, each of which builds
    its own regions."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity on this OS)
        cpus = os.cpu_count() or 1
    for name in ("LOCAL_WORLD_SIZE", "PYTEST_XDIST_WORKER_COUNT"):
        share = os.environ.get(name, "")
        if share.isdigit() and int(share) > 1:
            cpus //= int(share)
    return max(1, cpus)


def caches_on() -> bool:
    """Whether a region a worker compiled can be found here: Inductor's FX graph cache is on."""
    from torch._inductor import config

    return bool(config.fx_graph_cache) and not getattr(config, "force_disable_caches", False)


def processes_for(cold: int, cuda: bool, cpus: int | None = None, setting: str = "auto") -> int:
    """How many workers compile ``cold`` regions (see the module's docstring; ``cpus``: by
    default :func:`host_cpus`)."""
    if cold == 0 or _disabled or getattr(sys, "frozen", False):
        return 0
    if setting != "auto":
        return min(int(setting), cold)
    cpus = cpus if cpus is not None else host_cpus()
    if not cuda or cold < (MIN_COLD_STARTED if _prestarted else MIN_COLD) or cpus < 8:
        return 0
    return min(MAX_PROCESSES, cpus // 4, cold)


def off_reason() -> str | None:
    """Why the workers were turned off for this process (:func:`turn_off`), or None."""
    return _disabled[0] if _disabled else None


def turn_off(why: str) -> None:
    """No workers for the rest of this process (a warning says why, once)."""
    if not _disabled:
        _disabled.append(why)
        warnings.warn(f"flowexec: compile workers turned off for this process: {why}", stacklevel=3)


def compile_in_processes(jobs: Sequence[Job], processes: int,
                         progress: Callable[[int, int], None] | None = None,
                         here: Callable[[Job], None] | None = None) -> dict[str, str]:
    """Compile ``jobs`` in ``processes`` workers (each takes the next job when done with its
    last; those :func:`prestart` started first), filling Inductor's caches; returns the keys a
    worker did not compile, with why. Where ``here`` is given, this process takes jobs from the
    same queue too and hands each to ``here`` (its own compile) instead of waiting idle; those
    are not among the keys returned, nor sent to a worker. Every worker is gone when it returns,
    also on an interrupt; a job, a start or a last wait that takes over :data:`JOB_TIMEOUT_S`
    ends its worker."""
    todo: queue.SimpleQueue[Job] = queue.SimpleQueue()
    for job in sorted(jobs, key=lambda j: -len(j.recipe.ops)):  # (the longest first: the last to end sooner)
        todo.put(job)
    failed: dict[str, str] = {}
    done = [0]
    lock = threading.Lock()
    settings = frame(current_settings())
    n = max(1, min(processes, len(jobs)))
    workers = _take_prestarted(n)
    workers += [Worker() for _ in range(n - len(workers))]
    threads = max(1, host_cpus() // len(workers))

    idle = threading.Event()  # (set: this process found no job left; a worker still starting is stopped)

    def one_done(key: str, why: str | None = None) -> None:  # (under the lock)
        if why is not None:
            failed[key] = why
        done[0] += 1
        if progress is not None:
            progress(done[0], len(jobs))

    def serve(w: Worker) -> None:
        if idle.is_set():
            return
        try:
            w.start(settings, threads, JOB_TIMEOUT_S)
        except Exception as e:  # (its jobs go to the others, or stay for this process)
            if not idle.is_set():  # (not where it was stopped, unneeded, while starting)
                w.why = f"worker did not start: {e}"
            return
        with lock:
            w.ready = True
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                break
            try:
                data = frame(job)
            except Exception as e:  # (a value the recipe holds does not pickle: this process compiles it)
                with lock:
                    failed[job.key] = f"not sendable: {why_refused(e)}"
                continue
            try:
                why = w.compile(job.key, data, JOB_TIMEOUT_S)
            except Exception as e:  # the worker is gone: this job, and those whose kernels it built, stay here
                with lock:
                    failed.update({key: f"worker exited: {e}" for key in [*w.taken, job.key]})
                return
            with lock:
                one_done(job.key, why)
        try:  # every job generated: the worker waits for their kernels, and says which did not build
            late = w.finish(JOB_TIMEOUT_S)
        except Exception as e:
            late = {key: f"worker exited: {e}" for key in w.taken}
        with lock:
            failed.update(late)

    serving = [threading.Thread(target=serve, args=(w,), daemon=True, name="flowexec-compile-worker")
               for w in workers]
    try:
        for t in serving:
            t.start()
        while here is not None:  # (this thread compiles too, where it would wait: GPT-2 124M's
            try:                 # cold first call on an H100 waited 16.8 of its 25.8 s on 4 workers)
                job = todo.get_nowait()
            except queue.Empty:
                break
            here(job)
            with lock:
                one_done(job.key)
        if here is not None:  # (every job taken: a worker still starting would only start to finish)
            with lock:
                idle.set()
                starting = [w for w in workers if not w.ready]
            for w in starting:  # (its start then ends on its answers' pipe's end; the thread tidies up)
                w.kill()
        for t in serving:
            t.join()
    finally:
        for w in workers:
            w.stop()
        for t in serving:
            t.join(5)
        for w in workers:
            w.log.close()
    while True:  # (jobs no worker took: every worker failed to start, or refused)
        try:
            job = todo.get_nowait()
        except queue.Empty:
            break
        failed.setdefault(job.key, next((w.why for w in workers if w.why), "no worker took it"))
    if all(w.why for w in workers):  # (none started: every later build's would fail the same way)
        raise WorkersUnavailable(workers[0].why)
    return failed


_prestarted: list[Worker] = []  # started by prestart(), not yet given a job


def prestart(processes: int) -> None:
    """Start ``processes`` workers now, so that they import torch while this process captures
    (seconds each, hidden behind the capture); :func:`compile_in_processes` takes them first,
    and :func:`release_prestarted` stops those no build took."""
    threads = max(1, host_cpus() // max(1, processes))
    while len(_prestarted) < processes:
        w = Worker()
        try:
            w.spawn(threads)
        except OSError:
            w.log.close()
            return
        _prestarted.append(w)


def _take_prestarted(n: int) -> list[Worker]:
    taken = _prestarted[:n]
    del _prestarted[:n]
    return taken


def release_prestarted() -> None:
    """Stop the workers :func:`prestart` started that no build took."""
    for w in _take_prestarted(len(_prestarted)):
        w.stop()
        w.log.close()


atexit.register(release_prestarted)
