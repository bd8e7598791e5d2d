"""Dynamic shapes (issue 4): trace once with symbolic dims, pad to buckets, mask, unpad.
Oracle: each replica's unpadded computation through plain ``jax.jit``."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import runtime as rt
from compiler.passes.padding import PaddingError
from runtime.dynamic import AutoBuckets, distribute_uneven, make_bucketer

N = 4


def _layernorm(x):
    m = jnp.mean(x, axis=0, keepdims=True)
    v = jnp.var(x, axis=0, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5)


def _attention(x):
    q, k, v = x[:, :4], x[:, 4:8], x[:, 8:12]
    s = q @ k.T / 2.0
    return jax.nn.softmax(s, axis=-1) @ v


FUNCS = {
    "sum": lambda x: jnp.sum(x, axis=0),
    "sum_all": lambda x: jnp.sum(x),
    "max": lambda x: jnp.max(x, axis=0),
    "min": lambda x: jnp.min(x, axis=0),
    "prod": lambda x: jnp.prod(1.0 + 0.01 * x, axis=0),
    "argmax": lambda x: jnp.argmax(x, axis=0),
    "argmin": lambda x: jnp.argmin(x, axis=0),
    "mean": lambda x: jnp.mean(x, axis=0),
    "mean_all": lambda x: jnp.mean(x),
    "logsumexp": lambda x: jax.nn.logsumexp(x, axis=0),
    "var": lambda x: jnp.var(x, axis=0),
    "std": lambda x: jnp.std(x),
    "cumsum": lambda x: jnp.cumsum(x, axis=0),
    "cummax": lambda x: jax.lax.cummax(x, axis=0),
    "sort": lambda x: jnp.sort(x, axis=0),
    "argsort": lambda x: jnp.argsort(x[:, 0]),
    "softmax": lambda x: jax.nn.softmax(x, axis=0),
    "softmax_rows": lambda x: jax.nn.softmax(x, axis=1),
    "layernorm": _layernorm,
    "gram": lambda x: x.T @ x,
    "attention": _attention,
    "elementwise": lambda x: jnp.tanh(x) * 3 + 1,
    "gather": lambda x: x[jnp.array([0, 0, 0])] + jnp.take(x, jnp.zeros((2,), jnp.int32), axis=0).sum(),
    "column": lambda x: x[:, 2] * 2,
    "reshape": lambda x: x.reshape(x.shape[0], 4, 4).sum(-1),
    "stack": lambda x: jnp.stack([x, jnp.sin(x)], 1).sum(0) + jnp.stack([x, x], 0).mean(1),
    # a key per row (jax.random.split over the padded axis), used per row
    "keys_per_row": lambda x: x * jax.vmap(lambda k, r: jax.random.bernoulli(k, 0.5, r.shape))(
        jax.random.split(jax.random.PRNGKey(0), x.shape[0]), x),
}


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_differential(name):
    f = FUNCS[name]
    step = rt.replicate(f, num_replicas=N, options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(sorted(FUNCS).index(name))
    # fixed edge cases (a size-1 replica, one at a bucket boundary) and random real sizes
    for sizes in [(5, 7, 3, 8), (1, 2, 16, 9), tuple(rng.integers(1, 65, size=N))]:
        xs = [rng.normal(size=(n, 16)).astype(np.float32) for n in sizes]
        out = step(rt.PerReplica(xs))
        vals = out.values if isinstance(out, rt.PerReplica) else [out] * N
        for r, x in enumerate(xs):
            want = jax.jit(f)(x)
            np.testing.assert_allclose(np.asarray(vals[r]), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_gradient_mean_over_replicas_of_own_mean():
    def step_fn(w, x, y):
        loss = lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2)
        return jax.grad(loss)(w), loss(w)
    step = rt.replicate(step_fn, num_replicas=N, options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(1)
    w = rng.normal(size=(16, 3)).astype(np.float32)
    sizes = (10, 3, 7, 1)
    xs = [rng.normal(size=(n, 16)).astype(np.float32) for n in sizes]
    ys = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
    g, losses = step(w, rt.PerReplica(xs), rt.PerReplica(ys))
    ref = [jax.jit(step_fn)(w, x, y) for x, y in zip(xs, ys)]
    np.testing.assert_allclose(g, np.mean([r[0] for r in ref], 0), rtol=1e-5, atol=1e-6)
    for r in range(N):
        np.testing.assert_allclose(losses.values[r], ref[r][1], rtol=1e-5)


def test_uneven_distribute_and_output_lengths():
    step = rt.replicate(lambda x: x * 2, num_replicas=N, options=rt.RunOptions(dynamic_shapes=True))
    x = np.arange(30, dtype=np.float32).reshape(15, 2)
    out = step(distribute_uneven(x, N))
    assert [v.shape[0] for v in out.values] == [4, 4, 4, 3]
    assert rt.distribute_uneven is distribute_uneven
    np.testing.assert_allclose(np.concatenate(out.values), x * 2)


def test_pow2_compiles_at_most_11_and_never_retraces():
    step = rt.replicate(lambda x: jnp.mean(x, axis=0), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True, max_compiles_warning=None))
    rng = np.random.default_rng(2)
    seen = []
    for _ in range(40):
        n = int(rng.integers(1, 1025))
        seen.append(n)
        step(rt.PerReplica([np.ones((n, 2), np.float32), np.ones((max(1, n // 3), 2), np.float32)]))
    info = step.cache_info()
    assert info.misses <= 11
    before = info.misses
    step(rt.PerReplica([np.ones((seen[0], 2), np.float32)] * 2))
    assert step.cache_info().misses == before
    assert len(step._dynamic.traces) == 1  # one trace per symbolic signature


def test_maximum_shapes_error_and_cap():
    opts = rt.RunOptions(dynamic_shapes=True, maximum_shapes=[(100, None)])
    step = rt.replicate(lambda x: x + 1, num_replicas=2, options=opts)
    with pytest.raises(ValueError, match=r"size 101 .*bound 100"):
        step(rt.PerReplica([np.ones((101, 2), np.float32), np.ones((3, 2), np.float32)]))
    out = step(rt.PerReplica([np.ones((99, 2), np.float32), np.ones((3, 2), np.float32)]))
    assert out.values[0].shape == (99, 2)
    assert step.cache_info().misses == 1


def test_bucketers():
    assert make_bucketer("pow2")(5, None) == 8 and make_bucketer("pow2")(100, 100) == 100
    assert make_bucketer("none")(5, 64) == 64
    with pytest.raises(ValueError, match="maximum_shapes"):
        make_bucketer("none")(5, None)
    assert make_bucketer([4, 16, 64])(5, None) == 16
    with pytest.raises(ValueError, match="largest bucket 64"):
        make_bucketer([4, 16, 64])(65, None)
    assert make_bucketer(lambda n: n + 3)(5, None) == 8
    a = AutoBuckets()
    assert a(100) == 112 and a(90) == 112 and a(60) == 64 and a(113) == 128


def test_scan_over_padded_axis_is_a_clear_error():
    def f(x):
        return jax.lax.scan(lambda c, xt: (c + xt, c), jnp.zeros(x.shape[1:]), x)[0]
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"padding: scan .*test_dynamic.py:\d+"):
        step(rt.PerReplica([np.ones((5, 2), np.float32)] * 2))


@pytest.mark.parametrize("name,f", [
    ("reduce_scatter", lambda x: rt.psum_scatter(x, 1)),
    ("reduce_scatter", lambda x: jax.lax.psum_scatter(x, "replica", scatter_dimension=1,
                                                      tiled=True)),
    ("all_gather_invariant", lambda x: rt.all_gather(x, axis=1)),  # (rt.all_gather's op)
    ("all_to_all", lambda x: rt.all_to_all(x, 1, 1)),
    ("ppermute", lambda x: rt.ppermute(x, [(0, 1), (1, 0)])),
    ("all_reduce", lambda x: rt.all_reduce(x, "max")),
], ids=["psum_scatter", "lax.psum_scatter", "all_gather", "all_to_all", "ppermute", "pmax"])
def test_collectives_over_a_padded_axis_are_a_clear_error(name, f):
    """Replicas hold different real sizes in one bucket: a collective over a value with a
    padded axis would combine one replica's real rows with another's padding. Before, a
    reduce-scatter over the static dim of a [b, 4] batch ran and summed replica 0's third
    row with replica 1's padding (sizes 3 and 2); every collective is now the
    ``PaddingError`` naming the op and the line. Reduced over the padded axis first, the
    same collective is exact (the oracle: the replicas' own sums, by hand)."""
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    xs = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 4), np.float32)]
    with pytest.raises(ValueError, match=rf"padding: {name} over a value with a padded "
                                         rf"\(dynamic\) dim \['b'\] .*test_dynamic.py:\d+"):
        step(rt.PerReplica(xs))
    exact = rt.replicate(lambda x: rt.psum_scatter(x.sum(0), 0), num_replicas=2,
                         options=rt.RunOptions(dynamic_shapes=True))(rt.PerReplica(xs))
    total = xs[0].sum(0) + xs[1].sum(0)
    np.testing.assert_allclose(np.concatenate([np.asarray(v) for v in exact.values]), total)


def test_flip_is_a_clear_error():
    step = rt.replicate(lambda x: jnp.flip(x, 0), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"rev .*padded axis 0"):
        step(rt.PerReplica([np.ones((5, 2), np.float32)] * 2))


def test_warns_once_after_max_compiles(caplog):
    step = rt.replicate(lambda x: x * 1, num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True, bucketing=[1, 2, 3, 4],
                                              max_compiles_warning=2))
    with pytest.warns(RuntimeWarning, match="max_compiles_warning=2"):
        for n in (1, 2, 3):
            step(rt.PerReplica([np.ones((n,), np.float32)] * 2))


def test_golden_ir_dump():
    def loss_step(w, x):
        return jax.grad(lambda w: jnp.mean(jax.nn.softmax(x @ w, axis=0)))(w)
    step = rt.replicate(loss_step, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, maximum_shapes=[None, (128, None)]))
    w = np.ones((16, 4), np.float32)
    lowered = step.lower(w, rt.PerReplica([np.ones((5, 16), np.float32), np.ones((9, 16), np.float32)]))
    text = _check_golden("padding_softmax_grad.txt", lowered, ("import", "padding"))
    assert "f32[b<=128,16] varying" in text and "pad_mask" in text and "dim_value" in text


def _check_golden(name: str, lowered, passes) -> str:
    """The IR after ``passes`` (every one round-trips through the parser), with source
    files and line numbers normalized, equals ``tests/golden/<name>`` (``UPDATE_GOLDEN=1``
    rewrites it). Any file: JAX caches a combiner region (a scatter-add's ``add``) with
    the location of the first trace that made it, which may be another test file's."""
    import re
    from irtest import check_golden, check_roundtrip
    parts = [f"// {p}\n{check_roundtrip(lowered.ir(after=p))}\n" for p in passes]
    text = re.sub(r"\b\w+\.py:\d+", "model.py:N", "".join(parts))
    return check_golden(name, text)


def test_static_path_untouched():
    step = rt.replicate(lambda x: x + 1, num_replicas=2)
    assert step._dynamic is None


def test_jax_array_inputs_and_sequence_axis_attention():
    def attn(x):  # x: [batch, T, 12], T dynamic
        q, k, v = x[..., :4], x[..., 4:8], x[..., 8:12]
        s = jnp.einsum("btd,bsd->bts", q, k) / 2.0
        o = jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), v)
        return o, jnp.mean(o, axis=1)
    step = rt.replicate(attn, num_replicas=N, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={0: {1: "t"}}))
    rng = np.random.default_rng(3)
    xs = [jnp.asarray(rng.normal(size=(2, t, 12)).astype(np.float32)) for t in (3, 9, 5, 1)]
    o, m = step(rt.PerReplica(xs))
    for r, x in enumerate(xs):
        want_o, want_m = jax.jit(attn)(x)
        assert o.values[r].shape == want_o.shape
        np.testing.assert_allclose(o.values[r], want_o, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m.values[r], want_m, rtol=1e-5, atol=1e-6)


