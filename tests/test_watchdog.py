"""The progress watchdog (`launcher.watchdog.HangWatch`) on real processes that write real beacons
(`restart.progress.ProgressBeacon`): it names the stopped, the spinning and the stalled-behind rank, never a rank
waiting where the others are, never a rank writing the checkpoint, and nothing before a rank completed a step.

Each "rank" is a Python process that marks a few steps like a training loop, then, at step 5, does what its mode
says. A 0.6 s deadline keeps the tests short (a few seconds in all).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_checkpointless.launcher.procs import proc_state
from nemo_checkpointless.launcher.watchdog import HangWatch
from nemo_checkpointless.restart import progress
from nemo_checkpointless.restart.progress import ProgressBeacon, beacon_path, read_beacon

RANK = """
import os, signal, sys, time
from nemo_checkpointless.restart import progress
from nemo_checkpointless.restart.progress import ProgressBeacon
run_dir, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
beacon = ProgressBeacon(run_dir, rank)
for step in range(1, 5):
    for phase in (progress.STEP_START, progress.FORWARD, progress.GRAD_SYNC, progress.STEP_DONE):
        beacon.mark(step, phase)
        time.sleep(0.01)
beacon.mark(5, progress.STEP_START)
if mode == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
elif mode == "spin":
    while True:
        pass
elif mode == "checkpoint":
    beacon.mark(5, progress.CHECKPOINT)
    while True:
        pass
elif mode == "gil":  # a native call that keeps the GIL
    import ctypes
    ctypes.PyDLL(None).pause()
elif mode == "busy":  # a long step: busy, but nobody waits
    while True:
        pass
elif mode == "wait":  # in the step's gradient reduction, waiting for a peer
    beacon.mark(5, progress.FORWARD)
    beacon.mark(5, progress.GRAD_SYNC)
