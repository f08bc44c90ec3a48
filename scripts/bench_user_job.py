"""The bench's user job: the model and data of tests/scripts/user_lightning.py, made heavier, in two modes.

  --mode checkpointless   CheckpointlessStrategy() + CheckpointlessCallback(), run by `checkpointless-run`
  --mode ddp              Lightning's DDP (gloo, CPU) + ModelCheckpoint(every_n_train_steps=K, save_last=True),
                          run by `torchrun --max-restarts M`; after a restart it resumes from RUN_DIR/ckpt/last.ckpt

Both write RUN_DIR/progress_rank<r>.txt (the step each rank is at; the bench times its kill by it). Rank 0 writes,
in ddp mode, one line per start of training to RUN_DIR/starts_rank0.jsonl (the step it starts from: 0, or the
checkpoint's step after a restart), and at the end RUN_DIR/done.json: the final global_step, time.time(), the
times at which this process finished step --t-from and the last step, and a sha256 of the module's parameters.

    python scripts/bench_user_script.py          # runs this script under both launchers
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nemo_checkpointless.bench.job import params_sha256


def make_data(n: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n, generator=g)
    return x, y


class Regressor(pl.LightningModule):
    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 1))

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        x, y = batch  # type: ignore[misc]
        loss = nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True)
        return loss

    def configure_optimizers(self) -> object:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class Progress(pl.Callback):
    """RUN_DIR/progress_rank<r>.txt: the step this rank has finished; the times of step `t_from` and the last."""

    def __init__(self, run_dir: str, t_from: int) -> None:
        self.run_dir, self.t_from = run_dir, t_from
        self.t_from_t: float | None = None
        self.last_t: float | None = None
        self.start_step: int | None = None
        self.steps_log = None  # rank 0: one line per step, "step time pid" (the bench's step times)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step  # after Lightning restored a checkpoint: its step
        if trainer.global_rank == 0:
            with open(os.path.join(self.run_dir, "starts_rank0.jsonl"), "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "t": time.time(), "pid": os.getpid()}) + "\n")
            self.steps_log = open(os.path.join(self.run_dir, "steps_rank0.txt"), "a", buffering=1)  # noqa: SIM115

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        now = time.time()
        if trainer.global_step == self.t_from and self.t_from_t is None:
            self.t_from_t = now
        self.last_t = now
        if self.steps_log is not None:
            self.steps_log.write(f"{trainer.global_step} {now:.6f} {os.getpid()}\n")
        _write(os.path.join(self.run_dir, f"progress_rank{trainer.global_rank}.txt"), str(trainer.global_step))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("checkpointless", "ddp"), required=True)
    parser.add_argument("--run-dir", default=None, help="default: $RUN_DIR, else $NCL_RUN_DIR, else .")
    parser.add_argument("--max-steps", type=int, default=210)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--ckpt-every", type=int, default=20, help="ddp: ModelCheckpoint every N steps (0: none)")
    parser.add_argument("--t-from", type=int, default=10, help="the step from which done.json times training")
    args = parser.parse_args()
    run_dir = args.run_dir or os.environ.get("RUN_DIR") or os.environ.get("NCL_RUN_DIR", ".")
    os.makedirs(run_dir, exist_ok=True)

    pl.seed_everything(1234, verbose=False)
    model = Regressor(args.features, args.hidden)
    progress = Progress(run_dir, args.t_from)
    ckpt_dir = os.path.join(run_dir, "ckpt")
    ckpt_path = None
    if args.mode == "checkpointless":
        from nemo_checkpointless.lightning import CheckpointlessCallback, CheckpointlessStrategy

        strategy: object = CheckpointlessStrategy()
        callbacks: list[pl.Callback] = [CheckpointlessCallback(), progress]
        checkpointing = False
    else:
        from lightning.pytorch.callbacks import ModelCheckpoint

        strategy = "ddp"
        callbacks = [progress]
        checkpointing = args.ckpt_every > 0
        if checkpointing:
            callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.ckpt_every, save_last=True))
            last = os.path.join(ckpt_dir, "last.ckpt")
            ckpt_path = last if os.path.exists(last) else None  # torchrun restarted the job: resume
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "4")), strategy=strategy,
        callbacks=callbacks, max_steps=args.max_steps, max_epochs=-1, gradient_clip_val=1.0, logger=False,
        enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0)
    x, y = make_data(args.samples, args.features)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True),
                ckpt_path=ckpt_path)
    if args.mode == "ddp" and torch.distributed.is_initialized():
        # Lightning leaves the process group up; torn down at interpreter exit, a rank of a restarted torchrun
        # job was seen to abort ("terminate called without an active exception"), which torchrun counts as a
        # failure and restarts the whole job once more. A careful torchrun script ends it itself.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if trainer.global_rank == 0:
        done = {"mode": args.mode, "global_step": trainer.global_step, "time": time.time(),
                "start_step": progress.start_step, "t_from_step": args.t_from, "t_from": progress.t_from_t,
                "t_last": progress.last_t, "params_sha256": params_sha256(model), "pid": os.getpid()}
        _write(os.path.join(run_dir, "done.json"), json.dumps(done))


if __name__ == "__main__":
    main()
