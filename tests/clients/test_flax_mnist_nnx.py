"""Port of google/flax examples/mnist/train.py (the NNX version, HEAD).

Kept from the source: the ``CNN`` ``nnx.Module`` (conv1 -> dropout1 -> batch_norm1 -> relu
-> avg_pool, conv2 -> batch_norm2 -> relu -> avg_pool, linear1 -> relu/dropout2, linear2),
``loss_fn`` (``softmax_cross_entropy_with_integer_labels``), ``train_step`` with
``nnx.value_and_grad(loss_fn, has_aux=True)`` and ``optimizer.update(model, grads)`` on
``nnx.Optimizer(model, optax.sgd(lr, momentum), wrt=nnx.Param)``, dropout rngs passed to
the call. Data parallel, as NNX code does it under ``jax.pmap``: the model and optimizer
go through ``nnx.split`` / ``nnx.merge`` (the graphdef closed over), each replica builds
``nnx.Rngs`` from its own dropout key, the gradients are ``lax.pmean``ed, and so are the
BatchNorm statistics after the update (the source's BatchNorm has no ``axis_name``; the
statistics would otherwise differ between replicas). ``nnx.MultiMetric`` is replaced by
the pmean'd loss and accuracy, which is what it would accumulate. Sizes: 8x8 images, 4
and 8 conv features, Linear 32-16-10.

Per-replica BatchNorm statistics and dropout: replicate must equal pmap.
"""
from __future__ import annotations

from functools import partial

import jax
import optax
import pytest
from flax import nnx

from tests.clients._harness import REPLICAS, Each, Port, Split, check_port, mnist_batches, make_keys

IMAGE = 8
GLOBAL_BATCH = 16


class CNN(nnx.Module):
    """A simple CNN model."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(8, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(8 * (IMAGE // 4) ** 2, 16, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        x = self.linear2(x)
        return x


def loss_fn(model: CNN, batch, rngs):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean()
    return loss, logits


def make_train_step(graphdef):
    def train_step(state, batch, dropout_key):
        """Train for a single step."""
        model, optimizer = nnx.merge(graphdef, state)
        rngs = nnx.Rngs(dropout=jax.random.fold_in(dropout_key, optimizer.step[...]))
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, batch, rngs)
        grads = jax.lax.pmean(grads, axis_name="batch")
        optimizer.update(model, grads)  # In-place updates.
        batch_stats = jax.lax.pmean(nnx.state(model, nnx.BatchStat), axis_name="batch")
        nnx.update(model, batch_stats)
        accuracy = (logits.argmax(-1) == batch["label"]).mean()
        metrics = jax.lax.pmean({"loss": loss, "accuracy": accuracy}, axis_name="batch")
        return nnx.state((model, optimizer)), metrics

    return train_step


@pytest.mark.parametrize("n", REPLICAS)
def test_mnist_nnx(n):
    @nnx.jit  # eager init compiles every op once (seconds); same values
    def create():
        model = CNN(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1, 0.9), wrt=nnx.Param)

    model, optimizer = create()
    model.train()  # Switch to train mode
    graphdef, state = nnx.split((model, optimizer))
    batches = mnist_batches(GLOBAL_BATCH, IMAGE)
    keys = make_keys(0, n)
    port = Port(step=make_train_step(graphdef), state=(state,),
                inputs=lambda i: ((Split(batches[i]), Each(keys)), {}))
    check_port(port, n, oracle=False)
