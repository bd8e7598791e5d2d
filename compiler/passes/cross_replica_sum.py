"""The ``cross-replica-sum`` pass: TF's loss reduction on the gradients of mirrored
values, and the gradient all-reduces marked (and optionally bucketed).

Where the all-reduces come from: the step is traced per replica with JAX's varying-type
checks on, so where a mirrored value meets a per-replica one JAX inserts a cast to
varying, and ``jax.grad`` transposes that cast into a cross-replica sum on the gradient
of the mirrored value (JAX's exact derivative of the global program).

Where the loss reduction comes from: not from these sums. The trace marks the two ends of
every pullback with ``loss_scale(x) {replicas=a, reduction=b}`` (see
``compiler.trace``): seeds of outputs identical on every replica (``replicas=1``) and
gradients of mirrored primals (``reduction=1``). This pass replaces each marker by
x · N^a · r^b, with r = 1/N for ``loss_reduction="mean"`` and 1 for ``"sum"`` (a factor
of 1 is no op at all, 1/N a division by N as in ``pmean``). Nothing else is scaled, so a
constant in a user's ``custom_vjp`` backward function, a user's collective, a loop or a
branch can never change the factor: the result is c·∇ Σ_r L_r by construction, with c the
reduction and an identical L counted once per replica (TF's semantics).

Contract:
- no ``loss_scale`` op is left (lowering refuses one: a pipeline without this pass fails
  instead of silently computing ``"sum"``). Gradient all-reduces stay sums (so buckets
  merge them all); a ``"mean"`` shows as the division by N that follows;
- a gradient all-reduce of a float value on whose way to the outputs a float cast
  (mixed precision) or ``reduce_precision`` rounds, or of a float16 one, runs after
  the ops linear in it (``_defer_sums``: slices, sums, casts, calls, scans...), as pmap
  code sums after each replica's cast back; float32 programs keep their sums in place;
- every all-reduce made by transposition (the backward pass) gets ``gradient=True``;
  where float16 values are on the way from such all-reduces to a ``"mean"`` division
  through linear ops only, the division moves below them and they become all-reduces
  ``mean``: their sum could overflow where the mean does not (``_half_means``);
- a user ``all_reduce(sum)`` of a value already identical on every replica gives a warning
  naming the source line (a sum multiplies it by N); a ``pmean`` does not, nor does a sum
  of constants (``lax.psum(1, axis)``: pmap code's count of the replicas), nor does any
  sum when N = 1;
- with ``bucket_bytes > 0``, independent gradient all-reduces of one kind are merged
  into variadic all-reduces of at most that many bytes (see ``_bucket``).
"""
from __future__ import annotations

import functools
import heapq
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from compiler.errors import PassError
from ir import _jax_compat as jc
from ir.graph import Graph, Loc, Op, RegionMemo, Rewriter, Value
from ir.ops import PLAIN_CALLS, REMAT_CALLS
from ir.types import Replica, TensorType


# JAX's name for the forward pass that a transposed ``jax.checkpoint`` recomputes inside
# its backward region (jax/_src/ad_checkpoint.py): not transposed, though it sits there.
_REMAT_FORWARD = "rematted_computation"


def transposed(op: Op, enclosing: bool) -> bool:
    """Did transposition (a backward pass) make ``op``? Ops in a transposed op's regions
    have name stacks that start afresh, so the enclosing op's answer carries over, except
    for the forward pass a checkpoint recomputes there. Only labels all-reduces
    (``gradient=True``, bucketing); no number depends on it."""
    stack = op.loc.name_stack if op.loc is not None else ""
    if _REMAT_FORWARD in stack:
        return "transpose(" in stack.split(_REMAT_FORWARD, 1)[1]
    return enclosing or "transpose(" in stack


def is_zero(v: Value, producers: dict[Value, Op]) -> bool:
    """Is ``v`` a constant zero, broadcast, converted or reshaped (``producers``: the op
    making each value)? Also asked by ``hoist-collectives`` and the padding pass (a zero a
    scatter adds into)."""
    op = producers.get(v)
    while op is not None and op.name in ("broadcast_in_dim", "convert_element_type", "reshape"):
        op = producers.get(op.operands[0])
    if op is None or op.name != "constant":
        return False
    val = np.asarray(op.attr("value"))
    return val.dtype != object and not np.any(val)


@functools.cache
def _primitive(name: str) -> tuple[Any, tuple[tuple[str, Any], ...]]:
    """JAX's ``mul`` / ``div`` primitive and the parameters it is bound with (they change
    between JAX versions, so they are read off a trace instead of written here)."""
    fn = {"mul": lambda a, b: a * b, "div": lambda a, b: a / b}[name]
    return jc.traced_primitive(fn, np.float32(1), np.float32(1))


def _scale_ops(x: Value, result: Value, power: int, n: int, loc: Loc | None) -> list[Op]:
    """Ops computing ``result = x * n**power`` (``x / n**-power`` when negative)."""
    c = Value(TensorType((), result.type.dtype, Replica.MIRRORED))
    dtype = jc.dtype_from_name(result.type.dtype)
    prim, params = _primitive("mul" if power > 0 else "div")
    return [Op("constant", (), (c,), (("value", np.asarray(n ** abs(power), dtype)),)),
            Op(prim.name, (x, c), (result,), params, loc, impl=prim)]


def _is_pmean(result: Value, all_users: dict[Value, list[Op]], producers: dict[Value, Op],
              n: int) -> bool:
    """Is every reader of an all-reduce's result a division by the replica count (a
    ``pmean``, which leaves an identical value unchanged), possibly after a cast (the
    ``pmean`` of a bool or an integer sums in an integer type, then divides as a float)?"""
    users = all_users.get(result, [])
    for u in users:
        if u.name == "convert_element_type" and u.operands[0] is result:
            if not _is_pmean(u.results[0], all_users, producers, n):
                return False
            continue
        if u.name != "div" or u.operands[0] is not result:
            return False
        c = producers.get(u.operands[1])
        if c is None or c.name != "constant" or np.asarray(c.attr("value")).size != 1 \
                or float(np.asarray(c.attr("value")).reshape(())) != n:
            return False
    return bool(users)


