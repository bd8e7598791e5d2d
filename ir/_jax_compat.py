"""Every use of JAX internals lives here, so a JAX upgrade touches one file.

Tested against the JAX that ``pip install jax`` gives on this machine (0.10.x)."""
from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Any

import jax
import numpy as np
from jax._src import core as _core
from jax._src import source_info_util as _siu

Literal = _core.Literal
ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
Primitive = _core.Primitive
ShapedArray = _core.ShapedArray
DropVar = _core.DropVar

# Frames inside this project's own packages are not the user's source line.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _pkg in ("ir", "compiler", "runtime"):
    _siu.register_exclusion(os.path.join(_ROOT, _pkg) + os.sep)


def user_location(eqn: Any) -> tuple[str, int] | None:
    """(file, line) of the user's frame that created ``eqn``, if any."""
    frame = _siu.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    return frame.file_name, frame.start_line


def user_location_of_exception(exc: BaseException) -> tuple[str, int] | None:
    """(file, line) of the innermost user frame (not JAX's, not this project's) in the
    traceback of ``exc``: where the user's code was when it raised during a trace."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if _siu.is_user_filename(f.filename)]
    return (frames[-1].filename, frames[-1].lineno) if frames else None


def name_stack(eqn: Any) -> str:
    return str(eqn.source_info.name_stack)


def literal_value(atom: Any) -> np.ndarray:
    """A jaxpr literal as a plain numpy value (JAX's typed literals carry the trace's mesh)."""
    return np.asarray(atom.val)


def varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes a value varies over (``aval.manual_axis_type.varying``)."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def is_sharding(v: Any) -> bool:
    return isinstance(v, jax.sharding.Sharding)


def replica_sds(shape: tuple, dtype: Any, varying_axes_: frozenset, weak_type: bool = False):
    """A ``ShapeDtypeStruct`` typed for tracing inside ``shard_map(check_vma=True)``:
    it carries the context's abstract mesh and which manual axes it varies over."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.ShapeDtypeStruct(
        shape, dtype, weak_type=weak_type,
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        manual_axis_type=jax.sharding.ManualAxisType(varying=frozenset(varying_axes_)))


def dtype_from_name(name: str) -> Any:
    """The dtype object for a dtype name as the IR stores it (``float32``, ``key<fry>``)."""
    if name.startswith("key<") and name.endswith(">"):
        return _key_dtype(name[4:-1])
    import ml_dtypes  # noqa: F401  (registers bfloat16 & friends with numpy)
    try:
        return np.dtype(name)
    except TypeError:
        return jax.dtypes.canonicalize_dtype(getattr(ml_dtypes, name))


def _prng_module():
    try:  # jax >= 0.10 moved the module under jax._src.random
        from jax._src.random import prng
    except ImportError:  # pragma: no cover - older JAX
        from jax._src import prng
    return prng


def _key_dtype(tag: str) -> Any:
    """The key dtype printed ``key<tag>``: the registry is keyed by impl name
    (``threefry2x32``) while the dtype prints the impl's tag (``fry``)."""
    prng = _prng_module()
    for impl in prng.prngs.values():
        if impl.tag == tag or impl.name == tag:
            return prng.KeyTy(impl)
    raise TypeError(f"unknown PRNG key implementation {tag!r}; known tags: "
                    f"{sorted(i.tag for i in prng.prngs.values())}")


