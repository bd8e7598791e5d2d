"""The ``replication`` pass: decide, for every value, whether it varies per replica.

Contract: after this pass every value (regions included) has ``type.replica`` set.
A value is ``mirrored`` when it is provably identical on every replica: mirrored inputs,
constants, the results of ``all_reduce``/``all_gather``, and the results of ops known
to be pure functions of their operands (``PURE``) when every operand is mirrored.
``replica_id``, per-replica inputs and the results of ``ppermute``, ``psum_scatter``,
``all_to_all``, ``io_callback`` and ``rng_uniform`` are ``varying``. Any other op is
varying unless JAX's own trace typed its result invariant (JAX's varying-type system is
sound for pure ops, so that is a proof); an op parsed
from text without that record is varying. Inputs whose variance is unknown count as
varying. The runtime returns mirrored outputs as one array. Per-op rules are in ``RULES``;
ops with regions use ``_region_rule``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ir.graph import Graph, Op, RegionMemo, Value
from ir.ops import PLAIN_CALLS
from ir.types import Replica, SymDim

V, M = Replica.VARYING, Replica.MIRRORED


def _any(reps: list[Replica]) -> Replica:
    return V if V in reps else M


# op name -> (operand variances, op) -> result variances
RULES: dict[str, Callable[[list[Replica], Op], list[Replica]]] = {
    # identical everywhere, unless only within groups of replicas (``axis_index_groups``)
    "all_reduce": lambda reps, op: [V if op.attr("axis_index_groups") else M] * len(op.results),
    "all_gather": lambda reps, op: [V if op.attr("axis_index_groups") else M] * len(op.results),
    "all_gather_invariant": lambda reps, op: [M] * len(op.results),
    "replica_id": lambda reps, op: [V] * len(op.results),
    "all_to_all": lambda reps, op: [V] * len(op.results),
    # each replica gets its own block / its neighbour's value
    "reduce_scatter": lambda reps, op: [V] * len(op.results),
    "psum_scatter": lambda reps, op: [V] * len(op.results),
    "ppermute": lambda reps, op: [V] * len(op.results),
    "ragged_all_to_all": lambda reps, op: [V] * len(op.results),
    # a host callback with effects runs once per replica and may answer each its own
    # value; XLA's stateful RNG draws per device (JAX types both invariant when their
    # operands are; the trace casts them to varying: ``jc.install_varying_sources``)
    "io_callback": lambda reps, op: [V] * len(op.results),
    "rng_uniform": lambda reps, op: [V] * len(op.results),
    "constant": lambda reps, op: [M] * len(op.results),
    # a cast of a mirrored value to JAX's "varying" type is still identical everywhere
    "cast_varying": lambda reps, op: list(reps),
}


#: JAX primitives (and ops of ours) whose results are a pure function of their operands:
#: identical operands on every replica give identical results. Everything else (callbacks,
#: stateful RNG, refs, FFI calls, new primitives) is not assumed to be.
PURE = frozenset("""
abs acos acosh add add_any and argmax argmin asin asinh atan atan2 atanh bessel_i0e
bessel_i1e bitcast_convert_type broadcast_in_dim broadcast_to cbrt ceil cholesky clamp clz
complex concatenate conj conv_general_dilated convert_element_type copy copy_p cos cosh
cumlogsumexp cummax cummin cumprod cumsum digamma div dot_general dynamic_slice
dynamic_update_slice eig eigh eq erf erf_inv erfc exp exp2 expm1 fft floor gather ge geqrf gt
householder_product igamma igamma_grad_a igammac imag integer_pow iota is_finite le lgamma
log log1p logistic lt lu lu_pivots_to_permutation max min mul ne neg nextafter not or pad
polygamma population_count pow qr random_bits random_fold_in random_gamma random_seed
random_split random_unwrap random_wrap real reduce reduce_and reduce_max reduce_min
reduce_or reduce_precision reduce_prod reduce_sum reduce_window reduce_window_max
reduce_window_min reduce_window_sum reduce_xor regularized_incomplete_beta rem reshape rev
rng_bit_generator round rsqrt scatter scatter-add scatter-max scatter-min scatter-mul
scatter-sub select_and_gather_add select_and_scatter select_and_scatter_add select_n
shift_left shift_right_arithmetic shift_right_logical sign sin sinh slice sort split sqrt
square squeeze stop_gradient sub svd tan tanh threefry2x32 tile top_k transpose
triangular_solve tridiagonal tridiagonal_solve xor zeta approx_top_k optimization_barrier
device_put zeros_like schur hessenberg symmetric_product ormqr geqp3 mulhi philox2x32
philox4x32 ragged_dot_general
shard loss_scale pad_mask pad_index dim_value dim_as_value dimension_size
""".split())


def _default_rule(reps: list[Replica], op: Op) -> list[Replica]:
    """Ops without a rule: pure ones vary where an operand does; others are varying unless
    JAX's trace typed the result invariant."""
    if V in reps:
        return [V] * len(op.results)
    if op.name in PURE:
        return [M] * len(op.results)
    traced = op.traced_varying
    if traced is None or len(traced) != len(op.results):
        return [V] * len(op.results)
    return [V if t else M for t in traced]


