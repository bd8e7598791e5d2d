"""Shared set-up and timing for the benchmarks: 8 virtual CPU devices (set before JAX is
imported), the repository on ``sys.path``, interleaved timing, medians and ratios."""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402


def parser(doc: str, reps: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--reps", type=int, default=reps, help=f"repetitions (default {reps})")
    return ap


def interleaved(fns: dict[str, Callable[[], float | None]], reps: int) -> dict[str, list[float]]:
    """Run every ``fn`` once per repetition, alternating which goes first, so drift (CPU
    frequency, other load) hits all of them alike, each after :func:`settle`. A ``fn``
    returns the seconds it measured itself, or ``None`` to be timed from outside."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        order = names if i % 2 == 0 else names[::-1]
        for n in order:
            settle()
            t0 = time.perf_counter()
            dt = fns[n]()
            out[n].append(time.perf_counter() - t0 if dt is None else dt)
    return out


def settle() -> None:
    """Collect the garbage earlier samples left, before the next one is timed. Without it
    one side pays the other's collections: ``replicate`` pauses the collector while it
    builds a program, and the objects it made (the IR the ``Lowered`` keeps) were
    collected inside the ``jax.jit`` sample that followed; at 32 layers that made jit's
    lowering ~20 ms slower and our cold ratio look ~0.04 better than it is."""
    gc.collect()


def blocked(f: Callable[[], object]) -> Callable[[], float]:
    """A sample for :func:`interleaved`: the seconds ``f()`` takes until its result is
    ready (``jax.block_until_ready``, which also waits on a ``PerReplica``)."""
    import jax

    def sample() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(f())
        return time.perf_counter() - t0
    return sample


def fmt(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.2f} us"
    if seconds < 1:
        return f"{seconds * 1e3:8.3f} ms"
    return f"{seconds:8.3f} s "


def report(title: str, ours: list[float], ref: list[float], target: float | None,
           ours_name: str = "ours (rt.replicate)", ref_name: str = "jax.jit",
           ratio_name: str = "ours/jax.jit") -> float:
    """Print medians (and quartiles) of both and the ratio of the medians."""
    def q(xs):
        qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        return qs[0], statistics.median(xs), qs[2]
    o, r = q(ours), q(ref)
    ratio = o[1] / r[1]
    print(f"-- {title}  ({len(ours)} reps each, interleaved)")
    print(f"   {ours_name:<24} median {fmt(o[1])}   (p25 {fmt(o[0])}, p75 {fmt(o[2])})")
    print(f"   {ref_name:<24} median {fmt(r[1])}   (p25 {fmt(r[0])}, p75 {fmt(r[2])})")
    if target is None:
        print(f"   ratio ({ratio_name}): {ratio:.2f}x  (informational: no target of its own)")
    else:
        verdict = "OK" if ratio <= target else "OVER TARGET"
        print(f"   ratio ({ratio_name}): {ratio:.2f}x  target <= {target:g}x  [{verdict}]")
    return ratio
