"""Porting from pmap (issue 11): any callable, static and keyword arguments, the named
axis of pmap code and the collectives it uses, returned container types.

Oracle: ``jax.pmap`` of the same function on the same devices (pmap is JAX's own
per-replica semantics), or plain evaluation where there is nothing to replicate.
"""
from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from numpy.testing import assert_allclose

import runtime as rt

N = 4
RNG = np.random.default_rng(11)
X = RNG.normal(size=(N, 8, 3)).astype(np.float32)   # per replica: [8, 3]
W = RNG.normal(size=(3, 2)).astype(np.float32)


def per(stacked) -> rt.PerReplica:
    """The per-replica values of an array stacked on axis 0 (pmap's layout)."""
    return rt.PerReplica([stacked[i] for i in range(stacked.shape[0])])


def stack(out):
    """Our result in pmap's layout: per-replica values stacked, mirrored ones repeated."""
    def one(leaf):
        if isinstance(leaf, rt.PerReplica):
            return jax.tree.map(lambda *v: np.stack([np.asarray(a) for a in v]), *leaf.values)
        return np.stack([np.asarray(leaf)] * N)
    return jax.tree.map(one, out, is_leaf=lambda a: isinstance(a, rt.PerReplica))


def assert_same_as_pmap(fn, *args, in_axes=0, rtol=1e-5, atol=1e-6, **ours_kw):
    """``fn`` through ``rt.replicate(axis_name='batch')`` equals ``jax.pmap``; args with
    in_axes 0 are stacked per replica, None mirrored."""
    axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
    want = jax.pmap(fn, axis_name="batch", in_axes=axes)(*args)
    ours_args = [per(a) if ax == 0 else a for a, ax in zip(args, axes)]
    got = rt.replicate(fn, num_replicas=N, axis_name="batch", **ours_kw)(*ours_args)
    jax.tree.map(lambda g, w: assert_allclose(g, np.asarray(w), rtol=rtol, atol=atol),
                 stack(got), want)
    return got


# -- any callable ----------------------------------------------------------------------------
def _train_step(w, x, lr):
    g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - lr * lax.pmean(g, "batch")


class _Model:
    def __init__(self, lr):
        self.lr = lr

    def step(self, w, x):
        return _train_step(w, x, self.lr)

    def __call__(self, w, x):
        return _train_step(w, x, self.lr)


class _WithFnAttribute:
    """A callable object whose attributes are named like ours (eqx.filter_jit's are)."""

    def __init__(self):
        self.fn, self.options, self.mesh = "not callable", None, None

    def __call__(self, w, x):
        return _train_step(w, x, 0.1)


@pytest.mark.parametrize("make", [
    lambda: functools.partial(_train_step, lr=0.1),
    lambda: _Model(0.1).step,
    lambda: _Model(0.1),
    lambda: jax.jit(functools.partial(_train_step, lr=0.1)),
    lambda: __import__("equinox").filter_jit(functools.partial(_train_step, lr=0.1)),
    lambda: _WithFnAttribute(),
], ids=["partial", "bound-method", "callable-object", "jax.jit", "eqx.filter_jit",
        "object-with-fn-attribute"])
def test_any_callable_runs_like_pmap(make):
    fn = make()
    step = rt.replicate(fn, num_replicas=N, axis_name="batch")
    assert isinstance(step.__name__, str) and step.__name__
    got = step(W, per(X))
    want = jax.pmap(fn, axis_name="batch", in_axes=(None, 0))(W, X)
    assert_allclose(np.asarray(got), np.asarray(want[0]), rtol=1e-5, atol=1e-6)


def test_nnx_jit_wrapped_step():
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @nnx.jit
    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    got = rt.replicate(apply, num_replicas=N)(state, per(X))
    for r in range(N):
        assert_allclose(np.asarray(got.values[r]), np.asarray(model(X[r])), rtol=1e-5, atol=1e-6)


def test_callable_names_in_messages():
    step = rt.replicate(functools.partial(_train_step, lr=0.1), num_replicas=N, axis_name="batch")
    assert step.__name__ == "_train_step"
    assert rt.replicate(_Model(0.1), num_replicas=N).__name__ == "_Model"


# -- static and keyword arguments -------------------------------------------------------------
def _latents(x, n_latent):
    return jnp.zeros((x.shape[0], n_latent)) + x.sum(-1, keepdims=True)


