"""The verifier rejects malformed graphs with a message that marks the bad op, and the
pass manager verifies, times, dumps and reports failures by pass."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest

from compiler.errors import PassError
from compiler.pass_manager import DUMP_ENV, PassManager, parse_pipeline
from compiler.passes import PASSES
from ir.errors import IRVerifyError
from ir.graph import Graph, Loc, Op, RegionRef, Value
from ir.parser import parse
from ir.printer import print_graph
from ir.types import Replica, TensorType
from ir.verifier import verify
from tests.irtest import check_roundtrip

V, M = Replica.VARYING, Replica.MIRRORED


def T(shape, dtype="float32", replica=None):
    return TensorType(tuple(shape), dtype, replica)


def _verify_error(graph) -> str:
    with pytest.raises(IRVerifyError) as info:
        verify(graph)
    return str(info.value)


def _marked(msg: str) -> str:
    lines = [l for l in msg.split("\n") if l.startswith(">>")]
    assert len(lines) == 1, msg
    return lines[0]


def test_good_graph_verifies():
    g = parse("""func @f(%0: f32[3,4] varying, %1: f32[4] mirrored) {
  %2: f32[1,4] mirrored = broadcast_in_dim(%1) {shape=(1, 4), broadcast_dimensions=(1,)}
  %3: f32[3,4] varying = add(%0, %2)
  %4: f32[3,4] mirrored = all_reduce(%3) {reduce='sum', axes=('replica',)}
  %5: f32[] mirrored = constant() {value=2.0}
  %6: f32[3,4] mirrored = mul(%4, %5)
  return %6, %3
}""")
    check_roundtrip(g)


def test_operand_used_before_definition():
    x = Value(T((3,)))
    a, b, c = Value(T((3,))), Value(T((3,))), Value(T((3,)))
    ops = (Op("neg", (x,), (a,)), Op("mul", (a, c), (b,), loc=Loc("/w/model.py", 12)),
           Op("exp", (b,), (c,)))
    msg = _verify_error(Graph((x,), ops, (c,)))
    assert "operand 1 (%3) of mul is used before it is defined" in msg
    assert _marked(msg) == ">>  %2: f32[3] = mul(%1, %3)  # model.py:12"
    assert "  %3: f32[3] = exp(%2)" in msg  # the context shows where %3 really is


def test_operand_never_defined():
    x, stray, r = Value(T((3,))), Value(T((3,))), Value(T((3,)))
    msg = _verify_error(Graph((x,), (Op("add", (x, stray), (r,)),), (r,)))
    assert "operand 1 (%<undefined>) of add is used before it is defined, and never defined" in msg
    assert _marked(msg) == ">>  %1: f32[3] = add(%0, %<undefined>)"


def test_value_defined_twice():
    x, a, b = Value(T((2,))), Value(T((2,))), Value(T((2,)))
    ops = (Op("sin", (x,), (a,)), Op("cos", (x,), (b,)), Op("tanh", (b,), (a,)))
    msg = _verify_error(Graph((x,), ops, (a,)))
    assert "result 0 (%1) of tanh is already defined" in msg
    # the marked line shows the clash: the same name defined again
    assert _marked(msg) == ">>  %1: f32[2] = tanh(%2)"


def test_input_listed_twice():
    x = Value(T((2,)))
    msg = _verify_error(Graph((x, x), (), (x,)))
    assert "input %0 (f32[2]) is listed twice" in msg


def test_output_not_defined():
    x, a, stray = Value(T((2,))), Value(T((2,))), Value(T((5, 7)))
    msg = _verify_error(Graph((x,), (Op("sin", (x,), (a,)),), (a, stray)))
    assert "output 1 (%<undefined>) is not defined in the graph" in msg
    assert _marked(msg) == ">>  return %1, %<undefined>"


def test_region_output_not_defined():
    c, x = Value(T((), "int32")), Value(T((2,)))
    ra, stray, r = Value(T((2,))), Value(T((2,))), Value(T((2,)))
    region = Graph((ra,), (), (stray,), "region")
    op = Op("cond", (c, x), (r,), (("branches", (RegionRef(0),)),), regions=(region,))
    msg = _verify_error(Graph((c, x), (op,), (r,)))
    assert "(region of cond): output 0 (%<undefined>) is not defined in the region of cond" in msg
    assert _marked(msg).startswith(">>  %2: f32[2] = cond(%0, %1)")


def test_region_reads_outer_value():
    x, y = Value(T((2,))), Value(T((2,)))
    ra, rb = Value(T((2,))), Value(T((2,)))
    region = Graph((ra,), (Op("add", (ra, x), (rb,)),), (rb,), "region")
    op = Op("pjit", (x,), (y,), (("jaxpr", RegionRef(0)),), regions=(region,))
    msg = _verify_error(Graph((x,), (op,), (y,)))
    assert "operand 1 (%0) of add is used before it is defined (regions are isolated" in msg
    # the bad op is marked inside the region, with the full text's names
    assert _marked(msg) == ">>      %3: f32[2] = add(%2, %0)"


@pytest.mark.parametrize("refs, nregions, shown", [
    ((RegionRef(0), RegionRef(2)), 2, "[0, 2]"),
    ((RegionRef(0),), 2, "[0]"),
    ((), 1, "[]"),
])
def test_region_refs_must_match_regions(refs, nregions, shown):
    x, y = Value(T((2,))), Value(T((2,)))
    regions = tuple(Graph((a,), (), (a,), "region") for a in (Value(T((2,))) for _ in range(nregions)))
    op = Op("switchy", (x,), (y,), (("branches", refs),), regions=regions)
    msg = _verify_error(Graph((x,), (op,), (y,)))
    assert f"switchy has {nregions} regions but its attributes reference {shown}" in msg
    assert _marked(msg).startswith(">>  %1: f32[2] = switchy(%0)")


def test_all_reduce_result_type_differs():
    x = Value(T((4, 3), replica=V))
    r = Value(T((4, 5), replica=M))
    op = Op("all_reduce", (x,), (r,), (("reduce", "sum"), ("axes", ("replica",))))
    msg = _verify_error(Graph((x,), (op,), (r,)))
    assert "all_reduce: result type f32[4,5] mirrored differs from operand type f32[4,3] varying" in msg
    assert _marked(msg) == ">>  %1: f32[4,5] mirrored = all_reduce(%0) {reduce='sum', axes=('replica',)}"


def test_all_reduce_bad_reduce_kind():
    x, r = Value(T((4,))), Value(T((4,)))
    op = Op("all_reduce", (x,), (r,), (("reduce", "prod"), ("axes", ("replica",))))
    assert "reduce must be sum|mean|max|min, got 'prod'" in _verify_error(Graph((x,), (op,), (r,)))


def test_elementwise_shape_mismatch():
    x, y, r = Value(T((3, 4))), Value(T((3, 5))), Value(T((3, 4)))
    msg = _verify_error(Graph((x, y), (Op("add", (x, y), (r,)),), (r,)))
    assert "add: operand shapes differ: [3,4], [3,5]" in msg
    assert _marked(msg) == ">>  %2: f32[3,4] = add(%0, %1)"


def test_elementwise_rank_and_result_mismatch():
    x, y, r = Value(T((3, 4))), Value(T((4,))), Value(T((3, 4)))
    assert "mul: operand ranks differ: [3,4], [4]" in _verify_error(
        Graph((x, y), (Op("mul", (x, y), (r,)),), (r,)))
    x, r = Value(T((3, 4))), Value(T((4, 3)))
    assert "exp: result shape [4,3] differs from the broadcast operand shape [3,4]" in _verify_error(
        Graph((x,), (Op("exp", (x,), (r,)),), (r,)))


def test_constant_shape_mismatch():
    r = Value(T((2, 2)))
    msg = _verify_error(Graph((), (Op("constant", (), (r,), (("value", [1.0, 2.0, 3.0]),)),), (r,)))
    assert "constant: value has shape [3] but the result type has [2,2]" in msg


def test_mirrored_result_from_varying_operand():
    w = Value(T((4,), replica=M))
    x = Value(T((4,), replica=V))
    r = Value(T((4,), replica=M))
    msg = _verify_error(Graph((w, x), (Op("mul", (w, x), (r,), loc=Loc("m.py", 3)),), (r,)))
    assert "mul has varying operand(s) %1 but a mirrored result %2" in msg
    assert _marked(msg) == ">>  %2: f32[4] mirrored = mul(%0, %1)  # m.py:3"


def test_context_shows_neighbours_only():
    x = Value(T((2,)))
    vals = [x]
    ops = []
    for i in range(12):
        v = Value(T((2,)))
        ops.append(Op("neg", (vals[-1],), (v,)))
        vals.append(v)
    bad = Value(T((9,)))
    ops[6] = Op("neg", (vals[6],), (bad,))  # %7 has the wrong shape
    vals[7] = bad
    ops[7] = Op("neg", (bad,), (vals[8],))
    msg = _verify_error(Graph((x,), tuple(ops), (vals[-1],)))
    assert "neg: result shape [9] differs from the broadcast operand shape [2]" in msg
    assert _marked(msg) == ">>  %7: f32[9] = neg(%6)"
    assert "%4: f32[2] = neg(%3)" in msg and "%10: f32[2] = neg(%9)" in msg
    assert "%3: f32[2] = neg(%2)" not in msg and "%11:" not in msg


# ------------------------------------------------------------------ pass manager
_GRAPH = """func @f(%0: f32[4] mirrored, %1: f32[4] varying) {
  %2: f32[4] = mul(%0, %1)  # model.py:3
  %3: f32[4] = sin(%1)
  return %2
}"""


@dataclass(frozen=True)
class _BreakPass:
    """Produces a graph whose output is undefined."""

    name: str = "breaker"

    def apply(self, graph: Graph) -> Graph:
        return graph.replace(outputs=(Value(T((4,))),))


@dataclass(frozen=True)
class _RaisePass:
    name: str = "raiser"

    def apply(self, graph: Graph) -> Graph:
        from ir.errors import IRVerifyError
        raise IRVerifyError("raiser: cannot handle op sin")


def test_pass_producing_broken_graph_names_the_pass():
    pm = PassManager(parse_pipeline("replication,dce") + [_BreakPass()])
    with pytest.raises(PassError) as info:
        pm.run(parse(_GRAPH))
    msg = str(info.value)
    assert "after pass 'breaker'" in msg
    assert "passes that ran: import, replication, dce" in msg
    assert "output 0 (%<undefined>) is not defined in the graph" in msg


def test_pass_raising_names_the_pass():
    pm = PassManager(parse_pipeline("replication") + [_RaisePass()] + parse_pipeline("dce"))
    with pytest.raises(PassError) as info:
        pm.run(parse(_GRAPH))
    assert "pass 'raiser' failed (passes that ran before: import, replication): raiser: cannot" \
        in str(info.value)


@dataclass(frozen=True)
class _SwapPass:
    """Keeps every op object but swaps the first two: the second reads the first's result."""

    name: str = "swapper"

    def apply(self, graph: Graph) -> Graph:
        a, b, *rest = graph.ops
        return graph.replace(ops=(b, a, *rest))


