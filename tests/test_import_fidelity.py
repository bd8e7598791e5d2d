"""Import fidelity: a graph imported from a jaxpr, with no passes, computes what
``jax.jit`` of the original function computes, and its text form round-trips."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from compiler.lower import eval_graph
from ir.jaxpr_import import import_jaxpr
from tests.irtest import check_roundtrip


def _rng(seed=0):
    return np.random.default_rng(seed)


def _normal(shape, seed=0, dtype=np.float32):
    return _rng(seed).standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------- model cases
def case_flax_mlp():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(16)(x))
            return nn.Dense(3)(x)

    model = MLP()
    x, y = _normal((8, 5), 1), _normal((8, 3), 2)
    params = model.init(jax.random.PRNGKey(0), x)
    leaves, tree = jax.tree_util.tree_flatten(params)

    def step(*args):
        p = jax.tree_util.tree_unflatten(tree, args[:-2])
        xb, yb = args[-2:]

        def loss(p):
            return jnp.mean((model.apply(p, xb) - yb) ** 2)
        l, g = jax.value_and_grad(loss)(p)
        new = jax.tree_util.tree_map(lambda w, d: w - 0.1 * d, p, g)
        return [l] + jax.tree_util.tree_leaves(new)
    return step, [np.asarray(a) for a in leaves] + [x, y]


def case_flax_cnn():
    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3))(x)
            x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            x = x.reshape((x.shape[0], -1))
            return nn.Dense(2)(x)

    model = CNN()
    x = _normal((2, 8, 8, 1), 3)
    labels = np.array([0, 1], np.int32)
    params = model.init(jax.random.PRNGKey(1), x)
    leaves, tree = jax.tree_util.tree_flatten(params)

    def step(*args):
        p = jax.tree_util.tree_unflatten(tree, args[:-2])
        xb, lb = args[-2:]

        def loss(p):
            logits = model.apply(p, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, lb).mean()
        l, g = jax.value_and_grad(loss)(p)
        new = jax.tree_util.tree_map(lambda w, d: w - 0.05 * d, p, g)
        return [l] + jax.tree_util.tree_leaves(new)
    return step, [np.asarray(a) for a in leaves] + [x, labels]


def case_optax_adam():
    opt = optax.adam(1e-2)
    params = {"w": _normal((4, 3), 4), "b": _normal((3,), 5)}
    state = opt.init(params)
    p_leaves, p_tree = jax.tree_util.tree_flatten(params)
    s_leaves, s_tree = jax.tree_util.tree_flatten(state)
    x = _normal((6, 4), 6)
    np_, ns = len(p_leaves), len(s_leaves)

    def step(*args):
        p = jax.tree_util.tree_unflatten(p_tree, args[:np_])
        s = jax.tree_util.tree_unflatten(s_tree, args[np_:np_ + ns])
        xb = args[-1]

        def loss(p):
            return jnp.sum(jnp.tanh(xb @ p["w"] + p["b"]) ** 2)
        g = jax.grad(loss)(p)
        upd, s = opt.update(g, s, p)
        p = optax.apply_updates(p, upd)
        return jax.tree_util.tree_leaves(p) + jax.tree_util.tree_leaves(s)
    return step, [np.asarray(a) for a in p_leaves + s_leaves] + [x]


def _rnn(h0, w, xs):
    def cell(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h.sum()
    return lax.scan(cell, h0, xs)


def case_scan_rnn():
    args = [_normal((3,), 7), _normal((3, 3), 8) * 0.5, _normal((5, 3), 9)]
    return (lambda h, w, xs: _rnn(h, w, xs)), args


def case_scan_rnn_grad():
    def f(h, w, xs):
        def loss(w, h):
            hT, ys = _rnn(h, w, xs)
            return hT.sum() + ys.sum()
        return jax.grad(loss, argnums=(0, 1))(w, h)
    return f, [_normal((3,), 7), _normal((3, 3), 8) * 0.5, _normal((5, 3), 9)]


def case_scan_consts_forwarded_ys():
    # a closed-over operand (a scan const), two carries, a ys that is an xs element as is
    # (jax 0.11 forwards it: the scan's jaxpr and results leave it out) and a computed ys
    def f(w, h, xs):
        def body(carry, x):
            h, n = carry
            h = jnp.tanh(w @ h + x)
            return (h, n + 1), (x, h * 2.0)
        return lax.scan(body, (h, jnp.int32(0)), xs)
    return f, [_normal((3, 3), 40) * 0.5, _normal((3,), 41), _normal((4, 3), 42)]


def case_traced_call():
    # calling a ``jax.jit(g).trace(...)`` object: jax 0.11 binds its generic call primitive
    # (``eval_jaxpr``, ``closed_call`` before) with a jaxpr that carries a captured array
    table = _normal((3,), 43)
    traced = jax.jit(lambda x: jnp.sin(x) * table).trace(jax.ShapeDtypeStruct((3,), jnp.float32))

    def f(w, x):
        return traced(x * w), jax.grad(lambda w: jnp.sum(traced(x * w) ** 2))(w)
    return f, [_normal((3,), 44), _normal((3,), 45)]


def case_relu_gelu():
    def f(x):
        return jax.nn.relu(x) + jax.nn.gelu(x) + jax.nn.gelu(x, approximate=False)
    return f, [_normal((4, 5), 10)]


def case_relu_gelu_grad():
    def f(x):
        return jax.grad(lambda x: jnp.sum(jax.nn.relu(x) * jax.nn.gelu(x) + jax.nn.silu(x)))(x)
    return f, [_normal((4, 5), 11)]


def case_random_typed_key():
    def f(seed):
        k = jax.random.key(seed)
        k1, k2, k3 = jax.random.split(k, 3)
        a = jax.random.normal(k1, (3, 4))
        b = jax.random.uniform(k2, (3, 4), minval=-1.0, maxval=2.0)
        c = jax.random.bernoulli(k3, 0.3, (3, 4))
        return a, b, c, jax.random.key_data(k2)
    return f, [np.int32(42)]


def case_random_prngkey():
    def f(key):
        k1, k2 = jax.random.split(key)
        return (jax.random.normal(k1, (5,)), jax.random.uniform(k2, (2, 2)),
                jax.random.bernoulli(k2, 0.5, (7,)), jax.random.randint(k1, (4,), 0, 10))
    return f, [np.asarray(jax.random.PRNGKey(3))]


def case_embedding():
    def f(table, ids):
        def loss(t):
            e = jnp.take(t, ids, axis=0)
            return jnp.sum(e ** 2) + jnp.sum(t[ids[::-1]] * 0.5)
        return jnp.take(table, ids, axis=0), jax.grad(loss)(table)
    return f, [_normal((10, 4), 12), np.array([1, 3, 3, 9, 0], np.int32)]


def case_flax_embed():
    model = nn.Embed(11, 6)
    ids = np.array([[1, 2, 10], [0, 0, 5]], np.int32)
    params = model.init(jax.random.PRNGKey(2), ids)
    table = np.asarray(params["params"]["embedding"])

    def f(t, ids):
        return jax.grad(lambda t: jnp.sum(jnp.sin(model.apply({"params": {"embedding": t}}, ids))))(t)
    return f, [table, ids]


def case_cond():
    def f(p, x):
        return lax.cond(p > 0, lambda x: jnp.sin(x) * 2, lambda x: jnp.cos(x) - 1, x)
    return f, [np.int32(1), _normal((3,), 13)]


def case_cond_false_and_switch():
    def f(p, i, x):
        a = lax.cond(p > 0, lambda x: jnp.sin(x), lambda x: jnp.cos(x), x)
        b = lax.switch(i, [lambda x: x + 1, lambda x: x * 3, lambda x: -x], x)
        return a, b
    return f, [np.int32(-1), np.int32(2), _normal((3,), 14)]


def case_cond_grad():
    def f(p, x):
        return jax.grad(lambda x: lax.cond(p > 0, lambda x: jnp.sum(x ** 3), lambda x: jnp.sum(x), x))(x)
    return f, [np.int32(1), _normal((3,), 15)]


def case_while():
    def f(x, n):
        def cond(c):
            i, v = c
            return (i < n) & (jnp.sum(v) < 1e6)
        def body(c):
            i, v = c
            return i + 1, v * 1.5 + 1.0
        return lax.while_loop(cond, body, (jnp.int32(0), x))
    return f, [_normal((4,), 16), np.int32(7)]


def case_fori():
    def f(x):
        return lax.fori_loop(0, 5, lambda i, v: v * 0.9 + i, x), \
            lax.fori_loop(0, x.shape[0], lambda i, v: v.at[i].set(i * 2.0), x)
    return f, [_normal((4,), 17)]


def case_fori_dynamic():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, v: jnp.roll(v, 1) + i, x)
    return f, [_normal((4,), 18), np.int32(3)]


@jax.custom_vjp
def _clip_grad(x):
    return jnp.sin(x)


def _clip_fwd(x):
    return jnp.sin(x), jnp.cos(x)


def _clip_bwd(c, g):
    return (jnp.clip(g * c, -0.1, 0.1),)


_clip_grad.defvjp(_clip_fwd, _clip_bwd)


def case_custom_vjp():
    def f(x):
        return _clip_grad(x), jax.grad(lambda x: jnp.sum(_clip_grad(x) * 3.0))(x)
    return f, [_normal((5,), 19)]


@jax.custom_jvp
def _softplus(x):
    return jnp.log1p(jnp.exp(x))


_softplus.defjvp(lambda p, t: (_softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))


def case_custom_jvp():
    def f(x):
        return _softplus(x), jax.grad(lambda x: jnp.sum(_softplus(x) ** 2))(x)
    return f, [_normal((5,), 20)]


def case_checkpoint():
    def f(w, x):
        @jax.checkpoint
        def block(w, x):
            return jnp.tanh(x @ w) @ w.T
        return jax.value_and_grad(lambda w: jnp.sum(block(w, x) ** 2))(w)
    return f, [_normal((4, 4), 21), _normal((3, 4), 22)]


def case_checkpoint_policy():
    def f(w, x):
        block = jax.checkpoint(lambda w, x: jnp.sin(x @ w) @ w,
                               policy=jax.checkpoint_policies.dots_saveable)
        return jax.grad(lambda w: jnp.sum(block(w, x)))(w)
    return f, [_normal((4, 4), 23), _normal((3, 4), 24)]


def case_nested_jit():
    @jax.jit
    def inner(a, b):
        return a @ b + 1.0

    @functools.partial(jax.jit, static_argnums=1)
    def scaled(a, k):
        return a * k

    def f(a, b):
        return scaled(inner(a, b), 3), jax.grad(lambda a: jnp.sum(inner(a, b)))(a)
    return f, [_normal((3, 4), 25), _normal((4, 2), 26)]


def case_softmax_logsumexp():
    def f(x):
        return (jax.nn.softmax(x, axis=-1), jax.nn.logsumexp(x, axis=0),
                jax.nn.log_softmax(x), jax.scipy.special.logsumexp(x))
    return f, [_normal((4, 6), 27) * 10]


def case_integer_ops():
    def f(a, b):
        return (a + b, a * b, a // b, a % b, jnp.right_shift(a, 1), jnp.left_shift(a, 2),
                a & b, a | b, a ^ b, ~a, jnp.abs(a), jnp.maximum(a, b), jnp.sign(a),
                jnp.clip(a, -3, 3), a == b, a < b, jnp.where(a > 0, a, b))
    return f, [np.array([5, -7, 3, 0, 100], np.int32), np.array([2, 3, -4, 7, 9], np.int32)]


def case_unsigned_and_bool():
    def f(a, m):
        return a >> np.uint32(3), a * np.uint32(2654435761), jnp.logical_not(m), m & (a > 10), jnp.any(m)
    return f, [np.array([1, 2**31 + 5, 77], np.uint32), np.array([True, False, True])]


def case_argmax_sort_cumsum():
    def f(x, i):
        return (jnp.argmax(x, axis=1), jnp.argmin(x), jnp.sort(x, axis=0), jnp.argsort(x[0]),
                jnp.cumsum(x, axis=1), jnp.cumprod(x[:, :3], axis=0), jnp.cumsum(i),
                lax.sort((x[0], i), num_keys=1), lax.top_k(x[1], 2))
    return f, [_normal((3, 5), 28), np.array([3, 1, 4, 1, 5], np.int32)]


def case_dtype_casts():
    def f(x, i):
        b = x.astype(jnp.bfloat16)
        h = x.astype(jnp.float16)
        return (b, (b * b).astype(jnp.float32), h + 1, x.astype(jnp.int32), i.astype(jnp.float32),
                i.astype(jnp.int8), (x > 0).astype(jnp.int32), lax.bitcast_convert_type(x, jnp.int32),
                jnp.bfloat16(2.5) * b, x.astype(jnp.uint8))
    return f, [_normal((2, 3), 29) * 4, np.array([1, -2, 300], np.int32)]


def case_bf16_matmul_grad():
    def f(w, x):
        def loss(w):
            y = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
            return jnp.sum(y ** 2)
        return jax.grad(loss)(w)
    return f, [_normal((4, 3), 30), _normal((2, 4), 31)]


def case_closure_consts_and_literals():
    table = np.arange(12, dtype=np.float32).reshape(3, 4)

    def f(x):
        return x @ table.T + jnp.float32(np.inf) * 0 + jnp.array([1.0, -1.0, 0.5]), jnp.isnan(x * np.nan)
    return f, [_normal((2, 4), 32)]


def case_reductions_and_shapes():
    def f(x):
        return (x.sum(), x.max(axis=0), x.min(axis=1), x.prod(axis=0), jnp.mean(x, axis=1, keepdims=True),
                x.T, x.reshape(-1), jnp.concatenate([x, x], axis=0), jnp.pad(x, ((1, 0), (0, 2))),
                x[1:, ::2], lax.dynamic_slice(x, (1, 1), (2, 2)), jnp.expand_dims(x, 0),
                lax.dynamic_update_slice(x, jnp.ones((1, 2)), (2, 1)), jnp.flip(x, 1),
                jnp.broadcast_to(x[:, :1], (3, 4)), jnp.einsum("ij,kj->ik", x, x), jnp.var(x))
    return f, [_normal((3, 4), 33)]


def case_scatter_gather_ops():
    def f(x, idx):
        return (x.at[idx].add(1.0), x.at[idx].max(0.0), x.at[idx].set(-1.0), x.at[idx].multiply(2.0),
                x[idx, :2], jnp.take_along_axis(x[:3], idx[:3, None] % 4, axis=1))
    return f, [_normal((5, 4), 34), np.array([0, 4, 2, 2], np.int32)]


def case_vmap():
    def f(w, xs):
        return jax.vmap(lambda x: jnp.tanh(w @ x))(xs), jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(w @ x))))(xs)
    return f, [_normal((3, 4), 35), _normal((6, 4), 36)]


_CAPTURED_KEY = jax.random.key(7)


def case_captured_typed_key_and_empty_const():
    empty = np.zeros((0, 3), np.float32)

    def f(x):
        return jnp.concatenate([x, empty]) + jax.random.normal(_CAPTURED_KEY, (2, 3))
    return f, [_normal((2, 3), 37)]


def case_linear_solve_and_fill_gather():
    def f(x):
        sol = jax.scipy.sparse.linalg.cg(lambda v: 2.0 * v + 0.5 * jnp.roll(v, 1), x, maxiter=5)[0]
        return sol, jnp.take(x, jnp.array([0, 5]), mode="fill", fill_value=-1.0)
    return f, [_normal((3,), 38)]


def case_device_put_enum_attr():
    def f(x):
        return jax.device_put(x, jax.devices()[0]) * 2
    return f, [_normal((3,), 39)]


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


def _assert_same(got, want, exact):
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape, w.shape)
        if exact or not np.issubdtype(w.dtype, np.floating) and w.dtype.name != "bfloat16":
            np.testing.assert_array_equal(g, w, err_msg=f"output {i}")
        else:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64),
                                       rtol=1e-5, atol=1e-6, err_msg=f"output {i}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_imported_graph_matches_jit(name):
    fn, args = CASES[name]()
    closed = jax.make_jaxpr(fn)(*args)
    graph = import_jaxpr(closed)
    check_roundtrip(graph)
    want = jax.jit(fn)(*args)
    got = jax.jit(lambda *a: eval_graph(graph, list(a)))(*args)
    want_leaves = jax.tree_util.tree_leaves(want)
    # the same XLA ops on the same inputs: bit-identical is expected, but XLA may fuse
    # differently across two programs, so floats get a tight tolerance
    _assert_same(got, want_leaves, exact=False)


def test_regions_are_imported():
    """The control-flow cases really have regions (else the fidelity tests prove little)."""
    want = {"scan_rnn": {"scan"}, "cond": {"cond"}, "while": {"while"},
            "custom_vjp": {"custom_vjp_call"}, "custom_jvp": {"custom_jvp_call"},
            "checkpoint": {"remat2"}, "nested_jit": {"jit"}, "fori_dynamic": {"while"},
            "linear_solve_and_fill_gather": {"custom_linear_solve"}}
    for case, op_names in want.items():
        fn, args = CASES[case]()
        g = import_jaxpr(jax.make_jaxpr(fn)(*args))
        names = {op.name for op, _ in g.walk()}
        assert op_names <= names, (case, sorted(names))
        assert any(op.regions for op, _ in g.walk())


def test_primitives_of_interest_are_imported():
    """The cases exercise what they claim to (gradient of a gather is a scatter-add, ...)."""
    want = {"embedding": {"gather", "scatter-add"}, "flax_embed": {"scatter-add"},
            "random_typed_key": {"random_seed", "random_split", "random_bits", "random_unwrap"},
            "random_prngkey": {"random_wrap", "random_unwrap", "random_bits"},
            "argmax_sort_cumsum": {"argmax", "argmin", "sort", "cumsum", "cumprod", "top_k"},
            "dtype_casts": {"convert_element_type", "bitcast_convert_type"},
            "flax_cnn": {"conv_general_dilated", "reduce_window_max"},
            "relu_gelu_grad": {"custom_jvp_call"}, "softmax_logsumexp": {"reduce_max", "exp"},
            "captured_typed_key_and_empty_const": {"random_wrap", "constant"}}
    for case, op_names in want.items():
        fn, args = CASES[case]()
        names = {op.name for op, _ in import_jaxpr(jax.make_jaxpr(fn)(*args)).walk()}
        assert op_names <= names, (case, sorted(op_names - names), sorted(names))


def test_source_locations_point_at_this_file():
    fn, args = CASES["relu_gelu"]()
    g = import_jaxpr(jax.make_jaxpr(fn)(*args))
    locs = [op.loc for op, _ in g.walk() if op.loc is not None]
    assert locs and all(loc.file.endswith("test_import_fidelity.py") for loc in locs
                        if loc.file != "<unknown>")
    text = check_roundtrip(g)
    assert "# test_import_fidelity.py:" in text


def test_grad_name_stack_survives_roundtrip():
    fn, args = CASES["relu_gelu_grad"]()
    g = import_jaxpr(jax.make_jaxpr(fn)(*args))
    text = check_roundtrip(g)
    assert "transpose(jvp(" in text
    from ir.parser import parse
    reparsed = parse(text)
    assert any(op.loc is not None and op.loc.in_transpose for op, _ in reparsed.walk())


def _has_opaque(graph) -> bool:
    from ir.graph import Opaque

    def visit(v):
        if isinstance(v, Opaque):
            return True
        return isinstance(v, (tuple, list)) and any(visit(x) for x in v)
    return any(visit(v) for op, _ in graph.walk() for _, v in op.attrs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pipeline_preserves_semantics(name):
    """replication, cross-replica-sum and dce (verified after each) change no numbers of a
    single-device program."""
    from compiler.pass_manager import PassManager, parse_pipeline
    fn, args = CASES[name]()
    graph = import_jaxpr(jax.make_jaxpr(fn)(*args))
    pm = PassManager(parse_pipeline("replication,cross-replica-sum,dce"), verify=True, dump_dir="")
    out = pm.run(graph)
    check_roundtrip(out)
    got = jax.jit(lambda *a: eval_graph(out, list(a)))(*args)
    _assert_same(got, jax.tree_util.tree_leaves(jax.jit(fn)(*args)), exact=False)


PARSED_LOWERABLE = {"bf16_matmul_grad", "checkpoint", "closure_consts_and_literals", "cond",
                    "cond_false_and_switch", "dtype_casts", "scan_consts_forwarded_ys",
                    "scan_rnn", "scan_rnn_grad", "traced_call",
                    "unsigned_and_bool", "vmap", "while"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_graph_parsed_from_text_lowers(name):
    """A dump is a reproducer: a graph parsed back from text (primitives found by name)
    computes the same numbers, unless it holds opaque attributes, which must then be
    refused with a LoweringError rather than mis-lowered."""
    from compiler.errors import LoweringError
    from ir.parser import parse
    fn, args = CASES[name]()
    parsed = parse(check_roundtrip(import_jaxpr(jax.make_jaxpr(fn)(*args))))
    assert (not _has_opaque(parsed)) == (name in PARSED_LOWERABLE)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    try:
        got = jax.jit(lambda *a: eval_graph(parsed, list(a)))(*args)
    except LoweringError as e:
        assert _has_opaque(parsed), e
        assert "was parsed from text and cannot be rebuilt" in str(e)
        return
    _assert_same(got, want, exact=False)


def test_scan_attributes_read_the_same_on_every_jax():
    """jax 0.11's scan has FlatTree params (``ft_in``/``ft_out``) where 0.10 has counts:
    the IR spells them as counts on both, so passes and text do not depend on JAX."""
    fn, args = CASES["scan_consts_forwarded_ys"]()
    (op,) = [op for op, _ in import_jaxpr(jax.make_jaxpr(fn)(*args)).walk() if op.name == "scan"]
    assert [k for k, _ in op.attrs] == ["reverse", "length", "jaxpr", "num_consts",
                                        "num_carry", "unroll"]
    assert (op.attr("num_consts"), op.attr("num_carry"), op.attr("length")) == (1, 2, 4)
    assert len(op.operands) == 1 + 2 + 1
    assert len(op.results) == len(op.regions[0].outputs)
