"""Per-call inputs copied in by the program itself, so that graph mode holds no copy of them.

A CUDA graph reads its inputs at fixed addresses, so graph mode used to copy each per-call
input into a buffer of its own before every replay (``runtime/cuda_graph.py``): a buffer that
lives as long as the graph, beside the caller's tensor. A ResNet-50 batch (64 × 3 × 224 × 224,
float32: 36.75 MiB) read only by the first convolution's cast then sat through the whole
forward and backward, and put the build's peak 2.9 MiB above eager's.

:func:`copy_inputs_in` rewrites the program so that such an input is read by one op alone, a
``clone`` at the program's start, and every other read goes to the clone: an intermediate like
any other, which the plan frees after its last reader, so its memory serves later values. In a
captured graph that clone is a device-to-device memcpy node whose source a call re-points at
its own tensor (``runtime/staging.py``'s :class:`~flowexec.runtime.staging.CopyInNodes`).

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> prog = capture(lambda x: (x * 2).relu(), (torch.randn(4),)).program
    >>> [op.name for op in copy_inputs_in(prog, [0]).ops]
    ['aten.clone.default', 'aten.mul.Tensor', 'aten.relu.default']
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import torch

from ..program import Op, Program, Ref, Role, Value
from ..storage import is_stable
from .dependencies import mutated_state

aten = torch.ops.aten


def _swap(obj: Any, to: dict[int, int]) -> Any:
    if isinstance(obj, Ref):
        return Ref(to.get(obj.id, obj.id))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap(o, to) for o in obj)
    return obj


def copy_inputs_in(prog: Program, positions: Iterable[int]) -> Program:
    """``prog`` with each input at ``positions`` (of ``prog.inputs``) read only by a
    ``clone`` that the program's other ops and outputs read instead (module docstring)."""
    positions = sorted(set(positions))
    if not positions:
        return prog
    values = list(prog.values)
    to: dict[int, int] = {}
    ops: list[Op] = []
    for k in positions:
        vid = prog.inputs[k]
        v = values[vid]
        if v.role != Role.INPUT or v.meta is None:
            raise ValueError(f"copy_inputs_in: input {k} ({v.label}) is not a tensor input")
        new = Value(len(values), Role.TEMP, v.meta, f"{v.name}_in")
        values.append(new)
        to[vid] = new.id
        ops.append(Op(len(ops), aten.clone.default, (Ref(vid),), (), (new.id,), False, "(graph mode: the input copied in)"))
    for op in prog.ops:
        ops.append(dataclasses.replace(op, index=len(ops), args=_swap(op.args, to),
                                       kwargs=tuple((key, _swap(val, to)) for key, val in op.kwargs)))
    outputs = tuple(_swap(o, to) for o in prog.outputs)
    return dataclasses.replace(prog, values=tuple(values), ops=tuple(ops), outputs=outputs)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory without gaps or overlaps (a memcpy of
    its bytes copies it, whatever the order of its strides).

    >>> dense(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)), dense(torch.zeros(4, 4)[:, :2])
    (True, False)
    """
    return dense_layout(t.shape, t.stride())


def dense_layout(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """:func:`dense` of a layout (a value's meta: no tensor needed).

    >>> dense_layout((4, 2), (1, 4)), dense_layout((4, 2), (4, 1))
    (True, False)
    """
    expect = 1
    for st, size in sorted((st, n) for n, st in zip(shape, stride) if n != 1):
        if st != expect:
            return False
        expect *= size
    return True


def inputs_to_copy_in(prog: Program, tensors: Sequence[Any], borrowed: Iterable[int] = (),
                      on_device: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda,
                      mutated: Iterable[int] | None = None) -> tuple[int, ...]:
    """The positions (among ``prog.inputs``; ``tensors``: the call's tensors in that order) that
    graph mode has the program copy in: plain dense tensors on the device that the program
    neither writes nor sees sharing a storage with another input or state, not ``borrowed``
    (positions the caller reads in place), not stable (parameters, other graphs' outputs) and
    without a lazy conjugation or negation (their copy is a kernel, not a memcpy node);
    ``mutated``: the program's :func:`mutated_state`, where the caller has it."""
    mutated = set(mutated_state(prog) if mutated is None else mutated)
    shared = {v for pair in prog.shared_storage for v in pair}
    skip = set(borrowed)
    return tuple(k for k, (vid, a) in enumerate(zip(prog.inputs, tensors))
                 if type(a) is torch.Tensor and on_device(a) and vid not in mutated and vid not in shared
                 and k not in skip and not is_stable(a) and a.numel() > 0 and dense(a)
                 and not a.is_conj() and not a.is_neg())  # (a lazy conj/neg is copied by a kernel)
