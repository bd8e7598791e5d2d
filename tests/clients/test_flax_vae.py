"""Port of google/flax examples/vae (train.py and models.py at commit 18f8f311c275, HEAD of
2026-07-02; train.py last changed in 88d74979 "[flax:examples:vae] Small linter fixes").

Kept from the source: ``Encoder`` / ``Decoder`` / ``VAE`` (``setup``, ``generate``),
``reparameterize`` (``eps = random.normal(rng, logvar.shape)``), ``model(latents)``, the
vmapped ``kl_divergence`` and ``binary_cross_entropy_with_logits``, ``compute_metrics``,
``train_step(state, batch, z_rng, latents)`` (``jax.grad`` of BCE + KLD of the
reconstruction, ``state.apply_gradients``), ``eval_f(params, images, z, z_rng, latents)``
(``nn.apply`` of a function of the module: metrics, the comparison of the first 8 images
with their reconstructions, images generated from the fixed ``z``), and
``train_and_evaluate``'s setup: ``random.key(0)`` split into the init key and, per step,
a fresh ``z_rng``; ``TrainState`` with ``optax.adam(learning_rate)``; ``latents`` a Python
int (static). Sizes: 8x8 images (64 pixels, not 784), hidden 32 (not 500), 4 latents (not
20); synthetic binarized images (0/1 floats, as binarized MNIST), no download.

The source's step is single-device (it runs eagerly, one program on one device). Written
for one replica it goes to ``rt.replicate`` unchanged: the loss is each replica's own
batch mean, and ``replicate`` all-reduces the gradient (mean over replicas). The pmap-style
form adds ``lax.pmean(grads, 'batch')``.

Randomness. The step draws the reparameterization noise from ``z_rng`` for the rows of
ITS batch: ``random.normal(z_rng, (B/N, latents))``. Which noise a global example gets
depends on how ``z_rng`` reaches the replicas:

* per replica (``Each``: the step key split into N, as pmap code does): replica r draws
  ``normal(key_r, (B/N, L))`` for rows ``r*B/N ...``. The global-batch step with one key
  cannot draw those numbers (``normal(key, (B, L))`` is a different array), so the oracle
  is the N replicas' program itself on ONE device under ``jax.jit``: the source's loss of
  each slice with its replica's key, averaged over the slices (equal sizes: the global
  batch's mean), ``jax.grad`` of that, ``apply_gradients`` (``global_train_step``);
* mirrored (the source's one key passed as is): every replica draws the SAME
  ``normal(key, (B/N, L))`` for its own rows (TPUStrategy semantics: a mirrored value is
  the same everywhere); the oracle is the same program with that key for every slice;
* folded in the step (``random.fold_in(z_rng, rt.replica_id())`` of the one mirrored
  key, TPUStrategy code's idiom): the oracle takes ``fold_in(key, r)`` for slice r;
* per example (``Split``: one key per example, the model drawing ``eps`` with a ``vmap``
  over the keys, ``PerExampleVAE``): the noise of an example no longer depends on the
  split, so the plain global-batch ``jax.jit`` (the harness's oracle) is exact.

Adam divides each gradient by its own running scale, so a gradient N times too large (an
all-reduce summing instead of averaging) hides behind it; ``test_vae_sgd_*`` trains with
``optax.sgd`` and also shows that ``loss_reduction="sum"`` (N times the mean) lands far
from the oracle (a gradient never all-reduced would leave the parameters per replica,
which the harness refuses).

An uneven batch (13 examples on 4 replicas, ``RunOptions(dynamic_shapes=True)``): the
noise drawn at the padded size and masked equals each replica's own draw, with raw
``PRNGKey`` keys and with the source's typed keys (``random.key``; one per replica, no
dynamic axis).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from jax import random

import runtime as rt
from tests.clients._harness import (REPLICAS, Each, Port, Split, _for_pmap, assert_mirrored,
                                    assert_trees_close, check_against_global, check_port,
                                    replicate_result, train)

pytestmark = pytest.mark.filterwarnings("error::runtime.DivergingStateWarning")

IMAGE = 8                 # binarized MNIST is 28x28
PIXELS = IMAGE * IMAGE    # the source's 784
HIDDEN = 32               # the source's 500
LATENTS = 4               # config.latents = 20
GLOBAL_BATCH = 16         # config.batch_size = 128
LEARNING_RATE = 0.001     # config.learning_rate
STEPS = 3


# -- models.py ----------------------------------------------------------------------------

class Encoder(nn.Module):
  """VAE Encoder."""

  latents: int

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(HIDDEN, name='fc1')(x)
    x = nn.relu(x)
    mean_x = nn.Dense(self.latents, name='fc2_mean')(x)
    logvar_x = nn.Dense(self.latents, name='fc2_logvar')(x)
    return mean_x, logvar_x


class Decoder(nn.Module):
  """VAE Decoder."""

  @nn.compact
  def __call__(self, z):
    z = nn.Dense(HIDDEN, name='fc1')(z)
    z = nn.relu(z)
    z = nn.Dense(PIXELS, name='fc2')(z)
    return z


class VAE(nn.Module):
  """Full VAE model."""

  latents: int = 20

  def setup(self):
    self.encoder = Encoder(self.latents)
    self.decoder = Decoder()

  def __call__(self, x, z_rng):
    mean, logvar = self.encoder(x)
    z = reparameterize(z_rng, mean, logvar)
    recon_x = self.decoder(z)
    return recon_x, mean, logvar

  def generate(self, z):
    return nn.sigmoid(self.decoder(z))


def reparameterize(rng, mean, logvar):
  std = jnp.exp(0.5 * logvar)
  eps = random.normal(rng, logvar.shape)
  return mean + eps * std


def model(latents):
  return VAE(latents=latents)


# -- not in the source: the noise keyed per example (see the module docstring) -------------

class PerExampleVAE(VAE):
  """``VAE`` whose ``z_rng`` is one key per example: ``eps`` of example i is
  ``normal(z_rng[i], (latents,))``, whatever replica holds it."""

  def __call__(self, x, z_rng):
    mean, logvar = self.encoder(x)
    std = jnp.exp(0.5 * logvar)
    eps = jax.vmap(lambda k: random.normal(k, logvar.shape[1:]))(z_rng)
    recon_x = self.decoder(mean + eps * std)
    return recon_x, mean, logvar


# -- train.py -----------------------------------------------------------------------------

@jax.vmap
def kl_divergence(mean, logvar):
  return -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar))


@jax.vmap
def binary_cross_entropy_with_logits(logits, labels):
  logits = nn.log_sigmoid(logits)
  return -jnp.sum(
      labels * logits + (1.0 - labels) * jnp.log(-jnp.expm1(logits))
  )


def compute_metrics(recon_x, x, mean, logvar):
  bce_loss = binary_cross_entropy_with_logits(recon_x, x).mean()
  kld_loss = kl_divergence(mean, logvar).mean()
  return {'bce': bce_loss, 'kld': kld_loss, 'loss': bce_loss + kld_loss}


def train_step(state, batch, z_rng, latents):
  """Train step."""
  def loss_fn(params):
    recon_x, mean, logvar = models.model(latents).apply(
        {'params': params}, batch, z_rng
    )

    bce_loss = binary_cross_entropy_with_logits(recon_x, batch).mean()
    kld_loss = kl_divergence(mean, logvar).mean()
    loss = bce_loss + kld_loss
    return loss

  grads = jax.grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads)


def eval_f(params, images, z, z_rng, latents):
  """Evaluation function."""
  def eval_model(vae):
    recon_images, mean, logvar = vae(images, z_rng)
    comparison = jnp.concatenate([
        images[:8].reshape(-1, IMAGE, IMAGE, 1),
        recon_images[:8].reshape(-1, IMAGE, IMAGE, 1),
    ])

    generate_images = vae.generate(z)
    generate_images = generate_images.reshape(-1, IMAGE, IMAGE, 1)
    metrics = compute_metrics(recon_images, images, mean, logvar)
    return metrics, comparison, generate_images

  return nn.apply(eval_model, models.model(latents))({'params': params})


class models:  # noqa: N801  (the source's ``import models``: ``models.model(latents)``)
  model = staticmethod(model)


# -- data parallel forms and the oracles --------------------------------------------------

def pmap_train_step(state, batch, z_rng, latents):
  """``train_step`` as pmap code writes it: the gradients ``pmean``-ed over 'batch'."""
  def loss_fn(params):
    recon_x, mean, logvar = models.model(latents).apply(
        {'params': params}, batch, z_rng
    )

    bce_loss = binary_cross_entropy_with_logits(recon_x, batch).mean()
    kld_loss = kl_divergence(mean, logvar).mean()
    loss = bce_loss + kld_loss
    return loss

  grads = jax.grad(loss_fn)(state.params)
  grads = jax.lax.pmean(grads, axis_name='batch')
  return state.apply_gradients(grads=grads)


def fold_in_replica_id(step, state, batch, z_rng, latents):
  """``step`` with its mirrored ``z_rng`` folded with the replica's id."""
  return step(state, batch, random.fold_in(z_rng, rt.replica_id()), latents)


