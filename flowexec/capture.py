"""Capture: a Python function of tensors → a :class:`~flowexec.program.Program` of ATen ops.

The function runs once under ``make_fx`` on the real example tensors, so whatever it calls —
a model forward, ``torch.autograd.grad``, ``loss.backward()``, an optimizer step — is recorded
as the ATen ops it dispatches. Capture has no lasting side effects: every tensor that existed
before and was written during the capture run is restored afterwards (an undo log), and so
are the RNG states. Tensors the function reads from its closure (parameters, buffers, grads,
optimizer state) become *state*: the program binds the caller's own tensor objects and
mutates them in place exactly as eager would.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> w = torch.randn(3, 3)
    >>> prog = capture(lambda x: (x @ w).tanh(), (torch.randn(2, 3),)).program
    >>> [op.name for op in prog.ops]
    ['aten.mm.default', 'aten.tanh.default']
"""
from __future__ import annotations

import collections
import contextlib
import functools
import gc
import itertools
import operator
import os
import sys
import threading
import time
import traceback
import types
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Literal, Sequence, Union

import torch
import torch.fx as fx
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import disable_autocast_cache, make_fx
from torch.optim import optimizer as _optimizer
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .errors import CaptureError, InputError
from .guards import (GuardSet, Recorder, global_names, hook_guards, library_function_guards, state_guard,
                     optimizer_guards, user_code)
from .draw_ranges import DrawRanges
from .hyperparams import _HOST_READS, Lifter, NO_VALUE
from .list_returns import flatten_list_returns, is_list
from .parking import ParkedGrads, held_by_grad_alone
from .program import Op, Program, Ref, Role, TensorMeta, Value, written_args
from .signature import output_tree
from .snapshot import DeviceRoom, HostSnapshot
from .fake_run import cuda_in_use, is_fake_tensor, quiet_fake_mode, register_fake_optimizer_kernels, runs_for_real
from .op_log import OpLog
from .rng import install as install_rng_ops, lower_rng_hops
from .storage import shared_storage, storage_id, storage_key

# What a capture records for its calls to check: nothing (False), guards and fed hyperparameters
# with gradients as inputs (True, an Executable's), or only the guards of what it read ("reads",
# a pipeline stage's).
Guarding = Union[bool, Literal["reads"]]

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)
# Ops that only feed torch.profiler record_function markers: they do no tensor work.
_DROPPED = {
    "profiler._record_function_enter.default",
    "profiler._record_function_enter_new.default",
    "profiler._record_function_exit._RecordFunction",
    "profiler._record_function_exit.default",
}


@dataclass
class Captured:
    """What capture hands to planning: the program and how results map back to the caller."""

    program: Program
    # After each call, ``param.grad`` is re-bound to output slot ``idx`` (grads that fn
    # created with set_to_none zeroing live as extra outputs).
    grad_bindings: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    n_user_outputs: int = 0
    # The containers fn returned (flowexec.signature's tree); the program's outputs are their
    # leaves, then the extra grads.
    out_tree: Any = None
    # What the capture read that a call must check (flowexec.guards), and the optimizer
    # hyperparameters fed to the program (flowexec.hyperparams).
    guards: GuardSet | None = None
    # Parameters whose current .grad the caller appends to the call's tensors (the program's
    # last inputs): gradients that exist when a call starts are read where they are then.
    grad_inputs: tuple[torch.Tensor, ...] = ()
    # Parameters whose .grad the program never reads and fn replaces or clears (zero_grad with
    # set_to_none before backward): the caller drops it before the run, as eager's zero_grad
    # frees it before the forward, rather than holding a dead gradient through the step.
    discarded_grads: tuple[torch.Tensor, ...] = ()
    # The discarded gradients still parked in host memory (flowexec.parking): the caller keeps
    # them there while it plans, and lets them go with its run's zero_grad.
    parked: ParkedGrads | None = None
    # How fn ran: "fake" (fake tensors: nothing computed), or "real" and why a fake run could not
    run: str = "real"
    # make_state (an optimizer's first step as a program): after the run the caller sets
    # ``optimizer.state[param][key]`` to output ``idx``, for each (optimizer, param, key, idx)
    made_state: tuple[tuple[Any, Any, str, int], ...] = ()
    # the user's and libraries' code objects the run started (a kept program checks their files)
    codes: tuple[Any, ...] = ()
    # the run's ops with their arguments by role (capture(log_ops=True): what a kept program's
    # replay is checked against, flowexec.op_log)
    log: OpLog | None = None


_metas = threading.local()  # per thread: the fake modes of the captures under way, innermost last
_metas_lock = threading.Lock()
_capturing: list[FakeTensorMode] = []  # every thread's: the fake modes of the captures under way
# The autograd graph task this thread runs (-1 outside a backward); a torch without it: any thread's.
_GRAPH_TASK: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: 0)


def _capture_mode() -> FakeTensorMode | None:
    """The fake mode of the capture this thread's ops belong to, or None.

    The autograd engine runs a CUDA backward's ops on its own device thread, where this
    thread-local stack is empty: with one capture under way in the process, a backward's ops are its
    (a GPT-2 124M capture made ~1,500 fake modes there, one per value: ~2.5 s on the H200).
    The value stored is the same either way; only its cost differs."""
    modes = getattr(_metas, "modes", None)
    if modes:
        return modes[-1]
    live = _capturing
    # (only inside a backward: another thread's own make_fx keeps its own fake mode)
    return live[0] if len(live) == 1 and _GRAPH_TASK() != -1 else None


@contextlib.contextmanager
def _direct_fake_metas(mode: FakeTensorMode) -> Iterator[None]:
    """While make_fx traces real tensors for this capture (on this thread, and on the autograd
    engine's threads: :func:`_capture_mode`): the fake copy it stores in each node's
    meta is made directly (a FakeTensor of ``mode`` over a meta tensor of the value's shape,
    strides and dtype, on its device) instead of by an ``empty_strided`` dispatched through the
    fake mode: the same value at a fraction of the cost (a 124M GPT-2 capture on a CPU: 7.0 s
    against 8.5). Anything but a plain strided tensor takes make_fx's own path, and so does
    every thread with no capture under way (torch's ``extract_val`` is wrapped once, for good:
    swapping it per capture would race with captures on other threads). ``set_meta`` likewise
    stores that value alone, without make_fx's ``tensor_meta`` copy of it."""
    from torch.fx.experimental import proxy_tensor

    with _metas_lock:
        if not getattr(proxy_tensor.extract_val, "_flowexec", False):
            proxy_tensor.extract_val = _extract_val_of(proxy_tensor.extract_val)
        if not getattr(proxy_tensor.set_meta, "_flowexec", False):
            proxy_tensor.set_meta = _set_meta_of(proxy_tensor.set_meta)
    stack = _metas.__dict__.setdefault("modes", [])
    stack.append(mode)
    with _metas_lock:
        _capturing.append(mode)
    try:
        yield
    finally:
        stack.pop()
        with _metas_lock:
            _capturing.remove(mode)


def _extract_val_of(own: Callable[..., Any]) -> Callable[..., Any]:
    from torch._subclasses.fake_tensor import FakeTensor, is_fake

    def extract_val(val: Any, *args: Any, **kwargs: Any) -> Any:
        mode = _capture_mode()
        if mode is None:
            return own(val, *args, **kwargs)
        if isinstance(val, torch.Tensor) and val.layout == torch.strided and not is_fake(val) \
                and type(val) in (torch.Tensor, torch.nn.Parameter):
            with _disable_current_modes():
                meta = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
                return FakeTensor(mode, meta, val.device)
        return own(val, *args, **kwargs)  # (a list's items come back here: torch's recursion names the module's)
    extract_val._flowexec = True  # type: ignore[attr-defined]
    return extract_val


def _set_meta_of(own: Callable[..., Any]) -> Callable[..., Any]:
    from torch.fx.experimental import proxy_tensor

    def set_meta(proxy: Any, val: Any) -> Any:
        if not getattr(_metas, "modes", None):
            return own(proxy, val)
        # Only "val": make_fx's best-effort "tensor_meta" beside it (a TensorMetadata per value,
        # ~5% of a capture) is read by nothing downstream of a capture (program_from_graph).
        proxy.node.meta["val"] = proxy_tensor.extract_val(val, include_real=proxy.node.op == "placeholder")
        return proxy
    set_meta._flowexec = True  # type: ignore[attr-defined]
    return set_meta


class LazyStateError(CaptureError):
    """fn created tensors that outlive the call (optimizer state made on the first step): the
    capture is discarded, fn runs eagerly once, and the next call captures."""


def fresh_optimizers(fn: Callable[..., Any]) -> list[torch.optim.Optimizer]:
    """The torch.optim optimizers that ``fn`` reaches (:func:`reachable`) and that have made no
    state yet, though their first step will (not SGD without momentum); none if looking raised
    (a property, a ``__getattr__``: the capture then finds lazy state itself).

    A capture of such a step would find the state made: an Executable asks this before its
    first capture, and captures that first step as a program of its own that makes the state
    (``first_step="planned"``), has Adam, AdamW and the like make it first (``"prefill"``) or runs it eagerly.

        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.AdamW(net.parameters())
        >>> [type(o).__name__ for o in fresh_optimizers(lambda x: opt.step())]
        ['AdamW']
        >>> fresh_optimizers(lambda x: torch.optim.SGD(net.parameters(), lr=0.1))  # made in the call: not reached
        []
    """
    found = []
    try:
        for obj in reachable(fn):
            if isinstance(obj, torch.optim.Optimizer):
                stateless_sgd = isinstance(obj, torch.optim.SGD) and all(not g.get("momentum") for g in obj.param_groups)
                trainable = any(p.requires_grad for g in obj.param_groups for p in g["params"])
                if type(obj).__module__.startswith("torch.optim") and not stateless_sgd and trainable and not obj.state:
                    found.append(obj)
    except Exception:  # a user's object answered oddly: no verdict (the capture still finds lazy state)
        return []
    return found


