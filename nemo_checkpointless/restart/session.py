"""A rank's session: what outlives one `fit` on a rank (its place in the job, its groups, the recovery engine), and
how a process started by the launcher builds it from its environment (`Session.from_environ`).

Both adapters' strategies build one when `fit` starts; a hot spare says it is ready and waits inside
`from_environ` for the rank it replaces, then learns it (and sets `RANK`, `LOCAL_RANK`, `ROLE_RANK` for the
framework that reads them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nemo_checkpointless import protocol
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.restart import logs
from nemo_checkpointless.restart.faults import Injector
from nemo_checkpointless.restart.groups import Membership, connect_store
from nemo_checkpointless.restart.progress import ProgressBeacon
from nemo_checkpointless.restart.recovery import RecoveryEngine, RecoveryStamps
from nemo_checkpointless.restart.worker_env import WorkerEnv
from nemo_checkpointless.state.checkpoint import CheckpointStore
from nemo_checkpointless.topology import ParallelDims


@dataclass
class JoinSpec:
    """How this rank enters `fit`: fresh (step 0), as a replacement (receive state at `generation`), or from the
    persistent checkpoint of `step` after a fallback decided at `generation`."""

    kind: str = "fresh"  # fresh | replacement | checkpoint | rollback (integrity) | kept (a reshaped world)
    generation: int = 0
    step: int = 0


@dataclass
class DataPosition:
    """The first 0-based step the data loader yields (samples consumed = step x global batch)."""

    step: int = 0


def env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(name, raw, "must be a number", f"unset {name} or set it to a number") from None


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
    join: JoinSpec = field(default_factory=JoinSpec)
    stamps: RecoveryStamps = field(init=False)
    beacon: ProgressBeacon = field(init=False)  # where this rank's training thread is (the launcher's watchdog)
    faults: Injector = field(init=False)  # the fault plan's hooks (armed by the door's callback; empty: no plan)

    def __post_init__(self) -> None:
        self.stamps = RecoveryStamps(self.membership.store, self.env.rank)
        self.beacon = ProgressBeacon(self.env.run_dir, self.env.rank)
        self.faults = Injector(self.env.rank, self.membership.store)
        self.engine.faults = self.faults
        logs.bind(self.env.rank, generation=lambda: self.membership.generation, step=lambda: self.beacon.step)

    @property
    def store(self) -> Any:
        return self.membership.store

    @classmethod
    def create(cls, env: WorkerEnv, store: Any, dims: ParallelDims, collective_timeout_s: float,
               checkpoint_every: int, checkpoint_dir: str | None, verify_checksum: bool = True) -> Session:
        membership = Membership(store, env.rank, env.world_size, protocol.local_addr(env.store_host),
                                collective_timeout_s)
        ckpt_dir = checkpoint_dir or os.path.join(env.run_dir, "checkpoints")
        checkpoints = CheckpointStore(ckpt_dir, dims.checkpoint_slots) if checkpoint_every else None
        engine = RecoveryEngine(membership, dims, checkpoints, verify_checksum=verify_checksum)
        return cls(env, membership, dims, engine, checkpoints, checkpoint_every)

    @classmethod
    def from_environ(cls, dims: Callable[[int], ParallelDims], *, checkpoint_every: int | None = None,
                     checkpoint_dir: str | None = None, collective_timeout_s: float | None = None,
                     verify_checksum: bool = True, on_rank: Callable[[int], None] | None = None) -> Session:
        """The session of a process the launcher started (`checkpointless-run`, `checkpointless-train`).

        `dims(world_size)` gives the job's layout (and raises `ConfigError` in the caller's terms). The arguments
        left None come from the launcher's environment (`protocol`). A hot spare says it is ready and waits here for
        its rank; `on_rank(rank)` is then called (e.g. for Lightning's `rank_zero_only`)."""
        environ = os.environ
        if protocol.STORE_PORT_ENV not in environ:
            raise RuntimeError(
                "this process was not started by checkpointless-run (no "
                f"{protocol.STORE_PORT_ENV} in its environment). Start the script with: checkpointless-run "
                "--nproc-per-node K [--spares S] script.py ARGS (it hosts the job's store and replaces failed ranks)")
        host, port = environ[protocol.STORE_HOST_ENV], int(environ[protocol.STORE_PORT_ENV])
        run_dir = environ.get(protocol.RUN_DIR_ENV, os.getcwd())
        world = int(environ["WORLD_SIZE"])
        if protocol.START_TIMEOUT_ENV not in environ:  # every launcher sets it beside the store's port
            raise RuntimeError(f"{protocol.START_TIMEOUT_ENV} (launcher.start_timeout_s) is not set: this process "
                               "was started by a launcher of another version of nemo_checkpointless")
        start_timeout = env_number(protocol.START_TIMEOUT_ENV, 0.0)
        layout = dims(world)  # before waiting as a spare: a bad layout fails every process at once
        store = connect_store(host, port, start_timeout)
        join = JoinSpec()
        if protocol.SPARE_ID_ENV in environ:
            spare_id = int(environ[protocol.SPARE_ID_ENV])
            store.set(protocol.spare_ready_key(spare_id), "1")
            assignment = protocol.wait_for_assignment(store, spare_id)
            rank = assignment.rank
            local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
            environ.update(RANK=str(rank), LOCAL_RANK=str(rank % local_world), ROLE_RANK=str(rank),
                           NODE_RANK=str(rank // local_world))
            join = JoinSpec("replacement", assignment.generation)
        else:
            rank = int(environ["RANK"])
            if protocol.JOIN_GENERATION_ENV in environ:
                join = JoinSpec("replacement", int(environ[protocol.JOIN_GENERATION_ENV]))
        if on_rank is not None:
            on_rank(rank)
        store.set(protocol.checkpointless_key(os.getpid()), "1")
        env = WorkerEnv(rank, world, int(environ.get("LOCAL_RANK", rank)), host, port, run_dir)
        every = checkpoint_every if checkpoint_every is not None else int(
            env_number(protocol.CHECKPOINT_EVERY_ENV, 0))
        timeout = collective_timeout_s or env_number(protocol.COLLECTIVE_TIMEOUT_ENV, 30.0)
        ckpt_dir = checkpoint_dir or environ.get(protocol.CHECKPOINT_DIR_ENV)
        session = cls.create(env, store, layout, timeout, every, ckpt_dir, verify_checksum=verify_checksum)
        # A cold replacement runs the whole script before it reaches the recovery: the others wait for it to
        # arrive for as long as a rank may take to start, not one collective timeout.
        session.membership.arrive_timeout_s = max(timeout, start_timeout)
        if join.kind == "replacement":
            # Anything this rank does before the join belongs to the generation it joins, not to generation 0.
            session.membership.generation = join.generation - 1
        elif protocol.RESTART_GENERATION_ENV in environ:
            # A whole-job restart (launcher.on_failure=restart_all): every rank reloads the newest checkpoint.
            generation = int(environ[protocol.RESTART_GENERATION_ENV])
            step = session.checkpoints.latest(1 << 62) if session.checkpoints is not None else 0
            session.membership.generation = generation
            join = JoinSpec("checkpoint", generation, step)
        session.join = join
        return session