def global_train_step(state, batch, z_rngs, latents):
  """The oracle: the N replicas' program on one device. ``batch`` is the global batch,
  ``z_rngs`` the N replicas' keys (stacked); the loss of slice r is the source's, with key
  r; the global loss is their mean (equal slices: the mean over the global batch)."""
  n = z_rngs.shape[0]

  def loss_fn(params):
    losses = []
    for r, x in enumerate(jnp.split(batch, n)):
      recon_x, mean, logvar = models.model(latents).apply(
          {'params': params}, x, z_rngs[r]
      )
      losses.append(binary_cross_entropy_with_logits(recon_x, x).mean()
                    + kl_divergence(mean, logvar).mean())
    return jnp.mean(jnp.stack(losses))

  grads = jax.grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads)


def per_example_train_step(state, batch, z_rng, latents):
  """``train_step`` of ``PerExampleVAE``: ``z_rng`` holds one key per example."""
  def loss_fn(params):
    recon_x, mean, logvar = PerExampleVAE(latents).apply(
        {'params': params}, batch, z_rng
    )

    bce_loss = binary_cross_entropy_with_logits(recon_x, batch).mean()
    kld_loss = kl_divergence(mean, logvar).mean()
    loss = bce_loss + kld_loss
    return loss

  grads = jax.grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads)


