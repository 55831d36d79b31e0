"""flowexec: run PyTorch programs as planned instruction streams.

Capture a function once into a program of ATen ops, analyse it (dependencies, liveness,
frees), and run it as a precomputed instruction stream — in trace mode (one thread, fixed
order, dead values dropped at last use) or graph mode (a CUDA graph of the trace run).

Example::

    >>> import torch, flowexec
    >>> exe = flowexec.compile(lambda x: torch.relu(x) * 2, torch.randn(4))
    >>> exe(torch.tensor([-1.0, 0.5, 2.0, -3.0]))
    tensor([0., 1., 4., 0.])

``torch.compile(model, backend="flowexec")`` runs Dynamo's graphs through the same passes.
"""
from __future__ import annotations

from typing import Any

from .errors import CaptureError, ExecutionError, FlowexecError, InputError, OptionError
from .executable import Executable, RecaptureWarning, compile
from .profiler import Timeline, profile
from .passes.verify import Hazard, verify_plan
from .program import Program

__version__ = "0.1.0"
__all__ = [
    "compile", "Executable", "Program", "FlowexecError", "CaptureError", "InputError",
    "OptionError", "ExecutionError", "RecaptureWarning", "fast_item", "Fetch", "FetchRing", "profile", "Timeline",
    "verify_plan", "Hazard",
]

from . import backend as _backend  # noqa: E402, F401  registers torch.compile(backend="flowexec")


def __getattr__(name: str) -> Any:
    # Fetch machinery and kernels load on first use: they pull in optional native paths.
    if name in ("fast_item", "Fetch", "FetchRing", "FetchTimeoutError"):
        from . import fetch

        # Kept as a module attribute: without it every `flowexec.fast_item(t)` ran this hook and
        # its import statement, a few µs a call (the 0.93x of issue 23 against item.py's 0.70x).
        value = globals()[name] = getattr(fetch, name)
        return value
    if name == "kernels":
        import importlib

        return importlib.import_module(".kernels", __name__)
    raise AttributeError(f"module 'flowexec' has no attribute {name!r}")