def test_logical_devices_dynamic():
    step = rt.replicate(lambda x: jnp.mean(x, axis=0), num_replicas=2, logical_devices=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    xs = [np.arange(10, dtype=np.float32).reshape(5, 2), np.ones((3, 2), np.float32)]
    out = step(rt.PerReplica(xs))
    for r, x in enumerate(xs):
        np.testing.assert_allclose(out.values[r], x.mean(0), rtol=1e-5)


@pytest.mark.parametrize("bucketing", ["pow2", "auto"])
@pytest.mark.parametrize("k, sizes", [(2, (1, 1)), (4, (1, 2)), (2, (3, 5))])
def test_builtin_buckets_divide_by_the_logical_devices_a_padded_axis_is_split_over(
        bucketing, k, sizes):
    """A padded batch axis split over K logical devices: ``pow2`` and ``auto`` buckets are
    rounded up to a multiple of K, so every size works (before: replicas of one row got
    bucket 1, a ``PaddingError`` telling the user to choose ``bucketing='pow2'``, which
    was in use). Oracle: ``jax.jit`` on each replica's real rows; the bucket's padding
    does not reach the results."""
    w = np.arange(32, dtype=np.float32).reshape(8, 4) / 10

    def step(w, x):
        return jnp.tanh(rt.split_to_logical_devices(x, [k, 1]) @ w)
    rep = rt.replicate(step, num_replicas=2, logical_devices=k,
                       options=rt.RunOptions(dynamic_shapes=True, bucketing=bucketing))
    xs = [np.linspace(-1, 1, s * 8, dtype=np.float32).reshape(s, 8) for s in sizes]
    out = rep(w, rt.PerReplica(xs))
    for r, x in enumerate(xs):
        assert out.values[r].shape == (sizes[r], 4)
        np.testing.assert_allclose(out.values[r], jax.jit(lambda w, x: jnp.tanh(x @ w))(w, x),
                                   rtol=1e-6)


@pytest.mark.parametrize("axis", [-1, 1])
def test_gradient_through_a_stack_beside_the_padded_axis(axis):
    """``jnp.stack`` on another axis than the padded one: its transpose, ``unstack``,
    keeps the padded axis (before: a ``PaddingError``; the gradient of
    ``optax.sigmoid_focal_loss`` failed so). Oracle: ``jax.jit`` on each replica's real
    rows; the gradient is their mean."""
    def step(w, x):
        parts = jnp.unstack(jnp.stack([x @ w, jnp.tanh(x @ w) * 2], axis=axis), axis=axis)
        return jax.grad(lambda w: jnp.sum(jnp.stack([x @ w, parts[1]], axis=axis) ** 2))(w)
    w = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
    xs = [np.arange(15, dtype=np.float32).reshape(5, 3) / 10, np.ones((7, 3), np.float32)]
    got = rt.replicate(step, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))(
        w, rt.PerReplica(xs))
    want = np.mean([np.asarray(jax.jit(step)(w, x)) for x in xs], 0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_mismatched_sizes_within_a_replica():
    step = rt.replicate(lambda x, y: x + y, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"replica 1 has size 4 .* but 3 along axis 0 of argument 0"):
        step(rt.PerReplica([np.ones(3, np.float32)] * 2),
             rt.PerReplica([np.ones(3, np.float32), np.ones(4, np.float32)]))


def _count_plans(monkeypatch, step):
    """Count how often the dynamic path validates and buckets a call (its slow part)."""
    calls = []
    plan = step._dynamic.plan
    monkeypatch.setattr(step._dynamic, "plan", lambda args: (calls.append(1), plan(args))[1])
    return calls


def _mlp_step(w, x, y):
    loss = lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2)  # noqa: E731
    return jax.grad(loss)(w), loss(w)


def _check_mlp(out, w, xs, ys):
    """Loss per replica from jax.jit on its real rows; gradient the replicas' mean."""
    g, loss = out
    want = [jax.jit(_mlp_step)(w, x, y) for x, y in zip(xs, ys)]
    np.testing.assert_allclose(np.mean([np.asarray(v[0]) for v in want], 0), g, rtol=1e-5, atol=1e-6)
    for r, v in enumerate(want):
        np.testing.assert_allclose(float(loss.values[r]), float(v[1]), rtol=1e-5)


def test_a_bucket_is_planned_once(monkeypatch):
    """The first call of a bucket is validated and bucketed in full; later calls in that
    bucket, repeated sizes or sizes never seen, host or device arrays, go straight to its
    plan and count a hit, and their new data and sizes still go in."""
    step = rt.replicate(_mlp_step, num_replicas=N, options=rt.RunOptions(dynamic_shapes=True))
    plans = _count_plans(monkeypatch, step)
    rng = np.random.default_rng(7)
    w = rng.normal(size=(6, 3)).astype(np.float32)
    for i in range(3):
        xs = [rng.normal(size=(s, 6)).astype(np.float32) for s in (5, 7, 2, 8)]
        ys = [rng.normal(size=(s, 3)).astype(np.float32) for s in (5, 7, 2, 8)]
        _check_mlp(step(w, rt.PerReplica(xs), rt.PerReplica(ys)), w, xs, ys)
    assert len(plans) == 1
    assert step.cache_info()[:3] == (2, 1, 1)
    # new sizes in the same bucket (8): not planned again, same program, their own sizes
    xs = [rng.normal(size=(s, 6)).astype(np.float32) for s in (3, 8, 8, 1)]
    ys = [rng.normal(size=(s, 3)).astype(np.float32) for s in (3, 8, 8, 1)]
    _check_mlp(step(w, rt.PerReplica(xs), rt.PerReplica(ys)), w, xs, ys)
    assert len(plans) == 1 and step.cache_info()[:3] == (3, 1, 1)
    # the same shapes as device arrays: the same plan
    _check_mlp(step(w, rt.PerReplica([jnp.asarray(x) for x in xs]), rt.PerReplica(ys)), w, xs, ys)
    assert len(plans) == 1
    # a size past the bucket: planned in full, a new program
    xs = [rng.normal(size=(s, 6)).astype(np.float32) for s in (9, 1, 1, 1)]
    ys = [rng.normal(size=(s, 3)).astype(np.float32) for s in (9, 1, 1, 1)]
    _check_mlp(step(w, rt.PerReplica(xs), rt.PerReplica(ys)), w, xs, ys)
    assert len(plans) == 2 and step.cache_info().misses == 2


def test_a_planned_bucket_still_refuses_bad_calls(monkeypatch):
    """Once a bucket is planned, calls that differ in anything but their sizes are not
    run on its plan: a replica whose leaves disagree on the size of a dynamic dim, a
    different static dim or dtype (a new program), and a replica count that is wrong all
    get the full plan's errors or a program of their own, never the planned one."""
    step = rt.replicate(_mlp_step, num_replicas=N, options=rt.RunOptions(dynamic_shapes=True))
    plans = _count_plans(monkeypatch, step)
    rng = np.random.default_rng(3)
    w = rng.normal(size=(6, 3)).astype(np.float32)

    def batch(sizes, d=6, dtype=np.float32, y_sizes=None):
        xs = [rng.normal(size=(s, d)).astype(dtype) for s in sizes]
        ys = [rng.normal(size=(s, 3)).astype(np.float32) for s in (y_sizes or sizes)]
        return xs, ys
    xs, ys = batch((5, 7, 2, 8))
    _check_mlp(step(w, rt.PerReplica(xs), rt.PerReplica(ys)), w, xs, ys)
    xs, ys = batch((5, 7, 2, 8), y_sizes=(5, 7, 3, 8))
    with pytest.raises(ValueError, match=r"argument 2 leaf 0: replica 2 has size 3 along axis 0 "
                                         r"\(dynamic dim b\) but 2 along axis 0 of argument 1 "
                                         r"leaf 0; .*dynamic_dims=\{1: \(\)\}\) or \{2: \(\)\}"):
        step(w, rt.PerReplica(xs), rt.PerReplica(ys))
    with pytest.raises(ValueError, match="PerReplica argument 1 has 3 values but the step runs on 4"):
        step(w, rt.PerReplica(xs[:3]), rt.PerReplica(ys[:3]))
    xs, ys = batch((5, 7, 2, 8))
    xs[1] = xs[1][:, :5]
    with pytest.raises(ValueError, match=r"replica 1's value has shape \(7, 5\)"):
        step(w, rt.PerReplica(xs), rt.PerReplica(ys))
    # another static dim: its own program, whose numbers are its own
    w8 = rng.normal(size=(8, 3)).astype(np.float32)
    xs, ys = batch((5, 7, 2, 8), d=8)
    _check_mlp(step(w8, rt.PerReplica(xs), rt.PerReplica(ys)), w8, xs, ys)
    assert step.cache_info().misses == 2
    # another dtype: its own program too
    xs, ys = batch((5, 7, 2, 8))
    out = step(w, rt.PerReplica([x.astype(np.float16) for x in xs]), rt.PerReplica(ys))
    assert step.cache_info().misses == 3
    _check_mlp(out, w, [x.astype(np.float16).astype(np.float32) for x in xs], ys)


def test_pytree_values_use_the_planned_bucket(monkeypatch):
    """Per-replica values that are dicts of arrays take the quick plan as well, with the
    sizes of each replica's leaves."""
    step = rt.replicate(lambda w, b: _mlp_step(w, b["x"], b["y"]), num_replicas=N,
                        options=rt.RunOptions(dynamic_shapes=True))
    plans = _count_plans(monkeypatch, step)
    rng = np.random.default_rng(5)
    w = rng.normal(size=(6, 3)).astype(np.float32)
    for sizes in ((5, 7, 2, 8), (1, 6, 8, 3)):
        xs = [rng.normal(size=(s, 6)).astype(np.float32) for s in sizes]
        ys = [rng.normal(size=(s, 3)).astype(np.float32) for s in sizes]
        _check_mlp(step(w, rt.PerReplica([{"x": x, "y": y} for x, y in zip(xs, ys)])), w, xs, ys)
    assert len(plans) == 1 and step.cache_info()[:3] == (1, 1, 1)


def test_cache_clear_forgets_planned_calls():
    step = rt.replicate(lambda x: jnp.sum(x, 0), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    xs = [np.ones((3, 2), np.float32), np.full((5, 2), 2, np.float32)]
    step(rt.PerReplica(xs))
    step.cache_clear()
    assert not step._dynamic.planned
    out = step(rt.PerReplica(xs))
    assert step.cache_info()[:3] == (0, 1, 1)
    np.testing.assert_allclose(out.values[1], [10.0, 10.0])


def test_planned_calls_are_bounded(monkeypatch):
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "PLAN_MEMO_SIZE", 2)
    step = rt.replicate(lambda x: x * 3, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    for n in (1, 2, 3, 4, 5):
        out = step(rt.PerReplica([np.full((n, 1), n, np.float32)] * 2))
        np.testing.assert_allclose(out.values[0], np.full((n, 1), 3 * n))
    assert len(step._dynamic.planned) == 2
    assert step.cache_info().misses == 4  # buckets 1, 2, 4, 8


def test_padded_outputs_are_deferred():
    step = rt.replicate(lambda x: jnp.cumsum(x, 0), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    xs = [np.arange(3, dtype=np.float32), np.arange(6, dtype=np.float32)]
    out = jax.block_until_ready(step(rt.PerReplica(xs)))
    assert out._values is None  # nothing sliced until read
    for r, x in enumerate(xs):
        np.testing.assert_allclose(out.values[r], np.cumsum(x))
    np.testing.assert_allclose(rt.reduce("sum", out, axis=0), np.cumsum(xs[0]).sum() + np.cumsum(xs[1]).sum())


def _nan_padded(arrs, shape, dtype, n):
    """``_pad_host`` with NaN (or -1) in the padding instead of zeros."""
    buf = np.full((n,) + shape, np.nan if np.dtype(dtype).kind == "f" else -1, dtype)
    for r, a in enumerate(arrs):
        buf[(r,) + tuple(slice(0, d) for d in a.shape)] = a
    return buf.reshape((n * shape[0],) + shape[1:]) if shape else buf


def _check_padded(monkeypatch, f, shapes, seed, bound=None, padding="nan", rtol=1e-6,
                  atol=0.0, dynamic_dims=None):
    """``f`` through a dynamic ``replicate`` (one replica per shape in ``shapes``, axis 0
    bounded by ``bound``, the buckets padded with NaN or, as the runtime pads them, zeros)
    equals ``jax.jit(f)`` on each replica's exact input."""
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=s).astype(np.float32) for s in shapes]
    _check_values(monkeypatch, f, xs, bound, padding, rtol, atol, dynamic_dims)


