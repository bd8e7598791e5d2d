"""Port of patrick-kidger/equinox docs/examples/parallelism.ipynb ("Autoparallelism (e.g.
multi-GPU)"; equinox at 9336d82).

The notebook trains ``eqx.nn.MLP(4, 4, 32, 1)`` with ``optax.adam(3e-4)`` on ``sin`` of
Gaussian data: a *global* step, ``eqx.filter_jit(donate="all")``, that constrains the
model and optimizer state to be replicated (``eqx.filter_shard(..., P())``) and the batch
to be split over the mesh axis ``"batch"`` (``eqx.filter_shard(..., P("batch"))``), on 8
devices. That program is the oracle here, kept as the notebook writes it.

What a user porting it to ``rt.replicate`` meets, kept as tests:

* the notebook's ``train_step`` as it is: the model holds a function (its activation,
  which ``filter_jit`` treats as static), a ``TypeError`` naming the leaf and how to pass
  it;
* split off with ``eqx.partition`` (the notebook's step otherwise untouched): its
  ``filter_shard(x, P("batch"))`` splits the replica's own part of the batch over every
  device, a ``ShardingConstraintError`` naming the notebook's line; its replicated
  constraint on the model is kept (a layout, never a value);
* without the batch's constraint, the step written for the global batch is a step for
  one replica with the same numbers (its loss is a mean over equal-sized per-replica
  batches, and the gradients are averaged): equal to the notebook's own sharded program
  for 100 steps of its shuffling dataloader, and for SGD, whose update scales with the
  gradient (Adam's does not, so a reduction applied N times would pass with Adam alone).

Sizes are the notebook's (dataset 64, batch 16 = 8 replicas x 2); the number of steps
is 20 (the notebook's 100 cost 5x the time for no other code path).
"""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.sharding as jshard
import numpy as np
import optax
import pytest

import runtime as rt

# Hyperparameters (the notebook's)
dataset_size = 64
channel_size = 4
hidden_size = 32
depth = 1
learning_rate = 3e-4
num_steps = 20
batch_size = 16  # must be a multiple of our number of devices.
N = 8


def compute_loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    return jnp.mean((y - pred_y) ** 2)


def train_dataloader(arrays, batch_size, seed):
    """The notebook's dataloader, with its own seeded generator (the notebook uses the
    global ``np.random``) so both sides see the same batches."""
    rng = np.random.RandomState(seed)
    dataset_size = arrays[0].shape[0]
    assert all(array.shape[0] == dataset_size for array in arrays)
    indices = np.arange(dataset_size)
    while True:
        perm = rng.permutation(indices)
        start = 0
        end = batch_size
        while end <= dataset_size:
            batch_perm = perm[start:end]
            yield tuple(array[batch_perm] for array in arrays)
            start = end
            end = start + batch_size


def setup(optim):
    rng = np.random.RandomState(0)
    xs = rng.normal(size=(dataset_size, channel_size)).astype(np.float32)
    ys = np.sin(xs)
    model = eqx.nn.MLP(channel_size, channel_size, hidden_size, depth, key=jr.PRNGKey(6789))
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    return xs, ys, model, opt_state


def shardings():
    mesh = jax.make_mesh((N,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:N])
    data_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec("batch"))
    model_sharding = jshard.NamedSharding(mesh, jshard.PartitionSpec())
    return data_sharding, model_sharding