def reachable(fn: Callable[..., Any], depth: int = 3, budget: int = 2000) -> Iterator[Any]:
    """The objects ``fn`` reaches, each once: through closures, the globals its code names, a
    bound method's object, partials, attributes and containers, ``depth`` steps deep, at most 64
    entries of a container and ``budget`` objects in all (an optimizer's insides are not walked).

        >>> import torch
        >>> net = torch.nn.Linear(2, 2)
        >>> any(o is net for o in reachable(lambda x: net(x)))
        True
    """
    seen: set[int] = set()
    left = [budget]

    def visit(obj: Any, depth: int) -> Iterator[Any]:
        if id(obj) in seen or left[0] <= 0:
            return
        seen.add(id(obj))
        left[0] -= 1
        yield obj
        if depth == 0 or isinstance(obj, (type, types.ModuleType, torch.Tensor, str, bytes, torch.optim.Optimizer)):
            return
        found: list[Any] = []
        if isinstance(obj, (list, tuple)):
            found += obj[:64]
        elif isinstance(obj, dict):
            found += itertools.islice(obj.values(), 64)
        elif isinstance(obj, types.MethodType):
            yield from visit(obj.__func__, depth)
            yield from visit(obj.__self__, depth - 1)
            return
        elif isinstance(obj, types.FunctionType):
            found += [c.cell_contents for c in obj.__closure__ or () if _cell_filled(c)]
            found += [obj.__globals__[n] for n in global_names(obj.__code__) if n in obj.__globals__]
            found += [getattr(obj, "__wrapped__", None)]
        elif isinstance(obj, functools.partial):
            found += [obj.func, *obj.args, *obj.keywords.values()]
        else:  # a plain object (an nn.Module too: an optimizer it holds), by its attributes
            try:
                found += itertools.islice(vars(obj).values(), 64)
            except Exception:  # no __dict__ (slots, builtins), or one that raises
                pass
        for o in found:
            if o is not None:
                yield from visit(o, depth - 1)

    yield from visit(fn, depth)


def object_attributes(fn: Callable[..., Any]) -> list[tuple[Any, Any]]:
    """The attributes of the plain objects ``fn`` reaches (:func:`reachable`; not modules,
    whose attribute writes the capture's recorder undoes, nor optimizers), as they are now, with
    the contents of the dicts and lists among them (two levels): what :func:`put_back_attributes`
    restores after a capture run that is discarded (a GradScaler's scale, made lazily on a first
    step, must not stay behind as a fake tensor, nor its record of a step taken)."""
    out = []
    try:
        for obj in reachable(fn, depth=4):  # (an Executable's fn is a wrapper around the user's)
            if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, type, types.ModuleType,
                                types.FunctionType, types.MethodType, functools.partial)):
                continue
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict):
                out.append((obj, _contents(d, 3)))
    except Exception:  # a user's object answered oddly: what was recorded so far
        pass
    return out


def _contents(v: Any, depth: int) -> Any:
    """``v`` with a copy of what a dict or list holds, ``depth`` levels down (else ``v`` alone)."""
    if depth and (type(v) in (dict, list) or isinstance(v, collections.defaultdict)):
        items = v.items() if isinstance(v, dict) else enumerate(v)
        return (v, [(k, _contents(x, depth - 1)) for k, x in items])
    return (v, None)


def _put_back(saved: Any) -> Any:
    v, items = saved
    if items is not None:  # the same container, its contents as they were
        if isinstance(v, dict):
            v.clear()
            v.update((k, _put_back(x)) for k, x in items)
        else:
            v[:] = [_put_back(x) for _, x in items]
    return v


def put_back_attributes(saved: list[tuple[Any, Any]]) -> None:
    """Set each object's attributes back to ``saved`` (:func:`object_attributes`): those added
    since go, those replaced come back, and the dicts and lists among them hold what they held."""
    for _, attrs in saved:
        _put_back(attrs)


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


def _users(filename: str) -> bool:
    """Whether a frame's file is the user's (:func:`flowexec.guards.user_code`), "<string>"
    (make_fx's generated wrapper, which a stage's joint function runs under) excepted."""
    return user_code(filename) and filename != "<string>"


def user_frame(tb_or_stack: Any) -> str:
    """``file:line (code)`` of the innermost frame of the user's, or ''."""
    frames = traceback.extract_tb(tb_or_stack) if not isinstance(tb_or_stack, list) else tb_or_stack
    for fr in reversed(frames):
        if _users(fr.filename):
            code = f" ({fr.line.strip()})" if fr.line else ""
            return f"{fr.filename}:{fr.lineno}{code}"
    return ""


def _library_frame(tb: Any) -> str:
    """``file:line (code)`` of the innermost frame of a library (torch.nn, transformers, ...)
    that is not flowexec's nor torch's dispatch and tracing machinery, or '': where a read
    happened in a module of torch's with no user frame below (a pipeline stage's BatchNorm)."""
    internal = tuple(os.path.join(_TORCH_DIR, d) for d in ("_", "fx", "utils", "autograd", "overrides.py"))
    for fr in reversed(traceback.extract_tb(tb)):
        name = fr.filename
        if name.startswith(_OWN_DIR) or name.startswith(internal) or name.startswith("<"):
            continue
        code = f" ({fr.line.strip()})" if fr.line else ""
        return f"{name.replace(_TORCH_DIR, 'torch')}:{fr.lineno}{code}"
    return ""


def _caller_line() -> str:
    """``file:line`` of the innermost calling frame of the user's."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if _users(name):
            return f"{os.path.basename(name)}:{f.f_lineno}"
        f = f.f_back
    return ""


def _source_of(node: fx.Node) -> str:
    st = node.meta.get("stack_trace")
    if not st:
        return ""
    last = ""
    for line in st.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            fname = line[6:line.index('"', 6)]
            if _users(fname):
                lineno = line.split("line ", 1)[1].split(",", 1)[0]
                last = f"{os.path.basename(fname)}:{lineno}"
    return last


def _written_tensors(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensors an op writes in place, from its schema's alias annotations."""
    out = []
    schema_args = func._schema.arguments
    for i in written_args(func):
        val = args[i] if i < len(args) else kwargs.get(schema_args[i].name)
        if isinstance(val, torch.Tensor):
            out.append(val)
        elif isinstance(val, (list, tuple)):
            out.extend(v for v in val if isinstance(v, torch.Tensor))
    return out


@functools.lru_cache(maxsize=None)
def _returns_written_args(func: Any) -> bool:
    """Whether every output of ``func`` is an argument it writes (an in-place or out= op)."""
    rets = getattr(getattr(func, "_schema", None), "returns", ())
    return bool(rets) and all(r.alias_info is not None and r.alias_info.is_write for r in rets)


def _refuse_layout(func: Any, t: torch.Tensor, line: str) -> None:
    """A sparse (or otherwise unstrided) tensor: a program's values, liveness and memory plan are
    strided storages, and the capture would fail further on with torch's own message."""
    raise CaptureError(f"flowexec captures strided tensors only: {func}{' at ' + line if line else ''} takes a "
                       f"{t.layout} tensor of shape {tuple(t.shape)}. nn.Embedding(sparse=True) and "
                       "EmbeddingBag(sparse=True) make sparse gradients: pass sparse=False; run other sparse or "
                       "nested tensors outside the compiled function.")


# torch.tensor(literal)'s own: its argument is the literal's values, made outside the run's ops
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


class _NonDispatchReads(torch.overrides.TorchFunctionMode):
    """Host reads that do not dispatch (``tolist``, ``numpy``, ``__array__``): refused for a
    tensor not made from constants, as ``.item()`` of one is (a real run's answer would be a
    constant of the program: ``x * x.tolist()[0]`` computed with the first call's value)."""

    _READS = (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__)

    def __init__(self, guard: "_CaptureGuard", called: set) -> None:
        super().__init__()
        self.guard = guard
        self.called = called  # (Recorder.torch_functions)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.called.add(func)
        if func in self._READS and args and isinstance(args[0], torch.Tensor):
            if not self.guard.is_constant(self.guard.traced_values(args[0])):
                raise RuntimeError(f"{func.__name__}: data-dependent host read of a tensor whose value can change "
                                   "between calls")
        return func(*args, **(kwargs or {}))


_DEVICE_QUERY = torch.ops.prim.device.default

# ``t.set_(storage, ...)``: a graph cannot hold a storage as an argument. cuDNN's RNNs call it
# on the parameters' storage (their packed weight buffer: ``try_get_weight_buf``, inside
# ``torch.nn.LSTM``/``GRU``/``RNN`` on CUDA), as may fn itself.
_SET_FROM_STORAGE = (torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset)


