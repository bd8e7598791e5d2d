"""The ``padding`` pass: dynamic dims traced as symbols become their bucket size, and
every op that would see the padded elements is masked so the result is exact.

Input: a graph traced once with symbolic dims (``jax.export.symbolic_shape``; the IR
shows them as ``f32[b<=128,16]``), whose inputs include one varying ``s32[]`` per symbol
holding this replica's real size (``size_inputs``). Contract after this pass:

- every type is static: a plain symbol ``b`` is replaced by its bucket (``buckets``); a
  dim expression such as ``2*b`` (a concatenation or flattening over the padded axis,
  where padding would land in the middle) is an error;
- a dim cut from a symbol by a constant ``c`` (``b - 1``, the length of ``x[1:]``,
  ``x[:-1]``, ``jnp.diff``; JAX writes ``x[2:]``'s as ``- min(b, 2) + b``) is a padded dim
  of its own (:func:`derived_dim`): bucket ``max(bucket(b) - c, 0)``, real size
  ``max(n - c, 0)`` computed once at the top of the graph, and every rule below treats it
  like ``b``. The ops that cut it keep the real elements first: ``slice`` from a constant
  start with stride 1, ``gather``/``dynamic_slice`` (XLA clamps the start to ``[0, c]``
  padded as unpadded), ``pad`` with a constant low end, ``split`` and ``concatenate``
  with the padded part last; the ones that write it back keep its padding off real
  elements (a combining ``scatter`` masks it to its identity, ``.set`` only from row
  ``c``, ``dynamic_update_slice`` keeps what was under it, ``pad`` fills it); anything
  else is an error;
- ``dim_as_value`` (the size used as a number: the divisor of ``mean``/``var``, and its
  gradient) becomes ``dim_value(%n)``, evaluated on the real sizes at run time;
- ``pad_mask(%x, %n) {axis, fill}`` (``where(iota(axis) < n, x, fill)``) is inserted
  before every op whose result would depend on padded elements (rules in ``MASK_RULES``):
  reductions and cumulative ops over a padded axis (``sum``/``prod`` fill 0/1,
  ``max``/``argmax`` fill -inf, ``min``/``argmin`` +inf), ``sort`` (+inf: padding sorts
  last), ``top_k`` (-inf), ``dot_general`` contracting over a padded axis (zero both
  sides). Softmax, logsumexp, mean, variance, layer norm and attention are made of these.
- control flow over padded values (``cond``/``switch``, ``while``, ``scan`` whose carry
  or steps hold a padded axis, checkpointed regions) is padded region by region with the
  real sizes passed in as extra inputs, so the same rules hold inside;
- ops that cannot be made exact over a padded axis raise :class:`PaddingError` naming the
  op and the user's source line: a ``scan`` stepping along a padded axis, ``rev``,
  windows and convolutions over padded window dims, collectives of padded values, and ops
  whose result would mix padded with real positions. ``pad`` to a size beyond the real
  one (``jnp.pad(x, ((0, 16 - t),))``) sets the padding to the pad value first, since it
  would land on real positions. Ops not known are allowed only when they keep each padded
  axis where it was (element-wise); otherwise they are errors, never silent.
- a gradient all-reduce (sum) of a value with a padded dim, whose real size differs
  between replicas (the gradient of a position embedding ``wpe[arange(t)]``), is moved
  through linear ops to where the dims are static and summed there (``_Padder.deferred``);
  other uses before that point are errors naming both lines. A ``dynamic_slice`` or
  ``gather`` as long as a padded dim from a static axis has its start clamped against
  the real length (``_Padder.sized_slice``).
- call-like ops (``pjit``, ``custom_jvp_call``...) holding padded values are inlined.
- values computed from the real sizes are ``varying``.

- ``pad_index(%i, %n) {component, size, mode, oob}`` rewrites an index into a padded axis
  so that it behaves as it would against the real size ``n`` (rules in ``INDEX_RULES``):
  ``gather`` (modes ``clip``/``promise_in_bounds`` clamp to ``[0, n - size]``; ``fill``
  sends an index out of the real range out of the bucket too, so XLA fills),
  ``dynamic_slice``/``dynamic_update_slice`` starts (clamped like XLA clamps them), and
  the ``scatter`` family (``clip`` clamps; otherwise an index out of the real range is
  sent past the bucket, so XLA drops the update as it would unpadded). Scatter update
  rows that are padding are dropped the same way (their indices masked past the bucket;
  an error in ``clip`` mode, which cannot drop); an update whose padded axis would land on
  real positions is an error, unless the scatter combines (add, mul, min, max) and its
  window starts at a constant from which the bucket fits: the padding is then masked to
  the combiner's identity (the gradient of ``wpe[:t]``, ``x.at[:t].add(u)``). A
  ``dynamic_update_slice`` of a padded update into an operand with no padded axis writes
  only the real part (``_Padder.update_onto_static``).

Padding is at the end of each padded axis, so slices that keep the whole axis and
cumulative ops are exact as they are.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Iterable

import jax
import numpy as np
from jax import lax

from compiler.errors import PassError
from compiler.lower import CALL_LIKE, rule
from compiler.passes.cross_replica_sum import is_zero
from ir import _jax_compat as jc
from ir.graph import Graph, Op, Opaque, Value
from ir.jaxpr_import import import_jaxpr, sym_dim_name
from ir.ops import COLLECTIVES
from ir.types import Replica, SymDim, TensorType


class PaddingError(PassError, ValueError):
    """An op that padding cannot make exact over a padded (dynamic) dimension."""


# op -> (attribute holding the reduced axes, fill)
REDUCE_RULES: dict[str, tuple[str, str]] = {
    "reduce_sum": ("axes", "0"), "reduce_prod": ("axes", "1"),
    "reduce_max": ("axes", "-inf"), "reduce_min": ("axes", "+inf"),
    "reduce_and": ("axes", "ones"), "reduce_or": ("axes", "0"), "reduce_xor": ("axes", "0"),
    "argmax": ("axes", "-inf"), "argmin": ("axes", "+inf"),
    "cumsum": ("axis", "0"), "cumprod": ("axis", "1"), "cummax": ("axis", "-inf"),
    "cummin": ("axis", "+inf"), "cumlogsumexp": ("axis", "-inf"),
}
#: the identity of each cumulative op, finite (see ``cumulative_jvp`` in ``masked``)
_CUM_IDENTITY = {"cumprod": "1", "cummax": "lowest", "cummin": "highest",
                 "cumlogsumexp": "lowest"}
#: the derivatives of cumulative ops (``jc.cumulative_derivative_primitives``)
_CUM_DERIVATIVES = frozenset({"cumulative_jvp", "cumulative_vjp"})
#: window ops: exact when every padded axis has a window of one element (pooling over H, W
#: of a padded batch), an error otherwise
WINDOWS = frozenset({"reduce_window", "reduce_window_sum", "reduce_window_max",
                     "reduce_window_min", "select_and_scatter_add", "select_and_gather_add"})
#: ops that are never exact when an operand is padded: every collective (replicas hold
#: different real sizes in one bucket, so a reduce-scatter summed real rows of one replica
#: with padding of another) but the gradient all-reduce the pass defers to static dims
DENY = frozenset({"reduce", "reduce_precision_window"}) | COLLECTIVES
#: ops that call their one region with their operands and are kept as ops (not inlined)
_REGION_CALLS = frozenset({"remat2", "checkpoint", "remat", "custom_lin"})
#: the scatter family: a combiner region (scalar, not a loop) and ``ScatterDimensionNumbers``
SCATTERS = frozenset({"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                      "scatter-max"})
#: ops that index into an axis of their first operand (``pad_index`` on padded ones)
INDEX_RULES = frozenset({"gather", "dynamic_slice", "dynamic_update_slice"}) | SCATTERS
#: linear algebra on the matrices of the last two axes. A padded matrix axis is exact only
#: for the factorizations and solves whose leading block depends on the leading block
#: alone once the padding is the identity (``_Padder.linalg``); the others (eigenvalues,
#: QR, SVD, ...) mix the padding in (the identity's eigenvalues join the real ones)
LINALG_BLOCK_EXACT = frozenset({"cholesky", "lu", "triangular_solve"})
LINALG = LINALG_BLOCK_EXACT | frozenset({
    "eigh", "eig", "svd", "qr", "geqrf", "geqp3", "householder_product", "schur",
    "hessenberg", "tridiagonal", "tridiagonal_solve", "cholesky_update", "eigh_jacobi"})
#: ops whose operands' axes move; checked only for dim expressions in the result (ops
#: with a rule of their own in ``_Padder.masked`` are handled before this set is consulted)
STRUCTURAL = frozenset({"broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice",
                        "iota", "concatenate", "pad", "split", "select_n", "clamp", "argsort"})


def _loc(op: Op) -> str:
    return str(op.loc) if op.loc is not None else "unknown location"


def _grown(x: Any, by: dict[int, int]) -> Any:
    """``x`` with ``by[a]`` zeros appended along each axis ``a`` (traced, for ``splice``):
    room for a slice or update of a bucket's length that XLA then never clamps."""
    return lax.pad(x, jax.numpy.zeros((), x.dtype),
                   [(0, by.get(a, 0), 0) for a in range(x.ndim)])


def _clamped_start(c: Any, dim: int, n: Any) -> Any:
    """The start ``c`` clamped as XLA clamps it for ``n`` elements of an axis of ``dim``
    (traced, for ``splice``: ``n`` is a replica's real size)."""
    return jax.numpy.clip(c, 0, (dim - n).astype(c.dtype)).astype(c.dtype)


#: PRNG ops elementwise over a key array's leading axes that add or remove the trailing
#: axes of the key data (``jax.random.split`` of a key per row)
_KEY_DATA = frozenset({"random_wrap", "random_unwrap", "random_split", "random_fold_in",
                       "random_bits"})
