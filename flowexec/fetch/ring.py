"""Asynchronous fetches: ``FetchRing.submit(t)`` starts copying a scalar to the host without
waiting and returns a :class:`Fetch` whose ``result()`` waits for that value alone.

On CUDA ``submit`` records an event on the producer stream, makes the ring's side stream wait on
it, and launches the copy kernel there into slot ``n % slots`` tagged with sequence ``n + 1``.
The ring holds the producer tensor until its value has been read, so the caching allocator cannot
hand its memory to later work before the copy ran (cheaper than ``record_stream``, which also
works only after the fact). A slot is reused only after its previous ``Fetch`` has been
materialised (waited for and decoded, value kept in the ``Fetch``), so each ``Fetch`` returns its
own step's value, also after wrap-around; ``result()`` from another thread and a wrapping
``submit`` agree through one lock. ``fence(stream)`` is ``stream.wait_stream(side)``. On CPU the
value is taken at ``submit``, or when ``ready`` is set.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext as _nullcontext
from typing import Any

import torch

from . import choose, settings
from .host import HostSlots
from .slots import SPECS, Number, Readiness, Slots, Spec, wait


class Fetch:
    """A scalar on its way to the host, returned by :meth:`FetchRing.submit`.

    ``result()`` waits for this value alone (never for the whole device) and returns it as a
    Python number; ``done()`` polls without waiting.

    >>> ring = FetchRing("cpu", slots=2)
    >>> f = ring.submit(torch.tensor(7))
    >>> f.done(), f.result()
    (True, 7)
    """

    __slots__ = ("_ring", "_slot", "_seq", "_spec", "_src", "_value", "_done", "label")

    def __init__(self, ring: FetchRing, slot: int, seq: int, spec: Spec, src: torch.Tensor,
                 label: str) -> None:
        self._ring, self._slot, self._seq, self._spec = ring, slot, seq, spec
        self._src: torch.Tensor | None = src  # held until copied: its memory can't be reused
        self._value: Number | None = None
        self._done = False
        self.label = label

    def done(self) -> bool:
        """True once ``result()`` would return without waiting."""
        # Re-read _done after polling: a slot reused meanwhile was materialised first.
        return self._done or self._ring._slots.ready(self._slot, self._seq) or self._done

    def result(self, timeout: float | None = None) -> Number:
        """The value; waits at most ``timeout`` s (default: the ring's), else FetchTimeoutError."""
        if not self._done:
            self._ring._materialize(self, timeout)
        return self._value  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = f"value={self._value!r}" if self._done else "pending"
        return f"Fetch({self.label!r}, slot {self._slot} of {self._ring!r}, {state})"


class FetchRing:
    """A ring of reused pinned slots for asynchronous scalar fetches on one device.

    ``submit(t)`` returns at once: on CUDA the copy runs on the ring's side stream, ordered after
    the producer stream's work so far (an event), and the ring holds ``t`` until its copy is
    done so the allocator can't hand its memory out early. A slot is reused only after its
    previous Fetch has been materialised, so every Fetch returns its own step's value, also after
    wrap-around. If the producer overwrites ``t`` in place later (a reused output buffer, a
    CUDA-graph static output), call ``fence()`` first. On CPU the value is taken at submit, or
    when ``ready`` (a ``threading.Event``-like object) is set.

    >>> ring = FetchRing("cpu", slots=4)
    >>> fs = [ring.submit(torch.tensor(float(i))) for i in range(10)]
    >>> [f.result() for f in fs][-3:]
    [7.0, 8.0, 9.0]
    """

    def __init__(self, device: torch.device | str | int = "cuda", slots: int = 64, *,
                 timeout: float | None = None, spin_us: float | None = None) -> None:
        if slots < 1:
            raise ValueError(f"a FetchRing needs at least one slot, got {slots}")
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"FetchRing supports cuda and cpu devices, got {dev}")
        self.device, self.slots = dev, slots
        self.timeout, self.spin_us = timeout, spin_us
        self._lock = threading.Lock()
        self._owners: list[Fetch | None] = [None] * slots
        self._count = 0
        if dev.type == "cuda":
            idx = dev.index
            self._slots: Slots = choose.make_slots(choose.chosen or choose.choose(idx), idx, slots)
            self._side = torch.cuda.Stream(device=idx)
            self._side_raw = self._side.cuda_stream
        else:
            self._slots = HostSlots(slots)

    def __repr__(self) -> str:
        return f"FetchRing({self.device}, {self.slots} slots, {self._slots.name})"

    def submit(self, tensor: torch.Tensor, *, stream: torch.cuda.Stream | None = None,
               ready: Readiness | None = None, label: str | None = None,
               timeout: float | None = None) -> Fetch:
        """Start fetching a one-element tensor; returns its :class:`Fetch` without waiting.

        ``stream``: the CUDA stream that produces ``tensor`` (default: the current one).
        ``ready``: CPU only, signals that a CPU producer has finished writing ``tensor``.
        Waits (at most ``timeout``) only if the slot it needs still holds an unread Fetch.
        """
        spec, t = self._prepare(tensor, stream, ready)
        with self._lock:
            n = self._count
            i = n % self.slots
            old = self._owners[i]
            if old is not None and not old._done:
                self._wait(old, timeout, f"{old!r} to free slot {i} for {label or f'fetch #{n}'}")
                self._finish(old)
            seq = n + 1
            if isinstance(self._slots, HostSlots):
                self._slots.put(i, t, ready)
            elif torch._C._cuda_getDevice() == self.device.index:
                self._copy(i, t, spec, seq, stream)
            else:
                with torch.cuda.device(self.device.index):
                    self._copy(i, t, spec, seq, stream)
            f = self._owners[i] = Fetch(self, i, seq, spec, t, label or f"fetch #{n}")
            self._count = n + 1
        return f

    def fence(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: current) wait until every copy submitted so far has read its
        source, so that it may overwrite those tensors. No-op on CPU."""
        if self.device.type == "cuda":
            (stream or torch.cuda.current_stream(self.device)).wait_stream(self._side)

    def drain(self, timeout: float | None = None) -> None:
        """Materialise every pending Fetch (oldest first)."""
        for f in sorted((f for f in self._owners if f is not None), key=lambda f: f._seq):
            f.result(timeout)

    @property
    def pending(self) -> int:
        """How many submitted Fetches have not been materialised yet."""
        return sum(1 for f in self._owners if f is not None and not f._done)

    # -- internals
    def _prepare(self, t: torch.Tensor, stream: Any, ready: Any) -> tuple[Spec, torch.Tensor]:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"FetchRing.submit expects a torch.Tensor, got {type(t).__name__}")
        if t.numel() != 1:
            t.item()  # raises .item()'s own error before any device work
        if t.device.type != self.device.type or (t.is_cuda and t.get_device() != self.device.index):
            raise ValueError(f"{self!r} cannot fetch a tensor on {t.device}")
        if ready is not None and t.is_cuda:
            raise ValueError("ready= is for CPU producers; pass stream= for a CUDA producer")
        if stream is not None and not t.is_cuda:
            raise ValueError("stream= is for CUDA tensors")
        spec = SPECS.get(t.dtype)
        if spec is None or t.layout is not torch.strided:
            raise TypeError(f"{self!r} cannot fetch a {t.layout} tensor of dtype {t.dtype}")
        if t.is_conj() or t.is_neg() or (t.is_cuda and t.data_ptr() % spec.align):
            # A lazy conj/neg view or a misaligned element: fetch a fresh copy, made on the
            # producer's stream so that the ordering event still covers it.
            with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                t = t.resolve_conj().resolve_neg().clone()
        return spec, t

    def _copy(self, i: int, t: torch.Tensor, spec: Spec, seq: int, stream: Any) -> None:
        prod = (stream.cuda_stream if stream is not None
                else torch._C._cuda_getCurrentRawStream(self.device.index))
        self._slots.order(self._side_raw, prod)  # the side stream waits for the producer
        self._slots.write(i, t, spec, seq, self._side_raw)

    def _poll(self, f: Fetch, _: Any) -> bool:
        return f._done or self._slots.ready(f._slot, f._seq)

    def _wait(self, f: Fetch, timeout: float | None, what: object) -> None:
        if timeout is None:
            timeout = settings.timeout_s if self.timeout is None else self.timeout
        spin = settings.spin_s if self.spin_us is None else self.spin_us * 1e-6
        check = self._slots.check
        wait(self._poll, f, None, timeout, spin, check, getattr(self, "_side_raw", 0), what)

    def _finish(self, f: Fetch) -> None:  # with self._lock held, after its slot is ready
        f._value = self._slots.read(f._slot, f._spec, f._src)
        f._done = True
        f._src = None

    def _materialize(self, f: Fetch, timeout: float | None) -> None:
        self._wait(f, timeout, f)
        with self._lock:
            if not f._done:
                self._finish(f)
