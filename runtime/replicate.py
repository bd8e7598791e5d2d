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
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from compiler.lower import build_jitted
from compiler.mesh import build_mesh
from compiler.pass_manager import PassManager, parse_pipeline
from compiler.passes import DEFAULT_PIPELINE
from compiler.trace import LeafSpec, trace_replica_fn
from ir import _jax_compat as jc
from ir.graph import Graph
from ir.jaxpr_import import REPLICA_AXIS
from ir.types import Replica
from runtime.cache import CacheInfo, ExecutableCache
from runtime.per_replica import LEAF_TREEDEF, PerReplica
from runtime.stages import Lowered

log = logging.getLogger("runtime")
_tree_flatten = jax.tree_util.tree_flatten
#: a (1,) shard -> its scalar, through jit's C++ dispatch (an eager reshape costs ~3x)
_to_scalar = jax.jit(lambda x: x.reshape(()))


@dataclass(frozen=True)
class RunOptions:
    """Static options of a replicated step; all of them are part of the cache key.

    pipeline: the passes to run, as a string. dump_dir: at every compile, write the IR
    after every pass, the StableHLO, the partitioned HLO and a report into
    ``dump_dir/<fn>-<key hash>/`` (``$RT_DUMP_DIR`` also works; see ``runtime.report``).
    cache_dir: keep compiled programs on disk across processes (``$RT_CACHE_DIR`` also
    works; see ``runtime.persistent``; not part of the key). verify: run the verifier after every pass.
    bucket_bytes: merge gradient all-reduces into buckets of at most this many bytes (0:
    off; XLA's own combiner still merges them). dynamic_shapes / bucketing /
    maximum_shapes / dynamic_dims / max_compiles_warning: padding of dynamic shapes (see
    ``runtime.dynamic``)."""

    dynamic_shapes: bool = False
    bucketing: Any = "pow2"
    maximum_shapes: Any = None
    pipeline: str = DEFAULT_PIPELINE
    dump_dir: str | None = None
    verify: bool = True
    bucket_bytes: int = 0
    cache_dir: str | None = None
    dynamic_dims: Any = None
    max_compiles_warning: int | None = 16

    def __post_init__(self) -> None:
        if self.dynamic_shapes:
            from runtime.dynamic import check_options
            check_options(self)

    def __hash__(self) -> int:
        # fields may hold lists and dicts (maximum_shapes, dynamic_dims, bucketing): hash a
        # frozen copy, so options can key a dict like any other static argument
        return hash(tuple(_frozen(getattr(self, f.name)) for f in dataclasses.fields(self)))


def _frozen(v: Any) -> Any:
    """A hashable stand-in for an option value: lists and tuples -> tuples, dicts -> tuples
    of items; anything else (callables included) as it is."""
    if isinstance(v, dict):
        return ("dict",) + tuple((_frozen(k), _frozen(x)) for k, x in sorted(v.items(), key=repr))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


def _scalar_sig(x: Any) -> tuple:
    a = np.asarray(x)
    return (a.shape, jax.dtypes.canonicalize_dtype(a.dtype), True)


def _generic_sig(x: Any) -> tuple:
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return (tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False)))
    a = np.asarray(x)
    return (a.shape, jax.dtypes.canonicalize_dtype(a.dtype), False)


_SIG: dict[type, Callable[[Any], tuple]] = {
    np.ndarray: lambda x: (x.shape, jax.dtypes.canonicalize_dtype(x.dtype), False),
    int: _scalar_sig, float: _scalar_sig, bool: _scalar_sig, complex: _scalar_sig,
}


def leaf_sig(x: Any) -> tuple:
    """(shape, dtype, weak_type) of one mirrored leaf: the part of the cache key it decides."""
    f = _SIG.get(type(x))
    if f is None:
        f = _generic_sig
        if isinstance(x, jax.Array):
            # typed PRNG key arrays are jax.Arrays without ``weak_type``
            f = _SIG[type(x)] = lambda a: (a.shape, a.dtype, getattr(a, "weak_type", False))
    return f(x)


