"""Run a function on several local processes joined in one ``torch.distributed`` group.

``torchrun`` does this across machines; ``spawn`` is the same on one machine for tests, the CLI
and benchmarks, with the promises the runtime keeps: every collective and transfer has a
timeout, a rank that fails stops the others and its error reaches the caller, and nothing hangs.
:class:`Ranks` keeps such processes for several runs (tests and benchmark rounds): starting a
rank (a Python process importing torch) costs seconds on a small machine; a run costs what its
function does.
"""
from __future__ import annotations

import datetime
import io
import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class PipelineError(RuntimeError):
    """A rank failed or the run timed out; the message names the rank and its error."""


def _worker(rank: int, world: int, port: int, backend: str, timeout: float, jobs: Any, results: Any) -> None:
    """One rank: join the group, then run each job from ``jobs`` until ``None`` comes."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        # The store is the parent's (see Ranks): a rank's posted failure outlives the rank.
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        while (job := jobs.get()) is not None:
            fn, args = job
            out = io.BytesIO()  # tensors as bytes: a tensor shared through the queue dies with this process
            torch.save(fn(rank, world, *args), out)
            results.put((rank, True, out.getvalue()))
    except BaseException as e:  # the parent raises it with the rank's traceback
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Ranks:
    """``world`` spawned processes in one process group (gloo by default), kept for several runs.

    ``run(fn, *args)`` calls ``fn(rank, world, *args)`` on every rank and returns the results by
    rank. A rank that fails (or ends, or a run past twice ``timeout``) raises
    :class:`PipelineError` naming it and closes the ranks: the group is not to be trusted after
    that. Runs share the processes' state (their process groups, threads, seeds), so a run's
    function sets up what it needs. ``fn`` must be importable (defined at a module's top level).

    >>> with Ranks(2) as ranks:  # doctest: +SKIP
    ...     ranks.run(_echo), ranks.run(_echo)
    ([0, 1], [0, 1])
    """

    def __init__(self, world: int, backend: str = "gloo", timeout: float = 120.0) -> None:
        self.world, self.timeout = world, timeout
        ctx = mp.get_context("spawn")
        self._results = ctx.SimpleQueue()
        self._jobs = [ctx.SimpleQueue() for _ in range(world)]
        # The group's store lives here, not in rank 0 (as it would with MASTER_PORT alone): a rank
        # that fails posts its error there (stage.post_failure) and exits, and the others read it
        # when their waits break — rank 0's error too, whose store would have gone with it.
        self._store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=timeout))
        self._procs = [ctx.Process(target=_worker, args=(r, world, self._store.port, backend, timeout, self._jobs[r],
                                                          self._results), daemon=True) for r in range(world)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, last: bool = False) -> list[Any]:
        """``fn(rank, world, *args)`` on every rank; their results by rank. The run fails after
        twice ``timeout`` (default: the group's). ``last``: each rank ends as soon as its part is
        done, as a lone run's would: a rank that ends closes its connections, which ends a peer's
        wait for it at once (a kept rank's peer waits until its posted failure is read)."""
        if not self._procs:
            raise PipelineError("these ranks were closed (a run failed, or close() was called)")
        for q in self._jobs:
            q.put((fn, args))
            if last:
                q.put(None)
        try:
            return self._collect(2 * (timeout or self.timeout))
        except BaseException:
            self.close()
            raise

    def _collect(self, limit: float) -> list[Any]:
        deadline = time.monotonic() + limit
        got: dict[int, Any] = {}
        while len(got) < self.world:
            if not self._results.empty():
                rank, ok, value = self._results.get()
                if not ok:
                    raise PipelineError(f"rank {rank} failed: {value}")
                got[rank] = torch.load(io.BytesIO(value), weights_only=False)
                continue
            # A rank that ended without a result failed, whatever its exit code (os._exit(0) too);
            # read its exit status only once the queue holds nothing more from it.
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None and r not in got]
            if dead and self._results.empty():
                time.sleep(0.05)  # a result put just before the exit may still be in the pipe
                if self._results.empty():
                    raise PipelineError("rank(s) ended without a result: " + ", ".join(
                        f"rank {r} ({'signal ' + str(-c) if c < 0 else 'exit code ' + str(c)})" for r, c in dead))
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - set(got))
                raise PipelineError(f"ranks {missing} returned nothing within {limit:.0f} s")
            time.sleep(0.01)
        return [got[r] for r in range(self.world)]

    @property
    def closed(self) -> bool:
        return not self._procs

    def close(self) -> None:
        """End the ranks. They are killed: a run's results are all in (or it failed), and leaving
        the group cleanly costs seconds of gloo's teardown for nothing."""
        procs, self._procs = self._procs, []
        for p in procs:
            p.kill()
        for p in procs:
            p.join()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
          timeout: float = 120.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` new processes; returns their results by rank.

    ``fn`` must be importable (defined at a module's top level). Transfers time out after
    ``timeout`` seconds, and the whole run after twice that.

    >>> spawn(_echo, 2)  # doctest: +SKIP
    [0, 1]
    """
    with Ranks(world, backend, timeout) as ranks:
        return ranks.run(fn, *args, last=True)


def _echo(rank: int, world: int) -> int:
    return rank
