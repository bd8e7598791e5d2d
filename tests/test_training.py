"""Training through ``replicate`` equals training on one device (issue 1, "Done when").

Oracle: the same step under plain ``jax.jit`` on one device, on the global batch. With
equal shards, the mean loss over the global batch is the mean over replicas of the
per-replica mean losses, so ``loss_reduction="mean"`` must reproduce it exactly (up to
float rounding). Weight decay and user all-reduces follow TF's semantics, each checked
against an explicit oracle.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import runtime as rt
from tests.models import (RNN, init_mlp, l2, make_data, make_seq_data, mse_loss, optax_step,
                          sgd_step)

RTOL, ATOL = 1e-5, 1e-6
STEPS = 3
REPLICAS = [1, 2, 4, 8]


def assert_trees_close(got, want, rtol=RTOL, atol=ATOL):
    g_leaves, g_def = jax.tree.flatten(got)
    w_leaves, w_def = jax.tree.flatten(want)
    assert g_def == w_def
    for g, w in zip(g_leaves, w_leaves):
        assert not isinstance(g, rt.PerReplica), "a mirrored result came back as PerReplica"
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def _shards(batch, n):
    """The replicas' batches as a list (for oracles that loop over replicas)."""
    x, y = batch
    return list(zip(np.split(x, n), np.split(y, n)))


@pytest.fixture(scope="module")
def mlp():
    model, params = init_mlp(d_in=4, features=8, out=2)
    return model, params, make_data(n=16, d_in=4, d_out=2)


@pytest.mark.parametrize("n", REPLICAS)
def test_sgd_matches_single_device(mlp, n):
    model, params, batch = mlp
    step = sgd_step(mse_loss(model), lr=0.2)
    rstep = rt.replicate(step, num_replicas=n)
    ref_step = jax.jit(step)
    p, q = params, params
    for _ in range(STEPS):
        p = rstep(p, rt.distribute(batch, n))
        q = ref_step(q, batch)
    assert_trees_close(p, q)
    # the parameters moved: a step that did nothing would not pass by accident
    assert not np.allclose(jax.tree.leaves(p)[0], jax.tree.leaves(params)[0])
    assert rstep.cache_info().misses == 1


