"""Gradient all-reduce bucketing (cross-replica-sum pass, ``bucket_bytes``)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt


def _params(rng):
    return {"w1": rng.normal(size=(6, 16)).astype(np.float32),
            "b1": np.zeros(16, np.float32),
            "w2": rng.normal(size=(16, 3)).astype(np.float32),
            "b2": np.zeros(3, np.float32)}


def _loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def _step(p, batch):
    x, y = batch
    loss, g = jax.value_and_grad(_loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


def _grad_reduces(graph):
    return [op for op, _ in graph.walk() if op.name == "all_reduce" and op.attr("gradient")]


@pytest.mark.parametrize("bucket_bytes,expect_max_ops", [(1 << 20, 1), (256, 3)])
def test_bucketing_merges_gradient_all_reduces_and_keeps_numbers(bucket_bytes, expect_max_ops):
    rng = np.random.default_rng(0)
    p = _params(rng)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    y = rng.normal(size=(32, 3)).astype(np.float32)
    batch = rt.distribute((x, y), 4)
    plain = rt.replicate(_step, num_replicas=4)
    bucketed = rt.replicate(_step, num_replicas=4, options=rt.RunOptions(bucket_bytes=bucket_bytes))

    before = _grad_reduces(plain.lower(p, batch).ir())
    after = _grad_reduces(bucketed.lower(p, batch).ir())
    assert len(before) >= 4  # one per parameter at least
    assert 1 <= len(after) <= expect_max_ops < len(before)
    # every gradient value is still reduced exactly once
    assert sum(len(op.operands) for op in after) == sum(len(op.operands) for op in before)
    assert any(len(op.operands) > 1 for op in after)
    for op in after:
        if len(op.operands) > 1:
            assert op.attr("bucket") == len(op.operands)
            assert sum(int(np.prod(v.type.shape)) * 4 for v in op.operands) <= bucket_bytes

    # the bucket's collective names the lines of all its members (before: the last's)
    lines = {(o.loc.file, o.loc.line) for o in before}
    sources = {s for c in bucketed.lower(p, batch).compile().collectives() for s in c.ir_sources}
    assert {(os.path.basename(f), n) for f, n in lines} <= {(f, n) for _, f, n in sources}

    want_p, want_l = plain(p, batch)
    got_p, got_l = bucketed(p, batch)
    for k in p:
        np.testing.assert_allclose(got_p[k], want_p[k], rtol=1e-6)
    np.testing.assert_allclose(rt.reduce("mean", got_l), rt.reduce("mean", want_l), rtol=1e-6)
    # and the numbers are those of one device on the global batch
    ref = jax.jit(lambda p: jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(_loss)(p, x, y)))(p)
    for k in p:
        np.testing.assert_allclose(got_p[k], ref[k], rtol=1e-5, atol=1e-6)


# -- the linear-time bucketing against the first (networkx) implementation ------------------
def _reference_bucket(graph, bucket_bytes):
    """The pass's first implementation (networkx ancestors per candidate, networkx's
    lexicographic topological sort), kept here as the oracle of the linear one's grouping
    and schedule (the merged op itself is built by the pass's own helper)."""
    import networkx as nx
    from compiler.passes.cross_replica_sum import _nbytes, merged_all_reduce
    nxg = graph.to_networkx()
    candidates = [i for i, op in enumerate(graph.ops)
                  if op.name == "all_reduce" and op.attr("gradient")]
    groups, current, size, kind = [], [], 0, None
    for i in candidates:
        op = graph.ops[i]
        nbytes = sum(_nbytes(v) for v in op.operands)
        ancestors = {n[1] for n in nx.ancestors(nxg, ("op", i)) if n[0] == "op"}
        if not (current and kind == op.attr("reduce") and size + nbytes <= bucket_bytes
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
    ops = []
    for i, op in enumerate(graph.ops):
        if i in dropped:
            continue
        ops.append(merged_all_reduce([graph.ops[j] for j in merged_at[i]]) if i in merged_at
                   else op)
    dag = graph.replace(ops=tuple(ops)).to_networkx()
    sched = nx.lexicographical_topological_sort(dag, key=lambda n: (n[0] != "in", n[1]))
    return graph.replace(ops=tuple(dag.nodes[n]["op"] for n in sched if n[0] == "op"))


def _chained_step(p, batch):
    """Two gradients where the second reads the first's all-reduced result: their
    all-reduces must never share a bucket (that would be a cycle)."""
    x, y = batch
    g1 = jax.grad(_loss)(p, x, y)
    p1 = jax.tree.map(lambda a, b: a - 0.1 * b, p, g1)
    g2 = jax.grad(_loss)(p1, x * 2, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p1, g2)


def _layers_step(params, batch):
    x, y = batch
    def loss(ps):
        h = x
        for w, g in ps:
            h = jnp.tanh(h @ w) * g
        return jnp.mean((h[:, :3] - y) ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, grads)


@pytest.mark.parametrize("bucket_bytes", [1, 64, 256, 1000, 1 << 20])
@pytest.mark.parametrize("which", ["mlp", "chained", "layers"])
def test_linear_bucketing_matches_the_networkx_one(which, bucket_bytes):
    from compiler.passes.cross_replica_sum import CrossReplicaSumPass
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    y = rng.normal(size=(16, 3)).astype(np.float32)
    if which == "layers":
        p = [(rng.normal(size=(6, 6)).astype(np.float32), np.ones(6, np.float32)) for _ in range(5)]
        fn = _layers_step
    else:
        p, fn = _params(rng), (_step if which == "mlp" else _chained_step)
    batch = rt.distribute((x, y), 4)
    graph = rt.replicate(fn, num_replicas=4).lower(p, batch).ir(after="cross-replica-sum")
    assert len(_grad_reduces(graph)) >= 4
    got = CrossReplicaSumPass(num_replicas=4, bucket_bytes=bucket_bytes)._bucket(graph)
    assert str(got) == str(_reference_bucket(graph, bucket_bytes))
    # and the program runs to the unbucketed numbers
    plain = rt.replicate(fn, num_replicas=4)(p, batch)
    bucketed = rt.replicate(fn, num_replicas=4, options=rt.RunOptions(bucket_bytes=bucket_bytes))(p, batch)
    def arrays(tree):  # per-replica results as each replica's value
        leaves = jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, rt.PerReplica))
        return [np.asarray(a) for v in leaves
                for a in (v.values if isinstance(v, rt.PerReplica) else [v])]
    got_v, want_v = arrays(bucketed), arrays(plain)
    assert len(got_v) == len(want_v)
    for a, b in zip(got_v, want_v):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_chained_gradients_are_never_merged_into_one_bucket():
    rng = np.random.default_rng(4)
    p = _params(rng)
    batch = rt.distribute((rng.normal(size=(16, 6)).astype(np.float32),
                           rng.normal(size=(16, 3)).astype(np.float32)), 4)
    step = rt.replicate(_chained_step, num_replicas=4, options=rt.RunOptions(bucket_bytes=1 << 20))
    after = _grad_reduces(step.lower(p, batch).ir())
    assert len(after) == 2  # one bucket per gradient: the second depends on the first
    assert [op.attr("bucket") for op in after] == [4, 4]
