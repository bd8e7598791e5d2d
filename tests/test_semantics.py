"""Issue 10's targeted regressions: results split over logical devices come back whole,
``rt.reduce`` counts an identical result once per replica, ``rt.local`` keeps gradients
per replica, collectives in per-replica control flow are refused with both lines named,
and a multi-step state may not change its dtype. The broad differential corpus is
``test_semantics_corpus.py``."""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import runtime as rt
from compiler.errors import DivergentCollectiveError, PassError


def _line(fn, text: str) -> int:
    """The line of this file where ``text`` appears inside ``fn``."""
    src, start = inspect.getsourcelines(fn)
    for i, line in enumerate(src):
        if text in line:
            return start + i
    raise AssertionError(text)


# -- item 3: per-replica results split over logical devices ------------------------------
def _split_out(x):
    return rt.split_to_logical_devices(x, [1, 2]) * 2


def _split_by_propagation(x, w):
    return x @ rt.split_to_logical_devices(w, [1, 2])  # the output's split is propagated


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_split_result_comes_back_whole(dynamic):
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(2, 4)).astype(np.float32), rng.normal(size=(3 if dynamic else 2, 4)).astype(np.float32)]
    step = rt.replicate(_split_out, num_replicas=2, logical_devices=2,
                        options=rt.RunOptions(dynamic_shapes=dynamic))
    out = step(rt.PerReplica(xs))
    for r, x in enumerate(xs):
        assert out.values[r].shape == x.shape
        np.testing.assert_array_equal(np.asarray(out.values[r]), 2 * x)
    np.testing.assert_allclose(rt.reduce("sum", out, axis=0), 2 * np.concatenate(xs).sum(0), rtol=1e-6)


def test_split_result_by_propagation_stays_split_over_its_devices():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(4, 6)).astype(np.float32)
    xs = [rng.normal(size=(3, 4)).astype(np.float32) + r for r in range(4)]
    step = rt.replicate(_split_by_propagation, num_replicas=4, logical_devices=2)
    out = step(rt.PerReplica(xs), w)
    mesh = step.mesh.devices.reshape(4, 2)
    for r, x in enumerate(xs):
        v = out.values[r]
        np.testing.assert_allclose(np.asarray(v), x @ w, rtol=1e-5, atol=1e-6)
        # the value lives on replica r's two logical devices, one column tile on each
        assert v.devices() == set(mesh[r])
        assert sorted(s.data.shape for s in v.addressable_shards) == [(3, 3), (3, 3)]
    np.testing.assert_allclose(rt.reduce("mean", out), np.mean([x @ w for x in xs], 0), rtol=1e-5)


# -- item 4: identical values count once per replica --------------------------------------
@pytest.mark.parametrize("n", [2, 8])
def test_reduce_sum_of_an_identical_count_is_the_global_count(n):
    """A metric ``count = batch.shape[0]`` is identical on every replica (a constant):
    summed over replicas it is the global count, whether the compiler proved it identical
    (one array) or not (a PerReplica)."""
    step = rt.replicate(lambda x: {"count": jnp.float32(x.shape[0]),
                                   "count_pr": jnp.sum(x[:, 0] * 0 + 1)}, num_replicas=n)
    out = step(rt.distribute(np.zeros((3 * n, 2), np.float32), n))
    assert not isinstance(out["count"], rt.PerReplica) and isinstance(out["count_pr"], rt.PerReplica)
    for key in ("count", "count_pr"):
        assert float(rt.reduce("sum", out[key])) == 3 * n
        assert float(rt.reduce("mean", out[key])) == 3
        assert float(rt.reduce("max", out[key])) == 3
    # along an axis: N copies, concatenated
    vec = rt.replicate(lambda x: jnp.arange(3.0), num_replicas=n)(rt.distribute(np.zeros((n, 1)), n))
    np.testing.assert_array_equal(rt.reduce("sum", vec, axis=0), n * 3.0)
    np.testing.assert_array_equal(rt.reduce("mean", vec, axis=0), 1.0)


def test_reduce_sum_of_a_value_not_from_a_step_needs_num_replicas():
    with pytest.raises(ValueError, match=r"value\['a'\] \(shape \(3,\)\) is not a PerReplica.*num_replicas=N"):
        rt.reduce("sum", {"a": np.ones(3)})
    np.testing.assert_array_equal(rt.reduce("sum", np.ones(3), num_replicas=4), [4, 4, 4])
    np.testing.assert_array_equal(rt.reduce("mean", np.ones(3)), [1, 1, 1])  # any N: the same
    out = rt.replicate(lambda x: jnp.ones(2), num_replicas=2)(rt.distribute(np.zeros((2, 1)), 2))
    with pytest.raises(ValueError, match=r"step on 2 replicas but num_replicas=4"):
        rt.reduce("sum", out, num_replicas=4)
    with pytest.raises(ValueError, match=r"num_replicas must be a positive int, got 0"):
        rt.reduce("sum", out, num_replicas=0)


# -- item 5: gradients that stay per replica ------------------------------------------------
def test_local_outside_a_step_is_an_error():
    with pytest.raises(RuntimeError, match=r"local\(\) can only be called inside"):
        rt.local(jnp.ones(3))


def test_local_view_gradients_are_each_replicas_own():
    w = np.array([1.0, -2.0, 0.5], np.float32)
    xs = [np.full((2, 3), r + 1.0, np.float32) for r in range(4)]

    def step(w, x):
        loss = lambda w: jnp.sum((x @ w) ** 2)
        return jax.grad(loss)(rt.local(w)), jax.grad(loss)(w)
    local, reduced = rt.replicate(step, num_replicas=4)(w, rt.PerReplica(xs))
    own = [jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w) for x in xs]
    assert isinstance(local, rt.PerReplica)
    for r in range(4):
        np.testing.assert_allclose(local.values[r], own[r], rtol=1e-6)
    assert not isinstance(reduced, rt.PerReplica)
    np.testing.assert_allclose(reduced, np.mean(own, 0), rtol=1e-6)


