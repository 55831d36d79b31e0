"""Every rank's records on one clock: rank 0's.

A span's times are on its rank's host clock (CUDA event times were anchored to it when the
timer read them, against one anchor per run); its ``offset_ns`` — measured by :mod:`.clocks` when
profiling started — takes them to rank 0's clock. Merging adds each span's offset and keeps
the ranks' headers.

>>> from .records import Span
>>> a = Span(0, "h0", 1, 0, 0, "F", 0, "compute", 1_000, 2_000, "host")
>>> b = Span(1, "h1", 2, 0, 1, "F", 0, "compute", 500, 900, "host", offset_ns=1_600)
>>> [(s.rank, s.start_ns, s.offset_ns) for s in merge_spans([b, a])]
[(0, 1000, 0), (1, 2100, 0)]
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Iterable

from .io import Header, read_records
from .records import Span


@dataclass(frozen=True)
class Merged:
    """All ranks' spans on rank 0's clock (``offset_ns`` 0), by rank then start, and each
    rank's header."""

    spans: tuple[Span, ...]
    headers: dict[int, Header]

    @property
    def ranks(self) -> list[int]:
        return sorted({s.rank for s in self.spans} | set(self.headers))

    def meta(self) -> dict:
        """The run's description (schedule, stages, micro-batches, theory): rank 0's header meta
        merged over the others'."""
        out: dict = {}
        for r in sorted(self.headers, reverse=True):
            out.update(self.headers[r].meta)
        return out


def merge_spans(spans: Iterable[Span]) -> tuple[Span, ...]:
    """The spans with their offsets applied, ordered by (rank, start, end)."""
    return tuple(sorted((s.shifted(s.offset_ns) if s.offset_ns else s for s in spans),
                        key=lambda s: (s.rank, s.start_ns, s.end_ns)))


def merge_dir(directory: str) -> Merged:
    """Read every ``*.jsonl`` records file in ``directory`` (one per rank) and merge them; a
    directory without records, or two files claiming one rank, is a ValueError naming them."""
    paths = sorted(glob.glob(os.path.join(directory, "*.jsonl")))
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: no such directory")
    if not paths:
        raise ValueError(f"{directory}: no records (*.jsonl) to merge")
    headers: dict[int, Header] = {}
    where: dict[int, str] = {}
    spans: list[Span] = []
    for p in paths:
        hdr, ss = read_records(p)
        if hdr.rank in headers:
            raise ValueError(f"{p} and {where[hdr.rank]} both hold rank {hdr.rank}'s records")
        headers[hdr.rank], where[hdr.rank] = hdr, p
        wrong = [s for s in ss if s.rank != hdr.rank]
        if wrong:
            raise ValueError(f"{p}: header says rank {hdr.rank} but a span says rank {wrong[0].rank}")
        spans += ss
    return Merged(merge_spans(spans), headers)
