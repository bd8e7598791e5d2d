"""The model both training benchmarks use: a flax MLP, optax SGD with momentum, and the
same step written two ways: per replica for ``rt.replicate`` and global for ``jax.jit``."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

IN, HIDDEN, OUT = 256, 512, 10
#: 8 on the 8 virtual CPU devices; on an accelerator, one replica per device (at most 8)
N_REPLICAS = min(8, len(jax.devices()))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(HIDDEN)(x))
        x = nn.relu(nn.Dense(HIDDEN)(x))
        return nn.Dense(OUT)(x)


def make_step(model: nn.Module, tx: optax.GradientTransformation, pmean_axis: str | None = None):
    """A fresh step function object each call (so no JAX cache can hit across calls).

    The same Python function serves both paths: under ``rt.replicate`` it sees one
    replica's batch and the passes all-reduce (mean) the gradients; under ``jax.jit`` it
    sees the global batch and GSPMD inserts the reductions. With ``pmean_axis``, it is the
    step written by hand per replica (for ``jax.shard_map``): the gradients and the loss
    averaged over that axis."""
    def train_step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            logits = model.apply(p, batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        if pmean_axis is not None:
            grads, loss = jax.lax.pmean((grads, loss), pmean_axis)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return train_step


def setup(global_batch: int, seed: int = 0):
    model = MLP()
    tx = optax.sgd(0.05, momentum=0.9)
    params = model.init(jax.random.key(seed), jnp.zeros((1, IN), jnp.float32))
    state = (params, tx.init(params))
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((IN, OUT)).astype(np.float32)

    def batch(i: int):
        r = np.random.default_rng(seed + 1 + i)
        x = r.standard_normal((global_batch, IN)).astype(np.float32)
        return {"x": x, "y": np.argmax(x @ teacher, axis=1).astype(np.int32)}
    return model, tx, state, batch
