"""The errors flowexec raises. Each names what was wrong and, where known, the user's line."""
from __future__ import annotations


class FlowexecError(RuntimeError):
    """Base class of flowexec's errors."""


class CaptureError(FlowexecError):
    """fn could not be captured into a static program (raised by ``flowexec.compile``)."""


class InputError(FlowexecError, TypeError):
    """A call's arguments do not match what the executable was compiled for."""


class GuardError(FlowexecError):
    """A value the compiled function reads changed, and no new capture can follow it (the
    cache is full: it changes on every call); the message names the value."""


class OptionError(FlowexecError, ValueError):
    """An unknown option or an option value that cannot work here."""


class ExecutionError(FlowexecError):
    """An op failed while running; the message names the op and its source line."""


class RecaptureWarning(UserWarning):
    """A call with a new input signature, or a changed value the capture read (a module's
    ``training`` flag, say: ``model.encoder.training: True -> False``), made flowexec capture fn
    (or a pipeline stage) again."""


def whole_number(name: str, value: object, least: int) -> int:
    """``value`` checked to be a whole number of at least ``least`` (an ``OptionError`` naming
    ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise OptionError(f"{name}={value!r} must be a whole number of at least {least}")
    return value


def count_option(opts: dict, name: str, default: int, least: int) -> int:
    """``opts[name]`` (or ``default``) checked by :func:`whole_number`."""
    return whole_number(name, opts.get(name, default), least)
