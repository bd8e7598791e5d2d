"""Checks of what users pass to the public API, made before anything is traced or compiled.

Every check raises the exception a Python user expects (``TypeError`` for a value of the
wrong type, ``ValueError`` for a value of the right type out of range) with one sentence
naming the function, the parameter, the value and what would be accepted. The call-time
checks (arguments and results of a step) name the argument path, e.g. ``args[1]['x']``.
"""
from __future__ import annotations

import numbers
import os
from typing import Any, Callable

import jax
import numpy as np

from runtime.per_replica import PerReplica

#: leaf types a step may take (besides arrays and ShapeDtypeStructs)
_SCALARS = (bool, int, float, complex, np.generic)


def user_line(skip_file: str) -> str:
    """``file.py:line`` of the first frame outside ``skip_file`` (the user's call)."""
    import sys
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename in (skip_file, __file__):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f else "<unknown>"


def is_int(v: Any) -> bool:
    """A true integer (``True`` is not one here)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def positive_int(fn: str, name: str, v: Any, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not is_int(v):
        raise TypeError(f"{fn}: {name} must be a positive int, got {v!r} "
                        f"({type(v).__name__})")
    if v < 1:
        raise ValueError(f"{fn}: {name} must be a positive int, got {v!r}")


def flag(fn: str, name: str, v: Any) -> None:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{fn}: {name} must be True or False, got {v!r} ({type(v).__name__})")


def choice(fn: str, name: str, v: Any, allowed: tuple) -> None:
    if v not in allowed:
        raise ValueError(f"{fn}: {name} must be one of {', '.join(map(repr, allowed))}, "
                         f"got {v!r}")


def path_or_none(fn: str, name: str, v: Any) -> None:
    if v is not None and not isinstance(v, (str, os.PathLike)):
        raise TypeError(f"{fn}: {name} must be a directory path (str) or None, got {v!r} "
                        f"({type(v).__name__})")


# -- replicate(...) and RunOptions(...) ---------------------------------------------------
def replicate_args(fn: Any, num_replicas: Any, logical_devices: Any, devices: Any,
                   loss_reduction: Any, options: Any, steps_per_call: Any, donate: Any,
                   step_outputs: Any, run_options_type: type) -> None:
    """The arguments of ``replicate`` (those that need no device count)."""
    where = "replicate"
    if not callable(fn):
        raise TypeError(f"{where}: the step must be callable (a function, partial, bound "
                        f"method or callable object), got {fn!r} ({type(fn).__name__})")
    positive_int(where, "num_replicas", num_replicas, allow_none=True)
    positive_int(where, "logical_devices", logical_devices)
    positive_int(where, "steps_per_call", steps_per_call)
    flag(where, "donate", donate)
    choice(where, "loss_reduction", loss_reduction, ("mean", "sum"))
    if options is not None and not isinstance(options, run_options_type):
        hint = (f"; write rt.RunOptions(**{options!r})" if isinstance(options, dict) else "")
        raise TypeError(f"{where}: options must be an rt.RunOptions, got "
                        f"{type(options).__name__}{hint}")
    if devices is not None:
        flat = list(np.asarray(devices, dtype=object).ravel())
        bad = [d for d in flat if not isinstance(d, jax.Device)]
        if bad:
            raise TypeError(f"{where}: devices must be jax.Device objects (e.g. jax.devices()[:8]), "
                            f"got {bad[0]!r} ({type(bad[0]).__name__})")


def axis_name(v: Any) -> str:
    """``replicate(axis_name=...)``: a name (default: the IR's own, ``'replica'``)."""
    from ir.jaxpr_import import REPLICA_AXIS
    if v is None:
        return REPLICA_AXIS
    if not isinstance(v, str) or not v:
        raise TypeError(f"replicate: axis_name must be a non-empty string such as 'batch', got "
                        f"{v!r} ({type(v).__name__})")
    return v


def static_args(argnums: Any, argnames: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``static_argnums`` (ints >= 0) and ``static_argnames`` (strings), one or many."""
    nums = (argnums,) if is_int(argnums) else tuple(argnums if argnums is not None else ())
    names = (argnames,) if isinstance(argnames, str) else tuple(argnames if argnames is not None else ())
    for i in nums:
        if not is_int(i) or i < 0:
            raise TypeError(f"replicate: static_argnums must be non-negative ints, got {argnums!r}")
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"replicate: static_argnames must be strings, got {argnames!r}")
    return tuple(sorted(set(int(i) for i in nums))), tuple(dict.fromkeys(names))


def hashable_static(v: Any, what: str) -> Any:
    """A static argument's value, which keys the cache: it must be hashable."""
    try:
        hash(v)
    except TypeError:
        raise TypeError(f"static {what} must be hashable (it is part of the cache key), got "
                        f"{describe(v)}; pass a tuple instead of a list, or make it a "
                        f"dynamic argument") from None
    return v


def _env_verify() -> str:
    import os
    return os.environ.get("RT_VERIFY", "").strip().lower()


def run_options(o: Any) -> None:
    """The fields of ``RunOptions`` (the dynamic-shape ones in ``runtime.dynamic``)."""
    where = "RunOptions"
    flag(where, "dynamic_shapes", o.dynamic_shapes)
    if not (isinstance(o.verify, (bool, np.bool_)) or o.verify in ("each", "end")):
        raise TypeError(f"{where}: verify must be True, False, 'each' or 'end', got "
                        f"{o.verify!r} ({type(o.verify).__name__})"
                        + (" (from $RT_VERIFY)" if o.verify == _env_verify() else ""))
    path_or_none(where, "dump_dir", o.dump_dir)
    path_or_none(where, "cache_dir", o.cache_dir)
    if not is_int(o.bucket_bytes):
        raise TypeError(f"{where}: bucket_bytes must be an int (0: off), got {o.bucket_bytes!r} "
                        f"({type(o.bucket_bytes).__name__})")
    if o.bucket_bytes < 0:
        raise ValueError(f"{where}: bucket_bytes must be >= 0 (0: off), got {o.bucket_bytes}")
    positive_int(where, "max_compiles_warning", o.max_compiles_warning, allow_none=True)
    if not isinstance(o.pipeline, str):
        raise TypeError(f"{where}: pipeline must be a string such as "
                        f"'replication,cross-replica-sum,dce', got {o.pipeline!r}")
    from compiler.pass_manager import parse_pipeline
    from compiler.errors import PassError
    try:
        parse_pipeline(o.pipeline)
    except PassError as e:
        raise ValueError(f"{where}: pipeline={o.pipeline!r}: {e}") from None
    if not o.dynamic_shapes:
        for name in ("maximum_shapes", "dynamic_dims"):
            if getattr(o, name) is not None:
                raise ValueError(f"{where}: {name} is set but dynamic_shapes is False; set "
                                 f"dynamic_shapes=True to use it")
        if o.bucketing != "pow2":
            raise ValueError(f"{where}: bucketing={o.bucketing!r} is set but dynamic_shapes is "
                             f"False; set dynamic_shapes=True to use it")


# -- a step's arguments and results -------------------------------------------------------
def is_leaf_value(x: Any) -> bool:
    """Can ``x`` be one leaf of a step's arguments?"""
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, _SCALARS)) or \
        hasattr(x, "__jax_array__")


