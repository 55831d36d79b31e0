"""Kept programs: a capture kept on disk and bound again to a later process's objects.

A capture traces ``fn`` through ``make_fx`` (forward, backward, optimizer step): seconds for a
model of GPT-2's size, in every new process, where Inductor keeps its kernels on disk and
torch.compile's warm start loads them. A kept program is a capture's result written beside
Inductor's cache, with everything it holds of the live process — the parameters, buffers and
optimizer state it binds, the module dicts, closure cells and globals its guards read, the
param groups its fed hyperparameters come from — named by a path from ``fn`` (:func:`reach`)
instead of by identity. A later build of the same ``fn`` follows those paths in its own
process and takes the program only where a capture would have made that same program:

- the index key matches: flowexec's files, torch's and Python's versions, the call's signature
  and its tensors' ``requires_grad``, the capture's flags, the torch switches that choose which
  ATen ops a model dispatches (SDPA backends, deterministic algorithms), the devices, and the
  environment variables;
- the source file of every Python code object the capture ran outside torch, flowexec and the
  standard library (the user's, and libraries' such as transformers) has the path, size and
  modification time it had, as Python trusts its bytecode cache;
- every state tensor is found again with the dtype, shape, strides and device the program was
  captured for, and inputs and state share storage as they did;
- every guard holds (what the capture read: ``training`` flags, module attributes, numbers in
  closures and globals, ``requires_grad``, which gradients exist) and every host read of a fed
  hyperparameter answers as it did.

A capture holding anything no path from ``fn`` names (a tensor in a local cache, a code
object without a file) is not kept, and a program that does not bind is not taken: the build
captures, as it always did. ``Executable.kept`` says which happened and why.
``FLOWEXEC_KEEP=0`` turns keeping off (docs/kept.md).

    >>> import torch
    >>> def make(net):
    ...     return lambda x: net(x)
    >>> net = torch.nn.Linear(2, 2)
    >>> show(reach(make(net)).loc(net.weight))
    'fn.cell[net].param[weight]'
"""
from __future__ import annotations

import functools
import hashlib
import io
import numbers
import os
import pickle
import platform
import sys
import types
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from .guards import GuardSet, WeakAttrs, generated_code, global_names, is_scalar, user_code
from .hyperparams import Feeds, FeedSlot
from .list_returns import flat_op, flattened_from
from .op_log import first_difference
from .program import Op, Program, Ref, Role, TensorMeta, Value, map_nested
from .storage import shared_storage
from .verdict_cache import default_directory

FORMAT = 3  # (a change in what a record holds changes every key)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
# Names whose values differ between two runs of one command and steer no capture.
_VOLATILE_ENV = frozenset({"_", "OLDPWD", "PWD", "SHLVL", "TERM", "TERM_SESSION_ID", "COLUMNS", "LINES", "DISPLAY",
                           "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK", "TMUX", "TMUX_PANE",
                           "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID",
                           "PYTEST_XDIST_WORKER_COUNT", "FLOWEXEC_KEEP", "FLOWEXEC_KEEP_DIR"})
_DEPTH = 3  # how deep plain objects and containers are walked for modules, optimizers and tensors
_WIDTH = 64  # entries of one object or container walked


def enabled() -> bool:
    """Whether builds keep and look up programs (``FLOWEXEC_KEEP``: ``1``, the default, or ``0``).
    On by default since a kept program is taken only where the step's replay dispatches what its
    capture did (docs/kept.md)."""
    setting = os.environ.get("FLOWEXEC_KEEP", "1")
    if setting not in ("0", "1"):
        raise ValueError(f"FLOWEXEC_KEEP={setting!r}: expected 1 (keep captured programs and load them in later "
                         "processes, the default) or 0 (capture in every process)")
    return setting == "1"


def directory() -> str:
    """Where kept programs lie: ``FLOWEXEC_KEEP_DIR``, else ``programs/`` in flowexec's part of
    Inductor's cache directory (a warm Inductor cache and kept programs go together)."""
    return os.environ.get("FLOWEXEC_KEEP_DIR") or os.path.join(default_directory(), "programs")


class NotKept(Exception):
    """Why a capture is not kept, or a kept program does not bind."""


# --- the objects fn reaches, by paths a later process follows the same way -----------------

Loc = tuple


