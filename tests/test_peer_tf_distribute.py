"""Ports of tensorflow/tensorflow's distribute tests, the cases whose meaning a replicated
step has (TF's ``TPUStrategy`` semantics are this project's contract):

* ``tensorflow/python/distribute/custom_training_loop_gradient_test.py``
  (``GradientTapeTest``): gradients inside ``strategy.run`` of a distributed dataset's
  per-replica batches, and of a mirrored variable;
* ``tensorflow/python/distribute/strategy_common_test.py``: ``ReduceTest`` (``testBasic``,
  ``testAxis``), ``ReplicaCtxAllReduceTest.testBasic``, ``StrategyTest``'s replica id, and
  ``DistributedCollectiveAllReduceStrategyTest``'s reduce of a host value and its last
  partial batch (there on two workers; here two replicas);
* ``tensorflow/python/distribute/custom_training_loop_metrics_test.py``
  (``KerasMetricsTest``): a Keras ``Mean`` metric (its ``total`` and ``count`` are
  sync-on-read SUM variables) updated inside the step: ``rt.SyncOnRead``.

How TF maps: ``strategy.run(fn, args)`` is a call of ``rt.replicate(fn)``; a distributed
dataset's batch is ``rt.distribute`` of the global batch (``rt.distribute_uneven`` for a
partial last batch); ``experimental_local_results`` is ``PerReplica.values``;
``strategy.reduce(op, v, axis)`` is ``rt.reduce(op, v, axis)``; a replica-context
all-reduce is ``rt.all_reduce``; ``replica_id_in_sync_group`` is ``rt.replica_id()``; a
``MirroredVariable`` is a mirrored argument. TF's expected values are kept.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt


def _local_results(out, n):
    """TF's ``experimental_local_results``: one value per replica (a result proven
    identical on every replica, which ``replicate`` returns as one array, n times)."""
    return [np.asarray(v) for v in out.values] if isinstance(out, rt.PerReplica) \
        else [np.asarray(out)] * n


# -- custom_training_loop_gradient_test.py -------------------------------------------------

def _train_step(x):
    def computation(x):
        return jnp.square(x)
    # tape.watch(x); tape.gradient(y, x): the gradient of sum(y) with respect to x
    return jax.grad(lambda x: jnp.sum(computation(x)))(x)


@pytest.mark.parametrize("jit", [False, True], ids=["testStepInFunctionGradient",
                                                   "testRunInFunctionGradient"])
def test_gradient_of_a_per_replica_batch(jit):
    """``dataset.from_tensor_slices([5., 6., 7., 8.]).batch(2)`` over 2 replicas: each
    step's per-replica values are one element each, and their gradients ``2 x``:
    ``[[10., 12.], [14., 16.]]`` flattened step by step (with the step in a ``tf.function``
    or the whole ``strategy.run``: ``jax.jit`` of the step here)."""
    step = rt.replicate(jax.jit(_train_step) if jit else _train_step, num_replicas=2)
    data = np.asarray([5., 6., 7., 8.], np.float32)
    results = [np.concatenate(_local_results(step(rt.distribute(batch, 2)), 2))
               for batch in np.split(data, 2)]
    np.testing.assert_array_equal(results, [[10., 12.], [14., 16.]])


@pytest.mark.parametrize("model_in_tf_function", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_nested_function(model_in_tf_function, reduction):
    """``testNestedFunction``: the gradient of ``x * x`` with respect to a mirrored
    variable ``x = 1.0`` in each replica: TF checks one gradient per replica, none
    ``None``. Here the gradient of a mirrored value is all-reduced (``apply_gradients``'
    sum in TF): the loss is identical on every replica, so it counts once per replica,
    ``"mean"`` gives ``2 x`` and ``"sum"`` ``n * 2 x``, one array."""
    def model(x):
        return x * x
    if model_in_tf_function:
        model = jax.jit(model)
    n = 4
    grads = rt.replicate(lambda x: jax.grad(model)(x), num_replicas=n,
                         loss_reduction=reduction)(np.float32(1.0))
    assert not isinstance(grads, rt.PerReplica)
    local = _local_results(grads, n)
    assert len(local) == n and all(g is not None for g in local)
    np.testing.assert_allclose(local, [2.0 * (n if reduction == "sum" else 1)] * n)


# -- strategy_common_test.py ---------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_basic(n):
    """``ReduceTest.testBasic``: a per-replica 1.0 (``distribute_values_from_function``)
    reduced with SUM is ``n``."""
    per_replica = rt.distribute_values_from_function(lambda ctx: np.ones((), np.float32), n)
    assert float(rt.reduce("sum", per_replica, axis=None)) == 1.0 * n


@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_axis(n):
    """``ReduceTest.testAxis``: each replica returns ``[1., 2.]``; MEAN along axis 0 is
    1.5, SUM ``3 n`` (the constant comes back as one array: it still counts n times)."""
    x = rt.replicate(lambda: jnp.asarray([1., 2.]), num_replicas=n)()
    assert float(rt.reduce("mean", x, axis=0)) == 1.5
    assert float(rt.reduce("sum", x, axis=0)) == 3 * n


@pytest.mark.parametrize("n", [1, 2, 4])
def test_replica_ctx_all_reduce(n):
    """``ReplicaCtxAllReduceTest.testBasic``: an all-reduce SUM of 1.0 in replica context
    is ``n`` on each replica. A sum of a constant counts the replicas, as TF's test means:
    no warning (a sum of another value identical on every replica warns)."""
    step = rt.replicate(lambda: rt.all_reduce(jnp.float32(1.0), "sum"), num_replicas=n)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*identical on every replica")
        out = step()
    assert _local_results(out, n)[0] == 1.0 * n


def test_capture_replica_id():
    """``StrategyTest.testCaptureReplicaId``: the replica id inside a step (there, that
    capturing it in a function traced twice works; here, its values)."""
    out = rt.replicate(lambda: rt.replica_id(), num_replicas=4)()
    assert [int(v) for v in _local_results(out, 4)] == [0, 1, 2, 3]


def test_reduce_host_tensor():
    """``testReduceHostTensor`` / ``testReduceDeviceTensors`` on two replicas: a value
    that is the same on both (a host tensor there; a mirrored result here) reduced with
    SUM is 2."""
    assert float(rt.reduce("sum", np.float32(1.0), num_replicas=2)) == 2.
    value = rt.replicate(lambda: jnp.float32(1.0), num_replicas=2)()
    assert float(rt.reduce("sum", value, axis=None)) == 2.


def test_simple_input_last_partial_batch():
    """``testSimpleInputFromDatasetLastPartialBatch``: ``range(14).batch(8)`` on two
    replicas: the first batch splits 4 + 4, the last partial one (6) 3 + 3,
    ``[8, 9, 10]`` and ``[11, 12, 13]``; an identity step returns them as they are."""
    data = np.arange(14, dtype=np.int32)
    step = rt.replicate(lambda x: x, num_replicas=2,
                        options=rt.RunOptions(dynamic_shapes=True))
    first = step(rt.distribute_uneven(data[:8], 2))
    assert [v.tolist() for v in _local_results(first, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    last = step(rt.distribute_uneven(data[8:], 2))
    assert [v.tolist() for v in _local_results(last, 2)] == [[8, 9, 10], [11, 12, 13]]


# -- custom_training_loop_metrics_test.py --------------------------------------------------

def _mean_metric(n):
    """A Keras ``Mean``: ``total`` and ``count``, per replica, summed when read."""
    return rt.SyncOnRead({"total": np.float32(0), "count": np.float32(0)}, aggregation="sum",
                         num_replicas=n)


def _update_state(metric, values):
    values = jnp.asarray(values, jnp.float32)
    return metric.update(lambda v: {"total": v["total"] + jnp.sum(values),
                                    "count": v["count"] + values.size})


def _result(metric):
    read = metric.read()
    return float(read["total"] / read["count"])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_multiple_keras_metrics(n):
    """``test_multiple_keras_metrics_experimental_run``: two ``Mean`` metrics updated with a
    loss of 5.0 on every replica both read 5.0."""
    def step_fn(loss_metric, loss_metric_2):
        loss = jnp.float32(5.0)
        return _update_state(loss_metric, loss), _update_state(loss_metric_2, loss)

    m1, m2 = rt.replicate(step_fn, num_replicas=n)(_mean_metric(n), _mean_metric(n))
    assert _result(m1) == _result(m2) == 5.0


@pytest.mark.parametrize("n", [1, 2])
def test_update_keras_metric_declared_in_strategy_scope(n):
    """``test_update_keras_metric_declared_in_strategy_scope``: ``range(10).batch(2)``
    distributed, each replica's slice of each batch added to the metric: the mean of 0-9,
    4.5 (sum 45, count 10)."""
    step = rt.replicate(_update_state, num_replicas=n)
    metric = _mean_metric(n)
    for batch in np.split(np.arange(10, dtype=np.float32), 5):
        metric = step(metric, rt.distribute(batch, n))
    assert _result(metric) == 4.5
    assert float(metric.read()["count"]) == 10
