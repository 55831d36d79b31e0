"""Measured verdicts kept on disk, beside Inductor's compile cache, so that a warm build measures
nothing again.

``pad=None`` times a misaligned matrix product padded and not (``fusion._measured_faster``):
~1.1 s of a GPT-2 124M build on the H200 (its LM head's three products), in every new process;
a fused region's kernel runs once on example inputs to check what it returns
(``inductor.compile_graph``): on a CPU, random examples of GPT-2's logits took 5 of a warm
build's 8 s of fusion. A :class:`VerdictCache` keeps such a verdict under a key naming what decides it (the case, the
device, torch and CUDA versions) in ``<Inductor's cache dir>/flowexec/<name>.json``, the
directory ``TORCHINDUCTOR_CACHE_DIR`` sets: a cold Inductor cache is a cold verdict cache too.
A file that cannot be read or written is no error: the verdict is measured again. A cache
made with ``kind=str`` keeps text instead (Inductor's code keys: :mod:`flowexec.inductor_keys`).

    >>> import tempfile
    >>> cache = VerdictCache("example", tempfile.mkdtemp())
    >>> cache.get("case"), cache.put("case", True), cache.get("case")
    (None, None, True)
    >>> VerdictCache("example", cache.directory).get("case")   # another process reads it
    True
"""
from __future__ import annotations

import getpass
import json
import os
import re
import tempfile
from typing import Any


def default_directory() -> str:
    """``flowexec/`` in Inductor's cache directory: ``TORCHINDUCTOR_CACHE_DIR``, else Inductor's
    default (``torchinductor_<user>`` in the temporary directory), found as Inductor finds it
    without importing Inductor (a second to import, where a build fuses nothing)."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if root is None:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            getuid = getattr(os, "getuid", None)
            user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
        root = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return os.path.join(os.path.abspath(root), "flowexec")


class VerdictCache:
    """Verdicts by string key (booleans; values of another ``kind`` where asked: a string),
    in memory and in one JSON file."""

    def __init__(self, name: str, directory: str | None = None, kind: type = bool) -> None:
        self.directory = directory or default_directory()
        self.path = os.path.join(self.directory, f"{name}.json")
        self.kind = kind
        self._known: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._known is None:
            try:
                with open(self.path) as fh:
                    data: Any = json.load(fh)
                self._known = ({k: v for k, v in data.items() if isinstance(v, self.kind)} if isinstance(data, dict)
                               else {})
            except (OSError, ValueError):
                self._known = {}
        return self._known

    def __len__(self) -> int:
        return len(self._load())

    def get(self, key: str) -> Any:
        """The verdict kept for ``key``, or None."""
        return self._load().get(key)

    def put(self, key: str, verdict: Any) -> None:
        """Keep ``verdict`` for ``key``: in memory, and in the file (merged with what another
        process wrote there since, and replaced in one step)."""
        known = self._load()
        known[key] = verdict
        try:
            os.makedirs(self.directory, exist_ok=True)
            try:
                with open(self.path) as fh:
                    on_disk = json.load(fh)
            except (OSError, ValueError):
                on_disk = {}
            merged = {**({k: v for k, v in on_disk.items() if isinstance(v, self.kind)}
                         if isinstance(on_disk, dict) else {}), **known}
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".verdicts_")
            try:
                with os.fdopen(fd, "w") as fh:
                    json.dump(merged, fh, indent=0, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:  # (no half-written file left behind)
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError:
            pass  # a read-only or full disk: this process keeps the verdict in memory


_shared: dict[tuple[str, str, type], VerdictCache] = {}


def shared_cache(name: str, kind: type = bool) -> VerdictCache:
    """The process's one :class:`VerdictCache` called ``name`` in the current
    :func:`default_directory` (``TORCHINDUCTOR_CACHE_DIR`` can change between builds)."""
    directory = default_directory()
    cache = _shared.get((name, directory, kind))
    if cache is None:
        cache = _shared[name, directory, kind] = VerdictCache(name, directory, kind)
    return cache
