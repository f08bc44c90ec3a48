"""A user's own Lightning script, written as for `torchrun` + DDP, with the strategy swapped in.

Its own LightningModule (dropout), its own data (TensorDataset + DataLoader(shuffle=True), or a
LightningDataModule with dict batches, optionally through `MmapDataModule`), its own AdamW + LR schedule,
`self.log(..., sync_dist=True)`.
Run by the tests with `checkpointless-run --nproc-per-node 4 --spares 1 tests/scripts/user_lightning.py ...`.

At the end every rank writes `RUN_DIR/user_rank<r>.json`: digests of its parameters and of its own optimizer
state (its shard), which the tests compare with a fault-free run. With `--step-log` every process also logs each
optimizer step it completes (`StepLog`: the format tests/steplog.py reads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from nemo_checkpointless.lightning import CheckpointlessCallback, CheckpointlessStrategy, MmapDataModule
from nemo_checkpointless.restart.groups import device_plane_stats  # what the tests check of the device plane


def make_data(n: int = 512, features: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n, generator=g)
    return x, y


class DictDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "target": self.y[i]}


class RegressionData(pl.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.train = DictDataset(*make_data())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)


class Regressor(pl.LightningModule):
    def __init__(self, features: int = 16, hidden: int = 64, step_sleep: float = 0.0, slow_rank: int = -1,
                 slow_s: float = 0.0, slow_step: int = 0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 1))
        self.step_sleep = step_sleep
        # A straggler: this rank's steps take slow_s longer (only step `slow_step`, 1-based, when given).
        self.slow_rank, self.slow_s, self.slow_step = slow_rank, slow_s, slow_step
        self.val_batches = 0

    def training_step(self, batch: object, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, dict):
            x, y = batch["features"], batch["target"]
        else:
            x, y = batch  # type: ignore[misc]
        if self.step_sleep:
            time.sleep(self.step_sleep)
        if self.global_rank == self.slow_rank and self.slow_step in (0, self.global_step + 1):
            time.sleep(self.slow_s)
        loss = nn.functional.mse_loss(self.net(x).squeeze(1), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True)
        return loss

    def validation_step(self, batch: object, batch_idx: int) -> None:
        x, y = batch  # type: ignore[misc]
        self.val_batches += 1
        self.log("val_loss", nn.functional.mse_loss(self.net(x).squeeze(1), y), sync_dist=True)

    def configure_optimizers(self) -> object:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Progress(pl.Callback):
    """The step each rank is at, in RUN_DIR/progress_rank<r>.txt (the tests time their kills by it)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        path = os.path.join(self.run_dir, f"progress_rank{trainer.global_rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(str(trainer.global_step))
        os.replace(path + ".tmp", path)


class StepLog(pl.Callback):
    """After every optimizer step this process completes, one JSON line appended to
    RUN_DIR/steps_rank<r>.<pid>.jsonl (closed at once: a killed rank's lines survive it): rank, pid, step, a digest
    of the step's micro-batches and a monotonic time (which orders a rank's processes)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.before = -1
        self.digest = hashlib.sha256()

    def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
        self.digest = hashlib.sha256()  # fit entered again: a step begun before it never completed

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object,
                             batch_idx: int) -> None:
        self.before = trainer.global_step
        tensors = [batch[k] for k in sorted(batch)] if isinstance(batch, dict) else batch
        for t in tensors:  # type: ignore[attr-defined]
            self.digest.update(t.detach().cpu().numpy().tobytes())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step == self.before:
            return  # a micro-batch that did not step
        line = {"rank": trainer.global_rank, "pid": os.getpid(), "step": trainer.global_step,
                "batch": self.digest.hexdigest()[:16], "t": time.monotonic()}
        self.digest = hashlib.sha256()
        with open(os.path.join(self.run_dir, f"steps_rank{trainer.global_rank}.{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


class EvalLoss(pl.Callback):
    """After every optimizer step: the model's loss on a fixed held-out set (eval mode: no dropout, no RNG drawn),
    appended as "step loss" to RUN_DIR/eval_loss_rank<r>.txt: the loss curve the shrink tests compare."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        x, y = make_data(n=576)
        self.x, self.y = x[512:], y[512:]
        self.last = -1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.global_step == self.last:
            return  # a micro-batch that did not step
        self.last = trainer.global_step
        training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            loss = nn.functional.mse_loss(pl_module.net(self.x).squeeze(1), self.y).item()  # type: ignore[operator]
        pl_module.train(training)
        with open(os.path.join(self.run_dir, f"eval_loss_rank{trainer.global_rank}.txt"), "a") as f:
            f.write(f"{trainer.global_step} {loss!r}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--max-epochs", type=int, default=-1)
    parser.add_argument("--datamodule", action="store_true")
    parser.add_argument("--mmap", action="store_true", help="the DataModule through MmapDataModule (tier 2)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--devices", default="4")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--slow-rank", type=int, default=-1, help="a straggler: this rank sleeps --slow-s a step")
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--slow-step", type=int, default=0, help="with --slow-rank: only this step (1-based) is slow")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N batches (0: no validation)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu", help="gpu: one CUDA device a rank (scripts/gpu_check.sh)")
    parser.add_argument("--eval-loss", action="store_true", help="write the held-out loss after every step")
    parser.add_argument("--step-log", action="store_true", help="log every completed step (StepLog)")
    args = parser.parse_args()
    run_dir = os.environ.get("NCL_RUN_DIR", ".")

    pl.seed_everything(1234, verbose=False)
    model = Regressor(step_sleep=args.step_sleep, slow_rank=args.slow_rank, slow_s=args.slow_s,
                      slow_step=args.slow_step)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=int(args.devices) if args.devices.isdigit() else args.devices,
        num_nodes=args.num_nodes,
        strategy=CheckpointlessStrategy(),
        callbacks=[CheckpointlessCallback(), Progress(run_dir), *([EvalLoss(run_dir)] if args.eval_loss else []),
                   *([StepLog(run_dir)] if args.step_log else [])],
        max_steps=args.max_steps, max_epochs=args.max_epochs, accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, precision=args.precision,
        val_check_interval=args.val_every or None, limit_val_batches=4 if args.val_every else 0)
    if args.datamodule:
        data = RegressionData(args.batch_size)
        trainer.fit(model, datamodule=MmapDataModule(data) if args.mmap else data)
    else:
        x, y = make_data()
        val = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=args.batch_size) if args.val_every else None
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True), val)
    digests = trainer.strategy.rank_state_digests()  # type: ignore[attr-defined]
    digests.update(rank=trainer.global_rank, val_batches=model.val_batches, global_step=trainer.global_step,
                   epoch=trainer.current_epoch, pid=os.getpid(), nice=os.nice(0),
                   device_plane=device_plane_stats(), device=str(trainer.strategy.root_device))
    with open(os.path.join(run_dir, f"user_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(digests, f)


if __name__ == "__main__":
    main()
