"""Cache-hit call overhead: ``rt.replicate(f, num_replicas=1)`` vs ``jax.jit(f)``.

f is trivial (``x * 2 + 1`` on a small array), its argument mirrored and already on the
device, so the time is almost all dispatch: our cache key + lookup + argument handling +
the executable call, against jax.jit's C++ fast path. Each sample times ``--inner`` calls,
each result blocked on; samples of the two alternate.

    .venv/bin/python benchmarks/bench_cache_hit.py [--reps 200] [--inner 50]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import runtime as rt  # noqa: E402

TARGET = 1.1


def main() -> None:
    ap = _common.parser(__doc__, reps=200)
    ap.add_argument("--inner", type=int, default=50, help="calls per sample (default 50)")
    args = ap.parse_args()

    def f(x):
        return x * 2 + 1

    x = jax.device_put(jnp.arange(16, dtype=jnp.float32))
    ours = rt.replicate(f, num_replicas=1)
    ref = jax.jit(f)
    a, b = ours(x), ref(x)  # compile both
    assert (jax.device_get(a) == jax.device_get(b)).all(), "results differ"

    def sample(fn):
        def run():
            t0 = time.perf_counter()
            for _ in range(args.inner):
                fn(x).block_until_ready()
            return (time.perf_counter() - t0) / args.inner
        return run

    for _ in range(5):  # warm up both paths
        sample(ours)(), sample(ref)()
    res = _common.interleaved({"ours": sample(ours), "jit": sample(ref)}, args.reps)
    hits, misses, size = ours.cache_info()[:3]
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; per-call time, "
          f"{args.inner} calls per sample; cache_info: hits={hits} misses={misses} size={size}")
    _common.report("cache-hit call of f(x)=x*2+1, f32[16], result blocked on",
                   res["ours"], res["jit"], TARGET)


if __name__ == "__main__":
    main()
