"""In-process replacement on the NeMo path: what a rank does between two `fit`s of consecutive generations.

NeMo and megatron-core hold the default process group and groups derived from it in many places (parallel_state,
megatron DDP, its bucket groups, the distributed optimizer, modules' `pg_collection`). Rather than re-pointing each
handle, every rank leaves `fit` after a failure (in its own process: a survivor keeps its pid and memory) and enters
it again with a fresh Megatron setup on the next generation's default group:

- a survivor catches the failure out of `fit`, runs the recovery engine (`RecoveryEngine.recover`) with its
  `MegatronParticipant` (it sends its boundary state if it is a replacement's source), keeps its own boundary
  state in memory (`own_boundary_state`: views of the previous fit's tensors, no copy) and passes it as `resume=`
  to the next `CheckpointlessMegatronStrategy`;
- a replacement runs `RecoveryEngine.join` with a `ReceivedState` (it has no model yet), then passes the state it
  received as `resume=`;
- `abandon_default_group()` takes the failed default group and every group derived from it out of
  torch.distributed's tables and hands them to the reaper thread (`restart.groups.reap`), which destroys them
  off the training thread once nothing else holds them (it collects the failed `fit`'s reference cycles, which
  still hold some): a forgotten gloo group keeps its sockets and can leave its transport thread spinning on a
  core (see `restart.groups`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from lightning.pytorch.strategies.launchers.launcher import _Launcher

from nemo_checkpointless.errors import ConfigError, SummaryError
from nemo_checkpointless.megatron.data import clear_recorded
from nemo_checkpointless.megatron.groups import FaultWatch, abandon_default_group, drop_megatron_groups, release_fit
from nemo_checkpointless.megatron.participant import MegatronParticipant, own_boundary_state
from nemo_checkpointless.protocol import SPARE_ID_ENV
from nemo_checkpointless.restart.faults import InjectedFault
from nemo_checkpointless.restart.groups import PeerFailure, alive_key, fault_generation, hang_key
from nemo_checkpointless.restart.recovery import ReceivedState, RestartFromCheckpoint
from nemo_checkpointless.restart.session import Session
from nemo_checkpointless.restart.worker_env import die_by_signal, freeze_heap

log = logging.getLogger(__name__)

State = tuple[dict[str, torch.Tensor], dict[str, Any]]


class SkipStep(Exception):  # a control-flow signal, not an error
    """Raised out of `fit` on every rank alike: step `step + 1`'s gradient is not finite again with the same batch and
    `integrity.nan_policy=skip`: the step counts as done without an update (the data moves on); every rank enters
    `fit` again at boundary `step + 1` with its state of boundary `step`."""

    def __init__(self, step: int, hashes: list[bytes] | None) -> None:
        super().__init__(f"step {step + 1}'s batch gives a non-finite gradient: skipped")
        self.step, self.hashes = step, hashes


class RedoStep(Exception):  # a control-flow signal, not an error
    """Raised out of `fit` on every rank alike: the replicas' vote repaired a copy that step `step + 1` may have
    trained on; every rank enters `fit` again at boundary `step` and trains that step again."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the replicas' vote repaired a copy in step {step + 1}: that step is trained again")
        self.step = step


class MegatronDoor(Protocol):
    """What this module uses of the strategy it relaunches and recovers (`nemo.strategy.CheckpointlessMegatronStrategy`,
    which imports this module): named here, so that nothing here imports the strategy."""

    participant: MegatronParticipant | None
    restored: tuple[str, dict[int, int]]
    pg_timeout_s: float | None
    reentry: dict[str, float]
    fault_watch: FaultWatch | None
    tensor_model_parallel_size: Any
    sequence_parallel: Any
    lr_scheduler_configs: Any
    megatron_parallel: Any
    optimizers: Any
    model: Any

    @property
    def session(self) -> Session: ...

    @property
    def lightning_module(self) -> Any: ...

    def ensure_session(self) -> None: ...

    def begin_generation(self, resume: State | None) -> None: ...


