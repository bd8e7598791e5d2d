"""The public runtime API (DESIGN.md, "Public API contract") against numpy oracles."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt
from compiler.passes import DEFAULT_PIPELINE

N = 4


def _arange(*shape, scale=1.0):
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * scale
            - 3.0).astype(np.float32)


# -- PerReplica, distribute, reduce --------------------------------------------------------

def test_per_replica_container():
    pr = rt.PerReplica([1, 2, 3])
    assert pr.values == (1, 2, 3) and len(pr) == 3 and pr[1] == 2
    # unpacking would silently take the replicas for the items: refused (issue 11)
    with pytest.raises(TypeError, match=r"cannot be iterated or unpacked \(it holds 3 replicas"):
        a, b, c = pr


def test_distribute_snapshots_numpy_batches():
    """A loader that refills its batch buffer right after ``distribute`` (before or while
    the step runs) does not change the step's input: NumPy leaves are copied (before, the
    per-replica values were views of the buffer, and the executable read it after the
    call returned)."""
    buf = np.arange(8, dtype=np.float32).reshape(4, 2)
    batch = rt.distribute({"x": buf}, 2)
    buf[:] = -1.0
    np.testing.assert_array_equal(np.asarray(batch.values[1]["x"]), [[4.0, 5.0], [6.0, 7.0]])
    out = rt.replicate(lambda b: jnp.sum(b["x"]), num_replicas=2)(batch)
    assert [float(v) for v in out.values] == [6.0, 22.0]
    uneven = rt.distribute_uneven(buf, 3)  # (rows 2, 1, 1)
    buf[:] = 5.0
    np.testing.assert_array_equal(np.asarray(uneven.values[0]), [[-1.0, -1.0], [-1.0, -1.0]])


def test_distribute_splits_every_leaf_along_axis_0():
    x = _arange(8, 3)
    y = _arange(8)
    pr = rt.distribute({"x": x, "y": y}, N)
    assert isinstance(pr, rt.PerReplica) and len(pr.values) == N
    for r in range(N):
        np.testing.assert_array_equal(pr.values[r]["x"], x[2 * r:2 * r + 2])
        np.testing.assert_array_equal(pr.values[r]["y"], y[2 * r:2 * r + 2])


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_reduce_axis_none_and_axis_0(op):
    rng = np.random.RandomState(0)
    vals = [rng.randn(3, 2).astype(np.float32) for _ in range(N)]
    pr = rt.PerReplica(vals)
    stacked = np.stack(vals)
    np.testing.assert_allclose(rt.reduce(op, pr), getattr(np, op)(stacked, axis=0), rtol=1e-6)
    np.testing.assert_allclose(rt.reduce(op, pr, axis=0),
                               getattr(np, op)(np.concatenate(vals, 0), axis=0), rtol=1e-6)


def test_reduce_mean_axis_0_weighs_every_row():
    # unequal shards: the mean along axis 0 is over all rows, not a mean of means
    pr = rt.PerReplica([np.array([1.0, 2.0, 3.0]), np.array([10.0])])
    np.testing.assert_allclose(rt.reduce("mean", pr, axis=0), 4.0)


def test_reduce_pytree_and_bad_op():
    pr = rt.PerReplica([{"a": np.ones(2), "b": 1.0}, {"a": 3 * np.ones(2), "b": 5.0}])
    out = rt.reduce("sum", pr)
    np.testing.assert_allclose(out["a"], [4.0, 4.0])
    np.testing.assert_allclose(out["b"], 6.0)
    with pytest.raises(ValueError, match="prod"):
        rt.reduce("prod", pr)


# -- inside the step -----------------------------------------------------------------------

def test_replica_id_and_num_replicas():
    step = rt.replicate(lambda x: (rt.replica_id(), rt.num_replicas() * jnp.ones(()), x + rt.replica_id()),
                        num_replicas=N)
    rid, n, y = step(rt.distribute(np.zeros((N, 2), np.float32), N))
    assert isinstance(rid, rt.PerReplica) and [int(v) for v in rid.values] == list(range(N))
    assert not isinstance(n, rt.PerReplica) and float(n) == N
    for r in range(N):
        np.testing.assert_array_equal(y.values[r], np.full((1, 2), r, np.float32))


def test_collectives_outside_a_step_raise():
    with pytest.raises(RuntimeError, match="replicate"):
        rt.replica_id()
    with pytest.raises(RuntimeError, match="replicate"):
        rt.all_reduce(jnp.ones(2), "sum")


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_all_reduce(op):
    x = _arange(N * 2, 3, scale=0.7)
    step = rt.replicate(lambda a: rt.all_reduce(a, op), num_replicas=N)
    out = step(rt.distribute(x, N))
    assert isinstance(out, jax.Array), "an all-reduced result is mirrored: one array"
    want = getattr(np, op)(np.stack(np.split(x, N)), axis=0)
    np.testing.assert_allclose(out, want, rtol=1e-6)


@pytest.mark.parametrize("op", ["max", "min"])
@pytest.mark.parametrize("k", [1, 2])
def test_all_reduce_max_and_min_keep_a_replicas_nan(op, k):
    """A NaN on one replica is NaN in the max and min over replicas, as NumPy's over the
    stacked values (before: XLA:CPU's cross-device max kept the other operand, so replica
    0's 1.0 beat replica 1's NaN, as ``jax.pmap``'s ``pmax`` on CPU still does); bf16 and
    int values reduce as before."""
    x = np.array([[1.0, 2.0, -3.0], [np.nan, 5.0, np.nan], [0.5, -1.0, 4.0], [2.0, 0.0, 1.0]],
                 np.float32)
    step = rt.replicate(lambda a, b, c: (rt.all_reduce(a, op), rt.all_reduce(b, op),
                                         rt.all_reduce(c, op)),
                        num_replicas=N, logical_devices=k)
    got, got_bf16, got_int = step(rt.distribute(x, N), rt.distribute(x.astype(jnp.bfloat16), N),
                                  rt.distribute(np.arange(12, dtype=np.int32).reshape(4, 3), N))
    want = getattr(np, op)(x, axis=0, keepdims=True)  # (each replica holds one row)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(got_bf16, np.float32), want)
    np.testing.assert_array_equal(got_int, getattr(np, op)(np.arange(12).reshape(4, 3), 0,
                                                           keepdims=True))


def test_all_reduce_bad_op():
    step = rt.replicate(lambda a: rt.all_reduce(a, "prod"), num_replicas=2)
    with pytest.raises(ValueError, match="prod"):
        step(rt.distribute(np.ones((2, 2), np.float32), 2))


@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather(axis):
    x = _arange(N * 2, 3)
    out = rt.replicate(lambda a: rt.all_gather(a, axis), num_replicas=N)(rt.distribute(x, N))
    assert isinstance(out, jax.Array)
    np.testing.assert_array_equal(out, np.concatenate(np.split(x, N), axis=axis))


def test_all_to_all():
    vals = [_arange(N, 2) + 100 * r for r in range(N)]
    out = rt.replicate(lambda a: rt.all_to_all(a, 0, 1), num_replicas=N)(rt.PerReplica(vals))
    assert isinstance(out, rt.PerReplica) and len(out) == N
    for r in range(N):
        # replica r receives chunk r (row r) of every replica, concatenated along axis 1
        want = np.concatenate([vals[s][r:r + 1] for s in range(N)], axis=1)
        np.testing.assert_array_equal(out.values[r], want)


def test_all_to_all_indivisible():
    step = rt.replicate(lambda a: rt.all_to_all(a, 0, 1), num_replicas=N)
    with pytest.raises(ValueError, match=r"size 3.*4 replicas"):
        step(rt.PerReplica([np.ones((3, 2), np.float32)] * N))


# -- results and argument forms ------------------------------------------------------------

def test_mirrored_results_are_arrays_varying_are_per_replica():
    def fn(w, x):
        return {"w2": w * 2, "sum": rt.all_reduce(x, "sum"), "x": x * w}
    w = np.float32([1.0, 2.0])
    x = _arange(N, 2)
    out = rt.replicate(fn, num_replicas=N)(w, rt.distribute(x, N))
    assert isinstance(out["w2"], jax.Array) and isinstance(out["sum"], jax.Array)
    np.testing.assert_array_equal(out["w2"], w * 2)
    np.testing.assert_array_equal(out["sum"], x.sum(0, keepdims=True))
    assert isinstance(out["x"], rt.PerReplica) and len(out["x"].values) == N
    for r in range(N):
        assert isinstance(out["x"].values[r], jax.Array)
        np.testing.assert_array_equal(out["x"].values[r], x[r:r + 1] * w)


def test_decorator_forms():
    @rt.replicate
    def bare(a):
        return a + 1

    @rt.replicate(num_replicas=2)
    def called(a):
        return a * rt.num_replicas()

    def plain(a):
        return a - rt.num_replicas()
    fn_form = rt.replicate(plain, num_replicas=N)
    assert bare.num_replicas == len(jax.devices()) and called.num_replicas == 2
    assert bare.__name__ == "bare"
    np.testing.assert_array_equal(bare(np.ones(2, np.float32)), [2.0, 2.0])
    np.testing.assert_array_equal(called(np.ones(2, np.float32)), [2.0, 2.0])
    np.testing.assert_array_equal(fn_form(np.ones(2, np.float32)), [-3.0, -3.0])


@pytest.mark.parametrize("make", [float, np.float32, jnp.float32], ids=["py", "np", "jnp"])
def test_scalar_per_replica_inputs_and_outputs(make):
    step = rt.replicate(lambda a, b: (a * b, rt.all_reduce(a, "sum")), num_replicas=N)
    prod, total = step(rt.PerReplica([make(r + 1) for r in range(N)]), make(3.0))
    assert isinstance(prod, rt.PerReplica)
    assert [v.shape for v in prod.values] == [()] * N
    np.testing.assert_allclose([float(v) for v in prod.values], [3.0, 6.0, 9.0, 12.0])
    assert isinstance(total, jax.Array) and total.shape == ()
    np.testing.assert_allclose(total, 10.0)


def test_per_replica_of_pytrees():
    vals = [{"a": np.float32(r), "b": np.full(3, r, np.float32)} for r in range(N)]

    def fn(d):
        return {"s": d["a"] + d["b"].sum(), "m": rt.all_reduce(d["b"], "max")}
    out = rt.replicate(fn, num_replicas=N)(rt.PerReplica(vals))
    np.testing.assert_allclose([float(v) for v in out["s"].values], [4.0 * r for r in range(N)])
    np.testing.assert_array_equal(out["m"], np.full(3, N - 1, np.float32))


# -- errors name the numbers -----------------------------------------------------------------

def test_per_replica_wrong_count():
    step = rt.replicate(lambda a: a, num_replicas=4)
    with pytest.raises(ValueError, match=r"3 values.*4 replicas"):
        step(rt.PerReplica([np.ones(2)] * 3))


def test_per_replica_values_differ_in_shape():
    step = rt.replicate(lambda a: a, num_replicas=4)
    vals = [np.ones(2, np.float32)] * 4
    vals[2] = np.ones(5, np.float32)
    with pytest.raises(ValueError, match=r"replica 2.*\(5,\).*replica 0.*\(2,\)"):
        step(rt.PerReplica(vals))


def test_per_replica_values_differ_in_dtype():
    step = rt.replicate(lambda a: a, num_replicas=4)
    vals = [np.ones(2, np.float32)] * 4
    vals[1] = np.ones(2, np.int32)
    with pytest.raises(ValueError, match=r"replica 1.*int32.*replica 0.*float32"):
        step(rt.PerReplica(vals))


def test_per_replica_values_differ_in_structure():
    step = rt.replicate(lambda a: a, num_replicas=2)
    with pytest.raises(ValueError, match=r"replica 1.*structure"):
        step(rt.PerReplica([(np.ones(2),), {"k": np.ones(2)}]))


def test_distribute_not_divisible():
    with pytest.raises(ValueError, match=r"\(10, 2\).*10 rows.*4 replicas"):
        rt.distribute(np.ones((10, 2)), 4)
    with pytest.raises(ValueError, match=r"\['y'\].*6 rows.*4 replicas"):
        rt.distribute({"x": np.ones((8, 2)), "y": np.ones(6)}, 4)
    with pytest.raises(ValueError, match="scalar"):
        rt.distribute(np.float32(1.0), 2)


def test_more_replicas_than_devices():
    with pytest.raises(ValueError, match=r"16 replicas.*only 8"):
        rt.replicate(lambda a: a, num_replicas=16)


@pytest.mark.parametrize("bad", ["avg", "MEAN", None])
def test_bad_loss_reduction(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("'", ".")):
        rt.replicate(lambda a: a, loss_reduction=bad)


# -- ahead of time ---------------------------------------------------------------------------

def _grad_step(w, batch):
    x, y = batch
    g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * g, jnp.sum(x)


def test_lowered_keeps_the_ends_and_makes_the_stages_between_again():
    """``lower()`` keeps the imported and the last IR (a 32-layer step's every stage was
    ~30,000 long-lived objects the collector scanned); the stages between are made again
    from the imported graph when asked for. Oracle: every stage's text equals the one a
    pass manager that kept every graph gives, and the last graph is the program's own."""
    from compiler.pass_manager import PassManager, parse_pipeline
    step = rt.replicate(_grad_step, num_replicas=N)
    w_spec = jax.ShapeDtypeStruct((3, 2), jnp.float32)
    b_spec = rt.PerReplica([(jax.ShapeDtypeStruct((2, 3), jnp.float32),
                             jax.ShapeDtypeStruct((2, 2), jnp.float32))] * N)
    lowered = step.lower(w_spec, b_spec)
    kept = lowered._program._records
    assert kept[0].graph is not None and kept[-1].graph is not None
    assert all(r.graph is None for r in kept[1:-1]) and len(kept) > 3
    last = kept[-1].graph
    times = lowered.pass_times()  # (names and times need no graph)
    assert lowered._program._records is kept and list(times)[:len(kept)] == lowered.pass_names
    eager = PassManager(parse_pipeline(step.options.pipeline, num_replicas=N,
                                       loss_reduction=step.loss_reduction),
                        verify=True, keep=True)
    eager.run(kept[0].graph)
    for r in eager.records:
        assert str(lowered.ir(after=r.name)) == str(r.graph), r.name
    assert lowered.ir() is last and lowered.ir(after=kept[-1].name) is last
    assert [r.seconds for r in lowered._program.records] == [r.seconds for r in kept]


def test_stages_with_shape_dtype_structs():
    step = rt.replicate(_grad_step, num_replicas=N)
    w_spec = jax.ShapeDtypeStruct((3, 2), jnp.float32)
    b_spec = rt.PerReplica([(jax.ShapeDtypeStruct((2, 3), jnp.float32),
                             jax.ShapeDtypeStruct((2, 2), jnp.float32))] * N)
    lowered = step.lower(w_spec, b_spec)
    names = lowered.pass_names
    assert names == ["import", *DEFAULT_PIPELINE.split(",")]
    # the stages, in this order (later issues add passes between them)
    core = ["import", "replication", "cross-replica-sum", "dce"]
    assert [n for n in names if n in core] == core
    before, after = str(lowered.ir(after="replication")), str(lowered.ir())
    assert "gradient=True" in after and "gradient=True" not in before
    assert str(lowered.ir(after="dce")) == after
    assert str(lowered.ir(after="cross_replica_sum")) == str(lowered.ir(after="cross-replica-sum"))
    with pytest.raises(KeyError, match="no-such-pass.*replication"):
        lowered.ir(after="no-such-pass")
    text = lowered.as_text()
    assert "stablehlo" in text or "func.func" in text
    compiled = lowered.compile()
    assert "all-reduce" in compiled.as_text()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):  # older JAX: one dict per program
        cost = cost[0]
    assert cost["flops"] > 0
    assert compiled.memory_analysis() is not None

    rng = np.random.RandomState(0)
    w = rng.randn(3, 2).astype(np.float32)
    x, y = rng.randn(8, 3).astype(np.float32), rng.randn(8, 2).astype(np.float32)
    got_w, got_s = compiled(w, rt.distribute((x, y), N))
    want_w, _ = jax.jit(_grad_step)(w, (x, y))
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5)
    assert isinstance(got_s, rt.PerReplica)
    np.testing.assert_allclose([float(v) for v in got_s.values],
                               [x[2 * r:2 * r + 2].sum() for r in range(N)], rtol=1e-5)
    # the compiled stage and the step agree
    call_w, _ = step(w, rt.distribute((x, y), N))
    np.testing.assert_allclose(call_w, got_w, rtol=1e-6)


