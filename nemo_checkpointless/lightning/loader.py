"""The Lightning door's train loader, started at the session's data position.

A (re)entered `fit` trains on from the sample the recovered step starts at: the train loader's sampler
(Lightning's `DistributedSampler`, or the user's own) is wrapped (`ResumingSampler`) so that its first iteration
skips the samples of the steps already trained in the epoch, and Lightning's loop counters (epoch, batch in the
epoch, optimizer steps) are set to the same place; nothing iterates the loader to get there. A shrunk world's
rank trains the micro-batches of every rank it serves (`ServedBatches`); a loader served through the shared-memory
cache (`lightning.data.CachedTrainLoader`) skips whole batches itself. `TrainPosition` is the strategy's side of
this: what `process_dataloader`, `on_train_start` and a record's sample ids need.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, Sampler

from nemo_checkpointless import protocol
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.restart.session import Session
from nemo_checkpointless.topology import rank_info


def set_counters(tracker: Any, value: int) -> None:
    """A Lightning progress tracker at `value` (every stage of it: ready, started, processed, completed)."""
    for stage in ("ready", "started", "processed", "completed"):
        if hasattr(tracker, stage):
            setattr(tracker, stage, value)


class ResumingSampler(Sampler[int]):
    """The train loader's sampler, started `skip()` samples into its epoch on the first iteration after a (re)entry
    into `fit`; epochs, shuffling and sharding are the wrapped sampler's (Lightning calls its `set_epoch`)."""

    def __init__(self, inner: Any, skip: Callable[[], int]) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.inner), self.skip(), None)

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(epoch)


class ServedBatches(Sampler[list[int]]):
    """A shrunk world's train batches for one rank: in each step, `accumulate` micro-batches of every rank it serves
    (`topology.shrink.served_ranks`), in rank order, each drawn from that rank's own sampler (a copy of the
    `DistributedSampler` with its rank): the same samples, step for step, as the full world trains. Skips the
    steps already trained in the epoch when iterated; `slots` says whose each yielded micro-batch is."""

    def __init__(self, template: BatchSampler, own: DistributedSampler, served: tuple[int, ...], accumulate: int,
                 skip_steps: Callable[[], int]) -> None:
        self.template = template
        self.accumulate = accumulate
        self.skip_steps = skip_steps
        self.served = served
        self.samplers: list[DistributedSampler] = []
        for rank in served:
            sampler = copy.copy(own)
            sampler.rank = rank
            self.samplers.append(sampler)
        self.sampler = self  # Lightning sets the epoch through `batch_sampler.sampler.set_epoch`
        self.slots: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def _batches(self, sampler: DistributedSampler) -> Iterator[list[int]]:
        return iter(BatchSampler(sampler, self.template.batch_size, self.template.drop_last))

    def __iter__(self) -> Iterator[list[int]]:
        self.slots = []
        iters = [self._batches(s) for s in self.samplers]
        skip = self.skip_steps() * self.accumulate
        for it in iters:
            for _ in itertools.islice(it, skip):
                pass
        while True:
            blocks = [list(itertools.islice(it, self.accumulate)) for it in iters]
            if not blocks[0]:
                return
            for rank, block in zip(self.served, blocks, strict=True):
                for batch in block:
                    self.slots.append(rank)
                    yield batch

    def __len__(self) -> int:
        return len(self.template) * len(self.served)


def refuse_shrink(what: str) -> None:
    raise ConfigError("replication.shrink (checkpointless-run --shrink)", True,
                      f"a shrunk world trains a dropped rank's samples on another rank, which needs the "
                      f"train loader's sampler to be a DistributedSampler (Lightning's own, "
                      f"use_distributed_sampler=True); this loader uses {what}",
                      "let Lightning shard the loader (a plain DataLoader with shuffle= and "
                      "Trainer(use_distributed_sampler=True)), or drop --shrink")


