"""Run a function on several local processes joined in one ``torch.distributed`` group.

``torchrun`` does this across machines; ``spawn`` is the same on one machine for tests, the CLI
and benchmarks, with the promises the runtime keeps: every collective and transfer has a
timeout, a rank that fails stops the others and its error reaches the caller, and nothing hangs.
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


def _worker(rank: int, fn: Callable[..., Any], world: int, port: int, backend: str, timeout: float,
            args: tuple, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        # The store is the parent's (see spawn): a rank's posted failure outlives the rank.
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        out = io.BytesIO()  # tensors as bytes: a tensor shared through the queue dies with this process
        torch.save(fn(rank, world, *args), out)
        results.put((rank, True, out.getvalue()))
    except BaseException as e:  # the parent raises it with the rank's traceback
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
          timeout: float = 120.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns their results by rank.

    ``fn`` must be importable (defined at a module's top level). Transfers time out after
    ``timeout`` seconds, and the whole run after twice that.

    >>> spawn(_echo, 2)  # doctest: +SKIP
    [0, 1]
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    # The group's store lives here, not in rank 0 (as it would with MASTER_PORT alone): a rank
    # that fails posts its error there (stage.post_failure) and exits, and the others read it
    # when their waits break — rank 0's error too, whose store would have gone with it.
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    port = store.port
    procs = [ctx.Process(target=_worker, args=(r, fn, world, port, backend, timeout, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + 2 * timeout
    try:
        while len(got) < world:
            if not results.empty():
                rank, ok, value = results.get()
                if not ok:
                    raise PipelineError(f"rank {rank} failed: {value}")
                got[rank] = torch.load(io.BytesIO(value), weights_only=False)
                continue
            # A rank that ended without a result failed, whatever its exit code (os._exit(0) too);
            # read its exit status only once the queue holds nothing more from it.
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            if dead and results.empty():
                time.sleep(0.05)  # a result put just before the exit may still be in the pipe
                if results.empty():
                    raise PipelineError("rank(s) ended without a result: " + ", ".join(
                        f"rank {r} ({'signal ' + str(-c) if c < 0 else 'exit code ' + str(c)})" for r, c in dead))
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(got))
                raise PipelineError(f"ranks {missing} returned nothing within {2 * timeout:.0f} s")
            time.sleep(0.01)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


def _echo(rank: int, world: int) -> int:
    return rank
