"""The persistent cache (``RunOptions(cache_dir=...)`` / ``$RT_CACHE_DIR``): compiled
steps survive a process restart, corrupt records recompile with a warning, and the last
miss is explained. Every test runs its steps in fresh processes: JAX's compilation cache
directory is process-wide and must not leak into the rest of the suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r'''
import json, os, sys, time, warnings
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.environ["ROOT"])
t0 = time.perf_counter()
import jax, jax.numpy as jnp, numpy as np
import runtime as rt

SCALE = float(os.environ.get("SCALE", "0.1"))


class Config:  # an object the step reads: the code key sees its type only
    def __init__(self, mult):
        self.mult = mult


CFG = Config(float(os.environ.get("MULT", "1.0")))
BIAS = np.full((2,), float(os.environ.get("BIAS", "0.0")), np.float32)  # an array it reads

def step(w, batch):
    def loss_fn(w):
        return jnp.mean((jnp.tanh(batch["x"] @ w) - batch["y"] + BIAS) ** 2)
    loss, g = jax.value_and_grad(loss_fn)(w)
    return w - SCALE * CFG.mult * g, loss

rows = int(os.environ.get("ROWS", "16"))
opts = rt.RunOptions(cache_dir=sys.argv[1]) if sys.argv[1] != "-" else rt.RunOptions()
s = rt.replicate(step, num_replicas=4, options=opts)
w = jnp.full((4, 2), 0.5, jnp.float32)
rng = np.random.RandomState(0)
batch = {"x": rng.randn(rows, 4).astype(np.float32), "y": rng.randn(rows, 2).astype(np.float32)}
t1 = time.perf_counter()
with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always")
    w2, loss = s(w, rt.distribute(batch, 4))
    w3, _ = s(w2, rt.distribute(batch, 4))
t2 = time.perf_counter()
info = s.cache_info()
print(json.dumps({
    "info": list(info), "compiles": info.compiles, "memory_hits": info.memory_hits,
    "w": np.asarray(w3).tolist(), "loss": float(rt.reduce("mean", loss)),
    "build_s": t2 - t1, "warnings": [str(x.message) for x in ws
                                     if issubclass(x.category, RuntimeWarning)],
    "explain": s.cache_explain()}))
'''


def _run(tmp_path, cache, **env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    e = dict(os.environ, ROOT=ROOT, **env)
    for k in ("XLA_FLAGS", "RT_CACHE_DIR", "RT_DUMP_DIR"):
        e.pop(k, None)
    r = subprocess.run([sys.executable, str(script), str(cache)], env=e, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _files(d):
    out = set()
    for root, _, files in os.walk(d):
        out |= {os.path.relpath(os.path.join(root, f), d) for f in files}
    return out


def test_second_process_compiles_nothing(tmp_path):
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    first, _ = _run(tmp_path, cache)
    assert first["info"][:3] == [1, 1, 1]  # hits, misses, currsize: the old fields first
    assert first["compiles"] == 1 and first["info"][3:] == [0, 1]  # disk_hits, disk_writes
    after_first = _files(cache)
    assert any(f.startswith("rt/") and f.endswith(".rec") for f in after_first)
    assert any(f.startswith("xla/") for f in after_first)  # JAX's own cache was written
    second, _ = _run(tmp_path, cache)
    assert second["info"] == [1, 1, 1, 1, 0]  # the miss was served from disk
    assert second["compiles"] == 0 and second["memory_hits"] == 1
    assert _files(cache) - {"rt/last_miss.json"} == after_first - {"rt/last_miss.json"}, \
        "the second process wrote new cache entries: it compiled something"
    assert second["w"] == first["w"] and second["loss"] == first["loss"]
    assert "disk hit" in second["explain"]
    assert second["build_s"] < 30 and time.perf_counter() - t0 < 120


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip"])
def test_corrupt_record_warns_and_recompiles(tmp_path, damage):
    import shutil
    cache = tmp_path / "cache"
    first, _ = _run(tmp_path, cache)
    (rec,) = [cache / "rt" / f for f in os.listdir(cache / "rt") if f.endswith(".rec")]
    data = rec.read_bytes()
    if damage == "truncate":
        rec.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        rec.write_bytes(os.urandom(4096))
    else:  # one byte of the payload changed: the checksum catches it
        i = len(data) - 100
        rec.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    second, _ = _run(tmp_path, cache)
    # our record is unusable; the step is traced again and XLA's executable comes from
    # JAX's own cache (a disk hit of the other layer)
    assert "JAX's persistent cache" in second["explain"]
    assert second["compiles"] == 0 and second["info"][3] == 1
    assert any("recompiling" in w and str(rec) in w for w in second["warnings"]), second
    assert second["w"] == first["w"]
    if damage != "flip":  # (what follows is the same after every damage)
        return
    third, _ = _run(tmp_path, cache)  # the bad record was replaced by a readable one
    assert third["compiles"] == 0 and not third["warnings"]
    assert third["w"] == first["w"]
    # with JAX's cache gone as well, a corrupt record means a real compile
    rec.write_bytes(b"RTCACHE1\n" + b"0" * 64 + b"\n" + b"junk")
    shutil.rmtree(cache / "xla")
    fourth, _ = _run(tmp_path, cache)
    assert fourth["compiles"] == 1 and fourth["info"][3:] == [0, 1]
    assert any("checksum" in w for w in fourth["warnings"]), fourth
    assert fourth["w"] == first["w"]


def test_explain_names_the_entries_that_differed(tmp_path):
    cache = tmp_path / "cache"
    _run(tmp_path, cache)
    changed, _ = _run(tmp_path, cache, SCALE="0.2")  # a global constant the step reads
    assert changed["compiles"] == 1
    assert "fn.code" in changed["explain"] and "signature" not in changed["explain"]
    r = subprocess.run([sys.executable, "-m", "tools.cache", "explain", str(cache)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    # the constant is in the code key and, traced, in the program
    assert r.returncode == 0 and "fn.code:" in r.stdout and "program: the traced step" \
        in r.stdout and "2 entries differ" in r.stdout, r.stdout
    reshaped, _ = _run(tmp_path, cache, SCALE="0.2", ROWS="32")
    assert "signature" in reshaped["explain"] and "fn.code" not in reshaped["explain"]
    info = json.loads((cache / "rt" / "last_miss.json").read_text())
    assert [d["entry"] for d in info["differing"]] == ["signature", "program"]
    assert "float32[8, 4]" in info["differing"][0]["after"]
    r = subprocess.run([sys.executable, "-m", "tools.cache", "list", str(cache)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) == 3


def test_values_the_step_closes_over_are_part_of_the_key(tmp_path):
    """An object the step reads (here a config whose multiplier scales the update, as an
    optimizer object holds its learning rate) and an array it reads enter the code key by
    type only. Before, a run after either changed loaded the record of the old values and
    silently trained with them. The traced program ends the key: a change misses and
    names ``program``; the numbers equal an uncached run's with the new values."""
    cache = tmp_path / "cache"
    first, _ = _run(tmp_path, cache)
    scaled, _ = _run(tmp_path, cache, MULT="0.5")
    fresh, _ = _run(tmp_path, "-", MULT="0.5")
    assert scaled["compiles"] == 1 and scaled["info"][3] == 0, scaled
    assert scaled["w"] == fresh["w"] and scaled["w"] != first["w"]
    assert "program: the traced step differs" in scaled["explain"], scaled["explain"]
    assert "fn.code" not in scaled["explain"]  # (the code key could not see it)
    biased, _ = _run(tmp_path, cache, MULT="0.5", BIAS="1.0")
    assert biased["compiles"] == 1 and biased["loss"] != scaled["loss"], biased
    again, _ = _run(tmp_path, cache, MULT="0.5")  # the record of those values: a hit
    assert again["compiles"] == 0 and again["w"] == fresh["w"], again


