"""Regions shared by several ops (``ir/graph.py``: ``RegionMemo``; ``ir/jaxpr_import.py``).

The importer gives every call of one jaxpr the same region object (a step that calls
``jnp.var`` in 32 layers holds one ``_var`` region), and each pass rewrites a shared
region once per context. What would make this silently wrong is a pass that reuses one
context's rewrite in another: a region typed for varying inputs reused where its inputs
are mirrored (the step's output then taken from replica 0 alone), or an all-reduce marked
as a gradient's where it is not. Oracles: the types and attributes each op's own copy
gets (hand-built graphs that share a region, against the same graph with copies), and
``jax.jit`` of the per-replica function for the numbers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import runtime as rt
from compiler.pass_manager import PassManager, parse_pipeline
from compiler.passes.cross_replica_sum import CrossReplicaSumPass
from compiler.passes.dce import DCEPass
from compiler.passes.replication import ReplicationPass
from ir.graph import Graph, RegionMemo
from ir.parser import parse
from ir.printer import print_graph
from ir.types import Replica
from tests.irtest import check_roundtrip

V, M = Replica.VARYING, Replica.MIRRORED


def _share(graph: Graph) -> Graph:
    """``graph`` with every op that has regions holding the first such op's regions."""
    ops = [op for op in graph.ops if op.regions]
    first = ops[0].regions
    return graph.replace(ops=tuple(op.replace(regions=first) if op.regions else op
                                   for op in graph.ops))


def _distinct_regions(graph: Graph) -> int:
    return len({id(g) for op, _ in graph.walk() for g in op.regions})


_TWO_CALLS = """func @main(%0: f32[4] mirrored, %1: f32[4] varying) {
  %2: f32[4] = jit(%1) {jaxpr=^0, name='f'}  # a.py:3
    ^0(%3: f32[4]):
      %4: f32[4] = tanh(%3)  # a.py:1
      return %4
  %5: f32[4] = jit(%0) {jaxpr=^0, name='f'}  # a.py:4
    ^0(%6: f32[4]):
      %7: f32[4] = tanh(%6)  # a.py:1
      return %7
  return %2, %5
}"""


def test_replication_types_a_shared_region_per_context():
    copies = parse(_TWO_CALLS)
    shared = _share(copies)
    assert _distinct_regions(shared) == 1
    check_roundtrip(shared)  # prints each use as its own region; parses back to copies
    assert print_graph(shared) == print_graph(copies)
    out = ReplicationPass().apply(shared)
    assert print_graph(out) == print_graph(ReplicationPass().apply(copies))
    a, b = out.ops
    assert [v.type.replica for v in a.regions[0].inputs + a.results] == [V, V]
    assert [v.type.replica for v in b.regions[0].inputs + b.results] == [M, M]
    assert [v.type.replica for v in out.outputs] == [V, M]


def test_replication_keeps_a_region_shared_in_one_context():
    text = _TWO_CALLS.replace("jit(%0)", "jit(%1)")
    out = ReplicationPass().apply(_share(parse(text)))
    assert _distinct_regions(out) == 1  # one rewrite, held by both ops
    assert [v.type.replica for v in out.outputs] == [V, V]


_GRADIENT_AND_NOT = """func @main(%0: f32[4] varying) {
  %1: f32[4] varying = jit(%0) {jaxpr=^0, name='f'}  # a.py:3 [transpose(jvp(loss))]
    ^0(%2: f32[4] varying):
      %3: f32[4] mirrored = all_reduce(%2) {reduce='sum', axes=('replica',)}  # a.py:1
      return %3
  %4: f32[4] varying = jit(%0) {jaxpr=^0, name='f'}  # a.py:4
    ^0(%5: f32[4] varying):
      %6: f32[4] mirrored = all_reduce(%5) {reduce='sum', axes=('replica',)}  # a.py:1
      return %6
  return %1, %4
}"""


def test_cross_replica_sum_marks_gradients_per_context():
    copies = parse(_GRADIENT_AND_NOT)
    shared = _share(copies)
    p = CrossReplicaSumPass(num_replicas=2)
    out = p.apply(shared)
    assert print_graph(out) == print_graph(p.apply(copies))
    # (the transposed call's sum is returned as it is: it moves out of the call)
    first, grad, second = out.ops
    assert grad.name == "all_reduce" and not first.regions[0].ops
    plain = second.regions[0].ops[0]
    assert grad.attr("gradient") is True
    assert plain.attr("gradient") is None
    assert _distinct_regions(out) == 2


