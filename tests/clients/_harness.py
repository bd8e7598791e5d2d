"""Run a ported pmap-style train step three ways and compare what they return.

A port's ``train_step`` is written exactly as pmap code writes it (``lax.pmean(grads,
'batch')``, ``lax.pmean(batch_stats, 'batch')``, ...). :func:`train` runs it for a few
steps in one of three modes, on the same devices and the same data:

* ``"pmap"``: ``jax.pmap(train_step, axis_name='batch')``; every argument is stacked on
  a leading replica axis (mirrored ones broadcast, as ``flax.jax_utils.replicate`` does).
* ``"replicate"``: ``rt.replicate(train_step, num_replicas=n, axis_name='batch')``, the
  same function, only the decorator changed; split data go in as ``rt.distribute``,
  per-replica values as ``rt.PerReplica``, mirrored state as plain arrays.
* ``"global"``: the oracle for models without per-replica statistics or randomness: one
  ``jax.jit`` on one device of the same step on the *global* batch, mapped with
  ``jax.vmap(axis_name='batch')`` over an axis of size 1, so every ``pmean`` is the
  identity and the loss is the mean over the global batch.

Arguments of a step are described once, in global form: :class:`Split` (a global batch,
split on axis 0 over the replicas), :class:`Each` (one value per replica, e.g. dropout
keys), anything else is mirrored. Positions in ``static_argnums`` are static (pmap's
``static_broadcasted_argnums``). Results are brought to numpy, every leaf stacked on a
leading replica axis (a mirrored result is broadcast), so the modes compare leaf by leaf.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import runtime as rt

AXIS = "batch"
RTOL, ATOL = 2e-5, 1e-6
#: how many training steps every port runs (the state of step 1 feeds step 2)
STEPS = 2
REPLICAS = [2, 8]


@dataclasses.dataclass(frozen=True)
class Split:
    """A global batch (a pytree): each replica gets its equal slice of axis 0."""
    tree: Any


@dataclasses.dataclass(frozen=True)
class Each:
    """One value (pytree) per replica, in replica order."""
    values: Sequence[Any]


# -- building the inputs of each mode --------------------------------------------------

def _split_leaves(tree: Any, n: int) -> list:
    """The replicas' slices of a global batch, as ``n`` pytrees."""
    leaves, treedef = jax.tree.flatten(tree)
    for leaf in leaves:
        assert np.shape(leaf)[0] % n == 0, f"batch of {np.shape(leaf)} does not split over {n}"
    parts = [np.split(np.asarray(leaf), n) for leaf in leaves]
    return [jax.tree.unflatten(treedef, [p[r] for p in parts]) for r in range(n)]


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def stack(trees: Sequence[Any]) -> Any:
    """Stack ``n`` pytrees of the same structure on a new leading axis (on the host:
    eager ``jnp`` ops would compile once per shape)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs) if _is_key(xs[0])
                        else np.stack([np.asarray(x) for x in xs]), *trees)


def broadcast(tree: Any, n: int) -> Any:
    """A mirrored pytree as pmap takes it: every leaf repeated on a leading axis of ``n``
    (``flax.jax_utils.replicate``)."""
    return stack([tree] * n)


def _for_pmap(arg: Any, n: int, axis: str = AXIS) -> Any:
    """Placed as pmap code places them (``device_put_sharded`` / ``_replicated``, what
    ``flax.jax_utils.replicate`` and ``prefetch_to_device`` do), so that pmap compiles once
    rather than again for the sharded arrays its first step returns."""
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:n], (axis,)),
                                          jax.sharding.PartitionSpec(axis))
    if isinstance(arg, Split):
        tree = stack(_split_leaves(arg.tree, n))
    elif isinstance(arg, Each):
        assert len(arg.values) == n
        tree = stack(arg.values)
    else:
        tree = broadcast(arg, n)
    return jax.device_put(tree, sharding)


def _for_replicate(arg: Any, n: int) -> Any:
    if isinstance(arg, Split):
        return rt.distribute(arg.tree, n)
    if isinstance(arg, Each):
        assert len(arg.values) == n
        return rt.PerReplica(list(arg.values))
    return arg


def _for_global(arg: Any) -> Any:
    if isinstance(arg, Each):
        raise AssertionError("the global oracle has no per-replica values (Each)")
    tree = arg.tree if isinstance(arg, Split) else arg
    return stack([tree])


# -- bringing results to numpy ----------------------------------------------------------

def _np(x: Any) -> np.ndarray:
    if _is_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x)


def replicate_result(tree: Any, n: int) -> Any:
    """A result of ``rt.replicate`` with every leaf as ``[n, ...]`` numpy: a
    ``PerReplica`` leaf stacks its values, a mirrored array is broadcast."""
    def one(x):
        if isinstance(x, rt.PerReplica):
            assert len(x.values) == n
            return np.stack([_np(v) for v in x.values])
        v = _np(x)
        return np.broadcast_to(v, (n,) + v.shape)
    return jax.tree.map(one, tree, is_leaf=rt.PerReplica.__instancecheck__)


def assert_mirrored(tree: Any, what: str) -> None:
    """Every leaf of a ``rt.replicate`` result is one plain array (proven identical on
    every replica), not a ``PerReplica``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=rt.PerReplica.__instancecheck__)
    bad = [jax.tree_util.keystr(p) for p, x in flat if isinstance(x, rt.PerReplica)]
    assert not bad, f"{what}: mirrored results came back as PerReplica: {bad}"


