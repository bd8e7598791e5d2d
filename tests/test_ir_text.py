"""The IR text form: hand-built graphs round-trip through printer and parser, names are
assigned by the printer in definition order, and parse errors say where."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ir.errors import IRParseError, IRTypeError
from ir.graph import Graph, Loc, Op, Opaque, RegionRef, Value
from ir.parser import parse
from ir.printer import print_graph
from ir.types import Replica, Sharding, SymDim, TensorType
from tests.irtest import check_roundtrip

V, M = Replica.VARYING, Replica.MIRRORED


def T(shape, dtype="float32", replica=None, sharding=None, weak=False):
    return TensorType(tuple(shape), dtype, replica, sharding, weak)


def _one_op_graph(attrs=(), loc=None, name="sort", out_type=None):
    x = Value(T((4,)))
    r = Value(out_type or T((4,)))
    return Graph((x,), (Op(name, (x,), (r,), tuple(attrs), loc),), (r,))


def _attrs_after_roundtrip(attrs):
    g = _one_op_graph(attrs)
    text = check_roundtrip(g)
    return parse(text).ops[0].attrs, text


# ------------------------------------------------------------------ types
def test_types_symbolic_dims_shardings_weak_types():
    b = SymDim("b", 128)
    x = Value(T((b, 16), replica=V, sharding=Sharding("tiled", (1, 2), (0, 1))))
    y = Value(T((SymDim("n"), 3), "bfloat16", M, Sharding.replicated()))
    z = Value(T((), "int32", weak=True))
    r1 = Value(T((b, 16), replica=V, sharding=Sharding.maximal(1)))
    r2 = Value(T((2, 4), replica=M, sharding=Sharding("tiled", (1, 2, 2), (0, 2, 1, 3),
                                                      last_tile_dim_replicate=True)))
    r3 = Value(T((), "int32", M, weak=True))
    g = Graph((x, y, z), (Op("sort", (y,), (r1, r2)), Op("copy", (z,), (r3,))), (r1, r2, r3), "step")
    text = check_roundtrip(g)
    head = text.split("\n")[0]
    assert head == ("func @step(%0: f32[b<=128,16] varying {devices=[1,2]0,1}, "
                    "%1: bf16[n,3] mirrored {replicated}, %2: s32[]~) {")
    assert "%3: f32[b<=128,16] varying {maximal device=1}, " \
           "%4: f32[2,4] mirrored {devices=[1,2,2]0,2,1,3 last_tile_dim_replicate} = sort(%1)" in text
    assert "%5: s32[]~ mirrored = copy(%2)" in text
    back = parse(text)
    assert back.inputs[0].type == x.type
    assert back.inputs[0].type.shape[0] == SymDim("b", 128)
    assert back.inputs[1].type == y.type
    assert back.inputs[2].type.weak_type and not back.inputs[0].type.weak_type
    assert back.ops[0].results[1].type.sharding.last_tile_dim_replicate
    assert back.ops[0].results[0].type.sharding == Sharding.maximal(1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int8", "uint8", "int64",
                                   "uint32", "bool", "complex64", "float8_e4m3fn", "int4",
                                   "key<fry>"])
def test_dtypes_roundtrip(dtype):
    x = Value(T((2,), dtype))
    g = Graph((x,), (), (x,))
    text = check_roundtrip(g)
    assert parse(text).inputs[0].type.dtype == dtype


def test_invalid_types_are_rejected():
    with pytest.raises(IRTypeError, match="product of tile dims \\(1, 2\\) is 2 but 3 devices"):
        Sharding("tiled", (1, 2), (0, 1, 2))
    with pytest.raises(IRTypeError, match="negative"):
        T((-1, 2))
    with pytest.raises(IRTypeError, match="not an identifier"):
        SymDim("2b")
    with pytest.raises(IRTypeError, match="maximal"):
        Sharding("maximal")



def test_derived_types_are_one_object_each_and_equal_to_built_ones():
    """``with_replica``/``with_sharding`` give one object per replica variance of a type
    with no sharding or the replicated one, equal (and hashing equal) to the type built
    from scratch; other shardings are made per call (a type shared by every program must
    not keep one entry per sharding object: their number grows with every compile)."""
    t = T((4, 8))
    v = t.with_replica(V)
    assert v is t.with_replica(V) and v == T((4, 8), replica=V) and hash(v) == hash(T((4, 8), replica=V))
    assert t.with_replica(M) == T((4, 8), replica=M) and t.with_replica(M) is not v
    rep = v.with_sharding(Sharding.replicated())
    assert rep is v.with_sharding(Sharding.replicated()) and rep.with_sharding(None) == v
    assert rep == T((4, 8), replica=V, sharding=Sharding("replicated")) and str(rep) == \
        "f32[4,8] varying {replicated}"
    for k in range(20):
        s = Sharding("tiled", (2, 1), (k % 2, 1 - k % 2))
        tiled = v.with_sharding(s)
        assert tiled == T((4, 8), replica=V, sharding=Sharding("tiled", (2, 1), (k % 2, 1 - k % 2)))
        assert tiled.sharding is s and tiled.with_replica(None).sharding is s
    assert len(v._variants) == 1 and len(t._variants) == 2  # {replicated}; V and M
    assert v.with_sharding(Sharding.maximal(1)).sharding == Sharding.maximal(1)


# ------------------------------------------------------------------ attributes
def test_attribute_kinds_roundtrip():
    attrs = (("none", None), ("t", True), ("f", False), ("i", 7), ("neg", -3), ("big", 2**70),
             ("fl", 0.1), ("tiny", -1.5e-300), ("e", 1e20), ("negzero", -0.0),
             ("pinf", math.inf), ("ninf", -math.inf),
             ("s", "a'b\"  # not a comment"), ("hash", "#"), ("esc", "back\\slash\n"),
             ("t0", ()), ("t1", (1,)), ("nested", ((1, 2), ((3,),), ())), ("lst", [1, [2.5], (None,)]),
             ("dt", np.dtype("float32")), ("bf", np.dtype(__import__("ml_dtypes").bfloat16)),
             ("opaque", Opaque("fn f's (lambda)")), ("np_int", np.int32(5)),
             ("sh", Sharding("tiled", (2, 1), (1, 0))))
    got, text = _attrs_after_roundtrip(attrs)
    assert "s='a\\'b\"  # not a comment'" in text
    assert "t1=(1,)" in text and "t0=()" in text and "nested=((1, 2), ((3,),), ())" in text
    assert "pinf=inf, ninf=-inf" in text and "dt=f32, bf=bf16" in text
    assert "opaque=<fn f's (lambda)>" in text and "sh={devices=[2,1]1,0}" in text
    d = dict(got)
    assert d["none"] is None and d["t"] is True and d["f"] is False
    assert d["i"] == 7 and d["neg"] == -3 and d["big"] == 2**70 and d["np_int"] == 5
    assert d["fl"] == 0.1 and d["tiny"] == -1.5e-300 and d["e"] == 1e20
    assert math.copysign(1.0, d["negzero"]) == -1.0
    assert d["pinf"] == math.inf and d["ninf"] == -math.inf
    assert d["s"] == "a'b\"  # not a comment" and d["hash"] == "#" and d["esc"] == "back\\slash\n"
    assert d["t0"] == () and d["t1"] == (1,) and d["nested"] == ((1, 2), ((3,),), ())
    assert d["lst"] == [1, [2.5], (None,)]
    assert d["dt"] == np.dtype("float32") and d["bf"].name == "bfloat16"
    assert d["opaque"] == Opaque("fn f's (lambda)") and d["opaque"].obj is None
    assert d["sh"] == Sharding("tiled", (2, 1), (1, 0))
    # the printer never reorders attributes
    assert [k for k, _ in got] == [k for k, _ in attrs]


def test_nan_attribute():
    got, text = _attrs_after_roundtrip((("x", math.nan), ("xs", [math.nan, 1.0])))
    assert "x=nan, xs=[nan, 1.0]" in text
    assert math.isnan(dict(got)["x"]) and math.isnan(dict(got)["xs"][0])


def test_unprintable_objects_become_opaque_and_stay_stable():
    import enum

    class Mode(enum.IntEnum):
        FILL = 2

    def helper(x):
        return x

    got, text = _attrs_after_roundtrip((("m", Mode.FILL), ("fn", helper), ("d", {"k": 1}),
                                        ("c", 1 + 2j), ("obj", object())))
    assert "fn=<fn test_unprintable_objects_become_opaque_and_stay_stable.<locals>.helper>" in text
    assert "0x" not in text  # no addresses: two traces print the same text
    assert "obj=<object>" in text and "c=<complex (1+2j)>" in text
    d = dict(got)
    assert isinstance(d["m"], Opaque) and "FILL" in d["m"].text  # an enum is not a bare int


def test_opaque_text_must_be_parseable():
    with pytest.raises(IRTypeError, match="balanced"):
        Opaque("a > b")
    with pytest.raises(IRTypeError, match="one line"):
        Opaque("a\nb")


# ------------------------------------------------------------------ regions, locations
def _region_graph():
    """A graph with nested regions, a region op with open (^1o) and closed refs, an op
    with no results and source locations with name stacks."""
    x = Value(T((3,), replica=V))
    c = Value(T((), "int32", M))
    # innermost region
    ia = Value(T((3,)))
    ib = Value(T((3,)))
    inner = Graph((ia,), (Op("sin", (ia,), (ib,), loc=Loc("/src/model.py", 9, "jvp(f)")),), (ib,), "region")
    # a region holding an op that has a region of its own
    ra = Value(T((3,)))
    rb = Value(T((3,)))
    rc = Value(T((3,)))
    mid = Graph((ra,), (Op("pjit", (ra,), (rb,), (("jaxpr", RegionRef(0)), ("name", "inner")),
                           regions=(inner,)),
                        Op("neg", (rb,), (rc,))), (rc,), "region")
    oa = Value(T((3,)))
    other = Graph((oa,), (), (oa,), "region")
    y = Value(T((3,), replica=V))
    z = Value(T((3,), replica=V))
    ops = (
        Op("cond", (c, x), (y,), (("branches", (RegionRef(0), RegionRef(1, closed=False))),),
           Loc("/a/b/model.py", 14, "transpose(jvp(loss))"), (mid, other)),
        Op("debug_callback", (y,), (), (("callback", Opaque("fn cb")),), Loc("model.py", 15)),
        Op("add", (y, x), (z,), loc=Loc("<unknown>", 0, "vmap(f)")),
    )
    return Graph((c, x), ops, (z, y), "step")


GOLDEN_REGION_TEXT = """\
func @step(%0: s32[] mirrored, %1: f32[3] varying) {
  %2: f32[3] varying = cond(%0, %1) {branches=(^0, ^1o)}  # model.py:14 [transpose(jvp(loss))]
    ^0(%3: f32[3]):
      %4: f32[3] = pjit(%3) {jaxpr=^0, name='inner'}
        ^0(%5: f32[3]):
          %6: f32[3] = sin(%5)  # model.py:9 [jvp(f)]
          return %6
      %7: f32[3] = neg(%4)
      return %7
    ^1(%8: f32[3]):
      return %8
  debug_callback(%2) {callback=<fn cb>}  # model.py:15
  %9: f32[3] varying = add(%2, %1)  # <unknown>:0 [vmap(f)]
  return %9, %2
}"""


def test_nested_regions_print_exactly():
    text = check_roundtrip(_region_graph())
    assert text == GOLDEN_REGION_TEXT


def test_nested_regions_parse_structure():
    g = parse(GOLDEN_REGION_TEXT)
    cond = g.ops[0]
    assert cond.name == "cond" and len(cond.regions) == 2
    assert cond.attr("branches") == (RegionRef(0), RegionRef(1, closed=False))
    assert cond.loc == Loc("model.py", 14, "transpose(jvp(loss))") and cond.loc.in_transpose
    pjit = cond.regions[0].ops[0]
    assert pjit.regions[0].ops[0].name == "sin"
    assert pjit.regions[0].ops[0].loc.name_stack == "jvp(f)"
    assert g.ops[1].results == () and g.ops[1].name == "debug_callback"
    assert g.outputs == (g.ops[2].result, cond.result)
    # values are shared by identity: the region's return is its own value
    assert cond.regions[1].outputs[0] is cond.regions[1].inputs[0]


def test_graph_with_no_outputs_and_no_inputs():
    g = Graph((), (Op("iota", (), ()),), ())
    text = check_roundtrip(g)
    assert text.split("\n")[1] == "  iota()"


def test_op_named_like_return_is_not_a_return():
    """``return_value(...)`` is read as an op (not the ``return`` line), so it is refused as
    an unknown op, with its line and column."""
    text = "func @f(%0: f32[2]) {\n  %1: f32[2] = return_value(%0)\n  return %1\n}\n"
    with pytest.raises(IRParseError, match=r"line 2, column 16: unknown op 'return_value'"):
        parse(text)


def test_multiple_results_and_repeated_operands():
    x = Value(T((2,)))
    a, b = Value(T((2,))), Value(T((2,), "int32"))
    g = Graph((x,), (Op("sort", (x, x), (a, b), (("num_keys", 1),)),), (b, a, b))
    text = check_roundtrip(g)
    assert "%1: f32[2], %2: s32[2] = sort(%0, %0) {num_keys=1}" in text
    assert text.endswith("  return %2, %1, %2\n}")


# ------------------------------------------------------------------ names
def _build_chain():
    x = Value(T((4,)))
    y = Value(T((4,)))
    a = Value(T((4,)))
    b = Value(T((4,)))
    c = Value(T((4,)))
    ops = (Op("mul", (x, y), (a,)), Op("exp", (a,), (b,)), Op("add", (b, x), (c,)))
    return Graph((x, y), ops, (c,))


def test_names_follow_definition_order_not_creation_order():
    # values created in reverse order still print %0, %1, ... in definition order
    c = Value(T((4,)))
    b = Value(T((4,)))
    a = Value(T((4,)))
    x = Value(T((4,)))
    g = Graph((x,), (Op("neg", (x,), (a,)), Op("exp", (a,), (b,)), Op("log", (b,), (c,))), (c,))
    text = check_roundtrip(g)
    assert "%1: f32[4] = neg(%0)\n  %2: f32[4] = exp(%1)\n  %3: f32[4] = log(%2)" in text


def test_printing_is_deterministic():
    g = _build_chain()
    assert print_graph(g) == print_graph(g) == str(g)
    assert print_graph(_build_chain()) == print_graph(g)  # two builds, same text
    # a pass that rebuilds a graph with fresh values prints the same text
    reparsed = parse(print_graph(g))
    assert reparsed.inputs[0] is not g.inputs[0]
    assert print_graph(reparsed) == print_graph(g)


def test_parser_accepts_any_names_and_renumbers():
    text = """func @f(%x: f32[2], %w: f32[2]) {
  %out: f32[2] = mul(%x, %w)
  return %out
}"""
    assert print_graph(parse(text)) == """func @f(%0: f32[2], %1: f32[2]) {
  %2: f32[2] = mul(%0, %1)
  return %2
}"""


def test_pass_dump_header_is_skipped():
    text = "// pass: dce  time: 0.010 ms\n" + print_graph(_build_chain()) + "\n"
    assert print_graph(parse(text)) == print_graph(_build_chain())


# ------------------------------------------------------------------ parse errors
GOOD = """func @f(%0: f32[2], %1: f32[2]) {
  %2: f32[2] = mul(%0, %1)
  %3: f32[2] = exp(%2)
  return %3
}"""


def _err(text):
    with pytest.raises(IRParseError) as info:
        parse(text)
    return str(info.value)


def test_parse_error_use_before_def():
    msg = _err(GOOD.replace("exp(%2)", "exp(%4)"))
    assert msg.startswith("line 3, column 20: %4 is used before it is defined")


def test_parse_error_duplicate_definition():
    msg = _err(GOOD.replace("%3: f32[2] = exp", "%2: f32[2] = exp"))
    assert msg.startswith("line 3, column 3: %2 is defined twice")


def test_parse_error_duplicate_input():
    msg = _err(GOOD.replace("%1: f32[2]) {", "%0: f32[2]) {"))
    assert "line 1" in msg and "%0 is defined twice" in msg


@pytest.mark.parametrize("bad, where, what", [
    (GOOD.replace("mul(%0, %1)", "mul(%0, %1) {a=}"), "line 2", "expected an attribute value"),
    (GOOD.replace("mul(%0, %1)", "mul(%0, %1) garbage"), "line 2", "unexpected text after op"),
    (GOOD.replace("mul(%0, %1)", "mul(%0 %1)"), "line 2", "expected ',' or ')'"),
    (GOOD.replace("exp(%2)", "exp(%2) {k=bogus}"), "line 3", "unknown attribute token 'bogus'"),
    (GOOD.replace("f32[2] = exp", "f32[2 = exp"), "line 3", "unbalanced '['"),
    (GOOD.replace("func @f", "fun @f"), "line 1", "expected 'func'"),
    (GOOD.replace("{replicated}", "").replace("%0: f32[2]", "%0: f32[2] {devices=[2]0}"),
     "line 1", "tiled sharding"),
    (GOOD.replace("\n}", ""), "line 5", "expected '}'"),
    (GOOD + "\nextra", "line 6", "unexpected text after the graph"),
    (GOOD.replace("exp(%2)", "exp(%2)  # model.py:x"), "line 3", "bad source location"),
    ("\n\n" + GOOD.replace("exp(%2)", "exp(%9)"), "line 5", "%9 is used before"),
])
def test_parse_errors_name_line(bad, where, what):
    msg = _err(bad)
    assert msg.startswith(where) or f"{where}," in msg or f"{where}:" in msg, msg
    assert what in msg, msg


def test_parse_error_region_value_out_of_scope_is_a_verify_error_not_a_parse_error():
    # the parser resolves names globally; isolation of regions is the verifier's job
    from ir.errors import IRVerifyError
    from ir.verifier import verify
    text = GOLDEN_REGION_TEXT.replace("%7: f32[3] = neg(%4)", "%7: f32[3] = neg(%1)")
    g = parse(text)
    with pytest.raises(IRVerifyError, match="regions are isolated"):
        verify(g)


# ------------------------------------------------------------------ analysis view, helpers
def test_networkx_view_and_ancestors():
    from ir.analysis import ancestor_ops
    g = _build_chain()  # %2 = mul(%0, %1); %3 = exp(%2); %4 = add(%3, %0)
    nxg = g.to_networkx()
    assert set(nxg.edges) == {(("in", 0), ("op", 0)), (("in", 1), ("op", 0)), (("op", 0), ("op", 1)),
                              (("op", 1), ("op", 2)), (("in", 0), ("op", 2)), (("op", 2), ("out", 0))}
    assert nxg.nodes[("op", 1)]["label"] == "exp"
    assert ancestor_ops(g, g.ops[1].result) == [0, 1]
    assert ancestor_ops(g, g.outputs[0]) == [0, 1, 2]
    assert ancestor_ops(g, g.inputs[0]) == []


def test_with_attrs_keeps_order_and_appends():
    op = Op("all_reduce", (), (), (("reduce", "sum"), ("axes", ("replica",))))
    new = op.with_attrs(reduce="mean", gradient=True)
    assert new.attrs == (("reduce", "mean"), ("axes", ("replica",)), ("gradient", True))
    assert op.attr("reduce") == "sum"  # the original is untouched (immutable IR)


def test_symbolic_dims_import_with_stable_names():
    """Symbolic dims from jax.export print as readable identifiers that do not depend on
    the process (no hash()), with a bound when the type has one, and round-trip."""
    import jax
    import jax.numpy as jnp
    from jax import export

    from ir.jaxpr_import import import_jaxpr
    b, = export.symbolic_shape("b")
    x = jax.ShapeDtypeStruct((b, 4), jnp.float32)
    g = import_jaxpr(jax.make_jaxpr(lambda x: (jnp.concatenate([x, x]), x[1:]))(x))
    text = check_roundtrip(g)
    assert "%0: f32[b,4]" in text
    assert "f32[_2_times_b,4] = concatenate(%0, %0)" in text
    assert "f32[b_minus_1,4] = gather" in text
    bounded = TensorType((SymDim("b", 128), 4), "float32")
    assert str(bounded) == "f32[b<=128,4]"


def test_parse_error_unterminated_string():
    msg = _err(GOOD.replace("exp(%2)", "exp(%2) {name='abc}"))
    assert msg.startswith("line 3, column 30: unterminated string"), msg


def test_mutated_text_fails_only_with_ir_errors():
    """Mangled text (a dump edited by hand) gives IRParseError/IRVerifyError, never an
    IndexError or a crash inside the parser or verifier."""
    import random
    from pathlib import Path

    from ir.errors import IRError
    from ir.verifier import verify
    texts = [GOLDEN_REGION_TEXT, GOOD,
             (Path(__file__).parent / "golden" / "replication_scan.in.txt").read_text()]
    rng = random.Random(1234)
    for _ in range(3000):
        lines = rng.choice(texts).split("\n")
        k = rng.randrange(len(lines))
        line = lines[k]
        i = rng.randrange(len(line) + 1)
        mode = rng.randrange(3)
        if mode == 0:
            line = line[:i]
        elif mode == 1:
            line = line[:i] + line[i + 1:]
        else:
            line = line[:i] + rng.choice("%()[]{}<>'\",=#^~ :-0a") + line[i:]
        lines[k] = line
        try:
            verify(parse("\n".join(lines)))
        except IRError:
            pass


@pytest.mark.parametrize("cls", [Op, Value])
def test_fast_constructors_take_the_dataclass_fields(cls):
    """``ir/graph.py`` replaces the ``__init__`` of ``Op`` and ``Value`` by one that sets
    the slots directly (passes build an op for every op they retype): it must take the
    dataclass's fields in order with their defaults, set every one, and leave the
    instances frozen, equal and hashing as dataclass instances do."""
    import dataclasses
    import inspect

    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields):
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == want, (f.name, p.default, want)
    x = Value(T((2,)))
    args = {"type": T((2,))} if cls is Value else dict(
        name="add", operands=(x, x), results=(Value(T((2,))),), attrs=(("k", 1),),
        loc=Loc("m.py", 3, "jvp"), regions=(), impl=object(), traced_varying=(True,))
    obj = cls(**args)
    assert {f.name: getattr(obj, f.name) for f in fields} == args
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, fields[0].name, None)
    if cls is Op:
        same = Op(**{**args, "impl": None, "traced_varying": None})  # not compared
        assert same == obj and hash(same) == hash(obj)
        assert Op(**{**args, "attrs": ()}) != obj
        short = Op("neg", (x,), (x,))
        assert (short.attrs, short.loc, short.regions, short.impl, short.traced_varying) == \
            ((), None, (), None, None)
