"""The default run's choice of replica counts for the ports (``conftest.py``): each port
file runs at one count, and both counts stay covered by ports that are parametrized over
them; ``--long`` runs both (checked by collecting)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.clients._harness import REPLICAS
from tests.clients.conftest import HERE, _default_count, _port_files


def _ported_files() -> list[str]:
    """The port files that parametrize a test over ``REPLICAS``."""
    out = []
    for f in _port_files():
        with open(os.path.join(HERE, f)) as fh:
            if '"n", REPLICAS' in fh.read():
                out.append(f)
    return out


def test_both_counts_are_covered_by_default():
    counts = {f: _default_count(f) for f in _ported_files()}
    assert len(counts) >= 10, counts
    assert set(counts.values()) == set(REPLICAS), counts


def _collected(*extra: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "--collect-only", "-p",
         "no:cacheprovider", *extra, os.path.join(HERE, "test_flax_vae.py")],
        capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(HERE)), check=True)
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_long_runs_every_count_and_the_default_run_one():
    default, long = _collected(), _collected("--long")
    count = _default_count("test_flax_vae.py")
    other = next(n for n in REPLICAS if n != count)
    assert any(f"pmap_style[{count}]" in t for t in default), default
    assert not any(f"pmap_style[{other}]" in t for t in default), default
    assert any(f"pmap_style[{other}]" in t for t in long), long
    assert len(long) > len(default)
