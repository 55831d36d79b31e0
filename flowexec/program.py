"""The Program IR: ordered ATen ops over values, with a text form and a lint.

A :class:`Program` is what capture produces and what every pass reads. It is plain data:
small frozen records, no behaviour beyond printing and checking itself. Analysis results
(dependencies, liveness, streams …) live in side tables built by ``flowexec.passes``.

Example::

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda a, b: (a @ b).relu(), torch.randn(2, 3), torch.randn(3, 4))
    >>> print(exe.program)  # doctest: +ELLIPSIS
    program(a0: f32[2, 3] cpu, a1: f32[3, 4] cpu) -> (v3)
      v2: f32[2, 4] cpu = aten.mm.default(a0, a1)  # ...
      v3: f32[2, 4] cpu = aten.relu.default(v2)  # ...
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


class Role(enum.Enum):
    """Where a value comes from; decides whether the runtime may ever drop it."""

    INPUT = "input"  # per-call argument
    STATE = "state"  # caller's persistent tensor (parameter, buffer, grad, optimizer state)
    CONST = "const"  # non-tensor or tensor constant created at capture
    TEMP = "temp"  # produced by an op


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Static facts about a tensor value."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    nbytes: int
    stride: tuple[int, ...] | None = None  # None where unknown (a kernel compiler then assumes contiguous)

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        strided = t.layout == torch.strided
        return TensorMeta(t.dtype, tuple(t.shape), t.device, t.untyped_storage().nbytes() if strided else 0,
                          tuple(t.stride()) if strided else None)

    def __str__(self) -> str:
        dt = _DTYPE_SHORT.get(self.dtype, str(self.dtype).replace("torch.", ""))
        return f"{dt}[{', '.join(map(str, self.shape))}] {self.device}"


_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


@dataclass(frozen=True, slots=True)
class Value:
    """One SSA value. ``meta`` is None for non-tensor values (ints, tensor lists …)."""

    id: int
    role: Role
    meta: TensorMeta | None = None
    name: str = ""  # the capture's name for it (FX node name), for messages

    @property
    def label(self) -> str:
        return {Role.INPUT: "a", Role.STATE: "s", Role.CONST: "c", Role.TEMP: "v"}[self.role] + str(self.id)


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to a value inside an op's arguments."""

    id: int


def map_nested(a: Any, leaf: Callable[[Any], Any]) -> Any:
    """``a`` with ``leaf`` applied to everything inside it that is not a list or a tuple (lists and
    tuples rebuilt as such: an op's arguments, whose values are :class:`Ref` s).

    >>> map_nested([Ref(1), (2, Ref(3))], lambda a: a.id if isinstance(a, Ref) else a)
    [1, (2, 3)]
    """
    if isinstance(a, list):
        return [map_nested(x, leaf) for x in a]
    if isinstance(a, tuple):
        return tuple(map_nested(x, leaf) for x in a)
    return leaf(a)


@dataclass(frozen=True, slots=True)
class Op:
    """One ATen call.

    ``args``/``kwargs`` hold :class:`Ref` for values (nested in lists where the schema takes a
    list) and plain Python constants otherwise. ``outputs`` names the produced values; when
    ``unpack`` is set the call returns a sequence and ``outputs[i]`` receives element i
    (``-1``: element unused).
    """

    index: int
    target: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    outputs: tuple[int, ...] = ()
    unpack: bool = False
    source: str = ""  # "file:line" of the user's code that issued it, where known
    # a second run of an earlier op, where the backward reads its result (passes/recompute.py):
    # it joins no fused region of ops from before it
    recomputed: bool = False
    # refs(), walked once: every pass asks for it (capture's program of GPT-2 124M: ~45 times an op)
    _refs: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        refs: list[int] = []
        _collect_refs(self.args, refs)
        for _, v in self.kwargs:
            _collect_refs(v, refs)
        object.__setattr__(self, "_refs", tuple(refs))

    @property
    def name(self) -> str:
        return op_name(self.target)

    def refs(self) -> Iterator[int]:
        """Ids of all values this op takes as arguments (in order, with repeats)."""
        return iter(self._refs)


def _collect_refs(obj: Any, into: list[int]) -> None:
    """Append the ids of the Refs in ``obj`` (nested lists and tuples), in order. (A plain
    recursion: a capture builds thousands of ops, and generators cost three times as much.)"""
    if isinstance(obj, Ref):
        into.append(obj.id)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _collect_refs(o, into)


def op_name(target: Callable[..., Any]) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))


