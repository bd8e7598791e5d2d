"""The executable cache: hits, misses (= compiles), currsize, keys, threads, no retrace."""
from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt
from runtime.cache import ExecutableCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _counting(fn):
    """``fn`` wrapped to count its Python-level calls (each trace calls it once)."""
    calls = {"n": 0}

    def wrapped(*args):
        calls["n"] += 1
        return fn(*args)
    wrapped.__name__ = fn.__name__
    return wrapped, calls


def _axpy(a, b):
    return a * 2 + b


def test_repeated_calls_hit_and_do_not_retrace():
    fn, calls = _counting(_axpy)
    step = rt.replicate(fn, num_replicas=2)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for i in range(5):
        out = step(x, 1.5 + i)  # another Python float value: same key
        np.testing.assert_allclose(out, x * 2 + 1.5 + i)
    assert step.cache_info() == rt.CacheInfo(hits=4, misses=1, currsize=1)
    assert calls["n"] == 1
    # jax arrays and numpy arrays of the same shape/dtype share the key
    step(jnp.asarray(x), 1.0)
    assert step.cache_info().misses == 1 and calls["n"] == 1


def test_per_replica_args_hit():
    fn, calls = _counting(_axpy)
    step = rt.replicate(fn, num_replicas=2)
    x = np.ones((4, 3), np.float32)
    for _ in range(3):
        out = step(rt.distribute(x, 2), 1.0)
        assert isinstance(out, rt.PerReplica)
    # a PerReplica built by hand with the same shapes is the same key
    step(rt.PerReplica([x[:2], x[2:]]), 1.0)
    assert step.cache_info() == rt.CacheInfo(hits=3, misses=1, currsize=1)
    assert calls["n"] == 1


@pytest.mark.parametrize("n", [1, 4])
def test_per_replica_device_arrays_take_the_fast_path(monkeypatch, n):
    """``PerReplica`` of one device array per replica on its replica's device (a loader's
    per-device batches) skips the key and the checks of the slow path (at 1 replica the
    slow path cost twice jax.jit's call on CPU); arrays on other devices or of another
    shape take the slow path, which moves them or builds their program. Every call
    computes each replica's jax.jit result."""
    step = rt.replicate(lambda w, x: (jnp.tanh(x @ w), jnp.sum(x) * w), num_replicas=n)
    keys = _count_keys(monkeypatch, step)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 3)).astype(np.float32)
    devs = jax.devices()[:n]
    xs = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(n)]

    def check(arg, xs):
        h, s = step(w, rt.PerReplica(arg))
        for r in range(n):
            np.testing.assert_allclose(np.asarray(h.values[r]), np.tanh(xs[r] @ w), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(s.values[0]), np.sum(xs[0]) * w, rtol=1e-5)
    check([jax.device_put(x, d) for x, d in zip(xs, devs)], xs)
    assert len(keys) == 1
    for _ in range(2):
        xs = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(n)]
        check([jax.device_put(x, d) for x, d in zip(xs, devs)], xs)
    assert len(keys) == 1 and step.cache_info()[:2] == (2, 1)
    check([jax.device_put(x, d) for x, d in zip(xs, devs[::-1] if n > 1 else jax.devices()[1:2])],
          xs)  # placed elsewhere: moved by the slow path
    assert len(keys) == 2
    xs = [np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in xs]
    check([jnp.asarray(x) for x in xs], xs)  # uncommitted, on device 0: fast at 1 replica
    assert len(keys) == (2 if n == 1 else 3)
    xs = [x[:1] for x in xs]  # another shape: the slow path, a program of its own
    check([jax.device_put(x, d) for x, d in zip(xs, devs)], xs)
    assert len(keys) == (3 if n == 1 else 4) and step.cache_info().misses == 2


