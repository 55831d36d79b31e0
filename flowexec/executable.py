"""``flowexec.compile``: capture → plan → lower, and the callable it returns.

Example::

    >>> import torch, flowexec
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> def step(x, y):
    ...     opt.zero_grad(set_to_none=False)
    ...     loss = torch.nn.functional.mse_loss(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     return loss
    >>> exe = flowexec.compile(step, torch.randn(8, 4), torch.randn(8, 2))
    >>> loss = exe(torch.randn(8, 4), torch.randn(8, 2))  # one training step, params updated in place
"""
from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .capture import capture, storage_groups, storage_key
from .errors import InputError, OptionError, count_option
from .plan import ExecutionPlan, build_plan, check_gc
from .program import Program, Ref
from .runtime.interpreter import lower_trace

MODES = ("trace", "graph")
OPTIONS = {
    "cache_size": "how many input signatures to keep compiled (default 8); past that a new one is an error",
    "warmup": "graph mode: eager warm-up runs before capture (default 1)",
    "fetch": "True or output indices: return those one-element outputs as flowexec.Fetch handles "
             "(copied to the host on a side stream; .result() waits for that value only)",
    "fetch_slots": "pinned slots in the fetch ring (default 64)",
    "fuse_lerp": "substitute flowexec's fused Triton lerp for aten.lerp / aten.lerp_ on CUDA where it measured "
                 "faster (a broadcast operand, >= 2**20 elements): by default in graph mode, with True in every "
                 "mode; 'all': every eligible lerp and lerp_; False: none",
    "streams": "run independent ops on up to this many CUDA streams (default 1), ordered by statically planned "
               "events; pays in graph mode, where the events are edges of the graph (trace mode pays host time "
               "for every stream switch and event)",
    "memory": "'normal' (default: the caching allocator) or 'planned': intermediates get offsets in one arena per "
              "device, planned offline, and ops write into views of it (docs/memory.md)",
    "order": "'program' (default: the captured order) or 'memory': a dependency-respecting order that lowers the "
             "planned peak (branches depth-first, large buffers die early)",
    "gc_backlog": "gc='async': bound on the bytes handed to the collector and not yet freed, as bytes (int) or a "
                  "fraction of the planned peak (float, default 0.1); past it the caller frees itself",
    "borrow": "graph mode: positions of further tensor arguments to read where they are instead of copying them "
              "in, for tensors passed the same each call (gradients, say); arguments fn writes in place and "
              "parameters are read in place already",
}


class RecaptureWarning(UserWarning):
    """A call with a new input signature made flowexec capture fn again."""


def _signature(args: Sequence[Any]) -> tuple[Any, ...]:
    # Strides belong to the signature: make_fx records reshape as view when the example was
    # contiguous, which a strided call would break.
    return tuple([
        (a.shape, a.dtype, a.device, a.stride()) if isinstance(a, torch.Tensor) else (type(a), a) for a in args
    ])


_NO_SHARING = (("shared storage", ()),)  # the signature's last entry when no argument shares storage


def _describe(sig_item: Any) -> str:
    if isinstance(sig_item[0], torch.Size):
        shape, dtype, device, stride = sig_item
        return f"Tensor(shape={list(shape)}, dtype={dtype}, device={device}, stride={stride})"
    if isinstance(sig_item[0], str):  # ("shared storage", ((position, first position, bytes after it) or
        pairs = sig_item[1]           #                     (position, "state"), ...))
        return ", ".join(f"argument {p[0]} on closure state's storage" if p[1] == "state" else
                         f"argument {p[0]} on argument {p[1]}'s storage at {p[2]:+d} bytes"
                         for p in pairs) if pairs else "no arguments sharing storage"
    return f"{sig_item[0].__name__} {sig_item[1]!r}"


@dataclass
class _Compiled:
    """Everything built for one input signature."""

    plan: ExecutionPlan
    runner: Callable[[Sequence[Any]], list[Any]]
    tensor_pos: tuple[int, ...]
    user_spec: Any
    n_user: int
    grad_bindings: list[tuple[torch.Tensor, int]]
    build_seconds: float
    fetch: tuple[int, ...] = ()
    all_tensors: bool = False  # every argument is a tensor: the runner takes the args tuple as is

    def __post_init__(self) -> None:
        # fn returned one tensor (not a container): hand it back without unflattening.
        self.single = self.user_spec.is_leaf()


