"""Compile a step offline for N replicas × K logical devices and show what XLA made of it.

    python -m tools.inspect model.py:train_step --args model.py:make_args \\
        --replicas 8 --logical-devices 4 --out /tmp/inspect
    replicate-inspect ...            # the same, as a console script

Writes into ``--out``: ``ir/NN-<pass>.txt`` (the IR after every pass), ``stablehlo.mlir``,
``hlo.txt`` (partitioned, optimized HLO) and ``report.json`` (see ``runtime.report``),
and prints a summary: collectives, memory per device, shardings of inputs and outputs,
and the IR ops with the most flops. The machine needs no accelerator: N × K virtual CPU
devices are made (``XLA_FLAGS`` is set before JAX starts; from a process where JAX
already runs with fewer devices the tool re-runs itself in a subprocess).
"""
from __future__ import annotations

from tools._common import ArgumentParser as _ArgumentParser  # noqa: E402

import argparse
import json
import os
import sys
from typing import Any

from tools._common import (add_compile_options, add_debug_option, check_compile_options,
                           ensure_target, lower_step, output_paths, run_tool, writable_dir)

DESCRIPTION = __doc__


def build_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog="python -m tools.inspect", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="FILE.py:FUNCTION",
                   help="the per-replica step function (a plain function or an rt.replicate "
                        "object, whose options are then ignored)")
    add_compile_options(p)
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default: ./inspect-<FUNCTION>); created if missing")
    p.add_argument("--sweep", action="store_true",
                   help="with --target tpu:...: compile every split of the topology's devices "
                        "into N replicas x K logical devices that the step's annotations allow "
                        "(--replicas and --logical-devices are ignored; MAKE_ARGS is called for "
                        "each), print one table ranked by the roofline estimate, and write "
                        "sweep.json; progress goes to stderr")
    p.add_argument("-j", "--jobs", type=int, default=None, metavar="J",
                   help="--sweep: compiles run in J threads (default: the CPU count)")
    p.add_argument("--quiet", action="store_true", help="print only the output folder")
    add_debug_option(p)
    return p


def run(ns: argparse.Namespace) -> dict:
    """Compile and write the output folder; return the report."""
    from runtime.report import write_dump

    _, lowered, in_paths = lower_step(ns, ns.target)
    compiled = lowered.compile()
    program = compiled._program
    return write_dump(program, ns.out, in_paths, output_paths(program),
                      padding_overhead=getattr(ns, "padding_overhead", None))