@pytest.mark.parametrize("second", [
    pytest.param(lambda: (np.ones((4, 3), np.float32), 1.0), id="shape"),
    pytest.param(lambda: (np.ones((2, 3), np.int32), 1.0), id="dtype"),
    pytest.param(lambda: (np.ones((2, 3), np.float32), np.float32(1.0)), id="weak-scalar"),
    pytest.param(lambda: (jnp.broadcast_to(jnp.asarray(1.0), (2, 3)), 1.0), id="weak-array"),
    pytest.param(lambda: (rt.distribute(np.ones((2, 3), np.float32), 2), 1.0), id="per-replica"),
    pytest.param(lambda: ((np.ones((2, 3), np.float32),), 1.0), id="structure-tuple"),
    pytest.param(lambda: ({"k": np.ones((2, 3), np.float32)}, 1.0), id="structure-dict"),
])
def test_new_key_misses(second):
    def plain(a, b):
        return jax.tree.map(lambda t: t * 2 + b, a)
    fn, calls = _counting(plain)
    step = rt.replicate(fn, num_replicas=2)
    x = np.ones((2, 3), np.float32)
    step(x, 1.0)
    step(x, 1.0)
    args = second()
    assert step.cache_info() == rt.CacheInfo(hits=1, misses=1, currsize=1)
    out = step(*args)
    assert step.cache_info() == rt.CacheInfo(hits=1, misses=2, currsize=2)
    assert calls["n"] == 2
    # the new program computes what jax.jit computes, in the same dtype
    want = jax.jit(plain)(*((args[0].values[0],) if isinstance(args[0], rt.PerReplica) else args[:1]),
                       *args[1:])
    got = out.values[0] if isinstance(out, rt.PerReplica) else out
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w)
        assert g.dtype == w.dtype
    # and both keys now hit
    step(x, 1.0)
    step(*args)
    assert step.cache_info() == rt.CacheInfo(hits=3, misses=2, currsize=2)
    assert calls["n"] == 2


def test_weak_and_strong_keys_alternate():
    fn, calls = _counting(lambda a: a * 3)
    step = rt.replicate(fn, num_replicas=2)
    strong = jnp.ones((2, 3), jnp.float32)
    weak = jnp.broadcast_to(jnp.asarray(1.0), (2, 3))
    assert weak.weak_type and not strong.weak_type
    for _ in range(2):
        step(strong)
        step(weak)
        step(2.0)
        step(np.float32(2.0))
    assert step.cache_info() == rt.CacheInfo(hits=4, misses=4, currsize=4)
    assert calls["n"] == 4


def test_cache_clear():
    fn, calls = _counting(_axpy)
    step = rt.replicate(fn, num_replicas=2)
    x = np.ones((2, 3), np.float32)
    step(x, 1.0)
    step.cache_clear()
    assert step.cache_info() == rt.CacheInfo(0, 0, 0)
    step(x, 1.0)
    assert step.cache_info() == rt.CacheInfo(hits=0, misses=1, currsize=1)
    assert calls["n"] == 2


def test_each_replicate_object_owns_its_cache():
    a = rt.replicate(_axpy, num_replicas=2)
    b = rt.replicate(_axpy, num_replicas=4)
    x = np.ones((4, 3), np.float32)
    a(x, 1.0)
    b(x, 1.0)
    assert a.cache_info().misses == 1 and b.cache_info().misses == 1


@pytest.mark.parametrize("per_replica", [False, True])
def test_threads_on_a_cold_function_compile_once(per_replica):
    fn, calls = _counting(_axpy)
    step = rt.replicate(fn, num_replicas=2)
    n_threads = 8
    barrier = threading.Barrier(n_threads)
    results: list = [None] * n_threads
    errors: list = []
    xs = [np.full((2, 3), i, np.float32) for i in range(n_threads)]

    def worker(i):
        try:
            barrier.wait()
            arg = rt.distribute(xs[i], 2) if per_replica else xs[i]
            results[i] = step(arg, 0.5)
        except BaseException as e:  # reported below, in the main thread
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    info = step.cache_info()
    assert info.misses == 1 and info.currsize == 1 and calls["n"] == 1
    assert info.hits == n_threads - 1
    for i, out in enumerate(results):
        got = np.concatenate(out.values) if per_replica else out
        np.testing.assert_allclose(got, xs[i] * 2 + 0.5)


