"""Ports of tensorflow/tensorflow's model-parallelism tests for ``TPUStrategy``:

* ``tensorflow/python/distribute/tpu_strategy_model_parallelism_test.py``
  (``TPUStrategyModelParallelismTest``): logical device assignment, a partitioned model
  and its checkpoint, and the SPMD cases (variable read / update / checkpoint, a counter
  like ``test_spmd_with_summary``'s, outside compilation);
* ``tensorflow/python/distribute/tpu_strategy_test.py`` (``TPUStrategyDistributionTest``):
  ``test_model_parallelism`` and ``test_model_parallelism_checkpointing`` (one replica of
  two cores);
* ``tensorflow/python/distribute/tpu_strategy.py``: the ``ValueError``s of
  ``_experimental_split_to_logical_devices`` / ``_experimental_assign_to_logical_device``
  (rank, divisibility, product, device id), with TF's numbers;
* ``tensorflow/python/compiler/xla/experimental/xla_sharding_test.py``: split and
  replicate keep the values, and a split that does not divide its dimension raises;
* ``tensorflow/python/distribute/distribute_lib.py``'s example for
  ``experimental_split_to_logical_devices`` (images split ``[1, 2, 4, 1]`` over 8 logical
  devices, labels and logits replicated), trained.

How TF maps: ``get_tpu_strategy()`` builds ``computation_shape=[1, 1, 1, 2]`` with
``num_cores // 2`` replicas, i.e. 4 replicas × 2 logical devices on 8 devices:
``rt.replicate(fn, num_replicas=4, logical_devices=2)``; other N × K layouts are added
where TF's test does not depend on K = 2. A variable created in
``experimental_logical_device(d)`` is a mirrored argument annotated
``rt.assign_to_logical_device(w, d)`` in the step; ``with
replica_ctx.experimental_logical_device(d): y = ...`` is ``y =
rt.assign_to_logical_device(..., d)``; ``strategy.experimental_split_to_logical_devices``
and ``experimental_replicate_to_logical_devices`` are ``rt.split_to_logical_devices`` and
``rt.replicate_to_logical_devices``; a checkpoint save/restore is ``np.savez`` /
``np.load`` of the arguments. TF's expected values are kept; where TF compares against a
host computation with bf16 tolerances, the result is also compared with ``jax.jit`` on one
device at float32 tolerances (annotations never change values).
"""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt

split = rt.split_to_logical_devices
assign = rt.assign_to_logical_device
replicate_ld = rt.replicate_to_logical_devices

FILE = "test_peer_tf_model_parallel.py"
TF_LAYOUT = (4, 2)  # get_tpu_strategy(): computation_shape [1, 1, 1, 2], num_cores // 2 replicas


def _ids(layouts):
    return [f"{n}x{k}" for n, k, *_ in layouts]


def _local_results(out, n):
    """TF's ``experimental_local_results``: one value per replica."""
    return [np.asarray(v) for v in out.values] if isinstance(out, rt.PerReplica) \
        else [np.asarray(out)] * n


def _quiet(fn, *args):
    """Call ``fn`` with ``assign_to_logical_device``'s "replicated instead" warning off."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"assign_to_logical_device")
        return fn(*args)


def _model_axes(k):
    """The PartitionSpec entry of a dim split over all K logical devices."""
    from compiler.mesh import model_axes
    names = tuple(a for a, _ in model_axes(k))
    return names[0] if len(names) == 1 else names


# -- tpu_strategy_model_parallelism_test.py: logical device assignment ---------------------

def _two_device_model(v, w, x):
    """``f`` of ``test_logical_device_assignment``: ``v`` on logical device 0, ``w`` on 1."""
    w = assign(w, 1)                    # variables.Variable(3.) in experimental_logical_device(1)
    y = assign(v * x, 0)                # with replica_ctx.experimental_logical_device(0)
    z = assign(w * y, 1)                # with replica_ctx.experimental_logical_device(1)
    return z


@pytest.mark.parametrize("n,k", [TF_LAYOUT, (2, 4), (1, 8)], ids=_ids([TF_LAYOUT, (2, 4), (1, 8)]))
def test_logical_device_assignment(n, k):
    """``test_logical_device_assignment``: ``v = 2.`` on logical device 0, ``w = 3.`` on
    logical device 1, ``z = w * (v * 5.)`` in each replica: SUM over replicas ``30 * N``.
    TF checks the ops' devices (``TPU_REPLICATED_CORE:0`` / ``:1``); here the annotations
    are in the IR as ``{maximal device=0}`` / ``{maximal device=1}``, and lowering warns
    that JAX's partitioner replicates them (numbers unchanged)."""
    step = rt.replicate(_two_device_model, num_replicas=n, logical_devices=k)
    args = (np.float32(2.), np.float32(3.), np.float32(5.))
    with pytest.warns(UserWarning) as record:
        result = step(*args)
    for d in (0, 1):
        assert any(re.match(rf"assign_to_logical_device\(\.\.\., {d}\) \({FILE}:\d+\): .*replicated "
                            rf"over the replica's {k} logical devices", str(w.message)) for w in record)
    local = _local_results(result, n)
    assert len(local) == n and all(float(r) == 30. for r in local)
    assert float(rt.reduce("sum", result, axis=None)) == 30. * n
    text = str(_quiet(step.lower, *args).ir(after="sharding"))
    # TF: v's local result on TPU:0, w's on TPU:1; y on core 0, z on core 1
    assert text.startswith("func @_two_device_model(%0: f32[] mirrored {maximal device=0}, "
                           "%1: f32[] mirrored {maximal device=1}, "), text
    assert "sharding={maximal device=0}, annotation='assign'" in text, text
    assert re.search(r"= shard\(%6\) \{sharding=\{maximal device=1\}, annotation='assign'\}  "
                     rf"# {FILE}:\d+\n  return %7", text), text


