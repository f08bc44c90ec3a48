"""What the launcher and the workers tell each other: environment variables and keys of the job's store.

Imported by both sides (`launcher/` and every worker: the package's own and a user's script through
`CheckpointlessStrategy`); nothing here imports torch.distributed's process groups, Lightning or NeMo.

Environment of a process the launcher starts (besides torchrun's own: `RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
`LOCAL_WORLD_SIZE`, `GROUP_RANK`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`,
`TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT`, `TORCHELASTIC_MAX_RESTARTS`, `TORCHELASTIC_USE_AGENT_STORE`):
a hot spare has `SPARE_ID_ENV` and no `RANK`/`LOCAL_RANK` until the launcher assigns it one.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_PREFIX = "NCL_"
STORE_HOST_ENV = f"{ENV_PREFIX}STORE_HOST"
STORE_PORT_ENV = f"{ENV_PREFIX}STORE_PORT"
RUN_DIR_ENV = f"{ENV_PREFIX}RUN_DIR"
SPARE_ID_ENV = f"{ENV_PREFIX}SPARE_ID"  # set for a hot spare instead of RANK
LAUNCHER_PID_ENV = f"{ENV_PREFIX}LAUNCHER_PID"  # a spare exits when its launcher is gone
# Several nodes: the address of this rank's node that its gloo sockets bind to (one node: the store's host).
LOCAL_ADDR_ENV = f"{ENV_PREFIX}LOCAL_ADDR"
JOIN_GENERATION_ENV = f"{ENV_PREFIX}JOIN_GENERATION"  # a cold replacement joins this generation
RESTART_GENERATION_ENV = f"{ENV_PREFIX}RESTART_GENERATION"  # a whole-job restart: reload the newest checkpoint
# The job's settings for a user's script (checkpointless-run's flags); CheckpointlessStrategy's arguments win.
COLLECTIVE_TIMEOUT_ENV = f"{ENV_PREFIX}COLLECTIVE_TIMEOUT_S"
START_TIMEOUT_ENV = f"{ENV_PREFIX}START_TIMEOUT_S"
CHECKPOINT_EVERY_ENV = f"{ENV_PREFIX}CHECKPOINT_EVERY_N_STEPS"
CHECKPOINT_DIR_ENV = f"{ENV_PREFIX}CHECKPOINT_DIR"
NUM_INSTANCES_ENV = f"{ENV_PREFIX}NUM_INSTANCES"
# replication.shrink: with no spare, the job may go on with its whole optimizer instances (the strategy checks at
# start-up that it can serve a dropped rank's samples); and how long a fault then waits for a spare that is starting.
SHRINK_ENV = f"{ENV_PREFIX}SHRINK"
# integrity.every_n_steps, integrity.fence_after: the cross-replica check (`restart.integrity`)
INTEGRITY_EVERY_ENV = f"{ENV_PREFIX}INTEGRITY_EVERY_N_STEPS"
VERBOSE_ENV = f"{ENV_PREFIX}VERBOSE"  # launcher.verbose: "1" shows the ranks' DEBUG lines (`restart.logs`)
INTEGRITY_FENCE_ENV = f"{ENV_PREFIX}INTEGRITY_FENCE_AFTER"
NAN_POLICY_ENV = f"{ENV_PREFIX}INTEGRITY_NAN_POLICY"  # integrity.nan_policy
REPLACEMENT_TIMEOUT_ENV = f"{ENV_PREFIX}REPLACEMENT_TIMEOUT_S"
CACHE_ROOT_ENV = f"{ENV_PREFIX}CACHE_ROOT"  # where the job's shared-memory batch cache lives (default /dev/shm)
FAULT_PLAN_ENV = f"{ENV_PREFIX}FAULT_PLAN"  # JSON list of {kind, rank, step}: test and benchmark faults
# The training collectives' plane (`restart.groups`): unset, CUDA tensors go over NCCL and CPU tensors over gloo;
# "gloo" (tests on CPU machines) sends every all-reduce, all-gather and broadcast over a second gloo group per
# generation, waited, aborted and released as the NCCL one is.
DEVICE_PLANE_ENV = f"{ENV_PREFIX}DEVICE_PLANE"
# The recipe's model-parallel layout, set by `checkpointless-train recipe=NAME script=...` only (not by
# checkpointless-run): a `CheckpointlessMegatronStrategy` built without a size takes it from here, one built with a
# different size stops with a ConfigError. (variable, recipe key, MegatronStrategy argument) per size.
TP_ENV = f"{ENV_PREFIX}TENSOR_MODEL_PARALLEL_SIZE"
PP_ENV = f"{ENV_PREFIX}PIPELINE_MODEL_PARALLEL_SIZE"
CP_ENV = f"{ENV_PREFIX}CONTEXT_PARALLEL_SIZE"
LAYOUT_ENV = ((TP_ENV, "parallel.tp", "tensor_model_parallel_size"),
              (PP_ENV, "parallel.pp", "pipeline_model_parallel_size"),
              (CP_ENV, "parallel.cp", "context_parallel_size"))

# What rank 0's callback writes in the run directory at the end (both engines); the launcher merges it into
# summary.json.
WORKER_SUMMARY = "worker_summary.json"

# ------------------------------------------------------------------------------------------------ store keys
TRAIN_START_KEY = "job/train_start"  # set by rank 0 when it starts its first training step
GENERATION_KEY = "job/generation"  # the launcher's current generation (set when it publishes one)
FAULT_KEY = "job/fault_generation"  # the generation the launcher declared failed most recently
STEP_TIMES_KEY = "job/step_times"  # rank 0 appends "<step> <unix time>;" as each step completes
JOB_ID_KEY = "job/data_cache_id"  # the job id that names the shared-memory batch cache
# Set by the launcher while the job is shrunk and a spare is ready for every missing rank: the ranks of the
# shrunk world agree (in their gradient all-reduce) on the step after which they grow back.
GROW_KEY = "job/grow"
# Set by the ranks that stop the job on purpose (JSON: rank, message, exit_code): a non-finite gradient that
# reproduces under integrity.nan_policy=stop, a restore that failed its verification twice in a row. The launcher
# ends the job with that message and exit code instead of replacing the ranks that left.
STOP_KEY = "job/stop"
# The integrity records so far (JSON list), written by the ranks when they make one (`restart.integrity`).
INTEGRITY_RECORDS_KEY = "job/integrity/records"
# The exit status of a rank that must go back to the seeded initial state (a fallback or a rollback to step 0: no
# checkpoint) and cannot rebuild it in its own process (the Lightning engine: the user's script built the model
# before `fit`). The launcher restarts the whole job for that fault (`launcher.on_failure=restart_all` once).
RESTART_ALL_EXIT_CODE = 4


def local_addr(store_host: str) -> str:
    """The address this rank's gloo sockets bind to: its node's (`LOCAL_ADDR_ENV`), else the store's host."""
    return os.environ.get(LOCAL_ADDR_ENV) or store_host


