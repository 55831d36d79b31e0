"""Low-latency scalar readback and asynchronous fetches (docs/fetch.md).

``fast_item(t)`` returns ``t.item()`` faster on CUDA; ``FetchRing.submit(t)`` starts copying a
scalar to the host without waiting and returns a :class:`Fetch` whose ``result()`` waits for that
value alone. Every wait spins briefly, then sleeps with back-off, and raises
:class:`FetchTimeoutError` naming what it waited for instead of hanging.

One module a part:

* :mod:`.slots` — the 32-byte slot a value lands in, decoding every dtype, the wait, the
  :class:`~.slots.Slots` interface the back-ends implement;
* back-ends: :mod:`.kernel` (a one-thread PTX kernel launched into a host-mapped slot: rings and
  first sightings), :mod:`.graph` (``graph+cupy`` / ``graph+ctypes``: captured graphs of that
  kernel for addresses read again, fast_item's reader), :mod:`.torch_copy` (``torch``: the
  fallback that needs only torch), :mod:`.host` (``cpu`` rings);
* :mod:`.choose` — which back-end a machine uses; :mod:`.settings` — timeouts and spins;
* :mod:`.item` — ``fast_item``; :mod:`.ring` — ``FetchRing`` and ``Fetch``.

>>> fast_item(torch.tensor(3))
3
>>> FetchRing("cpu", slots=2).submit(torch.tensor(0.5)).result()
0.5
"""
from __future__ import annotations

from typing import Any

import torch

from . import choose, item, settings
from .item import fast_item
from .ring import Fetch, FetchRing
from .slots import FetchTimeoutError

__all__ = ["fast_item", "Fetch", "FetchRing", "FetchTimeoutError", "backend", "configure"]


def backend() -> str:
    """The readback path in use: ``"graph+cupy"``, ``"graph+ctypes"``, ``"torch"``, or ``"cpu"``
    where CUDA is unavailable. Picks it if none is picked yet (on CUDA: the first that loads and
    reads known values back correctly).

    >>> backend() in ("cpu", "torch") or backend().startswith("graph+")
    True
    """
    if choose.chosen is not None:
        return choose.chosen
    if not torch.cuda.is_available():
        return "cpu"
    return choose.choose(torch.cuda.current_device())


def configure(*, timeout: float | None = None, spin_us: float | None = None,
              backend: str | None = None) -> dict[str, Any]:
    """Set process-wide defaults; returns the previous ones (pass them back to restore).

    ``timeout`` (s) bounds every wait, ``spin_us`` is how long a wait busy-polls before it sleeps,
    ``backend`` is ``"auto"``, ``"graph"``, ``"graph+cupy"``, ``"graph+ctypes"`` or ``"torch"``
    (takes effect for new readers and rings).

    >>> old = configure(spin_us=50)
    >>> _ = configure(**old)
    """
    old = {"timeout": settings.timeout_s, "spin_us": settings.spin_s * 1e6, "backend": settings.backend}
    if timeout is not None:
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 s, got {timeout}")
        settings.timeout_s = float(timeout)
    if spin_us is not None:
        if spin_us < 0:
            raise ValueError(f"spin_us must be >= 0, got {spin_us}")
        settings.spin_s = float(spin_us) * 1e-6
    if backend is not None and backend != settings.backend:
        choose.candidates(backend)  # validates the name
        settings.backend = backend
        choose.reset()
        item.reset()
    return old
