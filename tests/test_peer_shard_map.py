"""Port of jax-ml/jax tests/shard_map_test.py (``ShardMapTest``): the cases that run over
one mesh axis, written as the per-replica step ``replicate`` runs.

How a case maps: ``shard_map(f, mesh, in_specs, out_specs)`` over a mesh axis ``'x'`` of
size n becomes ``rt.replicate(f, num_replicas=n, axis_name='x')``; an input with
``P('x', ...)`` goes in as ``rt.distribute`` (each replica its block of axis 0), one with
``P()`` as a plain (mirrored) array; a per-replica result is compared block by block with
``shard_map``'s global result (its ``out_specs`` say along which axis the blocks are
concatenated). Each case keeps the source's function and its expected values, and also
compares with JAX's ``shard_map`` run here on the same devices (the oracle).

Gradients: the source differentiates the ``shard_map``-ed function from outside (JAX's
derivative of the global program); a ``replicate`` step differentiates from inside, per
replica. With ``loss_reduction="sum"`` a mirrored input's gradient is that global
derivative; with ``"mean"`` it is divided by n (TF's semantics), and a seed of a value
identical on every replica counts once per replica (so the ``psum`` fan-in case gives n
times JAX's cotangent: shown, not hidden). An output the source types per device with
``out_specs=P('x')`` although its value is invariant (an implicit fan-out) is cast to
varying in the step with ``lax.pcast(..., to='varying')``, the cast ``out_specs`` makes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import runtime as rt


def _mesh(n: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()[:n]), ("x",))


def _blocks(out, n: int, axis: int = 0) -> np.ndarray:
    """A result as ``shard_map``'s global array under ``out_specs`` splitting ``axis``: a
    per-replica one's blocks concatenated; a mirrored one (proven identical on every
    replica: ``replicate`` returns one array) repeated n times, as ``shard_map`` gives it."""
    vals = out.values if isinstance(out, rt.PerReplica) else [out] * n
    return np.concatenate([np.asarray(v) for v in vals], axis=axis)


def _rep(f, n, **kw):
    return rt.replicate(f, num_replicas=n, axis_name="x", **kw)


def test_all_gather():
    """``test_all_gather`` on one axis: tiled gathers along axis 0 and along the last."""
    a = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)

    def fwd(a):
        return (lax.all_gather(a, 'x', axis=0, tiled=True),
                lax.all_gather(a, 'x', axis=-1, tiled=True))

    sm = jax.jit(jax.shard_map(fwd, mesh=_mesh(4), in_specs=(P('x'),), out_specs=P('x')))
    c, d = _rep(fwd, 4)(rt.distribute(a, 4))
    want_c, want_d = sm(a)
    # a gather is identical on every replica: one array each
    assert not isinstance(c, rt.PerReplica) and not isinstance(d, rt.PerReplica)
    np.testing.assert_array_equal(np.asarray(c), a)
    np.testing.assert_array_equal(np.asarray(d), np.concatenate(np.split(a, 4), axis=-1))
    np.testing.assert_array_equal(_blocks(c, 4), want_c)
    np.testing.assert_array_equal(_blocks(d, 4), want_d)


def test_matmul_reduce_scatter():
    """``test_matmul_reduce_scatter`` on one axis: a matmul contracting the split
    dimension leaves partial sums, which ``psum_scatter`` adds and splits by rows."""
    a = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    b = np.arange(8 * 8, dtype=np.float32).reshape(8, 8) / 10

    def fwd(a, b):
        c = jnp.matmul(a, b)  # [B, F] {x.unreduced}
        return lax.psum_scatter(c, 'x', scatter_dimension=0, tiled=True)

    sm = jax.jit(jax.shard_map(fwd, mesh=_mesh(4), in_specs=(P(None, 'x'), P('x', None)),
                               out_specs=P('x', None)))
    # a's columns and b's rows per replica: distribute splits axis 0, so a goes transposed
    cols = rt.PerReplica([np.ascontiguousarray(blk) for blk in np.split(a, 4, axis=1)])
    out = _rep(fwd, 4)(cols, rt.distribute(b, 4))
    np.testing.assert_allclose(_blocks(out, 4), a @ b, rtol=1e-6)
    np.testing.assert_allclose(_blocks(out, 4), sm(a, b), rtol=1e-6)


def test_collective_permute():
    a = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)

    def fwd(a):
        axis_size = lax.axis_size('x')
        perm = [(j, (j + 1) % axis_size) for j in range(axis_size)]
        return lax.ppermute(a, 'x', perm=perm)

    c = _blocks(_rep(fwd, 8)(rt.distribute(a, 8)), 8)
    np.testing.assert_array_equal(c[1, :], a[0, :])
    np.testing.assert_array_equal(c, jax.jit(jax.shard_map(
        fwd, mesh=_mesh(8), in_specs=(P('x', None),), out_specs=P('x', None)))(a))


def test_all_to_all():
    """``test_all_to_all`` (a GPU-only case there; the CPU runs it as well) on 8 devices:
    rows split, columns exchanged, out along axis 1."""
    a = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)

    def fwd(a):
        return lax.all_to_all(a, 'x', split_axis=1, concat_axis=1, tiled=True)

    c = _blocks(_rep(fwd, 8)(rt.distribute(a, 8)), 8, axis=1)
    assert (c == np.reshape(a.T, (1, 64))).all()
    np.testing.assert_array_equal(c, jax.jit(jax.shard_map(
        fwd, mesh=_mesh(8), in_specs=(P('x', None),), out_specs=P(None, 'x')))(a))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_all_to_all_grad(reduction):
    """The gradient of ``2 * sum(all_to_all(x))`` with respect to each replica's block is
    2 everywhere, as the source's outside gradient is: per-replica inputs' gradients are
    the global derivative, whatever the loss reduction."""
    a = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)

    def fwd(x):
        return lax.all_to_all(x, 'x', split_axis=1, concat_axis=0, tiled=True)

    def step(x):
        loss, grad = jax.value_and_grad(lambda x: fwd(x).sum() * 2)(x)
        return loss, grad

    loss, grad = _rep(step, 4, loss_reduction=reduction)(rt.distribute(a, 4))
    assert float(np.sum([np.asarray(v) for v in loss.values])) == 2 * sum(range(64))
    np.testing.assert_array_equal(_blocks(grad, 4), 2 * np.ones_like(a))
    sm = jax.shard_map(fwd, mesh=_mesh(4), in_specs=(P('x', None),), out_specs=P(None, 'x'))
    np.testing.assert_array_equal(_blocks(grad, 4), jax.grad(lambda x: sm(x).sum() * 2)(a))


def test_jvp_and_linearize_basic():
    """``test_jvp_basic`` / ``test_linearize_basic`` (one axis): forward mode inside a
    replica is the replica's own; jvp and linearize agree and equal the global ones."""
    x = np.arange(4 * 4, dtype=np.float32).reshape(4, 4)
    g = lambda x: jnp.sin(jnp.cos(x))  # noqa: E731

    def step(x):
        y, y_dot = jax.jvp(g, [x], [x])
        y_, g_lin = jax.linearize(g, x)
        return y, y_dot, y_, g_lin(x)

    y, y_dot, y_, y_dot_ = (_blocks(o, 2) for o in _rep(step, 2)(rt.distribute(x, 2)))
    np.testing.assert_allclose(y, y_, rtol=1e-6)
    np.testing.assert_allclose(y_dot, y_dot_, rtol=1e-6)
    sm = jax.shard_map(g, mesh=_mesh(2), in_specs=(P('x'),), out_specs=P('x'))
    want, want_dot = jax.jvp(sm, [x], [x])
    np.testing.assert_allclose(y, want, rtol=1e-6)
    np.testing.assert_allclose(y_dot, want_dot, rtol=1e-6)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reverse_mode_ad(reduction):
    """``test_reverse_mode_ad``: ``f(x, y)`` with x split (``P('x')``) and y replicated
    (``P(None)``): x's gradient is each replica's own block of the global one, y's the
    global one under ``"sum"`` and its mean over the 2 replicas under ``"mean"``; the
    second derivative in x likewise (``check_grads(order=2)`` there)."""
    def f(x, y):
        return jnp.sin(x) + 3 + jnp.tan(2.) * jnp.cos(x) + y

    x = np.arange(8., dtype=np.float32) / 10.
    y = np.arange(4., dtype=np.float32) / 10.
    ct = np.linspace(-1, 1, 8).astype(np.float32)

    def step(x, y, c):
        gx, gy = jax.grad(lambda x, y: jnp.vdot(f(x, y), c), argnums=(0, 1))(x, y)
        hxx = jax.grad(lambda x: jnp.vdot(jax.grad(lambda x: jnp.vdot(f(x, y), c))(x), c))(x)
        return gx, gy, hxx

    gx, gy, hxx = _rep(step, 2, loss_reduction=reduction)(
        rt.distribute(x, 2), y, rt.distribute(ct, 2))
    sm = jax.shard_map(f, mesh=_mesh(2), in_specs=(P('x'), P(None)), out_specs=P('x'))
    wx, wy = jax.grad(lambda x, y: jnp.vdot(sm(x, y), ct), argnums=(0, 1))(x, y)
    whxx = jax.grad(lambda x: jnp.vdot(jax.grad(lambda x: jnp.vdot(sm(x, y), ct))(x), ct))(x)
    np.testing.assert_allclose(_blocks(gx, 2), wx, rtol=1e-5)
    np.testing.assert_allclose(_blocks(hxx, 2), whxx, rtol=1e-5)
    assert not isinstance(gy, rt.PerReplica)
    np.testing.assert_allclose(np.asarray(gy), wy / (2 if reduction == "mean" else 1),
                               rtol=1e-5)


