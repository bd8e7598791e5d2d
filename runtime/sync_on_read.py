"""Sync-on-read state (TF's ``SyncOnReadVariable``): per-replica accumulators, such as a
metric's counts, that each replica updates on its own inside the step and that are
aggregated across replicas only when read.

    acc = rt.SyncOnRead({"correct": 0, "total": 0}, aggregation="sum", num_replicas=8)

    def step(params, acc, batch):
        ...                                      # inside: acc.value is this replica's tree
        return params, acc.assign({"correct": acc.value["correct"] + hits,
                                   "total": acc.value["total"] + n})

    params, acc = rstep(params, acc, rt.distribute(batch, 8))   # acc: a SyncOnRead again
    acc.read()                                   # summed over replicas (numpy)

A ``SyncOnRead`` is a pytree node whose one child is a ``PerReplica``, so ``replicate``
passes it as a per-replica input; inside the step (while a replicated function is being
traced) it is the replica's local view, whose ``value`` is that replica's tree and whose
``assign``/``update`` make the updated local view to return. Returned from the step it
comes back as a ``SyncOnRead`` with the same aggregation: leaves that stayed identical on
every replica (returned as one array) are given to every replica.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from compiler.trace import CURRENT_NUM_REPLICAS
from runtime.per_replica import PerReplica, across_processes, is_local_view

__all__ = ["SyncOnRead", "AGGREGATIONS"]

#: TF's ``tf.VariableAggregation`` values a ``SyncOnRead`` supports
AGGREGATIONS = ("sum", "mean", "only_first_replica")


class SyncOnRead:
    """Per-replica state aggregated on read; see the module docstring.

    Outside a step: ``values`` (one tree per replica), ``read()``, ``reset()``,
    ``assign(tree)`` (TF's cross-replica assign: ``read()`` gives ``tree``). Inside a
    step: ``value`` (this replica's tree), ``assign(tree)``, ``update(fn)``."""

    __slots__ = ("aggregation", "_values", "_local", "_n", "_superseded")

    def __init__(self, init: Any, aggregation: str = "sum", num_replicas: int | None = None):
        """``init``: a pytree every replica starts from (copied to each of
        ``num_replicas``), or a ``PerReplica`` of per-replica starting values."""
        aggregation = _check_aggregation(aggregation)
        self.aggregation = aggregation
        self._local = None
        self._superseded = None
        if isinstance(init, PerReplica):
            self._values = init
            self._n = len(init.values)
        else:
            if not isinstance(num_replicas, int) or num_replicas < 1:
                raise ValueError(f"SyncOnRead: num_replicas must be a positive int when init is "
                                 f"not a PerReplica, got {num_replicas!r}")
            init = jax.tree.map(np.asarray, init)
            self._values = PerReplica([init] * num_replicas)
            self._n = num_replicas

    # -- outside a step -----------------------------------------------------------------------
    @property
    def values(self) -> tuple:
        """One tree per replica (this process's replicas)."""
        self._outside("values")
        return self._values.values

    @property
    def num_replicas(self) -> int:
        """How many replicas' values it holds."""
        return self._n

    def read(self) -> Any:
        """The aggregate over replicas (numpy): their sum, their mean, or replica 0's."""
        self._outside("read")
        vals = self._values.values
        # several processes: a collective (an accumulator made outside a step holds this
        # process's replicas only, as one a step returned does: before, its read() reduced
        # them alone, 4 of 8 replicas; found by a probe)
        local_view = is_local_view(self._values) or jax.process_count() > 1
        if self.aggregation == "only_first_replica":
            if local_view:
                from jax.experimental import multihost_utils
                return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(
                    jax.tree.map(np.asarray, vals[0]),
                    is_source=jax.process_index() == _first_replica_process(self._values)))
            return jax.tree.map(np.asarray, vals[0])
        op = "sum" if self.aggregation == "sum" else "mean"
        fn = getattr(np, op)

        def red(*xs):
            stacked = np.stack([np.asarray(x) for x in xs])
            # (a sum keeps the counters' dtype: NumPy's promotes int32 to int64)
            return fn(stacked, axis=0, dtype=stacked.dtype if op == "sum" else None)
        if local_view:
            return jax.tree.map(lambda *xs: across_processes(op, red, xs, None), *vals)
        return jax.tree.map(red, *vals)

    def reset(self, init: Any = None) -> SyncOnRead:
        """A ``SyncOnRead`` with every replica's value set to ``init`` (default: zeros)."""
        if init is None:
            init = jax.tree.map(lambda x: np.zeros(np.shape(x), np.asarray(x).dtype),
                                self._values.values[0])
        return SyncOnRead(init, self.aggregation, self.num_replicas)

    def _assigned_across(self, tree: Any) -> SyncOnRead:
        old = jax.tree.structure(self._values.values[0])
        if jax.tree.structure(tree) != old:
            raise ValueError(f"SyncOnRead.assign: the new value has structure "
                             f"{jax.tree.structure(tree)} but the accumulator has {old}")
        tree = jax.tree.map(np.asarray, tree)
        n = self._n
        if self.aggregation != "sum":
            return SyncOnRead(PerReplica([tree] * n), self.aggregation)
        # (several processes: this process's n replicas of n x process_count in all, and
        # the first one process 0's; before, each process split the value over its own
        # replicas alone: 20 read back where 10 was assigned on 2 processes)
        total = n * jax.process_count()
        first = jax.process_index() == 0

        def part(x: np.ndarray, r: int) -> np.ndarray:
            if np.issubdtype(x.dtype, np.inexact):
                return (x / total).astype(x.dtype)
            return x if r == 0 and first else np.zeros_like(x)
        return SyncOnRead(PerReplica([jax.tree.map(lambda x: part(x, r), tree)
                                      for r in range(n)]), self.aggregation)

    # -- inside a step ------------------------------------------------------------------------
    @property
    def value(self) -> Any:
        """This replica's tree (inside a replicated step only)."""
        if self._local is None:
            raise ValueError("SyncOnRead.value is the replica's own value inside a replicated "
                             "step; outside, use .read() (aggregated) or .values (per replica)")
        return self._local

    def assign(self, tree: Any) -> SyncOnRead:
        """Inside a step: the local view holding ``tree`` (this replica's value): return
        it from the step. Outside (TF's assign in cross-replica context): a
        ``SyncOnRead`` whose ``read()`` is ``tree``: under ``"sum"`` each replica holds
        ``tree / N`` (an integer leaf: replica 0 holds it, the others zero, so the sum is
        exact), under ``"mean"`` and ``"only_first_replica"`` each holds ``tree``.
        (``reset(tree)`` sets every replica's value to ``tree`` instead.)"""
        if self._local is None:
            return self._assigned_across(tree)
        old = jax.tree.structure(self._local)
        if jax.tree.structure(tree) != old:
            raise ValueError(f"SyncOnRead.assign: the new value has structure "
                             f"{jax.tree.structure(tree)} but the accumulator has {old}")
        from runtime.validate import user_line
        self._superseded = user_line(__file__)  # (returning this view would drop the update)
        return _local_view(self.aggregation, self._n, tree)

    def update(self, fn: Callable[[Any], Any]) -> SyncOnRead:
        """``assign(fn(value))``."""
        return self.assign(fn(self.value))

    def _outside(self, what: str) -> None:
        if self._local is not None:
            raise ValueError(f"SyncOnRead.{what} is not available inside a replicated step; "
                             f"use .value (this replica's) there")

    def __repr__(self) -> str:
        if self._local is not None:
            return f"SyncOnRead(local, aggregation={self.aggregation!r}, value={self._local!r})"
        return f"SyncOnRead(aggregation={self.aggregation!r}, values={list(self._values.values)!r})"


def _check_aggregation(aggregation: Any) -> str:
    a = str(getattr(aggregation, "name", aggregation)).lower()  # also TF-style enums
    if a not in AGGREGATIONS:
        raise ValueError(f"SyncOnRead: aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return a


def _local_view(aggregation: str, n: int, tree: Any) -> SyncOnRead:
    obj = object.__new__(SyncOnRead)
    obj.aggregation = aggregation
    obj._n = n
    obj._values = None
    obj._local = tree
    obj._superseded = None
    return obj


def check_returned_views(out: Any, fn_name: str) -> None:
    """Raise ``TypeError`` when a step returns an accumulator's local view after calling
    its ``assign``/``update``, which return the updated view and leave this one as it
    was: TF's ``assign`` and a Keras metric's ``update_state`` change the variable in
    place, so a port that calls ``acc.update(fn)`` and returns ``acc`` would silently
    keep the old values (a metric that stays zero). Called while the step is traced, on
    its results as it made them (a pytree rebuild makes fresh views, without the mark)."""
    flat = jax.tree_util.tree_flatten_with_path(
        out, is_leaf=lambda x: isinstance(x, SyncOnRead))[0]
    for path, x in flat:
        if isinstance(x, SyncOnRead) and x._local is not None and x._superseded:
            at = f"result{jax.tree_util.keystr(path)}" if path else "its result"
            raise TypeError(
                f"the step {fn_name} returns as {at} a SyncOnRead accumulator whose "
                f"assign/update was called ({x._superseded}): assign and update return the "
                f"updated accumulator and leave this one unchanged, so the update would be "
                f"lost; return what they return (acc = acc.update(fn); return ..., acc)")


def _flatten(s: SyncOnRead):
    # outside: the PerReplica (a leaf for jax.tree, a per-replica input for replicate);
    # a local view: its tree, whose leaves become the step's outputs
    return ((s._values if s._local is None else s._local),), (s.aggregation, s._n)


def _unflatten(aux: tuple, children: Sequence[Any]) -> SyncOnRead:
    (child,) = children
    aggregation, n = aux
    if CURRENT_NUM_REPLICAS.get() is not None:  # tracing a replicated step: the local view
        return _local_view(aggregation, n, child)
    if isinstance(child, PerReplica):
        return SyncOnRead(child, aggregation)
    # a step's results: a tree whose leaves are PerReplica (varying) or one array (the same
    # on every replica): back to one tree per replica
    leaves, treedef = jax.tree.flatten(child, is_leaf=lambda x: isinstance(x, PerReplica))
    ns = {len(x.values) for x in leaves if isinstance(x, PerReplica)}
    if ns - {n}:
        raise ValueError(f"SyncOnRead: per-replica leaves have {sorted(ns)} values but the "
                         f"accumulator has {n} replicas")
    per = [treedef.unflatten([x.values[r] if isinstance(x, PerReplica) else x for x in leaves])
           for r in range(n)]
    return SyncOnRead(PerReplica(per), aggregation)


jax.tree_util.register_pytree_node(SyncOnRead, _flatten, _unflatten)


def _first_replica_process(values: Any) -> int:
    """The process holding replica 0 of a step's per-replica result (its global array's
    first device along the replica axis); process 0 for one made outside a step."""
    if values._global is None:
        return 0
    g = values._global[1][0]
    return int(g.sharding.mesh.devices.flat[0].process_index)
