"""`CheckpointlessCallback`: records what a replacement needs at every step boundary and writes the run summary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from nemo_checkpointless.lightning.strategy import CheckpointlessStrategy
from nemo_checkpointless.state.hashing import batch_hash

WORKER_SUMMARY = "worker_summary.json"


class CheckpointlessCallback(Callback):
    """Pairs with `CheckpointlessStrategy`. Hashes each batch a rank trains on; at the end, rank 0 writes
    `run_dir/worker_summary.json` (final step, timings, state and data digests) for the launcher to merge.

    `on_train_end` runs a collective over each optimizer instance: every rank calls it (Lightning does).
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = Path(run_dir)
        self._t_start = 0.0
        self._first_step_done = 0.0

    def _strategy(self, trainer: pl.Trainer) -> CheckpointlessStrategy:
        if not isinstance(trainer.strategy, CheckpointlessStrategy):
            raise TypeError("CheckpointlessCallback needs Trainer(strategy=CheckpointlessStrategy(...)); "
                            f"got {type(trainer.strategy).__name__}")
        return trainer.strategy

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy(trainer)
        self._t_start = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        tokens = batch if isinstance(batch, torch.Tensor) else batch[0]
        self._strategy(trainer).record_batch_hash(batch_hash(tokens))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        train_s = time.perf_counter() - self._t_start
        digest = strategy.full_state_digest()
        if trainer.global_rank != 0:
            return
        summary = {
            "final_step": trainer.global_step,
            "train_s": round(train_s, 3),
            "steps_per_s": round(trainer.global_step / train_s, 3) if train_s > 0 else None,
            "state_sha256": digest,
            "data_sha256": strategy.data_digest.hexdigest,
            "data_steps": strategy.data_digest.steps,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f".{WORKER_SUMMARY}.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(self.run_dir / WORKER_SUMMARY)
