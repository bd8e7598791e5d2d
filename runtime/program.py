"""The call path of a replicated step: one program per cache key, and how arguments go in
and results come out. ``replicate`` (static shapes), ``dynamic`` (padded buckets),
``persistent`` (records on disk) and ``stages`` (ahead of time) all use it; it imports
none of them.

- :func:`leaf_sig`: the part of the cache key one mirrored leaf decides.
- :func:`build`: trace, passes, lower (the IR run under ``shard_map`` + ``jax.jit``) for one
  key, giving a :class:`Program`; ``Program.compile()`` adds the executable.
  :func:`trace_step` is its first stage alone (the persistent cache checks a record
  against it), and ``build(..., traced=...)`` continues from it.
- :class:`Layout`: where a step's values live on its mesh: per-replica arguments as
  global arrays (:meth:`Layout.global_inputs`), varying results split back into deferred
  ``PerReplica`` values (:meth:`Layout.split`).
- :meth:`Program.run`: one call from flat argument leaves.

A program whose inputs and results are all mirrored (and nothing is donated) is lowered
over the caller's own argument structure, so its executable's C++ dispatch flattens the
arguments, checks their signature and unflattens the results itself: a cache hit then
costs what a ``jax.jit`` hit costs (``Program.hit``; see ``Replicated.__call__``).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from compiler.lower import build_jitted
from compiler.pass_manager import PassManager, parse_pipeline, rerun
from compiler.trace import LeafSpec, global_shape, trace_replica_fn
from ir import _jax_compat as jc
from ir.jaxpr_import import REPLICA_AXIS
from ir.types import Replica
from runtime.divergence import check_diverging_state, watching_local_views
from runtime.per_replica import PerReplica

log = logging.getLogger("runtime")
#: a (1,) shard -> its scalar, through jit's C++ dispatch (an eager reshape costs ~3x)
_to_scalar = jax.jit(lambda x: x.reshape(()))


# -- signatures -------------------------------------------------------------------------
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


class SignatureMismatch(TypeError):
    """Arguments that do not have the signature a program was compiled for."""


# -- the garbage collector while a program is built -------------------------------------
_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = True


@contextlib.contextmanager
def gc_paused():
    """No automatic garbage collection while a program is built. Tracing, the passes and
    lowering create many objects that all stay alive; CPython's collector would scan the
    whole process (JAX, flax, ...) for garbage there is none of, often a full collection
    of ~70 ms in the first step of a process. The pending collection runs later as usual.
    Nested and concurrent builds keep it paused until the last one ends."""
    global _gc_depth, _gc_was_enabled
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


# -- where values live ------------------------------------------------------------------
def _raise_if_does_not_fit(error: Exception, owner: Any) -> None:
    """A TPU compile that ran out of HBM becomes ``DoesNotFitError`` with the numbers."""
    if not owner.layout.compile_only:
        return
    from runtime import tpu
    fit = tpu.fit_from_compile_error(str(error), owner.layout.devices_nk.flat[0])
    if fit is not None:
        raise tpu.DoesNotFitError(
            f"{owner.__name__} does not fit on {fit.device or 'the target device'}: "
            f"{str(fit).splitlines()[0]}; "
            f"use more logical devices per replica, a smaller batch per replica, or a chip "
            f"with more HBM", fit) from error


def is_compile_only(device: Any) -> bool:
    """Whether ``device`` belongs to a compile-only client: a TPU topology described by
    ``jax.experimental.topologies`` (``rt.tpu_devices``), which XLA compiles for but which
    this machine cannot run."""
    return type(getattr(device, "client", None)).__name__ == "CompileOnlyPyClient"


class Layout:
    """A step's mesh of N replicas × K logical devices, and this process's part of it."""

    def __init__(self, mesh: Mesh, num_replicas: int, logical_devices: int):
        self.mesh = mesh
        self.num_replicas = num_replicas
        self.devices_nk = mesh.devices.reshape(num_replicas, logical_devices)
        self.replica_devices = [self.devices_nk[r, 0] for r in range(num_replicas)]
        self.varying_sharding = NamedSharding(mesh, P(REPLICA_AXIS))
        # one device per replica, in the varying sharding's own device order: its global
        # arrays can be assembled from the replicas' arrays as they are (``placed_global``)
        self._assemble_ok = self.devices_nk.shape[1] == 1 and list(
            self.varying_sharding._internal_device_list) == self.replica_devices
        #: devices of a topology this machine does not have (``rt.tpu_devices``): the step
        #: lowers and compiles for them, as one program seen from one process, and never runs
        self.compile_only = is_compile_only(self.devices_nk.flat[0])
        if self.compile_only:
            self.process_count = 1
            self.local_replicas = list(range(num_replicas))
            self.partial_replicas = []
            return
        # Multi-process (jax.distributed): the mesh spans every process's devices, and each
        # process passes and receives the values of its own (local) replicas only.
        self.process_count = jax.process_count()
        me = jax.process_index()
        self.local_replicas = [r for r in range(num_replicas)
                               if all(d.process_index == me for d in self.devices_nk[r])]
        self.partial_replicas = [r for r in range(num_replicas) if r not in self.local_replicas
                                 and any(d.process_index == me for d in self.devices_nk[r])]

    def global_inputs(self, pr: PerReplica, lay) -> list:
        """The global arrays (replicas concatenated on axis 0) of a per-replica argument.
        Host data stays on the host: the executable's C++ dispatch transfers it with the
        program's own input sharding, which costs less than a ``jax.device_put`` first
        (183 -> ~40 us for two 256 KiB leaves on 4 CPU devices)."""
        inner_treedef, ranks = lay
        if pr._global is not None and pr._global[0] == inner_treedef:
            glob = pr._global[1]
            if all(isinstance(g, jax.Array) and g.sharding == self.varying_sharding
                   for g in glob):
                return list(glob)
            if self.process_count == 1:
                if not any(isinstance(g, jax.Array) for g in glob):
                    return list(glob)
                return jax.device_put(list(glob), self.varying_sharding)
        n = self.num_replicas
        per = [jax.tree.leaves(v) for v in pr.values]
        if self.process_count == 1 and not any(isinstance(x, jax.Array) for p in per for x in p):
            return [self.host_global([p[j] for p in per], rank) for j, rank in enumerate(ranks)]
        out = []
        for j, rank in enumerate(ranks):
            if self.process_count == 1 and rank:  # (each on its replica's device: as it is)
                v0 = per[0][j]
                placed = self.placed_global([p[j] for p in per], np.shape(v0),
                                            getattr(v0, "dtype", None),
                                            bool(getattr(v0, "weak_type", False)))
                if placed is not None:
                    out.append(placed)
                    continue
            vals, devs = [], []
            for i, r in enumerate(self.local_replicas):
                v = per[i][j]
                if rank == 0:
                    v = np.reshape(v, (1,)) if not isinstance(v, jax.Array) else v.reshape((1,))
                for d in self.devices_nk[r]:
                    vals.append(v)
                    devs.append(d)
            # values already on their devices (a replica of one device) need no device_put,
            # a no-op that costs ~27 us per leaf at 1 replica and ~65 us at 4
            placed = all(isinstance(v, jax.Array) and v.is_fully_addressable
                         and v.devices() == {d} for v, d in zip(vals, devs))
            shards = vals if placed else jax.device_put(vals, devs)
            shape0 = np.shape(vals[0])
            gshape = (shape0[0] * n,) + tuple(shape0[1:])
            out.append(jax.make_array_from_single_device_arrays(gshape, self.varying_sharding, shards))
        return out

    def placed_global(self, values: Sequence[Any], shape: tuple, dtype: Any,
                      weak: bool) -> jax.Array | None:
        """The global input of one leaf given as one device array per replica (a loader's
        per-device batches, a step's ``.values``), assembled without a copy when each is
        of the per-replica ``shape`` (rank >= 1), ``dtype`` and weak type and lies on its
        replica's one device (one logical device, one process); else ``None`` (the slow
        path moves and checks them)."""
        if not self._assemble_ok or not shape:
            return None
        for v, d in zip(values, self.replica_devices):
            if not jc.is_plain_array(v) or v.shape != shape or v.dtype != dtype or \
                    v.weak_type != weak or v.sharding.device_set != {d}:
                return None
        if self.num_replicas == 1:  # the array is the global one (a new array per call
            # costs the executable's dispatch ~15 us more than one it has seen)
            return values[0]
        return jc.assemble((shape[0] * self.num_replicas,) + shape[1:], self.varying_sharding,
                           values)

    @staticmethod
    def host_global(values: Sequence[Any], rank: int) -> np.ndarray:
        """The replicas' host values of one leaf as the global input: one buffer (replicas
        concatenated on axis 0, scalars stacked), transferred by the executable's call
        (N per-device transfers and an assemble cost ~1.7x as much). A copy even for one
        replica: on CPU the executable may read the buffer it is given after the call
        returns, and the caller's array is theirs to change."""
        if rank == 0:
            return np.concatenate([np.reshape(v, (1,)) for v in values])
        return np.concatenate([np.asarray(v) for v in values])

    def split(self, arr: jax.Array, rank: int) -> PerReplica:
        """A varying output (the replicas' values concatenated on axis 0, or stacked when
        scalar) as a deferred ``PerReplica``: the split into one array per local replica
        (and a reshape dispatch per scalar) happens when ``.values`` is first read."""
        local, devices = self.local_replicas, self.replica_devices
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
            return [self.replica_value(arr, vshape, by_dev, r) for r in local]
        return PerReplica.deferred(len(local), values, (arr,), stacked=(arr, vshape))

    def replica_value(self, arr: jax.Array, vshape: tuple, by_dev: dict, r: int) -> jax.Array:
        """Replica ``r``'s value of a varying output that is split over its logical
        devices: one array over those devices, with the output's sharding less the
        replica axis."""
        names = self.mesh.axis_names[1:]
        sub = Mesh(self.mesh.devices[r], names)
        spec = []
        for d in arr.sharding.spec:
            axes = tuple(a for a in (d if isinstance(d, tuple) else (d,))
                         if a is not None and a != REPLICA_AXIS)
            spec.append(axes[0] if len(axes) == 1 else (axes or None))
        return jax.make_array_from_single_device_arrays(
            vshape, NamedSharding(sub, P(*spec)), [by_dev[d] for d in self.devices_nk[r]])


