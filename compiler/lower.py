"""Lowering: IR graph -> JAX-traceable per-replica function -> ``jax.jit`` over a mesh.

``eval_graph`` runs a graph op by op with JAX; per-op rules live in ``LOWERING_RULES``
and every op without one re-binds its JAX primitive (regions rebuilt as jaxprs).
``build_jitted`` wraps the per-replica function in ``shard_map`` over the ``replica`` mesh
axis (the ``model`` axis is left to XLA) and ``jax.jit`` with in/out shardings.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from compiler.errors import LoweringError
from compiler.hlo_report import ir_scope
from ir import _jax_compat as jc
from ir.graph import NOTE_ATTRS, Graph, Op, Opaque, RegionRef
from ir.jaxpr_import import REPLICA_AXIS
from ir.ops import COLLECTIVES
from ir.types import Replica
from compiler.mesh import logical_devices_of, partition_spec

Rule = Callable[[Op, list[Any]], list[Any]]
LOWERING_RULES: dict[str, Rule] = {}

# ops that call their region 0 with their operands: inlined (forward semantics are exact)
# (``jit`` is jax>=0.10's name for ``pjit``; ``remat2`` is not inlined: it keeps XLA from
# CSE-ing the recomputation away.)
CALL_LIKE = frozenset({"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat",
                       "custom_vjp_call_jaxpr", "named_call"}) | jc.CALL_PRIMITIVES


def rule(*names: str, table: dict[str, Rule] | None = None):
    """Register a lowering rule for the ops ``names`` (in ``table``: ``LOWERING_RULES``
    unless given)."""
    def register(fn: Rule) -> Rule:
        for n in names:
            (LOWERING_RULES if table is None else table)[n] = fn
        return fn
    return register


@rule("constant")
def _constant(op: Op, args: list[Any]) -> list[Any]:
    t = op.result.type
    value = np.asarray(op.attr("value"), dtype=jc.dtype_from_name(t.dtype))
    shape = tuple(t.shape)
    if value.shape != shape:  # a splat (one element) fills the shape, as the verifier allows
        value = value.reshape(shape) if value.size != 1 else np.broadcast_to(value.reshape(()), shape)
    if t.weak_type:  # (a NumPy array is a strong constant: ``lr * 0.5`` of a Python float
        # came out a strong float32, where ``jax.jit``'s is weak, and a bfloat16 weight
        # times it then float32; JAX folds this cast into a weak constant)
        return [jc.weak_constant(value)]
    return [value]


_REDUCERS = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def _single_replica() -> bool:
    """True when the replica axis has size 1: every cross-replica collective is then the
    identity (and XLA rejects an all-reduce over a size-1 axis of a partly manual mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(REPLICA_AXIS, 1) == 1


#: the platform of the devices a graph is lowered for (set by ``build_jitted``)
_PLATFORM: contextvars.ContextVar[str] = contextvars.ContextVar("platform", default="")
_HALF = (jax.numpy.bfloat16, jax.numpy.float16)


def _widened(fn: Callable, args: list[Any], axes: Any) -> list[Any]:
    """On CPU, a 16-bit float all-reduce runs in float32, rounded once at the end: XLA's
    CPU compiler promotes a bfloat16 one anyway (the same numbers as ``jax.pmap``), and
    its promotion aborts the process when the reduction region holds the sharding
    constraints of a partly manual mesh (K > 1 logical devices). A float16 one is then
    the correctly rounded sum, where ``jax.pmap`` adds in float16 and may differ from it
    by one unit in the last place (``tests/test_peer_pmap.py``). Other platforms reduce
    in the value's own type."""
    if _PLATFORM.get() != "cpu" or not any(a.dtype in _HALF for a in args):
        return list(fn(tuple(args), axes))
    wide = [a.astype(jax.numpy.float32) if a.dtype in _HALF else a for a in args]
    return [w.astype(a.dtype) for w, a in zip(fn(tuple(wide), axes), args)]


@rule("all_reduce")
def _all_reduce(op: Op, args: list[Any]) -> list[Any]:
    if _single_replica():
        return list(args)
    axes = op.attr("axes", (REPLICA_AXIS,))
    fn = _REDUCERS[op.attr("reduce")]
    if fn is lax.pmean and _PLATFORM.get() != "cpu" and any(a.dtype == np.float16 for a in args):
        fn = _mean_of_parts  # (CPU: _widened sums in float32)
    outs = _widened(fn, args, axes)
    if op.attr("reduce") in ("max", "min"):
        outs = _nan_kept(args, outs, lambda nan: lax.pmax(nan.astype(np.int32), axes) > 0)
    return outs


def _mean_of_parts(xs: tuple, axes: Any) -> tuple:
    """The mean over replicas as the sum of each replica's value divided by N: ``pmean``
    sums first, and a float16 sum of N values can overflow where their mean does not
    (exact for N a power of two; ``cross_replica_sum._half_means``)."""
    n = lax.psum(1, axes)
    return lax.psum(tuple(x / np.asarray(n, x.dtype) for x in xs), axes)


def _floating(x: Any) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


def _nan_kept(args: list[Any], outs: list[Any], any_nan: Callable[[Any], Any]) -> list[Any]:
    """A max or min across devices, NaN where any of its inputs is NaN (``any_nan`` of
    ``isnan(x)``: that or over the same elements), as NumPy's and one device's: XLA:CPU's
    cross-device max and min keep the other operand when one is NaN, so a NaN of one
    device (and everything else that device held) dropped out of the result, and on GPU
    it depends on the collective library. Floating values only."""
    return [jax.numpy.where(any_nan(jax.numpy.isnan(x)), jax.numpy.asarray(np.nan, o.dtype), o)
            if _floating(x) else o for x, o in zip(args, outs)]


def _model_axes() -> bool:
    """Does the mesh have model axes (K > 1 logical devices)? XLA's partitioner may then
    split any value over them, and a reduction over a split dim ends in a cross-device
    all-reduce."""
    mesh = jax.sharding.get_abstract_mesh()
    return any(a != REPLICA_AXIS and n > 1 for a, n in zip(mesh.axis_names, mesh.axis_sizes))


#: lowering rules that only act with K > 1 logical devices (model axes): with K = 1 the
#: second trace stages their ops directly, as any op without a rule (``eval_graph``)
MODEL_AXES_RULES: dict[str, Rule] = {}


def model_axes_rule(*names: str):
    return rule(*names, table=MODEL_AXES_RULES)


def _unsplit(x: Any, dims: Any) -> Any:
    """``x`` constrained unsplit over the logical devices along ``dims`` (a set of dim
    indices), its other dims as XLA's propagation leaves them."""
    spec = P(*[None if d in dims else P.UNCONSTRAINED for d in range(len(x.shape))])
    return lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))


