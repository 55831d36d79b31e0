"""What a compile worker must share with the process that sends it regions, so that the cache
keys it computes are that process's and the kernels it builds are the ones that process would.

:func:`current_settings` reads this process's state as plain, picklable values (one that does
not pickle, a lambda in a config, is left out: its key then differs, and the work is wasted,
not wrong); :func:`apply_settings` makes a worker's state the same. :func:`registrations` names
what no cache key reads: Inductor's lowerings, fallbacks and decompositions, which a process
may change at run time (``register_lowering``, ``make_fallback``); a worker where
:func:`registrations_differ` refuses to start, since the kernels it would build are not this
process's.

    >>> s = current_settings()
    >>> apply_settings(s)
    >>> current_settings() == s
    True
"""
from __future__ import annotations

import functools
import pickle
import warnings
from typing import Any

import torch

# torch.backends switches a cache key reads (those a torch version lacks are skipped), in the
# order they are set: each legacy switch before its fp32_precision, which it would overwrite
_BACKEND_SWITCHES = (
    "cuda.matmul.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_bf16_reduced_precision_reduction", "cudnn.allow_tf32",
    "fp32_precision", "cuda.matmul.fp32_precision", "cudnn.fp32_precision", "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision", "mkldnn.fp32_precision", "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision", "mkldnn.rnn.fp32_precision",
)


def _configs() -> dict[str, Any]:
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    found = {"inductor": inductor_config, "functorch": functorch_config, "dynamo": dynamo_config}
    compiler_config = getattr(getattr(torch, "compiler", None), "config", None)
    if compiler_config is not None and hasattr(compiler_config, "save_config_portable"):
        found["compiler"] = compiler_config  # (cache_key_tag and the like)
    return found


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _portable(cfg: Any) -> dict[str, Any]:
    """A config module's settings, private ones too (Inductor's cache key reads them)."""
    try:
        values = cfg.save_config_portable(ignore_private_configs=False)
    except TypeError:  # (a torch without the argument)
        values = cfg.save_config_portable()
    return {k: v for k, v in values.items() if _picklable(v)}


def _lookup(path: str) -> Any:
    obj: Any = torch.backends
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def current_settings() -> dict[str, Any]:
    """This process's state that decides a region's cache key or its generated code."""
    backends = {}
    for path in _BACKEND_SWITCHES:
        try:
            backends[path] = _lookup(path)
        except (AttributeError, RuntimeError):  # (a switch this torch does not have)
            pass
    try:  # (raises where the per-backend fp32_precision API was used: those are mirrored above)
        precision: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:
        precision = None
    deterministic_fill = getattr(getattr(torch.utils, "deterministic", None), "fill_uninitialized_memory", None)
    return {
        "configs": {name: _portable(cfg) for name, cfg in _configs().items()},
        "backends": backends,
        "float32_matmul_precision": precision,
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "fill_uninitialized_memory": deterministic_fill,
        "default_dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),  # (a C++ kernel's parallel reduction is generated for it)
        "autocast": {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")},
        "registrations": registrations(),
    }


def apply_settings(s: dict[str, Any]) -> None:
    """Make this process's state ``s`` (another's :func:`current_settings`), but autocast, which
    a worker enters around each compile. Each switch is set only where it differs: setting one
    to its own value is not always nothing (setting ``allow_tf32`` makes ``fp32_precision``
    "ieee" where it read "none", another cache key)."""
    configs = _configs()
    with warnings.catch_warnings():  # (deprecated keys say so when read or set)
        warnings.simplefilter("ignore")
        for name, values in s["configs"].items():
            cfg = configs.get(name)
            for k, v in values.items():
                try:
                    if getattr(cfg, k) != v:
                        setattr(cfg, k, v)
                except Exception:  # (a key this torch does not have: its cache key then differs)
                    pass
    if s["float32_matmul_precision"] is not None:
        try:
            if torch.get_float32_matmul_precision() != s["float32_matmul_precision"]:
                torch.set_float32_matmul_precision(s["float32_matmul_precision"])
        except RuntimeError:
            pass
    for path, value in s["backends"].items():
        try:
            if _lookup(path) != value:
                owner, name = path.rsplit(".", 1) if "." in path else ("", path)
                setattr(_lookup(owner) if owner else torch.backends, name, value)
        except (AttributeError, RuntimeError):
            pass
    on, warn_only = s["deterministic"]
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            on, warn_only):
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
    if s["fill_uninitialized_memory"] is not None:
        torch.utils.deterministic.fill_uninitialized_memory = s["fill_uninitialized_memory"]
    if torch.get_default_dtype() != s["default_dtype"]:
        torch.set_default_dtype(s["default_dtype"])
    if torch.get_num_threads() != s["threads"]:
        torch.set_num_threads(s["threads"])


def registrations() -> dict[str, str]:
    """Inductor's lowerings and decompositions: for each op (by name), the module and qualified
    name of its function (what a process registers at run time changes them; ``make_fallback``
    registers a lowering too)."""
    from torch._inductor import decomposition, lowering

    found = {f"lower {_name(op)}": _name(fn) for op, fn in lowering.lowerings.items()}
    found.update({f"decomp {_name(op)}": _name(fn) for op, fn in decomposition.decompositions.items()})
    return found


# Registered functions that are not a user's: torch's, and the operator module's (torch 2.11's
# Inductor registers ``operator.add`` and its kind as lowerings themselves).
_NOT_THE_USERS = ("torch.", "_operator.", "operator.")


def registrations_differ(theirs: dict[str, str], mine: dict[str, str]) -> str | None:
    """Where another process's :func:`registrations` would make it build another kernel than
    this process: an op registered on both sides with different functions, or on one side only
    with a function that is not torch's; None where none does. An op torch registered on one
    side only does not count: Inductor registers some as it goes (an implicit fallback, a
    lowering a module adds on import), and its own cache shares kernels between such processes."""
    for key in {*theirs, *mine}:
        fn, here = theirs.get(key), mine.get(key)
        only = here if fn is None else fn if here is None else None  # (registered on one side only)
        if fn == here or (only is not None and only.startswith(_NOT_THE_USERS)):
            continue
        if here is None:
            return f"{key}: {fn} (none here)"
        if fn is None:
            return f"{key}: none there (here {here})"
        return f"{key}: {fn} (here {here})"
    return None


def _name(obj: Any) -> str:
    """An op's or a function's name, the same in every process (no address); a partial is named
    by the function it wraps (torch registers hundreds of decompositions so)."""
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(obj)
    for _ in range(16):  # (a lowering wraps its function, which may be a partial)
        inner = obj.func if isinstance(obj, functools.partial) else getattr(obj, "__wrapped__", None)
        if inner is None or inner is obj:
            break
        obj = inner
    return f"{getattr(obj, '__module__', None) or '?'}.{getattr(obj, '__qualname__', None) or type(obj).__name__}"
