"""The random generator's state as ops of a program: ``torch.utils.checkpoint``'s recompute, seeding.

A checkpointed region (``torch.utils.checkpoint``, Hugging Face's gradient checkpointing)
saves the generator's state before its forward and, in the backward, restores it before
running the forward again, so that dropout draws the same mask twice; ``torch.random.fork_rng``
then puts the later state back. Those calls (``torch.get_rng_state``, ``torch.set_rng_state``
and ``torch.cuda``'s) are no ATen ops: a capture did not see them, and every call of the program
drew a fresh mask in the recompute — gradients silently unlike eager's.

While a capture runs, they go through two ops instead, which the program keeps in place:
``flowexec::get_rng_state(Device device) -> Tensor`` and ``flowexec::set_rng_state(Tensor
state, Device device) -> ()``; so does seeding (``torch.manual_seed``, ``torch.cuda.manual_seed``
and ``manual_seed_all``: ``flowexec::manual_seed``, ``flowexec::cuda_manual_seed``), which
eager does on every call. (A ``torch.Generator`` of the caller's own, seeded or set by its
methods inside ``fn``, is not seen: those are methods of a C type.) Both carry torch's ``nondeterministic_seeded`` tag, so every pass
treats them as random ops: their captured order with the draws stays (``passes/order.py``,
several streams), fusion leaves them out (``passes/regions.py``) and recomputation never repeats
one. Outside a capture the torch functions are untouched.

A CUDA graph cannot save or restore the generator's state from the host (a replay would not
run the host call): a signature whose program holds one of these ops runs in trace mode, with a
warning (``Executable._graph_can_stage``), and the op refuses to run under a CUDA graph capture.

Example::

    >>> import torch, flowexec
    >>> drop = torch.nn.Dropout(0.5)
    >>> def fn(x):
    ...     state = torch.get_rng_state()
    ...     a = drop(x)
    ...     torch.set_rng_state(state)  # the same mask again, as a checkpoint's recompute
    ...     return a - drop(x)
    >>> exe = flowexec.compile(fn, torch.ones(64))
    >>> bool((exe(torch.ones(64)) == 0).all())
    True
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.cuda.random
import torch.random

__all__ = ["install", "holds_rng_state_ops", "lower_rng_hops", "RNG_STATE_OPS", "draws_put_back",
           "release_capturing_generators"]

_LIB = torch.library.Library("flowexec", "FRAGMENT")
_TAGS = (torch.Tag.nondeterministic_seeded,)
_LIB.define("get_rng_state(Device device) -> Tensor", tags=_TAGS)
_LIB.define("set_rng_state(Tensor state, Device device) -> ()", tags=_TAGS)
# torch.manual_seed (the CPU's and every CUDA device's generators); torch.cuda's (device -1: all)
_LIB.define("manual_seed(int seed) -> ()", tags=_TAGS)
_LIB.define("cuda_manual_seed(int seed, int device) -> ()", tags=_TAGS)

RNG_STATE_OPS = frozenset({"flowexec.get_rng_state.default", "flowexec.set_rng_state.default",
                           "flowexec.manual_seed.default", "flowexec.cuda_manual_seed.default"})

# torch's own functions, read when this module is imported (before install() wraps them): the
# ops' kernels call these, also in a process that never captured (the backend's programs)
_ORIGINAL: dict[str, Callable[..., Any]] = {
    "torch.get_rng_state": torch.random.get_rng_state, "torch.set_rng_state": torch.random.set_rng_state,
    "torch.manual_seed": torch.random.manual_seed, "torch.cuda.get_rng_state": torch.cuda.random.get_rng_state,
    "torch.cuda.set_rng_state": torch.cuda.random.set_rng_state, "torch.cuda.manual_seed": torch.cuda.random.manual_seed,
    "torch.cuda.manual_seed_all": torch.cuda.random.manual_seed_all}
_installed: list[bool] = []


def _get_state(device: torch.device) -> torch.Tensor:
    _refuse_in_graph("save")
    if device.type == "cpu":
        return _ORIGINAL["torch.get_rng_state"]()
    return _ORIGINAL["torch.cuda.get_rng_state"](device)


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    _refuse_in_graph("restore")
    if device.type == "cpu":
        _ORIGINAL["torch.set_rng_state"](state)
        return
    _ORIGINAL["torch.cuda.set_rng_state"](state, device)


def _refuse_in_graph(what: str) -> None:
    # (also the CPU's generator: a replay would not run the host call either)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"flowexec: a CUDA graph cannot {what} the random generator's state (the step does, as "
                           "torch.utils.checkpoint does for a region with dropout): use mode='trace'")


def _manual_seed(seed: int) -> None:
    _refuse_in_graph("seed")
    with _originals():  # (torch.manual_seed calls torch.cuda.manual_seed_all by name)
        _ORIGINAL["torch.manual_seed"](seed)


def _cuda_manual_seed(seed: int, device: int) -> None:
    _refuse_in_graph("seed")
    with _originals():
        if device < 0:
            _ORIGINAL["torch.cuda.manual_seed_all"](seed)
        else:
            with torch.cuda.device(device):
                _ORIGINAL["torch.cuda.manual_seed"](seed)


_inside = threading.local()


@contextlib.contextmanager
def _originals() -> Iterator[None]:
    """While an op's kernel runs torch's own function, the routed names call torch's too."""
    _inside.on = True
    try:
        yield
    finally:
        _inside.on = False