@dataclass(frozen=True)
class Program:
    """An ordered list of ops over values.

    ``inputs`` are per-call arguments, in call order; ``state`` maps value ids to the caller's
    persistent tensors (bound by reference, never copied); ``consts`` holds other constants;
    ``outputs`` is a pytree spec plus the value ids (or constants) it is filled with.
    """

    values: tuple[Value, ...]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    outputs: tuple[Any, ...]  # flat: Ref or constant
    out_spec: Any = None  # torch.utils._pytree.TreeSpec, or None for a flat tuple
    state: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    consts: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)
    # (value, value) pairs of inputs and state whose example tensors shared a storage at capture
    shared_storage: tuple[tuple[int, int], ...] = field(default=(), compare=False, repr=False)

    def value(self, vid: int) -> Value:
        return self.values[vid]

    def __str__(self) -> str:
        return format_program(self)


def _fmt_arg(a: Any, prog: Program) -> str:
    if isinstance(a, Ref):
        return prog.values[a.id].label
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x, prog) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    return repr(a)


def format_op(op: Op, prog: Program) -> str:
    """One line: ``outputs = target(args)`` with each output's dtype, shape and device."""
    outs = []
    for vid in op.outputs:
        if vid < 0:
            outs.append("_")
            continue
        v = prog.values[vid]
        outs.append(f"{v.label}: {v.meta}" if v.meta else v.label)
    args = [_fmt_arg(a, prog) for a in op.args] + [f"{k}={_fmt_arg(v, prog)}" for k, v in op.kwargs]
    lhs = ", ".join(outs) if outs else "_"
    if op.unpack:
        lhs = f"({lhs})"
    notes = [n for n in (getattr(op.target, "summary", ""), op.source, "recomputed" * op.recomputed) if n]
    src = f"  # {'; '.join(notes)}" if notes else ""
    return f"{lhs} = {op.name}({', '.join(args)}){src}"


def format_program(prog: Program) -> str:
    """The program as text: a header with inputs and outputs, then one op per line."""
    ins = ", ".join(f"{prog.values[i].label}: {prog.values[i].meta}" for i in prog.inputs)
    outs = ", ".join(_fmt_arg(o, prog) for o in prog.outputs)
    lines = [f"program({ins}) -> ({outs})"]
    if prog.state:
        lines.append(f"  # state: {', '.join(prog.values[i].label + ': ' + str(prog.values[i].meta) for i in prog.state)}")
    lines += ["  " + format_op(op, prog) for op in prog.ops]
    return "\n".join(lines)


class LintError(ValueError):
    """A program breaks an invariant (use before definition, dangling ref …)."""


def lint(prog: Program) -> None:
    """Check the program's invariants; raise :class:`LintError` naming the first broken one."""
    defined = set(prog.inputs) | set(prog.state) | set(prog.consts)
    for vid, v in enumerate(prog.values):
        if v.id != vid:
            raise LintError(f"value #{vid} carries id {v.id}")
    for op in prog.ops:
        for r in op.refs():
            if r not in defined:
                raise LintError(f"op #{op.index} {op.name} uses {prog.values[r].label} before it is defined")
        for o in op.outputs:
            if o >= 0:
                if o in defined:
                    raise LintError(f"op #{op.index} {op.name} redefines {prog.values[o].label}")
                defined.add(o)
    for o in prog.outputs:
        if isinstance(o, Ref) and o.id not in defined:
            raise LintError(f"output {prog.values[o.id].label} is never defined")


# Ops whose schema does not admit that they write some arguments in place (training-mode
# batch norm updates its running statistics through plain `Tensor?` arguments).
_UNANNOTATED_WRITES: dict[str, tuple[int, ...]] = {
    "aten.native_batch_norm.default": (3, 4),
    "aten.cudnn_batch_norm.default": (3, 4),
    "aten.miopen_batch_norm.default": (3, 4),
}


def written_args(target: Callable[..., Any]) -> tuple[int, ...]:
    """Schema positions of the arguments ``target`` writes in place."""
    cached = _WRITTEN_CACHE.get(target)
    if cached is not None:
        return cached
    schema = getattr(target, "_schema", None)
    pos: tuple[int, ...] = ()
    if schema is not None:
        pos = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
        pos += tuple(i for i in _UNANNOTATED_WRITES.get(op_name(target), ()) if i not in pos)
    _WRITTEN_CACHE[target] = pos
    return pos


_WRITTEN_CACHE: dict[Any, tuple[int, ...]] = {}
