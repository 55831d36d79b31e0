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
from typing import Any, Iterator

import torch


def cuda_in_use() -> bool:
    """Whether this process has started CUDA (a step on a GPU has, by its first eager call)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def is_fake_tensor(t: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(t, torch.Tensor) and is_fake(t)


def runs_for_real(func: Any, fakes: list[torch.Tensor]) -> bool:
    """Whether torch's fake mode may run ``func`` on its real arguments, writing those it writes
    in place, where ``fakes`` are its fake arguments. It runs an op for real only where no
    argument is fake and the op takes Python numbers as tensors (``step += 1`` on a CPU step
    count) or is a lift (``torch.tensor``). With a fake argument, even a constant one
    (``torch.tensor(2.0)`` made in the run), the real arguments are converted to fake ones that
    are no constants, and the op runs on those; so does an op of real arguments alone that
    takes no numbers as tensors (``_foreach_mul_`` of the parameters and a number). An op a
    tracer may decompose (CompositeImplicitAutograd) counts as run for real: its parts are what
    the fake mode sees.

        >>> import torch
        >>> runs_for_real(torch.ops.aten.add_.Tensor, []), runs_for_real(torch.ops.aten._foreach_mul_.Scalar, [])
        (True, False)
    """
    return not fakes and (_numbers_as_tensors(func) or _decomposable(func))


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