def annotate(graph: Graph, in_reps: list[Replica],
             memo: RegionMemo | None = None) -> tuple[Graph, list[Replica]]:
    """Retype ``graph`` with the given input variances; return it and its output variances.
    A region shared by several ops is retyped once per input variances (``memo``)."""
    return _annotate(graph, in_reps, RegionMemo() if memo is None else memo)


def _region(memo: RegionMemo, g: Graph, reps: list[Replica]) -> tuple[Graph, list[Replica]]:
    new, outs = memo.get(g, tuple(reps), lambda: _annotate(g, reps, memo))
    return new, list(outs)  # (a list of the caller's own)


def _annotate(graph: Graph, in_reps: list[Replica],
              memo: RegionMemo) -> tuple[Graph, list[Replica]]:
    rep: dict[Value, Replica] = dict(zip(graph.inputs, in_reps))
    new_vals: dict[Value, Value] = {}
    inputs = []
    for v, r in zip(graph.inputs, in_reps):
        nv = Value(v.type.with_replica(r))
        new_vals[v] = nv
        inputs.append(nv)
    ops = []
    producers = functools.cache(graph.producers)  # (for a per-replica cond's operands, once)
    for op in graph.ops:
        reps = [rep[v] for v in op.operands]
        regions = op.regions
        if op.regions:
            out_reps, regions = _region_rule(op, reps, memo, producers)
        else:
            rule = RULES.get(op.name, _default_rule)
            out_reps = rule(reps, op)
        results = []
        for r, o in zip(op.results, out_reps):
            if o is M and (op.name == "dim_as_value" or _sized(r)):
                o = V  # (each replica's own size: see ``_sized``)
            rep[r] = o
            nv = Value(r.type.with_replica(o))
            new_vals[r] = nv
            results.append(nv)
        ops.append(op.with_values(tuple([new_vals[v] for v in op.operands]), tuple(results),
                                  tuple(regions)))
    outs = tuple(new_vals[v] for v in graph.outputs)
    return Graph(tuple(inputs), tuple(ops), outs, graph.name), [rep[v] for v in graph.outputs]


def _sized(v: Value) -> bool:
    """Is ``v``'s shape made of a dynamic size (``b``: ``RunOptions(dynamic_shapes=True)``)?
    Each replica holds its own real size, so such a value, and a size's value
    (``dim_as_value``), differ between replicas whatever they are computed from:
    ``jnp.ones(b).sum()`` is 5 on one replica and 3 on another, and a cond on
    ``b > 4`` takes a branch per replica (typed mirrored, its gradient sums were taken for
    those of a mirrored index and never moved out of the branches)."""
    return any(isinstance(d, SymDim) for d in v.type.shape)


def _fixpoint(run: Callable[[list[Replica]], tuple[list[Graph], list[Replica]]],
              carry: list[Replica]) -> tuple[list[Graph], list[Replica]]:
    """Iterate a loop body until the carried variances stop changing (they only grow)."""
    while True:
        regions, new_carry = run(carry)
        merged = [_any([a, b]) for a, b in zip(carry, new_carry)]
        if merged == carry:
            return regions, carry
        carry = merged


