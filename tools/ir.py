"""Read the IR after each pass: print it, diff two passes, draw it.

    python -m tools.ir show SOURCE [--after PASS]
    python -m tools.ir diff SOURCE PASS_A PASS_B
    python -m tools.ir dot  SOURCE [--after PASS] -o out.dot
    python -m tools.ir html SOURCE [--after PASS] -o out.html

SOURCE is a folder written by ``tools.inspect`` (its ``ir/``), a dump folder of
``NN-<pass>.txt`` files (``RunOptions(dump_dir=...)``), or ``FILE.py:FUNCTION`` with
``--args FILE.py:MAKE_ARGS`` (and ``--replicas``, ``--logical-devices``, ``-p``), which is
traced and run through the passes as ``tools.inspect`` does (no XLA compile).

How ``diff`` matches values: printed names (``%5``) shift when a pass adds or removes
ops, so values are matched by their producer instead. Inputs match by position. Every op
(regions included, in print order) gets the key (op name, source location with JAX's
name stack, occurrence number among ops with the same name and location); results of
ops with equal keys match by result index, and a region's arguments by (the op's key,
region index, argument index). A value is shown when its shape (padding bounds
included), replica variance or sharding differs; ops present on one side only are
listed as added or removed.
"""
from __future__ import annotations

from tools._common import ArgumentParser as _ArgumentParser  # noqa: E402

import argparse
import html
import os
import sys
from typing import Any

from tools._common import (ToolError, add_compile_options, add_debug_option,
                           check_compile_options, ensure_target, lower_step, pick_pass,
                           read_ir_dir, run_tool)

# ------------------------------------------------------------------------- loading


def _is_compile_target(source: str) -> bool:
    return ":" in source and source.rsplit(":", 1)[0].endswith(".py")


def load_passes(ns: argparse.Namespace, argv: list[str]) -> list[tuple[str, float, Any]]:
    """``(pass, seconds, Graph)`` for every stage of ``ns.source``."""
    if _is_compile_target(ns.source):
        check_compile_options(ns)
        ensure_target(ns, "tools.ir", argv)
        _, lowered, _ = lower_step(ns, ns.source)
        recs = lowered._program.records
        return [(r.name, r.seconds, r.graph) for r in recs]
    from ir.parser import parse
    out = []
    for name, seconds, text in read_ir_dir(ns.source):
        try:
            out.append((name, seconds, parse(text)))
        except Exception as e:  # noqa: BLE001 - name the file in the message
            raise ToolError(f"{ns.source}: the IR after {name!r} does not parse: {e}") from e
    return out


def _graph_after(ns: argparse.Namespace, argv: list[str]) -> tuple[str, Any]:
    stages = load_passes(ns, argv)
    i = pick_pass([s[0] for s in stages], ns.after)
    return stages[i][0], stages[i][2]


# --------------------------------------------------------------------------- diff

def value_keys(graph: Any) -> dict[tuple, Any]:
    """Every value of ``graph`` (regions included) under its position-independent key
    (see the module docstring)."""
    out: dict[tuple, Any] = {}
    for i, v in enumerate(graph.inputs):
        out[("in", i)] = v
    seen: dict[tuple, int] = {}

    def visit(op: Any) -> None:
        base = (op.name, str(op.loc) if op.loc else "")
        n = seen.get(base, 0)
        seen[base] = n + 1
        key = base + (n,)
        for j, r in enumerate(op.results):
            out[("op",) + key + (j,)] = r
        if not op.results:
            out[("op",) + key + (-1,)] = None
        for ri, region in enumerate(op.regions):
            for ai, a in enumerate(region.inputs):
                out[("region",) + key + (ri, ai)] = a
            for inner in region.ops:
                visit(inner)

    for op in graph.ops:
        visit(op)
    return out


def _producers(graph: Any) -> dict[Any, Any]:
    prod = {}
    for op, _ in graph.walk():
        for r in op.results:
            prod[r] = op
    return prod


def _what(key: tuple, v: Any, prod: dict) -> str:
    if key[0] == "in":
        return f"input {key[1]}"
    if key[0] == "region":
        return f"region {key[4]} argument {key[5]} of {key[1]}"
    op = prod.get(v)
    loc = f" {os.path.basename(op.loc.file)}:{op.loc.line}" if op is not None and op.loc else ""
    return f"{key[1]}{loc}"


def _sig(t: Any) -> tuple:
    return (tuple(str(d) for d in t.shape), t.dtype, t.replica, t.sharding)


