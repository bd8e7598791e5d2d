"""Sharding annotations inside a replica (TPUStrategy's ``experimental_assign_to_logical_device``,
``experimental_split_to_logical_devices``, ``experimental_replicate_to_logical_devices``).

Each returns a value equal to its input and records, as a ``shard`` op in the IR, how the
value is laid out over the replica's K logical devices. Specs are validated here, at
trace time, with TPUStrategy's rules; every error is a ``ValueError`` naming the numbers
and the user's source line, before XLA sees anything.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any, Sequence

import numpy as np

from compiler.trace import CURRENT_LOGICAL_DEVICES, SHARD as shard_p
from ir.types import Sharding


def _where() -> str:
    """``file.py:line`` of the user's call (the first frame outside this module)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f else "<unknown>"


def _logical_devices(fn: str) -> int:
    k = CURRENT_LOGICAL_DEVICES.get()
    if k is None:
        raise RuntimeError(f"{fn}() can only be called inside a function run by replicate()")
    return k


def num_logical_devices() -> int:
    """K, the number of logical devices of each replica (a Python int), inside a step: a
    model written with ``split_to_logical_devices(w, [1, rt.num_logical_devices()])`` runs
    for any K (``replicate-inspect --sweep`` tries them all)."""
    return _logical_devices("num_logical_devices")


def assign_to_logical_device(x: Any, logical_device_id: int) -> Any:
    """Place ``x`` on one logical device of the replica (XLA's maximal sharding)."""
    k = _logical_devices("assign_to_logical_device")
    if (not isinstance(logical_device_id, (int, np.integer)) or isinstance(logical_device_id, bool)
            or not 0 <= logical_device_id < k):
        raise ValueError(f"assign_to_logical_device: logical device {logical_device_id!r} is "
                         f"outside [0, {k}) for a replica of {k} logical devices ({_where()})")
    return shard_p.bind(x, sharding=Sharding.maximal(int(logical_device_id)), annotation="assign")


def split_to_logical_devices(x: Any, partition_dimensions: Sequence[int],
                             partial: bool = False) -> Any:
    """Split ``x`` over the replica's logical devices: dim i into ``partition_dimensions[i]``
    tiles, tile order ``np.arange(K).reshape(partition_dimensions)`` (TF's).

    With ``partial=True`` the product of the dims may be a divisor of K: each tile is
    then replicated over K / product devices (XLA's ``last_tile_dim_replicate``)."""
    k = _logical_devices("split_to_logical_devices")
    if not isinstance(partition_dimensions, (list, tuple)) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool)
            for d in partition_dimensions):
        raise TypeError(f"split_to_logical_devices: partition_dimensions must be a list of "
                        f"ints, one per dimension of the tensor (e.g. [1, {k}]), got "
                        f"{partition_dimensions!r} ({_where()})")
    dims = [int(d) for d in partition_dimensions]
    shape = tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)
    where = _where()
    if len(dims) != len(shape):
        raise ValueError(f"split_to_logical_devices: partition_dimensions {dims} has length "
                         f"{len(dims)} but the tensor has rank {len(shape)} ({where})")
    for i, (size, d) in enumerate(zip(shape, dims)):
        if d < 1:
            raise ValueError(f"split_to_logical_devices: partition_dimensions {dims} has a "
                             f"non-positive entry {d} at dimension {i} ({where})")
        if isinstance(size, int) and size % d:
            raise ValueError(f"split_to_logical_devices: dimension {i} of size {size} is not "
                             f"divisible by its split {d} (partition_dimensions {dims}, {where})")
    prod = math.prod(dims)
    if partial:
        if k % prod:
            raise ValueError(f"split_to_logical_devices: product of partition_dimensions {dims} "
                             f"is {prod}, which does not divide the replica's {k} logical "
                             f"devices ({where})")
    elif prod != k:
        raise ValueError(f"split_to_logical_devices: product of partition_dimensions {dims} is "
                         f"{prod} but the replica has {k} logical devices ({where})")
    if partial and prod != k:
        sharding = Sharding("tiled", tuple(dims) + (k // prod,), tuple(range(k)),
                            last_tile_dim_replicate=True)
    else:
        sharding = Sharding("tiled", tuple(dims), tuple(range(k)))
    return shard_p.bind(x, sharding=sharding, annotation="split")


def replicate_to_logical_devices(x: Any) -> Any:
    """Keep a full copy of ``x`` on every logical device of the replica."""
    _logical_devices("replicate_to_logical_devices")
    return shard_p.bind(x, sharding=Sharding.replicated(), annotation="replicate")
