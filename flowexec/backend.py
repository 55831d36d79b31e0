"""``torch.compile(model, backend="flowexec")``: Dynamo's graphs through flowexec.

Dynamo splits the user's Python at data-dependent control flow (graph breaks); AOTAutograd
turns each piece into a forward and a backward ATen graph. Each of those graphs becomes a
Program and runs through the same passes and interpreter as ``flowexec.compile``, with the
same options (``mode``, ``gc``).

Example::

    >>> import torch, flowexec
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> cmodel = torch.compile(model, backend="flowexec", options={"mode": "trace"})
    >>> cmodel(torch.randn(2, 4)).sum().backward()
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx

from .capture import program_from_graph
from .errors import CaptureError, OptionError, count_option
from .build import plan_for
from .executable import MODES, RecaptureWarning
from .fusion import check_fuse, check_pad
from .passes.streams import cuda_devices
from .plan import check_gc, check_streams
from .runtime.graph_trees import backward_static_indices, check_pool
from .runtime.lower import lower_for

BACKEND_OPTIONS = ("mode", "gc", "warmup", "fuse_lerp", "cache_size", "streams", "memory", "order", "gc_backlog",
                   "pool", "fuse", "pad")
_PLAN_OPTIONS = ("memory", "order", "gc_backlog")  # passed to build_plan as they are (docs/memory.md)
# Dynamo wraps compiled backward functions in a way that hides our _boxed_call flag; the
# unboxed call it falls back to is correct, so its advice is noise for our users.
warnings.filterwarnings("ignore", message="Your compiler for AOTAutograd is returning a function that doesn't take boxed")


def _fw_metadata() -> Any:
    """AOTAutograd's metadata of the forward being compiled (the tracing context's), or None."""
    try:
        ctx = torch._guards.TracingContext.try_get()
        return getattr(ctx, "fw_metadata", None) if ctx is not None else None
    except Exception:
        return None


def _static_input_indices() -> set[int]:
    """Indices AOTAutograd marks as static (parameters, buffers) for the graph being compiled."""
    return set(getattr(_fw_metadata(), "static_input_indices", None) or ())


def _to_front(runners: list[Any], k: int) -> Any:
    """Move ``runners[k]`` first (most recently used) and return it."""
    runners.insert(0, runners.pop(k))
    return runners[0]


def _cuda_available() -> bool:
    """Whether graph mode can capture CUDA graphs here (tests on CPU stand a runner in)."""
    return torch.cuda.is_available()


def _saved_outputs_start() -> int | None:
    """Where the tensors a forward graph saves for backward begin among its outputs (after the
    mutated inputs, user outputs and intermediate bases AOTAutograd returns first); None where
    that is not known (effect tokens, or another torch layout)."""
    meta = _fw_metadata()
    n = getattr(meta, "num_forward", None)
    return None if n is None or getattr(meta, "tokens", None) else int(n)


class _CaptureRefused(Exception):
    """CUDA refused a graph's capture; the GraphProgram now runs in trace mode."""


class _NotCapturable(Exception):
    """``program_from_graph`` refused an AOT graph (its CaptureError is the cause)."""


AS_TRACED = "as traced"  # a forward flowexec could not take: AOTAutograd's graph runs as it is


def _as_traced(g: fx.GraphModule, inputs: Sequence[Any], role: str, e: BaseException) -> Callable[..., Any]:
    """``g`` run as AOTAutograd traced it (torch.compile's ``aot_eager``: ``boxed_nop``), for a
    graph flowexec cannot capture (a Python call on symbolic sizes, a higher-order op), said in
    a warning."""
    from torch._dynamo.backends.debugging import boxed_nop

    warnings.warn(f"flowexec: this {role} graph runs as Dynamo and AOTAutograd traced it, without flowexec's plan "
                  f"(no fusion, streams or CUDA graph): {str(e).splitlines()[0][:300]}", stacklevel=3)
    return boxed_nop(g, list(inputs))