@dataclass
class Reach:
    """The objects a walk from ``fn`` finds, each by the first path that reaches it."""

    objects: dict[Loc, Any] = field(default_factory=dict)
    where: dict[int, Loc] = field(default_factory=dict)
    # The plain values the walk meets where no guard looks (defaults, a library function's
    # closure, a partial's arguments, objects' and user classes' attributes: _visit): a program
    # kept for one value must not be taken for another. loc -> (type, value)
    facts: dict[Loc, tuple[type, Any]] = field(default_factory=dict)

    def put(self, loc: Loc, obj: Any) -> bool:
        if id(obj) in self.where:
            return False
        self.where[id(obj)] = loc
        self.objects[loc] = obj
        return True

    def identities(self) -> dict[Loc, Any]:
        """:func:`identity` of every object found but tensors, containers and cells (whose
        contents are checked where a program binds them)."""
        return {loc: identity(o) for loc, o in self.objects.items()
                if not isinstance(o, (torch.Tensor, dict, list, tuple, types.CellType))}

    def loc(self, obj: Any) -> Loc | None:
        """The path to ``obj``, or None where the walk did not find it (``objects`` holds what
        it found, so an id in ``where`` is never another object's)."""
        return self.where.get(id(obj))


def reach(fn: Callable[..., Any]) -> Reach:
    """Every object a kept program may bind, by a path from ``fn``: functions through their
    closure cells and (the user's and libraries' code, not torch's) the globals they name;
    modules with their submodules, ``__dict__`` s, member tables, parameters and buffers;
    optimizers with their state, param groups and per-parameter state; plain objects and
    containers, a few levels deep. The walk visits in a fixed order, so a later process with
    the same code and objects finds each at the same path."""
    r = Reach()
    todo: deque[tuple[Loc, Any]] = deque([((("fn",),), fn)])
    while todo:
        loc, v = todo.popleft()
        _visit(r, loc, v, 0, todo)
    return r


def _visit(r: Reach, loc: Loc, v: Any, depth: int, todo: deque) -> None:
    # What a walk finds and records beyond the objects a record binds: every object's identity
    # (a module's class, a function's code: kept.identities), and every plain value held where
    # no guard looks (kept facts): a function's defaults and a library function's closure, a
    # partial's arguments, every module's and plain object's attributes, user classes'
    # attributes. A program is taken only where all of them are as they were.
    if isinstance(v, (types.MethodType, functools.partial)):
        if not r.put(loc, v):
            return
        inner = v.__func__ if isinstance(v, types.MethodType) else v.func
        _visit(r, loc + (("func", None),), inner, depth, todo)
        if isinstance(v, types.MethodType):
            _visit(r, loc + (("self", None),), v.__self__, depth, todo)
        else:
            items = [(("arg", k), a) for k, a in enumerate(v.args)] + [(("kw", k), a) for k, a in v.keywords.items()]
            _facts(r, loc, items)
            for key, a in items[:_WIDTH]:
                _visit(r, loc + (key,), a, depth + 1, todo)
        return
    if isinstance(v, types.FunctionType):
        if not r.put(loc, v):
            return
        code = v.__code__
        library = not user_code(code.co_filename)
        defaults = [(("default", k), d) for k, d in enumerate(v.__defaults__ or ())]
        defaults += [(("kwdefault", k), d) for k, d in (v.__kwdefaults__ or {}).items()]
        _facts(r, loc, defaults)  # (read by LOAD_FAST: no guard sees them)
        for key, d in defaults:
            todo.append((loc + (key,), d))
        for name, cell in zip(code.co_freevars, v.__closure__ or ()):
            r.put(loc + (("cellobj", name),), cell)
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if library:
                _facts(r, loc, [(("cell", name), contents)])
            todo.append((loc + (("cell", name),), contents))
        if not library:
            g = v.__globals__
            for name in global_names(code):
                if name in g:
                    todo.append(((("global", g.get("__name__"), name),), g[name]))
        return
    if isinstance(v, torch.nn.Module):
        if not r.put(loc, v):
            return
        for qual, m in v.named_modules(remove_duplicate=False):
            at = loc + (("module", qual),) if qual else loc
            r.put(at, m)
            d = vars(m)
            r.put(at + (("dict", None),), d)
            for table in ("_parameters", "_buffers", "_modules"):
                if isinstance(d.get(table), dict):
                    r.put(at + (("table", table),), d[table])
            _object_facts(r, at, m, todo)
        for qual, p in v.named_parameters(remove_duplicate=False):
            r.put(loc + (("param", qual),), p)
        for qual, b in v.named_buffers(remove_duplicate=False):
            r.put(loc + (("buffer", qual),), b)
        return
    if isinstance(v, torch.optim.Optimizer):
        if not r.put(loc, v):
            return
        r.put(loc + (("state", None),), v.state)
        for gi, group in enumerate(v.param_groups):
            r.put(loc + (("group", gi),), group)
            r.put(loc + (("params", gi),), group["params"])
            for k, p in enumerate(group["params"]):
                _visit(r, loc + (("param", gi, k),), p, depth, todo)
                st = dict.get(v.state, p)  # (a defaultdict: no entry made)
                if st is not None:
                    r.put(loc + (("pstate", gi, k),), st)
                    for key, t in st.items():
                        if isinstance(t, torch.Tensor):
                            r.put(loc + (("pstate", gi, k), ("item", key)), t)
        return
    if isinstance(v, torch.Tensor):
        r.put(loc, v)
        return
    if isinstance(v, type) or (callable(v) and not hasattr(v, "__dict__")):
        r.put(loc, v)  # (a class, a builtin function: its identity is its name)
        return
    if depth >= _DEPTH or isinstance(v, (types.ModuleType, str, bytes)) or v is None:
        return
    if type(v) in (dict, list, tuple):
        if not r.put(loc, v):
            return
        items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
        _facts(r, loc, [(("item", k), e) for k, e in items])
        for k, e in items[:_WIDTH]:
            if isinstance(k, (str, int)):
                _visit(r, loc + (("item", k),), e, depth + 1, todo)
        return
    if hasattr(v, "__dict__"):
        if not r.put(loc, v):
            return
        _object_facts(r, loc, v, todo)
        for k, e in list(vars(v).items())[:_WIDTH]:
            _visit(r, loc + (("attr", k),), e, depth + 1, todo)


