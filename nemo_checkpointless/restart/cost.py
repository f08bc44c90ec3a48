"""What a fault cost the job: its extra wall time, measured on the job's own step times.

`recover_s` ends when the first step after a recovery completes; a job can still be slower afterwards (a thread
left spinning, a spare warming up on the same cores), and a whole-job restart also redoes lost steps. The cost a
user pays is the job's extra wall time, so each fault is charged with the time from the last step completed
before it to the last step before the next fault (or the end of the run), minus what those steps take at the
job's step rate just before the fault:

    lost_s = (t[e] - t[s - 1]) - (e - (s - 1)) / rate_before

where s is the step the fault interrupted, e the last step before the next fault, and t[k] the first time step
k completed. A restart completes some steps twice; the first time is the one that belongs to this stretch of the
run (steps below s first completed before the fault, steps from s on after it; a later fault's redo of them is
that fault's cost). rate_before is the step rate over the `window` steps before the fault (never reaching back
past the previous fault); `rate_after` the step rate over the `window` steps from step s on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RATE_WINDOW = 20


@dataclass(frozen=True)
class StepTimes:
    """When each step completed: the first and the last time (unix seconds; they differ for steps a restart
    redid)."""

    first: dict[int, float]
    last: dict[int, float]

    @classmethod
    def parse(cls, text: str) -> StepTimes:
        """From the `"<step> <time>;"` records of `recovery.STEP_TIMES_KEY`, in append order."""
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for item in text.split(";"):
            if not item.strip():
                continue
            step_text, t_text = item.split()
            step, t = int(step_text), float(t_text)
            first.setdefault(step, t)
            last[step] = t
        return cls(first, last)

    def write_csv(self, path: Path) -> None:
        """`step,first_t,last_t` per completed step (the run directory's `steps.csv`, private to the user)."""
        lines = ["step,first_t,last_t", *(f"{k},{self.first[k]:.6f},{self.last[k]:.6f}" for k in sorted(self.first))]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")


@dataclass(frozen=True)
class FaultCost:
    lost_s: float | None
    rate_before: float | None  # steps/s over the window before the fault
    rate_after: float | None  # steps/s over the window after the interrupted step completed again

    def to_json(self) -> dict[str, float | None]:
        def r(v: float | None, nd: int) -> float | None:
            return None if v is None else round(v, nd)

        return {"lost_s": r(self.lost_s, 3), "steps_per_s_before": r(self.rate_before, 3),
                "steps_per_s_after": r(self.rate_after, 3)}


def _rate(times: dict[int, float], lo: int, hi: int) -> float | None:
    if hi <= lo or lo not in times or hi not in times or times[hi] <= times[lo]:
        return None
    return (hi - lo) / (times[hi] - times[lo])


def fault_costs(times: StepTimes, fault_steps: Sequence[int | None], final_step: int | None,
                window: int = RATE_WINDOW) -> list[FaultCost]:
    """One `FaultCost` per fault, in order; `fault_steps[i]` is the step fault i interrupted (None: unknown)."""
    out = []
    known = [s for s in fault_steps if s is not None]
    end_of_run = final_step if final_step is not None else max(times.last, default=0)
    for i, s in enumerate(fault_steps):
        if s is None:
            out.append(FaultCost(None, None, None))
            continue
        previous = max((p for p in known[:i] if p < s), default=1)  # step 1 holds the warm-up
        later = [n for n in fault_steps[i + 1:] if n is not None and n > s]
        end = (min(later) - 1) if later else end_of_run
        t = times.first
        before = _rate(t, max(s - 1 - window, previous), s - 1)
        after = _rate(t, s, min(s + window, end))
        lost = None
        if before is not None and end > s - 1 and end in t and (s - 1) in t:
            lost = (t[end] - t[s - 1]) - (end - (s - 1)) / before
        out.append(FaultCost(lost, before, after))
    return out