def describe(x: Any) -> str:
    """``the string 'abc'``, ``a list ([1, 2])``, ``an instance of mod.Class``."""
    if isinstance(x, str):
        return f"the string {x[:40]!r}"
    t = type(x)
    if t.__module__ == "builtins":
        article = "an" if t.__name__[0] in "aeiou" else "a"
        return f"{article} {t.__name__} ({repr(x)[:60]})"
    return f"an instance of {t.__module__}.{t.__qualname__}"


def check_arguments(args: tuple, is_per_replica_leaf: Callable[[Any], bool] = None) -> None:
    """Raise ``TypeError`` naming the first argument leaf that is not an array or number
    (``args[1]['x']``), or a ``PerReplica`` that holds another ``PerReplica``. Called only
    when a cheaper check already failed, so the paths cost nothing on good calls."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        where = "args" + jax.tree_util.keystr(path)
        if isinstance(leaf, PerReplica):
            for r, v in enumerate(leaf.values):
                for p2, x in jax.tree_util.tree_flatten_with_path(v)[0]:
                    inner = f"{where}, replica {r}'s value{jax.tree_util.keystr(p2)}"
                    if isinstance(x, PerReplica):
                        raise TypeError(f"step argument {inner} is a PerReplica inside a "
                                        f"PerReplica; a PerReplica holds one plain value "
                                        f"(a pytree of arrays) per replica")
                    if not is_leaf_value(x):
                        raise TypeError(f"step argument {inner} is {describe(x)}; step "
                                        f"arguments must be arrays or numbers (pytrees of them)")
        elif not is_leaf_value(leaf):
            raise TypeError(f"step argument {where} is {describe(leaf)}; step arguments must "
                            f"be arrays or numbers (pytrees of them), or rt.PerReplica of "
                            f"those{_function_hint(leaf)}")


def _function_hint(leaf: Any) -> str:
    """For a function among a step's argument leaves (an equinox Module's activation,
    which ``eqx.filter_jit`` treats as static), or a string or other hashable setting (a
    mode flag): how to pass it."""
    import enum
    if isinstance(leaf, (str, bytes, enum.Enum)):
        return ("; a setting that selects code (a mode, a name) is static: pass it with "
                "replicate(..., static_argnums=...) or static_argnames=... (each value "
                "compiles its own program)")
    if not callable(leaf):
        return ""
    return ("; a function is not data: split the arrays off and close over the rest "
            "(params, static = eqx.partition(model, eqx.is_array), then "
            "eqx.combine(params, static) in the step), or make the whole argument static "
            "(replicate(..., static_argnums=...))")


class _DictSubclass:
    """Stand-in, in a step's results, for an instance of a ``dict`` subclass that is not
    a registered pytree (JAX would take it for one leaf): flattened as a dict, rebuilt as
    an instance of its own class."""

    def __init__(self, cls: type, items: dict):
        self.cls, self.items = cls, items


def _flatten_sub(d: _DictSubclass):
    keys = tuple(d.items)
    return [d.items[k] for k in keys], (d.cls, keys)


def _unflatten_sub(aux: tuple, children: list) -> Any:
    cls, keys = aux
    try:
        return cls(zip(keys, children))
    except TypeError:  # a subclass whose constructor differs: fill an empty instance
        out = cls.__new__(cls)
        dict.update(out, zip(keys, children))
        return out


jax.tree_util.register_pytree_node(_DictSubclass, _flatten_sub, _unflatten_sub)


def keep_container_types(out: Any) -> Any:
    """``out`` with every ``dict`` subclass JAX does not know as a pytree made one that
    comes back as its own class (``jax.jit`` would refuse it as a leaf)."""
    def fix(x):
        if isinstance(x, dict) and type(x) is not dict:
            return _DictSubclass(type(x), {k: keep_container_types(v) for k, v in x.items()})
        return x
    return jax.tree.map(fix, out, is_leaf=lambda x: isinstance(x, dict) and type(x) is not dict
                        and jax.tree_util.treedef_is_leaf(jax.tree.structure(x)))


def check_results(out: Any, fn_name: str) -> None:
    """Raise ``TypeError`` naming the first result leaf of a step that is not an array or
    number (called while the step is traced)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if isinstance(leaf, jax.core.Tracer) or is_leaf_value(leaf):
            continue
        at = f"at result{jax.tree_util.keystr(path)}" if path else "as its result"
        raise TypeError(f"the step {fn_name} returned {describe(leaf)} {at}; a step must "
                        f"return arrays or numbers (pytrees of them)")


