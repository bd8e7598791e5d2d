"""JAX's own layouts inside a replicated step: ``jax.lax.with_sharding_constraint`` and
``jax.device_put`` with a sharding (what ``eqx.filter_shard`` and code written for
``jax.jit`` with shardings call).

A replica's program has no use for a layout over the devices of every replica. One that
replicates imports as the IR's ``shard {replicated}`` annotation (over the replica's
logical devices) and the numbers are ``jax.jit``'s; one that splits is a
``ShardingConstraintError`` (a ``ValueError``) naming the user's line, the value's
per-replica type, the layout and the mesh: nothing the user asked to split is
replicated silently. (Before, the layout was dropped at import and JAX's lowering failed
with ``AttributeError: 'NoneType' object has no attribute '_device_assignment'``.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import runtime as rt
from ir.types import Sharding

N = 4


def _mesh(axes=("batch",), shape=(8,)):
    return jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes),
                         devices=jax.devices()[:int(np.prod(shape))])


def _line_of(text: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f.read().splitlines(), 1) if text in line)


def _loss_with(constrain):
    def step(w, x):
        def loss(w):
            h = constrain(jnp.tanh(x @ w))
            return jnp.mean(h ** 2)
        l, g = jax.value_and_grad(loss)(w)
        return w - 0.1 * g, l
    return step


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("layout", ["named", "bare", "other_mesh", "unconstrained"])
def test_a_replicating_constraint_keeps_jits_numbers(layout, k):
    """The step with the constraint through replicate equals the step without it
    through ``jax.jit`` on the global batch (the loss a mean over equal parts)."""
    mesh = _mesh()
    spec = {"named": NamedSharding(mesh, P()), "bare": P(),
            "other_mesh": NamedSharding(_mesh(("a", "b"), (2, 2)), P(None, None)),
            "unconstrained": NamedSharding(mesh, P(None, P.UNCONSTRAINED))}[layout]
    step = _loss_with(lambda h: jax.lax.with_sharding_constraint(h, spec))
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    n = 8 // k
    w2, l = rt.replicate(step, num_replicas=n, logical_devices=k)(w, rt.distribute(x, n))
    w_ref, _ = jax.jit(_loss_with(lambda h: h))(w, x)
    np.testing.assert_allclose(np.asarray(w2), np.asarray(w_ref), rtol=2e-6, atol=1e-7)
    parts = np.split(x, n)
    np.testing.assert_allclose(np.asarray(l.values), [np.mean(np.tanh(p @ w) ** 2) for p in parts],
                               rtol=2e-6)


def test_a_replicating_constraint_is_a_replicated_annotation_in_the_ir():
    mesh = _mesh()

    def step(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())) * 2.0
    lowered = rt.replicate(step, num_replicas=N).lower(rt.distribute(np.ones((8, 3), np.float32), N))
    text = str(lowered.ir(after="import"))
    line = _line_of("return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())) * 2.0")
    shard = [ln for ln in text.splitlines() if " shard(" in ln or "= shard" in ln]
    assert len(shard) == 1, text
    assert "annotation='with_sharding_constraint'" in shard[0] and "{replicated}" in shard[0]
    assert f"test_sharding_constraints.py:{line}" in shard[0]
    assert "sharding_constraint(" not in text.replace("with_sharding_constraint", "")


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_splitting_constraint_is_an_error_naming_the_line(dynamic):
    mesh = _mesh()

    def step(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("batch"))) + 1.0
    opts = rt.RunOptions(dynamic_shapes=dynamic)
    f = rt.replicate(step, num_replicas=N, options=opts)
    with pytest.raises(rt.ShardingConstraintError) as e:
        f(rt.distribute(np.ones((8, 3), np.float32), N))
    msg = str(e.value)
    line = _line_of("return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(\"batch\"))) + 1.0")
    assert msg.startswith(f"with_sharding_constraint at test_sharding_constraints.py:{line} splits")
    assert ("f32[2,3]" if not dynamic else "f32[b") in msg
    assert "P('batch',)" in msg and "over mesh {'batch': 8}" in msg
    assert "rt.split_to_logical_devices" in msg
    assert isinstance(e.value, ValueError)


def test_a_constraint_splitting_a_mirrored_weight_is_an_error_too():
    """Splitting a weight over a replica's logical devices is
    ``rt.split_to_logical_devices``'s: a mesh-wide split is refused, not replicated."""
    mesh = _mesh(("model",), (2,))

    def step(w, x):
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(None, "model")))
        return x @ w
    f = rt.replicate(step, num_replicas=4, logical_devices=2)
    with pytest.raises(rt.ShardingConstraintError, match=r"f32\[3,4\] mirrored as P\(None, 'model'\) "
                                                      r"over mesh \{'model': 2\}"):
        f(np.ones((3, 4), np.float32), rt.distribute(np.ones((8, 3), np.float32), 4))


def test_device_put_with_a_splitting_sharding_is_an_error():
    mesh = _mesh()

    def step(x):
        return jax.device_put(x, NamedSharding(mesh, P("batch"))) * 2.0
    with pytest.raises(rt.ShardingConstraintError, match=r"^jax\.device_put at test_sharding_"
                                                      r"constraints\.py:\d+ splits a value of "
                                                      r"per-replica type f32\[8,3\] varying"):
        rt.replicate(step, num_replicas=N)(rt.distribute(np.ones((32, 3), np.float32), N))


