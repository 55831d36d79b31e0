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
