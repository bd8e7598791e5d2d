"""A transformer block (attention + MLP) with Megatron-style model parallelism:
2 replicas × 4 logical devices on 8 virtual CPU devices.

Inside each replica the attention heads are split over the 4 logical devices (QKV
projections split by columns, the output projection by rows) and so is the MLP (first
matmul by columns, second by rows): XLA then needs one all-reduce per block half
inside each replica, plus the gradient all-reduces across the 2 replicas.

    python examples/transformer_block.py
"""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import runtime as rt  # noqa: E402

REPLICAS, K = 2, 4
D, HEADS, FF, SEQ, BATCH = 32, 4, 64, 8, 4   # per replica: BATCH sequences


def init(rng: np.random.Generator) -> dict:
    s = 1 / np.sqrt(D)
    return {k: (rng.normal(size=shape) * s).astype(np.float32) for k, shape in {
        "wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D),
        "w1": (D, FF), "w2": (FF, D), "ln1": (D,), "ln2": (D,)}.items()}


def layernorm(x, g):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5) * (1 + g)


def block(p, x):
    col = lambda w: rt.split_to_logical_devices(w, [1, K])   # noqa: E731
    row = lambda w: rt.split_to_logical_devices(w, [K, 1])   # noqa: E731
    h = layernorm(x, p["ln1"])
    q, k, v = (h @ col(p[n]) for n in ("wq", "wk", "wv"))
    split = lambda t: t.reshape(t.shape[0], SEQ, HEADS, D // HEADS)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(x.shape)
    x = x + o @ row(p["wo"])
    h = layernorm(x, p["ln2"])
    return x + jax.nn.gelu(h @ col(p["w1"])) @ row(p["w2"])


def loss(p, x, y):
    return jnp.mean((block(p, x) - y) ** 2)


def train_step(p, batch):
    x, y = batch
    l, g = jax.value_and_grad(loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), l


def main() -> None:
    rng = np.random.default_rng(0)
    params = init(rng)
    x = rng.normal(size=(REPLICAS * BATCH, SEQ, D)).astype(np.float32)
    y = np.tanh(x[..., ::-1]).astype(np.float32)
    step = rt.replicate(train_step, num_replicas=REPLICAS, logical_devices=K)
    batch = rt.distribute((x, y), REPLICAS)
    for i in range(5):
        params, l = step(params, batch)
        print(f"step {i}: loss {float(rt.reduce('mean', l)):.5f}")
    compiled = step.lower(params, batch).compile()
    if hasattr(compiled, "collectives"):
        print("\ncollectives XLA inserted:")
        print(compiled.collectives_table())
    print(f"\nflops per device: {compiled.cost_analysis().get('flops', float('nan')):.3g}")
    print(step.cache_info())


if __name__ == "__main__":
    main()
