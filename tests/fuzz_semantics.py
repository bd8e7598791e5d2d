"""A seeded random-program fuzzer for gradient semantics (issue 10), with a shrinker.

A program is a list of :class:`Layer` s applied to one replica's activations ``h`` (rows
of the replica's batch), followed by a loss. Every layer has two meanings written side
by side: ``local`` (what one replica runs inside ``rt.replicate``) and ``glob`` (the
same layer over every replica's activations at once, on one device, with collectives
written as the sums, means and concatenations they are). The reference is the global
program's exact JAX derivative, combined by TF's rule (``c · ∇ Σ_r L_r``, an identical
loss counted once per replica); every output and gradient must agree.

On a mismatch, :func:`shrink` removes layers (and simplifies the configuration) while
the mismatch persists and :func:`render` prints the smallest program as Python source
that reproduces it::

    python tests/fuzz_semantics.py --count 500 --seed 7     # or: pytest tests/test_fuzz_semantics.py --long
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import runtime as rt

D = 4


@dataclass(frozen=True)
class Layer:
    """One layer: its source text (for reproducers), the replica's version and the
    global version (``glob(p, hs, n) -> hs``, ``hs`` a list over replicas)."""

    source: str
    local: Callable[[dict, jax.Array], jax.Array]
    glob: Callable[[dict, list, int], list]
    dynamic_ok: bool = True


def _each(f: Callable) -> Callable:
    return lambda p, hs, n: [f(p, h, r) for r, h in enumerate(hs)]


def _pointwise(source: str, f: Callable[[dict, jax.Array], jax.Array]) -> Layer:
    return Layer(source, f, _each(lambda p, h, r: f(p, h)))


def _scaled_vjp(k: float) -> Callable:
    @jax.custom_vjp
    def f(x):
        return x
    f.defvjp(lambda x: (x, None), lambda _, g: (k * g,))
    return f


_SCALED = {k: _scaled_vjp(k) for k in (-1.0, 0.5, 3.0)}


def _stat(op: str) -> Layer:
    """h + all_reduce(mean(h, 0), op): a statistic over every replica's rows."""
    red = {"sum": lambda xs: sum(xs), "mean": lambda xs: sum(xs) / len(xs),
           "max": lambda xs: jnp.max(jnp.stack(xs), 0), "min": lambda xs: jnp.min(jnp.stack(xs), 0)}[op]

    def glob(p, hs, n):
        s = red([jnp.mean(h, 0) for h in hs])
        return [h + 0.5 * s for h in hs]
    return Layer(f"h = h + 0.5 * rt.all_reduce(jnp.mean(h, 0), {op!r})",
                 lambda p, h: h + 0.5 * rt.all_reduce(jnp.mean(h, 0), op), glob)


def _gather() -> Layer:
    def glob(p, hs, n):
        allh = jnp.concatenate(hs, 0)
        return [h + 0.1 * jnp.mean(allh * jnp.sum(allh), 0) for h in hs]
    return Layer("g = rt.all_gather(h, axis=0); h = h + 0.1 * jnp.mean(g * jnp.sum(g), 0)",
                 lambda p, h: h + 0.1 * jnp.mean((g := rt.all_gather(h, axis=0)) * jnp.sum(g), 0),
                 glob, dynamic_ok=False)


def _cond_per_replica(a: Layer, b: Layer) -> Layer:
    """lax.cond on the replica's own data (the first row's first feature)."""
    def glob(p, hs, n):
        outs_a, outs_b = a.glob(p, hs, n), b.glob(p, hs, n)
        return [jnp.where(h[0, 0] > 0, oa, ob) for h, oa, ob in zip(hs, outs_a, outs_b)]
    src = f"h = lax.cond(h[0, 0] > 0, lambda h: [{a.source}], lambda h: [{b.source}], h)"
    return Layer(src, lambda p, h: lax.cond(h[0, 0] > 0, lambda h: a.local(p, h),
                                            lambda h: b.local(p, h), h), glob,
                 a.dynamic_ok and b.dynamic_ok)


