"""`CheckpointlessMegatronStrategy`: NeMo 2's `MegatronStrategy` with N replicated distributed-optimizer instances
and a `MegatronParticipant` kept at every step boundary. Importing this module imports NeMo (the [nemo] extra).

What it adds to `MegatronStrategy`:
- `num_distributed_optimizer_instances` (or `num_instances=`, the same knob) is validated against our topology
  before any process group exists (a `ConfigError` in NeMo's argument names), and
  Megatron's inter-instance groups are checked, once they exist, against `topology.rank_info(...).replica_peers`
  (the ranks our recovery plan copies a shard from);
- a `MegatronParticipant` (`self.participant`) over the wrapped model and the distributed optimizer: its RNG
  snapshot is taken before every training step and its step count follows the optimizer steps, so the recovery
  engine can read or replace this rank's shard at any step boundary;
- megatron's gradient reduction and clipping norm replaced by N-independent ones (`megatron.numerics`, for every N), so
  runs with 1 and N optimizer instances train bitwise alike.

Under `checkpointless-run` (or `checkpointless-train`), in-process replacement (`nemo.restart`): the strategy's
session comes from the launcher's environment when `fit` starts (a hot spare waits there for its rank), and the
strategy is its own Lightning launcher (`nemo.restart.InProcessLauncher`). Every `fit` of a generation runs on its
own default group, created from the launcher's store under a per-generation prefix (`begin_generation`), with a
short collective timeout (`pg_timeout_s=`, applied to the default group and to every group megatron derives from
it) as the failure detector of the ranks that do not neighbour the dead one. After a failure every rank leaves
`fit` in its own process, the old default group is abandoned (not destroyed), and `fit` is entered again on the
same trainer and model with a fresh Megatron setup; `resume` is the state to load once the model and optimizer
exist (a survivor's own boundary state, kept in memory; a replacement's, received from its replica by the
recovery engine), and the data position and Lightning's counters start at its step. Started any other way, it is
`MegatronStrategy` with the replicated optimizer and the participant (nothing recovers in process).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import math
import os
import struct
import time
from typing import Any

import torch

from nemo_checkpointless.nemo.checks import check_versions, in_nemo_terms, installed_versions, replication_knob

check_versions(*installed_versions())  # before NeMo's own imports: one message for an unsupported install

import torch.distributed as dist  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402
from nemo.lightning import MegatronStrategy  # noqa: E402
from typing_extensions import override  # noqa: E402

from nemo_checkpointless.errors import ConfigError  # noqa: E402
from nemo_checkpointless.megatron import numerics  # noqa: E402
from nemo_checkpointless.megatron.data import RecordingIterator, gather_step_hashes  # noqa: E402
from nemo_checkpointless.megatron.groups import FaultWatch, one_gloo_group_per_member_set  # noqa: E402
from nemo_checkpointless.megatron.participant import MegatronParticipant, distributed_optimizers  # noqa: E402
from nemo_checkpointless.nemo.restart import (  # noqa: E402
    NEMO_DEFAULT_SEED,
    InProcessLauncher,
    RedoStep,
    SkipStep,
)
from nemo_checkpointless.protocol import (  # noqa: E402
    LAYOUT_ENV,
    NUM_INSTANCES_ENV,
    STORE_PORT_ENV,
    default_group_prefix,
)
from nemo_checkpointless.restart import objects, progress  # noqa: E402
from nemo_checkpointless.restart.runtime import RankRuntime  # noqa: E402
from nemo_checkpointless.restart.session import Session  # noqa: E402
from nemo_checkpointless.state.checkpoint import CheckpointStore  # noqa: E402
from nemo_checkpointless.topology import ParallelDims, rank_info  # noqa: E402

log = logging.getLogger(__name__)


class CheckpointlessMegatronStrategy(MegatronStrategy):
    """`MegatronStrategy` with `num_instances` replicated optimizer instances and a recovery participant.

    Args:
        num_instances: `replication.num_instances`; Megatron's `num_distributed_optimizer_instances`, which may be
            passed under that name instead (one knob: both given must agree). Must divide the data-parallel size
            (dp*cp) at the job's world size; checked when the world size is known, before any process group.
        global_batch_size: samples per step, recorded with the data position (0: the data sampler's).
        pg_timeout_s: under our launcher, the gloo timeout of the default group and of megatron's groups (NeMo
            reads it from TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, which this sets): the failure detector of last resort.
            Must exceed the longest collective wait of a healthy step. Default: `checkpointless-run
            --collective-timeout`, else 30.
        checkpoint_every_n_steps, checkpoint_dir: the persistent fallback checkpoint (each rank of the first
            optimizer instance writes its whole state at the step boundary). Default: `checkpointless-run
            --checkpoint-every` (0: none; the fallback is then the seeded initial state), `RUN_DIR/checkpoints`.
        verify_checksum: check the sha256 of every state a replacement receives.
        integrity_every_n_steps: the replicas' vote on every copy of every optimizer shard and every rank's
            parameters (`restart.integrity`) every this many steps, before every persistent checkpoint, on the
            state a re-entered fit starts from and on the final state; with N >= 2 a digest of each shard is also
            compared every step. 0: none. Default: `checkpointless-run --integrity-every`, else 50.
        nan_policy: a non-finite gradient is attributed to the rank it came from (each rank's own gradient norm
            before the reduction rides the step's record) and its step trained again; when it comes back with the
            same batch: "stop" the job naming the batch's data positions, or "skip" that batch. Default:
            `checkpointless-run --nan-policy`, else "stop".
        **kwargs: `MegatronStrategy`'s arguments (`tensor_model_parallel_size`, `ddp`, ...).
    """

    def __init__(self, *args: Any, num_instances: int | None = None,
                 num_distributed_optimizer_instances: int | None = None, global_batch_size: int = 0,
                 pg_timeout_s: float | None = None, checkpoint_every_n_steps: int | None = None,
                 checkpoint_dir: str | None = None, verify_checksum: bool = True,
                 integrity_every_n_steps: int | None = None, nan_policy: str | None = None, **kwargs: Any) -> None:
        # The recipe's model-parallel layout (set only by `checkpointless-train recipe=NAME script=...`; see
        # protocol.LAYOUT_ENV): a size the script leaves out is the recipe's, one it passes must be the recipe's.
        if any(os.environ.get(name) for name, _, _ in LAYOUT_ENV):
            import inspect

            given = inspect.signature(MegatronStrategy.__init__).bind_partial(self, *args, **kwargs).arguments
            for name, recipe_key, arg in LAYOUT_ENV:
                if not os.environ.get(name):
                    continue
                size = int(os.environ[name])
                if arg not in given:
                    kwargs[arg] = size
                elif given[arg] != size:
                    raise ConfigError(arg, given[arg], f"the script's CheckpointlessMegatronStrategy({arg}="
                                      f"{given[arg]}) differs from the recipe's {recipe_key}={size} "
                                      "(checkpointless-train recipe=... script=...)",
                                      f"drop {arg}= from the script to take the recipe's, or run with "
                                      f"{recipe_key}={given[arg]}")
        from_launcher = (num_instances is None and num_distributed_optimizer_instances is None
                         and bool(os.environ.get(NUM_INSTANCES_ENV)))
        if from_launcher:
            num_instances = int(os.environ[NUM_INSTANCES_ENV])  # checkpointless-run --num-instances
        self.instances_key, num_instances = replication_knob(num_instances, num_distributed_optimizer_instances)
        if from_launcher:  # a layout error then names what set it
            self.instances_key = "checkpointless-run --num-instances"
        kwargs.setdefault("ddp", _distributed_optimizer_ddp())
        # Ranks come from the session (a spare learns its rank inside `fit`), not from the variables torchrun sets.
        kwargs.setdefault("cluster_environment", LightningEnvironment())
        super().__init__(*args, num_distributed_optimizer_instances=num_instances, **kwargs)
        ddp = self.ddp_config
        if num_instances > 1 and not getattr(ddp, "use_distributed_optimizer", False):
            raise ConfigError("ddp.use_distributed_optimizer", getattr(ddp, "use_distributed_optimizer", None),
                              f"{self.instances_key}={num_instances} replicates the distributed optimizer's shards",
                              "pass ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, ...) or "
                              "leave ddp= out (this strategy's default)")
        if getattr(ddp, "overlap_param_gather", False):
            raise ConfigError("ddp.overlap_param_gather", True,
                              "a replica sends its parameters at a step boundary, and with overlap_param_gather a "
                              "rank holds only its own shard of the last update until the next forward gathers the "
                              "rest", "pass DistributedDataParallelConfig(overlap_param_gather=False, ...) or leave "
                              "ddp= out (this strategy's default)")
        self.num_instances = num_instances
        self.global_batch_size = global_batch_size
        self.participant: MegatronParticipant | None = None
        self._step_hashes: list[bytes] | None = None  # every rank's data digest of the step in flight
        self._integrity_every_arg = integrity_every_n_steps
        self.runtime: RankRuntime | None = None  # the per-step duties: votes, checkpoints, checks (with the session)
        self._fits_in_generation = (-1, 0)  # (generation, fits of it entered): a vote's re-entry keeps its generation
        # How the state the next fit starts from was restored ("p2p" or "checkpoint") and, for p2p, which rank each
        # replaced rank received it from: the restore's verification names them (set by `nemo.restart`).
        self.restored: tuple[str, dict[int, int]] = ("p2p", {})
        self._damage_next_load = False  # fault plan kind corrupt_restore: the next state loaded is damaged
        self._nan_policy_arg = nan_policy
        self._local_norm = 0.0  # this rank's own gradient norm in the step in flight, before the reduction
        self.n_independent = False  # whether `megatron.numerics` replaced megatron's gradient reduction (at setup)
        self.dims: ParallelDims | None = None
        self.pg_timeout_s = pg_timeout_s
        self._checkpoint_every_arg, self._checkpoint_dir_arg = checkpoint_every_n_steps, checkpoint_dir
        self._verify_checksum = verify_checksum
        self._session: Session | None = None  # built when fit starts (`ensure_session`)
        self.pg_store: Any = None
        self.resume: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        self.resume_step = 0
        # Set by `CheckpointlessCallback.setup`, which Lightning calls before this strategy's `setup`: the pair is
        # complete (the callback knows the strategy's type; the strategy knows only that it was called).
        self.callback_paired = False
        self.groups_s = 0.0  # how long the last `setup_distributed` took (default group + megatron's groups)
        self.reentry: dict[str, float] = {}  # times of the phases of the last re-entry into `fit`
        self.fault_watch: FaultWatch | None = None  # this generation's, set by the launcher (`nemo.restart`)
        self._position_from_resume = False
        # the config's init methods a resuming fit replaced with a no-op, by field (None: none replaced)
        self._init_before: dict[str, Any] | None = None
        self.built_uninitialised = False  # the last fit's model was built without initialisation (a resume)
        self._quiet_barriers = False  # a re-entered fit's set-up: Lightning's barriers are skipped (`barrier`)
        self.barriers_skipped = 0  # by the current generation's fit

    # ------------------------------------------------------------------------------------------ the session
    @property
    def session(self) -> Session:
        assert self._session is not None, "the session is built when fit starts"
        return self._session

    @property
    def checkpoints(self) -> CheckpointStore | None:
        return self.session.checkpoints

    @property
    def under_launcher(self) -> bool:
        """Started by `checkpointless-run` / `checkpointless-train`. Otherwise (e.g. Lightning's own launcher, or
        torchrun) this is NeMo's `MegatronStrategy` with the replicated optimizer and a `MegatronParticipant`, and
        nothing recovers in process."""
        return STORE_PORT_ENV in os.environ

    def ensure_session(self) -> None:
        """This rank's session, from the launcher's environment (once per process). A hot spare says it is ready
        and waits here for the rank it replaces."""
        if self._session is not None:
            return

        session = Session.from_environ(self.job_dims, checkpoint_every=self._checkpoint_every_arg,
                                       checkpoint_dir=self._checkpoint_dir_arg,
                                       collective_timeout_s=self.pg_timeout_s, verify_checksum=self._verify_checksum)
        timeout = session.membership.timeout_s
        self.pg_timeout_s = timeout
        # The engine's collectives wait out a survivor still stuck in a NeMo collective until its timeout.
        session.membership.timeout_s = 2 * timeout + 60
        self.dims = session.dims
        self._session = session
        self.runtime = RankRuntime.create(session, self._integrity_every_arg, self._nan_policy_arg,
                                          "CheckpointlessMegatronStrategy")
        session.faults.attach(self.flip_bit, damage=self._damage_restore)  # the fault plan's hooks

    def begin_generation(self, resume: tuple[dict[str, torch.Tensor], dict[str, Any]] | None) -> None:
        """Before a `fit` of the session's current generation: its default group is made from the launcher's store
        (prefix `nemo/gen<g>/`; `nemo/gen<g>.<k>/` for its k-th re-entry after a vote), and `resume` (a
        `MegatronParticipant` state) is loaded once the model and optimizer exist."""
        generation = self.session.membership.generation
        # A fit entered again in the same generation (the replicas' vote repaired a copy or rolled back: no rank
        # failed) makes its groups under a prefix of its own.
        before, fits = self._fits_in_generation
        fits = fits + 1 if before == generation else 0
        self._fits_in_generation = (generation, fits)
        self.pg_store = dist.PrefixStore(default_group_prefix(generation, fits),
                                         self.session.store)
        self._quiet_barriers, self.barriers_skipped = generation > 0, 0
        self._restore_initialization()  # a fit that failed before its `setup` left it off
        self.resume = resume
        self.resume_step = int(resume[1]["step"]) if resume is not None else 0
        self._position_from_resume = resume is not None
        # Every rank of a generation enters its fit at the same boundary (a recovery, a rollback or a repair
        # re-enters every rank's fit there): the restore is verified there before the first step trains on it.
        assert self.runtime is not None
        self.runtime.entering(self.resume_step, self.restored if resume is not None else None,
                              from_checkpoint=resume is not None and self.restored[0] == "checkpoint")

    def _restore_initialization(self) -> None:
        if self._init_before is not None:
            config = self.lightning_module.config
            for name, method in self._init_before.items():
                setattr(config, name, method)
            self._init_before = None

    def job_dims(self, world_size: int | None = None) -> ParallelDims:
        """The job's layout in our topology's terms (raises `ConfigError` naming the key when it is invalid)."""
        try:
            return ParallelDims(world_size=world_size or self.world_size, tp=self.tensor_model_parallel_size,
                                cp=self.context_parallel_size, pp=self.pipeline_model_parallel_size,
                                ep=self.expert_model_parallel_size, num_instances=self.num_instances)
        except ConfigError as e:
            raise in_nemo_terms(e, self.instances_key) from None

    @override
    def _configure_launcher(self) -> None:
        if self.under_launcher:
            self._launcher = InProcessLauncher(self)
        else:
            super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        if not self.under_launcher:
            self.dims = self.job_dims()
            super().setup_environment()
            self._check_megatron_groups()
            return
        self.ensure_session()
        env = self.session.env
        os.environ["WORLD_SIZE"] = str(env.world_size)  # Lightning's environment removes it at each teardown
        assert isinstance(self.cluster_environment, LightningEnvironment)
        self.cluster_environment.set_world_size(env.world_size)
        self.cluster_environment.set_global_rank(env.rank)
        # Before init_process_group: a bad num_instances fails here with our message, not inside megatron.
        self.dims = self.job_dims()
        if self.resume is not None and self._init_before is None:
            # A fit that starts from a state (a survivor's own, a replacement's received one, a checkpoint's)
            # overwrites every parameter once the model exists (`MegatronParticipant.load_state` writes each one,
            # and restores the RNG the skipped initialisation would have drawn from): megatron's initialisation of
            # the model is skipped. Off from here, because Lightning builds the model (the `configure_model` hook)
            # after `setup_environment` and before `setup`, which turns it back on.
            self._init_before = _initialization_off(self.lightning_module)
        super().setup_environment()
        self._check_megatron_groups()

    @override
    def setup_distributed(self) -> None:
        if self.pg_store is None:  # not under our launcher
            super().setup_distributed()
            return
        # Every member arrives first (the store waits as long as a replacement needs to start), then gloo connects
        # under the short timeout that is also the failure detector of every collective of this generation.
        world = self.cluster_environment.world_size() if self.cluster_environment else self.world_size
        self.pg_store.add("arrived", 1)
        deadline = time.monotonic() + 600
        while self.pg_store.add("arrived", 0) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every rank reached the default group within 600 s ({world} expected)")
            time.sleep(0.002)
        self.store = self.pg_store
        from megatron.core import parallel_state
        from nemo.lightning import _strategy_lib

        original = parallel_state.initialize_model_parallel
        calls: list[int] = []

        def initialize(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if self.pg_timeout_s is not None:
                kwargs["distributed_timeout_minutes"] = self.pg_timeout_s / 60
            timeout = datetime.timedelta(seconds=self.pg_timeout_s) if self.pg_timeout_s is not None else None
            with one_gloo_group_per_member_set(timeout):
                return original(*args, **kwargs)

        if self.pg_timeout_s is not None:
            os.environ["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = str(max(1, round(self.pg_timeout_s)))
        parallel_state.initialize_model_parallel = initialize
        t0 = time.monotonic()
        try:
            super().setup_distributed()
            if not calls:
                # Observed with NeMo 2.7.3: in a later fit of the same process, MegatronStrategy.setup_distributed
                # leaves megatron's groups from the previous generation in place (handles into the abandoned
                # default group). Create them on this generation's default group.
                _strategy_lib.init_model_parallel(self.model)
            if not calls:
                raise RuntimeError("megatron's model-parallel groups were not re-created on this generation's "
                                   "default group")
        finally:
            parallel_state.initialize_model_parallel = original
            self.groups_s = time.monotonic() - t0
        if torch.cuda.device_count() == 0:
            # NeMo seeds Megatron's model-parallel RNG tracker (with its default seed) only when it sees a GPU.
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(NEMO_DEFAULT_SEED)

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
        if self.under_launcher and not self.callback_paired:
            raise ConfigError("nl.Trainer(callbacks=...)", [type(c).__name__ for c in trainer.callbacks],
                              "CheckpointlessMegatronStrategy needs CheckpointlessCallback (the per-step record of "
                              "what each rank trained on, the recovery records, the run summary)",
                              "add CheckpointlessCallback() to the trainer's callbacks")
        # megatron-core's optimizer builder gathers every rank's parameter-group keys with `all_gather_object`
        # (a pickle from each peer): JSON here (`restart.objects`).
        try:
            with objects.json_object_collectives():
                super().setup(trainer)
            self.built_uninitialised = self._init_before is not None
        finally:
            self._restore_initialization()
        assert self.dims is not None
        if not self.global_batch_size and self.data_sampler is not None:
            self.global_batch_size = int(getattr(self.data_sampler, "global_batch_size", 0) or 0)
        info = rank_info(self.dims, self.global_rank)
        # The same gradient summation order and norm for every N (`megatron.numerics`), N=1 included.
        self.n_independent = numerics.install(list(self.megatron_parallel), self.optimizers[0],
                                              nan_check=self.runtime is None)
        self.participant = MegatronParticipant(
            list(self.megatron_parallel), self.optimizers[0], dp_size=self.dims.dp_cp,
            num_instances=self.num_instances, shard_index=info.shard_index, tp_rank=info.tp_rank,
            pp_rank=info.pp_rank, global_batch_size=self.global_batch_size)
        self._watch_param_gather()
        if self.resume is not None:
            self.participant.load_state(*self.resume)
            self.resume = None  # the tensors belong to the previous fit's model: drop them once loaded
            if self._damage_next_load:
                self._damage_next_load = False
                self.participant.flip_bit()
            # The LR schedule continues from the loaded step (the loaded param groups hold its current LR; the
            # next scheduler step computes the LR of the step after it).
            for config in self.lr_scheduler_configs:
                config.scheduler.last_epoch = self.resume_step

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """`obj` from rank `src`, as JSON (`restart.objects`), where Lightning's `DDPStrategy.broadcast` pickles it
        (Lightning broadcasts its log directory while it sets up `fit`). A tensor is broadcast as a tensor (the
        same shape on every rank)."""
        if not dist.is_available() or not dist.is_initialized():
            return obj
        if isinstance(obj, torch.Tensor):
            out = obj.detach().clone()
            dist.broadcast(out, src)
            return out
        box = [obj]
        objects.broadcast_object_list(box, src)
        return box[0]

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier, but while a fit of a later generation sets up (from `begin_generation` to
        `on_train_start`). Lightning waits for every rank at five points there (before and after the setup hooks,
        after the restore, as the stage and its data start); they order file-system work of the first fit (rank 0
        makes a directory, the others then use it), which a re-entered fit finds done. Each costs every rank a wait
        for the last one, on the path of a recovery. Every rank of a generation skips them alike (the generation
        decides, not the rank's history), so no rank waits in one the others skip."""
        if self._quiet_barriers:
            self.barriers_skipped += 1
            return
        super().barrier(*args, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """`DDPStrategy.reduce` (the same result, in place), without the barrier Lightning's `_sync_ddp` runs before
        its all-reduce: the all-reduce already waits for every rank. Lightning reduces twice as a fit starts (the
        sizes of the training data, `has_len_all_ranks`)."""
        if not isinstance(tensor, torch.Tensor) or not dist.is_available() or not dist.is_initialized():
            return tensor
        group = dist.group.WORLD if group is None else group
        op, divide = dist.ReduceOp.SUM, False
        if isinstance(reduce_op, str):
            name = "avg" if reduce_op.lower() in ("mean", "avg") else reduce_op.lower()
            if name == "avg" and dist.get_backend(group) == "gloo":  # gloo has no AVG: a sum, then divided
                divide = True
            else:
                op = getattr(dist.ReduceOp, name.upper())
        elif reduce_op is not None:
            op = reduce_op
        dist.all_reduce(tensor, op=op, group=group)
        if not divide:
            return tensor
        world = dist.get_world_size(group)
        return tensor.div_(world) if torch.is_floating_point(tensor) else tensor.copy_(tensor / world)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        if (self._position_from_resume and self.data_sampler is not None
                and getattr(dataloader, "mode", "train") == "train"):
            # The exact data position, O(1): Megatron's sampler starts at `step x global batch` samples. The
            # sampler's own progress (a re-entered fit reuses the user's data module) starts there too.
            sampler: Any = self.data_sampler
            sampler.if_first_step = 0
            consumed = self.resume_step * int(getattr(sampler, "global_batch_size", 0) or self.global_batch_size)
            sampler.init_consumed_samples = sampler.prev_consumed_samples = consumed
            sampler.init_global_step = self.resume_step
        return super().process_dataloader(dataloader)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._quiet_barriers = False  # from here Lightning's barriers (a user's callback's too) wait again
        step = self.resume_step
        if step:
            # Resume Lightning's counters at the step boundary the loaded state belongs to.
            loop = self.trainer.fit_loop.epoch_loop
            loop.automatic_optimization.optim_progress.optimizer.step.total.ready = step
            loop.automatic_optimization.optim_progress.optimizer.step.total.completed = step
            loop._batches_that_stepped = step

    @override
    def training_step(self, dataloader_iter: Any, *args: Any, **kwargs: Any) -> Any:
        assert self.participant is not None and self.dims is not None
        step = self.trainer.global_step
        self.participant.at_step_boundary(step)
        if self.runtime is not None:
            # The restore this fit entered with verified, else the replicas' vote when due and before a checkpoint
            # (written once they agree), then the checkpoint: one file per TP/PP slice and shard, by instance 0.
            info = rank_info(self.dims, self.global_rank)
            self.runtime.at_boundary(self.participant, step, writes_checkpoint=info.instance == 0,
                                     slot=info.checkpoint_slot)
        self._mark(step + 1, progress.FORWARD)
        # Each micro-batch the step consumes is hashed as Megatron's schedule draws it (the data record). A fault
        # declared during the forward and backward stops them where they are (`FaultWatch.interruptible`).
        watch = self.fault_watch
        with watch.interruptible() if watch is not None else contextlib.nullcontext():
            out = super().training_step(RecordingIterator(dataloader_iter), *args, **kwargs)
        if self._session is not None:
            self._gather_step_record(step)
        self._mark(step + 1, progress.BACKWARD_DONE)
        return out

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        self._mark(self.trainer.global_step + 1, progress.OPTIMIZER)
        out = super().optimizer_step(*args, **kwargs)
        if self.participant is not None:
            self.participant.step_done(self._step_hashes)
        self._step_hashes = None
        self._mark(self.trainer.global_step + 1, progress.STEP_DONE)
        return out

    # ------------------------------------------------------------------------------- the replicas' checks
    def _gather_step_record(self, step: int) -> None:
        """The step's data record from every rank (`gather_step_hashes`), with each rank's own gradient norm (before
        the reduction) and, with N >= 2, its shard's replica digest riding along; then, before the optimizer step
        reads anything, the checks:

        - a copy of a shard that differs from its replicas: the replicas vote on the state of the step's boundary.
          A repaired copy may have fed this step's forward (a shard's main params are the parameters' own memory in
          fp32), so every rank leaves `fit` and trains the step again from the boundary (`RedoStep`), as after a
          recovery; a vote without a majority rolls back (`RestartFromCheckpoint`);
        - a rank whose gradient is not finite (`NanGuard`, the same verdict everywhere): the step is trained again
          from its boundary (`RedoStep`); when it comes back, the job stops naming the batch, or the batch is
          skipped (`SkipStep`: the step counts as done, nothing is updated, the data moves on)."""
        session, part, runtime = self.session, self.participant, self.runtime
        assert part is not None and runtime is not None
        digests = runtime.digests_every_step(self.num_instances)
        extra = runtime.step_digest(part).to_bytes(4, "little") if digests else b""
        extra += struct.pack("<d", self._local_norm)
        world = session.membership.world()
        self._step_hashes, extras = gather_step_hashes(world, extra)
        if digests:
            slots = torch.tensor([b for e in extras for b in e[:4]], dtype=torch.float32)
            if runtime.copies_differ(slots, world.ranks) and runtime.vote(part, step) == "repair":
                raise RedoStep(step)
        norms = {r: struct.unpack("<d", e[-8:])[0] for r, e in zip(world.ranks, extras, strict=True)}
        verdict = runtime.judge_norms(step + 1, norms, functools.partial(self._step_positions, step + 1))
        if verdict == "rerun":
            raise RedoStep(step)
        if verdict == "skip":
            raise SkipStep(step, self._step_hashes)

    def _step_positions(self, step: int) -> dict[str, Any]:
        """What this rank trained on in step `step` (for a record): the global data positions of its micro-batches,
        as Megatron's pretraining sampler hands them out (`[first, end)` each)."""
        sampler: Any = self.data_sampler
        mb = int(getattr(sampler, "micro_batch_size", 0) or 0)
        gb = int(getattr(sampler, "global_batch_size", 0) or self.global_batch_size)
        assert self.dims is not None
        dp, dp_rank = self.dims.dp_cp, rank_info(self.dims, self.global_rank).dp_rank
        if not mb or not gb:
            return {"step": step}
        start = (step - 1) * gb
        return {"step": step, "data_positions": [[start + k * mb * dp + dp_rank * mb, start + k * mb * dp
                                                  + (dp_rank + 1) * mb] for k in range(gb // (mb * dp))]}

    def integrity_summary(self) -> dict[str, Any] | None:
        """`summary.json["integrity"]`: the checks and their records (`RankRuntime.integrity_summary`)."""
        return self.runtime.integrity_summary() if self.runtime is not None else None

    def _damage_restore(self) -> None:
        """Fault plan kind `corrupt_restore` (`restart.faults.Injector`, once this rank restored a state, after its
        checksum passed): the state is loaded into the model when the next fit sets up, and damaged there."""
        self._damage_next_load = True

    def flip_bit(self, target: str = "shard") -> None:
        """Fault plan kind `bitflip` (target shard, the only one on this engine): one bit of this rank's optimizer
        shard flipped in memory (`MegatronParticipant.flip_bit`)."""
        assert self.participant is not None
        self.participant.flip_bit()

    def _watch_param_gather(self) -> None:
        """Mark where the step's gradient reduction begins (the launcher's straggler report reads the rank's busy time
        up to it), and tell the participant when this rank's shard is updated and its instance's parameter
        all-gather starts
        (megatron's `DistributedOptimizer` calls `start_param_sync` on each of its `model_chunks`, megatron's DDP
        modules, right after its update; an instance attribute of this setup's chunks, nothing of megatron's classes
        changes). A fault plan's kill with target `gather` fires there."""
        participant = self.participant
        chunks = {id(c): c for leaf in distributed_optimizers(self.optimizers[0]) for c in leaf.model_chunks}
        synced = [-1]  # the last step whose gradient reduction began (marked once a step, at its first chunk)
        for chunk in chunks.values():
            finish = chunk.finish_grad_sync

            def finish_grad_sync(*args: Any, _finish: Any = finish, **kwargs: Any) -> Any:
                # The step's gradient reduction begins (megatron's `finalize_model_grads`, after the backward): the
                # rank's own work of the step ends here (`progress.GRAD_SYNC`: its busy time, for stragglers).
                assert participant is not None
                step = participant.completed_steps + 1
                if synced[0] != step:
                    synced[0] = step
                    self._mark(step, progress.GRAD_SYNC)
                    self._before_reduction(step, chunks.values())
                return _finish(*args, **kwargs)

            chunk.finish_grad_sync = finish_grad_sync
            start = chunk.start_param_sync

            def start_param_sync(*args: Any, _start: Any = start, **kwargs: Any) -> Any:
                assert participant is not None
                participant.gathering()
                step = participant.completed_steps + 1
                self.session.faults.kill_in_gather(step)  # fault plan kind kill, target gather
                return _start(*args, **kwargs)

            chunk.start_param_sync = start_param_sync

    def _before_reduction(self, step: int, chunks: Any) -> None:
        """This rank's own gradients of step `step`, before any reduction: a fault plan's NaN lands in them, and
        their norm goes to the step's record (the NaN guard's attribution)."""
        buffers = [b for c in chunks for b in [*getattr(c, "buffers", []), *getattr(c, "expert_parallel_buffers", [])]]
        if buffers and self._session is not None and self._session.faults.poisoned(step):  # fault plan nan, nan_batch
            buffers[0].grad_data.view(-1)[0] = float("nan")
            log.info(f"injected a NaN in its gradient of step {step}")
        if self.runtime is not None:
            self._local_norm = math.sqrt(sum(float(b.grad_data.float().pow(2).sum()) for b in buffers))

    def _mark(self, step: int, phase: int) -> None:
        """Where this rank is in its step, for the launcher's progress watchdog (no session: nobody watches)."""
        if self._session is not None:
            self._session.beacon.mark(step, phase)


def _initialization_off(module: Any) -> dict[str, Any] | None:
    """The init methods of `module`'s megatron config (`init_method`, `output_layer_init_method`,
    `embedding_init_method`, ...) replaced with a no-op; returns the replaced ones by field (None where the config
    is not megatron's or has no init method: nothing skipped).

    Not `perform_initialization = False`: with it, megatron's tensor-parallel layers also skip marking their
    weights as tensor-parallel (`set_tensor_model_parallel_attributes` runs inside the initialisation), so under
    TP > 1 the gradient norm then counts a TP rank's weights as duplicates and leaves them out: a different clip,
    a different run. With a no-op init method the layers still allocate, split and mark their weights."""
    config: Any = getattr(module, "config", None)
    if not isinstance(getattr(config, "perform_initialization", None), bool):
        return None
    before = {name: value for name, value in vars(config).items() if name.endswith("init_method") and callable(value)}
    for name in before:
        setattr(config, name, _no_initialisation)
    return before or None  # no init method on the config: nothing skipped, and 'built uninitialised' stays false


def _no_initialisation(tensor: torch.Tensor) -> None:
    """An init method that leaves the tensor as allocated (the state loaded next writes it)."""


def _distributed_optimizer_ddp() -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    # overlap_param_gather off: at a step boundary every rank then holds the full, current parameters.
    return DistributedDataParallelConfig(check_for_nan_in_grad=True, use_distributed_optimizer=True,
                                         overlap_grad_reduce=False, overlap_param_gather=False)

