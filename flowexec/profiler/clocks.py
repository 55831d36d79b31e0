"""Clock offsets between ranks: a few ping-pong rounds with rank 0, keeping the lowest round trip.

Each rank ``r > 0`` sends its clock ``t0`` to rank 0, rank 0 answers with its own clock ``t1``
the moment it receives, and ``r`` notes ``t2`` when the answer arrives. If the two legs took
equally long, rank 0's clock read ``t1`` when this rank's read ``(t0 + t2) / 2``; the error is
at most half the round trip ``t2 - t0``, so the sample with the lowest round trip is kept
(queuing and scheduling only ever add delay). The offset is what to *add* to this rank's
times to put them on rank 0's clock; rank 0's is 0.

>>> choose_offset([(100, 5_000, 300), (1_000, 5_900, 1_040), (2_000, 9_000, 2_500)])
(4880, 40)
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch


def choose_offset(samples: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """``(offset_ns, rtt_ns)`` of the sample ``(t0, t1, t2)`` with the lowest round trip."""
    if not samples:
        raise ValueError("choose_offset needs at least one (t0, t1, t2) sample")
    t0, t1, t2 = min(samples, key=lambda s: s[2] - s[0])
    return t1 - (t0 + t2) // 2, t2 - t0


def host_id() -> int:
    """This machine's name as a 63-bit number (the same in every process on it)."""
    import hashlib
    import socket

    return int.from_bytes(hashlib.sha1(socket.gethostname().encode()).digest()[:8], "little") >> 1


def measure_offset(group: Any = None, rounds: int = 8, device: torch.device | str = "cpu") -> tuple[int, int, bool]:
    """This rank's ``(offset_ns, rtt_ns, same_host)`` to rank 0 of ``group`` (the default
    process group if None), by ``rounds`` ping-pongs; every rank of the group must call it.
    ``same_host``: rank 0 runs on this machine (its answers carry its :func:`host_id`).
    ``device``: where the 16-byte messages live (``cuda`` for NCCL). Rank 0 serves the others
    one after another.
    """
    import torch.distributed as dist

    if rounds < 1:
        raise ValueError(f"measure_offset needs rounds >= 1, got {rounds}")
    me, world = dist.get_rank(group), dist.get_world_size(group)
    glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    buf = torch.zeros(2, dtype=torch.int64, device=device)
    now = time.perf_counter_ns
    mine = host_id()
    if me == 0:
        for r in range(1, world):
            for _ in range(rounds):
                dist.recv(buf, glob(r), group=group)
                buf[0] = now()
                buf[1] = mine
                dist.send(buf, glob(r), group=group)
        return 0, 0, True
    samples = []
    theirs = None
    for _ in range(rounds):
        t0 = now()
        buf[0] = t0
        dist.send(buf, glob(0), group=group)
        dist.recv(buf, glob(0), group=group)
        t2 = now()
        t1, theirs = buf.tolist()
        samples.append((t0, t1, t2))
    return (*choose_offset(samples), theirs == mine)
