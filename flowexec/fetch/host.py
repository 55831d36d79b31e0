"""CPU rings (``cpu``): the value is taken at submit, or when the producer's readiness object
(a ``threading.Event``, set by a CPU worker) is set."""
from __future__ import annotations

import torch

from .slots import Number, Readiness, Slots, Spec


class HostSlots(Slots):
    """``n`` slots of Python values."""

    name = "cpu"

    def __init__(self, n: int) -> None:
        self._ready: list[Readiness | None] = [None] * n
        self._value: list[Number | None] = [None] * n

    def put(self, i: int, t: torch.Tensor, ready: Readiness | None) -> None:
        self._ready[i] = ready
        self._value[i] = t.item() if ready is None else None

    def ready(self, i: int, seq: int) -> bool:
        r = self._ready[i]
        return r is None or bool(r.is_set())

    def read(self, i: int, spec: Spec, t: torch.Tensor | None) -> Number:
        if self._ready[i] is None:
            return self._value[i]  # type: ignore[return-value]
        assert t is not None
        return t.item()

    def order(self, consumer: int, producer: int) -> None:
        pass