def _check_values(monkeypatch, f, xs, bound=None, padding="nan", rtol=1e-6, atol=0.0,
                  dynamic_dims=None):
    """:func:`_check_padded` on the given inputs, one per replica (NaN compares equal)."""
    import runtime.dynamic as dyn
    if padding == "nan":
        monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    step = rt.replicate(f, num_replicas=len(xs), options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims=dynamic_dims,
        maximum_shapes=None if bound is None else [(bound, None if dynamic_dims is None else bound)]))
    out = step(rt.PerReplica(xs))
    vals = out.values if isinstance(out, rt.PerReplica) else [out] * len(xs)
    for v, x in zip(vals, xs):
        np.testing.assert_allclose(np.asarray(v), np.asarray(jax.jit(f)(x)), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", sorted(FUNCS))
def test_results_do_not_depend_on_the_padding(monkeypatch, name):
    """Every padded element is masked where it could reach a result: NaN padding (as a
    device buffer padded elsewhere might hold) gives the unpadded answers exactly."""
    _check_padded(monkeypatch, FUNCS[name], [(n, 16) for n in (5, 7, 3, 8)], 11, rtol=1e-5,
                  atol=1e-5)


def test_gradient_does_not_depend_on_the_padding(monkeypatch):
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    step = rt.replicate(_mlp_step, num_replicas=N, options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(12)
    w = rng.normal(size=(6, 3)).astype(np.float32)
    xs = [rng.normal(size=(s, 6)).astype(np.float32) for s in (5, 7, 2, 8)]
    ys = [rng.normal(size=(s, 3)).astype(np.float32) for s in (5, 7, 2, 8)]
    _check_mlp(step(w, rt.PerReplica(xs), rt.PerReplica(ys)), w, xs, ys)



# -- indexing into a padded axis: indices behave as against the real size -----------------

INDEX_FUNCS = {
    "gather_oob_index": lambda x: x[jnp.array([10])],
    "gather_mixed_indices": lambda x: x[jnp.array([4, 10, -1, 6])],
    "take_clip": lambda x: jnp.take(x, jnp.array([10, 2]), axis=0, mode="clip"),
    "take_fill": lambda x: jnp.take(x, jnp.array([6, 1, 4]), axis=0, mode="fill", fill_value=-7.0),
    "take_fill_static_axis": lambda x: jnp.take(x, jnp.array([6, 1]), axis=1, mode="fill",
                                                fill_value=-7.0),
    "last_row": lambda x: x[-1],
    "dynamic_index_oob": lambda x: jax.lax.dynamic_index_in_dim(x, 10, 0, keepdims=False),
    "dynamic_index_negative": lambda x: jax.lax.dynamic_index_in_dim(x, -1, 0, keepdims=False),
    "argmax_row": lambda x: x[jnp.argmax(x[:, 0])],
    "set_last": lambda x: x.at[-1].set(100.0).sum(0),
    "set_oob_dropped": lambda x: x.at[6].set(100.0).sum(0),
    "set_clip": lambda x: x.at[jnp.array([9])].set(100.0, mode="clip").sum(0),
    "add_clip": lambda x: x.at[jnp.array([9])].add(100.0, mode="clip").sum(0),
    "dynamic_update_oob": lambda x: jax.lax.dynamic_update_index_in_dim(
        x, jnp.full((2,), 5.0), 9, 0).sum(0),
    "segment_sum": lambda x: jax.ops.segment_sum(x, (x[:, 0] > 0).astype(jnp.int32), 2),
    "bincount": lambda x: jnp.zeros(3).at[(x[:, 0] > 0).astype(jnp.int32)].add(1.0),
    "embedding": lambda x: jnp.arange(12.0).reshape(6, 2)[(jnp.abs(x[:, 0]) * 3).astype(jnp.int32)],
}


@pytest.mark.parametrize("padding", ["zeros", "nan"])
@pytest.mark.parametrize("name", sorted(INDEX_FUNCS))
def test_indexing_a_padded_axis_matches_unpadded(monkeypatch, name, padding):
    """Out-of-range, negative and traced indices into a padded axis clamp, fill or drop
    as they would against each replica's real size (sizes 5 and 3, bucket 8), whatever
    the padding holds."""
    import runtime.dynamic as dyn
    if padding == "nan":
        monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    f = INDEX_FUNCS[name]
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(13)
    xs = [rng.normal(size=(n, 2)).astype(np.float32) for n in (5, 3)]
    out = step(rt.PerReplica(xs))
    vals = out.values if isinstance(out, rt.PerReplica) else [out] * 2
    for v, x in zip(vals, xs):
        np.testing.assert_allclose(np.asarray(v), np.asarray(jax.jit(f)(x)), rtol=1e-6)


def test_traced_index_into_a_padded_axis():
    step = rt.replicate(lambda x, i: x[i], num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    xs = [np.arange(10, dtype=np.float32).reshape(5, 2), np.arange(6, dtype=np.float32).reshape(3, 2)]
    for i in (7, 4, -1, -9):
        out = step(rt.PerReplica(xs), i)
        for v, x in zip(out.values, xs):
            np.testing.assert_allclose(v, jax.jit(lambda x, i: x[i])(x, i))
    assert step.cache_info().misses == 1


def test_golden_pad_index():
    def f(x, i):
        return jnp.take(x, jnp.array([6]), axis=0, mode="fill", fill_value=-1.0), x[i]
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, maximum_shapes=[(8, None)]))
    lowered = step.lower(rt.PerReplica([np.ones((5, 2), np.float32), np.ones((3, 2), np.float32)]), 1)
    text = _check_golden("padding_pad_index.txt", lowered, ("padding",))
    assert "mode='drop', oob=8" in text and "mode='clip', oob=0" in text


def test_scatter_clip_of_padded_rows_is_a_clear_error():
    f = lambda x: jnp.zeros((3, 2)).at[(x[:, 0] > 0).astype(jnp.int32)].add(x, mode="clip")  # noqa: E731
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"padding: scatter-add in mode 'clip' scatters padded "
                                         r"update rows \(dim \['b'\]\).*mode='drop'.*"
                                         r"\(test_dynamic.py:\d+\)"):
        step(rt.PerReplica([np.ones((5, 2), np.float32), np.ones((3, 2), np.float32)]))


@pytest.mark.parametrize("case", ["psum", "pmean", "pmax", "pmin", "psum_float", "psum_tree",
                                  "all_gather", "psum_of_mean_count"])
def test_collective_of_a_dynamic_size_sums_the_replicas_sizes(case):
    """A dynamic size is each replica's own: ``lax.psum(x.shape[0], axis)`` is the sum of
    the real sizes (5 + 3 = 8, what pmap gives on the unpadded batches), ``pmean`` their
    mean, ``pmax`` their max... Before, JAX took the symbolic size for one number on every
    replica: the sum came out ``N * b`` per replica (10 and 6, no error: flax sst2's
    ``count`` metric) and the mean ``b``."""
    def step(x):
        b = x.shape[0]
        return {"psum": lambda: lax.psum(b, "i"), "pmean": lambda: lax.pmean(b, "i"),
                "pmax": lambda: lax.pmax(b, "i"), "pmin": lambda: lax.pmin(b, "i"),
                "psum_float": lambda: lax.psum(jnp.float32(b) * 2.0, "i"),
                "psum_tree": lambda: lax.psum({"n": b, "s": jnp.sum(x)}, "i")["n"],
                "all_gather": lambda: lax.all_gather(b, "i"),
                "psum_of_mean_count": lambda: lax.psum(jnp.sum(x) / jnp.mean(x), "i")}[case]()
    xs = [np.full((n, 2), 0.5, np.float32) for n in (5, 3)]
    got = rt.replicate(step, num_replicas=2, axis_name="i",
                       options=rt.RunOptions(dynamic_shapes=True))(rt.PerReplica(xs))
    want = {"psum": 8, "pmean": 4.0, "pmax": 5, "pmin": 3, "psum_float": 16.0, "psum_tree": 8,
            "all_gather": [5, 3], "psum_of_mean_count": 16.0}[case]
    assert not isinstance(got, rt.PerReplica), got
    np.testing.assert_allclose(np.asarray(got), want)


@pytest.mark.parametrize("axes", ["b", ("b", "i")], ids=["vmap_axis", "vmap_and_replica_axes"])
def test_pmean_over_a_vmap_axis_of_dynamic_size(axes):
    """``lax.pmean`` over a ``vmap`` axis of dynamic size (equinox's
    ``BatchNorm(axis_name="batch")``), and over it and the replica axis (its
    ``axis_name=("batch", "i")``): the mean over the replica's real rows, and over every
    replica's (5 + 3 rows). Before: an error (JAX's ``psum(1, axis)`` of the count took the
    size for an ``int``), where ``psum`` over the same axes worked. Oracle: NumPy on the
    unpadded batches."""
    w = np.arange(6, dtype=np.float32).reshape(3, 2) / 4
    xs = [np.arange(15, dtype=np.float32).reshape(5, 3), np.ones((3, 3), np.float32)]

    def step(w, x):
        return jax.vmap(lambda r: lax.pmean(r @ w, axes), axis_name="b")(x)
    got = rt.replicate(step, num_replicas=2, axis_name="i",
                       options=rt.RunOptions(dynamic_shapes=True))(w, rt.PerReplica(xs))
    for x, g in zip(xs, got.values):
        rows = np.concatenate(xs) if axes != "b" else x
        want = np.broadcast_to((rows @ w).mean(0), (len(x), 2))
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


_JAX_FAILS = {  # name: (step, the per-replica inputs' shapes, dynamic_dims, JAX's words)
    "associative_scan_along_the_padded_axis": (
        lambda x: lax.associative_scan(jnp.add, x, axis=0), [(5, 3), (3, 3)], None,
        "non-constant size"),
    "strided_valid_convolution_gradient": (
        lambda x: jax.grad(lambda x: jnp.sum(lax.conv_general_dilated(
            x, jnp.ones((3, 4, 2)), (2,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))))(x),
        [(2, 5, 4), (2, 3, 4)], {0: {1: "t"}}, "padding argument"),
}


@pytest.mark.parametrize("name", sorted(_JAX_FAILS))
def test_jax_failing_on_a_dynamic_dim_names_the_line_and_the_fix(name):
    """JAX itself fails on a symbolic size while the step is traced (no padding rule is
    reached): the error names the user's line, the dynamic dims, JAX's message and
    ``dynamic_dims``. Before: JAX's message alone (found by a probe)."""
    step, shapes, dims, words = _JAX_FAILS[name]
    opts = rt.RunOptions(dynamic_shapes=True, **({"dynamic_dims": dims} if dims else {}))
    s = rt.replicate(step, num_replicas=2, options=opts)
    with pytest.raises((ValueError, NotImplementedError)) as info:
        s(rt.PerReplica([np.ones(sh, np.float32) for sh in shapes]))
    msg = str(info.value)
    assert msg.startswith("dynamic shapes: tracing <lambda> at test_dynamic.py:")
    assert words in msg and "RunOptions(dynamic_dims=...)" in msg, msg


_SIZE_LOSSES = {
    "maximum": lambda w, x: jnp.sum(x @ w) + jnp.maximum(x.shape[0], 1) * jnp.sum(w ** 2),
    "ones_sum": lambda w, x: jnp.sum(x @ w) + jnp.ones(x.shape[0]).sum() * jnp.sum(w ** 2),
    "arange_sum": lambda w, x: jnp.sum(x @ w) * jnp.arange(x.shape[0]).sum(),
    "broadcast": lambda w, x: jnp.sum(x @ jnp.broadcast_to(w, (x.shape[0], 3)).sum(0)),
    "take_at_size": lambda w, x: jnp.sum(x * jnp.take(w, x.shape[0] % 3)),
    "where_on_count": lambda w, x: jnp.sum(
        x @ jnp.where(jnp.ones(x.shape[0]).sum() > 4, w * 2, w * 3)),
    "cond_on_size": lambda w, x: jnp.sum(
        x @ lax.cond(jnp.asarray(x.shape[0]) > 4, lambda: w * 2, lambda: w * 3)),
    "slice_at_size": lambda w, x: jnp.sum(
        lax.dynamic_slice_in_dim(jnp.tile(w, 4), x.shape[0], 3) * x),
    "tile_to_size": lambda w, x: jnp.sum(jnp.tanh(jnp.tile(w, (x.shape[0], 1)) + x) ** 2),
    "constant_broadcast": lambda w, x: jnp.sum(x @ w) * lax.broadcast_in_dim(
        2.0, (x.shape[0],), ()).sum(),
    "fori_to_size": lambda w, x: jnp.sum(x @ (w * lax.fori_loop(0, x.shape[0],
                                                                 lambda i, c: c + 1.0, 0.0))),
}


@pytest.mark.parametrize("case", sorted(_SIZE_LOSSES))
def test_gradient_through_a_value_made_from_a_size(case):
    """A value computed from a dynamic size (``jnp.maximum(b, 1)``, ``jnp.ones(b).sum()``,
    ``broadcast_to(w, (b, 3))``, ``w[b % 3]``, a cond on ``b > 4``) is each replica's
    own: the mirrored weight's gradient is the sum of each replica's own gradient (oracle:
    jax.jit on each replica's unpadded rows). Before, JAX typed such values like their
    operands (the same on every replica): the gradient was summed over the replicas
    before it met each replica's own size (a gradient per replica, each wrong, no error),
    a cond on the size raised a DivergentCollectiveError, and a slice starting at the
    size failed inside JAX (found by a probe)."""
    loss = _SIZE_LOSSES[case]
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in (5, 3)]
    w = np.asarray([0.3, -0.2, 0.5], np.float32)
    step = rt.replicate(jax.grad(loss), num_replicas=2, loss_reduction="sum",
                        options=rt.RunOptions(dynamic_shapes=True))
    got = step(w, rt.PerReplica(xs))
    assert not isinstance(got, rt.PerReplica), got
    want = sum(np.asarray(jax.jit(jax.grad(loss))(w, x)) for x in xs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


_SIZE_IN_REGIONS = {
    "while_cond": lambda x: lax.while_loop(lambda c: c[0] < x.shape[0],
                                           lambda c: (c[0] + 1, c[1] * 2.0), (0, 1.0))[1],
    "while_cond_array": lambda x: lax.while_loop(
        lambda c: c[0] < jnp.asarray(x.shape[0]), lambda c: (c[0] + 1, c[1] + 1.5), (0, 0.0))[1],
    "fori_body": lambda x: lax.fori_loop(0, 3, lambda i, c: c + x.shape[0] * i, 0.0),
    "cond_branch": lambda x: lax.cond(jnp.sum(x) > 0, lambda: x.shape[0] * 2.0,
                                      lambda: x.shape[0] * 3.0),
}


@pytest.mark.parametrize("case", sorted(_SIZE_IN_REGIONS))
def test_a_size_used_inside_a_loop_or_branch(case):
    """A size used as a number inside a region whose values are all scalars (a while
    loop's condition ``i < x.shape[0]``): the region gets the real sizes as the others do
    (before: JAX's ``UnexpectedDimVar`` when the step was lowered; found by a probe).
    Oracle: jax.jit on each replica's unpadded rows."""
    f = _SIZE_IN_REGIONS[case]
    xs = [np.ones((5, 3), np.float32), -np.ones((3, 3), np.float32)]
    got = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))(
        rt.PerReplica(xs))
    for g, x in zip(got.values, xs):
        np.testing.assert_allclose(np.asarray(g), np.asarray(jax.jit(f)(x)), rtol=1e-6)


