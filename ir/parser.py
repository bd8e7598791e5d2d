"""Parser for the IR text form written by ``ir.printer``.

Attribute values: ``None True False``, ints, floats (``inf``, ``-inf``, ``nan``), quoted
strings, tuples ``(a, b)`` / ``(a,)``, lists ``[a, b]``, dtypes (``f32``), region refs
``^0`` and opaque values ``<...>`` (kept as text: an op holding one cannot be lowered).
"""
from __future__ import annotations

import ast
from typing import Any

import numpy as np

from ir import ops
from ir.errors import IRParseError, IRTypeError
from ir.graph import Graph, Loc, Op, Opaque, RegionRef, Value
from ir.types import Replica, Sharding, SymDim, TensorType, long_dtype, _LONG


class _Cursor:
    def __init__(self, text: str, lineno: int) -> None:
        self.s = text
        self.i = 0
        self.lineno = lineno

    def error(self, msg: str, at: int | None = None) -> IRParseError:
        """A parse error at column ``at`` (0-based; default: the cursor)."""
        col = (self.i if at is None else at) + 1
        return IRParseError(f"line {self.lineno}, column {col}: {msg}: {self.s.strip()!r}")

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def peek(self, tok: str) -> bool:
        self.ws()
        return self.s.startswith(tok, self.i)

    def accept(self, tok: str) -> bool:
        if self.peek(tok):
            self.i += len(tok)
            return True
        return False

    def expect(self, tok: str) -> None:
        if not self.accept(tok):
            raise self.error(f"expected {tok!r}")

    def word(self) -> str:
        """A name: letters, digits, ``_ . -``, and a ``<...>`` suffix as in ``key<fry>``."""
        self.ws()
        j = self.i
        while j < len(self.s) and (self.s[j].isalnum() or self.s[j] in "_.-"):
            j += 1
        if j < len(self.s) and self.s[j] == "<" and j > self.i:
            k = self.s.find(">", j)
            if k > j and all(c.isalnum() or c == "_" for c in self.s[j + 1:k]):
                j = k + 1
        if j == self.i:
            raise self.error("expected a name")
        w, self.i = self.s[self.i:j], j
        return w

    def int_(self) -> int:
        self.ws()
        j = self.i
        if j < len(self.s) and self.s[j] == "-":
            j += 1
        while j < len(self.s) and self.s[j].isdigit():
            j += 1
        if j == self.i:
            raise self.error("expected an integer")
        v, self.i = int(self.s[self.i:j]), j
        return v

    def balanced(self, open_: str, close: str) -> str:
        """Text between a matching pair, quotes respected; cursor ends after ``close``."""
        self.ws()
        if not self.s.startswith(open_, self.i):
            raise self.error(f"expected {open_!r}")
        depth, j, quote = 0, self.i, None
        while j < len(self.s):
            c = self.s[j]
            if quote:
                if c == "\\":
                    j += 1
                elif c == quote:
                    quote = None
            elif c in "'\"":
                quote = c
            elif c == open_:
                depth += 1
            elif c == close:
                depth -= 1
                if depth == 0:
                    inner = self.s[self.i + 1:j]
                    self.i = j + 1
                    return inner
            j += 1
        raise self.error(f"unbalanced {open_!r}")

    def angle(self) -> str:
        """Text of an opaque ``<...>`` (nested ``<>`` counted, quotes not special)."""
        self.ws()
        depth, j = 0, self.i
        while j < len(self.s):
            depth += (self.s[j] == "<") - (self.s[j] == ">")
            if depth == 0:
                inner, self.i = self.s[self.i + 1:j], j + 1
                return inner
            j += 1
        raise self.error("unbalanced '<'")


def _parse_sharding(text: str, cur: _Cursor) -> Sharding:
    text = text.strip()
    if text == "replicated":
        return Sharding.replicated()
    if text.startswith("maximal device="):
        return Sharding.maximal(int(text.split("=", 1)[1]))
    if text.startswith("devices=["):
        dims_end = text.index("]")
        dims = tuple(int(x) for x in text[len("devices=["):dims_end].split(","))
        rest = text[dims_end + 1:].split()
        devs = tuple(int(x) for x in rest[0].split(",")) if rest else ()
        return Sharding("tiled", dims, devs, last_tile_dim_replicate="last_tile_dim_replicate" in rest[1:])
    raise cur.error(f"unknown sharding {{{text}}}")


def parse_type(cur: _Cursor) -> TensorType:
    """A type such as ``f32[b<=128,16]~ varying {devices=[1,2]0,1}``."""
    start = cur.i
    try:
        return _parse_type(cur)
    except (IRTypeError, ValueError) as e:
        if isinstance(e, IRParseError):
            raise
        raise cur.error(f"bad type: {e}", at=start) from None


