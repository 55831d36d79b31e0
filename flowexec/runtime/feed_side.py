"""Fed hyperparameters uploaded beside the program: an LR schedule adds nothing to a step's
device time.

A schedule's new values (``flowexec/hyperparams.py``'s :class:`~flowexec.hyperparams.Feeds`)
used to be copied to the device buffer the program reads in stream order before the next
replay: on the H200 that copy and the latency around it left the device idle 2.6-2.9 µs before
each replay whose values changed, and the same copy as the graph's own first node cost the same
(``docs/training.md``). Every copy in the replay's critical path costs that latency; this one need
not be in it, since only the optimizer reads the values, at the end of the step.

So in graph mode a program that reads fed values gets two calls from its runner
(``lower_trace``'s ``hooks``): before its first instruction that reads a fed value it waits for
the event ``ready``; after its last instruction it records the event ``done``. Both events are
*external* (``torch.cuda.Event(external=True)``), so a CUDA graph captured from the runner holds
an event-wait node and an event-record node for them, which each replay honours. A change is
uploaded on a stream of its own (:meth:`SideUpload.upload`): the side stream waits for ``done``
(the replays launched so far are the buffer's last readers), copies the values from a pinned
staging copy and records ``ready``; the next replay's forward and backward run meanwhile, and its
optimizer waits for ``ready`` — recorded long before, in practice. Nothing is launched on the
program's stream between two replays, and a step whose values did not change waits on an event
that has long passed.

Only plans on one stream take this path (a reader on another stream would need its own wait);
others, and programs on the CPU, keep the copy before the call.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..hyperparams import PinnedRing
from ..plan import ExecutionPlan


class SideUpload:
    """One device's fed values, uploaded on a side stream that the program waits on.

    ``buffer``: the packed device buffer the program reads; ``ring``: its pinned host copies
    (:class:`~flowexec.hyperparams.PinnedRing`), the copies here recorded on the side stream.
    """

    # Tests only: GPU clock cycles the side stream sleeps before each copy, so that a replay
    # that did not wait for its values would read the old ones (tests/gpu/test_training_gpu.py).
    delay_cycles = 0

    def __init__(self, buffer: torch.Tensor, ring: PinnedRing) -> None:
        self.buffer = buffer
        self.device = buffer.device
        self.ring = ring
        # High priority: a pool of its own (torch hands out pooled streams, and one shared with
        # the program's stream would copy in line again), and the small copy goes first.
        self.stream = torch.cuda.Stream(device=self.device, priority=-1)
        # The buffer is written on this stream: the allocator must not reuse its memory while a
        # copy there is queued (the program that read it may be dropped first).
        buffer.record_stream(self.stream)
        self.ready = torch.cuda.Event(external=True)
        self.done = torch.cuda.Event(external=True)
        # Recorded once now: torch makes an event at its first record, and a wait on one never
        # recorded is no wait at all, so a graph captured before the first change would hold no
        # wait node and never wait for the changes after it.
        self.ready.record(self.stream)
        self.done.record(self.stream)

    def wait_ready(self) -> None:
        """The runner's call before the first reader: the last upload is in the buffer."""
        torch.cuda.current_stream(self.device).wait_event(self.ready)

    def record_done(self) -> None:
        """The runner's call after its last instruction: this run has read the buffer."""
        self.done.record(torch.cuda.current_stream(self.device))

    def upload(self, host: torch.Tensor) -> None:
        """Copy ``host`` (the values now) into the buffer once the runs launched so far are
        done with it, without touching the program's stream."""
        pinned = self.ring.fill(host)
        side = self.stream
        side.wait_event(self.done)
        with torch.cuda.stream(side):
            if self.delay_cycles:
                torch.cuda._sleep(self.delay_cycles)
            self.buffer.copy_(pinned, non_blocking=True)
        self.ready.record(side)
        self.ring.passed(side)


def first_reader(plan: ExecutionPlan, buffer: torch.Tensor) -> int | None:
    """The position of the first instruction that takes a state value on ``buffer``'s storage
    (a fed value), or None where none does."""
    storage = buffer.untyped_storage().data_ptr()
    on_buffer = {vid for vid, t in plan.program.state.items()
                 if isinstance(t, torch.Tensor) and t.device == buffer.device
                 and t.untyped_storage().data_ptr() == storage}
    if not on_buffer:
        return None
    for pos, ins in enumerate(plan.instructions):
        if on_buffer.intersection(ins.op.refs()):
            return pos
    return None


def side_hooks(plan: ExecutionPlan, feeds: Any,
               make: Callable[[torch.Tensor, PinnedRing], Any] = SideUpload
               ) -> dict[int, Callable[[], None]] | None:
    """The runner's hooks that let ``feeds``' one CUDA buffer go up beside ``plan`` (and the
    feeds switched to that upload), or None where the plan keeps the copy before each call:
    no CUDA buffer with staging copies, more than one, a plan on several streams, or no
    instruction reading the values."""
    if feeds is None or plan.n_streams != 1 or plan.on_workers:
        return None
    cuda = [d for d, b in feeds.buffers.items() if d.type == "cuda" and feeds.staging.get(d)]
    if len(cuda) != 1 or len(feeds.buffers) != 1:
        return None
    d = cuda[0]
    pos = first_reader(plan, feeds.buffers[d])
    if pos is None:
        return None
    side = feeds.side.get(d)
    if side is None:
        try:
            side = make(feeds.buffers[d], feeds.ring(d))
        except (TypeError, RuntimeError):  # a torch without external events: the copy before each call
            return None
        feeds.attach_side(d, side)
    return {pos: side.wait_ready, len(plan.instructions): side.record_done}
