"""Port of patrick-kidger/equinox docs/examples/mnist.ipynb ("Convolutional Neural
Network on MNIST").

Kept from the source: the ``CNN`` ``eqx.Module`` (``Conv2d(1, 3, kernel_size=4)``,
``MaxPool2d(2)``, relu, ``jnp.ravel``, three ``Linear`` layers with sigmoid/relu,
``log_softmax``) applied per example with ``jax.vmap``; ``loss`` and ``cross_entropy``;
``optax.adamw`` over ``eqx.filter(model, eqx.is_array)``; ``make_step`` with
``eqx.filter_value_and_grad`` and ``eqx.apply_updates``. The model holds functions
(``jax.nn.relu``, ``jnp.ravel``) as leaves, so data-parallel code splits it with
``eqx.partition(model, eqx.is_array)`` (as the notebook shows for ``jax.value_and_grad``),
passes the arrays through pmap and closes over the static part; ``make_step`` then
``lax.pmean``s the gradients and the loss. Sizes: 12x12 images, Linear 48-16-10.

No per-replica statistics: the global-batch jit is an oracle.
"""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.clients._harness import REPLICAS, Port, Split, check_port

BATCH_SIZE = 16
LEARNING_RATE = 3e-4
SEED = 5678
IMAGE = 12


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        key1, key2, key3, key4 = jax.random.split(key, 4)
        # Standard CNN setup: convolutional layer, followed by flattening,
        # with a small MLP on top.
        self.layers = [
            eqx.nn.Conv2d(1, 3, kernel_size=4, key=key1),
            eqx.nn.MaxPool2d(kernel_size=2),
            jax.nn.relu,
            jnp.ravel,
            eqx.nn.Linear(3 * (IMAGE - 4) ** 2, 16, key=key2),   # 1728 -> 512 in the source
            jax.nn.sigmoid,
            eqx.nn.Linear(16, 16, key=key3),
            jax.nn.relu,
            eqx.nn.Linear(16, 10, key=key4),
            jax.nn.log_softmax,
        ]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def loss(model, x, y):
    # Our input has the shape (BATCH_SIZE, 1, H, W), the model works on one image.
    pred_y = jax.vmap(model)(x)
    return cross_entropy(y, pred_y)


def cross_entropy(y, pred_y):
    pred_y = jnp.take_along_axis(pred_y, jnp.expand_dims(y, 1), axis=1)
    return -jnp.mean(pred_y)


optim = optax.adamw(LEARNING_RATE)


def make_train_step(static):
    """``make_step`` on the arrays of the model (``params``); ``static`` is the rest."""

    def make_step(params, opt_state, x, y):
        model = eqx.combine(params, static)
        loss_value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        grads = jax.lax.pmean(grads, axis_name="batch")
        loss_value = jax.lax.pmean(loss_value, axis_name="batch")
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        params, _ = eqx.partition(model, eqx.is_array)
        return params, opt_state, loss_value

    return make_step


def trainloader(steps=2, seed=0):
    """Synthetic batches shaped like the notebook's torch loader: images normalised to
    [-1, 1], NCHW, int labels."""
    rng = np.random.default_rng(seed)
    return [(rng.uniform(-1, 1, (BATCH_SIZE, 1, IMAGE, IMAGE)).astype(np.float32),
             rng.integers(0, 10, BATCH_SIZE).astype(np.int32)) for _ in range(steps)]


@pytest.mark.parametrize("n", REPLICAS)
def test_equinox_mnist(n):
    key = jax.random.PRNGKey(SEED)
    key, subkey = jax.random.split(key, 2)
    model = eqx.filter_jit(CNN)(subkey)  # jitted: eager init compiles every op once
    opt_state = eqx.filter_jit(optim.init)(eqx.filter(model, eqx.is_array))
    params, static = eqx.partition(model, eqx.is_array)
    batches = trainloader()
    port = Port(step=make_train_step(static), state=(params, opt_state),
                inputs=lambda i: ((Split(batches[i][0]), Split(batches[i][1])), {}),
                split_out=lambda out: (out[:2], out[2]))
    check_port(port, n, oracle=True, oracle_metrics=lambda m: m)
