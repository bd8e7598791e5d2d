"""Dynamic shapes for CNNs, RNNs and cumulative ops (issue 11): a convolution whose padded
dim is only the batch, an RNN ``scan`` over time whose carry holds a padded batch, and
the gradients of cumprod / cummax / cummin / cumlogsumexp over the padded axis.

Oracle: ``jax.jit`` on each replica's own unpadded data (results), and the mean over
replicas of those gradients (TF's semantics); the padding holds NaN (``_pad_host``
replaced), so any padded element that reached a real result would show. Sizes fall
inside their buckets (5 and 7 rows pad to 8, 3 to 4), not only at a bucket's edge.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from numpy.testing import assert_allclose

import runtime as rt
from compiler.passes.padding import PaddingError

SIZES = {1: (5,), 2: (5, 7), 4: (5, 7, 3, 8)}


def _nan_padded(arrs, shape, dtype, n):
    buf = np.full((n,) + shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype)
    for r, a in enumerate(arrs):
        buf[(r,) + tuple(slice(0, d) for d in a.shape)] = a
    return buf.reshape((n * shape[0],) + shape[1:]) if shape else buf


@pytest.fixture(autouse=True)
def nan_padding(monkeypatch):
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)


def _check(loss, params, xs, n, rtol=2e-5, atol=2e-5):
    """Per replica: ``loss(params, x)`` and its gradient; through replicate (the gradient
    all-reduced, mean) against each replica's own unpadded jit."""
    def step(p, x):
        return loss(p, x), jax.grad(loss)(p, x)

    got_l, got_g = rt.replicate(step, num_replicas=n,
                                options=rt.RunOptions(dynamic_shapes=True))(params, rt.PerReplica(xs))
    ref = jax.jit(step)
    want = [ref(params, x) for x in xs]
    ls = got_l.values if isinstance(got_l, rt.PerReplica) else [got_l] * n
    for r in range(n):
        assert_allclose(np.asarray(ls[r]), np.asarray(want[r][0]), rtol=rtol, atol=atol)
    want_g = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[w[1] for w in want])
    jax.tree.map(lambda g, w: assert_allclose(np.asarray(g), w, rtol=rtol, atol=atol),
                 got_g, want_g)


# -- a CNN whose only dynamic dim is the batch ---------------------------------------------
def _cnn_loss(p, x):
    """Two convolutions (NHWC, SAME and VALID, a strided one), relu, global average pool,
    a dense head: the batch dim is the only padded one; the mean over rows is masked."""
    h = lax.conv_general_dilated(x, p["k1"], (1, 1), "SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(h + p["b1"])
    h = lax.conv_general_dilated(h, p["k2"], (2, 2), "VALID",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    logits = jnp.mean(jax.nn.relu(h), axis=(1, 2)) @ p["w"]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[:, 0])


@pytest.mark.parametrize("n", [1, 2])
def test_cnn_over_a_padded_batch(n):
    rng = np.random.default_rng(0)
    p = {"k1": rng.normal(size=(3, 3, 2, 4)).astype(np.float32) * 0.3,
         "b1": np.zeros(4, np.float32),
         "k2": rng.normal(size=(2, 2, 4, 4)).astype(np.float32) * 0.3,
         "w": rng.normal(size=(4, 3)).astype(np.float32)}
    xs = [rng.normal(size=(s, 6, 6, 2)).astype(np.float32) for s in SIZES[n]]
    _check(_cnn_loss, p, xs, n)


@pytest.mark.parametrize("pool", ["avg_pool", "max_pool"])
def test_flax_conv_over_a_padded_batch(pool):
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(4, (3, 3))(x))
            # a window over H, W (not padded); max_pool's gradient is select_and_scatter_add
            x = getattr(nn, pool)(x, (2, 2), strides=(2, 2))
            return nn.Dense(2)(x.reshape(x.shape[0], -1))

    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(s, 4, 4, 1)).astype(np.float32) for s in (5, 7)]
    params = CNN().init(jax.random.PRNGKey(0), xs[0])
    _check(lambda p, x: jnp.mean(CNN().apply(p, x) ** 2), params, xs, 2)


def test_convolution_window_over_the_padded_dim_is_a_clear_error():
    def f(x):   # x: [b, 8] -> a 1-D convolution along b, the padded dim
        return lax.conv_general_dilated(x.T[None], jnp.ones((1, 8, 3)), (1,), "VALID")

    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(PaddingError, match=r"padding: conv_general_dilated .*"
                                           r"test_dynamic_models\.py:\d+"):
        step(rt.PerReplica([np.ones((5, 8), np.float32), np.ones((7, 8), np.float32)]))


