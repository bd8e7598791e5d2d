"""Issue 13: faults are survived without losing work. A cache folder that cannot be used
costs the compile it would have saved, never the step; damaged, foreign and concurrently
written cache records are recompiled, never run; an abandoned input iterator stops its
thread; threads racing on a cold step compile it once; ``tools.launch`` forwards SIGTERM
and reports a child killed by a signal as 128+signal. Steps that use a persistent cache
run in fresh processes (JAX's compilation cache folder is process-wide)."""
from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt
from tests.test_persistent_cache import WORKER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _step(w, x):
    return w - 0.1 * jnp.mean(x, axis=0)


# -- a cache folder that cannot be used ------------------------------------------------------
@pytest.mark.parametrize("blocked", ["cache_dir_is_a_file", "rt_is_a_file"])
def test_unusable_cache_dir_warns_once_and_runs_uncached(tmp_path, blocked):
    root = tmp_path / "cache"
    if blocked == "cache_dir_is_a_file":
        root.write_text("in the way")
    else:
        root.mkdir()
        (root / "rt").write_text("in the way")
    w, x = np.ones(3, np.float32), np.arange(12, dtype=np.float32).reshape(4, 3)
    want = w - 0.1 * x.mean(0)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        for _ in range(2):  # two steps on the same folder: one warning
            step = rt.replicate(_step, num_replicas=2, options=rt.RunOptions(cache_dir=str(root)))
            out = step(w, rt.PerReplica([x[:2], x[2:]]))
            out2 = step(w, rt.PerReplica([x[:2], x[2:]]))
    msgs = [str(m.message) for m in ws if issubclass(m.category, RuntimeWarning)]
    assert len(msgs) == 1 and "cannot be used" in msgs[0] and "running without it" in msgs[0], msgs
    assert str(root) in msgs[0]
    assert isinstance(out, rt.PerReplica)
    for r in range(2):
        np.testing.assert_allclose(out.values[r], w - 0.1 * [x[:2], x[2:]][r].mean(0), rtol=1e-6)
    np.testing.assert_allclose(out2.values[0], out.values[0])
    info = step.cache_info()
    assert (info.misses, info.disk_hits, info.disk_writes) == (1, 0, 0)
    del want