def test_kept_ops_are_checked_again_where_they_now_sit():
    # The pass manager skips the per-op checks of an op it verified before (ops are
    # immutable), never the SSA order: a pass that moves a kept op is still caught.
    g = parse("""func @f(%0: f32[4]) {
  %1: f32[4] = neg(%0)
  %2: f32[4] = exp(%1)
  return %2
}""")
    with pytest.raises(PassError) as info:
        PassManager([_SwapPass()]).run(g)
    msg = str(info.value)
    assert "after pass 'swapper'" in msg
    assert re.search(r"operand 0 \(%\d\) of exp is used before it is defined", msg), msg


def test_kept_op_in_a_new_region_reading_an_outer_value_is_caught():
    # A pass wraps a verified op into a new region without passing its operand in.
    x = Value(T((4,)))
    a, b = Value(T((4,))), Value(T((4,)))
    neg = Op("neg", (x,), (a,))

    @dataclass(frozen=True)
    class _Wrap:
        name: str = "wrapper"

        def apply(self, graph: Graph) -> Graph:
            region = Graph((), (neg,), (a,), "region")
            call = Op("jit", (), (b,), (("jaxpr", RegionRef(0)),), regions=(region,))
            return Graph((x,), (call,), (b,))

    with pytest.raises(PassError) as info:
        PassManager([_Wrap()]).run(Graph((x,), (neg,), (a,)))
    msg = str(info.value)
    assert "after pass 'wrapper'" in msg
    assert "(regions are isolated: pass it as an operand)" in msg