class Executable:
    """A captured, planned and lowered function; call it like the original.

    Attributes ``program`` and ``plan`` show the most recently built signature.

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: x.cumsum(0), torch.ones(3))
    >>> exe(torch.ones(3)), exe.plan.stats()["ops"]
    (tensor([1., 2., 3.]), 1)
    """

    def __init__(self, fn: Callable[..., Any], mode: str, gc: str, options: dict[str, Any]) -> None:
        self.fn, self.mode, self.gc = fn, mode, gc
        self.cache_size = int(options.get("cache_size", 8))
        self.streams = count_option(options, "streams", 1, 1)
        # Arguments that share memory (with each other or with state) must be planned as one
        # buffer over several streams, and staged as one buffer in graph mode (a write through
        # one shows through the other): the call's pattern of sharing joins its signature.
        self._sharing = self.streams > 1 or mode == "graph"
        self._sig: Callable[[Sequence[Any]], tuple[Any, ...]] = self._shared_signature if self._sharing else _signature
        self._state_keys: frozenset[int] = frozenset()
        self.warmup = int(options.get("warmup", 1))
        fetch = options.get("fetch", ())
        self.fetch: bool | tuple[int, ...] = fetch if isinstance(fetch, bool) else tuple(int(i) for i in fetch)
        self.fetch_slots = int(options.get("fetch_slots", 64))
        self.fuse_lerp: bool | str | None = options.get("fuse_lerp")
        self.borrow = tuple(options.get("borrow", ()))
        self.memory_options = {k: options[k] for k in ("memory", "order", "gc_backlog") if k in options}
        if self.borrow and mode != "graph":
            raise OptionError("borrow applies to mode='graph' only (trace mode reads every argument in place)")
        self._ring: Any = None
        self._cache: OrderedDict[tuple[Any, ...], _Compiled] = OrderedDict()
        self._first_sig: tuple[Any, ...] | None = None
        self._last: _Compiled | None = None

    # -- building -------------------------------------------------------------------------
    def _build(self, args: Sequence[Any]) -> _Compiled:
        t0 = time.perf_counter()
        cap = capture(self.fn, args)
        plan = build_plan(rewrite_program(cap.program, self.mode, self.fuse_lerp), self.gc, self.streams,
                          **self.memory_options)
        run = lower_trace(plan)
        tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        fetch = self._fetch_indices(cap.program, cap.n_user_outputs)
        runner: Callable[[Sequence[Any]], list[Any]] = lambda targs: run(*targs)
        if self.mode == "graph" and not self._graph_can_stage(args, tensor_pos, plan):
            pass  # trace mode for this signature (said in a warning)
        elif self.mode == "graph":
            from .runtime.cuda_graph import CudaGraphRunner

            prog = plan.program
            state_mutated = [prog.state[v] for v in plan.mutated if v in prog.state]
            input_index = {vid: k for k, vid in enumerate(prog.inputs)}
            mutated_inputs = [input_index[v] for v in plan.mutated if v in input_index]
            targs = [args[i] for i in tensor_pos]
            bound = {i for _, i in cap.grad_bindings} | set(fetch)

            def capture_runner(targs: Sequence[torch.Tensor], borrow: Sequence[bool]) -> CudaGraphRunner:
                # Warm-up must leave the caller's tensors as they were: borrowed inputs the
                # program writes are snapshotted with the state.
                mutated = state_mutated + [targs[k] for k in mutated_inputs if borrow[k]]
                return CudaGraphRunner(run, targs, mutated, borrow=borrow, state=prog.state.values(),
                                       mutated_inputs=mutated_inputs, unprotected_outputs=bound,
                                       warmup=self.warmup, before_replay=self._fence if fetch else None)

            borrow = borrowed_inputs(targs, mutated_inputs)
            shared = sharing_positions(targs)
            for i in self.borrow:
                if not (isinstance(i, int) and 0 <= i < len(args) and isinstance(args[i], torch.Tensor)):
                    raise OptionError(f"borrow: {i!r} is not the position of a tensor argument "
                                      f"(tensor arguments: {list(tensor_pos)})")
                k = tensor_pos.index(i)
                if k in shared:  # staged with the others on its storage
                    warnings.warn(f"flowexec: borrow: argument {i} shares memory with another argument in this "
                                  "call, so the graph copies it in with them (a graph reading it in place would "
                                  "miss writes made through the other)", stacklevel=5)
                    continue
                borrow[k] = True
            runner = GraphVariants(capture_runner, targs, borrow)
        user_spec = pytree.tree_structure(_user_out_placeholder(cap.program, cap.n_user_outputs, bool(cap.grad_bindings)))
        return _Compiled(plan, runner, tensor_pos, user_spec, cap.n_user_outputs, cap.grad_bindings,
                         time.perf_counter() - t0, fetch, tensor_pos == tuple(range(len(args))))

    def _graph_can_stage(self, args: Sequence[Any], tensor_pos: tuple[int, ...], plan: ExecutionPlan) -> bool:
        """Whether a graph can run this signature: not when a tensor argument shares memory with
        closure state and fn writes in place (the graph would read or write the argument in a
        buffer of its own, apart from that state); such calls run in trace mode, with a warning.
        Capture recorded which inputs share a storage with state (``Program.shared_storage``)."""
        prog = plan.program
        first_of = dict(prog.shared_storage)  # value -> first value on its storage (inputs come first)
        with_state = {f for v, f in prog.shared_storage if v in prog.state}
        on_state = [tensor_pos[k] for k, v in enumerate(prog.inputs) if v in with_state or first_of.get(v) in with_state]
        if not (on_state and plan.mutated):
            return True
        warnings.warn(
            f"flowexec: tensor argument(s) {', '.join(map(str, on_state))} share memory with tensors fn uses from "
            "its closure (parameters, buffers), and fn writes in place; a CUDA graph would copy them apart, so "
            "calls with this signature run in trace mode. Pass a copy, or leave the tensor to the closure.",
            stacklevel=5)
        return False

    def _fetch_indices(self, prog: Program, n_user: int) -> tuple[int, ...]:
        """Flat output positions returned as Fetch handles."""
        if self.fetch is False or self.fetch == ():
            return ()
        metas = [prog.values[o.id].meta if isinstance(o, Ref) else None for o in prog.outputs[:n_user]]
        scalar = [i for i, m in enumerate(metas) if m is not None and _numel(m.shape) == 1]
        if self.fetch is True:
            return tuple(scalar)
        for i in self.fetch:
            if i not in scalar:
                raise OptionError(f"fetch: output {i} is not a one-element tensor output (one-element outputs: {scalar})")
        return tuple(self.fetch)

    def _fence(self) -> None:
        # Graph mode: copies still reading last call's static outputs finish before the replay.
        if self._ring is not None:
            self._ring.fence()

    def _submit(self, flat: list[Any], indices: tuple[int, ...]) -> None:
        if self._ring is None:
            from .fetch import FetchRing

            self._ring = FetchRing(flat[indices[0]].device, slots=self.fetch_slots)
        for i in indices:
            flat[i] = self._ring.submit(flat[i])

    def _shared_signature(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The signature plus the tensor arguments that share a storage: for each, (position,
        the first argument's position on that storage, its start in bytes after that one's) or
        (position, "state"). The usual call shares nothing and pays one storage address per
        tensor argument (about 0.2 µs each on CPU)."""
        sig = _signature(args)
        try:  # empty tensors all read 0 here and take the slow path, which leaves them out
            keys = [a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)]
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            keys = None
        if keys is not None and len(set(keys)) == len(keys) and self._state_keys.isdisjoint(keys):
            return sig + _NO_SHARING
        first: dict[int, int] = {}
        shared: list[tuple[Any, ...]] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                k = storage_key(a)
                if k in self._state_keys:
                    shared.append((i, "state"))
                elif k and first.setdefault(k, i) != i:
                    b = args[first[k]]
                    shared.append((i, first[k], a.storage_offset() * a.element_size()
                                   - b.storage_offset() * b.element_size()))
        return (*sig, ("shared storage", tuple(shared)))

    def _lookup(self, args: tuple[Any, ...]) -> _Compiled:
        sig = self._sig(args)
        hit = self._cache.get(sig)
        if hit is not None:
            return hit
        first = self._first_sig
        if first is not None:
            n_args = len(first) - self._sharing  # the storage-sharing entry is not an argument
            if len(args) != n_args:
                raise InputError(f"expected {n_args} argument(s), got {len(args)}")
            for i, (got, want) in enumerate(zip(sig, first)):
                if isinstance(want[0], torch.Size) != isinstance(got[0], torch.Size):
                    raise InputError(f"argument {i}: expected {_describe(want)}, got {_describe(got)}")
            i, got, want = next((i, g, w) for i, (g, w) in enumerate(zip(sig, first)) if g != w)
            if len(self._cache) >= self.cache_size:
                where = "arguments" if i == len(args) else f"argument {i}"
                raise InputError(
                    f"{where}: expected {_describe(want)}, got {_describe(got)} — "
                    f"{len(self._cache)} signature(s) compiled already (cache_size={self.cache_size})"
                )
            warnings.warn(
                f"flowexec: new input signature ({'arguments' if i == len(args) else f'argument {i}'}: "
                f"{_describe(got)}, compiled for "
                f"{_describe(want)}); capturing fn again", RecaptureWarning, stacklevel=3,
            )
        compiled = self._build(args)
        if self._sharing:  # the state is known now
            self._state_keys |= {storage_key(t) for t in compiled.plan.program.state.values()} - {0}
            sig = self._sig(args)
        if first is None:
            self._first_sig = sig
        self._cache[sig] = compiled
        self._last = compiled
        return compiled

    # -- running --------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        c = self._cache.get(self._sig(args)) if self._cache else None
        if c is None:
            c = self._lookup(args)
        flat = c.runner(args if c.all_tensors else [args[i] for i in c.tensor_pos])
        for p, idx in c.grad_bindings:
            g = flat[idx]
            if p.grad is not g:
                p.grad = g
        if c.fetch:
            self._submit(flat, c.fetch)
        if c.single:
            return flat[0]
        return pytree.tree_unflatten(flat[: c.n_user], c.user_spec)

    def compile_for(self, *args: Any) -> Executable:
        """Capture and plan for ``args`` now (``flowexec.compile`` does this for its examples)."""
        self._lookup(args)
        return self

    @property
    def input_buffers(self) -> list[torch.Tensor]:
        """Graph mode: the tensors the first CUDA graph reads its tensor inputs from.

        Per-call inputs have static buffers: filling them in place (e.g.
        ``exe.input_buffers[0].copy_(batch)``) and passing them to the call skips the staging
        copies; passing any other tensors copies them in. Inputs ``fn`` writes in place, and
        parameters, are read where they are (see :func:`borrowed_inputs`): their entry is the
        tensor the graph was captured with.
        """
        assert self._last is not None
        runner = self._last.runner
        if self.mode != "graph":
            raise OptionError("input_buffers exist in graph mode only; trace mode reads the caller's tensors directly")
        if not isinstance(runner, GraphVariants):
            raise OptionError("input_buffers: the last signature runs in trace mode (an argument shares memory "
                              "with closure state that fn writes), which reads the caller's tensors directly")
        return list(runner.static_inputs)

    @property
    def program(self) -> Program:
        assert self._last is not None
        return self._last.plan.program

    @property
    def plan(self) -> ExecutionPlan:
        assert self._last is not None
        return self._last.plan

    @property
    def build_seconds(self) -> float:
        """Seconds the most recent capture + plan + lower (+ graph capture) took."""
        assert self._last is not None
        return self._last.build_seconds

    def __repr__(self) -> str:
        return f"<flowexec.Executable {getattr(self.fn, '__name__', 'fn')} mode={self.mode} gc={self.gc} signatures={len(self._cache)}>"


def borrowed_inputs(targs: Sequence[torch.Tensor], mutated_inputs: Sequence[int]) -> list[bool]:
    """Which tensor arguments graph mode reads in place: those ``fn`` writes in place (state such as
    optimizer moments, passed the same each call) and parameters or other graphs' static outputs.

    Copying them in and back each call costs two full copies apiece (an Adam-like step over
    64 MiB states took longer than eager that way). An argument that shares memory with another
    stays staged, so the capture sees the aliasing it was traced with.

    >>> a, b = torch.zeros(3), torch.zeros(3)
    >>> borrowed_inputs([a, b, a[1:]], mutated_inputs=[0, 1])
    [False, True, False]
    """
    from .runtime.cuda_graph import is_stable

    shared = sharing_positions(targs)
    wanted = set(mutated_inputs)
    return [(k in wanted or is_stable(a)) and k not in shared for k, a in enumerate(targs)]


def sharing_positions(targs: Sequence[torch.Tensor]) -> set[int]:
    """The positions of tensors that share a storage with another of ``targs``."""
    return {k for group in storage_groups(list(enumerate(targs))) if len(group) > 1 for k in group}


class GraphVariants:
    """Graph mode's CUDA graphs for one input signature.

    A graph reads its borrowed inputs at the addresses it was captured with
    (``CudaGraphRunner.matches``). A call that passes one at another address gets a second
    borrowing graph (the common case: ``compile`` was given copies, the calls pass the real
    state); past ``max_borrowing`` graphs, calls whose borrowed addresses match none run on one
    graph that stages every input (copies in, and back for those written), with a warning once.

    ``capture(targs, borrow)`` builds a runner; ``borrow`` says which arguments to read in place.
    """

    def __init__(self, capture: Callable[[Sequence[torch.Tensor], Sequence[bool]], Any],
                 targs: Sequence[torch.Tensor], borrow: Sequence[bool], max_borrowing: int = 2) -> None:
        self._capture = capture
        self._borrow = list(borrow)
        self.max_borrowing = max_borrowing
        self.first = capture(targs, self._borrow)
        self._graphs: list[Any] = [self.first]
        self._staged: Any = None

    @property
    def static_inputs(self) -> list[Any]:
        """The first graph's input buffers (a borrowed input's is the tensor it was captured with)."""
        return self.first.static_inputs

    @property
    def graph_count(self) -> int:
        return len(self._graphs) + (self._staged is not None)

    def __call__(self, targs: Sequence[torch.Tensor]) -> list[Any]:
        for g in self._graphs:  # a graph that borrows nothing matches every call
            if g.matches(targs):
                return g(targs)
        if len(self._graphs) < self.max_borrowing:
            self._graphs.append(self._capture(targs, self._borrow))
            return self._graphs[-1](targs)
        if self._staged is None:
            names = ", ".join(str(k) for k, b in enumerate(self._borrow) if b)
            warnings.warn(
                f"flowexec: tensor argument(s) {names} (written in place by fn, or parameters) came at "
                f"{self.max_borrowing + 1} different addresses; graph mode now copies them in (and back) on "
                "such calls. Pass the same tensors each call to have them read in place.",
                RecaptureWarning, stacklevel=3)
            self._staged = self._capture(targs, [False] * len(targs))
        return self._staged(targs)


def rewrite_program(prog: Program, mode: str, fuse_lerp: bool | str | None) -> Program:
    """The program-to-program passes an executable applies before planning."""
    if fuse_lerp not in (None, True, False, "all"):
        raise ValueError(f"fuse_lerp must be None, True, False or 'all', not {fuse_lerp!r}")
    if fuse_lerp or (fuse_lerp is None and mode == "graph"):
        from .passes.fuse_lerp import substitute_lerp

        # None and True: lerp and lerp_ where the fused kernel measured faster than ATen's
        # (True also outside graph mode); "all": every eligible one.
        prog = substitute_lerp(prog, inplace=True, only_faster=fuse_lerp != "all")
    return prog


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _user_out_placeholder(prog: Program, n_user: int, has_extra: bool) -> Any:
    # Rebuild the user's output structure: the program's spec covers (out, extra grads) when
    # grads were appended, else just out.
    spec = prog.out_spec
    if has_extra:
        spec = spec.children()[0] if callable(getattr(spec, "children", None)) else spec.children_specs[0]
    return pytree.tree_unflatten([0] * spec.num_leaves, spec)


def compile(fn: Callable[..., Any], *example_args: Any, mode: str = "trace", gc: str = "fast", **options: Any) -> Executable:
    """Capture ``fn`` on ``example_args`` into a planned program and return a callable for it.

    ``fn`` may be a model forward or a whole training step (``loss.backward()`` /
    ``torch.autograd.grad`` plus in-place parameter updates); calls apply the same in-place
    mutations to the caller's tensors as eager would. ``mode``: ``"trace"`` (CPU, CUDA) or
    ``"graph"`` (CUDA graph of the trace run). ``gc``: ``"fast"`` (drop at last use) or ``"none"``.

    Example::

        >>> import torch, flowexec
        >>> exe = flowexec.compile(lambda a, b: a @ b + 1, torch.ones(2, 2), torch.ones(2, 2))
        >>> exe(torch.ones(2, 2), torch.eye(2))
        tensor([[2., 2.],
                [2., 2.]])
    """
    if mode not in MODES:
        hint = " (threaded mode is not implemented yet)" if mode == "threaded" else ""
        raise OptionError(f"mode={mode!r} is not a run mode; valid: {', '.join(MODES)}{hint}")
    check_gc(gc, mode, count_option(options, "streams", 1, 1))
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        valid = "; ".join(f"{k}: {v}" for k, v in OPTIONS.items())
        raise OptionError(f"unknown option(s) {', '.join(map(repr, unknown))}; valid options — {valid}")
    if not callable(fn):
        raise OptionError(f"fn must be callable, got {type(fn).__name__}")
    for i, a in enumerate(example_args):
        if not isinstance(a, (torch.Tensor, int, float, bool, str, type(None))):
            raise InputError(f"argument {i}: flowexec.compile takes tensors and Python scalars, got {type(a).__name__}")
    if mode == "graph":
        devices = {a.device.type for a in example_args if isinstance(a, torch.Tensor)}
        if not torch.cuda.is_available() or devices - {"cuda"}:
            where = "this machine has no CUDA device" if not torch.cuda.is_available() else f"inputs are on {sorted(devices)}"
            raise OptionError(f"mode='graph' captures a CUDA graph, but {where}; use mode='trace' on CPU")
    return Executable(fn, mode, gc, options).compile_for(*example_args)
