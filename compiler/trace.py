"""Trace a per-replica function into the IR.

The function is traced from the point of view of one replica inside
``shard_map(check_vma=True)`` over an abstract ``replica`` axis, so JAX types every value
as varying or not across replicas and ``jax.grad`` places a cross-replica sum on the
gradient of each mirrored input. No devices are needed: the mesh is abstract.

The loss reduction (TF's semantics) is applied where a pullback begins and ends, never by
recognizing ops afterwards. While a replica is traced, every ``jax.vjp`` pullback (so
``grad``, ``value_and_grad``, ``jacrev`` and the libraries built on them) goes through
:func:`_pullback`, which marks with ``loss_scale`` ops:

- each cotangent seed of an output that is identical on every replica (typed invariant):
  TF counts such a value once per replica, i.e. it is differentiated as ``pvary(y)``;
  ``loss_scale {replicas=1}`` multiplies the seed by N;
- each resulting gradient of a mirrored primal: ``loss_scale {reduction=1}`` multiplies it
  by 1/N for ``"mean"`` and 1 for ``"sum"`` (``compiler.passes.cross_replica_sum``
  decides the factor, so the trace does not depend on the option).

Why this is exact: JAX's pullback under ``check_vma`` is the exact derivative of the
global program, where an invariant value is one value and a varying one N values. Seeding
an invariant output with N·c equals seeding ``pvary(y)`` with c on every replica, so the
result is ∇ Σ_r <c, y_r> whatever JAX proved invariant; multiplying the gradients of
mirrored primals by 1/N then gives the mean over replicas. Both are scalings of a linear
map at its input and output: no path through the backward pass is treated differently
from another, whatever ops (``custom_vjp`` backward functions, collectives, loops) it
holds. Gradients of per-replica values (inputs, ``rt.local`` views) are the replica's
own: no reduction. A pullback called while another is being transposed (a
``custom_vjp`` backward function calling ``jax.vjp``) is left as JAX's own, since it is
part of the outer gradient, which is scaled once at its own ends.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
from jax.sharding import AbstractMesh, PartitionSpec as P

from ir import _jax_compat as jc
from ir.graph import Graph
from ir.jaxpr_import import REPLICA_AXIS, check_layout, import_jaxpr, type_of_aval
from ir.types import Replica, Sharding

#: the number of replicas of the step being traced (read by ``runtime.num_replicas()``)
CURRENT_NUM_REPLICAS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "num_replicas", default=None)
#: the sharding annotation primitive (``rt.split_to_logical_devices`` and the others, and
#: a replicating layout the step asks JAX for); imports as ``shard {sharding, annotation}``
SHARD = jc.define_annotation_primitive("shard")
#: ``loss_scale(x) {replicas=a, reduction=b}``: x · N^a · r^b, with r = 1/N for
#: ``loss_reduction="mean"`` and 1 for ``"sum"``; the ``cross-replica-sum`` pass replaces it
LOSS_SCALE = jc.define_scale_primitive("loss_scale")


def _is_float(x: Any) -> bool:
    return jax.numpy.issubdtype(getattr(x, "dtype", None), jax.numpy.inexact)


def _pullback(cts: list, out_axes: list, in_axes: list, run: Callable) -> list:
    """The loss reduction at the two ends of one pullback (see the module docstring).

    When every seed is identical on all replicas (the common case of an all-reduced or
    mirrored-only loss), the factor N of the seeds is moved onto the results (the map is
    linear), so a ``"mean"`` gradient of an identical loss is JAX's own, with no op."""
    axis = CURRENT_AXIS.get()
    live = [i for i, c in enumerate(cts) if c is not None and _is_float(c)]
    identical = [i for i in live if axis not in out_axes[i]]
    fold = len(identical) == len(live)
    seeds: list = [None] * len(cts)
    if identical and not fold:
        for i in identical:
            seeds[i] = LOSS_SCALE.bind(cts[i], replicas=1, reduction=0)
    grads = run(seeds)
    replicas = int(bool(identical) and fold)
    out = []
    for g, axes in zip(grads, in_axes):
        reduction = int(axis not in axes)
        if g is not None and _is_float(g) and (replicas or reduction):
            g = LOSS_SCALE.bind(g, replicas=replicas, reduction=reduction)
        out.append(g)
    return out