def test_pooling_window_over_the_padded_dim_is_a_clear_error():
    def f(x):   # a window of 2 rows along the padded batch dim
        return lax.reduce_window(x, 0.0, lax.add, (2, 1), (1, 1), "SAME")

    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(PaddingError, match=r"reduce_window_sum slides a window along the padded "
                                           r"\(dynamic\) axis 0 .*test_dynamic_models\.py:\d+"):
        step(rt.PerReplica([np.ones((5, 8), np.float32), np.ones((7, 8), np.float32)]))


# -- an RNN scanning over time, its carry a padded batch -----------------------------------
def _rnn_loss(p, x):
    """x: [batch, time, features]; scan over time (static), carry [batch, hidden]."""
    def cell(h, xt):
        h = jnp.tanh(xt @ p["wx"] + h @ p["wh"] + p["b"])
        return h, h
    h0 = jnp.zeros((x.shape[0], p["wh"].shape[0]), x.dtype)
    h, hs = lax.scan(cell, h0, jnp.swapaxes(x, 0, 1))
    return jnp.mean((h @ p["wo"]) ** 2) + 0.1 * jnp.mean(hs ** 2)


@pytest.mark.parametrize("n", [1, 2])
def test_rnn_scan_over_time_with_a_padded_batch_carry(n):
    rng = np.random.default_rng(2)
    p = {"wx": rng.normal(size=(3, 5)).astype(np.float32) * 0.5,
         "wh": rng.normal(size=(5, 5)).astype(np.float32) * 0.5,
         "b": np.zeros(5, np.float32), "wo": rng.normal(size=(5, 2)).astype(np.float32)}
    xs = [rng.normal(size=(s, 6, 3)).astype(np.float32) for s in SIZES[n]]
    _check(_rnn_loss, p, xs, n)


def test_flax_lstm_over_a_padded_batch():
    import flax.linen as nn

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.RNN(nn.OptimizedLSTMCell(6))(x)[:, -1] @ jnp.ones((6, 1))

    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(s, 4, 3)).astype(np.float32) for s in (5, 7)]
    params = Encoder().init(jax.random.PRNGKey(0), xs[0])
    _check(lambda p, x: jnp.mean(Encoder().apply(p, x) ** 2), params, xs, 2)


# -- cumulative ops over the padded axis: results and gradients ------------------------------
CUMULATIVE = {
    "cumsum": lambda v: jnp.cumsum(v, axis=0),
    "cumprod": lambda v: jnp.cumprod(v, axis=0),
    "cummax": lambda v: lax.cummax(v, axis=0),
    "cummin": lambda v: lax.cummin(v, axis=0),
    "cumlogsumexp": lambda v: lax.cumlogsumexp(v, axis=0),
    "cumprod-reverse": lambda v: lax.cumprod(v, axis=0, reverse=True),
    "cummax-reverse": lambda v: lax.cummax(v, axis=0, reverse=True),
    "cumlogsumexp-reverse": lambda v: lax.cumlogsumexp(v, axis=0, reverse=True),
    "cumprod-static-axis": lambda v: jnp.cumprod(v, axis=1),
    "cummax-vmapped": lambda v: jax.vmap(lambda c: lax.cummax(c, axis=0), in_axes=1,
                                         out_axes=1)(v),
}


@pytest.mark.parametrize("name", sorted(CUMULATIVE))
@pytest.mark.parametrize("n", [1, 2])
def test_cumulative_ops_and_their_gradients_over_the_padded_axis(name, n):
    f = CUMULATIVE[name]

    def loss(w, x):
        # x * w keeps the values away from ties (cummax's derivative at a tie depends on
        # the scan's tree, which differs with the length)
        return jnp.sum(jnp.tanh(f(x * w))) / x.shape[0]

    rng = np.random.default_rng(4)
    w = (1.0 + 0.1 * rng.normal(size=(3,))).astype(np.float32)
    xs = [(0.5 + rng.random(size=(s, 3))).astype(np.float32) for s in SIZES[n]]
    _check(loss, w, xs, n, rtol=1e-4, atol=1e-5)


def test_second_derivative_of_cumprod_is_refused_clearly():
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jax.grad(lambda w: jnp.sum(jnp.cumprod(x * w, 0)))(w)))(w)

    with pytest.raises(NotImplementedError, match="Differentiation rule for 'cumulative_(jvp|vjp)'"):
        rt.replicate(step, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))(
            np.ones(3, np.float32), rt.PerReplica([np.ones((5, 3), np.float32)] * 2))


def test_static_path_keeps_jax_rules_for_cumulative_ops():
    """Without dynamic shapes the step's jaxpr differentiates cumprod with JAX's own rule
    (no cumulative_jvp op in the IR)."""
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.cumprod(x * w, 0)))(w)

    lowered = rt.replicate(step, num_replicas=2).lower(
        np.ones(3, np.float32), rt.PerReplica([np.ones((5, 3), np.float32)] * 2))
    names = {op.name for op in lowered.ir(after="import").ops}
    assert "cumulative_jvp" not in names and "cumulative_vjp" not in names
