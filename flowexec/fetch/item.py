"""``fast_item(t)``: ``t.item()``, faster on CUDA.

The value is read on the current stream (so after the work that produced it, as ``.item()``'s
copy is) into a pinned slot owned by this thread. Everything ``fast_item`` does for an address
that has a graph (:mod:`.graph`) is inlined in the function itself: ``type(t)`` and
``t.is_cuda``; one lookup ``_tls.get((t.data_ptr(), t.dtype))`` (the thread-local's bound
``dict.get``); ``t.numel() == 1``; the cached entry, taken apart in one step; which lazy bits to
check; then the current stream (asked every call), clear the flag, launch, up to 256 untimed
polls, and ``.value`` of the value cell. After a failed wait the thread's reader (and its graphs)
is retired, never reused or freed: the copy may still land later.
"""
from __future__ import annotations

import threading

import torch

from . import choose, settings
from .graph import E_IDX, E_READER, HOT_MAX, SPIN, GraphSlots, HotEntry
from .slots import SPECS, Number, Slots


class _Local(threading.local):
    def __init__(self) -> None:
        self.readers: dict[int, Slots] = {}
        self.hot: dict[tuple[int, torch.dtype], HotEntry] = {}  # (address, dtype) -> graph
        self.get = self.hot.get  # bound once: the hot path does one attribute lookup, not two


_tls = _Local()
_retired: list[Slots] = []  # slots a late kernel may still write: kept, never reused
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses (fake, distributed...) take .item()
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # CUDA builds only
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def reset() -> None:
    """Every thread's readers and graphs start afresh (after the back-end setting changed)."""
    global _tls
    _tls = _Local()


def _reader(device_index: int) -> Slots:
    name = choose.chosen or choose.choose(device_index)
    r = choose.spare.pop(device_index, None) or choose.make_slots(name, device_index, 1, reader=True)
    _tls.readers[device_index] = r
    return r


def _retire(device_index: int) -> None:
    """A wait failed: the slot may still be written by a copy that runs later. Keep it (and its
    graphs) out of use forever; the next read on this thread starts afresh."""
    r = _tls.readers.pop(device_index, None)
    if r is not None:
        _retired.append(r)
    hot = _tls.hot
    for k in [k for k, e in hot.items() if e[E_IDX] == device_index]:
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
        launch, ex, flag, cell, lazy, dev, r, idx = e
        if not (lazy and (t.is_neg() or (lazy == 2 and t.is_conj()))) and (
                dev is None or _get_device() == dev):
            stream = _raw_stream(idx)
            flag.value = 0
            try:
                err = launch(ex, stream)
                if err:
                    r.launch_failed(err, e, stream)
                for _ in SPIN:
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
    spec = SPECS.get(dtype)
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
        if isinstance(r, GraphSlots):
            key, hot = (ptr, dtype), _tls.hot
            e = hot.get(key)
            if e is None and key in r.seen:  # read before, recently: worth a graph
                if len(hot) >= HOT_MAX:
                    old = hot.pop(next(iter(hot)))
                    old[E_READER].destroy(old)
                e = hot[key] = r.entry(ptr, spec)
            if e is not None:
                return r.graph_item(e, stream, t, timeout, spin_us)
            r.seen[key] = None
            if len(r.seen) > HOT_MAX:
                del r.seen[next(iter(r.seen))]
        return r.item(t, spec, stream, settings.timeout_s if timeout is None else timeout,
                      settings.spin_s if spin_us is None else spin_us * 1e-6)
    except BaseException:
        _retire(idx)
        raise
