"""The exception hierarchy shared by every layer."""
from __future__ import annotations


class IRError(Exception):
    """Base class of every error this project raises about a program."""


class IRTypeError(IRError, TypeError):
    """A malformed type or attribute."""


class IRVerifyError(IRError):
    """The verifier found a malformed graph; the message shows the ops around the fault."""


class IRParseError(IRError, ValueError):
    """The text form could not be parsed; the message names the line and column."""


class ImportError_(IRError):
    """A JAX program could not be imported into the IR."""


class ShardingConstraintError(IRError, ValueError):
    """A sharding constraint inside a replicated step that splits a value over devices:
    the step runs per replica, so a layout over the devices of every replica has no
    meaning there (the message names the user's line, the value and the layout)."""
