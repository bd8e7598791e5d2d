"""Port of google/flax examples/nlp_seq (train.py, models.py; the sentence format of
input_pipeline.py): a Transformer encoder tagging each word of a sentence with its
part of speech (Universal Dependencies XPOS), trained with ``jax.pmap``.

Kept from the source: ``TransformerConfig``, ``sinusoidal_init``, ``AddPositionEmbs``,
``MlpBlock`` (elu), ``Encoder1DBlock`` (no attention mask: padding is only in the loss's
weights), ``Transformer(inputs=, train=)``; ``create_learning_rate_scheduler`` ('constant
* linear_warmup * rsqrt_decay'), ``compute_weighted_cross_entropy``,
``compute_weighted_accuracy``, ``compute_metrics`` (with its ``np.sum(metrics, -1)``, the
identity on a dict); ``train_step``: weights ``targets > 0``, ``dropout_rng =
fold_in(dropout_rng, state.step)``, each replica's mean loss ``loss / weight_sum``,
``lax.pmean(grads, 'batch')``; ``optax.adamw(b1=0.9, b2=0.98, eps=1e-9,
weight_decay=1e-1)``; the jitted ``initialize_variables`` on ``ones((max_len, 1))``;
the loop's ``dropout_rngs = random.split(rng, local_device_count())`` passed as
``dropout_rng=`` (``model`` and ``learning_rate_fn`` bound by ``functools.partial``,
``donate_argnums`` dropped); ``eval_step`` (a closure over ``model``, ``pmap(eval_step,
axis_name='batch')``), ``pad_examples`` for the last, short eval batch (zero rows) and the
host-side summary (metric sums over replicas and batches over the summed denominator).

Changed: the source's ``compute_metrics`` returns each replica's sums and its loop adds
them up on the host; the train step here returns them ``lax.psum``-ed over 'batch' (the
pmap form of wmt's and lm1b's ``compute_metrics``), while the eval step keeps the source's
per-replica sums, so both forms are compared. Sizes: 16 word forms, 8 tags, emb/qkv 16,
MLP 32, 2 heads, 1 layer, sentences of up to 8 tokens (ROOT first, 0 padding after),
warmup 2 steps (from step 1, past the warmup's zero learning rate).

Each replica normalizes its loss by its own token count before ``pmean``: with the
replicas' token counts uneven (the "dropout" case, source dropout rates) only pmap is the
oracle, and a step that normalized over the global batch would differ. With dropout off
and every replica holding the same token count (rows still unevenly padded, some rows
all padding) the step is also the global batch's: "global" is the oracle too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import struct
from flax.training import common_utils, train_state
from jax import random

from tests.clients._harness import (REPLICAS, Each, Port, Split, assert_trees_close, check_port,
                                    train)

FORMS, TAGS, MAX_LEN, GLOBAL_BATCH = 16, 8, 8, 16
PAD_ID, ROOT_ID = 0, 2  # input_pipeline.py


# -- models.py ------------------------------------------------------------------------
@struct.dataclass
class TransformerConfig:
    """Global hyperparameters used to minimize obnoxious kwarg plumbing."""

    vocab_size: int
    output_vocab_size: int
    dtype: Any = jnp.float32
    emb_dim: int = 512
    num_heads: int = 8
    num_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    max_len: int = 2048
    dropout_rate: float = 0.3
    attention_dropout_rate: float = 0.3
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)
    posemb_init: Callable | None = None


def sinusoidal_init(max_len=2048):
    """1D Sinusoidal Position Embedding Initializer."""

    def init(key, shape, dtype=np.float32):
        """Sinusoidal init."""
        del key, dtype
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        div_term = np.exp(np.arange(0, d_feature, 2) * -(np.log(10000.0) / d_feature))
        pe[:, 0::2] = np.sin(position * div_term)
        pe[:, 1::2] = np.cos(position * div_term)
        pe = pe[np.newaxis, :, :]  # [1, max_len, d_feature]
        return jnp.array(pe)

    return init


class AddPositionEmbs(nn.Module):
    """Adds (optionally learned) positional embeddings to the inputs."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        assert inputs.ndim == 3, ("Number of dimensions should be 3, but it is: %d"
                                  % inputs.ndim)
        length = inputs.shape[1]
        pos_emb_shape = (1, config.max_len, inputs.shape[-1])
        if config.posemb_init is None:
            # Use a fixed (non-learned) sinusoidal position embedding.
            pos_embedding = sinusoidal_init(max_len=config.max_len)(None, pos_emb_shape, None)
        else:
            pos_embedding = self.param("pos_embedding", config.posemb_init, pos_emb_shape)
        pe = pos_embedding[:, :length, :]
        return inputs + pe


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""

    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs, deterministic=True):
        config = self.config
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(config.mlp_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                     bias_init=config.bias_init)(inputs)
        x = nn.elu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=deterministic)
        output = nn.Dense(actual_out_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                          bias_init=config.bias_init)(x)
        output = nn.Dropout(rate=config.dropout_rate)(output, deterministic=deterministic)
        return output


