"""The differential corpus of gradient semantics (issue 10): constructs users write, each
with an oracle that does not use this project.

Every :class:`Case` has a per-replica ``step(p, v, ann)`` (``p``: mirrored inputs, ``v``:
this replica's batch, ``ann``: an annotation applied to the parameters, the identity or
a split over 2 logical devices) and a ``reference(p, vs, c)`` written as one plain JAX
program on one device over every replica's batch ``vs`` (a list), where ``c`` is TF's
loss-reduction factor (1/N for ``"mean"``, 1 for ``"sum"``). The reference returns one
output pytree per replica. The rule every reference follows is the project's semantics
(README, "What the numbers mean"):

- a reverse-mode gradient (``grad``, ``vjp``, ``jacrev`` and what is built on them) with
  respect to a mirrored value is ``c · ∇ Σ_r L_r``, the exact derivative of the global
  program, where a loss identical on every replica counts once per replica;
- gradients with respect to per-replica values (inputs, ``rt.local`` views) and
  forward-mode derivatives (``jvp``, ``jacfwd``, ``linearize``) are each replica's own;
- collectives mean what they say over the replicas' values.

Most cases are losses (:func:`loss_case`): ``step = value_and_grad(loss)`` and the
reference is ``c · ∇ Σ_r L_r`` of the losses computed replica by replica
(``global_losses``, written by hand with explicit sums over ``vs`` wherever the loss uses
a collective or the replica id). Where a construct comes from public code, ``source`` names it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import runtime as rt

D_IN, D_OUT = 4, 6


@dataclass(frozen=True)
class Case:
    """One construct of the corpus (see the module docstring)."""

    name: str
    step: Callable[[Any, Any, Callable], Any]
    reference: Callable[[Any, list, Any], list]
    params: Callable[[np.random.Generator], Any]
    batch: Callable[[np.random.Generator, int], Any]
    dynamic: bool = True   # may run with dynamic shapes (per-replica sizes differ)
    rtol: float = 2e-5
    atol: float = 2e-6
    source: str = ""
    tags: tuple = field(default_factory=tuple)


CASES: dict[str, Case] = {}


def _register(case: Case) -> Case:
    assert case.name not in CASES, case.name
    CASES[case.name] = case
    return case


# -- data -------------------------------------------------------------------------------
def mlp_params(rng: np.random.Generator, dtype=np.float32) -> dict:
    """``{"params": {"w": [4, 6], "b": [6]}}``: the mirrored inputs of most cases."""
    return {"params": {"w": (rng.normal(size=(D_IN, D_OUT)) * 0.5).astype(dtype),
                       "b": (rng.normal(size=(D_OUT,)) * 0.1).astype(dtype)}}


def xy_batch(rng: np.random.Generator, b: int, dtype=np.float32) -> dict:
    """One replica's regression batch of ``b`` rows."""
    return {"x": rng.normal(size=(b, D_IN)).astype(dtype),
            "y": rng.normal(size=(b, D_OUT)).astype(dtype)}


def _mlp(q: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ q["w"] + q["b"])


def _mse(q: dict, v: dict) -> jax.Array:
    return jnp.mean((_mlp(q, v["x"]) - v["y"]) ** 2)


# -- the loss-case template ----------------------------------------------------------------
def _scale(c: Any, tree: Any) -> Any:
    return jax.tree.map(lambda a: (c * a).astype(a.dtype), tree)


def global_grad(total_losses: Callable[[Any], list], q: Any, c: Any) -> tuple[list, Any]:
    """The per-replica losses and ``c · ∇_q Σ_r L_r(q)`` (the reference's gradient)."""
    def total(q):
        ls = total_losses(q)
        return sum(jnp.sum(l) for l in ls), ls
    (_, ls), g = jax.value_and_grad(total, has_aux=True)(q)
    return ls, _scale(c, g)


def loss_case(name: str, loss: Callable[[dict, dict], jax.Array], *,
              global_losses: Callable[[dict, list], list] | None = None,
              params: Callable = mlp_params, batch: Callable = xy_batch, **kw: Any) -> Case:
    """A case ``step = value_and_grad(loss)`` with respect to ``p["params"]`` (other
    entries of ``p`` are mirrored inputs that are not differentiated). ``global_losses(p,
    vs)`` gives every replica's loss for the reference (default: ``loss`` replica by
    replica, which needs a loss without collectives or replica ids)."""
    per = global_losses or (lambda p, vs: [loss(p, v) for v in vs])

    def step(p, v, ann):
        return jax.value_and_grad(lambda q: loss({**p, "params": ann(q)}, v))(p["params"])

    def reference(p, vs, c):
        ls, g = global_grad(lambda q: per({**p, "params": q}, vs), p["params"], c)
        return [(l, g) for l in ls]
    return _register(Case(name, step, reference, params, batch, **kw))


def custom_case(name: str, step: Callable, reference: Callable, *, params: Callable = mlp_params,
                batch: Callable = xy_batch, **kw: Any) -> Case:
    """A case whose step and reference are written out by hand."""
    return _register(Case(name, step, reference, params, batch, **kw))


# == A. plain models =======================================================================
loss_case("mse_linear", lambda p, v: jnp.mean((v["x"] @ p["params"]["w"] - v["y"]) ** 2))
loss_case("mlp_tanh", lambda p, v: _mse(p["params"], v))
loss_case("sum_loss", lambda p, v: jnp.sum((_mlp(p["params"], v["x"]) - v["y"]) ** 2),
          tags=("sum over rows",))


