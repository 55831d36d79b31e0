"""Stage runners: what executes one pipeline stage's jobs on one rank.

A runner holds a micro-batch's state (saved activations; between ``I`` and ``W`` what ``W``
needs) from its ``F`` job to its last backward job. :class:`EagerRunner` runs the module with
autograd; ``CompiledRunner`` (``compiled.py``) runs flowexec programs. :func:`make_runner` picks.

Convention shared by both: the stage inputs whose ``example_inputs`` have ``requires_grad=True``
are the ones that get input gradients (the trainer sets it on every floating input of a stage
that is not the first); the others (stage 0's batch, integer ids) get ``None``.

>>> import torch
>>> lin = torch.nn.Linear(3, 2)
>>> r = make_runner(lin, example_inputs=(torch.zeros(4, 3, requires_grad=True),),
...                 loss_fn=torch.nn.functional.mse_loss, compile=False)
>>> (loss,) = r.forward(0, (torch.ones(4, 3),), target=torch.zeros(4, 2))
>>> gx = r.backward_input(0, None); r.backward_weight(0)
>>> gx[0].shape, lin.weight.grad is not None
(torch.Size([4, 3]), True)
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class StageRunner(Protocol):
    """One stage's jobs (the interface in ``docs/pipeline.md``)."""

    parameters: list[torch.nn.Parameter]

    def forward(self, micro: int, inputs: tuple[torch.Tensor, ...],
                target: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """F: the stage's outputs (detached), or on the last stage ``(loss,)`` (unscaled)."""
        ...

    def backward(self, micro: int, grad_outputs: tuple[torch.Tensor | None, ...] | None
                 ) -> tuple[torch.Tensor | None, ...]:
        """B: accumulate parameter gradients, return the inputs' gradients."""
        ...

    def backward_input(self, micro: int, grad_outputs: tuple[torch.Tensor | None, ...] | None
                       ) -> tuple[torch.Tensor | None, ...]:
        """I: the inputs' gradients only; keeps what W needs."""
        ...

    def backward_weight(self, micro: int) -> None:
        """W: accumulate the parameter gradients of ``micro``; frees its state."""
        ...


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class EagerRunner:
    """A stage through eager autograd. ``I`` is ``torch.autograd.grad`` with respect to the stage
    inputs (graph kept); ``W`` with respect to the parameters (that walks the graph again, so on
    an eager stage I + W costs more than B: the compiled runner's split does not).

    A weight used several times gets one gradient (autograd sums the uses); parameters that
    the output does not depend on keep their ``.grad``.
    """

    def __init__(self, module: torch.nn.Module, *, example_inputs: tuple[torch.Tensor, ...],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, loss_scale: float = 1.0) -> None:
        self.module = module
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self.loss_fn = loss_fn
        self.loss_scale = loss_scale
        self.needs_grad = tuple(bool(getattr(x, "requires_grad", False)) for x in example_inputs)
        # micro -> (inputs, roots, root grads or None until I has run)
        self._state: dict[int, tuple[tuple[torch.Tensor, ...], list[torch.Tensor], list[Any] | None]] = {}

    def forward(self, micro: int, inputs: tuple[torch.Tensor, ...],
                target: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if micro in self._state:
            raise RuntimeError(f"micro-batch {micro}'s forward ran twice before its backward")
        xs = tuple(x.detach().requires_grad_(True) if g else x for x, g in zip(inputs, self.needs_grad))
        with torch.enable_grad():
            out = self.module(*xs)
            if target is not None:
                if self.loss_fn is None:
                    raise ValueError("the last stage's runner was built without a loss_fn")
                loss = self.loss_fn(out, target)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                                     + (f" of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
                self._state[micro] = (xs, [loss * self.loss_scale] if loss.requires_grad else [], None)
                return (loss.detach(),)
        outs = _as_tuple(out)
        self._state[micro] = (xs, [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad], None)
        self._masks = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)

    def _roots(self, micro: int, grad_outputs: tuple[torch.Tensor | None, ...] | None
               ) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor], list[Any]]:
        if micro not in self._state:
            raise RuntimeError(f"backward of micro-batch {micro} before its forward")
        xs, roots, _ = self._state[micro]
        if grad_outputs is None:  # the last stage: from the (scaled) loss
            return xs, roots, [None] * len(roots)
        grads = [g for g, keep in zip(grad_outputs, self._masks) if keep]
        return xs, roots, grads

    def _input_grads(self, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
        return tuple(x.grad if g else None for x, g in zip(xs, self.needs_grad))

    def backward(self, micro: int, grad_outputs: tuple[torch.Tensor | None, ...] | None
                 ) -> tuple[torch.Tensor | None, ...]:
        xs, roots, grads = self._roots(micro, grad_outputs)
        del self._state[micro]
        if roots:
            torch.autograd.backward(roots, grads)
        return self._input_grads(xs)

    def backward_input(self, micro: int, grad_outputs: tuple[torch.Tensor | None, ...] | None
                       ) -> tuple[torch.Tensor | None, ...]:
        xs, roots, grads = self._roots(micro, grad_outputs)
        self._state[micro] = (xs, roots, grads)
        want = [x for x, g in zip(xs, self.needs_grad) if g]
        if not roots or not want:
            return tuple(None for _ in xs)
        got = iter(torch.autograd.grad(roots, want, grads, retain_graph=True, allow_unused=True))
        return tuple(next(got) if g else None for g in self.needs_grad)

    def backward_weight(self, micro: int) -> None:
        xs, roots, grads = self._state.pop(micro, (None, None, None))
        if grads is None:
            raise RuntimeError(f"W of micro-batch {micro} before its I")
        if not roots or not self.parameters:
            return
        got = torch.autograd.grad(roots, self.parameters, grads, allow_unused=True)
        # A weight gradient may be an output gradient itself (``x + w``: dL/dw is dL/dy), and
        # the trainer receives those into buffers it reuses every step: .grad gets its own copy.
        seeds = {g.data_ptr() for g in grads if isinstance(g, torch.Tensor)}
        with torch.no_grad():
            for p, g in zip(self.parameters, got):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g.clone() if g.data_ptr() in seeds else g
                else:
                    p.grad.add_(g)


def make_runner(module: torch.nn.Module, *, example_inputs: tuple[torch.Tensor, ...], loss_fn: Any = None,
                loss_scale: float = 1.0, compile: bool | str = True, fuse: str | bool | None = None) -> StageRunner:
    """The runner for one stage: ``compile=False`` -> :class:`EagerRunner`; ``compile=True`` (or
    a mode string) -> ``CompiledRunner`` (flowexec programs: trace mode on CPU, graph mode on
    CUDA; ``fuse``: the stage programs' fusion, as ``flowexec.compile``'s). ``example_inputs`` are one micro-batch's inputs (``requires_grad`` marks those that
    need gradients); ``loss_fn`` is given for the last stage; its loss is scaled by
    ``loss_scale`` (1 / micro-batches) for the backward."""
    if compile is False:
        return EagerRunner(module, example_inputs=example_inputs, loss_fn=loss_fn, loss_scale=loss_scale)
    try:
        from .compiled import CompiledRunner
    except ImportError as e:
        raise NotImplementedError("compiled stages need flowexec/pipeline/compiled.py (CompiledRunner), which this "
                                  "checkout lacks; pass compile=False for eager stages") from e
    kwargs: dict[str, Any] = dict(example_inputs=tuple(x.detach() for x in example_inputs), loss_fn=loss_fn,
                                  loss_scale=loss_scale,
                                  input_grads=tuple(bool(getattr(x, "requires_grad", False)) for x in example_inputs))
    if isinstance(compile, str):
        kwargs["mode"] = compile
    return CompiledRunner(module, fuse=fuse, **kwargs)
