"""Port of google/flax examples/seq2seq (train.py, models.py, input_pipeline.py): an LSTM
encoder-decoder learning integer addition.

Kept from the source: ``DecoderLSTMCell`` (an ``nn.RNNCellBase`` sampling its next input
with the 'lstm' rng) and ``Seq2seq`` (``nn.RNN(nn.LSTMCell)`` encoder with
``seq_lengths``, ``nn.RNN`` decoder with ``split_rngs={'params': False, 'lstm': True}``,
teacher forcing in training); ``CharacterTable``, ``mask_sequences`` and
``get_sequence_lengths``; ``cross_entropy_loss``, ``compute_metrics`` and ``train_step``
(``lstm_key = fold_in(lstm_rng, state.step)``, ``optax.adam``) with ``eos_id`` static
(the source jits it; here pmap's ``static_broadcasted_argnums=3`` and replicate's
``static_argnums=3``). The data-parallel form adds ``lax.pmean`` of the gradients and
metrics. Sizes: numbers of up to 2 digits, hidden size 16.

With teacher forcing the loss does not read the sampled tokens, so the global-batch jit
is an oracle for the parameters and the metrics.
"""
from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

from tests.clients._harness import REPLICAS, Port, Split, check_port

Array = jax.Array
LSTMCarry = tuple[Array, Array]
GLOBAL_BATCH = 16
HIDDEN_SIZE = 16


# -- models.py --------------------------------------------------------------------------

class DecoderLSTMCell(nn.RNNCellBase):
    """DecoderLSTM Module wrapped in a lifted scan transform."""
    features: int
    teacher_force: bool
    vocab_size: int

    @nn.compact
    def __call__(self, carry, x):
        """Applies the DecoderLSTM model."""
        lstm_state, last_prediction = carry
        if not self.teacher_force:
            x = last_prediction
        lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
        logits = nn.Dense(features=self.vocab_size)(y)
        categorical_rng = self.make_rng("lstm")
        predicted_token = jax.random.categorical(categorical_rng, logits)
        prediction = jax.nn.one_hot(predicted_token, self.vocab_size, dtype=jnp.float32)
        return (lstm_state, prediction), (logits, prediction)

    @property
    def num_feature_axes(self) -> int:
        return 1


class Seq2seq(nn.Module):
    """Sequence-to-sequence class using encoder/decoder architecture."""
    teacher_force: bool
    hidden_size: int
    vocab_size: int
    eos_id: int = 1

    @nn.compact
    def __call__(self, encoder_inputs, decoder_inputs):
        encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
        decoder = nn.RNN(
            DecoderLSTMCell(decoder_inputs.shape[-1], self.teacher_force, self.vocab_size),
            split_rngs={"params": False, "lstm": True}, name="decoder")
        seq_lengths = self.get_seq_lengths(encoder_inputs)
        encoder_state, _ = encoder(encoder_inputs, seq_lengths=seq_lengths)
        logits, predictions = decoder(decoder_inputs[:, :-1],
                                      initial_carry=(encoder_state, decoder_inputs[:, 0]))
        return logits, predictions

    def get_seq_lengths(self, inputs):
        """Get segmentation mask for inputs."""
        inputs = jnp.argmax(inputs, axis=-1)
        return jnp.argmax(inputs == self.eos_id, axis=-1)


# -- input_pipeline.py ------------------------------------------------------------------

class CharacterTable:
    """Encodes/decodes between strings and integer representations."""

    def __init__(self, chars, max_len_query_digit=3, seed=0):
        self._chars = sorted(set(chars))
        self._char_indices = {ch: idx + 2 for idx, ch in enumerate(self._chars)}
        self._max_len_query_digit = max_len_query_digit
        self._random = random.Random(seed)   # the source draws from `random` unseeded

    pad_id, eos_id = 0, 1

    @property
    def vocab_size(self):
        return len(self._chars) + 2

    @property
    def max_input_len(self):
        return self._max_len_query_digit * 2 + 2

    @property
    def max_output_len(self):
        return self._max_len_query_digit + 3

    @property
    def encoder_input_shape(self):
        return (1, self.max_input_len, self.vocab_size)

    @property
    def decoder_input_shape(self):
        return (1, self.max_output_len, self.vocab_size)

    def encode(self, inputs):
        return np.array([self._char_indices[char] for char in inputs] + [self.eos_id])

    def one_hot(self, tokens):
        vecs = np.zeros((tokens.size, self.vocab_size), dtype=np.float32)
        vecs[np.arange(tokens.size), tokens] = 1
        return vecs

    def encode_onehot(self, batch_inputs, max_len=None):
        max_len = self.max_input_len if max_len is None else max_len

        def encode_str(s):
            tokens = self.encode(s)
            tokens = np.pad(tokens, [(0, max_len - len(tokens))], mode="constant")
            return self.one_hot(tokens)
        return np.array([encode_str(inp) for inp in batch_inputs])

    def generate_examples(self, num_examples):
        for _ in range(num_examples):
            max_digit = pow(10, self._max_len_query_digit) - 1
            key = tuple(sorted((self._random.randint(0, 99),
                                self._random.randint(0, max_digit))))
            yield f"{key[0]}+{key[1]}", "=" + str(key[0] + key[1])

    def get_batch(self, batch_size):
        inputs, outputs = zip(*self.generate_examples(batch_size))
        return {"query": self.encode_onehot(inputs),
                "answer": self.encode_onehot(outputs, self.max_output_len)}