#: host callbacks: the host function would see a padded value's padding
_CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback", "callback"})
#: the identity of each combining scatter (what a masked update element adds nothing with)
_SCATTER_IDENTITY = {"scatter-add": "0", "scatter-sub": "0", "scatter-mul": "1",
                     "scatter-min": "+inf", "scatter-max": "-inf"}
#: ops linear in all their operands together (every one must hold an addend)
_LINEAR_ALL = frozenset({"add", "add_any", "sub"})
#: ops linear in their first operand, the others (indices, starts) not addends
_LINEAR_FIRST = frozenset({"neg", "reshape", "transpose", "squeeze", "expand_dims",
                           "broadcast_in_dim", "reduce_sum", "copy", "copy_p", "slice",
                           "cast_varying", "real", "imag", "conj", "gather",
                           "dynamic_slice"})


def _constant(v: Value, producers: dict[Value, Op]) -> np.ndarray | None:
    """``v``'s value when it is a constant (broadcast, reshaped, converted or cast to
    varying), else ``None``."""
    op = producers.get(v)
    if op is None:
        return None
    if op.name == "constant":
        value = np.asarray(op.attr("value"))
        shape = tuple(v.type.shape)
        if value.shape != shape and value.size == 1 and all(isinstance(d, int) for d in shape):
            value = np.broadcast_to(value.reshape(()), shape)
        return value
    if op.name in ("cast_varying", "copy", "copy_p") and len(op.operands) == 1:
        return _constant(op.operands[0], producers)  # (identities)
    if op.name in ("broadcast_in_dim", "convert_element_type", "reshape") and \
            all(isinstance(d, int) for d in v.type.shape):
        inner = _constant(op.operands[0], producers)
        if inner is None:
            return None
        if op.name == "convert_element_type":
            return inner.astype(jc.dtype_from_name(v.type.dtype))
        if op.name == "reshape":
            return inner.reshape(tuple(v.type.shape))
        dims = op.attr("broadcast_dimensions")
        shape = tuple(v.type.shape)
        expanded = inner.reshape([inner.shape[dims.index(k)] if k in dims else 1
                                  for k in range(len(shape))])
        return np.broadcast_to(expanded, shape)
    return None


_is_dimexpr = jc.is_symbolic_dim


def _subst_attr(v: Any, env: dict[str, int]) -> Any:
    if isinstance(v, Opaque) and v.obj is not None and _is_dimexpr(v.obj):
        v = v.obj
    if _is_dimexpr(v):
        name = sym_dim_name(str(v))
        if name in env:  # a padded dim, derived ones included: its bucket
            return env[name]
        return int(jc.evaluate_dim(v, env))  # the expression at the bucket sizes
    if isinstance(v, tuple):
        items = [_subst_attr(x, env) for x in v]
        return type(v)(*items) if hasattr(v, "_fields") else tuple(items)
    return v


#: the text of a dim expression that :func:`derived_dim` reads: one symbol, integers,
#: ``min``, ``max``, ``+``, ``-`` (no product, floordiv or mod)
_DERIVED_TEXT = re.compile(r"^[\sA-Za-z_0-9+\-(),]*$")


def derived_dim(d: Any, plain: Iterable[str]) -> tuple[str, int] | None:
    """``(s, c)`` when the dim ``d`` is ``max(s - c, 0)`` for a padded (``plain``) symbol
    ``s`` and an int ``c >= 0`` (``(s, 0)``: ``s`` itself), else ``None``. JAX writes the
    length of ``x[1:]`` as ``b - 1``, of ``x[2:]`` as ``- min(b, 2) + b`` and of
    ``x[:-2]`` as ``max(0, b - 2)``. The expression's text, read back by JAX's parser:
    made of ``s``, integers, ``min``, ``max``, ``+`` and ``-`` only, it is piecewise
    linear with its bends below the sum of its integers, so comparing its value (JAX's
    evaluation) with ``max(s - c, 0)`` at every size up to past that sum (from 1: JAX
    takes every symbol >= 1) decides it."""
    if not isinstance(d, SymDim):
        return None
    plain = frozenset(plain)
    if d.name in plain:
        return d.name, 0
    fam = _cut_of(d.expr) if d.expr else None
    return fam if fam is not None and fam[0] in plain else None


@functools.lru_cache(maxsize=1024)
def _cut_of(expr: str) -> tuple[str, int] | None:
    """``(s, c)`` when ``expr`` is ``max(s - c, 0)`` with ``c >= 1`` (see
    :func:`derived_dim`): parsed by JAX (``jc.parse_dim``) and evaluated by it."""
    if not _DERIVED_TEXT.match(expr):
        return None
    try:
        dim = jc.parse_dim(expr.strip())
        names = jc.dim_vars(dim)
    except Exception:  # noqa: BLE001 - not an expression JAX reads back
        return None
    if len(names) != 1 or set(re.findall(r"[A-Za-z_]\w*", expr)) - {"min", "max", names[0]}:
        return None
    s = names[0]
    top = sum(int(t) for t in re.findall(r"\b\d+\b", expr)) + 4
    if top > 4096:  # (not worth the sizes to compare: refused)
        return None

    def at(n: int) -> int:
        return int(jc.evaluate_dim(dim, {s: n}))
    c = top - at(top)
    if c < 1 or any(at(n) != max(n - c, 0)
                    for n in list(range(1, top + 1)) + [2 * top + 7, 10**6]):
        return None
    return s, c


def _is(d: Any, sym: str) -> bool:
    return isinstance(d, SymDim) and d.name == sym


def _has_sym(t: TensorType) -> bool:
    return any(isinstance(d, SymDim) for d in t.shape)


def _region_has_sym(g: Graph) -> bool:
    """Does ``g`` (regions included) hold a dynamic dim, or use a size as a number
    (``dim_as_value``: a while loop's condition ``i < x.shape[0]``, whose values are all
    scalars)?"""
    if any(_has_sym(v.type) for v in g.inputs + g.outputs):
        return True
    return any(op.name == "dim_as_value" or any(_has_sym(r.type) for r in op.results + op.operands)
               for op, _ in g.walk())


@dataclass(frozen=True)
class PaddingPass:
    """Symbolic dims -> buckets, masks, real sizes (see module docstring). A no-op when
    ``buckets`` is empty (a pipeline without dynamic shapes)."""

    name: str = "padding"
    buckets: tuple[tuple[str, int], ...] = ()
    size_inputs: tuple[tuple[str, int], ...] = ()

    def apply(self, graph: Graph) -> Graph:
        if not self.buckets:
            if _region_has_sym(graph):
                raise PaddingError("padding: the graph has symbolic dims but no buckets were given")
            return graph
        return _Padder(dict(self.buckets), dict(self.size_inputs)).run(graph)


