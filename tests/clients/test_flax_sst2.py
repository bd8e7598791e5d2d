"""Port of google/flax examples/sst2 (models.py and train.py's ``train_step``, at commit
18f8f311c275d57f46d95e41b15aa97b454754c0).

Kept from the source: ``TextClassifier`` (an ``Embedder`` with word dropout and dropout, a
bidirectional LSTM of two ``nn.scan``-ned ``OptimizedLSTMCell``s whose backward direction
runs over ``flip_sequences`` (a ``vmap`` of ``roll`` by each sequence's length), keys-only
MLP attention masked with ``-inf``, an MLP), ``sigmoid_cross_entropy_with_logits``,
``compute_metrics`` (sums over the batch) and ``create_train_state`` with
``optax.chain(sgd(momentum), add_decayed_weights)``. The source trains on one device with
``jax.jit``; ``train_step`` below is the pmap form of its ``train_step``: the gradients
averaged over the replicas, the metrics (sums) summed, each replica's dropout key its own.
Sizes: vocabulary 24, embeddings 8, hidden 8, sequences of 7 tokens with lengths 1..7.
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
from flax.training import train_state

from tests.clients._harness import REPLICAS, Each, Port, Split, check_port, make_keys

Array = jnp.ndarray
VOCAB, SEQ, GLOBAL_BATCH = 24, 7, 16


# -- models.py ------------------------------------------------------------------------
def sequence_mask(lengths: Array, max_length: int) -> Array:
    """Computes a boolean mask over sequence positions for each given length."""
    return jnp.arange(max_length)[None] < lengths[:, None]


@jax.vmap
def flip_sequences(inputs: Array, lengths: Array) -> Array:
    """Flips a sequence of inputs along the time dimension, keeping the padding at the
    end."""
    max_length = inputs.shape[0]
    return jnp.flip(jnp.roll(inputs, max_length - lengths, axis=0), axis=0)


class WordDropout(nn.Module):
    """Applies word dropout to a batch of input IDs."""

    dropout_rate: float
    unk_idx: int
    deterministic: bool | None = None

    @nn.compact
    def __call__(self, inputs: Array, deterministic: bool | None = None):
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.dropout_rate == 0.0:
            return inputs
        rng = self.make_rng("dropout")
        mask = jax.random.bernoulli(rng, p=self.dropout_rate, shape=inputs.shape)
        return jnp.where(mask, jnp.array([self.unk_idx]), inputs)


class Embedder(nn.Module):
    """Embeds batches of token IDs into feature space."""

    vocab_size: int
    embedding_size: int
    embedding_init: Callable[..., Array] = nn.initializers.normal(stddev=0.1)
    frozen: bool = False
    dropout_rate: float = 0.0
    word_dropout_rate: float = 0.0
    unk_idx: int | None = None
    deterministic: bool | None = None
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = self.param("embedding", self.embedding_init,
                                    (self.vocab_size, self.embedding_size), self.dtype)
        self.dropout_layer = nn.Dropout(rate=self.dropout_rate)
        self.word_dropout_layer = WordDropout(dropout_rate=self.word_dropout_rate,
                                              unk_idx=self.unk_idx)

    def __call__(self, inputs: Array, deterministic: bool | None = None) -> Array:
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        inputs = self.word_dropout_layer(inputs, deterministic=deterministic)
        embedded_inputs = self.embedding[inputs]
        if self.frozen:
            embedded_inputs = jax.lax.stop_gradient(embedded_inputs)
        return self.dropout_layer(embedded_inputs, deterministic=deterministic)


class SimpleLSTM(nn.Module):
    """A simple unidirectional LSTM."""

    hidden_size: int

    @functools.partial(nn.transforms.scan, variable_broadcast="params", in_axes=1,
                       out_axes=1, split_rngs={"params": False})
    @nn.compact
    def __call__(self, carry, x):
        return nn.OptimizedLSTMCell(self.hidden_size)(carry, x)

    def initialize_carry(self, input_shape):
        # Use fixed random key since default state init fn is just zeros.
        return nn.OptimizedLSTMCell(self.hidden_size, parent=None).initialize_carry(
            jax.random.key(0), input_shape)


class SimpleBiLSTM(nn.Module):
    """A simple bi-directional LSTM."""

    hidden_size: int

    def setup(self):
        self.forward_lstm = SimpleLSTM(self.hidden_size)
        self.backward_lstm = SimpleLSTM(self.hidden_size)

    def __call__(self, embedded_inputs, lengths):
        initial_state = self.forward_lstm.initialize_carry(embedded_inputs[:, 0].shape)
        _, forward_outputs = self.forward_lstm(initial_state, embedded_inputs)
        reversed_inputs = flip_sequences(embedded_inputs, lengths)
        initial_state = self.backward_lstm.initialize_carry(reversed_inputs[:, 0].shape)
        _, backward_outputs = self.backward_lstm(initial_state, reversed_inputs)
        backward_outputs = flip_sequences(backward_outputs, lengths)
        return jnp.concatenate([forward_outputs, backward_outputs], -1)


class MLP(nn.Module):
    """A simple Multilayer perceptron with 1 hidden layer."""

    hidden_size: int
    output_size: int
    activation: Callable[..., Any] = nn.tanh
    dropout_rate: float = 0.0
    output_bias: bool = False
    deterministic: bool | None = None

    def setup(self):
        self.intermediate_layer = nn.Dense(self.hidden_size)
        self.output_layer = nn.Dense(self.output_size, use_bias=self.output_bias)
        self.dropout_layer = nn.Dropout(rate=self.dropout_rate)

    def __call__(self, inputs: Array, deterministic: bool | None = None):
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        hidden = self.intermediate_layer(inputs)
        hidden = self.activation(hidden)
        hidden = self.dropout_layer(hidden, deterministic=deterministic)
        return self.output_layer(hidden)


class KeysOnlyMlpAttention(nn.Module):
    """MLP-based attention scores from the keys alone, masked and normalised."""

    hidden_size: int

    @nn.compact
    def __call__(self, keys: Array, mask: Array) -> Array:
        hidden = nn.Dense(self.hidden_size, name="keys", use_bias=False)(keys)
        energy = nn.tanh(hidden)
        scores = nn.Dense(1, name="energy", use_bias=False)(energy)
        scores = scores.squeeze(-1)
        scores = jnp.where(mask, scores, -jnp.inf)  # Using exp(-inf) = 0 below.
        scores = nn.softmax(scores, axis=-1)
        self.sow("intermediates", "attention", scores)
        return scores


class AttentionClassifier(nn.Module):
    """A classifier that uses attention to summarize the inputs."""

    hidden_size: int
    output_size: int
    dropout_rate: float = 0.0
    deterministic: bool | None = None

    def setup(self):
        self.dropout_layer = nn.Dropout(rate=self.dropout_rate)
        self.keys_only_mlp_attention = KeysOnlyMlpAttention(hidden_size=self.hidden_size)
        self.mlp = MLP(hidden_size=self.hidden_size, output_size=self.output_size,
                       output_bias=False, dropout_rate=self.dropout_rate)

    def __call__(self, encoded_inputs: Array, lengths: Array,
                 deterministic: bool | None = None) -> Array:
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        encoded_inputs = self.dropout_layer(encoded_inputs, deterministic=deterministic)
        mask = sequence_mask(lengths, encoded_inputs.shape[1])
        attention = self.keys_only_mlp_attention(encoded_inputs, mask)
        context = jnp.expand_dims(attention, 1) @ encoded_inputs
        context = context.squeeze(1)
        context = self.dropout_layer(context, deterministic=deterministic)
        return self.mlp(context, deterministic=deterministic)


class TextClassifier(nn.Module):
    """A Text Classification model."""

    embedding_size: int
    hidden_size: int
    vocab_size: int
    output_size: int
    dropout_rate: float
    word_dropout_rate: float
    unk_idx: int = 1
    deterministic: bool | None = None

    def setup(self):
        self.embedder = Embedder(vocab_size=self.vocab_size, embedding_size=self.embedding_size,
                                 dropout_rate=self.dropout_rate,
                                 word_dropout_rate=self.word_dropout_rate, unk_idx=self.unk_idx)
        self.encoder = SimpleBiLSTM(hidden_size=self.hidden_size)
        self.classifier = AttentionClassifier(hidden_size=self.hidden_size,
                                              output_size=self.output_size,
                                              dropout_rate=self.dropout_rate)

    def embed_token_ids(self, token_ids: Array, deterministic: bool | None = None) -> Array:
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        return self.embedder(token_ids, deterministic=deterministic)

    def logits_from_embedded_inputs(self, embedded_inputs: Array, lengths: Array,
                                    deterministic: bool | None = None) -> Array:
        deterministic = nn.module.merge_param("deterministic", self.deterministic, deterministic)
        encoded_inputs = self.encoder(embedded_inputs, lengths)
        return self.classifier(encoded_inputs, lengths, deterministic=deterministic)

    def __call__(self, token_ids: Array, lengths: Array,
                 deterministic: bool | None = None) -> Array:
        embedded_inputs = self.embed_token_ids(token_ids, deterministic=deterministic)
        return self.logits_from_embedded_inputs(embedded_inputs, lengths,
                                                deterministic=deterministic)


# -- train.py -------------------------------------------------------------------------
TrainState = train_state.TrainState


class Metrics(struct.PyTreeNode):
    """Computed metrics."""

    loss: Array
    accuracy: Array
    count: int | None = None


@jax.vmap
def sigmoid_cross_entropy_with_logits(*, labels: Array, logits: Array) -> Array:
    """Sigmoid cross entropy loss."""
    zeros = jnp.zeros_like(logits, dtype=logits.dtype)
    condition = logits >= zeros
    relu_logits = jnp.where(condition, logits, zeros)
    neg_abs_logits = jnp.where(condition, -logits, logits)
    return relu_logits - logits * labels + jnp.log1p(jnp.exp(neg_abs_logits))


def get_initial_params(rng, model):
    """Returns randomly initialized parameters."""
    token_ids = jnp.ones((2, 3), jnp.int32)
    lengths = jnp.ones((2,), dtype=jnp.int32)
    variables = model.init(rng, token_ids, lengths, deterministic=True)
    return variables["params"]


def create_train_state(rng, model, learning_rate=0.1, momentum=0.9, weight_decay=3e-6):
    """Create initial training state."""
    params = get_initial_params(rng, model)
    tx = optax.chain(optax.sgd(learning_rate=learning_rate, momentum=momentum),
                     optax.add_decayed_weights(weight_decay=weight_decay))
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def compute_metrics(*, labels: Array, logits: Array) -> Metrics:
    """Computes the metrics, summed across the batch if a batch is provided."""
    if labels.ndim == 1:  # Prevent the labels from broadcasting over the logits.
        labels = jnp.expand_dims(labels, axis=1)
    loss = sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
    binary_predictions = logits >= 0.0
    binary_accuracy = jnp.equal(binary_predictions, labels)
    return Metrics(loss=jnp.sum(loss), accuracy=jnp.sum(binary_accuracy),
                   count=logits.shape[0])


def train_step(state: TrainState, batch: dict[str, Array],
               rngs: dict[str, Any]) -> tuple[TrainState, Metrics]:
    """Train for a single step (pmap form: gradients averaged, metrics summed)."""
    step = state.step
    rngs = {name: jax.random.fold_in(rng, step) for name, rng in rngs.items()}

    def loss_fn(params):
        variables = {"params": params}
        logits = state.apply_fn(variables, batch["token_ids"], batch["length"],
                                deterministic=False, rngs=rngs)
        labels = batch["label"]
        if labels.ndim == 1:
            labels = jnp.expand_dims(labels, 1)
        loss = jnp.mean(sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))
        return loss, logits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    value, grads = grad_fn(state.params)
    (_, logits) = value
    grads = jax.lax.pmean(grads, axis_name="batch")
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(labels=batch["label"], logits=logits)
    return new_state, jax.lax.psum(metrics, axis_name="batch")


# -- the test ---------------------------------------------------------------------------
def sst2_batches(seed: int = 0, steps: int = 2) -> list[dict]:
    """Synthetic SST-2-shaped batches: token ids (0 padding, 1 unknown) padded after each
    sequence's length, lengths 1..SEQ, binary labels."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        length = rng.integers(1, SEQ + 1, GLOBAL_BATCH).astype(np.int32)
        ids = rng.integers(2, VOCAB, (GLOBAL_BATCH, SEQ)).astype(np.int32)
        ids[np.arange(SEQ)[None] >= length[:, None]] = 0
        out.append({"token_ids": ids, "length": length,
                    "label": rng.integers(0, 2, GLOBAL_BATCH).astype(np.int32)})
    return out


