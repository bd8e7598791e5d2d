"""Port of patrick-kidger/equinox docs/examples/frozen_layer.ipynb ("Freezing parameters").

Kept from the source: the toy regression data ``y = 5x - 2``; ``eqx.nn.MLP(in_size=1,
out_size=1, width_size=8, depth=1)``; the ``filter_spec`` built with ``jtu.tree_map`` and
``eqx.tree_at`` so only the last layer trains; ``make_step`` decorated with
``eqx.filter_jit`` (the step ``rt.replicate`` receives is that filter_jit-wrapped
function), the loss decorated with ``eqx.filter_grad`` and taking ``(diff_model,
static_model, x, y)``; ``eqx.partition`` by the filter spec, ``optax.sgd(3e-3)``,
``eqx.apply_updates``. Data parallel: the model's arrays go through pmap (the static
part, functions included, closed over) and ``make_step`` ``lax.pmean``s the gradients
over ``'batch'``, as pmap code does. Sizes: as in the source, a global batch of 32.

No per-replica statistics: the global-batch jit is an oracle.
"""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

from tests.clients._harness import REPLICAS, Port, Split, check_port, train

BATCH_SIZE, LEARNING_RATE, WIDTH, DEPTH, SEED = 32, 3e-3, 8, 1, 5678


def get_data(dataset_size, *, key):
    x = jrandom.normal(key, (dataset_size, 1))
    y = 5 * x - 2
    return x, y


optim = optax.sgd(LEARNING_RATE)


def make_train_step(static, filter_spec):
    """The source's ``make_step`` on the model's arrays (``params``)."""

    @eqx.filter_jit
    def make_step(params, opt_state, x, y):
        model = eqx.combine(params, static)

        @eqx.filter_grad
        def loss(diff_model, static_model, x, y):
            model = eqx.combine(diff_model, static_model)
            pred_y = jax.vmap(model)(x)
            return jnp.mean((y - pred_y) ** 2)

        diff_model, static_model = eqx.partition(model, filter_spec)
        grads = loss(diff_model, static_model, x, y)
        grads = jax.lax.pmean(grads, axis_name="batch")
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        params, _ = eqx.partition(model, eqx.is_array)
        return params, opt_state

    return make_step


@pytest.mark.parametrize("n", REPLICAS)
def test_equinox_frozen_layer(n):
    data_key, model_key = jrandom.split(jrandom.PRNGKey(SEED), 2)
    x, y = (np.asarray(a) for a in get_data(2 * BATCH_SIZE, key=data_key))
    model = eqx.filter_jit(lambda k: eqx.nn.MLP(in_size=1, out_size=1, width_size=WIDTH,
                                                depth=DEPTH, key=k))(model_key)
    filter_spec = jtu.tree_map(lambda _: False, model)
    filter_spec = eqx.tree_at(lambda tree: (tree.layers[-1].weight, tree.layers[-1].bias),
                              filter_spec, replace=(True, True))
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = eqx.filter_jit(optim.init)(params)
    batches = [(x[i * BATCH_SIZE:(i + 1) * BATCH_SIZE], y[i * BATCH_SIZE:(i + 1) * BATCH_SIZE])
               for i in range(2)]
    port = Port(step=make_train_step(static, filter_spec), state=(params, opt_state),
                inputs=lambda i: ((Split(batches[i][0]), Split(batches[i][1])), {}),
                split_out=lambda out: (out, {}))
    check_port(port, n, oracle=True)
    # the frozen layer stays frozen: replicate trains only the last layer
    state, _ = train(port, "replicate", n)
    first = [np.asarray(a)[0] for a in jax.tree.leaves(state[0].layers[0])]
    for got, want in zip(first, jax.tree.leaves(model.layers[0])):
        np.testing.assert_array_equal(got, np.asarray(want))
