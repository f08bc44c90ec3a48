"""Shrinking to the whole optimizer instances, and who trains whose samples meanwhile (pure functions).

With N instances, every optimizer shard lives in each of them. When ranks are lost and no spare can take their
place, the job can go on with the instances that are still whole: each of their ranks already holds its shard
and the full parameters, so nothing moves. The global batch stays the same: a rank of an instance that goes on
also trains, in the same step, the micro-batches of the rank at its shard position in each instance that was
dropped (its "served" ranks), so every global step sees the same samples as in the full world.

The number of instances that go on must divide N (so every one of them serves the same number of ranks and the
gradient accumulation is the same everywhere); whole instances beyond that are dropped too (their ranks wait,
parked, for the job to grow back).
"""

from __future__ import annotations

from collections.abc import Iterable

from nemo_checkpointless.topology.layout import ParallelDims, rank_info


def _instances(dims: ParallelDims) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in range(dims.world_size):
        out.setdefault(rank_info(dims, r).instance, []).append(r)
    return out


def shrink_layout(dims: ParallelDims, lost: Iterable[int]) -> tuple[int, ...] | None:
    """The ranks that go on training when `lost` ranks have no replacement: every rank of the largest number of
    whole instances that divides N (the lowest-numbered ones), in rank order. None when no instance is whole (or
    N = 1: there is nothing to shrink to)."""
    gone = set(lost)
    n = dims.num_instances
    whole = [i for i, ranks in sorted(_instances(dims).items()) if not gone & set(ranks)]
    keep = max((k for k in range(1, len(whole) + 1) if n % k == 0), default=0)
    if n == 1 or keep == 0 or keep == n:
        return None
    chosen = set(whole[:keep])
    return tuple(r for r in range(dims.world_size) if rank_info(dims, r).instance in chosen)


def served_ranks(dims: ParallelDims, active: Iterable[int] | None, rank: int) -> tuple[int, ...]:
    """The ranks whose micro-batches `rank` trains in each step, in rank order (its own included). With the full
    world (`active` None, or every rank) that is `rank` alone; in a shrunk world, an active rank also serves the
    rank at its shard position (and TP/PP slice) in each dropped instance: dropped instances are dealt to the
    active ones in turn, lowest first."""
    if active is None:
        return (rank,)
    active_set = set(active)
    info = rank_info(dims, rank)
    if rank not in active_set:
        return ()
    instances = sorted({rank_info(dims, r).instance for r in active_set})
    dropped = [i for i in range(dims.num_instances) if i not in instances]
    mine = [d for j, d in enumerate(dropped) if instances[j % len(instances)] == info.instance]
    return tuple(sorted([rank, *(info.replica_peers[d] for d in mine)]))
