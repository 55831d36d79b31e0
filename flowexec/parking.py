"""Last step's gradients parked in host memory while capture runs the step.

Capture runs ``fn`` for real, and the gradients that exist when it starts are the program's
inputs (``Captured.grad_inputs``): make_fx holds them until it returns. Eager's step frees them
at its ``zero_grad(set_to_none=True)``, before the forward; a capture that held them would peak
one set of gradients above eager's step (0.47 GiB on GPT-2 124M). Which of them the step reads
(accumulation) is known only after the run, so each is parked instead: its bytes are copied to
host memory and its device storage shrinks to nothing, the tensor object staying what the
program's input and ``p.grad`` refer to. The first op that touches a parked tensor (capture's
dispatch mode sees every op before make_fx records it) brings its bytes back first; the rest
come back when the capture ends, except those the program discards (``zero_grad`` drops them
before the run): those stay parked through planning and graph capture until the call's run
lets them go (:meth:`ParkedGrads.release`).

Parking moves a tensor's memory: its bytes come back at another address. So capture parks only
a gradient held by nothing but its parameter (:func:`held_by_grad_alone`) and that its caller
finds worth parking (``graph_variants.worth_parking`` turns away memory whose address a CUDA
graph relies on: a graph would go on writing to the old address).

Example::

    >>> import torch
    >>> from flowexec.parking import ParkedGrads
    >>> g = torch.ones(4)
    >>> parked = ParkedGrads.park([g])
    >>> g.untyped_storage().nbytes()
    0
    >>> parked.fetch((g,)); g.sum().item()
    4.0
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Collection, Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes


def on_a_device(t: torch.Tensor) -> bool:
    """Parking saves memory only where the tensor does not already live in host memory (and a
    meta tensor has no bytes to park)."""
    return t.device.type not in ("cpu", "meta")


def _parkable(t: torch.Tensor) -> bool:
    """A plain dense tensor that owns its whole storage: shrinking the storage touches no
    other tensor (a view of a flat gradient buffer is left alone)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t._base is None
            and not t.requires_grad and t.storage_offset() == 0 and t.numel() > 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _holders(p: torch.Tensor) -> tuple[int, int, int]:
    """References to ``p.grad``: Python's, its tensor's (C++ handles: views, the parameter) and
    its storage's (the tensors on it)."""
    g = p.grad
    storage = g.untyped_storage()
    return sys.getrefcount(g), g._use_count(), torch._C._storage_Use_Count(storage._cdata)


@functools.lru_cache(maxsize=None)
def _alone() -> tuple[int, int, int]:
    """:func:`_holders` of a gradient that only its parameter holds, measured on this build of
    torch (how a tensor's Python object is kept differs between versions)."""
    with torch.no_grad(), _disable_current_modes():  # (a user's dispatch mode may keep what ops make)
        q = torch.nn.Parameter(torch.zeros(2))
        q.grad = torch.zeros(2)
        return _holders(q)


def held_by_grad_alone(p: torch.Tensor, known: int = 0) -> bool:
    """Whether ``p.grad`` is held by ``p`` alone, besides ``known`` Python references the caller
    knows of: no other Python object (a list of outputs, a caller's variable), no view, no other
    tensor on its storage."""
    if p.grad is None:
        return False
    py, impl, storage = _holders(p)
    base_py, base_impl, base_storage = _alone()
    return py <= base_py + known and impl <= base_impl and storage <= base_storage


class ParkedGrads:
    """Tensors whose bytes wait in host memory; :meth:`fetch` and :meth:`restore` bring them back."""

    def __init__(self, parked: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._parked = parked  # id(tensor) -> (tensor, host copy)

    def __bool__(self) -> bool:
        return bool(self._parked)

    @classmethod
    def park(cls, grads: Iterable[torch.Tensor | None]) -> ParkedGrads:
        """Park each of ``grads`` that owns its storage (the caller chose them)."""
        out = cls({})
        parked = out._parked
        seen: set[int] = set()
        try:
            with torch.no_grad(), _disable_current_modes():
                for g in grads:
                    if g is None or id(g) in parked or not _parkable(g):
                        continue
                    ptr = g.untyped_storage().data_ptr()
                    if ptr in seen:
                        continue
                    seen.add(ptr)
                    host = g.detach().to("cpu", copy=True)
                    try:
                        g.untyped_storage().resize_(0)
                    except RuntimeError:  # a storage that cannot resize (external memory): keep it
                        continue
                    parked[id(g)] = (g, host)
        except BaseException:  # (a failed copy: what was parked so far comes back)
            out.restore()
            raise
        return out

    def fetch(self, tree: Any) -> None:
        """Bring back every parked tensor among ``tree``'s leaves (an op's arguments)."""
        parked = self._parked
        for a in pytree.tree_leaves(tree):
            if isinstance(a, torch.Tensor) and id(a) in parked and parked[id(a)][0] is a:
                self._unpark(id(a))

    def restore(self, keep: Collection[int] = ()) -> None:
        """Bring back whatever is still parked but the tensors of the ids in ``keep``; one that
        fails (out of memory) stays parked, the others come back, and the first error is raised
        after."""
        error: BaseException | None = None
        for key in [k for k in self._parked if k not in keep]:
            try:
                self._unpark(key)
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def release(self, ids: Iterable[int]) -> None:
        """Stop keeping the tensors of these ids (``id(t)``), which their holder let go (a
        ``p.grad`` set to None): their bytes are dropped unless something else still holds the
        tensor, which then gets them back (it must read what it read before)."""
        for key in ids:
            entry = self._parked.pop(key, None)
            if entry is None:
                continue
            ref, host = weakref.ref(entry[0]), entry[1]
            del entry
            g = ref()
            if g is not None:
                self._parked[key] = (g, host)
                self._unpark(key)

    def _unpark(self, key: int) -> None:
        g, host = self._parked[key]
        _refill(g, host)
        del self._parked[key]  # (only once the bytes are back: a failed refill keeps the host copy)


def _refill(g: torch.Tensor, host: torch.Tensor) -> None:
    with torch.no_grad(), _disable_current_modes():
        g.untyped_storage().resize_(host.numel() * host.element_size())
        g.copy_(host)