class _Program:
    """Everything built for one cache key: the IR records, the jitted function, its
    StableHLO and (once compiled) its executable, and how to map inputs and outputs."""

    def __init__(self, owner: Replicated, records, jitted, jax_lowered, in_layout, out_treedef,
                 out_varying, out_ranks):
        self.owner = owner
        self.records = records
        self.jitted = jitted
        self.jax_lowered = jax_lowered
        self.jax_compiled = None
        self.in_layout = in_layout      # per arg leaf: None (mirrored) or (inner_treedef, ranks)
        self.out_treedef = out_treedef
        self.out_varying = out_varying
        self.out_ranks = out_ranks
        self.out_varying_any = any(out_varying)
        self.scalar_sigs: tuple = ()  # (index, sig) of rank-0 inputs, for the fast path
        self.array_weak: tuple = ()   # (index, weak_type) of the other mirrored inputs, likewise
        self.pr_fast: tuple = ()      # (index, inner treedef, ranks, weak types) of per-replica ones
        self.donated: tuple = ()  # indices of argument leaves donated (deleted after a call)
        self.call = None

    def compile(self) -> _Program:
        if self.jax_compiled is None:
            t0 = time.perf_counter()
            self.jax_compiled = self.jax_lowered.compile()
            self.call = jc.fast_callable(self.jax_compiled)
            log.info("compiled %s in %.3f s", self.owner.__name__, time.perf_counter() - t0)
            folder = self.owner._dump_folder(self.key)
            if folder:
                from runtime.report import write_dump
                write_dump(self, folder)
        return self


