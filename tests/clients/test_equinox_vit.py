"""Port of patrick-kidger/equinox docs/examples/vision_transformer.ipynb ("Vision
Transformer (ViT)").

Kept from the source: ``PatchEmbedding`` (a ``Linear`` applied with ``jax.vmap`` to each
flattened patch), ``AttentionBlock`` (``LayerNorm``, ``eqx.nn.MultiheadAttention``, a GELU
MLP with two ``Dropout``s, residuals), ``VisionTransformer`` (CLS token, positional
embedding, embedding dropout, the blocks, a ``LayerNorm`` + ``Linear`` head in an
``eqx.nn.Sequential``), each with the source's fields and ``__call__`` (including the
source's choice of one ``key4`` for every block's initialisation); ``compute_grads``
(``eqx.filter_value_and_grad`` of the mean of
``optax.softmax_cross_entropy_with_integer_labels`` over
``jax.vmap(model, in_axes=(0, None, 0))(images, True, key)``: one dropout key per example);
``step_model`` (``optimizer.update``, ``eqx.apply_updates``) with ``optax.adamw(lr, b1,
b2)``; the test loop's inference (``enable_dropout=False``, argmax accuracy).

Changed: the one ``einops.rearrange`` is :func:`patchify`, a reshape/transpose (einops is
not a dependency), checked against a loop over patches. Sizes are tiny (8x8x3 images,
patch 4 so 4 patches, embedding 16, hidden 32, 2 heads, 2 layers, 10 classes; dropout 0.2
instead of 0.1 so that the few activations drop some); data are synthetic (CIFAR's
normalised NCHW shape, no torch). The model holds non-array leaves (``patch_size``,
``num_layers``, ``Dropout``'s rate), so, as in the equinox MNIST port, the step takes
``eqx.partition(model, eqx.is_array)``'s arrays and closes over the static part; the
per-example keys (the source's ``jr.split(key, num=batch_size + 1)[1:]``) are an input
split over the replicas with the images, so the global-batch oracle draws the same
dropout noise for every example.

What this checks: the step written for ONE replica (no collective), run by
``rt.replicate`` on N replicas, equals the same step through ``jax.jit`` on one device on
the global batch (state after 2 steps, and the loss averaged over replicas), with the
source's AdamW and with SGD (Adam normalises away a gradient N times too large; SGD does
not); and inference (dropout off) gives the global batch's logits and accuracy. Checked
that the oracle catches mistakes (N=2): under ``loss_reduction="sum"`` SGD's first weight
ends 0.148 against the oracle's 0.139 and Adam's ``mu`` is doubled; with the examples'
keys reversed, 0.137.
"""
from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import runtime as rt
from tests.clients._harness import REPLICAS, Port, Split, check_against_global

