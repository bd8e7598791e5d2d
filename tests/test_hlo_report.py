"""compiler.hlo_report reads collectives out of real partitioned HLO.

The programs below run on the 8 virtual CPU devices; every expected number (kind,
count, bytes, groups, source line) is computed here from the program, not copied from
the HLO. Synthetic lines cover forms the CPU backend does not print (async pairs, names
without ``%``, inline source locations, iota and mesh-axes replica groups), and lines of
one program as jax 0.10.2 and 0.11.2 print it (explicit and mesh-axes groups).
"""
from __future__ import annotations

import inspect
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from compiler.hlo_report import (Collective, HloReportError, collectives, parse_replica_groups,
                                 shape_bytes, summarize, to_json, while_bodies)

# A (2, 4) mesh named ('a', 'b'); each device holds an f32[8, 16] block of f32[16, 64].
MESH_SHAPE = (2, 4)
BLOCK = (8, 16)
F32 = 4


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), ("a", "b"))


def _groups_over(axis: int) -> tuple[tuple[int, ...], ...]:
    """Device-id groups that vary along mesh ``axis`` with the other axis fixed."""
    ids = np.arange(8).reshape(MESH_SHAPE)
    ids = np.moveaxis(ids, axis, -1).reshape(-1, MESH_SHAPE[axis])
    return tuple(tuple(int(i) for i in g) for g in ids)


def _line_of(fn, needle: str) -> int:
    """The file line number of the line in ``fn``'s source that contains ``needle``."""
    src, first = inspect.getsourcelines(fn)
    hits = [first + i for i, line in enumerate(src) if needle in line]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def _body(x):
    s = lax.psum(x, "b")
    g = lax.all_gather(x, "b", axis=0, tiled=True)
    rs = lax.psum_scatter(x, "b", scatter_dimension=0, tiled=True)
    a2a = lax.all_to_all(x, "b", 0, 0, tiled=True)
    pp = lax.ppermute(x, "b", [(i, (i + 1) % 4) for i in range(4)])
    s_a = lax.psum(x, "a")
    return s, g, rs, a2a, pp, s_a


@pytest.fixture(scope="module")
def shard_map_hlo() -> str:
    spec = P("a", "b")
    f = jax.jit(jax.shard_map(_body, mesh=_mesh(), in_specs=spec, out_specs=(spec,) * 6))
    x = jax.ShapeDtypeStruct((BLOCK[0] * MESH_SHAPE[0], BLOCK[1] * MESH_SHAPE[1]), jnp.float32)
    return f.lower(x).compile().as_text()


def _matmul(x, w):
    return x @ w


@pytest.fixture(scope="module")
def partitioner_hlo() -> str:
    mesh = _mesh()
    # x: f32[8, 32] split on its contracting dim over 'b'; w: f32[32, 16] likewise, so each
    # device computes a partial f32[8, 16] product and XLA all-reduces over 'b'.
    x = jax.device_put(jnp.ones((8, 32)), NamedSharding(mesh, P(None, "b")))
    w = jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P("b", None)))
    f = jax.jit(_matmul, out_shardings=NamedSharding(mesh, P()))
    return f.lower(x, w).compile().as_text()


def test_shard_map_collectives(shard_map_hlo: str) -> None:
    report = collectives(shard_map_hlo)
    by_kind: dict[str, list[Collective]] = {}
    for c in report:
        by_kind.setdefault(c.kind, []).append(c)
    assert {k: len(v) for k, v in by_kind.items()} == {
        "all-reduce": 2, "all-gather": 1, "reduce-scatter": 1, "all-to-all": 1,
        "collective-permute": 1}

    block_bytes = BLOCK[0] * BLOCK[1] * F32                       # 512
    over_b, over_a = _groups_over(1), _groups_over(0)
    assert over_b == ((0, 1, 2, 3), (4, 5, 6, 7))

    reduces = {c.replica_groups: c for c in by_kind["all-reduce"]}
    assert set(reduces) == {over_b, over_a}
    psum_b = reduces[over_b]
    assert psum_b.bytes == block_bytes and psum_b.shape == "f32[8,16]"
    assert reduces[over_a].bytes == block_bytes

    (gather,) = by_kind["all-gather"]
    assert gather.bytes == MESH_SHAPE[1] * block_bytes and gather.replica_groups == over_b
    (scatter,) = by_kind["reduce-scatter"]
    assert scatter.bytes == block_bytes // MESH_SHAPE[1] and scatter.replica_groups == over_b
    (a2a,) = by_kind["all-to-all"]
    assert a2a.bytes == block_bytes and a2a.replica_groups == over_b  # tuple of 4 pieces
    (perm,) = by_kind["collective-permute"]
    assert perm.bytes == block_bytes and perm.replica_groups == ()
    ids = np.arange(8).reshape(MESH_SHAPE)
    want_pairs = {(int(ids[r, i]), int(ids[r, (i + 1) % 4])) for r in range(2) for i in range(4)}
    assert set(perm.pairs) == want_pairs

    for c in report:
        assert c.source_file == __file__
        assert c.op_name and c.op_name.startswith("jit(")
        assert c.computation and not c.is_async
    assert psum_b.source_line == _line_of(_body, 'lax.psum(x, "b")')
    assert reduces[over_a].source_line == _line_of(_body, 'lax.psum(x, "a")')
    assert gather.source_line == _line_of(_body, "lax.all_gather(")
    assert perm.source_line == _line_of(_body, "lax.ppermute(")