def test_all_gather_negative_axis_and_scalar_error():
    x = _arange(N * 2, 3)
    out = rt.replicate(lambda a: rt.all_gather(a, -1), num_replicas=N)(rt.distribute(x, N))
    np.testing.assert_array_equal(out, np.concatenate(np.split(x, N), axis=-1))
    step = rt.replicate(lambda a: rt.all_gather(a.sum(), 0), num_replicas=N)
    with pytest.raises(ValueError, match=r"axis 0 .*shape \(\) \(rank 0\)"):
        step(rt.distribute(x, N))


def test_compiled_checks_its_arguments():
    step = rt.replicate(lambda w, b: w * b, num_replicas=2)
    compiled = step.lower(np.ones(3, np.float32), rt.PerReplica([np.ones(3, np.float32)] * 2)).compile()
    with pytest.raises(ValueError, match=r"3 values.*2 replicas"):
        compiled(np.ones(3, np.float32), rt.PerReplica([np.ones(3, np.float32)] * 3))
    with pytest.raises(TypeError, match=r"leaf 0.*float32\[3\].*float32\[4\]"):
        compiled(np.ones(4, np.float32), rt.PerReplica([np.ones(3, np.float32)] * 2))
    with pytest.raises(TypeError, match=r"leaf 1.*float32\[3\].*int32\[3\]"):
        compiled(np.ones(3, np.float32), rt.PerReplica([np.ones(3, np.int32)] * 2))
    with pytest.raises(TypeError, match="structure"):
        compiled(np.ones(3, np.float32), (rt.PerReplica([np.ones(3, np.float32)] * 2),))
    out = compiled(np.full(3, 2.0, np.float32), rt.PerReplica([np.ones(3, np.float32), np.zeros(3, np.float32)]))
    np.testing.assert_array_equal(out.values[0], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(out.values[1], [0.0, 0.0, 0.0])


def test_compiled_checks_its_static_arguments():
    """A ``Compiled`` step was traced with its static arguments: called with others it
    is a ``TypeError`` naming both (before: it ran the program of the old ones, 12.0 where
    the step gives 20.0), by position or by name; the same ones run."""
    def step(w, x, k):
        return jnp.sum(x) * w * k
    w, x = np.float32(1.0), rt.distribute(np.ones((4, 2), np.float32), 2)
    by_pos = rt.replicate(step, num_replicas=2, static_argnums=(2,))
    compiled = by_pos.lower(w, x, 3).compile()
    with pytest.raises(TypeError, match=r"static arguments \(argument 2=3\) but was called "
                                        r"with \(argument 2=5\)"):
        compiled(w, x, 5)
    np.testing.assert_array_equal(compiled(w, x, 3).values[1], by_pos(w, x, 3).values[1])
    by_name = rt.replicate(step, num_replicas=2, static_argnames=("k",))
    compiled = by_name.lower(w, x, k=3).compile()
    with pytest.raises(TypeError, match=r"\(k=3\) but was called with \(k=5\)"):
        compiled(w, x, k=5)
    np.testing.assert_array_equal(compiled(w, x, k=3).values[0], [12.0])


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("by", ["argnums", "argnames"])
def test_equal_static_arguments_of_different_types_get_their_own_programs(by, dynamic):
    """``1``, ``1.0`` and ``True`` are equal and hash alike, but a step may branch on
    their type: each gets its own program, as under ``jax.jit`` (oracle: the step run
    eagerly). Before, the second and third call ran the first one's program (3.0 where
    the step gives 0.5 and 101.0); a ``Compiled`` step traced with ``1`` refuses ``1.0``."""
    def step(x, k):
        if isinstance(k, bool):
            return x + 100.0
        return x * 0.5 if isinstance(k, float) else x * 3.0
    opts = rt.RunOptions(dynamic_shapes=dynamic)
    kw = {"static_argnums": (1,)} if by == "argnums" else {"static_argnames": ("k",)}
    rep = rt.replicate(step, num_replicas=2, options=opts, **kw)
    x = np.ones((2, 1), np.float32)
    call = (lambda f, k: f(rt.distribute(x, 2), k)) if by == "argnums" else \
        (lambda f, k: f(rt.distribute(x, 2), k=k))
    for k in (1, 1.0, True):
        np.testing.assert_array_equal(call(rep, k).values[0], step(x[:1], k))
    compiled = (rep.lower(rt.distribute(x, 2), 1) if by == "argnums" else
                rep.lower(rt.distribute(x, 2), k=1)).compile()
    with pytest.raises(TypeError, match="static arguments"):
        call(compiled, 1.0)


def test_compiled_dynamic_shapes_step_runs_calls_of_its_buckets():
    """``lower(...).compile()`` of a dynamic-shapes step runs any call whose sizes fall in
    the buckets it was compiled for, uneven replicas included, with the numbers of the
    step itself (before: an ``IndexError``, or a ``ValueError`` about uneven replicas); a
    call that needs other buckets is a ``TypeError`` naming both."""
    def step(w, x):
        return (jnp.mean(x) * w)[None], jnp.sum(x, 0)
    dyn = rt.replicate(step, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True))
    w = np.float32(2.0)
    lowered_for = rt.distribute_uneven(np.arange(10, dtype=np.float32).reshape(5, 2), 2)
    compiled = dyn.lower(w, lowered_for).compile()
    for rows in (5, 7, 6):  # (3, 2), (4, 3), (3, 3) rows: all in the bucket of 4
        x = rt.distribute_uneven(np.arange(2 * rows, dtype=np.float32).reshape(rows, 2), 2)
        got, want = compiled(w, x), dyn(w, x)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            for gv, ev in zip(g.values, e.values):
                np.testing.assert_array_equal(np.asarray(gv), np.asarray(ev))
    big = rt.distribute(np.ones((16, 2), np.float32), 2)
    with pytest.raises(TypeError, match=r"buckets \{'b': 4\}, but this call's sizes need "
                                        r"\{'b': 8\}"):
        compiled(w, big)