def is_key_array(x: Any) -> bool:
    """A typed PRNG key array (``jax.random.key``), whose dtype is not a numpy dtype."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def key_array_parts(x: Any) -> tuple[np.ndarray, Any, Primitive]:
    """(raw key data, impl, ``random_wrap`` primitive) so a key constant can be rebuilt
    as ``random_wrap(constant(data), impl=impl)``."""
    prng = _prng_module()
    return np.asarray(jax.random.key_data(x)), x.dtype._impl, prng.random_wrap_p


_PRIMITIVES: dict[str, Primitive] | None = None


def primitive_by_name(name: str) -> Primitive | None:
    """Find a JAX primitive by name (for graphs parsed from text)."""
    global _PRIMITIVES
    if _PRIMITIVES is None:
        import gc
        _PRIMITIVES = {}
        for obj in gc.get_objects():
            if isinstance(obj, Primitive):
                _PRIMITIVES.setdefault(obj.name, obj)
    return _PRIMITIVES.get(name)


def make_jaxpr_from(fn, avals: list[Any]) -> ClosedJaxpr:
    return jax.make_jaxpr(fn)(*avals)


def fast_callable(compiled: Any) -> Any:
    """The C++ dispatch function behind a ``jax.stages.Compiled`` (skips one Python frame
    per call); falls back to ``compiled.__call__``."""
    if getattr(compiled, "_call", None) is None and hasattr(compiled, "_executable"):
        try:
            compiled._call = compiled._executable.create_cpp_call(compiled._params)
        except Exception:  # noqa: BLE001 - any failure: use the public path
            return compiled.__call__
    return getattr(compiled, "_call", None) or compiled.__call__


def define_annotation_primitive(name: str) -> Primitive:
    """An identity primitive carrying static params (a sharding annotation).

    Its JVP annotates the tangent and its transpose the cotangent the same way, so a
    gradient is laid out like the value; it lowers to its operand (the compiler replaces
    it with ``with_sharding_constraint``); vmap keeps the annotation off the batch dim by
    dropping it (annotations are per-replica layouts, not batched ones)."""
    from jax._src.interpreters import ad, batching, mlir

    p = Primitive(name)
    p.def_impl(lambda x, **params: x)
    p.def_abstract_eval(lambda aval, **params: aval)

    def jvp(primals, tangents, **params):
        (x,), (t,) = primals, tangents
        t_out = t if type(t) is ad.Zero else p.bind(t, **params)
        return p.bind(x, **params), t_out

    def transpose(ct, x, **params):
        return [ct if type(ct) is ad.Zero else p.bind(ct, **params)]

    ad.primitive_jvps[p] = jvp
    ad.primitive_transposes[p] = transpose
    batching.primitive_batchers[p] = lambda args, dims, **params: (args[0], dims[0])
    mlir.register_lowering(p, lambda ctx, x, **params: [x])
    return p


# -- loop carries that become varying ------------------------------------------------
# Under shard_map(check_vma=True), a lax.scan / while_loop / fori_loop whose carry starts
# mirrored (``jnp.zeros(h)``) and becomes per-replica inside the body is a type error, and
# JAX asks the user to ``pcast`` the initial carry to varying by hand. JAX's loops already
# trace the body twice when a carry's type must be promoted (weak types); while we trace a
# replica (and only then) that promotion also casts a mirrored initial carry to varying,
# exactly the cast JAX's message asks for. Values are unchanged.
_VARYING_CARRIES = contextvars.ContextVar("promote_varying_carries", default=False)


def _install_carry_promotion() -> None:
    from jax._src.lax.control_flow import loops

    orig = loops._promote_weak_typed_input
    if getattr(orig, "_replicate_hlo", False):
        return

    def promote(in_val, in_aval, out_aval):
        val, changed = orig(in_val, in_aval, out_aval)
        if _VARYING_CARRIES.get():
            extra = varying_axes(out_aval) - varying_axes(in_aval)
            if extra:
                val = jax.lax.pcast(val, tuple(sorted(extra)), to="varying")
                changed = True
        return val, changed

    promote._replicate_hlo = True
    loops._promote_weak_typed_input = promote


@contextlib.contextmanager
def varying_loop_carries():
    """While active, loop carries that start mirrored but become varying are cast."""
    _install_carry_promotion()
    token = _VARYING_CARRIES.set(True)
    try:
        yield
    finally:
        _VARYING_CARRIES.reset(token)


# -- symbolic dimensions (jax.export) ---------------------------------------------------
def is_symbolic_dim(x: Any) -> bool:
    """A ``jax.export`` symbolic dimension expression (``b``, ``4*b``), not an int."""
    return not isinstance(x, (int, np.integer, bool)) and jax.export.is_symbolic_dim(x)


def evaluate_dim(expr: Any, env: dict[str, Any]) -> Any:
    """Value of a symbolic dimension expression with its variables bound by ``env``
    (ints, or traced int32 scalars)."""
    return expr._evaluate(env)


def dim_vars(expr: Any) -> tuple[str, ...]:
    """Names of the variables in a symbolic dimension expression, sorted."""
    return tuple(sorted(str(s) for s in expr._get_vars()))


# -- reverse-mode differentiation inside a replica ------------------------------------
# ``jax.vjp`` (and so ``grad``, ``value_and_grad``, ``jacrev``, flax/optax/equinox's
# wrappers of them) returns a pullback that ends in ``jax._src.api._vjp3_bwd``: one
# place where the cotangent seeds go in and the gradients of the primals come out. While
# a replica is traced, the compiler wraps it (``install_vjp_hook``) to apply the loss
# reduction at exactly those two ends (see ``compiler.trace``). The hook's mode is a JAX
# config state included in JAX's trace context, so a ``jax.jit`` traced inside a replica
# is never served from JAX's cache to a trace outside one, or the other way round.
_GRAD_MODE = None
_VJP_POLICY = None


def _grad_mode_state():
    global _GRAD_MODE
    if _GRAD_MODE is None:
        from jax._src import config as _config
        _GRAD_MODE = _config.enum_state(
            "replicate_hlo_grad_mode", ["off", "replica", "backward"], "off",
            help="replicate-hlo: 'replica' while a replica's step is traced (pullbacks "
                 "apply the loss reduction), 'backward' inside such a pullback.",
            include_in_trace_context=True)
    return _GRAD_MODE


def grad_mode(mode: str):
    """Context manager: set the reverse-mode hook's mode (``off``/``replica``/``backward``)."""
    return _grad_mode_state()(mode)


