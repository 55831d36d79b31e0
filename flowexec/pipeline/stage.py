"""Transfers between pipeline ranks: ``torch.distributed`` point-to-point (gloo on CPUs, NCCL on
GPUs), shapes agreed once, messages in a fixed order per channel, bounded waits.

A *channel* is one direction between two ranks (``src -> dst``). Its messages — a stage's
outputs for the next stage's forward, or a stage's input gradients for the previous stage's
backward — are numbered in the order the sender's plan produces them; every rank computes the
same numbering from the plan (:func:`channel_order`), the sender posts sends in that order and
the receiver posts its receives in that order too. That is what NCCL needs (it matches
point-to-point operations by order, not by tag); gloo also gets a tag per message. On NCCL the
two directions of a pair travel on two process groups so that a posted receive never queues a
send behind it on one NCCL stream.

Waits end after ``timeout`` seconds, or at once when a peer's connection closes, and then name
what they waited for and the error another rank posted to the group's store
(:func:`post_failure`).
"""
from __future__ import annotations

import datetime
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .launch import PipelineError
from .schedules import Job

# The dtypes a stage may send; a dtype's position is its code in the shape header, so new ones
# go at the end. float8 travels as its bytes (NCCL's send takes only the types it reduces).
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, n))
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
          torch.uint8, torch.int8, torch.int16, *_FLOAT8)
_MAX_TENSORS, _MAX_DIMS = 8, 8
_HEADER = 1 + _MAX_TENSORS * (2 + _MAX_DIMS)
_FAIL_KEY = "flowexec/pipeline/failure"

Spec = tuple[tuple[tuple[int, ...], torch.dtype], ...]  # per tensor: shape, dtype


@dataclass(frozen=True, slots=True)
class Message:
    """One message of a step: ``kind`` "act" (the input of ``stage``'s forward) or "grad" (the
    output gradients for ``stage``'s backward), of micro-batch ``micro``, on channel
    ``src -> dst`` at position ``pos``."""

    kind: str
    stage: int
    micro: int
    src: int
    dst: int
    pos: int

    def tags(self, n: int) -> tuple[int, ...]:
        """The tags of its ``n`` tensors (gloo matches on them; NCCL on the order)."""
        return tuple(self.pos * _MAX_TENSORS + i for i in range(n))


def spec_of(tensors: Sequence[torch.Tensor], what: str) -> Spec:
    """The shapes and dtypes of a stage's tensors (an error names what cannot travel)."""
    if not 1 <= len(tensors) <= _MAX_TENSORS:
        raise ValueError(f"{what}: a pipeline sends 1 to {_MAX_TENSORS} tensors between stages, got {len(tensors)}")
    out = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: element {i} is {type(t).__name__}; stages exchange tensors or tuples of tensors")
        if t.dtype not in DTYPES or t.dim() > _MAX_DIMS:
            raise ValueError(f"{what}: element {i} is {t.dtype} of {t.dim()} dims; a pipeline sends tensors of "
                             f"{', '.join(map(str, DTYPES))} with at most {_MAX_DIMS} dims")
        out.append((tuple(t.shape), t.dtype))
    return tuple(out)


def wire(t: torch.Tensor) -> torch.Tensor:
    """What a transfer sends or receives into for ``t``: ``t`` itself, or a byte view of it for
    the float8 dtypes (the same memory, so a receive into the view fills ``t``).

    >>> wire(torch.zeros(2, dtype=torch.float8_e4m3fn)).dtype
    torch.uint8
    """
    return t.view(torch.uint8) if t.dtype in _FLOAT8 else t


def encode_spec(spec: Spec) -> torch.Tensor:
    h = torch.zeros(_HEADER, dtype=torch.int64)
    h[0] = len(spec)
    for i, (shape, dtype) in enumerate(spec):
        o = 1 + i * (2 + _MAX_DIMS)
        h[o], h[o + 1] = DTYPES.index(dtype), len(shape)
        h[o + 2:o + 2 + len(shape)] = torch.tensor(shape, dtype=torch.int64)
    return h


def decode_spec(h: torch.Tensor) -> Spec:
    out = []
    for i in range(int(h[0])):
        o = 1 + i * (2 + _MAX_DIMS)
        ndim = int(h[o + 1])
        out.append((tuple(int(d) for d in h[o + 2:o + 2 + ndim]), DTYPES[int(h[o])]))
    return tuple(out)


def send_spec(spec: Spec, dst: int, group: Any, tag: int, device: torch.device) -> tuple[Any, torch.Tensor]:
    """Send ``spec`` as a shape header (on ``device``: NCCL sends device tensors); returns the
    work and the header, which must live until the work is done."""
    h = encode_spec(spec).to(device)
    return dist.isend(h, dst, group=group, tag=tag), h


def recv_spec(src: int, group: Any, tag: int, device: torch.device, wait_for: Callable[[Any], None]) -> Spec:
    """Receive a shape header from :func:`send_spec` (``wait_for(work)`` waits, with the
    caller's timeout and error text) and decode it (on CUDA, a host sync)."""
    h = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    wait_for(dist.irecv(h, src, group=group, tag=tag))
    return decode_spec(h.cpu())


