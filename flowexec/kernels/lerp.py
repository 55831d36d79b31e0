"""Fused, broadcast-aware ``lerp`` with a fused backward (custom op ``flowexec::lerp``).

``out = x + w * (y - x)`` with full broadcasting between ``x``, ``y`` and ``w`` (a tensor or a
Python float). On CUDA the forward is one Triton kernel and the backward one pass over the
output gradient that writes ``dx = g(1-w)``, ``dy = g w`` and ``dw = g(y-x)`` with the sums
over broadcast dims fused in (atomic sums into a buffer the forward zeroed, or block partials
and one small final kernel). Only the gradients autograd asks for are computed, and ``x`` and
``y`` are read only when ``w`` needs a gradient. On the CPU a PyTorch implementation is used.

Front doors, one implementation:

* :func:`lerp` — eager calls. Once a call's shapes are planned and its kernels compiled, they run
  in C++ (``csrc/lerp_native.cpp`` via ``_native``): planned launches and a C++ autograd node.
  The first call of a shape, and anything the native path leaves (misaligned tensors, forward
  AD, a build that failed, ``FLOWEXEC_NATIVE=0``), go through a lean ``torch.autograd.Function``.
  Under tracing (make_fx, Dynamo, fake tensors) it calls the registered op; under functorch
  transforms ATen's ``torch.lerp``.
* ``torch.ops.flowexec.lerp(x, y, weight: Tensor | None, weight_value: float)`` — the
  ``torch.library`` op with autograd and fake (meta) support, for captured programs. Its
  backward is the op ``torch.ops.flowexec.lerp_backward``.

Launch costs dominate small calls, so everything that depends only on shapes, dtype and
device (canonical dims, block sizes, grids, launch arguments, compiled kernels) is planned once
per signature and cached; a call looks its plan up, allocates its outputs and launches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad as _fwAD

from . import _native
from ._launch import Launcher

try:  # Triton is optional: without it every device uses the PyTorch implementation.
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    HAS_TRITON = False

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OP = "flowexec::lerp"


@dataclasses.dataclass
class LerpConfig:
    """Tuning knobs of the Triton path (defaults: the best of the sweep in docs/kernels.md, H200).

    * ``tile``: elements per [BM, BN] tile by element size (``fwd_tile``: the forward's, when it
      should differ; ``flat3_tile``: both, for one-row calls whose three operands are all the
      output's size, by element size); ``fwd_warps``, ``bwd_warps``: warps per program.
    * ``programs_per_sm``: target programs per multiprocessor when the backward splits a reduced dim
      (3 measured 0.1 µs faster on case 3 but 1 µs slower when only dx and dy are wanted).
    * ``full_tile_loads``: load operands that keep only rows or only columns as whole tiles (no
      layout conversions).
    * ``fwd_stream_store``: store the forward's output with the streaming hint.
    * ``final_block``, ``final_cols``: partials the final pass reads per program step, and the
      columns each of its programs sums.
    * ``bwd_reverse``: walk the backward's programs from the end (None: when the forward's bytes
      exceed L2).
    * ``flat_programs``, ``even_tiles``: a one-row canonical shape indexes programs by column
      block, and whole tiles get constant masks.
    * ``bwd_loads_first``: the backward issues every load of a row tile before its stores.
    * ``bwd_stream``: the backward loads ``g`` evict-first and stores gradients that keep both
      tile dims (non-flat layouts, e.g. case 3's ``dy``) with the streaming hint, so that L2
      keeps the forward's inputs it reads again (case 3: 19.55 -> 18.83 µs on the H200).
    * ``bwd_joint_flush``: when dx and dw both sum over rows, one two-value reduction for both
      (half the shuffles; case 3 float16 13.11 -> 12.93 µs).
    * ``fwd_plane``: a forward whose rows leave part of a tile idle walks each d2 x d3 plane flat,
      ``plane_tile`` elements a program (case 3: 8.48 -> 7.90 µs on the H200).
    * ``atomic_max``: float32/float64 calls whose broadcast operands hold at most this many
      elements in all sum their reduced gradients with atomics, into a buffer the forward kernel
      zeroes, instead of partial sums and a final pass (case 3: 18.9 -> 17.1 µs on the H200).
      Sums then differ in the last bits from run to run; under
      ``torch.use_deterministic_algorithms(True)``, inside CUDA-graph capture, and for a second
      backward through the same graph, the partial sums are used. 0: never.
    * ``fast_div``: programs find their coordinates by multiplying with a magic number the plan
      computes (``magic_div``) instead of dividing by runtime sizes.
    * ``flat3_evict``: by element size, the operands (bits: x 1, y 2, w 4) that the forward of a
      flat call on three output-sized operands loads evict-first. After a pass that leaves L2
      dirty, the lines it reads then make room for its own next loads instead of forcing
      write-backs (H200, all-[16,102400] float32 forward: 8.32 µs against 8.67 plain and
      PyTorch's 8.67-8.74). The price falls on a backward that runs at once: it finds x and y
      in memory, not L2 (forward + backward kernels 17.1 -> 19.6 µs, 1.15x the memory floor);
      in a model, where other layers run between the two, they would be gone anyway. bfloat16
      gained 0.08 µs for 1.3 µs of backward, so only 4-byte types take it.

    Measurements: docs/kernels.md and ``benchmarks/lerp_kernels.py``.
    """

    tile: dict[int, int] = dataclasses.field(default_factory=lambda: {2: 4096, 4: 2048, 8: 1024})
    fwd_warps: int = 4
    bwd_warps: int = 4
    programs_per_sm: int = 4
    full_tile_loads: bool = True
    fwd_tile: dict[int, int] | None = None
    fwd_stream_store: bool = True
    final_block: int = 8192
    final_cols: int = 16
    bwd_reverse: bool | None = None
    flat_programs: bool = True
    even_tiles: bool = True
    bwd_loads_first: bool = True
    bwd_stream: bool = True
    bwd_joint_flush: bool = True
    fwd_plane: bool = True
    plane_tile: dict[int, int] = dataclasses.field(default_factory=lambda: {2: 2048, 4: 1024, 8: 512})
    atomic_max: int = 1 << 16
    fast_div: bool = True
    flat3_tile: dict[int, int] = dataclasses.field(default_factory=lambda: {4: 1024})
    flat3_evict: dict[int, int] = dataclasses.field(default_factory=lambda: {4: 3})

    def __post_init__(self) -> None:
        # Triton's tl.arange takes powers of two: a bad knob fails here, not inside a kernel.
        sizes = {"final_cols": self.final_cols, "final_block": self.final_block,
                 **{f"tile[{k}]": v for k, v in self.tile.items()},
                 **{f"fwd_tile[{k}]": v for k, v in (self.fwd_tile or {}).items()},
                 **{f"plane_tile[{k}]": v for k, v in self.plane_tile.items()},
                 **{f"flat3_tile[{k}]": v for k, v in self.flat3_tile.items()}}
        bad = {k: v for k, v in sizes.items() if not (isinstance(v, int) and v >= 1 and v & (v - 1) == 0)}
        if bad:
            raise ValueError(f"LerpConfig: these must be powers of two: {bad}")
        if any(v not in range(8) for v in self.flat3_evict.values()):
            raise ValueError(f"LerpConfig: flat3_evict takes bits x 1, y 2, w 4 (0-7), not {self.flat3_evict!r}")


config = LerpConfig()
# Tests set this (or FLOWEXEC_LERP_TRITON_CPU=1) to run the Triton kernels on CPU tensors in
# Triton's interpreter (TRITON_INTERPRET=1 before Triton is imported); normal CPU use takes the
# PyTorch implementation.
force_triton_on_cpu = os.environ.get("FLOWEXEC_LERP_TRITON_CPU", "0") == "1"
# The native front door (``_native``) is used on CUDA; on CPU tensors in the interpreter only when
# a test asks (``triton_on_cpu(native=True)``): building the CPU flavour takes ~30 s.
native_on_cpu = False
_PLANS: dict[tuple, _Plan] = {}
_DEVICE_PROPS: dict[tuple[int, str], int] = {}


@contextlib.contextmanager
def configured(**changes: Any) -> Iterator[LerpConfig]:
    """Temporarily change :data:`config` (plans are rebuilt on entry and exit).

    Example::

        >>> with configured(atomic_max=0):   # partial sums and a final pass, never atomics
        ...     pass
    """
    global config
    old = config
    config = dataclasses.replace(config, **changes)
    clear_plans()
    try:
        yield config
    finally:
        config = old
        clear_plans()


@contextlib.contextmanager
def triton_on_cpu(enabled: bool = True, native: bool = False) -> Iterator[None]:
    """Run the Triton kernels on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``); for tests.

    ``native=True`` also sends eager calls through the native front door's CPU flavour, whose
    launches run in the interpreter from the parameter blocks the C++ side packs.
    """
    global force_triton_on_cpu, native_on_cpu
    old = force_triton_on_cpu, native_on_cpu
    force_triton_on_cpu, native_on_cpu = enabled, native
    clear_plans()
    try:
        yield
    finally:
        force_triton_on_cpu, native_on_cpu = old
        clear_plans()


def clear_plans() -> None:
    """Forget every plan (Python's and the native front door's) and release the native path's
    per-stream slabs of atomic-sum buffers; the next calls plan again.

    Example::

        >>> from flowexec.kernels import clear_lerp_plans
        >>> clear_lerp_plans()
    """
    _PLANS.clear()
    _native.clear_plans()


# ----------------------------------------------------------------------------- planning

def canonicalize(out_shape: Sequence[int], shapes: Sequence[Sequence[int] | None]
                 ) -> tuple[tuple[int, int, int, int], tuple[int, ...]] | None:
    """Coalesce a broadcast into at most 4 dims and a keep-mask per operand.

    Output dims of size 1 are dropped; neighbouring dims that every operand keeps or
    broadcasts alike are merged (operands are contiguous, so merged dims stay contiguous).
    Returns ``(sizes, masks)`` padded in front to 4 dims (mask bit 3 = d0 ... bit 0 = d3),
    or None when more than 4 dims remain. ``None`` in ``shapes`` is a scalar (mask 0).

    Example::

        >>> canonicalize((16, 3, 244, 244), [(16, 1, 1, 1), (16, 3, 244, 244), (3, 1, 244)])
        ((16, 3, 244, 244), (8, 15, 5))
        >>> canonicalize((16, 102400), [(16, 102400), (16, 102400), (1,)])
        ((1, 1, 1, 1638400), (1, 1, 0))
    """
    nd = len(out_shape)
    sizes: list[int] = []
    keeps: list[tuple[bool, ...]] = []
    for d, n in enumerate(out_shape):
        if n == 1:
            continue
        k = tuple(sh is not None and d - (nd - len(sh)) >= 0 and sh[d - (nd - len(sh))] == n for sh in shapes)
        if keeps and keeps[-1] == k:
            sizes[-1] *= n
        else:
            sizes.append(n)
            keeps.append(k)
    if len(sizes) > 4:
        return None
    pad = 4 - len(sizes)
    sizes4 = (1,) * pad + tuple(sizes)
    masks = tuple(sum(1 << (3 - (pad + d)) for d, k in enumerate(keeps) if k[i]) for i in range(len(shapes)))
    return sizes4, masks  # type: ignore[return-value]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def magic_div(d: int) -> tuple[int, int]:
    """Multiplier and shift that divide a program index ``0 <= n < 2**31`` by ``d`` in a kernel:
    ``n // d == (umulhi(n, m) + n) >> l`` in unsigned 32-bit arithmetic (Granlund and
    Montgomery's round-up method; ``m`` is returned as the int32 with the same bits).

    >>> m, l = magic_div(244)
    >>> n = 1_000_003
    >>> ((((n * (m % 2**32)) >> 32) + n) >> l) == n // 244
    True
    """
    if not 1 <= d < 2**31:
        raise ValueError(f"magic_div: divisor {d} is outside [1, 2**31)")
    if d & (d - 1) == 0:  # a power of two: the shift alone
        return 0, d.bit_length() - 1
    l = (d - 1).bit_length()  # ceil(log2 d)
    m = (1 << 32) * ((1 << l) - d) // d + 1  # < 2**32
    return (m - (1 << 32) if m >= 1 << 31 else m), l


def _division_args(*divisors: int) -> tuple[tuple[int, ...], int]:
    """What the kernels take to divide program indices by these sizes: (m, l) of ``magic_div``
    for each, flattened, and FASTDIV, bit i set where divisor i is divided with its multiplier.
    A divisor equal to 1 reaches the kernel as a constant (Triton specialises such integers), and
    a plain division by it folds away, which a multiplier would not."""
    magic = tuple(v for d in divisors for v in magic_div(max(d, 1)))
    return magic, sum(1 << i for i, d in enumerate(divisors) if config.fast_div and d > 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _device_property(device: torch.device, name: str, default: int) -> int:
    """A CUDA device property, read once per device (``default`` for the interpreter on CPU)."""
    if device.type != "cuda":
        return default
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, name)
    if key not in _DEVICE_PROPS:
        _DEVICE_PROPS[key] = getattr(torch.cuda.get_device_properties(idx), name, default)
    return _DEVICE_PROPS[key]


@dataclasses.dataclass(frozen=True)
class _Grad:
    """Where one gradient goes: direct (``red`` False) or via [p, k] partials at ``off``."""

    red: bool
    p: int
    k: int
    off: int


class _Backward:
    """The planned backward for one set of required gradients."""

    __slots__ = ("needs", "atomic", "acc_views", "main", "final", "args_tail", "grads", "part_numel",
                 "final_args_tail")

    def __init__(self, plan: _Plan, needs: tuple[bool, bool, bool], atomic: bool = False) -> None:
        self.needs = needs
        self.atomic = atomic  # reduced gradients added with atomics into outputs the forward zeroed
        # Per operand, where its needed gradient lives inside that buffer ((offset, elements) of
        # acc_layout), or None: a tensor of its own.
        slots = plan.acc_layout()[1] if atomic else (None, None, None)
        self.acc_views = tuple(v if need else None for v, need in zip(slots, needs))
        n0, n1, n2, n3 = plan.sizes
        bm, bn, nb3 = plan.bm, plan.bn, plan.nb3
        row_tiles = _cdiv(n2, bm)
        masks = plan.masks
        # Split rows only when a needed gradient sums over d2; otherwise one tile per program.
        sums_rows = any(need and not (m & 2) for need, m in zip(needs, masks)) and row_tiles > 1
        s = row_tiles
        if sums_rows:
            base = n0 * n1 * nb3
            target = config.programs_per_sm * _device_property(plan.device, "multi_processor_count", 4)
            s = min(max(_cdiv(target, base), 1), row_tiles)
            s = _cdiv(row_tiles, _cdiv(row_tiles, s))
        rows_per_split = _cdiv(row_tiles, s) * bm
        extents = (n0, n1, s, nb3)
        grads: list[_Grad | None] = []
        off = 0
        for need, m, shape in zip(needs, masks, plan.shapes):
            if not need:
                grads.append(None)
                continue
            p = math.prod(e for b, e in enumerate(extents) if not m & (1 << (3 - b)))
            k = math.prod(shape) if shape is not None else 1
            grads.append(_Grad(p > 1, p, k, off))
            if p > 1:
                off += p * k
        self.grads = grads
        self.part_numel = 0 if atomic else off
        red = [g for g in grads if g is not None and g.red]
        # Narrow column blocks: more programs share the final sums, each in one or two steps.
        fbk = min(_pow2(max((g.k for g in red), default=1)), config.final_cols)
        fbr = min(_pow2(max((g.p for g in red), default=1)), max(1, config.final_block // fbk))
        grid = n0 * n1 * s * nb3
        self.main = plan.launcher(plan.kernels._lerp_bwd_kernel, grid, config.bwd_warps)
        zero = _Grad(False, 1, 1, 0)
        gx, gy, gw = (g or zero for g in grads)
        magic, fastdiv = _division_args(nb3, s, n1)
        self.args_tail = (
            n0, n1, n2, n3, s, nb3, rows_per_split, *magic, gx.off, gy.off, gw.off,
            masks[0], masks[1], masks[2], plan.w_scalar, needs[0], needs[1], needs[2], gx.red, gy.red, gw.red,
            plan.acc_f64, plan.big, plan.vec, bm, bn, config.full_tile_loads,
            plan.reverse_backward, plan.flat, plan.flat and config.even_tiles and n3 % bn == 0,
            config.bwd_loads_first, config.bwd_stream, config.bwd_joint_flush, atomic, fastdiv,
        )
        self.final = None
        self.final_args_tail = ()
        if red and not atomic:
            fgrid = sum(_cdiv(g.k, fbk) for g in red)
            self.final = plan.launcher(plan.kernels._lerp_final_kernel, fgrid, 4)
            self.final_args_tail = (gx.off, gy.off, gw.off, gx.p, gy.p, gw.p, gx.k, gy.k, gw.k,
                                    gx.red, gy.red, gw.red, plan.acc_f64, fbr, fbk)

    def main_args(self, g: Any, x: Any, y: Any, wt: Any, dx: Any, dy: Any, dw: Any, part: Any,
                  hi: float, lo: float) -> tuple:
        """The main backward kernel's arguments (tensors, or placeholders where only the layout
        matters); the native path's parameter slots follow this order (``install_native_backward``)."""
        return (g, x, y, wt, dx, dy, dw, part, hi, lo, *self.args_tail)

    def final_args(self, part: Any, dx: Any, dy: Any, dw: Any) -> tuple:
        """The final pass's arguments (only when ``final`` is planned)."""
        return (part, dx, dy, dw, *self.final_args_tail)