def diff_graphs(a: Any, b: Any) -> list[str]:
    """Lines: one per value whose shape, replica variance or sharding differs between
    ``a`` and ``b``, then ops only in ``b`` (added) and only in ``a`` (removed)."""
    from ir.printer import value_names
    ka, kb = value_keys(a), value_keys(b)
    na, nb = value_names(a), value_names(b)
    pb = _producers(b)
    changed, added, removed = [], [], []
    for key, vb in kb.items():
        if key not in ka:
            if key[0] == "op" and key[-1] in (0, -1):
                added.append(f"+ {nb.get(vb, '-') if vb is not None else '-'} "
                             f"({key[1]} {key[2] or '?'}){': ' + str(vb.type) if vb else ''}")
            continue
        va = ka[key]
        if va is None or vb is None or _sig(va.type) == _sig(vb.type):
            continue
        name = nb.get(vb, "?")
        was = na.get(va, "?")
        label = name if was == name else f"{name} (was {was})"
        changed.append(f"{label} ({_what(key, vb, pb)}): {va.type} -> {vb.type}")
    for key, va in ka.items():
        if key not in kb and key[0] == "op" and key[-1] in (0, -1):
            removed.append(f"- {na.get(va, '-') if va is not None else '-'} "
                           f"({key[1]} {key[2] or '?'}){': ' + str(va.type) if va else ''}")
    out = changed
    if added:
        out += [f"ops added ({len(added)}):"] + ["  " + s for s in added]
    if removed:
        out += [f"ops removed ({len(removed)}):"] + ["  " + s for s in removed]
    return out


# ---------------------------------------------------------------------- colouring

PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69",
           "#fccde5", "#bc80bd", "#ccebc5", "#ffed6f", "#66c2a5", "#fc8d62", "#e78ac3")
NONE_COLOR = "#e0e0e0"


def sharding_colors(graph: Any) -> dict[str, str]:
    """A colour per sharding text (``none`` for values without one), in first-seen order."""
    colors: dict[str, str] = {}
    vals = list(graph.inputs) + [r for op, _ in graph.walk() for r in op.results]
    for v in vals:
        s = _shard_text(v)
        if s not in colors:
            colors[s] = NONE_COLOR if s == "none" else PALETTE[
                sum(1 for k in colors if k != "none") % len(PALETTE)]
    return colors


def _shard_text(v: Any) -> str:
    return str(v.type.sharding) if v.type.sharding is not None else "none"


# ---------------------------------------------------------------------------- DOT

def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph: Any, title: str = "ir") -> str:
    """Graphviz DOT of the top-level ops of ``graph``: one node per input, op and output,
    one edge per operand use (labelled with the value), nodes filled with the colour of
    their (first) result's sharding, and a legend cluster."""
    from ir.printer import value_names
    names = value_names(graph)
    colors = sharding_colors(graph)
    lines = [f"digraph {_q(title)} {{", "  rankdir=TB;",
             '  node [shape=box, style="filled,rounded", fontname="monospace", fontsize=10];',
             '  edge [fontname="monospace", fontsize=8];']
    src: dict[Any, str] = {}
    for i, v in enumerate(graph.inputs):
        src[v] = f"in{i}"
        lines.append(f"  in{i} [shape=ellipse, label={_q(f'{names[v]}: {v.type}')}, "
                     f"fillcolor={_q(colors[_shard_text(v)])}];")
    for i, op in enumerate(graph.ops):
        nid = f"op{i}"
        for r in op.results:
            src[r] = nid
        res = ", ".join(f"{names.get(r, '?')}: {r.type}" for r in op.results)
        label = f"{res}\n= {op.name}" if res else op.name
        if op.regions:
            label += f" (+{sum(len(g.ops) for g in op.regions)} region ops)"
        if op.loc:
            label += f"\n{op.loc.file}:{op.loc.line}"
        color = colors[_shard_text(op.results[0])] if op.results else NONE_COLOR
        lines.append(f"  {nid} [label={_q(label)}, fillcolor={_q(color)}];")
        for v in op.operands:
            if v in src:
                lines.append(f"  {src[v]} -> {nid} [label={_q(names.get(v, '?'))}];")
    for i, v in enumerate(graph.outputs):
        lines.append(f"  out{i} [shape=doubleoctagon, label={_q(f'return {i}')}, "
                     f"fillcolor={_q(colors.get(_shard_text(v), NONE_COLOR))}];")
        if v in src:
            lines.append(f"  {src[v]} -> out{i} [label={_q(names.get(v, '?'))}];")
    lines.append("  subgraph cluster_legend {")
    lines.append('    label="sharding"; style=dashed;')
    for j, (s, c) in enumerate(colors.items()):
        lines.append(f"    legend{j} [shape=box, label={_q(s)}, fillcolor={_q(c)}];")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- HTML

