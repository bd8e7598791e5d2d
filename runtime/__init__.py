"""The public API: ``import runtime as rt``.

    step = rt.replicate(fn, num_replicas=None, logical_devices=1, devices=None,
                        loss_reduction="mean", options=rt.RunOptions())
    out = step(*args)      # rt.PerReplica args vary per replica; others are mirrored
"""
from __future__ import annotations

from runtime.annotations import (assign_to_logical_device, num_logical_devices,
                                 replicate_to_logical_devices, split_to_logical_devices)
from runtime.cache import CacheInfo
from runtime.collectives import (all_gather, all_reduce, all_to_all, local, num_replicas,
                                 ppermute, psum_scatter, replica_id)
from runtime.divergence import DivergingStateWarning
from runtime.per_replica import PerReplica, distribute, reduce
from runtime.replicate import Replicated, RunOptions, replicate
from runtime.stages import Compiled, Lowered
from runtime.distributed import ProcessMismatchError, initialize_distributed
from runtime.iterators import (DistributedIterator, ValueContext, distribute_iterator,
                               distribute_steps, distribute_values_from_function)
from runtime.sync_on_read import SyncOnRead
from runtime.dynamic import distribute_uneven
from runtime import tpu
from runtime.tpu import CompileOnlyError, DoesNotFitError, tpu_devices
from ir.errors import ShardingConstraintError

__all__ = [
    "replicate", "Replicated", "RunOptions", "PerReplica", "distribute", "reduce",
    "replica_id", "num_replicas", "local", "all_reduce", "all_gather", "all_to_all",
    "psum_scatter", "ppermute",
    "assign_to_logical_device", "split_to_logical_devices", "num_logical_devices", "replicate_to_logical_devices",
    "Lowered", "Compiled", "CacheInfo",
    "distribute_iterator", "DistributedIterator", "distribute_values_from_function",
    "ValueContext", "distribute_steps", "SyncOnRead", "initialize_distributed", "ProcessMismatchError",
    "distribute_uneven", "tpu", "tpu_devices", "CompileOnlyError", "DoesNotFitError",
    "DivergingStateWarning", "ShardingConstraintError",
]
