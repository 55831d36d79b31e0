"""The pipes between a process and its compile workers, and a worker's loop.

A worker is started as ``python -c BOOT ROOT FD``: ``ROOT``, the directory this process imported
flowexec from, is put first on its path (``python -m`` would put the working directory first,
where another copy of flowexec, or a module shadowing the standard library's, may be); ``FD``
is the write end of a pipe of its own for its answers, so that nothing else a worker prints (a
``sitecustomize``, an import's warning, a compiler) can enter them: its stdout and stderr go
to a log file, whose end says why a worker failed. Each message is ``MAGIC``, a length and a
pickle; a reader gives up on a message that does not begin with ``MAGIC``, is longer than
:data:`MAX_MESSAGE`, or has not arrived by its deadline.

A worker's loop (:func:`serve`): its settings (:mod:`.settings`), then jobs, each answered once
its code is generated (None, or why not), inside one
:meth:`~flowexec.inductor.InductorCompiler.together` block, so that its kernels build side by
side as this process's would; at ``FINISH`` the block's end waits for them, and the answer is
the keys whose kernels did not build, with why. The pipe's end without ``FINISH``: the worker
exits at once (the process that sent the jobs gave up).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import select
import struct
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import torch

MAGIC = b"FXW1"
MAX_MESSAGE = 1 << 30
FINISH = "finish"
BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
        "from flowexec.compile_workers.pipe import serve; serve(int(sys.argv[2]))")


def frame(obj: Any) -> bytes:
    """One message: ``MAGIC``, the pickle's length, the pickle."""
    data = pickle.dumps(obj)
    return MAGIC + struct.pack("<Q", len(data)) + data


def send(pipe: IO[bytes], obj: Any) -> None:
    pipe.write(frame(obj))
    pipe.flush()


def read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``fd``; EOFError where it ends first, TimeoutError at ``deadline``
    (``time.monotonic()``; None: no limit)."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("no answer in time")
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the pipe ended")
        out += chunk
    return bytes(out)


def receive(fd: int, deadline: float | None = None) -> Any:
    """One message from ``fd`` (see :func:`read_exact` for the deadline)."""
    head = read_exact(fd, 12, deadline)
    if head[:4] != MAGIC:
        raise EOFError(f"not a message: {head!r}")
    (n,) = struct.unpack("<Q", head[4:])
    if n > MAX_MESSAGE:
        raise EOFError(f"a message of {n} bytes")
    return pickle.loads(read_exact(fd, n, deadline))