def test_broken_input_graph_is_caught_at_import():
    g = parse(_GRAPH)
    g = g.replace(outputs=(Value(T((4,))),))
    with pytest.raises(PassError, match="after pass 'import'"):
        PassManager(parse_pipeline("dce")).run(g)


def _check_dumps(d, names):
    files = sorted(os.listdir(d))
    assert files == [f"{i:02d}-{n}.txt" for i, n in enumerate(names)]
    texts = []
    for i, (f, n) in enumerate(zip(files, names)):
        text = open(os.path.join(d, f)).read()
        header, body = text.split("\n", 1)
        assert re.fullmatch(rf"// pass: {n}  time: \d+\.\d{{3}} ms", header), header
        # a dump loads back: the header is a comment for the parser
        g = parse(text)
        assert print_graph(g) == body.rstrip("\n")
        check_roundtrip(g)
        texts.append(body)
    return texts


def test_dump_dir_writes_one_file_per_pass(tmp_path):
    d = tmp_path / "dumps"
    pm = PassManager(parse_pipeline("replication,cross-replica-sum,dce", num_replicas=2),
                     dump_dir=str(d))
    out = pm.run(parse(_GRAPH), import_seconds=0.25)
    texts = _check_dumps(d, ["import", "replication", "cross-replica-sum", "dce"])
    assert open(d / "00-import.txt").read().startswith("// pass: import  time: 250.000 ms\n")
    assert "%2: f32[4] = mul(%0, %1)" in texts[0]  # no variance before replication
    assert "%2: f32[4] varying = mul(%0, %1)" in texts[1]
    assert "sin" in texts[2] and "sin" not in texts[3]  # dce removed the dead op
    assert texts[3].rstrip("\n") == print_graph(out)
    assert [r.name for r in pm.records] == ["import", "replication", "cross-replica-sum", "dce"]
    assert all(r.seconds >= 0 for r in pm.records)


