"""Port of google/flax examples/wmt/train.py and examples/wmt/models.py (pmap version).

Kept from the source: the encoder-decoder ``Transformer`` (``TransformerConfig``,
``shift_right``, ``sinusoidal_init``, ``AddPositionEmbs``, ``MlpBlock``, ``Encoder1DBlock``,
``EncoderDecoder1DBlock``, ``Encoder``, ``Decoder``, padding and causal masks), dropout and
attention dropout in training; ``compute_weighted_cross_entropy`` with label smoothing,
``compute_weighted_accuracy``, ``compute_metrics`` (``lax.psum`` over 'batch');
``train_step`` with ``dropout_rng = fold_in(dropout_rng, state.step)``, the per-replica
mean loss, ``lax.pmean(grads, 'batch')``; the rsqrt schedule with linear warmup and
``optax.adamw``. The loop's ``dropout_rngs = jax.random.split(rng, n)`` gives each replica
its own dropout key, passed as a keyword argument (``p_train_step(state, batch,
dropout_rng=dropout_rngs)``; ``config``, ``learning_rate_fn`` and ``label_smoothing``
bound with ``functools.partial``, ``donate_argnums`` dropped). The decode cache path is
not ported. Sizes: vocab 16, emb 16, 2 heads, 1 layer, length 6.

Each replica draws its own dropout masks, so there is no global-batch oracle: replicate
must equal pmap.
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

from tests.clients._harness import REPLICAS, Each, Port, Split, check_port, make_keys

VOCAB = 16
LENGTH = 6
GLOBAL_BATCH = 8


@struct.dataclass
class TransformerConfig:
    """Global hyperparameters used to minimize obnoxious kwarg plumbing."""
    vocab_size: int
    output_vocab_size: int
    share_embeddings: bool = False
    logits_via_embedding: bool = False
    dtype: Any = jnp.float32
    emb_dim: int = 512
    num_heads: int = 8
    num_layers: int = 6
    qkv_dim: int = 512
    mlp_dim: int = 2048
    max_len: int = 2048
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x, axis=1):
    """Shift the input to the right by padding on axis 1."""
    pad_widths = [(0, 0)] * len(x.shape)
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return padded[:, :-1]


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
    """1D Sinusoidal Position Embedding Initializer."""

    def init(key, shape, dtype=np.float32):
        del key, dtype
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
        div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
        pe[:, : d_feature // 2] = np.sin(position * div_term)
        pe[:, d_feature // 2: 2 * (d_feature // 2)] = np.cos(position * div_term)
        return jnp.array(pe[np.newaxis, :, :])  # [1, max_len, d_feature]

    return init


class AddPositionEmbs(nn.Module):
    """Adds fixed sinusoidal positional embeddings to the inputs."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, inputs_positions=None):
        config = self.config
        length = inputs.shape[1]
        pos_emb_shape = (1, config.max_len, inputs.shape[-1])
        pos_embedding = sinusoidal_init(max_len=config.max_len)(None, pos_emb_shape, None)
        pe = pos_embedding[:, :length, :]
        if inputs_positions is None:
            return inputs + pe
        return inputs + jnp.take(pe[0], inputs_positions, axis=0)


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""
    config: TransformerConfig
    out_dim: int | None = None

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        actual_out_dim = inputs.shape[-1] if self.out_dim is None else self.out_dim
        x = nn.Dense(config.mlp_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                     bias_init=config.bias_init)(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        output = nn.Dense(actual_out_dim, dtype=config.dtype, kernel_init=config.kernel_init,
                          bias_init=config.bias_init)(x)
        return nn.Dropout(rate=config.dropout_rate)(output, deterministic=config.deterministic)


def _attention(config):
    return nn.MultiHeadDotProductAttention(
        num_heads=config.num_heads, dtype=config.dtype, qkv_features=config.qkv_dim,
        kernel_init=config.kernel_init, bias_init=config.bias_init, use_bias=False,
        broadcast_dropout=False, dropout_rate=config.attention_dropout_rate,
        deterministic=config.deterministic)


class Encoder1DBlock(nn.Module):
    """Transformer encoder layer."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, encoder_mask=None):
        config = self.config
        x = nn.LayerNorm(dtype=config.dtype)(inputs)
        x = _attention(config)(x, mask=encoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs
        y = nn.LayerNorm(dtype=config.dtype)(x)
        y = MlpBlock(config=config)(y)
        return x + y


class EncoderDecoder1DBlock(nn.Module):
    """Transformer encoder-decoder layer."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, targets, encoded, decoder_mask=None, encoder_decoder_mask=None):
        config = self.config
        x = nn.LayerNorm(dtype=config.dtype)(targets)
        x = _attention(config)(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + targets
        y = nn.LayerNorm(dtype=config.dtype)(x)
        y = _attention(config)(y, encoded, mask=encoder_decoder_mask)
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y + x
        z = nn.LayerNorm(dtype=config.dtype)(y)
        z = MlpBlock(config=config)(z)
        return y + z


class Encoder(nn.Module):
    """Transformer Model Encoder for sequence to sequence translation."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, inputs_positions=None, encoder_mask=None):
        config = self.config
        input_embed = nn.Embed(num_embeddings=config.vocab_size, features=config.emb_dim,
                               embedding_init=nn.initializers.normal(stddev=1.0))
        x = input_embed(inputs.astype("int32"))
        x = AddPositionEmbs(config=config, name="posembed_input")(
            x, inputs_positions=inputs_positions)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x.astype(config.dtype)
        for lyr in range(config.num_layers):
            x = Encoder1DBlock(config=config, name=f"encoderblock_{lyr}")(x, encoder_mask)
        return nn.LayerNorm(dtype=config.dtype, name="encoder_norm")(x)


class Decoder(nn.Module):
    """Transformer Model Decoder for sequence to sequence translation."""
    config: TransformerConfig

    @nn.compact
    def __call__(self, encoded, targets, targets_positions=None, decoder_mask=None,
                 encoder_decoder_mask=None):
        config = self.config
        output_embed = nn.Embed(num_embeddings=config.output_vocab_size,
                                features=config.emb_dim,
                                embedding_init=nn.initializers.normal(stddev=1.0))
        y = shift_right(targets.astype("int32"))
        y = output_embed(y)
        y = AddPositionEmbs(config=config, name="posembed_output")(
            y, inputs_positions=targets_positions)
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y.astype(config.dtype)
        for lyr in range(config.num_layers):
            y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{lyr}")(
                y, encoded, decoder_mask=decoder_mask,
                encoder_decoder_mask=encoder_decoder_mask)
        y = nn.LayerNorm(dtype=config.dtype, name="encoderdecoder_norm")(y)
        return nn.Dense(config.output_vocab_size, dtype=config.dtype,
                        kernel_init=config.kernel_init, bias_init=config.bias_init,
                        name="logitdense")(y)


class Transformer(nn.Module):
    """Transformer Model for sequence to sequence translation."""
    config: TransformerConfig

    def setup(self):
        self.encoder = Encoder(config=self.config)
        self.decoder = Decoder(config=self.config)

    def encode(self, inputs, inputs_positions=None):
        config = self.config
        encoder_mask = nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype)
        return self.encoder(inputs, inputs_positions=inputs_positions,
                            encoder_mask=encoder_mask)

    def decode(self, encoded, inputs, targets, targets_positions=None):
        config = self.config
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(targets > 0, targets > 0, dtype=config.dtype),
            nn.make_causal_mask(targets, dtype=config.dtype))
        encoder_decoder_mask = nn.make_attention_mask(targets > 0, inputs > 0,
                                                      dtype=config.dtype)
        logits = self.decoder(encoded, targets, targets_positions=targets_positions,
                              decoder_mask=decoder_mask,
                              encoder_decoder_mask=encoder_decoder_mask)
        return logits.astype(self.config.dtype)

    def __call__(self, inputs, targets, inputs_positions=None, targets_positions=None):
        encoded = self.encode(inputs, inputs_positions=inputs_positions)
        return self.decode(encoded, inputs, targets, targets_positions=targets_positions)


def rsqrt_schedule(init_value, shift=0):
    def schedule(count):
        return init_value * (count + shift) ** -0.5 * shift**0.5
    return schedule


def create_learning_rate_schedule(learning_rate, warmup_steps):
    """Creates a rsqrt schedule with linear warmup."""
    return optax.join_schedules(
        [optax.linear_schedule(init_value=0, end_value=learning_rate,
                               transition_steps=warmup_steps),
         rsqrt_schedule(init_value=learning_rate, shift=warmup_steps)],
        boundaries=[warmup_steps])


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    """Compute weighted cross entropy and entropy for log probs and targets."""
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(confidence * jnp.log(confidence) + (vocab_size - 1)
                             * low_confidence * jnp.log(low_confidence + 1e-20))
    soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence,
                                       off_value=low_confidence)
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_weighted_accuracy(logits, targets, weights=None):
    """Compute weighted accuracy for log probs and targets."""
    loss = jnp.equal(jnp.argmax(logits, axis=-1), targets)
    normalizing_factor = np.prod(logits.shape[:-1])
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
    """Compute summary metrics."""
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights,
                                                      label_smoothing)
    acc, _ = compute_weighted_accuracy(logits, labels, weights)
    metrics = {"loss": loss, "accuracy": acc, "denominator": weight_sum}
    return jax.lax.psum(metrics, axis_name="batch")


def train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0,
               dropout_rng=None):
    """Perform a single training step."""
    train_keys = ["inputs", "targets", "inputs_position", "targets_position"]
    (inputs, targets, inputs_positions, targets_positions) = (
        batch.get(k, None) for k in train_keys)
    weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        """loss function used for training."""
        logits = Transformer(config).apply(
            {"params": params}, inputs, targets, inputs_positions=inputs_positions,
            targets_positions=targets_positions, rngs={"dropout": dropout_rng})
        loss, weight_sum = compute_weighted_cross_entropy(logits, targets, weights,
                                                          label_smoothing)
        mean_loss = loss / weight_sum
        return mean_loss, logits

    step = state.step
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    grads = jax.lax.pmean(grads, axis_name="batch")
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(logits, targets, weights)
    metrics["learning_rate"] = learning_rate_fn(step)
    return new_state, metrics


def get_batches(seed=0, steps=2):
    """Token ids in [1, VOCAB) with trailing padding (0), as the packed-free pipeline
    gives; positions as the packing pipeline gives."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        b = {}
        for key in ("inputs", "targets"):
            ids = rng.integers(1, VOCAB, (GLOBAL_BATCH, LENGTH)).astype(np.int32)
            lengths = rng.integers(2, LENGTH + 1, GLOBAL_BATCH)
            ids[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
            b[key] = ids
            b[key[:-1] + "_position"] = np.tile(np.arange(LENGTH, dtype=np.int32),
                                                (GLOBAL_BATCH, 1))
        out.append(b)
    return out


@pytest.mark.parametrize("n", REPLICAS)
def test_wmt_transformer(n):
    train_config = TransformerConfig(
        vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=16, num_heads=2, num_layers=1,
        qkv_dim=16, mlp_dim=32, max_len=LENGTH, dropout_rate=0.1,
        attention_dropout_rate=0.1)
    init_config = train_config.replace(deterministic=True)
    m = Transformer(init_config)
    initial_variables = jax.jit(m.init)(
        jax.random.key(0), jnp.ones((1, LENGTH), jnp.int32), jnp.ones((1, LENGTH), jnp.int32))
    learning_rate_fn = create_learning_rate_schedule(learning_rate=0.01, warmup_steps=2)
    optimizer = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0)
    state = jax.jit(lambda params: train_state.TrainState.create(
        apply_fn=m.apply, params=params, tx=optimizer))(initial_variables["params"])
    state = state.replace(step=1)   # past the warmup's zero learning rate
    batches = get_batches()
    dropout_rngs = make_keys(1, n)  # jax.random.split(rng, jax.local_device_count())
    p_train_step = functools.partial(train_step, config=train_config,
                                     learning_rate_fn=learning_rate_fn, label_smoothing=0.1)
    port = Port(step=p_train_step, state=(state,),
                inputs=lambda i: ((Split(batches[i]),), {"dropout_rng": Each(dropout_rngs)}))
    check_port(port, n, oracle=False)
