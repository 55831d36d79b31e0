"""Inductor's once-a-process costs, kept beside its cache so that a warm build pays them once.

Before its first compile (or its first cache lookup) in a process, Inductor computes what does
not change between processes on one host, and computes it again in the next:

- the keys of its own and Triton's code (``codecache.torch_key``, ``codecache.triton_key``):
  a hash of every module of torch and of Triton's compiler, language and library, read whole
  (~0.7 s of a warm CPU fused build on the 2-core host);
- the CPU's vector instructions (``cpu_vec_isa``): for each candidate (AMX, AVX-512 VNNI,
  AVX-512, AVX2 on an x86 host: ten small libraries) a library built into its cache and a
  Python process started to load it (~1.5 s on that host).

:func:`keep_process_keys` keeps both beside Inductor's cache (:mod:`flowexec.verdict_cache`;
a cold Inductor cache is a cold one here too) under keys that name what decides them:

- a code key under the *stamp* of the files it reads (every file's path, size, modification
  and change times and inode under torch's, or Triton's, directory: more than Python asks to
  trust its bytecode cache, since an image build may set every modification time alike), handed
  to Inductor through the ``set`` its cache of ``torch_key`` offers, and for ``triton_key`` by
  rebinding the name Inductor and Triton's compiler call (:func:`_triton_key_binder`). A file
  rewritten in place with its size and both times restored is not seen; a tree with a symbolic
  link, or one that cannot be read, is hashed as before;
- a probe that loaded its library under the library's path (Inductor names it after its
  source and flags) and stamp (:func:`file_stamp`), torch's own library, the interpreter and
  ``LD_LIBRARY_PATH``. A failed probe is never kept (it may have timed out).

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> open(f"{d}/a.py", "w").write("x = 1")
    5
    >>> tree_stamp(d) == tree_stamp(d), tree_stamp(d + "/missing")
    (True, None)
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
from typing import Any, Callable, NamedTuple

import torch

from .verdict_cache import shared_cache

_LOCK = threading.Lock()
_DONE: dict[str, Any] = {}  # "keys": the code keys were kept or set; "probe": what keep_vec_isa_probes replaced


def keep_process_keys(cpu: bool) -> None:
    """Hand Inductor the code keys kept for this torch and Triton (or keep them, computed now);
    with ``cpu`` (a C++ kernel is to be compiled), also have its vector-instruction probe keep
    what it finds. Once a process; anything unexpected leaves Inductor to compute as before."""
    if "keys" not in _DONE:
        with _LOCK:
            if "keys" not in _DONE:
                _DONE["keys"] = True
                try:
                    _keep_code_keys()
                except Exception:  # (a torch whose caches differ: Inductor computes them itself)
                    pass
    if cpu and "probe" not in _DONE:
        keep_vec_isa_probes()


# --- the code keys ---------------------------------------------------------------------------

def file_stamp(path: str, st: os.stat_result | None = None) -> str:
    """A file's path, size, modification and change times and inode (ctime and inode too: an
    image build may set every modification time alike); OSError where it cannot be read."""
    st = st if st is not None else os.stat(path)
    return f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\n"


def tree_stamp(root: str) -> str | None:
    """A hash of every file's path, size, times and inode under ``root`` (``__pycache__``
    left out: neither key reads it); None where ``root`` cannot be read whole or holds a symbolic
    link (a linked tree may change without its stamp)."""
    h = hashlib.sha256()
    todo = [root]
    try:
        if os.path.islink(root) or not os.path.isdir(root):
            return None
        while todo:
            d = todo.pop()
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
            for e in entries:
                if e.is_symlink():
                    return None
                if e.is_dir():
                    if e.name != "__pycache__":
                        todo.append(e.path)
                    continue
                h.update(file_stamp(e.path, e.stat()).encode())
    except OSError:
        return None
    return h.hexdigest()


class CodeKey(NamedTuple):
    """One of Inductor's code keys: ``compute`` (Inductor's or Triton's function, cached once a
    process), the directory whose files it hashes, and ``hand``, which gives this process the
    kept value instead (torch's caches raise RuntimeError or AssertionError where the key was
    computed already, and the computed one stands; the rebound ``triton_key`` replaces it, with
    the same value while the stamp holds)."""

    name: str
    compute: Callable[[], Any]
    root: str
    hand: Callable[[Any], None]


def _code_keys() -> list[CodeKey]:
    """The code keys this torch computes: ``torch_key`` through its cache's ``set``, and with
    Triton, ``triton_key`` rebound (:func:`_triton_key_binder`)."""
    from torch._inductor import codecache

    out = []
    if callable(getattr(codecache.torch_key, "set", None)):
        out.append(CodeKey("torch_key", codecache.torch_key, os.path.dirname(torch.__file__), codecache.torch_key.set))
    triton = _triton_key_binder()
    if triton is not None:
        out.append(triton)
    return out


def _triton_key_binder() -> CodeKey | None:
    """``triton_key`` where Triton is present. torch 2.11's ``get_system`` calls the function
    ``triton_compat`` imported from Triton (an ``lru_cache``, no ``set``; 0.6 s of a warm GPU
    build on the H100), 2.13's through its own cache, which reads the same name when called: so
    the kept value is handed over by rebinding ``triton_compat.triton_key`` and, where it is
    still Triton's own, ``triton.runtime.cache.triton_key`` (as Triton's compile-warm-up pool
    does in its workers) to a function that returns it."""
    try:
        from torch._inductor.runtime import triton_compat
    except ImportError:
        return None
    original = getattr(triton_compat, "triton_key", None)
    if not getattr(triton_compat, "HAS_TRITON", False) or not callable(original):
        return None
    import triton
    import triton.runtime.cache as triton_cache

    def hand(value: Any) -> None:
        kept = functools.lru_cache(None)(lambda: value)
        if triton_cache.__dict__.get("triton_key") is original:
            triton_cache.triton_key = kept
        triton_compat.triton_key = kept

    return CodeKey("triton_key", original, os.path.dirname(os.path.abspath(triton.__file__)), hand)


def _keep_code_keys() -> None:
    kept = shared_cache("inductor_keys", kind=str)
    for key in _code_keys():
        try:
            _keep_code_key(kept, key)
        except Exception:  # (this key as Inductor computes it; the next is kept all the same)
            pass


def _keep_code_key(kept: Any, key: CodeKey) -> None:
    """Hand ``key``'s kept value over, or keep the one computed now."""
    stamp = tree_stamp(key.root)
    if stamp is None:
        return
    case = hashlib.sha256(f"{key.name}\0{torch.__version__}\0{sys.executable}\0{key.root}\0{stamp}".encode()).hexdigest()
    value = _parse(kept.get(case))
    if value is not None:
        try:
            key.hand(value)
        except (RuntimeError, AssertionError):
            pass  # (computed already in this process: 2.13 raises, 2.11's list-based cache asserts)
        return
    computed = key.compute()
    if isinstance(computed, bytes):
        kept.put(case, "bytes:" + computed.hex())
    elif isinstance(computed, str):
        kept.put(case, "str:" + computed)


