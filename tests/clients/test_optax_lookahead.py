"""Port of google-deepmind/optax examples/lookahead_mnist.ipynb (commit 2edbcbe2390d, HEAD
of 2026-08-07; the notebook last changed in 7afa8808 "Migrate from flax.linen to flax.nnx
in Lookahead Optimizer in MNIST example").

Kept from the source: the ``CNN`` ``nnx.Module`` (conv1 -> relu -> avg_pool, conv2 ->
relu -> avg_pool, dense1 -> relu, dense2), the jitted ``predict`` (``nnx.update(model,
params)`` inside the jit, then the call) and ``loss_accuracy`` (softmax cross-entropy with
integer labels, accuracy), ``fast_solver = optax.adam(FAST_LEARNING_RATE)``, ``solver =
optax.lookahead(fast_solver, SYNC_PERIOD, SLOW_LEARNING_RATE)`` with the notebook's
values, ``params = optax.LookaheadParams.init_synced(nnx.state(net, nnx.Param))``, the
jitted ``train_step(params, model, solver_state, batch)`` (``value_and_grad`` of
``loss_accuracy`` at ``params.fast``, ``solver.update(grad, solver_state, params)``,
``apply_updates`` to the fast/slow pair) and ``dataset_stats`` evaluating ``params.slow``.
Sizes: 8x8 images, 4 and 8 conv features, Linear 16 (the notebook: 28x28, 32, 64, 256);
synthetic data of MNIST's layout (NHWC floats in [0, 1], integer labels), batches as the
notebook's ``(image, label)`` tuples. ``STEPS = SYNC_PERIOD + 1`` steps: four fast steps,
the synchronization (the slow weights move, the fast ones are reset to them), one more.

The notebook's step is single-device (``jax.jit``). Written for one replica it goes to
``rt.replicate`` unchanged: the loss is the replica's own batch mean, the gradient at the
mirrored ``params.fast`` is all-reduced (mean), and the model, passed as an argument whose
parameters ``predict`` overwrites, is mirrored. Its oracle is the same jitted step on the
global batch on one device. The pmap-style form ``pmean``s the gradient and the metrics.

Adam is invariant to the scale of the gradients (its update is m / sqrt(v)), so a gradient
all-reduce applied N times or not at all would hide behind it; the ``sgd`` cases use
``optax.lookahead(optax.sgd(...))``, whose fast and slow steps are linear in the gradient,
and ``test_lookahead_sgd_catches_a_wrong_gradient_reduction`` shows that
``loss_reduction="sum"`` (N times the mean) lands far from the oracle. One more case runs
lookahead's ``reset_state=True`` (momentum SGD's trace reset at the synchronization).
"""
from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import runtime as rt
from tests.clients._harness import (REPLICAS, Port, Split, assert_mirrored, check_against_global,
                                    check_port, mnist_batches, train)

pytestmark = pytest.mark.filterwarnings("error::runtime.DivergingStateWarning")

# The learning rate for the fast optimizer:
FAST_LEARNING_RATE = 0.002
# The learning rate for the slow optimizer:
SLOW_LEARNING_RATE = 0.1
# Number of fast optimizer steps to take before synchronizing parameters:
SYNC_PERIOD = 5
# Number of samples in each batch (the notebook: 256):
BATCH_SIZE = 16
STEPS = SYNC_PERIOD + 1

