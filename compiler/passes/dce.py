"""The ``dce`` pass: drop ops none of whose results is used.

Contract: the graph computes the same outputs; ops with side effects (``EFFECTFUL``), ops
with no results, and ops whose regions hold such an op (a ``jit`` or ``cond`` around a
``debug_callback``) are kept. Regions keep their signatures and are cleaned inside.
"""
from __future__ import annotations

from dataclasses import dataclass

from ir.graph import Graph, Op, RegionMemo, Value

EFFECTFUL = frozenset({"debug_callback", "io_callback", "debug_print", "callback",
                       "outside_call", "infeed", "outfeed",
                       # JAX's mutable-array (Ref) ops write state
                       "swap", "addupdate", "mutable_array", "ref_swap", "ref_addupdate"})


def has_effect(op: Op, memo: RegionMemo | None = None) -> bool:
    """Does ``op`` (or any op nested in its regions) have a side effect?"""
    if op.name in EFFECTFUL or not op.results:
        return True
    if not op.regions:
        return False
    memo = RegionMemo() if memo is None else memo
    return any(memo.get(region, "effect",
                        lambda region=region: any(has_effect(o, memo) for o in region.ops))
               for region in op.regions)


def dce(graph: Graph, memo: RegionMemo | None = None) -> Graph:
    """``graph`` without dead ops (a region several ops share is cleaned once)."""
    memo = RegionMemo() if memo is None else memo
    live: set[Value] = set(graph.outputs)
    kept = []
    for op in reversed(graph.ops):
        if any(r in live for r in op.results) or has_effect(op, memo):
            if op.regions:
                op = op.replace(regions=tuple(memo.get(g, "dce", lambda g=g: dce(g, memo))
                                              for g in op.regions))
            kept.append(op)
            live.update(op.operands)
    return graph.replace(ops=tuple(reversed(kept)))


@dataclass(frozen=True)
class DCEPass:
    """Removes dead ops (see module docstring)."""

    name: str = "dce"

    def apply(self, graph: Graph) -> Graph:
        return dce(graph)