def _parse(text: str | None) -> bytes | str | None:
    """A kept key as Inductor returns it (``bytes:<hex>`` or ``str:<text>``), or None where the
    file held something else."""
    if text is None:
        return None
    if text.startswith("bytes:"):
        try:
            return bytes.fromhex(text[6:])
        except ValueError:
            return None
    return text[4:] if text.startswith("str:") else None


# --- the vector-instruction probe --------------------------------------------------------------

def keep_vec_isa_probes() -> None:
    """Replace Inductor's probe that a vector-instruction library loads (``VecISA._probe_load``,
    a Python process per library) with :func:`kept_vec_isa_probe` over it, once a process
    (torch.compile in the same process gains the same). torch 2.11 has no ``_probe_load``: its
    ``check_build`` starts the process itself, which :class:`_ProbeProcesses` routes the same
    way (~17 s of a warm CPU fused GPT-2 build on the 2-core host, torch 2.11, before it)."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return
    with _LOCK:
        if "probe" in _DONE:
            return
        original = vars(cpu_vec_isa.VecISA).get("_probe_load")
        if not callable(original):  # (torch 2.11: check_build starts the process itself)
            _DONE["probe"] = _keep_probe_processes(cpu_vec_isa)
            return
        _DONE["probe"] = original

        def _probe_load(self: Any, output_path: str) -> bool:
            return kept_vec_isa_probe(self, output_path, original)

        cpu_vec_isa.VecISA._probe_load = _probe_load  # type: ignore[method-assign]


class _ProbeProcesses:
    """``subprocess`` as torch 2.11's ``cpu_vec_isa`` sees it: the probe's process (its
    ``VecISA._avx_py_load`` script with a library's path in it) asks the kept verdicts first
    (:func:`kept_vec_isa_probe`, the library named by that path); everything else is the module's."""

    def __init__(self, module: Any, script: str) -> None:
        self._module = module
        self._head, _, self._tail = script.partition("__lib_path__")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def library_of(self, cmd: Any) -> str | None:
        """The library a probe's command loads, or None where ``cmd`` is not a probe."""
        if not isinstance(cmd, (list, tuple)) or len(cmd) != 3 or cmd[1] != "-c" or not isinstance(cmd[2], str):
            return None
        script = cmd[2]
        if not (self._tail and script.startswith(self._head) and script.endswith(self._tail)):
            return None
        return script[len(self._head):len(script) - len(self._tail)]

    def check_call(self, cmd: Any, *args: Any, **kwargs: Any) -> int:
        library = self.library_of(cmd)
        if library is None:
            return self._module.check_call(cmd, *args, **kwargs)

        def probe(_isa: Any, _library: str) -> bool:
            try:
                self._module.check_call(cmd, *args, **kwargs)
            except self._module.CalledProcessError:
                return False
            return True
        if not kept_vec_isa_probe("probe", library, probe):  # (the library names its instruction set)
            raise self._module.CalledProcessError(1, cmd)
        return 0


def _keep_probe_processes(cpu_vec_isa: Any) -> Any:
    """Route torch 2.11's probe processes through the kept verdicts (:class:`_ProbeProcesses`);
    what it replaced, or None where this Inductor probes otherwise."""
    script = getattr(cpu_vec_isa.VecISA, "_avx_py_load", None)
    module = getattr(cpu_vec_isa, "subprocess", None)
    if not isinstance(script, str) or "__lib_path__" not in script or module is None \
            or isinstance(module, _ProbeProcesses):
        return None
    cpu_vec_isa.subprocess = _ProbeProcesses(module, script)
    return module


def vec_isa_probe_key(isa: str, library: str) -> str | None:
    """What decides whether a vector-instruction probe's ``library`` loads: the library itself
    (its path, which Inductor derives from its source and flags, and :func:`file_stamp`), the
    instruction set, torch's version and its ``libtorch_cpu`` (which the library links), the
    interpreter and ``LD_LIBRARY_PATH``, hashed; None where the library cannot be read."""
    libtorch = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    parts = [f"torch {torch.__version__}", sys.executable, os.environ.get("LD_LIBRARY_PATH", ""), isa]
    try:
        parts.append(file_stamp(os.path.abspath(library)))
        parts.append(file_stamp(libtorch) if os.path.exists(libtorch) else "no libtorch_cpu.so")
    except OSError:
        return None
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def kept_vec_isa_probe(isa: Any, library: str, probe: Callable[[Any, str], bool]) -> bool:
    """Whether ``library`` loads: a kept success (``vec_isa_probes`` beside Inductor's cache),
    else ``probe(isa, library)``, kept where it succeeded."""
    key = vec_isa_probe_key(str(isa), library)
    if key is None:
        return probe(isa, library)
    kept = shared_cache("vec_isa_probes")
    if kept.get(key):
        return True
    ok = bool(probe(isa, library))
    if ok:
        kept.put(key, True)
    return ok