def _cond_mirrored(a: Layer, b: Layer) -> Layer:
    def glob(p, hs, n):
        pred = jnp.sum(p["w"]) > 0
        outs_a, outs_b = a.glob(p, hs, n), b.glob(p, hs, n)
        return [jnp.where(pred, oa, ob) for oa, ob in zip(outs_a, outs_b)]
    src = f"h = lax.cond(jnp.sum(p['w']) > 0, lambda h: [{a.source}], lambda h: [{b.source}], h)"
    return Layer(src, lambda p, h: lax.cond(jnp.sum(p["w"]) > 0, lambda h: a.local(p, h),
                                            lambda h: b.local(p, h), h), glob,
                 a.dynamic_ok and b.dynamic_ok)


def _scan2() -> Layer:
    def f(p, h):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, jnp.stack([p["w"], p["w"].T]))[0]
    return Layer("h = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, jnp.stack([p['w'], p['w'].T]))[0]",
                 f, _each(lambda p, h, r: f(p, h)))


def _remat(a: Layer) -> Layer:
    return Layer(f"h = jax.checkpoint(lambda p, h: [{a.source}])(p, h)",
                 lambda p, h: jax.checkpoint(a.local)(p, h), a.glob, a.dynamic_ok)


#: the simple layers (no collectives, no control flow), by name
SIMPLE: dict[str, Layer] = {
    "matmul": _pointwise("h = h @ p['w']", lambda p, h: h @ p["w"]),
    "bias": _pointwise("h = h + p['v']", lambda p, h: h + p["v"]),
    "tanh": _pointwise("h = jnp.tanh(h)", lambda p, h: jnp.tanh(h)),
    "sin": _pointwise("h = jnp.sin(h) * p['s']", lambda p, h: jnp.sin(h) * p["s"]),
    "square": _pointwise("h = 0.5 * h * h", lambda p, h: 0.5 * h * h),
    "relu": _pointwise("h = jax.nn.relu(h + 0.1)", lambda p, h: jax.nn.relu(h + 0.1)),
    "stop": _pointwise("h = h + 0.5 * lax.stop_gradient(h)", lambda p, h: h + 0.5 * lax.stop_gradient(h)),
    "local_view": _pointwise("h = h @ rt.local(p['w'])", None),  # filled below
    "softmax_rows": _pointwise("h = jax.nn.softmax(h, axis=-1) * p['s']",
                               lambda p, h: jax.nn.softmax(h, axis=-1) * p["s"]),
    "layernorm": _pointwise("h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-3)",
                            lambda p, h: (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-3)),
    "scan2": _scan2(),
    "replica_weight": Layer("h = h * (1.0 + 0.25 * rt.replica_id())",
                            lambda p, h: h * (1.0 + 0.25 * rt.replica_id()),
                            _each(lambda p, h, r: h * (1.0 + 0.25 * r))),
}
SIMPLE["local_view"] = Layer("h = h @ rt.local(p['w'])", lambda p, h: h @ rt.local(p["w"]),
                             _each(lambda p, h, r: h @ p["w"]))
for _k, _f in _SCALED.items():
    SIMPLE[f"vjp_scale_{_k}"] = _pointwise(f"h = scaled_vjp({_k})(h)", lambda p, h, _f=_f: _f(h))
COLLECTIVE = {f"stat_{op}": _stat(op) for op in ("sum", "mean", "max", "min")}
COLLECTIVE["gather"] = _gather()


def random_layer(rng: np.random.Generator, depth: int = 0) -> Layer:
    """A random layer: mostly simple ones, some collectives, some control flow."""
    u = rng.random()
    simple = list(SIMPLE.values())
    if u < 0.6 or depth > 0:
        return simple[rng.integers(len(simple))]
    if u < 0.75:
        coll = list(COLLECTIVE.values())
        return coll[rng.integers(len(coll))]
    if u < 0.85:
        return _cond_per_replica(random_layer(rng, 1), random_layer(rng, 1))
    if u < 0.92:
        return _cond_mirrored(random_layer(rng, 1), random_layer(rng, 1))
    return _remat(random_layer(rng, 1))


