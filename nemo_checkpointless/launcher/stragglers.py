"""Stragglers: a rank persistently slower than the others is reported, never failed.

In a synchronous data-parallel step every rank's whole step takes as long as the slowest rank's, so the step
time cannot tell who is slow. What can is each rank's own work before it waits: the time from its step's start to
its gradient reduction (`busy_s` of its progress beacon, `restart.progress`). Every `poll_s` the launcher reads the
beacons; each new `busy_s` joins its rank's last `window` samples. A rank whose median of those is at least
`factor` times the median of the other ranks' medians is a straggler: reported once, when it starts (the log and
`summary.json`: rank, factor, first and last step), and its episode ends when it is back under the factor. Nothing
is killed: a slow rank still trains correctly, and replacing it would cost more than it slows the job (a slow
machine, thermal throttling, a noisy neighbour). `launcher.straggler_factor` (default 1.5; 0: off) and
`launcher.straggler_window` (default 20 samples).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nemo_checkpointless.restart.progress import Beacon, beacon_path, read_beacon


@dataclass
class Episode:
    rank: int
    factor: float  # the highest median ratio seen in the episode
    first_step: int
    last_step: int


@dataclass
class StragglerWatch:
    run_dir: Path
    factor: float = 1.5
    window: int = 20
    poll_s: float = 0.1
    samples: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)  # rank -> (step, busy_s)
    busy: dict[int, list[float]] = field(default_factory=dict)  # rank -> every busy_s seen (the summary's median)
    episodes: list[Episode] = field(default_factory=list)
    _open: dict[int, Episode] = field(default_factory=dict)
    _last: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (pid, busy_step) last taken
    _next: float = 0.0
    # rank -> its beacon (None: the file in run_dir); across nodes, what the agents report (`launcher.nodes`)
    read: Callable[[int], Beacon | None] | None = None

    def reset(self) -> None:
        """A new generation: a replacement's samples start afresh (the episodes stay)."""
        self.samples.clear()
        self._open.clear()

    def observe(self, live: dict[int, int]) -> list[str]:
        """`live`: rank -> pid. Returns what to report (a straggler found, an episode over)."""
        now = time.monotonic()
        if self.factor <= 0 or now < self._next:
            return []
        self._next = now + self.poll_s
        for rank, pid in live.items():
            beacon = self.read(rank) if self.read is not None else read_beacon(beacon_path(self.run_dir, rank))
            if beacon is None or beacon.pid != pid or not beacon.busy_step:
                continue
            if self._last.get(rank) == (pid, beacon.busy_step):
                continue
            self._last[rank] = (pid, beacon.busy_step)
            self.samples.setdefault(rank, deque(maxlen=self.window)).append((beacon.busy_step, beacon.busy_s))
            seen = self.busy.setdefault(rank, [])
            if len(seen) < 100_000:
                seen.append(beacon.busy_s)
        return self._judge()

    def _judge(self) -> list[str]:
        medians = {r: statistics.median(b for _, b in s) for r, s in self.samples.items() if len(s) == self.window}
        out = []
        for rank, mine in medians.items():
            others = [m for r, m in medians.items() if r != rank]
            if not others:
                continue
            base = statistics.median(others)
            ratio = mine / base if base > 0 else 0.0
            steps = [s for s, _ in self.samples[rank]]
            episode = self._open.get(rank)
            if ratio >= self.factor:
                if episode is None:
                    episode = Episode(rank, round(ratio, 2), steps[0], steps[-1])
                    self._open[rank] = episode
                    self.episodes.append(episode)
                    out.append(f"rank {rank} is a straggler: its steps' own work takes {ratio:.2f}x the other "
                               f"ranks' ({1e3 * mine:.1f} ms against {1e3 * base:.1f} ms, steps {steps[0]}-"
                               f"{steps[-1]}); reported, not replaced")
                else:
                    episode.factor, episode.last_step = max(episode.factor, round(ratio, 2)), steps[-1]
            elif episode is not None:
                del self._open[rank]
                out.append(f"rank {rank} is no straggler any more ({ratio:.2f}x at step {steps[-1]})")
        return out

    def summary(self) -> dict[str, Any]:
        return {"stragglers": [asdict(e) for e in self.episodes],
                "rank_busy_s": {str(r): round(statistics.median(b), 5) for r, b in sorted(self.busy.items()) if b}}