def plans(n: int) -> list[tuple[int, int]]:
    """Every (replicas, logical devices) with replicas x logical devices = ``n``."""
    return [(n // k, k) for k in range(1, n + 1) if n % k == 0]


def _plan_row(n: int, k: int) -> dict:
    return {"replicas": n, "logical_devices": k, "status": "not allowed", "estimate_s": None,
            "bound": None, "peak_bytes": None, "fits": None, "collective_bytes": None,
            "compile_s": None, "error": None, "examples": None, "per_example_s": None}


def _examples(lowered: Any, n: int) -> int | None:
    """Rows one step processes: the leading dim of the step's first per-replica input
    times the replicas (``None`` without one). ``make_args`` may give each plan another
    global batch (a fixed batch per replica): plans are ranked by time per example."""
    from ir.types import Replica
    for v in lowered.ir(after="import").inputs:
        if v.type.replica is Replica.VARYING and v.type.rank and isinstance(v.type.shape[0], int):
            return int(v.type.shape[0]) * n
    return None


def sweep(ns: argparse.Namespace) -> list[dict]:
    """Lower the step for every plan (in turn: tracing is Python), compile the lowered
    ones in ``ns.jobs`` threads (XLA's compile releases the GIL), and rank the rows: plans
    that fit by their estimate, then those that do not fit, then those not allowed."""
    import copy
    import time
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from runtime.tpu import DoesNotFitError, tpu_devices
    from tools._common import tpu_topology

    topo = tpu_topology(ns)
    total = len(tpu_devices(topo))
    rows, lowered = [], []
    todo = plans(total)
    for i, (n, k) in enumerate(todo):
        row = _plan_row(n, k)
        rows.append(row)
        sub = copy.copy(ns)
        sub.replicas, sub.logical_devices = n, k
        print(f"[sweep] {i + 1}/{len(todo)} lowering {n} replicas x {k} logical devices",
              file=sys.stderr, flush=True)
        try:
            lowered.append((row, lower_step(sub, ns.target)[1]))
            row["examples"] = _examples(lowered[-1][1], n)
        except Exception as e:  # noqa: BLE001 - an annotation this split cannot hold
            row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"

    def compile_one(row: dict, lo) -> dict:
        t0 = time.perf_counter()
        try:
            c = lo.compile()
        except DoesNotFitError as e:
            row.update(status="does not fit", fits=False, peak_bytes=e.fit.peak_bytes,
                       error=str(e.fit).splitlines()[0])
        except Exception as e:  # noqa: BLE001 - reported in the row
            row.update(status="compile error",
                       error=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}")
        else:
            fit, roof = c.memory_fit(), c.roofline()
            row.update(status="ok" if fit.fits else "does not fit", fits=fit.fits,
                       peak_bytes=fit.peak_bytes, estimate_s=roof.estimate_s, bound=roof.bound,
                       collective_bytes=roof.collective_bytes,
                       per_example_s=roof.estimate_s / row["examples"] if row["examples"]
                       else None)
        row["compile_s"] = time.perf_counter() - t0
        return row

    jobs = max(1, ns.jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=min(jobs, max(1, len(lowered)))) as pool:
        futures = [pool.submit(compile_one, row, lo) for row, lo in lowered]
        for done, f in enumerate(as_completed(futures), 1):
            r = f.result()
            print(f"[sweep] compiled {done}/{len(futures)}: {r['replicas']} x "
                  f"{r['logical_devices']} ({r['status']}, {r['compile_s']:.2f} s)",
                  file=sys.stderr, flush=True)
    order = {"ok": 0, "does not fit": 1, "compile error": 2, "not allowed": 3}
    # (by time per example where every plan has one: plans of other global batches do
    # other amounts of work; found by a probe: the one doing least work ranked first)
    per_example = all(r["per_example_s"] is not None for r in rows if r["estimate_s"] is not None)
    key = "per_example_s" if per_example else "estimate_s"
    rows.sort(key=lambda r: (order[r["status"]], r[key] if r[key] is not None
                             else float("inf"), r["peak_bytes"] or 0))
    return rows


def sweep_table(rows: list[dict], target: str) -> str:
    """The ranked plans as an aligned table (best first)."""
    from runtime.tpu import _human_bytes
    head = ("rank", "replicas x K", "estimate", "examples", "per example", "bound",
            "peak memory", "fits", "collective bytes", "status")
    out = [head]
    for i, r in enumerate(rows, 1):
        out.append((str(i), f"{r['replicas']} x {r['logical_devices']}",
                    f"{r['estimate_s'] * 1e3:.4g} ms" if r["estimate_s"] is not None else "-",
                    str(r["examples"]) if r.get("examples") else "-",
                    f"{r['per_example_s'] * 1e6:.4g} us" if r.get("per_example_s") else "-",
                    r["bound"] or "-",
                    _human_bytes(r["peak_bytes"]) if r["peak_bytes"] is not None else "-",
                    {True: "yes", False: "no", None: "-"}[r["fits"]],
                    str(r["collective_bytes"]) if r["collective_bytes"] is not None else "-",
                    r["status"] + (f": {r['error']}" if r["error"] and r["status"] != "ok"
                                   else "")))
    w = [max(len(row[i]) for row in out) for i in range(len(head) - 1)]
    lines = [f"sweep over {target} (roofline estimates; see runtime/tpu.py):"]
    lines += ["  " + "  ".join(row[i].ljust(w[i]) for i in range(len(w))) + "  " + row[-1]
              for row in out]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)

    def body() -> int:
        check_compile_options(ns)
        if ns.out is None:
            ns.out = os.path.abspath(f"inspect-{ns.target.rsplit(':', 1)[-1]}")
        writable_dir(ns.out, "--out")
        # parse first, JAX later: the device count must be in XLA_FLAGS before it starts
        ensure_target(ns, "tools.inspect", argv)
        if ns.sweep:
            from tools._common import ToolError, tpu_topology
            if tpu_topology(ns) is None:
                raise ToolError("--sweep needs a TPU target (--target tpu:GENERATION:TOPOLOGY): "
                                "it ranks plans by the chip's memory and roofline estimate")
            rows = sweep(ns)
            with open(os.path.join(ns.out, "sweep.json"), "w") as f:
                json.dump({"target": ns.compile_target, "plans": rows}, f, indent=1)
            print(sweep_table(rows, ns.compile_target))
            print(f"wrote {ns.out}/sweep.json")
            return 0
        report = run(ns)
        from runtime.report import summary
        if not ns.quiet:
            print(summary(report))
            print()
        print(f"wrote {ns.out}/: ir/ stablehlo.mlir hlo.txt report.json")
        return 0
    return run_tool("inspect", body, ns.debug)


if __name__ == "__main__":
    sys.exit(main())
