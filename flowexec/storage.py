"""Which tensors share a storage: what capture, the executable's staging checks and graph
mode's staged buffers all ask of the caller's real tensors (aliasing a graph cannot see, such
as ``x`` and ``x[2:]`` passed as two arguments). A leaf module: capture and the runtime both
use it without importing each other. Also which memory keeps its address across steps
(``mark_stable`` / ``is_stable``): what graphs read in place, and what capture must not move.

>>> b = torch.zeros(4)
>>> storage_groups([("x", b), ("y", torch.zeros(2)), ("z", b[1:])])
[['x', 'z'], ['y']]
>>> shared_storage([(3, b), (5, b[2:])])
((5, 3),)
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch


def storage_key(t: Any) -> int:
    """The address of a real tensor's storage (0 for anything else: fake tensors, empty ones)."""
    if not isinstance(t, torch.Tensor) or isinstance(t, torch._subclasses.FakeTensor):
        return 0
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return 0


def storage_id(t: torch.Tensor) -> int:
    """One number per storage, fake tensors' too (their views share it), where
    :func:`storage_key` has none for a fake tensor: what a capture's run tracks its writes by."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return -id(t)


def storage_groups(tensors: Sequence[tuple[Any, Any]]) -> list[list[Any]]:
    """The keys of ``(key, tensor)`` pairs grouped by the storage their tensors use, in the order
    first seen; a tensor without a real storage is a group of its own."""
    groups: dict[int, list[Any]] = {}
    for n, (key, t) in enumerate(tensors):
        groups.setdefault(storage_key(t) or -1 - n, []).append(key)
    return list(groups.values())


def shared_storage(tensors: Sequence[tuple[int, Any]]) -> tuple[tuple[int, int], ...]:
    """(value, first value on the same storage) for each (value id, tensor) whose storage an
    earlier one already uses: aliasing the graph cannot see (``x`` and ``x[2:]`` passed as two
    arguments, an argument that is closure state)."""
    return tuple((vid, group[0]) for group in storage_groups(tensors) for vid in group[1:])


# data_ptr -> tensor: memory that keeps its address across steps (static outputs of flowexec
# graphs, inputs a graph borrowed), which other graphs may borrow in turn.
_STABLE: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def _owner(ptr: int) -> torch.Tensor | None:
    """The tensor recorded for ``ptr`` while it still holds that address (a borrowed alias may
    have been moved since: ``.data = ...``, as outputs.py moves held outputs)."""
    held = _STABLE.get(ptr)
    return held if held is not None and held.data_ptr() == ptr else None


def mark_stable(t: torch.Tensor) -> None:
    """Record that ``t``'s memory keeps its address (a graph reads it in place)."""
    ptr = t.data_ptr()
    if _owner(ptr) is None:  # keep a live owner
        _STABLE[ptr] = t


def is_stable(t: torch.Tensor) -> bool:
    """Whether a tensor keeps its address across steps (so a graph may read it in place): a
    parameter, a static input for Dynamo, or memory whose recorded owner still holds it."""
    if isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None:
        return True
    return _owner(t.data_ptr()) is not None
