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
  only through linear ops (``LINEAR``, with every other operand mirrored and not derived
  from a collective) is taken out: the branch returns the replica's own addend and one
  ``all_reduce`` sum after the ``cond`` adds them up. By linearity Σ_r (taken_r ? a_r : 0)
  is the gradient of the global loss: replicas that skip the branch contribute zero, which
  is what the other branch returns there (a zero constant, or the same hoisted form).
- **Refused.** Any other collective inside per-replica control flow (a user's
  ``all_reduce`` in a forward branch, a collective in a ``while`` with a per-replica
  predicate, a collective used non-linearly) is a ``DivergentCollectiveError`` naming the op and the
  user's line. Never a hang or an abort.

The check alone is :func:`divergent_collectives`; lowering calls it too, so a pipeline
that leaves this pass out fails instead of hanging.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from compiler.errors import DivergentCollectiveError
from compiler.passes.cross_replica_sum import transposed
from compiler.passes.replication import annotate
from ir.graph import Graph, Op, Rewriter, Value
from ir.jaxpr_import import REPLICA_AXIS
from ir.types import Replica

#: ops that talk to other replicas (ours and JAX's own names) when over the replica axis
COLLECTIVES = frozenset({"all_reduce", "all_gather", "all_to_all", "ppermute", "reduce_scatter",
                         "psum_scatter", "pbroadcast", "all_gather_invariant", "ragged_all_to_all",
                         "pgather", "psum", "pmax", "pmin", "psum_invariant"})

#: ops linear in every operand that ``_linear_use`` allows to carry a collective's result
#: (with ``mul``/``div``/``dot_general``: linear in one operand, the other mirrored)
LINEAR = frozenset({"add_any", "add", "sub", "neg", "reshape", "transpose", "squeeze",
                    "expand_dims", "broadcast_in_dim", "reduce_sum", "convert_element_type",
                    "slice", "copy", "copy_p", "rev", "cumsum", "loss_scale", "concatenate",
                    "pad", "select_n", "dynamic_slice", "gather", "real", "imag", "conj"})
_ONE_SIDED = frozenset({"mul", "dot_general", "div"})
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "named_call"})


def is_collective(op: Op) -> bool:
    """Does ``op`` communicate across replicas?"""
    if op.name in ("all_reduce", "all_gather", "all_to_all"):
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


def divergent_collectives(graph: Graph) -> list[tuple[Op, Op]]:
    """Every (collective, enclosing control-flow op) where the collective runs inside
    control flow whose predicate or trip count differs between replicas."""
    found: list[tuple[Op, Op]] = []

    def visit(g: Graph, inside: Op | None) -> None:
        for op in g.ops:
            if inside is not None and is_collective(op):
                found.append((op, inside))
            divergent = _divergent_regions(op)
            for region in op.regions:
                visit(region, op if (region in divergent and inside is None) else inside)
    visit(graph, None)
    return found


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
        raise DivergentCollectiveError(
            f"{coll.name}{_where(coll)} runs inside a {kind} differs between replicas "
            f"({ctl.name}{_where(ctl)}): replicas that do not run it would never join the "
            f"collective (a hang or wrong numbers); {fix}"
            + (f" ({len(found) - 1} more such collective(s))" if len(found) > 1 else ""))


def _inline_calls(graph: Graph) -> Graph:
    """``graph`` with call-like ops (``jit``) inlined, so collectives inside them are
    seen by the linearity analysis."""
    if not any(op.name in _CALLS for op in graph.ops):
        return graph
    rw = Rewriter(graph)
    for op in graph.ops:
        if op.name in _CALLS and op.regions and len(op.regions[0].inputs) == len(op.operands):
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


def _is_zero(v: Value, producers: dict[Value, Op]) -> bool:
    op = producers.get(v)
    while op is not None and op.name in ("broadcast_in_dim", "convert_element_type", "reshape"):
        op = producers.get(op.operands[0])
    if op is None or op.name != "constant":
        return False
    val = np.asarray(op.attr("value"))
    return val.dtype != object and not np.any(val)


