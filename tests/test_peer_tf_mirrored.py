"""More ports of tensorflow/tensorflow's distribute tests (see also
``tests/test_peer_tf_distribute.py``), the cases whose meaning a replicated functional step
has, with TF's expected values kept:

* ``tensorflow/python/distribute/mirrored_strategy_test.py`` (``MirroredTwoDeviceDistributionTest``,
  ``MirroredOneDeviceDistributionTest``, ``MirroredStrategyCallForEachReplicaTest``,
  ``MirroredVariableUpdateTest``, ``SyncOnReadVariableAssignTest``,
  ``MirroredStrategyDefunTest``, ``FunctionTest``), and the helpers of
  ``tensorflow/python/distribute/strategy_test_lib.py`` they call (``_test_minimize_loss_*``,
  ``_test_replica_id``, ``_test_run``, ``_test_collective_comms*``, ``_test_all_reduce_*``,
  ``_test_input_fn_iterable``, ``_test_numpy_dataset``, ``_test_global_step_update``);
* ``tensorflow/python/distribute/mirrored_variable_test.py`` (``MirroredVariableCreationTest``:
  ``testOnlyFirstReplicaUpdatesVariables``, ``testSyncOnReadVariable``,
  ``testSyncOnReadVariableUpdate``);
* ``tensorflow/python/distribute/values_test.py`` (``DistributedValuesTest.testMakeDistributedValue*``,
  ``DistributedVariableTest.testStrategyExtendedUpdate`` for ON_READ variables);
* ``tensorflow/python/distribute/cross_device_ops_test.py`` (``testReduceDense``,
  ``testBatchReduceDense``, ``testAllReduceDense``, ``testAllGatherSameShape``,
  ``testCollectiveV2ControlFlow``, ``_testReductionAndBroadcast``,
  ``testReduceDistributedVariable``, ``_testIndexedSlicesAllReduce`` and
  ``testReduceSparseVariableLength`` densified);
* ``tensorflow/python/distribute/input_lib_test.py`` (``testUnevenDatasetBatches``) and
  ``tensorflow/python/distribute/strategy_common_test.py``
  (``testSimpleInputFromFnLastPartialBatch``, ``testBatchReduceTo*Tensor``).

How TF maps (as in ``test_peer_tf_distribute.py``): ``strategy.run`` /
``call_for_each_replica`` is a call of ``rt.replicate(fn)``; a distributed dataset's batch is
``rt.distribute`` (``rt.distribute_uneven`` / a ``PerReplica`` of unequal sizes with
``dynamic_shapes`` for a partial batch); ``experimental_local_results`` is
``PerReplica.values``; ``strategy.reduce`` / ``cross_device_ops.reduce`` is ``rt.reduce``;
a replica-context all-reduce is ``rt.all_reduce``; ``replica_id_in_sync_group`` is
``rt.replica_id()``; a ``MirroredVariable`` is a mirrored argument whose update the step
returns; a sync-on-read variable is ``rt.SyncOnRead``. A mirrored variable's
``aggregation`` (MEAN / ONLY_FIRST_REPLICA of per-replica writes) has no ``rt`` equivalent:
the step all-reduces the update itself (``rt.all_reduce(update, "mean")``, or replica 0's
value broadcast), and an unaggregated per-replica write warns
(``rt.DivergingStateWarning``). Training loops are also checked against the same step
through ``jax.jit`` on one device over the global batch.
"""
from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import runtime as rt
from compiler.errors import DivergentCollectiveError
from compiler.passes.padding import PaddingError

DYN = rt.RunOptions(dynamic_shapes=True)


def _local_results(out, n):
    """TF's ``experimental_local_results``: one value per replica (a result proven
    identical on every replica, which ``replicate`` returns as one array, n times)."""
    return [np.asarray(v) for v in out.values] if isinstance(out, rt.PerReplica) \
        else [np.asarray(out)] * n


def _local_tree(out, n):
    """``experimental_local_results`` of a pytree of results: one tree per replica."""
    leaves, td = jax.tree.flatten(out, is_leaf=lambda x: isinstance(x, rt.PerReplica))
    per = [_local_results(x, n) for x in leaves]
    return [td.unflatten([p[r] for p in per]) for r in range(n)]


def _identical_sum(n):
    """An all-reduce SUM of a value identical on every replica (an argument) warns when
    n > 1: the sum multiplies it by n, which TF's tests mean."""
    if n == 1:
        return contextlib.nullcontext()
    return pytest.warns(UserWarning, match=rf"identical on every replica .*: a sum "
                                           rf"multiplies it by {n}")


@contextlib.contextmanager
def _constant_sum():
    """An all-reduce SUM of constants (TF's tests' ``constant(1.0)``) counts the replicas,
    as those tests mean: no warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*identical on every replica")
        yield


def _train_against(rstep, oracle, batches, n):
    """Train ``_mlp_init()``'s parameters with the replicated step and the one-device
    oracle on the same global batches; they agree after every step."""
    params = ref = _mlp_init()
    for b in batches:
        params, ref = rstep(params, rt.distribute(b, n)), oracle(ref, b)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                             rtol=2e-5, atol=1e-6), params, ref)


def _pr(values, dtype=np.float32):
    return rt.PerReplica([np.asarray(v, dtype) for v in values])


# =========================================================================================
# strategy_test_lib.py via mirrored_strategy_test.py
# =========================================================================================

def _glorot_kernel(seed=0):
    """``create_variable_like_keras_layer(shape=(1, 1))``: GlorotUniform, limit sqrt(6/2)."""
    lim = np.sqrt(6.0 / 2.0)
    return np.random.RandomState(seed).uniform(-lim, lim, (1, 1)).astype(np.float32)


def _tf_loss(kernel, x):
    y = jnp.reshape(jnp.matmul(x, kernel), []) - 1.0
    return y * y


@pytest.mark.parametrize("lr", [0.2, 0.05], ids=["eager_lr0.2", "graph_lr0.05"])
@pytest.mark.parametrize("n", [1, 2])
def test_minimize_loss(n, lr):
    """``testMinimizeLoss`` (``_test_minimize_loss_eager`` / ``_graph``; lr 0.05 is
    ``RemoteSingleWorkerMirroredStrategyBase`` and the multi-worker ones): each replica's
    gradient of ``(x @ kernel - 1)^2`` at ``x = [[1.]]`` is ``reduce_to(SUM)``'d and
    ``kernel -= lr * g``, 10 steps; the error goes down. Here ``loss_reduction="sum"``
    (the loss is identical on every replica: it counts n times, as TF's SUM of n equal
    gradients). Oracle: ``jax.jit`` of the global program on one device, the sum of the n
    replicas' losses over the global batch of n rows ``[1.]``."""
    one = np.ones((1, 1), np.float32)

    def step(kernel, x):
        g = jax.grad(_tf_loss)(kernel, x)
        return kernel - lr * g, kernel

    rstep = rt.replicate(step, num_replicas=n, loss_reduction="sum")

    @jax.jit
    def oracle(kernel, xs):
        g = jax.grad(lambda k: sum(_tf_loss(k, xs[i:i + 1]) for i in range(n)))(kernel)
        return kernel - lr * g, kernel

    kernel = ref = _glorot_kernel()
    xs = np.ones((n, 1), np.float32)
    for i in range(10):
        kernel, before = rstep(kernel, one)
        ref, ref_before = oracle(ref, xs)
        if i == 0:
            first = np.asarray(before)
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(ref), rtol=1e-6, atol=1e-7)
        assert not isinstance(kernel, rt.PerReplica)
    assert abs(np.asarray(kernel) - 1).item() < abs(first - 1).item()


def _mlp_init():
    rs = np.random.RandomState(1)
    return {"w": rs.normal(size=(3, 2)).astype(np.float32) * 0.5,
            "b": np.zeros((2,), np.float32)}


def _per_example(params, x, y):
    pred = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.sum((pred - y) ** 2, axis=-1)


def _batches(k, b, seed=2):
    rs = np.random.RandomState(seed)
    return [{"x": rs.normal(size=(b, 3)).astype(np.float32),
             "y": rs.normal(size=(b, 2)).astype(np.float32)} for _ in range(k)]