def _nbytes(v: Value) -> int:
    n = 1
    for d in v.type.shape:
        n *= d if isinstance(d, int) else 1
    try:
        return n * np.dtype(v.type.dtype).itemsize
    except TypeError:
        return n * 4


def _uses(graph: Graph, cache: list) -> list:
    """The graph's users and producers, made on first need into ``cache`` (most graphs
    never ask)."""
    if not cache:
        cache.extend((graph.users(), graph.producers()))
    return cache


#: ops of one operand that a division by N commutes with (``_half_means``)
_LINEAR_UNARY = frozenset({"convert_element_type", "reduce_sum", "reshape", "transpose",
                           "squeeze", "expand_dims", "broadcast_in_dim", "neg", "copy",
                           "copy_p", "slice", "rev", "cumsum", "reduce_window_sum"})
#: ops linear in their first operand when every other one is a zero constant (a pad's
#: fill, the transpose of a slice: x/N padded with zeros is (x padded)/N)
_LINEAR_ZERO_REST = frozenset({"pad"})


def _updates_zeros(op: Op, producers: dict[Value, Op]) -> bool:
    """Is ``op`` an update of zeros at indices identical on every replica (the transpose
    of a ``dynamic_slice``: linear in the update)?"""
    return (op.name == "dynamic_update_slice" and is_zero(op.operands[0], producers)
            and all(v.type.replica is Replica.MIRRORED for v in op.operands[2:]))


#: ops linear in every operand: each must be made of such all-reduces
_LINEAR_SUMS = frozenset({"add_any", "add", "sub", "concatenate"})
#: ops that cut their one operand into pieces (``unstack``: the transpose of a stack)
_SPLITS = frozenset({"split", "unstack"})
#: ops linear in their first operand, the others indices (a division commutes with them)
_INDEXED = frozenset({"gather", "dynamic_slice"})
#: ops linear in one operand (``div``: its numerator), the other a factor
_LINEAR_ONE_SIDED = frozenset({"mul", "dot_general", "div"})


def _holds_reduce(v: Value, producers: dict[Value, Op], enclosing: bool,
                  memo: dict[Value, bool], depth: int = 0) -> bool:
    """Is a gradient all-reduce (``_mean_candidate``) among ``v``'s linear producers?
    (A module function: a closure calling itself would be a reference cycle.)"""
    if v in memo:
        return memo[v]
    p = producers.get(v)
    out = False
    if p is not None and (len(p.results) == 1 or p.name in _SPLITS) and depth < 512:
        if _mean_candidate(p, enclosing):
            out = True
        elif p.name in _LINEAR_UNARY or p.name in _SPLITS or p.name in _INDEXED or (
                p.name in _LINEAR_ZERO_REST and all(
                    is_zero(u, producers) for u in p.operands[1:])):
            out = _holds_reduce(p.operands[0], producers, enclosing, memo, depth + 1)
        elif _updates_zeros(p, producers):
            out = _holds_reduce(p.operands[1], producers, enclosing, memo, depth + 1)
        elif p.name == "select_n":  # (linear in the cases; the predicate picks)
            out = any(_holds_reduce(u, producers, enclosing, memo, depth + 1)
                      for u in p.operands[1:])
        elif p.name in _LINEAR_SUMS or p.name in _LINEAR_ONE_SIDED:
            out = any(_holds_reduce(u, producers, enclosing, memo, depth + 1)
                      for u in p.operands)
        else:
            out = bool(_linear_reduce_operands(p, producers, functools.partial(
                _holds_reduce, producers=producers, enclosing=enclosing, memo=memo,
                depth=depth + 1)))
    memo[v] = out
    return out


#: ops ``_linear_in`` takes that a division by N does not pass exactly: a rounding
#: (``x/N`` may fall below float16's normal range where ``x`` does not)
_ROUNDING = frozenset({"reduce_precision"})


def _linear_reduce_operands(op: Op, producers: dict[Value, Op],
                            holds_reduce: Callable[[Value], bool]) -> list[int]:
    """The positions of ``op``'s operands holding gradient all-reduces when ``op`` is
    linear in them together (``_linear_in``; its other operands coefficients or zeros,
    whatever their variance: a division by N commutes with it all the same), else none:
    the ops beyond ``_holds_reduce``'s own rules that ``_half_means`` moves a division
    below (a convolution, a scatter, an update of zeros, a layout annotation...)."""
    if op.name in _ROUNDING:
        return []
    mine = [i for i, u in enumerate(op.operands) if holds_reduce(u)]
    if mine and _linear_in(op, mine, lambda v: True, lambda v: is_zero(v, producers)):
        return mine
    return []


def _gradient_sum(op: Op, enclosing: bool, static: bool = True) -> bool:
    """An all-reduce sum of one value (of static shape, with ``static``), made by
    transposition."""
    return (op.name == "all_reduce" and op.attr("reduce") == "sum" and len(op.operands) == 1
            and transposed(op, enclosing)
            and (not static or all(isinstance(d, int) for d in op.operands[0].type.shape)))


def _mean_candidate(op: Op, enclosing: bool) -> bool:
    """A gradient all-reduce sum of one static float value (``_half_means``)."""
    return _gradient_sum(op, enclosing) and \
        jc.dtype_from_name(op.operands[0].type.dtype).kind == "f"


