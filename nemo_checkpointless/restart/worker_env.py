"""What the launcher tells a worker through its environment, and the worker's connection to the job's store."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from nemo_checkpointless.protocol import ENV_PREFIX, LAUNCHER_PID_ENV, SPARE_ID_ENV, local_addr
from nemo_checkpointless.restart.groups import Membership, connect_store

__all__ = ["ENV_PREFIX", "LAUNCHER_PID_ENV", "SPARE_ID_ENV", "WorkerEnv", "die_by_signal", "freeze_heap", "preload",
           "run_worker"]

_HEAP_FROZEN_BY = 0  # the process that froze its heap (a fork freezes its own once more)


def freeze_heap() -> None:
    """Once per process (a spare forked from a frozen template freezes what it built since): collect, then keep
    every object that exists now (the imports, the user's model, trainer and loaders, built before `fit`) out of
    every later collection. Python's full collection walks the whole heap: 0.15 s on a training rank's here
    (measured), a stall at a random step, more likely after a recovery (its garbage pushes the collector past its
    threshold) and on a rank started for it (a whole heap of imports, never collected). A collection then walks
    only what was made since; a spare forked from a template also stops copying the template's pages by touching
    their objects."""
    global _HEAP_FROZEN_BY
    if os.getpid() == _HEAP_FROZEN_BY:
        return
    gc.collect()
    gc.freeze()
    _HEAP_FROZEN_BY = os.getpid()


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world_size: int
    local_rank: int
    store_host: str
    store_port: int
    run_dir: str

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        env = os.environ
        try:
            return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env["LOCAL_RANK"]),
                       store_host=env[f"{ENV_PREFIX}STORE_HOST"], store_port=int(env[f"{ENV_PREFIX}STORE_PORT"]),
                       run_dir=env[f"{ENV_PREFIX}RUN_DIR"])
        except KeyError as e:
            raise RuntimeError(f"worker started without {e.args[0]} in its environment: start workers with "
                               "checkpointless-train (the launcher), not directly") from e

    def to_environ(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                f"{ENV_PREFIX}STORE_HOST": self.store_host, f"{ENV_PREFIX}STORE_PORT": str(self.store_port),
                f"{ENV_PREFIX}RUN_DIR": self.run_dir}

    def membership(self, timeout_s: float) -> Membership:
        store = connect_store(self.store_host, self.store_port, timeout_s)
        return Membership(store, self.rank, self.world_size, local_addr(self.store_host), timeout_s)


def preload(cfg: Any) -> None:
    """Import the modules of `launcher.preload` (calling `install()` where a module has one): before a worker
    builds anything, and for engine=nemo before NeMo and megatron-core are imported."""
    from nemo_checkpointless.restart.script_runner import already_installed

    for name in cfg.launcher.preload:
        if already_installed(name):  # by the rank template this process was forked from
            continue
        module = importlib.import_module(name)
        install = getattr(module, "install", None)
        if callable(install):
            install()


def die_by_signal(signum: Any) -> None:
    """A rank told to stop from outside (e.g. SIGTERM, which Lightning's launcher hook receives) is a fault to
    recover, like a crash: die by the signal now, its default action, rather than stop at the next step and then
    hang in interpreter teardown, joining gloo threads of a collective the others are still in."""
    import signal

    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def run_worker(body: Callable[[], None]) -> NoReturn:
    """A worker process's `main`: run `body`; a failure's traceback goes to the rank's log and the exit code to the
    launcher. Leaves with `os._exit`, skipping interpreter teardown: retired or abandoned gloo groups would join
    threads stuck in a dead collective."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    code = 0
    try:
        body()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
