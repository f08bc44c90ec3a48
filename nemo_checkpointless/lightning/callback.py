"""`CheckpointlessCallback`: step-boundary bookkeeping, fault injection, and the run summary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from nemo_checkpointless.config import FaultSpec
from nemo_checkpointless.errors import SummaryError
from nemo_checkpointless.lightning.strategy import CheckpointlessStrategy
from nemo_checkpointless.protocol import (
    FAULT_PLAN_ENV,
    RUN_DIR_ENV,
    TRAIN_START_KEY,
    GenerationInfo,
    finished_key,
    generation_info_key,
    mark_process_training,
    record_key,
    write_worker_summary,
)
from nemo_checkpointless.restart import PeerFailure, progress
from nemo_checkpointless.restart.faults import slow_delay
from nemo_checkpointless.state.hashing import batch_hash


class CheckpointlessCallback(Callback):
    """Pairs with `CheckpointlessStrategy`.

    Before every step it snapshots what a replacement needs (RNG, scheduler, data position; no copy of big
    tensors), writes the persistent checkpoint when due, hashes the batch this rank trains on (every tensor of
    it), and fires the fault plan's faults (each once per job, even across replacements). At the end, rank 0
    writes `run_dir/worker_summary.json` (what `checkpointless-run` puts in `summary.json`); `on_train_end` runs
    a collective over each optimizer instance.

    Each recovery is logged through the Trainer's logger once this rank completes its first step after it:
    `recovery/downtime_s` (the fault, as the launcher saw it, to that step), `recovery/path` (0: p2p from a
    replica, 1: the persistent checkpoint), `recovery/bytes` (the state its receivers got); the progress bar then
    shows `recoveries` and `recovery_s` (the last one's downtime).

    Args:
        run_dir: where the summary goes. Default: the launcher's run directory.
        fault_plan: faults to inject (tests, benchmarks). Default: the launcher's (`checkpointless-run
            --fault kind:rank:step`), else none.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None,
                 fault_plan: list[FaultSpec] | None = None) -> None:
        self.run_dir = Path(run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV, "."))
        if fault_plan is None and os.environ.get(FAULT_PLAN_ENV):
            fault_plan = [FaultSpec(**spec) for spec in json.loads(os.environ[FAULT_PLAN_ENV])]
        self.fault_plan = list(fault_plan or [])
        self._t_start = 0.0
        self._start_step = 0
        self._ended = False  # this fit's training was ended (from on_fit_start, or on_train_end)
        self._generation = 0  # the last generation (recovery) this rank logged
        self._recoveries: list[float] = []  # the downtime of each recovery this rank logged

    def _strategy(self, trainer: pl.Trainer) -> CheckpointlessStrategy:
        if not isinstance(trainer.strategy, CheckpointlessStrategy):
            raise TypeError("CheckpointlessCallback needs Trainer(strategy=CheckpointlessStrategy(...)); "
                            f"got {type(trainer.strategy).__name__}")
        return trainer.strategy

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy(trainer)
        self._t_start = time.perf_counter()
        self._start_step = trainer.global_step
        store = self._strategy(trainer).membership.store
        if trainer.global_rank == 0 and not store.check([TRAIN_START_KEY]):
            store.set(TRAIN_START_KEY, json.dumps(time.time()))

    def _maybe_fail(self, strategy: CheckpointlessStrategy, step: int) -> None:
        faults = strategy.session.faults
        if not faults.plan:
            faults.arm(self.fault_plan)
        faults.fire(step)
        slow_delay()  # a `slow` fault that fired: this rank is a straggler from then on

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        strategy = self._strategy(trainer)
        if strategy.at_step_boundary():
            mark_process_training(strategy.membership.store)
            strategy.session.beacon.mark(trainer.global_step + 1, progress.STEP_START)
            self._maybe_fail(strategy, trainer.global_step + 1)
        strategy.record_batch_hash(batch_hash(batch))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy = self._strategy(trainer)
        generation = strategy.membership.generation
        if generation > self._generation:  # the first step this rank completed after a recovery
            self._generation = generation
            store = strategy.membership.store
            info_key, mine = generation_info_key(generation), record_key(generation, strategy.global_rank)
            if store.check([info_key]) and store.check([mine]):
                info, record = GenerationInfo.from_json(store.get(info_key)), json.loads(store.get(mine))
                keys = [record_key(generation, r) for r in strategy.membership.world().ranks]
                moved = sum(json.loads(store.get(k)).get("bytes_received", 0) for k in keys if store.check([k]))
                self._recoveries.append(time.time() - info.fault_t)
                pl_module.log_dict({"recovery/downtime_s": self._recoveries[-1],
                                    "recovery/path": 0.0 if record.get("path") == "p2p" else 1.0,
                                    "recovery/bytes": float(moved)},
                                   on_step=True, on_epoch=False, logger=True, prog_bar=False)
        if self._recoveries:
            pl_module.log_dict({"recoveries": float(len(self._recoveries)), "recovery_s": self._recoveries[-1]},
                               on_step=True, on_epoch=False, logger=False, prog_bar=True)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        self._ended = False
        done = strategy.sharded.completed_steps if strategy.sharded is not None else 0
        if trainer.max_steps > 0 and done >= trainer.max_steps:
            # Joined (or rolled back) at the last step's boundary: Lightning skips its loop, on_train_end with it;
            # this rank still ends the training with the others (their end-of-training barrier, the digests).
            self._t_start, self._start_step = time.perf_counter(), done
            self.on_train_end(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        if self._ended:  # ended from on_fit_start: a loop that found its counters only then ran anyway
            return
        self._ended = True
        strategy.end_of_training_barrier()
        train_s = time.perf_counter() - self._t_start
        try:
            digest = strategy.full_state_digest()
        except PeerFailure as e:  # after the barrier every rank has trained every step: nothing is left to recover
            raise SummaryError(f"rank {strategy.global_rank}: a peer failed after training ended on every rank, "
                               f"while the final digests were taken ({e}); the training itself completed") from None
        store = strategy.membership.store
        if not strategy.is_lead:  # rank 0, or the lowest rank of a shrunk world without it
            store.set(finished_key(os.getpid()), "1")
            return
        final = strategy.sharded.completed_steps if strategy.sharded is not None else trainer.global_step
        steps = final - self._start_step
        summary = {
            "final_step": final,
            "train_s": round(train_s, 3),
            "steps_per_s": round(steps / train_s, 3) if train_s > 0 else None,
            "state_sha256": digest,
            "data_sha256": strategy.data_digest.hexdigest,
            "data_steps": strategy.data_digest.steps,
            "integrity": strategy.integrity_summary(),
            "train_end_t": time.time(),
        }
        write_worker_summary(self.run_dir, summary)
        store.set(finished_key(os.getpid()), "1")