def _closure(scale: Op, producers: dict[Value, Op], holds_reduce: Callable[[Value], bool],
             enclosing: bool) -> tuple | None:
    """The values a ``loss_scale``'s division can move below (``_half_means``): ``(values
    on the way by producer, all-reduces by id, {(reader id, operand position)} of the
    other values, readers by id)``, or ``None`` where a product has an all-reduce in both
    factors (not linear)."""
    inside: dict[Value, Op] = {}
    reduces: dict[int, Op] = {}
    others: set[tuple[int, int]] = set()
    readers: dict[int, Op] = {}
    stack = [(scale.operands[0], scale, 0)]
    while stack:
        v, reader, pos = stack.pop()
        p = producers.get(v)
        readers[id(reader)] = reader
        if p is None or (len(p.results) != 1 and p.name not in _SPLITS) or not holds_reduce(v):
            others.add((id(reader), pos))
            continue
        if v in inside:
            continue
        inside[v] = p
        if _mean_candidate(p, enclosing):
            reduces[id(p)] = p
        elif p.name in _LINEAR_UNARY or p.name in _LINEAR_ZERO_REST or p.name in _SPLITS \
                or p.name in _INDEXED:
            stack.append((p.operands[0], p, 0))  # (zeros, indices: as they are)
        elif p.name == "dynamic_update_slice":  # (into zeros: ``_holds_reduce``)
            stack.append((p.operands[1], p, 1))
        elif p.name == "select_n":  # the cases, each divided or holding a mean
            stack.extend((u, p, i) for i, u in enumerate(p.operands) if i > 0)
        elif p.name in _LINEAR_SUMS:
            stack.extend((u, p, i) for i, u in enumerate(p.operands))
        elif p.name in _LINEAR_ONE_SIDED:  # the operand with the all-reduce (a div's numerator)
            sides = (0,) if p.name == "div" else (0, 1)
            with_reduce = [i for i in sides if holds_reduce(p.operands[i])]
            if len(with_reduce) != 1:
                return None
            stack.append((p.operands[with_reduce[0]], p, with_reduce[0]))
        else:  # linear in the operands holding all-reduces, the others as they are
            stack.extend((p.operands[i], p, i)
                         for i in _linear_reduce_operands(p, producers, holds_reduce))
    return inside, reduces, others, readers


# -- gradient sums below each replica's own casts ---------------------------------------
# JAX sums a mirrored value's gradient over the replicas where the value first meets a
# per-replica one (the transpose of its cast to varying), not where the gradient of the
# mirrored input ends. In a mixed-precision step (float32 master weights cast to bfloat16
# or float16 inside the step, as jmp does) that is the low-precision cotangent of the
# cast: the replicas' addends were summed in bfloat16 (257 rounded to 256, so a replica's
# 1 was lost) or float16 (4 × 20000 = inf), then widened, where pmap code and TF (each
# replica's float32 gradient, then all-reduced) and ``jax.jit`` on the global batch give
# 128.5 and 80000. The same holds for ``lax.reduce_precision`` (rounded per replica
# there, once after the sum here). So the sum is deferred (``_sink_sums``): the ops that
# are linear in it with coefficients identical on every replica (``_linear_in``: slices,
# pads and updates of zeros, splits, concatenations, reshapes, sums and products with
# mirrored factors, selects against zeros, casts, ...) run on each replica's own addend,
# and the all-reduce comes just before the first op that is not linear in it, or at the
# graph's end (after the casts back to the weight's type, where pmap code sums). Σ_r f(a_r) =
# f(Σ_r a_r) for these linear maps, so only the rounding changes, to the per-replica
# program's. A sum is deferred only where a rounding is on its way (a cast, a
# ``reduce_precision``): elsewhere the program stays as it is. A ``jax.jit`` call that
# reads a narrow sum is inlined first, as ``jnp.pad`` and ``jnp.where`` are; a call
# that returns a deferred narrow sum (a ``jax.checkpoint``ed layer slicing its cast
# weight) returns the replica's addend, and the sum follows the call.
_SUMS = frozenset({"add_any", "add"})
#: ops a deferred sum passes as it is (``_LINEAR_UNARY`` less the cast, which only
#: between float types: ``_float_cast``; the splits; a rounding, done per replica as pmap does)
_LINEAR_UNARY_SINK = (_LINEAR_UNARY - {"convert_element_type"}) | _SPLITS | {
    "reduce_precision", "shard", "sharding_constraint"}  # (and the layout annotations)


def _float_dtype(name: str) -> Any:
    dtype = jc.dtype_from_name(name)
    return dtype if jax.numpy.issubdtype(dtype, jax.numpy.floating) else None


def _sinkable_reduce(op: Op, enclosing: bool) -> bool:
    """A gradient all-reduce sum of one float value (bfloat16 and float8 too; its shape
    may hold dynamic dims: the padding pass masks what the deferred ops read), over the
    replicas only (``_sink_sums``)."""
    return (_gradient_sum(op, enclosing, static=False) and not op.attr("axis_index_groups")
            and _float_dtype(op.operands[0].type.dtype) is not None)


def _float_cast(op: Op) -> bool:
    """Is ``op`` a cast between float types (a rounding or a widening)?"""
    return op.name == "convert_element_type" and all(
        _float_dtype(v.type.dtype) is not None for v in (op.operands[0], op.results[0]))


def _linear_in(op: Op, mine: list[int], mirrored: Callable[[Value], bool],
               zero: Callable[[Value], bool]) -> bool:
    """Is ``op`` linear in its operands at positions ``mine`` (deferred sums of one kind),
    its other operands identical on every replica (``mirrored``)? Then it runs on each
    replica's addends and its results are deferred sums too."""
    name, ops_ = op.name, op.operands
    rest = [v for i, v in enumerate(ops_) if i not in mine]
    if name in _LINEAR_UNARY_SINK or _float_cast(op):
        return len(ops_) == 1
    if name in _SUMS or name == "sub":  # (zeros: as they are)
        return all(zero(v) for v in rest)
    if name == "optimization_barrier":  # (each result its operand, as it is)
        return not rest
    if name == "concatenate":  # (pieces of zeros: as they are)
        return all(zero(v) for v in rest)
    if name == "pad":
        return mine == [0] and zero(ops_[1])
    if name == "dynamic_update_slice":  # (onto zeros, or zeros onto it: the transposes of
        # a dynamic slice and of an update; zeros as they are)
        return set(mine) <= {0, 1} and all(zero(ops_[i]) for i in (0, 1) if i not in mine) \
            and all(mirrored(v) for v in ops_[2:])
    if name in _INDEXED:
        return mine == [0] and all(mirrored(v) for v in rest)
    if name in ("mul", "dot_general", "conv_general_dilated"):
        return len(mine) == 1 and all(mirrored(v) for v in rest)
    if name in ("scatter-add", "scatter"):  # (adds or writes updates into an operand, at
        # indices identical on every replica; zeros as they are: ``.at[i].set(0)``)
        return 1 not in mine and mirrored(ops_[1]) and all(zero(ops_[i]) for i in (0, 2)
                                                           if i not in mine)
    if name == "scatter-mul":  # (the operand's rows scaled by mirrored factors)
        return mine == [0] and all(mirrored(v) for v in rest)
    if name == "div":
        return mine == [0] and mirrored(ops_[1])
    if name in ("select_and_scatter_add", "select_and_gather_add"):  # (max pooling's
        # gradient and tangent: linear in the source, the pooled operand picks where)
        return mine == [0] and mirrored(ops_[1])
    if name == "select_n":  # (the predicate picks; the other cases zeros)
        return 0 not in mine and mirrored(ops_[0]) and all(zero(v) for v in rest[1:])
    return False


