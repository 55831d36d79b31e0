"""Optimizer hyperparameters as program inputs: an LR schedule re-captures nothing.

A torch optimizer reads ``lr``, ``betas``, ``momentum``, ``weight_decay``, ``eps`` ... from
its ``param_groups`` as Python floats, which a captured program would bake in. During capture,
an optimizer step pre-hook (:func:`torch.optim.optimizer.register_optimizer_step_pre_hook`)
puts in their place 0-dim tensors made outside the tracing modes — ``make_fx`` records them as
constants, which flowexec binds as state by reference, like parameters — and turns on the code
path that takes them (``capturable=True``; ``foreach=True`` where the user left it to torch);
the post-hook puts the floats back. Before each call :class:`Feeds` copies the groups' current
values into those tensors: one small host→device copy of a packed buffer per device, only when
a value changed; a CUDA graph reads the tensors in place, so a replay sees the new values.

Some code paths read a hyperparameter on the host (``if weight_decay != 0``, an ``alpha=``
argument that must be a number). Such a read is answered with the value and recorded as a
:class:`HostRead`: the expression it computed is evaluated again whenever a value it depends
on changes, and a different answer re-captures — a guard, not a silent constant. Where an op
takes a number only because of its overload (``_foreach_lerp_(a, b, weight)``), the read is
avoided by rewriting the call into ops that take a tensor (:data:`REWRITES`), so the value stays
an input. Step counts that torch keeps on the CPU for CUDA parameters are moved to the
parameters' device, as ``capturable=True`` keeps them: a CUDA graph cannot count on the host.

    >>> import torch
    >>> cpu = torch.device("cpu")
    >>> feeds = Feeds.build([FeedSlot("opt.param_groups[0]['lr']", {"lr": 0.1}, "lr", -1, 0)],
    ...                     {cpu: torch.tensor([0.1], dtype=torch.float64)})
    >>> feeds.slots[0].group["lr"] = 0.05  # a scheduler's step
    >>> feeds.refresh(), feeds.buffers[cpu]  # what the program reads now
    (-1, tensor([0.0500], dtype=torch.float64))
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

# The dtype of lifted hyperparameters: float64, as eager's Python floats are (``1 - beta2`` with
# beta2 = 0.999 rounded to float32 first is off by 1.3e-5); where a value meets a tensor list the
# rewrites cast it to that list's dtype, which CUDA's foreach kernels need for their fast path.
SCALAR_DTYPE = torch.float64
_HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)
NO_VALUE = object()


# --- expressions over lifted values (to evaluate a host read again) ------------------------

@dataclass(frozen=True)
class Slot:
    index: int


@dataclass(frozen=True)
class Const:
    value: Any


@dataclass(frozen=True)
class Call:
    func: Any
    args: tuple
    kwargs: tuple


def _is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(t, torch.Tensor) and is_fake(t)


def evaluate(expr: Any, values: Sequence[float], memo: dict[int, Any] | None = None) -> Any:
    """``expr`` computed again on CPU tensors, with ``values[k]`` for ``Slot(k)``."""
    memo = {} if memo is None else memo
    key = id(expr)
    if key in memo:
        return memo[key]
    if isinstance(expr, Slot):
        out: Any = torch.tensor(values[expr.index], dtype=SCALAR_DTYPE)
    elif isinstance(expr, Const):
        out = expr.value.clone() if isinstance(expr.value, torch.Tensor) else expr.value
    elif isinstance(expr, Call):
        sub = lambda a: evaluate(a, values, memo) if isinstance(a, (Slot, Const, Call)) else a  # noqa: E731
        args = pytree.tree_map(sub, expr.args, is_leaf=lambda a: isinstance(a, (Slot, Const, Call)))
        kwargs = dict(pytree.tree_map(sub, dict(expr.kwargs), is_leaf=lambda a: isinstance(a, (Slot, Const, Call))))
        kwargs = {k: (torch.device("cpu") if k == "device" and v is not None else v) for k, v in kwargs.items()}
        out = expr.func(*args, **kwargs)
    else:
        out = expr
    memo[key] = out
    return out


def slots_of(expr: Any) -> frozenset[int]:
    if isinstance(expr, Slot):
        return frozenset((expr.index,))
    if isinstance(expr, Call):
        leaves = pytree.tree_leaves((expr.args, dict(expr.kwargs)), is_leaf=lambda a: isinstance(a, (Slot, Const, Call)))
        return frozenset().union(*(slots_of(a) for a in leaves if isinstance(a, Call | Slot)))
    return frozenset()


@dataclass(frozen=True)
class HostRead:
    """A value torch.optim read on the host from lifted hyperparameters (``if weight_decay
    != 0``): ``expr`` must still give ``value``; ``where`` is the torch line that read it."""

    expr: Any
    value: Any
    where: str
    slots: frozenset[int]


# --- the per-call side -----------------------------------------------------------------------

@dataclass
class FeedSlot:
    """One lifted value: ``group[key]`` (``group[key][index]`` for a tuple such as betas) of an
    optimizer's param group, at ``position`` in its device's packed buffer; ``last``: the value
    the buffer holds."""

    name: str
    group: dict[str, Any]
    key: str
    index: int
    position: int
    device: torch.device = torch.device("cpu")
    last: Any = None
    captured: Any = None  # the value at capture (what a host read of it answered)

    def current(self) -> Any:
        v = self.group.get(self.key, NO_VALUE)
        if self.index >= 0 and v is not NO_VALUE:
            try:
                v = v[self.index]
            except (TypeError, IndexError):
                return NO_VALUE
        return v


class PinnedRing:
    """Pinned host copies of a packed buffer, used in turn: :meth:`fill` writes the values into
    the next one (first waiting for the event recorded after its last copy, if that copy is still
    queued, RING uses ago), :meth:`passed` records that event once its copy is launched."""

    def __init__(self, copies: Sequence[torch.Tensor]) -> None:
        self.copies = list(copies)
        self.events: list[Any] = [None] * len(self.copies)
        self.turn = 0

    def fill(self, host: torch.Tensor) -> torch.Tensor:
        k = self.turn
        if self.events[k] is not None:
            self.events[k].synchronize()
        self.copies[k].copy_(host)
        return self.copies[k]

    def passed(self) -> None:
        """The copy out of the copy :meth:`fill` gave is launched on the current stream: record
        when it has passed, and move on to the next copy."""
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.turn] = ev
        self.turn = (self.turn + 1) % len(self.copies)


@dataclass
class Feeds:
    """The lifted hyperparameters of one program: per device a packed buffer (the program reads
    0-dim views of it), a host copy written in place, and the host reads that depend on them."""

    slots: tuple[FeedSlot, ...]
    buffers: dict[torch.device, torch.Tensor]  # what the program reads (views of these)
    hosts: dict[torch.device, Any]  # numpy views of the host copies (the CPU buffer itself on CPU)
    host_tensors: dict[torch.device, torch.Tensor]
    reads: tuple[HostRead, ...] = ()
    # slot index -> the host reads that depend on it
    dependents: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # host reads that answer otherwise for the values now in the buffers -> a slot they read
    failing: dict[int, int] = field(default_factory=dict)
    # Per device buffer off the CPU: pinned copies the upload goes through, in turn, each reused
    # once the event recorded after its last copy has passed. (A copy from pageable memory may
    # wait for the stream: the host would stall on every step whose lr changed.)
    staging: dict[torch.device, list[torch.Tensor]] = field(default_factory=dict)
    _rings: dict[torch.device, PinnedRing] = field(default_factory=dict)
    # Per device buffer that its graph writes itself (runtime/feed_node.py): the upload hands
    # the values to the graph's kernel node instead of copying them before the next replay;
    # ``uploaders`` is what the C++ check calls for it instead of copying itself.
    writers: dict[torch.device, Any] = field(default_factory=dict)
    uploaders: dict[torch.device, list[Callable[[], None]]] = field(default_factory=dict)

    RING = 4

    @staticmethod
    def build(slots: Sequence[FeedSlot], buffers: dict[torch.device, torch.Tensor],
              reads: Sequence[HostRead] = ()) -> Feeds:
        host_tensors = {d: b if b.device.type == "cpu" else b.cpu() for d, b in buffers.items()}
        hosts = {d: t.numpy() for d, t in host_tensors.items()}
        for s in slots:
            if s.last is None:
                s.last = s.current()
            if s.captured is None:
                s.captured = s.last
        dependents: dict[int, list[int]] = {}
        for k, r in enumerate(reads):
            for i in r.slots:
                dependents.setdefault(i, []).append(k)
        staging = {d: [torch.empty_like(h).pin_memory() for _ in range(Feeds.RING)]
                   for d, h in host_tensors.items() if buffers[d] is not h and d.type == "cuda"}
        return Feeds(tuple(slots), dict(buffers), hosts, host_tensors, tuple(reads),
                     {i: tuple(v) for i, v in dependents.items()}, staging=staging)

    def upload(self, d: torch.device) -> None:
        """The host copy of device ``d``'s values into the buffer the program reads (stream-ordered
        before the call that follows)."""
        buf, host = self.buffers[d], self.host_tensors[d]
        if buf is host:
            return
        writer = self.writers.get(d)
        if writer is not None:
            writer.upload(host)
            return
        ring = self.ring(d)
        if ring is None:
            buf.copy_(host)
            return
        buf.copy_(ring.fill(host), non_blocking=True)
        ring.passed()

    def ring(self, d: torch.device) -> PinnedRing | None:
        """Device ``d``'s pinned staging copies, in turn (None where it has none: the CPU)."""
        if d not in self._rings and self.staging.get(d):
            self._rings[d] = PinnedRing(self.staging[d])
        return self._rings.get(d)

    def attach_writer(self, d: torch.device, writer: Any) -> None:
        """Device ``d``'s values are written by the program itself from now on: a change goes to
        ``writer.upload(host)`` (runtime/feed_node.py: a kernel node of the graph)."""
        torch.cuda.synchronize(d)  # the copies launched before are done, their staging copies free
        self.writers[d] = writer
        calls = self.uploaders.setdefault(d, [])
        if not calls:  # (by weak reference: the C++ check holds the list, which must not hold these feeds)
            ref = weakref.ref(self)
            calls.append(lambda: (f := ref()) is not None and f.upload(d))

    def refresh(self) -> int:
        """Copy changed values in; -1 when the program fits them, else the index of a slot whose
        change it cannot take (not a number any more, or a host read now answers otherwise).
        A value is compared with its host copy (the C++ check does the same, so either path
        leaves the buffers as the other expects)."""
        dirty: set[torch.device] = set()
        recheck: set[int] = set()
        was: list[tuple[FeedSlot, Any, Any]] = []
        bad = -1
        for i, s in enumerate(self.slots):
            v = s.current()
            if type(v) not in (float, int):
                bad = i if bad < 0 else bad
                continue
            host = self.hosts[s.device]
            if host[s.position] == v:
                continue
            was.append((s, host[s.position], s.last))
            host[s.position] = v
            s.last = v
            dirty.add(s.device)
            recheck.update(self.dependents.get(i, ()))
        try:
            for d in dirty:  # the buffers always hold the host values, whatever the verdict
                self.upload(d)
        except BaseException:
            # An upload that did not happen (Ctrl-C while it waited for a staging copy) must not
            # leave the host copy saying it did: the next call would see no change and the
            # program would keep the old values. Take the change back; that call uploads it.
            for s, old, last in was:
                self.hosts[s.device][s.position] = old
                s.last = last
            raise
        if recheck:
            values = [float(self.hosts[s.device][s.position]) for s in self.slots]
            for k in recheck:
                r = self.reads[k]
                if _answer(r.expr, values) != r.value:
                    self.failing[k] = min(r.slots)
                else:
                    self.failing.pop(k, None)
        if bad >= 0:
            return bad
        return min(self.failing.values()) if self.failing else -1

    def reads_hold(self) -> bool:
        """Whether every host read answers for the values in the buffers as it did at capture
        (a program kept on disk, fed this process's values: :mod:`flowexec.kept`)."""
        values = [float(self.hosts[s.device][s.position]) for s in self.slots]
        return all(_answer(r.expr, values) == r.value for r in self.reads)

    def native_spec(self) -> tuple[list[tuple], list[torch.Tensor], list[torch.Tensor], list[tuple],
                                   list[list[torch.Tensor]], list[list[Callable[[], None]]]]:
        """What the C++ check (``csrc/guards.cpp``) takes: per slot (group, key, index, device,
        position, whether a host read it cannot evaluate depends on it); the host copies,
        buffers and pinned staging copies per device; the host reads of the form ``value <op>
        constant`` it evaluates; per device the list whose call uploads instead of the C++ copy
        (empty until the program writes the values itself: :meth:`attach_writer`)."""
        devices = list(self.buffers)
        simple: dict[int, tuple] = {}
        for k, r in enumerate(self.reads):
            p = _predicate(r)
            if p is not None:
                simple[k] = p
        feeds = []
        for i, s in enumerate(self.slots):
            other = any(k not in simple for k in self.dependents.get(i, ()))
            feeds.append((s.group, s.key, s.index, devices.index(s.device), s.position, other))
        return (feeds, [self.host_tensors[d] for d in devices], [self.buffers[d] for d in devices],
                list(simple.values()), [self.staging.get(d, []) for d in devices],
                [self.uploaders.setdefault(d, []) for d in devices])

    def fused_group(self, i: int) -> dict[str, Any] | None:
        """The param group of slot ``i`` where a fused kernel reads it on the host (it takes the
        value as a number: the program holds a constant), else None."""
        s = self.slots[i]
        return s.group if s.group.get("fused") and self.dependents.get(i) else None

    def describe(self, i: int) -> str:
        s = self.slots[i]
        v = s.current()
        why = [r.where for r in self.reads if i in r.slots]
        if why:
            return (f"{s.name}: {s.captured!r} -> {v!r} (torch.optim reads it on the host at {why[0]}, so the "
                    "program holds it as a constant; with foreach=True the optimizer takes it as a tensor, where "
                    "its code path allows)")
        return f"{s.name}: {s.captured!r} -> {v!r} (no longer a Python number, which is what the program is fed)"


