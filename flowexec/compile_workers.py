"""Regions compiled in worker processes before a fusion pass takes them from Inductor's cache.

Inductor generates a region's kernels in the process that asks for them (lowering, scheduling,
code generation: Python, one region at a time); only the kernels' own builds go to its compile
workers. A cold build of GPT-2 124M's first step spent 22 of its 30 s in the fusion pass on an
H100, generating its regions one after another. Here the regions a build has not compiled
before are first compiled in a few fresh processes, each writing Inductor's on-disk caches
(``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``, inherited); the fusion pass then compiles
each region as before and finds it in the cache, as a warm build does. Nothing a worker does
decides a result: a region a worker could not compile is compiled here as if no worker had
tried (and refused here, with Inductor's reason, if it is refused).

A worker is ``python -m flowexec.compile_workers``. It generates its jobs' code one after
another inside one :meth:`~flowexec.inductor.InductorCompiler.together` block, so that their
kernels build side by side on its share of the CPUs, and waits for them when no job is left.
A job is a region's graph as a picklable recipe and its inputs' metas; the worker gets this
process's Inductor, functorch and Dynamo configuration, TF32 and
reduced-precision switches, deterministic mode, default dtype and autocast state, so that its
cache keys are the ones this process computes (a key that differs costs a compile here, not
a wrong kernel). A worker is a fresh interpreter, not a fork: a user's script is not imported
again, and a process that has started CUDA may start workers.

``FLOWEXEC_COMPILE_PROCESSES``: ``auto`` (the default: on a CUDA program with at least
:data:`MIN_COLD` regions to compile and at least 8 CPUs, ``cpus // 4`` workers, at most 8;
none on the CPU, where C++ kernels build on threads), or a number of workers (``0``: none).
Under torchrun the CPUs are the host's divided among its local ranks.

    >>> processes_for(cold=2, cuda=True, cpus=16, setting="auto")
    0
    >>> processes_for(cold=12, cuda=True, cpus=16, setting="auto")
    4
    >>> processes_for(cold=12, cuda=False, cpus=16, setting="2")
    2
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Sequence

import torch

from .errors import OptionError
from .inductor import (GraphRecipe, InductorCompiler, graph_of, inductor_config_text, output_check_key, output_checks,
                       recipe_of, region_key, why_refused)
from .passes.regions import Region
from .program import Program, TensorMeta

MIN_COLD = 4  # fewer cold regions compile here sooner than a worker starts (it imports torch: seconds)
MAX_PROCESSES = 8
JOB_TIMEOUT_S = 900.0  # a region's compile that takes longer is left to this process


@dataclass(frozen=True)
class Job:
    """One region to compile: its :func:`~flowexec.inductor.region_key`, its graph as a
    :class:`~flowexec.inductor.GraphRecipe` (an FX graph does not pickle faithfully: unpickling
    traces its code again, and an op without tensor inputs, ``arange``, runs then and becomes a
    tensor constant) and its inputs' metas."""

    key: str
    recipe: GraphRecipe
    metas: tuple[TensorMeta, ...]


def cold_jobs(prog: Program, regions: Sequence[Region], comp: InductorCompiler) -> list[Job]:
    """The regions (one per key) ``comp`` has no kernel or refusal for and this cache directory
    no passed output check for (:func:`~flowexec.inductor.output_checks`): those a build would
    compile rather than load. A region holding a tensor constant or a target other than an ATen
    overload is left out (it compiles here)."""
    kept = output_checks()
    conf = inductor_config_text()
    jobs: dict[str, Job] = {}
    for region in regions:
        key = region_key(prog, region)
        if key in jobs or key in comp.kernels or key in comp.failures:
            continue
        metas = tuple(prog.values[v].meta for v in region.inputs)
        want = [prog.values[v].meta for v in region.computed]
        if kept.get(output_check_key(key, [*metas, *want], conf)):
            continue
        recipe = recipe_of(prog, region)
        if _sendable(recipe):
            jobs[key] = Job(key, recipe, metas)
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
    value = os.environ.get("FLOWEXEC_COMPILE_PROCESSES", "auto").strip().lower()
    if value != "auto" and not (value.isdigit() and int(value) <= 64):
        raise OptionError(f"FLOWEXEC_COMPILE_PROCESSES={value!r}: expected 'auto' (the default) or a number of "
                          "worker processes from 0 (none: every region compiles in this process) to 64")
    return value


