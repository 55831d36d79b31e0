"""A pipeline stage as programs: one joint capture, partitioned into forward and backward, and
the backward split into its input-gradient (I) and weight-gradient (W) halves.

``capture_stage`` runs the stage's forward and ``torch.autograd.grad`` once under flowexec's
capture, which records one *joint* program (inputs, gradient seeds → outputs, gradients).
Three pure passes cut it:

- :func:`partition_joint`: the **forward** program is every op the stage's outputs (and its
  in-place writes to buffers, such as batch-norm statistics) need; the **backward** program is
  every other op a gradient needs. Whatever the forward computes that the backward reads is
  *saved* (the forward returns it), except views of parameters, which the backward remakes.
- :func:`split_backward`: **I** is every op the input gradients need (closed over the
  dependency edges, in-place order included); **W** is the rest, the ops that only feed
  weight gradients. The values W reads that it does not make itself — saved activations,
  gradient seeds, and results of I — are the *kept* values, the only state a micro-batch holds
  between its I and W jobs.

A weight used twice in the stage is one parameter and one value of the program: autograd's
accumulation of its two uses is an op that feeds only that weight's gradient, so it lands in
W, and the gradient comes out once, whole.

Example::

    >>> import torch
    >>> from flowexec.pipeline.split import capture_stage, format_kept
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> stage = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    >>> cap = capture_stage(stage, (torch.randn(2, 4),))
    >>> [len(p.ops) > 0 for p in (cap.forward, cap.backward, cap.split.i_program, cap.split.w_program)]
    [True, True, True, True]
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils import _pytree as pytree

from ..capture import capture
from ..errors import CaptureError
from ..guards import GuardSet
from ..passes.dependencies import alias_groups, dependencies, read_write_sets
from ..program import Program, Ref, Role, TensorMeta, lint


# -- records ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KeptValue:
    """One value a micro-batch keeps alive from its I job to its W job."""

    id: int
    name: str
    meta: TensorMeta
    origin: str  # "input" (a stage input), "saved" (made by F), "seed" (a grad output), "I" (made by I)
    readers: tuple[str, ...]  # names of the W ops that read it


@dataclass(frozen=True)
class BackwardSplit:
    """The backward program cut in two (:func:`split_backward`).

    ``i_program``: backward inputs → input gradients, then ``i_kept`` (the values W needs that I
    makes or receives, returned so that they outlive the I job). ``w_program``: ``w_inputs`` →
    weight gradients. ``kept``: every value W reads that it does not make, in ``w_inputs`` order.
    """

    i_program: Program
    w_program: Program
    n_input_grads: int
    i_kept: tuple[int, ...]  # values I returns after the input gradients, for W
    w_inputs: tuple[int, ...]  # W's inputs, in order
    kept: tuple[KeptValue, ...]


@dataclass(frozen=True)
class StageCapture:
    """A stage captured once (:func:`capture_stage`): programs plus how they map to the stage.

    Forward: ``forward(*inputs[, target][, *nothing])`` returns ``n_outputs`` stage outputs (the
    unscaled loss on the last stage) followed by the ``saved`` values. Backward:
    ``backward(*saved, *seeds)`` returns the gradients of the inputs listed in
    ``input_grad_positions`` followed by those of ``params`` (a parameter no output depends on
    has none: it is left out of ``params``). ``seed_metas``: one per seed, the gradient of the
    differentiable output at ``seed_positions`` (the loss on the last stage).
    """

    joint: Program
    forward: Program
    backward: Program
    split: BackwardSplit
    saved: tuple[int, ...]
    n_inputs: int  # stage inputs (the target, on the last stage, comes after them)
    n_outputs: int
    seed_positions: tuple[int, ...]
    seed_metas: tuple[TensorMeta, ...]
    input_grad_positions: tuple[int, ...]
    params: tuple[torch.nn.Parameter, ...]
    out_spec: Any  # pytree spec of the module's output (None on the last stage: the loss)
    backward_inputs: tuple[int, ...]  # = saved + seed value ids
    # What the capture read (training flags, module attributes, requires_grad, global state):
    # the runner checks it before a step and captures the stage again where it changed.
    guards: GuardSet | None = None


# -- program slicing ---------------------------------------------------------------------------

def ancestors(deps: Sequence[Sequence[int]], roots: Iterable[int]) -> set[int]:
    """The ops ``roots`` are, and every op they follow through ``deps`` (transitively)."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i not in seen:
            seen.add(i)
            stack.extend(deps[i])
    return seen


