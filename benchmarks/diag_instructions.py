"""Instructions, not seconds: the L-layer step of ``bench_scaling`` built cold as
``replicate`` gives it (``ours``), as the hand-written ``shard_map`` + ``pmean`` step
(``sm``) and as ``jax.jit``'s global step (``jit``), each counted by valgrind's
cachegrind. A diagnostic, not a benchmark with a target.

On this 2-core VM the wall-clock cold ratio of ``bench_scaling`` moves by more than
0.1 between runs (single reps 0.9–1.4 at 32 layers), which hides any change of a few
percent. An instruction count is the same from run to run (``PYTHONHASHSEED=0``; XLA's
threads are counted, serialized), so it tells whether a change did what it meant to. It
is not time: Python runs fewer instructions per cycle than XLA's C++, memory stalls do
not count, and the threads run one at a time. Use it to compare two versions of our
code, and read the wall-clock benchmarks for the figures.

Each side runs in its own process under ``valgrind --tool=cachegrind --cache-sim=no``:
the process lowers and compiles a 2-layer step of every side first (JAX's and our
one-time costs), then builds the ``--layers`` step of its side (``--phase cold``: lower +
compile; ``lower``: lower only). A ``base`` process does the warm-up alone; its count is
subtracted. Two processes run at a time; at 32 layers the run takes ~6 minutes here.

To compare two versions of our code, run ``--sides ours`` in each checkout (half the
time): the counts of the same side differ only by what changed.

    .venv/bin/python benchmarks/diag_instructions.py [--layers 32] [--phase cold|lower]
                                                     [--sides ours,sm,jit]
"""
from __future__ import annotations

import _common  # noqa: F401  (sets XLA_FLAGS and sys.path before JAX is imported)

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

SIDES = ("ours", "sm", "jit")
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def child(side: str, layers: int, phase: str) -> None:
    """The warm-up (every side's 2-layer step, lowered and compiled), then ``side``'s
    ``layers`` step (nothing more for ``base``)."""
    from bench_scaling import lower_side

    for s in SIDES:
        lower_side(s, 2).compile()
    if side != "base":
        lowered = lower_side(side, layers)
        if phase == "cold":
            lowered.compile()


def count(side: str, layers: int, phase: str) -> int:
    """Instructions of one process (``child``) under cachegrind."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "valgrind.log")
        cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               f"--log-file={log}", sys.executable, os.path.abspath(__file__), "--child", side,
               "--layers", str(layers), "--phase", phase]
        out = subprocess.run(cmd, capture_output=True, text=True,
                             env=dict(os.environ, PYTHONHASHSEED="0"))
        text = open(log).read() if os.path.exists(log) else ""
        found = _REFS.search(text)
        if out.returncode or not found:
            tail = "\n".join((out.stderr + text).strip().splitlines()[-15:])
            raise RuntimeError(f"the {side} process exited with {out.returncode}:\n{tail}")
        return int(found.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32, help="layers of the step (default 32)")
    ap.add_argument("--phase", choices=("cold", "lower"), default="cold",
                    help="cold: lower + XLA's compile (default); lower: lowering only")
    ap.add_argument("--sides", default=",".join(SIDES),
                    help="comma-separated sides to count (default ours,sm,jit)")
    ap.add_argument("--child", choices=SIDES + ("base",), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.layers, args.phase)
        return
    sides = tuple(s for s in args.sides.split(",") if s)
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides:
        ap.error(f"--sides: {', '.join(bad) or 'none given'}; choose from {', '.join(SIDES)}")
    if shutil.which("valgrind") is None:
        sys.exit("diag_instructions: valgrind is not installed (apt-get install valgrind)")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {s: pool.submit(count, s, args.layers, args.phase) for s in ("base",) + sides}
        refs = {s: f.result() for s, f in futures.items()}
    own = {s: refs[s] - refs["base"] for s in sides}
    what = "lower + compile" if args.phase == "cold" else "lower"
    print(f"{args.layers}-layer step, {what}, instructions (cachegrind; warm-up subtracted)")
    for s in sides:
        vs_jit = f"   {own[s] / own['jit']:6.3f}x jit" if "jit" in own else ""
        print(f"   {s:<5} {own[s] / 1e9:8.3f} G{vs_jit}")
    if "ours" in own and "sm" in own:
        print(f"   ours/sm {own['ours'] / own['sm']:.3f}x")
    print(f"   (base, the warm-up: {refs['base'] / 1e9:.3f} G)")


if __name__ == "__main__":
    main()
