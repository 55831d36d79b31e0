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

import functools
import inspect
import os
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from . import kept, optim_state
from .capture import Captured, LazyStateError, capture, fake_capture_setting, fresh_optimizers, replay
from .errors import CaptureError, FlowexecError, GuardError, InputError, OptionError, RecaptureWarning
from .fake_run import cuda_in_use
from .build import check_recompute, plan_for
from .fusion import (check_fuse, check_pad, prestart_compile_workers, release_compile_workers, wants_fusion,
                     warm_compile_workers)
from .guards import GuardSet
from .graph_variants import GraphVariants, borrowed_inputs, sharing_positions, worth_parking
from .parking import ParkedGrads, held_by_grad_alone
from .plan import ExecutionPlan, check_gc, check_streams
from .program import Program, Ref
from .rng import holds_rng_state_ops
from .runtime import fastcall
from .runtime.borrowed import distinct_storages
from .runtime.lower import lower_for
from .snapshot import DeviceRoom, extent, prepin
from .signature import builder, call_arguments, call_difference, flatten, tree_of
from .passes.copy_in import inputs_to_copy_in
from .passes.dependencies import mutated_state
from .storage import storage_key

MODES = ("trace", "graph", "threaded")
OPTIONS = {
    "park": "let capture hold last step's gradients in host memory while it runs fn (default True; "
            "flowexec.parking): False where something outside flowexec writes them at a fixed address, such as "
            "a CUDA graph of your own",
    "cache_size": "how many input signatures to keep compiled (default 8); past that a new one is an error",
    "warmup": "graph mode: eager warm-up runs before capture (default 1)",
    "fetch": "True or output indices: return those one-element outputs as flowexec.Fetch handles "
             "(copied to the host on a side stream; .result() waits for that value only)",
    "fetch_slots": "pinned slots in the fetch ring (default 64)",
    "fuse_lerp": "substitute flowexec's fused Triton lerp for aten.lerp / aten.lerp_ on CUDA where it measured "
                 "faster (a broadcast operand, >= 2**20 elements): by default in graph mode, with True in every "
                 "mode; 'all': every eligible lerp and lerp_; False: none",
    "streams": "run independent ops on up to this many compute streams (default 1), ordered by statically planned "
               "events: CUDA streams, or worker threads on the CPU; 'auto': copies between host and device on copy "
               "streams, branches on extra streams where their estimated cost pays (docs/streams.md)",
    "spin_us": "threaded mode and CPU streams: how long a waiting worker spins before it blocks (default 200)",
    "wait_timeout": "threaded mode and CPU streams: seconds a wait may take before it fails naming the "
                    "instruction (default 60)",
    "memory": "'normal' (default: the caching allocator) or 'planned': intermediates get offsets in one arena per "
              "device, planned offline, and ops write into views of it (docs/memory.md)",
    "order": "'program' (default: the captured order) or 'memory': a dependency-respecting order that lowers the "
             "planned peak (branches depth-first, large buffers die early)",
    "gc_backlog": "gc='async': bound on the bytes handed to the collector and not yet freed, as bytes (int) or a "
                  "fraction of the planned peak (float, default 0.1); past it the caller frees itself",
    "first_step": "'prefill' (default), 'planned' or 'eager': how a first call runs when fn's optimizer has no state "
                  "yet, which its first step makes. 'prefill': Adam, AdamW and the other optimizers whose state "
                  "starts as zeros (optim_state.PREFILLABLE) make it with their own initialisation before the first "
                  "capture, which then captures the steps at once (no first step's program; other optimizers and "
                  "other lazy state as 'planned'). 'planned': as a program of its own "
                  "in trace mode (this executable's fusion, padding, recomputation and memory options), which also "
                  "makes the state; the second call captures the steps that follow. 'eager': fn itself runs (its "
                  "peak memory is eager's)",
    "pool": "graph mode: 'private' (default: each CUDA graph keeps a memory pool of its own and holds its outputs) "
            "or 'shared' (every graph of a device in one pool, through PyTorch's CUDA-graph trees; outputs are not "
            "held once dropped; docs/memory.md)",
    "fuse": "'inductor': regions of fusible ops (pointwise, reductions, norms, softmax, losses, the optimizer's "
            "elementwise math) become one instruction each, compiled by Inductor (Triton on CUDA, C++ on the CPU), "
            "beside library ops (matrix products, convolutions, attention); False: the captured ATen ops; None "
            "(default): Inductor in graph mode on CUDA, ATen ops elsewhere (exe.explain() lists the regions)",
    "pad": "None (default): pad a matrix product whose sizes are not multiples of 16 bytes to aligned sizes (and "
           "slice the result back) on CUDA where that measured faster; True: every such product; False: none",
    "recompute": "None (default): where the program is fused, activations that are cheap to make again (casts of "
                 "parameters, GELU's output, a norm's output) are recomputed where the backward reads them instead of "
                 "held across the step's peak, where that lowers it (plan.stats()['recomputed_bytes']); True: unfused "
                 "too; False: never",
    "borrow": "graph mode: positions of further tensor arguments to read where they are instead of copying them "
              "in, for tensors passed the same each call (gradients, say); arguments fn writes in place and "
              "parameters are read in place already",
}


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


