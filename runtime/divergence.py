"""State that comes in mirrored and goes out varying: the warning a step gets for it.

A training loop feeds a step's results back as its next arguments (``params, opt_state,
loss = step(params, opt_state, batch)``). When a result in the place of a mirrored
argument comes out varying across replicas (an optimizer fed a replica's own loss, as
``optax.contrib.reduce_on_plateau(...).update(..., value=loss)`` is), it comes back as a
``PerReplica``, and passed back in, every replica keeps its own copy from then on: the
copies drift apart, and nothing all-reduces a per-replica value's gradient, so the
replicas end up training apart without an error. TF refuses the same thing (updating a
``MirroredVariable`` with a per-replica value in replica context needs an aggregation);
a functional step may mean it (per-replica keys, statistics), so here it is a warning,
:class:`DivergingStateWarning`, which names the leaves and the lines that computed them.

Which results are state: result ``i`` of a step that returns a tuple or list, when
argument ``i`` came in mirrored and has the same structure, shapes and dtypes; the result
of a step that returns one container of two or more arrays (``params = step(params,
batch)``), when argument 0 came in mirrored with its structure, shapes and dtypes (one
array alone is as likely a loss as a state: not checked). Only the
first call warns (the next one passes the ``PerReplica`` in: nothing mirrored is left to
diverge); a step that returns its state elsewhere is not checked, nor one that takes an
``rt.local`` view (it asked for per-replica values: per-replica gradients or an inner
loop of its own, which may well come out in a mirrored argument's place).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings
from typing import Any, Iterator, Sequence

import jax

from ir.graph import Graph
from ir.types import Replica


class DivergingStateWarning(UserWarning):
    """A step's result in the place of a mirrored argument, of its structure, shapes and
    dtypes, comes out varying across replicas (see :mod:`runtime.divergence`)."""


#: leaves named in one warning (the rest counted)
_SHOWN = 4

#: while a step is traced (:func:`watching_local_views`): one entry per ``rt.local`` call
_LOCAL_VIEWS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "local_views", default=None)


def note_local_view() -> None:
    """``rt.local`` was called in the step being traced (it asked for per-replica values)."""
    views = _LOCAL_VIEWS.get()
    if views is not None:
        views.append(True)


@contextlib.contextmanager
def watching_local_views() -> Iterator[list]:
    """Around a step's trace: the list it yields is non-empty afterwards when the step
    took an ``rt.local`` view."""
    views: list = []
    token = _LOCAL_VIEWS.set(views)
    try:
        yield views
    finally:
        _LOCAL_VIEWS.reset(token)


def check_diverging_state(fn_name: str, in_treedef: Any, in_sigs: Sequence[tuple | None],
                          out_treedef: Any, graph: Graph) -> None:
    """Warn (:class:`DivergingStateWarning`) for each result ``i`` that has argument
    ``i``'s structure, shapes and dtypes, where argument ``i`` came in mirrored and some
    of the result's leaves are varying. ``in_treedef``: the arguments' (a tuple);
    ``in_sigs``: per argument leaf, its signature (``runtime.program.leaf_sig``: shape,
    dtype, ...) when mirrored, ``None`` when per replica; ``graph``: the program's IR
    after the passes, whose outputs are the flat results of ``out_treedef``."""
    if not _is_sequence(in_treedef):
        return
    args = in_treedef.children()
    bare = not _is_sequence(out_treedef)
    if bare:  # ``params = step(params, batch)``: the result in argument 0's place
        if out_treedef.num_leaves < 2 or not args:
            return  # (one array: as likely a loss as a state)
        outs = [out_treedef]
    else:
        outs = out_treedef.children()
    leaf = out_leaf = 0
    starts = []
    for a in args:
        starts.append(leaf)
        leaf += a.num_leaves
    for i, o in enumerate(outs):
        first_out, out_leaf = out_leaf, out_leaf + o.num_leaves
        if i >= len(args) or args[i] != o or o.num_leaves == 0:
            continue
        sigs = in_sigs[starts[i]:starts[i] + o.num_leaves]
        if any(sig is None for sig in sigs):
            continue  # per-replica in: varying out is what it was
        values = graph.outputs[first_out:out_leaf]
        if any(tuple(v.type.shape) != tuple(sig[0]) or v.type.dtype != str(sig[1])
               for v, sig in zip(values, sigs)):
            continue
        varying = [k for k, v in enumerate(values) if v.type.replica is not Replica.MIRRORED]
        if not varying:
            continue
        try:
            paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
                o.unflatten(range(o.num_leaves)))[0]]
        except Exception:  # noqa: BLE001  (a container that takes nothing but arrays)
            paths = [f" leaf {k}" for k in range(o.num_leaves)]
        named = []
        for k in varying[:_SHOWN]:
            loc = _origin(graph, values[k])
            where = f" (made at {loc.file.rsplit('/', 1)[-1]}:{loc.line})" if loc else ""
            named.append(f"result{'' if bare else f'[{i}]'}{paths[k]}{where}")
        more = f" and {len(varying) - _SHOWN} more" if len(varying) > _SHOWN else ""
        which = "its result" if bare else f"result {i}"
        warnings.warn(
            f"{fn_name}: {which} has the structure, shapes and dtypes of argument {i}, "
            f"which came in mirrored (the same on every replica), but {len(varying)} of its "
            f"{o.num_leaves} leaves come out varying across replicas: {', '.join(named)}"
            f"{more}. Passed back as argument {i}, each replica keeps its own copy from then "
            f"on and the copies drift apart (a per-replica value's gradient is not "
            f"all-reduced). If they must stay identical, reduce what they are computed from "
            f"across replicas (rt.all_reduce(x, 'mean'), lax.pmean); if they are per-replica "
            f"by design, pass them in as rt.PerReplica (or filter "
            f"rt.DivergingStateWarning).", DivergingStateWarning, stacklevel=_user_level())


def _origin(graph: Graph, value: Any) -> Any:
    """The location of the op that computed ``value`` (an output of ``graph``), looking
    through calls (a ``jax.jit``-wrapped step is one ``pjit`` op whose region holds the
    step's ops): the innermost op with a source line, or ``None``."""
    loc = None
    for _ in range(64):  # (nesting depth; a region's output is its own value)
        op = graph.producers().get(value)
        if op is None:
            return loc
        if op.loc is not None and op.loc.line:
            loc = op.loc
        region = op.regions[0] if op.regions else None
        if region is None or len(region.outputs) != len(op.results):
            return loc
        graph, value = region, region.outputs[op.results.index(value)]
    return loc


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: frames of these folders are ours or JAX's: a warning names the first frame outside them
_OWN_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("runtime", "compiler", "ir")) + (
    os.path.dirname(os.path.abspath(jax.__file__)) + os.sep, os.path.abspath(contextlib.__file__))


def _user_level() -> int:
    """``stacklevel`` for :func:`warnings.warn` called from :func:`check_diverging_state`:
    the user's line that called the step (or ``lower``), so the warning shows it and a
    filter by module applies to the user's module."""
    f, level = sys._getframe(2), 2  # (1: this function's caller's caller is level 2)
    while f is not None and f.f_code.co_filename.startswith(_OWN_DIRS):
        f, level = f.f_back, level + 1
    return level if f is not None else 2


def _is_sequence(treedef: Any) -> bool:
    """A tuple or list at the top (a step's arguments, or results returned as several)."""
    node = treedef.node_data()
    return node is not None and node[0] in (tuple, list)