class Encoder1DBlock(nn.Module):
    """Transformer encoder layer."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, deterministic):
        config = self.config

        # Attention block.
        assert inputs.ndim == 3
        x = nn.LayerNorm(dtype=config.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads, dtype=config.dtype, qkv_features=config.qkv_dim,
            kernel_init=config.kernel_init, bias_init=config.bias_init, use_bias=False,
            broadcast_dropout=False, dropout_rate=config.attention_dropout_rate,
            deterministic=deterministic)(x)

        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=deterministic)
        x = x + inputs

        # MLP block.
        y = nn.LayerNorm(dtype=config.dtype)(x)
        y = MlpBlock(config=config)(y, deterministic=deterministic)
        return x + y


class Transformer(nn.Module):
    """Transformer Model for sequence tagging."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, *, inputs, train):
        assert inputs.ndim == 2  # (batch, len)

        config = self.config

        x = inputs.astype("int32")
        x = nn.Embed(num_embeddings=config.vocab_size, features=config.emb_dim, name="embed")(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=not train)
        x = AddPositionEmbs(config)(x)

        for _ in range(config.num_layers):
            x = Encoder1DBlock(config)(x, deterministic=not train)

        x = nn.LayerNorm(dtype=config.dtype)(x)
        logits = nn.Dense(config.output_vocab_size, kernel_init=config.kernel_init,
                          bias_init=config.bias_init)(x)
        return logits


# -- train.py -------------------------------------------------------------------------
def create_learning_rate_scheduler(factors="constant * linear_warmup * rsqrt_decay",
                                   base_learning_rate=0.5, warmup_steps=8000,
                                   decay_factor=0.5, steps_per_decay=20000,
                                   steps_per_cycle=100000):
    """creates learning rate schedule."""
    factors = [n.strip() for n in factors.split("*")]

    def step_fn(step):
        """Step to learning rate function."""
        ret = 1.0
        for name in factors:
            if name == "constant":
                ret *= base_learning_rate
            elif name == "linear_warmup":
                ret *= jnp.minimum(1.0, step / warmup_steps)
            elif name == "rsqrt_decay":
                ret /= jnp.sqrt(jnp.maximum(step, warmup_steps))
            elif name == "rsqrt_normalized_decay":
                ret *= jnp.sqrt(warmup_steps)
                ret /= jnp.sqrt(jnp.maximum(step, warmup_steps))
            elif name == "decay_every":
                ret *= decay_factor ** (step // steps_per_decay)
            elif name == "cosine_decay":
                progress = jnp.maximum(0.0, (step - warmup_steps) / float(steps_per_cycle))
                ret *= jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * (progress % 1.0))))
            else:
                raise ValueError("Unknown factor %s." % name)
        return jnp.asarray(ret, dtype=jnp.float32)

    return step_fn


def compute_weighted_cross_entropy(logits, targets, weights=None):
    """Compute weighted cross entropy and entropy for log probs and targets."""
    if logits.ndim != targets.ndim + 1:
        raise ValueError("Incorrect shapes. Got shape %s logits and %s targets"
                         % (str(logits.shape), str(targets.shape)))
    onehot_targets = common_utils.onehot(targets, logits.shape[-1])
    loss = -jnp.sum(onehot_targets * nn.log_softmax(logits), axis=-1)
    normalizing_factor = onehot_targets.sum()
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()

    return loss.sum(), normalizing_factor


