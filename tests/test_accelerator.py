"""Steps on the machine's accelerator (issue 14): the GPU (or TPU) when JAX has one, else
the first CPU device, so these tests run everywhere and exercise the GPU where there is one.

The rest of the suite runs on the 8 virtual CPU devices. On a machine with a GPU, run it
with ``JAX_PLATFORMS=cpu,cuda`` (README, "Versions and platforms"): CPU stays the default
backend, so every other test is unchanged, and these tests place their step on the GPU
with ``replicate(devices=[gpu])``. One GPU holds one replica of one logical device.

Oracle: the same program under plain ``jax.jit`` on the same device, with the same JAX
context. Comparisons run under ``jax.default_matmul_precision("highest")`` where they
compare numbers (on an H100, f32 matrix products default to TF32, whose rounding depends
on how XLA fuses the program); the precision test compares each precision with itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import runtime as rt
from differential import Config, compare, make_inputs, seed_of
from semantics_corpus import CASES


def _devices_or_none(platform: str) -> list:
    try:
        return jax.devices(platform)
    except RuntimeError:  # no such backend, or JAX_PLATFORMS leaves it out
        return []


ACCEL = (_devices_or_none("gpu") + _devices_or_none("tpu") + jax.devices())[0]


def _on_accel(fn, *args):
    """``jax.jit(fn)(*args)`` with the arguments on the accelerator."""
    return jax.jit(fn)(*jax.device_put(args, ACCEL))


def test_the_accelerator_is_the_machines():
    """Where JAX sees a GPU, the tests below run their steps there, while the default
    backend, which every other test uses, stays the 8 virtual CPU devices
    (``JAX_PLATFORMS=cpu,cuda``, not ``cuda,cpu``)."""
    gpus = _devices_or_none("gpu")
    if gpus:
        assert ACCEL == gpus[0]
    assert jax.devices()[0].platform == "cpu" and len(jax.devices()) >= 8


# -- the semantics corpus, one replica on the accelerator ---------------------------------
def _cells(both: bool):
    """Two cells per construct (one replica: a mean of static shapes, a sum with dynamic
    shapes where the construct allows them); one of them, in turn, where the
    "accelerator" is the CPU and not ``--long``: ``test_semantics_corpus`` runs every
    construct on one CPU device already, and the suite keeps to its 10 minutes."""
    for i, (name, case) in enumerate(sorted(CASES.items())):
        if both or i % 2 == 0:
            yield name, Config(1, "mean", False, 1)
        if both or i % 2 == 1:
            yield name, Config(1, "sum", case.dynamic, 1)


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_corpus_on_the_accelerator":
        both = ACCEL.platform != "cpu" or metafunc.config.getoption("--long")
        metafunc.parametrize("name,cfg", list(_cells(both)), ids=lambda v: getattr(v, "id", v))


def test_corpus_on_the_accelerator(name, cfg):
    case = CASES[name]
    p, vs = make_inputs(case, cfg, seed_of(name, cfg.n, "accel"))
    step = rt.replicate(lambda p, v: case.step(p, v, lambda t: t), devices=[ACCEL],
                        loss_reduction=cfg.reduction,
                        options=rt.RunOptions(dynamic_shapes=cfg.dynamic))
    with jax.default_matmul_precision("highest"):
        got = step(p, rt.PerReplica(vs))
        want = _on_accel(case.reference, p, vs, np.float32(1.0))
    for leaf in jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, rt.PerReplica)):
        arrays = leaf.values if isinstance(leaf, rt.PerReplica) else [leaf]
        for a in arrays:
            assert a.devices() == {ACCEL}, (name, a.devices())
    problems = compare(got, want, case, cfg)
    assert not problems, "\n".join(problems)


# -- a public training program: flax's MNIST CNN with optax ------------------------------
def test_flax_mnist_training_on_the_accelerator():
    from flax.training import train_state

    from tests.clients.test_flax_mnist_linen import CNN, IMAGE, apply_model, update_model
    from tests.clients._harness import mnist_batches

    def train_step(state, batch):  # the source's single-device step (apply + update)
        grads, loss, accuracy = apply_model(state, batch["image"], batch["label"])
        return update_model(state, grads), {"loss": loss, "accuracy": accuracy}

    cnn = CNN()
    params = jax.jit(cnn.init)(jax.random.key(0), jnp.ones([1, IMAGE, IMAGE, 1]))["params"]
    state0 = train_state.TrainState.create(apply_fn=cnn.apply, params=params,
                                           tx=optax.sgd(0.1, 0.9))
    ours = rt.replicate(train_step, devices=[ACCEL])
    ref = jax.jit(train_step)
    s_ours = s_ref = jax.device_put(state0, ACCEL)
    with jax.default_matmul_precision("highest"):
        for batch in mnist_batches(16, IMAGE, steps=3):
            batch = jax.device_put(batch, ACCEL)
            s_ours, m_ours = ours(s_ours, batch)
            s_ref, m_ref = ref(s_ref, batch)
            np.testing.assert_allclose(m_ours["loss"], m_ref["loss"], rtol=1e-5)
    for g, w, w0 in zip(jax.tree.leaves(s_ours.params), jax.tree.leaves(s_ref.params),
                        jax.tree.leaves(state0.params)):
        assert g.devices() == {ACCEL}
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
        assert not np.allclose(w, w0)  # it trained


def test_multi_step_loop_on_the_accelerator():
    """``steps_per_call``: the steps' loop runs on the device, as k calls of jit do."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((8, 4)).astype(np.float32)
    xs = rng.standard_normal((3, 16, 8)).astype(np.float32)

    def step(w, x):  # (state, inputs) -> (state, outputs)
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.5 * g, loss

    multi = rt.replicate(step, devices=[ACCEL], steps_per_call=3)
    one = jax.jit(step)
    with jax.default_matmul_precision("highest"):
        got, losses = multi(w0, rt.distribute_steps(list(xs), 1))
        want, want_losses = jax.device_put(w0, ACCEL), []
        for x in xs:
            want, loss = one(want, jax.device_put(x, ACCEL))
            want_losses.append(loss)
    assert got.devices() == {ACCEL}
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rt.reduce("mean", losses), want_losses, rtol=1e-5)
    assert not np.allclose(want, w0)


