"""megatron-core's data side, framework-free: datasets indexed by the global data position Megatron's pretraining
sampler reads (position `consumed_samples + k`, in order), and the record of what each step trained on.

`PlannedSamples` maps a global data position to a sample through the same `GlobalBatchPlan` as the Lightning path:
position `s * GB + r * mb + k` is sample `plan.sample_ids(s, r)[k]`. So a step's micro-batches are the Lightning
path's for the same seed, data, micro-batch size and DP size, and the data position at step s is `s * GB` samples:
O(1) to restore, whatever s (a door sets the sampler's `consumed_samples`). With a loader (`data.loader=mmap`), a
rank's own micro-batches come from the job's shared-memory cache (tier 2), prefetched by its batch group's writer,
so a replacement's first batch is already there. `CachedSamples` does the same for a user's map-style dataset.

`RecordingIterator` wraps the step's micro-batch iterator: it hashes each micro-batch the step actually consumes (a
GPT batch: inputs plus the last label, the Lightning path's batch); `gather_step_hashes` collects every rank's digest
of the step for the running data record. Imports neither NeMo, Lightning nor megatron-core.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from nemo_checkpointless.data.loader import MmapBatchLoader
from nemo_checkpointless.data.sampling import GlobalBatchPlan, IndexPermutation, TokenSequences
from nemo_checkpointless.state.hashing import HASH_BYTES, batch_hash

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


def _row(batch: Any, j: int) -> Any:
    """Sample j of a collated batch (a tensor, or a dict/list/tuple of them), as the dataset returned it."""
    if isinstance(batch, torch.Tensor):
        return batch[j]
    if isinstance(batch, dict):
        return {k: _row(v, j) for k, v in batch.items()}
    return type(batch)(_row(v, j) for v in batch)


def all_tensors(sample: Any) -> bool:
    if isinstance(sample, torch.Tensor):
        return True
    if isinstance(sample, dict):
        return all(isinstance(k, str) and all_tensors(v) for k, v in sample.items())
    if isinstance(sample, (list, tuple)):
        return all(all_tensors(v) for v in sample)
    return False


class CachedSamples(torch.utils.data.Dataset[Any]):
    """A user's map-style training dataset read through this rank's `MmapBatchLoader`.

    The loader's plan is Megatron's pretraining order (`GlobalBatchPlan(..., shuffle=False)`): position
    `p * mb * DP + r * mb + j` is row j of DP rank r's micro-batch of plan step p. A position of this rank's own
    micro-batch is served from the cache (verified there; read from the dataset on a miss), any other directly, so
    the samples are the dataset's whatever the sampler asks for. Other attributes (e.g. `collate_fn`, which NeMo's
    data modules hand their DataLoader) are the dataset's."""

    def __init__(self, dataset: Any, loader: MmapBatchLoader) -> None:
        self.dataset, self.loader = dataset, loader
        self._step, self._batch = -1, None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, position: int) -> Any:
        plan = self.loader.plan
        step, k = divmod(int(position), plan.global_batch_size)
        dp_rank, j = divmod(k, plan.micro_batch_size)
        if dp_rank != self.loader.dp_rank or step >= self.loader.end_step:
            return self.dataset[position]
        if step != self._step:
            self._batch, self._step = self.loader.batch(step), step
        return _row(self._batch, j)

    def __getattr__(self, name: str) -> Any:
        if name in ("dataset", "loader", "_step", "_batch"):  # not set yet (e.g. while unpickling): not the inner's
            raise AttributeError(name)
        return getattr(self.dataset, name)


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


def gather_step_hashes(world: Any, extra: bytes = b"") -> tuple[list[bytes], list[bytes]]:
    """Once the step's micro-batches are consumed and before its optimizer step: every rank's digest of them, in
    rank order, gathered over `world` (the generation's world group: 32 bytes a rank, one small all-gather a step).
    A rank that consumed none (a middle pipeline stage) contributes zeros. The participant folds them into its
    running data digest when the step completes (`MegatronParticipant.step_done`), so the record travels with
    the rank's state (a replacement receives it; a checkpoint holds it) and no store key is written per step.

    `extra` (the same length on every rank) rides along: the strategy's per-step checks (its shard's replica
    digest, its own gradient norm). Returns the hashes and every rank's `extra`, in rank order."""
    size = HASH_BYTES + len(extra)
    mine = torch.tensor(list((take_step_digest() or bytes(HASH_BYTES)) + extra), dtype=torch.uint8)
    out = [torch.empty(size, dtype=torch.uint8) for _ in range(world.size)]
    world.all_gather(out, mine)
    rows = [bytes(t.tolist()) for t in out]
    return [r[:HASH_BYTES] for r in rows], [r[HASH_BYTES:] for r in rows]


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