def _parse_type(cur: _Cursor) -> TensorType:
    dtype = long_dtype(cur.word())
    dims_text = cur.balanced("[", "]")
    shape: list = []
    for d in filter(None, (x.strip() for x in dims_text.split(","))):
        if d.isdigit():
            shape.append(int(d))
        elif "<=" in d:
            name, bound = d.split("<=")
            shape.append(SymDim(name, int(bound)))
        else:
            shape.append(SymDim(d))
    weak = cur.accept("~")
    replica = None
    for r in Replica:
        if cur.peek(r.value) and not cur.s[cur.i + len(r.value):cur.i + len(r.value) + 1].isalnum():
            cur.accept(r.value)
            replica = r
    sharding = None
    if cur.peek("{") and _looks_like_sharding(cur):
        sharding = _parse_sharding(cur.balanced("{", "}"), cur)
    return TensorType(tuple(shape), dtype, replica, sharding, weak)


def _looks_like_sharding(cur: _Cursor) -> bool:
    rest = cur.s[cur.i + 1:]
    return rest.startswith(("replicated}", "maximal ", "devices="))


def parse_attr_value(cur: _Cursor) -> Any:
    cur.ws()
    s, i = cur.s, cur.i
    if i >= len(s):
        raise cur.error("expected an attribute value")
    c = s[i]
    if c in ",)]}":
        raise cur.error("expected an attribute value")
    if c == "(":
        items, trailing = _seq(cur, "(", ")")
        return tuple(items)
    if c == "[":
        items, _ = _seq(cur, "[", "]")
        return list(items)
    if c == "{":
        return _parse_sharding(cur.balanced("{", "}"), cur)
    if c == "^":
        cur.i += 1
        idx = cur.int_()
        return RegionRef(idx, closed=not cur.accept("o"))
    if c == "<":
        return Opaque(cur.angle())
    if c in "'\"":
        j = i + 1
        while j < len(s) and s[j] != c:
            j += 2 if s[j] == "\\" else 1
        if j >= len(s):
            raise cur.error("unterminated string", at=i)
        cur.i = j + 1
        try:
            return ast.literal_eval(s[i:j + 1])
        except (ValueError, SyntaxError) as e:
            raise cur.error(f"bad string literal ({e})", at=i) from None
    if c == "-" or c.isdigit():
        j = i + 1
        while j < len(s) and (s[j].isalnum() or s[j] in ".+-"):
            if s[j] in "+-" and s[j - 1] not in "eE":
                break
            j += 1
        tok = s[i:j]
        cur.i = j
        if tok in ("-inf",):
            return float("-inf")
        try:
            return int(tok)
        except ValueError:
            try:
                return float(tok)
            except ValueError:
                raise cur.error(f"bad number {tok!r}") from None
    w = cur.word()
    consts = {"None": None, "True": True, "False": False, "inf": float("inf"), "nan": float("nan")}
    if w in consts:
        return consts[w]
    if w in _LONG:
        import ml_dtypes  # noqa: F401  (registers bf16, int4, f8 names with numpy)
        return np.dtype(long_dtype(w))
    raise cur.error(f"unknown attribute token {w!r}")


def _seq(cur: _Cursor, open_: str, close: str) -> tuple[list, bool]:
    cur.expect(open_)
    items, trailing = [], False
    while not cur.accept(close):
        items.append(parse_attr_value(cur))
        trailing = cur.accept(",")
        if not trailing and not cur.peek(close):
            raise cur.error(f"expected ',' or {close!r}")
    return items, trailing


def _split_loc(line: str, lineno: int = 0) -> tuple[str, Loc | None]:
    """Split ``  # file.py:3 [stack]`` off the end of a line.

    Quoted strings (with backslash escapes) and opaque ``<...>`` attributes are skipped:
    either may contain ``  # ``; quotes inside ``<...>`` are not string delimiters (an
    opaque text is an arbitrary repr, e.g. ``<fn f's>``)."""
    quote, escaped, depth, angle = None, False, 0, 0
    for j, c in enumerate(line):
        if quote:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == quote:
                quote = None
        elif angle:
            angle += (c == "<") - (c == ">")
        elif c == "<" and not line.startswith("<=", j):
            angle = 1
        elif c in "'\"":
            quote = c
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif line.startswith("  # ", j) and depth == 0:
            loc_text = line[j + 4:].strip()
            stack = ""
            if loc_text.endswith("]") and " [" in loc_text:
                loc_text, stack = loc_text.split(" [", 1)
                stack = stack[:-1]
            file, _, ln = loc_text.rpartition(":")
            try:
                return line[:j], Loc(file, int(ln), stack)
            except ValueError:
                raise IRParseError(f"line {lineno}, column {j + 5}: bad source location {loc_text!r} "
                                   "(expected file:line [name stack])") from None
    return line, None