def mask_sequences(sequence_batch, lengths):
    """Sets positions beyond the length of each sequence to 0."""
    return sequence_batch * (
        lengths[:, np.newaxis] > np.arange(sequence_batch.shape[1])[np.newaxis])


def get_sequence_lengths(sequence_batch, eos_id):
    """Returns the length of each one-hot sequence, including the EOS token."""
    eos_row = sequence_batch[:, :, eos_id]
    eos_idx = jnp.argmax(eos_row, axis=-1)  # returns first occurrence
    return jnp.where(eos_row[jnp.arange(eos_row.shape[0]), eos_idx], eos_idx + 1,
                     sequence_batch.shape[1])


# -- train.py ---------------------------------------------------------------------------

def get_model(ctable, *, teacher_force=False):
    return Seq2seq(teacher_force=teacher_force, hidden_size=HIDDEN_SIZE,
                   eos_id=ctable.eos_id, vocab_size=ctable.vocab_size)


def get_initial_params(model, rng, ctable):
    rng1, rng2 = jax.random.split(rng)
    variables = model.init({"params": rng1, "lstm": rng2},
                           jnp.ones(ctable.encoder_input_shape, jnp.float32),
                           jnp.ones(ctable.decoder_input_shape, jnp.float32))
    return variables["params"]


def get_train_state(rng, ctable, learning_rate=0.003):
    # the loop trains with teacher forcing (get_model(ctable, teacher_force=True) in the
    # source's train_and_evaluate via the TrainState's apply_fn)
    model = get_model(ctable, teacher_force=True)
    params = get_initial_params(model, rng, ctable)
    tx = optax.adam(learning_rate)
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def cross_entropy_loss(logits, labels, lengths):
    xe = jnp.sum(nn.log_softmax(logits) * labels, axis=-1)
    masked_xe = jnp.mean(mask_sequences(xe, lengths))
    return -masked_xe


def compute_metrics(logits, labels, eos_id):
    lengths = get_sequence_lengths(labels, eos_id)
    loss = cross_entropy_loss(logits, labels, lengths)
    token_accuracy = jnp.argmax(logits, -1) == jnp.argmax(labels, -1)
    sequence_accuracy = jnp.sum(mask_sequences(token_accuracy, lengths), axis=-1) == lengths
    accuracy = jnp.mean(sequence_accuracy)
    return {"loss": loss, "accuracy": accuracy}


def train_step(state, batch, lstm_rng, eos_id):
    """Trains one step (data parallel over axis 'batch')."""
    labels = batch["answer"][:, 1:]
    lstm_key = jax.random.fold_in(lstm_rng, state.step)

    def loss_fn(params):
        logits, _ = state.apply_fn({"params": params}, batch["query"], batch["answer"],
                                   rngs={"lstm": lstm_key})
        loss = cross_entropy_loss(logits, labels, get_sequence_lengths(labels, eos_id))
        return loss, logits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    grads = jax.lax.pmean(grads, axis_name="batch")
    state = state.apply_gradients(grads=grads)
    metrics = jax.lax.pmean(compute_metrics(logits, labels, eos_id), axis_name="batch")
    return state, metrics


@pytest.mark.parametrize("n", REPLICAS)
def test_seq2seq_lstm(n):
    ctable = CharacterTable("0123456789+= ", max_len_query_digit=2)
    rng = jax.random.PRNGKey(0)
    # jitted: eager init compiles every op once (seconds); same values
    state = jax.jit(lambda r: get_train_state(r, ctable))(rng)
    batches = [ctable.get_batch(GLOBAL_BATCH) for _ in range(2)]
    port = Port(step=train_step, state=(state,), static_argnums=(3,),
                inputs=lambda i: ((Split(batches[i]), rng, ctable.eos_id), {}))
    check_port(port, n, oracle=True, oracle_metrics=lambda m: m)