def binarized_batches(global_batch, steps, seed=0):
  """Synthetic binarized MNIST: flat images of 0/1 floats (``prepare_image``'s layout)."""
  rng = np.random.default_rng(seed)
  return [(rng.random((global_batch, PIXELS)) < 0.3).astype(np.float32)
          for _ in range(steps)]


@functools.lru_cache(maxsize=None)
def create_state(tx_name="adam"):
  """``train_and_evaluate``'s setup: ``random.key(0)`` split, ``init`` on ones,
  ``TrainState`` with adam (``tx_name="sgd"``: ``optax.sgd``, see the docstring).
  Returns the state and the key the training loop goes on splitting."""
  rng = random.key(0)
  rng, key = random.split(rng)
  init_data = jnp.ones((GLOBAL_BATCH, PIXELS), jnp.float32)
  tx = optax.adam(LEARNING_RATE) if tx_name == "adam" else optax.sgd(0.05)
  # jitted: eager init compiles every op once (seconds); same values
  params = jax.jit(lambda k, r: models.model(LATENTS).init(k, init_data, r)['params'])(
      key, rng)
  state = train_state.TrainState.create(
      apply_fn=models.model(LATENTS).apply,
      params=params,
      tx=tx,
  )
  return jax.jit(lambda s: s)(state), rng


def step_keys(rng, steps):
  """The training loop's ``rng, key = random.split(rng)``, once per step."""
  keys = []
  for _ in range(steps):
    rng, key = random.split(rng)
    keys.append(key)
  return keys