def call_checking_arguments(fn: Any, args: tuple, fn_name: str) -> Any:
    """``fn(*args)`` while a step is traced, then :func:`check_arguments_unchanged`."""
    snapshot = argument_snapshot(args)
    out = fn(*args)
    check_arguments_unchanged(args, snapshot, out, fn_name)
    return out


def argument_snapshot(args: tuple) -> tuple | None:
    """The arguments' leaves and structure as the step is about to see them, for
    :func:`check_arguments_unchanged`; ``None`` when flattening them twice does not give
    the same objects (a pytree that makes its leaves anew: nothing can be compared)."""
    first, second = jax.tree_util.tree_flatten(args), jax.tree_util.tree_flatten(args)
    if first[1] != second[1] or any(a is not b for a, b in zip(first[0], second[0])):
        return None
    return first


def check_arguments_unchanged(args: tuple, snapshot: tuple | None, out: Any,
                              fn_name: str) -> None:
    """Raise ``TypeError`` when the step changed an argument in place to a value it does
    not return (called while the step is traced, after it ran). The step gets copies of
    its arguments, as under ``jax.jit``, so such a change is lost and the next call
    starts from the old value without an error: ``nnx.jit``'s in-place updates of a model
    and optimizer given to ``replicate`` trained nothing. A change the step also returns
    (``state["step"] += 1; return state``) has its value: allowed; so is a leaf that
    ``nnx.jit`` wrote back unchanged (``jc.forwards``)."""
    if snapshot is None:
        return
    before, before_td = snapshot
    try:
        leaves, td = jax.tree_util.tree_flatten(args)
    except Exception:  # noqa: BLE001 - an argument that refuses to be read once used
        return  # (equinox's nn.State after state.set: "Attempted to use old state")
    returned = {id(x) for x in jax.tree_util.tree_leaves(out)}
    if td == before_td:
        from ir import _jax_compat as jc
        changed = [i for i, (x, y) in enumerate(zip(leaves, before))
                   if x is not y and id(x) not in returned and not jc.forwards(x, y)]
        if not changed:
            return
        path = jax.tree_util.tree_flatten_with_path(args)[0][changed[0]][0]
        where = f"args{jax.tree_util.keystr(path)}"
        more = f" (and {len(changed) - 1} more leaves)" if len(changed) > 1 else ""
    else:
        old = {id(x) for x in before}
        if all(id(x) in old or id(x) in returned for x in leaves):
            return
        where, more = "an argument's structure", ""
    raise TypeError(
        f"the step {fn_name} changed {where}{more} in place, to a value it does not return: "
        f"replicate, like jax.jit, gives the step copies of its arguments, so the change is "
        f"lost and the next call starts from the old value (nnx.jit's in-place updates of a "
        f"model or optimizer, an entry written into a dict). Return the new state instead; "
        f"for flax nnx: graphdef, state = nnx.split((model, optimizer)) once, and in the "
        f"step model, optimizer = nnx.merge(graphdef, state) ... return nnx.state((model, "
        f"optimizer)) with the outputs")


def check_donated_distinct(leaves: list, donated: tuple) -> None:
    """Refuse a call that passes the same array twice where one of them is donated: XLA
    would read a buffer it gave away (the process can crash inside XLA)."""
    ids: dict[Any, int] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and not x.is_deleted():
            keys = [id(x)]
            try:
                keys += [("buf", s.data.unsafe_buffer_pointer()) for s in x.addressable_shards]
            except Exception:  # noqa: BLE001 - some arrays have no such pointer: identity only
                pass
            for k in keys:
                j = ids.setdefault(k, i)
                if j != i and (i in donated or j in donated):
                    raise ValueError(
                        f"replicate(donate=True): argument leaves {j} and {i} are the same "
                        f"array, and leaf {min(i, j) if min(i, j) in donated else max(i, j)} "
                        f"is donated (its buffer is given to the step); pass a copy "
                        f"(jnp.array(x, copy=True)) for the other")


def number(x: Any) -> bool:
    return isinstance(x, numbers.Number)
