"""Port of google-deepmind/dm-haiku examples/mnist.py.

Kept from the source: ``net_fn`` (LeNet-300-100 style ``hk.Sequential`` MLP on uint8
images scaled by 1/255), ``hk.without_apply_rng(hk.transform(net_fn))``, the ``Batch``
and ``TrainingState(params, avg_params, opt_state)`` NamedTuples, ``loss`` (cross-entropy
plus ``1e-4`` times the L2 regulariser of all params), ``optax.adam(1e-3)`` and ``update``
with the EMA ``optax.incremental_update(params, avg_params, step_size=0.001)``. The source
jits ``update``; its data-parallel form adds ``lax.pmean(grads, 'batch')``, as haiku's
imagenet example does. Sizes: 8x8 images, hidden layers 32 and 16.

No per-replica statistics: the global-batch jit is an oracle.
"""
from __future__ import annotations

from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.clients._harness import REPLICAS, Port, Split, check_port

NUM_CLASSES = 10
GLOBAL_BATCH = 16


class Batch(NamedTuple):
    image: np.ndarray  # [B, H, W, 1]
    label: np.ndarray  # [B]


class TrainingState(NamedTuple):
    params: hk.Params
    avg_params: hk.Params
    opt_state: optax.OptState


def net_fn(images: jax.Array) -> jax.Array:
    """Standard LeNet-300-100 MLP network (here 32-16)."""
    x = images.astype(jnp.float32) / 255.
    mlp = hk.Sequential([
        hk.Flatten(),
        hk.Linear(32), jax.nn.relu,
        hk.Linear(16), jax.nn.relu,
        hk.Linear(NUM_CLASSES),
    ])
    return mlp(x)


network = hk.without_apply_rng(hk.transform(net_fn))
optimiser = optax.adam(1e-3)


def loss(params: hk.Params, batch: Batch) -> jax.Array:
    """Cross-entropy classification loss, regularised by L2 weight decay."""
    batch_size, *_ = batch.image.shape
    logits = network.apply(params, batch.image)
    labels = jax.nn.one_hot(batch.label, NUM_CLASSES)
    l2_regulariser = 0.5 * sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))
    log_likelihood = jnp.sum(labels * jax.nn.log_softmax(logits))
    return -log_likelihood / batch_size + 1e-4 * l2_regulariser


def update(state: TrainingState, batch: Batch) -> TrainingState:
    """Learning rule (stochastic gradient descent), data parallel over 'batch'."""
    grads = jax.grad(loss)(state.params, batch)
    grads = jax.lax.pmean(grads, axis_name="batch")
    updates, opt_state = optimiser.update(grads, state.opt_state)
    params = optax.apply_updates(state.params, updates)
    # Compute avg_params, the exponential moving average of the "live" params.
    avg_params = optax.incremental_update(params, state.avg_params, step_size=0.001)
    return TrainingState(params, avg_params, opt_state)


def load_dataset(seed=0, steps=2):
    """Synthetic MNIST-shaped batches (uint8 images, int32 labels)."""
    rng = np.random.default_rng(seed)
    return [Batch(image=rng.integers(0, 256, (GLOBAL_BATCH, 8, 8, 1)).astype(np.uint8),
                  label=rng.integers(0, NUM_CLASSES, GLOBAL_BATCH).astype(np.int32))
            for _ in range(steps)]


@pytest.mark.parametrize("n", REPLICAS)
def test_haiku_mnist(n):
    train_dataset = load_dataset()

    @jax.jit  # eager init compiles every op once (seconds); same values
    def init(rng, image):
        initial_params = network.init(rng, image)
        initial_opt_state = optimiser.init(initial_params)
        return TrainingState(initial_params, initial_params, initial_opt_state)

    state = init(jax.random.PRNGKey(seed=0), train_dataset[0].image)
    port = Port(step=update, state=(state,),
                inputs=lambda i: ((Split(train_dataset[i]),), {}),
                split_out=lambda out: ((out,), {}))
    check_port(port, n, oracle=True)


# -- float16 with a dynamic loss scale: the recipe of haiku's imagenet example ------------

def mixed_precision_update(state: TrainingState, loss_scale, batch: Batch):
    """``update`` in float16 (params and compute; the imagenet example's
    ``--mp_policy=p=f16,c=f16,o=f32``) under a ``jmp.DynamicLossScale``: the loss scaled,
    the gradients unscaled before ``pmean``, a step with non-finite gradients skipped and
    the loss scale adjusted (``--mp_skip_nonfinite``)."""
    import jmp
    policy = jmp.get_policy("p=f16,c=f16,o=f32")

    def scaled_loss(params):
        half = policy.cast_to_compute(batch._replace(image=batch.image.astype(jnp.float32) / 255.))
        logits = network_f16.apply(params, half.image)
        labels = jax.nn.one_hot(batch.label, NUM_CLASSES)
        l2_regulariser = 0.5 * sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))
        log_likelihood = jnp.sum(labels * jax.nn.log_softmax(logits))
        return loss_scale.scale(-log_likelihood / batch.image.shape[0] + 1e-4 * l2_regulariser)
    grads = loss_scale.unscale(jax.grad(scaled_loss)(state.params))
    grads = jax.lax.pmean(grads, axis_name="batch")
    grads_finite = jmp.all_finite(grads)
    updates, opt_state = optax.sgd(1e-2).update(grads, state.opt_state)
    params = optax.apply_updates(state.params, updates)
    new = TrainingState(params, optax.incremental_update(params, state.avg_params, 0.001),
                        opt_state)
    new = jmp.select_tree(grads_finite, new, state)
    return (new, loss_scale.adjust(grads_finite)), {"grads_finite": grads_finite,
                                                    "loss_scale": loss_scale.loss_scale}


network_f16 = hk.without_apply_rng(hk.transform(
    lambda images: hk.Sequential([hk.Flatten(), hk.Linear(32), jax.nn.relu, hk.Linear(16),
                                  jax.nn.relu, hk.Linear(NUM_CLASSES)])(images)))


@pytest.mark.parametrize("n", REPLICAS)
def test_haiku_mnist_float16_dynamic_loss_scale(n):
    """Every step's gradients are finite under pmap, so no step is skipped and the loss
    scale stays 2**15. Before, the loss seed of the L2 regulariser (every replica adds it)
    was summed over the replicas in float16 before it met the weights (8 x 32768: inf):
    each step was skipped and the loss scale halved, silently."""
    import jmp
    train_dataset = load_dataset()
    params = jax.tree.map(lambda p: p.astype(jnp.float16),
                          network_f16.init(jax.random.PRNGKey(0),
                                           train_dataset[0].image.astype(jnp.float16)))
    state = TrainingState(params, params, optax.sgd(1e-2).init(params))
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0 ** 15))
    port = Port(step=mixed_precision_update, state=(state, loss_scale),
                inputs=lambda i: ((Split(train_dataset[i]),), {}),
                split_out=lambda out: (out[0], out[1]))
    check_port(port, n, oracle=False, pmap_tol=(4e-3, 2e-5))  # (float16: a few ulps)
    from tests.clients._harness import train
    _, metrics = train(port, "replicate", n)
    assert all(np.all(m["grads_finite"]) and np.all(m["loss_scale"] == 2.0 ** 15)
               for m in metrics), metrics
