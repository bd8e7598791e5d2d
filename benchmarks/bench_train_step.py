"""8-replica MLP training step: ``rt.replicate`` + ``rt.distribute`` vs hand-written
``jax.jit`` data parallelism (batch sharded ``P('data')``, params replicated, mean loss).

Same flax MLP (256-512-512-10), same optax SGD+momentum, same global batch, 8 virtual CPU
devices. Two measurements, each interleaved sample by sample:

1. step only: inputs already on the devices (ours: a ``PerReplica`` made once per batch by
   ``rt.distribute`` from a global array sharded over ``step.mesh``; jax.jit: the global
   array sharded ``P('data')``); only the step calls are timed.
2. step + input prep: from a host (numpy) batch each step (ours: ``rt.distribute`` + call;
   jax.jit: ``jax.device_put`` with the sharding + call).

The training state is chained from step to step in both; every sample times ``--inner``
steps and blocks on the state and the loss.

    .venv/bin/python benchmarks/bench_train_step.py [--reps 30] [--inner 10] [--batch 2048]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import runtime as rt  # noqa: E402
from _mlp import N_REPLICAS, make_step, setup  # noqa: E402

TARGET = 1.05


def main() -> None:
    ap = _common.parser(__doc__, reps=30)
    ap.add_argument("--inner", type=int, default=10, help="steps per sample (default 10)")
    ap.add_argument("--batch", type=int, default=2048, help="global batch (default 2048)")
    args = ap.parse_args()
    n = N_REPLICAS
    assert len(jax.devices()) >= n

    model, tx, state0, batch_at = setup(args.batch)
    host_batches = [batch_at(i) for i in range(args.inner)]

    # ours
    ours = rt.replicate(make_step(model, tx), num_replicas=n)
    ours_sh = NamedSharding(ours.mesh, P("replica"))
    ours_batches = [rt.distribute(jax.device_put(b, ours_sh), n) for b in host_batches]

    # hand-written jax.jit data parallelism
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("data",))
    data_sh, repl_sh = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    ref = jax.jit(make_step(model, tx), in_shardings=(repl_sh, data_sh),
                  out_shardings=(repl_sh, repl_sh))
    ref_batches = [jax.device_put(b, data_sh) for b in host_batches]

    # same answer? (one step from the same state on the same batch)
    (p_o, _), l_o = ours(state0, ours_batches[0])
    (p_r, _), l_r = ref(jax.device_put(state0, repl_sh), ref_batches[0])
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(p_o), jax.tree.leaves(p_r)))
    print(f"check: loss ours {float(rt.reduce('mean', l_o)):.6f} vs jax.jit {float(l_r):.6f}; "
          f"max |param diff| after one step {err:.2e}")
    if err > 1e-4:
        print("WARNING: the two steps disagree (gradients differ); timings compare different "
              "programs only in their numbers, not their work")

    def run(step, batches, prep=None):
        state = [jax.device_put(state0, repl_sh if step is ref else NamedSharding(ours.mesh, P()))]

        def sample():
            s = state[0]
            t0 = time.perf_counter()
            for b in batches:
                s, loss = step(s, prep(b) if prep else b)
            jax.block_until_ready((s, loss.values if isinstance(loss, rt.PerReplica) else loss))
            dt = time.perf_counter() - t0
            state[0] = s
            return dt / len(batches)
        return sample

    fns = {"ours": run(ours, ours_batches), "jit": run(ref, ref_batches),
           "ours_prep": run(ours, host_batches, lambda b: rt.distribute(b, n)),
           "jit_prep": run(ref, host_batches, lambda b: jax.device_put(b, data_sh))}
    for f in fns.values():  # warm up
        f(), f()
    res = _common.interleaved(fns, args.reps)
    print(f"jax {jax.__version__}, {n} {jax.devices()[0].platform} devices, global batch {args.batch}; per-step time, "
          f"{args.inner} steps per sample; cache_info: {tuple(ours.cache_info())}")
    _common.report("train step, inputs already on device (step calls only)",
                   res["ours"], res["jit"], TARGET)
    _common.report("train step + input prep from a host batch (distribute / device_put)",
                   res["ours_prep"], res["jit_prep"], TARGET)


if __name__ == "__main__":
    main()