_LIB.impl("get_rng_state", _get_state, "CompositeExplicitAutograd")
_LIB.impl("set_rng_state", _set_state, "CompositeExplicitAutograd")
_LIB.impl("manual_seed", _manual_seed, "CompositeExplicitAutograd")
_LIB.impl("cuda_manual_seed", _cuda_manual_seed, "CompositeExplicitAutograd")


@torch.library.register_fake("flowexec::get_rng_state")
def _fake_get(device: torch.device) -> torch.Tensor:
    # the state is a host tensor on every device: mt19937's 5,056 bytes on the CPU, a CUDA
    # generator's seed and offset (16 bytes)
    return torch.empty(5056 if device.type == "cpu" else 16, dtype=torch.uint8)


@torch.library.register_fake("flowexec::set_rng_state")
def _fake_set(state: torch.Tensor, device: torch.device) -> None:
    return None


@torch.library.register_fake("flowexec::manual_seed")
def _fake_seed(seed: int) -> None:
    return None


@torch.library.register_fake("flowexec::cuda_manual_seed")
def _fake_cuda_seed(seed: int, device: int) -> None:
    return None


def _cuda_device(device: Any) -> torch.device:
    """torch.cuda's ``device`` argument ('cuda', an index, a torch.device) as a torch.device with its index."""
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


_lock = threading.Lock()


def install(capturing: Callable[[], bool]) -> None:
    """Route ``torch.get_rng_state`` / ``set_rng_state`` (also ``torch.random``'s) and
    ``torch.cuda``'s through the ops above wherever ``capturing()`` is true (once, for good;
    elsewhere each calls the original)."""
    with _lock:
        if _installed:
            return
        _installed.append(True)
        cpu = torch.device("cpu")

        def routed() -> bool:
            return capturing() and not getattr(_inside, "on", False)

        @functools.wraps(_ORIGINAL["torch.get_rng_state"])
        def get_rng_state() -> torch.Tensor:
            if routed():
                return torch.ops.flowexec.get_rng_state(cpu)
            return _ORIGINAL["torch.get_rng_state"]()

        @functools.wraps(_ORIGINAL["torch.set_rng_state"])
        def set_rng_state(new_state: torch.Tensor) -> None:
            if routed():
                return torch.ops.flowexec.set_rng_state(new_state, cpu)
            return _ORIGINAL["torch.set_rng_state"](new_state)

        @functools.wraps(_ORIGINAL["torch.cuda.get_rng_state"])
        def cuda_get_rng_state(device: Any = "cuda") -> torch.Tensor:
            if routed():
                return torch.ops.flowexec.get_rng_state(_cuda_device(device))
            return _ORIGINAL["torch.cuda.get_rng_state"](device)

        @functools.wraps(_ORIGINAL["torch.cuda.set_rng_state"])
        def cuda_set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
            if routed():
                return torch.ops.flowexec.set_rng_state(new_state, _cuda_device(device))
            return _ORIGINAL["torch.cuda.set_rng_state"](new_state, device)

        @functools.wraps(_ORIGINAL["torch.manual_seed"])
        def manual_seed(seed: int) -> torch.Generator:
            if routed():
                torch.ops.flowexec.manual_seed(int(seed))
                return torch.default_generator
            return _ORIGINAL["torch.manual_seed"](seed)

        @functools.wraps(_ORIGINAL["torch.cuda.manual_seed"])
        def cuda_manual_seed(seed: int) -> None:
            if routed():
                return torch.ops.flowexec.cuda_manual_seed(int(seed), torch.cuda.current_device())
            return _ORIGINAL["torch.cuda.manual_seed"](seed)

        @functools.wraps(_ORIGINAL["torch.cuda.manual_seed_all"])
        def cuda_manual_seed_all(seed: int) -> None:
            if routed():
                return torch.ops.flowexec.cuda_manual_seed(int(seed), -1)
            return _ORIGINAL["torch.cuda.manual_seed_all"](seed)

        for mod in (torch, torch.random):
            mod.get_rng_state, mod.set_rng_state, mod.manual_seed = get_rng_state, set_rng_state, manual_seed
        for mod in (torch.cuda, torch.cuda.random):
            mod.get_rng_state, mod.set_rng_state = cuda_get_rng_state, cuda_set_rng_state
            mod.manual_seed, mod.manual_seed_all = cuda_manual_seed, cuda_manual_seed_all