class _Padder:
    def __init__(self, buckets: dict[str, int], size_inputs: dict[str, int]):
        self.buckets = buckets
        self.size_inputs = size_inputs
        self.env: dict[Value, Value] = {}
        self.sizes: dict[str, Value] = {}
        self.ops: list[Op] = []
        #: values (of the graph being padded) that hold this replica's addend of a gradient
        #: all-reduce deferred until its dims are static, with that all-reduce (``deferred``)
        self.partial: dict[Value, Op] = {}
        self.producers: dict[Value, Op] = {}  # (of the graph being padded, regions walked)
        #: per padded dim, ``(s, c)``: the symbol ``s`` it is cut from and by how much
        #: (``(s, 0)`` for ``s``; ``(b, 1)`` for ``b - 1``, the length of ``x[1:]``)
        self.family: dict[str, tuple[str, int]] = {sym: (sym, 0) for sym in buckets}
        self.texts: dict[str, str] = {}  # a cut dim's JAX text (``b - 1``), for messages

    # -- types -----------------------------------------------------------------------
    def padded_axes(self, t: TensorType, op: Op) -> dict[int, str]:
        out = {}
        for i, d in enumerate(t.shape):
            if isinstance(d, SymDim):
                if d.name not in self.buckets:
                    raise PaddingError(
                        f"padding: {op.name} has a value of type {t} whose dim "
                        f"{d.expr or d.name} mixes "
                        f"padded and real elements (the padded axis was flattened, concatenated, "
                        f"strided, resized or cut by a number that depends on its size: "
                        f"x[::2], x[b//2:], jnp.concatenate([x, x]); only a constant number "
                        f"of elements may be cut off, as x[1:], x[:-2], jnp.diff do); "
                        f"padding cannot make it exact ({_loc(op)})")
                out[i] = d.name
        return out

    def dim_sym(self, d: Any) -> str | None:
        """The padded dim (a name of :attr:`buckets`) of a dim expression in an attribute
        (``slice_sizes``), or ``None``."""
        if not _is_dimexpr(d):
            return None
        name = sym_dim_name(str(d))
        return name if name in self.buckets else None

    def text(self, sym: str) -> str:
        """A padded dim as the user's code knows it (``b - 1``, not ``b_minus_1``)."""
        return self.texts.get(sym, sym)

    def shorter(self, r: str | None, p: str | None) -> int | None:
        """How many elements padded dim ``r`` has fewer than another padded dim ``p`` cut
        from the same symbol (``b - 1`` against ``b``: 1; 0 for two texts of one length,
        ``max(0, b - 2)`` and ``- min(b, 2) + b``), when not more; else ``None`` (and for
        ``r`` = ``p``)."""
        fr, fp = self.family.get(r), self.family.get(p)
        if r == p or fr is None or fp is None or fr[0] != fp[0] or fr[1] < fp[1]:
            return None
        return fr[1] - fp[1]

    def register_derived(self, graph: Graph) -> None:
        """Every dim of ``graph`` (regions included) that is ``max(s - c, 0)`` of a padded
        symbol ``s`` (:func:`derived_dim`: the length of ``x[1:]``, ``x[:-2]``) becomes a
        padded dim of its own: bucket ``max(bucket(s) - c, 0)``, real size
        ``max(n_s - c, 0)`` computed here, at the top of the graph (regions get it as an
        input, like the other sizes). Whether the op that makes it keeps the real elements
        first is checked there (:meth:`slice`, :meth:`indexed`, :meth:`pad`, ...); any
        other dim expression stays an error where it is used (:meth:`padded_axes`)."""
        plain = [sym for sym in self.buckets if sym in self.sizes]
        seen: set[str] = set()

        def dims(vals):
            for v in vals:
                for d in v.type.shape:
                    if isinstance(d, SymDim) and d.name not in self.buckets and d.name not in seen:
                        seen.add(d.name)
                        yield d
        values = list(graph.inputs) + list(graph.outputs)
        for op, _ in graph.walk():
            values.extend(op.operands)
            values.extend(op.results)
            for region in op.regions:
                values.extend(region.inputs)
                values.extend(region.outputs)
        for d in list(dims(values)):
            fam = derived_dim(d, plain)
            if fam is None:
                continue
            sym, c = fam
            self.buckets[d.name] = max(self.buckets[sym] - c, 0)
            self.family[d.name] = fam
            self.texts[d.name] = d.expr
            self.sizes[d.name] = self.splice(
                lambda n, c=c: jax.numpy.maximum(n - c, 0).astype(n.dtype),
                (self.sizes[sym],), "derived_size", None)

    def subst_type(self, t: TensorType, replica: Replica | None = None) -> TensorType:
        shape = tuple(self.buckets[d.name] if isinstance(d, SymDim) and d.name in self.buckets
                      else d for d in t.shape)
        if any(isinstance(d, SymDim) for d in shape):
            bad = next(d for d in shape if isinstance(d, SymDim))
            raise PaddingError(f"padding: dim {bad} is not one of the padded dims "
                               f"{sorted(self.buckets)}")
        return TensorType(shape, t.dtype, replica or t.replica, t.sharding, t.weak_type)

    def new(self, v: Value, replica: Replica | None = None) -> Value:
        nv = Value(self.subst_type(v.type, replica))
        self.env[v] = nv
        return nv

    # -- the walk --------------------------------------------------------------------
    def run(self, graph: Graph) -> Graph:
        inputs = tuple(self.new(v) for v in graph.inputs)
        for sym, i in self.size_inputs.items():
            self.sizes[sym] = inputs[i]
        self.register_derived(graph)
        self.walk(graph.ops)
        self.check_no_partial(graph.outputs, "is a result of the step")
        outputs = tuple(self.env[v] for v in graph.outputs)
        g = Graph(inputs, tuple(self.ops), outputs, graph.name)
        from compiler.passes.replication import annotate
        return annotate(g, [v.type.replica or Replica.VARYING for v in inputs])[0]

    def walk(self, ops: tuple[Op, ...]) -> None:
        for op in ops:
            if op.name in CALL_LIKE and op.regions and _region_has_sym(op.regions[0]) \
                    and len(op.regions[0].inputs) == len(op.operands):
                region = op.regions[0]
                for rv, ov in zip(region.inputs, op.operands):
                    self.env[rv] = self.env[ov]
                    if ov in self.partial:
                        self.partial[rv] = self.partial[ov]
                self.walk(region.ops)
                for res, rv in zip(op.results, region.outputs):
                    self.env[res] = self.env[rv]
                    if rv in self.partial:
                        self.partial[res] = self.partial[rv]
                continue
            for r in op.results:
                self.producers[r] = op
            if not self.deferred(op):
                partial = [self.partial.get(v) for v in op.operands]
                if any(partial):
                    self.visit_partial(op, partial)
                else:
                    self.visit(op)

    def mask(self, x: Value, axis: int, sym: str, fill: str, op: Op) -> Value:
        m = Value(TensorType(x.type.shape, x.type.dtype, Replica.VARYING, x.type.sharding,
                             x.type.weak_type))
        self.ops.append(Op("pad_mask", (x, self.sizes[sym]), (m,),
                           (("axis", axis), ("fill", fill)), op.loc))
        return m

    # -- gradient all-reduces of padded values: deferred to where the dims are static -----
    def deferred(self, op: Op) -> bool:
        """A gradient all-reduce (a sum the backward pass made) of a value with a padded
        dim is not run there: each replica's own value has its own real size, so there is
        no elementwise sum to take (the gradient of a position embedding ``wpe[arange(t)]``
        whose length varies between replicas). Its result stands for the replica's addend
        (:attr:`partial`) until linear ops have made the dims static (the embedding's
        gradient, scattered into the table), where :meth:`visit_partial` sums it: by
        linearity sum_r f_r(x_r) is the derivative of the global program, f_r being the
        replica's own (padded: masked) linear map. Anything else is refused there."""
        if op.name != "all_reduce" or op.attr("reduce") != "sum" or not op.attr("gradient") \
                or len(op.operands) != 1 or not _has_sym(op.operands[0].type) \
                or op.operands[0] in self.partial:
            return False
        self.padded_axes(op.operands[0].type, op)  # (a dim expression: its own error)
        self.env[op.result] = self.env[op.operands[0]]
        self.partial[op.result] = op
        return True

    def visit_partial(self, op: Op, partial: list[Op | None]) -> None:
        """``op`` reading the addend of a deferred all-reduce (:meth:`deferred`): allowed
        when linear in it with its other operands mirrored; its results carry the addend
        on, or, once static, are summed over the replicas (the all-reduce, moved here)."""
        src = next(p for p in partial if p is not None)
        why = self.nonlinear(op, [p is not None for p in partial])
        if why:
            dims = sorted(set(d.name for v, p in zip(op.operands, partial) if p
                              for d in v.type.shape if isinstance(d, SymDim)))
            raise PaddingError(
                f"padding: the gradient all-reduce at {_loc(src)} sums a value with a padded "
                f"(dynamic) dim {dims}, whose size differs between replicas; it is moved to "
                f"where the dims are static, through linear ops only, but {op.name} at "
                f"{_loc(op)} {why}; keep that dim static (RunOptions(dynamic_dims=...))")
        self.visit(op)
        for r in op.results:
            if _has_sym(r.type):
                self.partial[r] = src
                continue
            t = self.env[r].type
            res = Value(TensorType(t.shape, t.dtype, Replica.MIRRORED, t.sharding, t.weak_type))
            self.ops.append(Op("all_reduce", (self.env[r],), (res,), src.attrs, src.loc))
            self.env[r] = res

    def nonlinear(self, op: Op, partial: list[bool]) -> str | None:
        """Why ``op`` is not linear in its ``partial`` operands with the others mirrored
        (so that it cannot carry a deferred sum), or ``None``."""
        others = [v for v, p in zip(op.operands, partial) if not p]
        if any(v.type.replica is not Replica.MIRRORED for v in others):
            return "combines it with a value that differs between replicas"
        name = op.name
        if op.regions and name not in SCATTERS:
            return "runs a region over it"
        if name in _LINEAR_ALL:
            return None if all(partial) else "adds it to a value that is no addend"
        if name in _LINEAR_FIRST:
            return None if partial[0] and not any(partial[1:]) else "is not linear in it"
        if name in ("mul", "dot_general"):
            return None if sum(partial) == 1 else "multiplies two addends"
        if name == "div":
            return None if partial == [True, False] else "divides by it"
        if name == "convert_element_type":
            kind = np.dtype(jc.dtype_from_name(op.result.type.dtype)).kind
            return None if kind in "fc" else "converts it to an integer type"
        if name == "dynamic_update_slice":
            zero = partial[0] or is_zero(op.operands[0], self.producers)
            return None if partial[1] and not any(partial[2:]) and zero else \
                "writes it onto a value that is not zero"
        if name == "scatter-add":
            zero = partial[0] or is_zero(op.operands[0], self.producers)
            return None if partial[2] and not partial[1] and zero else \
                "scatters it onto a value that is not zero"
        if name == "pad":  # (with zeros, along static axes only: ``jnp.pad``, a scan's shift)
            config = op.attr("padding_config") or ()
            static = all(tuple(c) == (0, 0, 0) for c, d in zip(config, op.operands[0].type.shape)
                         if isinstance(d, SymDim))
            return None if partial == [True, False] and static and \
                is_zero(op.operands[1], self.producers) else "pads it with a value that is not zero"
        return "is not known to be linear in it"

    def check_random_bits(self, op: Op, made: dict[int, str]) -> None:
        """Random bits drawn for a padded shape: a generator numbers the elements of the
        whole shape, so the padding changes the bits of the real elements except along
        axis 0 (the elements' row-major numbers do not depend on its size), and there
        only with a generator that numbers each element on its own (threefry
        "partitionable", JAX's default, and rbg; the other threefry splits its counters
        by the total size). Anything else would silently differ from the unpadded draw:
        a ``PaddingError`` naming the op and the axis."""
        key = op.operands[0].type.dtype if op.operands else ""
        threefry = not key.startswith("key<") or "fry" in key
        where = next((a for a in made if a != 0), None)
        if where is None and threefry and not jax.config.jax_threefry_partitionable:
            where = 0
        if where is not None:
            why = ("jax_threefry_partitionable is off, so every bit depends on the total size"
                   if where == 0 else "the bits of every element depend on the sizes of the "
                   "axes after axis 0")
            raise PaddingError(
                f"padding: random_bits draws {op.results[0].type} over the padded axis "
                f"{where} (dim {made[where]}) and {why}: its values would differ from the "
                f"unpadded draw ({_loc(op)}); draw over a static shape and slice, or keep that "
                f"dim static (RunOptions(dynamic_dims=...))")

    def check_no_partial(self, values: tuple[Value, ...], where: str) -> None:
        for v in values:
            src = self.partial.get(v)
            if src is not None:
                raise PaddingError(
                    f"padding: the gradient all-reduce at {_loc(src)} sums a value of type "
                    f"{v.type}, whose padded (dynamic) dim differs between replicas, and the "
                    f"value {where} before its dims are static; keep that dim static "
                    f"(RunOptions(dynamic_dims=...))")

    def visit(self, op: Op) -> None:
        pads = [self.padded_axes(v.type, op) for v in op.operands]
        for r in op.results:
            made = self.padded_axes(r.type, op)
            if made and op.name == "random_bits":
                self.check_random_bits(op, made)
        any_pad = any(pads)
        if op.name in _CALLBACKS and (any_pad or any(
                isinstance(d, SymDim) for r in op.results for d in r.type.shape)):
            raise PaddingError(
                f"padding: {op.name} takes or returns a value with a padded (dynamic) axis "
                f"({', '.join(str(v.type) for v in op.operands + op.results)}): the host "
                f"function would see the padding, not the real rows ({_loc(op)}); call it on "
                f"a static shape, or keep that dim static (RunOptions(dynamic_dims=...))")
        attrs = tuple((k, _subst_attr(v, self.buckets)) for k, v in op.attrs)
        operands = [self.env[v] for v in op.operands]
        if op.name == "dim_as_value":
            expr = op.attr("dim")
            names = jc.dim_vars(expr)
            missing = [n for n in names if n not in self.sizes]
            if missing:
                raise PaddingError(f"padding: dim_as_value uses {missing}, which has no real "
                                   f"size input ({_loc(op)})")
            res = self.new(op.result, Replica.VARYING)
            self.ops.append(Op("dim_value", tuple(self.sizes[n] for n in names), (res,),
                               (("dim", expr), ("vars", names)), op.loc))
            return
        if op.regions and op.name not in SCATTERS and (
                any_pad or any(_region_has_sym(g) for g in op.regions)):
            self.visit_regions(op, pads, operands, attrs)
            return
        if op.name == "shard" and pads[0]:
            self.check_split(op, pads[0])
        if op.name == "slice" and pads[0]:
            attrs = self.slice(op, pads[0], attrs)
        if op.name in ("dynamic_slice", "gather") and _has_sym(op.result.type):
            operands = self.sized_slice(op, pads, operands)
        if op.name == "dynamic_update_slice" and pads[1] and (not pads[0] or (
                all(pads[1].get(a) == sym for a, sym in pads[0].items())
                and any(a not in pads[0] for a in pads[1]))):
            # (axes padded alike on both, as the batch of a cache and its prefill, are
            # written whole from start 0: only those landing on static axes need care)
            self.update_onto_static(op, {a: s for a, s in pads[1].items() if a not in pads[0]},
                                    operands)
            return
        if any_pad and op.name == "fft":
            self.check_fft(op, pads[0])
            results = tuple(self.new(r) for r in op.results)
            self.ops.append(op.replace(operands=tuple(operands), results=results, attrs=attrs))
            return
        if any_pad and op.name in DENY:
            raise PaddingError(
                f"padding: {op.name} over a value with a padded (dynamic) dim "
                f"{sorted(set(s for p in pads for s in p.values()))} cannot be made exact "
                f"({_loc(op)})")
        if any_pad and op.name == "sort" and op.attr("dimension") in pads[0]:
            self.sort(op, pads[0][op.attr("dimension")], operands, attrs)
            return
        if any_pad:
            operands = self.masked(op, pads, operands)
            if op.name in _CUM_DERIVATIVES and op.attr("reverse") and self.cumulative_sym(op, pads):
                self.reverse_cumulative_derivative(op, pads, operands, attrs)
                return
        results = tuple(self.new(r) for r in op.results)
        self.ops.append(op.replace(operands=tuple(operands), results=results, attrs=attrs))

    # -- control flow: the regions are padded like the graph, with the real sizes passed in
    def visit_regions(self, op: Op, pads: list[dict[int, str]], operands: list[Value],
                      attrs: tuple) -> None:
        """``cond``, ``while``, ``scan`` and checkpointed regions over padded values: each
        region is padded by the same rules, the real sizes entering as extra inputs, so
        every reduction inside is masked as it would be outside. Exact because padding
        rows never mix with real ones in a region any more than outside it; a ``scan``
        whose steps run along a padded axis would step through the padding, so it is an
        error."""
        syms = sorted(self.sizes)
        sizes = [self.sizes[s] for s in syms]
        k = len(sizes)
        regions = list(op.regions)
        upd: dict[str, Any] = {}
        if op.name == "scan":
            nc, ncar = op.attr("num_consts"), op.attr("num_carry")
            for j in range(nc + ncar, len(op.operands)):
                if 0 in pads[j]:
                    raise PaddingError(
                        f"padding: scan steps along a padded (dynamic) axis of its input "
                        f"{op.operands[j].type}, so it would step through the padding; "
                        f"scan over a static axis (e.g. time with the batch padded) or keep "
                        f"that axis static (RunOptions(dynamic_dims=...)) ({_loc(op)})")
            i = op.attr("jaxpr").index
            regions[i] = self.region(regions[i], syms, 0)
            operands = sizes + operands
            upd["num_consts"] = nc + k
        elif op.name == "while":
            cn, bn = op.attr("cond_nconsts"), op.attr("body_nconsts")
            ci, bi = op.attr("cond_jaxpr").index, op.attr("body_jaxpr").index
            regions[ci] = self.region(regions[ci], syms, 0)
            regions[bi] = self.region(regions[bi], syms, 0)
            operands = sizes + operands[:cn] + sizes + operands[cn:]
            upd["cond_nconsts"], upd["body_nconsts"] = cn + k, bn + k
        elif op.name == "cond":
            regions = [self.region(g, syms, len(g.inputs)) for g in regions]
            operands = operands + sizes
        elif op.name in _REGION_CALLS and len(regions) == 1 \
                and len(regions[0].inputs) == len(op.operands):
            regions = [self.region(regions[0], syms, len(regions[0].inputs))]
            operands = operands + sizes
        else:
            raise PaddingError(
                f"padding: {op.name} runs a region over values with a padded (dynamic) dim "
                f"and has no padding rule ({_loc(op)})")
        attrs = tuple((key, upd.get(key, v)) for key, v in attrs)
        results = tuple(self.new(r) for r in op.results)
        self.ops.append(op.replace(operands=tuple(operands), results=results, attrs=attrs,
                                   regions=tuple(regions)))

    def region(self, g: Graph, syms: list[str], at: int) -> Graph:
        """``g`` padded by a padder of its own, with one real-size input per symbol
        inserted at input position ``at``."""
        sub = _Padder(self.buckets, {})
        sub.family, sub.texts = self.family, self.texts
        size_in = [Value(self.sizes[s].type) for s in syms]
        sub.sizes = dict(zip(syms, size_in))
        ins = [sub.new(v) for v in g.inputs]
        sub.walk(g.ops)
        sub.check_no_partial(g.outputs, "leaves the region of a cond, while, scan or "
                                        "checkpoint")
        outs = tuple(sub.env[v] for v in g.outputs)
        return Graph(tuple(ins[:at] + size_in + ins[at:]), tuple(sub.ops), outs, g.name)

    def masked(self, op: Op, pads: list[dict[int, str]], operands: list[Value]) -> list[Value]:
        name = op.name
        if name in REDUCE_RULES:
            key, fill = REDUCE_RULES[name]
            axes = op.attr(key)
            axes = (axes,) if isinstance(axes, int) else tuple(axes)
            for a in axes:
                if a in pads[0]:
                    operands[0] = self.mask(operands[0], a, pads[0][a], fill, op)
            return operands
        if name in LINALG:
            return self.linalg(op, pads, operands)
        if name == "top_k":
            a = operands[0].type.rank - 1
            if a in pads[0]:
                operands[0] = self.mask(operands[0], a, pads[0][a], "-inf", op)
            return operands
        if name == "dot_general":
            (lc, rc), _ = op.attr("dimension_numbers")
            for la, ra in zip(lc, rc):
                sym = pads[0].get(la) or pads[1].get(ra)
                if sym:
                    operands[0] = self.mask(operands[0], la, sym, "0", op)
                    operands[1] = self.mask(operands[1], ra, sym, "0", op)
            return operands
        if name in _CUM_DERIVATIVES:
            # the derivative of a cumulative op (jc.cumulative_derivative_primitives): its
            # input at the op's identity (finite: the derivative of max/logaddexp at an
            # infinity is NaN) and the tangent or cotangent at 0 along the padded axis
            sym = self.cumulative_sym(op, pads)
            if sym:
                a = op.attr("axis")
                operands[0] = self.mask(operands[0], a, sym, _CUM_IDENTITY[op.attr("kind")], op)
                operands[1] = self.mask(operands[1], a, sym, "0", op)
            return operands
        if name == "conv_general_dilated":
            return self.conv(op, pads, operands)
        if name in WINDOWS:
            self.check_window_op(op, pads)
            return operands
        if name == "rev":
            bad = [a for a in op.attr("dimensions") if a in pads[0]]
            if bad:
                raise PaddingError(f"padding: rev reverses padded axis {bad[0]} (dim "
                                   f"{pads[0][bad[0]]}), which would move the padding to the "
                                   f"front ({_loc(op)})")
            return operands
        if name == "reshape":
            self.check_reshape(op, pads[0])
            return operands
        if name == "pad":
            return self.pad(op, pads, operands)
        if name in INDEX_RULES:
            return self.indexed(op, pads, operands)
        if name == "concatenate":
            self.check_concatenate(op, pads)
            return operands
        if name == "split":
            self.check_split_parts(op, pads[0])
            return operands
        if name in STRUCTURAL:
            return operands
        # unknown op: allowed only when element-wise on every padded axis
        rshape = op.results[0].type.shape if op.results else ()
        if name == "stack":  # a new axis at ``axis``: the others move past it or stay
            k = op.attr("axis")
            for v, p in zip(op.operands, pads):
                for a, sym in p.items():
                    if not _is(rshape[a if a < k else a + 1], sym):
                        raise PaddingError(f"padding: stack moves the padded axis {a} (dim "
                                           f"{sym}) of {v.type} ({_loc(op)})")
            return operands
        if name == "unstack":  # axis ``axis`` taken apart: the others move down past it
            k = op.attr("axis") % max(op.operands[0].type.rank, 1)
            for a, sym in pads[0].items():
                if a == k or any(not _is(r.type.shape[a if a < k else a - 1], sym)
                                 for r in op.results):
                    raise PaddingError(f"padding: unstack takes apart the padded axis {a} (dim "
                                       f"{sym}) of {op.operands[0].type} ({_loc(op)})")
            return operands
        if name in _KEY_DATA:  # keys <-> their data: trailing axes added or removed
            for v, p in zip(op.operands, pads):
                for a, sym in p.items():
                    if a >= min(v.type.rank, len(rshape)) or not _is(rshape[a], sym):
                        raise PaddingError(f"padding: {name} moves the padded axis {a} (dim "
                                           f"{sym}) of {v.type} ({_loc(op)})")
            return operands
        for v, p in zip(op.operands, pads):
            for a, sym in p.items():
                if v.type.rank != len(rshape) or not _is(rshape[a], sym):
                    raise PaddingError(
                        f"padding: {op.name} is not known to be exact over the padded axis "
                        f"{a} (dim {sym}) of its operand {v.type} ({_loc(op)})")
        return operands

    def sort(self, op: Op, sym: str, operands: list[Value], attrs: tuple) -> None:
        """A sort along a padded axis: a first key added, true on the padding, puts every
        real element before every padded one whatever the real keys hold (a NaN sorts
        after +inf, and a multi-key sort's later keys would break a tie between a real
        first key and its fill), then dropped from the results."""
        a = op.attr("dimension")

        def is_pad(v, n):
            return lax.broadcasted_iota(np.int32, v.shape, a) >= n
        key = self.splice(is_pad, (operands[0], self.sizes[sym]), "pad_key", op)
        results = tuple(self.new(r) for r in op.results)
        attrs = tuple((k, v + 1 if k == "num_keys" else v) for k, v in attrs)
        self.ops.append(op.replace(operands=(key, *operands),
                                   results=(Value(key.type), *results), attrs=attrs))

    def linalg(self, op: Op, pads: list[dict[int, str]], operands: list[Value]) -> list[Value]:
        """Linear algebra with a padded axis. Padded batch axes (before the last two) are
        exact: each matrix is its own problem. A padded matrix must be padded on both of
        its axes by one size, and is then set to the identity outside its real block, so
        the matrix is ``blockdiag(A, I)``: a Cholesky or LU factor (partial pivoting never
        picks a padded row: it holds 0 in the real columns), a triangular solve (its
        right-hand side's padding set to 0, which the identity block keeps apart from the
        real rows) and a determinant are those of ``A`` on the real block, whatever the
        padding held.
        Other ops (eigenvalues, QR, SVD, ...) would mix the identity's part into the
        results: an error."""
        x = op.operands[0]
        r = x.type.rank
        mat = {a: s for a, s in pads[0].items() if a >= r - 2}
        if not mat:
            return operands
        syms = set(mat.values())
        if op.name not in LINALG_BLOCK_EXACT or len(mat) != 2 or len(syms) != 1:
            what = ("is not exact over a padded matrix axis" if op.name not in LINALG_BLOCK_EXACT
                    else "needs a square matrix padded on both axes by one size")
            raise PaddingError(
                f"padding: {op.name} {what}: axis {min(mat)} (dim {mat[min(mat)]}) of its "
                f"operand {x.type} is padded; keep that axis static "
                f"(RunOptions(dynamic_dims=...)) ({_loc(op)})")

        def identity_outside(v, n):
            i = lax.broadcasted_iota(np.int32, v.shape, r - 2)
            j = lax.broadcasted_iota(np.int32, v.shape, r - 1)
            return jax.numpy.where((i < n) & (j < n), v, (i == j).astype(v.dtype))
        sym = syms.pop()
        operands[0] = self.splice(identity_outside, (operands[0], self.sizes[sym]),
                                  "pad_identity", op)
        if op.name == "triangular_solve":  # the right-hand side's padding 0 (not NaN: 0 * NaN)
            b = op.operands[1].type.rank - (2 if op.attr("left_side") else 1)
            operands[1] = self.mask(operands[1], b, sym, "0", op)
        return operands

    @staticmethod
    def check_fft(op: Op, pads: dict[int, str]) -> None:
        """An FFT over the last ``len(fft_lengths)`` axes: exact when only the axes before
        them are padded (each row is its own transform, padded rows stay padding; the
        ``rfft`` of a batch of signals); along a padded axis it would transform the
        bucket's length, an error."""
        rank = op.operands[0].type.rank
        along = [a for a in sorted(pads) if a >= rank - len(op.attr("fft_lengths"))]
        if along:
            raise PaddingError(
                f"padding: fft along axis {along[0]} (dynamic dim {pads[along[0]]}) of "
                f"{op.operands[0].type} cannot be made exact (it would transform the "
                f"bucket's length); keep that axis static (RunOptions(dynamic_dims=...)) "
                f"({_loc(op)})")

    @staticmethod
    def cumulative_sym(op: Op, pads: list[dict[int, str]]) -> str | None:
        """The padded dim a ``cumulative_jvp``/``cumulative_vjp`` runs along, or None."""
        a = op.attr("axis")
        return pads[0].get(a) or pads[1].get(a)

    def reverse_cumulative_derivative(self, op: Op, pads: list[dict[int, str]],
                                      operands: list[Value], attrs: tuple) -> None:
        """The derivative of a cumulative op with ``reverse=True`` along a padded axis.
        Masking alone gives the right values, but JAX's derivative is that of an
        associative scan, whose tree depends on where the real elements sit: reversed, the
        padding would come first and shift the tree, and at ties (``cummax`` of equal
        values) the derivative's split among the tied elements would differ from the
        unpadded one. So the masked operands are rolled until the real elements end the
        axis (the padding, now first, ends the reversed scan, as in the forward case), the
        derivative is taken there, and its result is rolled back. ``operands``: already
        masked (:meth:`masked`)."""
        sym, a = self.cumulative_sym(op, pads), op.attr("axis")
        x, t = (self.roll(v, a, sym, True, op) for v in operands)
        res = self.new(op.result)
        mid = Value(res.type)
        self.ops.append(op.replace(operands=(x, t), results=(mid,), attrs=attrs))
        out = self.roll(mid, a, sym, False, op)
        self.env[op.result] = out

    def roll(self, x: Value, axis: int, sym: str, to_end: bool, op: Op) -> Value:
        """``x`` rolled along padded ``axis`` so that its ``n`` real elements end the axis
        (``to_end``), or back to its start: ``concatenate`` and ``dynamic_slice`` ops,
        traced from JAX at the bucket's size."""
        size = int(x.type.shape[axis])

        def fn(v, n):
            start = n if to_end else size - n
            return lax.dynamic_slice_in_dim(lax.concatenate([v, v], axis), start, size, axis)
        return self.splice(fn, (x, self.sizes[sym]), "roll", op)

    def splice(self, fn: Any, args: tuple[Value, ...], name: str, op: Op | None) -> Value:
        """``fn`` of ``args`` (padded values) as ops appended here: traced from JAX at the
        bucket sizes, imported, each op at ``op``'s location; returns its one result."""
        avals = [jax.ShapeDtypeStruct(tuple(v.type.shape), jc.dtype_from_name(v.type.dtype))
                 for v in args]
        g = import_jaxpr(jc.make_jaxpr_from(fn, avals), name)
        env = dict(zip(g.inputs, args))
        for o in g.ops:
            self.ops.append(o.replace(operands=tuple(env.get(v, v) for v in o.operands),
                                      loc=op.loc if op is not None else None))
        return env.get(g.outputs[0], g.outputs[0])

    def pad(self, op: Op, pads: list[dict[int, str]], operands: list[Value]) -> list[Value]:
        """``lax.pad`` (``jnp.pad``) of a padded axis. When nothing is added or taken
        there, nothing to do. Otherwise the padding would land inside the
        result (``pad(x, 0, (0, 16 - t))`` to a static 16: the unpadded result holds the
        pad value from row ``t`` on, the padded one the bucket's padding there), so the
        padding is first set to the pad value: exact when the elements added before the
        real ones (``lo``) do not depend on the size and none go between them
        (``interior`` 0); an error otherwise. The same covers a cut dim (``b - 1``) padded
        back to ``b`` (the gradient of ``lax.slice_in_dim(x, 0, b - 1)``: its padding
        lands on row ``b - 1``, which holds the pad value unpadded), a negative low end
        (``b`` cut to ``b - 1``), and a shift (``(-1, 1)``: the last real row is the pad
        value, not the first padding row)."""
        rshape = op.result.type.shape
        config = op.attr("padding_config")
        for a, sym in pads[0].items():
            if _is(rshape[a], sym) and tuple(config[a]) == (0, 0, 0):
                continue
            lo, _, interior = config[a]
            if _is_dimexpr(lo) or _is_dimexpr(interior) or interior != 0:
                raise PaddingError(
                    f"padding: pad of padded axis {a} (dim {sym}) with padding (low, high, "
                    f"interior) = {tuple(config[a])}: only the high end may depend on the "
                    f"size, and nothing may go between the elements; keep that axis static "
                    f"(RunOptions(dynamic_dims=...)) ({_loc(op)})")

            def fill(v, n, value, a=a):
                idx = lax.broadcasted_iota(np.int32, v.shape, a)
                return jax.numpy.where(idx < n, v, value)
            operands[0] = self.splice(fill, (operands[0], self.sizes[sym], operands[1]),
                                      "pad_fill", op)
        xshape = op.operands[0].type.shape
        for a, d in enumerate(rshape):
            if not isinstance(d, SymDim) and not isinstance(xshape[a], SymDim):
                continue
            lo, hi, interior = (int(_subst_attr(c, self.buckets)) for c in config[a])
            n = self.bucket_of(xshape[a])
            self.check_fits(op, a, lo + hi + n + max(n - 1, 0) * interior, rshape[a])
        return operands

    def bucket_of(self, d: Any) -> int:
        return self.buckets[d.name] if isinstance(d, SymDim) else int(d)

    def check_fits(self, op: Op, axis: int, size: int, d: Any) -> None:
        """The padded op's axis ``axis`` has ``size`` elements where its result's type
        says ``d``: they differ only where a dim cut from a symbol has a bucket clamped at
        0 and the op adds the elements back (never from JAX's own shapes, which keep them
        equal at every size): an error rather than a program XLA would refuse."""
        if size != self.bucket_of(d):
            raise PaddingError(
                f"padding: {op.name} makes axis {axis} of {op.results[0].type} {size} long at "
                f"the buckets {self.buckets}, not {self.bucket_of(d)}; keep that dim static "
                f"(RunOptions(dynamic_dims=...)) ({_loc(op)})")

    # -- dims cut from a padded symbol (``x[1:]``: ``b - 1``) -------------------------------
    def slice(self, op: Op, x_pad: dict[int, str], attrs: tuple) -> tuple:
        """``lax.slice`` along padded axes. Keeping the whole axis (start 0, stride 1) is
        exact as it is. Cutting it to a dim of the same symbol with ``c`` elements fewer
        (``slice_in_dim(x, 1, b)``: ``b - 1``) takes rows ``k..`` from a constant start
        ``k <= c`` with stride 1, so the real rows come first and the padding after:
        the bucket's slice is the same rows, ``bucket(b) - c`` long. A static slice of
        constant bounds is real rows (JAX proved them in range). Anything else (a
        stride, a start or bound that depends on the size) is an error."""
        start = list(op.attr("start_indices"))
        limit = list(op.attr("limit_indices"))
        strides = op.attr("strides") or (1,) * len(start)
        rshape = op.result.type.shape
        new_start, new_limit = list(_subst_attr(tuple(start), self.buckets)), \
            list(_subst_attr(tuple(limit), self.buckets))
        for a, sym in x_pad.items():
            r, k, st = rshape[a], start[a], strides[a]
            if isinstance(r, SymDim):
                gap = 0 if r.name == sym else self.shorter(r.name, sym)
                ok = gap is not None and not _is_dimexpr(k) and st == 1 and 0 <= int(k) <= gap
                if ok:
                    k0 = min(int(k), self.buckets[sym] - self.buckets[r.name])
                    new_start[a], new_limit[a] = k0, k0 + self.buckets[r.name]
                    continue
            elif not _is_dimexpr(k) and not _is_dimexpr(limit[a]):
                continue
            raise PaddingError(
                f"padding: slice of padded axis {a} (dim {self.text(sym)}) from {k} to "
                f"{limit[a]} by {st} gives {getattr(r, 'expr', None) or r}: only a constant "
                f"start, stride 1 and the end of the axis, or a constant number of elements "
                f"short of it, keep the real elements first (x[1:], x[:-1]); keep that axis "
                f"static (RunOptions(dynamic_dims=...)) ({_loc(op)})")
        return tuple((key, tuple(new_start) if key == "start_indices" else
                      tuple(new_limit) if key == "limit_indices" else v) for key, v in attrs)

    def check_concatenate(self, op: Op, pads: list[dict[int, str]]) -> None:
        """A concatenation along a padded axis keeps the real elements first only when the
        one padded operand there comes last, after static ones (``[x[:1], x[1:]]``, the
        transpose of a split); anywhere else its padding would land between real
        elements: an error."""
        k = op.attr("dimension")
        along = [i for i, p in enumerate(pads) if k in p]
        if not along:
            return
        last = len(op.operands) - 1
        r = op.result.type.shape[k]
        if along != [last] or not isinstance(r, SymDim):
            i = along[0] if along[0] != last else along[-1]
            raise PaddingError(
                f"padding: concatenate puts operand {i} ({op.operands[i].type}), padded along "
                f"axis {k} (dim {self.text(pads[i][k])}), before other elements of that "
                f"axis: its padding would land between real elements; only the last operand "
                f"may be padded there; keep that axis static (RunOptions(dynamic_dims=...)) "
                f"({_loc(op)})")
        static = sum(int(v.type.shape[k]) for v in op.operands[:-1])
        fam = self.family[pads[last][k]]
        if self.family.get(r.name) != (fam[0], fam[1] - static):
            raise PaddingError(f"padding: concatenate of {static} elements and dim "
                               f"{self.text(pads[last][k])} gives {r.expr or r.name} "
                               f"({_loc(op)})")
        self.check_fits(op, k, static + self.buckets[pads[last][k]], r)

    def check_split_parts(self, op: Op, x_pad: dict[int, str]) -> None:
        """``split`` along a padded axis: static parts first, then one part as long as the
        rest of the axis (``jnp.split(x, [1])``: ``1`` and ``b - 1``), which starts at a
        constant and ends where the axis does, so its real elements come first; a padded
        part before another would end inside the padding: an error."""
        a = op.attr("axis")
        if a not in x_pad:
            return
        dims = [r.type.shape[a] for r in op.results]
        static = dims[:-1]
        last = dims[-1]
        fam = self.family[x_pad[a]]
        if any(isinstance(d, SymDim) for d in static) or not isinstance(last, SymDim) or \
                self.family.get(last.name) != (fam[0], fam[1] + sum(static)):
            parts = [d.expr or d.name if isinstance(d, SymDim) else d for d in dims]
            raise PaddingError(
                f"padding: split of padded axis {a} (dim {self.text(x_pad[a])}) into parts "
                f"{parts}: only the last part may depend on the size (the others would end "
                f"inside the padding); keep that axis static (RunOptions(dynamic_dims=...)) "
                f"({_loc(op)})")
        self.check_fits(op, a, sum(static) + self.buckets[last.name],
                        op.operands[0].type.shape[a])

    def conv(self, op: Op, pads: list[dict[int, str]], operands: list[Value]) -> list[Value]:
        """A convolution over padded dims. Exact: the batch dim of the input (rows never
        mixed: the padded rows of the result are padding; also in a grouped or depthwise
        convolution, whose groups split the features, not the batch), the output features
        of an ungrouped kernel, and the input features contracted with the kernel's input
        features (both masked to 0, as ``dot_general``'s contraction: this is the kernel
        gradient, whose contraction runs over the batch; JAX writes a grouped kernel's
        gradient with ``batch_group_count``, which groups the other, unpadded, dim). A
        padded spatial dim would slide the window over the padding, and a padded dim that
        the groups split (``batch_group_count`` over the batch, ``feature_group_count`` over
        the features) would shift the groups: errors."""
        lhs_spec, rhs_spec, _ = op.attr("dimension_numbers")
        fgc, bgc = op.attr("feature_group_count") or 1, op.attr("batch_group_count") or 1
        lp, rp = pads[0], pads[1]
        ok_l = {lhs_spec[0]} if bgc == 1 else set()
        ok_r = {rhs_spec[0]} if (fgc, bgc) == (1, 1) else set()
        if fgc == 1:
            ok_l.add(lhs_spec[1])
            ok_r.add(rhs_spec[1])
        bad = [(0, a, sym) for a, sym in lp.items() if a not in ok_l] + \
              [(1, a, sym) for a, sym in rp.items() if a not in ok_r]
        if bad:
            i, a, sym = bad[0]
            spec = (lhs_spec, rhs_spec)[i]
            if a in spec[:2]:
                what = (f"a dim that its groups split (feature_group_count={fgc}, "
                        f"batch_group_count={bgc})")
                why = "the padding would shift the groups"
            else:
                what, why = "a window (spatial) dim", "the window would run over the padding"
            raise PaddingError(
                f"padding: conv_general_dilated over {what}: axis {a} (dim {sym}) of its "
                f"{'input' if i == 0 else 'kernel'} {op.operands[i].type} is padded, and "
                f"{why}; keep that dim static "
                f"(RunOptions(dynamic_dims=...)) ({_loc(op)})")
        contracted = lp.get(lhs_spec[1]) or rp.get(rhs_spec[1])
        if contracted:
            operands[0] = self.mask(operands[0], lhs_spec[1], contracted, "0", op)
            operands[1] = self.mask(operands[1], rhs_spec[1], contracted, "0", op)
        return operands

    def check_window_op(self, op: Op, pads: list[dict[int, str]]) -> None:
        """A window op slides along no padded axis: window 1, stride 1, no padding or
        dilation there (pooling over the spatial dims of a padded batch)."""
        dims = op.attr("window_dimensions")
        one = {"window_dimensions": 1, "window_strides": 1, "base_dilation": 1,
               "window_dilation": 1}
        for p in pads:
            for a, sym in p.items():
                ok = dims is not None and a < len(dims) and all(
                    (op.attr(k) is None or op.attr(k)[a] == v) for k, v in one.items())
                pad = op.attr("padding")
                ok = ok and (pad is None or tuple(pad[a]) == (0, 0))
                if not ok:
                    raise PaddingError(
                        f"padding: {op.name} slides a window along the padded (dynamic) axis "
                        f"{a} (dim {sym}), so the window would run over the padding; keep "
                        f"that axis static (RunOptions(dynamic_dims=...)) ({_loc(op)})")

    def check_split(self, op: Op, pads: dict[int, str]) -> None:
        """A split over logical devices of a padded axis: its bucket must divide by the
        number of tiles (XLA cannot tile it otherwise)."""
        s = op.attr("sharding")
        tiles = getattr(s, "tile_dims", None)
        if getattr(s, "kind", None) != "tiled" or not tiles:
            return
        for axis, sym in pads.items():
            t = tiles[axis] if axis < len(tiles) else 1
            if t > 1 and self.buckets[sym] % t:
                raise PaddingError(
                    f"padding: split_to_logical_devices splits padded axis {axis} (dim {sym}) "
                    f"{t} ways, but its bucket {self.buckets[sym]} is not divisible by {t}; "
                    f"give buckets that are (RunOptions(bucketing=...): a list of multiples "
                    f"of {t}, or 'pow2' / 'auto', which round up to a multiple of "
                    f"logical_devices; and a maximum_shapes bound for dim {sym} that is one "
                    f"too) ({_loc(op)})")

    def check_reshape(self, op: Op, pads: dict[int, str]) -> None:
        """A reshape keeps each padded axis whole and where it was: the dims before it
        multiply to the same size on both sides (a padded dim there on both sides too:
        ``[b, t] -> [b, t, 1]`` with two dynamic dims)."""
        src, dst = op.operands[0].type.shape, op.result.type.shape

        def prefix(dims: tuple) -> tuple[int, list[str]]:
            static = [d for d in dims if not isinstance(d, SymDim)]
            return (int(np.prod(static, dtype=np.int64)),
                    sorted(d.name for d in dims if isinstance(d, SymDim)))
        for a, sym in pads.items():
            j = next((i for i, d in enumerate(dst) if _is(d, sym)), None)
            if j is None or prefix(src[:a]) != prefix(dst[:j]):
                raise PaddingError(f"padding: reshape {op.operands[0].type} -> "
                                   f"{op.result.type} moves the padded axis {a} (dim {sym}) "
                                   f"({_loc(op)})")


    # -- indexing into padded axes (INDEX_RULES) --------------------------------------------
    def pad_index(self, idx: Value, component: int, size: int, mode: str, oob: int,
                  sym: str, op: Op) -> Value:
        """``idx`` (component ``component`` of its last axis, or the scalar itself when -1)
        rewritten against the real size of ``sym``: see ``_pad_index``."""
        t = idx.type
        out = Value(TensorType(t.shape, t.dtype, Replica.VARYING, t.sharding, t.weak_type))
        self.ops.append(Op("pad_index", (idx, self.sizes[sym]), (out,),
                           (("component", component), ("size", size), ("mode", mode),
                            ("oob", oob)), op.loc))
        return out

    def indexed(self, op: Op, pads: list[dict[int, str]], operands: list[Value]) -> list[Value]:
        """Indices into padded axes of ``op``'s first operand behave as they would against
        the real sizes; padded scatter update rows are dropped."""
        name, x_pad = op.name, pads[0]
        bucket = lambda a: self.buckets[x_pad[a]]  # noqa: E731
        if name == "dynamic_slice" or name == "dynamic_update_slice":
            first = 1 if name == "dynamic_slice" else 2
            for a, sym in x_pad.items():
                size = (op.attr("slice_sizes")[a] if name == "dynamic_slice"
                        else op.operands[1].type.shape[a])
                if not isinstance(size, (int, np.integer)):
                    if name == "dynamic_slice":
                        self.check_cut_window(op, a, sym, size)
                    continue  # (XLA clamps the start as it would unpadded)
                i = first + a
                operands[i] = self.pad_index(operands[i], -1, int(size), "clip", 0, sym, op)
            if name == "dynamic_update_slice":
                upd_pad = dict(pads[1])
                cut = {a: r for a, r in pads[1].items()
                       if self.shorter(r, x_pad.get(a)) is not None}
                if cut:
                    operands[1] = self.merged_under(op, cut, operands)
                    for a in cut:
                        del upd_pad[a]
                self.check_window(op, op.operands[1].type, upd_pad,
                                  {a: a for a in range(op.operands[1].type.rank)}, x_pad)
            return operands
        dn = _live(op, "dimension_numbers")
        mode = getattr(_live(op, "mode"), "name", None)
        if name == "gather":
            sizes = op.attr("slice_sizes")
            for a in x_pad:
                if not isinstance(sizes[a], (int, np.integer)):
                    self.check_cut_window(op, a, x_pad[a], sizes[a])
            for j, a in enumerate(dn.start_index_map):
                if a not in x_pad or not isinstance(sizes[a], (int, np.integer)):
                    continue
                operands[1] = self.pad_index(operands[1], j, int(sizes[a]),
                                             self.index_mode(op, mode, a, x_pad[a]), bucket(a),
                                             x_pad[a], op)
            return operands
        # scatter family: operand, indices, updates
        upd_t, idx_t = op.operands[2].type, op.operands[1].type
        window = [a for a in range(op.operands[0].type.rank)
                  if a not in dn.inserted_window_dims and a not in dn.operand_batching_dims]
        size_of = {a: upd_t.shape[d] for a, d in zip(window, dn.update_window_dims)}
        to_operand = {d: a for a, d in zip(window, dn.update_window_dims)}
        upd_pad = dict(pads[2])
        for d, sym in pads[2].items():
            if self.window_onto_static(op, d, to_operand.get(d), sym, x_pad):
                operands[2] = self.mask(operands[2], d, sym, _SCATTER_IDENTITY[name], op)
                del upd_pad[d]
            elif self.shorter(sym, x_pad.get(to_operand.get(d))) is not None:
                self.cut_window_onto_padded(op, d, to_operand[d], sym, x_pad, operands)
                del upd_pad[d]
        self.check_window(op, upd_t, upd_pad, to_operand, x_pad)
        for j, a in enumerate(dn.scatter_dims_to_operand_dims):
            if a not in x_pad or not isinstance(size_of.get(a, 1), (int, np.integer)):
                continue
            kind = self.index_mode(op, mode, a, x_pad[a])
            operands[1] = self.pad_index(operands[1], j, int(size_of.get(a, 1)), kind,
                                         bucket(a), x_pad[a], op)
        # update rows that are padding: their indices go past the operand, so XLA drops them
        rows = {a: sym for a, sym in pads[1].items() if a != idx_t.rank - 1}
        # a padded row along a batching dim scatters into the operand's batch of that
        # index, a padded one where that axis is padded alike (vmap's scatters: the
        # gradient of a per-example ``dynamic_slice``): padding onto padding
        for ia, oa in zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims):
            if ia in rows and x_pad.get(oa) == rows[ia]:
                del rows[ia]
        if rows:
            if mode == "CLIP":
                raise PaddingError(
                    f"padding: {name} in mode 'clip' scatters padded update rows (dim "
                    f"{sorted(set(rows.values()))}); clip cannot drop them, so they would land "
                    f"on real elements: use mode='drop' (where the scatter is JAX's gradient "
                    f"of a clip-mode gather or take there, index with mode='fill'), or keep "
                    f"that axis static (RunOptions(dynamic_dims=...)) ({_loc(op)})")
            a0 = dn.scatter_dims_to_operand_dims[0]
            past = int(operands[0].type.shape[a0])
            for a, sym in rows.items():
                operands[1] = self.mask(operands[1], a, sym, str(past), op)
        return operands

    def check_cut_window(self, op: Op, a: int, sym: str, size: Any) -> None:
        """A ``gather``/``dynamic_slice`` window along padded axis ``a`` (dim ``sym``) as
        long as a dim: the whole axis (its start clamps to 0, padded or not), or a dim cut
        from the same symbol with ``c`` elements fewer (``x[1:]``: ``b - 1`` from ``b``).
        XLA clamps the start of the cut window to ``[0, c]`` unpadded and padded alike
        (the bucket is ``c`` longer than the window too), and ``fill`` mode fills out of
        that same range, so the window takes the same real rows and its real elements
        come first; a window whose bucket is clamped at 0 holds no real element. Any
        other dim is an error."""
        r = self.dim_sym(size)
        if r == sym or self.shorter(r, sym) is not None:
            return
        raise PaddingError(
            f"padding: {op.name} takes a window of {size} along padded axis {a} (dim "
            f"{self.text(sym)}): "
            f"only the whole axis or a constant number of elements fewer keep the real "
            f"elements first; keep that axis static (RunOptions(dynamic_dims=...)) "
            f"({_loc(op)})")

    def cut_window_onto_padded(self, op: Op, d: int, a: int, sym: str, x_pad: dict[int, str],
                               operands: list[Value]) -> None:
        """A scatter of an update whose axis ``d`` is cut from the symbol of the operand's
        padded axis ``a`` (the gradient of ``x[:-1]``: a ``b - 1`` cotangent added into a
        ``b``-row zero buffer at row 0): the update's padding would land on real rows of
        the operand. Out of range (dropped, or clamped in ``clip`` mode) exactly when the
        real window would be, since the bucket is ``c`` longer than the window as the real
        size is. A combining scatter has the update's padding set to its identity, so it
        adds nothing there; a plain scatter (``.at[].set``) is exact only when every window
        starts at the constant ``c``, where the padding lands on the operand's padding;
        otherwise it is an error."""
        gap = self.shorter(sym, x_pad[a])
        if op.name in _SCATTER_IDENTITY:
            operands[2] = self.mask(operands[2], d, sym, _SCATTER_IDENTITY[op.name], op)
            return
        dn = _live(op, "dimension_numbers")
        starts = np.zeros((1,), np.int64)
        if a in dn.scatter_dims_to_operand_dims:
            known = _constant(op.operands[1], self.producers)
            starts = None if known is None else known[..., dn.scatter_dims_to_operand_dims.index(a)]
        if starts is None or not starts.size or (starts != gap).any():
            raise PaddingError(
                f"padding: {op.name} writes an update of type {op.operands[2].type} whose axis "
                f"{d} (dim {self.text(sym)}) is {gap} shorter than axis {a} (dim "
                f"{self.text(x_pad[a])}) of "
                f"{op.operands[0].type}, at a start that is not the constant {gap}: its "
                f"padding would overwrite real elements (x.at[:-1].set(y)); write from "
                f"row {gap} (x.at[{gap}:].set(y)), add instead (.at[].add), or keep that "
                f"axis static (RunOptions(dynamic_dims=...)) ({_loc(op)})")

    def merged_under(self, op: Op, cut: dict[int, str], operands: list[Value]) -> Value:
        """The update of a ``dynamic_update_slice`` whose axes ``cut`` are shorter than the
        operand's padded ones of the same symbol (the gradient of a cut
        ``dynamic_slice``): its padding would overwrite real rows, so it is replaced by
        what the operand holds there (read at the start XLA clamps both ops to), and the
        write leaves those rows as they were, as the real update does."""
        rank = op.operands[0].type.rank
        axes = sorted(cut)

        def fn(x, u, *rest):
            starts, ns = list(rest[:rank]), rest[rank:]
            under = lax.dynamic_slice(x, starts, u.shape)
            keep = None
            for a, n in zip(axes, ns):
                inside = lax.broadcasted_iota(np.int32, u.shape, a) < n
                keep = inside if keep is None else keep & inside
            return jax.numpy.where(keep, u, under)
        sizes = tuple(self.sizes[cut[a]] for a in axes)
        return self.splice(fn, (operands[0], operands[1], *operands[2:], *sizes),
                           "merged_under", op)

    def sized_slice(self, op: Op, pads: list[dict[int, str]], operands: list[Value]) -> list[Value]:
        """A ``dynamic_slice``/``gather`` whose slice is as long as a padded dim along an
        axis of its operand that is not padded (``dynamic_slice(table, i, t)``): XLA
        clamps the start so that the slice fits, and a slice of the bucket's length
        clamps where one of the real length would not (start 10, real length 5, bucket 8
        of a 16-row table: rows 8.. instead of 10..). So the start is clamped (or, in
        ``fill`` mode, sent out of range) against the real length, and the operand padded
        by a bucket along that axis so that XLA's own clamp never moves it; skipped when
        the start is a constant that fits the bucket (``wpe[:t]``, start 0)."""
        x_pad = pads[0] if pads else {}
        sizes = op.attr("slice_sizes")
        if op.name == "dynamic_slice":
            axes = [(a, 1 + a) for a in range(len(sizes))]
            mode = "clip"
        else:
            dn = _live(op, "dimension_numbers")
            axes = [(a, j) for j, a in enumerate(dn.start_index_map)]
            mode = None
        dims = op.operands[0].type.shape
        for a, where in axes:
            size = sizes[a]
            sym = self.dim_sym(size)
            if sym is None or a in x_pad:
                continue
            dim, bucket = int(dims[a]), self.buckets[sym]
            if op.name == "gather":
                mode = self.index_mode(op, getattr(_live(op, "mode"), "name", None), a, sym)
            start = op.operands[where] if op.name == "dynamic_slice" else op.operands[1]
            known = _constant(start, self.producers)
            if known is not None:
                c = known if op.name == "dynamic_slice" else known[..., where]
                if c.size and c.min() >= 0 and c.max() + bucket <= dim:
                    continue  # (the slice fits: nothing to clamp)

            def fix(i, n, j=(None if op.name == "dynamic_slice" else where)):
                c = i if j is None else i[..., j]
                if mode == "clip":
                    new = _clamped_start(c, dim, n)
                else:
                    past = jax.numpy.asarray(dim + bucket, c.dtype)  # (out of range: fills)
                    new = jax.numpy.where((c < 0) | (c > (dim - n).astype(c.dtype)), past, c)
                return new if j is None else i.at[..., j].set(new)
            k = where if op.name == "dynamic_slice" else 1
            operands[k] = self.splice(fix, (operands[k], self.sizes[sym]), "sized_slice", op)
            operands[0] = self.splice(lambda x, a=a, b=bucket: _grown(x, {a: b}),
                                      (operands[0],), "sized_slice", op)
        return operands

    def update_onto_static(self, op: Op, upd_pad: dict[int, str], operands: list[Value]) -> None:
        """``dynamic_update_slice`` of an update with padded axes into an operand without
        any (a sequence of length ``t`` written into a fixed buffer, and the gradient of
        ``dynamic_slice(table, i, t)``): the update's padding would overwrite real
        elements, and XLA would clamp the start for the bucket's length. So the operand is
        padded by a bucket along those axes, the start clamped against the real length as
        XLA clamps it unpadded, the elements under the padding read back and kept (the
        update's real part merged over them), and the result sliced back: only the real
        update is written, where it would be unpadded."""
        rank = op.operands[0].type.rank
        axes = sorted(upd_pad)
        dims = [self.buckets[d.name] if isinstance(d, SymDim) else int(d)
                for d in op.operands[0].type.shape]
        buckets = {a: self.buckets[upd_pad[a]] for a in axes}

        def fn(x, u, *rest):
            starts, ns = list(rest[:rank]), rest[rank:]
            grown = _grown(x, buckets)
            keep = None
            for a, n in zip(axes, ns):
                starts[a] = _clamped_start(starts[a], dims[a], n)
                inside = lax.broadcasted_iota(np.int32, u.shape, a) < n
                keep = inside if keep is None else keep & inside
            under = lax.dynamic_slice(grown, starts, u.shape)
            merged = jax.numpy.where(keep, u, under)
            out = lax.dynamic_update_slice(grown, merged, starts)
            return lax.slice(out, (0,) * rank, tuple(dims))
        sizes = tuple(self.sizes[upd_pad[a]] for a in axes)
        self.env[op.result] = self.splice(fn, (operands[0], operands[1], *operands[2:], *sizes),
                                          "update_onto_static", op)

    def index_mode(self, op: Op, mode: str | None, axis: int, sym: str) -> str:
        """``clip`` or ``drop``: what an out-of-range index into padded ``axis`` does."""
        if mode in ("CLIP", "PROMISE_IN_BOUNDS") and op.name == "gather":
            return "clip"  # XLA's gather clamps the start indices
        if mode == "CLIP":
            return "clip"
        if mode in ("FILL_OR_DROP", "PROMISE_IN_BOUNDS"):
            return "drop"  # gather fills; XLA's scatter skips out-of-bounds updates
        raise PaddingError(f"padding: {op.name} in mode {mode} indexes padded axis {axis} "
                           f"(dim {sym}), which padding cannot make exact ({_loc(op)})")

    def window_onto_static(self, op: Op, d: int, a: int | None, sym: str,
                           x_pad: dict[int, str]) -> bool:
        """Can a scatter that combines (add, mul, min, max) take the update's padded window
        axis ``d`` onto the operand's unpadded axis ``a`` (the gradient of ``wpe[:t]``:
        the position gradient added into the table)? Yes when every window starts at a
        constant from which the bucket's length fits: the padding then lands on real
        elements, but masked to the combiner's identity it changes nothing there, and the
        window is in range exactly when the real one is. Otherwise :meth:`check_window`
        refuses it."""
        if a is None or x_pad.get(a) == sym or op.name not in _SCATTER_IDENTITY:
            return False
        dim = op.operands[0].type.shape[a]
        if not isinstance(dim, (int, np.integer)):
            return False
        dn = _live(op, "dimension_numbers")
        starts = np.zeros((1,), np.int64)  # (an axis no index points into: the window starts at 0)
        if a in dn.scatter_dims_to_operand_dims:
            known = _constant(op.operands[1], self.producers)
            if known is None or not known.size:
                return False
            starts = known[..., dn.scatter_dims_to_operand_dims.index(a)]
        return bool(starts.min() >= 0 and starts.max() + self.buckets[sym] <= int(dim))

    def check_window(self, op: Op, upd: TensorType, upd_pad: dict[int, str],
                     to_operand: dict[int, int], x_pad: dict[int, str]) -> None:
        """An update window's padded axis must land on the same padded axis of the operand
        (then its padding covers only padding); elsewhere it would overwrite real elements."""
        for d, sym in upd_pad.items():
            a = to_operand.get(d)
            if a is None:
                continue  # a scatter dim: rows, handled by dropping
            if x_pad.get(a) != sym:
                raise PaddingError(
                    f"padding: {op.name} writes an update of type {upd} whose padded axis {d} "
                    f"(dim {sym}) lands on axis {a} of {op.operands[0].type}, which is not "
                    f"padded the same way: its padding would overwrite real elements "
                    f"({_loc(op)})")