def test_axis_index():
    """``test_axis_index`` (GPU/TPU there): a step with no arguments."""
    out = _rep(lambda: jax.lax.axis_index('x')[None], 4)()
    np.testing.assert_array_equal(_blocks(out, 4), np.arange(4))


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.everything_saveable],
                         ids=["remat", "everything_saveable"])
def test_remat_basic(policy):
    """``test_remat_basic``: the gradient through ``jax.remat`` (with and without a
    saving policy) of ``sin(sin(x))``."""
    x = np.arange(4., dtype=np.float32)
    f = jax.remat(lambda x: jnp.sin(jnp.sin(x)), policy=policy)
    g = _blocks(_rep(lambda x: jax.grad(lambda x: f(x).sum())(x), 4)(rt.distribute(x, 4)), 4)
    np.testing.assert_allclose(g, np.cos(np.sin(x)) * np.cos(x), atol=1e-3, rtol=1e-3)


def test_psum_transpose_non_zero_cts():
    """``test_psum_transpose_non_zero_cts``: a psum whose result the loss does not read."""
    def f1(x_block):
        return x_block, jax.lax.psum(x_block, axis_name='x')

    def step(x):
        return jax.grad(lambda x: f1(x)[0].sum())(x)

    x1 = np.arange(16., dtype=np.float32)
    np.testing.assert_array_equal(_blocks(_rep(step, 8)(rt.distribute(x1, 8)), 8), np.ones(16))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_fanout_specs_transpose_to_psum(reduction):
    """``in_specs=P(), out_specs=P('x')`` of the identity: its transpose sums the replicas'
    cotangents (JAX: 0 + 1 + 2 + 3 = 6); a mirrored input's gradient under ``"mean"``:
    6 / 4."""
    def step(x, ct):
        return jax.vjp(lambda x: lax.pcast(x, 'x', to='varying'), x)[1](ct)[0]

    sm = jax.shard_map(lambda x: x, mesh=_mesh(4), in_specs=P(), out_specs=P('x'))
    want = jax.vjp(sm, jnp.arange(1.))[1](jnp.arange(4.))[0]
    got = _rep(step, 4, loss_reduction=reduction)(np.arange(1., dtype=np.float32),
                                                  rt.distribute(np.arange(4., dtype=np.float32), 4))
    assert not isinstance(got, rt.PerReplica)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want) / (4 if reduction == "mean" else 1))
    np.testing.assert_allclose(np.asarray(want), [6.])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_fanin_psum_transposes_to_fanout(reduction):
    """``in_specs=P('x'), out_specs=P()`` of ``psum``: JAX's cotangent of every block is the
    output's (1). In a step the output is identical on every replica, so its seed counts
    once per replica (TF): each block's gradient is 4, under either reduction (per-replica
    inputs' gradients are not scaled)."""
    def step(x, ct):
        return jax.vjp(lambda x: lax.psum(x, 'x'), x)[1](ct)[0]

    sm = jax.shard_map(lambda x: lax.psum(x, 'x'), mesh=_mesh(4), in_specs=P('x'), out_specs=P())
    want = jax.vjp(sm, jnp.arange(4.))[1](jnp.array([1.]))[0]
    got = _rep(step, 4, loss_reduction=reduction)(
        rt.distribute(np.arange(4., dtype=np.float32), 4), np.array([1.], np.float32))
    np.testing.assert_allclose(np.asarray(want), np.ones(4))
    np.testing.assert_allclose(_blocks(got, 4), 4 * np.asarray(want))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_psum_with_implicit_fanout_self_transposes(reduction):
    """``in_specs=P('x'), out_specs=P('x')`` of ``psum``: each replica's cotangent of its
    copy of the sum flows to every block (JAX: 6 each); the same in a step."""
    def step(x, ct):
        return jax.vjp(lambda x: lax.pcast(lax.psum(x, 'x'), 'x', to='varying'), x)[1](ct)[0]

    sm = jax.shard_map(lambda x: lax.psum(x, 'x'), mesh=_mesh(4), in_specs=P('x'),
                       out_specs=P('x'))
    want = jax.vjp(sm, jnp.arange(4.))[1](jnp.arange(4.))[0]
    got = _rep(step, 4, loss_reduction=reduction)(
        rt.distribute(np.arange(4., dtype=np.float32), 4),
        rt.distribute(np.arange(4., dtype=np.float32), 4))
    np.testing.assert_allclose(np.asarray(want), 6 * np.ones(4))
    np.testing.assert_allclose(_blocks(got, 4), np.asarray(want))


