"""Graph outputs handed to callers: copy-on-overwrite of the static buffers a replay rewrites.

See :class:`HandedOutputs`; used by :class:`flowexec.runtime.cuda_graph.CudaGraphRunner`.
"""
from __future__ import annotations

import warnings
import weakref
from sys import getrefcount
from typing import Any, Callable, Sequence

import torch


class HandedOutputs:
    """The aliases of static output buffers that calls hand out, with copy-on-overwrite.

    Kept outputs: one alias per buffer is reused call after call. Before the buffers are
    overwritten, ``release()`` moves any alias that someone still holds — a Python reference,
    or a C++ one such as a ``.grad`` autograd stole — to private memory, and makes a fresh
    alias for later calls. An alias nobody kept costs one reference-count check.

    *Fresh* outputs (gradients that a backward graph hands to autograd) get a new alias per
    call that this object does not hold, so autograd's ``AccumulateGrad`` may adopt it as
    ``.grad`` without copying it. ``release()`` then finds holders by the buffer's storage
    count: an alias still alive is moved as above, a parameter whose ``.grad`` is the buffer
    (found among ``candidates()``) gets a private copy of its ``.grad``; any other holder is
    told with a warning that its tensor is overwritten.

    >>> import torch
    >>> buf = torch.zeros(2)
    >>> h = HandedOutputs([buf])
    >>> kept = h.aliases[0]
    >>> h.release(); buf.fill_(1.0)
    tensor([1., 1.])
    >>> kept, h.moved
    (tensor([0., 0.]), 1)
    """

    def __init__(self, buffers: Sequence[torch.Tensor], fresh: Sequence[int] = (),
                 candidates: Callable[[], Sequence[torch.Tensor]] | None = None,
                 outputs: Sequence[Any] | None = None, positions: Sequence[int] | None = None) -> None:
        """``buffers`` sit at ``positions`` of a call's ``outputs`` (default: they are the outputs);
        ``fresh`` indexes the buffers handed out fresh, ``candidates()`` their possible owners."""
        self.buffers = list(buffers)
        self.positions = list(range(len(self.buffers))) if positions is None else list(positions)
        self.fresh = sorted(set(fresh))
        self.kept = [k for k in range(len(self.buffers)) if k not in set(self.fresh)]
        self.aliases: list[Any] = [None] * len(self.buffers)
        # What a call returns, kept aliases in place; only a move changes it (fresh ones are
        # filled in per call), so a call copies one list.
        self.template = list(self.buffers) if outputs is None else list(outputs)
        for k in self.kept:
            self.aliases[k] = self.template[self.positions[k]] = self.buffers[k].detach()
        self.moved = 0  # how many held outputs were moved to private memory (for tests/stats)
        # Kept buffers whose holders saved_held() checks (autograd's saved tensors), and the rest.
        self._kept_saved: list[int] = []
        self._kept_other = list(self.kept)
        self.candidates = candidates
        self._base = self._refcounts()
        self._storages = [self.buffers[k].untyped_storage()._cdata for k in self.fresh]
        self._storage_base = [torch._C._storage_Use_Count(c) for c in self._storages]
        self._last: list[Any] = [None] * len(self.fresh)  # weak refs to the aliases of the last call
        self._owner: dict[int, Any] = {}  # fresh position -> weak ref to the parameter whose .grad it was
        self._warned = False

    def _refcounts(self) -> list[int]:
        # Same access pattern as saved_held() and _move_held(), which compare against these counts:
        # the list, the local name, getrefcount's argument (a helper taking the alias would add one).
        aliases = self.aliases
        counts = [0] * len(aliases)
        for k in self.kept:
            alias = aliases[k]
            counts[k] = getrefcount(alias)
        return counts

    def watch_saved(self, first: int) -> None:
        """Outputs from position ``first`` on are tensors autograd saves for backward:
        :meth:`saved_held` says whether any of them is still held."""
        self._kept_saved = [k for k in self.kept if self.positions[k] >= first]
        self._kept_other = [k for k in self.kept if self.positions[k] < first]

    def saved_held(self) -> bool:
        """Whether an output :meth:`watch_saved` names is still held (a backward is pending)."""
        aliases, base = self.aliases, self._base
        for k in self._kept_saved:
            alias = aliases[k]
            if getrefcount(alias) > base[k] or alias._use_count() > 1:
                return True
        return False

    def release(self, saved_checked: bool = False) -> None:
        """Make every output the next replay overwrites private to whoever still holds it
        (``saved_checked``: :meth:`saved_held` just said that the saved ones are free)."""
        self._move_held(self._kept_other)
        if not saved_checked:
            self._move_held(self._kept_saved)
        use_count, storage_base = torch._C._storage_Use_Count, self._storage_base
        for j, cdata in enumerate(self._storages):
            if use_count(cdata) > storage_base[j]:
                self._release_fresh(j)

    def _move_held(self, kept: list[int]) -> None:
        aliases, base = self.aliases, self._base
        for k in kept:
            alias = aliases[k]
            if getrefcount(alias) > base[k] or alias._use_count() > 1:
                alias.data = alias.clone()
                aliases[k] = self.template[self.positions[k]] = self.buffers[k].detach()
                self.moved += 1

    def _release_fresh(self, j: int) -> None:
        k = self.fresh[j]
        buf = self.buffers[k]
        alias = self._last[j]() if self._last[j] is not None else None
        if alias is not None:  # the alias itself is held (e.g. returned by torch.autograd.grad)
            alias.data = alias.clone()
            self.moved += 1
        del alias
        if torch._C._storage_Use_Count(self._storages[j]) > self._storage_base[j]:
            owner = self._find_owner(j, buf)
            if owner is not None:
                owner.grad = owner.grad.clone()
                self.moved += 1
        if torch._C._storage_Use_Count(self._storages[j]) > self._storage_base[j] and not self._warned:
            self._warned = True
            warnings.warn("flowexec: a gradient that a CUDA graph handed to autograd is still referenced outside "
                          "its parameter's .grad and is overwritten by this call; clone gradients you keep across "
                          "steps", RuntimeWarning, stacklevel=4)

    def _find_owner(self, j: int, buf: torch.Tensor) -> torch.Tensor | None:
        ptr = buf.data_ptr()
        ref = self._owner.get(j)
        owner = ref() if ref is not None else None
        if owner is not None and owner.grad is not None and owner.grad.data_ptr() == ptr:
            return owner
        for c in self.candidates() if self.candidates is not None else ():
            g = c.grad
            if g is not None and g.data_ptr() == ptr:
                self._owner[j] = weakref.ref(c)
                return c
        return None

    def hand_out(self) -> list[Any]:
        """This call's outputs: the template, with a new alias for every fresh buffer."""
        outs = list(self.template)
        if self.fresh:
            last, buffers, positions = self._last, self.buffers, self.positions
            for j, k in enumerate(self.fresh):
                alias = buffers[k].detach()
                last[j] = weakref.ref(alias)
                outs[positions[k]] = alias
        return outs