def _object_facts(r: Reach, loc: Loc, obj: Any, todo: deque) -> None:
    """The plain values of an object's ``__dict__``; and for its class and bases that are the
    user's or a library's (not torch's or the standard library's), theirs, and their methods
    (walked as functions: the globals a ``forward`` reads)."""
    _facts(r, loc, [(("attr", k), e) for k, e in vars(obj).items()])
    for cls in type(obj).__mro__:
        module = sys.modules.get(cls.__module__)
        if cls is object or not user_code(getattr(module, "__file__", None) or "<unknown>"):
            continue
        at = (("class", cls.__module__, cls.__qualname__),)
        _facts(r, at, [(("attr", k), e) for k, e in vars(cls).items() if not k.startswith("__")])
        for k, e in vars(cls).items():
            f = e.__func__ if isinstance(e, (staticmethod, classmethod)) else e
            if isinstance(f, types.FunctionType):
                todo.append((at + (("method", k),), f))


def _facts(r: Reach, loc: Loc, items: Sequence[tuple[Any, Any]]) -> None:
    for key, value in items:
        if is_scalar(value) or isinstance(value, numbers.Number):  # (numpy's scalars among them)
            r.facts[loc + (key if isinstance(key, tuple) else ("attr", key),)] = (type(value), value)


def identity(obj: Any) -> Any:
    """What must be the same of the object at a path for a program kept with another there: a
    function's code (file, name, line and bytecode), else the object's type."""
    if isinstance(obj, types.FunctionType):
        return ("code", _code_digest(obj.__code__))
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "__dict__")):
        return ("named", getattr(obj, "__module__", None), getattr(obj, "__qualname__", repr(obj)))
    return ("type", type(obj).__module__, type(obj).__qualname__)


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256()
    h.update(repr((code.co_filename, code.co_name, code.co_firstlineno, code.co_names, code.co_varnames,
                   code.co_freevars)).encode())
    h.update(code.co_code)
    for c in code.co_consts:
        h.update(_code_digest(c).encode() if isinstance(c, types.CodeType) else repr(c).encode())
    return h.hexdigest()[:32]


def _module_named(d: Any) -> str | None:
    """The name of the module whose globals ``d`` is, or None."""
    if type(d) is not dict:
        return None
    name = d.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    return name if module is not None and getattr(module, "__dict__", None) is d else None