def test_cumsum_and_repeated_psum():
    """``test_cumsum`` (each block's own cumsum) and ``test_repeated_psum_allowed``
    (https://github.com/jax-ml/jax/issues/19175: a psum of a psum multiplies by 4)."""
    x = np.arange(8., dtype=np.float32)
    np.testing.assert_array_equal(_blocks(_rep(jnp.cumsum, 4)(rt.distribute(x, 4)), 4),
                                  np.concatenate([np.cumsum(b) for b in np.split(x, 4)]))
    with pytest.warns(UserWarning, match="already identical on every replica"):
        y = _rep(lambda x: jax.lax.psum(jax.lax.psum(x, 'x'), 'x'), 4)(
            rt.distribute(np.arange(4., dtype=np.float32), 4))
    np.testing.assert_allclose(np.asarray(y), np.arange(4.).sum(keepdims=True) * 4)


def test_jacrev_explicit():
    """``test_jacrev_explicit``: ``jacrev`` in the per-replica rows ``x`` with the mirrored
    ``w`` an argument: each replica's own Jacobian block."""
    B, N, H = 20, 6, 8
    w = np.arange(N * H, dtype=np.float32).reshape(N, H)
    x = np.arange(B * N, dtype=np.float32).reshape(B, N)

    def f(w, x):
        return jnp.sum(x @ w, axis=-1)

    def f_jac(w, x):
        return jax.jacrev(f, argnums=1)(w, x)

    got = _rep(f_jac, 4)(w, rt.distribute(x, 4))
    sm = jax.jit(jax.shard_map(f_jac, mesh=_mesh(4), in_specs=(P(), P('x', None)),
                               out_specs=P('x', None)))
    np.testing.assert_allclose(_blocks(got, 4), sm(w, x), rtol=1e-6)
    # (x enters linearly: the Jacobian does not depend on it, and comes back as one array)
    assert not isinstance(got, rt.PerReplica)
    for xr in np.split(x, 4):
        np.testing.assert_allclose(np.asarray(got), jax.jacrev(f, argnums=1)(w, xr), rtol=1e-6)


