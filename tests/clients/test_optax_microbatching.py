"""Port of google-deepmind/optax examples/gradient_accumulation_and_microbatching.ipynb.

Kept from the source: the ``TransformerBlock`` and ``Transformer`` ``nnx.Module`` s
(``Embed``, pre-norm ``MultiHeadAttention`` and a GELU MLP, a final ``Linear``), split with
``nnx.split(model, nnx.Variable)`` and merged back in ``loss_fn`` (next-token
``softmax_cross_entropy_with_integer_labels``), ``optax.adamw(0.01)``, and the notebook's
four ways of taking a step, each a ``jax.jit`` with the notebook's ``donate_argnums``:
``update_fn`` (one batch), ``add_gradient`` + ``update_params`` (gradients accumulated by
hand), ``update_fn_v2`` (``optax.MultiSteps``) and ``update_fn_v3``
(``optax.microbatching.microbatch`` of ``jax.grad(loss_fn)`` over the batch). Changed for a
test: the sizes (vocabulary 32, hidden 16, 2 heads, 1 layer, sequences of 8, 2 steps of
accumulation, microbatches of 2), the microbatch accumulator asked for as ``MEAN`` (so that
the microbatched gradient is the batch's mean gradient, as the other three take it), and
AdamW's ``eps`` 1e-4 (optax's 1e-8): the attention's key bias has a gradient of exactly
zero in exact arithmetic and of rounding noise (5e-10) in floating point, which Adam's
``g / (|g| + eps)`` turns into a step of ~0.1 lr that depends on the summation order (the
same program on the global batch in one jit moves it by 0.0013 more: numbers, not a
defect).

Each step is written for one replica, as the notebook has it, and run by ``replicate``
over a global batch split on the replicas, against the same jitted function on the whole
batch on one device: ``replicate`` all-reduces the gradients of the mirrored parameters
(inside ``microbatch``'s ``fori_loop`` too: the all-reduce is moved after the loop), so
every form is the global-batch step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax import microbatching

import runtime as rt
from tests.clients._harness import assert_trees_close


class TransformerBlock(nnx.Module):
    def __init__(self, hidden_size: int, num_heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(hidden_size, rngs=rngs)
        self.mha = nnx.MultiHeadAttention(num_heads, hidden_size, rngs=rngs)
        self.norm2 = nnx.LayerNorm(hidden_size, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(hidden_size, 4*hidden_size, rngs=rngs),
            jax.nn.gelu,
            nnx.Linear(4*hidden_size, hidden_size, rngs=rngs),
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        attention_output = self.mha(self.norm1(x), self.norm1(x), self.norm1(x), decode=False)
        x = x + attention_output
        mlp_output = self.mlp(self.norm2(x))
        return x + mlp_output


class Transformer(nnx.Module, pytree=False):
    def __init__(self, vocab_size: int, num_layers: int, hidden_size: int, num_heads: int = 8,
                 *, rngs: nnx.Rngs):
        self.embedding = nnx.Embed(vocab_size, hidden_size, rngs=rngs)
        self.layers = [TransformerBlock(hidden_size, num_heads, rngs=rngs)
                       for _ in range(num_layers)]
        self.final_layer = nnx.Linear(hidden_size, vocab_size, rngs=rngs)

    def __call__(self, x: jax.Array):
        x = self.embedding(x)

        for layer in self.layers:
            x = layer(x)

        logits = self.final_layer(x)
        return logits


hidden_size = 16
num_heads = 2
num_layers = 1
vocab_size = 32
sequence_length = 8
batch_size = 16  # the global batch: 4 rows per replica on 4 replicas
accumulation_steps = 2
N = 4

model = Transformer(vocab_size, num_layers, hidden_size, num_heads, rngs=nnx.Rngs(0))
graphdef, params = nnx.split(model, nnx.Variable)

adamw = optax.adamw(0.01, eps=1e-4)


def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1], labels=batch[:, 1:]
    ).mean()


@functools.partial(jax.jit, donate_argnums=(0, 1))
def update_fn(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = adamw.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state


@functools.partial(jax.jit, donate_argnums=(2,))
def add_gradient(params, batch, accumulated_gradients):
    grad = jax.grad(loss_fn)(params, batch)
    return jax.tree.map(jnp.add, grad, accumulated_gradients)


@functools.partial(jax.jit, donate_argnums=(0, 1, 2))
def update_params(params, opt_state, accumulated_gradients):
    updates, opt_state = adamw.update(accumulated_gradients, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, optax.tree.zeros_like(accumulated_gradients)


multi_adam = optax.MultiSteps(adamw, accumulation_steps)


@functools.partial(jax.jit, donate_argnums=(0, 2))
def update_fn_v2(params, batch, opt_state):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = multi_adam.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state


@functools.partial(jax.jit, donate_argnums=(0, 2))
def update_fn_v3(params, batch, opt_state):
    grads = microbatching.microbatch(
        jax.grad(loss_fn),
        argnums=1,
        microbatch_size=2,
        accumulator=microbatching.AccumulationType.MEAN,
    )(params, batch)
    updates, opt_state = adamw.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state


def batches() -> list[np.ndarray]:
    keys = jax.random.split(jax.random.key(0), accumulation_steps)
    return [np.asarray(jax.random.randint(k, (batch_size, sequence_length), 0, vocab_size))
            for k in keys]


def _copy(tree):
    """A fresh copy (the steps donate their arguments)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _run(form: str, replicated: bool):
    """The notebook's ``form`` of training for ``accumulation_steps`` batches: through
    ``replicate`` (each batch split over N replicas) or the jitted function on one device;
    returns the parameters."""
    wrap = (lambda f: rt.replicate(f, num_replicas=N)) if replicated else (lambda f: f)
    put = (lambda b: rt.distribute(b, N)) if replicated else (lambda b: b)
    p = _copy(params)
    data = batches()
    if form == "update_fn":
        step, o = wrap(update_fn), adamw.init(p)
        for b in data:
            p, o = step(p, _copy(o), put(b))
    elif form == "accumulate":
        add, upd = wrap(add_gradient), wrap(update_params)
        acc, o = optax.tree.zeros_like(p), adamw.init(p)
        for b in data:
            acc = add(p, put(b), acc)
        p, o, acc = upd(p, o, acc)
    elif form == "MultiSteps":
        step, o = wrap(update_fn_v2), multi_adam.init(p)
        for b in data:
            p, o = step(p, put(b), o)
    elif form == "microbatch":
        step, o = wrap(update_fn_v3), adamw.init(p)
        p, o = step(p, put(data[0]), o)
    else:
        raise ValueError(form)
    return p


