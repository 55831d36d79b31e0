"""Host reads whose answer a random draw's range decides: ``if torch.rand([]) < p`` with ``p = 0``.

LayerDrop, as Hugging Face's BART, OPT, Whisper and their kin wrote it in training mode (up to
transformers 5.17), draws one number per layer and skips the layer where it falls below
``layerdrop``::

    dropout_probability = torch.rand([])
    if dropout_probability < self.layerdrop:  # skip the layer
        continue

That is a host read of a value every call draws anew, which one static program cannot hold, and
the capture refused it. With ``layerdrop = 0`` (the default) the answer is the same at every
call: a draw of ``rand`` lies in [0, 1], never below 0. :class:`DrawRanges` keeps the interval
each uniform draw lies in, and a comparison of such a draw with a number whose answer that
interval settles; the capture answers a host read of that comparison as eager would, and the
draw stays in the program, so the generator moves as eager's does. The number compared with is a
value fn read (a module attribute, a global), which the guards hold: ``layerdrop = 0.1`` later
captures again, and that capture is refused as before. Intervals are closed (a low-precision
draw may round up to its bound), and a write into a draw's storage forgets what was known of it.

Example::

    >>> import torch
    >>> ranges = DrawRanges()
    >>> r = torch.rand([])
    >>> ranges.record(torch.ops.aten.rand.default, ([],), {}, r, [])
    >>> below = r < 0.0
    >>> ranges.record(torch.ops.aten.lt.Scalar, (r, 0.0), {}, below, [])
    >>> ranges.answer(below)
    False
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from .storage import storage_id

__all__ = ["DrawRanges"]

_aten = torch.ops.aten


def _unit(args: tuple, kwargs: dict) -> tuple[float, float]:
    return 0.0, 1.0


def _bounds_of_uniform(args: tuple, kwargs: dict) -> tuple[float, float]:
    lo = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
    hi = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
    return float(lo), float(hi)


# Random draws of a known closed interval: op -> bounds from its arguments.
_DRAWS: dict[Any, Callable[[tuple, dict], tuple[float, float]]] = {
    _aten.rand.default: _unit,
    _aten.rand.generator: _unit,
    _aten.rand_like.default: _unit,
    _aten.uniform_.default: _bounds_of_uniform,
    _aten.uniform.default: _bounds_of_uniform,
}

# Comparisons with a number: op -> (the test, whether it holds for every value in [lo, hi],
# whether it fails for every one), each given (lo, hi, c).
_COMPARES: dict[Any, tuple[Callable[..., bool], Callable[..., bool]]] = {
    _aten.lt.Scalar: (lambda lo, hi, c: hi < c, lambda lo, hi, c: lo >= c),
    _aten.le.Scalar: (lambda lo, hi, c: hi <= c, lambda lo, hi, c: lo > c),
    _aten.gt.Scalar: (lambda lo, hi, c: lo > c, lambda lo, hi, c: hi <= c),
    _aten.ge.Scalar: (lambda lo, hi, c: lo >= c, lambda lo, hi, c: hi < c),
}


class DrawRanges:
    """What a capture's run knows of its random draws: the interval each lies in, and the
    comparisons those intervals settle (see the module docstring). Tensors are held weakly."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, Any, int]] = {}  # id -> (tensor, (lo, hi) or bool, storage)

    def _get(self, t: Any) -> Any:
        hit = self._known.get(id(t)) if isinstance(t, torch.Tensor) else None
        return hit[1] if hit is not None and hit[0]() is t else None

    def record(self, func: Any, args: Sequence[Any], kwargs: dict, out: Any, written: Sequence[torch.Tensor]) -> None:
        """After op ``func`` ran: forget what its writes overwrote, then keep a draw's interval
        or a settled comparison's answer."""
        if written and self._known:
            hit = {storage_id(t) for t in written}
            for k in [k for k, (_, _, s) in self._known.items() if s in hit]:
                del self._known[k]
        draw = _DRAWS.get(func)
        if draw is not None:
            target = args[0] if func is _aten.uniform_.default else out
            if isinstance(target, torch.Tensor) and target.dtype.is_floating_point:
                self._keep(target, draw(tuple(args), kwargs))
            return
        test = _COMPARES.get(func)
        if test is None or len(args) < 2 or not isinstance(out, torch.Tensor):
            return
        bounds, c = self._get(args[0]), args[1]
        if not isinstance(bounds, tuple) or isinstance(c, bool) or not isinstance(c, (int, float)):
            return
        holds, fails = test
        if holds(*bounds, c):
            self._keep(out, True)
        elif fails(*bounds, c):
            self._keep(out, False)

    def _keep(self, t: torch.Tensor, what: Any) -> None:
        self._known[id(t)] = (weakref.ref(t), what, storage_id(t))

    def answer(self, t: Any) -> bool | None:
        """The value of a one-element comparison the draws' intervals settled, else None."""
        got = self._get(t)
        return got if isinstance(got, bool) and t.numel() == 1 else None