@pytest.mark.parametrize("make_key", [jax.random.PRNGKey, jax.random.key], ids=["raw", "typed"])
def test_prng_keys_as_mirrored_inputs(make_key):
    def fn(k):
        return jax.random.normal(k, (3,)), jax.random.normal(jax.random.fold_in(k, rt.replica_id()), (3,))
    same, per = rt.replicate(fn, num_replicas=2)(make_key(0))
    np.testing.assert_allclose(same, jax.random.normal(make_key(0), (3,)), rtol=1e-6)
    for r in range(2):
        np.testing.assert_allclose(per.values[r], jax.random.normal(jax.random.fold_in(make_key(0), r), (3,)),
                                   rtol=1e-6)


def test_explicit_devices():
    devs = jax.devices()[::-1][:N]
    out = rt.replicate(lambda a: a + rt.replica_id(), devices=devs)(rt.distribute(np.zeros(N, np.float32), N))
    for r in range(N):
        assert out.values[r].devices() == {devs[r]}
        np.testing.assert_array_equal(out.values[r], [r])
    with pytest.raises(ValueError, match="more than once"):
        rt.replicate(lambda a: a, devices=[devs[0], devs[0]])


def test_reduce_pytree_of_per_replica_results():
    step = rt.replicate(lambda x: {"loss": jnp.mean(x), "n": jnp.sum(x > 0), "w": rt.all_reduce(x, "max")},
                        num_replicas=N)
    x = _arange(N * 2)
    out = step(rt.distribute(x, N))
    red = rt.reduce("mean", out)
    np.testing.assert_allclose(red["loss"], x.mean(), rtol=1e-6)
    np.testing.assert_allclose(red["n"], np.mean([np.sum(s > 0) for s in np.split(x, N)]))
    np.testing.assert_array_equal(red["w"], out["w"])  # mirrored: the mean of N copies
    # a mirrored result counts once per replica (TF): the sum over replicas is N times it
    np.testing.assert_allclose(rt.reduce("sum", {"w": out["w"]}, axis=0)["w"],
                               N * np.sum(np.asarray(out["w"])))
    with pytest.raises(ValueError, match=r"axis 0 .*shape \(\)"):
        rt.reduce("sum", out["loss"], axis=0)


