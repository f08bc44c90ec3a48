"""`CheckpointlessStrategy` on CUDA, the parts a CPU machine can check (the recovery over two planes runs for real in
`tests/test_user_script.py` with gloo standing in for NCCL; `scripts/gpu_check.sh` is the check on GPUs):

- the rank's device: GPU `LOCAL_RANK` under Lightning's CUDA accelerator (Lightning's own accelerator object; no
  GPU is touched to build it), the CPU otherwise; an accelerator the strategy does not train on is one ConfigError;
- the boundary state's CUDA RNG: absent where CUDA is not in use, and a state carrying one is refused by a
  process that does not use CUDA (ranks of one job train on one kind of device);
- the sharded optimizer keeps its buffers on its parameters' device, and refuses parameters spread over two.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from torch import nn

from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.lightning import CheckpointlessStrategy
from nemo_checkpointless.replication import ShardedOptimizer
from nemo_checkpointless.state.rng import capture_rng, restore_rng


def test_the_rank_trains_on_gpu_local_rank_under_the_cuda_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    strategy = CheckpointlessStrategy()
    strategy.accelerator = CUDAAccelerator()
    assert strategy.on_cuda and strategy.root_device == torch.device("cuda", 3)
    strategy.accelerator = CPUAccelerator()
    assert not strategy.on_cuda and strategy.root_device == torch.device("cpu")


def test_another_accelerator_is_one_clear_message() -> None:
    class Other(CPUAccelerator):  # stands for an accelerator the strategy does not train on (TPU, MPS, ...)
        pass

    trainer = pl.Trainer(accelerator=Other(), devices=1, strategy=CheckpointlessStrategy(num_instances=1),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    with pytest.raises(ConfigError) as e:
        trainer.strategy.setup(trainer)
    message = str(e.value)
    assert "Trainer(accelerator=...)" in message and "Other" in message and 'accelerator="gpu"' in message


def test_the_cuda_rng_is_carried_only_where_cuda_is_in_use() -> None:
    meta, tensors = capture_rng()
    assert "rng.cuda" not in tensors  # this process never initialized CUDA
    torch.manual_seed(5)
    meta, tensors = capture_rng()
    first = torch.rand(3)
    restore_rng(meta, tensors)
    assert torch.equal(torch.rand(3), first)
    with pytest.raises(ValueError, match="does not use CUDA"):
        restore_rng(meta, {**tensors, "rng.cuda": torch.zeros(16, dtype=torch.uint8)})


class _Spread(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2, device="meta")


def test_the_sharded_optimizer_keeps_its_buffers_on_the_parameters_device() -> None:
    module = nn.Linear(4, 4)
    opt = ShardedOptimizer(module, torch.optim.AdamW(module.parameters()), dp_size=2, num_instances=1,
                           shard_index=0, dp_group=lambda: None, instance_group=lambda: None)  # type: ignore[arg-type,return-value]
    assert opt.device == torch.device("cpu") and opt.flat_grad.device == opt.device
    assert all(g.flat.device == opt.device for g in opt.groups)
    spread = _Spread()
    with pytest.raises(ValueError, match="one device"):
        ShardedOptimizer(spread, torch.optim.AdamW(spread.parameters()), dp_size=2, num_instances=1,
                         shard_index=0, dp_group=lambda: None, instance_group=lambda: None)  # type: ignore[arg-type,return-value]
