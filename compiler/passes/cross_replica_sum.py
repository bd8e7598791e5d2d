"""The ``cross-replica-sum`` pass: gradients of mirrored inputs are all-reduced across
replicas with TF's loss-reduction semantics.

How the gradient all-reduces get there: the step is traced per replica with JAX's
varying-type checks on, so where a mirrored value meets a per-replica one JAX inserts a
cast to varying (``cast_varying``), and ``jax.grad`` transposes that cast into a
cross-replica sum on the gradient of the mirrored value. Those sums sit in the backward
pass (their name stack reads ``transpose(...)``). Their sum over all of a mirrored
input's uses is that input's gradient summed over replicas: exactly one reduction.

Contract:
- every gradient all-reduce gets ``gradient=True``;
- ``loss_reduction="mean"`` (TF's default) makes every gradient of a mirrored value the
  gradient of (1/N)·Σ_r loss_r; ``"sum"`` the gradient of Σ_r loss_r (JAX's own result);
- a loss that the user already all-reduced inside the step (``rt.all_reduce(loss,
  "mean")``, identical on every replica) is not scaled again: its gradient is the
  gradient of that global loss, with either loss reduction;
- a user ``all_reduce(sum)`` of a mirrored value (a gradient reduced a second time sums N
  equal copies) gives a warning naming the source line;
- with ``bucket_bytes > 0``, independent gradient all-reduces of one kind are merged
  into variadic all-reduces of at most that many bytes (see ``_bucket``).

Why scaling each all-reduce is exact: ``jax.grad`` of a per-replica (varying) loss gives
∇Σ_r loss_r, of a mirrored loss ∇L. Along any path from the loss back to a mirrored
input, the cotangent crosses from varying to mirrored at a gradient all-reduce and back
to varying at a ``cast_varying`` made while transposing a user's all-reduce of the
forward pass (a synchronized batch-norm statistic, or the loss itself). A varying loss
crosses once more to mirrored than back, a mirrored loss equally often. So with "mean",
dividing at every gradient all-reduce by N (sum -> mean) and multiplying at every
transposed ``cast_varying`` by N scales every path by exactly 1/N for a varying loss and
by 1 for a mirrored one, however the paths mix before a reduction. (Deciding per
all-reduce whether "the" cotangent came through a user reduction cannot be right when
paths through the user's reduction and around it are summed before one all-reduce.)
Ops inside the regions of a transposed op (the body of a transposed ``scan``, the
backward of a ``jax.checkpoint``) count as transposed too, their own name stacks starting
afresh; the forward pass a checkpoint recomputes there (``rematted_computation``) does not.

Gradients of gradients (Hessian-vector products, MAML): every op records how many
transpositions made it (``transpose(`` in its name stack). Gradient all-reduces at any
depth become means: each is the gradient of a mean loss. A ``cast_varying`` at depth 2 is
the transpose of a first-order gradient all-reduce, which is already a mean in the
program being differentiated, so it is not scaled; only depth-1 casts (transposes of the
user's forward all-reduces) are.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import networkx as nx
import numpy as np

from compiler.errors import PassError
from ir import _jax_compat as jc
from ir.graph import Graph, Loc, Op, Value
from ir.types import Replica, TensorType


# JAX's name for the forward pass that a transposed ``jax.checkpoint`` recomputes inside
# its backward region (jax/_src/ad_checkpoint.py): not transposed, though it sits there.
_REMAT_FORWARD = "rematted_computation"


def _transpose_depth(op: Op, enclosing: int) -> int:
    """How many transpositions made ``op``: 0 for the forward pass, 1 for the backward pass
    of ``jax.grad``, 2 for the backward pass of a gradient of a gradient. Ops in a
    transposed op's regions have name stacks that start afresh, so ``enclosing`` (the
    enclosing op's depth) is added, except for the forward pass a checkpoint recomputes."""
    stack = op.loc.name_stack if op.loc is not None else ""
    if _REMAT_FORWARD in stack:
        return max(0, enclosing - 1) + stack.split(_REMAT_FORWARD, 1)[1].count("transpose(")
    return enclosing + stack.count("transpose(")


def _is_gradient_reduce(op: Op, depth: int) -> bool:
    return op.name == "all_reduce" and op.attr("reduce") == "sum" and depth > 0


@functools.cache
def _mul_primitive() -> tuple[Any, tuple[tuple[str, Any], ...]]:
    """JAX's multiply primitive and the parameters it is bound with (they change between
    JAX versions, so they are read off a trace instead of written here)."""
    return jc.traced_primitive(lambda a, b: a * b, np.float32(1), np.float32(1))


def _is_inexact(v: Value) -> bool:
    try:
        return bool(jax.numpy.issubdtype(jc.dtype_from_name(v.type.dtype), jax.numpy.inexact))
    except (TypeError, AttributeError):
        return False