@jax.jit
def _oracle_sgd(params, batch):
    """One SGD step on the global batch's mean loss, on one device."""
    loss, g = jax.value_and_grad(lambda p: jnp.mean(_per_example(p, batch["x"], batch["y"])))(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("steps_per_call", [1, 5])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_minimize_loss_distributed_batch(reduction, steps_per_call, n):
    """The custom training loop the strategy tests stand for (``_test_minimize_loss``
    with a distributed dataset): gradients all-reduced with MEAN (each replica's mean
    loss, ``loss_reduction="mean"``) or SUM (each replica's loss summed over its rows and
    divided by the global batch size, TF's ``compute_average_loss``,
    ``loss_reduction="sum"``); both are the global batch's mean loss. Five SGD steps
    (one per call, or ``steps_per_call=5``: TF's ``steps_per_execution``) against
    ``jax.jit`` on one device over each global batch."""
    gbs = 24
    batches = _batches(5, gbs)

    def loss_fn(params, batch):
        per = _per_example(params, batch["x"], batch["y"])
        return jnp.mean(per) if reduction == "mean" else jnp.sum(per) / gbs

    def step(params, batch):
        loss, g = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss

    ref, ref_losses = _mlp_init(), []
    for b in batches:
        ref, l = _oracle_sgd(ref, b)
        ref_losses.append(float(l))

    params = _mlp_init()
    if steps_per_call == 1:
        rstep = rt.replicate(step, num_replicas=n, loss_reduction=reduction)
        losses = []
        for b in batches:
            params, loss = rstep(params, rt.distribute(b, n))
            losses.append(float(rt.reduce(reduction, loss)))
    else:
        rstep = rt.replicate(step, num_replicas=n, loss_reduction=reduction, steps_per_call=5)
        params, loss = rstep(params, rt.distribute_steps(batches, n))
        losses = list(rt.reduce(reduction, loss))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                         rtol=2e-5, atol=1e-6), params, ref)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_minimize_loss_uneven_last_batch(reduction):
    """A training loop whose last global batch is partial (``input_lib_test``'s uneven
    batches, ``drop_remainder=False``): 16 rows then 5 over 2 replicas (3 + 2). With SUM
    and ``compute_average_loss`` (divide by the global batch size) every step is the
    global batch's mean (oracle: ``jax.jit`` on the global batch); with MEAN each replica
    takes its own rows' mean and the replicas' gradients are averaged (TF's semantics;
    oracle: the mean of ``jax.jit``'s gradients over each replica's rows)."""
    n = 2
    data = _batches(1, 21, seed=3)[0]
    batches = [jax.tree.map(lambda a: a[:16], data), jax.tree.map(lambda a: a[16:], data)]

    def step(params, batch, gbs):
        def loss_fn(p):
            per = _per_example(p, batch["x"], batch["y"])
            return jnp.sum(per) / gbs if reduction == "sum" else jnp.mean(per)
        g = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    rstep = rt.replicate(step, num_replicas=n, loss_reduction=reduction, options=DYN)

    @jax.jit
    def grad_mean(p, b):
        return jax.grad(lambda p: jnp.mean(_per_example(p, b["x"], b["y"])))(p)

    params = ref = _mlp_init()
    for b in batches:
        params = rstep(params, rt.distribute_uneven(b, n), np.float32(len(b["x"])))
        if reduction == "sum":
            g = grad_mean(ref, b)
        else:
            parts = [{k: np.array_split(v, n)[i] for k, v in b.items()} for i in range(n)]
            gs = [grad_mean(ref, p) for p in parts]
            g = jax.tree.map(lambda *x: sum(x) / n, *gs)
        ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, g)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                             rtol=2e-5, atol=1e-6), params, ref)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_minimize_loss_with_regularization(reduction):
    """The same loop with a regularization loss of the parameters only (identical on
    every replica), as TF's custom loops write it: with SUM, ``compute_average_loss`` of
    the per-example losses plus ``scale_regularization_loss`` (the penalty divided by the
    number of replicas); with MEAN, each replica's mean plus the penalty. Either way the
    global objective is the global batch's mean loss plus the penalty (oracle:
    ``jax.jit`` of it on one device)."""
    n, gbs, lam = 4, 16, 0.05
    batches = _batches(3, gbs, seed=5)

    def penalty(params):
        return lam * jnp.sum(params["w"] ** 2)

    def loss_fn(params, batch):
        per = _per_example(params, batch["x"], batch["y"])
        if reduction == "sum":
            return jnp.sum(per) / gbs + penalty(params) / rt.num_replicas()
        return jnp.mean(per) + penalty(params)

    def step(params, batch):
        g = jax.grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    @jax.jit
    def oracle(params, batch):
        g = jax.grad(lambda p: jnp.mean(_per_example(p, batch["x"], batch["y"]))
                     + penalty(p))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    rstep = rt.replicate(step, num_replicas=n, loss_reduction=reduction)
    _train_against(rstep, oracle, batches, n)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_minimize_loss_through_all_reduce(reduction):
    """A loss that reads an all-reduce (the replica-context MEAN of the batch's
    activations, as a synchronized batch norm does) trained with SUM / MEAN gradient
    reduction: TF's tape differentiates through the all-reduce (its gradient is an
    all-reduce of the upstream gradients) and the replicas' gradients are then SUM'd /
    averaged, i.e. the gradient of the sum / mean of the replicas' losses. Oracle:
    ``jax.jit`` of that global objective on one device, the batch split into the
    replicas' rows and the mean taken over all of them."""
    n, gbs = 4, 16
    batches = _batches(3, gbs, seed=6)

    def replica_loss(params, x, y, mu):
        h = x @ params["w"] + params["b"]
        return jnp.mean((jnp.tanh(h - mu) - y) ** 2)

    def step(params, batch):
        def loss_fn(p):
            h = batch["x"] @ p["w"] + p["b"]
            mu = rt.all_reduce(jnp.mean(h, axis=0), "mean")
            return replica_loss(p, batch["x"], batch["y"], mu)
        g = jax.grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    @jax.jit
    def oracle(params, batch):
        def global_loss(p):
            mu = jnp.mean(batch["x"] @ p["w"] + p["b"], axis=0)
            xs, ys = (jnp.reshape(a, (n, gbs // n) + a.shape[1:]) for a in (batch["x"], batch["y"]))
            losses = [replica_loss(p, xs[r], ys[r], mu) for r in range(n)]
            return sum(losses) / (n if reduction == "mean" else 1)
        g = jax.grad(global_loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    rstep = rt.replicate(step, num_replicas=n, loss_reduction=reduction)
    _train_against(rstep, oracle, batches, n)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_dynamic_rnn_training(reduction):
    """``MirroredVariableCreationTest.testDynamicRnnVariables`` runs a bidirectional dynamic
    RNN in each replica (TF checks the two outputs and the variables' names). Here: a
    forward and a backward ``lax.scan`` RNN over each replica's batch, the backward one
    reading the replicas' MEAN of its state at every time step (an all-reduce inside the
    loop) and the loss the replicas' MEAN of the last forward state; the two outputs come
    back per replica, and the gradients of the mirrored weights (SUM / MEAN reduced)
    equal ``jax.jit`` of the global objective on one device (the replicas as a ``vmap``
    axis whose ``lax.pmean`` is the all-reduce)."""
    n, t, b, h = 4, 5, 2, 3
    rs = np.random.RandomState(8)
    params = {"W": rs.normal(size=(h, h)).astype(np.float32) * 0.5,
              "U": rs.normal(size=(2, h)).astype(np.float32) * 0.5,
              "Wb": rs.normal(size=(h, h)).astype(np.float32) * 0.5}
    xs = rs.normal(size=(n * b, t, 2)).astype(np.float32)

    def make(all_reduce_mean):
        def model(p, x):
            def cell_fw(s, xt):
                s = jnp.tanh(s @ p["W"] + xt @ p["U"])
                return s, s

            def cell_bw(s, xt):
                s = jnp.tanh(all_reduce_mean(s) @ p["Wb"] + xt @ p["U"])
                return s, s
            s0 = jnp.zeros((x.shape[0], h))
            s_fw, out_fw = lax.scan(cell_fw, s0, jnp.swapaxes(x, 0, 1))
            _, out_bw = lax.scan(cell_bw, s0, jnp.swapaxes(x, 0, 1)[::-1])
            loss = (jnp.mean(out_fw ** 2) + jnp.mean(out_bw * out_fw[::-1])
                    + jnp.sum(all_reduce_mean(s_fw) ** 2))
            return loss, (out_fw, out_bw)
        return model

    model = make(lambda v: rt.all_reduce(v, "mean"))
    step = rt.replicate(lambda p, x: jax.value_and_grad(model, has_aux=True)(p, x),
                        num_replicas=n, loss_reduction=reduction)
    (losses, outputs), grads = step(params, rt.distribute(xs, n))
    assert len(outputs) == 2 and all(isinstance(o, rt.PerReplica) for o in outputs)

    ref_model = make(lambda v: lax.pmean(v, "r"))

    @jax.jit
    def oracle(p):
        def objective(p):
            ls, outs = jax.vmap(ref_model, in_axes=(None, 0), axis_name="r")(
                p, xs.reshape(n, b, t, 2))
            return jnp.sum(ls) / (n if reduction == "mean" else 1), (ls, outs)
        return jax.grad(objective, has_aux=True)(p)

    ref_grads, (ref_losses, ref_outs) = oracle(params)
    np.testing.assert_allclose(_local_results(losses, n), ref_losses, rtol=1e-5)
    for o, ref in zip(outputs, ref_outs):
        np.testing.assert_allclose(np.stack(_local_results(o, n)), ref, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e),
                                                         rtol=1e-5, atol=1e-6), grads, ref_grads)


def test_minimize_loss_last_batch_with_empty_replica():
    """The last partial batch smaller than the replica count (``testUnevenDatasetBatches``'
    ``[[8], []]``): 3 rows over 4 replicas, one replica with none. With SUM and
    ``compute_average_loss`` (divide by the global batch size 3) the step is the global
    mean's SGD step (oracle: ``jax.jit`` on the 3 rows); the empty replica adds 0."""
    n = 4
    b = _batches(1, 3, seed=9)[0]

    def step(params, batch, gbs):
        g = jax.grad(lambda p: jnp.sum(_per_example(p, batch["x"], batch["y"])) / gbs)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g)

    rstep = rt.replicate(step, num_replicas=n, loss_reduction="sum", options=DYN)
    batch = rt.distribute_uneven(b, n)
    assert [len(v["x"]) for v in batch.values] == [1, 1, 1, 0]
    params = rstep(_mlp_init(), batch, np.float32(3))
    ref, _ = _oracle_sgd(_mlp_init(), b)
    jax.tree.map(lambda a, e: np.testing.assert_allclose(np.asarray(a), np.asarray(e),
                                                         rtol=2e-5, atol=1e-6), params, ref)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_replica_id(n):
    """``testReplicaId`` (``_test_replica_id``): every replica's id is in ``[0, n)`` and each
    id is seen exactly once; ``testNumReplicasInSync``: ``num_replicas_in_sync`` is n."""
    ids, count = rt.replicate(lambda: (rt.replica_id(), jnp.int32(rt.num_replicas())),
                              num_replicas=n)()
    ids = [int(v) for v in _local_results(ids, n)]
    assert all(0 <= i < n for i in ids)
    expected_devices = [False] * n
    for i in ids:
        assert not expected_devices[i]
        expected_devices[i] = True
    assert expected_devices == [True] * n
    assert [int(c) for c in _local_results(count, n)] == [n] * n


@pytest.mark.parametrize("n", [2, 8])
def test_reduce_to_cpu(n):
    """``testReduceToCpu``: the replica ids reduced with SUM: ``sum(range(n))``."""
    result = rt.replicate(lambda: rt.replica_id(), num_replicas=n)()
    assert int(rt.reduce("sum", result, axis=None)) == sum(range(n))


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("n", [2, 4])
def test_reduce_axis_to_cpu(n, dtype):
    """``testReduceAxisToCpu`` (``reduce_axis_helper``): replica x returns ``[x] * (x + 1)``,
    lists of different lengths on different replicas (a dynamic-shape step here); SUM
    along axis 0 is ``sum(x (x + 1))``, MEAN that over ``sum(x + 1)`` (for int32 too: TF
    divides ``numer / denom`` with true division)."""
    step = rt.replicate(lambda x: x * rt.replica_id().astype(x.dtype), num_replicas=n,
                        options=DYN)
    result = step(rt.PerReplica([np.ones(r + 1, dtype) for r in range(n)]))
    assert [v.tolist() for v in result.values] == [[r] * (r + 1) for r in range(n)]
    expected = sum(x * (x + 1) for x in range(n))
    assert abs(float(rt.reduce("sum", result, axis=0)) - expected) < 1e-5
    expected /= sum(x + 1 for x in range(n))
    assert abs(float(rt.reduce("mean", result, axis=0)) - expected) < 1e-5


def test_replicate_dataset():
    """``testReplicateDataset`` / ``testMakeInputFnIteratorWithDataset``
    (``_test_input_fn_iterable``): ``range(10)`` on two replicas gives ``[i, i + 1]`` per
    step, then ``StopIteration``; iterating again gives the same values."""
    step = rt.replicate(lambda x: x, num_replicas=2)
    expected_values = [[i, i + 1] for i in range(0, 10, 2)]
    batches = [np.arange(i, i + 2, dtype=np.int32) for i in range(0, 10, 2)]
    for _ in range(2):   # "After re-initializing the iterator, should be able to iterate again"
        with rt.distribute_iterator(batches, step=step) as it:
            for expected in expected_values:
                got = [int(v[0]) for v in _local_results(step(next(it)), 2)]
                assert got == expected
            with pytest.raises(StopIteration):
                next(it)


def test_numpy_dataset():
    """``testNumpyDataset`` (``_test_numpy_dataset``): ``(x, y)`` repeated for 2 epochs in
    batches of 6, an identity step on two replicas: the local results concatenated are
    ``x`` and ``y`` each epoch, then the data runs out."""
    x = np.asarray([[1, 2], [6, 12], [2, 4], [5, 10], [3, 6], [4, 8]], np.int32)
    y = np.asarray([5, 4, 3, 2, 1, 0], np.int32)
    step = rt.replicate(lambda z: z, num_replicas=2)
    it = iter([(x, y)] * 2)

    def run_and_concatenate():
        xs, ys = step(rt.distribute(next(it), 2))
        return np.concatenate(_local_results(xs, 2)), np.concatenate(_local_results(ys, 2))

    for _ in range(2):
        x_1, y_1 = run_and_concatenate()
        np.testing.assert_array_equal(x, x_1)
        np.testing.assert_array_equal(y, y_1)
    with pytest.raises(StopIteration):
        run_and_concatenate()


def test_global_step_update():
    """``testGlobalStepUpdate`` (``_test_global_step_update``): an int64 ``global_step``
    (ONLY_FIRST_REPLICA aggregation) ``assign_add(1)`` in every replica reads 1 on every
    replica. A mirrored counter the step increments: every replica adds the same 1, so
    the result is one array (no aggregation is needed)."""
    n = 2
    step = rt.replicate(lambda gs: (gs + 1, gs + 1), num_replicas=n)
    global_step, value = step(np.int32(0))
    assert not isinstance(global_step, rt.PerReplica)
    assert tuple(int(v) for v in _local_results(value, n)) == (1,) * n


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "run_in_function"])
def test_run_two_device(in_function):
    """``TwoDeviceDistributionTestBase._test_run``: ``replica_id + 1`` gives ``[1, 2]``;
    a step on those per-replica results returns ``{"a": x * 2, "b": x * x}``:
    ``[2, 4]``, ``[1, 4]``; one taking them as keyword arguments ``a + 2 b + 2``:
    ``[6, 14]`` (``run_in_function``: each fn in ``jax.jit``)."""
    wrap = jax.jit if in_function else (lambda f: f)
    out1 = rt.replicate(wrap(lambda: rt.replica_id() + 1), num_replicas=2)()
    assert [int(v) for v in _local_results(out1, 2)] == [1, 2]
    out2 = rt.replicate(wrap(lambda x: {"a": x * 2, "b": x * x}), num_replicas=2)(out1)
    assert [int(v) for v in _local_results(out2["a"], 2)] == [2, 4]
    assert [int(v) for v in _local_results(out2["b"], 2)] == [1, 4]
    out3 = rt.replicate(wrap(lambda b, a: a + 2 * b + 2), num_replicas=2)(**out2)
    assert [int(v) for v in _local_results(out3, 2)] == [6, 14]