class InProcessLauncher(_Launcher):
    """`trainer.fit` in this process, entered again after every recovery (the strategy's launcher).

    A hot spare waits here (`ensure_session`) for the rank it replaces, then receives its state. Each generation's
    `fit` runs under a `FaultWatch`. When it fails because a peer did, this rank recovers (`recover_in_process`),
    the trainer is taken back to where a fresh one would be (`reset_for_reentry`: its loops, the model's megatron
    module, DDP and optimizer), and `fit` is entered again with the same trainer, model and data module: the
    user's script (`trainer.fit`, `llm.train`) never sees the failure."""

    def __init__(self, strategy: MegatronDoor) -> None:
        self.strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def kill(self, signum: Any) -> None:
        """Lightning calls this when the process gets SIGTERM: `die_by_signal`."""
        die_by_signal(signum)

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        strategy = self.strategy
        if SPARE_ID_ENV in os.environ and args and isinstance(args[0], torch.nn.Module):
            # A hot spare of a user's script: compile what the first step compiles while it waits, not after it
            # took a rank (a spare of the package's worker was warmed by its template: nothing left to do).
            # `trainer.fit(model, datamodule)` passes the data module second (`llm.train` does), or as `datamodule=`
            # Only with the job's micro-batch shape: compiled for another, the first step compiles again, for
            # dynamic shapes, which takes longer than compiling once.
            datamodule = next((a for a in args[1:4] if hasattr(a, "micro_batch_size")), None)
            seq_len = getattr(getattr(args[0], "config", None), "seq_length", None)
            if datamodule is not None and seq_len:
                warm_up_kernels(args[0], int(datamodule.micro_batch_size), int(seq_len),
                                tp=int(strategy.tensor_model_parallel_size or 1),
                                sequence_parallel=bool(strategy.sequence_parallel))
        freeze_heap()  # once per process: what the script built before fit stays out of later collections
        strategy.ensure_session()
        session = strategy.session
        resume = entry_state(strategy)
        while True:
            generation = session.membership.generation
            strategy.begin_generation(resume)
            resume = None
            watch = FaultWatch(session.store, generation, keep_ports={session.env.store_port})
            strategy.fault_watch = watch
            try:
                with watch:
                    return function(*args, **kwargs)
            except (InjectedFault, ConfigError, SummaryError):  # this rank's own failure, a user's error: no peer's
                raise
            except (RestartFromCheckpoint, RedoStep, SkipStep) as again:  # the checks' verdict, every rank alike
                t, recovered = time.time(), False
                resume, how = after_vote(strategy, again)
                reset_for_reentry(trainer)
            except Exception as e:  # a peer failed (a gloo error, or the timeout of a collective it never joined)
                t, recovered = time.time(), True
                resume, how = recover_in_process(strategy, e, watch, generation)
                reset_for_reentry(trainer)
            # After the handler, so that the exception's traceback (the failed fit's frames) is gone. That fit's
            # objects sit in reference cycles (Lightning's, NeMo's), with handles to the groups: the reaper thread
            # collects them (a full collection, quick when the heap of the imports is frozen: `freeze_heap`) once
            # it has dropped the groups, while this thread sets up the next fit (it waits for its peers there).
            abandoned = abandon_default_group()
            if recovered:  # the recovery's record gets the first step after it (a vote's re-entry is no recovery)
                session.stamps.track(session.membership.generation)
            strategy.reentry = {"recovered": time.time()}
            log.warning(f"{'recovered ' if recovered else ''}{how} in {time.time() - t:.2f} s ({abandoned} old groups "
                        "abandoned); entering fit again")


_WARM = False  # this process (or the template it was forked from) ran `warm_up_kernels`
NEMO_DEFAULT_SEED = 1234  # the seed NeMo's `init_parallel_ranks` gives Megatron's RNG tracker


