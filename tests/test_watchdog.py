"""The progress watchdog (`launcher.watchdog.HangWatch`) on real processes that write real beacons
(`restart.progress.ProgressBeacon`): it names the stopped, the spinning and the stalled-behind rank, never a rank
waiting where the others are, never a rank writing the checkpoint, and nothing before a rank completed a step.

Each "rank" is a Python process that marks its first step's start, waits for the test's go, marks a few steps like
a training loop, then, at step 5, does what its mode says. The test starts watching before the go, so the watchdog
sees every rank move on from its first step (which is what arms it: `HangWatch` watches nothing before). A watch
that finds nothing has read every rank at the place it stays (each mode's `FINAL`) and then gone on for
`WINDOW_S`, five deadlines: a rank stalled that long would have been named.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nemo_checkpointless.launcher.procs import proc_state
from nemo_checkpointless.launcher.watchdog import HangWatch, local_reader
from nemo_checkpointless.restart import progress
from nemo_checkpointless.restart.progress import Beacon, ProgressBeacon, beacon_path, read_beacon

DEADLINE_S = 0.6
WINDOW_S = 5 * DEADLINE_S
# A spinning rank on a loaded 2-core machine gets well under the default 0.8 of a core (one run with 20 processes
# runnable gave it less than 0.1 in its first deadline); a waiting or stalled rank gets none: each does nothing
# after its last mark but the call it stays in.
BUSY_FRACTION = 0.02

# The beacon's module alone, from its file: `nemo_checkpointless.restart` imports torch, which takes each child
# seconds of CPU on a loaded 2-core machine, and the writer under test needs none of it.
RANK = """
import ctypes, importlib.util, os, signal, sys, time
run_dir, rank, mode, module_file = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
libc = ctypes.PyDLL(None)
spec = importlib.util.spec_from_file_location("progress", module_file)
progress = sys.modules["progress"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(progress)
beacon = progress.ProgressBeacon(run_dir, rank)
beacon.mark(1, progress.STEP_START)
sys.stdin.readline()  # the test's go: the watchdog has read this first mark
if mode == "first":  # start-up, compilation, a replacement joining: it never completes its first step
    while True:
        pass
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
    libc.pause()
elif mode == "busy":  # a long step: busy, but nobody waits
    while True:
        pass
elif mode == "wait":  # in the step's gradient reduction, waiting for a peer
    beacon.mark(5, progress.FORWARD)
    beacon.mark(5, progress.GRAD_SYNC)
time.sleep(3600)  # "stall": asleep at step 5's start, behind the waiters
"""
# (step, phase) of each mode's last mark, where its rank stays; any other mode: (5, STEP_START).
FINAL = {"wait": (5, progress.GRAD_SYNC), "checkpoint": (5, progress.CHECKPOINT), "first": (1, progress.STEP_START)}


@dataclass
class Watched:
    found: list[tuple[int, str]]  # what the watch named (empty: nothing in the whole window)
    reads: dict[int, Beacon]  # rank -> the last beacon of its process the watch read
    cpu_s: dict[int, float]  # rank -> CPU seconds it used in the window
    window_s: float  # from the read that saw every rank at its final place to the last check


def _watch(tmp_path: Path, modes: list[str]) -> Watched:
    """Start one rank per mode, let the watch see each pass its first step, then watch for `WINDOW_S` after every
    rank was read at its final place (or until the watch names a rank). No clock bounds the waits for the ranks
    (a loaded machine takes seconds to start each): a rank that exits fails the test, pytest's timeout a stuck one."""
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path), str(r), mode, progress.__file__],
                              stdin=subprocess.PIPE) for r, mode in enumerate(modes)]
    live = {r: p.pid for r, p in enumerate(procs)}
    reads: dict[int, Beacon] = {}
    local = local_reader(tmp_path)

    def reader(rank: int, pid: int) -> tuple[Beacon | None, tuple[str, float] | None]:
        beacon, state = local(rank, pid)
        if beacon is not None and beacon.pid == pid:
            reads[rank] = beacon
        return beacon, state

    watch = HangWatch(tmp_path, deadline_s=DEADLINE_S, poll_s=0, busy_fraction=BUSY_FRACTION, reader=reader)

    def check_until(reached: dict[int, tuple[int, int]]) -> list[tuple[int, str]]:
        while True:
            found = watch.check(live)
            if found or all(r in reads and (reads[r].step, reads[r].phase) == at for r, at in reached.items()):
                return found
            exited = {r: p.returncode for r, p in enumerate(procs) if p.poll() is not None}
            assert not exited, f"ranks exited (rank: code) {exited} before the watch read them at {reached}"
            time.sleep(0.02)

    try:
        found = check_until({r: (1, progress.STEP_START) for r in live})
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        found = found or check_until({r: FINAL.get(mode, (5, progress.STEP_START)) for r, mode in enumerate(modes)})
        start = time.monotonic()
        cpu0 = {r: state[1] for r, pid in live.items() if (state := proc_state(pid)) is not None}
        last = start
        while not found and last - start < WINDOW_S:
            time.sleep(0.02)
            last = time.monotonic()
            found = watch.check(live)  # its clock reads after `last`: the last check is WINDOW_S on, or later
        cpu = {r: state[1] - cpu0[r] for r, pid in live.items() if (state := proc_state(pid)) is not None and r in cpu0}
        return Watched(found, dict(reads), cpu, last - start)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdin is not None:
                p.stdin.close()


