"""Port of google-deepmind/optax examples/adversarial_training.ipynb.

Kept from the source: the ``CNN`` (conv 32 -> relu -> avg_pool -> conv 64 -> relu ->
avg_pool -> dense 256 -> relu -> dense), ``loss_fun`` (``@jax.jit``; mean
``softmax_cross_entropy_with_integer_labels`` plus ``0.5 * l2reg * tree_norm(params,
squared=True)``), ``pgd_attack`` (``@jax.jit``; ten steps of the sign of the gradient
with respect to the image perturbation, projected onto the L-infinity ball and the
pixel range) and ``train_step`` (the attack, then ``jax.grad(loss_fun)`` on the
adversarial images and ``optax.adam``). Sizes: 8x8 images, 10 classes, batch 16;
``EPSILON`` and ``L2_REG`` as in the notebook.

Under ``replicate`` the attack's gradient is taken with respect to each replica's own
images (per-replica values: the replica's own ``dL_r/dx``, README "What the numbers
mean"), which differs from the global-batch gradient by the positive factor N; the
attack only reads its sign, so the adversarial images, and then the training step with
its L2 term on the mirrored parameters, equal the global-batch jit's. That makes
``jax.jit`` on one device an oracle, and pmap (with the gradients ``pmean``-ed, its
form of the step) another.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from optax.losses import softmax_cross_entropy_with_integer_labels
from optax.tree_utils import tree_norm

from tests.clients._harness import REPLICAS, Port, Split, check_port, mnist_batches

LEARNING_RATE = 0.001
L2_REG = 0.0001
EPSILON = 0.01
IMAGE = 8
GLOBAL_BATCH = 16


class CNN(nn.Module):
  """A simple CNN model."""
  num_classes: int

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(features=32, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.Conv(features=64, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))  # flatten
    x = nn.Dense(features=256)(x)
    x = nn.relu(x)
    x = nn.Dense(features=self.num_classes)(x)
    return x


net = CNN(10)
optimizer = optax.adam(LEARNING_RATE)


@jax.jit
def loss_fun(params, l2reg, data):
  """Compute the loss of the network."""
  inputs, labels = data
  x = inputs.astype(jnp.float32)
  logits = net.apply({"params": params}, x)
  sqnorm = tree_norm(params, squared=True)
  loss_value = jnp.mean(softmax_cross_entropy_with_integer_labels(logits, labels))
  return loss_value + 0.5 * l2reg * sqnorm


@jax.jit
def pgd_attack(image, label, params, epsilon=0.1, maxiter=10):
  """PGD attack on the L-infinity ball with radius epsilon (Madry et al. 2017)."""
  image_perturbation = jnp.zeros_like(image)
  def adversarial_loss(perturbation):
    return loss_fun(params, 0, (image + perturbation, label))

  grad_adversarial = jax.grad(adversarial_loss)
  for _ in range(maxiter):
    # compute gradient of the loss wrt to the image
    sign_grad = jnp.sign(grad_adversarial(image_perturbation))

    # heuristic step-size 2 eps / maxiter
    image_perturbation += (2 * epsilon / maxiter) * sign_grad
    # projection step onto the L-infinity ball centered at image
    image_perturbation = jnp.clip(image_perturbation, - epsilon, epsilon)

  # clip the image to ensure pixels are between 0 and 1
  return jnp.clip(image + image_perturbation, 0, 1)


def train_step(params, opt_state, batch):
  images, labels = batch
  # convert images to float as attack requires to take gradients wrt to them
  images = images.astype(jnp.float32) / 255
  adversarial_images_train = pgd_attack(images, labels, params, epsilon=EPSILON)
  # train on adversarial images
  loss_grad_fun = jax.grad(loss_fun)
  grads = loss_grad_fun(params, L2_REG, (adversarial_images_train, labels))
  grads = jax.lax.pmean(grads, "batch")  # pmap's form (replicate: already averaged)
  updates, opt_state = optimizer.update(grads, opt_state)
  params = optax.apply_updates(params, updates)
  return params, opt_state, adversarial_images_train


@pytest.mark.parametrize("n", REPLICAS)
def test_adversarial_training(n):
    params = jax.jit(net.init)(jax.random.PRNGKey(0), jnp.zeros((1, IMAGE, IMAGE, 1)))["params"]
    batches = [(np.round(b["image"] * 255).astype(np.uint8), b["label"])
               for b in mnist_batches(GLOBAL_BATCH, IMAGE)]
    port = Port(step=train_step, state=(params, optimizer.init(params)),
                inputs=lambda i: ((Split(batches[i]),), {}),
                split_out=lambda out: ((out[0], out[1]), out[2]))
    # the adversarial images (the metrics here) are the global batch's too
    check_port(port, n, oracle=True, oracle_metrics=global_batch)


def global_batch(images):
    """Per-replica images ``[n, B/n, ...]`` (one replica's slice each; ``[1, B, ...]``
    for the global jit) as the global batch, once per replica: ``[n, B, ...]``."""
    whole = images.reshape((1, -1) + images.shape[2:])
    return np.broadcast_to(whole, (images.shape[0],) + whole.shape[1:])
