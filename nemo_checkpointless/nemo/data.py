"""Our token data (tier 2's exact position) as a NeMo 2 data module, and the record of what each step trained on.

`PlannedSamples` maps a global data position (what Megatron's pretraining sampler reads, in order: position
`consumed_samples + k`) to a sample through the same `GlobalBatchPlan` as the Lightning path: position
`s * GB + r * mb + k` is sample `plan.sample_ids(s, r)[k]`. So a step's micro-batches are the Lightning path's for
the same seed, data, micro-batch size and DP size, and the data position at step s is `s * GB` samples: O(1) to
restore, whatever s (`CheckpointlessMegatronStrategy.process_dataloader` sets it). With a loader
(`data.loader=mmap`), a rank's own micro-batches come from the job's shared-memory cache (tier 2), prefetched by
its batch group's writer, so a replacement's first batch is already there.

`RecordingIterator` wraps the step's micro-batch iterator (`CheckpointlessMegatronStrategy.training_step`): it hashes
each micro-batch the step actually consumes (a GPT batch: inputs plus the last label, the Lightning path's batch);
`take_step_digest` returns the step's digest. Importing this module imports NeMo (the [nemo] extra).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from nemo.lightning.pytorch.plugins import MegatronDataSampler

from nemo_checkpointless.data.loader import MmapBatchLoader
from nemo_checkpointless.data.sampling import GlobalBatchPlan, IndexPermutation, TokenSequences
from nemo_checkpointless.state.hashing import batch_hash

_RECORDED: list[bytes] = []  # this process's micro-batch hashes since the last `take_step_digest`


class PlannedSamples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Item i is the sample at global data position i (see the module doc), as NeMo's GPT batch dict."""

    def __init__(self, sequences: TokenSequences, plan: GlobalBatchPlan, length: int,
                 attention_mask: bool, loader: MmapBatchLoader | None = None) -> None:
        self.sequences, self.plan, self.length, self.loader = sequences, plan, length, loader
        self._step, self._batch = -1, torch.empty(0)
        seq_len = sequences.seq_len
        self.loss_mask = torch.ones(seq_len, dtype=torch.float32)
        self.position_ids = torch.arange(seq_len, dtype=torch.int64)
        # Megatron's convention: True marks a position that must not be attended to.
        self.mask = torch.ones(seq_len, seq_len).tril().unsqueeze(0) < 0.5 if attention_mask else None
        self._cache: dict[int, IndexPermutation] = {}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, position: int) -> dict[str, torch.Tensor]:
        # Position s * GB + r * mb + j is row j of DP rank r's micro-batch of plan step s.
        step, k = divmod(position, self.plan.global_batch_size)
        dp_rank, j = divmod(k, self.plan.micro_batch_size)
        if self.loader is not None and dp_rank == self.loader.dp_rank:
            # This rank's micro-batch of `step`, from the shared-memory cache (tier 2) when it is there.
            if step != self._step:
                self._batch, self._step = self.loader.batch(step), step
            seq = self._batch[j]
        else:
            seq = self.sequences[int(self.plan.sample_ids(step, dp_rank, self._cache)[j])]
        item = {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": self.loss_mask, "position_ids": self.position_ids}
        if self.mask is not None:
            item["attention_mask"] = self.mask
        return item


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


class RecordingIterator:
    """The step's micro-batch iterator, recording the hash of each micro-batch Megatron's schedule draws from it:
    a GPT batch by its inputs plus the last label (the Lightning path's batch: the two engines' data records agree),
    anything else by every tensor in it (`state.hashing.batch_hash`)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self) -> RecordingIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        fields = batch[0] if isinstance(batch, tuple) and len(batch) == 3 else batch  # Lightning's (batch, i, j)
        if isinstance(fields, dict) and isinstance(fields.get("tokens"), torch.Tensor) and isinstance(
                fields.get("labels"), torch.Tensor):
            _RECORDED.append(batch_hash(torch.cat([fields["tokens"], fields["labels"][:, -1:]], dim=1)))
        else:
            _RECORDED.append(batch_hash(fields))
        return batch


def take_step_digest() -> bytes | None:
    """The digest of the micro-batches consumed since the last call (one: its hash; several: the hash of their
    hashes, in order); None if none was."""
    hashes = list(_RECORDED)
    _RECORDED.clear()
    if not hashes:
        return None
    return hashes[0] if len(hashes) == 1 else hashlib.sha256(b"".join(hashes)).digest()


def clear_recorded() -> None:
    """Forget micro-batches of a step that did not complete (a failure interrupted it)."""
    _RECORDED.clear()