def warm_up_kernels(module: Any, micro_batch_size: int, seq_len: int, seed: int = NEMO_DEFAULT_SEED,
                    tp: int = 1, sequence_parallel: bool = False, again: bool = False) -> None:
    """A hot spare's warm-up, so that its first step after a join costs what a survivor's does: on a private process
    group (never the job's), build `module`'s megatron model and run one forward and backward on a dummy
    micro-batch of the job's shape, which compiles megatron's fused functions (`torch.compile`: 2.4 s here for the
    tiny Llama) the way the job's step calls them. The backward goes through megatron's own `custom_backward`, as
    its schedule does (`torch.autograd.backward` runs under another torch-function mode stack, and dynamo would
    compile again), from a loss reduced as NeMo's masked token loss reduces it (a plain `sum()` hands the compiled
    cross-entropy backward a stride-0 gradient, and dynamo compiles it again in the first real step).

    TP = 1 (PP any: a pipeline stage's layers have the whole model's shapes): one rank of a one-rank gloo group.
    TP = `tp` > 1: the model of each TP rank in turn, as rank r of a `tp`-rank world of torch's fake process group
    (no communication: a collective returns at once and leaves its output as it was; the values do not matter
    here), with the job's `sequence_parallel` (its gathers and scatters then have their real shapes too). The fused
    functions are compiled for one TP rank's slices (heads, FFN, vocabulary), and once per TP rank
    where a rank's own numbers reach them (the vocabulary range of the cross-entropy: dynamo specialises on it),
    with dynamo's automatic dynamic shapes off, so that each rank's entry is the static one a survivor of that TP
    rank compiled (with it on, the second rank's call would compile a dynamic-shape version instead). The spare
    does not know which TP rank it will replace. From dynamo's recompile limit (8) up, TP rank 0 only.

    Then the model, the group and megatron's state are dropped: the real `fit` builds the model again on the job's
    groups and loads the state it receives. Once per process (`again`: once more, in a process forked from one that
    warmed up: nothing compiles then, and the pages the step writes become the process's own); never fatal (the
    first step compiles instead)."""
    global _WARM
    import torch.distributed as dist

    if (_WARM and not again) or dist.is_initialized():
        return
    _WARM = True
    if tp == 1:
        _warm_up_one(module, micro_batch_size, seq_len, seed, "gloo", 0, 1)
        return
    import torch._dynamo

    try:
        import torch.testing._internal.distributed.fake_pg  # (registers torch's "fake" backend)
    except ImportError as e:
        log.warning(f"spare warm-up: skipped, torch has no fake process group ({e}); the first step after a join "
                    "will compile")
        return
    config = getattr(module, "config", None)
    # As the strategy sets them when `fit` starts: the vocabulary is padded to a multiple of the TP size.
    layout = {"tensor_model_parallel_size": tp, "sequence_parallel": sequence_parallel}
    before = {name: getattr(config, name) for name in layout if hasattr(config, name)}
    for name in before:
        setattr(config, name, layout[name])
    # One entry per TP rank in dynamo's cache of each cross-entropy function, with room for one more: with as many
    # as its recompile limit, a replacement whose rank misses would run that function uncompiled, unlike its
    # survivors (then only TP rank 0 is warmed; another rank's replacement compiles its own in its first step).
    limit = int(getattr(torch._dynamo.config, "recompile_limit", 0) or torch._dynamo.config.cache_size_limit)
    tp_ranks = range(tp) if tp < limit else range(1)
    try:
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            for tp_rank in tp_ranks:
                if not _warm_up_one(module, micro_batch_size, seq_len, seed, "fake", tp_rank, tp):
                    break
    finally:
        for name, value in before.items():
            setattr(config, name, value)


def _warm_up_one(module: Any, micro_batch_size: int, seq_len: int, seed: int, backend: str, rank: int,
                 world_size: int) -> bool:
    """`warm_up_kernels` as `rank` of a private `world_size`-rank world of `backend` (TP = world size, PP = 1):
    build, one forward and backward, drop. False if the forward or backward failed (said on stdout)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel.schedules import custom_backward

    dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(world_size, 1, create_gloo_process_groups=backend == "gloo")
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        module.configure_model()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        tokens = torch.zeros(micro_batch_size, seq_len, dtype=torch.int64, device=device)
        positions = torch.arange(seq_len, device=device).unsqueeze(0).expand(micro_batch_size, -1)
        mask = torch.ones(seq_len, seq_len, device=device).tril().view(1, 1, seq_len, seq_len) < 0.5
        loss = module.module(input_ids=tokens, position_ids=positions, attention_mask=mask, labels=tokens)
        loss_mask = torch.ones(micro_batch_size, seq_len, device=device)
        custom_backward((loss.float() * loss_mask).sum() / loss_mask.sum(), None)
        warm_up_logging(loss.device)
        return True
    except Exception as e:
        where = f" (as TP rank {rank} of {world_size})" if world_size > 1 else ""
        log.warning(f"spare warm-up: forward/backward failed{where} ({type(e).__name__}: {e}); the first step "
                    "after a join will compile")
        return False
    finally:
        if "module" in getattr(module, "_modules", {}):
            del module.module
        drop_megatron_groups()
        dist.destroy_process_group()


def warm_up_logging(device: torch.device) -> None:
    """The first `LightningModule.log` of a process costs ~0.09 s here (measured on a replacement's first step:
    NeMo's optimizer module logs the learning rate at every batch start): Python's ABC `isinstance` caches are
    filled for each class Lightning's collection helpers meet (0.05 s with NeMo's classes loaded), and torchmetrics
    reads two package versions from their metadata (0.03 s). A spare does it while it waits: one value logged into
    a throwaway result collection, as Lightning logs a step's value."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    results = _ResultCollection(training=True)
    results.log("on_train_batch_start", "lr", torch.tensor(0.0, device=device), prog_bar=True, on_step=True,
                on_epoch=False, batch_size=1)
    results.log("training_step", "reduced_train_loss", torch.tensor(0.0, device=device), prog_bar=True,
                on_step=True, on_epoch=False, batch_size=1)
    results.metrics(on_step=True)
    results.to(device)


