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


def _check(loss, params, xs, n, rtol=2e-5, atol=2e-5, wrt_x=False):
    """Per replica: ``loss(params, x)`` and its gradient; through replicate (the gradient
    all-reduced, mean) against each replica's own unpadded jit. With ``wrt_x`` also the
    gradient with respect to the (padded) input, per replica and sliced to its size."""
    def step(p, x):
        if wrt_x:
            return (loss(p, x),) + jax.grad(loss, argnums=(0, 1))(p, x)
        return loss(p, x), jax.grad(loss)(p, x)

    got = rt.replicate(step, num_replicas=n,
                       options=rt.RunOptions(dynamic_shapes=True))(params, rt.PerReplica(xs))
    ref = jax.jit(step)
    want = [ref(params, x) for x in xs]
    ls = got[0].values if isinstance(got[0], rt.PerReplica) else [got[0]] * n
    for r in range(n):
        assert_allclose(np.asarray(ls[r]), np.asarray(want[r][0]), rtol=rtol, atol=atol)
    want_g = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *[w[1] for w in want])
    jax.tree.map(lambda g, w: assert_allclose(np.asarray(g), w, rtol=rtol, atol=atol),
                 got[1], want_g)
    if wrt_x:
        gx = got[2].values if isinstance(got[2], rt.PerReplica) else [got[2]] * n
        for r in range(n):
            assert gx[r].shape == xs[r].shape
            assert_allclose(np.asarray(gx[r]), np.asarray(want[r][2]), rtol=rtol, atol=atol)


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
    _check(_cnn_loss, p, xs, n, wrt_x=True)


@pytest.mark.parametrize("n", [1, 2])
def test_depthwise_and_grouped_convolutions_over_a_padded_batch(n):
    """feature_group_count splits the features, never the batch: a depthwise (MobileNet)
    and a grouped convolution are exact over a padded batch; their kernel gradients are
    JAX's convolutions with batch_group_count, contracting over the (masked) batch."""
    import flax.linen as nn

    class DepthwiseCNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(4, (3, 3))(x))
            x = nn.relu(nn.Conv(4, (3, 3), feature_group_count=4)(x))     # depthwise
            x = nn.Conv(6, (1, 1), feature_group_count=2)(x)               # grouped
            return jnp.mean(x, axis=(1, 2))

    rng = np.random.default_rng(5)
    xs = [rng.normal(size=(s, 5, 5, 2)).astype(np.float32) for s in SIZES[n]]
    params = DepthwiseCNN().init(jax.random.PRNGKey(0), xs[0])
    _check(lambda p, x: jnp.mean(DepthwiseCNN().apply(p, x) ** 2), params, xs, n, wrt_x=True)


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


def test_rnn_scan_along_a_padded_time_axis_is_a_clear_error():
    """The time axis dynamic (``dynamic_dims``): the scan would step through the padding
    and its final carry would include it, so it is refused, naming scan and the line."""
    rng = np.random.default_rng(2)
    p = {"wx": rng.normal(size=(3, 5)).astype(np.float32) * 0.5,
         "wh": rng.normal(size=(5, 5)).astype(np.float32) * 0.5,
         "b": np.zeros(5, np.float32), "wo": rng.normal(size=(5, 2)).astype(np.float32)}
    opts = rt.RunOptions(dynamic_shapes=True, dynamic_dims={1: {1: "t"}})
    step = rt.replicate(lambda p, x: jax.grad(_rnn_loss)(p, x), num_replicas=2, options=opts)
    xs = [rng.normal(size=(4, t, 3)).astype(np.float32) for t in (5, 7)]
    with pytest.raises(PaddingError, match=r"padding: scan steps along a padded \(dynamic\) "
                                           r"axis of its input f32\[t,4,3\].*"
                                           r"test_dynamic_models\.py:\d+"):
        step(p, rt.PerReplica(xs))


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
    "cumsum-reverse": lambda v: lax.cumsum(v, axis=0, reverse=True),
    "cummin-reverse": lambda v: lax.cummin(v, axis=0, reverse=True),
    # ties: JAX's derivative splits them by the associative scan's tree; reversed, the
    # padding (first once flipped) would shift that tree, so the pass rolls it out of the way
    "cummax-cummin-ties": lambda v: lax.cummax(v, axis=0) + lax.cummin(v, axis=0),
    "cummax-cummin-reverse-ties": lambda v: (lax.cummax(v, axis=0, reverse=True)
                                             + 2 * lax.cummin(v, axis=0, reverse=True)),
    "cumprod-static-axis": lambda v: jnp.cumprod(v, axis=1),
    "others-static-axis": lambda v: (jnp.cumsum(v, axis=1) + lax.cummax(v, axis=1)
                                     + lax.cummin(v, axis=1, reverse=True)
                                     + lax.cumlogsumexp(v, axis=1)),
    "cummax-vmapped": lambda v: jax.vmap(lambda c: lax.cummax(c, axis=0), in_axes=1,
                                         out_axes=1)(v),
}


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_cumulative_ops_and_their_gradients_over_the_padded_axis":
        # every op on 1 and 2 replicas with --long; else each on one of them, in turn
        # (both paths visited by the family; the suite keeps to its 10 minutes)
        long = metafunc.config.getoption("--long")
        metafunc.parametrize("name,n", [(name, n) for i, name in enumerate(sorted(CUMULATIVE))
                                        for n in (1, 2) if long or n == 1 + i % 2])


