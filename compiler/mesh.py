"""The device mesh of a replicated step, and shardings over it.

The mesh is ``('replica', *model_axes)``: the K logical devices of a replica are split
into prime-factor axes (``model`` when K is 1 or prime, else ``model_0``, ``model_1``, ...
major to minor), so any tiling whose tile order is TF's ``np.arange(K).reshape(dims)``
maps onto mesh axes: dim i takes the next factors, in order, whose product is its tile
count.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from compiler.errors import LoweringError
from ir.jaxpr_import import REPLICA_AXIS
from ir.types import Sharding


def prime_factors(k: int) -> list[int]:
    out, f = [], 2
    while f * f <= k:
        while k % f == 0:
            out.append(f)
            k //= f
        f += 1
    if k > 1:
        out.append(k)
    return out


def model_axes(k: int) -> tuple[tuple[str, int], ...]:
    """(name, size) of the model mesh axes for K logical devices."""
    factors = prime_factors(k) or [1]
    if len(factors) == 1:
        return (("model", factors[0]),)
    return tuple((f"model_{i}", f) for i, f in enumerate(factors))


def model_spec(sharding: Sharding | None, rank: int, k: int, where: str = "") -> list[Any]:
    """Per-dimension mesh axes (a tuple of model axis names, or None) for ``sharding``."""
    dims: list[Any] = [None] * rank
    if sharding is None or sharding.kind != "tiled" or k == 1:
        return dims
    axes = list(model_axes(k))
    tiles = list(sharding.tile_dims)
    if sharding.last_tile_dim_replicate:
        tiles = tiles[:-1]
    if len(tiles) != rank:
        raise LoweringError(f"sharding {sharding} has {len(tiles)} tile dims for a rank-{rank} "
                            f"value{where}")
    if tuple(sharding.devices) != tuple(range(k)):
        raise LoweringError(f"sharding {sharding}: only TF's tile order "
                            f"np.arange({k}).reshape(...) can be lowered{where}")
    pos = 0
    for i, t in enumerate(tiles):
        names, prod = [], 1
        while prod < t and pos < len(axes):
            names.append(axes[pos][0])
            prod *= axes[pos][1]
            pos += 1
        if prod != t:
            raise LoweringError(
                f"sharding {sharding}: dimension {i} split {t} ways does not match the mesh "
                f"factors {[s for _, s in axes]} of {k} logical devices{where}")
        dims[i] = tuple(names) if names else None
    return dims


def partition_spec(sharding: Sharding | None, rank: int, k: int, varying: bool) -> P:
    """The jit-level PartitionSpec of a flat step input/output (varying: concatenated over
    replicas along axis 0, scalars stacked)."""
    if varying and rank == 0:
        return P(REPLICA_AXIS)
    try:
        dims = model_spec(sharding, rank, k)
    except LoweringError:
        # a sharding the pass propagated (never an annotation: those are checked against
        # the mesh with the user's line) that the mesh axes cannot express, such as a
        # split transposed back: whole on the replica's devices at the step's boundary
        dims = [None] * rank
    if varying:
        d0 = dims[0] or ()
        dims[0] = (REPLICA_AXIS,) + tuple(d0)
    dims = [d[0] if isinstance(d, tuple) and len(d) == 1 else d for d in dims]
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims)




def build_mesh(num_replicas: int, logical_devices: int, devices: Any = None) -> Mesh:
    """A mesh of N replicas × K logical devices: the first N·K devices, or ``devices``
    (an N×K array: device k of replica r, TF's DeviceAssignment)."""
    need = num_replicas * logical_devices
    if devices is None:
        devices = jax.devices()[:need]
    devices = np.asarray(devices)
    if devices.size != need:
        raise ValueError(f"devices has {devices.size} entries but {num_replicas} replicas × "
                         f"{logical_devices} logical devices need {need}")
    axes = model_axes(logical_devices)
    shape = (num_replicas,) + tuple(s for _, s in axes)
    return Mesh(devices.reshape(shape), (REPLICA_AXIS,) + tuple(n for n, _ in axes),
                axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def logical_devices_of(mesh: Any) -> int:
    """K: the product of the mesh's model axes."""
    k = 1
    for name, size in zip(mesh.axis_names, mesh.axis_sizes if hasattr(mesh, "axis_sizes")
                          else mesh.devices.shape):
        if name != REPLICA_AXIS:
            k *= size
    return k
