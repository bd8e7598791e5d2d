"""Every use of JAX internals lives here, so a JAX upgrade touches one file.

Supports jax 0.10.x and 0.11.x. The differences this module hides (see JAX's CHANGELOG):

- 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (consts attached to the jaxpr):
  :func:`is_jaxpr`, :func:`jaxpr_parts`, :func:`is_closed_jaxpr_param`.
- 0.11's ``scan`` has FlatTree params ``ft_in``/``ft_out`` instead of ``num_consts``/
  ``num_carry``: :func:`import_params` gives the IR 0.10's spelling on both versions and
  :func:`bind_params` turns it back into what the installed JAX binds.
- 0.11 renamed ``closed_call``/``call`` to ``eval_jaxpr``: :data:`CALL_PRIMITIVES`.
- ``jit``'s ``inline`` param is a ``jax.Inline`` enum on 0.11 (a bool before), and
  ``shard_map``'s ``manual_axes`` is ``newly_manual_axes`` from 0.10.2 on; nothing here
  reads either (they stay opaque attributes)."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import sys
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import source_info_util as _siu
from jax._src.interpreters import partial_eval as _pe
from jax._src.lib import xla_client as _xc

#: the installed JAX as (major, minor, patch)
JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3] if x.isdigit())

Literal = _core.Literal
ClosedJaxpr = _core.ClosedJaxpr  # jax >= 0.11: an alias of Jaxpr
Jaxpr = _core.Jaxpr
Primitive = _core.Primitive
ShapedArray = _core.ShapedArray
DropVar = _core.DropVar
#: the dtype of the tangent of an integer input (``jax.grad(..., allow_int=True)``)
FLOAT0 = _dtypes.float0

# -- jaxprs as primitive parameters ----------------------------------------------------
# jax 0.11 merged ClosedJaxpr into Jaxpr: every jaxpr may carry consts, and the type no
# longer says whether a primitive takes its parameter closed (consts bound with it) or
# open (no consts: remat2, shard_map). These are the open ones, as jax 0.10 types them.
_MERGED_JAXPR = ClosedJaxpr is Jaxpr
_OPEN_JAXPR_PARAMS = frozenset({
    ("remat2", "jaxpr"), ("checkpoint", "jaxpr"), ("shard_map", "jaxpr"),
    ("run_state", "jaxpr"), ("core_call", "call_jaxpr"), ("call", "call_jaxpr"),
    ("xla_pmap", "call_jaxpr")})

#: names JAX has given its generic call primitive (``core.closed_call``/``core.call``;
#: ``eval_jaxpr`` from jax 0.11 on): region 0 takes the operands and gives the results
CALL_PRIMITIVES = frozenset({"closed_call", "core_call", "call", "eval_jaxpr"})


def is_jaxpr(v: Any) -> bool:
    """A jaxpr (closed or open) used as a primitive parameter."""
    return isinstance(v, (ClosedJaxpr, Jaxpr))


def is_closed_jaxpr_param(primitive: str, param: str, v: Any) -> bool:
    """Whether primitive ``primitive`` takes its jaxpr-valued parameter ``param`` closed
    (consts bound with it) rather than open, the same answer on jax 0.10 and 0.11."""
    if not _MERGED_JAXPR:
        return isinstance(v, ClosedJaxpr)
    return (primitive, param) not in _OPEN_JAXPR_PARAMS


def jaxpr_parts(v: Any) -> tuple[Any, list[Any]]:
    """``(jaxpr, consts)``: the jaxpr's ``constvars`` take ``consts``, its ``invars`` the
    operands (``consts`` is empty for an open jaxpr)."""
    if _MERGED_JAXPR:  # jax >= 0.11 (whose legacy ``.jaxpr`` accessor is to be removed)
        return v, list(v.consts)
    if isinstance(v, ClosedJaxpr):
        return v.jaxpr, list(v.consts)
    return v, []


# -- primitive parameters that changed spelling ------------------------------------------
_SCAN_HAS_FLATTREES = JAX_VERSION >= (0, 11)


def import_params(primitive: str, params: dict[str, Any]) -> list[tuple[str, Any]]:
    """A primitive's parameters as the IR keeps them, spelled as in jax 0.10 whichever
    JAX traced them, so the IR (and its text) does not depend on the JAX version.

    jax 0.11's ``scan`` has ``ft_in``/``ft_out`` (FlatTrees of (consts, carry, xs) and
    (carry, ys)) where 0.10 has ``num_consts``/``num_carry``; :func:`bind_params` is the
    inverse."""
    items = list(params.items())
    if primitive == "scan" and "ft_in" in params:
        nc, ncarry, _ = (len(g) for g in params["ft_in"].unpack())
        out: list[tuple[str, Any]] = []
        for k, v in items:
            if k == "ft_in":
                out += [("num_consts", nc), ("num_carry", ncarry)]
            elif k != "ft_out":
                out.append((k, v))
        return out
    return items


def _scan_flattrees(num_args: int, num_outs: int, nc: int, ncarry: int) -> dict[str, Any]:
    from jax._src import flattree as ft
    return {"ft_in": ft.pack((ft.nones(nc), ft.nones(ncarry), ft.nones(num_args - nc - ncarry))),
            "ft_out": ft.pack((ft.nones(ncarry), ft.nones(num_outs - ncarry)))}


def bind_params(primitive: str, params: dict[str, Any], num_args: int) -> dict[str, Any]:
    """The parameters to bind ``primitive`` with on the installed JAX, from the IR's
    (:func:`import_params`) spelling; ``num_args`` is the number of operands."""
    if primitive == "scan" and _SCAN_HAS_FLATTREES and "num_consts" in params:
        params = dict(params)
        nc, ncarry = params.pop("num_consts"), params.pop("num_carry")
        num_outs = len(jaxpr_parts(params["jaxpr"])[0].outvars)
        params.update(_scan_flattrees(num_args, num_outs, nc, ncarry))
    return params


def _binds_by_default(prim: Any) -> bool:
    """Does ``prim``'s class keep ``Primitive.bind``, ``bind_with_trace`` and ``is_high``
    (``bind`` ends in the trace's ``process_primitive``; only low types)?"""
    cls = type(prim)
    return (cls.bind is _core.Primitive.bind
            and cls.bind_with_trace is _core.Primitive.bind_with_trace
            and cls.is_high is _core.Primitive.is_high)


def _plain_primitive(prim: Any) -> bool:
    """Does ``prim`` bind the default way, with no staging rule of its own?"""
    return _binds_by_default(prim) and prim not in _pe.custom_staging_rules


def bind(prim: Any, args: Sequence[Any], params: dict[str, Any]) -> Any:
    """``prim.bind(*args, **params)``; staged straight into the jaxpr being traced
    (:func:`stage`) when that is what ``bind`` would end in, which skips ``bind``'s
    per-argument canonicalisation and type look-ups, ~half its cost."""
    out = stage(prim, args, params, _siu.current())
    if out is None:
        return prim.bind(*args, **params)
    return out if prim.multiple_results else out[0]


def stage(prim: Any, args: Sequence[Any], params: dict[str, Any],
          source_info: Any) -> list[Any] | None:
    """Stage ``prim`` applied to ``args`` into the jaxpr being traced, with the given
    source info, as ``prim.bind`` would end in: ``default_process_primitive`` (JAX's own
    abstract evaluation, effects, constant folding and forwarding). ``bind`` gets there
    only after canonicalising every argument, and needs the source info (name scope,
    traceback) set up around it; the second trace stages every op of the step. A NumPy
    argument becomes the constant ``bind`` makes of it. Returns the results as a list,
    or ``None`` (nothing staged) unless the trace is a jaxpr trace, at least one argument
    a tracer of it and every other one a NumPy array (no tracer at all: ``bind`` may
    fold eagerly), and ``prim`` staged the default way (:func:`_stages_by_default`)."""
    trace = _core.trace_ctx.trace
    default = _DEFAULT_STAGING.get(prim)
    if default is None:
        default = _DEFAULT_STAGING[prim] = _stages_by_default(prim)
    if not default or type(trace) is not _pe.DynamicJaxprTrace:
        return None
    traced = arrays = False
    for a in args:
        if type(a) is _pe.DynamicJaxprTracer and a._trace is trace:
            traced = True
        elif type(a) is np.ndarray:
            arrays = True
        else:
            return None
    if not traced:
        return None
    tracers = _with_constants(trace, args, source_info) if arrays else list(args)
    out = trace.default_process_primitive(prim, tracers, params, source_info)
    return out if prim.multiple_results else [out]


def _with_constants(trace: Any, args: Sequence[Any], source_info: Any) -> list[Any]:
    """``args`` with each NumPy array made a constant of ``trace``, as ``bind`` makes it."""
    return [a if type(a) is not np.ndarray
            else trace.new_const(_dtypes.canonicalize_value(a), source_info) for a in args]


def call_and_record(fn: Any, args: Sequence[Any]) -> tuple[list[Any], Any]:
    """``fn(*args)`` on tracers of the current jaxpr trace (:func:`atom_tracers`), and what
    it staged when that was one equation that reads exactly ``args`` and whose results
    are exactly the outputs (a nested ``jax.jit`` call, with no effect): the equation's
    primitive, parameters and result types, for :func:`emit_recorded` on other atoms of
    the same types. Otherwise (JAX inlined or forwarded something) ``None``."""
    outs = list(fn(*args))
    eqn = getattr(outs[0], "parent", None) if outs else None
    if (eqn is None or eqn.effects or len(eqn.outvars) != len(outs)
            or len(eqn.in_tracers) != len(args)
            or any(a is not b for a, b in zip(eqn.in_tracers, args))
            or any(type(o) is not _pe.DynamicJaxprTracer or o.parent is not eqn
                   or o.val is not v for o, v in zip(outs, eqn.outvars))):
        return outs, None
    return outs, (eqn.primitive, eqn.params, [v.aval for v in eqn.outvars])


# -- equations emitted straight into the trace's frame ------------------------------------
# ``default_process_primitive`` makes a tracer for every result and a ``TracingEqn`` that
# ``to_jaxpr`` turns into a ``JaxprEqn`` later. The second trace of a step stages every op
# of it, so for the ops that staging would end in the plain case of (no forwarding, no
# constant folding, no references), the ``JaxprEqn`` is made here from JAX's own abstract
# evaluation and appended to the frame (as JAX's ``lower_jaxpr`` does): its results are
# ``Var`` objects, made tracers only where something else needs them (:func:`traced`).
_DIRECT: dict[Any, bool] = {}  # by primitive: ``_emits_directly``
_NOT_CACHED = frozenset({"custom_lin", "call_hi_primitive_linearized", "call_hi_primitive"})
_Var = _core.Var


def _emits_directly(prim: Any) -> bool:
    """Would ``default_process_primitive`` stage ``prim`` as one equation of its abstract
    evaluation's results (no forwarding rule, no reference allocation)?"""
    return (_stages_by_default(prim) and prim not in _pe.forwarding_rules
            and not getattr(prim, "ref_allocating", False) and prim.name not in _NOT_CACHED)


def _direct_trace() -> Any:
    """The jaxpr trace equations may be appended to, or ``None``: one that drops the
    equations whose results die (``auto_dce``: the AD traces) holds them by their
    tracers, which direct equations do not have."""
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace or trace.frame.auto_dce:
        return None
    return trace


def _special_aval(aval: Any) -> bool:
    """Is ``aval`` of a mutable or high-level type (JAX stages those its own way)?"""
    return type(aval) is not ShapedArray and (aval.is_high or getattr(aval, "has_qdd", False))


def _atoms(trace: Any, args: Sequence[Any], source_info: Any, consts: dict,
           const_fold: bool = False) -> list[Any] | None:
    """``args`` as atoms of ``trace``'s frame: a ``Var`` (one this module emitted into
    it) as it is, a tracer of it as its ``Var``, a NumPy array as the constant ``bind``
    makes of it, one per value and trace (``consts``, which the caller keeps until the
    trace ends: it holds the constant's tracer, and the frame drops a constant whose
    tracer died). ``None`` (and no constant made) when an argument is anything else, none
    is traced, an array meets ``const_fold`` (JAX would fold the equation), or a traced
    one is of a mutable or high-level type."""
    out: list[Any] = []
    traced = arrays = False
    for a in args:
        t = type(a)
        if t is _Var:
            pass
        elif t is _pe.DynamicJaxprTracer and a._trace is trace:
            a = a.val
        elif t is np.ndarray:
            arrays = True
            out.append(a)
            continue
        else:
            return None
        if _special_aval(a.aval):
            return None
        traced = True
        out.append(a)
    if not traced or (arrays and const_fold):
        return None
    if arrays:
        for i, a in enumerate(out):
            if type(a) is np.ndarray:
                key = (trace, a.dtype.str, a.shape, a.tobytes())
                c = consts.get(key)
                if c is None:
                    c = consts[key] = trace.new_const(_dtypes.canonicalize_value(a),
                                                      source_info)
                out[i] = c.val
    return out


def _append(trace: Any, atoms_: list[Any], out_avals: Sequence[Any], prim: Any,
            params: dict[str, Any], effs: Any, source_info: Any, ctx: Any) -> list[Any]:
    outvars = [_Var(a) for a in out_avals]
    if effs:
        effs = _core.resolve_input_effects(effs, atoms_)
    trace.frame.tracing_eqns.append(
        _core.JaxprEqn(atoms_, outvars, prim, params, effs, source_info, ctx))
    return outvars


def emit(prim: Any, args: Sequence[Any], params: dict[str, Any], source_info: Any,
         ctx: Any, consts: dict) -> list[Any] | None:
    """Stage ``prim`` on ``args`` (``Var`` objects emitted here, tracers of the current
    jaxpr trace, NumPy arrays; at least one not an array) as one ``JaxprEqn`` appended to
    the trace's frame, with JAX's cached abstract evaluation, the given source info and
    equation context (:func:`eqn_context`): what ``default_process_primitive`` stages,
    without a tracer per result. ``consts``: the constants made so far, which the caller
    keeps until the trace ends (:func:`_atoms`). Returns the results' ``Var`` objects,
    or ``None`` (nothing staged) where JAX would forward, fold or stage it another way."""
    ok = _DIRECT.get(prim)
    if ok is None:
        ok = _DIRECT[prim] = _emits_directly(prim)
    trace = _direct_trace() if ok else None
    if trace is None:
        return None
    atoms_ = _atoms(trace, args, source_info, consts, prim in _pe.const_fold_rules)
    if atoms_ is None:
        return None
    out_avals, effs = _pe._cached_abstract_eval(prim, *[v.aval for v in atoms_], **params)
    if not prim.multiple_results:
        out_avals = (out_avals,)
    return _append(trace, atoms_, out_avals, prim, params, effs, source_info, ctx)


def atoms(args: Sequence[Any], source_info: Any, consts: dict) -> list[Any] | None:
    """``args`` as atoms of the current jaxpr trace's frame (:func:`_atoms`), or ``None``."""
    trace = _direct_trace()
    return None if trace is None else _atoms(trace, args, source_info, consts)


def atom_tracers(atoms_: Sequence[Any], source_info: Any) -> list[Any]:
    """Tracers of the current trace for atoms of its frame (:func:`atoms`), literals
    included (a scalar constant's atom is a ``Literal``, which :func:`traced` passes
    through as it is)."""
    trace = _core.trace_ctx.trace
    return [trace.var_to_tracer(a, source_info) for a in atoms_]


def emit_recorded(recorded: Any, atoms_: Sequence[Any], source_info: Any,
                  ctx: Any) -> list[Any]:
    """The equation :func:`call_and_record` recorded, on atoms of the current trace's
    frame (of the types it was recorded on), appended to the frame (:func:`emit`):
    what calling the function again stages, without its dispatch, trace-cache look-up,
    abstract evaluation and tracers. Returns the results' ``Var`` objects."""
    prim, params, out_avals = recorded
    return _append(_core.trace_ctx.trace, list(atoms_), out_avals, prim, params,
                   _core.no_effects, source_info, ctx)


def frame_mark() -> tuple | None:
    """Where the current jaxpr trace's frame stands (for :func:`recorded_since`), or
    ``None`` when equations cannot be appended to it (:func:`_direct_trace`)."""
    trace = _direct_trace()
    if trace is None:
        return None
    frame = trace.frame
    return trace, len(frame.tracing_eqns), len(frame.constvar_to_val)


def plain_vars(atoms_: Sequence[Any]) -> bool:
    """Are ``atoms_`` variables of the current trace's frame that hold no constant (what
    JAX may fold on, a recording's equations could not be replayed on)?"""
    consts = _core.trace_ctx.trace.frame.constvar_to_val
    for a in atoms_:
        if type(a) is not _Var or a in consts:
            return False
    return True


def recorded_since(mark: tuple, in_atoms: Sequence[Any], outs: Sequence[Any],
                   source_info: Any) -> tuple | None:
    """What was staged since ``mark`` by a function of ``in_atoms`` (atoms of the frame)
    that returned ``outs``, for :func:`emit_recording` on other atoms of the same types:
    each equation's primitive, parameters, result types, operands (an input's index, an
    earlier equation's result, or a literal) and effects, and each output's source.
    ``None`` when that is not all it did (a new constant, an effect other than a
    collective's named axis, an equation reading something else, an output from
    elsewhere, a name stack other than ``source_info``'s, which is the one a replay
    gives), or an input is not a plain variable (:func:`plain_vars`)."""
    trace, n_eqns, n_consts = mark
    frame = trace.frame
    if (_core.trace_ctx.trace is not trace or len(frame.constvar_to_val) != n_consts
            or not plain_vars(in_atoms)):
        return None
    where: dict[int, tuple] = {id(a): ("in", i) for i, a in enumerate(in_atoms)}
    eqns = []
    for j, e in enumerate(frame.tracing_eqns[n_eqns:]):
        if type(e) is _pe.TracingEqn:
            invars = [t.val for t in e.in_tracers]
        elif type(e) is _core.JaxprEqn:
            invars = e.invars
        else:
            return None
        if e.source_info.name_stack != source_info.name_stack or any(
                type(f) is not _core.NamedAxisEffect for f in e.effects):
            return None  # (a collective's named axis: the only effect kept with it)
        ops = []
        for a in invars:
            src = where.get(id(a))
            if src is None:
                if type(a) is not _core.Literal:
                    return None
                src = ("lit", a)
            ops.append(src)
        for k, v in enumerate(e.outvars):
            where[id(v)] = ("eqn", j, k)
        eqns.append((e.primitive, e.params, [v.aval for v in e.outvars], ops, e.effects))
    srcs = []
    for o in outs:
        if type(o) is not _pe.DynamicJaxprTracer or o._trace is not trace:
            return None
        src = where.get(id(o.val))
        if src is None:
            return None
        srcs.append(src)
    return eqns, srcs


def emit_recording(recording: tuple, atoms_: Sequence[Any], source_info: Any,
                   ctx: Any) -> list[Any]:
    """What :func:`recorded_since` recorded, staged again on ``atoms_`` (atoms of the
    current trace's frame of the recorded types), every equation with ``source_info``
    and ``ctx``. Returns the outputs' atoms."""
    eqns, srcs = recording
    trace = _core.trace_ctx.trace
    made: list[list[Any]] = []

    def atom(src: tuple) -> Any:
        kind = src[0]
        return atoms_[src[1]] if kind == "in" else made[src[1]][src[2]] if kind == "eqn" \
            else src[1]

    for prim, params, out_avals, ops, effs in eqns:
        made.append(_append(trace, [atom(s) for s in ops], out_avals, prim, params, effs,
                            source_info, ctx))
    return [atom(s) for s in srcs]


def eqn_context() -> Any:
    """The equation context JAX gives an equation staged now (compute type, mesh, ...):
    the same for every op of a graph evaluated without entering a context between them."""
    return _core.current_jaxpr_eqn_context()


def has_vars(values: Sequence[Any]) -> bool:
    """Does ``values`` hold a ``Var`` emitted by :func:`emit`?"""
    for v in values:
        if type(v) is _Var:
            return True
    return False


def traced(values: Sequence[Any], source_info: Any) -> list[Any]:
    """``values`` with each ``Var`` emitted by :func:`emit` made a tracer of the current
    trace (what JAX's functions and rules take)."""
    out = list(values)
    for i, v in enumerate(out):
        if type(v) is _Var:
            out[i] = _core.trace_ctx.trace.var_to_tracer(v, source_info)
    return out


#: JAX's staging rules that only call ``default_process_primitive`` with the parameters
#: they are given (kept from the dynamic shapes JAX no longer has)
_TRIVIAL_STAGING_RULES = {("broadcast_in_dim", "_broadcast_in_dim_staging_rule"),
                          ("reshape", "_reshape_staging_rule")}
_DEFAULT_STAGING: dict[Any, bool] = {}  # by primitive: ``_stages_by_default``


def _stages_by_default(prim: Any) -> bool:
    """Does binding ``prim`` in a jaxpr trace end in ``default_process_primitive`` with
    the same parameters (:func:`_plain_primitive`, or a trivial staging rule)?"""
    rule = _pe.custom_staging_rules.get(prim)
    return _binds_by_default(prim) and (
        rule is None or (prim.name, getattr(rule, "__name__", "")) in _TRIVIAL_STAGING_RULES)


def source_info_context() -> Any:
    """JAX's current source info context (the name stack; a traceback only when set)."""
    return _siu._source_info_context.context


def source_info(traceback: Any, name_stack: Any) -> Any:
    return _siu.SourceInfo(traceback, name_stack)


def user_traceback(traceback: Any) -> Any:
    """A context in which what JAX stages names ``traceback``'s frames as the user's (a
    traceback JAX recorded in a trace; the name stack stays the current one)."""
    return _siu.user_context(traceback, name_stack=_siu._source_info_context.context.name_stack)


def current_source_info() -> Any:
    return _siu.current()


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


def user_call_site(traceback: Any) -> str:
    """Where the user's code is in ``traceback`` (an equation's ``source_info.traceback``,
    or the current one's), for an error: ``model.py:12``, or, when the innermost user
    frame is a library's (``site-packages``: equinox's ``filter_shard``),
    ``_sharding.py:43 (equinox), called from model.py:12``; ``""`` when unknown."""
    frames = list(_siu.user_frames(traceback))
    if not frames:
        return ""

    def short(f: Any) -> str:
        return f"{os.path.basename(f.file_name)}:{f.start_line}"

    def in_library(f: Any) -> bool:
        return _in_library(f.file_name)
    first = frames[0]
    if not in_library(first):
        return short(first)
    package = first.file_name.split("-packages" + os.sep, 1)[1].split(os.sep, 1)[0]
    caller = next((f for f in frames if not in_library(f)), None)
    return short(first) + f" ({package})" + (f", called from {short(caller)}" if caller else "")


def user_site(file: str, line: int, traceback: Any) -> tuple[str, int]:
    """``(file, line)``, or, when ``file`` is a library's (``site-packages``: flax's
    ``linear.py``), the first frame of ``traceback`` outside every library: the user's
    line that called it (the collectives report named ``linear.py:294`` for every layer's
    gradient all-reduce; found by a probe)."""
    if traceback is None or not _in_library(file):
        return file, line
    caller = next((f for f in _siu.user_frames(traceback) if not _in_library(f.file_name)), None)
    return (caller.file_name, caller.start_line) if caller is not None else (file, line)


def _in_library(file: str) -> bool:
    return any(d in file for d in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"))


#: while a replica is traced: what handles a layout the step's code asks JAX for
#: (``install_layout_hook``): ``hook(what, bind, args, params)``, ``None`` outside
LAYOUT_HOOK: contextvars.ContextVar[Any] = contextvars.ContextVar("layout_hook", default=None)


def install_layout_hook() -> None:
    """Route the binds of ``sharding_constraint`` (``jax.lax.with_sharding_constraint``),
    ``reshard`` (``jax.sharding.reshard``) and ``device_put`` (``jax.device_put``)
    through :data:`LAYOUT_HOOK` while it is set (idempotent). Their layouts name a mesh
    of devices, which a replica's trace must not see: JAX types the result on that mesh,
    and a later op or the gradient mixing it with the replica's own mesh fails inside
    JAX (``use_abstract_mesh cannot change the size of the mesh``)."""
    from jax._src import api, dispatch, pjit
    # JAX checks that a layout divides the value before any bind (``jax.device_put``,
    # ``jax.jit(in_shardings=...)``): in a replica, a split is the hook's (or the import's)
    # error whatever the sizes, so those checks are skipped there
    for module, name in ((pjit, "pjit_check_aval_sharding"), (api, "_check_sharding")):
        check = getattr(module, name, None)
        if check is None or getattr(check, "_replicate_hlo", False):
            continue

        @functools.wraps(check)
        def checked(*args, _check=check, **kwargs):
            if LAYOUT_HOOK.get() is not None and (len(args) < 2 or is_sharding(args[1])
                                                  or isinstance(args[0], (list, tuple))):
                return None  # (a device or an invalid value: JAX's own check)
            return _check(*args, **kwargs)
        checked._replicate_hlo = True
        setattr(module, name, checked)
    for prim, what in ((pjit.sharding_constraint_p, "with_sharding_constraint"),
                       (pjit.reshard_p, "jax.sharding.reshard"),
                       (dispatch.device_put_p, "jax.device_put")):
        def bind(orig, *args, _what=what, **params):
            hook = LAYOUT_HOOK.get()
            return orig(*args, **params) if hook is None else hook(_what, orig, args, params)
        _wrap_bind(prim, bind)


def _wrap_bind(prim: Any, bind: Any) -> None:
    """Route ``prim.bind`` through ``bind(orig_bind, *args, **params)`` (once: a primitive
    already wrapped is left as it is)."""
    if getattr(vars(prim).get("bind"), "_replicate_hlo", False):  # (its own, not the class's)
        return
    orig = prim.bind

    def wrapped(*args, **params):
        return bind(orig, *args, **params)
    wrapped._replicate_hlo = True
    prim.bind = wrapped


# Ops whose results differ between replicas even when their operands do not: a host
# callback with effects (``io_callback``: each replica's call may return its own value,
# as under ``jax.pmap``) and XLA's stateful RNG (``lax.rng_uniform``). JAX's varying
# types call such a result invariant when its operands are, so it came back as one
# array holding one replica's value, and a gradient through it (``w * io_callback()``)
# skipped the sum over the replicas. While a replica is traced, their results are cast
# to varying (values unchanged), so every later type and gradient sees per-replica values.
def install_varying_sources() -> None:
    """Install the casts described above (idempotent)."""
    from jax._src import callback
    from jax._src.lax import lax as jlax
    state = _grad_mode_state()
    for prim in (callback.io_callback_p, jlax.rng_uniform_p):
        def bind(orig, *args, _multiple=prim.multiple_results, **params):
            out = orig(*args, **params)
            axes = _mesh_axis_names() if state.value != "off" else frozenset()
            if not axes:
                return out
            return [to_varying(o, axes) for o in out] if _multiple else to_varying(out, axes)
        _wrap_bind(prim, bind)


def is_concrete_array(x: Any) -> bool:
    """Is ``x`` a ``jax.Array`` with a value (not a tracer)?"""
    return isinstance(x, jax.Array) and not isinstance(x, _core.Tracer)


def host_constants(arrays: Sequence[Any]) -> list:
    """Concrete ``arrays`` (spread over any devices) as arrays on this process's first
    device, made outside the current trace and any layout hook: constants a trace can
    hold without placing them."""
    token = LAYOUT_HOOK.set(None)
    try:
        with _core.eval_context():
            return [jax.device_put(np.asarray(x), jax.local_devices()[0]) for x in arrays]
    finally:
        LAYOUT_HOOK.reset(token)


def eager_constant_folding(on: bool):
    """Context manager: JAX's constant folding of ops whose operands are all constants,
    during staging (off by default)."""
    return _config.eager_constant_folding(on)


def traceback_filtering(mode: str):
    """Context manager: JAX's traceback filtering (``"off"`` keeps JAX's own frames)."""
    return _config.traceback_filtering(mode)


def unbound_axis_name(exc: BaseException) -> str | None:
    """The axis name a failed collective asked for, when ``exc`` comes from JAX looking up
    an axis the trace does not have (0.10/0.11 raise a bare ``AssertionError`` from
    ``core.pvary``, or ``NameError: unbound axis name: ...``); else ``None``."""
    import re
    m = re.search(r"unbound axis name:?\s*'?([\w.-]+)", str(exc))
    if m:
        return m.group(1)
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for f in reversed(frames[-6:]):  # JAX's innermost frames
        if "jax" not in f.f_code.co_filename:
            break
        for key in ("axis_name", "axes", "name"):
            v = f.f_locals.get(key)
            if isinstance(v, str):
                return v
            if isinstance(v, (tuple, list)) and v and isinstance(v[0], str):
                return v[0]
    return None


def user_location_of_exception(exc: BaseException) -> tuple[str, int] | None:
    """(file, line) of the innermost user frame (not JAX's, not this project's) in the
    traceback of ``exc``: where the user's code was when it raised during a trace."""
    import traceback
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if _siu.is_user_filename(f.filename)]
    return (frames[-1].filename, frames[-1].lineno) if frames else None


def literal_value(atom: Any) -> np.ndarray:
    """A jaxpr literal as a plain numpy value (JAX's typed literals carry the trace's mesh)."""
    return np.asarray(atom.val)


def varies_over(aval: Any, axis: str) -> bool:
    """Does JAX type the value varying over the manual mesh axis ``axis``?"""
    mat = getattr(aval, "manual_axis_type", None)
    return mat is not None and axis in mat.varying


def varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes a value varies over (``aval.manual_axis_type.varying``)."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def to_varying(x: Any, axes: str | frozenset) -> Any:
    """``x`` typed as varying over the manual mesh axis ``axes`` (a name, or a set of
    them) too, values unchanged; a value that already varies over them is returned as it
    is. Its transpose, in a gradient, is a sum over the axes it added."""
    extra = ({axes} if isinstance(axes, str) else set(axes)) - varying_axes(jax.typeof(x))
    return jax.lax.pcast(x, tuple(sorted(extra)), to="varying") if extra else x


from jax._src.array import ArrayImpl as _ArrayImpl  # noqa: E402


def is_plain_array(x: Any) -> bool:
    """Is ``x`` a concrete ``jax.Array`` of a plain dtype (not a tracer, not a typed PRNG
    key array, whose buffers :func:`assemble` cannot take)?"""
    return type(x) is _ArrayImpl


def assemble(shape: tuple, sharding: Any, shards: Sequence[Any]) -> Any:
    """The global array of ``shape`` made of ``shards``: device arrays of one dtype and
    weak type, one per device of ``sharding`` in its device order, each of its shard's
    shape (the caller checked all this): ``jax.make_array_from_single_device_arrays``
    without its checks and rearranging, ~2 us where it costs ~12 (a call's input)."""
    a = shards[0]
    aval = _core.ShapedArray(shape, a.dtype, weak_type=a.weak_type)
    return _ArrayImpl(aval, sharding, list(shards), committed=True, _skip_checks=True)


def is_sharding(v: Any) -> bool:
    return isinstance(v, jax.sharding.Sharding)


def is_unconstrained(entry: Any) -> bool:
    """Is a ``PartitionSpec`` entry ``P.UNCONSTRAINED`` (no constraint on that dim)?"""
    return entry is jax.sharding.PartitionSpec.UNCONSTRAINED


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
    if name == "float0":
        return FLOAT0
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


_PRIMITIVES: dict[str, Primitive] = {}


def _lowered_primitives() -> Iterator[Primitive]:
    """The primitives that have a lowering rule (every one that can reach XLA): JAX's
    lowering registry, a dict of a few hundred entries."""
    from jax._src.interpreters import mlir
    tables = [getattr(mlir, "_lowerings", {}),
              *getattr(mlir, "_platform_specific_lowerings", {}).values()]
    return (p for table in tables for p in table if isinstance(p, Primitive))


def _live_primitives() -> Iterator[Primitive]:
    """Every primitive object alive in the process (~30 ms: a walk of all objects)."""
    import gc
    return (obj for obj in gc.get_objects() if isinstance(obj, Primitive))


_LIVE_WALK = [-1]  # len(sys.modules) at the last walk of all live objects


def primitive_by_name(name: str) -> Primitive | None:
    """Find a JAX primitive by name (for graphs parsed from text, and the verifier's
    check that an op is known). JAX's lowering registry first (read on each miss: a
    primitive defined later registers its rule there); a name not there (a primitive
    without a lowering rule) is looked for among all live objects, which a first
    compile used to pay for in every process. That walk (~40 ms in a process holding a
    few models) is made again only after more modules were imported, where primitives
    are defined: a hand-edited dump full of misspelt op names walked once per name."""
    for source in (_lowered_primitives, _live_primitives):
        if name in _PRIMITIVES:
            break
        if source is _live_primitives:
            if _LIVE_WALK[0] == len(sys.modules):
                break
            _LIVE_WALK[0] = len(sys.modules)
        for prim in source():
            _PRIMITIVES.setdefault(prim.name, prim)
    return _PRIMITIVES.get(name)


def make_jaxpr_from(fn, avals: list[Any]) -> ClosedJaxpr:
    return jax.make_jaxpr(fn)(*avals)


def traced_primitive(fn, *args: Any) -> tuple[Primitive, tuple[tuple[str, Any], ...]]:
    """The primitive of the first equation of ``fn``'s jaxpr on ``args`` and its parameters
    (read off a trace: their spelling changes between JAX versions)."""
    jaxpr, _ = jaxpr_parts(jax.make_jaxpr(fn)(*args))
    eqn = jaxpr.eqns[0]
    return eqn.primitive, tuple(eqn.params.items())


def fast_callable(compiled: Any) -> Any:
    """The C++ dispatch function behind a ``jax.stages.Compiled`` (skips one Python frame
    per call); falls back to ``compiled.__call__``."""
    if getattr(compiled, "_call", None) is None and hasattr(compiled, "_executable"):
        try:
            compiled._call = compiled._executable.create_cpp_call(compiled._params)
        except Exception:  # noqa: BLE001 - any failure: use the public path
            return compiled.__call__
    return getattr(compiled, "_call", None) or compiled.__call__


def checked_cpp_call(compiled: Any, check: Any) -> Any:
    """The C++ dispatch function of a ``jax.stages.Compiled`` (it flattens the arguments,
    looks their signature up in its own cache and unflattens the results), with
    ``check(args)`` run on each miss of that cache before the executable's own checks:
    ``check`` raises to refuse arguments the executable would accept (it ignores weak
    types). ``None`` when the executable has no C++ dispatch or JAX's internals differ.

    JAX builds that function in ``MeshExecutable.create_cpp_call`` from a miss handler it
    defines inside; the handler is wrapped by intercepting the one ``_jax.pjit`` call
    that function makes, on this thread only."""
    import threading
    try:
        from jax._src.interpreters import pxla
        exe, params = compiled._executable, compiled._params
        real = pxla._jax
        real_pjit = real.pjit
    except AttributeError:
        return None
    me = threading.get_ident()

    class _Intercept:
        def __getattr__(self, name):
            return getattr(real, name)

        def pjit(self, name, fun, cache_miss, *rest):
            if threading.get_ident() != me:
                return real_pjit(name, fun, cache_miss, *rest)

            def miss(*args, **kwargs):
                check(args)
                return cache_miss(*args, **kwargs)
            return real_pjit(name, fun, miss, *rest)

    with _CPP_CALL_LOCK:
        pxla._jax = _Intercept()
        try:
            return exe.create_cpp_call(params)
        except Exception:  # noqa: BLE001 - internals changed: no fast path, still correct
            return None
        finally:
            pxla._jax = real


_CPP_CALL_LOCK = __import__("threading").Lock()


def trace_context() -> tuple:
    """What a jaxpr traced now depends on besides its function and avals: JAX's trace
    context (the config options that change tracing) and the abstract mesh (which avals
    carry), as one hashable key; JAX keys its own trace caches on the first. Our own
    setting (``_grad_mode_state``) joins that context when first made: it is made here
    first, so that a key taken before the first trace equals one taken after it."""
    if _GRAD_MODE is None:
        _grad_mode_state()
    return (_config.trace_context(), jax.sharding.get_abstract_mesh())


def all_gather_invariant(x: Any, axis_name: Any, *, axis: int, tiled: bool) -> Any:
    """JAX's ``all_gather`` typed identical on every device of ``axis_name`` (its result
    is; JAX's public ``all_gather`` types it varying)."""
    from jax._src.lax import parallel
    return parallel.all_gather_invariant(x, axis_name, axis=axis, tiled=tiled)


def weak_constant(value: np.ndarray) -> Any:
    """``value`` as a weak-typed constant of the current trace (a NumPy array is a
    strong one): a constant of the jaxpr being traced with a weak type, else JAX's
    cast of it to a weak type (which folds into one)."""
    trace = _core.trace_ctx.trace
    if type(trace) is _pe.DynamicJaxprTrace:
        c = _dtypes.canonicalize_value(value)
        return trace.new_const(c, current_source_info(),
                               _core.typeof(c).update(weak_type=True))
    from jax._src.lax import lax as _lax
    return _lax._convert_element_type(value, weak_type=True)


def without_context_mesh() -> Any:
    """A context without the user's ``jax.set_mesh`` mesh, for lowering a step's program:
    its ``shard_map`` over the replicas' mesh refuses another context mesh (a step called
    inside ``with jax.set_mesh(mesh):`` was a ``ValueError`` where ``jax.jit`` works)."""
    if jax.sharding.get_abstract_mesh().empty or not _core.trace_state_clean():
        return contextlib.nullcontext()
    return jax.set_mesh(None)


def trace_context_text() -> str:
    """:func:`trace_context` as text that is the same in every process for the same
    settings (a persistent key's entry): ``name=value`` for each setting JAX names, a
    value whose text holds an address by its type alone."""
    values = trace_context()[0]
    try:
        names = list(_config.trace_context_names())
    except (AttributeError, NotImplementedError):
        names = [f"#{i}" for i in range(len(values))]
    parts = []
    for name, value in zip(names, values):
        text = repr(value)
        parts.append(f"{name}={type(value).__name__ if ' at 0x' in text else text}")
    mesh = repr(jax.sharding.get_abstract_mesh())
    return " ".join(parts) + f" abstract_mesh={'?' if ' at 0x' in mesh else mesh}"


class HostPut:
    """Puts host arrays of one shape and dtype as global ``jax.Array`` s laid out as
    ``sharding`` says, with one ``batched_device_put`` (the copy to each device in C++);
    for a sharding of one device, hands the array back as it is, for the executable's
    call to send.

    JAX's own path for a NumPy argument of a compiled call (``shard_args``) works out
    the same slices and devices in Python on every call: ~45 us for a vector of 4
    replicas' sizes, against ~14 here, where they are worked out once. With one device
    there is nothing to work out, and that path costs less than a put first (the three
    host inputs of a dynamic step at one replica: ~26 us a call less, CPU and H100
    alike). The array must then stay unchanged until the call has run (the executable
    may read it later; the dynamic path's buffers are made per call and never written
    again). Only for a canonical dtype (what the executable takes as it is); anything
    else, or a JAX without the function, is handed to ``jax.device_put``."""

    __slots__ = ("sharding", "shape", "_aval", "_devices", "_indices", "_direct")

    def __init__(self, sharding: Any, shape: tuple, dtype: Any) -> None:
        self.sharding, self.shape = sharding, tuple(shape)
        self._aval = self._devices = self._indices = None
        self._direct = False
        if getattr(_xc, "batched_device_put", None) is None or sharding is None \
                or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            return  # (a typed PRNG key's dtype is not NumPy's: ``jax.device_put``'s)
        dtype = np.dtype(dtype)
        if jax.dtypes.canonicalize_dtype(dtype) != dtype or dtype == jax.dtypes.float0:
            return
        self._aval = ShapedArray(self.shape, dtype)
        self._devices = list(sharding._addressable_device_assignment)
        self._direct = len(self._devices) == 1 and sharding.is_fully_addressable
        self._indices = (None if sharding.is_fully_replicated else
                         tuple(sharding.addressable_devices_indices_map(self.shape).values()))

    def __call__(self, x: np.ndarray) -> Any:
        if self._aval is None or type(x) is not np.ndarray or x.shape != self.shape \
                or x.dtype != self._aval.dtype:
            return x if self.sharding is None else jax.device_put(x, self.sharding)
        if self._direct:
            return x
        shards = [x] * len(self._devices) if self._indices is None else [x[i] for i in self._indices]
        return _xc.batched_device_put(self._aval, self.sharding, shards, self._devices, True)


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

    def batcher(args, dims, **params):
        # the batch dim is whole on every device: the layout gains an unsplit dim there
        (x,), (d,) = args, dims
        batched = _with_batch_dim(params.get("sharding"), d, np.ndim(x))
        if batched is None:
            return x, d
        return p.bind(x, **{**params, "sharding": batched}), d

    ad.primitive_jvps[p] = jvp
    ad.primitive_transposes[p] = transpose
    batching.primitive_batchers[p] = batcher
    mlir.register_lowering(p, lambda ctx, x, **params: [x])
    return p


def _with_batch_dim(sharding: Any, dim: Any, rank: int) -> Any:
    """``sharding`` (an annotation's, of the unbatched value) for the value with a vmap
    batch dim at ``dim`` (rank ``rank`` with it): a tile of 1 inserted there for a split,
    the same sharding for a replicated or maximal one; ``None`` when not batched."""
    from ir.types import Sharding
    if not isinstance(sharding, Sharding) or not isinstance(dim, int):
        return None
    if sharding.kind != "tiled":
        return sharding
    dims = list(sharding.tile_dims)
    dims.insert(dim % rank, 1)  # (a last, replicated tile dim stays last)
    return Sharding("tiled", tile_dims=tuple(dims), devices=sharding.devices,
                    last_tile_dim_replicate=sharding.last_tile_dim_replicate)


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
        if _VARYING_CARRIES.get() and varying_axes(out_aval) - varying_axes(in_aval):
            val, changed = to_varying(val, varying_axes(out_aval)), True
        return val, changed

    promote._replicate_hlo = True
    loops._promote_weak_typed_input = promote


# -- calls of a jaxpr that drop per-replica types (jax >= 0.11) -------------------------
# From jax 0.11.1 on, calling a ``jax.jit(g).trace(...)`` object binds ``eval_jaxpr``
# (0.10 evaluated the jaxpr inline), whose abstract eval returns the callee's output types
# as they were traced, without the varying axes of its operands. Under
# shard_map(check_vma=True) a value computed from per-replica data is then typed
# mirrored, and a gradient that flows through it misses its cross-replica sum: plain
# jax 0.11.2 returns one replica's local gradient. While we trace a replica (and only
# then), such a call whose operands vary where the callee's inputs do not is evaluated
# inline, as jax 0.10 did: the same numbers, with JAX's types right.
def _install_call_inlining() -> None:
    prim = getattr(_core, "eval_jaxpr_p", None)
    if prim is None or getattr(prim.bind, "_replicate_hlo", False):
        return
    orig = prim.bind

    def bind(*args, call_jaxpr, **params):
        if _VARYING_CARRIES.get() and any(
                varying_axes(jax.typeof(a)) - varying_axes(v.aval)
                for a, v in zip(args, call_jaxpr.invars)):
            return _core.jaxpr_as_fun(call_jaxpr)(*args)
        return orig(*args, call_jaxpr=call_jaxpr, **params)

    bind._replicate_hlo = True
    prim.bind = bind


# -- branches and loop carries that differ in what varies -----------------------------
# Under shard_map(check_vma=True), ``lax.cond(p, lambda: 0.0, lambda: local_loss)`` is a
# type error: one branch's output is mirrored, the other's per-replica, and JAX asks for a
# ``pcast`` by hand. So is a loop whose carry becomes per-replica only after another one
# did (an L-BFGS state whose memory follows a per-replica value): JAX promotes a loop's
# initial carry once (``_install_carry_promotion``), not to a fixed point. pmap (where
# everything varies) and TF run both, with per-replica results. While we trace a replica
# (and only then), ``jax.lax.cond`` / ``switch`` / ``while_loop`` / ``scan`` trace again
# with each such branch output or initial carry cast to the union of the varying axes
# JAX found: the casts its message asks for, values unchanged (the transpose of a cast
# sums a mirrored value's cotangent over the replicas, as JAX's implicit casts do). A
# difference in shape or dtype is still JAX's error, and so is one met through a
# reference to JAX's own function taken before our first trace (``from jax.lax import
# cond`` at import time; ``_install_carry_promotion``'s one level still serves loops
# reached that way).
class _VaryingTypes(Exception):
    """Branch outputs or loop carries that differ only in their varying axes: ``axes``,
    per flat output or carry, the union to cast to."""

    def __init__(self, axes: list[frozenset]):
        super().__init__("types differ only in their varying axes")
        self.axes = axes


#: the functions (branches, or a loop's body) that the innermost wrapper below handed
#: JAX: only their check may ask it to trace again (a cond reached through a reference
#: to JAX's own function, inside a wrapped loop's body, keeps JAX's error)
_PROMOTING: contextvars.ContextVar[tuple] = contextvars.ContextVar("promoting_varying_types",
                                                                  default=())


def _only_varying_differs(avals1: Any, avals2: Any) -> list[frozenset] | None:
    if getattr(avals1, "tree", None) != getattr(avals2, "tree", None):
        return None
    avals1, avals2 = list(avals1), list(avals2)
    if len(avals1) != len(avals2):
        return None
    union, differs = [], False
    for a1, a2 in zip(avals1, avals2):
        v1, v2 = varying_axes(a1), varying_axes(a2)
        # (weak types may differ: JAX's check ignores them, as its typematch does)
        if (getattr(a1, "shape", None) != getattr(a2, "shape", None)
                or getattr(a1, "dtype", None) != getattr(a2, "dtype", None)):
            return None
        differs |= v1 != v2
        union.append(v1 | v2)
    return union if differs else None


def _cast_tree(tree: Any, axes: list[frozenset] | frozenset) -> Any:
    """Every leaf of ``tree`` cast to vary over its own axes in ``axes`` (a list, leaf by
    leaf), or over ``axes`` (one set for all)."""
    if isinstance(axes, frozenset):
        return jax.tree.map(lambda x: to_varying(x, axes), tree)
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([to_varying(x, want) for x, want in zip(leaves, axes)])


def _cast_branch(fn: Any, axes: list[frozenset] | frozenset) -> Any:
    @functools.wraps(fn)  # (JAX's messages name the user's function)
    def branch(*args: Any, **kwargs: Any) -> Any:
        return _cast_tree(fn(*args, **kwargs), axes)
    return branch


def _cast_carry_out(f: Any, axes: list[frozenset]) -> Any:
    """A scan body ``f(carry, x) -> (carry, y)`` whose carry out is cast to ``axes``."""
    @functools.wraps(f)
    def body(carry: Any, x: Any) -> Any:
        c, y = f(carry, x)
        return _cast_tree(c, axes), y
    return body


def _to_fixed_point(functions: Any, call: Any) -> Any:
    """``call(functions(None), None)``; while JAX finds that the types of those
    functions' outputs or carries differ only in their varying axes, again with
    ``axes``, the union so far (each round adds an axis to some output or carry; one
    that adds none is JAX's own error). ``functions(axes)``: the branches or the loop
    body this round hands JAX."""
    axes: list[frozenset] | None = None
    while True:
        fns = tuple(functions(axes))
        token = _PROMOTING.set(fns)
        try:
            return call(fns, axes)
        except _VaryingTypes as e:
            grown = e.axes if axes is None else [a | b for a, b in zip(axes, e.axes)]
            if grown == axes:
                break
            axes = grown
        finally:
            _PROMOTING.reset(token)
    return call(tuple(functions(axes)), axes)  # (no wrapper's functions: JAX's own error)


def _install_varying_promotion() -> None:
    from jax._src.lax.control_flow import conditionals, loops
    import jax._src.lax.control_flow as control_flow

    if getattr(conditionals._check_branch_outputs, "_replicate_hlo", False):
        return

    def checking(check, checked_functions):
        def checked(*args):
            owned = _PROMOTING.get()
            if owned and any(f is o for f in checked_functions(args) for o in owned):
                union = _only_varying_differs(args[-2], args[-1])
                if union is not None:
                    raise _VaryingTypes(union)
            return check(*args)
        checked._replicate_hlo = True
        return checked

    # (api_name, name1, name2, f1, f2, out_avals1, out_avals2); (name, body, in, out)
    conditionals._check_branch_outputs = checking(conditionals._check_branch_outputs,
                                                  lambda args: args[3:5])
    loops._check_carry_type = checking(loops._check_carry_type, lambda args: args[1:2])
    orig = {"cond": conditionals.cond, "switch": conditionals.switch,
            "while_loop": loops.while_loop, "scan": loops.scan}

    def cast_all(fns, axes):
        return fns if axes is None else [_cast_branch(f, axes) for f in fns]

    # (the parameter names are JAX's: callers may pass any of them by keyword)
    def cond(pred, true_fun, false_fun, *operands, **kwargs):
        if not kwargs and _vmapped(pred):
            index = pred if not np.issubdtype(np.dtype(pred.dtype), np.integer) else pred != 0
            out = _selected((false_fun, true_fun), index, operands)
            if out is not None:
                return out
        fns = _varying_by_index(pred, (true_fun, false_fun))
        return _to_fixed_point(lambda axes: cast_all(fns, axes),
                               lambda fns, _: orig["cond"](pred, *fns, *operands, **kwargs))

    def switch(index, branches, *operands, **kwargs):
        if not kwargs and _vmapped(index) and len(branches) > 1:
            out = _selected(list(branches), jax.lax.clamp(0, index.astype(np.int32),
                                                          len(branches) - 1), operands)
            if out is not None:
                return out
        fns = _varying_by_index(index, list(branches))
        return _to_fixed_point(lambda axes: cast_all(fns, axes),
                               lambda fns, _: orig["switch"](index, fns, *operands, **kwargs))

    # a loop's carry takes the union of what varies in and out: the initial carry is cast
    # (mirrored in, per-replica out: ``h = 0; h = f(h, x_r)``), and so is the body's carry
    # out (per-replica in, mirrored out: pmap code's ``v = pmean(v) + 1``)
    # and a loop whose condition varies (each replica its own trip count: ``i < n_r``, a
    # fori_loop to a per-replica bound or a dynamic size) has per-replica results, though
    # JAX types them by the carry alone (as a cond's by its branches): a mirrored
    # ``count`` multiplying a mirrored weight summed its gradient over the replicas
    # before the count met it. The results are cast to the condition's varying axes.
    def while_loop(cond_fun, body_fun, init_val):
        pred_axes: list[frozenset] = []

        def cond(carry):
            pred = cond_fun(carry)
            try:
                pred_axes.append(varying_axes(jax.typeof(pred)))
            except TypeError:  # (a Python bool: the same everywhere)
                pass
            return pred
        out = _to_fixed_point(
            lambda axes: (body_fun if axes is None else _cast_branch(body_fun, axes),),
            lambda fns, axes: orig["while_loop"](
                cond, fns[0], init_val if axes is None else _cast_tree(init_val, axes)))
        return _cast_tree(out, pred_axes[-1]) if pred_axes and pred_axes[-1] else out

    def scan(f, init, *args, **kwargs):
        return _to_fixed_point(
            lambda axes: (f if axes is None else _cast_carry_out(f, axes),),
            lambda fns, axes: orig["scan"](
                fns[0], init if axes is None else _cast_tree(init, axes), *args, **kwargs))

    for name, fn in (("cond", cond), ("switch", switch), ("while_loop", while_loop),
                     ("scan", scan)):
        original = orig[name]

        @functools.wraps(original)
        def wrapper(*args, _fn=fn, _original=original, **kwargs):
            if not _VARYING_CARRIES.get():
                return _original(*args, **kwargs)
            return _fn(*args, **kwargs)
        wrapper._replicate_hlo = True
        for module in (jax.lax, control_flow, conditionals, loops):
            if getattr(module, name, None) is original:
                setattr(module, name, wrapper)


def _varying_by_index(index: Any, branches: Sequence[Any]) -> list:
    """A ``cond``/``switch`` whose index varies over manual axes (each replica picks its
    own branch): every branch's results cast to vary over them too. JAX types the
    results by the branches' alone (jax-ml/jax#40823, open in 0.10 and 0.11):
    ``cond(p_r, id, neg, w)`` of a mirrored ``w`` came out mirrored, so the cast to
    varying JAX then put after it summed the replicas' cotangents *before* each
    transposed its own branch (gradient Σ_r b_r(Σ_s ct_s) instead of Σ_r b_r(ct_r)).
    Cast inside the branches, the sum is in each transposed branch, on its own
    cotangent, and ``hoist-collectives`` takes it out after the cond. (The operands stay
    as they are: a mirrored weight is mirrored inside the branch, so ``jax.grad`` of it
    there is still refused, its sum being a collective only some replicas would run.)"""
    try:
        axes = varying_axes(jax.typeof(index))
    except TypeError:  # (not an array: a Python value, the same everywhere)
        return list(branches)
    if not axes:
        return list(branches)
    return [_cast_branch(f, axes) for f in branches]


def _vmapped(index: Any) -> bool:
    """Is a ``cond``/``switch`` index batched by an enclosing ``jax.vmap`` (one per
    example)? JAX then runs every branch and selects per example
    (``_cond_batching_rule``), which under ``shard_map(check_vma=True)`` fails in its
    derivative when a branch uses a mirrored value (``pvary is a invariant->variant
    collective``: JAX 0.10 and 0.11, with plain ``jax.shard_map`` too): :func:`_selected`
    does the same selection itself."""
    from jax._src.interpreters import batching
    return isinstance(index, batching.BatchTracer) and index.batch_dim is not None


def _selected(branches: Sequence[Any], index: Any, operands: tuple) -> Any:
    """Every branch's result, ``lax.select_n`` by ``index`` (what JAX's batching of a
    ``cond`` with a batched index computes), the results cast to what varies in any of
    them; ``None`` when the branches' results differ in structure, shape or dtype (JAX's
    own error then)."""
    outs = [b(*operands) for b in branches]
    flat = [jax.tree.flatten(o) for o in outs]
    if any(td != flat[0][1] for _, td in flat) or any(
            len(leaves) != len(flat[0][0]) or any(
                _shape_dtype(a) != _shape_dtype(b) for a, b in zip(leaves, flat[0][0]))
            for leaves, _ in flat):
        return None
    try:
        index = index.astype(np.int32)
        leaves = []
        for cases in zip(*(leaves for leaves, _ in flat)):
            axes = frozenset().union(*(varying_axes(jax.typeof(c)) for c in (index, *cases)))
            leaves.append(jax.lax.select_n(to_varying(index, axes),
                                           *(to_varying(c, axes) for c in cases)))
    except (TypeError, ValueError):  # (results select_n cannot take: JAX's own cond then)
        return None
    return jax.tree.unflatten(flat[0][1], leaves)


def _shape_dtype(x: Any) -> tuple:
    aval = jax.typeof(x)
    return aval.shape, aval.dtype


def forwards(new: Any, old: Any) -> bool:
    """Is the tracer ``new`` the tracer ``old`` passed through ``jit`` calls unchanged
    (an output of a ``jit`` equation whose jaxpr returns the input ``old`` came in as)?
    ``nnx.jit`` writes its outputs back into the objects it was given, so an unchanged
    state comes back as new tracers of the same values. ``True`` when JAX's tracers cannot
    be read (nothing is reported then)."""
    try:
        for _ in range(64):  # (nested jit calls)
            if new is old:
                return True
            eqn = new.parent
            if eqn is None or eqn.primitive.name not in ("pjit", "jit"):
                return False
            inner = eqn.params["jaxpr"].jaxpr
            out = inner.outvars[list(eqn.outvars).index(new.val)]
            if not any(out is v for v in inner.invars):
                return False
            new = eqn.in_tracers[[i for i, v in enumerate(inner.invars) if v is out][0]]
        return False
    except Exception:  # noqa: BLE001  (another JAX's tracers: do not report)
        return True


def grouped_reduce(x: Any, op: str, groups: list[list[int]], n: int, axis: str) -> Any:
    """``op`` (sum | mean | max | min) of each leaf of ``x`` within each replica's group
    of ``groups`` (a partition of ``0..n-1``) over the replica axis ``axis``: every
    replica's value is gathered, and the members of this replica's group reduced (exact;
    one all-gather). Under ``shard_map``'s value-variance types JAX has no grouped
    ``psum`` of a per-replica value (a bare ``NotImplementedError``)."""
    member = np.zeros((n, n), bool)
    for g in groups:
        for r in g:
            member[r, g] = True

    def one(a):
        everyone = jax.lax.all_gather(a, axis, axis=0, tiled=False)   # [n, ...]
        me = jax.lax.axis_index(axis)
        mask = jax.numpy.asarray(member)[me]
        mask = mask.reshape((n,) + (1,) * (everyone.ndim - 1))
        if op in ("sum", "mean"):  # (in the value's own dtype: int8 wraps, as psum's)
            keep = None if everyone.dtype == bool else everyone.dtype
            out = jax.numpy.sum(jax.numpy.where(mask, everyone, 0), axis=0, dtype=keep)
            if op == "mean":  # (this replica's group's size)
                out = out / jax.numpy.asarray(member.sum(1), out.dtype)[me]
            return out
        fill = -jax.numpy.inf if op == "max" else jax.numpy.inf
        if everyone.dtype == bool:
            fill = op != "max"
        elif not jax.numpy.issubdtype(everyone.dtype, jax.numpy.inexact):
            info = jax.numpy.iinfo(everyone.dtype)
            fill = info.min if op == "max" else info.max
        red = jax.numpy.max if op == "max" else jax.numpy.min
        return red(jax.numpy.where(mask, everyone, fill), axis=0)
    return jax.tree.map(one, x)


def _install_grouped_sums() -> None:
    """``lax.psum`` (and so ``lax.pmean``) with ``axis_index_groups`` of a per-replica
    value over the replica axis: JAX raises a bare ``NotImplementedError`` under the
    value-variance types a replica is traced with (``bind_psum_invariant``), where
    ``jax.pmap`` runs it. While a replica is traced that sum is :func:`grouped_reduce`
    (pmap's numbers); anything else is JAX's own."""
    from jax._src import mesh as mesh_lib
    from jax._src.lax import parallel as par
    orig = par.bind_psum_invariant
    if getattr(orig, "_replicate_hlo", False):
        return

    @functools.wraps(orig)
    def bind_psum_invariant(leaf, *, axes, axis_index_groups, is_async):
        mesh = None if axis_index_groups is None else mesh_lib.get_abstract_mesh()
        if mesh is None or not _VARYING_CARRIES.get() or is_async or \
                len(axes) != 1 or mesh.empty or axes[0] not in mesh.axis_names:
            return orig(leaf, axes=axes, axis_index_groups=axis_index_groups,
                        is_async=is_async)
        n = dict(mesh.shape)[axes[0]]
        groups = [[int(r) for r in g] for g in axis_index_groups]
        if sorted(r for g in groups for r in g) != list(range(n)):
            return orig(leaf, axes=axes, axis_index_groups=axis_index_groups,
                        is_async=is_async)
        return grouped_reduce(leaf, "sum", groups, n, axes[0])
    bind_psum_invariant._replicate_hlo = True
    par.bind_psum_invariant = bind_psum_invariant


def _install_all_to_all_axes() -> None:
    """``lax.all_to_all`` with a negative ``split_axis``/``concat_axis``: jax 0.10 makes
    a wrong equation of it (its untiled form inserts an axis, then counts the negative
    axes from the new rank) that XLA:CPU crashes on (jax-ml/jax#20125, fixed in 0.11).
    While a replica is traced, the axes are made non-negative first, as ``rt.all_to_all``
    does: the numbers of the positive axes on every JAX."""
    from jax._src.lax import parallel as par
    orig = par.all_to_all
    if getattr(orig, "_replicate_hlo", False):
        return

    @functools.wraps(orig)
    def all_to_all(x, axis_name, split_axis, concat_axis, **kwargs):
        if _VARYING_CARRIES.get() and (split_axis < 0 or concat_axis < 0):
            def one(leaf):
                rank = np.ndim(leaf)
                return orig(leaf, axis_name, split_axis % rank if rank else split_axis,
                            concat_axis % rank if rank else concat_axis, **kwargs)
            return jax.tree.map(one, x)
        return orig(x, axis_name, split_axis, concat_axis, **kwargs)
    all_to_all._replicate_hlo = True
    for module in (jax.lax, par):
        if getattr(module, "all_to_all", None) is orig:
            setattr(module, "all_to_all", all_to_all)


@contextlib.contextmanager
def varying_loop_carries():
    """While active (tracing one replica), loop carries that start mirrored but become
    varying are cast (to a fixed point, with cond/switch branch outputs that differ
    only in what varies), and a call of a jaxpr whose operands vary where the callee's inputs
    do not is evaluated inline (see above): all keep JAX's per-replica types right."""
    _install_carry_promotion()
    _install_varying_promotion()
    _install_call_inlining()
    _install_all_to_all_axes()
    _install_grouped_sums()
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


def parse_dim(text: str) -> Any:
    """The symbolic dimension expression JAX prints as ``text`` (``b - 1``,
    ``max(0, b - 2)``), read back by JAX's own parser; ``ValueError`` for other text."""
    (dim,) = jax.export.symbolic_shape(text)
    return dim


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
        _GRAD_MODE = _config.enum_state(
            "replicate_hlo_grad_mode", ["off", "replica", "backward"], "off",
            help="replicate-hlo: 'replica' while a replica's step is traced (pullbacks "
                 "apply the loss reduction), 'backward' inside such a pullback.",
            include_in_trace_context=True)
    return _GRAD_MODE


def grad_mode(mode: str):
    """Context manager: set the reverse-mode hook's mode (``off``/``replica``/``backward``)."""
    return _grad_mode_state()(mode)


def _seed_for(c: Any, axes: frozenset) -> Any:
    """The cotangent seed ``c`` typed as its output, which varies over ``axes``:
    - a seed identical on every replica for a per-replica output (pmap code's ``pb(2.0)``)
      is that value on each replica: cast, values unchanged;
    - a per-replica seed for an output identical on every replica (``jax.vjp(f, w)`` of a
      mirrored ``w``, pulled back with the replica's data) is one seed of the global
      program, the sum of the replicas': given as their mean, an identical seed, which
      the pullback counts once per replica (``compiler.trace._pullback``).
    ``c`` as it is when it is not an array JAX can type (its own error then names it)."""
    try:
        have = varying_axes(jax.typeof(c))
    except TypeError:
        return c
    missing, extra = axes - have, have - axes
    if extra:
        c = jax.lax.pmean(c, tuple(sorted(extra)))
    return to_varying(c, missing) if missing else c


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

    def hooked(*args):
        # 0.10 / 0.11.0: (in_tree, out_tree, out_known, jaxpr, out_primal_avals, residuals,
        # maybe_accums, out_ct); 0.11.2: (in_tree, out_tree, out_zeros, jaxpr,
        # out_primal_avals, want_logs, residuals, structured_res, maybe_accums, out_ct),
        # returning (arg_cts, logs) when want_logs is set
        if state.value != "replica" or _VJP_POLICY is None:
            return orig(*args)
        jaxpr, out_primal_avals, out_ct = args[3], args[4], args[-1]
        want_logs = len(args) == 10 and bool(args[5])
        is_zero = lambda x: isinstance(x, ad.Zero)
        cts, ct_tree = jax.tree_util.tree_flatten(out_ct, is_leaf=is_zero)
        if len(cts) != len(out_primal_avals):  # a malformed seed: JAX's own error
            return orig(*args)
        out_varying = [varying_axes(a) for a in out_primal_avals]
        # (each seed typed as its output: a constant for a per-replica one, pmap code's
        # ``pb(1.0)``, and a per-replica seed for an identical one: ``_seed_for``)
        cts = [c if is_zero(c) else _seed_for(c, out_varying[i]) for i, c in enumerate(cts)]
        # 0.11.2's jaxpr takes the residuals first, then one input per primal leaf
        in_varying = [varying_axes(v.aval) for v in jaxpr.invars[-args[0].num_leaves:]] \
            if args[0].num_leaves else []
        placeholders = tuple(getattr(api, n) for n in ("DidntWant", "GradRef") if hasattr(api, n))
        logs, back = [], {}  # ``back``: not attributes of ``run`` (a cycle through its
        # own cell would keep the backward pass's jaxpr and tracers for the collector)

        def run(new_cts):
            seeds = [c if n is None else n for c, n in zip(cts, new_cts)]
            with state("backward"):
                res = orig(*args[:-1], jax.tree_util.tree_unflatten(ct_tree, seeds))
            if want_logs:
                res, log = res
                logs.append(log)
            leaves, tree = jax.tree_util.tree_flatten(
                res, is_leaf=lambda x: isinstance(x, placeholders))
            back["tree"], back["leaves"] = tree, leaves
            return [None if isinstance(x, placeholders) else x for x in leaves]

        out = _VJP_POLICY([None if is_zero(c) else c for c in cts], out_varying,
                          in_varying, run)
        out = [x if isinstance(x, placeholders) else o for o, x in zip(out, back["leaves"])]
        arg_cts = jax.tree_util.tree_unflatten(back["tree"], out)
        return (arg_cts, logs[0]) if want_logs else arg_cts

    hooked._replicate_hlo = True
    api._vjp3_bwd = hooked
    _install_linear_transpose_hook(api, state)
    _install_linearize_fallback(api, state)


def _install_linearize_fallback(api: Any, state: Any) -> None:
    """``jax.linearize`` at a mirrored primal whose linear function is then given a
    per-replica tangent (pmap code's Hessian-vector product with a replica's own vector):
    JAX refuses a tangent of another type than the linearization's (its message names
    ``pcast`` and the internal axis). While a replica is traced such a call is the
    ``jax.jvp`` at the primals instead (the forward pass recomputed), which takes the
    per-replica tangent and gives pmap's numbers; any other call is JAX's own."""
    orig = api.linearize

    @functools.wraps(orig)
    def linearize(fun, *primals, has_aux=False):
        out = orig(fun, *primals, has_aux=has_aux)
        if state.value != "replica" or not _mesh_axis_names():
            return out
        linear = out[1]
        p_leaves = jax.tree_util.tree_leaves(primals)

        def f_jvp(*tangents):
            t_leaves = jax.tree_util.tree_leaves(tangents)
            if len(t_leaves) == len(p_leaves) and any(
                    _is_inexact(p) and _is_inexact(t)
                    and varying_axes(jax.typeof(t)) - varying_axes(jax.typeof(p))
                    for p, t in zip(p_leaves, t_leaves)):
                primal_fun = (lambda *a: fun(*a)[0]) if has_aux else fun
                return jax.jvp(primal_fun, primals, tangents)[1]
            return linear(*tangents)
        return (out[0], jax.tree_util.Partial(f_jvp), *out[2:])
    linearize._replicate_hlo = True
    api.linearize = linearize
    jax.linearize = linearize


def _install_linear_transpose_hook(api: Any, state: Any) -> None:
    """``jax.linear_transpose`` builds its transpose with ``backward_pass`` directly,
    not through a pullback: while the mode is ``replica`` its transposed function goes
    through the same policy as ``jax.vjp``'s (a linear function's transpose is its vjp),
    so the two agree, as they do under pmap. Before, ``linear_transpose(psum)(c)`` gave
    ``c`` where the vjp (and pmap) give ``N c``, and a mirrored primal's transpose the sum
    over replicas where the vjp gives the mean (``loss_reduction="mean"``)."""
    orig = api.linear_transpose

    @functools.wraps(orig)
    def linear_transpose(fun, *primals, **kwargs):
        transposed = orig(fun, *primals, **kwargs)
        if state.value != "replica" or _VJP_POLICY is None:
            return transposed
        in_varying = [varying_axes(api.shaped_abstractify(x))
                      for x in jax.tree_util.tree_leaves(primals)]
        out_varying = [varying_axes(a) for a in jax.make_jaxpr(fun)(*primals).out_avals]

        @functools.wraps(transposed)
        def transposed_fun(out_cotangent):
            cts, ct_tree = jax.tree_util.tree_flatten(out_cotangent)
            if len(cts) != len(out_varying):  # a malformed cotangent: JAX's own error
                return transposed(out_cotangent)
            cts = [_seed_for(c, axes) for c, axes in zip(cts, out_varying)]
            back = {}

            def run(new_cts):
                seeds = [c if n is None else n for c, n in zip(cts, new_cts)]
                with state("backward"):
                    res = transposed(jax.tree_util.tree_unflatten(ct_tree, seeds))
                leaves, back["tree"] = jax.tree_util.tree_flatten(res)
                return leaves
            out = _VJP_POLICY(list(cts), out_varying, in_varying, run)
            return jax.tree_util.tree_unflatten(back["tree"], out)
        return transposed_fun

    linear_transpose._replicate_hlo = True
    api.linear_transpose = linear_transpose
    jax.linear_transpose = linear_transpose


# -- custom_vjp backward functions that return a per-replica cotangent ------------------
# A ``custom_vjp`` whose primal input is mirrored (a weight) and whose backward function
# computes its cotangent from per-replica values (``x.T @ g``) returns a per-replica
# cotangent for a value that is one across replicas. JAX's check (check_vma) refuses it:
# under ``shard_map`` the user is expected to ``psum`` it by hand. In the global program
# the mirrored input is one value used by every replica, so its cotangent is the sum of
# the replicas' contributions: exactly the sum JAX itself inserts when it transposes the
# implicit cast to varying of a mirrored value. While a replica is traced, that sum is
# inserted over the axes the cotangent varies over and its input does not.
def _sum_extra_axes(cts: Any, in_tree: Any, in_avals: Sequence[Any],
                    per_replica: bool = False) -> Any:
    children = jax.tree_util.treedef_children(in_tree)
    if isinstance(cts, list) and len(cts) == len(children):
        cts = tuple(cts)
    if not isinstance(cts, tuple) or len(cts) != len(children):
        return cts  # a malformed result: JAX's own error names it
    out, pos = [], 0
    for ct, child in zip(cts, children):
        avals = in_avals[pos:pos + child.num_leaves]
        pos += child.num_leaves
        leaves, tree = jax.tree_util.tree_flatten(ct, is_leaf=lambda x: x is None)
        if ct is None or len(leaves) != len(avals):
            out.append(ct)
            continue
        fixed = []
        for leaf, aval in zip(leaves, avals):
            if not (isinstance(leaf, jax.Array) or hasattr(leaf, "aval")):
                fixed.append(leaf)
                continue
            have, want = varying_axes(jax.typeof(leaf)), varying_axes(aval)
            extra, missing = have - want, want - have
            if per_replica and not have and not want and _is_inexact(leaf):
                # a cotangent identical on every replica (``pmean(g)``, a constant) that
                # each replica's backward function gave: every replica adds its copy
                extra = _mesh_axis_names()
                leaf = to_varying(leaf, extra)
            if extra:
                leaf = jax.lax.psum(leaf, tuple(sorted(extra)))
            if missing:  # (one cotangent for every replica: pmap code's psum(g))
                leaf = to_varying(leaf, missing)
            fixed.append(leaf)
        out.append(jax.tree_util.tree_unflatten(tree, fixed))
    return tuple(out)


def install_custom_vjp_sum() -> None:
    """While a replica is traced, sum a ``custom_vjp`` backward function's per-replica
    cotangent of a mirrored input over the replicas (see the comment above)."""
    from jax._src import custom_derivatives as cd
    from jax._src import linear_util as lu
    orig = cd._flatten_bwd
    if getattr(orig, "_replicate_hlo", False):
        return
    state = _grad_mode_state()

    @lu.transformation2
    def summed(f, in_tree, in_avals, with_logs, per_replica, *args):
        out = f(*args)
        if with_logs and isinstance(out, (list, tuple)) and len(out) == 2:
            return _sum_extra_axes(out[0], in_tree, in_avals, per_replica), out[1]
        return _sum_extra_axes(out, in_tree, in_avals, per_replica)

    def patched(bwd, in_tree, in_avals, *rest):
        # 0.10: (out_trees); 0.11.2: (out_trees, primal_fun, with_logs), where a backward
        # function registered with logs returns (cotangents, logs)
        if state.value == "off":
            return orig(bwd, in_tree, in_avals, *rest)
        with_logs = bool(rest[2]) if len(rest) >= 3 else False
        # (per replica: the function's outputs were cast, so it runs on each replica's
        # own cotangent: ``_install_per_replica_cotangents``)
        return orig(summed(bwd, in_tree, tuple(in_avals), with_logs, _FWD_CAST.get()),
                    in_tree, in_avals, *rest)

    patched._replicate_hlo = True
    cd._flatten_bwd = patched
    _install_per_replica_cotangents(cd, state)


def _varying_outputs(fwd: Any) -> Any:
    """A ``custom_vjp`` ``fwd`` rule whose (inexact) primal outputs are typed varying over
    every manual mesh axis (values unchanged), and its inexact residuals. A
    ``jax.custom_gradient`` function's (:func:`_custom_gradient_fun`) has its outputs
    cast before its gradient function is traced on their types."""
    fun_cell = _custom_gradient_fun(fwd)
    if fun_cell is not None and not getattr(fun_cell.cell_contents, "_replicate_hlo", False):
        fun_cell.cell_contents = _varying_answer(fun_cell.cell_contents)

    @functools.wraps(fwd)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        token = _IN_GRADIENT_FWD.set(True)
        try:
            out, *residuals = fwd(*args, **kwargs)
        finally:
            _IN_GRADIENT_FWD.reset(token)
        # (the residuals too: a backward function that differentiates with them,
        # ``jax.vjp(f, *res)[1](g)``, would otherwise sum a mirrored residual's cotangent
        # over the replicas itself, and the sum of the cotangents it returns then counted
        # it N times; found by a probe)
        return (_inexact_varying(out), *_inexact_varying(residuals))
    return wrapped


# ``jax.custom_gradient(fun)`` is a ``custom_vjp`` whose ``fwd`` (a closure over ``fun``)
# calls ``fun``, traces the gradient function it returns on the types of the answer (the
# cotangents' types) and whose ``bwd`` evaluates that jaxpr on the cotangents. Cast to
# varying only after ``fwd`` (as for a ``custom_vjp``), the answer of a mirrored input
# was traced invariant: per-replica cotangents then ran through a jaxpr typed for one
# value, a nested ``jit`` (``jnp.clip``) typed its result invariant, and the sum of the
# mirrored input's cotangent over the replicas was skipped (each replica kept its own
# gradient), or ``3.0 * g`` failed to type. So ``fun`` (in the closures' shared cell,
# also the primal function's: called outside ``fwd`` it keeps JAX's types) is wrapped
# once to return its answer varying while ``fwd`` runs.
_IN_GRADIENT_FWD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "in_gradient_fwd", default=False)


