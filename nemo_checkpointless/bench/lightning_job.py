"""The benchmark job as a user's Lightning script (`nemo_checkpointless.bench.job`), in three modes:

  --mode ours    CheckpointlessStrategy() + CheckpointlessCallback(), under `checkpointless-run`
  --mode ddp     Lightning's DDP (gloo) + ModelCheckpoint every --ckpt-every steps, under `torchrun --max-restarts`:
                 a restarted job resumes from RUN_DIR/ckpt/last.ckpt (the job restart every system is measured against)
  --mode plain   Lightning's DDP without a checkpoint (the fault-free cost of the others)
"""

from __future__ import annotations

import argparse
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from nemo_checkpointless.bench.job import JobSpec, StepLog, build_model, lm_loss, token_data, warmup


class BenchModule(pl.LightningModule):
    def __init__(self, spec: JobSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = build_model(spec)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return lm_loss(self.model, batch[0])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.spec.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                      foreach=False)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup(self.spec))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Report(pl.Callback):
    """The worker's `StepLog`, opened when training starts (a hot spare learns its rank only inside `fit`)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.steps: StepLog | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.steps is None:
            self.steps = StepLog(self.run_dir, trainer.global_rank)
        self.steps.event("train", step=trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        assert self.steps is not None
        self.steps.step(trainer.global_step)


def state_bytes(strategy: Any) -> dict[str, int]:
    """The bytes of training state this rank holds under CheckpointlessStrategy: its full parameters, its gradient
    buffer, its shard of the optimizer state (what `memory_overhead_ratio` compares with the theory)."""
    sharded = strategy.sharded
    params = sum(g.flat.numel() * g.flat.element_size() for g in sharded.groups)
    grads = sharded.flat_grad.numel() * sharded.flat_grad.element_size()
    optim = sum(t.numel() * t.element_size() for name, t in sharded.shard_state().items()
                if not name.endswith(".param") and t.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": optim,
            "num_params": sum(p.numel() for p in strategy.lightning_module.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("ours", "ddp", "plain"), required=True)
    parser.add_argument("--run-dir", required=True)
    JobSpec().add_arguments(parser)
    args = parser.parse_args()
    spec = JobSpec.from_args(args)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    pl.seed_everything(spec.seed, verbose=False)
    module = BenchModule(spec)
    callbacks: list[pl.Callback] = []
    ckpt_path = None
    if args.mode == "ours":
        from nemo_checkpointless.lightning import CheckpointlessCallback, CheckpointlessStrategy

        strategy: Any = CheckpointlessStrategy()
        callbacks.append(CheckpointlessCallback())
    else:
        strategy = "ddp"
        if args.mode == "ddp":
            from lightning.pytorch.callbacks import ModelCheckpoint

            ckpt_dir = os.path.join(args.run_dir, "ckpt")
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=spec.ckpt_every, save_last=True))
            last = os.path.join(ckpt_dir, "last.ckpt")
            ckpt_path = last if os.path.exists(last) else None  # torchrun restarted the job: resume
    report = Report(args.run_dir)
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "4")), strategy=strategy,
        callbacks=[*callbacks, report], max_steps=spec.steps, max_epochs=-1,
        gradient_clip_val=spec.grad_clip, logger=False, enable_checkpointing=args.mode == "ddp",
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    data = DataLoader(TensorDataset(token_data(spec)), batch_size=spec.micro_batch, shuffle=True)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if args.mode != "ours" and torch.distributed.is_initialized():
        torch.distributed.barrier()  # then end the group here: torn down at exit, a restarted rank was seen to abort
        torch.distributed.destroy_process_group()
    extra = {"state_bytes": state_bytes(trainer.strategy)} if args.mode == "ours" else {}
    (report.steps or StepLog(args.run_dir, trainer.global_rank)).done(trainer.global_step, module, **extra)


if __name__ == "__main__":
    main()