def test_partitioner_inserted_all_reduce(partitioner_hlo: str) -> None:
    (ar,) = collectives(partitioner_hlo)
    assert ar.kind == "all-reduce"
    assert ar.bytes == 8 * 16 * F32
    assert ar.replica_groups == _groups_over(1)
    assert ar.source_file == __file__
    assert ar.source_line == _line_of(_matmul, "x @ w")
    assert "dot_general" in (ar.op_name or "")


def test_summary_and_json(shard_map_hlo: str) -> None:
    report = collectives(shard_map_hlo)
    text = summarize(report)
    lines = text.splitlines()
    assert lines[0].split() == ["kind", "bytes", "groups", "source", "op_name"]
    assert len(lines) == len(report) + 2
    # Columns are aligned: every row's source column starts where the header's does.
    col = lines[0].index("source")
    base = os.path.basename(__file__)
    for line in lines[1:-1]:
        assert line[col:].startswith(base + ":")
    assert lines[-1] == (f"{len(report)} collective(s), {sum(c.bytes for c in report)} "
                         f"bytes per device per call")
    data = to_json(report)
    assert json.loads(json.dumps(data)) == data
    assert data[0].keys() >= {"kind", "bytes", "replica_groups", "pairs", "source_line"}


# --------------------------------------------------------------- synthetic forms

