"""Port of google-deepmind/optax examples/meta_learning.ipynb (meta-learning RMSProp's
learning rate).

Kept from the source: ``f(theta, x) = x * theta``, the ``optax.l2_loss`` loss, the inner
optimizer ``optax.inject_hyperparams(optax.rmsprop)(learning_rate=0.1)`` and the meta
optimizer ``optax.adam(0.03)``, ``step`` (``jax.grad`` of the loss, ``opt.update``,
``apply_updates``), ``outer_loss`` (the learning rate set to ``sigmoid(eta)`` in the
inner state's ``hyperparams``, the inner steps over all samples but the last, the loss of
the last) and the jitted ``outer_step`` (``jax.grad(outer_loss, has_aux=True)`` in
``eta``, the meta update), with ``N = 7`` samples per outer step, ``eta`` initialised to
the inverse sigmoid of the inner learning rate, and the notebook's generator
(``x ~ U(0, 10)``, ``y = 10 x + noise``).

What this checks is a gradient of a gradient of mirrored values: ``outer_loss``
differentiates through six inner steps, each of which takes ``jax.grad`` of the loss in
the mirrored ``theta`` and moves ``theta`` by RMSProp's update. Under ``replicate`` each
inner gradient is all-reduced (the mean over the replicas' samples), so the outer
gradient flows back through those all-reduces and through the loss scalings at both ends
of every inner pullback; a scaling applied once too often or too rarely anywhere on that
path changes the meta-gradient, and a ``sigmoid`` and RMSProp's square root then make it
no multiple of the right one.

Data parallel: each of the ``N`` samples is a global batch of ``GLOBAL_BATCH`` draws of
the generator (the notebook draws one), split over the replicas; ``loss`` is the mean of
``optax.l2_loss`` over a replica's draws (the notebook's loss of one draw, averaged), so
the global-batch step on one device is the oracle. Two forms of the step:

* pmap style: the inner gradient and the meta-gradient ``pmean``-ed over ``'batch'``;
  pmap and the global-batch jit are oracles;
* written for one replica (the notebook's code unchanged): ``replicate`` all-reduces both
  gradients itself; the global-batch jit is the oracle.
"""
from __future__ import annotations

from typing import Iterator, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.clients._harness import REPLICAS, Port, Split, check_against_global, check_port

GLOBAL_BATCH = 16
N = 7  # samples per outer step, as in the notebook
OUTER_STEPS = 3


def generator(seed: int = 0) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """The notebook's generator, a global batch of draws at a time (NumPy: eager JAX
    random ops would compile per shape in the test process)."""
    rng = np.random.default_rng(seed)
    while True:
        x = rng.uniform(0.0, 10.0, GLOBAL_BATCH).astype(np.float32)
        y = (10.0 * x + rng.normal(size=GLOBAL_BATCH)).astype(np.float32)
        yield x, y


def f(theta: jax.typing.ArrayLike, x: jax.typing.ArrayLike) -> jax.typing.ArrayLike:
    return x * theta


init_learning_rate = jnp.array(0.1)
meta_learning_rate = jnp.array(0.03)

opt = optax.inject_hyperparams(optax.rmsprop)(learning_rate=init_learning_rate)
meta_opt = optax.adam(learning_rate=meta_learning_rate)

#: the notebook's optimizers, and plain SGD in both places. RMSProp and Adam divide each
#: gradient by its own running scale, so they move the same whatever a gradient's scale:
#: a gradient N times too large (the reduction applied wrongly) changes nothing they do.
#: SGD's step is proportional to the gradient, so the ``sgd`` case fails on such an error
#: (checked: under ``loss_reduction="sum"`` its final ``eta`` and ``theta`` are far from the
#: global batch's, while the notebook's optimizers give the same numbers either way).
OPTIMIZERS = {
    "rmsprop+adam": (opt, meta_opt),
    # (x ~ U(0, 10): SGD on theta is stable for a learning rate below 2 / E[x^2] = 0.06)
    "sgd": (optax.inject_hyperparams(optax.sgd)(learning_rate=jnp.array(0.01)),
            optax.sgd(learning_rate=0.01)),
}


def loss(theta, x, y):
    return jnp.mean(optax.l2_loss(y, f(theta, x)))  # (the mean over the draws)


def make_outer_step(pmean: bool, opt=opt, meta_opt=meta_opt):
    """The notebook's ``step``, ``outer_loss`` and ``outer_step``; ``pmean``: the pmap-style
    form, both gradients averaged over ``'batch'``; ``opt``, ``meta_opt``: the inner and
    the meta optimizer (the notebook's by default)."""
    def step(theta, state, x, y):
        grad = jax.grad(loss)(theta, x, y)
        if pmean:
            grad = jax.lax.pmean(grad, "batch")
        updates, state = opt.update(grad, state)
        theta = optax.apply_updates(theta, updates)
        return theta, state

    def outer_loss(eta, theta, state, samples):
        state.hyperparams['learning_rate'] = jax.nn.sigmoid(eta)

        for x, y in samples[:-1]:
            theta, state = step(theta, state, x, y)

        x, y = samples[-1]

        return loss(theta, x, y), (theta, state)

    @jax.jit
    def outer_step(eta, theta, meta_state, state, samples):
        grad, (theta, state) = jax.grad(
            outer_loss, has_aux=True)(eta, theta, state, samples)
        if pmean:
            grad = jax.lax.pmean(grad, "batch")

        meta_updates, meta_state = meta_opt.update(grad, meta_state)
        eta = optax.apply_updates(eta, meta_updates)

        return eta, theta, meta_state, state
    return outer_step


def port(pmean: bool, optimizers: str = "rmsprop+adam") -> Port:
    opt, meta_opt = OPTIMIZERS[optimizers]
    theta = jax.random.normal(jax.random.PRNGKey(42))
    state = opt.init(theta)
    # inverse sigmoid, to match the value we initialized the inner optimizer with.
    lr = state.hyperparams['learning_rate']
    eta = jnp.asarray(-np.log(1. / lr - 1), jnp.float32)
    meta_state = meta_opt.init(eta)
    g = generator()
    data = [[next(g) for _ in range(N)] for _ in range(OUTER_STEPS)]
    return Port(step=make_outer_step(pmean, opt, meta_opt), state=(eta, theta, meta_state, state),
                inputs=lambda i: ((Split(data[i]),), {}),
                split_out=lambda out: (tuple(out), ()))


@pytest.mark.parametrize("optimizers", list(OPTIMIZERS))
@pytest.mark.parametrize("n", REPLICAS)
def test_meta_learning_pmap_style(n, optimizers):
    check_port(port(pmean=True, optimizers=optimizers), n, oracle=True, steps=OUTER_STEPS)


@pytest.mark.parametrize("optimizers", list(OPTIMIZERS))
@pytest.mark.parametrize("n", REPLICAS)
def test_meta_learning_written_for_one_replica_equals_the_global_batch(n, optimizers):
    """No collective in the step: replicate's all-reduces of the inner gradients and of the
    meta-gradient make it the global-batch step, the learning rate learnt included."""
    p = port(pmean=False, optimizers=optimizers)
    g_state = check_against_global(p, n, OUTER_STEPS, metric_means=False,
                                   what="meta-learning")
    # the meta-gradient moved the learning rate (eta is the state's first leaf)
    assert abs(float(g_state[0][0]) - float(p.state[0])) > 1e-3