def host_cpus() -> int:
    """This process's share of the host's CPUs: all of them, divided among the processes torchrun
    started on this host (``LOCAL_WORLD_SIZE``), each of which builds its own regions."""
    share = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return max(1, (os.cpu_count() or 1) // max(1, int(share) if share.isdigit() else 1))


def processes_for(cold: int, cuda: bool, cpus: int | None = None, setting: str = "auto") -> int:
    """How many workers compile ``cold`` regions (see the module's docstring; ``cpus``: by
    default :func:`host_cpus`)."""
    if cold == 0:
        return 0
    if setting != "auto":
        return min(int(setting), cold)
    cpus = cpus if cpus is not None else host_cpus()
    if not cuda or cold < MIN_COLD or cpus < 8:
        return 0
    return min(MAX_PROCESSES, cpus // 4, cold)


def compile_in_processes(jobs: Sequence[Job], processes: int,
                         progress: Callable[[int, int], None] | None = None) -> dict[str, str]:
    """Compile ``jobs`` in ``processes`` fresh workers (each takes the next job when done with its
    last), filling Inductor's caches; returns the keys a worker did not compile, with why. Every
    worker is gone when it returns, also on an interrupt."""
    todo: queue.SimpleQueue[Job] = queue.SimpleQueue()
    for job in sorted(jobs, key=lambda j: -len(j.recipe.ops)):  # (the longest first: the last to end sooner)
        todo.put(job)
    failed: dict[str, str] = {}
    done = [0]
    lock = threading.Lock()
    settings = pickle.dumps(current_settings())
    n = max(1, min(processes, len(jobs)))
    workers = _take_prestarted(n)
    workers += [_Worker() for _ in range(n - len(workers))]
    threads = max(1, host_cpus() // len(workers))

    def serve(w: _Worker) -> None:
        try:
            w.start(settings, threads)
        except Exception as e:  # (its jobs go to the others, or stay for this process)
            w.why = f"worker did not start: {e}"
            return
        while True:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                break
            try:
                data = pickle.dumps(job)
            except Exception as e:  # (a value the recipe holds does not pickle: this process compiles it)
                with lock:
                    failed[job.key] = f"not sendable: {why_refused(e)}"
                continue
            try:
                why = w.compile(job.key, data)
            except Exception as e:  # the worker is gone: this job, and those whose kernels it built, stay here
                with lock:
                    failed.update({key: f"worker exited: {e}" for key in [*w.taken, job.key]})
                return
            with lock:
                if why is not None:
                    failed[job.key] = why
                done[0] += 1
                if progress is not None:
                    progress(done[0], len(jobs))
        try:  # every job generated: the worker waits for their kernels, and says which failed to build
            late = w.finish()
        except Exception as e:
            late = {key: f"worker exited: {e}" for key in w.taken}
        with lock:
            failed.update(late)

    serving = [threading.Thread(target=serve, args=(w,), daemon=True, name="flowexec-compile-worker")
               for w in workers]
    try:
        for t in serving:
            t.start()
        deadline = time.monotonic() + JOB_TIMEOUT_S * max(1, -(-len(jobs) // len(workers)))
        for t in serving:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        for w in workers:
            w.stop()
        for t in serving:
            t.join(5)
        for w in workers:
            w.log.close()
    while True:  # (jobs no worker took: every worker failed to start, or the time ran out)
        try:
            job = todo.get_nowait()
        except queue.Empty:
            break
        failed.setdefault(job.key, next((w.why for w in workers if w.why), "no worker took it"))
    return failed


_prestarted: list[_Worker] = []  # started by prestart(), not yet given a job


def prestart(processes: int) -> None:
    """Start ``processes`` workers now, so that they import torch while this process captures
    (seconds each, hidden behind the capture); :func:`compile_in_processes` takes them first,
    and :func:`release_prestarted` stops those no build took."""
    threads = max(1, host_cpus() // max(1, processes))
    while len(_prestarted) < processes:
        w = _Worker()
        try:
            w.spawn(threads)
        except OSError:
            w.log.close()
            return
        _prestarted.append(w)


def _take_prestarted(n: int) -> list[_Worker]:
    taken = _prestarted[:n]
    del _prestarted[:n]
    return taken


def release_prestarted() -> None:
    """Stop the workers :func:`prestart` started that no build took."""
    for w in _take_prestarted(len(_prestarted)):
        w.stop()
        w.log.close()


atexit.register(release_prestarted)


# -- what a worker must share with this process for its cache keys to be this process's ---------

def current_settings() -> dict[str, Any]:
    """The global state a region's cache key depends on (module docstring), as plain values."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    backends = {}
    for path in _BACKEND_SWITCHES:
        try:
            backends[path] = _lookup(path)
        except (AttributeError, RuntimeError):  # (a switch this torch does not have)
            pass
    return {
        "configs": {name: cfg.save_config_portable() for name, cfg in (
            ("inductor", inductor_config), ("functorch", functorch_config), ("dynamo", dynamo_config))},
        "backends": backends,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "default_dtype": torch.get_default_dtype(),
        "autocast": {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")},
    }


def apply_settings(s: dict[str, Any]) -> None:
    """Make this process's global state ``s`` (:func:`current_settings` of another), but autocast,
    which :func:`compile_job` enters around each compile."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    for name, cfg in (("inductor", inductor_config), ("functorch", functorch_config), ("dynamo", dynamo_config)):
        for k, v in s["configs"][name].items():
            try:
                setattr(cfg, k, v)
            except Exception:  # (a key this torch does not have: its cache key then differs, and says so)
                pass
    # Each switch only where it differs: setting one to its own value is not always nothing
    # (setting allow_tf32 makes fp32_precision "ieee" where it read "none", another cache key).
    if torch.get_float32_matmul_precision() != s["float32_matmul_precision"]:
        torch.set_float32_matmul_precision(s["float32_matmul_precision"])
    for path, value in s["backends"].items():
        try:
            if _lookup(path) != value:
                owner, name = path.rsplit(".", 1)
                setattr(_lookup(owner), name, value)
        except (AttributeError, RuntimeError):
            pass
    on, warn_only = s["deterministic"]
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            on, warn_only):
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
    if torch.get_default_dtype() != s["default_dtype"]:
        torch.set_default_dtype(s["default_dtype"])


# torch.backends switches a cache key reads (those a torch version lacks are skipped)
_BACKEND_SWITCHES = (
    "cuda.matmul.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_bf16_reduced_precision_reduction", "cuda.matmul.fp32_precision",
    "cudnn.allow_tf32", "cudnn.fp32_precision", "fp32_precision",
)


def _lookup(path: str) -> Any:
    obj: Any = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def compile_job(job: Job, settings: dict[str, Any], comp: InductorCompiler) -> None:
    """Compile one job as :func:`flowexec.inductor.compile_graph` does, under the autocast state
    of ``settings``, in ``comp``'s open block (its kernels build until the block ends)."""
    import contextlib

    with contextlib.ExitStack() as stack:
        for device, (on, dtype) in settings["autocast"].items():
            if on:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        comp.compile_graph_of(job.key, graph_of(job.recipe), job.metas)  # (built as region_graph builds it)


# -- the pipe between this process and a worker: length-prefixed pickles ---------------------------

def _send(pipe: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj)
    pipe.write(struct.pack("<Q", len(data)) + data)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> Any:
    head = pipe.read(8)
    if len(head) < 8:
        raise EOFError("the worker closed its pipe")
    (n,) = struct.unpack("<Q", head)
    data = pipe.read(n)
    if len(data) < n:
        raise EOFError("the worker closed its pipe mid-message")
    return pickle.loads(data)


class _Worker:
    """One worker process (``python -m flowexec.compile_workers``); its output goes to a file,
    whose end says why it failed."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile()
        self.why = ""
        self.taken: list[str] = []  # keys of the jobs it generated

    def spawn(self, threads: int) -> None:
        """Start the process (it imports torch, then waits for its settings)."""
        # Inductor's own kernel-build workers: ``threads`` per worker (the CPUs shared out); a
        # user's TORCHINDUCTOR_COMPILE_THREADS stands.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
        self.proc = subprocess.Popen([sys.executable, "-m", "flowexec.compile_workers"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)

    def start(self, settings: bytes, threads: int) -> None:
        """Spawn it where :func:`prestart` did not, and hand it ``settings``; returns once it is ready."""
        if self.proc is None:
            self.spawn(threads)
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(struct.pack("<Q", len(settings)) + settings)
        self.proc.stdin.flush()
        self._reply()  # "ready"

    def compile(self, key: str, job: bytes) -> str | None:
        """None where the worker generated the pickled ``job``'s code (its kernels build in the
        background until :meth:`finish`), else Inductor's reason."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(struct.pack("<Q", len(job)) + job)
        self.proc.stdin.flush()
        why = self._reply()
        if why is None:
            self.taken.append(key)
        return why

    def finish(self) -> dict[str, str]:
        """Wait for every job's kernels: the keys of those that failed to build, with why."""
        assert self.proc is not None and self.proc.stdin is not None
        _send(self.proc.stdin, _FINISH)
        return self._reply()

    def _reply(self) -> Any:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            return _receive(self.proc.stdout)
        except EOFError as e:
            raise EOFError(f"{e}; it said: {self._said()}") from None

    def _said(self) -> str:
        try:
            self.log.seek(0)
            lines = self.log.read().decode(errors="replace").strip().splitlines()
        except ValueError:  # (closed: the pool is being torn down)
            return "nothing"
        return lines[-1][:300] if lines else "nothing"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]  (its loop ends on the pipe's end)
                self.proc.wait(2)
            except Exception:
                pass
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


_FINISH = "finish"


def _serve() -> None:
    """A worker's loop: settings, then jobs, each answered once its code is generated (None or
    why), inside one :meth:`~flowexec.inductor.InductorCompiler.together` block, so that its
    kernels build side by side as this process's would; at "finish", the block's end waits for
    them and the answer is the keys whose kernels failed, with why. The pipe's end, without
    "finish": the worker exits at once (its parent gave up)."""
    from torch._inductor.async_compile import maybe_warm_pool

    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # (a compiler's prints must not enter the pipe)
    settings = _receive(inp)
    apply_settings(settings)
    if torch.cuda.is_available():
        maybe_warm_pool()  # (Inductor's workers for Triton's builds, which go to them once they are up)
    _send(out, "ready")
    comp = InductorCompiler()
    with comp.together() as late:
        while True:
            try:
                job = _receive(inp)
            except EOFError:
                os._exit(0)  # (nothing to wait for: no one reads the answer)
            if job == _FINISH:
                break
            try:
                compile_job(job, settings, comp)
                _send(out, None)
            except Exception as e:
                _send(out, why_refused(e))
    _send(out, {key: comp.failures.get(key, "its kernels did not build") for key in late})


if __name__ == "__main__":
    _serve()
