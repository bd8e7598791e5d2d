"""``rt.DivergingStateWarning``: a result in the place of a mirrored argument, with its
structure, shapes and dtypes, that comes out varying across replicas (runtime/divergence.py).
Each case checks the warning's values (the result, the leaves, the user's line) or that
nothing warns, and that the numbers are what they are either way."""
from __future__ import annotations

import contextlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import runtime as rt

N = 4


def _x(rows: int = 8, cols: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)


@contextlib.contextmanager
def _no_warning():
    """A ``DivergingStateWarning`` inside is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", rt.DivergingStateWarning)
        yield


def test_state_fed_a_replicas_own_value_warns_naming_the_leaves_and_line():
    """An EMA of the replica's own loss kept in the state: the state comes back per replica
    (each replica's own EMA), with the warning naming ``result[1]['ema']`` and this line."""
    def step(params, state, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
        new = {"ema": 0.9 * state["ema"] + 0.1 * loss, "count": state["count"] + 1}
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), new, loss
    params = {"w": np.ones((3, 2), np.float32)}
    state = {"ema": np.float32(0.0), "count": np.int32(0)}
    x = _x()
    with pytest.warns(rt.DivergingStateWarning) as rec:
        p1, s1, loss = rt.replicate(step, num_replicas=N)(params, state, rt.distribute(x, N))
    assert len(rec) == 1
    msg = str(rec[0].message)
    line = step.__code__.co_firstlineno + 2  # the line that computes ``new``
    assert re.search(rf"step: result 1 has the structure, shapes and dtypes of argument 1, "
                     rf"which came in mirrored .* but 1 of its 2 leaves come out varying across "
                     rf"replicas: result\[1\]\['ema'\] \(made at test_divergence\.py:{line}\)\. "
                     rf"Passed back as argument 1", msg), msg
    assert not isinstance(p1["w"], rt.PerReplica)  # the gradient is all-reduced: mirrored
    assert isinstance(s1["ema"], rt.PerReplica) and not isinstance(s1["count"], rt.PerReplica)
    for r, xr in enumerate(np.split(x, N)):
        own = float(jnp.mean((xr @ params["w"]) ** 2))
        np.testing.assert_allclose(np.asarray(s1["ema"].values[r]), 0.1 * own, rtol=1e-6)


def test_mirrored_state_and_other_shapes_do_not_warn():
    """The same step with the loss averaged first (``rt.all_reduce``): mirrored, silent.
    And varying results that are no state: a per-replica output of another shape in a
    mirrored argument's place, a result past the last argument, a single result, a
    ``PerReplica`` argument, and a step that takes an ``rt.local`` view."""
    x = _x()

    def averaged(state, x):
        loss = rt.all_reduce(jnp.mean(x ** 2), "mean")
        return {"ema": 0.9 * state["ema"] + 0.1 * loss}, loss

    def other_shape(w, x):
        return x @ w, w * 2  # result 0 is per replica but of another shape than w

    def extra(w, x):
        return w * 2, x * 2  # the varying result is in a per-replica argument's place

    def single(w, x):
        return x.sum(0) * w  # one result, not a tuple

    def local(w, x):
        return jax.grad(lambda w: jnp.sum((x @ w) ** 2))(rt.local(w)), x.sum()

    w = np.ones((3, 3), np.float32)
    with _no_warning():
        s, loss = rt.replicate(averaged, num_replicas=N)({"ema": np.float32(0)},
                                                        rt.distribute(x, N))
        assert not isinstance(s["ema"], rt.PerReplica)
        np.testing.assert_allclose(np.asarray(s["ema"]), 0.1 * np.mean(x ** 2), rtol=1e-6)
        rt.replicate(other_shape, num_replicas=N)(w, rt.distribute(x, N))
        rt.replicate(extra, num_replicas=N)(w, rt.distribute(x, N))
        rt.replicate(single, num_replicas=N)(w[0], rt.distribute(x, N))
        per, _ = rt.replicate(local, num_replicas=N)(w, rt.distribute(x, N))
        assert isinstance(per, rt.PerReplica)
        # per-replica state passed in as PerReplica: it was never mirrored
        state = rt.PerReplica([{"ema": np.float32(r)} for r in range(N)])
        step = rt.replicate(lambda s, x: ({"ema": s["ema"] + x.mean()}, x.sum()), num_replicas=N)
        out, _ = step(state, rt.distribute(x, N))
        assert isinstance(out["ema"], rt.PerReplica)


class _Net(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        return nn.BatchNorm(use_running_average=False, axis_name=self.axis_name)(x).sum()


@pytest.mark.parametrize("axis_name", [None, "batch"], ids=["no axis_name", "axis_name"])
def test_flax_batchnorm_statistics_without_axis_name_warn(axis_name):
    """flax's ``BatchNorm`` without ``axis_name`` keeps each replica's own batch statistics
    (under pmap a silent divergence of the running averages); under ``replicate`` they come
    back as ``PerReplica`` with the warning naming them. With ``axis_name`` (pmap code's
    ``'batch'``, replicate's ``axis_name='batch'``) they are averaged: mirrored, silent."""
    net = _Net(axis_name)
    x = _x(cols=5)
    variables = net.init(jax.random.PRNGKey(0), x[:2])

    def train_step(params, batch_stats, x):
        def loss(p):
            out, upd = net.apply({"params": p, "batch_stats": batch_stats}, x,
                                 mutable=["batch_stats"])
            return out, upd["batch_stats"]
        (out, stats), g = jax.value_and_grad(loss, has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, g), stats, out

    step = rt.replicate(train_step, num_replicas=N, axis_name="batch")
    args = (variables["params"], variables["batch_stats"], rt.distribute(x, N))
    if axis_name is None:
        with pytest.warns(rt.DivergingStateWarning,
                          match=r"train_step: result 1 .* 2 of its 2 leaves come out varying "
                                r"across replicas: result\[1\]\['BatchNorm_0'\]\['mean'\] "
                                r"\(made at normalization\.py:\d+\), result\[1\]\['BatchNorm_0'\]"
                                r"\['var'\]"):
            _, stats, _ = step(*args)
        assert isinstance(stats["BatchNorm_0"]["mean"], rt.PerReplica)
        for r, xr in enumerate(np.split(x, N)):  # each replica's own statistics
            h = xr @ np.asarray(variables["params"]["Dense_0"]["kernel"]) + \
                np.asarray(variables["params"]["Dense_0"]["bias"])
            np.testing.assert_allclose(np.asarray(stats["BatchNorm_0"]["mean"].values[r]),
                                       0.01 * h.mean(0), rtol=1e-5, atol=1e-6)  # (momentum 0.99)
    else:
        with _no_warning():
            _, stats, _ = step(*args)
        h = x @ np.asarray(variables["params"]["Dense_0"]["kernel"]) + \
            np.asarray(variables["params"]["Dense_0"]["bias"])
        np.testing.assert_allclose(np.asarray(stats["BatchNorm_0"]["mean"]), 0.01 * h.mean(0),
                                   rtol=1e-5, atol=1e-6)


def test_dynamic_shapes_warn_alike():
    """With ``dynamic_shapes=True`` (ragged per-replica batches) the same check runs on the
    padded program: the replica's own loss fed into the state warns; averaged, silent."""
    def step(state, x):
        loss = jnp.mean(x ** 2)
        return {"ema": 0.9 * state["ema"] + 0.1 * loss}, loss

    def averaged(state, x):
        loss = rt.all_reduce(jnp.mean(x ** 2), "mean")
        return {"ema": 0.9 * state["ema"] + 0.1 * loss}, loss

    xs = [_x(rows=r + 2, seed=r) for r in range(N)]
    opts = rt.RunOptions(dynamic_shapes=True)
    with pytest.warns(rt.DivergingStateWarning, match=r"result\[0\]\['ema'\] \(made at "
                                                      r"test_divergence\.py:\d+\)"):
        s, _ = rt.replicate(step, num_replicas=N, options=opts)({"ema": np.float32(0)},
                                                                 rt.PerReplica(xs))
    for r in range(N):
        np.testing.assert_allclose(np.asarray(s["ema"].values[r]), 0.1 * np.mean(xs[r] ** 2),
                                   rtol=1e-6)
    with _no_warning():
        s, _ = rt.replicate(averaged, num_replicas=N, options=opts)({"ema": np.float32(0)},
                                                                     rt.PerReplica(xs))
    np.testing.assert_allclose(np.asarray(s["ema"]),
                               0.1 * np.mean([np.mean(x ** 2) for x in xs]), rtol=1e-6)


def test_the_warning_points_at_the_users_call():
    """The warning's location is the line that called the step, not ours."""
    step = rt.replicate(lambda s, x: (s + x.mean(), x.sum()), num_replicas=N)
    with pytest.warns(rt.DivergingStateWarning) as rec:
        step(np.float32(0), rt.distribute(_x(), N)); line = _line()  # noqa: E702
    assert rec[0].filename == __file__ and rec[0].lineno == line


def _line() -> int:
    import inspect
    return inspect.currentframe().f_back.f_lineno


def test_several_steps_per_call_warn_for_the_carried_state():
    """With ``steps_per_call=3`` the state is a loop carry: an EMA of the replica's own loss
    makes it varying (and the final state per replica); the weights, all-reduced, stay one."""
    def step(state, x):
        loss = jnp.mean(x ** 2)
        g = jax.grad(lambda w: jnp.mean((x * w) ** 2))(state["w"])
        return {"ema": 0.9 * state["ema"] + 0.1 * loss, "w": state["w"] - 0.1 * g}, loss

    xs = [_x(seed=t) for t in range(3)]
    with pytest.warns(rt.DivergingStateWarning, match=r"1 of its 2 leaves come out varying "
                                                      r"across replicas: result\[0\]\['ema'\]"):
        s, _ = rt.replicate(step, num_replicas=N, steps_per_call=3)(
            {"ema": np.float32(0), "w": np.ones(3, np.float32)}, rt.distribute_steps(xs, N))
    assert isinstance(s["ema"], rt.PerReplica) and not isinstance(s["w"], rt.PerReplica)
    for r in range(N):
        ema = 0.0
        for x in xs:
            ema = 0.9 * ema + 0.1 * np.mean(np.split(x, N)[r] ** 2)
        np.testing.assert_allclose(np.asarray(s["ema"].values[r]), ema, rtol=1e-5)


def test_a_bare_result_in_argument_0s_place_is_checked_too():
    """``params = step(params, batch)`` (the README's input-pipeline loop): one container
    returned, of argument 0's structure, shapes and dtypes, with a leaf fed the replica's
    own value warns, naming ``result['b']`` (no index: the step returns one value); one
    array alone (as likely a loss as a state) and a mirrored container do not."""
    x = _x()

    def step(params, x):
        g = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"]) ** 2))(params)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, g)
        return {"w": new["w"], "b": new["b"] + 0.01 * jnp.mean(x)}  # b: per replica

    params = {"w": np.ones((3, 2), np.float32), "b": np.zeros((2,), np.float32)}
    with pytest.warns(rt.DivergingStateWarning) as rec:
        out = rt.replicate(step, num_replicas=N)(params, rt.distribute(x, N))
    msg = str(rec[0].message)
    line = step.__code__.co_firstlineno + 3
    assert re.search(rf"step: its result has the structure, shapes and dtypes of argument 0, "
                     rf".* 1 of its 2 leaves come out varying across replicas: "
                     rf"result\['b'\] \(made at test_divergence\.py:{line}\)", msg), msg
    assert isinstance(out["b"], rt.PerReplica) and not isinstance(out["w"], rt.PerReplica)
    with _no_warning():
        mirrored = rt.replicate(lambda p, x: jax.tree.map(lambda a: a * 2, p), num_replicas=N)
        mirrored(params, rt.distribute(x, N))
        one_array = rt.replicate(lambda w, x: w * jnp.mean(x), num_replicas=N)
        assert isinstance(one_array(np.ones((2,), np.float32), rt.distribute(x, N)),
                          rt.PerReplica)
