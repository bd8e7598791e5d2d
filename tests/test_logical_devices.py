"""Model parallelism inside a replica: annotations, validation, lowering (issue 3).

Oracle: the same step, unannotated, through plain ``jax.jit`` on one device on the global
batch (mean loss over replicas = mean over the global batch, shards being equal)."""
from __future__ import annotations

import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt

# (N replicas, K logical devices) with N*K <= 8
COMBOS = [(n, k) for n in (1, 2, 4) for k in (2, 4, 8) if n * k <= 8]


def _sgd(loss):
    def step(p, *batch):
        l, g = jax.value_and_grad(loss)(p, *batch)
        return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), l
    return step


def _annotated_mlp_loss(k):
    def loss(p, x):
        w1 = rt.split_to_logical_devices(p["w1"], [1, k])      # column split
        h = jax.nn.gelu(x @ w1)
        h = rt.split_to_logical_devices(h, [1, k])
        w2 = rt.split_to_logical_devices(p["w2"], [k, 1])      # row split
        return jnp.mean((h @ w2) ** 2)
    return loss


def _plain_mlp_loss(p, x):
    return jnp.mean((jax.nn.gelu(x @ p["w1"]) @ p["w2"]) ** 2)


def _oracle(loss, p, x, n, steps):
    """SGD on one device: mean over replicas of per-replica losses."""
    def global_loss(p):
        return jnp.mean(jnp.stack([loss(p, s) for s in jnp.split(x, n)]))
    step = jax.jit(lambda p: jax.tree.map(lambda a, b: a - 0.05 * b, p, jax.grad(global_loss)(p)))
    for _ in range(steps):
        p = step(p)
    return p


@pytest.mark.parametrize("n,k", COMBOS)
def test_megatron_mlp_matches_single_device(n, k):
    rng = np.random.default_rng(n * 10 + k)
    p = {"w1": rng.normal(size=(8, 16)).astype(np.float32) * 0.5,
         "w2": rng.normal(size=(16, 8)).astype(np.float32) * 0.5}
    x = rng.normal(size=(4 * n, 8)).astype(np.float32)
    step = rt.replicate(_sgd(_annotated_mlp_loss(k)), num_replicas=n, logical_devices=k)
    got = p
    for _ in range(3):
        got, _ = step(got, rt.distribute(x, n))
    want = _oracle(_plain_mlp_loss, p, x, n, 3)
    for name in p:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert step.cache_info().misses == 1


def test_megatron_hlo_holds_weight_shards_and_ir_shows_annotations():
    k = 4
    rng = np.random.default_rng(0)
    p = {"w1": rng.normal(size=(8, 16)).astype(np.float32),
         "w2": rng.normal(size=(16, 8)).astype(np.float32)}
    x = rng.normal(size=(8, 8)).astype(np.float32)
    step = rt.replicate(_sgd(_annotated_mlp_loss(k)), num_replicas=2, logical_devices=k)
    lowered = step.lower(p, rt.distribute(x, 2))
    text = str(lowered.ir())
    line = inspect.getsource(_annotated_mlp_loss).split("\n")
    first = inspect.getsourcelines(_annotated_mlp_loss)[1]
    w1_line = first + next(i for i, s in enumerate(line) if 'p["w1"], [1, k]' in s)
    assert re.search(r"shard\(%0\) \{sharding=\{devices=\[1,4\]0,1,2,3\}, annotation='split'\}"
                     rf"  # test_logical_devices.py:{w1_line} ", text), text
    assert "{devices=[4,1]0,1,2,3}" in text
    hlo = lowered.compile().as_text()
    # per device: x block [4,8] @ w1 column shard [8,16/4] -> [4,4]
    assert re.search(r"f32\[4,4\]\{1,0\} dot\(", hlo), hlo
    # the row-split second matmul needs a sum over the 4 logical devices of each replica
    # (read through hlo_report: XLA spells the groups explicitly, as iota or as mesh axes)
    from compiler.hlo_report import collectives
    assert any(c.kind == "all-reduce" and c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
               for c in collectives(hlo)), hlo


def _conv_loss(annotate):
    def loss(p, x):
        if annotate:
            x = rt.split_to_logical_devices(x, [1, 2, 4, 1])
        y = jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        if annotate:
            y = rt.split_to_logical_devices(y, [1, 2, 4, 1])
        return jnp.mean(jnp.tanh(y) ** 2)
    return loss


