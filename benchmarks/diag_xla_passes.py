"""Where XLA's compile time goes, pass by pass: the L-layer step of ``bench_scaling`` as
``replicate`` gives it to XLA, as the hand-written ``shard_map`` + ``pmean`` step (the
same per-replica form) and as ``jax.jit``'s global step. A diagnostic, not a benchmark
with a target: run it when the "XLA" or "sm XLA" ratio of ``bench_scaling`` moves.

Each compile runs in its own process with XLA's pass-pipeline log on
(``TF_CPP_VMODULE=hlo_pass_pipeline=1``); the time of every run of a pass is summed per
pass name, and the medians over ``--reps`` compiles (the three sides' order rotating) are
printed: the passes whose time differs most between our program and jit's, the
hand-written ``shard_map``'s beside them, and each side's total of pass time and its
whole compile. What the per-replica form costs XLA shows as passes where ``ours`` and
``sm`` agree and both differ from ``jit`` (at 32 layers on CPU: ``call-inliner`` inlining
the ``shard_map`` body after partitioning, ``spmd-partitioning``, ``shardy-xla``).

    .venv/bin/python benchmarks/diag_xla_passes.py [--layers 32] [--reps 3] [--top 15]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

SIDES = ("ours", "sm", "jit")
_MARK = "-- compile starts --"
# hlo_pass_pipeline.cc: "HLO pass: <name> time: 13.7 ms (13655 us) (cumulative: ...)"
_PASS = re.compile(r"HLO pass: (\S+) time: \S+ \S+ \((\d+) us\)")


def child(side: str, layers: int) -> None:
    """Lower the step for ``side``, then compile it once, the log marked where the
    compile starts; prints the compile's wall time on stdout."""
    from bench_scaling import lower_side

    lowered = lower_side(side, layers)
    print(_MARK, file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    lowered.compile()
    print(time.perf_counter() - t0, flush=True)


def run(side: str, layers: int) -> tuple[float, dict[str, float]]:
    """One compile of ``side`` in a new process: (wall seconds, pass name -> seconds)."""
    env = dict(os.environ, TF_CPP_VMODULE="hlo_pass_pipeline=1", TF_CPP_MIN_LOG_LEVEL="0")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", side,
                          "--layers", str(layers)], capture_output=True, text=True, env=env)
    if out.returncode:
        tail = "\n".join(out.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the {side} compile's process exited with {out.returncode}:\n{tail}")
    log = out.stderr.split(_MARK, 1)[-1]
    passes: dict[str, float] = {}
    for name, us in _PASS.findall(log):
        passes[name] = passes.get(name, 0.0) + int(us) * 1e-6
    if not passes:
        raise RuntimeError(f"no 'HLO pass:' lines in the {side} compile's log: this XLA "
                           f"does not log pass times at TF_CPP_VMODULE=hlo_pass_pipeline=1")
    return float(out.stdout.strip().splitlines()[-1]), passes


def main() -> None:
    ap = _common.parser(__doc__, reps=3)
    ap.add_argument("--layers", type=int, default=32, help="layers of the step (default 32)")
    ap.add_argument("--top", type=int, default=15, help="passes to list (default 15)")
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.layers)
        return
    walls: dict[str, list[float]] = {s: [] for s in SIDES}
    per_pass: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
    for rep in range(args.reps):
        for side in SIDES[rep % 3:] + SIDES[:rep % 3]:
            wall, passes = run(side, args.layers)
            walls[side].append(wall)
            for name, t in passes.items():
                per_pass[side].setdefault(name, []).append(t)
    names = set().union(*(per_pass[s] for s in SIDES))
    # (a pass that did not run in a compile counts 0 there)
    med = {s: {p: statistics.median(per_pass[s].get(p, []) + [0.0] * (
        args.reps - len(per_pass[s].get(p, [])))) for p in names} for s in SIDES}
    print(f"{args.layers}-layer step, medians of {args.reps} compiles per side, ms")
    print(f"{'pass':<40} {'ours':>8} {'sm':>8} {'jit':>8} {'ours-jit':>9} {'sm-jit':>8}")
    ranked = sorted(names, key=lambda p: -abs(med["ours"][p] - med["jit"][p]))
    for p in ranked[:args.top]:
        o, s, j = (med[k][p] * 1e3 for k in SIDES)
        print(f"{p:<40} {o:>8.1f} {s:>8.1f} {j:>8.1f} {o - j:>+9.1f} {s - j:>+8.1f}")
    tot = {s: sum(med[s].values()) * 1e3 for s in SIDES}
    wall = {s: statistics.median(walls[s]) * 1e3 for s in SIDES}
    print(f"{'all passes (sum of medians)':<40} {tot['ours']:>8.1f} {tot['sm']:>8.1f} "
          f"{tot['jit']:>8.1f} {tot['ours'] - tot['jit']:>+9.1f} {tot['sm'] - tot['jit']:>+8.1f}")
    print(f"{'whole compile (wall, with the log on)':<40} {wall['ours']:>8.1f} {wall['sm']:>8.1f} "
          f"{wall['jit']:>8.1f} {wall['ours'] - wall['jit']:>+9.1f} {wall['sm'] - wall['jit']:>+8.1f}")


if __name__ == "__main__":
    main()