def show(loc: Loc) -> str:
    """A path as text: ``fn.cell[model].param[fc.weight]``."""
    parts = []
    for step in loc:
        kind, *args = step
        if kind == "fn":
            parts.append("fn")
        elif kind == "global":
            parts.append(f"{args[0]}.{args[1]}")
        else:
            parts.append(f".{kind}" + (f"[{', '.join(map(str, (a for a in args if a is not None)))}]"
                                       if any(a is not None for a in args) else ""))
    return "".join(parts)


# --- writing and reading a record ----------------------------------------------------------

class _Ref(int):
    """A :class:`~flowexec.program.Ref` in a record (a plain int would be taken for a constant)."""


class _Writer(pickle.Pickler):
    """Pickles a record: ATen ops by name, what :func:`reach` found by path, module globals by
    the module's name; a tensor, generator or stream it cannot name is refused (a copy of it
    would be bound where the live one was)."""

    def __init__(self, f: Any, r: Reach, values: bool = False) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.r = r
        self.values = values  # tensors by value (the constants in a host read's expression)

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, (str, int, float, bool, bytes)) or obj is None:
            return None
        if isinstance(obj, torch._ops.OpOverload):
            src = flattened_from(obj)  # (made in the process that loads it, from the op it flattens)
            return ("flat", src._schema.name, src._overloadname) if src is not None else \
                ("op", obj._schema.name, obj._overloadname)
        loc = self.r.loc(obj)
        if loc is not None:
            return ("obj", loc, identity(obj))
        name = _module_named(obj)
        if name is not None:
            return ("module", name)
        if isinstance(obj, types.FunctionType):  # (one no path reaches, as a guard expects it: by name, and code)
            if "<locals>" in obj.__qualname__ or sys.modules.get(obj.__module__) is None:
                raise NotKept(f"the program holds function {obj.__qualname__}, which no path from fn reaches")
            return ("func", obj.__module__, obj.__qualname__, _code_digest(obj.__code__))
        if isinstance(obj, torch.Tensor) and not self.values:
            raise NotKept(f"the program binds a tensor ({TensorMeta.of(obj)}) that no path from fn reaches")
        if isinstance(obj, (torch.Generator, types.CellType)) or type(obj).__name__ in ("Stream", "Event"):
            raise NotKept(f"the program holds a {type(obj).__name__} that no path from fn reaches")
        return None


class _Reader(pickle.Unpickler):
    def __init__(self, f: Any, r: Reach) -> None:
        super().__init__(f)
        self.r = r

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind in ("op", "flat"):
            ns, name = pid[1].split("::", 1)
            op = getattr(getattr(getattr(torch.ops, ns), name), pid[2] or "default")
            return flat_op(op) if kind == "flat" else op
        if kind == "obj":
            obj = self.r.objects.get(pid[1], _MISSING)
            if obj is _MISSING:
                raise NotKept(f"{show(pid[1])} is not there")
            if identity(obj) != pid[2]:
                what = "other code" if pid[2][0] == "code" else f"a {type(obj).__qualname__}"
                raise NotKept(f"{show(pid[1])} is {what} than the program was captured with")
            return obj
        if kind == "func":
            f: Any = sys.modules.get(pid[1])
            for part in pid[2].split("."):
                f = getattr(f, part, None)
            if not isinstance(f, types.FunctionType) or _code_digest(f.__code__) != pid[3]:
                raise NotKept(f"{pid[1]}.{pid[2]} is other code than the program was captured with")
            return f
        if kind == "module":
            module = sys.modules.get(pid[1])
            if module is None:
                raise NotKept(f"module {pid[1]} is not imported")
            return module.__dict__
        raise NotKept(f"a record of another format ({kind!r})")


_MISSING = object()


def _meta(m: TensorMeta | None) -> Any:
    return None if m is None else (m.dtype, m.shape, m.device, m.nbytes, m.stride)


def _enc(a: Any) -> Any:
    return map_nested(a, lambda x: _Ref(x.id) if isinstance(x, Ref) else x)


def _dec(a: Any) -> Any:
    return map_nested(a, lambda x: Ref(int(x)) if type(x) is _Ref else x)


def _shown(ident: Any) -> str:
    if ident is None:
        return "nothing"
    return "other code" if ident[0] == "code" else f"{ident[1]}.{ident[2]}"