#: the number of logical devices per replica (read by the sharding annotations)
CURRENT_LOGICAL_DEVICES: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "logical_devices", default=None)
#: the name the step's code uses for the replica axis while it is traced (``axis_name=``
#: of ``replicate``, e.g. ``'batch'`` for code written for ``jax.pmap``); the IR always
#: calls it ``REPLICA_AXIS``
CURRENT_AXIS: contextvars.ContextVar[str] = contextvars.ContextVar("axis", default=REPLICA_AXIS)


def current_axis() -> str:
    """The replica axis's name in the step being traced (see ``CURRENT_AXIS``)."""
    return CURRENT_AXIS.get()


def _replica_layout(what: str, bind: Callable, args: tuple, params: dict) -> Any:
    """A layout the step's code asks JAX for while a replica is traced
    (``jc.install_layout_hook``): ``jax.lax.with_sharding_constraint`` (what
    ``eqx.filter_shard`` and code written for ``jax.jit`` with shardings call),
    ``jax.sharding.reshard``, ``jax.device_put``. Its mesh names the devices of every
    replica, or others; a replica's program has no use for them. A layout that splits
    is a ``ShardingConstraintError`` naming the user's line (``check_layout``): nothing
    the user asked to split is replicated silently. One that replicates is the
    replicated annotation, over the replica's logical devices (as
    ``rt.replicate_to_logical_devices``); a device, or only ``P.UNCONSTRAINED`` dims,
    leaves the value as it is. A layout never changes a value, so the numbers are
    ``jax.jit``'s either way."""
    axis = CURRENT_AXIS.get()

    def check(x: Any, sharding: Any) -> None:
        aval = jax.typeof(x)
        rep = Replica.VARYING if jc.varies_over(aval, axis) else Replica.MIRRORED
        check_layout(what, sharding, type_of_aval(aval, rep), jc.current_source_info().traceback)

    def annotate(x: Any) -> Any:
        return SHARD.bind(x, sharding=Sharding.replicated(), annotation=what)

    if jc.is_concrete_array(args[0]):
        # JAX placing a constant the step closes over (an array spread over devices) on
        # the replica's mesh: it is a constant of the step, identical on every replica.
        # (Its type, or an annotation, would place it again through this hook: a
        # RecursionError under jax 0.10, a reshard nothing lowers under 0.11.)
        consts = jc.host_constants(args)
        return consts if what == "jax.device_put" else consts[0]
    if what == "jax.device_put":
        outs = []
        for x, dst in zip(args, params.get("devices", (None,) * len(args))):
            check(x, dst)
            outs.append(annotate(x) if jc.is_sharding(dst) else x)
        return outs
    sharding = params.get("sharding", params.get("dst_sharding"))
    check(args[0], sharding)
    return args[0] if params.get("unconstrained_dims") else annotate(args[0])


@dataclass(frozen=True)
class LeafSpec:
    """One flat input of the per-replica function: its per-replica shape and dtype, and
    whether it varies per replica."""

    shape: tuple[int, ...]
    dtype: Any
    weak_type: bool
    varying: bool


@contextlib.contextmanager
def replica_context(num_replicas: int, logical_devices: int = 1, axis_name: str = REPLICA_AXIS):
    """While tracing a step: the replica count, logical devices per replica and the
    replica axis's name."""
    token = CURRENT_NUM_REPLICAS.set(num_replicas)
    token_k = CURRENT_LOGICAL_DEVICES.set(logical_devices)
    token_a = CURRENT_AXIS.set(axis_name)
    try:
        yield
    finally:
        CURRENT_AXIS.reset(token_a)
        CURRENT_LOGICAL_DEVICES.reset(token_k)
        CURRENT_NUM_REPLICAS.reset(token)