def test_dp_sgd_readme_recipe_matches_single_device_dp_sgd():
    """The README's DP-SGD recipe on 4 replicas equals DP-SGD on the global batch."""
    rng = np.random.default_rng(3)
    params = {"w": rng.normal(size=(5, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
    x = rng.normal(size=(16, 5)).astype(np.float32)
    y = rng.normal(size=(16, 2)).astype(np.float32)

    def loss(p, x, y):  # one example
        return jnp.sum((x @ p["w"] + p["b"] - y) ** 2)

    def clip(g, c=1.0):
        norm = jnp.sqrt(sum(jnp.sum(a ** 2) for a in jax.tree.leaves(g)))
        return jax.tree.map(lambda a: a * jnp.minimum(1.0, c / norm), g)

    @rt.replicate
    def dp_step(params, x, y):
        per_example = jax.vmap(jax.grad(loss), (None, 0, 0))(rt.local(params), x, y)
        summed = jax.tree.map(lambda g: g.sum(0), jax.vmap(clip)(per_example))
        count = rt.all_reduce(jnp.float32(x.shape[0]), "sum")
        grads = jax.tree.map(lambda g: rt.all_reduce(g, "sum") / count, summed)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    def single_device(params, x, y):
        per_example = jax.vmap(jax.grad(loss), (None, 0, 0))(params, x, y)
        grads = jax.tree.map(lambda g: g.mean(0), jax.vmap(clip)(per_example))
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    got = rt.replicate(dp_step.fn, num_replicas=4)(params, rt.distribute(x, 4), rt.distribute(y, 4))
    want = jax.jit(single_device)(params, x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    # without rt.local the per-example gradients would be summed over replicas first
    wrong = rt.replicate(lambda p, x, y: jax.tree.map(
        lambda g: g.sum(0), jax.vmap(clip)(jax.vmap(jax.grad(loss), (None, 0, 0))(p, x, y))),
        num_replicas=4)(params, rt.distribute(x, 4), rt.distribute(y, 4))
    assert not np.allclose(wrong["w"] / 16, params["w"] - want["w"])


# -- item 2: collectives never run inside per-replica control flow ------------------------
def _user_all_reduce_in_branch(w, x):
    h = x @ w
    h = lax.cond(x[0, 0] > 0, lambda h: h + rt.all_reduce(h, "sum"), lambda h: h * 2.0, h)
    return jnp.sum(h)


def _collective_in_per_replica_while(w, x):
    def body(s):
        i, h = s
        return i + 1, h - rt.all_reduce(h, "mean")
    return lax.while_loop(lambda s: s[0] < x[0, 0], body, (0.0, x @ w))[1]


def _grad_inside_per_replica_branch(w, x):
    return lax.cond(x[0, 0] > 0, lambda w: jax.grad(lambda w: jnp.sum(x @ w))(w),
                    lambda w: w, w)


@pytest.mark.parametrize("fn, coll, ctl", [
    (_user_all_reduce_in_branch, 'rt.all_reduce(h, "sum")', "lax.cond("),
    (_collective_in_per_replica_while, 'rt.all_reduce(h, "mean")', "lax.while_loop("),
    (_grad_inside_per_replica_branch, "jax.grad(", "lax.cond("),
])
def test_collective_in_per_replica_control_flow_is_refused_with_both_lines(fn, coll, ctl):
    w = np.ones((3, 2), np.float32)
    step = rt.replicate(fn, num_replicas=2)
    with pytest.raises(DivergentCollectiveError) as e:
        step(w, rt.distribute(np.arange(12, dtype=np.float32).reshape(4, 3), 2))
    msg = str(e.value)
    assert f"test_semantics.py:{_line(fn, coll)}" in msg, msg
    assert f"test_semantics.py:{_line(fn, ctl)}" in msg, msg
    assert "differs between replicas" in msg


def test_collective_in_mirrored_control_flow_runs():
    """The same branch with a mirrored predicate is fine: every replica takes it."""
    def step(w, x):
        h = x @ w
        return lax.cond(jnp.sum(w) > 0, lambda h: h * 0 + rt.all_reduce(h, "sum"), lambda h: h, h)
    xs = np.arange(12, dtype=np.float32).reshape(4, 3)
    w = np.ones((3, 2), np.float32)
    out = rt.replicate(step, num_replicas=2)(w, rt.distribute(xs, 2))
    for r in range(2):
        np.testing.assert_allclose(out.values[r], xs[:2] @ w + xs[2:] @ w)


def test_hoisted_gradient_is_one_sum_after_the_branch():
    """Stochastic depth: the gradient of the block's weight leaves the transposed branch
    (one all-reduce after the cond) and equals the mean of each replica's gradient."""
    def loss(w, u, x):
        h = x @ w
        h = lax.cond(x[0, 0] > 0, lambda h: h + jnp.tanh(h @ u), lambda h: h, h)
        return jnp.mean(h ** 2)

    def step(w, u, x):
        return jax.grad(loss, argnums=(0, 1))(w, u, x)
    rng = np.random.default_rng(5)
    w, u = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(2, 2)).astype(np.float32)
    xs = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(4)]
    xs[0][0, 0], xs[1][0, 0] = 1.0, -1.0  # replica 0 runs the block, replica 1 skips it
    rstep = rt.replicate(step, num_replicas=4)
    gw, gu = rstep(w, u, rt.PerReplica(xs))
    want = [jax.jit(step)(w, u, x) for x in xs]  # each replica's own program
    np.testing.assert_allclose(gw, np.mean([g[0] for g in want], 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gu, np.mean([g[1] for g in want], 0), rtol=1e-5, atol=1e-6)
    graph = rstep.lower(w, u, rt.PerReplica(xs)).ir()
    conds = [op for op, _ in graph.walk() if op.name == "cond"]
    assert all(o.name != "all_reduce" for c in conds for r in c.regions for o, _ in r.walk())


# -- max / min all-reduce are differentiable ------------------------------------------------
@pytest.mark.parametrize("op", ["max", "min"])
def test_all_reduce_max_min_gradient_matches_jnp_extremum_with_ties(op):
    """The loss is identical on every replica, so it counts once per replica (TF): the
    gradient with respect to replica r's input is N times d max/d x_r, which goes to the
    replicas holding the extremum, shared equally among ties (as ``jnp.max`` shares it)."""
    xs = [np.array([1.0, 5.0, 2.0], np.float32), np.array([3.0, 5.0, 2.0], np.float32),
          np.array([3.0, 0.0, -1.0], np.float32), np.array([0.0, 5.0, 2.0], np.float32)]
    step = rt.replicate(lambda x: jax.grad(lambda x: jnp.sum(rt.all_reduce(x, op) * jnp.arange(1.0, 4.0)))(x),
                        num_replicas=4)
    got = step(rt.PerReplica(xs))
    red = jnp.max if op == "max" else jnp.min
    want = 4 * jax.grad(lambda s: jnp.sum(red(s, 0) * jnp.arange(1.0, 4.0)))(jnp.stack(xs))
    for r in range(4):
        np.testing.assert_allclose(got.values[r], want[r], rtol=1e-6)


# -- item 7: a multi-step state keeps its dtype -----------------------------------------------
def test_steps_per_call_state_dtype_change_is_refused():
    def step(state, x):
        return {"count": state["count"] + 0.5, "w": state["w"]}, jnp.sum(x)  # int32 -> float
    rstep = rt.replicate(step, num_replicas=2, steps_per_call=3)
    state = {"count": jnp.int32(0), "w": jnp.ones(2)}
    with pytest.raises(TypeError, match=r"state leaf state\['count'\] as float32\[\] but took it "
                                        r"as int32\[\]"):
        rstep(state, rt.distribute_steps([np.ones((4, 2), np.float32)] * 3, 2))


def test_pipeline_without_hoisting_still_never_runs_a_divergent_collective():
    step = rt.replicate(_user_all_reduce_in_branch, num_replicas=2,
                        options=rt.RunOptions(pipeline="replication,cross-replica-sum,sharding,dce"))
    with pytest.raises((DivergentCollectiveError, PassError)):
        step(np.ones((3, 2), np.float32), rt.distribute(np.ones((4, 3), np.float32), 2))


# -- branches and loop carries that differ in what varies (ir/_jax_compat.py) ------------
# JAX's shard_map types refuse these; pmap and TF run them with per-replica results.
_XS = np.arange(24, dtype=np.float32).reshape(4, 6) / 10.0


def _cond_mixed(w, x, k):
    """A branch with a mirrored output and one with a per-replica output."""
    return lax.cond(k > 0, lambda v: v.sum() * 0.0 + 1.0, lambda v: (v * x).sum(), w)


def _switch_mixed(w, x, k):  # (JAX's keyword names reach JAX through our wrapper)
    return lax.switch(k, branches=[lambda v: v.sum(), lambda v: (v * x).mean(),
                                   lambda v: v.max()], operand=w)


def _while_cascade(w, x, k):
    """b becomes per-replica only after a did: JAX promotes one level, this takes two."""
    def body(c):
        a, b, i = c
        return a + x.sum(), b + a, i + 1
    return lax.while_loop(lambda c: c[2] < k + 3, body, (w.sum(), w.mean(), 0))[:2]


def _scan_cascade(w, x, k):
    def body(c, _):
        a, b = c
        return (a + x.sum(), b * 0.5 + a), b
    return lax.scan(body, (w.sum(), w.mean()), None, length=3)


@pytest.mark.parametrize("fn", [_cond_mixed, _switch_mixed, _while_cascade, _scan_cascade])
@pytest.mark.parametrize("k", [0, 1])
def test_branches_and_carries_that_become_per_replica(fn, k):
    n = 4
    w = np.linspace(-1.0, 1.0, 6, dtype=np.float32)
    out = rt.replicate(lambda w, x, k: fn(w, x, k), num_replicas=n)(
        w, rt.PerReplica(list(_XS)), np.int32(k))
    ref = jax.jit(fn)
    for r in range(n):
        want = ref(w, _XS[r], np.int32(k))
        got = jax.tree.map(lambda v: v.values[r] if isinstance(v, rt.PerReplica) else v, out,
                           is_leaf=lambda v: isinstance(v, rt.PerReplica))
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, err_msg=f"replica {r}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_through_a_mirrored_branch_output_cast_to_varying(reduction):
    """The cast's transpose sums a mirrored branch output's cotangent over the replicas:
    the gradient is c times the sum of the replicas' own, as for any mirrored value."""
    n = 4
    w = np.linspace(-1.0, 1.0, 6, dtype=np.float32)

    def loss(w, x, k):
        y = lax.cond(k > 0, lambda v: v * 2.0, lambda v: v * x, w)
        return (y * y).sum()

    grad = rt.replicate(jax.grad(loss), num_replicas=n, loss_reduction=reduction)
    c = 1.0 / n if reduction == "mean" else 1.0
    for k in (0, 1):
        got = grad(w, rt.PerReplica(list(_XS)), np.int32(k))
        assert not isinstance(got, rt.PerReplica)
        want = c * sum(jax.grad(loss)(w, _XS[r], np.int32(k)) for r in range(n))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


def test_branches_that_differ_in_shape_are_still_jaxs_error():
    def step(w, x):
        return lax.cond(x.sum() > 0, lambda v: v, lambda v: v[:2], w)
    with pytest.raises(TypeError, match="cond branch"):
        rt.replicate(step, num_replicas=2)(np.ones(4, np.float32), rt.PerReplica([np.ones(2)] * 2))


def test_a_cond_reached_through_jaxs_own_function_keeps_jaxs_error():
    """Inside a loop body that our wrapper of ``while_loop`` traces, a ``cond`` called
    through a reference to JAX's own function (taken before our first trace) is not
    ours to retrace: JAX's error about its branches, not the loop's carries misread."""
    rt.replicate(lambda x: x, num_replicas=2)(np.ones(2, np.float32))  # hooks installed
    jax_cond = jax.lax.cond.__wrapped__ if getattr(jax.lax.cond, "_replicate_hlo", False) \
        else jax.lax.cond
    assert not getattr(jax_cond, "_replicate_hlo", False)

    def step(w, x):
        def body(c):
            a, b, i = c
            y = jax_cond(i > 5, lambda: jnp.float32(0.0), lambda: x.sum())
            return a + y, b, i + 1
        return lax.while_loop(lambda c: c[2] < 3, body, (w.sum(), w.mean(), 0))

    with pytest.raises(TypeError, match="cond branches must have equal output types"):
        rt.replicate(step, num_replicas=2)(np.ones(3, np.float32),
                                           rt.PerReplica([np.ones(2, np.float32)] * 2))


_BACKWARDS = {
    "clip": lambda g, w: jnp.clip(g, -0.01, 0.01),
    "scaled": lambda g, w: 3.0 * g,
    "shifted": lambda g, w: g + 1.0,
    "leaky": lambda g, w: jnp.where(g > 0, g, 0.1 * g),
    "times_primal": lambda g, w: g * w,
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(_BACKWARDS))
def test_custom_gradient_of_a_mirrored_weight_is_reduced_over_replicas(name, reduction):
    """``jax.custom_gradient`` applied to a mirrored weight: its gradient function runs on
    each replica's own cotangent and the results are reduced over the replicas, as a
    ``custom_vjp``'s (oracle: c·∇ Σ_r L_r on one device, each replica's loss through the
    same function). Before, a gradient function with a nested ``jit`` (``jnp.clip``) came
    back per replica, unreduced, and one with a constant (``3.0 * g``) failed to type."""
    n = 4
    bwd = _BACKWARDS[name]

    @jax.custom_gradient
    def through(w):
        return w, lambda g: (bwd(g, w),)

    def loss(w, x):
        return jnp.mean((x @ through(w)) ** 2)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4 * n, 3)).astype(np.float32)
    w = (0.5 * rng.normal(size=3)).astype(np.float32)
    got = rt.replicate(lambda w, x: jax.grad(loss)(w, x), num_replicas=n,
                       loss_reduction=reduction)(w, rt.distribute(x, n))
    assert not isinstance(got, rt.PerReplica)
    c = 1.0 / n if reduction == "mean" else 1.0
    want = c * jax.grad(lambda w: sum(loss(w, xr) for xr in np.split(x, n)))(w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["while", "fori"])
def test_a_loop_whose_trip_count_differs_between_replicas(kind):
    """A ``while_loop``/``fori_loop`` whose condition reads per-replica data runs a
    different number of times on each replica: its results are per-replica though its
    carry starts mirrored, so a mirrored weight scaled by the count gets the sum of each
    replica's own gradient (before: JAX typed the count by its carry, mirrored, and the
    weight's gradient was summed over the replicas before the count met it: each replica
    got its own wrong gradient, no error; found by a probe). Oracle: the sum of each
    replica's jax.jit gradient (loss_reduction="sum")."""
    def count(x):
        if kind == "while":
            return lax.while_loop(lambda c: c < jnp.sum(x), lambda c: c + 1.0, 0.0)
        return lax.fori_loop(0, jnp.sum(x).astype(jnp.int32), lambda i, c: c + 1.0, 0.0)

    def loss(w, x):
        return jnp.sum(x @ (w * count(x)))
    xs = [np.full((4, 3), v, np.float32) for v in (0.5, 1.0)]
    w = np.asarray([0.3, -0.2, 0.5], np.float32)
    got = rt.replicate(jax.grad(loss), num_replicas=2, loss_reduction="sum")(
        w, rt.PerReplica(xs))
    assert not isinstance(got, rt.PerReplica), got
    want = sum(np.asarray(jax.jit(jax.grad(loss))(w, x)) for x in xs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


@pytest.mark.parametrize("kind", ["cond", "cond_int", "switch"])
def test_gradient_through_a_per_example_branch_under_vmap(kind):
    """``jax.grad`` through ``jax.vmap`` of a ``lax.cond``/``switch`` whose index is per
    example, the branches using a mirrored weight: every branch runs and each example
    takes its own (JAX's batching of a batched index), and the gradient is the mean of
    the replicas' (before: JAX's "pvary is a invariant->variant collective" error, which
    plain ``jax.shard_map(check_vma=True)`` gives too)."""
    n = 4

    def pick(xi, w):
        if kind == "cond":
            return lax.cond(jnp.sum(xi) > 0, lambda: jnp.tanh(xi @ w), lambda: jnp.sin(xi @ w))
        if kind == "cond_int":
            return lax.cond((jnp.sum(xi) > 0).astype(jnp.int32), lambda v: v @ w,
                            lambda v: -(v @ w) ** 2, xi)
        return lax.switch(jnp.argmax(xi), [lambda: xi @ w, lambda: jnp.cos(xi @ w),
                                           lambda: 2.0 * xi @ w], )

    def loss(w, x):
        return jnp.mean(jax.vmap(lambda xi: pick(xi, w))(x) ** 2)
    rng = np.random.default_rng(5)
    x = rng.normal(size=(4 * n, 3)).astype(np.float32)
    w = (0.5 * rng.normal(size=(3, 3))).astype(np.float32)
    got = rt.replicate(lambda w, x: jax.grad(loss)(w, x), num_replicas=n)(w, rt.distribute(x, n))
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(jax.grad(loss))(w, x)),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["plain", "regularized", "used_twice", "shared_regularizer",
                                  "sliced", "jnp_where", "jnp_pad", "concat", "dynamic_slice",
                                  "checkpointed_slice", "concat_with_zeros", "conv",
                                  "set_zero", "gathered", "barrier", "conv_then_loop"])