# -- which results are identical on every replica (the *_rep_rule cases) -------------------
# shard_map checks an out_spec's promise of replication against JAX's own typing; a step
# makes the same decision itself: a result proven identical on every replica comes back as
# one array, any other as a PerReplica. The one-axis forms of the source's functions, with
# x mirrored (P(None)) and y, z per replica (P('x')).

def _is_mirrored(out) -> list[bool]:
    return [not isinstance(o, rt.PerReplica) for o in out]


def _rotating_scan(cast: bool):
    """The source's ``f``: three carries rotated through a scan; ``cast``: with its
    ``lax.pcast`` of the mirrored x to varying first, which JAX's own typing needs (a
    carry must keep its type); a step casts such a carry itself."""
    def f(x, y, z):
        x, y, z = x.sum(), y.sum(), z.sum()
        def body(c, _):
            c, *cs = c
            return (*cs, c), None
        if cast:
            x = lax.pcast(x, 'x', to='varying')
        out, _ = jax.lax.scan(body, (x, y, z), None, length=3)
        return [jnp.expand_dims(a, 0) for a in out]
    return f


def test_scan_rep_rule():
    """A carry rotated through a scan takes every position's variance (f: all per replica,
    though the first comes back with x's value after 3 steps; written without the source's
    ``pcast``, which a step does not need: it casts a carry that becomes varying itself,
    where plain ``shard_map`` stops at JAX's carry-type error); an identity body keeps
    each (g: x mirrored, y and z per replica). shard_map agrees: P(None) for g's first result and
    P('x') for the others are accepted, P(None) for f's first is refused."""
    f = _rotating_scan(cast=False)

    def g(x, y, z):
        x, y, z = x.sum(), y.sum(), z.sum()
        def body(c, _):
            return c, None
        out, _ = jax.lax.scan(body, (x, y, z), None, length=1)
        return [jnp.expand_dims(a, 0) for a in out]

    x = np.arange(4, dtype=np.int32)
    args = (x, rt.distribute(x, 2), rt.distribute(x, 2))
    out_f = _rep(f, 2)(*args)
    assert _is_mirrored(out_f) == [False, False, False]
    for r, blk in enumerate(np.split(x, 2)):
        assert [int(np.asarray(o.values[r])[0]) for o in out_f] == [x.sum(), blk.sum(), blk.sum()]
    out_g = _rep(g, 2)(*args)
    assert _is_mirrored(out_g) == [True, False, False]
    jax.shard_map(g, mesh=_mesh(2), in_specs=(P(None), P('x'), P('x')),
                  out_specs=[P(None), P('x'), P('x')])(x, x, x)
    f_src = _rotating_scan(cast=True)
    want = jax.shard_map(f_src, mesh=_mesh(2), in_specs=(P(None), P('x'), P('x')),
                         out_specs=P('x'))(x, x, x)
    for o, w in zip(out_f, want):
        np.testing.assert_array_equal(_blocks(o, 2), w)
    with pytest.raises(ValueError, match="require replication"):
        jax.shard_map(f_src, mesh=_mesh(2), in_specs=(P(None), P('x'), P('x')),
                      out_specs=[P(None), P('x'), P('x')])(x, x, x)


