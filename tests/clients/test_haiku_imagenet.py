"""Port of google-deepmind/dm-haiku examples/imagenet/train.py (the train step).

Kept from the source: ``TrainState(params, state, opt_state, loss_scale)``, the
``hk.transform_with_state`` ResNet ``_forward``, ``lr_schedule`` (warm-up then cosine),
``make_optimizer`` (``optax.trace(nesterov)`` + the schedule + ``scale(-1)``), ``l2_loss``
over the non-BatchNorm params, ``loss_fn`` (label-smoothed cross-entropy plus weight decay,
scaled by the jmp loss scale), and ``train_step``: unscale, ``lax.pmean(grads, 'i')``,
apply, and with ``mp_skip_nonfinite`` skip a step whose gradients are not finite and
adjust the dynamic loss scale; mixed precision through ``hk.mixed_precision.set_policy``
(ResNet in the compute dtype, BatchNorm in float32). Changed: a ResNet of one block per
group and 8/16 channels on 16x16 images, BatchNorm's statistics over the replicas
(``cross_replica_axis='i'``, so the state is mirrored), two steps. The oracle is
``jax.pmap`` of the same step (per-replica BatchNorm batches: no global-batch oracle).

With float16 params and a 2**15 dynamic loss scale every step's gradients are finite
under pmap. Here the loss seed of the weight decay (every replica adds it) was summed over
the replicas in float32, then cast to float16 on its way to the weights (inf), and
BatchNorm's synchronized statistics did the same: the first step was skipped and the loss
scale halved (``compiler.passes.cross_replica_sum._half_means`` takes the mean instead).
"""
from __future__ import annotations

from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

from tests.clients._harness import REPLICAS, Port, Split, check_port

NUM_CLASSES = 10
GLOBAL_BATCH = 16


class TrainState(NamedTuple):
    params: hk.Params
    state: hk.State
    opt_state: optax.OptState
    loss_scale: jmp.LossScale


def _forward(batch, is_training: bool) -> jax.Array:
    net = hk.nets.ResNet(blocks_per_group=(1, 1, 1, 1), num_classes=NUM_CLASSES,
                         resnet_v2=True, bottleneck=False, channels_per_group=(8, 8, 16, 16),
                         use_projection=(True,) * 4,
                         bn_config={"decay_rate": 0.9, "cross_replica_axis": "i"},
                         initial_conv_config={"output_channels": 8})
    return net(batch["images"], is_training=is_training)


forward = hk.transform_with_state(_forward)


def lr_schedule(step: jax.Array) -> jax.Array:
    """Cosine learning rate schedule (with linear warm-up, here one step long)."""
    total_batch_size = GLOBAL_BATCH
    steps_per_epoch = 1
    warmup_steps = 1 * steps_per_epoch
    training_steps = 90 * steps_per_epoch
    lr = 0.1 * total_batch_size / 256
    scaled_step = (jnp.maximum(step - warmup_steps, 0) / (training_steps - warmup_steps))
    lr *= 0.5 * (1.0 + jnp.cos(jnp.pi * scaled_step))
    lr *= jnp.minimum((step + 1) / warmup_steps, 1.0)
    return lr


def make_optimizer() -> optax.GradientTransformation:
    """SGD with nesterov momentum and a custom lr schedule."""
    return optax.chain(optax.trace(decay=0.9, nesterov=True),
                       optax.scale_by_schedule(lr_schedule), optax.scale(-1))


def l2_loss(params):
    return 0.5 * sum(jnp.sum(jnp.square(p)) for p in params)


def loss_fn(params, state, loss_scale, batch):
    """Computes a regularized loss for the given batch."""
    logits, state = forward.apply(params, state, None, batch, is_training=True)
    labels = jax.nn.one_hot(batch["labels"], NUM_CLASSES)
    labels = optax.smooth_labels(labels, 0.1)
    loss = optax.softmax_cross_entropy(logits=logits, labels=labels).mean()
    l2_params = [p for (mod_name, _, p) in hk.data_structures.traverse(params)
                 if "batchnorm" not in mod_name]
    loss = loss + 1e-4 * l2_loss(l2_params)
    return loss_scale.scale(loss), (loss, state)


