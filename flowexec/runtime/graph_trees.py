"""Graph mode with one memory pool per device (option ``pool="shared"``): each planned runner is
captured and replayed through PyTorch's CUDA-graph trees (``torch._inductor.cudagraph_trees``).

The private-pool graphs of ``cuda_graph.py`` each keep a pool and hold their static outputs,
so micro-batches in GPipe order keep every graph's outputs allocated between steps. CUDA-graph
trees, what ``torch.compile(mode="reduce-overhead")`` and the ``cudagraphs`` backend use, put
every graph of a device in one pool, hold outputs weakly (dead once the caller drops them),
checkpoint the pool's allocator state so that a graph recorded while earlier outputs are alive
places its memory around them, and record one node per order of calls (forward generations,
then backward ones). flowexec only wraps its runner in their calling convention:
:func:`tree_function` (boxed inputs, the list cleared, parameters as static inputs).

What trees do not do, flowexec adds (:class:`HeldOutputs`): trees replay over the previous
generation's outputs at the start of a new one (a new ``torch.compile`` invocation with no
backward pending) and, on their fast path, return the same tensor objects each replay, so an
output kept across steps would change silently. Outputs are handed out as fresh aliases; before
a call on which trees may begin a new generation, every alias from the last one still held is
moved to private memory (copy-on-overwrite, as the private-pool graphs do).

Example (needs CUDA)::

    >>> import torch, flowexec  # doctest: +SKIP
    >>> m = torch.nn.Linear(64, 64).cuda()  # doctest: +SKIP
    >>> cm = torch.compile(m, backend="flowexec", options={"mode": "graph", "pool": "shared"})  # doctest: +SKIP
    >>> cm(torch.randn(8, 64, device="cuda")).sum().backward()  # doctest: +SKIP
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Sequence

import torch

from ..errors import OptionError

POOLS = ("private", "shared")
ROLES = ("forward", "backward", "inference")


def check_pool(pool: Any, mode: str, streams: Any, options: dict[str, Any]) -> str:
    """``pool`` checked against the other options (an ``OptionError`` naming what cannot work).

    >>> check_pool("private", "trace", 1, {})
    'private'
    >>> check_pool("shared", "trace", 1, {})
    Traceback (most recent call last):
    ...
    flowexec.errors.OptionError: pool='shared' applies to mode='graph' (it is where CUDA graphs keep their memory); mode='trace' captures none
    """
    if pool not in POOLS:
        raise OptionError(f"pool={pool!r} is not a graph memory pool; valid: 'private' (default: each CUDA graph "
                          "keeps a pool of its own) or 'shared' (every graph of a device in one pool, through "
                          "PyTorch's CUDA-graph trees)")
    if pool == "private":
        return pool
    if mode != "graph":
        raise OptionError(f"pool='shared' applies to mode='graph' (it is where CUDA graphs keep their memory); "
                          f"mode={mode!r} captures none")
    if streams != 1:
        raise OptionError(f"pool='shared' runs each graph on one stream (CUDA-graph trees warm up, record and "
                          f"allocate on one stream per device); streams={streams!r} cannot be combined with it")
    if options.get("warmup", 1) != 1:
        raise OptionError(f"warmup={options['warmup']!r}: with pool='shared' CUDA-graph trees warm each graph up "
                          "once themselves (a first call runs eagerly in the pool); leave warmup out")
    if options.get("fetch") not in (None, False, ()):
        raise OptionError("fetch cannot be combined with pool='shared': a Fetch handle copies an output on a side "
                          "stream after the call, which the trees' next replay does not wait for")
    return pool


def tree_api() -> tuple[Callable[..., Any], frozenset[str]]:
    """``cudagraphify_impl`` and the keywords its ``cudagraphify`` accepts; an ``OptionError``
    naming this torch where they are missing (pool="shared" is built on them)."""
    try:
        from torch._inductor import cudagraph_trees as trees
        impl, inner = trees.cudagraphify_impl, trees.cudagraphify
        params = inspect.signature(inner).parameters
    except Exception as e:  # a private API: anything missing means this torch cannot do it
        raise OptionError(f"pool='shared' captures graphs through torch._inductor.cudagraph_trees.cudagraphify_impl, "
                          f"which torch {torch.__version__} does not provide as expected ({type(e).__name__}: {e}); "
                          "use pool='private'") from None
    needed = {"device_index", "is_backward", "is_inference"}
    if not needed <= set(params):
        raise OptionError(f"pool='shared': torch {torch.__version__}'s cudagraph_trees.cudagraphify takes "
                          f"{sorted(params)}, not the keywords {sorted(needed)} flowexec passes; use pool='private'")
    return impl, frozenset(params)


def skip_reason(gm: torch.fx.GraphModule) -> str | None:
    """Why an AOT graph cannot be a CUDA graph of the trees (a CPU node, several devices, an op
    that cannot be captured), as the ``cudagraphs`` backend decides; None where it can."""
    try:
        from torch._dynamo.backends.cudagraphs import get_device_node_mapping
        from torch._inductor.cudagraph_utils import check_multiple_devices_or_any_cpu_nodes
        from torch._inductor.utils import get_first_incompatible_cudagraph_node
    except Exception:  # checks only: without them a capture that fails says so itself
        return None
    if why := check_multiple_devices_or_any_cpu_nodes(get_device_node_mapping(gm)):
        return why
    if node := get_first_incompatible_cudagraph_node(gm):
        return f"an op a CUDA graph cannot capture ({node.name})"
    return None


def program_skip_reason(prog: Any, devices: set) -> str | None:
    """Why a ``flowexec.compile`` signature cannot be a graph of the trees: not on exactly one GPU
    (the trees' outputs must be CUDA tensors), or an output that is a constant other than an int
    or None (what the trees keep of non-tensor outputs); None where it can."""
    from ..program import Ref

    off = sorted({str(v.meta.device) for v in prog.values if v.meta is not None and v.meta.device.type != "cuda"})
    consts = [o for o in prog.outputs if not isinstance(o, Ref) and not isinstance(o, (int, type(None)))]
    if len(devices) != 1:
        return f"its program is on {len(devices)} CUDA devices"
    if off:
        return f"it has values on {', '.join(off)}"
    if consts:
        return f"it returns constants ({', '.join(type(c).__name__ for c in consts)})"
    return None


def backward_static_indices(gm: torch.fx.GraphModule) -> list[int]:
    """A backward graph's static inputs: everything before the tangents (saved tensors, which are
    the forward's outputs or parameters), as the ``cudagraphs`` backend takes them."""
    try:
        from torch._inductor.utils import count_tangents

        return list(range(count_tangents(gm)))
    except Exception:
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        return [i for i, n in enumerate(names) if "tangents" not in n]


def graph_metadata(gm: torch.fx.GraphModule, n_outputs: int) -> dict[str, Any]:
    """The trees' optional keywords taken from an AOT graph: stack traces of the outputs (used in
    their error messages; one per output or none) and placeholder records."""
    # One entry per output, always: the trees' warm-up nodes keep what they are given and assert
    # it is a list when a generation ends.
    traces: list[str | None] = [None] * n_outputs
    try:
        from torch._dynamo.backends.cudagraphs import get_stack_traces

        found = get_stack_traces(gm)
        if len(found) == n_outputs:
            traces = list(found)
    except Exception:
        pass
    return {"stack_traces": traces, "placeholders": placeholders_of(gm.graph)}


def placeholders_of(graph: torch.fx.Graph) -> Any:
    """The trees' placeholder records (their messages index them by input position)."""
    try:
        from torch._inductor.cudagraph_utils import get_placeholder_info

        return get_placeholder_info(graph)
    except Exception:
        return ()


def executable_metadata(n_inputs: int, n_outputs: int) -> dict[str, Any]:
    """The trees' optional keywords for a ``flowexec.compile`` signature (no fx graph names it)."""
    return {"stack_traces": [None] * n_outputs, "placeholders": named_placeholders([str(k) for k in range(n_inputs)])}


def named_placeholders(names: Sequence[str]) -> Any:
    """Placeholder records for inputs that no fx graph names (``flowexec.compile``'s leaves)."""
    g = torch.fx.Graph()
    for k, _ in enumerate(names):
        g.placeholder(f"arg{k}")
    return placeholders_of(g)


def tree_function(run: Callable[..., list[Any]], example_inputs: Sequence[Any], static_idx: Sequence[int],
                  mutated_idx: Sequence[int], device_index: int, role: str, **meta: Any) -> Callable[[list[Any]], Any]:
    """``run`` (a lowered runner: ``run(*inputs) -> list``) wrapped by ``cudagraphify_impl``.

    The trees call the model boxed: ``model(inputs)`` with a list it must empty (so inputs can
    die during the call), first eagerly in the pool (warm-up), then under capture, then replay
    it. ``static_idx``: inputs read in place (parameters, buffers, borrowed state), checked by
    address at each replay (another address records again); other tensor inputs are copied into
    the pool. ``mutated_idx``: inputs the program writes (trees run the model eagerly where one
    is neither static nor another graph's output). ``role``: forward, backward or inference
    (forwards with a backward pending keep their generation open)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    impl, accepted = tree_api()

    def model(inputs: list[Any]) -> list[Any]:
        args = tuple(inputs)
        inputs.clear()
        return run(*args)

    model.__name__ = getattr(run, "__name__", "flowexec_graph")
    kwargs = {"device_index": device_index, "is_backward": role == "backward", "is_inference": role == "inference",
              "mutated_input_idxs": tuple(sorted(set(mutated_idx))), **meta}
    return impl(model, list(example_inputs), sorted(set(static_idx)), **{k: v for k, v in kwargs.items() if k in accepted})


class HeldOutputs:
    """The aliases one device's tree graphs handed out since their last generation began.

    ``before_call()`` asks the device's tree manager whether the coming call may start a new
    generation (their test: a new ``torch.compile`` invocation, no forward waiting for its
    backward, or ``mark_step_begin``); if so, every alias still held that still points at pool
    memory gets a private copy (``alias.data = clone``), since the new generation's replays
    write over the old one's memory. An alias autograd adopted as a parameter's ``.grad`` is
    held from C++ only (its Python object, and so the weak reference, is gone): parameters the
    graphs read (``add_parameters``) whose ``.grad`` lies in memory handed out since get
    ``.grad = .grad.clone()``. ``moved`` counts both."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self.handed: list[tuple[Any, int]] = []  # (weak ref to an alias, its storage's address then)
        self.ptrs: set[int] = set()  # storages handed out in this generation
        self.params: dict[int, Any] = {}  # id -> weak ref: parameters whose .grad may be a handed output
        self.manager: Any = None
        self.moved = 0

    def add_parameters(self, tensors: Sequence[Any]) -> None:
        """Leaf tensors that require grad (a graph's parameters): their ``.grad`` is checked."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad and id(t) not in self.params:
                self.params[id(t)] = weakref.ref(t)

    def before_call(self) -> None:
        from torch._inductor.cudagraph_trees import get_manager

        m = get_manager(self.device_index, create_if_none_exists=False)
        if m is not self.manager:
            if self.manager is not None:  # the trees were reset, and their pool with them
                self.handed.clear()
                self.ptrs.clear()
            self.manager = m  # (from None: the aliases came from the calls that made it)
        if self.ptrs and m is not None and m.can_start_new_generation():
            self._move_held()

    def _move_held(self) -> None:
        ptrs = self.ptrs
        with torch.no_grad():
            for ref, ptr in self.handed:
                t = ref()
                if t is not None and t.untyped_storage().data_ptr() == ptr:
                    t.data = t.clone()
                    self.moved += 1
            for key, ref in list(self.params.items()):
                p = ref()
                if p is None:
                    del self.params[key]
                    continue
                g = p.grad
                if g is not None and g.untyped_storage().data_ptr() in ptrs:
                    p.grad = g.clone()
                    self.moved += 1
        self.handed.clear()
        ptrs.clear()

    def hand_out(self, outs: Sequence[Any], positions: Sequence[int]) -> list[Any]:
        """``outs`` with an alias in place of each output at ``positions`` (pool memory)."""
        outs = list(outs)
        handed = self.handed
        for k in positions:
            o = outs[k]
            if isinstance(o, torch.Tensor):
                a = o.detach()
                ptr = o.untyped_storage().data_ptr()
                handed.append((weakref.ref(a), ptr))
                self.ptrs.add(ptr)
                outs[k] = a
        if len(handed) > 4096:  # no generation ends (a caller that never steps): keep only the living
            self.handed = [(r, p) for r, p in handed if r() is not None]
        return outs


_HELD: dict[int, HeldOutputs] = {}


def held_outputs(device_index: int) -> HeldOutputs:
    """The device's :class:`HeldOutputs` (one per device, as the trees' pool is)."""
    h = _HELD.get(device_index)
    if h is None:
        h = _HELD[device_index] = HeldOutputs(device_index)
    return h


class SharedPoolGraph:
    """One planned runner as a graph of its device's CUDA-graph tree (``pool="shared"``).

    Called with a list of inputs (emptied, as the trees' convention is); returns the outputs,
    those in pool memory as aliases that :class:`HeldOutputs` keeps valid across generations.
    ``new_generation``: count every call as a new invocation (``flowexec.compile``'s
    executables are not ``torch.compile`` frames, whose entry is what advances the trees'
    generation), so each call may replay over the last call's memory once its held outputs are
    moved out. ``unprotected``: outputs handed out as they are, never moved (gradients that
    ``flowexec.compile`` binds to ``.grad`` again after every call)."""

    def __init__(self, run: Callable[..., list[Any]], example_inputs: Sequence[Any], static_idx: Sequence[int],
                 mutated_idx: Sequence[int], device_index: int, role: str, new_generation: bool = False,
                 unprotected: Sequence[int] = (), **meta: Any) -> None:
        self.device_index = device_index
        self.role = role
        self.static_idx = sorted(set(static_idx))
        self._fn = tree_function(run, example_inputs, self.static_idx, mutated_idx, device_index, role, **meta)
        self._held = held_outputs(device_index)
        self._positions: list[int] | None = None  # outputs in pool memory (not a static input's)
        self._new_generation = new_generation
        self._unprotected = set(unprotected)
        self._lead: Any = None  # weak ref to the first static input of the last registration
        self.calls = 0

    def __call__(self, args: list[Any]) -> list[Any]:
        if self._new_generation:
            from torch._dynamo.mutation_guard import GenerationTracker

            GenerationTracker.generation += 1  # what entering a torch.compile frame does
        held = self._held
        held.before_call()
        first = self._positions is None
        if first:  # which outputs are a static input's memory: fixed by the program, read once
            static = {args[i].untyped_storage().data_ptr() for i in self.static_idx
                      if i < len(args) and isinstance(args[i], torch.Tensor)}
        if self.static_idx and (first or (self._lead is not None and args[self.static_idx[0]] is not self._lead())):
            # new parameters (the first call, or another module of the class sharing this code):
            # their .grad may become one of the trees' outputs. (A backward's static inputs are
            # saved tensors, new each call: its parameters are the forward's, registered there.)
            held.add_parameters([args[i] for i in self.static_idx if i < len(args)])
            lead = args[self.static_idx[0]]
            self._lead = weakref.ref(lead) if self.role != "backward" and isinstance(lead, torch.Tensor) else None
        outs = self._fn(args)
        if first:
            self._positions = [k for k, o in enumerate(outs) if isinstance(o, torch.Tensor)
                               and o.untyped_storage().data_ptr() not in static
                               and o.untyped_storage().data_ptr() != 0 and k not in self._unprotected]
        self.calls += 1
        return held.hand_out(outs, self._positions)


def uncounted_output_bytes(device_index: int) -> int | None:
    """Bytes of the device's tree outputs alive now that the caching allocator does not count:
    on their fast path trees hand out tensors over pool memory they do not own (the allocator
    saw that memory freed when the recording's own outputs died), so ``memory_allocated`` misses
    them. Benchmarks add this to compare with eager honestly; None where the trees' internals
    differ."""
    m = tree_manager(device_index)
    if m is None or m.current_node is None:
        return 0
    try:
        seen: set[int] = set()
        total = 0
        for ref in m.current_node.path_live_weakrefs():
            cdata = ref()
            if cdata is None or ref.data_ptr() in seen or torch._C._has_Standard_Deleter(cdata):
                continue
            seen.add(ref.data_ptr())
            total += torch.UntypedStorage._new_with_weak_ptr(cdata).nbytes()
        return total
    except Exception:
        return None


def tree_manager(device_index: int) -> Any:
    """The device's CUDA-graph tree manager, or None (benchmarks and tests read its pool)."""
    from torch._inductor.cudagraph_trees import get_manager

    return get_manager(device_index, create_if_none_exists=False)
