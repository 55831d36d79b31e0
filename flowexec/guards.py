"""Guards: the Python values a capture read, checked before each call of its program.

A captured program is straight-line ATen code: whatever Python ``fn`` read while it was traced —
a module's ``training`` flag, ``self.temperature``, a number in a global dict, a parameter's
``requires_grad``, whether ``p.grad`` existed — is baked into it. Each such read becomes a
:class:`Guard` (where the value lives, what it was, how to compare); a call checks them all
first, and a change re-captures (``RecaptureWarning`` naming it: ``model.encoder.training:
True -> False``) or, where a new capture cannot help, raises an error naming it. The values
that change on purpose every step — optimizer hyperparameters under an LR schedule — are not
guarded but fed (:mod:`flowexec.hyperparams`).

What is read is recorded, as Dynamo's guards are (``torch/_dynamo/guards.py``), not guessed from
what is reachable:

- module attributes: ``nn.Module.__getattribute__`` is wrapped during capture, so every plain
  attribute read from a module's ``__dict__`` is seen, with the subscripts and attributes the
  reading bytecode applies to it next (``self.cfg["scale"]`` guards that entry, not ``cfg``);
  one its class answers (``self.shift`` where ``class Block: shift = 0.5``) is guarded as
  ``getattr(module, "shift")``, where a class of the user's holds it as plain data
  (:func:`class_value`: not a method, property or other descriptor, nor torch's);
- globals and closure variables: each user frame entered during capture is scanned once for
  ``LOAD_GLOBAL`` / ``LOAD_DEREF`` chains (``CFG["lr"]``, ``opts.scale``), resolved at entry;
- the first argument of a user frame: a plain object of the user's is used whole (its
  attributes and the plain data its classes hold), read through a weak reference where it holds
  tensors (:class:`WeakAttrs`); for a module or a class, the attribute names the code loads
  that its class answers (``type(self).shift``); an object the run makes (its ``__init__``
  runs during capture: an output record) is fn's own, only its class's data is guarded;
- module attribute writes (``model.train()`` inside ``fn``) are replayed after each call, and a
  value ``fn`` reads and then changes (a Python step counter) is refused: no capture can replay it;
- tensors: ``requires_grad`` of the parameters, whether their ``.grad`` is the tensor the
  program reads (or None); grad mode, autocast and the default dtype.

Checks cost a dictionary lookup and an identity test per guard (C++ where the native extension
is built: :mod:`flowexec.runtime.fastcall`).

    >>> import torch
    >>> m = torch.nn.Dropout(0.5)
    >>> g = Guard("m.training", vars(m), (("item", "training"),), True, "is")
    >>> holds(g), m.eval() is m, holds(g), describe(g)
    (True, True, False, 'm.training: True -> False')
"""
from __future__ import annotations

import copy
import dis
import enum
import functools
import itertools
import numbers
import os
import sys
import sysconfig
import threading
import types
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import frame_starts

_MISSING = object()
_MODULE_METHODS = dict(vars(torch.nn.Module))  # (nn.Module's own: method_read leaves them)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep
# flowexec's start-up hook (a top-level module beside the package): its import finder runs
# whenever a captured step imports something, and what it reads is not the user's.
# (Beside the package in a checkout or a wheel; the .pth may have loaded another copy first.)
_OWN_FILES = tuple(f for f in {os.path.join(os.path.dirname(os.path.dirname(__file__)), "_flowexec_accelerate.py"),
                               getattr(sys.modules.get("_flowexec_accelerate"), "__file__", None)} if f)
_STDLIB = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib")})
# A container used whole (passed to a function, iterated) is guarded on up to this many of its
# scalar leaves (and its length): enough for a dict of hyperparameters, bounded for big tables.
MAX_LEAVES = 64
# How deep a container's leaves are guarded one by one. A container of plain values (numbers,
# strings, ... in dicts, lists, tuples and sets) that nests deeper or holds more leaves than the
# budget left is guarded whole instead: one guard comparing it with a copy taken at capture (a
# change is still named to its entry: :func:`describe`). Up to MAX_SNAPSHOT values, which bounds
# what that comparison costs each call; what no guard covers is listed (``GuardSet.unguarded``).
MAX_DEPTH = 3
MAX_SNAPSHOT = 1024
_SCALAR_TYPES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout,
                 torch.memory_format, enum.Enum)


# --- the records ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Guard:
    """A value the capture read: ``root`` then ``path`` reaches it; it must still ``match``
    ``expected`` (``"is"``: identity; ``"eq"``: same type and equal; ``"state"``: the global
    state tuple of :func:`global_state`; ``"absent"``: the path's last dict item is not there,
    as a method's name in an instance ``__dict__``). ``name`` says where it is, for messages."""

    name: str
    root: Any
    path: tuple[tuple[str, Any], ...]
    expected: Any
    match: str = "eq"
    # A None-grad guard that the program's own re-bound gradient fails is lazy state settling,
    # not a change the user made: the executable re-captures that one silently.
    settles: bool = False


@dataclass(frozen=True)
class Replay:
    """A value ``fn`` assigned during capture — a plain module attribute (``model.train()``), a
    global, a closure variable: the compiled call sets it to ``value`` afterwards, as running
    ``fn`` would have."""

    name: str
    where: Any  # the module's __dict__ or the function's globals (a dict), or a closure cell
    key: str
    value: Any

    def apply(self) -> None:
        if isinstance(self.where, dict):
            if self.where.get(self.key, _MISSING) is not self.value:
                self.where[self.key] = self.value
        else:
            self.where.cell_contents = self.value


def read(root: Any, path: Sequence[tuple[str, Any]]) -> Any:
    """The value at ``path`` from ``root`` now, or ``_MISSING`` where the path is gone."""
    v = root
    try:
        for kind, arg in path:
            if kind == "item" and isinstance(v, dict):
                v = dict.get(v, arg, _MISSING)  # (a defaultdict must not grow an entry)
                if v is _MISSING:
                    return v
            elif kind == "item":
                v = v[arg]
            elif kind == "attr":
                v = getattr(v, arg)
            elif kind == "cell":
                v = v.cell_contents
            elif kind == "len":
                v = len(v)
            elif kind == "keys":
                v = tuple(v)
            elif kind == "state":
                v = global_state()
            else:
                raise ValueError(f"unknown guard step {kind!r}")
    except (KeyError, IndexError, AttributeError, TypeError, ValueError):
        return _MISSING
    return v


def _has_data_descriptor(cls: type, name: str) -> bool:
    for c in cls.__mro__:
        if name in c.__dict__:
            t = type(c.__dict__[name])
            return hasattr(t, "__set__") or hasattr(t, "__delete__")
    return False