@dataclass(frozen=True)
class Program:
    """A random program and the configuration it runs in."""

    layers: tuple[Layer, ...]
    loss: str            # "mean" (per replica), "pmean" (identical), "mean+reg"
    n: int
    reduction: str
    k: int
    dynamic: bool
    seed: int

    def loss_local(self, p, h):
        l = jnp.mean(h ** 2)
        if self.loss == "pmean":
            l = rt.all_reduce(l, "mean")
        elif self.loss == "mean+reg":
            l = l + 0.1 * jnp.sum(p["w"] ** 2)
        return l

    def losses_global(self, p, hs):
        ls = [jnp.mean(h ** 2) for h in hs]
        if self.loss == "pmean":
            ls = [sum(ls) / len(ls)] * len(ls)
        elif self.loss == "mean+reg":
            ls = [l + 0.1 * jnp.sum(p["w"] ** 2) for l in ls]
        return ls


def random_program(seed: int) -> Program:
    rng = np.random.default_rng(seed)
    layers = tuple(random_layer(rng) for _ in range(int(rng.integers(1, 6))))
    n = int(rng.choice([1, 2, 4, 8]))
    k = int(rng.choice([1, 2])) if n <= 4 else 1
    dynamic = bool(rng.random() < 0.3) and all(l.dynamic_ok for l in layers)
    return Program(layers, str(rng.choice(["mean", "pmean", "mean+reg"])), n,
                   str(rng.choice(["mean", "sum"])), k, dynamic, seed)


def _params(rng: np.random.Generator) -> dict:
    return {"w": (rng.normal(size=(D, D)) * 0.6).astype(np.float32),
            "v": (rng.normal(size=(D,)) * 0.3).astype(np.float32),
            "s": np.float32(rng.normal() * 0.5 + 1.0)}


def _annotate(p: dict, k: int) -> dict:
    return {**p, "w": rt.split_to_logical_devices(p["w"], [1, 2])} if k > 1 else p


def run(prog: Program) -> list[str]:
    """Run ``prog`` through ``rt.replicate`` and the reference; the mismatches."""
    rng = np.random.default_rng(prog.seed + 1)
    p = _params(rng)
    sizes = ([int(s) for s in rng.integers(1, 7, size=prog.n)] if prog.dynamic
             else [3] * prog.n)
    xs = [rng.normal(size=(s, D)).astype(np.float32) for s in sizes]

    def step(p, x):
        def loss(p):
            q = _annotate(p, prog.k)
            h = x
            for layer in prog.layers:
                h = layer.local(q, h)
            return prog.loss_local(q, h)
        return jax.value_and_grad(loss)(p)

    def reference(p, xs, c):
        def total(p):
            hs = list(xs)
            for layer in prog.layers:
                hs = layer.glob(p, hs, len(xs))
            ls = prog.losses_global(p, hs)
            return sum(ls), ls
        (_, ls), g = jax.value_and_grad(total, has_aux=True)(p)
        return ls, jax.tree.map(lambda a: c * a, g)

    rstep = rt.replicate(step, num_replicas=prog.n, logical_devices=prog.k,
                         loss_reduction=prog.reduction,
                         options=rt.RunOptions(dynamic_shapes=prog.dynamic))
    try:
        loss, grads = rstep(p, rt.PerReplica(xs))
    except Exception as e:  # noqa: BLE001 - any error is a finding, reported with the program
        return [f"raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"]
    c = np.float32(1.0 / prog.n if prog.reduction == "mean" else 1.0)
    want_l, want_g = jax.jit(reference)(p, xs, c)
    problems = []
    for r in range(prog.n):
        got_l = loss.values[r] if isinstance(loss, rt.PerReplica) else loss
        if not np.allclose(got_l, want_l[r], rtol=2e-4, atol=1e-5):
            problems.append(f"loss of replica {r}: {float(got_l):.6g} != {float(want_l[r]):.6g}")
    for name in ("w", "v", "s"):
        g = grads[name]
        g = g.values[0] if isinstance(g, rt.PerReplica) else g
        if isinstance(grads[name], rt.PerReplica):
            problems.append(f"grad {name} came back per replica")
        if not np.allclose(g, want_g[name], rtol=2e-4, atol=1e-5):
            ratio = np.asarray(g).ravel()[:3] / np.where(np.asarray(want_g[name]).ravel()[:3] == 0, 1,
                                                          np.asarray(want_g[name]).ravel()[:3])
            problems.append(f"grad {name}: got {np.asarray(g).ravel()[:3]}, want "
                            f"{np.asarray(want_g[name]).ravel()[:3]} (ratio {ratio})")
    return problems