@pytest.mark.parametrize("text, want", [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{}", ()),
    ("[2,4]<=[8]", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("[4,2]<=[2,4]T(1,0)", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("[1,8]<=[8]", (tuple(range(8)),)),
    ("[2,4]<=[2,2,2]T(2,1,0)", ((0, 4, 2, 6), (1, 5, 3, 7))),
    # jax 0.10 prints partitioner-made groups over named mesh axes:
    ("mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
     ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=2,'b'=4] {'b'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=2,'b'=4] {'a'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=2,'b'=4] {'b','a'}", ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ("mesh['a'=2,'b'=4], device_ids=(0,2,4,6,1,3,5,7) {'a'}", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("mesh['a'=8] {'a':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=8] {'a':(2)4}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=8] {'a':(1)2,'a':(4)2}", ((0, 1, 4, 5), (2, 3, 6, 7))),
])
def test_parse_replica_groups(text: str, want) -> None:
    assert parse_replica_groups(text) == want


def test_iota_matches_numpy() -> None:
    for dims, reshape, perm in [((4, 2), (2, 4), (1, 0)), ((2, 6), (2, 3, 2), (1, 2, 0))]:
        got = parse_replica_groups(
            f"[{dims[0]},{dims[1]}]<=[{','.join(map(str, reshape))}]T({','.join(map(str, perm))})")
        want = np.arange(np.prod(reshape)).reshape(reshape).transpose(perm).reshape(dims)
        assert got == tuple(tuple(int(i) for i in g) for g in want)


@pytest.mark.parametrize("shape, n", [
    ("f32[8,16]", 512), ("bf16[4,4]", 32), ("f16[3]", 6), ("s32[]", 4), ("u32[2]", 8),
    ("s8[5]", 5), ("u8[5]", 5), ("pred[7]", 7), ("f64[2,2]", 32), ("s64[3]", 24),
    ("(f32[2,16]{1,0}, bf16[8]{0})", 128 + 16), ("f32[<=8,16]", 512), ("s4[3]", 2),
])
def test_shape_bytes(shape: str, n: int) -> None:
    assert shape_bytes(shape) == n


def test_unknown_dtype_is_an_error() -> None:
    with pytest.raises(HloReportError, match="zz9"):
        shape_bytes("zz9[4]")


SYNTHETIC = """\
HloModule m, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  %all-reduce-start = f32[8,16]{1,0} all-reduce-start(%p), channel_id=1, replica_groups=[2,2]<=[4], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(f)/psum" source_file="/x/model.py" source_line=14}
  %all-reduce-done = f32[8,16]{1,0} all-reduce-done(%all-reduce-start)
  %all-gather-start = (f32[8,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%all-reduce-done), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = f32[32,16]{1,0} all-gather-done(%all-gather-start)
  %cp-start = (f32[8,16]{1,0}, f32[8,16]{1,0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(f)/ppermute"}
  %cp-done = f32[8,16]{1,0} collective-permute-done(%cp-start)
  ROOT %all-reduce.1 = bf16[8,16]{1,0:T(8,128)(2,1)} all-reduce(%p), replica_groups={}, to_apply=%add, metadata={op_name="q\\"uoted"}
}
"""


def test_async_pairs_count_once_with_done_shape() -> None:
    report = collectives(SYNTHETIC)
    assert [c.kind for c in report] == ["all-reduce", "all-gather", "collective-permute",
                                        "all-reduce"]
    ar, ag, cp, sync = report
    assert ar.is_async and ar.name == "all-reduce-start" and ar.bytes == 512
    assert ar.replica_groups == ((0, 1), (2, 3))
    assert (ar.op_name, ar.source_file, ar.source_line) == ("jit(f)/psum", "/x/model.py", 14)
    assert ar.computation == "main"
    assert ag.is_async and ag.shape == "f32[32,16]" and ag.bytes == 2048
    assert cp.pairs == ((0, 1), (1, 0)) and cp.bytes == 512
    assert (cp.source_file, cp.source_line) == (None, None)
    assert not sync.is_async and sync.replica_groups == () and sync.bytes == 256
    assert sync.op_name == 'q"uoted' and sync.shape == "bf16[8,16]"


# The same shard_map program on the (2, 4) mesh ('a', 'b'), as XLA's CPU backend prints it
# under jax 0.10.2 (explicit groups) and 0.11.2 (mesh-axes groups, ``jax_use_rgv3``):
# psum over 'b', psum over ('a', 'b'), all_gather over 'a', psum_scatter and all_to_all
# over 'b'. Lines copied from ``compiled.as_text()``.
_HLO_BY_JAX = {
    "0.10.2": """\
  %psum_invariant.14 = f32[16,4]{1,0} all-reduce(%param.1), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%region_0.0, metadata={op_name="jit(f)/shard_map/psum_invariant" stack_frame_id=12}
  %psum_invariant.15 = f32[16,4]{1,0} all-reduce(%param.1), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%region_2.0, metadata={op_name="jit(f)/shard_map/psum_invariant" stack_frame_id=17}
  %all_gather.3 = f32[32,4]{1,0} all-gather(%psum_invariant.14), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/shard_map/all_gather" stack_frame_id=13}
  %reduce_scatter.7 = f32[8,4]{1,0} reduce-scatter(%all_gather.3), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%region_1.0, metadata={op_name="jit(f)/shard_map/reduce_scatter" stack_frame_id=14}
  %all-to-all = (f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}) all-to-all(%wrapped_slice, %wrapped_slice.1, %wrapped_slice.2, %wrapped_slice.3), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, metadata={op_name="jit(f)/shard_map/all_to_all" stack_frame_id=15}
""",
    "0.11.2": """\
  %psum_invariant.14 = f32[16,4]{1,0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['a'=2,'b'=4] {'b'}, use_global_device_ids=true, to_apply=%region_0.0, metadata={op_name="jit(f)/shard_map/psum_invariant" stack_frame_id=12}
  %psum_invariant.15 = f32[16,4]{1,0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['a'=2,'b'=4] {'a','b'}, use_global_device_ids=true, to_apply=%region_2.0, metadata={op_name="jit(f)/shard_map/psum_invariant" stack_frame_id=17}
  %all_gather.3 = f32[32,4]{1,0} all-gather(%psum_invariant.14), channel_id=1, replica_groups=mesh['a'=2,'b'=4] {'a'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(f)/shard_map/all_gather" stack_frame_id=13}
  %reduce_scatter.7 = f32[8,4]{1,0} reduce-scatter(%all_gather.3), channel_id=1, replica_groups=mesh['a'=2,'b'=4] {'b'}, use_global_device_ids=true, dimensions={0}, to_apply=%region_1.0, metadata={op_name="jit(f)/shard_map/reduce_scatter" stack_frame_id=14}
  %all-to-all = (f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}, f32[2,4]{1,0}) all-to-all(%wrapped_slice, %wrapped_slice.1, %wrapped_slice.2, %wrapped_slice.3), channel_id=1, replica_groups=mesh['a'=2,'b'=4] {'b'}, metadata={op_name="jit(f)/shard_map/all_to_all" stack_frame_id=15}
""",
}


@pytest.mark.parametrize("version", sorted(_HLO_BY_JAX))
def test_replica_groups_as_each_jax_prints_them(version: str) -> None:
    """Both spellings of one program's groups read as the same explicit groups, computed
    here from the mesh (rows of ids vary along 'b', columns along 'a')."""
    text = "ENTRY %main (p: f32[16,4]) -> f32[16,4] {\n" + _HLO_BY_JAX[version] + "}\n"
    got = [(c.kind, c.replica_groups, c.bytes) for c in collectives(text)]
    both = (tuple(range(8)),)
    assert got == [("all-reduce", _groups_over(1), 16 * 4 * F32),
                   ("all-reduce", both, 16 * 4 * F32),
                   ("all-gather", _groups_over(0), 32 * 4 * F32),
                   ("reduce-scatter", _groups_over(1), 8 * 4 * F32),
                   ("all-to-all", _groups_over(1), 4 * 2 * 4 * F32)]


def test_names_without_percent() -> None:
    text = SYNTHETIC.replace("%", "")
    assert [(c.kind, c.name, c.bytes) for c in collectives(text)] == [
        (c.kind, c.name, c.bytes) for c in collectives(SYNTHETIC)]


def test_bad_replica_groups_name_the_instruction() -> None:
    bad = "ENTRY %m (p: f32[4]) -> f32[4] {\n  %ar.7 = f32[4]{0} all-reduce(%p), replica_groups=??\n}\n"
    with pytest.raises(HloReportError, match="ar.7"):
        collectives(bad)


def test_while_bodies_hold_the_collectives_run_every_step() -> None:
    """A psum in a scan's body is in a while body of the compiled HLO; one after the
    scan is not (what the backward-loop tests in test_loops_replicated.py rely on)."""
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("i",))

    def body(xs):
        h, _ = lax.scan(lambda c, x: (c + lax.psum(x, "i"), None), jnp.zeros(3), xs)
        return lax.psum(h * 2.0, "i")[None]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    text = f.lower(jnp.ones((4 * 5, 3))).compile().as_text()
    bodies = while_bodies(text)
    where = [c.computation in bodies for c in collectives(text) if c.kind == "all-reduce"]
    assert sorted(where) == [False, True], where



