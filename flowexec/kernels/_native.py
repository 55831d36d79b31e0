"""Build, load and feed the native front door of ``flowexec::lerp`` (``csrc/lerp_native.cpp``).

Python plans a call (``lerp._Plan``); after a kernel's first launch through Triton, this module
turns the plan into *programs* for the C++ side: buffers to allocate and kernel launches with
their parameter blocks (``native_launch``). From then on an eager forward runs in C++ and its
backward is a C++ autograd node: no ``autograd.Function``, no Python launcher.

The extension is compiled once per machine with ``torch.utils.cpp_extension`` (about 20 s on
the H200 machine, 30 s on a 2-core CPU machine) into ``~/.cache/flowexec/native``. Set
``FLOWEXEC_NATIVE=0`` to never build or use it; without a compiler, or if the build fails, the
Python path is used and one warning says why.

Example (on a CUDA machine; the first call builds the extension)::

    >>> from flowexec.kernels import _native
    >>> mod = _native.load(cuda=True)     # doctest: +SKIP
    >>> mod is None or mod.with_cuda      # doctest: +SKIP
    True
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

ENABLED = os.environ.get("FLOWEXEC_NATIVE", "1") != "0"
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "lerp_native.cpp")
_MODULES: dict[bool, Any] = {}
_FAILED: dict[bool, str] = {}
# CPU build only: test id -> (Launcher, args template, positions of kernel parameters).
_TEST_LAUNCHES: dict[int, tuple[Any, tuple, list[int]]] = {}
# The loaded extension's lerp(x, y, w, wv) -> Tensor | None: the eager front door (None while
# python_path() is active).
front_door: Any = None
_loaded_front: Any = None
_suspended = 0

_WEIGHT_KINDS = ("H", "L")


def build_directory(cuda: bool) -> str:
    """Where the extension for this torch, Python and flavour is built and cached."""
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info[0]}{sys.version_info[1]}-" + (
        "cuda" if cuda else "cpu")
    root = os.environ.get("FLOWEXEC_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "flowexec"))
    return os.path.join(root, "native", tag)


STALE_LOCK_S = 600.0  # no build of this one file takes this long


def _drop_stale_lock(directory: str) -> None:
    """A build killed mid-way leaves cpp_extension's ``lock`` file behind, and every later load
    then waits on it forever (seen here: the whole test process hung). A lock older than any
    build takes is removed, with a warning."""
    lock = os.path.join(directory, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_S:
        warnings.warn(f"flowexec: removing a stale build lock {lock} ({age:.0f} s old; a build was killed)")
        try:
            os.remove(lock)
        except OSError:
            pass


def load(cuda: bool) -> Any | None:
    """The compiled module (CUDA flavour launches through the driver, CPU flavour through a test
    hook), or None when disabled or unbuildable (a warning says why, once)."""
    if not ENABLED:
        return None
    if cuda in _MODULES:
        return _MODULES[cuda]
    if cuda in _FAILED:
        return None
    from torch.utils import cpp_extension

    name = "flowexec_lerp_native_" + ("cuda" if cuda else "cpu")
    directory = build_directory(cuda)
    os.makedirs(directory, exist_ok=True)
    _drop_stale_lock(directory)
    if not os.path.exists(os.path.join(directory, name + ".so")):
        print(f"flowexec: compiling the native lerp launcher into {directory} (once per machine, ~30 s)",
              file=sys.stderr, flush=True)
    try:
        if cuda and cpp_extension.CUDA_HOME is None:
            raise RuntimeError("no CUDA toolkit found (CUDA_HOME is not set and nvcc is not on PATH)")
        mod = cpp_extension.load(
            name, [_SOURCE], extra_cflags=["-O2", *(["-DFLOWEXEC_WITH_CUDA"] if cuda else [])],
            with_cuda=cuda, build_directory=directory, verbose=False)
    except Exception as e:  # no compiler, no headers, no ninja: the Python path still works
        _FAILED[cuda] = f"{type(e).__name__}: {e}"
        warnings.warn(f"flowexec: the native lerp launcher could not be built, using the Python path "
                      f"({_FAILED[cuda].splitlines()[0][:300]}); set FLOWEXEC_NATIVE=0 to skip the attempt",
                      RuntimeWarning, stacklevel=3)
        return None
    if not cuda:
        mod.set_test_hook(_test_hook)
    _MODULES[cuda] = mod
    global front_door, _loaded_front
    _loaded_front = mod.lerp
    if not _suspended:
        front_door = _loaded_front
    return mod


@contextlib.contextmanager
def python_path() -> Iterator[None]:
    """Eager calls take the Python front door meanwhile (plans are still installed natively);
    for comparisons in tests and benchmarks.

    Example::

        >>> from flowexec.kernels import _native
        >>> with _native.python_path():
        ...     assert _native.front_door is None
    """
    global front_door, _suspended
    _suspended += 1
    front_door = None
    try:
        yield
    finally:
        _suspended -= 1
        if not _suspended:
            front_door = _loaded_front


def clear_plans() -> None:
    """Empty the front door's plan registry of every loaded flavour."""
    for mod in _MODULES.values():
        mod.clear_plans()


