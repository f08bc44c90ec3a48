"""Samples of a token stream and the exact data position.

The position is the number of samples consumed. Sample ids for the step at any position come from index
arithmetic over one seeded permutation per epoch, so resuming at step 10 or at step 1,000,000 costs the same.
The permutation is a keyed Feistel network over [0, n) (cycle-walking), evaluated only at the positions asked
for: nothing of size n is ever materialised, so a 10^12-sample index costs what a 10^3-sample one does.
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


# Bump when the order a (seed, epoch) picks changes, so caches keyed by it are not reused (2: Feistel, was
# np.random.permutation).
PLAN_VERSION = 2
_ROUNDS = 6
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps; every operand is an array, so numpy does not warn)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class IndexPermutation:
    """A seeded bijection of [0, n), evaluated pointwise in O(1) per index (no O(n) table).

    A balanced Feistel network over the smallest even-width power of two >= n (so at most 4n), with the rounds
    keyed by (seed, epoch); values that land outside [0, n) are walked again (cycle-walking keeps a bijection).
    The expected number of walks is < 4 per index.
    """

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        if n > 1 << 62:
            raise ValueError(f"n={n} is larger than the permutation supports (2**62)")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = np.random.SeedSequence([seed, epoch, 0x5EED]).generate_state(_ROUNDS, dtype=np.uint64)

    def _once(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & self._mask)
        return (left << self._half) | right

    def __call__(self, index: np.ndarray) -> np.ndarray:
        """The images of `index` (integers in [0, n)) as int64."""
        idx = np.asarray(index)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.n):
            raise IndexError(f"index out of range for a permutation of {self.n}")
        y = self._once(idx.astype(np.uint64))
        out = y >= np.uint64(self.n)
        while out.any():
            y[out] = self._once(y[out])
            out = y >= np.uint64(self.n)
        return y.astype(np.int64)


@dataclass(frozen=True)
class GlobalBatchPlan:
    """Which samples each data-parallel rank trains on at each step.

    A global batch is `micro_batch_size * dp_size` samples; epoch e is a permutation of the samples seeded by
    (seed, e) (`IndexPermutation`), cut into whole global batches (the tail that does not fill one is dropped).
    Every lookup is O(micro_batch_size), whatever the step or the number of samples.
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

    def samples_consumed(self, step: int) -> int:
        """The data position before 0-based `step`: samples consumed by all ranks together."""
        return step * self.global_batch_size

    def sample_ids(self, step: int, dp_rank: int, _cache: dict[int, IndexPermutation] | None = None) -> np.ndarray:
        """Sample ids (int64) of `dp_rank`'s micro-batch at 0-based `step`: O(micro_batch_size), any step."""
        if step < 0 or not 0 <= dp_rank < self.dp_size:
            raise IndexError(f"step {step} / dp_rank {dp_rank} out of range (dp_size {self.dp_size})")
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        start = in_epoch * self.global_batch_size + dp_rank * self.micro_batch_size
        positions = np.arange(start, start + self.micro_batch_size, dtype=np.int64)
        if not self.shuffle:
            return positions
        perm = _cache.get(epoch) if _cache is not None else None
        if perm is None:
            perm = IndexPermutation(self.num_samples, self.seed, epoch)
            if _cache is not None:
                _cache.clear()
                _cache[epoch] = perm
        return perm(positions)


class RankBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this rank's micro-batches for steps `start_step`, ..., `end_step - 1` (0-based).

    The data position at step s is `s * global_batch_size` samples; nothing before `start_step` is touched.
    """

    def __init__(self, plan: GlobalBatchPlan, dp_rank: int, start_step: int, end_step: int) -> None:
        self.plan = plan
        self.dp_rank = dp_rank
        self.start_step = start_step
        self.end_step = end_step
        self._cache: dict[int, IndexPermutation] = {}

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.end_step):
            yield self.plan.sample_ids(step, self.dp_rank, self._cache).tolist()

    def __len__(self) -> int:
        return self.end_step - self.start_step
