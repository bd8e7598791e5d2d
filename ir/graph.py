"""Immutable SSA graphs: values, ops (with typed attributes, source locations and
nested regions) and graphs.

A :class:`Graph` is a tuple of typed input values, a tuple of ops in program order and a
tuple of output values. Passes never mutate a graph: they build a new one with
:meth:`Graph.replace` (or a :class:`Rewriter`). Values are compared by identity; their
printed names (``%3``) are assigned by the printer in definition order, so nothing
depends on a global counter.

Regions are isolated (they read only their inputs), so several ops may hold the same
region object: the importer gives every call of one jaxpr the same region (a step that
calls ``jnp.var`` in 32 layers holds one ``_var`` region, not 32 copies). Code that walks
regions sees each op's region as its own and gets the same results as with copies; a pass
that rewrites regions does each (region, context) once through a :class:`RegionMemo`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from ir.errors import IRTypeError
from ir.types import TensorType


@dataclass(frozen=True, eq=False, slots=True)
class Value:
    """An SSA value. Identity is the value: two values with equal types are distinct."""

    type: TensorType

    def __repr__(self) -> str:
        return f"Value({self.type})"


@dataclass(frozen=True, slots=True)
class Loc:
    """Where an op came from: the user's file and line, and JAX's name stack
    (``transpose(jvp(loss))`` marks ops that ``jax.grad`` made)."""

    file: str
    line: int
    name_stack: str = ""
    #: the traceback JAX recorded for the first equation imported at this location (not
    #: printed, not compared): lowering gives it to the op's HLO, whose metadata then
    #: names the user's frames as ``jax.jit``'s does; ``None`` for ops a pass made and
    #: for IR parsed from text
    traceback: Any = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        s = f"{os.path.basename(self.file)}:{self.line}"
        return f"{s} [{self.name_stack}]" if self.name_stack else s

    @property
    def in_transpose(self) -> bool:
        """True for ops JAX emitted while transposing (the backward pass of ``grad``)."""
        return "transpose(" in self.name_stack


@dataclass(frozen=True, slots=True)
class RegionRef:
    """An attribute that points at ``op.regions[index]``: printed ``^index`` for a
    region that stands for a closed jaxpr, ``^indexo`` for an open one."""

    index: int
    closed: bool = True

    def __str__(self) -> str:
        return f"^{self.index}" if self.closed else f"^{self.index}o"


@dataclass(frozen=True, slots=True)
class Opaque:
    """An attribute the text form cannot rebuild (an enum, a callable, a dataclass).

    ``text`` is how it prints; ``obj`` is the live object when the op was imported from
    JAX, ``None`` when it was parsed from text (such an op cannot be lowered)."""

    text: str
    obj: Any = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        # the parser finds the end of ``<text>`` by counting angle brackets
        depth = 0
        for c in self.text:
            depth += (c == "<") - (c == ">")
            if depth < 0:
                break
        if depth != 0 or "\n" in self.text:
            raise IRTypeError(f"opaque attribute text {self.text!r} must be one line with "
                              "balanced '<' and '>'")

    def __str__(self) -> str:
        return f"<{self.text}>"


Attrs = tuple[tuple[str, Any], ...]

#: attributes passes add for people to read (printed, parsed, kept by passes) that are
#: not parameters of the op: lowering never passes them to a JAX primitive
NOTE_ATTRS = frozenset({"sharding_conflict"})


@dataclass(frozen=True, slots=True)
class Op:
    """One operation. ``name`` is a JAX primitive name or one of ours (``all_reduce``,
    ``constant``, ``cast_varying``, ``replica_id``, ...).

    ``attrs`` are ordered (key, value) pairs; ``regions`` are nested graphs referenced from
    attrs by :class:`RegionRef`; ``impl`` is the JAX primitive the op re-binds when it has
    no lowering rule of its own (not printed, not compared). ``traced_varying`` records,
    per result, whether JAX's own trace typed it as varying across replicas (``None``
    when unknown, e.g. parsed from text; not printed, not compared): the replication pass
    trusts it only to prove an op it does not know identical on every replica."""

    name: str
    operands: tuple[Value, ...]
    results: tuple[Value, ...]
    attrs: Attrs = ()
    loc: Loc | None = None
    regions: tuple[Graph, ...] = ()
    impl: Any = field(default=None, compare=False, repr=False)
    traced_varying: tuple[bool, ...] | None = field(default=None, compare=False, repr=False)

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def with_attrs(self, **updates: Any) -> Op:
        """A copy with some attributes replaced or added (order kept, new keys last)."""
        out = [(k, updates.pop(k) if k in updates else v) for k, v in self.attrs]
        out.extend(updates.items())
        return _replace(self, _OP_FIELDS, {"attrs": tuple(out)})

    def replace(self, **changes: Any) -> Op:
        return _replace(self, _OP_FIELDS, changes)

    def with_values(self, operands: tuple[Value, ...], results: tuple[Value, ...],
                    regions: tuple[Graph, ...] | None = None) -> Op:
        """A copy reading ``operands`` and defining ``results`` (and holding ``regions``):
        what a pass that retypes or remaps values builds for every op, so it is the
        constructor called directly (twice as fast as :meth:`replace`)."""
        return Op(self.name, operands, results, self.attrs, self.loc,
                  self.regions if regions is None else regions, self.impl, self.traced_varying)

    @property
    def result(self) -> Value:
        if len(self.results) != 1:
            raise ValueError(f"op {self.name} has {len(self.results)} results, not 1")
        return self.results[0]


@dataclass(frozen=True, slots=True)
class Graph:
    """A graph: typed inputs, ops in program order, outputs. Regions are graphs too."""

    inputs: tuple[Value, ...]
    ops: tuple[Op, ...]
    outputs: tuple[Value, ...]
    name: str = "main"

    def replace(self, **changes: Any) -> Graph:
        return _replace(self, _GRAPH_FIELDS, changes)

    def walk(self) -> Iterator[tuple[Op, Graph]]:
        """Every op with the graph that holds it, nested regions included (pre-order)."""
        for op in self.ops:
            yield op, self
            for region in op.regions:
                yield from region.walk()

    def users(self) -> dict[Value, list[Op]]:
        """Ops of this graph (not regions) that read each value."""
        out: dict[Value, list[Op]] = {}
        for op in self.ops:
            for v in op.operands:
                out.setdefault(v, []).append(op)
        return out

    def producers(self) -> dict[Value, Op]:
        """The op of this graph that defines each value (inputs have none)."""
        return {r: op for op in self.ops for r in op.results}

    def __str__(self) -> str:
        from ir.printer import print_graph
        return print_graph(self)

    def to_networkx(self):
        """The analysis view: a ``networkx.DiGraph`` whose nodes are op indices (plus
        ``"in:i"`` / ``"out:i"`` for inputs and outputs) and whose edges carry the value."""
        from ir.analysis import to_networkx
        return to_networkx(self)


_OP_FIELDS = tuple(f.name for f in dataclasses.fields(Op))
_GRAPH_FIELDS = tuple(f.name for f in dataclasses.fields(Graph))
_set = object.__setattr__


# -- constructors: every pass builds a new op for every op it retypes ---------------------
# The ``__init__`` a frozen dataclass generates sets each field through
# ``object.__setattr__``, ~1 us for an op's eight: a third of the cost of the passes
# that retype a whole graph. These set the slots through their descriptors directly
# (~0.55 us), with the same parameters and defaults (``tests/test_ir_text.py`` checks
# them against the dataclass fields); the instances stay frozen, compare and hash as
# before.
def _value_init() -> Callable[..., None]:
    set_type = Value.__dict__["type"].__set__

    def __init__(self, type: TensorType) -> None:  # noqa: A002  (the field's name)
        set_type(self, type)
    return __init__


def _op_init() -> Callable[..., None]:
    (s_name, s_operands, s_results, s_attrs, s_loc, s_regions, s_impl,
     s_traced) = [Op.__dict__[f].__set__ for f in _OP_FIELDS]

    def __init__(self, name: str, operands: tuple[Value, ...], results: tuple[Value, ...],
                 attrs: Attrs = (), loc: Loc | None = None, regions: tuple[Graph, ...] = (),
                 impl: Any = None, traced_varying: tuple[bool, ...] | None = None) -> None:
        s_name(self, name)
        s_operands(self, operands)
        s_results(self, results)
        s_attrs(self, attrs)
        s_loc(self, loc)
        s_regions(self, regions)
        s_impl(self, impl)
        s_traced(self, traced_varying)
    return __init__


Value.__init__ = _value_init()
Op.__init__ = _op_init()


def _replace(obj: Any, fields: tuple[str, ...], changes: Mapping[str, Any]) -> Any:
    """``dataclasses.replace`` for ``Op`` and ``Graph`` (frozen, no ``__post_init__``) at a
    third of its cost: passes copy every op, and ``dataclasses.replace`` was their largest
    single cost (it re-reads the class's fields and goes through ``__init__``)."""
    unknown = changes.keys() - set(fields)
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    for f in fields:
        _set(new, f, changes[f] if f in changes else getattr(obj, f))
    return new


class RegionMemo:
    """What a pass made of each region, by the region's identity and the context it was
    rewritten in (the input variances, an enclosing transpose...): a region that several
    ops share is rewritten once per context, and the new ops share the result. The
    context must hold everything the rewrite reads besides the region itself. Entries
    keep their region alive, so its id is not reused while the memo lives (one pass).

    ``types`` is the pass's own cache of retyped types, ``id(old type) -> (old type, new
    type)``, for a pass that gives each type one new type (``sharding`` at K = 1): a graph
    has a few hundred types for thousands of values, and such a pass then makes each new
    type once (the entry keeps the old type alive, so its id is not reused either)."""

    __slots__ = ("_done", "types")

    def __init__(self) -> None:
        self._done: dict[tuple, tuple[Graph, Any]] = {}
        self.types: dict[int, tuple[TensorType, TensorType]] = {}

    def get(self, region: Graph, context: Any, make: Callable[[], Any]) -> Any:
        """``make()``'s result for ``region`` in ``context``, computed once."""
        key = (id(region), context)
        hit = self._done.get(key)
        if hit is None:
            hit = self._done[key] = (region, make())
        return hit[1]


class Rewriter:
    """Builds a new graph from an old one, remapping values.

    Typical use in a pass::

        rw = Rewriter(graph)
        for op in graph.ops:
            rw.emit(op)                   # copy (operands remapped)
        return rw.finish()

    ``retype(fn)`` copies while giving every value a new type: ``fn(value, op)`` returns
    the new type (``op`` is ``None`` for inputs)."""

    def __init__(self, graph: Graph, input_types: Callable[[Value], TensorType] | None = None):
        self.graph = graph
        self.mapping: dict[Value, Value] = {}
        self.ops: list[Op] = []
        new_inputs = []
        for v in graph.inputs:
            nv = Value(input_types(v)) if input_types else v
            self.mapping[v] = nv
            new_inputs.append(nv)
        self.inputs = tuple(new_inputs)

    def get(self, v: Value) -> Value:
        return self.mapping.get(v, v)

    def emit(self, op: Op, result_types: tuple[TensorType, ...] | None = None,
             regions: tuple[Graph, ...] | None = None) -> Op:
        """Append ``op`` with operands remapped; new result values when types change."""
        get = self.mapping.get
        operands = tuple([get(v, v) for v in op.operands])
        if result_types is None:
            results = op.results
        else:
            results = tuple(r if r.type == t else Value(t) for r, t in zip(op.results, result_types))
            for old, new in zip(op.results, results):
                self.mapping[old] = new
        if results is op.results and (regions is None or regions is op.regions) and all(
                a is b for a, b in zip(operands, op.operands)):
            new = op  # unchanged: ops are immutable, so the old one is the new one
        else:
            new = op.with_values(operands, results, regions)
        self.ops.append(new)
        return new

    def add(self, op: Op) -> Op:
        """Append a brand-new op whose operands are already new values."""
        self.ops.append(op)
        return op

    def alias(self, old: Value, new: Value) -> None:
        """From now on, uses of ``old`` read ``new``."""
        self.mapping[old] = new

    def finish(self, outputs: tuple[Value, ...] | None = None) -> Graph:
        outs = tuple(self.get(v) for v in (self.graph.outputs if outputs is None else outputs))
        return Graph(self.inputs, tuple(self.ops), outs, self.graph.name)


def map_region_refs(attrs: Attrs) -> list[int]:
    """Region indices referenced by an op's attributes, in order."""
    out: list[int] = []
    for _, v in attrs:
        _region_refs(v, out)
    return out


def _region_refs(v: Any, out: list[int]) -> None:
    # a module-level function: a nested recursive one is a cycle through its own cell,
    # garbage for the collector after every call
    if isinstance(v, RegionRef):
        out.append(v.index)
    elif isinstance(v, (tuple, list)):
        for x in v:
            _region_refs(x, out)


def attrs_from(mapping: Mapping[str, Any]) -> Attrs:
    return tuple(mapping.items())
