"""NeMo 2 tiny Llama on 4 CPU ranks (gloo, the test-only shim), run by tests/test_nemo_*.py in a subprocess.

    python tests/nemo_tiny_llama.py OUT_DIR MODE [STEPS]

Lightning's launcher re-executes this script for ranks 1..3. Each rank writes OUT_DIR/rank<r>.json. MODE:
- `faultfree`: train STEPS steps with `CheckpointlessMegatronStrategy(num_instances=2)` (DistributedOptimizer,
  `num_distributed_optimizer_instances=2`);
- `restore`: the same, but at the boundary of step RESTORE_AT rank 1 loses everything a dead rank loses (model
  params and its fp32 main-param shard set to NaN, optimizer state and param-group hyper-parameters overwritten,
  torch and Megatron RNG re-seeded) and receives its shard from its inter-instance peer through the adapter:
  `boundary_state()` -> `pack` -> send over megatron's inter-instance group -> checksum -> `unpack` ->
  `load_state()`. Training then continues; the test compares every rank's final state with the fault-free run;
- `restore-without-rng`: the same, dropping the RNG part of the received state (a negative control).

Workarounds for NeMo 2.7.3 on CPU (shared/notes/deps.md §4): the shim; `use_cpu_initialization` and no fusions;
fp32; `MockDataModule.setup` passes `create_attention_mask` by keyword (NeMo passes it into `seed`);
`model_parallel_cuda_manual_seed` from a callback's `setup` (NeMo skips it without CUDA).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import nemo_shim

nemo_shim.install()

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from nemo import lightning as nl  # noqa: E402
from nemo.collections import llm  # noqa: E402
from nemo.collections.llm.gpt.data.mock import _MockGPTDataset  # noqa: E402
from nemo.collections.llm.gpt.model.base import local_layer_spec  # noqa: E402
from nemo.collections.llm.gpt.model.llama import Llama3Config  # noqa: E402

from nemo_checkpointless.nemo import CheckpointlessMegatronStrategy, distributed_optimizers  # noqa: E402
from nemo_checkpointless.state.hashing import state_digest  # noqa: E402
from nemo_checkpointless.state.packing import checksum, pack, unpack  # noqa: E402

SEED = 1234
RESTORE_AT = 3
VICTIM = 1


class _Tokenizer:
    vocab_size = 256


class _Data(llm.MockDataModule):
    def setup(self, stage: str = "") -> None:
        for attr, name, n in (("_train_ds", "train", self.num_train_samples), ("_validation_ds", "valid", 8),
                              ("_test_ds", "test", 8)):
            setattr(self, attr, _MockGPTDataset(self.tokenizer, name, n, self.seq_length, seed=42,
                                                create_attention_mask=True))


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    return state_digest(tensors, {})


class _Probe(pl.Callback):
    def __init__(self, mode: str, out: Path) -> None:
        self.mode = mode
        self.out = out
        self.record: dict[str, Any] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.mode.startswith("restore") or trainer.global_step != RESTORE_AT:
            return
        strategy = trainer.strategy
        assert isinstance(strategy, CheckpointlessMegatronStrategy) and strategy.participant is not None
        part = strategy.participant
        part.at_step_boundary(trainer.global_step)
        rank = dist.get_rank()
        group = parallel_state.get_inter_distributed_optimizer_instance_group()
        peers = dist.get_process_group_ranks(group)
        if VICTIM not in peers:
            return
        source = next(r for r in peers if r != VICTIM)
        if rank == source:
            tensors, meta = part.boundary_state()
            buf = pack(tensors, meta)
            digest = torch.tensor(list(bytes.fromhex(checksum(buf))), dtype=torch.uint8)
            dist.send(torch.tensor([buf.numel()], dtype=torch.int64), VICTIM, group=group)
            dist.send(digest, VICTIM, group=group)
            dist.send(buf, VICTIM, group=group)
            self.record["sent_bytes"] = buf.numel()
        elif rank == VICTIM:
            self.record["nan_before"] = _wipe(part)
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, source, group=group)
            digest = torch.empty(32, dtype=torch.uint8)
            dist.recv(digest, source, group=group)
            buf = torch.empty(int(size[0]), dtype=torch.uint8)
            dist.recv(buf, source, group=group)
            assert checksum(buf) == bytes(digest.tolist()).hex(), "state failed its checksum"
            tensors, meta = unpack(buf)
            part.load_state(tensors, meta)
            if self.mode == "restore-without-rng":  # a negative control: the run must then differ
                part._rng_to_restore = None
            self.record["received_bytes"] = buf.numel()
            self.record["received_from"] = source
            self.record["nan_after"] = sum(int(p.isnan().sum()) for c in part.model for p in c.parameters())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, CheckpointlessMegatronStrategy) and strategy.participant is not None
        part = strategy.participant
        part.at_step_boundary(trainer.global_step)
        tensors, _ = part.boundary_state()
        leaves = distributed_optimizers(strategy.optimizers[0])
        shard = {k: v for k, v in tensors.items() if k.startswith("opt")}
        self.record.update(
            rank=dist.get_rank(),
            step=trainer.global_step,
            params_sha256=_digest({k: v for k, v in tensors.items() if k.startswith("model.")}),
            shard_sha256=_digest(shard),
            rng_sha256=_digest({k: v for k, v in tensors.items() if k.startswith("rng.")}),
            numel_params=sum(v.numel() for k, v in tensors.items() if k.startswith("model.")),
            numel_exp_avg=sum(v.numel() for k, v in shard.items() if k.endswith(".state.exp_avg")),
            state_keys=sorted({k.rsplit(".", 1)[1] for k in shard if ".state." in k}),
            optimizer=[type(leaf).__name__ for leaf in leaves],
            inner_optimizer=[type(leaf.optimizer).__name__ for leaf in leaves],
            inter_instance_group=dist.get_process_group_ranks(
                parallel_state.get_inter_distributed_optimizer_instance_group()),
            num_instances=strategy.ddp_config.num_distributed_optimizer_instances,
            backend=dist.get_backend(),
            finite=all(bool(torch.isfinite(v).all()) for k, v in tensors.items() if v.is_floating_point()),
        )
        (self.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(self.record, indent=1))


def _wipe(part: Any) -> int:
    """What a replacement process lacks: every tensor of the rank's state is garbage, its RNG differs."""
    with torch.no_grad():
        for chunk in part.model:
            for p in chunk.parameters():
                p.fill_(float("nan"))
        for leaf in distributed_optimizers(part.optimizer):
            for group in leaf.optimizer.param_groups:
                group["lr"] = 0.5
                for p in group["params"]:
                    p.fill_(float("nan"))
                    for t in leaf.optimizer.state[p].values():
                        if isinstance(t, torch.Tensor):
                            t.fill_(7.0)
    torch.manual_seed(999)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states({k: torch.zeros_like(v) for k, v in tracker.get_states().items()})
    return sum(int(p.isnan().sum()) for c in part.model for p in c.parameters())


