"""A rank's progress beacon: where in its step the training thread is, readable by the launcher without the rank.

Each rank's training thread writes `(seq, step, phase, pid, t, busy_step, busy_s)` into a 48-byte file of its own,
`RUN_DIR/progress/rank<r>.bin` (mode 0600), mapped into memory: a store of a few words per phase, no system call,
no lock, no thread. The launcher reads the file (`read_beacon`) on its own; a rank that is SIGSTOPped, spins in
native code, holds its GIL, or waits somewhere no collective is stops writing, and the launcher's watchdog
(`launcher.watchdog.HangWatch`) sees it. `seq` is written last and grows with every mark; a reader takes a record
it read twice alike.

Phases, in the order a step goes through them on both engines: `STEP_START` (the callback's batch start: the
batch is drawn), `OPTIMIZER` (the strategy's optimizer step begins; Lightning runs the closure, forward and
backward, inside it), `FORWARD` (`training_step` begins), `BACKWARD_DONE` (`training_step` returned; on NeMo
megatron's schedule ran the backward inside it), `GRAD_SYNC` (Lightning: the closure returned, the gradient
reduction begins), `STEP_DONE` (the optimizer step returned), `BATCH_END` (the callback's batch end).
`CHECKPOINT` marks a rank writing the persistent checkpoint (long and legitimate: the watchdog exempts it).

`busy_s` is the time the rank's step `busy_step` took from `STEP_START` to `GRAD_SYNC`, less the time it waited in
collectives of the user's code on the way (`waited`): its own work before it waits for the others in the gradient
reduction (the launcher's straggler report, `launcher.stragglers`). In a
synchronous step every rank's whole step takes as long as the slowest one's; this part does not. On the NeMo
engine megatron's schedule reduces the gradients at the end of `training_step`; the strategy marks `GRAD_SYNC` as
megatron's DDP begins it (`finish_grad_sync`).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

_FORMAT = struct.Struct("<QqiIdqd")  # seq, step, phase, pid, wall time, busy step, busy seconds
SIZE = 48

STEP_START, OPTIMIZER, FORWARD, BACKWARD_DONE, GRAD_SYNC, STEP_DONE, BATCH_END, CHECKPOINT = range(1, 9)
PHASE_NAMES = {STEP_START: "step start", OPTIMIZER: "optimizer step", FORWARD: "training_step",
               BACKWARD_DONE: "training_step returned", GRAD_SYNC: "gradient reduction",
               STEP_DONE: "optimizer step done", BATCH_END: "batch end", CHECKPOINT: "writing the checkpoint"}


def beacon_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / "progress" / f"rank{rank}.bin"


@dataclass(frozen=True)
class Beacon:
    seq: int
    step: int
    phase: int
    pid: int
    t: float
    busy_step: int = 0  # the last step that reached its gradient reduction (0: none yet)
    busy_s: float = 0.0  # its time from step start to the reduction

    @property
    def where(self) -> tuple[int, int]:
        """How far the rank got: (step, phase), comparable between ranks (CHECKPOINT sorts with STEP_START)."""
        return self.step, STEP_START if self.phase == CHECKPOINT else self.phase

    def describe(self) -> str:
        return f"step {self.step}, {PHASE_NAMES.get(self.phase, f'phase {self.phase}')}"


class ProgressBeacon:
    """The writer: `mark(step, phase)` from the training thread. Never raises after construction; a beacon that
    could not be created is a no-op (the collective timeout then stays the only hang detector)."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self._map: mmap.mmap | None = None
        self._seq = 0
        self.step = 0  # the step of the last mark (the rank's log lines name it)
        self._pid = os.getpid()
        self._started = (0, 0.0)  # (step, wall time) of the last STEP_START
        self._busy = (0, 0.0)  # (step, seconds) of the last step that reached GRAD_SYNC
        self._waited = 0.0  # seconds of this step spent in collectives of the user's code (`waited`)
        path = beacon_path(run_dir, rank)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{self._pid}.tmp")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, SIZE)
                self._map = mmap.mmap(fd, SIZE)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # a replacement of this rank takes the file over whole
        except OSError:
            self._map = None

    def mark(self, step: int, phase: int) -> None:
        self.step = step
        m = self._map
        if m is None:
            return
        self._seq += 1
        now = time.time()
        if phase == STEP_START:
            self._started, self._waited = (step, now), 0.0
        elif phase == GRAD_SYNC and self._started[0] == step:
            self._busy = (step, max(0.0, now - self._started[1] - self._waited))
        # seq last: a reader never takes a half-written record for a new one.
        m[8:SIZE] = _FORMAT.pack(0, step, phase, self._pid, now, *self._busy)[8:]
        m[0:8] = self._seq.to_bytes(8, "little")

    def waited(self, seconds: float) -> None:
        """Time this step spent waiting in a collective of its own (`self.log(sync_dist=True)`): not its work, so
        not `busy_s` (the fast ranks wait there for the slow one)."""
        self._waited += seconds

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def parse_beacon(raw: bytes) -> Beacon | None:
    """One record's bytes (what `read_beacon` read; an agent of several nodes sends them to the leader)."""
    if len(raw) != SIZE:
        return None
    seq, step, phase, pid, t, busy_step, busy_s = _FORMAT.unpack(raw)
    return Beacon(seq, step, phase, pid, t, busy_step, busy_s) if seq else None


def read_beacon_bytes(path: str | os.PathLike[str]) -> bytes | None:
    """The last whole record of a beacon file, as bytes; None if there is none (yet) or it is unreadable."""
    try:
        with open(path, "rb") as f:
            for _ in range(3):
                first = f.read(SIZE)
                f.seek(0)
                second = f.read(SIZE)
                f.seek(0)
                if len(first) == SIZE and first == second:
                    return second
    except OSError:
        return None
    return None


def read_beacon(path: str | os.PathLike[str]) -> Beacon | None:
    """The last whole record of a beacon file; None if there is none (yet) or it is unreadable."""
    raw = read_beacon_bytes(path)
    return parse_beacon(raw) if raw is not None else None
