"""Port of google-deepmind/optax examples/contrib/sam.ipynb (Sharpness-Aware Minimization).

Kept from the source: the three SAM optimizers of the notebook's transparent-mode cells
(the drop-in ``contrib.sam(optax.sgd(lr), chain(contrib.normalize(), optax.sgd(rho)),
sync_period=2)``, ``sam_mom`` and ``sam_adam`` with ``sync_period=5``), their opaque-mode
forms (``opaque_mode=True``, the update given ``grad_fn = jax.grad(lambda params, _:
loss(params, batch))``), the ``Store`` of params, optimizer state and step (the
notebook's ``chex.dataclass``, here ``flax.struct.dataclass``: chex is no dependency of
ours, and both make a pytree with ``replace``) and ``make_step``'s ``@jax.jit`` step
(``value_and_grad(loss)``, ``opt.update``, ``apply_updates``, ``store.replace``), run
for two sync periods so that adversarial and outer steps both happen.

Data parallel: the notebook's loss is a fixed 2-D surface with a sharp minimum at (0, 0)
and a smooth one at (2, 0); here each example shifts it by a small offset and the loss is
the mean over the replica's slice of a global batch, so the gradient differs from
replica to replica and the adversarial point depends on which gradient SAM perturbs by.
Two forms of the step:

* pmap style: the gradients and the loss ``pmean``-ed, and in opaque mode
  ``batch_axis_name`` given so that optax ``pmean``s the gradients ``grad_fn`` returns
  inside the update (its docstring's instruction for pmapped training). pmap and the
  global-batch jit are oracles.
* written for one replica, as TPUStrategy users write it: no collective at all.
  ``replicate`` all-reduces every gradient of the mirrored parameters, the one SAM takes
  inside ``opt.update`` in opaque mode included, so each adversarial step moves the
  parameters by the global batch's gradient and the result is the global-batch jit's
  (pmap runs each replica's own problem there: no oracle). Had the inner gradient stayed
  per replica, each replica would perturb to its own point: a silently different
  optimizer ("m-sharpness"), which these tests would show: run so (pmap style without
  ``batch_axis_name``), the parameters end 0.11 (sam), 0.11 (sam_mom) and 0.41
  (sam_adam) away from the global batch's, against a tolerance of 2e-5.
"""
from __future__ import annotations

import jax
import jax.numpy as np  # the notebook's name for jax.numpy
import numpy
import optax
import pytest
from flax import struct
from optax import contrib

from tests.clients._harness import REPLICAS, Port, Split, check_against_global, check_port

GLOBAL_BATCH = 16


def loss(params, batch):
    """The notebook's two-minima surface, shifted by each example's offset, averaged."""
    x, y = params
    a, b = batch["a"], batch["b"]
    return np.mean(-np.exp(-(x - 2 - a)**2 - (y - b)**2)
                   - 1.0*np.exp(-((x - a)**2 + (y - b)**2*100)))


@struct.dataclass
class Store:
    params: jax.Array
    state: optax.OptState
    step: int = 0


# -- the notebook's optimizers (lr, rho and momentum as there; lr larger, so that a few
# steps move the parameters well past the tolerance) --------------------------------------
def sam_sgd(opaque_mode=False, batch_axis_name=None, lr=0.05, rho=0.1):
    opt = optax.sgd(lr)
    adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
    return contrib.sam(opt, adv_opt, sync_period=2, opaque_mode=opaque_mode,
                       batch_axis_name=batch_axis_name)


def sam_mom(lr=0.05, momentum=0.1, rho=0.1, sync_period=2, opaque_mode=False,
            batch_axis_name=None):
    opt = optax.sgd(lr, momentum=momentum)
    adv_opt = optax.chain(contrib.normalize(), optax.sgd(rho))
    return contrib.sam(opt, adv_opt, sync_period=sync_period, opaque_mode=opaque_mode,
                       batch_axis_name=batch_axis_name)


def sam_adam(lr=0.05, b1=0.9, b2=0.999, rho=0.03, sync_period=5, opaque_mode=False,
             batch_axis_name=None):
    """A SAM optimizer using Adam for the outer optimizer."""
    opt = optax.adam(lr, b1=b1, b2=b2)
    adv_opt = optax.chain(contrib.normalize(), optax.adam(rho))
    return contrib.sam(opt, adv_opt, sync_period=sync_period, opaque_mode=opaque_mode,
                       batch_axis_name=batch_axis_name)


OPTIMIZERS = {"sam": (sam_sgd, 2), "sam_mom": (sam_mom, 2), "sam_adam": (sam_adam, 5)}


def make_step(opt, opaque, pmean):
    """The notebook's ``make_step``; ``pmean``: the pmap-style form (see the module
    docstring); ``opaque``: the update takes ``grad_fn`` (the notebook's opaque cells)."""
    @jax.jit
    def step(store, batch):
        value, grads = jax.value_and_grad(loss)(store.params, batch)
        if pmean:
            grads = jax.lax.pmean(grads, "batch")
            value = jax.lax.pmean(value, "batch")
        if opaque:
            grad_fn = jax.grad(lambda params, _: loss(params, batch))
            updates, state = opt.update(grads, store.state, store.params, grad_fn=grad_fn)
        else:
            updates, state = opt.update(grads, store.state, store.params)
        params = optax.apply_updates(store.params, updates)
        return store.replace(
            params=params,
            state=state,
            step=store.step+1), value
    return step


def batches(steps, seed=0):
    rng = numpy.random.default_rng(seed)
    return [{"a": rng.normal(0, 0.3, GLOBAL_BATCH).astype(numpy.float32),
             "b": rng.normal(0, 0.3, GLOBAL_BATCH).astype(numpy.float32)}
            for _ in range(steps)]


def port(name, opaque, pmean):
    make_opt, sync_period = OPTIMIZERS[name]
    opt = make_opt(opaque_mode=opaque, batch_axis_name="batch" if (opaque and pmean) else None)
    params = np.array([-0.4, -0.4])
    data = batches(2 * sync_period)
    return Port(step=make_step(opt, opaque, pmean),
                state=(Store(params=params, state=opt.init(params)),),
                inputs=lambda i: ((Split(data[i]),), {}),
                split_out=lambda out: ((out[0],), out[1])), 2 * sync_period


@pytest.mark.parametrize("opaque", [False, True], ids=["transparent", "opaque"])
@pytest.mark.parametrize("n", REPLICAS)
def test_sam_pmap_style(n, opaque):
    p, steps = port("sam", opaque, pmean=True)
    check_port(p, n, oracle=True, steps=steps, oracle_metrics=lambda m: m)


@pytest.mark.parametrize("name", ["sam_mom", "sam_adam"])
@pytest.mark.parametrize("opaque", [False, True], ids=["transparent", "opaque"])
def test_sam_variants_pmap_style(name, opaque):
    p, steps = port(name, opaque, pmean=True)
    check_port(p, 8, oracle=True, steps=steps, oracle_metrics=lambda m: m)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("opaque", [False, True], ids=["transparent", "opaque"])
def test_sam_written_for_one_replica_equals_the_global_batch(name, opaque):
    """No collective in the step: replicate's gradient all-reduces (SAM's inner one in
    opaque mode too) make it the global-batch step; every step's loss, averaged over the
    replicas (equal slices), is the global batch's."""
    p, steps = port(name, opaque, pmean=False)
    check_against_global(p, 4, steps, what=name)