# Hyperparameters (the source's names; tiny sizes)
lr = 0.0001
dropout_rate = 0.2
beta1 = 0.9
beta2 = 0.999
batch_size = 16            # global batch: 8 per replica at N=2, 2 at N=8
patch_size = 4
image_size = (8, 8, 3)
num_patches = (image_size[0] // patch_size) * (image_size[1] // patch_size)
embedding_dim = 16
hidden_dim = 32
num_heads = 2
num_layers = 2
height, width, channels = image_size
num_classes = 10
STEPS = 2


def patchify(x, ph: int, pw: int):
    """``einops.rearrange(x, "c (h ph) (w pw) -> (h w) (c ph pw)", ph=ph, pw=pw)``.

    ``x`` is ``(c, h*ph, w*pw)``; row ``i*w + j`` of the result is patch ``(i, j)``
    flattened in ``(channel, row in patch, column in patch)`` order."""
    c, hh, ww = x.shape
    h, w = hh // ph, ww // pw
    x = x.reshape(c, h, ph, w, pw)           # c (h ph) (w pw) -> c h ph w pw
    x = x.transpose(1, 3, 0, 2, 4)           # -> h w c ph pw
    return x.reshape(h * w, c * ph * pw)     # -> (h w) (c ph pw)


def test_patchify_matches_loop():
    x = np.arange(3 * 8 * 12, dtype=np.float32).reshape(3, 8, 12)
    ph, pw = 4, 3
    h, w = 8 // ph, 12 // pw
    want = np.empty((h * w, 3 * ph * pw), np.float32)
    for i in range(h):
        for j in range(w):
            for c in range(3):
                for a in range(ph):
                    for b in range(pw):
                        want[i * w + j, c * ph * pw + a * pw + b] = x[c, i * ph + a, j * pw + b]
    np.testing.assert_array_equal(np.asarray(patchify(jnp.asarray(x), ph, pw)), want)
    np.testing.assert_array_equal(patchify(x, ph, pw), want)


class PatchEmbedding(eqx.Module):
    linear: eqx.nn.Embedding
    patch_size: int

    def __init__(self, input_channels: int, output_shape: int, patch_size: int, key):
        self.patch_size = patch_size

        self.linear = eqx.nn.Linear(
            self.patch_size**2 * input_channels,
            output_shape,
            key=key,
        )

    def __call__(self, x):
        # "channels height width" -> "num_patches embedding_dim"
        x = patchify(x, self.patch_size, self.patch_size)
        x = jax.vmap(self.linear)(x)

        return x


class AttentionBlock(eqx.Module):
    layer_norm1: eqx.nn.LayerNorm
    layer_norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    dropout1: eqx.nn.Dropout
    dropout2: eqx.nn.Dropout

    def __init__(self, input_shape: int, hidden_dim: int, num_heads: int,
                 dropout_rate: float, key):
        key1, key2, key3 = jr.split(key, 3)

        self.layer_norm1 = eqx.nn.LayerNorm(input_shape)
        self.layer_norm2 = eqx.nn.LayerNorm(input_shape)
        self.attention = eqx.nn.MultiheadAttention(num_heads, input_shape, key=key1)

        self.linear1 = eqx.nn.Linear(input_shape, hidden_dim, key=key2)
        self.linear2 = eqx.nn.Linear(hidden_dim, input_shape, key=key3)
        self.dropout1 = eqx.nn.Dropout(dropout_rate)
        self.dropout2 = eqx.nn.Dropout(dropout_rate)

    def __call__(self, x, enable_dropout: bool, key):
        input_x = jax.vmap(self.layer_norm1)(x)
        x = x + self.attention(input_x, input_x, input_x)

        input_x = jax.vmap(self.layer_norm2)(x)
        input_x = jax.vmap(self.linear1)(input_x)
        input_x = jax.nn.gelu(input_x)

        key1, key2 = jr.split(key, num=2)

        input_x = self.dropout1(input_x, inference=not enable_dropout, key=key1)
        input_x = jax.vmap(self.linear2)(input_x)
        input_x = self.dropout2(input_x, inference=not enable_dropout, key=key2)

        x = x + input_x

        return x


class VisionTransformer(eqx.Module):
    patch_embedding: PatchEmbedding
    positional_embedding: jnp.ndarray
    cls_token: jnp.ndarray
    attention_blocks: list[AttentionBlock]
    dropout: eqx.nn.Dropout
    mlp: eqx.nn.Sequential
    num_layers: int

    def __init__(self, embedding_dim: int, hidden_dim: int, num_heads: int,
                 num_layers: int, dropout_rate: float, patch_size: int, num_patches: int,
                 num_classes: int, key):
        key1, key2, key3, key4, key5 = jr.split(key, 5)

        self.patch_embedding = PatchEmbedding(channels, embedding_dim, patch_size, key1)

        self.positional_embedding = jr.normal(key2, (num_patches + 1, embedding_dim))

        self.cls_token = jr.normal(key3, (1, embedding_dim))

        self.num_layers = num_layers

        self.attention_blocks = [
            AttentionBlock(embedding_dim, hidden_dim, num_heads, dropout_rate, key4)
            for _ in range(self.num_layers)
        ]

        self.dropout = eqx.nn.Dropout(dropout_rate)

        self.mlp = eqx.nn.Sequential(
            [
                eqx.nn.LayerNorm(embedding_dim),
                eqx.nn.Linear(embedding_dim, num_classes, key=key5),
            ]
        )

    def __call__(self, x, enable_dropout: bool, key):
        x = self.patch_embedding(x)

        x = jnp.concatenate((self.cls_token, x), axis=0)

        x += self.positional_embedding[
            : x.shape[0]
        ]  # Slice to the same length as x, as the positional embedding may be longer.

        dropout_key, *attention_keys = jr.split(key, num=self.num_layers + 1)

        x = self.dropout(x, inference=not enable_dropout, key=dropout_key)

        for block, attention_key in zip(self.attention_blocks, attention_keys):
            x = block(x, enable_dropout, key=attention_key)

        x = x[0]  # Select the CLS token.
        x = self.mlp(x)

        return x


@eqx.filter_value_and_grad
def compute_grads(model: VisionTransformer, images, labels, key):
    logits = jax.vmap(model, in_axes=(0, None, 0))(images, True, key)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    return jnp.mean(loss)


def make_step_model(static, optimizer):
    """The source's ``step_model`` for one replica, on the model's arrays (``params``);
    ``static`` (the non-array part) and ``optimizer`` are closed over."""

    def step_model(params, state, images, labels, key):
        model = eqx.combine(params, static)
        loss, grads = compute_grads(model, images, labels, key)
        updates, new_state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))

        model = eqx.apply_updates(model, updates)
        params, _ = eqx.partition(model, eqx.is_array)

        return params, new_state, loss

    return step_model


