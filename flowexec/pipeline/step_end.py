"""What a pipeline step does after its last job, on every rank: sum the gradients of weights
tied across ranks (:mod:`.tied`), average every gradient over the data-parallel replicas,
clip every gradient by the norm over the whole model, then step the optimizers that waited.

The norm is the one ``torch.nn.utils.clip_grad_norm_`` would give on the unsplit model: each
rank sums the squares of its own gradients (a weight tied across ranks counted on the lowest of
its ranks only, since after the sum every copy holds the whole gradient), one ``all_reduce``
adds the ranks' sums, and every rank scales its gradients by ``min(1, max_norm / (norm +
1e-6))``. That sum needs every rank's last job, so with clipping every optimizer steps here,
after the sum, instead of at its stage's ``OPT`` job.

A :class:`StepEnd` is built once, at the trainer's construction; :meth:`StepEnd.run` is the
per-step work. With nothing to do it is falsy, and the trainer skips it.

>>> end = StepEnd(synced=(), deferred=(), max_norm=None, counted=(), scaled=())
>>> bool(end)
False
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepEnd:
    """The step's end on one rank, built at set-up.

    ``synced``: per weight tied across ranks that this rank holds, ``(parameter, group, what)``
    (``what`` names it in a timeout's error). ``deferred``: ``(stage, optimizer)`` to step after
    the sums and the clip. ``max_norm``: the clip's bound, None for no clip. ``counted``: the
    parameters whose gradients this rank counts toward the norm; ``scaled``: those it scales
    (every local trainable parameter once); ``dtype``: what the squares are summed in, decided
    from the whole model's parameters so that every rank's ``all_reduce`` agrees
    (:func:`norm_dtype`); ``device``: the local stages'; ``norm_group``: the ranks whose squares
    make the norm (one pipeline's; None: every rank). ``averaged``: with ``dp`` > 1
    data-parallel replicas, the local parameters whose gradients are averaged over ``dp_group``
    (this pipeline position's ranks in every replica) before the clip; ``buffers``: the local
    buffers, given replica 0's values (global rank ``source``) after it, as DDP's
    ``broadcast_buffers``; both in groups of one dtype and device (:func:`by_kind`)."""

    synced: tuple[tuple[torch.nn.Parameter, Any, str], ...]
    deferred: tuple[tuple[int, Any], ...]
    max_norm: float | None
    counted: tuple[torch.nn.Parameter, ...]
    scaled: tuple[torch.nn.Parameter, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    norm_group: Any = None
    averaged: tuple[tuple[torch.nn.Parameter, ...], ...] = ()
    dp_group: Any = None
    dp: int = 1
    buffers: tuple[tuple[torch.Tensor, ...], ...] = ()
    source: int = 0

    def __bool__(self) -> bool:
        return bool(self.synced or self.deferred or self.max_norm is not None or self.averaged or self.buffers)

    def run(self, wait: Callable[[Any, str], None], timer: Any, step: int) -> torch.Tensor | None:
        """Sum the tied gradients, clip, step the deferred optimizers (every rank, in the same
        order, so the collectives cannot cross). Returns the norm before the clip (a 0-d
        tensor of ``dtype`` on ``device``, the same on every rank), or None without a clip."""
        for p, group, what in self.synced:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            wait(dist.all_reduce(p.grad, group=group, async_op=True), what)
        if self.averaged or self.buffers:
            tok = timer.begin(step=step, stage=None, kind="average", micro=None)
            self._average(wait)
            broadcast_from(self.buffers, self.source, self.dp_group, wait, "replica 0's buffers")
            timer.end(tok)
        norm = None
        if self.max_norm is not None:
            tok = timer.begin(step=step, stage=None, kind="clip", micro=None)
            norm = self._clip(wait)
            timer.end(tok)
        for s, opt in self.deferred:
            tok = timer.begin(step=step, stage=s, kind="OPT", micro=None)
            opt.step()
            timer.end(tok)
        return norm

    def _average(self, wait: Callable[[Any, str], None]) -> None:
        """Average the gradients over the data-parallel replicas: one ``all_reduce`` a dtype of
        the gradients laid end to end. Which parameters have a gradient can differ between
        replicas (a branch or an expert that one replica's data does not take): a small
        ``all_reduce`` of who has one comes first (on CUDA, a host sync), a parameter that has
        one somewhere gets zeros where it has none, and one that has none anywhere stays None,
        as on one process over the whole batch."""
        if not self.averaged:
            return
        have = torch.tensor([p.grad is not None for ps in self.averaged for p in ps], dtype=torch.int32,
                            device=self.device)
        wait(dist.all_reduce(have, group=self.dp_group, async_op=True), "the other replicas' gradients")
        flags = iter(have.tolist())
        for ps in self.averaged:
            grads = []
            for p in ps:
                if next(flags):
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(p.grad)
            _through_flat(grads, lambda f: dist.all_reduce(f, group=self.dp_group, async_op=True), wait,
                          "the other replicas' gradients", divide=self.dp)

    def _clip(self, wait: Callable[[Any, str], None]) -> torch.Tensor:
        grads = [p.grad for p in self.counted if p.grad is not None]
        # Per tensor in its own dtype, as clip_grad_norm_ does; the squares summed in ``dtype``
        # (float32, float64 where the model has float64 parameters: the same on every rank).
        if grads:
            sq = torch.stack([n.to(self.dtype) for n in torch._foreach_norm(grads)]).square().sum()
        else:
            sq = torch.zeros((), dtype=self.dtype, device=self.device)
        wait(dist.all_reduce(sq, group=self.norm_group, async_op=True), "the other ranks' gradient norms")
        norm = sq.sqrt()
        coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        scaled = [p.grad for p in self.scaled if p.grad is not None]
        if scaled:
            torch._foreach_mul_(scaled, coef)
        return norm


def by_kind(tensors: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], ...]:
    """``tensors`` in groups of one dtype and device, in the order first seen: what one flat
    collective carries.

    >>> [len(g) for g in by_kind([torch.zeros(2), torch.zeros(1, dtype=torch.int64), torch.ones(3)])]
    [2, 1]
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return tuple(tuple(g) for g in groups.values())


def _through_flat(tensors: Sequence[torch.Tensor], collective: Callable[[torch.Tensor], Any],
                  wait: Callable[[Any, str], None], what: str, divide: int = 1) -> None:
    """Lay ``tensors`` (one dtype and device) end to end, run ``collective`` on that buffer, and
    copy it back into them (divided by ``divide``)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    wait(collective(flat), what)
    if divide != 1:
        flat.div_(divide)
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))


def broadcast_from(groups: Sequence[Sequence[torch.Tensor]], source: int, group: Any,
                   wait: Callable[[Any, str], None], what: str) -> None:
    """Give the tensors of ``groups`` (:func:`by_kind`; the same on every rank of ``group``) the
    values they have on the global rank ``source``: one ``broadcast`` a group."""
    for ts in groups:
        _through_flat(ts, lambda f: dist.broadcast(f, source, group=group, async_op=True), wait, what)


def check_max_norm(max_norm: Any) -> float | None:
    """``max_grad_norm`` as given to the trainer: None, or a positive finite real number (NumPy's
    too, as ``clip_grad_norm_`` takes them)."""
    if max_norm is None:
        return None
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real) or not math.isfinite(max_norm) \
            or max_norm <= 0:
        raise ValueError(f"max_grad_norm must be a positive finite number or None, got {max_norm!r}")
    return float(max_norm)


def norm_dtype(modules: Any) -> torch.dtype:
    """What a norm over ``modules`` (every stage, the same list on every rank) is summed in:
    float64 where any trainable parameter is float64, else float32."""
    wide = any(p.dtype == torch.float64 for m in modules for p in m.parameters() if p.requires_grad)
    return torch.float64 if wide else torch.float32


__all__ = ["StepEnd", "broadcast_from", "by_kind", "check_max_norm", "norm_dtype"]
