"""Lowering an ExecutionPlan into a runner, and the reference interpreter loop.

Trace mode lowers the plan once into straight-line Python: one line per instruction that
calls the op's pre-bound C++ entry point (``OpOverload._op``) on local slots, and a ``del`` of
every value the plan frees after it. The hot path is thus a fixed sequence of calls with no
per-step lookups, dispatch on instruction kind or recomputation; the loop interpreter
(:class:`Interpreter`) walks the same instructions one by one with hooks, for checks and
tooling. Both name the failing op and the user's line on error.

Example::

    >>> import torch
    >>> from flowexec.capture import capture
    >>> from flowexec.plan import build_plan
    >>> plan = build_plan(capture(lambda x: x.sin() + 1, (torch.zeros(2),)).program)
    >>> run = lower_trace(plan)
    >>> run(torch.zeros(2))
    [tensor([1., 1.])]
"""
from __future__ import annotations

import itertools
import linecache
import math
import os
import weakref
from typing import Any, Callable

import torch

from ..errors import ExecutionError
from ..plan import ExecutionPlan
from ..program import Program, Ref, format_op, op_name
from . import streams as cuda_streams
from .arena import bind_arenas, out_call
from .seeds import with_seeds_for_capture

_counter = itertools.count()


# Ops whose kernel reads grad mode, not only its arguments: the CPU LSTM's ``mkldnn_rnn_layer``
# makes the workspace its backward reads only where grad mode is on, as it is in eager's forward.
# A program runs with grad mode off (it holds its backward already), so these run with it on,
# over detached arguments: no autograd graph is built.
GRAD_MODE_OPS = frozenset({"aten.mkldnn_rnn_layer.default"})


def callable_of(target: Callable[..., Any], op: Any = None) -> Callable[..., Any]:
    """The cheapest entry point of an op: the C++ overload behind an ``OpOverload`` (with grad
    mode on for :data:`GRAD_MODE_OPS`, and an attention backward's dropout seeds where its
    kernel reads them: ``seeds.py``, unless ``op``, the program's record, drops nothing)."""
    fn = getattr(target, "_op", target)
    if str(target) in GRAD_MODE_OPS:
        return _with_grad_mode(fn)
    return with_seeds_for_capture(target, fn, op)


def _with_grad_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        with torch.enable_grad():
            return fn(*args, **kwargs)
    return call


def _slot(vid: int) -> str:
    return f"v{vid}"


class _Renderer:
    """Turns op arguments into Python source, parking non-literal constants in globals."""

    def __init__(self, prog: Program, glb: dict[str, Any]) -> None:
        self.prog, self.glb = prog, glb

    def const(self, obj: Any) -> str:
        name = f"k{len(self.glb)}"
        self.glb[name] = obj
        return name

    def __call__(self, a: Any) -> str:
        if isinstance(a, Ref):
            if a.id in self.prog.state:
                return f"s{a.id}"
            if a.id in self.prog.consts:
                return f"c{a.id}"
            return _slot(a.id)
        if isinstance(a, list):
            return "[" + ", ".join(self(x) for x in a) + "]"
        if isinstance(a, tuple):
            return "(" + "".join(self(x) + ", " for x in a) + ")"
        if a is None or isinstance(a, (bool, int, str)):
            return repr(a)
        if isinstance(a, float) and math.isfinite(a):
            return repr(a)
        return self.const(a)


def explain_failure(plan: ExecutionPlan, index: int, exc: BaseException) -> ExecutionError:
    """The error raised when instruction ``index`` fails: names the op and its source line."""
    op = plan.instructions[index].op
    src = f" (issued at {op.source})" if op.source else ""
    return ExecutionError(
        f"While executing op #{index} {format_op(op, plan.program)}{src}: {type(exc).__name__}: {exc}"
    )


def _plan_source(src: str, name: str) -> str:
    """The file name a plan's generated ``src`` is compiled under, its lines known to
    ``linecache`` (a traceback through a plan shows the op's line). With ``FLOWEXEC_PLAN_DIR``
    set, the source is also written there as ``<name>-<pid>.py`` and compiled under that path,
    so that what prints only a file and a line (``faulthandler`` on a crash) names a line one
    can read."""
    directory = os.environ.get("FLOWEXEC_PLAN_DIR")
    filename = f"<{name}>"
    if directory:
        try:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(os.path.abspath(directory), f"{name}-{os.getpid()}.py")
            with open(path, "w") as fh:
                fh.write(src)
            filename = path
        except OSError:
            pass  # (an unwritable directory: the plan still runs, its lines in linecache alone)
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    return filename


