"""Regions of a program compiled by Inductor, as ops of the program.

:class:`InductorCompiler` turns a :class:`~flowexec.passes.regions.Region` into a
:class:`FusedKernel`: the region's ATen ops become an FX graph of its inputs, Inductor
(``torch._inductor.compile_fx.compile_fx``: Triton on CUDA, C++ on CPU) compiles it, and the
kernel is called like an op: ``fused(*inputs) -> outputs``. Its schema says which inputs it
writes in place, so every pass after fusion (dependencies, liveness, streams, events, verify)
reads a fused op as it reads an ATen op; the runtime calls it as it calls any op.

Regions with the same ops, constants, shapes, dtypes, strides and devices (a model's repeated
blocks) share one compiled kernel: :func:`region_key` is what they share, and the compiler
keeps one kernel per key for the life of the process. A region Inductor refuses stays ATen
ops; the reason is kept (``compiler.failures``) for ``plan.stats()`` and ``explain()``.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> from flowexec.passes.regions import find_regions
    >>> prog = capture(lambda x: (x.sin() * 2).relu(), (torch.randn(8),)).program
    >>> (region,) = find_regions(prog)
    >>> kernel = InductorCompiler().compile(prog, region)  # doctest: +SKIP
    >>> kernel(torch.ones(8))  # doctest: +SKIP
    [tensor([1.6829, ...])]
"""
from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import importlib
import operator
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

from .inductor_entries import compile_noting_key, entry_name, kept_entries, load_entry
from .inductor_keys import keep_process_keys
from .passes.copy_in import dense_layout
from .passes.metas import fake_tensor
from .passes.regions import Region, alias_groups_of
from .program import Program, Ref, TensorMeta, map_nested, op_name, written_args
from .verdict_cache import VerdictCache, shared_cache


