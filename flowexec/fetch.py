"""Low-latency scalar readback and asynchronous fetches.

``fast_item(t)`` returns ``t.item()`` faster on CUDA; ``FetchRing.submit(t)`` starts copying a
scalar to the host without waiting and returns a :class:`Fetch` whose ``result()`` waits for that
value alone. Every wait spins briefly, then sleeps with back-off, and raises
:class:`FetchTimeoutError` naming what it waited for instead of hanging.

How a CUDA value comes back (``backend()`` names the path in use; docs/fetch.md has the
measurements behind the order):

* ``graph+<launcher>`` (fast_item only): a one-thread PTX kernel copies the element into a
  32-byte host-mapped pinned slot, then writes a flag behind a system fence; the host spins on
  the flag. Each (address, dtype) read twice within the last 256 new addresses gets its own
  captured CUDA graph of that kernel, replayed with ``cuGraphLaunch`` (measured cheaper than
  ``cuLaunchKernel`` on the H200 machine; through cupy's Cython ``runtime.graphLaunch`` for
  ``graph+cupy``); first sightings launch the kernel directly. Graphs of elements of <= 4 bytes
  use ``fx_ll``: payload and flag in one 8-byte store, no fence (0.6 µs less on the H200).
* ``kernel+<launcher>``: the same kernel launched with ``cuLaunchKernel`` every time (through
  cupy's Cython binding, cuda.bindings, or ctypes), a sequence number instead of the flag.
  FetchRing always uses this (its slot changes with every submit).
* ``memcpy``: ``cuMemcpyDtoHAsync`` into the pinned slot plus an event, spun on with
  ``cuEventQuery`` (the copy engine's round trip).
* ``torch``: ``copy_(non_blocking=True)`` into pinned memory plus a ``torch.cuda.Event``; needs
  nothing beyond torch.

The first CUDA use picks the first path that loads and reads back known values correctly
(``FLOWEXEC_FETCH_BACKEND`` or :func:`configure` force one). Slots are allocated once per
thread (``fast_item``) or per ring (``FetchRing``) and reused.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time
import warnings
from contextlib import nullcontext as _nullcontext
from collections.abc import Callable
from typing import Any, Protocol, Union

import torch

__all__ = ["fast_item", "Fetch", "FetchRing", "FetchTimeoutError", "backend", "configure"]

Number = Union[bool, int, float, complex]
_now = time.perf_counter
_SLOT = 32  # bytes per slot: 16 of payload, the sequence number at +16, 8 spare


class FetchTimeoutError(TimeoutError):
    """A wait for a fetched value ran past its timeout; the message names what was waited for."""


class Readiness(Protocol):
    """What a CPU producer hands to ``FetchRing.submit(ready=...)``; ``threading.Event`` fits."""

    def is_set(self) -> bool: ...


# ---------------------------------------------------------------- settings
_timeout_s = float(os.environ.get("FLOWEXEC_FETCH_TIMEOUT_S", "300"))
_spin_s = float(os.environ.get("FLOWEXEC_FETCH_SPIN_US", "200")) * 1e-6
_backend_request = os.environ.get("FLOWEXEC_FETCH_BACKEND", "auto")
_LAUNCHERS = ("cupy", "ctypes", "bindings")  # "auto" order: measured fastest first (docs/fetch.md)


def configure(
    *, timeout: float | None = None, spin_us: float | None = None, backend: str | None = None
) -> dict[str, Any]:
    """Set process-wide defaults; returns the previous ones (pass them back to restore).

    ``timeout`` (s) bounds every wait, ``spin_us`` is how long a wait busy-polls before it sleeps,
    ``backend`` is ``"auto"``, ``"graph"``, ``"kernel"``, one of ``"graph+cupy"``,
    ``"graph+bindings"``, ``"graph+ctypes"``, ``"kernel+cupy"``, ``"kernel+bindings"``,
    ``"kernel+ctypes"``, or ``"memcpy"`` or ``"torch"`` (takes effect for new readers and rings).

    >>> old = configure(spin_us=50)
    >>> _ = configure(**old)
    """
    global _timeout_s, _spin_s, _backend_request, _chosen, _tls
    old = {"timeout": _timeout_s, "spin_us": _spin_s * 1e6, "backend": _backend_request}
    if timeout is not None:
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 s, got {timeout}")
        _timeout_s = float(timeout)
    if spin_us is not None:
        if spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        _spin_s = float(spin_us) * 1e-6
    if backend is not None and backend != _backend_request:
        _candidates(backend)  # validates the name
        _backend_request, _chosen, _tls = backend, None, _Local()
    return old


# ---------------------------------------------------------------- decoding a slot
class _SlotView:
    """ctypes views of one slot at a fixed host address, built once and read many times."""

    __slots__ = ("b", "i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64", "f32", "f64",
                 "f32_hi", "f64_hi", "raw", "seq", "_bits", "_f")

    def __init__(self, addr: int) -> None:
        c = ctypes
        self.b, self.i8, self.u8 = (t.from_address(addr) for t in (c.c_bool, c.c_int8, c.c_uint8))
        self.i16, self.u16 = c.c_int16.from_address(addr), c.c_uint16.from_address(addr)
        self.i32, self.u32 = c.c_int32.from_address(addr), c.c_uint32.from_address(addr)
        self.i64, self.u64 = c.c_int64.from_address(addr), c.c_uint64.from_address(addr)
        self.f32, self.f64 = c.c_float.from_address(addr), c.c_double.from_address(addr)
        self.f32_hi, self.f64_hi = c.c_float.from_address(addr + 4), c.c_double.from_address(addr + 8)
        self.raw = (c.c_char * 16).from_address(addr)
        self.seq = c.c_uint64.from_address(addr + 16)
        self._bits = c.c_uint32()  # bfloat16 scratch: the high half of a float32
        self._f = c.c_float.from_buffer(self._bits)


def _bf16(v: _SlotView) -> float:
    v._bits.value = v.u16.value << 16
    return v._f.value


_HALF, _HALF2 = struct.Struct("<e"), struct.Struct("<ee")


def _fp8(dtype: torch.dtype) -> Callable[[_SlotView], float]:
    table: list[float] = []

    def decode(v: _SlotView) -> float:
        if not table:  # 256 entries, converted by torch itself so they match .item()
            table.extend(torch.arange(256, dtype=torch.uint8).view(dtype).double().tolist())
        return table[v.u8.value]

    return decode


class _Spec:
    """How to read one dtype: element size, decoder, alignment, ``lazy``: which lazy-view bits a
    tensor of it can carry (0 none, 1 negative, 2 negative or conjugate), and ``field``: the
    :class:`_SlotView` cell whose ``.value`` already is ``.item()``'s answer (None: decode)."""

    __slots__ = ("nbytes", "decode", "align", "lazy", "field")

    def __init__(self, nbytes: int, decode: Callable[[_SlotView], Number], lazy: int = 0,
                 field: str | None = None) -> None:
        self.nbytes, self.decode, self.align, self.lazy = nbytes, decode, min(nbytes, 8), lazy
        self.field = field