def slice_program(prog: Program, ops: Iterable[int], inputs: Sequence[int], outputs: Sequence[int]) -> Program:
    """The ops at positions ``ops`` (kept in program order) as a program of their own taking
    ``inputs`` and returning ``outputs`` (value ids of ``prog``; ids stay the same)."""
    chosen = sorted(set(ops))
    as_input = set(inputs)
    values = tuple(dataclasses.replace(v, role=Role.INPUT) if v.id in as_input else v for v in prog.values)
    new_ops = tuple(dataclasses.replace(prog.ops[i], index=k) for k, i in enumerate(chosen))
    used = {r for op in new_ops for r in op.refs()} | set(outputs)
    state = {v: t for v, t in prog.state.items() if v in used and v not in as_input}
    consts = {v: c for v, c in prog.consts.items() if v in used}
    present = set(inputs) | set(state)
    shared = tuple((a, b) for a, b in prog.shared_storage if a in present and b in present)
    sub = Program(values, new_ops, tuple(inputs), tuple(Ref(o) for o in outputs), None, state, consts, shared)
    lint(sub)
    return sub


def _producers(prog: Program) -> dict[int, int]:
    return {o: op.index for op in prog.ops for o in op.outputs if o >= 0}


def order_edges(prog: Program, groups: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Per op, the ops it must follow: the dependency pass's edges (read-after-write,
    write-after-read, write-after-write over alias groups) plus the producer of every value it
    reads (the alias-group edges name the group's last writer, which for a view of a view is
    the first view, not the op that made the value read)."""
    producer = _producers(prog)
    deps = dependencies(prog, groups)
    return [tuple(sorted(set(deps[op.index]) | {producer[r] for r in op.refs() if r in producer})) for op in prog.ops]


def _views_to_remake(graph: Any, producer: dict[int, int], users: set[int], source: set[int],
                     free: Callable[[int], bool]) -> set[int]:
    """The view ops of ``source`` that ops of ``users`` read and that view only values ``free``
    accepts (or what such remade views make), closed under that: cheaper for ``users``' side to
    remake than for ``source``'s side to keep."""
    remade: set[int] = set()
    changed = True
    while changed:
        changed = False
        for i in sorted(users | remade):
            for r in graph.ops[i].refs():
                p = producer.get(r)
                if p is None or p not in source or p in remade:
                    continue
                pop = graph.ops[p]
                if _is_view_op(pop) and all(free(x) or producer.get(x) in remade for x in pop.refs()):
                    remade.add(p)
                    changed = True
    return remade


def _is_view_op(op: Any) -> bool:
    schema = getattr(op.target, "_schema", None)
    return (schema is not None and len(schema.returns) == 1 and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write)


def _random_ops(prog: Program) -> list[Any]:
    """Ops that draw random numbers here: seeded ops (dropout, bernoulli, rand ...), except those
    whose schema says they draw nothing this time (a dropout probability of 0, ``train=False``:
    scaled-dot-product attention is tagged seeded for its optional dropout)."""
    tag = getattr(torch.Tag, "nondeterministic_seeded", None)
    out = []
    for op in prog.ops:
        if tag is None or tag not in getattr(op.target, "tags", ()):
            continue
        schema = op.target._schema
        kw = dict(op.kwargs)
        vals = {a.name: (op.args[i] if i < len(op.args) else kw.get(a.name, a.default_value))
                for i, a in enumerate(schema.arguments)}
        if vals.get("dropout_p", vals.get("p")) == 0.0 or vals.get("train") is False:
            continue
        out.append(op)
    return out