def test_single_flight_build_shares_exceptions():
    cache = ExecutableCache()
    started, release = threading.Event(), threading.Event()
    builds = {"n": 0}

    def build():
        builds["n"] += 1
        started.set()
        release.wait(5)
        raise RuntimeError("boom 42")
    errors: list = []

    def worker():
        try:
            cache.get_or_build("k", build)
        except RuntimeError as e:
            errors.append(str(e))
    first = threading.Thread(target=worker)
    first.start()
    started.wait(5)
    others = [threading.Thread(target=worker) for _ in range(3)]
    for t in others:
        t.start()
    # each waiter counts a hit before it waits on the build in flight
    deadline = time.monotonic() + 5
    while cache.info().hits < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    release.set()
    for t in [first, *others]:
        t.join()
    assert builds["n"] == 1 and errors == ["boom 42"] * 4
    # a failed build is not cached: the next call builds again
    assert cache.get_or_build("k", lambda: "ok") == "ok"
    assert cache.info() == rt.CacheInfo(hits=3, misses=2, currsize=1)


def test_a_trace_error_is_not_cached():
    state = {"fail": True}

    def fn(a):
        if state["fail"]:
            raise ValueError("user bug 7")
        return a + 1
    step = rt.replicate(fn, num_replicas=2)
    with pytest.raises(ValueError, match="user bug 7"):
        step(np.ones(2, np.float32))
    state["fail"] = False
    np.testing.assert_allclose(step(np.ones(2, np.float32)), [2.0, 2.0])
    assert step.cache_info().currsize == 1


# -- the fast path for per-replica global batches ------------------------------------------

def _count_keys(monkeypatch, step):
    """Count slow-path key computations (the per-leaf signature the fast path skips)."""
    calls = []
    key_from = step._key_from
    monkeypatch.setattr(step, "_key_from", lambda *a: (calls.append(1), key_from(*a))[1])
    return calls


def _mlp(params, batch):
    h = jnp.tanh(batch["x"] @ params["w"])
    loss = jnp.mean((h - batch["y"]) ** 2)
    return jax.tree.map(lambda p: p * 0.5, params), loss, h


def test_distributed_batches_take_the_fast_path(monkeypatch):
    """A distribute()d batch with the shapes of the cached program skips the key; each
    call computes what jax.jit computes on each replica's rows."""
    step = rt.replicate(_mlp, num_replicas=4)
    keys = _count_keys(monkeypatch, step)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 2)).astype(np.float32)}
    for i in range(4):
        batch = {"x": rng.normal(size=(8, 3)).astype(np.float32),
                 "y": rng.normal(size=(8, 2)).astype(np.float32)}
        new, loss, h = step(params, rt.distribute(batch, 4))
        for r in range(4):
            part = jax.tree.map(lambda a: a[2 * r:2 * r + 2], batch)
            want = jax.jit(_mlp)(params, part)
            np.testing.assert_allclose(float(loss.values[r]), float(want[1]), rtol=1e-6)
            np.testing.assert_allclose(np.asarray(h.values[r]), np.asarray(want[2]), rtol=1e-6)
        np.testing.assert_allclose(new["w"], params["w"] * 0.5)
    assert len(keys) == 1 and step.cache_info()[:3] == (3, 1, 1)
    # a step's own per-replica result fed back (h): fast too once its program exists
    again = rt.replicate(lambda h: h * 2, num_replicas=4)
    again(h)
    keys2 = _count_keys(monkeypatch, again)
    out = again(h)
    assert not keys2 and again.cache_info()[:2] == (1, 1)
    np.testing.assert_allclose(np.asarray(out.values[1]), np.asarray(h.values[1]) * 2)