def _within(t: torch.Tensor, offset: int, size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether the elements of the view (``offset``, ``size``, ``stride``) of ``t``'s storage
    lie among those ``t`` itself spans (non-negative strides: ``set_``'s)."""
    if any(int(n) == 0 for n in size):
        return True
    first, last = int(offset), int(offset) + sum((int(n) - 1) * int(s) for n, s in zip(size, stride))
    low = t.storage_offset()
    high = low + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else low - 1
    return low <= first and last <= high


def _alive_in(refs: dict[int, weakref.ref], t: Any) -> bool:
    """Whether ``refs`` (id -> weak reference) holds ``t`` itself, not a dead object whose id
    ``t`` took over."""
    ref = refs.get(id(t))
    return ref is not None and ref() is t


class _CaptureGuard(TorchDispatchMode):
    """Sits above make_fx's proxy mode during the capture run.

    It keeps an undo log of pre-existing tensors before their first in-place write, and
    remembers which tensors were created by the run (to find the ones that escape).
    """

    def __init__(self, lifter: Lifter | None = None) -> None:
        super().__init__()
        self.lifter = lifter
        self.undo = HostSnapshot(device_room=DeviceRoom(open=False))
        self._saved: set[tuple[int, int, tuple, tuple]] = set()
        self.created: dict[int, weakref.ref] = {}
        self.placeholders: list[weakref.ref] = []  # the graph's inputs (fn's tensors and the gradients)
        # Storages the run allocated: address -> a tensor the run made there, weakly (a storage
        # that existed before the run keeps its address while the run holds it). A view the run
        # made of a tensor that existed before, such as ``buf.view(-1)[:2]``, is created but its
        # memory is not: a write through it must be undone. An address counts as the run's only
        # while that tensor lives: once freed it may hold other memory (a gradient parked before
        # the run and brought back there, whose writes must be undone).
        self.created_storages: dict[int, weakref.ref] = {}
        self.leaves: dict[int, weakref.ref] = {}
        self.grads0: dict[int, Any] = {}  # id(leaf) -> its .grad when the run first used it
        self.sources: list[tuple[Any, str]] = []  # (op, "file:line") in dispatch order
        # Tensors the run made from constants alone (factories, then ops on such tensors): the
        # only ones whose host read has the same answer on every call. id -> the tensor, weakly;
        # and their ids by storage (storage_id), since a write of the call's values into a
        # storage ends every view of it being one (``mask[:3] = x[:3] > 0`` then ``mask.all()``:
        # the call's value, not the capture's). (Not a set of written storages: a freed one's
        # address comes back for a new storage, whose constants it would have refused.)
        self.constant: dict[int, weakref.ref] = {}
        self._constants_on: dict[int, list[int]] = {}
        self.draws = DrawRanges()  # random draws' intervals, and the comparisons they settle
        self.read_under_flag = False  # torch.compiler.is_compiling() at the last host read
        self.parked = ParkedGrads({})  # last step's gradients, in host memory until an op reads them
        # A fake run (FLOWEXEC_FAKE_CAPTURE) writes no real tensor, so it keeps no undo log; the
        # tensors it makes from constants alone get a real twin (id -> tensor), which answers
        # their host reads as eager would.
        self.fake = False
        self.shadows: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(fake) -> (the fake, weakly; its twin)
        # The real twins fn was handed in place of fake integer and boolean tensors made from
        # constants (:meth:`_fold`): id(twin) -> (twin, held weakly: fn's alone; its fake, which
        # the graph traces wherever fn passes the twin to an op)
        self.folded: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        # id(fake) -> (the fake, its twin), both weakly: an id is looked up only with the fake's
        # identity checked, since a dead fake's id is reused by a later one (a stale entry then
        # kept a new fake's twin from being recorded, or answered its host read with another's)
        self._folded_twins: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._folded_storages: set[int] = set()  # their fakes' (storage_id)
        self.backward_seen = False  # an op of an autograd backward has run (snapshot.DeviceRoom.open)
        # torch.Generator objects of fn's own that random ops draw from: id -> (generator, its
        # state at the first draw, its state after the last). The default generators are saved
        # and put back whole (_rng_states); these are put back by restore().
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor, torch.Tensor]] = {}
        self.log: OpLog | None = None  # (flowexec.op_log: the ops in dispatch order, by role)
        self.lines = True  # each op's source line (a replay, which makes no program, finds none)

    def is_created(self, t: torch.Tensor) -> bool:
        return _alive_in(self.created, t)

    def _run_owns_memory_of(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is the run's own (:attr:`created_storages`): none to undo."""
        key = storage_key(t)
        if key == 0:  # (no storage of its own: nothing to undo)
            return True
        held = self.created_storages.get(key)
        made = None if held is None else held()
        return made is not None and storage_id(made) == storage_id(t)

    def is_constant(self, t: torch.Tensor) -> bool:
        return _alive_in(self.constant, t)

    def _make_constant(self, t: torch.Tensor) -> None:
        self.constant[id(t)] = weakref.ref(t)
        self._constants_on.setdefault(storage_id(t), []).append(id(t))

    def _written_with_call_values(self, t: torch.Tensor) -> None:
        """No tensor on ``t``'s memory is a constant any more (its views and base: one memory)."""
        self.constant.pop(id(t), None)
        where = storage_id(t)
        for k in self._constants_on.pop(where, ()):
            ref = self.constant.get(k)
            c = None if ref is None else ref()
            if c is not None and storage_id(c) == where:  # (a live one: on this very storage)
                del self.constant[k]

    def _tensor_on(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """The tensor that ``set_(storage, offset, size, stride)`` makes of ``storage``: where a
        value of the run or an input is on that storage, ``as_strided`` of it (a graph op, so
        each call views its own memory); else it is fn's state (the parameters', for cuDNN), and
        the view is state that the program reads in place, as it reads a parameter."""
        t, storage = args[0], args[1]
        if func is torch.ops.aten.set_.source_Storage:
            offset, size, stride = 0, [storage.nbytes() // t.element_size()], []
        else:
            bound = dict(zip(("storage_offset", "size", "stride"), args[2:]), **kwargs)
            offset, size, stride = bound["storage_offset"], list(bound["size"]), list(bound.get("stride", []))
        stride = stride or list(make_contiguous_strides_for(size))  # (set_'s default)
        on = [o for ref in itertools.chain(self.created.values(), self.placeholders)
              if (o := ref()) is not None and storage_id(o) == storage._cdata]
        owner = next((o for o in on if o.dtype == t.dtype), None)
        if owner is None and on:
            raise RuntimeError(f"{func}: a storage that no tensor of dtype {t.dtype} of the run is on")
        if owner is None and storage.device.type != "meta" and storage.data_ptr() not in self.created_storages:
            with _disable_current_modes():  # (fn's state; a fake run takes it for a constant)
                owner = torch.empty(0, dtype=t.dtype, device=storage.device).set_(storage)
        if owner is None:  # (the run's memory, with no tensor of it left to view it through)
            raise RuntimeError(f"{func}: a storage of the run that no live tensor is on")
        if any(owner is ref() for ref in self.placeholders) and (func is torch.ops.aten.set_.source_Storage
                                                                 or not _within(owner, offset, size, stride)):
            # (an argument's storage beyond the argument: its size is no part of a call's signature)
            raise RuntimeError(f"{func}: a view of an argument's storage past the argument itself; pass the "
                               "tensor, or a view of it")
        return self.__torch_dispatch__(torch.ops.aten.as_strided.default, (type(owner),),
                                       (owner, size, stride, offset))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY:
            # ``t.device`` of a fake tensor (two in three of a fake GPT-2 step's dispatches): it
            # reads no value, writes nothing and makes no node; nor is it the op whose source
            # line the next node takes.
            return func(*args, **(kwargs or {}))
        if func in _SET_FROM_STORAGE:  # recorded as ``set_`` from a tensor on that memory
            return self.__torch_dispatch__(torch.ops.aten.set_.source_Tensor, types,
                                           (args[0], self._tensor_on(func, args, kwargs or {})))
        kwargs = kwargs or {}
        # The graph traces a folded twin's fake: each call makes the value anew. (``passed`` keeps
        # the twins fn passed alive until the op is done: they are held weakly, and this op's
        # shadow run reads them.)
        passed = (args, kwargs)
        if self.folded:
            args, kwargs = self.traced_values(passed)
        if self.parked:
            self.parked.fetch((args, kwargs))
        lifter = self.lifter
        if lifter is not None:
            # A host read of a value computed from lifted hyperparameters: answered, and kept as
            # a guard (flowexec.hyperparams), instead of failing as data-dependent.
            value = lifter.host_read(func, args, kwargs)
            if value is not NO_VALUE:
                if self.log is not None:
                    self.log.read(func, args)
                return value
        if func in _HOST_READS:
            self.read_under_flag = bool(torch.compiler._is_compiling_flag)
            t = args[0] if args else None
            if isinstance(t, torch.Tensor) and not self.is_constant(t):
                settled = self.draws.answer(t)  # (``torch.rand([]) < 0``: every call's answer)
                if settled is not None:
                    if self.log is not None:
                        self.log.read(func, args)
                    return settled
                # make_fx would answer a read of state fn did not make (a step count written in
                # place) with its value now, and the program would keep that value for good.
                raise RuntimeError(f"{func}: a host read of a tensor whose value can change between calls")
            if isinstance(t, torch.Tensor):
                if self.log is not None:
                    self.log.read(func, args)
                # Made from constants alone, its value is every call's: answered here, as eager
                # answers it. (make_fx propagates constants of one element only, and would call
                # the read data-dependent: HF's packed-sequence check on an arange of positions,
                # whose retry under the compiling flag built an explicit causal mask.)
                with _disable_current_modes():
                    return func(*self._real(args), **self._real(kwargs)) if self.fake else func(*args, **kwargs)
        self.sources.append((func, _caller_line() if self.lines else ""))
        written = _written_tensors(func, args, kwargs)
        # Copies of what the run writes may stay on the device only once its backward is over
        # (the optimizer's writes): one made before would sit under the activations to come.
        task = _GRAPH_TASK()
        self.backward_seen = self.backward_seen or task != -1
        self.undo.device_room.open = self.backward_seen and task == -1
        leaves = pytree.tree_leaves((args, kwargs))
        if self.fake:
            # The fake mode writes its fake copies of real arguments, but an op of constants and
            # untraced state runs for real (a CPU step count += 1): only those writes are undone.
            tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
            undone = [t for t in written if not is_fake_tensor(t)] if written and runs_for_real(func, tensors) else []
        else:
            undone = written
        for t in undone:
            if self.is_created(t) and self._run_owns_memory_of(t):
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if key not in self._saved:
                self._saved.add(key)
                with _disable_current_modes():  # the snapshot must not be traced
                    # A device's snapshot stays on it only within the room below the peak the
                    # device has reached (snapshot.DeviceRoom), else waits in host memory: the
                    # parameters and optimizer state cloned beside themselves would make the
                    # capture's optimizer step hold them twice (a large model at a small batch:
                    # above eager's peak).
                    self.undo.save(t)
        arg_ids = set()
        arg_storages = set()
        # (a random draw is no constant, though it reads no tensor)
        from_constants = torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ())
        gens = []  # (a torch.Generator of fn's own that this op draws from)
        for a in leaves:
            if isinstance(a, torch.Tensor):
                if a.layout is not torch.strided:
                    _refuse_layout(func, a, self.sources[-1][1] if self.sources else "")
                arg_ids.add(id(a))
                arg_storages.add(storage_key(a))
                from_constants = from_constants and (func in _LIFTS or self.is_constant(a))
                if a.requires_grad and a.is_leaf and not self.is_created(a):
                    if self.fake and not _alive_in(self.leaves, a):  # (its first use: a dead leaf's id is not its)
                        self.grads0[id(a)] = a.grad
                    self.leaves[id(a)] = weakref.ref(a)
            elif isinstance(a, torch.Generator):
                gens.append(a)
                self._before_draw(a, func)
        if not from_constants and self._folded_storages and any(storage_id(t) in self._folded_storages
                                                                for t in written):
            # (fn holds the twin, which this write would leave stale: a real run decides)
            raise RuntimeError(f"{func} writes values of the call into a tensor made from constants")
        out = func(*args, **kwargs)
        if self.log is not None:
            self.log.op(func, args, kwargs, out)
        self.draws.record(func, args, kwargs, out, written)
        for g in gens:
            first = self.generators[id(g)][1]
            self.generators[id(g)] = (g, first, g.get_state())
        # In-place ops return their argument: that is not a new tensor (nor, in a fake run, the
        # fake copy that stands for a real argument).
        in_place = self.fake and _returns_written_args(func)
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor) and id(o) not in arg_ids and not in_place:
                self.created[id(o)] = weakref.ref(o)
                key = storage_key(o)
                held = self.created_storages.get(key)
                if key not in arg_storages and (held is None or held() is None):  # (the first alive)
                    self.created_storages[key] = weakref.ref(o)
                if from_constants:
                    self._make_constant(o)
        if self.fake and from_constants:
            self._shadow(func, args, kwargs, out)
            out = self._fold(out, in_place)
        if not from_constants:
            for t in written:
                self._written_with_call_values(t)
        if lifter is not None:
            lifter.propagate(func, args, kwargs, out)
        return out

    def shadows_get(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real twin of fake tensor ``t`` (made from constants), or None."""
        hit = self.shadows.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        return self._folded_twin(t)

    def is_folded(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is the fake of a twin fn was handed (:meth:`_fold`)."""
        hit = self._folded_twins.get(id(t))
        return hit is not None and hit[0]() is t

    def _folded_twin(self, t: torch.Tensor) -> torch.Tensor | None:
        """The twin fn was handed for fake ``t``, where it was folded and fn still holds it."""
        return self._folded_twins[id(t)][1]() if self.is_folded(t) else None

    def traced_values(self, tree: Any) -> Any:
        """``tree`` with each folded twin replaced by its fake (what the graph traces)."""
        folded = self.folded

        def fake(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and id(a) in folded:
                ref, f = folded[id(a)]
                if ref() is a:
                    return f
            return a
        if not any(isinstance(a, torch.Tensor) and id(a) in folded for a in pytree.tree_leaves(tree)):
            return tree
        return pytree.tree_map(fake, tree)

    def _real(self, tree: Any) -> Any:
        """``tree`` with each fake tensor replaced by its real twin (a tensor made from constants)."""
        from torch._subclasses.fake_tensor import is_fake

        def real(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and is_fake(a):
                twin = self.shadows_get(a)
                if twin is None:
                    raise RuntimeError("a host read of a tensor with no real value in a fake capture")
                return twin
            return a
        return pytree.tree_map(real, tree)

    def _shadow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Run an op of constants on their real twins, and keep its outputs' twins."""
        try:
            with _disable_current_modes(), torch.no_grad():
                real_out = func(*self._real(args), **self._real(kwargs))
                if func in _LIFTS:  # (its own tensor, not the literal's, which the fake mode keeps)
                    real_out = real_out.clone()
        except Exception:  # (no twin: its host reads fail as data-dependent, and the capture runs for real)
            return
        for o, r in zip(pytree.tree_leaves(out), pytree.tree_leaves(real_out)):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and not self.is_folded(o):
                self.shadows[id(o)] = (weakref.ref(o), r)

    def _fold(self, out: Any, in_place: bool = False) -> Any:
        """``out`` of an op of constants, or where its tensors are all integers or booleans
        (positions, masks, indices), their real twins: fn then holds what an eager run holds.
        Libraries take another path for a fake tensor than for a real one (transformers'
        ``is_tracing``: handed a fake mask of packed sequences, HF models build an explicit
        causal mask, and SDPA leaves its flash kernels: 10% of a GPT-2 step on the H200). The
        graph still traces the fake: an op fn calls on the twin gets the fake
        (:meth:`traced_values`), its shadow run writes the twin, and fn's return value names the
        fake, so each call makes the value anew as eager does. The twin is held weakly: one
        still alive after fn returned, and not returned, is Python state fn kept."""
        if in_place:  # (the written argument: fn gets back what it passed, its twin where folded)
            def passed(o: Any) -> Any:
                twin = self._folded_twin(o) if isinstance(o, torch.Tensor) else None
                return o if twin is None else twin
            return pytree.tree_map(passed, out)
        leaves = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        twins = {id(o): self.shadows_get(o) for o in leaves}
        if not leaves or any(o.dtype.is_floating_point or o.dtype.is_complex or twins[id(o)] is None
                             or twins[id(o)].dtype != o.dtype or twins[id(o)].shape != o.shape for o in leaves):
            return out
        for o in leaves:
            self.shadows.pop(id(o), None)
            r = twins[id(o)]
            self.folded[id(r)] = (weakref.ref(r), o)
            self._folded_twins[id(o)] = (weakref.ref(o), weakref.ref(r))
            self._folded_storages.add(storage_id(o))
            self.created[id(r)] = weakref.ref(r)
            self._make_constant(r)
        return pytree.tree_map(lambda o: twins[id(o)] if isinstance(o, torch.Tensor) else o, out)

    def _before_draw(self, g: torch.Generator, func: Any) -> None:
        """Note ``g``'s state before a draw: its first (restore() puts it back: the capture's
        run must not move a generator of fn's own), or a refusal where something other than a
        recorded draw moved it since the last (``g.manual_seed``, ``g.set_state`` inside fn: a
        compiled call would not repeat that)."""
        state = g.get_state()
        seen = self.generators.get(id(g))
        if seen is None:
            self.generators[id(g)] = (g, state, state)
        elif not torch.equal(seen[2], state):
            line = self.sources[-1][1] if self.sources else ""
            raise CaptureError(f"fn seeds or sets the state of a torch.Generator of its own between its draws (before "
                               f"{func}{' at ' + line if line else ''}): a compiled call would not do that again. Seed "
                               "it outside fn, or draw from torch's default generator (torch.manual_seed inside fn is "
                               "repeated)")

    def restore(self) -> None:
        with _disable_current_modes():
            self.undo.restore()
            for g, first, _ in self.generators.values():
                g.set_state(first)
        self.undo = HostSnapshot(device_room=DeviceRoom(open=False))


def _rng_states() -> tuple[Any, Any]:
    # (the generators themselves: torch.get_rng_state and torch.cuda's become program ops while a
    # capture runs, flowexec/rng.py)
    cuda = ([g.get_state() for g in torch.cuda.default_generators]
            if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    return torch.default_generator.get_state(), cuda


def _set_rng_states(states: tuple[Any, Any]) -> None:
    torch.default_generator.set_state(states[0])
    for g, state in zip(torch.cuda.default_generators if states[1] is not None else (), states[1] or ()):
        g.set_state(state)


_DATA_DEPENDENT_HINT = (
    "fn reads a tensor's value on the host (.item(), bool(tensor), `if tensor:`, data-dependent "
    "shapes), which one static program cannot capture. Use torch.compile(fn, backend=\"flowexec\"): "
    "its graph breaks run such Python control flow eagerly and the graphs between them through "
    "flowexec."
)


def _optimizer_frame(tb: Any) -> traceback.FrameSummary | None:
    """The frame of torch's optimizers or GradScaler that read a tensor on the host, if the
    read was theirs: their innermost frame, where no user frame lies deeper in the traceback.
    (A user's read under them is the user's: a model forward decorated with ``torch.autocast``
    or ``torch.amp.custom_fwd`` runs below a frame of torch/amp/autocast_mode.py, and an LBFGS
    closure below torch/optim/lbfgs.py.)"""
    frames = traceback.extract_tb(tb)
    lib = [k for k, f in enumerate(frames)
           if "/torch/optim/" in f.filename or "/torch/amp/grad_scaler" in f.filename]
    if not lib:
        return None
    user = [k for k, f in enumerate(frames) if _users(f.filename)]
    if user and user[-1] > lib[-1]:
        return None
    return frames[lib[-1]]


def _rnn_hint(tb: Any) -> str | None:
    """What to do where torch's RNN module read a tensor on the host: a packed sequence's
    lengths (they decide its shapes), or cuDNN's dropout between layers, which seeds a random
    state of its own from the generator on the host after every ``manual_seed``."""
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith(os.path.join("torch", "nn", "modules", "rnn.py")) \
                and frame.f_code.co_name == "forward":
            here, module = frame.f_locals, frame.f_locals.get("self")
            name = type(module).__name__
            if here.get("batch_sizes") is not None:
                return (f"{name} over a PackedSequence: its lengths decide the shapes on the host, which one static "
                        "program cannot capture. Pad the batch to one length (and mask the padding), or compile with "
                        "torch.compile(fn, backend=\"flowexec\").")
            on_cuda = any(getattr(w, "is_cuda", False) for w in getattr(module, "_flat_weights", ()))
            if on_cuda and getattr(module, "dropout", 0) and getattr(module, "training", False):
                return (f"{name}(dropout={module.dropout}) in training on CUDA: cuDNN's dropout between layers "
                        "seeds a random state of its own from the generator (on the host, after every manual_seed), "
                        "which no program can repeat. Set dropout=0 and put nn.Dropout between single-layer RNNs, "
                        "or compile with torch.compile(fn, backend=\"flowexec\").")
        tb = tb.tb_next
    return None


def _host_read_hint(tb: Any) -> str:
    """What to use instead, where a library (not the user) read a tensor on the host."""
    f = _optimizer_frame(tb)
    if f is None:
        rnn = _rnn_hint(tb)
        if rnn:
            return rnn
        frames = traceback.extract_tb(tb)
        if frames and any("/torch/nn/modules/batchnorm.py" in g.filename and "num_batches_tracked" in (g.line or "")
                          for g in frames):
            return ("BatchNorm with momentum=None (a cumulative average) reads num_batches_tracked on the host "
                    "on every step, which one static program cannot capture: give it a momentum (0.1 is torch's "
                    "default), or compile with torch.compile(fn, backend=\"flowexec\").")
        return _DATA_DEPENDENT_HINT
    where = f"torch/{f.filename.rsplit('/torch/', 1)[-1]}:{f.lineno} ({(f.line or '').strip()})"
    if "grad_scaler" in f.filename:
        return (f"torch.amp.GradScaler reads found_inf on the host at {where} for an optimizer that is not "
                "fused: pass fused=True to the optimizer (Adam, AdamW, SGD, Adagrad), whose step takes the scale "
                "and found_inf as tensors, or leave the scaler out of the compiled function.")
    if f.name.startswith("_single_tensor"):
        return (f"the optimizer reads a value computed from its state on the host at {where}, which one static "
                "program cannot capture: pass foreach=True (or fused=True) to the optimizer, whose step keeps "
                "such values on the device.")
    return (f"the optimizer reads a value computed from its state on the host at {where} (in {f.name}: "
            "this optimizer's foreach path reads it too), which one static program cannot capture: call "
            "opt.step() outside the compiled function, or compile with torch.compile(fn, backend=\"flowexec\"), "
            "whose graph breaks run it eagerly.")


class HostReadError(CaptureError):
    """fn (or a library it calls) read a tensor's value on the host during capture;
    ``retry_with_flag``: the read happened with ``torch.compiler.is_compiling()`` false, outside
    GradScaler (which reads whatever the flag says), so a capture with the flag set throughout
    may take a path without it."""

    retry_with_flag = False


@contextlib.contextmanager
def _library_compiling(everywhere: bool) -> Iterator[None]:
    """Tell library code it is being compiled (``torch.compiler.is_compiling()``), inside every
    optimizer step, or (``everywhere``) for the whole capture run.

    Optimizers read that flag to keep step counts and bias corrections on the device instead of
    the host, which one static program needs. Elsewhere the flag changes what libraries run: a
    Hugging Face model builds an explicit causal mask and repeats GQA's keys and values where
    eager passes ``is_causal`` to one attention kernel, work and memory eager does not spend. So
    the capture sets it only inside ``Optimizer.step`` first; :func:`trace` sets it everywhere
    only when that capture read a tensor on the host (the compiled path of such a library avoids
    the read)."""
    prev = torch.compiler._is_compiling_flag
    if everywhere:
        torch.compiler._is_compiling_flag = True
        try:
            yield
        finally:
            torch.compiler._is_compiling_flag = prev
        return
    outer: list[bool] = []  # the flag as each (possibly nested) step found it

    def enter(*_: Any) -> None:
        outer.append(torch.compiler._is_compiling_flag)
        torch.compiler._is_compiling_flag = True

    def leave(*_: Any) -> None:
        torch.compiler._is_compiling_flag = outer.pop() if outer else prev

    hooks = (_optimizer.register_optimizer_step_pre_hook(enter),
             _optimizer.register_optimizer_step_post_hook(leave))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        torch.compiler._is_compiling_flag = prev  # a step that raised skipped its post hook


def trace(fn: Callable[..., Any], args: Sequence[Any], guarded: Guarding = False,
          park: Callable[[torch.Tensor], bool] | None = None, unfused: frozenset[int] = frozenset(),
          make_state: bool = False, first_call: bool = False,
          untouched: bool = False, log_ops: bool = False) -> tuple[fx.GraphModule, list[tuple[torch.Tensor, int]], int, list[tuple[Any, str]], Any, Any]:
    """Run ``fn(*args)`` once under make_fx; return the graph, escaped-grad bindings, output
    count, op sources, the tree of fn's output containers, and what the run read
    (:class:`_Reads`: guards, lifted hyperparameters). ``guarded``: record what the run reads,
    lift optimizer hyperparameters and take existing gradients as inputs (what an
    :class:`~flowexec.Executable` checks and feeds per call); without it the program binds
    whatever fn reads, as a pipeline stage's capture wants; ``"reads"``: that, and also record
    what the run reads (a stage's guards: :func:`read_guards`).

    Library code sees ``torch.compiler.is_compiling()`` inside optimizer steps only, so the
    model runs what eager runs; a run that reads a tensor on the host is traced again with the
    flag set throughout (:func:`_library_compiling`). ``park``: which of the gradients that
    are inputs wait in host memory while fn runs (:mod:`flowexec.parking`; None: none);
    ``unfused``: ids of param groups that step through the foreach path instead of their fused
    kernel (:class:`~flowexec.hyperparams.Lifter`); ``make_state``: a first step's program, whose
    outputs include the state entries the stepped optimizers make (:attr:`Captured.made_state`);
    ``first_call``: fn has not run yet (a prefilled first step; ``make_state`` implies it), so
    lazy state it makes (a GradScaler's scale) is final where the fake run finds it, with no real
    run to find it again. There, and where fn has not run in this process before (``untouched``:
    no eager step and no program of it yet), what a failed run changed in plain objects is put
    back before the next (a GradScaler's record of a step taken, which the next run would
    refuse). (Not on later captures: the record holds the containers fn replaces, a
    GradScaler's per-optimizer dict, and with them the tensors the run put there, which would
    then count as state fn left behind.) ``log_ops``: keep the run's ops by role
    (:class:`~flowexec.op_log.OpLog`, the reads' ``log``), what a kept program's replay is
    checked against.
    """
    everywhere, hooks = False, True
    first_call = first_call or make_state  # (a first step's program is fn's first call too)
    saved = _snapshot(fn, first_call, untouched)
    # A fake run (_FAKE_CAPTURE: the default) computes nothing: no activations held, no undo log
    # of what the step writes. Whatever it cannot do (an op with no fake kernel, a host read of
    # a value it does not have, an argument on closure state's storage), a real run decides.
    fake = guarded is True and (_FAKE_CAPTURE is True or (_FAKE_CAPTURE == "cpu" and not cuda_in_use()))
    why = ""
    for _ in range(4):
        try:
            log = OpLog() if log_ops and fake else None  # (a real run is not kept)
            out = _trace(fn, args, guarded, everywhere=everywhere, park=park, unfused=unfused, saved_hooks=hooks,
                         fake=fake, make_state=make_state, log=log)
            out[-1].run = "fake" if fake else f"real (a fake run could not: {why})" if why else "real"
            if log is not None:
                log.flags = (everywhere, hooks)
                out[-1].log = log
            return out
        except Exception as e:
            if saved is not None:
                put_back_attributes(saved)
            if isinstance(e, LazyStateError) and (not fake or first_call):
                raise
            if fake and isinstance(e, HostReadError) and e.retry_with_flag and not everywhere:
                everywhere = True  # (as a real run would be retried: the fake one first)
            elif fake:
                fake = False
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            elif isinstance(e, HostReadError):
                if not e.retry_with_flag or everywhere:
                    raise
                everywhere = True
            elif isinstance(e, CaptureError) and hooks and _NO_SAVED_HOOKS in str(e):
                # torch.func's grad and vjp refuse to run under saved-tensor hooks, which only
                # tell tensors an autograd graph saved from state fn left behind: traced again without.
                hooks = False
            else:
                raise
        # The failed run's frames (held in a cycle through its traceback) still hold its tensors
        # and references to the gradients, which would stop them being parked: collected first.
        gc.collect()
    raise AssertionError("unreachable")


_NO_SAVED_HOOKS = "don't yet support saved tensor hooks"
# Unset or "1": every capture fake where it can be; "0": none (every capture runs fn for real);
# "cpu": those of a process that has not started CUDA (the default until the CUDA tests passed
# with the fake capture on an H100, 2026-12-05).
_FAKE_CAPTURE_CHOICES: dict[str, bool | str] = {"1": True, "": True, "0": False, "cpu": "cpu"}
_fake_setting = os.environ.get("FLOWEXEC_FAKE_CAPTURE", "1")
if _fake_setting not in _FAKE_CAPTURE_CHOICES:
    raise ValueError(f"FLOWEXEC_FAKE_CAPTURE={_fake_setting!r}: expected 1 (the default), 0 or cpu")
_FAKE_CAPTURE: bool | str = _FAKE_CAPTURE_CHOICES[_fake_setting]


def fake_capture_setting() -> bool | str:
    """Whether captures run on fake tensors (``FLOWEXEC_FAKE_CAPTURE``: True, False or "cpu")."""
    return _FAKE_CAPTURE


class _FakeAliasing(CaptureError):
    """A fake run read closure state on an argument's storage: its fake copy of the state
    stood for the argument, which a real run keeps apart."""


@contextlib.contextmanager
def _fx_tracing() -> Iterator[None]:
    """torch.fx's tracing flag, as make_fx's trace sets it (library code may read it:
    ``torch.fx._symbolic_trace.is_fx_tracing()``)."""
    from torch.fx import _symbolic_trace

    prev = _symbolic_trace._is_fx_tracing_flag
    _symbolic_trace._is_fx_tracing_flag = True
    try:
        yield
    finally:
        _symbolic_trace._is_fx_tracing_flag = prev


def _snapshot(fn: Callable[..., Any], first_call: bool, untouched: bool) -> list[tuple[Any, Any]] | None:
    """What a run that may be discarded puts back of plain objects (:func:`object_attributes`):
    on fn's first call, or one where fn has not run in this process. (Not on later calls: the
    snapshot would hold the containers fn replaces, a GradScaler's per-optimizer dict, and the
    tensors the run put there would count as state fn left behind.)"""
    return object_attributes(fn) if first_call or untouched else None


def _settle_reads(rec: Recorder) -> Any:
    """After a run: the guards of objects that did not outlive it dropped, the assignments to
    repeat after each call, and a :class:`CaptureError` where fn changed Python state a compiled
    call cannot."""
    rec.drop_gone()
    replays = rec.replays()  # (lists tensors fn assigns to globals among module_tensor_writes)
    _refuse_lost_writes(rec)
    return replays


def _trace(fn: Callable[..., Any], args: Sequence[Any], guarded: Guarding, everywhere: bool,
           park: Callable[[torch.Tensor], bool] | None = None, unfused: frozenset[int] = frozenset(),
           saved_hooks: bool = True, fake: bool = False, make_state: bool = False, log: OpLog | None = None,
           replay: bool = False, hold: Sequence[torch.Tensor] = ()) -> tuple[fx.GraphModule | None, list[tuple[torch.Tensor, int]], int, list[tuple[Any, str]], Any, Any]:
    # replay: fn runs under the capture's modes on fake tensors with no make_fx and no graph (a
    # kept program's check, :func:`replay`), and whatever it changed is put back as after a
    # failed capture
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    bindings: list[tuple[torch.Tensor, int]] = []
    fed = guarded is True  # hyperparameters lifted, gradients as inputs
    recorder = Recorder(fn, active=bool(guarded))
    lifter = Lifter(recorder.name_of, active=fed, unfused=unfused)
    guard = _CaptureGuard(lifter if fed else None)
    guard.log = log
    guard.lines = not replay
    if log is not None:
        log.lifted = lifter.slot_of
    n_user = [0]
    out_tree: list[Any] = [None]
    made: list[tuple[torch.optim.Optimizer, Any, str, int]] = []  # make_state: (optimizer, param, key, output)
    # The .grad each parameter fn reaches has now is an input of the program, read at each call:
    # gradient accumulation makes a new one per cycle (zero_grad sets None), which a binding to
    # this tensor object would miss.
    grad_params = recorder.grad_inputs() if fed else ()
    # (decided before make_fx holds them: the recorder's is the one reference known here)
    parkable = tuple(p for p in grad_params if park is not None and p.grad.layout is torch.strided
                     and held_by_grad_alone(p, known=1) and park(p.grad))

    guard.fake = fake
    if fake:
        lifter.real_of = guard.shadows_get  # (dropped after the run: the lifter outlives the guard)
        register_fake_optimizer_kernels()
        parkable = ()  # (a fake run allocates no activations: the gradients can stay)

    def traced(*tensors: torch.Tensor) -> Any:
        guard.placeholders = [weakref.ref(t) for t in tensors]
        if log is not None:
            log.inputs(tensors)
        if fake:  # fn reaches the gradients through p.grad: the fake placeholders stand there
            for p, g in zip(grad_params, tensors[len(tensor_pos):]):
                p.grad = g
        tensors = tensors[:len(tensor_pos)]  # (the rest: the gradients, reached through p.grad)
        full = list(args)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        # Tensors autograd saved, weakly: one freed by a backward leaves its id to a later tensor,
        # which an id alone would take for it (and not refuse as state fn kept).
        saved: dict[int, weakref.ref] = {}
        # (parked once make_fx has made their placeholders: it reads their metadata only)
        guard.parked = ParkedGrads.park(p.grad for p in parkable)

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[id(t)] = weakref.ref(t)
            return t

        hooked = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if saved_hooks else contextlib.nullcontext()
        with guard, hooked, recorder, lifter, lifter.rewrite_mode(), _NonDispatchReads(guard, recorder.torch_functions):
            out = fn(*full)
        # The graph returns a flat list: fn's containers (dict, namedtuple, ...) are rebuilt
        # around the outputs per call, so the graph never records their constructors.
        try:
            out_tree[0], flat = output_tree(out)
        except InputError as e:
            raise CaptureError(f"fn returned something flowexec cannot hand back: {e}") from None
        n_user[0] = len(flat)
        returned = list(flat)  # (a folded twin fn returns: the graph returns its fake)
        flat = list(guard.traced_values(flat))
        out_ids = {id(o) for o in flat} | {id(o) for o in returned}
        extra = []
        for ref in guard.leaves.values():
            p = ref()
            g = None if p is None else p.grad
            if g is not None and guard.is_created(g) and id(g) not in out_ids:
                bindings.append((p, len(flat) + len(extra)))
                extra.append(g)
                out_ids.add(id(g))
        # The base of a returned view (a gradient that autograd made as t() of a temporary) is
        # held by that view, not left in Python state.
        out_bases = {id(o._base) for o in flat + returned if isinstance(o, torch.Tensor) and o._base is not None}

        def left_behind() -> list[torch.Tensor]:
            return [t for r in guard.created.values()
                    if (t := r()) is not None and id(t) not in out_ids and not _alive_in(saved, t)
                    and guard.is_created(t) and not any(t is a for a in tensors)
                    and not guard.is_folded(t)  # (a folded twin's fake: held by the guard)
                    and (t._base is None or id(t._base) not in out_ids) and id(t) not in out_bases]

        if make_state:  # the optimizers' new state entries are outputs, bound by the caller after the run
            position = {id(o): i for i, o in enumerate(flat + extra)}
            for opt, param, key, t in _new_state(lifter, guard):
                t = guard.traced_values(t)  # (a folded twin: the graph makes its fake)
                if id(t) not in position:
                    position[id(t)] = len(flat) + len(extra)
                    extra.append(t)
                    out_ids.add(id(t))
                made.append((opt, param, key, position[id(t)]))
        escaped = left_behind()
        if escaped:  # garbage in reference cycles (a model's output object, its KV cache) is no state
            del escaped
            gc.collect()
            escaped = left_behind()
        if escaped:
            desc = ", ".join(str(TensorMeta.of(t)) for t in escaped[:3])
            raise LazyStateError(
                f"fn left {len(escaped)} tensor(s) it created in Python state outside its return value "
                f"(first: {desc}). A compiled program would recreate them on every call, so that state would "
                "silently stop updating. flowexec runs the first call eagerly so that state made on a first step "
                "(optimizer moments) exists before capture; state made anew on every call cannot be captured: "
                "keep it in tensors written in place, or return it from fn.")
        if log is not None:
            log.result(flat + extra)
        return flat + extra

    # (no record_stack_traces: each op's source line comes from _CaptureGuard, at a fraction of
    # the cost of a symbolized traceback per node)
    kw: dict[str, Any] = {}
    rng = _rng_states()
    install_rng_ops(lambda: _capture_mode() is not None)  # (once: the generators' state as program ops)
    failed = True
    grads0 = [p.grad for p in grad_params] if fake else []
    try:
        # make_fx stores a fake copy of every value in its node's meta; with no fake mode to find
        # it builds a FakeTensorMode per value, each recording its creation stack (half the
        # capture's time on a small model). One mode, in a tracing context, serves them all.
        # (a fake run takes no fallback kernel: it would run the real op on real arguments)
        mode = FakeTensorMode(allow_fallback_kernels=not fake, allow_non_fake_inputs=fake)
        context = torch._guards.TracingContext(mode)
        real_inputs = [*[args[i] for i in tensor_pos], *[p.grad for p in grad_params]]
        if fake:
            kw = {"tracing_mode": "fake", "_allow_non_fake_inputs": True}
            real_inputs = [mode.from_tensor(t) for t in real_inputs]
        with _library_compiling(everywhere), torch._guards.tracing(context), _direct_fake_metas(mode), \
                quiet_fake_mode(fake):
            if replay:  # (what make_fx sets around fn, but its graph)
                # The fake mode keeps its fakes of real tensors weakly: a foreach optimizer's
                # step made one of each parameter again at every op. The state's are held.
                held = [mode.from_tensor(t) for t in hold]
                with mode, disable_autocast_cache(), _fx_tracing():
                    traced(*real_inputs)
                del held
                _settle_reads(recorder)  # (a capture now would refuse what it refuses)
                gm = None
            else:
                gm = make_fx(traced, **kw)(*real_inputs)
        if gm is not None and not fake and any(is_fake_tensor(getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"):
            raise CaptureError("fn reads a fake tensor kept in Python state (a cache, such as functools.lru_cache "
                               "or a dict, that a capture's run on fake tensors filled): make the cached tensor "
                               "before the first compiled call, or set FLOWEXEC_FAKE_CAPTURE=0")
        if gm is not None and fake:
            inputs = {storage_key(args[i]) for i in tensor_pos} | {storage_key(g) for g in grads0}
            consts = (getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr")
            if any(isinstance(c, torch.Tensor) and storage_key(c) in inputs - {0} for c in consts):
                raise _FakeAliasing("closure state on an argument's storage")
        failed = replay  # (a replay is put back as a discarded capture is)
    except CaptureError:
        raise
    except Exception as e:
        where = user_frame(e.__traceback__) or _library_frame(e.__traceback__)
        msg = str(e).split("\n", 1)[0]
        if "_local_scalar_dense" in msg or "data-dependent" in msg.lower() or "Data dependent" in msg:
            err = HostReadError(f"cannot capture fn: at {where or '<unknown>'}: {_host_read_hint(e.__traceback__)}")
            reader = _optimizer_frame(e.__traceback__)
            err.retry_with_flag = not guard.read_under_flag and not (reader and "grad_scaler" in reader.filename)
            raise err from e
        hint = _rnn_hint(e.__traceback__)  # (cuDNN's dropout state: its generator is no graph argument)
        raise CaptureError(f"cannot capture fn: {type(e).__name__}: {msg} (at {where or '<unknown>'})"
                           f"{': ' + hint if hint else ''}") from e
    finally:
        settled = False
        try:
            lifter.restore()
            guard.restore()
            _set_rng_states(rng)
            # Gradients are left as fn found them (fn may have set them to None and made new ones);
            # those fn leaves None (zero_grad after the step) are cleared after each call too.
            cleared = tuple(p for p, g0, _ in recorder.grads.values() if g0 is not None and p.grad is None)
            for p, g0, _ in recorder.grads.values():
                if p.grad is not g0:
                    p.grad = g0
            for p, _ in bindings:
                if id(p) not in recorder.grads:
                    p.grad = None
            if fake:  # no fake gradient is left on a real parameter (the backward's, or a placeholder)
                before = {id(p): (p, g) for p, g in zip(grad_params, grads0)}
                for key, ref in guard.leaves.items():
                    if (p := ref()) is not None:
                        before.setdefault(key, (p, guard.grads0.get(key)))
                for p, g0 in before.values():
                    if is_fake_tensor(p.grad):
                        p.grad = None if is_fake_tensor(g0) else g0
                guard.grads0.clear()  # (held no longer than the run: a gradient the step discards is freed)
                lifter.real_of = lambda t: None
            settled = not failed
            if log is not None:  # (the lifter, and through it the recorder, live no longer than the run)
                log.lifted = lambda t: None
        finally:
            # A failed capture gives its parked gradients back (once the run's own are let go:
            # both sets at once would peak above eager); a good one hands on those no op read.
            if not settled:
                guard.parked.restore()
        if failed:  # a discarded capture leaves Python state as it found it
            lifter.restore_state()
            recorder.undo_writes()
        elif made:  # the run's state (fake, or to be made again by the program) goes
            lifter.restore_state()
    return gm, bindings, n_user[0], guard.sources, out_tree[0], _Reads(recorder, lifter, guard.leaves, grad_params,
                                                                       cleared, guard.parked, made=tuple(made))


@dataclass
class _Reads:
    """What a capture run read, for :func:`guards_of`; ``grad_params``: the parameters whose
    ``.grad`` follows the call's tensors among the program's inputs."""

    recorder: Recorder
    lifter: Lifter
    leaves: dict[int, weakref.ref]
    grad_params: tuple[torch.Tensor, ...] = ()
    cleared_grads: tuple[torch.Tensor, ...] = ()  # parameters fn leaves with .grad None
    parked: ParkedGrads = field(default_factory=lambda: ParkedGrads({}))  # gradients no op read
    run: str = "real"  # Captured.run
    made: tuple[tuple[Any, Any, str, int], ...] = ()  # Captured.made_state
    log: OpLog | None = None  # Captured.log


def _new_state(lifter: Lifter, guard: Any) -> list[tuple[torch.optim.Optimizer, Any, str, torch.Tensor]]:
    """The entries the stepped optimizers' state gained during the run, in the order they were
    made: (optimizer, parameter, key, tensor). A :class:`LazyStateError` where one is not a
    tensor the run created (a program cannot make a Python number, nor a tensor it did not)."""
    out = []
    for opt, before in lifter.state_snapshots.values():
        for param, entries in opt.state.items():
            old = before.get(param, {})
            for key, value in entries.items():
                if key in old and old[key] is value:
                    continue
                if not (isinstance(value, torch.Tensor) and guard.is_created(value)):
                    raise LazyStateError(f"{type(opt).__name__}'s first step made state entry {key!r} as "
                                         f"{type(value).__name__}, which a program cannot make")
                out.append((opt, param, key, value))
    return out


def capture(fn: Callable[..., Any], args: Sequence[Any], guarded: Guarding = False,
            park: Callable[[torch.Tensor], bool] | None = None, unfused: frozenset[int] = frozenset(),
            make_state: bool = False, first_call: bool = False, untouched: bool = False,
            log_ops: bool = False) -> Captured:
    """Trace ``fn`` on ``args`` (flat: tensors and scalars) and convert the graph into a Program.
    The program's inputs are the tensors of ``args``, then (``guarded=True``) ``p.grad`` for
    each parameter of ``Captured.grad_inputs``; ``guarded`` also records its guards
    (:func:`trace`; ``"reads"``: only what the run read, :func:`read_guards`; ``park``,
    ``unfused``, ``make_state``, ``first_call`` and ``log_ops``: see :func:`trace`)."""
    gm, bindings, n_user, sources, out_tree, reads = trace(fn, args, guarded, park, unfused, make_state, first_call,
                                                           untouched, log_ops)
    _warn_fast_paths(sources)
    try:
        return _captured(gm, bindings, n_user, sources, out_tree, reads, args, guarded)
    except BaseException:
        reads.parked.restore()
        raise


def _warn_fast_paths(sources: Sequence[tuple[Any, str]]) -> None:
    """Say where torch took another path under the capture than eager takes: TransformerEncoder's
    nested-tensor fast path (eval, a padding mask) does not run under make_fx (nor under
    torch.compile), and its other path computes the padded positions where eager returns zeros."""
    for func, line in sources:
        if func is torch.ops.aten._nested_tensor_from_mask_left_aligned.default:
            warnings.warn(f"flowexec: at {line or '<unknown>'}, nn.TransformerEncoder's nested-tensor fast path (eval, "
                          "src_key_padding_mask) does not run under capture (nor under torch.compile): the program "
                          "computes the padded positions, where eager returns zeros. Mask them yourself, or build "
                          "the encoder with enable_nested_tensor=False so that eager does the same.", stacklevel=4)
            return


def _captured(gm: fx.GraphModule, bindings: list[tuple[torch.Tensor, int]], n_user: int, sources: Any,
              out_tree: Any, reads: _Reads, args: Sequence[Any], guarded: Guarding) -> Captured:
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if guarded is not True:  # (no gradient is an input, so none was parked)
        prog = program_from_graph(gm, [args[i] for i in tensor_pos], sources)
        return Captured(prog, bindings, n_user, out_tree, read_guards(reads, prog) if guarded == "reads" else None)
    feeds = _bind_feeds(gm, reads.lifter)
    read, discarded = _drop_unread_grads(gm, len(tensor_pos), reads.grad_params,
                                         {id(p) for p, _ in bindings} | {id(p) for p in reads.cleared_grads})
    # (a gradient dropped before the run need not be cleared again after it)
    gone = {id(p) for p in discarded}
    reads = replace(reads, cleared_grads=tuple(p for p in reads.cleared_grads if id(p) not in gone))
    # A parked gradient no op read and the program discards stays parked for the caller; one fn
    # neither read nor replaced comes back.
    reads.parked.restore(keep={id(p.grad) for p in discarded if p.grad is not None})
    prog = program_from_graph(gm, [args[i] for i in tensor_pos] + [p.grad for p in read], sources)
    return Captured(prog, bindings, n_user, out_tree, guards_of(reads, prog, feeds), read, discarded,
                    reads.parked, reads.run, reads.made, tuple(reads.recorder.user_codes()), reads.log)


@dataclass
class Replayed:
    """What :func:`replay` saw fn do: its ops by role, the escaped gradients and made state
    with their output positions, its output containers, the names of what it read, and the
    parameters whose ``.grad`` it left None."""

    log: OpLog
    grad_bindings: list[tuple[torch.Tensor, int]]
    n_user_outputs: int
    out_tree: Any
    made_state: tuple[tuple[Any, Any, str, int], ...]
    read_names: frozenset[str]
    cleared_grads: tuple[torch.Tensor, ...]
    seconds: float  # (how long the run took)


def replay(fn: Callable[..., Any], args: Sequence[Any], flags: tuple, unfused: frozenset[int] = frozenset(),
           make_state: bool = False, first_call: bool = False, untouched: bool = False,
           hold: Sequence[torch.Tensor] = ()) -> Replayed:
    """Run ``fn(*args)`` as a fake capture runs it (the same modes, hooks and lifted
    hyperparameters; ``flags``: the kept capture's :attr:`OpLog.flags`) but with no ``make_fx``
    and no graph, logging its ops (:class:`~flowexec.op_log.OpLog`), and put back everything
    it changed, as after a discarded capture (plain objects' attributes where :func:`trace` puts
    them back: ``first_call``, ``untouched``). A kept program is taken only where this log is the
    one its capture kept (flowexec/kept.py). ``hold``: the state tensors the run reads (the kept
    log's), whose fakes are made once for the whole run. Raises what a capture would raise.

        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> seen = replay(lambda x: (x * w).sum(), (torch.ones(2),), (False, True))
        >>> [e[0] for e in seen.log.entries]
        ['aten.mul.Tensor', 'aten.sum.default', 'out']
        >>> w.grad is None
        True
    """
    t0 = time.perf_counter()
    everywhere, hooks = flags
    saved = _snapshot(fn, first_call or make_state, untouched)
    log = OpLog()
    try:
        _, bindings, n_user, _, out_tree, reads = _trace(fn, args, True, everywhere=everywhere, saved_hooks=hooks,
                                                         unfused=unfused, fake=True, make_state=make_state, log=log,
                                                         replay=True, hold=hold)
    finally:
        if saved is not None:
            put_back_attributes(saved)
    names = frozenset(g.name for g in reads.recorder.guards.values())
    return Replayed(log, bindings, n_user, out_tree, reads.made, names, reads.cleared_grads,
                    time.perf_counter() - t0)


def _drop_unread_grads(gm: fx.GraphModule, n_args: int, grad_params: Sequence[torch.Tensor],
                       replaced: set[int]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(the parameters whose ``.grad`` the program reads, those whose ``.grad`` it neither reads
    nor keeps): a gradient input with no use leaves the graph's inputs, so that no call passes it
    and graph mode neither copies it in nor keeps a buffer for it. ``replaced``: the ids of the
    parameters whose ``.grad`` fn replaced or left None."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][n_args:]
    read, discarded = [], []
    for p, node in zip(grad_params, placeholders):
        if node.users:
            read.append(p)
            continue
        gm.graph.erase_node(node)
        if id(p) in replaced:
            discarded.append(p)
    # (no gm.recompile(): the program is read from the graph's nodes, and the module's Python
    # code, 0.2 s for a 2,000-node step, is never run)
    return tuple(read), tuple(discarded)


def _bind_feeds(gm: fx.GraphModule, lifter: Lifter) -> Any:
    """The lifted hyperparameters the graph reads, re-bound to views of one packed buffer per
    device (what :class:`~flowexec.hyperparams.Feeds` refreshes before each call)."""
    consts = [(n.target, getattr(gm, n.target)) for n in gm.graph.nodes if n.op == "get_attr"]
    feeds, rebind = lifter.feeds([t for _, t in consts if isinstance(t, torch.Tensor)])
    for name, t in consts:
        if isinstance(t, torch.Tensor) and id(t) in rebind:
            setattr(gm, name, rebind[id(t)])
    return feeds


def guards_of(reads: _Reads, prog: Program, feeds: Any) -> GuardSet:
    """The guards of a captured program: what the run read (flowexec.guards), the parameters'
    ``requires_grad`` and ``.grad``, the stepped optimizers' settings that are not fed, and
    the global state; refuses a run that changed what it read."""
    rec, lifter = reads.recorder, reads.lifter
    replays = _settle_reads(rec)
    stepped = [p for opt in lifter.optimizers for g in opt.param_groups for p in g["params"]]
    _use_leaves(reads)
    rec.tensor_guards(prog.state.values(), stepped)
    for opt in lifter.optimizers:
        for g in optimizer_guards(opt, rec.name_of(opt, type(opt).__name__), lifter.lifted_keys(opt)):
            rec.add(g)
    for g in (*hook_guards(), *library_function_guards(rec.torch_functions)):
        rec.add(g)
    rec.add(state_guard())
    return GuardSet(tuple(rec.guards.values()), feeds, replays, reads.cleared_grads, tuple(rec.unguarded))


def read_guards(reads: _Reads, prog: Program) -> GuardSet:
    """The guards of a program that binds what fn reads (a pipeline stage's: its caller writes
    the gradients and steps the optimizers): the Python values the run read (``training``
    flags, module attributes, numbers in closures and globals), the ``requires_grad`` of the
    parameters it used, and the global state; and the Python assignments the run made, for the
    caller to repeat after each call (:meth:`~flowexec.guards.GuardSet.replay`). Nothing is fed;
    refuses what :func:`guards_of` refuses."""
    rec = reads.recorder
    replays = _settle_reads(rec)
    _use_leaves(reads)
    rec.tensor_guards(prog.state.values(), (), grads=False)
    for g in (*hook_guards(), *library_function_guards(rec.torch_functions)):
        rec.add(g)
    rec.add(state_guard())
    return GuardSet(tuple(rec.guards.values()), None, replays, unguarded=tuple(rec.unguarded))


def _use_leaves(reads: _Reads) -> None:
    for t in [t for r in reads.leaves.values() if (t := r()) is not None]:
        reads.recorder.use_leaf(t)


def _refuse_lost_writes(rec: Recorder) -> None:
    """A capture error where fn changed Python state that a compiled call cannot change."""
    if rec.module_tensor_writes:
        raise CaptureError(
            f"fn assigns tensors to Python names ({', '.join(rec.module_tensor_writes[:3])}): a compiled call "
            "cannot re-bind Python attributes or variables. Write into the existing tensor in place (copy_), or "
            "return the tensor from fn.")
    changed = rec.changed_during_run()
    if changed:
        raise CaptureError(
            f"fn changes a Python value it reads ({'; '.join(changed[:3])}): a compiled call runs no Python, so "
            "that change would be lost, and the next call would find another value. Keep such state in a tensor "
            "updated in place, or change it outside the compiled function.")


def program_from_graph(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None,
                       sources: Sequence[tuple[Any, str]] = ()) -> Program:
    """Convert an ATen-level FX graph (make_fx or AOTAutograd output) into a Program.

    Placeholders become inputs, ``get_attr`` tensors become state bound by reference,
    ``getitem`` on multi-output ops folds into the producing op, profiler markers are dropped.
    """
    lower_rng_hops(gm)  # (AOTAutograd's checkpointed draws: flowexec/rng.py)
    flatten_list_returns(gm)  # (a tuple holding lists: cuDNN's RNN backward)
    values: list[Value] = []
    env: dict[fx.Node, Any] = {}  # node -> Ref | constant | ("multi", op_pos)
    ops: list[dict[str, Any]] = []
    inputs: list[int] = []
    state: dict[int, torch.Tensor] = {}
    consts: dict[int, Any] = {}
    example_inputs = list(example_inputs) if example_inputs is not None else None

    def new_value(role: Role, meta: TensorMeta | None, name: str) -> int:
        values.append(Value(len(values), role, meta, name))
        return len(values) - 1

    def meta_of(node: fx.Node) -> TensorMeta | None:
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            shape = tuple(int(s) for s in v.shape)
            try:
                stride: tuple[int, ...] | None = tuple(int(s) for s in v.stride())
            except Exception:  # sparse and other layouts without strides
                stride = None
            try:
                return TensorMeta(v.dtype, shape, v.device, v.untyped_storage().nbytes(), stride)
            except Exception:  # fake/symbolic storage sizes
                numel = 1
                for s in v.shape:
                    numel *= int(s)
                return TensorMeta(v.dtype, shape, v.device, numel * v.element_size(), stride)
        return None

    def lookup(a: Any) -> Any:
        if isinstance(a, fx.Node):
            r = env[a]
            if isinstance(r, tuple) and r and r[0] == "multi":
                raise CaptureError(f"node {a.name} returns several values but is used whole")
            return r
        if isinstance(a, (list, tuple)):
            return [lookup(x) for x in a] if isinstance(a, list) else tuple(lookup(x) for x in a)
        if isinstance(a, dict):
            return {k: lookup(v) for k, v in a.items()}
        return a

    src_pos = 0

    def source_for(node: fx.Node) -> str:
        # The capture run saw ops in the order the graph records them: match by op, looking a
        # few entries ahead in case a dispatch did not become a node.
        nonlocal src_pos
        for j in range(src_pos, min(src_pos + 4, len(sources))):
            if sources[j][0] is node.target:
                src_pos = j + 1
                return sources[j][1]
        return _source_of(node)

    n_placeholder = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            meta = meta_of(node)
            if meta is None and example_inputs is not None and isinstance(example_inputs[n_placeholder], torch.Tensor):
                meta = TensorMeta.of(example_inputs[n_placeholder])
            vid = new_value(Role.INPUT, meta, node.name)
            inputs.append(vid)
            env[node] = Ref(vid)
            n_placeholder += 1
        elif node.op == "get_attr":
            obj = getattr(gm, node.target)
            if isinstance(obj, torch.Tensor):
                vid = new_value(Role.STATE, TensorMeta.of(obj), node.target)
                state[vid] = obj
            else:
                vid = new_value(Role.CONST, None, node.target)
                consts[vid] = obj
            env[node] = Ref(vid)
        elif node.op == "call_function":
            target = node.target
            if target is operator.getitem and isinstance(node.args[0], fx.Node) and isinstance(env.get(node.args[0]), tuple):
                _, pos = env[node.args[0]]
                vid = new_value(Role.TEMP, meta_of(node), node.name)
                ops[pos]["outputs"][node.args[1]] = vid
                env[node] = Ref(vid)
                continue
            if not isinstance(target, torch._ops.OpOverload):
                raise CaptureError(
                    f"unsupported call {getattr(target, '__name__', target)!r} in the captured graph "
                    f"(node {node.name}{', at ' + _source_of(node) if _source_of(node) else ''}): "
                    "flowexec runs ATen operator overloads only"
                )
            name = f"{target.namespace}.{target._opname}.{target._overloadname}"
            if name in _DROPPED:
                source_for(node)
                env[node] = None
                continue
            args = lookup(node.args)
            kwargs = lookup(node.kwargs)
            rets = target._schema.returns
            multi = len(rets) > 1 or (len(rets) == 1 and is_list(rets[0]))
            record = {"target": target, "args": tuple(args), "kwargs": tuple(kwargs.items()),
                      "source": source_for(node), "unpack": multi}
            if multi:
                n = len(rets) if len(rets) > 1 else len(node.meta.get("val") or ()) if isinstance(node.meta.get("val"), (list, tuple)) else 0
                if n == 0:
                    n = max((u.args[1] for u in node.users if u.target is operator.getitem), default=-1) + 1
                record["outputs"] = [-1] * n
                env[node] = ("multi", len(ops))
            elif len(rets) == 0:
                record["outputs"] = []
                env[node] = None
            else:
                vid = new_value(Role.TEMP, meta_of(node), node.name)
                record["outputs"] = [vid]
                env[node] = Ref(vid)
            ops.append(record)
        elif node.op == "output":
            flat, spec = pytree.tree_flatten(node.args[0])
            outs = []
            for leaf in flat:
                r = lookup(leaf) if isinstance(leaf, fx.Node) else leaf
                outs.append(r)
            out_spec = spec
        else:
            raise CaptureError(f"unsupported FX node kind {node.op!r} ({node.name})")

    final_ops = tuple(
        Op(i, r["target"], r["args"], r["kwargs"], tuple(r["outputs"]), r["unpack"], r["source"])
        for i, r in enumerate(ops)
    )
    tensors = list(zip(inputs, example_inputs or ())) + list(state.items())
    return Program(tuple(values), final_ops, tuple(inputs), tuple(outs), out_spec, state, consts,
                   shared_storage(tensors))