@pytest.mark.parametrize("how", ["argnums", "argnames", "keyword"])
def test_static_argument_picks_shapes_and_keys_the_cache(how):
    kw = {"static_argnums": (1,)} if how == "argnums" else {"static_argnames": ("n_latent",)}
    step = rt.replicate(_latents, num_replicas=N, **kw)
    call = (lambda x, n: step(x, n_latent=n)) if how == "keyword" else (lambda x, n: step(x, n))
    a, b, a2 = call(per(X), 5), call(per(X), 7), call(per(X), 5)
    assert a.values[0].shape == (8, 5) and b.values[0].shape == (8, 7)
    for r in range(N):
        assert_allclose(np.asarray(a.values[r]), np.asarray(_latents(X[r], 5)), rtol=1e-6)
        assert_allclose(np.asarray(a2.values[r]), np.asarray(a.values[r]))
    info = step.cache_info()
    assert info.misses == 2 and info.hits >= 1


def test_unhashable_static_argument_is_a_clear_error():
    step = rt.replicate(_latents, num_replicas=N, static_argnums=(1,))
    with pytest.raises(TypeError, match=r"static argument 1.*unhashable|argument 1.*hashable"):
        step(per(X), [5])


def test_keyword_arguments_per_replica_and_mirrored():
    def step(w, x, *, dropout_rng, scale=1.0):
        keep = jax.random.bernoulli(dropout_rng, 0.5, x.shape)
        return (jnp.where(keep, x, 0.0) @ w) * scale

    keys = jax.random.split(jax.random.PRNGKey(0), N)
    got = rt.replicate(step, num_replicas=N)(W, per(X), dropout_rng=rt.PerReplica(list(keys)),
                                               scale=2.0)
    for r in range(N):
        assert_allclose(np.asarray(got.values[r]),
                        np.asarray(step(W, X[r], dropout_rng=keys[r], scale=2.0)),
                        rtol=1e-5, atol=1e-6)


# -- the named axis: pmap's collectives --------------------------------------------------------
@pytest.mark.parametrize("name,fn", [
    ("psum", lambda x: lax.psum(x, "batch")),
    ("pmean", lambda x: lax.pmean(x, "batch")),
    ("pmax", lambda x: lax.pmax(x, "batch")),
    ("pmin", lambda x: lax.pmin(x, "batch")),
    ("axis_index", lambda x: x * lax.axis_index("batch")),
    ("all_gather", lambda x: lax.all_gather(x, "batch")),
    ("all_gather-tiled", lambda x: lax.all_gather(x, "batch", axis=1, tiled=True)),
    ("ppermute-ring", lambda x: lax.ppermute(x, "batch", [(i, (i + 1) % N) for i in range(N)])),
    ("ppermute-partial", lambda x: lax.ppermute(x, "batch", [(0, 3), (3, 0)])),
    ("psum_scatter", lambda x: lax.psum_scatter(x, "batch", scatter_dimension=0, tiled=True)),
    ("psum_scatter-untiled", lambda x: lax.psum_scatter(x[:N], "batch")),
    ("all_to_all", lambda x: lax.all_to_all(x, "batch", 0, 0, tiled=True)),
    ("axis_size", lambda x: x * lax.psum(1, "batch")),
])
def test_pmap_collectives_by_axis_name(name, fn):
    assert_same_as_pmap(fn, X)


def test_explicit_pmean_of_gradients_is_not_reduced_twice_and_does_not_warn():
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        g = lax.pmean(g, axis_name="batch")
        return w - 0.1 * g, lax.pmean(loss, "batch")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_as_pmap(step, W, X, in_axes=(None, 0))
    # and equal to one device's step on the global batch (equal batches per replica)
    want = W - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(X.reshape(-1, 3) @ w) ** 2))(W)
    got = rt.replicate(step, num_replicas=N, axis_name="batch")(W, per(X))[0]
    assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_gradients_through_pmap_collectives():
    """Gradients of a loss that uses collectives (ring exchange, all-gather, psum_scatter)
    equal pmap's."""
    def step(w, x):
        def loss(w):
            h = jnp.tanh(x @ w)
            ring = lax.ppermute(h, "batch", [(i, (i + 1) % N) for i in range(N)])
            every = lax.all_gather(h.sum(0), "batch")
            part = lax.psum_scatter(h[:N], "batch", tiled=False)
            return jnp.mean(h * ring) + jnp.sum(every ** 2) * 0.01 + jnp.sum(part) * 0.1
        return lax.pmean(jax.grad(loss)(w), "batch")

    assert_same_as_pmap(step, W, X, in_axes=(None, 0), rtol=1e-4, atol=1e-5)


