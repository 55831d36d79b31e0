"""Per-call checks of a graph's borrowed inputs, precomputed once per captured graph.

A CUDA graph reads its *borrowed* inputs (parameters, state written in place) at the addresses
it was captured with, and graph mode refuses calls whose tensor arguments share a storage (they
are planned and staged apart). Done naively, a call pays for every tensor argument a
``data_ptr()`` for the address check plus an ``untyped_storage().data_ptr()`` and a set entry
for the sharing check (about 0.4 µs an argument on the H200's host). :class:`BorrowedAddresses`
makes that proportional to what can change:

- the borrowed addresses are compared as one tuple (``map(Tensor.data_ptr, ...)``, a C loop);
- the sharing check reads storages only of the *staged* arguments (per-call data, usually a
  few): a borrowed argument found at its captured address, with the layout the tensor guard
  checked, covers the same bytes as the tensor captured there, so its storage is the captured
  one, whose distinctness from the other borrowed ones and from closure state was checked when
  the graph was captured.

That last step assumes the captured storages are still alive (memory of a live storage is never
handed to another one). Each is watched with a weak reference: once one dies (``p.data = ...``
or ``p.set_(...)`` rebound the last tensor on it, say), :meth:`unshared` answers ``None`` and the
caller runs the full check over every argument's storage, as before.

>>> import torch
>>> p, x = torch.zeros(3), torch.zeros(2)
>>> check = BorrowedAddresses([p, x], [True, False])
>>> check.matches([p, torch.ones(2)]), check.matches([torch.zeros(3), x])
(True, False)
>>> check.unshared([p, torch.ones(2)], frozenset())
True
>>> check.unshared([p, p[1:]], frozenset())  # a staged argument on a borrowed one's storage
False
"""
from __future__ import annotations

import weakref
from operator import itemgetter
from typing import Any, Callable, Sequence

import torch

_data_ptr = torch.Tensor.data_ptr


def _getter(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``args -> tuple(args[i] for i in positions)`` in C (``itemgetter`` of one position
    returns the item itself, not a 1-tuple)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        (i,) = positions
        return lambda args: (args[i],)
    return itemgetter(*positions)


class BorrowedAddresses:
    """The borrowed inputs' captured addresses and storages, and the staged inputs' positions.

    ``inputs``: the tensors (or other values) a graph was captured with; ``borrow[i]``: whether
    input ``i`` is read in place.
    """

    def __init__(self, inputs: Sequence[Any], borrow: Sequence[bool]) -> None:
        tensors = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        self.positions = tuple(i for i in tensors if borrow[i])
        self.ptrs = tuple(inputs[i].data_ptr() for i in self.positions)
        self.staged = tuple(i for i in tensors if not borrow[i])
        self._borrowed_of = _getter(self.positions)
        self._staged_of = _getter(self.staged)
        alive = self._alive = [True]

        def died(_: Any, alive: list[bool] = alive) -> None:  # no reference to self: no cycle
            alive[0] = False
        try:
            storages = [inputs[i].untyped_storage() for i in self.positions]
            self._refs = [weakref.ref(s, died) for s in storages]
            self.storage_keys = frozenset(s.data_ptr() for s in storages)
        except (RuntimeError, NotImplementedError, TypeError):  # subclasses without a storage
            self._refs, self.storage_keys = [], frozenset()
            alive[0] = False
        # Borrowed inputs sharing a storage with each other (or empty ones, all at 0) leave the
        # full check to the caller.
        if len(self.storage_keys) != len(self.positions) or 0 in self.storage_keys:
            alive[0] = False
        self._state: frozenset[int] | None = None  # the closure-state keys `_forbidden` was made for
        self._forbidden: frozenset[int] | None = frozenset()

    def matches(self, args: Sequence[Any]) -> bool:
        """Whether every borrowed input is at its captured address (one tuple comparison)."""
        return tuple(map(_data_ptr, self._borrowed_of(args))) == self.ptrs

    def moved(self, args: Sequence[Any]) -> list[int]:
        """The positions of borrowed inputs that are not at their captured address."""
        return [i for i, p, q in zip(self.positions, map(_data_ptr, self._borrowed_of(args)), self.ptrs) if p != q]

    def unshared(self, args: Sequence[Any], state_keys: frozenset[int]) -> bool | None:
        """For a call that :meth:`matches`: True when no two arguments share a storage and none
        is on closure state's (storage addresses ``state_keys``); False when some do; None when
        this check cannot tell (a captured storage died), so the caller checks every argument."""
        if not self._alive[0]:
            return None
        if state_keys is not self._state:  # closure state grew (another signature): recompute once
            self._state = state_keys
            self._forbidden = self.storage_keys | state_keys if self.storage_keys.isdisjoint(state_keys) else None
        forbidden = self._forbidden
        if forbidden is None:  # a borrowed storage is closure state's now: the slow path decides
            return None
        if not self.staged:
            return True
        return distinct_storages(self._staged_of(args), forbidden)


    def native_spec(self, n: int) -> tuple[list[int], list[bool], frozenset[int], list[bool]] | None:
        """What the C++ call check (:mod:`flowexec.runtime.fastcall`) needs for ``n`` tensor
        arguments: each one's captured address (0: not borrowed), whether it is staged, the
        storages staged ones must stay apart from, and the liveness flag of the captured
        storages; None where :meth:`unshared` could not vouch (a storage died, or it has not
        run for the current closure state)."""
        if not self._alive[0] or self._forbidden is None:
            return None
        ptrs, staged = [0] * n, [False] * n
        for i, p in zip(self.positions, self.ptrs):
            ptrs[i] = p
        for i in self.staged:
            staged[i] = True
        return ptrs, staged, self._forbidden, self._alive


def distinct_storages(tensors: Sequence[Any], forbidden: frozenset[int]) -> bool | None:
    """Whether the tensors' storages are pairwise distinct, none of them at an address in
    ``forbidden`` and none empty (at 0); None when a tensor has no storage to read."""
    try:
        keys = [a.untyped_storage().data_ptr() for a in tensors]
    except (RuntimeError, NotImplementedError):
        return None
    return len(set(keys)) == len(keys) and forbidden.isdisjoint(keys) and 0 not in keys
