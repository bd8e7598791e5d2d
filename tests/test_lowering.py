"""Lowering of nested ``jit`` calls (``compiler/lower.py``: ``_call``): each distinct
region becomes one function of the StableHLO module, called from every site, as
``jax.jit`` of the user's step does, and two calls share a function only when their
regions mean exactly the same thing (constants by their bits, ``-0.0`` apart from
``0.0``). Oracle: ``jax.jit`` of the same per-replica function on each replica's data.
Also the source locations lowering gives every op: the user's frames, as ``jax.jit``'s."""
from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt
from compiler.lower import region_key


def _funcs(text: str) -> int:
    return len(re.findall(r"func\.func ", text))


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _layers(x):
    for _ in range(4):  # jnp.var's ``_var`` (a jit) called 4 times from one line
        x = jnp.tanh(_norm(x) @ jnp.ones((x.shape[-1], x.shape[-1]), x.dtype) * 0.1)
    return x.sum()


def _func_names(text):
    return re.findall(r"func\.func (?:private |public )?@(\S+?)\(", text)


def test_repeated_jit_lowers_to_one_function_each_as_jax_jit_does():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(2)]
    step = rt.replicate(_layers, num_replicas=2)
    ours = step.lower(rt.PerReplica(xs)).as_text()
    ref = jax.jit(_layers).lower(xs[0]).as_text()
    assert _funcs(ref) > 1  # the check below means something only if jit shares functions
    assert _funcs(ours) == _funcs(ref)
    assert ours.count("call @") == ref.count("call @") >= 4
    # named as jit names them (the function the step called), not "<lambda>"
    assert _func_names(ours) == _func_names(ref) == ["main", "_var", "_where"], _func_names(ours)
    out = step(rt.PerReplica(xs))
    for r, x in enumerate(xs):
        np.testing.assert_allclose(np.asarray(out.values[r]), np.asarray(jax.jit(_layers)(x)),
                                   rtol=1e-5, atol=1e-6)


def test_repeated_calls_are_replayed_into_the_same_module(monkeypatch):
    """In the second trace, the first call of a shared region (per argument types) goes
    through its nested ``jax.jit`` and the others replay what it staged
    (``_Stager.shared_call``): the StableHLO module, locations included, is the one the
    nested ``jax.jit`` gives at every call, and the results are ``jax.jit``'s."""
    import compiler.lower as lower

    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(2)]
    recorded, calls = [], []
    real_record, real_replay = lower.jc.call_and_record, lower.jc.emit_recorded

    def counting_record(fn, args):
        recorded.append(fn)
        return real_record(fn, args)

    def counting_replay(rec, args, info, ctx):
        calls.append(rec)
        return real_replay(rec, args, info, ctx)

    with monkeypatch.context() as m:
        m.setattr(lower.jc, "call_and_record", counting_record)
        m.setattr(lower.jc, "emit_recorded", counting_replay)
        rt.replicate(_layers, num_replicas=2).lower(rt.PerReplica(xs))
    # _var (4 calls from one line) and the _where inside it (traced once, with _var)
    assert len(recorded) == 2 and len(calls) == 3, (recorded, calls)
    texts = []
    for replay in (True, False):  # (one line, no wrapper of the test's: the locations name them)
        if not replay:
            monkeypatch.setattr(lower._Stager, "shared_call", lambda self, op, args, ctx: None)
        texts.append(rt.replicate(_layers, num_replicas=2).lower(rt.PerReplica(xs)).as_text(debug_info=True))
    assert texts[0] == texts[1]
    out = rt.replicate(_layers, num_replicas=2)(rt.PerReplica(xs))
    for r, x in enumerate(xs):
        np.testing.assert_allclose(np.asarray(out.values[r]), np.asarray(jax.jit(_layers)(x)),
                                   rtol=1e-5, atol=1e-6)


def _const_fn(c):
    return jax.jit(lambda x: x * c)  # one line for every c: equal locations