def test_flax_batchnorm_with_axis_name_equals_pmap():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            x = nn.Dense(4)(x)
            return nn.BatchNorm(use_running_average=not train, axis_name="batch")(x)

    variables = Net().init(jax.random.PRNGKey(0), X[0])

    def step(params, stats, x):
        def loss(p):
            y, upd = Net().apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
            return jnp.mean(y ** 2), upd
        (l, upd), g = jax.value_and_grad(loss, has_aux=True)(params)
        g = lax.pmean(g, "batch")
        return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), upd["batch_stats"], l

    assert_same_as_pmap(step, variables["params"], variables["batch_stats"], X,
                        in_axes=(None, None, 0), rtol=1e-4, atol=1e-5)


def test_flax_dynamic_scale_with_axis_name_equals_pmap():
    """flax's DynamicScale (mixed-precision loss scaling, as the imagenet example uses it
    with half precision): value_and_grad(axis_name='batch') pmeans the gradients and
    checks them finite across replicas."""
    from flax.training.dynamic_scale import DynamicScale

    def step(w, x):
        dyn = DynamicScale(scale=2.0 ** 8)
        grad_fn = dyn.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2), axis_name="batch")
        dyn, is_fin, loss, g = grad_fn(w)
        return w - 0.1 * g, loss, is_fin, dyn.scale

    assert_same_as_pmap(step, W, X, in_axes=(None, 0))


def test_unknown_axis_name_is_a_clear_error():
    def step(x):
        return lax.psum(x, "batchh")   # the typo

    with pytest.raises(NameError) as e:
        rt.replicate(step, num_replicas=N, axis_name="batch")(per(X))
    msg = str(e.value)
    assert "'batchh'" in msg and "'batch'" in msg
    assert re.search(r"test_porting\.py:\d+", msg), msg


def test_axis_name_without_setting_it_names_the_option():
    with pytest.raises(NameError, match=r"axis_name="):
        rt.replicate(lambda x: lax.pmean(x, "batch"), num_replicas=N)(per(X))


# -- collectives over a vmap axis inside the step (equinox's BatchNorm(axis_name=...)) ----------
def test_collectives_over_a_vmap_axis_equal_pmap():
    def step(x):
        y = jax.vmap(lambda xi: xi - lax.pmean(xi, "i"), axis_name="i")(x)
        z = jax.vmap(lambda xi: xi * lax.psum(1.0, "i") + lax.pmean(xi, ("i", "batch")),
                     axis_name="i")(x)
        m = jax.vmap(lambda xi: lax.pmax(xi, "i") - lax.pmin(xi, ("batch", "i")), axis_name="i")(x)
        return y, z, m

    assert_same_as_pmap(step, X)


def test_gradient_of_a_vmap_with_collectives_is_exact():
    """grad(vmap(f)) where f normalizes over the vmap axis (batch norm): equals one
    device's gradient of the mean of the per-replica losses (the all-reduce's mean)."""
    def loss(w, x):
        h = jax.vmap(lambda xi: jnp.tanh(xi @ w) - lax.pmean(jnp.tanh(xi @ w), "i"),
                     axis_name="i")(x)
        return jnp.mean(h ** 2)

    got = rt.replicate(lambda w, x: jax.grad(loss)(w, x), num_replicas=N)(W, per(X))
    want = np.mean([jax.grad(loss)(W, X[r]) for r in range(N)], axis=0)
    assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_per_example_gradients_through_a_vmap_collective_are_refused():
    def step(w, x):
        return jax.vmap(jax.grad(lambda w, xi: jnp.sum((xi @ w - lax.pmean(xi @ w, "i")) ** 2)),
                        in_axes=(None, 0), axis_name="i")(w, x)

    with pytest.raises(ValueError, match=r"per-example gradients of a loss that mixes the "
                                         r"examples are not defined"):
        rt.replicate(step, num_replicas=N)(W, per(X))