def test_result_names_the_step_reads_from_an_object_are_part_of_the_key(tmp_path):
    """Result names taken from an object the step reads (the code key sees its type
    only): renamed so that the IR is the same program, the record must not be reused
    (before: a disk hit returned the first run's names, ``out["loss"]`` reading another
    result). Same names again: a hit with them."""
    import jax.numpy as jnp
    import numpy as np

    import runtime as rt

    class Names:
        def __init__(self, first, second):
            self.first, self.second = first, second

    def run(names):
        def step(x):
            s = rt.all_reduce(jnp.sum(x), "sum")
            return {names.first: s, names.second: s * 2.0}
        rep = rt.replicate(step, num_replicas=2, options=rt.RunOptions(cache_dir=str(tmp_path)))
        out = rep(rt.distribute(np.arange(4, dtype=np.float32), 2))
        return {k: float(v) for k, v in out.items()}, rep.cache_info()

    first, _ = run(Names("loss", "err"))
    assert first == {"loss": 6.0, "err": 12.0}
    renamed, info = run(Names("zzz", "loss"))  # sorted keys keep the leaves' order
    # (a record of its own; XLA's executable may come from JAX's cache: the same HLO)
    assert renamed == {"zzz": 6.0, "loss": 12.0} and info.disk_writes == 1, (renamed, info)
    again, info = run(Names("zzz", "loss"))
    assert again == renamed and info.disk_hits == 1, (again, info)