class _Decoded:
    """``.value`` decodes a slot: stands in for a ctypes cell where no single cell gives the
    value (float16, bfloat16, float8, complex)."""

    __slots__ = ("_decode", "_view")

    def __init__(self, decode: Callable[[_SlotView], Number], view: _SlotView) -> None:
        self._decode, self._view = decode, view

    @property
    def value(self) -> Number:
        return self._decode(self._view)


def _value_cell(spec: _Spec, view: _SlotView) -> Any:
    """What the hot path reads ``.value`` of: the ctypes cell itself for plain types (no Python
    call to decode), else a :class:`_Decoded`."""
    return getattr(view, spec.field) if spec.field else _Decoded(spec.decode, view)


def _build_specs() -> dict[torch.dtype, _Spec]:
    t = torch
    specs = {
        t.bool: _Spec(1, lambda v: v.b.value, field="b"),
        t.int8: _Spec(1, lambda v: v.i8.value, field="i8"),
        t.uint8: _Spec(1, lambda v: v.u8.value, field="u8"),
        t.int16: _Spec(2, lambda v: v.i16.value, field="i16"),
        t.int32: _Spec(4, lambda v: v.i32.value, field="i32"),
        t.int64: _Spec(8, lambda v: v.i64.value, field="i64"),
        t.float16: _Spec(2, lambda v: _HALF.unpack_from(v.raw)[0]),
        t.bfloat16: _Spec(2, _bf16),
        t.float32: _Spec(4, lambda v: v.f32.value, field="f32"),
        t.float64: _Spec(8, lambda v: v.f64.value, field="f64"),
        t.complex32: _Spec(4, lambda v: complex(*_HALF2.unpack_from(v.raw))),
        t.complex64: _Spec(8, lambda v: complex(v.f32.value, v.f32_hi.value)),
        t.complex128: _Spec(16, lambda v: complex(v.f64.value, v.f64_hi.value)),
    }
    for name, nbytes, attr in (("uint16", 2, "u16"), ("uint32", 4, "u32"), ("uint64", 8, "u64")):
        if hasattr(t, name):  # unsigned wide integers arrived in torch 2.3
            specs[getattr(t, name)] = _Spec(nbytes, lambda v, a=attr: getattr(v, a).value,
                                            field=attr)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "float8_e8m0fnu"):
        if hasattr(t, name):
            specs[getattr(t, name)] = _Spec(1, _fp8(getattr(t, name)))
    for dt, spec in specs.items():  # `z.conj().imag` is a real tensor with the negative bit
        spec.lazy = 2 if dt.is_complex else 1 if dt.is_floating_point else 0
    return specs


