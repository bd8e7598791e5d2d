"""How our compile stages scale with the size of the step: an unrolled MLP of L layers
(dense, layer norm, tanh; value_and_grad and SGD) on 8 replicas, for L in 2, 8, 32, 128.

For each L: IR ops after the passes; the stages (JAX's trace of the step, its import into
the IR, the passes, the second trace of the IR under ``jax.jit``, JAX's lowering to
StableHLO) and XLA's compile; our time per IR op (flat = linear total); and our own
stages (import, passes, second trace: what ``jax.jit`` does not do) as a share of XLA's
compile (target: under 25% at 32 layers and above); with ``jax.jit``'s trace+lower and
compile of the same global step for comparison, and the cold ratio: our whole
``lower()`` (the stages plus the verifier, the cache key and the layout, wall time) and
XLA's compile over ``jax.jit``'s (issue 15: at most 1.1 at 32 layers and above), with its
two parts (lowering, XLA) as ratios; and XLA's compile of the step written by hand per
replica (``shard_map`` + ``pmean``: the form ``replicate`` gives XLA) over jit's, which
shows what of the XLA part comes from that form; and our cold lower() + XLA over that
hand-written ``shard_map``'s lower + XLA (what ``replicate`` costs over writing the
per-replica program by hand). Medians of ``--reps`` cold builds (fresh functions, so no
cache hits); the three sides' order rotates from rep to rep.

    .venv/bin/python benchmarks/bench_scaling.py [--reps 3] [--layers 2,8,32,128]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import runtime as rt  # noqa: E402

D, BATCH = 64, 256
SHARE_TARGET = 0.25
COLD_TARGET = 1.1


def make_step(layers: int, pmean_axis: str | None = None):
    """The step; with ``pmean_axis``, written per replica (gradients averaged over it)."""
    def step(params, x, y):
        def loss(p):
            h = x
            for w, g in p:
                h = h @ w
                h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-5) * g
                h = jnp.tanh(h)
            return jnp.mean((h - y) ** 2)
        l, grads = jax.value_and_grad(loss)(params)
        if pmean_axis is not None:
            grads, l = jax.lax.pmean(grads, pmean_axis), l[None]
        return jax.tree.map(lambda a, b: a - 0.01 * b, params, grads), l
    return step


def make_shard_map_step(layers: int, mesh: Mesh):
    """The step written by hand per replica with ``shard_map`` and ``pmean`` (the form
    ``replicate`` gives XLA), for XLA's compile time of that form."""
    return jax.jit(jax.shard_map(make_step(layers, "data"), mesh=mesh,
                                 in_specs=(P(), P("data"), P("data")),
                                 out_specs=(P(), P("data")), check_vma=False))