# -- records that must not run -------------------------------------------------------------------
def _worker(tmp_path, cache, **env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    e = dict(os.environ, ROOT=ROOT, **env)
    for k in ("XLA_FLAGS", "RT_CACHE_DIR", "RT_DUMP_DIR"):
        e.pop(k, None)
    e.update(env)
    return subprocess.Popen([sys.executable, str(script), str(cache)], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _records(cache) -> list:
    return sorted(f for f in os.listdir(os.path.join(cache, "rt")) if f.endswith(".rec"))


def test_foreign_record_is_recompiled_not_run(tmp_path):
    """A record stored under another key's file name (copied, renamed) has a valid
    checksum but is another program: it must be refused, never executed."""
    cache = tmp_path / "cache"
    a = _result(_worker(tmp_path, cache, SCALE="0.1"))     # writes program A's record
    rec_a = _records(cache)
    b = _result(_worker(tmp_path, cache, SCALE="0.7"))     # another program: its own record
    rec_b = [f for f in _records(cache) if f not in rec_a]
    assert len(rec_a) == 1 and len(rec_b) == 1 and a["w"] != b["w"]
    shutil.copyfile(cache / "rt" / rec_a[0], cache / "rt" / rec_b[0])  # A's bytes under B's name
    again = _result(_worker(tmp_path, cache, SCALE="0.7"))
    assert again["w"] == b["w"], "the foreign record (program A) was executed"
    assert any("holds the record of another key" in m and "recompiling" in m
               for m in again["warnings"]), again["warnings"]
    assert again["info"][1] == 1 and again["compiles"] == again["info"][1] - again["info"][3]


@pytest.mark.parametrize("damage", ["truncate", "zero"])
def test_damaged_record_is_recompiled_not_run(tmp_path, damage):
    cache = tmp_path / "cache"
    first = _result(_worker(tmp_path, cache))
    (rec,) = _records(cache)
    path = cache / "rt" / rec
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\0" * len(data))
    again = _result(_worker(tmp_path, cache))
    assert again["w"] == first["w"] and any("recompiling" in m for m in again["warnings"])
    assert again["info"][3] in (0, 1)  # a fresh record (or JAX's own cache) serves it


def test_two_processes_sharing_a_cache_dir(tmp_path):
    """Two processes compiling the same step into one cache folder at once: both finish
    with the same numbers, the record left behind is whole, and a third process loads it."""
    cache = tmp_path / "cache"
    procs = [_worker(tmp_path, cache) for _ in range(2)]
    res = [_result(p) for p in procs]
    assert res[0]["w"] == res[1]["w"] and not any(r["warnings"] for r in res)
    third = _result(_worker(tmp_path, cache))
    assert third["w"] == res[0]["w"] and third["compiles"] == 0 and not third["warnings"]


# -- threads and iterators ---------------------------------------------------------------------
def test_eight_threads_on_one_cold_step_compile_once():
    calls = []

    def fn(w, x):
        calls.append(1)  # once per trace
        return w * 2 + jnp.sum(x)
    step = rt.replicate(fn, num_replicas=2)
    w, x = np.ones(3, np.float32), np.ones((4, 2), np.float32)
    barrier = threading.Barrier(8)
    outs, errors = [None] * 8, []

    def run(i):
        try:
            barrier.wait()
            outs[i] = np.asarray(step(w, rt.distribute(x, 2)).values[0])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(calls) == 1
    assert step.cache_info().misses == 1
    for o in outs:
        np.testing.assert_allclose(o, w * 2 + 4.0)


def _iterator_threads():
    return [t for t in threading.enumerate() if t.name == "rt-distribute-iterator" and t.is_alive()]


def test_abandoned_iterator_stops_its_thread():
    before = len(_iterator_threads())

    def endless():
        while True:
            yield np.ones((4, 3), np.float32)
    it = rt.distribute_iterator(endless(), num_replicas=2, prefetch=2)
    first = next(it)
    assert isinstance(first, rt.PerReplica) and len(_iterator_threads()) == before + 1
    del it, first  # no close(): only the last reference goes
    gc.collect()
    deadline = time.monotonic() + 10
    while len(_iterator_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_iterator_threads()) == before


# -- tools.launch and signals ---------------------------------------------------------------------
SLEEPER = '''
import os, signal, sys, time
if sys.argv[1:] == ["kill"] and os.environ["RT_PROCESS_ID"] == "1":
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(7)))
print("ready", flush=True)
time.sleep(60)
'''


def _launch(tmp_path, *args):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", "tools.launch", "-n", "2",
                             "--devices-per-process", "0", str(tmp_path / "sleeper.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_launch_reports_a_child_killed_by_a_signal_as_128_plus_signal(tmp_path):
    p = _launch(tmp_path, "kill")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGKILL, out
    assert "process 1 was killed by SIGKILL" in out


def test_launch_forwards_sigterm_to_its_workers(tmp_path):
    p = _launch(tmp_path)
    seen = []
    deadline = time.monotonic() + 60
    while sum("ready" in line for line in seen) < 2 and time.monotonic() < deadline:
        seen.append(p.stdout.readline())
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    out = "".join(seen) + out
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "[p0] got SIGTERM" in out and "[p1] got SIGTERM" in out, out
    assert "received SIGTERM; forwarding it" in out


def test_cache_dir_without_write_permission_runs_uncached(tmp_path, monkeypatch):
    """No write permission (simulated: the suite may run as root, whom chmod does not
    stop): the probe write fails with EACCES, so the step warns and runs uncached."""
    import errno
    import tempfile
    from runtime import persistent
    root = tmp_path / "readonly"
    real = tempfile.mkstemp

    def denied(*a, dir=None, **kw):
        if dir is not None and str(root) in str(dir):
            raise PermissionError(errno.EACCES, "Permission denied", str(dir))
        return real(*a, dir=dir, **kw)
    monkeypatch.setattr(persistent.tempfile, "mkstemp", denied)
    step = rt.replicate(_step, num_replicas=2, options=rt.RunOptions(cache_dir=str(root)))
    w, x = np.ones(3, np.float32), np.ones((4, 3), np.float32)
    with pytest.warns(RuntimeWarning, match=r"cannot be used \(Permission denied.*running without it"):
        out = step(w, rt.distribute(x, 2))
    np.testing.assert_allclose(out.values[0], w - 0.1)
    assert step.cache_info().disk_writes == 0
