"""Port of jax-ml/jax tests/pmap_test.py (``PythonPmapTest``, ``VmapPmapCollectivesTest``,
``PmapWithDevicesTest``): the cases over one named axis whose function means the same as
a per-replica step, written for ``replicate``.

How a case maps: ``jax.pmap(f, axis_name='i')`` over a leading axis of size n becomes
``rt.replicate(f, num_replicas=n, axis_name='i')``; an input pmap maps (``in_axes=0``)
goes in as ``rt.PerReplica`` (one row per replica), one it broadcasts (``in_axes=None``)
as a plain (mirrored) array. A per-replica result is stacked back into pmap's layout, a
mirrored one (``replicate`` returns one array for a value proven identical everywhere)
repeated n times. The oracle of every case is ``jax.pmap`` of the same function on the
same CPU devices, compared value and dtype; where the source asserts a hand-computed
value, that assertion is kept too.

Gradients: many source cases differentiate the pmapped function from *outside*
(``grad(pmap(f))``); a step differentiates from inside, so those cases put the same
derivative inside the step and compare with ``pmap`` of that step. pmap's in-step
derivative of a collective is its transpose over the axis (``psum`` of the cotangents),
which is what a step gives for per-replica inputs (``∂ Σ_s L_s / ∂x_r``, README "What the
numbers mean"). For a *mirrored* input a step all-reduces the gradient itself: under
``loss_reduction="mean"`` it is pmap's per-replica gradient ``pmean``-ed, under ``"sum"``
``psum``-ed (README "Porting from pmap": "Gradients"); those cases assert exactly that.
"""
from __future__ import annotations

import functools
import itertools as it
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import runtime as rt

AX = 'i'


def _no_identical_sum_warning():
    """A context in which the "already identical on every replica" warning is an error."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*already identical on every replica")
            yield
    return ctx()


def per(stacked) -> rt.PerReplica:
    """pmap's mapped input (replica axis first) as one value per replica."""
    return rt.PerReplica([np.asarray(stacked)[r] for r in range(np.shape(stacked)[0])])


def stack(out, n: int):
    """Our result in pmap's layout: per-replica values stacked, mirrored ones repeated."""
    def one(leaf):
        if isinstance(leaf, rt.PerReplica):
            return np.stack([np.asarray(v) for v in leaf.values])
        return np.stack([np.asarray(leaf)] * n)
    return jax.tree.map(one, out, is_leaf=lambda a: isinstance(a, rt.PerReplica))


def _close(got, want, rtol, atol):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def same_as_pmap(fn, *args, in_axes=0, rtol=1e-6, atol=1e-6, static_argnums=(), **kw):
    """``fn`` through ``rt.replicate`` equals ``jax.pmap`` on the same n devices (n: the
    leading axis of the mapped args); returns (ours in pmap's layout, pmap's, ours raw)."""
    axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
    n = next(np.shape(jax.tree.leaves(a)[0])[0] for a, ax in zip(args, axes) if ax == 0)
    want = jax.pmap(fn, axis_name=AX, in_axes=axes, static_broadcasted_argnums=static_argnums)(
        *args)
    ours_args = [jax.tree.map(per, a) if ax == 0 else a for a, ax in zip(args, axes)]
    raw = rt.replicate(fn, num_replicas=n, axis_name=AX, static_argnums=static_argnums,
                       **kw)(*ours_args)
    got = stack(raw, n)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(lambda g, w: _close(g, w, rtol, atol), got, want)
    return got, want, raw


def _arange(shape, dtype=np.float32):
    return np.arange(math.prod(shape), dtype=dtype).reshape(shape)


# -- the reductions: psum / pmean / pmax / pmin ------------------------------------------------

@pytest.mark.parametrize("n", [2, 8])
def test_basic(n):
    """``testBasic``: ``x - psum(x)``."""
    x = _arange((n, 4))
    got, _, _ = same_as_pmap(lambda x: x - lax.psum(x, AX), x)
    np.testing.assert_allclose(got, x - np.sum(x, 0))


@pytest.mark.parametrize("n", [2, 8])
def test_mean(n):
    """``testMean``: ``x - pmean(x)``."""
    x = _arange((n, 4))
    got, _, _ = same_as_pmap(lambda x: x - lax.pmean(x, AX), x)
    np.testing.assert_allclose(got, x - np.broadcast_to(np.mean(x, 0), x.shape))


@pytest.mark.parametrize("name,prim,ref", [("ReduceMax", lax.pmax, np.max),
                                           ("ReduceMin", lax.pmin, np.min)])
def test_reduce_max_min(name, prim, ref):
    """``testReduceMax`` / ``testReduceMin``: ``x - pmax(x)``, ``x - pmin(x)``."""
    x = _arange((8, 4))
    got, _, _ = same_as_pmap(lambda x: x - prim(x, AX), x)
    np.testing.assert_allclose(got, x - ref(x, 0))


def test_grad_of_pmax_is_an_error_use_all_reduce():
    """Not a source case of its own (``testReduceMax``'s derivative): JAX has no derivative
    rule for ``pmax``, so pmap and a step both refuse it with JAX's message;
    ``rt.all_reduce(x, "max")`` is differentiable, its derivative going to the replica
    holding the maximum (by hand: a one-hot over the replicas, summed over their seeds)."""
    x = np.random.default_rng(13).normal(size=(8, 3)).astype(np.float32)
    step = lambda x: jax.grad(lambda x: jnp.sum(lax.pmax(x, AX)))(x)  # noqa: E731
    with pytest.raises(NotImplementedError, match="Differentiation rule for 'pmax'"):
        jax.pmap(step, axis_name=AX)(x)
    with pytest.raises(NotImplementedError, match="Differentiation rule for 'pmax'"):
        rt.replicate(step, num_replicas=8, axis_name=AX)(per(x))
    got = rt.replicate(lambda x: jax.grad(lambda x: jnp.sum(rt.all_reduce(x, "max")))(x),
                       num_replicas=8, axis_name=AX)(per(x))
    np.testing.assert_allclose(stack(got, 8), 8.0 * (x == x.max(0)))


def test_pmax_pmin_of_nan_inf_and_signed_zeros():
    """Not in the source (``testReduceMax`` / ``testReduceMin`` with special values): a NaN
    on one replica, infinities and zeros of both signs. The oracle is ``np.max`` / ``np.min``
    over the replica axis (one device's ``jnp.max``): a NaN on any replica is NaN, as psum
    propagates it. Here we differ from pmap on CPU, whose XLA all-reduce max/min skips
    replica 0's NaN (``compiler.lower._nan_kept``); every other column is pmap's."""
    x = np.random.default_rng(14).normal(size=(8, 4)).astype(np.float32)
    x[0, 0], x[:, 1], x[3, 1], x[2, 2], x[5, 3] = np.nan, -0.0, 0.0, np.inf, -np.inf
    fn = lambda x: (lax.pmax(x, AX), lax.pmin(x, AX), lax.psum(x, AX))  # noqa: E731
    got = stack(rt.replicate(fn, num_replicas=8, axis_name=AX)(per(x)), 8)
    pmapped = jax.pmap(fn, axis_name=AX)(x)
    for g, w, p in zip(got, (x.max(0), x.min(0), x.sum(0)), pmapped):
        np.testing.assert_allclose(g, np.broadcast_to(w, g.shape), rtol=1e-6)
        np.testing.assert_allclose(g[:, 1:], np.asarray(p)[:, 1:], rtol=1e-6)
    assert np.isnan(got[0][:, 0]).all() and np.isnan(got[1][:, 0]).all()
    assert (got[0][:, 2] == np.inf).all() and (got[1][:, 3] == -np.inf).all()


def test_zero_size_values():
    """Not in the source: psum / all_gather / ppermute of a zero-size slice. (pmap's
    ``(8, 0)`` result cannot be read with ``np.asarray`` under jax 0.10 — a JAX bug — so
    shapes and dtypes are compared.)"""
    x = _arange((8, 4))
    f = lambda v: (lax.psum(v[:0], AX), lax.all_gather(v[:0], AX),  # noqa: E731
                   lax.ppermute(v[:0], AX, _RING), jnp.zeros((0, 3)))
    want = jax.pmap(f, axis_name=AX)(x)
    got = rt.replicate(f, num_replicas=8, axis_name=AX)(per(x))
    for g, w_ in zip(got, want):
        v = g.values[0] if isinstance(g, rt.PerReplica) else g
        assert (8,) + v.shape == w_.shape and v.dtype == w_.dtype


@pytest.mark.parametrize("dtype", [np.float32, np.int32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("name", ["pargmax", "pargmin"])
def test_arg_all_reduce(name, dtype):
    """``testArgAllReduce`` (its ``in_axes=0`` cases, ``(8,)`` and ``(8, 2)``): the replica
    holding the max / min, against ``jnp.argmax`` / ``argmin`` over the replica axis."""
    from jax._src.lax import parallel
    collective = getattr(parallel, name)
    bulk_op = {"pargmax": np.argmax, "pargmin": np.argmin}[name]
    for shape in [(8,), (8, 2)]:
        x = (np.random.default_rng(18).permutation(math.prod(shape)).reshape(shape) - 5
             ).astype(dtype)
        got, _, _ = same_as_pmap(lambda x: collective(x, AX), x)
        np.testing.assert_array_equal(got[0], bulk_op(x, axis=0))


def test_complex_psum():
    """``testComplexPsum``: ``x - psum(x)`` of complex64."""
    x = _arange((8, 8)).view(np.complex64)
    got, _, _ = same_as_pmap(lambda x: x - lax.psum(x, AX), x)
    np.testing.assert_allclose(got, x - np.sum(x, 0))


def test_trees():
    """``testTrees``: pmax/pmin/psum/pmean, ``all_to_all(x, 0, 0)`` (a transpose) and a
    ring ``ppermute`` of a dict of int arrays."""
    def ptranspose(x, axis_name):
        return lax.all_to_all(x, axis_name, 0, 0)

    def protate(x, axis_name):
        n = lax.axis_size(axis_name)
        return lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])

    n = 8
    x = {'a': np.arange(1 * n * n, 2 * n * n).reshape([n, n]).astype(np.int32),
         'b': np.arange(2 * n * n, 3 * n * n).reshape([n, n]).astype(np.int32),
         'c': np.arange(4 * n * n, 5 * n * n).reshape([n, n]).astype(np.int32)}
    np_f = lambda p: {k: np.broadcast_to(p(v, 0), v.shape) for k, v in x.items()}  # noqa: E731
    for prim, ref in [(lax.pmax, np.max), (lax.pmin, np.min), (lax.psum, np.sum),
                      (lax.pmean, np.mean), (ptranspose, None), (protate, None)]:
        got, _, _ = same_as_pmap(lambda x, prim=prim: prim(x, AX), x)
        if prim is ptranspose:
            want = {k: v.T for k, v in x.items()}
        elif prim is protate:
            want = {k: np.concatenate([v[-1:], v[:-1]]) for k, v in x.items()}
        else:
            want = np_f(ref)
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), got, want)