def _rotating_while(cast: bool):
    """The source's ``f`` for ``while_loop`` (see :func:`_rotating_scan`)."""
    def f(x, y, z):
        x, y, z = x.sum(), y.sum(), z.sum()
        def cond(c):
            i, *_ = c
            return i < 5
        def body(c):
            i, c, *cs = c
            return (i + 1, *cs, c)
        if cast:
            x = lax.pcast(x, 'x', to='varying')
        _, *out = jax.lax.while_loop(cond, body, (0, x, y, z))
        return [jnp.expand_dims(a, 0) for a in out]
    return f


def test_while_rep_rule():
    """The same rotation in a ``while_loop`` (5 steps): every carry per replica (without
    the source's ``pcast``, as for scan); an identity body keeps x mirrored."""
    f = _rotating_while(cast=False)

    def g(x, y, z):
        x, y, z = x.sum(), y.sum(), z.sum()
        def cond(c):
            i, *_ = c
            return i < 1
        def body(c):
            i, *cs = c
            return (i + 1, *cs)
        _, *out = jax.lax.while_loop(cond, body, (0, x, y, z))
        return [jnp.expand_dims(a, 0) for a in out]

    x = np.arange(4, dtype=np.int32)
    args = (x, rt.distribute(x, 2), rt.distribute(x, 2))
    out_f = _rep(f, 2)(*args)
    assert _is_mirrored(out_f) == [False, False, False]
    want = jax.shard_map(_rotating_while(cast=True), mesh=_mesh(2),
                         in_specs=(P(None), P('x'), P('x')), out_specs=P('x'))(x, x, x)
    for o, w in zip(out_f, want):
        np.testing.assert_array_equal(_blocks(o, 2), w)
    assert _is_mirrored(_rep(g, 2)(*args)) == [True, False, False]


