"""First compile in a fresh process: the 8-replica MLP training step, ``rt.replicate``
vs ``jax.jit`` with NamedSharding, each in its own new Python process.

Both processes import the same modules first (jax, flax, optax, and ``runtime`` for ours),
then time one ``lower`` + ``compile`` of the step: what a user waits for at the first
step of a run, including every one-time cost of our path (first trace through the
compiler's hooks, first use of each pass) and of JAX's. Imports are reported separately.
A third process times the step written by hand per replica (``jax.shard_map`` with
``pmean``, JAX's default checks: the form ``replicate`` gives XLA), for what
``replicate`` costs over writing that by hand (informational). Runs ``--reps`` rounds of
the three processes, the order rotating.

    .venv/bin/python benchmarks/bench_first_compile.py [--reps 5]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

TARGET = 1.2

_CHILD = r'''
import json, os, sys, time
t0 = time.perf_counter()
sys.path.insert(0, os.path.join({root!r}, "benchmarks")); sys.path.insert(0, {root!r})
import jax, numpy as np, flax, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import _mlp
if {side!r} == "ours":
    import runtime as rt
t1 = time.perf_counter()
model, tx, state, batch_at = _mlp.setup(2048)
n = _mlp.N_REPLICAS
sds = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), t)
host = batch_at(0)
t2 = time.perf_counter()
if {side!r} == "ours":
    step = rt.replicate(_mlp.make_step(model, tx), num_replicas=n)
    step.lower(sds(state), rt.PerReplica([sds(jax.tree.map(lambda a: a[: 2048 // n], host))] * n)).compile()
else:
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("data",))
    d, r = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    if {side!r} == "jit":
        fn = _mlp.make_step(model, tx)
    else:  # the step written by hand per replica, under shard_map (JAX's default checks)
        fn = jax.shard_map(_mlp.make_step(model, tx, "data"), mesh=mesh,
                           in_specs=(P(), P("data")), out_specs=(P(), P()))
    jax.jit(fn, in_shardings=(r, d), out_shardings=(r, r)).lower(sds(state), sds(host)).compile()
t3 = time.perf_counter()
print(json.dumps({{"imports": t1 - t0, "first_compile": t3 - t2}}))
'''


def _run(side: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _CHILD.format(root=root, side=side)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=os.environ.copy(), check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    args = _common.parser(__doc__, reps=5).parse_args()
    sides = ("ours", "jit", "sm")
    res: dict[str, list[float]] = {s: [] for s in sides}
    imports: dict[str, list[float]] = {s: [] for s in sides}
    for i in range(args.reps):
        for name in sides[i % 3:] + sides[:i % 3]:  # the order rotates
            r = _run(name)
            res[name].append(r["first_compile"])
            imports[name].append(r["imports"])
    _common.report("imports (jax, flax, optax [+ runtime])", imports["ours"], imports["jit"], None)
    _common.report("first lower + compile in a fresh process", res["ours"], res["jit"], TARGET)
    _common.report("the same, against the step written by hand per replica (shard_map + pmean)",
                   res["ours"], res["sm"], None, ref_name="shard_map by hand",
                   ratio_name="ours/shard_map")


if __name__ == "__main__":
    main()
