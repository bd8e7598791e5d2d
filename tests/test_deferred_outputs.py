"""Per-replica results are deferred: a step returns ``PerReplica``s over its global output
arrays and splits them into per-replica arrays only when ``.values`` is read.
Oracles: each replica's computation through plain ``jax.jit``, and numpy's reductions."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt

N = 4


def _step(w, x):
    """Per-replica outputs of rank 0, 1 and 2, and a mirrored one."""
    h = jnp.tanh(x @ w)
    return {"loss": jnp.mean(h ** 2), "rowsum": h.sum(1), "h": h, "w2": w * 2}


def _data(seed=0, rows=3):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(5, 2)).astype(np.float32)
    xs = [rng.normal(size=(rows, 5)).astype(np.float32) + r for r in range(N)]
    return w, xs


def _want(w, xs):
    return [jax.jit(_step)(w, x) for x in xs]


@pytest.mark.parametrize("logical_devices", [1, 2])
def test_values_equal_jit_per_replica(logical_devices):
    w, xs = _data()
    out = rt.replicate(_step, num_replicas=N, logical_devices=logical_devices)(w, rt.PerReplica(xs))
    assert isinstance(out["w2"], jax.Array)
    for k in ("loss", "rowsum", "h"):
        assert isinstance(out[k], rt.PerReplica) and len(out[k]) == N
        for r, want in enumerate(_want(w, xs)):
            got = out[k].values[r]
            assert isinstance(got, jax.Array) and got.shape == want[k].shape
            np.testing.assert_allclose(np.asarray(got), np.asarray(want[k]), rtol=1e-6)
            assert got.devices() == out[k].values[r].devices()  # stable once built


def test_block_until_ready_waits_without_splitting():
    w, xs = _data(1)
    out = rt.replicate(_step, num_replicas=N)(w, rt.PerReplica(xs))
    same = jax.block_until_ready(out)
    assert same["loss"] is out["loss"]
    assert out["loss"]._values is None  # still one global array: nothing was split
    np.testing.assert_allclose([float(v) for v in out["loss"].values],
                               [float(want["loss"]) for want in _want(w, xs)], rtol=1e-6)
    assert out["loss"].block_until_ready() is out["loss"]


def test_values_live_on_their_replicas_device():
    w, xs = _data(2)
    step = rt.replicate(_step, num_replicas=N)
    out = step(w, rt.PerReplica(xs))
    for r in range(N):
        assert out["h"].values[r].devices() == {step.layout.replica_devices[r]}
        assert out["loss"].values[r].devices() == {step.layout.replica_devices[r]}


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("key,axis", [("loss", None), ("rowsum", None), ("rowsum", 0),
                                      ("h", None), ("h", 0)])
def test_reduce_of_a_result_equals_numpy_on_the_values(op, key, axis):
    """rt.reduce reads a result's global array with one transfer; it must equal the
    reduction of the per-replica values (numpy's, on jax.jit's per-replica answers)."""
    w, xs = _data(3)
    out = rt.replicate(_step, num_replicas=N)(w, rt.PerReplica(xs))
    got = rt.reduce(op, out[key], axis=axis)
    assert out[key]._values is None  # read from the global array, not split
    vals = [np.asarray(want[key]) for want in _want(w, xs)]
    fn = getattr(np, op)
    expect = fn(np.stack(vals), axis=0) if axis is None else fn(np.concatenate(vals, 0), axis=0)
    np.testing.assert_allclose(got, expect, rtol=1e-6)
    # the same through the split values (the path every other PerReplica takes)
    np.testing.assert_allclose(rt.reduce(op, rt.PerReplica(out[key].values), axis=axis), expect,
                               rtol=1e-6)


def test_reduce_axis_out_of_range_on_a_deferred_scalar():
    w, xs = _data(4)
    out = rt.replicate(_step, num_replicas=N)(w, rt.PerReplica(xs))
    with pytest.raises(ValueError, match=r"axis 0 is out of range for per-replica values of "
                                         r"shape \(\) \(rank 0\)"):
        rt.reduce("sum", out["loss"], axis=0)


@pytest.mark.parametrize("read_first", [False, True])
def test_a_result_fed_back_as_an_input(read_first):
    """A per-replica result passed to the next step (per-replica state) equals passing
    fresh per-replica arrays of the same values, whether or not .values was read."""
    def carry(h, s):
        return h * 2 + s, s + h.sum()
    step = rt.replicate(carry, num_replicas=N)
    rng = np.random.default_rng(5)
    hs = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(N)]
    ss = [np.float32(r + 1) for r in range(N)]
    h1, s1 = step(rt.PerReplica(hs), rt.PerReplica(ss))
    if read_first:
        _ = h1.values, s1.values
    h2, s2 = step(h1, s1)  # rank 2 and rank 0 results back in as inputs
    if not read_first:  # their global arrays went in as they are, never split
        assert h1._values is None and s1._values is None
    for r in range(N):
        want_h1, want_s1 = hs[r] * 2 + ss[r], ss[r] + hs[r].sum()
        np.testing.assert_allclose(np.asarray(h1.values[r]), want_h1, rtol=1e-6)
        np.testing.assert_allclose(float(s1.values[r]), want_s1, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(h2.values[r]), want_h1 * 2 + want_s1, rtol=1e-5)
        np.testing.assert_allclose(float(s2.values[r]), want_s1 + want_h1.sum(), rtol=1e-5)


def test_deferred_repr_len_index():
    w, xs = _data(6)
    out = rt.replicate(_step, num_replicas=N)(w, rt.PerReplica(xs))
    loss = out["loss"]
    assert len(loss) == N and loss._values is None
    assert [float(v) for v in loss.values] == [float(loss[r]) for r in range(N)]
    assert repr(loss).startswith("PerReplica([Array(")


def test_deferred_values_built_once():
    calls = []

    def make():
        calls.append(1)
        return [np.float32(1), np.float32(2)]
    pr = rt.PerReplica.deferred(2, make)
    assert len(pr) == 2 and not calls
    assert pr.values == (1.0, 2.0) and pr.values is pr.values
    assert len(calls) == 1
