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
import os
import sys

from tools._common import (add_compile_options, add_debug_option, check_compile_options,
                           ensure_devices, lower_step, output_paths, run_tool, writable_dir)

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)

    def body() -> int:
        check_compile_options(ns)
        if ns.out is None:
            ns.out = os.path.abspath(f"inspect-{ns.target.rsplit(':', 1)[-1]}")
        writable_dir(ns.out, "--out")
        # parse first, JAX later: the device count must be in XLA_FLAGS before it starts
        ensure_devices(ns.replicas * ns.logical_devices, "tools.inspect", argv, ns.platform)
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
