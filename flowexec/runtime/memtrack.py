"""Achieved memory: how many bytes a call really held at its peak, to set against the plan.

On CUDA the caching allocator counts for us (``max_memory_allocated`` over the call, less what
was allocated before it). On CPU there is no allocator statistic, so :class:`StorageTracker`
counts the storages the ops of the call create: a ``TorchDispatchMode`` sees every op's outputs
(the trace runner's pre-bound ``OpOverload._op`` calls go through the dispatcher too), adds a
storage's bytes the first time it appears and takes them off when the storage dies (a weakref
finalizer, which also fires when the async collector drops it on its worker thread). A view
shares its base's storage and is counted once; storages that existed before the call (inputs,
state, an arena) are not counted. Scratch space inside a kernel is invisible on CPU.

Example::

    >>> import torch, flowexec
    >>> from flowexec.runtime.memtrack import measure_memory
    >>> exe = flowexec.compile(lambda x: (x * 2).exp().sum(), torch.ones(1024))
    >>> r = measure_memory(exe, torch.ones(1024))
    >>> r["achieved_peak_bytes"] <= r["planned_peak_bytes"]
    True
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of storages created by ops while it is active, and their peak.

    ``known``: tensors whose storages existed before (never counted, also when an op returns
    a view of one).
    """

    def __init__(self, known: Iterable[Any] = ()) -> None:
        super().__init__()
        self._known = {_key(t) for t in known if isinstance(t, torch.Tensor)} - {0}
        self._live: dict[int, int] = {}
        self._lock = threading.Lock()  # finalizers run on whichever thread drops the storage
        self.current = 0
        self.peak = 0
        self.created = 0  # storages counted

    def _gone(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._live.pop(key, None) is not None:
                self.current -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            s = t.untyped_storage()
            key = s.data_ptr()
            if key == 0 or key in self._known:
                continue
            with self._lock:
                if key in self._live:
                    continue
                n = s.nbytes()
                self._live[key] = n
                self.current += n
                self.created += 1
                self.peak = max(self.peak, self.current)
            weakref.finalize(s, self._gone, key, n)
        return out


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def achieved_peak(call: Callable[[], Any], known: Iterable[Any] = (), device: torch.device | str = "cpu",
                  drain: Callable[[], Any] | None = None) -> tuple[int, Any]:
    """Run ``call()`` once and return (peak bytes it allocated above what was live before, its result).

    ``drain``: called after the call (and before reading the figure), e.g. to let the async
    collector finish, so that late frees are seen."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = call()
        if drain is not None:
            drain()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, result
    tracker = StorageTracker(known)
    with tracker:
        result = call()
    if drain is not None:
        drain()
    return tracker.peak, result


def measure_memory(exe: Any, *args: Any) -> dict[str, Any]:
    """Call ``exe(*args)`` once and report achieved against planned memory for its signature.

    Keys: ``planned_peak_bytes`` and ``lower_bound_bytes`` (from the plan), ``arena_bytes``
    (``memory="planned"``: the arenas, allocated before the call and counted into the achieved
    figure), ``achieved_peak_bytes`` (allocator statistics on CUDA, tracked storages on CPU),
    ``ratio`` (achieved / planned) and ``result`` (what the call returned).
    """
    from .gc import collector

    exe.compile_for(*args)
    plan = exe.plan
    stats = plan.stats()
    prog = plan.program
    devices = {v.meta.device for v in prog.values if v.meta is not None}
    device = next((d for d in devices if d.type == "cuda"), torch.device("cpu"))
    known = [a for a in args if isinstance(a, torch.Tensor)] + list(prog.state.values())
    known += [c for c in prog.consts.values() if isinstance(c, torch.Tensor)]
    known += [p.grad for p in prog.state.values() if getattr(p, "grad", None) is not None]
    from .arena import live_arenas

    known += live_arenas()
    drain = (lambda: collector().drain()) if plan.gc == "async" else None
    peak, result = achieved_peak(lambda: exe(*args), known, device, drain)
    arena = stats.get("arena_bytes", 0)
    achieved = peak + arena  # the arena was allocated before the call: neither count saw it
    planned = stats["planned_peak_bytes"]
    return {"planned_peak_bytes": planned, "lower_bound_bytes": stats["lower_bound_bytes"],
            "arena_bytes": arena, "achieved_peak_bytes": achieved,
            "ratio": achieved / planned if planned else float("nan"), "device": str(device), "result": result}
