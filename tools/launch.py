"""Start a multi-process run on this machine (a local stand-in for a multi-host cluster).

    python -m tools.launch -n 2 [--devices-per-process 4] [--timeout 300] script.py [args...]

Starts ``n`` copies of ``python script.py args...``, each in its own process group, with
the variables ``rt.initialize_distributed()`` reads (``RT_COORDINATOR_ADDRESS`` on
127.0.0.1 and a free port, ``RT_NUM_PROCESSES``, ``RT_PROCESS_ID``), ``JAX_PLATFORMS=cpu``
unless set, and ``XLA_FLAGS`` giving each process ``--devices-per-process`` CPU devices.
Every output line is prefixed with ``[p<id>]``. When one process fails (or the timeout
passes) the others are killed; the exit status is the first failure's (124 on timeout;
128+N for a process killed by signal N, as a shell reports it), 0 when all succeed. A
SIGTERM or SIGINT sent to the launcher is forwarded to every process (then the launcher
exits 128+that signal).
"""
from __future__ import annotations

from tools._common import ArgumentParser as _ArgumentParser  # noqa: E402

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    """A TCP port nobody listens on now (the coordinator binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(pid: int, n: int, port: int, devices: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RT_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", RT_NUM_PROCESSES=str(n),
               RT_PROCESS_ID=str(pid), PYTHONUNBUFFERED="1")
    env.setdefault("JAX_PLATFORMS", "cpu")
    if devices is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()
    stream.close()


def kill_group(p: subprocess.Popen) -> None:
    """Kill a process started by ``launch`` and everything it started (its process group)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def launch(n: int, argv: list[str], devices_per_process: int | None = 4,
           timeout: float | None = None, out=None) -> int:
    """Run ``python argv...`` as ``n`` processes; return the exit status (see the module doc)."""
    out = out or sys.stdout
    port = free_port()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda s, _f: received.append(s))
    try:
        for pid in range(n):
            p = subprocess.Popen([sys.executable, *argv], env=_env(pid, n, port, devices_per_process),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # own process group: killable as one
            procs.append(p)
            t = threading.Thread(target=_pump, args=(p.stdout, f"[p{pid}] ", out), daemon=True)
            t.start()
            pumps.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        status = 0
        while True:
            if received:
                sig = received[0]
                out.write(f"[launch] received {signal.Signals(sig).name}; forwarding it to every "
                          f"process\n")
                for p in procs:
                    _signal_group(p, sig)
                _wait_all(procs, 10)
                status = 128 + sig
                break
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                # Popen reports death by signal N as -N; a shell (and we) report 128+N
                status = 128 - code if code < 0 else code
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with status {code}")
                out.write(f"[launch] process {i} {how}; killing the others\n")
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                out.write(f"[launch] timeout after {timeout} s; killing every process\n")
                status = 124
                break
            time.sleep(0.05)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            kill_group(p)
        for t in pumps:
            t.join(timeout=5)
        out.flush()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def _wait_all(procs: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def main(args: list[str] | None = None) -> int:
    ap = _ArgumentParser(prog="python -m tools.launch", description=__doc__.splitlines()[0])
    ap.add_argument("-n", "--num-processes", type=int, required=True,
                    help="how many processes to start")
    ap.add_argument("--devices-per-process", type=int, default=4,
                    help="CPU devices per process (XLA_FLAGS); 0: leave XLA_FLAGS alone")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds before killing all (status 124)")
    ap.add_argument("script", help="the Python script every process runs")
    ap.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    ns = ap.parse_args(args)
    if ns.num_processes < 1:
        ap.error(f"-n must be at least 1, got {ns.num_processes}")
    if ns.devices_per_process < 0:
        ap.error(f"--devices-per-process must be >= 0 (0: leave XLA_FLAGS alone), got "
                 f"{ns.devices_per_process}")
    if ns.timeout is not None and not ns.timeout > 0:
        ap.error(f"--timeout must be a positive number of seconds, got {ns.timeout}")
    if not os.path.isfile(ns.script):
        ap.error(f"{ns.script}: no such file")
    return launch(ns.num_processes, [ns.script, *ns.script_args],
                  ns.devices_per_process or None, ns.timeout)


if __name__ == "__main__":
    sys.exit(main())