def test_run_one_device():
    """``OneDeviceDistributionTestBase._test_run``: ``[4.]``, ``[8.]`` and ``[16.]``,
    ``[42.]`` on one replica."""
    out1 = rt.replicate(lambda: jnp.float32(4.), num_replicas=1)()
    assert _local_results(out1, 1) == [4.]
    out2 = rt.replicate(lambda x: {"a": x * 2, "b": x * x}, num_replicas=1)(out1)
    assert _local_results(out2["a"], 1) == [8.] and _local_results(out2["b"], 1) == [16.]
    out3 = rt.replicate(lambda b, a: a + 2 * b + 2, num_replicas=1)(**out2)
    assert _local_results(out3, 1) == [42.]


_COMMS = {  # (n, op): (inputs per replica, expected on every replica)
    (2, "sum"): (([1., 3.], [[39., 2.], [3., 41.]]), (4., [42., 43.])),
    (2, "mean"): (([1., 3.], [[39., 2.], [3., 41.]]), (2., [21., 21.5])),
    (1, "sum"): (([4.], [[42., 43.]]), (4., [42., 43.])),
    (1, "mean"): (([2.], [[21., 22.]]), (2., [21., 22.])),
}


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "run_in_function"])
@pytest.mark.parametrize("n,op", list(_COMMS), ids=["TwoDevice_AllReduceSum",
                                                  "TwoDevice_AllReduceMean",
                                                  "OneDevice_AllReduceSum",
                                                  "OneDevice_AllReduceMean"])