#: ops that call their one region on their operands and return its outputs
#: (``jax.jit``, ``jax.checkpoint``): a gradient sum they return moves out of them
_CALLS = PLAIN_CALLS | REMAT_CALLS


def _hoist_from_calls(graph: Graph, enclosing: bool, memo: dict) -> Graph:
    """``graph`` with the gradient all-reduces that a call's region returns deferred (the
    backward pass of ``jax.checkpoint(layer)`` or ``jax.jit(layer)`` applied to a weight
    cast outside it, jmp's pattern; a sum returned as it is or, if narrow, through linear
    ops: ``_sink_sums(returns=True)``) moved after the call: the region returns the
    replica's own addend, so the sum can then follow it below the cast. (No value is
    renamed: the call's hoisted results are new values, and the sums after it define the
    old ones, so every other op stays as it is.)"""
    if not any(op.name in _CALLS or op.name == "cond" for op in graph.ops):
        return graph
    ops: list[Op] = []
    changed = conds = False
    for op in graph.ops:
        if op.name == "cond":
            new = _hoist_from_cond(op, enclosing, memo)
            changed |= new is not None
            conds |= new is not None
            ops.extend([op] if new is None else new)
            continue
        body = op.regions[0] if op.name in _CALLS and len(op.regions) == 1 else None
        if body is None or len(body.outputs) != len(op.results):
            ops.append(op)
            continue
        inner = transposed(op, enclosing)
        key = (id(body), inner)  # (a region several calls share: sunk and read once;
        if key not in memo:      # the entry holds the region, so its id stays its own)
            memo[key] = (body, *_defer_sums(body, inner, memo, returns=True))
        _, new_body, hoisted = memo[key]
        if not hoisted:
            changed |= new_body is not body
            ops.append(op if new_body is body else op.replace(regions=(new_body,)))
            continue
        changed = True
        results = tuple(Value(r.type.with_replica(Replica.VARYING)) if j in hoisted else r
                        for j, r in enumerate(op.results))
        ops.append(op.with_values(op.operands, results, (new_body,)))
        ops.extend(Op("all_reduce", (results[j],), (op.results[j],), reduce.attrs, op.loc)
                   for j, reduce in sorted(hoisted.items()))
    if not changed:
        return graph
    new = Graph(graph.inputs, tuple(ops), graph.outputs, graph.name)
    # (a branch that returns a mirrored zero where another returns an addend)
    return _retyped(new) if conds else new


def _retyped(graph: Graph) -> Graph:
    """``graph`` with its values' variances derived again from its inputs' (the
    replication pass's rules): after a scan's or cond's regions were made to take or
    return addends where a mirrored zero comes in or goes out."""
    from compiler.passes.replication import annotate
    return annotate(graph, [v.type.replica or Replica.VARYING for v in graph.inputs])[0]


def _hoist_from_cond(op: Op, enclosing: bool, memo: dict) -> list[Op] | None:
    """A ``cond`` whose index is identical on every replica and whose branches return a
    narrow gradient sum (as ``_hoist_from_calls`` takes one out of a call), or a zero, at
    the same results: the cond with each branch returning the replica's addend there,
    then the sums (``None``: nothing to take out). The backward pass of ``lax.cond(flag,
    lambda v: v * m, ...)`` on a bfloat16 weight and per-replica data ``m``: before, the
    sum stayed in the branch, in bfloat16, before the cast back."""
    if op.operands[0].type.replica is not Replica.MIRRORED or any(
            len(g.outputs) != len(op.results) for g in op.regions):
        return None
    inner = transposed(op, enclosing)
    sunk = []
    for g in op.regions:
        key = (id(g), inner)
        if key not in memo:
            memo[key] = (g, *_defer_sums(g, inner, memo, returns=True))
        sunk.append(memo[key][1:])
    hoisted: dict[int, Op] = {}
    for _, h in sunk:
        for j, reduce in h.items():
            hoisted.setdefault(j, reduce)
    if not hoisted or len({r.attrs for r in hoisted.values()}) != 1 or any(
            any(not is_zero(g.outputs[j], prods) for j in hoisted if j not in h)
            for g, h in sunk for prods in (g.producers(),)):
        return None  # (a branch returns something else there, or sums of other kinds)
    results = tuple(Value(r.type.with_replica(Replica.VARYING)) if j in hoisted else r
                    for j, r in enumerate(op.results))
    return [op.with_values(op.operands, results, tuple(g for g, _ in sunk)), *(
        Op("all_reduce", (results[j],), (op.results[j],), reduce.attrs, op.loc)
        for j, reduce in sorted(hoisted.items()))]


def _narrow_sum(op: Op, enclosing: bool) -> bool:
    """A gradient all-reduce of a float type narrower than float32 (``_sinkable_reduce``)."""
    return (op.name == "all_reduce" and _sinkable_reduce(op, enclosing)
            and _float_dtype(op.operands[0].type.dtype).itemsize < 4)