@pytest.mark.parametrize("dropout", [True, False], ids=["dropout", "deterministic"])
@pytest.mark.parametrize("n", REPLICAS)
def test_sst2(n, dropout):
    rate, word_rate = (0.5, 0.1) if dropout else (0.0, 0.0)
    model = TextClassifier(embedding_size=8, hidden_size=8, vocab_size=VOCAB, output_size=1,
                           dropout_rate=rate, word_dropout_rate=word_rate, unk_idx=1)
    state = jax.jit(lambda k: create_train_state(k, model))(jax.random.key(0))
    batches = sst2_batches()
    keys = make_keys(1, n)
    # with dropout each replica draws its own masks from its own key (pmap is the
    # oracle); without it the step is the global batch's (one mirrored key, unused):
    # the gradients of the mean loss, the metrics summed over the global batch
    rngs = Each([{"dropout": k} for k in keys]) if dropout else {"dropout": keys[0]}
    port = Port(step=train_step, state=(state,),
                inputs=lambda i: ((Split(batches[i]), rngs), {}))
    check_port(port, n, oracle=not dropout, oracle_metrics=lambda m: m)


def _replica_grads(state: TrainState, batch: dict[str, Array]) -> tuple[Any, Metrics]:
    """One replica's part of ``train_step`` without dropout and without its collectives:
    the gradients of its own mean loss and its metrics (the ragged test's oracle)."""
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["token_ids"], batch["length"],
                                deterministic=True)
        labels = jnp.expand_dims(batch["label"], 1)
        return jnp.mean(sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)), logits
    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return grads, compute_metrics(labels=batch["label"], logits=logits)