class _Plan:
    """Everything about a call that depends only on shapes, dtype and device."""

    def __init__(self, xs: torch.Size, ys: torch.Size, ws: torch.Size | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        try:
            self.out_shape = torch.broadcast_shapes(xs, ys, ws if ws is not None else ())
        except RuntimeError as e:
            raise ValueError(f"{_OP}: shapes x {tuple(xs)}, y {tuple(ys)}, weight "
                             f"{tuple(ws) if ws is not None else 'scalar'} do not broadcast: {e}") from None
        self.shapes = (tuple(xs), tuple(ys), tuple(ws) if ws is not None else None)
        self.dtype = dtype
        self.device = device
        self.w_scalar = ws is None
        self.numel = math.prod(self.out_shape)
        canon = canonicalize(self.out_shape, self.shapes) if self.numel else None
        on_triton_device = device.type == "cuda" or (
            device.type == "cpu" and force_triton_on_cpu and interpreter_active())
        self.use_triton = HAS_TRITON and on_triton_device and canon is not None
        self._backward: dict[tuple[tuple[bool, bool, bool], bool], _Backward] = {}
        self._acc: Any = False  # acc_layout(), once computed
        self.native: Any = None  # the C++ LerpPlan once the forward is installed there
        wanted = self.use_triton and _native.ENABLED and (device.type == "cuda" or native_on_cpu)
        self.native_pending = {False: wanted, True: wanted}  # forward variants not yet installed natively
        self.out_like = next((i for i, sh in enumerate(self.shapes) if sh == tuple(self.out_shape)), -1)
        self.part_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if not self.use_triton:
            return
        self.kernels = _kernels(device)
        self.device_index = device.index if device.type == "cuda" else None
        if device.type == "cuda" and self.device_index is None:
            self.device_index = torch.cuda.current_device()
        self.sizes, self.masks = canon
        n0, n1, n2, n3 = self.sizes
        # Flat calls on three output-sized operands (4-byte types) take smaller tiles, forward and
        # backward: PyTorch's vectorized kernel is then matched (H200, all-[16,102400] float32
        # forward: 8.64-8.74 µs against 8.80-8.90 with 2048-element tiles, PyTorch 8.64-8.77;
        # forward + backward unchanged). Smaller tiles in the forward alone cost the backward 1 µs.
        three_full = (n0 == n1 == n2 == 1 and not self.w_scalar
                      and all(math.prod(sh) == self.numel for sh in self.shapes))
        tiles = config.flat3_tile if three_full and dtype.itemsize in config.flat3_tile else config.tile
        tile = tiles[dtype.itemsize]
        self.bn = min(_pow2(n3), tile)
        self.bm = min(_pow2(n2), max(1, tile // self.bn))
        self.nb3 = _cdiv(n3, self.bn)
        self.acc_f64 = dtype == torch.float64
        self.big = self.numel >= 2**31 - 1
        self.vec = min(n3 & -n3, 16)  # largest power of two dividing the row length
        self.flat = config.flat_programs and n0 == n1 == n2 == 1
        # Walk the backward's programs from the end when the forward's bytes exceed L2: the
        # backward then starts on the inputs the forward read last, still cached (case 2:
        # backward 32.0 -> 28.8 µs). Data that fits measured slightly slower reversed.
        fwd_bytes = (sum(math.prod(sh) for sh in self.shapes if sh is not None) + self.numel) * dtype.itemsize
        self.reverse_backward = (config.bwd_reverse if config.bwd_reverse is not None
                                 else fwd_bytes > _device_property(device, "L2_cache_size", 1 << 62))
        # The forward has no reductions; its tile is chosen on its own (``fwd_tile``).
        ftile = (config.fwd_tile or tiles)[dtype.itemsize]
        fbn = min(_pow2(n3), ftile)
        fbm = min(_pow2(n2), max(1, ftile // fbn))
        fnb3, row_tiles = _cdiv(n3, fbn), _cdiv(n2, fbm)
        # At most 16 elements per thread: 2-byte types' 4096-element tiles get 8 warps (H200,
        # all-[16,102400] bf16 forward: 5.95 µs with 4 warps, 5.46 with 8; PyTorch 5.47).
        warps = max(config.fwd_warps, ftile // 512) if fbm == 1 else config.fwd_warps
        if config.fwd_plane and not self.flat and n2 > 1 and n3 % fbn:
            # Rows that leave part of the tile idle: walk each plane flat instead (one compile
            # per row length, which the kernel takes as a constant).
            plane = n2 * n3
            ftile = config.plane_tile[dtype.itemsize]
            nbp = _cdiv(plane, ftile)
            magic, fastdiv = _division_args(nbp, n1)
            self.fwd = self.launcher(self.kernels._lerp_fwd_plane_kernel, n0 * n1 * nbp, config.fwd_warps)
            self.fwd_tail = (n0, n1, n2, plane, nbp, *magic, *self.masks, self.w_scalar, self.acc_f64, self.big,
                             min(plane & -plane, 16), n3, ftile, config.fwd_stream_store, fastdiv)
        else:
            magic, fastdiv = _division_args(fnb3, row_tiles, n1)
            self.fwd = self.launcher(self.kernels._lerp_fwd_kernel, n0 * n1 * row_tiles * fnb3, warps)
            self.fwd_tail = (n0, n1, n2, n3, row_tiles, fnb3, fbm, *magic, *self.masks, self.w_scalar, self.acc_f64,
                             self.big, self.vec, fbm, fbn, config.full_tile_loads, config.fwd_stream_store,
                             self.flat, self.flat and config.even_tiles and n3 % fbn == 0, fastdiv,
                             config.flat3_evict.get(dtype.itemsize, 0) if three_full else 0)
        # The same forward that also zeroes the buffer its backward sums into (another compiled
        # specialisation, so a launcher of its own).
        self.fwd_zero = self.launcher(self.fwd.fn, self.fwd.grid, self.fwd.num_warps)

    def launcher(self, fn: Any, grid: int, num_warps: int) -> Launcher:
        return Launcher(fn, grid, num_warps, self.device_index)

    def forward_args(self, x: Any, y: Any, wt: Any, out: Any, hi: float, lo: float,
                     acc: Tensor | None = None) -> tuple:
        """The forward kernel's arguments (``fwd``, or ``fwd_zero`` with ``acc``, the buffer the
        kernel then also zeroes); ``acc`` sits at index ``6 + len(fwd_tail)``. ``x``, ``y``,
        ``wt``, ``out``: tensors, or placeholders where only the layout matters."""
        zero = acc is not None
        return (x, y, wt, out, hi, lo, *self.fwd_tail, acc if zero else out, acc.numel() if zero else 0, zero)

    def backward_plan(self, needs: tuple[bool, bool, bool], atomic: bool = False) -> _Backward:
        """The backward for these needed gradients; ``atomic``: summing into the forward's zeroed
        buffer."""
        bw = self._backward.get((needs, atomic))
        if bw is None:
            bw = self._backward[(needs, atomic)] = _Backward(self, needs, atomic)
        return bw

    def acc_layout(self) -> tuple[int, tuple[tuple[int, int] | None, ...]] | None:
        """The buffer a forward zeroes for its backward's atomic sums: (elements, per operand
        (offset, elements) or None), covering every broadcast operand; None where the partial
        sums stay (half types, no final pass to save, or more than ``config.atomic_max``)."""
        if self._acc is False:
            self._acc = None
            if (self.use_triton and config.atomic_max > 0 and self.dtype in (torch.float32, torch.float64)
                    and self.backward_plan((True, True, not self.w_scalar)).final is not None):
                slots: list[tuple[int, int] | None] = []
                off = 0
                line = 128 // self.dtype.itemsize  # each gradient on cache lines of its own
                for sh in self.shapes:
                    n = math.prod(sh) if sh is not None else 0
                    slots.append((off, n) if sh is not None and n < self.numel else None)
                    off += _cdiv(n, line) * line if slots[-1] is not None else 0
                if 0 < off <= config.atomic_max:
                    self._acc = (off, tuple(slots))
        return self._acc

    def has_native_backward(self, mask: int) -> bool:
        """Whether the C++ side holds the backward that eager calls with this needs mask (bit 0
        dx, 1 dy, 2 dw) take: the atomic one where this plan has a zeroed buffer, else partials."""
        n = self.native
        return n is not None and (n.has_backward_atomic(mask) if self.acc_layout() is not None
                                  else n.has_backward(mask))

    def wants_acc(self, device: torch.device) -> bool:
        """Whether a forward with grad zeroes a buffer for its backward's atomic sums now: not in
        deterministic mode, and not inside CUDA-graph capture (a graph could replay the backward
        without the forward that zeroes it)."""
        return (self.acc_layout() is not None and not torch.are_deterministic_algorithms_enabled()
                and not (device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing()))

    # -- the native front door: programs built from launches Triton has compiled
    def install_native_forward(self, args: tuple, zero: bool) -> None:
        """Hand a forward to the C++ side after its first launch (``args``: that launch's;
        ``zero``: the variant that also zeroes the backward's buffer)."""
        self.native_pending[zero] = False
        if self.native is None:
            mod = _native.load(cuda=self.device.type == "cuda")
            if mod is None:
                self.native_pending = {False: False, True: False}
                return
            ref = weakref.ref(self)  # the C++ plan holds this callback: no cycle through C++
            nat = mod.LerpPlan(-1 if self.device_index is None else self.device_index, self.w_scalar, self.acc_f64,
                               lambda g, x, y, w, wv, needs, acc: _native_backward(ref, g, x, y, w, wv, needs, acc))
            layout = self.acc_layout()
            if layout is not None:  # the forward's tensor for it is shaped as its first gradient
                first = next(i for i, v in enumerate(layout[1]) if v is not None and v[0] == 0)
                nat.set_acc(layout[0], list(self.shapes[first]), self.dtype)
            mod.register_plan(nat, args[0], args[1], None if self.w_scalar else args[2])
            self.native = nat
        weight = (4, 5) if self.w_scalar else None
        acc_arg = 6 + len(self.fwd_tail)
        launch = _native.native_launch(self.fwd_zero if zero else self.fwd, args,
                                       {0: 0, 1: 1, 2: 2, 3: 3, acc_arg: 4 if zero else 3}, weight)
        if launch is None:
            return
        # Buffer 4, the zeroed buffer of a forward with grad, comes from the C++ side's per-stream slab.
        self.native.install(-2 if zero else -1, 5 if zero else 4, [(3, list(self.out_shape), self.dtype)], [launch], [])

    def install_native_backward(self, bw: _Backward, main_args: tuple, final_args: tuple) -> None:
        """Hand a backward to the C++ side after its first launch. Buffers: 0-3 g, x, y, w;
        4-6 the gradients (allocated, or with ``bw.atomic`` views of the forward's zeroed buffer
        for broadcast operands); 7 the partial sums."""
        if self.native is None:
            return
        weight = (8, 9) if self.w_scalar else None
        launches = [_native.native_launch(bw.main, main_args, {i: i for i in range(8)}, weight)]
        if bw.final is not None:
            launches.append(_native.native_launch(bw.final, final_args, {0: 7, 1: 4, 2: 5, 3: 6}, None))
        if any(la is None for la in launches):
            return
        # Two or three allocated gradients share one allocation (one caching-allocator call on
        # the engine's worker thread instead of one each; the gradients then share a storage, as
        # torch.cat's backward hands out views of one gradient).
        own = [i for i in range(3) if bw.needs[i] and bw.acc_views[i] is None]
        allocs = [(4 + i, list(self.shapes[i]), self.dtype, len(own) > 1) for i in own]
        views = [(4 + i, v[0], list(self.shapes[i])) for i, v in enumerate(bw.acc_views) if v is not None]
        if bw.part_numel:
            allocs.append((7, [bw.part_numel], self.part_dtype))
        mask = sum(1 << i for i in range(3) if bw.needs[i])
        self.native.install(mask + (8 if bw.atomic else 0), 8, allocs, launches, views)

def interpreter_active() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1`` set before Triton was imported)."""
    if not HAS_TRITON:
        return False
    import triton.language.standard as tl_std

    # Triton decides at import time: its own @jit library must be interpreted too, not just ours.
    return type(tl_std.sum).__name__ == "InterpretedFunction"


def _kernels(device: torch.device) -> Any:
    from . import _lerp_triton

    if device.type != "cuda" and not interpreter_active():
        raise RuntimeError(f"{_OP}: running the Triton kernels on CPU tensors needs TRITON_INTERPRET=1 set "
                           "before triton is imported")
    if device.type != "cuda" and type(_lerp_triton._lerp_fwd_kernel).__name__ != "InterpretedFunction":
        import importlib

        importlib.reload(_lerp_triton)  # first imported before the interpreter was switched on
    return _lerp_triton


def _plan(x: Tensor, y: Tensor, w: Tensor | None) -> _Plan:
    key = (x.shape, y.shape, w.shape if w is not None else None, x.dtype, x.device)
    plan = _PLANS.get(key)
    if plan is None:
        _check(x, y, w)
        plan = _PLANS[key] = _Plan(x.shape, y.shape, w.shape if w is not None else None, x.dtype, x.device)
    elif y.dtype != x.dtype or y.device != x.device or (w is not None and (w.dtype != x.dtype or w.device != x.device)):
        _check(x, y, w)
    return plan


def _check(x: Tensor, y: Tensor, w: Tensor | None) -> None:
    for name, t in (("y", y), ("weight", w)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"{_OP}: {name} has dtype {t.dtype} but x has {x.dtype}; cast them to one dtype")
        if t.device != x.device:
            raise ValueError(f"{_OP}: {name} is on {t.device} but x is on {x.device}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{_OP}: dtype {x.dtype} is not supported (use one of "
                        f"{', '.join(str(d) for d in SUPPORTED_DTYPES)})")


def _split_weight(wv: float, acc_f64: bool) -> tuple[float, float]:
    if not acc_f64:
        return wv, 0.0
    import numpy as np

    hi = float(np.float32(wv))
    return hi, wv - hi


# ----------------------------------------------------------------------------- implementations

def _forward_impl(x: Tensor, y: Tensor, w: Tensor | None, wv: float, plan: _Plan | None = None,
                  out: Tensor | None = None, acc: Tensor | None = None) -> Tensor:
    """The forward on a planned call; ``out`` (in place: ``x`` itself, contiguous) or a new tensor.
    ``acc``: a buffer of ``plan.acc_layout()`` the kernel also zeroes (for the backward's atomics)."""
    plan = plan or _plan(x, y, w)
    if not plan.use_triton:
        return torch.lerp(x, y, w if w is not None else wv)
    x, y, wt = _operands(x, y, w)
    fresh = out is None
    if out is None:
        # empty_like costs about a third of empty(shape, dtype=, device=) from Python.
        like = plan.out_like
        out = torch.empty_like((x, y, wt)[like]) if like >= 0 else x.new_empty(plan.out_shape)
    hi, lo = _split_weight(wv, plan.acc_f64)
    ptrs = (x.data_ptr(), y.data_ptr(), wt.data_ptr(), out.data_ptr())
    aligned = not ((ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15)
    zero = acc is not None
    args = plan.forward_args(x, y, wt, out, hi, lo, acc)
    (plan.fwd_zero if zero else plan.fwd)(args, aligned, ptrs)
    if plan.native_pending[zero] and aligned and fresh:  # the native program allocates its output
        plan.install_native_forward(args, zero)
    return out


def _resolved(t: Tensor | None) -> Tensor | None:
    """A negated view (``torch._neg_view``) as real values: the kernels read raw memory."""
    return t.resolve_neg() if t is not None and t.is_neg() else t


def _contiguous(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _operands(x: Tensor, y: Tensor, w: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """x, y and the weight as the kernels read them: resolved and contiguous; a float weight's
    pointer argument is ``x`` (never read)."""
    x, y = _contiguous(_resolved(x)), _contiguous(_resolved(y))
    return x, y, x if w is None else _contiguous(_resolved(w))


def _backward_impl(g: Tensor, x: Tensor, y: Tensor, w: Tensor | None, wv: float, needs: tuple[bool, bool, bool],
                   plan: _Plan | None = None, native_install: bool = False, acc: Tensor | None = None
                   ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The backward on a planned call. ``acc``: the buffer this call's forward zeroed; the
    gradients of broadcast operands are then summed into views of it with atomics."""
    plan = plan or _plan(x, y, w)
    if not plan.use_triton:
        return _backward_torch(g, x, y, w if w is not None else wv, needs)
    if not any(needs):
        return None, None, None
    bw = plan.backward_plan(needs, atomic=acc is not None)
    g = _contiguous(_resolved(g))
    x, y, wt = _operands(x, y, w)
    dx, dy, dw = (g if not need else torch.empty_like(like) if v is None else acc[v[0]:v[0] + v[1]].view(shape)
                  for need, v, like, shape in zip(needs, bw.acc_views, (x, y, wt), plan.shapes))
    part = g.new_empty(bw.part_numel, dtype=plan.part_dtype) if bw.part_numel else g
    hi, lo = _split_weight(wv, plan.acc_f64)
    ptrs = (g.data_ptr(), x.data_ptr(), y.data_ptr(), wt.data_ptr(), dx.data_ptr(), dy.data_ptr(), dw.data_ptr(),
            part.data_ptr())
    aligned = not ((ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15)
    main_args = bw.main_args(g, x, y, wt, dx, dy, dw, part, hi, lo)
    bw.main(main_args, aligned, ptrs)
    final_args: tuple = ()
    if bw.final is not None:
        final_args = bw.final_args(part, dx, dy, dw)
        bw.final(final_args, True, (ptrs[7], ptrs[4], ptrs[5], ptrs[6]))
    if native_install and aligned:
        plan.install_native_backward(bw, main_args, final_args)
    return (dx if needs[0] else None, dy if needs[1] else None, dw if needs[2] else None)


def _native_backward(ref: Any, g: Tensor, x: Tensor, y: Tensor, w: Tensor | None, wv: float,
                     needs: tuple[bool, bool, bool], acc: Tensor | None = None
                     ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The C++ node's way back: a set of gradients not planned natively yet (planned now for next
    time), or tensors the native path does not take (misaligned, another current device)."""
    plan = ref()
    if plan is None:  # the plan cache was cleared while the graph lived
        plan = _plan(x, y, w)
        if acc is not None and plan.acc_layout() is None:
            acc = None  # a plan built under another config
    return _backward_impl(g, x, y, w, wv, needs, plan, native_install=True, acc=acc)


def _backward_torch(g: Tensor, x: Tensor, y: Tensor, w: Tensor | float, needs: Sequence[bool]
                    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The reference formulas in PyTorch ops (CPU path and shapes beyond 4 coalesced dims)."""
    dx = (g * (1 - w)).sum_to_size(x.shape) if needs[0] else None
    dy = (g * w).sum_to_size(y.shape) if needs[1] else None
    dw = (g * (y - x)).sum_to_size(w.shape) if needs[2] and isinstance(w, Tensor) else None
    return dx, dy, dw


# ----------------------------------------------------------------------------- front doors

class _LerpFunction(torch.autograd.Function):
    """Eager front door: one Python autograd node, no dispatcher round trip."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, y: Tensor, w: Tensor | None, wv: float, plan: _Plan) -> Tensor:
        ctx.save_for_backward(x, y, w)
        ctx.wv = wv
        ctx.plan = plan
        ctx.acc = x.new_empty(plan.acc_layout()[0]) if plan.wants_acc(x.device) else None
        return _forward_impl(x, y, w, wv, plan, acc=ctx.acc)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        x, y, w = ctx.saved_tensors
        n = ctx.needs_input_grad
        needs = (n[0], n[1], n[2])
        # create_graph=True, or a batched gradient (vmap over the backward, as in
        # jacobian(vectorize=True); it has no storage): differentiable PyTorch formulas
        acc, ctx.acc = ctx.acc, None  # zeroed once: a second backward (retain_graph) sums partials
        if torch.is_grad_enabled() or torch._C._are_functorch_transforms_active() or not torch._C._has_storage(g):
            return (*_backward_torch(g, x, y, w if w is not None else ctx.wv, needs), None, None)
        if acc is not None and not ctx.plan.wants_acc(g.device):
            acc = None
        return (*_backward_impl(g, x, y, w, ctx.wv, needs, ctx.plan, acc=acc), None, None)


# autograd.Function.apply's C++ half, bound to our class. The Python half only binds default
# arguments (we have none) and unwraps functorch wrappers (lerp() sends functorch transforms to
# torch.lerp): about 3 µs of a ~10 µs call saved.
_apply = super(torch.autograd.Function, _LerpFunction).apply


# Explicit schemas: they do not depend on how a torch version reads string annotations.
@torch.library.custom_op("flowexec::lerp", mutates_args=(),
                         schema="(Tensor x, Tensor y, Tensor? weight, float weight_value=0.0) -> Tensor")
def _lerp_op(x: Tensor, y: Tensor, weight: Tensor | None, weight_value: float = 0.0) -> Tensor:
    return _forward_impl(x, y, weight, weight_value)


@_lerp_op.register_fake
def _lerp_fake(x: Tensor, y: Tensor, weight: Tensor | None, weight_value: float = 0.0) -> Tensor:
    _check(x, y, weight)
    shape = torch.broadcast_shapes(x.shape, y.shape, weight.shape if weight is not None else ())
    return x.new_empty(shape)


@torch.library.custom_op("flowexec::lerp_backward", mutates_args=(),
                         schema="(Tensor grad, Tensor x, Tensor y, Tensor? weight, float weight_value, bool[] needs) "
                                "-> Tensor[]")
def _lerp_backward_op(grad: Tensor, x: Tensor, y: Tensor, weight: Tensor | None, weight_value: float,
                      needs: list[bool]) -> list[Tensor]:
    grads = _backward_impl(grad, x, y, weight, weight_value, (needs[0], needs[1], needs[2]))
    # Ops cannot return None: a gradient that was not asked for is an empty tensor.
    return [t if t is not None else grad.new_empty(0) for t in grads]


@_lerp_backward_op.register_fake
def _lerp_backward_fake(grad: Tensor, x: Tensor, y: Tensor, weight: Tensor | None, weight_value: float,
                        needs: list[bool]) -> list[Tensor]:
    shapes = (x.shape, y.shape, weight.shape if weight is not None else None)
    return [grad.new_empty(s) if need and s is not None else grad.new_empty(0) for need, s in zip(needs, shapes)]


def _op_setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, y, w, wv = inputs
    ctx.save_for_backward(x, y, w)
    ctx.wv = wv


def _op_backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
    x, y, w = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [bool(n[0]), bool(n[1]), bool(n[2]) and w is not None]
    dx, dy, dw = torch.ops.flowexec.lerp_backward(g, x, y, w, ctx.wv, needs)
    return (dx if needs[0] else None, dy if needs[1] else None, dw if needs[2] else None, None)


_lerp_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# The in-place op: the forward kernel writing into ``self``. Defined through the low-level
# Library API because its return aliases a mutated input (``Tensor(a!)``, as aten.lerp_ has),
# which the dependency and memory passes read from the schema; ``custom_op`` cannot declare that.
_LIB = torch.library.Library("flowexec", "FRAGMENT")
_LIB.define("lerp_(Tensor(a!) self, Tensor end, Tensor? weight, float weight_value=0.0) -> Tensor(a!)")


def _lerp_inplace(x: Tensor, y: Tensor, weight: Tensor | None, weight_value: float = 0.0) -> Tensor:
    """``x.lerp_(y, weight)`` with the fused forward kernel writing into ``x``.

    ATen's ``lerp_`` takes what the kernel does not: autograd (an input needs grad), forward AD,
    tracing and functorch, non-contiguous or negated ``x``, an operand that overlaps ``x`` other than ``x``
    itself, dtypes or devices that differ, and devices without the Triton path.

    Example::

        >>> import torch
        >>> import flowexec.kernels  # registers the op
        >>> m = torch.zeros(4)
        >>> torch.ops.flowexec.lerp_(m, torch.ones(4), None, 0.1)
        tensor([0.1000, 0.1000, 0.1000, 0.1000])
    """
    w = weight
    aten = lambda: x.lerp_(y, w if w is not None else weight_value)  # noqa: E731
    ops = (x, y) if w is None else (x, y, w)
    if (_tracing(x, y, w) or _transforming()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in ops))):
        return aten()
    if not x.is_contiguous() or x.is_neg() or x.is_conj() or any(_overlaps(t, x) for t in ops[1:]):
        return aten()
    if x.is_inference() and not torch.is_inference_mode_enabled():
        return aten()  # ATen refuses to update an inference tensor outside inference mode
    try:  # the plan checks dtypes, devices and broadcasting once per signature
        plan = _plan(x, y, w)
    except (TypeError, ValueError):
        return aten()  # ATen's own error
    if not plan.use_triton or plan.out_shape != x.shape:
        return aten()
    _forward_impl(x, y, w, weight_value, plan, out=x)
    torch.autograd.graph.increment_version(x)  # the kernel wrote through a raw pointer
    return x


def _overlaps(t: Tensor, x: Tensor) -> bool:
    """Whether ``t`` shares memory with ``x`` other than as the very same elements (an identical
    view is fine: each element is read and written by one thread)."""
    if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return False
    return not (t.data_ptr() == x.data_ptr() and t.shape == x.shape and t.stride() == x.stride())


_LIB.impl("lerp_", _lerp_inplace, "CompositeImplicitAutograd")


_PLAIN = (Tensor, torch.nn.Parameter)


def _transforming() -> bool:
    """Forward AD (an open dual level) or a functorch transform: ATen's lerp carries tangents
    and batching, with the same formula."""
    return _fwAD._current_level >= 0 or torch._C._are_functorch_transforms_active()


def _tracing(x: Tensor, y: Tensor, w: Tensor | None) -> bool:
    # Dispatch modes (make_fx's proxy mode, fake/functional modes) and Dynamo need the op, not
    # our launches; so do tensor subclasses (a Parameter is a plain tensor here).
    if torch._C._len_torch_dispatch_stack() > 0 or torch.compiler.is_compiling():
        return True
    for t in (x, y, w):
        if t is not None and type(t) is not Tensor and not isinstance(t, torch.nn.Parameter):
            return True
    return False


def lerp(x: Tensor, y: Tensor, weight: Tensor | float) -> Tensor:
    """``x + weight * (y - x)`` with broadcasting and a fused backward.

    ``x``, ``y`` and a tensor ``weight`` broadcast against each other and must share dtype
    (float16, bfloat16, float32, float64) and device. Eager CUDA calls run natively (C++
    launches and autograd node) once their shapes are planned, else a lean autograd function;
    under tracing the call records ``torch.ops.flowexec.lerp``.

    Example::

        >>> import torch
        >>> from flowexec.kernels import lerp
        >>> x = torch.zeros(2, 3, requires_grad=True)
        >>> w = torch.tensor([0.0, 0.5, 1.0], requires_grad=True)
        >>> out = lerp(x, torch.ones(2, 3), w)
        >>> out
        tensor([[0.0000, 0.5000, 1.0000],
                [0.0000, 0.5000, 1.0000]], grad_fn=<_LerpFunctionBackward>)
        >>> out.sum().backward(); w.grad
        tensor([2., 2., 2.])
    """
    if isinstance(weight, Tensor):
        w, wv = weight, 0.0
    else:
        w, wv = None, float(weight)
    if _fwAD._current_level >= 0:  # a dual level is open: ATen's lerp carries the tangents
        return torch.lerp(x, y, weight)
    front = _native.front_door
    if (front is not None and type(x) in _PLAIN and type(y) in _PLAIN and (w is None or type(w) in _PLAIN)
            and not torch.compiler.is_compiling()):
        # C++ from here: dispatch-mode and functorch checks, plan lookup, forward and autograd
        # node. None: not planned natively yet, or a call it leaves to the paths below.
        out = front(x, y, w, wv)
        if out is not None:
            return out
    if _tracing(x, y, w):
        return torch.ops.flowexec.lerp(x, y, w, wv)
    if torch._C._are_functorch_transforms_active():
        # vmap/grad/jvp see through ATen's lerp, which computes the same formula
        return torch.lerp(x, y, weight)
    plan = _plan(x, y, w)
    if not torch.is_grad_enabled() or not (x.requires_grad or y.requires_grad or (w is not None and w.requires_grad)):
        return _forward_impl(x, y, w, wv, plan)  # nothing to differentiate: no autograd node
    return _apply(x, y, w, wv, plan)
