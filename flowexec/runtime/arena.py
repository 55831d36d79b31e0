"""The arenas of a ``memory="planned"`` plan: one byte buffer per device, a view per planned value.

Built once when the plan is lowered (never per call): each planned value gets a contiguous
view of its shape and dtype at its offset, and the lowered runner passes it as the ``out=``
argument of the value's op. The arenas live as long as the runner, so between calls an
executable holds its arena (the plan's price: a fixed footprint, no allocator work per op).

Example::

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: (x * 2).exp().sum(), torch.ones(256), memory="planned")
    >>> exe(torch.ones(256)).item() == (torch.ones(256) * 2).exp().sum().item()
    True
"""
from __future__ import annotations

import weakref
from typing import Any

import torch

from ..passes.memory import MemoryPlan
from ..program import Program


_LIVE: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def allocate_arenas(mem: MemoryPlan) -> list[torch.Tensor]:
    """One uninitialised uint8 tensor per device, of the planned size."""
    arenas = [torch.empty(max(n, 1), dtype=torch.uint8, device=d) for n, d in zip(mem.arena_bytes, mem.devices)]
    for a in arenas:
        _LIVE[id(a)] = a
    return arenas


def live_arenas() -> list[torch.Tensor]:
    """Every arena still held by a lowered runner (memory accounting counts them apart)."""
    return list(_LIVE.values())


def arena_views(mem: MemoryPlan, prog: Program) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], dict[int, tuple[Any, str]]]:
    """(the arenas, value -> its view of an arena, value -> (out= overload, out argument name)).

    Real memory also where the lowering runs under a fake-tensor mode (the torch.compile
    backend lowers while AOTAutograd traces)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        arenas = allocate_arenas(mem)
        views: dict[int, torch.Tensor] = {}
        for p in mem.placements:
            meta = prog.values[p.root].meta
            assert meta is not None
            views[p.root] = arenas[p.arena][p.offset:p.offset + p.nbytes].view(meta.dtype).view(meta.shape)
    return arenas, views, dict(mem.out_overloads)


def bind_arenas(mem: MemoryPlan | None, prog: Program, glb: dict[str, Any]) -> dict[int, tuple[Any, str]]:
    """Put the arenas and a global ``A<vid>`` per planned view into a lowering's globals;
    return value -> (out= overload, out argument name), empty without a memory plan."""
    if mem is None:
        return {}
    glb["_arenas"], views, outs = arena_views(mem, prog)
    glb.update({f"A{vid}": t for vid, t in views.items()})
    return outs


def out_call(op: Any, outs: dict[int, tuple[Any, str]]) -> tuple[Any, str | None]:
    """(what the lowered code calls for ``op``, its extra ``name=A<vid>`` argument or None):
    a planned op calls its out= overload into its arena view (passes/memory.py orders reuse)."""
    into = outs.get(op.outputs[0]) if outs and op.outputs else None
    if into is None:
        return op.target, None
    return into[0], f"{into[1]}=A{op.outputs[0]}"