def trace_replica_fn(flat_fn: Callable[..., Sequence[Any]], specs: Sequence[LeafSpec],
                     num_replicas: int, name: str = "step",
                     logical_devices: int = 1,
                     split: dict[str, float] | None = None,
                     axis_name: str = REPLICA_AXIS) -> tuple[Graph, float]:
    """Trace ``flat_fn`` (flat leaves in, flat leaves out) for one replica of
    ``num_replicas``; return the imported graph and the seconds it took. ``split``, when
    given, receives the seconds of JAX's trace (``"trace"``) and of the jaxpr's import into
    the IR (``"import"``). ``axis_name``: what the step's code calls the replica axis
    (``lax.pmean(g, 'batch')``); the IR names it ``REPLICA_AXIS``. A collective over
    another, unknown name is a ``NameError`` naming it and the user's line."""
    t0 = time.perf_counter()
    mesh = AbstractMesh((num_replicas,), (axis_name,))
    captured: dict[str, Any] = {}

    def outer():
        avals = [jc.replica_sds(s.shape, s.dtype, {axis_name} if s.varying else set(), s.weak_type)
                 for s in specs]
        captured["jaxpr"] = jax.make_jaxpr(flat_fn)(*avals)
        return ()

    jc.install_vjp_hook(_pullback)
    jc.install_custom_vjp_sum()
    jc.install_vmap_axis_collectives()
    jc.install_layout_hook()
    jc.install_varying_sources()

    def trace():
        layouts = jc.LAYOUT_HOOK.set(_replica_layout)
        try:
            with replica_context(num_replicas, logical_devices, axis_name), \
                    jc.varying_loop_carries(), jc.grad_mode("replica"), \
                    jc.without_context_mesh():  # (inside, shard_map's mesh is the context)
                jax.make_jaxpr(jax.shard_map(outer, mesh=mesh, in_specs=(), out_specs=(),
                                             check_vma=True))()
        finally:
            jc.LAYOUT_HOOK.reset(layouts)
    try:
        trace()
    except (NameError, AssertionError, KeyError) as e:
        # JAX reports an axis name it does not know as a bare AssertionError, its frames
        # filtered away: trace again with JAX's frames kept to find the name it looked up
        where = jc.user_location_of_exception(e)
        unknown = jc.unbound_axis_name(e)
        if unknown is None:
            try:
                with jc.traceback_filtering("off"):
                    trace()
            except (NameError, AssertionError, KeyError) as again:
                unknown = jc.unbound_axis_name(again)
        if unknown is None or unknown == axis_name:
            raise
        at = f" ({os.path.basename(where[0])}:{where[1]})" if where else ""
        raise NameError(f"a collective over the axis {unknown!r}{at}: this step's replica axis "
                        f"is named {axis_name!r}; name it so in the code, or replicate the "
                        f"step with axis_name={unknown!r}") from None
    reps = [Replica.VARYING if s.varying else Replica.MIRRORED for s in specs]
    t1 = time.perf_counter()
    graph = import_jaxpr(captured["jaxpr"], name, reps, axis_name=axis_name)
    t2 = time.perf_counter()
    if split is not None:
        split.update(trace=t1 - t0, **{"import": t2 - t1})
    return graph, t2 - t0


def global_shape(shape: tuple, num_replicas: int) -> tuple:
    """The global shape of a varying value whose per-replica shape is ``shape``: the
    replicas' values concatenated along axis 0, scalars stacked into an ``(N,)`` vector
    (the layout :func:`global_spec` names)."""
    return (num_replicas * shape[0],) + tuple(shape[1:]) if shape else (num_replicas,)


def global_spec(varying: bool, rank: int) -> P:
    """How a flat input or output is laid out across replicas: varying values are
    concatenated along axis 0 (scalars are stacked), mirrored ones are replicated."""
    return P(REPLICA_AXIS) if varying else P()