class GraphProgram:
    """One AOT graph, planned and lowered; graph mode captures lazily at the first real call.

    A backward graph (``forward`` names its forward's GraphProgram) hands its gradients to
    autograd as fresh aliases of its static buffers, so ``AccumulateGrad`` adopts them as
    ``.grad`` instead of copying each one; before the next replay a ``.grad`` that still holds
    a buffer is given a private copy (the forward's leaf inputs are where those are looked for).

    The CUDA graph reads some inputs in place (borrowed: parameters, other graphs' outputs), so
    it is valid for one set of their addresses. Graphs are kept per set, up to ``cache_size``,
    the least recently used dropped first: Dynamo shares one compiled graph between modules of
    one class, whose parameters differ. A call whose borrowed inputs moved replays the graph of
    its addresses where one is kept, and otherwise captures one (warned where a parameter or a
    static input moved; silently where the inputs are another graph's outputs, such as the
    saved tensors of the forward graph that a micro-batch ran on).

    A forward (``saved_from``: where its saved tensors begin among its outputs) whose graph's
    saved tensors are still held when it is called again (micro-batches in GPipe order: all
    forwards, then all backwards) replays another kept graph whose saved tensors are free, or
    captures one (up to ``cache_size``), so no saved tensor is copied; the backward then
    finds them in that graph's buffers. Past ``cache_size`` the busy graph's held outputs are
    moved to private memory, and a call whose moved inputs are such one-call copies runs on a
    second kind of graph, one that copies them in (captured once, silently; up to
    ``cache_size`` of them).
    """

    _boxed_call = True  # AOTAutograd passes the argument list itself

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str, gc: str, warmup: int,
                 fuse_lerp: bool | str | None = None, forward: GraphProgram | None = None,
                 static_idx: Iterable[int] = (), cache_size: int = 8, saved_from: int | None = None,
                 streams: int = 1, plan_options: dict[str, Any] | None = None, pool: str = "private",
                 role: str = "forward", tree_static: Iterable[int] = (), fuse: str | bool | None = None,
                 pad: bool | None = None) -> None:
        """``static_idx``: input positions AOTAutograd marks static (:func:`_static_input_indices`,
        a forward's only); ``forward``: the forward GraphProgram of a backward graph;
        ``cache_size``: how many captured graphs (sets of borrowed addresses) to keep;
        ``saved_from``: a forward's first output that autograd saves (:func:`_saved_outputs_start`);
        ``streams``: CUDA streams to spread the graph's ops over (``flowexec.compile``'s option;
        a graph on no CUDA device, or on several, runs on one). ``pool="shared"``: the graph is
        one of its device's CUDA-graph trees (``runtime/graph_trees.py``), as ``role`` (forward,
        backward, inference), with ``tree_static`` among its static inputs."""
        try:
            program = program_from_graph(gm, example_inputs)
        except CaptureError as e:
            raise _NotCapturable from e
        # streams of one device (CUDA streams) or of none (worker threads on the CPU); memory="planned":
        # every graph captured from this program writes its intermediates into the one arena (replays
        # are serial), so they share that memory.
        self.plan = plan_for(program, mode, gc=gc, streams=streams if len(cuda_devices(program)) <= 1 else 1,
                             fuse=fuse, pad=pad, fuse_lerp=fuse_lerp, **(plan_options or {}))
        self.run = lower_for(self.plan, mode)
        self.mode = mode
        self.warmup = warmup
        self.static_idx = set(static_idx)
        self.cache_size = cache_size
        self.saved_from = saved_from
        self.graph_runners: list[Any] = []  # most recently used first: [0] ran the last call
        self.staging_runners: list[Any] = []  # graphs that copy one-call copies in; most recent first
        self.forward = forward
        self.leaf_inputs: list[Any] = []  # weak refs to the leaf tensors this graph reads (grad owners)
        self.staged_calls = 0  # calls whose one-call copies a staging graph copied in
        self.dropped = 0  # graphs dropped to keep cache_size (a warning once it keeps happening)
        index = {vid: k for k, vid in enumerate(self.plan.program.inputs)}
        self.mutated_inputs = [index[v] for v in self.plan.mutated if v in index]  # positions written in place
        if mode == "graph" and any(not isinstance(a, torch.Tensor) for a in example_inputs):
            warnings.warn("flowexec: graph with symbolic/scalar inputs runs in trace mode (no CUDA graph)")
            self.mode = "trace"
        if self.mode == "graph" and forward is not None and forward.mode != "graph":
            self._follow_forward()
        self.shared: Any = None  # pool="shared": the SharedPoolGraph every call goes through
        self._tree_device: int | None = None  # a backward in trace mode after a forward in the trees
        if self.mode == "graph" and pool == "shared":
            self.shared = self._shared_graph(gm, example_inputs, role, tree_static)

    def _shared_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any], role: str,
                      tree_static: Iterable[int]) -> Any:
        """This graph as a node of its device's CUDA-graph tree, or None (trace mode, warned)
        where the ``cudagraphs`` backend would not capture it either."""
        from .runtime.graph_trees import SharedPoolGraph, graph_metadata, skip_reason

        devices = cuda_devices(self.plan.program)
        fwd = self.forward
        why = (("its forward graph runs in trace mode" if fwd is not None and fwd.shared is None else None)
               or skip_reason(gm) or (None if len(devices) == 1 else f"{len(devices)} CUDA devices"))
        if why is not None:
            warnings.warn(f"flowexec: pool='shared': this {role} graph runs in trace mode (no CUDA graph): {why}")
            self.mode = "trace"
            if fwd is not None and fwd.shared is not None:  # the trees must still see the backward run
                self._tree_device = fwd.shared.device_index
            return None
        (device,) = devices
        index = device.index if device.index is not None else torch.cuda.current_device()
        return SharedPoolGraph(self.run, example_inputs, sorted(self.static_idx | set(tree_static)),
                               self.mutated_inputs, index, role, **graph_metadata(gm, len(self.plan.program.outputs)))

    def _follow_forward(self) -> None:
        """A backward runs in graph mode only while its forward does: its gradients' buffers are
        handed out as ``.grad`` only where the forward's graphs record the leaves that may hold
        them, and an attention forward's dropout seeds are host tensors outside a graph."""
        warnings.warn("flowexec: this backward graph runs in trace mode (no CUDA graph), as its forward graph does",
                      stacklevel=5)
        self._leave_graph_mode()

    def _leave_graph_mode(self) -> None:
        """Trace mode from now on; the graphs kept so far (their buffers, private pools) go."""
        self.mode = "trace"
        self.graph_runners.clear()
        self.staging_runners.clear()

    def _capture(self, args: list[Any]) -> Any:
        from .runtime.cuda_graph import CudaGraphRunner, graph_capture_failed
        from .storage import is_stable, mark_stable

        borrow = [isinstance(a, torch.Tensor) and (i in self.static_idx or is_stable(a)) for i, a in enumerate(args)]
        for a, b in zip(args, borrow):
            if b:
                mark_stable(a)
        mutated = [args[i] for i in self.mutated_inputs if borrow[i]]
        # Every graph's leaves stay candidates: a kept graph of other parameters replays later.
        known = {id(t) for t in (r() for r in self.leaf_inputs) if t is not None}
        self.leaf_inputs = [r for r in self.leaf_inputs if r() is not None] + [
            weakref.ref(a) for a in args
            if isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf and id(a) not in known]
        fwd = self.forward
        fresh = range(len(self.plan.program.outputs)) if fwd is not None else ()
        candidates = (lambda: [t for t in (r() for r in fwd.leaf_inputs) if t is not None]) if fwd is not None else None
        try:
            runner = CudaGraphRunner(self.run, args, mutated, borrow, mutated_inputs=self.mutated_inputs,
                                     warmup=self.warmup, fresh_outputs=fresh, grad_candidates=candidates,
                                     keep_borrowed=False)  # a backward's hold would keep its forward busy
        except RuntimeError as e:  # (torch.AcceleratorError and ExecutionError are ones)
            if not graph_capture_failed(e):
                raise
            # No graph of this program can be made (a host tensor copied to the device, say): it
            # runs as traced from now on, as eager does (the capture put the caller's state back).
            warnings.warn(f"flowexec: the CUDA graph capture of this {self._role} graph failed "
                          f"({str(e).splitlines()[0][:300]}); it runs in trace mode", stacklevel=4)
            self._leave_graph_mode()
            raise _CaptureRefused from None
        if self.saved_from is not None:
            runner.outputs.watch_saved(self.saved_from)
        return runner

    def __call__(self, *args: Any) -> list[Any]:
        # AOTAutograd calls boxed (one list) where it sees _boxed_call, unboxed elsewhere.
        args = args[0] if len(args) == 1 and isinstance(args[0], list) else list(args)
        if self.mode != "graph":  # trace and threaded
            if self._tree_device is not None:  # as the cudagraphs backend does: no forward pending now
                from .runtime.graph_trees import tree_manager

                manager = tree_manager(self._tree_device)
                if manager is not None:
                    manager.set_to_running_backward()
            return self.run(*args)
        if self.shared is not None:  # pool="shared": the trees pick, record and replay the graph
            return self.shared(args)
        runners = self.graph_runners
        if runners and runners[0].matches(args):
            runner = runners[0]
            if self.saved_from is None:
                return runner(args)
            if not runner.outputs.saved_held():
                return runner(args, saved_checked=True)
        try:
            return self._call_slow(args)
        except _CaptureRefused:
            pass  # (run outside the handler: the refused capture's frames and buffers go first)
        return self.run(*args)

    @property
    def graph_runner(self) -> Any:
        """The graph of the last call (None before the first)."""
        return self.graph_runners[0] if self.graph_runners else None

    def _call_slow(self, args: list[Any]) -> list[Any]:
        """A call the last call's graph cannot serve as it is: its borrowed inputs moved, or (a
        forward) the saved tensors of its last call are still held."""
        if self.forward is not None and self.forward.mode != "graph":  # (its capture was refused since)
            self._follow_forward()
            raise _CaptureRefused
        busy = None
        watched = self.saved_from is not None
        for k, runner in enumerate(self.graph_runners):
            if runner.matches(args):
                if watched and runner.outputs.saved_held():
                    busy = busy or runner  # its last call's backward has not run yet
                    continue
                _to_front(self.graph_runners, k)
                return runner(args, saved_checked=watched)
        if busy is not None:
            # Another micro-batch's forward while earlier ones wait for their backwards (GPipe
            # order): a graph of its own, so nothing is copied out of the busy ones. With no
            # room for one, the busy graph's held outputs are moved to private memory first.
            if self._make_room():
                return self._add(self._capture(args), args)
            _to_front(self.graph_runners, self.graph_runners.index(busy))
            return busy(args)
        moved = [runner.moved(args) for runner in self.graph_runners]
        if any(self._only_transient(args, m) for m in moved):
            return self._call_staging(args)
        # Warned only where no kept graph has this call's parameters and static inputs where they
        # are (new parameters); a graph for another graph's outputs (saved tensors) is silent.
        permanent = [[i for i in m if isinstance(args[i], torch.nn.Parameter) or i in self.static_idx] for m in moved]
        full = len(self.graph_runners) >= self.cache_size
        self._make_room()
        if permanent and all(permanent):
            warnings.warn(f"flowexec: {self._describe_moved(args, min(moved, key=len))} of this {self._role} graph, "
                          "read in place by its CUDA graph, came at new addresses (moved, or another module's that "
                          "shares this compiled code); capturing the graph again for them "
                          f"({min(len(self.graph_runners) + 1, self.cache_size)} graph(s) kept, cache_size="
                          f"{self.cache_size}" + (", the least recently used dropped)" if full else ")"),
                          RecaptureWarning, stacklevel=3)
        return self._add(self._capture(args), args)

    def _make_room(self) -> bool:
        """Whether a graph can be added without dropping one that is busy: where the cache is
        full, the least recently used graph whose saved tensors are free is dropped."""
        runners = self.graph_runners
        if len(runners) < self.cache_size:
            return True
        for k in range(len(runners) - 1, -1, -1):
            if self.saved_from is None or not runners[k].outputs.saved_held():
                del runners[k]
                self._note_dropped()
                return True
        return False

    def _note_dropped(self) -> None:
        self.dropped += 1
        if self.dropped == 2 * self.cache_size:  # once: captures that keep dropping graphs cost every call
            warnings.warn(f"flowexec: this {self._role} graph has dropped {self.dropped} captured graphs to keep "
                          f"cache_size={self.cache_size}; more sets of addresses take turns than it keeps, so calls "
                          "keep capturing graphs. Pass a larger options={'cache_size': ...}", RecaptureWarning,
                          stacklevel=4)

    def _keep(self, runners: list[Any], runner: Any) -> Any:
        """Put a new graph first in ``runners``, the least recently used dropped past cache_size."""
        runners.insert(0, runner)
        if len(runners) > self.cache_size:
            del runners[self.cache_size:]
            self._note_dropped()
        return runner

    def _add(self, runner: Any, args: list[Any]) -> list[Any]:
        """Keep a new graph and run it."""
        return self._keep(self.graph_runners, runner)(args, saved_checked=False)

    def _call_staging(self, args: list[Any]) -> list[Any]:
        """A call whose moved inputs are one-call copies: the backward of a micro-batch whose
        forward another forward of the same graph followed, its saved tensors moved out of the
        graph's buffers (outputs.py) for this call only. A graph captured on such a call borrows
        only the stable inputs and copies the rest in, so it serves every such call; the graphs
        that read them in place stay for the calls that find them there. Kept like the others."""
        self.staged_calls += 1
        runners = self.staging_runners
        for k, runner in enumerate(runners):
            if runner.matches(args):
                return _to_front(runners, k)(args)
        return self._keep(runners, self._capture(args))(args)

    def _only_transient(self, args: list[Any], moved: list[int]) -> bool:
        """Whether every moved input is a one-call copy: neither an input AOTAutograd marks static
        nor a tensor that keeps its address (``is_stable``: parameters, other graphs' outputs),
        which moved for good, so the graph is captured again."""
        from .storage import is_stable

        return all(i not in self.static_idx and not is_stable(args[i]) for i in moved)

    @property
    def _role(self) -> str:
        return "backward" if self.forward is not None else "forward"

    def _describe_moved(self, args: list[Any], moved: list[int]) -> str:
        """Names the moved inputs and why each counts as moved for good, for the warning."""
        from .storage import is_stable

        prog = self.plan.program
        names = [prog.values[vid].label for vid in prog.inputs]
        parts = []
        for i in moved:
            a = args[i]
            why = ("a parameter" if isinstance(a, torch.nn.Parameter) else "static for AOTAutograd"
                   if i in self.static_idx else "at a stable address" if is_stable(a) else "a copy")
            name = f" {names[i]}" if i < len(names) else ""
            parts.append(f"input {i}{name} {tuple(a.shape)} ({why})")
        return ", ".join(parts)