@pytest.mark.parametrize("target", ["replicated", "device"])
def test_device_put_to_a_device_or_replicated_keeps_the_numbers(target):
    mesh = _mesh()
    dst = NamedSharding(mesh, P()) if target == "replicated" else jax.devices()[3]

    def step(x):
        return jax.device_put(x, dst) * 2.0
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    out = rt.replicate(step, num_replicas=N)(rt.distribute(x, N))
    np.testing.assert_array_equal(np.concatenate([np.asarray(v) for v in out.values]), x * 2)


def test_reshard_splitting_is_an_error_and_replicating_keeps_the_numbers():
    mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Explicit,))

    def split(x):
        return jax.sharding.reshard(x, NamedSharding(mesh, P("batch"))) * 2.0

    def replicated(x):
        return jax.sharding.reshard(x, NamedSharding(mesh, P())) * 2.0
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    with pytest.raises(rt.ShardingConstraintError, match=r"^jax\.sharding\.reshard at test_sharding_"
                                                      r"constraints\.py:\d+ splits a value of "
                                                      r"per-replica type f32\[4,4\] varying"):
        rt.replicate(split, num_replicas=N)(rt.distribute(x, N))
    out = rt.replicate(replicated, num_replicas=N)(rt.distribute(x, N))
    np.testing.assert_array_equal(np.concatenate([np.asarray(v) for v in out.values]), x * 2)


def test_a_jaxpr_traced_outside_a_replica_imports_its_constraint_by_the_same_rule():
    """``import_jaxpr`` of a jaxpr made outside ``replicate`` (no trace-time hook): a
    replicating constraint is the replicated annotation, a splitting one the error."""
    from ir.jaxpr_import import import_jaxpr
    mesh = _mesh()
    x = np.ones((8, 3), np.float32)
    rep = jax.make_jaxpr(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())))(x)
    g = import_jaxpr(rep)
    assert [op.name for op in g.ops] == ["shard"]
    assert g.ops[0].attrs == (("sharding", Sharding.replicated()),
                              ("annotation", "with_sharding_constraint"))
    split = jax.make_jaxpr(lambda x: jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, P("batch"))))(x)
    with pytest.raises(rt.ShardingConstraintError, match=r"with_sharding_constraint at test_sharding_"
                                                      r"constraints\.py:\d+ splits a value of "
                                                      r"per-replica type f32\[8,3\] as "
                                                      r"P\('batch',\) over mesh \{'batch': 8\}"):
        import_jaxpr(split)


@pytest.mark.parametrize("rows", [2, 8])
def test_jit_shardings_inside_the_step_follow_the_same_rule(rows):
    """``jax.jit(f, in_shardings=...)`` called in the step (how ``nnx.jit`` code places a
    jitted function's arguments): a split is the same ``ShardingConstraintError``, whether
    or not the replica's rows divide by the mesh (JAX's own divisibility check, an
    ``IndivisibleError`` before, is skipped in a replica), and ``jax.device_put`` of a
    split the same; replicated ``in_shardings`` keep the numbers."""
    mesh = _mesh(("data",), (8,))
    split = jax.jit(lambda x: x * 2.0, in_shardings=NamedSharding(mesh, P("data")))
    same = jax.jit(lambda x: x * 2.0, in_shardings=NamedSharding(mesh, P()))
    x = np.arange(rows * N * 3, dtype=np.float32).reshape(rows * N, 3)
    with pytest.raises(rt.ShardingConstraintError,
                       match=rf"^jax\.jit\(in_shardings=\.\.\.\) at .* splits a value of "
                             rf"per-replica type f32\[{rows},3\] varying as P\('data',\)"):
        rt.replicate(lambda x: split(x), num_replicas=N)(rt.distribute(x, N))
    with pytest.raises(rt.ShardingConstraintError, match=rf"^jax\.device_put at .*f32\[{rows},3\]"):
        rt.replicate(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))),
                     num_replicas=N)(rt.distribute(x, N))
    out = rt.replicate(lambda x: same(x), num_replicas=N)(rt.distribute(x, N))
    np.testing.assert_array_equal(np.concatenate([np.asarray(v) for v in out.values]), x * 2)


@pytest.mark.parametrize("spec", [P("batch"), P()], ids=["split", "replicated"])
def test_step_closing_over_an_array_spread_over_devices(spec):
    """A step that closes over a ``jax.Array`` placed over 8 devices (a table made for
    ``jax.jit`` code): its value is a constant of the step, the numbers ``jax.jit``'s,
    gradient included. Before, reading its type inside the layout hook placed it again,
    through the hook: a ``RecursionError``."""
    table = jax.device_put(jnp.arange(24, dtype=jnp.float32).reshape(8, 3),
                           NamedSharding(_mesh(), spec))

    def step(w, x):
        return jax.value_and_grad(lambda w: jnp.sum((x @ table.T) * w))(w)
    x = np.arange(N * 6, dtype=np.float32).reshape(N * 2, 3) / 10
    w = np.ones(8, np.float32)
    loss, grad = rt.replicate(step, num_replicas=N)(w, rt.distribute(x, N))
    for r, xr in enumerate(np.split(x, N)):
        np.testing.assert_allclose(loss.values[r], jax.jit(step)(w, xr)[0], rtol=1e-6)
    want = np.mean([jax.jit(step)(w, xr)[1] for xr in np.split(x, N)], axis=0)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6)