_CONSTS = [0.0, -0.0, 1.0, np.float32(2.5), np.arange(4, dtype=np.float32),
           np.arange(4, dtype=np.float32)[::-1].copy(), 0.0]
_FNS = [_const_fn(c) for c in _CONSTS]


def _calls_with_constants(x):
    return tuple(f(x) for f in _FNS)  # one call line: only the constants tell them apart


def test_jit_calls_differing_only_in_a_constant_are_not_merged():
    x = np.ones((4,), np.float32)
    step = rt.replicate(_calls_with_constants, num_replicas=2)
    out = step(rt.PerReplica([x, 2 * x]))
    want = jax.jit(_calls_with_constants)(x)
    assert len(out) == len(want) == len(_CONSTS)
    for i, (got, ref) in enumerate(zip(out, want)):
        got = np.asarray(got.values[0])
        np.testing.assert_array_equal(got, np.asarray(ref), err_msg=f"call {i}")
        np.testing.assert_array_equal(np.signbit(got), np.signbit(np.asarray(ref)), err_msg=f"call {i}")


def test_region_key_is_exact():
    graph = rt.replicate(_calls_with_constants, num_replicas=2).lower(
        rt.PerReplica([np.ones((4,), np.float32)] * 2)).ir()
    keys = [region_key(op) for op in graph.ops if op.name in ("jit", "pjit")]
    assert len(keys) == len(_CONSTS) and None not in keys
    # 0.0 twice (the first and the last) share; -0.0, 1.0, 2.5 and the two arrays do not
    assert keys[0] == keys[-1]
    assert len(set(keys)) == len(_CONSTS) - 1


def test_attribute_keys_tell_apart_values_that_compare_equal():
    from compiler.lower import _attr_key
    vals = [1, True, np.int32(1), 1.0, np.float32(1), -0.0, 0.0, (1,), [1], (True,), ((1,),),
            "1", None, np.ones(1, np.float32), np.ones(1, np.int32)]
    keys = [_attr_key(v) for v in vals]
    assert len(set(keys)) == len(vals), keys
    assert _attr_key((1, (2, "a"), 0.5)) == _attr_key((1, (2, "a"), 0.5))


@pytest.mark.parametrize("k", [1, 2], ids=["K1", "K2"])
def test_shared_jit_under_logical_devices_and_gradients(k):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(5, 4)).astype(np.float32)
    xs = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(2)]

    def loss(w, x):
        h = _norm(x @ w)
        return jnp.mean(_norm(h * 2.0) ** 2) + jnp.mean(h ** 2)

    step = rt.replicate(lambda w, x: jax.grad(loss)(w, x), num_replicas=2, logical_devices=k)
    got = np.asarray(step(w, rt.PerReplica(xs)))
    want = np.asarray(jax.jit(jax.grad(loss))(w, np.concatenate(xs)))  # loss_reduction='mean'
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _one_var(x):
    return _norm(x).sum()  # one ``_var`` call


def test_jit_called_once_is_inlined():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    step = rt.replicate(_one_var, num_replicas=2)
    assert _funcs(step.lower(rt.PerReplica([x, x])).as_text()) == 1  # main only
    out = step(rt.PerReplica([x, x + 1]))
    np.testing.assert_allclose(np.asarray(out.values[1]), np.asarray(jax.jit(_one_var)(x + 1)), atol=1e-5)


_SEEN: list[float] = []


@jax.jit
def _logged_double(x):
    jax.debug.callback(lambda v: _SEEN.append(float(v.sum())), x)
    return x * 2


def _two_logged_calls(x):
    return _logged_double(x) + _logged_double(x + 1)  # one line: one shared function


