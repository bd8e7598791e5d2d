"""Issue 10's differential corpus: every construct of ``semantics_corpus.CASES`` through
``rt.replicate`` against its one-device reference (zero mismatches: a failure lists
every output that differs, with the factor when it is a constant one, e.g. N×).

The matrix is N ∈ {1, 2, 4, 8} × {mean, sum} × {static, dynamic shapes} × K ∈ {1, 2}
logical devices (N·K ≤ 8; dynamic shapes where the construct allows them). By default
each construct runs four cells, every N and both levels of the other factors (half of an
orthogonal array that covers every pair of levels, the halves taken in turn and rotated
per construct so the corpus visits every cell); ``pytest --long`` runs every construct in
every cell (about 2,000 runs)."""
from __future__ import annotations

from differential import covering, matrix, run_case, seed_of
from semantics_corpus import CASES


def pytest_generate_tests(metafunc):
    if "cfg" not in metafunc.fixturenames:
        return
    long = metafunc.config.getoption("--long")
    params, ids = [], []
    for i, (name, case) in enumerate(sorted(CASES.items())):
        cells = matrix(case.dynamic) if long else covering(i, case.dynamic)
        for cfg in dict.fromkeys(cells):  # a repeated row runs once
            params.append((name, cfg))
            ids.append(f"{name}-{cfg.id}")
    metafunc.parametrize("name,cfg", params, ids=ids)


def test_corpus_is_large_enough():
    assert len(CASES) >= 60, len(CASES)


def test_construct(name, cfg):
    problems = run_case(CASES[name], cfg, seed_of(name, cfg.n))
    assert not problems, "\n".join(problems)