def _custom_gradient_fun(fwd: Any) -> Any:
    """The cell holding ``fun`` of a ``jax.custom_gradient`` ``fwd`` rule, or ``None``."""
    code = getattr(fwd, "__code__", None)
    if code is None or not getattr(fwd, "__qualname__", "").startswith("custom_gradient.") \
            or "fun" not in code.co_freevars or fwd.__closure__ is None:
        return None
    return fwd.__closure__[code.co_freevars.index("fun")]


def _varying_answer(fun: Any) -> Any:
    """``fun`` (a ``custom_gradient`` function: ``x -> (answer, gradient function)``)
    returning its inexact answer varying over the mesh axes while a ``fwd`` rule runs it
    (:data:`_IN_GRADIENT_FWD`, reset for the calls inside ``fun``)."""
    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        in_fwd = _IN_GRADIENT_FWD.get()
        token = _IN_GRADIENT_FWD.set(False)
        try:
            ans, rule = fun(*args, **kwargs)
        finally:
            _IN_GRADIENT_FWD.reset(token)
        return (_inexact_varying(ans) if in_fwd else ans), rule
    wrapped._replicate_hlo = True
    return wrapped


def _inexact_varying(tree: Any) -> Any:
    """``tree`` with its inexact leaves typed varying over every manual mesh axis
    (values unchanged)."""
    axes = _mesh_axis_names()
    return jax.tree.map(lambda x: to_varying(x, axes) if _is_inexact(x) else x, tree)