def _unsplit_along(op: Op, args: list[Any], dims: list[bool]) -> list[Any]:
    """``op`` bound with its operands and results of ``len(dims)`` dims unsplit over the
    logical devices along ``dims`` (a flag per dim), the other dims as XLA's propagation
    leaves them (operands of another rank, a ``pad``'s scalar, as they are); as it is
    with K = 1 or nothing to unsplit."""
    if not _model_axes() or not any(dims):
        return _bind(op, args)
    along = {d for d, flag in enumerate(dims) if flag}

    def unsplit(x):
        return _unsplit(x, along) if len(x.shape) == len(dims) else x
    return [unsplit(r) for r in _bind(op, [unsplit(a) for a in args])]


@model_axes_rule("select_and_scatter_add")
def _select_and_scatter_add(op: Op, args: list[Any]) -> list[Any]:
    """The gradient of a max or min ``reduce_window`` (max pooling), with K > 1 logical
    devices: unsplit along the windowed dims. XLA's SPMD partitioner gives wrong numbers
    for a select-and-scatter split along a dim whose windows overlap (``jax.jit`` with
    the same sharding constraint gives the same wrong gradient: a window of 3, stride 1,
    ``SAME``, split in two, sent some rows' gradient to the wrong element). The result is
    constrained too: JAX pads the operand inside the op's lowering, and XLA's propagation
    split the padded operand from the result's side."""
    return _unsplit_along(op, args, [w > 1 or s != 1 or tuple(p) != (0, 0) for w, s, p in zip(
        op.attr("window_dimensions"), op.attr("window_strides"), op.attr("padding"))])


@model_axes_rule("conv_general_dilated")
def _conv(op: Op, args: list[Any]) -> list[Any]:
    """A convolution whose kernel is not a weight (per-replica data: the gradient of a
    kernel, ``jnp.convolve(a, a[:4])``; or one whose output window is smaller than its
    kernel's, or with batch groups), with K > 1 logical devices: unsplit along the
    spatial dims (and the batch dim of batch groups). XLA's SPMD partitioner gave wrong
    numbers for such a convolution with spatial dims split: 2x when the value is split
    along a spatial dim and copied over the other devices (``partial=True``), or split
    along H and C with an output taller than the input; half the kernel gradient zero
    with ``batch_group_count=2`` and the batch split (the gradient's convolution has
    feature groups over the batch: its feature dim unsplit too; ``jax.jit`` with the same
    sharding constraints: the same numbers; found by a probe). A convolution of data
    with a weight (forward, the data's gradient) keeps its spatial split (halo exchange,
    which XLA gets right)."""
    if not _model_axes() or len(op.results) != 1:
        return _bind(op, args)
    dn = op.attr("dimension_numbers")
    lhs_spec, rhs_spec, out_spec = (getattr(dn, f, None) for f in ("lhs_spec", "rhs_spec", "out_spec"))
    if lhs_spec is None:
        return _bind(op, args)
    groups = (op.attr("batch_group_count") or 1) > 1
    rhs_shape, out_shape = op.operands[1].type.shape, op.results[0].type.shape
    small = any(out_shape[o] < rhs_shape[r] for o, r in zip(out_spec[2:], rhs_spec[2:]))
    if op.operands[1].type.replica is not Replica.VARYING and not groups and not small:
        return _bind(op, args)
    grouped = (op.attr("feature_group_count") or 1) > 1  # (the kernel gradient of batch groups)
    lhs = _unsplit(args[0], set(lhs_spec[2:]) | ({lhs_spec[0]} if groups else set())
                   | ({lhs_spec[1]} if grouped else set()))
    rhs = _unsplit(args[1], set(rhs_spec[2:]))
    return [_unsplit(r, set(out_spec[2:])) for r in _bind(op, [lhs, rhs])]