@pytest.mark.parametrize("second", [
    pytest.param(lambda: rt.distribute(np.ones((8, 3), np.float32), 4), id="more rows"),
    pytest.param(lambda: rt.distribute(np.ones((4, 3), np.int32), 4), id="dtype"),
    pytest.param(lambda: rt.distribute(np.ones((4, 1), np.float32), 4), id="columns"),
    pytest.param(lambda: rt.distribute({"a": np.ones((4, 3), np.float32)}, 4), id="structure"),
    pytest.param(lambda: rt.distribute(jnp.ones((4, 3)) * 1.0, 4), id="jax array"),
    pytest.param(lambda: rt.PerReplica([np.ones((1, 3), np.float32)] * 4), id="hand-made"),
    pytest.param(lambda: np.ones((1, 3), np.float32), id="mirrored"),
])
def test_fast_path_falls_back_when_the_batch_differs(second):
    """Anything the cached program was not built for takes the slow path and gets its own
    program (or the same one, when only the way it was made differs)."""
    def f(x):
        return jax.tree.map(lambda a: a.sum(0) * 2, x)
    step = rt.replicate(f, num_replicas=4)
    step(rt.distribute(np.ones((4, 3), np.float32), 4))
    arg = second()
    out = step(arg)
    is_pr = lambda v: isinstance(v, rt.PerReplica)  # noqa: E731
    for r in range(4):
        got = jax.tree.map(lambda o: o.values[r] if is_pr(o) else o, out, is_leaf=is_pr)
        x = arg.values[r] if is_pr(arg) else arg
        want = jax.jit(f)(x)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert g.dtype == w.dtype
            np.testing.assert_allclose(np.asarray(g), np.asarray(w))


def test_a_per_replica_result_fed_back_where_a_mirrored_scalar_was():
    """A state leaf that came in as a mirrored scalar and went out varying (optax's
    ``reduce_on_plateau`` fed a replica's own loss) comes back as a ``PerReplica``; fed to
    the next call in the same place it gets a program of its own (it crashed the fast
    path's scalar check: ``np.asarray`` of a ``PerReplica``), and anything that is no array
    there is the slow path's ``TypeError``, naming the leaf."""
    def f(s, x):
        return s + x.mean(), x.sum(0) * s
    step = rt.replicate(f, num_replicas=4)
    x = rt.distribute(np.arange(8, dtype=np.float32).reshape(8, 1), 4)
    with pytest.warns(rt.DivergingStateWarning, match=r"f: result 0 has .* 1 of its 1 leaves "
                                                      r"come out varying .*: result\[0\] \(made "
                                                      r"at test_cache\.py:\d+\)"):
        s, _ = step(np.float32(1.0), x)
    assert isinstance(s, rt.PerReplica)
    s2, y = step(s, x)  # the same structure, a PerReplica where the scalar was
    for r in range(4):
        xr = np.arange(8, dtype=np.float32).reshape(4, 2, 1)[r]
        s_r = 1.0 + xr.mean()
        np.testing.assert_allclose(np.asarray(s2.values[r]), s_r + xr.mean(), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(y.values[r]), xr.sum(0) * s_r, rtol=1e-6)
    assert step.cache_info().misses == 2
    with pytest.raises(TypeError, match=r"step argument args\[0\] is the string 'not an array'"):
        step("not an array", x)


