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
from typing import Any

ENV_PREFIX = "NCL_"
STORE_HOST_ENV = f"{ENV_PREFIX}STORE_HOST"
STORE_PORT_ENV = f"{ENV_PREFIX}STORE_PORT"
RUN_DIR_ENV = f"{ENV_PREFIX}RUN_DIR"
SPARE_ID_ENV = f"{ENV_PREFIX}SPARE_ID"  # set for a hot spare instead of RANK
LAUNCHER_PID_ENV = f"{ENV_PREFIX}LAUNCHER_PID"  # a spare exits when its launcher is gone
JOIN_GENERATION_ENV = f"{ENV_PREFIX}JOIN_GENERATION"  # a cold replacement joins this generation
RESTART_GENERATION_ENV = f"{ENV_PREFIX}RESTART_GENERATION"  # a whole-job restart: reload the newest checkpoint
# The job's settings for a user's script (checkpointless-run's flags); CheckpointlessStrategy's arguments win.
COLLECTIVE_TIMEOUT_ENV = f"{ENV_PREFIX}COLLECTIVE_TIMEOUT_S"
START_TIMEOUT_ENV = f"{ENV_PREFIX}START_TIMEOUT_S"
CHECKPOINT_EVERY_ENV = f"{ENV_PREFIX}CHECKPOINT_EVERY_N_STEPS"
CHECKPOINT_DIR_ENV = f"{ENV_PREFIX}CHECKPOINT_DIR"
NUM_INSTANCES_ENV = f"{ENV_PREFIX}NUM_INSTANCES"
CACHE_ROOT_ENV = f"{ENV_PREFIX}CACHE_ROOT"  # where the job's shared-memory batch cache lives (default /dev/shm)
FAULT_PLAN_ENV = f"{ENV_PREFIX}FAULT_PLAN"  # JSON list of {kind, rank, step}: test and benchmark faults

TRAIN_START_KEY = "job/train_start"  # set by rank 0 when it starts its first training step


def training_key(pid: int) -> str:
    """Set by a worker process when it starts its first training step."""
    return f"job/training/{pid}"


def checkpointless_key(pid: int) -> str:
    """Set by a worker process whose training recovers in process (it runs `CheckpointlessStrategy`); the launcher
    replaces such a rank alone, and restarts every rank of a job whose processes never said so (tier 1)."""
    return f"job/checkpointless/{pid}"


def spare_assign_key(spare_id: int) -> str:
    return f"job/spare/{spare_id}/assign"


def spare_ready_key(spare_id: int) -> str:
    return f"job/spare/{spare_id}/ready"


_TRAINING: list[int] = []  # this process's pid once it has said that it trains


def mark_process_training(store: Any) -> bool:
    """Called by a worker before every training step; says once per process that it trains (`training_key`).
    True on that first call only."""
    if _TRAINING:
        return False
    _TRAINING.append(os.getpid())
    store.set(training_key(os.getpid()), "1")
    return True


def wait_for_assignment(store: Any, spare_id: int) -> dict[str, int]:
    """A spare's wait for the launcher to hand it a rank: {"rank": r, "generation": g}. A spare whose launcher is
    gone (it was re-parented, or the store stopped answering) exits instead of waiting for ever."""
    key = spare_assign_key(spare_id)
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=60))  # blocks in the store server: no polling load
            return dict(json.loads(store.get(key)))
        except RuntimeError as e:  # a timeout (a spare may wait for hours), or the store is gone
            if (launcher and os.getppid() != launcher) or "timeout" not in str(e).lower():
                raise SystemExit(f"spare {spare_id}: the launcher is gone ({e}); exiting") from None
