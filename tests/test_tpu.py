"""TPU targets without a TPU (issue 12): steps compiled by the real TPU compiler (libtpu,
the project's ``tpu`` extra) for topologies this CPU machine does not have.

Oracles: the IR after the passes is the one the same step gets on CPU devices (the
passes do not depend on the platform); the TPU HLO carries TPU layouts and the
collectives the step's shardings imply (group sizes from the mesh); memory against the
chip table and the compiler's own out-of-memory refusal; roofline figures recomputed by
hand from the formula; the sweep's table against the plans a step's annotations allow.
"""
from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt
from runtime import tpu
from runtime.tpu import CHIPS, CompileOnlyError, DoesNotFitError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import tpu_transformer as tt  # noqa: E402

TINY = dict(layers=1, d=128, heads=4, ff=256, seq=16, vocab=128, batch=4)


def _compile(topology: str, n: int, k: int, **cfg):
    devs = rt.tpu_devices(topology)
    step = rt.replicate(tt.train_step, num_replicas=n, logical_devices=k, devices=devs[:n * k])
    lowered = step.lower(*tt.make_args(n, k, **{**TINY, **cfg}))
    return step, lowered, lowered.compile()


# -- devices -------------------------------------------------------------------------------
@pytest.mark.parametrize("topology,count,kind", [
    ("v5e:2x4", 8, "TPU v5 lite"), ("v5p:4x4x4", 64, "TPU v5"), ("v6e:4x4", 16, "TPU v6 lite"),
    ("v4:2x2x2", 16, "TPU v4"),   # v4: two TensorCores per chip, each a device
])
def test_tpu_devices_of_a_topology(topology, count, kind):
    devs = rt.tpu_devices(topology)
    assert len(devs) == count
    assert {d.platform for d in devs} == {"tpu"} and {d.device_kind for d in devs} == {kind}
    assert tpu.chip_of(devs[0]) is CHIPS[topology.split(":")[0]]


@pytest.mark.parametrize("name,words", [
    ("v5e-16", ["'v5e-16'", "GENERATION:SHAPE", "v5e:4x4"]),
    ("v9:4x4", ["'v9:4x4'", "v4, v5e, v5p, v6e"]),
    ("v5e:4x0", ["axis of size 0"]),
])
def test_tpu_devices_bad_topology(name, words):
    with pytest.raises(ValueError) as e:
        rt.tpu_devices(name)
    for w in words:
        assert w in str(e.value)


def test_unknown_shape_is_libtpu_refusal():
    with pytest.raises(ValueError, match=r"libtpu refuses the topology 'v5e:3x5'"):
        rt.tpu_devices("v5e:3x5")


# -- the pipeline on TPU targets ------------------------------------------------------------
def test_transformer_block_v5e_2x4_same_ir_as_cpu_and_tpu_hlo():
    step, lowered, compiled = _compile("v5e:2x4", 2, 4)
    cpu = rt.replicate(tt.train_step, num_replicas=2, logical_devices=4)
    cpu_lowered = cpu.lower(*tt.make_args(2, 4, **TINY))
    assert lowered.pass_names == cpu_lowered.pass_names
    for name in lowered.pass_names:   # every pass, verifier on, the same IR text
        assert str(lowered.ir(name)) == str(cpu_lowered.ir(name)), name
    assert compiled.target == "TPU v5 lite x8 (compile-only)"
    hlo = compiled.as_text()
    assert ":T(8,128)" in hlo                 # TPU tiled layouts: the TPU compiler's HLO
    assert "num_partitions=8" in hlo
    cols = compiled.collectives()
    # the gradient all-reduce over the 2 replicas, and the Megatron all-reduces inside a
    # replica over its 4 logical devices
    sizes = {(c.kind, c.group_size) for c in cols}
    assert ("all-reduce", 2) in sizes and ("all-reduce", 4) in sizes, sizes
    roof = compiled.roofline()
    assert set(roof.ici_by_axis) >= {"replica", "model_0+model_1"}
    with pytest.raises(CompileOnlyError, match=r"train_step targets 8 TPU v5 lite devices"):
        step(*tt.make_args(2, 4, **TINY))
    with pytest.raises(CompileOnlyError):
        compiled(*tt.make_args(2, 4, **TINY))


