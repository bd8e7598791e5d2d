"""Loops whose carry starts mirrored and becomes per-replica (an RNN's zero state fed
per-replica inputs): traced without the user casting the carry by hand, gradients
all-reduced once, numbers equal to one device on the global batch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import runtime as rt


def rnn_scan(p, xs):                       # xs: [T, B, D]
    h, _ = lax.scan(lambda h, x: (jnp.tanh(h @ p["w"] + x @ p["u"]), None),
                    jnp.zeros((xs.shape[1], 4)), xs)
    return jnp.mean(h ** 2)


def rnn_fori(p, xs):
    def body(t, h):
        return jnp.tanh(h @ p["w"] + xs[t] @ p["u"])
    return jnp.mean(lax.fori_loop(0, xs.shape[0], body, jnp.zeros((xs.shape[1], 4))) ** 2)


def rnn_while(p, xs):
    def body(c):
        t, h = c
        return t + 1, jnp.tanh(h @ p["w"] + xs[t] @ p["u"])
    _, h = lax.while_loop(lambda c: c[0] < xs.shape[0], body, (0, jnp.zeros((xs.shape[1], 4))))
    return jnp.mean(h ** 2)


@pytest.mark.parametrize("loss", [rnn_scan, rnn_fori], ids=lambda f: f.__name__)
@pytest.mark.parametrize("n", [2, 4])
def test_loop_with_carry_becoming_varying_matches_single_device(loss, n):
    rng = np.random.default_rng(n)
    p = {"w": rng.normal(size=(4, 4)).astype(np.float32) * 0.5,
         "u": rng.normal(size=(3, 4)).astype(np.float32) * 0.5}
    xs = rng.normal(size=(5, 2 * n, 3)).astype(np.float32)   # time-major, batch on axis 1

    def step(p, xs):
        l, g = jax.value_and_grad(loss)(p, jnp.swapaxes(xs, 0, 1))
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l

    batch_major = np.swapaxes(xs, 0, 1)
    got, _ = rt.replicate(step, num_replicas=n)(p, rt.distribute(batch_major, n))

    def global_loss(p):
        parts = jnp.split(xs, n, axis=1)
        return jnp.mean(jnp.stack([loss(p, part) for part in parts]))
    want = jax.jit(lambda p: jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(global_loss)(p)))(p)
    for k in p:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", [rnn_scan, rnn_fori, rnn_while], ids=lambda f: f.__name__)
def test_loop_forward_per_replica_values(loss):
    """while_loop has no reverse mode in JAX: check the per-replica forward values."""
    n = 4
    rng = np.random.default_rng(7)
    p = {"w": rng.normal(size=(4, 4)).astype(np.float32) * 0.5,
         "u": rng.normal(size=(3, 4)).astype(np.float32) * 0.5}
    xs = rng.normal(size=(2 * n, 5, 3)).astype(np.float32)
    got = rt.replicate(lambda p, xs: loss(p, jnp.swapaxes(xs, 0, 1)), num_replicas=n)(
        p, rt.distribute(xs, n))
    assert isinstance(got, rt.PerReplica) and len(got.values) == n
    for r in range(n):
        want = jax.jit(loss)(p, np.swapaxes(xs[2 * r:2 * r + 2], 0, 1))
        np.testing.assert_allclose(got.values[r], want, rtol=1e-5, atol=1e-6)


def test_outside_a_replica_trace_jax_behaviour_is_unchanged():
    """The carry promotion is scoped to our trace: a user's own shard_map still gets
    JAX's error for a carry whose type changes."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()[:2]), ("i",))

    def body(xs):
        h, _ = lax.scan(lambda h, x: (h + x, None), jnp.zeros(3), xs)
        return h[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=True)
    rt.replicate(lambda x: x, num_replicas=1)(np.ones(2, np.float32))  # installs the hook
    with pytest.raises(TypeError, match="carry input and carry output must have equal types"):
        jax.jit(f)(np.ones((4, 3), np.float32))