def native_path(root: Any, path: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``path`` for the C++ check: an ``("attr", name)`` step on an object whose class has a
    ``__getattribute__`` of its own in Python (a Hugging Face config's: ~1 µs a read, most
    of a transformer's guard check) becomes ``("dict", name)``, a lookup in the instance
    ``__dict__``, where that is where the read found its value now and no data descriptor
    (a property) of the class answers the name first. The Python check keeps the plain read."""
    out, v = [], root
    for kind, arg in path:
        nxt = read(v, ((kind, arg),))
        if nxt is _MISSING:
            return list(path)
        own = getattr(v, "__dict__", None) if kind == "attr" else None
        if type(v).__getattribute__ is not object.__getattribute__ and isinstance(own, dict) \
                and own.get(arg, _MISSING) is nxt and not _has_data_descriptor(type(v), arg):
            kind = "dict"
        out.append((kind, arg))
        v = nxt
    return out


def tensor_kind(t: torch.Tensor) -> tuple[Any, ...]:
    """What a ``.grad`` that is a program input must keep: dtype, device, sizes, strides."""
    return (t.dtype, t.device, tuple(t.shape), tuple(t.stride()))


def same(value: Any, expected: Any, match: str) -> bool:
    """Whether ``value`` still matches ``expected`` (``"grad"``: a tensor of the kind
    :func:`tensor_kind` describes)."""
    if match == "grad":
        return isinstance(value, torch.Tensor) and tensor_kind(value) == expected
    if match == "absent":
        return value is _MISSING
    if value is expected:
        return True
    if match == "is":
        return False
    return type(value) is type(expected) and value == expected


def holds(g: Guard) -> bool:
    """Whether guard ``g`` passes now."""
    return same(read(g.root, g.path), g.expected, g.match)


def _short(v: Any) -> str:
    if v is _MISSING:
        return "<gone>"
    if isinstance(v, torch.Tensor):
        return f"Tensor(shape={list(v.shape)}, dtype={v.dtype}, device={v.device})"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def describe(g: Guard) -> str:
    """``name: expected -> current`` for a guard that failed; for a container guarded whole by a
    copy, the entry that changed (``CFG['model']['scale']: 2.0 -> 3.0``)."""
    now = read(g.root, g.path)
    if g.match == "absent":
        return f"{g.name}: set on the instance ({_short(now)}), where its class's answered"
    whole = g.match != "eq" or (g.path and g.path[-1][0] == "keys")  # (an order: shown whole)
    suffix, was, now = ("", g.expected, now) if whole else _difference(g.expected, now)
    return f"{g.name}{suffix}: {_short(was)} -> {_short(now)}"


def _difference(was: Any, now: Any) -> tuple[str, Any, Any]:
    """The first entry where ``now`` differs from ``was`` as a subscript path (``['a'][3]``),
    with its two values: into dicts, lists and plain tuples of the same type and length."""
    if type(was) is not type(now) or not isinstance(was, (dict, list)) and type(was) is not tuple:
        return "", was, now
    if isinstance(was, dict):
        keys = list(was) + [k for k in now if k not in was]
        pairs = [(k, was.get(k, _MISSING), now.get(k, _MISSING)) for k in keys]
    elif len(was) != len(now):
        return "", was, now
    else:
        pairs = list(zip(range(len(was)), was, now))
    for k, a, b in pairs:
        if a is not b and (type(a) is not type(b) or a != b):
            suffix, a, b = _difference(a, b)
            return f"[{k!r}]{suffix}", a, b
    return "", was, now


def global_state() -> tuple[Any, ...]:
    """The global switches a captured program bakes in: grad mode, autocast on CPU and CUDA
    (enabled, dtype), the default dtype, and how many torch function modes are entered (a
    ``TorchFunctionMode`` or ``with torch.device(...)`` around a call changes what eager runs;
    the capture traces through those entered around it). Dispatch modes are not counted: a
    trace-mode call runs the program's ATen ops through them, and a capture beneath one traced
    its answers, which the run would then pass through it twice."""
    return (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.get_default_dtype(),
            torch._C._len_torch_function_stack())


def len_guard(label: str, root: Any, path: tuple, container: Any) -> Guard:
    """The guard on the length of ``container``, read at ``path`` from ``root`` (a hook dict, a
    container used whole): ``len(label)`` must stay ``len(container)``."""
    return Guard(f"len({label})", root, path + (("len", None),), len(container), "eq")


def order_guard(label: str, root: Any, path: tuple, container: Any) -> Guard:
    """The keys of a dict in their order (its length with them), where they are plain values:
    equality ignores a dict's order, which a loop over ``.items()`` or ``.values()`` follows
    (a ``cat`` of a config's entries), so a reordered dict would otherwise pass. Other keys, or
    more than ``MAX_SNAPSHOT`` of them (each call's check reads them all): the length alone.

        >>> where = {"cfg": {"a": 1.0, "b": 2.0}}
        >>> g = order_guard("cfg", where, (("item", "cfg"),), where["cfg"])
        >>> g.name, holds(g)
        ('cfg.keys()', True)
        >>> where["cfg"] = {"b": 2.0, "a": 1.0}  # (equal to the first: the same items)
        >>> holds(g), describe(g)
        (False, "cfg.keys(): ('a', 'b') -> ('b', 'a')")"""
    if isinstance(container, dict) and len(container) <= MAX_SNAPSHOT and all(is_scalar(k) for k in container):
        return Guard(f"{label}.keys()", root, path + (("keys", None),), tuple(container), "eq")
    return len_guard(label, root, path, container)


# torch's registries of hooks every module call or optimizer step runs (``register_module_forward_hook``,
# ``register_optimizer_step_post_hook``, ...): read by torch's code, which no frame scan sees.
_GLOBAL_HOOKS = (("torch.nn.modules.module", ("_global_forward_pre_hooks", "_global_forward_hooks",
                                              "_global_backward_pre_hooks", "_global_backward_hooks")),
                 ("torch.optim.optimizer", ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")))


def hook_guards() -> list[Guard]:
    """Guards on the number of torch's global module and optimizer hooks (a hook registered
    between calls, which a program would not run, captures again)."""
    out = []
    for modname, names in _GLOBAL_HOOKS:
        mod = sys.modules.get(modname)
        for name in names:
            hooks = getattr(mod, name, None)
            if isinstance(hooks, dict):
                # (rooted at the module's globals, as a global's guard is: kept programs name those)
                out.append(len_guard(f"{modname}.{name}", vars(mod), (("item", name),), hooks))
    return out


# Python modules whose functions torch's own code looks up at each call: ``nn.GELU.forward``
# calls ``F.gelu``, ``F.layer_norm`` calls ``torch.layer_norm``; no frame scan sees those reads.
# Their entries as flowexec found them: one replaced since is a patch (below).
_LOOKED_UP = {name: dict(vars(sys.modules[name])) for name in ("torch.nn.functional", "torch")}


def library_function_guards(called: Iterable[Any]) -> list[Guard]:
    """Identity guards on the entries of torch's function modules that a run may have read:
    those of the functions it called at the top of torch function dispatch (``F.layer_norm``);
    the functions those load one level down (the ``torch.layer_norm`` that it calls in turn,
    which no mode sees); and every entry that is a patch: replaced since flowexec was imported,
    or a function from outside torch (a patch made before; no dispatch reports a user
    function). So ``F.gelu = patched`` between calls captures again, and so does putting it
    back, as eager then runs what the entry holds. Rooted at each module's globals, as a
    global's guard is.

    >>> import torch.nn.functional as F
    >>> [g.name for g in library_function_guards([F.gelu, len])]
    ['torch.nn.functional.gelu']
    """
    called_ids = {id(f) for f in called}
    nested = {n for f in called if isinstance(f, types.FunctionType) for n in f.__code__.co_names}
    out = []
    for modname, found in _LOOKED_UP.items():
        d = vars(sys.modules[modname])
        for name, v in d.items():
            if _own_code(v):  # (rng.install's routing of ``torch.manual_seed``)
                continue
            was = found.get(name, v)
            patched = (was is not v and not _torch_wrapper_of(v, was)) or (
                _is_function(v) and not name.startswith("_") and not _module_of(v).startswith(("torch", "typing")))
            if patched or id(v) in called_ids or (name in nested and _is_function(v)):
                out.append(Guard(f"{modname}.{name}", d, (("item", name),), v, "is"))
    return out


def _torch_wrapper_of(v: Any, was: Any) -> bool:
    """Whether ``v`` is torch's own wrapper of ``was`` (importing ``torch._dynamo`` rebinds
    ``torch.manual_seed`` to a ``_disable_dynamo`` wrapper of itself): no user's patch."""
    code = getattr(v, "__code__", None)
    return getattr(v, "__wrapped__", None) is was and isinstance(code, types.CodeType) \
        and code.co_filename.startswith(_TORCH_DIR)


def _is_function(v: Any) -> bool:
    return callable(v) and not isinstance(v, (type, types.ModuleType))


def _module_of(v: Any) -> str:
    return getattr(v, "__module__", None) or ""


def _own_code(v: Any) -> bool:
    """Whether ``v`` is a function of flowexec's."""
    code = getattr(v, "__code__", None)
    return isinstance(code, types.CodeType) and code.co_filename.startswith(_OWN_DIR)


def state_guard() -> Guard:
    """The guard on :func:`global_state`."""
    return Guard("torch global state (grad mode, autocast cpu/cuda and dtypes, default dtype, "
                 "torch function modes entered)", None,
                 (("state", None),), global_state(), "eq")


def is_scalar(v: Any) -> bool:
    """Whether ``v`` is a value a guard compares (numbers, strings, dtypes, enums, and tuples and
    frozensets of them: namedtuples and ``torch.Size`` among the tuples)."""
    if isinstance(v, _SCALAR_TYPES) or (isinstance(v, numbers.Number) and not isinstance(v, torch.Tensor)):
        return True  # (numbers.Number: numpy's scalars among them)
    # (immutable, compared whole: one guard; the type too, so a namedtuple is not a tuple)
    return isinstance(v, (tuple, frozenset)) and all(is_scalar(e) for e in v)


def _plain_size(v: Any, limit: int) -> tuple[int, int] | None:
    """(values, nesting) of ``v``, a container of plain values (scalars in dicts, lists, tuples and
    sets, nested; each container counted once, as its length guard), or None where it holds
    anything else or more than ``limit`` values."""
    n, deepest = 0, 0
    todo = [(v, 0)]
    while todo:
        e, level = todo.pop()
        n += 1
        if n > limit:
            return None
        if is_scalar(e):
            continue
        deepest = max(deepest, level + 1)
        if isinstance(e, dict):
            if not all(is_scalar(k) for k in e):
                return None
            todo += [(x, level + 1) for x in e.values()]
        elif isinstance(e, (list, tuple, set, frozenset)):
            todo += [(x, level + 1) for x in e]
        else:
            return None
    return n, deepest


def _snapshot(v: Any) -> Any:
    """A copy of ``v``, a container of plain values, that a guard compares with it (a copy, as
    the container may change in place), or ``_MISSING``."""
    try:
        return copy.deepcopy(v)
    except Exception:  # (a container subclass that cannot be copied: not guarded whole)
        return _MISSING


@functools.lru_cache(maxsize=None)  # (asked per frame: a capture's op walks ~30 of torch's)
def user_code(filename: str) -> bool:
    """Whether a code object's file is the user's (not torch's, flowexec's or the standard library's)."""
    return (not filename.startswith((_TORCH_DIR, _OWN_DIR, *_STDLIB)) and not filename.startswith("<frozen")
            and filename not in _OWN_FILES)


def generated_code(code: types.CodeType) -> bool:
    """Code that dataclasses, namedtuple and typing generate by ``exec`` of ``<string>`` (an
    ``__init__`` and its ``__create_fn__``, a namedtuple's ``__new__`` lambda, an annotation's
    ``<module>``): it follows from a definition, and reads only their own helpers."""
    if code.co_filename != "<string>":
        return False
    n = code.co_name
    return (n.startswith("__") and n.endswith("__")) or n == "<module>" or (n == "<lambda>" and code.co_names == ("_tuple_new",))


# --- which values a chain of bytecode reads ------------------------------------------------

_SUBSCR = ("BINARY_SUBSCR",)
_CONSTS = ("LOAD_CONST", "LOAD_SMALL_INT")


def chain_after(instructions: Sequence[dis.Instruction], k: int) -> tuple[tuple[str, Any], ...]:
    """The constant subscripts and attribute loads the bytecode applies to the value that
    instruction ``k`` pushed (``x["a"].b`` after ``LOAD_GLOBAL x``)."""
    steps: list[tuple[str, Any]] = []
    i = k + 1
    n = len(instructions)
    while i < n:
        ins = instructions[i]
        if ins.opname in ("CACHE", "EXTENDED_ARG", "NOP"):
            i += 1
            continue
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            steps.append(("attr", ins.argval))
            i += 1
            continue
        if ins.opname in _CONSTS and i + 1 < n:
            nxt = instructions[i + 1]
            if nxt.opname in _SUBSCR or (nxt.opname == "BINARY_OP" and nxt.argrepr == "[]"):
                try:
                    hash(ins.argval)
                except TypeError:
                    break
                steps.append(("item", ins.argval))
                i += 2
                continue
        break
    return tuple(steps)


@dataclass(frozen=True)
class CodeReads:
    """What one code object reads and writes outside its frame: (kind, name, chain) with kind
    ``global`` or ``deref``, the global / free-variable names it stores, and whether it uses
    its first argument (a method's ``self``)."""

    reads: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...]
    writes: tuple[tuple[str, str], ...]
    uses_arg0: bool = False  # the code reads its first argument (a method's self)
    # The attribute names it and the code nested in it (a comprehension, a lambda) load: those
    # a class may answer (``type(self).shift``, which no module hook sees).
    attrs: frozenset[str] = frozenset()


_CODE_READS: "weakref.WeakKeyDictionary[types.CodeType, CodeReads]" = weakref.WeakKeyDictionary()


def code_reads(code: types.CodeType) -> CodeReads:
    """:class:`CodeReads` of ``code`` (computed once per code object)."""
    hit = _CODE_READS.get(code)
    if hit is not None:
        return hit
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE",)]
    reads: dict[tuple[str, str, tuple], None] = {}
    writes: dict[tuple[str, str], None] = {}
    free = set(code.co_freevars)
    arg0 = code.co_varnames[0] if code.co_argcount else None
    uses_arg0 = False
    attrs = {name for c in code.co_consts if isinstance(c, types.CodeType) for name in code_reads(c).attrs}
    for k, i in enumerate(ins):
        if i.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"):
            attrs.add(i.argval)
        if arg0 is not None and i.opname.startswith("LOAD_FAST") and (
                i.argval == arg0 or (isinstance(i.argval, tuple) and arg0 in i.argval)):
            uses_arg0 = True
        elif i.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            reads[("global", i.argval, chain_after(ins, k))] = None
        elif i.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_DEREF") and i.argval in free:
            reads[("deref", i.argval, chain_after(ins, k))] = None
        elif i.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
            writes[("global", i.argval)] = None
        elif i.opname in ("STORE_DEREF", "DELETE_DEREF") and i.argval in free:
            writes[("deref", i.argval)] = None
    hit = _CODE_READS[code] = CodeReads(tuple(reads), tuple(writes), uses_arg0, frozenset(attrs))
    return hit


def _is_library_object(v: Any) -> bool:
    return isinstance(v, (types.ModuleType, type, types.BuiltinFunctionType, types.BuiltinMethodType,
                          types.MethodWrapperType, types.WrapperDescriptorType, torch.Tensor,
                          torch.nn.Module, torch.optim.Optimizer))


def _user_class(cls: type) -> bool:
    """Whether ``cls`` is a class of the user's or a library's (not torch's, flowexec's, the
    standard library's or a builtin)."""
    return cls.__module__ != "builtins" and user_code(
        getattr(sys.modules.get(cls.__module__), "__file__", None) or "<unknown>")


def _slot_names(cls: type) -> tuple[str, ...]:
    """The instance attributes ``cls`` and its bases declare in ``__slots__`` (mangled as
    Python stores them), but ``__dict__`` and ``__weakref__``."""
    out = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{c.__name__.lstrip('_')}{name}"
            out.append(name)
    return tuple(out)


def _own(obj: Any) -> dict[str, Any]:
    """An object's own attributes: its ``__dict__``, then its slots that are set (a
    ``@dataclass(slots=True)`` has only those)."""
    own = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for name in _slot_names(type(obj)):
        try:
            own.setdefault(name, object.__getattribute__(obj, name))
        except AttributeError:  # (a slot not set)
            pass
    return own


def _is_plain(obj: Any) -> bool:
    """An instance of a class of the user's that is not a module, optimizer or function."""
    if _is_library_object(obj) or isinstance(obj, types.FunctionType):
        return False
    if isinstance(obj, (dict, list, tuple, set, frozenset)):  # a container (a model's output record is a dict)
        return False
    return (hasattr(obj, "__dict__") or bool(_slot_names(type(obj)))) and _user_class(type(obj))


def class_value(cls: type, name: str) -> Any:
    """What ``obj.name`` finds on ``obj``'s class ``cls`` (or the base that holds it) where that
    is plain data of a user class (a number, a table, a library function); ``_MISSING`` where a
    library's class answers (torch's ``nn.Module``), and for methods, properties and other
    descriptors (anything with ``__get__``): code, bound or run at each read, so that the value
    read would be another bound method at every check. (What a property's code reads is seen
    in its own frame; a method replaced on the class is not seen between calls.)"""
    if name[:2] == "__":
        return _MISSING
    for c in cls.__mro__:
        v = c.__dict__.get(name, _MISSING)
        if v is not _MISSING:
            return v if _user_class(c) and not hasattr(type(v), "__get__") else _MISSING
    return _MISSING


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    """An object's attributes as it is used whole: its own, then what its classes hold as plain
    data that its own do not cover (:func:`class_value`); up to ``MAX_LEAVES``."""
    own = _own(obj)
    items = [(k, v) for k, v in own.items() if not k.startswith("__")]
    cls = type(obj)
    names = dict.fromkeys(k for c in cls.__mro__ if _user_class(c) for k in vars(c) if k not in own)
    items += [(k, v) for k in names if (v := class_value(cls, k)) is not _MISSING]
    return items[:MAX_LEAVES]


def _namespace_data(ns: type | types.ModuleType) -> list[tuple[str, Any]]:
    """What a class or a Python module of the user's holds as plain data, as a namespace read
    by name (``getattr(Cfg, name)``): a class's as :func:`class_value` finds it (its bases' too;
    no methods or other descriptors, nor a dataclass's field defaults), a module's numbers, strings and containers of them, and
    library functions (``ACT = F.gelu``); not names that start with ``_``, and nothing of
    torch's, the standard library's or a module without a file (``math``); up to
    ``MAX_LEAVES``."""
    if isinstance(ns, type):
        if not _user_class(ns):
            return []
        fields = getattr(ns, "__dataclass_fields__", {})  # (their defaults: the generated __init__'s)
        names = dict.fromkeys(k for c in ns.__mro__ if _user_class(c) for k in vars(c)
                              if k[:1] != "_" and k not in fields)
        items = [(k, v) for k in names if (v := class_value(ns, k)) is not _MISSING]
    else:
        path = getattr(ns, "__file__", None)
        if not isinstance(path, str) or not user_code(path):
            return []
        items = [(k, v) for k, v in vars(ns).items() if k[:1] != "_" and (
            _plain_size(v, MAX_SNAPSHOT) is not None
            or isinstance(v, (types.BuiltinFunctionType, types.FunctionType)) and not _is_user_function(v))]
    return items[:MAX_LEAVES]


def _holds_tensor(v: Any) -> bool:
    """Whether ``v`` is a tensor, or a list, tuple or dict with one among its first items."""
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, (list, tuple, dict)):
        items = v.values() if isinstance(v, dict) else v
        return any(isinstance(e, torch.Tensor) for e in itertools.islice(items, MAX_LEAVES))
    return False