def assert_trees_close(got: Any, want: Any, what: str, rtol: float = RTOL,
                       atol: float = ATOL) -> None:
    """Same structure, every leaf ``assert_allclose``; the message names the leaf."""
    g_flat, g_def = jax.tree_util.tree_flatten_with_path(got)
    w_flat, w_def = jax.tree_util.tree_flatten_with_path(want)
    assert g_def == w_def, f"{what}: tree structures differ:\n{g_def}\n{w_def}"
    for (path, g), (_, w) in zip(g_flat, w_flat):
        g, w = _np(g), _np(w)
        assert g.shape == w.shape, f"{what}{jax.tree_util.keystr(path)}: {g.shape} vs {w.shape}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


def assert_changed(before: Any, after: Any, what: str) -> None:
    """Training moved the state: a step that did nothing cannot pass by accident."""
    b = [_np(x) for x in jax.tree.leaves(before)]
    a = [_np(x)[0] for x in jax.tree.leaves(after)]
    assert any(x.shape == y.shape and not np.allclose(x, y) for x, y in zip(b, a)), \
        f"{what}: the state did not change in training"


# -- running a port ---------------------------------------------------------------------

@dataclasses.dataclass
class Port:
    """How to train one port.

    ``step``: the pmap-style train step. ``state``: the mirrored arguments carried from
    step to step, the first ``len(state)`` positional arguments. ``inputs(i)``: the
    other positional arguments and keyword arguments of step ``i`` as ``(args, kwargs)``
    (global form: :class:`Split`, :class:`Each`, or mirrored). ``split_out(out)``:
    ``(new_state tuple, metrics)``; the default takes ``(state, metrics)`` results."""

    step: Callable
    state: tuple
    inputs: Callable[[int], tuple[tuple, dict]]
    static_argnums: tuple = ()
    #: the axis the step's collectives name (pmap's and replicate's ``axis_name``)
    axis_name: str = AXIS
    split_out: Callable[[Any], tuple[tuple, Any]] = lambda out: ((out[0],), out[1])


def train(port: Port, mode: str, n: int, steps: int = STEPS) -> tuple[Any, list]:
    """Run ``steps`` steps in ``mode``; return the final state and each step's metrics,
    every leaf as numpy ``[n, ...]`` (``[1, ...]`` for ``"global"``)."""
    k = len(port.state)
    statics = set(port.static_argnums)
    # Python scalars and weakly typed arrays in the state (TrainState.step=0) as the
    # strongly typed arrays that the next step returns (flax.jax_utils.replicate does the
    # same), so the second step does not compile again for a weak type
    init = jax.tree.map(_strong, port.state)
    if mode == "pmap":
        fn = jax.pmap(port.step, axis_name=port.axis_name, devices=jax.devices()[:n],
                      static_broadcasted_argnums=port.static_argnums)
        put = functools.partial(_for_pmap, n=n, axis=port.axis_name)
        state = tuple(put(s) for s in init)
    elif mode == "replicate":
        fn = rt.replicate(port.step, num_replicas=n, axis_name=port.axis_name,
                          static_argnums=port.static_argnums)
        state = init
        put = functools.partial(_for_replicate, n=n)
    elif mode == "global":
        fn = _global_step(port.step, statics, port.axis_name)
        state = tuple(_for_global(s) for s in init)
        put = _for_global
    else:
        raise ValueError(mode)
    metrics = []
    for i in range(steps):
        args, kwargs = port.inputs(i)
        args = tuple(a if k + j in statics else put(a) for j, a in enumerate(args))
        kwargs = {name: put(v) for name, v in kwargs.items()}
        out = fn(*state, *args, **kwargs)
        state, m = port.split_out(out)
        state = tuple(state)
        assert len(state) == k
        if mode == "replicate":
            assert_mirrored(state, f"replicate, N={n}, step {i}: the new state")
            m = replicate_result(m, n)
        metrics.append(jax.tree.map(_np, m))
    if mode == "replicate":
        state = replicate_result(state, n)
    return jax.tree.map(_np, state), metrics


def _strong(x: Any) -> Any:
    if isinstance(x, jax.Array) and x.weak_type:  # e.g. step=0 of a jitted TrainState.create
        return np.asarray(x)
    if isinstance(x, bool):
        return np.bool_(x)
    if isinstance(x, int):
        return np.int32(x)
    if isinstance(x, float):
        return np.float32(x)
    return x