def holds_rng_state_ops(prog: Any) -> bool:
    """Whether a program saves or restores a generator's state (graph mode cannot)."""
    return any(op.name in RNG_STATE_OPS for op in prog.ops)


def lower_rng_hops(gm: Any) -> None:
    """Rewrite, in place, AOTAutograd's functionalized generator state in ``gm``'s graph into
    the ops above: ``run_and_save_rng_state(op, *args)`` (a checkpointed region's forward draw,
    with the state before it) becomes ``get_rng_state`` then ``op``; ``run_with_rng_state(state,
    op, *args)`` (its recompute) becomes ``get_rng_state``, ``set_rng_state(state)``, ``op``,
    ``set_rng_state`` of what it read — torch's own CPU and CUDA implementations of the two
    (``torch/_prims/rng_prims.py``), as program ops."""
    import operator

    hops = {"run_and_save_rng_state", "run_with_rng_state"}
    for node in list(gm.graph.nodes):
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name not in hops:
            continue
        saving = name == "run_and_save_rng_state"
        state, (op, *args) = (None, node.args) if saving else (node.args[0], node.args[1:])
        device = _device_of(args, node.kwargs)
        val = node.meta.get("val")
        g = gm.graph
        with g.inserting_before(node):
            before = g.call_function(torch.ops.flowexec.get_rng_state.default, (device,))
            before.meta["val"] = _fake_get(device)
            if not saving:
                g.call_function(torch.ops.flowexec.set_rng_state.default, (state, device))
            drawn = g.call_function(op, tuple(args), dict(node.kwargs))
            drawn.meta["val"] = val[1] if saving and isinstance(val, (tuple, list)) else val
            if not saving:
                g.call_function(torch.ops.flowexec.set_rng_state.default, (before, device))
        if saving:  # (state, result): its getitems become the two nodes
            for user in list(node.users):
                if user.target is operator.getitem:
                    user.replace_all_uses_with(before if user.args[1] == 0 else drawn)
                    g.erase_node(user)
        else:
            node.replace_all_uses_with(drawn)
        g.erase_node(node)
    gm.graph.lint()


def _device_of(args: Any, kwargs: Any) -> torch.device:
    """The device a wrapped random op draws on: its first tensor argument's (its ``device=``
    for a factory), else the CPU (as the higher-order op's dispatch decides)."""
    for a in list(args) + list(kwargs.values()):
        v = getattr(a, "meta", {}).get("val") if hasattr(a, "meta") else None
        if isinstance(v, torch.Tensor):
            return v.device
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else torch.device("cpu")


@contextlib.contextmanager
def draws_put_back() -> Iterator[None]:
    """The default generators' states, the CPU's and each started CUDA device's, put back on
    exit (``torch.random.fork_rng``). Work that is no call of fn's, a build's timing of padded
    products on random operands, Inductor's benchmarks, a CUDA graph's warm-up runs, must not
    move the streams fn draws from: eager draws once per call, and dropout after such work drew
    other masks than eager's (BERT and T5 in graph mode, 2026-12-06).

    >>> before = torch.random.get_rng_state()
    >>> with draws_put_back():
    ...     _ = torch.rand(3)
    >>> torch.equal(torch.random.get_rng_state(), before)
    True
    """
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        yield


def release_capturing_generators() -> None:
    """After a CUDA graph capture failed at its end (``cudaErrorStreamCaptureUnjoined``), the
    current device's default generator still counts itself as capturing, and every later draw
    of the process fails ("Offset increment outside graph capture encountered unexpectedly").
    One empty capture ends that: its start registers the same generator state and its end
    (``capture_epilogue``) clears the flag on it. (A fresh copy of the state would do too, but
    graphs captured before keep moving the old one's offset at each replay, which eager's draws
    would then no longer see.)"""
    if not torch.cuda.is_initialized():
        return
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("The CUDA Graph is empty")
        with torch.cuda.graph(graph):
            pass
    del graph
