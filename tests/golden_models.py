"""Step functions for golden tests. Printed source locations are ``golden_models.py:LINE``:
append new functions at the end so existing line numbers never move."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sgd_step(w, x, y):
    """One mirrored weight, a per-replica batch: value_and_grad of a squared loss, SGD."""
    def loss(w):
        pred = jnp.tanh(x @ w)
        return jnp.mean((pred - y) ** 2)
    l, g = jax.value_and_grad(loss)(w)
    return l, w - 0.1 * g


def stochastic_depth_step(w, u, x, y):
    """A residual block kept or skipped per replica (the predicate reads the replica's
    data): the gradient all-reduces of ``u`` sit in the transposed branch."""
    def loss(w, u):
        h = x @ w
        h = jax.lax.cond(x[0, 0] > 0, lambda h: h + jnp.tanh(h @ u), lambda h: h, h)
        return jnp.mean((h - y) ** 2)
    return jax.grad(loss, argnums=(0, 1))(w, u)


def divergent_user_all_reduce_step(w, x):
    """A user's all-reduce inside a branch taken per replica: refused, never run."""
    h = x @ w
    h = jax.lax.cond(x[0, 0] > 0, lambda h: jax.lax.psum(h, "replica"), lambda h: h, h)
    return jnp.sum(h)


def rnn_step(w, xs):
    """An RNN over the replica's sequences: the transposed scan accumulates the gradient
    of the mirrored ``w`` in a carry that starts at zero, with an all-reduce in every step
    until hoist-collectives takes it out of the loop."""
    def loss(w):
        def body(h, x):
            h = jnp.tanh(h @ w + x)
            return h, jnp.sum(h)
        h, ys = jax.lax.scan(body, jnp.zeros((2, 3)), xs)
        return jnp.sum(h) + jnp.sum(ys)
    return jax.grad(loss)(w)