def test_conv_split_over_eight_logical_devices_matches_single_device():
    rng = np.random.default_rng(1)
    p = {"k": rng.normal(size=(3, 3, 2, 4)).astype(np.float32) * 0.3}
    x = rng.normal(size=(2, 8, 16, 2)).astype(np.float32)
    step = rt.replicate(_sgd(_conv_loss(True)), num_replicas=1, logical_devices=8)
    got, _ = step(p, rt.distribute(x, 1))
    want = _oracle(_conv_loss(False), p, x, 1, 1)
    np.testing.assert_allclose(got["k"], want["k"], rtol=1e-5, atol=1e-6)
    hlo = step.lower(p, rt.distribute(x, 1)).compile().as_text()
    # each device holds a [2, 8/2, 16/4, 2] block of the images
    assert "f32[2,4,4,2]" in hlo


@pytest.mark.parametrize("n,k", [(1, 2), (2, 4)])
def test_assign_to_logical_device_matches_and_warns(n, k):
    def loss(p, x):
        h = rt.assign_to_logical_device(x @ p["w"], k - 1)
        return jnp.mean(h ** 2)

    rng = np.random.default_rng(2)
    p = {"w": rng.normal(size=(4, 3)).astype(np.float32)}
    x = rng.normal(size=(2 * n, 4)).astype(np.float32)
    step = rt.replicate(_sgd(loss), num_replicas=n, logical_devices=k)
    with pytest.warns(UserWarning, match=rf"assign_to_logical_device\(\.\.\., {k - 1}\).*replicated "
                                         rf"over the replica's {k} logical devices"):
        got, _ = step(p, rt.distribute(x, n))
    want = _oracle(lambda p, x: jnp.mean((x @ p["w"]) ** 2), p, x, n, 1)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)
    assert f"{{maximal device={k - 1}}}" in str(step.lower(p, rt.distribute(x, n)).ir())


def test_partial_tiling_replicates_over_the_rest():
    def loss(p, x):
        w = rt.split_to_logical_devices(p["w"], [1, 2], partial=True)  # 2 tiles on 4 devices
        return jnp.mean((x @ w) ** 2)

    rng = np.random.default_rng(3)
    p = {"w": rng.normal(size=(4, 6)).astype(np.float32)}
    x = rng.normal(size=(4, 4)).astype(np.float32)
    step = rt.replicate(_sgd(loss), num_replicas=2, logical_devices=4)
    got, _ = step(p, rt.distribute(x, 2))
    want = _oracle(lambda p, x: jnp.mean((x @ p["w"]) ** 2), p, x, 2, 1)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5, atol=1e-6)
    assert "{devices=[1,2,2]0,1,2,3 last_tile_dim_replicate}" in str(step.lower(p, rt.distribute(x, 2)).ir())


# -- validation: ValueError naming the numbers and the user's source line ---------------

def _run_annotated(annotate, k=4, shape=(4, 6)):
    def fn(x):
        return annotate(x)
    step = rt.replicate(fn, num_replicas=1, logical_devices=k)
    step(np.ones(shape, np.float32))


def _line_of(fn, needle):
    src, first = inspect.getsourcelines(fn)
    return first + next(i for i, s in enumerate(src) if needle in s)


def test_partition_dims_length_differs_from_rank():
    def bad(x):
        return rt.split_to_logical_devices(x, [1, 2, 2])  # rank 2, three dims
    with pytest.raises(ValueError, match=rf"partition_dimensions \[1, 2, 2\] has length 3 but the "
                                         rf"tensor has rank 2 \(test_logical_devices.py:{_line_of(bad, '[1, 2, 2]')}\)"):
        _run_annotated(bad)


def test_dim_not_divisible_by_its_split():
    def bad(x):
        return rt.split_to_logical_devices(x, [1, 4])  # 6 % 4 != 0
    with pytest.raises(ValueError, match=r"dimension 1 of size 6 is not divisible by its split 4 .*"
                                         rf"test_logical_devices.py:{_line_of(bad, '[1, 4]')}"):
        _run_annotated(bad)


def test_product_differs_from_logical_devices():
    def bad(x):
        return rt.split_to_logical_devices(x, [2, 3])  # 6 tiles, 4 devices
    with pytest.raises(ValueError, match=r"product of partition_dimensions \[2, 3\] is 6 but the "
                                         r"replica has 4 logical devices"):
        _run_annotated(bad)