# -- one program ------------------------------------------------------------------------
class Program:
    """Everything built for one cache key: the IR records, the jitted function, its
    StableHLO and (once compiled) its executable, and how to map inputs and outputs.

    ``entry_tree``: the argument structure the program was lowered over when it takes the
    caller's own arguments (all mirrored, see the module docstring), else ``None`` (it
    takes flat leaves, per-replica ones as global arrays). ``hit``: once compiled, the
    C++ callable a cache hit may use directly with the caller's arguments (or ``None``)."""

    def __init__(self, owner: Any, records, jax_lowered, in_layout, out_treedef,
                 out_varying, out_ranks, entry_tree: Any = None, passes: Any = None):
        # (not the ``jax.jit`` function lowered: JAX's trace cache would keep the second
        # trace's jaxpr alive, ~5 objects per IR op, for as long as the program lives)
        self.owner = owner
        self._records = records
        self._passes = passes  # to make the IR between the ends again (``records``)
        self.jax_lowered = jax_lowered
        self.jax_compiled = None
        self.in_layout = in_layout      # per arg leaf: None (mirrored) or (inner_treedef, ranks)
        self.out_treedef = out_treedef
        self.out_varying = out_varying
        self.out_ranks = out_ranks
        self.out_varying_any = any(out_varying)
        self.entry_tree = entry_tree
        self.scalar_sigs: tuple = ()  # (index, sig) of rank-0 inputs, for the fast path
        self.array_weak: tuple = ()   # (index, weak_type) of the other mirrored inputs, likewise
        self.pr_fast: tuple = ()      # (index, inner treedef, ranks, weak types, signatures)
        #                               of per-replica ones
        self.fast_ready = False       # the three above are set (from the key, once)
        self.donated: tuple = ()  # indices of argument leaves donated (deleted after a call)
        self.key: tuple = ()
        self.ctx: Any = None  # jc.trace_context() of the calls it serves (set by the caller)
        self.call = None
        self.hit = None
        self.lower_times: dict[str, float] = {}
        self.import_split: dict[str, float] = {}

    @property
    def records(self) -> list:
        """The pipeline's stages (``PassRecord``: name, seconds, graph). A program built
        with ``passes`` kept only the imported and the last graph; the others are made
        again the first time this is read (``pass_manager.rerun``)."""
        if self._passes is not None:
            self._records, self._passes = rerun(self._passes, self._records), None
        return self._records

    def stage_times(self) -> list[tuple[str, float]]:
        """(name, seconds) of each stage, without making any graph again."""
        return [(r.name, r.seconds) for r in self._records]

    def compile(self) -> Program:
        if self.jax_compiled is None:
            t0 = time.perf_counter()
            try:
                compiled = self.jax_lowered.compile()
            except Exception as e:  # noqa: BLE001 - the TPU compiler's out-of-memory refusal
                _raise_if_does_not_fit(e, self.owner)
                raise
            self.set_executable(compiled)
            log.info("compiled %s in %.3f s", self.owner.__name__, time.perf_counter() - t0)
            folder = self.owner._dump_folder(self.key)
            if folder:
                from runtime.report import write_dump
                write_dump(self, folder,
                           padding_overhead=getattr(self, "dyn_padding", None))
        return self

    def set_executable(self, compiled: Any) -> None:
        """Use ``compiled`` (a ``jax.stages.Compiled``, built or loaded from disk)."""
        self.jax_compiled = compiled
        self.call = jc.fast_callable(compiled)
        self.hit = None
        if self.entry_tree is not None:
            self.hit = jc.checked_cpp_call(compiled, self._check_entry)

    def _check_entry(self, args: tuple) -> None:
        """On a miss of the executable's own C++ cache: refuse arguments whose signature is
        not exactly the key's (weak types included, which the executable does not check),
        and calls in another JAX context (``jc.trace_context()``) than the program's."""
        leaves, treedef = jax.tree.flatten(args)
        if treedef != self.key[0] or len(leaves) != len(self.key[1]) or any(
                type(x) is PerReplica or leaf_sig(x) != s for x, s in zip(leaves, self.key[1])):
            raise SignatureMismatch("arguments differ from the program's signature")
        if jc.trace_context() != self.ctx:
            raise SignatureMismatch("the JAX context differs from the program's")

    def run(self, leaves: list) -> Any:
        """One call: flat argument leaves (``PerReplica`` ones whole) in, results out."""
        layout: Layout = self.owner.layout
        if self.entry_tree is not None:
            return self._run_entry(leaves)
        if self.donated:
            from runtime.validate import check_donated_distinct
            check_donated_distinct(leaves, self.donated)
        flat = []
        for x, lay in zip(leaves, self.in_layout):
            if lay is None:
                flat.append(x)
            else:
                flat.extend(layout.global_inputs(x, lay))
        try:
            outs = self.call(*flat)
        except ValueError as e:
            # An argument placed other than the program wants it (a per-replica input split
            # over the model axes, a mirrored array committed elsewhere): move it there.
            if "disagree with the" not in str(e) and layout.process_count == 1:
                raise
            shardings = list(self.jax_compiled.input_shardings[0])
            if layout.process_count > 1:
                flat = [to_global(x, s) for x, s in zip(flat, shardings)]
                outs = self.call(*flat)
            else:
                outs = self.call(*jax.device_put(flat, shardings))
        if self.donated:
            delete_donated(leaves, self.donated)
        if not self.out_varying_any:
            return self.out_treedef.unflatten(outs)
        return self.outputs(outs)

    def _run_entry(self, leaves: list) -> Any:
        args = self.entry_tree.unflatten(leaves)
        try:
            return self.call(*args)
        except ValueError as e:
            if "disagree with the" not in str(e):
                raise
            shardings = jax.tree.leaves(self.jax_compiled.input_shardings[0])
            return self.call(*self.entry_tree.unflatten(jax.device_put(leaves, shardings)))

    def outputs(self, outs: list) -> Any:
        """Flat global outputs as the step's results: varying ones split per replica."""
        split = self.owner.layout.split
        res = [split(o, r) if v else o for o, v, r in zip(outs, self.out_varying, self.out_ranks)]
        return self.out_treedef.unflatten(res)