IMAGE = 8
IMG_SIZE = (IMAGE, IMAGE, 1)
NUM_CLASSES = 10
SGD_LEARNING_RATE = 0.1


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, in_features, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(in_features=in_features,
                          out_features=4,
                          kernel_size=(3, 3),
                          rngs=rngs)
    self.pool1 = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.conv2 = nnx.Conv(in_features=4,
                          out_features=8,
                          kernel_size=(3, 3),
                          rngs=rngs)
    self.pool2 = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.dense1 = nnx.Linear(in_features=(IMAGE // 4)**2*8, out_features=16, rngs=rngs)
    self.dense2 = nnx.Linear(in_features=16, out_features=NUM_CLASSES, rngs=rngs)

  def __call__(self, x):
    x = self.conv1(x)
    x = nnx.relu(x)
    x = self.pool1(x)
    x = self.conv2(x)
    x = nnx.relu(x)
    x = self.pool2(x)
    x = x.reshape((x.shape[0], -1))  # flatten
    x = self.dense1(x)
    x = nnx.relu(x)
    x = self.dense2(x)
    return x


@jax.jit
def predict(params, model, inputs):
  nnx.update(model, params)
  return model(inputs)


@jax.jit
def loss_accuracy(params, model, data):
  """Computes loss and accuracy over a mini-batch.

  Args:
    params: parameters of the model.
    model: Instance of the nnx.Module.
    data: tuple of (inputs, labels).

  Returns:
    loss: float
    accuracy: float
  """
  inputs, labels = data
  logits = predict(params, model, inputs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=labels
  ).mean()
  accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
  return loss, {"accuracy": accuracy}


SOLVERS = {
    # the notebook's
    "adam": lambda: optax.lookahead(optax.adam(FAST_LEARNING_RATE), SYNC_PERIOD,
                                    SLOW_LEARNING_RATE),
    # an inner optimizer whose step is proportional to the gradient (module docstring)
    "sgd": lambda: optax.lookahead(optax.sgd(SGD_LEARNING_RATE), SYNC_PERIOD,
                                   SLOW_LEARNING_RATE),
    # lookahead's other option: the fast state (momentum) reset at each synchronization
    "sgd_momentum_reset": lambda: optax.lookahead(
        optax.sgd(SGD_LEARNING_RATE, momentum=0.9), SYNC_PERIOD, SLOW_LEARNING_RATE,
        reset_state=True),
}


def make_train_step(solver, pmean=False):
  """The notebook's ``train_step`` for ``solver``; ``pmean``: the pmap-style form, the
  gradient and the metrics averaged over 'batch'."""
  @jax.jit
  def train_step(params, model, solver_state, batch):
    # Performs a one step update.
    (loss, aux), grad = jax.value_and_grad(loss_accuracy, has_aux=True)(
        params.fast, model, batch
    )
    if pmean:
      grad = jax.lax.pmean(grad, "batch")
      loss, aux = jax.lax.pmean((loss, aux), "batch")
    updates, solver_state = solver.update(grad, solver_state, params)
    params = optax.apply_updates(params, updates)
    return params, solver_state, loss, aux
  return train_step


@functools.lru_cache(maxsize=None)
def setup(solver_name):
  """The notebook's initialisation: the net, synced lookahead params, solver state."""
  solver = SOLVERS[solver_name]()
  # jitted: eager init compiles every op once (seconds); same values
  net = nnx.jit(lambda: CNN(IMG_SIZE[-1], nnx.Rngs(0)))()
  dummy_data = jnp.ones((1,) + IMG_SIZE, dtype=jnp.float32)
  _ = net(dummy_data)
  params = nnx.state(net, nnx.Param)

  # Initializes the lookahead optimizer with the initial model parameters.
  params = optax.LookaheadParams.init_synced(params)
  solver_state = jax.jit(solver.init)(params)
  return solver, net, params, solver_state


def batches(steps, seed=0):
  return [(b["image"], b["label"]) for b in mnist_batches(BATCH_SIZE, IMAGE, seed, steps)]


def port(solver_name, pmean=False):
  solver, net, params, solver_state = setup(solver_name)
  train_step = make_train_step(solver, pmean)
  data = batches(STEPS)
  # the carried state first (the harness's convention); the model is a mirrored argument
  step = lambda params, solver_state, model, batch: train_step(params, model, solver_state,
                                                              batch)
  return Port(step=step, state=(params, solver_state),
              inputs=lambda i: ((net, Split(data[i])), {}),
              split_out=lambda out: ((out[0], out[1]), {"loss": out[2], **out[3]}))


def _assert_synced_step(params_before, params_after, solver_state):
  """The synchronization happened: ``steps_since_sync`` wrapped, and the slow weights
  moved while staying between the old slow weights and the new fast ones."""
  assert int(np.asarray(solver_state.steps_since_sync).reshape(-1)[0]) == STEPS % SYNC_PERIOD
  moved = [np.max(np.abs(a[0] - np.asarray(b))) for a, b in
           zip(jax.tree.leaves(params_after.slow), jax.tree.leaves(params_before.slow))]
  assert max(moved) > 1e-6, moved


@pytest.mark.parametrize("n,solver_name", [(n, s) for n in REPLICAS for s in ("adam", "sgd")]
                         + [(8, "sgd_momentum_reset")])
def test_lookahead_written_for_one_replica_equals_the_global_batch(n, solver_name):
    """The notebook's ``train_step`` unchanged: replicate's state (fast and slow weights,
    adam's moments, the sync counter) after a synchronization equals the global-batch
    jit's, and each step's loss and accuracy averaged over the replicas are the global
    batch's."""
    p = port(solver_name)
    g_state = check_against_global(p, n, STEPS, what=f"lookahead({solver_name})")
    _assert_synced_step(p.state[0], g_state[0], g_state[1])


@pytest.mark.parametrize("solver_name", ["adam", "sgd"])
@pytest.mark.parametrize("n", REPLICAS)
def test_lookahead_pmap_style(n, solver_name):
    """``pmean`` of the gradient and the metrics: replicate equals pmap and the
    global-batch jit (metrics included)."""
    check_port(port(solver_name, pmean=True), n, oracle=True, steps=STEPS,
               oracle_metrics=lambda m: m)


def test_lookahead_sgd_catches_a_wrong_gradient_reduction():
    """With the SGD inner optimizer ``loss_reduction="sum"`` (each gradient N times the
    mean: the reduction applied as a sum) ends far from the global-batch jit, which the
    mean agrees with (the test above): the oracle can tell a wrong gradient scale."""
    n = 8
    p = port("sgd")
    g_state, _ = train(p, "global", 1, STEPS)
    fn = rt.replicate(p.step, num_replicas=n, loss_reduction="sum")
    state = p.state
    for i in range(STEPS):
        (model, batch), _ = p.inputs(i)
        out = fn(*state, model, rt.distribute(batch.tree, n))
        state = (out[0], out[1])
    assert_mirrored(state, "sum reduction")
    worst = max(float(np.max(np.abs(np.asarray(a) - b[0]))) for a, b in
                zip(jax.tree.leaves(state[0]), jax.tree.leaves(g_state[0])))
    assert worst > 1e-2, f"sum reduction not told apart from mean: {worst}"


def test_dataset_stats_on_the_slow_weights():
    """``dataset_stats(params.slow, net, loader)`` with ``loss_accuracy`` run by
    replicate on 8 replicas per test batch: the per-replica loss and accuracy averaged
    over the replicas (equal slices) are the global batch's, batch by batch and over the
    loader."""
    n = 8
    _, net, params, _ = setup("adam")
    # the slow weights after training would do as well; these differ from the fast ones
    slow = jax.tree.map(lambda x: x * 1.5, params.slow)
    loader = batches(3, seed=7)
    r_loss_acc = rt.replicate(loss_accuracy, num_replicas=n)
    all_r, all_g = [], []
    for batch in loader:
        loss, aux = r_loss_acc(slow, net, rt.distribute(batch, n))
        assert isinstance(loss, rt.PerReplica)
        all_r.append((rt.reduce("mean", loss), rt.reduce("mean", aux["accuracy"])))
        g_loss, g_aux = loss_accuracy(slow, net, batch)
        all_g.append((g_loss, g_aux["accuracy"]))
    np.testing.assert_allclose(np.asarray(all_r), np.asarray(all_g), rtol=2e-5, atol=1e-6)
