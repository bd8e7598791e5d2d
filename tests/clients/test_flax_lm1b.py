"""Port of google/flax examples/lm1b (train.py, models.py, temperature_sampler.py; the
packed-example format of input_pipeline.py): a decoder-only Transformer language model.

The source's train.py moved from ``jax.pmap`` to ``jax.jit`` with a mesh in flax commit
558be01e ("updated lm1b example with jit"); its step functions are ported from the last
pmap version (the parent commit, fd8fd76a): ``train_step`` with ``lax.pmean(grads,
'batch')`` and ``compute_metrics`` ``lax.psum``-ing its sums over 'batch', run as
``pmap(partial(train_step, config=train_config, learning_rate_fn=learning_rate_fn),
axis_name='batch')`` with ``dropout_rng=dropout_rngs``, ``dropout_rngs =
random.split(rng, local_device_count())`` (typed keys), ``donate_argnums`` dropped;
``p_eval_step = pmap(partial(eval_step, config=eval_config), axis_name='batch')`` and
``evaluate``'s summary; ``p_pred_step`` (``predict_step`` with ``temperature_sample``,
``static_broadcasted_argnums=(3, 4)``) and ``generate_prediction``'s loop: the prompts in
chunks of ``n_devices``, the last padded with ``pad_examples``, one ``inference_rngs`` split
per chunk. models.py is the current one less its ``nn.with_logical_partitioning``
annotations (the jit version's; the pmap version's initializers are the plain ones):
``shift_right``, ``shift_inputs`` (a packed sequence's first token sees 0, not the previous
sequence's EOS), ``sinusoidal_init``, ``AddPositionEmbs`` (``inputs_positions`` of packed
examples, the decode cache index), ``MlpBlock``, ``EncoderDecoder1DBlock``, ``Decoder``,
``TransformerLM`` (padding, causal and segmentation masks). Kept from train.py:
``rsqrt_schedule``, ``create_learning_rate_schedule`` (linear warmup then rsqrt),
``compute_weighted_cross_entropy`` (label smoothing), ``compute_weighted_accuracy``,
``optax.adamw(b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)``, the jitted ``m.init`` on
``ones((per_device_batch_size, max_target_length))``.

Sizes: vocabulary 32 (0 padding, 2 EOS), emb/qkv 16, MLP 32, 2 heads, 1 layer, training
rows of 12 tokens packing 1 to 4 sequences each (``inputs_position``,
``inputs_segmentation``), rows fuller at the front of the batch than at the back (the
replicas' token counts differ); warmup 2 steps, from step 1 (past the warmup's zero
learning rate). Training draws per-replica dropout and prediction per-replica samples,
so pmap is their oracle; the deterministic eval step is also checked against the
global batch on one device.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import struct
from flax.training import common_utils, train_state
from jax import lax, random

from tests.clients._harness import (REPLICAS, Each, Port, Split, assert_trees_close, check_port,
                                    train)

VOCAB, LENGTH, GLOBAL_BATCH = 32, 12, 16
EOS_ID = 2  # temperature_sampler.EOS_ID


# -- models.py ------------------------------------------------------------------------
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
    decode: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)
    posemb_init: Optional[Callable] = None


def shift_right(x, axis=1):
    """Shift the input to the right by padding and slicing on axis."""
    pad_widths = [(0, 0)] * len(x.shape)
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def shift_inputs(x, segment_ids=None, axis=1):
    """Shift inputs and replace EOS by 0 for packed inputs."""
    shifted = shift_right(x, axis=axis)
    # For packed targets, the first shifted token of a new sequence is made
    # 0, rather than being the EOS token for the last sequence.
    if segment_ids is not None:
        shifted *= segment_ids == shift_right(segment_ids, axis=axis)
    return shifted


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
    """1D Sinusoidal Position Embedding Initializer."""

    def init(key, shape, dtype=np.float32):
        """Sinusoidal init."""
        del key, dtype
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
        div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
        pe[:, : d_feature // 2] = np.sin(position * div_term)
        pe[:, d_feature // 2: 2 * (d_feature // 2)] = np.cos(position * div_term)
        pe = pe[np.newaxis, :, :]  # [1, max_len, d_feature]
        return jnp.array(pe)

    return init


class AddPositionEmbs(nn.Module):
    """Adds (optionally learned) positional embeddings to the inputs."""

    config: TransformerConfig
    decode: bool = False

    @nn.compact
    def __call__(self, inputs, inputs_positions=None):
        config = self.config
        # inputs.shape is (batch_size, seq_len, emb_dim)
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

        # We use a cache position index for tracking decoding position.
        if self.decode:
            is_initialized = self.has_variable("cache", "cache_index")
            cache_index = self.variable("cache", "cache_index",
                                        lambda: jnp.array(0, dtype=jnp.uint32))
            if is_initialized:
                i = cache_index.value
                cache_index.value = i + 1
                _, _, df = pos_embedding.shape
                pe = lax.dynamic_slice(pos_embedding, jnp.array((0, i, 0)), (1, 1, df))
        if inputs_positions is None:
            # normal unpacked case:
            return inputs + pe
        else:
            # for packed data we need to use known position indices:
            return inputs + jnp.take(pe[0], inputs_positions, axis=0)


class MlpBlock(nn.Module):
    """Transformer MLP / feed-forward block."""

    config: TransformerConfig
    out_dim: Optional[int] = None

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
        output = nn.Dropout(rate=config.dropout_rate)(output,
                                                      deterministic=config.deterministic)
        return output


class EncoderDecoder1DBlock(nn.Module):
    """Transformer encoder-decoder layer."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None, encoder_decoder_mask=None):
        config = self.config

        # Decoder block.
        assert inputs.ndim == 3
        x = nn.LayerNorm(dtype=config.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads, dtype=config.dtype, qkv_features=config.qkv_dim,
            kernel_init=config.kernel_init, bias_init=config.bias_init, use_bias=False,
            broadcast_dropout=False, dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic, decode=config.decode)(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs

        # MLP block.
        z = nn.LayerNorm(dtype=config.dtype)(x)
        z = MlpBlock(config=config)(z)

        return x + z


class Decoder(nn.Module):
    """Transformer Model Decoder for sequence to sequence translation."""

    config: TransformerConfig
    shared_embedding: Any = None

    @nn.compact
    def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None,
                 decoder_mask=None, encoder_decoder_mask=None):
        config = self.config
        assert inputs.ndim == 2  # (batch, len)

        # Target Embedding
        if self.shared_embedding is None:
            output_embed = nn.Embed(num_embeddings=config.output_vocab_size,
                                    features=config.emb_dim,
                                    embedding_init=nn.initializers.normal(stddev=1.0))
        else:
            output_embed = self.shared_embedding

        y = inputs.astype("int32")
        if not config.decode:
            y = shift_inputs(y, segment_ids=inputs_segmentation)
        y = output_embed(y)
        y = AddPositionEmbs(config=config, decode=config.decode, name="posembed_output")(
            y, inputs_positions=inputs_positions)
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)

        y = y.astype(config.dtype)

        # Target-Input Decoder
        for lyr in range(config.num_layers):
            y = EncoderDecoder1DBlock(config=config, name=f"encoderdecoderblock_{lyr}")(
                y, decoder_mask=decoder_mask, encoder_decoder_mask=encoder_decoder_mask)
        y = nn.LayerNorm(dtype=config.dtype, name="encoderdecoder_norm")(y)

        # Decoded Logits
        if config.logits_via_embedding:
            # Use the transpose of embedding matrix for logit transform.
            logits = output_embed.attend(y.astype(jnp.float32))
            # Correctly normalize pre-softmax logits for this shared case.
            logits = logits / jnp.sqrt(y.shape[-1])
        else:
            logits = nn.Dense(config.output_vocab_size, dtype=config.dtype,
                              kernel_init=config.kernel_init, bias_init=config.bias_init,
                              name="logitdense")(y)
        return logits