def prepare_side(side: str, layers: int) -> Callable[[], Any]:
    """The ``layers``-layer step on up to 8 devices as ``side`` gives it to XLA: ``ours``
    (``rt.replicate``), ``sm`` (the step written by hand with ``shard_map`` + ``pmean``)
    or ``jit`` (``jax.jit``'s global step), made ready to lower: the function is built
    and its argument types made here, and the returned call only lowers it (what a
    benchmark times)."""
    n = min(8, len(jax.devices()))
    mesh = Mesh(np.asarray(jax.devices()[:n]), ("data",))
    params = [(jax.ShapeDtypeStruct((D, D), jnp.float32), jax.ShapeDtypeStruct((D,), jnp.float32))
              for _ in range(layers)]
    xg = jax.ShapeDtypeStruct((BATCH, D), jnp.float32)
    if side == "ours":
        x = rt.PerReplica([jax.ShapeDtypeStruct((BATCH // n, D), jnp.float32)] * n)
        step = rt.replicate(make_step(layers), num_replicas=n)
        return lambda: step.lower(params, x, x)
    if side == "sm":
        fn = make_shard_map_step(layers, mesh)
    elif side == "jit":
        d, r = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
        fn = jax.jit(make_step(layers), in_shardings=(r, d, d), out_shardings=(r, r))
    else:
        raise ValueError(f"side must be 'ours', 'sm' or 'jit', not {side!r}")
    return lambda: fn.lower(params, xg, xg)


def lower_side(side: str, layers: int) -> Any:
    """The step lowered (not compiled) as ``side`` gives it (:func:`prepare_side`); for
    the diagnostics that compare the three (``diag_xla_passes``, ``diag_instructions``)."""
    return prepare_side(side, layers)()


def print_row(L, ops, med, total, own, xla_t, rl, rc, paired) -> None:
    """One row of the table (see the module docstring for the columns)."""
    share = own / xla_t
    flag = "" if L < 32 else ("  OK" if share <= SHARE_TARGET else "  OVER")
    cold = paired["cold"]
    cflag = "" if L < 32 else ("  OK" if cold <= COLD_TARGET else "  OVER")
    print(f"{L:>6} {ops:>7} {med['trace'] * 1e3:>7.1f} {med['import'] * 1e3:>7.1f} "
          f"{med['passes'] * 1e3:>7.1f} {med['second trace'] * 1e3:>8.1f} "
          f"{med['StableHLO'] * 1e3:>7.1f} {total * 1e3:>7.1f} {total / ops * 1e6:>6.1f} "
          f"{med['other'] * 1e3:>6.1f} {xla_t * 1e3:>8.1f} {share:>7.0%}{flag} | "
          f"{rl * 1e3:>9.1f} {rc * 1e3:>8.1f} | {paired['lower']:>5.2f}x "
          f"{paired['XLA']:>5.2f}x {paired['sm XLA']:>5.2f}x | {cold:>12.2f}x{cflag}"
          f"  (reps {paired['cold lo']:.2f}..{paired['cold hi']:.2f}) | {paired['vs sm']:>9.2f}x")


def main() -> None:
    ap = _common.parser(__doc__, reps=3)
    ap.add_argument("--layers", default="2,8,32,128", help="comma-separated layer counts")
    args = ap.parse_args()
    n = min(8, len(jax.devices()))
    rows = []
    print(f"jax {jax.__version__}, {n} {jax.devices()[0].platform} devices; medians of {args.reps} cold builds; ms")
    print(f"{'layers':>6} {'IR ops':>7} {'trace':>7} {'import':>7} {'passes':>7} {'retrace':>8} "
          f"{'HLO':>7} {'total':>7} {'us/op':>6} {'other':>6} {'XLA':>8} {'own/XLA':>8} | "
          f"{'jit lower':>9} {'jit XLA':>8} | {'lower':>6} {'XLA':>6} {'sm XLA':>6} | "
          f"{'cold ours/jit':>13} {'':>22} | {'ours/sm':>10}")
    for L in [int(v) for v in args.layers.split(",")]:
        stages: dict[str, list[float]] = {}
        xla, ref_lower, ref_comp, sm_lower, sm_comp, walls, n_ops = [], [], [], [], [], [], 0

        def ours() -> int:
            """Our lower + compile; the stages' times noted; the IR op count returned.
            The ``Lowered`` (and the IR it keeps) is freed and collected before the other
            side runs (``_common.settle``), so neither side pays for the other's garbage."""
            lower = prepare_side("ours", L)
            t0 = time.perf_counter()
            lowered = lower()
            walls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            lowered.compile()
            xla.append(time.perf_counter() - t0)
            times = lowered.pass_times()
            split = lowered.import_times()
            times.pop("import")
            ours_t = {"trace": split["trace"], "import": split["import"]}
            ours_t["second trace"] = times.pop("retrace (IR under jax.jit)", 0.0)
            ours_t["StableHLO"] = times.pop("lower to StableHLO", 0.0)
            ours_t["passes"] = sum(times.values())
            for k, v in ours_t.items():
                stages.setdefault(k, []).append(v)
            return sum(1 for _ in lowered.ir().walk())

        def jit() -> None:
            lower = prepare_side("jit", L)
            t0 = time.perf_counter()
            jl = lower()
            t1 = time.perf_counter()
            jl.compile()
            ref_lower.append(t1 - t0)
            ref_comp.append(time.perf_counter() - t1)

        def sm() -> None:
            lower = prepare_side("sm", L)
            t0 = time.perf_counter()
            sl = lower()
            t1 = time.perf_counter()
            sl.compile()
            sm_lower.append(t1 - t0)
            sm_comp.append(time.perf_counter() - t1)

        sides = (ours, jit, sm)
        for rep in range(args.reps):
            # the order rotates: no side always runs right after a compile of another's
            # (or its own) program; each starts with the garbage collected
            for side in sides[rep % 3:] + sides[:rep % 3]:
                _common.settle()
                n_ops = side() or n_ops
        med = {k: statistics.median(v) for k, v in stages.items()}
        total = sum(med.values())
        own = med["import"] + med["passes"] + med["second trace"]
        med["other"] = max(0.0, statistics.median(walls) - total)
        # the ratios are medians of each rep's own ratio (ours and jit's side by side in
        # one rep): a slow stretch of the machine then slows both sides of a ratio
        colds = [(w + c) / (jw + jc) for w, c, jw, jc in zip(walls, xla, ref_lower, ref_comp)]
        paired = {
            "cold": statistics.median(colds), "cold lo": min(colds), "cold hi": max(colds),
            "lower": statistics.median(w / jw for w, jw in zip(walls, ref_lower)),
            "XLA": statistics.median(c / jc for c, jc in zip(xla, ref_comp)),
            "sm XLA": statistics.median(c / jc for c, jc in zip(sm_comp, ref_comp)),
            "vs sm": statistics.median((w + c) / (sl + sc) for w, c, sl, sc
                                       in zip(walls, xla, sm_lower, sm_comp))}
        rows.append((L, n_ops, med, total, own, statistics.median(xla),
                     statistics.median(ref_lower), statistics.median(ref_comp), paired))
        print_row(*rows[-1])  # as it is measured: a run stopped later keeps its rows
    per_op = [total / ops for _, ops, _, total, *_ in rows if ops >= 1000] or \
        [total / ops for _, ops, _, total, *_ in rows]
    print(f"-- our time per IR op from 1,000 ops up: {min(per_op) * 1e6:.1f}..{max(per_op) * 1e6:.1f}"
          f" us (max/min {max(per_op) / min(per_op):.2f}: flat means linear); own = import + "
          f"passes + second trace, target <= {SHARE_TARGET:.0%} of XLA at 32 layers and above; "
          f"other = verifier, cache key, layout; cold = (our lower() + XLA) / (jit lower + "
          f"XLA), target <= {COLD_TARGET} at 32 layers and above (reps: the lowest and highest "
          f"rep's ratio, the spread this machine's noise gives the median); lower, XLA = its two "
          f"parts, ours over jit's (ratios: medians of each rep's ratio); sm XLA = XLA's "
          f"compile of the step written by hand per replica (shard_map + pmean, the form "
          f"replicate gives XLA) over jit's; ours/sm = our cold lower() + XLA over that "
          f"hand-written shard_map's lower + XLA (what replicate costs over writing the "
          f"per-replica program by hand)")


if __name__ == "__main__":
    main()