class TrainPosition:
    """The train loader of the current `fit` at the session's data position (see the module).

    `served`: the ranks whose micro-batches this rank trains in each step (itself alone in the whole world);
    `user_accumulate`: the micro-batches per rank and step the user asked for (a shrunk world's rank trains that
    many for each rank it serves)."""

    def __init__(self, cache_batches: bool, shrink: bool) -> None:
        self.cache_batches = cache_batches
        self.cache_prefetch, self.cache_lookback = 16, 4
        self.shrink = shrink
        self.served: tuple[int, ...] = ()
        self.user_accumulate: int | None = None
        self.served_loader: ServedBatches | None = None
        self.cached: Any = None  # the CachedTrainLoader of the current fit
        self.skip_samples = 0
        self.resumed = False  # this fit's loop counters are at the data position (`resume_loops`)

    def serve(self, trainer: pl.Trainer, served: tuple[int, ...]) -> None:
        """A (re)entered fit's shape: the ranks served, and the micro-batches of a step for all of them."""
        self.served = served
        self.resumed = False
        if self.user_accumulate is None:
            self.user_accumulate = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = self.user_accumulate * len(served)

    def next_slot(self, default: int) -> int:
        """Whose micro-batch the one being trained is: the served rank it was drawn for (`default`: this rank)."""
        if self.served_loader is not None and self.served_loader.slots:
            return self.served_loader.slots.pop(0)
        return default

    # ------------------------------------------------------------------------------------------- the loader
    def process(self, trainer: pl.Trainer | None, dataloader: object, session: Session) -> object:
        """The train loader started at the session's data position (any other loader as it is)."""
        from nemo_checkpointless.data.sampling import RankBatchSampler

        if self.shrink and trainer is not None and trainer.training and (
                not isinstance(dataloader, DataLoader) or isinstance(dataloader.batch_sampler, RankBatchSampler)):
            refuse_shrink(type(dataloader).__name__ if not isinstance(dataloader, DataLoader)
                          else type(dataloader.batch_sampler).__name__)
        if (trainer is None or not trainer.training or not isinstance(dataloader, DataLoader)
                or isinstance(dataloader.batch_sampler, RankBatchSampler)):
            return dataloader  # not the train loader, or one that starts at the data position itself
        from nemo_checkpointless.lightning.data import MmapDataModule

        datamodule = getattr(trainer, "datamodule", None)  # the user's data module, if any
        if isinstance(datamodule, MmapDataModule):  # served through the cache, with its prefetch and lookback
            self.cache_batches = True
            self.cache_prefetch, self.cache_lookback = datamodule.prefetch, datamodule.lookback
        if isinstance(dataloader.dataset, IterableDataset):
            raise ConfigError("train_dataloader", type(dataloader.dataset).__name__,
                              "is an IterableDataset: a recovered rank must start at an exact sample without "
                              "reading the samples before it, which needs indexed access",
                              "use a map-style Dataset (__getitem__ + __len__) with a DataLoader")
        batch_sampler = dataloader.batch_sampler
        if not isinstance(batch_sampler, BatchSampler):
            raise ConfigError("DataLoader(batch_sampler=...)", type(batch_sampler).__name__,
                              "the data position is restored through a torch BatchSampler's sampler",
                              "pass batch_size= and a sampler (or shuffle=) to the DataLoader instead")
        if isinstance(batch_sampler, ServedBatches):  # the same loader again, after a shrunk fit
            batch_sampler = batch_sampler.template
            object.__setattr__(dataloader, "batch_sampler", batch_sampler)  # DataLoader refuses a plain set
        if self.shrink:
            self._check_shrinkable(batch_sampler)
        if self.cache_batches:
            return self._cached_loader(trainer, dataloader, session)
        if not isinstance(batch_sampler.sampler, ResumingSampler):
            batch_sampler.sampler = ResumingSampler(batch_sampler.sampler, self._take_skip)
        if len(self.served) > 1:
            return self._served_dataloader(trainer, dataloader, batch_sampler, session)
        self.served_loader = None
        self.resume_loops(trainer, len(dataloader), batch_sampler.batch_size, session.position.step)
        return dataloader

    def _check_shrinkable(self, batch_sampler: BatchSampler) -> None:
        """At start-up, with replication.shrink: this loader can give a dropped rank's samples to another rank."""
        inner = batch_sampler.sampler
        inner = inner.inner if isinstance(inner, ResumingSampler) else inner
        if self.cache_batches or not isinstance(inner, DistributedSampler):
            refuse_shrink("MmapDataModule (the shared-memory cache)" if self.cache_batches else type(inner).__name__)

    def _served_dataloader(self, trainer: pl.Trainer, dataloader: DataLoader, batch_sampler: BatchSampler,
                           session: Session) -> Any:
        """The loader of a shrunk world's rank: every served rank's micro-batches in each step (`ServedBatches`)."""
        wrapped = batch_sampler.sampler
        own = wrapped.inner if isinstance(wrapped, ResumingSampler) else wrapped
        assert isinstance(own, DistributedSampler)
        assert self.user_accumulate is not None
        per_step = batch_sampler.batch_size * trainer.accumulate_grad_batches  # samples of the served stream
        served = ServedBatches(batch_sampler, own, self.served, self.user_accumulate,
                               lambda: self._take_skip() // per_step)
        object.__setattr__(dataloader, "batch_sampler", served)  # DataLoader refuses a plain set
        self.served_loader = served
        self.resume_loops(trainer, len(dataloader), batch_sampler.batch_size, session.position.step)
        return dataloader

    def _cached_loader(self, trainer: pl.Trainer, dataloader: DataLoader, session: Session) -> Any:
        from nemo_checkpointless.data.job import job_id_fallback
        from nemo_checkpointless.lightning.data import CachedTrainLoader

        if self.cached is not None:
            self.cached.close()
        env = session.env
        info = rank_info(session.dims, env.rank)
        cached = CachedTrainLoader(dataloader, store=session.membership.store, rank=env.rank, dp_rank=info.dp_rank,
                                   dp_size=session.dims.dp, cache_root=os.environ.get(protocol.CACHE_ROOT_ENV),
                                   job_id_fallback=job_id_fallback(env.run_dir, env.store_port),
                                   prefetch=self.cache_prefetch, lookback=self.cache_lookback)
        batch_size = cached.plan.micro_batch_size
        self.resume_loops(trainer, len(cached), batch_size, session.position.step)
        cached.skip_batches, self.skip_samples = self.skip_samples // batch_size, 0
        self.cached = cached
        return cached

    def _take_skip(self) -> int:
        skip, self.skip_samples = self.skip_samples, 0
        return skip

    # ------------------------------------------------------------------------------------ Lightning's loops
    def resume_loops(self, trainer: pl.Trainer, batches: int, batch_size: int, step: int) -> None:
        """Lightning's loop counters at step `step` (optimizer steps; the epoch and the batch in it), and the
        samples of the epoch's steps so far skipped by the loader's next iteration."""
        self.resumed = True
        if not step:
            return
        limit = trainer.limit_train_batches
        if isinstance(limit, int):
            batches = min(batches, limit)
        elif limit is not None and limit != 1.0:
            batches = int(batches * limit)
        accumulate = trainer.accumulate_grad_batches
        steps_per_epoch = math.ceil(batches / accumulate)
        epoch, batch = step // steps_per_epoch, (step % steps_per_epoch) * accumulate
        self.skip_samples = batch * batch_size
        fit_loop = trainer.fit_loop
        set_counters(fit_loop.epoch_progress.total, epoch)
        set_counters(fit_loop.epoch_progress.current, epoch)
        epoch_loop = fit_loop.epoch_loop
        optimizer = epoch_loop.automatic_optimization.optim_progress.optimizer
        set_counters(optimizer.step.total, step)
        set_counters(optimizer.zero_grad.total, step)
        epoch_loop._batches_that_stepped = step
        reset = epoch_loop.reset

        def reset_then_resume() -> None:
            # After the epoch loop's own reset (which zeroes the counters of the epoch), once.
            reset()
            del epoch_loop.reset
            set_counters(epoch_loop.batch_progress.current, batch)
            set_counters(epoch_loop.batch_progress.total, epoch * batches + batch)

        epoch_loop.reset = reset_then_resume  # type: ignore[method-assign]

    def on_train_start(self, trainer: pl.Trainer, step: int) -> None:
        """A loader that starts at the data position itself (the package's own): Lightning's step counters."""
        if step and not self.resumed:
            loop = trainer.fit_loop.epoch_loop
            set_counters(loop.automatic_optimization.optim_progress.optimizer.step.total, step)
            loop._batches_that_stepped = step

    def step_samples(self, trainer: pl.Trainer, step: int, step_hashes: dict[int, bytes]) -> dict[str, Any]:
        """The sample ids of this rank's micro-batches in step `step + 1` (in flight; for a record); a loader whose
        sampler is not ours says what it can: the step and the micro-batch hashes."""
        hashes = {str(slot): digest.hex()[:16] for slot, digest in step_hashes.items()}
        loader = trainer.fit_loop._combined_loader
        flat = getattr(loader, "flattened", None) if loader is not None else None
        dataloader = flat[0] if flat else None
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        sampler = getattr(batch_sampler, "sampler", None)
        if not isinstance(sampler, ResumingSampler) or not isinstance(batch_sampler, BatchSampler):
            return {"step": step + 1, "batch_hashes": hashes, "sample_ids": None,
                    "why": f"the loader's sampler ({type(sampler).__name__}) does not give sample ids"}
        accumulate = trainer.accumulate_grad_batches
        batches = len(dataloader)  # type: ignore[arg-type]
        steps_per_epoch = max(1, math.ceil(batches / accumulate))
        first = (step % steps_per_epoch) * accumulate
        inner = copy.copy(sampler.inner)  # its epoch is the one in flight (Lightning set it)
        order = list(iter(inner))
        size = batch_sampler.batch_size
        ids = [order[(first + k) * size:(first + k + 1) * size] for k in range(accumulate)]
        return {"step": step + 1, "batch_hashes": hashes, "sample_ids": ids}
