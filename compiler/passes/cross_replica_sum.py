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
                           "copy_p", "slice", "rev", "cumsum"})
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
    if p is not None and (len(p.results) == 1 or p.name == "split") and depth < 512:
        if _mean_candidate(p, enclosing):
            out = True
        elif p.name in _LINEAR_UNARY or p.name == "split" or (
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
    memo[v] = out
    return out


def _gradient_sum(op: Op, enclosing: bool) -> bool:
    """An all-reduce sum of one value of static shape, made by transposition."""
    return (op.name == "all_reduce" and op.attr("reduce") == "sum" and len(op.operands) == 1
            and transposed(op, enclosing)
            and all(isinstance(d, int) for d in op.operands[0].type.shape))


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
        if p is None or (len(p.results) != 1 and p.name != "split") or not holds_reduce(v):
            others.add((id(reader), pos))
            continue
        if v in inside:
            continue
        inside[v] = p
        if _mean_candidate(p, enclosing):
            reduces[id(p)] = p
        elif p.name in _LINEAR_UNARY or p.name in _LINEAR_ZERO_REST or p.name == "split":
            stack.append((p.operands[0], p, 0))  # (zeros: as they are)
        elif p.name == "dynamic_update_slice":  # (into zeros: ``_holds_reduce``)
            stack.append((p.operands[1], p, 1))
        elif p.name == "select_n":  # the cases, each divided or holding a mean
            stack.extend((u, p, i) for i, u in enumerate(p.operands) if i > 0)
        elif p.name in _LINEAR_SUMS:
            stack.extend((u, p, i) for i, u in enumerate(p.operands))
        else:  # one-sided: the operand with the all-reduce (a div's numerator)
            sides = (0,) if p.name == "div" else (0, 1)
            with_reduce = [i for i in sides if holds_reduce(p.operands[i])]
            if len(with_reduce) != 1:
                return None
            stack.append((p.operands[with_reduce[0]], p, with_reduce[0]))
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
# there, once after the sum here). So a gradient all-reduce moves below the ops of one
# operand its result alone feeds that widen, round or shrink it, or only rearrange it
# (``_SINKS``, a broadcast that adds unit dims, a cast to a narrower float and back, a
# pad with zeros, an update of zeros or a split that a widening cast reads, a product
# with a mirrored factor, a select between it and zeros; a ``jax.jit`` call that reads
# a narrow sum is inlined first, as ``jnp.pad`` and ``jnp.where`` are),
# and below an ``add_any`` of such sums: each replica applies them to its
# own addend, and the sum follows, in the wider type. Σ_r f(a_r) = f(Σ_r a_r) for these
# linear maps, so only the rounding changes, to the per-replica program's.
_SINKS = frozenset({"reduce_sum", "reshape", "transpose", "squeeze", "expand_dims", "copy",
                    "copy_p", "reduce_precision", "convert_element_type", "slice", "cumsum",
                    "neg", "rev"})
_SUMS = frozenset({"add_any", "add"})


def _size(v: Value) -> int | None:
    n = 1
    for d in v.type.shape:
        if not isinstance(d, int):
            return None
        n *= d
    return n


def _float_dtype(name: str) -> Any:
    dtype = jc.dtype_from_name(name)
    return dtype if jax.numpy.issubdtype(dtype, jax.numpy.floating) else None


def _sinkable_reduce(op: Op, enclosing: bool) -> bool:
    """A gradient all-reduce sum of one static float value (bfloat16 and float8 too), over
    the replicas only (``_sink_sums``)."""
    return (_gradient_sum(op, enclosing) and not op.attr("axis_index_groups")
            and _float_dtype(op.operands[0].type.dtype) is not None)


def _sinks_through(op: Op) -> bool:
    """Does a gradient all-reduce move below ``op`` (``_SINKS``; a cast only between
    float types, to one at least as wide; a broadcast only of unit dims)?"""
    if op.name == "broadcast_in_dim":
        return _size(op.results[0]) == _size(op.operands[0])
    if op.name != "convert_element_type":
        return op.name in _SINKS
    a, b = (_float_dtype(v.type.dtype) for v in (op.operands[0], op.results[0]))
    return a is not None and b is not None and b.itemsize >= a.itemsize


def _rounds(op: Op, users: dict[Value, list[Op]], waits: Callable[[Value], bool]) -> bool:
    """Is ``op`` a cast to a narrower float type whose result only a cast back to one at
    least as wide as its operand reads (``x.astype(float8).astype(float32)``: a rounding,
    as ``reduce_precision``)?"""
    if op.name != "convert_element_type" or not waits(op.results[0]):
        return False
    (back,) = users[op.results[0]]
    a, b, c = (_float_dtype(v.type.dtype) for v in (op.operands[0], op.results[0],
                                                     back.results[0]))
    return (a is not None and b is not None and c is not None and back.name == op.name
            and c.itemsize >= a.itemsize)


def _widened_alone(op: Op, users: dict[Value, list[Op]], waits: Callable[[Value], bool],
                   producers: Callable[[], dict[Value, Op]]) -> bool:
    """Does every result of ``op`` reach a cast to a wider float type through ops that
    only rearrange it (``_REARRANGES``, a ``split``, a pad with zeros, an update of zeros,
    an ``add_any``; each result read once)? (A pad or an update of zeros, the transpose
    of a slice, grows the sum, and a ``split``, the transpose of a ``concatenate``, makes
    one sum several: a sum moves below them only to follow such a cast:
    ``w.astype(float16)[:, :4]``, ``jnp.concatenate([w.astype(bfloat16)] * 2)`` of a
    float32 weight.)"""
    for v in op.results:
        while True:
            if not waits(v):
                return False
            (u,) = users[v]
            if u.name == "convert_element_type":
                if not _sinks_through(u):
                    return False
                break
            if u.name == "split":
                if not _widened_alone(u, users, waits, producers):
                    return False
                break
            if u.name in _REARRANGES or u.name in _SUMS or (
                    u.name == "broadcast_in_dim" and _sinks_through(u)):
                pass  # (a sum: ``moves`` asks that a sum of the same kind is each addend)
            elif u.name == "pad" and u.operands[0] is v and is_zero(u.operands[1], producers()):
                pass
            elif u.name == "dynamic_update_slice" and u.operands[1] is v and \
                    _updates_zeros(u, producers()):
                pass
            else:
                return False
            v = u.results[0]
    return True


#: ops that only move, keep or drop a value's elements (``_widened_alone``)
_REARRANGES = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p",
                         "slice", "rev"})