def test_model_parallelism_one_replica_two_cores():
    """``tpu_strategy_test.py``'s ``test_model_parallelism``: a device assignment of one
    replica on two given cores (``core_assignment=[[[0,0,0,0], [0,0,0,1]]]``; here
    devices 6 and 7): the same ``f`` gives ``30.``, one local result, on those devices."""
    devs = np.asarray(jax.devices()[6:8]).reshape(1, 2)
    step = rt.replicate(_two_device_model, num_replicas=1, logical_devices=2, devices=devs)
    result = _quiet(step, np.float32(2.), np.float32(3.), np.float32(5.))
    assert len(_local_results(result, 1)) == 1
    assert float(result) == 30.
    assert set(result.devices()) <= set(devs.flat)


class _PartitionedModel:
    """``PartitionedModel`` of the checkpointing tests: ``v`` on logical device 0, ``w``
    on 1; ``change_weights_op`` is a new parameter dict."""

    def __init__(self, v, w):
        self.params = {"v": np.float32(v), "w": np.float32(w)}

    @staticmethod
    def apply(params, x):
        return _two_device_model(params["v"], params["w"], x)

    def change_weights_op(self, v_new, w_new):
        self.params = {"v": np.float32(v_new), "w": np.float32(w_new)}


@pytest.mark.parametrize("n,k", [TF_LAYOUT, (1, 2)],
                         ids=["test_paritioned_model_checkpointing",
                              "test_model_parallelism_checkpointing"])
def test_partitioned_model_checkpointing(tmp_path, n, k):
    """``test_paritioned_model_checkpointing`` (4 × 2) and ``tpu_strategy_test.py``'s
    ``test_model_parallelism_checkpointing`` (1 × 2): save ``(2., 3.)``, change the
    weights to ``(1., 4.)``: SUM ``20 * N``; restore: ``30 * N``. One executable serves
    both weights (they are arguments, not constants)."""
    model = _PartitionedModel(2., 3.)
    prefix = tmp_path / "ckpt.npz"
    np.savez(prefix, **model.params)                        # checkpoint.save
    step = rt.replicate(_PartitionedModel.apply, num_replicas=n, logical_devices=k)

    model.change_weights_op(1., 4.)
    result = _quiet(step, model.params, np.float32(5.))
    assert float(rt.reduce("sum", result, axis=None)) == 20. * n

    with np.load(prefix) as ckpt:                           # checkpoint.restore
        model.params = {name: ckpt[name] for name in ckpt.files}
    assert set(model.params) == {"v", "w"}                  # assert_consumed
    result = _quiet(step, model.params, np.float32(5.))
    assert float(rt.reduce("sum", result, axis=None)) == 30. * n
    assert step.cache_info().misses == 1