def test_float16_mean_gradient_does_not_overflow_in_its_sum(case):
    """A float16 weight under a 2**15 loss scale on 4 replicas: each replica's gradient
    (and the mean) is finite, the sum of four is not. The gradient all-reduce takes the
    mean (the division moved below the sum, also past a mirrored regularizer's gradient
    added to it), so the result is ``jax.jit``'s on the global batch (before: inf). With
    the loss scale on a regularizer of two weights (haiku's ImageNet example with
    weight decay), the sum over replicas of its seed (4 x 32768) overflowed before it
    met the weights: the mean is taken there too. A sliced weight's gradient is the
    sum padded with zeros (the transpose of the slice): the mean moves below the pad,
    below an update of zeros (a ``dynamic_slice``'s), a split (a ``concatenate``'s) and
    through a ``jnp`` function JAX jits (``jnp.where``, ``jnp.pad``: the call is inlined;
    before, these kept the float16 sum: inf), and below every op the sum's deferral takes
    as linear: a convolution with a mirrored kernel, a write of zeros, a gather's
    transpose (a scatter-add into zeros), an ``optimization_barrier`` (before: inf; found
    by the fuzzer, a conv kernel ahead of a loop)."""
    n = 4
    uses = {"used_twice": lambda x, w: x * w + 0.5 * (x * w),
            "sliced": lambda x, w: x * w[:3],
            "jnp_where": lambda x, w: x * jnp.where(jnp.arange(3) < 2, w, jnp.float16(0)),
            "jnp_pad": lambda x, w: x * jnp.pad(w, (0, 1))[1:],
            "concat": lambda x, w: x * jnp.concatenate([w, w])[2:5],
            "dynamic_slice": lambda x, w: x * lax.dynamic_slice_in_dim(w, 1, 3),
            "checkpointed_slice": lambda x, w: x * jax.checkpoint(lambda w: w[1:])(w),
            "concat_with_zeros": lambda x, w: x * jnp.concatenate([w, jnp.zeros_like(w)])[1:4],
            "conv": lambda x, w: x * lax.conv_general_dilated(
                w[None, None], jnp.array([1.0, -0.5], jnp.float16)[None, None], (1,),
                "SAME")[0, 0],
            "set_zero": lambda x, w: x * w.at[1].set(0),
            "gathered": lambda x, w: x * w[jnp.array([0, 2, 2])],
            "barrier": lambda x, w: x * lax.optimization_barrier(w),
            "conv_then_loop": lambda x, w: conv_then_loop(x, w)}

    def conv_then_loop(x, w):  # the fuzzer's case: two sums added, then the conv's transpose
        v = uses["conv"](jnp.float16(1), w)
        rows = lax.scan(lambda c, xi: (c, v * xi), 0, x[:, 0])[1]  # per example
        return x * (v + rows)

    def loss(p, x):
        w, v = p
        y = uses.get(case, lambda x, w: x * w)(x, w)
        total = jnp.mean(y) + jnp.mean(x * v)
        if case == "regularized":
            total = total + jnp.sum(w * w) * jnp.float16(1e-3)
        if case == "shared_regularizer":
            total = total + (jnp.sum(w * w) + jnp.sum(v * v)) * jnp.float16(1e-3)
        return total * jnp.float16(2.0 ** 15)
    p = (jnp.ones((4 if case in ("sliced", "dynamic_slice", "checkpointed_slice") else 3,),
                  jnp.float16),
         jnp.full((3,), 0.5, jnp.float16))
    x = np.full((8, 3), 1.5 if case != "used_twice" else 1.0, np.float16)
    got = rt.replicate(lambda p, x: jax.grad(loss)(p, x), num_replicas=n)(p, rt.distribute(x, n))
    want = jax.jit(jax.grad(loss))(p, x)
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(g, np.float32)).all()
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-3)


