"""A NeMo 2 user's own pre-training script, with the checkpointless strategy and callback swapped in.

Its own tiny `llm.GPTModel(Llama3Config(...))` (dropout on), NeMo's `MockDataModule`, Megatron's distributed
optimizer through `nl.MegatronOptimizerModule` with a warm-up + cosine schedule, `nl.Trainer`, and `llm.train`.
Run by the tests with `checkpointless-run --nproc-per-node 4 --spares 1 tests/scripts/user_nemo.py ...`.

The one line a user would not write: on a machine without a GPU the test suite's CPU shim (`tests/nemo_shim.py`)
is installed before NeMo is imported. Every rank writes RUN_DIR/progress_rank<r>.txt (its step; the tests time
their kills by it); the callback writes the digests the tests compare with a fault-free run. With `--step-log` every
process also logs each optimizer step it completes (`StepLog`: the format tests/steplog.py reads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from typing import Any

import torch

if not torch.cuda.is_available():
    import nemo_shim  # test-only: megatron-core and NeMo on CPU (PYTHONPATH=tests)

    nemo_shim.install()

import lightning.pytorch as pl
from megatron.core.optimizer import OptimizerConfig
from nemo import lightning as nl
from nemo.collections import llm
from nemo.collections.llm.gpt.model.llama import Llama3Config
from nemo.lightning.pytorch.optim import CosineAnnealingScheduler

from nemo_checkpointless.megatron import numerics
from nemo_checkpointless.nemo import CheckpointlessCallback, CheckpointlessMegatronStrategy, MmapDataModule


class ByteVocabulary:
    """What MockDataModule and GPTModel read of a tokenizer: the vocabulary size."""

    vocab_size = 256


class CpuMockDataModule(llm.MockDataModule):
    """NeMo 2.7.3's MockDataModule passes `create_attention_mask` to its dataset in the `seed` position, so without
    Transformer Engine (on CPU) its batches have no mask; this puts the mask back."""

    def setup(self, stage: str = "") -> None:
        super().setup(stage)
        for dataset in (self._train_ds, self._validation_ds, self._test_ds):
            dataset.create_attention_mask = True
            dataset.attention_mask = torch.ones(self.seq_length, self.seq_length).tril().unsqueeze(0) < 0.5


class Progress(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        path = os.path.join(os.environ.get("NCL_RUN_DIR", "."), f"progress_rank{trainer.global_rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(str(trainer.global_step))
        os.replace(path + ".tmp", path)


class StepLog(pl.Callback):
    """After every optimizer step this process completes, one JSON line appended to
    RUN_DIR/steps_rank<r>.<pid>.jsonl (closed at once: a killed rank's lines survive it): rank, pid, step, a digest
    of the step's last micro-batch (`llm.train` fetches them inside the step) and a monotonic time."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object,
                           batch: dict[str, Any], batch_idx: int) -> None:
        h = hashlib.sha256()
        for key, value in sorted(batch.items()):
            if isinstance(value, torch.Tensor):
                h.update(key.encode() + value.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        rank, pid = trainer.global_rank, os.getpid()
        line = {"rank": rank, "pid": pid, "step": trainer.global_step, "batch": h.hexdigest()[:16],
                "t": time.monotonic()}
        with open(os.path.join(os.environ.get("NCL_RUN_DIR", "."), f"steps_rank{rank}.{pid}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


class ParamsDigest(pl.Callback):
    """`--params-digest`: the sha256 of this rank's model parameters when training starts and when it ends
    (RUN_DIR/params_rank<r>.json), so a test can tell the parameters moved."""

    def __init__(self) -> None:
        self.record: dict[str, str] = {}

    @staticmethod
    def _digest(pl_module: pl.LightningModule) -> str:
        h = hashlib.sha256()
        for name, p in pl_module.named_parameters():
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record.setdefault("init", self._digest(pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.record["final"] = self._digest(pl_module)
        path = os.path.join(os.environ.get("NCL_RUN_DIR", "."), f"params_rank{trainer.global_rank}.json")
        with open(path, "w") as f:
            json.dump(self.record, f)


class AlternateReduction(pl.Callback):
    """`--ab-reduction`: a timing run. Odd steps run with megatron-core's own gradient reduction and norm, even
    steps with `megatron.numerics`' (N-independent); each step's wall time is recorded and rank 0 prints the medians
    of the steps after the first four (the warm-up) and their ratio. Its parameters are not those of either."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.times: dict[str, list[float]] = {"ours": [], "megatron": []}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        strategy: Any = trainer.strategy
        chunks = numerics.ddp_chunks(list(strategy.megatron_parallel))
        optimizers = numerics.megatron_optimizers(strategy.optimizers[0])
        for obj in [bg for c in chunks for bg in c.bucket_groups] + optimizers:  # back to megatron's methods
            for name in ("start_grad_sync", "finish_grad_sync", "get_grad_norm", "clip_grad_norm"):
                obj.__dict__.pop(name, None)
        if trainer.global_step % 2 == 0:
            numerics.install(list(strategy.megatron_parallel), strategy.optimizers[0])
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        step = trainer.global_step  # already counted: the step just run was step - 1
        if step > 4:
            self.times["ours" if (step - 1) % 2 == 0 else "megatron"].append(time.perf_counter() - self.t0)

    def on_train_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_rank == 0:
            ours, theirs = (statistics.median(self.times[k]) for k in ("ours", "megatron"))
            print(f"step time: ours {ours * 1e3:.1f} ms, megatron's {theirs * 1e3:.1f} ms, ratio {ours / theirs:.3f} "
                  f"({len(self.times['ours'])} + {len(self.times['megatron'])} steps)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--instances", type=int, default=2, help="num_distributed_optimizer_instances")
    parser.add_argument("--mmap", action="store_true", help="tier 2: the data module wrapped in MmapDataModule")
    parser.add_argument("--plain-strategy", action="store_true", help="bad input: NeMo's own MegatronStrategy")
    parser.add_argument("--params-digest", action="store_true", help="write the params' sha256 at start and end")
    parser.add_argument("--ab-reduction", action="store_true", help="timing: alternate megatron's reduction and ours")
    parser.add_argument("--no-callback", action="store_true", help="bad input: our strategy without our callback")
    parser.add_argument("--step-log", action="store_true", help="log every completed step (StepLog)")
    args = parser.parse_args()
    cpu = not torch.cuda.is_available()
    options = {}
    if cpu:  # no Transformer Engine, no fused kernels
        from nemo.collections.llm.gpt.model.base import local_layer_spec

        options = dict(use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
                       persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                       bias_activation_fusion=False, transformer_layer_spec=local_layer_spec)
    config = Llama3Config(num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                          num_query_groups=2, seq_length=64, hidden_dropout=0.1, attention_dropout=0.1,
                          init_method_std=0.02, make_vocab_size_divisible_by=128, **options)
    tokenizer = ByteVocabulary()
    model = llm.GPTModel(config, tokenizer=tokenizer)
    data = (CpuMockDataModule if cpu else llm.MockDataModule)(
        seq_length=64, micro_batch_size=2, global_batch_size=8, tokenizer=tokenizer, num_workers=0, pin_memory=False,
        num_train_samples=args.max_steps * 8, num_val_samples=8, num_test_samples=8)
    if args.mmap:
        data = MmapDataModule(data)
    optim = nl.MegatronOptimizerModule(
        config=OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01, clip_grad=1.0,
                               use_distributed_optimizer=True),
        lr_scheduler=CosineAnnealingScheduler(max_steps=args.max_steps, warmup_steps=4, min_lr=3e-4))
    parallel = dict(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, ckpt_async_save=False,
                    pipeline_dtype=torch.float32 if args.pp > 1 else None)
    if args.plain_strategy:
        # NeMo's own strategy pickles (Lightning's broadcast of the log directory) before our callback refuses it:
        # this run is about that refusal, not our path, so the tests' pickle guard is lifted.
        import pickle_guard

        pickle_guard.uninstall()
    strategy = (nl.MegatronStrategy(**parallel) if args.plain_strategy else
                CheckpointlessMegatronStrategy(num_distributed_optimizer_instances=args.instances, **parallel))
    callbacks = [Progress()] if args.no_callback else [CheckpointlessCallback(), Progress()]
    callbacks += [ParamsDigest()] if args.params_digest else []
    callbacks += [AlternateReduction()] if args.ab_reduction else []
    callbacks += [StepLog()] if args.step_log else []
    trainer = nl.Trainer(accelerator="cpu" if cpu else "gpu", devices=4, num_nodes=1, max_steps=args.max_steps,
                         strategy=strategy, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                         enable_progress_bar=False, log_every_n_steps=1)
    llm.train(model, data, trainer, optim=optim,
              log=nl.NeMoLogger(log_dir=os.path.join(os.environ.get("NCL_RUN_DIR", "."), "nemo_logs")))


if __name__ == "__main__":
    main()