def _xent_batch(rng, b):
    return {"x": rng.normal(size=(b, D_IN)).astype(np.float32),
            "label": rng.integers(0, D_OUT, size=(b,)).astype(np.int32)}


def _xent(p, v):
    logits = v["x"] @ p["params"]["w"] + p["params"]["b"]
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), v["label"][:, None], 1))


loss_case("softmax_xent_int_labels", _xent, batch=_xent_batch, tags=("int input",))


def _emb_params(rng):
    return {"params": {"emb": rng.normal(size=(10, D_IN)).astype(np.float32),
                       "w": rng.normal(size=(D_IN, D_OUT)).astype(np.float32) * 0.5}}


def _tok_batch(rng, b):
    return {"tok": rng.integers(0, 10, size=(b, 3)).astype(np.int32),
            "y": rng.normal(size=(b, D_OUT)).astype(np.float32)}


def _emb_loss(p, v):
    h = jnp.mean(p["params"]["emb"][v["tok"]], axis=1)
    return jnp.mean((jnp.tanh(h @ p["params"]["w"]) - v["y"]) ** 2)


loss_case("embedding_lookup_int_tokens", _emb_loss, params=_emb_params, batch=_tok_batch,
          tags=("int input", "gather"))


def _layernorm(h):
    m = jnp.mean(h, -1, keepdims=True)
    return (h - m) / jnp.sqrt(jnp.var(h, -1, keepdims=True) + 1e-5)


loss_case("layernorm_mlp", lambda p, v: jnp.mean((_layernorm(v["x"] @ p["params"]["w"]) *
                                                  p["params"]["b"] - v["y"]) ** 2))


def _attn_loss(p, v):
    h = v["x"] @ p["params"]["w"]                      # [b, 6]
    q, k = h[:, :3], h[:, 3:]
    a = jax.nn.softmax(q @ k.T / np.sqrt(3.0), axis=-1)  # rows attend to rows of the replica
    return jnp.mean((a @ h - v["y"]) ** 2)


loss_case("self_attention_over_rows", _attn_loss)
loss_case("bf16_params", lambda p, v: _mse(p["params"], jax.tree.map(
    lambda a: a.astype(jnp.bfloat16), v)).astype(jnp.float32),
    params=lambda rng: mlp_params(rng, jnp.bfloat16), rtol=3e-2, atol=3e-2, tags=("bf16",))
loss_case("mixed_precision_compute_bf16", lambda p, v: jnp.mean((
    _mlp(jax.tree.map(lambda a: a.astype(jnp.bfloat16), p["params"]),
         v["x"].astype(jnp.bfloat16)).astype(jnp.float32) - v["y"]) ** 2),
    rtol=3e-2, atol=3e-2, tags=("bf16",))
loss_case("where_nan_safe_sqrt", lambda p, v: jnp.mean(jnp.where(
    v["x"] @ p["params"]["w"] > 0, jnp.sqrt(jnp.abs(v["x"] @ p["params"]["w"]) + 1e-3), 0.0)))


def _count_params(rng):
    return {**mlp_params(rng), "count": np.int32(3), "lr_scale": np.float32(0.7)}


loss_case("int_mirrored_counter_schedule", lambda p, v: _mse(p["params"], v) *
          p["lr_scale"] / (1.0 + p["count"].astype(jnp.float32)), params=_count_params,
          tags=("int input", "mirrored non-differentiated inputs"))


# == B. custom derivatives, checkpointing ===================================================
def _scaled_identity(k: float):
    @jax.custom_vjp
    def f(x):
        return x

    f.defvjp(lambda x: (x, None), lambda _, g: (k * g,))
    return f


_times3, _reverse = _scaled_identity(3.0), _scaled_identity(-0.5)
loss_case("custom_vjp_bwd_times_3", lambda p, v: _mse({**p["params"], "w": _times3(p["params"]["w"])}, v))
loss_case("custom_vjp_gradient_reversal", lambda p, v: jnp.mean(
    (jnp.tanh(_reverse(v["x"] @ p["params"]["w"])) - v["y"]) ** 2),
    source="gradient reversal layer (Ganin & Lempitsky, DANN)")


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.05, 0.05),))
loss_case("custom_vjp_clip_cotangent", lambda p, v: jnp.mean(
    (jnp.tanh(_clip_grad(v["x"] @ p["params"]["w"])) - v["y"]) ** 2))


@jax.custom_vjp
def _ste_round(x):
    return jnp.round(x)


_ste_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))
loss_case("custom_vjp_straight_through", lambda p, v: jnp.mean(
    (_ste_round(4.0 * v["x"] @ p["params"]["w"]) / 4.0 - v["y"]) ** 2),
    source="straight-through estimator (Bengio et al. 2013)")


@jax.custom_vjp
def _mul_saving_w(x, w):
    return x @ w


def _msw_fwd(x, w):
    return x @ w, (x, w)


def _msw_bwd(res, g):
    x, w = res
    return 0.5 * g @ w.T, 2.0 * x.T @ g  # deliberately not the true derivative


_mul_saving_w.defvjp(_msw_fwd, _msw_bwd)
loss_case("custom_vjp_residuals_mirrored_and_per_replica", lambda p, v: jnp.mean(
    (jnp.tanh(_mul_saving_w(v["x"], p["params"]["w"])) - v["y"]) ** 2))


@jax.custom_vjp
def _soft(x):
    return jnp.tanh(x)


def _soft_bwd(x, g):
    _, pb = jax.vjp(lambda z: jnp.sin(z) * 0.5, x)  # the backward pass calls jax.vjp itself
    return pb(g)