@pytest.mark.parametrize("prim", [lax.psum, lax.pmean, lax.pmax, lax.pmin, lax.all_gather],
                         ids=lambda p: p.__name__)
def test_trees_of_mirrored_and_per_replica_leaves(prim):
    """``testTrees`` with pmap's ``in_axes=(None, 0)``: one collective over a tuple mixing
    broadcast (mirrored) leaves, per-replica leaves and a constant (one primitive with
    several operands of different variance), its values, and its gradients (w's
    ``pmean``-ed, as above) for the differentiable ones. (psum of the mirrored leaves
    warns that it multiplies them by n, as pmap does; the pmean does not, and neither
    warns of the constant: a sum of constants counts the replicas.)"""
    import contextlib
    rng = np.random.default_rng(17)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    w = rng.normal(size=(4,)).astype(np.float32)
    warns = (pytest.warns(UserWarning, match="already identical on every replica")
             if prim is lax.psum else _no_identical_sum_warning())
    with warns:
        same_as_pmap(lambda w, x: prim((w, x, w * 2, jnp.int32(3), x[0]), AX), w, x,
                     in_axes=(None, 0), rtol=1e-5)
    if prim in (lax.pmax, lax.pmin):
        return

    def loss(w, x):
        a, b = prim((jnp.sin(w), jnp.tanh(x * w)), AX)
        return jnp.sum((a + b) ** 2 * x)

    want = jax.pmap(lambda w, x: (lax.pmean(jax.grad(loss)(w, x), AX), jax.grad(loss, 1)(w, x)),
                    axis_name=AX, in_axes=(None, 0))(w, x)
    with (pytest.warns(UserWarning, match="already identical on every replica")
          if prim is lax.psum else contextlib.nullcontext()):
        got = rt.replicate(lambda w, x: (jax.grad(loss)(w, x), jax.grad(loss, 1)(w, x)),
                           num_replicas=8, axis_name=AX)(w, per(x))
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(stack(g, 8), w_, rtol=1e-4, atol=1e-5)


def test_collectives_with_trees_of_different_dtypes():
    """``testCollectivesWithTreesOfDifferentDtypes``: one collective over a dict of float32
    and int32 leaves (pmean of ints: float32, as pmap)."""
    n = 8
    x = {'a': np.arange(1 * n * n, 2 * n * n, dtype=np.float32).reshape([n, n]),
         'b': np.arange(2 * n * n, 3 * n * n, dtype=np.int32).reshape([n, n]),
         'c': np.arange(4 * n * n, 5 * n * n, dtype=np.float32).reshape([n, n]),
         'd': np.arange(6 * n * n, 7 * n * n, dtype=np.int32).reshape([n, n])}
    for prim, ref in [(lax.pmax, np.max), (lax.pmin, np.min), (lax.psum, np.sum),
                      (lax.pmean, np.mean)]:
        got, _, _ = same_as_pmap(lambda x, prim=prim: prim(x, AX), x)
        for k, v in x.items():
            np.testing.assert_allclose(got[k], np.broadcast_to(ref(v, 0), v.shape), rtol=1e-6)


def test_psum_on_boolean_dtype():
    """``testPsumOnBooleanDtype`` (https://github.com/jax-ml/jax/issues/3123): psum of bools
    counts them (int32), pmean of bools is a float."""
    x = np.array([True, False])
    got, _, _ = same_as_pmap(lambda x: lax.psum(x, AX), x)
    assert list(got) == [1, 1]
    got, _, _ = same_as_pmap(lambda x: lax.pmean(x, AX), x)
    assert list(got) == [1 / 2, 1 / 2]


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_pmap_dtype(dtype):
    """``testPmapDtype`` (https://github.com/jax-ml/jax/issues/6022): ``psum`` of a 0-d
    constant of the dtype keeps the dtype (and is 0)."""
    def func(_):
        return lax.psum(dtype(0), axis_name=AX)

    got, _, raw = same_as_pmap(func, np.arange(8))
    assert got.dtype == dtype and not isinstance(raw, rt.PerReplica)
    np.testing.assert_array_equal(got, np.zeros(8, dtype))


@pytest.mark.parametrize("n", [2, 8])
def test_psum_of_python_scalars_is_the_axis_size(n):
    """Not a source case of its own (``lax.psum(1, axis)`` is pmap's idiom for the axis
    size, as ``testCollectiveConstant``'s ``axis_size``): psum of a Python int, float and
    bool, and pmean / pmax of a Python scalar, each a 0-d result identical everywhere."""
    def f(x):
        return (lax.psum(1, AX), lax.psum(2.5, AX), lax.psum(True, AX), lax.pmean(3., AX),
                lax.pmax(7, AX), x * lax.psum(1, AX))

    x = _arange((n,), np.int32)
    with _no_identical_sum_warning():  # (a sum of constants counts the replicas: no warning)
        got, _, raw = same_as_pmap(f, x)
    assert [int(v) for v in got[0]] == [n] * n
    np.testing.assert_allclose(got[1], np.full(n, 2.5 * n))
    np.testing.assert_array_equal(got[5], x * n)
    assert all(not isinstance(r, rt.PerReplica) for r in raw[:5])


# -- all_gather ----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 8])
def test_gather(n):
    """``testGather``: an untiled gather stacks every replica's row."""
    x = _arange((n, 4))
    got, _, raw = same_as_pmap(lambda x: lax.all_gather(x, AX), x)
    np.testing.assert_allclose(got, np.array([x] * n))
    assert not isinstance(raw, rt.PerReplica)


def test_gather_bool():
    """``testGatherBool``."""
    x = (_arange((8, 4)) % 2).astype(np.bool_)
    got, _, _ = same_as_pmap(lambda x: lax.all_gather(x, AX), x)
    np.testing.assert_array_equal(got, np.array([x] * 8))


def test_gather_negative_axis():
    """``testGatherNegativeAxis``: ``axis=-1`` stacks on a new last axis."""
    x = _arange((8, 4))
    got, _, _ = same_as_pmap(lambda x: lax.all_gather(x, AX, axis=-1), x)
    np.testing.assert_allclose(got, np.array([x.T] * 8))


def test_gather_tiled():
    """``testGatherTiled``."""
    x = _arange((8, 4))
    got, _, _ = same_as_pmap(lambda x: lax.all_gather(x, AX, tiled=True), x)
    np.testing.assert_allclose(got, np.array([x] * 8).reshape(8, -1))


def test_gather_tiled_negative_axis():
    """``testGatherTiledNegativeAxis``."""
    x = _arange((8, 4, 3))
    got, _, _ = same_as_pmap(lambda x: lax.all_gather(x, AX, tiled=True, axis=-1), x)
    np.testing.assert_allclose(got, np.array([x.transpose(1, 0, 2).reshape(4, -1)] * 8))


def test_gather_of_a_scalar():
    """Not in the source: an untiled gather of 0-d values (one per replica) is the vector
    of all of them."""
    x = _arange((8,))
    got, _, _ = same_as_pmap(lambda x: lax.all_gather(x * 2, AX), x)
    np.testing.assert_allclose(got, np.array([2 * x] * 8))


# -- psum_scatter --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 8])
def test_reduce_scatter(n):
    """``testReduceScatter``: each replica keeps its element of the sum."""
    x = _arange((n, n))
    got, _, _ = same_as_pmap(lambda x: lax.psum_scatter(x, AX), x)
    np.testing.assert_allclose(got, np.sum(x, axis=0))


def test_reduce_scatter_tiled():
    """``testReduceScatterTiled``."""
    x = _arange((8, 32))
    got, _, _ = same_as_pmap(lambda x: lax.psum_scatter(x, AX, tiled=True), x)
    np.testing.assert_allclose(got, np.sum(x, axis=0).reshape(8, 4))


def test_reduce_scatter_negative_scatter_dimension():
    """``testReduceScatterNegativeScatterDimension``
    (https://github.com/jax-ml/jax/issues/20125): ``scatter_dimension=-1`` gives the same
    as 1. Under jax 0.10 pmap itself fails to lower the negative form (StableHLO's
    verifier refuses ``scatter_dimension = -1``; JAX fixed it later) and a step, which
    binds JAX's own ``psum_scatter``, fails the same way; under jax 0.11 both run and are
    compared. ``rt.psum_scatter(x, -1)`` normalizes the axis on either."""
    x = _arange((8, 8, 32))
    pos, want, _ = same_as_pmap(
        lambda x: lax.psum_scatter(x, AX, scatter_dimension=1, tiled=True), x)
    S = x.sum(0)
    np.testing.assert_allclose(pos, np.stack([S[:, 4 * r:4 * r + 4] for r in range(8)]))
    neg_f = lambda x: lax.psum_scatter(x, AX, scatter_dimension=-1, tiled=True)  # noqa: E731
    try:
        neg_want = jax.pmap(neg_f, axis_name=AX)(x)
    except ValueError as e:
        assert "scatter_dimension" in str(e)
        with pytest.raises(Exception, match="scatter_dimension"):
            rt.replicate(neg_f, num_replicas=8, axis_name=AX)(per(x))
    else:
        np.testing.assert_allclose(neg_want, want)
        same_as_pmap(neg_f, x)
    ours = rt.replicate(lambda x: rt.psum_scatter(x, scatter_dimension=-1), num_replicas=8,
                        axis_name=AX)(per(x))
    np.testing.assert_allclose(stack(ours, 8), want)


@pytest.mark.parametrize("name,prim", [("Gather", lax.all_gather),
                                       ("ReduceScatter", lax.psum_scatter)])
def test_vmap_of(name, prim):
    """``testVmapOf``: ``vmap(pmap(prim))`` over a leading batch of 4; in a step the vmap is
    inside: each replica maps the collective over its rows' batch axis."""
    x = _arange((4, 8, 8))
    want = jnp.stack([jax.pmap(functools.partial(prim, axis_name=AX), axis_name=AX)(xs)
                      for xs in x], axis=0)
    xt = np.ascontiguousarray(x.transpose(1, 0, 2))  # the replica axis first
    got, _, _ = same_as_pmap(lambda x: jax.vmap(functools.partial(prim, axis_name=AX))(x), xt)
    np.testing.assert_allclose(np.moveaxis(got, 0, 1), want)


# -- all_to_all / pswapaxes ----------------------------------------------------------------

@pytest.mark.parametrize("split_axis,concat_axis", list(it.product(range(2), range(2))))
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_, np.complex64],
                         ids=lambda d: np.dtype(d).name)
def test_all_to_all(split_axis, concat_axis, dtype):
    """``testAllToAll`` (four dtypes of ``lax_test_util.all_dtypes``): untiled
    ``all_to_all`` is a move of axes of the global (8, 8, 8) array."""
    x = (_arange((8, 8, 8)) % 5).astype(dtype)
    got, _, _ = same_as_pmap(lambda x: lax.all_to_all(x, AX, split_axis, concat_axis), x)
    ref = np.moveaxis(x, (0, split_axis + 1), (concat_axis + 1, 0))
    np.testing.assert_array_equal(got, ref)


