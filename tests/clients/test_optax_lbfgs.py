"""Port of google-deepmind/optax examples/lbfgs.ipynb.

Kept from the source: ``run_opt`` (the notebook's "L-BFGS solver" loop: a
``lax.while_loop`` whose body takes ``optax.value_and_grad_from_state(fun)`` and
``opt.update(grad, state, params, value=value, grad=grad, value_fn=fun)``, and whose
predicate reads the count and the gradient norm from the optimizer state with
``optax.tree.get``), the optimizer ``optax.lbfgs()`` (its zoom linesearch is a second
``while_loop`` that evaluates ``value_and_grad(fun)`` at trial points), and the
"linesearch" cell's loop (``optax.chain(optax.sgd(1.0),
optax.scale_by_backtracking_linesearch(max_backtracking_steps=15, store_grad=True))``
with ``value_and_grad_from_state``), one iteration per step.

Data parallel: the notebook's objective is a fixed function; here ``fun(w)`` is a
least-squares loss over the replica's slice of a global batch, averaged over replicas
with ``lax.pmean`` (pmap style), so every value, gradient and linesearch decision is the
global batch's, and the global-batch jit is an oracle. Gradients are taken *inside* the
loops, so the step's gradient all-reduces run in loop bodies whose predicates are
mirrored. pmap is no reference for that: its ``w`` is a mapped (varying) value, so
``grad`` of the ``pmean``ed loss is each replica's own ``(1/N) dL_r/dw`` and the replicas
drift apart (the notebook's loop assumes one ``w``); replicate's ``w`` is mirrored, and its
gradient is the global one. Without the ``pmean``, each replica solves its own problem,
as under pmap: the solver's state becomes per-replica one field after another, which JAX
types only when loop carries and cond branches are cast to varying to a fixed point.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree
import pytest

from tests.clients._harness import (REPLICAS, Port, Split, assert_changed,
                                    assert_trees_close, train)

DIM = 8
GLOBAL_BATCH = 32


def run_opt(init_params, fun, opt, max_iter, tol):
  value_and_grad_fun = optax.value_and_grad_from_state(fun)

  def step(carry):
    params, state = carry
    value, grad = value_and_grad_fun(params, state=state)
    updates, state = opt.update(
        grad, state, params, value=value, grad=grad, value_fn=fun
    )
    params = optax.apply_updates(params, updates)
    return params, state

  def continuing_criterion(carry):
    _, state = carry
    iter_num = optax.tree.get(state, 'count')
    grad = optax.tree.get(state, 'grad')
    err = optax.tree.norm(grad)
    return (iter_num == 0) | ((iter_num < max_iter) & (err >= tol))

  init_carry = (init_params, opt.init(init_params))
  final_params, final_state = jax.lax.while_loop(
      continuing_criterion, step, init_carry
  )
  return final_params, final_state


def local_loss(w, batch):
    """Least squares on this replica's examples (a mean over them)."""
    r = batch["x"] @ w - batch["y"]
    return 0.5 * jnp.mean(r * r)


def global_fun(batch):
    """The objective over the global batch: the replicas' means, averaged."""
    return lambda w: jax.lax.pmean(local_loss(w, batch), "batch")


def lbfgs_step(w, batch):
    fun = global_fun(batch)
    final_params, final_state = run_opt(w, fun, optax.lbfgs(), max_iter=6, tol=1e-4)
    return final_params, {"value": fun(final_params),
                          "iterations": optax.tree.get(final_state, "count")}


def linesearch_step(w, state, batch):
    fun = global_fun(batch)
    opt = optax.chain(optax.sgd(learning_rate=1.0), optax.scale_by_backtracking_linesearch(
        max_backtracking_steps=15, store_grad=True))
    v, g = optax.value_and_grad_from_state(fun)(w, state=state)
    u, state = opt.update(g, state, w, value=v, grad=g, value_fn=fun)
    return w + u, state, v


