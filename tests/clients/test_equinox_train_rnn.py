"""Port of patrick-kidger/equinox docs/examples/train_rnn.ipynb ("Train RNN").

Kept from the source: ``get_data`` (sine and cosine curves of 16 steps, the first half of
the dataset flipped and labelled 0), the ``RNN`` ``eqx.Module`` (an ``eqx.nn.GRUCell``
run over the sequence with ``lax.scan``, a bias-free ``Linear`` and a bias, a sigmoid),
``compute_loss`` (``eqx.filter_value_and_grad`` of the binary cross-entropy of
``jax.vmap(model)``), ``optax.adam(3e-3)`` over ``eqx.filter(model, eqx.is_array)`` and
``make_step`` (``optim.update``, ``eqx.apply_updates``), with the notebook's sizes
(hidden 16, batch 32, seed 5678). The model holds an ``int`` leaf (``hidden_size``), so,
as in the equinox MNIST port, data-parallel code splits it with ``eqx.partition(model,
eqx.is_array)``, passes the arrays and closes over the rest; ``make_step`` then takes
``(params, opt_state, x, y)`` and returns ``(params, opt_state, loss)`` (the notebook:
``(model, x, y, opt_state)`` -> ``(loss, model, opt_state)``). Batches are the
notebook's dataloader's, drawn with a fixed NumPy seed.

What this checks: the gradient of a ``lax.scan`` over time whose body reads the mirrored
GRU weights, which ``replicate`` all-reduces once after the backward loop (on the
accumulated gradients) rather than once per step; the global-batch jit is the oracle.
pmap style (gradients and loss ``pmean``-ed) against pmap and the oracle; written for one
replica (no collective) against the oracle, with the notebook's Adam and with SGD (which,
unlike Adam, moves by the gradient's scale: checked, under ``loss_reduction="sum"`` its
weights end 0.056 from the oracle's, against 1.5e-8 under ``"mean"``).
"""
from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import optax
import pytest

from tests.clients._harness import REPLICAS, Port, Split, check_against_global, check_port

BATCH_SIZE = 32
STEPS = 3


def get_data(dataset_size, *, key):
    t = jnp.linspace(0, 2 * math.pi, 16)
    offset = jrandom.uniform(key, (dataset_size, 1), minval=0, maxval=2 * math.pi)
    x1 = jnp.sin(t + offset) / (1 + t)
    x2 = jnp.cos(t + offset) / (1 + t)
    y = jnp.ones((dataset_size, 1))

    half_dataset_size = dataset_size // 2
    x1 = x1.at[:half_dataset_size].multiply(-1)
    y = y.at[:half_dataset_size].set(0)
    x = jnp.stack([x1, x2], axis=-1)

    return x, y


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.Module
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jrandom.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = lax.scan(f, hidden, input)
        # sigmoid because we're performing binary classification
        return jax.nn.sigmoid(self.linear(out) + self.bias)


@eqx.filter_value_and_grad
def compute_loss(model, x, y):
    pred_y = jax.vmap(model)(x)
    # Trains with respect to binary cross-entropy
    return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y))


#: the notebook's Adam, and SGD: Adam divides each gradient by its running scale, so a
#: gradient N times too large would move it the same (and pass); SGD's step would not
OPTIMIZERS = {"adam": optax.adam(3e-3), "sgd": optax.sgd(0.5)}


def make_train_step(static, pmean: bool, optim):
    """``make_step`` on the model's arrays (``params``; ``static`` is the rest); ``pmean``:
    the pmap-style form; ``optim``: the optimizer."""
    @eqx.filter_jit
    def make_step(params, opt_state, x, y):
        model = eqx.combine(params, static)
        loss, grads = compute_loss(model, x, y)
        if pmean:
            grads = jax.lax.pmean(grads, axis_name="batch")
            loss = jax.lax.pmean(loss, axis_name="batch")
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        model = eqx.apply_updates(model, updates)
        params, _ = eqx.partition(model, eqx.is_array)
        return params, opt_state, loss
    return make_step


def dataloader(arrays, batch_size, steps, seed=0):
    """The notebook's dataloader (a permutation, then consecutive batches), seeded."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(arrays[0].shape[0])
    return [tuple(np.asarray(a)[perm[i * batch_size:(i + 1) * batch_size]] for a in arrays)
            for i in range(steps)]


def port(pmean: bool, optimizer: str = "adam") -> Port:
    optim = OPTIMIZERS[optimizer]
    data_key, model_key = jrandom.split(jrandom.PRNGKey(5678), 2)
    xs, ys = eqx.filter_jit(get_data)(256, key=data_key)
    batches = dataloader((xs, ys), BATCH_SIZE, STEPS)
    model = eqx.filter_jit(RNN)(2, 1, 16, key=model_key)
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = eqx.filter_jit(optim.init)(params)
    return Port(step=make_train_step(static, pmean, optim), state=(params, opt_state),
                inputs=lambda i: ((Split(batches[i][0]), Split(batches[i][1])), {}),
                split_out=lambda out: (out[:2], out[2]))


@pytest.mark.parametrize("n", REPLICAS)
def test_train_rnn_pmap_style(n):
    check_port(port(pmean=True), n, oracle=True, steps=STEPS, oracle_metrics=lambda m: m)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("n", REPLICAS)
def test_train_rnn_written_for_one_replica_equals_the_global_batch(n, optimizer):
    check_against_global(port(pmean=False, optimizer=optimizer), n, STEPS, what="RNN",
                         metric_tol=(2e-5, 0.0))