#: ops that call their one region on their operands and return its outputs
#: (``jax.jit``, ``jax.checkpoint``): a gradient sum they return moves out of them
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "named_call", "remat2",
                    "checkpoint", "remat"})


def _hoist_from_calls(graph: Graph, enclosing: bool, memo: dict) -> Graph:
    """``graph`` with the gradient all-reduces that a call's region returns as they are
    (the backward pass of ``jax.checkpoint(layer)`` or ``jax.jit(layer)`` applied to a
    weight cast outside it, jmp's pattern) moved after the call: the region returns the
    replica's own addend, so the sum can then move below the cast (``_sink_sums``).
    (No value is renamed: the call's hoisted results are new values, and the sums after
    it define the old ones, so every other op stays as it is.)"""
    if not any(op.name in _CALLS for op in graph.ops):
        return graph
    ops: list[Op] = []
    changed = False
    for op in graph.ops:
        body = op.regions[0] if op.name in _CALLS and len(op.regions) == 1 else None
        if body is None or len(body.outputs) != len(op.results):
            ops.append(op)
            continue
        inner = transposed(op, enclosing)
        key = (id(body), inner)  # (a region several calls share: sunk and read once;
        if key not in memo:      # the entry holds the region, so its id stays its own)
            sunk = _sink_sums(body, inner, memo)
            memo[key] = (body, sunk, _returned_sums(sunk, inner))
        _, body, hoisted = memo[key]
        if not hoisted:
            changed |= body is not op.regions[0]
            ops.append(op if body is op.regions[0] else op.replace(regions=(body,)))
            continue
        changed = True
        dropped = {id(r) for r in hoisted.values()}
        body = body.replace(ops=tuple(o for o in body.ops if id(o) not in dropped),
                            outputs=tuple(hoisted[j].operands[0] if j in hoisted else v
                                          for j, v in enumerate(body.outputs)))
        results = tuple(Value(r.type.with_replica(Replica.VARYING)) if j in hoisted else r
                        for j, r in enumerate(op.results))
        ops.append(op.with_values(op.operands, results, (body,)))
        ops.extend(Op("all_reduce", (results[j],), (op.results[j],), reduce.attrs, op.loc)
                   for j, reduce in sorted(hoisted.items()))
    return Graph(graph.inputs, tuple(ops), graph.outputs, graph.name) if changed else graph


def _returned_sums(body: Graph, enclosing: bool) -> dict[int, Op]:
    """By output position, the gradient all-reduces ``body`` returns as they are (read by
    nothing else, returned once)."""
    if not any(op.name == "all_reduce" for op in body.ops):
        return {}
    producers, users = body.producers(), body.users()
    return {j: producers[v] for j, v in enumerate(body.outputs)
                  if v in producers and _sinkable_reduce(producers[v], enclosing)
                  and not users.get(v) and body.outputs.count(v) == 1}


