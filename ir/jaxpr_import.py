"""Import a (closed) jaxpr into the IR.

Every primitive imports as a generic op that re-binds the primitive; a few become ops
of ours so passes can read them (``all_reduce``, ``cast_varying``, ``replica_id``).
Jaxpr-valued parameters (``pjit``, ``scan``, ``while``, ``cond``, ``custom_jvp_call``,
``custom_vjp_call``, ``checkpoint``...) become regions referenced by ``^i``. Literals and
closed-over constants become ``constant`` ops; source lines and name stacks are kept.
"""
from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np

from ir import _jax_compat as jc
from ir.errors import ImportError_, ShardingConstraintError
from ir.graph import Graph, Loc, Op, RegionRef, Value
from ir.types import Replica, Sharding, SymDim, TensorType

REPLICA_AXIS = "replica"

# JAX primitive -> (our op name, how to read its attributes)
_ALL_REDUCE = {"psum": "sum", "psum_invariant": "sum", "pmax": "max", "pmin": "min"}
#: the primitives that may import as one of our collective ops (by their axes)
_COLLECTIVES = frozenset(_ALL_REDUCE) | {"pvary", "pcast", "axis_index"}
#: parameter types kept as they are, with no look for jaxprs, shardings or axis names
#: (``axes`` of a reduction are ints; a collective's axis names are strings or tuples,
#: renamed below)
_PLAIN_ATTRS = frozenset({int, bool, float, type(None)})


_SYM_OPS = (("//", "_floordiv_"), ("*", "_times_"), ("+", "_plus_"), ("-", "_minus_"),
            ("%", "_mod_"), ("(", "_"), (")", "_"), (",", "_"), (" ", ""))


def sym_dim_name(expr: str) -> str:
    """An identifier for a symbolic dimension expression, readable and the same in every
    process (``2*b`` -> ``_2_times_b``; a plain ``b`` stays ``b``)."""
    if expr.isidentifier():
        return expr
    name = expr
    for op, word in _SYM_OPS:
        name = name.replace(op, word)
    name = re.sub(r"\W", "_", name)
    return name if name.isidentifier() else "_" + name


def type_of_aval(aval: Any, replica: Replica | None = None) -> TensorType:
    """The IR type of a JAX abstract value."""
    shape = getattr(aval, "shape", None)
    if shape is None:  # tokens and other non-array avals: an identifier the parser reads
        name = type(aval).__name__.lower().removeprefix("abstract")
        return TensorType((), re.sub(r"\W", "_", name) or "opaque")
    weak = bool(getattr(aval, "weak_type", False))
    if all(type(d) is int for d in shape):
        # (types are immutable, so one object serves every value of the same type;
        # symbolic shapes are not cached: comparing their dims can raise)
        try:
            return _static_type(shape, aval.dtype, weak, replica)
        except TypeError:  # a dtype that does not hash
            pass
    return _type(shape, aval.dtype, weak, replica)


@functools.lru_cache(maxsize=4096)
def _static_type(shape: tuple[int, ...], dtype: Any, weak: bool,
                 replica: Replica | None) -> TensorType:
    return TensorType(shape, dtype_name(dtype), replica, None, weak)


def dtype_name(dtype: Any) -> str:
    """The IR's name of a JAX dtype: NumPy's, except ``float0`` (the tangent type of an
    integer input, ``jax.grad(..., allow_int=True)``), which NumPy spells as a struct."""
    return "float0" if dtype == jc.FLOAT0 else str(dtype)


def _type(shape: tuple, dtype: Any, weak: bool, replica: Replica | None) -> TensorType:
    dims = []
    for d in shape:
        if isinstance(d, (int, np.integer)):
            dims.append(int(d))
        else:  # a symbolic dimension from jax.export.symbolic_shape
            name = sym_dim_name(str(d))
            dims.append(SymDim(name, expr=None if name == str(d) else str(d)))
    return TensorType(tuple(dims), dtype_name(dtype), replica, None, weak)