class Replicated:
    """A step function replicated over a mesh; see :func:`replicate`."""

    def __init__(self, fn: Callable, num_replicas: int | None = None, logical_devices: int = 1,
                 devices: Any = None, loss_reduction: str = "mean",
                 options: RunOptions | None = None, steps_per_call: int = 1,
                 donate: bool = False, step_outputs: str = "stack"):
        if not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise ValueError(f"replicate: steps_per_call must be a positive int, got {steps_per_call!r}")
        if step_outputs not in STEP_OUTPUTS:
            raise ValueError(f"replicate: step_outputs must be one of {STEP_OUTPUTS}, "
                             f"got {step_outputs!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"replicate: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if not isinstance(logical_devices, int) or logical_devices < 1:
            raise ValueError(f"replicate: logical_devices must be a positive int, got {logical_devices!r}")
        if devices is not None:
            flat = list(np.asarray(devices, dtype=object).ravel())
            dups = sorted({str(d) for d in flat if flat.count(d) > 1})
            if dups:
                raise ValueError(f"replicate: devices lists {', '.join(dups)} more than once; "
                                 f"each of the {len(flat)} devices must be distinct")
        avail = np.asarray(devices).size if devices is not None else len(jax.devices())
        if num_replicas is None:
            num_replicas = max(1, avail // logical_devices)
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"replicate: num_replicas must be a positive int, got {num_replicas!r}")
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
        self._fast: dict[Any, _Program] = {}  # treedef -> last mirrored-only program
        self._devices_nk = self.mesh.devices.reshape(num_replicas, logical_devices)
        self._replica_devices = [self._devices_nk[r, 0] for r in range(num_replicas)]
        self._varying_sharding = NamedSharding(self.mesh, P(REPLICA_AXIS))
        self.steps_per_call = steps_per_call
        self.donate = bool(donate)
        self.step_outputs = step_outputs
        self._dynamic = None
        # Multi-process (jax.distributed): the mesh spans every process's devices, and each
        # process passes and receives the values of its own (local) replicas only.
        self._process_count = jax.process_count()
        me = jax.process_index()
        self._local_replicas = [r for r in range(num_replicas)
                                if all(d.process_index == me for d in self._devices_nk[r])]
        #: the replica ids whose values this process passes and receives (all of them in a
        #: single process), in the order of a ``PerReplica``'s values
        self.local_replicas = tuple(self._local_replicas)
        if self._process_count > 1:
            partial = [r for r in range(num_replicas) if r not in self._local_replicas
                       and any(d.process_index == me for d in self._devices_nk[r])]
            if partial:
                raise ValueError(f"replicate: replicas {partial} span devices of several "
                                 f"processes; each replica's devices must belong to one process")
        functools.update_wrapper(self, fn)
        if self.options.dynamic_shapes:
            from runtime.dynamic import DynamicPath
            self._dynamic = DynamicPath(self)

    # -- the hot path -------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        if self._dynamic is not None:
            return self._dynamic.call(args)
        leaves, treedef = _tree_flatten(args, _is_pr)
        prog = self._fast.get(treedef)
        if prog is not None and self._fast_key_matches(prog, leaves):
            # The last program for this structure: the executable itself checks every
            # argument's shape and dtype (a TypeError before anything runs), but not weak
            # types, which _fast_key_matches compares (a weak array must not run a strong
            # program), nor what only the per-replica values show (_fast_inputs).
            flat = leaves if not prog.pr_fast else self._fast_inputs(prog, leaves)
            if flat is not None:
                try:
                    outs = prog.call(*flat)
                except (TypeError, ValueError):  # types or placement differ: the slow path decides
                    pass
                else:
                    self._cache.count_fast_hit()
                    if prog.donated:
                        _delete_donated(leaves, prog.donated)
                    return prog.out_treedef.unflatten(outs) if not prog.out_varying_any else \
                        self._outputs(prog, outs)
        key = self._key_from(leaves, treedef)
        prog = self._cache.get(key)
        if prog is None:
            prog = self._cache.get_or_build(key, lambda: self._build(leaves, treedef, key))
        mirrored_only = all(lay is None for lay in prog.in_layout)
        if mirrored_only or self._process_count == 1:
            sigs = key[1]
            prog.scalar_sigs = tuple((i, s) for i, s in enumerate(sigs) if s[0] == ())
            prog.array_weak = tuple((i, s[2]) for i, s in enumerate(sigs)
                                    if s[0] != () and s[0] != "per_replica")
            prog.pr_fast = tuple((i, lay[0], tuple(len(x[0]) for x in s[2]),
                                  tuple(bool(x[2]) for x in s[2]))
                                 for i, (s, lay) in enumerate(zip(sigs, prog.in_layout))
                                 if lay is not None)
            self._fast[treedef] = prog
        return self._run_flat(prog, leaves)

    def _fast_inputs(self, prog: _Program, leaves: list) -> list | None:
        """The flat inputs of a program with per-replica arguments, when every one of them
        is a global batch (``distribute``, ``distribute_iterator``, a step's result) with the
        inner structure, per-replica ranks and weak types the program was built for: such
        values are uniform across replicas by construction, and the executable checks the
        global shapes and dtypes. ``None`` sends the call to the slow path (per-replica
        lists, which it validates replica by replica)."""
        flat: list = []
        last = 0
        for i, td, ranks, weaks in prog.pr_fast:
            pr = leaves[i]
            if type(pr) is not PerReplica:  # an array where a PerReplica was: same treedef
                return None
            g = pr._global
            if g is None or g[0] != td or pr._n != self.num_replicas:
                return None
            vshape = pr._vshape
            for a, rank, weak in zip(g[1], ranks, weaks):
                # a global (n,) holds n scalars or n one-element vectors: the rank decides
                if (len(vshape) if vshape is not None else np.ndim(a)) != rank or \
                        bool(getattr(a, "weak_type", False)) != weak:
                    return None
            flat.extend(leaves[last:i])
            flat.extend(self._global_inputs(pr, (td, ranks)))
            last = i + 1
        flat.extend(leaves[last:])
        return flat

    @staticmethod
    def _fast_key_matches(prog: _Program, leaves: list) -> bool:
        """The key entries the executable does not check itself: the full signature of
        rank-0 inputs (Python scalars are weak) and the weak type of the others. Plain
        loops: this runs on every cache hit."""
        for i, s in prog.scalar_sigs:
            if leaf_sig(leaves[i]) != s:
                return False
        for i, w in prog.array_weak:
            if getattr(leaves[i], "weak_type", False) is not w:
                return False
        return True

    def _run(self, prog: _Program, args: tuple) -> Any:
        """Run a program compiled ahead of time (``Compiled.__call__``), after checking
        that the arguments match what it was compiled for."""
        leaves, _, key = self._key_of(args)
        _check_same_signature(prog.key, key)
        return self._run_flat(prog.compile(), leaves)

    def _run_flat(self, prog: _Program, leaves: list) -> Any:
        flat = []
        for x, lay in zip(leaves, prog.in_layout):
            if lay is None:
                flat.append(x)
            else:
                flat.extend(self._global_inputs(x, lay))
        try:
            outs = prog.call(*flat)
        except ValueError as e:
            # An argument placed other than the program wants it (a per-replica input split
            # over the model axes, a mirrored array committed elsewhere): move it there.
            if "disagree with the" not in str(e) and self._process_count == 1:
                raise
            shardings = list(prog.jax_compiled.input_shardings[0])
            if self._process_count > 1:
                flat = [_to_global(x, s) for x, s in zip(flat, shardings)]
                outs = prog.call(*flat)
            else:
                outs = prog.call(*jax.device_put(flat, shardings))
        if prog.donated:
            _delete_donated(leaves, prog.donated)
        if not prog.out_varying_any:
            return prog.out_treedef.unflatten(outs)
        return self._outputs(prog, outs)

    def _outputs(self, prog: _Program, outs: list) -> Any:
        res = [self._split(o, r) if v else o for o, v, r in zip(outs, prog.out_varying, prog.out_ranks)]
        return prog.out_treedef.unflatten(res)

    def _global_inputs(self, pr: PerReplica, lay) -> list:
        """The global arrays (replicas concatenated on axis 0) of a per-replica argument.
        Host data stays on the host: the executable's C++ dispatch transfers it with the
        program's own input sharding, which costs less than a ``jax.device_put`` first
        (183 -> ~40 us for two 256 KiB leaves on 4 CPU devices)."""
        inner_treedef, ranks = lay
        if pr._global is not None and pr._global[0] == inner_treedef:
            glob = pr._global[1]
            if all(isinstance(g, jax.Array) and g.sharding == self._varying_sharding
                   for g in glob):
                return list(glob)
            if self._process_count == 1:
                if not any(isinstance(g, jax.Array) for g in glob):
                    return list(glob)
                return jax.device_put(list(glob), self._varying_sharding)
        n = self.num_replicas
        per = [jax.tree.leaves(v) for v in pr.values]
        if self._process_count == 1 and not any(isinstance(x, jax.Array) for p in per for x in p):
            # Host values: one concatenated buffer per leaf, transferred by the call
            # (N per-device transfers and an assemble cost ~1.7x as much).
            return [np.concatenate([np.reshape(p[j], (1,)) if rank == 0 else np.asarray(p[j])
                                    for p in per]) for j, rank in enumerate(ranks)]
        out = []
        for j, rank in enumerate(ranks):
            vals, devs = [], []
            for i, r in enumerate(self._local_replicas):
                v = per[i][j]
                if rank == 0:
                    v = np.reshape(v, (1,)) if not isinstance(v, jax.Array) else v.reshape((1,))
                for d in self._devices_nk[r]:
                    vals.append(v)
                    devs.append(d)
            # values already on their devices (a replica of one device) need no device_put,
            # a no-op that costs ~27 us per leaf at 1 replica and ~65 us at 4
            placed = all(isinstance(v, jax.Array) and v.is_fully_addressable
                         and v.devices() == {d} for v, d in zip(vals, devs))
            shards = vals if placed else jax.device_put(vals, devs)
            shape0 = np.shape(vals[0])
            gshape = (shape0[0] * n,) + tuple(shape0[1:])
            out.append(jax.make_array_from_single_device_arrays(gshape, self._varying_sharding, shards))
        return out

    def _split(self, arr: jax.Array, rank: int) -> PerReplica:
        """A varying output (the replicas' values concatenated on axis 0, or stacked when
        scalar) as a deferred ``PerReplica``: the split into one array per local replica
        (and a reshape dispatch per scalar) happens when ``.values`` is first read."""
        local, devices = self._local_replicas, self._replica_devices
        vshape = () if rank == 0 else (arr.shape[0] // self.num_replicas,) + tuple(arr.shape[1:])

        def values() -> list:
            by_dev = {s.device: s.data for s in arr.addressable_shards}
            vals = [by_dev[devices[r]] for r in local]
            if rank == 0:
                return [_to_scalar(v) for v in vals]
            if all(v.shape == vshape for v in vals):  # replicated over the model axes
                return vals
            # split over the replica's logical devices: each value is assembled from its
            # K tiles, and stays split over them (device 0's shard alone is one tile)
            return [self._replica_value(arr, vshape, by_dev, r) for r in local]
        return PerReplica.deferred(len(local), values, (arr,), stacked=(arr, vshape))

    def _replica_value(self, arr: jax.Array, vshape: tuple, by_dev: dict, r: int) -> jax.Array:
        """Replica ``r``'s value of a varying output that is split over its logical
        devices: one array over those devices, with the output's sharding less the
        replica axis."""
        from jax.sharding import Mesh
        names = self.mesh.axis_names[1:]
        sub = Mesh(self.mesh.devices[r], names)
        spec = []
        for d in arr.sharding.spec:
            axes = tuple(a for a in (d if isinstance(d, tuple) else (d,))
                         if a is not None and a != REPLICA_AXIS)
            spec.append(axes[0] if len(axes) == 1 else (axes or None))
        return jax.make_array_from_single_device_arrays(
            vshape, NamedSharding(sub, P(*spec)), [by_dev[d] for d in self._devices_nk[r]])

    def _sig(self, pr: PerReplica, index: int) -> tuple:
        n = len(self._local_replicas)
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

    # -- building -----------------------------------------------------------------------
    def _lower(self, leaves: list, treedef: Any, key: tuple) -> _Program:
        n = self.num_replicas
        specs: list[LeafSpec] = []
        in_layout: list = []
        for x, sig in zip(leaves, key[1]):
            if sig and sig[0] == "per_replica":
                _, td, sigs = sig
                in_layout.append((td, tuple(len(s[0]) for s in sigs)))
                specs.extend(LeafSpec(tuple(s[0]), s[1], s[2], True) for s in sigs)
            else:
                in_layout.append(None)
                specs.append(LeafSpec(tuple(sig[0]), sig[1], sig[2], False))
        out_info: dict[str, Any] = {}
        k_steps = self.steps_per_call
        # the state (argument 0) is carried across steps and, with donate=True, donated
        n_state = treedef.children()[0].num_leaves if treedef.children() else 0
        if k_steps > 1:
            if not treedef.children():
                raise TypeError(f"replicate(steps_per_call={k_steps}): the step takes no "
                                f"arguments; it must be fn(state, *inputs) -> (state, outputs)")
            _check_stacked(key[1][n_state:], k_steps)
        donated, pos = [], 0
        for i, lay in enumerate(in_layout):
            if self.donate and i < n_state and lay is None:
                donated.append((i, pos))
            pos += 1 if lay is None else len(lay[1])

        def build_args(slots):
            return jax.tree.unflatten(treedef, [s if lay is None else jax.tree.unflatten(lay[0], s)
                                                for s, lay in zip(slots, in_layout)])

        def flat_fn(*flat):
            it = iter(flat)
            slots = [next(it) if lay is None else [next(it) for _ in lay[1]] for lay in in_layout]
            if k_steps == 1:
                out = self.fn(*build_args(slots))
            else:
                mask = [False if lay is None else [True] * len(lay[1]) for lay in in_layout]
                out = _scan_steps(self.fn, build_args(slots), build_args(mask), k_steps,
                                  self.step_outputs)
            out_leaves, out_td = jax.tree.flatten(out)
            out_info["treedef"] = out_td
            return out_leaves

        graph, t_import = trace_replica_fn(flat_fn, specs, n, getattr(self.fn, "__name__", "step"),
                                           logical_devices=self.logical_devices)
        passes = parse_pipeline(self.options.pipeline, num_replicas=n,
                                loss_reduction=self.loss_reduction,
                                num_logical_devices=self.logical_devices,
                                bucket_bytes=self.options.bucket_bytes)
        pm = PassManager(passes, verify=self.options.verify,
                         dump_dir=self._dump_folder(key, "ir"))  # "": no dump
        final = pm.run(graph, import_seconds=t_import)
        out_varying = [v.type.replica is not Replica.MIRRORED for v in final.outputs]
        out_ranks = [v.type.rank for v in final.outputs]
        jitted = build_jitted(final, self.mesh, [s.varying for s in specs],
                              [len(s.shape) for s in specs], out_varying, out_ranks,
                              donate_argnums=tuple(p for _, p in donated))
        gavals = []
        for s in specs:
            shape = s.shape
            if s.varying:
                shape = (n * shape[0],) + tuple(shape[1:]) if shape else (n,)
            gavals.append(jax.ShapeDtypeStruct(shape, s.dtype, weak_type=s.weak_type))
        jax_lowered = jitted.lower(*gavals)
        prog = _Program(self, pm.records, jitted, jax_lowered, in_layout, out_info["treedef"],
                        out_varying, out_ranks)
        prog.key = key
        prog.donated = tuple(i for i, _ in donated)
        return prog

    # -- ahead of time & introspection ---------------------------------------------------
    def lower(self, *args: Any) -> Lowered:
        """Trace, run the passes and lower for these arguments (arrays or
        ``jax.ShapeDtypeStruct``, ``PerReplica`` of either for per-replica inputs)."""
        if self._dynamic is not None:  # dynamic shapes: needs arrays (their real sizes)
            return Lowered(self._dynamic.lower(args))
        return Lowered(self._lower(*self._key_of(args)))

    def _key_of(self, args: tuple) -> tuple[list, Any, tuple]:
        """(leaves, treedef, cache key) of a call's arguments (the slow path's key)."""
        leaves, treedef = _tree_flatten(args, _is_pr)
        return leaves, treedef, self._key_from(leaves, treedef)

    def _key_from(self, leaves: list, treedef: Any) -> tuple:
        """The cache key: the structure and every leaf's signature (per-replica leaves
        validated across replicas)."""
        return (treedef, tuple(self._sig(x, i) if type(x) is PerReplica else leaf_sig(x)
                               for i, x in enumerate(leaves)))

    def cache_info(self) -> CacheInfo:
        """Hits (from memory), misses (builds), the number of cached executables, and with
        a persistent cache the misses served from disk and the records written."""
        return self._cache.info()

    def _build(self, leaves: list, treedef: Any, key: tuple) -> _Program:
        """A cache miss: the persistent cache's record when there is one, else
        trace, passes, lower and compile (and store the result on disk)."""
        from runtime import persistent
        root = persistent.cache_dir_for(self.options)
        if not root:
            return self._lower(leaves, treedef, key).compile()
        store = persistent.PersistentCache(root)
        return store.build(self, key, lambda: self._lower(leaves, treedef, key).compile())

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
        if self._dynamic is not None:
            self._dynamic.ready.clear()

    def ir(self, *args: Any, after: str | None = None) -> Graph:
        """Shortcut for ``self.lower(*args).ir(after)``."""
        return self.lower(*args).ir(after)


STEP_OUTPUTS = ("stack", "last", "mean", "sum")


def _check_stacked(sigs: tuple, k: int) -> None:
    """Every per-replica leaf of the inputs after the state must carry the k steps on
    axis 0 (replica r's value for step t is ``leaf[t]``)."""
    for i, sig in enumerate(sigs):
        if sig and sig[0] == "per_replica":
            for j, s in enumerate(sig[2]):
                if not s[0] or s[0][0] != k:
                    raise ValueError(
                        f"replicate(steps_per_call={k}): per-replica input leaf {j} of argument "
                        f"leaf {i} after the state has shape {tuple(s[0])}; each replica's value "
                        f"must stack the {k} steps' batches on axis 0 (shape [{k}, ...])")


def _scan_steps(fn: Callable, args: tuple, mask: tuple, k: int, step_outputs: str) -> Any:
    """Run ``fn(state, *inputs) -> (state, outputs)`` for k steps as one ``lax.scan``:
    the state (argument 0) is the carry; the per-replica leaves of the other arguments
    (``mask`` True) are sliced along axis 0, one slice per step; mirrored ones are the same
    every step. Per-step outputs are stacked on a new axis 0, or reduced (``step_outputs``)."""
    state, rest = args[0], args[1:]
    state_leaves, state_td = jax.tree.flatten(state)
    state_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    rest_leaves, rest_td = jax.tree.flatten(rest)
    is_xs = jax.tree.leaves(mask[1:])
    xs = [x for x, m in zip(rest_leaves, is_xs) if m]

    def body(carry, xs_t):
        it = iter(xs_t)
        r = [next(it) if m else x for x, m in zip(rest_leaves, is_xs)]
        out = fn(state_td.unflatten(carry), *rest_td.unflatten(r))
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(f"replicate(steps_per_call={k}): the step must return "
                            f"(state, outputs), got {type(out).__name__}")
        new_leaves, new_td = jax.tree.flatten(out[0])
        if new_td != state_td:
            raise TypeError(f"replicate(steps_per_call={k}): the step returned a state of "
                            f"structure {new_td} but took {state_td}")
        for path, v, o in zip(state_paths, new_leaves, state_leaves):
            # a cast would silently change the user's numbers (an int32 counter made
            # float, a float32 state rounded to bfloat16): the loop carry must keep its type
            if jax.numpy.result_type(v) != jax.numpy.result_type(o) or np.shape(v) != np.shape(o):
                raise TypeError(
                    f"replicate(steps_per_call={k}): the step returned state leaf "
                    f"state{jax.tree_util.keystr(path)} as {jax.numpy.result_type(v)}"
                    f"{list(np.shape(v))} but took it as {jax.numpy.result_type(o)}"
                    f"{list(np.shape(o))}; with several steps per call the state is a loop "
                    f"carry and must keep its dtype and shape (cast it in the step, e.g. "
                    f"x.astype(...))")
        return new_leaves, out[1]

    carry, ys = lax.scan(body, state_leaves, xs, length=k)
    if step_outputs == "last":
        ys = jax.tree.map(lambda y: y[-1], ys)
    elif step_outputs == "mean":
        ys = jax.tree.map(lambda y: jax.numpy.mean(y, axis=0), ys)
    elif step_outputs == "sum":
        ys = jax.tree.map(lambda y: jax.numpy.sum(y, axis=0), ys)
    return state_td.unflatten(carry), ys


def _delete_donated(leaves: list, donated: tuple) -> None:
    """Donation gives the state's buffers to the step: delete the caller's arrays even when
    the executable got a copy (an array committed elsewhere, moved first), so that a
    donated input is deleted after every call, not only when XLA reused it."""
    for i in donated:
        x = leaves[i]
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def _to_global(x: Any, sharding: Any) -> Any:
    """Multi-process: a mirrored argument (the same host value in every process) as a global
    array with the program's sharding, built from this process's shards only."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    a = np.asarray(x)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


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


def _is_pr(x: Any) -> bool:
    return type(x) is PerReplica


def replicate(fn: Callable | None = None, *, num_replicas: int | None = None,
              logical_devices: int = 1, devices: Any = None, loss_reduction: str = "mean",
              options: RunOptions | None = None, steps_per_call: int = 1, donate: bool = False,
              step_outputs: str = "stack") -> Any:
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
    arrays are deleted after each call (``x.is_deleted()``); pass the returned state next."""
    def wrap(f: Callable) -> Replicated:
        return Replicated(f, num_replicas, logical_devices, devices, loss_reduction, options,
                          steps_per_call, donate, step_outputs)
    return wrap if fn is None else wrap(fn)