_NEG_A2A = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np, jax
from jax import lax
import runtime as rt
x = np.random.default_rng(0).normal(size=(8, 8, 8)).astype(np.float32)
f = lambda x: lax.all_to_all(x, 'i', -2, -1)
if sys.argv[1] == 'pmap':
    out = np.asarray(jax.pmap(f, axis_name='i')(x))
else:
    res = rt.replicate(f, num_replicas=8, axis_name='i')(rt.PerReplica(list(x)))
    out = np.stack([np.asarray(v) for v in res.values])
pos = np.asarray(jax.pmap(lambda x: lax.all_to_all(x, 'i', 0, 1), axis_name='i')(x))
print('MAXDIFF', float(np.abs(out - pos).max()))
"""


def test_all_to_all_negative_axes():
    """``testAllToAllNegativeAxes`` (https://github.com/jax-ml/jax/issues/20125): axes
    ``(-2, -1)`` give the same as ``(0, 1)``. Under jax 0.10 pmap of the negative form
    kills the process (a segmentation fault in XLA:CPU; JAX fixed it later); a step's
    import makes the axes non-negative, so it gives the numbers of ``(0, 1)`` on every
    JAX (before, it crashed as pmap does). Each runs in its own process here."""
    import subprocess
    import sys

    def run(which):
        return subprocess.Popen([sys.executable, "-c", _NEG_A2A, which], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, cwd=os.path.dirname(
                                    os.path.dirname(os.path.abspath(__file__))))

    procs = {w: run(w) for w in ("pmap", "ours")}
    res = {w: (p.communicate(timeout=120)[0], p.returncode) for w, p in procs.items()}
    assert res["ours"][1] == 0 and "MAXDIFF 0.0" in res["ours"][0], res["ours"]
    if res["pmap"][1] == 0:
        assert "MAXDIFF 0.0" in res["pmap"][0], res["pmap"]
    else:  # the JAX bug: pmap dies of a signal
        assert res["pmap"][1] < 0, res


@pytest.mark.parametrize("split_axis,concat_axis", list(it.product(range(3), range(3))))
def test_all_to_all_vs_vmap(split_axis, concat_axis):
    """``testAllToAllVsVmap``: pmap's and vmap's all_to_all agree; so does a step's."""
    def f(x):
        return lax.all_to_all(x, AX, split_axis=split_axis, concat_axis=concat_axis)

    x = np.arange(8 ** 4, dtype=np.int32).reshape((8,) * 4)
    got, _, _ = same_as_pmap(f, x)
    np.testing.assert_array_equal(got, jax.vmap(f, axis_name=AX)(x))


@pytest.mark.parametrize("split_axis,concat_axis,vmap_axis",
                         [(0, 0, 0), (0, 2, 1), (1, 0, 3), (2, 1, 2), (2, 2, 0), (1, 1, 1)])
def test_all_to_all_in_vmap(split_axis, concat_axis, vmap_axis):
    """``testAllToAllInVmap`` (6 of its 36 axis combinations): ``vmap`` of all_to_all inside
    the step, against pmap of the same ``vmap``."""
    def f(x):
        return lax.all_to_all(x, AX, split_axis=split_axis, concat_axis=concat_axis)

    x = np.arange(8 ** 5, dtype=np.int32).reshape((8,) * 5)
    same_as_pmap(jax.vmap(f, in_axes=vmap_axis), x)


def test_pswapaxes():
    """``testPswapaxes``: ``pswapaxes(x, 'i', 1)`` swaps the replica axis with axis 1."""
    x = np.arange(8 * 3 * 8 * 5, dtype=np.int32).reshape(8, 3, 8, 5)
    got, _, _ = same_as_pmap(lambda x: lax.pswapaxes(x, AX, 1), x)
    np.testing.assert_array_equal(got, np.swapaxes(x, 0, 2))


def test_grad_of_pswapaxes():
    """``testGradOfPswapaxes``: a gradient taken inside the step (as in the source) through
    ``pswapaxes``; ``w`` per replica."""
    x = _arange((8, 1, 8))
    w = np.arange(8, dtype=np.float32)

    def f(x, w):
        g = lambda x: jnp.sum(lax.pswapaxes(x, AX, 1) * w)  # noqa: E731
        return jax.grad(g)(x)

    got, _, _ = same_as_pmap(f, x, w)
    np.testing.assert_allclose(got, np.tile(w, reps=8).reshape(x.shape))


# -- ppermute / pshuffle -------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 8])
def test_collective_permute(n):
    """``testCollectivePermute``: a ring rotation of int rows."""
    rotation = [(i, (i + 1) % n) for i in range(n)]
    x = np.arange(4 * n, dtype=np.int32).reshape((n, 4))
    got, _, _ = same_as_pmap(lambda x: lax.ppermute(x, perm=rotation, axis_name=AX), x)
    np.testing.assert_array_equal(got, np.roll(x, shift=1, axis=0))


def test_collective_permute_cyclic_with_pshuffle():
    """``testCollectivePermuteCyclicWithPShuffle``: ``pshuffle`` (perm[i] is the source of
    replica i) of 0-d values."""
    values = np.arange(8, dtype=np.int32)
    shift_right = [(i - 1) % 8 for i in range(8)]
    got, _, _ = same_as_pmap(lambda x: lax.pshuffle(x, perm=shift_right, axis_name=AX), values)
    np.testing.assert_array_equal(got, np.roll(values, 1))


def test_pshuffle_with_bad_perm():
    """``testPShuffleWithBadPerm``: the same ``ValueError`` as pmap's."""
    bad_perm = list(range(8))
    bad_perm[0] = 1
    f = lambda x: lax.pshuffle(x, perm=bad_perm, axis_name=AX)  # noqa: E731
    msg = r"`perm` does not represent a permutation: \[1.*\]"
    with pytest.raises(ValueError, match=msg):
        jax.pmap(f, AX)(np.arange(8))
    with pytest.raises(ValueError, match=msg):
        rt.replicate(f, num_replicas=8, axis_name=AX)(per(np.arange(8)))


def test_ppermute_with_zip_object():
    """``testPpermuteWithZipObject`` (https://github.com/jax-ml/jax/issues/1703): the perm
    given as a ``zip``."""
    perm = [7] + list(range(7))
    got, _, _ = same_as_pmap(
        lambda x: lax.ppermute(x, AX, list(zip(perm, range(8)))), np.arange(8, dtype=np.float32))
    np.testing.assert_allclose(got, np.asarray(perm, np.float32))


def test_ppermute_partial_receives_zeros():
    """``testCollectivePermuteGrad``'s forward: a non-cyclic shift, replica 0 receives
    nothing (zeros)."""
    shift_right = [(i, i + 1) for i in range(7)]
    x = np.arange(8, dtype=np.float32) + 1
    got, _, _ = same_as_pmap(lambda x: lax.ppermute(x, perm=shift_right, axis_name=AX), x)
    np.testing.assert_allclose(got, np.concatenate([[0], x[:-1]]))


def test_ppermute_agrees_with_vmap():
    """``testPPermuteAgreesWithVmap``: 3 replicas, ``perm=[[1, 0], [2, 1], [0, 2]]``."""
    def f(x):
        return lax.ppermute(x, AX, [[1, 0], [2, 1], [0, 2]])

    xs = np.arange(3, dtype=np.int32) * 10
    got, _, _ = same_as_pmap(f, xs)
    np.testing.assert_array_equal(got, jax.vmap(f, axis_name=AX)(xs))


def test_rule30():
    """``testRule30``: a halo exchange (two ppermutes of bool slices) running rule 30 for
    9 steps; each step's board fed back as the next step's per-replica input."""
    device_count = 8

    def send_right(x, axis_name):
        perm = [(i, (i + 1) % device_count) for i in range(device_count)]
        return lax.ppermute(x, perm=perm, axis_name=axis_name)

    def send_left(x, axis_name):
        perm = [((i + 1) % device_count, i) for i in range(device_count)]
        return lax.ppermute(x, perm=perm, axis_name=axis_name)

    def update_board(board):
        left, right, center = board[:-2], board[2:], board[1:-1]
        return lax.bitwise_xor(left, lax.bitwise_or(center, right))

    def step(board_slice):
        left, right = board_slice[:1], board_slice[-1:]
        right, left = send_left(left, AX), send_right(right, AX)
        return update_board(jnp.concatenate([left, board_slice, right]))

    board = np.zeros(40, dtype=bool)
    board[board.shape[0] // 2] = True
    ours = rt.replicate(step, num_replicas=device_count, axis_name=AX)
    theirs = jax.pmap(step, axis_name=AX)
    b_ours, b_theirs = per(board.reshape((device_count, -1))), board.reshape((device_count, -1))
    boards = [''.join('*' if x else ' ' for x in board)]
    for _ in range(9):
        b_ours, b_theirs = ours(b_ours), theirs(b_theirs)
        got = stack(b_ours, device_count)
        np.testing.assert_array_equal(got, np.asarray(b_theirs))
        boards.append(''.join('*' if x else ' ' for x in got.ravel()))
    assert '\n'.join(boards) == '\n'.join((
        '                    *                   ',
        '                   ***                  ',
        '                  **  *                 ',
        '                 ** ****                ',
        '                **  *   *               ',
        '               ** **** ***              ',
        '              **  *    *  *             ',
        '             ** ****  ******            ',
        '            **  *   ***     *           ',
        '           ** **** **  *   ***          ',
    ))


# -- axis_index / axis_size / constants ----------------------------------------------------

def test_axis_index():
    """``testAxisIndex``: ``x + axis_index``, int32."""
    got, _, _ = same_as_pmap(lambda x: x + lax.axis_index(AX), np.ones(8, np.int32))
    np.testing.assert_array_equal(got, 1 + np.arange(8))


def test_axis_index_in_initial_style():
    """``testAxisIndexInInitialStyle``: ``axis_index`` inside a scan body."""
    def f(x):
        def body(carry, i):
            return carry + i + lax.axis_index(AX), None
        return lax.scan(body, 0, x)[0]

    got, _, _ = same_as_pmap(f, np.ones((8, 10), np.int32))
    np.testing.assert_array_equal(got, (np.arange(8, dtype=np.int32) + 1) * 10)


@pytest.mark.parametrize("remat", [jax.remat, jax.checkpoint], ids=["remat", "checkpoint"])
def test_axis_index_remat(remat):
    """``testAxisIndexRemat`` (https://github.com/jax-ml/jax/issues/2716): a key folded with
    the axis index under remat; here also its values, equal to pmap's."""
    def f(key):
        key = jax.random.fold_in(key, lax.axis_index(AX))
        return jax.random.bernoulli(key, p=0.5, shape=(16,))

    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    same_as_pmap(remat(f), np.asarray(keys))


def test_collective_constant():
    """``testCollectiveConstant``: ``axis_size`` is n on every replica."""
    got, _, raw = same_as_pmap(lambda x: lax.axis_size(AX), np.arange(8))
    np.testing.assert_array_equal(got, np.repeat(8, 8))
    assert not isinstance(raw, rt.PerReplica)


def test_pmap_constant():
    """``testPmapConstant``: a closed-over constant array indexed in the step; and
    ``testPmapConstantDevices``' ``lambda x: 3`` (a Python constant result: one 0-d array,
    mirrored)."""
    const = jnp.arange(16, dtype=np.int32)
    x = np.arange(8, dtype=np.int32)
    got, _, _ = same_as_pmap(lambda x: x + const[15], x)
    np.testing.assert_array_equal(got, x + np.int32(15))
    got, _, raw = same_as_pmap(lambda x: 3, np.arange(7))
    np.testing.assert_array_equal(got, np.repeat(3, 7))
    assert not isinstance(raw, rt.PerReplica)


# -- mixed arguments, composition with jit / vmap / scan / cond ----------------------------

def test_partially_mapped():
    """``testPartiallyMapped``: ``in_axes=(None, 0)``: x mirrored, y per replica; f returns
    the mirrored x, g ``x - psum(y)`` (mirrored too: a step returns one array for each)."""
    x = np.array(3., dtype=np.float32)
    y = _arange((8, 4))
    got, _, raw = same_as_pmap(lambda x, y: x, x, y, in_axes=(None, 0))
    np.testing.assert_allclose(got, np.broadcast_to(x, (8,)))
    assert not isinstance(raw, rt.PerReplica)
    got, _, raw = same_as_pmap(lambda x, y: x - lax.psum(y, AX), x, y, in_axes=(None, 0))
    np.testing.assert_allclose(got, np.broadcast_to(x - np.sum(y, 0, keepdims=True), y.shape))
    assert not isinstance(raw, rt.PerReplica)


def test_jit_pmap_composition():
    """``testJitPmapComposition`` (``pmap(jit(f))``) and ``testJitInPmap`` (a jitted
    function inside the step, then psum)."""
    f = lambda x: x - lax.psum(x, AX)  # noqa: E731
    x = _arange((8, 4))
    got, _, _ = same_as_pmap(jax.jit(f), x)
    np.testing.assert_allclose(got, x - np.sum(x, 0))

    def foo(x):
        bar = jax.jit(lambda y: y + 1)
        return lax.psum(bar(x), AX)

    got, _, _ = same_as_pmap(foo, np.ones((8, 1), np.float32))
    np.testing.assert_allclose(got, np.ones((8, 1)) * 8 * 2)


def test_collectives_in_nested_jit_scan_cond_and_fori():
    """Not a source case of its own (``testJitInPmap``, ``testAxisIndexInInitialStyle`` and
    ``test_issue_1062``'s ``fori_loop`` in one step): psum inside nested jits, pmean in a
    scan body, pmax in both branches of a cond on a mirrored predicate, ppermute in a
    fori_loop, all_gather in a while_loop with a mirrored trip count."""
    n = 8
    ring = [(i, (i + 1) % n) for i in range(n)]

    def step(x, k):
        a = jax.jit(lambda v: jax.jit(lambda u: lax.psum(u * 2, AX))(v) + 1)(x)
        b, ys = lax.scan(lambda c, v: (c + lax.pmean(v, AX), lax.psum(c, AX)), 0., x)
        c = lax.cond(k > 0, lambda v: lax.pmax(v, AX), lambda v: -lax.pmax(-v, AX), x)
        d = lax.fori_loop(0, 3, lambda i, v: lax.ppermute(v, AX, ring) + i, x)
        e = lax.while_loop(lambda s: s[0] < k, lambda s: (s[0] + 1, s[1] + lax.all_gather(
            s[1][:1], AX, tiled=True).sum()), (0, x))[1]
        return a, b, ys, c, d, e

    x = np.random.default_rng(1).normal(size=(n, 5)).astype(np.float32)
    # (the scan's psum of its carry, a pmean: already identical everywhere, as the step
    # warns; pmap multiplies it by n as well)
    with pytest.warns(UserWarning, match="already identical on every replica"):
        same_as_pmap(step, x, np.int32(2), in_axes=(0, None), rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match="already identical on every replica"):
        same_as_pmap(step, x, np.int32(-1), in_axes=(0, None), rtol=1e-5, atol=1e-5)


def test_vmap_collectives_over_both_axes():
    """``testCollectivesWithVmap`` (``pmap(vmap(f, axis_name='j'))``, 2 x 2): psum / pmean /
    pmax / pmin over ``('i', 'j')``, the replica axis and a vmap axis inside the step."""
    x = np.random.default_rng(2).normal(size=(2, 2, 16, 16)).astype(np.float32)
    for collective in (lax.psum, lax.pmean, lax.pmax, lax.pmin):
        @functools.partial(jax.vmap, axis_name='j')
        def f(x, y, collective=collective):
            return x + collective(x.dot(y), (AX, 'j'))

        got, _, _ = same_as_pmap(f, x, x, rtol=1e-4, atol=1e-4)
        want = jax.vmap(f, axis_name=AX)(x, x)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_ppermute_with_vmap():
    """``testPPermuteWithVmap``: ``pmap(vmap(f))`` with a ppermute over the replica axis."""
    perm = [(0, 1), (1, 0)]

    @jax.vmap
    def f(x, y):
        return x + lax.ppermute(x.dot(y), AX, perm)

    x = np.ones((2, 2, 16, 16), np.float32)
    same_as_pmap(f, x, x)


@pytest.mark.parametrize("name,prim,tiled", [
    ("AllGather", lax.all_gather, False), ("AllGatherTiled", lax.all_gather, True),
    ("ReduceScatter", lax.psum_scatter, False), ("ReduceScatterTiled", lax.psum_scatter, True)])
def test_vs_vmap(name, prim, tiled):
    """``testVsVmap`` / ``testWithVmap``: all_gather / psum_scatter over 4 replicas equal
    vmap's over an axis of 4, and ``pmap(vmap(prim))`` equals ``vmap(pmap(prim))``."""
    x = np.arange(4 * 4 * 8, dtype=np.int32).reshape(4, 4, 8)
    f = functools.partial(prim, axis_name=AX, tiled=tiled)
    got, _, _ = same_as_pmap(f, x)
    np.testing.assert_array_equal(got, jax.vmap(f, axis_name=AX)(x))
    y = np.ones((2, 4, 4, 8), np.float32)
    got, _, _ = same_as_pmap(jax.vmap(f), np.ascontiguousarray(y.transpose(1, 0, 2, 3)))
    np.testing.assert_array_equal(np.moveaxis(got, 0, 1),
                                  jax.vmap(jax.pmap(f, axis_name=AX))(y))


def test_pmap_static_argnums():
    """``testPmapStaticArgnums``: a static callable argument."""
    def f(x, y):
        return jnp.sin(x + y())

    x = _arange((8, 4))
    y = lambda: 3.  # noqa: E731
    got, _, _ = same_as_pmap(f, x, y, in_axes=(0, None), static_argnums=(1,))
    np.testing.assert_allclose(got, np.sin(x + 3.), rtol=1e-6)


def test_pmap_dict_out_and_many_args():
    """``testPmapDictOutAxes`` (a dict result, issue 6410) and ``testManyArgs`` (a list of
    per-replica 0-d arguments summed; 250 here, 500 there)."""
    got, _, _ = same_as_pmap(lambda x: {'a': x}, np.arange(8, dtype=np.int32))
    np.testing.assert_array_equal(got['a'], np.arange(8))
    args = [np.array([i] * 8, np.int32) for i in range(250)]
    got, _, _ = same_as_pmap(lambda args_list: sum(args_list), args)
    np.testing.assert_array_equal(got, np.array([sum(range(250))] * 8))


# -- derivatives -----------------------------------------------------------------------------

def test_jvp_and_partial_eval():
    """``testJvpAndPartialEval`` (``linearize`` of ``sin``) inside the step; and the same of a
    psum: forward mode through a collective is per replica, as in pmap (the tangent is
    psum-ed with the primal)."""
    x = _arange((8, 4))

    def step(x):
        _, lin = jax.linearize(jnp.sin, x)
        _, lin2 = jax.linearize(lambda x: lax.psum(jnp.sin(x), AX), x)
        return lin(jnp.ones_like(x)), lin2(x)

    got, _, _ = same_as_pmap(step, x, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[0], np.cos(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], np.broadcast_to(np.sum(np.cos(x) * x, 0), x.shape),
                               rtol=1e-5, atol=1e-4)


def test_grad_basic():
    """``testGradBasic`` (both classes): ``grad(sum(sin(x)))`` in the step is ``cos(x)``."""
    x = _arange((8, 4))
    got, _, _ = same_as_pmap(lambda x: jax.grad(lambda x: jnp.sum(jnp.sin(x)))(x), x)
    np.testing.assert_allclose(got, np.cos(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [2, 8])
def test_grad_of_psum(n):
    """``testGradOfPsum`` (``check_grads`` of ``pmap(psum)``, order 2, fwd and rev) inside
    the step: the reverse derivative of ``<psum(x), ct_r>`` w.r.t. replica r's x is
    ``Σ_s ct_s`` (psum transposes to psum), forward mode gives ``psum(t)``, and the second
    order (grad of grad of ``<psum(x)³, ct>``) equals pmap's."""
    x = _arange((n, 4)) / 10
    ct = np.random.default_rng(3).normal(size=(n, 4)).astype(np.float32)

    def step(x, ct):
        rev = jax.grad(lambda x: jnp.vdot(lax.psum(x, AX), ct))(x)
        fwd = jax.jvp(lambda x: lax.psum(x, AX), (x,), (ct,))[1]
        g = lambda x: jnp.vdot(lax.psum(x, AX) ** 3, ct)  # noqa: E731
        second = jax.grad(lambda x: jnp.vdot(jax.grad(g)(x), ct))(x)
        return rev, fwd, second

    got, _, _ = same_as_pmap(step, x, ct, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0], np.broadcast_to(ct.sum(0), x.shape), rtol=1e-5)
    np.testing.assert_allclose(got[1], np.broadcast_to(ct.sum(0), x.shape), rtol=1e-5)
    # by hand: d/dx_r Σ_s <d/dx_s Σ_t <S³, ct_t>, ct_s> = 6 S (Σ ct)², with S = Σ_s x_s
    S, C = x.sum(0), ct.sum(0)
    np.testing.assert_allclose(got[2], np.broadcast_to(6 * S * C * C, x.shape), rtol=1e-4)


@pytest.mark.parametrize("n", [2, 8])
def test_grad_of_pmean(n):
    """Not a source case of its own (``testMean``'s derivative): reverse and forward
    derivatives of ``pmean`` inside the step: ``Σ_s ct_s / n`` and ``pmean(t)``."""
    x = _arange((n, 3))
    ct = np.random.default_rng(4).normal(size=(n, 3)).astype(np.float32)

    def step(x, ct):
        return (jax.grad(lambda x: jnp.vdot(lax.pmean(x, AX) ** 2, ct))(x),
                jax.jvp(lambda x: lax.pmean(x, AX), (x,), (ct,))[1])

    got, _, _ = same_as_pmap(step, x, ct, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        got[0], np.broadcast_to(2 * x.mean(0) * ct.sum(0) / n, x.shape), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["psum", "pmean"])
def test_linear_transpose_of_a_collective_matches_pmap_and_vjp(name):
    """Not in the source (``testGradOfPsum``'s reverse mode through ``jax.linear_transpose``,
    the transpose ``vjp`` is built on): in pmap, ``linear_transpose(psum)(c)`` and
    ``vjp(psum)[1](c)`` are the same (``n · c``; pmean's: ``c``), and in a step ``vjp`` gives
    that too (a seed of a value identical on every replica counts once per replica), and
    so does ``linear_transpose`` (before, it missed that rule and gave 1/n of both,
    silently)."""
    prim = {"psum": lax.psum, "pmean": lax.pmean}[name]
    x = _arange((8, 2))
    c = np.array([1., 10.], np.float32)

    def step(x, c):
        f = lambda x: prim(x, AX)  # noqa: E731
        return jax.linear_transpose(f, x)(c)[0], jax.vjp(f, x)[1](c)[0]

    want = jax.pmap(step, axis_name=AX, in_axes=(0, None))(x, c)
    np.testing.assert_allclose(want[0], want[1])
    np.testing.assert_allclose(want[0], np.broadcast_to(c * (8 if name == "psum" else 1), (8, 2)))
    got = rt.replicate(step, num_replicas=8, axis_name=AX)(per(x), c)
    np.testing.assert_allclose(stack(got[1], 8), want[1])            # vjp: as pmap
    np.testing.assert_allclose(stack(got[0], 8), want[0])            # linear_transpose


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_transpose_wrt_a_mirrored_argument_is_reduced_like_vjp(reduction):
    """Not in the source: ``linear_transpose`` of ``w ↦ w · x_r`` w.r.t. the mirrored w, with
    per-replica cotangents, against the same step's ``vjp`` (README "What the numbers
    mean": a mirrored input's reverse derivative is ``c · ∇ Σ_r``: the mean of pmap's
    per-replica ones under ``"mean"``, their sum under ``"sum"``). Before, a step's
    ``linear_transpose`` gave the sum under either reduction."""
    x = _arange((8, 2))
    c = x + 1
    w = np.ones(2, np.float32)

    def step(w, x, c):
        return (jax.linear_transpose(lambda w: w * x, w)(c)[0],
                jax.vjp(lambda w: w * x, w)[1](c)[0])

    per_replica = np.asarray(jax.pmap(step, axis_name=AX, in_axes=(None, 0, 0))(w, x, c)[1])
    want = per_replica.mean(0) if reduction == "mean" else per_replica.sum(0)
    got = rt.replicate(step, num_replicas=8, axis_name=AX, loss_reduction=reduction)(
        w, per(x), per(c))
    np.testing.assert_allclose(np.asarray(got[1]), want)             # vjp
    np.testing.assert_allclose(np.asarray(got[0]), want)             # linear_transpose


def test_vjp_with_mixed_seeds_and_hessian_of_psum():
    """Not a source case of its own (``testGradOfPsum``, order 2): ``vjp`` of a function
    returning a psum (seeded with a mirrored cotangent) and a per-replica value (seeded per
    replica), w.r.t. per-replica x and (with a ``sin(w)`` output too) the mirrored w; and
    ``jax.hessian`` of ``sum(psum(x)³)``: pmap's numbers (w's ``pmean``-ed)."""
    rng = np.random.default_rng(15)
    x, d = (rng.normal(size=(8, 4)).astype(np.float32) for _ in range(2))
    c, w = (rng.normal(size=(4,)).astype(np.float32) for _ in range(2))

    def step(w, x, d, c):
        gx = jax.vjp(lambda x: (lax.psum(x, AX), x * 2), x)[1]((c, d))[0]
        gw = jax.vjp(lambda w: (lax.psum(w * x, AX), w * x * 2, jnp.sin(w)), w)[1]((c, d, c))[0]
        return gw, gx, jax.hessian(lambda x: jnp.sum(lax.psum(x, AX) ** 3))(x)

    want = jax.pmap(lambda *a: (lambda g: (lax.pmean(g[0], AX), g[1], g[2]))(step(*a)),
                    axis_name=AX, in_axes=(None, 0, 0, None))(w, x, d, c)
    # (jacfwd's basis tangents are constants, identical everywhere: the psum's tangent
    # rule sums them, n times one, as the step warns and as pmap computes too)
    with pytest.warns(UserWarning, match="already identical on every replica"):
        got = rt.replicate(step, num_replicas=8, axis_name=AX)(w, per(x), per(d), c)
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(stack(g, 8), w_, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(want[1], np.broadcast_to(8 * c, (8, 4)) + 2 * d, rtol=1e-5)


def test_jvp_of_a_mirrored_primal_with_per_replica_tangents():
    """Not in the source (``testJvpAndPartialEval`` with pmap's ``in_axes=(None, 0)``): a
    forward derivative at a mirrored (broadcast) primal along per-replica tangents. pmap
    runs it, and so does a step's ``jax.jvp`` (the mirrored primal stays mirrored, its
    tangent per replica: a ``pvary`` of the tangent, already varying, is the identity;
    before, JAX's value-variance types failed inside: ``pvary is a invariant->variant
    collective``). ``jax.linearize`` at the mirrored primal, then fed a per-replica
    tangent, is the ``jax.jvp`` there (before: JAX's refusal of a tangent of another type,
    naming ``pcast`` and the internal axis), and with the primal cast to varying
    (``lax.pcast``) the same: pmap's numbers."""
    rng = np.random.default_rng(16)
    t = rng.normal(size=(8, 4)).astype(np.float32)
    w = rng.normal(size=(4,)).astype(np.float32)
    f = lambda w: jnp.sin(w) * lax.psum(w, AX)  # noqa: E731
    want = jax.pmap(lambda w, t: jax.jvp(f, (w,), (t,)), axis_name=AX, in_axes=(None, 0))(w, t)
    with pytest.warns(UserWarning, match="already identical on every replica"):  # psum(w)
        got = rt.replicate(lambda w, t: jax.jvp(f, (w,), (t,)), num_replicas=8,
                           axis_name=AX)(w, per(t))
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(stack(g, 8), w_, rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match="already identical on every replica"):  # psum(w)
        got = rt.replicate(lambda w, t: jax.linearize(f, w)[1](t), num_replicas=8,
                           axis_name=AX)(w, per(t))
    np.testing.assert_allclose(stack(got, 8), want[1], rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning, match="already identical on every replica"):  # psum(w)
        got = rt.replicate(lambda w, t: jax.jvp(f, (lax.pcast(w, AX, to='varying'),), (t,)),
                           num_replicas=8, axis_name=AX)(w, per(t))
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(stack(g, 8), w_, rtol=1e-5, atol=1e-5)


def test_grad_of_jvp():
    """``testGradOfJvp``: grad of a sum of a ``linearize``d function's tangents, in the
    step; equal to ``grad(sum(jvp(sin)))`` = ``-sin(x)``."""
    x = _arange((8, 4))

    def step(x):
        def splitjvp(x):
            _, jvp = jax.linearize(jnp.sin, x)
            return jvp(jnp.ones_like(x))
        return jax.grad(lambda x: jnp.sum(splitjvp(x)))(x)

    got, _, _ = same_as_pmap(step, x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, -np.sin(x), rtol=1e-5, atol=1e-5)


def test_two_args_grad():
    """``testTwoArgsGrad``: grad of ``psum(5 cos(x) sin(y))`` w.r.t. both per-replica
    arguments: n times the local derivative (every replica's copy of the sum depends on
    each replica's x and y)."""
    def f(x, y):
        return lax.psum(5. * jnp.cos(x) * jnp.sin(y), AX)

    x = _arange((8, 4)) / 8
    y = 4 + x
    got, _, _ = same_as_pmap(lambda x, y: jax.grad(lambda x, y: jnp.sum(f(x, y)),
                                                  argnums=(0, 1))(x, y), x, y,
                             rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0], 8 * -5 * np.sin(x) * np.sin(y), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], 8 * 5 * np.cos(x) * np.cos(y), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,prim,tiled", [
    ("Gather", lax.all_gather, False), ("GatherTiled", lax.all_gather, True),
    ("ReduceScatter", lax.psum_scatter, False), ("ReduceScatterTiled", lax.psum_scatter, True)])
