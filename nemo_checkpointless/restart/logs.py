"""What a training rank says: one logger, `nemo_checkpointless`, and every line it writes prefixed with the rank,
the generation it is in and the step it is at (`[rank 2 gen 1 step 41] recovered p2p at step 40 in 0.21 s`), to
the rank's stdout (the launcher sends rank 0's to the terminal and every other rank's to `RUN_DIR/logs`).

Quiet by default. At INFO and above, what a user must know, once per event: a fault injected, a rank that left
`fit` recovered and how, an integrity verdict, a stop. At DEBUG, what explains a recovery's time (a re-entered
fit's set-up, where a replacement's first batch came from), shown with `launcher.verbose=true`
(`checkpointless-run --verbose`). Nothing is written per step.

Every module of the package logs through a child of this logger (`logging.getLogger(__name__)`); `bind` is called
once a process knows its rank (`restart.session.Session`) and installs the handler. A process that never binds
(a unit test, a tool) leaves the logger to Python's defaults.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

from nemo_checkpointless.protocol import VERBOSE_ENV

LOGGER = "nemo_checkpointless"


class _Where(logging.Filter):
    """Adds `where` to each record: `[rank R gen G step S] ` from the bound rank's live values."""

    def __init__(self) -> None:
        super().__init__()
        self.rank: int | None = None
        self.generation: Callable[[], int] | None = None
        self.step: Callable[[], int] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        parts = [f"rank {self.rank}"] if self.rank is not None else []
        if self.generation is not None:
            parts.append(f"gen {self.generation()}")
        if self.step is not None:
            parts.append(f"step {self.step()}")
        record.where = f"[{' '.join(parts)}] " if parts else ""
        return True


_WHERE = _Where()
_HANDLER: logging.Handler | None = None


def bind(rank: int, generation: Callable[[], int] | None = None, step: Callable[[], int] | None = None) -> None:
    """This process is rank `rank` (again, for a spare that took a rank): every line names it, and its generation
    and step as the callables give them when the line is written. Installs the handler once per process, at the
    level `launcher.verbose` asks for (the launcher passes it in `VERBOSE_ENV`)."""
    global _HANDLER
    _WHERE.rank, _WHERE.generation, _WHERE.step = rank, generation, step
    logger = logging.getLogger(LOGGER)
    if _HANDLER is None:
        _HANDLER = logging.StreamHandler(sys.stdout)
        _HANDLER.setFormatter(logging.Formatter("%(where)s%(message)s"))
        _HANDLER.addFilter(_WHERE)
        logger.addHandler(_HANDLER)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if os.environ.get(VERBOSE_ENV) == "1" else logging.INFO)


__all__ = ["LOGGER", "bind"]