def test_per_replica_host_arrays_take_the_fast_path(monkeypatch):
    """``PerReplica([x0, x1, ...])`` of NumPy arrays with the cached program's per-replica
    shape and dtype skips the key (each replica's array is checked against the program's
    signature instead); anything else takes the slow path and its errors."""
    def f(w, x):
        return w * 2, jnp.tanh(x @ w).sum(0)
    step = rt.replicate(f, num_replicas=2)
    rng = np.random.default_rng(3)
    w = rng.normal(size=(3, 3)).astype(np.float32)
    rows = lambda k=4, dt=np.float32: [rng.normal(size=(k, 3)).astype(dt) for _ in range(2)]  # noqa: E731
    step(w, rt.PerReplica(rows()))
    keys = _count_keys(monkeypatch, step)
    for _ in range(3):
        xs = rows()
        _, out = step(w, rt.PerReplica(xs))
        kept = [x.copy() for x in xs]
        for x in xs:  # the caller's arrays are theirs again once the call returns
            x[:] = 1e3
        for r in range(2):
            np.testing.assert_allclose(np.asarray(out.values[r]), jax.jit(f)(w, kept[r])[1],
                                       rtol=1e-6)
    assert not keys and step.cache_info()[:2] == (3, 1)
    with pytest.raises(ValueError, match=r"replica 1's leaf 0 has shape \(5, 3\) and dtype "
                                         r"float32 but replica 0's has shape \(4, 3\)"):
        step(w, rt.PerReplica([rows()[0], rows(5)[1]]))
    # float64 host arrays (x64 off): the slow path's key, the same program, as on a first call
    _, out = step(w, rt.PerReplica(rows(dt=np.float64)))
    assert out.values[0].dtype == jnp.float32 and step.cache_info().misses == 1
    # a device array among them: the slow path, the same program
    xs = rows()
    _, out = step(w, rt.PerReplica([xs[0], jnp.asarray(xs[1])]))
    np.testing.assert_allclose(np.asarray(out.values[1]), jax.jit(f)(w, xs[1])[1], rtol=1e-6)
    assert step.cache_info().misses == 1 and len(keys) == 3


def test_fast_path_tells_scalars_from_one_element_vectors():
    """A global (n,) array holds n scalars or n vectors of one element: the same global
    shape, so the executable cannot tell; the fast path must."""
    step = rt.replicate(lambda s: s + jnp.zeros((2,)), num_replicas=4)
    scal = step(rt.PerReplica([np.float32(r) for r in range(4)]))   # per-replica scalars
    assert scal.values[0].shape == (2,)
    vecs = rt.distribute(np.arange(4, dtype=np.float32), 4)  # per-replica (1,): global (4,)
    assert vecs.values[0].shape == (1,)
    out = step(vecs)
    for r in range(4):
        assert out.values[r].shape == (2,)
        np.testing.assert_allclose(np.asarray(out.values[r]), [r, r])
    assert step.cache_info().misses == 2
    # and the deferred result of a rank-0 output, fed back: scalars again
    back = step(rt.replicate(lambda s: s * 1, num_replicas=4)(
        rt.PerReplica([np.float32(r) for r in range(4)])))
    assert back.values[3].shape == (2,) and step.cache_info().misses == 2


def test_fast_path_keeps_weak_types_apart():
    """A weakly typed batch (from a Python scalar) promotes differently (f32 weak * bf16 is
    bf16; strong, f32) though the executable sees the same f32 array: not the fast path."""
    f = lambda x: x * jnp.ones((), jnp.bfloat16)  # noqa: E731
    step = rt.replicate(f, num_replicas=2)
    strong = step(rt.distribute(jnp.ones((2, 3), jnp.float32), 2))
    weak_batch = jnp.broadcast_to(jnp.asarray(1.0), (2, 3))
    assert weak_batch.weak_type
    weak = step(rt.distribute(weak_batch, 2))
    assert strong.values[0].dtype == jnp.float32
    assert weak.values[0].dtype == jax.jit(f)(weak_batch[:1]).dtype == jnp.bfloat16
    assert step.cache_info().misses == 2


# -- the C++ hit path of all-mirrored programs (issue 15) --------------------------------
def test_all_mirrored_hits_take_the_executables_own_dispatch(monkeypatch):
    """After the first call, an all-mirrored step is served by its executable's C++
    dispatch: the Python path is not entered again, and the hits are still counted."""
    step = rt.replicate(_axpy, num_replicas=2)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    step(x, 1.0)
    assert step._hit is not None
    monkeypatch.setattr(type(step), "_call", lambda self, args: pytest.fail("slow path taken"))
    for i in range(3):
        np.testing.assert_allclose(step(x, 2.0 + i), x * 2 + 2.0 + i)
    assert step.cache_info() == rt.CacheInfo(hits=3, misses=1, currsize=1)