def _fresh_constants(prog: Program) -> set[int]:
    """The state values read only by ``lift_fresh_copy``: tensors fn made from Python values
    during the run (``torch.tensor(...)``), which make_fx keeps as constants of the graph."""
    readers: dict[int, set[Any]] = {}
    for op in prog.ops:
        for i in op.refs():
            readers.setdefault(i, set()).add(op.target)
    lift = torch.ops.aten.lift_fresh_copy.default
    return {vid for vid in prog.state if readers.get(vid) == {lift}}


def _feed_buffer_of(t: torch.Tensor, feeds: Any) -> torch.device | None:
    if feeds is None:
        return None
    ptr = t.untyped_storage().data_ptr()
    return next((d for d, b in feeds.buffers.items() if b.untyped_storage().data_ptr() == ptr), None)


def encode(cap: Any, r: Reach, files: dict[str, tuple[int, int]]) -> bytes:
    """A capture (:class:`flowexec.capture.Captured`) as bytes, or :class:`NotKept`."""
    prog: Program = cap.program
    gs: GuardSet = cap.guards
    feeds = gs.feeds
    for g in gs.guards:  # read from a copy, a guard would hold whatever the live value did
        # (a weak root is written as the object it reads: WeakAttrs.__reduce__)
        root = g.root.ref() if isinstance(g.root, WeakAttrs) else g.root
        if root is not None and r.loc(root) is None and _module_named(root) is None:
            raise NotKept(f"guard {g.name}: no path from fn reaches what it reads")
    for rp in gs.replays:
        if r.loc(rp.where) is None and _module_named(rp.where) is None:
            raise NotKept(f"fn assigns {rp.name}, which no path from fn reaches")
    for opt, *_ in cap.made_state:
        if r.loc(opt) is None:
            raise NotKept(f"an optimizer ({type(opt).__name__}) that no path from fn reaches makes state")
    log = cap.log
    if log is None:
        raise NotKept("the capture kept no log of its ops")
    if log.opaque:
        raise NotKept(f"the capture's log of its ops cannot name {log.opaque}")
    fresh = _fresh_constants(prog)
    state: dict[int, Any] = {}
    for vid, t in prog.state.items():
        d = _feed_buffer_of(t, feeds)
        if d is not None:
            state[vid] = ("feed", d, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        elif vid in fresh and r.loc(t) is None:  # (torch.tensor(...) in fn: a constant of the program's own)
            state[vid] = ("value", t.dtype, tuple(t.shape), t.detach().cpu().flatten().tolist(), t.device)
        else:
            state[vid] = ("bound", t)
    slots = None
    if feeds is not None:
        for s in feeds.slots:
            if r.loc(s.group) is None:
                raise NotKept(f"{s.name}: its param group is not reached from fn")
        reads = io.BytesIO()
        try:
            _Writer(reads, r, values=True).dump(feeds.reads)
        except Exception as e:
            raise NotKept(f"a host read of a fed hyperparameter cannot be written: {type(e).__name__}: {e}") from None
        slots = ([(s.name, s.group, s.key, s.index, s.position, s.device, s.captured) for s in feeds.slots],
                 {d: (b.numel(), b.dtype) for d, b in feeds.buffers.items()}, reads.getvalue())
    record = {
        "files": files, "facts": r.facts, "identities": r.identities(),
        "values": [(v.id, v.role.value, _meta(v.meta), v.name) for v in prog.values],
        "ops": [(op.index, op.target, _enc(op.args), tuple((k, _enc(v)) for k, v in op.kwargs), op.outputs,
                 op.unpack, op.source, op.recomputed) for op in prog.ops],
        "inputs": prog.inputs, "outputs": _enc(prog.outputs), "out_spec": prog.out_spec, "state": state,
        "consts": prog.consts, "shared_storage": prog.shared_storage,
        "grad_bindings": list(cap.grad_bindings), "n_user_outputs": cap.n_user_outputs, "out_tree": cap.out_tree,
        "guards": gs.guards, "replays": gs.replays, "cleared_grads": gs.cleared_grads, "feeds": slots,
        "grad_inputs": tuple(cap.grad_inputs), "discarded_grads": tuple(cap.discarded_grads),
        "made_state": tuple(cap.made_state),
        "log": (log.entries, log.flags, [_state_of(t, r) for t in log.state]),
    }
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():  # (pytree's LeafSpec warns of its own isinstance check when pickled)
            warnings.simplefilter("ignore", FutureWarning)
            _Writer(buf, r).dump(record)
    except NotKept:
        raise
    except Exception as e:  # (an object pickle cannot write: a lambda in a guard's expected value)
        raise NotKept(f"{type(e).__name__}: {e}") from None
    return buf.getvalue()


def decode(data: bytes, r: Reach, call_tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The fields of a :class:`flowexec.capture.Captured` from a record, bound to the objects
    of ``r`` and checked (files, metas, storage sharing, guards, host reads), or
    :class:`NotKept`. ``call_tensors``: the call's tensors (the program's first inputs; the
    gradients it reads follow them)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            rec = _Reader(io.BytesIO(data), r).load()
    except NotKept:
        raise
    except Exception as e:
        raise NotKept(f"the record does not load: {type(e).__name__}: {e}") from None
    identities = r.identities()
    if rec["identities"] != identities:
        loc = next(k for k in {**rec["identities"], **identities} if rec["identities"].get(k) != identities.get(k))
        raise NotKept(f"{show(loc)} is {_shown(identities.get(loc))} where the program was captured with "
                      f"{_shown(rec['identities'].get(loc))}")
    if rec["facts"] != r.facts:
        loc = next((k for k in {**rec["facts"], **r.facts} if rec["facts"].get(k) != r.facts.get(k)), None)
        was, now = rec["facts"].get(loc, (None, "nothing")), r.facts.get(loc, (None, "nothing"))
        raise NotKept(f"{show(loc)} is {now[1]!r} where the program was captured with {was[1]!r}")
    changed = next((p for p, st in rec["files"].items() if _stamp(p) != st), None)
    if changed is not None:
        raise NotKept(f"{changed} changed since the program was kept")
    values = tuple(Value(i, Role(role), None if m is None else TensorMeta(*m), name)
                   for i, role, m, name in rec["values"])
    feeds = None
    if rec["feeds"] is not None:
        slots, buffers, reads = rec["feeds"]
        try:
            feeds = _feeds(slots, buffers, _Reader(io.BytesIO(reads), r).load())
        except NotKept:
            raise
        except Exception as e:
            raise NotKept(f"the fed hyperparameters do not load: {type(e).__name__}: {e}") from None
    state: dict[int, torch.Tensor] = {}
    for vid, how in rec["state"].items():
        if how[0] == "feed":
            _, d, offset, shape, stride = how
            t = feeds.buffers[d].as_strided(shape, stride, offset)
        elif how[0] == "value":
            _, dtype, shape, items, device = how
            t = torch.tensor(items, dtype=dtype).reshape(shape).to(device)
        else:
            t = how[1]
            if TensorMeta.of(t) != values[vid].meta:
                raise NotKept(f"{values[vid].name}: {TensorMeta.of(t)} where the program was captured for "
                              f"{values[vid].meta}")
        state[vid] = t
    ops = tuple(Op(i, target, _dec(args), tuple((k, _dec(v)) for k, v in kwargs), outputs, unpack, source, recomputed)
                for i, target, args, kwargs, outputs, unpack, source, recomputed in rec["ops"])
    prog = Program(values, ops, tuple(rec["inputs"]), _dec(rec["outputs"]), rec["out_spec"], state, rec["consts"],
                   tuple(rec["shared_storage"]))
    grads = [p.grad for p in rec["grad_inputs"]]
    if any(g is None for g in grads):
        raise NotKept("a gradient the program reads is None")
    targs = list(call_tensors) + grads
    if len(targs) != len(prog.inputs):
        raise NotKept(f"the call has {len(targs)} tensors where the program takes {len(prog.inputs)}")
    for vid, t in zip(prog.inputs, targs):
        if not isinstance(t, torch.Tensor) or TensorMeta.of(t) != values[vid].meta:
            raise NotKept(f"input {values[vid].name}: another tensor than the program was captured for")
    sharing = shared_storage(list(zip(prog.inputs, targs)) + list(state.items()))
    if tuple(sharing) != prog.shared_storage:
        raise NotKept("the call's tensors and fn's state share storage otherwise than at capture")
    gs = GuardSet(tuple(rec["guards"]), feeds, tuple(rec["replays"]), tuple(rec["cleared_grads"]))
    failed = gs.check()  # (also refreshes the fed values: the program reads this process's)
    if failed >= 0:
        raise NotKept(f"a guard fails: {gs.describe(failed)}")
    if feeds is not None and not feeds.reads_hold():
        raise NotKept("a host read of a fed hyperparameter answers otherwise")
    return dict(program=prog, grad_bindings=list(rec["grad_bindings"]), n_user_outputs=rec["n_user_outputs"],
                out_tree=rec["out_tree"], guards=gs, grad_inputs=tuple(rec["grad_inputs"]),
                discarded_grads=tuple(rec["discarded_grads"]), made_state=tuple(rec["made_state"]),
                log=rec["log"])


def _state_of(t: Any, r: Reach) -> Any:
    """A state object of a capture's log (a tensor, or one of fn's own generators) as a record
    holds it: by path (the object itself, which :class:`_Writer` names), or, for a small tensor
    no path reaches, by value (a constant fn made outside dispatch: ``torch.from_numpy``)."""
    if r.loc(t) is not None:
        return t
    if isinstance(t, torch.Tensor) and t.numel() <= _VALUE_LIMIT:  # (``torch.tensor(...)`` in fn: the literal)
        return _value_of(t)
    what = f"a tensor ({TensorMeta.of(t)})" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
    raise NotKept(f"the step reads {what} that no path from fn reaches")


def _value_of(t: torch.Tensor) -> tuple:
    """A small tensor by its metadata and its bytes (-0.0 is not 0.0, and a NaN equals itself)."""
    data = t.detach().cpu().contiguous().reshape(-1)
    return ("value", str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.device),
            data.view(torch.uint8).numpy().tobytes() if data.element_size() else b"")


