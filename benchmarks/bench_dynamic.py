"""Dynamic shapes benchmark (issue 4): padding to buckets vs ``jax.jit``.

1. ``--calls`` calls with random per-replica batch sizes in [1, 1024]: total time of a
   dynamic ``replicate`` step (pow2 and auto buckets, compiles included) vs ``jax.jit``
   on the exact shapes (one jit call per replica's real data; a compile per distinct size).
2. Per-call time at one fixed bucket (interleaved, medians): the dynamic step, fed the
   replicas' unpadded host arrays, vs a hand-written ``jax.jit(shard_map)`` data-parallel
   step on the padded shape, fed the padded host arrays (target <= 1.1x). Both are
   waited for with ``jax.block_until_ready`` on what they return. Also shown: the same
   when every per-replica result is read (``.values``: one array per replica), and our
   static ``replicate`` on the padded shape.
3. Padding waste (padded rows / bucket rows) and compile count of pow2 vs auto over the
   sizes of 1.
4. Device-array inputs (issue 15): the per-call time of a dynamic step whose every call
   brings exact sizes never seen before, all inside one compiled bucket (target <= 1 ms,
   and the same as repeating one size); and 40 calls with random sizes in [1, 256]
   (pow2), compiles included, against ``jax.jit`` compiling every exact shape (target
   <= 0.3x). New/repeated is held to the same 1.1x as part 2 (issue 15: the cost must not
   depend on whether the sizes were seen; machines here are too noisy for 1.0). Every
   per-replica result is read (``.values``). Beside them, our static step on arrays of
   the bucket's shape: the computation's own time on this machine, which the 1 ms
   includes (the dynamic call reads back only the real rows).

    .venv/bin/python benchmarks/bench_dynamic.py [--calls 200] [--replicas 4] [--reps 300]

On an accelerator set ``JAX_PLATFORMS`` (e.g. ``cuda``) and ``--replicas`` to at most the
number of devices.
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import runtime as rt  # noqa: E402
from runtime.dynamic import make_bucketer  # noqa: E402

D = 32
BUCKET = 512
TARGET = 1.1


def step_fn(w, x, y):
    def loss(w):
        return jnp.mean((jnp.tanh(x @ w) - y) ** 2)
    return jax.grad(loss)(w), loss(w)


def _values(out):
    """Every per-replica value of a result (reads ``PerReplica.values``)."""
    res = []
    for v in jax.tree.leaves(out, is_leaf=lambda v: isinstance(v, rt.PerReplica)):
        res.extend(v.values if isinstance(v, rt.PerReplica) else [v])
    return res


def random_sizes(rng, calls: int, n: int) -> None:
    w = rng.normal(size=(D, D)).astype(np.float32) * 0.1
    sizes = rng.integers(1, 1025, size=(calls, n))
    data = [([rng.normal(size=(s, D)).astype(np.float32) for s in row],
             [rng.normal(size=(s, D)).astype(np.float32) for s in row]) for row in sizes]
    results = {}
    for bucketing in ("pow2", "auto"):
        step = rt.replicate(step_fn, num_replicas=n, options=rt.RunOptions(
            dynamic_shapes=True, bucketing=bucketing, max_compiles_warning=None))
        t0 = time.perf_counter()
        for xs, ys in data:
            jax.block_until_ready(step(w, rt.PerReplica(xs), rt.PerReplica(ys)))
        results[bucketing] = (time.perf_counter() - t0, step.cache_info().misses)
    jitted = jax.jit(step_fn)
    t0 = time.perf_counter()
    for xs, ys in data:
        jax.block_until_ready([jitted(w, x, y) for x, y in zip(xs, ys)])
    t_exact = time.perf_counter() - t0
    distinct = len(set(sizes.ravel().tolist()))
    print(f"[1] {calls} calls x {n} replicas, random sizes in [1,1024], compiles included:")
    for b, (t, c) in results.items():
        print(f"    dynamic replicate, {b:4s} buckets: {t:7.2f} s  ({c} compiles)  "
              f"ratio to jax.jit {t / t_exact:.3f}x")
    print(f"    jax.jit on exact shapes        : {t_exact:7.2f} s  ({distinct} distinct shapes)")

    print("[3] padding waste over the same sizes (per call: max over replicas -> bucket):")
    for b in ("pow2", "auto"):
        f = make_bucketer(b)
        real = padded = 0
        made = set()
        for row in sizes:
            bk = f(int(row.max()), None)
            made.add(bk)
            real += int(row.sum())
            padded += bk * n
        print(f"    {b:4s}: {len(made):3d} buckets, {100 * (1 - real / padded):5.1f}% of rows are "
              f"padding (of which {100 * (1 - int(sizes.max(1).sum()) * n / padded):4.1f}% "
              f"from bucket rounding)")


def fixed_bucket(rng, n: int, reps: int) -> None:
    w = rng.normal(size=(D, D)).astype(np.float32) * 0.1
    fixed = [int(s) for s in rng.integers(BUCKET // 2 + 1, BUCKET + 1, size=n)]
    xs = [rng.normal(size=(s, D)).astype(np.float32) for s in fixed]
    ys = [rng.normal(size=(s, D)).astype(np.float32) for s in fixed]
    pad = lambda v: np.pad(v, ((0, BUCKET - v.shape[0]), (0, 0)))  # noqa: E731
    xs_p, ys_p = [pad(v) for v in xs], [pad(v) for v in ys]
    dyn = rt.replicate(step_fn, num_replicas=n, options=rt.RunOptions(dynamic_shapes=True))
    static = rt.replicate(step_fn, num_replicas=n)

    # hand-written data parallelism over the same n devices on the padded shape (gradient
    # mean over replicas; each replica's loss is the mean over its padded rows, which is
    # the reference's cost, not its answer), fed the same host arrays every call
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("r",))

    def per_replica(w, x, y):
        g, l = step_fn(w, x, y)
        return jax.lax.pmean(g, "r"), l[None]
    dp = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=(P(), P("r"), P("r")),
                               out_specs=(P(), P("r"))),
                 in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("r")),
                               NamedSharding(mesh, P("r"))))

    # the dynamic step is exact: its loss equals jax.jit's on each replica's real rows
    g, loss = dyn(w, rt.PerReplica(xs), rt.PerReplica(ys))
    want = [float(jax.jit(step_fn)(w, x, y)[1]) for x, y in zip(xs, ys)]
    np.testing.assert_allclose([float(v) for v in loss.values], want, rtol=1e-5)

    blocked = _common.blocked
    fns = {
        "dyn": blocked(lambda: dyn(w, rt.PerReplica(xs), rt.PerReplica(ys))),
        "dyn+values": blocked(lambda: _values(dyn(w, rt.PerReplica(xs), rt.PerReplica(ys)))),
        "static": blocked(lambda: static(w, rt.PerReplica(xs_p), rt.PerReplica(ys_p))),
        "dp": blocked(lambda: dp(w, np.concatenate(xs_p), np.concatenate(ys_p))),
    }
    for f in fns.values():  # warm up: compile everything first
        for _ in range(5):
            f()
    t = _common.interleaved(fns, reps)
    print(f"[2] fixed bucket {BUCKET}, {n} replicas with real sizes {fixed}, host inputs:")
    _common.report("dynamic step vs jax.jit(shard_map) data parallel on the padded shape",
                   t["dyn"], t["dp"], TARGET, ours_name="dynamic replicate",
                   ref_name="jax.jit (padded)", ratio_name="dynamic/jax.jit")
    _common.report("same, reading every per-replica result (.values)", t["dyn+values"], t["dp"],
                   None, ours_name="dynamic + .values", ref_name="jax.jit (padded)",
                   ratio_name="dynamic+values/jax.jit")
    _common.report("dynamic step vs our static replicate on the padded shape", t["dyn"],
                   t["static"], None, ours_name="dynamic replicate",
                   ref_name="static replicate", ratio_name="dynamic/static")


def device_inputs(rng, n: int, reps: int) -> None:
    """Part 4 (see the module docstring)."""
    w = jax.device_put(rng.normal(size=(D, D)).astype(np.float32) * 0.1)
    step = rt.replicate(step_fn, num_replicas=n, options=rt.RunOptions(dynamic_shapes=True))

    def batch(sizes):
        return ([jax.device_put(rng.normal(size=(s, D)).astype(np.float32)) for s in sizes],
                [jax.device_put(rng.normal(size=(s, D)).astype(np.float32)) for s in sizes])
    # one bucket (129..256): compile it, then time calls with sizes never seen and a repeat
    pool = [int(v) for v in rng.permutation(np.arange(129, 257))]
    _values(step(w, *map(rt.PerReplica, batch([256] * n))))
    compiles = step.cache_info().misses
    _values(step(w, *map(rt.PerReplica, batch([200] * n))))
    # the floor: our static step on arrays of the bucket's shape (what the dynamic call
    # runs, without planning or padding), so the per-call figure reads against the
    # computation itself on this machine
    static = rt.replicate(step_fn, num_replicas=n)
    full = batch([256] * n)
    _values(static(w, *map(rt.PerReplica, full)))
    new_t, rep_t, static_t = [], [], []
    for i in range(min(reps, len(pool) // n)):
        # Both calls get arrays made for them (as a data loader's are), already on the
        # device: a repeated size must not be the same arrays again, whose host copy JAX
        # keeps after the first call (on a GPU that copy is most of the call).
        xs, ys = batch(pool[i * n:(i + 1) * n])  # sizes this step has never seen
        repeat = batch([200] * n)
        jax.block_until_ready((xs, ys, repeat))
        # which call goes first alternates: the first of a pair runs right after the
        # arrays were made and is the slower one whatever its sizes (after a full
        # collection, 1.55-1.75x the second); with "new" always first the ratio read
        # 1.11-1.20 where alternating reads 0.96-1.01
        calls = [(new_t, step, xs, ys), (rep_t, step, repeat[0], repeat[1]),
                 (static_t, static, full[0], full[1])]
        for times, fn, a, b in calls[i % 3:] + calls[:i % 3]:
            t0 = time.perf_counter()
            _values(fn(w, rt.PerReplica(a), rt.PerReplica(b)))
            times.append(time.perf_counter() - t0)
    assert step.cache_info().misses == compiles, "a new size inside the bucket compiled"
    print(f"[4] device-array inputs, {n} replicas, bucket 256:")
    _common.report("a call with exact sizes never seen, inside the compiled bucket", new_t,
                   rep_t, TARGET, ours_name="new sizes", ref_name="a repeated size",
                   ratio_name="new/repeated")
    _common.report("a call with new sizes vs our static step on the bucket's shape (the "
                   "computation's own time)", new_t, static_t, None, ours_name="new sizes",
                   ref_name="static, bucket shape", ratio_name="new/static")
    med = sorted(new_t)[len(new_t) // 2]
    print(f"   per call with new sizes: {_common.fmt(med)}  target <= 1 ms  "
          f"[{'OK' if med <= 1e-3 else 'OVER TARGET'}]  (the static step on the bucket's "
          f"shape: {_common.fmt(sorted(static_t)[len(static_t) // 2])})")
    # 40 calls, random sizes in [1, 256], compiles included, vs jax.jit on exact shapes
    sizes = rng.integers(1, 257, size=(40, n))
    data = [batch(row) for row in sizes]
    fresh = rt.replicate(step_fn, num_replicas=n, options=rt.RunOptions(
        dynamic_shapes=True, bucketing="pow2", max_compiles_warning=None))
    t0 = time.perf_counter()
    for xs, ys in data:
        _values(fresh(w, rt.PerReplica(xs), rt.PerReplica(ys)))
    ours = time.perf_counter() - t0
    jitted = jax.jit(step_fn)
    t0 = time.perf_counter()
    for xs, ys in data:
        jax.block_until_ready([jitted(w, x, y) for x, y in zip(xs, ys)])
    ref = time.perf_counter() - t0
    ratio = ours / ref
    print(f"   40 calls, random sizes in [1,256], pow2, compiles included: ours {ours:.2f} s "
          f"({fresh.cache_info().misses} compiles), jax.jit on exact shapes {ref:.2f} s "
          f"({len(set(sizes.ravel().tolist()))} shapes): ratio {ratio:.2f}x  target <= 0.3x  "
          f"[{'OK' if ratio <= 0.3 else 'OVER TARGET'}]")


def main() -> None:
    ap = _common.parser(__doc__, reps=300)
    ap.add_argument("--calls", type=int, default=200, help="calls in part 1 (default 200)")
    ap.add_argument("--replicas", type=int, default=4, help="replicas (default 4)")
    ap.add_argument("--parts", default="fixed,random,device",
                    help="which parts to run: fixed (2), random (1 and 3), device (4); default all")
    a = ap.parse_args()
    n = a.replicas
    if n > len(jax.devices()):
        raise SystemExit(f"--replicas {n} needs {n} devices; this backend has "
                         f"{len(jax.devices())} ({jax.devices()[0].platform})")
    print(f"backend: {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
          f"jax {jax.__version__}")
    rng = np.random.default_rng(0)
    parts = set(a.parts.split(","))
    if "fixed" in parts:
        fixed_bucket(rng, n, a.reps)
    if "random" in parts:
        random_sizes(rng, a.calls, n)
    if "device" in parts:
        device_inputs(rng, n, min(a.reps, 30))


if __name__ == "__main__":
    main()
