"""`CheckpointlessStrategy`: Lightning's hooks mapped onto the engine's groups, sharded optimizer and recovery.

The strategy does not launch processes (the launcher does) and does not use `torch.distributed`'s default group:
its groups come from the launcher's store (see `restart.groups`). The user's optimizer, as returned by
`configure_optimizers`, is wrapped in a `ShardedOptimizer` with `num_instances` replicated instances. When a
collective of the step fails, the strategy runs the recovery protocol in place (`restart.recovery`) and retries
the step: a healthy rank never leaves `fit`, keeps its process, its memory and the gradients it already computed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from nemo_checkpointless.replication import ShardedOptimizer
from nemo_checkpointless.replication.checkpoint import CheckpointStore
from nemo_checkpointless.restart import Membership, PeerFailure, WorkerEnv
from nemo_checkpointless.restart.recovery import Decision, RecoveryEngine, RecoveryStamps
from nemo_checkpointless.state.hashing import DataDigest, decode_hashes, encode_hash
from nemo_checkpointless.state.rng import capture_rng, restore_rng
from nemo_checkpointless.topology import ParallelDims, rank_info

STATE_VERSION = 1


@dataclass
class JoinSpec:
    """How this rank enters `fit`: fresh (step 0), as a replacement (receive state at `generation`), or from the
    persistent checkpoint of `step` after a fallback decided at `generation`."""

    kind: str = "fresh"  # fresh | replacement | checkpoint
    generation: int = 0
    step: int = 0


@dataclass
class DataPosition:
    """The first 0-based step the data loader yields (samples consumed = step x global batch)."""

    step: int = 0


@dataclass
class Session:
    """What outlives one `fit` on a rank: its place in the job, its groups and the recovery engine."""

    env: WorkerEnv
    membership: Membership
    dims: ParallelDims
    engine: RecoveryEngine
    checkpoints: CheckpointStore | None
    checkpoint_every: int = 0
    position: DataPosition = field(default_factory=DataPosition)
    stamps: RecoveryStamps = field(init=False)

    def __post_init__(self) -> None:
        self.stamps = RecoveryStamps(self.membership.store, self.env.rank)


class CheckpointlessStrategy(ParallelStrategy):
    """Data-parallel training with an N-instance sharded optimizer over groups hosted by the launcher.

    Args:
        session: this rank's `Session` (groups, recovery engine, checkpoint store), built by the worker.
        num_instances: replicated copies of the optimizer state (`replication.num_instances`); must divide DP.
        grad_clip: clip gradients to this global norm (0: off); done on the averaged gradient, no extra collective.
        join: how this rank enters `fit` (see `JoinSpec`).
    """

    strategy_name = "checkpointless"

    def __init__(self, session: Session, num_instances: int = 1, grad_clip: float = 0.0,
                 join: JoinSpec | None = None) -> None:
        super().__init__(parallel_devices=[torch.device("cpu")], cluster_environment=LightningEnvironment())
        self.session = session
        self.num_instances = num_instances
        self.grad_clip = grad_clip
        self.join = join or JoinSpec()
        self.sharded: ShardedOptimizer | None = None
        self.data_digest = DataDigest()
        self._pending_batch_hash: bytes | None = None
        self._boundary: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        self._rng_to_restore: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        self.decisions: list[Decision] = []
        self._in_step = False

    @property
    def membership(self) -> Membership:
        return self.session.membership

    # ------------------------------------------------------------------------------------------ environment
    @override
    def setup_environment(self) -> None:
        env = self.session.env
        assert isinstance(self.cluster_environment, LightningEnvironment)
        self.cluster_environment.set_world_size(env.world_size)
        self.cluster_environment.set_global_rank(env.rank)
        self.info = rank_info(self.session.dims, env.rank)
        super().setup_environment()

    @property
    @override
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------------- optimizer
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"CheckpointlessStrategy supports one optimizer; configure_optimizers returned "
                             f"{len(self.optimizers)}")
        assert self.lightning_module is not None
        membership, info = self.membership, self.info
        self.sharded = ShardedOptimizer(
            self.lightning_module, self.optimizers[0], dp_size=self.session.dims.dp,
            num_instances=self.num_instances, shard_index=info.shard_index, dp_group=lambda: membership.world(),
            instance_group=lambda: membership.group("instance", info.shard_group), grad_clip=self.grad_clip,
            side_channel_numel=self.world_size * 32)
        if self.join.kind == "replacement":
            decision = self.session.engine.join(self, self.join.generation)
            self.decisions.append(decision)
            self.session.stamps.track(self.membership.generation)
            step = decision.step
        elif self.join.kind == "checkpoint":
            self.session.engine.load_checkpoint(self, self.join.step)
            self.session.stamps.track(self.join.generation)
            step = self.join.step
        else:
            step = 0
        self.sharded.completed_steps = step
        self.session.position.step = step

    @override
    def on_train_start(self) -> None:
        step = self.session.position.step
        if step:
            # Resume Lightning's own counters at the step boundary the state belongs to.
            assert self.lightning_module is not None
            loop = self.lightning_module.trainer.fit_loop.epoch_loop
            loop.automatic_optimization.optim_progress.optimizer.step.total.ready = step
            loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
            loop._batches_that_stepped = step

    def at_step_boundary(self) -> None:
        """Called before each training step: snapshot what a replacement needs (small: RNG, scheduler, data)."""
        if self._rng_to_restore is not None:
            restore_rng(*self._rng_to_restore)
            self._rng_to_restore = None
        meta, tensors = capture_rng()
        self._boundary = (meta, tensors)
        assert self.sharded is not None
        step = self.sharded.completed_steps
        every = self.session.checkpoint_every
        if (every and step and step % every == 0 and self.info.instance == 0
                and self.session.checkpoints is not None):
            tensors_out, meta_out = self.boundary_state()
            self.session.checkpoints.save_shard(step, self.info.shard_index, tensors_out, meta_out,
                                                shared_prefix="param.")

    def record_batch_hash(self, digest: bytes) -> None:
        """The hash of the micro-batch this rank trains on in the current step (sent with the gradients)."""
        self._pending_batch_hash = digest
        self._in_step = True

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        assert self.sharded is not None and self._pending_batch_hash is not None
        # Forward + backward (and Lightning's on_before_optimizer_step hooks) through the precision plugin.
        result = self.precision_plugin._wrap_closure(model, optimizer, closure)
        side = encode_hash(self._pending_batch_hash, self.global_rank, self.world_size)
        while True:
            try:
                summed = self.sharded.step(side)
                break
            except PeerFailure as failure:
                # Raises RestartFromCheckpoint when peers cannot help; otherwise retry this step's collectives
                # with the gradients this rank already holds.
                self.decisions.append(self.session.engine.recover(self, failure))
                self.session.stamps.track(self.membership.generation)
        assert summed is not None
        self.data_digest.update(decode_hashes(summed))
        self._pending_batch_hash = None
        self._in_step = False
        self.session.stamps.stamp(self.sharded.completed_steps)
        return result

    # ------------------------------------------------------------------------- the recovery engine's view
    def progress(self) -> tuple[int, int]:
        assert self.sharded is not None
        return self.sharded.completed_steps, self.sharded.phase

    def data_digest_hex(self) -> str:
        return self.data_digest.hexdigest

    def boundary_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        assert self.sharded is not None and self._boundary is not None
        rng_meta, rng_tensors = self._boundary
        tensors: dict[str, torch.Tensor] = dict(rng_tensors)
        for i, g in enumerate(self.sharded.groups):
            tensors[f"param.group{i}"] = g.flat
        for name, t in self.sharded.shard_state().items():
            if not name.endswith(".param"):
                tensors[f"shard.{name}"] = t
        schedulers = [cfg.scheduler.state_dict() for cfg in self.lr_scheduler_configs]
        meta = {
            "version": STATE_VERSION,
            "step": self.sharded.completed_steps,
            "world_size": self.world_size,
            "num_instances": self.num_instances,
            "shard_index": self.info.shard_index,
            "lrs": [g["lr"] for g in self.sharded.optimizer.param_groups],
            "schedulers": json.loads(json.dumps(schedulers)),
            "rng": rng_meta,
            "data_digest": self.data_digest.to_json(),
            "data_position": {"step": self.sharded.completed_steps, "dp_size": self.session.dims.dp},
        }
        return tensors, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        assert self.sharded is not None
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"state version {meta.get('version')}, this build reads {STATE_VERSION}")
        if meta["data_position"]["dp_size"] != self.session.dims.dp:
            raise ValueError(f"state saved with data-parallel size {meta['data_position']['dp_size']}, "
                             f"this job has {self.session.dims.dp}: the data position would not be exact")
        if meta["shard_index"] != self.info.shard_index or meta["num_instances"] != self.num_instances:
            raise ValueError(f"state of shard {meta['shard_index']} (N={meta['num_instances']}) offered to shard "
                             f"{self.info.shard_index} (N={self.num_instances})")
        opt = self.sharded.optimizer
        for i, g in enumerate(self.sharded.groups):
            g.flat.copy_(tensors[f"param.group{i}"])
            state = {name.split(".", 2)[2]: t.clone() for name, t in tensors.items()
                     if name.startswith(f"shard.group{i}.")}
            opt.state[g.shard] = state
        for group, lr in zip(opt.param_groups, meta["lrs"], strict=True):
            group["lr"] = lr
        for cfg, sd in zip(self.lr_scheduler_configs, meta["schedulers"], strict=True):
            cfg.scheduler.load_state_dict(sd)
        self._rng_to_restore = (meta["rng"], {k: v for k, v in tensors.items() if k.startswith("rng.")})
        self.data_digest = DataDigest(meta["data_digest"]["hexdigest"], meta["data_digest"]["steps"])
        self.sharded.completed_steps = meta["step"]
        self.session.position.step = meta["step"]

    # ------------------------------------------------------------------------------------------ collectives
    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """A sum/mean over all ranks inside a training step (e.g. `self.log(..., sync_dist=True)`); outside a
        step it returns the local value: Lightning reduces while it sets up `fit` (`has_len_all_ranks`), and a
        replacement joining mid-run sets up alone while the healthy ranks are inside a step."""
        if not isinstance(tensor, torch.Tensor) or not self._in_step:
            return tensor
        out = tensor.detach().clone().float()
        self.membership.world().all_reduce(out)
        if reduce_op in ("mean", "avg") or str(reduce_op).lower().endswith("avg"):
            out /= self.world_size
        return out.to(tensor.dtype)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Local. Lightning asks this while it sets up `fit` (e.g. "do all ranks' loaders have a length?") and
        between epochs; our ranks answer these from the same config, and a replacement joining mid-run could not
        take part in a collective there."""
        return decision

    @override
    def barrier(self, name: str | None = None) -> None:
        """A no-op. Lightning calls barriers while it sets up `fit`; a replacement that joins mid-run sets up
        alone while the healthy ranks are inside a step, so a real barrier there would hang. Nothing here needs
        one: the launcher creates the run directory before any rank starts."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Tensors are broadcast from `src` (a collective: call it inside a step, on every rank). Other objects
        (Lightning broadcasts log and checkpoint paths while it sets up) are returned as they are: every rank
        derives them from the same config, and a joining replacement could not match the collective."""
        if isinstance(obj, torch.Tensor):
            out = obj.detach().clone()
            self.membership.world().broadcast(out, src)
            return out
        return obj

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        outs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.membership.world().all_gather(outs, tensor.detach().contiguous())
        return torch.stack(outs)

    @override
    def teardown(self) -> None:
        # The groups belong to the session (they outlive this fit); nothing of ours to destroy here.
        super().teardown()

    def full_state_digest(self) -> str:
        """Hash of all params and optimizer state (collective over each instance; every rank gets its instance's)."""
        from nemo_checkpointless.state.hashing import state_digest

        assert self.sharded is not None
        params, state = self.sharded.full_state()
        return state_digest(params, state)
