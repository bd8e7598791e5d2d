"""The registered passes, by pipeline name, and the default pipeline."""
from __future__ import annotations

from compiler.passes.cross_replica_sum import CrossReplicaSumPass
from compiler.passes.dce import DCEPass
from compiler.passes.hoist_collectives import HoistCollectivesPass
from compiler.passes.padding import PaddingPass
from compiler.passes.replication import ReplicationPass
from compiler.passes.sharding import ShardingPass

PASSES = {
    "replication": ReplicationPass,
    "hoist-collectives": HoistCollectivesPass,
    "cross-replica-sum": CrossReplicaSumPass,
    "sharding": ShardingPass,
    "padding": PaddingPass,
    "dce": DCEPass,
}

DEFAULT_PIPELINE = "replication,hoist-collectives,cross-replica-sum,sharding,dce"

__all__ = ["PASSES", "DEFAULT_PIPELINE", "ReplicationPass", "CrossReplicaSumPass", "HoistCollectivesPass", "ShardingPass", "DCEPass", "PaddingPass"]