class WeakAttrs:
    """The attributes of an object, read without keeping it alive: ``holder[name]`` is
    ``getattr(obj, name)``, a ``KeyError`` once the object is gone (a guard then fails: fn
    reaches another object now). The root of the guards on a plain object that holds tensors,
    which a guard holding it would keep alive as long as the program.

        >>> class Helper: ...
        >>> h = Helper(); h.scale = 2.0
        >>> g = Guard("h.scale", WeakAttrs(h), (("item", "scale"),), 2.0)
        >>> holds(g), setattr(h, "scale", 3.0), holds(g)
        (True, None, False)
        >>> del h; describe(g)
        'h.scale: 2.0 -> <gone>'
    """

    __slots__ = ("ref",)

    def __init__(self, obj: Any) -> None:
        self.ref = weakref.ref(obj)

    def __getitem__(self, name: str) -> Any:
        obj = self.ref()
        if obj is None:
            raise KeyError(name)
        return getattr(obj, name)

    def __reduce__(self) -> tuple[Any, ...]:  # (a kept program writes the object by its path from fn)
        obj = self.ref()
        if obj is None:
            raise TypeError("the object a guard reads is gone")
        return (WeakAttrs, (obj,))


@functools.lru_cache(maxsize=None)
def _torch_optimizer_attributes() -> frozenset[str]:
    """The instance attributes torch's ``Optimizer`` keeps (in this torch version), and the
    flag an LR scheduler sets in its step wrapper."""
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    return frozenset(vars(probe)) | {"state", "param_groups", "defaults", "_opt_called"}