_SPECS = _build_specs()


# ---------------------------------------------------------------- waiting
def _wait(poll: Callable[[Any, Any], bool], a: Any, b: Any, timeout: float, spin: float,
          check: Callable[[int], None] | None, stream: int, what: object) -> None:
    """Return once ``poll(a, b)``; spin for ``spin`` s, then sleep with doubling back-off.

    Raises FetchTimeoutError after ``timeout`` s; ``check(stream)`` runs while sleeping so that a
    failed producer raises its own error rather than a timeout.
    """
    t0 = _now()
    spin_end = t0 + min(spin, timeout)
    while True:
        for _ in range(64):  # a clock read costs about as much as a poll: read it every 64
            if poll(a, b):
                return
        if _now() >= spin_end:
            break
    deadline, delay = t0 + timeout, 5e-6
    while not poll(a, b):
        if check is not None:
            check(stream)
        now = _now()
        if now >= deadline:
            raise FetchTimeoutError(
                f"timed out after {timeout:g} s waiting for {what}; its producer never finished "
                "(a blocked or very long kernel, a stream waiting on an event nobody records, "
                "or a CPU producer that never signalled)")
        time.sleep(min(delay, deadline - now))
        delay = min(2 * delay, 1e-3)


class _What:
    """Describes a fast_item wait lazily: the message is built only if it times out."""

    __slots__ = ("t", "stream")

    def __init__(self, t: torch.Tensor, stream: int) -> None:
        self.t, self.stream = t, stream

    def __str__(self) -> str:
        t = self.t
        return (f"fast_item of a {t.dtype} tensor at 0x{t.data_ptr():x} on {t.device} "
                f"(stream 0x{self.stream:x})")


# ---------------------------------------------------------------- slot strategies
class _Slots:
    """N reusable host slots and the way one device value gets into them.

    ``write`` starts the copy of ``t`` into slot ``i`` tagged ``seq`` on ``stream`` (raw handle);
    ``ready(i, seq)`` polls; ``read`` decodes; ``check(stream)`` raises a device error;
    ``order(consumer, producer)`` makes stream ``consumer`` wait for ``producer``'s work so far.
    """

    name = "?"
    check: Callable[[int], None] | None = None

    def write(self, i: int, t: torch.Tensor, spec: _Spec, seq: int, stream: int) -> None:
        raise NotImplementedError

    def ready(self, i: int, seq: int) -> bool:
        raise NotImplementedError

    def read(self, i: int, spec: _Spec, t: torch.Tensor | None) -> Number:
        return spec.decode(self.views[i])

    def order(self, consumer: int, producer: int) -> None:
        raise NotImplementedError

    def item(self, t: torch.Tensor, spec: _Spec, stream: int, timeout: float, spin: float) -> Number:
        """Slot 0 as a synchronous reader for ``fast_item`` (one reader per thread and device)."""
        seq = self._seq = self._seq + 1
        self.write(0, t, spec, seq, stream)
        if not self.ready(0, seq):
            _wait(self.ready, 0, seq, timeout, spin, self.check, stream, _What(t, stream))
        return spec.decode(self.views[0])


def _native():  # imported lazily: CPU-only use never touches libcuda
    from flowexec import _cuda_native

    return _cuda_native


def _stream_check(stream: int) -> None:
    nat = _native()
    err = nat.driver().cuStreamQuery(stream)
    if err not in (0, nat.CUDA_ERROR_NOT_READY):
        raise nat.CudaDriverError(err, f"the producer stream 0x{stream:x} (cuStreamQuery)")


class _DriverSlots(_Slots):
    """Shared by the kernel and memcpy paths: cuMemHostAlloc'd slots, driver events."""

    def __init__(self, device_index: int, n: int) -> None:
        nat = self._nat = _native()
        nat.ensure_context(device_index)
        self.device_index = device_index
        self._host, self._dev = nat.host_alloc(n * _SLOT)
        self.views = [_SlotView(self._host + i * _SLOT) for i in range(n)]
        self._order_ev = nat.event_create()
        self._seq = 0
        self.check = _stream_check

    def order(self, consumer: int, producer: int) -> None:
        d = self._nat.driver()
        self._nat.check(d.cuEventRecord(self._order_ev, producer), "cuEventRecord")
        self._nat.check(d.cuStreamWaitEvent(consumer, self._order_ev, 0), "cuStreamWaitEvent")


