"""What one compile produced, as files and as a report: shared by ``tools.inspect`` and
the runtime's dumps (``RunOptions(dump_dir=...)`` / ``$RT_DUMP_DIR``).

:func:`write_dump` writes, into one folder::

    ir/NN-<pass>.txt   the IR after each pass ("// pass: <name>  time: <ms>" header)
    stablehlo.mlir     the StableHLO module (when the program was lowered in this process)
    hlo.txt            the partitioned, optimized HLO
    report.json        see :func:`build_report`

:func:`summary` renders a report as text: the collectives, memory per device and the IR
ops with the most flops. Flops per IR op are our own estimate (:func:`op_flops`):
``dot_general`` 2·M·N·K (batch dims included), convolutions 2·out·(kernel window ×
input features per group), elementwise ops and reductions one per element.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

from compiler import hlo_report
from compiler.pass_manager import PassRecord
from ir.graph import Graph, Op
from ir.printer import value_names
from ir.types import SymDim, TensorType

__all__ = ["op_flops", "top_ops", "build_report", "target_report", "write_dump", "write_ir", "summary",
           "REPORT_VERSION"]

REPORT_VERSION = 1

_ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex conj cos cosh
div erf erf_inv erfc exp exp2 expm1 floor imag integer_pow is_finite lgamma digamma log
log1p logistic max min mul ne eq lt le gt ge neg nextafter not or pow real rem round rsqrt
select_n sign sin sinh sqrt square sub tan tanh xor shift_left shift_right_arithmetic
shift_right_logical population_count convert_element_type reduce_precision
""".split())
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                         "reduce_and", "reduce_or", "argmax", "argmin", "cumsum", "cumprod",
                         "cummax", "cummin", "cumlogsumexp", "all_reduce", "psum"})


def _numel(t: TensorType) -> int:
    n = 1
    for d in t.shape:
        n *= (d.bound or 1) if isinstance(d, SymDim) else d
    return n


