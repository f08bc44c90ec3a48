"""`CheckpointlessStrategy`: Lightning's hooks mapped onto the engine's groups, sharded optimizer and recovery.

A user adds it to their own `Trainer` (`Trainer(devices=K, strategy=CheckpointlessStrategy(num_instances=2),
callbacks=[CheckpointlessCallback()])`) and starts the script with `checkpointless-run --nproc-per-node K`. The
strategy does not launch processes (the launcher does) and does not use `torch.distributed`'s default group: its
groups come from the launcher's store (see `restart.groups`). Everything it needs comes from the launcher's
environment (`protocol`); a hot spare runs the script up to `trainer.fit` and waits there for the rank it
replaces. The user's optimizer, as returned by `configure_optimizers`, is wrapped in a `ShardedOptimizer` with
`num_instances` replicated instances.

When a collective of the step fails, the strategy runs the recovery protocol in place (`restart.recovery`) and
retries the step: a healthy rank never leaves `fit`, keeps its process, its memory and, if the step made no
collective of its own before its gradient all-reduce, the gradients it already computed. A step that did (e.g.
`self.log(..., sync_dist=True)` or `self.all_gather` in `training_step`) is replayed from its boundary on every
survivor (RNG restored, the step's micro-batches run again), in step with the replacement that runs it for the
first time. A fallback to the persistent checkpoint leaves the fit loop and enters it again in the same process
(the strategy's launcher, `lightning.launcher`), at the checkpoint's step.

What a rank does around its step whatever the framework (the replicas' vote, the persistent checkpoint, the
per-step replica digest and NaN attribution, the end-of-training barrier) is the engine's (`restart.runtime`);
the data position (a (re)entered `fit` starts at the recovered step's sample, Lightning's loop counters at the
same place) is `lightning.loader`'s. This module maps Lightning's hooks onto them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from nemo_checkpointless import protocol
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.lightning.launcher import InProcessLauncher, Regroup
from nemo_checkpointless.lightning.loader import TrainPosition
from nemo_checkpointless.replication import ShardedOptimizer
from nemo_checkpointless.replication.participant import ShardedParticipant
from nemo_checkpointless.restart import Membership, PeerFailure, progress
from nemo_checkpointless.restart.channel import SideChannel
from nemo_checkpointless.restart.recovery import Decision
from nemo_checkpointless.restart.runtime import RankRuntime
from nemo_checkpointless.restart.session import JoinSpec, Session, env_number
from nemo_checkpointless.restart.step import StepHooks, run_step
from nemo_checkpointless.state.hashing import DataDigest
from nemo_checkpointless.topology import ParallelDims, rank_info
from nemo_checkpointless.topology.shrink import served_ranks

log = logging.getLogger(__name__)


def _set_rank_zero(rank: int) -> None:
    """Lightning's `rank_zero_only` reads `RANK` when it is imported; a spare learns its rank later."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    rank_zero_only.rank = rank  # type: ignore[attr-defined]