def grad_spec(spec: Spec) -> Spec:
    """What travels back for a message of ``spec``: a gradient per floating tensor."""
    return tuple(s for s in spec if s[1].is_floating_point)


def channel_order(plan: dict[int, Sequence[Job]], owner: dict[int, int]) -> list[Message]:
    """Every cross-rank message of one step, numbered per channel in the sender's job order."""
    n_stages = len(owner)
    pos: dict[tuple[int, int], int] = {}
    out = []
    for r, jobs in sorted(plan.items()):
        for j in jobs:
            if j.kind == "F" and j.stage + 1 < n_stages:
                kind, stage = "act", j.stage + 1
            elif j.kind in ("B", "I") and j.stage > 0:
                kind, stage = "grad", j.stage - 1
            else:
                continue
            dst = owner[stage]
            if dst == r:
                continue  # a neighbour on the same rank: handed over in memory
            k = pos.get((r, dst), 0)
            pos[r, dst] = k + 1
            out.append(Message(kind, stage, j.micro, r, dst, k))  # type: ignore[arg-type]
    return out


def post_failure(rank: int, error: BaseException) -> None:
    """Tell the other ranks (through the group's store) that this rank failed, and why."""
    store = _store()
    if store is not None:
        try:
            if not store.check([_FAIL_KEY]):
                store.set(_FAIL_KEY, f"rank {rank} failed: {type(error).__name__}: {error}"[:4000])
        except Exception:  # the store may be gone with the group: the others time out instead
            pass


def posted_failure() -> str | None:
    store = _store()
    if store is None:
        return None
    try:
        return store.get(_FAIL_KEY).decode() if store.check([_FAIL_KEY]) else None
    except Exception:
        return None


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def wait(work: Any, what: str, rank: int, timeout: float) -> None:
    """Wait for a point-to-point ``work`` at most ``timeout`` seconds. A peer that failed (and
    posted why, :func:`post_failure`) or ended closes the connection, which ends the wait at
    once; either way the error names what this rank waited for and, when another rank posted
    one, that rank's error. (gloo's works report completion only through ``wait``, so there is
    nothing to poll.)"""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:
        failure = posted_failure()
        if failure is not None:
            raise PipelineError(f"rank {rank} stopped waiting for {what}: {failure}") from None
        raise PipelineError(f"rank {rank}: waiting for {what} failed within {timeout:g} s (a rank that ended or "
                            f"hangs, or a plan the ranks do not share): {type(e).__name__}: {str(e)[:300]}") from e


class SendThread:
    """Issues gloo sends off the compute thread, in the order they were handed over (the
    channel order). ``dist.isend`` on gloo can block the caller for milliseconds: it writes the
    message into the socket, which (the socket buffers being smaller than a message of a few
    hundred KiB) waits for the receiving process's gloo I/O thread to drain it, and on a loaded
    CPU that thread may wait for a core; it also takes the connection's lock, which the
    process's own I/O thread holds while it reads an incoming message. Here only this thread
    waits; the jobs go on. :meth:`drain` (the end of a step) returns the works issued so far.

    ``record``: stamp each ``isend`` call (its start and end on ``perf_counter_ns``, with the
    label handed over); :meth:`issued` returns and clears the stamps — the trainer turns them
    into ``isend`` spans, which show how long a message waited for this thread and its call.

    >>> t = SendThread(rank=0, timeout=5.0)
    >>> t.drain(), t.issued()
    ([], [])
    >>> t.close()
    """

    def __init__(self, rank: int, timeout: float, record: bool = False) -> None:
        self.rank, self.timeout = rank, timeout
        self.record = record
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._works: list[tuple[Any, torch.Tensor]] = []
        self._stamps: list[tuple[Any, int, int]] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="flowexec-pipeline-send", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        clock = time.perf_counter_ns
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            t, dst, group, tag, label = item
            try:
                t0 = clock() if self.record else 0
                self._works.append((dist.isend(t, dst, group=group, tag=tag), t))
                if t0:
                    self._stamps.append((label, t0, clock()))
            except BaseException as e:  # raised on the compute thread at drain()
                if self._error is None:
                    self._error = e

    def send(self, t: torch.Tensor, dst: int, group: Any, tag: int, label: Any = None) -> None:
        self._q.put((t, dst, group, tag, label))

    def issued(self) -> list[tuple[Any, int, int]]:
        """``(label, start_ns, end_ns)`` of every ``isend`` call recorded since the last call
        (complete after :meth:`drain`)."""
        out, self._stamps = self._stamps, []
        return out

    def drain(self) -> list[tuple[Any, torch.Tensor]]:
        """Wait (at most ``timeout`` s) until every handed-over send is issued; its works."""
        done = threading.Event()
        self._q.put(done)
        if not done.wait(self.timeout):
            failure = posted_failure()
            raise PipelineError(f"rank {self.rank}: a send was not issued within {self.timeout:g} s"
                                + (f": {failure}" if failure else ""))
        if self._error is not None:
            e, self._error = self._error, None
            failure = posted_failure()
            raise PipelineError(f"rank {self.rank}: a send failed: "
                                + (failure or f"{type(e).__name__}: {str(e)[:300]}")) from e
        works, self._works = self._works, []
        return works

    def close(self) -> None:
        self._q.put(None)
