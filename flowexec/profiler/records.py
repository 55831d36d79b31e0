"""The one record type of flowexec's timeline: a timed span.

Every timer (pipeline jobs, transfers, instructions) writes :class:`Span` records; merging across
ranks and hosts and the exporters (Trace Event Format, the HTML page) read only these.

>>> s = Span(rank=0, host="h", pid=1, step=0, stage=1, kind="F", micro=3, stream="compute",
...          start_ns=1_000, end_ns=4_000, clock="host")
>>> s.duration_ns, s.label
(3000, '1F3')
"""
from __future__ import annotations

from typing import Any, NamedTuple

JOB_KINDS = ("F", "B", "I", "W", "OPT")
TRANSFER_KINDS = ("send", "recv")
CLOCKS = ("host", "cuda")
SCHEMA = "flowexec-timeline"
SCHEMA_VERSION = 1  # bump when a field changes meaning; adding a field with a default does not


class Span(NamedTuple):
    """One timed span on one rank (a named tuple: immutable, and built in a fraction of a frozen
    dataclass's time — a timer makes one per job and transfer).

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

    def shifted(self, delta_ns: int) -> "Span":
        """The same span ``delta_ns`` later (issue time too), offset folded in (``offset_ns=0``)."""
        return self._replace(start_ns=self.start_ns + delta_ns, end_ns=self.end_ns + delta_ns,
                             issue_ns=None if self.issue_ns is None else self.issue_ns + delta_ns, offset_ns=0)

    def to_dict(self) -> dict[str, Any]:
        """The span as one JSON object (the ``span`` line of the records file; see docs/timeline.md)."""
        return dict(zip(_NAMES, self))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Span":
        """The inverse of :meth:`to_dict`; a missing or mistyped field is a ValueError naming it.
        Unknown fields (written by a newer minor version) are ignored."""
        kw = {}
        for name in _NAMES:
            if name in d:
                kw[name] = d[name]
            elif name in _REQUIRED:
                raise ValueError(f"span record lacks field {name!r}: {d}")
        for name in ("rank", "pid", "step", "start_ns", "end_ns", "offset_ns"):
            if name in kw and not isinstance(kw[name], int):
                raise ValueError(f"span field {name!r} must be an integer, got {kw[name]!r}")
        if kw["end_ns"] < kw["start_ns"]:
            raise ValueError(f"span ends before it starts: {d}")
        if kw["clock"] not in CLOCKS:
            raise ValueError(f"span field 'clock' must be one of {CLOCKS}, got {kw['clock']!r}")
        return Span(**kw)


_NAMES = Span._fields
_REQUIRED = set(_NAMES) - set(Span._field_defaults)  # no default: must be present