def partition_joint(joint: Program, n_fwd_outputs: int, seeds: Sequence[int]) -> tuple[Program, Program, tuple[int, ...]]:
    """Cut a joint program (forward then its gradients) into (forward, backward, saved).

    The joint's first ``n_fwd_outputs`` outputs are the forward's results, the rest gradients;
    ``seeds`` are the inputs that carry the outputs' gradients. The forward is every op the
    forward results or the in-place writes to inputs and state (buffers) need; the backward
    every other op a gradient needs, plus copies of the views of state it reads (a ``t()`` of a
    weight is remade, not kept). ``saved``: the values the backward reads that the forward
    makes or takes as inputs; the forward returns them after its results, and the backward
    takes them, then the seeds. Ops no output needs are dropped.
    """
    groups = alias_groups(joint)
    deps = order_edges(joint, groups)
    rw = read_write_sets(joint, groups)
    seed_set = set(seeds)
    # Ops that depend on a seed, by data flow: they are backward by nature.
    from_seed = [False] * len(joint.ops)
    tainted = set(seed_set)
    for op in joint.ops:
        if any(r in tainted for r in op.refs()):
            from_seed[op.index] = True
            tainted.update(o for o in op.outputs if o >= 0)
    outside = {groups[v.id] for v in joint.values if v.role in (Role.INPUT, Role.STATE)}
    producer = _producers(joint)
    out_ids = [o.id if isinstance(o, Ref) else None for o in joint.outputs]
    for k, o in enumerate(out_ids):
        if o is None:
            raise CaptureError(f"output {k} of the stage is a constant, not a tensor the stage computes")
    fwd_roots = [producer[o] for o in out_ids[:n_fwd_outputs] if o in producer]
    for op in joint.ops:
        if rw[op.index][1] & outside:  # writes a buffer, an input: a side effect of the forward
            if from_seed[op.index]:
                raise CaptureError(f"the stage's backward writes {op.name} in place into a buffer or an input "
                                   f"(op #{op.index}{', at ' + op.source if op.source else ''}); "
                                   "CompiledRunner needs a backward that only computes gradients")
            fwd_roots.append(op.index)
    fwd = ancestors(deps, fwd_roots)
    bad = [joint.ops[i] for i in fwd if from_seed[i]]
    if bad:
        raise CaptureError(f"the stage's outputs depend on a gradient ({bad[0].name}): cannot split forward from backward")
    bwd_roots = [producer[o] for o in out_ids[n_fwd_outputs:] if o in producer]
    bwd = ancestors(deps, bwd_roots) - fwd
    # Remake views of state (t(weight), weight.view(...)) in the backward instead of saving them.
    remade = _views_to_remake(joint, producer, bwd, fwd,
                              lambda x: joint.values[x].role in (Role.STATE, Role.CONST))
    bwd_ops = bwd | remade
    made_in_bwd = {o for i in bwd_ops for o in joint.ops[i].outputs if o >= 0}
    needed: list[int] = []
    for i in sorted(bwd_ops):
        for r in joint.ops[i].refs():
            if r not in made_in_bwd and joint.values[r].role in (Role.TEMP, Role.INPUT) and r not in seed_set:
                needed.append(r)
    for o in out_ids[n_fwd_outputs:]:  # a gradient that is a forward value (a zeros the forward made, say)
        if o not in made_in_bwd and joint.values[o].role in (Role.TEMP, Role.INPUT) and o not in seed_set:
            needed.append(o)
    saved = tuple(dict.fromkeys(needed))
    fwd_inputs = [v for v in joint.inputs if v not in seed_set]
    forward = slice_program(joint, fwd, fwd_inputs, [*out_ids[:n_fwd_outputs], *saved])
    backward = slice_program(joint, bwd_ops, [*saved, *seeds], out_ids[n_fwd_outputs:])
    return forward, backward, saved


def _mask_position(op: Any) -> int | None:
    """Schema position of a ``bool[3] output_mask`` argument whose output 0 is the input gradient
    and 1, 2 the weight and bias gradients (layer/batch/group norm and convolution backward)."""
    schema = getattr(op.target, "_schema", None)
    if schema is None or not op.unpack or len(op.outputs) != 3:
        return None
    for i, a in enumerate(schema.arguments):
        if a.name == "output_mask" and i < len(op.args):
            return i
    return None


