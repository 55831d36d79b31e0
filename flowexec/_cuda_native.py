"""Thin ctypes access to the CUDA driver (libcuda) for :mod:`flowexec.fetch`.

Only what the scalar readback needs: load a tiny PTX kernel per device, allocate host-mapped
pinned slots, launch, record/query events, query streams. Everything here is imported lazily by
``flowexec.fetch`` and only on a machine with a CUDA tensor, so CPU-only installs never load
libcuda. Why the driver and not the runtime: libcuda.so.1 is present wherever a CUDA tensor
exists (torch loads it too), whereas the runtime library's name and location depend on how torch
was built.

The kernel (``fx_read{1,2,4,8,16}``, one thread) copies an element of 1..16 bytes from device
memory into a 32-byte host-mapped slot, then ``membar.sys`` and a volatile store of a 64-bit
sequence number at slot+16. The host polls that number: when it equals the launch's sequence
number, the payload before it is visible (the system fence orders the two stores over PCIe).
It was written as CUDA C (see ``_CUDA_SOURCE``) and lowered by hand to PTX ISA 6.0 / sm_50, so
any driver since CUDA 9 can JIT it; ``tests/test_fetch.py`` checks it with ``ptxas`` where one
is installed.

A second family, ``fx_ll{1,2,4}``, serves the captured graphs of elements of at most 4 bytes (the
usual float32/bf16/fp16 loss): it zero-extends the element to 32 bits and writes it together with
a 32-bit flag as ONE aligned 8-byte store, and has no fence. An aligned 8-byte store reaches host
memory in one piece (NCCL's LL protocol relies on the same property), so when the host sees the
flag half it sees the payload half too. That saves the ``membar.sys`` round trip.

Launchers: ``cuLaunchKernel`` is the hot call of the direct path, made through cupy's Cython
``driver.launchKernel`` (all arguments plain integers; measured fastest on the H200 machine) or
ctypes (no dependency); ``graph_launcher`` does the same for ``cuGraphLaunch``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

SLOT_BYTES = 32  # 16 bytes of payload (complex128 is the widest element), 8 of sequence, 8 spare
SEQ_OFFSET = 16
SIZES = (1, 2, 4, 8, 16)

# The kernel as CUDA C, for the reader; _ptx() below is its hand-lowered PTX.
_CUDA_SOURCE = r"""
template <class T> __global__ void fx_read(const T* src, volatile T* slot, unsigned long long seq) {
  slot[0] = src[0];                      // 16-byte case: two 8-byte loads and stores
  __threadfence_system();                // payload visible to the host before the sequence number
  *(volatile unsigned long long*)((volatile char*)slot + 16) = seq;
}
// Graphs of elements of <= 4 bytes: payload and flag in one 8-byte store, no fence.
template <class U> __global__ void fx_ll(const U* src, volatile unsigned long long* slot,
                                         unsigned long long flag) {
  *slot = (unsigned long long)src[0] | ((unsigned long long)(unsigned)flag << 32);
}
"""

_PTX_HEAD = ".version 6.0\n.target sm_50\n.address_size 64\n"
_PTX_ENTRY = """
.visible .entry fx_read{n}(.param .u64 p_src, .param .u64 p_slot, .param .u64 p_seq)
{{
\t.reg .b16 %rs<2>;
\t.reg .b32 %r<2>;
\t.reg .b64 %rd<8>;
\tld.param.u64 %rd1, [p_src];
\tld.param.u64 %rd2, [p_slot];
\tld.param.u64 %rd3, [p_seq];
\tcvta.to.global.u64 %rd4, %rd2;
\tcvta.to.global.u64 %rd5, %rd1;
{body}\tmembar.sys;
\tst.volatile.global.u64 [%rd4+16], %rd3;
\tret;
}}
"""
_PTX_BODY = {
    1: "\tld.global.u8 %rs1, [%rd5];\n\tst.volatile.global.u8 [%rd4], %rs1;\n",
    2: "\tld.global.u16 %rs1, [%rd5];\n\tst.volatile.global.u16 [%rd4], %rs1;\n",
    4: "\tld.global.u32 %r1, [%rd5];\n\tst.volatile.global.u32 [%rd4], %r1;\n",
    8: "\tld.global.u64 %rd6, [%rd5];\n\tst.volatile.global.u64 [%rd4], %rd6;\n",
    16: (
        "\tld.global.u64 %rd6, [%rd5];\n\tld.global.u64 %rd7, [%rd5+8];\n"
        "\tst.volatile.global.u64 [%rd4], %rd6;\n\tst.volatile.global.u64 [%rd4+8], %rd7;\n"
    ),
}


_PTX_LL = """
.visible .entry fx_ll{n}(.param .u64 p_src, .param .u64 p_slot, .param .u64 p_flag)
{{
\t.reg .b32 %r<3>;
\t.reg .b64 %rd<7>;
\tld.param.u64 %rd1, [p_src];
\tld.param.u64 %rd2, [p_slot];
\tld.param.u64 %rd3, [p_flag];
\tcvta.to.global.u64 %rd4, %rd2;
\tcvta.to.global.u64 %rd5, %rd1;
\tld.global.u{bits} %r1, [%rd5];
\tcvt.u32.u64 %r2, %rd3;
\tmov.b64 %rd6, {{%r1, %r2}};
\tst.volatile.global.u64 [%rd4], %rd6;
\tret;
}}
"""
LL_SIZES = (1, 2, 4)  # element sizes whose graphs use fx_ll (kernels() keys them as -n)


def ptx() -> str:
    """The PTX module holding ``fx_read1`` .. ``fx_read16`` and ``fx_ll1`` .. ``fx_ll4``."""
    return (_PTX_HEAD + "".join(_PTX_ENTRY.format(n=n, body=_PTX_BODY[n]) for n in SIZES)
            + "".join(_PTX_LL.format(n=n, bits=8 * n) for n in LL_SIZES))


CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_NOT_READY = 600
_HOSTALLOC_PORTABLE_DEVICEMAP = 0x01 | 0x02
_EVENT_DISABLE_TIMING = 0x02

_vp, _u, _sz, _i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int
_SIGNATURES: dict[str, list] = {
    "cuInit": [_u],
    "cuGetErrorName": [_i, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(_i), _i],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_vp), _i],
    "cuCtxGetCurrent": [ctypes.POINTER(_vp)],
    "cuCtxSetCurrent": [_vp],
    "cuModuleLoadData": [ctypes.POINTER(_vp), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(_vp), _vp, ctypes.c_char_p],
    "cuMemHostAlloc": [ctypes.POINTER(_vp), _sz, _u],
    "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(ctypes.c_uint64), _vp, _u],
    "cuLaunchKernel": [_vp, _u, _u, _u, _u, _u, _u, _u, _vp, _vp, _vp],
    "cuEventCreate": [ctypes.POINTER(_vp), _u],
    "cuEventRecord": [_vp, _vp],
    "cuEventQuery": [_vp],
    "cuEventElapsedTime": [ctypes.POINTER(ctypes.c_float), _vp, _vp],
    "cuEventDestroy_v2": [_vp],
    "cuStreamWaitEvent": [_vp, _vp, _u],
    "cuStreamQuery": [_vp],
    "cuStreamCreate": [ctypes.POINTER(_vp), _u],
    "cuStreamBeginCapture_v2": [_vp, _i],
    "cuStreamEndCapture": [_vp, ctypes.POINTER(_vp)],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_vp), _vp, ctypes.c_ulonglong],
    "cuGraphLaunch": [_vp, _vp],
    "cuGraphDestroy": [_vp],
    "cuGraphExecDestroy": [_vp],
    "cuGraphGetNodes": [_vp, ctypes.POINTER(_vp), ctypes.POINTER(_sz)],
    "cuGraphNodeGetType": [_vp, ctypes.POINTER(_i)],
}
# Kernel-node parameters (runtime/feed_node.py); looked up when first needed, as older drivers
# may lack the _v2 entry points.
_OPTIONAL: dict[str, list] = {
    "cuGraphKernelNodeGetParams_v2": [_vp, _vp],
    "cuGraphExecKernelNodeSetParams_v2": [_vp, _vp, _vp],
}


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error name."""

    def __init__(self, code: int, call: str) -> None:
        self.code = code
        super().__init__(f"{call} failed: {error_name(code)} ({code})")