time.sleep(3600)  # "stall": asleep at step 5's start, behind the waiters
"""


def _start(tmp_path: Path, modes: list[str]) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), str(r), mode]) for r, mode in enumerate(modes)]


def _watch(tmp_path: Path, procs: list[subprocess.Popen[bytes]], seconds: float) -> list[tuple[int, str]]:
    watch = HangWatch(tmp_path, deadline_s=0.6, poll_s=0.05)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            found = watch.check({r: p.pid for r, p in enumerate(procs)})
            if found:
                return found
            time.sleep(0.02)
        return []
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(("mode", "reason"), [
    ("stop", "stopped (state T) at step 5, step start"),
    ("spin", "busy without progress at step 5, step start"),
    ("stall", "idle at step 5, step start for"),
    ("gil", "idle at step 5, step start for"),
])
def test_the_hung_rank_is_named_and_the_waiters_are_not(tmp_path: Path, mode: str, reason: str) -> None:
    found = _watch(tmp_path, _start(tmp_path, ["wait", mode, "wait"]), seconds=8)
    assert len(found) == 1 and found[0][0] == 1 and found[0][1].startswith(reason), found
    if mode in ("stall", "gil"):
        # ranks 0 and 2 both wait; the reason names one of them, whichever the watchdog saw first
        assert any(f"while rank {w} waits at step 5, gradient reduction" in found[0][1] for w in (0, 2)), found


def test_every_rank_busy_is_a_long_step_not_a_hang(tmp_path: Path) -> None:
    assert _watch(tmp_path, _start(tmp_path, ["busy", "busy"]), seconds=2.5) == []


def test_ranks_waiting_at_the_same_place_are_not_blamed(tmp_path: Path) -> None:
    """Every rank idle in the same collective: the watchdog cannot tell who is at fault (the collective timeout
    and the launcher's check-in round can)."""
    assert _watch(tmp_path, _start(tmp_path, ["wait", "wait", "wait"]), seconds=2.5) == []


def test_a_rank_writing_the_checkpoint_is_never_blamed(tmp_path: Path) -> None:
    assert _watch(tmp_path, _start(tmp_path, ["wait", "checkpoint"]), seconds=2.5) == []


def test_nothing_is_watched_before_a_rank_completed_a_step(tmp_path: Path) -> None:
    """A process that only ever marked its first step (start-up, compilation, a replacement joining) is not
    watched, however long it takes."""
    script = ("import time, sys\nfrom nemo_checkpointless.restart.progress import ProgressBeacon\n"
              "b = ProgressBeacon(sys.argv[1], 0)\nb.mark(1, 1)\nwhile True:\n    pass\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])]
    assert _watch(tmp_path, procs, seconds=2.0) == []


def test_a_beacon_round_trips_and_a_replacement_takes_the_file_over(tmp_path: Path) -> None:
    beacon = ProgressBeacon(tmp_path, 3)
    assert read_beacon(beacon_path(tmp_path, 3)) is None  # nothing marked yet
    beacon.mark(7, progress.GRAD_SYNC)
    got = read_beacon(beacon_path(tmp_path, 3))
    assert got is not None and (got.seq, got.step, got.phase, got.pid) == (1, 7, progress.GRAD_SYNC, os.getpid())
    assert got.describe() == "step 7, gradient reduction"
    assert oct(beacon_path(tmp_path, 3).stat().st_mode & 0o777) == "0o600"
    again = ProgressBeacon(tmp_path, 3)  # the next process of rank 3
    again.mark(8, progress.STEP_START)
    got = read_beacon(beacon_path(tmp_path, 3))
    assert got is not None and (got.seq, got.step) == (1, 8)
    beacon.close()
    again.close()


def test_the_default_deadline_follows_the_step_times(tmp_path: Path) -> None:
    watch = HangWatch(tmp_path)
    assert watch.deadline() == 5.0  # the floor, before any step time is seen
    watch.step_times.extend([0.2] * 10)
    assert watch.deadline() == 5.0  # 10 x 0.2 s is below the floor
    watch.step_times.append(1.5)
    assert watch.deadline() == pytest.approx(15.0)  # few samples: p95 is their maximum
    watch.step_times.extend([0.2] * 30)
    assert watch.deadline() == 5.0  # one slow step among 41 is above p95
    assert HangWatch(tmp_path, deadline_s=3).deadline() == 3 and not HangWatch(tmp_path, deadline_s=-1).enabled


def test_a_fixed_deadline_shorter_than_a_step_is_said_and_raised(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    watch = HangWatch(tmp_path, deadline_s=1.0, poll_s=0)
    watch.step_times.append(2.5)
    assert watch.check({}) == []
    err = capsys.readouterr().err
    assert "launcher.hang_deadline_s=1: shorter than a step this job took (2.5 s)" in err, err
    assert "Set it above the longest step, or to 0" in err and watch.deadline() == 5.0


def test_proc_state_reads_state_and_cpu() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.1)
        state = proc_state(proc.pid)
        assert state is not None and state[0] == "T" and state[1] >= 0
    finally:
        proc.kill()
        proc.wait()
    assert proc_state(proc.pid) is None


def test_a_slow_rank_is_reported_once_as_a_straggler_and_a_fast_one_never(tmp_path: Path) -> None:
    """Three beacons marking real steps: rank 2 works 25 ms a step before its gradient reduction, the others 3 ms
    (plus 20 ms each in a collective of their own, which is not work); then rank 2 speeds up."""
    from nemo_checkpointless.launcher.stragglers import StragglerWatch

    beacons = [ProgressBeacon(tmp_path, r) for r in range(3)]
    watch = StragglerWatch(tmp_path, factor=1.5, window=8, poll_s=0.0)
    lines: list[str] = []
    for step in range(1, 31):
        for r, beacon in enumerate(beacons):
            beacon.mark(step, progress.STEP_START)
            time.sleep(0.025 if r == 2 and step <= 20 else 0.003)
            if r != 2:
                time.sleep(0.02)
                beacon.waited(0.02)
            beacon.mark(step, progress.GRAD_SYNC)
            beacon.mark(step, progress.STEP_DONE)
        lines += watch.observe({r: os.getpid() for r in range(3)})
    summary = watch.summary()
    [episode] = summary["stragglers"]
    assert episode["rank"] == 2 and episode["factor"] > 3 and episode["first_step"] <= 8, summary
    assert 20 <= episode["last_step"] < 30, summary
    assert any(line.startswith("rank 2 is a straggler") and "reported, not replaced" in line for line in lines)
    assert any(line.startswith("rank 2 is no straggler any more") for line in lines), lines
    assert set(summary["rank_busy_s"]) == {"0", "1", "2"}