def test_hit_path_keeps_weak_types_apart_and_refuses_per_replica():
    """The executable's own dispatch ignores weak types; the check on its cache misses does
    not: a weak array gets its own program (with JAX's promotion), and a PerReplica
    argument goes to the general path."""
    f = lambda x: x * jnp.ones((), jnp.bfloat16)  # noqa: E731
    step = rt.replicate(f, num_replicas=2)
    strong = jnp.ones((2, 3), jnp.float32)
    weak = jnp.broadcast_to(jnp.asarray(1.0), (2, 3))
    for _ in range(2):
        assert step(strong).dtype == jax.jit(f)(strong).dtype == jnp.float32
        assert step(weak).dtype == jax.jit(f)(weak).dtype == jnp.bfloat16
    assert step.cache_info().misses == 2
    out = step(rt.distribute(strong, 2))
    assert isinstance(out, rt.PerReplica) and out.values[1].shape == (1, 3)
    assert step(strong).dtype == jnp.float32 and step.cache_info().misses == 3


def test_hit_path_alternating_signatures_and_aot_compiled():
    step = rt.replicate(lambda a: a.sum(0) * 2, num_replicas=4)
    a, b = np.ones((3, 2), np.float32), np.ones((5, 2), np.float32)
    for _ in range(3):
        np.testing.assert_allclose(step(a), [6, 6])
        np.testing.assert_allclose(step(b), [10, 10])
    assert step.cache_info() == rt.CacheInfo(hits=4, misses=2, currsize=2)
    compiled = step.lower(a).compile()
    np.testing.assert_allclose(compiled(a), [6, 6])
    with pytest.raises(TypeError, match=r"argument leaf 0: the compiled step takes float32\[3, 2\] "
                                        r"but was called with float32\[5, 2\]"):
        compiled(b)


def _long_chain(x):
    for i in range(60):  # 120 distinct ops, no nested jit (no JAX-internal caches)
        x = jnp.tanh(x * (1.0 + i / 100))
    return x


def test_a_cached_executable_does_not_keep_its_traces_alive():
    """Every compiled step stays in the cache; it must not keep the jaxprs of its two
    traces (the second trace's used to stay alive through the ``jax.jit`` function the
    program held: JAX's trace cache keyed by it)."""
    import gc
    from jax._src.core import JaxprEqn

    def live_eqns() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) is JaxprEqn)

    xs = [np.ones((4,), np.float32), np.full((4,), 2.0, np.float32)]
    rt.replicate(lambda x: _long_chain(x), num_replicas=2)(rt.PerReplica(xs))  # warm up
    want = jax.jit(_long_chain)(xs[1])  # (jax.jit's own cache keeps its jaxpr: before)
    before = live_eqns()
    step = rt.replicate(lambda x: _long_chain(x), num_replicas=2)
    out = step(rt.PerReplica(xs))
    np.testing.assert_allclose(out.values[1], want, rtol=1e-6)
    assert step.cache_info().currsize == 1
    assert live_eqns() - before < 30  # the step's jaxprs hold ~120 eqns each


@jax.custom_vjp
def _scaled_tanh(x):
    return jnp.tanh(x)


def _scaled_tanh_fwd(x):
    y = jnp.tanh(x)
    return y, y


def _scaled_tanh_bwd(y, g):
    return (g * (1 - y * y),)


_scaled_tanh.defvjp(_scaled_tanh_fwd, _scaled_tanh_bwd)


def _cyclic_step(w, x):
    """A training step through every path of a build: the pullback hook (grad), a
    custom_vjp, a scan with a cond inside (regions), rematerialisation."""
    def loss(w):
        def body(c, xi):
            c = jax.lax.cond(w.sum() > 0, lambda c: c @ w, lambda c: c + w[0], c)
            return c, _scaled_tanh(c).sum()
        c, ys = jax.lax.scan(body, x[0], x)
        return ys.sum() + jax.checkpoint(lambda z: jnp.sin(z) @ w)(c).sum()
    l, g = jax.value_and_grad(loss)(w)
    return w - 0.1 * g, l