def lower_trace(plan: ExecutionPlan, extra_globals: dict[str, Any] | None = None,
                streams: Any = None, clock: list[int] | None = None,
                hooks: dict[int, Callable[[], None]] | None = None) -> Callable[..., list[Any]]:
    """Generate the straight-line runner for ``plan``: ``run(*inputs) -> list of flat outputs``.

    A plan over several streams (``plan.n_streams > 1``) also switches streams, records and
    waits on its events and marks cross-stream frees, through ``streams`` (by default
    :class:`~flowexec.runtime.streams.CudaStreams` on the plan's device): see ``runtime/streams.py``.
    ``clock`` (a list of ``len(plan.instructions) + 1`` ints; profiling only) makes the runner
    write ``time.perf_counter_ns()`` into it on entry and after each instruction and its frees.
    ``hooks`` maps an instruction's position to a call made just before it, on its stream
    (position ``len(plan.instructions)``: before the runner returns); graph mode writes fed
    hyperparameters there (``runtime/feed_node.py``).
    """
    prog = plan.program
    glb: dict[str, Any] = {"__builtins__": __builtins__}
    glb.update({f"s{vid}": t for vid, t in prog.state.items()})
    glb.update({f"c{vid}": c for vid, c in prog.consts.items()})
    if extra_globals:
        glb.update(extra_globals)
    render = _Renderer(prog, glb)
    params = ", ".join(_slot(i) for i in prog.inputs)
    lines = [f"def run({params}):"]
    line_to_op: dict[int, int] = {}
    if clock is not None:
        import time

        glb.update({"_now": time.perf_counter_ns, "_T": clock})
        lines.append("    _T[0] = _now()")
    async_gc = plan.gc == "async"
    if async_gc:
        from .gc import collector, handed_frees

        glb["_gc"] = collector().bounded(plan.gc_backlog_bytes)
        handed = handed_frees(plan)
    outs = bind_arenas(plan.memory, prog, glb)  # memory="planned": planned ops write into arena views
    multi = plan.n_streams > 1
    if multi:
        if streams is None:  # looked up on the module at each lowering: tests stand a recorder in
            streams = cuda_streams.CudaStreams(plan.n_streams, plan.n_events, cuda_streams.device_of(plan))
        glb.update({"_cur": streams.current, "_set": streams.set, "_fork": streams.fork, "_join": streams.join,
                    "_rs": streams.record_stream})
        glb.update({f"S{k}": streams.side[k] for k in range(1, plan.n_streams)})
        glb.update({f"E{e}": ev for e, ev in enumerate(streams.events)})
        lines += ["    _s0 = _cur()", "    _fork(_s0)"]
    on = 0  # the stream the generated code has made current

    def call_hook(pos: int) -> None:
        if hooks and pos in hooks:
            glb[f"_hook{pos}"] = hooks[pos]
            lines.append(f"    _hook{pos}()")

    def stream_name(k: int) -> str:
        return "_s0" if k == 0 else f"S{k}"

    for pos, ins in enumerate(plan.instructions):
        op = ins.op
        if multi:
            if ins.stream != on:
                lines.append(f"    _set({stream_name(ins.stream)})")
                on = ins.stream
            lines += [f"    {stream_name(on)}.wait_event(E{e})" for e in ins.waits]
        call_hook(pos)
        fname = f"f{op.index}"
        target, out_arg = out_call(op, outs)
        glb[fname] = callable_of(target, op)
        args = [render(a) for a in op.args] + [f"{k}={render(v)}" for k, v in op.kwargs]
        if out_arg:
            args.append(out_arg)
        call = f"{fname}({', '.join(args)})"
        if op.unpack:
            names = [_slot(o) if o >= 0 else "_" for o in op.outputs]
            lhs = (", ".join(names) + ("," if len(names) == 1 else "")) if names else "_"
            stmt = f"{lhs} = {call}" if any(o >= 0 for o in op.outputs) else call
        elif op.outputs and op.outputs[0] >= 0:
            stmt = f"{_slot(op.outputs[0])} = {call}"
        else:
            stmt = call
        lines.append(f"    {stmt}  # {op_name(op.target)}")  # (the op a crash's file and line point at)
        line_to_op[len(lines)] = op.index
        if multi:
            lines += [f"    E{e}.record({stream_name(on)})" for e in ins.records]
            lines += [f"    _rs({_slot(v)}, {stream_name(k)})" for v, ks in ins.stream_uses for k in ks]
        if ins.frees:
            names = ", ".join(_slot(v) for v in ins.frees)
            if async_gc and handed[pos][0]:  # the worker drops the last references (runtime/gc.py)
                lines.append(f"    _gc(({''.join(_slot(v) + ', ' for v in handed[pos][0])}), {handed[pos][1]})")
            lines.append("    del " + names)
        if clock is not None:
            lines.append(f"    _T[{pos + 1}] = _now()")
    call_hook(len(plan.instructions))
    if multi:
        if on != 0:
            lines.append("    _set(_s0)")
        lines.append("    _join(_s0)")
        lines += [f"    _rs({_slot(v)}, _s0)" for v in plan.side_outputs]
        lines += [f"    _rs({_slot(v)}, {stream_name(k)})" for v, ks in plan.exit_uses for k in ks]
    lines.append("    return [" + ", ".join(render(o) for o in prog.outputs) + "]")
    src = "\n".join(lines) + "\n"
    filename = _plan_source(src, f"flowexec-plan-{next(_counter)}")
    exec(compile(src, filename, "exec"), glb)
    inner = glb["run"]
    weakref.finalize(inner, linecache.cache.pop, filename, None)  # (its lines live as long as the plan)

    set_grad = torch._C._set_grad_enabled
    is_grad = torch.is_grad_enabled

    def run(*args: Any) -> list[Any]:
        # The program already holds its backward ops: running it must not build an autograd graph.
        prev = is_grad()
        set_grad(False)
        token = streams.begin() if multi else None
        try:
            return inner(*args)
        except Exception as e:
            if multi:  # order the caller's stream after what the side streams were given so far
                streams.abort(token)
            tb = e.__traceback__
            line = None
            while tb is not None:
                if tb.tb_frame.f_code.co_filename == filename:
                    line = tb.tb_lineno
                tb = tb.tb_next
            if line is None or line not in line_to_op:
                raise
            raise explain_failure(plan, line_to_op[line], e) from e
        finally:
            set_grad(prev)
            if multi:  # the caller's device and stream, also where an op failed on a side stream
                streams.end(token)

    run.source = src  # type: ignore[attr-defined]
    run.inner = inner  # type: ignore[attr-defined]
    return run