@pytest.mark.parametrize("case", ["grad_of_roll", "vmapped_add"])
def test_scatter_along_a_batching_dim_of_padded_rows_equals_jit(case):
    """A scatter whose padded rows run along a batching dim (``jax.vmap``'s) lands them in
    the operand's padded batch rows, so even ``clip`` mode is exact: the gradient of a
    per-example ``jnp.roll`` (flax's ``examples/sst2`` ``flip_sequences``; before: a
    ``PaddingError`` telling the user to change the mode of a scatter they never wrote)
    and a vmapped ``.at[i].add(mode="clip")``. Oracle: each replica's ``jax.jit``."""
    def flip(x, n):  # flax examples/sst2/models.py
        return jnp.flip(jnp.roll(x, x.shape[0] - n, axis=0), axis=0)

    if case == "grad_of_roll":
        def step(w, x, n):
            return jax.grad(lambda w: jnp.mean(jax.vmap(flip)(x * w, n) ** 2
                                               * jnp.arange(1.0, 5.0)))(w)
    else:
        def step(w, x, n):
            return jax.vmap(lambda r, i: (r * w).at[i].add(r[0] * 2.0, mode="clip"))(x, n)
    rng = np.random.default_rng(7)
    xs = [rng.normal(size=(b, 4)).astype(np.float32) for b in (3, 2)]
    ns = [np.array([1, 4, 2][:b], np.int32) for b in (3, 2)]
    w = np.float32(1.5)
    got = rt.replicate(step, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))(
        w, rt.PerReplica(xs), rt.PerReplica(ns))
    want = [np.asarray(jax.jit(step)(w, x, n)) for x, n in zip(xs, ns)]
    if case == "grad_of_roll":  # (a mirrored weight's gradient: the replicas' mean)
        np.testing.assert_allclose(np.asarray(got), np.mean(want), rtol=1e-6)
    else:
        for g, v in zip(got.values, want):
            np.testing.assert_allclose(np.asarray(g), v, rtol=1e-6)


def test_clip_scatter_made_by_a_gradient_names_the_indexing():
    """The gradient of ``jnp.take(w, i, mode="clip")`` at per-replica indices is a clip-mode
    scatter the user never wrote: the error says so and what to do instead."""
    step = rt.replicate(lambda w, i: jax.grad(lambda w: jnp.sum(jnp.take(w, i, mode="clip")))(w),
                        num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"scatter-add in mode 'clip' scatters padded update "
                                         r"rows \(dim \['b'\]\).*gradient of a clip-mode "
                                         r"gather or take there, index with mode='fill'.*"
                                         r"\(test_dynamic.py:\d+\)"):
        step(np.ones((4,), np.float32), rt.PerReplica([np.array([0, 1, 3], np.int32),
                                                        np.array([2], np.int32)]))


_WINDOW = jax.lax.ScatterDimensionNumbers(update_window_dims=(0, 1), inserted_window_dims=(),
                                          scatter_dims_to_operand_dims=(0,))


def test_padded_window_that_may_not_fit_is_a_clear_error():
    """From row 12 a window of the bucket's 8 rows leaves the 16: XLA would skip it where
    a real window of 3 fits (a combining scatter from row 2 is exact: masked to identity)."""
    f = lambda x: jax.lax.scatter_add(jnp.ones((16, 4)), jnp.array([12]), x, _WINDOW)  # noqa: E731
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, maximum_shapes=[(8, None)]))
    with pytest.raises(ValueError, match=r"scatter-add writes an update of type f32\[b<=8,4\] "
                                         r"varying whose padded axis 0 \(dim b\) lands on axis 0 "
                                         r"of f32\[16,4\] mirrored"):
        step(rt.PerReplica([np.ones((5, 4), np.float32), np.ones((3, 4), np.float32)]))


# -- an update as long as a padded dim written into a fixed buffer ---------------------------
BUFFER = jnp.arange(64, dtype=jnp.float32).reshape(16, 4)
UPDATE_FUNCS = {
    # (the whole buffer is the result: every row the bucket's padding could overwrite)
    "at_1": lambda x: jax.lax.dynamic_update_slice_in_dim(BUFFER, x, 1, 0),
    "clamped_at_14": lambda x: jax.lax.dynamic_update_slice_in_dim(BUFFER, x, 14, 0),
    "negative": lambda x: jax.lax.dynamic_update_slice_in_dim(BUFFER, x, -2, 0),
    "traced_start": lambda x: jax.lax.dynamic_update_slice_in_dim(
        BUFFER, x, 9 + (x[0, 0] > -100).astype(jnp.int32), 0),
    "two_dim_start": lambda x: jax.lax.dynamic_update_slice(jnp.zeros((16, 6)), x, (3, 1)),
    "gradient_of_a_slice": lambda x: jax.grad(lambda tb: jnp.sum(jnp.tanh(
        x + jax.lax.dynamic_slice_in_dim(tb, 10, x.shape[0]))))(BUFFER),
}


@pytest.mark.parametrize("name", sorted(UPDATE_FUNCS))
def test_update_as_long_as_a_padded_dim_into_a_fixed_buffer_equals_jit(monkeypatch, name):
    """Only the real rows are written, at the start XLA clamps them to unpadded (start 14,
    real length 5: row 11); the rows under the padding keep their values. The gradient of
    ``dynamic_slice(table, i, t)`` writes the position gradient so (and at one replica only,
    where the mean over replicas is the replica's own)."""
    _check_padded(monkeypatch, UPDATE_FUNCS[name], [(5, 4)] if name == "gradient_of_a_slice"
                  else [(5, 4), (3, 4)], 21, bound=8, rtol=1e-6, atol=1e-6)


def test_update_with_two_padded_axes_into_a_fixed_buffer_equals_jit(monkeypatch):
    buffer = jnp.arange(96, dtype=jnp.float32).reshape(8, 12)
    f = lambda x: jax.lax.dynamic_update_slice(buffer, x, (3, 1))  # noqa: E731
    _check_padded(monkeypatch, f, [(5, 3), (3, 2)], 23, bound=8, dynamic_dims={0: (0, 1)})


def test_gradient_of_a_dynamic_slice_over_ragged_lengths_is_the_mean():
    f = UPDATE_FUNCS["gradient_of_a_slice"]
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, maximum_shapes=[(8, None)]))
    rng = np.random.default_rng(22)
    xs = [rng.normal(size=(n, 4)).astype(np.float32) for n in (5, 3)]
    np.testing.assert_allclose(step(rt.PerReplica(xs)),
                               np.mean([jax.jit(f)(x) for x in xs], axis=0), rtol=1e-6)


# -- pad of a padded axis to a size beyond the real one ----------------------------------
PAD_TO = 16
PAD_FUNCS = {
    # what the padded rows would land on: real rows of the result, which hold the pad value
    "lax_pad_high": lambda x: jax.lax.pad(jnp.exp(x), 0.0, ((0, PAD_TO - x.shape[0], 0), (0, 0, 0)))
    * jnp.arange(PAD_TO, dtype=jnp.float32)[:, None],
    "jnp_pad_sum": lambda x: jnp.pad(jnp.exp(x), ((0, PAD_TO - x.shape[0]), (0, 0))).sum(0),
    "jnp_pad_value_and_low": lambda x: jnp.pad(x, ((3, PAD_TO - x.shape[0]), (1, 0)),
                                               constant_values=2.5),
    "traced_pad_value": lambda x: jax.lax.pad(x, x[0, 0] * 2, ((0, PAD_TO - x.shape[0], 0),
                                                               (0, 0, 0))),
    # (squared: every row's gradient depends on the rows the pad value fills)
    "gradient": lambda x: jax.grad(lambda v: jnp.sum(jnp.pad(jnp.tanh(v), (
        (0, PAD_TO - v.shape[0]), (0, 0)), constant_values=1.0)
        * jnp.arange(PAD_TO, dtype=jnp.float32)[:, None]) ** 2)(x),
}