def entry_state(strategy: MegatronDoor) -> State | None:
    """The state this rank's first `fit` starts from: a replacement's, received from a live replica (or the
    checkpoint); after a whole-job restart, the newest checkpoint's; else none (the seeded initial state)."""
    session = strategy.session
    join = session.join
    if join.kind == "replacement":
        received = ReceivedState()
        decision = session.engine.join(received, join.generation)
        session.stamps.track(session.membership.generation)
        strategy.reentry = {"recovered": time.time()}
        source = (f"a replica (p2p, {session.engine.bytes_received} bytes)" if decision.path == "p2p" else
                  "the checkpoint" if decision.step else "the seeded initial state")
        log.info(f"joined: state of step {decision.step} from {source}")
        strategy.restored = (decision.path, dict(decision.sources))
        return received.state
    if join.kind == "checkpoint":
        session.stamps.track(join.generation)
        strategy.restored = ("checkpoint", {})
        return checkpoint_state(strategy, join.step)
    return None


def checkpoint_state(strategy: MegatronDoor, step: int) -> State | None:
    received = ReceivedState()
    strategy.session.engine.load_checkpoint(received, step)
    return received.state


def _wait_for_fault(store: Any, generation: int, patience_s: float) -> bool:
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        if fault_generation(store) >= generation:
            return True
        time.sleep(0.01)
    return False