# A tensor's own hooks (``p.register_hook``, ``p.register_post_accumulate_grad_hook``): run by
# autograd in the backward the program was captured from, which a hook added later is not in.
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def tensor_hook_guards(p: torch.Tensor, label: str) -> list[Guard]:
    """Guards on the hooks of parameter ``p``: None where it has none (the C++ check reads the
    tensor's field itself, a few ns: guards.cpp), else their number."""
    out = []
    for name in _TENSOR_HOOKS:
        hooks = getattr(p, name, _MISSING)
        if hooks is None:
            out.append(Guard(f"{label}.{name}", p, (("attr", name),), None, "is"))
        elif isinstance(hooks, dict):
            out.append(len_guard(f"{label}.{name}", p, (("attr", name),), hooks))
    return out


def _defaults_guards(label: str, root: Any, path: tuple, f: types.FunctionType) -> list[Guard]:
    """Guards on a user function's defaults (its frame reads them as locals, which no scan
    sees): plain ones compared whole (a copy of the keyword defaults, a dict), others by identity."""
    out = []
    d = f.__defaults__
    if d is not None:
        out.append(Guard(f"{label}.__defaults__", root, path + (("attr", "__defaults__"),), d,
                         "eq" if is_scalar(d) else "is"))
    kw = f.__kwdefaults__
    if kw:
        plain = _plain_size(kw, MAX_SNAPSHOT) is not None
        out.append(Guard(f"{label}.__kwdefaults__", root, path + (("attr", "__kwdefaults__"),),
                         dict(kw) if plain else kw, "eq" if plain else "is"))
    return out


def method_guards(label: str, obj: Any, name: str, f: types.FunctionType, cls_at: tuple[Any, tuple] | None,
                  own_at: tuple[Any, tuple]) -> list[Guard]:
    """Guards on the code ``obj.name`` runs (a method ``f`` its class answered): the class still
    answers with ``f``, read at ``cls_at`` (root, path to ``obj``; None: guarded already), and
    ``obj`` holds none of its own in front of it, an "absent" item of its ``__dict__`` at
    ``own_at`` (root, path to that dict)."""
    out = []
    if cls_at is not None and getattr(type(obj), name, None) is f:  # (a plain function: not a classmethod)
        root, at = cls_at
        out.append(Guard(f"{type(obj).__qualname__}.{name}", root, at + (("attr", "__class__"), ("attr", name)), f, "is"))
    root, at = own_at
    out.append(Guard(label, root, at + (("item", name),), None, "absent"))
    return out


def _is_user_function(v: Any) -> bool:
    return isinstance(v, types.FunctionType) and user_code(v.__code__.co_filename)


# --- recording during capture --------------------------------------------------------------