def test_all_reduce(n, op, in_function):
    """``testAllReduceSum`` / ``testAllReduceMean`` (``_test_collective_comms``): a dataset
    of ``(scalar, vector)`` slices, one per replica, all-reduced in replica context;
    every replica gets the expected pair."""
    (a, b), expected = _COMMS[(n, op)]
    fn = lambda x, y: (rt.all_reduce(x, op), rt.all_reduce(y, op))  # noqa: E731
    step = rt.replicate(jax.jit(fn) if in_function else fn, num_replicas=n)
    outputs = step(_pr(a), _pr(b))
    for r in range(n):
        assert float(_local_results(outputs[0], n)[r]) == expected[0]
        assert _local_results(outputs[1], n)[r].tolist() == expected[1]


_GRADS = {(2, "sum"): ([1., 3.], [4., 4.]), (2, "mean"): ([1., 3.], [2., 2.]),
          (1, "sum"): ([4.], [4.]), (1, "mean"): ([5.], [5.])}


@pytest.mark.parametrize("x_kind", ["identity", "local"])
@pytest.mark.parametrize("api", ["gradients", "gradient_tape"])
@pytest.mark.parametrize("n,op", list(_GRADS), ids=["TwoDevice_Sum", "TwoDevice_Mean",
                                                  "OneDevice_Sum", "OneDevice_Mean"])
def test_all_reduce_gradients(n, op, api, x_kind):
    """``testAllReduce{Sum,Mean}Gradients`` / ``...GradientTape``
    (``_test_collective_comms_gradients``): ``x = identity(42.)``, ``y = all_reduce(x) * c``
    with c the replica's input; ``dy/dx`` is the sum of the c's (SUM) or their mean
    (MEAN) on every replica: ``[4., 4.]`` / ``[2., 2.]`` for c = 1, 3. ``x`` is a constant
    (mirrored; ``loss_reduction="mean"``) or its per-replica view ``rt.local``."""
    cs, expected = _GRADS[(n, op)]

    def step(c):
        x = jnp.float32(42.)
        if x_kind == "local":
            x = rt.local(x)
        f = lambda x: rt.all_reduce(x, op) * c  # noqa: E731
        if api == "gradients":
            return jax.grad(f)(x)
        y, vjp = jax.vjp(f, x)
        return vjp(jnp.ones_like(y))[0]

    with _constant_sum():  # (the seed of the gradient, ones, is a constant)
        out = rt.replicate(step, num_replicas=n)(_pr(cs))
    assert [float(v) for v in _local_results(out, n)] == expected


def test_function_in_call_for_each_replica():
    """``testFunctionInCallForEachReplica`` / ``...InsideAnotherFunction``: a
    ``tf.function`` returning ``replica_id_in_sync_group`` gives ``(0, 1)``; here the step
    is ``jax.jit``-wrapped, also inside another ``jax.jit``. (TF traces it once per
    replica; ``replicate`` traces the step once for all replicas.)"""
    traces = []

    @jax.jit
    def model_fn():
        traces.append(1)
        return rt.replica_id()

    assert tuple(int(v) for v in _local_results(rt.replicate(model_fn, num_replicas=2)(), 2)) == (0, 1)
    nested = rt.replicate(jax.jit(lambda: model_fn()), num_replicas=2)
    assert tuple(int(v) for v in _local_results(nested(), 2)) == (0, 1)
    assert len(traces) >= 1


# -- MirroredVariableUpdateTest ------------------------------------------------------------

_MEAN_UPDATES = {
    # test name: (initial, update(v, replica_id as float), expected)
    "testAssignMirroredVarReplicaContextWithoutAggregationType": (1.0, lambda v, r: 5.0, 5.0),
    "testAssignMirroredVarReplicaContext": (1.0, lambda v, r: r, 0.5),
    "testAssignMirroredVarReplicaContextWithSingleValue": (1.0, lambda v, r: 5.0, 5.0),
    "testAssignAddMirroredVarReplicaContext": (1.0, lambda v, r: v + r, 1.5),
    "testAssignAddMirroredVarReplicaContextWithSingleValue": (1.0, lambda v, r: v + 5.0, 6.0),
    "testAssignSubMirroredVarReplicaContext": (5.0, lambda v, r: v - r, 4.5),
    "testAssignSubMirroredVarReplicaContextWithSingleValue": (5.0, lambda v, r: v - 1.0, 4.0),
}


@pytest.mark.parametrize("name", list(_MEAN_UPDATES))
def test_mirrored_var_mean_aggregation(name):
    """``MirroredVariableUpdateTest``: a mirrored variable (``aggregation=MEAN``) assigned
    in replica context on two replicas, e.g. ``assign(replica_id)`` reads 0.5 and
    ``assign_add(replica_id)`` from 1.0 reads 1.5. Here the step returns the new value
    averaged with ``rt.all_reduce(..., "mean")`` (the aggregation TF applies); a value
    identical on every replica (5.0) is unchanged by it."""
    init, update, expected = _MEAN_UPDATES[name]

    def model_fn(v):
        return rt.all_reduce(jnp.asarray(update(v, rt.replica_id().astype(jnp.float32)),
                                         jnp.float32), "mean")

    mirrored_var = rt.replicate(model_fn, num_replicas=2)(np.float32(init))
    assert not isinstance(mirrored_var, rt.PerReplica)
    assert float(mirrored_var) == expected


def test_mirrored_var_unaggregated_per_replica_assign_warns():
    """The other side of ``testAssignMirroredVarReplicaContext``: a per-replica value
    written into a mirrored variable with no aggregation. TF aggregates (or refuses);
    ``replicate`` keeps each replica's value and warns that the state diverges (for a
    step returning a tuple or list, whose result i is argument i's new value: the
    documented rule of ``runtime/divergence.py``)."""
    step = rt.replicate(lambda v: (rt.replica_id().astype(jnp.float32),), num_replicas=2)
    with pytest.warns(rt.DivergingStateWarning):
        out, = step(np.float32(1.0))
    assert [float(v) for v in _local_results(out, 2)] == [0.0, 1.0]


def test_mirrored_var_sum_aggregation_of_single_value():
    """``testAssignMirroredVarReplicaContextWithSum``: TF refuses to SUM-aggregate a value
    that is not per-replica (``ValueError: A non-DistributedValues value 5.0 cannot be
    reduced with the given reduce op ReduceOp.SUM``). ``rt.all_reduce`` has no
    aggregation mode to refuse with: the sum of the constant 5.0 is what it says,
    ``2 * 5.0`` (a sum of constants counts the replicas: no warning)."""
    step = rt.replicate(lambda v: rt.all_reduce(jnp.float32(5.0), "sum"), num_replicas=2)
    with _constant_sum():
        out = step(np.float32(1.0))
    assert float(out) == 10.0


# -- MirroredStrategyDefunTest / FunctionTest ----------------------------------------------

def _mock_model(variables, factor=2):
    x = factor * variables[0]
    if len(variables) > 1:
        x += variables[1]
    return x


@jax.jit
def _fn1(variables, factor=2.):
    return _mock_model(variables, factor)


@jax.jit
def _fn2(variables):
    return _fn1(variables) + 1


_DEFUN = {
    "testVariableInDefun": ([1.25], lambda v: _fn1(v), 2.5),
    "testVariableInNestedDefun": ([1.25], lambda v: _fn2(v), 3.5),
    "testTwoVariablesInNestedDefun": ([1.25, 2.0], lambda v: _fn2(v), 5.5),
    "testGradientTapeOverNestedDefuns": ([1.25, 2.0], lambda v: jax.grad(_fn2)(v), [2.0, 1.0]),
}