def separate_weight_outputs(prog: Program) -> tuple[Program, tuple[tuple[int, int], ...]]:
    """Each fused backward op that makes an input gradient and weight gradients together (its
    ``output_mask`` asks for both) becomes two: one asking for the input gradient only, right
    after it one asking for the weight gradients only; returns the program and the (first,
    second) op positions of each pair. Alone this only adds work; :func:`split_backward` keeps a
    pair where its halves fall in I and W and merges the others back."""
    ops: list[Any] = []
    pairs: list[tuple[int, int]] = []
    for op in prog.ops:
        pos = _mask_position(op)
        mask = op.args[pos] if pos is not None else None
        if mask is None or not mask[0] or not any(mask[1:]) or op.outputs[0] < 0:
            ops.append(dataclasses.replace(op, index=len(ops)))
            continue
        a = list(op.args)
        a[pos] = [True, False, False]
        first = dataclasses.replace(op, index=len(ops), args=tuple(a), outputs=(op.outputs[0], -1, -1))
        a = list(op.args)
        a[pos] = [False, bool(mask[1]), bool(mask[2])]
        second = dataclasses.replace(op, index=len(ops) + 1, args=tuple(a), outputs=(-1, *op.outputs[1:]))
        pairs.append((len(ops), len(ops) + 1))
        ops += [first, second]
    return dataclasses.replace(prog, ops=tuple(ops)), tuple(pairs)


def _merge_pairs(prog: Program, pairs: Sequence[tuple[int, int]], keep: set[tuple[int, int]]) -> Program:
    """Undo :func:`separate_weight_outputs` for the pairs not in ``keep``."""
    merge = {p[0]: p for p in pairs if p not in keep}
    second = {p[1] for p in merge.values()}
    ops: list[Any] = []
    for op in prog.ops:
        if op.index in second:
            continue
        if op.index in merge:
            b = prog.ops[merge[op.index][1]]
            pos = _mask_position(op)
            a = list(op.args)
            a[pos] = [True, *b.args[pos][1:]]
            op = dataclasses.replace(op, args=tuple(a), outputs=(op.outputs[0], *b.outputs[1:]))
        ops.append(dataclasses.replace(op, index=len(ops)))
    return dataclasses.replace(prog, ops=tuple(ops))


def _i_and_w(prog: Program, n_input_grads: int) -> tuple[set[int], set[int]]:
    deps = order_edges(prog, alias_groups(prog))
    producer = _producers(prog)
    out_ids = [o.id for o in prog.outputs]
    i_ops = ancestors(deps, [producer[o] for o in out_ids[:n_input_grads] if o in producer])
    w_ops = ancestors(deps, [producer[o] for o in out_ids[n_input_grads:] if o in producer]) - i_ops
    return i_ops, w_ops


def split_backward(backward: Program, n_input_grads: int, origins: dict[int, str] | None = None,
                   defer_fused: bool = True) -> BackwardSplit:
    """Split a backward program whose first ``n_input_grads`` outputs are input gradients (the
    rest weight gradients) into I and W.

    I is every op the input gradients need, with every op those follow (read-after-write,
    write-after-read, write-after-write: an in-place op keeps its order); W is every other op
    a weight gradient needs. W's inputs are the values W reads that it does not make: backward
    inputs (``origins`` names where each came from: ``"saved"``, ``"input"``, ``"seed"``) and
    values I made (origin ``"I"``). I returns, after the input gradients, every W input that is
    not a saved value of the forward (seeds and its own results), so that it outlives the job.
    """
    origins = origins or {}
    if defer_fused:  # the weight half of a fused norm/convolution backward goes to W where it can
        separated, pairs = separate_weight_outputs(backward)
        if pairs:
            i_ops, w_ops = _i_and_w(separated, n_input_grads)
            keep = {p for p in pairs if p[0] in i_ops and p[1] in w_ops}
            backward = _merge_pairs(separated, pairs, keep)
    i_ops, w_ops = _i_and_w(backward, n_input_grads)
    out_ids = [o.id for o in backward.outputs]
    # Views I makes of state or of backward inputs (detach(weight), x.view(...)): W remakes
    # them from what it reads anyway, rather than keeping them.
    producer = _producers(backward)
    inputs = set(backward.inputs)
    remade = _views_to_remake(backward, producer, w_ops, i_ops,
                              lambda x: backward.values[x].role in (Role.STATE, Role.CONST) or x in inputs)
    w_ops |= remade
    # An op W needs that an op of I follows is in I by the closure above; the reverse (an I op
    # W must follow) is a W op that depends on I, which is fine: I runs first.
    made_in_w = {o for i in w_ops for o in backward.ops[i].outputs if o >= 0}
    wanted: list[int] = []
    readers: dict[int, list[str]] = {}
    for i in sorted(w_ops):
        op = backward.ops[i]
        for r in op.refs():
            if r not in made_in_w and backward.values[r].role is not Role.STATE and r not in backward.consts:
                wanted.append(r)
                readers.setdefault(r, [])
                if op.name not in readers[r]:
                    readers[r].append(op.name)
    for o in out_ids[n_input_grads:]:
        if o not in made_in_w:  # a weight gradient I made (or a backward input passed through)
            wanted.append(o)
            readers.setdefault(o, []).append("(returned)")
    w_inputs = tuple(dict.fromkeys(wanted))
    backward_inputs = set(backward.inputs)
    i_kept = tuple(v for v in w_inputs if v not in backward_inputs or origins.get(v) == "seed")
    i_program = slice_program(backward, i_ops, backward.inputs, [*out_ids[:n_input_grads], *i_kept])
    w_program = slice_program(backward, w_ops, w_inputs, out_ids[n_input_grads:])
    kept = tuple(
        KeptValue(v, backward.values[v].name, backward.values[v].meta, origins.get(v, "saved") if v in backward_inputs else "I",
                  tuple(readers.get(v, ())))
        for v in w_inputs
    )
    return BackwardSplit(i_program, w_program, n_input_grads, i_kept, w_inputs, kept)