class _KernelSlots(_DriverSlots):
    """The fx_read PTX kernel writes the value and then a sequence number into mapped memory."""

    def __init__(self, device_index: int, n: int, launcher: str) -> None:
        super().__init__(device_index, n)
        nat = self._nat
        self.name = f"kernel+{launcher}"
        self._fns = nat.kernels(device_index)
        self._launch = nat.launcher(launcher)
        self._dst = [self._dev + i * _SLOT for i in range(n)]
        # Kernel parameters live in preallocated ctypes cells; cuLaunchKernel copies them at the
        # call, so they can be overwritten for the next launch straight away.
        self._p = (ctypes.c_uint64 * 3)()
        a = ctypes.addressof(self._p)
        self._params = (ctypes.c_void_p * 3)(a, a + 8, a + 16)
        self._paddr = ctypes.addressof(self._params)

    def write(self, i: int, t: torch.Tensor, spec: _Spec, seq: int, stream: int) -> None:
        p = self._p
        p[0], p[1], p[2] = t.data_ptr(), self._dst[i], seq
        err = self._launch(self._fns[spec.nbytes], stream, self._paddr)
        if err:
            self._relaunch(err, spec, stream)

    def _relaunch(self, err: int, spec: _Spec, stream: int) -> None:
        nat = self._nat
        if err == nat.CUDA_ERROR_INVALID_CONTEXT:  # a thread with no current context yet
            nat.ensure_context(self.device_index)
            err = self._launch(self._fns[spec.nbytes], stream, self._paddr)
        nat.check(err, "cuLaunchKernel(fx_read)")

    def ready(self, i: int, seq: int) -> bool:
        return self.views[i].seq.value >= seq

    def item(self, t: torch.Tensor, spec: _Spec, stream: int, timeout: float, spin: float) -> Number:
        # write() and ready() inlined: this is the hot path whose latency the benchmark measures.
        seq = self._seq = self._seq + 1
        p = self._p
        p[0], p[1], p[2] = t.data_ptr(), self._dst[0], seq
        err = self._launch(self._fns[spec.nbytes], stream, self._paddr)
        if err:
            self._relaunch(err, spec, stream)
        v = self.views[0]
        s = v.seq
        n = 0
        while s.value < seq:  # an idle device answers within a few µs: poll without the clock
            n += 1
            if n > 256:  # then the timed spin-then-sleep wait takes over
                _wait(self.ready, 0, seq, timeout, spin, self.check, stream, _What(t, stream))
                break
        return spec.decode(v)


# A cached CUDA graph that reads one (address, dtype), as a plain tuple: fast_item's hot path
# takes all of it apart in one UNPACK_SEQUENCE (~20 ns; a NamedTuple's unpack takes the generic
# path, ~60 ns, and one attribute lookup per field more). Fields, in order:
#   launch  launch(handle, stream): falsy on success (a CUresult, or it raises)
#   handle  the exec handle as ``launch`` takes it
#   flag    ctypes cell: the host clears it, the graph sets it after the payload
#   cell    ``.value`` is the read value (a ctypes cell, or a _Decoded)
#   lazy    0, or 1: check the negative bit, 2: also the conjugate bit
#   dev     None in a one-GPU process (no current-device check), else the device index
#   reader  the _GraphSlots that owns it
#   exec    the raw CUgraphExec (destroyed on eviction)
#   idx     device index
_HotEntry = tuple
_E_LAUNCH, _E_HANDLE, _E_FLAG, _E_CELL, _E_LAZY, _E_DEV, _E_READER, _E_EXEC, _E_IDX = range(9)


_HOT_MAX = 256  # graphs cached per thread; also the window in which a second sighting counts
_SPIN = range(256)  # untimed polls before the timed spin-then-sleep wait takes over


def _nonzero(cell: Any, _: Any) -> bool:
    return cell.value != 0