def _inline_narrow_sum_calls(graph: Graph, enclosing: bool) -> Graph:
    """``graph`` with the calls (``jax.jit``: ``jnp.pad``, ``jnp.where``, ``jnp.cumsum``
    are jitted functions) that read a value computed from a bfloat16/float16/float8
    gradient all-reduce inlined, nested ones too: their sum can then move below what the
    call does with it to the widening cast after it (``_sink_sums``), or take its mean
    (``_half_means``); before, it stayed in the narrow type (four replicas' float16 16384
    summed to inf where pmap gives a finite mean). A call computes what its ops do, so
    inlining it changes no number. The inlined ops are new values (a region several
    calls share keeps its own)."""
    if not any(op.name in PLAIN_CALLS for op in graph.ops) or not any(
            _narrow_sum(op, enclosing) for op in graph.ops):
        return graph
    rw = Rewriter(graph)
    narrow: set[Value] = set()  # (values of ``rw``'s graph computed from a narrow sum)
    changed = False

    def inline(op: Op, env: Rewriter) -> None:
        body = op.regions[0]
        inner = Rewriter(body)
        for a, v in zip(body.inputs, op.operands):
            inner.alias(a, env.get(v))
        for o in body.ops:
            if o.name in PLAIN_CALLS and len(o.regions) == 1 and \
                    len(o.regions[0].inputs) == len(o.operands):
                inline(o, inner)
                continue
            results = tuple(Value(r.type) for r in o.results)
            for r, nr in zip(o.results, results):
                inner.alias(r, nr)
            rw.add(o.with_values(tuple(inner.get(v) for v in o.operands), results, o.regions))
        for r, out in zip(op.results, body.outputs):
            env.alias(r, inner.get(out))

    for op in graph.ops:
        if _narrow_sum(op, enclosing):
            narrow.update(op.results)
        elif any(rw.get(v) in narrow for v in op.operands):
            if op.name in PLAIN_CALLS and len(op.regions) == 1 and \
                    len(op.regions[0].inputs) == len(op.operands):
                start = len(rw.ops)
                inline(op, rw)
                changed = True
                narrow.update(r for o in rw.ops[start:] for r in o.results)
                continue
            narrow.update(op.results)
        rw.emit(op)
    return rw.finish() if changed else graph


def _sink_sums(graph: Graph, enclosing: bool, memo: dict | None = None) -> Graph:
    """``graph`` with its gradient all-reduces deferred below the ops linear in them (see
    the comment above), and out of the calls that return them (``_hoist_from_calls``)."""
    return _defer_sums(graph, enclosing, {} if memo is None else memo)[0]


def _defer_sums(graph: Graph, enclosing: bool, memo: dict, returns: bool = False,
                inputs: dict[int, Op] | None = None) -> tuple[Graph, dict[int, Op]]:
    """``_sink_sums``; with ``returns`` (a call's region), a deferred sum the region
    returns (as it is, or a narrow one through linear ops) stays the replica's addend, and
    the second result maps its output position to the all-reduce that the caller emits.
    ``inputs``: the region's inputs that are deferred sums at the call (by position, with
    an all-reduce of each: attributes, location), given as the replica's addends.

    First the deferral is planned: walking the ops, the results of a sinkable all-reduce
    and of every op linear in such values (``_linear_in``) are *deferred*, in groups that
    merge where an op reads several. A group is deferred only when a rounding is on its
    way (a cast between float types, ``reduce_precision``), or it reaches the region's
    results (``returns``). Then the graph is rebuilt: deferred ops read the addends, and
    a deferred value that anything else reads (or the graph returns) is summed just
    before its first such reader, defining the old value: where pmap code sums its
    gradients, after the casts back to the weights' type."""
    graph = _hoist_from_calls(graph, enclosing, memo)
    graph = _inline_narrow_sum_calls(graph, enclosing)
    inputs = inputs or {}
    if not inputs and not any(op.name == "all_reduce" and _sinkable_reduce(op, enclosing)
                              for op in graph.ops):
        return graph, {}
    made: list = []  # (the producers, made on first need: only zero checks read them)

    def producers() -> dict[Value, Op]:
        if not made:
            made.append(graph.producers())
        return made[0]

    def zero(v: Value) -> bool:
        return is_zero(v, producers())

    parent: dict[int, int] = {}

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g
    group: dict[Value, int] = {}  # deferred value -> its group
    kind: dict[int, Any] = {}     # group -> the attributes of its all-reduces
    source: dict[int, Op] = {}    # group -> an all-reduce of it (attributes, location)
    rounds: set[int] = set()      # groups with a rounding on the way
    planned: dict[int, list[int]] = {}  # op id -> the positions of its deferred operands
    needed: set[Value] = set()    # deferred values something else reads

    # planned call id -> region (a scan's or cond's: the op, lifted), sums
    calls: dict[int, tuple[Graph | Op, dict[int, Op]]] = {}

    def mirrored(v: Value) -> bool:  # (a deferred value summed before: as it is)
        return (v not in group or v in needed) and v.type.replica is Replica.MIRRORED

    def start(v: Value, op: Op) -> None:
        g = parent[len(parent)] = len(parent)
        group[v], kind[g], source[g] = g, op.attrs, op
        if v.type.dtype == "float16":  # (deferred to where a float16 mean can be taken)
            rounds.add(g)
    for i, op in inputs.items():  # (the caller defers them: they move whatever happens)
        start(graph.inputs[i], op)
        rounds.add(group[graph.inputs[i]])
    for op in graph.ops:
        mine = [i for i, v in enumerate(op.operands) if v in group and v not in needed]
        if op.name == "all_reduce" and _sinkable_reduce(op, enclosing) and not mine:
            start(op.results[0], op)
            continue
        if not mine:
            continue
        roots = {find(group[op.operands[i]]) for i in mine}
        through = None  # (a call: its region with the deferred inputs, the sums it returns)
        if len({kind[g] for g in roots}) == 1 and op.name in _CALLS and len(op.regions) == 1 \
                and len(op.regions[0].inputs) == len(op.operands) == len(set(op.operands)):
            body, inner = op.regions[0], transposed(op, enclosing)
            key = (id(body), inner, tuple(mine))
            if key not in memo:
                src = source[min(roots)]
                memo[key] = (body, *_defer_sums(body, inner, memo, returns=True,
                                                inputs={i: src for i in mine}))
            through = memo[key][1:]
        loop = None  # (a scan, a cond: the op with its regions taking addends, the addend results)
        if len({kind[g] for g in roots}) == 1 and op.name in ("scan", "cond"):
            loop = _lifted_for_addends(op, mine, producers())
            if loop is not None:
                through = (loop[0], dict.fromkeys(loop[1]))
        if len({kind[g] for g in roots}) != 1 or (
                through is None and not _linear_in(op, mine, mirrored, zero)):
            needed.update(op.operands[i] for i in mine)
            continue
        g = min(roots)
        if roots & rounds or _float_cast(op) or op.name == "reduce_precision" or (
                through is not None and (_float_dtype(op.operands[mine[0]].type.dtype)
                                         .itemsize < 4 or _rounds_inside(op))):
            # (a cast between float types rounds, or widens: see above; a narrow sum out of
            # a call: a float16 mean can follow; a region that casts: the sum went in
            # before a rounding, which it must follow as it does outside one)
            rounds.add(g)
        for other in roots:
            parent[other] = g
        planned[id(op)] = mine
        if through is not None:
            calls[id(op)] = through
            for j in through[1]:
                group[op.results[j]] = g
            continue
        for r in op.results:
            group[r] = g
    outputs = graph.outputs
    returned: dict[int, int] = {}  # output position -> group, returned as the addend
    if returns:
        for j, v in enumerate(outputs):
            if v in group and v not in needed and outputs.count(v) == 1:
                g = find(group[v])
                narrow = _float_dtype(v.type.dtype).itemsize < 4
                if narrow or graph.producers().get(v) is source[g] or v in graph.inputs:
                    returned[j] = g
    moving = {find(g) for g in parent} & (rounds | {find(g) for g in returned.values()})
    if not moving:
        return graph, {}
    moves = lambda v: v in group and find(group[v]) in moving  # noqa: E731
    keep = {v for j, v in enumerate(outputs) if j in returned and moves(v)}
    addend: dict[Value, Value] = {}
    summed: set[Value] = set()
    ops: list[Op] = []
    retype = False

    def total(v: Value) -> None:
        """The deferred value ``v``, summed (its first reader that is not linear)."""
        if v not in summed:
            summed.add(v)
            src = source[find(group[v])]
            ops.append(Op("all_reduce", (addend[v],), (v,), src.attrs, src.loc))
    new_inputs = list(graph.inputs)
    for i in inputs:
        v = graph.inputs[i]
        new_inputs[i] = addend[v] = Value(v.type.with_replica(Replica.VARYING))
    for op in graph.ops:
        mine = planned.get(id(op))
        if mine and moves(op.operands[mine[0]]):
            for i, v in enumerate(op.operands):
                if i not in mine and moves(v):
                    total(v)  # (summed before, by an earlier reader: see ``mirrored``)
            operands = tuple(addend[v] if i in mine else v for i, v in enumerate(op.operands))
            if id(op) in calls:  # (the sums it returns deferred, its other results as they are)
                body, sums = calls[id(op)]
                results = tuple(Value(r.type.with_replica(Replica.VARYING)) if j in sums else r
                                for j, r in enumerate(op.results))
                if isinstance(body, Op):  # (a scan or cond: the op, its regions lifted)
                    retype = True
                    ops.append(body.with_values(operands, results, body.regions))
                else:
                    ops.append(op.with_values(operands, results, (body,)))
                addend.update((op.results[j], results[j]) for j in sums)
                continue
            results = tuple(Value(r.type.with_replica(Replica.VARYING)) for r in op.results)
            ops.append(Op(op.name, operands, results, op.attrs, op.loc, op.regions, op.impl))
            addend.update(zip(op.results, results))
            continue
        if op.name == "all_reduce" and mine is None and moves(op.results[0]):
            addend[op.results[0]] = op.operands[0]  # (a deferred sum's start)
            continue
        for v in op.operands:
            if moves(v):
                total(v)
        ops.append(op)
    for v in outputs:
        if moves(v) and v not in keep:
            total(v)
    hoisted = {j: source[g] for j, g in returned.items() if g in moving}
    new_outputs = tuple(addend[v] if j in hoisted else v for j, v in enumerate(outputs))
    new = Graph(tuple(new_inputs), tuple(ops), new_outputs, graph.name)
    # (a scan's carry that starts at a mirrored zero now holds an addend, a cond's branch
    # returns one where another returns a mirrored zero)
    return (_retyped(new) if retype else new), hoisted