def test_cumulative_ops_and_their_gradients_over_the_padded_axis(name, n):
    f = CUMULATIVE[name]

    def loss(w, x):
        # weighted by position so that each output's gradient differs
        pos = 1.0 + jnp.arange(x.shape[0], dtype=x.dtype)[:, None] / 4
        return jnp.sum(jnp.tanh(f(x * w)) * pos) / x.shape[0]

    rng = np.random.default_rng(4)
    w = (1.0 + 0.1 * rng.normal(size=(3,))).astype(np.float32)
    if name.endswith("-ties"):   # few distinct values: many ties in every column
        xs = [(0.5 + np.round(2 * rng.random(size=(s, 3)))).astype(np.float32)
              for s in SIZES[n]]
    else:
        xs = [(0.5 + rng.random(size=(s, 3))).astype(np.float32) for s in SIZES[n]]
    _check(loss, w, xs, n, rtol=1e-4, atol=1e-5, wrt_x=True)


def test_reverse_cummax_with_ties_inside_an_rnn_scan():
    """The roll of a reverse cumulative derivative inside a scan body (a padded region)."""
    def loss(w, x):   # x: [batch, time, 3]; per step a reverse cummax over the batch
        def cell(h, xt):
            h = jnp.tanh(lax.cummax(xt * w, axis=0, reverse=True) + 0.5 * h)
            return h, jnp.sum(h * jnp.arange(1.0, 4.0))
        return jnp.sum(lax.scan(cell, jnp.zeros((x.shape[0], 3)), jnp.swapaxes(x, 0, 1))[1])

    rng = np.random.default_rng(6)
    xs = [np.round(2 * rng.random(size=(s, 4, 3))).astype(np.float32) for s in SIZES[2]]
    _check(loss, np.ones(3, np.float32), xs, 2, rtol=1e-4, atol=1e-5, wrt_x=True)


@pytest.mark.parametrize("n", [1, 2])
def test_forward_mode_of_cumulative_ops_over_the_padded_axis(n):
    """``jax.jvp`` (forward mode) of cumprod / cumlogsumexp / reverse cummax: the
    tangents of the real rows."""
    def step(x, t):
        f = lambda v: (jnp.cumprod(v, 0), lax.cumlogsumexp(v, 0),  # noqa: E731
                       lax.cummax(v, 0, reverse=True))
        return jax.jvp(f, (x,), (t,))[1]

    rng = np.random.default_rng(7)
    xs = [(0.5 + rng.random(size=(s, 3))).astype(np.float32) for s in SIZES[n]]
    ts = [rng.normal(size=(s, 3)).astype(np.float32) for s in SIZES[n]]
    got = rt.replicate(step, num_replicas=n, options=rt.RunOptions(dynamic_shapes=True))(
        rt.PerReplica(xs), rt.PerReplica(ts))
    for r in range(n):
        want = jax.jit(step)(xs[r], ts[r])
        for g, w_ in zip(got, want):
            assert_allclose(np.asarray(g.values[r]), np.asarray(w_), rtol=1e-4, atol=1e-5)


def test_second_derivative_of_cumprod_is_refused_clearly():
    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jax.grad(lambda w: jnp.sum(jnp.cumprod(x * w, 0)))(w)))(w)

    with pytest.raises(NotImplementedError,
                       match=r"dynamic shapes: tracing step at test_dynamic_models\.py:\d+ "
                             r"with dynamic dims \(b\) differentiates the derivative of "
                             r"cumprod, .*\(cumulative_(jvp|vjp): .*take one derivative"):
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
