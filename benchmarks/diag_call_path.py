"""Where a cache-hit call's time goes, ours vs jax.jit, on whatever backend JAX picks:
the executable alone on device-resident inputs vs the whole call. A diagnostic, not a
benchmark with a target: run it when a ratio in the benchmarks moves.

    JAX_PLATFORMS=cuda python benchmarks/diag_call_path.py [--reps 300]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import statistics  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import runtime as rt  # noqa: E402
from ir import _jax_compat as jc  # noqa: E402
from _common import blocked  # noqa: E402
from _mlp import make_step, setup  # noqa: E402


def main() -> None:
    a = _common.parser(__doc__, reps=300).parse_args()
    model, tx, state, batch_at = setup(256)
    batch = batch_at(0)
    step = make_step(model, tx)
    ours = rt.replicate(step, num_replicas=1)
    ref = jax.jit(step)
    dev_batch = jax.device_put(batch)
    pr = rt.PerReplica([dev_batch])
    ours(state, pr)
    ref(state, dev_batch)
    prog = next(iter(ours._cache._entries.values()))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; fast C++ call: "
          f"{prog.call is not prog.jax_compiled.__call__}")
    leaves = jax.tree.leaves((state, dev_batch))
    flat = jax.device_put(leaves, list(prog.jax_compiled.input_shardings[0]))
    ref_c = ref.lower(state, dev_batch).compile()

    dist = rt.distribute(jax.device_put(batch, ours.layout.varying_sharding), 1)
    fns = {"ours call, PerReplica([device batch])": blocked(lambda: ours(state, pr)),
           "ours call, distribute(global batch)": blocked(lambda: ours(state, dist)),
           "jit call": blocked(lambda: ref(state, dev_batch)),
           "ours executable alone": blocked(lambda: prog.call(*flat)),
           "jit executable alone": blocked(lambda: ref_c(state, dev_batch))}
    res = _common.interleaved(fns, a.reps)
    for k, v in res.items():
        print(f"   {k:40s} median {_common.fmt(statistics.median(v))}")
    hlo_o, hlo_r = prog.jax_compiled.as_text(), ref_c.as_text()
    count = lambda h, w: sum(line.count(w) for line in h.splitlines())  # noqa: E731
    for w in ("fusion(", "all-reduce", "custom-call", "copy("):
        print(f"   HLO '{w}': ours {count(hlo_o, w)}, jit {count(hlo_r, w)}")

    dynamic_phases(a.reps)


def dynamic_phases(reps: int) -> None:
    """The dynamic path's phases on one replica at a fixed bucket: the signature lookup,
    the host padding, the executable on the padded host inputs, and the whole call."""
    from bench_dynamic import D, step_fn
    from runtime.dynamic import _pad_host
    rng = np.random.default_rng(0)
    w = rng.normal(size=(D, D)).astype(np.float32)
    x = rng.normal(size=(314, D)).astype(np.float32)
    y = rng.normal(size=(314, D)).astype(np.float32)
    dyn = rt.replicate(step_fn, num_replicas=1, options=rt.RunOptions(dynamic_shapes=True))
    args = (w, rt.PerReplica([x]), rt.PerReplica([y]))
    dyn(*args)
    path = dyn._dynamic
    plan = next(iter(path.planned.values()))
    leaves = jax.tree_util.tree_flatten(args, lambda v: type(v) is rt.PerReplica)[0]
    sizes = ({"b": 314},)
    flat = [plan.puts[0](np.asarray([314], np.int32)), w, _pad_host([x], (512, D), x.dtype, 1),
            _pad_host([y], (512, D), y.dtype, 1)]

    fns = {"dynamic call": blocked(lambda: dyn(*args)),
           "run() alone (pad + execute + wrap)": blocked(lambda: path.run(plan, sizes, leaves)),
           "executable on padded host inputs": blocked(lambda: plan.prog.call(*flat)),
           "pad both inputs on the host": blocked(lambda: (_pad_host([x], (512, D), x.dtype, 1),
                                                     _pad_host([y], (512, D), y.dtype, 1)))}
    res = _common.interleaved(fns, reps)
    print("dynamic step, 1 replica, bucket 512 (real 314):")
    for k, v in res.items():
        print(f"   {k:40s} median {_common.fmt(statistics.median(v))}")


if __name__ == "__main__":
    main()