def test_spmd_cannot_assign_tensor_to_logical_device():
    """``test_spmd_cannot_assign_tensor_to_logical_device``: TF's SPMD partitioner has no
    maximal sharding and raises ``ValueError``. Here the annotation outside a step is an
    error naming where it can be used; inside a step it lowers replicated with a warning
    that says so (the value is unchanged: ``[0, 1]``)."""
    x = jnp.asarray([0, 1])
    with pytest.raises(RuntimeError, match=r"assign_to_logical_device\(\) can only be called "
                                           r"inside a function run by replicate"):
        assign(x, 0)
    n, k = TF_LAYOUT
    step = rt.replicate(lambda x: assign(x, 0), num_replicas=n, logical_devices=k)
    with pytest.warns(UserWarning, match=r"no maximal sharding; the value is replicated"):
        out = step(np.asarray([0, 1], np.int32))
    assert all(r.tolist() == [0, 1] for r in _local_results(out, n))


# -- the SPMD variable cases ---------------------------------------------------------------

def test_spmd_variable_created_from_callable():
    """``test_spmd_variable_created_from_callable``: a variable initialized from
    ``random_normal((16, 16))``: every logical device's copy is the same value (here: the
    copies the step's result keeps on each of the 8 devices)."""
    w = jax.random.normal(jax.random.key(0), (16, 16))      # the initializer, run once
    n, k = TF_LAYOUT
    out = rt.replicate(lambda w: replicate_ld(w), num_replicas=n, logical_devices=k)(w)
    shards = out.addressable_shards
    assert len(shards) == n * k
    for s in shards:
        assert s.data.shape == (16, 16)
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(w))


@pytest.mark.parametrize("n,k,dims", [TF_LAYOUT + (None,), (2, 4, "cols"), (1, 8, "rows")],
                         ids=["4x2-unannotated", "2x4-w-split-cols", "1x8-w-split-rows"])
