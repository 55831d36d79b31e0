"""Teach Hugging Face accelerate the Dynamo backend name ``flowexec``, without importing flowexec.

``TrainingArguments(torch_compile=True, torch_compile_backend="flowexec")`` fails before torch
is asked: accelerate checks the name against an enum of torch's own backends
(``accelerate.utils.DynamoBackend``). torch itself finds the backend through the
``torch_dynamo_backends`` entry point. This module adds the name to accelerate's enum right
after accelerate defines it.

The installed package ships ``flowexec-accelerate.pth``, which Python's ``site`` runs at every
start-up: it calls :func:`install`, which only puts a finder first on ``sys.meta_path`` that
waits for ``accelerate.utils.dataclasses``. It imports nothing an interpreter has not loaded
by then (no torch, no flowexec, not even ``importlib.abc``: start-up stays as fast), and any
failure is swallowed: a ``.pth`` must never break an interpreter. ``import flowexec``
calls :func:`install` too (a source checkout on ``PYTHONPATH`` has no ``.pth``).

Example::

    >>> import _flowexec_accelerate
    >>> _flowexec_accelerate.install()  # idempotent; True once accelerate knows the name (or will)
    True
"""
from __future__ import annotations

import sys
import threading

# (Only modules every interpreter has loaded by the time site runs .pth files: sys, threading's
# own imports are light. importlib.abc, typing and contextlib would cost ~30 ms at every start-up.)

ACCELERATE = "accelerate.utils.dataclasses"


def teach_accelerate() -> bool:
    """Add ``FLOWEXEC`` to ``accelerate.utils.DynamoBackend`` (loaded already); False where
    accelerate is not loaded or its enum is not what this expects (then pass
    ``Trainer(model=torch.compile(model, backend="flowexec"))`` instead)."""
    enum_type = getattr(sys.modules.get(ACCELERATE), "DynamoBackend", None)
    if enum_type is None:
        return False
    try:
        if "FLOWEXEC" in enum_type._value2member_map_:
            return True
        member = str.__new__(enum_type, "FLOWEXEC")
        member._name_, member._value_ = "FLOWEXEC", "FLOWEXEC"
        member.__objclass__ = enum_type
        type.__setattr__(enum_type, "FLOWEXEC", member)
        enum_type._member_map_["FLOWEXEC"] = member
        enum_type._value2member_map_["FLOWEXEC"] = member
        enum_type._member_names_.append("FLOWEXEC")
        return enum_type("FLOWEXEC") is member
    except Exception:  # another enum layout: the integration is unavailable, nothing breaks
        return False


class AfterAccelerate:
    """A ``sys.meta_path`` finder that runs :func:`teach_accelerate` right after accelerate's
    dataclasses module loads. It stays in place (taking itself out while the import system walks
    ``sys.meta_path`` could make another thread's import skip a finder) and answers None to
    every other name; a module loaded again (``importlib.reload``) is taught again."""

    def __init__(self) -> None:
        self._busy = threading.local()  # (its own find_spec call below must not come back here)

    def find_spec(self, name: str, path: object = None, target: object = None) -> object:
        if name != ACCELERATE or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
            loader = getattr(spec, "loader", None)
            run = getattr(loader, "exec_module", None)
            if run is None or getattr(run, "_flowexec_teaches", False):
                return spec

            def exec_module(module: object) -> None:
                run(module)
                teach_accelerate()
            exec_module._flowexec_teaches = True  # type: ignore[attr-defined]
            loader.exec_module = exec_module  # type: ignore[union-attr]
            return spec
        except Exception:  # whatever went wrong, the import proceeds as if this finder were absent
            return None
        finally:
            self._busy.on = False


def install() -> bool:
    """Teach accelerate now if it is loaded, and whenever it loads (one finder at most)."""
    if not any(isinstance(f, AfterAccelerate) for f in sys.meta_path):
        sys.meta_path.insert(0, AfterAccelerate())
    if ACCELERATE in sys.modules:
        return teach_accelerate()
    return True


def install_quietly() -> None:
    """What the ``.pth`` line calls: :func:`install`, and never an exception."""
    try:
        install()
    except Exception:
        pass