_VALUE_LIMIT = 4096  # elements of a tensor no path reaches that a record keeps by value


def check_replay(fields: dict[str, Any], seen: Any) -> None:
    """:class:`NotKept` where the step, run again (:class:`flowexec.capture.Replayed`), did
    otherwise than the kept capture's run: other ops, or other arguments, or other state
    tensors, other returns, other gradients left behind or state made, or a value read that the
    program does not guard. Equal runs make equal programs (``make_fx`` records what the run
    dispatches)."""
    entries, _, state = fields["log"]
    log = seen.log
    if log.opaque:
        raise NotKept(f"the step, run again, passes an op {log.opaque}")
    diff = first_difference(log.entries, entries)
    if diff is not None:
        raise NotKept(f"the step, run again, dispatches otherwise: {diff}")
    if len(log.state) != len(state):  # (equal entries name as many)
        raise NotKept("the step, run again, reads another number of state tensors")
    for j, (now, was) in enumerate(zip(log.state, state)):
        same = now is was if not isinstance(was, tuple) else isinstance(now, torch.Tensor) and was == _value_of(now)
        if not same:
            what = TensorMeta.of(now) if isinstance(now, torch.Tensor) else type(now).__name__
            raise NotKept(f"the step, run again, reads another object as its state object {j} ({what})")
    pairs = [(id(p), i) for p, i in seen.grad_bindings], [(id(p), i) for p, i in fields["grad_bindings"]]
    made = [(id(o), id(p), k, i) for o, p, k, i in seen.made_state], \
        [(id(o), id(p), k, i) for o, p, k, i in fields["made_state"]]
    if pairs[0] != pairs[1] or made[0] != made[1]:
        raise NotKept("the step, run again, leaves other gradients or makes other optimizer state")
    if seen.n_user_outputs != fields["n_user_outputs"] or seen.out_tree != fields["out_tree"]:
        raise NotKept("the step, run again, returns other containers")
    gone = {id(p) for p in fields["discarded_grads"]}
    cleared = {id(p) for p in seen.cleared_grads if id(p) not in gone}
    if cleared != {id(p) for p in fields["guards"].cleared_grads}:
        raise NotKept("the step, run again, leaves other gradients None")
    guarded = {g.name for g in fields["guards"].guards}
    unguarded = sorted(seen.read_names - guarded)
    if unguarded:
        raise NotKept(f"the step, run again, reads {unguarded[0]}, which the program does not guard")


