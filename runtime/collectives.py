"""Collectives and replica context, called inside a replicated step function."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from compiler.trace import CURRENT_NUM_REPLICAS
from ir import _jax_compat as jc
from ir.jaxpr_import import REPLICA_AXIS
from runtime.validate import user_line

_OPS = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def _require_step(fn: str) -> int:
    n = CURRENT_NUM_REPLICAS.get()
    if n is None:
        raise RuntimeError(f"{fn}() can only be called inside a function run by replicate()")
    return n


def replica_id() -> Any:
    """The id of the replica running this code, an int32 scalar in ``[0, num_replicas)``."""
    _require_step("replica_id")
    return lax.axis_index(REPLICA_AXIS)


def num_replicas() -> int:
    """The number of replicas the step runs on (a Python int)."""
    return _require_step("num_replicas")


def _extremum(reduce: Any) -> Any:
    """A differentiable ``pmax`` / ``pmin`` (JAX has no derivative rule for either): the
    tangent is the one of the replica holding the extremum, shared equally among ties
    (as ``jnp.max``'s derivative shares it among equal elements)."""
    @jax.custom_jvp
    def f(x):
        return reduce(x, REPLICA_AXIS)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        y = reduce(x, REPLICA_AXIS)
        hit = x == y
        ties = lax.psum(hit.astype(t.dtype), REPLICA_AXIS)
        return y, lax.psum(jax.numpy.where(hit, t, jax.numpy.zeros_like(t)), REPLICA_AXIS) / ties
    return f


_OPS["max"], _OPS["min"] = _extremum(lax.pmax), _extremum(lax.pmin)


def all_reduce(x: Any, op: str = "sum") -> Any:
    """Reduce ``x`` (a pytree) across replicas with ``op`` in sum | mean | max | min.
    Every op is differentiable (the derivative of ``max``/``min`` goes to the replica
    holding the extremum, split equally among ties)."""
    _require_step("all_reduce")
    if op not in _OPS:
        raise ValueError(f"all_reduce: op must be one of {sorted(_OPS)}, got {op!r} "
                         f"({user_line(__file__)})")
    if op in ("max", "min"):
        return jax.tree.map(lambda a: _OPS[op](a) if jax.numpy.issubdtype(
            jax.numpy.result_type(a), jax.numpy.inexact) else
            (lax.pmax if op == "max" else lax.pmin)(a, REPLICA_AXIS), x)
    return _OPS[op](x, REPLICA_AXIS)


def all_gather(x: Any, axis: int = 0) -> Any:
    """Concatenate every replica's ``x`` along ``axis`` (the result is the same everywhere)."""
    _require_step("all_gather")
    for leaf in jax.tree.leaves(x):
        rank = len(np.shape(leaf))
        if not -rank <= axis < rank:
            raise ValueError(f"all_gather: axis {axis} is out of range for a value of shape "
                             f"{tuple(np.shape(leaf))} (rank {rank}); to gather scalars, "
                             f"reshape them to shape (1,) first ({user_line(__file__)})")
    return lax.all_gather(x, REPLICA_AXIS, axis=axis, tiled=True)


def all_to_all(x: Any, split_axis: int, concat_axis: int) -> Any:
    """Split ``x`` along ``split_axis`` into N chunks, send chunk i to replica i, and
    concatenate the received chunks along ``concat_axis`` (negative axes count from the
    end)."""
    n = _require_step("all_to_all")
    rank = len(np.shape(x))
    for name, ax in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if not isinstance(ax, (int, np.integer)) or isinstance(ax, bool) or not -rank <= ax < rank:
            raise ValueError(f"all_to_all: {name} {ax!r} is out of range for a value of shape "
                             f"{tuple(np.shape(x))} (rank {rank}) ({user_line(__file__)})")
    split_axis, concat_axis = int(split_axis) % rank, int(concat_axis) % rank
    if x.shape[split_axis] % n:
        raise ValueError(f"all_to_all: split_axis {split_axis} has size {x.shape[split_axis]}, "
                         f"not divisible by {n} replicas ({user_line(__file__)})")
    return lax.all_to_all(x, REPLICA_AXIS, split_axis, concat_axis, tiled=True)


def local(tree: Any) -> Any:
    """A per-replica view of ``tree`` (a pytree of arrays, usually mirrored parameters):
    the same values, typed as varying per replica, so that gradients taken *with respect
    to the view* are each replica's own: neither all-reduced across replicas nor scaled
    by the loss reduction. Values computed from the view and per-replica data are
    per-replica as usual. Gradients with respect to the mirrored values themselves are
    unchanged (all-reduced as usual), also when they flow through a view.

    Use it where the algorithm wants local gradients: per-example gradients for DP-SGD
    (``jax.vmap(jax.grad(loss), (None, 0))(rt.local(params), batch)``, then clip, sum and
    ``rt.all_reduce`` yourself), or a per-replica inner loop (MAML with one task per
    replica: ``inner = sgd(rt.local(params), support)``)."""
    _require_step("local")

    for x in jax.tree.leaves(tree):
        if not hasattr(x, "dtype") and not isinstance(x, (bool, int, float, complex)):
            raise TypeError(f"local: leaves must be arrays or numbers, got {type(x).__name__} "
                            f"({user_line(__file__)})")
    return jax.tree.map(lambda x: jc.to_varying(jax.numpy.asarray(x), REPLICA_AXIS), tree)