class _Driver:
    """libcuda.so.1 with argument types declared once (undeclared pointers would be truncated)."""

    def __init__(self) -> None:
        name = os.environ.get("FLOWEXEC_LIBCUDA", "libcuda.so.1")
        self.lib = ctypes.CDLL(name)
        for fn, argtypes in _SIGNATURES.items():
            f = getattr(self.lib, fn)
            f.argtypes, f.restype = argtypes, ctypes.c_int
            setattr(self, fn, f)
        for fn, argtypes in _OPTIONAL.items():
            f = getattr(self.lib, fn, None)
            if f is not None:
                f.argtypes, f.restype = argtypes, ctypes.c_int
            setattr(self, fn, f)


_driver: _Driver | None = None
_lock = threading.Lock()
_kernels: dict[int, dict[int, int]] = {}
_primary: dict[int, int] = {}


def driver() -> _Driver:
    """The loaded driver (raises OSError where there is no libcuda)."""
    global _driver
    if _driver is None:
        with _lock:
            if _driver is None:
                d = _Driver()
                check(d.cuInit(0), "cuInit")
                _driver = d
    return _driver


def error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if _driver is None or _driver.cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
        return "CUDA_ERROR_UNKNOWN"
    return name.value.decode()


def check(code: int, call: str) -> None:
    if code != CUDA_SUCCESS:
        raise CudaDriverError(code, call)