def test_a_collective_in_a_loop_counts_once_per_iteration():
    """A collective in a ``while`` body (a ``lax.scan`` of 10 steps) runs 10 times per call:
    its ``trips`` is the loop's known trip count, the summary and the report's byte total
    count it 10 times (before: once), and the roofline's collective bytes too."""
    import runtime as rt

    def step(x):
        def body(c, _):
            return c + rt.all_reduce(c, "sum") * 0.5, c.sum()
        return jax.lax.scan(body, x, None, length=10)
    compiled = rt.replicate(step, num_replicas=4).lower(
        rt.distribute(np.ones((4, 16), np.float32), 4)).compile()
    (c,) = compiled.collectives()
    assert (c.kind, c.bytes, c.trips, c.step_bytes) == ("all-reduce", 64, 10, 640)
    assert summarize([c]).splitlines()[-1].startswith("1 collective(s), 640 bytes per device")
    from runtime.report import build_report, summary
    text = summary(build_report(compiled._program))
    assert "64 x 10" in text and "640 bytes per device per call" in text


def test_roofline_counts_a_collective_per_loop_iteration():
    """The TPU roofline counts a collective's bytes once per iteration of its loop (trip
    count 3: three times), and one in a loop of unknown trip count once, saying so."""
    from dataclasses import replace

    from compiler.hlo_report import Collective
    from runtime.tpu import CHIPS, roofline
    base = Collective(kind="all-reduce", name="ar", shape="f32[16]", bytes=64,
                      replica_groups=((0, 1, 2, 3),), pairs=(), op_name=None,
                      source_file=None, source_line=None, computation="body")
    chip = CHIPS["v5e"]
    once = roofline({}, [base], chip, (4,), ("replica",))
    thrice = roofline({}, [replace(base, trips=3)], chip, (4,), ("replica",))
    unknown = roofline({}, [replace(base, trips=None)], chip, (4,), ("replica",))
    assert (once.collective_bytes, thrice.collective_bytes) == (64, 192)
    assert thrice.ici_s == pytest.approx(3 * once.ici_s)
    assert unknown.collective_bytes == 64 and unknown.loops_unknown == 1
    assert "trip count" in str(unknown) and "trip count" not in str(once)


