"""Checkpointing parameters split over logical devices with orbax-checkpoint.

A Megatron-split MLP (``w1`` by columns, ``w2`` by rows over the replica's 2 logical
devices, ``rt.split_to_logical_devices``) trained with Adam on 2 replicas x 2 logical
devices. After one step the parameters and optimizer state are saved with
``ocp.StandardCheckpointer`` and restored with the saved arrays' own shardings as the
target. The restored arrays must hold the same values with the same ``.sharding``, and
one more step from them must equal one more step from the in-memory state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import runtime as rt
from tests.clients._harness import assert_trees_close

N, K = 2, 2
tx = optax.adam(1e-2)


def loss(params, x):
    w1 = rt.split_to_logical_devices(params["w1"], [1, K])   # columns over the K devices
    h = jax.nn.gelu(x @ w1 + params["b1"])
    w2 = rt.split_to_logical_devices(params["w2"], [K, 1])   # rows: XLA adds an all-reduce
    return jnp.mean((h @ w2 - x) ** 2)


def train_step(state, x):
    params, opt_state = state
    l, grads = jax.value_and_grad(loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), l


def test_orbax_roundtrip_of_split_params(tmp_path):
    rng = np.random.default_rng(0)
    params = {"w1": (rng.normal(size=(8, 16)) * 0.3).astype(np.float32),
              "b1": np.zeros(16, np.float32),
              "w2": (rng.normal(size=(16, 8)) * 0.3).astype(np.float32)}
    batches = [rng.normal(size=(4 * N, 8)).astype(np.float32) for _ in range(2)]
    step = rt.replicate(train_step, num_replicas=N, logical_devices=K)

    state, _ = step((params, tx.init(params)), rt.distribute(batches[0], N))
    w1 = state[0]["w1"]
    assert isinstance(w1, jax.Array) and not w1.sharding.is_fully_replicated, \
        f"w1 should stay split over the logical devices, got {w1.sharding}"

    ckpt = ocp.StandardCheckpointer()
    path = tmp_path / "ckpt"
    ckpt.save(path, state)
    ckpt.wait_until_finished()
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored = ckpt.restore(path, target)
    ckpt.close()

    flat_r, def_r = jax.tree_util.tree_flatten_with_path(restored)
    flat_s, def_s = jax.tree_util.tree_flatten_with_path(state)
    assert def_r == def_s
    for (p, r), (_, s) in zip(flat_r, flat_s):
        name = jax.tree_util.keystr(p)
        assert r.sharding == s.sharding, f"{name}: restored {r.sharding}, saved {s.sharding}"
        np.testing.assert_array_equal(np.asarray(r), np.asarray(s), err_msg=name)

    from_memory, l_mem = step(state, rt.distribute(batches[1], N))
    from_disk, l_disk = step(restored, rt.distribute(batches[1], N))
    assert_trees_close(from_disk, from_memory, "step from restored vs in-memory", 0, 0)
    assert_trees_close(rt.reduce("mean", l_disk), rt.reduce("mean", l_mem), "loss", 0, 0)
    for a, b in zip(jax.tree.leaves(from_disk), jax.tree.leaves(from_memory)):
        assert a.sharding == b.sharding
    assert step.cache_info().misses == 1, step.cache_info()