# -- building a program -----------------------------------------------------------------
class TracedStep:
    """A step traced for one cache key and imported into the IR (:func:`trace_step`),
    before the passes: what :func:`build` continues from. ``graph`` is the imported IR
    (the persistent cache fingerprints it: ``runtime.persistent.program_fingerprint``)."""

    __slots__ = ("graph", "specs", "in_layout", "out_treedef", "donated", "seconds", "split",
                 "local_views")

    def __init__(self, graph, specs, in_layout, out_treedef, donated, seconds, split,
                 local_views) -> None:
        self.graph, self.specs, self.in_layout = graph, specs, in_layout
        self.out_treedef, self.donated, self.seconds = out_treedef, donated, seconds
        self.split, self.local_views = split, local_views


def build(rep: Any, leaves: list, treedef: Any, key: tuple, keep: bool = True,
          traced: TracedStep | None = None) -> Program:
    """Trace ``rep.fn`` for the signature ``key`` (or take ``traced``, its trace for that
    key), run the passes, lower: a :class:`Program` not yet compiled. ``keep``: every
    pass's IR can be read (``Lowered.ir``): the imported and the last are kept, the others
    made again when first asked for (``Program.records``)."""
    with gc_paused():
        if traced is None:
            traced = _trace_step(rep, leaves, treedef, key)
        return _build(rep, treedef, key, keep, traced)


