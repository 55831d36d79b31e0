"""Graph mode: the lowered trace runner captured once into a CUDA graph, then replayed.

Inputs come in two kinds. *Staged* inputs (per-call data) get a static buffer that each call
copies into. *Borrowed* inputs (parameters, buffers, static outputs of another flowexec graph)
are read in place at the address they had at capture; a call that passes a borrowed input at
another address re-captures (the caller sees a warning). State bound by the program (closure
tensors) is always the caller's own memory.

Outputs are the graph's static buffers. What a call returns stays valid: before the next
replay, any output the caller still holds is moved to a private copy (copy-on-overwrite), so
the common loop that drops last step's results pays nothing.

Example (needs CUDA)::

    >>> import torch, flowexec  # doctest: +SKIP
    >>> w = torch.randn(64, 64, device="cuda")  # doctest: +SKIP
    >>> exe = flowexec.compile(lambda x: (x @ w).relu(), torch.randn(8, 64, device="cuda"), mode="graph")  # doctest: +SKIP
    >>> y = exe(torch.randn(8, 64, device="cuda"))  # doctest: +SKIP
"""
from __future__ import annotations

import weakref
from sys import getrefcount
from typing import Any, Callable, Sequence

import torch

# data_ptr -> tensor: memory that keeps its address across steps (static outputs of flowexec
# graphs, inputs a graph borrowed), which other graphs may borrow in turn.
_STABLE: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()


def mark_stable(t: torch.Tensor) -> None:
    """Record that ``t``'s memory keeps its address (a graph reads it in place)."""
    _STABLE[t.data_ptr()] = t


def is_stable(t: torch.Tensor) -> bool:
    """Whether a tensor keeps its address across steps (so a graph may read it in place)."""
    return (
        isinstance(t, torch.nn.Parameter)
        or getattr(t, "_dynamo_static_input_type", None) is not None
        or t.data_ptr() in _STABLE
    )


def capture_graph(fn: Callable[[], Any], warmup: int = 3, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``fn`` up on a side stream, then capture one call of it; returns (graph, its outputs).

    The warm-up lets lazily created library state (cuBLAS handles, workspaces) exist before
    capture, where creating it is not allowed.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outs = fn()
    return graph, outs


class HandedOutputs:
    """The aliases of static output buffers that calls hand out, with copy-on-overwrite.

    One alias per buffer is reused call after call. Before the buffers are overwritten,
    ``release()`` moves any alias that someone still holds — a Python reference, or a C++ one
    such as a ``.grad`` autograd stole — to private memory, and makes a fresh alias for later
    calls. An alias nobody kept costs one reference-count check.

    >>> import torch
    >>> buf = torch.zeros(2)
    >>> h = HandedOutputs([buf])
    >>> kept = h.aliases[0]
    >>> h.release(); buf.fill_(1.0)
    tensor([1., 1.])
    >>> kept, h.moved
    (tensor([0., 0.]), 1)
    """

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        self.buffers = list(buffers)
        self.aliases = [b.detach() for b in self.buffers]
        self.moved = 0  # how many held aliases were moved to private memory (for tests/stats)
        self._base = self._refcounts()

    def _refcounts(self) -> list[int]:
        # Same access pattern as release(): the list, the local name, getrefcount's argument.
        aliases = self.aliases
        counts = []
        for k in range(len(aliases)):
            alias = aliases[k]
            counts.append(getrefcount(alias))
        return counts

    def release(self) -> None:
        aliases, base = self.aliases, self._base
        for k in range(len(aliases)):
            alias = aliases[k]
            if getrefcount(alias) > base[k] or alias._use_count() > 1:
                alias.data = alias.clone()
                aliases[k] = self.buffers[k].detach()
                self.moved += 1


class CudaGraphRunner:
    """Captures ``run(*inputs)`` into a CUDA graph and replays it per call."""

    def __init__(
        self,
        run: Callable[..., list[Any]],
        example_inputs: Sequence[Any],
        mutated: Sequence[torch.Tensor],
        borrow: Sequence[bool],
        mutated_inputs: Sequence[int] = (),
        unprotected_outputs: Sequence[int] = (),
        pool: Any = None,
        warmup: int = 1,
        before_replay: Callable[[], None] | None = None,
        state: Any = (),
    ) -> None:
        self.before_replay = before_replay
        self.borrow = tuple(borrow)
        self.static_inputs: list[Any] = []
        for a, b in zip(example_inputs, self.borrow):
            if isinstance(a, torch.Tensor) and not b:
                self.static_inputs.append(a.detach().clone())
            else:
                self.static_inputs.append(a)
        self._staged = [i for i, (a, b) in enumerate(zip(example_inputs, self.borrow)) if isinstance(a, torch.Tensor) and not b]
        self._borrowed = [(i, a.data_ptr()) for i, (a, b) in enumerate(zip(example_inputs, self.borrow)) if isinstance(a, torch.Tensor) and b]
        self._staged_ptrs = [(i, self.static_inputs[i].data_ptr()) for i in self._staged]
        self._mutated_inputs = [i for i in mutated_inputs if i in self._staged]
        # Replays and warm-up must not change the caller's state: snapshot what the program
        # writes in place and restore it after warm-up.
        snapshot = [(t, t.detach().clone()) for t in mutated]
        self.graph, outs = capture_graph(lambda: run(*self.static_inputs), warmup, pool)
        with torch.no_grad():
            for t, saved in snapshot:
                t.copy_(saved)
        self.static_outputs = outs
        # Outputs that are the caller's own memory (inputs, state) are live views, never protected.
        input_storages = {a.untyped_storage().data_ptr() for a in [*self.static_inputs, *state] if isinstance(a, torch.Tensor)}
        skip = set(unprotected_outputs)
        self._protect = []
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in input_storages:
                mark_stable(o)
                if i not in skip:
                    self._protect.append(i)
        self.outputs = HandedOutputs([outs[i] for i in self._protect])
        self.pool = self.graph.pool()

    def matches(self, args: Sequence[Any]) -> bool:
        """Whether every borrowed input is still at its captured address."""
        for i, ptr in self._borrowed:
            if args[i].data_ptr() != ptr:
                return False
        return True

    def __call__(self, args: Sequence[Any]) -> list[Any]:
        static = self.static_inputs
        dst, src = [], []
        for i, ptr in self._staged_ptrs:
            a = args[i]
            if a.data_ptr() != ptr:  # the caller may pass the static buffer itself
                dst.append(static[i])
                src.append(a)
        if len(dst) == 1:
            dst[0].copy_(src[0])
        elif dst:
            torch._foreach_copy_(dst, src)  # one call for all staged inputs
        self.outputs.release()
        if self.before_replay is not None:
            self.before_replay()
        self.graph.replay()
        for i in self._mutated_inputs:
            args[i].copy_(static[i])
        outs = list(self.static_outputs)
        for i, alias in zip(self._protect, self.outputs.aliases):
            outs[i] = alias
        return outs
