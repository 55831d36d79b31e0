"""The objects a multi-stream trace runner calls: side streams, events, fork and join.

The runner that ``lower_trace`` generates for a plan with ``n_streams > 1`` switches streams,
records and waits on events and marks cross-stream frees through one of these, so that the
same generated code runs on CUDA (:class:`CudaStreams`) and under a recording stand-in on the
CPU (tests check there that every dependency is ordered by what the code actually does).

Stream 0 is the caller's current stream at each call: on entry every side stream waits on an
event recorded there (inputs are ready), and before returning the caller's stream waits on
an event recorded on every side stream (outputs, in-place writes and pending reads are done).
Inside CUDA-graph capture this fork and join are what make the side streams part of the graph.

Example (needs CUDA)::

    >>> import torch, flowexec  # doctest: +SKIP
    >>> ws = [torch.randn(256, 256, device="cuda") for _ in range(4)]  # doctest: +SKIP
    >>> f = lambda x: sum((x @ w).relu() for w in ws)  # doctest: +SKIP
    >>> exe = flowexec.compile(f, torch.randn(8, 256, device="cuda"), mode="graph", streams=4)  # doctest: +SKIP
    >>> exe.plan.stats()["streams"]  # doctest: +SKIP
    4
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..errors import OptionError
from ..passes.streams import cuda_devices

_SIDE: dict[int, list[torch.cuda.Stream]] = {}


def side_streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """The first ``count`` of the side streams every plan on ``device`` shares.

    Shared because cuBLAS keeps a workspace per (handle, stream) for the life of the process
    (32 MiB on the H200): streams of their own per compiled program would leave one behind for
    each. Sharing is safe: a run forks them from its caller's stream and joins them back, so
    runs that follow each other on the host are ordered through that stream.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool = _SIDE.setdefault(index, [])
    while len(pool) < count:
        pool.append(torch.cuda.Stream(device=index))
    return pool[:count]


class CudaStreams:
    """The side streams (shared, :func:`side_streams`) and ``n_events`` events of one plan."""

    def __init__(self, n_streams: int, n_events: int, device: torch.device) -> None:
        self.device = device
        self.side = [None] + side_streams(device, n_streams - 1)
        self.events = [torch.cuda.Event() for _ in range(n_events)]
        self._entry = torch.cuda.Event()
        self._exit = [torch.cuda.Event() for _ in range(n_streams)]

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def begin(self) -> Any:
        """What :meth:`end` restores: the current device and the caller's stream."""
        return torch.cuda.current_device(), self.current()

    def abort(self, token: Any) -> None:
        """After an op failed: the caller's stream waits on the side streams (what they were
        given stays ordered for the caller), then :meth:`end`. A join that fails too (the op
        broke a graph capture) is left out: the op's error is the one to raise."""
        with contextlib.suppress(Exception):
            self.join(token[1])
        self.end(token)

    def end(self, token: Any) -> None:
        device, s0 = token
        torch.cuda.set_stream(s0)  # which also makes s0's device current
        if torch.cuda.current_device() != device:
            torch.cuda.set_device(device)

    def set(self, stream: Any) -> None:
        torch.cuda.set_stream(stream)

    def fork(self, s0: Any) -> None:
        self._entry.record(s0)
        for s in self.side[1:]:
            s.wait_event(self._entry)

    def join(self, s0: Any) -> None:
        for k, s in enumerate(self.side[1:], 1):
            self._exit[k].record(s)
            s0.wait_event(self._exit[k])

    @staticmethod
    def record_stream(t: Any, stream: Any) -> None:
        # Dynamo's graphs mix in CPU tensors (lifted constants); their memory is not stream-ordered
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


def device_of(plan: Any) -> torch.device:
    """The CUDA device a multi-stream plan runs on (its tensors'); an error where it has none."""
    devices = cuda_devices(plan.program)
    if len(devices) != 1:
        found = ", ".join(sorted(map(str, devices))) or "no CUDA tensor"
        raise OptionError(f"streams > 1 runs ops on CUDA streams of one device; this program has {found}")
    return devices.pop()