def test_a_collective_in_a_branch_inside_a_loop_counts_per_iteration():
    """A collective in a ``lax.cond`` branch inside a ``lax.scan`` of 5 steps (the branch a
    computation its loop body calls): counted for every iteration, as one directly in the
    body (before: once; found by a probe)."""
    import runtime as rt

    def step(flag, x):
        def body(h, _):
            return jax.lax.cond(flag > 0, lambda h: rt.all_reduce(h, "sum") * 0.5,
                                lambda h: h, h), None
        return jax.lax.scan(body, x, None, length=5)[0]
    compiled = rt.replicate(step, num_replicas=2).lower(
        jnp.float32(1), rt.distribute(np.ones((8, 16), np.float32), 2)).compile()
    (c,) = compiled.collectives()
    assert (c.bytes, c.trips, c.step_bytes) == (256, 5, 1280)
    assert compiled.roofline(chip="v5e").collective_bytes == 1280


def test_steps_per_call_reports_per_call_and_per_step():
    """With ``steps_per_call=3`` the table's total is per call (3 steps: 3 x 2048 bytes of
    gradient all-reduce) and a line gives one step's; the roofline takes one step's
    collective bytes, as XLA's cost analysis one step's flops (before: "per step" over
    3 steps' bytes, and the roofline mixed the two; found by a probe)."""
    import runtime as rt

    def step(w, x):
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, jnp.float32(0)
    w = np.ones((16, 32), np.float32)
    xs = [np.ones((8, 16), np.float32)] * 3
    compiled = rt.replicate(step, num_replicas=4, steps_per_call=3).lower(
        w, rt.distribute_steps(xs, 4)).compile()
    table = compiled.collectives_table()
    assert "6144 bytes per device per call" in table
    assert table.splitlines()[-1] == "3 steps per call: 2048 bytes per device per step"
    assert compiled.roofline(chip="v5e").collective_bytes == 2048


def test_ragged_all_to_all_is_a_collective():
    """``ragged-all-to-all`` (MoE token dispatch) is reported with its output buffer's
    bytes (before: left out of every report; found by a probe)."""
    text = """HloModule m

ENTRY %main (p: f32[8,16]) -> f32[8,16] {
  %p = f32[8,16]{1,0} parameter(0)
  ROOT %ra = f32[8,16]{1,0} ragged-all-to-all(%p, %p, %p, %p, %p, %p), replica_groups={{0,1}}
}
"""
    (c,) = collectives(text)
    assert (c.kind, c.bytes, c.replica_groups) == ("ragged-all-to-all", 512, ((0, 1),))


def test_a_libraryss_collective_names_the_users_line():
    """A flax model's gradient all-reduces are made in flax's ``linear.py``: the report
    names the user's lines that called each layer (before: ``linear.py:294, linear.py:287``
    for every layer; found by a probe)."""
    import inspect

    import flax.linen as nn

    import runtime as rt

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jnp.tanh(nn.Dense(32)(x))
            return nn.Dense(4)(x)
    m = MLP()

    def step(p, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(m.apply(p, x) ** 2))(p)
        return jax.tree.map(lambda a, b: a - b, p, g), loss
    p = m.init(jax.random.key(0), jnp.ones((2, 16)))
    compiled = rt.replicate(step, num_replicas=4).lower(
        p, rt.distribute(np.ones((16, 16), np.float32), 4)).compile()
    lines, first = inspect.getsourcelines(MLP.__call__)
    dense = [f"test_hlo_report.py:{first + i}" for i, s in enumerate(lines) if "nn.Dense" in s]
    sources = {s for c in compiled.collectives() for s in c.source.split(", ")}
    assert sources == set(dense), (sources, dense)
