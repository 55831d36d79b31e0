"""``CompiledRunner``: a pipeline stage's jobs (F, B, I, W) as flowexec programs.

The stage is captured once (:func:`~flowexec.pipeline.split.capture_stage`) into a forward,
a full backward, and the backward's I and W halves; each is planned (liveness frees every
intermediate at its last use) and lowered once. A job is one call of its program: a
trace-mode run on CPU, a CUDA-graph replay on CUDA. The runner keeps, per micro-batch in
flight, what the next job of that micro-batch reads and nothing else: after F the saved
values; after I only the values W reads (the *kept* values of
:func:`~flowexec.pipeline.split.format_kept`); after W or B nothing.

Graph mode keeps one *slot* per micro-batch in flight: a slot holds the CUDA graphs of F, B, I
and W (each captured on first use) whose buffers are chained — I and B read the saved values
where F's graph wrote them, W reads them and I's results where they lie — so no job copies
another's results. A forward takes the lowest free slot and a micro-batch frees its slot at
its last backward job, so a schedule with k micro-batches in flight captures k slots (1F1B:
at most the number of stages; GPipe: every micro-batch). Stage inputs and output gradients are
copied into a slot's input buffers (they come from the caller, whose tensors may change).

Gradients accumulate into ``param.grad`` as eager autograd does: the first contribution of a
step becomes ``.grad``; in trace mode every later B or W job runs a variant of its program that
adds into ``.grad`` in place (:func:`~flowexec.pipeline.accumulate.accumulate_gradients`: a
``Linear``'s weight gradient is one ``addmm_`` into ``.grad``, no temporary); in graph mode the
graph's gradients are added with one ``_foreach_add_`` per job.

Example::

    >>> import torch
    >>> from flowexec.pipeline.compiled import CompiledRunner
    >>> stage = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    >>> r = CompiledRunner(stage, example_inputs=(torch.randn(2, 4),))
    >>> (y,) = r.forward(0, (torch.randn(2, 4),))
    >>> (gx,) = r.backward_input(0, (torch.ones_like(y),))
    >>> r.backward_weight(0)
    >>> stage[0].weight.grad.shape
    torch.Size([4, 4])
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import InputError, OptionError, RecaptureWarning
from ..build import plan_for
from ..fusion import check_fuse
from ..passes.dependencies import alias_groups
from ..plan import ExecutionPlan
from ..program import Program, Role
from ..runtime import fastcall
from ..runtime.interpreter import lower_trace
from .accumulate import accumulate_gradients
from .split import StageCapture, capture_stage

MODES = ("trace", "graph")


@dataclass
class _Micro:
    """What one micro-batch in flight holds: ``values`` by value id, the last job it ran."""

    values: dict[int, torch.Tensor]
    done: str  # "F" or "I"
    slot: Any = None


@dataclass
class _Slot:
    """Graph mode: the CUDA graphs one micro-batch in flight runs on (captured on first use)."""

    graphs: dict[str, Any] = field(default_factory=dict)
    busy: bool = False


def _fresh_outputs(prog: Program) -> list[bool]:
    """Per output: whether it is memory the program allocates (not an input's or state's, nor
    shared with another output), which may become a ``.grad`` without a copy."""
    groups = alias_groups(prog)
    foreign = {groups[v.id] for v in prog.values if v.role is not Role.TEMP}
    seen: dict[int, int] = {}
    for o in prog.outputs:
        seen[groups[o.id]] = seen.get(groups[o.id], 0) + 1
    return [groups[o.id] not in foreign and seen[groups[o.id]] == 1 for o in prog.outputs]


class CompiledRunner:
    """Runs one pipeline stage's F, B, I and W jobs as compiled flowexec programs.

    ``module``: the stage; ``example_inputs``: a tuple of tensors shaped like one micro-batch's
    inputs (every call must match them: shape, dtype, device). ``loss_fn``: the last stage's
    ``loss_fn(output, target)``; its backward starts from ``loss * loss_scale`` (captured at
    the first forward, which brings the target). ``mode``: ``"trace"``, ``"graph"`` (CUDA), or
    None (graph on CUDA, trace elsewhere). ``input_grads``: which inputs get gradients (default
    every floating-point one; False on a first stage, whose inputs are data). Implements the
    stage-runner interface (``forward``, ``backward``, ``backward_input``, ``backward_weight``).

    >>> import torch
    >>> lin = torch.nn.Linear(3, 1)
    >>> r = CompiledRunner(lin, example_inputs=(torch.randn(2, 3),), loss_fn=torch.nn.functional.mse_loss)
    >>> (loss,) = r.forward(0, (torch.randn(2, 3),), target=torch.zeros(2, 1))
    >>> r.backward(0, None)
    (tensor(...),)
    """

    def __init__(self, module: torch.nn.Module, *, example_inputs: Sequence[torch.Tensor],
                 loss_fn: Callable[..., torch.Tensor] | None = None, loss_scale: float = 1.0,
                 mode: str | None = None, input_grads: bool | Sequence[bool] | None = None,
                 warmup: int = 1, fuse: str | bool | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise OptionError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        example = tuple(example_inputs)
        if not example or not all(isinstance(x, torch.Tensor) for x in example):
            raise InputError("example_inputs must be a non-empty tuple of tensors (one micro-batch's stage inputs)")
        cuda = example[0].device.type == "cuda"
        if mode is None:
            mode = "graph" if cuda else "trace"
        if mode not in MODES:
            raise OptionError(f"mode={mode!r} is not a run mode for a compiled stage; valid: trace, graph, None")
        if mode == "graph" and not (cuda and torch.cuda.is_available()):
            raise OptionError(f"mode='graph' replays CUDA graphs, but the stage's inputs are on {example[0].device}; "
                              "use mode='trace' (or None) on CPU")
        self.module, self.loss_fn, self.loss_scale, self.mode = module, loss_fn, float(loss_scale), mode
        self.parameters: list[torch.nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self._example = example
        self._sig = [(tuple(x.shape), x.dtype, x.device) for x in example]
        self._input_grads = input_grads
        self._warmup = warmup
        self._fuse = check_fuse(fuse)
        self._micros: dict[int, _Micro] = {}
        self._slots: list[_Slot] = []
        self._overwrite = False  # the next B/W job writes .grad instead of adding (reset_grads)
        self.capture: StageCapture | None = None
        if loss_fn is None:
            self._build(example, None)

    # -- building ---------------------------------------------------------------------------
    def _plan(self, prog: Program) -> ExecutionPlan:
        return plan_for(prog, self.mode, fuse=self._fuse)

    # A stage's programs compute their gradients themselves: the capture needs autograd whatever
    # the caller's grad mode, and its guards then record grad mode on (_changed checks under the
    # same mode, so jobs run under torch.no_grad() keep their program).
    @torch.enable_grad()
    def _build(self, inputs: Sequence[torch.Tensor], target: torch.Tensor | None) -> None:
        cap = capture_stage(self.module, inputs, loss_fn=self.loss_fn, target=target, input_grads=self._input_grads)
        if cap.guards is not None:  # checked in C++ where the extension is built (the Python check else)
            cap.guards.attach(fastcall.guard_checker(cap.guards))
        self.capture = cap
        # the Python assignments the forward made, repeated after each F job as running it would
        self._replay = cap.guards.replay if cap.guards is not None and cap.guards.after_call else None
        self._target_sig = None if target is None else (tuple(target.shape), target.dtype, target.device)
        sp = cap.split
        progs = {"F": cap.forward, "B": cap.backward, "I": sp.i_program, "W": sp.w_program}
        # Each job's program is fused after the I/W split (fusion.py): the split reads ATen ops.
        self.plans = {k: self._plan(p) for k, p in progs.items()}
        self._runs = {k: lower_trace(p) for k, p in self.plans.items()}
        # Trace mode, once .grad exists: B and W adding into it in place ("acc"), or writing
        # over last step's values ("over", the first contribution after reset_grads).
        n_gx = len(cap.input_grad_positions)
        self._acc_runs = {} if self.mode != "trace" else {
            (job, over): lower_trace(self._plan(accumulate_gradients(prog, first, overwrite=over)))
            for job, prog, first in (("B", cap.backward, n_gx), ("W", sp.w_program, 0)) for over in (False, True)}
        # Which gradients may become .grad as they are (trace mode: fresh memory of that call).
        self._fresh = {"B": _fresh_outputs(cap.backward)[len(cap.input_grad_positions):],
                       "W": _fresh_outputs(sp.w_program)}
        self._mutated_state = [cap.forward.state[v] for v in self.plans["F"].mutated if v in cap.forward.state]
        self._grad_params = list(cap.params)
        self._grad_set = set(cap.params)
        self._n_gx = len(cap.input_grad_positions)
        self._seed_pos = cap.seed_positions
        self._zeros: dict[int, torch.Tensor] = {}
        if self.loss_fn is not None:
            m = cap.seed_metas[0]
            self._loss_seed = torch.full(m.shape, self.loss_scale, dtype=m.dtype, device=m.device)

    def _check(self, micro: int, inputs: Any, target: Any) -> tuple[torch.Tensor, ...]:
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        inputs = tuple(inputs)
        if len(inputs) != len(self._sig):
            raise InputError(f"micro-batch {micro}: the stage takes {len(self._sig)} input(s), got {len(inputs)}")
        for k, (x, (shape, dtype, device)) in enumerate(zip(inputs, self._sig)):
            if not isinstance(x, torch.Tensor) or (tuple(x.shape), x.dtype, x.device) != (shape, dtype, device):
                got = f"{x.dtype} {list(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise InputError(f"micro-batch {micro}: input {k} is {got}; the stage was compiled for "
                                 f"{dtype} {list(shape)} on {device} (every micro-batch must match example_inputs)")
        if (self.loss_fn is None) != (target is None):
            raise InputError(f"micro-batch {micro}: " + ("the last stage (loss_fn given) needs a target"
                                                         if target is None else "a target was given to a stage without loss_fn"))
        if micro in self._micros:
            raise InputError(f"micro-batch {micro}'s forward ran already and its backward has not")
        return inputs

    # -- jobs -------------------------------------------------------------------------------
    def forward(self, micro: int, inputs: tuple[torch.Tensor, ...],
                target: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """F job: the stage outputs (detached), or ``(loss,)`` unscaled on the last stage."""
        inputs = self._check(micro, inputs, target)
        if self.capture is None:
            self._build(inputs, target)
        elif not self._micros and self._changed():  # (between steps: no micro-batch in flight)
            self._slots.clear()
            self._build(inputs, target)
        elif target is not None and (tuple(target.shape), target.dtype, target.device) != self._target_sig:
            raise InputError(f"micro-batch {micro}: target is {target.dtype} {list(target.shape)} on {target.device}; "
                             f"the stage was compiled for {self._target_sig}")
        cap = self.capture
        assert cap is not None
        args = (*inputs, target) if target is not None else inputs
        slot = None
        if self.mode == "graph":
            slot = self._take_slot()
            flat = self._graph(slot, "F", args, [False] * len(args))(args)
        else:
            flat = self._runs["F"](*args)
        n = cap.n_outputs
        self._micros[micro] = _Micro(dict(zip(cap.saved, flat[n:])), "F", slot)
        if self._replay is not None:
            self._replay()
        return tuple(flat[:n])

    def _changed(self) -> bool:
        """Whether a value the capture read changed (``model.eval()``, a module attribute,
        ``requires_grad``, autocast): said in a warning; the caller captures the stage again."""
        guards = self.capture.guards if self.capture is not None else None
        with torch.enable_grad():  # (grad mode does not change a stage's programs: _build)
            i = -1 if guards is None else guards.check()
        if i < 0:
            return False
        warnings.warn(f"flowexec: pipeline stage: {guards.describe(i)}; capturing the stage again", RecaptureWarning,
                      stacklevel=4)
        return True

    def backward(self, micro: int, grad_outputs: Sequence[torch.Tensor | None] | None) -> tuple[torch.Tensor | None, ...]:
        """B job: accumulates every parameter gradient and returns the input gradients."""
        seeds = self._seeds(micro, grad_outputs)  # checked before the state is let go
        st = self._pop(micro, "B", "F")
        saved = [st.values[v] for v in self.capture.saved]  # type: ignore[union-attr]
        args = (*saved, *seeds)
        if st.slot is not None:
            flat = self._graph(st.slot, "B", args, [True] * len(saved) + [self.loss_fn is not None] * len(seeds))(args)
            self._free(st.slot)
        else:
            held = self._held_grads()
            if held is not None:
                return self._input_grads_of(self._acc_runs["B", self._take_overwrite()](*args, *held))
            flat = self._runs["B"](*args)
        self._accumulate(flat[self._n_gx:], "B")
        return self._input_grads_of(flat[: self._n_gx])

    def backward_input(self, micro: int, grad_outputs: Sequence[torch.Tensor | None] | None) -> tuple[torch.Tensor | None, ...]:
        """I job: returns the input gradients; keeps only what the W job reads."""
        st = self._micros.get(micro)
        if st is None or st.done != "F":
            raise InputError(self._order_error(micro, "I", st))
        cap = self.capture
        assert cap is not None
        seeds = self._seeds(micro, grad_outputs)
        args = (*[st.values[v] for v in cap.saved], *seeds)
        if st.slot is not None:
            borrow = [True] * len(cap.saved) + [self.loss_fn is not None] * len(seeds)
            flat = self._graph(st.slot, "I", args, borrow)(args)
        else:
            flat = self._runs["I"](*args)
        sp = cap.split
        made = dict(zip(sp.i_kept, flat[self._n_gx:]))
        st.values = {v: made[v] if v in made else st.values[v] for v in sp.w_inputs}
        st.done = "I"
        return self._input_grads_of(flat[: self._n_gx])

    def backward_weight(self, micro: int) -> None:
        """W job: accumulates the parameter gradients of ``micro``; frees its state."""
        st = self._pop(micro, "W", "I")
        args = [st.values[v] for v in self.capture.split.w_inputs]  # type: ignore[union-attr]
        if st.slot is not None:
            flat = self._graph(st.slot, "W", args, [True] * len(args))(args)
            self._free(st.slot)
        else:
            held = self._held_grads()
            if held is not None:
                self._acc_runs["W", self._take_overwrite()](*args, *held)
                return
            flat = self._runs["W"](*args)
        self._accumulate(flat, "W")

    @property
    def in_flight(self) -> dict[int, str]:
        """Micro-batches whose state the runner holds, with the last job each ran."""
        return {m: st.done for m, st in self._micros.items()}

    def kept_bytes(self, micro: int) -> int:
        """Bytes of the tensors the runner holds for ``micro`` now (views counted whole)."""
        st = self._micros[micro]
        return sum(t.numel() * t.element_size() for t in st.values.values())

    # -- helpers ----------------------------------------------------------------------------
    def _order_error(self, micro: int, job: str, st: _Micro | None) -> str:
        if st is None:
            return f"{job} job of micro-batch {micro}: its forward has not run (or its backward has finished)"
        need = {"I": "F", "B": "F", "W": "I"}[job]
        return f"{job} job of micro-batch {micro}: it follows {need}, but the last job of that micro-batch was {st.done}"

    def _pop(self, micro: int, job: str, after: str) -> _Micro:
        st = self._micros.get(micro)
        if st is None or st.done != after:
            raise InputError(self._order_error(micro, job, st))
        del self._micros[micro]
        return st

    def _seeds(self, micro: int, grad_outputs: Any) -> list[torch.Tensor]:
        cap = self.capture
        assert cap is not None
        if self.loss_fn is not None:
            if grad_outputs is not None:
                raise InputError(f"micro-batch {micro}: the last stage's backward starts from its loss; pass grad_outputs=None")
            return [self._loss_seed]
        if grad_outputs is None:
            raise InputError(f"micro-batch {micro}: a stage without loss_fn needs grad_outputs (one per output)")
        if isinstance(grad_outputs, torch.Tensor):
            grad_outputs = (grad_outputs,)
        grad_outputs = tuple(grad_outputs)
        if len(grad_outputs) != cap.n_outputs:
            raise InputError(f"micro-batch {micro}: {len(grad_outputs)} grad_outputs for {cap.n_outputs} stage output(s)")
        seeds = []
        for pos, meta in zip(self._seed_pos, cap.seed_metas):
            g = grad_outputs[pos]
            if g is None:  # that output's consumer needs no gradient: zeros, as autograd would use
                g = self._zeros.get(pos)
                if g is None:
                    g = self._zeros[pos] = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
            elif (tuple(g.shape), g.dtype, g.device) != (meta.shape, meta.dtype, meta.device):
                raise InputError(f"micro-batch {micro}: grad_outputs[{pos}] is {g.dtype} {list(g.shape)} on {g.device}; "
                                 f"output {pos} is {meta.dtype} {list(meta.shape)} on {meta.device}")
            seeds.append(g)
        return seeds

    def _input_grads_of(self, gx: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = [None] * len(self._sig)
        for pos, g in zip(self.capture.input_grad_positions, gx):  # type: ignore[union-attr]
            out[pos] = g
        return tuple(out)

    def reset_grads(self) -> None:
        """Start a step's gradients: afterwards ``.grad`` holds only what later B and W jobs
        give. In trace mode, where every gradient parameter has a ``.grad``, the buffers are
        kept and the next job writes over them (as ``zero_grad(set_to_none=False)`` would keep
        them, without the zeroing): fresh gradient memory each step costs page faults, ~1 ms
        per 4 MB on a CPU. Otherwise ``.grad`` is set to None."""
        if self.capture is not None and self.mode == "trace" and all(p.grad is not None for p in self._grad_params):
            self._overwrite = True
            for p in self.parameters:
                if p not in self._grad_set:
                    p.grad = None
            return
        self._overwrite = False
        for p in self.parameters:
            p.grad = None

    def _take_overwrite(self) -> bool:
        over, self._overwrite = self._overwrite, False
        return over

    def _held_grads(self) -> list[torch.Tensor] | None:
        """Every gradient parameter's ``.grad`` when all are set (then the in-place variant
        adds into them), else None (the first contribution of a step)."""
        held = [p.grad for p in self._grad_params]
        return None if any(g is None for g in held) else held  # type: ignore[return-value]

    def _accumulate(self, grads: Sequence[torch.Tensor], job: str) -> None:
        fresh = self._fresh[job]
        held, add = [], []
        for k, (p, g) in enumerate(zip(self._grad_params, grads)):
            if p.grad is None:
                # A graph's output buffer is rewritten by the next replay, and an output that is
                # an input's memory is the caller's: .grad gets its own copy of those.
                # .grad keeps the parameter's layout, as autograd's accumulation does.
                own = fresh[k] and self.mode == "trace" and g.stride() == p.stride()
                p.grad = g if own else torch.empty_like(p).copy_(g)
            else:
                held.append(p.grad)
                add.append(g)
        if held:
            torch._foreach_add_(held, add)

    # -- graph mode -------------------------------------------------------------------------
    def _take_slot(self) -> _Slot:
        for s in self._slots:
            if not s.busy:
                s.busy = True
                return s
        s = _Slot(busy=True)
        self._slots.append(s)
        return s

    def _free(self, slot: _Slot) -> None:
        slot.busy = False

    def _graph(self, slot: _Slot, job: str, args: Sequence[torch.Tensor], borrow: list[bool]) -> Any:
        g = slot.graphs.get(job)
        if g is None:
            from ..runtime.cuda_graph import CudaGraphRunner

            plan = self.plans[job]
            g = CudaGraphRunner(self._runs[job], list(args), self._mutated_state if job == "F" else [],
                                borrow=borrow, state=plan.program.state.values(), warmup=self._warmup,
                                keep_borrowed=False)
            slot.graphs[job] = g
        return g

    @property
    def graph_slots(self) -> int:
        """Graph mode: how many slots (graph sets) exist — the most micro-batches in flight so far."""
        return len(self._slots)

    def __repr__(self) -> str:
        return (f"<CompiledRunner {type(self.module).__name__} mode={self.mode} params={len(self.parameters)} "
                f"in_flight={len(self._micros)}>")