@dataclass
class Recorder:
    """Collects the guards of one capture run. Enter it around the run (``with recorder:``);
    afterwards :meth:`tensor_guards` adds the parameters' guards, ``guards`` holds them all,
    :meth:`replays` the writes to repeat after each call, and :meth:`changed_during_run` what
    fn read and then changed (refused); :meth:`undo_writes` puts Python state back for a
    capture that is discarded."""

    fn: Callable[..., Any]
    active: bool = True  # False: records nothing (a capture whose program is not guarded)
    guards: dict[tuple[int, tuple], Guard] = field(default_factory=dict)
    # (id(module dict), key) -> (module __dict__, the value before fn's first write)
    written: dict[tuple[int, str], tuple[dict, Any]] = field(default_factory=dict)
    # the same for tensors fn assigned (refused, but a discarded run must not leave them: a fake one's)
    tensor_written: dict[tuple[int, str], tuple[dict, Any]] = field(default_factory=dict)
    global_writes: dict[tuple[int, str], tuple[Any, str, Any]] = field(default_factory=dict)
    functions: dict[types.CodeType, list[types.FunctionType]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    # id(param) -> (param, its .grad and requires_grad when first seen: at the start for what fn reaches)
    grads: dict[int, tuple[torch.Tensor, Any, bool]] = field(default_factory=dict)
    _used: set = field(default_factory=set)
    _ignored: set = field(default_factory=set)  # ids of module __dict__s that are not fn's
    _thread: int = 0
    _grad_input_ids: set = field(default_factory=set)
    _grad_inputs: tuple | None = None
    module_tensor_writes: list[str] = field(default_factory=list)
    _seen_code: set = field(default_factory=set)
    _per_object: set = field(default_factory=set)  # user codes that use their first argument
    _seen_objects: set = field(default_factory=set)  # ids of the plain objects guarded whole
    # ids of the plain objects the run made (their __init__ ran): fn's own, no guard's. (An id a
    # later object takes once one dies is that of an object the run made too.)
    _made: set = field(default_factory=set)
    _class_scanned: set = field(default_factory=set)  # (code, object id or class): class reads guarded
    _class_methods: set = field(default_factory=set)  # (id(class), name): a method's guard (method_read)
    _weak: list = field(default_factory=list)  # the WeakAttrs roots of guards (drop_gone)
    _active: bool = False
    _prev_trace: Any = None
    _hook: str = ""  # how frames reach the recorder: "monitoring" (frame_starts) or "trace" (sys.settrace)
    _objects: list[Any] = field(default_factory=list)  # keeps ids in `guards` / `names` valid
    # what fn used whole that no guard covers (_unguarded): GuardSet.unguarded
    unguarded: list[str] = field(default_factory=list)
    # the functions the run called through torch function dispatch (library_function_guards)
    torch_functions: set = field(default_factory=set)

    # -- set-up: names for the objects fn reaches, and its parameters' grads --
    def __post_init__(self) -> None:
        if not self.active:
            return
        self._index_function(self.fn)
        for label, obj in self._roots():
            self._name_tree(label, obj)

    def _roots(self) -> list[tuple[str, Any]]:
        """(name, object) for fn's closure variables and the globals its code names, and theirs
        for the user functions among them (a breadth-first walk, each function once)."""
        out: list[tuple[str, Any]] = []
        seen: set[int] = set()
        todo = [f for fs in self.functions.values() for f in fs]
        while todo:
            f = todo.pop(0)
            if id(f) in seen:
                continue
            seen.add(id(f))
            code = f.__code__
            cells: list[tuple[str, Any]] = []
            for name, cell in zip(code.co_freevars, f.__closure__ or ()):
                try:
                    cells.append((name, cell.cell_contents))
                except ValueError:  # an empty cell
                    pass
            # A library function's globals are its module's, not the user's: only its closure
            # (a wrapper or decorator keeps the user's function there) leads on.
            found = cells + ([(name, f.__globals__[name]) for name in global_names(code) if name in f.__globals__]
                             if user_code(code.co_filename) else [])
            for k, (_, v) in enumerate(found):
                for g in _functions_in(v):
                    if id(g) not in seen and (k < len(cells) or _is_user_function(g)):
                        self._index_function(g)
                        todo.append(g)
            out += found
        return out

    def _index_function(self, f: Any) -> None:
        for g in _functions_in(f):
            known = self.functions.setdefault(g.__code__, [])
            if not any(h is g for h in known):
                known.append(g)

    def _name_tree(self, label: str, obj: Any) -> None:
        if id(obj) in self.names:
            return
        if isinstance(obj, torch.nn.Module):
            for qual, m in obj.named_modules(remove_duplicate=False):
                if id(m) not in self.names:
                    self.names[id(m)] = f"{label}.{qual}" if qual else label
                    self._objects.append(m)
                    self._objects.append(vars(m))
                    self.names[id(vars(m))] = self.names[id(m)]
            for qual, p in obj.named_parameters(remove_duplicate=False):
                self.names.setdefault(id(p), f"{label}.{qual}")
                self._note_param(p)
        elif isinstance(obj, torch.optim.Optimizer):
            self.names[id(obj)] = label
            self._objects.append(obj)
            for gi, group in enumerate(obj.param_groups):
                self.names[id(group)] = f"{label}.param_groups[{gi}]"
                self._objects.append(group)
                for p in group["params"]:
                    self._note_param(p)
        elif not _is_library_object(obj) and not callable(obj) and hasattr(obj, "__dict__"):
            self.names[id(obj)] = label  # a trainer or config object: name it, walk its modules
            self._objects.append(obj)
            for k, v in list(vars(obj).items())[:MAX_LEAVES]:
                if isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
                    self._name_tree(f"{label}.{k}", v)

    def _note_param(self, p: torch.Tensor) -> None:
        if id(p) not in self.grads:
            self.grads[id(p)] = (p, p.grad, p.requires_grad)

    def grad_inputs(self) -> tuple[torch.Tensor, ...]:
        """The parameters fn reaches whose ``.grad`` exists at the start of the capture (the
        first call of this method, before the run)."""
        if self._grad_inputs is None:
            self._grad_inputs = tuple(p for p, g, _ in self.grads.values() if g is not None)
        return self._grad_inputs

    def name_of(self, obj: Any, fallback: str) -> str:
        return self.names.get(id(obj), fallback)

    # -- recording --
    def add(self, g: Guard) -> None:
        key = (id(g.root), g.path)
        if key not in self.guards:
            self.guards[key] = g
            self._objects.append(g.root)

    def add_chain(self, label: str, root: Any, path: tuple[tuple[str, Any], ...]) -> None:
        """Guard what ``path`` from ``root`` reaches now: a scalar by value, a user function by
        identity, a container or plain object used whole by its scalar leaves."""
        v = read(root, path)
        if v is _MISSING:
            return
        if isinstance(v, types.MethodType) and _is_user_function(v.__func__) and _is_plain(v.__self__):
            # x.method(...) of the user's: its frame guards what it reads of x (object_entered);
            # here its code: the class still answers with it, and x holds none of its own
            if path[-1][0] == "attr" and isinstance(getattr(v.__self__, "__dict__", None), dict):
                at = path[:-1]
                for g in method_guards(label, v.__self__, path[-1][1], v.__func__, (root, at),
                                       (root, at + (("attr", "__dict__"),))):
                    self.add(g)
            return
        if callable(v) and not isinstance(v, (torch.nn.Module, type)) and path and path[-1][0] == "attr" \
                and len(path) > 1 and not _is_user_function(v):
            parent = read(root, path[:-1])
            if isinstance(parent, types.ModuleType):  # F.gelu, torch.tanh: the module's entry, by identity
                d, name = vars(parent), path[-1][1]  # (F.gelu = patched captures again)
                if d.get(name, _MISSING) is v:
                    self.add(Guard(label, d, (("item", name),), v, "is"))
                return
            # x.method(...): x is used whole (bound builtin methods such as dict.get)
            path = path[:-1]
            label = label.rsplit(".", 1)[0]
            v = read(root, path)
        self._guard_value(label, root, path, v, depth=0, budget=[MAX_LEAVES])

    def _guard_value(self, label: str, root: Any, path: tuple, v: Any, depth: int, budget: list[int]) -> None:
        if budget[0] <= 0:
            self._unguarded(label)
            return
        if is_scalar(v):
            budget[0] -= 1
            self.add(Guard(label, root, path, v, "is" if v is None or isinstance(v, (bool, enum.Enum)) else "eq"))
            return
        if _is_user_function(v):
            budget[0] -= 1
            self.add(Guard(label, root, path, v, "is"))
            for g in _defaults_guards(label, root, path, v):
                self.add(g)
            self._index_function(v)
            return
        if isinstance(v, (torch.nn.Module, torch.optim.Optimizer)):
            # (by identity: a module swapped into a Sequential, or into a global, is another
            # program; a named attribute's is guarded where nn.Module.__getattr__ reads it)
            budget[0] -= 1
            self.add(Guard(label, root, path, v, "is"))
            self._name_tree(label, v)
            return
        if depth == 0 and isinstance(v, (type, types.ModuleType)):
            # a class or a Python module of the user's used whole, as a namespace
            # (``getattr(Cfg, name)``, ``vars(config)``): its plain data, as a plain object's
            self.names.setdefault(id(v), label)
            for k, e in _namespace_data(v):
                self._guard_value(f"{label}.{k}", root, path + (("attr", k),), e, depth + 1, budget)
            return
        if callable(v) and not isinstance(v, (type, types.ModuleType)):
            budget[0] -= 1  # (a library function in a global or closure: F.silu for F.gelu is another program)
            self.add(Guard(label, root, path, v, "is"))
            return
        if _is_library_object(v):
            return
        if isinstance(v, (dict, list, tuple, set, frozenset)):
            self._guard_container(label, root, path, v, depth, budget)
        elif depth >= MAX_DEPTH:
            if _is_plain(v):
                self._unguarded(label)
        elif (hasattr(v, "__dict__") and not isinstance(v, types.FunctionType)) or _is_plain(v):
            self.names.setdefault(id(v), label)  # (a plain object, slotted ones among them)
            for k, e in _attributes(v):
                self._guard_value(f"{label}.{k}", root, path + (("attr", k),), e, depth + 1, budget)

    def _guard_container(self, label: str, root: Any, path: tuple, v: Any, depth: int, budget: list[int]) -> None:
        """A container used whole: its length and its leaves one by one where they fit the
        budget and depth; else, where it holds plain values only, one guard comparing it with a
        copy (a set always: its items have no path); else as far as the budget reaches, the rest
        listed as unguarded."""
        size = _plain_size(v, MAX_SNAPSHOT)
        fits = size is not None and size[0] <= budget[0] and depth + size[1] <= MAX_DEPTH
        if size is not None and (not fits or isinstance(v, (set, frozenset))):
            snap = _snapshot(v)
            if snap is not _MISSING:
                budget[0] -= 1
                self.add(Guard(label, root, path, snap, "eq"))
                if isinstance(v, dict):  # (the copy compares equal in any order)
                    self.add(order_guard(label, root, path, v))
                return
        if depth >= MAX_DEPTH:
            self._unguarded(label)
            return
        self.add(order_guard(label, root, path, v))
        budget[0] -= 1
        if isinstance(v, (set, frozenset)):  # (items of a set have no path: its length alone)
            self._unguarded(f"{label} (items)")
            return
        items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
        if len(items) > MAX_LEAVES:
            self._unguarded(f"{label}[{MAX_LEAVES}:]")
        for k, e in items[:MAX_LEAVES]:
            try:
                hash(k)
            except TypeError:
                self._unguarded(f"{label}[{k!r}]")
                continue
            self._guard_value(f"{label}[{k!r}]", root, path + (("item", k),), e, depth + 1, budget)

    def _unguarded(self, label: str) -> None:
        """A value of something used whole that no guard covers (past the depth or the leaf
        budget, and not all plain values): listed, so that it is not left out unseen."""
        if len(self.unguarded) < MAX_LEAVES and label not in self.unguarded:
            self.unguarded.append(label)

    def module_read(self, module: torch.nn.Module, name: str, value: Any, frame: Any) -> None:
        """``module.name`` was read from its ``__dict__`` (by the wrapped ``__getattribute__``)."""
        d = object.__getattribute__(module, "__dict__")
        if (id(d), name) in self.written or isinstance(value, torch.Tensor) or id(d) in self._ignored:
            return
        label = f"{self.name_of(module, type(module).__name__)}.{name}"
        path: tuple[tuple[str, Any], ...] = (("item", name),)
        if callable(value) and not isinstance(value, torch.nn.Module):  # a function kept on the module
            self.add(Guard(label, d, path, value, "is"))
            if _is_user_function(value):
                for g in _defaults_guards(label, d, path, value):
                    self.add(g)
            return
        if not is_scalar(value) and frame is not None:
            path += _chain_at(frame, name)
            label += "".join(f"[{a!r}]" if k == "item" else f".{a}" for k, a in path[1:])
        self.add_chain(label, d, path)

    def class_read(self, module: torch.nn.Module, name: str) -> None:
        """``module.name`` was answered by the module's class, not its ``__dict__`` (by the wrapped
        ``__getattribute__``): guarded where a class of the user's holds it as plain data."""
        value = class_value(type(module), name)
        if value is not _MISSING:
            d = object.__getattribute__(module, "__dict__")
            self._class_guard(module, name, value, on_class=id(d) in self._ignored)

    def method_read(self, module: torch.nn.Module, name: str, bound: types.MethodType) -> None:
        """``module.name`` was a method its class answered (``self.forward``, which ``_call_impl``
        reads): the class must still answer with the same function (``Block.forward = other``
        captures again) and the instance must not hold one of its own in front of it
        (``model.block.forward = other``). The class's is read through the module
        (``module.__class__.name``), which a kept program's walk reaches."""
        d = object.__getattribute__(module, "__dict__")
        if id(d) in self._ignored or (id(d), name) in self.written:
            return
        if _MODULE_METHODS.get(name) is bound.__func__:
            return  # nn.Module's own machinery (``_call_impl``): torch's, not the model's code
        key = (id(type(module)), name)  # (the class's function once per class)
        first = key not in self._class_methods
        self._class_methods.add(key)
        for g in method_guards(f"{self.name_of(module, type(module).__name__)}.{name}", module, name, bound.__func__,
                               (module, ()) if first else None, (d, ())):
            self.add(g)

    def _class_guard(self, obj: Any, name: str, value: Any, on_class: bool) -> None:
        """Guard ``obj.name``, which ``obj``'s class answers with ``value``: read from the object
        (an instance attribute set later covers the class's), or (``on_class``: the object is
        the run's own, or a class itself) from the class."""
        if on_class:
            cls = obj if isinstance(obj, type) else type(obj)
            root, label = cls, f"{cls.__name__}.{name}"
        else:
            root, label = obj, f"{self.name_of(obj, type(obj).__name__)}.{name}"
        self._guard_value(label, root, (("attr", name),), value, 1, [MAX_LEAVES])

    def member_read(self, module: torch.nn.Module, name: str, value: Any) -> None:
        """A parameter, buffer or submodule read (``nn.Module.__getattr__``): the program binds
        it, so it must still be the same object (``model.fc = nn.Linear(...)`` re-captures)."""
        d = object.__getattribute__(module, "__dict__")
        if id(d) in self._ignored or isinstance(value, FakeTensor):
            # (a fake tensor there is one fn put in for the run, as torch.func.functional_call
            # swaps in its arguments' fake stand-ins: the program binds no module member for it)
            return
        for table in ("_parameters", "_buffers", "_modules"):
            members = d.get(table)
            if members is not None and name in members and members[name] is value:
                label = f"{self.name_of(module, type(module).__name__)}.{name}"
                self.add(Guard(label, members, (("item", name),), value, "is"))
                return

    def module_write(self, module: torch.nn.Module, name: str, value: Any) -> None:
        """``module.name = value`` inside fn: replayed after each call (refused for tensors).
        Only modules fn reaches count (not those tracing machinery makes, such as make_fx's root)."""
        d = object.__getattribute__(module, "__dict__")
        if id(d) in self._ignored:
            return
        if isinstance(value, torch.Tensor) and any(value is d.get(t, {}).get(name, _MISSING)
                                                   for t in ("_parameters", "_buffers")) or value is d.get(name, _MISSING):
            return  # the object already there (spectral_norm's ``self._u = normalize(..., out=self._u)``)
        if isinstance(value, torch.Tensor) or (name in d.get("_parameters", {}) or name in d.get("_buffers", {})):
            table = next((d[t] for t in ("_parameters", "_buffers") if name in d.get(t, {})), d)
            self.tensor_written.setdefault((id(table), name), (table, table.get(name, _MISSING)))
            self.module_tensor_writes.append(f"{self.name_of(module, type(module).__name__)}.{name}")
            return
        if isinstance(value, torch.nn.Module):
            return
        key = (id(d), name)
        if key not in self.written:
            self.written[key] = (d, d.get(name, _MISSING))
            self._objects.append(d)
            # (fn sets it, and a call replays that: its absence before is no guard's)
            g = self.guards.get((id(d), (("item", name),)))
            if g is not None and g.match == "absent":
                del self.guards[(id(d), (("item", name),))]

    def frame_entered(self, frame: Any) -> None:
        """A user frame started: guard the globals and closure variables its code reads."""
        code = frame.f_code
        info = code_reads(code)
        if info.uses_arg0:
            self._per_object.add(code)
            self.object_entered(frame)
        cells = None
        for kind, name, steps in info.reads:
            label = name + "".join(f"[{a!r}]" if k == "item" else f".{a}" for k, a in steps)
            if kind == "global":
                g = frame.f_globals
                if name not in g:
                    continue  # a builtin
                if (id(g), name) in self.global_writes:
                    continue
                self.add_chain(label, g, (("item", name),) + steps)
            else:
                if cells is None:
                    cells = self._cells(code)
                for cell in cells.get(name, ()):
                    if (id(cell), name) not in self.global_writes:
                        self.add_chain(label, cell, (("cell", None),) + steps)
        for kind, name in info.writes:
            if kind == "global":
                g = frame.f_globals
                self.global_writes.setdefault((id(g), name), (g, name, g.get(name, _MISSING)))
                self._objects.append(g)
            else:
                for cell in (self._cells(code) if cells is None else cells).get(name, ()):
                    try:
                        old = cell.cell_contents
                    except ValueError:
                        old = _MISSING
                    self.global_writes.setdefault((id(cell), name), (cell, name, old))
                    self._objects.append(cell)

    def object_entered(self, frame: Any) -> None:
        """A user frame that uses its first argument started. Where that argument is a plain
        object of the user's (a helper class's ``self``, a config passed in; not a tensor or
        container), it is used whole: its attributes, its own and the plain data its classes
        hold, are guarded (once per object), so a change between calls re-captures and a change
        during the run (``self.n += 1``) is refused. One that holds tensors is read through a
        weak reference (:class:`WeakAttrs`): a guard must not keep them alive. An object the run
        makes (its ``__init__`` runs now: an output record) is fn's own: only what its class
        holds is guarded, as for a module (whose own reads the hooks see) and a class (a
        classmethod's ``cls``): :meth:`_class_reads`."""
        code = frame.f_code
        obj = frame.f_locals.get(code.co_varnames[0], _MISSING)
        if obj is _MISSING:
            return
        if code.co_name in ("__init__", "__new__", "__post_init__"):
            if code.co_name != "__new__" and _is_plain(obj):
                self._made.add(id(obj))  # an object being made, by this run: nothing of it to guard
            return
        if isinstance(obj, (torch.nn.Module, type)) or (id(obj) in self._made and _is_plain(obj)):
            self._class_reads(code, obj)
            return
        if isinstance(obj, torch.optim.Optimizer):
            if _user_class(type(obj)):
                self._optimizer_entered(obj)
            return
        if not _is_plain(obj) or id(obj) in self._seen_objects:
            return
        self._seen_objects.add(id(obj))
        if any(_holds_tensor(e) for e in _own(obj).values()):
            try:
                root: Any = WeakAttrs(obj)
            except TypeError:  # (no weak reference to it: nothing is read that would hold it)
                return
            self._weak.append(root)
            step, label = "item", self.names.get(id(obj)) or type(obj).__name__
        else:
            self._objects.append(obj)
            root, step, label = obj, "attr", self.names.setdefault(id(obj), type(obj).__name__)
        budget = [MAX_LEAVES]
        for k, e in _attributes(obj):
            self._guard_value(f"{label}.{k}", root, ((step, k),), e, 1, budget)

    def _optimizer_entered(self, opt: torch.optim.Optimizer) -> None:
        """A method of the user's optimizer class (its ``step``): the plain data it holds of its
        own (``self.clip``, and its class's) is guarded as a plain object's; what torch's
        ``Optimizer`` keeps (``state``, ``param_groups``, ``defaults``, hooks) has guards of its
        own (:func:`optimizer_guards`), and functions on it (an LR scheduler's ``step`` wrapper)
        are code. The optimizer is held: its program binds its state anyway."""
        if id(opt) in self._seen_objects:
            return
        self._seen_objects.add(id(opt))
        self._objects.append(opt)
        label = self.names.setdefault(id(opt), type(opt).__name__)
        torch_own = _torch_optimizer_attributes()
        budget = [MAX_LEAVES]
        for k, e in _attributes(opt):
            if k not in torch_own and not k.startswith("_warned") and not callable(e):
                self._guard_value(f"{label}.{k}", opt, (("attr", k),), e, 1, budget)

    def _class_reads(self, code: types.CodeType, obj: Any) -> None:
        """Guard the attribute names ``code`` loads that ``obj``'s class answers with plain data
        (``type(self).shift``, ``self.shift`` where ``class Block: shift = 0.5``), once per code
        and object: on the object where it outlives the run, else (a class, an object the run
        made) on the class."""
        on_class = isinstance(obj, type) or id(obj) in self._made or id(vars(obj)) in self._ignored
        cls = obj if isinstance(obj, type) else type(obj)
        key = (code, cls if on_class else id(obj))
        if key in self._class_scanned:
            return
        self._class_scanned.add(key)
        own = {} if isinstance(obj, type) else _own(obj)
        for name in code_reads(code).attrs:
            if name not in own and (value := class_value(cls, name)) is not _MISSING:
                self._class_guard(obj, name, value, on_class)

    def _cells(self, code: types.CodeType) -> dict[str, list[Any]]:
        """The closure cells of the functions with this code that fn reaches (a function made
        inside fn reads per-call values, which are no guard's business)."""
        out: dict[str, list[Any]] = {}
        for f in self.functions.get(code, ()):
            for name, cell in zip(code.co_freevars, f.__closure__ or ()):
                if name != "__class__":
                    out.setdefault(name, []).append(cell)
        return out

    # -- the hooks --
    def __enter__(self) -> Recorder:
        if not self.active:
            return self
        self._active = True
        self._thread = threading.get_ident()  # (the hooks are the class's: other threads' reads are not fn's)
        try:  # make_fx's own root module (it keeps the graph's constants) is not fn's
            from torch.fx.experimental.proxy_tensor import get_proxy_mode

            mode = get_proxy_mode()
            root = getattr(getattr(mode, "tracer", None), "root", None)
            if root is not None:
                self._ignored.add(id(vars(root)))
        except Exception:
            pass
        _ACTIVE.append(self)
        if len(_ACTIVE) == 1:
            torch.nn.Module.__getattribute__ = _recording_getattribute  # type: ignore[method-assign]
            _ORIGINAL["setattr"] = torch.nn.Module.__setattr__
            torch.nn.Module.__setattr__ = _recording_setattr  # type: ignore[method-assign]
            _ORIGINAL["getattr"] = torch.nn.Module.__getattr__
            torch.nn.Module.__getattr__ = _recording_getattr  # type: ignore[method-assign]
            _ORIGINAL["init"] = torch.nn.Module.__init__
            torch.nn.Module.__init__ = _recording_init  # type: ignore[method-assign]
            if hasattr(copy, "_reconstruct"):  # (the standard library's private helper: checked)
                _ORIGINAL["reconstruct"] = copy._reconstruct  # type: ignore[attr-defined]
                copy._reconstruct = _recording_reconstruct  # type: ignore[attr-defined]
        # Before Python 3.12, a global trace function sees each Python frame once, when it starts
        # (returning None leaves the frame untraced): a profile function would also see every C
        # call and return, which doubled the capture time of a transformer block. A tracer the
        # user runs (a debugger, coverage) pauses for the capture: its frames are flowexec's
        # tracing. From 3.12, sys.monitoring reports each code's first frame alone, and leaves a
        # user's tracer running.
        if _FRAME_HOOK != "trace" and frame_starts.available():  # Python 3.12+: each code's first frame only
            frame_starts.start(self, user_code)
            self._hook = "monitoring"
            return self
        self._hook = "trace"
        self._prev_trace = sys.gettrace()
        native = _NATIVE_TRACER.get("make")
        if native is not None:  # the same tracer in C (runtime/csrc/codetracer.cpp): a quarter of the capture less
            native(self._seen_code, self._per_object, self._new_code, self._object_code).install()
        else:
            sys.settrace(self._tracer())
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.active:
            return
        if self._hook == "monitoring":
            frame_starts.stop(self)
        elif isinstance(prev := self._prev_trace, _NATIVE_TRACER.get("type", ())):  # an outer capture's C tracer
            prev.install()
        else:
            sys.settrace(prev)
        self._active = False
        _ACTIVE.remove(self)
        if not _ACTIVE:
            del torch.nn.Module.__getattribute__
            torch.nn.Module.__setattr__ = _ORIGINAL.pop("setattr")  # type: ignore[method-assign]
            torch.nn.Module.__getattr__ = _ORIGINAL.pop("getattr")  # type: ignore[method-assign]
            torch.nn.Module.__init__ = _ORIGINAL.pop("init")  # type: ignore[method-assign]
            if "reconstruct" in _ORIGINAL:
                copy._reconstruct = _ORIGINAL.pop("reconstruct")  # type: ignore[attr-defined]

    def _tracer(self) -> Callable[[Any, str, Any], None]:
        """The global trace function: the first frame of each user code object is scanned (it
        runs for every Python frame the capture starts, ~0.6M for a transformer block: kept to
        a set lookup). Where the native extension is loaded, a C trace function does those
        lookups and calls :meth:`_new_code` and :meth:`_object_code` itself."""
        seen = self._seen_code
        per_object = self._per_object
        new_code, object_code = self._new_code, self._object_code

        def trace(frame: Any, event: str, arg: Any) -> None:
            code = frame.f_code
            if code in seen:
                if code in per_object:
                    object_code(frame)
            else:
                new_code(frame)
        return trace

    def _new_code(self, frame: Any) -> None:
        """The first frame of a code object: scanned if the code is the user's."""
        code = frame.f_code
        self._seen_code.add(code)
        if not (self._active and user_code(code.co_filename)):
            return
        if not generated_code(code):
            self._scan(self.frame_entered, frame)
        elif code.co_name == "__init__":  # a dataclass's: what it makes is the run's own (object_entered)
            self._per_object.add(code)
            self._scan(self.object_entered, frame)

    def _object_code(self, frame: Any) -> None:
        """Another frame of a user code that takes its object as first argument."""
        if self._active:
            self._scan(self.object_entered, frame)  # the same method on another object

    def _scan(self, scan: Callable[[Any], None], frame: Any) -> None:
        self._active = False  # the recorder's own reads are not fn's
        try:
            scan(frame)
        finally:
            self._active = True

    # -- after the run --
    def user_codes(self) -> list[types.CodeType]:
        """The code objects of the user's and libraries' (not torch's, flowexec's or the standard
        library's) whose frames the run started."""
        return [c for c in self._seen_code if user_code(c.co_filename)]

    def drop_gone(self) -> None:
        """After the run: drop the guards read through a weak reference (:class:`WeakAttrs`) to
        an object that did not outlive it. The run made that one (an output record a dataclass
        made, handed to a method), and each call makes another: a guard on it would fail at
        every call."""
        gone = {id(w) for w in self._weak if w.ref() is None}
        if gone:
            self.guards = {k: g for k, g in self.guards.items() if id(g.root) not in gone}

    def use_leaf(self, t: torch.Tensor) -> None:
        """A leaf tensor that requires grad was an argument of a traced op."""
        self._used.add(id(t))
        self._note_param(t)

    def tensor_guards(self, state: Iterable[torch.Tensor], stepped: Iterable[torch.Tensor], grads: bool = True) -> None:
        """``requires_grad`` of the parameters the program uses (as it was before the run,
        unless fn itself changed it), and (``grads``) whether each one's ``.grad`` is still the
        tensor the program reads, or still None where it was None; ``stepped``: the parameters
        of the optimizers that stepped (their ``.grad`` decides whether they are stepped)."""
        state_ids = {id(t) for t in state}
        self._grad_input_ids = {id(p) for p in self.grad_inputs()}
        stepped_ids = set()
        for p in stepped:
            self._note_param(p)
            stepped_ids.add(id(p))
        for pid, (p, g0, rg0) in self.grads.items():
            if not (pid in state_ids or pid in self._used or pid in stepped_ids):
                continue
            label = self.names.get(pid) or f"parameter{list(p.shape)}"
            if p.requires_grad == rg0:
                self.add(Guard(f"{label}.requires_grad", p, (("attr", "requires_grad"),), rg0, "is"))
            for g in tensor_hook_guards(p, label):
                self.add(g)
            if not grads:
                continue
            if g0 is None:
                self.add(Guard(f"{label}.grad", p, (("attr", "grad"),), None, "is", settles=True))
            elif pid in self._grad_input_ids:  # an input: any tensor of its kind, read per call
                self.add(Guard(f"{label}.grad", p, (("attr", "grad"),), tensor_kind(g0), "grad"))
            elif id(g0) in state_ids:
                self.add(Guard(f"{label}.grad", p, (("attr", "grad"),), g0, "is"))

    def replays(self) -> tuple[Replay, ...]:
        """The assignments to repeat after each call: module attributes, then globals and
        closure variables fn stores (tensors among them are refused: ``module_tensor_writes``)."""
        out = []
        for (_, key), (d, _old) in self.written.items():
            if key in d:
                out.append(Replay(f"{self.names.get(id(d), 'module')}.{key}", d, key, d[key]))
        for owner, name, _old in self.global_writes.values():
            value = owner.get(name, _MISSING) if isinstance(owner, dict) else _cell_value(owner)
            if value is _MISSING:
                continue
            if isinstance(value, torch.Tensor):
                self.module_tensor_writes.append(f"global {name}" if isinstance(owner, dict) else f"closure {name}")
            else:
                out.append(Replay(name, owner, name, value))
        return tuple(out)

    def changed_during_run(self) -> list[str]:
        """The guarded values fn itself changed during the run (read, then written): no compiled
        call can replay that."""
        bad = []
        for g in self.guards.values():
            if g.path and g.path[-1][0] in ("attr",) and isinstance(g.root, torch.Tensor):
                continue  # requires_grad / grad: fn may (re)create grads; the program re-binds them
            if g.path and g.path[0][0] == "state":
                continue
            if not holds(g):
                bad.append(describe(g))
        return bad

    def undo_writes(self) -> None:
        """Put back the attributes, globals and closure variables fn assigned (a capture that
        is discarded leaves Python state as it found it)."""
        for (_, key), (d, old) in [*self.written.items(), *self.tensor_written.items()]:
            if old is _MISSING:
                d.pop(key, None)
            else:
                d[key] = old
        for owner, name, old in self.global_writes.values():
            if isinstance(owner, dict):
                if old is _MISSING:
                    owner.pop(name, None)
                else:
                    owner[name] = old
            elif old is not _MISSING:
                owner.cell_contents = old


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _MISSING


def global_names(code: types.CodeType) -> list[str]:
    """The names ``code`` and the code objects nested in it load (globals among them)."""
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.extend(global_names(c))
    return names


def _functions_in(v: Any) -> list[types.FunctionType]:
    if isinstance(v, types.MethodType):
        v = v.__func__
    if isinstance(v, functools.partial):
        v = v.func
    return [v] if isinstance(v, types.FunctionType) else []


def _chain_at(frame: Any, name: str) -> tuple[tuple[str, Any], ...]:
    """The subscripts and attributes the instruction reading ``name`` in ``frame`` applies next."""
    code = frame.f_code
    ins = _instructions(code)
    for offset in (frame.f_lasti, 2 * frame.f_lasti):  # (bytes; Python 3.10 counts code units)
        k = ins[1].get(offset)
        if k is not None and ins[0][k].opname in ("LOAD_ATTR", "LOAD_METHOD") and ins[0][k].argval == name:
            return chain_after(ins[0], k)
    return ()


_INSTRUCTIONS: "weakref.WeakKeyDictionary[types.CodeType, tuple[list, dict]]" = weakref.WeakKeyDictionary()


def _instructions(code: types.CodeType) -> tuple[list[dis.Instruction], dict[int, int]]:
    hit = _INSTRUCTIONS.get(code)
    if hit is None:
        ins = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
        hit = _INSTRUCTIONS[code] = (ins, {i.offset: k for k, i in enumerate(ins)})
    return hit


_ACTIVE: list[Recorder] = []
_ORIGINAL: dict[str, Any] = {}
# The native extension's C trace function (runtime/fastcall.py registers it when the extension
# loads): "make" builds one (seen, per_object, on_new, on_object), "type" is its class.
_NATIVE_TRACER: dict[str, Any] = {}
# "trace": a trace function even where sys.monitoring is there (Python 3.12+), which it
# otherwise delivers the frames through (flowexec.frame_starts)
_FRAME_HOOK = os.environ.get("FLOWEXEC_FRAME_HOOK", "")


def use_native_tracer(make: Callable[..., Any], kind: type) -> None:
    """Have recorders trace frames with ``make(seen, per_object, on_new, on_object)``, an
    object whose ``install()`` makes it the thread's trace function (runtime/csrc/codetracer.cpp)."""
    _NATIVE_TRACER.update(make=make, type=kind)
_object_getattribute = object.__getattribute__


_FX_DIR = os.path.join(_TORCH_DIR, "fx") + os.sep


def _recorder() -> Recorder | None:
    """The recorder of this thread's capture, while it records."""
    if _ACTIVE:
        me = threading.get_ident()
        for rec in reversed(_ACTIVE):  # (captures on two threads at once: each records its own)
            if rec._thread == me:
                return rec if rec._active else None
    return None


def _recording_getattribute(self: Any, name: str) -> Any:
    value = _object_getattribute(self, name)
    if _ACTIVE and name[:2] != "__":
        own = _object_getattribute(self, "__dict__").get(name, _MISSING) is value
        rec = _recorder()
        frame = sys._getframe(1)
        # reads by the recorder itself or by the tracer (make_fx's root module) are not fn's
        if rec is not None and not frame.f_code.co_filename.startswith(_FX_DIR):
            rec._active = False
            try:
                if own:
                    rec.module_read(self, name, value, frame)
                elif isinstance(value, types.MethodType):  # a method (``self.forward`` in _call_impl)
                    if value.__self__ is self:
                        rec.method_read(self, name, value)
                else:  # answered by the class (or a property's code: class_read tells)
                    rec.class_read(self, name)
            finally:
                rec._active = True
    return value


def _recording_getattr(self: Any, name: str) -> Any:
    value = _ORIGINAL["getattr"](self, name)
    rec = _recorder()
    if rec is not None:
        frame = sys._getframe(1)
        if not frame.f_code.co_filename.startswith(_FX_DIR):
            rec._active = False
            try:
                rec.member_read(self, name, value)
            finally:
                rec._active = True
    return value


def _recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
    # A module made during the run (``layers[:n]`` makes a ModuleList) is fn's own temporary:
    # what is read of it, or written to it, is no guard's or replay's business.
    rec = _recorder()
    if rec is not None:
        rec._ignored.add(id(vars(self)))
    _ORIGINAL["init"](self, *args, **kwargs)


def _recording_reconstruct(*args: Any, **kwargs: Any) -> Any:
    # ``copy.copy`` and ``copy.deepcopy`` of an object (``copy._reconstruct``, which both call)
    # make it without its ``__init__``: a copy the run makes is fn's own as well (a config
    # copied, then trimmed, inside a forward: its attributes are no guard's).
    made = _ORIGINAL["reconstruct"](*args, **kwargs)
    rec = _recorder()
    if rec is not None and _is_plain(made):
        rec._made.add(id(made))
    return made


def _recording_setattr(self: Any, name: str, value: Any) -> None:
    rec = _recorder()
    if rec is not None and not sys._getframe(1).f_code.co_filename.startswith(_FX_DIR):
        rec.module_write(self, name, value)
    _ORIGINAL["setattr"](self, name, value)


# --- optimizers ------------------------------------------------------------------------------

def optimizer_guards(opt: torch.optim.Optimizer, label: str, lifted: set[tuple[int, str]]) -> list[Guard]:
    """Guards on a stepped optimizer's structure (its groups and their parameter lists, its
    state dict) and on every setting its step reads that is not fed (``lifted``: the
    ``(group, key)`` pairs fed as tensors): flags such as ``nesterov`` or ``amsgrad``, and
    values that are not numbers."""
    out = [len_guard(f"{label}.param_groups", opt, (("attr", "param_groups"),), opt.param_groups),
           Guard(f"{label}.state", opt, (("attr", "state"),), opt.state, "is"),
           len_guard(f"{label}.state", opt, (("attr", "state"),), opt.state)]
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):  # (opt.register_step_post_hook)
        if isinstance(getattr(opt, name, None), dict):
            out.append(len_guard(f"{label}.{name}", opt, (("attr", name),), getattr(opt, name)))
    for gi, group in enumerate(opt.param_groups):
        where = f"{label}.param_groups[{gi}]"
        out.append(Guard(where, opt, (("attr", "param_groups"), ("item", gi)), group, "is"))
        out.append(Guard(f"{where}['params']", group, (("item", "params"),), group["params"], "is"))
        out.append(len_guard(f"{where}['params']", group, (("item", "params"),), group["params"]))
        for key in opt.defaults:
            if (gi, key) in lifted or key not in group:
                continue
            v = group[key]
            match = "eq" if is_scalar(v) and not (v is None or isinstance(v, bool)) else "is"
            out.append(Guard(f"{where}[{key!r}]", group, (("item", key),), v, match))
        # Each parameter's state (the program binds its tensors): cleared and made again, or
        # replaced, it is another dict (load_state_dict replaces opt.state itself: guarded above).
        for k, p in enumerate(group["params"]):
            st = dict.get(opt.state, p)
            if st is not None:
                out.append(Guard(f"{label}.state[{where}['params'][{k}]]", opt.state, (("item", p),), st, "is"))
    return out