def to_html(graph: Any, title: str = "ir") -> str:
    """A self-contained HTML page (inline CSS, no scripts or external files): the IR text
    with every value coloured by its sharding, and a legend with counts."""
    import re

    from ir.printer import value_names
    names = value_names(graph)
    colors = sharding_colors(graph)
    cls = {s: f"s{i}" for i, s in enumerate(colors)}
    by_name = {n: cls[_shard_text(v)] for v, n in names.items()}
    counts: dict[str, int] = {}
    for v in names:
        counts[_shard_text(v)] = counts.get(_shard_text(v), 0) + 1
    css = "\n".join(f".{cls[s]} {{ background: {c}; }}" for s, c in colors.items())
    legend = "\n".join(
        f'<li><span class="{cls[s]} sw"></span><code>{html.escape(s)}</code> '
        f"({counts.get(s, 0)} value{'s' if counts.get(s, 0) != 1 else ''})</li>"
        for s in colors)

    def color(m: re.Match) -> str:
        n = m.group(0)
        c = by_name.get(n)
        return f'<span class="{c}" title="{html.escape(n)}">{n}</span>' if c else n

    body = "\n".join(re.sub(r"%\d+", color, html.escape(line)) for line in str(graph).splitlines())
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; }}
pre {{ font-family: monospace; font-size: 12px; line-height: 1.5; }}
pre span {{ border-radius: 3px; padding: 0 2px; }}
.sw {{ display: inline-block; width: 1.2em; height: 1em; vertical-align: middle;
       border: 1px solid #888; margin-right: .4em; }}
ul.legend {{ list-style: none; padding: 0; }}
{css}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<h2>Legend: sharding over the replica's logical devices</h2>
<ul class="legend">
{legend}
</ul>
<h2>IR</h2>
<pre>{body}</pre>
</body>
</html>
"""


# ---------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = _ArgumentParser(prog="python -m tools.ir", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("source", metavar="SOURCE",
                        help="an inspect output folder, an IR dump folder (NN-<pass>.txt), "
                             "or FILE.py:FUNCTION (then --args is required)")
        add_compile_options(sp)
        add_debug_option(sp)

    def after(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--after", metavar="PASS", default=None,
                        help="the pass whose output to use: its name (import, replication, "
                             "cross-replica-sum, sharding, dce, ...) or NN number "
                             "(default: the last)")

    fmt = argparse.RawDescriptionHelpFormatter
    sp = sub.add_parser("show", help="print the IR after a pass", formatter_class=fmt,
                        description="Print the IR text after a pass.")
    common(sp)
    after(sp)
    sp.add_argument("--list", action="store_true",
                    help="list the passes with their times instead of printing the IR")

    sp = sub.add_parser("diff", help="values whose sharding, variance or padding changed",
                        formatter_class=fmt, description=(
                            "Show only the values whose shape (padding), replica variance "
                            "or sharding changed between two passes, and ops added or "
                            "removed.\n\n" + __doc__.split("How ``diff`` matches values:")[1]))
    common(sp)
    sp.add_argument("pass_a", metavar="PASS_A", help="the earlier pass (name or NN)")
    sp.add_argument("pass_b", metavar="PASS_B", help="the later pass (name or NN)")

    for name, what in (("dot", "Graphviz DOT"), ("html", "a self-contained HTML page")):
        sp = sub.add_parser(name, help=f"write the IR after a pass as {what}",
                            formatter_class=fmt,
                            description=f"Write the IR after a pass as {what}, values coloured "
                                        "by their sharding, with a legend.")
        common(sp)
        after(sp)
        sp.add_argument("-o", "--output", metavar="FILE", required=True,
                        help="where to write it ('-' for standard output)")
    return p


def _write(path: str, text: str) -> None:
    if path == "-":
        sys.stdout.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    return run_tool("ir", lambda: _main(ns, argv), getattr(ns, "debug", False))


def _main(ns: argparse.Namespace, argv: list[str]) -> int:
    if ns.command == "show":
        if ns.list:
            for name, seconds, _ in load_passes(ns, argv):
                print(f"{name:24s} {seconds * 1e3:9.3f} ms")
            return 0
        name, g = _graph_after(ns, argv)
        print(f"// after pass: {name}")
        print(g)
    elif ns.command == "diff":
        stages = load_passes(ns, argv)
        names = [s[0] for s in stages]
        ia, ib = pick_pass(names, ns.pass_a), pick_pass(names, ns.pass_b)
        lines = diff_graphs(stages[ia][2], stages[ib][2])
        print(f"// diff {names[ia]} -> {names[ib]}")
        print("\n".join(lines) if lines else "(no value changed)")
    elif ns.command == "dot":
        name, g = _graph_after(ns, argv)
        _write(ns.output, to_dot(g, f"{g.name} after {name}"))
    elif ns.command == "html":
        name, g = _graph_after(ns, argv)
        _write(ns.output, to_html(g, f"{g.name} after {name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