_COMPARISONS = {"ne": 0, "eq": 1, "gt": 2, "ge": 3, "lt": 4, "le": 5}


def _predicate(r: HostRead) -> tuple[int, int, float, bool] | None:
    """``(slot, op, constant, answer)`` for a host read of ``slot <op> constant`` (``if
    weight_decay != 0``), which the C++ check evaluates itself; None for any other."""
    e = r.expr
    if not (isinstance(e, Call) and e.func in _HOST_READS and len(e.args) == 1 and isinstance(e.args[0], Call)):
        return None
    cmp = e.args[0]
    name = getattr(cmp.func, "_opname", None)
    if name not in _COMPARISONS or getattr(cmp.func, "_overloadname", "") != "Scalar" or len(cmp.args) != 2:
        return None
    slot, const = cmp.args
    if not isinstance(slot, Slot) or type(const) not in (int, float) or not isinstance(r.value, bool):
        return None
    return (slot.index, _COMPARISONS[name], float(const), r.value)


def _answer(expr: Any, values: Sequence[Any]) -> Any:
    out = evaluate(expr, values)
    return out.item() if isinstance(out, torch.Tensor) else out


# --- the capture side --------------------------------------------------------------------------

@dataclass
class _Lift:
    """One optimizer group key lifted during capture."""

    slot: FeedSlot
    tensor: torch.Tensor