def test_cond_rep_rule():
    """A ``cond`` of a per-replica operand is per replica; of mirrored operands under a
    per-replica predicate too (the replicas may take different branches); under a
    mirrored predicate it stays mirrored. And https://github.com/jax-ml/jax/issues/24418:
    Python constants returned by the branches of a per-replica predicate."""
    def true_fn(x, y):
        return x

    def false_fun(x, y):
        return x + 1

    x = np.arange(4, dtype=np.int32)
    per = rt.distribute(x, 2)
    out = _rep(lambda x, y: jax.lax.cond(True, true_fn, false_fun, x, y), 2)(per, x)
    assert isinstance(out, rt.PerReplica)
    np.testing.assert_array_equal(_blocks(out, 2), x)
    # mirrored x, predicate on the per-replica y: per replica
    out = _rep(lambda x, y: jax.lax.cond(jnp.any(y > 1), true_fn, false_fun, x, y), 2)(x, per)
    assert isinstance(out, rt.PerReplica)
    np.testing.assert_array_equal(out.values[0], x + 1)  # y = [0, 1]: false
    np.testing.assert_array_equal(out.values[1], x)      # y = [2, 3]: true
    # mirrored x, predicate on the mirrored x: one array
    out = _rep(lambda x, y: jax.lax.cond(jnp.any(x > 0), true_fn, false_fun, x, y), 2)(x, per)
    assert not isinstance(out, rt.PerReplica)
    np.testing.assert_array_equal(np.asarray(out), x)

    def f(a):
        c = jax.lax.cond(jnp.any(a), lambda: 1, lambda: 0)
        return jnp.reshape(c, a.shape)

    a = np.array([True, False])
    got = _blocks(_rep(f, 2)(rt.distribute(a, 2)), 2)
    np.testing.assert_array_equal(got, [1, 0])
    np.testing.assert_array_equal(got, jax.shard_map(f, mesh=_mesh(2), in_specs=P('x'),
                                                     out_specs=P('x'))(a))


def test_switch_rep_rule():
    """``lax.switch`` on a mirrored index over a per-replica operand: per replica."""
    def f(n, x, y):
        return jax.lax.switch(
            n, [lambda x, _: x, lambda x, _: x + 1, lambda x, _: x + 2], x, y)

    x = np.arange(4, dtype=np.int32)
    out = _rep(f, 2)(np.int32(1), rt.distribute(x, 2), x)
    np.testing.assert_array_equal(_blocks(out, 2), x + 1)


# -- custom derivatives (the test_rewrite_process_custom_* cases) --------------------------

def _foo_jvp():
    @jax.custom_jvp
    def foo(x):
        return 2. * x

    @foo.defjvp
    def foo_jvp(primals, tangents):
        (x,), (x_dot,) = primals, tangents
        return foo(x), 2. * x_dot
    return foo


def _foo_vjp(bwd_ones: bool = False):
    """The source's ``foo``: ``2 x`` with a custom VJP of ``2 y_bar``, or (``bwd_ones``,
    ``..._match_more_replicated``) of ones, more replicated than the primal."""
    @jax.custom_vjp
    def foo(x):
        return 2. * x

    def foo_fwd(x):
        return foo(x), None

    def foo_bwd(_, y_bar):
        return (jnp.ones_like(y_bar),) if bwd_ones else (2. * y_bar,)

    foo.defvjp(foo_fwd, foo_bwd)
    return foo


