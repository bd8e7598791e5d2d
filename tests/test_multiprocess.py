"""Multi-process runs (issue 6.4): 2 processes × 4 CPU devices (jax.distributed, gloo)
give the same Adam parameters as 1 process × 8 devices; the launcher prefixes output,
propagates failures and leaves no process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 180


def _run(cmd, env_extra=None, timeout=TIMEOUT):
    """Run ``cmd`` in its own process group; kill the whole group in any case."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)              # the launcher / the command sets the devices
    env["JAX_PLATFORMS"] = "cpu"
    env.update(env_extra or {})
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out.decode(errors="replace")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_two_processes_equal_one_process_adam(tmp_path):
    mp_out, sp_out = tmp_path / "mp.npz", tmp_path / "sp.npz"
    rc, log = _run([sys.executable, "-m", "tools.launch", "-n", "2", "--devices-per-process", "4",
                    "--timeout", str(TIMEOUT - 20), "tests/mp/adam_train.py", str(mp_out)])
    assert rc == 0, log[-4000:]
    assert "[p0] process 0/2: 8 replicas, local [0, 1, 2, 3]" in log, log[-4000:]
    assert "[p1] process 1/2: 8 replicas, local [4, 5, 6, 7]" in log, log[-4000:]
    rc, log1 = _run([sys.executable, "tests/mp/adam_train.py", str(sp_out)],
                    {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert rc == 0, log1[-4000:]
    assert "process 0/1: 8 replicas" in log1
    # rt.reduce and SyncOnRead.read over every process's replicas, not the local ones
    # (before: 6 and 22 for the sum over two processes' 4 replicas each, of 28); an
    # accumulator made outside a step too (before: fresh 4 of 8, 20 where 10 was assigned)
    want = ("reductions: sum 28 mean 3.5 max 7 min 0 read 36 first 1 fresh 8 assigned 10 "
            "counted 10")
    assert f"[p0] {want}" in log and f"[p1] {want}" in log and want in log1, log[-4000:]
    mp, sp = np.load(mp_out), np.load(sp_out)
    mp1 = np.load(f"{mp_out}.p1.npz")
    assert sorted(mp) == sorted(sp) and len(sp) == 4
    for k in sp:
        np.testing.assert_allclose(mp[k], sp[k], rtol=1e-5, atol=1e-6, err_msg=k)
        np.testing.assert_array_equal(mp[k], mp1[k], err_msg=k)   # mirrored: same everywhere
    assert not np.allclose(sp["['params']['Dense_0']['kernel']"], 0)


def test_launcher_propagates_failure_and_kills_the_rest(tmp_path):
    pidfile = tmp_path / "p0.pid"
    t0 = time.monotonic()
    rc, log = _run([sys.executable, "-m", "tools.launch", "-n", "2", "--devices-per-process", "2",
                    "--timeout", "60", "tests/mp/fail.py", str(pidfile)], timeout=90)
    assert rc == 3, log
    assert time.monotonic() - t0 < 30
    assert "[p0] hello from 0 of 2 (2 devices)" in log and "[p1] hello from 1 of 2" in log
    assert "process 1 exited with status 3" in log
    deadline = time.monotonic() + 5
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if pidfile.exists():      # p0 got far enough to write its pid: it must be gone now
        assert not _alive(int(pidfile.read_text()))


def test_launcher_timeout(tmp_path):
    rc, log = _run([sys.executable, "-m", "tools.launch", "-n", "1", "--timeout", "2",
                    "tests/mp/fail.py", str(tmp_path / "pid")], timeout=60)
    assert rc == 124 and "timeout after 2" in log, log
    assert not _alive(int((tmp_path / "pid").read_text()))


def test_processes_with_different_argument_shapes_raise_with_the_numbers():
    """Two processes calling one step with different per-replica shapes (3 rows a replica
    against 2, or 0) or different mirrored weights: each would compile its own program,
    whose collectives do not match (before: process 1 returned its weights unchanged
    with no error, process 0 failed 30 s later in gloo). Now both raise
    ``ProcessMismatchError`` naming the leaf and both processes' shapes, before tracing."""
    rc, log = _run([sys.executable, "-m", "tools.launch", "-n", "2", "--devices-per-process", "4",
                    "--timeout", "100", "tests/mp/mismatch.py", "all"], timeout=120)
    assert rc == 0, log[-4000:]
    assert "NO ERROR" not in log, log[-4000:]
    for me, other in ((0, 1), (1, 0)):
        for mode, leaf, shapes in (("rows", 1, {0: "per-replica float32[3, 4]",
                                                1: "per-replica float32[2, 4]"}),
                                   ("empty", 1, {0: "per-replica float32[3, 4]",
                                                 1: "per-replica float32[0, 4]"}),
                                   ("mirrored", 0, {0: "float32[4, 1]", 1: "float32[5, 1]"})):
            want = (f"[p{me}] {mode}: ProcessMismatchError: replicate(step): the processes call "
                    f"the step with different arguments")
            line = next((ln for ln in log.splitlines() if ln.startswith(want)), None)
            assert line is not None, (want, log[-4000:])
            assert (f"argument leaf {leaf} is {shapes[me]} on process {me} and {shapes[other]} "
                    f"on process {other}") in line, line


def test_a_process_compiling_alone_raises_after_the_timeout():
    """The first call agrees; in the second, process 0's shapes are new (a compile) and
    process 1's are the first call's (a cache hit, no compile): process 0 waits for
    process 1's arguments ``RT_ARGUMENTS_TIMEOUT_S`` seconds, then raises naming its own,
    and the launcher ends process 1 (waiting in gloo for process 0's collectives)."""
    rc, log = _run([sys.executable, "-m", "tools.launch", "-n", "2", "--devices-per-process", "4",
                    "--timeout", "100", "tests/mp/mismatch.py", "later"],
                   {"RT_ARGUMENTS_TIMEOUT_S": "3"}, timeout=120)
    assert rc == 4, log[-4000:]
    assert "[p0] first call agrees: [0.19999998807907104" in log, log[-4000:]
    assert ("[p0] later: ProcessMismatchError: replicate(step): process 0 compiles the step for "
            "the 2nd time and process 1 did not within 3 s (RT_ARGUMENTS_TIMEOUT_S)") in log, \
        log[-4000:]
    assert "argument leaf 1: per-replica float32[2, 4]" in log, log[-4000:]