def trace_step(rep: Any, leaves: list, treedef: Any, key: tuple) -> TracedStep:
    """Trace ``rep.fn`` for the signature ``key`` and import it (the first stage of
    :func:`build`, which continues from the result)."""
    with gc_paused():
        return _trace_step(rep, leaves, treedef, key)


def _trace_step(rep: Any, leaves: list, treedef: Any, key: tuple) -> TracedStep:
    n = rep.num_replicas
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
    k_steps = rep.steps_per_call
    fn = rep._callable(key[2]) if len(key) > 2 else rep.fn
    # the state (argument 0) is carried across steps and, with donate=True, donated
    n_state = treedef.children()[0].num_leaves if treedef.children() else 0
    if k_steps > 1:
        if not treedef.children():
            raise TypeError(f"replicate(steps_per_call={k_steps}): the step takes no "
                            f"arguments; it must be fn(state, *inputs) -> (state, outputs)")
        check_stacked(key[1][n_state:], k_steps)
    donated, pos = [], 0
    for i, lay in enumerate(in_layout):
        if rep.donate and i < n_state and lay is None:
            donated.append((i, pos))
        pos += 1 if lay is None else len(lay[1])

    def build_args(slots):
        return jax.tree.unflatten(treedef, [s if lay is None else jax.tree.unflatten(lay[0], s)
                                            for s, lay in zip(slots, in_layout)])

    def flat_fn(*flat):
        it = iter(flat)
        slots = [next(it) if lay is None else [next(it) for _ in lay[1]] for lay in in_layout]
        if k_steps == 1:
            out = call_step(fn, build_args(slots), getattr(rep, "__name__", "step"))
        else:
            mask = [False if lay is None else [True] * len(lay[1]) for lay in in_layout]
            out = scan_steps(fn, build_args(slots), build_args(mask), k_steps,
                             rep.step_outputs)
        from runtime.validate import check_results, keep_container_types
        out = keep_container_types(out)
        check_results(out, getattr(rep, "__name__", "step"))
        out_leaves, out_td = jax.tree.flatten(out)
        out_info["treedef"] = out_td
        return out_leaves

    split: dict[str, float] = {}
    with watching_local_views() as local_views:
        graph, t_import = trace_replica_fn(flat_fn, specs, n, getattr(rep, "__name__", "step"),
                                           logical_devices=rep.logical_devices, split=split,
                                           axis_name=rep.axis_name)
    return TracedStep(graph, specs, in_layout, out_info["treedef"], donated, t_import, split,
                      bool(local_views))


