"""8-replica RNN training step (a scan over time): ``rt.replicate`` vs hand-written
``jax.jit`` data parallelism (batch sharded ``P('data')``, params replicated, mean loss).

The backward pass is a scan whose every step adds each weight's gradient to an
accumulator. ``hoist-collectives`` all-reduces the accumulated gradient once after the
loop; the hand-written jit leaves the collectives where XLA's partitioner puts them. The
script prints, for both compiled programs, the all-reduces inside a while loop's body and
outside it (each one in a loop body runs once per time step), checks that the two steps
agree, and times them interleaved.

    .venv/bin/python benchmarks/bench_rnn_step.py [--reps 20] [--steps 32] [--hidden 128]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import runtime as rt  # noqa: E402

N = 8


def loss(p, xs, ys):                                   # xs: [B, T, D], ys: [B, D]
    def body(h, x):
        h = jnp.tanh(h @ p["w"] + x @ p["u"] + p["b"])
        return h, None
    h, _ = jax.lax.scan(body, jnp.zeros((xs.shape[0], p["w"].shape[0])), jnp.swapaxes(xs, 0, 1))
    return jnp.mean((h @ p["v"] - ys) ** 2)


def step(p, xs, ys):
    l, g = jax.value_and_grad(loss)(p, xs, ys)
    return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), l


def loop_all_reduces(hlo: str) -> tuple[int, int]:
    """(all-reduces in a while body, all-reduces elsewhere) of a compiled HLO text."""
    from compiler.hlo_report import collectives, while_bodies

    bodies = while_bodies(hlo)
    found = [c.computation in bodies for c in collectives(hlo) if c.kind == "all-reduce"]
    return sum(found), len(found) - sum(found)


def main() -> None:
    ap = _common.parser(__doc__, reps=20)
    ap.add_argument("--steps", type=int, default=32, help="time steps (default 32)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    ap.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    d, hdim = 32, args.hidden
    p0 = {"w": rng.normal(size=(hdim, hdim)).astype(np.float32) / np.sqrt(hdim),
          "u": rng.normal(size=(d, hdim)).astype(np.float32) / np.sqrt(d),
          "b": np.zeros(hdim, np.float32),
          "v": rng.normal(size=(hdim, d)).astype(np.float32) / np.sqrt(hdim)}
    xs = rng.normal(size=(args.batch, args.steps, d)).astype(np.float32)
    ys = rng.normal(size=(args.batch, d)).astype(np.float32)

    ours = rt.replicate(step, num_replicas=N)
    mesh = Mesh(np.asarray(jax.devices()[:N]), ("data",))
    data, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    ref = jax.jit(step, in_shardings=(repl, data, data), out_shardings=(repl, repl))

    o_sh = NamedSharding(ours.mesh, P("replica"))
    o_args = (jax.device_put(p0, NamedSharding(ours.mesh, P())),
              rt.distribute(jax.device_put(xs, o_sh), N), rt.distribute(jax.device_put(ys, o_sh), N))
    r_args = (jax.device_put(p0, repl), jax.device_put(xs, data), jax.device_put(ys, data))

    (p_o, l_o), (p_r, l_r) = ours(*o_args), ref(*r_args)
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(p_o), jax.tree.leaves(p_r)))
    print(f"check: loss ours {float(rt.reduce('mean', l_o)):.6f} vs jax.jit {float(l_r):.6f}; "
          f"max |param diff| after one step {err:.2e}")
    if err > 1e-4:
        print("WARNING: the two steps disagree")
    ours_hlo = ours.lower(*o_args).compile().as_text()
    ref_hlo = ref.lower(*r_args).compile().as_text()
    for name, hlo in (("ours   ", ours_hlo), ("jax.jit", ref_hlo)):
        inside, outside = loop_all_reduces(hlo)
        print(f"{name}: all-reduces in a loop body {inside} (each runs {args.steps}x per step), "
              f"outside {outside}")

    def run(fn, a):
        return _common.blocked(lambda: fn(*a))
    fo, fr = run(ours, o_args), run(ref, r_args)
    for f in (fo, fr):
        f(), f()
    res = _common.interleaved({"ours": fo, "jit": fr}, args.reps)
    print(f"jax {jax.__version__}, {N} {jax.devices()[0].platform} devices, batch {args.batch}, "
          f"{args.steps} time steps, hidden {hdim}")
    _common.report("RNN train step (inputs on device)", res["ours"], res["jit"], 1.05)


if __name__ == "__main__":
    main()
