"""An optimizer's state made by its own initialisation before the first capture
(``first_step="prefill"``).

Adam and AdamW make their state in ``_init_group`` on the first ``step()``: a step count and
zero moments shaped as each parameter, read from the parameter alone, never from its gradient;
so do NAdam, RAdam, Adamax, RMSprop, Adadelta and ASGD (:data:`PREFILLABLE`).
Made there before the first call, the state exists when flowexec captures, so the first call
captures the steps' program at once: no first step's program to capture, plan and compile,
which on GPT-2 124M is a second capture and a set of regions of its own (docs/training.md).

The state is the optimizer's own code's, so it is eager's to the bit. Eager makes it only for
the parameters that have a gradient on that first step; :func:`prefill` makes it for every
parameter that requires one, and :func:`prune` drops it again from those the captured program
does not read, so that ``optimizer.state`` ends as eager's. Any other optimizer (a subclass
too, whose ``_init_group`` may read more) is left to the first step's program.

    >>> import torch
    >>> net = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.AdamW(net.parameters())
    >>> made = prefill(opt)
    >>> sorted(opt.state[net.weight]), float(opt.state[net.weight]["exp_avg"].abs().sum())
    (['exp_avg', 'exp_avg_sq', 'step'], 0.0)
    >>> net.weight.grad is None                    # (the placeholder gradients are gone)
    True
    >>> dropped = prune(made, [opt.state[net.weight]["exp_avg"]])   # the program reads the weight's state only
    >>> [p is net.bias for p, _ in dropped], net.bias in opt.state
    ([True], False)
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

# Exact types whose _init_group makes state from the parameter (and its group) alone: zeros,
# ones and step counts shaped or placed as the parameter (a subclass may read more), with how
# many lists it fills after the group (params, grads, then its own: Adam's exp_avgs,
# exp_avg_sqs, max_exp_avg_sqs and steps). Not SGD, whose first momentum buffer is the gradient.
PREFILLABLE: dict[type, int] = {
    torch.optim.Adam: 6, torch.optim.AdamW: 6, torch.optim.NAdam: 6, torch.optim.RAdam: 5,
    torch.optim.Adamax: 5, torch.optim.RMSprop: 6, torch.optim.Adadelta: 5, torch.optim.ASGD: 6,
}


def can_prefill(opt: Any) -> bool:
    """Whether :func:`prefill` makes ``opt``'s state: one of :data:`PREFILLABLE` (not a subclass) with no
    state yet and no differentiable param group."""
    return (type(opt) in PREFILLABLE and not opt.state
            and not any(g.get("differentiable") for g in opt.param_groups))


def prefill(opt: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.optim.Optimizer]]:
    """Make ``opt``'s state with its own ``_init_group`` for every parameter that requires a
    gradient, each given a placeholder gradient for the while (a zero expanded to its shape:
    no memory) where it has none; returns (parameter, optimizer) per parameter given state.
    Raises what ``_init_group`` raises (a fused AdamW on a device it does not support), with
    no state left behind."""
    if not can_prefill(opt):
        raise ValueError(f"flowexec: cannot prefill the state of {type(opt).__name__} (the optimizers of "
                         "flowexec.optim_state.PREFILLABLE only, before their first step)")
    made: list[tuple[torch.Tensor, torch.optim.Optimizer]] = []
    try:
        for group in opt.param_groups:
            lent = lend_grads(group["params"])
            try:
                opt._init_group(group, *([] for _ in range(PREFILLABLE[type(opt)])))  # type: ignore[attr-defined]
            finally:
                take_back(lent)
            made += [(p, opt) for p in group["params"] if p.requires_grad]
    except BaseException:
        opt.state.clear()
        raise
    return made


def lend_grads(params: Iterable[torch.Tensor], like: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A placeholder ``.grad`` for every parameter that requires one and has none: a zero
    expanded to its shape (no memory), or with ``like`` an unfilled tensor laid out as the
    parameter, as a gradient is (a capture records its layout); returns (parameter,
    placeholder) per one lent."""
    lent = []
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.empty_like(p) if like else torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)
            lent.append((p, p.grad))
    return lent


def take_back(lent: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``.grad`` None again where it is still the placeholder :func:`lend_grads` lent."""
    for p, g in lent:
        if p.grad is g:
            p.grad = None


def prune(made: Iterable[tuple[torch.Tensor, torch.optim.Optimizer]],
          read: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.optim.Optimizer]]:
    """Drop the prefilled state of the parameters whose state tensors the captured program does
    not read (``read``: its state tensors): eager makes none for a parameter without a gradient.
    Returns the (parameter, optimizer) pairs dropped."""
    kept = {id(t) for t in read}
    dropped = []
    for p, opt in made:
        entry = opt.state.get(p)
        if entry is not None and not any(id(v) in kept for v in entry.values()):
            del opt.state[p]
            dropped.append((p, opt))
    return dropped


def undo(made: Iterable[tuple[torch.Tensor, torch.optim.Optimizer]]) -> None:
    """Drop all of the prefilled state again (a capture that failed: the first step then makes it)."""
    for p, opt in made:
        opt.state.pop(p, None)