def test_transformer_v5p_64_chips():
    _, lowered, compiled = _compile("v5p:4x4x4", 16, 4)
    assert compiled.target == "TPU v5 x64 (compile-only)"
    grads = [c for c in compiled.collectives() if c.kind == "all-reduce" and c.group_size == 16]
    assert grads, "no gradient all-reduce over the 16 replicas"
    groups = grads[0].replica_groups
    assert len(groups) == 4 and sorted(d for g in groups for d in g) == list(range(64))
    fit = compiled.memory_fit()
    assert fit.fits and fit.capacity_bytes == 95 * tpu.GiB
    mem = compiled.memory_analysis()
    assert fit.argument_bytes == mem.argument_size_in_bytes
    assert fit.temp_bytes == mem.temp_size_in_bytes
    assert fit.peak_bytes > 0


def test_dynamic_shape_buckets_on_a_tpu_target():
    devs = rt.tpu_devices("v5e:2x2")

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2) / x.shape[0])(w)

    s = rt.replicate(step, num_replicas=4, devices=devs,
                     options=rt.RunOptions(dynamic_shapes=True))
    w = np.ones((16, 8), np.float32)
    lowered = s.lower(w, rt.PerReplica([np.ones((5 + r, 16), np.float32) for r in range(4)]))
    # rows 5..8 per replica pad to the bucket of 8; the size input carries the real rows
    assert [str(v.type) for v in lowered.ir().inputs][-1] == "f32[8,16] varying {replicated}"
    compiled = lowered.compile()
    assert ":T(8,128)" in compiled.as_text()
    with pytest.raises(CompileOnlyError):
        s(w, rt.PerReplica([np.ones((5, 16), np.float32)] * 4))


# -- memory ----------------------------------------------------------------------------------
def test_model_that_does_not_fit_a_v5e_chip():
    devs = rt.tpu_devices("v5e:2x2")

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

    s = rt.replicate(step, num_replicas=4, devices=devs)
    big = jax.ShapeDtypeStruct((50_000, 50_000), jnp.float32)   # 9.3 GiB, and its gradient
    xs = rt.PerReplica([jax.ShapeDtypeStruct((8, 50_000), jnp.float32)] * 4)
    with pytest.raises(DoesNotFitError) as e:
        s.lower(big, xs).compile()
    fit = e.value.fit
    assert not fit.fits and fit.lower_bound
    assert 15 * tpu.GiB < fit.capacity_bytes <= 16 * tpu.GiB   # the compiler's usable HBM
    assert fit.peak_bytes > fit.capacity_bytes
    assert "does not fit" in str(e.value) and "TPU v5 lite" in str(e.value)
    # the same step with a quarter of the rows per weight fits
    small = jax.ShapeDtypeStruct((12_500, 50_000), jnp.float32)
    fit2 = s.lower(small, rt.PerReplica([jax.ShapeDtypeStruct((8, 12_500), jnp.float32)] * 4)
                   ).compile().memory_fit()
    assert fit2.fits and fit2.margin_bytes == fit2.capacity_bytes - fit2.peak_bytes
    assert str(fit2).startswith("fits: peak ")