# -- our own collectives, with pmap as the oracle ---------------------------------------------
@pytest.mark.parametrize("name,ours,theirs", [
    ("psum_scatter", lambda x: rt.psum_scatter(x), lambda x: lax.psum_scatter(x, "batch", tiled=True)),
    ("psum_scatter-untiled", lambda x: rt.psum_scatter(x[:N], tiled=False),
     lambda x: lax.psum_scatter(x[:N], "batch")),
    ("ppermute", lambda x: rt.ppermute(x, [(i, (i + 1) % N) for i in range(N)]),
     lambda x: lax.ppermute(x, "batch", [(i, (i + 1) % N) for i in range(N)])),
    ("all_gather-untiled", lambda x: rt.all_gather(x, tiled=False),
     lambda x: lax.all_gather(x, "batch")),
    ("all_gather-axis1", lambda x: rt.all_gather(x, axis=1), lambda x: lax.all_gather(x, "batch", axis=1, tiled=True)),
    ("all_reduce-groups", lambda x: rt.all_reduce(x, "sum", axis_index_groups=[[0, 1], [2, 3]]),
     lambda x: jnp.where(lax.axis_index("batch") < 2,
                         lax.all_gather(x, "batch")[:2].sum(0),
                         lax.all_gather(x, "batch")[2:].sum(0))),
    ("all_to_all-negative-axes", lambda x: rt.all_to_all(x.reshape(N, 2, 3), -3, -3),
     lambda x: lax.all_to_all(x.reshape(N, 2, 3), "batch", 0, 0, tiled=True)),
])
def test_runtime_collectives_equal_pmap(name, ours, theirs):
    want = jax.pmap(theirs, axis_name="batch")(X)
    got = rt.replicate(ours, num_replicas=N)(per(X))
    assert_allclose(stack(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_runtime_collective_gradients_equal_pmap():
    ring = [(i, (i + 1) % N) for i in range(N)]

    def ours(w, x):
        def loss(w):
            h = jnp.tanh(x @ w)
            return (jnp.mean(h * rt.ppermute(h, ring)) + jnp.sum(rt.psum_scatter(h[:N], tiled=False))
                    + jnp.sum(rt.all_gather(h.sum(0), tiled=False) ** 2) * 0.01)
        return jax.grad(loss)(w)

    def theirs(w, x):
        def loss(w):
            h = jnp.tanh(x @ w)
            return (jnp.mean(h * lax.ppermute(h, "batch", ring))
                    + jnp.sum(lax.psum_scatter(h[:N], "batch"))
                    + jnp.sum(lax.all_gather(h.sum(0), "batch") ** 2) * 0.01)
        return lax.pmean(jax.grad(loss)(w), "batch")   # ours: the mean all-reduce is automatic

    want = jax.pmap(theirs, axis_name="batch", in_axes=(None, 0))(W, X)
    got = rt.replicate(ours, num_replicas=N)(W, per(X))
    assert_allclose(np.asarray(got), np.asarray(want[0]), rtol=1e-4, atol=1e-5)


def test_all_to_all_bad_axis_is_a_clear_error():
    with pytest.raises(ValueError, match=r"all_to_all: split_axis 3 is out of range"):
        rt.replicate(lambda x: rt.all_to_all(x, 3, 0), num_replicas=N)(per(X))


# -- returned containers keep their type -------------------------------------------------------
class Metrics(dict):
    """A dict subclass, as metric collections often are."""


def test_dict_subclass_result_keeps_its_type():
    got = rt.replicate(lambda x: Metrics(loss=x.mean(), n=x.shape[0]), num_replicas=N)(per(X))
    assert type(got) is Metrics          # per-replica leaves inside the user's container
    assert isinstance(got["loss"], rt.PerReplica) and int(got["n"]) == 8
    for r in range(N):
        assert_allclose(np.asarray(got["loss"].values[r]), X[r].mean(), rtol=1e-5)


def test_flax_struct_dataclass_result_keeps_its_type():
    from flax import struct

    @struct.dataclass
    class State:
        w: jax.Array
        step: jax.Array

    def fn(s, x):
        return State(w=s.w - 0.1 * jnp.mean(x @ s.w), step=s.step + 1)

    out = rt.replicate(fn, num_replicas=N)(State(w=W, step=jnp.int32(0)), per(X))
    assert type(out) is State and int(out.step) == 1
    for r in range(N):
        assert_allclose(np.asarray(out.w.values[r]), W - 0.1 * np.mean(X[r] @ W), rtol=1e-5)


def test_nnx_state_and_equinox_module_results_keep_their_types():
    import equinox as eqx
    from flax import nnx

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    _, state = nnx.split(model)
    out = rt.replicate(lambda s: jax.tree.map(lambda a: a * 2, s), num_replicas=N)(state)
    assert type(out) is type(state)
    assert_allclose(np.asarray(out["kernel"][...]), 2 * np.asarray(model.kernel[...]), rtol=1e-6)

    lin = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    got = rt.replicate(lambda m: jax.tree.map(lambda a: a + 1, m), num_replicas=N)(lin)
    assert type(got) is eqx.nn.Linear
    assert_allclose(np.asarray(got.weight), np.asarray(lin.weight) + 1, rtol=1e-6)


def test_per_replica_refuses_to_unpack():
    with pytest.raises(TypeError, match=r"cannot be iterated or unpacked"):
        a, b = rt.distribute((X[:2].reshape(16, 3), X[2:].reshape(16, 3)), 2)