def _rounds_inside(op: Op) -> bool:
    """Does a region of ``op`` (nested ones too) cast between float types or
    ``reduce_precision``? A gradient sum going into such a call, ``cond`` or ``scan``
    linearly is deferred past it (``_defer_sums``): the backward pass of
    ``jax.jit(lambda w: w.astype(f16) * 2)(w)``, a weight's own computation inside a call
    whose inputs are all mirrored, casts the summed cotangent to float16 inside the call;
    four replicas' 20000 summed there overflowed to inf, where pmap code sums the
    replicas' gradients after their cast back."""
    return any(_float_cast(o) or o.name == "reduce_precision"
               for g in op.regions for o, _ in g.walk())


def _lifted_for_addends(op: Op, mine: list[int], producers: dict[Value, Op]
                        ) -> tuple[Op, set[int]] | None:
    """The ``scan`` or ``cond`` ``op`` run on the replicas' addends of its operands at
    ``mine`` (deferred sums), when it is linear in them (its regions' ops, as
    ``hoist-collectives`` lifts them: a scan's carry that takes an addend starts as one or
    at zero; a cond's branches return an addend or zero at each such result, its index
    identical on every replica; a gradient sum inside becomes its addend too): the op
    with its regions rewritten and the positions of its results that are then addends;
    ``None`` when it is not linear in them (the sum then stays before it). The backward
    scan over a stacked weight cast to bfloat16 (a scan over layers), or over a cast
    weight it closes over or indexes (``v[i]`` in a ``fori_loop``), loops in loops, and a
    ``lax.cond`` on a mirrored flag, then sum after the cast back, as pmap code does."""
    from compiler.passes.hoist_collectives import _Lifter, _Refused
    try:
        if op.name == "cond":
            if 0 in mine or op.operands[0].type.replica is not Replica.MIRRORED:
                return None
            return _Lifter(1).cond(op, {i - 1 for i in mine})
        if op.attr("num_consts") is None or op.attr("num_carry") is None:
            return None
        return _Lifter(1)._scan(op, [i in mine for i in range(len(op.operands))], producers)
    except _Refused:
        return None


