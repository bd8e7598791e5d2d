"""Port of patrick-kidger/equinox examples/stateful.ipynb (BatchNorm with ``eqx.nn.State``).

Kept from the source: the ``Model`` of ``BatchNorm`` and ``Linear`` layers called with a
state, ``eqx.nn.make_with_state``, ``compute_loss`` returning ``(loss, state)`` and the
step with ``eqx.filter_grad(..., has_aux=True)``, ``optax`` and ``eqx.apply_updates``.
Changed: the BatchNorm's ``axis_name`` is the replica axis, as under ``jax.pmap`` with one
example per device (the notebook vmaps over its batch with that axis name), ``mode="batch"``
(``"ema"`` fails under pmap itself: JAX/equinox), sgd, two steps. The oracle is
``jax.pmap`` of the same step.

Before, the step failed under ``replicate`` with equinox's "Attempted to use old state":
the check for arguments changed in place read the state after ``state.set`` had retired
it (``runtime.validate.check_arguments_unchanged`` now leaves such arguments alone).
"""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from tests.clients._harness import REPLICAS, Port, Split, check_port


class Model(eqx.Module):
    norm1: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    norm2: eqx.nn.BatchNorm
    linear2: eqx.nn.Linear

    def __init__(self, key):
        key1, key2 = jr.split(key)
        self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch", mode="batch")
        self.linear1 = eqx.nn.Linear(3, 16, key=key1)
        self.norm2 = eqx.nn.BatchNorm(input_size=16, axis_name="batch", mode="batch")
        self.linear2 = eqx.nn.Linear(16, 3, key=key2)

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x = self.linear1(x)
        x, state = self.norm2(x, state)
        x = self.linear2(x)
        return x, state


optim = optax.sgd(0.1)  # (sgd: an N-fold error in the gradients would show)


def compute_loss(model, state, x, y):
    pred_y, state = model(x, state)
    loss = jnp.mean((pred_y - y) ** 2)
    return loss, state


def make_step(params, static, state, opt_state, x, y):
    model = eqx.combine(params, static)
    grads, state = eqx.filter_grad(compute_loss, has_aux=True)(model, state, x, y)
    grads = jax.lax.pmean(grads, "batch")
    updates, opt_state = optim.update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return (eqx.filter(model, eqx.is_array), state, opt_state), {}


@pytest.mark.parametrize("n", REPLICAS)
def test_equinox_stateful(n):
    model, state = eqx.nn.make_with_state(Model)(jr.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(n, 3)).astype(np.float32), rng.normal(size=(n, 3)).astype(np.float32))
            for _ in range(2)]

    def step(params, state, opt_state, x, y):
        # one example per replica, as the notebook's vmap gives BatchNorm one per index
        return make_step(params, static, state, opt_state, x[0], y[0])
    port = Port(step=step, state=(params, state, optim.init(params)),
                inputs=lambda i: ((Split(data[i][0]), Split(data[i][1])), {}),
                axis_name="batch", split_out=lambda out: out)
    check_port(port, n, oracle=False)
