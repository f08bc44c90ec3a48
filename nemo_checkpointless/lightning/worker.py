"""A training rank or a hot spare: `python -m nemo_checkpointless.lightning.worker`, started by the launcher.

The built-in job written as a user's script would be, on the public pieces only: `CheckpointlessStrategy`,
`CheckpointlessCallback` and a `LightningDataModule` (`JobData`). A spare imports everything, builds the model
and the trainer, and waits inside `fit` (the strategy's launcher) for the launcher to hand it a rank; it then
joins as that rank's replacement. A fallback to the persistent checkpoint leaves the fit loop and enters it
again in the same process, from the checkpoint's step (the strategy's launcher too).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from nemo_checkpointless.config import Config, load_run_config
from nemo_checkpointless.data.indexed import IndexedTokens
from nemo_checkpointless.data.job import job_loader
from nemo_checkpointless.data.loader import LedgeredLoader, MmapBatchLoader
from nemo_checkpointless.data.sampling import GlobalBatchPlan, RankBatchSampler, TokenSequences
from nemo_checkpointless.lightning.callback import CheckpointlessCallback
from nemo_checkpointless.lightning.module import LlamaLightningModule
from nemo_checkpointless.lightning.strategy import CheckpointlessStrategy
from nemo_checkpointless.protocol import RUN_DIR_ENV, SPARE_ID_ENV
from nemo_checkpointless.restart.session import Session
from nemo_checkpointless.restart.template import warm_up_at_idle_priority
from nemo_checkpointless.restart.worker_env import freeze_heap, preload, run_worker
from nemo_checkpointless.topology import rank_info

log = logging.getLogger(__name__)


class _PositionedSampler(RankBatchSampler):
    """Reads its first step from the session's data position when iterated (set by a join or a restart)."""

    def __init__(self, plan: GlobalBatchPlan, dp_rank: int, session: Session, end_step: int) -> None:
        super().__init__(plan, dp_rank, 0, end_step)
        self.session = session

    def __iter__(self) -> Iterator[list[int]]:
        self.start_step = self.session.position.step
        return super().__iter__()

    def __len__(self) -> int:
        return self.end_step - self.session.position.step


def _build_loader(cfg: Config, session: Session, dataset: TokenSequences, plan: GlobalBatchPlan, dp_rank: int
                  ) -> Iterable[torch.Tensor]:
    """`data.loader=mmap`: batches from the job's shared-memory cache (tier 2); `plain`: a `DataLoader`. Both start
    at the session's data position when iterated, and with `data.verify` record what they yield for the check."""
    env = session.env
    start = lambda: session.position.step  # noqa: E731  (set by a join or a restart before `fit` iterates)
    loader: MmapBatchLoader | LedgeredLoader
    if cfg.data.loader == "plain":
        plain = torch.utils.data.DataLoader(
            dataset, batch_sampler=_PositionedSampler(plan, dp_rank, session, cfg.trainer.max_steps), num_workers=0)
        if not cfg.data.verify:
            return plain
        loader = LedgeredLoader(plain, start)
    else:
        loader = job_loader(cfg, session.membership.store, rank=env.rank, dims=session.dims, run_dir=env.run_dir,
                            store_port=env.store_port, dataset=dataset, plan=plan, end_step=cfg.trainer.max_steps,
                            start_step=start)
    return loader


