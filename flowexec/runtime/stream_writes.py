"""Fed hyperparameters written into the device buffer by the stream itself (``cuStreamBatchMemOp``).

A learning-rate schedule changes the program's fed values every step. Copying them from a pinned
host buffer puts a copy-engine transfer and an event between two graph replays: 5.6 µs of device
time a step on the H200 (``benchmarks/schedule.py``, 2% of a small step). A stream memory
operation instead carries each 8-byte value inside the command itself: the GPU's front end
writes it in stream order, with no copy engine, no kernel and no host buffer that a queued
replay could still be reading (so no ring of buffers and no events either).

:func:`stream_writes_for` gives a :class:`StreamWrites` for a CUDA float64 buffer, or None
where the driver lacks the call or a one-time check on the device (write, read back) fails;
callers then copy through pinned memory as before.

Example (needs CUDA)::

    >>> import numpy as np, torch
    >>> buf = torch.zeros(2, dtype=torch.float64, device="cuda")  # doctest: +SKIP
    >>> w = stream_writes_for(buf)  # doctest: +SKIP
    >>> w.write(np.array([1e-3, 0.9])); buf.tolist()  # doctest: +SKIP
    [0.001, 0.9]
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import torch

# CUstreamBatchMemOpParams: a 48-byte union; its writeValue member is {u32 operation; u64
# address; u64 value64; u32 flags; u64 alias} at offsets 0, 8, 16, 24, 32 (cuda.h).
_OP_BYTES = 48
_WRITE_VALUE_64 = 5
_MAX_OPS = 256  # the most one cuStreamBatchMemOp call takes
_PARAMS = np.dtype({"names": ["operation", "address", "value", "flags"],
                    "formats": [np.uint32, np.uint64, np.float64, np.uint32],
                    "offsets": [0, 8, 16, 24], "itemsize": _OP_BYTES})


@functools.lru_cache(maxsize=None)
def _batch_mem_op() -> Any:
    """libcuda's cuStreamBatchMemOp (the _v2 entry point of CUDA >= 11.7 drivers), or None."""
    try:
        from .._cuda_native import driver
        lib = driver().lib
    except (OSError, RuntimeError):
        return None
    fn = getattr(lib, "cuStreamBatchMemOp_v2", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class StreamWrites:
    """Writes a float64 vector into a CUDA buffer, in the current stream's order, from the host.

    The parameter array is built once (one 64-bit write per element, addresses fixed); a call
    fills in the values and makes one driver call per 256 elements: about as cheap on the host
    as a ``copy_``, and a few hundred nanoseconds of front-end work on the device.
    """

    def __init__(self, buf: torch.Tensor, fn: Any) -> None:
        if buf.dtype != torch.float64 or buf.device.type != "cuda" or not buf.is_contiguous():
            raise ValueError(f"stream writes need a contiguous CUDA float64 buffer, got {buf.dtype} on {buf.device}")
        n = buf.numel()
        self.buf = buf  # (kept: the commands hold its address)
        self._fn = fn
        self._device = buf.device.index if buf.device.index is not None else torch.cuda.current_device()
        self._params = np.zeros(n, dtype=_PARAMS)
        self._params["operation"] = _WRITE_VALUE_64
        self._params["address"] = buf.data_ptr() + 8 * np.arange(n, dtype=np.uint64)
        self.values = self._params["value"]  # a view: write() fills it
        base = self._params.ctypes.data
        self._chunks = [(base + k * _OP_BYTES, min(_MAX_OPS, n - k)) for k in range(0, n, _MAX_OPS)]
        self._stream = torch._C._cuda_getCurrentRawStream

    def write(self, values: Any) -> None:
        """Enqueue ``buf[:] = values`` on the current stream (``values``: n floats)."""
        self.values[:] = values
        stream = self._stream(self._device)
        for ptr, count in self._chunks:
            rc = self._fn(stream, count, ptr, 0)
            if rc != 0:
                if rc == 201:  # CUDA_ERROR_INVALID_CONTEXT: a thread the runtime has not bound yet
                    from .._cuda_native import ensure_context
                    ensure_context(self._device)
                    rc = self._fn(stream, count, ptr, 0)
                if rc != 0:
                    from .._cuda_native import CudaDriverError
                    raise CudaDriverError(rc, "cuStreamBatchMemOp_v2")


@functools.lru_cache(maxsize=None)
def _works_on(device_index: int) -> bool:
    """Whether stream writes reach device memory here: written once and read back."""
    fn = _batch_mem_op()
    if fn is None:
        return False
    try:
        with torch.cuda.device(device_index):
            probe = torch.full((3,), -1.0, dtype=torch.float64, device="cuda")
            want = [1.5, -2.25, 3.0e-7]
            StreamWrites(probe, fn).write(want)
            return probe.tolist() == want  # (.tolist() waits for the stream)
    except Exception:  # no such support on this device or driver: the pinned copy stays
        return False


def stream_writes_for(buf: torch.Tensor) -> StreamWrites | None:
    """A :class:`StreamWrites` for ``buf`` where this device and driver take stream writes, else None."""
    if buf.device.type != "cuda" or buf.dtype != torch.float64 or not buf.is_contiguous():
        return None
    index = buf.device.index if buf.device.index is not None else torch.cuda.current_device()
    if not _works_on(index):
        return None
    return StreamWrites(buf, _batch_mem_op())
