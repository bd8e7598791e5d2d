"""Port of karpathy/nanoGPT model.py (and the optimizer/schedule parts of train.py) to
flax linen.

Kept from the source: ``GPTConfig``; ``LayerNorm`` with optional bias;
``CausalSelfAttention`` (one ``c_attn`` projection to q, k, v, causal mask, ``attn_dropout``,
``c_proj``, ``resid_dropout``); ``MLP`` (``c_fc`` 4x, GELU, ``c_proj``, dropout); ``Block``
(pre-norm residual attention and MLP); ``GPT`` (``wte``, ``wpe``, ``drop``, ``h``, ``ln_f``,
``lm_head`` tied to ``wte``, cross-entropy with ``ignore_index=-1``); the init (normal 0.02,
``c_proj`` weights scaled by ``1/sqrt(2 * n_layer)``, zero biases);
``configure_optimizers`` (AdamW, weight decay only on params of ndim >= 2); train.py's
``get_lr`` (linear warmup, cosine decay) and ``grad_clip=1.0``. The training step is the
data-parallel one (DDP there, ``pmap`` here): per-replica dropout keys, ``lax.pmean`` of
the gradients and the loss. Sizes: block 8, vocab 32, 1 layer, 2 heads, 16 wide.

Dropout is drawn per replica, so there is no global-batch oracle: replicate must equal
pmap. ``test_nanogpt_bucketed_sequence_lengths``: the step written for one replica, with
dynamic shapes over the sequence axis and a different length on each of 4 replicas (block
16, 2 layers, 2 steps), against ``jax.jit`` on each replica's exact batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import runtime as rt
from tests.clients._harness import REPLICAS, Each, Port, Split, check_port, make_keys

GLOBAL_BATCH = 8


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


_normal = nn.initializers.normal(stddev=0.02)


class LayerNorm(nn.Module):
    """LayerNorm but with an optional bias."""
    bias: bool

    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm(epsilon=1e-5, use_bias=self.bias)(x)


class CausalSelfAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x, train: bool):
        cfg = self.config
        B, T, C = x.shape
        # key, query, value projections for all heads, in a batch
        q, k, v = jnp.split(nn.Dense(3 * C, use_bias=cfg.bias, kernel_init=_normal,
                                     name="c_attn")(x), 3, axis=2)
        hs = C // cfg.n_head
        q = q.reshape(B, T, cfg.n_head, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
        k = k.reshape(B, T, cfg.n_head, hs).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, cfg.n_head, hs).transpose(0, 2, 1, 3)
        # manual implementation of attention
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(hs))
        mask = jnp.tril(jnp.ones((T, T), bool))
        att = jnp.where(mask[None, None], att, -jnp.inf)
        att = jax.nn.softmax(att, axis=-1)
        att = nn.Dropout(cfg.dropout, name="attn_dropout")(att, deterministic=not train)
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # re-assemble all head outputs
        y = nn.Dense(C, use_bias=cfg.bias, name="c_proj",
                     kernel_init=nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer)))(y)
        return nn.Dropout(cfg.dropout, name="resid_dropout")(y, deterministic=not train)


class MLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x, train: bool):
        cfg = self.config
        x = nn.Dense(4 * cfg.n_embd, use_bias=cfg.bias, kernel_init=_normal, name="c_fc")(x)
        x = nn.gelu(x, approximate=False)
        x = nn.Dense(cfg.n_embd, use_bias=cfg.bias, name="c_proj",
                     kernel_init=nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layer)))(x)
        return nn.Dropout(cfg.dropout)(x, deterministic=not train)


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x, train: bool):
        x = x + CausalSelfAttention(self.config, name="attn")(
            LayerNorm(self.config.bias, name="ln_1")(x), train)
        x = x + MLP(self.config, name="mlp")(LayerNorm(self.config.bias, name="ln_2")(x), train)
        return x


class GPT(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, idx, targets=None, train: bool = False):
        cfg = self.config
        b, t = idx.shape
        assert t <= cfg.block_size, f"Cannot forward sequence of length {t}"
        pos = jnp.arange(0, t)
        wte = nn.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=_normal, name="wte")
        tok_emb = wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = nn.Embed(cfg.block_size, cfg.n_embd, embedding_init=_normal, name="wpe")(pos)
        x = nn.Dropout(cfg.dropout, name="drop")(tok_emb + pos_emb, deterministic=not train)
        for i in range(cfg.n_layer):
            x = Block(cfg, name=f"h_{i}")(x, train)
        x = LayerNorm(cfg.bias, name="ln_f")(x)
        logits = wte.attend(x)  # lm_head shares its weight with wte (weight tying)
        if targets is None:
            return logits, None
        valid = targets != -1  # F.cross_entropy(..., ignore_index=-1)
        losses = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.where(valid, targets, 0))
        loss = jnp.sum(losses * valid) / jnp.sum(valid)
        return logits, loss


def configure_optimizers(params, weight_decay, learning_rate, betas):
    """AdamW; every 2-D parameter (matmul weights, embeddings) decays, biases and
    layernorm scales do not."""
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),  # train.py: grad_clip = 1.0
        optax.adamw(learning_rate, b1=betas[0], b2=betas[1], weight_decay=weight_decay,
                    mask=decay_mask))


def get_lr_schedule(learning_rate=6e-4, warmup_iters=2, lr_decay_iters=10, min_lr=6e-5):
    """train.py's get_lr(it): linear warmup, then cosine decay down to min_lr."""
    def get_lr(it):
        warm = learning_rate * (it + 1) / (warmup_iters + 1)
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        coeff = 0.5 * (1.0 + jnp.cos(math.pi * jnp.clip(decay_ratio, 0.0, 1.0)))
        cosine = min_lr + coeff * (learning_rate - min_lr)
        return jnp.where(it < warmup_iters, warm, jnp.where(it > lr_decay_iters, min_lr, cosine))
    return get_lr