@pytest.mark.parametrize("padding", ["zeros", "nan"])
@pytest.mark.parametrize("name", sorted(PAD_FUNCS))
def test_pad_of_a_padded_axis_to_a_static_size_equals_jit(monkeypatch, name, padding):
    """``pad(x, v, (0, 16 - t))`` to a static size puts the pad value from row ``t`` on;
    the bucket's padding must not land there (it did before: 15.0 off, silently)."""
    _check_padded(monkeypatch, PAD_FUNCS[name], [(5, 3), (11, 3)], 14, bound=PAD_TO,
                  padding=padding, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("f,config", [
    # a low end that depends on the size moves the real elements
    (lambda x: jnp.pad(x, ((PAD_TO - x.shape[0], 0), (0, 0))), r"\(- b \+ 16, 0, 0\)"),
    # interior padding puts padding between them (static result: the rule's own check)
    (lambda x: jax.lax.pad(x, 0.0, ((2, PAD_TO - 2 * x.shape[0], 1), (0, 0, 0))),
     r"\(2, - 2\*b \+ 16, 1\)"),
])
def test_pad_that_moves_the_real_elements_is_a_clear_error(f, config):
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, maximum_shapes=[(PAD_TO // 2, None)]))
    with pytest.raises(ValueError, match=rf"padding: pad of padded axis 0 \(dim b\) with "
                                         rf"padding \(low, high, interior\) = {config}: only "
                                         rf"the high end may depend on the size.*"
                                         rf"\(test_dynamic.py:\d+\)"):
        step(rt.PerReplica([np.ones((5, 2), np.float32), np.ones((3, 2), np.float32)]))


# -- slices of a static array as long as a padded dim ---------------------------------------
TABLE = jnp.arange(64, dtype=jnp.float32).reshape(16, 4)
_ROWS = jax.lax.GatherDimensionNumbers(offset_dims=(0, 1), collapsed_slice_dims=(),
                                       start_index_map=(0,))
SIZED_SLICE_FUNCS = {
    # XLA clamps a start so that the slice fits: one of the bucket's length (8) clamped
    # where one of the real length did not (start 10, 5 rows of 16), silently, before
    "dynamic_slice_const": lambda x: x + jax.lax.dynamic_slice_in_dim(TABLE, 10, x.shape[0]),
    "dynamic_slice_traced": lambda x: x + jax.lax.dynamic_slice_in_dim(
        TABLE, 9 + (x[0, 0] > -100).astype(jnp.int32), x.shape[0]),
    "dynamic_slice_negative": lambda x: x + jax.lax.dynamic_slice_in_dim(TABLE, -3, x.shape[0]),
    "dynamic_slice_past_the_end": lambda x: x + jax.lax.dynamic_slice_in_dim(TABLE, 20, x.shape[0]),
    "gather_clip": lambda x: x + jax.lax.gather(TABLE, jnp.array([12]), _ROWS, (x.shape[0], 4),
                                                mode="clip"),
    # fill: out of range for the real length (13 + 5 > 16), in range for 13 + 3
    "gather_fill": lambda x: x + jax.lax.gather(TABLE, jnp.array([13]), _ROWS, (x.shape[0], 4),
                                                mode="fill", fill_value=-1.0),
    "prefix": lambda x: x + TABLE[:x.shape[0]],  # start 0: fits the bucket, left as is
}


@pytest.mark.parametrize("name", sorted(SIZED_SLICE_FUNCS))
def test_slices_as_long_as_a_padded_dim_equal_jit(monkeypatch, name):
    _check_padded(monkeypatch, SIZED_SLICE_FUNCS[name], [(5, 4), (3, 4)], 15, bound=8)


# -- gradient all-reduces of values with a padded dim: summed where the dims are static ------
def _position_loss(p, x):
    """A learned position embedding over a sequence axis whose length differs between
    replicas (x: [batch, t, 4]): the gradient of ``pe`` has each replica's own length, and
    only the table's gradient, scattered from it, can be summed over the replicas."""
    pe = jnp.take(p["wpe"], jnp.arange(x.shape[1]), axis=0)
    return jnp.mean(jnp.tanh((x + pe) @ p["w"]) ** 2)


def _scaled_position_loss(p, x):
    """The embedding divided by each replica's own length: the backward ops after the
    deferred all-reduce divide by t_r, which differs between replicas (a size-derived
    value, typed mirrored before padding)."""
    pe = jnp.take(p["wpe"], jnp.arange(x.shape[1]), axis=0) / x.shape[1]
    return jnp.mean(jnp.tanh((x + pe) @ p["w"]) ** 2)


def test_position_gradient_divided_by_each_replicas_length_equals_jit(monkeypatch):
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    rng = np.random.default_rng(24)
    p = {"wpe": rng.normal(size=(16, 4)).astype(np.float32),
         "w": rng.normal(size=(4, 4)).astype(np.float32)}
    step = rt.replicate(lambda p, x: jax.grad(_scaled_position_loss)(p, x), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True, dynamic_dims={1: (1,)},
                                              maximum_shapes=[None, (None, 16, None)]))
    xs = [rng.normal(size=(3, t, 4)).astype(np.float32) for t in (3, 13)]
    g = step(p, rt.PerReplica(xs))
    ref = [jax.jit(jax.grad(_scaled_position_loss))(p, x) for x in xs]
    for k in p:
        np.testing.assert_allclose(g[k], np.mean([r[k] for r in ref], 0), rtol=1e-5,
                                   atol=1e-6, err_msg=k)


def _position_step(p, x):
    loss, g = jax.value_and_grad(_position_loss)(p, x)
    return jax.tree.map(lambda a, b: a - 0.5 * b, p, g), loss


@pytest.mark.parametrize("n", [1, 2, 4])
def test_position_embedding_gradient_over_ragged_lengths_equals_jit(monkeypatch, n):
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    rng = np.random.default_rng(16)
    p = {"wpe": rng.normal(size=(16, 4)).astype(np.float32),
         "w": rng.normal(size=(4, 4)).astype(np.float32)}
    step = rt.replicate(_position_step, num_replicas=n, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={1: (1,)}, maximum_shapes=[None, (None, 16, None)]))
    for lengths in [(5, 11, 2, 16)[:n], (7, 3, 9, 1)[:n]]:
        xs = [rng.normal(size=(3, t, 4)).astype(np.float32) for t in lengths]
        new, loss = step(p, rt.PerReplica(xs))
        ref = [jax.jit(jax.value_and_grad(_position_loss))(p, x) for x in xs]
        for k in p:
            want = p[k] - 0.5 * np.mean([g[k] for _, g in ref], axis=0)
            np.testing.assert_allclose(new[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
        losses = loss.values if isinstance(loss, rt.PerReplica) else [loss]
        np.testing.assert_allclose([float(v) for v in losses], [float(l) for l, _ in ref],
                                   rtol=1e-5)


def _prefix_loss(p, x):
    """The other way to write it: the table's first ``t`` rows (``wpe[:t]``), whose
    gradient adds a window of the position gradient into the table."""
    return jnp.mean(jnp.tanh((x + p["wpe"][:x.shape[1]]) @ p["w"]) ** 2)


@pytest.mark.parametrize("n", [1, 2])
def test_position_prefix_gradient_over_ragged_lengths_equals_jit(monkeypatch, n):
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    rng = np.random.default_rng(19)
    p = {"wpe": rng.normal(size=(16, 4)).astype(np.float32),
         "w": rng.normal(size=(4, 4)).astype(np.float32)}
    step = rt.replicate(lambda p, x: jax.grad(_prefix_loss)(p, x), num_replicas=n,
                        options=rt.RunOptions(dynamic_shapes=True, dynamic_dims={1: (1,)},
                                              maximum_shapes=[None, (None, 16, None)]))
    xs = [rng.normal(size=(3, t, 4)).astype(np.float32) for t in (5, 11)[:n]]
    g = step(p, rt.PerReplica(xs))
    ref = [jax.jit(jax.grad(_prefix_loss))(p, x) for x in xs]
    for k in p:
        np.testing.assert_allclose(g[k], np.mean([r[k] for r in ref], 0), rtol=1e-5,
                                   atol=1e-6, err_msg=k)


WINDOW_SCATTERS = {
    "add": lambda x: jax.lax.scatter_add(jnp.ones((16, 4)), jnp.array([2]), x, _WINDOW),
    "mul": lambda x: jax.lax.scatter_mul(jnp.full((16, 4), 2.0), jnp.array([2]), x, _WINDOW),
    "max": lambda x: jax.lax.scatter_max(jnp.zeros((16, 4)), jnp.array([2]), x, _WINDOW),
    "min": lambda x: jax.lax.scatter_min(jnp.zeros((16, 4)), jnp.array([2]), x, _WINDOW),
}


@pytest.mark.parametrize("name", sorted(WINDOW_SCATTERS))
def test_scatter_of_a_padded_window_onto_a_static_axis_equals_jit(monkeypatch, name):
    """The window's padding lands on real elements, masked to the combiner's identity;
    the window starts at a constant (2) from which the bucket (8) fits the 16 rows."""
    _check_padded(monkeypatch, WINDOW_SCATTERS[name], [(5, 4), (3, 4)], 20, bound=8)


def test_golden_deferred_gradient_all_reduce():
    """The embedding's gradient all-reduce runs on the table's static gradient after the
    scatter (f32[8,2]), not on the padded per-position one: the rows read at a dynamic
    length are each replica's own, so the table is cast to varying where it is read, and
    its gradient summed there, from the trace on (before: a mirrored f32[b<=8,2] sum that
    the padding pass had to defer past the scatter)."""
    def step(wpe, x):
        return jax.grad(lambda e: jnp.sum(jnp.tanh(x + jnp.take(e, jnp.arange(x.shape[0]),
                                                                axis=0))))(wpe)
    step = rt.replicate(step, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={1: (0,)}, maximum_shapes=[None, (8, None)]))
    lowered = step.lower(np.ones((8, 2), np.float32),
                         rt.PerReplica([np.ones((5, 2), np.float32), np.ones((3, 2), np.float32)]))
    text = _check_golden("padding_deferred_all_reduce.txt", lowered, ("cross-replica-sum",
                                                                      "padding"))
    before, after = text.split("// padding")
    assert "mirrored = all_reduce(" in before and "b<=8,2] mirrored" not in before
    assert "f32[8,2] mirrored = all_reduce(" in before
    assert "f32[8,2] mirrored = all_reduce(" in after and "f32[8,2] varying = scatter-add" in after


def _grad_of_position(p, x):
    """The gradient with respect to the table's first ``t`` rows, ``t`` a dynamic size:
    each replica's own rows (its own number of them), so a per-replica value whose
    gradient is the replica's own, as for any per-replica value."""
    return jax.grad(lambda e: jnp.sum(jnp.tanh(x + e)))(jnp.take(p, jnp.arange(x.shape[0]),
                                                                 axis=0))


@pytest.mark.parametrize("f", [
    lambda p, x: jnp.sum(_grad_of_position(p, x) ** 2),
    lambda p, x: jnp.sum(_grad_of_position(p, x) * x),
    lambda p, x: jnp.sum(_grad_of_position(p, x) * 2.0),
    _grad_of_position,
], ids=["squared", "times_x", "linear", "returned"])
def test_gradient_of_a_value_with_a_dynamic_dim_is_each_replicas_own(f):
    """``jnp.take(p, jnp.arange(t))`` of a mirrored table holds each replica's own number
    of rows: a per-replica value, whose gradient is each replica's own (oracle: jax.jit on
    the replica's unpadded data), used in any way. Before, it was taken for a mirrored
    value: its gradient was the mean over the replicas of their padded gradients, which
    could only be used linearly (anything else was an error) and was no replica's own."""
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={1: (0,)}, maximum_shapes=[None, (8, None)]))
    rng = np.random.default_rng(17)
    p = rng.normal(size=(8, 4)).astype(np.float32)
    xs = [rng.normal(size=(t, 4)).astype(np.float32) for t in (5, 3)]
    got = step(p, rt.PerReplica(xs))
    for g, x in zip(got.values, xs):
        np.testing.assert_allclose(np.asarray(g), np.asarray(jax.jit(f)(p, x)), rtol=1e-5)


def test_gradient_of_a_table_read_at_a_dynamic_length_through_a_checkpoint():
    """A positional table read at ``arange(t)`` inside a ``jax.checkpoint``: its gradient is
    the mean over replicas of each replica's own (the scatter of its ``t`` rows), summed
    where the table meets the replicas' data (before: refused where the region ended)."""
    def f(p, x):
        def inner(pe, x):
            return jnp.tanh((x + pe) @ p["w"])
        return jax.grad(lambda p: jnp.mean(jax.checkpoint(inner)(
            jnp.take(p["wpe"], jnp.arange(x.shape[1]), axis=0), x) ** 2))(p)
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={1: (1,)}, maximum_shapes=[None, (None, 8, None)]))
    rng = np.random.default_rng(5)
    p = {"wpe": rng.normal(size=(8, 4)).astype(np.float32),
         "w": rng.normal(size=(4, 4)).astype(np.float32)}
    xs = [rng.normal(size=(2, t, 4)).astype(np.float32) for t in (5, 3)]
    got = step(p, rt.PerReplica(xs))
    want = [jax.jit(f)(p, x) for x in xs]
    for k in p:
        np.testing.assert_allclose(np.asarray(got[k]), (want[0][k] + want[1][k]) / 2,
                                   rtol=1e-5, atol=1e-6)


# -- two dynamic dims (batch and sequence) ---------------------------------------------------
def _causal_attention(x):
    s = jnp.einsum("btd,bsd->bts", x, x)
    s = jnp.where(jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool)), s, -jnp.inf)
    return jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), x)


FUNCS_2D = {
    "causal_attention": _causal_attention,
    # its gradient reshapes [b, t] -> [b, t, 1]: a padded dim before the other (an
    # internal TypeError before)
    "causal_attention_gradient": lambda x: jax.grad(
        lambda v: jnp.sum(_causal_attention(v) ** 2) / v.shape[0])(x),
    "mean_over_both": lambda x: jnp.mean(jnp.tanh(x), (0, 1)),
    "cumsum_over_t": lambda x: jnp.cumsum(x, 1)[:, -1],
}


@pytest.mark.parametrize("name", sorted(FUNCS_2D))
def test_two_dynamic_dims_equal_jit(monkeypatch, name):
    _check_padded(monkeypatch, FUNCS_2D[name], [(3, 5, 4), (2, 7, 4)], 18, rtol=1e-5,
                  atol=1e-6, dynamic_dims={0: (0, 1)})


def test_reshape_that_swaps_two_dynamic_dims_is_a_clear_error():
    step = rt.replicate(lambda x: x.reshape(x.shape[1], x.shape[0], 4).sum(0), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True, dynamic_dims={0: (0, 1)}))
    with pytest.raises(ValueError, match=r"padding: reshape f32\[b,d1,4\] varying -> "
                                         r"f32\[d1,b,4\] varying moves the padded axis"):
        step(rt.PerReplica([np.ones((3, 5, 4), np.float32), np.ones((2, 7, 4), np.float32)]))


def test_undecidable_size_comparison_names_the_line_and_dims():
    f = lambda x: jax.lax.dynamic_slice_in_dim(x, 1, 2, 0)  # noqa: E731
    for ms, dims, hint in [(None, "(b)", "maximum_shapes"), ([(8, None)], "(b<=8)", "dynamic_dims")]:
        step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(
            dynamic_shapes=True, maximum_shapes=ms))
        with pytest.raises(ValueError, match=rf"tracing <lambda> at test_dynamic.py:\d+ with "
                                             rf"dynamic dims \{dims[:-1]}\).*'b' >= '2'.*{hint}"):
            step(rt.PerReplica([np.ones((5, 2), np.float32), np.ones((3, 2), np.float32)]))


def test_bound_settles_a_size_comparison():
    """x[:10] is min(b, 10) rows: unbounded, a clear error naming the expression; with
    maximum_shapes b <= 8 the trace knows it is b, and the result is exact."""
    f = lambda x: x[:10].sum(0)  # noqa: E731
    xs = [np.arange(10, dtype=np.float32).reshape(5, 2), np.ones((3, 2), np.float32)]
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"whose dim min\(b, 10\) mixes padded and real"):
        step(rt.PerReplica(xs))
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, maximum_shapes=[(8, None)]))
    out = step(rt.PerReplica(xs))
    for v, x in zip(out.values, xs):
        np.testing.assert_allclose(v, x.sum(0))


def test_unsupported_combinations_say_so():
    opts = rt.RunOptions(dynamic_shapes=True)
    with pytest.raises(NotImplementedError, match="dynamic_shapes=True.* donate=True"):
        rt.replicate(lambda s, x: (s, x), num_replicas=2, options=opts, donate=True)
    with pytest.raises(NotImplementedError, match="steps_per_call > 1"):
        rt.replicate(lambda s, x: (s, x), num_replicas=2, options=opts, steps_per_call=2)


def test_persistent_cache_is_not_silently_ignored(tmp_path):
    opts = rt.RunOptions(dynamic_shapes=True, cache_dir=str(tmp_path))
    with pytest.warns(RuntimeWarning, match=rf"persistent cache \({tmp_path}\) does not hold "
                                            r"dynamic-shape programs"):
        step = rt.replicate(lambda x: x.sum(0), num_replicas=2, options=opts)
    out = step(rt.PerReplica([np.ones((3, 2), np.float32), np.ones((5, 2), np.float32)]))
    np.testing.assert_allclose(out.values[1], [5.0, 5.0])