class _GraphSlots(_KernelSlots):
    """fast_item's reader: a captured CUDA graph of the read kernel per (address, dtype).

    On the measured machine cuGraphLaunch costs less than cuLaunchKernel (docs/fetch.md), so an
    address read a second time within the last ``_HOT_MAX`` new addresses gets its own graph;
    first sightings use the direct launch (slot 0, sequence numbers). Each graph writes into
    slot 1: elements of up to 4 bytes with ``fx_ll`` (payload and the flag 1 in one 8-byte
    store, flag at +4), wider ones with ``fx_read`` (payload, system fence, flag 1 at +16). The
    host clears the flag before every launch, and a reader whose wait failed is retired with
    its graphs, so a late write can't be mistaken for a later read's.
    """

    def __init__(self, device_index: int, launcher: str) -> None:
        super().__init__(device_index, 2, launcher)
        self.name = f"graph+{launcher}"
        self._glaunch, self._ghandle = self._nat.graph_launcher(launcher)
        self._gview = self.views[1]
        self._flag = self.views[1].seq  # fx_read's flag: 64 bits at +16
        self._ll_flag = ctypes.c_uint32.from_address(self._host + _SLOT + 4)  # fx_ll's flag
        self._dev = None if torch.cuda.device_count() <= 1 else device_index
        self._cap: int | None = None
        self.seen: dict[tuple[int, torch.dtype], None] = {}

    def entry(self, ptr: int, spec: _Spec) -> _HotEntry:
        """Capture and instantiate the graph reading ``spec.nbytes`` at ``ptr`` (not cached)."""
        nat = self._nat
        if self._cap is None:
            self._cap = nat.stream_create()
        ll = spec.nbytes in nat.LL_SIZES
        p = self._p
        p[0], p[1], p[2] = ptr, self._dst[1], 1
        ex = nat.graph_of_launch(self._fns[-spec.nbytes if ll else spec.nbytes], self._paddr,
                                 self._cap)
        return (self._glaunch, self._ghandle(ex), self._ll_flag if ll else self._flag,
                _value_cell(spec, self._gview), spec.lazy, self._dev, self, ex, self.device_index)

    def destroy(self, e: _HotEntry) -> None:
        self._nat.driver().cuGraphExecDestroy(e[_E_EXEC])

    def launch_failed(self, err: Any, e: _HotEntry, stream: int) -> None:
        """A launcher returned an error code: make this thread's context current and retry once
        (a thread that has not touched CUDA through the runtime yet), else raise."""
        nat = self._nat
        if err == nat.CUDA_ERROR_INVALID_CONTEXT:
            nat.ensure_context(self.device_index)
            err = e[_E_LAUNCH](e[_E_HANDLE], stream)
        if err:
            nat.check(int(err), "cuGraphLaunch(fx_read)")

    def wait_flag(self, flag: Any, t: torch.Tensor, stream: int, timeout: float | None,
                  spin_us: float | None) -> None:
        """The timed spin-then-sleep wait, once the untimed polls found no flag."""
        _wait(_nonzero, flag, None, _timeout_s if timeout is None else timeout,
              _spin_s if spin_us is None else spin_us * 1e-6, self.check, stream, _What(t, stream))

    def graph_item(self, e: _HotEntry, stream: int, t: torch.Tensor, timeout: float | None,
                   spin_us: float | None) -> Number:
        """Replay ``e`` on ``stream`` and return its value (fast_item inlines the same steps)."""
        launch, h, flag, cell, _, _, _, _, _ = e
        flag.value = 0
        err = launch(h, stream)
        if err:
            self.launch_failed(err, e, stream)
        for _ in _SPIN:
            if flag.value:
                return cell.value
        self.wait_flag(flag, t, stream, timeout, spin_us)
        return cell.value


class _MemcpySlots(_DriverSlots):
    """cuMemcpyDtoHAsync into the pinned slot, completion by a per-slot event."""

    name = "memcpy"

    def __init__(self, device_index: int, n: int) -> None:
        super().__init__(device_index, n)
        self._events = [self._nat.event_create() for _ in range(n)]
        d = self._nat.driver()
        self._copy, self._record, self._query = d.cuMemcpyDtoHAsync_v2, d.cuEventRecord, d.cuEventQuery

    def write(self, i: int, t: torch.Tensor, spec: _Spec, seq: int, stream: int) -> None:
        check = self._nat.check
        check(self._copy(self._host + i * _SLOT, t.data_ptr(), spec.nbytes, stream), "cuMemcpyDtoHAsync")
        check(self._record(self._events[i], stream), "cuEventRecord")

    def ready(self, i: int, seq: int) -> bool:
        err = self._query(self._events[i])
        if err == 0:
            return True
        if err != self._nat.CUDA_ERROR_NOT_READY:
            self._nat.check(err, "cuEventQuery")
        return False