_soft.defvjp(lambda x: (jnp.tanh(x), x), _soft_bwd)
loss_case("custom_vjp_bwd_calls_vjp", lambda p, v: jnp.mean((_soft(v["x"] @ p["params"]["w"]) - v["y"]) ** 2))


@jax.custom_jvp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


_softplus.defjvp(lambda pr, tg: (_softplus(pr[0]), tg[0] * 1.5 * jax.nn.sigmoid(pr[0])))
loss_case("custom_jvp_softplus", lambda p, v: jnp.mean((_softplus(v["x"] @ p["params"]["w"]) - v["y"]) ** 2))


@jax.custom_jvp
def _safe_norm(x):
    return jnp.sqrt(jnp.sum(x ** 2, -1))


@_safe_norm.defjvp
def _safe_norm_jvp(pr, tg):
    (x,), (t,) = pr, tg
    n = _safe_norm(x)
    return n, jnp.sum(x * t, -1) / jnp.maximum(n, 1e-6)


loss_case("custom_jvp_safe_norm", lambda p, v: jnp.mean(_safe_norm(v["x"] @ p["params"]["w"] - v["y"])))


@jax.custom_gradient
def _cg_square(x):
    return x ** 2, lambda g: (g * 3.0 * x,)


loss_case("jax_custom_gradient", lambda p, v: jnp.mean(_cg_square(_mlp(p["params"], v["x"]) - v["y"])))


def _optax_sg(p, v):
    import optax
    return jnp.mean(jnp.tanh(optax.scale_gradient(v["x"] @ p["params"]["w"], 0.5)) ** 2)


loss_case("optax_scale_gradient", _optax_sg, source="issue 10 reproducer (optax.scale_gradient)")
loss_case("stop_gradient_partial", lambda p, v: jnp.mean(
    (jnp.tanh(v["x"] @ p["params"]["w"]) * lax.stop_gradient(p["params"]["b"]) +
     p["params"]["b"] ** 2 - v["y"]) ** 2))
loss_case("checkpoint_default", lambda p, v: _mse(p["params"], v) +
          jnp.mean(jax.checkpoint(lambda q, x: jnp.sin(x @ q["w"]) ** 2)(p["params"], v["x"])))
loss_case("checkpoint_dots_saveable", lambda p, v: jnp.mean(jax.checkpoint(
    lambda q, x: jnp.tanh(jnp.tanh(x @ q["w"]) @ q["w"].T @ q["w"]),
    policy=jax.checkpoint_policies.dots_saveable)(p["params"], v["x"]) ** 2))
loss_case("checkpoint_nothing_saveable", lambda p, v: jnp.mean(jax.checkpoint(
    lambda q, x: (jnp.tanh(x @ q["w"] + q["b"]) - 0.5) ** 2,
    policy=jax.checkpoint_policies.nothing_saveable)(p["params"], v["x"])))
loss_case("checkpoint_around_custom_vjp", lambda p, v: jnp.mean(jax.checkpoint(
    lambda q, x: jnp.tanh(_times3(x @ q["w"])) ** 2)(p["params"], v["x"])))
loss_case("custom_vjp_around_checkpoint", lambda p, v: jnp.mean(_times3(jax.checkpoint(
    lambda q, x: jnp.tanh(x @ q["w"]))(p["params"], v["x"])) ** 2))


# == C. control flow =======================================================================
def _layers_params(rng):
    return {"params": {"ws": (rng.normal(size=(3, D_IN, D_IN)) * 0.5).astype(np.float32),
                       "w": (rng.normal(size=(D_IN, D_OUT)) * 0.5).astype(np.float32)}}


def _scan_layers(p, v):
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), v["x"], p["params"]["ws"])
    return jnp.mean((h @ p["params"]["w"] - v["y"]) ** 2)


loss_case("scan_over_layers", _scan_layers, params=_layers_params)
loss_case("checkpointed_scan_over_layers", lambda p, v: jnp.mean((lax.scan(
    jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None)), v["x"], p["params"]["ws"])[0]
    @ p["params"]["w"] - v["y"]) ** 2), params=_layers_params)


def _fori(p, v):
    h = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ p["params"]["w"] @ p["params"]["w"].T)
                      + 0.1 * i, v["x"])
    return jnp.mean((h @ p["params"]["w"] - v["y"]) ** 2)


loss_case("fori_loop_fixed_trip", _fori)


def _seq_batch(rng, b):
    return {"x": rng.normal(size=(b, 5, D_IN)).astype(np.float32),
            "y": rng.normal(size=(b, D_OUT)).astype(np.float32)}


def _rnn(p, v):
    def cell(h, x_t):
        h = jnp.tanh(x_t @ p["params"]["w"] + h @ p["params"]["u"])
        return h, None
    h0 = jnp.zeros((v["x"].shape[0], D_OUT), jnp.float32)
    h, _ = lax.scan(cell, h0, jnp.swapaxes(v["x"], 0, 1))
    return jnp.mean((h - v["y"]) ** 2)


def _rnn_params(rng):
    return {"params": {"w": (rng.normal(size=(D_IN, D_OUT)) * 0.5).astype(np.float32),
                       "u": (rng.normal(size=(D_OUT, D_OUT)) * 0.3).astype(np.float32)}}


loss_case("rnn_scan_over_time", _rnn, params=_rnn_params, batch=_seq_batch, dynamic=False,
          tags=("scan carry holds the batch",))


def _newton_sqrt(a):
    def body(s):
        i, y = s
        return i + 1, 0.5 * (y + a / y)
    return lax.while_loop(lambda s: s[0] < 6, body, (0, jnp.ones_like(a)))[1]