@pytest.mark.parametrize("n", [2, 4])
def test_gradient_through_a_traced_call_of_per_replica_data(mlp, n):
    """A ``jax.jit(g).trace(...)`` object called on per-replica data: jax 0.11 binds it as
    ``eval_jaxpr`` with the callee's types, which lose the data's per-replica typing, and
    would then leave the weight's gradient unsummed (each replica's own, and the weight
    per replica). It must equal the single-device step like any other."""
    model, params, (x, y) = mlp
    feats = jax.jit(lambda x: jnp.sin(jnp.tanh(x))).trace(
        jax.ShapeDtypeStruct((x.shape[0] // n, x.shape[1]), x.dtype))

    def loss(params, batch):
        bx, by = batch
        return jnp.mean((model.apply(params, feats(bx)) - by) ** 2)

    def plain(params, batch):
        bx, by = batch
        return jnp.mean((model.apply(params, jnp.sin(jnp.tanh(bx))) - by) ** 2)

    got = rt.replicate(sgd_step(loss, lr=0.2), num_replicas=n)(params, rt.distribute((x, y), n))
    want = jax.jit(sgd_step(plain, lr=0.2))(params, (x, y))
    assert_trees_close(got, want)


@pytest.mark.parametrize("n", REPLICAS)
def test_adam_matches_single_device(mlp, n):
    model, params, batch = mlp
    tx = optax.adam(1e-2)
    step = optax_step(mse_loss(model), tx)
    rstep = rt.replicate(step, num_replicas=n)
    ref_step = jax.jit(step)
    p, s = params, tx.init(params)
    q, t = params, tx.init(params)
    for _ in range(STEPS):
        p, s, loss = rstep(p, s, rt.distribute(batch, n))
        q, t, ref_loss = ref_step(q, t, batch)
        # the loss is per replica: its mean over replicas is the global-batch loss
        if n > 1:
            assert isinstance(loss, rt.PerReplica) and len(loss) == n
        np.testing.assert_allclose(rt.reduce("mean", loss), ref_loss, rtol=RTOL)
    assert_trees_close(p, q)
    assert_trees_close(s, t)


WD = 0.05


@pytest.mark.parametrize("n", [2, 4])
def test_weight_decay_mean_counts_it_once(mlp, n):
    """TF: each replica adds wd to its loss; "mean" gives grad of (1/N)Σ_r(loss_r + wd),
    i.e. the single-device step with weight decay counted once."""
    model, params, batch = mlp
    loss = mse_loss(model)

    def loss_wd(p, b):
        return loss(p, b) + WD * l2(p)
    step = sgd_step(loss_wd, lr=0.2)
    got = rt.replicate(step, num_replicas=n, loss_reduction="mean")(params, rt.distribute(batch, n))
    assert_trees_close(got, jax.jit(step)(params, batch))


@pytest.mark.parametrize("n", [2, 4])
def test_weight_decay_sum_counts_it_n_times(mlp, n):
    """TF: "sum" gives grad of Σ_r(loss_r + wd): weight decay counted N times."""
    model, params, batch = mlp
    loss = mse_loss(model)

    def loss_wd(p, b):
        return loss(p, b) + WD * l2(p)

    def oracle_loss(p, b):
        return sum(loss_wd(p, shard) for shard in _shards(b, n))
    got = rt.replicate(sgd_step(loss_wd, lr=0.05), num_replicas=n, loss_reduction="sum")(
        params, rt.distribute(batch, n))
    want = jax.jit(sgd_step(oracle_loss, lr=0.05))(params, batch)
    assert_trees_close(got, want)
    # and it is not the "mean" answer
    mean_ans = jax.jit(sgd_step(loss_wd, lr=0.05))(params, batch)
    assert not np.allclose(jax.tree.leaves(got)[0], jax.tree.leaves(mean_ans)[0], rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("n", [2, 4])
def test_user_all_reduced_loss_follows_tf(mlp, n, reduction):
    """An all-reduced loss is identical on every replica. TF: every replica holds its own
    copy of it, so "mean" gives its gradient once (the global-batch gradient, not scaled
    twice) and "sum" gives N times it (the sum over the replicas' copies)."""
    model, params, batch = mlp
    loss = mse_loss(model)

    def global_loss(p, b):
        return rt.all_reduce(loss(p, b), "mean")

    def oracle(p, b):
        return (n if reduction == "sum" else 1) * loss(p, b)
    got = rt.replicate(sgd_step(global_loss, lr=0.2), num_replicas=n, loss_reduction=reduction)(
        params, rt.distribute(batch, n))
    assert_trees_close(got, jax.jit(sgd_step(oracle, lr=0.2))(params, batch))


@pytest.mark.parametrize("n", [2, 4])
def test_sync_batch_statistic(mlp, n):
    """A loss that uses a cross-replica mean of activations (synchronized batch norm):
    the gradient flows both through the user's all-reduce and around it; "mean" must
    still give the gradient of the global-batch loss."""
    model, params, batch = mlp

    def make_loss(center):
        def loss(p, b):
            x, y = b
            h = model.apply(p, x)
            mu = center(jnp.mean(h, axis=0))
            return jnp.mean((h - mu - y) ** 2)
        return loss
    got = rt.replicate(sgd_step(make_loss(lambda m: rt.all_reduce(m, "mean")), lr=0.2),
                       num_replicas=n)(params, rt.distribute(batch, n))
    want = jax.jit(sgd_step(make_loss(lambda m: m), lr=0.2))(params, batch)
    assert_trees_close(got, want)


def test_gradient_all_reduce_in_ir_and_hlo(mlp):
    model, params, batch = mlp
    step = rt.replicate(sgd_step(mse_loss(model)), num_replicas=4)
    lowered = step.lower(params, rt.distribute(batch, 4))
    text = str(lowered.ir())
    grads = [line for line in text.splitlines() if "= all_reduce(" in line]
    # one gradient all-reduce per parameter (4: two kernels, two biases)
    assert len(grads) == len(jax.tree.leaves(params)), text
    assert all("gradient=True" in line and "reduce='sum'" in line for line in grads), grads
    # the trace marked each mirrored gradient with the loss reduction; the pass made each
    # marker a division by N ("mean") and left no marker
    before = lowered.ir(after="replication")
    marks = [op for op in before.ops if op.name == "loss_scale"]
    assert [(op.attr("replicas"), op.attr("reduction")) for op in marks] == [(0, 1)] * 4
    assert "gradient=True" not in str(before)
    after = lowered.ir()
    assert not [op for op in after.ops if op.name == "loss_scale"]
    consts = {op.result: op for op in after.ops if op.name == "constant"}
    divs = [op for op in after.ops if op.name == "div" and op.operands[1] in consts
            and float(consts[op.operands[1]].attr("value")) == 4.0]
    assert len(divs) >= 4, text
    assert "all-reduce" in lowered.compile().as_text()


def test_rnn_scan_matches_single_device():
    xs, ys = make_seq_data(n=8, t=5, d_in=3)
    model = RNN(hidden=6)
    params = model.init(jax.random.PRNGKey(0), xs[:1])

    def loss(p, b):
        return jnp.mean((model.apply(p, b[0]) - b[1]) ** 2)
    step = sgd_step(loss, lr=0.3)
    for n in (2, 4):
        rstep = rt.replicate(step, num_replicas=n)
        p, q = params, params
        for _ in range(2):
            p = rstep(p, rt.distribute((xs, ys), n))
            q = jax.jit(step)(q, (xs, ys))
        assert_trees_close(p, q)
        # the gradient all-reduces inside the transposed scan body are marked too
        ir = str(rstep.lower(params, rt.distribute((xs, ys), n)).ir())
        assert "reduce='sum', axes=('replica',))" not in ir, ir


def test_rnn_scan_with_zeros_initial_carry():
    """A carry that starts mirrored (``jnp.zeros``) and becomes per-replica in the body:
    JAX's scan-vma check would reject it unless the tracer makes loop carries varying."""
    xs, ys = make_seq_data(n=4, t=3, d_in=2)
    w = jnp.full((2, 3), 0.1)

    def loss(w, b):
        def cell(h, x):
            h = jnp.tanh(x @ w + h)
            return h, None
        h, _ = jax.lax.scan(cell, jnp.zeros((b[0].shape[0], 3)), jnp.swapaxes(b[0], 0, 1))
        return jnp.mean(h)
    step = sgd_step(loss)
    got = rt.replicate(step, num_replicas=2)(w, rt.distribute((xs, ys), 2))
    np.testing.assert_allclose(got, jax.jit(step)(w, (xs, ys)), rtol=RTOL)


@pytest.mark.parametrize("sync", [False, True], ids=["plain", "sync-stat"])
def test_checkpointed_model_matches_single_device(mlp, sync):
    """``jax.checkpoint`` puts the gradient all-reduces, and a recomputed forward pass
    (with its own casts and user all-reduces), inside a transposed region."""
    model, params, batch = mlp
    n = 4

    def make_loss(center):
        def loss(p, b):
            x, y = b
            h = jax.checkpoint(model.apply)(p, x)

            @jax.checkpoint
            def tail(h):
                mu = center(jnp.mean(h, axis=0)) if sync else 0.0
                return jnp.mean((h - mu - y) ** 2)
            return tail(h)
        return loss
    got = rt.replicate(sgd_step(make_loss(lambda m: rt.all_reduce(m, "mean")), lr=0.2),
                       num_replicas=n)(params, rt.distribute(batch, n))
    want = jax.jit(sgd_step(make_loss(lambda m: m), lr=0.2))(params, batch)
    assert_trees_close(got, want)


def test_checkpointed_scan_over_layers():
    """A scan over stacked layers with a checkpointed body (the usual memory-saving
    pattern): gradient all-reduces sit in a checkpoint region inside a transposed scan."""
    rng = np.random.RandomState(3)
    ws = rng.randn(3, 4, 4).astype(np.float32) * 0.5
    x, y = rng.randn(8, 4).astype(np.float32), rng.randn(8, 4).astype(np.float32)

    def loss(ws, b):
        @jax.checkpoint
        def layer(h, w):
            return jnp.tanh(h @ w), None
        h, _ = jax.lax.scan(layer, b[0], ws)
        return jnp.mean((h - b[1]) ** 2)
    step = sgd_step(loss, lr=0.5)
    got = rt.replicate(step, num_replicas=4)(ws, rt.distribute((x, y), 4))
    np.testing.assert_allclose(got, jax.jit(step)(ws, (x, y)), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("n", [2, 4])
def test_user_summed_loss_is_the_loss(mlp, n):
    """``all_reduce(loss, "sum")`` is a global loss too: its gradient, whatever the loss
    reduction, is the gradient of Σ_r loss_r."""
    model, params, batch = mlp
    loss = mse_loss(model)

    def summed(p, b):
        return rt.all_reduce(loss(p, b), "sum")

    def oracle(p, b):
        return sum(loss(p, shard) for shard in _shards(b, n))
    got = rt.replicate(sgd_step(summed, lr=0.05), num_replicas=n)(params, rt.distribute(batch, n))
    assert_trees_close(got, jax.jit(sgd_step(oracle, lr=0.05))(params, batch))


def test_reducing_gradients_again_mean_is_harmless_and_silent(mlp):
    """Gradients of mirrored values come back already all-reduced; a pmap habit of
    reducing them again with a mean changes nothing and warns nothing (issue 11)."""
    model, params, batch = mlp
    loss = mse_loss(model)

    def step(p, b):
        g = jax.grad(loss)(p, b)
        g = rt.all_reduce(g, "mean")
        return jax.tree.map(lambda a, c: a - 0.2 * c, p, g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = rt.replicate(step, num_replicas=4)(params, rt.distribute(batch, 4))
    assert_trees_close(got, jax.jit(sgd_step(loss, lr=0.2))(params, batch))


def test_summing_gradients_again_warns_with_the_line(mlp):
    """A sum of an already identical gradient multiplies it by N: warned, naming the line."""
    model, params, batch = mlp
    loss = mse_loss(model)

    def step(p, b):
        g = jax.grad(loss)(p, b)
        g = rt.all_reduce(g, "sum")  # the line the warning names
        return jax.tree.map(lambda a, c: a - 0.05 * c, p, g)
    line = step.__code__.co_firstlineno + 2
    with pytest.warns(UserWarning, match=rf"already identical on every replica \(test_training\.py:{line}"):
        got = rt.replicate(step, num_replicas=4)(params, rt.distribute(batch, 4))
    assert_trees_close(got, jax.jit(sgd_step(lambda p, b: 4 * loss(p, b), lr=0.05))(params, batch))


def _hvp_loss(w, b, center=lambda m: m):
    h = jnp.tanh(b[0] @ w)
    return jnp.mean((h - center(jnp.mean(h, axis=0)) - b[1]) ** 2)


@pytest.mark.parametrize("sync", [False, True], ids=["plain", "sync-stat"])
def test_hessian_vector_product(sync):
    """A gradient of a gradient: v·∇(mean loss) differentiated again must be the HVP of
    the global-batch loss (the inner gradient is a mean, its transpose is not rescaled)."""
    rng = np.random.RandomState(5)
    w, v = rng.randn(3, 2).astype(np.float32), rng.randn(3, 2).astype(np.float32)
    batch = rng.randn(8, 3).astype(np.float32), rng.randn(8, 2).astype(np.float32)
    # with sync, centering by the global-batch mean; without, no centering at all
    center = (lambda m: rt.all_reduce(m, "mean")) if sync else jnp.zeros_like
    ref_center = (lambda m: m) if sync else jnp.zeros_like

    def hvp(w, v, b, center):
        return jax.grad(lambda w: jnp.vdot(jax.grad(_hvp_loss)(w, b, center), v))(w)
    got = rt.replicate(lambda w, v, b: hvp(w, v, b, center), num_replicas=4)(
        w, v, rt.distribute(batch, 4))
    want = jax.jit(lambda w, v, b: hvp(w, v, b, ref_center))(w, v, batch)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_maml_step():
    """MAML: an inner SGD step on each replica's first example (its gradient averaged over
    replicas), then the outer gradient of the mean loss through the inner step."""
    n = 4
    rng = np.random.RandomState(6)
    w = rng.randn(3, 2).astype(np.float32)
    batch = rng.randn(8, 3).astype(np.float32), rng.randn(8, 2).astype(np.float32)

    def step(w, b):
        inner = lambda w: w - 0.5 * jax.grad(_hvp_loss)(w, (b[0][:1], b[1][:1]), jnp.zeros_like)
        return jax.grad(lambda w: _hvp_loss(inner(w), b, jnp.zeros_like))(w)

    def oracle(w, b):
        shards = _shards(b, n)

        def outer(w):
            g = sum(jax.grad(_hvp_loss)(w, (x[:1], y[:1]), jnp.zeros_like) for x, y in shards) / n
            return sum(_hvp_loss(w - 0.5 * g, s, jnp.zeros_like) for s in shards) / n
        return jax.grad(outer)(w)
    got = rt.replicate(step, num_replicas=n)(w, rt.distribute(batch, n))
    np.testing.assert_allclose(got, jax.jit(oracle)(w, batch), rtol=1e-4, atol=1e-6)