def build_model_and_data() -> tuple[llm.GPTModel, _Data]:
    """The tiny Llama (dropout on) with Megatron's distributed optimizer, and its mock data (global batch 8)."""
    torch.manual_seed(SEED)  # Megatron DDP does not broadcast initial params: every rank must build the same ones
    config = Llama3Config(
        num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
        seq_length=64, make_vocab_size_divisible_by=128, init_method_std=0.02,
        hidden_dropout=0.1, attention_dropout=0.1,  # so that a wrongly restored RNG would show
        use_cpu_initialization=True, params_dtype=torch.float32, bf16=False, fp16=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, transformer_layer_spec=local_layer_spec)
    optim = nl.MegatronOptimizerModule(config=OptimizerConfig(
        optimizer="adam", lr=3e-3, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=True,
        bf16=False, fp16=False, params_dtype=torch.float32))
    model = llm.GPTModel(config, tokenizer=_Tokenizer(), optim=optim)
    data = _Data(seq_length=64, tokenizer=_Tokenizer(), micro_batch_size=2, global_batch_size=8, num_workers=0,
                 pin_memory=False, num_train_samples=10_000)
    return model, data


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    warnings.filterwarnings("ignore")
    model, data = build_model_and_data()
    strategy = CheckpointlessMegatronStrategy(num_instances=2, global_batch_size=8, ckpt_async_save=False)
    probe = _Probe(mode, out)
    trainer = nl.Trainer(accelerator="cpu", devices=4, max_steps=steps, strategy=strategy, logger=False,
                         enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                         enable_progress_bar=False, callbacks=[probe], log_every_n_steps=1)
    trainer.fit(model, datamodule=data)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"rank done: {hashlib.sha256(json.dumps(probe.record, sort_keys=True).encode()).hexdigest()[:12]}")


if __name__ == "__main__":
    main()