@pytest.mark.parametrize("name", list(_DEFUN))
def test_defun(name):
    """``MirroredStrategyDefunTest``: a mock model (``factor * v0 (+ v1)``, v0 = 1.25,
    v1 = 2.0) called through nested ``tf.function``s (``jax.jit`` here) in each replica;
    the gradient of ``fn2`` with respect to the variables is ``[2.0, 1.0]`` (the loss is
    identical on every replica: with ``loss_reduction="mean"`` its all-reduced gradient is
    the replica's own)."""
    init, fn, expected = _DEFUN[name]
    result = rt.replicate(fn, num_replicas=2)([np.float32(v) for v in init])
    for device_result in _local_tree(result, 2):
        np.testing.assert_allclose(np.asarray(device_result, np.float32), expected)


def test_defun_pass_per_replica():
    """``MirroredStrategyDefunTest.testPassPerReplica``: ``fn1(model, factor)`` with
    factors ``PerReplica((5.0, 3.0))``: ``(5.0 * 1.25, 3.0 * 1.25)``."""
    result = rt.replicate(lambda v, f: _fn1(v, f), num_replicas=2)([np.float32(1.25)],
                                                                   _pr([5.0, 3.0]))
    assert [float(x) for x in _local_results(result, 2)] == [5.0 * 1.25, 3.0 * 1.25]


def test_backward_function():
    """``FunctionTest.testBackwardFunctionDevicePlacement``: ``w = [1.5]``, ``b = [0.5]``,
    a ``tf.function`` ``x * w + b`` at ``x = [1.0]``; the gradient of ``forward - [1.0]``
    with respect to ``[w, b]`` is 1.0 each (TF checks the primary replica's)."""
    forward = jax.jit(lambda x, w, b: x * w + b)

    def replica_fn(w, b):
        x = jnp.asarray([1.0])
        return jax.grad(lambda w, b: jnp.sum(forward(x, w, b) - jnp.asarray([1.0])),
                        argnums=(0, 1))(w, b)

    g1, g2 = rt.replicate(replica_fn, num_replicas=2)(np.asarray([1.5], np.float32),
                                                      np.asarray([0.5], np.float32))
    assert _local_results(g1, 2)[0].tolist() == [1.0]
    assert _local_results(g2, 2)[0].tolist() == [1.0]


# =========================================================================================
# sync-on-read variables: mirrored_strategy_test.py, mirrored_variable_test.py, values_test.py
# =========================================================================================

def test_only_first_replica_updates_variables():
    """``MirroredVariableCreationTest.testOnlyFirstReplicaUpdatesVariables`` on two replicas:
    ``v0`` (ON_READ, ONLY_FIRST_REPLICA, 2.0) ``assign_add(5 (id + 1))``: the replicas
    hold 7 and 12, a read gives replica 0's 7; then ``+ 11 (id + 1)``: 18 and 34, read 18.
    ``v1`` (ON_WRITE, ONLY_FIRST_REPLICA, 3.0) ``assign_add(7 (id + 1))``: only replica
    0's argument is used, 10 everywhere, then ``+ 13 (id + 1)``: 23. ``rt.SyncOnRead(...,
    "only_first_replica")`` for v0; for v1 (no ``rt`` aggregation of mirrored writes) the
    step broadcasts replica 0's increment itself."""
    v0 = rt.SyncOnRead(np.float32(2.0), aggregation="only_first_replica", num_replicas=2)
    v1 = np.float32(3.0)
    assert [float(x) for x in v0.values] == [2.0, 2.0] and float(v0.read()) == 2.0

    def update(v0, v1, k0, k1):
        replica_id_plus_one = (rt.replica_id() + 1).astype(jnp.float32)
        inc1 = k1 * replica_id_plus_one
        first = rt.all_reduce(jnp.where(rt.replica_id() == 0, inc1, 0.0), "sum")
        return v0.update(lambda x: x + k0 * replica_id_plus_one), v1 + first

    step = rt.replicate(update, num_replicas=2)
    v0, v1 = step(v0, v1, np.float32(5.0), np.float32(7.0))
    assert [float(x) for x in v0.values] == [2.0 + 5.0, 2.0 + 2 * 5.0]
    assert float(v0.read()) == 2.0 + 5.0
    assert [float(x) for x in _local_results(v1, 2)] == [3.0 + 7.0] * 2
    v0, v1 = step(v0, v1, np.float32(11.0), np.float32(13.0))
    assert [float(x) for x in v0.values] == [2.0 + 5.0 + 11.0, 2.0 + 2 * 5.0 + 2 * 11.0]
    assert float(v0.read()) == 2.0 + 5.0 + 11.0
    assert [float(x) for x in _local_results(v1, 2)] == [3.0 + 7.0 + 13.0] * 2


@pytest.mark.parametrize("n", [2, 4])
def test_sync_on_read_variable(n):
    """``MirroredVariableCreationTest.testSyncOnReadVariable``: ``v_sum`` (SUM, 1.0)
    ``assign_add(2.0 + replica_id)`` and ``v_mean`` (MEAN, 4.0) ``assign(6.0 * replica_id)``:
    replica i holds ``i + 3`` and ``6 i``; reads give their sum and mean."""
    v_sum = rt.SyncOnRead(np.float32(1.0), aggregation="sum", num_replicas=n)
    v_mean = rt.SyncOnRead(np.float32(4.0), aggregation="mean", num_replicas=n)

    def model_fn(v_sum, v_mean):
        rid = rt.replica_id().astype(jnp.float32)
        return v_sum.update(lambda v: v + 2.0 + rid), v_mean.assign(6.0 * rid)

    ret_v_sum, ret_v_mean = rt.replicate(model_fn, num_replicas=n)(v_sum, v_mean)
    expected_sum = expected_mean = 0.0
    for i in range(n):
        assert float(ret_v_sum.values[i]) == i + 3.0
        expected_sum += i + 3.0
        assert float(ret_v_mean.values[i]) == i * 6.0
        expected_mean += i * 6.0
    expected_mean /= n
    assert float(ret_v_sum.read()) == expected_sum
    assert float(ret_v_mean.read()) == expected_mean


def test_sync_on_read_variable_update():
    """``MirroredVariableCreationTest.testSyncOnReadVariableUpdate``: a SUM sync-on-read 1.0
    on two replicas: replica 0 reads 1.0, the variable 2.0; ``extended.update`` assigning
    5.0 to each component: 5.0 and 10.0 (``reset(5.0)``: every replica's value 5.0)."""
    ret_v_sum = rt.SyncOnRead(np.float32(1.0), aggregation="sum", num_replicas=2)
    assert float(ret_v_sum.values[0]) == 1.0 and float(ret_v_sum.read()) == 2.0
    ret_v_sum = ret_v_sum.reset(np.float32(5.0))
    assert float(ret_v_sum.values[0]) == 5.0 and float(ret_v_sum.read()) == 10.0


@pytest.mark.parametrize("aggregation,read", [("sum", 2.0), ("mean", 1.0)],
                         ids=["testAssignReplicaLocalVarSumAggregation",
                              "testAssignReplicaLocalVarMeanAggregation"])
def test_assign_replica_local_var(aggregation, read):
    """``SyncOnReadVariableAssignTest``: each replica holds 1.0 (set in replica context);
    a read is their SUM (2.0) or MEAN (1.0). Assigning 6.0 in cross-replica context
    (``assign`` outside a step) reads 6.0: TF's SUM variable gets ``6.0 / n`` per replica,
    its MEAN one 6.0 each. (``reset(6.0)`` sets each replica's value instead.)"""
    v = rt.SyncOnRead(np.float32(0.0), aggregation=aggregation, num_replicas=2)
    v = rt.replicate(lambda v: v.assign(jnp.float32(1.0)), num_replicas=2)(v)
    assert float(v.read()) == read
    w = v.assign(np.float32(6.0))
    assert float(w.read()) == 6.0 and w.aggregation == aggregation
    assert [float(x) for x in w.values] == ([3.0, 3.0] if aggregation == "sum" else [6.0, 6.0])
    if aggregation == "mean":
        assert float(v.reset(np.float32(6.0)).read()) == 6.0


@pytest.mark.parametrize("aggregation,final_read", [("mean", 4.5), ("sum", 9.0),
                                                    ("only_first_replica", 3.0)])