class CheckpointlessStrategy(ParallelStrategy):
    """Data-parallel training with an N-instance sharded optimizer over groups hosted by the launcher.

    Every argument is optional; what is not given comes from the launcher's environment (`checkpointless-run`).

    Args:
        num_instances: replicated copies of the optimizer state (Megatron's `num_distributed_optimizer_instances`);
            must divide the data-parallel size. Default: `checkpointless-run --num-instances`, else 2 when the
            data-parallel size is even (a rank can then be restored from a peer), else 1 (checkpoint only).
        grad_clip: clip gradients to this global norm (0: off), on the averaged gradient, as DDP does. Default:
            the Trainer's `gradient_clip_val` (algorithm "norm").
        checkpoint_every_n_steps: write the persistent fallback checkpoint every n steps (0: never). Default:
            `checkpointless-run --checkpoint-every`, else 0.
        checkpoint_dir: where that checkpoint goes. Default: `RUN_DIR/checkpoints`.
        collective_timeout_s: a collective that makes no progress for this long is a hang. Default:
            `checkpointless-run --collective-timeout`, else 30.
        verify_checksum: check the sha256 of every state a replacement receives (a mismatch: checkpoint fallback).
        cache_batches: serve the train loader's batches through the job's shared-memory cache (tier 2; what
            `MmapDataModule(your_datamodule)` sets), so a replacement's first batch is ready at once.
        integrity_every_n_steps: compare every copy of every optimizer shard, and every rank's parameters, across
            the replicas every n steps and after every recovery (0: never); a copy in a minority is repaired from
            the majority, two copies that differ roll the job back. Default: `checkpointless-run`'s
            `integrity.every_n_steps`, else 50.
        nan_policy: a non-finite gradient is attributed to the rank it came from and its step run again; if it
            comes back with the same batch: "stop" the job, naming the batch's samples, or "skip" the batch (no
            update; the data moves on) with a record. Default: `checkpointless-run --nan-policy`, else "stop".
    """

    strategy_name = "checkpointless"

    def __init__(self, num_instances: int | None = None, grad_clip: float | None = None, *,
                 checkpoint_every_n_steps: int | None = None, checkpoint_dir: str | None = None,
                 collective_timeout_s: float | None = None, cache_batches: bool = False,
                 verify_checksum: bool = True, integrity_every_n_steps: int | None = None,
                 nan_policy: str | None = None) -> None:
        super().__init__(cluster_environment=LightningEnvironment())
        self._session: Session | None = None  # built when fit starts (`ensure_session`)
        self._num_instances_arg = num_instances
        self.num_instances = num_instances or 1
        self._grad_clip_arg = grad_clip
        self.grad_clip = grad_clip or 0.0
        self._checkpoint_every_arg = checkpoint_every_n_steps
        self._checkpoint_dir_arg = checkpoint_dir
        self._collective_timeout_arg = collective_timeout_s
        self._verify_checksum = verify_checksum
        self.join = JoinSpec()
        self._num_nodes = 1
        self._participant: ShardedParticipant | None = None  # this rank's state (built with the session)
        self._runtime: RankRuntime | None = None  # the per-step duties (built with the session)
        self._in_step = False
        self._step_calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []  # the step's micro-batches so far
        self._step_collectives = 0  # collectives of the user's code in the step in flight
        self._replaying = False
        # A shrunk world (`topology.shrink`): the ranks whose micro-batches this rank trains in each step (itself
        # alone in the whole world), the micro-batches per rank and step the user asked for, each served rank's
        # batch hash of the step in flight, and the state kept across a re-entry of `fit` (`Reshape`).
        self._step_hashes: dict[int, bytes] = {}
        self._slot: int | None = None
        self._kept: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        self._regroup = False  # the shrunk world agreed to grow back after the step just completed
        self._integrity_every_arg = integrity_every_n_steps
        self._nan_policy_arg = nan_policy
        self.loader = TrainPosition(cache_batches, self.shrink_enabled)  # the train loader's data position
        env = os.environ
        if protocol.SPARE_ID_ENV in env:
            _set_rank_zero(-1)  # a spare says nothing as "rank 0" before it has a rank
        elif "RANK" in env:
            self.cluster_environment.set_global_rank(int(env["RANK"]))  # type: ignore[union-attr]
            if "WORLD_SIZE" in env:
                self.cluster_environment.set_world_size(int(env["WORLD_SIZE"]))  # type: ignore[union-attr]

    @property
    def session(self) -> Session:
        assert self._session is not None, "the session is built when fit starts"
        return self._session

    @property
    def membership(self) -> Membership:
        return self.session.membership

    @property
    def participant(self) -> ShardedParticipant:
        """This rank's training state as the recovery engine sees it (`replication.participant`)."""
        assert self._participant is not None, "the participant is built with the session, when fit starts"
        return self._participant

    @property
    def runtime(self) -> RankRuntime:
        assert self._runtime is not None, "the runtime is built with the session"
        return self._runtime

    @property
    def decisions(self) -> list[Decision]:
        """The recoveries this rank took part in, in order."""
        return self.runtime.decisions

    @property
    def sharded(self) -> ShardedOptimizer | None:
        """The current fit's sharded optimizer (None before the first `setup`)."""
        return self._participant.sharded if self._participant is not None else None

    @property
    def data_digest(self) -> DataDigest:
        return self.participant.data_digest

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def is_distributed(self) -> bool:
        """For Lightning: shard the train loader over the data-parallel ranks (`use_distributed_sampler`)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        info = rank_info(self.session.dims, self.session.env.rank)
        return {"num_replicas": self.session.dims.dp, "rank": info.dp_rank}

    @override
    def _configure_launcher(self) -> None:
        self._launcher = InProcessLauncher(self)

    # ------------------------------------------------------------------------------------------ environment
    def ensure_session(self) -> None:
        """Build this rank's session from the launcher's environment (once per process). A hot spare says it is
        ready and waits here for the rank it replaces."""
        if self._session is not None:
            return

        def dims(world: int) -> ParallelDims:
            n = self._num_instances_arg or int(env_number(protocol.NUM_INSTANCES_ENV, 0)) or (
                2 if world % 2 == 0 else 1)
            if world % n:
                raise ConfigError("CheckpointlessStrategy(num_instances=...)", n,
                                  f"must divide the data-parallel size {world}",
                                  f"use a divisor of {world} (2 keeps one replica of every optimizer shard)")
            return ParallelDims(world_size=world, num_instances=n)

        self._session = Session.from_environ(
            dims, checkpoint_every=self._checkpoint_every_arg, checkpoint_dir=self._checkpoint_dir_arg,
            collective_timeout_s=self._collective_timeout_arg, verify_checksum=self._verify_checksum,
            on_rank=_set_rank_zero)
        self.num_instances = self._session.dims.num_instances
        self.join = self._session.join
        if self.shrink_enabled and self.num_instances == 1:
            raise ConfigError("replication.shrink (checkpointless-run --shrink)", True,
                              "needs num_instances >= 2: with one optimizer instance there is nothing to shrink to",
                              "use --num-instances 2 (CheckpointlessStrategy(num_instances=2)), or drop --shrink")
        self._session.engine.extra_patience_s = env_number(protocol.REPLACEMENT_TIMEOUT_ENV, 0.0)
        self._runtime = RankRuntime.create(
            self._session, self._integrity_every_arg, self._nan_policy_arg, "CheckpointlessStrategy",
            whole=lambda: self.membership.active is None)  # a shrunk world's dropped copies: nothing to compare
        info = rank_info(self._session.dims, self._session.env.rank)
        self._participant = ShardedParticipant(
            self._session.position, lambda: [cfg.scheduler for cfg in self.lr_scheduler_configs],
            dp_size=self._session.dims.dp, world_size=self._session.env.world_size,
            num_instances=self.num_instances, shard_index=info.shard_index)
        self._session.faults.attach(self._participant.flip_bit)  # the fault plan's hooks (a restore damaged: a bit)

    @property
    def shrink_enabled(self) -> bool:
        return os.environ.get(protocol.SHRINK_ENV) == "1"

    @property
    def is_lead(self) -> bool:
        """Whether this rank speaks for the job (the summary, the step times): rank 0, or the lowest rank of a
        shrunk world without it."""
        return self.session.env.rank == self.membership.lead

    @override
    def setup_environment(self) -> None:
        self.ensure_session()
        env = self.session.env
        if self.lightning_module is not None:
            self._check_world(self.lightning_module.trainer)
        assert isinstance(self.cluster_environment, LightningEnvironment)
        self.cluster_environment.set_world_size(env.world_size)
        self.cluster_environment.set_global_rank(env.rank)
        self.info = rank_info(self.session.dims, env.rank)
        super().setup_environment()

    def _check_world(self, trainer: pl.Trainer) -> None:
        """`Trainer(devices=K, num_nodes=M)` as a DDP user writes it must describe the launcher's world."""
        flag = trainer._accelerator_connector._devices_flag
        if flag == "auto" or self.session.env.world_size == 1:
            return
        devices = len(self.parallel_devices or [None])
        world = self.session.env.world_size
        if devices * self.num_nodes != world:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # the launcher's ranks per node
            raise ConfigError("Trainer(devices=..., num_nodes=...)", f"devices={flag}, num_nodes={self.num_nodes}",
                              f"describes {devices * self.num_nodes} processes; the launcher started {world} "
                              f"({world // local} node(s) x {local})",
                              f"use Trainer(devices={local}, num_nodes={world // local}), or launch "
                              f"{self.num_nodes} node(s) x --nproc-per-node {devices}")

    @property
    def on_cuda(self) -> bool:
        """`Trainer(accelerator="gpu")` (Lightning's CUDAAccelerator): each rank trains on one GPU."""
        return type(self.accelerator).__name__ == "CUDAAccelerator"

    @property
    @override
    def root_device(self) -> torch.device:
        """The rank's device: GPU `LOCAL_RANK` (a spare learns it with its rank), or the CPU."""
        if not self.on_cuda:
            return torch.device("cpu")
        local = self._session.env.local_rank if self._session is not None else int(os.environ.get("LOCAL_RANK", 0))
        return torch.device("cuda", local)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------------- optimizer
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        accelerator = type(trainer.accelerator).__name__
        if trainer.accelerator is not None and accelerator not in ("CPUAccelerator", "CUDAAccelerator"):
            raise ConfigError("Trainer(accelerator=...)", accelerator,
                              "CheckpointlessStrategy trains on CPU processes (gloo) or one CUDA GPU a process "
                              "(NCCL for the training collectives, gloo for the recovery)",
                              'use Trainer(accelerator="cpu") or Trainer(accelerator="gpu")')
        self.model_to_device()  # before the optimizer is sharded: its flat buffers go where the parameters are
        if trainer.gradient_clip_val:
            if trainer.gradient_clip_algorithm not in (None, "norm"):
                raise ConfigError("Trainer(gradient_clip_algorithm=...)", trainer.gradient_clip_algorithm,
                                  "CheckpointlessStrategy clips the averaged gradient by its global norm",
                                  'use gradient_clip_algorithm="norm"')
            if self._grad_clip_arg is None:
                self.grad_clip = float(trainer.gradient_clip_val)
            # Clipped once, after the gradient all-reduce (as DDP clips the averaged gradient), not per rank here.
            trainer.gradient_clip_val = None
        super().setup(trainer)
        if len(self.optimizers) != 1:
            raise ConfigError("configure_optimizers()", f"{len(self.optimizers)} optimizers",
                              "CheckpointlessStrategy shards and replicates one optimizer",
                              "return one optimizer (param groups may differ in lr, weight decay, ...)")
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            raise ConfigError("LightningModule.automatic_optimization", False,
                              "CheckpointlessStrategy steps the optimizer itself (it shards and replicates it)",
                              "use automatic optimization")
        membership, info, participant = self.membership, self.info, self.participant
        participant.host_copies = self.on_cuda  # what is sent, checkpointed or kept is a host copy
        participant.sharded = sharded = ShardedOptimizer(
            self.lightning_module, self.optimizers[0], dp_size=self.session.dims.dp,
            num_instances=self.num_instances, shard_index=info.shard_index, dp_group=lambda: membership.world(),
            instance_group=lambda: membership.group("instance", info.shard_group), grad_clip=self.grad_clip,
            side_channel_numel=self.channel.numel)
        if self.join.kind == "kept":  # the same rank, its world reshaped: its own state, kept in memory
            assert self._kept is not None
            self.lightning_module.zero_grad(set_to_none=True)
            participant.load_state(*self._kept)
            self._kept = None
            self.session.stamps.track(self.join.generation)
            step = self.join.step
        elif self.join.kind == "replacement":
            decision = self.session.engine.join(participant, self.join.generation)
            self.decisions.append(decision)
            self.session.stamps.track(self.membership.generation)
            step = decision.step
        elif self.join.kind in ("checkpoint", "rollback"):  # a rollback: the integrity check's, not a recovery
            self.session.engine.load_checkpoint(participant, self.join.step)
            if self.join.kind == "checkpoint":
                self.session.stamps.track(self.join.generation)
            step = self.join.step
        else:
            step = 0
        sharded.completed_steps = step
        self.session.position.step = step
        self._in_step = False
        self._step_calls = []
        self._regroup = False
        if self.join.kind != "fresh":
            # After any recovery every rank compares the replicas once the first step after it is done (survivors
            # recovered inside that step get the same boundary in `_recover`).
            self.runtime.integrity.pending = step + 1
        # The world's shape in this generation: which ranks' micro-batches this rank trains, and the average over
        # the ranks that take part in the gradient all-reduce.
        active = self.membership.active
        self.loader.serve(trainer, served_ranks(self.session.dims, active, self.session.env.rank))
        # The first instance that trains writes the persistent checkpoint (instance 0 unless the job shrank without it)
        self.runtime.writer_instance = min(rank_info(self.session.dims, r).instance for r in active) if active else 0
        sharded.average_over = len(active) if active is not None else self.session.dims.dp
        self.session.stamps.lead = self.is_lead
        # A fit entered at a boundary the survivors may already have passed (a replacement) checks nothing there:
        # the ranks that were there did. Its restore is verified now, before the first step trains on it (the
        # survivors of a p2p recovery that stayed in their step verify in `_recover`; the ranks that kept their own
        # state take part).
        restored = None
        if self.join.kind != "fresh":
            p2p = self.join.kind == "kept" or (self.join.kind == "replacement" and self.decisions[-1].path == "p2p")
            restored = ("p2p" if p2p else "checkpoint",
                        dict(self.decisions[-1].sources) if self.join.kind == "replacement" and p2p else {})
        self.runtime.entering(step, restored, from_checkpoint=self.join.kind in ("checkpoint", "rollback")
                              or (self.join.kind == "replacement" and self.decisions[-1].path == "checkpoint"),
                              verify_now=participant)

    @property
    def channel(self) -> SideChannel:
        """What rides the gradient all-reduce (`restart.channel`): batch hashes, grow flag, norms, shard digests."""
        return SideChannel(self.world_size)

    def keep_own_state(self) -> None:
        """Keep this rank's step-boundary state in memory across a re-entry of `fit` (a reshaped world)."""
        self._kept = self.participant.boundary_state()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The train loader starts at the session's data position (`lightning.loader.TrainPosition`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self.loader.process(trainer, dataloader, self.session)

    @override
    def on_train_start(self) -> None:
        assert self.lightning_module is not None
        self.loader.on_train_start(self.lightning_module.trainer, self.session.position.step)

    def at_step_boundary(self) -> bool:
        """Called before each micro-batch: before the first one of an optimizer step, snapshot what a replacement
        needs (small: RNG, scheduler, data) and write the persistent checkpoint when due. True there."""
        if self._in_step:
            return False
        participant = self.participant
        participant.at_step_boundary()
        step = participant.completed_steps
        if self._regroup:
            raise Regroup()  # caught by the launcher: every rank of the shrunk world leaves `fit` here
        while True:  # the replicas' vote when due and before a checkpoint, then the checkpoint (`RankRuntime`)
            try:
                self.runtime.at_boundary(participant, step, slot=self.info.checkpoint_slot,
                                         writes_checkpoint=self.info.instance == self.runtime.writer_instance)
                return True
            except PeerFailure as failure:
                # A p2p recovery in the vote: the checkpoint (when due) is written after it, and the replicas are
                # compared again once the next step is done.
                self._recover(failure)

    def integrity_summary(self) -> dict[str, Any] | None:
        """`summary.json["integrity"]`: the checks (`RankRuntime.integrity_summary`) and the NaN guard's own cost on
        this rank (its gradient norm, every step)."""
        if self._runtime is None:
            return None
        sharded = self.sharded
        return self.runtime.integrity_summary(nan_guard_s=round(sharded.local_norm_s, 4) if sharded else None)

    def _apply_poison(self, step: int) -> None:
        """Fault plan kinds `nan` (once) and `nan_batch` (every time step `step` is computed on this rank): one
        element of this rank's gradient is made NaN after the step's backward, before the gradient all-reduce."""
        if not self.session.faults.poisoned(step):
            return
        self.participant.poison_gradient()
        log.info(f"injected: a NaN in the gradient of step {step}")

    def _step_samples(self) -> Any:
        """The sample ids of this rank's micro-batches in the step in flight (for a record)."""
        assert self.sharded is not None and self.lightning_module is not None
        return self.loader.step_samples(self.lightning_module.trainer, self.sharded.completed_steps,
                                        self._step_hashes)

    def record_batch_hash(self, digest: bytes) -> None:
        """The hash of a micro-batch this rank trains on in the current step (sent with the gradients); several
        micro-batches of one step (gradient accumulation) are chained. In a shrunk world each micro-batch is
        chained under the rank it is served for, and the RNG goes back to the step's boundary where the next
        served rank's micro-batches begin: they draw (dropout, ...) what that rank draws in the whole world."""
        if not self._in_step:
            self._step_calls = []
            self._step_collectives = 0
            self._step_hashes = {}
            self._slot = None
        slot = self.loader.next_slot(self.global_rank)
        if self._slot is not None and slot != self._slot:
            self.participant.restore_boundary_rng()
        self._slot = slot
        before = self._step_hashes.get(slot)
        self._step_hashes[slot] = digest if before is None else hashlib.sha256(before + digest).digest()
        self._in_step = True

    # ------------------------------------------------------------------------------------- a step, recovered
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._replaying:  # the last micro-batch of a replayed step: a failure goes to `optimizer_step`
            return super().training_step(*args, **kwargs)
        self._step_calls.append((args, kwargs))
        beacon, step = self.session.beacon, self._in_flight_step()
        beacon.mark(step, progress.FORWARD)
        replay = False
        while True:
            try:
                if replay:
                    # Every rank redoes this step from its boundary, in step with the replacement: the micro-
                    # batches before this one again (their forward, collectives and backward), then this one.
                    self._replay(len(self._step_calls) - 1)
                    replay = False
                out = super().training_step(*args, **kwargs)
                beacon.mark(step, progress.BACKWARD_DONE)
                return out
            except PeerFailure as failure:
                self._recover(failure)
                replay = True

    def _recover(self, failure: PeerFailure) -> Decision:
        """Raises RestartFromCheckpoint when peers cannot help, or when the restored state fails its verification."""
        decision = self.session.engine.recover(self.participant, failure)
        # Nobody checks at the decision's boundary any more (a rank rolled forward, `finish_step`, reaches it only
        # now); the replicas are compared once the first step after it is done.
        self.runtime.recovered(decision)
        try:
            self.runtime.verify_restore(self.participant, decision.step, decision.sources, "p2p")
        except PeerFailure as again:  # a fault while verifying: one more recovery (verified in its turn)
            return self._recover(again)
        return decision

    def _replay(self, micro_batches: int) -> None:
        """Back to the step's boundary: RNG as it was, no gradients; then the step's first `micro_batches` again."""
        assert self.lightning_module is not None
        self.participant.restore_boundary_rng()
        self.lightning_module.zero_grad(set_to_none=True)
        trainer = self.lightning_module.trainer
        self._step_collectives = 0
        self._replaying = True
        try:
            for args, kwargs in self._step_calls[:micro_batches]:
                out = super().training_step(*args, **kwargs)
                loss = out.get("loss") if isinstance(out, dict) else out
                if not isinstance(loss, torch.Tensor):
                    continue
                if trainer.accumulate_grad_batches > 1:
                    loss = loss / trainer.accumulate_grad_batches
                self.backward(loss, None)
        finally:
            self._replaying = False

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        model = model or self.lightning_module
        assert self.sharded is not None and self._step_hashes, "a micro-batch of the step was not recorded"
        beacon, step = self.session.beacon, self._in_flight_step()
        beacon.mark(step, progress.OPTIMIZER)
        # Forward + backward (and Lightning's on_before_optimizer_step hooks) through the precision plugin.
        result = self.precision_plugin._wrap_closure(model, optimizer, closure)
        self._apply_poison(step)
        beacon.mark(step, progress.GRAD_SYNC)
        channel = self.channel
        # A shrunk world: this rank asks to grow back after this step.
        side = channel.compose(self._step_hashes, self.membership.active is not None and (
            self.session.faults.grow_asked(step) or self.membership.store.check([protocol.GROW_KEY])))

        def recompute() -> None:
            # The step made collectives of its own before its gradient all-reduce, its gradients were not finite,
            # or this rank was rewound: everyone (or this rank) redoes it from its boundary (a replacement makes
            # the same collectives for the first time).
            nonlocal result
            self._replay(len(self._step_calls) - 1)
            self._replaying = True
            try:
                result = self.precision_plugin._wrap_closure(model, optimizer, closure)
            finally:
                self._replaying = False
            self._apply_poison(step)

        hooks = StepHooks(recompute, self._recover, lambda: self._step_collectives > 0, self._step_samples)
        self._regroup = run_step(self.runtime, self.participant, self.membership, self.session.faults, channel, side,
                                 step, hooks)
        self._step_hashes = {}
        self._in_step = False
        self.session.stamps.stamp(self.sharded.completed_steps)
        beacon.mark(self.sharded.completed_steps, progress.STEP_DONE)
        return result

    def end_of_training_barrier(self) -> None:
        """No rank leaves training before every rank has completed the last step: a rank lost in it is recovered
        while its peers (its replica among them, which may have finished) are all still here. Recovered like a
        step's collective; a fallback to the checkpoint leaves `fit` (`RestartFromCheckpoint`) and trains again.
        A shrunk world does not end shrunk: it grows back first (`Regroup`, the spares started for the missing
        ranks taking them, waited for if still starting), so that every rank, the parked ones too, leaves `fit` with
        the final state and runs what the script does after it (rank 0 saving the model, typically)."""
        self.participant.at_step_boundary()  # after the last step: the boundary a replacement would receive
        if self.membership.active is not None:
            raise Regroup()  # every rank of the shrunk world is here after the same last step
        assert self.sharded is not None
        while True:
            try:
                # The replicas vote on the final state before any rank hands it over (the script's save, the
                # digests), unless this fit entered at this boundary (a replacement here, or the survivors that
                # recovered it: the restore was verified). A rollback leaves `fit` and trains again.
                self.runtime.end_barrier(self.participant, self.sharded.completed_steps)
                return
            except PeerFailure as failure:
                self._recover(failure)

    def _in_flight_step(self) -> int:
        assert self.sharded is not None
        return self.sharded.completed_steps + 1

    # ------------------------------------------------------------------------------------------ collectives
    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """A sum/mean over all ranks inside a training step (e.g. `self.log(..., sync_dist=True)`); outside a
        step it returns the local value: Lightning reduces while it sets up `fit` (`has_len_all_ranks`), and a
        replacement joining mid-run sets up alone while the healthy ranks are inside a step."""
        if not isinstance(tensor, torch.Tensor) or not self._in_step:
            return tensor
        self._step_collectives += 1
        out = tensor.detach().clone().float()
        t0 = time.perf_counter()
        world = self.membership.world()
        world.all_reduce(out)
        self._waited(t0)
        if reduce_op in ("mean", "avg") or str(reduce_op).lower().endswith("avg"):
            out /= world.size
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
        """Tensors are broadcast from `src` (a collective on every rank; recovered inside a training step). Other
        objects (Lightning broadcasts log and checkpoint paths while it sets up) are returned unchanged, not sent:
        every rank derives them from the same config, and a joining replacement could not match the collective."""
        if isinstance(obj, torch.Tensor):
            self._step_collectives += self._in_step
            out = obj.detach().clone()
            t0 = time.perf_counter()
            world = self.membership.world()
            world.broadcast(out, src if src in world.ranks else world.ranks[0])  # a shrunk world may lack src
            self._waited(t0)
            return out
        return obj

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Every rank's `tensor`, stacked (a collective; recovered inside a training step, like `reduce`)."""
        self._step_collectives += self._in_step
        world = self.membership.world()
        outs = [torch.empty_like(tensor) for _ in range(world.size)]  # a shrunk world: its ranks' only
        t0 = time.perf_counter()
        world.all_gather(outs, tensor.detach().contiguous())
        self._waited(t0)
        return torch.stack(outs)

    def _waited(self, t0: float) -> None:
        """A collective of the user's code inside the step ended: its wait is not this rank's work (the straggler
        report's `busy_s`)."""
        if self._in_step:
            self.session.beacon.waited(time.perf_counter() - t0)

    @override
    def teardown(self) -> None:
        # The groups belong to the session (they outlive this fit); nothing of ours to destroy here.
        super().teardown()

    def rank_state_digests(self) -> dict[str, str]:
        """This rank's own view, no collective: sha256 of its full parameters and of its optimizer shard."""
        return self.participant.rank_state_digests()

    def full_state_digest(self) -> str:
        """Hash of all params and optimizer state (collective over each instance; every rank gets its instance's)."""
        return self.participant.full_state_digest()
