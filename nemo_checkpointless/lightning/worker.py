"""A training rank or a hot spare: `python -m nemo_checkpointless.lightning.worker`, started by the launcher.

A spare imports everything and opens the data, then waits for the launcher to hand it a rank; it then joins as
that rank's replacement. Every rank runs `fit` in a loop: a fallback to the persistent checkpoint leaves `fit`
(`RestartFromCheckpoint`) and enters it again in the same process, from the checkpoint's step.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from nemo_checkpointless.config import Config, load_run_config
from nemo_checkpointless.data.indexed import IndexedTokens
from nemo_checkpointless.data.job import job_loader
from nemo_checkpointless.data.loader import LedgeredLoader, MmapBatchLoader
from nemo_checkpointless.data.sampling import GlobalBatchPlan, RankBatchSampler, TokenSequences
from nemo_checkpointless.lightning.callback import CheckpointlessCallback
from nemo_checkpointless.lightning.module import LlamaLightningModule
from nemo_checkpointless.lightning.strategy import CheckpointlessStrategy, JoinSpec, Session
from nemo_checkpointless.protocol import spare_ready_key, wait_for_assignment
from nemo_checkpointless.restart import Membership, WorkerEnv
from nemo_checkpointless.restart.groups import connect_store
from nemo_checkpointless.restart.recovery import RecoveryEngine, RestartFromCheckpoint
from nemo_checkpointless.restart.template import warm_up_at_idle_priority
from nemo_checkpointless.restart.worker_env import ENV_PREFIX, SPARE_ID_ENV, preload, run_worker
from nemo_checkpointless.state.checkpoint import CheckpointStore
from nemo_checkpointless.topology import rank_info


class _PositionedSampler(RankBatchSampler):
    """Reads its first step from the session's data position when iterated (set by a join or a restart)."""

    def __init__(self, plan: GlobalBatchPlan, dp_rank: int, session: Session, end_step: int) -> None:
        super().__init__(plan, dp_rank, 0, end_step)
        self.session = session

    def __iter__(self) -> Iterator[list[int]]:
        self.start_step = self.session.position.step
        return super().__iter__()

    def __len__(self) -> int:
        return self.end_step - self.session.position.step


def build_session(cfg: Config, env: WorkerEnv, store: torch.distributed.Store) -> Session:
    membership = Membership(store, env.rank, env.world_size, env.store_host, cfg.launcher.collective_timeout_s)
    dims = cfg.dims()
    shards = dims.shard_size
    ckpt_dir = cfg.checkpoint.dir or str(Path(env.run_dir) / "checkpoints")
    checkpoints = CheckpointStore(ckpt_dir, shards) if cfg.checkpoint.every_n_steps else None
    engine = RecoveryEngine(membership, dims, checkpoints, verify_checksum=cfg.replication.checksum)
    return Session(env, membership, dims, engine, checkpoints, cfg.checkpoint.every_n_steps)


# This process's loader from its previous `fit` (a checkpoint restart builds a new one): its prefetch thread stops.
_previous_loader: list[MmapBatchLoader | LedgeredLoader] = []


def _build_loader(cfg: Config, session: Session, dataset: TokenSequences, plan: GlobalBatchPlan, dp_rank: int
                  ) -> Iterable[torch.Tensor]:
    """`data.loader=mmap`: batches from the job's shared-memory cache (tier 2); `plain`: a `DataLoader`. Both start
    at the session's data position when iterated, and with `data.verify` record what they yield for the check."""
    while _previous_loader:
        _previous_loader.pop().close()
    env = session.env
    start = lambda: session.position.step  # noqa: E731  (set by a join or a restart before `fit` iterates)
    loader: MmapBatchLoader | LedgeredLoader
    if cfg.data.loader == "plain":
        plain = torch.utils.data.DataLoader(
            dataset, batch_sampler=_PositionedSampler(plan, dp_rank, session, cfg.trainer.max_steps), num_workers=0)
        if not cfg.data.verify:
            return plain
        loader = LedgeredLoader(plain, start)
    else:
        loader = job_loader(cfg, session.membership.store, rank=env.rank, dims=session.dims, run_dir=env.run_dir,
                            store_port=env.store_port, dataset=dataset, plan=plan, end_step=cfg.trainer.max_steps,
                            start_step=start, name=f"[rank {env.rank}]")
    _previous_loader.append(loader)
    return loader


class _DataOrderCheck(pl.Callback):
    """Before each step: the batch must be the one the loader produced for this step (`data.verify`)."""

    def __init__(self, loader: MmapBatchLoader | LedgeredLoader, rank: int) -> None:
        self.loader = loader
        self.rank = rank
        self._first = True

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.loader.check_batch(trainer.global_step, batch)
        first = getattr(self.loader, "first_batch", None)
        if self._first and first and first["step"]:
            print(f"[rank {self.rank}] data: first batch at step {first['step']} from the {first['source']} in "
                  f"{1e3 * first['s']:.2f} ms", flush=True)
        self._first = False


def _data_callbacks(loader: Iterable[torch.Tensor], rank: int) -> list[pl.Callback]:
    return [_DataOrderCheck(loader, rank)] if isinstance(loader, (MmapBatchLoader, LedgeredLoader)) else []