@pytest.mark.parametrize("logical_devices", [1, 2])
@pytest.mark.parametrize("placement", ["own", "device0", "reversed", "uncommitted", "mixed"])
def test_per_replica_device_arrays_wherever_they_are(placement, logical_devices):
    """Per-replica jax.Arrays go in from any device: already on their replica's device
    (no copy), elsewhere (moved), uncommitted, or mixed with host arrays; each replica
    computes what jax.jit computes on its value."""
    n = 4
    step = rt.replicate(lambda x, s: (x @ x.T * s, s * 2), num_replicas=n,
                        logical_devices=logical_devices)
    rng = np.random.default_rng(3)
    host = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(n)]
    scal = [np.float32(r + 1) for r in range(n)]
    devs = [step.layout.devices_nk[r, 0] for r in range(n)]
    place = {
        "own": lambda r, a: jax.device_put(a, devs[r]),
        "device0": lambda r, a: jax.device_put(a, jax.devices()[0]),
        "reversed": lambda r, a: jax.device_put(a, devs[n - 1 - r]),
        "uncommitted": lambda r, a: jnp.asarray(a),
        "mixed": lambda r, a: jax.device_put(a, devs[r]) if r % 2 else a,
    }[placement]
    xs = [place(r, a) for r, a in enumerate(host)]
    ss = [place(r, s) for r, s in enumerate(scal)]
    y, s2 = step(rt.PerReplica(xs), rt.PerReplica(ss))
    for r in range(n):
        np.testing.assert_allclose(np.asarray(y.values[r]), host[r] @ host[r].T * scal[r], rtol=1e-5)
        assert float(s2.values[r]) == 2 * scal[r]
        assert y.values[r].devices() == {step.layout.replica_devices[r]}


