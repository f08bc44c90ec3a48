"""Samples of a token stream and the exact data position.

The position is the number of samples consumed. Sample ids for the step at any position come from index
arithmetic over one seeded permutation per epoch, so resuming at step 10 or at step 1,000,000 costs the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


class TokenSequences(torch.utils.data.Dataset[torch.Tensor]):
    """Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1] of the concatenated stream (inputs + next token)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_samples = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))


@dataclass(frozen=True)
class GlobalBatchPlan:
    """Which samples each data-parallel rank trains on at each step.

    A global batch is `micro_batch_size * dp_size` samples; epoch e is a permutation of the samples seeded by
    (seed, e), cut into whole global batches (the tail that does not fill one is dropped).
    """

    num_samples: int
    micro_batch_size: int
    dp_size: int
    seed: int
    shuffle: bool = True

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def sample_ids(self, step: int, dp_rank: int, _cache: dict[int, np.ndarray] | None = None) -> np.ndarray:
        """Sample ids of `dp_rank`'s micro-batch at 0-based `step`: O(1) index arithmetic given the epoch order."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        order = _cache.get(epoch) if _cache is not None else None
        if order is None:
            order = self._epoch_order(epoch)
            if _cache is not None:
                _cache.clear()
                _cache[epoch] = order
        start = in_epoch * self.global_batch_size + dp_rank * self.micro_batch_size
        return order[start : start + self.micro_batch_size]


class RankBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's micro-batches for steps `start_step`, ..., `end_step - 1` (0-based).

    The data position at step s is `s * global_batch_size` samples; nothing before `start_step` is touched.
    """

    def __init__(self, plan: GlobalBatchPlan, dp_rank: int, start_step: int, end_step: int) -> None:
        self.plan = plan
        self.dp_rank = dp_rank
        self.start_step = start_step
        self.end_step = end_step
        self._cache: dict[int, np.ndarray] = {}

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.end_step):
            yield self.plan.sample_ids(step, self.dp_rank, self._cache).tolist()

    def __len__(self) -> int:
        return self.end_step - self.start_step