def build_trainer(cfg: Config, session: Session, tokens: object, join: JoinSpec
                  ) -> tuple[pl.Trainer, LlamaLightningModule, Iterable[torch.Tensor]]:
    env = session.env
    # The same seed on every rank: every replica starts from the same parameters.
    pl.seed_everything(cfg.seed, workers=False, verbose=False)
    dataset = TokenSequences(tokens, cfg.data.seq_len)  # type: ignore[arg-type]
    dp_rank = rank_info(session.dims, env.rank).dp_rank
    plan = GlobalBatchPlan(len(dataset), cfg.data.micro_batch_size, session.dims.dp, cfg.seed, cfg.data.shuffle)
    loader = _build_loader(cfg, session, dataset, plan, dp_rank)
    module = LlamaLightningModule(cfg.model.llama_config(), cfg.optim, cfg.trainer.max_steps)
    strategy = CheckpointlessStrategy(num_instances=cfg.replication.num_instances, grad_clip=cfg.optim.grad_clip,
                                      session=session, join=join)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=cfg.trainer.max_steps,
        callbacks=[*_data_callbacks(loader, env.rank), CheckpointlessCallback(env.run_dir, cfg.fault.plan)],
        logger=CSVLogger(env.run_dir, name="logs", version=f"metrics_rank{env.rank}") if env.rank == 0 else False,
        log_every_n_steps=cfg.trainer.log_every_n_steps, enable_checkpointing=False,
        enable_progress_bar=cfg.trainer.progress_bar, enable_model_summary=False,
        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0)
    return trainer, module, loader


def warm_up(cfg: Config) -> None:
    """Run one forward/backward of the model on a dummy batch, so a replacement's first real step does not pay for
    first-call kernel and allocator set-up (measured: ~0.1 s of a ~0.3 s recovery on the CPU test job). Touches
    no state that matters: the model is rebuilt, and RNG is restored from the replica, after assignment."""
    module = LlamaLightningModule(cfg.model.llama_config(), cfg.optim, cfg.trainer.max_steps)
    batch = torch.zeros(cfg.data.micro_batch_size, cfg.data.seq_len + 1, dtype=torch.int64)
    logits = module.model(batch[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()


@dataclass
class _Prepared:
    """What a rank or spare sets up before it needs the store: the config, the tokens, and (a spare) the warm-up."""

    cfg: Config
    tokens: Any
    warm: bool = False


def _prepare(run_dir: str) -> _Prepared:
    cfg = load_run_config(Path(run_dir))
    torch.set_num_threads(cfg.launcher.threads_per_rank)
    preload(cfg)
    assert cfg.data.path is not None, "the launcher resolves data.path before starting workers"
    return _Prepared(cfg, IndexedTokens(cfg.data.path).tokens)


def spare_template() -> Callable[[], None]:
    """For `restart.template`: import and warm up once; each spare forked from here runs the returned function."""
    prepared = _prepare(os.environ[f"{ENV_PREFIX}RUN_DIR"])
    warm_up(prepared.cfg)
    prepared.warm = True
    return lambda: run(prepared)


def run(prepared: _Prepared | None = None) -> None:
    environ = os.environ
    host, port = environ[f"{ENV_PREFIX}STORE_HOST"], int(environ[f"{ENV_PREFIX}STORE_PORT"])
    run_dir = environ[f"{ENV_PREFIX}RUN_DIR"]
    prepared = prepared or _prepare(run_dir)
    cfg, tokens = prepared.cfg, prepared.tokens
    store = connect_store(host, port, cfg.launcher.start_timeout_s)
    join = JoinSpec()
    if SPARE_ID_ENV in environ:
        spare_id = int(environ[SPARE_ID_ENV])
        if not prepared.warm:  # started without the template
            warm_up_at_idle_priority(lambda: warm_up(cfg))
        store.set(spare_ready_key(spare_id), "1")
        assignment = wait_for_assignment(store, spare_id)
        rank, world = assignment["rank"], int(environ["WORLD_SIZE"])
        env = WorkerEnv(rank, world, rank, host, port, run_dir)
        join = JoinSpec("replacement", assignment["generation"])
    else:
        env = WorkerEnv.from_environ()
        if f"{ENV_PREFIX}JOIN_GENERATION" in environ:
            join = JoinSpec("replacement", int(environ[f"{ENV_PREFIX}JOIN_GENERATION"]))
    session = build_session(cfg, env, store)
    if join.kind == "replacement":
        # Anything this rank does before the join belongs to the generation it joins, not to generation 0.
        session.membership.generation = join.generation - 1
    elif f"{ENV_PREFIX}RESTART_GENERATION" in environ:
        # A whole-job restart (launcher.on_failure=restart_all): every rank reloads the newest checkpoint.
        generation = int(environ[f"{ENV_PREFIX}RESTART_GENERATION"])
        step = session.checkpoints.latest(cfg.trainer.max_steps) if session.checkpoints is not None else 0
        session.membership.generation = generation
        join = JoinSpec("checkpoint", generation, step)
    while True:
        trainer, module, loader = build_trainer(cfg, session, tokens, join)
        try:
            trainer.fit(module, train_dataloaders=loader)
            return
        except RestartFromCheckpoint as restart:
            print(f"[rank {env.rank}] {restart}", flush=True)
            join = JoinSpec("checkpoint", restart.generation, restart.decision.step)


def main() -> NoReturn:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    run_worker(run)


if __name__ == "__main__":
    main()