@pytest.mark.parametrize("jit", [True, False])
def test_rewrite_process_custom_jvp_call(jit):
    foo = _foo_jvp()
    g = (lambda x: foo(x) * x)
    g = jax.jit(g) if jit else g
    x = np.arange(4., dtype=np.float32)

    def step(x):
        y2, y_dot = jax.jvp(g, (x,), (3 * x,))
        return g(x), y2, y_dot

    y, y2, y_dot = (_blocks(o, 4) for o in _rep(step, 4)(rt.distribute(x, 4)))
    np.testing.assert_allclose(y, 2 * x * x)
    np.testing.assert_allclose(y2, 2 * x * x)
    np.testing.assert_allclose(y_dot, 2 * 2 * 3 * x * x)


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("case", ["custom_vjp_call", "match_more_replicated", "call_jaxpr"])
def test_rewrite_process_custom_vjp_call(case, jit):
    """``test_rewrite_process_custom_vjp_call`` (``x_bar = 2 * 2 x``), its
    ``_match_more_replicated`` form (a backward function returning ones: ``1 + 2 x``) and
    ``test_rewrite_custom_vjp_call_jaxpr`` (``foo`` inside a scan): the user's backward
    arithmetic is the user's, never rescaled."""
    foo = _foo_vjp(bwd_ones=case == "match_more_replicated")
    if case == "call_jaxpr":
        inner = foo

        def foo(x):
            y, _ = jax.lax.scan(lambda x, _: (inner(x), None), x, None, length=1)
            return y
    g = (lambda x: foo(x) * x)
    g = jax.jit(g) if jit else g
    x = np.arange(4., dtype=np.float32)
    want_bar = np.ones(4) + 2 * x if case == "match_more_replicated" else 2 * 2 * x

    y_, x_bar = _rep(lambda x: jax.value_and_grad(lambda x: g(x).sum())(x), 4)(
        rt.distribute(x, 4))
    assert float(np.sum([np.asarray(v) for v in y_.values])) == float((2 * x * x).sum())
    np.testing.assert_allclose(_blocks(x_bar, 4), want_bar)
    sm = jax.shard_map(g, mesh=_mesh(4), in_specs=(P('x'),), out_specs=P('x'))
    np.testing.assert_allclose(_blocks(x_bar, 4), jax.grad(lambda x: sm(x).sum())(x))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("bwd_ones", [False, True], ids=["2y_bar", "ones"])
