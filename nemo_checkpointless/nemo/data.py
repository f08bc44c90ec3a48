"""Our token data (tier 2's exact position) as a NeMo 2 data module, and tier 2 for a user's NeMo data module.

`PlannedDataModule` serves `megatron.data.PlannedSamples` (the sample at each global data position Megatron's
pretraining sampler reads) with Megatron's data sampler; the data position at step s is `s * GB` samples, O(1) to
restore (`CheckpointlessMegatronStrategy.process_dataloader` sets it).

`MmapDataModule` gives tier 2 to a user's data module (NeMo's `MockDataModule`, `PreTrainingDataModule`, any data
module with Megatron's data sampler that builds its training dataset as `_train_ds` in `setup`): its training
dataset is read through the job's shared-memory cache in the order Megatron's pretraining sampler draws it
(`megatron.data.CachedSamples`). Importing this module imports NeMo (the [nemo] extra).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from nemo.lightning.pytorch.plugins import MegatronDataSampler

from nemo_checkpointless.data.cache import data_version, fingerprint
from nemo_checkpointless.data.loader import MmapBatchLoader
from nemo_checkpointless.data.sampling import GlobalBatchPlan, TokenSequences
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.megatron.data import CachedSamples, PlannedSamples, all_tensors


class PlannedDataModule(pl.LightningDataModule):
    """A NeMo-compatible data module over `PlannedSamples` (train only), with Megatron's data sampler.

    Args:
        tokens: the token stream (`IndexedTokens(...).tokens`).
        seq_len, micro_batch_size, dp_size, seed, shuffle: as `data.*` and the job's DP size.
        global_batch_size: micro_batch_size x DP x gradient accumulation.
        max_steps: the dataset is `max_steps * global_batch_size` positions long (epochs repeat, each reshuffled).
        attention_mask: build the causal mask (needed without Transformer Engine).
        loader: builds this rank's tier-2 loader (`data.job.job_loader`) from (the strategy's session, samples,
            plan, plan steps) when `fit` sets the module up (a spare learns its rank there); closed at teardown
            (it stops the prefetch; the next `fit`'s loader adopts what the cache holds). None: read the token
            file directly.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, micro_batch_size: int, dp_size: int,
                 global_batch_size: int, seed: int, shuffle: bool, max_steps: int, attention_mask: bool,
                 loader: Callable[[Any, TokenSequences, GlobalBatchPlan, int], MmapBatchLoader] | None = None) -> None:
        super().__init__()
        self.sequences = TokenSequences(tokens, seq_len)
        self.plan = GlobalBatchPlan(len(self.sequences), micro_batch_size, dp_size, seed, shuffle)
        # A plan step is one micro-batch per DP rank: global_batch_size / (micro_batch_size x DP) per optimizer step.
        self.plan_steps = max_steps * global_batch_size // self.plan.global_batch_size
        self.length, self.attention_mask = max_steps * global_batch_size, attention_mask
        self.make_loader = loader
        self.loader: MmapBatchLoader | None = None
        self.dataset = PlannedSamples(self.sequences, self.plan, self.length, attention_mask)
        self.seq_length = seq_len
        self.micro_batch_size, self.global_batch_size = micro_batch_size, global_batch_size
        self.data_sampler = MegatronDataSampler(seq_len=seq_len, micro_batch_size=micro_batch_size,
                                                global_batch_size=global_batch_size)

    def setup(self, stage: str = "") -> None:
        if self.make_loader is not None and self.loader is None:
            strategy: Any = self.trainer.strategy if self.trainer is not None else None
            self.loader = self.make_loader(strategy.session, self.sequences, self.plan, self.plan_steps)
            self.dataset = PlannedSamples(self.sequences, self.plan, self.length, self.attention_mask, self.loader)

    def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
        return torch.utils.data.DataLoader(self.dataset, num_workers=0, pin_memory=False)

    def teardown(self, stage: str = "") -> None:
        self.close()

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None


_UNWRAPPED = ("or pass the data module unwrapped (a recipe: nemo_checkpointless.nemo.apply(recipe, mmap=False)), its "
              "batches then read directly")