# -- gradient all-reduces leave the loop ----------------------------------------------------
def _collectives_in_loops(graph) -> list[str]:
    """``"<collective> in <loop>"`` for every collective inside a scan or while body of
    ``graph`` (the IR after the passes)."""
    from compiler.passes.hoist_collectives import is_collective

    return [f"{inner.name} in {op.name}" for op, _ in graph.walk() if op.name in ("scan", "while")
            for region in op.regions for inner, _ in region.walk() if is_collective(inner)]


def _hlo_loop_all_reduces(compiled) -> list[str]:
    """All-reduces of the compiled HLO whose computation is a while loop's body."""
    from compiler.hlo_report import while_bodies

    bodies = while_bodies(compiled.as_text())
    return [c.name for c in compiled.collectives()
            if c.kind == "all-reduce" and c.computation in bodies]


def nested_rnn(p, xs):
    """Two stacked RNN layers, scanned over layers (an outer scan around the time scan)."""
    def layer(h_seq, w):
        _, hs = lax.scan(lambda h, x: (jnp.tanh(h @ w + x), jnp.tanh(h @ w + x)),
                         jnp.zeros((h_seq.shape[1], 3)), h_seq)
        return hs, None
    hs, _ = lax.scan(layer, xs, p["ws"])
    return jnp.mean(hs ** 2)


def remat_layers(p, xs):
    """Layers scanned with ``jax.checkpoint`` on each (how large models are trained):
    each layer's weight gradient is a per-step output of the backward scan, computed
    inside the checkpoint's region."""
    @jax.checkpoint
    def layer(h, w):
        return jnp.tanh(h @ w), None
    h, _ = lax.scan(layer, xs[-1], p["ws"])
    return jnp.mean(h ** 2)


@pytest.mark.parametrize("loss, shape", [(rnn_scan, (3, 4)), (rnn_fori, (3, 4)),
                                         (nested_rnn, None), (remat_layers, None)],
                         ids=["scan", "fori", "nested", "remat_layers"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_backward_loop_all_reduces_once_after_it(loss, shape, reduction):
    """The transposed loop accumulates each weight's gradient in a carry that starts at
    zero; its all-reduce ran in every step (one rendezvous per step and weight, and the
    XLA:CPU crash of README "Porting from pmap"). hoist-collectives makes it one
    all-reduce of the accumulated sum after the loop: Σ_t Σ_r g = Σ_r Σ_t g. Numbers
    against one device on the global batch."""
    n = 4
    rng = np.random.default_rng(3)
    p = ({"ws": rng.normal(size=(2, 3, 3)).astype(np.float32) * 0.5} if shape is None else
         {"w": rng.normal(size=(4, 4)).astype(np.float32) * 0.5,
          "u": rng.normal(size=shape).astype(np.float32) * 0.5})
    xs = rng.normal(size=(2 * n, 5, 3)).astype(np.float32)    # batch-major
    grad = lambda p, xs: jax.grad(loss)(p, jnp.swapaxes(xs, 0, 1))
    step = rt.replicate(grad, num_replicas=n, loss_reduction=reduction)
    got = step(p, rt.distribute(xs, n))
    c = 1.0 / n if reduction == "mean" else 1.0
    want = jax.jit(lambda p: jax.grad(lambda p: c * sum(
        loss(p, jnp.swapaxes(xs[2 * r:2 * r + 2], 0, 1)) for r in range(n)))(p))(p)
    for k in p:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6)
    lowered = step.lower(p, rt.distribute(xs, n))
    assert _collectives_in_loops(lowered.ir()) == []
    assert _collectives_in_loops(lowered.ir(after="replication"))  # it was in the loop
    assert _hlo_loop_all_reduces(lowered.compile()) == []


def test_gradient_of_a_mirrored_sequence_all_reduces_its_stacked_steps_once():
    """A mirrored input scanned over (each step's slice of it is used by every replica):
    its gradient's per-step all-reduce becomes one all-reduce of the stacked steps."""
    n = 4
    rng = np.random.default_rng(5)
    w = rng.normal(size=(3, 3)).astype(np.float32) * 0.5
    prompt = rng.normal(size=(5, 3)).astype(np.float32)         # mirrored, [T, D]
    xs = rng.normal(size=(2 * n, 5, 3)).astype(np.float32)

    def loss(w, prompt, xs):                                     # xs: [B, T, D]
        def body(h, px):
            pt, xt = px
            h = jnp.tanh(h @ w + xt + pt)
            return h, jnp.sum(h * pt)
        h, ys = lax.scan(body, jnp.zeros((xs.shape[0], 3)), (prompt, jnp.swapaxes(xs, 0, 1)))
        return jnp.mean(h ** 2) + jnp.sum(ys)

    step = rt.replicate(jax.grad(loss, argnums=(0, 1)), num_replicas=n)
    got = step(w, prompt, rt.distribute(xs, n))
    want = jax.jit(jax.grad(lambda w, p: sum(loss(w, p, xs[2 * r:2 * r + 2])
                                             for r in range(n)) / n, argnums=(0, 1)))(w, prompt)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=1e-6)
    lowered = step.lower(w, prompt, rt.distribute(xs, n))
    assert _collectives_in_loops(lowered.ir()) == []
    shapes = sorted(c.shape for c in lowered.compile().collectives() if c.kind == "all-reduce")
    assert any(s.startswith("f32[5,3]") or "f32[5,3]" in s for s in shapes), shapes