def test_partial_product_must_divide_logical_devices():
    def bad(x):
        return rt.split_to_logical_devices(x, [3, 1], partial=True)
    with pytest.raises(ValueError, match=r"is 3, which does not divide the replica's 4 logical"):
        _run_annotated(bad, shape=(6, 4))


@pytest.mark.parametrize("device", [4, -1, 7])
def test_device_id_outside_range(device):
    def bad(x):
        return rt.assign_to_logical_device(x, device)
    with pytest.raises(ValueError, match=rf"logical device {device} is outside \[0, 4\) .*"
                                         rf"test_logical_devices.py:{_line_of(bad, 'assign_to')}"):
        _run_annotated(bad)


def test_too_many_devices_names_both_numbers():
    with pytest.raises(ValueError, match=r"4 replicas × 4 logical devices need 16 devices but only 8"):
        rt.replicate(lambda x: x, num_replicas=4, logical_devices=4)


def test_explicit_device_assignment_orders_the_mesh():
    devs = np.asarray(jax.devices()[:8])[::-1].reshape(2, 4)   # replica 0 on devices 7..4
    step = rt.replicate(lambda x: x * 2.0 + rt.replica_id(), num_replicas=2, logical_devices=4,
                        devices=devs)
    out = step(rt.PerReplica([np.ones(3, np.float32), np.ones(3, np.float32)]))
    assert out.values[0].devices() == {devs[0, 0]}
    np.testing.assert_allclose(out.values[1], 3.0)
    with pytest.raises(ValueError, match=r"2 replicas × 4 logical devices need 8 devices but only 6"):
        rt.replicate(lambda x: x, num_replicas=2, logical_devices=4, devices=devs.flat[:6])


def test_annotation_outside_a_step_is_a_clear_error():
    with pytest.raises(RuntimeError, match="inside a function run by replicate"):
        rt.split_to_logical_devices(jnp.ones((2, 2)), [1, 1])


# -- what XLA did --------------------------------------------------------------------

def test_collectives_match_the_hlo_and_name_the_users_lines():
    k = 4
    rng = np.random.default_rng(5)
    p = {"w1": rng.normal(size=(8, 16)).astype(np.float32),
         "w2": rng.normal(size=(16, 8)).astype(np.float32)}
    x = rng.normal(size=(8, 8)).astype(np.float32)
    step = rt.replicate(_sgd(_annotated_mlp_loss(k)), num_replicas=2, logical_devices=k)
    compiled = step.lower(p, rt.distribute(x, 2)).compile()
    hlo = compiled.as_text()
    found = compiled.collectives()
    in_text = re.findall(r"= \(?[^=]*?\)? ?(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(", hlo)
    assert len(found) == len(in_text) > 0
    assert sorted(c.kind for c in found) == sorted(in_text)
    # within a replica: groups of the 4 logical devices; across replicas: pairs
    groups = {c.replica_groups for c in found}
    assert ((0, 1, 2, 3), (4, 5, 6, 7)) in groups
    assert ((0, 4), (1, 5), (2, 6), (3, 7)) in groups
    src, first = inspect.getsourcelines(_annotated_mlp_loss)
    w2_line = first + next(i for i, s in enumerate(src) if "(h @ w2)" in s)
    lines = {(f, ln) for c in found for _, f, ln in c.ir_sources}
    assert ("test_logical_devices.py", w2_line) in lines   # the row-split matmul's all-reduce
    for c in found:
        assert c.bytes > 0 and c.ir_sources, c
    table = compiled.collectives_table()
    assert f"test_logical_devices.py:{w2_line}" in table


def test_sharding_view_from_the_stages_api():
    k = 4
    p = {"w1": np.ones((8, 16), np.float32), "w2": np.ones((16, 8), np.float32)}
    x = np.ones((8, 8), np.float32)
    lowered = rt.replicate(_sgd(_annotated_mlp_loss(k)), num_replicas=2,
                           logical_devices=k).lower(p, rt.distribute(x, 2))
    view = lowered.sharding_view("%0")      # w1: split by columns over 4 devices
    assert view.splitlines()[0].startswith("%0: f32[8,16] mirrored {devices=[1,4]0,1,2,3}")
    for d in range(4):
        assert f"dev {d} [0:8, {4 * d}:{4 * d + 4}]" in view
    with pytest.raises(KeyError, match="no value named '%999'"):
        lowered.sharding_view("%999")


