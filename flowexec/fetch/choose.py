"""Which back-end reads CUDA values: the first CUDA use tries, in order, ``graph+cupy``,
``graph+ctypes`` and ``torch``, and takes the first that loads and reads known values of every
element size back equal to ``.item()`` (the graph back-ends also replay graphs of 1-, 2-, 4-, 8-
and 16-byte elements, fenceless and fenced, over changing values). ``FLOWEXEC_FETCH_BACKEND`` or
``configure(backend=...)`` forces one. cupy is imported only when tried; ``libcuda.so.1`` is
loaded only on first CUDA use.

Why these three (docs/fetch.md): ``graph+cupy`` is what the measured machine (H200) chooses;
``graph+ctypes`` is the same path without cupy (not a dependency), 0.3 µs slower; ``torch`` needs
nothing beyond torch, for where the driver paths do not load. The direct kernel launch, a driver
``cuMemcpyDtoHAsync`` and cuda.bindings launchers were measured too and no machine chose them
or needed them as a fallback, so they are gone.
"""
from __future__ import annotations

import threading

import torch

from . import settings
from .graph import GraphSlots
from .kernel import KernelSlots
from .slots import SPECS, Slots
from .torch_copy import TorchSlots

LAUNCHERS = ("cupy", "ctypes")  # "auto" order: measured fastest first
NAMES = (*(f"graph+{k}" for k in LAUNCHERS), "torch")

chosen: str | None = None
failures: list[str] = []  # why faster back-ends were passed over (the benchmark prints them)
spare: dict[int, Slots] = {}  # the reader the choice tested, per device: the first thread's to keep
_lock = threading.Lock()


def candidates(request: str) -> list[str]:
    """The back-ends ``request`` allows, in the order they are tried (a ValueError for a name
    that is none of them).

    >>> candidates("auto")
    ['graph+cupy', 'graph+ctypes', 'torch']
    >>> candidates("graph")
    ['graph+cupy', 'graph+ctypes']
    """
    if request == "auto":
        return list(NAMES)
    if request == "graph":
        return [n for n in NAMES if n.startswith("graph+")]
    if request in NAMES:
        return [request]
    raise ValueError(f"unknown fetch backend {request!r}: expected 'auto', 'graph', "
                     f"{', '.join(repr(n) for n in NAMES)}")


def make_slots(name: str, device_index: int, n: int, reader: bool = False) -> Slots:
    """Slots of back-end ``name``; ``reader``: fast_item's per-thread reader (graphs), else a
    ring's slots (graph back-ends launch the kernel directly there: the slot changes per submit)."""
    with torch.cuda.device(device_index):  # driver objects belong to this device's context
        kind, _, launcher = name.partition("+")
        if kind == "graph":
            return GraphSlots(device_index, launcher) if reader else KernelSlots(device_index, n, launcher)
        return TorchSlots(device_index, n)


def self_test(slots: Slots, device_index: int) -> None:
    """Read known values of every element size back; raise if any differs from .item()."""
    with torch.cuda.device(device_index):
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        for value, dtype in ((True, torch.bool), (-1234, torch.int16), (-3.25e38, torch.float32),
                             (-(2**62) - 3, torch.int64), (1.5 - 2.25j, torch.complex128)):
            t = torch.tensor(value, dtype=dtype, device=f"cuda:{device_index}")
            got = slots.item(t, SPECS[dtype], stream, 10.0, settings.spin_s)
            if got != t.item():
                raise RuntimeError(f"read back {got!r} for a {dtype} holding {t.item()!r}")
        if isinstance(slots, GraphSlots):  # graphs read their address anew at each replay
            for dtype, values in ((torch.float64, (-2.75, 1e300, 7.0)),  # fx_read, fenced
                                  (torch.float32, (-3.25e38, 0.5, 7.0)),  # fx_ll, 4 bytes
                                  (torch.int16, (-1234, 77)), (torch.bool, (True, False)),
                                  (torch.complex128, (1.5 - 2.25j, -0.5j))):
                t = torch.zeros((), dtype=dtype, device=f"cuda:{device_index}")
                e = slots.entry(t.data_ptr(), SPECS[dtype])
                try:
                    for v in values:
                        t.fill_(v)
                        got, want = slots.graph_item(e, stream, t, 10.0, None), t.item()
                        if got != want or type(got) is not type(want):
                            raise RuntimeError(f"graph read back {got!r} for {want!r} ({dtype})")
                finally:
                    slots.destroy(e)


def choose(device_index: int) -> str:
    """The back-end in use: the first that loads and reads correctly (picked once per process).
    ``torch`` warns, naming why the driver paths failed."""
    global chosen
    with _lock:
        if chosen is None:
            passed_over = []
            for name in candidates(settings.backend):
                try:
                    slots = make_slots(name, device_index, 1, reader=True)
                    self_test(slots, device_index)
                except Exception as e:  # noqa: BLE001 - any failure means: try the next path
                    passed_over.append(f"{name}: {type(e).__name__}: {e}")
                    continue
                chosen = name
                spare[device_index] = slots
                break
            else:
                raise RuntimeError("no fetch backend works here:\n  " + "\n  ".join(passed_over))
            failures[:] = passed_over
            if settings.backend == "auto" and not chosen.startswith("graph+"):
                import warnings

                warnings.warn(f"flowexec.fetch uses the {chosen!r} path; faster paths failed:\n  "
                              + "\n  ".join(passed_over), RuntimeWarning, stacklevel=3)
    return chosen


def reset() -> None:
    """Forget the choice (a new ``backend`` setting takes effect for new readers and rings)."""
    global chosen
    with _lock:
        chosen = None
        spare.clear()
