"""Ports of google/flax examples/nnx_toy_examples/ (flax at
18f8f311c275d57f46d95e41b15aa97b454754c0) to ``rt.replicate``.

* ``04_data_parallel_with_jit.py``: an ``nnx.jit`` train step (``MLP(1, 64, 1)``,
  ``nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)``) over model and optimizer
  state placed with ``jax.device_put(state, model_sharding)`` (``P()``) and batches of 16
  placed with ``data_sharding`` (``P('data')``) on a mesh of the 8 devices. That sharded
  program, run as the example runs it (its ``dataset`` with a seeded generator, 20 of its
  1000 steps), is the oracle. The port keeps the example's step, model, placement and
  data, and moves the nnx objects through ``nnx.split`` / ``nnx.merge`` into a
  functional step for ``replicate``; it must equal the oracle step by step, with
  AdamW and with SGD (Adam's update hardly depends on the gradient's scale: an N-times
  gradient would pass with AdamW alone), and 5 steps per call. Also: the example's step
  given the nnx objects
  themselves (the decorator swapped, nothing else), its data layout kept inside the step
  (``jax.device_put`` / ``with_sharding_constraint`` / ``nnx.jit(in_shardings=...)``
  with ``P('data')``: an ``rt.ShardingConstraintError`` naming the line), and a replicated
  layout kept inside the step (accepted, the same numbers).
* ``06_scan_over_layers.py``: ``ScanMLP`` (5 ``Block``s of Linear -> BatchNorm -> Dropout
  -> gelu, created with ``nnx.split_rngs`` + ``nnx.vmap``, applied with ``nnx.scan``).
  The source only runs it forward; the port trains it with SGD: in eval mode (running
  BatchNorm statistics, no dropout) against ``jax.jit`` of the same step on the global
  batch on one device, and in train mode (per-replica BatchNorm statistics, the model's
  own dropout ``Rngs``) against ``jax.pmap`` of the same step, written as NNX code is
  for pmap (``lax.pmean`` of the gradients and the statistics); without the statistics'
  ``pmean`` a ``rt.DivergingStateWarning``. Two steps: BatchNorm over a replica's 2 rows
  after dropout divides by about ``sqrt(eps)`` where the rows agree, so the last-bit
  differences of two correct programs (replicate all-reduces the scan's gradients once
  after the loop) grow to ~1e-4 by the third step; from the same state each step agrees
  to the last bit.
* ``03_train_state.py``: the source's ``jax.jit`` ``train_step`` over a
  ``flax.training.train_state.TrainState`` holding the nnx ``GraphDef`` and a ``Count``
  state, ``optax.sgd(0.1)``: only the decorator changed; and its ``test_step`` on the
  whole data set (100 rows, 4 replicas).
* ``01_functional_api.py``: ``nnx.split(model, nnx.Param, Count)``, the graphdef closed
  over, a hand-written SGD over ``nnx.State``; only the decorator changed. One change
  to the source, for flax 0.12.8 itself: ``nnx.merge(..., copy=True)`` in ``loss_fn``
  (as 03 has it; without it the source's own ``jax.jit`` step raises flax's
  ``TraceContextError``).

Every oracle is the source's own program (``jax.jit`` / ``nnx.jit``, sharded or on one
device) on the global batch; sizes and step counts are small (the examples' plots and
02/05/07-10 are left out: they add no other code path for a replicated step).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.experimental import mesh_utils

import runtime as rt

N = 8
RTOL, ATOL = 2e-5, 1e-7


def assert_states_close(got, want, what, rtol=RTOL, atol=ATOL):
    g = jax.tree_util.tree_flatten_with_path(got, is_leaf=rt.PerReplica.__instancecheck__)[0]
    w = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in g] == [p for p, _ in w], f"{what}: structures differ"
    for (path, a), (_, b) in zip(g, w):
        assert not isinstance(a, rt.PerReplica), f"{what}{jax.tree_util.keystr(path)}: PerReplica"
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


def source_line(msg: str) -> str:
    """The line of this file that an error message names (``test_flax_nnx_toy.py:LINE``)."""
    line = int(msg.split("test_flax_nnx_toy.py:")[1].split()[0].rstrip(",:)"))
    with open(__file__) as f:
        return f.read().splitlines()[line - 1]


# ======================================================================================
# 04_data_parallel_with_jit.py
# ======================================================================================

# create a mesh + shardings (the example's)
num_devices = N
mesh = jax.sharding.Mesh(
    mesh_utils.create_device_mesh((num_devices,), devices=jax.devices()[:num_devices]), ('data',)
)
model_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
data_sharding = jax.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))

STEPS_04 = 20
BATCH_04 = 16  # the example's: 2 rows per replica


# create model
class MLP(nnx.Module):
    def __init__(self, din, dmid, dout, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
        self.linear2 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x, y):
    def loss_fn(model: MLP):
        y_pred = model(x)
        return jnp.mean((y - y_pred) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def dataset(steps, batch_size, rng):
    """The example's ``dataset``, drawing from ``rng`` (the example: ``np.random``)."""
    for _ in range(steps):
        x = rng.uniform(-2, 2, size=(batch_size, 1))
        y = 0.8 * x**2 + 0.1 + rng.normal(0, 0.1, size=x.shape)
        yield x, y