def test_memory_fit_from_stats_and_messages():
    class Stats:
        argument_size_in_bytes, output_size_in_bytes, temp_size_in_bytes = 4 << 30, 1 << 30, 12 << 30
        alias_size_in_bytes, generated_code_size_in_bytes = 1 << 30, 0
    fit = tpu.memory_fit(Stats(), 16 << 30, "TPU v5 lite")
    assert fit.peak_bytes == 16 << 30 and fit.fits and fit.margin_bytes == 0
    Stats.temp_size_in_bytes = 13 << 30
    fit = tpu.memory_fit(Stats(), 16 << 30)
    assert not fit.fits and fit.margin_bytes == -(1 << 30)
    assert "does not fit: peak 17 GiB exceeds the 16 GiB per device by 1 GiB" in str(fit)
    Stats.peak_memory_in_bytes = 3 << 30     # the compiler's liveness peak wins
    assert tpu.memory_fit(Stats(), 16 << 30).peak_bytes == 3 << 30
    f = tpu.fit_from_compile_error(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (18.65G) exceeds available HBM (15.75G).", None)
    assert f.peak_bytes == int(18.65 * (1 << 30)) and f.capacity_bytes == int(15.75 * (1 << 30))
    assert f.lower_bound and not f.fits
    f = tpu.fit_from_compile_error("Used 20.5G of 15.75G hbm. Exceeded hbm capacity by 4.75G.",
                                   None)
    assert f.peak_bytes == int(20.5 * (1 << 30)) and not f.lower_bound
    assert tpu.fit_from_compile_error("INTERNAL: something else", None) is None


def test_memory_fit_on_cpu_counts_the_temporaries():
    """XLA:CPU's ``peak_memory_in_bytes`` is its arguments and outputs only: the peak is at
    least every part's sum there (a 1 MiB argument live with a 1 MiB temporary "fitted" in
    1.5 MiB; found by a probe). Other devices keep the compiler's liveness peak."""
    class Stats:
        argument_size_in_bytes, output_size_in_bytes, temp_size_in_bytes = 1 << 20, 4, 1 << 20
        alias_size_in_bytes, generated_code_size_in_bytes = 0, 0
        peak_memory_in_bytes = (1 << 20) + 4
    fit = tpu.memory_fit(Stats(), 3 << 19, "cpu")
    assert fit.peak_bytes == (2 << 20) + 4 and not fit.fits
    assert tpu.memory_fit(Stats(), 3 << 19, "TPU v5 lite").peak_bytes == (1 << 20) + 4


def test_memory_fit_on_cpu_needs_a_capacity():
    s = rt.replicate(lambda x: x * 2, num_replicas=2)
    c = s.lower(rt.PerReplica([np.ones(4, np.float32)] * 2)).compile()
    with pytest.raises(ValueError, match=r"no known memory capacity for cpu devices"):
        c.memory_fit()
    assert c.memory_fit(capacity_bytes=1 << 20).fits
    with pytest.raises(ValueError, match=r"pass chip="):
        c.roofline()


# -- roofline --------------------------------------------------------------------------------
def test_wire_bytes_formulas():
    assert tpu.wire_bytes("all-reduce", 800, 4) == 2 * 3 / 4 * 800
    assert tpu.wire_bytes("all-gather", 800, 4) == 600
    assert tpu.wire_bytes("all-to-all", 800, 8) == 700
    assert tpu.wire_bytes("reduce-scatter", 100, 4) == 300
    assert tpu.wire_bytes("collective-permute", 123, 2) == 123
    assert tpu.wire_bytes("all-reduce", 800, 1) == 0
    with pytest.raises(ValueError, match="unknown collective kind 'send'"):
        tpu.wire_bytes("send", 1, 2)


def test_mesh_axes_of_group():
    shape, names = (4, 2, 2), ("replica", "model_0", "model_1")
    assert tpu.mesh_axes_of_group([0, 4, 8, 12], shape, names) == "replica"
    assert tpu.mesh_axes_of_group([0, 1, 2, 3], shape, names) == "model_0+model_1"
    assert tpu.mesh_axes_of_group([4, 6], shape, names) == "model_0"


def test_roofline_recomputed_by_hand():
    _, _, compiled = _compile("v5e:2x4", 2, 4)
    roof = compiled.roofline()
    chip = CHIPS["v5e"]
    cost = compiled.cost_analysis()
    assert roof.compute_s == pytest.approx(cost["flops"] / chip.peak_flops)
    assert roof.hbm_s == pytest.approx(cost["bytes accessed"] / chip.hbm_bandwidth)
    wire = 0.0
    kinds = set()
    for c in compiled.collectives():
        kinds.add(c.kind)
        n = 8 if c.kind != "collective-permute" and not c.replica_groups else c.group_size
        wire += c.bytes if c.kind == "collective-permute" else \
            tpu.wire_bytes(c.kind, c.bytes, n)
    assert roof.ici_s == pytest.approx(wire / chip.ici_bandwidth)
    assert roof.estimate_s == max(roof.compute_s, roof.hbm_s, roof.ici_s)
    assert roof.bound == {roof.compute_s: "compute", roof.hbm_s: "hbm",
                          roof.ici_s: "ici"}[roof.estimate_s]
    assert roof.collective_bytes == sum(c.bytes for c in compiled.collectives())
    # the same program estimated for another chip scales by the figures
    v6 = compiled.roofline("v6e")
    assert v6.compute_s == pytest.approx(roof.compute_s * 197 / 918)
    with pytest.raises(ValueError, match="unknown chip 'v7'"):
        compiled.roofline("v7")


def test_chip_table_has_sources():
    for chip in CHIPS.values():
        assert chip.source.startswith("cloud.google.com/tpu/docs/")
        assert chip.hbm_bytes > 0 and chip.peak_flops > 1e14 and chip.ici_bandwidth > 1e11


# -- the tool --------------------------------------------------------------------------------
_TT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                   "tpu_transformer.py")