def generation_info_key(generation: int) -> str:
    """The launcher's `GenerationInfo` of `generation`, as JSON."""
    return f"job/gen/{generation}"


def record_key(generation: int, rank: int) -> str:
    """A rank's record of the recovery that moved it to `generation` (and `/first_step`, `/caught_up` stamps)."""
    return f"job/recovery/{generation}/{rank}"


def fault_ranks_key(generation: int) -> str:
    """Set by the launcher just before it declares `generation` failed (`FAULT_KEY`): the ranks it found failed, a
    JSON list (absent when it declares a hang before it knows the hung rank)."""
    return f"job/fault/{generation}/ranks"


def hang_key(generation: int) -> str:
    """Set by a rank whose collective of `generation` timed out: asks the launcher to find the hung rank."""
    return f"job/hang/{generation}"


def group_prefix(generation: int, name: str, ranks: Sequence[int]) -> str:
    """The store keys of one of the package's process groups (`restart.groups.Group`) in `generation`."""
    return f"gen{generation}/{name}/{','.join(map(str, ranks))}"


def default_group_prefix(generation: int, fits: int) -> str:
    """The store keys of the NeMo door's default group (and megatron's groups made from it) for the `fits`-th fit
    entered in `generation` (0: the first; a later one after the replicas' vote re-entered `fit`)."""
    return f"nemo/gen{generation}/" if not fits else f"nemo/gen{generation}.{fits}/"


_GROUP_KEY = re.compile(r"(?:nemo/)?gen(\d+)[./]")


def group_generation(key: str) -> int | None:
    """The generation whose process groups a store key belongs to (`group_prefix`, `default_group_prefix`); None:
    the key is not a group's."""
    match = _GROUP_KEY.match(key)
    return int(match.group(1)) if match else None


def alive_key(generation: int, rank: int) -> str:
    """Set by every rank that reaches recovery from `generation`: the ranks that never set it are the hung ones."""
    return f"job/alive/{generation}/{rank}"


