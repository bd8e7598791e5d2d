"""The ``sharding`` pass: validate the user's annotations and give every value a sharding
over the replica's K logical devices.

Contract
--------
After this pass every value (graph inputs, op results, region inputs and results) has
``type.sharding`` set, printed in XLA's notation. With ``num_logical_devices=1`` every
value is ``{replicated}`` (annotations are still validated).

- **Annotations.** A ``shard`` op fixes the sharding of its result to its ``sharding``
  attribute and seeds its operand with the same sharding (as a backward proposal).
  Before anything else every ``shard`` op (regions included) is validated: a device id
  outside ``[0, K)``, a device list that is not each of the K devices once, or tile
  dims that do not match the operand's rank (``last_tile_dim_replicate`` adds one) raise
  :class:`ShardingError` naming the op, the numbers and the source line.
- **Propagation** runs forward (operands -> results) and backward (results -> operands)
  with the per-op rules of ``RULES`` until nothing changes. Every rule returns, per value,
  candidate shardings or nothing ("no information"); see ``RULES`` for the table. Ops of
  unknown kind propose nothing either way; a value nobody proposes anything for ends
  ``{replicated}`` (the conservative default). Shardings already on the input graph's
  types are ignored: annotations are the only source, so the pass is idempotent.
- **Partial sums.** A dot_general with a split contracting dim (on either operand) and a
  reduction over a split dim compute partial sums on each device; the result is
  ``{replicated}`` (it needs an all-reduce over the replica's devices) unless a later
  ``shard`` annotates it otherwise. Keeping the non-reduced dims split (XLA's partial
  replication) would be finer; we choose the simpler, documented layout.
- **Maximal** shardings (``assign``) propagate only through elementwise and identity
  ops; any other op treats a maximal operand as "no information".
- **Regions.** Call-like ops (``jit``, ``pjit``, ``closed_call``/``eval_jaxpr``, ``custom_jvp_call``,
  ``custom_vjp_call``, ``checkpoint``/``remat``) whose region 0 takes the operands and
  returns the results are propagated through: the region is solved with its inputs
  seeded from the operands (forward) and its outputs from the results (backward), and
  region inputs/outputs propose back to operands/results. A ``scan`` is propagated
  through the same way, its scanned operands (``xs``) and stacked results (``ys``) with
  dim 0 (the steps', unsplit) taken off or put back: weights split inside a scan over
  layers, or a step run ``steps_per_call`` times, stay split at its inputs and outputs.
  A ``cond``'s branches are each propagated through the same way (they take the operands
  after the index; where branches disagree, the first branch's proposal wins). A
  ``while`` is propagated through its body: the body takes the body constants and the
  carry (seeded from the operands, a carry with no sharding of its own from the
  result's) and gives the carry, which proposes to the results; the condition takes the
  condition constants and the carry (its predicate proposes nothing). Every other op
  with regions is conservative: its results are ``{replicated}`` and its regions are
  solved with ``{replicated}`` inputs (annotations inside still act).
- **Conflicts.** When different shardings reach one value, the winner is chosen by, in
  order: (1) an annotation always wins; (2) forward beats backward; (3) the sharding that
  splits the value over more devices (then over more dims) wins; (4) the proposal of the
  op first in program order wins. Within one op, operand proposals that fit together
  (e.g. a batch split from one matmul operand and a column split from the other) are
  merged first when a tile order of TF's form (``np.arange(K).reshape(...)``) satisfies
  both; a replicated operand imposes nothing on an elementwise op. A losing proposal that
  merely coarsens the kept sharding (splits a subset of its dims the same way, as a
  projection through a reduction or slice does) is not a conflict. Each resolved conflict
  is recorded on the op that defines the value as
  ``sharding_conflict='{kept} vs {lost}: kept forward'`` (graph/region inputs: on their
  first user, prefixed ``input %N:``; multi-result ops: prefixed ``%N:``; several joined
  by ``; ``). :func:`sharding_conflicts` lists them with source locations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ir import _jax_compat as jc
from ir.graph import Graph, Op, Opaque, RegionMemo, Value
from ir.printer import value_names
from ir.types import Sharding

from compiler.errors import ShardingError

REPLICATED = Sharding.replicated()
CONFLICT_ATTR = "sharding_conflict"

# proposal strengths (higher wins)
BACKWARD, FORWARD, ANNOTATION = 1, 2, 3
_STRENGTH_NAME = {BACKWARD: "backward", FORWARD: "forward", ANNOTATION: "annotation"}

# A candidate list per value: None = no information.
Cands = list[Sharding] | None


# ---------------------------------------------------------------------------------------
# Tile-assignment arrays: a tiled or replicated sharding of a rank-r value over K devices
# is an int array of shape (t_0, ..., t_{r-1}, rep): the devices of each tile, the last
# axis listing the devices that hold the same tile (sorted: their order is immaterial).
# ---------------------------------------------------------------------------------------

def _arr(s: Sharding, rank: int, k: int) -> np.ndarray | None:
    if s.kind == "replicated":
        return np.arange(k).reshape([1] * rank + [k])
    if s.kind == "maximal":
        return None
    a = np.asarray(s.devices, dtype=np.int64).reshape(s.tile_dims)
    if not s.last_tile_dim_replicate:
        a = a[..., None]
    if a.ndim - 1 != rank:
        return None
    return a


def _from_arr(a: np.ndarray) -> Sharding:
    a = np.sort(a, axis=-1)
    data = tuple(int(t) for t in a.shape[:-1])
    if all(t == 1 for t in data):
        return REPLICATED
    devs = tuple(int(d) for d in a.reshape(-1))
    if a.shape[-1] == 1:
        return Sharding("tiled", data, devs)
    return Sharding("tiled", data + (int(a.shape[-1]),), devs, last_tile_dim_replicate=True)


def canonical(s: Sharding, rank: int, k: int) -> Sharding:
    """``s`` in normal form: replicate groups sorted, all-ones tilings ``{replicated}``."""
    a = _arr(s, rank, k)
    return s if a is None else _from_arr(a)


def _project(a: np.ndarray, mapping: dict[int, int], out_rank: int) -> np.ndarray:
    """Out dim ``j`` takes the tiles of in dim ``mapping[j]``; every other in dim's tiles
    join the replicate axis; out dims not in ``mapping`` are unsplit."""
    in_rank = a.ndim - 1
    src = [mapping[j] for j in sorted(mapping)]
    others = [i for i in range(in_rank) if i not in src]
    t = a.transpose(src + others + [in_rank]).reshape([a.shape[i] for i in src] + [-1])
    shape = [a.shape[mapping[j]] if j in mapping else 1 for j in range(out_rank)]
    return t.reshape(shape + [t.shape[-1]])


def _split_dims(a: np.ndarray) -> list[int]:
    return [i for i, t in enumerate(a.shape[:-1]) if t > 1]


def _merge(parts: list[np.ndarray], k: int) -> np.ndarray | None:
    """One array that agrees with every part on the dims the part splits, or None."""
    nontrivial = [p for p in parts if _split_dims(p)]
    if not nontrivial:
        return parts[0] if parts else None
    if len(nontrivial) == 1:
        return nontrivial[0]
    rank = nontrivial[0].ndim - 1
    tiles = [1] * rank
    for p in nontrivial:
        for d in _split_dims(p):
            if tiles[d] not in (1, p.shape[d]):
                return None
            tiles[d] = p.shape[d]
    n = math.prod(tiles)
    if k % n:
        return None
    cand = np.arange(k).reshape(tiles + [k // n])
    for p in nontrivial:
        proj = _project(cand, {d: d for d in _split_dims(p)}, rank)
        if not np.array_equal(np.sort(proj, -1), np.sort(p, -1)):
            return None
    return cand


def _splitness(s: Sharding) -> tuple[int, int]:
    if s.kind != "tiled":
        return (1, 0)
    data = s.tile_dims[:-1] if s.last_tile_dim_replicate else s.tile_dims
    return (math.prod(data), sum(1 for t in data if t > 1))


# ---------------------------------------------------------------------------------------
# Per-op rules. forward(op, ins, k) -> per result candidates; backward(op, ins, outs, k)
# -> per operand candidates. ``ins``/``outs`` hold the current sharding or None.
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """Sharding propagation for one op kind (forward: results from operands; backward:
    operands from results and the other operands)."""

    forward: Callable[[Op, list, int], list[Cands]]
    backward: Callable[[Op, list, list, int], list[Cands]]


def _shape(v: Value) -> tuple:
    return v.type.shape


def _tiled_arr(s: Sharding | None, v: Value, k: int) -> np.ndarray | None:
    return None if s is None else _arr(s, v.type.rank, k)


def _dedupe(cands: list[Sharding]) -> Cands:
    out: list[Sharding] = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out or None


def _combine(parts: list[np.ndarray], maximals: list[Sharding], known: bool, k: int) -> Cands:
    """Candidates from operand parts: merged tiles, or each part and maximal separately."""
    if not known:
        return None
    tiled = [p for p in parts if _split_dims(p)]
    if not tiled and maximals:
        return _dedupe(maximals)
    if not tiled:
        return [REPLICATED]
    merged = _merge(tiled, k)
    cands = [_from_arr(merged)] if merged is not None else [_from_arr(p) for p in tiled]
    return _dedupe(cands + maximals)


def _same_dims(a: tuple, b: tuple) -> dict[int, int]:
    return {j: j for j, (x, y) in enumerate(zip(a, b)) if x == y}


def _elementwise_fwd(op: Op, ins: list, k: int) -> list[Cands]:
    out = []
    for r in op.results:
        parts, maximals, known = [], [], False
        for v, s in zip(op.operands, ins):
            if s is None:
                continue
            known = True
            if s.kind == "maximal":
                maximals.append(s)
                continue
            a = _tiled_arr(s, v, k)
            if a is not None and v.type.rank == r.type.rank:
                parts.append(_project(a, _same_dims(_shape(v), _shape(r)), r.type.rank))
        out.append(_combine(parts, maximals, known, k))
    return out


def _elementwise_bwd(op: Op, ins: list, outs: list, k: int) -> list[Cands]:
    r, s = op.results[0], outs[0]
    res: list[Cands] = []
    for v in op.operands:
        if s is None:
            res.append(None)
        elif s.kind == "maximal":
            res.append([s])
        elif v.type.rank != r.type.rank or (v.type.rank == 0 and r.type.rank != 0):
            res.append(None)
        else:
            a = _arr(s, r.type.rank, k)
            res.append([_from_arr(_project(a, _same_dims(_shape(r), _shape(v)), v.type.rank))])
    return res


def _identity_fwd(op: Op, ins: list, k: int) -> list[Cands]:
    return [None if s is None else [s] for s in ins[:len(op.results)]] + \
        [None] * max(0, len(op.results) - len(ins))


def _identity_bwd(op: Op, ins: list, outs: list, k: int) -> list[Cands]:
    return [None if s is None else [s] for s in outs[:len(op.operands)]] + \
        [None] * max(0, len(op.operands) - len(outs))


def _mapped_rule(mapping_fn: Callable[[Op], dict[int, int] | None]) -> Rule:
    """A one-operand op whose result dim j is operand dim ``mapping[j]`` (other result
    dims unsplit, other operand dims' splits dropped to replication). Extra operands
    (dynamic sizes, indices) get no proposal."""

    def fwd(op: Op, ins: list, k: int) -> list[Cands]:
        m = mapping_fn(op)
        a = _tiled_arr(ins[0], op.operands[0], k)
        if m is None or a is None:
            return [None] * len(op.results)
        return [[_from_arr(_project(a, m, op.results[0].type.rank))]]

    def bwd(op: Op, ins: list, outs: list, k: int) -> list[Cands]:
        m = mapping_fn(op)
        rest: list[Cands] = [None] * (len(op.operands) - 1)
        a = _tiled_arr(outs[0], op.results[0], k)
        if m is None or a is None:
            return [None] + rest
        inv = {i: j for j, i in m.items()}
        return [[_from_arr(_project(a, inv, op.operands[0].type.rank))]] + rest

    return Rule(fwd, bwd)


def _broadcast_map(op: Op) -> dict[int, int] | None:
    bd = op.attr("broadcast_dimensions")
    if bd is None:
        return None
    x, r = _shape(op.operands[0]), _shape(op.results[0])
    return {j: i for i, j in enumerate(bd) if x[i] == r[j]}


def _transpose_map(op: Op) -> dict[int, int] | None:
    perm = op.attr("permutation")
    return None if perm is None else {j: p for j, p in enumerate(perm)}


def _squeeze_map(op: Op) -> dict[int, int] | None:
    dims = op.attr("dimensions")
    if dims is None:
        return None
    rank = op.operands[0].type.rank
    dims = {d % rank for d in dims}
    kept = [i for i in range(rank) if i not in dims]
    return {j: i for j, i in enumerate(kept)}


def _unsliced(op: Op, sizes: tuple | None) -> dict[int, int] | None:
    """Dims a slice takes whole (a split of a sliced dim is not kept)."""
    x = _shape(op.operands[0])
    if sizes is None:
        return None
    return {d: d for d in range(len(x)) if sizes[d] == x[d]}


def _slice_map(op: Op) -> dict[int, int] | None:
    start, limit, strides = (op.attr("start_indices"), op.attr("limit_indices"),
                             op.attr("strides"))
    x = _shape(op.operands[0])
    if start is None or limit is None:
        return None
    return {d: d for d in range(len(x))
            if start[d] == 0 and limit[d] == x[d] and (strides is None or strides[d] == 1)}


def _reduce_fwd(op: Op, ins: list, k: int) -> list[Cands]:
    axes = op.attr("axes")
    a = _tiled_arr(ins[0], op.operands[0], k)
    if axes is None or a is None:
        return [None] * len(op.results)
    rank = op.operands[0].type.rank
    axes = {d % rank for d in axes}
    if any(a.shape[d] > 1 for d in axes):  # partial results on each device
        return [[REPLICATED] for _ in op.results]
    kept = [i for i in range(rank) if i not in axes]
    s = _from_arr(_project(a, {j: i for j, i in enumerate(kept)}, len(kept)))
    return [[s] for _ in op.results]


def _reduce_bwd(op: Op, ins: list, outs: list, k: int) -> list[Cands]:
    axes = op.attr("axes")
    a = _tiled_arr(outs[0], op.results[0], k)
    if axes is None or a is None:
        return [None] * len(op.operands)
    rank = op.operands[0].type.rank
    kept = [i for i in range(rank) if i not in {d % rank for d in axes}]
    return [[_from_arr(_project(a, {i: j for j, i in enumerate(kept)}, rank))]] + \
        [None] * (len(op.operands) - 1)


def _reshape_groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]] | None:
    """Contiguous dim groups with equal element counts, or None (dynamic / size 0)."""
    if not all(isinstance(d, int) and d > 0 for d in a + b):
        return None
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        ga, gb, pa, pb = [], [], 1, 1
        if i < len(a):
            ga.append(i); pa *= a[i]; i += 1  # noqa: E702
        if j < len(b):
            gb.append(j); pb *= b[j]; j += 1  # noqa: E702
        while pa != pb:
            if pa < pb and i < len(a):
                ga.append(i); pa *= a[i]; i += 1  # noqa: E702
            elif pb < pa and j < len(b):
                gb.append(j); pb *= b[j]; j += 1  # noqa: E702
            else:
                return None
        groups.append((ga, gb))
    return groups


def _reshape_arr(arr: np.ndarray, src: tuple, dst: tuple) -> np.ndarray | None:
    """Tiles of a reshape ``src -> dst``: in each group of dims the split of the group's
    major (first non-1) dim carries to the major dim of the other side when its tile
    count divides that dim; any other split is dropped to replication."""
    if src == dst:
        return arr
    groups = _reshape_groups(tuple(src), tuple(dst))
    if groups is None:
        return None
    keep: dict[int, int] = {}
    out_tiles = [1] * len(dst)
    for ga, gb in groups:
        major_a = next((d for d in ga if src[d] > 1), None)
        major_b = next((d for d in gb if dst[d] > 1), None)
        t = arr.shape[major_a] if major_a is not None else 1
        if t > 1 and major_b is not None and dst[major_b] % t == 0:
            keep[major_a] = major_a
            out_tiles[major_b] = t
    a = _project(arr, keep, len(src))
    return a.reshape(out_tiles + [a.shape[-1]])


def _reshape_fwd(op: Op, ins: list, k: int) -> list[Cands]:
    a = _tiled_arr(ins[0], op.operands[0], k)
    if a is None or op.attr("dimensions") is not None:
        return [None]
    out = _reshape_arr(a, _shape(op.operands[0]), _shape(op.results[0]))
    return [[REPLICATED if out is None else _from_arr(out)]]


def _reshape_bwd(op: Op, ins: list, outs: list, k: int) -> list[Cands]:
    a = _tiled_arr(outs[0], op.results[0], k)
    rest: list[Cands] = [None] * (len(op.operands) - 1)
    if a is None or op.attr("dimensions") is not None:
        return [None] + rest
    out = _reshape_arr(a, _shape(op.results[0]), _shape(op.operands[0]))
    return [[REPLICATED if out is None else _from_arr(out)]] + rest


def _dot_dims(op: Op):
    (lc, rc), (lb, rb) = op.attr("dimension_numbers")
    nl, nr = op.operands[0].type.rank, op.operands[1].type.rank
    lf = [d for d in range(nl) if d not in lc and d not in lb]
    rf = [d for d in range(nr) if d not in rc and d not in rb]
    return list(lc), list(rc), list(lb), list(rb), lf, rf


def _dot_fwd(op: Op, ins: list, k: int) -> list[Cands]:
    lc, rc, lb, rb, lf, rf = _dot_dims(op)
    la = _tiled_arr(ins[0], op.operands[0], k)
    ra = _tiled_arr(ins[1], op.operands[1], k)
    if la is None and ra is None:
        return [None]
    if (la is not None and any(la.shape[d] > 1 for d in lc)) or \
            (ra is not None and any(ra.shape[d] > 1 for d in rc)):
        return [[REPLICATED]]  # partial sums: an all-reduce makes the result replicated
    nb, rank = len(lb), op.results[0].type.rank
    parts = []
    if la is not None:
        m = {i: d for i, d in enumerate(lb)} | {nb + i: d for i, d in enumerate(lf)}
        parts.append(_project(la, m, rank))
    if ra is not None:
        m = {i: d for i, d in enumerate(rb)} | {nb + len(lf) + i: d for i, d in enumerate(rf)}
        parts.append(_project(ra, m, rank))
    return [_combine(parts, [], True, k)]


def _dot_bwd(op: Op, ins: list, outs: list, k: int) -> list[Cands]:
    lc, rc, lb, rb, lf, rf = _dot_dims(op)
    oa = _tiled_arr(outs[0], op.results[0], k)
    la = _tiled_arr(ins[0], op.operands[0], k)
    ra = _tiled_arr(ins[1], op.operands[1], k)
    nb = len(lb)
    res: list[Cands] = []
    for side in (0, 1):
        mine_c, mine_b, mine_f = (lc, lb, lf) if side == 0 else (rc, rb, rf)
        other_c, other_b = (rc, rb) if side == 0 else (lc, lb)
        other = ra if side == 0 else la
        f_off = nb if side == 0 else nb + len(lf)
        rank = op.operands[side].type.rank
        parts = []
        if oa is not None:
            m = {d: i for i, d in enumerate(mine_b)} | {d: f_off + i for i, d in enumerate(mine_f)}
            parts.append(_project(oa, m, rank))
        if other is not None:
            m = {d: o for d, o in zip(mine_c, other_c)} | {d: o for d, o in zip(mine_b, other_b)}
            parts.append(_project(other, m, rank))
        res.append(_combine(parts, [], bool(parts), k))
    return res + [None] * (len(op.operands) - 2)


def _concat_fwd(op: Op, ins: list, k: int) -> list[Cands]:
    dim, r = op.attr("dimension"), op.results[0]
    parts, known = [], False
    for v, s in zip(op.operands, ins):
        a = _tiled_arr(s, v, k)
        if a is not None:
            known = True
            parts.append(_project(a, {d: d for d in range(r.type.rank) if d != dim}, r.type.rank))
    return [_combine(parts, [], known, k)]


def _concat_bwd(op: Op, ins: list, outs: list, k: int) -> list[Cands]:
    dim, r = op.attr("dimension"), op.results[0]
    a = _tiled_arr(outs[0], r, k)
    if a is None:
        return [None] * len(op.operands)
    s = _from_arr(_project(a, {d: d for d in range(r.type.rank) if d != dim}, r.type.rank))
    return [[s] for _ in op.operands]


def _gather_map(op: Op) -> dict[int, int] | None:
    """Result offset dims <- operand dims taken whole (not collapsed, not indexed, not
    batched). Dimension numbers parsed from text are opaque: no mapping."""
    dn = op.attr("dimension_numbers")
    if isinstance(dn, Opaque):
        dn = dn.obj
    sizes = op.attr("slice_sizes")
    if dn is None or sizes is None or not hasattr(dn, "offset_dims"):
        return None
    x = _shape(op.operands[0])
    skip = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()))
    window = [d for d in range(len(x)) if d not in skip]
    if len(window) != len(dn.offset_dims):
        return None
    indexed = set(dn.start_index_map)
    return {o: d for o, d in zip(dn.offset_dims, window)
            if d not in indexed and sizes[d] == x[d]}


def _dynamic_slice_map(op: Op) -> dict[int, int] | None:
    return _unsliced(op, op.attr("slice_sizes"))


def _cumulative_map(op: Op) -> dict[int, int] | None:
    axis, rank = op.attr("axis"), op.operands[0].type.rank
    if axis is None:
        return None
    return {d: d for d in range(rank) if d != axis % max(rank, 1)}


def _pad_map(op: Op) -> dict[int, int] | None:
    cfg = op.attr("padding_config")
    if cfg is None:
        return None
    return {d: d for d, (lo, hi, interior) in enumerate(cfg) if lo == hi == interior == 0}


def _pad_rule() -> Rule:
    base = _mapped_rule(_pad_map)
    # the padding value (a scalar) gets no proposal
    return base


ELEMENTWISE = (
    "add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "and", "or", "xor",
    "neg", "exp", "log", "tanh", "logistic", "sqrt", "rsqrt", "abs", "sign", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "floor",
    "ceil", "round", "exp2", "log1p", "expm1", "erf", "erfc", "erf_inv", "not",
    "integer_pow", "square", "cbrt", "is_finite", "nextafter", "real", "imag", "conj",
    "add_any", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "shift_left",
    "shift_right_logical", "shift_right_arithmetic", "population_count", "lgamma", "digamma",
)
IDENTITY = ("convert_element_type", "cast_varying", "copy", "copy_p", "reduce_precision",
            "all_reduce", "optimization_barrier", "stop_gradient")
REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
              "reduce_or", "reduce_xor", "argmax", "argmin")

#: op name -> sharding rule; ops not listed propose nothing (their values end replicated)
RULES: dict[str, Rule] = {
    **{n: Rule(_elementwise_fwd, _elementwise_bwd) for n in ELEMENTWISE},
    **{n: Rule(_identity_fwd, _identity_bwd) for n in IDENTITY},
    **{n: Rule(_reduce_fwd, _reduce_bwd) for n in REDUCTIONS},
    "broadcast_in_dim": _mapped_rule(_broadcast_map),
    "transpose": _mapped_rule(_transpose_map),
    "squeeze": _mapped_rule(_squeeze_map),
    "reshape": Rule(_reshape_fwd, _reshape_bwd),
    "dot_general": Rule(_dot_fwd, _dot_bwd),
    "slice": _mapped_rule(_slice_map),
    "dynamic_slice": _mapped_rule(_dynamic_slice_map),
    "concatenate": Rule(_concat_fwd, _concat_bwd),
    "gather": _mapped_rule(_gather_map),
    "pad": _pad_rule(),
    **{n: _mapped_rule(_cumulative_map) for n in ("cumsum", "cumprod", "cummax", "cummin",
                                                  "cumlogsumexp")},
}

def _is_branching(op: Op) -> bool:
    """A ``cond`` whose every branch takes the operands after the branch index and
    gives the results (propagated through like calls, one solver per branch)."""
    return (op.name == "cond" and bool(op.regions) and bool(op.operands)
            and all(len(g.inputs) == len(op.operands) - 1 and len(g.outputs) == len(op.results)
                    for g in op.regions))


def _scan_split(op: Op) -> tuple[int, int] | None:
    """For a ``scan``: (the first scanned operand, the first stacked result): its
    region takes the constants, the carry and one step's slice of each scanned operand
    (``xs``), and gives the carry and one step's ``ys``. ``None`` for any other op."""
    if op.name != "scan":
        return None
    consts, carry = op.attr("num_consts"), op.attr("num_carry")
    if not isinstance(consts, int) or not isinstance(carry, int):
        return None
    return consts + carry, carry


def _while_parts(op: Op) -> tuple[int, int, int, int] | None:
    """For a ``while`` whose regions fit its operands (the condition takes its constants
    and the carry and gives one predicate; the body takes its constants and the carry and
    gives the carry): (condition constants, body constants, condition region index, body
    region index). ``None`` for any other op."""
    if op.name != "while" or len(op.regions) != 2:
        return None
    cn, bn = op.attr("cond_nconsts"), op.attr("body_nconsts")
    ci, bi = op.attr("cond_jaxpr"), op.attr("body_jaxpr")
    if not (isinstance(cn, int) and isinstance(bn, int) and hasattr(ci, "index")
            and hasattr(bi, "index") and {ci.index, bi.index} == {0, 1}):
        return None
    ncarry = len(op.operands) - cn - bn
    cond, body = op.regions[ci.index], op.regions[bi.index]
    if (ncarry != len(op.results) or len(cond.inputs) != cn + ncarry or len(cond.outputs) != 1
            or len(body.inputs) != bn + ncarry or len(body.outputs) != ncarry):
        return None
    return cn, bn, ci.index, bi.index


def _without_dim0(s: Sharding | None) -> Sharding | None:
    """The sharding of one step's slice of a scanned value of sharding ``s`` (dim 0 is
    the steps'): ``None`` (no information) when dim 0 is split."""
    if s is None or s.kind != "tiled":
        return s
    if s.tile_dims[0] != 1:
        return None
    return Sharding("tiled", s.tile_dims[1:], s.devices,
                    last_tile_dim_replicate=s.last_tile_dim_replicate)


def _with_dim0(s: Sharding) -> Sharding:
    """The sharding of a scanned value whose steps' slices have sharding ``s``."""
    if s.kind != "tiled":
        return s
    return Sharding("tiled", (1,) + tuple(s.tile_dims), s.devices,
                    last_tile_dim_replicate=s.last_tile_dim_replicate)


#: ops with regions that are propagated through (region 0 takes operands, gives results)
CALL_OPS = frozenset({"jit", "pjit", "custom_jvp_call", "custom_vjp_call",
                      "custom_vjp_call_jaxpr", "checkpoint", "remat", "remat2"}) | jc.CALL_PRIMITIVES


# ---------------------------------------------------------------------------------------
# The solver
# ---------------------------------------------------------------------------------------

def _implied(kept: Sharding, other: Sharding, rank: int, k: int) -> bool:
    """True when ``other`` only coarsens ``kept`` (splits a subset of its dims the same
    way), as a projection that could not see some dims does: that is no conflict."""
    a, b = _arr(kept, rank, k), _arr(other, rank, k)
    if a is None or b is None:
        return False
    dims = _split_dims(b)
    if any(a.shape[d] != b.shape[d] for d in dims):
        return False
    return np.array_equal(np.sort(_project(a, {d: d for d in dims}, rank), -1), np.sort(b, -1))


Key = tuple  # (strength, tiles, split dims, -op index, -sub index)


def _key(s: Sharding, strength: int, pos: tuple[int, int]) -> Key:
    return (strength, *_splitness(s), -pos[0], -pos[1])


class _Solver:
    """Propagation over one graph (a region is solved by its own solver)."""

    def __init__(self, graph: Graph, k: int, in_seeds: tuple, out_seeds: tuple,
                 memo: dict) -> None:
        self.graph, self.k, self.memo = graph, k, memo
        self.in_seeds, self.out_seeds = in_seeds, out_seeds
        self.state: dict[Value, tuple[Sharding, Key]] = {}
        self.run()

    def get(self, v: Value) -> Sharding | None:
        st = self.state.get(v)
        return st[0] if st else None

    def sub(self, op: Op, index: int, in_seeds: tuple, out_seeds: tuple) -> _Solver:
        key = (id(op), index, in_seeds, out_seeds)
        if key not in self.memo:
            self.memo[key] = _Solver(op.regions[index], self.k, in_seeds, out_seeds, self.memo)
        return self.memo[key]

    def region_solvers(self, op: Op) -> list[_Solver]:
        ins = tuple(self.get(v) for v in op.operands)
        outs = tuple(self.get(v) for v in op.results)
        if _is_branching(op):  # each branch takes the operands after the index
            return [self.sub(op, i, ins[1:], outs) for i in range(len(op.regions))]
        loop = _while_parts(op)
        if loop is not None:  # a carry without a sharding of its own takes the result's
            cn, bn, ci, bi = loop
            carry = tuple(o if i is None else i for i, o in zip(ins[cn + bn:], outs))
            solvers = [None, None]
            solvers[ci] = self.sub(op, ci, ins[:cn] + carry, ())
            solvers[bi] = self.sub(op, bi, ins[cn:cn + bn] + carry, outs)
            return solvers
        scan = _scan_split(op)
        solvers = []
        for i, g in enumerate(op.regions):
            if i == 0 and self.is_call(op):
                if scan is not None:  # the scanned operands and results lose their dim 0
                    ins = tuple(_without_dim0(x) if j >= scan[0] else x for j, x in enumerate(ins))
                    outs = tuple(_without_dim0(x) if j >= scan[1] else x for j, x in enumerate(outs))
                solvers.append(self.sub(op, i, ins, outs))
            else:
                solvers.append(self.sub(op, i, (REPLICATED,) * len(g.inputs), ()))
        return solvers

    def is_call(self, op: Op) -> bool:
        """Is region 0 of ``op`` propagated through: a call (its inputs the operands, its
        outputs the results), or a ``scan`` (``_scan_split``)?"""
        g = op.regions[0]
        return _is_branching(op) or _while_parts(op) is not None or (
            (op.name in CALL_OPS or _scan_split(op) is not None)
            and len(g.inputs) == len(op.operands) and len(g.outputs) == len(op.results))

    def proposals(self) -> Iterator[tuple[Value, Sharding, Key]]:
        """Every (value, sharding, key) proposed from the current state."""
        g = self.graph
        for i, (v, s) in enumerate(zip(g.inputs, self.in_seeds)):
            if s is not None:
                yield v, canonical(s, v.type.rank, self.k), _key(s, FORWARD, (-1, i))
        for idx, op in enumerate(g.ops):
            yield from self._op_props(idx, op, forward=True)
        for idx in range(len(g.ops) - 1, -1, -1):
            yield from self._op_props(idx, g.ops[idx], forward=False)
        for i, (v, s) in enumerate(zip(g.outputs, self.out_seeds)):
            if s is not None:
                yield v, s, _key(s, BACKWARD, (len(g.ops), i))

    def _op_props(self, idx: int, op: Op, forward: bool):
        k = self.k
        if op.name == "shard":
            s = op.attr("sharding")
            if forward:
                for r in op.results:
                    c = canonical(s, r.type.rank, k)
                    yield r, c, _key(c, ANNOTATION, (idx, 0))
            else:
                for v in op.operands:
                    c = canonical(s, v.type.rank, k)
                    yield v, c, _key(c, BACKWARD, (idx, 0))
            return
        if op.regions:
            if forward and not self.is_call(op):
                for r in op.results:
                    yield r, REPLICATED, _key(REPLICATED, FORWARD, (idx, 0))
                return
            if not self.is_call(op):
                return
            if _is_branching(op):  # every branch proposes (conflicts: the first branch's)
                for b, sol in enumerate(self.region_solvers(op)):
                    pairs = (zip(op.results, sol.graph.outputs) if forward
                             else zip(op.operands[1:], sol.graph.inputs))
                    for v, inner in pairs:
                        s = sol.get(inner)
                        if s is not None:
                            yield v, s, _key(s, FORWARD if forward else BACKWARD, (idx, b))
                return
            loop = _while_parts(op)
            if loop is not None:
                yield from self._while_props(idx, op, loop, forward)
                return
            sol = self.region_solvers(op)[0]
            scan = _scan_split(op)
            if forward:
                for j, (r, o) in enumerate(zip(op.results, sol.graph.outputs)):
                    s = sol.get(o)
                    if s is not None and scan is not None and j >= scan[1]:
                        s = _with_dim0(s)  # (a ``ys`` result: the steps stacked on dim 0)
                    if s is not None:
                        yield r, s, _key(s, FORWARD, (idx, 0))
            else:
                for j, (v, i) in enumerate(zip(op.operands, sol.graph.inputs)):
                    s = sol.get(i)
                    if s is not None and scan is not None and j >= scan[0]:
                        s = _with_dim0(s)  # (an ``xs`` operand: sliced on dim 0 per step)
                    if s is not None:
                        yield v, s, _key(s, BACKWARD, (idx, 0))
            return
        rule = RULES.get(op.name)
        if rule is None:
            return
        ins = [self.get(v) for v in op.operands]
        if forward:
            cands = rule.forward(op, ins, k)
            targets = op.results
            strength = FORWARD
        else:
            cands = rule.backward(op, ins, [self.get(r) for r in op.results], k)
            targets = op.operands
            strength = BACKWARD
        for v, cs in zip(targets, cands):
            for sub, s in enumerate(cs or ()):
                if s.kind == "maximal" and op.name not in ELEMENTWISE + IDENTITY:
                    continue
                yield v, s, _key(s, strength, (idx, sub))

    def _while_props(self, idx: int, op: Op, loop: tuple[int, int, int, int],
                     forward: bool) -> Iterator[tuple[Value, Sharding, Key]]:
        """A ``while``'s proposals (:func:`_while_parts`): forward, the body's carry out
        to the results; backward, the regions' inputs to the constants and the carry."""
        cn, bn, ci, bi = loop
        solvers = self.region_solvers(op)
        body, cond = solvers[bi], solvers[ci]
        if forward:
            pairs = [(v, body, o) for v, o in zip(op.results, body.graph.outputs)]
        else:
            pairs = [*[(v, cond, i) for v, i in zip(op.operands[:cn], cond.graph.inputs)],
                     *[(v, body, i) for v, i in zip(op.operands[cn:], body.graph.inputs)]]
        for v, sol, inner in pairs:
            s = sol.get(inner)
            if s is not None:
                yield v, s, _key(s, FORWARD if forward else BACKWARD, (idx, 0))

    def run(self) -> None:
        for _ in range(1000):  # keys only grow, so this ends; the bound is a guard
            changed = False
            for v, s, key in self.proposals():
                old = self.state.get(v)
                if old is None or key > old[1]:
                    if old is None or old[0] != s or old[1] != key:
                        self.state[v] = (s, key)
                        changed = True
            if not changed:
                return

    # -- results ---------------------------------------------------------------------

    def conflicts(self) -> dict[Value, list[str]]:
        lost: dict[Value, dict[Sharding, Key]] = {}
        for v, s, key in self.proposals():
            kept = self.state[v][0]
            if s != kept and not _implied(kept, s, v.type.rank, self.k):
                d = lost.setdefault(v, {})
                if s not in d or key > d[s]:
                    d[s] = key
        out: dict[Value, list[str]] = {}
        for v, d in lost.items():
            kept, wkey = self.state[v]
            texts = []
            for s, key in sorted(d.items(), key=lambda kv: kv[1], reverse=True):
                if wkey[0] > key[0]:
                    why = f"kept {_STRENGTH_NAME[wkey[0]]}"
                elif wkey[1:3] > key[1:3]:
                    why = f"kept {_STRENGTH_NAME[wkey[0]]}, the one splitting more"
                else:
                    why = f"kept {_STRENGTH_NAME[wkey[0]]}, the first in program order"
                texts.append(f"{kept} vs {s}: {why}")
            out[v] = texts
        return out

    def emit(self, names: dict[Value, str]) -> Graph:
        g = self.graph
        new: dict[Value, Value] = {}

        def retype(v: Value) -> Value:
            nv = Value(v.type.with_sharding(self.get(v) or REPLICATED))
            new[v] = nv
            return nv

        inputs = tuple(retype(v) for v in g.inputs)
        conflicts = self.conflicts()
        notes: dict[int, list[str]] = {}
        for i, v in enumerate(g.inputs):
            if v in conflicts:
                first = next((j for j, op in enumerate(g.ops) if v in op.operands), None)
                if first is not None:
                    notes.setdefault(first, []).extend(
                        f"input {names.get(v, '%?')}: {t}" for t in conflicts[v])
        for j, op in enumerate(g.ops):
            for r in op.results:
                if r in conflicts:
                    pre = f"{names.get(r, '%?')}: " if len(op.results) > 1 else ""
                    notes.setdefault(j, []).extend(pre + t for t in conflicts[r])
        ops = []
        for j, op in enumerate(g.ops):
            regions = tuple(s.emit(names) for s in self.region_solvers(op)) if op.regions else ()
            attrs = tuple((a, b) for a, b in op.attrs if a != CONFLICT_ATTR)
            if j in notes:
                attrs += ((CONFLICT_ATTR, "; ".join(notes[j])),)
            ops.append(op.replace(operands=tuple(new[v] for v in op.operands),
                                  results=tuple(retype(r) for r in op.results),
                                  attrs=attrs, regions=regions))
        return Graph(inputs, tuple(ops), tuple(new[v] for v in g.outputs), g.name)


# ---------------------------------------------------------------------------------------
# Validation, the pass, the conflict listing
# ---------------------------------------------------------------------------------------

def _where(op: Op) -> str:
    return f" ({op.loc})" if op.loc is not None else ""


def validate_annotation(op: Op, k: int) -> None:
    """Raise :class:`ShardingError` unless ``op`` (a ``shard``) fits K logical devices."""
    s = op.attr("sharding")
    ann = op.attr("annotation")
    head = f"shard (annotation {ann!r})" if ann else "shard"
    if not isinstance(s, Sharding):
        raise ShardingError(f"{head}: sharding attribute {s!r} is not a sharding{_where(op)}")
    if s.kind == "maximal":
        if not 0 <= s.device < k:
            raise ShardingError(f"{head}: sharding {s} names logical device {s.device}, "
                                f"outside [0, {k}) for a replica of {k} logical "
                                f"devices{_where(op)}")
        return
    if s.kind != "tiled":
        return
    bad = [d for d in s.devices if not 0 <= d < k]
    if bad:
        ids = ", ".join(map(str, bad))
        raise ShardingError(f"{head}: sharding {s} names logical device(s) {ids}, outside "
                            f"[0, {k}) for a replica of {k} logical devices{_where(op)}")
    if sorted(s.devices) != list(range(k)):
        raise ShardingError(f"{head}: sharding {s} lists {len(s.devices)} device ids "
                            f"{list(s.devices)} but must list each of the replica's {k} "
                            f"logical devices once{_where(op)}")
    rank = op.operands[0].type.rank if op.operands else 0
    n = len(s.tile_dims) - (1 if s.last_tile_dim_replicate else 0)
    if n != rank:
        extra = " (plus the last, replicated one)" if s.last_tile_dim_replicate else ""
        raise ShardingError(f"{head}: sharding {s} has {n} tile dimension(s){extra} but the "
                            f"operand has rank {rank}{_where(op)}")
    from compiler.errors import LoweringError
    from compiler.mesh import model_spec
    try:  # (the lowering's mapping onto the mesh axes, checked here with the user's line)
        model_spec(s, rank, k)
    except LoweringError as e:
        raise ShardingError(
            f"{head}: {e}: the logical devices form one mesh axis per prime factor of {k}, "
            f"smallest first, so a dimension split by a larger factor must come after one "
            f"split by a smaller (e.g. [2, 3], not [3, 2]; TF tiles any order){_where(op)}"
        ) from None


@dataclass(frozen=True)
class ShardingPass:
    """Validates ``shard`` annotations and gives every value a sharding over the
    replica's ``num_logical_devices`` logical devices (see the module docstring)."""

    name: str = "sharding"
    num_logical_devices: int = 1

    def __post_init__(self) -> None:
        if self.num_logical_devices < 1:
            raise ShardingError(f"num_logical_devices must be >= 1, got "
                                f"{self.num_logical_devices}")

    def apply(self, graph: Graph) -> Graph:
        k = self.num_logical_devices
        for op, _ in graph.walk():
            if op.name == "shard":
                validate_annotation(op, k)
            elif op.name == "cond" and k > 1:
                _check_branch_annotations(op, k)
        if k == 1:
            return _all_replicated(graph)
        names = value_names(graph)
        root = _Solver(graph, k, (None,) * len(graph.inputs), (), {})
        return root.emit(names)


def _check_branch_annotations(op: Op, k: int) -> None:
    """Raise :class:`ShardingError` when the branches of the ``cond`` ``op`` annotate
    the same result with different layouts (each branch ending in a ``shard``): XLA
    requires the roots of a conditional's branches to agree and fails with an internal
    error otherwise. Annotate the ``cond``'s result once, after it, instead."""
    for j in range(len(op.results)):
        seen: dict = {}
        for b, g in enumerate(op.regions):
            producers = g.producers()
            producer = producers.get(g.outputs[j]) if j < len(g.outputs) else None
            while producer is not None and producer.name == "cast_varying":
                producer = producers.get(producer.operands[0])  # (a cast: the value as is)
            if producer is not None and producer.name == "shard":
                seen.setdefault(canonical(producer.attr("sharding"), g.outputs[j].type.rank, k),
                                (b, producer))
        if len(seen) > 1:
            (s1, (b1, p1)), (s2, (b2, p2)) = list(seen.items())[:2]
            # (lax.cond's regions are [false, true]; a switch's are its branches in order)
            name = (lambda b: ("the false branch", "the true branch")[b]) \
                if len(op.regions) == 2 else (lambda b: f"branch {b}")
            raise ShardingError(
                f"cond{_where(op)}: {name(b1)} annotates result {j} as {s1}{_where(p1)} and "
                f"{name(b2)} as {s2}{_where(p2)}; a conditional's branches must give their "
                f"results one layout (XLA refuses otherwise): annotate the cond's result "
                f"once, after it")


def _all_replicated(graph: Graph, memo: RegionMemo | None = None) -> Graph:
    """``graph`` with every value typed replicated (K = 1); a shared region once, each
    type once (``memo.types``)."""
    memo = RegionMemo() if memo is None else memo
    types = memo.types
    new: dict[Value, Value] = {}

    def retype(v: Value) -> Value:
        t = v.type
        hit = types.get(id(t))
        if hit is None:
            hit = types[id(t)] = (t, t.with_sharding(REPLICATED))
        nv = new[v] = Value(hit[1])
        return nv

    inputs = tuple([retype(v) for v in graph.inputs])
    ops = []
    for op in graph.ops:
        regions = op.regions
        if regions:
            regions = tuple([memo.get(g, None, lambda g=g: _all_replicated(g, memo))
                             for g in regions])
        new_op = op.with_values(tuple([new[v] for v in op.operands]),
                                tuple([retype(r) for r in op.results]), regions)
        if op.attrs and any(a == CONFLICT_ATTR for a, _ in op.attrs):
            new_op = new_op.replace(attrs=tuple((a, b) for a, b in op.attrs if a != CONFLICT_ATTR))
        ops.append(new_op)
    return Graph(inputs, tuple(ops), tuple([new[v] for v in graph.outputs]), graph.name)


def sharding_conflicts(graph: Graph) -> list[str]:
    """Every conflict the ``sharding`` pass resolved in ``graph`` (regions included), one
    line each: ``model.py:14: dot_general %5: {kept} vs {lost}: kept forward``."""
    names = value_names(graph)
    out = []
    for op, _ in graph.walk():
        text = op.attr(CONFLICT_ATTR)
        if not text:
            continue
        where = str(op.loc) if op.loc is not None else "<unknown location>"
        res = ", ".join(names.get(r, "%?") for r in op.results)
        for part in text.split("; "):
            out.append(f"{where}: {op.name} {res}: {part}")
    return out


__all__ = ["ShardingPass", "ShardingError", "RULES", "CALL_OPS", "sharding_conflicts",
           "validate_annotation", "canonical"]
