"""Graph mode's CUDA graphs for one input signature (:class:`GraphVariants`), and what graphs'
fixed addresses decide: which arguments a graph reads in place (:func:`borrowed_inputs`) and
which gradients capture may move into host memory for a while (:func:`worth_parking`).

>>> a = torch.zeros(3)
>>> sorted(sharing_positions([a, torch.zeros(2), a[1:]]))
[0, 2]
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Sequence

import torch

from . import parking
from .errors import RecaptureWarning
from .storage import is_stable, storage_groups


def borrowed_inputs(targs: Sequence[torch.Tensor], mutated_inputs: Sequence[int]) -> list[bool]:
    """Which tensor arguments graph mode reads in place: those ``fn`` writes in place (state such as
    optimizer moments, passed the same each call) and parameters or other graphs' static outputs.

    Copying them in and back each call costs two full copies apiece (an Adam-like step over
    64 MiB states took longer than eager that way). An argument that shares memory with another
    stays staged, so the capture sees the aliasing it was traced with.

    >>> a, b = torch.zeros(3), torch.zeros(3)
    >>> borrowed_inputs([a, b, a[1:]], mutated_inputs=[0, 1])
    [False, True, False]
    """
    shared = sharing_positions(targs)
    wanted = set(mutated_inputs)
    return [(k in wanted or is_stable(a)) and k not in shared for k, a in enumerate(targs)]


def sharing_positions(targs: Sequence[torch.Tensor]) -> set[int]:
    """The positions of tensors that share a storage with another of ``targs``."""
    return {k for group in storage_groups(list(enumerate(targs))) if len(group) > 1 for k in group}


def worth_parking(g: torch.Tensor) -> bool:
    """Whether capture may park gradient ``g`` (flowexec.parking): off the host, and not memory
    a CUDA graph writes at a fixed address (a graph's static output, which flowexec's graphs
    mark stable; anything while CUDA-graph trees manage the device's pool)."""
    if not parking.on_a_device(g):
        return False
    if is_stable(g):
        return False
    # (trees exist only once their module is imported: importing it here would load Inductor)
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if g.is_cuda and trees is not None:
        index = g.device.index if g.device.index is not None else torch.cuda.current_device()
        if trees.get_manager(index, create_if_none_exists=False) is not None:
            return False
    return True


class GraphVariants:
    """Graph mode's CUDA graphs for one input signature.

    A graph reads its borrowed inputs at the addresses it was captured with
    (``CudaGraphRunner.matches``). A call that passes one at another address gets a second
    borrowing graph (the common case: ``compile`` was given copies, the calls pass the real
    state); past ``max_borrowing`` graphs, calls whose borrowed addresses match none run on one
    graph that stages every input (copies in, and back for those written), with a warning once.

    ``capture(targs, borrow)`` builds a runner; ``borrow`` says which arguments to read in place.
    """

    def __init__(self, capture: Callable[[Sequence[torch.Tensor], Sequence[bool]], Any],
                 targs: Sequence[torch.Tensor], borrow: Sequence[bool], max_borrowing: int = 2) -> None:
        self._capture = capture
        self._borrow = list(borrow)
        self.max_borrowing = max_borrowing
        self.first = capture(targs, self._borrow)
        self._graphs: list[Any] = [self.first]
        self._checks: list[tuple[Any, Any]] = []  # (graph.borrowed, graph) per graph, for select()
        self._staged: Any = None

    @property
    def static_inputs(self) -> list[Any]:
        """The first graph's input buffers (a borrowed input's is the tensor it was captured with)."""
        return self.first.input_buffers()

    @property
    def graph_count(self) -> int:
        return len(self._graphs) + (self._staged is not None)

    def select(self, targs: Sequence[torch.Tensor], state_keys: frozenset[int]) -> Any:
        """The graph whose borrowed inputs are at ``targs``' addresses, when its precomputed
        check (:class:`~flowexec.runtime.borrowed.BorrowedAddresses`) finds that no argument
        shares a storage with another or with closure state (``state_keys``); else None, and
        the caller checks every argument's storage and calls this object."""
        checks = self._checks
        if len(checks) != len(self._graphs):  # (stand-in runners in tests may have no checks)
            checks = self._checks = [(getattr(g, "borrowed", None), g) for g in self._graphs]
        for check, g in checks:
            if check is None:
                return None
            if check.matches(targs):
                return g if check.unshared(targs, state_keys) else None
        return None

    def __call__(self, targs: Sequence[torch.Tensor]) -> list[Any]:
        for g in self._graphs:  # a graph that borrows nothing matches every call
            if g.matches(targs):
                return g(targs)
        if len(self._graphs) < self.max_borrowing:
            self._graphs.append(self._capture(targs, self._borrow))
            return self._graphs[-1](targs)
        if self._staged is None:
            names = ", ".join(str(k) for k, b in enumerate(self._borrow) if b)
            warnings.warn(
                f"flowexec: tensor argument(s) {names} (written in place by fn, or parameters) came at "
                f"{self.max_borrowing + 1} different addresses; graph mode now copies them in (and back) on "
                "such calls. Pass the same tensors each call to have them read in place.",
                RecaptureWarning, stacklevel=3)
            self._staged = self._capture(targs, [False] * len(targs))
        return self._staged(targs)