loss_case("while_loop_mirrored_trip_forward", lambda p, v: _mse(p["params"], v) *
          _newton_sqrt(lax.stop_gradient(jnp.sum(p["params"]["b"] ** 2) + 1.0)))


def _per_replica_trip(p, v):
    t = jnp.abs(v["x"][0, 0])  # differs between replicas

    def body(s):
        i, y = s
        return i + 1, y * 0.9
    _, y = lax.while_loop(lambda s: s[1] > t, body, (0, jnp.float32(4.0)))
    return _mse(p["params"], v) * y


loss_case("while_loop_per_replica_trip_forward", _per_replica_trip)
loss_case("cond_mirrored_predicate", lambda p, v: lax.cond(
    jnp.sum(p["params"]["b"]) > 0, lambda q: _mse(q, v), lambda q: 2.0 * _mse(q, v) + 1.0,
    p["params"]))


def _stochastic_depth(p, v):
    keep = v["x"][0, 1] > 0  # per replica (data), as bernoulli(fold_in(key, replica_id))
    h = lax.cond(keep, lambda h: h + jnp.tanh(h @ p["params"]["u"]), lambda h: h,
                 v["x"] @ p["params"]["w"])
    return jnp.mean((h - v["y"]) ** 2)


loss_case("cond_per_replica_stochastic_depth", _stochastic_depth, params=_rnn_params,
          source="stochastic depth (Huang et al. 2016), issue 10 item 2")


def _sd_replica_id(p, v):
    keep = jax.random.bernoulli(jax.random.fold_in(jax.random.key(7), rt.replica_id()), 0.5)
    h = lax.cond(keep, lambda h: h + jnp.tanh(h @ p["params"]["u"]), lambda h: h,
                 v["x"] @ p["params"]["w"])
    return jnp.mean((h - v["y"]) ** 2)


def _sd_replica_id_ref(p, vs):
    out = []
    for r, v in enumerate(vs):
        keep = jax.random.bernoulli(jax.random.fold_in(jax.random.key(7), r), 0.5)
        h = lax.cond(keep, lambda h: h + jnp.tanh(h @ p["params"]["u"]), lambda h: h,
                     v["x"] @ p["params"]["w"])
        out.append(jnp.mean((h - v["y"]) ** 2))
    return out


loss_case("cond_replica_id_bernoulli", _sd_replica_id, global_losses=_sd_replica_id_ref,
          params=_rnn_params, source="issue 10 item 2 (stochastic depth with fold_in)")


def _cond_both(p, v):
    q = p["params"]
    return lax.cond(v["x"][0, 0] > 0, lambda x: jnp.mean((jnp.tanh(x @ q["w"]) - v["y"]) ** 2),
                    lambda x: jnp.mean((x @ q["w"] @ q["u"] - v["y"]) ** 2), v["x"])


loss_case("cond_per_replica_both_branches_use_params", _cond_both, params=_rnn_params)


def _switch(idx_fn):
    def loss(p, v):
        q = p["params"]
        branches = [lambda x: jnp.mean((jnp.tanh(x @ q["w"]) - v["y"]) ** 2),
                    lambda x: jnp.mean((x @ q["w"] @ q["u"] - v["y"]) ** 2),
                    lambda x: jnp.mean(jnp.sin(x @ q["w"]) ** 2)]
        return lax.switch(idx_fn(p, v), branches, v["x"])
    return loss


loss_case("switch_mirrored_index", _switch(lambda p, v: (jnp.sum(p["params"]["w"]) > 0).astype(jnp.int32) + 1),
          params=_rnn_params)
loss_case("switch_per_replica_index", _switch(lambda p, v: jnp.clip(
    jnp.floor(v["x"][0, 2] + 1.5), 0, 2).astype(jnp.int32)), params=_rnn_params)


def _nested_cond(p, v):
    q = p["params"]
    inner = lambda h: lax.cond(v["x"][0, 3] > 0, lambda h: jnp.tanh(h @ q["u"]), lambda h: h * 0.5, h)
    h = lax.cond(v["x"][0, 0] > 0, inner, lambda h: h, v["x"] @ q["w"])
    return jnp.mean((h - v["y"]) ** 2)


loss_case("nested_cond_per_replica", _nested_cond, params=_rnn_params)


def _sd_in_scan(p, v):
    keeps = v["x"][0, :3] > 0  # a per-replica keep flag per layer

    def layer(h, wk):
        w, k = wk
        return lax.cond(k, lambda h: h + jnp.tanh(h @ w), lambda h: h, h), None
    h, _ = lax.scan(layer, v["x"], (p["params"]["ws"], keeps))
    return jnp.mean((h @ p["params"]["w"] - v["y"]) ** 2)


loss_case("cond_per_replica_inside_scan", _sd_in_scan, params=_layers_params)


# == D. collectives and identical values =====================================================
def _all_reduce_sum(p, v):
    s = rt.all_reduce(jnp.sum(_mlp(p["params"], v["x"]), 0), "sum")
    return jnp.mean((_mlp(p["params"], v["x"]) - v["y"]) ** 2) + 0.01 * jnp.sum(s ** 2)


def _all_reduce_sum_ref(p, vs):
    s = sum(jnp.sum(_mlp(p["params"], v["x"]), 0) for v in vs)
    return [jnp.mean((_mlp(p["params"], v["x"]) - v["y"]) ** 2) + 0.01 * jnp.sum(s ** 2) for v in vs]