_DEAD_AND_EFFECT = """func @main(%0: f32[4] varying) {
  %1: f32[4] varying = jit(%0) {jaxpr=^0, name='f'}  # a.py:3
    ^0(%2: f32[4] varying):
      %3: f32[4] varying = tanh(%2)  # a.py:1
      %4: f32[4] varying = exp(%2)  # a.py:1
      return %3
  %5: f32[4] varying = jit(%0) {jaxpr=^0, name='f'}  # a.py:4
    ^0(%6: f32[4] varying):
      %7: f32[4] varying = tanh(%6)  # a.py:1
      %8: f32[4] varying = exp(%6)  # a.py:1
      return %7
  return %5
}"""


def test_dce_cleans_a_shared_region_once_and_drops_a_dead_call():
    out = DCEPass().apply(_share(parse(_DEAD_AND_EFFECT)))
    assert len(out.ops) == 1  # the dead call is gone, the live one cleaned inside
    assert [op.name for op in out.ops[0].regions[0].ops] == ["tanh"]
    check_roundtrip(out)


def test_region_memo_is_per_region_and_context():
    a, b = parse(_TWO_CALLS).ops[0].regions[0], parse(_TWO_CALLS).ops[0].regions[0]
    memo, made = RegionMemo(), []

    def make(tag):
        made.append(tag)
        return tag

    assert memo.get(a, V, lambda: make("aV")) == "aV"
    assert memo.get(a, V, lambda: make("again")) == "aV"
    assert memo.get(a, M, lambda: make("aM")) == "aM"
    assert memo.get(b, V, lambda: make("bV")) == "bV"  # equal text, another region
    assert made == ["aV", "aM", "bV"]


# -- from a trace -------------------------------------------------------------------------
def _norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _layers(w, x):
    def loss(w):
        h = x
        for _ in range(4):  # jnp.var's ``_var`` (a jit), forward and backward, 4 times each
            h = jnp.tanh(_norm(h) @ w)
        return jnp.mean(h ** 2)
    return jax.value_and_grad(loss)(w)


def test_a_traced_step_imports_one_region_per_jaxpr_and_the_passes_keep_it_shared():
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(5, 5)) * 0.5).astype(np.float32)
    xs = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(2)]
    step = rt.replicate(_layers, num_replicas=2, options=rt.RunOptions(verify="each"))
    lowered = step.lower(w, rt.PerReplica(xs))
    calls = {name: [op for op, _ in lowered.ir(name).walk() if op.name in ("jit", "pjit")]
             for name in lowered.pass_names}
    n_calls = len(calls["import"])
    assert n_calls >= 8
    imported = len({id(op.regions[0]) for op in calls["import"]})
    assert imported < n_calls // 2  # the same jaxpr: the same region
    for name, ops in calls.items():
        assert len(ops) == n_calls, name
        assert len({id(op.regions[0]) for op in ops}) == imported, name
    # the numbers: each replica's loss and gradient as jax.jit computes them
    loss, grad = step(w, rt.PerReplica(xs))
    ref = [jax.jit(_layers)(w, x) for x in xs]
    for r in range(2):
        np.testing.assert_allclose(np.asarray(loss.values[r]), np.asarray(ref[r][0]),
                                   rtol=1e-5, atol=1e-6)
    # the gradient of a mirrored weight: the mean of the replicas' (loss_reduction="mean")
    np.testing.assert_allclose(np.asarray(grad), np.mean([np.asarray(g) for _, g in ref], 0),
                               rtol=1e-5, atol=1e-6)


def test_pipeline_on_a_shared_graph_equals_the_pipeline_on_copies():
    copies = parse(_TWO_CALLS)
    outs = []
    for g in (copies, _share(copies)):
        pm = PassManager(parse_pipeline("replication,cross-replica-sum,sharding,dce",
                                        num_replicas=2), verify="each")
        outs.append(print_graph(pm.run(g)))
    assert outs[0] == outs[1]