def test_inspect_target_tpu_writes_tpu_outputs(tmp_path, monkeypatch, capsys):
    from tools import inspect as tool

    monkeypatch.setattr(tt, "CONFIG", dict(TINY))   # make_args' defaults, as the tool calls it
    out = tmp_path / "out"
    rc = tool.main([f"{_TT}:train_step", "--args", f"{_TT}:make_args", "--target", "tpu:v5e:2x4",
                    "--logical-devices", "4", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == "TPU v5 lite x8 (compile-only)"
    assert report["num_replicas"] == 2 and report["logical_devices"] == 4
    assert report["memory_fit"]["fits"] is True
    assert report["memory_fit"]["capacity_bytes"] == 16 * tpu.GiB
    assert report["roofline"]["bound"] in ("compute", "hbm", "ici")
    assert "estimate = max(" in report["roofline"]["formula"]
    assert ":T(8,128)" in (out / "hlo.txt").read_text()
    assert "stablehlo" in (out / "stablehlo.mlir").read_text()
    assert len(list((out / "ir").iterdir())) >= 5
    text = capsys.readouterr().out
    assert "memory fit: fits: peak" in text and "roofline estimate (v5e)" in text


def test_inspect_sweep_on_16_chips(tmp_path, monkeypatch, capsys):
    from tools import inspect as tool

    # K divides heads (4) for every plan but 8 and 16 logical devices... the column split
    # of wqkv needs 3*d/K whole tiles and the reshape to heads works for any K: all 5 plans
    # compile; a step whose annotation fixes K = 4 allows only 4 x 4 (below)
    monkeypatch.setattr(tt, "CONFIG", dict(TINY))
    out = tmp_path / "sweep"
    rc = tool.main([f"{_TT}:train_step", "--args", f"{_TT}:make_args", "--target", "tpu:v5e:4x4",
                    "--sweep", "-j", "2", "--out", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    data = json.loads((out / "sweep.json").read_text())
    plans = [(r["replicas"], r["logical_devices"]) for r in data["plans"]]
    assert sorted(plans) == [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
    ok = [r for r in data["plans"] if r["status"] == "ok"]
    assert len(ok) == 5
    # make_args gives each replica TINY's batch: plans do other amounts of work, ranked by
    # the estimate per example (before: per step, the plan doing least work first)
    assert all(r["examples"] == r["replicas"] * TINY["batch"] for r in ok)
    per = [r["per_example_s"] for r in ok]
    assert per == sorted(per) and all(
        r["per_example_s"] == pytest.approx(r["estimate_s"] / r["examples"]) for r in ok)
    assert all(r["fits"] and r["peak_bytes"] > 0 for r in ok)
    assert re.search(r"rank  replicas x K  estimate +examples  per example", captured.out)
    assert "[sweep] compiled 5/5" in captured.err   # progress on stderr


def test_inspect_sweep_reports_plans_the_annotations_refuse(tmp_path, capsys):
    from tools import inspect as tool

    root = os.path.dirname(_TT)
    rc = tool.main([f"{root}/transformer_block.py:train_step", "--args",
                    f"{os.path.dirname(root)}/tests/inspect_models.py:transformer_args",
                    "--target", "tpu:v5e:2x4", "--sweep", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "sweep.json").read_text())["plans"]
    assert rows[0]["status"] == "ok" and (rows[0]["replicas"], rows[0]["logical_devices"]) == (2, 4)
    refused = {(r["replicas"], r["logical_devices"]): r["error"] for r in rows[1:]}
    assert set(refused) == {(8, 1), (4, 2), (1, 8)}
    assert all(r["status"] == "not allowed" for r in rows[1:])
    assert "product of partition_dimensions [1, 4] is 4 but the replica has 2 logical devices" \
        in refused[(4, 2)]


def test_inspect_target_errors(tmp_path, capsys):
    from tools import inspect as tool

    base = [f"{_TT}:train_step", "--args", f"{_TT}:make_args", "--out", str(tmp_path)]
    assert tool.main(base + ["--target", "gpu"]) == 2
    assert "--target gpu: expected cpu or tpu:GENERATION:TOPOLOGY" in capsys.readouterr().err
    assert tool.main(base + ["--sweep"]) == 2
    assert "--sweep needs a TPU target" in capsys.readouterr().err
    assert tool.main(base + ["--target", "tpu:v5e:2x2", "--replicas", "4",
                             "--logical-devices", "2"]) == 2
    assert "need 8 devices but tpu:v5e:2x2 has 4" in capsys.readouterr().err


def test_byte_sizes_print_without_exponents():
    """Sizes in reports read ``1005 KiB``, not ``1.01e+03 KiB``."""
    from runtime.tpu import _human_bytes
    assert [_human_bytes(n) for n in (5, 1005 * 1024, 3.5 * 2 ** 20, 150 * 2 ** 30)] == \
        ["5 B", "1005 KiB", "3.5 MiB", "150 GiB"]