class TransformerLM(nn.Module):
    """Transformer pure decoder stack for language modelling."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None):
        config = self.config

        # Make padding attention masks.
        if config.decode:
            # for fast autoregressive decoding we use no decoder mask
            decoder_mask = None
        else:
            decoder_mask = nn.combine_masks(
                nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
                nn.make_causal_mask(inputs, dtype=config.dtype))

        # Add segmentation block-diagonal attention masks if using segmented data.
        if inputs_segmentation is not None:
            decoder_mask = nn.combine_masks(
                decoder_mask,
                nn.make_attention_mask(inputs_segmentation, inputs_segmentation, jnp.equal,
                                       dtype=config.dtype))

        logits = Decoder(config=config, shared_embedding=None, name="decoder")(
            inputs, inputs_positions=inputs_positions, inputs_segmentation=inputs_segmentation,
            decoder_mask=decoder_mask, encoder_decoder_mask=None)
        return logits.astype(self.config.dtype)


# -- temperature_sampler.py -------------------------------------------------------------
def temperature_sample(prompt_inputs, init_cache, tokens_to_logits, prng_key,
                       temperature=1.0, topk=20, eos_token=EOS_ID):
    """Temperature sampling for language model generation."""
    batch_size = prompt_inputs.shape[0]
    max_decode_len = prompt_inputs.shape[1]
    end_marker = jnp.array(eos_token)
    temperature = jnp.array(temperature)

    # Initialize sampling loop state.
    # initial loop PRNGKey
    rng0 = prng_key
    # loop position counter.
    i0 = jnp.array(-1)
    # per batch-item holding current token in loop.
    token0 = jnp.zeros((batch_size, 1), dtype=jnp.int32)
    # per batch-item state bit indicating if sentence has finished.
    ended0 = jnp.zeros((batch_size, 1), dtype=jnp.bool_)
    # (batch, length) array containing prefix prompt tokens for sampling loop
    # as well as the generated output of newly sampled tokens.
    sequences0 = prompt_inputs
    # Sampling loop state is stored in a simple tuple.
    sampling_loop_init_state = (i0, sequences0, init_cache, token0, ended0, rng0)

    def sampling_loop_cond_fn(state):
        """Sampling loop termination condition."""
        (i, _, _, _, ended, _) = state
        # Have we reached max decoding length?
        not_at_end = i < max_decode_len - 1
        # Have all sampled sequences reached an end marker?
        all_sequences_ended = jnp.all(ended)
        return not_at_end & (~all_sequences_ended)

    def sampling_loop_body_fn(state):
        """Sampling loop state update."""
        i, sequences, cache, cur_token, ended, rng = state
        # Split RNG for sampling.
        rng1, rng2 = random.split(rng)
        # Call fast-decoder model on current tokens to get next-position logits.
        logits, new_cache = tokens_to_logits(cur_token, cache)
        # Sample next token from logits.
        if topk:
            # Get top-k logits and their indices, sample within these top-k tokens.
            topk_logits, topk_idxs = lax.top_k(logits, topk)
            topk_token = jnp.expand_dims(
                random.categorical(rng1, topk_logits / temperature).astype(jnp.int32),
                axis=-1)
            # Return the original indices corresponding to the sampled top-k tokens.
            next_token = jnp.squeeze(jnp.take_along_axis(topk_idxs, topk_token, axis=-1),
                                     axis=-1)
        else:
            next_token = random.categorical(rng1, logits / temperature).astype(jnp.int32)
        # Only use sampled tokens if we're past provided prefix tokens.
        out_of_prompt = sequences[:, i + 1] == 0
        next_token = next_token * out_of_prompt + sequences[:, i + 1] * ~out_of_prompt
        # If end-marker reached for batch item, only emit padding tokens.
        next_token_or_endpad = next_token[None] * ~ended
        ended |= next_token_or_endpad == end_marker
        # Add current sampled tokens to recorded sequences.
        new_sequences = lax.dynamic_update_slice(sequences, next_token_or_endpad, (0, i + 1))
        return (i + 1, new_sequences, new_cache, next_token_or_endpad, ended, rng2)

    # Run sampling loop and collect final state.
    final_state = lax.while_loop(sampling_loop_cond_fn, sampling_loop_body_fn,
                                 sampling_loop_init_state)

    # Pick part of the state corresponding to the sampled sequences.
    final_sequences = final_state[1]
    return final_sequences


# -- train.py (the pmap version, fd8fd76a) ------------------------------------------------
def rsqrt_schedule(init_value: float, shift: int = 0):
    """Applies a reverse square-root schedule."""

    def schedule(count):
        return init_value * (count + shift) ** -0.5 * shift**0.5

    return schedule


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int):
    """Creates a rsqrt schedule with linear warmup."""
    return optax.join_schedules(
        [optax.linear_schedule(init_value=0, end_value=learning_rate,
                               transition_steps=warmup_steps),
         rsqrt_schedule(init_value=learning_rate, shift=warmup_steps)],
        boundaries=[warmup_steps])


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    """Compute weighted cross entropy and entropy for log probs and targets."""
    if logits.ndim != targets.ndim + 1:
        raise ValueError("Incorrect shapes. Got shape %s logits and %s targets"
                         % (str(logits.shape), str(targets.shape)))
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
    if logits.ndim != targets.ndim + 1:
        raise ValueError("Incorrect shapes. Got shape %s logits and %s targets"
                         % (str(logits.shape), str(targets.shape)))
    loss = jnp.equal(jnp.argmax(logits, axis=-1), targets)
    normalizing_factor = np.prod(logits.shape[:-1])
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()

    return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
    """Compute summary metrics."""
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    acc, _ = compute_weighted_accuracy(logits, labels, weights)
    metrics = {"loss": loss, "accuracy": acc, "denominator": weight_sum}
    metrics = jax.lax.psum(metrics, axis_name="batch")
    return metrics


def train_step(state, batch, config, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
    """Perform a single training step."""
    # X_position and X_segmentation are needed only when using "packed examples"
    # where multiple sequences are packed into the same example with this
    # metadata.
    # if such features are not present they are ignored and the example is treated
    # like a normal, unpacked sequence example.
    train_keys = ["inputs", "inputs_position", "inputs_segmentation"]
    (inputs, inputs_positions, inputs_segmentation) = (batch.get(k, None) for k in train_keys)

    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)

    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        """loss function used for training."""
        logits = TransformerLM(config).apply(
            {"params": params}, inputs, inputs_positions=inputs_positions,
            inputs_segmentation=inputs_segmentation, rngs={"dropout": dropout_rng})

        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights,
                                                          label_smoothing)
        mean_loss = loss / weight_sum
        return mean_loss, logits

    step = state.step
    lr = learning_rate_fn(step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    grads = jax.lax.pmean(grads, "batch")
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(logits, inputs, weights)
    metrics["learning_rate"] = lr

    return new_state, metrics


def eval_step(params, batch, config, label_smoothing=0.0):
    """Calculate evaluation metrics on a batch."""
    inputs = batch["inputs"]
    weights = jnp.where(inputs > 0, 1.0, 0.0)
    logits = TransformerLM(config).apply({"params": params}, inputs)

    return compute_metrics(logits, inputs, weights, label_smoothing)


def predict_step(inputs, params, rngkey, eos_id, max_decode_len, config, temperature, top_k):
    """Predict language model on a batch."""
    target_shape = (inputs.shape[0], max_decode_len) + inputs.shape[2:]
    initial_variables = TransformerLM(config).init(
        jax.random.key(0), jnp.ones(target_shape, config.dtype))
    cache = initial_variables["cache"]

    def tokens_ids_to_logits(flat_ids, flat_cache):
        """Token slice to logits from decoder model."""
        # --> [batch * beam, 1, vocab]
        flat_logits, new_vars = TransformerLM(config).apply(
            {"params": params, "cache": flat_cache}, flat_ids, mutable=["cache"])
        new_flat_cache = new_vars["cache"]
        # Remove singleton sequence-length dimension:
        # [batch, 1, vocab] --> [batch, vocab]
        flat_logits = flat_logits.squeeze(axis=1)
        return flat_logits, new_flat_cache

    # Using the above-defined single-step decoder function, run a
    # beam search over possible sequences given input encoding.
    seqs = temperature_sample(inputs, cache, tokens_ids_to_logits, rngkey,
                              temperature=temperature, topk=top_k, eos_token=eos_id)

    return seqs


def pad_examples(x, desired_batch_size):
    """Expand batch to desired size by repeating last slice."""
    batch_pad = desired_batch_size - x.shape[0]
    return np.concatenate([x, np.tile(x[-1], (batch_pad, 1))], axis=0)


def summarize(metrics_all: list) -> dict:
    """``evaluate``'s (and the training loop's) summary: the metric sums over batches
    (``common_utils.get_metrics`` stacks the replicas' copies of the psum'd sums, so the
    replica axis is dropped first) over the summed denominator."""
    metrics_all = common_utils.stack_forest([jax.tree_util.tree_map(lambda x: x[0], m)
                                             for m in metrics_all])
    metrics_sums = jax.tree_util.tree_map(jnp.sum, metrics_all)
    denominator = metrics_sums.pop("denominator")
    return jax.tree_util.tree_map(lambda x: np.asarray(x / denominator), metrics_sums)


# -- the test ---------------------------------------------------------------------------
def configs(dropout_rate=0.1):
    train_config = TransformerConfig(
        vocab_size=VOCAB, output_vocab_size=VOCAB, logits_via_embedding=False,
        dtype=jnp.float32, emb_dim=16, num_heads=2, num_layers=1, qkv_dim=16, mlp_dim=32,
        max_len=LENGTH, dropout_rate=dropout_rate, attention_dropout_rate=dropout_rate,
        deterministic=False, decode=False, kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6))
    eval_config = train_config.replace(deterministic=True)
    predict_config = train_config.replace(deterministic=True, decode=True)
    return train_config, eval_config, predict_config


def init_params(eval_config, per_device_batch_size=2):
    """``train_and_evaluate``'s initialization: returns the params and the rest of the
    seed's key (``rng``) and ``inference_rng``."""
    rng = jax.random.key(0)
    rng, init_rng = jax.random.split(rng)
    rng, inference_rng = random.split(rng)
    input_shape = (per_device_batch_size, LENGTH)
    m = TransformerLM(eval_config)
    initial_variables = jax.jit(m.init)(init_rng, jnp.ones(input_shape, jnp.float32))
    return m, initial_variables["params"], rng, inference_rng