def test_float16_mean_below_a_gather_of_summed_pieces():
    """Float16 weights under "mean" on 4 replicas, scatter-added into rows (at constant
    indices) then mapped in batches of two (``lax.map(batch_size=2)``) with a per-replica
    mask: the gradient is two sums (the batches' and the rest's) added, then gathered
    (the scatter-add's transpose); the mean moves below the gather too (before: the sum
    of four 20000s in float16, inf, where ``jax.jit`` on the global batch gives 20000;
    found by the fuzzer)."""
    n, f16 = 4, jnp.float16

    def chain(v, m):
        rows = jnp.zeros((3, 6), f16).at[jnp.array([1, 2, 2, 1])].add(v)
        return lax.map(lambda r: jnp.where(m[0] > 0, r, 0), rows, batch_size=2)

    def loss(w, x):
        return jnp.sum(chain(w, (x[:1] > 0).astype(f16)) * x.astype(f16)).astype(jnp.float32)
    w = jnp.ones((4, 6), f16)
    x = np.full((n, 3, 6), 20000.0, np.float32)
    want = jax.jit(jax.grad(lambda w: sum(loss(w, x[r]) for r in range(n)) / n))(w)
    got = rt.replicate(jax.grad(loss), num_replicas=n, loss_reduction="mean")(
        w, rt.distribute(x.reshape(n * 3, 6), n))
    assert np.all(np.isfinite(np.asarray(want, np.float32)))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_mean_of_parts_is_a_float16_mean_that_does_not_overflow():
    """``compiler.lower._mean_of_parts``: the all-reduce ``mean`` of float16 values where
    they are not widened (off CPU) divides each part by N before the sum, so four of
    30000 give 30000 where ``lax.pmean`` (sum first) gives inf."""
    from jax.sharding import Mesh, PartitionSpec as P

    from compiler.lower import _mean_of_parts
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("r",))
    x = np.full((4, 3), 30000.0, np.float16)

    def run(fn):
        return np.asarray(jax.jit(jax.shard_map(lambda v: fn((v,), "r")[0], mesh=mesh,
                                                in_specs=P("r"), out_specs=P("r")))(x))
    np.testing.assert_array_equal(run(_mean_of_parts), x)
    assert np.isinf(run(lambda xs, a: (lax.pmean(xs[0], a),))).all()


def test_gradient_with_allow_int_gives_float0_like_jax_jit():
    """``jax.grad(..., allow_int=True)`` with respect to an integer input: its gradient is
    ``float0`` zeros, mirrored, and the float gradient beside it is reduced as usual
    (oracle: ``jax.jit`` on the global batch). Before, the float0 dtype was unknown to
    the IR (an ``IRTypeError``)."""
    n = 2

    def step(w, k, x):
        def loss(w, k):
            return jnp.mean((x @ w) ** 2) * k
        gw, gk = jax.grad(loss, argnums=(0, 1), allow_int=True)(w, k)
        return w - 0.1 * gw, gk
    w, k = jnp.ones((4, 2)), jnp.int32(3)
    x = np.arange(32, dtype=np.float32).reshape(8, 4) / 10
    (got_w, got_k), (want_w, want_k) = (rt.replicate(step, num_replicas=n)(w, k, rt.distribute(x, n)),
                                        jax.jit(step)(w, k, x))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=1e-5)
    assert got_k.dtype == want_k.dtype == jax.dtypes.float0 and got_k.shape == want_k.shape


def _identity_with_backward(bwd):
    """``w -> w`` as a ``custom_vjp`` whose backward function is ``bwd(g, w)``."""
    @jax.custom_vjp
    def through(w):
        return w
    through.defvjp(lambda w: (w, w), lambda w, g: (bwd(g, w),))
    return through


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
@pytest.mark.parametrize("name", ["clip", "times_primal"])
def test_custom_vjp_of_a_mirrored_weight_under_checkpoint(name, policy):
    """A ``custom_vjp`` applied to a mirrored weight inside ``jax.checkpoint``: its
    backward function runs on each replica's own cotangent, as without the checkpoint
    (oracle: c·∇ Σ_r L_r on one device). Before, the checkpoint staged the function
    first and JAX refused its forward rule's per-replica output ("Custom VJP fwd rule
    ... must produce a pair"), then the staged cast of that output to per-replica."""
    n = 4
    through = _identity_with_backward(_BACKWARDS[name])
    pol = None if policy is None else getattr(jax.checkpoint_policies, policy)

    def loss(w, x):
        return jnp.mean(jax.checkpoint(lambda w: jnp.tanh(x @ through(w)), policy=pol)(w) ** 2)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4 * n, 3)).astype(np.float32)
    w = (0.5 * rng.normal(size=3)).astype(np.float32)
    got = rt.replicate(jax.grad(loss), num_replicas=n)(w, rt.distribute(x, n))
    assert not isinstance(got, rt.PerReplica)
    want = jax.grad(lambda w: sum(loss(w, xr) for xr in np.split(x, n)))(w) / n
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_io_callback_and_stateful_rng_of_mirrored_operands_are_per_replica():
    """An ``io_callback`` runs once per replica and may answer each its own value (a host
    data source), and ``lax.rng_uniform`` draws per device, even when their operands are
    mirrored: their results are per replica, and the gradient of a mirrored weight
    through them is the mean over the replicas (oracle: pmap with ``pmean``, the host
    values recorded). Before, JAX's invariant typing made the loss one array holding one
    replica's value and the gradient that replica's own, unreduced (1.0 where it is 2.5)."""
    import itertools
    import threading
    from jax.experimental import io_callback
    n, lock, counter, seen = 4, threading.Lock(), itertools.count(1), []

    def host_value():
        with lock:
            seen.append(np.float32(next(counter)))
            return seen[-1]

    def step(w):
        def loss(w):
            return jnp.sum(w) * io_callback(host_value, jax.ShapeDtypeStruct((), jnp.float32))
        return jax.value_and_grad(loss)(w)
    loss, grad = rt.replicate(step, num_replicas=n)(np.ones(2, np.float32))
    jax.effects_barrier()
    assert sorted(seen) == [1.0, 2.0, 3.0, 4.0]
    assert isinstance(loss, rt.PerReplica)
    assert sorted(float(v) for v in loss.values) == [2.0, 4.0, 6.0, 8.0]
    np.testing.assert_allclose(np.asarray(grad), [np.mean(seen)] * 2)
    draws = rt.replicate(lambda w: w + lax.rng_uniform(0.0, 1.0, (3,)), num_replicas=n)(
        np.zeros(3, np.float32))
    assert isinstance(draws, rt.PerReplica)
    rows = np.stack([np.asarray(v) for v in draws.values])
    assert len({tuple(r) for r in rows}) == n and np.all((rows >= 0) & (rows < 1))


