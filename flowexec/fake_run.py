"""What a capture on fake tensors needs beside make_fx's fake mode (flowexec/capture.py).

A fake run records fn's ops without computing them. Torch's fake mode has no kernel for some
ops flowexec dispatches (the fused optimizer steps with a tensor learning rate), logs the meta
kernels that fail (the capture then runs fn for real: not the user's concern), and a process
on a GPU captures for real until the CUDA tests have run with the fake capture.

    >>> import torch
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> is_fake_tensor(FakeTensorMode().from_tensor(torch.ones(2))), is_fake_tensor(torch.ones(2))
    (True, False)
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Sequence

import torch


def cuda_in_use() -> bool:
    """Whether this process has started CUDA (a step on a GPU has, by its first eager call)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def is_fake_tensor(t: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(t, torch.Tensor) and is_fake(t)


def runs_for_real(func: Any, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a fake capture may run ``func``, whose tensor arguments are ``tensors``, on real
    tensors, writing those it writes in place. Two places propagate constants for real:

    - make_fx's proxy mode, for an op whose traced arguments are all constants and one at
      least is (``torch.tensor(1.0)`` made in the run); tensors it does not trace (closure state
      no earlier op of the run produced or lifted) do not count against that: Adam's CPU step
      counts in ``_foreach_add_(steps, torch.tensor(1.0))``;
    - torch's fake mode, for an op with no fake argument that takes Python numbers as tensors
      (``step += 1``) or is a lift (``torch.tensor``); an op a tracer may decompose
      (CompositeImplicitAutograd) counts too, since its parts are what the mode sees.

    Otherwise the real arguments are converted to fake ones and only those are written (a
    foreach optimizer's weight decay of its traced parameters, ``_foreach_mul_(params, factor)``).
    Outside a make_fx trace only the second applies.

        >>> import torch
        >>> runs_for_real(torch.ops.aten.add_.Tensor, []), runs_for_real(torch.ops.aten._foreach_mul_.Scalar, [])
        (True, False)
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    proxy = get_proxy_mode()
    if proxy is not None:
        slots = [s for s in (get_proxy_slot(t, proxy.tracer, None) for t in tensors) if s is not None]
        constants = [getattr(s, "constant", None) is not None for s in slots]
        if constants and all(constants) and torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
            return True
    if any(is_fake_tensor(t) for t in tensors):
        return False
    return _numbers_as_tensors(func) or _decomposable(func)


@functools.lru_cache(maxsize=None)
def _numbers_as_tensors(func: Any) -> bool:
    """The fake mode's constant propagation: a lift (``torch.tensor``) or an op that binds
    Python numbers to tensors runs for real where no argument is fake."""
    from torch._subclasses.fake_tensor import should_allow_numbers_as_tensors

    aten = torch.ops.aten
    if func in (aten.lift_fresh.default, aten.lift_fresh_copy.default):
        return True
    try:
        return should_allow_numbers_as_tensors(func)
    except (AttributeError, RuntimeError):  # (not an ATen OpOverload: count it as run for real)
        return True


@functools.lru_cache(maxsize=None)
def _decomposable(func: Any) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
    except (AttributeError, RuntimeError):  # (not an ATen OpOverload: count it as run for real)
        return True


@contextlib.contextmanager
def quiet_fake_mode(on: bool) -> Iterator[None]:
    """A fake run that fails gives way to a real one: the fake mode's own log of the failure (a
    meta kernel that raised) is not the user's concern."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    if on:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@functools.lru_cache(maxsize=None)
def register_fake_optimizer_kernels() -> None:
    """Fake kernels for the fused optimizer steps torch has none for (``_fused_adamw_`` with a
    tensor learning rate, as flowexec feeds it): they write their arguments in place and return
    nothing, so the fake one does nothing."""
    from torch._subclasses import fake_impls

    ops = set()
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
        packet = getattr(torch.ops.aten, name, None)
        for overload in packet.overloads() if packet is not None else ():
            op = getattr(packet, overload)
            if not op._schema.returns and not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
                ops.add(op)
    if ops:
        fake_impls.register_op_impl(lambda func: func in ops)(lambda fake_mode, func, *args, **kwargs: None)
