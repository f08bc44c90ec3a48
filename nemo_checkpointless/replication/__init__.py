"""Tier 4: N replicated instances of the sharded optimizer state, and (later) peer-to-peer transfer from them."""

from nemo_checkpointless.replication.sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
