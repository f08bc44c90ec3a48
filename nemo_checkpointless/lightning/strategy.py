"""`CheckpointlessStrategy`: Lightning's hooks mapped onto the engine's groups and sharded optimizer.

The strategy does not launch processes (the launcher does) and does not use `torch.distributed`'s default group:
its groups come from the launcher's store (see `restart.groups`). The user's optimizer, as returned by
`configure_optimizers`, is wrapped in a `ShardedOptimizer` with `num_instances` replicated instances.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from nemo_checkpointless.replication import ShardedOptimizer
from nemo_checkpointless.restart import Membership, WorkerEnv
from nemo_checkpointless.state.hashing import DataDigest, decode_hashes, encode_hash
from nemo_checkpointless.topology import ParallelDims, rank_info


class CheckpointlessStrategy(ParallelStrategy):
    """Data-parallel training with an N-instance sharded optimizer over groups hosted by the launcher.

    Args:
        num_instances: replicated copies of the optimizer state (`replication.num_instances`); must divide DP.
        grad_clip: clip gradients to this global norm (0: off); done on the averaged gradient, no extra collective.
        collective_timeout_s: the longest a collective may block before it counts as a failure.
        worker_env: where this worker is in the job; read from the environment the launcher set when None.
    """

    strategy_name = "checkpointless"

    def __init__(self, num_instances: int = 1, grad_clip: float = 0.0, collective_timeout_s: float = 30.0,
                 worker_env: WorkerEnv | None = None) -> None:
        super().__init__(parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment())
        self.num_instances = num_instances
        self.grad_clip = grad_clip
        self.collective_timeout_s = collective_timeout_s
        self._worker_env = worker_env
        self.membership: Membership | None = None
        self.sharded: ShardedOptimizer | None = None
        self.data_digest = DataDigest()
        self._pending_batch_hash: bytes | None = None
        self.step_hooks: list[Callable[[int], None]] = []

    # ------------------------------------------------------------------------------------------ environment
    @override
    def setup_environment(self) -> None:
        env = self._worker_env or WorkerEnv.from_environ()
        self._worker_env = env
        assert isinstance(self.cluster_environment, LightningEnvironment)
        self.cluster_environment.set_world_size(env.world_size)
        self.cluster_environment.set_global_rank(env.rank)
        self.membership = env.membership(self.collective_timeout_s)
        self.dims = ParallelDims(world_size=env.world_size, num_instances=self.num_instances)
        self.info = rank_info(self.dims, env.rank)
        super().setup_environment()

    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ------------------------------------------------------------------------------------------- optimizer
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"CheckpointlessStrategy supports one optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}")
        assert self.membership is not None and self.lightning_module is not None
        membership, info = self.membership, self.info
        self.sharded = ShardedOptimizer(
            self.lightning_module, self.optimizers[0], dp_size=self.dims.dp, num_instances=self.num_instances,
            shard_index=info.shard_index, dp_group=lambda: membership.world(),
            instance_group=lambda: membership.group("instance", info.shard_group), grad_clip=self.grad_clip,
            side_channel_numel=self.world_size * 32)

    def record_batch_hash(self, digest: bytes) -> None:
        """The hash of the micro-batch this rank trains on in the current step (sent with the gradients)."""
        self._pending_batch_hash = digest

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        assert self.sharded is not None and self._pending_batch_hash is not None
        # Forward + backward (and Lightning's on_before_optimizer_step hooks) through the precision plugin.
        result = self.precision_plugin._wrap_closure(model, optimizer, closure)
        side = encode_hash(self._pending_batch_hash, self.global_rank, self.world_size)
        summed = self.sharded.step(side)
        assert summed is not None
        self.data_digest.update(decode_hashes(summed))
        self._pending_batch_hash = None
        return result

    # ------------------------------------------------------------------------------------------ collectives
    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        assert self.membership is not None
        out = tensor.detach().clone().float()
        self.membership.world().all_reduce(out)
        if reduce_op in ("mean", "avg") or str(reduce_op).lower().endswith("avg"):
            out /= self.world_size
        return out.to(tensor.dtype)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self.membership is not None:
            self.membership.world().barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a tensor or a JSON value (never a pickle) from `src`."""
        assert self.membership is not None
        if isinstance(obj, torch.Tensor):
            out = obj.detach().clone()
            self.membership.world().broadcast(out, src)
            return out
        payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        self.membership.world().broadcast(size, src)
        buf = payload if self.global_rank == src else torch.empty(int(size), dtype=torch.uint8)
        self.membership.world().broadcast(buf, src)
        return json.loads(bytes(buf.tolist()).decode())

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        assert self.membership is not None
        outs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.membership.world().all_gather(outs, tensor.detach().contiguous())
        return torch.stack(outs)

    def full_state_digest(self) -> str:
        """Hash of all params and optimizer state (collective over each instance; every rank gets its instance's)."""
        from nemo_checkpointless.state.hashing import state_digest

        assert self.sharded is not None
        params, state = self.sharded.full_state()
        return state_digest(params, state)