def test_sst2_ragged_batches_with_dynamic_shapes():
    """The source's real input: batches of different sizes per replica (5 and 3 sequences),
    with ``RunOptions(dynamic_shapes=True)``. The backward LSTM's ``flip_sequences`` (a
    ``vmap`` of ``roll`` by each length) has a clip-mode scatter along the padded batch in
    its gradient; before, a ``PaddingError`` refused it. Oracle: each replica's gradients
    by ``jax.jit`` on its own batch, averaged (``pmean``), then applied; the metrics
    summed, ``count`` the 8 real sequences."""
    from runtime import PerReplica, RunOptions, replicate
    model = TextClassifier(embedding_size=8, hidden_size=8, vocab_size=VOCAB, output_size=1,
                           dropout_rate=0.0, word_dropout_rate=0.0, unk_idx=1)
    state = jax.jit(lambda k: create_train_state(k, model))(jax.random.key(0))
    step = replicate(train_step, num_replicas=2, axis_name="batch",
                     options=RunOptions(dynamic_shapes=True))
    want_state = state
    for batch in sst2_batches(steps=2):
        parts = [{k: v[:5] for k, v in batch.items()}, {k: v[5:8] for k, v in batch.items()}]
        state, metrics = step(state, PerReplica(parts), {"dropout": jax.random.key(1)})
        outs = [jax.jit(_replica_grads)(want_state, p) for p in parts]
        grads = jax.tree.map(lambda a, b: (a + b) / 2, outs[0][0], outs[1][0])
        want_state = want_state.apply_gradients(grads=grads)
        np.testing.assert_allclose(np.asarray(metrics.loss), outs[0][1].loss + outs[1][1].loss,
                                   rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(metrics.accuracy),
                                      outs[0][1].accuracy + outs[1][1].accuracy)
        assert int(metrics.count) == 8
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                             rtol=1e-5, atol=1e-6),
                     state.params, want_state.params)
