"""Who replicates whom: pure rank-layout functions for Megatron-style parallelism with N replicated
distributed-optimizer instances (``num_distributed_optimizer_instances``), and peer-recovery planning."""

from nemo_checkpointless.topology.layout import (
    ParallelDims,
    RankInfo,
    RecoveryPlan,
    context_parallel_groups,
    data_parallel_groups,
    pipeline_parallel_groups,
    plan_recovery,
    rank_info,
    replica_groups,
    shard_groups,
    tensor_parallel_groups,
)

__all__ = [
    "ParallelDims",
    "RankInfo",
    "RecoveryPlan",
    "context_parallel_groups",
    "data_parallel_groups",
    "pipeline_parallel_groups",
    "plan_recovery",
    "rank_info",
    "replica_groups",
    "shard_groups",
    "tensor_parallel_groups",
]