def test_custom_vjp_of_a_mirrored_input(bwd_ones, reduction):
    """Not in the source: the same ``foo`` applied to a *mirrored* input (``in_specs=P()``)
    times per-replica data, the case where gradients once came out n times too large.
    Each replica calls ``foo``, so its backward function runs once per replica on that
    replica's own cotangent (as under ``jax.pmap`` and TF's replica context), and ``w``'s
    gradient is the sum (``"sum"``) or mean (``"mean"``) of the replicas'. ``jax.shard_map``
    differentiated outside runs it once on the summed cotangent: the same for a backward
    function linear in its cotangent (``2 y_bar``), not for one that is not (``ones``:
    n times less under shard_map)."""
    foo = _foo_vjp(bwd_ones)
    w = np.array([0.5, -1.0, 2.0, 1.5], np.float32)
    x = np.arange(16., dtype=np.float32).reshape(4, 4) / 10

    def loss(w, x):
        return jnp.sum(foo(w) * x)

    got = _rep(lambda w, x: jax.grad(loss)(w, x), 4, loss_reduction=reduction)(
        w, rt.distribute(x, 4))
    assert not isinstance(got, rt.PerReplica)
    reduce = jax.lax.pmean if reduction == "mean" else jax.lax.psum
    want = jax.pmap(lambda w, x: reduce(jax.grad(loss)(w, x), "i"), axis_name="i",
                    in_axes=(None, 0), devices=jax.devices()[:4])(w, x.reshape(4, 1, 4))[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    # and by hand: replica r's backward function gets y_bar_r = x_r
    per_replica = np.ones((4, 4)) if bwd_ones else 2 * x
    by_hand = per_replica.sum(0) / (4 if reduction == "mean" else 1)
    np.testing.assert_allclose(np.asarray(got), by_hand, rtol=1e-6)
    sm = jax.shard_map(lambda w, x: loss(w, x)[None], mesh=_mesh(4), in_specs=(P(), P('x')),
                       out_specs=P('x'))
    shard_map_grad = jax.grad(lambda w: sm(w, x).sum())(w)
    np.testing.assert_allclose(np.asarray(shard_map_grad), np.ones(4) if bwd_ones else 2 * x.sum(0),
                               rtol=1e-6)


# -- single ops and effects (the "doesn't crash" cases, with their values) -----------------

def test_conv_general_dilated():
    """A convolution used as a matmul over the split contraction, then psum: ``a @ b``."""
    dot = lambda x, y: lax.conv_general_dilated(  # noqa: E731
        x, y, window_strides=(), padding='VALID', dimension_numbers=('NC', 'IO', 'NC'))

    def f(x, y):
        return lax.psum(dot(x, y), 'x')

    a = np.ones((16, 32), np.float32)
    b = np.ones((32, 8), np.float32)
    cols = rt.PerReplica([np.ascontiguousarray(blk) for blk in np.split(a, 4, axis=1)])
    y = _rep(f, 4)(cols, rt.distribute(b, 4))
    assert not isinstance(y, rt.PerReplica)
    np.testing.assert_allclose(np.asarray(y), a @ b, atol=1e-2, rtol=1e-2)


def test_custom_jvp_inside_jit_random_erf_approx_top_k():
    """``test_custom_jvp_inside_jit`` (``jax.jit(jax.nn.relu)``), ``test_random_normal_rules``
    (one key per replica), ``test_erf_rules`` and ``test_approx_top_k``, each against
    ``shard_map``'s result."""
    x = np.arange(16., dtype=np.float32) - 8
    for fn in (jax.jit(jax.nn.relu), jax.lax.erf):
        sm = jax.shard_map(fn, mesh=_mesh(4), in_specs=P('x'), out_specs=P('x'))
        np.testing.assert_allclose(_blocks(_rep(fn, 4)(rt.distribute(x, 4)), 4), sm(x),
                                   rtol=1e-6)
    keys = jax.random.split(jax.random.key(0), 4)
    normal = lambda k: jax.random.normal(k[0], (1,))  # noqa: E731
    got = _rep(normal, 4)(rt.PerReplica([keys[r:r + 1] for r in range(4)]))
    want = jax.shard_map(normal, mesh=_mesh(4), in_specs=P('x'), out_specs=P('x'))(keys)
    np.testing.assert_allclose(_blocks(got, 4), want, rtol=1e-6)
    xk = np.array([3.0, 1.0, 4.0, 2.0], np.float32)
    topk = lambda x: lax.approx_max_k(x, 1)  # noqa: E731
    got = _rep(topk, 2)(rt.distribute(xk, 2))
    want = jax.shard_map(topk, mesh=_mesh(2), in_specs=P('x'), out_specs=P('x'))(xk)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_blocks(g, 2), w)


def test_debug_print_and_pure_callback(capfd):
    """``test_debug_print_jit`` (every replica prints, with its index) and
    ``test_pure_callback_return_multiple_arrays`` (a host function returning two arrays,
    called per replica)."""
    def f(x):
        idx = jax.lax.axis_index('x')
        jax.debug.print("instance {i} has value x={x}", i=idx, x=x)
        y = jnp.cos(x)
        jax.debug.print("instance {i} has value y={y}", i=idx, y=y)
        return y

    x = np.arange(8, dtype=np.float32)
    y = _rep(f, 4)(rt.distribute(x, 4))
    jax.block_until_ready(y)
    jax.effects_barrier()
    out = capfd.readouterr().out
    for i in range(4):
        assert f'instance {i} has value' in out
    np.testing.assert_allclose(_blocks(y, 4), np.cos(x), rtol=1e-6)

    def host_kernel(arr: np.ndarray):
        return arr + 1, arr * 2.0

    def per_shard(x_shard):
        spec = jax.ShapeDtypeStruct(x_shard.shape, x_shard.dtype)
        return jax.pure_callback(host_kernel, (spec, spec), x_shard)

    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    a, b = _rep(per_shard, 2)(rt.distribute(x, 2))
    np.testing.assert_array_equal(_blocks(a, 2), x + 1)
    np.testing.assert_array_equal(_blocks(b, 2), x * 2)