def _global_step(step: Callable, statics: set, axis_name: str) -> Callable:
    """``jax.jit`` of ``step`` on one device, mapped over an axis of size 1 named
    ``axis_name`` (the static arguments are closed over, one trace per value)."""
    @functools.lru_cache(maxsize=None)
    def compiled(static_items: tuple, nargs: int):
        static = dict(static_items)

        def call(dyn_args, kwargs):
            it = iter(dyn_args)
            args = [static[i] if i in static else next(it) for i in range(nargs)]
            return step(*args, **kwargs)
        return jax.jit(jax.vmap(call, axis_name=axis_name))

    def run(*args, **kwargs):
        static_items = tuple((i, args[i]) for i in sorted(statics))
        dyn = tuple(a for i, a in enumerate(args) if i not in statics)
        with jax.default_device(jax.devices()[0]):
            return compiled(static_items, len(args))(dyn, kwargs)
    return run


def check_port(port: Port, n: int, oracle: bool, steps: int = STEPS,
               oracle_metrics: Callable[[Any], Any] | None = None,
               oracle_tol: tuple[float, float] = (RTOL, ATOL),
               pmap_tol: tuple[float, float] = (RTOL, ATOL)) -> None:
    """pmap and replicate give the same state and metrics after ``steps`` steps (to
    ``pmap_tol``: float16 ports sum in another order); with ``oracle``, the state also
    equals the global-batch step on one device, and so do ``oracle_metrics(metrics)``
    (the metrics that are means over the global batch)."""
    p_state, p_metrics = train(port, "pmap", n, steps)
    r_state, r_metrics = train(port, "replicate", n, steps)
    assert_changed(port.state, p_state, "pmap")
    assert_trees_close(r_state, p_state, f"N={n} state, replicate vs pmap", *pmap_tol)
    for i, (rm, pm) in enumerate(zip(r_metrics, p_metrics)):
        assert_trees_close(rm, pm, f"N={n} step {i} metrics, replicate vs pmap", *pmap_tol)
    if not oracle:
        return
    g_state, g_metrics = train(port, "global", 1, steps)
    rtol, atol = oracle_tol
    want = jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape[1:]), g_state)
    assert_trees_close(r_state, want, f"N={n} state, replicate vs global jit", rtol, atol)
    if oracle_metrics is not None:
        for i, (rm, gm) in enumerate(zip(r_metrics, g_metrics)):
            gm = jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape[1:]),
                              oracle_metrics(gm))
            assert_trees_close(oracle_metrics(rm), gm,
                               f"N={n} step {i} metrics, replicate vs global jit", rtol, atol)


def check_against_global(port: Port, n: int, steps: int = STEPS, oracle: Port | None = None,
                         metric_means: bool = True, what: str = "",
                         metric_tol: tuple[float, float] = (RTOL, ATOL)) -> Any:
    """A step written for one replica (no collective) run by ``replicate`` on ``n``
    replicas equals the global-batch step on one device: the state after ``steps`` steps,
    and (``metric_means``) each step's metrics averaged over the replicas (equal slices of
    the batch), to ``metric_tol`` (rtol, atol). ``oracle``: the port whose global run is
    the reference (default ``port``: one that uses ``rt.`` collectives cannot run outside
    ``replicate``). Returns the oracle's final state, ``[1, ...]`` per leaf."""
    r_state, r_metrics = train(port, "replicate", n, steps)
    g_state, g_metrics = train(oracle or port, "global", 1, steps)
    assert_changed(port.state, g_state, "global jit")
    want = jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape[1:]), g_state)
    assert_trees_close(r_state, want, f"N={n} {what} state, replicate vs global jit")
    if metric_means:
        for i, (rm, gm) in enumerate(zip(r_metrics, g_metrics)):
            assert_trees_close(jax.tree.map(lambda m: m.mean(0), rm),
                               jax.tree.map(lambda m: m[0], gm),
                               f"N={n} {what} step {i} metrics, mean over replicas",
                               *metric_tol)
    return g_state


def make_keys(seed: int, n: int) -> list:
    """``n`` distinct PRNG keys (raw uint32 keys, as pmap code splits them)."""
    return list(jax.random.split(jax.random.PRNGKey(seed), n))


def mnist_batches(global_batch: int, image: int, seed: int = 0, steps: int = 2) -> list[dict]:
    """Synthetic MNIST-shaped batches (the flax examples' ``{"image", "label"}``): float
    images in [0, 1], NHWC with one channel, int32 labels in [0, 10)."""
    rng = np.random.default_rng(seed)
    return [{"image": rng.random((global_batch, image, image, 1), dtype=np.float32),
             "label": rng.integers(0, 10, global_batch).astype(np.int32)}
            for _ in range(steps)]