loss_case("all_reduce_sum_in_loss", _all_reduce_sum, global_losses=_all_reduce_sum_ref)
loss_case("all_reduced_loss_pmean", lambda p, v: rt.all_reduce(_mse(p["params"], v), "mean"),
          global_losses=lambda p, vs: [sum(_mse(p["params"], v) for v in vs) / len(vs)] * len(vs),
          tags=("identical loss",))
loss_case("all_reduced_loss_psum", lambda p, v: rt.all_reduce(_mse(p["params"], v), "sum"),
          global_losses=lambda p, vs: [sum(_mse(p["params"], v) for v in vs)] * len(vs),
          tags=("identical loss",))


def _norm_by(op):
    def loss(p, v):
        h = _mlp(p["params"], v["x"])
        m = rt.all_reduce(jnp.max(h, 0) if op == "max" else jnp.min(h, 0), op)
        return jnp.mean((h - m - v["y"]) ** 2)

    def ref(p, vs):
        hs = [_mlp(p["params"], v["x"]) for v in vs]
        red = jnp.max if op == "max" else jnp.min
        m = red(jnp.stack([red(h, 0) for h in hs]), 0)
        return [jnp.mean((h - m - v["y"]) ** 2) for h, v in zip(hs, vs)]
    return loss, ref


loss_case("all_reduce_max_normalizer", *_norm_by("max")[:1], global_losses=_norm_by("max")[1])
loss_case("all_reduce_min_normalizer", *_norm_by("min")[:1], global_losses=_norm_by("min")[1])


def _sync_bn(p, v):
    h = v["x"] @ p["params"]["w"]
    m = rt.all_reduce(jnp.mean(h, 0), "mean")
    var = rt.all_reduce(jnp.mean((h - m) ** 2, 0), "mean")
    h = (h - m) / jnp.sqrt(var + 1e-5) * (1.0 + p["params"]["b"])
    return jnp.mean((h - v["y"]) ** 2)


def _sync_bn_ref(p, vs):
    hs = [v["x"] @ p["params"]["w"] for v in vs]
    m = sum(jnp.mean(h, 0) for h in hs) / len(hs)
    var = sum(jnp.mean((h - m) ** 2, 0) for h in hs) / len(hs)
    return [jnp.mean(((h - m) / jnp.sqrt(var + 1e-5) * (1.0 + p["params"]["b"]) - v["y"]) ** 2)
            for h, v in zip(hs, vs)]


loss_case("sync_batch_norm", _sync_bn, global_losses=_sync_bn_ref,
          source="flax BatchNorm(axis_name=...) / TF SyncBatchNormalization")


def _gather_contrastive(p, v):
    z = _mlp(p["params"], v["x"])
    zs = rt.all_gather(z, axis=0)  # every replica's rows
    return jnp.mean(jax.nn.logsumexp(z @ zs.T, axis=1)) - jnp.mean(z * v["y"])


def _gather_contrastive_ref(p, vs):
    zs = [_mlp(p["params"], v["x"]) for v in vs]
    allz = jnp.concatenate(zs, 0)
    return [jnp.mean(jax.nn.logsumexp(z @ allz.T, axis=1)) - jnp.mean(z * v["y"]) for z, v in zip(zs, vs)]


loss_case("all_gather_contrastive", _gather_contrastive, global_losses=_gather_contrastive_ref,
          dynamic=False, source="SimCLR-style loss over the global batch")


def _a2a(p, v):
    n = rt.num_replicas()
    h = _mlp(p["params"], v["x"])                        # [b, 6]
    h = jnp.tile(h, (1, n))                              # [b, 6n]: split axis 1 into n parts
    t = rt.all_to_all(h, split_axis=1, concat_axis=0)    # [n*b, 6]: part r of every replica
    return jnp.mean((t * jnp.arange(1.0, t.shape[0] + 1.0)[:, None]) ** 2)


def _a2a_ref(p, vs):
    hs = [_mlp(p["params"], v["x"]) for v in vs]
    t = jnp.concatenate(hs, 0)  # replica r receives part r of every replica: all are h_s
    return [jnp.mean((t * jnp.arange(1.0, t.shape[0] + 1.0)[:, None]) ** 2)] * len(vs)


loss_case("all_to_all_exchange", _a2a, global_losses=_a2a_ref, dynamic=False)
loss_case("replica_id_weighting", lambda p, v: _mse(p["params"], v) * (1.0 + rt.replica_id()),
          global_losses=lambda p, vs: [_mse(p["params"], v) * (1.0 + r) for r, v in enumerate(vs)])
loss_case("identical_regularizer_only", lambda p, v: jnp.sum(p["params"]["w"] ** 2) + jnp.sum(
    jnp.sin(p["params"]["b"])), tags=("identical loss",))
loss_case("per_replica_plus_identical_regularizer", lambda p, v: _mse(p["params"], v) +
          0.1 * jnp.sum(p["params"]["w"] ** 2))
loss_case("constant_count_times_loss", lambda p, v: _mse(p["params"], v) * v["x"].shape[0],
          tags=("sizes",))


# == E. gradient transforms written out by hand ===============================================
def _has_aux_step(p, v, ann):
    def f(q):
        pred = _mlp(ann(q), v["x"])
        return jnp.mean((pred - v["y"]) ** 2), {"pred_mean": jnp.mean(pred), "n": v["x"].shape[0]}
    (l, aux), g = jax.value_and_grad(f, has_aux=True)(p["params"])
    return l, aux, g


def _has_aux_ref(p, vs, c):
    ls, g = global_grad(lambda q: [_mse(q, v) for v in vs], p["params"], c)
    return [(l, {"pred_mean": jnp.mean(_mlp(p["params"], v["x"])), "n": v["x"].shape[0]}, g)
            for l, v in zip(ls, vs)]


