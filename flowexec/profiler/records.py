"""The one record type of flowexec's timeline: a timed span.

Every timer (pipeline jobs, transfers, instructions) writes :class:`Span` records; merging across
ranks and hosts and the exporters (Trace Event Format, the HTML page) read only these.

>>> s = Span(rank=0, host="h", pid=1, step=0, stage=1, kind="F", micro=3, stream="compute",
...          start_ns=1_000, end_ns=4_000, clock="host")
>>> s.duration_ns, s.label
(3000, '1F3')
"""
from __future__ import annotations

from dataclasses import dataclass

JOB_KINDS = ("F", "B", "I", "W", "OPT")
TRANSFER_KINDS = ("send", "recv")
CLOCKS = ("host", "cuda")


@dataclass(frozen=True, slots=True)
class Span:
    """One timed span on one rank.

    ``start_ns``/``end_ns`` are on the rank's host clock (``perf_counter_ns``) — CUDA event times
    are anchored to it when they are read — and ``offset_ns`` is what to add to reach rank 0's
    clock (0 on one host). ``clock`` says where the times were measured: ``"cuda"`` (events on
    the stream that ran the work) or ``"host"``. ``issue_ns`` is when the host issued the work.
    """

    rank: int
    host: str
    pid: int
    step: int
    stage: int | None
    kind: str            # "F" "B" "I" "W" "OPT" | "send" "recv" | "wait" | "step" | an op name
    micro: int | None
    stream: str          # "compute" | "comm" | "wait" | a stream name
    start_ns: int
    end_ns: int
    clock: str           # "host" | "cuda"
    offset_ns: int = 0
    issue_ns: int | None = None
    peer: int | None = None
    tag: int | None = None
    name: str | None = None

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def label(self) -> str:
        """``1F3`` for a job (stage, kind, micro-batch); the name or kind otherwise."""
        if self.kind in JOB_KINDS and self.stage is not None and self.micro is not None:
            return f"{self.stage}{self.kind}{self.micro}"
        return self.name or self.kind