def test_strategy_extended_update_on_read(aggregation, final_read):
    """``DistributedVariableTest.testStrategyExtendedUpdate`` (ON_READ): a variable 0.
    updated with ``PerReplica([1., 2.])``: ``assign`` -> ``[1, 2]``, ``assign_add`` ->
    ``[2, 4]``, ``assign_sub`` -> ``[1, 2]``, ``assign_add(value() + read_value())`` ->
    ``[3, 6]`` (each component reads its own value); then the aggregated read."""
    v = rt.SyncOnRead(np.float32(0.0), aggregation=aggregation, num_replicas=2)
    value = _pr([1., 2.])
    fns = [lambda v, value: v.assign(value),
           lambda v, value: v.update(lambda x: x + value),
           lambda v, value: v.update(lambda x: x - value),
           lambda v, value: v.update(lambda x: x + (x + x))]
    for fn, expected in zip(fns, [[1., 2.], [2., 4.], [1., 2.], [3., 6.]]):
        v = rt.replicate(fn, num_replicas=2)(v, value)
        assert [float(x) for x in v.values] == expected
    assert float(v.read()) == final_read


# =========================================================================================
# values_test.py: DistributedValuesTest.testMakeDistributedValue*
# =========================================================================================

def _gather(value, n):
    """``test_util.gather(strategy, value)``: every replica's value stacked (axis 0),
    here through an all-gather inside a step."""
    return rt.replicate(lambda v: rt.all_gather(v, axis=0, tiled=False), num_replicas=n)(value)


_MAKE = {
    "testMakeDistributedValueFromTensor":
        (lambda ctx: np.int32(1), lambda n: np.ones(n)),
    "testMakeDistributedValueSingleNumpyArrayConstant":
        (lambda ctx: np.array([1., 2., 3.], np.float32), lambda n: [[1., 2., 3.]] * n),
    "testMakeDistributedValueTupleConstant":
        (lambda ctx: (np.float32(1.), np.float32(2.), np.float32(3.)),
         lambda n: tuple([v for _ in range(n)] for v in (1., 2., 3.))),
    "testMakeDistributedValueNestedStructurePerReplica":
        (lambda ctx: tuple(np.float32(v * ctx.replica_id) for v in (1., 2., 3.)),
         lambda n: tuple([v * i for i in range(n)] for v in (1., 2., 3.))),
    "testMakeDistributedValueExtractFromArray":
        (lambda ctx: np.int32(range(ctx.num_replicas)[ctx.replica_id]), lambda n: list(range(n))),
}


@pytest.mark.parametrize("name", list(_MAKE))
def test_make_distributed_value(name):
    """``experimental_distribute_values_from_function``: the gathered values, e.g. a tuple
    ``(1., 2., 3.)`` gives ``([1., 1.], [2., 2.], [3., 3.])`` on two replicas, and
    ``v * replica_id`` gives ``([0., 1.], [0., 2.], [0., 3.])``."""
    n = 4
    value_fn, expected = _MAKE[name]
    got = _gather(rt.distribute_values_from_function(value_fn, n), n)
    got = jax.tree.map(lambda a: np.asarray(a).tolist(), got)
    expected = expected(n)
    if isinstance(expected, tuple):
        assert tuple(got) == expected
    else:
        np.testing.assert_array_equal(got, expected)


def test_make_distributed_value_and_run():
    """``testMakeDistributedValueAndRun``: values ``range(n)[replica_id]``, a step squaring
    them, gathered: ``[i ** 2 for i in range(n)]``."""
    n = 4
    values = rt.distribute_values_from_function(lambda ctx: np.int32(ctx.replica_id), n)
    out = rt.replicate(lambda x: rt.all_gather(jnp.square(x), tiled=False), num_replicas=n)(values)
    assert np.asarray(out).tolist() == [i ** 2 for i in range(n)]


# =========================================================================================
# cross_device_ops_test.py
# =========================================================================================

_DENSE = {1: 1.0, 2: {"sum": 3.0, "mean": 1.5}, 4: {"sum": 10.0, "mean": 2.5}}
_BATCH = {1: [1.0, 2.0], 2: {"sum": [4.0, 6.0], "mean": [2.0, 3.0]},
          4: {"sum": [16.0, 20.0], "mean": [4.0, 5.0]}}


def _expect(table, n, op):
    e = table[n]
    return e if n == 1 else e[op]


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_reduce_dense(n, op):
    """``CollectiveOpsTest.testReduceDense`` / ``testBatchReduceDense``: replica i holds
    ``[1., 2., 3., 4.][i]`` (batch: ``[[1, 2], [3, 4], [5, 6], [7, 8]][i]``); reduced, every
    replica gets 1 / 3 / 10 (SUM) or 1 / 1.5 / 2.5 (MEAN) (batch: ``[4, 6]`` / ``[16, 20]``,
    ``[2, 3]`` / ``[4, 5]``). In replica context (``rt.all_reduce`` of a value and of a
    tuple) and on the host (``rt.reduce``)."""
    inputs = [1.0, 2.0, 3.0, 4.0][:n]
    pairs = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]][:n]
    step = rt.replicate(lambda x, b: (rt.all_reduce(x, op), rt.all_reduce(b, op)), num_replicas=n)
    got, batch = step(_pr(inputs), rt.PerReplica([tuple(np.float32(v) for v in p) for p in pairs]))
    assert [float(v) for v in _local_results(got, n)] == [_expect(_DENSE, n, op)] * n
    for b in _local_tree(batch, n):
        assert [float(v) for v in b] == _expect(_BATCH, n, op)
    assert float(rt.reduce(op, _pr(inputs))) == _expect(_DENSE, n, op)
    host = rt.reduce(op, rt.PerReplica([tuple(np.float32(v) for v in p) for p in pairs]))
    assert [float(v) for v in host] == _expect(_BATCH, n, op)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_all_reduce_dense_constant(n, op):
    """``CollectiveOpsTest.testAllReduceDense``: ``constant(1.0)`` on every replica
    all-reduced: ``n`` (SUM) or 1.0 (MEAN); the pair ``(1.0, 2.0)``: ``(n, 2 n)`` or
    ``(1.0, 2.0)``."""
    step = rt.replicate(lambda: (rt.all_reduce(jnp.float32(1.0), op),
                                 rt.all_reduce((jnp.float32(1.0), jnp.float32(2.0)), op)),
                        num_replicas=n)
    with _constant_sum():
        got, pair = step()
    k = n if op == "sum" else 1
    assert [float(v) for v in _local_results(got, n)] == [1.0 * k] * n
    for p in _local_tree(pair, n):
        assert [float(v) for v in p] == [1.0 * k, 2.0 * k]


@pytest.mark.parametrize("n", [1, 2, 8])
def test_reduction_and_broadcast(n):
    """``CrossDeviceOpsTestBase._testReductionAndBroadcast``: replica d holds ``float(d)``
    (mean ``(n - 1) / 2``) and ``d + 1.0`` (mean + 1); ``reduce`` MEAN / SUM gives the mean
    and ``mean * n``, ``batch_reduce`` of both the pair; ``broadcast(1.)`` is 1.0 on every
    replica."""
    per_replica = _pr([float(d) for d in range(n)])
    per_replica_2 = _pr([d + 1.0 for d in range(n)])
    mean = (n - 1.) / 2.
    mean_2 = mean + 1.
    assert float(rt.reduce("mean", per_replica)) == mean
    assert float(rt.reduce("mean", per_replica_2)) == mean_2
    assert float(rt.reduce("sum", per_replica)) == mean * n
    assert float(rt.reduce("sum", per_replica_2)) == mean_2 * n
    assert [float(v) for v in rt.reduce("mean", (per_replica, per_replica_2))] == [mean, mean_2]
    assert [float(v) for v in rt.reduce("sum", (per_replica, per_replica_2))] == [mean * n,
                                                                                  mean_2 * n]
    broadcast = rt.replicate(lambda: jnp.float32(1.), num_replicas=n)()
    assert [float(v) for v in _local_results(broadcast, n)] == [1.0] * n


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_all_gather_same_shape(axis):
    """``CollectiveOpsTest.testAllGatherSameShape``: ``[[[1, 2], [1, 2]]]`` on every replica
    gathered along ``axis``: ``concat([value] * n, axis)`` on every replica."""
    value = np.asarray([[[1, 2], [1, 2]]], np.float32)
    for n in (1, 2, 4):
        got = rt.replicate(lambda v: rt.all_gather(v, axis=axis), num_replicas=n)(value)
        expect = np.concatenate([value] * n, axis=axis)
        for g in _local_results(got, n):
            np.testing.assert_array_equal(g, expect)