_ROUNDINGS = {  # name: (loss of (w, x), rows of x per replica, loss reduction)
    "bf16_master": (lambda w, x: jnp.sum(w.astype(jnp.bfloat16) * x.astype(jnp.bfloat16))
                    .astype(jnp.float32), [[256.0], [1.0]], "mean"),
    "f16_sum": (lambda w, x: jnp.sum(w.astype(jnp.float16) * x.astype(jnp.float16))
                .astype(jnp.float32), [[20000.0]] * 4, "sum"),
    "f8_round_trip": (lambda w, x: jnp.sum(w.astype(jnp.float8_e4m3fn).astype(jnp.float32) * x),
                      [[1.1], [1.2]], "sum"),
    "reduce_precision": (lambda w, x: jnp.sum(lax.reduce_precision(w, 4, 3) * x),
                         [[1.1], [1.2]], "sum"),
    "f16_slice_sum": (lambda w, x: jnp.sum(w.astype(jnp.float16)[:1] * x.astype(jnp.float16))
                      .astype(jnp.float32), [[20000.0]] * 4, "sum"),
    "bf16_scaled": (lambda w, x: jnp.sum(w.astype(jnp.bfloat16) * 2 * x.astype(jnp.bfloat16))
                    .astype(jnp.float32), [[256.0], [1.0]], "mean"),
    "f16_checkpoint": (lambda w, x: jnp.sum(jax.checkpoint(lambda v, h: h * v)(
        w.astype(jnp.float16), x.astype(jnp.float16))).astype(jnp.float32), [[20000.0]] * 4, "sum"),
    "bf16_jit": (lambda w, x: jnp.sum(jax.jit(lambda v, h: h * v)(
        w.astype(jnp.bfloat16), x.astype(jnp.bfloat16))).astype(jnp.float32),
        [[256.0], [1.0]], "mean"),
    # a jnp function (jitted by JAX) or a concatenate between the cast and its use
    "bf16_concat": (lambda w, x: jnp.sum(jnp.concatenate(
        [w.astype(jnp.bfloat16), w.astype(jnp.bfloat16)])[:1] * x.astype(jnp.bfloat16))
        .astype(jnp.float32), [[256.0], [1.0]], "mean"),
    "f16_concat_twice_sum": (lambda w, x: jnp.sum(jnp.concatenate(
        [w.astype(jnp.float16)] * 2) * x.astype(jnp.float16)).astype(jnp.float32),
        [[20000.0]] * 4, "sum"),
    "f16_jnp_pad_sum": (lambda w, x: jnp.sum(jnp.pad(w.astype(jnp.float16), (0, 1))[:1]
                                             * x.astype(jnp.float16)).astype(jnp.float32),
                        [[20000.0]] * 4, "sum"),
    "f16_where_sum": (lambda w, x: jnp.sum(jnp.where(x > 0, w.astype(jnp.float16),
                                                     jnp.float16(0)) * x.astype(jnp.float16))
                      .astype(jnp.float32), [[20000.0]] * 4, "sum"),
    "bf16_cumsum": (lambda w, x: jnp.sum(jnp.cumsum(w.astype(jnp.bfloat16)) * x.astype(
        jnp.bfloat16)).astype(jnp.float32), [[256.0], [1.0]], "mean"),
    # the cast inside a call, branch or loop whose inputs are all mirrored (the weight's
    # own computation), its float32 result meeting the replicas' data after it: the sum
    # goes into the call's backward pass before the cast there
    "f16_cast_inside_jit": (lambda w, x: jnp.sum(_halved_twice(jax.jit)(w) * x),
                            [[20000.0]] * 4, "sum"),
    "f16_cast_inside_checkpoint": (lambda w, x: jnp.sum(_halved_twice(jax.checkpoint)(w) * x),
                                   [[20000.0]] * 4, "mean"),
    "f16_cast_inside_cond": (lambda w, x: jnp.sum(lax.cond(
        w[0] > 0, _halved_twice(lambda f: f), lambda v: v, w) * x), [[20000.0]] * 4, "sum"),
    "f16_cast_inside_scan": (lambda w, x: jnp.sum(lax.scan(
        lambda c, _: (c + _halved_twice(lambda f: f)(w), None), jnp.zeros_like(w), None,
        length=1)[0] * x), [[20000.0]] * 4, "sum"),
    "f16_cast_inside_fori_loop": (lambda w, x: jnp.sum(lax.fori_loop(
        0, 1, lambda i, c: c + _halved_twice(lambda f: f)(w), jnp.zeros_like(w)) * x),
        [[20000.0]] * 4, "sum"),
    # max pooling of the cast weight (its gradient: a select-and-scatter, linear in the
    # cotangent; found by a probe)
    "f16_max_pooled": (lambda w, x: jnp.sum(lax.reduce_window(
        jnp.concatenate([w, w * 0.5]).astype(jnp.float16), -jnp.inf, lax.max, (2,), (1,),
        "VALID") * x.astype(jnp.float16)).astype(jnp.float32), [[20000.0]] * 4, "sum"),
    "bf16_cast_inside_jit": (lambda w, x: jnp.sum(jax.jit(
        lambda v: (v.astype(jnp.bfloat16) * v.astype(jnp.bfloat16)).astype(jnp.float32))(w)
        * x), [[256.0], [1.0]], "mean"),
}


def _halved_twice(wrap):
    """``wrap`` of a function casting its operand to float16 and doubling it there."""
    return wrap(lambda v: (v.astype(jnp.float16) * jnp.float16(2)).astype(jnp.float32))


