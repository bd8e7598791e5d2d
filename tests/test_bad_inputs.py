"""Issue 13: every mistake a new user makes with the public API and the tools gets a clear
error: the right exception type, and a message naming the offending value (and, for
errors found while the step is traced, the user's file and line). One case per mistake;
the command-line cases run the real commands as subprocesses (one line on stderr, exit
status 2, no traceback)."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import runtime as rt
from compiler.errors import DivergentCollectiveError, LoweringError, PassError
from ir.errors import IRParseError, IRTypeError, IRVerifyError

HERE = os.path.basename(__file__)
X = np.ones((4, 3), np.float32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _line(fn, text: str) -> int:
    src, start = inspect.getsourcelines(fn)
    for i, line in enumerate(src):
        if text in line:
            return start + i
    raise AssertionError(text)


def _step(fn, n=2, k=1, **kw):
    return rt.replicate(fn, num_replicas=n, logical_devices=k, **kw)


# ---------------------------------------------------------------------------------------
# (id, thunk, exception type, regex the message must match)
CASES: list[tuple] = []


def case(name, exc, pattern):
    def register(thunk):
        CASES.append(pytest.param(thunk, exc, pattern, id=name))
        return thunk
    return register


# -- replicate(...) -------------------------------------------------------------------------
case("replicate-fn-not-callable", TypeError, r"step must be callable .* got 5 \(int\)")(
    lambda: rt.replicate(5))
case("replicate-fn-string", TypeError, r"step must be callable .* got 'step' \(str\)")(
    lambda: rt.replicate("step"))
case("num_replicas-bool", TypeError, r"num_replicas must be a positive int, got True \(bool\)")(
    lambda: rt.replicate(lambda a: a, num_replicas=True))
case("num_replicas-zero", ValueError, r"num_replicas must be a positive int, got 0")(
    lambda: rt.replicate(lambda a: a, num_replicas=0))
case("num_replicas-negative", ValueError, r"num_replicas must be a positive int, got -2")(
    lambda: rt.replicate(lambda a: a, num_replicas=-2))
case("num_replicas-float", TypeError, r"num_replicas must be a positive int, got 2\.0 \(float\)")(
    lambda: rt.replicate(lambda a: a, num_replicas=2.0))
case("num_replicas-string", TypeError, r"num_replicas must be a positive int, got '2' \(str\)")(
    lambda: rt.replicate(lambda a: a, num_replicas="2"))
case("num_replicas-too-many", ValueError, r"9 replicas × 1 logical devices need 9 devices but only 8")(
    lambda: rt.replicate(lambda a: a, num_replicas=9))
case("logical_devices-zero", ValueError, r"logical_devices must be a positive int, got 0")(
    lambda: rt.replicate(lambda a: a, logical_devices=0))
case("logical_devices-string", TypeError, r"logical_devices must be a positive int, got '4' \(str\)")(
    lambda: rt.replicate(lambda a: a, logical_devices="4"))
case("replicas-times-logical-too-many", ValueError, r"4 replicas × 4 logical devices need 16 devices but only 8")(
    lambda: rt.replicate(lambda a: a, num_replicas=4, logical_devices=4))
case("devices-strings", TypeError, r"devices must be jax.Device objects .* got 'cpu:0' \(str\)")(
    lambda: rt.replicate(lambda a: a, devices=["cpu:0", "cpu:1"]))
case("devices-ints", TypeError, r"devices must be jax.Device objects .* got 0 \(int\)")(
    lambda: rt.replicate(lambda a: a, devices=[0, 1]))
case("devices-duplicate", ValueError, r"devices lists .* more than once")(
    lambda: rt.replicate(lambda a: a, devices=[jax.devices()[0]] * 2))
case("devices-wrong-count", ValueError, r"devices has 3 entries but 2 replicas × 1 logical devices need 2")(
    lambda: rt.replicate(lambda a: a, num_replicas=2, devices=jax.devices()[:3]))
case("loss_reduction-avg", ValueError, r"loss_reduction must be one of 'mean', 'sum', got 'avg'")(
    lambda: rt.replicate(lambda a: a, loss_reduction="avg"))
case("loss_reduction-none", ValueError, r"loss_reduction must be one of 'mean', 'sum', got None")(
    lambda: rt.replicate(lambda a: a, loss_reduction=None))
case("options-dict", TypeError, r"options must be an rt.RunOptions, got dict; write rt.RunOptions\(\*\*\{'verify': True\}\)")(
    lambda: rt.replicate(lambda a: a, options={"verify": True}))
case("options-string", TypeError, r"options must be an rt.RunOptions, got str")(
    lambda: rt.replicate(lambda a: a, options="fast"))
case("steps_per_call-zero", ValueError, r"steps_per_call must be a positive int, got 0")(
    lambda: rt.replicate(lambda a: a, steps_per_call=0))
case("steps_per_call-bool", TypeError, r"steps_per_call must be a positive int, got True \(bool\)")(
    lambda: rt.replicate(lambda a: a, steps_per_call=True))
case("donate-string", TypeError, r"donate must be True or False, got 'yes' \(str\)")(
    lambda: rt.replicate(lambda a: a, donate="yes"))
case("step_outputs-median", ValueError, r"step_outputs must be one of .* got 'median'")(
    lambda: rt.replicate(lambda a: a, step_outputs="median"))
case("dynamic-steps_per_call", NotImplementedError, r"dynamic_shapes=True\) with steps_per_call > 1")(
    lambda: rt.replicate(lambda s, a: (s, a), steps_per_call=2, options=rt.RunOptions(dynamic_shapes=True)))
case("dynamic-donate", NotImplementedError, r"dynamic_shapes=True\) with donate=True")(
    lambda: rt.replicate(lambda a: a, donate=True, options=rt.RunOptions(dynamic_shapes=True)))

# -- RunOptions(...) --------------------------------------------------------------------------
case("opts-dump_dir-int", TypeError, r"dump_dir must be a directory path \(str\) or None, got 5 \(int\)")(
    lambda: rt.RunOptions(dump_dir=5))
case("opts-cache_dir-list", TypeError, r"cache_dir must be a directory path \(str\) or None, got \['a'\] \(list\)")(
    lambda: rt.RunOptions(cache_dir=["a"]))
case("opts-bucketing-without-dynamic", ValueError, r"bucketing='pow3' is set but dynamic_shapes is False")(
    lambda: rt.RunOptions(bucketing="pow3"))
case("opts-bucketing-pow3", ValueError, r"bucketing=\.\.\.\) must be 'pow2', 'none', 'auto'.* got 'pow3'")(
    lambda: rt.RunOptions(dynamic_shapes=True, bucketing="pow3"))
case("opts-bucketing-empty-list", ValueError, r"bucketing=\.\.\.\): a list of positive sizes, got \[\]")(
    lambda: rt.RunOptions(dynamic_shapes=True, bucketing=[]))
case("opts-bucket_bytes-negative", ValueError, r"bucket_bytes must be >= 0 \(0: off\), got -1")(
    lambda: rt.RunOptions(bucket_bytes=-1))
case("opts-bucket_bytes-string", TypeError, r"bucket_bytes must be an int \(0: off\), got '1MB' \(str\)")(
    lambda: rt.RunOptions(bucket_bytes="1MB"))
case("opts-max_compiles_warning-str", TypeError, r"max_compiles_warning must be a positive int, got 'x' \(str\)")(
    lambda: rt.RunOptions(max_compiles_warning="x"))
case("opts-max_compiles_warning-zero", ValueError, r"max_compiles_warning must be a positive int, got 0")(
    lambda: rt.RunOptions(max_compiles_warning=0))
case("opts-verify-string", TypeError, r"verify must be True, False, 'each' or 'end', got 'no' \(str\)")(
    lambda: rt.RunOptions(verify="no"))
case("opts-dynamic_shapes-string", TypeError, r"dynamic_shapes must be True or False, got 'yes' \(str\)")(
    lambda: rt.RunOptions(dynamic_shapes="yes"))
case("opts-pipeline-unknown-pass", ValueError, r"pipeline='replication,foo': unknown pass 'foo'; known passes: .*dce")(
    lambda: rt.RunOptions(pipeline="replication,foo"))
case("opts-pipeline-not-string", TypeError, r"pipeline must be a string .* got \['dce'\]")(
    lambda: rt.RunOptions(pipeline=["dce"]))
case("opts-maximum_shapes-without-dynamic", ValueError, r"maximum_shapes is set but dynamic_shapes is False")(
    lambda: rt.RunOptions(maximum_shapes=[(8,)]))
case("opts-dynamic_dims-without-dynamic", ValueError, r"dynamic_dims is set but dynamic_shapes is False")(
    lambda: rt.RunOptions(dynamic_dims={0: (0,)}))
case("opts-dynamic_dims-list", ValueError, r"dynamic_dims=\.\.\.\) must be a dict \{arg_index: axes\}, got \[0\]")(
    lambda: rt.RunOptions(dynamic_shapes=True, dynamic_dims=[0]))

# -- arguments and results of a step ---------------------------------------------------------
case("arg-string", TypeError, r"step argument args\[1\] is the string 'hello'; step arguments must be arrays")(
    lambda: _step(lambda a, b: a)(X, "hello"))
case("arg-string-kwarg-hints-static", TypeError, r"step argument args\[1\]\['mode'\] is the string "
     r"'eval'; .*a setting that selects code .* static_argnums=\.\.\.\) or static_argnames")(
    lambda: _step(lambda a, mode="train": a)(X, mode="eval"))
case("arg-dict-string-leaf", TypeError, r"step argument args\[1\]\['x'\] is the string 's'")(
    lambda: _step(lambda a, b: a)(X, {"x": "s"}))
case("arg-object", TypeError, r"step argument args\[0\] is an instance of builtins.object|step argument args\[0\] is an object")(
    lambda: _step(lambda a: a)(object()))
case("arg-list-of-strings", TypeError, r"step argument args\[0\]\[1\] is the string 'b'")(
    lambda: _step(lambda a: a)([1.0, "b"]))
case("arg-nested-per-replica", TypeError, r"args\[0\], replica 0's value is a PerReplica inside a PerReplica")(
    lambda: _step(lambda a: a)(rt.PerReplica([rt.PerReplica([X, X]), X])))
case("arg-per-replica-string", TypeError, r"step argument args\[0\], replica 1's value is the string 'x'")(
    lambda: _step(lambda a: a)(rt.PerReplica([X, "x"])))
case("arg-per-replica-wrong-count", ValueError, r"PerReplica argument \(leaf 0 of the arguments\) has 3 values but the step runs on 2 replicas")(
    lambda: _step(lambda a: a)(rt.PerReplica([X, X, X])))
case("arg-per-replica-shapes-differ", ValueError, r"replica 1's leaf 0 has shape \(5, 3\) and dtype float32 but replica 0's has shape \(4, 3\)")(
    lambda: _step(lambda a: a)(rt.PerReplica([X, np.ones((5, 3), np.float32)])))
case("arg-per-replica-dtypes-differ", ValueError, r"replica 1's leaf 0 has shape \(4, 3\) and dtype int32 but replica 0's has shape \(4, 3\) and dtype float32")(
    lambda: _step(lambda a: a)(rt.PerReplica([X, X.astype(np.int32)])))
case("arg-per-replica-structure-differs", ValueError, r"replica 1's value has structure .* but replica 0's has")(
    lambda: _step(lambda a: a)(rt.PerReplica([{"x": X}, {"y": X}])))
case("result-string", TypeError, r"the step <lambda> returned the string 's' as its result; a step must return arrays")(
    lambda: _step(lambda a: "s")(X))
case("result-dict-object", TypeError, r"returned an instance of builtins.object|returned an object .* at result\['o'\]")(
    lambda: _step(lambda a: {"o": object(), "a": a})(X))
case("kwargs-to-step", TypeError, r"unexpected keyword argument 'lr'|keyword argument")(
    lambda: _step(lambda a: a)(X, lr=0.1))
case("compiled-wrong-shape", TypeError, r"argument leaf 0: the compiled step takes float32\[4, 3\] but was called with float32\[5, 3\]")(
    lambda: _step(lambda a: a).lower(X).compile()(np.ones((5, 3), np.float32)))
case("compiled-wrong-structure", TypeError, r"the compiled step takes arguments of structure")(
    lambda: _step(lambda a: a).lower(X).compile()((X, X)))


def _donate_twice():
    s = _step(lambda st, b: (st * 2, b), donate=True)
    a = jnp.ones(3)
    return s(a, a)


case("donate-same-array-twice", ValueError, r"argument leaves 0 and 1 are the same array, and leaf 0 is donated")(
    _donate_twice)


# -- distribute / reduce / PerReplica ---------------------------------------------------------
case("distribute-not-divisible", ValueError, r"distribute: the batch has shape \(4, 3\): 4 rows on axis 0 are not divisible by 3 replicas")(
    lambda: rt.distribute(X, 3))
case("distribute-scalar", ValueError, r"distribute: the batch is a scalar; it has no axis 0 to split over 2 replicas")(
    lambda: rt.distribute(np.float32(1), 2))
case("distribute-float-count", ValueError, r"distribute: num_replicas must be a positive int, got 2\.0")(
    lambda: rt.distribute(X, 2.0))
case("distribute-leaf-not-divisible", ValueError, r"distribute: leaf \['y'\] has shape \(3,\)")(
    lambda: rt.distribute({"x": X, "y": np.ones(3)}, 2))
case("per-replica-unpack", TypeError, r"a PerReplica cannot be iterated or unpacked \(it holds 2 replicas' values")(
    lambda: (lambda a, b: None)(*rt.distribute((X, X), 2)))
case("per-replica-list", TypeError, r"cannot be iterated or unpacked")(
    lambda: list(rt.distribute(X, 2)))
case("reduce-op-prod", ValueError, r"reduce: op must be one of \('sum', 'mean', 'max', 'min'\), got 'prod'")(
    lambda: rt.reduce("prod", rt.PerReplica([X, X])))
case("reduce-shapes-differ", ValueError, r"reduce: replica 1's value has shape \(4,\) but replica 0's has \(3,\)")(
    lambda: rt.reduce("sum", rt.PerReplica([np.ones(3), np.ones(4)])))
case("reduce-strings", TypeError, r"reduce: replica 0's value is <U1 .*only numbers can be reduced")(
    lambda: rt.reduce("sum", rt.PerReplica([np.array(["a"]), np.array(["b"])])))
case("reduce-axis-out-of-range", ValueError, r"reduce: axis 2 is out of range for per-replica values of shape \(3,\) \(rank 1\)")(
    lambda: rt.reduce("sum", rt.PerReplica([np.ones(3), np.ones(3)]), axis=2))
case("reduce-sum-unknown-replicas", ValueError, r"reduce: value \(shape \(3,\)\) is not a PerReplica nor the result of a replicated step.*num_replicas=N")(
    lambda: rt.reduce("sum", np.ones(3)))
case("reduce-num_replicas-zero", ValueError, r"reduce: num_replicas must be a positive int, got 0")(
    lambda: rt.reduce("sum", np.ones(3), num_replicas=0))
case("distribute_steps-bad-shape", ValueError, r"distribute_steps: a leaf of shape \(4, 3\) is not \[k, B, \.\.\.\] with B divisible by 2")(
    lambda: rt.distribute_steps(np.ones((4, 3)), 2))
case("distribute_iterator-prefetch", ValueError, r"distribute_iterator: prefetch must be a positive int, got -1")(
    lambda: rt.distribute_iterator([X], num_replicas=2, prefetch=-1))
case("distribute_iterator-no-count", ValueError, r"distribute_iterator: give num_replicas, mesh= or step=")(
    lambda: rt.distribute_iterator([X]))
case("distribute_values_from_function-zero", ValueError, r"num_replicas must be a positive int, got 0")(
    lambda: rt.distribute_values_from_function(lambda ctx: ctx.replica_id, 0))
case("sync_on_read-aggregation", ValueError, r"SyncOnRead: aggregation must be one of \('sum', 'mean', 'only_first_replica'\), got 'max'")(
    lambda: rt.SyncOnRead({"a": 0}, aggregation="max", num_replicas=2))
case("sync_on_read-no-count", ValueError, r"SyncOnRead: num_replicas must be a positive int when init is not a PerReplica, got None")(
    lambda: rt.SyncOnRead({"a": 0}))

# -- inside the step, outside it ---------------------------------------------------------------
case("replica_id-outside", RuntimeError, r"replica_id\(\) can only be called inside a function run by replicate\(\)")(
    lambda: rt.replica_id())
case("num_replicas-outside", RuntimeError, r"num_replicas\(\) can only be called inside")(
    lambda: rt.num_replicas())
case("all_reduce-outside", RuntimeError, r"all_reduce\(\) can only be called inside")(
    lambda: rt.all_reduce(X))
case("local-outside", RuntimeError, r"local\(\) can only be called inside")(lambda: rt.local(X))
case("split-outside", RuntimeError, r"split_to_logical_devices\(\) can only be called inside")(
    lambda: rt.split_to_logical_devices(X, [1, 1]))
case("assign-outside", RuntimeError, r"assign_to_logical_device\(\) can only be called inside")(
    lambda: rt.assign_to_logical_device(X, 0))


# trace-time mistakes: the message names this file and the line of the call
def _split_float(a):
    return rt.split_to_logical_devices(a, [1.5, 2])


def _split_int(a):
    return rt.split_to_logical_devices(a, 2)


def _split_rank(a):
    return rt.split_to_logical_devices(a, [2])


def _split_indivisible(a):
    return rt.split_to_logical_devices(a, [1, 2])  # 3 columns


def _split_product(a):
    return rt.split_to_logical_devices(a, [2, 2])


def _split_negative(a):
    return rt.split_to_logical_devices(a, [-1, 2])


def _assign_range(a):
    return rt.assign_to_logical_device(a, 5)


def _assign_bool(a):
    return rt.assign_to_logical_device(a, True)


def _all_reduce_prod(a):
    return rt.all_reduce(a, "prod")


def _all_gather_axis(a):
    return rt.all_gather(a, axis=3)


def _all_to_all_axis(a):
    return rt.all_to_all(a, 5, 0)


def _all_to_all_indivisible(a):
    return rt.all_to_all(a, 1, 0)  # 3 columns over 2 replicas


def _local_string(a):
    return rt.local("weights")


def _per_replica_branch_collective(w, x):
    return lax.cond(x[0, 0] > 0, lambda h: h + rt.all_reduce(h, "sum"), lambda h: h * 2.0, x @ w)


def _per_replica_while_collective(w, x):
    return lax.while_loop(lambda s: s[0] < x[0, 0], lambda s: (s[0] + 1, s[1] - rt.all_reduce(s[1], "mean")),
                          (0.0, x @ w))[1]


TRACE_CASES = [
    ("split-float-dims", _split_float, (X,), 2, TypeError,
     r"partition_dimensions must be a list of ints, .* got \[1\.5, 2\]", "[1.5, 2]"),
    ("split-int-dims", _split_int, (X,), 2, TypeError,
     r"partition_dimensions must be a list of ints, .* got 2", "(a, 2)"),
    ("split-wrong-rank", _split_rank, (X,), 2, ValueError,
     r"partition_dimensions \[2\] has length 1 but the tensor has rank 2", "[2]"),
    ("split-indivisible", _split_indivisible, (X,), 2, ValueError,
     r"dimension 1 of size 3 is not divisible by its split 2", "[1, 2]"),
    ("split-product-mismatch", _split_product, (np.ones((4, 4), np.float32),), 2, ValueError,
     r"product of partition_dimensions \[2, 2\] is 4 but the replica has 2 logical devices", "[2, 2]"),
    ("split-negative", _split_negative, (X,), 2, ValueError,
     r"non-positive entry -1 at dimension 0", "[-1, 2]"),
    ("assign-out-of-range", _assign_range, (X,), 2, ValueError,
     r"logical device 5 is outside \[0, 2\) for a replica of 2 logical devices", "(a, 5)"),
    ("assign-bool", _assign_bool, (X,), 2, ValueError,
     r"logical device True is outside", "True"),
    ("all_reduce-op", _all_reduce_prod, (X,), 1, ValueError,
     r"all_reduce: op must be one of \['max', 'mean', 'min', 'sum'\], got 'prod'", '"prod"'),
    ("all_gather-axis", _all_gather_axis, (X,), 1, ValueError,
     r"all_gather: axis 3 is out of range for a value of shape \(4, 3\) \(rank 2\)", "axis=3"),
    ("all_to_all-axis", _all_to_all_axis, (X,), 1, ValueError,
     r"all_to_all: split_axis 5 is out of range for a value of shape \(4, 3\) \(rank 2\)", "(a, 5, 0)"),
    ("all_to_all-indivisible", _all_to_all_indivisible, (X,), 1, ValueError,
     r"all_to_all: split_axis 1 has size 3, not divisible by 2 replicas", "(a, 1, 0)"),
    ("local-string", _local_string, (X,), 1, TypeError,
     r"local: leaves must be arrays or numbers, got str", '"weights"'),
]


@pytest.mark.parametrize("thunk, exc, pattern", CASES)
def test_mistake_gets_a_clear_error(thunk, exc, pattern):
    with pytest.raises(exc) as e:
        thunk()
    assert re.search(pattern, str(e.value)), f"message {str(e.value)!r} does not match {pattern!r}"


@pytest.mark.parametrize("name, fn, args, k, exc, pattern, marker", TRACE_CASES,
                         ids=[c[0] for c in TRACE_CASES])
def test_trace_time_mistake_names_the_users_line(name, fn, args, k, exc, pattern, marker):
    step = rt.replicate(fn, num_replicas=2, logical_devices=k)
    with pytest.raises(exc) as e:
        step(*args)
    msg = str(e.value)
    assert re.search(pattern, msg), f"message {msg!r} does not match {pattern!r}"
    assert f"{HERE}:{_line(fn, marker)}" in msg, f"{HERE}:{_line(fn, marker)} not in {msg!r}"


@pytest.mark.parametrize("fn, coll, ctl", [
    (_per_replica_branch_collective, 'rt.all_reduce(h, "sum")', "lax.cond("),
    (_per_replica_while_collective, 'rt.all_reduce(s[1], "mean")', "lax.while_loop("),
], ids=["cond", "while"])
def test_divergent_collective_names_both_lines(fn, coll, ctl):
    with pytest.raises(DivergentCollectiveError) as e:
        rt.replicate(fn, num_replicas=2)(np.ones((3, 3), np.float32), rt.distribute(np.ones((4, 3), np.float32), 2))
    assert f"{HERE}:{_line(fn, coll)}" in str(e.value) and f"{HERE}:{_line(fn, ctl)}" in str(e.value)


def test_gradient_taken_inside_a_per_replica_branch_says_how_to_take_it():
    """``jax.grad`` of a mirrored weight inside a ``lax.cond`` whose predicate differs
    between replicas: the gradient's all-reduce (JAX's transpose of the weight's
    broadcast) would run in one branch only. The error names the cond and says to take
    the gradient outside it or of ``rt.local(weights)``; the latter gives each replica's
    own gradient (oracle: ``jax.grad`` on each replica's data)."""
    def loss(w, x):
        return jnp.sum(jnp.tanh(x * w) ** 2)

    def branchy(view):
        return lambda w, x, i: jax.lax.cond(i > 0, lambda: jax.grad(loss)(view(w), x),
                                            lambda: -jax.grad(loss)(view(w), x))
    w = np.linspace(-1, 1, 3).astype(np.float32)
    xs = [np.full((3,), 0.5, np.float32), np.full((3,), 2.0, np.float32)]
    args = (w, rt.PerReplica(xs), rt.PerReplica([np.int32(0), np.int32(1)]))
    with pytest.raises(DivergentCollectiveError, match=r"inside a lax.cond/switch whose index "
                       r"differs between replicas \(cond \(test_bad_inputs.py:\d+\)\).*gradient "
                       r"of a mirrored value .* take the gradient outside it .*rt\.local"):
        rt.replicate(branchy(lambda w: w), num_replicas=2)(*args)
    got = rt.replicate(branchy(rt.local), num_replicas=2)(*args)
    for r, (x, sign) in enumerate(zip(xs, (-1, 1))):
        np.testing.assert_allclose(np.asarray(got.values[r]), sign * jax.grad(loss)(w, x),
                                   rtol=1e-6)


# -- dynamic shapes --------------------------------------------------------------------------
def _dyn(fn=lambda a: a, **opts):
    return rt.replicate(fn, num_replicas=2, options=rt.RunOptions(dynamic_shapes=True, **opts))


DYN = [np.ones((3, 2), np.float32), np.ones((5, 2), np.float32)]
case("dyn-maximum_shapes-too-many", ValueError, r"maximum_shapes=\.\.\.\) has 2 entries but the step was called with 1 arguments")(
    lambda: _dyn(maximum_shapes=[None, None])(rt.PerReplica(DYN)))
case("dyn-maximum_shapes-mirrored", ValueError, r"maximum_shapes=\.\.\.\): entry 0 bounds argument 0, which is mirrored")(
    lambda: _dyn(lambda a, b: b, maximum_shapes=[(8, 2)])(X, rt.PerReplica(DYN)))
case("dyn-maximum_shapes-exceeded", ValueError, r"replica 1 has size 5 along dynamic axis 0, larger than its bound 4 in maximum_shapes")(
    lambda: _dyn(maximum_shapes=[(4, None)])(rt.PerReplica(DYN)))
case("dyn-dynamic_dims-mirrored", ValueError, r"dynamic_dims=\.\.\.\): argument 0 is mirrored \(not a PerReplica\)")(
    lambda: _dyn(lambda a, b: b, dynamic_dims={0: (0,)})(X, rt.PerReplica(DYN)))
case("dyn-dynamic_dims-bad-axis", ValueError, r"dynamic_dims=\{0: \(5,\)\}\): axis 5 is out of range for leaf 0 of argument 0, which has rank 2")(
    lambda: _dyn(dynamic_dims={0: (5,)})(rt.PerReplica(DYN)))
case("dyn-dynamic_dims-bad-index", ValueError, r"dynamic_dims=\.\.\.\): key 3 is not an argument index of a call with 1 arguments")(
    lambda: _dyn(dynamic_dims={3: (0,)})(rt.PerReplica(DYN)))
case("dyn-lower-shape-dtype-structs", TypeError, r"PerReplica argument 0 leaf 0 of replica 0 is a jax.ShapeDtypeStruct; .* need arrays")(
    lambda: _dyn().lower(rt.PerReplica([jax.ShapeDtypeStruct((4, 2), jnp.float32)] * 2)))
case("dyn-static-dims-differ", ValueError, r"replica 1's value has shape \(5, 3\) .* replica 0's has \(3, 2\).*only the dynamic axes \[0\] may differ")(
    lambda: _dyn()(rt.PerReplica([np.ones((3, 2), np.float32), np.ones((5, 3), np.float32)])))
case("dyn-bucket-list-exceeded", ValueError, r"dynamic size 5 exceeds the largest bucket 4 of RunOptions\(bucketing=\[2, 4\]\)")(
    lambda: _dyn(bucketing=[2, 4])(rt.PerReplica(DYN)))
case("dyn-bucketing-none-without-bound", ValueError, r"bucketing='none'\) pads to the bound and needs maximum_shapes")(
    lambda: _dyn(bucketing="none")(rt.PerReplica(DYN)))


# -- steps per call ------------------------------------------------------------------------------
case("steps-not-stacked", ValueError, r"per-replica input leaf 0 of argument leaf 0 after the state has shape \(4, 3\); each replica's value must stack the 3 steps.*belongs in the state")(
    lambda: rt.replicate(lambda s, b: (s, b), num_replicas=2, steps_per_call=3)(jnp.ones(2), rt.distribute(np.ones((8, 3), np.float32), 2)))
case("steps-returns-not-pair", TypeError, r"steps_per_call=2\): the step must return \(state, outputs\), got ArrayImpl|got DynamicJaxprTracer|got")(
    lambda: rt.replicate(lambda s, b: s, num_replicas=2, steps_per_call=2)(jnp.ones(2), rt.distribute_steps([X, X], 2)))
case("steps-state-structure", TypeError, r"steps_per_call=2\): the step returned a state of structure")(
    lambda: rt.replicate(lambda s, b: ((s, s), b), num_replicas=2, steps_per_call=2)(jnp.ones(2), rt.distribute_steps([X, X], 2)))
case("steps-state-dtype", TypeError, r"state leaf state as float32\[2\] but took it as int32\[2\]")(
    lambda: rt.replicate(lambda s, b: (s * 0.5, b), num_replicas=2, steps_per_call=2)(jnp.ones(2, jnp.int32), rt.distribute_steps([X, X], 2)))
case("steps-no-arguments", TypeError, r"steps_per_call=2\): the step takes no arguments")(
    lambda: rt.replicate(lambda: (1, 2), num_replicas=2, steps_per_call=2)())


# -- the IR text (the contract of dumps and reproducers) ------------------------------------------
def _parse(text):
    from ir.parser import parse
    return parse(textwrap.dedent(text).lstrip())


case("ir-unknown-dtype", IRParseError, r"line 1, column 12: bad type: unknown dtype 'f99'")(
    lambda: _parse("func @f(%0: f99[2]) {\n  return %0\n}\n"))
case("ir-unknown-op", IRParseError, r"line 2, column 16: unknown op 'frobnicate'")(
    lambda: _parse("func @f(%0: f32[2]) {\n  %1: f32[2] = frobnicate(%0)\n  return %1\n}\n"))
case("ir-binary-op-one-operand", IRParseError, r"line 2, column 16: add takes 2 operands but has 1")(
    lambda: _parse("func @f(%0: f32[2]) {\n  %1: f32[2] = add(%0)\n  return %1\n}\n"))
case("ir-unary-op-two-operands", IRParseError, r"line 2, column 16: tanh takes 1 operand but has 2")(
    lambda: _parse("func @f(%0: f32[2]) {\n  %1: f32[2] = tanh(%0, %0)\n  return %1\n}\n"))
case("ir-undefined-value", IRParseError, r"line 2, column 21: %7 is used before it is defined")(
    lambda: _parse("func @f(%0: f32[2]) {\n  %1: f32[2] = tanh(%7)\n  return %1\n}\n"))
case("ir-bad-sharding", IRParseError, r"line 1, column 12: bad type: tiled sharding: product of tile dims \(2,\) is 2 but 1 devices")(
    lambda: _parse("func @f(%0: f32[2] mirrored {devices=[2]0}) {\n  return %0\n}\n"))
case("ir-missing-return", IRParseError, r"line 3")(
    lambda: _parse("func @f(%0: f32[2]) {\n  %1: f32[2] = tanh(%0)\n}\n"))
case("ir-empty", IRParseError, r"line 1: empty text")(lambda: _parse(""))


def _verify_op(name, n_operands):
    from ir.graph import Graph, Op, Value
    from ir.types import TensorType
    from ir.verifier import verify
    t = TensorType((2,), "float32")
    xs = tuple(Value(t) for _ in range(n_operands))
    r = Value(t)
    verify(Graph(xs, (Op(name, xs, (r,)),), (r,)))


case("verify-unknown-op", IRVerifyError, r"frobnicate: unknown op")(lambda: _verify_op("frobnicate", 1))
case("verify-arity", IRVerifyError, r"mul: mul takes 2 operands but has 3")(lambda: _verify_op("mul", 3))
case("type-unknown-dtype", IRTypeError, r"unknown dtype 'f99'")(
    lambda: __import__("ir.types", fromlist=["x"]).TensorType((2,), "f99"))


# -- the command-line tools: one line on stderr, status 2 -----------------------------------------
MODEL = '''
import numpy as np
import jax.numpy as jnp
import runtime as rt
NOT_A_FUNCTION = 5
def step(w, x):
    return w - 0.1 * jnp.mean(x)
def make_args(num_replicas):
    return (np.ones(3, np.float32), rt.distribute(np.ones((num_replicas * 2, 3), np.float32), num_replicas))
def make_args_three(num_replicas):
    return (np.ones(3, np.float32), rt.distribute(np.ones((6, 3), np.float32), 3))
def make_args_positional(n):
    return ()
def make_args_raises(num_replicas):
    raise KeyError("no such dataset")
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "m.py").write_text(MODEL)
    (d / "blocked").write_text("a file in the way")
    cache = d / "cache" / "rt"
    cache.mkdir(parents=True)
    (cache / "last_miss.json").write_text("{not json")
    cache2 = d / "cache2" / "rt"
    cache2.mkdir(parents=True)
    (cache2 / "last_miss.json").write_text('{"function": 3}')
    (d / "script.py").write_text("print('hi')\n")
    return d


CLI = [
    ("inspect-not-a-function", "tools.inspect", ["m.py:NOT_A_FUNCTION", "--args", "m.py:make_args", "--replicas", "2", "--out", "o"],
     r"inspect: error: m.py:NOT_A_FUNCTION is a int \(5\), not a function"),
    ("inspect-no-such-function", "tools.inspect", ["m.py:nothere", "--args", "m.py:make_args", "--replicas", "2", "--out", "o"],
     r"inspect: error: .*m.py has no function 'nothere'"),
    ("inspect-no-such-file", "tools.inspect", ["nofile.py:step", "--args", "m.py:make_args", "--out", "o"],
     r"inspect: error: nofile.py: no such file"),
    ("inspect-make_args-wrong-replicas", "tools.inspect", ["m.py:step", "--args", "m.py:make_args_three", "--replicas", "2", "--out", "o"],
     r"inspect: error: --args: make_args_three\(\) gave args\[1\] as a PerReplica of 3 values but --replicas is 2"),
    ("inspect-make_args-positional", "tools.inspect", ["m.py:step", "--args", "m.py:make_args_positional", "--out", "o"],
     r"inspect: error: --args: make_args_positional\(\) requires n"),
    ("inspect-make_args-raises", "tools.inspect", ["m.py:step", "--args", "m.py:make_args_raises", "--out", "o"],
     r"inspect: error: KeyError: 'no such dataset' \(--debug shows the traceback\)"),
    ("inspect-unknown-pass", "tools.inspect", ["m.py:step", "--args", "m.py:make_args", "--replicas", "2", "-p", "replication,foo", "--out", "o"],
     r"inspect: error: ValueError: RunOptions: pipeline='replication,foo': unknown pass 'foo'"),
    ("inspect-unwritable-out", "tools.inspect", ["m.py:step", "--args", "m.py:make_args", "--out", "blocked/sub"],
     r"inspect: error: --out blocked/sub: cannot create it"),
    ("inspect-zero-replicas", "tools.inspect", ["m.py:step", "--args", "m.py:make_args", "--replicas", "0", "--out", "o"],
     r"inspect: error: --replicas and --logical-devices must be positive, got 0 and 1"),
    ("inspect-missing-args", "tools.inspect", ["m.py:step", "--out", "o"],
     r"inspect: error: --args FILE.py:MAKE_ARGS is required"),
    ("cache-corrupt-metadata", "tools.cache", ["explain", "cache"],
     r"cache: error: .*last_miss.json is unreadable or incomplete \(JSONDecodeError"),
    ("cache-incomplete-metadata", "tools.cache", ["explain", "cache2"],
     r"cache: error: .*last_miss.json is unreadable or incomplete"),
    ("cache-no-cache", "tools.cache", ["list", "nowhere"],
     r"cache: error: nowhere holds no persistent cache \(no rt/ folder\)"),
    ("launch-negative-devices", "tools.launch", ["--devices-per-process", "-3", "-n", "2", "script.py"],
     r"error: --devices-per-process must be >= 0 \(0: leave XLA_FLAGS alone\), got -3"),
    ("launch-negative-timeout", "tools.launch", ["--timeout", "-1", "-n", "2", "script.py"],
     r"error: --timeout must be a positive number of seconds, got -1.0"),
    ("launch-zero-processes", "tools.launch", ["-n", "0", "script.py"], r"error: -n must be at least 1, got 0"),
    ("launch-no-script", "tools.launch", ["-n", "2", "missing.py"], r"error: missing.py: no such file"),
    ("ir-not-a-folder", "tools.ir", ["show", "nonexistent"], r"ir: error: nonexistent: not a folder"),
    ("ir-unknown-command", "tools.ir", ["frob"], r"error: argument COMMAND: invalid choice: 'frob'"),
]


@pytest.mark.parametrize("module, argv, pattern", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli_mistake_is_one_line_and_status_2(model_dir, module, argv, pattern):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", module, *argv], cwd=model_dir, capture_output=True,
                       text=True, env=env, timeout=120)
    err = p.stderr.strip()
    assert p.returncode == 2, (p.returncode, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert re.search(pattern, err), f"{err!r} does not match {pattern!r}"


def test_cli_debug_shows_the_traceback(model_dir):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "tools.inspect", "m.py:step", "--args",
                        "m.py:make_args_raises", "--out", "o", "--debug"], cwd=model_dir,
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0 and "Traceback" in p.stderr and "no such dataset" in p.stderr


def test_there_are_at_least_a_hundred_cases():
    assert len(CASES) + len(TRACE_CASES) + 2 + len(CLI) >= 100


# -- dynamic shapes: what padding cannot make exact names the op and the user's line ----------
def _dyn_flip(x):
    return jnp.flip(x, axis=0)


def _dyn_convolve(x):
    return jnp.convolve(x, jnp.ones(3))


def _dyn_split_odd_bucket(x):
    return rt.split_to_logical_devices(x, [2, 1]) * 2


def _dyn_concat(x):
    return jnp.concatenate([x, x])


def _dyn_strided(x):
    return x[::2] * 2


DYN_TRACE = [
    ("flip", _dyn_flip, 1, {}, ValueError,
     r"padding: rev reverses padded axis 0 \(dim b\), which would move the padding to the front", "jnp.flip"),
    ("convolve", _dyn_convolve, 1, {}, TypeError,
     r"dynamic shapes: tracing _dyn_convolve at .* needs a concrete size where the dynamic dim\(s\) b are symbolic", "jnp.convolve"),
    ("split-odd-bucket", _dyn_split_odd_bucket, 2, {"bucketing": [3, 5]}, ValueError,
     r"splits padded axis 0 \(dim b\) 2 ways, but its bucket 5 is not divisible by 2", "[2, 1]"),
    ("concatenate", _dyn_concat, 1, {}, ValueError,
     r"concatenate has a value of type f32\[_2_times_b.* whose dim 2\*b mixes padded and real elements", "jnp.concatenate"),
    # (x[1:] - x[:-1], a dim b - 1, is exact: tests/test_dynamic.py, "cut by a constant")
    ("slice-strided", _dyn_strided, 1, {}, ValueError,
     r"whose dim floordiv\(b \+ 1, 2\) mixes padded and real elements \(.*strided.*x\[::2\]",
     "x[::2]"),
]


@pytest.mark.parametrize("name, fn, k, opts, exc, pattern, marker", DYN_TRACE, ids=[c[0] for c in DYN_TRACE])
def test_dynamic_shape_mistake_names_the_op_and_line(name, fn, k, opts, exc, pattern, marker):
    step = rt.replicate(fn, num_replicas=2, logical_devices=k,
                        options=rt.RunOptions(dynamic_shapes=True, **opts))
    xs = [np.ones((3, 4), np.float32), np.ones((5, 4), np.float32)] if k > 1 else \
        [np.arange(3, dtype=np.float32), np.arange(5, dtype=np.float32)]
    with pytest.raises(exc) as e:
        step(rt.PerReplica(xs))
    msg = str(e.value)
    assert re.search(pattern, msg), f"{msg!r} does not match {pattern!r}"
    assert f"{HERE}:{_line(fn, marker)}" in msg, msg


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after a call"])
def test_disable_jit_is_a_clear_error(warm):
    """Under ``jax.disable_jit()`` a step says why it cannot run eagerly (JAX's own error
    named a ``jit(body)`` the user never wrote), before and after a compiled call, and the
    step works again once the context ends."""
    step = rt.replicate(lambda w, x: jnp.sum(x @ w), num_replicas=2)
    step.__name__ = "my_step"
    w, x = np.ones((3, 3), np.float32), rt.PerReplica([np.ones((2, 3), np.float32)] * 2)
    if warm:
        step(w, x)
    with jax.disable_jit():
        for call in (lambda: step(w, x), lambda: step.lower(w, x)):
            with pytest.raises(RuntimeError, match=r"my_step: jax.disable_jit\(\) is on.*2 replicas"):
                call()
    np.testing.assert_allclose(rt.reduce("sum", step(w, x)), 36.0)


def test_an_error_of_the_first_call_is_not_chained_to_the_fast_paths_miss():
    """The first call's error (here the step's own AttributeError) is raised outside the
    fast path's handler: before, every such traceback began with an unrelated
    ``TypeError: 'NoneType' object is not callable`` and "During handling of the above
    exception, another exception occurred"."""
    import traceback
    step = rt.replicate(lambda x: x.undefined_attr, num_replicas=2)
    with pytest.raises(AttributeError) as e:
        step(rt.distribute(np.ones((4, 2), np.float32), 2))
    text = "".join(traceback.format_exception(e.value))
    assert "'NoneType' object is not callable" not in text
    assert "During handling of the above exception" not in text


def test_a_step_that_changes_an_argument_in_place_without_returning_it_is_an_error():
    """The step gets copies of its arguments (as under ``jax.jit``): a change it makes to
    one in place and does not return is lost, and the next call starts from the old value
    without an error. That is a ``TypeError`` naming the leaf; a change the step also
    returns is its result, allowed (its numbers checked); so is a step that changes none."""
    def forgets(state, x):
        state["w"] = state["w"] - 0.1 * jnp.mean(x)     # written into the argument only
        return jnp.sum(x)

    def returns_it(state, x):
        state["w"] = state["w"] - 0.1 * jnp.mean(x)
        return state

    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    state = {"w": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}
    with pytest.raises(TypeError, match=r"the step forgets changed args\[0\]\['w'\] in place, to "
                                        r"a value it does not return"):
        rt.replicate(forgets, num_replicas=2)(state, rt.distribute(x, 2))
    with pytest.warns(rt.DivergingStateWarning):  # (w now per replica: each one's own mean)
        out = rt.replicate(returns_it, num_replicas=2)(dict(state), rt.distribute(x, 2))
    np.testing.assert_allclose(np.stack([np.asarray(v) for v in out["w"].values]),
                               [np.ones(3) - 0.1 * x[:2].mean(), np.ones(3) - 0.1 * x[2:].mean()],
                               rtol=1e-6)
    with pytest.raises(TypeError, match=r"changed args\[0\]\['w'\] in place"):
        rt.replicate(forgets, num_replicas=2,
                     options=rt.RunOptions(dynamic_shapes=True))(state, rt.distribute(x, 2))


def test_an_nnx_jit_step_that_writes_back_unchanged_state_is_not_refused():
    """``nnx.jit`` writes its outputs back into the objects it was given, so a step that
    only reads an ``nnx.State`` (``nnx.merge(graphdef, state)(x)``) sees that state come
    back as new tracers of the same values: not a change (the argument check follows them
    through the jit call to the inputs), and the numbers are the model's."""
    from flax import nnx
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @nnx.jit
    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    got = rt.replicate(apply, num_replicas=2)(state, rt.distribute(x, 2))
    np.testing.assert_allclose(np.concatenate([np.asarray(v) for v in got.values]),
                               np.asarray(model(x)), rtol=1e-6)