def _region_rule(op: Op, reps: list[Replica], memo: RegionMemo,
                 producers: Callable[[], dict[Value, Op]]) -> tuple[list[Replica], list[Graph]]:
    a = op.attr_dict
    if op.name == "scan":
        nc, ncarry = a["num_consts"], a["num_carry"]
        consts, carry, xs = reps[:nc], reps[nc:nc + ncarry], reps[nc + ncarry:]

        def run(c):
            g, outs = _region(memo, op.regions[0], consts + c + xs)
            return [g], outs[:ncarry]
        regions, carry = _fixpoint(run, carry)
        _, outs = _region(memo, op.regions[0], consts + carry + xs)
        return carry + outs[ncarry:], regions
    if op.name == "while":
        cn, bn = a["cond_nconsts"], a["body_nconsts"]
        cconsts, bconsts, carry = reps[:cn], reps[cn:cn + bn], reps[cn + bn:]
        cond_i, body_i = a["cond_jaxpr"].index, a["body_jaxpr"].index

        def run(c):
            cg, cout = _region(memo, op.regions[cond_i], cconsts + c)
            bg, bout = _region(memo, op.regions[body_i], bconsts + c)
            if cout[0] is V:  # replicas may run different trip counts
                bout = [V] * len(bout)
            regs = [None, None]
            regs[cond_i], regs[body_i] = cg, bg
            return regs, bout
        regions, carry = _fixpoint(run, carry)
        return carry, regions
    if op.name == "cond":
        index, args = reps[0], reps[1:]
        regions, outs = [], [M] * len(op.results)
        for g in op.regions:
            ng, o = _region(memo, g, args)
            regions.append(ng)
            outs = [_any([x, y]) for x, y in zip(outs, o)]
        if index is V:  # (each replica takes its own branch: a result differs unless every
            # branch computes it alike from mirrored values: a constant mask, indices)
            # (the operands keyed too: a constant each branch's closure passes separately)
            outer = producers()
            ins = [("constant", _attrs_key(outer[v].attrs)) if v in outer and
                   outer[v].name == "constant" else ("operand", id(v)) for v in op.operands[1:]]
            first, *others = [_branch_keys(g, ins) for g in op.regions]
            outs = [M if o is M and first[j] is not None and all(k[j] == first[j] for k in others)
                    else V for j, o in enumerate(outs)]
        return outs, regions
    # call-like ops (pjit, custom_jvp_call, checkpoint, ...): region 0 takes the operands
    regions = []
    outs = [_any(reps)] * len(op.results)
    for i, g in enumerate(op.regions):
        if len(g.inputs) == len(reps):
            ng, o = _region(memo, g, reps)
            if i == 0 and len(o) == len(op.results):
                outs = o
        else:  # unknown calling convention: be conservative inside too
            ng, _ = _region(memo, g, [_any(reps)] * len(g.inputs))
        regions.append(ng)
    return outs, regions


def _attrs_key(x: Any) -> Any:
    """``x`` (attributes) as a comparable key: arrays by dtype, shape and bytes (their
    ``repr`` elides the middle of a large one), tuples item by item, the rest by ``repr``
    (a spurious difference only keeps a result varying)."""
    if isinstance(x, np.ndarray) or (hasattr(x, "__array__") and hasattr(x, "shape")):
        x = np.asarray(x)  # (a JAX array's repr elides too)
        # (an object array: only itself is equal to itself)
        return ("array", str(x.dtype), x.shape, x.tobytes() if x.dtype != object else id(x))
    if isinstance(x, tuple):
        return tuple(_attrs_key(y) for y in x)
    return repr(x)


def _branch_keys(g: Graph, inputs: list | None = None) -> list[tuple | None]:
    """A structural key of each output of ``g`` (a cond's branch): the ops computing it,
    their attributes (``_attrs_key``) and
    the branch inputs it reads, by position or by ``inputs`` (the keys of the cond's
    operands; a call's region keyed alike); ``None`` for one computed by another op with
    regions, or too deep. Outputs with equal keys in every branch are computed alike
    whichever branch a replica takes (the residuals a forward cond returns to its
    backward pass: a mask, gather indices)."""
    producers = g.producers()
    position = {v: (i if inputs is None else inputs[i]) for i, v in enumerate(g.inputs)}
    memo: dict[Value, tuple | None] = {}

    def key(v: Value, depth: int) -> tuple | None:
        if v in memo:
            return memo[v]
        if v in position:
            out: tuple | None = ("input", position[v])
        else:
            op = producers.get(v)
            if op is None or depth > 64 or (op.regions and op.name not in PLAIN_CALLS):
                out = None
            else:  # (a call: its region's outputs keyed the same way)
                args = [key(u, depth + 1) for u in op.operands]
                inner = tuple(tuple(_branch_keys(r)) for r in op.regions)
                out = None if any(a is None for a in args) or any(
                    k is None for r in inner for k in r) else (
                    op.name, _attrs_key(op.attrs), op.results.index(v), tuple(args), inner)
        memo[v] = out
        return out
    return [key(v, 0) for v in g.outputs]


@dataclass(frozen=True)
class ReplicationPass:
    """Marks every value ``varying`` or ``mirrored`` (see module docstring)."""

    name: str = "replication"

    def apply(self, graph: Graph) -> Graph:
        in_reps = [v.type.replica or V for v in graph.inputs]
        return annotate(graph, in_reps)[0]