OPTIMIZERS_04 = {"adamw": lambda: optax.adamw(1e-2), "sgd": lambda: optax.sgd(0.01)}


def create_04(opt: str):
    model = MLP(1, 64, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, OPTIMIZERS_04[opt](), wrt=nnx.Param)
    # replicate state
    state = nnx.state((model, optimizer))
    state = jax.device_put(state, model_sharding)
    nnx.update((model, optimizer), state)
    return model, optimizer


@functools.lru_cache(maxsize=None)
def run_example_04(opt: str, steps: int = STEPS_04):
    """The example's training loop as it is (the oracle): each step's loss, and the final
    model and optimizer state as numpy."""
    model, optimizer = create_04(opt)
    losses = []
    for step, (x, y) in enumerate(dataset(steps, BATCH_04, np.random.RandomState(0))):
        # shard data
        x, y = jax.device_put((x, y), data_sharding)
        # train
        loss = train_step(model, optimizer, x, y)
        losses.append(float(loss))
    state = jax.device_get(nnx.state((model, optimizer)))
    return np.array(losses), state


def run_port_04(opt: str, step_fn=train_step, steps: int = STEPS_04):
    """The port: the same model, placement and data; the nnx objects split into a
    functional step around the example's ``train_step`` (``step_fn``)."""
    model, optimizer = create_04(opt)
    graphdef, state = nnx.split((model, optimizer))

    def replica_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss = step_fn(model, optimizer, x, y)
        return nnx.state((model, optimizer)), loss

    p_train_step = rt.replicate(replica_step, num_replicas=N)
    losses = []
    for step, (x, y) in enumerate(dataset(steps, BATCH_04, np.random.RandomState(0))):
        state, loss = p_train_step(state, rt.distribute(x, N), rt.distribute(y, N))
        assert isinstance(loss, rt.PerReplica)
        losses.append(float(rt.reduce("mean", loss)))
    assert p_train_step.cache_info().misses == 1
    return np.array(losses), state


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_04_port_equals_the_examples_sharded_program(opt):
    want_losses, want_state = run_example_04(opt)
    losses, state = run_port_04(opt)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert_states_close(state, want_state, f"04 ({opt}) state")
    # training moved the weights and lowered the loss
    assert want_state[1]["step"][...] == STEPS_04
    assert want_losses[-5:].mean() < 0.5 * want_losses[:5].mean()