def _check_sampler(module: pl.LightningDataModule) -> None:
    """`ConfigError` unless `module` draws its training data with Megatron's pretraining sampler: the cache holds
    each rank's micro-batches in that sampler's order (and the strategy restores that sampler's position)."""
    name = type(module).__name__
    sampler = getattr(module, "data_sampler", None)
    if not isinstance(sampler, MegatronDataSampler):
        raise ConfigError(f"MmapDataModule({name}).data_sampler", type(sampler).__name__ if sampler is not None
                          else None, "must be Megatron's data sampler (nemo.lightning.pytorch.plugins."
                          "MegatronDataSampler): the cache serves each data-parallel rank's micro-batches in the "
                          "order Megatron's pretraining sampler draws them",
                          "set self.data_sampler = MegatronDataSampler(seq_len=..., micro_batch_size=..., "
                          f"global_batch_size=...) in the module's __init__ (NeMo's GPT data modules do), {_UNWRAPPED}")
    if sampler.dataloader_type != "single":
        raise ConfigError(f"MmapDataModule({name}).data_sampler.dataloader_type", repr(sampler.dataloader_type),
                          "must be 'single' (Megatron's sequential pretraining sampler, whose next micro-batches the "
                          "cache prefetches; 'cyclic' draws samples at random, 'batch' splits global batches "
                          "another way)",
                          f"build the sampler with dataloader_type='single' (the default), {_UNWRAPPED}")


