"""``PerReplica`` values, ``distribute`` and ``reduce`` (TF's strategy.reduce)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from ir.jaxpr_import import REPLICA_AXIS


class PerReplica:
    """One pytree per replica: replica ``r`` sees ``values[r]``.

    As a step argument it marks a per-replica (varying) input; as a step result it holds
    the per-replica values of a leaf that differs between replicas. A step result is
    deferred, like a ``jax.Array``: it holds the step's one global output array, and
    ``values`` splits it into one array per replica the first time it is read (a
    dispatch per replica that a loop which never looks at a result should not pay).
    ``jax.block_until_ready(out)`` waits for it without splitting it, and
    :func:`reduce` reads it with one device-to-host transfer."""

    __slots__ = ("_values", "_global", "_n", "_make", "_pending", "_vshape")

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)
        self._n = len(self._values)
        self._global = None   # (treedef, leaves): the global batch these values split, when known
        self._make = None     # deferred: builds the values on first read
        self._pending = ()    # deferred: the arrays the values will come from
        self._vshape = None   # with _global one array: every value's shape (it stacks them)

    @classmethod
    def deferred(cls, num: int, make: Callable[[], Sequence[Any]],
                 pending: Sequence[Any] = (), stacked: tuple | None = None) -> PerReplica:
        """``num`` values that ``make()`` builds when ``values`` is first read; ``pending``
        are the arrays they come from (what :meth:`block_until_ready` waits for).
        ``stacked=(array, value_shape)``: value ``r`` is
        ``array.reshape((num,) + value_shape)[r]`` (the step's global output), which
        :func:`reduce` and the next step's inputs read without building the values."""
        out = cls.__new__(cls)
        out._values, out._n, out._global, out._vshape = None, num, None, None
        out._make, out._pending = make, tuple(pending)
        if stacked is not None:
            out._global = (LEAF_TREEDEF, (stacked[0],))
            out._vshape = tuple(stacked[1])
        return out

    @property
    def values(self) -> tuple:
        """The per-replica values, a tuple of ``len(self)`` pytrees."""
        v = self._values
        if v is None:
            # two threads may both build them: the same arrays either way
            v = self._values = tuple(self._make())
            self._make = None
        return v

    def block_until_ready(self) -> PerReplica:
        """Wait until every value is computed (``jax.block_until_ready`` calls this)."""
        jax.block_until_ready(list(self._pending) if self._values is None else self._values)
        return self

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, r: int) -> Any:
        return self.values[r]

    def __iter__(self):
        # ``a, b = rt.distribute((x, y), 2)`` would silently unpack the *replicas*
        raise TypeError(
            f"a PerReplica cannot be iterated or unpacked (it holds {self._n} replicas' "
            f"values, not the items of each value): pass it to a step whole, read "
            f"`.values` for the per-replica values, or distribute each item separately "
            f"(`rt.distribute(x, n), rt.distribute(y, n)`)")

    def __repr__(self) -> str:
        return f"PerReplica({list(self.values)!r})"


def is_per_replica(x: Any) -> bool:
    """Is ``x`` a ``PerReplica`` (an ``is_leaf`` for ``jax.tree`` functions)?"""
    return isinstance(x, PerReplica)


