"""Dynamic shapes for ``replicate``: trace once with symbolic dims, pad to buckets, mask,
unpad (``RunOptions(dynamic_shapes=True)``).

- Which dims are dynamic: axis 0 of every leaf of every ``PerReplica`` argument (symbol
  ``b``, shared by all of them, so ``x`` and ``y`` of one batch may meet), or
  ``RunOptions(dynamic_dims={arg_index: axes})`` where ``axes`` is a tuple of axes (axis 0
  is ``b``, axis k is ``dk``) or a dict ``{axis: symbol}``; arguments not named keep the
  default. Replicas may hold different sizes in one call (an uneven last batch: see
  :func:`distribute_uneven`); every leaf with the same symbol must agree within a replica.
- ``maximum_shapes``: one entry per positional argument: ``None``, a shape tuple (``None``
  entries unbounded) applied to every leaf, or a pytree of shape tuples. A larger input is
  a ``ValueError`` naming the bound and the size. The bound caps the bucket and prints in
  the IR (``f32[b<=128,16]``).
- Bucketing of each symbol's largest size over the replicas (:func:`make_bucketer`):
  ``"pow2"`` (TF's POWER_OF_TWO), ``"none"`` (the bound), a list of sizes, a callable
  ``size -> bucket``, or ``"auto"`` (see :class:`AutoBuckets`).
- One trace per symbolic signature (the structure, dtypes, static dims, symbols and
  bounds); the ``padding`` pass (inserted before ``sharding``) makes one program per
  bucket; the cache key holds the bucket sizes, so ``cache_info().misses`` counts one
  compile per bucket. Each call logs its bucket (``logging.getLogger("runtime")``, INFO)
  and more compiles than ``RunOptions(max_compiles_warning=...)`` warn once.
- The real sizes go in as run-time ``s32`` arguments, one per replica per symbol, sent
  with the call's other inputs; inputs are zero-padded at the end of each dynamic axis
  (the masks make the result independent of what the padding holds), on the host, device
  arrays included (padding on a device would compile a program per exact size), unless
  they already have the bucket's shape; results are cut back to the real sizes on the
  host when ``.values`` is read, for the same reason. Nothing is compiled per exact size,
  only per bucket; outputs keep their padded axes sliced back to each replica's real
  size (deferred ``PerReplica`` values of different lengths).
- Each bucket is planned once (:class:`_Plan`: program, padding per leaf, how each host
  input is sent; at most ``PLAN_MEMO_SIZE``). A later call whose per-replica values are
  arrays reads its sizes and buckets off the shapes in one pass and goes to that plan,
  so its cost does not depend on whether its exact sizes were seen before; the first
  call of a bucket, calls with ``maximum_shapes`` and calls with values other than
  arrays are validated and bucketed in full.
- Gradient all-reduce keeps TF's semantics: each replica's ``mean`` divides by its own
  real size (``dim_as_value`` in the trace), and gradients are then averaged over replicas.

Not supported (errors, never silent): ``steps_per_call > 1``, several processes,
``donate=True``, Python code whose shapes depend on comparing a dynamic size with a
number (a ``ValueError`` naming the line; a bound in ``maximum_shapes`` settles some), and
the ops the ``padding`` pass rejects (loops over padded values, ``rev``, windows, padded
updates onto real elements, ...). The persistent cache is not used (a warning).
"""
from __future__ import annotations

import bisect
import logging
import os
import re
import threading
import warnings
from typing import Any, Callable, Iterator

import jax
import numpy as np

from compiler.lower import build_jitted
from compiler.pass_manager import PassManager, parse_pipeline
from compiler.trace import LeafSpec, global_shape, trace_replica_fn
from ir import _jax_compat as jc
from ir.graph import Graph, Value
from ir.types import Replica, SymDim, TensorType
from runtime.divergence import check_diverging_state, watching_local_views
from runtime.per_replica import LEAF_TREEDEF, PerReplica
from runtime.program import Program, call_step, leaf_sig

log = logging.getLogger("runtime")


# -- bucketing -----------------------------------------------------------------------------