def test_run_options_hash_with_list_and_dict_fields():
    """RunOptions with maximum_shapes (a list) and dynamic_dims (a dict) hash like the
    frozen dataclass they are: equal options, equal hashes; they key a dict."""
    def opts(axes, bound):
        return rt.RunOptions(dynamic_shapes=True, dynamic_dims={0: axes, 1: {1: "t"}},
                             maximum_shapes=[(bound, None), None], bucketing=[8, 16, 32])
    a, b, c = opts((0, 1), 100), opts((0, 1), 100), opts((0, 2), 100)
    assert a == b and hash(a) == hash(b)
    assert a != c and a != opts((0, 1), 99)
    table = {a: "a", c: "c"}
    assert table[b] == "a" and len(table) == 2
    assert hash(rt.RunOptions()) == hash(rt.RunOptions())


# -- documentation -------------------------------------------------------------------------
def _undocumented(module) -> list[str]:
    """The public names of ``module`` (``__all__``), and the public methods and properties
    of its classes, whose docstring is empty."""
    import inspect
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.ismodule(obj):
            continue
        if not (obj.__doc__ or "").strip():
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        for attr, v in vars(obj).items():
            if attr.startswith("_") or not (callable(v) or isinstance(v, (property, staticmethod,
                                                                            classmethod))):
                continue
            if not (getattr(v, "__doc__", None) or "").strip():
                missing.append(f"{name}.{attr}")
    return missing