def format_kept(split: BackwardSplit) -> str:
    """The values kept alive between a micro-batch's I and W jobs, one per line, as a table.

    Columns: the value's name in the capture, dtype and shape, where it comes from (``input``:
    a stage input; ``saved``: made by F; ``seed``: an output's gradient; ``I``: made by the I
    job), and the W ops that read it. A last line sums the bytes.
    """
    rows = [("value", "type", "from", "read by W")]
    for k in split.kept:
        rows.append((k.name, str(k.meta).rsplit(" ", 1)[0], k.origin, ", ".join(n.replace("aten.", "").replace(".default", "")
                                                                              for n in k.readers)))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    lines = ["  ".join(r[c].ljust(widths[c]) for c in range(3)) + "  " + r[3] for r in rows]
    total = sum(_numel(k.meta.shape) * k.meta.dtype.itemsize for k in split.kept)
    lines.append(f"{len(split.kept)} values, {total} bytes")
    return "\n".join(line.rstrip() for line in lines)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- capture -------------------------------------------------------------------------------------

def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def probe_outputs(module: torch.nn.Module, inputs: Sequence[torch.Tensor], needs_grad: Sequence[bool],
                  loss_fn: Callable[..., torch.Tensor] | None, target: torch.Tensor | None) -> tuple[list[Any], Any]:
    """Run the stage once eagerly to learn its outputs (flat list, spec), leaving no trace: the
    buffers and the random streams are restored."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        xs = [x.detach().requires_grad_(True) if n else x for x, n in zip(inputs, needs_grad)]
        out = module(*xs)
        if loss_fn is not None:
            out = loss_fn(out, target)
            if not (isinstance(out, torch.Tensor) and out.numel() == 1):
                raise CaptureError(f"loss_fn must return a one-element tensor, got {type(out).__name__}"
                                   f"{list(out.shape) if isinstance(out, torch.Tensor) else ''}")
        flat, spec = pytree.tree_flatten(out)
        return flat, spec
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _name_inputs(prog: Program, n_in: int, n_extra: int) -> Program:
    """The joint with readable input names: ``input0``..., ``target``, ``grad_output0``..."""
    names = {v: f"input{k}" for k, v in enumerate(prog.inputs[:n_in])}
    names.update({v: "target" for v in prog.inputs[n_in:n_in + n_extra]})
    names.update({v: f"grad_output{k}" for k, v in enumerate(prog.inputs[n_in + n_extra:])})
    values = tuple(dataclasses.replace(v, name=names[v.id]) if v.id in names else v for v in prog.values)
    return dataclasses.replace(prog, values=values)


def capture_stage(module: torch.nn.Module, example_inputs: Sequence[torch.Tensor], *,
                  loss_fn: Callable[..., torch.Tensor] | None = None, target: torch.Tensor | None = None,
                  input_grads: bool | Sequence[bool] | None = None) -> StageCapture:
    """Capture ``module`` on ``example_inputs`` once into forward, backward, I and W programs.

    ``loss_fn`` (with an example ``target``): the last stage, whose forward ends in
    ``loss_fn(output, target)`` and whose backward starts from that loss. ``input_grads``:
    which inputs get a gradient (default: every floating-point input; ``False``: none, as on
    the first stage). Raises :class:`~flowexec.errors.CaptureError` for stages the programs
    cannot represent: random ops (dropout), outputs that are not tensors, a backward that
    writes buffers.

    >>> import torch
    >>> cap = capture_stage(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    >>> cap.n_outputs, len(cap.params), cap.input_grad_positions
    (1, 2, (0,))
    """
    inputs = tuple(example_inputs)
    for k, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise CaptureError(f"example input {k} is a {type(x).__name__}; stage inputs must be tensors")
    if input_grads is None or isinstance(input_grads, bool):
        needs = [(input_grads is not False) and _is_float(x) for x in inputs]
    else:
        needs = [bool(b) for b in input_grads]
        if len(needs) != len(inputs):
            raise CaptureError(f"input_grads has {len(needs)} entries for {len(inputs)} inputs")
        for k, (n, x) in enumerate(zip(needs, inputs)):
            if n and not _is_float(x):
                raise CaptureError(f"input {k} is {x.dtype}: only floating-point inputs have gradients")
    if loss_fn is not None and not isinstance(target, torch.Tensor):
        raise CaptureError("the last stage (loss_fn given) needs an example target tensor to capture its loss")
    params = tuple(p for p in module.parameters() if p.requires_grad)
    flat, out_spec = probe_outputs(module, inputs, needs, loss_fn, target)
    for k, o in enumerate(flat):
        if not isinstance(o, torch.Tensor):
            raise CaptureError(f"stage output {k} is a {type(o).__name__}; stage outputs must be tensors")
    diff = tuple(k for k, o in enumerate(flat) if o.requires_grad)
    seed_examples = [torch.zeros_like(flat[k]).detach() if loss_fn is None else torch.ones_like(flat[k]).detach()
                     for k in diff]
    n_in = len(inputs)
    n_extra = 1 if loss_fn is not None else 0
    unused_params: list[int] = []

    def joint(*args: torch.Tensor) -> Any:
        xs = [x.detach().requires_grad_(True) if n else x for x, n in zip(args[:n_in], needs)]
        out = module(*xs)
        if loss_fn is not None:
            out = loss_fn(out, args[n_in])
        outs = pytree.tree_leaves(out)
        seeds = args[n_in + n_extra:]
        wrt = [x for x, n in zip(xs, needs) if n] + list(params)
        grads = torch.autograd.grad([outs[k] for k in diff], wrt, list(seeds), allow_unused=True) if diff and wrt else [None] * len(wrt)
        n_x = len(wrt) - len(params)
        gx = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads[:n_x], wrt[:n_x])]
        gp = []
        for k, g in enumerate(grads[n_x:]):
            if g is None:
                unused_params.append(k)
            else:
                gp.append(g)
        return [o.detach() for o in outs], gx, gp

    args = [*inputs, *([target] if loss_fn is not None else []), *seed_examples]
    cap = capture(joint, args, guarded="reads")
    joint_prog = _name_inputs(cap.program, n_in, n_extra)
    rand = _random_ops(joint_prog)
    if rand:
        op = rand[0]
        raise CaptureError(
            f"stage uses a random op ({op.name}{', at ' + op.source if op.source else ''}): CompiledRunner replays "
            "fixed programs and cannot keep dropout masks equal between a forward and its backward; "
            "use compile=False for this stage, or put it in eval mode (no dropout)")
    if cap.grad_bindings:
        raise CaptureError("the stage set .grad of a tensor during its forward; CompiledRunner cannot capture that")
    n_out = len(flat)
    seed_ids = tuple(joint_prog.inputs[n_in + n_extra:])
    forward, backward, saved = partition_joint(joint_prog, n_out, seed_ids)
    groups = alias_groups(joint_prog)
    input_groups = {groups[v] for v in joint_prog.inputs[:n_in]}
    origins = {v: ("input" if groups[v] in input_groups else "saved") for v in saved}
    origins.update({v: "seed" for v in seed_ids})
    n_gx = sum(needs)
    split = split_backward(backward, n_gx, origins)
    used_params = tuple(p for k, p in enumerate(params) if k not in set(unused_params))
    return StageCapture(joint_prog, forward, backward, split, saved, n_in, n_out, diff,
                        tuple(TensorMeta.of(s) for s in seed_examples), tuple(k for k, n in enumerate(needs) if n),
                        used_params, None if loss_fn is not None else out_spec, tuple(backward.inputs), cap.guards)
