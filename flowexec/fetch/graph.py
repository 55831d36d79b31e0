"""``graph+<launcher>``, fast_item's reader: a captured CUDA graph of the copy kernel per
(address, dtype) read more than once.

On the H200 machine a ``cuLaunchKernel`` call from Python cost 4.2 µs through cupy and 5.8 µs
through ctypes, while launching a captured graph of the same kernel and spinning for its result
took 4.9-5.7 µs in all (``benchmarks/results/item.json`` of 5b6372d, docs/history.md). So an address read a second time within the last
``HOT_MAX`` new addresses gets its own graph (a training loop's loss usually comes back at the
same address: the caching allocator reuses the block); first sightings use the direct launch of
:class:`~.kernel.KernelSlots` (slot 0, sequence numbers), and a round-robin over more addresses
never builds graphs, so no pattern pays a capture per read.

Each graph writes into slot 1: elements of up to 4 bytes with ``fx_ll`` (payload and the flag 1
in one aligned 8-byte store, no fence: such a store reaches host memory in one piece, the
property NCCL's LL protocol is built on; 0.6 µs less on the H200), wider ones with ``fx_read``
(payload, system fence, flag 1 at +16). The host clears the flag before every launch, and a
reader whose wait failed is retired with its graphs, so a late write can't be mistaken for a
later read's.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import settings
from .kernel import KernelSlots
from .slots import SLOT, Number, Spec, What, value_cell, wait

# A cached graph that reads one (address, dtype), as a plain tuple: fast_item's hot path takes
# all of it apart in one UNPACK_SEQUENCE (~20 ns; a NamedTuple's unpack takes the generic path,
# ~60 ns, and one attribute lookup per field more). Fields, in order:
#   launch  launch(exec, stream): falsy on success (a CUresult, or it raises)
#   exec    the CUgraphExec (destroyed on eviction)
#   flag    ctypes cell: the host clears it, the graph sets it after the payload
#   cell    ``.value`` is the read value (a ctypes cell, or a decoder)
#   lazy    0, or 1: check the negative bit, 2: also the conjugate bit
#   dev     None in a one-GPU process (no current-device check), else the device index
#   reader  the GraphSlots that owns it
#   idx     device index
HotEntry = tuple
E_LAUNCH, E_EXEC, E_FLAG, E_CELL, E_LAZY, E_DEV, E_READER, E_IDX = range(8)

HOT_MAX = 256  # graphs cached per thread; also the window in which a second sighting counts
SPIN = range(256)  # untimed polls before the timed spin-then-sleep wait takes over


def _nonzero(cell: Any, _: Any) -> bool:
    return cell.value != 0


class GraphSlots(KernelSlots):
    """fast_item's reader on one device: the kernel launched directly into slot 0 for first
    sightings, a graph per (address, dtype) into slot 1 for the addresses seen again."""

    def __init__(self, device_index: int, launcher: str) -> None:
        super().__init__(device_index, 2, launcher)
        self.name = f"graph+{launcher}"
        self._glaunch = self._nat.graph_launcher(launcher)
        self._gview = self.views[1]
        self._flag = self.views[1].seq  # fx_read's flag: 64 bits at +16
        self._ll_flag = ctypes.c_uint32.from_address(self._host + SLOT + 4)  # fx_ll's flag
        self._dev = None if torch.cuda.device_count() <= 1 else device_index
        self._cap: int | None = None
        self.seen: dict[tuple[int, torch.dtype], None] = {}

    def entry(self, ptr: int, spec: Spec) -> HotEntry:
        """Capture and instantiate the graph reading ``spec.nbytes`` at ``ptr`` (not cached)."""
        nat = self._nat
        if self._cap is None:
            self._cap = nat.stream_create()
        ll = spec.nbytes in nat.LL_SIZES
        p = self._p
        p[0], p[1], p[2] = ptr, self._dst[1], 1
        ex = nat.graph_of_launch(self._fns[-spec.nbytes if ll else spec.nbytes], self._paddr, self._cap)
        return (self._glaunch, ex, self._ll_flag if ll else self._flag, value_cell(spec, self._gview),
                spec.lazy, self._dev, self, self.device_index)

    def destroy(self, e: HotEntry) -> None:
        self._nat.driver().cuGraphExecDestroy(e[E_EXEC])

    def launch_failed(self, err: Any, e: HotEntry, stream: int) -> None:
        """A launcher returned an error code: make this thread's context current and retry once
        (a thread that has not touched CUDA through the runtime yet), else raise."""
        nat = self._nat
        if err == nat.CUDA_ERROR_INVALID_CONTEXT:
            nat.ensure_context(self.device_index)
            err = e[E_LAUNCH](e[E_EXEC], stream)
        if err:
            nat.check(int(err), "cuGraphLaunch(fx_read)")

    def wait_flag(self, flag: Any, t: torch.Tensor, stream: int, timeout: float | None,
                  spin_us: float | None) -> None:
        """The timed spin-then-sleep wait, once the untimed polls found no flag."""
        wait(_nonzero, flag, None, settings.timeout_s if timeout is None else timeout,
             settings.spin_s if spin_us is None else spin_us * 1e-6, self.check, stream, What(t, stream))

    def graph_item(self, e: HotEntry, stream: int, t: torch.Tensor, timeout: float | None,
                   spin_us: float | None) -> Number:
        """Replay ``e`` on ``stream`` and return its value (fast_item inlines the same steps)."""
        launch, ex, flag, cell, _, _, _, _ = e
        flag.value = 0
        err = launch(ex, stream)
        if err:
            self.launch_failed(err, e, stream)
        for _ in SPIN:
            if flag.value:
                return cell.value
        self.wait_flag(flag, t, stream, timeout, spin_us)
        return cell.value
