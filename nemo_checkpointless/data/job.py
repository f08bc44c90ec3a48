"""A rank's tier-2 loader for a job run by the launcher: the shared-memory batch cache of its batch group.

Both engines call `job_loader` for our token data (the Lightning worker iterates it; the NeMo data module reads it
by step); `group_loader` serves any map-style dataset (a NeMo user's, through `nemo.data.MmapDataModule`). Each
names the job's cache from the launcher's store, keys every batch by a data version (for our data: content,
sequence length, batch layout, seed, plan), and makes the lowest rank of each batch group (the ranks that train on
the same micro-batch) its only writer.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from typing import Any

import torch

from nemo_checkpointless.config import Config
from nemo_checkpointless.data.cache import BatchCache, data_version
from nemo_checkpointless.data.indexed import IndexedTokens
from nemo_checkpointless.data.loader import BatchPlan, MmapBatchLoader
from nemo_checkpointless.data.sampling import PLAN_VERSION, GlobalBatchPlan, TokenSequences
from nemo_checkpointless.protocol import JOB_ID_KEY
from nemo_checkpointless.topology import ParallelDims, rank_info


def job_id_fallback(run_dir: str, store_port: int) -> str:
    """The cache's job id when the launcher published none: from the run dir and the store's port."""
    return hashlib.sha256(f"{run_dir}:{store_port}".encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def content_id(path: str) -> str:
    return IndexedTokens(path).content_id()


def job_loader(cfg: Config, store: torch.distributed.Store, *, rank: int, dims: ParallelDims, run_dir: str,
               store_port: int, dataset: TokenSequences, plan: GlobalBatchPlan, end_step: int,
               start_step: int | Callable[[], int] = 0, name: str = "") -> MmapBatchLoader:
    """This rank's `MmapBatchLoader` over the job's cache (`data.loader=mmap`)."""
    assert cfg.data.path is not None, "the launcher resolves data.path before starting workers"
    version = data_version(content=content_id(cfg.data.path), seq_len=cfg.data.seq_len,
                           micro_batch_size=plan.micro_batch_size, dp_size=plan.dp_size, seed=plan.seed,
                           shuffle=plan.shuffle, plan=PLAN_VERSION, num_samples=len(dataset))
    return group_loader(store, rank=rank, dims=dims, run_dir=run_dir, store_port=store_port, dataset=dataset,
                        plan=plan, end_step=end_step, version=version, cache_root=cfg.data.cache_root,
                        prefetch=cfg.data.prefetch, lookback=cfg.data.lookback, verify=cfg.data.verify,
                        start_step=start_step, name=name)


def group_loader(store: torch.distributed.Store, *, rank: int, dims: ParallelDims, run_dir: str, store_port: int,
                 dataset: Any, plan: BatchPlan, end_step: int, version: str, cache_root: str | None = None,
                 prefetch: int = 16, lookback: int = 4, verify: bool = True,
                 start_step: int | Callable[[], int] = 0, name: str = "") -> MmapBatchLoader:
    """This rank's `MmapBatchLoader` over the job's cache for any map-style `dataset` whose batches `version`
    names: the cache of the rank's batch group (its data-parallel index), whose lowest rank is its only writer."""
    # The launcher names the job (and removes its cache at the end); without one, the run dir + store port do.
    job_id = store.get(JOB_ID_KEY).decode() if store.check([JOB_ID_KEY]) else job_id_fallback(run_dir, store_port)
    dp_rank = rank_info(dims, rank).dp_rank
    group_ranks = [r for r in range(dims.world_size) if rank_info(dims, r).dp_rank == dp_rank]
    cache = BatchCache(cache_root, job_id, version, group=dp_rank)
    return MmapBatchLoader(dataset, plan, dp_rank, end_step, start_step=start_step, cache=cache,
                           writer=rank == min(group_ranks), prefetch=prefetch, lookback=lookback,
                           verify=verify, data_version=version, name=name)