def shrink(prog: Program, fails: Callable[[Program], bool] | None = None) -> Program:
    """The smallest program found that still fails: drop layers one at a time, replace a
    control-flow layer by one of its branches' layers, fewer replicas, K = 1, static
    shapes, a plain loss; repeat until nothing smaller fails."""
    fails = fails or (lambda q: bool(run(q)))
    changed = True
    while changed:
        changed = False
        for cand in _smaller(prog):
            if fails(cand):
                prog, changed = cand, True
                break
    return prog


def _smaller(prog: Program):
    for i in range(len(prog.layers)):
        if len(prog.layers) > 1:
            yield dataclasses.replace(prog, layers=prog.layers[:i] + prog.layers[i + 1:])
    for i, layer in enumerate(prog.layers):
        for inner in _inner_layers(layer):
            yield dataclasses.replace(prog, layers=prog.layers[:i] + (inner,) + prog.layers[i + 1:])
    if prog.k > 1:
        yield dataclasses.replace(prog, k=1)
    if prog.dynamic:
        yield dataclasses.replace(prog, dynamic=False)
    if prog.loss != "mean":
        yield dataclasses.replace(prog, loss="mean")
    for n in (1, 2, 4):
        if n < prog.n:
            yield dataclasses.replace(prog, n=n)


def _inner_layers(layer: Layer) -> list[Layer]:
    """The layers a control-flow layer was built from (by source text)."""
    return [l for l in list(SIMPLE.values()) + list(COLLECTIVE.values())
            if l.source != layer.source and f"[{l.source}]" in layer.source]


def render(prog: Program) -> str:
    """``prog`` as a standalone Python reproducer."""
    lines = [f"# fuzz seed {prog.seed}: N={prog.n}, K={prog.k}, loss_reduction={prog.reduction!r}, "
             f"dynamic_shapes={prog.dynamic}",
             "def step(p, x):", "    def loss(p):"]
    if prog.k > 1:
        lines.append("        p = {**p, 'w': rt.split_to_logical_devices(p['w'], [1, 2])}")
    lines.append("        h = x")
    lines += [f"        {l.source}" for l in prog.layers]
    lines.append({"mean": "        return jnp.mean(h ** 2)",
                  "pmean": "        return rt.all_reduce(jnp.mean(h ** 2), 'mean')",
                  "mean+reg": "        return jnp.mean(h ** 2) + 0.1 * jnp.sum(p['w'] ** 2)"}[prog.loss])
    lines.append("    return jax.value_and_grad(loss)(p)")
    lines.append(f"rt.replicate(step, num_replicas={prog.n}, logical_devices={prog.k}, "
                 f"loss_reduction={prog.reduction!r}, options=rt.RunOptions(dynamic_shapes={prog.dynamic}))")
    return "\n".join(lines)


def fuzz(count: int, seed: int = 0, log: Callable[[str], None] = print) -> list[tuple[Program, list[str]]]:
    """Run ``count`` random programs from ``seed``; each failure shrunk, as (program, problems)."""
    failures = []
    for i in range(count):
        prog = random_program(seed + i)
        problems = run(prog)
        if problems:
            small = shrink(prog)
            failures.append((small, run(small) or problems))
            log(f"seed {prog.seed}: {problems[0]}\nminimal reproducer:\n{render(small)}\n")
    return failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=40, help="programs to run (default 40)")
    ap.add_argument("--seed", type=int, default=0, help="first program's seed")
    ap.add_argument("--long", action="store_true", help="run 1000 programs")
    args = ap.parse_args(argv)
    count = 1000 if args.long else args.count
    t0 = time.perf_counter()
    failures = fuzz(count, args.seed)
    print(f"{count} programs, {len(failures)} failures, {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
    sys.exit(main())
