"""What every back-end shares: the slot a value lands in, how each dtype is decoded from it, the
spin-then-sleep wait, and the :class:`Slots` interface the back-ends implement.

A slot is 32 bytes of host memory: 16 of payload (complex128 is the widest element), a 64-bit
sequence number or flag at +16, 8 spare. Decoding reads it through ctypes views built once per
slot (bfloat16 through a float32 scratch word, float8 through a 256-entry table that torch itself
converts, so it matches ``.item()``).

>>> import ctypes
>>> buf = (ctypes.c_char * SLOT)()
>>> t = torch.tensor(-2.5, dtype=torch.bfloat16)
>>> _ = ctypes.memmove(buf, t.data_ptr(), t.element_size())
>>> SPECS[torch.bfloat16].decode(SlotView(ctypes.addressof(buf)))
-2.5
"""
from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Callable
from typing import Any, Protocol, Union

import torch

Number = Union[bool, int, float, complex]
SLOT = 32  # bytes per slot: 16 of payload, the sequence number at +16, 8 spare
_now = time.perf_counter


class FetchTimeoutError(TimeoutError):
    """A wait for a fetched value ran past its timeout; the message names what was waited for."""


class Readiness(Protocol):
    """What a CPU producer hands to ``FetchRing.submit(ready=...)``; ``threading.Event`` fits."""

    def is_set(self) -> bool: ...


# ---------------------------------------------------------------- decoding a slot
class SlotView:
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


def _bf16(v: SlotView) -> float:
    v._bits.value = v.u16.value << 16
    return v._f.value


_HALF, _HALF2 = struct.Struct("<e"), struct.Struct("<ee")


def _fp8(dtype: torch.dtype) -> Callable[[SlotView], float]:
    table: list[float] = []

    def decode(v: SlotView) -> float:
        if not table:  # 256 entries, converted by torch itself so they match .item()
            table.extend(torch.arange(256, dtype=torch.uint8).view(dtype).double().tolist())
        return table[v.u8.value]

    return decode


class Spec:
    """How to read one dtype: element size, decoder, alignment, ``lazy``: which lazy-view bits a
    tensor of it can carry (0 none, 1 negative, 2 negative or conjugate), and ``field``: the
    :class:`SlotView` cell whose ``.value`` already is ``.item()``'s answer (None: decode)."""

    __slots__ = ("nbytes", "decode", "align", "lazy", "field")

    def __init__(self, nbytes: int, decode: Callable[[SlotView], Number], lazy: int = 0,
                 field: str | None = None) -> None:
        self.nbytes, self.decode, self.align, self.lazy = nbytes, decode, min(nbytes, 8), lazy
        self.field = field


class _Decoded:
    """``.value`` decodes a slot: stands in for a ctypes cell where no single cell gives the
    value (float16, bfloat16, float8, complex)."""

    __slots__ = ("_decode", "_view")

    def __init__(self, decode: Callable[[SlotView], Number], view: SlotView) -> None:
        self._decode, self._view = decode, view

    @property
    def value(self) -> Number:
        return self._decode(self._view)


def value_cell(spec: Spec, view: SlotView) -> Any:
    """What the hot path reads ``.value`` of: the ctypes cell itself for plain types (no Python
    call to decode), else a :class:`_Decoded`."""
    return getattr(view, spec.field) if spec.field else _Decoded(spec.decode, view)


def _build_specs() -> dict[torch.dtype, Spec]:
    t = torch
    specs = {
        t.bool: Spec(1, lambda v: v.b.value, field="b"),
        t.int8: Spec(1, lambda v: v.i8.value, field="i8"),
        t.uint8: Spec(1, lambda v: v.u8.value, field="u8"),
        t.int16: Spec(2, lambda v: v.i16.value, field="i16"),
        t.int32: Spec(4, lambda v: v.i32.value, field="i32"),
        t.int64: Spec(8, lambda v: v.i64.value, field="i64"),
        t.float16: Spec(2, lambda v: _HALF.unpack_from(v.raw)[0]),
        t.bfloat16: Spec(2, _bf16),
        t.float32: Spec(4, lambda v: v.f32.value, field="f32"),
        t.float64: Spec(8, lambda v: v.f64.value, field="f64"),
        t.complex32: Spec(4, lambda v: complex(*_HALF2.unpack_from(v.raw))),
        t.complex64: Spec(8, lambda v: complex(v.f32.value, v.f32_hi.value)),
        t.complex128: Spec(16, lambda v: complex(v.f64.value, v.f64_hi.value)),
    }
    for name, nbytes, attr in (("uint16", 2, "u16"), ("uint32", 4, "u32"), ("uint64", 8, "u64")):
        if hasattr(t, name):  # unsigned wide integers arrived in torch 2.3
            specs[getattr(t, name)] = Spec(nbytes, lambda v, a=attr: getattr(v, a).value, field=attr)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                 "float8_e8m0fnu"):
        if hasattr(t, name):
            specs[getattr(t, name)] = Spec(1, _fp8(getattr(t, name)))
    for dt, spec in specs.items():  # `z.conj().imag` is a real tensor with the negative bit
        spec.lazy = 2 if dt.is_complex else 1 if dt.is_floating_point else 0
    return specs


SPECS = _build_specs()


# ---------------------------------------------------------------- waiting
def wait(poll: Callable[[Any, Any], bool], a: Any, b: Any, timeout: float, spin: float,
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


class What:
    """Describes a fast_item wait lazily: the message is built only if it times out."""

    __slots__ = ("t", "stream")

    def __init__(self, t: torch.Tensor, stream: int) -> None:
        self.t, self.stream = t, stream

    def __str__(self) -> str:
        t = self.t
        return (f"fast_item of a {t.dtype} tensor at 0x{t.data_ptr():x} on {t.device} "
                f"(stream 0x{self.stream:x})")


# ---------------------------------------------------------------- the back-ends' interface
class Slots:
    """N reusable host slots and the way one device value gets into them.

    ``write`` starts the copy of ``t`` into slot ``i`` tagged ``seq`` on ``stream`` (raw handle);
    ``ready(i, seq)`` polls; ``read`` decodes; ``check(stream)`` raises a device error;
    ``order(consumer, producer)`` makes stream ``consumer`` wait for ``producer``'s work so far.
    """

    name = "?"
    check: Callable[[int], None] | None = None
    views: list[SlotView]
    _seq = 0

    def write(self, i: int, t: torch.Tensor, spec: Spec, seq: int, stream: int) -> None:
        raise NotImplementedError

    def ready(self, i: int, seq: int) -> bool:
        raise NotImplementedError

    def read(self, i: int, spec: Spec, t: torch.Tensor | None) -> Number:
        return spec.decode(self.views[i])

    def order(self, consumer: int, producer: int) -> None:
        raise NotImplementedError

    def item(self, t: torch.Tensor, spec: Spec, stream: int, timeout: float, spin: float) -> Number:
        """Slot 0 as a synchronous reader for ``fast_item`` (one reader per thread and device)."""
        seq = self._seq = self._seq + 1
        self.write(0, t, spec, seq, stream)
        if not self.ready(0, seq):
            wait(self.ready, 0, seq, timeout, spin, self.check, stream, What(t, stream))
        return spec.decode(self.views[0])