def regroup_key(generation: int) -> str:
    """Set by the ranks of a shrunk `generation` once they have agreed to grow back and left `fit` at a step
    boundary: the launcher publishes the next generation, the full world, with the missing ranks given spares."""
    return f"job/regroup/{generation}"


def injected_key(index: int) -> str:
    """Set by the rank that fires fault `index` of the fault plan (JSON: t, kind, rank, step)."""
    return f"job/fault/{index}/injected"


def corrupt_restore_key(rank: int) -> str:
    """Fault plan kind `corrupt_restore`: how many of the next states rank `rank` restores (from a peer or the
    checkpoint) are damaged after their checksum passed. In the store, so that the replacement of the rank, a new
    process, is the one that damages what it receives."""
    return f"job/fault/corrupt_restore/{rank}"


def samples_key(step: int, rank: int) -> str:
    """What rank `rank` trained on in step `step` (JSON: sample ids per micro-batch), set when its gradient was not
    finite twice on the same batch (`restart.integrity.NanGuard`)."""
    return f"job/integrity/samples/{step}/{rank}"


def training_key(pid: int) -> str:
    """Set by a worker process when it starts its first training step."""
    return f"job/training/{pid}"


def finished_key(pid: int) -> str:
    """Set by a worker process once its training has ended and its results are written (the callbacks'
    `on_train_end`): a death after it (a kill while the interpreter exits) loses nothing, and the launcher counts
    the rank as finished."""
    return f"job/finished/{pid}"


def checkpointless_key(pid: int) -> str:
    """Set by a worker process whose training recovers in process (it runs `CheckpointlessStrategy`); the launcher
    replaces such a rank alone, and restarts every rank of a job whose processes never said so (tier 1)."""
    return f"job/checkpointless/{pid}"


def spare_assign_key(spare_id: int) -> str:
    """The launcher's `Assignment` of spare `spare_id`, as JSON."""
    return f"job/spare/{spare_id}/assign"


def spare_ready_key(spare_id: int) -> str:
    return f"job/spare/{spare_id}/ready"


# --------------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Assignment:
    """What the launcher tells a hot spare: the rank it becomes and the generation it joins."""

    rank: int
    generation: int

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "generation": self.generation})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Assignment:
        data = json.loads(raw)
        return cls(int(data["rank"]), int(data["generation"]))


@dataclass(frozen=True)
class GenerationInfo:
    """What the launcher publishes with a generation: the ranks it replaced, when the fault was seen, the step
    the fault interrupted when it knows it (ranks stamp when they are back there), and the ranks that train in it
    (`active`: None for the whole world; a shrunk world's ranks otherwise, see `topology.shrink`)."""

    failed: list[int]
    fault_t: float
    target_step: int | None = None
    active: list[int] | None = None

    def to_json(self) -> str:
        return json.dumps({"failed": self.failed, "fault_t": self.fault_t, "target_step": self.target_step,
                           "active": self.active})

    @classmethod
    def from_json(cls, raw: str | bytes) -> GenerationInfo:
        data = json.loads(raw)
        active = data.get("active")
        return cls(list(data["failed"]), float(data["fault_t"]), data.get("target_step"),
                   None if active is None else [int(r) for r in active])


_TRAINING: list[int] = []  # this process's pid once it has said that it trains


def mark_process_training(store: Any) -> bool:
    """Called by a worker before every training step; says once per process that it trains (`training_key`).
    True on that first call only."""
    if _TRAINING:
        return False
    _TRAINING.append(os.getpid())
    store.set(training_key(os.getpid()), "1")
    return True


def wait_for_assignment(store: Any, spare_id: int) -> Assignment:
    """A spare's wait for the launcher to hand it a rank (and the generation it joins). A spare whose launcher is
    gone (it was re-parented, or the store stopped answering) exits instead of waiting for ever."""
    key = spare_assign_key(spare_id)
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=60))  # blocks in the store server: no polling load
            return Assignment.from_json(store.get(key))
        except RuntimeError as e:  # a timeout (a spare may wait for hours), or the store is gone
            if (launcher and os.getppid() != launcher) or "timeout" not in str(e).lower():
                raise SystemExit(f"spare {spare_id}: the launcher is gone ({e}); exiting") from None


def write_worker_summary(run_dir: str | os.PathLike[str], summary: dict[str, Any]) -> None:
    """RUN_DIR/worker_summary.json, whole or not at all (written beside it, then renamed)."""
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{WORKER_SUMMARY}.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(directory / WORKER_SUMMARY)