def make_model():
    key = jr.PRNGKey(2003)
    return eqx.filter_jit(VisionTransformer)(   # jitted: eager init compiles every op once
        embedding_dim=embedding_dim, hidden_dim=hidden_dim, num_heads=num_heads,
        num_layers=num_layers, dropout_rate=dropout_rate, patch_size=patch_size,
        num_patches=num_patches, num_classes=num_classes, key=key)


def trainloader(steps=STEPS, seed=0):
    """Synthetic batches shaped like the source's normalised CIFAR loader (NCHW float
    images, int labels), each with the source's per-example keys
    (``key, *subkeys = jr.split(key, num=batch_size + 1)``), as raw uint32 keys."""
    rng = np.random.default_rng(seed)
    key = jr.PRNGKey(2003)
    batches = []
    for _ in range(steps):
        key, *subkeys = jr.split(key, num=batch_size + 1)
        batches.append((rng.normal(0, 1, (batch_size, channels, height, width)).astype(np.float32),
                        rng.integers(0, num_classes, batch_size).astype(np.int32),
                        np.asarray(jnp.array(subkeys))))
    return batches


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(learning_rate=lr, b1=beta1, b2=beta2),
    # a large step so that a wrongly scaled gradient shows far beyond the tolerance
    "sgd": lambda: optax.sgd(0.5),
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", REPLICAS)
def test_equinox_vit_train(n, opt):
    optimizer = OPTIMIZERS[opt]()
    model = make_model()
    state = eqx.filter_jit(optimizer.init)(eqx.filter(model, eqx.is_array))
    params, static = eqx.partition(model, eqx.is_array)
    batches = trainloader()
    port = Port(step=make_step_model(static, optimizer), state=(params, state),
                inputs=lambda i: ((Split(batches[i][0]), Split(batches[i][1]),
                                   Split(batches[i][2])), {}),
                split_out=lambda out: (out[:2], out[2]))
    check_against_global(port, n, STEPS, what=f"ViT {opt}")


def make_eval(static):
    """The source's test loop for one batch: logits with dropout off, accuracy."""

    def evaluate(params, images, labels, key):
        model = eqx.combine(params, static)
        logits = jax.vmap(functools.partial(model, enable_dropout=False))(images, key=key)
        predictions = jnp.argmax(logits, axis=-1)
        accuracy = jnp.mean(predictions == labels)
        return logits, accuracy

    return evaluate


@pytest.mark.parametrize("n", REPLICAS)
def test_equinox_vit_inference(n):
    model = make_model()
    params, static = eqx.partition(model, eqx.is_array)
    images, labels, keys = trainloader(steps=1, seed=1)[0]
    evaluate = make_eval(static)

    with jax.default_device(jax.devices()[0]):
        want_logits, want_acc = jax.jit(evaluate)(params, images, labels, keys)
        # the oracle is not trivially dropout-free: with dropout on, the logits differ
        on = jax.jit(lambda p, x, k: jax.vmap(
            functools.partial(eqx.combine(p, static), enable_dropout=True))(x, key=k))(
            params, images, keys)
    assert not np.allclose(np.asarray(on), np.asarray(want_logits))

    step = rt.replicate(evaluate, num_replicas=n)
    logits, acc = step(params, rt.distribute(images, n), rt.distribute(labels, n),
                       rt.distribute(keys, n))
    assert isinstance(logits, rt.PerReplica)
    got_logits = np.concatenate([np.asarray(v) for v in logits.values])
    np.testing.assert_allclose(got_logits, np.asarray(want_logits), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(rt.reduce("mean", acc)), float(want_acc), rtol=1e-6)
