"""The Lightning door's launcher: `trainer.fit` in this process, entered again when the world changes.

Lightning calls a strategy's launcher to run `fit`; `CheckpointlessStrategy`'s runs it in the process the package's
launcher started, and enters it again, in the same process, when the recovery cannot stay inside the step: a
fallback to the persistent checkpoint, the world reshaped (shrunk to the whole optimizer instances, or grown back),
or a rank parked out of a shrunk world until the job grows back. A hot spare waits here (`ensure_session`) for the
rank it replaces.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from typing_extensions import override

from nemo_checkpointless import protocol
from nemo_checkpointless.replication.participant import ShardedParticipant
from nemo_checkpointless.restart.recovery import Parked, Reshape, RestartFromCheckpoint
from nemo_checkpointless.restart.session import JoinSpec, Session
from nemo_checkpointless.restart.worker_env import die_by_signal, freeze_heap

log = logging.getLogger(__name__)


class LightningDoor(Protocol):
    """What the launcher uses of the strategy it runs `fit` for (`lightning.strategy.CheckpointlessStrategy`, which
    imports this module): named here, so that nothing here imports the strategy."""

    join: JoinSpec

    @property
    def session(self) -> Session: ...

    @property
    def participant(self) -> ShardedParticipant: ...

    def ensure_session(self) -> None: ...

    def keep_own_state(self) -> None: ...


class Regroup(Exception):  # a control-flow signal
    """The shrunk world agreed to grow back after the step this rank just completed: leave `fit` at the boundary."""


class InProcessLauncher(_Launcher):
    """`trainer.fit` in this process. A hot spare waits here for the rank it replaces; a fallback to the persistent
    checkpoint (`RestartFromCheckpoint`) leaves the fit loop and enters it again here, in the same process; so does
    a change of the world's shape (`Reshape`: shrunk to the whole optimizer instances, or grown back), with this
    rank's own state; a rank left out of a shrunk world (`Parked`) waits here until the job grows back."""

    def __init__(self, strategy: LightningDoor) -> None:
        self.strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    def kill(self, signum: Any) -> None:
        """Lightning calls this when the process gets SIGTERM: `die_by_signal`."""
        die_by_signal(signum)

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: pl.Trainer | None = None,
               **kwargs: Any) -> Any:
        strategy = self.strategy
        freeze_heap()  # once per process: what the script built before fit stays out of later collections
        strategy.ensure_session()
        while True:
            try:
                return function(*args, **kwargs)
            except RestartFromCheckpoint as restart:
                log.warning(f"{restart}")
                if restart.decision.step == 0:
                    # No checkpoint: back to the seeded initial state, which only the user's script builds (before
                    # `fit`): the job starts again, every process of it.
                    log.warning("no checkpoint to go back to: the job restarts from the start")
                    os._exit(protocol.RESTART_ALL_EXIT_CODE)
                strategy.join = JoinSpec("checkpoint" if restart.recovery else "rollback", restart.generation,
                                         restart.decision.step)
            except Regroup:
                strategy.keep_own_state()
                try:  # raises Reshape once the world is whole again
                    strategy.session.engine.regroup(strategy.participant)
                except Reshape as reshape:
                    log.info(f"grown back: {reshape}")
                    strategy.join = JoinSpec("kept", reshape.generation, reshape.decision.step)
                except RestartFromCheckpoint as restart:
                    log.warning(f"{restart}")
                    if restart.decision.step == 0:
                        log.warning("no checkpoint to go back to: the job restarts from the start")
                        os._exit(protocol.RESTART_ALL_EXIT_CODE)
                    strategy.join = JoinSpec("checkpoint", restart.generation, restart.decision.step)
            except Reshape as reshape:
                log.info(f"{reshape}")
                strategy.keep_own_state()
                strategy.join = JoinSpec("kept", reshape.generation, reshape.decision.step)
            except Parked as parked:
                log.info(f"{parked}")
                assert trainer is not None
                trainer._teardown()
                strategy.join = JoinSpec("replacement", strategy.session.engine.wait_to_rejoin())
                log.info(f"rejoins at generation {strategy.join.generation}")
                trainer.fit_loop._combined_loader = None
                continue
            assert trainer is not None
            trainer._teardown()
            # The next fit processes the user's train loader again (a fresh iterator at the new position).
            trainer.fit_loop._combined_loader = None
