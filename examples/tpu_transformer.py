"""Plan a transformer's training step for a TPU pod slice on a machine without a TPU.

A decoder-only transformer (pre-LayerNorm blocks of causal attention and an MLP) whose
weights are split Megatron-style over the K logical devices of each replica — attention
heads and the MLP's hidden units by columns in, by rows out — written for any K through
``rt.num_logical_devices()``. Its step compiles with the real TPU compiler for a TPU
topology (``rt.tpu_devices``, the project's ``tpu`` extra): nothing is allocated and
nothing runs; the compiled step reports whether it fits the chip's HBM and a roofline
estimate of its time.

    python examples/tpu_transformer.py                  # v5e:4x4, 4 replicas x 4
    python examples/tpu_transformer.py v5p:4x4x4 16 4   # topology, replicas, K

The same step and ``make_args`` work with the offline tool::

    replicate-inspect examples/tpu_transformer.py:train_step \\
        --args examples/tpu_transformer.py:make_args --target tpu:v5e:4x4 --sweep
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import runtime as rt  # noqa: E402

#: model sizes: layers, model width, heads, MLP width, sequence, vocabulary, batch/replica
CONFIG = dict(layers=2, d=256, heads=16, ff=1024, seq=128, vocab=512, batch=8)


def param_shapes(layers: int, d: int, ff: int, vocab: int, **_: int) -> dict:
    block = {"ln1": (d,), "wqkv": (d, 3 * d), "wo": (d, d), "ln2": (d,), "w1": (d, ff),
             "w2": (ff, d)}
    return {"embed": (vocab, d), "blocks": [dict(block) for _ in range(layers)],
            "ln_f": (d,)}


def _layernorm(x, g):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(x32.var(-1, keepdims=True) + 1e-5) * (1 + g)
    return y.astype(x.dtype)


def split_in_replica(w, how: str):
    """The step's annotation: ``how`` is "col" (split the columns over the replica's K
    logical devices) or "row"."""
    k = rt.num_logical_devices()
    return rt.split_to_logical_devices(w, [1, k] if how == "col" else [k, 1])


def _block(p, x, heads, split):
    col = lambda w: split(w, "col")  # noqa: E731
    row = lambda w: split(w, "row")  # noqa: E731
    b, t, d = x.shape
    h = _layernorm(x, p["ln1"])
    q, kk, v = jnp.split(h @ col(p["wqkv"]), 3, axis=-1)
    by_head = lambda a: a.reshape(b, t, heads, d // heads)  # noqa: E731
    q, kk, v = by_head(q), by_head(kk), by_head(v)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kk).astype(jnp.float32) / np.sqrt(d // heads)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jax.nn.softmax(s, axis=-1).astype(x.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d)
    x = x + o @ row(p["wo"])
    h = _layernorm(x, p["ln2"])
    return x + jax.nn.gelu(h @ col(p["w1"])) @ row(p["w2"])


def loss(params, tokens, heads=None, split=split_in_replica):
    """Next-token cross-entropy; ``split(w, "col" | "row")`` lays the block weights out
    (default: :func:`split_in_replica`; a hand-written ``jax.jit`` passes its own)."""
    heads = heads or CONFIG["heads"]
    x = params["embed"][tokens[:, :-1]]
    for p in params["blocks"]:
        x = _block(p, x, heads, split)
    logits = (_layernorm(x, params["ln_f"]) @ params["embed"].T).astype(jnp.float32)
    labels = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))


def train_step(params, tokens):
    """One SGD step on this replica's batch; the gradient all-reduce is the compiler's."""
    l, g = jax.value_and_grad(loss)(params, tokens)
    return jax.tree.map(lambda w, gw: w - 1e-3 * gw.astype(w.dtype), params, g), l


def make_args(num_replicas: int = 4, logical_devices: int = 4, dtype=jnp.bfloat16,
              **overrides: int) -> tuple:
    """Abstract arguments (``jax.ShapeDtypeStruct``): the parameters and a
    ``PerReplica`` of token batches. ``overrides`` change :data:`CONFIG` (a module-level
    change of CONFIG changes every later call, as the tools see it)."""
    cfg = {**CONFIG, **overrides}
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(**cfg),
                          is_leaf=lambda s: isinstance(s, tuple))
    tokens = jax.ShapeDtypeStruct((cfg["batch"], cfg["seq"] + 1), jnp.int32)
    return params, rt.PerReplica([tokens] * num_replicas)


def main(argv: list[str]) -> None:
    topology = argv[0] if argv else "v5e:4x4"
    devices = rt.tpu_devices(topology)
    n = int(argv[1]) if len(argv) > 1 else 4
    k = int(argv[2]) if len(argv) > 2 else len(devices) // n
    step = rt.replicate(train_step, num_replicas=n, logical_devices=k,
                        devices=devices[:n * k])
    compiled = step.lower(*make_args(n, k)).compile()
    print(f"{topology}: {n} replicas x {k} logical devices on {compiled.target}")
    print(compiled.memory_fit())
    print(compiled.roofline())


if __name__ == "__main__":
    main(sys.argv[1:])