@dataclass(frozen=True)
class CrossReplicaSumPass:
    """Marks and scales gradient all-reduces (see module docstring)."""

    loss_reduction: str = "mean"
    num_replicas: int = 1
    bucket_bytes: int = 0
    name: str = "cross-replica-sum"

    def __post_init__(self) -> None:
        if self.loss_reduction not in ("mean", "sum"):
            raise PassError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")

    def apply(self, graph: Graph) -> Graph:
        graph = self._rewrite(graph, False, RegionMemo())
        if self.bucket_bytes > 0:
            graph = self._bucket(graph)
        return graph

    def _power(self, op: Op) -> int:
        """The power of N that a ``loss_scale`` op multiplies by."""
        reduction = -1 if self.loss_reduction == "mean" else 0
        return int(op.attr("replicas", 0)) + reduction * int(op.attr("reduction", 0))

    def _half_means(self, graph: Graph, enclosing: bool,
                    uses: list) -> tuple[set[int], dict[int, set[int]]]:
        """Where a float16 gradient all-reduce's sum could overflow though its mean does
        not (four of 16384 under a 2**15 loss scale: inf, where ``jax.jit`` and pmap
        code that unscales before its ``pmean`` give 16384; XLA keeps the sum in float16;
        also the loss seed of a regularizer every replica adds, summed over the replicas
        before it meets the weights), the divisions by N of the ``"mean"`` ``loss_scale``
        ops move below the sums. The values those divisions read, followed back through
        linear ops (``_LINEAR_UNARY``, ``_LINEAR_SUMS``, the operand of
        ``_LINEAR_ONE_SIDED`` ops that holds an all-reduce: a division commutes with
        them, exactly for N a power of two), end in gradient all-reduces, which take the
        mean instead, and other values, divided by N where they are read. Scales that
        share values move together; only when no op outside reads a value on the way
        (its scale would change) and a float16 value is among them. Returns the ids of
        those ``loss_scale`` ops (dropped) and all-reduces (made ``mean``), and per op id
        the operand positions of the other values (each divided by N before the op)."""
        if self.loss_reduction != "mean" or self.num_replicas == 1 or not any(
                r.type.dtype == "float16" for op in graph.ops for r in op.results):
            return set(), {}  # (no float16 value: no group qualifies; the common case)
        scales = [op for op in graph.ops if op.name == "loss_scale" and self._power(op) == -1]
        if not scales:
            return set(), {}
        users, producers = _uses(graph, uses)
        reducing: dict[Value, bool] = {}
        holds_reduce = functools.partial(_holds_reduce, producers=producers,
                                         enclosing=enclosing, memo=reducing)

        # each loss_scale's values on the way; scales that share one form a group, and a
        # group moves its divisions only as a whole (or not at all)
        closures = [_closure(op, producers, holds_reduce, enclosing) for op in scales]
        group = list(range(len(scales)))

        def root(i: int) -> int:
            while group[i] != i:
                group[i] = group[group[i]]
                i = group[i]
            return i
        first: dict[Value, int] = {}
        for i, c in enumerate(closures):
            for v in (c[0] if c is not None else ()):  # (None: its own group, skipped)
                j = first.setdefault(v, i)
                group[root(i)] = root(j)
        ids: set[int] = set()
        leaves: dict[int, set[int]] = {}
        for g in {root(i) for i in range(len(scales))}:
            members = [i for i in range(len(scales)) if root(i) == g]
            if any(closures[i] is None for i in members):
                continue  # (a product of two all-reduced values: not linear)
            inside = {v: p for i in members for v, p in closures[i][0].items()}
            reduces = {k: r for i in members for k, r in closures[i][1].items()}
            others = {o for i in members for o in closures[i][2]}
            readers = {k: r for i in members for k, r in closures[i][3].items()}
            scale_ids = {id(scales[i]) for i in members}
            inner = {id(p) for p in inside.values()} | scale_ids
            if any(id(u) not in inner for v in inside for u in users.get(v, ())) or any(
                    r not in inside and (users.get(r) or r in graph.outputs)
                    for p in inside.values() for r in p.results):
                continue  # something outside reads a value whose scale would change
            # (float16 on the way: a sum in float32 that a cast to float16 reads overflows
            # there, the seed of a float16 regularizer summed over the replicas)
            if not reduces or not any(v.type.dtype == "float16" for v in inside) or any(
                    jc.dtype_from_name(readers[r].operands[i].type.dtype).kind not in "fc"
                    for r, i in others):
                continue
            ids |= scale_ids | set(reduces)
            for r, i in others:
                leaves.setdefault(r, set()).add(i)
        return ids, leaves

    def _rewrite(self, graph: Graph, enclosing: bool, memo: RegionMemo) -> Graph:
        """``graph`` (a region: inside a transposed op when ``enclosing``) rewritten; a
        region several ops share is rewritten once per ``enclosing``."""
        graph = _sink_sums(graph, enclosing)
        rw = Rewriter(graph)
        uses: list = []  # (users, producers) of the graph, made for the first warning check
        half_means, divided = self._half_means(graph, enclosing, uses)
        for op in graph.ops:
            name = op.name
            if id(op) in divided:  # (a value added to a float16 mean: divided by N first)
                operands = list(op.operands)
                for pos in sorted(divided[id(op)]):
                    v = operands[pos]
                    operands[pos] = Value(v.type)
                    for new in _scale_ops(rw.get(v), operands[pos], -1, self.num_replicas,
                                          op.loc):
                        rw.add(new)
                op = op.replace(operands=tuple(operands))
            if name == "loss_scale":
                power = self._power(op) if self.num_replicas > 1 else 0
                (x,), (r,) = op.operands, op.results
                if power == 0 or id(op) in half_means:  # (the mean taken by its all-reduces)
                    rw.alias(r, rw.get(x))
                else:
                    for new in _scale_ops(rw.get(x), r, power, self.num_replicas, op.loc):
                        rw.add(new)
                continue
            if not op.regions and name != "all_reduce":
                rw.emit(op)  # (most ops: nothing to mark, nothing inside)
                continue
            is_t = transposed(op, enclosing)
            if op.regions:
                op = op.replace(regions=tuple(
                    memo.get(g, is_t, lambda g=g: self._rewrite(g, is_t, memo))
                    for g in op.regions))
            if name == "all_reduce" and op.attr("reduce") == "sum":
                if id(op) in half_means:
                    op = op.with_attrs(reduce="mean", gradient=True)
                elif is_t:
                    op = op.with_attrs(gradient=True)
                elif (self.num_replicas > 1  # (a sum over one replica changes nothing)
                      and all(v.type.replica is Replica.MIRRORED for v in op.operands)
                      and not self._all_pmean(op, graph, uses)
                      and not self._of_constants(op, graph, uses)
                      and not self._of_sizes(op, graph, uses)):
                    where = f" ({op.loc})" if op.loc else ""
                    warnings.warn(
                        f"all-reduce of a value that is already identical on every "
                        f"replica{where}: a sum multiplies it by {self.num_replicas} (a "
                        f"mean leaves it unchanged); gradients of mirrored values are "
                        f"already all-reduced by replicate()", stacklevel=2)
            rw.emit(op)
        return rw.finish()

    def _all_pmean(self, op: Op, graph: Graph, uses: list) -> bool:
        """Is each result of the all-reduce ``op`` read only by divisions by N (a
        ``pmean``)? ``uses`` caches the graph's users and producers (built on first need:
        most graphs never ask)."""
        users, producers = _uses(graph, uses)
        return all(_is_pmean(r, users, producers, self.num_replicas) for r in op.results)

    def _of_constants(self, op: Op, graph: Graph, uses: list) -> bool:
        """Are all of ``op``'s operands constants? ``lax.psum(1, axis)`` is pmap code's
        way to count the replicas: the sum by N is what it asks for."""
        producers = _uses(graph, uses)[1]

        def constant(v: Any) -> bool:
            p = producers.get(v)
            while p is not None and p.name == "cast_varying":  # (a cast keeps the value)
                p = producers.get(p.operands[0])
            return p is not None and p.name == "constant"
        return all(constant(v) for v in op.operands)

    def _of_sizes(self, op: Op, graph: Graph, uses: list) -> bool:
        """Is an operand of ``op`` computed from a dynamic dim's value (``x.shape[0]`` of
        a dynamic batch: each replica's own size, typed mirrored until the padding pass
        gives it one; the README's DP-SGD count ``all_reduce(float(x.shape[0]), "sum")``)?"""
        producers = _uses(graph, uses)[1]
        stack, seen = list(op.operands), set()
        while stack and len(seen) < 64:
            v = stack.pop()
            p = producers.get(v)
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            if p.name in ("dim_as_value", "dimension_size"):
                return True
            stack.extend(p.operands)
        return False

    def _bucket(self, graph: Graph) -> Graph:
        """Merge independent gradient all-reduces (same reduce kind) into variadic ones.

        Greedy in program order: an all-reduce joins the open bucket when the sizes fit and
        none of the bucket's members is among its ancestors (merging those would make a
        cycle). The merged op takes the place of the bucket's last member and the graph is
        re-scheduled by a topological sort that keeps program order wherever it can, so
        readers of an earlier member's result move after the merged op.

        Linear in the graph: each op's ancestors among the candidates are one bit mask
        (an int), built in one pass in program order."""
        ops = graph.ops
        candidates = [i for i, op in enumerate(ops)
                      if op.name == "all_reduce" and op.attr("gradient")]
        if len(candidates) < 2:
            return graph
        bit = {i: 1 << k for k, i in enumerate(candidates)}
        below = _candidate_ancestors(graph, bit)
        groups: list[list[int]] = []
        current: list[int] = []
        current_mask, size, kind = 0, 0, None
        for i in candidates:
            op = ops[i]
            nbytes = sum(_nbytes(v) for v in op.operands)
            if not (current and kind == op.attr("reduce") and size + nbytes <= self.bucket_bytes
                    and not below[i] & current_mask):
                if len(current) > 1:
                    groups.append(current)
                current, current_mask, size, kind = [], 0, 0, op.attr("reduce")
            current.append(i)
            current_mask |= bit[i]
            size += nbytes
        if len(current) > 1:
            groups.append(current)
        if not groups:
            return graph
        merged_at = {g[-1]: g for g in groups}
        dropped = {j for g in groups for j in g[:-1]}
        kept: dict[int, Op] = {}
        for i, op in enumerate(ops):
            if i in dropped:
                continue
            kept[i] = merged_all_reduce([ops[j] for j in merged_at[i]]) if i in merged_at else op
        return graph.replace(ops=tuple(kept[i] for i in _stable_topological_order(kept)))


