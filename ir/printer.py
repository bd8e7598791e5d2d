"""The text form of the IR: one op per line, names assigned in definition order.

    func @step(%0: f32[3,2] mirrored, %1: f32[5,3] varying) {
      %2: f32[5,2] varying = dot_general(%1, %0) {dimension_numbers=(((1,), (0,)), ((), ())), precision=None, preferred_element_type=f32}  # model.py:14
      ...
      return %2
    }

Regions print under their op as ``^i(args):`` blocks, indented. ``ir.parser.parse``
reads this text back: ``print_graph(parse(text)) == text``.
"""
from __future__ import annotations

import enum
import math
from typing import Any

import numpy as np

from ir.graph import Graph, Op, Opaque, RegionRef, Value
from ir.types import Sharding, short_dtype


def format_attr(v: Any) -> str:
    """Text of one attribute value (see the module docstring of ``ir.parser`` for the grammar)."""
    if isinstance(v, (RegionRef, Opaque, Sharding)):
        return str(v)
    if v is None or isinstance(v, bool):
        return repr(v)
    if isinstance(v, enum.Enum) or (isinstance(v, (int, float, str))
                                    and type(v) not in (int, float, str)):
        # IntEnum-like values would print as a bare name or number and parse back as
        # something else; keep them opaque
        return str(Opaque(opaque_text(v)))
    if isinstance(v, np.ndarray):
        return format_attr(v.tolist()) if v.ndim else format_attr(v.item())
    if isinstance(v, np.generic):
        return format_attr(v.item())
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, complex):
        return f"<complex {v!r}>"
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, tuple) and (not hasattr(v, "_fields")
                                 or any(isinstance(x, RegionRef) for x in v)):
        # (a NamedTuple of region refs prints as a plain tuple: the refs must stay visible)
        inner = ", ".join(format_attr(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if isinstance(v, list):
        return "[" + ", ".join(format_attr(x) for x in v) + "]"
    if isinstance(v, np.dtype):
        return short_dtype(v.name)
    return str(Opaque(opaque_text(v)))


def opaque_text(v: Any) -> str:
    """A stable, address-free description of an object the text form cannot rebuild."""
    if callable(v) and hasattr(v, "__name__") and not isinstance(v, type):
        return f"fn {getattr(v, '__qualname__', v.__name__)}"
    text = repr(v)
    if " at 0x" in text:
        text = f"{type(v).__name__}"
    return text.replace("<", "(").replace(">", ")").replace("\n", " ")


class _Namer:
    """Names values ``%0, %1, ...`` in definition order. With ``fixed`` (from
    :func:`value_names`) every value keeps the name of its first definition, so a
    fragment printed for a diagnostic uses the names of the full text."""

    def __init__(self, fixed: dict[Value, str] | None = None) -> None:
        self.names: dict[Value, str] = {}
        self.count = 0
        self.fixed = fixed

    def define(self, v: Value) -> str:
        name = f"%{self.count}"
        self.count += 1
        if self.fixed is not None:
            name = self.fixed.get(v, name)
            self.names.setdefault(v, name)
            return name
        self.names[v] = name
        return name

    def use(self, v: Value) -> str:
        if self.fixed is not None and v in self.fixed:
            return self.fixed[v]
        return self.names.get(v, "%<undefined>")


def _decl(namer: _Namer, v: Value) -> str:
    return f"{namer.define(v)}: {v.type}"


def _print_op(op: Op, namer: _Namer, indent: int, lines: list[str],
              where: dict[int, int] | None = None) -> None:
    pad = " " * indent
    head = ", ".join(_decl(namer, r) for r in op.results)
    call = f"{op.name}(" + ", ".join(namer.use(v) for v in op.operands) + ")"
    if op.attrs:
        call += " {" + ", ".join(f"{k}={format_attr(v)}" for k, v in op.attrs) + "}"
    line = f"{pad}{head} = {call}" if op.results else f"{pad}{call}"
    if op.loc is not None:
        line += f"  # {op.loc}"
    if where is not None:
        where.setdefault(id(op), len(lines))
    lines.append(line)
    for i, region in enumerate(op.regions):
        args = ", ".join(_decl(namer, v) for v in region.inputs)
        lines.append(f"{pad}  ^{i}({args}):")
        for inner in region.ops:
            _print_op(inner, namer, indent + 4, lines, where)
        lines.append(f"{pad}    return " + ", ".join(namer.use(v) for v in region.outputs))


def _print_lines(graph: Graph, namer: _Namer, where: dict[int, int] | None = None) -> list[str]:
    args = ", ".join(_decl(namer, v) for v in graph.inputs)
    lines = [f"func @{graph.name}({args}) {{"]
    for op in graph.ops:
        _print_op(op, namer, 2, lines, where)
    lines.append("  return " + ", ".join(namer.use(v) for v in graph.outputs))
    lines.append("}")
    return lines


def value_names(graph: Graph) -> dict[Value, str]:
    """The printed name of every value defined in ``graph`` (regions included); a value
    defined twice (in a region several ops share: the text prints it at each) keeps the
    name of its first definition. (A walk in print order that formats nothing, so it
    stays cheap on graphs holding large constants.)"""
    names: dict[Value, str] = {}
    for n, v in printed_names(graph).items():
        names.setdefault(v, n)
    return names


def printed_names(graph: Graph) -> dict[str, Value]:
    """Every name the text of ``graph`` defines, with its value: a value of a region
    several ops share is printed, and found here, under each of its names."""
    defined: list[Value] = list(graph.inputs)
    for op in graph.ops:
        _defined_by(op, defined)
    return {f"%{i}": v for i, v in enumerate(defined)}


def _defined_by(op: Op, defined: list[Value]) -> None:
    """Append the values ``op`` defines, in text order (its results, then each region's
    inputs and ops). Module level: a nested recursive function is a reference cycle."""
    defined.extend(op.results)
    for region in op.regions:
        defined.extend(region.inputs)
        for inner in region.ops:
            _defined_by(inner, defined)


def print_graph(graph: Graph) -> str:
    """The text form of ``graph`` (no trailing newline)."""
    return "\n".join(_print_lines(graph, _Namer()))


def print_op_context(graph: Graph, bad: Op | None, radius: int = 3, note: str = "") -> str:
    """The lines around ``bad`` (an op of ``graph`` or of any of its regions) with the
    bad line marked ``>>``; with ``bad=None`` the graph's ``return`` line is marked.
    Values carry the names they have in the full text of ``graph``."""
    where: dict[int, int] = {}
    lines = _print_lines(graph, _Namer(fixed=value_names(graph)), where)
    idx = len(lines) - 2 if bad is None else where.get(id(bad))
    if idx is None:  # not in this graph: show it alone
        lines, idx = [], 0
        _print_op(bad, _Namer(fixed=value_names(graph)), 2, lines)
    lo, hi = max(0, idx - radius), min(len(lines), idx + radius + 1)
    out = []
    for i in range(lo, hi):
        mark = ">>" if i == idx else "  "
        out.append(f"{mark}{lines[i]}")
        if i == idx and note:
            out.append(f"    ^-- {note}")
    return "\n".join(out)