custom_case("value_and_grad_has_aux", _has_aux_step, _has_aux_ref)


def _mixed_argnums_step(p, v, ann):
    return jax.grad(lambda q, x: jnp.mean((_mlp(ann(q), x) - v["y"]) ** 2), argnums=(0, 1))(
        p["params"], v["x"])


def _mixed_argnums_ref(p, vs, c):
    _, g = global_grad(lambda q: [_mse(q, v) for v in vs], p["params"], c)
    return [(g, jax.grad(lambda x: jnp.mean((_mlp(p["params"], x) - v["y"]) ** 2))(v["x"]))
            for v in vs]


custom_case("grad_argnums_mirrored_and_per_replica", _mixed_argnums_step, _mixed_argnums_ref)
custom_case("grad_wrt_per_replica_input_only",
            lambda p, v, ann: jax.grad(lambda x: jnp.mean((_mlp(ann(p["params"]), x) - v["y"]) ** 2))(v["x"]),
            lambda p, vs, c: [jax.grad(lambda x: jnp.mean((_mlp(p["params"], x) - v["y"]) ** 2))(v["x"])
                              for v in vs])


def _vjp_seed_step(p, v, ann):
    y, pb = jax.vjp(lambda q: _mlp(ann(q), v["x"]), p["params"])
    return pb(v["y"])[0], y


def _vjp_seed_ref(p, vs, c):
    _, g = global_grad(lambda q: [jnp.sum(_mlp(q, v["x"]) * v["y"]) for v in vs], p["params"], c)
    return [(g, _mlp(p["params"], v["x"])) for v in vs]


custom_case("vjp_with_per_replica_seed", _vjp_seed_step, _vjp_seed_ref)


def _vec(q, v):
    return jnp.mean(jnp.tanh(v["x"] @ q["w"]), 0) * q["b"]  # [6]


def _jacrev_ref(p, vs, c):
    js = [jax.jacrev(lambda q: _vec(q, v))(p["params"]) for v in vs]
    return [_scale(c, jax.tree.map(lambda *a: sum(a), *js))] * len(vs)


custom_case("jacrev_vector_loss", lambda p, v, ann: jax.jacrev(lambda q: _vec(ann(q), v))(p["params"]),
            _jacrev_ref, tags=("jacrev",))
custom_case("jacfwd_is_per_replica",
            lambda p, v, ann: jax.jacfwd(lambda q: _vec(ann(q), v))(p["params"]),
            lambda p, vs, c: [jax.jacfwd(lambda q: _vec(q, v))(p["params"]) for v in vs],
            tags=("forward mode",))


def _small_params(rng):
    return {"params": (rng.normal(size=(D_IN,)) * 0.5).astype(np.float32)}


def _sloss(w, v):
    return jnp.mean(jnp.tanh(v["x"] @ w) ** 2 * (1.0 + v["y"][:, 0] ** 2))


def _hessian_ref(p, vs, c):
    h = sum(jax.hessian(lambda w: _sloss(w, v))(p["params"]) for v in vs)
    return [c * h] * len(vs)


custom_case("hessian", lambda p, v, ann: jax.hessian(lambda w: _sloss(w, v))(p["params"]),
            _hessian_ref, params=_small_params, tags=("second order",))


def _hvp_step(p, v, ann):
    w = p["params"]
    return jax.jvp(jax.grad(lambda w: _sloss(w, v)), (w,), (jnp.ones_like(w),))[1]


def _hvp_ref(p, vs, c):
    w = p["params"]
    hv = sum(jax.jvp(jax.grad(lambda w: _sloss(w, v)), (w,), (jnp.ones_like(w),))[1] for v in vs)
    return [c * hv] * len(vs)


custom_case("hessian_vector_product", _hvp_step, _hvp_ref, params=_small_params,
            tags=("second order",))


def _jvp_step(p, v, ann):
    q = ann(p["params"])
    return jax.jvp(lambda q: _mse(q, v), (q,), (jax.tree.map(jnp.ones_like, q),))


custom_case("jvp_is_per_replica", _jvp_step, lambda p, vs, c: [jax.jvp(
    lambda q: _mse(q, v), (p["params"],), (jax.tree.map(jnp.ones_like, p["params"]),)) for v in vs],
    tags=("forward mode",))


def _linearize_step(p, v, ann):
    y, f_jvp = jax.linearize(lambda q: _mse(q, v), ann(p["params"]))
    return y, f_jvp(jax.tree.map(lambda a: 0.5 * jnp.ones_like(a), p["params"]))


custom_case("linearize_is_per_replica", _linearize_step, lambda p, vs, c: [
    jax.jvp(lambda q: _mse(q, v), (p["params"],),
            (jax.tree.map(lambda a: 0.5 * jnp.ones_like(a), p["params"]),)) for v in vs],
    tags=("forward mode",))


def _gradnorm_step(p, v, ann):
    def penalty(q):
        g = jax.grad(lambda q: _mse(ann(q), v))(q)  # mirrored: c · Σ_r ∇L_r
        return sum(jnp.sum(a ** 2) for a in jax.tree.leaves(g))  # identical on every replica
    return jax.value_and_grad(penalty)(p["params"])


def _gradnorm_ref(p, vs, c):
    def g_of(q):
        return global_grad(lambda q: [_mse(q, v) for v in vs], q, c)[1]
    pen = lambda q: sum(jnp.sum(a ** 2) for a in jax.tree.leaves(g_of(q)))
    ls, g = global_grad(lambda q: [pen(q)] * len(vs), p["params"], c)  # counts once per replica
    return [(l, g) for l in ls]


