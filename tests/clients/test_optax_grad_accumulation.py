"""Port of google-deepmind/optax examples/gradient_accumulation.ipynb.

Kept from the source: the ``MLP`` ``nnx.Module`` (flatten, linear1 -> relu -> linear2 ->
relu -> linear3), ``loss_fn`` (mean ``softmax_cross_entropy_with_integer_labels``),
``build_train_step``'s ``update`` (``nnx.grad(loss_fn)``, ``optimizer.update(model,
grads)``), ``fit`` looping over batches, and the optimizer
``optax.MultiSteps(optax.sgd(schedule), every_k_schedule=k)`` with the notebook's
``piecewise_constant_schedule``. Data parallel: the model and ``nnx.Optimizer`` go through
``nnx.split``/``nnx.merge`` (graphdef closed over) and the gradients are ``lax.pmean``ed
before they reach ``MultiSteps``, which accumulates them and applies the mean every
k = 2 steps (the second step here). Sizes: 8x8 images, hidden 16.

No per-replica statistics: the global-batch jit is an oracle.
"""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from tests.clients._harness import REPLICAS, Port, Split, check_port

IMAGE = 8
GLOBAL_BATCH = 16


class MLP(nnx.Module):
    """A simple multilayer perceptron model using flax.nnx."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(IMAGE * IMAGE, 16, rngs=rngs)
        self.linear2 = nnx.Linear(16, 16, rngs=rngs)
        self.linear3 = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        # Flattens inputs in the batch.
        x = x.reshape((x.shape[0], -1))
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        x = jax.nn.relu(x)
        x = self.linear3(x)
        return x


def loss_fn(model, batch):
    """Computes loss over a mini-batch."""
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean()


def build_train_step(graphdef):
    """Builds a function for executing a single step in the optimization."""

    def update(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        grads = jax.lax.pmean(grads, axis_name="batch")
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), jax.lax.pmean(loss, axis_name="batch")

    return update


def examples(seed=0, steps=2):
    key = jax.random.PRNGKey(seed)
    out = []
    for i in range(steps):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        out.append({"image": np.asarray(jax.random.uniform(k1, (GLOBAL_BATCH, IMAGE, IMAGE, 1))),
                    "label": np.asarray(jax.random.randint(k2, (GLOBAL_BATCH,), 0, 10))})
    return out


@pytest.mark.parametrize("n", REPLICAS)
def test_optax_multisteps(n):
    learning_rate_schedule = optax.piecewise_constant_schedule(
        init_value=1.0, boundaries_and_scales={0: 1e-1, 1: 1e-1})
    optimizer = optax.sgd(learning_rate_schedule)

    @nnx.jit  # eager init compiles every op once (seconds); same values
    def create():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.MultiSteps(optimizer, every_k_schedule=2),
                                    wrt=nnx.Param)

    model, opt = create()
    graphdef, state = nnx.split((model, opt))
    batches = examples()
    port = Port(step=build_train_step(graphdef), state=(state,),
                inputs=lambda i: ((Split(batches[i]),), {}))
    check_port(port, n, oracle=True, oracle_metrics=lambda m: m)
