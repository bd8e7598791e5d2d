"""Port of google-deepmind/optax examples/contrib/reduce_on_plateau.ipynb.

Kept from the source: the ``MLP`` (flax linen: flatten, Dense-relu-Dense-relu-Dense), the
jitted ``loss_accuracy`` (softmax cross-entropy with integer labels, accuracy), the
optimizer ``optax.chain(optax.adam(LEARNING_RATE), contrib.reduce_on_plateau(patience=...,
cooldown=..., factor=..., rtol=..., accumulation_size=...))`` and the jitted
``train_step`` (``value_and_grad(loss_accuracy, has_aux=True)``, ``opt.update(grad,
opt_state, params, value=value)``, ``apply_updates``). Changed for a test: Fashion-MNIST
is synthetic batches of its shape (28x28, 10 classes), the hidden layers are 32 wide (the
notebook's 1000), the plateau is reached in a few steps (``accumulation_size=2``,
``patience=1``, a learning rate of 0.003: the random labels' loss stops improving by the
fourth step), so the learning-rate scale really changes (the test checks that it did),
and Adam's ``eps`` is 1e-4 (optax's 1e-8): Adam's first update is ``lr * g / (|g| +
eps)``, the sign of ``g`` wherever ``g`` is far below ``eps``, and a weight whose gradient
is rounding noise (a pixel no example lights up) would then move by ``+-lr`` depending on
the order the global batch's gradient was summed in (0.6% of a weight after six steps:
numbers, not a defect; pmap and replicate, which sum alike, agree either way).

What this checks is state computed from the loss: ``reduce_on_plateau`` keeps a running
mean of the ``value`` it is given and scales the updates down when it stops improving.

* pmap style (the gradients and the value ``pmean``-ed): pmap and the global-batch jit
  are oracles.
* Written for one replica, as the notebook has it: the value is the replica's own loss,
  so the plateau state, the scale and the parameters come out different on every
  replica. ``replicate`` returns them as ``PerReplica`` (what they are) and warns
  (``rt.DivergingStateWarning``) naming the leaves: fed back, the replicas would train
  apart without a word. TF refuses the same (updating a mirrored variable with a
  per-replica value needs an aggregation).
* Written for one replica with the value averaged (``rt.all_reduce(value, "mean")``, the
  one change the warning asks for): no warning, and the global-batch step.
"""
from __future__ import annotations

import re
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from optax import contrib

import runtime as rt
from tests.clients._harness import REPLICAS, Port, Split, check_against_global, check_port

GLOBAL_BATCH = 32
IMG_SIZE = (28, 28, 1)
NUM_CLASSES = 10
STEPS = 6

LEARNING_RATE = 0.003
PATIENCE = 1
COOLDOWN = 0
FACTOR = 0.5
RTOL = 1e-4
ACCUMULATION_SIZE = 2


class MLP(nn.Module):
    """A simple multilayer perceptron model for image classification."""
    hidden_sizes: Sequence[int] = (32, 32)

    @nn.compact
    def __call__(self, x):
        # Flattens images in the batch.
        x = x.reshape((x.shape[0], -1))
        x = nn.Dense(features=self.hidden_sizes[0])(x)
        x = nn.relu(x)
        x = nn.Dense(features=self.hidden_sizes[1])(x)
        x = nn.relu(x)
        x = nn.Dense(features=NUM_CLASSES)(x)
        return x


net = MLP()


@jax.jit
def loss_accuracy(params, data):
    inputs, labels = data
    logits = net.apply({"params": params}, inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=labels
    ).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, {"accuracy": accuracy}


opt = optax.chain(
    optax.adam(LEARNING_RATE, eps=1e-4),
    contrib.reduce_on_plateau(
        patience=PATIENCE,
        cooldown=COOLDOWN,
        factor=FACTOR,
        rtol=RTOL,
        accumulation_size=ACCUMULATION_SIZE,
    ),
)


