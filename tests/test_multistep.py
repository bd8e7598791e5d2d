"""Multi-step executables (issue 6.1): ``replicate(fn, steps_per_call=k)`` runs k steps in
one executable and must equal k single calls (and k plain ``jax.jit`` steps on the global
batch); ``donate=True`` deletes the input state's buffers; ``step_outputs`` reduces the
per-step outputs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import runtime as rt
from tests.models import init_mlp, make_data, mse_loss, optax_step, sgd_step

RTOL, ATOL = 1e-5, 1e-6
K = 5


def assert_trees_close(got, want, rtol=RTOL, atol=ATOL):
    g, gd = jax.tree.flatten(got)
    w, wd = jax.tree.flatten(want)
    assert gd == wd
    for a, b in zip(g, w):
        assert not isinstance(a, rt.PerReplica)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def mlp():
    model, params = init_mlp(d_in=4, features=8, out=2)
    batches = [make_data(n=16, d_in=4, d_out=2, seed=s) for s in range(K)]
    return model, params, batches


def sgd_state_step(model):
    loss = mse_loss(model)
    step = sgd_step(loss, lr=0.2)

    def mstep(params, batch):                      # (state, inputs) -> (state, outputs)
        return step(params, batch), loss(params, batch)
    return mstep


def adam_state_step(model, tx):
    step = optax_step(mse_loss(model), tx)

    def mstep(state, batch):
        p, s, loss = step(*state, batch)
        return (p, s), loss
    return mstep


@pytest.mark.parametrize("n", [1, 4, 8])
def test_sgd_k_steps_equal_k_single_calls(mlp, n):
    model, params, batches = mlp
    mstep = sgd_state_step(model)
    multi = rt.replicate(mstep, num_replicas=n, steps_per_call=K)
    single = rt.replicate(mstep, num_replicas=n)
    p_multi, losses = multi(params, rt.distribute_steps(batches, n))
    p, q = params, params
    want_losses = []
    ref = jax.jit(mstep)
    for b in batches:
        p, loss = single(p, rt.distribute(b, n))
        q, ref_loss = ref(q, b)
        want_losses.append(rt.reduce("mean", loss))
        np.testing.assert_allclose(rt.reduce("mean", loss), ref_loss, rtol=RTOL)
    assert_trees_close(p_multi, p)
    assert_trees_close(p_multi, q)
    # per-step outputs stacked on axis 0: replica r's losses have shape [K]
    got = rt.reduce("mean", losses)
    assert got.shape == (K,)
    np.testing.assert_allclose(got, want_losses, rtol=RTOL)
    assert multi.cache_info().misses == 1
    assert not np.allclose(jax.tree.leaves(p_multi)[1], jax.tree.leaves(params)[1])


@pytest.mark.parametrize("n", [2, 8])
def test_adam_k_steps_equal_k_single_calls(mlp, n):
    model, params, batches = mlp
    tx = optax.adam(1e-2)
    mstep = adam_state_step(model, tx)
    multi = rt.replicate(mstep, num_replicas=n, steps_per_call=K)
    single = rt.replicate(mstep, num_replicas=n)
    state0 = (params, tx.init(params))
    (p_multi, s_multi), _ = multi(state0, rt.distribute_steps(batches, n))
    state = state0
    for b in batches:
        state, _ = single(state, rt.distribute(b, n))
    assert_trees_close(p_multi, state[0])
    assert_trees_close(s_multi, state[1])
    # two multi-step calls == 2K single steps (the state round-trips)
    (p2, _), _ = multi((p_multi, s_multi), rt.distribute_steps(batches, n))
    for b in batches:
        state, _ = single(state, rt.distribute(b, n))
    assert_trees_close(p2, state[0])
    assert multi.cache_info().misses == 1


def test_per_replica_values_with_leading_k_axis(mlp):
    """The documented input layout: each PerReplica leaf is [k, ...], built by hand."""
    model, params, batches = mlp
    n = 4
    mstep = sgd_state_step(model)
    per = [rt.distribute(b, n) for b in batches]
    hand = rt.PerReplica([jax.tree.map(lambda *xs: np.stack(xs), *[per[t].values[r] for t in range(K)])
                          for r in range(n)])
    multi = rt.replicate(mstep, num_replicas=n, steps_per_call=K)
    a, _ = multi(params, hand)
    b, _ = multi(params, rt.distribute_steps(batches, n))
    assert_trees_close(a, b, rtol=0, atol=0)
    # a tuple of [K, B, ...] arrays is the same input
    stacked = (np.stack([x for x, _ in batches]), np.stack([y for _, y in batches]))
    c, _ = multi(params, rt.distribute_steps(stacked, n))
    assert_trees_close(c, b, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["last", "mean", "sum", "stack"])
def test_step_outputs(mlp, mode):
    model, params, batches = mlp
    n = 2
    mstep = sgd_state_step(model)
    stacked = rt.replicate(mstep, num_replicas=n, steps_per_call=K)
    red = rt.replicate(mstep, num_replicas=n, steps_per_call=K, step_outputs=mode)
    _, all_losses = stacked(params, rt.distribute_steps(batches, n))
    _, got = red(params, rt.distribute_steps(batches, n))
    for r in range(n):
        full = np.asarray(all_losses.values[r])
        want = {"last": full[-1], "mean": full.mean(0), "sum": full.sum(0), "stack": full}[mode]
        np.testing.assert_allclose(np.asarray(got.values[r]), want, rtol=RTOL)


@pytest.mark.parametrize("k", [1, K])
def test_donate_deletes_input_state(mlp, k):
    model, params, batches = mlp
    n = 4
    tx = optax.adam(1e-2)
    mstep = adam_state_step(model, tx)
    donating = rt.replicate(mstep, num_replicas=n, steps_per_call=k, donate=True)
    plain = rt.replicate(mstep, num_replicas=n, steps_per_call=k)
    x = rt.distribute_steps(batches[:k], n) if k > 1 else rt.distribute(batches[0], n)
    want, _ = plain((params, tx.init(params)), x)
    state = jax.tree.map(jnp.array, (params, tx.init(params)))   # our own copies
    leaves = jax.tree.leaves(state)
    got, _ = donating(state, x)
    assert all(a.is_deleted() for a in leaves)
    assert_trees_close(got, want)
    # next call with the returned state (already on the mesh): donated again, right numbers
    leaves = jax.tree.leaves(got)
    got2, _ = donating(got, x)
    want2, _ = plain(want, x)
    assert all(a.is_deleted() for a in leaves)
    assert_trees_close(got2, want2)
    assert not any(a.is_deleted() for a in jax.tree.leaves(got2))


def test_multistep_errors(mlp):
    model, params, batches = mlp
    mstep = sgd_state_step(model)
    multi = rt.replicate(mstep, num_replicas=2, steps_per_call=3)
    with pytest.raises(ValueError, match=r"shape \[3, \.\.\.\]"):
        multi(params, rt.distribute_steps(batches[:2], 2))
    bad = rt.replicate(lambda p, b: p, num_replicas=2, steps_per_call=2)
    with pytest.raises(TypeError, match="must return"):
        bad(params, rt.distribute_steps(batches[:2], 2))
    with pytest.raises(ValueError, match="step_outputs"):
        rt.replicate(mstep, step_outputs="first")
    with pytest.raises(ValueError, match="steps_per_call"):
        rt.replicate(mstep, steps_per_call=0)


@pytest.mark.parametrize("how", ["mean", "sum"])
def test_step_outputs_mean_of_a_key_output_is_a_clear_error(how):
    """``step_outputs="mean"``/``"sum"`` of an output that is a PRNG key: a
    ``TypeError`` naming the option and the output (before: NumPy's ``Cannot interpret
    'key<fry>' as a data type``)."""
    def step(key, x):
        key, sub = jax.random.split(key)
        return key, (jnp.sum(x), sub)
    s = rt.replicate(step, num_replicas=2, steps_per_call=3, step_outputs=how)
    with pytest.raises(TypeError, match=rf"step_outputs='{how}'\): output outputs\[1\] is "
                                        r"key<fry> \(a PRNG key\)"):
        s(jax.random.key(0), rt.distribute_steps([np.ones((2, 1), np.float32)] * 3, 2))