#: calls inlined where they read a narrow gradient sum (``_inline_narrow_sum_calls``)
_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})


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
    if not any(op.name in _INLINED for op in graph.ops) or not any(
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
            if o.name in _INLINED and len(o.regions) == 1 and \
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
            if op.name in _INLINED and len(op.regions) == 1 and \
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
    """``graph`` with its gradient all-reduces moved below the ops described above (and
    out of the calls that return them: ``_hoist_from_calls``). An all-reduce moves only
    when the op reading it moves too (so it keeps its place in the program otherwise):
    found first (``moving``), then the graph rebuilt (no value renamed: a moved op reads
    the addends and defines a new one, the sum after it defines the old result)."""
    graph = _hoist_from_calls(graph, enclosing, {} if memo is None else memo)
    graph = _inline_narrow_sum_calls(graph, enclosing)
    if not any(op.name == "all_reduce" and _sinkable_reduce(op, enclosing) for op in graph.ops):
        return graph
    users, outputs = graph.users(), set(graph.outputs)
    made: list = []  # (the producers, made on first need: only zero checks read them)

    def producers() -> dict[Value, Op]:
        if not made:
            made.append(graph.producers())
        return made[0]

    def waits(v: Value) -> bool:
        return v not in outputs and len(users.get(v, ())) == 1

    def moves(op: Op, held: set[Value], attrs: dict[Value, Any]) -> bool:
        """Does the sum move below ``op``, its operands in ``held`` waiting for theirs?"""
        if not any(v in held for v in op.operands):
            return False
        if op.name == "split":  # (one sum made one per piece: only to be widened)
            return _widened_alone(op, users, waits, producers)
        if len(op.results) != 1:
            return False
        if op.name in _SUMS:
            return all(v in held for v in op.operands) and \
                len({attrs[v] for v in op.operands}) == 1
        if op.name == "pad":  # (its padding value is a second operand)
            return (op.operands[0] in held and is_zero(op.operands[1], producers())
                    and _widened_alone(op, users, waits, producers))
        if op.name == "dynamic_update_slice":  # (into zeros: the transpose of a slice)
            return (op.operands[1] in held and not any(v in held for v in op.operands[2:])
                    and _updates_zeros(op, producers())
                    and _widened_alone(op, users, waits, producers))
        if op.name in ("mul", "div", "select_n"):  # (linear in one operand, the rest mirrored)
            sides = {"mul": (0, 1), "div": (0,), "select_n": tuple(range(1, len(op.operands)))}
            mine = [i for i, v in enumerate(op.operands) if v in held]
            rest = [v for i, v in enumerate(op.operands) if i not in mine]
            return (len(mine) == 1 and mine[0] in sides[op.name]
                    and all(v.type.replica is Replica.MIRRORED for v in rest)
                    and (op.name != "select_n" or all(
                        is_zero(v, producers()) for v in rest[1:])))
        return len(op.operands) == 1 and (_sinks_through(op) or _rounds(op, users, waits))

    # which ops the sums move below, if every sum that can wait does
    held: set[Value] = set()
    attrs: dict[Value, Any] = {}
    moving: set[int] = set()
    for op in graph.ops:
        if op.name == "all_reduce" and _sinkable_reduce(op, enclosing):
            if waits(op.results[0]):
                held.add(op.results[0])
                attrs[op.results[0]] = op.attrs
        elif held and moves(op, held, attrs):
            moving.add(id(op))
            kind = attrs[next(v for v in op.operands if v in held)]
            for r in op.results:
                if waits(r):
                    held.add(r)
                    attrs[r] = kind
    if not moving:
        return graph

    def defer(v: Value) -> bool:
        return v in held and id(users[v][0]) in moving

    ops: list[Op] = []
    # a value whose all-reduce waits: (the replica's own addend, the all-reduce to emit
    # below the ops that move)
    pending: dict[Value, tuple[Value, Op]] = {}
    for op in graph.ops:
        if op.name == "all_reduce" and op.results[0] in held and defer(op.results[0]):
            pending[op.results[0]] = (op.operands[0], op)
            continue
        if id(op) not in moving:
            ops.append(op)
            continue
        reduce = next(pending[v][1] for v in op.operands if v in pending)
        addends = tuple(Value(r.type.with_replica(Replica.VARYING)) for r in op.results)
        ops.append(Op(op.name, tuple(pending.pop(v)[0] if v in pending else v
                                     for v in op.operands), addends, op.attrs, op.loc, (),
                      op.impl))
        for r, addend in zip(op.results, addends):
            if defer(r):
                pending[r] = (addend, reduce)
            else:
                ops.append(reduce.with_values((addend,), (r,)))
    return Graph(graph.inputs, tuple(ops), graph.outputs, graph.name)


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
                    r not in inside for p in inside.values() for r in p.results):
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
    sources = tuple(dict.fromkeys(f"{os.path.basename(m.loc.file)}:{m.loc.line}"
                                  for m in members if m.loc is not None and m.loc.line))
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
