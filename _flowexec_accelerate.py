"""Teach Hugging Face accelerate the Dynamo backend name ``flowexec``, without importing flowexec.

``TrainingArguments(torch_compile=True, torch_compile_backend="flowexec")`` fails before torch
is asked: accelerate checks the name against an enum of torch's own backends
(``accelerate.utils.DynamoBackend``). torch itself finds the backend through the
``torch_dynamo_backends`` entry point. This module adds the name to accelerate's enum right
after accelerate defines it.

The installed package ships ``flowexec-accelerate.pth``, which Python's ``site`` runs at every
start-up: it calls :func:`install`, which only puts a finder first on ``sys.meta_path`` that
waits for ``accelerate.utils.dataclasses``. Nothing else is imported (no torch, no flowexec),
and any failure is swallowed: a ``.pth`` must never break an interpreter. ``import flowexec``
calls :func:`install` too (a source checkout on ``PYTHONPATH`` has no ``.pth``).

Example::

    >>> import _flowexec_accelerate
    >>> _flowexec_accelerate.install()  # idempotent; True once accelerate knows the name (or will)
    True
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from typing import Any

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


class AfterAccelerate(importlib.abc.MetaPathFinder):
    """Runs :func:`teach_accelerate` right after accelerate's dataclasses module loads."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != ACCELERATE:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # find the real spec with the other finders; once only
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            teach_accelerate()
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> bool:
    """Teach accelerate now if it is loaded, else when it loads (a finder; one at most)."""
    if ACCELERATE in sys.modules:
        return teach_accelerate()
    if not any(isinstance(f, AfterAccelerate) for f in sys.meta_path):
        sys.meta_path.insert(0, AfterAccelerate())
    return True


def install_quietly() -> None:
    """What the ``.pth`` line calls: :func:`install`, and never an exception."""
    with contextlib.suppress(Exception):
        install()