def test_new_exact_sizes_of_device_arrays_compile_nothing():
    """Issue 15: inside a compiled bucket, device-array inputs of sizes never seen before
    (and reading the sliced results) compile no program at all: no pad or slice program
    per exact size (JAX's backend-compile event is counted)."""
    import jax.monitoring
    from jax._src.dispatch import BACKEND_COMPILE_EVENT
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **kw: compiles.append(event) if event == BACKEND_COMPILE_EVENT else None)
    step = rt.replicate(lambda x: (jnp.cumsum(x, axis=0) * 2, jnp.sum(x)), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(7)
    dev = lambda n: jax.device_put(rng.normal(size=(n, 3)).astype(np.float32))  # noqa: E731
    first = step(rt.PerReplica([dev(16), dev(9)]))  # bucket 16: compiles our program
    [v.block_until_ready() for v in first[0].values + first[1].values]  # (scalars: once per device)
    before = len(compiles)
    for sizes in [(9, 10), (11, 12), (13, 3), (15, 14), (1, 16)]:
        xs = [dev(s) for s in sizes]
        cum, tot = step(rt.PerReplica(xs))
        for r, x in enumerate(xs):
            assert cum.values[r].shape == x.shape
            np.testing.assert_allclose(cum.values[r], np.cumsum(np.asarray(x), 0) * 2, rtol=1e-5)
            np.testing.assert_allclose(tot.values[r], np.asarray(x).sum(), rtol=1e-5)
    assert len(compiles) == before, f"{len(compiles) - before} programs compiled for new sizes"
    assert step.cache_info().misses == 1


@pytest.mark.parametrize("where", ["own devices", "device 0"])
def test_device_arrays_of_the_buckets_shape_run_as_they_are(where):
    """Device arrays of exactly the bucket's shape need no padding: on their replicas'
    devices they are assembled into the global input as they are, on another device they
    are moved there; each replica's results are jax.jit's on its array either way."""
    step = rt.replicate(lambda x: (jnp.cumsum(x, axis=0) * 2, jnp.sum(x)), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(3)
    devs = jax.devices()[:2] if where == "own devices" else [jax.devices()[0]] * 2
    for _ in range(2):
        xs = [jax.device_put(rng.normal(size=(16, 3)).astype(np.float32), d) for d in devs]
        cum, tot = step(rt.PerReplica(xs))
        for r, x in enumerate(xs):
            np.testing.assert_allclose(cum.values[r], np.cumsum(np.asarray(x), 0) * 2, rtol=1e-5)
            np.testing.assert_allclose(tot.values[r], np.asarray(x).sum(), rtol=1e-5)
    assert step.cache_info().misses == 1


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_, np.float64])
def test_host_put_matches_device_put(dtype):
    """The dynamic path sends its host buffers with ``HostPut``: the same values and
    layout as ``jax.device_put`` (split over the replica axis, replicated over the model
    axis), and a dtype the executable would convert (float64 without x64) is left to
    ``jax.device_put``."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ir._jax_compat import HostPut
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("replica", "model"))
    for spec, shape in ((P("replica"), (8, 3)), (P(), (8, 3)), (P("replica", "model"), (4, 6))):
        sh = NamedSharding(mesh, spec)
        x = (np.arange(np.prod(shape)).reshape(shape) % 5).astype(dtype)
        put = HostPut(sh, shape, x.dtype)
        got, want = put(x), jax.device_put(x, sh)
        assert got.sharding == want.sharding and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        for a, b in zip(sorted(got.addressable_shards, key=lambda s: s.device.id),
                        sorted(want.addressable_shards, key=lambda s: s.device.id)):
            assert a.index == b.index
            np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
        # another shape than the one it was made for: jax.device_put's answer, not a misfit
        y = np.ones((shape[0] * 2,) + shape[1:], dtype)
        np.testing.assert_array_equal(np.asarray(put(y)), y.astype(want.dtype))


def test_host_put_leaves_a_one_device_array_to_the_call():
    """With a sharding of one device ``HostPut`` hands a host array of its shape and dtype
    back as it is (the executable's own call sends it, which costs less than a put first);
    any other array still goes to ``jax.device_put``; with two devices it puts."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ir._jax_compat import HostPut
    one = NamedSharding(Mesh(np.asarray(jax.devices()[:1]), ("replica",)), P("replica"))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    put = HostPut(one, x.shape, x.dtype)
    assert put(x) is x
    other = put(np.ones((4, 3), np.float32))
    assert isinstance(other, jax.Array) and other.sharding == one
    two = NamedSharding(Mesh(np.asarray(jax.devices()[:2]), ("replica",)), P("replica"))
    got = HostPut(two, x.shape, x.dtype)(x)
    assert isinstance(got, jax.Array) and got.sharding == two
    np.testing.assert_array_equal(np.asarray(got), x)


def test_one_replica_dynamic_calls_equal_jit():
    """At one replica the dynamic path hands its host buffers (the padded inputs and the
    size vector) to the executable's call as they are: every call's results equal
    ``jax.jit``'s on its real rows, for new, repeated and shrinking sizes and host, device
    and mixed inputs, read only after all the calls ran (a buffer written after its
    call was handed it would change an earlier result)."""
    step = rt.replicate(_mlp_step, num_replicas=1, options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(3)
    w = rng.normal(size=(6, 3)).astype(np.float32)
    calls = []
    for size, kind in ((5, "host"), (7, "host"), (5, "host"), (16, "device"), (3, "mixed"),
                       (8, "device"), (1, "host")):
        x = rng.normal(size=(size, 6)).astype(np.float32)
        y = rng.normal(size=(size, 3)).astype(np.float32)
        xa = jnp.asarray(x) if kind in ("device", "mixed") else x
        ya = jnp.asarray(y) if kind == "device" else y
        calls.append((step(w, rt.PerReplica([xa]), rt.PerReplica([ya])), x, y))
    for out, x, y in calls:
        _check_mlp(out, w, [x], [y])
    plans = list(step._dynamic.planned.values())
    assert plans and all(p is None or p._direct for plan in plans for p in plan.puts)


def test_concurrent_calls_keep_their_own_sizes(monkeypatch):
    """Threads calling one dynamic step at once, with sizes inside planned buckets, new
    buckets and a plan memo small enough to evict: each call's results are its own
    (checked against jax.jit per replica), whatever the others were doing."""
    import threading
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "PLAN_MEMO_SIZE", 2)
    step = rt.replicate(_mlp_step, num_replicas=N, options=rt.RunOptions(dynamic_shapes=True))
    w = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(6):
                sizes = rng.integers(1, 20, size=N)
                xs = [rng.normal(size=(s, 6)).astype(np.float32) for s in sizes]
                ys = [rng.normal(size=(s, 3)).astype(np.float32) for s in sizes]
                _check_mlp(step(w, rt.PerReplica(xs), rt.PerReplica(ys)), w, xs, ys)
        except Exception as e:  # noqa: BLE001 - reported below with its thread
            errors.append((seed, e))
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(step._dynamic.planned) <= 2


# -- typed PRNG keys (jax.random.key, what flax's examples pass) ----------------------------
def _noisy_step(w, x, key):
    eps = jax.random.normal(key, x.shape)
    return jnp.mean((x + eps) @ w)


def test_a_typed_key_per_replica_equals_each_replicas_own_jit():
    """Before, ``TypeError: Cannot interpret 'key<fry>' as a data type`` from the put of
    the program's inputs (``HostPut``: a NumPy dtype only). A key per replica has no
    dynamic axis (rank 0), so nothing is padded."""
    n = 2
    w = np.ones((3,), np.float32)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    keys = list(jax.random.split(jax.random.key(0), n))
    step = rt.replicate(_noisy_step, num_replicas=n, options=rt.RunOptions(dynamic_shapes=True))
    got = step(w, rt.distribute_uneven(x, n), rt.PerReplica(keys))
    want = [float(jax.jit(_noisy_step)(w, p, k)) for p, k in zip(np.array_split(x, n), keys)]
    np.testing.assert_allclose([float(v) for v in got.values], want, rtol=1e-6)


def test_typed_keys_with_a_dynamic_axis_are_an_error_saying_what_to_pass():
    """Keys cannot be padded: a ``TypeError`` naming the argument, the keys' type and the
    two ways out; ``distribute_uneven`` splits typed keys (NumPy cannot hold them) as
    ``numpy.array_split`` splits arrays, and their data, padded, gives each replica's
    own numbers."""
    n = 2
    w = np.ones((3,), np.float32)
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    keys = jax.random.split(jax.random.key(0), 5)

    def per_example(w, x, keys):
        eps = jax.vmap(lambda k: jax.random.normal(k, (3,)))(keys)
        return jnp.mean((x + eps) @ w)
    parts = rt.distribute_uneven(keys, n)
    assert [p.shape for p in parts.values] == [(3,), (2,)]
    np.testing.assert_array_equal(jax.random.key_data(parts.values[1]),
                                  jax.random.key_data(keys[3:]))
    step = rt.replicate(per_example, num_replicas=n, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(TypeError, match=r"PerReplica argument 2 leaf 0 holds typed PRNG keys "
                                        r"\(key<fry>\[3\]\) with dynamic axes \[0\], which "
                                        r"cannot be padded: pass their data \(jax\.random\."
                                        r"key_data.*dynamic_dims=\{2: \(\)\}"):
        step(w, rt.distribute_uneven(x, n), parts)

    def from_data(w, x, data):                # the way out the message gives
        return per_example(w, x, jax.random.wrap_key_data(data))
    data = jax.random.key_data(keys)
    got = rt.replicate(from_data, num_replicas=n, options=rt.RunOptions(dynamic_shapes=True))(
        w, rt.distribute_uneven(x, n), rt.distribute_uneven(data, n))
    want = [float(jax.jit(per_example)(w, xp, kp)) for xp, kp in
            zip(np.array_split(x, n), [keys[:3], keys[3:]])]
    np.testing.assert_allclose([float(v) for v in got.values], want, rtol=1e-6)


SORT_FUNCS = {
    "sort": jnp.sort,
    "argsort": jnp.argsort,
    "median": jnp.median,
    "nanmedian": jnp.nanmedian,
    "nanquantile_lower": lambda x: jnp.nanquantile(x, 0.5, method="lower"),
    # a first key equal to the padding's old fill (True), the second breaking the tie
    "lexsort_bool_key": lambda x: jnp.lexsort((jnp.nan_to_num(x), jnp.isnan(x) | (x > 2))),
    "lexsort_int_max_key": lambda x: jnp.lexsort((jnp.nan_to_num(x), jnp.where(
        x > 2, jnp.iinfo(jnp.int32).max, 0).astype(jnp.int32))),
}


@pytest.mark.parametrize("padding", ["zeros", "nan"])
@pytest.mark.parametrize("name", sorted(SORT_FUNCS))
def test_sorts_put_every_real_element_before_the_padding(monkeypatch, name, padding):
    """A sort along a padded axis sorts the real elements first whatever they hold. Before,
    the padding was filled with +inf: a real NaN sorts after it and was cut off (``sort``
    gave ``inf``, ``argsort`` an index into the padding, ``nanmedian`` a wrong median),
    and a multi-key sort whose first key equalled the fill put padding rows first."""
    xs = [np.array([3.0, np.nan, 1.0, 2.0, 5.0], np.float32),
          np.array([np.nan, 4.0, 2.0], np.float32), np.array([7.0, 1.5], np.float32)]
    _check_values(monkeypatch, SORT_FUNCS[name], xs, padding=padding)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8])
def test_bitwise_and_over_a_padded_axis_fills_every_bit(monkeypatch, dtype):
    """The padding of a bitwise and-reduction is all ones (before: 1, the identity of a
    logical and only, so ``[7, 6, 14]`` reduced to 0 instead of 6)."""
    xs = [np.array([7, 6, 14], dtype), np.array([255, 15, 13, 5, 127], dtype)]
    _check_values(monkeypatch, jnp.bitwise_and.reduce, xs, padding="zeros")
    _check_values(monkeypatch, lambda x: jnp.all(x > 4), xs, padding="zeros")


def _kernel(x):
    """An RBF kernel matrix over the padded axis (its padding rows are not zero)."""
    v = jnp.sin(3 * x[:, 0])
    return jnp.exp(-(v[:, None] - v[None, :]) ** 2) + jnp.eye(x.shape[0])


def _pivoting(x):
    """A matrix whose padding rows (x = 0) would win partial pivoting over the real ones."""
    return (jnp.exp(-x[:, 0])[:, None] * jnp.cos(x[None, :, 1])
            + 0.01 * jnp.eye(x.shape[0]) * x[:, 2][None, :])


LINALG_FUNCS = {
    "cholesky": lambda x: jnp.linalg.cholesky(_kernel(x)),
    "cho_solve": lambda x: jax.scipy.linalg.cho_solve(
        jax.scipy.linalg.cho_factor(_kernel(x), lower=True), jnp.sin(x[:, 0])),
    "lu": lambda x: jax.scipy.linalg.lu_factor(_pivoting(x))[0],
    "lu_pivots": lambda x: jax.scipy.linalg.lu_factor(_pivoting(x))[1],
    "det": lambda x: jnp.linalg.det(_pivoting(x)),
    "slogdet": lambda x: jnp.linalg.slogdet(_pivoting(x))[1],
    "solve_upper": lambda x: jax.scipy.linalg.solve_triangular(
        jnp.triu(_kernel(x)), jnp.ones_like(_kernel(x)), lower=False),
    "solve_lower_transposed": lambda x: jax.scipy.linalg.solve_triangular(
        jnp.tril(_kernel(x)), jnp.ones_like(_kernel(x)), lower=True, trans=1),
    "eigh_of_padded_batch": lambda x: jnp.linalg.eigvalsh(
        jnp.einsum("bi,bj->bij", x, x) + jnp.eye(3)),
}