def _derived(branch: Graph) -> tuple[set[Value], list[Op], str | None]:
    """Values of ``branch`` derived linearly from its all_reduce sums/means, those
    all-reduces, and why hoisting is impossible (``None`` when it is possible)."""
    producers = branch.producers()
    derived: set[Value] = set()
    reduces: list[Op] = []
    for op in branch.ops:
        reads = [v in derived for v in op.operands]
        if op.regions and any(
                is_collective(o) for region in op.regions for o, _ in region.walk()):
            return derived, reduces, f"{op.name}{_where(op)} holds a collective in a region"
        if is_collective(op):
            if op.name != "all_reduce" or op.attr("reduce") not in ("sum", "mean") or any(reads):
                return derived, reduces, f"{op.name}{_where(op)} is not a linear all-reduce"
            reduces.append(op)
            derived.update(op.results)
            continue
        if not any(reads):
            continue
        others = [v for v, d in zip(op.operands, reads) if not d]
        if op.name in _ONE_SIDED:
            ok = (sum(reads) == 1 and not _varying(others[0])
                  and (op.name != "div" or reads[0]))
        elif op.name in ("add_any", "add", "sub", "concatenate"):
            ok = all(_is_zero(v, producers) for v in others)
        elif op.name == "select_n":
            ok = not reads[0] and not _varying(op.operands[0]) and \
                all(_is_zero(v, producers) for v in others[1:])
        elif op.name in ("pad", "dynamic_slice", "gather"):
            ok = reads[0] and all(not _varying(v) for v in others) and \
                (op.name != "pad" or _is_zero(op.operands[1], producers))
        else:
            ok = op.name in LINEAR and all(not _varying(v) for v in others)
        if not ok:
            return derived, reduces, (f"{op.name}{_where(op)} uses the result of a collective "
                                      f"in a way that is not linear")
        derived.update(op.results)
    return derived, reduces, None


@dataclass(frozen=True)
class HoistCollectivesPass:
    """Takes gradient all-reduces out of per-replica branches, refuses any other
    collective in per-replica control flow (see module docstring)."""

    num_replicas: int = 1
    name: str = "hoist-collectives"

    def apply(self, graph: Graph) -> Graph:
        in_reps = [v.type.replica or Replica.VARYING for v in graph.inputs]
        new, changed = self._rewrite(graph, False)
        if changed:
            new = annotate(new, in_reps)[0]
        check_no_divergent_collectives(new)
        return new

    def _rewrite(self, graph: Graph, enclosing: bool) -> tuple[Graph, bool]:
        rw = Rewriter(graph)
        changed = False
        for op in graph.ops:
            is_t = transposed(op, enclosing)
            if op.regions:
                regions = []
                for region in op.regions:
                    r, c = self._rewrite(region, is_t)
                    regions.append(r)
                    changed |= c
                op = op.replace(regions=tuple(regions))
            if op.name == "cond" and is_t and _varying(op.operands[0]):
                hoisted = self._hoist_cond(op)
                if hoisted is not None:
                    cond, positions = hoisted
                    rw.emit(cond)
                    for j in positions:
                        r = cond.results[j]
                        total = Value(r.type.with_replica(Replica.MIRRORED))
                        rw.add(Op("all_reduce", (r,), (total,),
                                  (("reduce", "sum"), ("axes", (REPLICA_AXIS,)),
                                   ("gradient", True)), op.loc))
                        rw.alias(op.results[j], total)
                    changed = True
                    continue
            rw.emit(op)
        return rw.finish(), changed

    def _hoist_cond(self, op: Op) -> tuple[Op, list[int]] | None:
        """The cond with its branches' all-reduces taken out, and the result positions to
        sum after it; ``None`` when no branch holds a collective (raises when one holds
        a collective that cannot be taken out: the final check names it)."""
        branches = [_inline_calls(g) for g in op.regions]
        if not any(is_collective(o) for g in branches for o, _ in g.walk()):
            return None
        analyses = [_derived(g) for g in branches]
        if any(why is not None for _, _, why in analyses):
            return None  # left in place: check_no_divergent_collectives reports it
        n_out = len(op.results)
        positions = sorted({j for g, (derived, _, _) in zip(branches, analyses)
                            for j in range(n_out) if g.outputs[j] in derived})
        for g, (derived, _, _) in zip(branches, analyses):
            producers = g.producers()
            for j in positions:
                v = g.outputs[j]
                if v not in derived and not _is_zero(v, producers):
                    return None
        new_branches = tuple(self._strip(g, reduces) for g, (_, reduces, _) in
                             zip(branches, analyses))
        results = tuple(Value(r.type.with_replica(Replica.VARYING)) if j in positions else r
                        for j, r in enumerate(op.results))
        return op.replace(regions=new_branches, results=results), positions

    def _strip(self, branch: Graph, reduces: list[Op]) -> Graph:
        """The branch with each all-reduce replaced by its operand (a mean by the operand
        divided by N): the replica's own addend."""
        from compiler.passes.cross_replica_sum import _scale_ops
        drop = {id(o) for o in reduces}
        rw = Rewriter(branch)
        for op in branch.ops:
            if id(op) not in drop:
                rw.emit(op)
                continue
            for x, r in zip(op.operands, op.results):
                if op.attr("reduce") == "sum" or self.num_replicas == 1:
                    rw.alias(r, rw.get(x))
                else:
                    part = Value(r.type.with_replica(Replica.VARYING))
                    for new in _scale_ops(rw.get(x), part, -1, self.num_replicas, op.loc):
                        rw.add(new)
                    rw.alias(r, part)
        return rw.finish()
