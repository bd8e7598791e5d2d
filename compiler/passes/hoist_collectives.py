"""The ``hoist-collectives`` pass: no collective runs inside control flow whose predicate
or trip count differs between replicas.

A cross-replica collective is a rendezvous of every replica. Inside a ``cond``/``switch``
whose index varies per replica, or a ``while`` whose predicate does, only some replicas
reach it: XLA then pairs unrelated collectives (wrong numbers) or waits for replicas that
never come (a hang, then an abort). JAX builds exactly that when it differentiates a
branch taken per replica (stochastic depth: ``lax.cond(keep_r, block, identity, h)``):
the transpose of the branch holds the gradient all-reduce of every mirrored value the
branch uses.

Contract, after ``replication`` (which sets every value's variance):

- **Hoisted, exactly.** In a ``cond`` made by transposition (a backward pass) with a
  per-replica index, an ``all_reduce`` sum or mean whose result reaches the branch outputs
  only through linear ops (``_Lifter._check_linear``, with every other operand mirrored
  and not derived from a collective) is taken out: the branch returns the replica's own
  addend and one ``all_reduce`` sum after the ``cond`` adds them up. By linearity Σ_r (taken_r ? a_r : 0)
  is the gradient of the global loss: replicas that skip the branch contribute zero, which
  is what the other branch returns there (a zero constant, or the same hoisted form).
- **Hoisted from backward loops, exactly.** In a ``scan`` made by transposition (the
  backward pass of an RNN, a scan over layers, ``jax.checkpoint`` ones included, a
  ``fori_loop``), every replica runs the same steps, so a collective in the body is
  legal, but the gradient of a mirrored weight then costs one all-reduce per step, and
  XLA:CPU's concurrent scheduler crashes on two such loops at once (README, "Porting
  from pmap"). Where the body's all-reduce sums reach the scan's outputs only linearly
  (as above) and are accumulated in carries that start at zero (how JAX transposes a
  scan's constants) or stacked in per-step outputs, the body keeps the replica's own
  addends and one ``all_reduce`` sum per such output follows the scan:
  Σ_t Σ_r g_{t,r} = Σ_r Σ_t g_{t,r}. Otherwise the collective stays in the loop, where
  every replica runs it equally often: correct, only slower.
- **Refused.** Any other collective inside per-replica control flow (a user's
  ``all_reduce`` in a forward branch, a collective in a ``while`` with a per-replica
  predicate, a collective used non-linearly) is a ``DivergentCollectiveError`` naming the op and the
  user's line. Never a hang or an abort.

The check alone is :func:`divergent_collectives`; lowering calls it too, so a pipeline
that leaves this pass out fails instead of hanging.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field

from compiler.errors import DivergentCollectiveError
from compiler.passes.cross_replica_sum import _linear_in, is_zero, transposed
from compiler.passes.replication import annotate
from ir.graph import Graph, Op, RegionMemo, Rewriter, Value
from ir.ops import COLLECTIVES, PLAIN_CALLS, REMAT_CALLS
from ir.jaxpr_import import REPLICA_AXIS
from ir.types import Replica


#: ops linear in their one operand that the lifting takes beyond the deferral's rules
#: (``cross_replica_sum._linear_in``): the loss-scale marker, a sharding annotation, the
#: parts of a complex value, any cast (a cotangent's dtype is the primal's)
_UNARY_HERE = frozenset({"loss_scale", "shard", "real", "imag", "conj", "convert_element_type"})
#: ops whose region only combines scalars (a scatter's update): checked as ops, not lifted
_COMBINED = frozenset({"scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul"})


def is_collective(op: Op) -> bool:
    """Does ``op`` communicate across replicas?"""
    if op.name in ("all_reduce", "all_gather", "all_gather_invariant", "all_to_all"):
        return True
    if op.name not in COLLECTIVES:
        return False
    axes = op.attr("axis_name", op.attr("axes"))
    axes = axes if isinstance(axes, (tuple, list)) else (axes,)
    return REPLICA_AXIS in axes


def _varying(v: Value) -> bool:
    return v.type.replica is not Replica.MIRRORED  # unknown counts as varying


def _divergent_regions(op: Op) -> list[Graph]:
    """The regions of ``op`` that some replicas may run and others not."""
    if op.name == "cond" and _varying(op.operands[0]):
        return list(op.regions)
    if op.name == "while":
        cond_i = op.attr("cond_jaxpr").index
        region = op.regions[cond_i]
        if any(_varying(v) for v in region.outputs):
            return list(op.regions)
    return []


def _where(op: Op) -> str:
    return f" ({op.loc})" if op.loc is not None else ""


def nested_collectives(graph: Graph, memo: dict[int, tuple] | None = None) -> bool:
    """Does any region of ``graph`` (at any depth) hold a collective? Without one, no
    collective runs inside control flow: nothing to hoist, nothing divergent. A region
    several ops share is looked at once (``memo``, by identity; entries keep it alive)."""
    memo = {} if memo is None else memo
    for op in graph.ops:
        for region in op.regions:
            hit = memo.get(id(region))
            if hit is None:
                hit = memo[id(region)] = (region, any(is_collective(o) for o in region.ops)
                                          or nested_collectives(region, memo))
            if hit[1]:
                return True
    return False


def divergent_collectives(graph: Graph) -> list[tuple[Op, Op]]:
    """Every (collective, enclosing control-flow op) where the collective runs inside
    control flow whose predicate or trip count differs between replicas."""
    found: list[tuple[Op, Op]] = []
    if nested_collectives(graph):  # (else none: a step without one is looked at once)
        _find_divergent(graph, None, found)
    return found


def _find_divergent(g: Graph, inside: Op | None, found: list[tuple[Op, Op]]) -> None:
    # module level: a nested recursive function is a cycle through its own cell
    for op in g.ops:
        if inside is not None and is_collective(op):
            found.append((op, inside))
        divergent = _divergent_regions(op)
        for region in op.regions:
            _find_divergent(region, op if (region in divergent and inside is None) else inside,
                            found)


def check_no_divergent_collectives(graph: Graph) -> None:
    """Raise ``DivergentCollectiveError`` naming the first collective inside per-replica
    control flow, and the control flow."""
    found = divergent_collectives(graph)
    if found:
        coll, ctl = found[0]
        if ctl.name == "cond":
            kind, fix = ("lax.cond/switch whose index", "compute it outside the cond, e.g. "
                         "all-reduce `jnp.where(pred, x, 0)` after it")
        else:
            kind, fix = ("while loop whose predicate", "move it out of the loop, or give "
                         "every replica the same trip count (a mirrored bound)")
        if coll.loc is not None and "transpose(" in coll.loc.name_stack:
            # JAX's differentiation made it: the all-reduce of a mirrored value's gradient
            where = "cond" if ctl.name == "cond" else "loop"
            fix = (f"it is the all-reduce of the gradient of a mirrored value (a weight) "
                   f"taken inside the {where}: take the gradient outside it (jax.grad of a "
                   f"function that runs the {where}, whose result then needs no collective "
                   f"inside), or differentiate with respect to rt.local(weights) if each "
                   f"replica's own gradient is meant")
        raise DivergentCollectiveError(
            f"{coll.name}{_where(coll)} runs inside a {kind} differs between replicas "
            f"({ctl.name}{_where(ctl)}): replicas that do not run it would never join the "
            f"collective (a hang or wrong numbers); {fix}"
            + (f" ({len(found) - 1} more such collective(s))" if len(found) > 1 else ""))


def _inline_calls(graph: Graph) -> Graph:
    """``graph`` with call-like ops (``jit``) inlined, so collectives inside them are
    seen by the linearity analysis."""
    if not any(op.name in PLAIN_CALLS for op in graph.ops):
        return graph
    rw = Rewriter(graph)
    for op in graph.ops:
        if op.name in PLAIN_CALLS and op.regions and len(op.regions[0].inputs) == len(op.operands):
            region = _inline_calls(op.regions[0])
            inner = Rewriter(region)
            for a, v in zip(region.inputs, op.operands):
                inner.alias(a, rw.get(v))
            for o in region.ops:
                rw.add(inner.emit(o))
            for r, out in zip(op.results, region.outputs):
                rw.alias(r, inner.get(out))
        else:
            rw.emit(op)
    return rw.finish()


def _collective_dependents(g: Graph) -> set[Value]:
    """The values of ``g`` computed from a collective's result in ``g`` (an op holding a
    collective in a region counts as one)."""
    tainted: set[Value] = set()
    for op in g.ops:
        if is_collective(op) or any(v in tainted for v in op.operands) or (
                op.regions and _has_collective(op)):
            tainted.update(op.results)
    return tainted


class _Refused(Exception):
    """A collective that cannot be taken out exactly (the message says which and why)."""


def _has_collective(op: Op) -> bool:
    return any(is_collective(o) for region in op.regions for o, _ in region.walk())


def _partial(v: Value) -> Value:
    return Value(v.type.with_replica(Replica.VARYING))


class _Lifter:
    """Takes every collective out of a transposed region, exactly (by linearity).

    A *partial* is a value that still owes an all-reduce: the replica's own addend of a
    sum. ``lift(region, partial_inputs)`` rewrites ``region`` without collectives: each
    ``all_reduce`` sum (mean: over N) becomes its operand, a partial; every op that reads
    a partial must be linear in it with coefficients identical on every replica (else
    ``_Refused``), and its result is a partial too. Regions are lifted recursively:
    ``scan`` (partials in the per-step outputs, or accumulated in a carry that starts
    at zero), ``cond`` (any index: a branch returns a partial or zero at each such
    output), ``jax.checkpoint`` (its region lifted, the op kept) and calls (inlined).
    The caller all-reduces the outputs that are partials:
    Σ_r of the replicas' addends is the sum the collectives computed, whichever branches
    or steps each replica ran."""

    def __init__(self, num_replicas: int, branch_coefficients: bool = False):
        self.n = num_replicas
        # the branches of a transposed per-replica cond (``HoistCollectivesPass``): a factor
        # after a gradient sum there may be typed per-replica (a residual the forward cond
        # returns, a zero where another branch computes it) though it is the same on every
        # replica that runs the branch: JAX puts the sum where the mirrored weight first
        # meets per-replica data, so what follows it in the backward pass is computed from
        # mirrored values. Σ_r A_b(r) ct_r is the gradient whichever branch b(r) each takes.
        # Not for the deferral (``cross_replica_sum``), where such a factor is real.
        self.branch_coefficients = branch_coefficients

    def lift(self, region: Graph, partial_inputs: set[int]) -> tuple[Graph, set[int]]:
        region = _inline_calls(region)
        producers = region.producers()
        uses = collections.Counter(v for o in region.ops for v in o.operands)
        uses.update(region.outputs)
        owing = {v for i, v in enumerate(region.inputs) if i in partial_inputs}
        rw = Rewriter(region, input_types=lambda v: _partial(v).type if v in owing else v.type)
        partial: set[Value] = {rw.get(v) for v in owing}
        for op in region.ops:
            ins = [rw.get(v) for v in op.operands]
            reads = [v in partial for v in ins]
            if is_collective(op):
                self._strip(op, ins, reads, rw, partial,
                            shared=[uses[v] > 1 for v in op.operands])
            elif op.regions and (_has_collective(op) or (any(reads) and op.name not in _COMBINED)):
                self._nested(op, ins, reads, rw, partial, producers)
            elif not any(reads):
                rw.emit(op)
            else:
                self._check_linear(op, reads, producers)
                new = rw.emit(op, result_types=tuple(r.type.with_replica(Replica.VARYING)
                                                     for r in op.results))
                partial.update(new.results)
        out = rw.finish()
        return out, {i for i, v in enumerate(out.outputs) if v in partial}

    def _strip(self, op: Op, ins: list[Value], reads: list[bool], rw: Rewriter,
               partial: set[Value], shared: list[bool]) -> None:
        """The all-reduce ``op`` taken out: its result becomes its operand, the replica's
        addend (a partial). An operand the region reads elsewhere too (the cotangent a
        transposed branch both sums for a mirrored weight and passes on for a per-replica
        input) gets a value of its own as the partial (``x / 1``, which XLA drops): marked
        partial itself, its other uses would have been summed over the replicas too."""
        if op.name != "all_reduce" or op.attr("reduce") not in ("sum", "mean"):
            raise _Refused(f"{op.name}{_where(op)} is not a linear all-reduce")
        if tuple(op.attr("axes", ())) != (REPLICA_AXIS,):
            # the sum put back after the region is over the replicas alone
            raise _Refused(f"{op.name}{_where(op)} also reduces over {op.attr('axes')}")
        if any(reads):
            raise _Refused(f"{op.name}{_where(op)} all-reduces a value that already owes one")
        from compiler.passes.cross_replica_sum import _scale_ops
        power = 0 if op.attr("reduce") == "sum" or self.n == 1 else -1  # (x / N: a mean)
        for x, r, more in zip(ins, op.results, shared):
            if power == 0 and not more:
                rw.alias(r, x)
                partial.add(x)
                continue
            part = _partial(r)
            for new in _scale_ops(x, part, power, self.n, op.loc):
                rw.add(new)
            rw.alias(r, part)
            partial.add(part)

    def _check_linear(self, op: Op, reads: list[bool], producers: dict[Value, Op]) -> None:
        """Raise ``_Refused`` unless ``op`` is linear in its operands that are partials
        (``reads``), with coefficients identical on every replica: the deferral's rules
        (``cross_replica_sum._linear_in``), plus the markers and element-wise maps it
        does not move sums through (``_UNARY_HERE``)."""
        if op.name in _UNARY_HERE:
            ok = len(op.operands) == 1
        else:
            same = (lambda v: True) if self.branch_coefficients else (lambda v: not _varying(v))
            ok = _linear_in(op, [i for i, r in enumerate(reads) if r], same,
                            lambda v: is_zero(v, producers))
        if not ok:
            raise _Refused(f"{op.name}{_where(op)} uses the result of a collective in a way "
                           f"that is not linear")

    def _nested(self, op: Op, ins: list[Value], reads: list[bool], rw: Rewriter,
                partial: set[Value], producers: dict[Value, Op]) -> None:
        if op.name == "scan":
            new, outs = self._scan(op, reads, producers)
        elif op.name == "cond":
            if reads[0]:
                raise _Refused(f"cond{_where(op)} branches on a value that owes an all-reduce")
            new, outs = self.cond(op, {i - 1 for i, r in enumerate(reads) if r and i > 0})
        elif op.name in REMAT_CALLS and len(op.regions) == 1 and \
                len(op.regions[0].inputs) == len(op.operands):
            region, outs = self.lift(op.regions[0], {i for i, r in enumerate(reads) if r})
            new = op.replace(regions=(region,))
        else:
            raise _Refused(f"{op.name}{_where(op)} holds a collective in a region")
        emitted = rw.emit(new, result_types=tuple(
            r.type.with_replica(Replica.VARYING) if j in outs else r.type
            for j, r in enumerate(new.results)))
        partial.update(emitted.results[j] for j in outs)

    def cond(self, op: Op, partial_operands: set[int]) -> tuple[Op, set[int]]:
        """``op`` (a cond) with its branches lifted; the result positions that are
        partials (each branch returns a partial or a zero there)."""
        lifted = [self.lift(g, partial_operands) for g in op.regions]
        positions = set().union(*(p for _, p in lifted))
        for g, p in lifted:
            prods = g.producers()
            for j in positions - p:
                if not is_zero(g.outputs[j], prods):
                    raise _Refused(f"cond{_where(op)}: a branch returns a value that is neither "
                                   f"the replica's addend nor zero where another returns an addend")
        return op.replace(regions=tuple(g for g, _ in lifted)), positions

    def scan(self, op: Op, producers: dict[Value, Op]) -> tuple[Op, set[int]]:
        """``op`` (a scan none of whose operands owes an all-reduce; ``producers``: of
        the graph it is in) with its body lifted; the result positions that are partials."""
        n_consts, n_carry = op.attr("num_consts"), op.attr("num_carry")
        if n_consts is None or n_carry is None:
            raise _Refused(f"scan{_where(op)} holds a collective and its carries are unknown")
        body = op.regions[op.attr("jaxpr").index]
        tainted = _collective_dependents(body)
        # the accumulators: carries that start at zero and take a collective's result (a
        # zero is every replica's addend of zero, so they start as partials)
        reads = [n_consts <= k < n_consts + n_carry and body.outputs[k - n_consts] in tainted
                 and is_zero(v, producers) for k, v in enumerate(op.operands)]
        return self._scan(op, reads, producers)

    def _scan(self, op: Op, reads: list[bool], producers: dict[Value, Op]) -> tuple[Op, set[int]]:
        n_consts, n_carry = op.attr("num_consts"), op.attr("num_carry")
        if n_consts is None or n_carry is None:
            raise _Refused(f"scan{_where(op)} holds a collective and its carries are unknown")
        body_i = op.attr("jaxpr").index
        body = op.regions[body_i]
        carry = {i for i in range(n_carry) if reads[n_consts + i]}
        fixed = {i for i in range(n_consts) if reads[i]}
        xs = {n_consts + n_carry + i for i in range(len(reads) - n_consts - n_carry)
              if reads[n_consts + n_carry + i]}
        # a carry the partials reach (a cotangent summed over the steps from zero, of a
        # weight the scan closes over or indexes) takes partials too: it must start at
        # zero, every replica's addend of zero (a carry the check below would refuse)
        reached = set(fixed) | {n_consts + i for i in carry} | xs
        while True:
            seen = {v for i, v in enumerate(body.inputs) if i in reached}
            for o in body.ops:
                if any(v in seen for v in o.operands):
                    seen.update(o.results)
            more = {n_consts + k for k in range(n_carry) if body.outputs[k] in seen and
                    is_zero(op.operands[n_consts + k], producers)} - reached
            if not more:
                break
            reached |= more
        carry |= {i - n_consts for i in reached if n_consts <= i < n_consts + n_carry}
        while True:
            new_body, outs = self.lift(body, fixed | {n_consts + i for i in carry} | xs)
            grown = {i for i in range(n_carry) if i in outs} - carry
            for i in grown:  # a carry that becomes an addend must start as one (or zero)
                if not is_zero(op.operands[n_consts + i], producers):
                    raise _Refused(f"scan{_where(op)} accumulates a collective's result in a "
                                   f"carry that does not start at zero")
            if not grown:
                break
            carry |= grown
        prods = new_body.producers()
        for i in carry - outs:
            if not is_zero(new_body.outputs[i], prods):
                raise _Refused(f"scan{_where(op)} overwrites a carry that holds a collective's "
                               f"result")
        regions = list(op.regions)
        regions[body_i] = new_body
        return op.replace(regions=tuple(regions)), carry | {j for j in outs if j >= n_carry}


@dataclass(frozen=True)
class HoistCollectivesPass:
    """Takes gradient all-reduces out of per-replica branches, refuses any other
    collective in per-replica control flow (see module docstring)."""

    num_replicas: int = 1
    name: str = "hoist-collectives"
    _why: list = field(default_factory=list, compare=False, repr=False)

    def apply(self, graph: Graph) -> Graph:
        if not nested_collectives(graph):
            return graph  # no collective inside control flow: the graph is as it must be
        in_reps = [v.type.replica or Replica.VARYING for v in graph.inputs]
        self._why.clear()
        new, changed = self._rewrite(graph, False, RegionMemo())
        if changed:
            new = annotate(new, in_reps)[0]
        try:
            check_no_divergent_collectives(new)
        except DivergentCollectiveError as e:
            if not self._why:
                raise
            raise DivergentCollectiveError(f"{e}; the gradient's all-reduce could not be "
                                           f"taken out of the branch: {self._why[0]}") from None
        return new

    def _rewrite(self, graph: Graph, enclosing: bool,
                 memo: RegionMemo) -> tuple[Graph, bool]:
        """``graph`` with the conds and scans it can hoist hoisted, and whether anything
        changed; a region several ops share is rewritten once per ``enclosing``."""
        rw = Rewriter(graph)
        changed = False
        producers = functools.cache(graph.producers)  # for the scans' zero carries, once
        for op in graph.ops:
            is_t = transposed(op, enclosing)
            if op.regions:
                regions = []
                for region in op.regions:
                    r, c = memo.get(region, is_t,
                                    lambda g=region: self._rewrite(g, is_t, memo))
                    regions.append(r)
                    changed |= c
                op = op.replace(regions=tuple(regions))
            hoisted = None
            if op.name == "cond" and is_t and _varying(op.operands[0]):
                hoisted = self._hoist(op, lambda lifter: lifter.cond(op, set()), True, True)
            elif op.name == "scan" and is_t:
                hoisted = self._hoist(op, lambda lifter: lifter.scan(op, producers()), False)
            if hoisted is not None:
                new_op, positions = hoisted
                rw.emit(new_op)
                for j in positions:
                    r = new_op.results[j]
                    total = Value(r.type.with_replica(Replica.MIRRORED))
                    rw.add(Op("all_reduce", (r,), (total,),
                              (("reduce", "sum"), ("axes", (REPLICA_AXIS,)),
                               ("gradient", True)), op.loc))
                    rw.alias(op.results[j], total)
                changed = True
                continue
            rw.emit(op)
        return rw.finish(), changed

    def _hoist(self, op: Op, lift, required: bool,
               branch_coefficients: bool = False) -> tuple[Op, list[int]] | None:
        """``op`` (a cond or a scan) with every collective of its regions taken out (see
        ``_Lifter``), and the result positions to sum after it; ``None`` when no region
        holds a collective or one cannot be taken out. ``required``: the collective may
        not stay (a per-replica cond: the final check then names it, with the reason kept
        here); a scan's collective that cannot be taken out stays in the loop, where every
        replica runs it equally often."""
        if not _has_collective(op):
            return None
        try:
            new, positions = lift(_Lifter(self.num_replicas, branch_coefficients))
        except _Refused as e:
            if required:
                self._why.append(str(e))
            return None
        results = tuple(Value(r.type.with_replica(Replica.VARYING)) if j in positions else r
                        for j, r in enumerate(new.results))
        return new.replace(results=results), sorted(positions)