def ports(n, keys_mode, tx_name="adam", pmean=False):
  """(the port run by replicate/pmap, the oracle port run by the global jit)."""
  state, rng = create_state(tx_name)
  batches = binarized_batches(GLOBAL_BATCH, STEPS)
  keys = step_keys(rng, STEPS)
  step = pmap_train_step if pmean else train_step
  if keys_mode == "per_replica":
    per = [random.split(k, n) for k in keys]  # each step's key split over the replicas
    inputs = lambda i: ((Split(batches[i]), Each(list(per[i])), LATENTS), {})
    oracle_inputs = lambda i: ((batches[i], per[i], LATENTS), {})
  elif keys_mode == "mirrored":
    inputs = lambda i: ((Split(batches[i]), keys[i], LATENTS), {})
    oracle_inputs = lambda i: ((batches[i], jnp.stack([keys[i]] * n), LATENTS), {})
  elif keys_mode == "fold_in_replica_id":
    # TPUStrategy code's idiom: one mirrored key, made per replica inside the step
    step = functools.partial(fold_in_replica_id, step)
    inputs = lambda i: ((Split(batches[i]), keys[i], LATENTS), {})
    oracle_inputs = lambda i: (
        (batches[i], jnp.stack([random.fold_in(keys[i], r) for r in range(n)]), LATENTS), {})
  else:
    raise ValueError(keys_mode)
  out = lambda s: ((s,), ())
  port = Port(step=step, state=(state,), inputs=inputs, static_argnums=(3,), split_out=out)
  oracle = Port(step=global_train_step, state=(state,), inputs=oracle_inputs,
                static_argnums=(3,), split_out=out)
  return port, oracle


# -- tests --------------------------------------------------------------------------------

@pytest.mark.parametrize("n,keys_mode", [(n, "per_replica") for n in REPLICAS]
                         + [(8, "mirrored"), (8, "fold_in_replica_id")])
def test_vae_written_for_one_replica(n, keys_mode):
    """The source's ``train_step`` unchanged: replicate equals the replicas' program on
    one device (same noise per example), after ``STEPS`` adam steps."""
    port, oracle = ports(n, keys_mode)
    check_against_global(port, n, STEPS, oracle=oracle, metric_means=False,
                         what=f"vae {keys_mode} keys")


@pytest.mark.parametrize("n", REPLICAS)
def test_vae_pmap_style(n):
    """``lax.pmean(grads)`` added: replicate equals pmap (same per-replica keys) and the
    replicas' program on one device."""
    port, oracle = ports(n, "per_replica", pmean=True)
    check_port(port, n, oracle=False, steps=STEPS)
    check_against_global(port, n, STEPS, oracle=oracle, metric_means=False,
                         what="vae pmap style")


@pytest.mark.parametrize("n", REPLICAS)
def test_vae_per_example_noise_equals_the_global_batch(n):
    """One key per example (``Split``): the noise no longer depends on the split, and the
    plain global-batch jit on one device is the oracle."""
    state, rng = create_state()
    batches = binarized_batches(GLOBAL_BATCH, STEPS)
    keys = [np.asarray(random.key_data(random.split(k, GLOBAL_BATCH)))  # raw uint32, (B, 2)
            for k in step_keys(rng, STEPS)]
    port = Port(step=per_example_train_step, state=(state,),
                inputs=lambda i: ((Split(batches[i]), Split(keys[i]), LATENTS), {}),
                static_argnums=(3,), split_out=lambda s: ((s,), ()))
    check_against_global(port, n, STEPS, metric_means=False, what="vae per-example keys")


@pytest.mark.parametrize("n", [8])
def test_vae_sgd_catches_a_wrong_gradient_reduction(n):
    """Plain SGD: the step is proportional to the gradient, so a reduction applied N times
    or not at all shows. The oracle agrees; ``loss_reduction="sum"`` (the gradient N times
    the mean) does not."""
    port, oracle = ports(n, "per_replica", tx_name="sgd")
    g_state = check_against_global(port, n, STEPS, oracle=oracle, metric_means=False,
                                   what="vae sgd")
    fn = rt.replicate(train_step, num_replicas=n, static_argnums=(3,), loss_reduction="sum")
    state = port.state[0]
    for i in range(STEPS):
        (batch, keys, latents), _ = port.inputs(i)
        state = fn(state, rt.distribute(batch.tree, n), rt.PerReplica(list(keys.values)),
                   latents)
    assert_mirrored(state, "sum reduction")
    got = jax.tree.leaves(state.params)
    want = jax.tree.leaves(g_state[0].params)
    worst = max(float(np.max(np.abs(np.asarray(a) - b[0]))) for a, b in zip(got, want))
    assert worst > 1e-3, f"sum reduction not told apart from mean: {worst}"


# -- eval_f -------------------------------------------------------------------------------

def global_eval_f(params, images, z, z_rngs, latents):
  """The oracle of ``eval_f`` on N replicas: each slice evaluated with its replica's key,
  in one program on one device; results stacked on a leading replica axis."""
  n = z_rngs.shape[0]
  outs = [eval_f(params, x, z, z_rngs[r], latents) for r, x in enumerate(jnp.split(images, n))]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