def _timed_out(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def after_vote(strategy: MegatronDoor, again: RestartFromCheckpoint | RedoStep | SkipStep
               ) -> tuple[State | None, str]:
    """Every rank, out of a `fit` the integrity checks ended (`restart.integrity`): the state the next `fit` (of
    the same generation) starts from: the checkpoint's (a vote without a majority: roll back), this rank's own
    boundary state, repaired or not (train the step again: a repair, a non-finite gradient), or that state
    counted one step on (a batch skipped). Lets the ended fit's megatron objects go."""
    part = strategy.participant
    assert part is not None
    if isinstance(again, RestartFromCheckpoint):
        resume = checkpoint_state(strategy, again.decision.step)
        how = f"rolled back to step {again.decision.step} ({again.decision.reason})"
        strategy.restored = ("checkpoint", {})
    elif isinstance(again, SkipStep):
        # The RNG as the skipped step left it (a run that applied the step would go on from there too).
        strategy.restored = ("p2p", {})
        part.step_done(again.hashes)
        part.at_step_boundary(part.completed_steps)
        resume = part.boundary_state()
        how = f"step {again.step + 1} skipped (its batch gives a non-finite gradient)"
    else:
        strategy.restored = ("p2p", {})
        part.adopt_loaded_rng()
        resume = own_boundary_state(part)
        how = f"step {again.step + 1} again (a repaired copy, or a non-finite gradient)"
    release_fit(strategy.model, strategy.optimizers)
    strategy.participant = None
    return resume, how


def recover_in_process(strategy: MegatronDoor, error: Exception, watch: FaultWatch,
                       generation: int) -> tuple[State | None, str]:
    """A survivor, out of a failed `fit`: wait until the launcher declares the failure (re-raise `error` if it never
    does: then it was this rank's own), run the recovery engine, and return the state the next `fit` starts from
    (its own boundary state, or the checkpoint's) and how it recovered. Lets the failed fit's megatron objects go."""
    session = strategy.session
    store, rank, timeout = session.store, session.env.rank, strategy.pg_timeout_s or 30.0
    clear_recorded()
    if fault_generation(store) < generation:
        # Nobody has died (yet): check in, and if a collective timed out, ask the launcher to find a hang.
        store.set(alive_key(generation, rank), json.dumps(time.time()))
        if _timed_out(error):
            store.set(hang_key(generation), json.dumps({"rank": rank, "t": time.time()}))
    if not _wait_for_fault(store, generation, patience_s=2 * timeout + 10):
        raise error
    part = strategy.participant
    if part is None:  # failed before the model existed: nothing of this fit to keep
        raise error
    why = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    if watch.fired:
        why += f" (fault watch closed {watch.closed} sockets)"
    log.info(f"left fit at step {part.completed_steps}: {why}")
    resume: State | None = own_boundary_state(part)
    try:
        decision = session.engine.recover(part, PeerFailure(f"{type(error).__name__} in NeMo's fit"))
        how = f"p2p at step {decision.step}"
        strategy.restored = ("p2p", dict(decision.sources))
        if rank in decision.rolled_forward:  # loaded with a replica's state at the end of the step it was in
            resume = own_boundary_state(part)
            how += ", rolled forward"
        elif rank in decision.rewound:  # loaded with a replica's state at the start of the step it was in
            resume = own_boundary_state(part)
            how += ", rewound"
    except RestartFromCheckpoint as restart:
        resume = checkpoint_state(strategy, restart.decision.step)
        strategy.restored = ("checkpoint", {})
        how = f"from the checkpoint of step {restart.decision.step} ({restart.decision.reason})"
    release_fit(strategy.model, strategy.optimizers)  # else that fit's model and groups are never freed
    strategy.participant = None
    return resume, how


def _is_telemetry(callback: Any) -> bool:
    try:
        from nv_one_logger.training_telemetry.integration.pytorch_lightning import TimeEventCallback
    except ImportError:
        return False
    return isinstance(callback, TimeEventCallback)


_CONFIG_HOOKS = ("no_sync_func", "grad_sync_func", "param_sync_func", "finalize_model_grads_func")


def reset_for_reentry(trainer: Any) -> None:
    """The trainer, its model and data module as a fresh `Trainer.fit` would find them, so that `fit` can be
    entered again on the same objects: the teardown hooks run (a data module closes its prefetch), the
    strategy's megatron objects are dropped, the model's megatron module is dropped (its layers hold the failed
    generation's groups; `configure_model` builds it again, and the state is then loaded into it), the hooks NeMo
    put on the model config and its `configure_optimizers` are undone, and the fit loop is a new one."""
    from lightning.pytorch.loops import _FitLoop
    from lightning.pytorch.trainer import call

    strategy = trainer.strategy
    model = strategy.lightning_module
    for callback in trainer.callbacks:
        # NeMo's telemetry (nv_one_logger, which `llm.train` turns on) keeps spans open from on_train_start to
        # on_train_end (and from each batch's start to its end) and refuses a second start: they end here.
        if _is_telemetry(callback):
            # Each may not be open (the failure came between two batches); telemetry never stops a recovery.
            with contextlib.suppress(Exception):
                callback.on_train_batch_end(trainer, model, None, None, 0)
            with contextlib.suppress(Exception):
                callback.on_train_end(trainer, model)
    trainer._teardown()
    call._call_teardown_hook(trainer)
    if hasattr(strategy, "megatron_parallel"):
        del strategy.megatron_parallel
    strategy.optimizers, strategy.lr_scheduler_configs = [], []
    if "module" in model._modules:
        del model.module
    # MegatronParallel binds the megatron module's `set_input_tensor` onto the Lightning module (pipeline
    # parallelism feeds each stage through it): bound to the dropped module, it would keep it alive and feed it.
    model.__dict__.pop("set_input_tensor", None)
    config = getattr(model, "config", None)
    for name in _CONFIG_HOOKS:
        if getattr(config, name, None) is not None:
            setattr(config, name, None)
    configure = model.__dict__.get("configure_optimizers")
    while isinstance(configure, functools.partial):  # NeMo binds each fit's MegatronParallel to it
        configure = configure.func
    if configure is not None:
        model.configure_optimizers = configure
    # NeMo's optimizer and LR-scheduler modules keep what they built last (`_optimizers`, `_scheduler`): the failed
    # generation's optimizer, hence its DDP and groups, until the next fit replaced them.
    optim = getattr(model, "optim", None)
    for holder, name in ((optim, "_optimizers"), (getattr(optim, "lr_scheduler", None), "_scheduler")):
        if holder is not None and getattr(holder, name, None) is not None:
            setattr(holder, name, None)
    old = trainer.fit_loop
    loop = _FitLoop(trainer, min_epochs=old.min_epochs, max_epochs=old.max_epochs)
    epoch = old.epoch_loop
    loop.epoch_loop = type(epoch)(trainer, min_steps=epoch.min_steps, max_steps=epoch.max_steps)
    trainer.fit_loop = loop