def test_all_gather_diff_value():
    """``strategy_gather_test.testAllGatherDiffValueTPU``: ``[[1], ..., [8]]`` batched by
    8 and distributed; each replica all-gathers its rows along axis 0: the whole batch on
    every replica."""
    data = np.asarray([[1], [2], [3], [4], [5], [6], [7], [8]], np.int32)
    for n in (2, 4, 8):
        result = rt.replicate(lambda v: rt.all_gather(v, axis=0), num_replicas=n)(
            rt.distribute(data, n))
        assert [r.tolist() for r in _local_results(result, n)] == [data.tolist()] * n


def test_all_gather_diff_shape_at_axis0_is_refused():
    """``strategy_gather_test.testAllGatherDiffShapeAtAxis0``: shapes ``[1, 1]``,
    ``[2, 1]`` gathered to ``[3, 1]``. TPUStrategy skips it ("TPU does not support
    all_gather different shapes"); a dynamic-shape step refuses the gather of a padded
    axis before XLA runs (it cannot be made exact) instead of gathering padding."""
    per_replica_value = rt.distribute_values_from_function(
        lambda ctx: np.ones((ctx.replica_id + 1, 1), np.int32), 2)
    step = rt.replicate(lambda v: rt.all_gather(v, axis=0), num_replicas=2, options=DYN)
    with pytest.raises(PaddingError, match="all_gather(_invariant)? .* padded"):
        step(per_replica_value)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_through_all_gather(reduction):
    """The gradient through a replica-context all-gather (TF: the gather's gradient is
    each replica's slice of the all-reduced upstream gradient): replica r's loss weighs
    the gathered activations of every replica by its own coefficients; the parameters'
    gradient, SUM / MEAN reduced, is that of the sum / mean of the replicas' losses
    (oracle: ``jax.jit`` of the global objective on one device)."""
    n, gbs = 4, 8
    rs = np.random.RandomState(7)
    x = rs.normal(size=(gbs, 3)).astype(np.float32)
    c = rs.normal(size=(n, gbs, 2)).astype(np.float32)
    w = rs.normal(size=(3, 2)).astype(np.float32)

    def step(w, x, c):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(rt.all_gather(x @ w, axis=0)) * c[0]))(w)

    got = rt.replicate(step, num_replicas=n, loss_reduction=reduction)(
        w, rt.distribute(x, n), rt.distribute(c, n))
    expected = jax.jit(jax.grad(lambda w: sum(jnp.sum(jnp.tanh(x @ w) * c[r]) for r in range(n))
                                / (n if reduction == "mean" else 1)))(w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_collective_in_cond(n):
    """``CollectiveOpsTest.testCollectiveV2ControlFlow``: a SUM reduce of ``[1.]`` in both
    branches of a ``cond`` on a constant predicate: ``[1. * n]``."""
    def reduce_fn(v):
        def cond_body(v):
            return rt.all_reduce(v, "sum")
        return lax.cond(jnp.asarray(False), cond_body, cond_body, v)

    step = rt.replicate(reduce_fn, num_replicas=n)
    with _identical_sum(n):
        got = step(np.asarray([1.], np.float32))
    for g in _local_results(got, n):
        assert g.tolist() == [1. * n]


def test_merge_call_in_loop():
    """``testControlFlowFunctionInCallForEachReplicaWithMergeCall``: TF refuses a
    ``merge_call`` (a cross-replica reduce) inside a ``while_loop`` in replica context
    ("`merge_call` called while defining a new graph"). Its ``rt`` counterpart, an
    all-reduce inside a loop whose trip count every replica shares, is allowed: three
    rounds of ``v + mean(v)`` from ``[0, 2]`` give ``[7, 9]``; a trip count that differs
    between replicas is refused (``DivergentCollectiveError``) before XLA runs."""
    def body(i, v):
        return v + rt.all_reduce(v, "mean")

    step = rt.replicate(lambda v: lax.fori_loop(0, 3, body, v), num_replicas=2)
    assert [float(v) for v in _local_results(step(_pr([0., 2.])), 2)] == [7.0, 9.0]

    def divergent(v, k):
        return lax.while_loop(lambda c: c[0] < k, lambda c: (c[0] + 1, body(0, c[1])),
                              (jnp.int32(0), v))[1]

    with pytest.raises(DivergentCollectiveError):
        rt.replicate(divergent, num_replicas=2)(_pr([0., 2.]), _pr([1, 2], np.int32))


@pytest.mark.parametrize("loop", ["fori_loop", "scan", "while_loop"])
def test_merge_call_in_loop_carry_becomes_mirrored(loop):
    """The same loop as ``test_merge_call_in_loop`` written as pmap code writes it: each
    round's carry is ``mean(v) + 1``, so the carry comes in per-replica and leaves
    identical on every replica. ``jax.pmap(..., axis_name)`` gives ``[4., 4.]`` from
    ``[0., 2.]`` (the README's "Porting from pmap": the code runs unchanged)."""
    body = lambda v: lax.pmean(v, "batch") + 1.0  # noqa: E731
    fns = {"fori_loop": lambda v: lax.fori_loop(0, 3, lambda i, v: body(v), v),
           "scan": lambda v: lax.scan(lambda c, _: (body(c), None), v, None, length=3)[0],
           "while_loop": lambda v: lax.while_loop(lambda c: c[0] < 3,
                                                  lambda c: (c[0] + 1, body(c[1])),
                                                  (0, v))[1]}
    step = rt.replicate(fns[loop], num_replicas=2, axis_name="batch")
    assert [float(v) for v in _local_results(step(_pr([0., 2.])), 2)] == [4.0, 4.0]


def test_collective_in_divergent_cond_is_refused():
    """The counterpart of ``testCollectiveV2ControlFlow`` with a per-replica predicate:
    a collective inside a branch that replicas take differently would hang a real
    all-reduce; ``replicate`` refuses it before XLA runs."""
    def reduce_fn(v, p):
        return lax.cond(p, lambda v: rt.all_reduce(v, "sum"), lambda v: v, v)

    with pytest.raises(DivergentCollectiveError):
        rt.replicate(reduce_fn, num_replicas=2)(np.asarray([1.], np.float32),
                                                rt.PerReplica([np.bool_(True), np.bool_(False)]))


def test_reduce_distributed_variable():
    """``testReduceDistributedVariable``: a mirrored variable 1.0 reduced with MEAN:
    ``[1.0, 1.0]``; with SUM (TF's semantics of a mirrored value) ``n`` copies."""
    v = rt.replicate(lambda v: v, num_replicas=2)(np.float32(1.0))
    assert float(rt.reduce("mean", v)) == 1.0
    assert float(rt.reduce("sum", v)) == 2.0


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_indexed_slices_all_reduce(op):
    """``_testIndexedSlicesAllReduce`` densified (JAX has no ``IndexedSlices``): replica 0
    holds rows ``[[1, 2]]`` at indices ``[1]``, replica 1 ``[[3, 4], [5, 6]]`` at ``[1, 3]``
    of a ``[5, 2]`` tensor (a different number of rows per replica: dynamic shapes);
    scattered and all-reduced: rows 1 and 3 are ``[4, 6]``, ``[5, 6]`` (SUM) or
    ``[2, 3]``, ``[2.5, 3]`` (MEAN), the rest 0."""
    def fn(values, indices):
        dense = jnp.zeros((5, 2), jnp.float32).at[indices].add(values)
        return rt.all_reduce(dense, op)

    step = rt.replicate(fn, num_replicas=2, options=DYN)
    out = step(rt.PerReplica([np.asarray([[1., 2.]], np.float32),
                              np.asarray([[3., 4.], [5., 6.]], np.float32)]),
               rt.PerReplica([np.asarray([1], np.int32), np.asarray([1, 3], np.int32)]))
    rows = {"sum": [[4., 6.], [5., 6.]], "mean": [[2., 3.], [2.5, 3.]]}[op]
    expected = np.zeros((5, 2), np.float32)
    expected[[1, 3]] = rows
    for g in _local_results(out, 2):
        np.testing.assert_array_equal(g, expected)


def test_reduce_sparse_variable_length():
    """``testReduceSparseVariableLength`` densified: ``[[1.]]`` at ``[0]`` and
    ``[[2.], [3.], [4.]]`` at ``[0, 1, 2]`` of a ``[10, 1]`` tensor, SUM: the expected
    slices ``[[1], [2], [3], [4]]`` at ``[0, 0, 1, 2]``, i.e. ``[3, 3, 4, 0, ...]``."""
    def fn(values, indices):
        return rt.all_reduce(jnp.zeros((10, 1), jnp.float32).at[indices].add(values), "sum")

    out = rt.replicate(fn, num_replicas=2, options=DYN)(
        rt.PerReplica([np.asarray([[1.]], np.float32), np.asarray([[2.], [3.], [4.]], np.float32)]),
        rt.PerReplica([np.asarray([0], np.int32), np.asarray([0, 1, 2], np.int32)]))
    expected = np.zeros((10, 1), np.float32)
    np.add.at(expected, [0, 0, 1, 2], [[1.], [2.], [3.], [4.]])
    for g in _local_results(out, 2):
        np.testing.assert_array_equal(g, expected)


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_sparse_gradient_all_reduce(op):
    """The case ``IndexedSlices`` all-reduce exists for: the gradient of an embedding
    lookup (TF's sparse gradient, dense here) with per-replica ids of different lengths,
    all-reduced by ``replicate`` (MEAN: ``loss_reduction="mean"``, each replica's mean
    loss; SUM: ``"sum"`` with the sum over the global batch), against ``jax.jit`` of the
    same averages on one device."""
    table = np.arange(10, dtype=np.float32).reshape(5, 2) / 10
    ids = [np.asarray([1], np.int32), np.asarray([1, 3], np.int32)]

    def loss(t, i):
        return jnp.sum(jnp.take(t, i, axis=0) ** 2) / (1. if op == "sum" else i.shape[0])

    got = rt.replicate(lambda t, i: jax.grad(loss)(t, i), num_replicas=2, loss_reduction=op,
                       options=DYN)(table, rt.PerReplica(ids))
    grads = [jax.jit(jax.grad(lambda t, i=i: jnp.sum(jnp.take(t, i, axis=0) ** 2)
                              / (1. if op == "sum" else len(i))))(table) for i in ids]
    expected = (grads[0] + grads[1]) / (1. if op == "sum" else 2.)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6)


