"""The records file: one JSON object per line, a header first, then one line per span.

Each rank writes its own file (``rank0.jsonl``, ``rank1.jsonl`` … in one directory); the
merge reads them all. The format is versioned (``SCHEMA_VERSION``) and documented in
docs/timeline.md::

    {"schema": "flowexec-timeline", "version": 1, "type": "header", "rank": 0, "host": "h", "pid": 7,
     "clock_offset_ns": 0, "clock_rtt_ns": 0, "meta": {"schedule": "1f1b", "theory_bubble": 0.11}}
    {"type": "span", "rank": 0, "host": "h", "pid": 7, "step": 10, "stage": 0, "kind": "F", "micro": 3, ...}

A reader accepts any file of the same ``version`` (fields added since are ignored) and refuses
another version with an error naming the file.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> s = Span(0, "h", 1, 0, 0, "F", 0, "compute", 0, 5, "host")
>>> p = RecordWriter(os.path.join(d, "rank0.jsonl"), Header(rank=0, host="h", pid=1)).write([s]).close()
>>> hdr, spans = read_records(p)
>>> hdr.rank, spans == [s]
(0, True)
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from .records import SCHEMA, SCHEMA_VERSION, Span


@dataclass(frozen=True)
class Header:
    """What one rank's file says about the rank: who it is, its clock's offset to rank 0 (add it
    to this rank's times to reach rank 0's clock) and the round trip that offset was measured
    over (``clock_offset_measured_ns``: the estimate itself, kept where it is not applied — a
    rank on rank 0's machine shares its clock), and free-form ``meta`` (schedule, stages,
    micro-batches, the schedule's theoretical bubble)."""

    rank: int
    host: str
    pid: int
    clock_offset_ns: int = 0
    clock_rtt_ns: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    clock_offset_measured_ns: int | None = None  # the ping-pong estimate (0 applied on rank 0's host)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "version": SCHEMA_VERSION, "type": "header", **asdict(self)}


def rank_file(directory: str, rank: int) -> str:
    """Where rank ``rank`` writes its records in ``directory``."""
    return os.path.join(directory, f"rank{rank}.jsonl")


class RecordWriter:
    """Appends spans to one rank's records file, header first; :meth:`write` flushes each call
    (a step at a time), so a run that dies keeps the steps it finished."""

    def __init__(self, path: str, header: Header) -> None:
        self.path = path
        self._f = open(path, "w")
        self._f.write(json.dumps(header.to_dict()) + "\n")
        self._f.flush()

    def write(self, spans: Iterable[Span]) -> "RecordWriter":
        self._f.write("".join(json.dumps({"type": "span", **s.to_dict()}) + "\n" for s in spans))
        self._f.flush()
        return self

    def close(self) -> str:
        self._f.close()
        return self.path


def write_records(path: str, header: Header, spans: Iterable[Span]) -> str:
    """Write a whole records file at once; returns ``path``."""
    return RecordWriter(path, header).write(spans).close()


def read_records(path: str) -> tuple[Header, list[Span]]:
    """One rank's header and spans; a file that is not a records file, or of another schema
    version, is a ValueError naming the file and line."""
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: empty; expected a flowexec timeline header line")
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:1: not JSON ({e})") from None
    if not isinstance(head, dict) or head.get("schema") != SCHEMA or head.get("type") != "header":
        raise ValueError(f"{path}:1: not a flowexec timeline records file (no {SCHEMA!r} header)")
    if head.get("version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: records of schema version {head.get('version')}; this flowexec reads "
                         f"version {SCHEMA_VERSION}")
    try:
        header = Header(**{k: head[k] for k in ("rank", "host", "pid")},
                        **{k: head[k] for k in ("clock_offset_ns", "clock_rtt_ns", "meta", "clock_offset_measured_ns")
                           if k in head})
    except KeyError as e:
        raise ValueError(f"{path}:1: header lacks {e}") from None
    spans = []
    for no, ln in enumerate(lines[1:], start=2):
        try:
            d = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{no}: not JSON ({e})") from None
        if d.get("type") != "span":
            continue  # other record types a later minor version may add
        try:
            spans.append(Span.from_dict(d))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}:{no}: {e}") from None
    return header, spans