def train_step(state, batch, dropout_rng):
    """One optimizer step; each replica runs its micro-batch, gradients averaged (DDP)."""
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        _, loss = state.apply_fn({"params": params}, batch["x"], batch["y"], train=True,
                                 rngs={"dropout": dropout_rng})
        return loss

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    grads = jax.lax.pmean(grads, axis_name="batch")
    state = state.apply_gradients(grads=grads)
    return state, {"loss": jax.lax.pmean(loss, axis_name="batch")}


def init_model(cfg):
    """The model, its parameters (seed 1337, as train.py) and the optimizer."""
    model = GPT(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(1337),
                                 jnp.zeros((1, cfg.block_size), jnp.int32))["params"]
    tx = configure_optimizers(params, weight_decay=1e-1, learning_rate=get_lr_schedule(),
                              betas=(0.9, 0.95))
    return model, params, tx


def get_batch(cfg, seed=0, steps=2):
    """train.py's get_batch on a synthetic token stream: x and y = x shifted by one."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, cfg.vocab_size, 1000).astype(np.int32)
    out = []
    for _ in range(steps):
        ix = rng.integers(0, len(data) - cfg.block_size, GLOBAL_BATCH)
        out.append({"x": np.stack([data[i:i + cfg.block_size] for i in ix]),
                    "y": np.stack([data[i + 1:i + 1 + cfg.block_size] for i in ix])})
    return out


@pytest.mark.parametrize("n", REPLICAS)
def test_nanogpt(n):
    cfg = GPTConfig(block_size=8, vocab_size=32, n_layer=1, n_head=2, n_embd=16,
                    dropout=0.1, bias=True)
    model, params, tx = init_model(cfg)
    state = jax.jit(lambda p: train_state.TrainState.create(
        apply_fn=model.apply, params=p, tx=tx))(params)
    batches = get_batch(cfg)
    keys = make_keys(2, n)
    port = Port(step=train_step, state=(state,),
                inputs=lambda i: ((Split(batches[i]), Each(keys)), {}))
    check_port(port, n, oracle=False)


# -- bucketed sequence lengths: train.py's step written for one replica (no pmean), each
# replica's batch a different length (rt.replicate pads it to a bucket) -----------------
def single_replica_step(state, batch):
    """The step as one replica sees it: no collective; replicate averages the gradients.
    Dropout off (``dropout=0.0``): the reference below has no per-replica keys."""
    def loss_fn(params):
        return state.apply_fn({"params": params}, batch["x"], batch["y"], train=True)[1]
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_nanogpt_bucketed_sequence_lengths():
    """The learned position embedding ``wpe(arange(t))`` with ``t`` differing between
    replicas: its gradient is each replica's own length until it is scattered into the
    table, where replicate sums it (padding refused it before). Every step equals the
    mean over replicas of ``jax.jit``'s gradients on each replica's exact batch."""
    from tests.clients._harness import _strong
    n = 4
    # (one layer: the position embedding's gradient is the case; the suite's time budget)
    cfg = GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=16,
                    dropout=0.0, bias=True)
    model, params, tx = init_model(cfg)
    state = jax.tree.map(_strong, train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx))
    step = rt.replicate(single_replica_step, num_replicas=n, options=rt.RunOptions(
        dynamic_shapes=True, dynamic_dims={1: (1,)},
        maximum_shapes=[None, {"x": (None, cfg.block_size), "y": (None, cfg.block_size)}]))
    grads_of = jax.jit(lambda st, b: jax.value_and_grad(
        lambda p: st.apply_fn({"params": p}, b["x"], b["y"], train=True)[1])(st.params))
    rng = np.random.default_rng(3)
    ours = ref = state
    # (the second step moves each length to another replica: jit compiles no new shape)
    for lengths in ([14, 11, 5, 16], [5, 16, 14, 11]):
        # (y = -1 marks ignored targets, as train.py's ignore_index)
        batches = [{"x": rng.integers(0, cfg.vocab_size, (4, t)).astype(np.int32),
                    "y": rng.integers(-1, cfg.vocab_size, (4, t)).astype(np.int32)}
                   for t in lengths]
        ours, loss = step(ours, rt.PerReplica(batches))
        per = [grads_of(ref, b) for b in batches]
        ref = ref.apply_gradients(grads=jax.tree.map(lambda *g: sum(g) / n, *[g for _, g in per]))
        np.testing.assert_allclose([float(v) for v in loss.values], [float(l) for l, _ in per],
                                   rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(ours.params)[0],
                            jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
