"""The launcher's progress watchdog: a hung rank found from outside it, in seconds, not after collective timeouts.

Every `poll_s` the launcher reads each live rank's progress beacon (`restart.progress`: step and phase, written by
the rank's training thread) and, from /proc, its scheduler state and CPU time. A rank is a suspect once its beacon
has not moved for the deadline. A data-parallel job cannot go on without any of its ranks, so when one hangs
every rank's beacon stops; the watchdog tells the hung rank from those waiting for it:

- **stopped**: its state is `T` (SIGSTOP, a debugger): hung;
- **busy without progress**: it used at least `busy_fraction` of a core since its beacon last moved (spinning in
  native code, a Python loop) while another rank waits, idle: hung. Ranks waiting in a gloo collective use no CPU;
  when every rank is busy (a long step) nobody is blamed;
- **behind, idle**: it is idle at an earlier (step, phase) than another rank that is itself stalled (waiting for
  it): hung. This catches a rank that never enters the collective the others wait in (a sleep, a lock, I/O).

A rank idle at the same place as the others is a waiter, never blamed: when every rank waits in the same
collective (a lost peer process the kernel has not reported, a network stall), the collective timeout and the
check-in round of `_Job.watch_hangs` stay the detector. A rank writing the persistent checkpoint (phase
`CHECKPOINT`) is never blamed. Nothing is watched before the rank has completed a step in the current generation,
so start-up, compilation, the join of a replacement and the first step after a recovery have no deadline here.

The deadline: `launcher.hang_deadline_s` when > 0; when 0 (the default) `max(floor_s, factor x p95)` of the last
256 step times seen (from the beacons: time per step of each rank between two reads, from its second step in a
generation on; with few, p95 is their maximum), `floor_s` before any; negative: off. So a slow step is not mistaken
for a hang unless it takes `factor` times the slow steps seen so far. A fixed deadline shorter than a step the job
took is said once (the key, the step, the fix) and raised to twice that step, so no healthy rank is killed for it.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nemo_checkpointless.launcher.procs import proc_state
from nemo_checkpointless.restart.progress import CHECKPOINT, Beacon, beacon_path, read_beacon

# What the watchdog reads of one rank (rank, pid) -> (its beacon, its (state letter, CPU seconds)); either None
# when unreadable. On one machine: its beacon file and /proc (`local_reader`); across nodes, what each node's agent
# reports to the leader (`launcher.nodes`).
Reader = Callable[[int, int], tuple[Beacon | None, tuple[str, float] | None]]


def local_reader(run_dir: str | os.PathLike[str]) -> Reader:
    def read(rank: int, pid: int) -> tuple[Beacon | None, tuple[str, float] | None]:
        return read_beacon(beacon_path(run_dir, rank)), proc_state(pid)

    return read


@dataclass
class _Seen:
    pid: int
    beacon: Beacon | None
    changed: float  # launcher's monotonic clock when the beacon last moved
    cpu: float  # the process's CPU seconds then
    state: tuple[str, float] | None = None  # (state letter, CPU seconds) at the last read; None: unreadable
    first_step: int | None = None  # the beacon's step when first read in this generation
    armed: bool = False  # has completed a step in this generation


class HangWatch:
    """Finds hung ranks (`check`); the launcher kills them, which makes the hang an ordinary failure."""

    def __init__(self, run_dir: str | os.PathLike[str], deadline_s: float = 0.0, floor_s: float = 5.0,
                 factor: float = 10.0, busy_fraction: float = 0.8, poll_s: float = 0.1,
                 reader: Reader | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.read = reader or local_reader(run_dir)
        self.fixed, self.floor_s, self.factor = deadline_s, floor_s, factor
        self.busy_fraction, self.poll_s = busy_fraction, poll_s
        self.step_times: deque[float] = deque(maxlen=256)
        self._seen: dict[int, _Seen] = {}
        self._rate: dict[int, tuple[int, float]] = {}  # rank -> (step, wall time) of its last beacon read
        self._next = 0.0

    @property
    def enabled(self) -> bool:
        return self.fixed >= 0

    def deadline(self) -> float:
        if self.fixed > 0:
            return self.fixed
        if not self.step_times:
            return self.floor_s
        ordered = sorted(self.step_times)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return max(self.floor_s, self.factor * p95)

    def _check_fixed(self) -> None:
        """A fixed deadline shorter than a step seen: said once, and raised to twice that step."""
        longest = max(self.step_times, default=0.0)
        if 0 < self.fixed < longest:
            print(f"checkpointless: launcher.hang_deadline_s={self.fixed:g}: shorter than a step this job took "
                  f"({longest:.1f} s), so a healthy rank in such a step could be declared hung; using "
                  f"{2 * longest:.1f} s. Set it above the longest step, or to 0 (follows the step times)",
                  file=sys.stderr, flush=True)
            self.fixed = 2 * longest

    def reset(self) -> None:
        """A new generation: every rank is unwatched until it completes a step in it."""
        self._seen.clear()
        self._rate.clear()

    def _observe(self, rank: int, pid: int, now: float) -> _Seen | None:
        beacon, state = self.read(rank, pid)
        cpu = state[1] if state else 0.0
        seen = self._seen.get(rank)
        if beacon is not None and beacon.pid != pid:
            beacon = None  # the file of the process this one replaces: nothing of this process yet
        if seen is None or seen.pid != pid:
            seen = self._seen[rank] = _Seen(pid, beacon, now, cpu, state=state,
                                            first_step=beacon.step if beacon else None)
            return seen
        seen.state = state
        if beacon is not None and (seen.beacon is None or beacon.seq != seen.beacon.seq):
            if seen.first_step is None:
                seen.first_step = beacon.step
            elif beacon.step > seen.first_step:
                seen.armed = True
            if seen.armed:  # step times from the second step on: the first (warm-up, compilation) has its own
                last = self._rate.get(rank)
                if last is not None and beacon.step > last[0]:
                    self.step_times.append((beacon.t - last[1]) / (beacon.step - last[0]))
                if last is None or beacon.step > last[0]:
                    self._rate[rank] = (beacon.step, beacon.t)
            seen.beacon, seen.changed, seen.cpu = beacon, now, cpu
        return seen

    def check(self, live: dict[int, int]) -> list[tuple[int, str]]:
        """`live`: rank -> pid of the processes training now. Returns the hung ranks, each with why."""
        now = time.monotonic()
        if not self.enabled or now < self._next:
            return []
        self._next = now + self.poll_s
        seen = {r: s for r, pid in live.items() if (s := self._observe(r, pid, now)) is not None}
        self._check_fixed()
        deadline = self.deadline()
        stalled = {r: s for r, s in seen.items()
                   if s.armed and s.beacon is not None and now - s.changed > deadline and s.beacon.phase != CHECKPOINT}
        # For each stalled rank still there: its beacon, its state letter and whether it was busy since it stalled.
        how: dict[int, tuple[Beacon, str, float]] = {}
        for r, s in stalled.items():
            if s.state is not None and s.beacon is not None:
                how[r] = (s.beacon, s.state[0], s.state[1] - s.cpu)
        busy = {r for r, (_, _, cpu) in how.items() if cpu >= self.busy_fraction * (now - stalled[r].changed)}
        waiting = [r for r, (_, letter, _) in how.items() if letter not in ("T", "t") and r not in busy]
        hung = []
        for r, (beacon, letter, cpu) in how.items():
            idle, where = now - stalled[r].changed, beacon.describe()
            if letter in ("T", "t"):
                hung.append((r, f"stopped (state {letter}) at {where} for {idle:.1f} s"))
            elif r in busy:
                if any(q != r for q in waiting):  # someone waits for it (all busy: a long step)
                    hung.append((r, f"busy without progress at {where} for {idle:.1f} s ({cpu:.1f} s of CPU)"))
            else:
                ahead = [q for q in waiting if q != r and how[q][0].where > beacon.where]
                if ahead:
                    hung.append((r, f"idle at {where} for {idle:.1f} s while rank {ahead[0]} waits at "
                                    f"{how[ahead[0]][0].describe()}"))
        return hung