def distribute(tree: Any, num_replicas: int) -> PerReplica:
    """Split every leaf of ``tree`` along axis 0 into ``num_replicas`` equal parts.

    NumPy leaves are copied: a loader may refill its batch buffer as soon as this returns
    (a step reads its inputs after its call returns, so a buffer passed as it is could
    change under it). Raises ``ValueError`` naming the leaf shape when axis 0 is not
    divisible."""
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"distribute: num_replicas must be a positive int, got {num_replicas!r}")
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    with_path = [(path, np.array(leaf) if isinstance(leaf, np.ndarray) else leaf)
                 for path, leaf in with_path]
    leaves = [leaf for _, leaf in with_path]
    parts: list[list[Any]] = [[] for _ in range(num_replicas)]
    for path, leaf in with_path:
        shape = np.shape(leaf)
        name = f"leaf {jax.tree_util.keystr(path)}" if path else "the batch"
        if not shape:
            raise ValueError(f"distribute: {name} is a scalar; it has no axis 0 to split over "
                             f"{num_replicas} replicas")
        if shape[0] % num_replicas:
            raise ValueError(f"distribute: {name} has shape {tuple(shape)}: {shape[0]} rows on "
                             f"axis 0 are not divisible by {num_replicas} replicas")
        k = shape[0] // num_replicas
        for r in range(num_replicas):
            parts[r].append(leaf[r * k:(r + 1) * k])
    out = PerReplica([jax.tree.unflatten(treedef, p) for p in parts])
    out._global = (treedef, leaves)
    return out


_REDUCE_OPS = ("sum", "mean", "max", "min")
#: the treedef of one leaf: the inner structure of a PerReplica of plain arrays
LEAF_TREEDEF = jax.tree.structure(0)


def _stacked_on_host(v: PerReplica) -> np.ndarray | None:
    """A step result's values stacked on a new axis 0, read from its global array with one
    transfer (instead of one per replica), or ``None`` when that array is not known here."""
    if v._vshape is None:
        return None
    (g,) = v._global[1]
    if isinstance(g, jax.Array) and not g.is_fully_addressable:
        return None
    return np.asarray(g).reshape((v._n,) + v._vshape)


