"""Collectives and replica context, called inside a replicated step function."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from compiler.trace import CURRENT_NUM_REPLICAS, current_axis
from ir import _jax_compat as jc
from runtime.divergence import note_local_view
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
    return lax.axis_index(current_axis())


def num_replicas() -> int:
    """The number of replicas the step runs on (a Python int)."""
    return _require_step("num_replicas")


def _extremum(reduce: Any) -> Any:
    """A differentiable ``pmax`` / ``pmin`` (JAX has no derivative rule for either): the
    tangent is the one of the replica holding the extremum, shared equally among ties
    (as ``jnp.max``'s derivative shares it among equal elements)."""
    @jax.custom_jvp
    def f(x):
        return reduce(x, current_axis())

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        y = reduce(x, current_axis())
        hit = x == y
        ties = lax.psum(hit.astype(t.dtype), current_axis())
        return y, lax.psum(jax.numpy.where(hit, t, jax.numpy.zeros_like(t)), current_axis()) / ties
    return f


_OPS["max"], _OPS["min"] = _extremum(lax.pmax), _extremum(lax.pmin)


def _check_groups(groups: Any, n: int) -> list[list[int]]:
    """``axis_index_groups``: a partition of the replica ids into groups of equal size."""
    try:
        gs = [[int(r) for r in g] for g in groups]
    except TypeError:
        raise TypeError(f"axis_index_groups must be a list of lists of replica ids, got "
                        f"{groups!r} ({user_line(__file__)})") from None
    seen = sorted(r for g in gs for r in g)
    if seen != list(range(n)) or len({len(g) for g in gs}) != 1:
        raise ValueError(f"axis_index_groups {gs} must split the {n} replica ids 0..{n - 1} "
                         f"into groups of equal size, each id once ({user_line(__file__)})")
    return gs


def all_reduce(x: Any, op: str = "sum", axis_index_groups: Any = None) -> Any:
    """Reduce ``x`` (a pytree) across replicas with ``op`` in sum | mean | max | min.
    Every op is differentiable (the derivative of ``max``/``min`` goes to the replica
    holding the extremum, split equally among ties). ``axis_index_groups`` (as in
    ``lax.psum``): reduce within each group of replica ids only, e.g. ``[[0, 1], [2, 3]]``."""
    n = _require_step("all_reduce")
    if op not in _OPS:
        raise ValueError(f"all_reduce: op must be one of {sorted(_OPS)}, got {op!r} "
                         f"({user_line(__file__)})")
    if axis_index_groups is not None:
        return jc.grouped_reduce(x, op, _check_groups(axis_index_groups, n), n,
                                 current_axis())
    if op in ("max", "min"):
        return jax.tree.map(lambda a: _OPS[op](a) if jax.numpy.issubdtype(
            jax.numpy.result_type(a), jax.numpy.inexact) else
            (lax.pmax if op == "max" else lax.pmin)(a, current_axis()), x)
    return _OPS[op](x, current_axis())


def all_gather(x: Any, axis: int = 0, tiled: bool = True) -> Any:
    """Every replica's ``x``, the same on every replica: concatenated along ``axis``
    (``tiled=True``), or stacked on a new axis ``axis`` (``tiled=False``, as
    ``lax.all_gather``'s default)."""
    _require_step("all_gather")
    for leaf in jax.tree.leaves(x):
        rank = len(np.shape(leaf)) + (0 if tiled else 1)
        if not -rank <= axis < rank or (tiled and rank == 0):
            raise ValueError(f"all_gather: axis {axis} is out of range for a value of shape "
                             f"{tuple(np.shape(leaf))} (rank {len(np.shape(leaf))}); "
                             + ("to gather scalars, use tiled=False or reshape them to (1,) "
                                if tiled else "") + f"({user_line(__file__)})")
    # (typed identical on every replica, as it is: JAX's ``all_gather`` types its result
    # per replica, so a state leaf that mixes it with a gradient became a per-replica loop
    # carry under steps_per_call > 1 or a user's loop, and the gradient there each
    # replica's own, unreduced; found by a probe)
    return jc.all_gather_invariant(x, current_axis(), axis=axis, tiled=tiled)


def psum_scatter(x: Any, scatter_dimension: int = 0, tiled: bool = True) -> Any:
    """Reduce-scatter (the building block of ZeRO/FSDP-style sharded optimizer state):
    the sum over replicas of ``x``, of which replica r keeps the r-th of N equal chunks
    along ``scatter_dimension`` (``tiled=False``: that dimension must be N long and is
    removed), as ``lax.psum_scatter``."""
    n = _require_step("psum_scatter")
    for leaf in jax.tree.leaves(x):
        shape = np.shape(leaf)
        if not -len(shape) <= scatter_dimension < len(shape):
            raise ValueError(f"psum_scatter: scatter_dimension {scatter_dimension} is out of "
                             f"range for a value of shape {tuple(shape)} ({user_line(__file__)})")
        size = shape[scatter_dimension]
        if (size % n) if tiled else (size != n):
            raise ValueError(f"psum_scatter: dimension {scatter_dimension} of a value of shape "
                             f"{tuple(shape)} has size {size}, "
                             + (f"not divisible by {n} replicas" if tiled else
                                f"not {n} (tiled=False scatters one slice per replica)")
                             + f" ({user_line(__file__)})")
    return jax.tree.map(lambda a: lax.psum_scatter(
        a, current_axis(), scatter_dimension=scatter_dimension % np.ndim(a), tiled=tiled), x)


def ppermute(x: Any, perm: Any) -> Any:
    """Send ``x`` from replica ``i`` to replica ``j`` for each ``(i, j)`` in ``perm``
    (ring and pipeline exchanges); a replica no pair sends to receives zeros, as
    ``lax.ppermute``."""
    n = _require_step("ppermute")
    try:
        pairs = [(int(i), int(j)) for i, j in perm]
    except (TypeError, ValueError):
        raise TypeError(f"ppermute: perm must be a list of (source, destination) replica id "
                        f"pairs, got {perm!r} ({user_line(__file__)})") from None
    srcs, dsts = [i for i, _ in pairs], [j for _, j in pairs]
    bad = [r for r in srcs + dsts if not 0 <= r < n]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(f"ppermute: perm {pairs} must use replica ids in [0, {n}) with no "
                         f"source and no destination twice ({user_line(__file__)})")
    return lax.ppermute(x, current_axis(), pairs)


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
    return lax.all_to_all(x, current_axis(), split_axis, concat_axis, tiled=True)


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
    note_local_view()
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "dtype") and not isinstance(x, (bool, int, float, complex)):
            raise TypeError(f"local: leaves must be arrays or numbers, got {type(x).__name__} "
                            f"({user_line(__file__)})")
    return jax.tree.map(lambda x: jc.to_varying(jax.numpy.asarray(x), current_axis()), tree)