def call_step(fn: Callable, args: tuple, fn_name: str) -> Any:
    """``fn(*args)`` while a step is traced, for both call paths (this one and
    ``runtime.dynamic``): an argument changed in place and not returned, or an
    accumulator returned with its update dropped, is a ``TypeError``
    (``validate.call_checking_arguments``, ``sync_on_read.check_returned_views``, on the
    results as the step made them: a pytree rebuild makes fresh views, without the mark)."""
    from runtime.sync_on_read import check_returned_views
    from runtime.validate import call_checking_arguments
    out = call_checking_arguments(fn, args, fn_name)
    check_returned_views(out, fn_name)
    return out


def _build(rep: Any, treedef: Any, key: tuple, keep: bool, traced: TracedStep) -> Program:
    n = rep.num_replicas
    graph, specs, in_layout = traced.graph, traced.specs, traced.in_layout
    donated, t_import, split = traced.donated, traced.seconds, traced.split
    out_info = {"treedef": traced.out_treedef}
    passes = parse_pipeline(rep.options.pipeline, num_replicas=n,
                            loss_reduction=rep.loss_reduction,
                            num_logical_devices=rep.logical_devices,
                            bucket_bytes=rep.options.bucket_bytes)
    dump = rep._dump_folder(key, "ir")  # "": no dump
    # ``keep`` (or a dump of the program, which writes every stage's IR): the ends, the
    # IR between made again when it is asked for (``Program.records``)
    keep = keep or bool(dump)
    pm = PassManager(passes, verify=rep.options.verify, dump_dir=dump,
                     keep="ends" if keep else False)
    final = pm.run(graph, import_seconds=t_import)
    if not traced.local_views:  # a result in a mirrored argument's place that comes out varying
        check_diverging_state(getattr(rep, "__name__", "step"), treedef,
                              [None if lay is not None else sig
                               for lay, sig in zip(in_layout, key[1])],
                              out_info["treedef"], final)
    out_varying = [v.type.replica is not Replica.MIRRORED for v in final.outputs]
    out_ranks = [v.type.rank for v in final.outputs]
    # all mirrored, one process, nothing donated: the executable takes the caller's own
    # argument structure (its C++ dispatch then flattens and checks them)
    entry = (all(lay is None for lay in in_layout) and not any(out_varying) and not donated
             and rep.layout.process_count == 1 and _reflattens(out_info["treedef"]))
    jitted = build_jitted(final, rep.mesh, [s.varying for s in specs],
                          [len(s.shape) for s in specs], out_varying, out_ranks,
                          donate_argnums=tuple(p for _, p in donated),
                          in_tree=treedef if entry else None,
                          out_tree=out_info["treedef"] if entry else None)
    gavals = []
    for s in specs:
        shape = global_shape(s.shape, n) if s.varying else s.shape
        gavals.append(jax.ShapeDtypeStruct(shape, s.dtype, weak_type=s.weak_type))
    with jc.without_context_mesh():
        t0 = time.perf_counter()
        jax_traced = jitted.trace(*(treedef.unflatten(gavals) if entry else gavals))
        t1 = time.perf_counter()
        jax_lowered = jax_traced.lower()
        t2 = time.perf_counter()
    prog = Program(rep, pm.records, jax_lowered, in_layout, out_info["treedef"],
                   out_varying, out_ranks, entry_tree=treedef if entry else None,
                   passes=passes if keep else None)
    # the IR evaluated once more under jax.jit (the second trace), then JAX's lowering
    prog.lower_times = {"retrace (IR under jax.jit)": t1 - t0, "lower to StableHLO": t2 - t1}
    prog.import_split = split  # "import" = JAX's trace of the step + the jaxpr's import
    prog.key = key
    prog.donated = tuple(i for i, _ in donated)
    return prog


