"""Issue 10's random-program fuzzer in the suite: seeded, bounded (``FUZZ_PROGRAMS``
programs, about half a minute here, for the suite's 10-minute budget; ``pytest --long``
runs 1000), every output and gradient against the one-device reference of
``fuzz_semantics``. A failure prints the shrunk reproducer. The shrinker itself is
tested on a layer whose reference is known wrong."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

import fuzz_semantics as fz

FUZZ_PROGRAMS, LONG_PROGRAMS, CHUNK = 40, 1000, 10


def pytest_generate_tests(metafunc):
    if "first" in metafunc.fixturenames:
        count = LONG_PROGRAMS if metafunc.config.getoption("--long") else FUZZ_PROGRAMS
        metafunc.parametrize("first", range(0, count, CHUNK),
                             ids=[f"seeds{i}-{i + CHUNK - 1}" for i in range(0, count, CHUNK)])


def test_random_programs_agree_with_the_reference(first):
    failures = fz.fuzz(CHUNK, seed=first, log=lambda s: None)
    report = "\n\n".join(f"{problems[0]}\n{fz.render(prog)}" for prog, problems in failures)
    assert not failures, f"{len(failures)} of {CHUNK} programs disagree:\n{report}"


def test_shrinker_reduces_a_failure_to_its_cause():
    """A layer whose global meaning is off by 2 (a planted bug) among four good layers,
    on 8 replicas with K=2 and an identical loss: the run must see the mismatch and the
    shrinker must keep only that layer, on one replica, K=1, with the plain loss."""
    bad = fz.Layer("h = BAD(h)", lambda p, h: 2.0 * h @ p["w"],
                   lambda p, hs, n: [h @ p["w"] for h in hs])
    good = [fz.SIMPLE["tanh"], fz.SIMPLE["bias"], fz.COLLECTIVE["stat_mean"], fz.SIMPLE["square"]]
    prog = fz.Program(tuple(good[:2]) + (bad,) + tuple(good[2:]), "pmean", n=8,
                      reduction="sum", k=1, dynamic=False, seed=3)
    assert fz.run(prog), "the planted bug was not detected"
    small = fz.shrink(prog)
    assert [l.source for l in small.layers] == ["h = BAD(h)"]
    assert (small.n, small.k, small.loss) == (1, 1, "mean")
    assert "h = BAD(h)" in fz.render(small) and "num_replicas=1" in fz.render(small)
    # and a correct program is left alone
    assert not fz.run(dataclasses.replace(prog, layers=tuple(good)))