@pytest.mark.parametrize("name", sorted(_ROUNDINGS))
def test_low_precision_cotangents_are_rounded_per_replica_then_summed(name):
    """A mirrored float32 weight cast to a low-precision type inside the step (mixed
    precision), or rounded by ``reduce_precision``: each replica rounds its own
    cotangent and the replicas' float32 gradients are summed, as pmap code (oracle:
    pmap with ``psum``, then the reduction) and TF compute. Before, the all-reduce ran on
    the low-precision cotangent: in bfloat16 257 rounded to 256 (128.0 where pmap gives
    128.5), in float16 4 × 20000 overflowed to inf (pmap: 80000). Also with the cast
    outside a ``jax.checkpoint``/``jax.jit`` layer (jmp's pattern: the sum is returned
    by the call, then moved out of it), a constant factor between cast and use, and a
    ``jnp`` function there, jitted by JAX (``jnp.pad``, ``where``, ``cumsum``: the call is
    inlined), or a ``concatenate`` (its transpose splits the sum; before, each of those
    kept the sum in the narrow type); a ``lax.scan`` between them:
    ``test_low_precision_sums_follow_linear_ops_to_the_cast``. And with the cast inside a
    ``jax.jit``, ``jax.checkpoint``, ``cond`` or loop of mirrored inputs only (``*_inside_*``):
    the backward pass casts the summed float32 cotangent there, after the sum (inf in
    float16 where pmap gives 160000; bfloat16 rounding of the sum)."""
    loss, rows, reduction = _ROUNDINGS[name]
    x = np.asarray(rows, np.float32)
    n, w = len(rows), jnp.ones((2 if "slice" in name else 1,), jnp.float32)
    step = rt.replicate(jax.grad(loss), num_replicas=n, loss_reduction=reduction)
    got = step(w, rt.distribute(x, n))
    summed = jax.pmap(lambda a: lax.psum(jax.grad(loss)(w, a[None]), "i"), axis_name="i")(x)[0]
    want = summed / n if reduction == "mean" else summed
    assert np.all(np.isfinite(np.asarray(want)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    reduces = [op for op, _ in step.lower(w, rt.distribute(x, n)).ir().walk()
               if op.name == "all_reduce"]
    assert [r.results[0].type.dtype for r in reduces] == ["float32"]


_CHAINS = {  # name: what the step does with a float32 weight cast to a narrow type
    "fused_qkv_in_checkpoint": lambda v, x: jax.checkpoint(lambda v, x: x @ v[:, :4])(v, x),
    "transposed_slice_in_jit": lambda v, x: jax.jit(lambda v, x: x @ v.T[:4].T)(v, x),
    "checkpoint_of_the_weight": lambda v, x: x @ jax.checkpoint(lambda v: v[:, :4] * 2)(v),
    "used_twice": lambda v, x: x @ (v + jnp.flip(v, 0))[:, :4],
    "times_3_plus_itself": lambda v, x: x @ (v * 3 + v)[:, :4],
    "centred": lambda v, x: x @ (v - v.mean(1, keepdims=True))[:, :4],
    "sum_keepdims": lambda v, x: x @ jnp.broadcast_to(jnp.sum(v, 1, keepdims=True), (6, 4)),
    "float8_round_trip_sliced": lambda v, x: x @ v.astype(jnp.float8_e4m3fn).astype(v.dtype)[:, :4],
    "concat_with_zeros": lambda v, x: x @ jnp.concatenate([v, jnp.zeros_like(v)], 1)[:, 2:6],
    "scaled_then_sliced": lambda v, x: x @ (v * 2)[:, :4],
    # a scan between the cast and the use (the replicas' data read after it, so the
    # cotangent the backward scan takes is already summed): over the weight's rows (a scan
    # over layers), over pieces stacked, closing over it, a fori_loop, a carry scaled (the
    # backward scan is linear in the cotangent; a carry sums the steps' cotangents from zero)
    "scan_over_rows": lambda v, x: x[:, :4] * lax.scan(
        lambda c, w: (c + w, None), jnp.zeros((4,), v.dtype), v[:, :4])[0],
    "scan_over_stacked_pieces": lambda v, x: lax.scan(
        lambda c, w: (c + x @ w, None), jnp.zeros((1, 4), v.dtype),
        jnp.stack([v[:, :4], v[:, 2:]]))[0],
    "scan_closing_over_it": lambda v, x: x[:, :4] * lax.scan(
        lambda c, _: (c + v[0, :4], None), jnp.zeros((4,), v.dtype), None, length=2)[0],
    "fori_loop_closing_over_it": lambda v, x: x[:, :4] * lax.fori_loop(
        0, 2, lambda i, c: c + v[0, :4], jnp.zeros((4,), v.dtype)),
    "scan_carry_scaled": lambda v, x: x[:, :4] * lax.scan(
        lambda c, _: (c * c.dtype.type(2), None), v[0, :4], None, length=2)[0],
    # indexed at indices identical on every replica (a positional embedding; ``v[i]`` in
    # a loop), under a cond on a mirrored flag, windowed, convolved with a mirrored kernel
    # (their transposes: a scatter-add into zeros, a cond, a pad, a convolution)
    "gathered_rows": lambda v, x: x @ v[jnp.arange(3)].T,
    "taken_columns": lambda v, x: x @ jnp.take(v, jnp.asarray([1, 3, 4, 5]), axis=1),
    "indexed_in_fori_loop": lambda v, x: x[:, :4] * lax.fori_loop(
        0, 3, lambda i, c: c + v[i, :4], jnp.zeros((4,), v.dtype)),
    "taken_in_scan": lambda v, x: x[:, :4] * lax.scan(  # (jnp.take: a jit, a scatter-add)
        lambda c, i: (c + jnp.take(v[:, :4], i, axis=0), None), jnp.zeros((4,), v.dtype),
        jnp.arange(3))[0],
    "cond_on_a_mirrored_flag": lambda v, x: x @ lax.cond(
        v[0, 0] > 0, lambda u: u * u.dtype.type(2), lambda u: u, v),
    "reduce_window": lambda v, x: x[:, :5] @ lax.reduce_window(
        v, v.dtype.type(0), lax.add, (2, 1), (1, 1), "VALID"),
    "convolved": lambda v, x: x[:, :5] @ jax.scipy.signal.convolve(
        v, jnp.ones((2, 1), v.dtype), mode="valid"),
    # written into (a row zeroed or scaled, a slice overwritten: the transposes write
    # zeros into the cotangent or scale it), loops in loops, a loop in a cond, a branch
    # of a cond on a mirrored flag reading the replica's data (its sum in the branch)
    "row_zeroed": lambda v, x: x @ v.at[5].set(0)[:, :4],
    "row_scaled": lambda v, x: x @ v.at[1].multiply(2)[:, :4],
    "slice_overwritten": lambda v, x: x @ lax.dynamic_update_slice(
        v, jnp.zeros((6, 1), v.dtype), (0, 5))[:, :4],
    "scan_in_scan": lambda v, x: x[:, :4] * lax.scan(lambda c, w: (c + lax.scan(
        lambda d, _: (d + w, None), jnp.zeros_like(w), None, length=2)[0], None),
        jnp.zeros((4,), v.dtype), v[:, :4])[0],
    "scan_in_cond": lambda v, x: x[:, :4] * lax.cond(
        v[0, 0] > 0, lambda u: lax.scan(lambda c, w: (c + w, None), jnp.zeros((4,), u.dtype),
                                        u[:, :4])[0], lambda u: u[0, :4], v),
    "cond_branch_reads_the_data": lambda v, x: lax.cond(
        v[0, 0] > 0, lambda u: x @ u[:, :4], lambda u: u[:1, :4], v),
    # behind an optimization barrier (layout annotations: the test after this one)
    "optimization_barrier": lambda v, x: x @ lax.optimization_barrier(v)[:, :4],
}


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", sorted(_CHAINS))
def test_low_precision_sums_follow_linear_ops_to_the_cast(name, low):
    """A float32 weight cast to bfloat16/float16 in the step, then sliced, scaled, used
    twice, centred, reduced, round-tripped through float8 or concatenated, inside a
    ``jax.checkpoint``/``jax.jit`` layer or outside, or scanned over (a scan over the
    stacked layers, one closing over the weight, a ``fori_loop``: the backward scan runs
    on each replica's cotangent, and the sum follows it), gathered at mirrored indices
    (a positional embedding), indexed in a loop, under a ``cond`` on a mirrored flag,
    windowed or convolved with a mirrored kernel: every replica rounds its own
    cotangent and the float32 gradients are summed (pmap's numbers, exactly: bf16
    cotangents 256 and 1 summed to 257, eight float16 cotangents of 10000 to 80000). The
    sum is deferred through the ops linear in it to where pmap code sums (found by a
    random-program fuzzer: before, these kept it in the narrow type, 256 or inf)."""
    dtype = jnp.dtype(low)
    n = 2 if low == "bfloat16" else 8
    w = jnp.asarray(np.linspace(0.5, 1.5, 36).reshape(6, 6), jnp.float32)
    if low == "bfloat16":
        x = np.ones((n, 1, 6), np.float32)
        x[0] *= 256.0
    else:  # (row 0's cotangents: 10000 a replica, finite; eight of them are not in float16.
        # float8 e4m3 ends at 448: its round trip rounds cotangents of 100 instead)
        x = np.zeros((n, 1, 6), np.float32)
        x[:, :, 0] = 100.0 if "float8" in name else 10000.0

    def loss(w, x):
        return jnp.sum(_CHAINS[name](w.astype(dtype), x.astype(dtype))).astype(jnp.float32)
    got = rt.replicate(jax.grad(loss), num_replicas=n, loss_reduction="sum")(
        w, rt.distribute(x.reshape(n, 6), n))
    want = jax.pmap(lambda x: lax.psum(jax.grad(loss)(w, x), "i"), axis_name="i")(x)[0]
    assert np.all(np.isfinite(np.asarray(want)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("annotation", ["split", "assign", "replicate"])
def test_low_precision_sums_follow_an_annotation_of_the_cast_weight(annotation, low):
    """The bfloat16/float16 copy of a float32 weight split over (or assigned to one of, or
    replicated to) a replica's two logical devices: annotations change no number, so the replicas'
    narrow cotangents are each cast back and summed in float32, as pmap of the
    unannotated step gives them (found by a probe: the sum stayed narrow, a row-parallel
    bf16 MLP off by up to 1.93; float16 "mean" inf where pmap gives 20000)."""
    dtype, n = jnp.dtype(low), 2
    ann = {"split": lambda v: rt.split_to_logical_devices(v, [1, 2]),
           "assign": lambda v: rt.assign_to_logical_device(v, 1),
           "replicate": rt.replicate_to_logical_devices}[annotation]

    def loss(w, x, annotate=True):
        v = w.astype(dtype)
        return jnp.sum((x.astype(dtype) @ (ann(v) if annotate else v)).astype(jnp.float32))
    w = jnp.zeros((1, 2), jnp.float32)
    x = np.asarray([[[256.0]], [[1.0]]] if low == "bfloat16" else [[[20000.0]]] * n, np.float32)
    reduction = "sum" if low == "bfloat16" else "mean"
    got = rt.replicate(jax.grad(loss), num_replicas=n, logical_devices=2,
                       loss_reduction=reduction)(w, rt.distribute(x.reshape(n, 1), n))
    red = lax.psum if reduction == "sum" else lax.pmean
    want = jax.pmap(lambda x: red(jax.grad(lambda w: loss(w, x, False))(w), "i"),
                    axis_name="i", devices=jax.devices()[:n])(x)[0]
    assert np.all(np.isfinite(np.asarray(want)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("form", ["jvp_of_grad", "linearize_of_grad", "grad_of_vdot",
                                  "hutchinson"])
def test_hessian_vector_product_along_a_per_replica_tangent(form, reduction):
    """A Hessian-vector product at mirrored weights along each replica's own vector (a
    random probe per replica, Hutchinson's trace estimate): the gradient inside is the
    reduced one (``c·∇Σ_r L_r``), so the product is ``c·Σ_r H_r t_r`` and the gradient
    beside it the reduced gradient, pmap's numbers with the ``pmean``/``psum`` where a
    data-parallel user puts it, after the gradient (oracle). Before, ``jax.jvp`` cast the
    weights to per-replica to match the tangent, so the gradient inside was each
    replica's own and nothing was all-reduced (Hutchinson's estimate 0.20 where pmap
    gives -0.11), and ``jax.linearize``'s function refused the per-replica tangent."""
    n, d = 4, 4
    rng = np.random.default_rng(3)
    w = (rng.normal(size=(d,)) * .5).astype(np.float32)
    x = rng.normal(size=(4 * n, d)).astype(np.float32)
    t = np.sign(rng.normal(size=(n, d))).astype(np.float32)  # Rademacher probes
    red = lax.pmean if reduction == "mean" else lax.psum

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 4)

    def program(reduce):  # the step; ``reduce`` follows every gradient w.r.t. the weights
        def grad(f):
            return lambda q: reduce(jax.grad(f)(q))

        def step(w, x, t):
            g = grad(lambda q: loss(q, x))
            if form == "grad_of_vdot":
                return g(w), grad(lambda q: jnp.vdot(g(q), t))(w)
            if form == "linearize_of_grad":
                gw, lin = jax.linearize(g, w)
                return gw, lin(t)
            gw, hv = jax.jvp(g, (w,), (t,))
            return (gw, hv) if form == "jvp_of_grad" else (gw, jnp.vdot(t, hv))
        return step
    replicated = program(lambda g: g)
    got = rt.replicate(lambda w, x, t: replicated(w, x, t[0]), num_replicas=n,
                       loss_reduction=reduction)(w, rt.distribute(x, n), rt.distribute(t, n))
    want = jax.pmap(program(lambda g: red(g, "i")), "i", in_axes=(None, 0, 0))(
        w, x.reshape(n, 4, d), t)
    for g, ref in zip(got, want):
        vals = np.stack([np.asarray(v) for v in g.values]) if isinstance(g, rt.PerReplica) \
            else np.broadcast_to(np.asarray(g), ref.shape)
        np.testing.assert_allclose(vals, np.asarray(ref), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("seed", ["jnp", "python"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_vjp_seed_identical_on_every_replica_for_a_per_replica_output(reduction, seed):
    """pmap code seeds a pullback with a constant (``pb(2.0)``) for an output that
    differs between replicas: each replica pulls back that value, and the gradient of
    the mirrored weight is reduced as ``loss_reduction`` says (oracle: pmap with
    ``pmean`` / ``psum`` of the per-replica gradients). Before, JAX refused the seed's
    type (``unexpected JAX type ... expected float32[]{V:replica}``)."""
    n = 4
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) / 10
    w = jnp.ones(3, jnp.float32)
    c = jnp.float32(2.0) if seed == "jnp" else 2.0

    def step(w, x):
        _, pb = jax.vjp(lambda w: jnp.sum(x @ w), w)
        return pb(c)[0]
    got = rt.replicate(step, num_replicas=n, loss_reduction=reduction)(w, rt.distribute(x, n))
    red = lax.pmean if reduction == "mean" else lax.psum
    want = jax.pmap(lambda x: red(step(w, x), "i"), axis_name="i")(x.reshape(n, 2, 3))[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


_IDENTICAL_BACKWARDS = {
    "pmean": lambda g, w: lax.pmean(g, "i"),
    "psum": lambda g, w: lax.psum(g, "i"),
    "ones": lambda g, w: jnp.ones_like(w),
    "residual": lambda g, w: 0.1 * w,
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(_IDENTICAL_BACKWARDS))
def test_custom_vjp_backward_identical_on_every_replica_counts_once_per_replica(name, reduction):
    """A ``custom_vjp`` of a mirrored weight whose backward function returns a value
    identical on every replica (``pmean(g)``, ``psum(g)``, a constant, a residual): each
    replica's backward function gave it, so the replicas' copies are added and the loss
    reduction applied, as for any other backward result (oracle: pmap of the same step
    with ``pmean`` / ``psum`` of its gradients). Before, one copy was kept: N× too small."""
    n = 4
    through = _identity_with_backward(_IDENTICAL_BACKWARDS[name])

    def grad(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ through(w)) ** 2))(w)
    x = np.random.default_rng(0).normal(size=(n, 3, 2)).astype(np.float32)
    w = np.full((2, 2), 0.5, np.float32)
    got = rt.replicate(grad, num_replicas=n, axis_name="i", loss_reduction=reduction)(
        w, rt.PerReplica(list(x)))
    red = lax.pmean if reduction == "mean" else lax.psum
    want = jax.pmap(lambda w, x: red(grad(w, x), "i"), "i", in_axes=(None, 0))(w, x)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_custom_vjp_backward_that_differentiates_its_residuals(reduction):
    """A ``custom_vjp`` whose backward function is ``jax.vjp(f, *residuals)[1](g)`` with a
    mirrored weight among the residuals (a layer reusing JAX's own derivative): each
    replica's backward gives its own cotangent, added once over the replicas (oracle:
    pmap with ``pmean`` / ``psum``). Before: N times that (the inner vjp summed the
    mirrored residual's cotangent over the replicas, and the backward's result was summed
    again; found by a probe)."""
    n = 4

    def mul(x, w):
        return jnp.tanh(x @ w)

    @jax.custom_vjp
    def layer(x, w):
        return mul(x, w)
    layer.defvjp(lambda x, w: (mul(x, w), (x, w)), lambda res, g: jax.vjp(mul, *res)[1](g))

    def grad(w, x):
        return jax.grad(lambda w: jnp.sum(layer(x, w) ** 2))(w)
    x = np.random.default_rng(0).normal(size=(n, 3, 2)).astype(np.float32)
    w = np.full((2, 2), 0.5, np.float32)
    got = rt.replicate(grad, num_replicas=n, loss_reduction=reduction)(w, rt.PerReplica(list(x)))
    red = lax.pmean if reduction == "mean" else lax.psum
    want = jax.pmap(lambda w, x: red(grad(w, x), "i"), "i", in_axes=(None, 0))(w, x)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("how", ["vjp", "linear_transpose"])
def test_vjp_of_a_mirrored_function_seeded_per_replica(how, reduction):
    """``jax.vjp(f, w)`` (or ``jax.linear_transpose``) of a mirrored ``w`` (its output
    identical on every replica) pulled back with the replica's own data: the global
    program's seed is the replicas' sum, and the gradient of ``w`` is reduced as
    ``loss_reduction`` says (oracle: pmap with ``pmean`` / ``psum`` of the per-replica
    pullbacks). Before, JAX refused the seed's type (``expected float32[2,2]``, got a
    per-replica one)."""
    n = 4
    x = np.random.default_rng(0).normal(size=(n, 2, 2)).astype(np.float32)
    w = np.ones((2, 2), np.float32)

    def pull(w, x):
        if how == "linear_transpose":
            return jax.linear_transpose(lambda v: 2.0 * v, w)(x)[0]
        _, vjp = jax.vjp(jnp.tanh, w)
        return vjp(x)[0]
    got = rt.replicate(pull, num_replicas=n, loss_reduction=reduction)(w, rt.PerReplica(list(x)))
    assert not isinstance(got, rt.PerReplica)
    red = lax.pmean if reduction == "mean" else lax.psum
    want = jax.pmap(lambda w, x: red(pull(w, x), "i"), "i", in_axes=(None, 0))(w, x)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


_PER_REPLICA_CONDS = {  # name: f(w, x) with a branch chosen per replica on the data
    "cond_id_or_neg": lambda w, x: lax.cond(x[0, 0] > 0, lambda v: v, lambda v: -v, w) * x,
    "cond_2v_or_3v": lambda w, x: lax.cond(x[0, 0] > 0, lambda v: 2 * v, lambda v: 3 * v, w) * x,
    "switch_zero_or_w": lambda w, x: x @ jnp.diag(lax.switch(
        (x[0, 0] > 0).astype(jnp.int32), [lambda: w * 0, lambda: w])),
    "cond_closes_over_w": lambda w, x: lax.cond(x[0, 0] > 0, lambda: w, lambda: -w) * x,
    "stochastic_depth": lambda w, x: x + lax.cond(x[0, 0] > 0, lambda h: h * w,
                                                  jnp.zeros_like, x),
    # both branches mask the weight (the mask, a residual each branch computes alike, is
    # the same on every replica: before, typed per-replica, a DivergentCollectiveError)
    "switch_masked": lambda w, x: lax.switch(
        (x[0, 0] > 0).astype(jnp.int32), [lambda v: jnp.where(jnp.arange(3) % 2 == 0, v, 0),
                                          lambda v: jnp.where(jnp.arange(3) % 2 == 0, v, 0) * .5],
        w) * x,
    # two of three branches mask by the weight itself, one is the identity: the mask, a
    # residual one branch does not compute, is typed per-replica (zeros there); it is
    # still each branch's own, the same on every replica that runs it
    "switch_masked_by_the_weight_or_identity": lambda w, x: lax.switch(
        (x[0, 0] > 0).astype(jnp.int32) * 2, [lambda v: jnp.where(w > 1.0, v, 0),
                                              lambda v: jnp.where(w > 1.0, v, 0) * .5,
                                              lambda v: v], w) * x,
    # gathered at constant indices each branch's closure passes separately
    "cond_gathered": lambda w, x: lax.cond(x[0, 0] > 0, lambda v: v[jnp.array([2, 0, 1])],
                                           lambda v: v[jnp.array([2, 0, 1])] * .5, w) * x,
    # a per-replica value (from an earlier cond, a scan's carry, the data) as the operand
    # and the weight closed over: the transposed branch sums its cotangent for the weight
    # and passes the same cotangent on to the operand; that pass-on is no sum (before: it
    # was taken for one, a DivergentCollectiveError; found by a probe)
    "two_conds_in_a_row": lambda w, x: lax.cond(
        x[0, 1] > 0, lambda c: c * 1.1 + w, jnp.sin,
        lax.cond(x[0, 0] > 0, lambda c: c * 1.1 + w, jnp.sin, w)) * x,
    "cond_in_a_scan": lambda w, x: lax.scan(
        lambda c, xi: (lax.cond(xi > 0, lambda c: c * 1.1 + w, jnp.sin, c), None),
        w, x[0])[0] * x,
    "cond_on_data_and_weight": lambda w, x: lax.cond(
        x[0, 0] > 0, lambda c: c * 1.1 + w, lambda c: jnp.zeros_like(c) + 2.0,
        jnp.tanh(x[0] * w)) * x,
}


@pytest.mark.parametrize("name", sorted(_PER_REPLICA_CONDS))
def test_a_branch_chosen_per_replica_on_mirrored_weights(name):
    """A ``lax.cond``/``switch`` whose predicate differs between replicas, applied to a
    mirrored weight: each replica transposes its own branch, then the gradients are
    summed (pmap's numbers, and the sum of each replica's ``jax.grad``). Before, JAX
    typed the cond's result mirrored (jax-ml/jax#40823), so the replicas' cotangents
    were summed before the branches: a per-replica gradient [2, -2] where the sum is 4
    (found by a fuzzer). The forward results differ per replica and come back so."""
    f, n = _PER_REPLICA_CONDS[name], 2
    w = jnp.asarray([1.0, 2.0, 0.5], jnp.float32)
    x = np.asarray([[3.0, 3, 3], [-1, -1, -1]], np.float32)  # replica 0 true, 1 false

    def loss(w, x):
        return jnp.sum(f(w, x))
    got = rt.replicate(jax.grad(loss), num_replicas=n, loss_reduction="sum")(
        w, rt.distribute(x, n))
    want = jax.pmap(lambda x: lax.psum(jax.grad(loss)(w, x), "i"), axis_name="i",
                    devices=jax.devices()[:n])(x[:, None])[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(want), sum(jax.grad(loss)(w, x[r:r + 1])
                                                     for r in range(n)), rtol=1e-5)
    out = rt.replicate(f, num_replicas=n)(w, rt.distribute(x, n))
    assert isinstance(out, rt.PerReplica)
    for r in range(n):
        np.testing.assert_allclose(np.asarray(out.values[r]), f(w, x[r:r + 1]), rtol=1e-6)


def test_a_checkpointed_jit_with_an_array_constant_over_a_float16_weight():
    """``jax.checkpoint(jax.jit(f))`` where ``f`` gathers a float16 weight at constant
    indices and round-trips it through float8: the deferral inlines the ``jax.jit`` into
    the checkpoint's region (a narrow gradient sum reads it), which then holds the
    indices as an array constant, which the checkpoint primitive's open jaxpr cannot
    take (before: ``LoweringError: remat2: region ^0 captured constants``; found by the
    fuzzer). Numbers as ``jax.jit``'s on the global batch."""
    n = 2
    inner = jax.jit(lambda v: jnp.take_along_axis(v, jnp.array([[2, 3, 1]]), axis=0)
                    .astype(jnp.float8_e5m2).astype(jnp.float16))
    layer = jax.checkpoint(inner)

    def loss(w, x):
        return jnp.sum(layer(w[:, 1::2]) * x[0].astype(jnp.float16)).astype(jnp.float32)
    w = jnp.asarray(np.linspace(0.5, 2, 24).reshape(4, 6), jnp.float16)
    x = np.asarray([[[1.0, 2.0, 3.0]], [[4.0, 5.0, 6.0]]], np.float32)
    want = jax.jit(jax.grad(lambda w: sum(loss(w, x[r]) for r in range(n)) / n))(w)
    got = rt.replicate(jax.grad(loss), num_replicas=n)(w, rt.distribute(x[:, 0], n))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.any(np.asarray(want) != 0)


def test_a_branch_per_replica_returning_large_constants_that_differ_in_the_middle():
    """Branches that return constants equal but for one element in the middle (where
    NumPy's ``repr`` elides a large array): the result stays per-replica (the replication
    pass compares constants by their bytes when it keeps a result of a per-replica cond
    mirrored because every branch computes it alike)."""
    a = np.arange(2000, dtype=np.float32)
    b = a.copy()
    b[1000] = -5.0

    def f(x):
        return lax.cond(x[0, 0] > 0, lambda: jnp.asarray(a), lambda: jnp.asarray(b))[1000]
    out = rt.replicate(f, num_replicas=2)(rt.distribute(np.asarray([[1.0], [-1.0]], np.float32), 2))
    assert isinstance(out, rt.PerReplica)
    assert [float(v) for v in out.values] == [1000.0, -5.0]