def test_shared_function_runs_its_callback_at_every_call_site():
    step = rt.replicate(_two_logged_calls, num_replicas=2)
    xs = [np.ones(3, np.float32), np.zeros(3, np.float32)]
    want = [np.asarray(jax.jit(_two_logged_calls)(x)) for x in xs]
    assert _funcs(step.lower(rt.PerReplica(xs)).as_text()) == 2  # main and the shared one
    jax.effects_barrier()
    _SEEN.clear()
    out = step(rt.PerReplica(xs))
    jax.effects_barrier()
    for r in range(len(xs)):
        np.testing.assert_array_equal(np.asarray(out.values[r]), want[r])
    assert sorted(_SEEN) == [0.0, 3.0, 3.0, 6.0]  # x.sum() and (x + 1).sum() per replica


def _scatters(x, i):
    """Each ``.at[]`` update binds a scatter whose combiner is a region of its own: add,
    mul, max, min, and an add of int32 values."""
    return (x.at[i].add(2.0), x.at[i].mul(3.0), x.at[i].max(x[0]), x.at[i].min(-1.0),
            jnp.zeros(3, jnp.int32).at[i % 3].add(i))


def test_rebuilt_combiners_are_reused_only_when_identical():
    """The combiner regions of scatters are rebuilt once per distinct region (by exact
    key) and trace context, and reused by later lowerings; each program still gets its
    own combiner, and a combiner traced for one mesh is never used under another (its
    avals carry the mesh: a reuse across replica counts aborted XLA)."""
    from compiler import lower
    lower._PLAIN_JAXPRS.clear()
    x = np.arange(8, dtype=np.float32).reshape(4, 2) - 3
    for n, k in ((2, 1), (2, 1), (1, 1), (4, 1), (2, 2)):  # (2, 1) twice: the reuse
        xs = [x + r for r in range(n)]
        idx = [np.int32(r % 4) for r in range(n)]
        step = rt.replicate(_scatters, num_replicas=n, logical_devices=k)
        out = step(rt.PerReplica(xs), rt.PerReplica(idx))
        for r in range(n):
            want = jax.jit(_scatters)(xs[r], idx[r])
            for j, (got, ref) in enumerate(zip(out, want)):
                np.testing.assert_array_equal(np.asarray(got.values[r]), np.asarray(ref),
                                              err_msg=f"{n}x{k}: replica {r}, output {j}")
    # add (f32), mul, max, min and add (i32): five distinct combiners, none merged, for
    # each of the four meshes
    assert len(lower._PLAIN_JAXPRS) == 5 * 4, len(lower._PLAIN_JAXPRS)


# -- ir._jax_compat.bind: staging straight into the jaxpr being traced ------------------
def _source(x, y):
    a = jnp.sort(x + y, axis=-1)
    k, v = jax.lax.sort((x[0], y[0]), num_keys=1)  # several results
    d = (a @ y.T).astype(jnp.float16)
    c = jnp.cumsum(x * 3.0, axis=1)  # a literal operand
    return d, k, v, c, jax.jit(jnp.tanh)(a).sum(), jax.lax.cond(x[0, 0] > 0, jnp.sin, jnp.cos, y)


def _restaged(closed, direct: bool) -> str:
    """``closed`` staged again eqn by eqn with ``jc.bind`` (``direct``) or ``Primitive.bind``."""
    from ir import _jax_compat as jc
    jaxpr = closed.jaxpr

    def run(*xs):
        env = dict(zip(jaxpr.constvars, closed.consts)) | dict(zip(jaxpr.invars, xs))
        read = lambda a: a.val if isinstance(a, jc.Literal) else env[a]  # noqa: E731
        for eqn in jaxpr.eqns:
            args = [read(a) for a in eqn.invars]
            out = (jc.bind(eqn.primitive, args, eqn.params) if direct
                   else eqn.primitive.bind(*args, **eqn.params))
            env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
        return [read(a) for a in jaxpr.outvars]
    return str(jax.make_jaxpr(run)(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
                                     for v in jaxpr.invars]))