class JobData(pl.LightningDataModule):
    """The built-in job's data: token sequences in the order of the job's `GlobalBatchPlan` (the NeMo engine's
    too), through the shared-memory cache (`data.loader=mmap`) or a `DataLoader` (`plain`). Built when `fit`
    starts, from the strategy's session (a spare learns its rank there), and again when `fit` is entered again
    after a checkpoint fallback; both start at the session's data position."""

    def __init__(self, cfg: Config, tokens: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.dataset = TokenSequences(tokens, cfg.data.seq_len)
        self.loader: Iterable[torch.Tensor] | None = None

    def train_dataloader(self) -> Iterable[torch.Tensor]:
        assert self.trainer is not None
        strategy = self.trainer.strategy
        assert isinstance(strategy, CheckpointlessStrategy)
        session, cfg = strategy.session, self.cfg
        if isinstance(self.loader, (MmapBatchLoader, LedgeredLoader)):
            self.loader.close()  # its prefetch thread stops
        dp_rank = rank_info(session.dims, session.env.rank).dp_rank
        plan = GlobalBatchPlan(len(self.dataset), cfg.data.micro_batch_size, session.dims.dp, cfg.seed,
                               cfg.data.shuffle)
        self.loader = _build_loader(cfg, session, self.dataset, plan, dp_rank)
        return self.loader


class _DataOrderCheck(pl.Callback):
    """Before each step: the batch must be the one the loader produced for this step (`data.verify`)."""

    def __init__(self, data: JobData) -> None:
        self.data = data
        self._first = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first = True

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        loader = self.data.loader
        if not isinstance(loader, (MmapBatchLoader, LedgeredLoader)):
            return
        loader.check_batch(trainer.global_step, batch)
        first = getattr(loader, "first_batch", None)
        if self._first and first and first["step"]:
            log.debug(f"data: first batch at step {first['step']} from the {first['source']} in "
                      f"{1e3 * first['s']:.2f} ms")
        self._first = False


def build_trainer(cfg: Config, tokens: object) -> tuple[pl.Trainer, LlamaLightningModule, JobData]:
    """The job as a user's script would write it: the public strategy, callback and a data module."""
    # The same seed on every rank: every replica starts from the same parameters.
    pl.seed_everything(cfg.seed, workers=False, verbose=False)
    data = JobData(cfg, tokens)
    module = LlamaLightningModule(cfg.model.llama_config(), cfg.optim, cfg.trainer.max_steps)
    strategy = CheckpointlessStrategy(
        num_instances=cfg.replication.num_instances, grad_clip=cfg.optim.grad_clip,
        checkpoint_every_n_steps=cfg.checkpoint.every_n_steps, checkpoint_dir=cfg.checkpoint.dir,
        collective_timeout_s=cfg.launcher.collective_timeout_s, verify_checksum=cfg.replication.checksum)
    run_dir = os.environ[RUN_DIR_ENV]
    callbacks: list[pl.Callback] = [_DataOrderCheck(data), CheckpointlessCallback(run_dir, cfg.fault.plan)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=cfg.trainer.devices, num_nodes=cfg.trainer.num_nodes, strategy=strategy,
        max_steps=cfg.trainer.max_steps, callbacks=callbacks,
        logger=CSVLogger(run_dir, name="logs", version="metrics_rank0"),  # written by rank 0 only
        log_every_n_steps=cfg.trainer.log_every_n_steps, enable_checkpointing=False,
        enable_progress_bar=cfg.trainer.progress_bar, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0)
    return trainer, module, data


def warm_up(cfg: Config) -> None:
    """Run one forward/backward of the model on a dummy batch, so a replacement's first real step does not pay for
    first-call kernel and allocator set-up (measured: ~0.1 s of a ~0.3 s recovery on the CPU test job). Touches
    no state that matters: the model is rebuilt, and RNG is restored from the replica, after assignment."""
    module = LlamaLightningModule(cfg.model.llama_config(), cfg.optim, cfg.trainer.max_steps)
    batch = torch.zeros(cfg.data.micro_batch_size, cfg.data.seq_len + 1, dtype=torch.int64)
    logits = module.model(batch[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()


@dataclass
class _Prepared:
    """What a rank or spare sets up before it needs the store: the config, the tokens, and (a spare) the warm-up."""

    cfg: Config
    tokens: Any
    warm: bool = False


def _prepare(run_dir: str) -> _Prepared:
    cfg = load_run_config(Path(run_dir))
    torch.set_num_threads(cfg.launcher.threads_per_rank)
    preload(cfg)
    assert cfg.data.path is not None, "the launcher resolves data.path before starting workers"
    return _Prepared(cfg, IndexedTokens(cfg.data.path).tokens)


def spare_template() -> Callable[[], None]:
    """For `restart.template`: import and warm up once; each spare forked from here runs the returned function."""
    prepared = _prepare(os.environ[RUN_DIR_ENV])
    warm_up(prepared.cfg)
    prepared.warm = True
    freeze_heap()  # what every spare shares stays out of its collections (and its pages are not copied by them)
    return lambda: run(prepared)


def run(prepared: _Prepared | None = None) -> None:
    """A rank, or a hot spare (it builds everything, then waits inside `fit` for the rank it replaces). A fallback
    to the persistent checkpoint enters `fit` again in this process (the strategy's launcher does it)."""
    prepared = prepared or _prepare(os.environ[RUN_DIR_ENV])
    cfg = prepared.cfg
    if SPARE_ID_ENV in os.environ and not prepared.warm:  # a spare started without the template
        warm_up_at_idle_priority(lambda: warm_up(cfg))
    trainer, module, data = build_trainer(cfg, prepared.tokens)
    trainer.fit(module, datamodule=data)


def main() -> NoReturn:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    run_worker(run)


if __name__ == "__main__":
    main()