def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class AutoBuckets:
    """``bucketing="auto"``: buckets chosen from the sizes seen so far.

    Rule: a size n reuses the smallest bucket already made that is >= n when that bucket
    is at most ``reuse`` × n (default 1.5: at most a third of its rows are padding);
    otherwise it makes a new bucket, n rounded up to a grid of ``steps`` sizes per power of
    two (default 4: 8, 10, 12, 14, 16, 20, 24, 28, 32, ...; at most 20% padding). So
    compiles grow like ``steps`` per octave actually seen and the padded work stays under
    about a third, against pow2's one compile per octave and up to half the work wasted
    (measured in benchmarks/bench_dynamic.py)."""

    def __init__(self, reuse: float = 1.5, steps: int = 4):
        self.reuse, self.steps = reuse, steps
        self.made: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, n: int) -> int:
        with self.lock:
            i = bisect.bisect_left(self.made, n)
            if i < len(self.made) and self.made[i] <= self.reuse * n:
                return self.made[i]
            if n <= self.steps:
                b = n
            else:
                unit = max(1, (1 << (n.bit_length() - 1)) // self.steps)
                b = -(-n // unit) * unit
            bisect.insort(self.made, b)
            return b


def make_bucketer(spec: Any, multiple: int = 1) -> Callable[[int, int | None], int]:
    """``(size, bound or None) -> bucket`` for a ``RunOptions.bucketing`` value.
    ``multiple``: ``"pow2"`` and ``"auto"`` buckets are rounded up to a multiple of it (the
    logical devices, which a padded axis split over them must divide: a pow2 bucket of 1
    cannot be split 2 ways), as far as the bound allows; a list or callable gives its own."""
    if multiple > 1 and spec in ("pow2", "auto"):
        plain = make_bucketer(spec)

        def rounded(n: int, bound: int | None) -> int:
            b = -(-plain(n, bound) // multiple) * multiple
            return b if bound is None or b <= bound else plain(n, bound)
        return rounded
    if spec == "pow2":
        return lambda n, bound: min(_pow2(n), bound) if bound else _pow2(n)
    if spec == "none":
        def none(n: int, bound: int | None) -> int:
            if bound is None:
                raise ValueError("RunOptions(bucketing='none') pads to the bound and needs "
                                 "maximum_shapes for every dynamic dim")
            return bound
        return none
    if spec == "auto":
        auto = AutoBuckets()
        return lambda n, bound: min(auto(n), bound) if bound else auto(n)
    if isinstance(spec, (list, tuple)):
        sizes = sorted(int(s) for s in spec)
        if not sizes or sizes[0] < 1:
            raise ValueError(f"RunOptions(bucketing=...): a list of positive sizes, got {spec!r}")

        def listed(n: int, bound: int | None) -> int:
            i = bisect.bisect_left(sizes, n)
            if i == len(sizes):
                raise ValueError(f"dynamic size {n} exceeds the largest bucket {sizes[-1]} "
                                 f"of RunOptions(bucketing={sizes})")
            return sizes[i]
        return listed
    if callable(spec):
        def custom(n: int, bound: int | None) -> int:
            b = int(spec(n))
            if b < n:
                raise ValueError(f"RunOptions(bucketing=<callable>) returned {b} for size {n}; "
                                 f"a bucket must be >= the size")
            return b
        return custom
    raise ValueError(f"RunOptions(bucketing=...) must be 'pow2', 'none', 'auto', a list of "
                     f"sizes or a callable, got {spec!r}")


def check_options(options: Any) -> None:
    """Validate the dynamic-shape fields of ``RunOptions`` (called when dynamic_shapes)."""
    make_bucketer(options.bucketing)  # raises for a spec it cannot use
    if options.dynamic_dims is not None and not isinstance(options.dynamic_dims, dict):
        raise ValueError(f"RunOptions(dynamic_dims=...) must be a dict {{arg_index: axes}}, "
                         f"got {options.dynamic_dims!r}")


def distribute_uneven(tree: Any, num_replicas: int) -> PerReplica:
    """Split every leaf along axis 0 into ``num_replicas`` nearly equal parts (the first
    ones one longer, as ``numpy.array_split``): an uneven last batch for a dynamic step.
    NumPy leaves are copied, as by ``rt.distribute``: the caller may refill its buffer."""
    leaves, td = jax.tree.flatten(tree)
    parts = [_array_split(np.array(x) if isinstance(x, np.ndarray) else x, num_replicas)
             for x in leaves]
    return PerReplica([td.unflatten([p[r] for p in parts]) for r in range(num_replicas)])


def _array_split(x: Any, n: int) -> list:
    """``numpy.array_split(x, n)`` along axis 0; an array NumPy cannot hold (typed PRNG
    keys) is sliced as a ``jax.Array``."""
    if not (isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)):
        return np.array_split(np.asarray(x), n, axis=0)
    q, r = divmod(x.shape[0], n)
    ends = np.cumsum([0] + [q + (i < r) for i in range(n)])
    return [x[int(a):int(b)] for a, b in zip(ends[:-1], ends[1:])]


# -- the call path ---------------------------------------------------------------------------

def _is_pr(x: Any) -> bool:
    return type(x) is PerReplica


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(e is None or isinstance(e, int) for e in x)


class DynamicPath:
    """The call path of a ``Replicated`` with ``RunOptions(dynamic_shapes=True)``."""

    def __init__(self, rep: Any):
        if rep.steps_per_call != 1:
            raise NotImplementedError("RunOptions(dynamic_shapes=True) with steps_per_call > 1")
        if rep._process_count != 1:
            raise NotImplementedError("RunOptions(dynamic_shapes=True) with several processes")
        if rep.donate:
            raise NotImplementedError("RunOptions(dynamic_shapes=True) with donate=True: the "
                                      "padded inputs are new buffers every call, nothing to donate")
        from runtime.persistent import cache_dir_for
        if cache_dir_for(rep.options):
            warnings.warn(f"{rep.__name__}: the persistent cache ({cache_dir_for(rep.options)}) "
                          f"does not hold dynamic-shape programs; each process compiles its "
                          f"buckets", RuntimeWarning, stacklevel=4)
        self.rep = rep
        self.options = rep.options
        check_options(self.options)
        self.bucket = make_bucketer(self.options.bucketing, rep.logical_devices)
        self.traces: dict[Any, Any] = {}
        self.planned: dict[Any, _Plan] = {}  # a call's quick key -> its bucket's plan
        self._arg_of: dict[Any, tuple] = {}  # argument treedef -> argument index per leaf
        self._axes_memo: dict[tuple, tuple] = {}  # (argument, rank) -> dynamic, static axes
        self.lock = threading.Lock()
        self.warned = False

    # -- planning a call -------------------------------------------------------------------
    def _axes(self, arg: int, rank: int, leaf: int = 0) -> dict[int, str]:
        explicit = (self.options.dynamic_dims or {}).get(arg)
        spec = (0,) if explicit is None else explicit
        if isinstance(spec, int):
            spec = (spec,)
        if not isinstance(spec, dict):
            spec = {a: ("b" if a == 0 else f"d{a}") for a in spec}
        if explicit is not None:  # the default (axis 0) skips scalars; a named axis must exist
            bad = [a for a in spec if not isinstance(a, int) or not -rank <= a < rank]
            if bad:
                raise ValueError(f"RunOptions(dynamic_dims={{{arg}: {explicit!r}}}): axis "
                                 f"{bad[0]!r} is out of range for leaf {leaf} of argument {arg}, "
                                 f"which has rank {rank}")
        return {a % rank: s for a, s in spec.items() if rank and -rank <= a < rank}

    def _check_call(self, args: tuple) -> None:
        """Options that name arguments must fit this call's arguments."""
        ms, dd = self.options.maximum_shapes, self.options.dynamic_dims
        if ms is not None:
            if not isinstance(ms, (list, tuple)):
                raise TypeError(f"RunOptions(maximum_shapes=...) must be a list with one entry "
                                f"per argument, got {ms!r}")
            if len(ms) > len(args):
                raise ValueError(f"RunOptions(maximum_shapes=...) has {len(ms)} entries but the "
                                 f"step was called with {len(args)} arguments")
            for i, entry in enumerate(ms):
                if entry is not None and not any(
                        _is_pr(x) for x in jax.tree.leaves(args[i], is_leaf=_is_pr)):
                    raise ValueError(f"RunOptions(maximum_shapes=...): entry {i} bounds argument "
                                     f"{i}, which is mirrored (not a PerReplica): only "
                                     f"per-replica arguments have dynamic dims")
        for i in (dd or {}):
            if not isinstance(i, int) or not 0 <= i < len(args):
                raise ValueError(f"RunOptions(dynamic_dims=...): key {i!r} is not an argument "
                                 f"index of a call with {len(args)} arguments")
            if not any(_is_pr(x) for x in jax.tree.leaves(args[i], is_leaf=_is_pr)):
                raise ValueError(f"RunOptions(dynamic_dims=...): argument {i} is mirrored (not "
                                 f"a PerReplica): only per-replica arguments have dynamic dims")

    def _bounds(self, arg: int, inner_td: Any) -> list:
        ms = self.options.maximum_shapes
        if ms is None or arg >= len(ms) or ms[arg] is None:
            return [None] * inner_td.num_leaves
        entry = ms[arg]
        if _is_shape(entry):
            return [entry] * inner_td.num_leaves
        leaves = jax.tree.leaves(entry, is_leaf=_is_shape)
        if len(leaves) != inner_td.num_leaves:
            raise ValueError(f"maximum_shapes[{arg}] has {len(leaves)} shapes but argument {arg} "
                             f"has {inner_td.num_leaves} leaves per replica")
        return leaves

    def plan(self, args: tuple) -> tuple:
        rep = self.rep
        n = rep.num_replicas
        self._check_call(args)
        leaves, treedef = jax.tree_util.tree_flatten(args, _is_pr)
        arg_of = [i for i, a in enumerate(args) for _ in jax.tree_util.tree_flatten(a, _is_pr)[0]]
        sizes: list[dict[str, int]] = [{} for _ in range(n)]
        first: dict[str, tuple[int, int, int]] = {}  # dim -> the (argument, leaf, axis) setting it
        bounds: dict[str, int] = {}
        per_leaf = []  # per leaf: None (mirrored) or (inner_td, [per inner leaf: (arrays, axes)])
        for i, x in enumerate(leaves):
            if not _is_pr(x):
                per_leaf.append(None)
                continue
            arg = arg_of[i]
            if len(x.values) != n:
                raise ValueError(f"PerReplica argument {arg} has {len(x.values)} values but the "
                                 f"step runs on {n} replicas")
            flat = [jax.tree.flatten(v) for v in x.values]
            td0 = flat[0][1]
            for r, (_, td) in enumerate(flat):
                if td != td0:
                    raise ValueError(f"PerReplica argument {arg}: replica {r}'s value has structure "
                                     f"{td} but replica 0's has {td0}")
            leaf_bounds = self._bounds(arg, td0)
            inner = []
            for j in range(td0.num_leaves):
                for r, v in enumerate(flat):
                    if isinstance(v[0][j], jax.ShapeDtypeStruct):
                        raise TypeError(
                            f"dynamic shapes: PerReplica argument {arg} leaf {j} of replica {r} "
                            f"is a jax.ShapeDtypeStruct; with RunOptions(dynamic_shapes=True) "
                            f"the real sizes of arrays choose the buckets, so lower() and calls "
                            f"need arrays (e.g. np.zeros of the sizes to plan for)")
                arrs = [v[0][j] if isinstance(v[0][j], jax.Array) else np.asarray(v[0][j])
                        for v in flat]
                shape0, dtype0 = arrs[0].shape, arrs[0].dtype
                rank = len(shape0)
                axes = self._axes(arg, rank, j)
                if axes and jax.dtypes.issubdtype(dtype0, jax.dtypes.extended):
                    raise TypeError(
                        f"dynamic shapes: PerReplica argument {arg} leaf {j} holds typed PRNG "
                        f"keys ({dtype0}{list(shape0)}) with dynamic axes {sorted(axes)}, "
                        f"which cannot be padded: pass their data (jax.random.key_data(keys), "
                        f"uint32) and jax.random.wrap_key_data(...) it in the step, or keep "
                        f"the axes static (RunOptions(dynamic_dims={{{arg}: ()}}))")
                static_axes = [k for k in range(rank) if k not in axes]
                bound = leaf_bounds[j]
                for r, a in enumerate(arrs):
                    shape = a.shape  # (a jax.Array computes it on every access)
                    if len(shape) != rank or a.dtype != dtype0 or any(
                            shape[k] != shape0[k] for k in static_axes):
                        raise ValueError(
                            f"PerReplica argument {arg} leaf {j}: replica {r}'s value has shape "
                            f"{shape} and dtype {a.dtype} but replica 0's has {shape0} "
                            f"and {dtype0} (only the dynamic axes {sorted(axes)} may differ)")
                    for ax, sym in axes.items():
                        size = shape[ax]
                        if bound is not None and ax < len(bound) and bound[ax] is not None:
                            if size > bound[ax]:
                                raise ValueError(
                                    f"PerReplica argument {arg} leaf {j}: replica {r} has size "
                                    f"{size} along dynamic axis {ax}, larger than its bound "
                                    f"{bound[ax]} in maximum_shapes")
                            bounds[sym] = min(bounds.get(sym, bound[ax]), bound[ax])
                        prev = sizes[r].setdefault(sym, size)
                        where = first.setdefault(sym, (arg, j, ax))
                        if prev != size:
                            a0, j0, ax0 = where
                            raise ValueError(
                                f"PerReplica argument {arg} leaf {j}: replica {r} has size {size} "
                                f"along axis {ax} (dynamic dim {sym}) but {prev} along axis "
                                f"{ax0} of argument {a0} leaf {j0}; every axis of dim {sym} "
                                f"holds the replica's one size. If one of them is not that "
                                f"dim (a state's, a table's), keep its argument static "
                                f"(RunOptions(dynamic_dims={{{a0}: ()}}) or {{{arg}: ()}}) or "
                                f"give that axis a dim of its own (dynamic_dims={{argument: "
                                f"{{axis: name}}}})")
                inner.append((arrs, axes))
            per_leaf.append((td0, inner))
        syms = tuple(sorted(sizes[0])) if sizes else ()
        buckets = {}
        for s in syms:
            top = max(sz[s] for sz in sizes)
            b = self.bucket(top, bounds.get(s))
            if b < top:
                raise ValueError(f"dynamic dim {s}: size {top} is larger than its bucket {b}")
            buckets[s] = b
        return leaves, treedef, per_leaf, syms, sizes, buckets, bounds

    def call(self, args: tuple, statics: tuple = ()) -> Any:
        """Run the step. A call whose per-replica values are arrays (and no
        ``maximum_shapes``) is planned in one pass over its shapes (:meth:`_quick`): its
        structure, static dims and buckets find the plan of the bucket, made by the first
        call that landed in it, so a call with sizes never seen costs what a repeated one
        does. Any other call, and the first of each bucket, is planned, validated and
        bucketed in full (:meth:`prepare`)."""
        leaves, treedef = _tree_flatten(args, _is_pr)
        quick = self._quick(leaves, treedef, statics)
        plan = None
        if quick is not None:
            qkey, sizes, buckets = quick
            try:
                plan = self.planned.get(qkey)
            except TypeError:  # an unhashable mirrored leaf: plan every call
                quick = None
        if plan is None:
            plan, sizes = self.prepare(args, statics)
            # kept for later calls only when the full plan chose the buckets the quick
            # pass did (a bucketing callable that is not a function of the size: never)
            if quick is not None and plan.buckets == buckets:
                with self.lock:  # (another thread may be storing its plan)
                    if len(self.planned) >= PLAN_MEMO_SIZE:
                        self.planned.pop(next(iter(self.planned)), None)
                    self.planned[qkey] = plan
        else:
            self.rep._cache.count_fast_hit()
        if log.isEnabledFor(logging.INFO):
            log.info("%s: dynamic sizes %s -> bucket %s", self.rep.__name__,
                     [dict(s) for s in sizes], plan.buckets)
        return self.run(plan, sizes, leaves)

    def _quick(self, leaves: list, treedef: Any, statics: tuple) -> tuple | None:
        """``(key, sizes, buckets)`` of a call, read off its shapes in one pass, when every
        per-replica value is an array or a pytree of arrays and no ``maximum_shapes`` is
        set; ``None`` otherwise, and for anything :meth:`plan` would reject (which then
        says why). The key holds everything the plan depends on but the exact sizes: the
        argument structure, the mirrored leaves' signatures, per per-replica leaf its
        rank, dtype, static dims and dynamic axes, and the buckets."""
        if self.options.maximum_shapes is not None:
            return None
        n = self.rep.num_replicas
        arg_of = self._arg_of.get(treedef)
        if arg_of is None:
            arg_of = self._arg_of[treedef] = tuple(
                i for i, c in enumerate(treedef.children()) for _ in range(c.num_leaves))
        sizes: list[dict[str, int]] = [{} for _ in range(n)]
        parts = []
        for i, x in enumerate(leaves):
            if type(x) is not PerReplica:
                parts.append(leaf_sig(x))
                continue
            vals = x.values
            if len(vals) != n:
                return None
            if _is_array(vals[0]):  # one array per replica
                part = self._quick_leaf(vals, arg_of[i], sizes)
                if part is None:
                    return None
                parts.append((_PER_REPLICA, part))
                continue
            flat = [_tree_flatten(v) for v in vals]  # a pytree per replica
            td0 = flat[0][1]
            if any(td != td0 for _, td in flat):
                return None
            inner = []
            for j in range(td0.num_leaves):
                part = self._quick_leaf([f[0][j] for f in flat], arg_of[i], sizes)
                if part is None:
                    return None
                inner.append(part)
            parts.append((_PER_REPLICA, td0, tuple(inner)))
        buckets = {}
        for sym in sorted(sizes[0]) if n else ():
            top = max(sz[sym] for sz in sizes)
            b = self.bucket(top, None)
            if b < top:
                return None
            buckets[sym] = b
        return ((treedef, statics, tuple(parts), tuple(buckets.items()), jc.trace_context()),
                tuple(sizes), buckets)

    def _quick_leaf(self, arrs: list, arg: int, sizes: list) -> tuple | None:
        """One per-replica leaf of :meth:`_quick` (an array per replica): its part of the
        key, with each replica's sizes recorded in ``sizes``; ``None`` unless every value
        is an array of the same rank, dtype and static dims, and each replica's sizes
        agree with its other leaves'."""
        a0 = arrs[0]
        if not _is_array(a0):
            return None
        shape0, dtype0 = a0.shape, a0.dtype
        lay = self._leaf_axes(arg, len(shape0))
        if lay is None:
            return None
        dyn, static = lay
        static0 = tuple([shape0[k] for k in static])
        for r, a in enumerate(arrs):
            if not _is_array(a):
                return None
            shape = a.shape  # (a jax.Array computes it on every access)
            if len(shape) != len(shape0) or a.dtype != dtype0 or \
                    tuple([shape[k] for k in static]) != static0:
                return None
            got = sizes[r]
            for ax, sym in dyn:
                if got.setdefault(sym, shape[ax]) != shape[ax]:
                    return None
        return dtype0, static0, dyn

    def _leaf_axes(self, arg: int, rank: int) -> tuple | None:
        """``(((axis, symbol), ...), static axes)`` of a per-replica array leaf of argument
        ``arg`` (remembered); ``None`` when the options name a bad axis."""
        lay = self._axes_memo.get((arg, rank))
        if lay is None:
            try:
                axes = self._axes(arg, rank)
            except ValueError:
                return None
            lay = self._axes_memo[(arg, rank)] = (
                tuple(sorted(axes.items())), tuple(k for k in range(rank) if k not in axes))
        return lay

    def prepare(self, args: tuple, statics: tuple = ()) -> tuple:
        """Plan a call in full: validate it, choose the buckets, and fetch (or build and
        compile) the program of those buckets. Returns ``(plan, sizes)``."""
        leaves, treedef, per_leaf, syms, sizes, buckets, bounds, pads, key = \
            self.planned_key(args, statics)
        cache = self.rep._cache
        ckey = (key, jc.trace_context())  # the JAX context too (Replicated._call)
        prog = cache.get(ckey)
        if prog is None:
            def build():
                prog = self.build(leaves, treedef, per_leaf, syms, buckets, bounds, key, statics)
                prog.dyn_padding = padding_report(self.options.bucketing, syms, sizes, buckets)
                return prog.compile()
            prog = cache.get_or_build(ckey, build)
            self._maybe_warn()
        return _Plan(prog, syms, buckets, pads, self.rep.num_replicas), tuple(sizes)

    def planned_key(self, args: tuple, statics: tuple = ()) -> tuple:
        """A call's plan (:meth:`plan`), how each argument leaf pads to its buckets, and
        the cache key of its bucket's program."""
        leaves, treedef, per_leaf, syms, sizes, buckets, bounds = self.plan(args)
        pads, key_sigs = [], []
        for x, info in zip(leaves, per_leaf):
            if info is None:
                pads.append(None)
                key_sigs.append(leaf_sig(x))
                continue
            td, inner = info
            leaf_pads, sig = [], []
            for arrs, axes in inner:
                a0 = arrs[0]
                shape = tuple(buckets[axes[k]] if k in axes else d for k, d in enumerate(a0.shape))
                leaf_pads.append((shape, a0.dtype, {ax: buckets[s] for ax, s in axes.items()}))
                sig.append((shape, a0.dtype, False, tuple(sorted(axes.items()))))
            pads.append((td, tuple(leaf_pads)))
            key_sigs.append(("per_replica", td, tuple(sig)))
        key = ("dynamic", treedef, tuple(key_sigs), tuple(sorted(bounds.items())), statics)
        return leaves, treedef, per_leaf, syms, sizes, buckets, bounds, tuple(pads), key

    def lower(self, args: tuple, statics: tuple = ()) -> Any:
        """The program (not compiled) for these arguments' buckets; its ``key`` is theirs
        (:meth:`run_compiled` takes calls of the same buckets)."""
        leaves, treedef, per_leaf, syms, sizes, buckets, bounds, pads, key = \
            self.planned_key(args, statics)
        prog = self.build(leaves, treedef, per_leaf, syms, buckets, bounds, ("dynamic-lower",),
                          statics)
        prog.key, prog.dyn_buckets, prog.dyn_syms = key, buckets, tuple(syms)
        return prog

    def run_compiled(self, prog: Any, args: tuple, statics: tuple = ()) -> Any:
        """A call of a program compiled ahead of time (``step.lower(...).compile()``):
        padded to the buckets it was built for and run, as a call of the step would run
        its bucket's program; arguments whose buckets, structure, dtypes or statics
        differ are a ``TypeError`` saying which."""
        leaves, _, _, syms, sizes, buckets, _, pads, key = self.planned_key(args, statics)
        if buckets != prog.dyn_buckets:
            raise TypeError(f"{self.rep.__name__}: the compiled step runs dynamic dims in the "
                            f"buckets {prog.dyn_buckets}, but this call's sizes need "
                            f"{buckets}; call the step itself (it compiles each bucket) or "
                            f"lower and compile for these arguments")
        if key != prog.key:
            raise TypeError(f"{self.rep.__name__}: the compiled step takes arguments of "
                            f"another structure, dtype or static arguments than this call's; "
                            f"lower and compile for these arguments")
        return self.run(_Plan(prog.compile(), syms, buckets, pads, self.rep.num_replicas),
                        tuple(sizes), leaves)

    def _maybe_warn(self) -> None:
        limit = getattr(self.options, "max_compiles_warning", None)
        misses = self.rep._cache.info().misses
        if limit is not None and misses > limit and not self.warned:
            self.warned = True
            msg = (f"{self.rep.__name__}: {misses} compiles for dynamic shapes exceed "
                   f"max_compiles_warning={limit}; use coarser buckets or maximum_shapes")
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)

    # -- building --------------------------------------------------------------------------
    def trace(self, leaves, treedef, per_leaf, syms, bounds, statics: tuple = ()) -> tuple:
        """One trace per symbolic signature: (graph, in_layout, specs, out treedef)."""
        rep = self.rep
        skey = (treedef, statics, jc.trace_context(), tuple(sorted(bounds.items())), tuple(
            ("m", leaf_sig(x)) if info is None else
            ("p", info[0], tuple((tuple(axes.get(k, d) for k, d in enumerate(a[0].shape)),
                                  a[0].dtype) for a, axes in info[1]))
            for x, info in zip(leaves, per_leaf)))
        with self.lock:
            hit = self.traces.get(skey)
        if hit is not None:
            return hit
        # the bounds are constraints: the trace may then decide ``b <= 10`` (a bound of 8)
        constraints = tuple(f"{s} <= {bounds[s]}" for s in syms if s in bounds)
        exprs = dict(zip(syms, jax.export.symbolic_shape(",".join(syms), constraints=constraints))) \
            if syms else {}
        specs = [LeafSpec((), np.dtype(np.int32), False, True) for _ in syms]
        in_layout: list = []
        for x, info in zip(leaves, per_leaf):
            if info is None:
                s = leaf_sig(x)
                in_layout.append(None)
                specs.append(LeafSpec(tuple(s[0]), s[1], s[2], False))
                continue
            td, inner = info
            in_layout.append((td, tuple(a[0].ndim for a, _ in inner)))
            for arrs, axes in inner:
                shape = tuple(exprs[axes[k]] if k in axes else d
                              for k, d in enumerate(arrs[0].shape))
                specs.append(LeafSpec(shape, arrs[0].dtype, False, True))
        out_info: dict[str, Any] = {}
        k = len(syms)

        def flat_fn(*flat):
            it = iter(flat[k:])
            slots = [next(it) if lay is None else jax.tree.unflatten(lay[0], [next(it) for _ in lay[1]])
                     for lay in in_layout]
            from runtime.validate import check_results, keep_container_types
            out = call_step(fn, jax.tree.unflatten(treedef, slots),
                            getattr(rep, "__name__", "step"))
            out = keep_container_types(out)
            check_results(out, getattr(rep, "__name__", "step"))
            out_leaves, out_td = jax.tree.flatten(out)
            out_info["treedef"] = out_td
            return out_leaves

        name = rep.__name__
        fn = rep._callable(statics)
        try:
            with jc.symbolic_cumulative(), jc.per_replica_dim_values(rep.axis_name), \
                    watching_local_views() as local_views:
                graph, t = trace_replica_fn(flat_fn, specs, rep.num_replicas, name,
                                            logical_devices=rep.logical_devices,
                                            axis_name=rep.axis_name)
        except jax.errors.InconclusiveDimensionOperation as e:
            raise _inconclusive(e, name, syms, bounds) from e
        except jc.CumulativeDerivativeTwice as e:
            raise _cumulative_twice(e, name, syms) from e
        except TypeError as e:
            # JAX code that needs a concrete size (jnp.convolve, np.zeros(x.shape[0]), a
            # Python range over it) fails on a symbolic one inside JAX: say where, and why
            if "_DimExpr" not in str(e) and "symbolic" not in str(e):
                raise
            raise _symbolic_size(e, name, syms) from e
        except (NotImplementedError, ValueError) as e:
            # (JAX's plain errors only: this project's are subclasses with messages of
            # their own, rt.ShardingConstraintError's naming the value's dynamic type)
            if type(e) not in (NotImplementedError, ValueError) or not _mentions_dims(
                    str(e), syms):
                raise
            raise type(e)(_failed_on_dims(e, name, syms)) from e
        graph = _with_bounds(graph, bounds)
        res = (graph, t, bool(local_views), specs, out_info["treedef"])
        with self.lock:
            self.traces[skey] = res
        return res

    def build(self, leaves, treedef, per_leaf, syms, buckets, bounds, key,
              statics: tuple = ()) -> Any:
        rep = self.rep
        graph, t_import, local_views, specs, out_td = self.trace(
            leaves, treedef, per_leaf, syms, bounds, statics)
        size_td = jax.tree.structure(tuple(range(len(syms))))
        in_layout = [(size_td, (0,) * len(syms))] + [
            None if info is None else (info[0], tuple(a[0].ndim for a, _ in info[1]))
            for info in per_leaf]
        names = [p.strip().replace("_", "-") for p in self.options.pipeline.split(",") if p.strip()]
        if "padding" not in names:
            at = names.index("sharding") if "sharding" in names else (
                names.index("dce") if "dce" in names else len(names))
            names.insert(at, "padding")
        passes = parse_pipeline(",".join(names), num_replicas=rep.num_replicas,
                                loss_reduction=rep.loss_reduction,
                                num_logical_devices=rep.logical_devices,
                                bucket_bytes=self.options.bucket_bytes,
                                buckets=tuple(sorted(buckets.items())),
                                size_inputs=tuple((s, i) for i, s in enumerate(syms)))
        pm = PassManager(passes, verify=self.options.verify,
                         dump_dir=rep._dump_folder(key, "ir") if len(key) > 1 else "")
        final = pm.run(graph, import_seconds=t_import)
        if not local_views:  # a result in a mirrored argument's place that comes out varying
            check_diverging_state(rep.__name__, treedef,
                                  [None if info is not None else leaf_sig(x)
                                   for x, info in zip(leaves, per_leaf)], out_td, final)
        out_varying = [v.type.replica is not Replica.MIRRORED for v in final.outputs]
        out_ranks = [v.type.rank for v in final.outputs]
        jitted = build_jitted(final, rep.mesh, [s.varying for s in specs],
                              [len(s.shape) for s in specs], out_varying, out_ranks)
        n = rep.num_replicas
        gavals = []
        for s in specs:
            shape = tuple(buckets[d.name] if isinstance(d, SymDim) else
                          (buckets[str(d)] if not isinstance(d, int) else d) for d in s.shape)
            if s.varying:
                shape = global_shape(shape, n)
            gavals.append(jax.ShapeDtypeStruct(shape, s.dtype, weak_type=s.weak_type))
        with jc.without_context_mesh():
            lowered = jitted.lower(*gavals)
        prog = Program(rep, pm.records, lowered, in_layout, out_td, out_varying, out_ranks)
        prog.key = key
        # which axes of each output are padded, from the symbolic graph: per axis the
        # symbol and how many elements fewer it has (``x[1:]``: ``("b", 1)``)
        prog.dyn_out_pad = [{a: _out_dim(d, syms) for a, d in enumerate(v.type.shape)
                             if isinstance(d, SymDim)} for v in graph.outputs]
        prog.dyn_nonempty = _nonempty_syms(graph, syms)
        return prog

    def run(self, plan: _Plan, sizes: tuple, leaves: list) -> Any:
        """Pad the inputs to the buckets, run the program, and return the outputs with
        every padded axis sliced back to each replica's real size (deferred)."""
        rep, prog, n = self.rep, plan.prog, self.rep.num_replicas
        puts = plan.puts
        if prog.dyn_nonempty:
            _check_nonempty(rep.__name__, prog.dyn_nonempty, sizes)
        # the real sizes, one (N,) int32 vector per symbol: the program's first inputs
        flat = [puts[i](np.asarray([s[sym] for s in sizes], np.int32))
                for i, sym in enumerate(plan.syms)]
        # per argument leaf: None (mirrored), or per inner leaf (shape, dtype, arrays, how)
        groups = [None if pad is None else
                  [(shape, dtype, arrs, _placement(arrs, shape))
                   for shape, dtype, arrs in _replica_leaves(x, pad)]
                  for x, pad in zip(leaves, plan.pads)]
        if plan.copies_wait:
            _start_host_copies(groups)
        for x, group in zip(leaves, groups):
            if group is None:
                flat.append(x)
                continue
            for shape, dtype, arrs, how in group:
                put = puts[len(flat)]
                if how == "host":
                    flat.append(put(_pad_host(arrs, shape, dtype, n)))
                elif how == "device":
                    # device arrays already of the bucket's shape: nothing to pad
                    flat.extend(rep.layout.global_inputs(PerReplica(arrs),
                                                         (LEAF_TREEDEF, (len(shape),))))
                else:
                    # Device arrays of other sizes are padded on the host: padding on the
                    # device would compile a program per exact input shape (tens of ms for
                    # each new size); a copy to the host and back costs far less and does
                    # not depend on whether the size was seen before.
                    flat.append(put(_pad_host([np.asarray(a) for a in arrs], shape, dtype, n)))
        try:
            outs = prog.call(*flat)
        except ValueError as e:
            if "disagree with the" not in str(e):
                raise
            outs = prog.call(*jax.device_put(flat, list(prog.jax_compiled.input_shardings[0])))
        res = []
        for o, v, r, pad in zip(outs, prog.out_varying, prog.out_ranks, prog.dyn_out_pad):
            if not pad:
                res.append(rep.layout.split(o, r) if v else o)
            else:
                res.append(_unpadded(rep, o, v, r, pad, sizes))
        return prog.out_treedef.unflatten(res)


#: how many bucket plans a ``DynamicPath`` remembers for :meth:`DynamicPath._quick`
#: (oldest dropped first)
PLAN_MEMO_SIZE = 4096
_tree_flatten = jax.tree_util.tree_flatten
_PER_REPLICA = object()  # tags a per-replica leaf in a plan key (never equal to a signature)


def padding_report(bucketing: Any, syms: tuple, sizes: list, buckets: dict) -> dict | None:
    """The padding of the call a bucket's program was compiled for, as a dump's
    ``report.json`` gives it (``padding_overhead``): each replica's real size of the first
    dynamic dim, its bucket, and the padded share (before, a dynamic program's dump said
    "no dynamic shapes"; found by a probe)."""
    if not syms:
        return None
    rows = [int(s[syms[0]]) for s in sizes]
    bucket = int(buckets[syms[0]])
    return {"bucketing": bucketing if isinstance(bucketing, str) else repr(bucketing),
            "real_rows": rows, "bucket": bucket,
            "padded_fraction": 1.0 - sum(rows) / (bucket * len(rows)) if bucket else 0.0}


class _Plan:
    """How to run a call in one bucket: its compiled program, the dynamic symbols (the
    program's first inputs, one ``(N,)`` int32 vector of the real sizes each), the buckets,
    per argument leaf ``None`` (mirrored) or ``(inner treedef, ((padded shape, dtype,
    {axis: bucket}), ...))``, per program input the :class:`~ir._jax_compat.HostPut`
    that sends its host array (the size vectors, the padded host buffers), and whether
    reading a device array on the host waits for a copy (any platform but CPU)."""

    __slots__ = ("prog", "syms", "buckets", "pads", "puts", "copies_wait")

    def __init__(self, prog: Any, syms: tuple, buckets: dict, pads: tuple, n: int) -> None:
        self.prog, self.syms, self.buckets, self.pads = prog, syms, buckets, pads
        shardings = list(prog.jax_compiled.input_shardings[0])
        # reading a device array on the host waits for a copy (not on CPU: a view)
        self.copies_wait = any(_host_read_waits(d) for sh in shardings if sh is not None
                               for d in sh.device_set)
        shapes = [(n,)] * len(syms)
        dtypes = [np.dtype(np.int32)] * len(syms)
        for pad in pads:
            if pad is None:
                shapes.append(None)
                dtypes.append(None)
                continue
            for shape, dtype, _ in pad[1]:
                shapes.append(global_shape(shape, n))
                dtypes.append(dtype)
        self.puts = tuple(None if shape is None else jc.HostPut(sh, shape, dtype)
                          for sh, shape, dtype in zip(shardings, shapes, dtypes))


def _host_read_waits(device: Any) -> bool:
    """Does reading an array of ``device`` on the host wait for a copy? Not on CPU,
    where it is a view of the buffer (and an early copy would only cost time)."""
    return device.platform != "cpu"


def _placement(arrs: list, shape: tuple) -> str:
    """How :meth:`DynamicPath.run` pads the replicas' arrays of one leaf to the bucket's
    ``shape``: ``"host"`` (NumPy arrays), ``"device"`` (device arrays already of that
    shape: nothing to pad) or ``"copy"`` (any other mix: read to the host and padded
    there)."""
    if all(type(a) is np.ndarray for a in arrs):
        return "host"
    if all(isinstance(a, jax.Array) and a.shape == shape for a in arrs):
        return "device"
    return "copy"


def _start_host_copies(groups: list) -> None:
    """Start the device-to-host copy of every device array that :meth:`DynamicPath.run`
    reads to pad on the host (``groups``: its per-leaf entries), all before the first is
    read: on a GPU each copy waits for the device (~0.2 ms), so reading them one after
    another would pay that once per replica and leaf."""
    for group in groups:
        for _, _, arrs, how in group or ():
            if how == "copy":
                for a in arrs:
                    if isinstance(a, jax.Array):
                        a.copy_to_host_async()


def _replica_leaves(x: PerReplica, pad: tuple) -> Iterator[tuple]:
    """``(padded shape, dtype, [each replica's array])`` per leaf of a per-replica
    argument ``x`` whose plan entry is ``pad`` (``(inner treedef, leaf pads)``)."""
    td, leaf_pads = pad
    if td == LEAF_TREEDEF:
        shape, dtype, _ = leaf_pads[0]
        yield shape, dtype, x.values
        return
    per = [td.flatten_up_to(v) for v in x.values]
    for j, (shape, dtype, _) in enumerate(leaf_pads):
        yield shape, dtype, [p[j] for p in per]


def _is_array(x: Any) -> bool:
    return type(x) is np.ndarray or isinstance(x, jax.Array)


def _pad_host(arrs: list, shape: tuple, dtype: Any, n: int) -> np.ndarray:
    """The replicas' host arrays zero-padded to ``shape`` in one global buffer
    (``[n * shape[0], ...]``, or ``[n]`` for scalars); only the padding is zeroed."""
    buf = np.empty((n,) + shape, dtype)
    for r, a in enumerate(arrs):
        if a.shape == shape:
            buf[r] = a
        elif a.shape[1:] == shape[1:]:  # only axis 0 is short
            buf[r, :a.shape[0]] = a
            buf[r, a.shape[0]:] = 0
        else:
            buf[r] = 0
            buf[(r,) + tuple(slice(0, d) for d in a.shape)] = a
    return buf.reshape(global_shape(shape, n))


def _out_dim(d: SymDim, syms: Any) -> tuple[str, int]:
    """``(symbol, c)`` of an output's padded dim: its real size is ``max(n - c, 0)``
    (``c`` 0 for a symbol itself, 1 for ``b - 1``, the length of ``x[1:]``)."""
    from compiler.passes.padding import PaddingError, derived_dim
    fam = derived_dim(d, syms)
    if fam is None:  # (the padding pass refuses such a dim before)
        raise PaddingError(f"padding: an output has dim {d.expr or d.name}, which is not "
                           f"one of the dynamic dims {list(syms)} nor cut from one by a "
                           f"constant number of elements")
    return fam


def _nonempty_syms(graph: Graph, syms: Any) -> tuple[tuple[str, str, str], ...]:
    """``(symbol, dim, size)`` for each dynamic symbol ``s`` that a replica may not have at
    size 0 (JAX traces every symbol as >= 1): a dim ``s - 1`` cut from it (``x[1:]``) is
    ``0`` then unpadded, where its text gives -1, and a size used as a number that
    involves ``s`` (``jnp.mean`` over ``x[1:]`` divides by it) cannot tell the two
    apart (``x.shape[0] - 1`` is -1 unpadded); a multiple of ``s`` is 0 either way. Empty
    when the step has no such pair."""
    from compiler.passes.padding import derived_dim
    cut: dict[str, str] = {}
    sizes: dict[str, str] = {}
    seen: set[str] = set()
    for op, _ in graph.walk():
        for v in op.operands + op.results:
            for d in v.type.shape:
                if not isinstance(d, SymDim) or d.name in seen:
                    continue
                seen.add(d.name)
                fam = derived_dim(d, syms)
                if fam is not None and fam[1] and jc.evaluate_dim(
                        jax.export.symbolic_shape(d.expr)[0], {fam[0]: 0}) < 0:
                    cut.setdefault(fam[0], d.expr)
        if op.name == "dim_as_value":
            text = str(op.attr("dim"))
            if not re.fullmatch(r"(\d+\*)?\w+", text):
                for s in jc.dim_vars(op.attr("dim")):
                    sizes.setdefault(s, text)
    return tuple((s, cut[s], sizes[s]) for s in sorted(cut) if s in sizes)


def _check_nonempty(name: str, nonempty: tuple, sizes: tuple) -> None:
    for s, dim, size in nonempty:
        r = next((r for r, sz in enumerate(sizes) if sz[s] == 0), None)
        if r is not None:
            raise ValueError(
                f"{name}: replica {r} has 0 elements along dynamic dim {s}, and the step "
                f"cuts it to {dim} and uses a size {size} as a number (a mean divides by "
                f"one): traced with {s} >= 1, its value could differ from the unpadded "
                f"one's for an empty replica; give every replica at least one element "
                f"along {s}, or keep that axis static (RunOptions(dynamic_dims=...))")


def _unpadded(rep: Any, out: Any, varying: bool, rank: int, pad: dict, sizes: tuple) -> PerReplica:
    """An output with padded axes (``pad``: axis -> ``(symbol, c)``, the real size
    ``max(n - c, 0)``) as a deferred ``PerReplica`` of each replica's value sliced back to
    its real sizes."""
    def values() -> list:
        vals = rep.layout.split(out, rank).values if varying else [out] * len(sizes)
        index = [tuple(slice(0, max(sizes[i][pad[a][0]] - pad[a][1], 0)) if a in pad
                       else slice(None) for a in range(rank)) for i in range(len(vals))]
        if vals and _host_read_waits(next(iter(vals[0].devices()))):
            for x, ix in zip(vals, index):  # every copy under way before the first is read
                if not _whole(x, ix):
                    x.copy_to_host_async()
        return [_sliced(x, ix, rep.layout.replica_devices[r])
                for x, ix, r in zip(vals, index, rep.layout.local_replicas)]
    return PerReplica.deferred(len(sizes), values, (out,))


def _sliced(x: jax.Array, index: tuple, device: Any) -> jax.Array:
    """``x[index]`` (a bucket-sized value cut to its real size) without compiling a slice
    program per exact size: cut on the host, put back where ``x`` lives (on the
    replica's first device when its sharding cannot tile the real size)."""
    if _whole(x, index):
        return x
    part = np.asarray(x)[index]
    try:
        return jax.device_put(part, x.sharding)
    except ValueError:
        return jax.device_put(part, device)


def _whole(x: jax.Array, index: tuple) -> bool:
    """Does ``x[index]`` (slices from 0) keep all of ``x``?"""
    return all(s.stop is None or s.stop == d for s, d in zip(index, x.shape))


def _symbolic_size(e: Exception, name: str, syms: tuple) -> TypeError:
    """Code that needs a concrete size met a dynamic one while tracing: the user's line."""
    from ir import _jax_compat as jc
    where = jc.user_location_of_exception(e)
    at = f" at {os.path.basename(where[0])}:{where[1]}" if where else ""
    return TypeError(
        f"dynamic shapes: tracing {name}{at} needs a concrete size where the dynamic dim(s) "
        f"{', '.join(syms)} are symbolic ({str(e).strip().splitlines()[0]}); one trace serves "
        f"every size, so that code cannot depend on the size's value: keep that axis static "
        f"(RunOptions(dynamic_dims=...)) or avoid the operation on the padded axis")


def _mentions_dims(message: str, syms: tuple) -> bool:
    """Does JAX's error ``message`` name a dynamic dim in a shape or an expression
    (``(b, 1, 1, t)``, ``floordiv(t - 3, 2)``, "axis of non-constant size: b")?"""
    if "non-constant size" in message or "floordiv(" in message:
        return True
    return any(re.search(rf"[(\[,]\s*{re.escape(s)}\s*[,)\]]", message) for s in syms)


def _failed_on_dims(e: Exception, name: str, syms: tuple) -> str:
    """JAX failed on a dynamic dim while tracing (``lax.associative_scan`` along it; the
    gradient of a strided ``VALID`` convolution over it; shapes that cannot broadcast
    because one argument's axis is dynamic and another's static): the user's line, the
    dims, JAX's message and what to do. Before: JAX's message alone, naming no line."""
    from ir import _jax_compat as jc
    where = jc.user_location_of_exception(e)
    at = f" at {os.path.basename(where[0])}:{where[1]}" if where else ""
    first = str(e).strip().splitlines()[0]
    return (f"dynamic shapes: tracing {name}{at} with dynamic dims ({', '.join(syms)}) failed "
            f"inside JAX: {first}; JAX cannot do this with a symbolic size: keep that axis "
            f"static (RunOptions(dynamic_dims=...)), or check that every argument's axes "
            f"that hold one size are dynamic alike")


def _inconclusive(e: Exception, name: str, syms: tuple, bounds: dict) -> ValueError:
    """JAX could not decide a comparison of a dynamic size with a number while tracing:
    say where in the user's code, which dims, and what to do."""
    from ir import _jax_compat as jc
    where = jc.user_location_of_exception(e)
    at = f" at {os.path.basename(where[0])}:{where[1]}" if where else ""
    first = str(e).strip().splitlines()[0]
    dims = ", ".join(f"{s}<={bounds[s]}" if s in bounds else s for s in syms)
    todo = ("keep that axis static (RunOptions(dynamic_dims=...))" if all(s in bounds for s in syms)
            else "bound it (RunOptions(maximum_shapes=...): the trace then knows the bound) or "
                 "keep that axis static (RunOptions(dynamic_dims=...))")
    return ValueError(
        f"dynamic shapes: tracing {name}{at} with dynamic dims ({dims}) needs a decision the "
        f"sizes do not settle ({first}); one trace serves every size, so code there must not "
        f"depend on how a dynamic size compares with a number: {todo}")


def _cumulative_twice(e: jc.CumulativeDerivativeTwice, name: str,
                      syms: tuple) -> NotImplementedError:
    """A derivative of the derivative of a cumulative op, traced with dynamic dims: its
    first derivative is an opaque op evaluated at the bucket's size (JAX's own rule needs
    a constant size), which has no derivative rule of its own."""
    where = jc.user_location_of_exception(e)
    at = f" at {os.path.basename(where[0])}:{where[1]}" if where else ""
    return NotImplementedError(
        f"dynamic shapes: tracing {name}{at} with dynamic dims ({', '.join(syms)}) "
        f"differentiates the derivative of cumprod, cummax, cummin or cumlogsumexp ({e.op}: "
        f"jax.hessian, jax.grad of jax.grad, jax.grad of jax.jvp); with dynamic shapes their "
        f"first derivative is evaluated at the bucket's size and has no derivative of its "
        f"own: take one derivative of the cumulative op, or run this step without "
        f"RunOptions(dynamic_shapes=True)")


def _with_bounds(graph: Graph, bounds: dict[str, int]) -> Graph:
    """The graph with every symbolic dim carrying its bound (``b<=128``) where one is known."""
    if not bounds:
        return graph
    env: dict[Value, Value] = {}

    def t(v: Value) -> Value:
        if v not in env:
            ty = v.type
            shape = tuple(SymDim(d.name, bounds.get(d.name), d.expr) if isinstance(d, SymDim) else d
                          for d in ty.shape)
            env[v] = (Value(TensorType(shape, ty.dtype, ty.replica, ty.sharding, ty.weak_type))
                      if shape != ty.shape else v)
        return env[v]

    return _map_values(graph, t)


def _map_values(gr: Graph, t: Callable[[Value], Value]) -> Graph:
    """``gr`` (regions included) with every value ``v`` replaced by ``t(v)``. Module
    level: a nested recursive function is a reference cycle (here through the map of
    every value) left for the garbage collector."""
    ins = tuple(t(v) for v in gr.inputs)
    ops = tuple(op.replace(operands=tuple(t(v) for v in op.operands),
                           results=tuple(t(v) for v in op.results),
                           regions=tuple(_map_values(r, t) for r in op.regions))
                for op in gr.ops)
    return Graph(ins, ops, tuple(t(v) for v in gr.outputs), gr.name)