def test_grad_of(name, prim, tiled):
    """``testGradOf`` (``check_grads`` of ``pmap(prim)``; the ``IndexGroups`` variants are in
    ``test_axis_index_groups``): reverse and forward derivatives through all_gather /
    psum_scatter inside the step, against pmap's, and the reverse one by hand (the
    transpose of a gather sums the cotangents and keeps this replica's slice; the transpose
    of psum_scatter gathers them)."""
    n = 8
    x = _arange((n, n)) / 10
    ct_shape = jax.eval_shape(jax.pmap(functools.partial(prim, axis_name=AX, tiled=tiled),
                                       axis_name=AX), x).shape
    ct = np.random.default_rng(5).normal(size=ct_shape).astype(np.float32)

    def step(x, ct):
        f = lambda x: prim(x, axis_name=AX, tiled=tiled)  # noqa: E731
        return (jax.grad(lambda x: jnp.vdot(f(x) ** 2, ct))(x),
                jax.jvp(f, (x,), (x * x,))[1])

    got, _, _ = same_as_pmap(step, x, ct, rtol=1e-5, atol=1e-5)
    if prim is lax.all_gather:
        # every replica's gather is x (stacked / concatenated): d/dx_r = Σ_s 2 x_r ct_s[r]
        cts = ct.reshape(n, n, n)  # [s, r, :]
        want = np.stack([2 * x[r] * cts[:, r].sum(0) for r in range(n)])
    else:
        # replica r holds Σ_s x_s[r] (a slice of the sum): d/dx_r[k] = 2 (Σ_s x_s[k]) ct_k
        S = x.sum(0)
        want = np.broadcast_to(2 * S * ct.reshape(n), (n, n))
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)