custom_case("grad_of_gradient_norm", _gradnorm_step, _gradnorm_ref, tags=("second order",),
            rtol=5e-5, atol=1e-5)


def _maml_mirrored_step(p, v, ann):
    def outer(q):
        inner = jax.tree.map(lambda a, g: a - 0.1 * g, q, jax.grad(lambda q: _mse(ann(q), v))(q))
        return _mse(inner, v)
    return jax.value_and_grad(outer)(p["params"])


def _maml_mirrored_ref(p, vs, c):
    def inner(q):
        g = global_grad(lambda q: [_mse(q, v) for v in vs], q, c)[1]
        return jax.tree.map(lambda a, g: a - 0.1 * g, q, g)
    ls, g = global_grad(lambda q: [_mse(inner(q), v) for v in vs], p["params"], c)
    return [(l, g) for l in ls]


custom_case("maml_inner_gradient_mirrored", _maml_mirrored_step, _maml_mirrored_ref,
            tags=("second order",), rtol=5e-5, atol=1e-5)


def _maml_local_step(p, v, ann):
    def outer(q):
        ql = rt.local(q)
        inner = jax.tree.map(lambda a, g: a - 0.1 * g, ql, jax.grad(lambda q: _mse(ann(q), v))(ql))
        return _mse(inner, v)
    return jax.value_and_grad(outer)(p["params"])


def _maml_local_ref(p, vs, c):
    def inner(q, v):
        return jax.tree.map(lambda a, g: a - 0.1 * g, q, jax.grad(lambda q: _mse(q, v))(q))
    ls, g = global_grad(lambda q: [_mse(inner(q, v), v) for v in vs], p["params"], c)
    return [(l, g) for l in ls]


custom_case("maml_inner_gradient_local", _maml_local_step, _maml_local_ref,
            tags=("second order", "rt.local"), rtol=5e-5, atol=1e-5,
            source="MAML (Finn et al. 2017), one task per replica")


def _pe_loss(q, x, y):
    return jnp.sum((_mlp(q, x[None])[0] - y) ** 2)


def _per_example_mirrored_step(p, v, ann):
    return jax.vmap(jax.grad(_pe_loss), (None, 0, 0))(ann(p["params"]), v["x"], v["y"])


def _per_example_mirrored_ref(p, vs, c):
    pes = [jax.vmap(jax.grad(_pe_loss), (None, 0, 0))(p["params"], v["x"], v["y"]) for v in vs]
    g = jax.tree.map(lambda *a: c * sum(a), *pes)
    return [g] * len(vs)


custom_case("vmap_grad_mirrored_sums_over_replicas", _per_example_mirrored_step,
            _per_example_mirrored_ref, dynamic=False, tags=("vmap(grad)",))
custom_case("vmap_grad_local_per_example",
            lambda p, v, ann: jax.vmap(jax.grad(_pe_loss), (None, 0, 0))(rt.local(ann(p["params"])), v["x"], v["y"]),
            lambda p, vs, c: [jax.vmap(jax.grad(_pe_loss), (None, 0, 0))(p["params"], v["x"], v["y"]) for v in vs],
            tags=("vmap(grad)", "rt.local"))


def _clip(g, bound=0.5):
    norm = jnp.sqrt(sum(jnp.sum(a ** 2) for a in jax.tree.leaves(g)))
    return jax.tree.map(lambda a: a * jnp.minimum(1.0, bound / (norm + 1e-6)), g)


def _dpsgd_step(p, v, ann):
    """DP-SGD (README recipe): per-example gradients of a local view, clipped, summed,
    all-reduced and divided by the global batch size; noise left out to compare exactly."""
    pe = jax.vmap(jax.grad(_pe_loss), (None, 0, 0))(rt.local(ann(p["params"])), v["x"], v["y"])
    total = jax.tree.map(lambda a: jnp.sum(a, 0), jax.vmap(_clip)(pe))
    count = rt.all_reduce(jnp.float32(v["x"].shape[0]), "sum")
    g = jax.tree.map(lambda a: rt.all_reduce(a, "sum") / count, total)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p["params"], g)


def _dpsgd_ref(p, vs, c):
    x = jnp.concatenate([v["x"] for v in vs])  # single-device DP-SGD on the global batch
    y = jnp.concatenate([v["y"] for v in vs])
    pe = jax.vmap(jax.grad(_pe_loss), (None, 0, 0))(p["params"], x, y)
    g = jax.tree.map(lambda a: jnp.mean(a, 0), jax.vmap(_clip)(pe))
    return [jax.tree.map(lambda a, b: a - 0.1 * b, p["params"], g)] * len(vs)


custom_case("dp_sgd_clipped_per_example", _dpsgd_step, _dpsgd_ref, tags=("rt.local",),
            source="DP-SGD (Abadi et al. 2016); README recipe")


def _local_mean_step(p, v, ann):
    g = jax.grad(lambda q: _mse(ann(q), v))(rt.local(p["params"]))
    return rt.all_reduce(g, "mean"), g


custom_case("local_gradient_then_all_reduce_mean", _local_mean_step, lambda p, vs, c: [
    (jax.tree.map(lambda *a: sum(a) / len(vs), *[jax.grad(_mse)(p["params"], u) for u in vs]),
     jax.grad(_mse)(p["params"], v)) for v in vs], tags=("rt.local",))


def _user_pmean_grads_step(p, v, ann):
    g = jax.grad(lambda q: _mse(ann(q), v))(p["params"])
    return rt.all_reduce(g, "mean")  # already identical: a mean changes nothing


