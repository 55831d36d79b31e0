"""Recording chosen steps of a run: one rank's timer per step, written to its records file.

:class:`StepProfiler` is what a trainer holds when profiling is on: built on every rank at the
same point (it measures this rank's clock offset to rank 0 then, a collective over the process
group), it hands out a :class:`~.timers.JobTimer` for a step that is to be recorded and
:data:`~.timers.NULL_TIMER` for one that is not, and at the step's end flushes the timer (which
never waits: on CUDA a step's spans may come a step late); after the last step of a run of
recorded steps it finishes the timer (one synchronisation, between steps). The spans wait in memory and are written to ``DIR/rank<r>.jsonl`` after
the last step of each run of recorded steps (``range(10, 13)``: after step 12, before step 13
begins) and at :meth:`close`, so that writing (tens of µs per span) never lands inside a
recorded step.

>>> import tempfile, torch
>>> d = tempfile.mkdtemp()
>>> prof = StepProfiler(d, steps=[1], device="cpu", meta={"schedule": "1f1b"})
>>> for k in range(3):
...     with prof.step(k) as t:
...         t.end(t.begin(step=k, stage=0, kind="F", micro=0))
>>> from .io import read_records
>>> [s.step for s in read_records(prof.close())[1]]
[1]
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, Container, Iterator

import torch

from .io import Header, RecordWriter, rank_file
from .timers import FLUSH_BATCH, NULL_TIMER, JobTimer


class _AllSteps:
    """The container of every step (``StepProfiler(..., steps=ALL_STEPS)``)."""

    def __contains__(self, step: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "ALL_STEPS"


ALL_STEPS = _AllSteps()


class StepProfiler:
    """Records the steps in ``steps`` (any container: ``range(10, 13)``) into ``directory``."""

    def __init__(self, directory: str, steps: Container[int], *, device: torch.device | str = "cpu",
                 rank: int | None = None, group: Any = None, meta: dict[str, Any] | None = None,
                 sync_clocks: bool | None = None) -> None:
        import torch.distributed as dist

        joined = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank(group) if joined else 0)
        self.steps = steps
        self.device = torch.device(device)
        offset = rtt = 0
        measured = None
        self.host = socket.gethostname()
        if sync_clocks if sync_clocks is not None else (joined and dist.get_world_size(group) > 1):
            from .clocks import measure_offset

            measured, rtt, same_host = measure_offset(group, device=self.device if dist.get_backend(group) == "nccl"
                                                      else "cpu")
            # Processes on rank 0's machine read the same monotonic clock: an estimate could only
            # add its error (up to half a round trip) there. Other machines take the estimate.
            offset = 0 if same_host else measured
        self.timer_ = JobTimer(self.device, rank=self.rank, host=self.host, offset_ns=offset, batch=FLUSH_BATCH)
        os.makedirs(directory, exist_ok=True)
        self._writer = RecordWriter(rank_file(directory, self.rank),
                                    Header(self.rank, self.host, os.getpid(), offset, rtt, dict(meta or {}),
                                           measured))
        self.recorded: list[int] = []
        self._pending: list[Any] = []

    def timer(self, step: int) -> Any:
        """The timer to use in ``step``: a real one if the step is recorded, else NULL_TIMER."""
        return self.timer_ if step in self.steps else NULL_TIMER

    def add(self, step: int, spans: list[Any]) -> None:
        """Record spans timed elsewhere (on this rank's host clock) with ``step``'s, if it is recorded."""
        if step in self.steps:
            self._pending += spans
            if step + 1 not in self.steps:
                self._write()

    def _write(self) -> None:
        self._pending += self.timer_.finish()  # the spans of the run's last steps, still on the device
        self._writer.write(self._pending)
        self._pending = []

    def end_step(self, step: int) -> None:
        """After ``step``'s work was issued: read its times and append them to the file."""
        if step in self.steps:
            self._pending += self.timer_.flush()
            self.recorded.append(step)
            if step + 1 not in self.steps:
                self._write()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[Any]:
        """``with prof.step(k) as timer:`` — the timer for step ``k``, flushed at the end."""
        yield self.timer(step)
        self.end_step(step)

    def close(self) -> str:
        """Write what is pending and close the records file; returns its path."""
        self._write()
        return self._writer.close()