def _replicas_of(v: Any) -> int | None:
    """The replica count of a step's mirrored result: the size of the ``replica`` axis of
    the mesh it lives on (``None`` for a value that did not come from a step)."""
    sharding = getattr(v, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    names = getattr(mesh, "axis_names", ())
    if REPLICA_AXIS not in names:
        return None
    return int(dict(zip(names, mesh.devices.shape))[REPLICA_AXIS])


def _on_host(v: Any) -> np.ndarray:
    """A mirrored value as a numpy array; a global array of several processes is read
    from this process's shards (each process holds every element of its replicas)."""
    if isinstance(v, jax.Array) and not v.is_fully_addressable:
        out = np.empty(v.shape, v.dtype)
        for s in v.addressable_shards:
            out[s.index] = np.asarray(s.data)
        return out
    return np.asarray(v)


def reduce(op: str, value: Any, axis: int | None = None,
           num_replicas: int | None = None) -> Any:
    """Reduce per-replica values across replicas (TF's ``strategy.reduce``).

    ``value`` is a ``PerReplica`` (of arrays or of pytrees) or a pytree whose leaves are
    ``PerReplica`` (what a step returns) or plain arrays. ``axis=None``: elementwise across
    replicas. ``axis=k``: also reduce along axis ``k`` of each value (for ``mean``, the
    mean over all rows of all replicas, so unequal shards weigh by their rows).

    A leaf that is not a ``PerReplica`` (a result identical on every replica, which a step
    returns as one array) counts as that value held by each of the N replicas, as in TF:
    ``reduce("sum", x)`` is N·x, ``"mean"``, ``"max"`` and ``"min"`` give x. The answer
    never depends on whether the compiler proved a result identical. N is the replica
    count of the step the array came from (the ``replica`` axis of its mesh), or
    ``num_replicas``; a ``"sum"`` of a value from elsewhere without ``num_replicas`` is a
    ``ValueError``. Results are numpy arrays."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce: op must be one of {_REDUCE_OPS}, got {op!r}")
    if num_replicas is not None and (not isinstance(num_replicas, int) or
                                     isinstance(num_replicas, bool) or num_replicas < 1):
        raise ValueError(f"reduce: num_replicas must be a positive int, got {num_replicas!r}")
    fn = getattr(np, op)

    def red(*xs):
        xs = [np.asarray(x) for x in xs]
        for r, x in enumerate(xs):
            if x.dtype.kind not in "biufc":
                raise TypeError(f"reduce: replica {r}'s value is {x.dtype} ({x.ravel()[:1]!r}); "
                                f"only numbers can be reduced")
            if axis is None and x.shape != xs[0].shape:
                raise ValueError(f"reduce: replica {r}'s value has shape {x.shape} but replica "
                                 f"0's has {xs[0].shape}; reducing across replicas with "
                                 f"axis=None needs equal shapes (axis=k concatenates along k)")
        if axis is None:
            return fn(np.stack(xs), axis=0)
        if not -xs[0].ndim <= axis < xs[0].ndim:
            raise ValueError(f"reduce: axis {axis} is out of range for per-replica values of "
                             f"shape {xs[0].shape} (rank {xs[0].ndim})")
        return fn(np.concatenate(xs, axis=axis), axis=axis)

    def identical(path, v):
        n = _replicas_of(v)
        if num_replicas is not None:
            if n is not None and n != num_replicas:
                raise ValueError(
                    f"reduce: value{jax.tree_util.keystr(path)} is the result of a step on {n} "
                    f"replicas but num_replicas={num_replicas}")
            n = num_replicas
        x = _on_host(v)
        if x.dtype.kind not in "biufc":
            raise TypeError(f"reduce: value{jax.tree_util.keystr(path)} is {x.dtype} "
                            f"({x.ravel()[:1]!r}); only numbers can be reduced")
        if n is None:
            if op != "sum":
                n = 1  # the mean, max or min of N copies of x is x, whatever N is
            else:
                raise ValueError(
                    f"reduce: value{jax.tree_util.keystr(path)} (shape {x.shape}) is not a "
                    f"PerReplica nor the result of a replicated step, so the number of "
                    f"replicas whose copies it sums is unknown; pass num_replicas=N")
        # N copies of one value, reduced exactly as N per-replica values are (same dtypes)
        if axis is None:
            return fn(np.broadcast_to(x, (n,) + x.shape), axis=0)
        return red(*([x] * n))

    def one(path, v):
        if isinstance(v, PerReplica):
            stacked = _stacked_on_host(v)
            if stacked is not None:
                return red(*stacked)
            if is_local_view(v):  # this process's replicas of a step's result
                return jax.tree.map(lambda *xs: across_processes(op, red, xs, axis), *v.values)
            return jax.tree.map(red, *v.values)
        return identical(path, v)
    return jax.tree_util.tree_map_with_path(one, value, is_leaf=is_per_replica)


def is_local_view(v: PerReplica) -> bool:
    """Is ``v`` a step's per-replica result in a run of several processes (its values
    this process's replicas only, its global array spanning the others)?"""
    if v._global is None or len(v._global[1]) != 1:
        return False
    g = v._global[1][0]
    return isinstance(g, jax.Array) and not g.is_fully_addressable


def across_processes(op: str, red: Callable, xs: Sequence[Any], axis: int | None) -> Any:
    """``op`` over the replicas of every process, from this process's ``xs``: each
    process reduces its own (``red``; a mean as its sum and count), the partial results
    are gathered from every process and reduced. A collective: every process calls it,
    in the same order (as TF's ``strategy.reduce`` across workers)."""
    from jax.experimental import multihost_utils
    xs = [np.asarray(x) for x in xs]
    if op != "mean":
        parts = multihost_utils.process_allgather(np.asarray(red(*xs)))
        return getattr(np, op)(np.asarray(parts), axis=0)
    local = red(*xs)  # (validates, and gives the mean's dtype)
    cat = np.stack(xs) if axis is None else np.concatenate(xs, axis=axis)
    count = cat.shape[0 if axis is None else axis]
    sums = np.asarray(multihost_utils.process_allgather(np.sum(cat, axis=0 if axis is None
                                                                else axis)))
    counts = np.asarray(multihost_utils.process_allgather(np.asarray(count, np.int64)))
    return np.asarray(np.sum(sums, axis=0) / np.sum(counts)).astype(np.asarray(local).dtype)
