"""Which runner a plan gets: :func:`lower_for`.

Trace mode (one stream, or several CUDA streams) is the straight-line runner that
:func:`~flowexec.runtime.interpreter.lower_trace` generates. Plans whose streams are worker
threads — CPU streams, and threaded mode — run on :mod:`flowexec.runtime.cpu_streams`'s workers.
This module sits above both, so that lowering, CUDA streams and CPU streams depend on each
other in one direction only (cpu_streams → interpreter → streams).

Threaded mode (``mode="threaded"``): one worker thread per stream, ops dispatched by dependency
counts. Each side stream's worker is handed its precomputed list of items once per call (one
append per stream, no per-op work on the caller's thread), and the caller's thread runs stream
0's list itself (a thread hop less, and it would only wait otherwise). An op's count is the
number of its cross-stream dependencies still unmet — the plan's pruned waits; each is met when
the worker of the recording stream has run the op before the record (on CUDA: launched it and
recorded a CUDA event, which the waiting stream also waits on, so the device keeps the order
too). Dependencies on the same stream are met by the list's order. Workers spin ~200 µs
(yielding the GIL; ``spin_us``) and then block; every wait has a timeout (``wait_timeout``,
seconds) whose error names the instruction, and an op's exception reaches the caller naming
the op and the user's line.

Where it can pay: independent branches of ops that release the GIL for long enough (matrix
products of a few hundred rows and up on the CPU, one intra-op thread per worker) on cores
that nothing else uses; ``benchmarks/streams.py --device cpu`` measures it against trace mode
with one and two intra-op threads (on a shared, loaded 2-core machine it measured slower).
Where it does not: small ops (each costs a queue hop and, across streams, an event) and CUDA
programs bound by launch time (launches from several threads contend for the GIL and the
driver; trace mode issues them faster from one thread).

Example::

    >>> import torch, flowexec
    >>> ws = [torch.randn(64, 64) for _ in range(2)]
    >>> f = lambda x: (x @ ws[0]).relu() + (x @ ws[1]).tanh()
    >>> exe = flowexec.compile(f, torch.randn(8, 64), mode="threaded", streams=2)
    >>> x = torch.randn(8, 64)
    >>> torch.allclose(exe(x), f(x), atol=1e-6)
    True
"""
from __future__ import annotations

from typing import Any, Callable

from ..plan import ExecutionPlan
from .cpu_streams import DEFAULT_SPIN_US, DEFAULT_TIMEOUT_S, lower_workers
from .interpreter import lower_trace


def lower_for(plan: ExecutionPlan, mode: str, spin_us: float | None = None,
              timeout_s: float | None = None,
              hooks: dict[int, Callable[[], None]] | None = None) -> Callable[..., list[Any]]:
    """The runner for ``plan`` in ``mode``: threaded mode and CPU streams run on worker threads,
    everything else is the trace runner (CUDA streams where the plan has several; ``hooks``:
    see :func:`~flowexec.runtime.interpreter.lower_trace`, trace runners only)."""
    if not plan.on_workers:
        return lower_trace(plan, hooks=hooks)
    if hooks:
        raise ValueError("lower_for: hooks are for the trace runner (this plan runs on worker threads)")
    return lower_workers(plan, issue="lists" if mode == "threaded" else "host",
                         spin_us=DEFAULT_SPIN_US if spin_us is None else spin_us,
                         timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
