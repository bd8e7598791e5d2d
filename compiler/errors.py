"""Errors raised by passes and lowering."""
from __future__ import annotations

from ir.errors import IRError


class PassError(IRError):
    """A pass failed; the message names the pass and the passes that ran before it."""


class LoweringError(IRError):
    """The IR could not be lowered to a JAX-traceable function."""


class ShardingError(PassError, ValueError):
    """A sharding is invalid for the replica's logical devices or for the value's shape.

    A ``ValueError`` too: it is the user's input that is wrong. The pass manager keeps
    this type when it adds which passes ran."""


class DivergentCollectiveError(PassError, ValueError):
    """A collective would run inside control flow whose predicate or trip count differs
    between replicas (some replicas would never join it). A ``ValueError``: the user's
    program must move the collective."""
