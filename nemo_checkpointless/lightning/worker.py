"""A training rank: `python -m nemo_checkpointless.lightning.worker`, started by the launcher (never by hand)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

from nemo_checkpointless.config import Config, load_run_config
from nemo_checkpointless.data.indexed import IndexedTokens
from nemo_checkpointless.data.sampling import GlobalBatchPlan, RankBatchSampler, TokenSequences
from nemo_checkpointless.lightning.callback import CheckpointlessCallback
from nemo_checkpointless.lightning.module import LlamaLightningModule
from nemo_checkpointless.lightning.strategy import CheckpointlessStrategy
from nemo_checkpointless.models import LlamaConfig
from nemo_checkpointless.restart import WorkerEnv


def build_trainer(cfg: Config, env: WorkerEnv) -> tuple[pl.Trainer, LlamaLightningModule, torch.utils.data.DataLoader]:
    assert cfg.data.path is not None, "the launcher resolves data.path before starting workers"
    torch.set_num_threads(cfg.launcher.threads_per_rank)
    # The same seed on every rank: every replica starts from the same parameters.
    pl.seed_everything(cfg.seed, workers=False, verbose=False)
    dataset = TokenSequences(IndexedTokens(cfg.data.path).tokens, cfg.data.seq_len)
    plan = GlobalBatchPlan(len(dataset), cfg.data.micro_batch_size, env.world_size, cfg.seed, cfg.data.shuffle)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=RankBatchSampler(plan, env.rank, 0, cfg.trainer.max_steps), num_workers=0)
    module = LlamaLightningModule(LlamaConfig(**vars(cfg.model)), cfg.optim, cfg.trainer.max_steps)
    strategy = CheckpointlessStrategy(num_instances=cfg.replication.num_instances, grad_clip=cfg.optim.grad_clip,
                                      collective_timeout_s=cfg.launcher.collective_timeout_s, worker_env=env)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=cfg.trainer.max_steps,
        callbacks=[CheckpointlessCallback(env.run_dir)],
        logger=CSVLogger(env.run_dir, name="logs", version="metrics"),
        log_every_n_steps=cfg.trainer.log_every_n_steps, enable_checkpointing=False,
        enable_progress_bar=cfg.trainer.progress_bar, enable_model_summary=env.rank == 0,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0)
    return trainer, module, loader


def main() -> int:
    env = WorkerEnv.from_environ()
    cfg = load_run_config(Path(env.run_dir))
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    trainer, module, loader = build_trainer(cfg, env)
    trainer.fit(module, train_dataloaders=loader)
    # Skip interpreter teardown: retired gloo groups would join their threads; nothing is left to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
