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