def test_04_port_with_steps_per_call_equals_the_examples_sharded_program():
    """The same port, 5 steps per call (one ``lax.scan`` carrying the ``nnx.State``),
    the state donated; SGD."""
    k = 5
    want_losses, want_state = run_example_04("sgd")
    model, optimizer = create_04("sgd")
    graphdef, state = nnx.split((model, optimizer))

    def replica_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss = train_step(model, optimizer, x, y)
        return nnx.state((model, optimizer)), loss

    p_train_step = rt.replicate(replica_step, num_replicas=N, steps_per_call=k, donate=True)
    data = list(dataset(STEPS_04, BATCH_04, np.random.RandomState(0)))
    losses = []
    for c in range(0, STEPS_04, k):
        xs, ys = zip(*data[c:c + k])
        state, loss = p_train_step(state, rt.distribute_steps(list(xs), N),
                                   rt.distribute_steps(list(ys), N))
        losses.extend(np.mean([np.asarray(v) for v in loss.values], axis=0))
    assert p_train_step.cache_info().misses == 1
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert_states_close(state, want_state, "04 (steps_per_call=5) state")


def test_04_nnx_objects_given_to_the_replicated_step_are_an_error():
    """The example's ``nnx.jit`` step with only the decorator swapped: ``rt.replicate``
    given the model and optimizer themselves. ``nnx.jit`` updates them in place, which a
    step (like ``jax.jit``, which gets copies) cannot do for the caller's objects: before,
    the updates were dropped without an error (it never trained: the kernel did not move,
    ``optimizer.step`` stayed 0). Now the first call is a ``TypeError`` naming a changed
    leaf and saying to split the state; the objects are untouched."""
    model, optimizer = create_04("sgd")
    before = jax.tree.map(np.asarray, nnx.state((model, optimizer)))
    p_train_step = rt.replicate(train_step, num_replicas=N)
    x, y = next(dataset(1, BATCH_04, np.random.RandomState(0)))
    with pytest.raises(TypeError, match=r"the step train_step changed args\[\d\]\S* .*in "
                                        r"place, to a value it does not return.*nnx\.split"):
        p_train_step(model, optimizer, rt.distribute(x, N), rt.distribute(y, N))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(
        (model, optimizer))), before)