def _dims_of(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else ()


def op_flops(op: Op) -> int:
    """Our estimate of the flops of one IR op (its regions included; a ``scan`` body
    counts ``length`` times, a ``while`` body once, a ``cond`` its costliest branch: one
    branch runs)."""
    name = op.name
    if name == "dot_general" and op.results:
        dn = op.attr("dimension_numbers")
        contract = _dims_of(dn[0][0]) if isinstance(dn, tuple) and dn else ()
        lhs = op.operands[0].type
        k = 1
        for d in contract:
            s = lhs.shape[d]
            k *= (s.bound or 1) if isinstance(s, SymDim) else s
        return 2 * _numel(op.results[0].type) * k
    if name.startswith("conv_general_dilated") and op.results:
        rhs = op.operands[1].type
        dn = op.attr("dimension_numbers")
        out_feat_dim = 0
        if isinstance(dn, tuple) and len(dn) == 3 and isinstance(dn[1], tuple) and dn[1]:
            out_feat_dim = int(dn[1][0])
        out_feat = rhs.shape[out_feat_dim] if rhs.rank else 1
        out_feat = (out_feat.bound or 1) if isinstance(out_feat, SymDim) else max(int(out_feat), 1)
        return 2 * _numel(op.results[0].type) * (_numel(rhs) // out_feat)
    total = 0
    if name in _ELEMENTWISE and op.results:
        total = _numel(op.results[0].type)
    elif name in _REDUCTIONS and op.operands:
        total = _numel(op.operands[0].type)
    reps = op.attr("length", 1) if name == "scan" else 1
    reps = reps if isinstance(reps, int) and reps > 0 else 1
    per_region = [sum(op_flops(inner) for inner in region.ops) for region in op.regions]
    if name == "cond":
        return total + max(per_region, default=0)
    return total + reps * sum(per_region)


def top_ops(graph: Graph, n: int = 10) -> list[dict[str, Any]]:
    """The ``n`` top-level ops of ``graph`` with the most flops (our estimate), most
    first: ``{"value", "op", "flops", "type", "source"}``."""
    names = value_names(graph)
    rows = []
    for op in graph.ops:
        f = op_flops(op)
        if f <= 0:
            continue
        rows.append({
            "value": names.get(op.results[0], "?") if op.results else "-",
            "op": op.name, "flops": f,
            "type": str(op.results[0].type) if op.results else "",
            "source": f"{os.path.basename(op.loc.file)}:{op.loc.line}" if op.loc else "-",
            "source_file": op.loc.file if op.loc else None,
        })
    rows.sort(key=lambda r: -r["flops"])
    return rows[:n]


def _first(x: Any) -> Any:
    """``cost_analysis()`` is a dict in jax 0.10, a list of one dict in older ones."""
    if isinstance(x, (list, tuple)):
        return x[0] if x else {}
    return x or {}


def _memory(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes", "alias_size_in_bytes")
    out = {k.replace("_size_in_bytes", "_bytes"): int(getattr(stats, k, 0) or 0) for k in keys}
    out["total_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                          + out["generated_code_bytes"] - out["alias_bytes"])
    return out


def _value_sides(graph: Graph, values: Iterable, jax_shardings: list, paths: list | None,
                 ) -> list[dict[str, Any]]:
    names = value_names(graph)
    out = []
    for i, v in enumerate(values):
        sh = jax_shardings[i] if i < len(jax_shardings) else None
        out.append({
            "index": i,
            "path": paths[i] if paths and i < len(paths) else None,
            "ir_value": names.get(v, "?"),
            "type": str(v.type),
            "replica": str(v.type.replica) if v.type.replica is not None else None,
            "xla_sharding": str(v.type.sharding) if v.type.sharding is not None else None,
            "jax_sharding": str(sh) if sh is not None else None,
        })
    return out


def build_report(program: Any, input_paths: list[str] | None = None,
                 output_paths: list[str] | None = None) -> dict[str, Any]:
    """The report of one compiled program (a ``runtime.program.Program`` with its
    executable): flops and bytes accessed (XLA's ``cost_analysis``), memory per device
    (``memory_analysis``: the SPMD program is the same on every device), the collectives
    of the partitioned HLO (``compiler.hlo_report.to_json``), each flat input's and
    output's sharding (XLA notation from the IR after the last pass, JAX's from the
    executable), our top-10 IR ops by flops, and ``padding_overhead`` (``None`` until
    dynamic shapes exist)."""
    import jax  # the runtime layer: JAX is already loaded wherever a program exists

    compiled = program.jax_compiled
    graph = program.records[-1].graph
    owner = program.owner
    cost = _first(compiled.cost_analysis())
    try:
        mem = _memory(compiled.memory_analysis())
    except Exception:  # noqa: BLE001 - some backends have no memory analysis
        mem = None
    hlo = compiled.as_text()
    in_sh = list(jax.tree.leaves(compiled.input_shardings[0]))
    out_sh = list(jax.tree.leaves(compiled.output_shardings))
    syms = getattr(program, "dyn_syms", ())
    if input_paths is not None and syms:  # dynamic shapes: the real sizes come first
        input_paths = [f"(real size of dim {s})" for s in syms] + list(input_paths)
    return {
        "version": REPORT_VERSION,
        "function": getattr(owner.fn, "__qualname__", getattr(owner.fn, "__name__", "?")),
        "num_replicas": owner.num_replicas,
        "logical_devices": owner.logical_devices,
        "devices": int(owner.num_replicas * owner.logical_devices),
        "mesh": {str(k): int(v) for k, v in owner.mesh.shape.items()},
        "passes": [{"name": r.name, "seconds": r.seconds} for r in program.records],
        "flops": float(cost.get("flops", 0.0)) if cost else None,
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)) if cost else None,
        "memory_per_device": mem,
        "collectives": hlo_report.to_json(hlo_report.collectives(hlo)),
        "inputs": _value_sides(graph, graph.inputs, in_sh, input_paths),
        "outputs": _value_sides(graph, graph.outputs, out_sh, output_paths),
        "top_ops": top_ops(graph),
        "ir_flops_total": sum(op_flops(op) for op in graph.ops),
        "padding_overhead": None,
        **target_report(program),
    }


def target_report(program: Any) -> dict[str, Any]:
    """``target`` (what the step compiled for), ``memory_fit`` (per-device memory against
    the device's HBM, ``None`` where the capacity is unknown, as on CPU) and ``roofline``
    (``runtime.tpu``'s estimate, ``None`` off TPU) of a compiled program."""
    from runtime.stages import Compiled

    c = Compiled(program)
    out: dict[str, Any] = {"target": c.target, "memory_fit": None, "roofline": None}
    try:
        out["memory_fit"] = c.memory_fit().to_json()
    except ValueError:
        pass
    try:
        out["roofline"] = c.roofline().to_json()
    except ValueError:
        pass
    return out


def write_ir(records: Iterable[PassRecord], folder: str) -> list[str]:
    """``folder/NN-<pass>.txt`` per record, in the pass manager's dump format."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for i, r in enumerate(records):
        path = os.path.join(folder, f"{i:02d}-{r.name}.txt")
        with open(path, "w") as f:
            f.write(f"// pass: {r.name}  time: {r.seconds * 1e3:.3f} ms\n{r.graph}\n")
        paths.append(path)
    return paths


def write_dump(program: Any, folder: str, input_paths: list[str] | None = None,
               output_paths: list[str] | None = None,
               padding_overhead: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``ir/``, ``stablehlo.mlir``, ``hlo.txt`` and ``report.json`` of a compiled
    program into ``folder``; return the report. ``padding_overhead``: with dynamic shapes,
    the real rows, the bucket and the padded share."""
    os.makedirs(folder, exist_ok=True)
    write_ir(program.records, os.path.join(folder, "ir"))
    if getattr(program, "jax_lowered", None) is not None:
        with open(os.path.join(folder, "stablehlo.mlir"), "w") as f:
            f.write(program.jax_lowered.as_text())
    with open(os.path.join(folder, "hlo.txt"), "w") as f:
        f.write(program.jax_compiled.as_text())
    report = build_report(program, input_paths, output_paths)
    if padding_overhead is not None:
        report["padding_overhead"] = padding_overhead
    with open(os.path.join(folder, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def _human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}P"


def summary(report: dict[str, Any]) -> str:
    """A readable text summary of a report: totals, collectives, memory per device, the
    inputs' and outputs' shardings and the IR ops with the most flops."""
    lines = [f"{report['function']}: {report['num_replicas']} replicas x "
             f"{report['logical_devices']} logical devices = {report['devices']} devices"
             + (f" ({report['target']})" if report.get("target") else ""),
             f"flops (XLA, per device): {_human(report['flops'])}   "
             f"bytes accessed: {_human(report['bytes_accessed'])}", "", "collectives:"]
    cols = report["collectives"]
    if cols:
        rows = [("kind", "bytes", "group size", "source")]
        for c in cols:
            size = ("pairs" if c["kind"] == "collective-permute" else
                    len(c["replica_groups"][0]) if c["replica_groups"] else "all")
            trips = c.get("trips", 1)
            runs = "" if trips == 1 else (" x ?" if trips is None else f" x {trips}")
            rows.append((c["kind"] + (" (async)" if c["is_async"] else ""),
                         f"{c['bytes']}{runs}", str(size), c["source"]))
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        lines += ["  " + "  ".join(r[i].ljust(w[i]) for i in range(4)).rstrip() for r in rows]
    step_bytes = sum(c.get("step_bytes", c["bytes"]) or 0 for c in cols)
    unknown = sum(1 for c in cols if c.get("trips", 1) is None)
    lines.append(f"  {len(cols)} collective(s), {step_bytes} bytes per device per call"
                 + (f" ({unknown} in loops of unknown trip count left out)" if unknown else "")
                 + ("; x N: in a loop that runs N times"
                    if any(c.get("trips", 1) != 1 for c in cols) else ""))
    lines += ["", "memory per device:"]
    mem = report["memory_per_device"]
    if mem:
        for k in ("argument_bytes", "output_bytes", "temp_bytes", "generated_code_bytes",
                  "alias_bytes", "total_bytes"):
            lines.append(f"  {k:22s} {mem[k]:>12d}")
    else:
        lines.append("  (not available)")
    lines += ["", "inputs / outputs (IR sharding | jax sharding):"]
    for side in ("inputs", "outputs"):
        for v in report[side]:
            label = v["path"] or v["ir_value"]
            js = v["jax_sharding"] or "-"
            if "spec=" in js:  # NamedSharding(mesh=..., spec=P(...), ...): the spec says it
                js = js.split("spec=", 1)[1].split(", memory_kind")[0]
                while js.endswith(")") and js.count(")") > js.count("("):
                    js = js[:-1]
            lines.append(f"  {side[:-1]:6s} {label}: {v['type']} | {js}")
    lines += ["", "IR ops with the most flops (our estimate):"]
    total = report.get("ir_flops_total") or sum(r["flops"] for r in report["top_ops"]) or 1
    lines[-1] += f" total {_human(total)} (top 10, % of the total)"
    for r in report["top_ops"]:
        lines.append(f"  {r['value']:>6s} {r['op']:22s} {_human(r['flops']):>8s} "
                     f"{100 * r['flops'] / total:5.1f}%  {r['type']}  {r['source']}")
    fit, roof = report.get("memory_fit"), report.get("roofline")
    if fit is not None:
        from runtime.tpu import MemoryFit
        keys = MemoryFit.__dataclass_fields__
        lines += ["", "memory fit: " + str(MemoryFit(**{k: v for k, v in fit.items()
                                                        if k in keys})).splitlines()[0]]
    if roof is not None:
        lines += ["", f"roofline estimate ({roof['chip']}): {roof['estimate_s'] * 1e3:.4g} ms per "
                      f"step, {roof['bound']}-bound: compute {roof['compute_s'] * 1e3:.4g} ms, "
                      f"hbm {roof['hbm_s'] * 1e3:.4g} ms, ici {roof['ici_s'] * 1e3:.4g} ms "
                      f"(an estimate; see runtime/tpu.py)"]
    pad = report.get("padding_overhead")
    if pad is None:
        lines += ["", "padding overhead: n/a (no dynamic shapes)"]
    else:
        lines += ["", f"padding overhead ({pad['bucketing']}): rows per replica {pad['real_rows']} "
                      f"-> bucket {pad['bucket']}: {100 * pad['padded_fraction']:.1f}% padding"]
    return "\n".join(lines)