def test_transformer_block_example_matches_single_device(monkeypatch):
    import types

    from examples import transformer_block as tb

    rng = np.random.default_rng(0)
    params = tb.init(rng)
    x = rng.normal(size=(tb.REPLICAS * tb.BATCH, tb.SEQ, tb.D)).astype(np.float32)
    y = np.tanh(x[..., ::-1]).astype(np.float32)
    step = rt.replicate(tb.train_step, num_replicas=tb.REPLICAS, logical_devices=tb.K)
    got, _ = step(params, rt.distribute((x, y), tb.REPLICAS))
    # oracle: the same block, annotations as identities, jax.jit on one device
    monkeypatch.setattr(tb, "rt", types.SimpleNamespace(split_to_logical_devices=lambda w, d: w))

    def global_loss(p):
        return jnp.mean(jnp.stack([tb.loss(p, xs, ys) for xs, ys in
                                   zip(jnp.split(x, tb.REPLICAS), jnp.split(y, tb.REPLICAS))]))
    want = jax.jit(lambda p: jax.tree.map(lambda a, b: a - 0.05 * b, p, jax.grad(global_loss)(p)))(params)
    for name in params:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_split_inside_a_traced_call_is_kept():
    """Calling a ``jax.jit(g).trace(...)`` object binds JAX's generic call primitive
    (``eval_jaxpr`` on jax 0.11, inlined on 0.10): the sharding pass propagates through
    it, so the split inside is not silently replicated, and the SGD step matches
    ``jax.jit`` on one device."""
    rng = np.random.default_rng(7)
    p = {"w": rng.normal(size=(8, 4)).astype(np.float32) * 0.5}
    x = rng.normal(size=(8, 8)).astype(np.float32)
    def loss(p, x):
        split = jax.jit(lambda w: rt.split_to_logical_devices(jnp.tanh(w), [2, 1]))
        return jnp.mean((x @ split.trace(jax.ShapeDtypeStruct((8, 4), jnp.float32))(p["w"])) ** 2)

    step = rt.replicate(_sgd(loss), num_replicas=2, logical_devices=2)
    text = str(step.lower(p, rt.distribute(x, 2)).ir(after="sharding"))
    # the row split of the call's result reaches the step's inputs: the weight by rows,
    # and x, which contracts with it, by columns
    assert text.startswith("func @step(%0: f32[8,4] mirrored {devices=[2,1]0,1}, "
                           "%1: f32[4,8] varying {devices=[1,2]0,1})"), text
    if jax.__version__ >= "0.11.1":  # (0.10 inlines the call while tracing)
        assert "= eval_jaxpr(%0)" in text, text
    got, _ = step(p, rt.distribute(x, 2))
    plain = lambda p, x: jnp.mean((x @ jnp.tanh(p["w"])) ** 2)  # noqa: E731
    np.testing.assert_allclose(got["w"], _oracle(plain, p, x, 2, 1)["w"], rtol=1e-5, atol=1e-6)