def install_vjp_hook(policy: Any) -> None:
    """Route every pullback's seeds and results through ``policy`` while the mode is
    ``replica``: ``policy(cts, out_varying, in_varying, run)`` gets the flat cotangent
    seeds (``None`` for a symbolic zero), the manual axes each output and each primal
    varies over, and ``run(cts) -> flat primal cotangents`` (``None`` where no array comes
    back); it returns the primal cotangents. Inside ``run`` the mode is ``backward``, so a
    pullback called while the backward pass is built (a ``custom_vjp`` backward function
    that calls ``jax.vjp``) is JAX's own."""
    global _VJP_POLICY
    _VJP_POLICY = policy
    from jax._src import api
    from jax._src.interpreters import ad
    orig = api._vjp3_bwd
    if getattr(orig, "_replicate_hlo", False):
        return
    state = _grad_mode_state()

    def hooked(in_tree, out_tree, out_known, jaxpr, out_primal_avals, residuals,
               maybe_accums, out_ct):
        if state.value != "replica" or _VJP_POLICY is None:
            return orig(in_tree, out_tree, out_known, jaxpr, out_primal_avals, residuals,
                        maybe_accums, out_ct)
        is_zero = lambda x: isinstance(x, ad.Zero)
        cts, ct_tree = jax.tree_util.tree_flatten(out_ct, is_leaf=is_zero)
        if len(cts) != len(out_primal_avals):  # a malformed seed: JAX's own error
            return orig(in_tree, out_tree, out_known, jaxpr, out_primal_avals, residuals,
                        maybe_accums, out_ct)
        out_varying = [varying_axes(a) for a in out_primal_avals]
        in_varying = [varying_axes(v.aval) for v in jaxpr.invars]
        placeholders = (api.DidntWant, api.GradRef)

        def run(new_cts):
            seeds = [c if n is None else n for c, n in zip(cts, new_cts)]
            with state("backward"):
                res = orig(in_tree, out_tree, out_known, jaxpr, out_primal_avals, residuals,
                           maybe_accums, jax.tree_util.tree_unflatten(ct_tree, seeds))
            leaves, tree = jax.tree_util.tree_flatten(
                res, is_leaf=lambda x: isinstance(x, placeholders))
            run.tree = tree
            return [None if isinstance(x, placeholders) else x for x in leaves]

        out = _VJP_POLICY([None if is_zero(c) else c for c in cts], out_varying,
                          in_varying, run)
        return jax.tree_util.tree_unflatten(run.tree, out)

    hooked._replicate_hlo = True
    api._vjp3_bwd = hooked


def define_scale_primitive(name: str) -> Primitive:
    """A primitive standing for ``x * factor`` with the factor decided later (by a pass):
    linear and self-adjoint, so its JVP and its transpose are itself with the same
    parameters; elementwise under vmap; typed like its operand."""
    from jax._src.interpreters import ad, batching, mlir

    p = Primitive(name)
    p.def_impl(lambda x, **params: x)
    p.def_abstract_eval(lambda aval, **params: aval)

    def jvp(primals, tangents, **params):
        (x,), (t,) = primals, tangents
        return p.bind(x, **params), (t if type(t) is ad.Zero else p.bind(t, **params))

    def transpose(ct, x, **params):
        return [ct if type(ct) is ad.Zero else p.bind(ct, **params)]

    def lowering(ctx, x, **params):
        raise NotImplementedError(
            f"{name} reached XLA: the pass that decides its factor did not run")

    ad.primitive_jvps[p] = jvp
    ad.primitive_transposes[p] = transpose
    batching.primitive_batchers[p] = lambda args, dims, **params: (p.bind(args[0], **params), dims[0])
    mlir.register_lowering(p, lowering)
    return p