@pytest.mark.parametrize("form", ["update_fn", "accumulate", "MultiSteps", "microbatch"])
def test_written_for_one_replica_equals_the_global_batch(form):
    want = _run(form, replicated=False)
    got = _run(form, replicated=True)
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(params)))
    assert moved > 1e-3, f"{form}: training did not move the parameters"
    for leaf in jax.tree.leaves(got):
        assert not isinstance(leaf, rt.PerReplica)
    assert_trees_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                       f"{form}: replicate vs the global batch")


def test_the_gradients_themselves_equal_the_global_batchs():
    """AdamW moves the same for any gradient scale, so the steps above cannot see a
    gradient N times too large; the gradients can: ``microbatch``'s (its all-reduce moved
    out of the ``fori_loop``) and ``add_gradient``'s accumulated sum over two batches."""
    def micro(params, batch):
        return microbatching.microbatch(jax.grad(loss_fn), argnums=1, microbatch_size=2,
                                        accumulator=microbatching.AccumulationType.MEAN)(
            params, batch)
    data = batches()
    want = jax.jit(micro)(params, data[0])
    got = rt.replicate(micro, num_replicas=N)(params, rt.distribute(data[0], N))
    assert_trees_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                       "microbatched gradient, replicate vs the global batch")
    add = rt.replicate(add_gradient, num_replicas=N)
    acc_r, acc_j = optax.tree.zeros_like(params), optax.tree.zeros_like(params)
    for b in data:
        acc_r = add(params, rt.distribute(b, N), acc_r)
        acc_j = add_gradient(params, b, acc_j)
    assert_trees_close(jax.tree.map(np.asarray, acc_r), jax.tree.map(np.asarray, acc_j),
                       "accumulated gradients, replicate vs the global batch")