@jax.jit
def _skippable_block(h, u, gate):
    """Stochastic depth (tests/test_semantics.py's case) as one jitted block: the
    replicas whose gate is off skip it, so its weight's gradient all-reduce sits in a
    per-replica branch of the transposed block until hoist-collectives takes it out."""
    return jax.lax.cond(gate > 0, lambda h: h + jnp.tanh(h @ u), lambda h: h, h)


def _two_blocks(w, u, x):
    def loss(w, u):
        h = x @ w
        h = _skippable_block(h, u, x[0, 0])  # the same jaxpr twice: one shared region
        h = _skippable_block(h, u, x[0, 1])
        return jnp.mean(h ** 2)
    return jax.grad(loss, argnums=(0, 1))(w, u)


def test_gradient_hoisted_out_of_a_shared_block_matches_each_replica():
    rng = np.random.default_rng(5)
    w, u = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(2, 2)).astype(np.float32)
    xs = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(4)]
    for r, gates in enumerate([(1.0, 1.0), (1.0, -1.0), (-1.0, 1.0), (-1.0, -1.0)]):
        xs[r][0, :2] = gates  # every combination of the two blocks run or skipped
    step = rt.replicate(_two_blocks, num_replicas=4, options=rt.RunOptions(verify="each"))
    gw, gu = step(w, u, rt.PerReplica(xs))
    want = [jax.jit(_two_blocks)(w, u, x) for x in xs]  # each replica's own program
    np.testing.assert_allclose(gw, np.mean([g[0] for g in want], 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gu, np.mean([g[1] for g in want], 0), rtol=1e-5, atol=1e-6)
    # JAX traces each call's linearized block afresh, so share the equal ones by hand:
    # the pipeline must give the text it gives the copies (hoisting included)
    imported = step.lower(w, u, rt.PerReplica(xs)).ir("import")
    by_text: dict[str, tuple] = {}
    ops = []
    for op in imported.ops:
        if op.name in ("jit", "pjit"):
            op = op.replace(regions=by_text.setdefault(print_graph(op.regions[0]), op.regions))
        ops.append(op)
    shared = imported.replace(ops=tuple(ops))
    assert _distinct_regions(shared) < _distinct_regions(imported)
    texts = []
    for g in (imported, shared):
        pm = PassManager(parse_pipeline("replication,hoist-collectives,cross-replica-sum,"
                                        "sharding,dce", num_replicas=4), verify="each")
        out = pm.run(g)
        texts.append(print_graph(out))
        conds = [op for op, _ in out.walk() if op.name == "cond"]
        assert conds and all(o.name != "all_reduce" for c in conds for r in c.regions
                             for o, _ in r.walk())
    assert texts[0] == texts[1]


def test_every_printed_name_of_a_shared_region_is_found():
    """The text prints a shared region at each use, under new names each time; the
    sharding view finds a value by any name the text shows, and diagnostics name a
    value by its first definition."""
    from ir.printer import printed_names, value_names
    shared = ReplicationPass().apply(_share(parse(_TWO_CALLS.replace("jit(%0)", "jit(%1)"))))
    text = print_graph(shared)
    names = printed_names(shared)
    assert sorted(names, key=lambda n: int(n[1:])) == [f"%{i}" for i in range(8)]
    inner = shared.ops[0].regions[0].ops[0].result  # tanh's result, printed as %4 and %7
    assert "%4: f32[4] varying = tanh(%3)" in text and "%7: f32[4] varying = tanh(%6)" in text
    assert names["%4"] is inner and names["%7"] is inner
    assert value_names(shared)[inner] == "%4"
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(2)]
    w = rng.normal(size=(5, 5)).astype(np.float32)
    step = rt.replicate(_layers, num_replicas=2)
    lowered = step.lower(w, rt.PerReplica(xs))
    graph = lowered.ir()
    seen: dict[int, str] = {}
    for name, v in printed_names(graph).items():
        if id(v) in seen:  # a second printing of a shared value: found under this name too
            assert lowered.sharding_view(name).split("\n")[0] == f"{name}: {v.type}"
            break
        seen[id(v)] = name
    else:
        raise AssertionError("the step has no shared region")