class _Parser:
    def __init__(self, text: str) -> None:
        self.lines = text.split("\n")
        self.pos = 0
        self.env: dict[str, Value] = {}

    def cursor(self) -> _Cursor:
        return _Cursor(self.lines[self.pos], self.pos + 1)

    def define(self, cur: _Cursor) -> Value:
        cur.ws()
        start = cur.i
        if not cur.accept("%"):
            raise cur.error("expected a value name")
        name = cur.word()
        if name in self.env:
            raise cur.error(f"%{name} is defined twice", at=start)
        cur.expect(":")
        v = Value(parse_type(cur))
        self.env[name] = v
        return v

    def use(self, cur: _Cursor) -> Value:
        cur.ws()
        start = cur.i
        if not cur.accept("%"):
            raise cur.error("expected a value name")
        name = cur.word()
        if name not in self.env:
            raise cur.error(f"%{name} is used before it is defined", at=start)
        return self.env[name]

    def parse(self) -> Graph:
        # leading blank lines and ``//`` comments (the header of a pass dump) are skipped
        while self.pos < len(self.lines) and (not self.lines[self.pos].strip()
                                              or self.lines[self.pos].lstrip().startswith("//")):
            self.pos += 1
        if self.pos == len(self.lines):
            raise IRParseError("line 1: empty text, expected 'func @name(...) {'")
        cur = self.cursor()
        cur.expect("func")
        cur.expect("@")
        name = cur.word()
        cur.expect("(")
        inputs = self._decls(cur, ")")
        cur.expect("{")
        self.pos += 1
        ops, outputs = self._body(2)
        if self.pos >= len(self.lines) or self.lines[self.pos].strip() != "}":
            raise IRParseError(f"line {self.pos + 1}: expected '}}'")
        for k in range(self.pos + 1, len(self.lines)):
            if self.lines[k].strip():
                raise IRParseError(f"line {k + 1}, column 1: unexpected text after the "
                                   f"graph: {self.lines[k].strip()!r}")
        return Graph(tuple(inputs), tuple(ops), tuple(outputs), name)

    def _decls(self, cur: _Cursor, close: str) -> list[Value]:
        out = []
        while not cur.accept(close):
            out.append(self.define(cur))
            if not cur.accept(",") and not cur.peek(close):
                raise cur.error(f"expected ',' or {close!r}")
        return out

    def _body(self, indent: int) -> tuple[list[Op], list[Value]]:
        ops: list[Op] = []
        while self.pos < len(self.lines):
            line = self.lines[self.pos]
            stripped = line.strip()
            if not stripped:
                self.pos += 1
                continue
            if stripped == "return" or stripped.startswith("return "):
                cur = self.cursor()
                cur.expect("return")
                outs = []
                while cur.i < len(cur.s.rstrip()):
                    outs.append(self.use(cur))
                    if not cur.accept(",") and cur.i < len(cur.s.rstrip()):
                        raise cur.error("expected ',' between returned values")
                self.pos += 1
                return ops, outs
            ops.append(self._op(indent))
        raise IRParseError(f"line {self.pos}: missing 'return'")

    def _op(self, indent: int) -> Op:
        body, loc = _split_loc(self.lines[self.pos], self.pos + 1)
        cur = _Cursor(body, self.pos + 1)
        results: list[Value] = []
        cur.ws()
        if cur.peek("%"):
            while True:
                results.append(self.define(cur))
                if not cur.accept(","):
                    break
            cur.expect("=")
        cur.ws()
        name_at = cur.i
        name = cur.word()
        if not ops.is_known(name):
            raise cur.error(f"unknown op {name!r} (neither one of this project's ops nor a "
                            f"JAX primitive)", at=name_at)
        cur.expect("(")
        operands = []
        while not cur.accept(")"):
            operands.append(self.use(cur))
            if not cur.accept(",") and not cur.peek(")"):
                raise cur.error("expected ',' or ')'")
        bad = ops.arity_error(name, len(operands))
        if bad:
            raise cur.error(bad, at=name_at)
        attrs = []
        if cur.accept("{"):
            while not cur.accept("}"):
                key = cur.word()
                cur.expect("=")
                attrs.append((key, parse_attr_value(cur)))
                if not cur.accept(",") and not cur.peek("}"):
                    raise cur.error("expected ',' or '}'")
        cur.ws()
        if cur.i != len(cur.s):
            raise cur.error("unexpected text after op")
        self.pos += 1
        regions = []
        while self.pos < len(self.lines) and self.lines[self.pos].startswith(" " * (indent + 2) + "^"):
            rc = self.cursor()
            rc.expect("^")
            idx = rc.int_()
            if idx != len(regions):
                raise rc.error(f"region ^{idx} out of order")
            rc.expect("(")
            rin = self._decls(rc, ")")
            rc.expect(":")
            self.pos += 1
            rops, routs = self._body(indent + 4)
            regions.append(Graph(tuple(rin), tuple(rops), tuple(routs), "region"))
        return Op(name, tuple(operands), tuple(results), tuple(attrs), loc, tuple(regions))


def parse(text: str) -> Graph:
    """Parse the text form back into a :class:`Graph` (raises :class:`IRParseError`)."""
    return _Parser(text).parse()
