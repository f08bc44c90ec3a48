"""`CheckpointlessCallback` for NeMo 2: `nl.Trainer(strategy=CheckpointlessMegatronStrategy(...),
callbacks=[CheckpointlessCallback()])`. Importing this module imports NeMo (the [nemo] extra).

Per step: the fault plan's faults (tests, benchmarks; each fires once per job, even across replacements) and the
stamps the launcher turns into each recovery's record. At the end, every rank writes `RUN_DIR/nemo_rank<r>.json` (its
pid and the sha256 of its parameters, optimizer shard and RNG), and rank 0 writes `RUN_DIR/worker_summary.json`
(what `checkpointless-run` puts in `summary.json`): the final step, `state_sha256` (every TP/PP slice's parameters
and optimizer state whole, `megatron.digest`: equal exactly when the states are bitwise equal, however the shards are
cut into 1 or N optimizer instances) and `data_sha256` (the global batches, defined as on the Lightning path, so the two
engines agree on it for the same data settings).

It holds no store or process state of its own (NeMo deep-copies a trainer's callbacks for its io config): all of
that is the strategy's session.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from nemo_checkpointless.config import FaultSpec
from nemo_checkpointless.errors import ConfigError, SummaryError
from nemo_checkpointless.megatron.digest import slice_digest
from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy
from nemo_checkpointless.protocol import (
    FAULT_PLAN_ENV,
    RUN_DIR_ENV,
    TRAIN_START_KEY,
    finished_key,
    mark_process_training,
    write_worker_summary,
)
from nemo_checkpointless.restart import progress
from nemo_checkpointless.restart.faults import slow_delay
from nemo_checkpointless.state.hashing import state_digest
from nemo_checkpointless.topology import rank_info

log = logging.getLogger(__name__)


class CheckpointlessCallback(pl.Callback):
    """Pairs with `CheckpointlessMegatronStrategy`.

    Args:
        run_dir: where the summary goes. Default: the launcher's run directory.
        fault_plan: faults to inject (tests, benchmarks). Default: the launcher's (`checkpointless-run
            --fault kind:rank:step`), else none.
        summary_timeout_s: how long rank 0 waits for every rank's final digests at the end.
    """

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, fault_plan: list[FaultSpec] | None = None,
                 summary_timeout_s: float = 120.0) -> None:
        self.run_dir = Path(run_dir if run_dir is not None else os.environ.get(RUN_DIR_ENV, "."))
        if fault_plan is None and os.environ.get(FAULT_PLAN_ENV):
            fault_plan = [FaultSpec(**spec) for spec in json.loads(os.environ[FAULT_PLAN_ENV])]
        self.fault_plan = list(fault_plan or [])
        for i, spec in enumerate(self.fault_plan):
            if spec.kind == "bitflip" and spec.target == "param":
                raise ConfigError(f"fault.plan[{i}].target", spec.target,
                                  "a bitflip in the parameters outside a rank's shard is injected by the Lightning "
                                  "engine only; the NeMo engine flips a bit of the rank's optimizer shard",
                                  "drop the target (target shard)")
        self.summary_timeout_s = summary_timeout_s

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> CheckpointlessMegatronStrategy:
        if not isinstance(trainer.strategy, CheckpointlessMegatronStrategy):
            raise ConfigError("nl.Trainer(strategy=...)", type(trainer.strategy).__name__,
                              "CheckpointlessCallback needs the checkpointless strategy (it recovers the ranks)",
                              "use strategy=CheckpointlessMegatronStrategy(...), which takes every argument "
                              "nl.MegatronStrategy takes")
        return trainer.strategy

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy(trainer).callback_paired = True  # the strategy's own setup, next, refuses to run without

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        if strategy.reentry:
            strategy.reentry["train_start"] = time.time()
            strategy.reentry["groups"] = strategy.groups_s
            strategy.reentry["graphs"] = compiled_graphs()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        strategy = self._strategy(trainer)
        session = strategy.session
        store = session.store
        if mark_process_training(store) and session.env.rank == 0 and not store.check([TRAIN_START_KEY]):
            store.set(TRAIN_START_KEY, json.dumps(time.time()))
        session.beacon.mark(trainer.global_step + 1, progress.STEP_START)
        faults = session.faults
        if not faults.plan:
            faults.arm(self.fault_plan)
        faults.fire(trainer.global_step + 1)
        slow_delay()  # a `slow` fault that fired: this rank is a straggler from then on

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        strategy = self._strategy(trainer)
        session, step = strategy.session, trainer.global_step
        if strategy.reentry:  # the first step after a recovery: where the time to re-enter `fit` went
            t = strategy.reentry
            log.debug(f"back in fit: fit set-up {t['train_start'] - t['recovered']:.2f} s "
                  f"(of which groups {t.get('groups', 0.0):.2f} s; model built "
                  f"{'uninitialised' if strategy.built_uninitialised else 'and initialised'}; "
                  f"{strategy.barriers_skipped} of Lightning's barriers skipped), first step "
                  f"{time.time() - t['train_start']:.2f} s ({compiled_graphs() - t['graphs']:.0f} graphs compiled)")
            strategy.reentry = {}
        session.stamps.stamp(step)
        session.beacon.mark(step, progress.BATCH_END)
        loader = getattr(getattr(trainer, "datamodule", None), "loader", None)
        first = getattr(loader, "first_batch", None)
        if first and first["step"] and not first.get("reported"):
            first["reported"] = True
            log.debug(f"data: first batch at step {first['step']} from the {first['source']} in "
                      f"{1e3 * first['s']:.2f} ms")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy(trainer)
        session, step = strategy.session, trainer.global_step
        rank, world, store = session.env.rank, session.env.world_size, session.store
        part = strategy.participant
        assert part is not None
        # The replicas vote on the final state before any rank hands it over (the digests, the script's save),
        # unless this fit entered at this boundary (its state was voted on there): a repair loads the majority's
        # state here, a rollback leaves `fit` and trains again. No rank leaves before every rank has completed the
        # last step: a rank lost in it is recovered with its peers (its replica among them) still here. A failure
        # raises out of `fit`, which recovers and re-enters.
        part.at_step_boundary(step)
        assert strategy.runtime is not None
        strategy.runtime.end_barrier(part, step)
        tensors, _ = part.boundary_state()
        params = state_digest({k: v for k, v in tensors.items() if k.startswith("model.")}, {})
        shard = state_digest({k: v for k, v in tensors.items() if k.startswith("opt")}, {})
        # The slice's state whole (a collective over the ranks of this instance that hold the same TP/PP slice),
        # whatever the number of optimizer instances.
        info = rank_info(session.dims, rank)
        try:
            whole = slice_digest(part, strategy.optimizers[0], session.membership.group("digest", info.shard_group))
        except RuntimeError as e:  # after the barrier every rank has trained every step: nothing left to recover
            raise SummaryError(f"rank {rank}: a peer failed after training ended on every rank, while the final "
                               f"digests were taken ({str(e)[:200]}); the training itself completed") from None
        if info.instance == 0 and info.shard_group[0] == rank:
            store.set(f"final/{step}/{rank}", whole)
        record = {"rank": rank, "pid": os.getpid(), "step": step, "params_sha256": params, "shard_sha256": shard,
                  "rng_sha256": state_digest({k: v for k, v in tensors.items() if k.startswith("rng.")}, {})}
        loader = getattr(getattr(trainer, "datamodule", None), "loader", None)
        if loader is not None:  # tier 2: how this fit's micro-batches were served (cache hits, direct reads, ...)
            record["data_cache"] = dict(loader.stats)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / f"nemo_rank{rank}.json").write_text(json.dumps(record, indent=1))
        if rank != 0:
            store.set(finished_key(os.getpid()), "1")
            return
        leaders = sorted({rank_info(session.dims, r).shard_group[0] for r in range(world)
                          if rank_info(session.dims, r).instance == 0})
        finals = [f"final/{step}/{r}" for r in leaders]  # one per TP/PP slice, in rank order
        try:
            store.wait(finals, datetime.timedelta(seconds=self.summary_timeout_s))
        except RuntimeError:  # the store's wait timeout; not a peer's failure (nothing to recover at the end)
            missing = [k for k in finals if not store.check([k])]
            raise SummaryError(f"rank 0: training ended at step {step} but {len(missing)} record(s) of the "
                               f"job's summary are missing after {self.summary_timeout_s:.0f} s: "
                               f"{', '.join(missing[:8])}") from None
        state = hashlib.sha256("|".join(store.get(k).decode() for k in finals).encode()).hexdigest()
        data = part.data_digest  # every rank's batches of every step, folded step by step (`gather_step_hashes`)
        summary = {"final_step": step, "state_sha256": state, "data_sha256": data.hexdigest,
                   "data_steps": data.steps, "integrity": strategy.integrity_summary(), "train_end_t": time.time()}
        write_worker_summary(self.run_dir, summary)
        store.set(finished_key(os.getpid()), "1")


def compiled_graphs() -> int:
    """How many graphs `torch.compile` has compiled in this process (megatron's fused functions are compiled in
    the first step that calls them: a replacement whose spare warmed them up compiles none)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0