class Lifter:
    """Capture-time state: which optimizers stepped, the tensors lifted for their groups, and
    the provenance of every tensor computed only from those (to recognise host reads)."""

    def __init__(self, names: Callable[[Any, str], str], active: bool = True,
                 unfused: frozenset[int] = frozenset()) -> None:
        self._name = names
        self.active = active  # False: no hooks, nothing lifted
        # ids of param groups whose fused kernel met a schedule of a value it takes as a number
        # (betas, eps, weight_decay): they step through the foreach path, which takes it fed
        self.unfused = unfused
        self.optimizers: list[torch.optim.Optimizer] = []
        self._swapped: dict[int, list[tuple[dict, dict[str, Any]]]] = {}  # id(opt) -> (group, original values)
        self._lifts: dict[tuple[int, int, str, int], _Lift] = {}
        self._prov: dict[int, tuple[weakref.ref, Any]] = {}
        self.reads: list[HostRead] = []
        self.state_snapshots: dict[int, tuple[torch.optim.Optimizer, dict[Any, Any]]] = {}
        self._buffers: dict[torch.device, list[float]] = {}
        self._made: dict[torch.device, torch.Tensor] = {}
        self._handles: list[Any] = []
        # (a fake capture's: the real twin of a fake tensor made from constants, or None)
        self.real_of: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: None

    # hooks
    def __enter__(self) -> Lifter:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if not self.active:
            return self
        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.restore()

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with _disable_current_modes():
            if id(opt) not in self.state_snapshots:
                self.optimizers.append(opt)
                # which parameters had state before fn's first step (a discarded capture puts this back)
                self.state_snapshots[id(opt)] = (opt, {p: dict(s) for p, s in opt.state.items()})
            self._swap_in(opt)

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._swap_out(opt)

    def lifted_keys(self, opt: torch.optim.Optimizer) -> set[tuple[int, str]]:
        """The (group index, key) pairs of ``opt`` fed as tensors."""
        return {(gi, key) for (o, gi, key, _) in self._lifts if o == id(opt)}

    def restore_state(self) -> None:
        """Drop the optimizer state the run created (a discarded capture: the eager call that
        follows creates it afresh, as a first step does)."""
        for opt, before in self.state_snapshots.values():
            for p in [p for p in opt.state if p not in before]:
                del opt.state[p]
            for p, entries in before.items():
                opt.state[p].clear()
                opt.state[p].update(entries)

    def _swap_in(self, opt: torch.optim.Optimizer) -> None:
        # Each group's originals are recorded before it changes (an error midway is undone too).
        saved = self._swapped.setdefault(id(opt), [])
        label = self._name(opt, type(opt).__name__)
        for gi, group in enumerate(opt.param_groups):
            original: dict[str, Any] = {}
            saved.append((group, original))
            params = group["params"]
            device = params[0].device if params else torch.device("cpu")
            for key, default in opt.defaults.items():
                v = group.get(key)
                if _liftable(v):
                    original[key] = v
                    group[key] = self._lifted(opt, gi, key, -1, v, f"{label}.param_groups[{gi}][{key!r}]", device)
                elif type(v) is tuple and v and all(_liftable(e) for e in v):
                    original[key] = v
                    group[key] = tuple(self._lifted(opt, gi, key, i, e, f"{label}.param_groups[{gi}][{key!r}][{i}]",
                                                    device) for i, e in enumerate(v))
            if "capturable" in group and not group.get("differentiable"):
                original["capturable"] = group["capturable"]
                group["capturable"] = True
            if id(group) in self.unfused and group.get("fused"):
                original["fused"], original["foreach"] = group["fused"], group.get("foreach")
                group["fused"], group["foreach"] = False, True
            if "foreach" in group and group["foreach"] is None and not group.get("fused") \
                    and not group.get("differentiable"):
                original["foreach"] = None
                group["foreach"] = True
            if group.get("capturable"):
                _steps_to_device(opt, params)

    def _swap_out(self, opt: torch.optim.Optimizer) -> None:
        for group, original in reversed(self._swapped.pop(id(opt), [])):
            group.update(original)

    def restore(self) -> None:
        """Put every swapped group back (also after a step that raised), last swapped first: a
        wrapper that shares its inner optimizer's groups is swapped twice."""
        for key in reversed(list(self._swapped)):
            for group, original in reversed(self._swapped.pop(key)):
                group.update(original)

    def _lifted(self, opt: Any, gi: int, key: str, index: int, value: Any, name: str, device: torch.device) -> torch.Tensor:
        k = (id(opt), gi, key, index)
        hit = self._lifts.get(k)
        if hit is not None:
            return hit.tensor
        buf = self._buffers.setdefault(device, [])
        buf.append(float(value))
        slot = FeedSlot(name, opt.param_groups[gi], key, index, len(buf) - 1, device, value)
        # The buffer is made once per device, when the first lifted value is used (_materialise):
        # until then each value is a tensor of its own, remade as a view of the packed buffer.
        t = torch.tensor(float(value), dtype=SCALAR_DTYPE, device=device)
        self._lifts[k] = _Lift(slot, t)
        self._prov[id(t)] = (weakref.ref(t), Slot(len(self._lifts) - 1))
        return t

    # provenance and host reads (called by capture's dispatch mode)
    def lifted(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        hit = self._prov.get(id(t))
        return hit is not None and hit[0]() is t

    def slot_of(self, t: Any) -> int | None:
        """The index of the lifted value ``t`` is (in the order lifted), or None."""
        if not self.lifted(t):
            return None
        e = self._expr(t)
        return e.index if isinstance(e, Slot) else None

    def _expr(self, t: torch.Tensor) -> Any:
        return self._prov[id(t)][1]

    def host_read(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The answer to a host read of a value computed only from lifted tensors (recorded),
        or ``NO_VALUE`` for any other (capture then fails on it as data-dependent)."""
        if not self._prov or not (func in _HOST_READS or torch.Tag.data_dependent_output in func.tags):
            return NO_VALUE
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not tensors or not all(self.lifted(t) for t in tensors):
            return NO_VALUE
        expr = Call(func, self._template(args), tuple(self._template(kwargs).items()))
        if any(_is_fake(t) for t in tensors):  # (a fake capture: computed again from the lifted numbers)
            value = evaluate(expr, [self._buffers[lift.slot.device][lift.slot.position] for lift in self._lifts.values()])
        else:
            with _disable_current_modes():
                value = func(*args, **kwargs)
        self.reads.append(HostRead(expr, value, _torch_line(), frozenset()))
        return value

    def propagate(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Outputs of an op whose tensor inputs all come from lifted values (or are made from
        constants) come from them too."""
        if not self._prov:
            return
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors:
            if not all(self.lifted(t) for t in tensors):
                return
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not outs or any(o.numel() != 1 for o in outs):
            return
        if not tensors:
            for o in outs:
                real = self.real_of(o) if _is_fake(o) else o  # (a fake capture's: its real twin)
                if real is None:
                    continue
                with _disable_current_modes():
                    self._prov[id(o)] = (weakref.ref(o), Const(real.detach().clone()))
            return
        expr = Call(func, self._template(args), tuple(self._template(kwargs).items()))
        multi = isinstance(out, (list, tuple))
        for i, o in enumerate(outs):
            e = Call(_pick, (expr, i), ()) if multi else expr
            self._prov[id(o)] = (weakref.ref(o), e)

    def _template(self, tree: Any) -> Any:
        return pytree.tree_map(lambda a: self._expr(a) if self.lifted(a) else a, tree)

    # after the run
    def feeds(self, state: Sequence[torch.Tensor]) -> tuple[Feeds | None, dict[int, torch.Tensor]]:
        """The feeds of the values the program reads or that a host read depends on, and the
        tensors to re-bind: ``{id(capture-time tensor): view of the packed buffer}``."""
        lifts = list(self._lifts.values())
        if not lifts:
            return None, {}
        in_state = {id(t) for t in state}
        unique: dict[tuple, HostRead] = {}  # one guard per line, answer and values it read
        for r in self.reads:
            h = HostRead(r.expr, r.value, r.where, slots_of(r.expr))
            unique.setdefault((h.where, repr(h.value), h.slots), h)
        reads = list(unique.values())
        wanted = {i for i, l in enumerate(lifts) if id(l.tensor) in in_state} | {i for r in reads for i in r.slots}
        if not wanted:
            return None, {}
        order = sorted(wanted)
        renumber = {old: new for new, old in enumerate(order)}
        per_device: dict[torch.device, list[int]] = {}
        slots = []
        for new, old in enumerate(order):
            s = lifts[old].slot
            pos = per_device.setdefault(s.device, [])
            slots.append(FeedSlot(s.name, s.group, s.key, s.index, len(pos), s.device, s.last))
            pos.append(new)
        with _disable_current_modes():
            buffers = {d: torch.tensor([float(slots[i].last) for i in idx], dtype=SCALAR_DTYPE, device=d)
                       for d, idx in per_device.items()}
            rebind = {id(lifts[old].tensor): buffers[slots[new].device][slots[new].position]
                      for new, old in enumerate(order) if id(lifts[old].tensor) in in_state}
        reads = [HostRead(_renumber(r.expr, renumber), r.value, r.where, frozenset(renumber[i] for i in r.slots))
                 for r in reads]
        return Feeds.build(slots, buffers, reads), rebind

    def rewrite_mode(self) -> Any:
        """The mode that rewrites calls given lifted values (:data:`REWRITES`)."""
        return _RewriteMode(self) if self.active else contextlib.nullcontext()


def _pick(seq: Any, i: int) -> Any:
    return seq[i]


def _renumber(expr: Any, renumber: dict[int, int]) -> Any:
    if isinstance(expr, Slot):
        return Slot(renumber[expr.index])
    if isinstance(expr, Call):
        f = lambda a: _renumber(a, renumber)  # noqa: E731
        leaf = lambda a: isinstance(a, (Slot, Const, Call))  # noqa: E731
        return Call(expr.func, pytree.tree_map(f, expr.args, is_leaf=leaf),
                    tuple((k, pytree.tree_map(f, v, is_leaf=leaf)) for k, v in expr.kwargs))
    return expr


def _liftable(v: Any) -> bool:
    return type(v) in (float, int)


def _steps_to_device(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
    """0-dim CPU state (step counts) of parameters on another device, moved there: capturable
    code reads it on the device, and a CUDA graph cannot count on the host."""
    for p in params:
        st = opt.state.get(p)
        if not st or p.device.type == "cpu":
            continue
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device.type == "cpu":
                st[k] = v.to(p.device)


def _torch_line() -> str:
    import traceback

    frames = [f for f in traceback.extract_stack() if "/torch/optim/" in f.filename or "/torch/amp/" in f.filename]
    if not frames:
        return "<unknown>"
    f = frames[-1]
    return f"{f.filename.rsplit('/torch/', 1)[-1]}:{f.lineno} ({(f.line or '').strip()})"


# --- rewrites: numbers an overload insists on, taken as tensors --------------------------------

def _foreach(name: str) -> Any:
    return getattr(torch, name, None)


def _like(t: torch.Tensor, tensors: Any) -> torch.Tensor:
    """The lifted scalar ``t`` in the dtype of the tensors it meets (the first of a list)."""
    first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
    if isinstance(first, torch.Tensor) and first.dtype != t.dtype and first.dtype.is_floating_point:
        return t.to(first.dtype)
    return t


def _rule_binary(name: str) -> Callable[..., Any]:
    """``_foreach_add_(xs, t)`` picks the Scalar overload for a 0-dim tensor; call ``.Tensor``."""
    packet = getattr(torch.ops.aten, name, None)
    op = getattr(packet, "Tensor", None) if packet is not None else None

    def rule(lifted: Callable[[Any], bool], args: tuple, kwargs: dict) -> Any:
        if op is None or len(args) != 2 or kwargs or not lifted(args[1]) or not isinstance(args[0], (list, tuple)):
            return NotImplemented
        return op(list(args[0]), _like(args[1], args[0]))
    return rule


def _rule_scaled(name: str, param: str, position: int) -> Callable[..., Any]:
    """A number that scales the second list, as a tensor: ``_foreach_add_(xs, ys, alpha=t)`` →
    ``_foreach_add_(xs, ys * t)``; ``_foreach_addcmul_(xs, a, b, value=t)`` →
    ``_foreach_addcmul_(xs, a * t, b)`` (``param`` at ``position``; addcdiv too)."""
    fn = _foreach(name)

    def rule(lifted: Callable[[Any], bool], args: tuple, kwargs: dict) -> Any:
        scale = kwargs.get(param, args[position] if len(args) > position else None)
        if not lifted(scale) or len(args) < position or not isinstance(args[1], (list, tuple)):
            return NotImplemented
        new = list(args[:position])
        new[1] = torch._foreach_mul(list(args[1]), _like(scale, args[1]))
        return fn(*new)
    return rule


def _rule_lerp(inplace: bool) -> Callable[..., Any]:
    """``_foreach_lerp_(xs, ys, w)`` → ``xs += (ys - xs) * w`` (lerp's own formula for w < 0.5)."""
    def rule(lifted: Callable[[Any], bool], args: tuple, kwargs: dict) -> Any:
        w = kwargs.get("weight", args[2] if len(args) > 2 else None)
        if not lifted(w):
            return NotImplemented
        xs, ys = list(args[0]), list(args[1])
        step = torch._foreach_mul(torch._foreach_sub(ys, xs), _like(w, xs))
        if inplace:
            torch._foreach_add_(xs, step)
            return None
        return torch._foreach_add(xs, step)
    return rule


def _rule_pow(lifted: Callable[[Any], bool], args: tuple, kwargs: dict) -> Any:
    """``_foreach_pow(b, steps)`` with a lifted base → ``_foreach_pow([b] * n, steps)``;
    ``_foreach_pow(xs, e)`` with a lifted exponent → ``_foreach_pow(xs, [e] * n)``."""
    if kwargs or len(args) != 2:
        return NotImplemented
    base, exp = args
    if lifted(base) and isinstance(exp, (list, tuple)):
        return torch._foreach_pow([_like(base, exp)] * len(exp), list(exp))
    if lifted(exp) and isinstance(base, (list, tuple)):
        return torch._foreach_pow(list(base), [_like(exp, base)] * len(base))
    return NotImplemented


def _rule_method(kind: str, inplace: bool) -> Callable[..., Any]:
    """``x.add_(y, alpha=t)`` → ``x.add_(y * t)``; ``x.addcmul_(a, b, value=t)`` → ``x.addcmul_(a * t, b)``."""
    def rule(lifted: Callable[[Any], bool], args: tuple, kwargs: dict) -> Any:
        if kind in ("add", "sub"):
            alpha = kwargs.get("alpha", args[2] if len(args) > 2 else None)
            if not lifted(alpha) or len(args) < 2:
                return NotImplemented
            other = args[1] * alpha
            op = getattr(torch.Tensor, kind + ("_" if inplace else ""))
            return op(args[0], other)
        value = kwargs.get("value", args[3] if len(args) > 3 else None)
        if not lifted(value) or len(args) < 3:
            return NotImplemented
        op = getattr(torch.Tensor, kind + ("_" if inplace else ""))
        return op(args[0], args[1] * value, args[2])
    return rule


def _rule_fused(fn: Any) -> Callable[..., Any]:
    """The fused optimizer kernels (``_fused_adamw_(..., lr=t)``) read a tensor lr as float32, the
    dtype torch's own tensor lrs have: a lifted lr is handed over in it."""
    def rule(lifted: Callable[[Any], bool], args: tuple, kwargs: dict) -> Any:
        lr = kwargs.get("lr")
        if not lifted(lr) or lr.dtype == torch.float32:
            return NotImplemented
        return fn(*args, **{**kwargs, "lr": lr.to(torch.float32)})
    return rule


def _rewrites() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {}
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
        if _foreach(name) is not None:
            table[_foreach(name)] = _rule_fused(_foreach(name))
    for base in ("add", "sub", "mul", "div"):
        for suffix in ("", "_"):
            name = f"_foreach_{base}{suffix}"
            fn = _foreach(name)
            if fn is None:
                continue
            binary = _rule_binary(name)
            alpha = _rule_scaled(name, "alpha", 2) if base in ("add", "sub") else None

            def rule(lifted: Callable[[Any], bool], args: tuple, kwargs: dict, binary=binary, alpha=alpha) -> Any:
                if alpha is not None and isinstance(args[1] if len(args) > 1 else None, (list, tuple)):
                    return alpha(lifted, args, kwargs)
                return binary(lifted, args, kwargs)
            table[fn] = rule
    for name in ("_foreach_addcmul", "_foreach_addcmul_", "_foreach_addcdiv", "_foreach_addcdiv_"):
        if _foreach(name) is not None:
            table[_foreach(name)] = _rule_scaled(name, "value", 3)
    for name, inplace in (("_foreach_lerp", False), ("_foreach_lerp_", True)):
        if _foreach(name) is not None:
            table[_foreach(name)] = _rule_lerp(inplace)
    if _foreach("_foreach_pow") is not None:
        table[torch._foreach_pow] = _rule_pow
    for kind in ("add", "sub", "addcmul", "addcdiv"):
        for inplace in (False, True):
            method = getattr(torch.Tensor, kind + ("_" if inplace else ""))
            table[method] = _rule_method(kind, inplace)
        if hasattr(torch, kind):
            table[getattr(torch, kind)] = _rule_method(kind, False)
    return table


REWRITES = _rewrites()


class _RewriteMode(TorchFunctionMode):
    """During capture: calls in :data:`REWRITES` given a lifted value where their overload wants
    a number are rewritten into ops that take it as a tensor; every other call passes through."""

    def __init__(self, lifter: Lifter) -> None:
        super().__init__()
        self.lifter = lifter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rule = REWRITES.get(func)
        if rule is not None and self.lifter._prov:
            out = rule(self.lifter.lifted, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)