def test_dump_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "env"))
    assert DUMP_ENV == "RT_DUMP_DIR"
    PassManager(parse_pipeline("replication,dce")).run(parse(_GRAPH))
    _check_dumps(tmp_path / "env", ["import", "replication", "dce"])


def test_no_dump_without_dir(tmp_path, monkeypatch):
    monkeypatch.delenv(DUMP_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    PassManager(parse_pipeline("dce")).run(parse(_GRAPH))
    assert os.listdir(tmp_path) == []


def test_unknown_pass_lists_known_passes():
    with pytest.raises(PassError) as info:
        parse_pipeline("replication,fuse-everything,dce")
    msg = str(info.value)
    assert "unknown pass 'fuse-everything'" in msg
    assert "known passes: " + ", ".join(sorted(PASSES)) in msg
    for known in ("replication", "cross-replica-sum", "dce"):
        assert known in msg


def test_pipeline_options_and_spelling():
    passes = parse_pipeline(" replication , cross_replica_sum,dce ", num_replicas=4,
                            loss_reduction="sum")
    assert [p.name for p in passes] == ["replication", "cross-replica-sum", "dce"]
    assert passes[1].num_replicas == 4 and passes[1].loss_reduction == "sum"
    assert parse_pipeline("") == []


def test_a_splat_constant_the_verifier_accepts_also_lowers():
    import jax
    import numpy as np

    from compiler.lower import eval_graph
    from ir.graph import Graph, Op, Value
    from ir.types import TensorType
    from ir.verifier import verify

    v = Value(TensorType((2, 3), "float32"))
    g = Graph((), (Op("constant", (), (v,), (("value", np.float32(2.0)),)),), (v,))
    verify(g)
    np.testing.assert_array_equal(jax.jit(lambda: eval_graph(g, [])[0])(), np.full((2, 3), 2.0))


@pytest.mark.parametrize("name", ["select_n", "gather", "scatter-add", "random_wrap", "custom_lin"])
def test_primitive_by_name_finds_lowered_and_unlowered_primitives(name):
    # custom_lin has no lowering rule: found by the scan of live objects, not the registry
    from ir import _jax_compat as jc
    prim = jc.primitive_by_name(name)
    assert prim is not None and prim.name == name
    assert jc.primitive_by_name("no_such_primitive") is None


def test_missing_primitives_walk_live_objects_once_per_import(monkeypatch):
    """Names nothing defines (misspelt ops in a hand-edited dump) walk every live object
    once, not on each look-up (in a long-running process each walk took ~40 ms), and
    again after a module import (where primitives are defined); a primitive made later
    with a lowering rule is found without a walk."""
    import sys
    import types

    from jax._src.interpreters import mlir
    from jax.extend.core import Primitive

    from ir import _jax_compat as jc
    walks = []
    real = jc._live_primitives
    monkeypatch.setattr(jc, "_live_primitives", lambda: walks.append(1) or real())
    for module in ["rt_test_module_a", "rt_test_module_b"]:  # (as if imported now)
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
        for name in ["rt_no_such_a", "rt_no_such_b", "rt_no_such_a", "rt_test_made_later"]:
            assert jc.primitive_by_name(name) is None
        assert len(walks) == (1 if module.endswith("a") else 2)
    before = len(walks)
    prim = Primitive("rt_test_made_later")
    prim.def_abstract_eval(lambda x: x)
    mlir.register_lowering(prim, lambda ctx, x: [x])
    assert jc.primitive_by_name("rt_test_made_later") is prim
    assert len(walks) == before


# -- verify="end": one verification on success, the same error as "each" on failure ---------
@dataclass(frozen=True)
class _Count:
    """An identity pass that counts its runs (in a list shared by the test)."""

    runs: list
    name: str = "counter"

    def apply(self, graph: Graph) -> Graph:
        self.runs.append(self.name)
        return graph


def test_verify_end_runs_each_pass_once_when_the_result_verifies(monkeypatch):
    import ir.verifier as iv
    calls, runs = [], []
    real = iv.verify
    monkeypatch.setattr("compiler.pass_manager.verify",
                        lambda g, **kw: (calls.append(kw.get("where")), real(g, **kw))[1])
    out = PassManager(parse_pipeline("replication") + [_Count(runs)] + parse_pipeline("dce"),
                      verify="end").run(parse(_GRAPH))
    assert runs == ["counter"]
    assert calls == ["after the pipeline"]
    each = PassManager(parse_pipeline("replication") + [_Count([])] + parse_pipeline("dce"),
                       verify="each").run(parse(_GRAPH))
    assert print_graph(out) == print_graph(each)


@pytest.mark.parametrize("tail", [[], ["dce"]], ids=["last", "before-dce"])
def test_verify_end_names_the_pass_that_broke_the_graph(tail):
    # the broken graph reaches the end (or dce, which trips on it): either way the passes
    # run again, verified one by one, and the error is the one verify="each" gives
    def pipeline():
        return parse_pipeline("replication,dce") + [_BreakPass()] + parse_pipeline(",".join(tail))
    with pytest.raises(PassError) as each:
        PassManager(pipeline(), verify="each").run(parse(_GRAPH))
    with pytest.raises(PassError) as end:
        PassManager(pipeline(), verify="end").run(parse(_GRAPH))
    assert str(end.value) == str(each.value)
    assert "after pass 'breaker'" in str(end.value)
    assert "passes that ran: import, replication, dce" in str(end.value)


def test_verify_false_does_not_verify_and_a_bad_mode_is_refused():
    out = PassManager([_BreakPass()], verify=False).run(parse(_GRAPH))
    assert len(out.outputs) == 1
    with pytest.raises(PassError, match=r"verify must be one of True, False, 'each', 'end', "
                                         r"got 'always'"):
        PassManager([], verify="always")


def test_run_options_verify_default_comes_from_rt_verify(monkeypatch):
    import runtime as rt
    assert rt.RunOptions().verify == "each"  # tests/conftest.py sets RT_VERIFY=each
    monkeypatch.delenv("RT_VERIFY")
    assert rt.RunOptions().verify == "end"
    monkeypatch.setenv("RT_VERIFY", "0")
    assert rt.RunOptions().verify is False
    monkeypatch.setenv("RT_VERIFY", "sometimes")
    with pytest.raises(TypeError, match=r"verify must be True, False, 'each' or 'end', got "
                                        r"'sometimes' \(str\) \(from \$RT_VERIFY\)"):
        rt.RunOptions()
