"""The IR verifier: SSA well-formedness, region shape, per-op type rules, replica rules.

Raises :class:`IRVerifyError` whose message shows the ops around the fault, the bad one
marked ``>>``. Per-op rules live in ``OP_RULES`` (op name -> check), beside the ops they
describe; ops without a rule are checked only structurally.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ir import ops
from ir.errors import IRVerifyError
from ir.graph import Graph, Op, RegionRef, Value, map_region_refs
from ir.printer import print_op_context, value_names
from ir.types import Replica

# Ops whose results are identical on every replica even when operands vary.
REPLICA_REDUCING_OPS = frozenset({"all_reduce", "all_gather", "all_gather_invariant"})

_ELEMENTWISE = {
    "add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "and", "or", "xor",
    "neg", "exp", "log", "tanh", "logistic", "sqrt", "rsqrt", "abs", "sign", "sin", "cos",
    "floor", "ceil", "round", "exp2", "log1p", "expm1", "erf", "not", "integer_pow",
    "add_any", "cast_varying",
}


def _shape(shape: tuple) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def _check_elementwise(op: Op) -> str | None:
    # Scalars broadcast; equal-rank operands broadcast their size-1 dims (as lax does).
    if len(op.results) == 1:  # the usual case first: every operand the result's shape
        want = op.results[0].type.shape
        for v in op.operands:
            s = v.type.shape
            if s != want and s != ():
                break
        else:
            return None
    shapes = [v.type.shape for v in op.operands if v.type.shape != ()]
    if not shapes:
        return None
    if len({len(s) for s in shapes}) > 1:
        return f"operand ranks differ: {', '.join(map(_shape, shapes))}"
    out = []
    for dims in zip(*shapes):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            return f"operand shapes differ: {', '.join(map(_shape, shapes))}"
        out.append(sizes.pop() if sizes else 1)
    for r in op.results:
        if r.type.shape != tuple(out):
            return (f"result shape {_shape(r.type.shape)} differs from the broadcast operand "
                    f"shape {_shape(tuple(out))}")
    return None


def _check_all_reduce(op: Op) -> str | None:
    if op.attr("reduce") not in ("sum", "mean", "max", "min"):
        return f"reduce must be sum|mean|max|min, got {op.attr('reduce')!r}"
    if len(op.operands) != len(op.results):
        return f"{len(op.operands)} operands but {len(op.results)} results"
    for a, r in zip(op.operands, op.results):
        if not a.type.same_shape_dtype(r.type):
            return f"result type {r.type} differs from operand type {a.type}"
    return None


def _check_constant(op: Op) -> str | None:
    if op.operands or len(op.results) != 1:
        return "constant takes no operands and has one result"
    shape = np.shape(op.attr("value"))
    want = op.result.type.shape
    size = np.size(op.attr("value"))
    empty = size == 0 and any(d == 0 for d in want)  # [] prints for every empty shape
    if shape != want and size != 1 and not empty:
        return f"value has shape {_shape(shape)} but the result type has {_shape(want)}"
    return None


OP_RULES: dict[str, Callable[[Op], str | None]] = {
    "all_reduce": _check_all_reduce,
    "constant": _check_constant,
    **{name: _check_elementwise for name in _ELEMENTWISE},
}


#: op names already found known (JAX's primitive table is searched once per name)
_known: set[str] = set()


def _has_ref(attrs: tuple) -> bool:
    """Does any attribute hold a region reference (at the top or one tuple deep)?"""
    for _, v in attrs:
        if isinstance(v, RegionRef) or (isinstance(v, tuple) and
                                        any(isinstance(x, RegionRef) for x in v)):
            return True
    return False


def _fail(root: Graph, op: Op | None, msg: str, where: str) -> IRVerifyError:
    return IRVerifyError(f"{where}: {msg}\n{print_op_context(root, op, note=msg)}")


def verify(graph: Graph, where: str = "verify", seen: dict[int, Any] | None = None) -> None:
    """Check ``graph``; raise :class:`IRVerifyError` naming the first fault.

    ``seen``: ops and regions already verified (by identity), and filled with those
    verified now. Ops and graphs are immutable, so a pass that keeps an op or a region
    keeps it verified: the pass manager checks only what each pass changed, plus the
    SSA order of every op (which the pass may have moved)."""
    _verify(graph, where, (), graph, _LazyNames(graph), None, seen)


class _LazyNames:
    """Printed value names, computed only when a message needs them."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.names: dict[Value, str] | None = None

    def get(self, v: Value, default: str) -> str:
        if self.names is None:
            self.names = value_names(self.graph)
        return self.names.get(v, default)

    def __contains__(self, v: Value) -> bool:
        return self.get(v, "") != ""