def test_spmd_variable_read(n, k, dims):
    """``test_spmd_variable_read``: ``w`` (16 × 8) read in a matmul with the same batch
    ``x`` (32 × 16) on every replica: SUM over replicas is ``x @ w * N`` (TF's rtol/atol
    5e-3), and equals ``jax.jit``'s ``x @ w`` at float32 tolerance. Besides TF's
    unannotated case, ``w`` split by columns (no communication) and by rows (the matmul's
    partial sums need an all-reduce over the replica's logical devices)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(32, 16)).astype(np.float32)
    w_init = rng.uniform(size=(16, 8)).astype(np.float32)
    spec = {None: None, "cols": [1, k], "rows": [k, 1]}[dims]

    def step_fn(batch_features, w):
        w = split(w, spec) if spec else w
        return batch_features @ w

    step = rt.replicate(step_fn, num_replicas=n, logical_devices=k)
    result = step(x, w_init)
    assert w_init.shape == (16, 8)
    np.testing.assert_allclose(rt.reduce("sum", result, axis=None), x @ w_init * n,
                               rtol=5e-3, atol=5e-3)
    want = jax.jit(lambda a, b: a @ b)(x, w_init)
    for r in _local_results(result, n):
        np.testing.assert_allclose(r, want, rtol=1e-6, atol=1e-6)
    if spec:
        text = str(step.lower(x, w_init).ir(after="sharding"))
        tiles = ",".join(map(str, spec))
        assert re.search(rf"%1: f32\[16,8\] mirrored \{{devices=\[{tiles}\]", text), text


def test_spmd_variable_read_init_scope():
    """``test_spmd_variable_read_init_scope``: reading ``v = ones((4, 4))`` in every
    replica, MEAN over replicas, is ``v``."""
    v = np.ones((4, 4), np.float32)
    n, k = TF_LAYOUT
    result = rt.replicate(lambda v: replicate_ld(v) * 1.0, num_replicas=n, logical_devices=k)(v)
    np.testing.assert_allclose(rt.reduce("mean", result, axis=None), v)


def test_spmd_variable_update():
    """``test_spmd_variable_update``: a 1024 × 256 variable (here split by columns over
    the logical devices) assigned ``x``, then ``assign_sub(delta)``, then
    ``assign_add(delta)``: each step's result, SUMmed over replicas, is ``N`` times the
    variable's new value; the updated variable stays split between the steps."""
    n, k = TF_LAYOUT
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(1024, 256)).astype(np.float32)
    w = rng.uniform(size=(1024, 256)).astype(np.float32)

    def make_strategy_run(update):
        return rt.replicate(lambda w, value: split(update(w, value), [1, k]),
                            num_replicas=n, logical_devices=k)

    w = make_strategy_run(lambda w, v: v + 0 * w)(w, x)                   # w.assign
    np.testing.assert_allclose(rt.reduce("sum", w, axis=None), x * n)
    delta = rng.uniform(size=(1024, 256)).astype(np.float32)
    w = make_strategy_run(lambda w, v: w - v)(w, delta)                    # w.assign_sub
    x = x - delta
    np.testing.assert_allclose(rt.reduce("sum", w, axis=None), x * n)
    delta = rng.uniform(size=(1024, 256)).astype(np.float32)
    w = make_strategy_run(lambda w, v: w + v)(w, delta)                    # w.assign_add
    x = x + delta
    np.testing.assert_allclose(rt.reduce("sum", w, axis=None), x * n)
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, _model_axes(k))
    assert {s.data.shape for s in w.addressable_shards} == {(1024, 256 // k)}


class _LinearModel:
    def __init__(self, w):
        self.w = w

    def change_weights_op(self, w_new):
        self.w = w_new


@pytest.mark.parametrize("n,k", [TF_LAYOUT, (2, 4)], ids=_ids([TF_LAYOUT, (2, 4)]))
def test_spmd_model_checkpointing(tmp_path, n, k):
    """``test_spmd_model_checkpointing``: ``x`` (32 × 16) split ``[1, K]`` (TF: ``[1, 2]``)
    times the model's ``w`` (16 × 8): after changing ``w`` to ``w2`` the SUM over replicas
    is ``x @ w2 * N``, after restoring ``w1`` it is ``x @ w1 * N``. The split is real: the
    IR gives ``x`` the column split and ``w`` the matching row split, and XLA sums the
    matmul's partial products over each replica's K logical devices, on the model's line."""
    rng = np.random.default_rng(2)
    w1 = rng.uniform(size=(16, 8)).astype(np.float32)
    w2 = rng.uniform(size=(16, 8)).astype(np.float32)
    x = rng.uniform(size=(32, 16)).astype(np.float32)
    model = _LinearModel(w1)
    np.savez(tmp_path / "ckpt.npz", w=model.w)

    def step_fn(x, w):
        x = split(x, [1, k])
        return x @ w                                        # model(x)

    step = rt.replicate(step_fn, num_replicas=n, logical_devices=k)
    model.change_weights_op(w2)
    result = step(x, model.w)
    np.testing.assert_allclose(rt.reduce("sum", result, axis=None), x @ w2 * n, rtol=5e-3, atol=5e-3)
    for r in _local_results(result, n):
        np.testing.assert_allclose(r, jax.jit(jnp.matmul)(x, w2), rtol=1e-6, atol=1e-6)
    with np.load(tmp_path / "ckpt.npz") as ckpt:
        model.change_weights_op(ckpt["w"])
    result = step(x, model.w)
    np.testing.assert_allclose(rt.reduce("sum", result, axis=None), x @ w1 * n, rtol=5e-3, atol=5e-3)
    for r in _local_results(result, n):
        np.testing.assert_allclose(r, jax.jit(jnp.matmul)(x, w1), rtol=1e-6, atol=1e-6)

    lowered = step.lower(x, model.w)
    devs = ",".join(map(str, range(k)))
    text = str(lowered.ir(after="sharding"))
    assert text.startswith(f"func @step_fn(%0: f32[32,16] mirrored {{devices=[1,{k}]{devs}}}, "
                           f"%1: f32[16,8] mirrored {{devices=[{k},1]{devs}}})"), text
    matmul_line = step_fn.__code__.co_firstlineno + 2
    groups = tuple(tuple(range(r * k, (r + 1) * k)) for r in range(n))
    found = lowered.compile().collectives()
    assert any(c.kind == "all-reduce" and c.replica_groups == groups
               and (FILE, matmul_line) in {(f, ln) for _, f, ln in c.ir_sources}
               for c in found), found


def test_spmd_step_counter():
    """``test_spmd_with_summary`` without the summary writer: a mirrored int64 (here
    int32) ``step = 1``, ``step.assign_add(1)`` in 10 runs: every copy on every logical
    device is 11, and the values the summary would log, ``step * 2``, are 2, 4, ..., 20."""
    n, k = TF_LAYOUT
    const_multiple, num_iters = 2, 10
    run = rt.replicate(lambda step: (step + 1, replicate_ld(step * const_multiple)),
                       num_replicas=n, logical_devices=k)
    step, logged = jnp.int32(1), []
    for _ in range(num_iters):
        step, value = run(step)
        logged.append(int(value))
    assert logged == [i * const_multiple for i in range(1, num_iters + 1)]
    assert len(step.addressable_shards) == n * k
    assert all(int(s.data) == num_iters + 1 for s in step.addressable_shards)


@pytest.mark.parametrize("n,k,do_split", [
    (8, 1, False),
    (4, 2, True),
], ids=["8x1", "4x2-split"])
def test_spmd_with_outside_comp(n, k, do_split):
    """``test_spmd_with_outside_comp`` (replicated and ``[1, 2]``-split input):
    ``host_inc`` run outside the compiled program (``jax.pure_callback`` here) between two
    ``+ 1``: SUM over replicas ``(arg + 3) * N``. With K > 1 JAX cannot lower a callback
    (the logical-device axes are not manual): its ``NotImplementedError``, saying so;
    K = 1 shows the numbers."""
    def host_inc(x):
        return np.asarray(x) + 1

    def fn(x):
        if do_split:
            x = split(x, [1, 2])
        y = x + 1
        z = jax.pure_callback(host_inc, jax.ShapeDtypeStruct(y.shape, y.dtype), y)
        return z + 1

    arg = np.zeros((2, 2), np.int32)
    if k > 1:
        with pytest.raises(NotImplementedError, match="callbacks are only supported in spmd "
                                                      "computations when all mesh axes are "
                                                      "partitioned manually"):
            rt.replicate(fn, num_replicas=n, logical_devices=k)(arg)
        return
    result = rt.replicate(fn, num_replicas=n, logical_devices=k)(arg)
    np.testing.assert_array_equal(rt.reduce("sum", result, axis=None), (arg + 3) * n)


# -- tpu_strategy.py's annotation errors ------------------------------------------------------

def _bad_rank(x):
    return split(x, [1, 1, 2])


def _bad_divisor(x):
    return split(x, [1, 4])


def _bad_product(x):
    return split(x, [2, 3])


def _bad_device(x):
    return assign(x, 2)


def _incommensurate(x):
    return split(x, [8, 1, 1])    # xla_sharding.split(tensor, 0, 8) of ones([4, 5, 6])


def _line(fn):
    return fn.__code__.co_firstlineno + 1


@pytest.mark.parametrize("fn,shape,k,message", [
    # "Length of `partition_dimensions` (3) must be equal to the rank of `x` (2)."
    (_bad_rank, (4, 6), 2, r"partition_dimensions \[1, 1, 2\] has length 3 but the tensor has rank 2"),
    # "Tensor shape at dimension (1) must be divisible by ... `partition_dimensions` (4)."
    (_bad_divisor, (4, 6), 2, r"dimension 1 of size 6 is not divisible by its split 4"),
    # "Number of logical devices (2) does not match the number of partition splits specified (6)."
    (_bad_product, (4, 6), 2, r"product of partition_dimensions \[2, 3\] is 6 but the replica has "
                              r"2 logical devices"),
    # "Received logical device id 2 but there are only total of 2 logical devices in replica."
    (_bad_device, (4, 6), 2, r"logical device 2 is outside \[0, 2\) for a replica of 2 logical devices"),
    # xla_sharding_test.test_split_raises_error_with_incommensurate_dimensions
    (_incommensurate, (4, 5, 6), 8, r"dimension 0 of size 4 is not divisible by its split 8"),
    # the product rule holds for K = 1 too
    (_bad_divisor, (4, 8), 1, r"product of partition_dimensions \[1, 4\] is 4 but the replica has "
                              r"1 logical devices"),
], ids=["rank", "divisibility", "product", "device-id",
        "xla-sharding-incommensurate", "product-K1"])
def test_annotation_errors_name_the_numbers_and_the_line(fn, shape, k, message):
    """TPUStrategy's ``ValueError``s for a bad ``partition_dimensions`` or logical device
    id, with TF's numbers (its message in the comment above each case), raised while
    tracing — before XLA runs — and naming the line of the annotation."""
    step = rt.replicate(fn, num_replicas=8 // k, logical_devices=k)
    with pytest.raises(ValueError, match=rf"{message}.*{FILE}:{_line(fn)}\b"):
        step(np.ones(shape, np.float32))


# -- xla_sharding_test.py: annotations keep values ----------------------------------------------

def test_split_annotates_tensor_correctly():
    """``test_split_annotates_tensor_correctly``: ``split(ones([4, 5, 6]), 2, 3)`` has tile
    shape ``[1, 1, 3]`` and the value of its input. Here on 2 replicas × 3 logical devices:
    the IR carries ``{devices=[1,1,3]0,1,2}`` and each device holds a 4 × 5 × 2 block."""
    step = rt.replicate(lambda x: split(x, [1, 1, 3]) * 1.0, num_replicas=2, logical_devices=3)
    in_tensor = np.ones((8, 5, 6), np.float32)              # [4, 5, 6] per replica
    out = step(rt.distribute(in_tensor, 2))
    for r in _local_results(out, 2):
        np.testing.assert_array_equal(r, np.ones((4, 5, 6), np.float32))
    assert {s.data.shape for v in out.values for s in v.addressable_shards} == {(4, 5, 2)}
    assert "shard(%0) {sharding={devices=[1,1,3]0,1,2}, annotation='split'}" in \
        str(step.lower(rt.distribute(in_tensor, 2)).ir())


def test_replicate_annotates_tensor_correctly():
    """``test_replicate_annotates_tensor_correctly``: ``replicate(ones([4, 5, 6]))`` is
    annotated (``{replicated}``, no tile shape) and keeps its value; every logical device
    holds all of it."""
    n, k = TF_LAYOUT
    step = rt.replicate(lambda x: replicate_ld(x) + 0.0, num_replicas=n, logical_devices=k)
    in_tensor = np.ones((4 * n, 5, 6), np.float32)
    out = step(rt.distribute(in_tensor, n))
    for r in _local_results(out, n):
        np.testing.assert_array_equal(r, np.ones((4, 5, 6), np.float32))
    assert {s.data.shape for v in out.values for s in v.addressable_shards} == {(4, 5, 6)}
    assert "{sharding={replicated}, annotation='replicate'}" in \
        str(step.lower(rt.distribute(in_tensor, n)).ir())


# -- TF's tile order over a device assignment ----------------------------------------------------

@pytest.mark.parametrize("n,k,dims", [(1, 8, [2, 4]), (2, 4, [2, 2])], ids=["1x8-2x4", "2x4-2x2"])
def test_tile_order_follows_the_device_assignment(n, k, dims):
    """TPUStrategy's ``_experimental_split_to_logical_devices`` tiles with
    ``np.arange(K).reshape(partition_dimensions)`` over the replica's cores in the
    ``DeviceAssignment``'s order (``test_model_parallelism`` builds one by hand): with the
    8 devices in a scrambled order, logical device ``d`` of replica ``r`` (``devices[r,
    d]``) holds tile ``np.unravel_index(d, dims)`` of replica r's value."""
    perm = np.random.default_rng(3).permutation(8)
    devs = np.asarray(jax.devices()[:8])[perm].reshape(n, k)
    x = np.arange(64 * n, dtype=np.float32).reshape(8 * n, 8)
    out = rt.replicate(lambda x: split(x, dims) * 1.0, num_replicas=n, logical_devices=k,
                       devices=devs)(rt.distribute(x, n))
    for r, (value, xr) in enumerate(zip(out.values, np.split(x, n))):
        np.testing.assert_array_equal(value, xr)
        assert len(value.addressable_shards) == k
        for s in value.addressable_shards:
            d = list(devs[r]).index(s.device)
            t = np.unravel_index(d, dims)
            block = xr[t[0] * (8 // dims[0]):(t[0] + 1) * (8 // dims[0]),
                       t[1] * (8 // dims[1]):(t[1] + 1) * (8 // dims[1])]
            np.testing.assert_array_equal(np.asarray(s.data), block)


def test_split_three_ways_first_over_six_logical_devices():
    """TF accepts any ``partition_dimensions`` whose product is K: ``[3, 2]`` over 6
    logical devices (tile order ``np.arange(6).reshape(3, 2)``). Here the logical devices
    form one mesh axis per prime factor, smallest first, so a dim split 3 ways must come
    after one split 2 ways: ``[3, 2]`` is a ``ShardingError`` naming the line and the way
    out (before, a ``LoweringError`` without the line); ``[2, 3]`` of the transposed
    value works, the value unchanged."""
    from compiler.errors import ShardingError
    x = np.arange(36, dtype=np.float32).reshape(6, 6)
    with pytest.raises(ShardingError, match=r"dimension 0 split 3 ways does not match the "
                                            r"mesh factors \[2, 3\] of 6 logical devices.*"
                                            r"\[2, 3\], not \[3, 2\].*test_peer_tf_model_"
                                            r"parallel\.py:\d+"):
        rt.replicate(lambda x: split(x, [3, 2]) * 1.0, num_replicas=1, logical_devices=6)(x)
    out = rt.replicate(lambda x: split(x.T, [2, 3]).T * 1.0, num_replicas=1,
                       logical_devices=6)(x)
    np.testing.assert_array_equal(out, x)


# -- training with model-parallel variables -------------------------------------------------------

LAYOUTS = [(2, 4), TF_LAYOUT, (1, 8), (8, 1)]


def _mlp_loss(k, annotate=True):
    def loss(p, x, y):
        w1 = split(p["w1"], [1, k]) if annotate else p["w1"]     # columns
        w2 = split(p["w2"], [k, 1]) if annotate else p["w2"]     # rows: partial sums
        h = jnp.tanh(x @ w1)
        return jnp.mean((h @ w2 - y) ** 2)
    return loss


def _sgd(loss, lr=0.1):
    def step(p, x, y):
        l, g = jax.value_and_grad(loss)(p, x, y)
        return jax.tree.map(lambda a, b: a - lr * b, p, g), l
    return step


def _oracle(loss, p, xs, ys, reduction, steps, lr=0.1):
    """SGD on one device: the replicas' losses averaged (``mean``) or summed (``sum``)."""
    def global_loss(p):
        total = sum(loss(p, x, y) for x, y in zip(xs, ys))
        return total / len(xs) if reduction == "mean" else total
    f = jax.jit(lambda p: jax.tree.map(lambda a, b: a - lr * b, p, jax.grad(global_loss)(p)))
    for _ in range(steps):
        p = f(p)
    return p


def _mlp_data(seed=0):
    rng = np.random.default_rng(seed)
    p = {"w1": rng.normal(size=(8, 16)).astype(np.float32) * 0.5,
         "w2": rng.normal(size=(16, 4)).astype(np.float32) * 0.5}
    x = rng.normal(size=(16, 8)).astype(np.float32)
    y = rng.normal(size=(16, 4)).astype(np.float32)
    return p, x, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n,k", LAYOUTS, ids=_ids(LAYOUTS))
def test_training_with_model_parallel_variables(n, k, reduction):
    """A training loop with split variables (TF's SPMD variables, ``w1`` by columns and
    ``w2`` by rows, Megatron-style) on N × K layouts: after 3 SGD steps the weights equal
    ``jax.jit``'s on one device of the global loss (the replicas' mean or sum, as
    ``loss_reduction`` says), the weights stay split between steps (the step's outputs
    keep the annotations' layout) and one executable serves every step."""
    p0, x, y = _mlp_data()
    step = rt.replicate(_sgd(_mlp_loss(k)), num_replicas=n, logical_devices=k,
                        loss_reduction=reduction)
    p = p0
    for _ in range(3):
        p, loss = step(p, rt.distribute(x, n), rt.distribute(y, n))
    want = _oracle(_mlp_loss(1, False), p0, np.split(x, n), np.split(y, n), reduction, 3)
    for name in p:
        np.testing.assert_allclose(p[name], want[name], rtol=1e-5, atol=1e-6)
    assert step.cache_info().misses == 1
    if k > 1:
        P = jax.sharding.PartitionSpec
        assert p["w1"].sharding.spec == P(None, _model_axes(k))
        assert p["w2"].sharding.spec == P(_model_axes(k))


def test_training_with_model_parallel_variables_steps_per_call():
    """The same training loop as TF's ``steps_per_execution=3`` (``steps_per_call=3``,
    one executable for 3 steps) on 2 × 4: the weights equal the one-device oracle's, and
    they come back split as they do from one step per call: a split weight must not turn
    into a full copy on every device because the steps run in a loop."""
    n, k = 2, 4
    p0, x, y = _mlp_data()
    single = rt.replicate(_sgd(_mlp_loss(k)), num_replicas=n, logical_devices=k)
    p1, _ = single(p0, rt.distribute(x, n), rt.distribute(y, n))
    multi = rt.replicate(_sgd(_mlp_loss(k)), num_replicas=n, logical_devices=k, steps_per_call=3)
    p, losses = multi(p0, rt.distribute_steps([x] * 3, n), rt.distribute_steps([y] * 3, n))
    want = _oracle(_mlp_loss(1, False), p0, np.split(x, n), np.split(y, n), "mean", 3)
    for name in p:
        np.testing.assert_allclose(p[name], want[name], rtol=1e-5, atol=1e-6)
    assert {name: p[name].sharding.spec for name in p} == \
        {name: p1[name].sharding.spec for name in p1}
    assert {s.data.shape for s in p["w1"].addressable_shards} == {(8, 16 // k)}


def test_model_parallel_gradients_of_a_partial_last_batch():
    """TPUStrategy's ``experimental_enable_dynamic_batch_size`` (the dynamic padder of
    ``_tpu_function_creator``) with model parallelism: a last batch of 11 rows over 2
    replicas (6 + 5) of 4 logical devices, ``w1``/``w2`` split: the gradients are the
    mean of each replica's gradient on its real rows (``jax.jit`` per replica, unpadded)
    and stay split."""
    n, k = 2, 4
    p0, x, y = _mlp_data(6)
    x, y = x[:11], y[:11]
    step = rt.replicate(lambda p, x, y: jax.grad(_mlp_loss(k))(p, x, y), num_replicas=n,
                        logical_devices=k, options=rt.RunOptions(dynamic_shapes=True))
    g = step(p0, rt.distribute_uneven(x, n), rt.distribute_uneven(y, n))
    per_replica = [jax.jit(jax.grad(_mlp_loss(1, False)))(p0, xs, ys)
                   for xs, ys in zip(np.array_split(x, n), np.array_split(y, n))]
    for name in g:
        np.testing.assert_allclose(g[name], sum(r[name] for r in per_replica) / n,
                                   rtol=1e-5, atol=1e-6)
    assert g["w1"].sharding.spec == jax.sharding.PartitionSpec(None, _model_axes(k))


def _image_model(annotate, dims=None):
    """``distribute_lib.experimental_split_to_logical_devices``' example: the images split
    ``dims`` ways, the model on the split images, labels and logits replicated for the loss."""
    def loss(p, images, labels):
        if annotate:
            images = split(images, dims)
        h = jax.lax.conv_general_dilated(images, p["k"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        output = jnp.mean(jax.nn.relu(h), axis=(1, 2)) @ p["d"]
        if annotate:
            labels = replicate_ld(labels)
            output = replicate_ld(output)
        return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(output), -1))
    return loss


@pytest.mark.parametrize("n,k,dims,reduction", [(1, 8, [1, 2, 4, 1], "mean"),
                                                (2, 4, [1, 2, 2, 1], "sum")],
                         ids=["1x8-mean", "2x4-sum"])
def test_split_images_replicated_labels_training(n, k, dims, reduction):
    """The ``experimental_split_to_logical_devices`` docstring's step: images split
    ``[1, 2, 4, 1]`` over 8 logical devices (and ``[1, 2, 2, 1]`` over 4 on 2 replicas),
    labels and logits ``experimental_replicate_to_logical_devices``: two SGD steps equal
    ``jax.jit``'s on one device, and each device convolves its own block of the images."""
    rng = np.random.default_rng(4)
    p0 = {"k": rng.normal(size=(3, 3, 3, 4)).astype(np.float32) * 0.3,
          "d": rng.normal(size=(4, 5)).astype(np.float32)}
    images = rng.normal(size=(2 * n, 8, 16, 3)).astype(np.float32)
    labels = np.eye(5, dtype=np.float32)[rng.integers(0, 5, 2 * n)]
    step = rt.replicate(_sgd(_image_model(True, dims)), num_replicas=n, logical_devices=k,
                        loss_reduction=reduction)
    p = p0
    for _ in range(2):
        p, _ = step(p, rt.distribute(images, n), rt.distribute(labels, n))
    want = _oracle(_image_model(False), p0, np.split(images, n), np.split(labels, n), reduction, 2)
    for name in p:
        np.testing.assert_allclose(p[name], want[name], rtol=1e-5, atol=1e-6)
    hlo = step.lower(p, rt.distribute(images, n), rt.distribute(labels, n)).compile().as_text()
    block = f"f32[2,{8 // dims[1]},{16 // dims[2]},3]"
    assert block in hlo, hlo[:2000]


def test_split_inside_vmap_is_kept():
    """Not in TF (which has no ``vmap``): ``split_to_logical_devices`` of a value batched
    by ``jax.vmap`` (two weight matrices, one split per example) must keep the split on
    the example's dims (``[1, 1, 4]`` on the stacked value), not drop it: dropping turns
    the asked-for split into a silent full copy on every logical device. Values unchanged."""
    n, k = 2, 4
    rng = np.random.default_rng(5)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    x = rng.normal(size=(16, 8)).astype(np.float32)

    def fn(w, x):
        ws = jnp.stack([w, 2 * w])
        h = jax.vmap(lambda w: split(w, [1, k]))(ws)
        return jnp.einsum("bi,nij->nbj", x, h)

    step = rt.replicate(fn, num_replicas=n, logical_devices=k)
    out = step(w, rt.distribute(x, n))
    for r, xr in enumerate(np.split(x, n)):
        np.testing.assert_allclose(out.values[r], np.stack([xr @ w, xr @ (2 * w)]), rtol=1e-5, atol=1e-5)
    text = str(step.lower(w, rt.distribute(x, n)).ir(after="sharding"))
    assert "{sharding={devices=[1,1,4]0,1,2,3}, annotation='split'}" in text, text
