"""Tier 4: `ShardedOptimizer`, a distributed optimizer whose state is kept in N replicated instances.

The replicas are what a replacement is restored from; the transfer itself is `restart.recovery`'s. This package
does not import `restart/` (the optimizer takes any object with the two collectives it runs).
"""

from nemo_checkpointless.replication.sharded_optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
