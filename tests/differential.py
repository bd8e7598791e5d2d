"""Runs a semantics :class:`~semantics_corpus.Case` through ``rt.replicate`` and through
its one-device reference, and compares every output of every replica.

Used by the corpus (``test_semantics_corpus.py``) and the random-program fuzzer
(``test_fuzz_semantics.py``).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import runtime as rt

#: rows per replica in static mode; in dynamic mode each replica draws 1..MAX_ROWS
ROWS, MAX_ROWS = 4, 7


@dataclass(frozen=True)
class Config:
    """One cell of the matrix: replicas, loss reduction, dynamic shapes, logical devices."""

    n: int
    reduction: str
    dynamic: bool
    k: int

    @property
    def id(self) -> str:
        return f"N{self.n}-{self.reduction}-{'dynamic' if self.dynamic else 'static'}-K{self.k}"


def matrix(dynamic_ok: bool = True) -> list[Config]:
    """N ∈ {1, 2, 4, 8} × {mean, sum} × {static, dynamic} × K ∈ {1, 2} (N·K ≤ 8 devices)."""
    return [Config(n, red, dyn, k) for n in (1, 2, 4, 8) for red in ("mean", "sum")
            for dyn in ((False, True) if dynamic_ok else (False,)) for k in (1, 2) if n * k <= 8]


#: an orthogonal array of strength 2 for one 4-level factor (N) and three 2-level ones
#: (reduction, dynamic shapes, K): every pair of levels of any two factors appears
_OA8 = ((0, 0, 0, 0), (0, 1, 1, 1), (1, 0, 0, 1), (1, 1, 1, 0),
        (2, 0, 1, 0), (2, 1, 0, 1), (3, 0, 1, 1), (3, 1, 0, 0))


#: the orthogonal array's two halves: each has every N once and each level of the 2-level
#: factors twice; together they are the array
_HALVES = ((0, 3, 5, 6), (1, 2, 4, 7))


def covering(index: int, dynamic_ok: bool = True) -> list[Config]:
    """Four cells of :func:`matrix`: one half of an orthogonal array that covers every
    pair of factor levels (``_OA8``; constructs take the halves in turn, so two of them
    cover every pair), with the levels of the 2-level factors flipped by ``index`` so
    that a corpus of many constructs visits every cell many times. Each construct runs
    every N and both levels of the others. (Four, not all eight: the suite's 10-minute
    budget; ``pytest --long`` runs the whole matrix.) N = 8 with K = 2 does not fit 8
    devices: such a row runs with K = 1."""
    flip = [(index >> b) & 1 for b in range(3)]
    out = []
    for a, b, c, d in (_OA8[i] for i in _HALVES[(index >> 3) & 1]):
        n = (1, 2, 4, 8)[a]
        red = ("mean", "sum")[b ^ flip[0]]
        dyn = bool(c ^ flip[1]) and dynamic_ok
        k = (1, 2)[d ^ flip[2]] if n < 8 else 1
        out.append(Config(n, red, dyn, k))
    return out


def split_params(tree: Any) -> Any:
    """The K = 2 annotation: every float matrix whose dim 1 is even is split column-wise
    over the 2 logical devices (numbers unchanged: it exercises the sharding pass)."""
    def ann(a):
        if getattr(a, "ndim", 0) == 2 and a.shape[1] % 2 == 0 and jnp.issubdtype(a.dtype, jnp.floating):
            return rt.split_to_logical_devices(a, [1, 2])
        return a
    return jax.tree.map(ann, tree)


def _identity(tree: Any) -> Any:
    return tree


def seed_of(*parts: Any) -> int:
    """A seed that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(parts).encode())


def make_inputs(case: Any, cfg: Config, seed: int) -> tuple[Any, list]:
    """The mirrored inputs and the per-replica batches of one run."""
    rng = np.random.default_rng(seed)
    p = case.params(rng)
    if cfg.dynamic:
        sizes = [int(s) for s in rng.integers(1, MAX_ROWS + 1, size=cfg.n)]
        sizes[0] = MAX_ROWS  # one replica fills the bucket, the others pad
    else:
        sizes = [ROWS] * cfg.n
    return p, [case.batch(rng, s) for s in sizes]


def run_case(case: Any, cfg: Config, seed: int = 0) -> list[str]:
    """Run one case in one configuration; the mismatches, each as one line (empty: all
    outputs of all replicas agree with the reference)."""
    p, vs = make_inputs(case, cfg, seed)
    ann = split_params if cfg.k > 1 else _identity
    step = rt.replicate(lambda p, v: case.step(p, v, ann), num_replicas=cfg.n,
                        logical_devices=cfg.k, loss_reduction=cfg.reduction,
                        options=rt.RunOptions(dynamic_shapes=cfg.dynamic))
    step.__name__ = case.name
    got = step(p, rt.PerReplica(vs))
    c = 1.0 / cfg.n if cfg.reduction == "mean" else 1.0
    want = jax.jit(case.reference)(p, vs, np.float32(c))
    return compare(got, want, case, cfg)


def compare(got: Any, want: list, case: Any, cfg: Config) -> list[str]:
    """Every leaf of ``got`` (a step's result: ``PerReplica`` or mirrored arrays) against
    each replica's reference output."""
    is_pr = lambda x: isinstance(x, rt.PerReplica)
    got_leaves, got_td = jax.tree_util.tree_flatten_with_path(got, is_leaf=is_pr)
    problems = []
    if len(want) != cfg.n:
        return [f"reference gave {len(want)} outputs for {cfg.n} replicas"]
    for r, w in enumerate(want):
        w_leaves, w_td = jax.tree.flatten(w)
        if len(w_leaves) != len(got_leaves):
            return [f"structure: step returned {got_td}, reference {w_td}"]
        for (path, g), e in zip(got_leaves, w_leaves):
            gv = np.asarray(g.values[r] if is_pr(g) else g)
            ev = np.asarray(e)
            where = f"{case.name}[{cfg.id}] out{jax.tree_util.keystr(path)} replica {r}"
            if gv.shape != ev.shape:
                problems.append(f"{where}: shape {gv.shape} != reference {ev.shape}")
                continue
            if gv.dtype != ev.dtype and not (np.issubdtype(gv.dtype, np.integer) and
                                             np.issubdtype(ev.dtype, np.integer)):
                problems.append(f"{where}: dtype {gv.dtype} != reference {ev.dtype}")
                continue
            a, b = gv.astype(np.float64), ev.astype(np.float64)
            if not np.allclose(a, b, rtol=case.rtol, atol=case.atol, equal_nan=True):
                err = np.max(np.abs(a - b))
                ratio = _ratio(a, b)
                problems.append(f"{where}: max |diff| {err:.3g}" +
                                (f", got/reference = {ratio:.4g} everywhere" if ratio else "") +
                                f"; got {np.ravel(a)[:4]}, reference {np.ravel(b)[:4]}")
    return problems


def _ratio(a: np.ndarray, b: np.ndarray) -> float | None:
    """The constant factor between two arrays, when there is one (an N× gradient)."""
    nz = np.abs(b) > 1e-6
    if not nz.any():
        return None
    q = a[nz] / b[nz]
    return float(q[0]) if np.allclose(q, q[0], rtol=1e-3) else None