def _index(src: Any, key: Any) -> int:
    if isinstance(key, str):
        return src.fn.arg_names.index(key)
    if isinstance(key, tuple):  # Triton 3.3 keys constants by (index,)
        return key[0]
    return key


_TYPE_KINDS = {"i32": "i", "u32": "i", "i64": "l", "u64": "l", "fp32": "f", "fp64": "d"}


def native_launch(launcher: Any, args: tuple, buffers: dict[int, int], weight: tuple[int, int] | None
                  ) -> tuple | None:
    """The C++ form of one planned launch: ``(function, grid, block, shared, params)``.

    ``args`` are the kernel's arguments as the Python path passes them; ``buffers`` maps an
    argument position to the program buffer it takes, ``weight`` gives the positions of the
    float weight's hi and lo parts (patched per call). Each parameter is ``(kind, value)``:
    ``p`` buffer, ``i``/``l`` 32/64-bit integer, ``f``/``d`` float/double, ``n`` null pointer
    (Triton's scratch arguments), ``H``/``L`` the weight. None when the kernel cannot be
    launched this way (not yet compiled, scratch memory, clusters, an unknown parameter type).
    """
    wkind = {} if weight is None else {weight[0]: "H", weight[1]: "L"}
    if launcher.device_index is None:  # CPU flavour: parameters follow the Python values
        import inspect

        sig = inspect.signature(launcher.fn.fn).parameters.values()
        positions = [i for i, p in enumerate(sig) if "constexpr" not in str(p.annotation)]
        params: list[tuple[str, Any]] = []
        for i in positions:
            a = args[i]
            if i in buffers:
                params.append(("p", buffers[i]))
            elif i in wkind:
                params.append((wkind[i], 0))
            elif isinstance(a, float):
                params.append(("f", a))
            elif isinstance(a, int):
                params.append(("i" if -2**31 <= a < 2**31 else "l", int(a)))
            else:
                return None
        test_id = len(_TEST_LAUNCHES) + 1
        _TEST_LAUNCHES[test_id] = (launcher, args, positions)
        return (test_id, launcher.grid, 32 * launcher.num_warps, 0, params)
    compiled = launcher.compiled
    function = getattr(compiled, "function", None)
    if not function:
        return None
    md = compiled.metadata
    if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        return None
    # Instrumented kernels (Triton's GSan and the like) take hidden parameters of their own.
    if getattr(md, "instrumentation_mode", "") or getattr(compiled.run, "gsan_enabled", False):
        return None
    src = compiled.src
    sig = {_index(src, k): v for k, v in src.signature.items()}
    constants = {_index(src, k) for k in getattr(src, "constants", {})}
    params = []
    for i in sorted(sig):
        ty = sig[i]
        if ty == "constexpr" or i in constants:
            continue
        if i in buffers:
            if not str(ty).startswith("*"):
                return None
            params.append(("p", buffers[i]))
        elif i in wkind:
            if ty != "fp32":
                return None
            params.append((wkind[i], 0))
        elif ty in _TYPE_KINDS:
            params.append((_TYPE_KINDS[ty], args[i]))
        else:
            return None
    for attr in ("global_scratch_size", "profile_scratch_size"):  # Triton >= 3.3 / 3.5: hidden pointers
        if hasattr(md, attr):
            if getattr(md, attr) > 0:
                return None
            params.append(("n", 0))
    return (int(function), launcher.grid, 32 * md.num_warps, int(md.shared), params)


def _test_hook(test_id: int, grid: int, params: list[tuple[str, Any]], bufs: list[torch.Tensor]) -> None:
    """CPU flavour: run a launch the C++ side packed, in Triton's interpreter, from its decoded
    parameter block (pointers are matched back to the program's buffers)."""
    launcher, template, positions = _TEST_LAUNCHES[test_id]
    args = list(template)
    for pos, (kind, value) in zip(positions, params):
        if kind == "p":
            matches = [b for b in bufs if b.data_ptr() == value]
            if not matches:
                raise RuntimeError(f"flowexec native test hook: parameter {pos} points at no buffer")
            args[pos] = matches[0]
        else:
            args[pos] = value
    launcher.fn[(grid,)](*args, num_warps=launcher.num_warps)