@pytest.mark.parametrize("name", sorted(LINALG_FUNCS))
def test_factorizations_and_solves_over_a_padded_matrix_equal_jit(monkeypatch, name):
    """A matrix padded on both axes is the identity outside its real block, so Cholesky,
    LU (pivoting stays in the real rows), determinants and triangular solves in either
    direction are the real block's, with NaN in the padding too (before: the padding
    rows won the pivoting and an upper solve ran through them: wrong numbers)."""
    rng = np.random.default_rng(0)
    xs = [rng.uniform(5, 6, size=(n, 3)).astype(np.float32) for n in (5, 3)]
    _check_values(monkeypatch, LINALG_FUNCS[name], xs, rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("name,f", [
    ("eigh", lambda x: jnp.linalg.eigvalsh(_kernel(x))),
    ("qr", lambda x: jnp.linalg.qr(_kernel(x))[1]),
])
def test_spectral_ops_over_a_padded_matrix_are_a_clear_error(name, f):
    """Eigenvalues and QR of a padded matrix would mix the padding's part into the real
    results (before: wrong numbers); the error names the op, the axis and the line."""
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    xs = [np.ones((n, 3), np.float32) for n in (5, 3)]
    with pytest.raises(PaddingError, match=rf"{name} is not exact over a padded matrix axis: "
                                           rf"axis 0 \(dim \w+\) of its operand f32\[\w+,\w+\] .*"
                                           rf"\(test_dynamic\.py:\d+\)"):
        step(rt.PerReplica(xs))


@pytest.mark.parametrize("case", ["axis0", "axis1", "not_partitionable"])
def test_random_draws_over_a_padded_axis_equal_the_unpadded_draw_or_are_refused(case):
    """``jax.random`` over a padded shape: along axis 0 with JAX's default generator the
    real rows' values are the unpadded draw's (oracle: ``jax.jit`` on each replica's own
    data); along a later padded axis (a dynamic sequence length), or with
    ``jax_threefry_partitionable`` off, every element's bits depend on the padded sizes,
    so it is a ``PaddingError`` naming the op and the axis. Before, both gave other
    numbers than the unpadded draw, silently."""
    def step(x, key):
        return x + jax.random.normal(jax.random.fold_in(key, 7), x.shape)
    dims = {0: {1: "t"}} if case == "axis1" else None
    rep = rt.replicate(step, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims=dims))
    key = jax.random.PRNGKey(3)
    xs = ([np.zeros((2, t), np.float32) for t in (3, 2)] if case == "axis1" else
          [np.zeros((t, 3), np.float32) for t in (3, 2)])
    with jax.threefry_partitionable(case != "not_partitionable"):
        if case != "axis0":
            axis = 1 if case == "axis1" else 0
            with pytest.raises(PaddingError, match=rf"random_bits .* padded axis {axis} "
                                                   r".*test_dynamic\.py:\d+"):
                rep(rt.PerReplica(xs), key)
            return
        got = rep(rt.PerReplica(xs), key)
        for r, x in enumerate(xs):
            np.testing.assert_array_equal(got.values[r], jax.jit(step)(x, key))


def test_a_dynamic_size_is_per_replica_and_its_sum_gives_no_warning():
    """``x.shape[0]`` of a dynamic batch is each replica's own size: the README's DP-SGD
    count ``rt.all_reduce(jnp.float32(x.shape[0]), "sum")`` is the global batch size
    with no warning (before: "all-reduce of a value that is already identical on every
    replica"), and the size itself comes back per replica (oracle: the real sizes)."""
    import warnings

    def step(x):
        n = jnp.float32(x.shape[0])
        return n[None], rt.all_reduce(n, "sum")
    rep = rt.replicate(step, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        local, total = rep(distribute_uneven(np.ones((5, 2), np.float32), 2))
    assert [float(v[0]) for v in local.values] == [3.0, 2.0] and float(total) == 5.0


def test_pure_callback_over_a_padded_axis_is_a_clear_error():
    """A ``jax.pure_callback`` of a value with a padded axis would hand the host function
    the padding: a ``PaddingError`` naming the op and the line, as for the other
    callbacks (before: an internal ``LoweringError`` about shapes ``(2, 3), (b, 3)``)."""
    def step(x):
        return x * jax.pure_callback(lambda v: np.sin(v), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    rep = rt.replicate(step, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(PaddingError, match=r"pure_callback .*padded .*test_dynamic\.py:\d+"):
        rep(rt.distribute(np.ones((4, 3), np.float32), 2))


@pytest.mark.parametrize("kind", ["associative_scan", "pad"])
def test_gradient_of_a_broadcast_weight_through_a_zero_pad_along_a_static_axis(kind):
    """A mirrored decay ``a`` broadcast over a padded batch and shifted along time with
    zeros (``jnp.pad``, inside ``lax.associative_scan`` too: an LRU/Mamba-style scan):
    its gradient's sum over the replicas moves through the pad, which is linear, to
    where the dims are static (oracle: the mean of ``jax.grad`` on each replica's own
    data). Before: a ``PaddingError`` (pad "not known to be linear")."""
    def loss(a, u):
        decay = jnp.broadcast_to(a, u.shape)                       # [b, T, D]
        if kind == "pad":
            h = jnp.pad(decay[:, 1:], ((0, 0), (1, 0), (0, 0))) * u
        else:
            _, h = lax.associative_scan(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1]),
                                        (decay, u), axis=1)
        return jnp.mean(h ** 2)
    a = jnp.array([0.3, 0.5, 0.7, 0.9])
    x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (8, 6, 4)))
    xs = [x[:3], x[3:8]]
    got = rt.replicate(jax.grad(loss), num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True))(a, rt.PerReplica(xs))
    want = np.mean([jax.jit(jax.grad(loss))(a, u) for u in xs], axis=0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-7)


def test_prefill_with_a_dynamic_batch_and_length_into_a_fixed_cache():
    """A KV-cache prefill, ``dynamic_update_slice(zeros((b, T)), x[b, t], (0, 0))`` with
    both ``b`` and ``t`` dynamic: the batch axis is written whole, only the real length
    along the static cache axis (oracle: ``jax.jit`` on each replica's own data, uneven
    sizes). Before, a ``PaddingError`` (axis t "not padded the same way")."""
    def prefill(x):
        return lax.dynamic_update_slice(jnp.zeros((x.shape[0], 6)), x, (0, 0))
    xs = [np.ones((2, 2), np.float32), 2 * np.ones((3, 4), np.float32)]
    rep = rt.replicate(prefill, num_replicas=2, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={0: {0: "b", 1: "t"}}, maximum_shapes=[(8, 6)]))
    got = rep(rt.PerReplica(xs))
    for r, x in enumerate(xs):
        np.testing.assert_array_equal(got.values[r], jax.jit(prefill)(x))


# -- dims cut from a padded symbol by a constant: x[1:], x[:-1], jnp.diff (b - 1) ----------
#: the real sizes of four replicas, and so buckets 8 and 2 (pow2): ``b - 1`` holds 0 or 1
#: real rows, and ``b - 2`` has buckets 6 and 0 (clamped); ``pytest --long`` adds buckets 1
#: and 4 (the suite's 10-minute budget: each size set is a compile per function)
CUT_SIZES = [(5, 1, 2, 8), (2, 1, 2, 1)]
CUT_SIZES_LONG = [(1, 1, 1, 1), (3, 2, 1, 3)]


def _jnp_roll_back(x):
    """``jnp.concatenate`` of static rows and a cut one (the transpose of ``jnp.split``)."""
    return jnp.concatenate([x[:1] * 3, x[1:]])


CUT_FUNCS = {
    "shift": lambda x: x[1:],  # (returned: sliced back to n - 1 rows per replica)
    "drop_last": lambda x: x[:-1] * 2,
    "shift_2": lambda x: x[2:],  # (JAX: - min(b, 2) + b)
    "drop_2": lambda x: x[:-2],  # (JAX: max(0, b - 2))
    "middle": lambda x: x[1:-1] + 1,
    "diff": lambda x: jnp.diff(x, axis=0),
    "neighbour_difference": lambda x: x[1:] - x[:-1],  # (an error before: test_bad_inputs)
    "squared_steps": lambda x: jnp.sum((x[1:] - x[:-1]) ** 2, axis=0),
    "mean_shift_2": lambda x: jnp.mean(x[2:], axis=0),
    "var_of_diff": lambda x: jnp.var(jnp.diff(x, axis=0), axis=0),
    "slice_in_dim": lambda x: lax.slice_in_dim(x, 1, x.shape[0]),
    "slice_in_dim_end": lambda x: lax.slice_in_dim(x, 0, x.shape[0] - 1),
    "cumsum": lambda x: jnp.cumsum(x[1:], axis=0),
    "sort": lambda x: jnp.sort(x[:-1], axis=0),
    "softmax": lambda x: jax.nn.softmax(x[1:], axis=0),
    "max": lambda x: jnp.max(x[2:], axis=0, initial=-1.0),  # (argmax: JAX needs b - 2 >= 1)
    "gram": lambda x: x[1:].T @ x[:-1],
    "pairwise": lambda x: jnp.sum(x[1:, None, 0] * x[None, :-1, 1], axis=0),
    "split": lambda x: jnp.split(x, [1])[1] * 2,
    "concatenate": _jnp_roll_back,
    "dynamic_slice": lambda x: lax.dynamic_slice_in_dim(x, 1, x.shape[0] - 1),
    # (XLA clamps the start to [0, 1] unpadded and padded alike)
    "dynamic_slice_clamped": lambda x: lax.dynamic_slice_in_dim(x, 7, x.shape[0] - 1),
    "dynamic_slice_traced": lambda x: lax.dynamic_slice_in_dim(
        x, (x[0, 0] > 0).astype(jnp.int32), x.shape[0] - 1),
    "pad_negative": lambda x: lax.pad(x, 0.0, ((-1, 0, 0), (0, 0, 0))),
    # (the same length, moved up: the last real row is the pad value, not padding)
    "pad_shift_up": lambda x: lax.pad(x, 2.0, ((-1, 1, 0), (0, 0, 0))),
    "set_from_row_1": lambda x: x.at[1:].set(x[:-1] * 10),
    "add_onto_front": lambda x: x.at[:-1].add(x[1:]),
    "update_at_0": lambda x: lax.dynamic_update_slice_in_dim(x, x[1:] * 10, 0, 0),
    "update_traced": lambda x: lax.dynamic_update_slice_in_dim(
        x, x[1:] * 10, (x[0, 0] > 0).astype(jnp.int32), 0),
    "cond": lambda x: lax.cond(jnp.sum(x) > 0, lambda v: jnp.sum(v[1:] ** 2, 0),
                               lambda v: jnp.sum(v[:-1], 0), x),
    # gradients: the cotangent of the cut rows scattered (or padded) back into b rows
    "grad_products": jax.grad(lambda x: jnp.sum(jnp.sin(x[1:]) * x[:-1])),
    "grad_shift_2": jax.grad(lambda x: jnp.sum(jnp.sin(x[2:]) ** 2) + jnp.sum(x[:-2] ** 3)),
    "grad_slice_in_dim": jax.grad(lambda x: jnp.sum(
        lax.slice_in_dim(x, 1, x.shape[0]) ** 2 * lax.slice_in_dim(x, 0, x.shape[0] - 1))),
    "grad_dynamic_slice": jax.grad(lambda x: jnp.sum(
        jnp.tanh(lax.dynamic_slice_in_dim(x, 0, x.shape[0] - 1)) * 3)),
    "grad_diff_mean": jax.grad(lambda x: jnp.mean(jnp.diff(x, axis=0) ** 2)),
}