def _reflattens(treedef: Any) -> bool:
    """Does a value of this structure flatten back to it? Not when it holds a container
    rebuilt as a type JAX takes for a leaf (a ``dict`` subclass: runtime.validate)."""
    try:
        return jax.tree.structure(treedef.unflatten([0] * treedef.num_leaves)) == treedef
    except Exception:  # noqa: BLE001
        return False


# -- several steps per call, donation, several processes ----------------------------
STEP_OUTPUTS = ("stack", "last", "mean", "sum")


def check_stacked(sigs: tuple, k: int) -> None:
    """Every per-replica leaf of the inputs after the state must carry the k steps on
    axis 0 (replica r's value for step t is ``leaf[t]``)."""
    for i, sig in enumerate(sigs):
        if sig and sig[0] == "per_replica":
            for j, s in enumerate(sig[2]):
                if not s[0] or s[0][0] != k:
                    raise ValueError(
                        f"replicate(steps_per_call={k}): per-replica input leaf {j} of argument "
                        f"leaf {i} after the state has shape {tuple(s[0])}; each replica's value "
                        f"must stack the {k} steps' batches on axis 0 (shape [{k}, ...]); "
                        f"a per-replica value that is not a batch (a SyncOnRead "
                        f"accumulator, per-replica statistics) belongs in the state, "
                        f"argument 0, which the steps carry")