# --- the per-call check ----------------------------------------------------------------------

@dataclass
class GuardSet:
    """Everything a call of one captured program checks or feeds before it runs, and the
    module attributes it sets afterwards.

    ``check()`` returns -1 when the program fits (and has copied changed hyperparameters into
    its inputs), else the index of what failed: ``i < len(guards)`` a guard, beyond that a fed
    value (``len(guards) + slot``) that a host read or its type ties to the capture.
    """

    guards: tuple[Guard, ...]
    feeds: Any = None  # flowexec.hyperparams.Feeds
    replays: tuple[Replay, ...] = ()
    cleared_grads: tuple[torch.Tensor, ...] = ()  # parameters fn leaves with .grad None (zero_grad)
    # what fn used whole that no guard covers (past the leaf budget or depth, and not all plain
    # values: Recorder.unguarded): a change there is not seen
    unguarded: tuple[str, ...] = ()
    _native: Any = field(default=None, repr=False)

    def native(self) -> Any:
        """The C++ check of these guards and feeds (``runtime/csrc/guards.cpp``), where the
        executable attached one (:func:`flowexec.runtime.fastcall.guard_checker`); else None."""
        return self._native  # (not `or None`: a checker of feeds alone has len 0)

    def attach(self, checker: Any) -> None:
        """Use ``checker`` (a ``GuardChecker`` built from this set) for :meth:`check`'s fast answer."""
        self._native = checker

    def expecting_no_grad(self, params: Iterable[torch.Tensor]) -> GuardSet:
        """This set with each guard on the ``.grad`` of one of ``params`` expecting None, as a
        capture that found it None records (a placeholder gradient a capture ran with, of a
        parameter the step leaves without one); the C++ check is to be attached again."""
        ids = {id(p) for p in params}
        guards = tuple(replace(g, expected=None, match="is", settles=True)
                       if id(g.root) in ids and g.path == (("attr", "grad"),) else g for g in self.guards)
        return replace(self, guards=guards, _native=None)

    def without_state_of(self, pruned: Iterable[tuple[torch.Tensor, torch.optim.Optimizer]]) -> GuardSet:
        """This set after each (parameter, optimizer) of ``pruned`` lost its state entry (a
        prefilled one the program does not read: flowexec.optim_state.prune): no guard on that
        entry, and each optimizer's ``len(state)`` as it is now; the C++ check is to be attached
        again."""
        gone = {(id(opt.state), id(p)) for p, opt in pruned}
        lengths = {id(opt): len(opt.state) for _, opt in pruned}
        state_len = (("attr", "state"), ("len", None))
        guards = tuple(replace(g, expected=lengths[id(g.root)]) if g.path == state_len and id(g.root) in lengths
                       else g for g in self.guards
                       if not (len(g.path) == 1 and g.path[0][0] == "item" and (id(g.root), id(g.path[0][1])) in gone))
        return replace(self, guards=guards, _native=None)

    def records(self) -> list[tuple[Any, list, Any, str]]:
        """(root, path, expected, match) per guard: what the C++ check is built from (an
        attribute that a class with its own ``__getattribute__`` answers from the instance
        ``__dict__`` is read from that dict: :func:`native_path`)."""
        return [(g.root, native_path(g.root, g.path), g.expected, g.match) for g in self.guards]

    def check(self) -> int:
        native = self.native()
        # (a host read the Python path found answering otherwise keeps failing there: the C++
        # check compares values with the host copies, which that path has already written)
        if native is not None and not (self.feeds is not None and self.feeds.failing) and native.check() == -1:
            return -1
        for i, g in enumerate(self.guards):
            if not same(read(g.root, g.path), g.expected, g.match):
                return i
        if self.feeds is not None:
            j = self.feeds.refresh()
            if j >= 0:
                return len(self.guards) + j
        return -1

    def describe(self, i: int) -> str:
        """What changed, for failure ``i`` of :meth:`check`."""
        if i < len(self.guards):
            return describe(self.guards[i])
        return self.feeds.describe(i - len(self.guards))

    def fused_group(self, i: int) -> dict[str, Any] | None:
        """For failure ``i`` of :meth:`check`, the param group whose fused kernel holds the
        changed value as a constant (:meth:`Feeds.fused_group`), else None."""
        j = i - len(self.guards)
        return self.feeds.fused_group(j) if j >= 0 and self.feeds is not None else None

    def settles(self, i: int) -> bool:
        """Whether failure ``i`` is lazy state settling (a ``.grad`` the program itself made)."""
        return i < len(self.guards) and self.guards[i].settles

    @property
    def after_call(self) -> bool:
        """Whether :meth:`replay` has anything to do."""
        return bool(self.replays or self.cleared_grads)

    def replay(self) -> None:
        """Set the module attributes, globals and closure variables fn assigned, and clear the
        gradients it left None, as running it would have."""
        for r in self.replays:
            r.apply()
        for p in self.cleared_grads:
            p.grad = None

    def __len__(self) -> int:
        return len(self.guards)

    @property
    def fed(self) -> tuple[str, ...]:
        """The names of the values fed to the program before each call (optimizer hyperparameters)."""
        return tuple(s.name for s in self.feeds.slots) if self.feeds is not None else ()

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the guarded values."""
        return tuple(g.name for g in self.guards)