def test_every_public_name_is_documented():
    """Every name ``runtime`` and ``runtime.tpu`` export, and every public method and
    property of their classes (``Lowered.ir``, ``Compiled.cost_analysis``,
    ``CacheInfo.compiles``, ``MemoryFit.fits``, ...), says what it does."""
    from runtime import tpu
    assert len(rt.__all__) > 20 and len(tpu.__all__) > 5
    assert _undocumented(rt) == []
    assert _undocumented(tpu) == []


def test_the_documentation_check_finds_a_missing_docstring():
    import types

    class Thing:
        """Documented."""

        def method(self):
            pass

    mod = types.SimpleNamespace(__all__=["Thing", "f"], Thing=Thing, f=lambda: None)
    assert _undocumented(mod) == ["Thing.method", "f"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_step_called_under_a_context_mesh(dynamic):
    """A step called inside ``with jax.set_mesh(mesh):`` (a program that also runs
    ``jax.jit`` code with explicit shardings) runs, with ``jax.jit``'s numbers; its
    per-replica program does not see that mesh (inside, the replicas' mesh is the
    context). Before: ``ValueError: The context mesh ... should match the mesh passed to
    shard_map`` (found by a probe)."""
    w = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
    xs = [np.arange(12, dtype=np.float32).reshape(4, 3) / 10, np.ones((2, 3), np.float32)]
    if not dynamic:
        xs[1] = np.ones((4, 3), np.float32)

    def step(w, x):
        return jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    s = rt.replicate(step, num_replicas=2, options=rt.RunOptions(dynamic_shapes=dynamic))
    with jax.set_mesh(jax.make_mesh((8,), ("d",))):
        got = [s(w, rt.PerReplica(xs)) for _ in range(2)]  # (a build, then a hit)
    want = np.mean([jax.jit(step)(w, x) for x in xs], 0)
    for g in got:
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


def test_results_keep_jax_jits_weak_types():
    """A result computed from a Python scalar is weak-typed, as ``jax.jit``'s (so a
    bfloat16 weight times it stays bfloat16); before, the IR's weak constant lowered as a
    strong NumPy array and the result came out a strong float32 (found by a probe)."""
    def step(x, lr):
        return x * 2, lr * 0.5, jax.lax.cond(lr > 0, lambda: lr * 2.0, lambda: lr)
    x = np.ones(4, np.float32)
    got, want = rt.replicate(step, num_replicas=2)(x, 0.1), jax.jit(step)(x, 0.1)
    for g, w in zip(got, want):
        assert (g.dtype, g.weak_type) == (w.dtype, w.weak_type)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert [w.weak_type for w in want] == [False, True, True]
    assert (jnp.ones(3, jnp.bfloat16) * got[1]).dtype == jnp.bfloat16


@pytest.mark.parametrize("loop", ["steps_per_call", "fori_loop"])
def test_all_gather_of_a_gradient_in_the_state_of_a_loop(loop):
    """A state leaf updated from a gradient and ``rt.all_gather`` (identical on every
    replica) inside a loop (``steps_per_call=2``, or a ``fori_loop`` in the step): the
    numbers of two calls of one step, and of pmap. Before: JAX typed the gather's result
    per replica, so the loop carry became per replica and its gradient each replica's own,
    unreduced (four different states; found by a probe)."""
    n, k = 4, 2
    rng = np.random.RandomState(1)
    xs = [rng.randn(8, 4).astype(np.float32) for _ in range(k)]

    def lf(w, x):
        return jnp.mean((x @ w - 1.0) ** 2)

    def step(w, x):
        g = jax.grad(lf)(w, x)
        return w - 0.05 * g + 1e-3 * jnp.sum(rt.all_gather(g[None], axis=0), 0), jnp.float32(0)
    want = np.ones(4, np.float32)
    for x in xs:
        g = np.mean([np.asarray(jax.grad(lf)(want, xr)) for xr in np.split(x, n)], 0)
        want = want - 0.05 * g + 1e-3 * n * g
    if loop == "steps_per_call":
        got, _ = rt.replicate(step, num_replicas=n, steps_per_call=k)(
            jnp.ones(4), rt.distribute_steps(xs, n))
    else:
        got, _ = rt.replicate(lambda w, xk: (jax.lax.fori_loop(
            0, k, lambda i, w: step(w, xk[i])[0], w), 0.0), num_replicas=n)(
            jnp.ones(4), rt.distribute_steps(xs, n))
    assert not isinstance(got, rt.PerReplica)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