def make_train_step(optim, data_sharding, model_sharding, constrain_batch=True):
    """The notebook's ``train_step``; ``constrain_batch=False``: without its constraint
    on the batch (the one change a port to ``replicate`` needs)."""
    @eqx.filter_jit(donate="all")
    def train_step(model, opt_state, x, y):
        model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
        if constrain_batch:
            x, y = eqx.filter_shard((x, y), data_sharding)
        grads = eqx.filter_grad(compute_loss)(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return eqx.filter_shard((model, opt_state), model_sharding)
    return train_step


def run_notebook(optim):
    """The notebook's training loop as it is: the oracle (the global batch, sharded)."""
    xs, ys, model, opt_state = setup(optim)
    data_sharding, model_sharding = shardings()
    train_step = make_train_step(optim, data_sharding, model_sharding)
    model, opt_state = eqx.filter_shard((model, opt_state), model_sharding)
    for step, (x, y) in zip(range(1, num_steps + 1),
                            train_dataloader((xs, ys), batch_size, seed=1)):
        x, y = eqx.filter_shard((x, y), data_sharding)
        model, opt_state = train_step(model, opt_state, x, y)
    return model, opt_state


def run_replicated(optim):
    """The port: the notebook's step, its batch constraint dropped, the model's arrays
    split from its functions, replicated over 8 replicas."""
    xs, ys, model, opt_state = setup(optim)
    data_sharding, model_sharding = shardings()
    train_step = make_train_step(optim, data_sharding, model_sharding, constrain_batch=False)
    params, static = eqx.partition(model, eqx.is_array)

    def step_fn(params, opt_state, x, y):
        model, opt_state = train_step(eqx.combine(params, static), opt_state, x, y)
        return eqx.filter(model, eqx.is_array), opt_state

    step = rt.replicate(step_fn, num_replicas=N)
    for step_i, (x, y) in zip(range(1, num_steps + 1),
                              train_dataloader((xs, ys), batch_size, seed=1)):
        params, opt_state = step(params, opt_state, rt.distribute(x, N), rt.distribute(y, N))
    assert step.cache_info().misses == 1
    return eqx.combine(params, static), opt_state


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_port_equals_the_notebooks_sharded_program(optimizer):
    optim = optax.adam(learning_rate) if optimizer == "adam" else optax.sgd(0.1)
    ref_model, ref_state = run_notebook(optim)
    model, state = run_replicated(optim)
    ref_leaves = jax.tree.leaves(eqx.filter((ref_model, ref_state), eqx.is_array))
    leaves = jax.tree.leaves(eqx.filter((model, state), eqx.is_array))
    assert len(leaves) == len(ref_leaves)
    for got, want in zip(leaves, ref_leaves):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-7)
    # the training moved the weights (a step that did nothing would match nothing)
    _, _, model0, _ = setup(optim)
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(
        jax.tree.leaves(eqx.filter(ref_model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(model0, eqx.is_array))))
    assert moved > (1e-3 if optimizer == "adam" else 1e-2)


def test_the_notebooks_model_as_an_argument_names_its_function_leaf():
    optim = optax.adam(learning_rate)
    xs, ys, model, opt_state = setup(optim)
    step = rt.replicate(make_train_step(optim, *shardings()), num_replicas=N)
    with pytest.raises(TypeError, match=r"args\[0\]\.activation is an instance of .*custom_jvp"
                       r".*eqx\.partition\(model, eqx\.is_array\).*static_argnums"):
        step(model, opt_state, rt.distribute(xs[:16], N), rt.distribute(ys[:16], N))


def test_the_notebooks_batch_constraint_is_an_error_naming_its_line():
    optim = optax.adam(learning_rate)
    xs, ys, model, opt_state = setup(optim)
    train_step = make_train_step(optim, *shardings())
    params, static = eqx.partition(model, eqx.is_array)

    def step_fn(params, opt_state, x, y):
        model, opt_state = train_step(eqx.combine(params, static), opt_state, x, y)
        return eqx.filter(model, eqx.is_array), opt_state

    step = rt.replicate(step_fn, num_replicas=N)
    with pytest.raises(rt.ShardingConstraintError) as e:
        step(params, opt_state, rt.distribute(xs[:16], N), rt.distribute(ys[:16], N))
    msg = str(e.value)
    # the library's line and the notebook's (the x, y = eqx.filter_shard(...) in train_step)
    assert "(equinox), called from test_equinox_parallelism.py:" in msg
    line = int(msg.split("test_equinox_parallelism.py:")[1].split()[0])
    with open(__file__) as f:
        assert "eqx.filter_shard((x, y), data_sharding)" in f.read().splitlines()[line - 1]
    # the replica's part of the batch (2 of 16 rows), the layout and the mesh
    assert "f32[2,4]" in msg and "P('batch',)" in msg and "{'batch': 8}" in msg
    assert isinstance(e.value, ValueError)