def test_collective_permute_grad():
    """``testCollectivePermuteGrad`` (CPU-skipped in the source; runs here): the gradient
    of ``<y, ppermute(x, shift right)>`` w.r.t. each replica's x is the y of the replica it
    sends to (0 for the last, which sends nothing)."""
    shift_right = [(i, i + 1) for i in range(7)]
    y = np.pi + np.arange(8, dtype=np.float32)
    x = np.arange(8, dtype=np.float32)

    def step(x, y):
        return jax.grad(lambda x: jnp.sum(y * lax.ppermute(x, perm=shift_right, axis_name=AX)))(x)

    got, _, _ = same_as_pmap(step, x, y)
    np.testing.assert_allclose(got, np.concatenate([np.pi + np.arange(1, 8), [0]]), rtol=1e-6)


def test_collective_permute_cyclic_grad():
    """``testCollectivePermuteCyclicGrad``: a ring, the gradient is y rolled back by one;
    also the second derivative of ``<y, ppermute(x)²>`` and the jvp."""
    shift_right = [(i, (i + 1) % 8) for i in range(8)]
    y = np.pi + np.arange(8, dtype=np.float32)
    x = np.arange(8, dtype=np.float32)

    def step(x, y):
        f = lambda x: lax.ppermute(x, perm=shift_right, axis_name=AX)  # noqa: E731
        g = jax.grad(lambda x: jnp.sum(y * f(x)))(x)
        h = jax.grad(lambda x: jax.grad(lambda x: jnp.sum(y * f(x) ** 2))(x))(x)
        return g, h, jax.jvp(f, (x,), (y,))[1]

    got, _, _ = same_as_pmap(step, x, y, rtol=1e-5)
    np.testing.assert_allclose(got[0], np.roll(np.pi + np.arange(8), -1), rtol=1e-6)
    np.testing.assert_allclose(got[1], 2 * np.roll(y, -1), rtol=1e-6)
    np.testing.assert_allclose(got[2], np.roll(y, 1), rtol=1e-6)