def merged_all_reduce(members: list[Op]) -> Op:
    """One variadic gradient all-reduce of ``members`` (same reduce kind and axes), with
    their operands and results in order, at the last member's location."""
    last = members[-1]
    # every member's line (the merged op's location is the last one's): the collectives
    # report names them all (``compiler.lower.scope_name``)
    sources = tuple(dict.fromkeys(
        "{}:{}".format(os.path.basename(site[0]), site[1]) for m in members
        if m.loc is not None and m.loc.line
        for site in (jc.user_site(m.loc.file, m.loc.line, m.loc.traceback),)))
    return Op("all_reduce", tuple(v for m in members for v in m.operands),
              tuple(r for m in members for r in m.results),
              (("reduce", last.attr("reduce")), ("axes", last.attr("axes")),
               ("gradient", True), ("bucket", len(members)), ("sources", sources)), last.loc)


def _candidate_ancestors(graph: Graph, bit: dict[int, int]) -> list[int]:
    """Per op (by index), the bits of the candidate ops among its ancestors: the OR over
    its operands' producers of their own masks and bits. The ops are in program order
    (every operand defined before its reader), which the verifier guarantees."""
    producer: dict[Value, int] = {}
    below = [0] * len(graph.ops)
    for i, op in enumerate(graph.ops):
        m = 0
        for v in op.operands:
            j = producer.get(v)
            if j is not None:
                m |= below[j] | bit.get(j, 0)
        below[i] = m
        for r in op.results:
            producer[r] = i
    return below


def _stable_topological_order(ops: dict[int, Op]) -> list[int]:
    """The keys of ``ops`` (program positions) in a topological order of their operand
    dependences that takes the smallest position first whenever several ops are ready:
    the program order itself wherever the dependences allow it."""
    producer = {r: i for i, op in ops.items() for r in op.results}
    waiting: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for i, op in ops.items():
        deps = {producer[v] for v in op.operands if v in producer}
        waiting[i] = len(deps)
        for d in deps:
            readers.setdefault(d, []).append(i)
    ready = [i for i, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in readers.get(i, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(ops):
        raise PassError("cross-replica-sum: merging all-reduces made a dependence cycle")
    return order