def _is_inexact(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def _install_per_replica_cotangents(cd: Any, state: Any) -> None:
    """While a replica is traced, a differentiated ``custom_vjp`` function's outputs (its
    ``fwd`` rule's) are per-replica values (cast, values unchanged), so its backward
    function receives each replica's own cotangent, as under ``jax.pmap`` and in TF's
    replica context; called without a derivative (``fun``) it keeps JAX's types. An output JAX
    proves identical on every replica (``psum`` inside the function, or mirrored inputs
    only) would otherwise get the cotangents of every replica already summed (the
    transpose of its implicit cast to varying: ``jax.shard_map``'s convention), and a
    backward function written per replica (pmap's ``psum(g)``, a gradient clip) would
    silently count or clip that sum. Its cotangents of mirrored inputs are then summed
    over the replicas (``_sum_extra_axes``), as JAX sums a mirrored value's."""
    orig = cd.custom_vjp.__call__

    @functools.wraps(orig)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if state.value != "replica" or not self.fwd or not _mesh_axis_names():
            return orig(self, *args, **kwargs)
        per_replica = object.__new__(type(self))  # (copy.copy needs __new__'s arguments)
        per_replica.__dict__.update(self.__dict__)
        per_replica.fwd = _varying_outputs(self.fwd)  # (``fun`` alone: JAX's types)
        token = _FWD_CAST.set(True)
        try:
            return orig(per_replica, *args, **kwargs)
        finally:
            _FWD_CAST.reset(token)

    __call__._replicate_hlo = True
    cd.custom_vjp.__call__ = __call__
    _install_fwd_type_check(cd)


# When ``fun`` was traced before ``fwd`` runs (under ``jax.checkpoint``, whose body is
# staged before it is differentiated), two things see ``fun``'s invariant types where
# ``fwd``'s outputs are now varying, and ``jax.jit`` runs what they refuse:
# - JAX checks that ``fwd``'s primal outputs have ``fun``'s types ("Custom VJP fwd rule
#   ... must produce a pair"). While the cast applies (``_FWD_CAST``), the check is given
#   ``fun``'s types cast the same way (inexact ones varying over every mesh axis): it
#   still catches a ``fwd`` whose outputs differ from ``fun``'s in shape or dtype.
# - the staged body casts ``fun``'s output to varying where it meets per-replica values
#   (``pvary``), and that cast, rebound on the now varying output while the body is
#   differentiated, is refused ("pvary is a invariant->variant collective"). A cast to
#   varying over axes a value varies over already is the identity, and so is its
#   transpose: the output's cotangent stays each replica's own, exactly as when ``fun``
#   is not staged first and no cast is traced at all. While a replica is traced, such a
#   rebind drops those axes.
_FWD_CAST: contextvars.ContextVar[bool] = contextvars.ContextVar("fwd_cast", default=False)


def _install_fwd_type_check(cd: Any) -> None:
    orig = cd._flatten_fwd
    if getattr(orig, "_replicate_hlo", False):
        return
    _install_idempotent_pvary()

    def patched(fwd, *params):
        if not _FWD_CAST.get():
            return orig(fwd, *params)
        *rest, maybe_out_type = params
        axes = _mesh_axis_names()

        def cast_type():
            tree, avals, *more = maybe_out_type()
            avals = [_varying_aval(a, axes) if _is_inexact(a) else a for a in avals]
            return (tree, avals, *more)
        return orig(fwd, *rest, cast_type)

    patched._replicate_hlo = True
    cd._flatten_fwd = patched


def _install_idempotent_pvary() -> None:
    """While a replica is traced, ``pvary`` over axes its operand varies over already
    casts over the others only (the identity when none is left): see the comment above."""
    from jax._src import core as jcore
    state = _grad_mode_state()

    def bind(orig, x, *, axes, **params):
        # (also wherever sizes are per replica: a zero made to a size is varying already)
        if (state.value != "off" or _DIM_VALUE_AXES.get() is not None) and \
                isinstance(axes, tuple):
            have = varying_axes(jax.typeof(x))
            if have.intersection(axes):
                axes = tuple(a for a in axes if a not in have)
                if not axes:
                    return x
        return orig(x, axes=axes, **params)
    _wrap_bind(jcore.pvary_p, bind)


def _varying_aval(aval: Any, axes: frozenset) -> Any:
    """``aval`` varying over ``axes`` too (its type after :func:`to_varying`)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is None:
        return aval
    return aval.update(manual_axis_type=type(mat)(
        varying=frozenset(mat.varying) | axes, unreduced=mat.unreduced, reduced=mat.reduced))


# Collectives over a ``vmap`` axis inside ``shard_map(check_vma=True)`` (the trace of every
# step: trace.py). ``jax.vmap(f, axis_name="i")`` where ``f`` calls ``lax.pmean(x, "i")``
# (equinox's BatchNorm(axis_name=...), per-example code) crashes there in JAX 0.10 and
# 0.11 alike: ``pvary`` asserts that every axis it casts over is a mesh axis, and the
# batching rule of ``psum``/``pmax``/``pmin`` rebinds them with a positional axis, which
# the check_vma abstract evaluation refuses. jax.pmap and shard_map(check_vma=False) do
# not type values, so they do not hit it. The patch below changes JAX only where it
# would crash: ``pvary`` over names that are not axes of the current mesh (vmap axes:
# varying along them is what batching already tracks) casts over the mesh axes alone,
# and a reduction over a vmap axis of a batched value becomes a plain reduction over
# the batch dimension, then the collective over the remaining (mesh) axes.
def _mesh_axis_names() -> frozenset:
    from jax._src import mesh as mesh_lib
    m = mesh_lib.get_abstract_mesh()
    return frozenset() if m.empty else frozenset(m.axis_names)


def _only_vmap_extras(axes: tuple) -> frozenset | None:
    """The current mesh's axis names when every name in ``axes`` that is not one of them
    is a bound (vmap) axis and there is at least one such name; else ``None`` (JAX's own
    behaviour applies: no mesh, only mesh axes, or an unknown name it reports)."""
    from jax._src import core as jcore
    mesh_axes = _mesh_axis_names()
    if not mesh_axes:
        return None
    extra = [a for a in axes if not isinstance(a, int) and a not in mesh_axes]
    if not extra:
        return None
    env = jcore.get_axis_env()
    return mesh_axes if all(env.axis_exists(a) for a in extra) else None


def install_vmap_axis_collectives() -> None:
    """Install the patch described above (idempotent)."""
    from jax._src import core as jcore
    from jax._src.interpreters import batching
    from jax._src.lax import lax as jlax
    from jax._src.lax import parallel as par

    if getattr(jcore.pvary, "_replicate_hlo", False):
        return
    orig_pvary = jcore.pvary

    def pvary(x, axis_name):
        axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        mesh_axes = _only_vmap_extras(axes) if axis_name else None
        if mesh_axes:
            axes = tuple(a for a in axes if a in mesh_axes)
            return orig_pvary(x, axes) if axes else x
        return orig_pvary(x, axis_name)

    pvary._replicate_hlo = True
    jcore.pvary = pvary
    par.pvary = pvary
    try:
        from jax._src import shard_map as _sm
        if getattr(_sm, "pvary", None) is orig_pvary:
            _sm.pvary = pvary
    except ImportError:  # pragma: no cover - moved
        pass

    if hasattr(par, "_get_from"):
        orig_get_from = par._get_from

        def get_from(aval, axes, name):
            # what a collective does is decided by the mesh axes; a vmap axis is batching's
            mesh_axes = _only_vmap_extras(tuple(axes))
            if mesh_axes:
                axes = tuple(a for a in axes if a in mesh_axes)
                if not axes:
                    return "varying"
            return orig_get_from(aval, axes, name)

        par._get_from = get_from

    orig_eval = par._psum_invariant_abstract_eval

    def invariant_eval(name, aval, *, axes):
        # a staged reduction over a vmap axis (linearize under vmap) types like one over
        # its mesh axes; batching rewrites it into a reduction over the batch dimension
        mesh_axes = _only_vmap_extras(tuple(axes))
        if mesh_axes and not any(isinstance(a, int) for a in axes):
            on_mesh = tuple(a for a in axes if a in mesh_axes)
            out, effects = orig_eval(name, aval, axes=on_mesh) if on_mesh else (aval, set())
            return out, set(effects) | {jcore.NamedAxisEffect(a) for a in axes
                                        if a not in mesh_axes}
        return orig_eval(name, aval, axes=axes)

    par._psum_invariant_abstract_eval = invariant_eval      # pmax / pmin look it up
    par.psum_invariant_p.def_effectful_abstract_eval(
        functools.partial(invariant_eval, par.psum_invariant_p.name))

    from jax._src.interpreters import ad
    orig_transpose = ad.primitive_transposes.get(par.psum_invariant_p)

    def invariant_transpose(cts, arg, *, axes):
        # reached by jax.vmap(jax.grad(f)) when f reduces over the vmap axis: each
        # example's gradient would need every other example's contribution, which has no
        # per-example meaning (jax.pmap silently sums them; JAX's own check crashes)
        mesh_axes = _only_vmap_extras(tuple(axes))
        vmap_axes = [a for a in axes if not isinstance(a, int) and a not in (mesh_axes or ())]
        if mesh_axes and vmap_axes:
            raise ValueError(
                f"a gradient taken inside vmap flows back through a collective over the vmap "
                f"axis {vmap_axes[0]!r} (jax.vmap(jax.grad(f)) where f calls lax.psum / "
                f"pmean over {vmap_axes[0]!r}): per-example gradients of a loss that mixes "
                f"the examples are not defined; take the gradient outside the vmap "
                f"(jax.grad(lambda w: jax.vmap(f, axis_name={vmap_axes[0]!r})(...).sum())), "
                f"or compute the collective outside the differentiated function")
        return orig_transpose(cts, arg, axes=axes)

    if orig_transpose is not None:
        ad.primitive_transposes[par.psum_invariant_p] = invariant_transpose

    reducers = {par.psum_invariant_p: (jlax.reduce_sum_p, lambda v, n: n * v)}
    if hasattr(par, "pmax_p"):
        reducers[par.pmax_p] = (jlax.reduce_max_p, lambda v, n: v)
    if hasattr(par, "pmin_p"):
        reducers[par.pmin_p] = (jlax.reduce_min_p, lambda v, n: v)
    reduce_fns = {jlax.reduce_sum_p: jlax.reduce_sum, jlax.reduce_max_p: jlax.reduce_max,
                  jlax.reduce_min_p: jlax.reduce_min}
    for prim, (red, _unmapped) in reducers.items():
        orig_rule = batching.fancy_primitive_batchers[prim]

        def rule(axis_data, vals_in, dims_in, *args, _prim=prim, _red=red, _orig=orig_rule,
                 **params):
            axes = params.get("axes", args[0] if args else ())
            (v,), (d,) = vals_in, dims_in
            mesh_axes = _mesh_axis_names()
            if (d is None or axis_data.name not in axes or not mesh_axes
                    or axis_data.name in mesh_axes or params.get("axis_index_groups")):
                return _orig(axis_data, vals_in, dims_in, *args, **params)
            out = reduce_fns[_red](v, (d,))       # over the vmap axis: the batch dimension
            rest = tuple(a for a in axes if a != axis_data.name)
            if rest:
                out = _prim.bind(out, **{**params, "axes": rest})
            return out, None

        batching.fancy_primitive_batchers[prim] = rule


# Derivatives of cumprod / cummax / cummin / cumlogsumexp at a symbolic size (dynamic
# shapes: the step is traced once with axis 0 a dim variable). JAX differentiates them
# with ``associative_scan``, which needs a constant size ("associative scan over axis of
# non-constant size"). While such a step is traced, their JVP is instead two opaque
# primitives, ``cumulative_jvp(x, t)`` and its transpose ``cumulative_vjp(x, ct)``, typed
# like ``t`` / ``x``; they lower to JAX's own associative-scan derivative, which by then
# runs at the bucket's constant size. The padding pass masks their operands (x to the
# op's identity, t and ct to 0) along a padded axis, so padding never reaches real rows.
_SYMBOLIC_CUMULATIVE = contextvars.ContextVar("symbolic_cumulative", default=False)
_CUM_PRIMS: dict[str, Primitive] = {}


def _cumulative_scan(kind: str, axis: int, reverse: bool) -> Any:
    import jax.numpy as jnp
    combine = {"cumprod": jax.lax.mul, "cummax": jax.lax.max, "cummin": jax.lax.min,
               "cumlogsumexp": jnp.logaddexp}[kind]
    return functools.partial(jax.lax.associative_scan, combine, axis=axis, reverse=reverse)


def _align_varying(*xs: Any) -> list:
    """``xs`` cast to the union of their varying manual axes (values unchanged)."""
    axes = frozenset().union(*(varying_axes(jax.typeof(x)) for x in xs))
    return [to_varying(x, axes) for x in xs]


class CumulativeDerivativeTwice(NotImplementedError):
    """A derivative of ``cumulative_jvp`` or ``cumulative_vjp`` (``op``): a second
    derivative of a cumulative op traced with dynamic dims, which they do not have."""

    def __init__(self, op: str):
        super().__init__(f"Differentiation rule for {op!r} not implemented")
        self.op = op


def cumulative_derivative_primitives() -> tuple[Primitive, Primitive]:
    """``(cumulative_jvp, cumulative_vjp)``, defined once (see the comment above)."""
    if _CUM_PRIMS:
        return _CUM_PRIMS["jvp"], _CUM_PRIMS["vjp"]
    from jax._src.interpreters import ad, batching, mlir

    jvp_p, vjp_p = Primitive("cumulative_jvp"), Primitive("cumulative_vjp")

    def jvp_impl(x, t, *, kind, axis, reverse):
        return jax.jvp(_cumulative_scan(kind, axis, reverse), (x,), (t,))[1]

    def vjp_impl(x, ct, *, kind, axis, reverse):
        return jax.vjp(_cumulative_scan(kind, axis, reverse), x)[1](ct)[0]

    for p, impl, which in ((jvp_p, jvp_impl, 1), (vjp_p, vjp_impl, 1)):
        p.def_impl(impl)
        p.def_abstract_eval(lambda *avals, _i=which, **params: avals[_i])
        mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))

        def batch(args, dims, *, _p=p, kind, axis, reverse):
            size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
            moved = [batching.moveaxis(a, d, 0) if d is not None else
                     jax.numpy.broadcast_to(a, (size,) + a.shape) for a, d in zip(args, dims)]
            return _p.bind(*moved, kind=kind, axis=axis + 1, reverse=reverse), 0
        batching.primitive_batchers[p] = batch

        def no_jvp(primals, tangents, *, _name=p.name, **params):
            raise CumulativeDerivativeTwice(_name)
        ad.primitive_jvps[p] = no_jvp

    def jvp_transpose(ct, x, t, *, kind, axis, reverse):
        if type(ct) is ad.Zero:
            return [None, ad.Zero(t.aval)]
        x, ct = _align_varying(x, ct)
        return [None, vjp_p.bind(x, ct, kind=kind, axis=axis, reverse=reverse)]

    def vjp_transpose(ct, x, c, *, kind, axis, reverse):
        if type(ct) is ad.Zero:
            return [None, ad.Zero(c.aval)]
        x, ct = _align_varying(x, ct)
        return [None, jvp_p.bind(x, ct, kind=kind, axis=axis, reverse=reverse)]

    ad.primitive_transposes[jvp_p] = jvp_transpose
    ad.primitive_transposes[vjp_p] = vjp_transpose
    _CUM_PRIMS.update(jvp=jvp_p, vjp=vjp_p)
    _PRIMITIVES.update({jvp_p.name: jvp_p, vjp_p.name: vjp_p})
    return jvp_p, vjp_p


def install_symbolic_cumulative_rules() -> None:
    """Route the JVPs of cumprod / cummax / cummin / cumlogsumexp through the primitives
    above while :func:`symbolic_cumulative` is on (idempotent; JAX's rules otherwise)."""
    from jax._src.interpreters import ad
    from jax._src.lax.control_flow import loops

    jvp_p, _ = cumulative_derivative_primitives()
    for kind in ("cumprod", "cummax", "cummin", "cumlogsumexp"):
        prim = getattr(loops, f"{kind}_p")
        orig = ad.primitive_jvps[prim]
        if getattr(orig, "_replicate_hlo", False):
            continue

        def rule(primals, tangents, *, axis, reverse, _prim=prim, _kind=kind, _orig=orig):
            if not _SYMBOLIC_CUMULATIVE.get():
                return _orig(primals, tangents, axis=axis, reverse=reverse)
            (x,), (t,) = primals, tangents
            y = _prim.bind(x, axis=axis, reverse=reverse)
            if type(t) is ad.Zero:
                return y, ad.Zero(t.aval)
            x, t = _align_varying(x, t)
            return y, jvp_p.bind(x, t, kind=_kind, axis=axis, reverse=reverse)

        rule._replicate_hlo = True
        ad.primitive_jvps[prim] = rule


@contextlib.contextmanager
def symbolic_cumulative():
    """While a step with symbolic sizes is traced (see above)."""
    install_symbolic_cumulative_rules()
    token = _SYMBOLIC_CUMULATIVE.set(True)
    try:
        yield
    finally:
        _SYMBOLIC_CUMULATIVE.reset(token)


# -- a dynamic size is per replica ---------------------------------------------------
# Traced with symbolic sizes, a step sees each dynamic dim as one expression (``b``),
# which JAX takes for the same number on every device of the mesh: its value
# (``dim_as_value``: ``jnp.mean``'s count, ``x.shape[0]`` in arithmetic) is typed
# invariant, so ``lax.psum(x.shape[0], axis)`` gave ``N * b`` (a constant-folded sum, or
# the sum of an invariant value) and ``pmean`` gave ``b``: each replica its own wrong
# total, where the replicas' real sizes differ (``5 + 3`` gave 10 and 6, silently: flax's
# sst2 ``count`` metric). While :func:`per_replica_dim_values` is on, such a value is
# typed varying over the replica axis, and a ``psum`` of bare sizes sums those values.
_DIM_VALUE_AXES: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "dim_value_axes", default=None)


def _dim_value_axes() -> frozenset | None:
    """The axes a size's value varies over here: the replica axis while
    :func:`per_replica_dim_values` is on and the current mesh has it, else ``None``."""
    axes = _DIM_VALUE_AXES.get()
    if axes is None:
        return None
    return frozenset(axes) & _mesh_axis_names() or None


def _split_symbolic_axes(x: Any, axis_name: Any, groups: Any) -> tuple[Any, tuple] | None:
    """For a ``psum`` of constants (no tracer among ``x``'s leaves) over named axes of
    which some have a symbolic size (a ``vmap`` over a dynamic dim): the product of those
    sizes and the other axes; else ``None``. ``lax.pmean`` divides by ``psum(1, axes)``,
    and over a ``vmap`` axis of dynamic size (equinox's ``BatchNorm(axis_name=...)``)
    JAX's constant case turned the size into an ``int`` (an error, where the same mean's
    sum of tracers worked)."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    leaves = jax.tree.leaves(x)
    if groups is not None or not leaves or any(isinstance(a, int) for a in names) or any(
            isinstance(v, _core.Tracer) for v in leaves):
        return None
    env = _core.get_axis_env()
    sym = [a for a in names if is_symbolic_dim(env.axis_size(a))]
    if not sym:
        return None
    return math.prod(env.axis_size(a) for a in sym), tuple(a for a in names if a not in sym)


def _install_per_replica_dim_values() -> None:
    """Wrap the type of a bare size, ``parallel._psum`` (whose constant case would multiply
    a bare size by N without converting it) and ``parallel.insert_collective_pvary`` (the
    other collectives' cast of their operand, which would take a bare size for an
    invariant value); idempotent, and JAX's own behaviour while the context is off. (A
    size's value, ``dim_as_value``, is cast by the ``Primitive.bind`` hook below: its
    ``dim`` param holds a size.)"""
    from jax._src.export import shape_poly
    from jax._src.lax import parallel

    orig_psum, orig_pvary = parallel._psum, parallel.insert_collective_pvary
    if getattr(orig_psum, "_replicate_hlo", False):
        return

    def as_values(x):
        if _DIM_VALUE_AXES.get() is None:
            return x
        return jax.tree.map(lambda v: _core.dimension_as_value(v) if is_symbolic_dim(v)
                            else v, x)

    def psum(x, axis_name, *, axis_index_groups, is_async):
        split = _split_symbolic_axes(x, axis_name, axis_index_groups)
        if split is not None:  # (JAX's constant case would take the size for an int)
            # each replica's own size (a value), then summed over the other axes: over
            # ("batch", replica axis) the count is the sum of the replicas' sizes
            n = _core.dimension_as_value(split[0])
            x = jax.tree.map(lambda v: jax.lax.convert_element_type(
                n, np.int32 if np.asarray(v).dtype == np.bool_ else jax.numpy.result_type(v))
                * v, x)
            if not split[1]:
                return x
            axis_name = split[1]
        return orig_psum(as_values(x), axis_name, axis_index_groups=axis_index_groups,
                         is_async=is_async)

    def insert_collective_pvary(axis_name, x):  # (pmax, pmin, all_gather...: JAX would
        # type a bare size invariant, then cast a value that already varies)
        return orig_pvary(axis_name, as_values(x))

    # the type JAX gives a bare size (``jax.typeof(b)``): what a ``jax.jit``-ed function
    # (``jnp.maximum(b, 1)``) is traced for, whose result would stay invariant
    orig_aval = _core.pytype_aval_mappings[shape_poly._DimExpr]

    def dim_aval(dim):
        aval = orig_aval(dim)
        axes = _dim_value_axes()
        if axes is None:
            return aval
        # (JAX's has no mesh: a scalar of the current one, varying over the axis)
        return _varying_aval(aval.update(sharding=_core.get_cur_mesh_sharding()), axes)

    psum._replicate_hlo = insert_collective_pvary._replicate_hlo = True
    parallel._psum, parallel.insert_collective_pvary = psum, insert_collective_pvary
    _core.pytype_aval_mappings[shape_poly._DimExpr] = dim_aval


# The same holds of any value whose shape a primitive makes from a size rather than from
# its operands' shapes: ``jnp.ones(b)``, ``jnp.arange(b)``, ``broadcast_to(w, (b, d))``,
# ``w[b % 3]`` (a slice at a symbolic start), ``dynamic_slice(table, i, b)``: JAX types it
# as its operands (invariant, for a mirrored weight or a constant), yet each replica's
# holds its own number of rows, so ``jnp.ones(b).sum() * w`` summed the gradient over the
# replicas before multiplying it by each replica's own count (each replica got a wrong
# gradient of its own, no error). Such a primitive's array operands are cast to varying
# first: its result varies, and a gradient's sum comes where the operand (of a static
# shape) meets it, as for any per-replica use of a mirrored value.
def _mentions_size(v: Any) -> bool:
    if isinstance(v, (tuple, list)):
        return any(_mentions_size(u) for u in v)
    return is_symbolic_dim(v)


def _install_per_replica_shapes() -> None:
    """Route ``Primitive.bind`` (the class's: every primitive that does not define its
    own, which only call-like ones do) through the cast above while the context is on;
    one context-variable read per bind otherwise (idempotent)."""
    orig = _core.Primitive.bind
    if getattr(orig, "_replicate_hlo", False):
        return

    def bind(self, *args, **params):
        if _DIM_VALUE_AXES.get() is None or not any(
                _mentions_size(v) for v in params.values()) or any(
                isinstance(v, (_core.Jaxpr, _core.ClosedJaxpr)) for v in params.values()):
            return orig(self, *args, **params)  # (loops, calls: their bodies are typed)
        axes = _dim_value_axes()
        if axes is None:
            return orig(self, *args, **params)
        traced = any(isinstance(a, _core.Tracer) for a in args)
        if traced:  # (constants too: a table sliced at a traced start)
            args = [to_varying(a, axes) if isinstance(a, (_core.Tracer, jax.Array, np.ndarray))
                    else a for a in args]
        out = orig(self, *args, **params)
        if not traced:  # (``iota``, a broadcast constant: nothing to cast but the result)
            out = [to_varying(o, axes) for o in out] if self.multiple_results \
                else to_varying(out, axes)
        return out
    bind._replicate_hlo = True
    _core.Primitive.bind = bind


@contextlib.contextmanager
def per_replica_dim_values(axis_name: str):
    """While a step with symbolic sizes is traced over the replica axis ``axis_name``:
    the values of its sizes vary over that axis (see above)."""
    _install_per_replica_dim_values()
    _install_per_replica_shapes()
    _install_idempotent_pvary()  # (JAX's own casts of what is varying already)
    token = _DIM_VALUE_AXES.set((axis_name,))
    try:
        yield
    finally:
        _DIM_VALUE_AXES.reset(token)


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


# -- multi-process ----------------------------------------------------------------------
def distributed_client() -> Any:
    """``jax.distributed``'s client of the coordination service (its key-value store), or
    ``None`` when this process has not joined others (JAX has no public handle to it)."""
    try:
        from jax._src import distributed as _d
        return _d.global_state.client
    except Exception:  # noqa: BLE001 - the private state moved: as if not initialized
        return None


def distributed_initialized() -> bool:
    """Whether ``jax.distributed.initialize`` has run in this process (JAX has no public
    query for it in 0.10 or 0.11)."""
    return distributed_client() is not None
