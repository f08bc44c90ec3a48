"""`CheckpointlessMegatronStrategy`: NeMo 2's `MegatronStrategy` with N replicated distributed-optimizer instances
and a `MegatronParticipant` kept at every step boundary. Importing this module imports NeMo (the [nemo] extra).

What it adds to `MegatronStrategy`:
- `num_distributed_optimizer_instances` is set from `replication.num_instances` (`num_instances=`), validated
  against our topology before any process group exists (the same `ConfigError` as `checkpointless-plan`), and
  Megatron's inter-instance groups are checked, once they exist, against `topology.rank_info(...).replica_peers`
  (the ranks our recovery plan copies a shard from);
- a `MegatronParticipant` (`self.participant`) over the wrapped model and the distributed optimizer: its RNG
  snapshot is taken before every training step and its step count follows the optimizer steps, so the recovery
  engine can read or replace this rank's shard at any step boundary.

What it does not do yet: replace a killed rank in-process. NeMo and megatron-core run every collective on
`torch.distributed`'s default group and the groups `megatron.core.parallel_state` derived from it; see
docs/design.md ("NeMo path") for what would have to be rebuilt.
"""

from __future__ import annotations

from typing import Any

from nemo.lightning import MegatronStrategy
from typing_extensions import override

from nemo_checkpointless.nemo.adapter import MegatronParticipant
from nemo_checkpointless.topology import ParallelDims, rank_info


class CheckpointlessMegatronStrategy(MegatronStrategy):
    """`MegatronStrategy` with `num_instances` replicated optimizer instances and a recovery participant.

    Args:
        num_instances: `replication.num_instances`; Megatron's `num_distributed_optimizer_instances`. Must divide
            the data-parallel size (dp*cp) at the job's world size; checked when the world size is known.
        global_batch_size: samples per step, recorded with the data position (0: unknown).
        **kwargs: `MegatronStrategy`'s arguments (`tensor_model_parallel_size`, `ddp`, ...), except
            `num_distributed_optimizer_instances`, which this strategy owns.
    """

    def __init__(self, *args: Any, num_instances: int = 1, global_batch_size: int = 0, **kwargs: Any) -> None:
        if "num_distributed_optimizer_instances" in kwargs:
            raise TypeError("CheckpointlessMegatronStrategy sets num_distributed_optimizer_instances from "
                            "num_instances (replication.num_instances); pass num_instances= instead")
        if not isinstance(num_instances, int) or num_instances < 1:
            raise ValueError(f"replication.num_instances={num_instances!r}: must be an integer >= 1")
        kwargs.setdefault("ddp", _distributed_optimizer_ddp())
        super().__init__(*args, num_distributed_optimizer_instances=num_instances, **kwargs)
        ddp = self.ddp_config
        if num_instances > 1 and not getattr(ddp, "use_distributed_optimizer", False):
            raise ValueError(f"replication.num_instances={num_instances} needs Megatron's distributed optimizer: "
                             "pass ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, ...)")
        self.num_instances = num_instances
        self.global_batch_size = global_batch_size
        self.participant: MegatronParticipant | None = None
        self.dims: ParallelDims | None = None

    def job_dims(self) -> ParallelDims:
        """The job's layout in our topology's terms (raises `ConfigError` naming the key when it is invalid)."""
        return ParallelDims(world_size=self.world_size, tp=self.tensor_model_parallel_size,
                            cp=self.context_parallel_size, pp=self.pipeline_model_parallel_size,
                            ep=self.expert_model_parallel_size, num_instances=self.num_instances)

    @override
    def setup_environment(self) -> None:
        # Before init_process_group: a bad num_instances fails here with our message, not inside megatron.
        self.dims = self.job_dims()
        super().setup_environment()
        self._check_megatron_groups()

    def _check_megatron_groups(self) -> None:
        if self.num_instances == 1:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state

        assert self.dims is not None
        group = parallel_state.get_inter_distributed_optimizer_instance_group()
        megatron = sorted(dist.get_process_group_ranks(group))
        ours = list(rank_info(self.dims, self.global_rank).replica_peers)
        if megatron != ours:
            raise RuntimeError(f"rank {self.global_rank}: megatron's inter-instance group is {megatron}, our topology "
                               f"says the replicas of this rank's shard are {ours}; recovery would copy the wrong "
                               "shard (parallel.order must be Megatron's default tp-cp-ep-dp-pp)")

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        assert self.dims is not None
        self.participant = MegatronParticipant(
            list(self.megatron_parallel), self.optimizers[0], dp_size=self.dims.dp_cp,
            num_instances=self.num_instances, shard_index=rank_info(self.dims, self.global_rank).shard_index,
            global_batch_size=self.global_batch_size)

    @override
    def training_step(self, dataloader_iter: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.participant is not None
        self.participant.at_step_boundary(self.trainer.global_step)
        return super().training_step(dataloader_iter, *args, **kwargs)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(*args, **kwargs)
        if self.participant is not None:
            self.participant.step_done()
        return out


def _distributed_optimizer_ddp() -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    # overlap_param_gather off: at a step boundary every rank then holds the full, current parameters.
    return DistributedDataParallelConfig(check_for_nan_in_grad=True, use_distributed_optimizer=True,
                                         overlap_grad_reduce=False, overlap_param_gather=False)