class _TorchSlots(_Slots):
    """Only torch: copy_(non_blocking) into pinned memory, a torch.cuda.Event per slot."""

    name = "torch"

    def __init__(self, device_index: int, n: int) -> None:
        self.device_index = device_index
        self._host = torch.zeros(n * _SLOT, dtype=torch.uint8, pin_memory=True)
        base = self._host.data_ptr()
        self.views = [_SlotView(base + i * _SLOT) for i in range(n)]
        self._events = [torch.cuda.Event() for _ in range(n)]
        self._dst: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._seq = 0

    def _stream(self, raw: int) -> torch.cuda.Stream:
        s = self._streams.get(raw)
        if s is None:
            s = (torch.cuda.default_stream(self.device_index) if raw == 0
                 else torch.cuda.ExternalStream(raw, device=self.device_index))
            self._streams[raw] = s
        return s

    def write(self, i: int, t: torch.Tensor, spec: _Spec, seq: int, stream: int) -> None:
        dst = self._dst.get((i, t.dtype))
        if dst is None:
            dst = self._host[i * _SLOT:i * _SLOT + spec.nbytes].view(t.dtype).view(())
            self._dst[(i, t.dtype)] = dst
        s = self._stream(stream)
        with torch.cuda.stream(s):
            dst.copy_(t.reshape(()), non_blocking=True)
            self._events[i].record(s)

    def ready(self, i: int, seq: int) -> bool:
        return self._events[i].query()

    def order(self, consumer: int, producer: int) -> None:
        self._stream(consumer).wait_stream(self._stream(producer))


class _HostSlots(_Slots):
    """CPU rings: the value is taken at submit, or when the producer's readiness object is set."""

    name = "cpu"

    def __init__(self, n: int) -> None:
        self._ready: list[Readiness | None] = [None] * n
        self._value: list[Number | None] = [None] * n

    def put(self, i: int, t: torch.Tensor, ready: Readiness | None) -> None:
        self._ready[i] = ready
        self._value[i] = t.item() if ready is None else None

    def ready(self, i: int, seq: int) -> bool:
        r = self._ready[i]
        return r is None or bool(r.is_set())

    def read(self, i: int, spec: _Spec, t: torch.Tensor | None) -> Number:
        if self._ready[i] is None:
            return self._value[i]  # type: ignore[return-value]
        assert t is not None
        return t.item()

    def order(self, consumer: int, producer: int) -> None:
        pass


# ---------------------------------------------------------------- choosing a backend
_chosen: str | None = None
_backend_failures: list[str] = []  # why faster paths were passed over (shown by the benchmark)
_choose_lock = threading.Lock()


def _candidates(request: str) -> list[str]:
    graphs = [f"graph+{k}" for k in _LAUNCHERS]
    kernels = [f"kernel+{k}" for k in _LAUNCHERS]
    if request == "auto":
        return [*graphs, *kernels, "memcpy", "torch"]
    if request in ("graph", "kernel"):
        return graphs if request == "graph" else kernels
    if request in (*graphs, *kernels, "memcpy", "torch"):
        return [request]
    raise ValueError(f"unknown fetch backend {request!r}: expected 'auto', 'graph', 'kernel', "
                     f"{', '.join(repr(k) for k in graphs + kernels)}, 'memcpy' or 'torch'")


def _make_slots(name: str, device_index: int, n: int, reader: bool = False) -> _Slots:
    """Slots of backend ``name``; ``reader``: fast_item's per-thread reader (graphs), else a
    ring's slots (graph backends use direct kernel launches there: slots change per submit)."""
    with torch.cuda.device(device_index):  # driver objects belong to this device's context
        kind, _, launcher = name.partition("+")
        if kind == "graph" and reader:
            return _GraphSlots(device_index, launcher)
        if kind in ("graph", "kernel"):
            return _KernelSlots(device_index, n, launcher)
        if name == "memcpy":
            return _MemcpySlots(device_index, n)
        return _TorchSlots(device_index, n)


def _self_test(slots: _Slots, device_index: int) -> None:
    """Read known values of every element size back; raise if any differs from .item()."""
    with torch.cuda.device(device_index):
        _self_test_here(slots, device_index)


def _self_test_here(slots: _Slots, device_index: int) -> None:
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    for value, dtype in ((True, torch.bool), (-1234, torch.int16), (-3.25e38, torch.float32),
                         (-(2**62) - 3, torch.int64), (1.5 - 2.25j, torch.complex128)):
        t = torch.tensor(value, dtype=dtype, device=f"cuda:{device_index}")
        got = slots.item(t, _SPECS[dtype], stream, 10.0, _spin_s)
        if got != t.item():
            raise RuntimeError(f"read back {got!r} for a {dtype} holding {t.item()!r}")
    if isinstance(slots, _GraphSlots):  # graphs read their address anew at each replay
        for dtype, values in ((torch.float64, (-2.75, 1e300, 7.0)),  # fx_read, fenced
                              (torch.float32, (-3.25e38, 0.5, 7.0)),  # fx_ll, 4 bytes
                              (torch.int16, (-1234, 77)), (torch.bool, (True, False)),
                              (torch.complex128, (1.5 - 2.25j, -0.5j))):
            t = torch.zeros((), dtype=dtype, device=f"cuda:{device_index}")
            e = slots.entry(t.data_ptr(), _SPECS[dtype])
            try:
                for v in values:
                    t.fill_(v)
                    got, want = slots.graph_item(e, stream, t, 10.0, None), t.item()
                    if got != want or type(got) is not type(want):
                        raise RuntimeError(f"graph read back {got!r} for {want!r} ({dtype})")
            finally:
                slots.destroy(e)