def _tensor_guard(tensors: Sequence[torch.Tensor]) -> Any:
    """A check of the tensors' dtypes, devices, shapes, strides (and dispatch keys,
    requires_grad) in C++: Dynamo's ``TensorGuards``, about 0.05 µs a tensor against 0.3 µs
    for building the Python signature. None where this torch lacks it (every call then
    builds the signature)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        # Concrete sizes and strides: every dimension static, as the signature is.
        guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])
        return guard if guard.check(*tensors) else None
    except Exception:  # a private API: any change in it only costs the fast path
        return None


@dataclass
class _Compiled:
    """Everything built for one input signature."""

    plan: ExecutionPlan
    runner: Callable[[Sequence[Any]], list[Any]]
    tensor_pos: tuple[int, ...]  # positions of the tensor leaves among the call's leaves
    out_build: Callable[[Sequence[Any]], Any]  # flat outputs -> fn's containers
    grad_bindings: list[tuple[torch.Tensor, int]]
    build_seconds: float
    fetch: tuple[int, ...] = ()
    all_tensors: bool = False  # every leaf is a tensor: the runner takes the leaves as they are
    tree: Any = None  # the call's tree (flowexec.signature)
    paths: tuple[str, ...] = ()  # each leaf's path, e.g. "args[0]['opt'][3]"
    variants: GraphVariants | None = None  # graph mode: the runner, for its precomputed checks
    guards: GuardSet | None = None  # what the capture read (flowexec.guards); None: nothing to check
    # Parameters whose .grad follows the call's tensors among the program's inputs (read per call)
    grad_inputs: tuple[torch.Tensor, ...] = ()
    # Parameters whose .grad the program neither reads nor keeps: dropped before each run
    discarded_grads: tuple[torch.Tensor, ...] = ()
    # Where build_seconds went: capture, plan (without fusion's compiler: fuse_compile), lower,
    # runner (graph mode's warm-up and CUDA-graph capture)
    build_phases: dict[str, float] = field(default_factory=dict)
    # torch.cuda.max_memory_allocated() after capture, plan and runner (None off CUDA)
    build_peaks: dict[str, int | None] = field(default_factory=dict)
    capture_run: str = "real"  # Captured.run: how the capture ran fn
    made_state: tuple[tuple[Any, Any, str, int], ...] = ()  # Captured.made_state: a first step's program

    def tensors(self, leaves: Sequence[Any]) -> list[Any] | None:
        """The program's tensor inputs for a call with these leaves; None where a parameter whose
        gradient it reads has none."""
        targs = list(leaves) if self.all_tensors else [leaves[i] for i in self.tensor_pos]
        for p in self.grad_inputs:
            g = p.grad
            if g is None:
                return None
            targs.append(g)
        return targs


class Executable:
    """A captured, planned and lowered function; call it like the original.

    Calls take what ``fn`` takes: positional and keyword arguments, each a tensor, a Python
    scalar, ``None``, or any nesting of lists, tuples, dicts and namedtuples of them; results
    come back in the containers ``fn`` returns. The tree structure, every non-tensor leaf and
    each tensor's shape, dtype, device and strides form the call's signature: a new one
    captures ``fn`` again (with a :class:`RecaptureWarning`). So does a change of a Python value
    the capture read (a module's ``training`` flag, ``self.temperature``, a number in a global
    dict, ``requires_grad``: its guards, ``exe.guards``), while optimizer hyperparameters are
    fed to the program at each call, so an LR schedule captures nothing again. Adam, AdamW and
    the other optimizers of ``optim_state.PREFILLABLE`` make their state before the first
    capture, which then captures the steps (``first_step="prefill"``, the default); a first
    call that makes other state (another
    optimizer's first step) runs as a program of its own that makes it (``"planned"``), or
    ``fn`` eagerly, and the next captures (docs/training.md). Attributes ``program`` and
    ``plan`` show the most recently built signature.

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: x.cumsum(0), torch.ones(3))
    >>> exe(torch.ones(3)), exe.plan.stats()["ops"]
    (tensor([1., 2., 3.]), 1)
    """

    def __init__(self, fn: Callable[..., Any], mode: str, gc: str, options: dict[str, Any]) -> None:
        self.fn, self.mode, self.gc = fn, mode, gc
        self.cache_size = int(options.get("cache_size", 8))
        self.streams = check_streams(options.get("streams", 1))
        self._worker_opts = (options.get("spin_us"), options.get("wait_timeout"))
        # Arguments that share memory (with each other or with state) must be planned as one
        # buffer over several streams, and staged as one buffer in graph mode (a write through
        # one shows through the other): the call's pattern of sharing joins its signature.
        self._sharing = self.streams != 1 or mode == "graph"
        self._sig: Callable[[Sequence[Any]], tuple[Any, ...]] = self._shared_signature if self._sharing else _signature
        self._state_keys: frozenset[int] = frozenset()
        self.warmup = int(options.get("warmup", 1))
        fetch = options.get("fetch", ())
        self.fetch: bool | tuple[int, ...] = fetch if isinstance(fetch, bool) else tuple(int(i) for i in fetch)
        self.fetch_slots = int(options.get("fetch_slots", 64))
        self.fuse_lerp: bool | str | None = options.get("fuse_lerp")
        self.fuse = check_fuse(options.get("fuse"))
        self.pad = check_pad(options.get("pad"))
        self.recompute = check_recompute(options.get("recompute"))
        self.borrow = tuple(options.get("borrow", ()))
        self.park = bool(options.get("park", True))
        self.pool = options.get("pool", "private")
        self.first_step = options.get("first_step", "prefill")
        if self.first_step not in ("planned", "prefill", "eager"):
            raise OptionError(f"first_step={self.first_step!r}: choose 'planned' (the first step as a program of its "
                              "own, which makes the optimizer's state), 'prefill' (Adam, AdamW and the like make "
                              "their state before the first capture) or 'eager' (fn runs eagerly once)")
        self.memory_options = {k: options[k] for k in ("memory", "order", "gc_backlog") if k in options}
        if self.borrow and mode != "graph":
            raise OptionError("borrow applies to mode='graph' only (trace mode reads every argument in place)")
        self._ring: Any = None
        # Per signature, the programs captured for it, most recently used first: they differ in
        # the values their guards check (a model in training and in eval mode, say).
        self._cache: OrderedDict[tuple[Any, ...], list[_Compiled]] = OrderedDict()
        # Lazy state: a call that makes state (optimizer moments on a first step) runs the first
        # step's program or fn eagerly (_run_first_step); _ran_eagerly: True once the last call
        # did that, _eager_next: compile()'s examples found it (the first call then does it outright).
        self._ran_eagerly = False
        self._eager_next = False
        self._asked_fresh = False  # whether capture.fresh_optimizers was asked (before the first capture)
        self._deferred: str | None = None
        self.first_step_program: ExecutionPlan | None = None  # the plan a first_step="planned" call ran
        self.first_step_phases: dict[str, float] | None = None  # its build_phases (where its build's seconds went)
        self.first_step_capture_run: str | None = None  # how its capture ran fn (as capture_run says of the steps')
        self.first_step_fallback: str | None = None  # why a first step ran eagerly instead
        self.first_step_prefilled = False  # first_step="prefill" made the optimizers' state before the first capture
        # Last step's gradients the new program discards, parked in host memory from capture to
        # the call's run, which drops them (planning's kernel timings and graph mode's warm-up
        # and capture need not hold them); compile_for, which takes no step, gives them back.
        self._parked: ParkedGrads | None = None
        # the thread pinning graph mode's warm-up snapshot's blocks (_prepin_for_warm_up), joined
        # before that snapshot is taken: none may pin while a CUDA graph captures
        self._pinning: threading.Thread | None = None
        # ids of param groups stepped through foreach instead of their fused kernel, which took a
        # value a schedule changes (betas, eps, weight_decay) as a number (Lifter.unfused)
        self._unfused: set[int] = set()
        # Per structure key (flowexec.signature.flatten): (tensor guard, compiled) pairs, most
        # recent first; a call whose tensors pass a guard skips building its signature.
        self._fast: dict[tuple[Any, ...], list[tuple[Any, _Compiled]]] = {}
        # The C++ check of the signature and graph that ran last (runtime/fastcall.py), and
        # those built so far by (id(compiled), id(runner)): a call that fails the check takes
        # the Python path, which sets the one it ends on.
        self._native: Any = None
        self._natives: dict[tuple[int, int], Any] = {}
        self._first: _Compiled | None = None
        self._first_sig: tuple[Any, ...] | None = None
        # How the last build came by its program: loaded from disk, or captured (and kept or
        # not, and why): flowexec.kept
        self.kept: str | None = None
        self._last: _Compiled | None = None
        self._check_devices = False  # compile() sets it; tests stand graphs in on CPU
        try:
            self._variadic = any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # builtins and some C callables have no signature
            self._variadic = True

    # -- building -------------------------------------------------------------------------
    def _build(self, args: Sequence[Any], tree: Any, paths: Sequence[str], first_step: bool = False,
               after_capture: Callable[[Any], None] | None = None, first_call: bool = False) -> _Compiled:
        # args: the call's leaves in flattened order (tree and paths: flowexec.signature.tree_of);
        # first_step: the program of a step that makes its optimizers' state, run once in trace mode;
        # after_capture(captured): called before planning (it may raise a CaptureError);
        # first_call: fn has not run yet (a prefilled first step: capture.trace)
        t0 = time.perf_counter()
        self._give_back_parked()
        fastcall.load()  # (where built, its C frame tracer serves the capture's guards.Recorder)
        if self.fuse is not False and self.mode == "graph" and cuda_in_use():
            warm_compile_workers()  # (ready by the time the captured program's regions compile)
            prestart_compile_workers()  # (a cold cache's: started while the capture runs)
        try:
            cap = self._capture(args, tree, paths, first_step, first_call)
            self._parked = cap.parked or None
            if self._parked is not None:  # (an executable dropped while they wait gives them back)
                weakref.finalize(self, self._parked.restore)
            try:
                if after_capture is not None:
                    after_capture(cap)
                return self._plan_and_lower(cap, args, tree, paths, t0, mode="trace" if first_step else self.mode)
            except BaseException:
                self._give_back_parked()
                raise
        finally:
            release_compile_workers()  # (prestarted ones the build did not take: none once fusion ran)

    def _capture(self, args: Sequence[Any], tree: Any, paths: Sequence[str], first_step: bool,
                 first_call: bool) -> Captured:
        """The program of ``fn`` for this call: a kept one (flowexec.kept) where one binds to
        this process's objects, else captured (and kept, where it can be); ``self.kept`` says
        which."""
        flat_fn = _call_with_containers(self.fn, tree, paths)
        # (the capture's and the replay's: a replay runs fn as its capture would)
        how = dict(unfused=frozenset(self._unfused), make_state=first_step, first_call=first_call,
                   untouched=not self._ran_eagerly and not self._cache)

        def run_capture() -> Captured:
            return capture(flat_fn, args, guarded=True, park=worth_parking if self.park else None, log_ops=keeping,
                           **how)

        keeping = kept.enabled()

        if not keeping:
            self.kept = "off (FLOWEXEC_KEEP=0)"
            return run_capture()
        # (nothing of keeping may fail a build: whatever goes wrong there, the build captures)
        try:
            r = kept.reach(self.fn)
            unfused = sorted(kept.show(r.where[i]) if i in r.where else "?" for i in self._unfused)
            key = kept.index_key(self.fn, kept.signature_of(args, _signature(args), tree),
                                 (first_step, first_call, unfused, fake_capture_setting()))
            records = kept.load(key)
        except Exception as e:
            self.kept = f"not kept: {type(e).__name__}: {e}"
            return run_capture()
        why = "no program kept for this call"
        seen: dict[tuple, Any] = {}
        for data in records:  # (the newest first; the first that binds is taken)
            try:
                fields = kept.decode(data, r, [a for a in args if isinstance(a, torch.Tensor)])
            except Exception as e:  # (kept.NotKept: it does not bind; anything else: it does not load)
                if not seen:  # (a record that bound and failed its replay says more)
                    why = f"the kept program does not bind: {e if isinstance(e, kept.NotKept) else repr(e)}"
                continue
            # Taken only where the step, run again on fake tensors, does what the kept capture's
            # run did (flowexec.op_log): then a capture now would make this very program.
            try:
                flags = fields["log"][1]
                if flags not in seen:  # (the same run for every record made with these flags)
                    seen[flags] = replay(flat_fn, args, flags, hold=[t for t in fields["log"][2]
                                                                     if isinstance(t, torch.Tensor)], **how)
                kept.check_replay(fields, seen[flags])
            except Exception as e:
                why = f"the kept program is not what a capture would make now: {e}"
                continue
            self.kept = f"loaded {key} (its replay took {seen[flags].seconds:.2f} s)"
            fields.pop("log")
            return Captured(run="kept", **fields)
        cap = run_capture()
        if cap.run != "fake":  # (a real run read real values: nothing says a later process would read the same)
            self.kept = f"{why}; not kept: fn ran for real"
            return cap
        try:
            path = kept.save(key, kept.encode(cap, r, kept.files_of(cap.codes)))
            self.kept = f"{why}; kept {os.path.basename(path)}"
        except Exception as e:  # (kept.NotKept: something no path names; OSError: the directory)
            self.kept = f"{why}; not kept: {e if isinstance(e, kept.NotKept) else repr(e)}"
        finally:
            cap.log = None  # (it holds the state tensors the run read, and every result's storage)
        return cap

    def _drop_parked(self, c: _Compiled) -> None:
        """Drop the gradients ``c`` discards (as :meth:`_finish` does) and their parked bytes;
        any other parked one (for a program this call does not run) comes back."""
        gone = [id(p.grad) for p in c.discarded_grads if p.grad is not None]
        for p in c.discarded_grads:
            p.grad = None
        if self._parked is not None:
            self._parked.release(gone)
        self._give_back_parked()

    def _park_for_warm_up(self, discarded: Sequence[torch.Tensor], run_bytes: int) -> None:
        """A fake capture parks nothing, but graph mode's warm-up runs the program while last
        step's gradients that it discards are still held (eager's zero_grad has freed them by
        then): they wait in host memory where the warm-up's ``run_bytes`` on top of what is
        allocated would lift the device above the peak it has reached."""
        params = [p for p in discarded if p.grad is not None and p.grad.is_cuda and held_by_grad_alone(p)
                  and worth_parking(p.grad)]
        if not params:
            return
        dev = params[0].grad.device
        if torch.cuda.memory_allocated(dev) + run_bytes <= torch.cuda.max_memory_allocated(dev):
            return
        self._parked = ParkedGrads.park(p.grad for p in params)
        weakref.finalize(self, self._parked.restore)

    def _join_pinning(self) -> None:
        """Wait for the blocks :func:`_prepin_for_warm_up` pins (at most as long as the snapshot
        would have taken to pin them itself; a snapshot that does not wait finds none cached and
        pins its own beside them)."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None

    def _give_back_parked(self) -> None:
        if self._parked is not None:
            self._parked.restore()
            self._parked = None

    def _plan_and_lower(self, cap: Any, args: Sequence[Any], tree: Any, paths: Sequence[str], t0: float,
                        copy_in: bool = True, mode: str | None = None) -> _Compiled:
        mode = mode or self.mode
        t1 = time.perf_counter()  # (t0: the build's start; capture took t1 - t0)
        capture_peak = _cuda_peak()
        tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        copied = self._copied_in(cap.program, args, tensor_pos) if copy_in and mode == "graph" else ()
        fuse = self.fuse
        if mode != self.mode:  # a first step's program (trace mode) is fused as the steps' program will be
            fuse = "inductor" if wants_fusion(cap.program, self.fuse, self.mode) else False
        plan = plan_for(cap.program, mode, gc=self.gc, streams=self.streams, fuse=fuse, pad=self.pad,
                        fuse_lerp=self.fuse_lerp, copied_in=copied, recompute=self.recompute, **self.memory_options)
        t2 = time.perf_counter()
        _warn_outer_autocast_cache(cap.program, plan.mutated)
        plan_peak = _cuda_peak()
        run_bytes = plan.planned_peak_bytes()  # (what graph mode's warm-up allocates on top)
        if mode == "graph" and self.park and cap.run in ("fake", "kept") and self._parked is None:
            self._park_for_warm_up(cap.discarded_grads, run_bytes)
        hooks, node = None, None
        if mode == "graph" and self.pool != "shared" and cap.guards is not None and cap.guards.feeds is not None:
            from .runtime.feed_node import node_hooks  # a schedule's values written by the graph itself

            made = node_hooks(plan, cap.guards.feeds)
            if made is not None:
                hooks, node = made
        run = lower_for(plan, mode, *self._worker_opts, hooks=hooks)
        t3 = time.perf_counter()
        fetch = self._fetch_indices(cap.program, cap.n_user_outputs)
        runner: Callable[[Sequence[Any]], list[Any]] = lambda targs: run(*targs)
        all_targs = [args[i] for i in tensor_pos] + [p.grad for p in cap.grad_inputs]
        if mode == "graph" and not self._graph_can_stage(args, tensor_pos, plan.program, plan.mutated):
            pass  # trace mode for this signature (said in a warning)
        elif mode == "graph" and self.pool == "shared":
            runner = self._shared_runner(run, plan, all_targs, cap, fetch, tensor_pos, runner)
        elif mode == "graph":
            from .runtime.cuda_graph import CopyInMissing, CudaGraphRunner, graph_capture_failed

            prog = plan.program
            state_mutated = [prog.state[v] for v in plan.mutated if v in prog.state]
            input_index = {vid: k for k, vid in enumerate(prog.inputs)}
            mutated_inputs = [input_index[v] for v in plan.mutated if v in input_index]
            targs = all_targs
            bound = {i for _, i in cap.grad_bindings} | set(fetch)

            def capture_runner(targs: Sequence[torch.Tensor], borrow: Sequence[bool]) -> CudaGraphRunner:
                # Warm-up must leave the caller's tensors as they were: borrowed inputs the
                # program writes are snapshotted with the state (in blocks pinned meanwhile).
                self._join_pinning()
                mutated = state_mutated + [targs[k] for k in mutated_inputs if borrow[k]]
                r = CudaGraphRunner(run, targs, mutated, borrow=borrow, state=prog.state.values(),
                                    mutated_inputs=mutated_inputs, unprotected_outputs=bound, warmup=self.warmup,
                                    before_replay=self._fence if fetch else None, keep_graph=node is not None,
                                    copied_in=copied, run_bytes=run_bytes)
                if node is not None:  # its fed values' kernel node, rewritten when they change
                    node.bind(r.graph)
                return r

            borrow = borrowed_inputs(targs, mutated_inputs)
            shared = sharing_positions(targs)
            for i in self.borrow:
                if not (isinstance(i, int) and 0 <= i < len(args) and isinstance(args[i], torch.Tensor)):
                    raise OptionError(f"borrow: {i!r} is not the position of a tensor argument (positions count "
                                      f"the call's leaves in flattened order; tensor leaves: {list(tensor_pos)})")
                k = tensor_pos.index(i)
                if k in shared:  # staged with the others on its storage
                    warnings.warn(f"flowexec: borrow: argument {i} shares memory with another argument in this "
                                  "call, so the graph copies it in with them (a graph reading it in place would "
                                  "miss writes made through the other)", stacklevel=5)
                    continue
                borrow[k] = True
            plain = runner
            try:
                runner = GraphVariants(capture_runner, targs, borrow)
            except CopyInMissing:  # torch copied an input with a kernel: the buffer per input instead
                runner = None
            except RuntimeError as e:  # (torch.AcceleratorError is one)
                if not graph_capture_failed(e):
                    raise
                runner = plain  # (no graph of this program can be made: it runs as traced, as eager does)
                warnings.warn(f"flowexec: the CUDA graph capture of this call's program failed "
                              f"({str(e).splitlines()[0]}); calls with this signature run in trace mode", stacklevel=5)
            if runner is None:  # (outside the handler: its traceback would hold the failed graph)
                del plan, run, hooks, node, capture_runner
                return self._plan_and_lower(cap, args, tree, paths, t0, copy_in=False, mode=mode)
        guards = cap.guards if cap.guards is not None and (len(cap.guards) or cap.guards.feeds) else None
        if guards is not None:  # checked in C++ where the extension is built (the Python check else)
            guards.attach(fastcall.guard_checker(guards))
        t4 = time.perf_counter()
        fuse_s = plan.fusion.compile_seconds if plan.fusion is not None else 0.0
        phases = {"capture": t1 - t0, "plan": t2 - t1 - fuse_s, "fuse_compile": fuse_s, "lower": t3 - t2,
                  "runner": t4 - t3}
        peaks = {"capture": capture_peak, "plan": plan_peak, "runner": _cuda_peak()}
        return _Compiled(plan, runner, tensor_pos, builder(cap.out_tree), cap.grad_bindings,
                         t4 - t0, fetch, tensor_pos == tuple(range(len(args))), tree, tuple(paths),
                         runner if isinstance(runner, GraphVariants) else None, guards, tuple(cap.grad_inputs),
                         tuple(cap.discarded_grads), build_phases=phases, build_peaks=peaks, capture_run=cap.run,
                         made_state=cap.made_state)

    def _shared_runner(self, run: Callable[..., list[Any]], plan: ExecutionPlan, targs: list[Any], cap: Any,
                       fetch: tuple[int, ...], tensor_pos: tuple[int, ...], fallback: Callable[[Sequence[Any]], list[Any]]) -> Callable[[Sequence[Any]], list[Any]]:
        """pool="shared": this signature's runner as a graph of its device's CUDA-graph tree
        (``runtime/graph_trees.py``); every call is a generation of its own, so a call may
        replay over the last call's memory once the outputs still held are moved out. Read in
        place (static): what graph mode borrows (arguments fn writes, parameters, ``borrow``)."""
        from .passes.streams import cuda_devices
        from .runtime import graph_trees

        prog = plan.program
        devices = cuda_devices(prog)
        why = graph_trees.program_skip_reason(prog, devices)
        if why is not None:
            warnings.warn(f"flowexec: pool='shared': this signature runs in trace mode ({why}; a CUDA-graph tree "
                          "records one GPU's tensors)", stacklevel=5)
            return fallback
        (device,) = devices
        index = {vid: k for k, vid in enumerate(prog.inputs)}
        mutated = [index[v] for v in plan.mutated if v in index]
        borrow = borrowed_inputs(targs, mutated)
        shared = sharing_positions(targs)  # staged apart by the trees: only written ones matter (see docs)
        for i in self.borrow:
            if not (isinstance(i, int) and i in tensor_pos):
                raise OptionError(f"borrow: {i!r} is not the position of a tensor argument (positions count "
                                  f"the call's leaves in flattened order; tensor leaves: {list(tensor_pos)})")
            if tensor_pos.index(i) not in shared:
                borrow[tensor_pos.index(i)] = True
        static = [k for k, b in enumerate(borrow) if b]
        bound = {i for _, i in cap.grad_bindings} | set(fetch)  # rebound after each call, as in private graphs
        index_ = device.index if device.index is not None else torch.cuda.current_device()
        graph = graph_trees.SharedPoolGraph(run, targs, static, mutated, index_, "inference", new_generation=True,
                                            unprotected=bound,
                                            **graph_trees.executable_metadata(len(targs), len(prog.outputs)))
        return lambda t: graph(list(t))  # the trees empty the list they are given

    def _copied_in(self, prog: Program, args: Sequence[Any], tensor_pos: tuple[int, ...]) -> tuple[int, ...]:
        """Graph mode: the positions (among ``prog.inputs``) of the per-call CUDA tensors that the
        program copies in itself, so that the graph holds no copy of them past their last reader
        (``passes/copy_in.py``'s :func:`inputs_to_copy_in`); none without CUDA's runtime bindings
        (no node to re-point), with ``pool="shared"`` or ``memory="planned"``, or where the
        signature runs in trace mode."""
        if self.mode != "graph" or self.pool == "shared" or self.memory_options.get("memory") == "planned":
            return ()  # (an arena's views are contiguous: the copy would not keep the input's layout)
        from .runtime.staging import memcpy_runtime

        if not any(args[i].is_cuda for i in tensor_pos) or memcpy_runtime() is None:
            return ()
        mutated = mutated_state(prog)
        if not self._graph_can_stage(args, tensor_pos, prog, mutated, warn=False):
            return ()
        borrowed = [k for k, i in enumerate(tensor_pos) if i in self.borrow]
        return inputs_to_copy_in(prog, [args[i] for i in tensor_pos], borrowed, mutated=mutated)

    def _graph_can_stage(self, args: Sequence[Any], tensor_pos: tuple[int, ...], prog: Program,
                         mutated: Sequence[int], warn: bool = True) -> bool:
        """Whether a graph can run this signature: not when a tensor argument shares memory with
        closure state and fn writes in place (the graph would read or write the argument in a
        buffer of its own, apart from that state), nor when the program saves or restores a
        generator's state (flowexec/rng.py); such calls run in trace mode, with a warning.
        Capture recorded which inputs share a storage with state (``Program.shared_storage``);
        ``mutated``: the values the program writes in place."""
        if holds_rng_state_ops(prog):
            if warn:
                warnings.warn("flowexec: fn saves, restores or seeds the random generator's state "
                              "(torch.utils.checkpoint around a region with random ops, torch.manual_seed), which a "
                              "CUDA graph cannot replay; calls with this signature run in trace mode", stacklevel=5)
            return False
        first_of = dict(prog.shared_storage)  # value -> first value on its storage (inputs come first)
        with_state = {f for v, f in prog.shared_storage if v in prog.state}
        on_state = [tensor_pos[k] for k, v in enumerate(prog.inputs[:len(tensor_pos)])
                    if v in with_state or first_of.get(v) in with_state]
        if not (on_state and mutated):
            return True
        if not warn:
            return False
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

    def _lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> _Compiled | None:
        """The compiled signature for a call, captured now if it is new (the slow path); None
        where fn creates state on its first step and this call must run it eagerly."""
        kwargs = kwargs or {}
        leaves, key = flatten(args, kwargs)
        try:
            return self._lookup_leaves(leaves, key, args, kwargs)
        finally:  # its callers take no step: gradients parked by a capture come back
            self._give_back_parked()

    def _lookup_leaves(self, leaves: list[Any], key: tuple[Any, ...], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> _Compiled | None:
        sig = (key, self._sig(leaves))
        entries = self._cache.get(sig)
        hit, failed = None, None
        for c in entries or ():
            i = c.guards.check() if c.guards is not None else -1
            if i < 0:
                hit = c
                break
            failed = failed or (c, i)
        if hit is None:
            hit = self._compile_new(sig, leaves, args, kwargs, failed)
            if hit is None:
                return None
            if self._sharing:  # closure state joined _state_keys: the sharing entry may differ now
                sig = (key, self._sig(leaves))
        elif entries[0] is not hit:
            entries.insert(0, entries.pop(entries.index(hit)))
        # The guarded fast path checks that nothing shares storage: only such signatures join it.
        if not self._sharing or sig[1][-1] == _NO_SHARING[0]:
            self._remember(key, hit, leaves)
        self._last = hit
        return hit

    def _remember(self, key: tuple[Any, ...], c: _Compiled, leaves: Sequence[Any]) -> None:
        """Put ``c`` first among the guarded signatures of structure ``key``."""
        tensors = c.tensors(leaves)
        if tensors is None:
            return
        entries = self._fast.setdefault(key, [])
        for k, (g, e) in enumerate(entries):
            if e is c and g.check(*tensors):  # (the fast path was skipped for another reason)
                entries.insert(0, entries.pop(k))
                return
        guard = _tensor_guard(tensors)
        if guard is not None:  # several guards may lead to one signature (requires_grad, say)
            entries.insert(0, (guard, c))
            del entries[2 * self.cache_size:]

    def _compile_new(self, sig: tuple[Any, ...], leaves: list[Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any], failed: tuple[_Compiled, int] | None = None) -> _Compiled | None:
        """Capture for a new signature, or for a known one whose programs' guards all failed
        (``failed``: the most recent one and what failed). None: fn creates state on its first
        step, so this call runs that step by itself (:meth:`_run_first_step`; for compile()'s
        examples, the next call does)."""
        tree, _, paths = tree_of(args, kwargs)
        first = self._first
        n_programs = sum(len(v) for v in self._cache.values())
        unfusing = None
        if failed is not None:
            c, i = failed
            what = c.guards.describe(i)
            group = c.guards.fused_group(i)
            if group is not None and id(group) not in self._unfused:
                # Once per group: its fused kernel holds the value as a constant, its foreach
                # path takes it fed per call, so the schedule re-captures nothing after this.
                unfusing = id(group)
                self._unfused.add(unfusing)
            elif c.guards.settles(i) and n_programs < self.cache_size:
                pass  # a .grad now exists that was None: the usual second program (no warning)
            elif n_programs >= self.cache_size:
                raise GuardError(
                    f"{what} — {n_programs} program(s) captured already (cache_size={self.cache_size}); a value the "
                    "compiled function reads changed again. If it changes on every call, keep it in a tensor "
                    "(read by the program, updated in place) or pass it as an argument.")
            else:
                warnings.warn(f"flowexec: {what}; capturing fn again", RecaptureWarning, stacklevel=4)
        elif first is not None:
            n_args = len(first.tree[2][0])
            if len(args) != n_args and not self._variadic:
                raise InputError(f"expected {n_args} argument(s), got {len(args)}")
            where, got, want = self._difference(first, tree, paths, leaves, sig)
            if n_programs >= self.cache_size:
                raise InputError(
                    f"{where}: expected {want}, got {got} — "
                    f"{n_programs} signature(s) compiled already (cache_size={self.cache_size})"
                )
            warnings.warn(f"flowexec: new input signature ({where}: {got}, compiled for {want}); capturing fn again",
                          RecaptureWarning, stacklevel=4)
        if self.mode == "graph" and self._check_devices:
            tensors = [(a, p) for a, p in zip(leaves, paths) if isinstance(a, torch.Tensor)]
            _check_graph_devices([a for a, _ in tensors], [p for _, p in tensors])
        # Before the first capture only: a fresh optimizer fn reaches makes state on its first
        # step, so a capture now would trace the whole step to discard it. (Once: an optimizer
        # fn reaches but never steps must not keep calls eager.)
        fresh = fresh_optimizers(self.fn) if not self._asked_fresh and not self._ran_eagerly else []
        self._asked_fresh = True
        made = self._prefill(fresh) if fresh and self.first_step == "prefill" else None
        if fresh and made is None:
            self._deferred = (f"fn reaches an optimizer ({type(fresh[0]).__name__}) that has no state yet, which its "
                              "first step makes")
            return None
        if made:
            compiled = self._build_prefilled(made, leaves, tree, paths)
            if compiled is None:
                return None
        else:
            try:
                compiled = self._build(leaves, tree, paths)
            except LazyStateError as e:
                if self._ran_eagerly:  # the state is made anew on every call, not once
                    raise CaptureError(str(e)) from None
                self._deferred = str(e).split(". ", 1)[0]
                return None
            except CaptureError as e:
                if unfusing is None:
                    raise
                self._unfused.discard(unfusing)  # (the foreach path refused: a GradScaler's scale, say)
                raise GuardError(f"{what} — the param group's foreach path, which would take it fed per call, "
                                 f"cannot step this function ({e}); keep that value constant with this optimizer (a "
                                 "GradScaler hands its scale and found_inf to fused kernels only)") from None
        if unfusing is not None:
            warnings.warn(f"flowexec: {what}; captured fn again with that param group stepped by its foreach "
                          "path, which takes the value fed per call (fused kernels take it as a number)",
                          RecaptureWarning, stacklevel=4)
        self._native = None  # closure state may grow: checks built against the old keys go
        self._natives.clear()
        if self._sharing:  # the state is known now
            self._state_keys |= {storage_key(t) for t in compiled.plan.program.state.values()} - {0}
            sig = (sig[0], self._sig(leaves))
        if first is None:
            self._first, self._first_sig = compiled, sig
        if unfusing is not None:  # the fused program gives way (its graph and pool with it)
            self._forget(failed[0], compiled)
        self._cache.setdefault(sig, []).insert(0, compiled)
        return compiled

    def _build_prefilled(self, made: list[Any], leaves: list[Any], tree: Any, paths: Sequence[str]) -> _Compiled | None:
        """The steps' program, captured with the optimizers' state prefilled (``made``:
        flowexec.optim_state) and a placeholder ``.grad`` where later calls find last step's
        gradients, which fn's zero_grad drops: the steps' own program, so that no second one
        follows once this call's gradients exist. None, with the prefill undone, where the first
        step's program must decide instead (other lazy state; a step that reads ``.grad``)."""
        lent = optim_state.lend_grads((p for p, _ in made), like=True)
        lent_to = [p for p, _ in lent]
        if self.mode == "graph":
            self._pinning = _prepin_for_warm_up(made)

        def give_back(cap: Any) -> None:  # (before planning: graph mode's warm-up would park them)
            optim_state.take_back(lent)
            lent.clear()  # (held here through the build, they lifted its warm-up's peak by a gradient's size)
            if cap.grad_inputs:  # fn adds to .grad: it would read the placeholders as gradients
                raise CaptureError("fn reads .grad (adds to it)")
        try:
            compiled = self._build(leaves, tree, paths, after_capture=give_back, first_call=True)
        except BaseException as e:
            self._join_pinning()
            optim_state.take_back(lent)
            optim_state.undo(made)
            if not isinstance(e, CaptureError):  # (an interrupt, a planning error: nothing stays behind)
                raise
            self.first_step_fallback = f"prefill: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._deferred = "fn's first step makes state that a prefill cannot"
            return None
        self._join_pinning()  # (where no warm-up took them: a trace-mode signature)
        # Eager makes no state for a parameter left without a gradient, and the next call finds
        # its .grad None: the guards read so (they saw the prefill's state, and a placeholder).
        dropped = optim_state.prune(made, compiled.plan.program.state.values())
        bound = {id(p) for p, _ in compiled.grad_bindings}
        unbound = [p for p in lent_to if id(p) not in bound]
        if (dropped or unbound) and compiled.guards is not None:
            compiled.guards = compiled.guards.without_state_of(dropped).expecting_no_grad(unbound)
            compiled.guards.attach(fastcall.guard_checker(compiled.guards))
        self.first_step_prefilled = True
        return compiled

    def _prefill(self, fresh: Sequence[torch.optim.Optimizer]) -> list[Any] | None:
        """``first_step="prefill"``: the state of every optimizer in ``fresh`` made by its own
        initialisation (flowexec.optim_state), or None (nothing made) where one cannot be."""
        if not all(optim_state.can_prefill(o) for o in fresh):
            return None
        made: list[Any] = []
        try:
            for opt in fresh:
                made += optim_state.prefill(opt)
        except Exception as e:  # (a fused AdamW's device check, say: its first step's program says so again)
            optim_state.undo(made)
            self.first_step_fallback = f"prefill: {type(e).__name__}: {e}"
            return None
        return made

    def _forget(self, c: _Compiled, successor: _Compiled) -> None:
        """Drop program ``c`` from every cache (its signature's list, the guarded fast path);
        ``successor``, a program of the same signature, stands in where ``c`` was the first."""
        if self._first is c:
            self._first = successor
        for entries in self._cache.values():
            entries[:] = [e for e in entries if e is not c]  # (by identity: a dataclass's == reads tensors)
        for key, pairs in self._fast.items():
            self._fast[key] = [(g, e) for g, e in pairs if e is not c]

    def _difference(self, first: _Compiled, tree: Any, paths: Sequence[str], leaves: Sequence[Any],
                    sig: tuple[Any, ...]) -> tuple[str, str, str]:
        """(where, got, expected) between a new call and the first signature; raises
        :class:`InputError` where a tensor leaf became something else or the other way round."""
        d = call_difference(first.tree, tree)
        if d is not None:  # another structure: compared by paths, a leaf may still be wrong
            where, want, got = d
            return where, got, want
        assert self._first_sig is not None
        want_sig, got_sig = self._first_sig[1], sig[1]
        n = len(paths)  # past the leaves: the storage-sharing entry
        for i, (got, want) in enumerate(zip(got_sig[:n], want_sig[:n])):
            if isinstance(want[0], torch.Size) != isinstance(got[0], torch.Size):
                raise InputError(f"{paths[i]}: expected {_describe(want)}, got {_describe(got)}")
        for i, (got, want) in enumerate(zip(got_sig[:n], want_sig[:n])):
            if got != want:
                return paths[i], _describe(got), _describe(want)
        if got_sig[n:] != want_sig[n:]:
            return "arguments", _describe(got_sig[-1]), _describe(want_sig[-1])
        return "arguments", "another signature", "this one"

    # -- running --------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fc = self._native
        if fc is not None and fc.alive[0] and not kwargs:
            targs = fc.check(args)  # every check below in one C++ walk (runtime/fastcall.py)
            if targs is not None:  # (run None: the signature's runner, which a profiler may swap)
                c = fc.compiled
                if c.guards is None or fc.guarded or c.guards.check() < 0:
                    return self._finish(c, fc.run or c.runner, targs)
            # The Python path decides, and installs the check of the program it picks: this one
            # may no longer fit (a host read of a hyperparameter now answers otherwise).
            self._native = None
        if self._eager_next:  # compile()'s examples found state fn makes on its first step
            return self._run_first_step(args, kwargs)
        leaves, key = flatten(args, kwargs)
        c = None
        entries = self._fast.get(key)
        if entries:
            for guard, comp in entries:
                targs = comp.tensors(leaves)
                if targs is not None and guard.check(*targs) and (comp.guards is None or comp.guards.check() < 0):
                    c = comp
                    break
            if c is not None and self._sharing:
                # Graph mode: the graph whose borrowed inputs are where this call's are, when it
                # can vouch that nothing shares storage (GraphVariants.select); else every
                # argument's storage is read.
                g = c.variants.select(targs, self._state_keys) if c.variants is not None else None
                if g is not None:
                    run, native = g, (getattr(g, "call", g), getattr(g, "borrowed", None), None)
                elif not self._unshared(targs):
                    c = None
                else:
                    run, native = c.runner, (None, None, self._state_keys)
            elif c is not None:
                run, native = c.runner, (None, None, None)
            if c is not None and not kwargs:  # the next call like this one: the C++ check
                self._native = self._native_for(c, *native, leaves, targs)
        if c is None:
            try:
                c = self._lookup_leaves(leaves, key, args, kwargs)
                if c is None:
                    return self._run_first_step(args, kwargs)
                targs = c.tensors(leaves)
                run = c.runner
            except BaseException:  # (a new program's parked gradients come back: no step was taken)
                self._give_back_parked()
                raise
        return self._finish(c, run, targs)

    def _run_first_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A step that makes the state fn's optimizers keep, once, so that it exists for the
        capture of the next call: with ``first_step="planned"`` a program of its own (trace
        mode) that returns the new state entries too, bound into the optimizers after its run;
        fn itself where that program cannot be had (state it cannot make, ``first_step="eager"``).
        """
        self._eager_next = False
        leaves, _ = flatten(args, kwargs)
        c = self._first_step_program(leaves, args, kwargs) if self.first_step != "eager" else None
        if c is None:
            self._ran_eagerly = True
            return self.fn(*args, **kwargs)

        def run_and_bind(targs: Sequence[Any]) -> list[Any]:
            flat = c.runner(targs)
            for opt, p, key, idx in c.made_state:  # the state its optimizers made, where eager keeps it
                opt.state[p][key] = flat[idx]
            return flat

        try:
            out = self._finish(c, run_and_bind, c.tensors(leaves))
        finally:
            self._give_back_parked()
        self._ran_eagerly = True  # (the first step is taken: state made again on a call is an error)
        self.first_step_program = c.plan  # (kept for inspection: what the first step ran)
        self.first_step_phases = dict(c.build_phases)
        self.first_step_capture_run = c.capture_run
        return out

    def _first_step_program(self, leaves: Sequence[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Compiled | None:
        """The first step's program for the call's ``leaves`` (see :meth:`_run_first_step`), or
        None where a capture of it failed (``first_step_fallback`` says why; fn then runs
        eagerly and the next call captures, and raises, as it would have)."""
        tree, _, paths = tree_of(args, kwargs)
        try:
            c = self._build(leaves, tree, paths, first_step=True)
        except CaptureError as e:  # (LazyStateError among them: state a program cannot make)
            self.first_step_fallback = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return None
        if c.tensors(leaves) is None:
            self.first_step_fallback = "a gradient the program reads is missing"
            return None
        return c

    def _native_for(self, c: _Compiled, run: Any, borrowed: Any, forbidden: frozenset[int] | None,
                    leaves: Sequence[Any], targs: Sequence[Any]) -> Any:
        """The C++ check for calls like this one, which passed the Python checks to ``run`` (a
        graph of ``c``; None: ``c.runner``) with ``borrowed``'s addresses or storages apart from
        ``forbidden`` (:func:`fastcall.make`), built once per (signature, graph); None where it
        cannot be had."""
        k = (id(c), id(run))
        hit = self._natives.get(k, False)
        if hit is False:
            if len(self._natives) >= 4 * self.cache_size:  # graphs come and go: never pile up
                self._natives.clear()
            hit = self._natives[k] = fastcall.make(c, run, c.tree, leaves, targs, borrowed, forbidden)
        return hit

    def _finish(self, c: _Compiled, run: Callable[[Sequence[Any]], list[Any]], targs: Sequence[Any]) -> Any:
        self._ran_eagerly = False
        if self._parked is not None:  # the call after a capture
            self._drop_parked(c)
        else:
            for p in c.discarded_grads:  # (fn's zero_grad: freed before the forward, as in eager)
                p.grad = None
        flat = run(targs)
        if c.guards is not None and c.guards.after_call:
            c.guards.replay()
        for p, idx in c.grad_bindings:
            g = flat[idx]
            if p.grad is not g:
                p.grad = g
        if c.fetch:
            self._submit(flat, c.fetch)
        return c.out_build(flat)

    def _unshared(self, targs: Sequence[Any]) -> bool:
        """Whether no two tensors share a storage and none is on closure state's (else the
        signature's sharing entry decides, on the slow path)."""
        return bool(distinct_storages(targs, self._state_keys))

    def compile_for(self, *args: Any, **kwargs: Any) -> Executable:
        """Capture and plan for ``exe(*args, **kwargs)`` now (``flowexec.compile`` does this for
        its examples); returns the executable. No step is taken: where fn creates state on its
        first step (optimizer moments), nothing is captured yet, and the first call runs fn
        eagerly and the second captures."""
        if self._lookup(args, kwargs) is None:
            self._eager_next = True
        return self

    def _captured(self, what: str) -> _Compiled:
        if self._last is None:
            if self._deferred is not None:
                how = ("as a program of its own that makes this state" if self.first_step != "eager"
                       else "fn eagerly so that this state exists")
                raise NotCapturedError(f"{what}: nothing is captured yet — {self._deferred}; the first call runs "
                                       f"{how}, and a later call captures")
            raise NotCapturedError(f"{what}: nothing is captured yet — this Executable captures fn on its first "
                                   "call (or call exe.compile_for(*example_args) first)")
        return self._last

    @property
    def input_buffers(self) -> list[torch.Tensor]:
        """Graph mode: the tensors the first CUDA graph reads its tensor inputs from.

        Per-call inputs have static buffers: filling them in place (e.g.
        ``exe.input_buffers[0].copy_(batch)``) and passing them to the call skips the staging
        copies; passing any other tensors copies them in. Inputs ``fn`` writes in place, and
        parameters, are read where they are (see :func:`borrowed_inputs`): their entry is the
        tensor the graph was captured with.
        """
        runner = self._captured("input_buffers").runner
        if self.mode == "graph" and self.pool == "shared":
            raise OptionError("input_buffers: with pool='shared' the CUDA-graph trees own the graphs' input buffers "
                              "(they copy per-call inputs into the shared pool); pass tensors to the call")
        if self.mode != "graph":
            raise OptionError("input_buffers exist in graph mode only; trace mode reads the caller's tensors directly")
        if not isinstance(runner, GraphVariants):
            raise OptionError("input_buffers: the last signature runs in trace mode (an argument shares memory "
                              "with closure state that fn writes), which reads the caller's tensors directly")
        return list(runner.static_inputs)

    @property
    def program(self) -> Program:
        return self._captured("program").plan.program

    @property
    def plan(self) -> ExecutionPlan:
        return self._captured("plan").plan

    def explain(self) -> str:
        """The last signature's fused regions (kernel, ATen ops, inputs -> outputs, status: compiled,
        shared with an equal region, or why it fell back to its ATen ops), then its program."""
        plan = self._captured("explain").plan
        head = "no fusion (fuse=False, or None on the CPU)" if plan.fusion is None else plan.fusion.table()
        return f"{head}\n{plan.program}"

    @property
    def guards(self) -> GuardSet | None:
        """What the most recently used program checks before each call (``.names``) and is fed
        (``.fed``: optimizer hyperparameters); None where its capture read nothing to check.
        See docs/training.md."""
        return self._captured("guards").guards

    @property
    def build_seconds(self) -> float:
        """Seconds the most recent capture + plan + lower (+ graph capture) took."""
        return self._captured("build_seconds").build_seconds

    @property
    def build_phases(self) -> dict[str, float]:
        """Where :attr:`build_seconds` went, in seconds: ``capture`` (tracing fn), ``plan``
        (the passes, without fusion's compiler), ``fuse_compile`` (Inductor compiling the fused
        regions), ``lower`` and ``runner`` (graph mode's warm-up and CUDA-graph capture, the
        C++ check's set-up).

        >>> import torch, flowexec
        >>> exe = flowexec.compile(lambda x: (x * 2).sum(), torch.ones(3), mode="trace")
        >>> sorted(exe.build_phases)
        ['capture', 'fuse_compile', 'lower', 'plan', 'runner']
        """
        return dict(self._captured("build_phases").build_phases)

    @property
    def build_peaks(self) -> dict[str, int | None]:
        """``torch.cuda.max_memory_allocated()`` (bytes) after the last build's ``capture``,
        ``plan`` and ``runner`` phases (:attr:`build_phases`), None where CUDA was not in use: the
        phase after which it grew is the one that raised the process's peak. Nothing is reset.

        >>> import torch, flowexec
        >>> exe = flowexec.compile(lambda x: (x * 2).sum(), torch.ones(3), mode="trace")
        >>> sorted(exe.build_peaks)
        ['capture', 'plan', 'runner']
        """
        return dict(self._captured("build_peaks").build_peaks)

    @property
    def capture_run(self) -> str:
        """How the last build's capture ran fn: ``"fake"`` (on fake tensors: nothing computed,
        nothing to undo, no activations held), or ``"real (a fake run could not: ...)"`` where
        a fake run failed (an op with no fake kernel, a host read of a value it does not have,
        an argument on closure state's storage) and fn ran for real, as eager runs it.

        >>> import torch, flowexec
        >>> flowexec.compile(lambda x: (x * 2).sum(), torch.ones(3), mode="trace").capture_run
        'fake'
        """
        return self._captured("capture_run").capture_run

    def __repr__(self) -> str:
        return f"<flowexec.Executable {getattr(self.fn, '__name__', 'fn')} mode={self.mode} gc={self.gc} signatures={len(self._cache)} programs={sum(map(len, self._cache.values()))}>"


def _cuda_peak() -> int | None:
    """The process's CUDA peak so far (current device), None where CUDA is not in use."""
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class NotCapturedError(FlowexecError, AttributeError):
    """``program``, ``plan`` (...) of an :class:`Executable` read before its first call."""


def _call_with_containers(fn: Callable[..., Any], tree: Any, paths: Sequence[str]) -> Callable[..., Any]:
    """``fn`` as a function of the call's leaves: capture traces this, so the graph's inputs are
    the leaves and fn still sees its lists, dicts and keyword arguments.

    The containers fn sees are rebuilt ones: a change fn makes to them (not to the tensors in
    them) would not reach the caller's, nor be replayed, so it is an error naming the leaf."""
    def flat_fn(*leaves: Any) -> Any:
        args, kwargs = call_arguments(tree, leaves)
        out = fn(*args, **kwargs)
        try:
            after_tree, after, _ = tree_of(args, kwargs)
        except InputError as e:
            raise CaptureError(f"fn put something into the containers it was passed: {e}") from None
        changed = after_tree != tree or any(
            (b is not a) if isinstance(a, torch.Tensor) else (type(a) is not type(b) or a != b)
            for a, b in zip(leaves, after))
        if changed:
            where = next((p for p, a, b in zip(paths, leaves, after) if a is not b), "a container")
            raise CaptureError(
                f"fn changed the containers it was passed (at {where}): a compiled call replays writes into "
                "tensors, not changes to lists or dicts (appending, replacing an entry, a Python counter). "
                "Keep such state in tensors written in place, or return the new values.")
        return out
    return flat_fn


def _warn_outer_autocast_cache(prog: Program, mutated: Sequence[int]) -> None:
    """A warning where fn is called inside ``torch.autocast`` (entered outside fn, its weight
    cache on) and writes in place a parameter (a leaf that requires grad: an optimizer step).
    Eager autocast caches its low-precision cast of such a leaf until the outermost autocast
    block exits, so across calls inside one block eager keeps using the first call's casts of
    weights the steps have since updated; a program casts its state afresh on every call (as
    ``torch.autocast(cache_enabled=False)`` does), and would otherwise differ from eager
    silently."""
    on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    if not on or not torch.is_autocast_cache_enabled():
        return
    written = sum(1 for v in mutated if v in prog.state and prog.state[v].is_leaf and prog.state[v].requires_grad)
    if written:
        level, f = 1, sys._getframe(0)  # (the warning points at the user's call, past flowexec's frames)
        while f is not None and f.f_code.co_filename.startswith(os.path.dirname(__file__) + os.sep):
            level, f = level + 1, f.f_back
        warnings.warn(
            f"flowexec: fn is called inside torch.autocast({on[0]!r}) with its weight cache on, and updates "
            f"{written} parameter(s) in place; eager PyTorch "
            "would reuse its first cast of those parameters until the autocast block exits (stale weights), "
            "flowexec casts them afresh each call, as torch.autocast(cache_enabled=False) does. Put autocast "
            "inside fn, around the forward and the loss (PyTorch's AMP recipe), to have both agree.",
            stacklevel=level)


def _prepin_for_warm_up(made: Sequence[Any]) -> threading.Thread | None:
    """Graph mode's warm-up steps the parameters and optimizer state in ``made`` and puts them
    back from a snapshot, whose copies go to pinned host memory where the device has no room for
    them below the peak it has reached (a process's first build: a fake capture lifts no peak).
    That memory is pinned on a thread while the capture runs (:func:`snapshot.prepin`); returns
    the thread (None where nothing is pinned)."""
    sizes = [extent(t) * t.element_size() for p, opt in made for t in (p, *opt.state.get(p, {}).values())
             if isinstance(t, torch.Tensor) and t.is_cuda]  # (the tensors the warm-up snapshot saves)
    dev = next((p.device for p, _ in made if p.is_cuda), None)
    if not sizes or dev is None:
        return None
    if DeviceRoom().take(dev, sum(sizes)):  # (the warm-up's room, less the run it has ahead: no more)
        return None
    return prepin(sizes)


def _check_graph_devices(tensors: Sequence[torch.Tensor], paths: Sequence[str]) -> None:
    if not torch.cuda.is_available():
        raise OptionError("mode='graph' captures a CUDA graph, but this machine has no CUDA device; "
                          "use mode='trace' on CPU")
    off = [f"{p} on {t.device}" for t, p in zip(tensors, paths) if t.device.type != "cuda"]
    if off:
        raise OptionError(f"mode='graph' captures a CUDA graph, but inputs are not on CUDA: {', '.join(off[:4])}; "
                          "use mode='trace' for them")


def compile(fn: Callable[..., Any] | None = None, *example_args: Any, mode: str = "trace", gc: str = "fast",
            example_kwargs: dict[str, Any] | None = None, **options: Any) -> Any:
    """Capture ``fn`` into a planned program and return a callable for it (an :class:`Executable`).

    ``fn`` may be a model forward or a whole training step (``loss.backward()`` /
    ``torch.autograd.grad`` plus in-place parameter updates); calls apply the same in-place
    mutations to the caller's tensors as eager would. ``mode``: ``"trace"`` (CPU, CUDA) or
    ``"graph"`` (CUDA graph of the trace run). ``gc``: ``"fast"`` (drop at last use) or ``"none"``.

    Three forms:

    - ``compile(fn, *example_args, example_kwargs={...}, **options)`` captures now, on the examples
      (no step is taken: where ``fn`` makes optimizer state on its first step, the first call runs
      that step as a program of its own that makes it, and the second captures);
    - ``compile(fn, **options)`` captures on the first call;
    - ``@compile`` and ``@compile(mode="graph", ...)`` decorate a function (capture on first call).

    Every keyword given to ``compile`` is an option of flowexec's (the table ``OPTIONS``); ``fn``'s
    own keyword arguments are given at call time, ``exe(x, scale=2.0)``, or as ``example_kwargs``.
    Arguments and results may be pytrees (see :class:`Executable`); options that take positions
    (``fetch=``, ``borrow=``) count leaves in flattened order.

    Example::

        >>> import torch, flowexec
        >>> exe = flowexec.compile(lambda a, b: a @ b + 1, torch.ones(2, 2), torch.ones(2, 2))
        >>> exe(torch.ones(2, 2), torch.eye(2))
        tensor([[2., 2.],
                [2., 2.]])
        >>> @flowexec.compile
        ... def step(params, x, *, scale):
        ...     return {"y": (params[0] * x).sum() * scale}
        >>> step([torch.ones(3)], torch.arange(3.0), scale=2.0)
        {'y': tensor(6.)}
    """
    if mode not in MODES:
        raise OptionError(f"mode={mode!r} is not a run mode; valid: {', '.join(MODES)}")
    streams = check_streams(options.get("streams", 1))
    check_gc(gc, mode, streams)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        valid = "; ".join(f"{k}: {v}" for k, v in OPTIONS.items())
        raise OptionError(f"unknown option(s) {', '.join(map(repr, unknown))}; valid options — {valid}. "
                          "(fn's own keyword arguments go to the call, exe(x, name=value), or to "
                          "compile(..., example_kwargs={...}))")
    from .runtime.graph_trees import check_pool

    check_pool(options.get("pool", "private"), mode, streams, options)
    if fn is None:  # @flowexec.compile(mode=..., ...)
        if example_args or example_kwargs:
            raise OptionError("compile(None, ...): example arguments need the function to capture")
        return functools.partial(compile, mode=mode, gc=gc, **options)
    if not callable(fn):
        raise OptionError(f"fn must be callable, got {type(fn).__name__}")
    if mode == "graph" and not torch.cuda.is_available():
        raise OptionError("mode='graph' captures a CUDA graph, but this machine has no CUDA device; "
                          "use mode='trace' on CPU")
    exe = Executable(fn, mode, gc, options)
    exe._check_devices = True
    functools.update_wrapper(exe, fn, updated=())
    if example_args or example_kwargs:
        exe.compile_for(*example_args, **(example_kwargs or {}))
    return exe
