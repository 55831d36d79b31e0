"""Forward-only passes through a pipeline: the validation loss, or the model's outputs, with no
backward, no gradients and no optimizer step (torch.distributed.pipelining's
``schedule.eval``, Megatron-LM's ``forward_only``).

Every rank runs its stages' forwards in stage order, each over every micro-batch
(:func:`forward_plan`), so a stage never waits for a later one and no plan can deadlock. The
modules run eagerly under ``torch.no_grad()``: a forward-only pass saves nothing for a backward,
and the compiled stages' programs, with their per-micro-batch saved values, stay untouched for
training. Shapes are not fixed: every message is preceded by a small header with its shapes and
dtypes (once a stage boundary: the micro-batches are equal parts of the batch), so the batch may
differ from the training batch. Train/eval mode (dropout, batch
norm) is the modules' own: call ``module.eval()`` on the stages first if you want it.

>>> from flowexec.pipeline.schedules import v_placement
>>> [str(j) for j in forward_plan(v_placement(2, 4), 2)[0]]
['0F0', '0F1', '3F0', '3F1']
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from .runner import _as_tuple
from .schedules import Job
from .stage import recv_spec, send_spec, spec_of, wire

# Tags of the forward-only messages (gloo matches on them; NCCL on the order, which is the same
# on both ends): apart from a step's (below 1 << 20), the set-up's (1 << 20 | stage) and the
# warm-up's (1 << 21).
_TAG = 1 << 22


def forward_plan(owner: Mapping[int, int], n_micro: int) -> dict[int, tuple[Job, ...]]:
    """Per rank, the forwards of its stages in stage order, each over every micro-batch."""
    plan: dict[int, list[Job]] = {r: [] for r in sorted(set(owner.values()))}
    for s in sorted(owner):
        plan[owner[s]].extend(Job(s, "F", m) for m in range(n_micro))
    return {r: tuple(js) for r, js in plan.items()}


def _tags(stage: int, micro: int, n: int) -> list[int]:
    return [_TAG | (stage << 14) | (micro << 4) | i for i in range(n)]


def evaluate(trainer: Any, inputs: Any = None, targets: Any = None) -> torch.Tensor | None:
    """One forward-only pass of ``trainer``'s pipeline over a batch (every rank calls it):
    the mean of ``loss_fn`` over the micro-batches where ``targets`` are given, else the last
    stage's output for the whole batch (its micro-batches' outputs joined on dim 0; the first
    tensor of a tuple); on the last stage's rank, None elsewhere."""
    last = trainer.n_stages - 1
    n = trainer.n_micro
    if n >= 1 << 10 or trainer.n_stages >= 1 << 8:  # the fields of _tags
        raise ValueError(f"evaluate() supports up to 1023 micro-batches and 255 stages, got {n} and {trainer.n_stages}")
    xs, ys = trainer._micro_batches(inputs, targets, "evaluate()", targets_needed=False)
    hdr_dev = trainer.device if trainer.nccl else torch.device("cpu")
    owner, rank = trainer.owner, trainer.rank
    held: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (stage, micro) -> its input, handed over locally
    sends: list[tuple[Any, Any]] = []
    results: list[Any] = []
    specs: dict[int, Any] = {}  # stage -> its input's spec, sent or received with micro-batch 0
    with torch.no_grad():
        for job in forward_plan(owner, n)[rank]:
            s, m = job.stage, job.micro
            if s == 0:
                got = xs[m]  # type: ignore[index]
            elif owner[s - 1] == rank:
                got = held.pop((s, m))
            else:
                got = _receive(trainer, owner[s - 1], s, m, hdr_dev, specs)
            out = trainer.modules[s](*got)
            if s == last:
                results.append(trainer.loss_fn(out, ys[m]) if ys is not None else _as_tuple(out)[0])
                continue
            outs = _as_tuple(out)
            if owner[s + 1] == rank:
                held[s + 1, m] = outs
            else:
                _send(trainer, outs, owner[s + 1], s + 1, m, hdr_dev, sends, specs)
        for w, _ in sends:
            trainer._wait(w, "a forward-only send to finish")
    if not results:
        return None
    return torch.stack([r.detach().reshape(()) for r in results]).mean() if ys is not None else torch.cat(results)


def _send(trainer: Any, outs: tuple[torch.Tensor, ...], dst: int, stage: int, micro: int, hdr_dev: torch.device,
          sends: list[tuple[Any, Any]], specs: dict[int, Any]) -> None:
    group = trainer._group(trainer.rank, dst)
    spec = spec_of(outs, f"stage {stage - 1}'s output")
    tags = _tags(stage, micro, len(outs) + 1)
    if micro == 0:
        specs[stage] = spec
        sends.append(send_spec(spec, trainer._peer[dst], group, tags[0], hdr_dev))
    elif spec != specs[stage]:
        raise ValueError(f"stage {stage - 1}'s output for micro-batch {micro} has shapes {spec}, micro-batch 0's "
                         f"{specs[stage]}: a forward-only pass sends one shape a stage")
    for t, tag in zip(outs, tags[1:]):
        t = wire(t.contiguous())
        sends.append((dist.isend(t, trainer._peer[dst], group=group, tag=tag), t))


def _receive(trainer: Any, src: int, stage: int, micro: int, hdr_dev: torch.device,
             specs: dict[int, Any]) -> tuple[torch.Tensor, ...]:
    group = trainer._group(src, trainer.rank)
    what = f"the input of stage {stage} micro-batch {micro} from rank {trainer._peer[src]} (forward only)"
    if micro == 0:  # the header (on NCCL, reading it is a host sync: one a stage boundary)
        specs[stage] = recv_spec(trainer._peer[src], group, _tags(stage, micro, 1)[0], hdr_dev,
                                 lambda w: trainer._wait(w, what))
    spec = specs[stage]
    bufs = [torch.empty(shape, dtype=dt, device=trainer.device) for shape, dt in spec]
    works = [dist.irecv(wire(b), trainer._peer[src], group=group, tag=tag)
             for b, tag in zip(bufs, _tags(stage, micro, len(spec) + 1)[1:])]
    for w in works:
        trainer._wait(w, what)
    return tuple(bufs)


__all__ = ["evaluate", "forward_plan"]