def _check_dataset(module: pl.LightningDataModule, dataset: Any) -> None:
    """`ConfigError` unless `dataset` (the module's `_train_ds` after `setup`) is one the cache can serve:
    map-style (`len` and `[i]`), its samples tensors or str-keyed dicts / lists / tuples of them."""
    name = type(module).__name__
    if dataset is None:
        raise ConfigError(f"MmapDataModule({name})", "no _train_ds", "the wrapped module must build its training "
                          "dataset as self._train_ds in setup (the dataset the cache reads)",
                          f"assign the training dataset to self._train_ds in {name}.setup (NeMo's GPT data modules "
                          f"do), {_UNWRAPPED}")
    if isinstance(dataset, torch.utils.data.IterableDataset) or not (
            hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(f"{name}._train_ds", type(dataset).__name__, "is an iterable-style dataset; the cache "
                          "serves a map-style one (len(ds) and ds[i]), whose samples Megatron's sampler picks by "
                          "index", f"give {name} a map-style training dataset, {_UNWRAPPED}")
    n = len(dataset)
    for i in sorted({0, n - 1}) if n else ():
        sample = dataset[i]
        if not all_tensors(sample):
            raise ConfigError(f"{name}._train_ds[{i}]", type(sample).__name__, "a sample must be a tensor or a "
                              "str-keyed dict / list / tuple of tensors (what the cache stores: no pickle)",
                              f"return tensors from {type(dataset).__name__}.__getitem__, {_UNWRAPPED}")


class MmapDataModule(pl.LightningDataModule):
    """Tier 2 for a NeMo user's data module: `MmapDataModule(llm.MockDataModule(...))` in place of the module.

    Under `checkpointless-run` each rank's training micro-batches come from the job's shared-memory cache: the lowest
    rank of each batch group (the ranks that train on the same micro-batch) prefetches the next `prefetch` ones and
    keeps the last `lookback`, so a replacement finds the batch it resumes on already there. The data position is
    Megatron's sampler's, restored by `CheckpointlessMegatronStrategy` in O(1) (`step x global batch` samples), with
    or without this wrapper. The batches are the same with and without it (every cached batch is verified, and a
    miss reads the dataset). Started any other way, it is the module itself.

    What it cannot serve is refused with one `ConfigError` (key, value, rule, fix): here, a module without Megatron's
    data sampler (`data_sampler`, a `MegatronDataSampler` with `dataloader_type='single'`); in `setup`, one that
    builds no training dataset as `_train_ds` (NeMo's GPT data modules do), an iterable-style one, or samples that
    are not tensors or str-keyed dicts / lists / tuples of them (checked on its first and last sample), under the
    launcher or not. Everything else (the sampler, the tokenizer, the validation data, `state_dict`) is the wrapped
    module's.

    Args:
        module: the user's data module.
        prefetch, lookback, cache_root: as `data.prefetch`, `data.lookback`, `data.cache_root` (default /dev/shm).
    """

    def __init__(self, module: pl.LightningDataModule, *, prefetch: int = 16, lookback: int = 4,
                 cache_root: str | None = None) -> None:
        super().__init__()
        if not isinstance(module, pl.LightningDataModule):
            raise ConfigError("MmapDataModule(module)", type(module).__name__,
                              "must be a LightningDataModule (a NeMo data module)",
                              "pass the data module itself, e.g. MmapDataModule(llm.MockDataModule(...))")
        _check_sampler(module)
        self.module = module
        self.prefetch, self.lookback, self.cache_root = prefetch, lookback, cache_root
        self.loader: MmapBatchLoader | None = None

    def __getattr__(self, name: str) -> Any:
        # What NeMo and the strategy read of a data module (micro_batch_size, seq_length, tokenizer, ...).
        if name == "module" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.module, name)

    @property
    def data_sampler(self) -> Any:
        return getattr(self.module, "data_sampler", None)

    @data_sampler.setter
    def data_sampler(self, sampler: Any) -> None:  # NeMo hands the strategy's sampler to the data module
        self.module.data_sampler = sampler  # type: ignore[attr-defined]

    def setup(self, stage: str = "") -> None:
        self.module.trainer = self.trainer  # its setup may read the trainer (e.g. max_steps)
        self.module.setup(stage)
        dataset = getattr(self.module, "_train_ds", None)
        if dataset is None and stage not in ("fit", ""):
            return  # validate / test / predict only: no training dataset to serve
        if isinstance(dataset, CachedSamples):  # a module whose setup keeps its datasets (a re-entered fit)
            dataset = dataset.dataset
        _check_dataset(self.module, dataset)  # also when not under the launcher: the same error everywhere
        strategy: Any = self.trainer.strategy if self.trainer is not None else None
        session = getattr(strategy, "_session", None)
        if session is not None:
            self.module._train_ds = self._cached(dataset, session)  # type: ignore[attr-defined]

    def _cached(self, dataset: Any, session: Any) -> Any:
        from nemo_checkpointless.data.job import group_loader

        sampler = self.data_sampler
        mb = int(getattr(sampler, "micro_batch_size", 0) or getattr(self.module, "micro_batch_size", 0))
        dims = session.dims
        n = len(dataset)
        if not mb or n < mb * dims.dp:
            return dataset  # fewer samples than one micro-batch per DP rank: Megatron's sampler says so
        probe = [dataset[0], dataset[n - 1]]
        plan = GlobalBatchPlan(n, mb, dims.dp, seed=0, shuffle=False)  # Megatron's pretraining order (DP excludes CP)
        # Names the data: the batches of another dataset, length or layout are never read from the cache.
        version = data_version(dataset=f"{type(dataset).__module__}.{type(dataset).__qualname__}", num_samples=n,
                               micro_batch_size=mb, dp_size=plan.dp_size,
                               probe=fingerprint(torch.utils.data.default_collate(probe)))
        rank = session.env.rank
        self.close()
        self.loader = group_loader(session.store, rank=rank, dims=dims, run_dir=session.env.run_dir,
                                   store_port=session.env.store_port, dataset=dataset, plan=plan,
                                   end_step=plan.steps_per_epoch, version=version, cache_root=self.cache_root,
                                   prefetch=self.prefetch, lookback=self.lookback, verify=False)
        return CachedSamples(dataset, self.loader)

    def prepare_data(self) -> None:
        self.module.prepare_data()

    def train_dataloader(self) -> Any:
        return self.module.train_dataloader()

    def val_dataloader(self) -> Any:
        return self.module.val_dataloader()

    def test_dataloader(self) -> Any:
        return self.module.test_dataloader()

    def predict_dataloader(self) -> Any:
        return self.module.predict_dataloader()

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module.load_state_dict(state_dict)

    def teardown(self, stage: str = "") -> None:
        self.close()
        self.module.teardown(stage)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None