def test_direct_staging_gives_the_jaxpr_bind_gives():
    from ir import _jax_compat as jc
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    closed = jax.make_jaxpr(_source)(x, x + 1)
    names = {e.primitive.name for e in closed.jaxpr.eqns}
    assert {"add", "sort", "dot_general", "convert_element_type", "mul",
            "cond"} <= names and names & {"jit", "pjit"}
    assert jc._plain_primitive(jax.lax.add_p) and jc._plain_primitive(jax.lax.sort_p)
    assert not any(jc._plain_primitive(e.primitive) for e in closed.jaxpr.eqns
                   if e.primitive.name in ("jit", "pjit"))  # (JAX stages them its own way)
    assert _restaged(closed, direct=True) == _restaged(closed, direct=False)


# -- compiler.lower._Stager: the second trace stages plain ops without bind -------------
def _stage_step(w, x):
    def loss(w):
        h = jnp.tanh(_norm(x @ w) * 2.0)  # literals, jnp.var's jit (one function per call)
        h = jax.lax.cond(h.sum() > 0, jnp.sin, jnp.cos, h)  # regions: not staged directly
        s, = jax.lax.sort((h.reshape(-1),), num_keys=1)  # a reshape, several results
        return (s[:3] ** 2).mean() + jnp.cumsum(h, axis=1).sum() * 0.5
    l, g = jax.value_and_grad(loss)(w)
    return w - 0.1 * g, l


def test_staged_second_trace_lowers_to_the_module_bind_gives_locations_included(monkeypatch):
    """The second trace stages the ops that re-bind their primitive straight into the
    jaxpr (an equation appended to the frame, ``jc.emit``, else ``jc.stage``), with
    source info made once per name scope and user's traceback. Oracle: the same step
    lowered with every op bound through ``jax.named_scope`` + ``Primitive.bind`` gives
    the same StableHLO, op names and the user's source locations included."""
    from ir import _jax_compat as jc
    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, 5)).astype(np.float32)
    xs = [rng.normal(size=(3, 5)).astype(np.float32) for _ in range(2)]
    staged = {"emit": [], "stage": []}
    real = {"emit": jc.emit, "stage": jc.stage}

    def counting(name):
        def wrapper(*a):
            out = real[name](*a)
            staged[name].append(out is not None)
            return out
        return wrapper

    def text() -> str:
        step = rt.replicate(_stage_step, num_replicas=2)
        return step.lower(w, rt.PerReplica(xs))._program.jax_lowered.as_text(debug_info=True)

    texts = []
    for way in (counting, lambda name: lambda *a: None):  # (None: every op Primitive.bind)
        monkeypatch.setattr(jc, "emit", way("emit"))
        monkeypatch.setattr(jc, "stage", way("stage"))
        texts.append(text())  # (one call site: the locations hold the caller's line)
    direct, bound = texts
    emitted, tries = sum(staged["emit"]), len(staged["emit"])
    # (most of them: casts and broadcasts of constants, which JAX folds, are bound; 77 of
    # 96 with jax 0.10.2, 75 of 94 with 0.11.2)
    assert emitted > 50 and emitted > 0.75 * tries, (emitted, tries)
    assert direct == bound
    # (what was compared: the user's frames of each op, under JAX's own name stack, and
    # the scopes of the collectives, the only ops that carry one with K = 1)
    src, first = inspect.getsourcelines(_norm)
    norm_line = first + next(i for i, ln in enumerate(src) if "rsqrt" in ln)
    assert f'"{__file__}":{norm_line}:' in direct
    assert set(re.findall(r"(\w+)\[test_lowering\.py:\d+\]", direct)) == {"all_reduce"}
    out = rt.replicate(_stage_step, num_replicas=2)(w, rt.PerReplica(xs))
    grads = [jax.grad(lambda w, x: _stage_step(w, x)[1])(w, x) for x in xs]
    np.testing.assert_allclose(np.asarray(out[0]), w - 0.1 * (grads[0] + grads[1]) / 2,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eager_folding", [False, True])
def test_stage_leaves_ops_of_constants_only_to_bind(eager_folding):
    """``jc.stage`` stages an op with a tracer operand (NumPy ones become constants) and
    leaves an op of constants only to ``bind``, which folds it when JAX's eager constant
    folding is on. Oracle: the jaxpr ``Primitive.bind`` gives."""
    from ir import _jax_compat as jc
    c = np.arange(3, dtype=np.float32)
    mul, add = jax.make_jaxpr(lambda x, y: (x * y, x + y))(c, c).jaxpr.eqns

    def run(bind):
        def f(x):
            return bind(mul, [x, c * 2]), bind(add, [c, c + 1])
        with jc.eager_constant_folding(eager_folding):
            return str(jax.make_jaxpr(f)(c))

    staged = []

    def through_stage(eqn, args):
        out = jc.stage(eqn.primitive, args, eqn.params, jc.current_source_info())
        staged.append(out is not None)
        return eqn.primitive.bind(*args, **eqn.params) if out is None else out[0]
    assert run(through_stage) == run(lambda eqn, args: eqn.primitive.bind(*args, **eqn.params))
    assert staged == [True, False]


_WEAK = {  # arrays of a weak type the step closes over, as jnp makes them without a dtype
    "full": lambda: jnp.full(4, 3.0),
    "broadcast_to": lambda: jnp.broadcast_to(2.0, (4,)),
    "int_full_summed": lambda: jnp.full((4,), 2),
}


@pytest.mark.parametrize("name", sorted(_WEAK))
def test_a_weak_typed_array_the_step_closes_over(name):
    """A weak-typed array closed over by the step, which the step's ops cast to its strong
    type first (an op of constants only, which JAX folds into a constant of the frame):
    the numbers ``jax.jit`` gives. Before: a ``KeyError: Var(...)`` from JAX's lowering
    (the folded constant's tracer had died before ``shard_map`` made the jaxpr, and JAX
    drops such a constant; found by a probe)."""
    g = _WEAK[name]()
    assert g.weak_type

    def step(x):
        return x * (g.sum() if name.endswith("summed") else g)
    x = np.arange(1, 5, dtype=np.float32)
    got = rt.replicate(step, num_replicas=2)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(step)(x)))


