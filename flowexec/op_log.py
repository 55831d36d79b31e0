"""The ops a capture's run dispatches, with every argument named by where it came from.

A kept program (flowexec/kept.py) is taken in a later process only where that process's step
would be captured into the same program. A capture is ``make_fx``'s record of the ATen ops the
step dispatches, so two runs that dispatch the same ops, on the same arguments, in the same
order, make the same program. An :class:`OpLog` is that sequence in a form two processes can
compare: each op by name, each tensor argument by its role (an input of the call, an output of
an earlier op, a lifted hyperparameter, or the n-th tensor of fn's state the run read), every
other argument by type and value. A later process runs the step once more on fake tensors
without ``make_fx`` (``capture.replay``: about a third of a capture's cost) and takes the kept
program only where its log is the kept one's (:func:`first_difference`).

    >>> import torch
    >>> w = torch.ones(2)
    >>> log = OpLog()
    >>> x = torch.zeros(2)
    >>> log.inputs([x])
    >>> y = torch.ops.aten.mul.Tensor(x, w)
    >>> log.op(torch.ops.aten.mul.Tensor, (x, w), {}, y)
    >>> name, (a, b), _ = log.entries[0]
    >>> name, a, b[:2]
    ('aten.mul.Tensor', ('in', 0), ('state', 0))
    >>> log.state[0] is w
    True
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Sequence

import torch

from .storage import storage_id

Role = tuple


class OpLog:
    """The run's ops in dispatch order (:attr:`entries`), and the tensors of fn's state that
    they read (:attr:`state`: real tensors no op of the run made, and fn's own generators, in
    the order first read).
    :attr:`lifted`: the feed slot of a lifted hyperparameter tensor, or None for any other.
    :attr:`opaque` says why the log cannot stand for the run (an argument it cannot name)."""

    def __init__(self, lifted: Callable[[torch.Tensor], int | None] = lambda t: None) -> None:
        self.entries: list[tuple] = []
        self.state: list[Any] = []
        self.opaque: str | None = None
        self.flags: tuple = ()  # (how the run was made: capture.trace's retries)
        self.lifted = lifted
        self._roles: dict[int, tuple[weakref.ref, Role]] = {}  # id(t) -> (t weakly, its role)
        # storage_id -> (the storage, held: a freed one's id would come back for another; the role
        # of the first tensor seen on it). (A log is kept of fake runs alone, whose storages hold
        # no memory.)
        self._storages: dict[int, tuple[Any, Role]] = {}

    def inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """The run's placeholders: the call's tensors, then the gradients it reads."""
        for i, t in enumerate(tensors):
            self._name(t, ("in", i))

    def op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """One dispatched op and its result (whose tensors later ops name by it)."""
        name = _op_name(func)
        if name.startswith("profiler."):  # (record_function's markers: no program keeps them)
            return
        k = len(self.entries)
        self.entries.append((name, self._enc(args), tuple((n, self._enc(v)) for n, v in kwargs.items())))
        if isinstance(out, torch.Tensor):
            self._name(out, ("op", k, 0))
        elif isinstance(out, (list, tuple)):
            for i, o in enumerate(_leaves(out)):
                if isinstance(o, torch.Tensor):
                    self._name(o, ("op", k, i))

    def read(self, func: Any, args: tuple) -> None:
        """A host read the run answered without an op (a constant's, a lifted value's)."""
        self.entries.append(("read", _op_name(func), self._enc(args)))

    def result(self, outs: Sequence[Any]) -> None:
        """What the run returned (fn's outputs, then the gradients and state it made)."""
        self.entries.append(("out", self._enc(tuple(outs))))

    def _name(self, t: torch.Tensor, role: Role) -> None:
        self._roles[id(t)] = (weakref.ref(t), role)
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # (a tensor subclass with no storage)
            return
        self._storages.setdefault(st._cdata, (st, role))

    def _known(self, obj: Any) -> Role | None:
        hit = self._roles.get(id(obj))
        return hit[1] if hit is not None and hit[0]() is obj else None

    def role(self, t: torch.Tensor) -> Role:
        known = self._known(t)
        if known is not None:
            return known
        slot = self.lifted(t)
        if slot is not None:
            role: Role = ("lift", slot)
        else:
            on = self._storages.get(storage_id(t))
            if on is not None:  # (a view no op made: ``.data``, ``detach`` outside dispatch)
                role = ("view", on[1], t.storage_offset(), tuple(t.shape), tuple(t.stride()), str(t.dtype))
            elif _is_fake(t):
                self.opaque = self.opaque or f"a fake tensor ({t.dtype}, {tuple(t.shape)}) that no op of the run made"
                role = ("unknown", len(self._roles))
            else:  # fn's state: the parameters, buffers and optimizer state it reads
                self.state.append(t)
                role = ("state", len(self.state) - 1, str(t.dtype), tuple(t.shape), tuple(t.stride()),
                        t.storage_offset(), str(t.device))
        self._name(t, role)
        return role

    def _enc(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return self.role(a)
        if a is None or type(a) is int or type(a) is str:
            return a
        if type(a) is float:  # (by its bits: 1 and 1.0 take other overloads' paths; -0.0, nan)
            return ("f", a.hex())
        if type(a) is bool:
            return ("b", a)
        if isinstance(a, (list, tuple)):
            return tuple(self._enc(x) for x in a)
        if isinstance(a, torch.Generator):  # (one of fn's own: found again as state is)
            known = self._known(a)
            if known is not None:
                return known
            self.state.append(a)
            role: Role = ("generator", len(self.state) - 1, str(a.device))
            self._roles[id(a)] = (weakref.ref(a), role)
            return role
        if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return ("t", str(a))
        if isinstance(a, (int, float, complex)):  # (numpy's and other numbers)
            return ("n", type(a).__name__, repr(a))
        self.opaque = self.opaque or f"an argument of type {type(a).__name__}"
        return ("opaque", type(a).__name__)


def first_difference(now: Sequence[tuple], was: Sequence[tuple]) -> str | None:
    """Where two logs' entries part, in words; None where they are the same."""
    if len(now) == len(was) and now == was:
        return None
    for k, (a, b) in enumerate(zip(now, was)):
        if a != b:
            return f"op {k} is {_shown(a)} where the program was captured with {_shown(b)}"
    n = min(len(now), len(was))
    return f"the run dispatched {len(now)} ops where the capture dispatched {len(was)} (from op {n} on)"


def _shown(entry: tuple) -> str:
    text = repr(entry)
    return text if len(text) <= 160 else text[:157] + "..."


@functools.lru_cache(maxsize=None)
def _op_name(func: Any) -> str:
    return str(func)


def _leaves(out: Any) -> list[Any]:
    flat: list[Any] = []
    for o in out:
        if isinstance(o, (list, tuple)):
            flat.extend(_leaves(o))
        else:
            flat.append(o)
    return flat


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor)