def _choose(device_index: int) -> str:
    """Pick the first backend that loads and reads correctly (once per process)."""
    global _chosen
    with _choose_lock:
        if _chosen is None:
            failures = []
            for name in _candidates(_backend_request):
                try:
                    slots = _make_slots(name, device_index, 1, reader=True)
                    _self_test(slots, device_index)
                except Exception as e:  # noqa: BLE001 - any failure means: try the next path
                    failures.append(f"{name}: {type(e).__name__}: {e}")
                    continue
                _chosen = name
                _tls.readers.setdefault(device_index, slots)
                break
            else:
                raise RuntimeError("no fetch backend works here:\n  " + "\n  ".join(failures))
            _backend_failures[:] = failures
            if _backend_request == "auto" and not _chosen.startswith(("graph+", "kernel+")):
                warnings.warn(f"flowexec.fetch uses the {_chosen!r} path; faster paths failed:\n  "
                              + "\n  ".join(failures), RuntimeWarning, stacklevel=3)
    return _chosen


def backend() -> str:
    """The readback path in use: ``"graph+cupy"`` (and the other ``graph+``/``kernel+``
    launchers), ``"memcpy"``, ``"torch"``, or ``"cpu"`` where CUDA is unavailable. Picks it if
    none is picked yet (on CUDA: the first that loads and reads known values back correctly).

    >>> backend() in ("cpu", "memcpy", "torch") or backend().startswith(("graph+", "kernel+"))
    True
    """
    if _chosen is not None:
        return _chosen
    if not torch.cuda.is_available():
        return "cpu"
    return _choose(torch.cuda.current_device())


# ---------------------------------------------------------------- fast_item
class _Local(threading.local):
    def __init__(self) -> None:
        self.readers: dict[int, _Slots] = {}
        self.hot: dict[tuple[int, torch.dtype], _HotEntry] = {}  # (address, dtype) -> graph
        self.get = self.hot.get  # bound once: the hot path does one attribute lookup, not two


_tls = _Local()
_retired: list[_Slots] = []  # slots a late kernel may still write: kept, never reused
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses (fake, distributed...) take .item()
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds only
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def _reader(device_index: int) -> _Slots:
    r = _make_slots(_chosen or _choose(device_index), device_index, 1, reader=True)
    _tls.readers[device_index] = r
    return r


def _retire(device_index: int) -> None:
    """A wait failed: the slot may still be written by a copy that runs later. Keep it (and its
    graphs) out of use forever; the next read on this thread starts afresh."""
    r = _tls.readers.pop(device_index, None)
    if r is not None:
        _retired.append(r)
    hot = _tls.hot
    for k in [k for k, e in hot.items() if e[_E_IDX] == device_index]:
        del hot[k]


def fast_item(t: torch.Tensor, *, timeout: float | None = None, spin_us: float | None = None) -> Number:
    """The value of a one-element tensor as a Python number, like ``t.item()`` but faster on CUDA.

    CPU tensors take ``t.item()``. On CUDA the value is read on the current stream (so after the
    work that produced it, as ``.item()`` does) into a pinned slot owned by this thread; the wait
    spins for ``spin_us`` µs, then sleeps, and raises :class:`FetchTimeoutError` after ``timeout``
    seconds. A tensor with other than one element raises ``RuntimeError`` as ``.item()`` does.

    >>> fast_item(torch.tensor(2.5))
    2.5
    >>> fast_item(torch.tensor([True]))
    True
    """
    if type(t) not in _PLAIN or not t.is_cuda:
        return t.item()
    try:
        e = _tls.get((t.data_ptr(), t.dtype))
    except RuntimeError:  # no data pointer (sparse and other layouts)
        return t.item()
    # Hot path: this (address, dtype) has a graph. Only what can differ between two tensors at
    # one address and dtype is checked again: element count, the lazy-view bits, the current
    # device (several GPUs only). The current stream is asked every time: the read is ordered
    # on it, as .item()'s copy is. Every step is inlined (graph_item does the same).
    if e is not None and t.numel() == 1:
        launch, h, flag, cell, lazy, dev, r, _, idx = e
        if not (lazy and (t.is_neg() or (lazy == 2 and t.is_conj()))) and (
                dev is None or _get_device() == dev):
            stream = _raw_stream(idx)
            flag.value = 0
            try:
                err = launch(h, stream)
                if err:
                    r.launch_failed(err, e, stream)
                for _ in _SPIN:
                    if flag.value:
                        return cell.value
                r.wait_flag(flag, t, stream, timeout, spin_us)
                return cell.value
            except BaseException:
                _retire(idx)
                raise
    return _fast_item_slow(t, timeout, spin_us)


