"""Port of google/flax examples/mnist/train.py (linen, before the NNX rewrite; the version
at the parent of commit 0ef9abb2 "Update mnist example to use NNX").

Kept from the source: the ``CNN`` (two 3x3 convs with avg pools, Dense 256, Dense 10),
``apply_model`` (value_and_grad of the softmax cross-entropy, accuracy) and
``update_model`` (``state.apply_gradients``), ``create_train_state`` with
``optax.sgd(lr, momentum)``. The source is single-device ``jax.jit``; the pmap form every
data-parallel user writes from it is ``train_step`` below: ``apply_model``, then
``lax.pmean`` of the gradients and metrics, then ``update_model``. Sizes: 8x8 images, 4 and
8 conv features, Dense 16; synthetic data of MNIST's dtypes and layout (NHWC, int labels).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

from tests.clients._harness import REPLICAS, Port, Split, check_port, mnist_batches

IMAGE = 8          # MNIST is 28; the structure (two stride-2 pools) is the same
GLOBAL_BATCH = 16


class CNN(nn.Module):
    """A simple CNN model."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=4, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=8, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=16)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


def apply_model(state, images, labels):
    """Computes gradients, loss and accuracy for a single batch."""

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, 10)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        return loss, logits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return grads, loss, accuracy


def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def train_step(state, batch):
    """apply_model + update_model, data parallel: gradients and metrics averaged over
    the replicas (axis 'batch'), as pmap code does."""
    grads, loss, accuracy = apply_model(state, batch["image"], batch["label"])
    grads = jax.lax.pmean(grads, axis_name="batch")
    state = update_model(state, grads)
    metrics = jax.lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name="batch")
    return state, metrics


def create_train_state(rng, learning_rate=0.1, momentum=0.9):
    """Creates initial `TrainState`."""
    cnn = CNN()
    params = cnn.init(rng, jnp.ones([1, IMAGE, IMAGE, 1]))["params"]
    tx = optax.sgd(learning_rate, momentum)
    return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


@pytest.mark.parametrize("n", REPLICAS)
def test_mnist_linen(n):
    # jitted: eager init compiles every op once (seconds); same values
    state = jax.jit(create_train_state)(jax.random.key(0))
    batches = mnist_batches(GLOBAL_BATCH, IMAGE)
    port = Port(step=train_step, state=(state,), inputs=lambda i: ((Split(batches[i]),), {}))
    # no per-replica statistics: the loss and accuracy averaged over replicas are the
    # global batch's, so the global-batch jit is an oracle for the metrics too
    check_port(port, n, oracle=True, oracle_metrics=lambda m: m)