# the example's train_step with a layout kept inside it, as a step for jax.jit has it
def _update(model: MLP, optimizer: nnx.Optimizer, x, y):
    """The example's ``train_step`` body (the loss, its gradient, the update)."""
    def loss_fn(model: MLP):
        return jnp.mean((y - model(x)) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def train_step_device_put(model: MLP, optimizer: nnx.Optimizer, x, y):
    x, y = jax.device_put((x, y), data_sharding)
    return _update(model, optimizer, x, y)


@nnx.jit
def train_step_constraint(model: MLP, optimizer: nnx.Optimizer, x, y):
    x, y = jax.lax.with_sharding_constraint((x, y), data_sharding)
    return _update(model, optimizer, x, y)


@nnx.jit(in_shardings=(model_sharding, model_sharding, data_sharding, data_sharding))
def train_step_in_shardings(model: MLP, optimizer: nnx.Optimizer, x, y):
    return _update(model, optimizer, x, y)


@nnx.jit
def train_step_replicated_layouts(model: MLP, optimizer: nnx.Optimizer, x, y):
    state = jax.device_put(nnx.state((model, optimizer)), model_sharding)
    nnx.update((model, optimizer), state)
    x, y = jax.lax.with_sharding_constraint((x, y), model_sharding)
    return _update(model, optimizer, x, y)


def _layout_error(fn, batch: int) -> str:
    """The message of the ``rt.ShardingConstraintError`` that the example's step ``fn``
    (written for ``jax.jit`` over the data mesh) raises when a replicated step calls it
    on a batch of ``batch`` rows split over the replicas."""
    model, optimizer = create_04("sgd")
    graphdef, state = nnx.split((model, optimizer))

    def replica_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        return nnx.state((model, optimizer)), fn(model, optimizer, x, y)

    x, y = next(dataset(1, batch, np.random.RandomState(0)))
    with pytest.raises(rt.ShardingConstraintError) as e:
        rt.replicate(replica_step, num_replicas=N)(state, rt.distribute(x, N),
                                                   rt.distribute(y, N))
    return str(e.value)


@pytest.mark.parametrize("batch", [BATCH_04, 8 * N])
@pytest.mark.parametrize("layout", ["device_put", "with_sharding_constraint"])
def test_04_data_layout_in_the_step_is_an_error_naming_its_line(layout, batch):
    """``P('data')`` inside the step splits the replica's own rows over every device:
    an ``rt.ShardingConstraintError`` naming the line, whether or not the replica's rows
    divide by the mesh (the example's batch of 16: 2 rows per replica)."""
    fn, code = {"device_put": (train_step_device_put, "jax.device_put((x, y), data_sharding)"),
                "with_sharding_constraint": (train_step_constraint,
                                             "jax.lax.with_sharding_constraint((x, y), data_")
                }[layout]
    msg = _layout_error(fn, batch)
    assert code in source_line(msg), msg
    assert f"f32[{batch // N},1]" in msg and "P('data',)" in msg, msg


@pytest.mark.parametrize("batch", [BATCH_04, 8 * N])
def test_04_nnx_jit_in_shardings_splitting_the_batch_is_an_error(batch):
    """The same layout written as ``nnx.jit(in_shardings=...)`` (how NNX code places a
    jitted step's arguments): it splits the replica's rows as the constraint does."""
    _layout_error(train_step_in_shardings, batch)


def test_04_replicated_layouts_in_the_step_are_accepted():
    """``jax.device_put(state, model_sharding)`` and a ``P()`` constraint on the batch
    inside the step replicate: layouts, never values; the numbers are the example's."""
    want_losses, want_state = run_example_04("adamw")
    losses, state = run_port_04("adamw", train_step_replicated_layouts)
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert_states_close(state, want_state, "04 (replicated layouts) state")


# ======================================================================================
# 06_scan_over_layers.py
# ======================================================================================

DIM_06, LAYERS_06, BATCH_06, STEPS_06 = 10, 5, 16, 2


class Block(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
    """
    An MLP that uses `vmap` during `__init__` to create a Block instance
    with an additional `layer` axis, and `scan` during `__call__` to apply
    the sequence of layers iteratively over the input / output `x`.
    """

    def __init__(self, dim: int, *, n_layers: int, rngs: nnx.Rngs):
        self.n_layers = n_layers

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(axis_size=n_layers)
        def create_block(rngs: nnx.Rngs):
            return Block(dim, rngs=rngs)

        self.layers = create_block(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan
        def scan_fn(x: jax.Array, block: Block):
            x = block(x)
            return x, None

        x, _ = scan_fn(x, self.layers)

        return x


@functools.lru_cache(maxsize=None)
def create_06():
    # nnx.jit: eager init compiles every op once (seconds); same values
    model = nnx.jit(lambda: ScanMLP(DIM_06, n_layers=LAYERS_06, rngs=nnx.Rngs(0)))()
    assert nnx.state(model, nnx.Param)["layers"]["linear"]["kernel"].shape == (5, 10, 10)
    return nnx.split(model)


def batches_06(steps=STEPS_06):
    rng = np.random.RandomState(6)
    return [(rng.normal(size=(BATCH_06, DIM_06)).astype(np.float32),
             rng.normal(size=(BATCH_06, DIM_06)).astype(np.float32)) for _ in range(steps)]


def make_train_step_06(graphdef, pmean_stats=True):
    """SGD on ``ScanMLP``, written as NNX code for ``jax.pmap`` is (``lax.pmean`` of the
    gradients and, in train mode, of the BatchNorm statistics)."""
    def train_step(state, x, y):
        model = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        grads = jax.lax.pmean(grads, "batch")
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
        if pmean_stats:
            nnx.update(model, jax.lax.pmean(nnx.state(model, nnx.BatchStat), "batch"))
        return nnx.state(model), {"loss": jax.lax.pmean(loss, "batch")}
    return train_step


def leaves_np(tree):
    """Every leaf as numpy (PRNG keys as their key data)."""
    def one(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return [one(x) for x in jax.tree.leaves(tree)]


def run_06(mode, train_step, state, data):
    """``STEPS_06`` steps of ``train_step``: ``"replicate"`` (N replicas), ``"pmap"``
    (N devices, the state stacked as ``flax.jax_utils.replicate`` does) or ``"global"``
    (``jax.jit`` on one device of the step on the global batch, mapped over an axis
    ``'batch'`` of size 1, so every ``pmean`` is the identity). Returns the final state
    as ``[n, ...]`` numpy leaves and each step's loss (replicate: ``PerReplica`` values)."""
    losses = []
    if mode == "replicate":
        step = rt.replicate(train_step, num_replicas=N, axis_name="batch")
        for x, y in data:
            state, metrics = step(state, rt.distribute(x, N), rt.distribute(y, N))
            assert all(not isinstance(v, rt.PerReplica) for v in jax.tree.leaves(
                state, is_leaf=rt.PerReplica.__instancecheck__)), "state came back PerReplica"
            losses.append(np.asarray(metrics["loss"]))
        assert step.cache_info().misses == 1
        return [np.broadcast_to(v, (N,) + v.shape) for v in leaves_np(state)], losses
    n = N if mode == "pmap" else 1
    stack = lambda t: jax.tree.map(lambda v: jnp.stack([v] * n), t)  # noqa: E731
    if mode == "pmap":
        step = jax.pmap(train_step, axis_name="batch", devices=jax.devices()[:N])
    else:
        step = jax.jit(jax.vmap(train_step, axis_name="batch"))
    state = stack(state)
    for x, y in data:
        state, metrics = step(state, x.reshape(n, -1, x.shape[-1]), y.reshape(n, -1, y.shape[-1]))
        losses.append(np.asarray(metrics["loss"]))
    return leaves_np(state), losses


def assert_leaves_close(got, want, what, rtol=RTOL, atol=1e-6):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"{what}: leaf {i}")


def test_06_the_examples_forward_pass():
    """The source's program: ``model(x)`` on ``jnp.ones((3, 10))`` in train mode (batch
    statistics, dropout), replicated with ``x`` mirrored: every replica computes what
    ``jax.jit`` computes, and the updated statistics and rng counts stay mirrored."""
    graphdef, state = create_06()

    def forward(state, x):
        model = nnx.merge(graphdef, state)
        y = model(x)
        return nnx.state(model), y

    x = jnp.ones((3, 10))
    want_state, want_y = jax.jit(forward)(state, x)
    new_state, y = rt.replicate(forward, num_replicas=N)(state, x)
    assert not isinstance(y, rt.PerReplica) and y.shape == (3, 10)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=RTOL, atol=1e-7)
    assert_leaves_close(leaves_np(new_state), leaves_np(want_state), "06 forward state")


def test_06_scan_over_layers_eval_mode_equals_global_jit():
    """Running BatchNorm statistics, no dropout: the replicas' program is the global
    batch's; the gradients of the stacked layers go through ``nnx.scan``'s backward loop."""
    graphdef, state = create_06()
    model = nnx.merge(graphdef, state)
    model.eval()
    graphdef, state = nnx.split(model)
    data = batches_06()
    train_step = make_train_step_06(graphdef)
    got, got_losses = run_06("replicate", train_step, state, data)
    want, want_losses = run_06("global", train_step, state, data)
    assert_leaves_close(got, [np.broadcast_to(w, (N,) + w.shape[1:]) for w in want],
                        "06 eval mode state, replicate vs global jit")
    np.testing.assert_allclose([l.item() for l in got_losses],
                               [l.item() for l in want_losses], rtol=RTOL)
    assert any(not np.allclose(a, b) for a, b in zip(leaves_np(state), [w[0] for w in want]))


def test_06_scan_over_layers_train_mode_equals_pmap():
    """Train mode: BatchNorm over each replica's rows (statistics pmean'd), dropout from
    the model's own ``Rngs`` (a mirrored key per layer: the same masks as pmap's)."""
    graphdef, state = create_06()
    data = batches_06()
    train_step = make_train_step_06(graphdef)
    got, got_losses = run_06("replicate", train_step, state, data)
    want, want_losses = run_06("pmap", train_step, state, data)
    assert_leaves_close(got, want, "06 train mode state, replicate vs pmap")
    for g, w in zip(got_losses, want_losses):
        np.testing.assert_allclose(np.broadcast_to(g, w.shape), w, rtol=RTOL)


def test_06_batch_stats_left_per_replica_warn():
    graphdef, state = create_06()
    x, y = batches_06(1)[0]
    step = rt.replicate(make_train_step_06(graphdef, pmean_stats=False), num_replicas=N,
                        axis_name="batch")
    with pytest.warns(rt.DivergingStateWarning) as record:
        new_state, _ = step(state, rt.distribute(x, N), rt.distribute(y, N))
    msg = "\n".join(str(r.message) for r in record)
    assert "mean" in msg and "var" in msg, msg
    # only the statistics differ between replicas
    per_replica = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_flatten_with_path(
        new_state, is_leaf=rt.PerReplica.__instancecheck__)[0] if isinstance(v, rt.PerReplica)]
    assert per_replica and all("'bn'" in p and ("'mean'" in p or "'var'" in p)
                               for p in per_replica), per_replica


# ======================================================================================
# 03_train_state.py and 01_functional_api.py (each example's own classes)
# ======================================================================================

STEPS_0103 = 10


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
        self.b = nnx.Param(jnp.zeros((dout,)))

    def __call__(self, x):
        return x @ self.w[...] + self.b[...]  # the source: .value (deprecated in flax 0.12)


class Count(nnx.Variable[nnx.A]):
    pass


class MLP03(nnx.Module):
    def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.linear1 = Linear(din, dhidden, rngs=rngs)
        self.linear2 = Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        self.count[...] += 1  # the source: self.count.value += 1
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x


class TrainState(train_state.TrainState):
    counts: nnx.State
    graphdef: nnx.GraphDef


@jax.jit
def train_step_03(state: TrainState, batch):
    x, y = batch

    def loss_fn(params):
        model = nnx.merge(state.graphdef, params, state.counts, copy=True)
        y_pred = model(x)
        loss = jnp.mean((y - y_pred) ** 2)
        counts = nnx.state(model, Count)
        return loss, counts

    grads, counts = jax.grad(loss_fn, has_aux=True)(state.params)
    # sdg update
    state = state.apply_gradients(grads=grads, counts=counts)

    return state


@jax.jit
def eval_step_03(state: TrainState, batch):  # the source's test_step (a name pytest collects)
    x, y = batch
    model = nnx.merge(state.graphdef, state.params, state.counts)
    y_pred = model(x)
    loss = jnp.mean((y - y_pred) ** 2)
    return {'loss': loss}


def data_0103(f, seed):
    """The example's ``X``, ``Y`` (``f``: its curve) and ``dataset``, from a seeded
    generator (the examples: ``np.random``; 01's ``jnp.sin`` as ``np.sin``: the data on
    the host, as 03's)."""
    rng = np.random.RandomState(seed)
    X = np.linspace(*f["range"], 100)[:, None]
    Y = f["curve"](X) + rng.normal(0, 0.1, size=X.shape)

    def dataset(batch_size):
        while True:
            idx = rng.choice(len(X), size=batch_size)
            yield X[idx], Y[idx]
    return X, Y, dataset


def create_03():
    model = MLP03(din=1, dhidden=32, dout=1, rngs=nnx.Rngs(0))
    graphdef, params, counts = nnx.split(model, nnx.Param, Count)
    return TrainState.create(apply_fn=None, graphdef=graphdef, params=params,
                             tx=optax.sgd(0.1), counts=counts)


def test_03_train_state_port_equals_the_examples_program():
    curve = {"range": (0, 1), "curve": lambda X: 0.8 * X**2 + 0.1}
    p_train_step = rt.replicate(train_step_03, num_replicas=N)
    p_test_step = rt.replicate(eval_step_03, num_replicas=4)  # 100 rows: 25 per replica
    runs = {}
    for mode in ("jit", "replicate"):
        X, Y, dataset = data_0103(curve, seed=3)
        state = create_03()
        for step, batch in enumerate(dataset(32)):
            if mode == "jit":
                state = train_step_03(state, batch)
            else:
                state = p_train_step(state, rt.distribute(batch, N))
            if step >= STEPS_0103 - 1:
                break
        if mode == "jit":
            loss = eval_step_03(state, (X, Y))["loss"]
        else:
            loss = rt.reduce("mean", p_test_step(state, rt.distribute((X, Y), 4))["loss"])
        runs[mode] = (state, float(loss))
    (want, want_loss), (got, got_loss) = runs["jit"], runs["replicate"]
    # one compile: TrainState.create's step=0 is a weakly typed int32 and so is the step
    # returned (results keep jax.jit's weak types); jax.jit compiles twice, its C++ cache
    # keying on the Python type too (an int, then an array)
    assert p_train_step.cache_info().misses == 1 and train_step_03._cache_size() == 2
    assert_states_close((got.step, got.params, got.opt_state, got.counts),
                        (want.step, want.params, want.opt_state, want.counts), "03 state")
    np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    model = nnx.merge(got.graphdef, got.params, got.counts)
    assert model.count[...] == STEPS_0103  # 'times called': once per step, not per replica
    assert got.step == STEPS_0103


class MLP01(nnx.Module):
    def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.linear1 = Linear(din, dhidden, rngs=rngs)
        self.linear2 = Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        self.count[...] += 1
        return self.linear2(jax.nn.relu(self.linear1(x) * 0.5))


def make_steps_01():
    graphdef, params, counts = nnx.split(
        MLP01(din=1, dhidden=32, dout=1, rngs=nnx.Rngs(0)), nnx.Param, Count
    )

    @jax.jit
    def train_step(params, counts, batch):
        x, y = batch

        def loss_fn(params):
            # the source: nnx.merge(graphdef, params, counts), which flax 0.12.8 refuses
            # under its own jax.jit ("Cannot mutate Count from a different trace level":
            # the merged Count is jit's, mutated under grad); copy=True as 03 has it
            model = nnx.merge(graphdef, params, counts, copy=True)
            y_pred = model(x)
            new_counts = nnx.state(model, Count)
            loss = jnp.mean((y - y_pred) ** 2)
            return loss, new_counts

        grad, counts = jax.grad(loss_fn, has_aux=True)(params)
        #                          |-------- sgd ---------|
        params = jax.tree.map(lambda w, g: w - 0.1 * g, params, grad)

        return params, counts

    @jax.jit
    def test_step(params: nnx.State, counts: nnx.State, batch):
        x, y = batch
        model = nnx.merge(graphdef, params, counts)
        y_pred = model(x)
        loss = jnp.mean((y - y_pred) ** 2)
        return {'loss': loss}

    return graphdef, params, counts, train_step, test_step


def test_01_functional_api_port_equals_the_examples_program():
    curve = {"range": (-np.pi, np.pi), "curve": lambda X: 0.8 * np.sin(X) + 0.1}
    runs = {}
    for mode in ("jit", "replicate"):
        X, Y, dataset = data_0103(curve, seed=1)
        graphdef, params, counts, train_step, test_step = make_steps_01()
        if mode == "replicate":
            p_train_step = rt.replicate(train_step, num_replicas=N)
            p_test_step = rt.replicate(test_step, num_replicas=4)
        for step, batch in enumerate(dataset(32)):
            if mode == "jit":
                params, counts = train_step(params, counts, batch)
            else:
                params, counts = p_train_step(params, counts, rt.distribute(batch, N))
            if step >= STEPS_0103 - 1:
                break
        if mode == "jit":
            loss = test_step(params, counts, (X, Y))["loss"]
        else:
            loss = rt.reduce("mean", p_test_step(params, counts, rt.distribute((X, Y), 4))["loss"])
        runs[mode] = (params, counts, float(loss), graphdef)
    want_params, want_counts, want_loss, _ = runs["jit"]
    params, counts, loss, graphdef = runs["replicate"]
    assert_states_close((params, counts), (want_params, want_counts), "01 state")
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    model = nnx.merge(graphdef, params, counts)
    assert model.count[...] == STEPS_0103  # 'times called'