def test_splits_propagate_through_while_loops_to_the_steps_boundary():
    """A weight split before a ``lax.while_loop`` whose trip count is a run-time value
    (``fori_loop`` with a traced bound), and a carry split only inside the loop's body,
    come out of the step split, not whole on every logical device (before, the sharding
    pass gave ``while`` results ``{replicated}``); the weight going in takes the split.
    A body that splits its carry another way than the carry came in wins (the annotation
    inside), and numbers equal ``jax.jit``'s on one device."""
    n, k = 2, 4
    split = rt.split_to_logical_devices

    def make(split):
        def step(w, v, x, trips):
            w = split(w, [1, k])
            w2 = jax.lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c) * 0.9, w)
            v2 = jax.lax.while_loop(lambda c: c[0] < trips,
                                    lambda c: (c[0] + 1, split(c[1] * 1.5 - 0.25, [k, 1])),
                                    (jnp.int32(0), v))[1]
            return w2, v2, x @ w2
        return step

    rng = np.random.default_rng(11)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    v = rng.normal(size=(8, 4)).astype(np.float32)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    rep = rt.replicate(make(split), num_replicas=n, logical_devices=k)
    w2, v2, y = rep(w, v, rt.distribute(x, n), np.int32(3))
    want_w2, want_v2, want_y = jax.jit(make(lambda a, dims: a))(w, v, x, np.int32(3))
    np.testing.assert_allclose(np.asarray(w2), np.asarray(want_w2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(v2), np.asarray(want_v2), rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([np.asarray(a) for a in y.values]),
                               np.asarray(want_y), rtol=1e-5, atol=1e-6)
    ir = rep.lower(w, v, rt.distribute(x, n), np.int32(3)).ir(after="sharding")
    cols = f"{{devices=[1,{k}]0,1,2,3}}"
    assert str(ir.inputs[0].type) == f"f32[8,8] mirrored {cols}"
    assert str(ir.outputs[0].type) == f"f32[8,8] mirrored {cols}"
    assert str(ir.outputs[1].type) == f"f32[8,4] mirrored {{devices=[{k},1]0,1,2,3}}"
    assert w2.sharding.shard_shape(w2.shape) == (8, 8 // k)   # the results really split
    assert v2.sharding.shard_shape(v2.shape) == (8 // k, 4)


def test_splits_propagate_through_cond_and_scan_to_the_steps_boundary():
    """A value split only inside a ``lax.cond``'s branches (and a scan over two layers whose
    body splits its carry) comes out of the step split, not whole on every logical device
    (before, the sharding pass gave ``cond``/``scan`` results ``{replicated}``), and the
    weight going in takes the split too. Branches that annotate the result differently are
    a ``ShardingError`` naming both lines (before, XLA's internal verifier error: a
    conditional's branch roots must agree). Numbers equal ``jax.jit``'s."""
    n, k = 2, 4

    def make(split):
        def step(w, x, flag):
            w2 = jax.lax.cond(flag > 0, lambda w: split(w * 2.0, [1, k]),
                              lambda w: split(w + 1.0, [1, k]), w)
            w3, _ = jax.lax.scan(lambda c, _: (split(jnp.tanh(c), [1, k]), None), w2, None,
                                 length=2)
            return w3, x @ w3
        return step
    split = rt.split_to_logical_devices
    step = make(split)

    def disagree(w, x):
        w2 = jax.lax.cond(x.sum() > 1e9, lambda w: split(w * 2.0, [1, k]),
                          lambda w: split(w * 3.0, [k, 1]), w)
        return w2, x @ w2

    rng = np.random.default_rng(7)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    rep = rt.replicate(step, num_replicas=n, logical_devices=k)
    w3, y = rep(w, rt.distribute(x, n), np.int32(1))
    want_w3, want_y = jax.jit(make(lambda v, dims: v))(w, x, np.int32(1))
    np.testing.assert_allclose(np.asarray(w3), np.asarray(want_w3), rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([np.asarray(v) for v in y.values]),
                               np.asarray(want_y), rtol=1e-5, atol=1e-6)
    ir = rep.lower(w, rt.distribute(x, n), np.int32(1)).ir(after="sharding")
    split_type = f"f32[8,8] mirrored {{devices=[1,{k}]0,1,2,3}}"
    assert str(ir.inputs[0].type) == split_type and str(ir.outputs[0].type) == split_type
    assert w3.sharding.shard_shape(w3.shape) == (8, 8 // k)   # the result really split
    from compiler.errors import ShardingError
    with pytest.raises(ShardingError, match=r"cond \(test_logical_devices\.py:\d+\): the false "
                                            r"branch annotates result 0 as \{devices=\[4,1\]"
                                            r"0,1,2,3\} \(.*\) and the true branch as "
                                            r"\{devices=\[1,4\]0,1,2,3\}"):
        rt.replicate(disagree, num_replicas=n, logical_devices=k)(w, rt.distribute(x, n))


def test_a_split_inside_a_per_replica_branch_keeps_the_gradient_hoistable():
    """A weight split (an identity annotation) inside both branches of a ``lax.cond`` whose
    predicate differs between replicas, then ``jax.grad``: the gradient's all-reduce is
    taken out of the branch as without the annotation, and the gradient equals the mean of
    the replicas' own gradients (before: a ``DivergentCollectiveError`` saying the ``shard``
    op used the collective's result "in a way that is not linear")."""
    split = rt.split_to_logical_devices
    w = np.linspace(-0.5, 0.5, 8, dtype=np.float32).reshape(4, 2)
    xs = [np.full((2, 4), 1.0, np.float32), np.full((2, 4), -1.0, np.float32)]

    def step(w, x):
        def loss(w):
            return jax.lax.cond(jnp.sum(x) > 0,
                                lambda: jnp.sum(jnp.tanh(x @ split(w, [1, 2]))),
                                lambda: jnp.sum(jnp.cos(x @ split(w, [1, 2]))))
        return jax.grad(loss)(w)

    got = rt.replicate(step, num_replicas=2, logical_devices=2)(w, rt.PerReplica(xs))
    want = (jax.grad(lambda w: jnp.sum(jnp.tanh(xs[0] @ w)))(w)
            + jax.grad(lambda w: jnp.sum(jnp.cos(xs[1] @ w)))(w)) / 2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("k", [2, 4])
def test_max_and_min_over_a_split_dim_keep_nan(k):
    """``jnp.max``/``jnp.min`` over a dim split across K logical devices equal one
    device's, NaN included (before: the tile holding the NaN dropped out of XLA:CPU's
    cross-device max, so ``[0, ..., 5, nan, 7]`` split in two gave 3.0, and plain
    ``jax.jit`` over the same devices still does); ``argmax`` and NaN-free rows unchanged."""
    split = rt.split_to_logical_devices
    x = np.array([[0, 1, 2, 3, 4, 5, np.nan, 7], [3, -1, 8, 2, 0, 6, 1, 5]], np.float32)

    def f(x):
        return (jnp.max(x, axis=1), jnp.min(x, axis=1), jnp.max(x), jnp.argmax(x, axis=1),
                jnp.nanmax(x, axis=1))
    step = rt.replicate(lambda x: f(split(x, [1, k])), num_replicas=2, logical_devices=k)
    got = step(rt.PerReplica([x, x[::-1]]))
    for r, xr in enumerate([x, x[::-1]]):
        for g, w in zip(got, jax.jit(f)(xr)):
            np.testing.assert_array_equal(np.asarray(g.values[r]), np.asarray(w))


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("case", ["psum_scatter", "grad_of_all_gather"])
def test_bfloat16_reduce_scatter_with_logical_devices(case, k):
    """A bfloat16 reduce-scatter (``rt.psum_scatter``, or the gradient of an
    ``rt.all_gather``) with K > 1 logical devices: the numbers ``jax.pmap`` gives (before:
    XLA:CPU aborted the whole process while compiling it, its promotion to float32 unable
    to clone a reducer holding the partly manual mesh's sharding constraint; found by a
    probe). Oracle: jax.pmap of the same per-replica code."""
    from jax import lax
    bf16 = jnp.bfloat16
    x = np.arange(8, dtype=np.float32) * 0.75
    if case == "psum_scatter":
        f = lambda x: rt.psum_scatter(x.astype(bf16), scatter_dimension=0).astype(jnp.float32)  # noqa: E731
        ref = lambda x: lax.psum_scatter(x.astype(bf16), "i", tiled=True).astype(jnp.float32)  # noqa: E731
    else:
        f = lambda x: jax.grad(lambda v: jnp.sum(rt.all_gather(v.astype(bf16), axis=0)  # noqa: E731
                                                  .astype(jnp.float32) ** 2))(x)
        ref = lambda x: jax.grad(lambda v: jnp.sum(lax.all_gather(  # noqa: E731
            v.astype(bf16), "i", tiled=True).astype(jnp.float32) ** 2))(x)
    got = rt.replicate(f, num_replicas=2, logical_devices=k)(rt.distribute(x, 2))
    want = jax.pmap(ref, axis_name="i", devices=jax.devices()[:2])(x.reshape(2, 4))
    for r in range(2):
        np.testing.assert_allclose(np.asarray(got.values[r]), np.asarray(want[r]), rtol=1e-6)


_POOLS = {  # name: (reducer, init, window, strides, padding) along the split dim 1
    "max_same_window_3": (jax.lax.max, -np.inf, (1, 3), (1, 1), "SAME"),
    "min_same_window_3": (jax.lax.min, np.inf, (1, 3), (1, 1), "SAME"),
    "max_valid_window_2": (jax.lax.max, -np.inf, (1, 2), (1, 1), "VALID"),
    "max_2d_3x3": (jax.lax.max, -np.inf, (3, 3), (1, 1), "SAME"),
}


@pytest.mark.parametrize("n,k", [(1, 2), (2, 2), (1, 4)])
@pytest.mark.parametrize("name", sorted(_POOLS))
def test_gradient_of_max_pooling_along_a_split_dim(name, n, k):
    """The gradient of a max/min ``reduce_window`` whose windows overlap along a dim
    split over the logical devices (XLA's select-and-scatter) equals one device's; found
    by a probe: XLA's partitioner gave wrong numbers there (window 3, stride 1, split in
    two: ``[-0.17, 0, 1.68, -0.51, ...]`` where one device gives ``[2.63, -0.53, 0.72,
    1.33, ...]``; plain ``jax.jit`` with the same constraint too), so its operands are
    unsplit along the windowed dims (``compiler.lower``). Oracle: ``jax.jit`` on one
    device, gradients averaged over the replicas."""
    from jax import lax
    reducer, init, window, strides, padding = _POOLS[name]
    w = np.random.RandomState(0).randn(8).astype(np.float32)
    xs = [np.random.RandomState(1 + r).randn(4, 8).astype(np.float32) for r in range(n)]

    def loss(w, x, split=True):
        v = x * w
        if split:
            v = rt.split_to_logical_devices(v, [1, k])
        y = lax.reduce_window(v, np.float32(init), reducer, window, strides, padding)
        return jnp.sum(y * jnp.cos(x[:, :y.shape[1]]))
    got = rt.replicate(jax.grad(loss), num_replicas=n, logical_devices=k)(w, rt.PerReplica(xs))
    want = np.mean([jax.jit(jax.grad(lambda w, x: loss(w, x, False)))(w, x) for x in xs], 0)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_complex_fft_along_a_split_dim(axis, k):
    """A complex FFT of a value split over the logical devices along its transformed
    axis (or the other), forward and the gradient of a mirrored weight: one device's
    numbers. Before: XLA:CPU failed the call (``RET_CHECK ... IsMonotonicWithDim0Major``
    in its FFT thunk; ``jax.jit`` of inputs sharded so too; found by a probe): the
    transformed axes are unsplit for the op (``compiler.lower``)."""
    w = np.linspace(0.5, 1.5, 8).astype(np.float32)
    xs = [np.random.RandomState(1 + r).randn(8, 8).astype(np.float32) for r in range(2)]

    def f(w, x, split=True):
        v = x * w
        if split:
            v = rt.split_to_logical_devices(v, [1, k] if axis else [k, 1])
        return jnp.abs(jnp.fft.fft(v, axis=1)) ** 2

    def step(w, x, split=True):
        return jax.value_and_grad(lambda w: jnp.mean(f(w, x, split)))(w)
    out = rt.replicate(lambda w, x: (f(w, x), step(w, x)[1]), num_replicas=2,
                       logical_devices=k)(w, rt.PerReplica(xs))
    for r, x in enumerate(xs):
        np.testing.assert_allclose(np.asarray(out[0].values[r]),
                                   np.asarray(jax.jit(lambda w, x: f(w, x, False))(w, x)),
                                   rtol=1e-4, atol=1e-4)
    want = np.mean([jax.jit(lambda w, x: step(w, x, False)[1])(w, x) for x in xs], 0)
    np.testing.assert_allclose(np.asarray(out[1]), want, rtol=1e-4, atol=1e-5)


def _conv(padding="SAME", **kw):
    return lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"), **kw)


_CONVS = {  # name: (k, split of x, partial, kernel shape, conv, kernel made from the data)
    "kernel_grad_split_h_partial": (4, [1, 2, 1, 1], True, (3, 3, 4, 4), _conv(), False),
    "kernel_grad_split_h_and_c_taller_output": (4, [1, 2, 1, 2], False, (5, 1, 4, 4),
                                                _conv(((4, 4), (0, 0))), False),
    "kernel_grad_batch_groups": (2, [2, 1, 1, 1], False, (3, 3, 4, 4),
                                 _conv(batch_group_count=2), False),
    "data_kernel_of_a_slice": (4, [1, 2, 1, 2], False, None, None, True),
    "kernel_grad_split_h": (2, [1, 2, 1, 1], False, (3, 3, 4, 4), _conv(), False),
}


@pytest.mark.parametrize("name", sorted(_CONVS))
def test_convolutions_of_spatially_split_data(name):
    """Convolutions whose kernel is per-replica data (a kernel's gradient, ``jnp.convolve``
    of a row with its own first elements) or with batch groups, on data split along
    spatial dims: one device's numbers. Found by a probe: XLA's partitioner gave 2x
    (a split along H copied over the other devices; H and C split with an output taller
    than the input; a ``[1, 2, 2]`` split cut to one channel) and half a kernel gradient
    zero (batch groups, the batch split); ``jax.jit`` with the same constraints too
    (``compiler.lower``'s rule unsplits the spatial dims of such a convolution). Oracle:
    ``jax.jit`` on one device."""
    k, dims, partial, wshape, conv, data_kernel = _CONVS[name]
    split = rt.split_to_logical_devices
    r = np.random.RandomState(0)
    if data_kernel:
        x = r.randn(2, 8, 2, 2).astype(np.float32)

        def f(h):
            return jax.vmap(lambda a: jnp.convolve(a, a[:4], mode="same"))(h[..., 1, 1])
        got = rt.replicate(lambda h: f(split(h, dims)), num_replicas=1, logical_devices=k)(
            rt.distribute(x, 1))
        np.testing.assert_allclose(np.asarray(got.values[0]), np.asarray(jax.jit(f)(x)),
                                   rtol=1e-5, atol=1e-5)
        return
    x = r.randn(2, 8, 8, 4).astype(np.float32)
    w = r.randn(*wshape).astype(np.float32)

    def loss(w, x):
        return jnp.sum(conv(x, w) ** 2)
    got = rt.replicate(lambda w, x: jax.grad(loss)(w, split(x, dims, partial=partial)),
                       num_replicas=1, logical_devices=k)(w, rt.distribute(x, 1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(jax.grad(loss))(w, x)),
                               rtol=1e-4, atol=1e-3)


_W6 = np.random.RandomState(1).randn(6).astype(np.float32)
_IDS = np.random.RandomState(2).randint(0, 16, size=(2, 8))


def _gather_two_axes(h, split=lambda v, d: v):
    """A table split over both model axes read at indices, times a value split so."""
    table = split(h[:, :8], [2, 2])
    return table[_IDS] * split(jnp.tanh(h[:2, :8])[:, :, None] * h[0, :8], [1, 2, 2])


_ABORTS = {  # name: (n, k, f(h, split)); h: (16, 8) per replica; found by a probe
    "pad_cutting_and_interleaving": (1, 2, lambda h, split: jax.lax.pad(
        split(h, [2, 1]), 0.5, ((-1, 2, 1), (0, 0, 0)))),
    "sort_grad_along_an_uneven_cut": (1, 2, lambda h, split: jax.grad(lambda h: jnp.sum(
        jnp.sort(split(h, [2, 1])[1:], axis=0) * jnp.arange(15.0)[:, None]))(h)),
    "gather_from_two_axes_on_two_replicas": (2, 4, _gather_two_axes),
    "sort_grad_on_two_axes_on_two_replicas": (2, 4, lambda h, split: jax.grad(
        lambda w: jnp.sum(jnp.sin(jnp.sort(split(h[:, :6], [2, 2]) * w, 0))))(_W6)),
}


@pytest.mark.parametrize("name", sorted(_ABORTS))
def test_ops_xla_aborted_on_split_values(name):
    """Ops on split values where XLA's partitioner aborted the whole process (a negative
    and interior ``pad`` of a split dim; the gradient of a sort along a split axis cut to
    an uneven length; a gather, or a sort's gradient, of values split over both model
    axes of K = 4 on 2 replicas, which ``jax.jit`` of ``shard_map`` over the replicas
    aborts too): they run, with one device's numbers (``compiler.lower`` unsplits them).
    Oracle: ``jax.jit`` on one device."""
    n, k, f = _ABORTS[name]
    xs = [np.random.RandomState(r).randn(16, 8).astype(np.float32) for r in range(n)]
    got = rt.replicate(lambda h: f(h, rt.split_to_logical_devices), num_replicas=n,
                       logical_devices=k)(rt.PerReplica(xs))
    want = [np.asarray(jax.jit(lambda h: f(h, lambda v, d: v))(x)) for x in xs]
    if not isinstance(got, rt.PerReplica):  # (a mirrored weight's gradient: the mean)
        got, want = rt.PerReplica([got]), [np.mean(want, 0)]
    for g, w in zip(got.values, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)