def examples(seed=0, steps=2):
    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=DIM).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(GLOBAL_BATCH, DIM)).astype(np.float32)
        y = (x @ w_true + 0.1 * rng.normal(size=GLOBAL_BATCH)).astype(np.float32)
        out.append({"x": x, "y": y})
    return out


def check_against_global(port, n, steps=2, rtol=2e-5, atol=1e-6):
    """replicate's state and metrics after ``steps`` steps equal the global-batch jit's."""
    r_state, r_metrics = train(port, "replicate", n, steps)
    g_state, g_metrics = train(port, "global", 1, steps)
    assert_changed(port.state, g_state, "global jit")
    wide = lambda t: jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape[1:]), t)  # noqa: E731
    assert_trees_close(r_state, wide(g_state), f"N={n} state, replicate vs global jit", rtol, atol)
    for i, (rm, gm) in enumerate(zip(r_metrics, g_metrics)):
        assert_trees_close(rm, wide(gm), f"N={n} step {i} metrics, replicate vs global jit",
                           rtol, atol)


@pytest.mark.parametrize("n", REPLICAS)
def test_lbfgs_solver_loop(n):
    batches = examples()
    w0 = np.zeros(DIM, np.float32)
    port = Port(step=lbfgs_step, state=(w0,), inputs=lambda i: ((Split(batches[i]),), {}))
    check_against_global(port, n)


@pytest.mark.parametrize("n", REPLICAS)
def test_backtracking_linesearch_loop(n):
    batches = examples(seed=1, steps=3)
    w0 = np.zeros(DIM, np.float32)
    opt = optax.chain(optax.sgd(learning_rate=1.0), optax.scale_by_backtracking_linesearch(
        max_backtracking_steps=15, store_grad=True))
    port = Port(step=linesearch_step, state=(w0, opt.init(w0)),
                inputs=lambda i: ((Split(batches[i]),), {}),
                split_out=lambda out: ((out[0], out[1]), out[2]))
    check_against_global(port, n, steps=3)


def local_lbfgs_step(w, batch):
    """The solver on the replica's own loss (no pmean); ``w`` is only its start."""
    fun = lambda v: local_loss(v, batch)  # noqa: E731
    final_params, final_state = run_opt(w, fun, optax.lbfgs(), max_iter=6, tol=1e-4)
    return w, {"params": final_params, "value": fun(final_params),
               "iterations": optax.tree.get(final_state, "count")}


@pytest.mark.parametrize("n", REPLICAS)
def test_lbfgs_on_each_replicas_own_loss(n):
    """Each replica solves its own problem, as under pmap: the loss differs per replica,
    so the linesearch's values, the solver's state and, from the first iteration on, the
    parameters vary (the state becomes per-replica one field after another: loop carries
    cast to varying to a fixed point, and a cond whose branches differ in what varies);
    no gradient is all-reduced, and no collective runs in a loop that the replicas leave
    at different times."""
    batches = examples()
    w0 = np.zeros(DIM, np.float32)
    port = Port(step=local_lbfgs_step, state=(w0,), inputs=lambda i: ((Split(batches[i]),), {}))
    _, r_metrics = train(port, "replicate", n, steps=1)
    _, p_metrics = train(port, "pmap", n, steps=1)
    assert_trees_close(r_metrics, p_metrics, f"N={n} replicate vs pmap")
    # replica r's answer is the one-device solver's on its own slice
    size = GLOBAL_BATCH // n
    solve = jax.jit(local_lbfgs_step)
    for r in range(n):
        own = {k: v[r * size:(r + 1) * size] for k, v in batches[0].items()}
        want = solve(w0, own)[1]
        got = jax.tree.map(lambda x: x[r], r_metrics[0])
        assert_trees_close(got, want, f"N={n} replica {r} vs its own solve")
    assert len({float(v) for v in r_metrics[0]["value"]}) == n, "the replicas' problems differ"