def test_cache_dir_from_environment(tmp_path):
    cache = tmp_path / "envcache"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    e = dict(os.environ, ROOT=ROOT, RT_CACHE_DIR=str(cache))
    e.pop("XLA_FLAGS", None)
    for _ in range(2):
        r = subprocess.run([sys.executable, str(script), "-"], env=e, capture_output=True,
                           text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compiles"] == 0 and out["info"][3] == 1


def test_key_entries_are_documented():
    from runtime import persistent
    doc = persistent.__doc__
    for name in ("format", "fn.module", "fn.qualname", "fn.code", "fn.source", "signature",
                 "jax", "jaxlib", "backend", "jax_config", "compiler", "mesh", "pipeline",
                 "options", "program"):
        assert f"``{name}``" in doc, name


def test_multi_step_options_are_part_of_the_persistent_key():
    """steps_per_call, donate and step_outputs change the program: a 1-step and a
    10-step version of one function must not share a disk record."""
    import numpy as np

    import runtime as rt
    from runtime.persistent import digest, key_entries

    def step(state, x):
        return state + x.sum(), x.mean()

    args = (np.float32(0.0), rt.distribute(np.ones((2, 4), np.float32), 2))
    digests = set()
    for kw in ({}, {"steps_per_call": 3}, {"steps_per_call": 3, "donate": True},
               {"steps_per_call": 3, "step_outputs": "last"}):
        s = rt.replicate(step, num_replicas=2, **kw)
        entries = key_entries(s, s._key_of(args)[2])
        assert f"steps_per_call={kw.get('steps_per_call', 1)}" in entries["options"]
        digests.add(digest(entries))
    assert len(digests) == 4


def test_jax_context_is_part_of_the_persistent_key():
    """A record made under one JAX context (matmul precision, rank promotion, ...) is not
    another context's: the ``jax_config`` entry holds the whole trace context, thread-local
    settings included, as the same text in every process."""
    import jax
    import numpy as np

    import runtime as rt
    from runtime.persistent import key_entries

    s = rt.replicate(lambda a: a @ a, num_replicas=1)
    key = s._key_of((np.ones((4, 4), np.float32),))[2]
    plain = key_entries(s, key)["jax_config"]
    with jax.default_matmul_precision("highest"):
        highest = key_entries(s, key)["jax_config"]
    with jax.numpy_rank_promotion("raise"):
        strict = key_entries(s, key)["jax_config"]
    assert len({plain, highest, strict}) == 3
    assert "jax_default_matmul_precision='highest'" in highest
    assert "jax_numpy_rank_promotion='raise'" in strict
    assert " at 0x" not in plain and key_entries(s, key)["jax_config"] == plain
    code = ("import os; os.environ['JAX_PLATFORMS'] = 'cpu'\n"
            "import numpy as np, runtime as rt\n"
            "from runtime.persistent import key_entries\n"
            "s = rt.replicate(lambda a: a @ a, num_replicas=1)\n"
            "print(key_entries(s, s._key_of((np.ones((4, 4), np.float32),))[2])['jax_config'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == plain


def test_xla_flags_are_part_of_the_persistent_key(monkeypatch):
    """A record compiled under other XLA flags is not this process's (JAX's own cache keys
    on them): before, a bfloat16 step's record written under XLA's default excess
    precision was served to a process run with ``--xla_allow_excess_precision=false``
    (3877.68 where ``jax.jit`` there gives 3877.85; found by a probe). The ``compiler``
    entry holds ``$XLA_FLAGS``, ``$LIBTPU_INIT_ARGS`` and JAX's compile-option settings."""
    import numpy as np

    import runtime as rt
    from runtime.persistent import digest, key_entries

    s = rt.replicate(lambda a: a * 3, num_replicas=1)
    key = s._key_of((np.ones((4,), np.float32),))[2]
    entries = []
    for flags in ("--xla_force_host_platform_device_count=8",
                  "--xla_force_host_platform_device_count=8 --xla_allow_excess_precision=false"):
        monkeypatch.setenv("XLA_FLAGS", flags)
        entries.append(key_entries(s, key))
    assert "--xla_allow_excess_precision=false" in entries[1]["compiler"]
    assert "jax_memory_fitting_level=" in entries[0]["compiler"]
    assert entries[0]["compiler"] != entries[1]["compiler"]
    assert digest(entries[0]) != digest(entries[1])
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_latency_hiding_scheduler=true")
    assert key_entries(s, key)["compiler"] != entries[1]["compiler"]


def test_a_disk_hit_returns_this_traces_result_structure(tmp_path):
    """A step returning a pytree node whose static data is an object with an address in
    its text (which the fingerprint drops): a disk hit is served the executable, but its
    results come in the structure this trace gave, not the one of the step that wrote the
    record (before: ``'linear'`` where the step returns ``'cosine'``; found by a probe).
    Two ``replicate`` objects in one fresh process: the second's miss is a disk hit."""
    code = r'''
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
import runtime as rt

class Meta:  # equal by schedule; its repr holds an address
    def __init__(self, schedule): self.schedule = schedule
    def __eq__(self, o): return isinstance(o, Meta) and o.schedule == self.schedule
    def __hash__(self): return hash(self.schedule)

class Box:
    def __init__(self, v, meta): self.v, self.meta = v, meta

jax.tree_util.register_pytree_node(Box, lambda b: ((b.v,), b.meta), lambda m, c: Box(c[0], m))
out = []
for schedule in ("linear", "cosine"):
    meta = Meta(schedule)
    s = rt.replicate(lambda x: Box(x * 2, meta), num_replicas=2,
                     options=rt.RunOptions(cache_dir=sys.argv[1]))
    got = s(np.ones(4, np.float32))
    out.append([got.meta.schedule, np.asarray(got.v).tolist(), s.cache_info().disk_hits])
print(json.dumps(out))
'''
    script = tmp_path / "box.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=ROOT)
    for k in ("XLA_FLAGS", "RT_CACHE_DIR", "RT_DUMP_DIR"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    first, second = json.loads(r.stdout.strip().splitlines()[-1])
    assert first == ["linear", [2.0] * 4, 0]
    assert second == ["cosine", [2.0] * 4, 1]


def test_program_fingerprint_is_stable_and_sees_what_the_step_closes_over():
    """The ``program`` key entry (``persistent.program_fingerprint`` of ``trace_step``):
    two fresh traces of one step, with fresh function and optimizer objects (whose
    addresses differ, as they do between processes), agree; a changed closed-over array
    or learning rate inside the optimizer object changes it. (In this process only: no
    cache directory is set.)"""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import runtime as rt
    from runtime.persistent import program_fingerprint
    from runtime.program import trace_step

    def fingerprint(lr, bias):
        tx, b = optax.adam(lr), np.full((2,), bias, np.float32)

        def step(p, opt, x):
            g = jax.grad(lambda p: jnp.mean(jax.nn.gelu(x @ p + b) ** 2))(p)
            u, opt = tx.update(g, opt, p)
            return optax.apply_updates(p, u), opt
        rep = rt.replicate(step, num_replicas=2)
        p = np.ones((3, 2), np.float32)
        leaves, treedef, key = rep._key_of((p, tx.init(p), rt.distribute(np.ones((4, 3), np.float32), 2)))
        return program_fingerprint(trace_step(rep, leaves, treedef, key).graph)

    base = fingerprint(1e-3, 0.5)
    assert fingerprint(1e-3, 0.5) == base
    assert fingerprint(1e-4, 0.5) != base
    assert fingerprint(1e-3, 0.25) != base