def ensure_context(device_index: int) -> None:
    """If this thread has no current context, make ``device_index``'s primary context current.

    A thread whose only CUDA calls so far went through the runtime may have none yet (the
    runtime binds it lazily), and driver calls there fail with CUDA_ERROR_INVALID_CONTEXT. This
    does what the runtime would do; callers make sure torch's current device is
    ``device_index`` first, so a context that is already current is left alone.
    """
    d = driver()
    cur = ctypes.c_void_p()
    check(d.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value:
        return
    ctx = _primary.get(device_index)
    if ctx is None:
        dev, c = ctypes.c_int(), ctypes.c_void_p()
        check(d.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        check(d.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev.value), "cuDevicePrimaryCtxRetain")
        ctx = _primary[device_index] = c.value
    check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def kernels(device_index: int) -> dict[int, int]:
    """``{element bytes: CUfunction}`` for ``device_index``, JIT-compiled once per process:
    ``n`` is ``fx_read<n>``, ``-n`` is ``fx_ll<n>``."""
    fns = _kernels.get(device_index)
    if fns is None:
        with _lock:
            fns = _kernels.get(device_index)
            if fns is None:
                d = driver()
                ensure_context(device_index)
                mod = ctypes.c_void_p()
                check(d.cuModuleLoadData(ctypes.byref(mod), ptx().encode() + b"\0"), "cuModuleLoadData")
                fns = {}
                for n in SIZES:
                    f = ctypes.c_void_p()
                    check(d.cuModuleGetFunction(ctypes.byref(f), mod, f"fx_read{n}".encode()),
                          "cuModuleGetFunction")
                    fns[n] = f.value
                for n in LL_SIZES:
                    f = ctypes.c_void_p()
                    check(d.cuModuleGetFunction(ctypes.byref(f), mod, f"fx_ll{n}".encode()),
                          "cuModuleGetFunction")
                    fns[-n] = f.value
                _kernels[device_index] = fns
    return fns


def host_alloc(nbytes: int) -> tuple[int, int]:
    """Zeroed, pinned, portable, device-mapped host memory: ``(host pointer, device pointer)``.

    Never freed: slots are reused for the life of the process, and a slot that a late kernel
    might still write must not go back to an allocator (see ``flowexec.fetch.item._retire``).
    """
    d = driver()
    p, dp = ctypes.c_void_p(), ctypes.c_uint64()
    check(d.cuMemHostAlloc(ctypes.byref(p), nbytes, _HOSTALLOC_PORTABLE_DEVICEMAP), "cuMemHostAlloc")
    ctypes.memset(p.value, 0, nbytes)  # sequence numbers start at 0 so that no slot looks ready
    check(d.cuMemHostGetDevicePointer_v2(ctypes.byref(dp), p.value, 0), "cuMemHostGetDevicePointer")
    return p.value, dp.value


def event_create() -> int:
    ev = ctypes.c_void_p()
    check(driver().cuEventCreate(ctypes.byref(ev), _EVENT_DISABLE_TIMING), "cuEventCreate")
    return ev.value


def timing_event_create() -> int:
    """An event that keeps a device timestamp (``cuEventElapsedTime`` reads it)."""
    ev = ctypes.c_void_p()
    check(driver().cuEventCreate(ctypes.byref(ev), 0), "cuEventCreate")
    return ev.value


def stream_create() -> int:
    """A non-blocking stream (one the legacy default stream does not synchronize with)."""
    s = ctypes.c_void_p()
    check(driver().cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")
    return s.value


def graph_of_launch(fn: int, params: int, capture_stream: int) -> int:
    """An instantiated CUDA graph holding one 1x1 launch of ``fn`` with the current ``params``.

    Captured in relaxed mode on a private stream, so other threads' CUDA calls are unaffected.
    cuGraphLaunch of the result costs less than cuLaunchKernel on the H200 machine measured
    (docs/fetch.md), which is why fast_item replays one graph per (pointer, dtype).
    """
    d = driver()
    g, ge = ctypes.c_void_p(), ctypes.c_void_p()
    check(d.cuStreamBeginCapture_v2(capture_stream, 2), "cuStreamBeginCapture")  # 2: relaxed
    err = d.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, capture_stream, params, None)
    end = d.cuStreamEndCapture(capture_stream, ctypes.byref(g))  # always end the capture
    check(err, "cuLaunchKernel (captured)")
    check(end, "cuStreamEndCapture")
    try:
        check(d.cuGraphInstantiateWithFlags(ctypes.byref(ge), g, 0), "cuGraphInstantiate")
    finally:
        d.cuGraphDestroy(g)  # the executable graph does not need it
    return ge.value


Launch = Callable[[int, int, int], int]


def launcher(kind: str) -> Launch:
    """``launch(function, stream, params_address) -> CUresult`` for a 1×1 grid, 1×1 block.

    ``kind`` is ``"cupy"`` or ``"ctypes"``; raises ImportError where cupy is missing.
    """
    if kind == "ctypes":
        f = driver().cuLaunchKernel

        def launch(fn: int, stream: int, params: int, _f=f) -> int:
            return _f(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None)

        return launch
    if kind == "cupy":
        from cupy.cuda import driver as cupy_driver  # raises CUDADriverError itself on failure

        def launch(fn: int, stream: int, params: int, _f=cupy_driver.launchKernel,
                   _err=cupy_driver.CUDADriverError) -> int:
            try:
                _f(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, 0)
            except _err as e:  # cupy raises; callers expect a CUresult like the other launchers
                return int(getattr(e, "status", 999))
            return 0

        return launch
    raise ValueError(f"unknown launcher {kind!r}: expected 'cupy' or 'ctypes'")


GraphLaunch = Callable[[int, int], object]


def graph_launcher(kind: str) -> GraphLaunch:
    """``launch(exec, stream)`` for ``cuGraphLaunch``: returns a falsy value on success, and a
    CUresult or raises on failure.

    ``kind`` as for :func:`launcher`. cupy: its Cython ``runtime.graphLaunch`` (two plain
    integers; the runtime's ``cudaGraphExec_t`` is the driver's ``CUgraphExec``; raises
    ``CUDARuntimeError``). ctypes: ``cuGraphLaunch`` with its argument types declared.
    """
    if kind == "ctypes":
        return driver().cuGraphLaunch
    if kind == "cupy":
        from cupy.cuda import runtime as cupy_runtime

        return cupy_runtime.graphLaunch
    raise ValueError(f"unknown launcher {kind!r}: expected 'cupy' or 'ctypes'")