# -- the JAX context a call runs in is part of the program -------------------------------
def test_matmul_precision_context_is_part_of_the_key():
    """A step called under one ``default_matmul_precision`` and then under another runs
    the program of each, as jit does: on a GPU, TF32 and HIGHEST give f32 products that
    differ in the fourth digit (checked), so the numbers tell which program ran; the
    lowered text says which precision every platform was asked for."""
    import re

    rng = np.random.default_rng(1)
    a, b = (jax.device_put(rng.standard_normal((256, 256)).astype(np.float32), ACCEL)
            for _ in range(2))
    mm = lambda a, b: jnp.tanh(a @ b) @ b
    step = rt.replicate(mm, devices=[ACCEL])
    text_says = {"highest": {"HIGHEST"}, "tensorfloat32": {"HIGH"}, "default": {"DEFAULT"}}
    results = {}
    for precision in ("highest", "tensorfloat32", "highest", "default", "tensorfloat32"):
        with jax.default_matmul_precision(precision):
            got, want = step(a, b), jax.jit(mm)(a, b)
            # the same program may still pick another GEMM algorithm: a few ulps apart
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4, err_msg=precision)
            hlo = step.lower(a, b).as_text()
            said = {w for p in re.findall(r"precision = \[([\w, ]+)\]", hlo)
                    for w in p.split(", ")}
            assert said <= text_says[precision] and (said or precision == "default"), \
                (precision, said)
            results[precision] = np.asarray(want)
    if ACCEL.platform == "gpu":  # the numbers tell the programs apart there
        assert not np.allclose(results["tensorfloat32"], results["highest"], rtol=2e-5,
                               atol=1e-4)
    assert step.cache_info().misses == 3  # one program per precision, then hits


# -- dynamic shapes with device-array inputs ----------------------------------------------
@pytest.mark.parametrize("early_copies", [False, True], ids=["platform", "early-copies"])
def test_device_array_inputs_of_new_sizes(monkeypatch, early_copies):
    """A dynamic step fed arrays already on the device, a new exact size each call inside
    one bucket: they are padded on the host (their copies all started before the first is
    read, where reading waits for the device), and the per-row output is cut back to the
    real size. Equal to ``jax.jit`` on the exact shapes, one compile for the bucket.
    ``early-copies`` takes the copying path on CPU too (it is the GPU's)."""
    import runtime.dynamic as dyn
    if early_copies:
        monkeypatch.setattr(dyn, "_host_read_waits", lambda device: True)
    rng = np.random.default_rng(2)
    w = jax.device_put(rng.standard_normal((8, 8)).astype(np.float32), ACCEL)

    def f(w, x, y):
        h = jnp.tanh(x @ w)  # one row per example: the output keeps the dynamic axis
        return h, jnp.mean((h - y) ** 2)

    step = rt.replicate(f, devices=[ACCEL], options=rt.RunOptions(dynamic_shapes=True))
    with jax.default_matmul_precision("highest"):
        for size in (16, 11, 13, 9, 16, 12):  # all in the bucket of 16
            x, y = (jax.device_put(rng.standard_normal((size, 8)).astype(np.float32), ACCEL)
                    for _ in range(2))
            h, loss = step(w, rt.PerReplica([x]), rt.PerReplica([y]))
            want_h, want_loss = jax.jit(f)(w, x, y)
            (got_h,), (got_loss,) = h.values, loss.values
            assert got_h.shape == (size, 8) and got_h.devices() == {ACCEL}
            np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert step.cache_info().misses == 1