# -- the other direction: a carry that comes in per-replica and leaves mirrored ------------
def _mean_loops(w):
    """Loops whose body all-reduces the carry (pmap code's ``v = pmean(v * w) + 1``):
    the carry comes in per-replica and leaves identical on every replica."""
    body = lambda v: lax.pmean(v * w, "batch") + 1.0  # noqa: E731
    return {"fori_loop": lambda v: lax.fori_loop(0, 3, lambda i, v: body(v), v),
            "scan": lambda v: lax.scan(lambda c, _: (body(c), None), v, None, length=3)[0],
            "while_loop": lambda v: lax.while_loop(lambda c: c[0] < 3,
                                                   lambda c: (c[0] + 1, body(c[1])), (0, v))[1]}


@pytest.mark.parametrize("loop", ["fori_loop", "scan", "while_loop"])
def test_loop_with_carry_becoming_mirrored_matches_pmap_and_its_gradient_the_global_one(loop):
    """Before, JAX's carry-type error (``carry input and carry output must have equal
    types``): only the initial carry was cast. Now the body's carry out is cast to
    per-replica too (a cast keeps the value): pmap's numbers, and the gradient of the
    mean over replicas of the result with respect to a mirrored ``w`` is that of the
    global program (one device, the replicas' values as a vector)."""
    n = 4
    x = np.asarray([0., 2., 5., -1.], np.float32)
    w = np.float32(0.7)
    step = rt.replicate(lambda w, v: _mean_loops(w)[loop](v), num_replicas=n, axis_name="batch")
    got = step(w, rt.PerReplica(list(x)))
    want = jax.pmap(lambda v: _mean_loops(w)[loop](v), axis_name="batch",
                    devices=jax.devices()[:n])(x)
    np.testing.assert_allclose(np.asarray(got.values), np.asarray(want), rtol=1e-6)
    if loop == "while_loop":  # (no reverse-mode derivative of a while_loop in JAX)
        return

    def global_program(w, v):                 # the replicas' values as one vector
        for _ in range(3):
            v = jnp.broadcast_to(jnp.mean(v * w), v.shape) + 1.0
        return jnp.mean(v)
    grad = rt.replicate(jax.grad(lambda w, v: _mean_loops(w)[loop](v)),
                        num_replicas=n, axis_name="batch")(w, rt.PerReplica(list(x)))
    np.testing.assert_allclose(float(grad), float(jax.jit(jax.grad(global_program))(w, x)),
                               rtol=1e-5)