class _Importer:
    def __init__(self, fallback: Loc | None = None, axis: str = REPLICA_AXIS,
                 regions: dict[tuple, tuple[Any, Graph]] | None = None,
                 shared: tuple[dict, dict, dict] | None = None) -> None:
        self.env: dict[Any, Value] = {}
        #: the replica axis's name in the traced program (renamed ``REPLICA_AXIS`` here)
        self.axis = axis
        #: the location of the op whose region this is: the user's line for the ops of
        #: a library call (``jnp.flip`` is a jitted function) that have none of their own
        self.fallback = fallback
        #: the regions imported so far, shared by the whole import: by the jaxpr object
        #: (JAX traces a jitted function once per signature, so a step that calls
        #: ``jnp.var`` in 32 layers holds one ``_var`` jaxpr 32 times), whether it is
        #: closed, and the fallback location (the only context an import depends on);
        #: each entry keeps its jaxpr alive, so the id is not reused
        self.regions = {} if regions is None else regions
        #: shared by the whole import too: result types by aval (``typed``), name
        #: stacks' text and locations (``loc``)
        self.types: dict[int, tuple] = {} if shared is None else shared[0]
        self.stacks: dict[int, tuple] = {} if shared is None else shared[1]
        self.locs: dict[tuple, Loc] = {} if shared is None else shared[2]

    def read(self, atom: Any, ops: list[Op]) -> Value:
        if isinstance(atom, jc.Literal):
            val = jc.literal_value(atom)
            v = Value(type_of_aval(atom.aval))
            ops.append(Op("constant", (), (v,), (("value", val),)))
            return v
        try:
            return self.env[atom]
        except KeyError:
            raise ImportError_(f"jaxpr variable {atom} used before definition") from None

    def graph(self, jaxpr: Any, consts: list[Any], name: str,
              input_replica: list[Replica | None] | None = None) -> Graph:
        ops: list[Op] = []
        for var, c in zip(jaxpr.constvars, consts):
            v = Value(type_of_aval(var.aval))
            if jc.is_key_array(c):  # a captured typed key: its raw data, wrapped back
                data, impl, wrap = jc.key_array_parts(c)
                d = Value(TensorType(data.shape, str(data.dtype)))
                ops.append(Op("constant", (), (d,), (("value", data),)))
                ops.append(Op("random_wrap", (d,), (v,), (("impl", impl),), impl=wrap))
            else:
                ops.append(Op("constant", (), (v,), (("value", np.asarray(c)),)))
            self.env[var] = v
        inputs = []
        for i, var in enumerate(jaxpr.invars):
            rep = input_replica[i] if input_replica else None
            v = Value(type_of_aval(var.aval, rep))
            self.env[var] = v
            inputs.append(v)
        for eqn in jaxpr.eqns:
            self.eqn(eqn, ops)
        outputs = [self.read(a, ops) for a in jaxpr.outvars]
        return Graph(tuple(inputs), tuple(ops), tuple(outputs), name)

    def region(self, param: Any, closed: bool, loc: Loc | None = None) -> Graph:
        """The region of a jaxpr-valued parameter. One jaxpr met again (in the same
        context) gives the same :class:`Graph` object: the IR is immutable and regions
        are isolated, so ops may share a region, and the passes and the lowering then
        work on it once (``ir.graph.RegionMemo``)."""
        fallback = loc if loc is not None and loc.line else self.fallback
        key = (id(param), closed, fallback)
        hit = self.regions.get(key)
        if hit is not None:
            return hit[1]
        jaxpr, consts = jc.jaxpr_parts(param)
        if not closed and (consts or jaxpr.constvars):
            raise ImportError_("open jaxpr parameters with constvars are not supported")
        region = _Importer(fallback, self.axis, self.regions,
                           (self.types, self.stacks, self.locs)).graph(jaxpr, consts, "region")
        self.regions[key] = (param, region)
        return region

    def eqn(self, eqn: Any, ops: list[Op]) -> None:
        env = self.env
        try:
            operands = tuple([env[a] for a in eqn.invars])
        except (KeyError, TypeError):  # a literal (a constant op), or undefined (an error)
            operands = tuple([self.read(a, ops) for a in eqn.invars])
        if eqn.primitive.name == "sharding_constraint":
            self.sharding_constraint(eqn, operands[0], ops)
            return
        if eqn.primitive.name == "device_put":  # a layout inside jit: the same rule
            for d, v in zip(eqn.params.get("devices", ()), operands):
                check_layout("jax.device_put", d, v.type, eqn.source_info.traceback)
        elif eqn.primitive.name in ("pjit", "jit") and "in_shardings" in eqn.params:
            self.check_jit_layouts(eqn, operands)
        results, traced = [], []
        for var in eqn.outvars:
            t, varies = self.typed(var.aval)
            v = Value(t)
            if not isinstance(var, jc.DropVar):
                env[var] = v
            results.append(v)
            traced.append(varies)
        loc = self.loc(eqn)
        regions: list[Graph] = []
        name = eqn.primitive.name
        attrs = []
        for k, v in jc.import_params(name, eqn.params):
            tv = type(v)
            if tv in _PLAIN_ATTRS or (tv is tuple and all([type(x) in _PLAIN_ATTRS for x in v])) \
                    or isinstance(v, np.dtype):  # most parameters: ints, tuples of ints, dtypes
                attrs.append((k, v))
                continue
            if k in ("axes", "axis_name") and self.axis != REPLICA_AXIS:
                v = self.rename(v)
            attrs.append((k, self.attr(v, regions, name, k, loc)))
        if name in _COLLECTIVES:
            axes = eqn.params.get("axes", eqn.params.get("axis_name"))
            axes_t = self.rename(tuple(axes) if isinstance(axes, (tuple, list)) else (axes,))
            if name in _ALL_REDUCE and REPLICA_AXIS in axes_t and \
                    eqn.params.get("axis_index_groups") is None:
                attrs = [("reduce", _ALL_REDUCE[name]), ("axes", axes_t)]
                name = "all_reduce"
            elif name in ("pvary", "pcast") and REPLICA_AXIS in axes_t:
                name = "cast_varying"
            elif name == "axis_index" and self.rename(eqn.params.get("axis_name")) == REPLICA_AXIS:
                name, attrs = "replica_id", []
        ops.append(Op(name, operands, tuple(results), tuple(attrs), loc, tuple(regions),
                      impl=eqn.primitive, traced_varying=tuple(traced)))

    def sharding_constraint(self, eqn: Any, operand: Value, ops: list[Op]) -> None:
        """``jax.lax.with_sharding_constraint`` (``eqx.filter_shard``, flax's logical
        constraints) in a replica's program. Its layout names devices of every replica
        (the step's mesh, or any other), which a replica's program has no use for; it
        never changes a value, so: one that replicates becomes the IR's annotation
        ``shard {replicated}`` (over the replica's logical devices, as
        ``rt.replicate_to_logical_devices`` gives); one whose only constraint-free dims
        are ``P.UNCONSTRAINED`` leaves the value as it is; one that splits is a
        :class:`ShardingConstraintError` naming the line: the value here is the replica's
        own part (a batch is split over the replicas already), and splitting it over a
        replica's logical devices is ``rt.split_to_logical_devices``'s."""
        check_layout("with_sharding_constraint", eqn.params.get("sharding"), operand.type,
                     eqn.source_info.traceback)
        if eqn.params.get("unconstrained_dims"):
            self.env[eqn.outvars[0]] = operand
            return
        t, varies = self.typed(eqn.outvars[0].aval)
        v = self.env[eqn.outvars[0]] = Value(t)
        ops.append(Op("shard", (operand,), (v,),
                      (("sharding", Sharding.replicated()),
                       ("annotation", "with_sharding_constraint")), self.loc(eqn),
                      traced_varying=(varies,)))

    def check_jit_layouts(self, eqn: Any, operands: tuple) -> None:
        """``jax.jit(in_shardings=..., out_shardings=...)`` (``nnx.jit``'s too) of a
        function the step calls: the same rule as a sharding constraint (``check_layout``):
        one that splits is a ``ShardingConstraintError``; the others are dropped (the
        lowering re-derives a replica's layouts, :meth:`attr`)."""
        tb = eqn.source_info.traceback
        for s, v in zip(eqn.params["in_shardings"], operands):
            check_layout("jax.jit(in_shardings=...)", s, v.type, tb)
        for s, v in zip(eqn.params.get("out_shardings", ()), eqn.outvars):
            check_layout("jax.jit(out_shardings=...)", s, type_of_aval(v.aval), tb)

    def typed(self, aval: Any) -> tuple[TensorType, bool]:
        """The IR type of a result's abstract value, and whether JAX typed it varying over
        the replica axis; by the aval's identity (JAX's abstract evaluation, cached,
        gives equal results the same aval object; each entry keeps its aval alive)."""
        hit = self.types.get(id(aval))
        if hit is None:
            hit = self.types[id(aval)] = (type_of_aval(aval), jc.varies_over(aval, self.axis),
                                          aval)
        return hit[0], hit[1]

    def loc(self, eqn: Any) -> Loc | None:
        """The user's line and JAX's name stack of ``eqn``: one :class:`Loc` object per
        distinct location (the name stack's text made once per name stack object)."""
        info = eqn.source_info
        hit = self.stacks.get(id(info.name_stack))
        if hit is None:
            hit = self.stacks[id(info.name_stack)] = (str(info.name_stack), info.name_stack)
        stack = hit[0]
        where = jc.user_location(eqn)
        if where is not None:
            key = (where[0], where[1], stack)
        elif self.fallback is not None:
            key = (self.fallback.file, self.fallback.line, stack)
        elif stack:
            key = ("<unknown>", 0, stack)
        else:
            return None
        loc = self.locs.get(key)
        if loc is None:
            loc = self.locs[key] = Loc(*key, traceback=info.traceback)
        return loc

    def rename(self, v: Any) -> Any:
        """``v`` (an axis name, or a tuple of them) with the traced replica axis's name
        replaced by ``REPLICA_AXIS``."""
        if v == self.axis:
            return REPLICA_AXIS
        if isinstance(v, tuple):
            return tuple(REPLICA_AXIS if x == self.axis else x for x in v)
        return v

    def attr(self, v: Any, regions: list[Graph], primitive: str, param: str,
             loc: Loc | None = None) -> Any:
        if jc.is_jaxpr(v):
            closed = jc.is_closed_jaxpr_param(primitive, param, v)
            regions.append(self.region(v, closed, loc))
            return RegionRef(len(regions) - 1, closed=closed)
        if (isinstance(v, tuple) and any(jc.is_jaxpr(x) for x in v)
                and all(x is None or jc.is_jaxpr(x) for x in v)):
            # cond's branches; custom_linear_solve's NamedTuple of jaxprs (type kept)
            items = [None if x is None else self.attr(x, regions, primitive, param, loc)
                     for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
        if jc.is_sharding(v):
            # Shardings inside a replica's program name the trace's abstract mesh; the
            # lowering re-derives them, so the IR stays mesh-independent.
            return None
        return v


def check_layout(what: str, sharding: Any, value_type: TensorType, traceback: Any) -> None:
    """Raise :class:`ShardingConstraintError` if ``sharding`` (a layout the step's code
    asks JAX for, ``NamedSharding(mesh, P('batch'))``) splits a value of a replica's
    program (``value_type``, its per-replica type; ``traceback``: JAX's, where the user's
    line is read from, only for the error). A device,
    ``None``, a replicated layout or one whose only entries are ``P.UNCONSTRAINED`` pass:
    a layout never changes a value, and a replica's program keeps these as the
    replicated annotation (``compiler.trace``) or drops them."""
    if not jc.is_sharding(sharding) or sharding.is_fully_replicated:
        return
    spec = getattr(sharding, "spec", None)
    if spec is not None and not any(d is not None and not jc.is_unconstrained(d)
                                    for d in spec):
        return
    site = jc.user_call_site(traceback)
    where = f" at {site}" if site else ""
    mesh = getattr(sharding, "mesh", None)
    over = f" over mesh {dict(mesh.shape)}" if mesh is not None else ""
    raise ShardingConstraintError(
        f"{what}{where} splits a value of per-replica type {value_type} as "
        f"{spec if spec is not None else sharding}{over}: inside rt.replicate the step runs "
        f"once per replica, on the replica's own part of the batch (rt.distribute splits it "
        f"over the replicas already), so a layout over the devices of every replica has no "
        f"meaning there. Remove it (a step written for the global batch, as jax.jit with "
        f"shardings is, also computes its loss over the global batch; under replicate the "
        f"loss is each replica's, reduced as loss_reduction says); to split a value over a "
        f"replica's logical devices use rt.split_to_logical_devices(x, dims)")


def import_jaxpr(closed: Any, name: str = "main",
                 input_replica: list[Replica | None] | None = None,
                 axis_name: str = REPLICA_AXIS) -> Graph:
    """Import a ``ClosedJaxpr`` (or open ``Jaxpr`` without constvars) as a :class:`Graph`;
    the replica axis, traced as ``axis_name``, is ``REPLICA_AXIS`` in the IR."""
    jaxpr, consts = jc.jaxpr_parts(closed)
    return _Importer(axis=axis_name).graph(jaxpr, consts, name, input_replica)