def sequence(rng, length):
    """A tokenized sentence: ids in [3, VOCAB), EOS last (``TokenizeOp`` adds it)."""
    return list(rng.integers(3, VOCAB, length - 1)) + [EOS_ID]


def packed_batches(seed: int = 0, steps: int = 2) -> list[dict]:
    """What ``pack_dataset`` makes of sentences of 2..6 tokens: rows of LENGTH packing whole
    sentences, ``inputs_segmentation`` 1, 2, ... per sentence and 0 on padding,
    ``inputs_position`` counting from 0 in each sentence (0 on padding). Row r fills to at
    most LENGTH - r // 2 tokens, so the replicas at the back of the batch hold fewer."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        b = {k: np.zeros((GLOBAL_BATCH, LENGTH), np.int32)
             for k in ("inputs", "inputs_position", "inputs_segmentation")}
        for r in range(GLOBAL_BATCH):
            room, at, seg = LENGTH - r // 2, 0, 1
            while True:
                n = int(rng.integers(2, 7))
                if at + n > room:
                    if seg == 1:  # a row holds at least one sentence
                        n = room - at
                    else:
                        break
                b["inputs"][r, at:at + n] = sequence(rng, n)
                b["inputs_position"][r, at:at + n] = np.arange(n)
                b["inputs_segmentation"][r, at:at + n] = seg
                at, seg = at + n, seg + 1
        out.append(b)
    return out


@pytest.mark.parametrize("n", REPLICAS)
def test_lm1b_train(n):
    train_config, eval_config, _ = configs()
    m, params, rng, _ = init_params(eval_config)
    learning_rate_fn = create_learning_rate_schedule(learning_rate=0.0016, warmup_steps=2)
    optimizer = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    state = jax.jit(lambda params: train_state.TrainState.create(
        apply_fn=m.apply, params=params, tx=optimizer))(params)
    state = state.replace(step=1)  # past the warmup's zero learning rate
    p_train_step = functools.partial(train_step, config=train_config,
                                     learning_rate_fn=learning_rate_fn)
    # We init the first set of dropout PRNG keys, but update it afterwards inside
    # the main pmap"d training update for performance.
    dropout_rngs = jax.random.split(rng, n)
    batches = packed_batches()
    port = Port(step=p_train_step, state=(state,),
                inputs=lambda i: ((Split(batches[i]),),
                                  {"dropout_rng": Each(list(dropout_rngs))}))
    check_port(port, n, oracle=False)


@pytest.mark.parametrize("n", REPLICAS)
def test_lm1b_eval(n):
    """``evaluate`` with ``p_eval_step``: unpacked eval rows (``pack_examples=False``) of
    uneven length, the psum'd sums equal on every replica, and equal to the global batch's
    on one device, as is the summary."""
    _, eval_config, _ = configs()
    _, params, _, _ = init_params(eval_config)
    rng = np.random.default_rng(1)
    eval_batches = []
    for _ in range(2):
        inputs = np.zeros((GLOBAL_BATCH, LENGTH), np.int32)
        for r, length in enumerate(np.maximum(1, rng.integers(-4, LENGTH + 1, GLOBAL_BATCH))):
            inputs[r, :length] = sequence(rng, length) if length > 1 else [EOS_ID]
        eval_batches.append({"inputs": inputs})
    p_eval_step = functools.partial(eval_step, config=eval_config)
    # the Port's state is the mirrored params, passed through unchanged
    port = Port(step=lambda params, batch: (params, p_eval_step(params, batch)),
                state=(params,), inputs=lambda i: ((Split(eval_batches[i]),), {}))
    _, p_metrics = train(port, "pmap", n)
    _, r_metrics = train(port, "replicate", n)
    _, g_metrics = train(port, "global", 1)
    for i, (rm, pm, gm) in enumerate(zip(r_metrics, p_metrics, g_metrics)):
        assert_trees_close(rm, pm, f"N={n} eval batch {i} metrics, replicate vs pmap")
        want = jax.tree_util.tree_map(lambda x: np.broadcast_to(x, (n,) + x.shape[1:]), gm)
        assert_trees_close(rm, want, f"N={n} eval batch {i} metrics, replicate vs global jit")
    assert_trees_close(summarize(r_metrics), summarize(g_metrics),
                       f"N={n} eval summary, replicate vs global jit")


@pytest.mark.parametrize("n", REPLICAS)
def test_lm1b_predict(n):
    """``generate_prediction`` with ``p_pred_step``: 2n - 1 prompts in two chunks of n
    (the second padded by repeating its last prompt), one row per replica, each sampled
    with its replica's key in a ``while_loop`` over the decode cache that stops when the
    replica's rows reach EOS (at a different step on each replica)."""
    _, eval_config, predict_config = configs()
    _, params, _, inference_rng = init_params(eval_config)
    max_predict_length = LENGTH
    p_pred_step = functools.partial(predict_step, config=predict_config, temperature=0.6,
                                    top_k=20)
    rng = np.random.default_rng(2)
    tokenized_prompts = np.zeros((2 * n - 1, max_predict_length), np.int32)
    for i, length in enumerate(rng.integers(1, 4, 2 * n - 1)):
        tokenized_prompts[i, :length] = rng.integers(3, VOCAB, length)
    chunks = []
    for pred_batch in np.array_split(tokenized_prompts,
                                     int(np.ceil(len(tokenized_prompts) / n))):
        cur_pred_batch_size = pred_batch.shape[0]
        if cur_pred_batch_size % n:
            padded_size = int(np.ceil(cur_pred_batch_size / n) * n)
            pred_batch = pad_examples(pred_batch, padded_size)
        inference_rng, sub_rng = random.split(inference_rng)
        inference_rngs = random.split(sub_rng, n)
        chunks.append((pred_batch, list(inference_rngs)))
    assert len(chunks) == 2
    # p_pred_step(pred_batch, params, inference_rngs, eos_id, max_predict_length), its
    # static_broadcasted_argnums=(3, 4); the params are the Port's (unchanged) state
    port = Port(step=lambda params, batch, keys, eos_id, max_len:
                (params, p_pred_step(batch, params, keys, eos_id, max_len)),
                state=(params,), static_argnums=(3, 4),
                inputs=lambda i: ((Split(chunks[i][0]), Each(chunks[i][1]), EOS_ID,
                                   max_predict_length), {}))
    _, p_seqs = train(port, "pmap", n)
    _, r_seqs = train(port, "replicate", n)
    for i, (rs, ps) in enumerate(zip(r_seqs, p_seqs)):
        np.testing.assert_array_equal(rs, ps, err_msg=f"N={n} prediction chunk {i}")
    predicted = np.concatenate([s.reshape(n, -1) for s in p_seqs])
    assert (predicted[:, 3:] != 0).any(), "nothing was sampled"