def package_root() -> str:
    """The directory this process imported flowexec from (this file is flowexec/compile_workers/pipe.py)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Worker:
    """This process's handle on one worker."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile()
        self.why = ""
        self.ready = False  # (started and handed its settings: compile_in_processes sets it)
        self.cancelled = False  # (kill() asked: a start not yet spawned then ends at once)
        self.taken: list[str] = []  # keys of the jobs it generated
        self._answers = -1  # the read end of its answers' pipe

    def spawn(self, threads: int) -> None:
        """Start the process (it imports torch, then waits for its settings)."""
        # Inductor's own kernel-build workers: ``threads`` per worker (the CPUs shared out); a
        # user's TORCHINDUCTOR_COMPILE_THREADS stands.
        env = dict(os.environ)
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(threads))
        read, write = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", BOOT, package_root(), str(write)],
                                         stdin=subprocess.PIPE, stdout=self.log, stderr=self.log, env=env,
                                         pass_fds=(write,))
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        self._answers = read

    def start(self, settings: bytes, threads: int, timeout: float) -> None:
        """Spawn it where nobody did, and hand it ``settings`` (a :func:`frame`); returns once it
        is ready, raises where it refuses (its Inductor registrations are not this process's)."""
        if self.proc is None:
            self.spawn(threads)
        if self.cancelled:  # (kill() came before the process it would kill: after it, kill() sees it)
            raise RuntimeError("stopped while starting: no job left for it")
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(settings)
        self.proc.stdin.flush()
        said = self.answer(time.monotonic() + timeout)
        if said != "ready":
            raise RuntimeError(str(said))

    def compile(self, key: str, job: bytes, timeout: float) -> str | None:
        """None where the worker generated the job's code (a :func:`frame`; its kernels build in
        the background until :meth:`finish`), else why not."""
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(job)
        self.proc.stdin.flush()
        why = self.answer(time.monotonic() + timeout)
        if why is None:
            self.taken.append(key)
        return why

    def finish(self, timeout: float) -> dict[str, str]:
        """Wait for every job's kernels: the keys of those that did not build, with why."""
        assert self.proc is not None and self.proc.stdin is not None
        send(self.proc.stdin, FINISH)
        return self.answer(time.monotonic() + timeout)

    def answer(self, deadline: float) -> Any:
        try:
            return receive(self._answers, deadline)
        except (EOFError, TimeoutError) as e:
            self.stop()  # (a late answer must not be read as the next one's)
            raise EOFError(f"{e}; it said: {self.said()}") from None

    def said(self) -> str:
        """The end of the worker's log: its last lines naming an error, else its last line."""
        try:
            self.log.seek(0)
            lines = self.log.read().decode(errors="replace").strip().splitlines()
        except ValueError:  # (closed: the pool is being torn down)
            return "nothing"
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
        return (errors[-1] if errors else lines[-1] if lines else "nothing")[:300]

    def kill(self) -> None:
        """Kill the process (from another thread than the one waiting on its answers: that wait
        ends on the pipe's end and stops it)."""
        self.cancelled = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def stop(self) -> None:
        """End the process (its pipe's end first, then a kill) and close its pipes."""
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()  # type: ignore[union-attr]  (its loop ends on the pipe's end)
                    self.proc.wait(2)
                except Exception:
                    pass
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
        if self._answers >= 0:
            os.close(self._answers)
            self._answers = -1


def compile_job(job: Any, settings: dict[str, Any], comp: Any) -> None:
    """Compile one job (a :class:`~flowexec.compile_workers.Job`) as
    :func:`flowexec.inductor.compile_graph` does, under the autocast state of ``settings``, in
    ``comp``'s open block (its kernels build until the block ends)."""
    from ..inductor import graph_of

    with contextlib.ExitStack() as stack:
        for device, (on, dtype) in settings["autocast"].items():
            if on:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        comp.compile_graph_of(job.key, graph_of(job.recipe), job.metas)  # (built as region_graph builds it)


def serve(answers_fd: int) -> None:
    """A worker's loop (module docstring); its answers go to ``answers_fd``."""
    from torch._inductor import async_compile

    from ..inductor import InductorCompiler, why_refused
    from .settings import apply_settings, registrations, registrations_differ

    inp = sys.stdin.buffer
    out = os.fdopen(answers_fd, "wb")

    def next_message() -> Any:
        try:
            return receive(inp.fileno())
        except EOFError:
            os._exit(0)  # (nothing to wait for: no one reads the answer)

    settings = next_message()
    apply_settings(settings)
    differ = registrations_differ(settings["registrations"], registrations())
    if differ is not None:
        send(out, f"Inductor's lowerings, fallbacks or decompositions differ in the process that sent the jobs "
                  f"(registered at run time: {differ}): a kernel built here would not be that process's")
        return
    from ..inductor_keys import keep_process_keys

    keep_process_keys(cpu=False)  # (before the pool, whose start computes torch_key)
    warm = getattr(async_compile, "maybe_warm_pool", None)
    if warm is not None and torch.cuda.is_available():
        warm()  # (Inductor's workers for Triton's builds, which go to them once they are up)
    send(out, "ready")
    comp = InductorCompiler()
    with comp.together() as late:
        while True:
            job = next_message()
            if job == FINISH:
                break
            try:
                compile_job(job, settings, comp)
                send(out, None)
            except Exception as e:
                send(out, why_refused(e))
    send(out, {key: comp.failures.get(key, "its kernels did not build") for key in late})