@pytest.mark.parametrize("keys_mode", ["per_replica", "mirrored"])
def test_vae_eval(keys_mode):
    """``eval_f`` on 8 replicas (8 test images each: the comparison takes the first 8):
    the metrics and comparisons are per replica and equal pmap's and the one-device
    program's; the generated images read only mirrored values (params, ``z``) and come
    back as one array. The mean of the metrics over the replicas is the test set's."""
    n = 8
    state, rng = create_state()
    rng, z_key, eval_rng = random.split(rng, 3)
    z = random.normal(z_key, (64, LATENTS))
    images = binarized_batches(8 * n, 1, seed=1)[0]
    if keys_mode == "per_replica":
        keys = random.split(eval_rng, n)
        r_keys = rt.PerReplica(list(keys))
        p_keys = _for_pmap(Each(list(keys)), n)
    else:
        keys = jnp.stack([eval_rng] * n)
        r_keys = eval_rng
        p_keys = _for_pmap(eval_rng, n)
    metrics, comparison, sample = rt.replicate(eval_f, num_replicas=n, static_argnums=(4,))(
        state.params, rt.distribute(images, n), z, r_keys, LATENTS)
    assert not isinstance(sample, rt.PerReplica), type(sample)
    assert isinstance(comparison, rt.PerReplica)
    got = replicate_result((metrics, comparison, sample), n)

    want = jax.jit(global_eval_f, static_argnums=(4,))(state.params, images, z, keys, LATENTS)
    assert_trees_close(got, want, f"eval, {keys_mode} keys, replicate vs one-device jit")

    p_eval = jax.pmap(eval_f, axis_name="batch", static_broadcasted_argnums=(4,),
                      devices=jax.devices()[:n])
    p_out = p_eval(_for_pmap(state.params, n), _for_pmap(Split(images), n),
                   _for_pmap(z, n), p_keys, LATENTS)
    assert_trees_close(got, p_out, f"eval, {keys_mode} keys, replicate vs pmap")


# -- an uneven last batch (dynamic shapes) ------------------------------------------------

@pytest.mark.parametrize("key_kind", ["raw", "typed"])
def test_vae_uneven_batch_dynamic_shapes(key_kind):
    """``RunOptions(dynamic_shapes=True)``: 13 examples over 4 replicas (4, 3, 3, 3),
    one SGD step. Each replica's noise is ``normal(key_r, (its rows, latents))`` drawn at
    the padded size and masked; the oracle is the replicas' program on one device with
    each replica's real rows (TF's semantics: each replica's mean, then their mean)."""
    n = 4
    state, _ = create_state("sgd")
    batch = binarized_batches(13, 1, seed=2)[0]
    parts = np.array_split(batch, n)
    if key_kind == "raw":
        keys = list(random.split(random.PRNGKey(3), n))
        opts = rt.RunOptions(dynamic_shapes=True, maximum_shapes=[None, (8, None)],
                             dynamic_dims={2: ()})  # a raw key's axis 0 is not the batch
    else:
        keys = list(random.split(random.key(3), n))
        opts = rt.RunOptions(dynamic_shapes=True, maximum_shapes=[None, (8, None)])

    def oracle(state, parts, keys, latents):
        def loss_fn(params):
            losses = []
            for x, key in zip(parts, keys):
                recon_x, mean, logvar = models.model(latents).apply({'params': params}, x, key)
                losses.append(binary_cross_entropy_with_logits(recon_x, x).mean()
                              + kl_divergence(mean, logvar).mean())
            return jnp.mean(jnp.stack(losses))
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params))

    fn = rt.replicate(train_step, num_replicas=n, static_argnums=(3,), options=opts)
    got = fn(state, rt.distribute_uneven(batch, n), rt.PerReplica(keys), LATENTS)
    assert_mirrored(got, "dynamic shapes")
    with jax.default_device(jax.devices()[0]):
        want = jax.jit(oracle, static_argnums=(3,))(state, parts, keys, LATENTS)
    assert_trees_close(got.params, want.params, "uneven batch, replicate vs one-device jit")
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
                zip(jax.tree.leaves(got.params), jax.tree.leaves(state.params)))
    assert moved > 1e-3, moved