def _fast_item_slow(t: torch.Tensor, timeout: float | None, spin_us: float | None) -> Number:
    if t.numel() != 1:
        return t.item()  # raises .item()'s own error
    dtype = t.dtype
    spec = _SPECS.get(dtype)
    if spec is None or t.layout is not torch.strided:
        return t.item()  # unsupported dtype or layout
    if t.is_conj() or t.is_neg():  # lazy conjugate / negative views: memory holds the other value
        return fast_item(t.resolve_conj().resolve_neg(), timeout=timeout, spin_us=spin_us)
    ptr = t.data_ptr()
    if ptr % spec.align:
        return t.item()
    idx = t.get_device()
    if _get_device() != idx:
        with torch.cuda.device(idx):
            return _fast_item_slow(t, timeout, spin_us)
    r = _tls.readers.get(idx) or _reader(idx)
    stream = _raw_stream(idx)
    try:
        if isinstance(r, _GraphSlots):
            key, hot = (ptr, dtype), _tls.hot
            e = hot.get(key)
            if e is None and key in r.seen:  # read before, recently: worth a graph
                if len(hot) >= _HOT_MAX:
                    old = hot.pop(next(iter(hot)))
                    old[_E_READER].destroy(old)
                e = hot[key] = r.entry(ptr, spec)
            if e is not None:
                return r.graph_item(e, stream, t, timeout, spin_us)
            r.seen[key] = None
            if len(r.seen) > _HOT_MAX:
                del r.seen[next(iter(r.seen))]
        return r.item(t, spec, stream, _timeout_s if timeout is None else timeout,
                      _spin_s if spin_us is None else spin_us * 1e-6)
    except BaseException:
        _retire(idx)
        raise


# ---------------------------------------------------------------- asynchronous fetches
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

    def __init__(self, ring: FetchRing, slot: int, seq: int, spec: _Spec, src: torch.Tensor,
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
            self._slots: _Slots = _make_slots(_chosen or _choose(idx), idx, slots)
            self._side = torch.cuda.Stream(device=idx)
            self._side_raw = self._side.cuda_stream
        else:
            self._slots = _HostSlots(slots)

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
            if isinstance(self._slots, _HostSlots):
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
    def _prepare(self, t: torch.Tensor, stream: Any, ready: Any) -> tuple[_Spec, torch.Tensor]:
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
        spec = _SPECS.get(t.dtype)
        if spec is None or t.layout is not torch.strided:
            raise TypeError(f"{self!r} cannot fetch a {t.layout} tensor of dtype {t.dtype}")
        if t.is_conj() or t.is_neg() or (t.is_cuda and t.data_ptr() % spec.align):
            # A lazy conj/neg view or a misaligned element: fetch a fresh copy, made on the
            # producer's stream so that the ordering event still covers it.
            with torch.cuda.stream(stream) if stream is not None else _nullcontext():
                t = t.resolve_conj().resolve_neg().clone()
        return spec, t

    def _copy(self, i: int, t: torch.Tensor, spec: _Spec, seq: int, stream: Any) -> None:
        prod = (stream.cuda_stream if stream is not None
                else torch._C._cuda_getCurrentRawStream(self.device.index))
        self._slots.order(self._side_raw, prod)  # the side stream waits for the producer
        self._slots.write(i, t, spec, seq, self._side_raw)

    def _poll(self, f: Fetch, _: Any) -> bool:
        return f._done or self._slots.ready(f._slot, f._seq)

    def _wait(self, f: Fetch, timeout: float | None, what: object) -> None:
        if timeout is None:
            timeout = _timeout_s if self.timeout is None else self.timeout
        spin = _spin_s if self.spin_us is None else self.spin_us * 1e-6
        check = self._slots.check
        _wait(self._poll, f, None, timeout, spin, check, getattr(self, "_side_raw", 0), what)

    def _finish(self, f: Fetch) -> None:  # with self._lock held, after its slot is ready
        f._value = self._slots.read(f._slot, f._spec, f._src)
        f._done = True
        f._src = None

    def _materialize(self, f: Fetch, timeout: float | None) -> None:
        self._wait(f, timeout, f)
        with self._lock:
            if not f._done:
                self._finish(f)
