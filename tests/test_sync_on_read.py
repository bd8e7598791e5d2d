"""Sync-on-read state (issue 6.3): per-replica accumulators updated inside the step and
aggregated across replicas only when read (TF's SUM, MEAN, ONLY_FIRST_REPLICA)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt


def _data(n_rows=64, d=5, classes=3, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n_rows, d).astype(np.float32)
    y = rng.randint(0, classes, size=n_rows).astype(np.int32)
    w = rng.randn(d, classes).astype(np.float32)
    return w, x, y


def accuracy_step(w, acc, batch):
    x, y = batch
    pred = jnp.argmax(x @ w, axis=-1)
    hits = jnp.sum(pred == y).astype(jnp.int32)
    return acc.assign({"correct": acc.value["correct"] + hits,
                       "total": acc.value["total"] + jnp.int32(y.shape[0])})


@pytest.mark.parametrize("n", [1, 4, 8])
def test_accuracy_metric_equals_global_numpy(n):
    w, x, y = _data()
    step = rt.replicate(accuracy_step, num_replicas=n)
    acc = rt.SyncOnRead({"correct": np.int32(0), "total": np.int32(0)}, aggregation="sum",
                        num_replicas=n)
    batches = [(x[i:i + 32], y[i:i + 32]) for i in (0, 32)]
    for b in batches:
        acc = step(w, acc, rt.distribute(b, n))
        assert isinstance(acc, rt.SyncOnRead) and acc.aggregation == "sum"
    # each replica kept its own counts: they differ from one another (the shards differ)
    totals = [int(v["total"]) for v in acc.values]
    assert totals == [64 // n] * n
    got = acc.read()
    # the counters keep their dtype (NumPy's sum would promote int32 to int64)
    assert got["correct"].dtype == got["total"].dtype == np.int32
    want_correct = int(np.sum(np.argmax(x @ w, -1) == y))
    assert int(got["correct"]) == want_correct and int(got["total"]) == 64
    np.testing.assert_allclose(got["correct"] / got["total"], want_correct / 64)
    assert step.cache_info().misses == 1          # the returned accumulator feeds the next call


def test_mean_and_only_first_replica():
    n = 4
    step = rt.replicate(lambda acc, x: acc.update(lambda v: v + jnp.sum(x)), num_replicas=n)
    x = np.arange(8, dtype=np.float32)           # replica r sums rows [2r, 2r+1]
    per_replica = np.array([x[2 * r] + x[2 * r + 1] for r in range(n)])
    for agg, want in [("mean", per_replica.mean()), ("sum", per_replica.sum()),
                      ("only_first_replica", per_replica[0])]:
        acc = step(rt.SyncOnRead(np.float32(0), aggregation=agg, num_replicas=n), rt.distribute(x, n))
        np.testing.assert_allclose(acc.read(), want)
        assert acc.aggregation == agg
    # reset gives zeros on every replica
    assert float(acc.reset().read()) == 0.0


def test_per_replica_init_and_mirrored_update():
    """A step that overwrites the accumulator with a mirrored value: every replica holds it."""
    n = 2
    acc = rt.SyncOnRead(rt.PerReplica([np.float32(1), np.float32(5)]), aggregation="sum")
    step = rt.replicate(lambda acc, c: acc.assign(c + 0 * acc.value), num_replicas=n)
    out = step(acc, np.float32(3))
    assert [float(v) for v in out.values] == [3.0, 3.0] and float(out.read()) == 6.0
    assert float(acc.read()) == 6.0


def test_sync_on_read_in_multistep_state():
    """A metric carried as part of a k-step state stays per replica through the loop."""
    n, k = 4, 3
    w, x, y = _data(n_rows=96)

    def mstep(state, batch):
        w, acc = state
        return (w, accuracy_step(w, acc, batch)), ()
    step = rt.replicate(mstep, num_replicas=n, steps_per_call=k)
    acc = rt.SyncOnRead({"correct": np.int32(0), "total": np.int32(0)}, "sum", num_replicas=n)
    batches = [(x[32 * t:32 * (t + 1)], y[32 * t:32 * (t + 1)]) for t in range(k)]
    (_, acc), _ = step((w, acc), rt.distribute_steps(batches, n))
    got = acc.read()
    assert int(got["total"]) == 96
    assert int(got["correct"]) == int(np.sum(np.argmax(x @ w, -1) == y))


def test_errors():
    with pytest.raises(ValueError, match="aggregation"):
        rt.SyncOnRead(0.0, aggregation="max", num_replicas=2)
    with pytest.raises(ValueError, match="num_replicas"):
        rt.SyncOnRead(0.0)
    acc = rt.SyncOnRead(np.float32(0), num_replicas=2)
    with pytest.raises(ValueError, match="inside a replicated step"):
        acc.value
    step = rt.replicate(lambda a: a.assign({"oops": a.value}), num_replicas=2)
    with pytest.raises(ValueError, match="structure"):
        step(acc)


@pytest.mark.parametrize("aggregation", ["sum", "mean", "only_first_replica"])
def test_assign_outside_a_step_reads_back_the_value(aggregation):
    """TF's assign in cross-replica context: ``read()`` gives the assigned value whatever
    the aggregation; a float under ``"sum"`` is split evenly over the replicas (TF's
    ``value / n``), an integer put on replica 0 (the sum exact); the accumulator then
    keeps counting from there inside a step; a tree of another structure is refused."""
    n = 4
    acc = rt.SyncOnRead({"total": np.float32(0), "count": np.int32(0)},
                        aggregation=aggregation, num_replicas=n)
    acc = acc.assign({"total": np.float32(10.0), "count": np.int32(7)})
    got = acc.read()
    assert float(got["total"]) == 10.0 and int(got["count"]) == 7
    if aggregation == "sum":
        assert [float(v["total"]) for v in acc.values] == [2.5] * n
        assert [int(v["count"]) for v in acc.values] == [7, 0, 0, 0]
    step = rt.replicate(lambda acc, x: acc.update(lambda v: {"total": v["total"] + x.sum(),
                                                             "count": v["count"] + 1}),
                        num_replicas=n)
    x = np.arange(8, dtype=np.float32)
    after = step(acc, rt.distribute(x, n)).read()
    if aggregation == "sum":
        assert float(after["total"]) == 10.0 + x.sum() and int(after["count"]) == 7 + n
    with pytest.raises(ValueError, match="structure"):
        acc.assign({"total": np.float32(1.0)})


def _update_in_place(w, acc, batch):
    """Keras's ``metric.update_state(...)`` ported as written: the update's result dropped
    and the accumulator it was called on returned."""
    x, y = batch
    acc.update(lambda v: {"correct": v["correct"] + jnp.sum(jnp.argmax(x @ w, -1) == y),
                          "total": v["total"] + y.shape[0]})
    return acc


@pytest.mark.parametrize("form", ["static", "dynamic", "steps_per_call"])
def test_returning_an_accumulator_after_its_update_is_an_error(form):
    """``assign``/``update`` return the updated accumulator and leave the one they were
    called on unchanged. A step that returned the latter ran, and the metric silently
    stayed at zero (TF's assign and Keras's ``update_state`` change the variable in place,
    so a port reads naturally this way). Now a ``TypeError`` naming the update's line; the
    step that returns the update counts every real row (with dynamic shapes, a
    replica's real size, not its bucket's)."""
    n = 2
    w, x, y = _data(n_rows=12)
    acc = rt.SyncOnRead({"correct": np.int32(0), "total": np.int32(0)}, "sum", num_replicas=n)
    if form == "steps_per_call":
        step = rt.replicate(lambda s, b: ((s[0], _update_in_place(s[0], s[1], b)), ()),
                            num_replicas=n, steps_per_call=2)
        call = lambda: step((w, acc), rt.distribute_steps([(x[:6], y[:6]), (x[6:], y[6:])], n))  # noqa: E731
    else:
        opts = rt.RunOptions(dynamic_shapes=form == "dynamic")
        step = rt.replicate(_update_in_place, num_replicas=n, options=opts)
        batch = rt.PerReplica([(x[:7], y[:7]), (x[7:], y[7:])]) if form == "dynamic" \
            else rt.distribute((x, y), n)
        call = lambda: step(w, acc, batch)  # noqa: E731
    with pytest.raises(TypeError, match=r"SyncOnRead accumulator whose assign/update was "
                                        r"called \(test_sync_on_read\.py:\d+\).*acc = "
                                        r"acc\.update\(fn\)"):
        call()
    if form == "dynamic":  # returned as the error says: every real row counted
        def fixed(w, acc, batch):
            x, y = batch
            return acc.update(lambda v: {
                "correct": v["correct"] + jnp.sum(jnp.argmax(x @ w, -1) == y),
                "total": v["total"] + y.shape[0]})
        got = rt.replicate(fixed, num_replicas=n, options=opts)(w, acc, batch).read()
        assert int(got["total"]) == 12
        assert int(got["correct"]) == int(np.sum(np.argmax(x @ w, -1) == y))