@pytest.mark.parametrize("name", sorted(CUT_FUNCS))
def test_a_padded_axis_cut_by_a_constant_equals_jit(monkeypatch, request, name):
    """``x[1:]``, ``x[:-1]``, ``jnp.diff`` and the like (a dim ``b - c``) take their rows
    from a constant start, so the real ones still come first: every rule then treats the
    cut dim as a padded dim of its own (bucket ``max(bucket - c, 0)``, real size
    ``max(n - c, 0)``), and a returned one comes back with ``n - c`` rows per replica.
    The padding holds NaN; replicas of 1 and 2 rows leave 0 or 1 real rows."""
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    f = CUT_FUNCS[name]
    step = rt.replicate(f, num_replicas=N, options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(sorted(CUT_FUNCS).index(name))
    for sizes in CUT_SIZES + (CUT_SIZES_LONG if request.config.getoption("--long") else []):
        xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
        out = step(rt.PerReplica(xs))
        for v, x in zip(out.values, xs):
            want = jax.jit(f)(x)
            assert np.shape(v) == want.shape, (sizes, np.shape(v), want.shape)
            np.testing.assert_allclose(np.asarray(v), np.asarray(want), rtol=1e-5, atol=1e-5,
                                       err_msg=str(sizes))


def _smoothness_loss(w, x):
    h = x @ w
    return jnp.sum((h[1:] - h[:-1]) ** 2)


@pytest.mark.parametrize("sizes", CUT_SIZES)
def test_gradient_of_a_loss_over_neighbouring_rows_is_the_mean_of_jits(monkeypatch, sizes):
    """``sum((h[1:] - h[:-1])**2)`` with ``h = x @ w``: the loss per replica and the
    gradient of the mirrored ``w``, the mean over replicas of each one's own jit gradient
    (loss_reduction="mean"); NaN padding."""
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    step = rt.replicate(jax.value_and_grad(_smoothness_loss), num_replicas=N,
                        loss_reduction="mean", options=rt.RunOptions(dynamic_shapes=True))
    rng = np.random.default_rng(31)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    xs = [rng.normal(size=(n, 3)).astype(np.float32) for n in sizes]
    loss, g = step(w, rt.PerReplica(xs))
    want = [jax.jit(jax.value_and_grad(_smoothness_loss))(w, x) for x in xs]
    for r in range(N):
        np.testing.assert_allclose(loss.values[r], want[r][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g, np.mean([v[1] for v in want], 0), rtol=1e-5, atol=1e-5)


def _next_token_loss(p, tokens):
    """A tiny language model over a dynamic sequence axis t: every position predicts the
    next token (``logits[:, :-1]`` against ``tokens[:, 1:]``, both of length ``t - 1``).
    (One-hot labels: ``take_along_axis`` over an axis of ``t - 1`` asks JAX whether
    ``t - 1 >= 1`` while tracing, which it cannot decide.)"""
    h = jnp.tanh(p["wte"][tokens] @ p["w"])
    logits = h @ p["out"]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=logp.dtype)
    return jnp.mean(-jnp.sum(logp * labels, axis=-1))


def test_next_token_cross_entropy_on_a_dynamic_sequence_axis_equals_jit(monkeypatch):
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    rng = np.random.default_rng(32)
    vocab = 11
    p = {"wte": rng.normal(size=(vocab, 6)).astype(np.float32),
         "w": rng.normal(size=(6, 6)).astype(np.float32) / 2,
         "out": rng.normal(size=(6, vocab)).astype(np.float32)}
    fn = jax.value_and_grad(_next_token_loss)
    step = rt.replicate(fn, num_replicas=N, loss_reduction="mean",
                        options=rt.RunOptions(dynamic_shapes=True, dynamic_dims={1: {1: "t"}}))
    for lengths in [(7, 2, 4, 3), (2, 9, 5, 2)]:
        toks = [rng.integers(0, vocab, size=(3, t)).astype(np.int32) for t in lengths]
        loss, g = step(p, rt.PerReplica(toks))
        want = [jax.jit(fn)(p, tk) for tk in toks]
        for r in range(N):
            np.testing.assert_allclose(loss.values[r], want[r][0], rtol=1e-5)
        for k in p:
            np.testing.assert_allclose(g[k], np.mean([v[1][k] for v in want], 0), rtol=1e-4,
                                       atol=1e-6, err_msg=k)
    # one replica of length 1 has no next token: its mean is NaN, as jit's
    toks = [rng.integers(0, vocab, size=(3, t)).astype(np.int32) for t in (1, 4, 2, 6)]
    loss = rt.replicate(_next_token_loss, num_replicas=N, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={1: {1: "t"}}))(p, rt.PerReplica(toks))
    for r in range(N):
        np.testing.assert_allclose(loss.values[r], jax.jit(_next_token_loss)(p, toks[r]),
                                   rtol=1e-5)


def test_a_table_cut_to_a_padded_length_minus_one_equals_jit(monkeypatch):
    """A static table sliced as long as ``b - 1`` (from a constant, or a start XLA clamps
    against the real length): the cut dim's own real size clamps it."""
    table = jnp.arange(48, dtype=jnp.float32).reshape(16, 3)
    _check_padded(monkeypatch, lambda x: x[1:] + table[3:3 + x.shape[0] - 1],
                  [(5, 3), (1, 3), (8, 3)], 33, bound=8)
    _check_padded(monkeypatch, lambda x: x[1:] + lax.dynamic_slice_in_dim(
        table, 14, x.shape[0] - 1), [(5, 3), (1, 3), (8, 3)], 33, bound=8)


def test_a_cut_dim_of_an_empty_replica_used_as_a_number_is_a_clear_error():
    """JAX traces ``b >= 1``, so ``b - 1`` is -1 for a replica of 0 rows where ``x[1:]``
    has 0: a size used as a number (``jnp.mean`` over ``x[1:]`` divides by it) would be
    wrong there, so such a call is an error; without one the cut is exact."""
    xs = [np.ones((n, 2), np.float32) for n in (0, 3, 2, 1)]
    cut = rt.replicate(lambda x: x[1:] * 2, num_replicas=N,
                       options=rt.RunOptions(dynamic_shapes=True))
    for v, x in zip(cut(rt.PerReplica(xs)).values, xs):
        np.testing.assert_array_equal(v, x[1:] * 2)
    step = rt.replicate(lambda x: jnp.mean(x[1:], axis=0), num_replicas=N,
                        options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"replica 0 has 0 elements along dynamic dim b, and the "
                                         r"step cuts it to b - 1 and uses a size b - 1 as a "
                                         r"number"):
        step(rt.PerReplica(xs))
    # (x[2:] is max(b - 2, 0) in JAX's own text: right at 0 too)
    step2 = rt.replicate(lambda x: jnp.mean(x[2:], axis=0), num_replicas=N,
                         options=rt.RunOptions(dynamic_shapes=True))
    for v, x in zip(step2(rt.PerReplica(xs)).values, xs):
        np.testing.assert_array_equal(v, jax.jit(lambda x: jnp.mean(x[2:], axis=0))(x))


CUT_ERRORS = {
    "stride": (lambda x: x[::2],
               r"padding: iota has a value of type s32\[floordiv_b_plus_1_2_\].* whose dim "
               r"floordiv\(b \+ 1, 2\) mixes padded and real elements \(.*x\[::2\]"),
    "half": (lambda x: x[x.shape[0] // 2:],
             r"padding: gather has a value of type f32\[.*whose dim - floordiv\(b, 2\) \+ b mixes "
             r"padded and real elements"),
    "bounded_window": (lambda x: x[1:3],
                       r"padding: gather has a value of type .*whose dim min\(b, 3\) - 1 mixes"),
    "set_before_the_end": (lambda x: x.at[:-1].set(x[1:]),
                           r"padding: scatter writes an update of type f32\[b_minus_1,2\] "
                           r"varying whose axis 0 \(dim b - 1\) is 1 shorter than axis 0 \(dim b\)"
                           r".*at a start that is not the constant 1: its padding would "
                           r"overwrite real elements"),
    "cut_first": (lambda x: jnp.concatenate([x[1:], x[:1]]),
                  r"padding: concatenate puts operand 0 \(f32\[b_minus_1,2\] varying\), padded "
                  r"along axis 0 \(dim b - 1\), before other elements of that axis"),
    "split_before_the_end": (lambda x: jnp.split(x, [x.shape[0] - 1])[1] * 2,
                             r"padding: split of padded axis 0 \(dim b\) into parts "
                             r"\['b - 1', 1\]"),
}


@pytest.mark.parametrize("name", sorted(CUT_ERRORS))
def test_a_padded_axis_cut_by_anything_but_a_constant_is_a_clear_error(name):
    """A stride, a cut that depends on the size, a window of at most a constant, a
    ``.set`` whose padding would land on real rows, a cut operand before others: errors
    naming the op and the line, never a silent wrong number."""
    f, pattern = CUT_ERRORS[name]
    step = rt.replicate(f, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(PaddingError, match=pattern) as e:
        step(rt.PerReplica([np.ones((5, 2), np.float32), np.ones((3, 2), np.float32)]))
    assert f"test_dynamic.py:{CUT_ERRORS[name][0].__code__.co_firstlineno}" in str(e.value)


def test_a_slice_from_a_constant_beyond_one_is_an_undecidable_size_comparison():
    """``lax.slice_in_dim(x, 2, b)`` needs ``b >= 2``, which JAX cannot decide while
    tracing (``x[2:]``, which clamps, is supported): an error naming the line."""
    step = rt.replicate(lambda x: lax.slice_in_dim(x, 2, x.shape[0]), num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"tracing <lambda> at test_dynamic.py:\d+ with dynamic "
                                         r"dims \(b\) needs a decision.*'b' >= '2'"):
        step(rt.PerReplica([np.ones((5, 2), np.float32), np.ones((3, 2), np.float32)]))


def _cut_position_loss(p, x):
    """A position embedding of each replica's own length minus one (``wpe[:t - 1]``, added
    to ``x[:, 1:]``): its gradient all-reduce is deferred through the cut dim to the
    table's gradient, as for ``wpe[:t]``."""
    pe = p["wpe"][:x.shape[1] - 1]
    return jnp.mean(jnp.tanh((x[:, 1:] + pe) @ p["w"]) ** 2)


def test_position_gradient_over_a_cut_sequence_axis_equals_jit(monkeypatch):
    import runtime.dynamic as dyn
    monkeypatch.setattr(dyn, "_pad_host", _nan_padded)
    rng = np.random.default_rng(34)
    p = {"wpe": rng.normal(size=(16, 4)).astype(np.float32),
         "w": rng.normal(size=(4, 4)).astype(np.float32)}
    step = rt.replicate(jax.grad(_cut_position_loss), num_replicas=N, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={1: (1,)}, maximum_shapes=[None, (None, 16, None)]))
    xs = [rng.normal(size=(3, t, 4)).astype(np.float32) for t in (3, 13, 2, 5)]
    g = step(p, rt.PerReplica(xs))
    ref = [jax.jit(jax.grad(_cut_position_loss))(p, x) for x in xs]
    for k in p:
        np.testing.assert_allclose(g[k], np.mean([r[k] for r in ref], 0), rtol=1e-5,
                                   atol=1e-6, err_msg=k)


@pytest.mark.parametrize("low, reduction", [("bfloat16", "sum"), ("float16", "mean")])
def test_low_precision_positional_table_over_a_dynamic_sequence(low, reduction):
    """A float32 positional table cast to bfloat16/float16 and gathered at ``arange(t)``
    for a dynamic sequence length ``t`` (2 and 3 on the two replicas): the replicas'
    narrow cotangents are each cast back, then summed in float32, as ``jax.jit`` of the
    sum of the replicas' losses gives them (found by a probe: the gradient sum of a
    dynamic shape was left in the narrow type, bf16 256 where the sum is 257, float16
    "mean" inf where it is 20000)."""
    dtype = jnp.dtype(low)

    def loss(pos, f):  # f: [b, t, 1]
        h = pos.astype(dtype)[jnp.arange(f.shape[1])][None] * f.astype(dtype)
        return jnp.mean(jnp.sum(h.astype(jnp.float32), axis=(1, 2)))
    pos = jnp.zeros((4, 1), jnp.float32)
    if low == "bfloat16":
        fs = [np.full((1, 3, 1), 256.0, np.float32), np.full((1, 2, 1), 1.0, np.float32)]
    else:
        fs = [np.full((1, 3, 1), 20000.0, np.float32) for _ in range(4)]
        fs[1] = fs[1][:, :2]
    n = len(fs)
    want = sum(jax.jit(jax.grad(loss))(pos, jnp.asarray(f)) for f in fs)
    want = want / n if reduction == "mean" else want
    opts = rt.RunOptions(dynamic_shapes=True, dynamic_dims={1: {0: "b", 1: "t"}})
    got = rt.replicate(jax.grad(loss), num_replicas=n, loss_reduction=reduction,
                       options=opts)(pos, rt.PerReplica(fs))
    assert np.all(np.isfinite(np.asarray(want)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


_FFTS = {
    "rfft": lambda v: jnp.abs(jnp.fft.rfft(v, axis=-1)),
    "fft_complex": lambda v: jnp.abs(jnp.fft.fft(v.astype(jnp.complex64), axis=-1)) ** 2,
    "irfft_of_rfft": lambda v: jnp.fft.irfft(jnp.fft.rfft(v) * 2, n=v.shape[-1]),
    "fft2_last_axes": lambda v: jnp.real(jnp.fft.fft2(v.reshape(v.shape[0], 2, 4))).reshape(
        v.shape[0], 8),
}


@pytest.mark.parametrize("name", sorted(_FFTS))
def test_fft_along_static_axes_of_a_dynamic_batch(name):
    """An FFT over the static trailing axes of a value with a dynamic batch axis (a batch
    of signals): exact, each row its own transform, forward and the gradient of a
    mirrored weight. Before: a ``PaddingError`` (every padded FFT refused; found by a
    probe). Along the padded axis itself: the error, naming the axis. Oracle: ``jax.jit``
    on each replica's unpadded batch, gradients averaged."""
    w = np.linspace(0.5, 1.5, 8).astype(np.float32)
    xs = [np.random.RandomState(r).randn(3 + 2 * r, 8).astype(np.float32) for r in range(2)]

    def step(w, x):
        return jax.value_and_grad(lambda w: jnp.mean(_FFTS[name](x * w)))(w)
    loss, grad = rt.replicate(step, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))(
        w, rt.PerReplica(xs))
    want = [jax.jit(step)(w, x) for x in xs]
    for got, (wl, _) in zip(loss.values, want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(wl), rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), np.mean([g for _, g in want], 0), rtol=2e-5,
                               atol=1e-6)
    along = rt.replicate(lambda x: jnp.abs(jnp.fft.fft(x, axis=0)), num_replicas=2,
                         options=rt.RunOptions(dynamic_shapes=True))
    with pytest.raises(ValueError, match=r"fft along axis 1 \(dynamic dim b\) of c64\[8,b\]"):
        along(rt.PerReplica(xs))