custom_case("user_pmean_of_reduced_gradients", _user_pmean_grads_step, lambda p, vs, c: [
    global_grad(lambda q: [_mse(q, v) for v in vs], p["params"], c)[1]] * len(vs))


# == F. libraries =============================================================================
def _flax_dropout_params(rng):
    model = _FlaxMLP()
    params = model.init(jax.random.PRNGKey(int(rng.integers(100))), jnp.zeros((1, D_IN)), train=False)
    return {"params": params, "key": np.asarray(jax.random.key_data(jax.random.PRNGKey(3)))}


@functools.cache
def _flax_mlp_cls():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Dense(8)(x)
            x = nn.LayerNorm()(x)
            x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
            return nn.Dense(D_OUT)(x)
    return MLP


def _FlaxMLP():
    return _flax_mlp_cls()()


def _flax_loss(q, v, key):
    out = _FlaxMLP().apply(q, v["x"], train=True, rngs={"dropout": key})
    return jnp.mean((out - v["y"]) ** 2)


def _flax_step(p, v, ann):
    key = jax.random.fold_in(jax.random.wrap_key_data(p["key"]), rt.replica_id())
    return jax.value_and_grad(lambda q: _flax_loss(ann(q), v, key))(p["params"])


def _flax_ref(p, vs, c):
    keys = [jax.random.fold_in(jax.random.wrap_key_data(p["key"]), r) for r in range(len(vs))]
    ls, g = global_grad(lambda q: [_flax_loss(q, v, k) for v, k in zip(vs, keys)], p["params"], c)
    return [(l, g) for l in ls]


custom_case("flax_linen_mlp_dropout_layernorm", _flax_step, _flax_ref, params=_flax_dropout_params,
            dynamic=False, source="flax linen Dense/LayerNorm/Dropout, per-replica dropout keys")


def _optax_step(tx_fn):
    def step(p, v, ann):
        tx = tx_fn()
        g = jax.grad(lambda q: _mse(ann(q), v))(p["params"])
        upd, opt = tx.update(g, tx.init(p["params"]), p["params"])
        import optax
        return optax.apply_updates(p["params"], upd), opt

    def ref(p, vs, c):
        tx = tx_fn()
        g = global_grad(lambda q: [_mse(q, v) for v in vs], p["params"], c)[1]
        upd, opt = tx.update(g, tx.init(p["params"]), p["params"])
        import optax
        return [(optax.apply_updates(p["params"], upd), opt)] * len(vs)
    return step, ref


def _adamw():
    import optax
    return optax.adamw(1e-2, weight_decay=1e-3)


def _clipped_sgd():
    import optax
    return optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5, momentum=0.9))


custom_case("optax_adamw_update", *_optax_step(_adamw), source="optax adamw")
custom_case("optax_clip_by_global_norm_sgd", *_optax_step(_clipped_sgd),
            source="optax chain(clip_by_global_norm, sgd)")


# == G. raw JAX collectives over the step's axis ("replica", ir.jaxpr_import.REPLICA_AXIS) =====
def _ring(p, v):
    n = rt.num_replicas()
    h = _mlp(p["params"], v["x"])
    g = lax.ppermute(jnp.mean(h, 0), "replica", [(r, (r + 1) % n) for r in range(n)])
    return jnp.mean((h + g - v["y"]) ** 2)  # reads the previous replica's statistic


def _ring_ref(p, vs):
    hs = [_mlp(p["params"], v["x"]) for v in vs]
    n = len(vs)
    return [jnp.mean((h + jnp.mean(hs[(r - 1) % n], 0) - v["y"]) ** 2)
            for r, (h, v) in enumerate(zip(hs, vs))]


loss_case("ppermute_ring", _ring, global_losses=_ring_ref, dynamic=False,
          source="ring exchange (issue 10 item 6: a permuted mirrored value is per replica)")


def _scatter(p, v):
    n = rt.num_replicas()
    h = jnp.tile(jnp.mean(_mlp(p["params"], v["x"]), 0), n)       # [6n]
    part = lax.psum_scatter(h * (1.0 + rt.replica_id()), "replica", tiled=True)  # [6]: my slice of the sum
    return jnp.sum(part * v["y"][0])


def _scatter_ref(p, vs):
    n = len(vs)
    hs = [jnp.tile(jnp.mean(_mlp(p["params"], v["x"]), 0), n) * (1.0 + r) for r, v in enumerate(vs)]
    total = sum(hs)
    return [jnp.sum(total[r * D_OUT:(r + 1) * D_OUT] * v["y"][0]) for r, v in enumerate(vs)]


loss_case("psum_scatter_reduce_scatter", _scatter, global_losses=_scatter_ref, dynamic=False,
          source="reduce-scatter, the building block of ZeRO/FSDP")


def _permuted_mirrored_step(p, v, ann):
    n = rt.num_replicas()
    w = ann(p["params"])["w"]
    moved = lax.ppermute(w * (1.0 + rt.replica_id()), "replica", [(r, (r + 1) % n) for r in range(n)])
    return moved, lax.psum_scatter(jnp.tile(w[0], n), "replica", tiled=True)


def _permuted_mirrored_ref(p, vs, c):
    n, w = len(vs), p["params"]["w"]
    return [(w * (1.0 + (r - 1) % n), n * w[0]) for r in range(n)]


custom_case("ppermute_and_psum_scatter_of_mirrored_are_per_replica", _permuted_mirrored_step,
            _permuted_mirrored_ref, source="issue 10 item 6")