_LOG: list = []


def _callbacks(x):
    y = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    jax.experimental.io_callback(lambda v: _LOG.append(round(float(v.sum()), 4)), None, y * 2)
    return jnp.tanh(y).sum()


def test_staged_callbacks_run_once_per_replica_on_its_own_values():
    """Callback primitives (effectful, no region) are staged directly too: JAX's abstract
    evaluation gives their effects. Oracle: each replica's ``jax.jit`` of the step."""
    import jax.experimental  # noqa: F401  (io_callback)
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(2, 3)).astype(np.float32) for _ in range(4)]
    _LOG.clear()
    out = rt.replicate(_callbacks, num_replicas=4)(rt.PerReplica(xs))
    jax.effects_barrier()
    ours = sorted(_LOG)
    _LOG.clear()
    want = [np.asarray(jax.jit(_callbacks)(x)) for x in xs]
    jax.effects_barrier()
    assert ours == sorted(_LOG) and len(ours) == 4
    for r in range(4):
        np.testing.assert_allclose(np.asarray(out.values[r]), want[r], rtol=1e-6)


def _four_layer_step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)
    g = jax.grad(loss)(ws)
    return [w - 0.1 * gw for w, gw in zip(ws, g)], loss(ws)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_rule_calls_are_replayed_into_the_same_module(monkeypatch, dtype):
    """In the second trace, an all-reduce's rule runs once per attributes and operand
    types and what it staged is staged again for the others (``_Stager.rule_call``; on
    CPU a 16-bit one is widened to float32 and back). Oracle: the StableHLO module,
    locations included, equals the one the rule run at every op gives, and the results
    are ``jax.jit``'s of the step on the whole batch."""
    import compiler.lower as lower
    rng = np.random.default_rng(3)
    ws = [jnp.asarray(rng.normal(size=(4, 4)) * 0.5, dtype) for _ in range(4)]
    xs = [jnp.asarray(rng.normal(size=(2, 4)), dtype) for _ in range(2)]
    replays = []
    real = lower.jc.emit_recording

    def counting(*a):
        replays.append(a[0])
        return real(*a)

    texts = []
    for replay in (True, False):
        with monkeypatch.context() as m:
            m.setattr(lower.jc, "emit_recording", counting)
            if not replay:
                m.setattr(lower._Stager, "rule_call", lambda *a: None)
            texts.append(rt.replicate(_four_layer_step, num_replicas=2)
                         .lower(ws, rt.PerReplica(xs)).as_text(debug_info=True))
    # four gradients of one type: the first all-reduce recorded, three replayed
    assert len(replays) == 3 and texts[0].count("all_reduce") >= 4, replays
    assert texts[0] == texts[1]
    new_ws, losses = rt.replicate(_four_layer_step, num_replicas=2)(ws, rt.PerReplica(xs))
    want_ws, _ = jax.jit(lambda ws, x: _four_layer_step(ws, x))(ws, jnp.concatenate(xs))
    tol = 1e-5 if dtype == np.float32 else 2e-2
    for got, want in zip(new_ws, want_ws):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)