class Interpreter:
    """The reference loop: runs instructions one by one over a slot table, with a hook.

    Slower than the lowered trace runner; used for checks (e.g. that no more intermediates
    are alive than the plan says) and as the base of tooling. It runs every instruction on the
    current stream, whatever stream the plan gave it (the reference order).
    """

    def __init__(self, plan: ExecutionPlan) -> None:
        self.plan = plan
        self._fns = [callable_of(i.op.target, i.op) for i in plan.instructions]

    def _resolve(self, a: Any, env: list[Any]) -> Any:
        if isinstance(a, Ref):
            return env[a.id]
        if isinstance(a, list):
            return [self._resolve(x, env) for x in a]
        if isinstance(a, tuple):
            return tuple(self._resolve(x, env) for x in a)
        return a

    def run(self, *args: Any, on_step: Callable[[int, list[Any]], None] | None = None) -> list[Any]:
        prog = self.plan.program
        env: list[Any] = [None] * len(prog.values)
        for vid, a in zip(prog.inputs, args):
            env[vid] = a
        for vid, t in prog.state.items():
            env[vid] = t
        for vid, c in prog.consts.items():
            env[vid] = c
        with torch.no_grad():
            self._loop(env, on_step)
        return [self._resolve(o, env) for o in prog.outputs]

    def _loop(self, env: list[Any], on_step: Callable[[int, list[Any]], None] | None) -> None:
        for i, ins in enumerate(self.plan.instructions):
            op = ins.op
            try:
                out = self._fns[i](*self._resolve(op.args, env), **{k: self._resolve(v, env) for k, v in op.kwargs})
            except Exception as e:
                raise explain_failure(self.plan, i, e) from e
            if op.unpack:
                for vid, o in zip(op.outputs, out):
                    if vid >= 0:
                        env[vid] = o
            elif op.outputs and op.outputs[0] >= 0:
                env[op.outputs[0]] = out
            for vid in ins.frees:
                env[vid] = None
            if on_step is not None:
                on_step(i, env)