def scan_steps(fn: Callable, args: tuple, mask: tuple, k: int, step_outputs: str) -> Any:
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
        from runtime.sync_on_read import check_returned_views
        it = iter(xs_t)
        r = [next(it) if m else x for x, m in zip(rest_leaves, is_xs)]
        out = fn(state_td.unflatten(carry), *rest_td.unflatten(r))
        check_returned_views(out, getattr(fn, "__name__", "step"))
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
    if step_outputs in ("mean", "sum"):
        for path, y in jax.tree_util.tree_leaves_with_path(ys):
            if jax.dtypes.issubdtype(y.dtype, jax.dtypes.extended):
                raise TypeError(
                    f"replicate(steps_per_call={k}, step_outputs={step_outputs!r}): output "
                    f"outputs{jax.tree_util.keystr(path)} is {y.dtype} (a PRNG key), which has "
                    f"no {step_outputs}; return it as state, or use step_outputs='stack' or "
                    f"'last'")
    if step_outputs == "last":
        ys = jax.tree.map(lambda y: y[-1], ys)
    elif step_outputs == "mean":
        ys = jax.tree.map(lambda y: jax.numpy.mean(y, axis=0), ys)
    elif step_outputs == "sum":
        ys = jax.tree.map(lambda y: jax.numpy.sum(y, axis=0), ys)
    return state_td.unflatten(carry), ys


def delete_donated(leaves: list, donated: tuple) -> None:
    """Donation gives the state's buffers to the step: delete the caller's arrays even when
    the executable got a copy (an array committed elsewhere, moved first), so that a
    donated input is deleted after every call, not only when XLA reused it."""
    for i in donated:
        x = leaves[i]
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.delete()


def to_global(x: Any, sharding: Any) -> Any:
    """Multi-process: a mirrored argument (the same host value in every process) as a global
    array with the program's sharding, built from this process's shards only."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.device_put(x, sharding)
    a = np.asarray(x)
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])
