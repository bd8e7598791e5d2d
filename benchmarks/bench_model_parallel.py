"""Annotated Megatron MLP step (2 replicas × 4 logical devices) through ``rt.replicate``
vs the same step hand-written with ``jax.jit``, ``NamedSharding`` and
``with_sharding_constraint`` on the same mesh. Interleaved, medians, ratio.

    python benchmarks/bench_model_parallel.py [--reps 30] [--iters 10]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import runtime as rt  # noqa: E402

N, K, D, H, B = 2, 4, 256, 1024, 64  # B rows per replica


def ours_step():
    def loss(p, x):
        w1 = rt.split_to_logical_devices(p["w1"], [1, K])
        h = jax.nn.gelu(x @ w1)
        h = rt.split_to_logical_devices(h, [1, K])
        w2 = rt.split_to_logical_devices(p["w2"], [K, 1])
        return jnp.mean((h @ w2 - x) ** 2)

    def step(p, x):
        l, g = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), l
    return rt.replicate(step, num_replicas=N, logical_devices=K)


def theirs_step(mesh):
    # data parallel over 'replica', Megatron over 'model'; loss mean over the global batch
    def loss(p, x):
        w1 = jax.lax.with_sharding_constraint(p["w1"], NamedSharding(mesh, P(None, "model")))
        h = jax.nn.gelu(x @ w1)
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("replica", "model")))
        w2 = jax.lax.with_sharding_constraint(p["w2"], NamedSharding(mesh, P("model", None)))
        return jnp.mean((h @ w2 - x) ** 2)

    def step(p, x):
        l, g = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), l
    psh = {"w1": NamedSharding(mesh, P(None, "model")), "w2": NamedSharding(mesh, P("model", None))}
    return jax.jit(step, in_shardings=(psh, NamedSharding(mesh, P("replica"))),
                   out_shardings=(psh, NamedSharding(mesh, P())))


def main() -> None:
    ap = _common.parser(__doc__, reps=30)
    ap.add_argument("--iters", type=int, default=10, help="steps per repetition (default 10)")
    args = ap.parse_args()
    if len(jax.devices()) < N * K:
        raise SystemExit(f"needs {N * K} devices ({N} replicas x {K} logical devices); "
                         f"this backend has {len(jax.devices())}")
    rng = np.random.default_rng(0)
    p0 = {"w1": (rng.normal(size=(D, H)) / np.sqrt(D)).astype(np.float32),
          "w2": (rng.normal(size=(H, D)) / np.sqrt(H)).astype(np.float32)}
    x = rng.normal(size=(N * B, D)).astype(np.float32)
    mesh = Mesh(np.asarray(jax.devices()[:N * K]).reshape(N, K), ("replica", "model"))
    ours, theirs = ours_step(), theirs_step(mesh)
    xs_ours = rt.distribute(x, N)
    x_theirs = jax.device_put(x, NamedSharding(mesh, P("replica")))
    state = {"ours": ours(p0, xs_ours)[0], "theirs": theirs(p0, x_theirs)[0]}
    # same numbers (mean of per-replica means == global mean for equal shards)
    for k in p0:
        np.testing.assert_allclose(state["ours"][k], state["theirs"][k], rtol=2e-4, atol=1e-5)

    def run(name, fn, x):
        def sample():
            p = state[name]
            t0 = time.perf_counter()
            for _ in range(args.iters):
                p, _ = fn(p, x)
            jax.block_until_ready(p)
            state[name] = p  # the parameters are chained from step to step
            return (time.perf_counter() - t0) / args.iters
        return sample

    t = _common.interleaved({"ours": run("ours", ours, xs_ours),
                             "theirs": run("theirs", theirs, x_theirs)}, args.reps)
    _common.report(f"annotated step ({N} replicas x {K} logical devices, MLP {D}->{H}->{D}, "
                   f"{B} rows/replica), per step", t["ours"], t["theirs"], 1.05,
                   ref_name="jax.jit + sharding")


if __name__ == "__main__":
    main()