def _feeds(slots: list[tuple], buffers: dict[torch.device, tuple[int, torch.dtype]], reads: Any) -> Feeds:
    """Fed hyperparameters anew: this process's param groups' values in new packed buffers."""
    made = [FeedSlot(name, group, key, index, position, device, None, captured)
            for name, group, key, index, position, device, captured in slots]
    hosts = {d: [0.0] * n for d, (n, _) in buffers.items()}
    for s in made:
        v = s.current()
        if type(v) not in (float, int):
            raise NotKept(f"{s.name} is {v!r}, not a number")
        hosts[s.device][s.position] = v
    bufs = {d: torch.tensor(hosts[d], dtype=dt).to(d) for d, (_, dt) in buffers.items()}
    return Feeds.build(made, bufs, reads)


# --- keys ----------------------------------------------------------------------------------

def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _own_files() -> tuple[tuple[str, tuple[int, int] | None], ...]:
    out = []
    for root, dirs, names in os.walk(_OWN_DIR):
        dirs.sort()
        out += [(os.path.join(root, n), _stamp(os.path.join(root, n))) for n in sorted(names) if n.endswith(".py")]
    return tuple(out)


def _switches() -> tuple[Any, ...]:
    """torch's global switches that choose which ATen ops a model dispatches under capture."""
    b = torch.backends
    out: list[Any] = [torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
                      b.cudnn.enabled, b.cudnn.deterministic, b.mkldnn.enabled]
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        f = getattr(b.cuda, name, None)
        out.append(f() if callable(f) else None)
    if torch.cuda.is_initialized():
        out += [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
                for i in range(torch.cuda.device_count())]
    return tuple(out)


