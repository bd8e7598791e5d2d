"""Which op names the IR knows, and how many operands the fixed-arity ones take.

An op is either one of this project's own (``OUR_OPS``: collectives over the replica
axis, annotations, padding, markers) or a JAX primitive, imported as a generic op that
lowers by binding the primitive again. The parser and the verifier reject any other
name, and a fixed-arity op with another number of operands (``ARITY``), so a text that
cannot be lowered is refused where it is read, with its line and column.
"""
from __future__ import annotations

#: ops of this project (their lowering rules live in ``compiler``), with their arity
#: (``None``: variadic)
OUR_OPS: dict[str, int | None] = {
    "constant": 0, "replica_id": 0, "all_reduce": None, "all_gather": 1, "all_to_all": 1,
    "all_gather_invariant": 1,
    "cast_varying": None, "loss_scale": 1, "shard": 1, "pad_mask": 2, "pad_index": 2,
    "dim_value": None, "dim_as_value": 0,
}

_UNARY = ("neg", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt",
          "cbrt", "abs", "sign", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh",
          "asinh", "acosh", "atanh", "floor", "ceil", "round", "erf", "erfc", "erf_inv",
          "lgamma", "digamma", "not", "integer_pow", "is_finite", "real", "imag", "conj",
          "population_count", "clz", "convert_element_type", "reduce_precision", "copy",
          "copy_p", "stop_gradient", "square", "reshape", "transpose", "broadcast_in_dim",
          "squeeze", "expand_dims", "rev", "reduce_sum", "reduce_max", "reduce_min",
          "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin",
          "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "slice", "iota")
_BINARY = ("add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "and", "or",
           "xor", "eq", "ne", "lt", "le", "gt", "ge", "add_any", "dot_general",
           "shift_left", "shift_right_logical", "shift_right_arithmetic", "nextafter",
           "complex", "igamma", "igammac")

#: the operand counts checked for every op that has a fixed one
ARITY: dict[str, int] = {**{n: 1 for n in _UNARY}, **{n: 2 for n in _BINARY},
                         "iota": 0, "select_n": None,
                         **{k: v for k, v in OUR_OPS.items() if v is not None}}
ARITY = {k: v for k, v in ARITY.items() if v is not None}


#: ops that may talk to other devices (ours and JAX's own names; over the replica axis,
#: or another named axis of a user's program)
COLLECTIVES = frozenset({"all_reduce", "all_gather", "all_to_all", "ppermute", "reduce_scatter",
                         "psum_scatter", "pbroadcast", "all_gather_invariant", "ragged_all_to_all",
                         "pgather", "psum", "pmax", "pmin", "psum_invariant"})

#: ops that only call their one region on their operands and return its outputs
#: (``jax.jit`` and JAX's other call primitives, of any JAX version): inlining one changes
#: no value, and what holds of its region's outputs holds of its results
PLAIN_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "named_call"})

#: rematerialization (``jax.checkpoint``): a call of one region on its operands that
#: lowering keeps as an op (inlined, XLA would merge the recomputation away)
REMAT_CALLS = frozenset({"remat2", "checkpoint", "remat"})

#: primitive names of other JAX versions that lowering still accepts (call-like ops)
COMPAT_NAMES = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2",
                          "checkpoint", "custom_vjp_call_jaxpr", "custom_vjp_call",
                          "custom_jvp_call", "named_call", "eval_jaxpr"})


def is_known(name: str) -> bool:
    """Is ``name`` one of our ops or a JAX primitive of the installed JAX?"""
    if name in OUR_OPS or name in ARITY or name in COMPAT_NAMES:
        return True
    from ir import _jax_compat as jc
    return jc.primitive_by_name(name) is not None


def arity_error(name: str, n_operands: int) -> str | None:
    """Why ``n_operands`` operands are wrong for op ``name`` (``None`` when they are not)."""
    want = ARITY.get(name)
    if want is None or want == n_operands:
        return None
    return (f"{name} takes {want} operand{'s' if want != 1 else ''} but has {n_operands}")