def _nothing_found(watched: Watched, modes: list[str]) -> None:
    """Nothing was named, over the whole window, with every rank read at its final place before it."""
    assert watched.found == [], watched
    assert watched.window_s >= WINDOW_S, watched
    where = {r: (b.step, b.phase) for r, b in watched.reads.items()}
    assert where == {r: FINAL.get(m, (5, progress.STEP_START)) for r, m in enumerate(modes)}, watched


@pytest.mark.parametrize(("mode", "reason"), [
    ("stop", "stopped (state T) at step 5, step start"),
    ("spin", "busy without progress at step 5, step start"),
    ("stall", "idle at step 5, step start for"),
    ("gil", "idle at step 5, step start for"),
])
def test_the_hung_rank_is_named_and_the_waiters_are_not(tmp_path: Path, mode: str, reason: str) -> None:
    found = _watch(tmp_path, ["wait", mode, "wait"]).found
    assert len(found) == 1 and found[0][0] == 1 and found[0][1].startswith(reason), found
    if mode in ("stall", "gil"):
        # ranks 0 and 2 both wait; the reason names one of them, whichever the watchdog saw first
        assert any(f"while rank {w} waits at step 5, gradient reduction" in found[0][1] for w in (0, 2)), found


def test_every_rank_busy_is_a_long_step_not_a_hang(tmp_path: Path) -> None:
    modes = ["busy", "busy"]
    watched = _watch(tmp_path, modes)
    _nothing_found(watched, modes)
    # Both were busy as the watch counts it (else this would be two idle ranks at one place, another test's case).
    assert all(cpu >= BUSY_FRACTION * watched.window_s for cpu in watched.cpu_s.values()), watched
    assert len(watched.cpu_s) == 2, watched


def test_ranks_waiting_at_the_same_place_are_not_blamed(tmp_path: Path) -> None:
    """Every rank idle in the same collective: the watchdog cannot tell who is at fault (the collective timeout
    and the launcher's check-in round can)."""
    modes = ["wait", "wait", "wait"]
    _nothing_found(_watch(tmp_path, modes), modes)


def test_a_rank_writing_the_checkpoint_is_never_blamed(tmp_path: Path) -> None:
    """Rank 1 spins in the checkpoint's phase while rank 0 waits for it in the gradient reduction: any other phase
    would name it (busy without progress, or idle behind a waiter)."""
    modes = ["wait", "checkpoint"]
    _nothing_found(_watch(tmp_path, modes), modes)


def test_nothing_is_watched_before_a_rank_completed_a_step(tmp_path: Path) -> None:
    """A process that only ever marked its first step (start-up, compilation, a replacement joining) is not
    watched, however long it takes, even while another rank waits for it at step 5 (were it watched, it would be
    named: busy while a rank waits, or idle behind it)."""
    modes = ["wait", "first"]
    _nothing_found(_watch(tmp_path, modes), modes)


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
    # The child burns some CPU, says how much, and sleeps; the test stops it and waits (waitpid) until it is stopped.
    code = ("import sys, time\nwhile time.process_time() < 0.2:\n    pass\n"
            "print(time.process_time(), flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        used = float(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGSTOP)
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        state = proc_state(proc.pid)
        # /proc counts CPU in clock ticks, sampled: of the order of what the child measured, not to the tick.
        assert state is not None and state[0] == "T" and state[1] >= used / 2 and used >= 0.2, (state, used)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc_state(proc.pid) is None


def test_a_slow_rank_is_reported_once_as_a_straggler_and_a_fast_one_never(tmp_path: Path) -> None:
    """Three beacons marking real steps: rank 2 works 150 ms a step before its gradient reduction for 20 steps, the
    others 10 ms (plus 20 ms each in a collective of their own, which is not work); then rank 2 works 10 ms too.
    A sleep never ends early, so rank 2's slow steps are at least 150 ms however loaded the machine; the fast
    steps' medians (of 8) stay far below that."""
    from nemo_checkpointless.launcher.stragglers import StragglerWatch

    slow_steps, steps, window = 20, 40, 8
    beacons = [ProgressBeacon(tmp_path, r) for r in range(3)]
    watch = StragglerWatch(tmp_path, factor=1.5, window=window, poll_s=0.0)
    lines: list[str] = []
    for step in range(1, steps + 1):
        for r, beacon in enumerate(beacons):
            beacon.mark(step, progress.STEP_START)
            time.sleep(0.15 if r == 2 and step <= slow_steps else 0.01)
            if r != 2:
                t0 = time.monotonic()
                time.sleep(0.02)
                beacon.waited(time.monotonic() - t0)  # measured, as the strategy measures its collectives
            beacon.mark(step, progress.GRAD_SYNC)
            beacon.mark(step, progress.STEP_DONE)
        lines += watch.observe({r: os.getpid() for r in range(3)})
    summary = watch.summary()
    [episode] = summary["stragglers"]
    # Named as soon as every rank's window is full (steps 1-8); still named while half its window is slow (step
    # slow_steps + window / 2: the median is the mean of a slow and a fast step); over before the run ends.
    assert episode["rank"] == 2 and episode["factor"] >= watch.factor and episode["first_step"] == 1, summary
    assert slow_steps + window // 2 <= episode["last_step"] < steps, summary
    said = [line for line in lines if "straggler" in line]
    assert len(said) == 2, lines  # once when it starts, once when it ends; never a fast rank
    assert said[0].startswith("rank 2 is a straggler") and "reported, not replaced" in said[0], said
    assert said[1].startswith("rank 2 is no straggler any more"), said
    assert set(summary["rank_busy_s"]) == {"0", "1", "2"}