def make_train_step(value_reduction: str | None):
    """The notebook's ``train_step``; ``value_reduction``: ``"pmean"`` (pmap style, the
    gradients and the value averaged over ``'batch'``), ``"all_reduce"`` (written for one
    replica, the value averaged with ``rt.all_reduce``) or ``None`` (the notebook's)."""
    @jax.jit
    def train_step(params, opt_state, batch):
        """Performs a one step update."""
        (value, aux), grad = jax.value_and_grad(loss_accuracy, has_aux=True)(
            params, batch
        )
        if value_reduction == "pmean":
            grad = jax.lax.pmean(grad, "batch")
            value = jax.lax.pmean(value, "batch")
        elif value_reduction == "all_reduce":
            value = rt.all_reduce(value, "mean")
        updates, opt_state = opt.update(grad, opt_state, params, value=value)
        params = optax.apply_updates(params, updates)
        return params, opt_state, value, aux
    return train_step


def batches(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.random((GLOBAL_BATCH,) + IMG_SIZE, dtype=np.float32),
             rng.integers(0, NUM_CLASSES, GLOBAL_BATCH).astype(np.int32))
            for _ in range(STEPS)]


def port(value_reduction: str | None) -> Port:
    fake_data = jnp.ones((1,) + IMG_SIZE, dtype=jnp.float32)
    init_params = net.init({"params": jax.random.PRNGKey(0)}, fake_data)["params"]
    data = batches()
    return Port(step=make_train_step(value_reduction),
                state=(init_params, opt.init(init_params)),
                inputs=lambda i: ((Split(data[i]),), {}),
                split_out=lambda out: (out[:2], out[2]))


def _scale(state) -> np.ndarray:
    """The plateau state's learning-rate scale (every replica's, ``[n]``)."""
    return np.asarray(state[1][1].scale)


@pytest.mark.parametrize("n", REPLICAS)
def test_reduce_on_plateau_pmap_style(n):
    check_port(port("pmean"), n, oracle=True, steps=STEPS, oracle_metrics=lambda m: m)


@pytest.mark.parametrize("n", REPLICAS)
def test_the_value_averaged_with_all_reduce_equals_the_global_batch(n):
    # (the oracle: the pmap-style step on the global batch, where every pmean is the
    # identity; rt.all_reduce runs only under replicate)
    with warnings.catch_warnings():
        warnings.simplefilter("error", rt.DivergingStateWarning)
        g_state = check_against_global(port("all_reduce"), n, STEPS, oracle=port("pmean"),
                                       metric_tol=(2e-5, 0.0))
    assert _scale(g_state)[0] < 1.0, "the plateau was never reached: the test checks nothing"


def test_the_notebooks_step_warns_that_the_plateau_state_diverges():
    """The notebook's step unchanged: the plateau state is each replica's own, returned as
    ``PerReplica``, with a warning naming its leaves and the line that made them; its
    numbers are each replica's own run of the notebook on its slice, the first step's."""
    n = 4
    p = port(None)
    step = rt.replicate(p.step, num_replicas=n)
    data = batches()
    with pytest.warns(rt.DivergingStateWarning) as record:
        params, opt_state, value, _ = step(*p.state, rt.distribute(data[0], n))
    texts = [str(w.message) for w in record]
    assert len(texts) == 2, texts  # the params (result 0) and the optimizer state (result 1)
    assert re.search(r"train_step: result 1 has the structure, shapes and dtypes of argument 1"
                     r", which came in mirrored .* 5 of its \d+ leaves come out varying across "
                     r"replicas: result\[1\]\[1\]\.scale \(made at _reduce_on_plateau\.py:\d+\)",
                     texts[1]), texts[1]
    assert "rt.all_reduce(x, 'mean')" in texts[1]
    assert isinstance(opt_state[1].scale, rt.PerReplica)
    # each replica's own notebook step on its slice of the batch
    one = jax.jit(make_train_step(None))
    for r in range(n):
        sl = slice(r * GLOBAL_BATCH // n, (r + 1) * GLOBAL_BATCH // n)
        want = one(*p.state, (data[0][0][sl], data[0][1][sl]))
        np.testing.assert_allclose(np.asarray(value.values[r]), want[2], rtol=2e-5)
        np.testing.assert_allclose(np.asarray(opt_state[1].avg_value.values[r]),
                                   want[1][1].avg_value, rtol=2e-5)
    # passed back in, the PerReplica state is a per-replica argument: no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", rt.DivergingStateWarning)
        step(params, opt_state, rt.distribute(data[1], n))