# =========================================================================================
# input_lib_test.py / strategy_common_test.py
# =========================================================================================

@pytest.mark.parametrize("drop_remainder", [False, True])
def test_uneven_dataset_batches(drop_remainder):
    """``InputIterationTest.testUnevenDatasetBatches``: ``range(9)`` in global batches of 4
    on two replicas: ``[[0, 1], [2, 3]]``, ``[[4, 5], [6, 7]]``, then (without
    ``drop_remainder``) ``[[8], []]``: the last global batch only has data for one
    replica."""
    data = np.arange(9, dtype=np.int32)
    batches = [data[i:i + 4] for i in range(0, 9, 4)]
    if drop_remainder:
        batches = [b for b in batches if len(b) == 4]
        expected_values = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    else:
        expected_values = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
    step = rt.replicate(lambda x: x, num_replicas=2, options=DYN)
    got = [[v.tolist() for v in _local_results(step(rt.distribute_uneven(b, 2)), 2)]
           for b in batches]
    assert got == expected_values


def test_distribute_iterator_partial_last_batch_is_refused():
    """``testUnevenDatasetBatches`` through the input pipeline: ``rt.distribute_iterator``
    splits each global batch evenly, so the partial last one (``[8]`` on two replicas) is
    a clear error naming the shape (TF's distributed dataset yields ``[[8], []]``; here
    ``rt.distribute_uneven`` and a dynamic-shape step do, see above)."""
    step = rt.replicate(lambda x: x, num_replicas=2, options=DYN)
    data = np.arange(9, dtype=np.int32)
    got = []
    with pytest.raises(ValueError, match=r"shape \(1,\) cannot be split over 2 replicas"):
        with rt.distribute_iterator([data[i:i + 4] for i in range(0, 9, 4)], step=step) as it:
            for batch in it:
                got.append([v.tolist() for v in _local_results(step(batch), 2)])
    assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_uneven_last_batch_reduce():
    """The same partial last batch reduced across replicas (``strategy.reduce`` of a step's
    per-replica sums): ``[8]`` and ``[]`` sum to 8, and their row counts to 1."""
    step = rt.replicate(lambda x: (jnp.sum(x), jnp.sum(jnp.ones_like(x))), num_replicas=2,
                        options=DYN)
    s, count = step(rt.distribute_uneven(np.asarray([8], np.int32), 2))
    assert [int(v) for v in _local_results(s, 2)] == [8, 0]
    assert int(rt.reduce("sum", s)) == 8 and int(rt.reduce("sum", count)) == 1


def test_sync_on_read_metric_uneven_batches():
    """A sync-on-read metric (a Keras ``Mean``'s ``total`` and ``count``, SUM) updated on
    ``range(9)`` in global batches of 4 over two replicas, the last one ``[8]`` and ``[]``
    (``testUnevenDatasetBatches``'s data): total 36, count 9, the mean 4.0; the replica
    with no data adds nothing."""
    def update_state(metric, values):
        return metric.update(lambda v: {"total": v["total"] + jnp.sum(values),
                                        "count": v["count"] + jnp.sum(jnp.ones_like(values))})

    step = rt.replicate(update_state, num_replicas=2, options=DYN)
    metric = rt.SyncOnRead({"total": np.float32(0), "count": np.float32(0)}, aggregation="sum",
                           num_replicas=2)
    data = np.arange(9, dtype=np.float32)
    for i in range(0, 9, 4):
        metric = step(metric, rt.distribute_uneven(data[i:i + 4], 2))
    read = metric.read()
    assert float(read["total"]) == 36.0 and float(read["count"]) == 9.0
    assert float(read["total"] / read["count"]) == 4.0
    assert [float(v["count"]) for v in metric.values] == [5.0, 4.0]


def test_simple_input_from_fn_last_partial_batch():
    """``testSimpleInputFromFnLastPartialBatch``: ``range(14).batch(4)`` sharded over two
    input pipelines: after a full step, the partial one is ``[8, 9, 10, 11]`` on the first
    replica and ``[12, 13]`` on the second; an identity step returns them."""
    step = rt.replicate(lambda x: x, num_replicas=2, options=DYN)
    data = np.arange(14, dtype=np.int32)
    per_replica_batches = [data[i:i + 4] for i in range(0, 14, 4)]   # shard(2): 0, 2 | 1, 3
    first = step(rt.PerReplica([per_replica_batches[0], per_replica_batches[1]]))
    assert [v.tolist() for v in _local_results(first, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    result = step(rt.PerReplica([per_replica_batches[2], per_replica_batches[3]]))
    assert [v.tolist() for v in _local_results(result, 2)] == [[8, 9, 10, 11], [12, 13]]


def test_batch_reduce_to_host_and_device_tensors():
    """``testBatchReduceToHostTensor`` / ``testBatchReduceToDeviceTensors`` on two replicas:
    ``batch_reduce_to(SUM, [(value, value), (value, value)])`` of 1.0 is ``[2., 2.]``."""
    value = np.float32(1.)
    assert [float(v) for v in rt.reduce("sum", [value, value], num_replicas=2)] == [2., 2.]
    value = rt.replicate(lambda: jnp.float32(1.), num_replicas=2)()
    assert [float(v) for v in rt.reduce("sum", [value, value])] == [2., 2.]


# =========================================================================================
# replica-context all-reduce of shapes and dtypes (cross_device_ops_test.py's dense cases
# with the dtypes TF's collectives take)
# =========================================================================================

@pytest.mark.parametrize("shape", [(), (3,), (2, 3)], ids=["scalar", "vector", "matrix"])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, jnp.bfloat16, np.float16],
                         ids=["float32", "int32", "bfloat16", "float16"])
def test_all_reduce_shapes_dtypes(dtype, shape):
    """Replica r holds ``(r + 1) * [1, 2, ...]`` of the shape and dtype; SUM and MEAN
    all-reduces equal numpy's over the stacked values on every replica, the SUM in the
    input dtype. (MEAN of int32 comes back as float32: JAX's ``pmean`` divides; TF's MEAN
    divides with true division too.)"""
    n = 4
    size = int(np.prod(shape)) if shape else 1
    vals = [((r + 1) * np.arange(1, 1 + size).reshape(shape)).astype(dtype) for r in range(n)]
    stacked = np.stack([np.asarray(v, np.float64) for v in vals])
    out = rt.replicate(lambda x: (rt.all_reduce(x, "sum"), rt.all_reduce(x, "mean")),
                       num_replicas=n)(rt.PerReplica(vals))
    for s, m in zip(_local_results(out[0], n), _local_results(out[1], n)):
        assert s.dtype == np.dtype(dtype) and s.shape == shape
        np.testing.assert_array_equal(s.astype(np.float64), stacked.sum(0))
        np.testing.assert_allclose(m.astype(np.float64), stacked.mean(0), rtol=1e-2)
