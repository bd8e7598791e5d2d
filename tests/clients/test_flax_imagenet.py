"""Port of google/flax examples/imagenet/train.py and examples/imagenet/models.py.

Kept from the source: ``ResNet`` (V1.5) built from ``ResNetBlock`` with
``nn.BatchNorm(momentum=0.9, epsilon=1e-5, axis_name='batch')`` (batch statistics
synchronized across replicas), ``scale_init=zeros`` on each block's last norm and the
``conv_proj``/``norm_proj`` shortcut; ``cross_entropy_loss``, ``compute_metrics`` (pmean'd
over 'batch'); ``train_step`` with the L2 weight penalty (weight decay 1e-4 on params of
ndim > 1), ``lax.pmean(grads, 'batch')``, ``apply_gradients`` with
``batch_stats=lax.pmean(new_model_state['batch_stats'], 'batch')``; the warmup + cosine
``create_learning_rate_fn`` and ``optax.sgd(momentum=0.9, nesterov=True)``; the
``TrainState`` with ``batch_stats`` (``dynamic_scale`` None: float32). ``train_step`` is
pmapped as in the source (``axis_name='batch'``; ``donate_argnums`` dropped, since the
test reuses the initial state). Sizes: a ``_ResNet1``-like net (one stage of two blocks,
the second with a stride-2 projection), 8 filters, 16x16 images, 10 classes.

BatchNorm statistics are per replica, so there is no global-batch oracle here: replicate
must equal pmap exactly.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import common_utils, train_state
from jax import lax

from tests.clients._harness import REPLICAS, Port, Split, check_port

NUM_CLASSES = 10
IMAGE = 16
GLOBAL_BATCH = 16
ModuleDef = Any


class ResNetBlock(nn.Module):
    """ResNet block."""
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    """ResNetV1.5."""
    stage_sizes: Sequence[int]
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu
    conv: ModuleDef = nn.Conv

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = partial(self.conv, use_bias=False, dtype=self.dtype)
        norm = partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                       epsilon=1e-5, dtype=self.dtype, axis_name="batch")
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)],
                 name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                # the source strides the first block of every stage after the first; with
                # one stage the tiny net strides its second block, so the projection
                # shortcut (conv_proj, norm_proj) is exercised too
                strides = (2, 2) if (i > 0 and j == 0) or (i, j) == (0, 1) else (1, 1)
                x = self.block_cls(self.num_filters * 2**i, strides=strides, conv=conv,
                                   norm=norm, act=self.act)(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        x = jnp.asarray(x, self.dtype)
        return x


_ResNetTiny = partial(ResNet, stage_sizes=[2], block_cls=ResNetBlock, num_filters=8)


def initialized(key, image_size, model):
    input_shape = (1, image_size, image_size, 3)

    @jax.jit
    def init(*args):
        return model.init(*args)

    # one example at init: BatchNorm sees axis 'batch' only inside the pmapped step
    variables = init({"params": key}, jnp.ones(input_shape, model.dtype))
    return variables["params"], variables["batch_stats"]


def cross_entropy_loss(logits, labels):
    one_hot_labels = common_utils.onehot(labels, num_classes=NUM_CLASSES)
    xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
    return jnp.mean(xentropy)


def compute_metrics(logits, labels):
    loss = cross_entropy_loss(logits, labels)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    metrics = {"loss": loss, "accuracy": accuracy}
    metrics = lax.pmean(metrics, axis_name="batch")
    return metrics


def create_learning_rate_fn(config, base_learning_rate, steps_per_epoch):
    """Create learning rate schedule."""
    warmup_fn = optax.linear_schedule(
        init_value=0.0, end_value=base_learning_rate,
        transition_steps=config.warmup_epochs * steps_per_epoch)
    cosine_epochs = max(config.num_epochs - config.warmup_epochs, 1)
    cosine_fn = optax.cosine_decay_schedule(
        init_value=base_learning_rate, decay_steps=cosine_epochs * steps_per_epoch)
    return optax.join_schedules(schedules=[warmup_fn, cosine_fn],
                                boundaries=[config.warmup_epochs * steps_per_epoch])


def train_step(state, batch, learning_rate_fn):
    """Perform a single training step."""

    def loss_fn(params):
        """loss function used for training."""
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"], mutable=["batch_stats"])
        loss = cross_entropy_loss(logits, batch["label"])
        weight_penalty_params = jax.tree_util.tree_leaves(params)
        weight_decay = 0.0001
        weight_l2 = sum(jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1)
        weight_penalty = weight_decay * 0.5 * weight_l2
        loss = loss + weight_penalty
        return loss, (new_model_state, logits)

    step = state.step
    lr = learning_rate_fn(step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    aux, grads = grad_fn(state.params)
    # Re-use same axis_name as in the call to `pmap(...train_step...)`.
    grads = lax.pmean(grads, axis_name="batch")
    new_model_state, logits = aux[1]
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = lr
    new_state = state.apply_gradients(
        grads=grads, batch_stats=lax.pmean(new_model_state["batch_stats"], "batch"))
    return new_state, metrics


class TrainState(train_state.TrainState):
    batch_stats: Any


def create_train_state(rng, config, model, image_size, learning_rate_fn):
    """Create initial training state."""
    params, batch_stats = initialized(rng, image_size, model)
    tx = optax.sgd(learning_rate=learning_rate_fn, momentum=config.momentum, nesterov=True)
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx,
                             batch_stats=batch_stats)


def default_config():
    """The source's configs/default.py fields this port reads (an ml_collections
    ConfigDict there)."""
    return SimpleNamespace(learning_rate=0.1, warmup_epochs=1.0, momentum=0.9,
                           num_epochs=3.0)


def get_batches(seed=0, steps=2):
    rng = np.random.default_rng(seed)
    return [{"image": rng.normal(size=(GLOBAL_BATCH, IMAGE, IMAGE, 3)).astype(np.float32),
             "label": rng.integers(0, NUM_CLASSES, GLOBAL_BATCH).astype(np.int32)}
            for _ in range(steps)]


@pytest.mark.parametrize("n", REPLICAS)
def test_imagenet_resnet(n):
    config = default_config()
    steps_per_epoch = 2
    # base_learning_rate = config.learning_rate * config.batch_size / 256 in the source
    learning_rate_fn = create_learning_rate_fn(config, config.learning_rate, steps_per_epoch)
    model = _ResNetTiny(num_classes=NUM_CLASSES, dtype=jnp.float32)
    # jitted: eager init compiles every op once (seconds); same values
    state = jax.jit(partial(create_train_state, config=config, model=model, image_size=IMAGE,
                            learning_rate_fn=learning_rate_fn))(jax.random.key(0))
    # warm up past step 0 (learning rate 0) so both steps move the parameters
    state = state.replace(step=1)
    batches = get_batches()
    step = partial(train_step, learning_rate_fn=learning_rate_fn)
    port = Port(step=step, state=(state,), inputs=lambda i: ((Split(batches[i]),), {}))
    check_port(port, n, oracle=False)
