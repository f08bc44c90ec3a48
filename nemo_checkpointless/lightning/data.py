"""Tier 2 for a user's own data: their train loader's batches served through the job's shared-memory cache.

`MmapDataModule(user_datamodule)` (or `CheckpointlessStrategy(cache_batches=True)` for a plain `DataLoader`): each
rank's next `prefetch` batches are built ahead by a thread, from the user's dataset and `collate_fn` with the
indices the loader's sampler gives (Lightning's `DistributedSampler` for this rank, or the user's), and written to
the job's private cache under `/dev/shm` (`data.cache`). A replacement's first batch is then already there: the
failed rank wrote it before it died. Batches are keyed by the micro-batch counter of the run (epoch x batches per
epoch + batch), checked against the sample ids the sampler assigns and a sha256; anything that does not match is
read from the dataset directly (reported once). The user's loader itself is not iterated (its `num_workers` are
not used); randomness in `Dataset.__getitem__` must come from the index.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader

from nemo_checkpointless.data.cache import BatchCache, data_version
from nemo_checkpointless.data.loader import MmapBatchLoader
from nemo_checkpointless.protocol import JOB_ID_KEY

log = logging.getLogger(__name__)

__all__ = ["CachedTrainLoader", "MmapDataModule"]


class _SamplerPlan:
    """What `MmapBatchLoader` needs of a plan, for a torch sampler: micro-batch k of this rank is batch
    k mod L of epoch k // L (L batches an epoch), the sampler's indices for that epoch, in batches of `batch_size`."""

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool, dp_size: int) -> None:
        self.sampler = sampler
        self.micro_batch_size = batch_size
        self.drop_last = drop_last
        self.dp_size = dp_size
        n = len(sampler)
        self.batches_per_epoch = n // batch_size if drop_last else math.ceil(n / batch_size)
        self.global_batch_size = batch_size * dp_size

    def _epoch_indices(self, epoch: int, cache: dict[int, Any]) -> np.ndarray:
        if epoch not in cache:
            sampler = copy.copy(self.sampler)  # the live sampler's epoch is Lightning's; this one is ours
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)
            cache.clear()
            cache[epoch] = np.fromiter((int(i) for i in sampler), dtype=np.int64)
        indices: np.ndarray = cache[epoch]
        return indices

    def sample_ids(self, step: int, dp_rank: int, cache: dict[int, Any]) -> np.ndarray:
        epoch, batch = divmod(step, self.batches_per_epoch)
        indices = self._epoch_indices(epoch, cache)
        return indices[batch * self.micro_batch_size : (batch + 1) * self.micro_batch_size]

    def samples_consumed(self, step: int) -> int:
        return step * self.global_batch_size


class _EpochSampler:
    """What Lightning calls `set_epoch` on (`loader.sampler`): records the epoch for the next iteration."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)


class CachedTrainLoader:
    """The train loader Lightning iterates when batches go through the cache: one epoch per `iter()`, from the
    epoch Lightning set (`sampler.set_epoch`) and, after a (re)entry into `fit`, from the recovered batch of it."""

    def __init__(self, dataloader: DataLoader, *, store: Any, rank: int, dp_rank: int, dp_size: int,
                 cache_root: str | None, job_id_fallback: str, prefetch: int = 16, lookback: int = 4) -> None:
        batch_sampler = dataloader.batch_sampler
        assert batch_sampler is not None
        inner = batch_sampler.sampler  # type: ignore[attr-defined]
        self.sampler = _EpochSampler(inner)
        self.plan = _SamplerPlan(inner, batch_sampler.batch_size, batch_sampler.drop_last,  # type: ignore[attr-defined]
                                 dp_size)
        job_id = store.get(JOB_ID_KEY).decode() if store.check([JOB_ID_KEY]) else job_id_fallback
        dataset = dataloader.dataset
        version = data_version(dataset=f"{type(dataset).__module__}.{type(dataset).__qualname__}",
                               num_samples=len(dataset),  # type: ignore[arg-type]
                               batch_size=self.plan.micro_batch_size, drop_last=self.plan.drop_last, dp_size=dp_size,
                               sampler=type(inner).__qualname__, seed=getattr(inner, "seed", None),
                               shuffle=getattr(inner, "shuffle", None))
        cache = BatchCache(cache_root, job_id, version, group=dp_rank)
        self.loader = MmapBatchLoader(dataset, self.plan, dp_rank, end_step=0, cache=cache, writer=True,
                                      prefetch=prefetch, lookback=lookback, collate_fn=dataloader.collate_fn,
                                      verify=False, data_version=version)
        self.generator = dataloader.generator
        self.skip_batches = 0  # set for the first iteration after a (re)entry into fit
        self.rank = rank
        self.first_reported = False

    def __len__(self) -> int:
        return self.plan.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        # What a DataLoader's iterator draws from the global RNG when it is created (its base seed), drawn here
        # too, so a run through the cache trains bitwise like the same run through the DataLoader.
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        return self._epoch()

    def _epoch(self) -> Iterator[Any]:
        # Lazy: Lightning creates an iterator and may create another before it reads the first batch.
        length = self.plan.batches_per_epoch
        start = self.sampler.epoch * length + self.skip_batches
        self.skip_batches = 0
        self.loader._start = start
        self.loader.end_step = (self.sampler.epoch + 1) * length
        for batch in self.loader:
            if not self.first_reported and start:
                first = self.loader.first_batch
                log.debug(f"data: first batch (micro-batch {start} of the run) from the {first['source']} in "
                          f"{1e3 * first['s']:.2f} ms")
            self.first_reported = True
            yield batch

    @property
    def first_batch(self) -> dict[str, Any]:
        return self.loader.first_batch

    def close(self) -> None:
        self.loader.close()


class MmapDataModule(pl.LightningDataModule):
    """Wraps a user's `LightningDataModule`: the same data, the train batches served through the job's
    shared-memory cache (tier 2). Everything else is the wrapped module's."""

    def __init__(self, datamodule: pl.LightningDataModule, prefetch: int = 16, lookback: int = 4) -> None:
        super().__init__()
        self.datamodule = datamodule
        self.prefetch = prefetch
        self.lookback = lookback

    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    def setup(self, stage: str) -> None:
        self.datamodule.trainer = self.trainer
        self.datamodule.setup(stage)

    def teardown(self, stage: str) -> None:
        self.datamodule.teardown(stage)

    def train_dataloader(self) -> Any:
        # `CheckpointlessStrategy.process_dataloader` sees this module on the trainer and serves the loader from
        # the cache, with this module's prefetch and lookback.
        return self.datamodule.train_dataloader()

    def val_dataloader(self) -> Any:
        return self.datamodule.val_dataloader()

    def state_dict(self) -> dict[str, Any]:
        return self.datamodule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.datamodule.load_state_dict(state_dict)