def test_grad_of_all_to_all():
    """``testGradOfAllToAllReplicaGroups`` without groups (those are in
    ``test_axis_index_groups``): a gradient through all_to_all taken inside the step."""
    x = _arange((8, 8, 1))
    w = np.arange(8, dtype=np.float32)

    def fn(x, w):
        g = lambda x: jnp.sum(lax.all_to_all(x, AX, 0, 1) * w)  # noqa: E731
        return jax.grad(g)(x)

    got, _, _ = same_as_pmap(fn, x, w)
    # replica r's row j goes to replica j, which weighs it by w[j]
    np.testing.assert_allclose(got, np.broadcast_to(w[None, :, None], x.shape))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_psum_zero_cotangents(reduction):
    """``testPsumZeroCotangents`` (https://github.com/jax-ml/jax/issues/3651): a psum of a
    gradient whose second component is zero, under an outer gradient (a meta-gradient),
    with 0-d parameters per replica (the source maps ``[2.]`` and ``[3.]`` over one
    device). By hand: inner = ``mpo · (net + Σ_s meta · mpo_s)``, so pmap's
    ``d inner / d meta`` = ``mpo · Σ_s mpo_s`` = 3 · 24 = 72 on every replica. ``meta`` is
    a constant made inside the step: mirrored, so a step reduces its gradient: 72 under
    ``"mean"`` (pmap's, as all are equal), 8 · 72 under ``"sum"``."""
    def loss(params, meta_params):
        (net, mpo) = params
        return meta_params * mpo * net

    def inner(meta_params, params):
        grads = jax.grad(loss)(params, meta_params)
        grads = lax.psum(grads, axis_name=AX)
        net_grads, mpo_grads = grads
        net = params[0] + net_grads
        mpo = params[1]
        return mpo * net

    def outer(params):
        meta_params = jnp.array(4.0)
        return jax.grad(inner)(meta_params, params)

    params = (np.full((8,), 2.0, np.float32), np.full((8,), 3.0, np.float32))
    want = jax.pmap(outer, axis_name=AX)(params)
    np.testing.assert_allclose(want, np.full(8, 72.0))
    got = rt.replicate(outer, num_replicas=8, axis_name=AX, loss_reduction=reduction)(
        jax.tree.map(per, params))
    assert not isinstance(got, rt.PerReplica)
    np.testing.assert_allclose(stack(got, 8), np.asarray(want) * (8 if reduction == "sum" else 1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_of_a_mirrored_argument(reduction):
    """``testPmapInAxesGrad`` / ``testPmapPostProcess`` in a step: ``sin(x + y + z)`` with x,
    y per replica and z broadcast (``in_axes=None``), differentiated inside the step with a
    psum in the loss. x's and y's gradients equal pmap's; z's is pmap's per-replica one
    all-reduced by the step (README "Porting from pmap": "Gradients"): its pmean under
    ``"mean"``, psum under ``"sum"`` (pmap leaves n different copies)."""
    def f(x, y, z):
        h = jnp.sin(x + y + z)
        return jnp.sum(h * lax.psum(h, AX))

    def step(x, y, z):
        return jax.grad(f, argnums=(0, 1, 2))(x, y, z)

    rng = np.random.default_rng(6)
    x, y = (rng.normal(size=(8, 5, 7)).astype(np.float32) for _ in range(2))
    z = rng.normal(size=(5, 7)).astype(np.float32)
    want = jax.pmap(step, axis_name=AX, in_axes=(0, 0, None))(x, y, z)
    got = rt.replicate(step, num_replicas=8, axis_name=AX, loss_reduction=reduction)(
        per(x), per(y), z)
    np.testing.assert_allclose(stack(got[0], 8), want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stack(got[1], 8), want[1], rtol=1e-5, atol=1e-5)
    assert not isinstance(got[2], rt.PerReplica)
    red = np.mean if reduction == "mean" else np.sum
    np.testing.assert_allclose(np.asarray(got[2]), red(np.asarray(want[2]), 0),
                               rtol=1e-5, atol=1e-4)
    # pmap's own step with the pmean/psum written out gives the same
    prim = lax.pmean if reduction == "mean" else lax.psum
    want2 = jax.pmap(lambda x, y, z: prim(step(x, y, z)[2], AX), axis_name=AX,
                     in_axes=(0, 0, None))(x, y, z)
    np.testing.assert_allclose(np.asarray(got[2]), want2[0], rtol=1e-5, atol=1e-4)


# -- axis_index_groups ---------------------------------------------------------------------

_HALVES = np.arange(8).reshape(2, 4).tolist()                 # [[0..3], [4..7]]
_EVEN_ODD = np.arange(8).reshape(4, 2).T.tolist()            # [[0, 2, 4, 6], [1, 3, 5, 7]]
_INTERLEAVED = np.concatenate([np.arange(8)[::2], np.arange(8)[1::2]]).reshape(2, 4).tolist()
_PAIRS = [(2 * i, 2 * i + 1) for i in range(4)]


def test_psum_constant_replica_groups():
    """``testPsumConstantReplicaGroups``: ``x - psum(2., groups of 4)`` = ``x - 8``."""
    x = _arange((8, 4))
    got, _, _ = same_as_pmap(lambda x: x - lax.psum(2., AX, axis_index_groups=_HALVES), x)
    np.testing.assert_allclose(got, x - 2. * 8 // 2)


@pytest.mark.parametrize("name", ["psum", "pmean"])
def test_psum_replica_groups(name):
    """``testPsumReplicaGroups`` / ``testPsumUnevenReplicaGroups`` (and pmean): JAX's
    ``lax.psum`` of a per-replica value with ``axis_index_groups``, equal or uneven groups,
    gives pmap's numbers in a step (JAX's shard_map typing has no such psum: a bare
    ``NotImplementedError`` before; a step gathers and reduces within the group), and so
    does its gradient. ``rt.all_reduce(x, 'sum', axis_index_groups=...)`` gives the same
    for equal groups and refuses uneven ones with a ``ValueError`` naming them."""
    prim = getattr(lax, name)
    x = _arange((8, 4))
    f = lambda x: x - prim(x, AX, axis_index_groups=_HALVES)  # noqa: E731
    want = jax.pmap(f, axis_name=AX)(x)
    sums = np.concatenate([np.broadcast_to(x[:4].sum(0), (4, 4)),
                           np.broadcast_to(x[4:].sum(0), (4, 4))])
    np.testing.assert_allclose(want, x - (sums if name == "psum" else sums / 4))
    same_as_pmap(f, x)
    uneven = [[0, 1], list(range(2, 8))]
    same_as_pmap(lambda x: x - prim(x, AX, axis_index_groups=uneven), x, rtol=1e-6)
    grad = lambda x: jax.grad(lambda x: jnp.sum(jnp.sin(prim(x, AX, axis_index_groups=uneven)) * x))(x)  # noqa: E731,E501
    same_as_pmap(grad, x / 10, rtol=1e-5, atol=1e-6)
    if name == "psum":
        got = rt.replicate(lambda x: x - rt.all_reduce(x, "sum", axis_index_groups=_HALVES),
                           num_replicas=8, axis_name=AX)(per(x))
        np.testing.assert_allclose(stack(got, 8), want)
        with pytest.raises(ValueError, match="groups of equal size"):
            rt.replicate(lambda x: rt.all_reduce(x, "sum", axis_index_groups=uneven),
                         num_replicas=8, axis_name=AX)(per(x))


@pytest.mark.parametrize("prim", ["psum", "pmean", "pmax", "pmin"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.bool_])
def test_replica_groups_of_small_integers_and_bools(dtype, prim):
    """A grouped reduction of int8 / uint8 / bool values has pmap's dtype and numbers:
    a sum in the value's own dtype wraps (100 + 100 is -56 in int8). Before, the sum
    widened to int32 (200) and a max of bools raised ``Invalid integer data type``."""
    x = (np.array([100, 100, -100, -100, 7, 8, 9, 10]) if dtype == np.int8 else
         np.array([200, 100, 0, 255, 1, 2, 3, 4]) if dtype == np.uint8 else
         np.array([1, 0, 0, 0, 1, 1, 0, 0])).astype(dtype).reshape(8, 1)
    got, want, _ = same_as_pmap(lambda x: getattr(lax, prim)(x, AX, axis_index_groups=_PAIRS), x)
    assert np.asarray(got).dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("groups", [_EVEN_ODD, _INTERLEAVED], ids=["even-odd", "interleaved"])
def test_gather_replica_groups(groups):
    """``testGatherReplicaGroups`` / ``testGatherReplicaGroupsInterleaved``: every replica
    gathers its group's rows (a per-replica result); and ``pmax`` within groups."""
    x = _arange((8, 4))
    got, _, raw = same_as_pmap(lambda x: lax.all_gather(x, AX, axis_index_groups=groups), x)
    want = np.empty((8, 4, 4), np.float32)
    want[0::2], want[1::2] = x[0::2], x[1::2]
    np.testing.assert_allclose(got, want)
    assert isinstance(raw, rt.PerReplica)
    same_as_pmap(lambda x: lax.pmax(x, AX, axis_index_groups=groups), x)


def test_reduce_scatter_replica_groups_tiled():
    """``testReduceScatterReplicaGroupsTiled``: each group of 4 sums its rows and scatters
    the sum over its members."""
    x = _arange((8, 32))
    got, _, _ = same_as_pmap(
        lambda x: lax.psum_scatter(x, AX, axis_index_groups=_EVEN_ODD, tiled=True), x)
    g1, g2 = x[0::2].sum(0), x[1::2].sum(0)
    for i in range(8):
        np.testing.assert_allclose(got[i], (g1 if i % 2 == 0 else g2)[i // 2 * 8:(i // 2 + 1) * 8])


def test_all_to_all_replica_groups():
    """``testAllToAllReplicaGroups``: all_to_all within the even and odd replicas."""
    x = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
    got, _, _ = same_as_pmap(
        lambda x: lax.all_to_all(x, AX, 0, 0, axis_index_groups=_EVEN_ODD), x)
    np.testing.assert_array_equal(got, np.swapaxes(x.reshape(4, 2, 4), 0, 2).reshape(8, 4))


def test_grad_of_all_to_all_replica_groups():
    """``testGradOfAllToAllReplicaGroups``: a gradient through a grouped all_to_all taken
    inside the step (as in the source)."""
    x = _arange((8, 4, 1))
    w = np.arange(8, dtype=np.float32)

    def fn(x, w):
        g = lambda x: jnp.sum(lax.all_to_all(x, AX, 0, 1, axis_index_groups=_HALVES) * w)  # noqa
        return jax.grad(g)(x)

    got, _, _ = same_as_pmap(fn, x, w)
    expected = np.ones_like(x) * w[:, None, None]
    np.testing.assert_allclose(got, np.swapaxes(expected.reshape(2, 4, 4), 1, 2).reshape(x.shape))


@pytest.mark.parametrize("name,prim,tiled", [
    ("GatherIndexGroups", lax.all_gather, False), ("GatherTiledIndexGroups", lax.all_gather, True),
    ("ReduceScatterIndexGroups", lax.psum_scatter, False),
    ("ReduceScatterTiledIndexGroups", lax.psum_scatter, True)])
def test_grad_of_index_groups(name, prim, tiled):
    """``testGradOf``'s ``IndexGroups`` variants (groups of neighbouring pairs, rows of 2):
    reverse and forward derivatives inside the step."""
    x = _arange((8, 2)) / 10
    ct_shape = jax.eval_shape(jax.pmap(lambda x: prim(x, AX, tiled=tiled, axis_index_groups=_PAIRS),
                                       axis_name=AX), x).shape
    ct = np.random.default_rng(7).normal(size=ct_shape).astype(np.float32)

    def step(x, ct):
        f = lambda x: prim(x, axis_name=AX, tiled=tiled, axis_index_groups=_PAIRS)  # noqa
        return jax.grad(lambda x: jnp.vdot(f(x) ** 2, ct))(x), jax.jvp(f, (x,), (x * x,))[1]

    same_as_pmap(step, x, ct, rtol=1e-5, atol=1e-5)


# -- what a step adds: mirrored parameters, their gradients, and where it refuses ------------

_RING = [(i, (i + 1) % 8) for i in range(8)]
_PART = [(0, 3), (3, 0), (5, 6)]


@pytest.mark.parametrize("name,c", [
    ("psum", lambda v: lax.psum(v, AX)), ("pmean", lambda v: lax.pmean(v, AX)),
    ("pmax", lambda v: lax.pmax(v, AX)), ("all_gather", lambda v: lax.all_gather(v, AX)),
    ("ppermute-ring", lambda v: lax.ppermute(v, AX, _RING)),
    ("ppermute-partial", lambda v: v + lax.ppermute(v, AX, _PART)),
    ("psum_scatter", lambda v: lax.psum_scatter(v, AX, tiled=True)),
    ("all_to_all", lambda v: lax.all_to_all(v, AX, 0, 0, tiled=True)),
    ("groups", lambda v: (lax.all_gather(v, AX, axis_index_groups=_HALVES),
                          lax.pmax(v, AX, axis_index_groups=_HALVES))),
])
def test_collectives_of_a_mirrored_argument(name, c):
    """Not a source case of its own (``testPartiallyMapped``'s ``in_axes=None``): every
    collective applied to a broadcast (mirrored) argument; a partial ppermute, psum_scatter
    and all_to_all make it per replica, the reductions and gathers keep it mirrored."""
    w = np.random.default_rng(8).normal(size=(8,)).astype(np.float32)
    import contextlib
    with (pytest.warns(UserWarning, match="already identical on every replica")  # N · w
          if name == "psum" else contextlib.nullcontext()):
        got, _, raw = same_as_pmap(lambda w, x: c(w * 2), w, np.zeros((8, 1), np.float32),
                                   in_axes=(None, 0), rtol=1e-5)
    if name in ("psum", "pmean", "pmax", "all_gather"):
        assert not isinstance(raw, rt.PerReplica)


_LOSSES = {
    "psum": lambda w, x: jnp.sum(lax.psum(x * w, AX) ** 2),
    "pmean-of-loss": lambda w, x: lax.pmean(jnp.sum(jnp.tanh(x * w)), AX),
    "psum-of-loss": lambda w, x: lax.psum(jnp.sum(jnp.tanh(x * w) ** 2), AX),
    "all_gather": lambda w, x: jnp.sum(lax.all_gather(jnp.tanh(x * w), AX) ** 2),
    "all_gather-x": lambda w, x: jnp.sum(lax.all_gather(jnp.tanh(x * w), AX, tiled=True)[:8] * x),
    "ppermute-ring": lambda w, x: jnp.sum(lax.ppermute(jnp.tanh(x * w), AX, _RING) * x),
    "ppermute-partial": lambda w, x: jnp.sum(lax.ppermute(jnp.tanh(x * w), AX, _PART) * x),
    "ppermute-of-w": lambda w, x: jnp.sum(lax.ppermute(jnp.tanh(w), AX, _PART) * x),
    "psum_scatter": lambda w, x: jnp.sum(lax.psum_scatter(jnp.tanh(x * w), AX, tiled=True) ** 2),
    "psum_scatter-of-w": lambda w, x: jnp.sum(
        lax.psum_scatter(jnp.tanh(w) * 3, AX, tiled=True) * x[:1]),
    "all_to_all": lambda w, x: jnp.sum(
        lax.all_to_all(jnp.tanh(x * w), AX, 0, 0, tiled=True) * jnp.arange(8.)),
    "axis_index": lambda w, x: jnp.sum(w * lax.axis_index(AX) * x),
    "axis_size": lambda w, x: jnp.sum(jnp.tanh(x * w)) / lax.psum(1, AX),
    "w-only": lambda w, x: jnp.sum(jnp.sin(w)),
    "pmax-value": lambda w, x: jnp.sum(lax.pmax(x, AX) * w),
    "stop_gradient-psum": lambda w, x: jnp.sum(lax.stop_gradient(lax.psum(x * w, AX)) * x * w),
    "all_gather-groups": lambda w, x: jnp.sum(
        lax.all_gather(jnp.tanh(x * w), AX, axis_index_groups=_HALVES) * x),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(_LOSSES))
def test_grad_through_collectives_of_a_mirrored_argument(name, reduction):
    """Not a source case of its own (``testGradOf`` / ``testCollectivePermuteGrad`` with a
    parameter broadcast as pmap's ``in_axes=None``): the gradient of a loss built with each
    collective w.r.t. the mirrored w is pmap's per-replica gradient all-reduced (``pmean``
    under ``"mean"``, ``psum`` under ``"sum"``: README "Porting from pmap"), and the
    per-replica x's gradient is pmap's."""
    loss = _LOSSES[name]
    w = np.random.default_rng(9).normal(size=(8,)).astype(np.float32)
    x = np.random.default_rng(10).normal(size=(8, 8)).astype(np.float32)
    red = lax.pmean if reduction == "mean" else lax.psum
    # (JAX has no derivative of pmax: x's gradient there is an error in both)
    dx = (lambda w, x: x) if name == "pmax-value" else jax.grad(loss, 1)
    want = jax.pmap(lambda w, x: (red(jax.grad(loss)(w, x), AX), dx(w, x)),
                    axis_name=AX, in_axes=(None, 0))(w, x)
    got = rt.replicate(lambda w, x: (jax.grad(loss)(w, x), dx(w, x)),
                       num_replicas=8, axis_name=AX, loss_reduction=reduction)(w, per(x))
    assert not isinstance(got[0], rt.PerReplica)
    np.testing.assert_allclose(stack(got[0], 8), want[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(stack(got[1], 8), want[1], rtol=2e-5, atol=2e-5)


def _rnn_psum(W, x):
    def body(h, xt):
        h = jnp.tanh(h @ W + xt + 0.1 * lax.pmean(h, AX))
        return h, h
    _, hs = lax.scan(body, jnp.zeros(4), x)
    return jnp.sum(hs ** 2)


def _rnn_ppermute(W, x):
    def body(h, xt):
        return jnp.tanh(h @ W + xt) + 0.3 * lax.ppermute(h, AX, _RING), None
    h, _ = lax.scan(body, jnp.zeros(4), x)
    return jnp.sum(h * x[0])


def _rnn_gather(W, x):
    def body(h, xt):
        return jnp.tanh(h @ W + xt + 0.05 * lax.all_gather(h, AX).sum(0)), None
    h, _ = lax.scan(body, jnp.zeros(4), x)
    return jnp.sum(h ** 3)


def _remat_scan(W, x):
    body = jax.checkpoint(lambda h, xt: (jnp.tanh(h @ W + xt + lax.psum(h, AX) * 0.01), None))
    h, _ = lax.scan(body, jnp.ones(4), x)
    return jnp.sum(h)


def _fori_ppermute(W, x):
    h = lax.fori_loop(0, 6, lambda i, h: jnp.tanh(lax.ppermute(h, AX, _RING) @ W + x[i]),
                      jnp.zeros(4))
    return jnp.sum(h * x[1])


def _cond_per_replica(W, x):
    return lax.cond(x.sum() > 0, lambda: jnp.sum(jnp.tanh(x @ W)),
                    lambda: jnp.sum(lax.psum(1., AX) * (x @ W) ** 2) * 0.1)


def _vmap_psum(W, x):
    return jnp.sum(jax.vmap(lambda xt: lax.psum(jnp.tanh(xt @ W), AX))(x) ** 2)


def _vmap_both_axes(W, x):
    return jnp.sum(jax.vmap(lambda xt: lax.psum(jnp.tanh(xt @ W), (AX, 'j')), axis_name='j')(x)
                   ** 2)


def _jit_pmean(W, x):
    return jnp.sum(jax.jit(lambda W, x: lax.pmean(jnp.tanh(x @ W), AX))(W, x) * x)


def _checkpoint_policy(W, x):
    return jnp.sum(jax.checkpoint(lambda W: lax.psum(jnp.sin(x @ W), AX) ** 2,
                                  policy=jax.checkpoint_policies.nothing_saveable)(W))


def _sort_gather(W, x):
    return jnp.sum(jnp.sort(lax.all_gather(jnp.tanh(x @ W), AX, tiled=True), axis=0)[:3] * 2.)


@pytest.mark.parametrize("loss,reduction", [
    (f, r) for f in (_rnn_psum, _rnn_ppermute, _rnn_gather, _remat_scan, _fori_ppermute,
                     _cond_per_replica, _vmap_psum, _vmap_both_axes, _jit_pmean,
                     _checkpoint_policy, _sort_gather)
    for r in (("mean", "sum") if f in (_rnn_psum, _cond_per_replica, _vmap_both_axes) else
              ("mean",))], ids=lambda v: v if isinstance(v, str) else v.__name__.strip('_'))
def test_grad_through_collectives_in_control_flow(loss, reduction):
    """Not a source case of its own (``testAxisIndexInInitialStyle``, ``testJitInPmap``,
    ``testCollectivesWithVmap`` and ``test_remat_of_pmap`` with a gradient): collectives
    inside scan / fori_loop / remat / vmap / jit / a cond on a per-replica predicate,
    differentiated inside the step w.r.t. the mirrored W (all-reduced as above) and the
    per-replica x, and the forward derivative (per replica, as pmap's), against pmap."""
    rng = np.random.default_rng(11)
    x = rng.normal(size=(8, 6, 4)).astype(np.float32)
    W = (rng.normal(size=(4, 4)) * 0.5).astype(np.float32)
    red = lax.pmean if reduction == "mean" else lax.psum

    def step(W, x):
        return (jax.grad(loss)(W, x), jax.grad(loss, 1)(W, x),
                jax.jvp(lambda W: loss(W, x), (W,), (W * 0.5,))[1], loss(W, x))

    want = jax.pmap(lambda W, x: (red(step(W, x)[0], AX),) + step(W, x)[1:], axis_name=AX,
                    in_axes=(None, 0))(W, x)
    got = rt.replicate(step, num_replicas=8, axis_name=AX, loss_reduction=reduction)(W, per(x))
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(stack(g, 8), w_, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_meta_gradient_through_an_explicit_pmean(reduction):
    """``testPsumZeroCotangents``' shape with mirrored parameters (MAML written for pmap:
    the inner gradient ``pmean``-ed by hand, an outer gradient through it). In a step the
    inner gradient of the mirrored W is already all-reduced, so the hand-written pmean
    changes nothing (README "Porting from pmap"): under ``"mean"`` the step equals pmap's
    program; under ``"sum"`` it equals pmap's with the inner reduction a psum."""
    rng = np.random.default_rng(12)
    x = rng.normal(size=(8, 6, 4)).astype(np.float32)
    W = (rng.normal(size=(4, 4)) * 0.5).astype(np.float32)

    def make(inner_red):
        def maml(W, x):
            g = inner_red(jax.grad(lambda W: jnp.sum(jnp.tanh(x[:3] @ W) ** 2))(W), AX)
            return jnp.sum(jnp.tanh(x[3:] @ (W - 0.1 * g)) ** 2)
        return maml

    red = lax.pmean if reduction == "mean" else lax.psum
    ours, theirs = make(lax.pmean), make(red)
    want = jax.pmap(lambda W, x: (red(jax.grad(theirs)(W, x), AX), jax.grad(theirs, 1)(W, x)),
                    axis_name=AX, in_axes=(None, 0))(W, x)
    got = rt.replicate(lambda W, x: (jax.grad(ours)(W, x), jax.grad(ours, 1)(W, x)),
                       num_replicas=8, axis_name=AX, loss_reduction=reduction)(W, per(x))
    np.testing.assert_allclose(stack(got[0], 8), want[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stack(got[1], 8), want[1], rtol=1e-4, atol=1e-5)


def test_float16_all_reduce_is_rounded_once():
    """Not in the source: psum / pmean of float16 on CPU. pmap (and shard_map) add the
    replicas' values in float16, rounding after each addition; a step reduces 16-bit floats
    in float32 on CPU and rounds once (``compiler/lower.py`` ``_widened``), so it gives the
    correctly rounded sum, which may differ from pmap's by one float16 ulp. Asserted: ours
    is the correctly rounded sum, and within pmap's rounding of it. (bfloat16 agrees with
    pmap exactly: XLA:CPU widens it as well.)"""
    x = (np.random.default_rng(0).normal(size=(8, 16)) * 50).astype(np.float16)
    f = lambda x: (lax.psum(x, AX), lax.pmean(x, AX))  # noqa: E731
    want = jax.pmap(f, axis_name=AX)(x)
    got = rt.replicate(f, num_replicas=8, axis_name=AX)(per(x))
    exact = x.astype(np.float64)
    np.testing.assert_array_equal(np.asarray(got[0]), exact.sum(0).astype(np.float16))
    np.testing.assert_array_equal(np.asarray(got[1]), exact.mean(0).astype(np.float16))
    assert not np.array_equal(np.asarray(got[0]), np.asarray(want[0][0]))  # the difference
    for g, w_, e in zip(got, want, (exact.sum(0), exact.mean(0))):
        # every element at least as close to the exact value as pmap's
        assert np.all(np.abs(np.asarray(g, np.float64) - e)
                      <= np.abs(np.asarray(w_[0], np.float64) - e))
    y = (np.random.default_rng(1).normal(size=(8, 16)) * 50).astype(jnp.bfloat16)
    same_as_pmap(f, y, rtol=0, atol=0)


def test_collective_under_a_per_replica_cond_is_refused():
    """Not in the source: a psum inside a ``lax.cond`` whose predicate differs between
    replicas (in pmap the replicas that skip it never join it). A step refuses it before
    XLA runs, naming the line (README "What the numbers mean")."""
    x = _arange((8, 4)) - 14
    from compiler.errors import DivergentCollectiveError
    with pytest.raises(DivergentCollectiveError, match="differs between replicas"):
        rt.replicate(lambda x: lax.cond(x.sum() > 0, lambda v: lax.psum(v, AX), lambda v: v, x),
                     num_replicas=8, axis_name=AX)(per(x))


@pytest.mark.parametrize("bwd", ["pmean", "psum", "plain", "pcast"])
def test_custom_vjp_of_a_collective_matches_pmap(bwd):
    """Not in the source (``testGradOfPsum`` with the psum's derivative written by hand, as
    pmap code does around collectives): ``f = custom_vjp(psum)`` with a backward function
    ``2 pmean(g)``, ``psum(g)`` (psum's true transpose under pmap), ``2 g``, or ``psum(g)``
    cast to varying with ``lax.pcast`` (shard_map-era code; pmap takes it as the
    identity). The backward function gets each replica's own cotangent ``g = x_r``, as
    under pmap (before, a step handed it the replicas' cotangents already summed,
    ``jax.shard_map``'s convention, so the ``pmean``/``psum`` variants came out n times
    pmap's with no error, and a reduced result for the per-replica input was JAX's
    "manual axis types do not match" error where pmap runs it)."""
    @jax.custom_vjp
    def f(v):
        return lax.psum(v, AX)

    def f_bwd(_, g):
        out = {"pmean": lambda: lax.pmean(g, AX) * 2, "psum": lambda: lax.psum(g, AX),
               "plain": lambda: 2 * g,
               "pcast": lambda: lax.pcast(lax.psum(g, AX), AX, to="varying")}[bwd]()
        return (out,)

    f.defvjp(lambda v: (f(v), None), f_bwd)
    x = _arange((8, 4)) / 10
    t = 1 - np.tanh(x) ** 2
    step = lambda x: jax.grad(lambda x: jnp.sum(f(jnp.tanh(x)) * x))(x)  # noqa: E731
    want = np.asarray(jax.pmap(step, axis_name=AX)(x))
    direct = np.broadcast_to(np.tanh(x).sum(0), x.shape)  # d/dx of the primal's x factor
    by_hand = {"pmean": 2 * x.mean(0) * t, "psum": x.sum(0) * t, "plain": 2 * x * t,
               "pcast": x.sum(0) * t}[bwd]
    np.testing.assert_allclose(want, direct + by_hand, rtol=1e-5)
    got = rt.replicate(step, num_replicas=8, axis_name=AX)(per(x))
    np.testing.assert_allclose(stack(got, 8), want, rtol=1e-5, atol=1e-5)


def test_pbroadcast_is_gpu_only():
    """``testCollectiveBroadcast`` (GPU-only there): on CPU pmap has no lowering for
    ``pbroadcast``; a step with the axis written as a tuple stops at the same point. With
    the axis a str a step fails earlier, at lowering (JAX's pbroadcast lowering iterates
    the axis name, and a step renames a one-letter name to ``'replica'``; pmap fails the
    same way for a longer name); only the op's name is asserted there."""
    x = np.arange(4 * 8, dtype=np.float32).reshape(8, 4)
    f = lambda x: lax.pbroadcast(x, source=0, axis_name=(AX,))  # noqa: E731
    msg = "MLIR translation rule for primitive 'pbroadcast' not found for platform cpu"
    with pytest.raises(NotImplementedError, match=msg):
        jax.pmap(f, AX)(x)
    with pytest.raises(NotImplementedError, match=msg):
        rt.replicate(f, num_replicas=8, axis_name=AX)(per(x))
    with pytest.raises(Exception, match="pbroadcast"):
        rt.replicate(lambda x: lax.pbroadcast(x, source=0, axis_name=AX), num_replicas=8,
                     axis_name=AX)(per(x))


def test_custom_vjp_gradient_clip_of_a_mirrored_weight_is_per_replica():
    """Not in the source: a ``custom_vjp`` identity whose backward function clips (a
    gradient clip on a weight, optax's ``scale_gradient`` made nonlinear) applied to a
    mirrored weight used with per-replica data. pmap (and TF's replica context) clip each
    replica's cotangent, then the step's ``pmean`` averages; a step gives the same, the
    mean of the clipped ones (before, it clipped the replicas' cotangents summed, then
    divided by n: no error, different numbers). Called without a derivative the function
    keeps its mirrored type: its result is one array, not a ``PerReplica``."""
    @jax.custom_vjp
    def clip_grad(w):
        return w

    clip_grad.defvjp(lambda w: (w, None), lambda _, g: (jnp.clip(g, -0.5, 0.5),))
    w = np.array([1., -2., 0.5, 3.], np.float32)
    x = np.random.default_rng(3).normal(size=(8, 4)).astype(np.float32)
    step = lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(clip_grad(w) * x)))(w)  # noqa: E731
    want = jax.pmap(lambda w, x: lax.pmean(step(w, x), AX), axis_name=AX, in_axes=(None, 0))(w, x)
    got = rt.replicate(step, num_replicas=8, axis_name=AX)(w, per(x))
    assert not isinstance(got, rt.PerReplica)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want)[0], rtol=1e-6)
    by_hand = np.clip((1 - np.tanh(w * x) ** 2) * x, -0.5, 0.5).mean(0)
    np.testing.assert_allclose(np.asarray(got), by_hand, rtol=1e-5)
    assert not np.allclose(by_hand, np.clip(((1 - np.tanh(w * x) ** 2) * x).sum(0), -.5, .5) / 8)
    out = rt.replicate(lambda w: clip_grad(w) * 2, num_replicas=8, axis_name=AX)(w)
    assert not isinstance(out, rt.PerReplica)
    np.testing.assert_array_equal(np.asarray(out), w * 2)


def test_pmean_of_an_identical_bool_or_int_does_not_warn():
    """Not in the source: ``lax.pmean`` of a mirrored bool or int (haiku's imagenet step
    averages ``grads_finite``) sums in an integer type and divides after a cast: it is a
    mean, which leaves an identical value as it is, so no "already identical" warning
    (before: it warned that a sum multiplies it by N). Numbers as pmap's."""
    x = _arange((8, 4))
    with _no_identical_sum_warning():
        same_as_pmap(lambda x: lax.pmean({"finite": jnp.all(jnp.isfinite(lax.psum(x, AX))),
                                          "count": jnp.int32(3)}, AX), x)