def index_key(fn: Callable[..., Any], signature: Any, flags: Any) -> str:
    """The name of the record a build of ``fn`` for this call would keep (see the module's
    docstring: what must match before its files, metas and guards are checked)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    code = None if code is None else _code_digest(code)
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE_ENV))
    parts = (FORMAT, _own_files(), torch.__version__, getattr(torch.version, "git_version", None),
             torch.version.cuda, sys.version, platform.machine(), _switches(), env, repr(signature), repr(flags),
             code, type(fn).__qualname__)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


def files_of(codes: Iterable[types.CodeType]) -> dict[str, tuple[int, int]]:
    """The stamps of the source files of ``codes`` that are the user's or a library's (not
    torch's, flowexec's or the standard library's); :class:`NotKept` where one has no file."""
    out: dict[str, tuple[int, int]] = {}
    for code in codes:
        name = code.co_filename
        if name in out or not user_code(name) or generated_code(code):
            continue
        st = _stamp(name)
        if st is None:
            raise NotKept(f"code of {code.co_name} ran from {name}, which is not a file a later process can check")
        out[name] = st
    return out


# Records kept under one key: a step can make more than one program for one call's key (a first
# call that finds ``.grad`` None, later ones that find gradients: plain SGD, a run resumed from a
# checkpoint), and one record a key would have each build write over the other's.
RECORDS_PER_KEY = 4


def save(key: str, data: bytes) -> str:
    """Write a record under ``key`` (atomically: a reader never sees half of one) beside the
    others kept under it, the oldest dropped past :data:`RECORDS_PER_KEY`; its path."""
    d = directory()
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{key}.{hashlib.sha256(data).hexdigest()[:12]}.pkl")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    for old in _records(key)[RECORDS_PER_KEY:]:
        try:
            os.remove(old)
        except OSError:
            pass  # (another process dropped it first)
    return path


def load(key: str) -> list[bytes]:
    """The records kept under ``key``, the newest first (a build takes the first that binds)."""
    out = []
    for path in _records(key):
        try:
            with open(path, "rb") as f:
                out.append(f.read())
        except OSError:
            pass
    return out


def _records(key: str) -> list[str]:
    """The paths of the records under ``key``, the newest first."""
    d = directory()
    try:
        names = [os.path.join(d, n) for n in os.listdir(d) if n.startswith(key + ".") and n.endswith(".pkl")]
    except OSError:
        return []
    stamped = []
    for path in names:
        try:
            stamped.append((os.stat(path).st_mtime_ns, path))
        except OSError:
            pass
    return [path for _, path in sorted(stamped, reverse=True)]


def signature_of(args: Sequence[Any], sig: Any, tree: Any) -> Any:
    """What of a call goes into its key: the executable's signature, the tree of containers and
    each tensor argument's ``requires_grad``."""
    return (sig, tree, tuple(a.requires_grad for a in args if isinstance(a, torch.Tensor)))


__all__ = ["NotKept", "Reach", "decode", "directory", "enabled", "encode", "files_of", "index_key", "load",
           "reach", "save", "show", "signature_of"]
