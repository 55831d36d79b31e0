"""A region's kernel loaded straight from Inductor's cache entry, without ``compile_fx``.

A warm build finds each region's kernel in Inductor's cache, but ``compile_fx`` first computes
the entry's key: it pickles and hashes the region's graph, its inputs and every configuration
that decides the compile (AOTAutograd's ``autograd_cache_key``, then the FX graph cache's),
~15–20 ms a region on the 2-core CPU host under torch 2.11, for a GPT-2 build's ~22 distinct
regions. That key was computed when the region was first compiled, and nothing it hashes can
have changed while what names the region here holds: the region's own key, its inputs' and
outputs' metas, the device, Inductor's configuration and torch's version (the output check's
key, :func:`flowexec.inductor.output_check_key`) with torch's build, Triton's version and the
settings Inductor's own keys read (:func:`entry_name`). So the
first compile keeps AOTAutograd's key under that name (:func:`kept_entries`), and a later build
loads the entry by it (:func:`load_entry`) as ``torch._inductor.standalone_compile``'s saved
artifacts are loaded: ``AOTAutogradCache._lookup`` then its ``wrap_post_compile`` (the same
wrappers ``compile_fx`` returns on a cache hit). An entry that is gone, or anything unexpected,
loads nothing, and the region is compiled as before.

    >>> entry_name("abc") == entry_name("abc"), entry_name("abc") == entry_name("abd")
    (True, False)
    >>> before = entry_name("abc")
    >>> torch.use_deterministic_algorithms(True); after = entry_name("abc"); torch.use_deterministic_algorithms(False)
    >>> before == after
    False
"""
from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable

import torch

from .verdict_cache import VerdictCache, shared_cache

_seen = threading.local()  # .key: the AOTAutograd cache key this thread's last compile computed
_lock = threading.Lock()
_wrapped: list[Any] = []  # the autograd_cache_key replaced (once a process)


def kept_entries() -> VerdictCache:
    """AOTAutograd cache keys by :func:`entry_name`, beside Inductor's cache."""
    return shared_cache("region_entries", kind=str)


# Inductor's settings that hold functions: its cache keys hash them, its portable configuration
# (the output check's key) leaves them out; while any is set, every region is compiled.
_CUSTOM_PASSES = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass", "joint_custom_pre_pass",
                  "joint_custom_post_pass", "pre_grad_custom_pass", "_pre_fusion_custom_pass",
                  "_post_fusion_custom_pass")


def entry_name(check: str) -> str | None:
    """The name a region's entry is kept under: its output ``check`` key (region, metas, the
    devices by name and capability, Inductor's configuration, torch's version) with torch's
    build, Triton's version, AOTAutograd's configuration and the global settings Inductor's
    keys read (deterministic algorithms, each backend's fp32 precision, reduced-precision
    products, the default dtype, the thread count); None while a custom pass is set in
    Inductor's configuration (no entry is loaded or kept then)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    if any(getattr(config, name, None) is not None for name in _CUSTOM_PASSES):
        return None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    matmul = torch.backends.cuda.matmul
    # (each backend's fp32 precision, as Inductor reads them: torch.get_float32_matmul_precision()
    # raises once the per-backend API has set one; the default dtype, which a factory op
    # without one computes in, and the thread count a CPU kernel's C++ bakes in, which torch
    # 2.13's FX graph key hashes)
    precision = tuple(getattr(getattr(b, "matmul", None), "fp32_precision", None)
                      for b in (torch.backends.cuda, torch.backends.mkldnn))
    switches = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                getattr(torch.utils.deterministic, "fill_uninitialized_memory", None),
                precision if precision != (None, None) else torch.get_float32_matmul_precision(),
                matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction,
                torch.get_default_dtype(), torch.get_num_threads())
    text = "\n".join(["entry 1", check, str(getattr(torch.version, "git_version", None)),
                      str(torch.version.hip), str(triton_version),
                      repr(sorted(functorch_config.save_config_portable().items())), repr(switches)])
    return hashlib.sha256(text.encode()).hexdigest()


def _watch_keys() -> bool:
    """Note each AOTAutograd cache key this process computes, on its thread (``_seen``)."""
    with _lock:
        if _wrapped:
            return _wrapped[0] is not None
        try:
            from torch._functorch._aot_autograd import autograd_cache
        except ImportError:
            _wrapped.append(None)
            return False
        original = getattr(autograd_cache, "autograd_cache_key", None)
        if not callable(original):
            _wrapped.append(None)
            return False

        def autograd_cache_key(*args: Any, **kwargs: Any) -> Any:
            got = original(*args, **kwargs)
            _seen.key = got[0] if isinstance(got, tuple) and got and isinstance(got[0], str) else None
            return got
        autograd_cache.autograd_cache_key = autograd_cache_key
        _wrapped.append(original)
        return True


def compile_noting_key(compile: Callable[[], Callable[..., Any]]) -> tuple[Callable[..., Any], str | None]:
    """``compile()`` (a call of ``compile_fx``), with the AOTAutograd cache key it looked up or
    saved under (None where it computed none: the cache off, or a graph it bypassed)."""
    watching = _watch_keys()
    _seen.key = None
    compiled = compile()
    return compiled, (_seen.key if watching else None)


def load_entry(aot_key: str) -> Callable[..., Any] | None:
    """The compiled function kept under ``aot_key`` in Inductor's cache (called like
    ``compile_fx``'s: ``fn(*inputs)``), or None where it is not there or does not load."""
    try:
        from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
        from torch._inductor import config
        from torch._inductor.cudagraph_utils import BoxedDeviceIndex
        from torch._inductor.utils import BoxedBool
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # (a region's inputs have static sizes: its entry has no shape guards to evaluate)
        with config.patch(unsafe_skip_cache_dynamic_shape_guards=True):
            found = AOTAutogradCache._lookup(aot_key, local=True, remote=False, args=[], cache_info={}, aot_config=None)
            if found is None:
                return None
            entry = found[0]
            fx_config = {"cudagraphs": BoxedBool(False), "boxed_forward_device_index": BoxedDeviceIndex(None)}
            context = torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))
            with torch._guards.tracing(context):
                fn = entry.wrap_post_compile([], entry.sanitized_aot_config, fx_config)
    except Exception:  # (a missing FX entry, another torch's layout: compiled as before)
        return None
    return lambda *args: fn(list(args))