def _verify(graph: Graph, where: str, outer_scopes: tuple[set[Value], ...], root: Graph,
            names: _LazyNames, owner: Op | None, seen: dict[int, Any] | None = None) -> None:
    """``root`` is the top-level graph (messages show its text and its value names);
    ``owner`` is the op whose region ``graph`` is (``None`` at top level)."""
    def name(v: Value) -> str:
        return names.get(v, "%<undefined>")

    defined: set[Value] = set()
    for v in graph.inputs:
        if v in defined:
            raise _fail(root, owner, f"input {name(v)} ({v.type}) is listed twice", where)
        defined.add(v)
    for op in graph.ops:
        if not defined.issuperset(op.operands):  # (the loop only to name the first)
            for i, v in enumerate(op.operands):
                if v not in defined:
                    outer = any(v in d for d in outer_scopes)
                    scope = " (regions are isolated: pass it as an operand)" if outer else ""
                    never = "" if v in names else ", and never defined"
                    raise _fail(root, op, f"operand {i} ({name(v)}) of {op.name} is used "
                                          f"before it is defined{never}{scope}", where)
        for j, r in enumerate(op.results):
            if r in defined:
                raise _fail(root, op, f"result {j} ({name(r)}) of {op.name} is already defined",
                            where)
            defined.add(r)
        if seen is not None and seen.get(id(op)) is op:
            # checked before, regions included: an op is immutable (its values and their
            # types too) and its regions are isolated, so only where it sits (the SSA
            # checks above) can have changed
            continue
        _check_op(op, where, root, names)
        if op.regions:
            _verify_regions(op, where, defined, outer_scopes, root, names, seen)
        if seen is not None:
            seen[id(op)] = op  # (kept alive, so its id is not reused)
    for i, v in enumerate(graph.outputs):
        if v not in defined:
            what = "the graph" if owner is None else f"the region of {owner.name}"
            raise _fail(root, owner, f"output {i} ({name(v)}) is not defined in {what}", where)


def _check_op(op: Op, where: str, root: Graph, names: _LazyNames) -> None:
    """The checks that depend on ``op`` alone: its region references, its per-op rule,
    its name and arity, and the replica rule."""
    # (an op without regions is checked for dangling references only by a cheap scan)
    if op.regions or (op.attrs and _has_ref(op.attrs)):
        refs = sorted(set(map_region_refs(op.attrs)))
        if refs != list(range(len(op.regions))):
            raise _fail(root, op, f"{op.name} has {len(op.regions)} regions but its "
                                  f"attributes reference {refs}", where)
    name = op.name
    rule = OP_RULES.get(name)
    msg = rule(op) if rule else None
    if msg is None and name not in _known:
        if not ops.is_known(name):
            msg = "unknown op (neither one of this project's ops nor a JAX primitive)"
        else:
            _known.add(name)
    if msg is None and name in ops.ARITY:
        msg = ops.arity_error(name, len(op.operands))
    if msg:
        raise _fail(root, op, f"{name}: {msg}", where)
    if name in REPLICA_REDUCING_OPS or op.regions:
        return
    for r in op.results:
        if r.type.replica is Replica.MIRRORED:
            # names only for the message: printing the graph's names costs a walk of it
            bad = [names.get(v, "%<undefined>") for v in op.operands
                   if v.type.replica is Replica.VARYING]
            if bad:
                raise _fail(root, op, f"{name} has varying operand(s) {', '.join(bad)} but "
                                      f"a mirrored result {names.get(r, '%<undefined>')}; "
                                      "only cross-replica reductions make values mirrored",
                            where)


def _verify_regions(op: Op, where: str, defined: set[Value],
                    outer_scopes: tuple[set[Value], ...], root: Graph, names: _LazyNames,
                    seen: dict[int, Any] | None) -> None:
    for region in op.regions:
        if seen is not None and seen.get(id(region)) is region:
            continue
        # scopes are a chain (copying the defined set per region is quadratic)
        _verify(region, f"{where} (region of {op.name})", (defined,) + outer_scopes, root,
                names, op, seen)
        if seen is not None:
            seen[id(region)] = region  # (kept alive, so its id is not reused)