def _scale_ops(result: Value, factor: int, loc: Loc | None) -> tuple[Value, list[Op]]:
    """Ops computing ``result = fresh * factor``; returns ``fresh`` (to be produced in
    place of ``result``) and the ops (a scalar constant and a multiply)."""
    fresh = Value(result.type)
    dtype = jc.dtype_from_name(result.type.dtype)
    c = Value(TensorType((), result.type.dtype, Replica.MIRRORED))
    prim, params = _mul_primitive()
    return fresh, [Op("constant", (), (c,), (("value", np.asarray(factor, dtype)),)),
                   Op(prim.name, (fresh, c), (result,), params, loc, impl=prim)]


def _nbytes(v: Value) -> int:
    n = 1
    for d in v.type.shape:
        n *= d if isinstance(d, int) else 1
    try:
        return n * np.dtype(v.type.dtype).itemsize
    except TypeError:
        return n * 4


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
        graph = self._rewrite(graph)
        if self.bucket_bytes > 0:
            graph = self._bucket(graph)
        return graph

    def _rewrite(self, graph: Graph, enclosing_depth: int = 0) -> Graph:
        ops: list[Op] = []
        mean = self.loss_reduction == "mean" and self.num_replicas > 1
        for op in graph.ops:
            depth = _transpose_depth(op, enclosing_depth)
            if op.regions:
                op = op.replace(regions=tuple(self._rewrite(g, depth) for g in op.regions))
            if _is_gradient_reduce(op, depth):
                op = op.with_attrs(reduce="mean" if mean else "sum", gradient=True)
            elif op.name == "cast_varying" and depth == 1 and mean:
                # the transpose of a user's all-reduce in the forward pass: undo one 1/N
                # (see the module docstring). At depth 2 a cast is the transpose of a
                # gradient all-reduce, already a mean: left as it is.
                results, scale = [], []
                for r in op.results:
                    if not _is_inexact(r):  # integer cotangents (float0) carry nothing
                        results.append(r)
                        continue
                    fresh, new_ops = _scale_ops(r, self.num_replicas, op.loc)
                    results.append(fresh)
                    scale.extend(new_ops)
                ops.append(op.replace(results=tuple(results)))
                ops.extend(scale)
                continue
            elif (op.name == "all_reduce" and op.attr("reduce") == "sum"
                  and all(v.type.replica is Replica.MIRRORED for v in op.operands)):
                where = f" ({op.loc})" if op.loc else ""
                warnings.warn(f"all-reduce of a value that is already identical on every "
                              f"replica{where}: a sum multiplies it by {self.num_replicas} (a "
                              f"mean leaves it unchanged); gradients of mirrored values are "
                              f"already all-reduced by replicate()", stacklevel=2)
            ops.append(op)
        return graph.replace(ops=tuple(ops))

    def _bucket(self, graph: Graph) -> Graph:
        """Merge independent gradient all-reduces (same reduce kind) into variadic ones.

        Greedy in program order: an all-reduce joins the open bucket when the sizes fit and
        none of the bucket's members is among its ancestors (merging those would make a
        cycle). The merged op takes the place of the bucket's last member and the graph is
        re-scheduled by a topological sort that keeps program order wherever it can, so
        readers of an earlier member's result move after the merged op."""
        nxg = graph.to_networkx()
        candidates = [i for i, op in enumerate(graph.ops)
                      if op.name == "all_reduce" and op.attr("gradient")]
        groups: list[list[int]] = []
        current: list[int] = []
        size, kind = 0, None
        for i in candidates:
            op = graph.ops[i]
            nbytes = sum(_nbytes(v) for v in op.operands)
            ancestors = {n[1] for n in nx.ancestors(nxg, ("op", i)) if n[0] == "op"}
            if not (current and kind == op.attr("reduce") and size + nbytes <= self.bucket_bytes
                    and not ancestors.intersection(current)):
                if len(current) > 1:
                    groups.append(current)
                current, size, kind = [], 0, op.attr("reduce")
            current.append(i)
            size += nbytes
        if len(current) > 1:
            groups.append(current)
        if not groups:
            return graph
        merged_at = {g[-1]: g for g in groups}
        dropped = {j for g in groups for j in g[:-1]}
        ops: list[Op] = []
        for i, op in enumerate(graph.ops):
            if i in dropped:
                continue
            if i in merged_at:
                members = [graph.ops[j] for j in merged_at[i]]
                op = Op("all_reduce", tuple(v for m in members for v in m.operands),
                        tuple(r for m in members for r in m.results),
                        (("reduce", op.attr("reduce")), ("axes", op.attr("axes")),
                         ("gradient", True), ("bucket", len(members))), members[-1].loc)
            ops.append(op)
        dag = graph.replace(ops=tuple(ops)).to_networkx()
        sched = nx.lexicographical_topological_sort(dag, key=lambda n: (n[0] != "in", n[1]))
        return graph.replace(ops=tuple(dag.nodes[n]["op"] for n in sched if n[0] == "op"))