def flowexec_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The Dynamo backend: AOTAutograd with flowexec compiling the forward and backward graphs."""
    from torch._dynamo.backends.common import aot_autograd

    opts = dict(options or {})
    unknown = sorted(set(opts) - set(BACKEND_OPTIONS))
    if unknown:
        raise OptionError(f"unknown flowexec backend option(s) {unknown}; valid: {', '.join(BACKEND_OPTIONS)}")
    mode, gc = opts.get("mode", "trace"), opts.get("gc", "fast")
    warmup, cache_size = count_option(opts, "warmup", 1, 0), count_option(opts, "cache_size", 8, 1)
    streams = check_streams(opts.get("streams", 1))
    if mode not in MODES:
        raise OptionError(f"mode={mode!r} is not a run mode; valid: {', '.join(MODES)}")
    check_gc(gc, mode, streams)
    pool = check_pool(opts.get("pool", "private"), mode, streams, opts)
    fuse, pad = check_fuse(opts.get("fuse")), check_pad(opts.get("pad"))
    if mode == "graph" and not _cuda_available():
        raise OptionError("mode='graph' captures CUDA graphs, but this machine has no CUDA device; use mode='trace'")

    forwards: list[GraphProgram | str] = []  # AOTAutograd compiles this graph's forward, then its backward
    plan_options = {k: opts[k] for k in _PLAN_OPTIONS if k in opts}

    def compiler(g: fx.GraphModule, inputs: Sequence[Any], saved_from: int | None = None,
                 role: str = "inference") -> Callable[..., Any]:
        # The trees' static inputs also count the parameters AOTAutograd lifts in front of Dynamo's
        # inputs (none where Dynamo inlines modules), as the cudagraphs backend counts them.
        lifted = range(max(0, len(inputs) - len(example_inputs))) if pool == "shared" else ()
        try:
            return GraphProgram(g, inputs, mode, gc, warmup, opts.get("fuse_lerp"), static_idx=_static_input_indices(),
                                cache_size=cache_size, saved_from=saved_from, streams=streams,
                                plan_options=plan_options, pool=pool, role=role, tree_static=lifted, fuse=fuse, pad=pad)
        except _NotCapturable as e:
            return _as_traced(g, inputs, role, e.__cause__ or e)

    def fw_compiler(g: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        made = compiler(g, inputs, _saved_outputs_start(), role="forward")
        forwards.append(made if isinstance(made, GraphProgram) else AS_TRACED)
        return made

    def bw_compiler(g: fx.GraphModule, inputs: Sequence[Any]) -> Callable[..., Any]:
        # No static indices: the tracing context still holds the forward's, which index the
        # forward's inputs (taken for the backward's, they made a tangent "static", so every call
        # moved it and captured again). The backward borrows by address instead (is_stable:
        # parameters and the forward's outputs, which its saved tensors are).
        # pool="shared": the trees' static inputs are everything before the tangents (saved
        # tensors: the forward's outputs in the pool, or parameters), as the cudagraphs backend has it.
        tree_static = backward_static_indices(g) if pool == "shared" else ()
        fwd = forwards[-1] if forwards else None
        # (after a forward run as traced, no graph holds its saved tensors for a backward graph)
        bmode = "trace" if fwd is AS_TRACED and mode == "graph" else mode
        try:
            return GraphProgram(g, inputs, bmode, gc, warmup, opts.get("fuse_lerp"),
                                forward=fwd if isinstance(fwd, GraphProgram) else None, cache_size=cache_size,
                                streams=streams, plan_options=plan_options, pool=pool, role="backward",
                                tree_static=tree_static, fuse=fuse, pad=pad)
        except _NotCapturable as e:
            return _as_traced(g, inputs, "backward", e.__cause__ or e)

    return aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler, inference_compiler=compiler)(gm, example_inputs)


def _register() -> None:
    from torch._dynamo import list_backends, register_backend

    # (Installed, the package also names this function in the torch_dynamo_backends entry point
    # group, so torch.compile(backend="flowexec") finds it without `import flowexec`.)
    if "flowexec" not in list_backends(exclude_tags=()):
        register_backend(flowexec_backend, name="flowexec")


_register()
# Hugging Face's Trainer asks accelerate, which checks backend names against an enum of its own:
# teach it "flowexec" (the installed package's .pth does this at start-up, without this import).
with contextlib.suppress(ImportError):
    import _flowexec_accelerate

    _flowexec_accelerate.install()