def make_train_step(policy: jmp.Policy, skip_nonfinite: bool):
    def train_step(train_state: TrainState, batch):
        """Applies an update to parameters and returns new state."""
        params, state, opt_state, loss_scale = train_state
        grads, (loss, new_state) = jax.grad(loss_fn, has_aux=True)(params, state, loss_scale,
                                                                    batch)
        # Taking the mean across all replicas to keep params in sync.
        grads = policy.cast_to_compute(grads)
        grads = loss_scale.unscale(grads)
        grads = jax.lax.pmean(grads, axis_name="i")
        grads = policy.cast_to_param(grads)
        updates, new_opt_state = make_optimizer().update(grads, opt_state)
        new_params = optax.apply_updates(params, updates)
        scalars = {"train_loss": loss, "loss_scale": loss_scale.loss_scale}
        if skip_nonfinite:
            grads_finite = jmp.all_finite(grads)
            loss_scale = loss_scale.adjust(grads_finite)
            new_params, new_state, new_opt_state = jmp.select_tree(
                grads_finite, (new_params, new_state, new_opt_state),
                (params, state, opt_state))
            scalars["grads_finite"] = grads_finite
        new_state, scalars = jmp.cast_to_full((new_state, scalars))
        scalars = jax.lax.pmean(scalars, axis_name="i")
        return TrainState(new_params, new_state, new_opt_state, loss_scale), scalars
    return train_step


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_haiku_imagenet(n, precision):
    """``precision="float16"``: params and compute (the source's
    ``--mp_policy=p=f16,c=f16,o=f32``) under a 2**15 dynamic loss scale; pmap takes every
    step (finite gradients), and so must this (the metrics compare ``grads_finite`` and
    the loss scale)."""
    policy = jmp.get_policy("p=f32,c=f32,o=f32" if precision == "float32" else
                            "p=f16,c=f16,o=f32")
    hk.mixed_precision.set_policy(hk.BatchNorm, jmp.get_policy("p=f32,c=f32,o=f32")
                                  .with_output_dtype(policy.compute_dtype))
    hk.mixed_precision.set_policy(hk.nets.ResNet, policy)
    try:
        rng = np.random.default_rng(0)
        batches = [{"images": rng.normal(size=(GLOBAL_BATCH, 16, 16, 3)).astype(np.float32),
                    "labels": rng.integers(0, NUM_CLASSES, GLOBAL_BATCH).astype(np.int32)}
                   for _ in range(2)]
        one = {k: v[:GLOBAL_BATCH // n] for k, v in batches[0].items()}

        @jax.jit
        def init(key, batch):
            # BatchNorm's cross-replica axis needs a bound axis, as under the source's pmap
            def per_replica(key, batch):
                params, state = forward.init(key, batch, is_training=True)
                return TrainState(params, state, make_optimizer().init(params),
                                  jmp.DynamicLossScale(jnp.float32(2.0 ** 15)))
            return jax.vmap(per_replica, in_axes=(None, None), axis_size=1,
                            axis_name="i")(key, batch)
        state = jax.tree.map(lambda x: x[0], init(jax.random.PRNGKey(42), one))
        port = Port(step=make_train_step(policy, skip_nonfinite=True), state=(state,),
                    inputs=lambda i: ((Split(batches[i]),), {}), axis_name="i")
        # (float16: a mean taken as the sum of halves, not half of the sum; a few ulps)
        check_port(port, n, oracle=False,
                   pmap_tol=(2e-5, 1e-6) if precision == "float32" else (4e-3, 2e-5))
    finally:
        hk.mixed_precision.clear_policy(hk.BatchNorm)
        hk.mixed_precision.clear_policy(hk.nets.ResNet)