class FusedKernel:
    """A compiled region, called like an op: ``kernel(*inputs) -> list of outputs``.

    ``_schema`` declares every input, the written ones as ``Tensor(aN!)``, and the outputs, those
    that *are* an input (an in-place op's result) with that input's alias set, so that the
    program's analyses see the same reads, writes and aliasing as the region's ATen ops had.
    ``reference`` runs the region's ATen ops (the FX graph Inductor compiled): after
    :meth:`check_first_call` the next call runs both and, where they differ, keeps the ATen
    ops for good (``status`` says why).
    """

    def __init__(self, name: str | None, compiled: Callable[..., Any], reference: Callable[..., Any], n_inputs: int,
                 mutated: Sequence[int], aliases: Sequence[int], summary: str, key: str) -> None:
        self.summary, self.key = summary, key
        self.status = "compiled"
        self.tags: tuple[Any, ...] = ()
        self.reference = reference
        self._mutated = tuple(mutated)
        self._aliases = tuple(aliases)
        args = ", ".join(f"Tensor(a{k}!) x{k}" if k in self._mutated else f"Tensor x{k}" for k in range(n_inputs))
        rets = ", ".join(f"Tensor(a{a}!)" if a >= 0 else "Tensor" for a in aliases)
        self._signature = f"({args}) -> ({rets})"
        self.rename(name or "fused_unnamed")
        self.named = name is not None  # (None: named where a compiler first hands it out, in a pass's order)
        self._fast = self._assemble(compiled)
        self._call = self._fast

    def rename(self, name: str) -> None:
        """Name the kernel (and its schema): before any program holds it."""
        self.__name__ = self.__qualname__ = name
        self._schema = torch._C.parse_schema(f"flowexec::{name}{self._signature}")
        self.named = True

    def _assemble(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (which returns the computed outputs) as the op: outputs that are inputs added."""
        aliases = self._aliases
        if all(a < 0 for a in aliases):
            return fn  # the common case: every output computed, handed back as is

        def call(*args: Any) -> list[Any]:
            it = iter(fn(*args))
            return [next(it) if a < 0 else args[a] for a in aliases]
        return call

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)

    def check_first_call(self) -> None:
        """Have the next call compare the kernel with the region's ATen ops (once)."""
        if self.status == "compiled":
            self._call = self._checked

    def _checked(self, *args: Any) -> Any:
        saved = {k: args[k].clone() for k in self._mutated}
        out = self._fast(*args)
        ref_args = [saved[k].clone() if k in saved else a for k, a in enumerate(args)]
        ref = self._assemble(self.reference)(*ref_args)
        why = _difference(list(out) + [args[k] for k in saved], list(ref) + [ref_args[k] for k in saved])
        if why is None:
            self.status = "compiled, checked"
            self._call = self._fast
            return out
        self.status = f"fallback: miscompiled ({why}); runs its ATen ops"
        self._call = self._assemble(self.reference)
        with torch.no_grad():
            for k in saved:
                args[k].copy_(ref_args[k])
        return [args[a] if a >= 0 else r for a, r in zip(self._aliases, ref)]

    def __repr__(self) -> str:
        return f"<FusedKernel {self.__name__}: {self.summary}>"


def _difference(got: Sequence[Any], want: Sequence[Any]) -> str | None:
    """Where ``got`` differs from ``want`` beyond a kernel compiler's rounding, or None."""
    for k, (a, b) in enumerate(zip(got, want)):
        if not isinstance(a, torch.Tensor):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {k}: {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
        if a.is_floating_point():
            tol = {torch.float64: 1e-7, torch.float32: 1e-4}.get(a.dtype, 2e-2)
            if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol, equal_nan=True):
                err = (a.float() - b.float()).abs().max().item()
                return f"output {k}: max difference {err:.3g}"
        elif not torch.equal(a, b):
            return f"output {k}: values differ"
    return None


def _example(meta: TensorMeta) -> torch.Tensor:
    """A tensor of ``meta``'s dtype, shape, strides and device, filled with zeros (valid indices
    for a region that gathers; a memset, where random values cost seconds on a CPU's logits)."""
    stride = meta.stride if meta.stride is not None else _contiguous(meta.shape)
    return torch.empty_strided(meta.shape, stride, dtype=meta.dtype, device=meta.device).zero_()


def _contiguous(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


@dataclass(frozen=True)
class Local:
    """A value inside a :class:`GraphRecipe`: input ``k`` (k < n_inputs) or an op's output."""

    k: int


@dataclass(frozen=True)
class GraphRecipe:
    """A region's ops as plain data, picklable where their arguments are (a compile worker
    builds the same graph from it: :func:`graph_of`). ``ops``: per op, its target (an ATen
    overload's name, ``aten.add.Tensor``, or the callable itself), arguments (:class:`Local` for
    values), keyword arguments, and the locals its outputs become (one, unpacked where
    ``unpack``; -1 for an output nothing reads); ``returned``: the locals the graph returns."""

    n_inputs: int
    ops: tuple[tuple[Any, tuple[Any, ...], tuple[tuple[str, Any], ...], tuple[int, ...], bool], ...]
    returned: tuple[int, ...]


def recipe_of(prog: Program, region: Region, force_strides: bool = False, views_as_reshapes: bool = False) -> GraphRecipe:
    """The region as a :class:`GraphRecipe`: its inputs, its ops, its computed outputs returned;
    with ``force_strides``, each dense output that shares memory with no other value of the
    region asks Inductor for the program's strides (:func:`_dense_stride`; what
    :meth:`InductorCompiler.compile` tries where a kernel returned other strides); with
    ``views_as_reshapes``, each ``aten.view`` a ``reshape`` (:meth:`InductorCompiler.with_views_as_reshapes`)."""
    local: dict[int, int] = {v: k for k, v in enumerate(region.inputs)}

    def leaf(a: Any) -> Any:
        if isinstance(a, Ref):
            if a.id in local:
                return Local(local[a.id])
            if a.id in prog.consts:
                return prog.consts[a.id]
            raise KeyError(f"value {prog.values[a.id].label} is not available inside the region")
        return a

    def arg(a: Any) -> Any:
        return map_nested(a, leaf)

    ops = []
    for i in region.ops:
        op = prog.ops[i]
        args, kwargs = tuple(arg(a) for a in op.args), tuple((k, arg(v)) for k, v in op.kwargs)
        outs = []
        for o in (op.outputs if op.unpack else op.outputs[:1]):
            if o >= 0:
                local[o] = len(local)
            outs.append(local[o] if o >= 0 else -1)
        target = op_name(op.target) if isinstance(op.target, torch._ops.OpOverload) else op.target
        if views_as_reshapes and target == _VIEW:
            target = _RESHAPE
        ops.append((target, args, kwargs, tuple(outs), op.unpack))
    if not force_strides:
        return GraphRecipe(len(region.inputs), tuple(ops), tuple(local[o] for o in region.computed))
    # (forced into other strides, a value that shares memory with another the program sees of
    # the region, an input or another output, would be a copy, parted from it: the program's
    # alias groups say which do, views, in-place ops and _unsafe_view alike. One that shares it
    # only with the region's own intermediates parts from nothing anyone reads)
    groups = alias_groups_of(prog)
    members = collections.Counter(groups[v] for v in (*region.inputs, *region.computed))
    returned: list[int] = []
    for v in region.computed:
        stride = _dense_stride(prog.values[v].meta) if members[groups[v]] == 1 else None
        if stride is None:
            returned.append(local[v])
        else:
            returned.append(len(local) + len(ops) - len(region.ops))
            ops.append((_FORCE_STRIDES, (Local(local[v]), stride), (), (returned[-1],), False))
    return GraphRecipe(len(region.inputs), tuple(ops), tuple(returned))


_FORCE_STRIDES = "prims.inductor_force_stride_order.default"  # (Inductor's: no-op where they are already)
_VIEW, _RESHAPE = "aten.view.default", "aten.reshape.default"


def _dense_stride(meta: TensorMeta | None) -> tuple[int, ...] | None:
    """``meta``'s strides where they lay out a dense tensor (:func:`~flowexec.passes.copy_in.dense_layout`)
    of two or more dimensions longer than one, else None (a slice of a wider tensor, a vector)."""
    if meta is None or meta.stride is None or sum(s > 1 for s in meta.shape) < 2:
        return None
    return tuple(meta.stride) if dense_layout(meta.shape, meta.stride) else None


def graph_of(recipe: GraphRecipe) -> fx.GraphModule:
    """The FX graph of a :class:`GraphRecipe`: placeholders, its ops, its returned values."""
    g = fx.Graph()
    env: dict[int, fx.Node] = {k: g.placeholder(f"x{k}") for k in range(recipe.n_inputs)}

    def arg(a: Any) -> Any:
        return map_nested(a, lambda x: env[x.k] if isinstance(x, Local) else x)

    for target, args, kwargs, outs, unpack in recipe.ops:
        node = g.call_function(_overload(target), arg(args), {k: arg(v) for k, v in kwargs})
        if unpack:
            for j, o in enumerate(outs):
                if o >= 0:
                    env[o] = g.call_function(operator.getitem, (node, j))
        elif outs and outs[0] >= 0:
            env[outs[0]] = node
    g.output(tuple(env[o] for o in recipe.returned))
    return fx.GraphModule(torch.nn.Module(), g)


def _overload(target: Any) -> Any:
    """An ATen overload from its name (``aten.add.Tensor``); any other target as it is."""
    if not isinstance(target, str):
        return target
    if target == _FORCE_STRIDES:
        importlib.import_module("torch._inductor.inductor_prims")  # (registers the prim)
    ns, name, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def region_graph(prog: Program, region: Region, force_strides: bool = False) -> fx.GraphModule:
    """The region's ops as an FX graph: placeholders for its inputs, its computed outputs returned."""
    return graph_of(recipe_of(prog, region, force_strides))


def region_key(prog: Program, region: Region) -> str:
    """What two regions must share to share a kernel: ops, constants, input metas (dtype,
    shape, strides, device), written inputs and which values are returned."""
    local: dict[int, str] = {v: f"x{k}" for k, v in enumerate(region.inputs)}
    lines = [";".join(f"{m.dtype}{list(m.shape)}{list(m.stride or ())}@{m.device}"
                      for m in (prog.values[v].meta for v in region.inputs))]

    def fmt(a: Any) -> str:
        if isinstance(a, Ref):
            return local.get(a.id) or f"c{repr(prog.consts.get(a.id))}"
        if isinstance(a, (list, tuple)):
            return "[" + ",".join(fmt(x) for x in a) + "]"
        return repr(a)

    for n, i in enumerate(region.ops):
        op = prog.ops[i]
        for j, o in enumerate(op.outputs):
            if o >= 0:
                local[o] = f"t{n}_{j}"
        args = ",".join([fmt(a) for a in op.args] + [f"{k}={fmt(v)}" for k, v in op.kwargs])
        lines.append(f"{op_name(op.target)}({args})")
    lines.append("out:" + ",".join(local[o] for o in region.outputs))
    lines.append(f"alias:{region.aliases} mut:{region.mutated}")
    return "\n".join(lines)


def summarize(prog: Program, region: Region, limit: int = 6) -> str:
    """A short account of a region's ops: ``12 ops: native_layer_norm, gelu, add, ...``."""
    names: list[str] = []
    for i in region.ops:
        n = getattr(prog.ops[i].target, "_opname", prog.ops[i].name)
        if n not in names:
            names.append(n)
    more = ", ..." if len(names) > limit else ""
    return f"{len(region.ops)} ops: {', '.join(names[:limit])}{more}"


@dataclass
class InductorCompiler:
    """Compiles regions with Inductor, one kernel per :func:`region_key` for this process.

    ``failures`` maps a key to why Inductor refused it (the region then stays ATen ops);
    ``seconds`` is the time spent compiling.
    """

    kernels: dict[str, FusedKernel] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    worker_seconds: float = 0.0  # spent waiting on compile workers (flowexec.compile_workers)
    worker_jobs: int = 0  # regions sent to them
    worker_jobs_here: int = 0  # cold regions this process compiled itself while they ran
    worker_failures: dict[str, str] = field(default_factory=dict)  # those they did not compile, why
    worker_sent: set[str] = field(default_factory=set)  # keys they compiled, to be found in the cache
    reshaped: set[str] = field(default_factory=set)  # keys whose kernel took its views as reshapes
    worker_misses: int = 0  # of those, compiled here again all the same (not found in the cache)
    # Kernels named so far (fused_0, fused_1, ...: a kernel is named where :meth:`compile` first
    # hands it out, so in the pass's order also where :meth:`prepare` made it ahead, in the
    # compile workers' queue order; a replaced one keeps counting).
    made: int = 0

    @contextlib.contextmanager
    def together(self, progress: Callable[[int, int], None] | None = None) -> Iterator[list[str]]:
        """Regions compiled inside compile their kernels side by side (:class:`_Batch`): each
        region's generated kernels go to Inductor's compile workers while the next region is
        generated, and the block's exit waits for them all (``progress(done, total)`` per
        region waited for), then runs the output checks :func:`compile_graph` put off. The
        list it yields gets, on exit, the keys of regions refused only then (a kernel that did
        not build, or returned other metas): their kernels are gone from :attr:`kernels` (or, where
        only the strides differed, replaced by one compiled for the program's:
        :meth:`with_forced_strides`), so a program fused inside must be fused again. While a block is open (an inner one, another
        thread's), a block compiles as it would without one; an interrupt during the end's waits
        drops every kernel of the block."""
        late: list[str] = []
        batch = _open_batch()
        if batch is None:
            yield late
            return
        try:
            try:
                yield late
            finally:
                _close_batch(batch)
            t0 = time.perf_counter()
            refused = batch.finish(progress)
        except BaseException:  # (an interrupt: no kernel of the block was surely waited for and checked)
            for key in batch.keys:
                self.kernels.pop(key, None)
            raise
        for key, why in refused.items():
            self.kernels.pop(key, None)
            self.failures[key] = why
        self.seconds += time.perf_counter() - t0
        for key in refused:  # (kept under its key: the pass, fusing again, takes the second kernel)
            if key in batch.sources:
                self.with_forced_strides(key, *batch.sources[key])
        batch.sources.clear()  # (a program holds its state: none kept past the block)
        late.extend(refused)

    def compile_graph_of(self, key: str, gm: fx.GraphModule, metas: Sequence[TensorMeta]) -> Callable[..., Any]:
        """Inductor's function for a region's graph ``gm`` under ``key``, as :meth:`compile`
        compiles it but with no output check and no kernel kept (a compile worker's: it only
        fills the cache); inside :meth:`together`, a kernel that fails to build names ``key``."""
        _batch_takes(key)
        try:
            return inductor_compile(gm, metas)
        except Exception as e:
            self.failures[key] = why_refused(e)
            raise

    def compile(self, prog: Program, region: Region, name: str | None = None) -> FusedKernel | str:
        """The kernel for ``region`` (compiled now, or shared with an equal region), or why
        Inductor refused it (inside :meth:`together`, the kernel is ready once its block ends);
        a kernel not yet named is named now (``name``, else the next ``fused_N``)."""
        got = self.prepare(prog, region)
        if isinstance(got, FusedKernel) and not got.named:
            got.rename(name or f"fused_{self.made}")
            self.made += 1
        return got

    def prepare(self, prog: Program, region: Region) -> FusedKernel | str:
        """:meth:`compile` without naming a kernel it makes (one compiled ahead of a pass)."""
        key = region_key(prog, region)
        hit = self.kernels.get(key)
        if hit is not None:
            return hit
        if key in self.failures:
            return self.failures[key]
        t0 = time.perf_counter()
        _batch_takes(key)
        hits = _cache_hits() if key in self.worker_sent else None
        batch = _batch_here()
        if batch is not None:  # (for a second try where the block's end refuses the kernel)
            batch.sources[key] = (prog, region)
        try:
            gm = region_graph(prog, region)
            compiled = compile_graph(gm, [prog.values[v].meta for v in region.inputs],
                                     [prog.values[v].meta for v in region.computed], key=key)
            if hits is not None and _cache_hits() == hits:
                self.worker_misses += 1
        except Exception as e:  # Inductor's refusal: keep the ATen ops, say why
            self.failures[key] = why_refused(e)
        finally:
            self.seconds += time.perf_counter() - t0
        if key in self.failures:  # (a second try counts its own seconds: outside the window above)
            return self.with_forced_strides(key, prog, region) or self.with_views_as_reshapes(key, prog, region) \
                or self.failures[key]
        kernel = self.kernels[key] = self._kernel(compiled, gm, prog, region, key)
        return kernel

    def _kernel(self, compiled: Callable[..., Any], gm: fx.GraphModule, prog: Program, region: Region,
                key: str) -> FusedKernel:
        return FusedKernel(None, compiled, gm, len(region.inputs), region.mutated, region.aliases,
                           summarize(prog, region), key)

    def with_forced_strides(self, key: str, prog: Program, region: Region) -> FusedKernel | None:
        """Where the kernel for ``key`` returned an output in other strides than the program's
        (Inductor may lay a concatenation of permuted tensors out in their order; later kernels
        are compiled for the program's strides), the region compiled again asking Inductor for
        the program's strides (:func:`recipe_of`), checked, and kept under ``key``; None where
        that is not the refusal, or the second kernel is refused too (the first refusal stands)."""
        if not self.failures.get(key, "").startswith(f"{OtherStrides.__name__}:") or _batch_here():
            return None  # (inside a block its check would be put off: the block's end tries it)
        reshaped = key in self.reshaped  # (the refused kernel took its views as reshapes: so does this one)
        recipe = recipe_of(prog, region, force_strides=True, views_as_reshapes=reshaped)
        if len(recipe.ops) == len(region.ops):  # (no output it may force: the same graph again)
            return None
        return self._compile_again(key, prog, region, recipe, "forced strides" + (", views as reshapes" if reshaped else ""))

    def with_views_as_reshapes(self, key: str, prog: Program, region: Region) -> FusedKernel | None:
        """Where Inductor refused the region for ``key``, the region compiled again with each
        ``aten.view`` a ``reshape`` and kept under ``key``; None where it has no view, writes
        anything in place, or the second kernel is refused too (the first refusal stands).
        Inductor lays a region's intermediates out as it chooses, and a view the program took of
        eager's layout may not exist in Inductor's (T5's attention: a transposed concatenation
        viewed to three dimensions); inside a region nothing else reads that memory, so a
        reshape, which is the view where one exists and a copy where not, computes the same.
        Only where nothing is written in place: a write through a copied view would miss its base."""
        if not any(op_name(prog.ops[i].target) == _VIEW for i in region.ops) or region.mutated \
                or any(a >= 0 for a in region.aliases) \
                or any(getattr(t, "_schema", None) is None or written_args(t) for t in (prog.ops[i].target for i in region.ops)):
            return None
        kernel = self._compile_again(key, prog, region, recipe_of(prog, region, views_as_reshapes=True), "views as reshapes")
        if kernel is not None:
            self.reshaped.add(key)
        return kernel

    def _compile_again(self, key: str, prog: Program, region: Region, recipe: GraphRecipe,
                       how: str) -> FusedKernel | None:
        """The refused region for ``key`` compiled from another ``recipe`` (checked under the key
        and ``how``) and kept under ``key`` in place of the refusal; None where it is refused too."""
        t0 = time.perf_counter()
        try:
            gm = graph_of(recipe)
            compiled = compile_graph(gm, [prog.values[v].meta for v in region.inputs],
                                     [prog.values[v].meta for v in region.computed], key=f"{key}\n{how}")
        except Exception:
            return None
        finally:
            self.seconds += time.perf_counter() - t0
        self.failures.pop(key, None)
        kernel = self.kernels[key] = self._kernel(compiled, gm, prog, region, key)
        return kernel


def compile_graph(gm: fx.GraphModule, metas: Sequence[TensorMeta], want: Sequence[TensorMeta] = (),
                  key: str | None = None) -> Callable[..., Any]:
    """Inductor's compiled function for a region's graph whose inputs have ``metas`` (its
    inference path: no autograd). With ``want`` (the metas the program expects of the returned
    values), the kernel runs once on example inputs and a result of another dtype, shape or
    stride is an error (a decomposition can compute in another dtype than the ATen kernel: CPU
    batch norm's saved statistics under bf16 autocast came back in bf16, not float32). The
    floating inputs of one dtype, shape and stride share one zero-filled example: the check reads only
    the outputs' metadata, and a region over a whole optimizer's parameters, gradients and
    moments would otherwise hold a second copy of them all (a fake capture's first call, where
    no activation is yet alive, then peaked above eager's first step on that copy). With
    ``key`` (the region's :func:`region_key`) a passed check is kept beside Inductor's cache
    (:func:`output_check_key`), so a warm build neither allocates examples nor runs kernels."""
    kept = output_checks() if key is not None else None
    batch = _batch_here()
    check = output_check_key(key, [*metas, *want], batch.config_text() if batch is not None else None) \
        if kept is not None else None
    passed = check is not None and bool(kept.get(check))  # type: ignore[union-attr]
    # (a region whose check passed loads its entry by the key its first compile kept, without
    # compile_fx hashing the graph again: flowexec.inductor_entries)
    entry = entry_name(check) if check is not None else None
    aot_key = kept_entries().get(entry) if passed and entry is not None else None
    compiled = None
    if aot_key:
        _keep_process_keys_for(metas)  # (as a compile would)
        compiled = load_entry(aot_key)
    loaded = compiled is not None
    if not loaded:
        compiled, aot_key = compile_noting_key(lambda: inductor_compile(gm, metas))

    def keep_entry() -> None:
        if aot_key and entry is not None:
            kept_entries().put(entry, aot_key)
    if passed and not loaded:  # (checked before, compiled now: its entry is named from now on)
        keep_entry()

    def keep_passed() -> None:
        kept.put(check, True)  # type: ignore[union-attr]
        keep_entry()
    if (want or kept is not None) and not passed:
        def check_outputs() -> None:
            if not want:  # (nothing to check: kept as built, so that a warm build knows it is)
                keep_passed()
                return
            # (floating inputs alike share one example: see above. An integer one is an index
            # where the region gathers, and a shared one that the region writes first would
            # make another's indices out of bounds: a device-side assert on CUDA)
            alike = [(m.dtype, m.shape, m.stride, m.device) if m.dtype.is_floating_point else k
                     for k, m in enumerate(metas)]
            examples: dict[Any, torch.Tensor] = {}
            for same, m in zip(alike, metas):
                if same not in examples:
                    examples[same] = _example(m)
            with torch.no_grad(), _quiet():
                outs = compiled(*[examples[same] for same in alike])
            # (a computed output is a new tensor: an input's memory handed back as one, which
            # Inductor does where it drops a copy as a no-op, would let later writes to either
            # reach the other)
            inputs = {e.untyped_storage().data_ptr() for e in examples.values() if e.numel()}
            for k, o in enumerate(outs):
                if isinstance(o, torch.Tensor) and o.numel() and o.untyped_storage().data_ptr() in inputs:
                    raise TypeError(f"output {k} came back in the memory of an input, the program expects a new tensor")
            for k, (o, m) in enumerate(zip(outs, want)):
                got = (o.dtype, tuple(o.shape), tuple(o.stride()) if m.stride is not None and o.numel() > 1 else None)
                expect = (m.dtype, m.shape, m.stride if m.stride is not None and o.numel() > 1 else None)
                if got != expect:
                    error = OtherStrides if got[:2] == expect[:2] else TypeError
                    raise error(f"output {k} came back as {got[0]} {list(got[1])} stride {got[2]}, the program "
                                f"expects {expect[0]} {list(expect[1])} stride {expect[2]}")
            if kept is not None:
                keep_passed()
        if batch is not None:
            batch.checks.append((batch.key, check_outputs))  # (its kernels are not built yet)
        else:
            check_outputs()
    return compiled


class OtherStrides(TypeError):
    """A kernel returned an output of the program's dtype and shape in other strides."""


def _cache_hits() -> tuple[int, int]:
    """Inductor's AOT and FX graph cache hits so far in this process."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"], counters["inductor"]["fxgraph_cache_hit"]


def _keep_process_keys_for(metas: Sequence[TensorMeta]) -> None:
    """What Inductor computes once a process, from a disk on which it does not change, kept
    (:func:`~flowexec.inductor_keys.keep_process_keys`; the CPU's probe where a region runs there)."""
    keep_process_keys(cpu=any(torch.device(m.device).type == "cpu" for m in metas))


def inductor_compile(gm: fx.GraphModule, metas: Sequence[TensorMeta]) -> Callable[..., Any]:
    """Inductor's compiled function for ``gm`` on inputs of ``metas`` (what :func:`compile_graph`
    and a compile worker, :mod:`flowexec.compile_workers`, both call: their cache keys agree)."""
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # A tracing context of its own: inside the torch.compile backend, Dynamo's context is
    # active, and Inductor would record this region's output strides there as the strides of
    # the graph AOTAutograd is compiling (its backward then reads them). Its fake mode has a
    # shape environment, without which Inductor bypasses its FX graph cache (every build would
    # generate every kernel again); the inputs are made with static sizes, so the kernels are
    # specialised to the region's sizes.
    fake = FakeTensorMode(shape_env=ShapeEnv())
    inputs = [fake_tensor(m, fake) for m in metas]
    _keep_process_keys_for(metas)
    with torch.no_grad(), _quiet(), torch._guards.tracing(torch._guards.TracingContext(fake)):
        return compile_fx(gm, inputs)


@dataclass
class _Batch:
    """The regions compiled in one :meth:`InductorCompiler.together` block. Inductor's module
    for a region submits its kernels to the compile workers, then waits for them
    (``AsyncCompile.wait(globals())``) before the next region is even generated: one region's
    kernels at a time, while torch.compile's one graph has all of its kernels compiling at once.
    In a block that wait is kept here (``waits``: region key, compiler, the module's globals,
    whose futures the wait replaces by kernels) and done at the block's end; so are the output
    checks, which run the kernels (``checks``), and the writes of the regions' entries in
    Inductor's FX graph cache (``saves``): Inductor bundles into an entry the Triton kernels that
    resolved while the region compiled (``TritonBundler``: their binaries, and the statically
    launchable ones ready to launch), and a kernel whose wait is put off resolves only after
    that; an entry written at once would hold none of them, and a warm build would then load
    each of those kernels one by one (~0.1 s each on CUDA). At the block's end each region's
    waits run inside a bundle of their own, which joins the entry before it is written."""

    thread: int
    wait: Callable[[Any, dict[str, Any]], None]  # AsyncCompile.wait as it was
    key: str = ""  # the region being compiled
    keys: list[str] = field(default_factory=list)
    waits: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)
    checks: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    # (key -> the program and region compiled under it: for a second try where the end refuses
    # the kernel only on its strides; cleared there, since a program holds its state)
    sources: dict[str, tuple[Program, Region]] = field(default_factory=dict)
    # (region key, FxGraphCache._save_graph's arguments with the graph as it was then, and the
    # tracing context whose shape environment the write reads)
    saves: list[tuple[str, tuple[Any, ...], Any]] = field(default_factory=list)
    save: Callable[..., None] | None = None  # FxGraphCache._save_graph as it was
    _config_text: str | None = None

    def config_text(self) -> str:
        """:func:`inductor_config_text`, read once per block (~10 ms a read; a warm GPT-2 build keys
        a few dozen regions, and nothing changes Inductor's configuration inside a fusion pass)."""
        if self._config_text is None:
            self._config_text = inductor_config_text()
        return self._config_text

    def put_off(self, compiler: Any, scope: dict[str, Any]) -> None:
        """``AsyncCompile.wait`` while the block is open: this thread's kept, another's done."""
        if threading.get_ident() == self.thread:
            self.waits.append((self.key, compiler, scope))
        else:
            self.wait(compiler, scope)

    def put_off_save(self, key: str, compiled: Any, *rest: Any) -> None:
        """``FxGraphCache._save_graph`` while the block is open: this thread's kept (with a
        shallow copy of the graph, as the write itself takes one), another's done."""
        assert self.save is not None  # (set with the hook that calls this)
        if threading.get_ident() != self.thread:
            self.save(key, compiled, *rest)
            return
        self.saves.append((self.key, (key, _copy_to_save(compiled), *rest), torch._guards.TracingContext.try_get()))

    def finish(self, progress: Callable[[int, int], None] | None) -> dict[str, str]:
        """Every wait put off (each region's inside a Triton bundle of its own), every cache
        entry put off (with that bundle), then every output check: the regions refused, with why."""
        refused: dict[str, str] = {}
        waits: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
        for key, compiler, scope in self.waits:
            waits.setdefault(key, []).append((compiler, scope))
        saves: dict[str, list[tuple[tuple[Any, ...], Any]]] = {}
        for key, args, context in self.saves:
            saves.setdefault(key, []).append((args, context))
        done = 0
        for key in dict.fromkeys([*waits, *saves]):
            bundle = None
            with _bundling(key in saves) as bundled:
                for compiler, scope in waits.get(key, ()):
                    try:
                        self.wait(compiler, scope)
                    except Exception as e:
                        refused.setdefault(key, why_refused(e))
                    done += 1
                    if progress is not None:
                        progress(done, len(self.waits))
                bundle = bundled()
            if key not in refused:  # (as Inductor writes no entry for a kernel that did not build)
                for args, context in saves.get(key, ()):
                    _save_with(self.save, args, context, bundle)
        self.saves.clear()
        for key, check in self.checks:
            if key not in refused:
                try:
                    check()
                except Exception as e:
                    refused[key] = why_refused(e)
        return refused


_batch: _Batch | None = None  # the open block (one at a time: a fusion pass runs on one thread)
_batch_lock = threading.Lock()


def _open_batch() -> _Batch | None:
    """A new block with ``AsyncCompile.wait`` routed through it, or None where one is open (an
    inner block's or another thread's regions then compile as without one)."""
    global _batch
    from torch._inductor.async_compile import AsyncCompile

    with _batch_lock:
        if _batch is not None:
            return None
        batch = _batch = _Batch(threading.get_ident(), AsyncCompile.wait)
        # (a function, which binds the compiler as a method does; a bound method would not)
        AsyncCompile.wait = lambda compiler, scope: batch.put_off(compiler, scope)  # type: ignore[method-assign]
        cache = _fx_graph_cache()
        if cache is not None:
            batch.save = cache._save_graph
            cache._save_graph = staticmethod(batch.put_off_save)
        return batch


def _close_batch(batch: _Batch) -> None:
    global _batch
    from torch._inductor.async_compile import AsyncCompile

    with _batch_lock:
        AsyncCompile.wait = batch.wait  # type: ignore[method-assign]
        cache = _fx_graph_cache()
        if cache is not None and batch.save is not None:
            cache._save_graph = staticmethod(batch.save)
        _batch = None


def _fx_graph_cache() -> Any:
    """Inductor's FX graph cache class, where it writes entries as :class:`_Batch` expects
    (``_save_graph(key, compiled_graph, example_inputs, local, remote_cache)``, torch 2.11 to
    2.13); None elsewhere (its entries are then written at once, without the kernels put off)."""
    import inspect

    from torch._inductor.codecache import FxGraphCache

    try:
        inspect.signature(FxGraphCache._save_graph).bind("key", "graph", [], True, None)
    except (AttributeError, TypeError, ValueError):
        return None
    return FxGraphCache


@contextlib.contextmanager
def _bundling(on: bool) -> Iterator[Callable[[], Any]]:
    """Inside, the Triton kernels that resolve are noted by Inductor's ``TritonBundler``; the
    function it yields collects them (a ``TritonBundle``, or None where bundling is off, not
    ``on``, or a bundle is already open: Inductor's is one per process)."""
    from torch._inductor.triton_bundler import TritonBundler

    if not on or not TritonBundler.is_enabled() or TritonBundler._entries is not None:
        yield lambda: None
        return
    TritonBundler.begin_compile()
    try:
        yield lambda: TritonBundler.collect()[0]
    finally:
        TritonBundler.end_compile()


def _copy_to_save(compiled: Any) -> Any:
    """A shallow copy of Inductor's compiled graph for a put-off cache write, without its module's
    ``runner`` (the write drops it too: ``prepare_for_serialization``). A copy that shared it
    would delete the runner's ``partitions`` a second time when both are collected, and
    ``CompiledFxGraph.__del__`` (torch 2.11, 2.13) prints an ``AttributeError`` traceback at
    every cold region's end."""
    out = copy.copy(compiled)
    if getattr(out, "compiled_fn_runner", None) is not None:
        out.compiled_fn_runner = None
    return out


def _save_with(save: Callable[..., None] | None, args: tuple[Any, ...], context: Any, bundle: Any) -> None:
    """Inductor's cache write ``save(*args)`` in the tracing ``context`` it was asked for in,
    with the kernels of ``bundle`` joined to those the graph bundled itself."""
    if save is None:
        return
    compiled = args[1]
    if bundle is not None and (bundle.kernel_artifacts or bundle.static_autotuners):
        own = getattr(compiled, "_triton_bundle", None)
        if own is not None:
            bundle = type(bundle)(own.kernel_artifacts + bundle.kernel_artifacts,
                                  own.static_autotuners + bundle.static_autotuners)
        compiled.set_triton_bundle(bundle)
    with torch._guards.tracing(context) if context is not None else contextlib.nullcontext():
        save(*args)


def _batch_here() -> _Batch | None:
    """The open block, where it is this thread's."""
    batch = _batch
    return batch if batch is not None and batch.thread == threading.get_ident() else None


def _batch_takes(key: str) -> None:
    """The region ``key`` is the one this thread's open block (if any) now compiles: its kernels'
    waits and checks are put off under ``key``, which a failure at the block's end then names."""
    batch = _batch_here()
    if batch is not None:
        batch.key = key
        batch.keys.append(key)


def why_refused(e: BaseException) -> str:
    """An exception as a one-line reason a region was refused."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def output_checks() -> VerdictCache:
    """Regions whose compiled outputs were seen to match the program's metas, and regions that
    return nothing whose kernels were built (in the current Inductor cache directory): those a
    build in this directory loads rather than compiles (:func:`flowexec.compile_workers.cold_jobs`)."""
    return shared_cache("region_output_checks")


# The output check's own version: raised whenever what it checks changes, so that a verdict an
# older check kept is not taken for this one's (f9b1442 added the test that no output comes back
# in an input's memory; a cache filled before it kept such kernels as passed: T5 on the CPU
# fused 5 regions more on a cache filled before it than on a fresh one, each a kernel now refused).
OUTPUT_CHECK_VERSION = 2


def output_check_key(key: str, metas: Sequence[TensorMeta], config_text: str | None = None) -> str:
    """What decides whether a region's kernel returns what the program expects: the region
    (:func:`region_key`), its input and output ``metas``, torch's and CUDA's versions, the
    devices it runs on (a CUDA device by name and capability, which Inductor generates for),
    Inductor's configuration (``config_text``: :func:`inductor_config_text`,
    read once by a caller that keys many regions) and the check's own version
    (:data:`OUTPUT_CHECK_VERSION`), hashed to a short key."""
    devices = sorted({torch.device(m.device) for m in metas}, key=str)
    names = [f"{torch.cuda.get_device_name(d)} {torch.cuda.get_device_capability(d)}" if d.type == "cuda" else str(d)
             for d in devices]
    conf = config_text if config_text is not None else inductor_config_text()
    text = "\n".join([f"check {OUTPUT_CHECK_VERSION}; torch {torch.__version__} cuda {torch.version.cuda} on {names}",
                      conf, key,
                      ";".join(f"{m.dtype}{list(m.shape)}{list(m.stride or ())}" for m in metas)])
    return hashlib.sha256(text.encode()).hexdigest()


def inductor_config_text() -> str:
    """Inductor's configuration as :func:`output_check_key` reads it (its portable settings)."""
    from torch._inductor import config

    return repr(sorted(config.save_config_portable().items()))


@contextlib.contextmanager
def _quiet() -> Any:
    """Inductor warns about things that are not the user's concern here (e.g. a graph that
    returns no output); the failures that matter come back as exceptions."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield

