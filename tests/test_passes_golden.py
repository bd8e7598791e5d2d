"""Golden-text tests: parse an input graph (``tests/golden/NAME.in.txt``), run one pass,
compare the printed result with ``tests/golden/NAME.out.txt``.

``UPDATE_GOLDEN=1 pytest tests/test_passes_golden.py`` rewrites the expected files; read
the diff before committing it. Inputs we own give the same text on every JAX; the traced
step's golden may have a per-JAX copy (``tests.irtest.golden_path``)."""
from __future__ import annotations

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from compiler.errors import LoweringError
from compiler.pass_manager import PassManager, parse_pipeline
from compiler.trace import LeafSpec, trace_replica_fn
from ir.graph import Graph
from ir.parser import parse
from ir.printer import print_graph
from ir.types import Replica
from tests import golden_models
from tests.irtest import check_golden, check_roundtrip

GOLDEN = Path(__file__).parent / "golden"


def _compare(name: str, graph: Graph) -> str:
    return check_golden(f"{name}.out.txt", check_roundtrip(graph) + "\n")


# (golden name, input file, pipeline, options)
CASES = [
    ("replication_basic", "replication_basic", "replication", {}),
    ("replication_scan", "replication_scan", "replication", {}),
    ("replication_while", "replication_while", "replication", {}),
    ("replication_cond", "replication_cond", "replication", {}),
    ("dce", "dce", "dce", {}),
    ("crs_mean", "crs", "cross-replica-sum", {"loss_reduction": "mean", "num_replicas": 4}),
    ("crs_sum", "crs", "cross-replica-sum", {"loss_reduction": "sum", "num_replicas": 4}),
    # a bfloat16 gradient sum deferred through a backward scan to the cast back
    ("crs_defer", "crs_defer", "cross-replica-sum", {"loss_reduction": "sum", "num_replicas": 4}),
    # golden_models.stochastic_depth_step after replication: the gradient all-reduce of
    # ``u`` leaves the transposed per-replica branch (the branch returns its addend)
    ("hoist_cond", "hoist_cond", "hoist-collectives", {"num_replicas": 4}),
    # golden_models.rnn_step after replication: the all-reduce in every step of the
    # transposed scan becomes one after it; the carry that accumulates it turns varying
    ("hoist_scan", "hoist_scan", "hoist-collectives", {"num_replicas": 4}),
]


@pytest.mark.parametrize("name, src, pipeline, options", CASES, ids=[c[0] for c in CASES])
def test_one_pass_golden(name, src, pipeline, options):
    graph = parse((GOLDEN / f"{src}.in.txt").read_text())
    check_roundtrip(graph)
    passes = parse_pipeline(pipeline, **options)
    assert len(passes) == 1
    out = PassManager(passes, verify=True, dump_dir="").run(graph)
    _compare(name, out)


def _vals(graph: Graph):
    return {v: v.type.replica for op, _ in graph.walk() for v in op.results}


def test_replication_sets_every_value():
    """The pass contract, checked beside the golden text: no value is left unknown."""
    for src in ("replication_basic", "replication_scan", "replication_while", "replication_cond"):
        g = parse_pipeline("replication")[0].apply(parse((GOLDEN / f"{src}.in.txt").read_text()))
        values = [v for op, sub in g.walk() for v in (*op.results, *sub.inputs)] + list(g.inputs)
        assert all(v.type.replica is not None for v in values), src


def test_crs_applies_the_loss_reduction_only_at_loss_scale_markers():
    """Checked beside the golden text: no marker survives; the user's max all-reduce is
    untouched; gradient sums stay sums (marked); "mean" divides where reduction=1, "sum"
    multiplies only where replicas=1 and reduction does not cancel it."""
    graph = parse((GOLDEN / "crs.in.txt").read_text())
    outs = {}
    for red in ("mean", "sum"):
        g = PassManager(parse_pipeline("cross-replica-sum", loss_reduction=red, num_replicas=4),
                        dump_dir="").run(graph)
        assert not [op for op in g.ops if op.name == "loss_scale"]
        outs[red] = [op for op in g.ops if op.name == "all_reduce"]
        outs[red + "_scale"] = sorted(op.name for op in g.ops if op.name in ("mul", "div"))
    user_mean, *grads_mean = outs["mean"]
    user_sum, *grads_sum = outs["sum"]
    assert user_mean.attr("reduce") == user_sum.attr("reduce") == "max"
    assert user_mean.attr("gradient") is None
    for op in grads_mean + grads_sum:
        assert (op.attr("reduce"), op.attr("gradient")) == ("sum", True)
    # the user's own mul (%13) plus: mean: two divisions, one times N; sum: two times N
    assert outs["mean_scale"] == ["div", "div", "mul", "mul"]
    assert outs["sum_scale"] == ["mul", "mul", "mul"]


def test_pipeline_without_cross_replica_sum_is_an_error_not_a_sum():
    """Issue 10: a pipeline that leaves out the pass must not turn "mean" into "sum"."""
    import runtime as rt
    w = jnp.ones((3,))
    step = rt.replicate(lambda w, x: jax.grad(lambda w: jnp.sum(w * x))(w), num_replicas=2,
                        options=rt.RunOptions(pipeline="replication,sharding,dce"))
    with pytest.raises(LoweringError, match=r"no 'cross-replica-sum' pass"):
        step(w, rt.distribute(np.ones((4, 3), np.float32), 2))


# ------------------------------------------------------------------ a real traced step
def _traced_sgd():
    specs = [LeafSpec((4, 2), jnp.float32, False, False),   # w: mirrored
             LeafSpec((3, 4), jnp.float32, False, True),    # x: per replica
             LeafSpec((3, 2), jnp.float32, False, True)]    # y: per replica
    graph, _ = trace_replica_fn(golden_models.sgd_step, specs, num_replicas=2)
    return graph


def test_traced_sgd_step_golden():
    graph = _traced_sgd()
    check_roundtrip(graph)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step has no user all-reduce: no warning
        pm = PassManager(parse_pipeline("replication,cross-replica-sum,dce", num_replicas=2,
                                        loss_reduction="mean"), dump_dir="")
        out = pm.run(graph)
    text = _compare("traced_sgd", out)
    assert text.startswith("func @step(%0: f32[4,2] mirrored, %1: f32[3,4] varying, "
                           "%2: f32[3,2] varying) {")
    # exactly one gradient all-reduce, a sum, on the weight's gradient, in the backward pass,
    # then the mean's division by N where the trace marked the pullback's end
    reduces = [op for op in out.ops if op.name == "all_reduce"]
    assert len(reduces) == 1
    (ar,) = reduces
    assert ar.attr("reduce") == "sum" and ar.attr("gradient") is True and ar.loc.in_transpose
    assert [op.name for op in out.ops if op.name in ("div", "loss_scale")
            and ar.result in op.operands] == ["div"]
    assert ar.result.type.replica is Replica.MIRRORED and ar.result.type.shape == (4, 2)
    # the loss is per replica, the new weight identical everywhere
    assert [v.type.replica for v in out.outputs] == [Replica.VARYING, Replica.MIRRORED]
    assert all(op.loc is None or op.loc.file.endswith("golden_models.py") for op in out.ops)


def test_traced_sgd_step_computes_the_mean_gradient():
    """The golden graph is not just text: lowered over 2 replicas it gives the gradient of
    the mean of the per-replica losses (TF's loss_reduction='mean')."""
    import jax
    from compiler.lower import build_jitted
    from compiler.mesh import build_mesh

    out = PassManager(parse_pipeline("replication,cross-replica-sum,dce", num_replicas=2),
                      dump_dir="").run(_traced_sgd())
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 2)).astype(np.float32)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    y = rng.standard_normal((6, 2)).astype(np.float32)
    fn = build_jitted(out, build_mesh(2, 1), [False, True, True], [2, 2, 2], [True, False], [0, 2])
    losses, new_w = fn(w, x, y)
    per = [golden_models.sgd_step(w, x[3 * r:3 * r + 3], y[3 * r:3 * r + 3]) for r in range(2)]
    np.testing.assert_allclose(np.asarray(losses), [float(p[0]) for p in per], rtol=1e-5)

    def mean_loss(w):
        return sum(jnp.mean((jnp.tanh(x[3 * r:3 * r + 3] @ w) - y[3 * r:3 * r + 3]) ** 2)
                   for r in range(2)) / 2
    np.testing.assert_allclose(np.asarray(new_w), w - 0.1 * jax.grad(mean_loss)(w), rtol=1e-5, atol=1e-6)


def test_update_golden_mode_rewrites_and_compare_fails_on_difference(tmp_path, monkeypatch):
    from tests import irtest
    text = print_graph(parse((GOLDEN / "dce.in.txt").read_text())) + "\n"
    monkeypatch.setattr(irtest, "GOLDEN", tmp_path)
    monkeypatch.setattr(irtest.jc, "JAX_VERSION", (*irtest.BASE_JAX, 0))
    monkeypatch.setenv("UPDATE_GOLDEN", "1")
    irtest.check_golden("x.out.txt", text)
    assert (tmp_path / "x.out.txt").read_text() == text
    monkeypatch.delenv("UPDATE_GOLDEN")
    irtest.check_golden("x.out.txt", text)
    with pytest.raises(AssertionError, match="output differs"):
        irtest.check_golden("x.out.txt", text.replace("sin", "cos"))
    with pytest.raises(AssertionError, match="missing"):
        irtest.check_golden("absent.out.txt", text)


def test_golden_copy_per_jax_version(tmp_path, monkeypatch):
    """Another JAX falls back to the base golden and keeps its own copy only where its
    text differs; the base JAX never reads that copy."""
    from tests import irtest
    monkeypatch.delenv("UPDATE_GOLDEN", raising=False)
    monkeypatch.setattr(irtest, "GOLDEN", tmp_path)
    base, own = tmp_path / "x.out.txt", tmp_path / "jax-0.99" / "x.out.txt"
    base.write_text("base\n")
    monkeypatch.setattr(irtest.jc, "JAX_VERSION", (0, 99, 1))
    irtest.check_golden("x.out.txt", "base\n")
    with pytest.raises(AssertionError, match="output differs"):
        irtest.check_golden("x.out.txt", "new\n")
    monkeypatch.setenv("UPDATE_GOLDEN", "1")
    irtest.check_golden("x.out.txt", "new\n")
    assert own.read_text() == "new\n" and base.read_text() == "base\n"
    monkeypatch.delenv("UPDATE_GOLDEN")
    irtest.check_golden("x.out.txt", "new\n")
    with pytest.raises(AssertionError, match="output differs"):
        irtest.check_golden("x.out.txt", "base\n")
    monkeypatch.setattr(irtest.jc, "JAX_VERSION", (*irtest.BASE_JAX, 0))
    irtest.check_golden("x.out.txt", "base\n")
    monkeypatch.setattr(irtest.jc, "JAX_VERSION", (0, 99, 1))
    monkeypatch.setenv("UPDATE_GOLDEN", "1")
    irtest.check_golden("x.out.txt", "base\n")  # equal to the base again: the copy goes
    assert not own.exists() and base.read_text() == "base\n"


def test_hoist_scan_leaves_an_all_reduce_over_more_axes_in_the_loop():
    """Only an all-reduce over the replicas alone leaves a loop (the sum put back after
    it is over the replicas): one that also sums over another axis stays where it is."""
    text = (GOLDEN / "hoist_scan.in.txt").read_text()
    one = "all_reduce(%49) {reduce='sum', axes=('replica',)}"
    assert text.count(one) == 1
    graph = parse(text.replace(one, one.replace("('replica',)", "('replica', 'b')")))
    out = PassManager(parse_pipeline("hoist-collectives", num_replicas=4), verify=True,
                      dump_dir="").run(graph)
    inside = [op.attr("axes") for op, g in out.walk() if op.name == "all_reduce" and g is not out]
    assert inside == [("replica", "b")]
    assert not [op for op in out.ops if op.name == "all_reduce"]


def test_hoist_returns_a_graph_without_nested_collectives_unchanged():
    """With no collective in any region (at any depth; a region shared by many ops looked
    at once), ``hoist-collectives`` has nothing to hoist and nothing to refuse: it returns
    the very graph (a 32-layer MLP step spent 3 ms rewriting it op by op into an equal
    one). A collective moved into a nested region is still found and hoisted."""
    from compiler.passes.hoist_collectives import HoistCollectivesPass, nested_collectives

    def layers(w, x):
        def loss(w):
            h = x
            for _ in range(3):  # jnp.var's jit, one shared region
                h = jnp.tanh((h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5) @ w)
            return jnp.mean(h ** 2)
        return jax.grad(loss)(w)

    specs = [LeafSpec((4, 4), jnp.float32, False, False), LeafSpec((2, 4), jnp.float32, False, True)]
    graph, _ = trace_replica_fn(lambda w, x: [layers(w, x)], specs, 2)
    before = PassManager(parse_pipeline("replication,cross-replica-sum", num_replicas=2),
                         verify=True, dump_dir="").run(graph)
    assert any(op.regions for op in before.ops) and any(op.name == "all_reduce" for op in before.ops)
    assert not nested_collectives(before)
    assert HoistCollectivesPass().apply(before) is before

    graph = parse((GOLDEN / "hoist_cond.in.txt").read_text())  # (its golden output: above)
    assert nested_collectives(graph)
    out = PassManager(parse_pipeline("hoist-collectives", num_replicas=4), verify=True,
                      dump_dir="").run(graph)
    assert not nested_collectives(out) and any(op.name == "all_reduce" for op in out.ops)


F16_MEANS = """func @step(%0: f16[3] varying, %1: f16[3] varying, %2: f16[3] mirrored) {
  %3: f16[3] mirrored = all_reduce(%0) {reduce='sum', axes=('replica',)}  # m.py:1 [transpose(jvp())]
  %4: f16[3] mirrored = all_reduce(%1) {reduce='sum', axes=('replica',)}  # m.py:2 [transpose(jvp())]
  %5: f16[3] mirrored = add_any(%3, %2)  # m.py:3 [transpose(jvp())]
  %6: f16[3] mirrored = loss_scale(%5) {replicas=0, reduction=1}  # m.py:4
  %7: f16[3] mirrored = mul(%3, %4)  # m.py:5 [transpose(jvp())]
  %8: f16[3] mirrored = loss_scale(%7) {replicas=0, reduction=1}  # m.py:6
  %9: f16[3] mirrored = all_reduce(%1) {reduce='sum', axes=('replica',)}  # m.py:7 [transpose(jvp())]
  %10: f16[3] mirrored = mul(%9, %2)  # m.py:8 [transpose(jvp())]
  %11: f16[3] mirrored = loss_scale(%10) {replicas=0, reduction=1}  # m.py:9
  return %6, %8, %11
}"""


def test_crs_float16_means_move_below_linear_sums_only():
    """``loss_reduction="mean"`` with float16 gradients: a division reading an all-reduce
    through linear ops (%9 times a mirrored value) moves below it (the all-reduce takes
    the mean, no division after); %4, read only by its product with %3 (identical on
    every replica), moves below that product first (``_sink_sums``), so its group takes
    the mean too; %3, also read by %5 (with the mirrored %2), is left a sum with its
    division (before the analysis skipped a product of two all-reduces it raised a
    TypeError)."""
    g = PassManager(parse_pipeline("cross-replica-sum", loss_reduction="mean", num_replicas=4),
                    dump_dir="").run(parse(F16_MEANS))
    reduces = {op.loc.line: op.attr("reduce") for op in g.ops if op.name == "all_reduce"}
    assert reduces == {1: "sum", 2: "mean", 7: "mean"}, reduces
    divided = sorted(op.loc.line for op in g.ops if op.name == "div")
    assert divided == [4], divided  # (the linear groups' divisions went into the means)