@model_axes_rule("pad")
def _pad(op: Op, args: list[Any]) -> list[Any]:
    """A ``pad`` with K > 1 logical devices: unsplit along each dim whose padding both cuts
    (a negative low or high) and interleaves (interior): XLA's partitioner aborted the
    process on one split there (``spmd_partitioner.cc:1115``; ``jax.jit`` with the same
    constraint too; found by a probe)."""
    return _unsplit_along(op, args, [(lo < 0 or hi < 0) and interior > 0
                                     for lo, hi, interior in op.attr("padding_config")])


#: ops XLA's partitioner aborts the process on (``spmd_partitioner_util.cc:497``,
#: ``partition_group_list``) when the replicas are a manual axis of two or more devices
#: and the value is split over two model axes (K = 4 as 2 x 2): ``jax.jit`` of
#: ``shard_map`` manual over the replicas does too; a global ``jax.jit`` does not
_TWO_AXIS_ABORTS = ("gather", "scatter", "scatter-add", "scatter-mul", "scatter-min",
                    "scatter-max", "sort", "lu", "cholesky", "triangular_solve", "qr", "eigh",
                    "svd", "eig", "geqrf", "householder_product")


@model_axes_rule(*_TWO_AXIS_ABORTS)
def _replicated_on_two_model_axes(op: Op, args: list[Any]) -> list[Any]:
    """One of :data:`_TWO_AXIS_ABORTS`, on N > 1 replicas with two or more model axes:
    its operands and results replicated over the replica's logical devices (a found
    abort: a gather from a table split ``[2, 2]`` on 2 replicas x 4 logical devices;
    numbers unchanged, the split kept elsewhere)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if sizes.get(REPLICA_AXIS, 1) < 2 or sum(
            1 for a, n in sizes.items() if a != REPLICA_AXIS and n > 1) < 2:
        if op.name == "sort":  # (XLA's partitioner aborted a sort along a split axis of
            # an uneven length, 8 split in two then cut to 7, under grad; the partitioner
            # gathers the sorted axis anyway)
            rank = len(args[0].shape)
            return _unsplit_along(op, args, [d == op.attr("dimension") for d in range(rank)])
        return _bind(op, args)
    def whole(x):
        return _unsplit(x, range(len(x.shape)))
    return [whole(r) for r in _bind(op, [whole(a) for a in args])]


@model_axes_rule("fft")
def _fft(op: Op, args: list[Any]) -> list[Any]:
    """An FFT, with K > 1 logical devices: unsplit along its transformed (last) axes.
    XLA:CPU aborted the call of a complex FFT split along them (``RET_CHECK ...
    IsMonotonicWithDim0Major`` in its FFT thunk; ``jax.jit`` of inputs sharded so too);
    the partitioner gathers those axes for the transform anyway."""
    rank, n = len(args[0].shape), len(op.attr("fft_lengths"))
    if len(op.results[0].type.shape) != rank:
        return _bind(op, args)
    return _unsplit_along(op, args, [d >= rank - n for d in range(rank)])


@rule("reduce_scatter")
def _reduce_scatter(op: Op, args: list[Any]) -> list[Any]:
    """A reduce-scatter (``psum_scatter``, the gradient of an ``all_gather``) as JAX binds
    it, in float32 for a 16-bit float on CPU (``_widened``: XLA:CPU's promotion of a
    bfloat16 one aborted the process under K > 1 logical devices)."""
    return _widened(lambda xs, _axes: _bind(op, list(xs)), args, None)


@rule("reduce_max", "reduce_min")
def _reduce_extremum(op: Op, args: list[Any]) -> list[Any]:
    """``jnp.max``/``jnp.min``: over K > 1 logical devices, NaN kept (:func:`_nan_kept`:
    a dim split over them is reduced across devices; ``[0, ..., nan, 7]`` split in two
    gave 3.0, with plain ``jax.jit`` over the same devices too)."""
    out = _bind(op, args)
    if not _floating(args[0]) or not _model_axes():
        return out
    axes = tuple(op.attr("axes"))
    return _nan_kept(args, out, lambda nan: lax.reduce_or(nan, axes))


@rule("remat2", "checkpoint")
def _remat(op: Op, args: list[Any]) -> list[Any]:
    """``jax.checkpoint``'s primitive takes an open jaxpr: a region that holds an array
    constant (one a pass moved in, inlining a ``jax.jit`` whose constant it was) has none
    to give it, so such a region is checkpointed again through ``jax.checkpoint``, which
    passes the constants as operands (same policy and CSE choice; numbers unchanged)."""
    try:
        return _bind(op, args)
    except _CapturedConstants:
        region = op.regions[0]
        fn = jax.checkpoint(lambda *xs: eval_graph(region, list(xs)),
                            prevent_cse=bool(op.attr("prevent_cse", True)),
                            policy=_param(op.attr("policy"), op))
        return list(fn(*args))


@rule("all_gather", "all_gather_invariant")
def _all_gather(op: Op, args: list[Any]) -> list[Any]:
    if _single_replica() and op.attr("axis_name") in ((REPLICA_AXIS,), REPLICA_AXIS):
        x = args[0]
        return [x if op.attr("tiled") else jax.numpy.expand_dims(x, op.attr("all_gather_dimension"))]
    return _bind(op, args)


@rule("all_to_all")
def _all_to_all(op: Op, args: list[Any]) -> list[Any]:
    if _single_replica() and op.attr("axis_name") in ((REPLICA_AXIS,), REPLICA_AXIS):
        return list(args)
    return _bind(op, args)


@rule("cast_varying")
def _cast_varying(op: Op, args: list[Any]) -> list[Any]:
    return list(args)  # a type-level cast; lowered without JAX's varying checks


@rule("loss_scale")
def _loss_scale(op: Op, args: list[Any]) -> list[Any]:
    raise LoweringError(
        f"loss_scale ({op.loc}) reached lowering: the pipeline has no 'cross-replica-sum' "
        f"pass, which applies the loss reduction to gradients; add it to the pipeline")


@rule("replica_id")
def _replica_id(op: Op, args: list[Any]) -> list[Any]:
    if _single_replica():
        return [np.int32(0)]
    return [lax.axis_index(REPLICA_AXIS)]


def _inline(op: Op, args: list[Any]) -> list[Any]:
    region = op.regions[0]
    if len(region.inputs) != len(args):
        raise LoweringError(f"{op.name}: region takes {len(region.inputs)} inputs but the op "
                            f"has {len(args)} operands ({op.loc})")
    return eval_graph(region, args)


for _name in CALL_LIKE:
    LOWERING_RULES[_name] = _inline


# -- nested ``jit`` calls: one function per region called more than once ---------------
class _Sharing:
    """The ``jit`` regions of one graph being lowered: each op's region key, how often
    each key is called, and the nested ``jax.jit`` function of each shared key."""

    def __init__(self, graph: Graph):
        self.keys: dict[int, RegionKey | None] = {}  # by id(op): ops live as long as the graph
        self.calls: dict[RegionKey, int] = {}
        self.fns: dict[RegionKey, Any] = {}
        self._canon: dict[RegionKey, RegionKey] = {}
        self._graph_keys: dict[int, RegionKey] = {}  # by id(region): regions are shared
        self._count(graph)

    def _count(self, graph: Graph) -> None:
        for op in graph.ops:
            if op.name in _SHARABLE:
                key = region_key(op, self._graph_keys)
                if key is not None:
                    # one deep comparison per repeat; every later look-up of the key
                    # (here, and at each call in ``_call``) is then by identity
                    key = self._canon.setdefault(key, key)
                    self.calls[key] = self.calls.get(key, 0) + 1
                self.keys[id(op)] = key
            for region in op.regions:  # (a shared region's calls count at each use)
                self._count(region)


#: the sharing state of the graph ``build_jitted`` is lowering (``None`` outside it)
_SHARED: contextvars.ContextVar[_Sharing | None] = contextvars.ContextVar("shared", default=None)
_SHARABLE = ("jit", "pjit")


class _Unkeyable(Exception):
    """An attribute whose value cannot be keyed exactly: its call is inlined instead."""


def _attr_key(v: Any) -> Any:
    """``v`` as a hashable key equal only for values that mean the same: arrays by their
    bytes, floats by their bits (``0.0`` and ``-0.0`` differ), scalars with their type
    (``True`` and ``1`` differ), opaque objects and anything else by identity."""
    t = type(v)  # the common exact types first (the same keys as the general cases below)
    if t is str or v is None:
        return v
    if t is int or t is bool:
        return (t.__name__, int(v))
    if t is tuple:
        return ("tuple",) + tuple(map(_attr_key, v))
    if isinstance(v, (str, RegionRef)):
        return v
    if isinstance(v, (bool, int, np.integer)):
        return (type(v).__name__, int(v))
    if isinstance(v, (float, np.floating)):
        return ("float", type(v).__name__, float(v).hex())
    if isinstance(v, np.ndarray):
        if v.dtype == object:
            raise _Unkeyable
        return ("ndarray", v.dtype.str, v.shape, v.tobytes())
    if isinstance(v, Opaque):
        return ("opaque", v.text, id(v.obj))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__,) + tuple(_attr_key(x) for x in v)
    if isinstance(v, np.dtype):
        return ("dtype", v.str)
    return ("object", type(v).__name__, id(v))  # the same object means the same thing


def _graph_key(g: Graph) -> tuple:
    ids: dict[Any, int] = {v: i for i, v in enumerate(g.inputs)}
    parts: list[Any] = [tuple(v.type for v in g.inputs)]
    for op in g.ops:
        operands = tuple(map(ids.__getitem__, op.operands))
        for r in op.results:
            ids[r] = len(ids)
        parts.append((op.name, id(op.impl), operands, tuple([r.type for r in op.results]),
                      op.loc, tuple([(k, _attr_key(v)) for k, v in op.attrs]),
                      tuple(map(_graph_key, op.regions)) if op.regions else ()))
    parts.append(tuple(ids[v] for v in g.outputs))
    return tuple(parts)


class RegionKey:
    """A region's exact key (:func:`region_key`) with its hash computed once: the key is
    a deep tuple, and a tuple hashes all of itself again at every dict look-up."""
    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts, self._hash = parts, hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RegionKey) and self._hash == other._hash
                and self.parts == other.parts)


def region_key(op: Op, graph_keys: dict[int, RegionKey] | None = None) -> RegionKey | None:
    """A key equal for two ``jit`` ops exactly when lowering their regions gives the same
    program, locations included (they name the HLO's ``op_name`` metadata); ``None``
    when an attribute cannot be keyed exactly (the call is then inlined). ``graph_keys``:
    the regions' exact keys so far, by id, so that a region several ops share is keyed
    once (the caller keeps the graph, so the ids stay its regions')."""
    try:
        region = op.regions[0]
        gk = None if graph_keys is None else graph_keys.get(id(region))
        if gk is None:
            gk = RegionKey(_graph_key(region))  # (its deep hash computed once per region)
            if graph_keys is not None:
                graph_keys[id(region)] = gk
        return RegionKey((op.loc, gk))
    except (_Unkeyable, TypeError, KeyError):
        return None


def _shared(op: Op, args: list[Any]) -> tuple[RegionKey, Callable] | None:
    """The region key and nested ``jax.jit`` function of a ``jit`` op whose exact region
    is called more than once in the graph being lowered (:func:`_call`), else ``None``."""
    sharing = _SHARED.get()
    key = sharing.keys.get(id(op)) if sharing is not None else None
    if key is None or sharing.calls[key] < 2 or len(op.regions[0].inputs) != len(args):
        return None  # (a wrong operand count: the inlining's error names the op)
    fn = sharing.fns.get(key)
    if fn is None:
        region = op.regions[0]

        def call(*xs):
            return tuple(eval_graph(region, list(xs)))
        # named as the function the step called (``_var``): the StableHLO function, HLO
        # computation and ``op_name`` metadata then say what it is, as ``jax.jit``'s do
        name = op.attr("name")
        if isinstance(name, str) and name.isidentifier():
            call.__name__ = call.__qualname__ = name
        fn = sharing.fns[key] = jax.jit(call)
    return key, fn


def _call(op: Op, args: list[Any]) -> list[Any]:
    """A ``jit`` op (a function of JAX's or the user's, ``jnp.var``'s ``_var``) whose
    exact region is called more than once in the graph: lowered as a nested ``jax.jit``
    call, one function per region, so that JAX traces and lowers it once, as ``jax.jit``
    of the user's step does (a 32-layer step calls ``_var`` 64 times), and XLA inlines
    the calls (in the second trace, calls after the first are replayed:
    :meth:`_Stager.shared_call`). Inlined when called once (a nested jit costs more
    than it saves), when its region cannot be keyed exactly, or outside
    ``build_jitted``."""
    shared = _shared(op, args)
    return _inline(op, args) if shared is None else list(shared[1](*args))


for _name in _SHARABLE:
    LOWERING_RULES[_name] = _call


def _plain(region: Graph) -> bool:
    """A region whose ops all re-bind their JAX primitive with plain attributes (no
    lowering rule, no nested region): what it lowers to depends on nothing but itself
    (a scatter's combiner, a reduction's body, a sort's comparator)."""
    return all(not op.regions and op.name not in LOWERING_RULES
               and op.name not in MODEL_AXES_RULES for op in region.ops)


#: jaxprs rebuilt from plain regions, by the region's exact key (``_graph_key``) and the
#: trace context (JAX's config and the abstract mesh: a jaxpr's avals carry the mesh it
#: was traced under, and one traced for 2 replicas is wrong for 1). JAX's own combiners
#: come from ``lru_cache``d tracers (``lax._reduction_jaxpr``) keyed the same way, so a
#: fresh trace of a step meets the same ones; tracing each again costs ~0.5 ms
_PLAIN_JAXPRS: dict[tuple, Any] = {}
_PLAIN_JAXPRS_SIZE = 512


def _rebuild(ref: RegionRef, op: Op) -> Any:
    region = op.regions[ref.index]
    key = None
    if _plain(region):
        try:
            key = (ref.closed, jc.trace_context(), _PLATFORM.get(), _graph_key(region))
            hit = _PLAIN_JAXPRS.get(key)
        except (_Unkeyable, TypeError, KeyError):
            key = hit = None
        if hit is not None:
            return hit
    jaxpr = _trace_region(ref, op, region)
    if key is not None:
        if len(_PLAIN_JAXPRS) >= _PLAIN_JAXPRS_SIZE:
            _PLAIN_JAXPRS.clear()  # (one step: safe while another thread lowers)
        _PLAIN_JAXPRS[key] = jaxpr
    return jaxpr


def _trace_region(ref: RegionRef, op: Op, region: Graph) -> Any:
    avals = [jax.ShapeDtypeStruct(v.type.shape, jc.dtype_from_name(v.type.dtype),
                                  weak_type=v.type.weak_type) for v in region.inputs]
    closed = jc.make_jaxpr_from(lambda *xs: eval_graph(region, list(xs)), avals)
    if ref.closed:
        return closed
    jaxpr, consts = jc.jaxpr_parts(closed)
    if consts:
        raise _CapturedConstants(f"{op.name}: region ^{ref.index} captured constants but "
                                 f"the primitive takes an open jaxpr ({op.loc})")
    return jaxpr


class _CapturedConstants(LoweringError):
    """An open jaxpr's region holds array constants (``_remat`` takes them as operands)."""


def _param(v: Any, op: Op) -> Any:
    if isinstance(v, RegionRef):
        return _rebuild(v, op)
    if isinstance(v, Opaque):
        if v.obj is None:
            raise LoweringError(f"{op.name}: attribute <{v.text}> was parsed from text and cannot "
                                f"be rebuilt; lower the graph from a trace instead ({op.loc})")
        return v.obj
    if isinstance(v, tuple) and any(isinstance(x, RegionRef) for x in v):
        items = [_param(x, op) for x in v]  # NamedTuples (custom_linear_solve) keep their type
        return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
    return v


def _bind(op: Op, args: list[Any]) -> list[Any]:
    prim = op.impl or jc.primitive_by_name(op.name)
    if prim is None:
        raise LoweringError(f"no lowering rule and no JAX primitive named {op.name!r} ({op.loc})")
    params = {k: _param(v, op) for k, v in op.attrs if k not in NOTE_ATTRS}
    out = jc.bind(prim, args, jc.bind_params(prim.name, params, len(args)))
    return list(out) if prim.multiple_results else [out]


def scope_name(op: Op) -> str:
    """The name scope an op lowers under (``hlo_report.ir_scope``). XLA copies it into the
    ``op_name`` metadata of every HLO instruction made for the op (collectives the SPMD
    partitioner inserts included), which is how ``compiler.hlo_report`` maps them back."""
    sources = op.attr("sources") if op.name == "all_reduce" else None
    if sources:  # a bucket of gradient all-reduces: every member's line, nested scopes
        return "/".join(ir_scope(op.name, *s.rsplit(":", 1)) for s in sources)
    # (the user's line where the op's is a library's: flax's linear.py for every layer)
    key = (op.name, *jc.user_site(op.loc.file, op.loc.line, op.loc.traceback))
    name = _SCOPES.get(key)
    if name is None:
        if len(_SCOPES) >= 65536:
            _SCOPES.clear()
        name = _SCOPES[key] = ir_scope(*key)
    return name


_SCOPES: dict[tuple, str] = {}
#: ops that make no HLO of their own (a NumPy constant, a type-level cast): no scope to name
_UNSCOPED = frozenset({"constant", "cast_varying"})
#: does every op lower under its scope (K > 1: XLA's partitioner may make a collective of
#: any op), or only the collectives (K = 1: they are the only ones)? Set by ``build_jitted``
_SCOPE_EVERY_OP: contextvars.ContextVar[bool] = contextvars.ContextVar("scope_every_op",
                                                                       default=True)


def _scope(op: Op) -> str | None:
    """The name scope ``op`` lowers under, or ``None`` (no HLO of its own, no line, or
    no collective where only collectives are named: ``_SCOPE_EVERY_OP``).

    The scope is how ``compiler.hlo_report`` finds the IR op and the user's line behind
    a collective; nothing else reads it. Every op's HLO names the user's frames that
    made it as ``jax.jit``'s does (``source_file``/``source_line`` metadata, which
    profilers show), through the traceback its :class:`~ir.graph.Loc` kept from the
    trace (``_Stager.source_info``, ``_op_context``); before, each op's line was in its
    ``op_name`` only and its source frames were the caller's of ``lower``."""
    if op.name in _UNSCOPED or op.loc is None or not op.loc.line:
        return None
    if op.name not in COLLECTIVES and not _SCOPE_EVERY_OP.get():
        return None
    return scope_name(op)


def _user_traceback(op: Op) -> Any:
    """The traceback of the user's code that made ``op`` (``Loc.traceback``), or ``None``."""
    return None if op.loc is None or op.name in _UNSCOPED else op.loc.traceback


@contextlib.contextmanager
def _op_context(op: Op, scope: str | None):
    """The context a rule lowers ``op`` in: what it stages names the user's frames that
    made the op, as ``_Stager.source_info`` gives the ops it stages itself, and the op's
    scope (``_scope``)."""
    tb = _user_traceback(op)
    with (contextlib.nullcontext() if tb is None else jc.user_traceback(tb)), \
            (contextlib.nullcontext() if scope is None else jax.named_scope(scope)):
        yield


class _Stager:
    """Stages the ops of the graph ``build_jitted`` is lowering that re-bind their JAX
    primitive (no lowering rule, no region) straight into its trace: one ``JaxprEqn``
    each, appended to the trace's frame with JAX's abstract evaluation (``jc.emit``; its
    results stay ``Var`` objects until a rule or JAX needs a tracer: ``jc.traced``), else
    as ``prim.bind`` would (``jc.stage``); with the source info
    ``jax.named_scope(scope_name(op))`` would give them made once per scope: the second
    trace stages every op of the step, and entering a name scope and taking a traceback
    for each was a fifth of its cost, a tracer per result half of what was left."""

    def __init__(self) -> None:
        self.infos: dict[tuple, tuple] = {}
        self.traceback: Any = None
        self.recorded: dict[tuple, Any] = {}  # calls to replay (``shared_call``), by key
        self.consts: dict[tuple, Any] = {}  # constants made, by value (``jc.emit``)
        self.rules: dict[tuple, Any] = {}  # what rules staged, to replay (``rule_call``)
        # every graph's values, kept until the trace's end: JAX drops a constant of the
        # frame whose tracer died, and an op of constants only (a weak-typed array the step
        # closes over, cast to its strong type) is folded by JAX into one, which the ops
        # after it read as a ``Var`` (a ``KeyError`` when ``shard_map`` lowered them)
        self.envs: list[dict] = []

    def source_info(self, op: Op) -> Any:
        ctx = jc.source_info_context()
        scope = _scope(op)
        user_tb = _user_traceback(op)
        key = (id(ctx), scope, id(user_tb))
        hit = self.infos.get(key)
        if hit is None:  # (the entry keeps its context and traceback alive: ids not reused)
            # the frames of the user's code that made the op (kept from the trace), else
            # those of the context (a rule's op: ``eval_graph``), else the caller's, the
            # same for every op
            traceback = user_tb if user_tb is not None else ctx.traceback
            if traceback is None:
                if self.traceback is None:
                    self.traceback = jc.current_source_info().traceback
                traceback = self.traceback
            stack = ctx.name_stack if scope is None else ctx.name_stack.extend(scope)
            hit = self.infos[key] = (jc.source_info(traceback, stack), ctx, user_tb)
        return hit[0]

    def shared_call(self, op: Op, args: list[Any], ctx: Any) -> list[Any] | None:
        """A ``jit`` op calling a shared region (:func:`_call`): the first call per region
        key and argument types goes through its nested ``jax.jit``, and what that staged
        is appended again for the others (``jc.call_and_record``, ``jc.emit_recorded``),
        skipping ``jax.jit``'s dispatch and trace-cache look-up (~35 us of ~50 per call;
        a 32-layer step makes 64). ``None``: lower it by its rule."""
        shared = _shared(op, args)
        if shared is None:
            return None
        info = self.source_info(op)
        atoms = jc.atoms(args, info, self.consts)
        if atoms is None:
            return None
        key = (shared[0], tuple([a.aval for a in atoms]))
        recorded = self.recorded.get(key)
        if recorded is not None:
            return jc.emit_recorded(recorded, atoms, info, ctx)
        with _op_context(op, _scope(op)):
            outs, recorded = jc.call_and_record(shared[1], jc.atom_tracers(atoms, info))
        if recorded is not None:
            self.recorded[key] = recorded
        return outs

    def rule_call(self, op: Op, rule: Rule, args: list[Any], ctx: Any) -> list[Any] | None:
        """An op lowered by a rule of :data:`_REPLAYED` (a function of the op's attributes
        and operand types only): the first call per attributes and operand types runs the
        rule, and what it staged is staged again for the others (``jc.recorded_since``,
        ``jc.emit_recording``): a 32-layer step all-reduces 64 gradients of two types,
        and ``lax.pmean`` costs ~50 us a call. ``None``: lower it the usual way."""
        info = self.source_info(op)
        atoms = jc.atoms(args, info, self.consts)
        if atoms is None or not jc.plain_vars(atoms):
            return None
        try:
            key = (op.name, tuple([(k, _attr_key(v)) for k, v in op.attrs]),
                   tuple([a.aval for a in atoms]))
        except _Unkeyable:
            return None
        recording = self.rules.get(key)
        if recording is not None:
            return jc.emit_recording(recording, atoms, info, ctx)
        mark = jc.frame_mark()
        with _op_context(op, _scope(op)):
            outs = rule(op, jc.atom_tracers(atoms, info))
        if mark is not None:
            recording = jc.recorded_since(mark, atoms, outs, info)
            if recording is not None:
                self.rules[key] = recording
        return outs

    def stage(self, op: Op, args: list[Any], ctx: Any) -> list[Any] | None:
        """An op without regions (``eval_graph`` calls this for no other): its attributes
        hold no region reference (the verifier's rule), so of ``_param``'s cases only an
        opaque attribute needs its object back. ``ctx``: JAX's equation context."""
        prim = op.impl
        if prim is None:
            return None
        params = {}
        for k, v in op.attrs:
            if type(v) is Opaque:
                v = _param(v, op)
            elif k in NOTE_ATTRS:
                continue
            params[k] = v
        info = self.source_info(op)
        out = jc.emit(prim, args, params, info, ctx, self.consts)
        if out is None:
            out = jc.stage(prim, jc.traced(args, info), params, info)
        return out


#: ops whose rule stages the same equations for the same attributes and operand types
#: (the platform and the mesh being those of the graph ``build_jitted`` lowers)
_REPLAYED = frozenset({"all_reduce", "all_gather", "all_gather_invariant", "all_to_all"})

#: the stager of the graph ``build_jitted`` is lowering (``None`` outside it)
_STAGER: contextvars.ContextVar[_Stager | None] = contextvars.ContextVar("stager", default=None)


def eval_graph(graph: Graph, args: Sequence[Any]) -> list[Any]:
    """Evaluate ``graph`` on JAX values (inside a trace); returns the outputs."""
    env = dict(zip(graph.inputs, args))
    stager = _STAGER.get()
    # (the same for every op here: nothing enters a context between them)
    ctx = jc.eqn_context() if stager is not None else None
    # (K > 1 only, which ``_SCOPE_EVERY_OP`` is: with K = 1 a convolution, a gather, a pad
    # are staged directly, as before their rules existed)
    model_rules = MODEL_AXES_RULES if _SCOPE_EVERY_OP.get() else {}
    for op in graph.ops:
        try:
            outs = None
            vals = [env[v] for v in op.operands]
            if stager is not None:
                if not op.regions and op.name not in LOWERING_RULES and \
                        op.name not in model_rules:
                    outs = stager.stage(op, vals, ctx)
                elif op.name in _SHARABLE:
                    outs = stager.shared_call(op, vals, ctx)
            if outs is None:
                fn = model_rules.get(op.name) or LOWERING_RULES.get(op.name, _bind)
                if fn is _cast_varying:  # (an identity: ``Var`` objects pass as they are)
                    env.update(zip(op.results, vals))
                    continue
                if stager is not None and op.name in _REPLAYED:
                    outs = stager.rule_call(op, fn, vals, ctx)
                    if outs is not None:
                        env.update(zip(op.results, outs))
                        continue
                scope = _scope(op)
                if stager is not None and jc.has_vars(vals):  # (rules take tracers)
                    vals = jc.traced(vals, stager.source_info(op))
                if scope is None and _user_traceback(op) is None:
                    outs = fn(op, vals)
                else:
                    with _op_context(op, scope):
                        outs = fn(op, vals)
        except LoweringError:
            raise
        except Exception as e:  # attach the op and the user's line to JAX's error
            raise LoweringError(f"lowering {op.name} ({op.loc}) failed: {type(e).__name__}: {e}") from e
        env.update(zip(op.results, outs))
    outs = [env[v] for v in graph.outputs]
    if stager is None:
        return outs
    stager.envs.append(env)
    return jc.traced(outs, jc.current_source_info())


def build_jitted(graph: Graph, mesh: Mesh, in_varying: Sequence[bool], in_ranks: Sequence[int],
                 out_varying: Sequence[bool], out_ranks: Sequence[int],
                 donate_argnums: tuple[int, ...] = (), in_tree: Any = None,
                 out_tree: Any = None) -> Any:
    """``jax.jit`` of the graph run per replica under ``shard_map`` over ``replica``.

    Varying inputs/outputs are laid out concatenated along axis 0 (scalars stacked into a
    length-N vector); mirrored ones are replicated over replicas. Over the model axes
    (K > 1) inputs and outputs take the shardings the ``sharding`` pass gave the graph's
    inputs and outputs; inside, the model axes are left to XLA's partitioner.

    The jitted function takes the graph's inputs as flat positional arguments, or, given
    ``in_tree`` (the treedef of a tuple of arguments) and ``out_tree``, the arguments in
    that structure and returns the results in ``out_tree``'s."""
    from compiler.passes.hoist_collectives import check_no_divergent_collectives
    check_no_divergent_collectives(graph)  # whatever the pipeline: never a hang
    k = logical_devices_of(mesh)

    platform = mesh.devices.flat[0].platform if hasattr(mesh, "devices") else ""

    last_stager: list[_Stager] = []

    def body(*xs):
        args = [x.reshape(()) if v and r == 0 else x for x, v, r in zip(xs, in_varying, in_ranks)]
        token, shared = _PLATFORM.set(platform), _SHARED.set(_Sharing(graph))
        every = _SCOPE_EVERY_OP.set(k > 1)
        # kept past the trace's end (``shard_map`` makes the jaxpr after ``body``
        # returns), with the tracers of the constants its equations read
        last_stager[:] = [_Stager()]
        stager = _STAGER.set(last_stager[0])
        try:
            outs = eval_graph(graph, args)
        finally:
            _STAGER.reset(stager)
            _SCOPE_EVERY_OP.reset(every)
            _SHARED.reset(shared)
            _PLATFORM.reset(token)
        return tuple(o.reshape((1,)) if v and r == 0 else o
                     for o, v, r in zip(outs, out_varying, out_ranks))

    in_specs = tuple(P(REPLICA_AXIS) if v else P() for v in in_varying)
    out_specs = tuple(P(REPLICA_AXIS) if v else P() for v in out_varying)
    manual = {REPLICA_AXIS} if k > 1 else set(mesh.axis_names)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False, axis_names=manual)
    in_sh = tuple(NamedSharding(mesh, partition_spec(v.type.sharding, r, k, var))
                  for v, r, var in zip(graph.inputs, in_ranks, in_varying))
    out_sh = tuple(NamedSharding(mesh, partition_spec(v.type.sharding, r, k, var))
                   for v, r, var in zip(graph.outputs, out_ranks, out_varying))
    if in_tree is not None:
        flat_mapped = mapped

        def mapped(*args):  # the caller's own argument structure
            return out_tree.unflatten(flat_mapped(*jax.tree.leaves(args)))
        in_sh, out_sh = tuple(in_tree.unflatten(in_sh)), out_tree.unflatten(out_sh)
    return jax.jit(mapped, in_shardings=in_sh, out_shardings=out_sh,
                   donate_argnums=donate_argnums)


from compiler import lower_sharding  # noqa: E402,F401  (registers the ``shard`` rule)