def _dynamic_step(w, x):
    """A step over a batch of any size (dynamic shapes: padded, masked)."""
    l, g = jax.value_and_grad(lambda w: jnp.mean(_scaled_tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, l


@pytest.mark.parametrize("dynamic", [False, True])
def test_building_a_step_leaves_no_reference_cycles(dynamic):
    """Everything a build makes and drops is freed by reference counting: nothing is left
    in a reference cycle for the garbage collector (the pullback hook's ``run`` used to
    hold itself through its own cell, keeping the whole backward pass's jaxpr and tracers
    for the collector: ~15,000 objects for a 32-layer step; recursive nested functions
    did the same on a smaller scale), which scanned them inside the next ``lower()``.
    With dynamic shapes JAX's own tracing of symbolic sizes leaves cycles (the TypeErrors
    ``core._canonicalize_dimension`` catches and keeps, with their frames and all they
    reach): there, no function of this project's may be in a cycle through its own
    closure (a recursive nested function)."""
    import collections
    import gc
    import types

    ours = tuple(os.path.join(ROOT, d) + os.sep for d in ("compiler", "ir", "runtime"))

    w = np.full((4, 4), 0.1, np.float32)
    if dynamic:
        fn, opts = _dynamic_step, rt.RunOptions(dynamic_shapes=True)
        xs = [np.full((3 + 2 * r, 4), r + 1.0, np.float32) for r in range(2)]
    else:
        fn, opts = _cyclic_step, rt.RunOptions()
        xs = [np.full((3, 2, 4), r + 1.0, np.float32) for r in range(2)]
    rt.replicate(fn, num_replicas=2, options=opts).lower(w, rt.PerReplica(xs))  # warm up
    gc.collect()
    gc.disable()
    try:
        step = rt.replicate(fn, num_replicas=2, options=opts)
        new_w, losses = step(w, rt.PerReplica(xs))  # trace, passes, lower, compile, run
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        garbage = collections.Counter(
            getattr(o, "__qualname__", None) or type(o).__qualname__ for o in gc.garbage
            if not dynamic or (type(o) is types.FunctionType
                               and o.__code__.co_filename.startswith(ours)
                               and any(c.cell_contents is o for c in o.__closure__ or ())))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not garbage, garbage.most_common(10)
    grads = [jax.jit(jax.grad(lambda w, x: fn(w, x)[1]))(w, x) for x in xs]
    np.testing.assert_allclose(new_w, w - 0.1 * (grads[0] + grads[1]) / 2, rtol=1e-5)
    np.testing.assert_allclose(losses.values, [jax.jit(fn)(w, x)[1] for x in xs], rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_rank_promotion_context_is_part_of_the_key(dynamic):
    """A cached step called under ``numpy_rank_promotion("raise")`` raises what jit
    raises (it ran the cached "allow" program, silently, before JAX's context was part
    of the key), and the "allow" program (its C++ fast path, or the dynamic path's
    plan) serves the calls after the context ends."""
    f = lambda a, v: jnp.sum(a + v)
    a, v = jnp.ones((3,)), jnp.ones((2, 3))
    step = rt.replicate(f, num_replicas=1, options=rt.RunOptions(dynamic_shapes=dynamic))
    arg = (lambda x: rt.PerReplica([x])) if dynamic else (lambda x: x)
    call = lambda v: float(rt.reduce("sum", step(a, arg(v))))
    assert call(v) == call(v) == 12.0  # the second: a hit
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion"):
            jax.jit(f)(a, v)
        with pytest.raises(ValueError, match="rank_promotion"):
            call(v)
    assert call(v) == 12.0
    info = step.cache_info()
    # builds: "allow" (kept) and "raise" (refused, nothing kept); the last call hit the first
    assert (info.misses, info.currsize, info.hits) == (2, 1, 2)