def _loss(w, x):
    h = jnp.tanh(x @ w)
    return jnp.mean((h - 1.0) ** 2)


def _sgd(w, x):
    return w - 0.1 * jax.grad(_loss)(w, x)


def _lines_named(text: str) -> set[int]:
    """The lines of this file that a module's locations name (``as_text(debug_info=True)``),
    within ``_loss`` and ``_sgd``."""
    lines = set()
    for fn in (_loss, _sgd):
        src, first = inspect.getsourcelines(fn)
        span = range(first, first + len(src))
        lines |= {int(n) for n in re.findall(re.escape(f'"{__file__}"') + r":(\d+):", text)
                  if int(n) in span}
    return lines


@pytest.mark.parametrize("k", [1, 2])
def test_every_op_names_the_users_lines_as_jit_does(k):
    """What an op lowers to names the frames of the user's code that made it, as
    ``jax.jit``'s module does (the traceback the IR kept from the trace: ``Loc.traceback``),
    so XLA's metadata and profiles point at the user's lines. The ``op[file:line]`` scope
    that ``hlo_report`` reads a collective's IR op back from is on every op with K > 1
    (the partitioner may make a collective of any) and only on the collectives with K = 1
    (they are the only ones there)."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    xs = [rng.normal(size=(5, 4)).astype(np.float32) for _ in range(2)]
    lowered = rt.replicate(_sgd, num_replicas=2, logical_devices=k).lower(w, rt.PerReplica(xs))
    ours = lowered.as_text(debug_info=True)
    ref = jax.jit(_sgd).lower(w, xs[0]).as_text(debug_info=True)
    assert len(_lines_named(ref)) >= 3
    assert _lines_named(ours) == _lines_named(ref)
    scoped = set(re.findall(r"(\w+)\[test_lowering\.py:\d+\]", ours))
    assert "all_reduce" in scoped
    if k == 1:
        assert scoped == {"all_reduce"}
    else:
        assert {"dot_general", "tanh"} <= scoped
    # the gradient all-reduce, read back from the compiled program, names its IR op and a
    # line of the user's step
    compiled = lowered.compile()
    grads = [c for c in compiled.collectives() if c.kind == "all-reduce"]
    assert grads and all(c.ir_sources for c in grads)
    assert {(op, f) for c in grads for op, f, _ in c.ir_sources} == {
        ("all_reduce", "test_lowering.py")}
    assert {ln for c in grads for _, _, ln in c.ir_sources} <= _lines_named(ref)
    grad = jax.jit(jax.grad(_loss))
    want = w - 0.1 * np.mean([np.asarray(grad(w, x)) for x in xs], axis=0)
    np.testing.assert_allclose(np.asarray(compiled(w, rt.PerReplica(xs))), want,
                               rtol=1e-5, atol=1e-6)
