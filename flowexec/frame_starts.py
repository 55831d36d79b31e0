"""The frames a capture starts, delivered to its :class:`~flowexec.guards.Recorder` through
``sys.monitoring`` (Python 3.12+).

The recorder must see the first frame of every code object that runs while ``fn`` is traced
(to scan its global and closure reads) and every frame of a code whose first argument it
guards. A trace function (``sys.settrace``, in Python or in C) sees each of the millions of
frames a training step starts; on Python 3.12 it also switches every code object onto CPython's
instrumented path (line and jump events included) while it is set: 60% of a GPT-2 124M step's
fake capture (4.3 s against 1.7 s on a 2-core CPU, C tracer). ``sys.monitoring``'s ``PY_START``
event instead reaches :func:`_on_start` once per code object: a code the recorder has done with
is disabled (``sys.monitoring.DISABLE``) and its later frames cost nothing.

Library code (torch's, the standard library's, flowexec's) is never scanned: its event is
disabled at its first frame, on any thread. The event is process-wide where a trace function is
per-thread: the user's frames of another thread reach the callback too and are passed over, and
a user's code is disabled only while recorders run on one thread alone (each new or ending
recorder restarts the disabled events, so that none misses a code another disabled).

    >>> import sys
    >>> from flowexec import frame_starts
    >>> frame_starts.available() == (sys.version_info >= (3, 12))
    True
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable

_TOOL_NAME = "flowexec capture"
# thread id -> the recorders started on it, innermost last (only the innermost records, as a
# trace function set by an inner capture stands in for the outer's until it ends)
_RECORDERS: dict[int, list[Any]] = {}
_TOOL: list[int] = []  # the sys.monitoring tool id held while any recorder runs
_user_file: Any = None  # guards.user_code (cached per file), set by start(): this module sits below guards


def available() -> bool:
    """Whether this Python has ``sys.monitoring`` and a tool id is free for flowexec."""
    mon = getattr(sys, "monitoring", None)
    return mon is not None and (bool(_TOOL) or _free_tool(mon) is not None)


def _free_tool(mon: Any) -> int | None:
    # 3 and 4 have no name in PEP 669 (0-2 and 5 are the debugger's, coverage's, profilers' and
    # the optimizer's); any free id will do.
    for tool in (3, 4, 0, 1, 2, 5):
        if mon.get_tool(tool) is None:
            return tool
    return None


def start(recorder: Any, user_file: Callable[[str], bool]) -> None:
    """Deliver the frames this thread starts to ``recorder`` (``_new_code(frame)`` for a code
    it has not seen, ``_object_code(frame)`` for one in its ``_per_object``) until :func:`stop`;
    ``user_file(name)``: whether code in that file is the user's (other code is never scanned,
    and its event is disabled at its first frame)."""
    global _user_file
    _user_file = user_file
    mon = sys.monitoring
    if not _TOOL:
        tool = _free_tool(mon)
        if tool is None:
            raise RuntimeError("no sys.monitoring tool id is free")
        mon.use_tool_id(tool, _TOOL_NAME)
        mon.register_callback(tool, mon.events.PY_START, _on_start)
        mon.set_events(tool, mon.events.PY_START)
        _TOOL.append(tool)
    _RECORDERS.setdefault(threading.get_ident(), []).append(recorder)
    mon.restart_events()  # (codes disabled while another recorder ran are new to this one)


def stop(recorder: Any) -> None:
    """The end of :func:`start` for ``recorder``; the tool id is given back after the last one."""
    mon = sys.monitoring
    tid = threading.get_ident()
    stack = _RECORDERS.get(tid, [])
    if recorder in stack:
        stack.remove(recorder)
    if not stack:
        _RECORDERS.pop(tid, None)
    if _RECORDERS:
        mon.restart_events()  # (an outer recorder has not seen what the inner one disabled)
    elif _TOOL:
        tool = _TOOL.pop()
        mon.set_events(tool, 0)
        mon.register_callback(tool, mon.events.PY_START, None)
        mon.free_tool_id(tool)


def _on_start(code: Any, offset: int) -> Any:
    if not _user_file(code.co_filename):  # no recorder scans library code, on any thread (the autograd engine's device threads run
        return sys.monitoring.DISABLE  # the backward's fake and proxy kernels): done with for good
    stack = _RECORDERS.get(threading.get_ident())
    alone = len(_RECORDERS) == 1
    if not stack:  # another thread's frame: a code done with for the one recorder is so for good
        if alone:
            rec = next(iter(_RECORDERS.values()))[-1]
            if code in rec._seen_code and code not in rec._per_object:
                return sys.monitoring.DISABLE
        return None
    rec = stack[-1]
    if code in rec._seen_code:
        if code in rec._per_object:
            rec._object_code(sys._getframe(1))
            return None
    else:
        rec._new_code(sys._getframe(1))  # (a callback starts no events: its own frames are not fn's)
        if code in rec._per_object:
            return None
    return sys.monitoring.DISABLE if alone else None