def compute_weighted_accuracy(logits, targets, weights=None):
    """Compute weighted accuracy for log probs and targets."""
    if logits.ndim != targets.ndim + 1:
        raise ValueError("Incorrect shapes. Got shape %s logits and %s targets"
                         % (str(logits.shape), str(targets.shape)))
    loss = jnp.equal(jnp.argmax(logits, axis=-1), targets)
    normalizing_factor = np.prod(logits.shape[:-1])
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()

    return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights):
    """Compute summary metrics."""
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights)
    acc, _ = compute_weighted_accuracy(logits, labels, weights)
    metrics = {"loss": loss, "accuracy": acc, "denominator": weight_sum}
    metrics = np.sum(metrics, -1)
    return metrics


def train_step(state, batch, model, learning_rate_fn, dropout_rng=None):
    """Perform a single training step."""
    train_keys = ["inputs", "targets"]
    (inputs, targets) = (batch.get(k, None) for k in train_keys)

    weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)

    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        """loss function used for training."""
        logits = model.apply({"params": params}, inputs=inputs, train=True,
                             rngs={"dropout": dropout_rng})
        loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights)

        mean_loss = loss / weight_sum
        return mean_loss, logits

    lr = learning_rate_fn(state.step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    grads = jax.lax.pmean(grads, "batch")
    new_state = state.apply_gradients(grads=grads)
    # the source returns each replica's sums (added up on the host); the pmap form:
    metrics = jax.lax.psum(compute_metrics(logits, targets, weights), "batch")
    metrics["learning_rate"] = lr

    return new_state, metrics


def pad_examples(x, desired_batch_size):
    """Expand batch to desired size by zeros with the shape of last slice."""
    batch_pad = desired_batch_size - x.shape[0]
    # Padding with zeros to avoid that they get counted in compute_metrics.
    return np.concatenate([x, np.tile(np.zeros_like(x[-1]), (batch_pad, 1))])


def summarize(metrics_all: list) -> dict:
    """The loop's summary: every metric summed (over batches and replicas, the leading
    axes of ``common_utils.get_metrics``) over the summed denominator."""
    metrics_all = common_utils.stack_forest(metrics_all)
    metrics_sums = jax.tree_util.tree_map(jnp.sum, metrics_all)
    denominator = metrics_sums.pop("denominator")
    return jax.tree_util.tree_map(lambda x: np.asarray(x / denominator), metrics_sums)


# -- the test ---------------------------------------------------------------------------
def sentences(lengths, rng) -> dict:
    """One padded batch as ``sentence_dataset_dict`` gives it: ROOT first in inputs and
    targets (``create_sentence_with_root``), word ids in [3, FORMS), tag ids in [3, TAGS),
    0 after each sentence's length (length 0: a row of padding)."""
    rows = len(lengths)
    inputs = rng.integers(3, FORMS, (rows, MAX_LEN)).astype(np.int32)
    targets = rng.integers(3, TAGS, (rows, MAX_LEN)).astype(np.int32)
    inputs[:, 0] = targets[:, 0] = ROOT_ID
    pad = np.arange(MAX_LEN)[None] >= np.asarray(lengths)[:, None]
    inputs[pad] = targets[pad] = PAD_ID
    return {"inputs": inputs, "targets": targets}


def train_batches(balanced: bool, seed: int = 0, steps: int = 2) -> list[dict]:
    """``balanced``: each pair of rows holds MAX_LEN tokens (lengths L and MAX_LEN - L, one
    row of a pair may be all padding), so every replica at 2 or 8 replicas holds the same
    token count. Otherwise the rows shorten along the batch: the first replicas hold many
    more tokens than the last (every replica at least one)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        if balanced:
            first = rng.permutation(np.arange(MAX_LEN + 1))[:GLOBAL_BATCH // 2]
            lengths = np.stack([first, MAX_LEN - first], 1).reshape(-1)
        else:
            lengths = np.clip(MAX_LEN - np.arange(GLOBAL_BATCH) // 2
                              + rng.integers(-1, 1, GLOBAL_BATCH), 1, MAX_LEN)
            lengths[-3] = 0  # a row of padding
        out.append(sentences(lengths, rng))
    return out


def make_model(dropout: bool):
    rate = 0.3 if dropout else 0.0
    config = TransformerConfig(vocab_size=FORMS, output_vocab_size=TAGS, emb_dim=16,
                               num_heads=2, num_layers=1, qkv_dim=16, mlp_dim=32,
                               max_len=MAX_LEN, dropout_rate=rate, attention_dropout_rate=rate)
    model = Transformer(config)

    @jax.jit
    def initialize_variables(init_rng):
        init_batch = jnp.ones((config.max_len, 1), jnp.float32)
        init_variables = model.init(init_rng, inputs=init_batch, train=False)
        return init_variables

    rng = random.key(0)
    rng, init_rng = random.split(rng)
    return model, initialize_variables(init_rng), rng


@pytest.mark.parametrize("dropout", [True, False], ids=["dropout", "deterministic"])
@pytest.mark.parametrize("n", REPLICAS)
def test_nlp_seq_train(n, dropout):
    model, init_variables, rng = make_model(dropout)
    learning_rate_fn = create_learning_rate_scheduler(base_learning_rate=0.05, warmup_steps=2)
    optimizer = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=1e-1)
    state = jax.jit(lambda params: train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optimizer))(init_variables["params"])
    state = state.replace(step=1)  # past the warmup's zero learning rate
    p_train_step = functools.partial(train_step, model=model, learning_rate_fn=learning_rate_fn)
    dropout_rngs = list(random.split(rng, n))
    batches = train_batches(balanced=not dropout)
    # with dropout each replica draws its own masks, and the replicas' token counts
    # differ (pmap is the oracle); without, one mirrored key (unused) and balanced counts
    key = Each(dropout_rngs) if dropout else dropout_rngs[0]
    port = Port(step=p_train_step, state=(state,),
                inputs=lambda i: ((Split(batches[i]),), {"dropout_rng": key}))
    check_port(port, n, oracle=not dropout, oracle_metrics=lambda m: m)


@pytest.mark.parametrize("n", REPLICAS)
def test_nlp_seq_eval(n):
    """``p_eval_step`` over the dev set: a full batch and a short last one padded with zero
    rows (whole replicas of padding at 8 replicas); per-replica metric sums as the source
    returns them, and the host summary equal to the global batch's."""
    model, init_variables, _ = make_model(dropout=False)
    params = init_variables["params"]

    def eval_step(params, batch):
        """Calculate evaluation metrics on a batch."""
        inputs, targets = batch["inputs"], batch["targets"]
        weights = jnp.where(targets > 0, 1.0, 0.0)
        logits = model.apply({"params": params}, inputs=inputs, train=False)
        return compute_metrics(logits, targets, weights)

    rng = np.random.default_rng(1)
    full = sentences(rng.integers(1, MAX_LEN + 1, GLOBAL_BATCH), rng)
    short = sentences(rng.integers(1, MAX_LEN + 1, 5), rng)
    eval_batches = [full, jax.tree_util.tree_map(lambda x: pad_examples(x, GLOBAL_BATCH), short)]
    # the Port's state is the mirrored params, passed through unchanged
    port = Port(step=lambda params, batch: (params, eval_step(params, batch)), state=(params,),
                inputs=lambda i: ((Split(eval_batches[i]),), {}))
    _, p_metrics = train(port, "pmap", n)
    _, r_metrics = train(port, "replicate", n)
    _, g_metrics = train(port, "global", 1)
    for i, (rm, pm) in enumerate(zip(r_metrics, p_metrics)):
        assert_trees_close(rm, pm, f"N={n} eval batch {i} metrics, replicate vs pmap")
    if n == 8:  # the padded batch's last replicas hold no token
        assert np.all(r_metrics[1]["denominator"][3:] == 0), r_metrics[1]["denominator"]
    assert_trees_close(summarize(r_metrics), summarize(g_metrics),
                       f"N={n} eval summary, replicate vs global jit")