def _live(op: Op, key: str) -> Any:
    """An attribute's live JAX object (``Opaque`` unwrapped); a graph parsed from text
    does not have it."""
    v = op.attr(key)
    if isinstance(v, Opaque):
        if v.obj is None:
            raise PaddingError(f"padding: {op.name} attribute {key}=<{v.text}> was parsed from "
                               f"text; pad a traced graph instead ({_loc(op)})")
        return v.obj
    return v


# -- lowering of the ops this pass adds --------------------------------------------------

def _fill(kind: str, dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if kind == "ones":  # every bit set: the identity of a bitwise and
        return np.asarray(-1).astype(dtype) if dtype != np.bool_ else np.asarray(True)
    if kind.isdigit():  # "0", "1", or an index past the end (pad_mask of scatter indices)
        return np.asarray(int(kind), dtype)
    high = kind in ("+inf", "highest")
    if dtype == np.bool_:
        return np.asarray(high)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.asarray(info.max if high else info.min, dtype)
    if kind in ("lowest", "highest"):  # finite
        info = np.finfo(dtype)
        return np.asarray(info.max if high else info.min, dtype)
    return np.asarray(np.inf if high else -np.inf, dtype)


@rule("pad_mask")
def _pad_mask(op: Op, args: list[Any]) -> list[Any]:
    x, n = args
    axis = op.attr("axis")
    idx = lax.broadcasted_iota(np.int32, x.shape, axis)
    return [jax.numpy.where(idx < n, x, _fill(op.attr("fill"), x.dtype))]


@rule("dim_value")
def _dim_value(op: Op, args: list[Any]) -> list[Any]:
    env = dict(zip(op.attr("vars"), args))
    return [jax.numpy.asarray(jc.evaluate_dim(op.attr("dim"), env), np.int32)]


@rule("pad_index")
def _pad_index(op: Op, args: list[Any]) -> list[Any]:
    """Component ``component`` of ``idx``'s last axis (or ``idx`` when -1), an index into a
    padded axis with a window of ``size``, behaving as against the real size ``n``:
    ``clip`` clamps it to ``[0, n - size]``; ``drop`` maps one outside that range to
    ``oob`` (the bucket: out of range of the padded axis too)."""
    idx, n = args
    j, size, oob = op.attr("component"), op.attr("size"), op.attr("oob")
    c = idx if j < 0 else idx[..., j]
    hi = (n - size).astype(c.dtype)
    if op.attr("mode") == "clip":
        new = jax.numpy.maximum(jax.numpy.minimum(c, hi), 0).astype(c.dtype)
    else:
        new = jax.numpy.where((c < 0) | (c > hi), jax.numpy.asarray(oob, c.dtype), c)
    return [new if j < 0 else idx.at[..., j].set(new)]
