"""``replicate``: run a per-replica step function on N replicas × K logical devices.

    step = rt.replicate(fn, num_replicas=None, logical_devices=1, devices=None,
                        loss_reduction="mean", options=rt.RunOptions())
    out = step(params, rt.distribute(batch, n))

Arguments that are ``PerReplica`` vary per replica; every other argument is mirrored.
Result leaves proven identical on every replica come back as one array, the others as
``PerReplica``. Gradients of mirrored inputs are all-reduced (mean by default).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from compiler.mesh import build_mesh
from compiler.passes import DEFAULT_PIPELINE
from ir import _jax_compat as jc
from ir.graph import Graph
from runtime import program as _prog
from runtime.cache import CacheInfo, ExecutableCache
from runtime.per_replica import LEAF_TREEDEF, PerReplica
from runtime.program import STEP_OUTPUTS, Program, leaf_sig
from runtime.stages import Lowered
from runtime.sync_on_read import SyncOnRead
from runtime import validate as _validate

log = logging.getLogger("runtime")
_tree_flatten = jax.tree_util.tree_flatten
#: argument types that a program lowered over the caller's own structure cannot take
_NOT_MIRRORED = (PerReplica, SyncOnRead)


@dataclass(frozen=True)
class RunOptions:
    """Static options of a replicated step; all of them are part of the cache key.

    pipeline: the passes to run, as a string. dump_dir: at every compile, write the IR
    after every pass, the StableHLO, the partitioned HLO and a report into
    ``dump_dir/<fn>-<key hash>/`` (``$RT_DUMP_DIR`` also works; see ``runtime.report``).
    cache_dir: keep compiled programs on disk across processes (``$RT_CACHE_DIR`` also
    works; see ``runtime.persistent``; not part of the key). verify: ``"end"`` (the default
    unless ``$RT_VERIFY`` names another mode) verifies the pipeline's result once and, only
    if it fails, runs the passes again verifying after each to name the pass that broke
    it; ``True`` or ``"each"`` verifies after every pass (the tests' setting: ~10% of a
    cold lowering at 32 layers); ``False`` never.
    bucket_bytes: merge gradient all-reduces into buckets of at most this many bytes (0:
    off; XLA's own combiner still merges them). dynamic_shapes / bucketing /
    maximum_shapes / dynamic_dims / max_compiles_warning: padding of dynamic shapes (see
    ``runtime.dynamic``)."""

    dynamic_shapes: bool = False
    bucketing: Any = "pow2"
    maximum_shapes: Any = None
    pipeline: str = DEFAULT_PIPELINE
    dump_dir: str | None = None
    verify: bool | str = dataclasses.field(default_factory=lambda: _default_verify())
    bucket_bytes: int = 0
    cache_dir: str | None = None
    dynamic_dims: Any = None
    max_compiles_warning: int | None = 16

    def __post_init__(self) -> None:
        _validate.run_options(self)
        if self.dynamic_shapes:
            from runtime.dynamic import check_options
            check_options(self)

    def __hash__(self) -> int:
        # fields may hold lists and dicts (maximum_shapes, dynamic_dims, bucketing): hash a
        # frozen copy, so options can key a dict like any other static argument
        return hash(tuple(_frozen(getattr(self, f.name)) for f in dataclasses.fields(self)))


def _default_verify() -> bool | str:
    """``RunOptions.verify``'s default: ``$RT_VERIFY`` (``each``, ``end``, ``0``/``1``)."""
    env = os.environ.get("RT_VERIFY", "end").strip().lower()
    return {"1": True, "true": True, "0": False, "false": False}.get(env, env)


def _frozen(v: Any) -> Any:
    """A hashable stand-in for an option value: lists and tuples -> tuples, dicts -> tuples
    of items; anything else (callables included) as it is."""
    if isinstance(v, dict):
        return ("dict",) + tuple((_frozen(k), _frozen(x)) for k, x in sorted(v.items(), key=repr))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


class Replicated:
    """A step function replicated over a mesh; see :func:`replicate`."""

    def __init__(self, fn: Callable, num_replicas: int | None = None, logical_devices: int = 1,
                 devices: Any = None, loss_reduction: str = "mean",
                 options: RunOptions | None = None, steps_per_call: int = 1,
                 donate: bool = False, step_outputs: str = "stack", axis_name: str | None = None,
                 static_argnums: Any = (), static_argnames: Any = ()):
        _validate.replicate_args(fn, num_replicas, logical_devices, devices, loss_reduction,
                                 options, steps_per_call, donate, step_outputs, RunOptions)
        self.axis_name = _validate.axis_name(axis_name)
        self._static_argnums, self._static_argnames = _validate.static_args(
            static_argnums, static_argnames)
        if step_outputs not in STEP_OUTPUTS:
            raise ValueError(f"replicate: step_outputs must be one of {STEP_OUTPUTS}, "
                             f"got {step_outputs!r}")
        if devices is not None:
            flat = list(np.asarray(devices, dtype=object).ravel())
            dups = sorted({str(d) for d in flat if flat.count(d) > 1})
            if dups:
                raise ValueError(f"replicate: devices lists {', '.join(dups)} more than once; "
                                 f"each of the {len(flat)} devices must be distinct")
        avail = np.asarray(devices).size if devices is not None else len(jax.devices())
        if num_replicas is None:
            num_replicas = max(1, avail // logical_devices)
        need = num_replicas * logical_devices
        if need > avail:
            raise ValueError(f"replicate: {num_replicas} replicas × {logical_devices} logical devices "
                             f"need {need} devices but only {avail} are available")
        self.fn = fn
        self.num_replicas = num_replicas
        self.logical_devices = logical_devices
        self.loss_reduction = loss_reduction
        self.options = options or RunOptions()
        self.mesh = build_mesh(num_replicas, logical_devices, devices)
        self._cache = ExecutableCache()
        self._fast: dict[Any, Program] = {}  # (treedef, statics, context) -> its program
        self.layout = _prog.Layout(self.mesh, num_replicas, logical_devices)
        self.steps_per_call = steps_per_call
        self.donate = bool(donate)
        self.step_outputs = step_outputs
        self._dynamic = None
        self._process_count = self.layout.process_count
        #: the replica ids whose values this process passes and receives (all of them in a
        #: single process), in the order of a ``PerReplica``'s values
        self.local_replicas = tuple(self.layout.local_replicas)
        if self.layout.partial_replicas:
            raise ValueError(f"replicate: replicas {self.layout.partial_replicas} span devices "
                             f"of several processes; each replica's devices must belong to "
                             f"one process")
        #: the C++ dispatch of the last program whose inputs and results are all mirrored
        self._hit = None
        self._hits = itertools.count()
        # not the wrapped callable's __dict__: a callable object's attributes (eqx.filter_jit's
        # "fn", say) must not replace this object's own
        functools.update_wrapper(self, fn, updated=())
        if not isinstance(getattr(self, "__name__", None), str):
            # partials, bound methods of objects without __name__, callable objects
            self.__name__ = _callable_name(fn)
        self._statics_or_kwargs = bool(self._static_argnums or self._static_argnames)
        if self.options.dynamic_shapes:
            from runtime.dynamic import DynamicPath
            self._dynamic = DynamicPath(self)

    # -- the hot path -------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The last all-mirrored program's C++ dispatch (``None`` until there is one): it
        # flattens the arguments and looks their signature up in its own cache, and a miss
        # there runs Program's check of the full key (weak types included, and no
        # PerReplica) before anything runs, so a hit costs what a jax.jit hit costs.
        # Anything else (another signature, a PerReplica, a placement to fix, no such
        # program yet) raises before running and takes the general path.
        if kwargs or self._statics_or_kwargs:
            return self._call(*self._split_call(args, kwargs))
        try:
            out = self._hit(*args)
        except (TypeError, ValueError):
            pass  # (outside the handler: an error of the general path is not chained to it)
        else:
            next(self._hits)
            return out
        return self._call(args)

    # -- static arguments and keyword arguments ------------------------------------------
    def _split_call(self, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
        """The dynamic arguments (the keyword ones as a dict after the positional ones) and
        the statics: the key entries that say how to call ``fn`` (see ``_callable``). A
        static value's entry holds its type too: ``1``, ``1.0`` and ``True`` are equal
        and hash alike, but a step may take a different path for each (``jax.jit``
        keys them apart too), so they must not share a program."""
        dyn = list(args)
        statics: list[tuple] = []
        names = self._param_names()
        kw = dict(kwargs)
        argnums = set(self._static_argnums)
        for name in self._static_argnames:  # a static name passed by position
            if name in names and names.index(name) < len(args):
                argnums.add(names.index(name))
        for i in sorted(argnums, reverse=True):
            if i >= len(args):
                if i < len(names) and names[i] in kw:
                    continue  # passed by keyword: handled below
                raise TypeError(f"{self.__name__}: static argument {i} is not given (the step was "
                                f"called with {len(args)} positional arguments)")
            v = _validate.hashable_static(args[i], f"argument {i}")
            statics.append(("pos", i, v, type(v)))
            del dyn[i]
        static_names = set(self._static_argnames) | {names[i] for i in argnums if i < len(names)}
        for name in sorted(static_names & set(kw)):
            v = _validate.hashable_static(kw.pop(name), f"argument {name!r}")
            statics.append(("kw", name, v, type(v)))
        if kw:
            statics.append(("kwargs", tuple(sorted(kw))))
            dyn.append({k: kw[k] for k in sorted(kw)})
        statics.sort(key=lambda t: (t[0], t[1]))
        return tuple(dyn), tuple(statics)

    def _param_names(self) -> list[str]:
        names = getattr(self, "_names_cache", None)
        if names is None:
            import inspect
            try:
                names = [p.name for p in inspect.signature(self.fn).parameters.values()
                         if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            except (TypeError, ValueError):
                names = []
            self._names_cache = names
        return names

    def _callable(self, statics: tuple) -> Callable:
        """``fn`` as called with dynamic arguments only (see ``_split_call``)."""
        if not statics:
            return self.fn
        pos = sorted((t[1], t[2]) for t in statics if t[0] == "pos")
        kws = {t[1]: t[2] for t in statics if t[0] == "kw"}
        has_kwargs = any(t[0] == "kwargs" for t in statics)
        fn = self.fn

        def call(*dyn: Any) -> Any:
            dyn = list(dyn)
            kw = dict(dyn.pop()) if has_kwargs else {}
            for i, v in pos:
                dyn.insert(i, v)
            return fn(*dyn, **kw, **kws)
        return call

    def _call(self, args: tuple, statics: tuple = ()) -> Any:
        """The general path: the dynamic path, or the key, the cache and a program's run."""
        if self.layout.compile_only:
            raise self._compile_only_error()
        if jax.config.jax_disable_jit:
            raise self._disable_jit_error()
        if self._dynamic is not None:
            return self._dynamic.call(args, statics)
        leaves, treedef = _tree_flatten(args)
        # JAX's context (default_matmul_precision, numpy_rank_promotion, x64, ...) changes
        # what a trace gives, so it is part of every key, as it is of jit's
        ctx = jc.trace_context()
        prog = self._fast.get((treedef, statics, ctx))
        if prog is not None and self._fast_key_matches(prog, leaves):
            # The last program for this structure: the executable itself checks every
            # argument's shape and dtype (a TypeError before anything runs), but not weak
            # types, which _fast_key_matches compares (a weak array must not run a strong
            # program), nor what only the per-replica values show (_fast_inputs).
            flat = leaves if not prog.pr_fast else self._fast_inputs(prog, leaves)
            if flat is not None and prog.donated:
                _validate.check_donated_distinct(leaves, prog.donated)
            if flat is not None:
                try:
                    outs = prog.call(*flat)
                except (TypeError, ValueError):  # types or placement differ: the slow path decides
                    pass
                else:
                    self._cache.count_fast_hit()
                    if prog.donated:
                        _prog.delete_donated(leaves, prog.donated)
                    return prog.out_treedef.unflatten(outs) if not prog.out_varying_any else \
                        prog.outputs(outs)
        key = self._key_from(leaves, treedef) + ((statics,) if statics else ())
        prog = self._cache.get((key, ctx))
        if prog is None:
            prog = self._cache.get_or_build((key, ctx),
                                            lambda: self._build(leaves, treedef, key))
        prog.ctx = ctx
        if prog.hit is not None:
            self._hit = prog.hit
        elif all(lay is None for lay in prog.in_layout) or self._process_count == 1:
            if not prog.fast_ready:  # (the program's key: the same for every call)
                sigs = key[1]
                prog.scalar_sigs = tuple((i, s) for i, s in enumerate(sigs) if s[0] == ())
                prog.array_weak = tuple((i, s[2]) for i, s in enumerate(sigs)
                                        if s[0] != () and s[0] != "per_replica")
                prog.pr_fast = tuple((i, lay[0], tuple(len(x[0]) for x in s[2]),
                                      tuple(bool(x[2]) for x in s[2]), s[2])
                                     for i, (s, lay) in enumerate(zip(sigs, prog.in_layout))
                                     if lay is not None)
                prog.fast_ready = True
            if prog.entry_tree is None:
                self._fast[(treedef, statics, ctx)] = prog
        return prog.run(leaves)

    def _fast_inputs(self, prog: Program, leaves: list) -> list | None:
        """The flat inputs of a program with per-replica arguments, when every one of them
        is a global batch (``distribute``, ``distribute_iterator``, a step's result) with the
        inner structure, per-replica ranks and weak types the program was built for: such
        values are uniform across replicas by construction, and the executable checks the
        global shapes and dtypes; or a list of arrays, one per replica (NumPy, or each on
        its replica's device), each of the program's per-replica signature
        (:meth:`_replica_arrays`). ``None`` sends the
        call to the slow path (any other per-replica list, which it validates replica by
        replica)."""
        flat: list = []
        last = 0
        for i, td, ranks, weaks, sigs in prog.pr_fast:
            pr = leaves[i]
            if type(pr) is not PerReplica:  # an array where a PerReplica was: same treedef
                return None
            g = pr._global
            if g is None:  # one array per replica
                one = self._replica_arrays(pr, td, sigs[0])
                if one is None:
                    return None
                inputs = [one]
            else:
                if g[0] != td or pr._n != self.num_replicas:
                    return None
                vshape = pr._vshape
                for a, rank, weak in zip(g[1], ranks, weaks):
                    # a global (n,) holds n scalars or n one-element vectors: the rank decides
                    if (len(vshape) if vshape is not None else np.ndim(a)) != rank or \
                            bool(getattr(a, "weak_type", False)) != weak:
                        return None
                inputs = self.layout.global_inputs(pr, (td, ranks))
            flat.extend(leaves[last:i])
            flat.extend(inputs)
            last = i + 1
        flat.extend(leaves[last:])
        return flat

    def _replica_arrays(self, pr: PerReplica, td: Any, sig: tuple) -> Any:
        """The global input of a per-replica argument given as one array per replica
        (``PerReplica([x0, x1, ...])``), when each is exactly the program's per-replica
        signature ``sig`` (the check the slow path's key makes): NumPy arrays (never
        weak), or device arrays each on its replica's device (``Layout.placed_global``);
        else ``None``."""
        vals = pr._values
        if td != LEAF_TREEDEF or vals is None or len(vals) != self.num_replicas or \
                self._process_count != 1:
            return None
        shape, dtype = sig[0], sig[1]
        if type(vals[0]) is not np.ndarray:
            return self.layout.placed_global(vals, shape, dtype, bool(sig[2]))
        if sig[2]:
            return None
        for v in vals:
            if type(v) is not np.ndarray or v.shape != shape or v.dtype != dtype:
                return None
        return self.layout.host_global(vals, len(shape))

    @staticmethod
    def _fast_key_matches(prog: Program, leaves: list) -> bool:
        """The key entries the executable does not check itself: the full signature of
        rank-0 inputs (Python scalars are weak) and the weak type of the others. Plain
        loops: this runs on every cache hit. A leaf that has no signature (a
        ``PerReplica`` where the program took a mirrored scalar: a step's per-replica
        result fed back; or no array at all) is no match: the slow path's key decides,
        and names what is wrong."""
        for i, s in prog.scalar_sigs:
            x = leaves[i]
            if type(x) is PerReplica:
                return False
            try:
                if leaf_sig(x) != s:
                    return False
            except (TypeError, ValueError):
                return False
        for i, w in prog.array_weak:
            if getattr(leaves[i], "weak_type", False) is not w:
                return False
        return True

    def _run(self, prog: Program, args: tuple, kwargs: dict | None = None) -> Any:
        """Run a program compiled ahead of time (``Compiled.__call__``), after checking
        that the arguments match what it was compiled for."""
        if self.layout.compile_only:
            raise self._compile_only_error()
        args, statics = self._split_call(args, kwargs or {}) if (
            kwargs or self._statics_or_kwargs) else (args, ())
        if self._dynamic is not None:
            return self._dynamic.run_compiled(prog, args, statics)
        leaves, _, key = self._key_of(args)
        _check_same_signature(prog.key, key + ((statics,) if statics else ()))
        return prog.compile().run(leaves)

    def _disable_jit_error(self) -> Exception:
        return RuntimeError(
            f"{self.__name__}: jax.disable_jit() is on, but a replicated step runs only as one "
            f"compiled program over its {self.num_replicas} replicas (its collectives need "
            f"every replica at once); call it outside disable_jit. To look inside the step: "
            f"jax.debug.print / jax.debug.callback in it, or RunOptions(dump_dir=...) for the "
            f"IR after every pass")

    def _compile_only_error(self) -> Exception:
        from runtime.tpu import CompileOnlyError
        d = self.layout.devices_nk.flat[0]
        return CompileOnlyError(
            f"{self.__name__} targets {self.layout.devices_nk.size} {d.device_kind} devices "
            f"that this machine does not have (rt.tpu_devices): it can be lowered, compiled and "
            f"inspected (step.lower(*args).compile(), .memory_fit(), .roofline(), "
            f"replicate-inspect --target), not run")

    def _sig(self, pr: PerReplica, index: int) -> tuple:
        n = len(self.local_replicas)
        if len(pr) != n:
            where = (f"on {n} replicas" if self._process_count == 1 else
                     f"{n} replicas in this process (of {self.num_replicas} in all)")
            raise ValueError(f"PerReplica argument (leaf {index} of the arguments) has "
                             f"{len(pr)} values but the step runs {where}")
        if pr._values is None and pr._vshape is not None:
            # a step's result not yet split: every value has its global array's dtype
            g = pr._global[1][0]
            return ("per_replica", LEAF_TREEDEF, ((pr._vshape, g.dtype, bool(g.weak_type)),))
        leaves0, td0 = jax.tree.flatten(pr.values[0])
        sig0 = tuple(leaf_sig(x) for x in leaves0)
        for r in range(1, n):
            leaves, td = jax.tree.flatten(pr.values[r])
            if td != td0:
                raise ValueError(f"PerReplica argument (leaf {index}): replica {r}'s value has "
                                 f"structure {td} but replica 0's has {td0}")
            for j, x in enumerate(leaves):
                s = leaf_sig(x)
                if s[:2] != sig0[j][:2]:
                    raise ValueError(
                        f"PerReplica argument (leaf {index}): replica {r}'s leaf {j} has shape "
                        f"{tuple(s[0])} and dtype {s[1]} but replica 0's has shape "
                        f"{tuple(sig0[j][0])} and dtype {sig0[j][1]}")
        return ("per_replica", td0, sig0)

    # -- ahead of time & introspection ---------------------------------------------------
    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Trace, run the passes and lower for these arguments (arrays or
        ``jax.ShapeDtypeStruct``, ``PerReplica`` of either for per-replica inputs)."""
        if jax.config.jax_disable_jit:
            raise self._disable_jit_error()
        args, statics = self._split_call(args, kwargs) if (
            kwargs or self._statics_or_kwargs) else (args, ())
        if self._dynamic is not None:  # dynamic shapes: needs arrays (their real sizes)
            return Lowered(self._dynamic.lower(args, statics))
        leaves, treedef, key = self._key_of(args)
        return Lowered(_prog.build(self, leaves, treedef, key + ((statics,) if statics else ())))

    def _key_of(self, args: tuple) -> tuple[list, Any, tuple]:
        """(leaves, treedef, cache key) of a call's arguments (the slow path's key)."""
        leaves, treedef = _tree_flatten(args)
        return leaves, treedef, self._key_from(leaves, treedef)

    def _key_from(self, leaves: list, treedef: Any) -> tuple:
        """The cache key: the structure and every leaf's signature (per-replica leaves
        validated across replicas). A leaf that is not an array or a number is a
        ``TypeError`` naming its path."""
        is_value = _validate.is_leaf_value
        for x in leaves:
            if not is_value(x) and (type(x) is not PerReplica or (
                    x._values is not None and not all(
                        is_value(y) for v in x._values for y in jax.tree.leaves(v)))):
                _validate.check_arguments(treedef.unflatten(leaves))
        return (treedef, tuple(self._sig(x, i) if type(x) is PerReplica else leaf_sig(x)
                               for i, x in enumerate(leaves)))

    def cache_info(self) -> CacheInfo:
        """Hits (from memory), misses (builds), the number of cached executables, and with
        a persistent cache the misses served from disk and the records written."""
        info = self._cache.info()
        # hits served by an executable's own C++ dispatch (the count's value, unconsumed)
        direct = int(repr(self._hits)[len("count("):-1])
        return info._replace(hits=info.hits + direct)

    def _build(self, leaves: list, treedef: Any, key: tuple) -> Program:
        """A cache miss: trace, then the persistent cache's record of that program when
        there is one, else passes, lower and compile (and store the result on disk)."""
        from runtime import persistent
        if self._process_count > 1:  # (every process must build the same program)
            from runtime.distributed import check_same_arguments, describe_arguments
            check_same_arguments(getattr(self, "__name__", "step"), describe_arguments(key))
        root = persistent.usable_cache_dir(self.options)
        if not root:
            # only the final IR is needed to run (a dump or a record keeps them all)
            return _prog.build(self, leaves, treedef, key, keep=False).compile()
        store = persistent.PersistentCache(root)
        return store.build(self, key, lambda: _prog.trace_step(self, leaves, treedef, key),
                           lambda traced: _prog.build(self, leaves, treedef, key,
                                                      traced=traced).compile())

    def _dump_folder(self, key: tuple, sub: str = "") -> str:
        """``<dump dir>/<fn>-<key hash>[/sub]``, or ``""`` when not dumping."""
        import os
        from compiler.pass_manager import DUMP_ENV
        root = self.options.dump_dir or os.environ.get(DUMP_ENV)
        if not root:
            return ""
        from runtime.persistent import short_name
        return os.path.join(root, short_name(self, key), sub)

    def cache_explain(self) -> str:
        """Which persistent-key entries differed from the newest record of this function
        on the last miss (needs ``RunOptions(cache_dir=...)`` or ``$RT_CACHE_DIR``)."""
        from runtime.persistent import explain_text
        return explain_text(getattr(self, "_last_miss", None) or {})

    def cache_clear(self) -> None:
        """Drop every compiled program (the fast path's too) and reset the counts."""
        self._cache.clear()
        self._fast.clear()
        self._hit = None
        self._hits = itertools.count()
        if self._dynamic is not None:
            self._dynamic.planned.clear()

    def ir(self, *args: Any, after: str | None = None) -> Graph:
        """Shortcut for ``self.lower(*args).ir(after)``."""
        return self.lower(*args).ir(after)


def _callable_name(fn: Any) -> str:
    """A name for any callable: a function's, a partial's function's, a callable object's
    class."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    return type(fn).__name__


def _describe(sig: Any) -> str:
    if sig and sig[0] == "per_replica":
        return "PerReplica of " + ", ".join(_describe(s) for s in sig[2])
    return f"{getattr(sig[1], 'name', sig[1])}{list(sig[0])}"


def _check_same_signature(compiled_key: tuple, key: tuple) -> None:
    """Raise ``TypeError`` naming the first argument leaf whose structure, shape or dtype
    differs from what a program was compiled for (weak types may differ, as in JAX)."""
    if compiled_key[0] != key[0]:
        raise TypeError(f"the compiled step takes arguments of structure {compiled_key[0]} "
                        f"but was called with {key[0]}")

    def strip(sig):
        if sig and sig[0] == "per_replica":
            return (sig[0], sig[1], tuple(strip(s) for s in sig[2]))
        return tuple(sig[:2])
    for i, (want, got) in enumerate(zip(compiled_key[1], key[1])):
        if strip(want) != strip(got):
            raise TypeError(f"argument leaf {i}: the compiled step takes {_describe(want)} but "
                            f"was called with {_describe(got)}")
    # the static arguments (and how keyword arguments were passed) were traced into it
    want, got = compiled_key[2] if len(compiled_key) > 2 else (), key[2] if len(key) > 2 else ()
    if want != got:
        raise TypeError(f"the compiled step was compiled for the static arguments "
                        f"{_describe_statics(want)} but was called with "
                        f"{_describe_statics(got)}; lower and compile for these")


def _describe_statics(statics: tuple) -> str:
    parts = [f"{s[1]}={s[2]!r}" if s[0] == "kw" else f"argument {s[1]}={s[2]!r}"
             for s in statics if s[0] in ("pos", "kw")]
    names = [n for s in statics if s[0] == "kwargs" for n in s[1]]
    if names:
        parts.append("keyword arguments " + ", ".join(names))
    return "(" + ", ".join(parts) + ")" if parts else "(none)"


def replicate(fn: Callable | None = None, *, num_replicas: int | None = None,
              logical_devices: int = 1, devices: Any = None, loss_reduction: str = "mean",
              options: RunOptions | None = None, steps_per_call: int = 1, donate: bool = False,
              step_outputs: str = "stack", axis_name: str | None = None,
              static_argnums: Any = (), static_argnames: Any = ()) -> Any:
    """Replicate a per-replica step function; usable as ``replicate(fn, ...)``,
    ``@replicate`` and ``@replicate(...)``.

    num_replicas: N (default: all devices // logical_devices; with ``jax.distributed``
    initialized, the devices of every process). logical_devices: K devices per replica.
    devices: an explicit N×K device array (device k of replica r). loss_reduction:
    ``"mean"`` (gradient of (1/N)·Σ loss_r) or ``"sum"`` (of Σ loss_r).
    Raises ``ValueError`` when N × K exceeds the devices available.

    Multi-step executables (TF's ``steps_per_execution``): with ``steps_per_call=k > 1``
    one call runs k steps as one ``lax.scan`` in one executable. The step must then be
    ``fn(state, *inputs) -> (state, outputs)``: argument 0 is the state, carried from step
    to step (the returned state must have the same structure and dtypes); every
    ``PerReplica`` leaf of the other arguments stacks the k steps' batches on axis 0, i.e.
    replica r's value has shape ``[k, ...]`` and step t sees ``value[t]`` (build it with
    ``rt.distribute_steps(batches, n)`` from a list of k global batches); mirrored
    arguments after the state are the same in every step. A call returns
    ``(final_state, outputs)``, where each output leaf has the k steps stacked on a new axis
    0 (``step_outputs="stack"``) or is the last step's (``"last"``, TF's
    ``set_last_step_output``), or their ``"mean"`` / ``"sum"`` over the steps.

    donate: donate the mirrored leaves of argument 0 (the state) to the executable
    (``donate_argnums``): XLA may reuse their buffers for the new state, and those input
    arrays are deleted after each call (``x.is_deleted()``); pass the returned state next.

    axis_name: the name the step's code uses for the replica axis, as ``jax.pmap``'s
    ``axis_name``: ``lax.pmean(grads, 'batch')``, ``lax.psum``, ``lax.axis_index``,
    ``flax.linen.BatchNorm(axis_name='batch')`` then run unchanged (see the README's
    "Porting from pmap"). static_argnums / static_argnames: arguments that are Python
    values (shapes, flags) rather than arrays, as in ``jax.jit``: they must be hashable and
    are part of the cache key. Keyword arguments are passed to ``fn`` as given
    (``step(state, batch, rng=keys)``; ``PerReplica`` values are allowed)."""
    def wrap(f: Callable) -> Replicated:
        return Replicated(f, num_replicas, logical_devices, devices, loss_reduction, options,
                          steps_per_call, donate, step_outputs, axis_name, static_argnums,
                          static_argnames)
    return wrap if fn is None else wrap(fn)
