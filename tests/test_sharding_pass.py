"""Tests of the ``sharding`` pass: golden text (parse -> ShardingPass -> print), the
conflict listing, validation errors, and round-trip/verifier checks on every output.

``UPDATE_GOLDEN=1 pytest tests/test_sharding_pass.py`` rewrites the expected files."""
from __future__ import annotations

import os
import pathlib

import pytest

from compiler.passes.sharding import ShardingError, ShardingPass, sharding_conflicts
from ir.parser import parse
from ir.printer import print_graph
from ir.types import Sharding
from tests.irtest import check_roundtrip

GOLDEN = pathlib.Path(__file__).parent / "golden"

# golden case -> number of logical devices per replica
CASES = {
    "megatron": 4,      # x @ W1[1,4] -> gelu -> @ W2[4,1] -> partial sum -> replicated
    "ops": 4,           # transpose/reshape/broadcast/reduce/slice/concat/gather/... rules
    "backward": 2,      # un-annotated inputs take the sharding of their users
    "conflict": 2,      # listed conflicts: forward vs backward, first in program order
    "maximal": 2,       # assign_to_logical_device through elementwise ops only
    "k1": 1,            # one logical device: everything replicated
    "partial": 4,       # last_tile_dim_replicate
    "regions": 2,       # call-like regions, scan and while propagate
}


def _run(name: str, k: int):
    text = (GOLDEN / f"sharding_{name}.in.txt").read_text().rstrip("\n")
    graph = parse(text)
    assert print_graph(graph) == text
    out = ShardingPass(num_logical_devices=k).apply(graph)
    return out


def _all_values(graph):
    yield from graph.inputs
    for op in graph.ops:
        yield from op.results
        for region in op.regions:
            yield from _all_values(region)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    out = _run(name, CASES[name])
    text = check_roundtrip(out)  # verifier + print(parse(text)) == text
    assert all(v.type.sharding is not None for v in _all_values(out))
    path = GOLDEN / f"sharding_{name}.out.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text + "\n")
    assert text == path.read_text().rstrip("\n")


@pytest.mark.parametrize("name", sorted(CASES))
def test_idempotent(name):
    k = CASES[name]
    once = _run(name, k)
    twice = ShardingPass(num_logical_devices=k).apply(parse(print_graph(once)))
    assert print_graph(twice) == print_graph(once)


def _sharding_of(graph, printed_name):
    text = print_graph(graph)
    for line in text.split("\n"):
        line = line.strip()
        for decl in (line.split(" = ")[0].split(", ") if " = " in line else []):
            if decl.startswith(printed_name + ":"):
                return decl.split(": ", 1)[1]
    raise AssertionError(f"{printed_name} not found in\n{text}")


def test_megatron_partial_sum_is_replicated_and_hidden_is_column_split():
    out = _run("megatron", 4)
    assert _sharding_of(out, "%5") == "f32[8,32] {devices=[1,4]0,1,2,3}"
    assert _sharding_of(out, "%17") == "f32[8,32] {devices=[1,4]0,1,2,3}"
    assert _sharding_of(out, "%18") == "f32[8,16] {replicated}"
    assert out.inputs[0].type.sharding == Sharding.replicated()
    assert sharding_conflicts(out) == []


def test_backward_reaches_unannotated_inputs():
    out = _run("backward", 2)
    assert [str(v.type.sharding) for v in out.inputs] == [
        "{devices=[2,1]0,1}", "{devices=[1,2]0,1}", "{devices=[2]0,1}"]


def test_conflicts_are_listed_with_locations():
    out = _run("conflict", 2)
    assert sharding_conflicts(out) == [
        "conflict.py:3: shard %2: input %0: {devices=[1,2]0,1} vs {devices=[2,1]0,1}: "
        "kept backward, the first in program order",
        "conflict.py:4: shard %3: {devices=[2,1]0,1} vs {devices=[1,2]0,1}: kept annotation",
        "conflict.py:5: tanh %4: {devices=[1,2]0,1} vs {devices=[2,1]0,1}: kept forward",
        # add(%2, %3): the two operands' splits cannot be merged over 2 devices
        "conflict.py:7: add %6: {devices=[1,2]0,1} vs {devices=[2,1]0,1}: "
        "kept forward, the first in program order",
    ]
    # an annotation's own sharding coarsened by a user (reduce, slice) is no conflict
    ops = _run("ops", 4)
    assert sharding_conflicts(ops) == []
    assert _sharding_of(out, "%6") == "f32[8,8] {devices=[1,2]0,1}"


def test_k1_everything_replicated():
    out = _run("k1", 1)
    assert {str(v.type.sharding) for v in _all_values(out)} == {"{replicated}"}


def test_maximal_only_through_elementwise():
    out = _run("maximal", 2)
    assert _sharding_of(out, "%6") == "f32[4,4] {maximal device=1}"
    assert out.inputs[1].type.sharding == Sharding.maximal(1)
    assert _sharding_of(out, "%7") == "f32[4] {replicated}"
    assert _sharding_of(out, "%8") == "f32[4,4] {replicated}"


_BAD = """func @main(%0: f32[8,6,2]) {{
  %1: f32[8,6,2] = shard(%0) {{sharding={sharding}, annotation='{ann}'}}  # model.py:21
  return %1
}}"""


@pytest.mark.parametrize("k, sharding, ann, pieces", [
    (4, "{devices=[1,2,1]0,5}", "split", ["device(s) 5", "[0, 4)", "4 logical devices",
                                          "model.py:21", "shard (annotation 'split')"]),
    (2, "{devices=[1,2]0,1}", "split", ["2 tile dimension(s)", "rank 3", "model.py:21"]),
    (8, "{devices=[2,2,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}", "split",
     ["2 tile dimension(s) (plus the last, replicated one)", "rank 3", "model.py:21"]),
    (3, "{maximal device=7}", "assign", ["logical device 7", "[0, 3)", "model.py:21"]),
    (4, "{devices=[1,2,1]0,1}", "split", ["lists 2 device ids", "4 logical devices"]),
])
def test_validation_errors_name_the_numbers(k, sharding, ann, pieces):
    graph = parse(_BAD.format(sharding=sharding, ann=ann))
    with pytest.raises(ShardingError) as e:
        ShardingPass(num_logical_devices=k).apply(graph)
    assert isinstance(e.value, ValueError)
    for p in pieces:
        assert p in str(e.value), (p, str(e.value))


def test_validation_inside_regions():
    text = (GOLDEN / "sharding_regions.in.txt").read_text().rstrip("\n")
    with pytest.raises(ShardingError, match=r"device\(s\) 1, outside \[0, 1\).*regions.py:3"):
        ShardingPass(num_logical_devices=1).apply(parse(text))


def test_imported_jaxpr_gets_shardings_everywhere():
    import jax
    import jax.numpy as jnp
    from ir.jaxpr_import import import_jaxpr

    def f(x, w, idx):
        h = jax.nn.relu(x @ w).T.reshape(-1)
        return jnp.sum(h) + jnp.take(x, idx, axis=0).sum()

    g = import_jaxpr(jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((8, 6)), jnp.array([0, 2])))
    out = ShardingPass(num_logical_devices=2).apply(g)
    check_roundtrip(out)
    assert {str(v.type.sharding) for v in _all_values(out)} == {"{replicated}"}
