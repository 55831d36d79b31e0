"""The per-call check of a compiled signature in one C++ call (``csrc/fastcall.cpp``).

A call of an executable is checked before it runs: its container structure and leaf types
(``flowexec.signature.flatten``), every tensor's metadata (Dynamo's ``TensorGuards``), in graph
mode each borrowed input's captured address and the staged inputs' storages
(``runtime.borrowed.BorrowedAddresses``). In Python that is four walks over the arguments:
about 23 µs before a graph launch for an MLP step with 18 parameters in a list on the H200's
host, against 6 µs for the launch itself. :class:`FastCall` does all of it in one walk in C++
for the signature the executable ran last, and hands back the tensor leaves; any difference
(another structure, shape, address, a shared storage, a tensor without storage) returns None
and the call takes the Python path, which decides as before. The C++ check compares only
what the Python path compares, or more, so it can send a call to the slow path but never let
one through that the slow path would refuse.

The extension is not built on import: ``python -m flowexec.runtime.build_native`` (which
``scripts/setup.sh`` runs) compiles it once per machine into ``~/.cache/flowexec`` (about 30 s);
without it, or with ``FLOWEXEC_NATIVE=0``, calls take the Python path. :func:`status` says
which.

    >>> import torch
    >>> from flowexec.runtime import fastcall
    >>> layout_of(("call", (), ((("list", None, (None, None)), None), ())), [torch.ones(1)] * 3)
    [2, 2, 1, 2, -1, -1, -1]
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .. import guards

_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "fastcall.cpp")
# One extension, four sources: the call check, the guards of a captured program
# (flowexec/guards.py), the job timer's event clock (profiler/timers.py, NativeEvents) and the
# capture's frame tracer (guards.Recorder).
_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [_SOURCE, os.path.join(_CSRC, "guards.cpp"), os.path.join(_CSRC, "eventclock.cpp"),
            os.path.join(_CSRC, "codetracer.cpp")]
_HEADERS = [os.path.join(_CSRC, "guards.h")]
_STATE: dict[str, Any] = {}  # "module" once loaded, "error" why not

# Layout codes (as in csrc/fastcall.cpp)
TENSOR, NONE, LIST, TUPLE = -1, -2, 1, 2


def _name_and_directory() -> tuple[str, str]:
    from ..kernels._native import build_directory

    h = hashlib.sha1()
    for src in _SOURCES + _HEADERS:
        with open(src, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()[:10]
    # The sources' hash in the name: an edited source is a new module, never a stale one.
    return f"flowexec_fastcall_{digest}", build_directory(False) + "-fastcall"


def build() -> Any:
    """Compile the extension (once per machine and source) and load it."""
    from torch.utils import cpp_extension

    from ..kernels._native import _drop_stale_lock

    name, directory = _name_and_directory()
    os.makedirs(directory, exist_ok=True)
    _drop_stale_lock(directory)
    mod = cpp_extension.load(name, _SOURCES, extra_cflags=["-O2"], build_directory=directory, verbose=False)
    _STATE.clear()
    _STATE["module"] = mod
    guards.use_native_tracer(mod.code_tracer, mod.CodeTracer)
    return mod


def load() -> Any | None:
    """The built extension, or None (not built, disabled, or it failed to load: :func:`status`)."""
    if "module" in _STATE or "error" in _STATE:
        return _STATE.get("module")
    if os.environ.get("FLOWEXEC_NATIVE", "1") == "0":
        _STATE["error"] = "disabled by FLOWEXEC_NATIVE=0"
        return None
    name, directory = _name_and_directory()
    path = os.path.join(directory, name + ".so")
    if not os.path.exists(path):
        _STATE["error"] = f"not built (run: {sys.executable} -m flowexec.runtime.build_native)"
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path,
                                                      loader=importlib.machinery.ExtensionFileLoader(name, path))
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except Exception as e:  # built for another torch ABI, say: the Python path still works
        _STATE["error"] = f"{type(e).__name__}: {e}"
        return None
    _STATE["module"] = mod
    guards.use_native_tracer(mod.code_tracer, mod.CodeTracer)
    return mod


def status() -> str:
    """``"native"`` when calls are checked in C++, else why not."""
    return "native" if load() is not None else str(_STATE.get("error"))


def layout_of(tree: Any, leaves: Sequence[Any]) -> list[int] | None:
    """The call tree (``flowexec.signature.tree_of``) as the C++ layout codes, in preorder; None
    where the check cannot take it (keyword arguments, dicts, namedtuples, registered types,
    scalar leaves: such calls keep the Python path)."""
    kind, names, (args, kwargs) = tree
    if kind != "call" or names or kwargs:
        return None
    codes: list[int] = [TUPLE, len(args)]
    it = iter(leaves)

    def walk(node: Any) -> bool:
        if node is None:
            leaf = next(it)
            if isinstance(leaf, torch.Tensor):
                codes.append(TENSOR)
                return True
            if leaf is None:
                codes.append(NONE)
                return True
            return False
        k, _, kids = node
        if k not in ("list", "tuple"):
            return False
        codes.extend((LIST if k == "list" else TUPLE, len(kids)))
        return all(walk(c) for c in kids)
    return codes if all(walk(a) for a in args) else None


def guard_checker(guards: Any) -> Any | None:
    """The C++ check of a captured program's guards and fed hyperparameters
    (``csrc/guards.cpp``) for a :class:`~flowexec.guards.GuardSet`; None without the extension,
    or for a guard it cannot take (the Python check then answers alone)."""
    mod = load()
    if mod is None or not hasattr(mod, "GuardChecker"):
        return None
    spec = guards.feeds.native_spec() if guards.feeds is not None else ([], [], [], [], [], [])
    feeds, hosts, devices, predicates, staging, uploaders = spec
    try:
        return mod.GuardChecker(guards.records(), feeds, hosts, devices, predicates, staging, uploaders)
    except (RuntimeError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class FastCall:
    """One signature's call path: ``check(args)`` (C++) gives the tensor leaves or None,
    ``run(tensors)`` runs them (None: the signature's own runner, read at each call); ``alive[0]`` turns False when a captured storage the check
    relies on dies (shared with :class:`~flowexec.runtime.borrowed.BorrowedAddresses`)."""

    check: Callable[[tuple[Any, ...]], list[torch.Tensor] | None]
    compiled: Any
    run: Callable[[Sequence[Any]], list[Any]] | None
    alive: list[bool]
    guarded: bool = False  # the check also ran the compiled program's guards (flowexec.guards)


_ALWAYS = [True]


def make(compiled: Any, run: Callable[[Sequence[Any]], list[Any]] | None, tree: Any, leaves: Sequence[Any],
         tensors: Sequence[torch.Tensor], borrowed: Any = None, forbidden: frozenset[int] | None = None) -> FastCall | None:
    """The C++ check for a call that just passed the Python checks with these ``tensors`` (its
    tensor leaves, then the ``.grad`` of each of ``compiled.grad_inputs``): with ``borrowed`` (a graph's ``BorrowedAddresses``) it also checks that
    graph's addresses and staged storages; with ``forbidden`` alone, that every tensor's storage
    is distinct and apart from those addresses. None without the extension or for a call it
    cannot take."""
    mod = load()
    if mod is None:
        return None
    layout = layout_of(tree, leaves)
    if layout is None:
        return None
    n = len(tensors)
    ptrs, staged, alive = [0] * n, [False] * n, _ALWAYS
    if borrowed is not None:
        spec = borrowed.native_spec(n)
        if spec is None:
            return None
        ptrs, staged, forbidden, alive = spec
    elif forbidden is not None:
        staged = [True] * n
    guards = getattr(compiled, "guards", None)
    checker = guards.native() if guards is not None else None  # (attached by the executable)
    if guards is not None and checker is None:
        return None  # the guards only run in Python here: so does the call
    grad_params = list(getattr(compiled, "grad_inputs", ()))
    try:
        guard = mod.CallGuard(layout, list(tensors), ptrs, staged, sorted(forbidden or ()), checker, grad_params)
    except (RuntimeError, TypeError):  # symbolic shapes, a layout it refuses: the Python path
        return None
    return FastCall(guard.check, compiled, run, alive, checker is not None)
