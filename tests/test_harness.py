"""Real processes, real gloo groups, real signals: failure detection and re-formation of `restart.groups`.

The test process plays the launcher: it hosts the store, watches the ranks, kills or freezes one, and sets
`FAULT_KEY`. Rank functions (the `_rank_*` below) run in the child processes through `harness.launch_ranks`.
Scenarios are batched per launch (each launch costs ~2-4 s of imports on two cores).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from typing import Any

import pytest
import torch
from harness import RankContext, launch_ranks, run_threads, wait_until

from nemo_checkpointless.restart.groups import FAULT_KEY, CollectiveTimeout, Membership, PeerFailure

WORLD = 4
NUMEL = 1024
KEY_DELAY_S = 0.5  # the "launcher" sets FAULT_KEY this long after it sees the exit, to tell self-detection apart
# The SIGKILL run's collective timeout: what a survivor would wait if neither the broken connection nor the key
# released it. Detection must beat it by far: a tenth of it (the expected figures are ~15 ms for the dead rank's
# neighbours and ~10 ms after the key).
SIGKILL_TIMEOUT_S = 60.0
DETECT_BOUND_S = SIGKILL_TIMEOUT_S / 10
# Waits for the rank processes to start: each imports torch, seconds of CPU on a loaded 2-core machine. They bound
# a hang, never a figure the tests assert.
START_S = 240


# -------------------------------------------------------------------------------------------- rank functions
def _rank_ring(ctx: RankContext) -> None:
    """One checked all_reduce; a loop of all_reduces until a PeerFailure; then, on the survivors, generation 1
    and an all_reduce over a group of the survivors only. args: (survivors,)."""
    (survivors,) = ctx.args
    m = ctx.membership
    world = m.world()
    x = torch.full((NUMEL,), float(ctx.rank + 1))
    world.all_reduce(x)
    ctx.emit("sum", [x.min().item(), x.max().item()])

    n, deadline, started = 0, time.monotonic() + 60, 0.0
    try:
        while time.monotonic() < deadline:
            y = torch.ones(NUMEL)
            started = time.monotonic()  # when the collective that fails began
            world.all_reduce(y)
            assert y[0].item() == ctx.world_size, y[0].item()
            n += 1
            if n == 20:
                ctx.emit("looping", n)
        raise AssertionError("no failure within 60 s")
    except PeerFailure as e:
        t = time.monotonic()
        ctx.emit("failure", {"t": t, "started": started, "by_key": "launcher reported" in str(e), "iters": n,
                             "msg": str(e)[:400]})

    assert ctx.rank in survivors
    m.advance(1)
    group = m.group("world3", survivors)
    z = torch.full((NUMEL,), float(ctx.rank + 1))
    group.all_reduce(z)
    ctx.emit("sum3", {"generation": group.generation, "size": group.size, "min": z.min().item(),
                      "max": z.max().item()})


def _rank_misbehave(ctx: RankContext) -> None:
    if ctx.spare:
        ctx.emit("spare", [ctx.rank, ctx.world_size, os.environ["OMP_NUM_THREADS"]])
        return
    if ctx.rank == 0:
        print("rank 0 about to fail", flush=True)
        raise ValueError("boom from rank 0")
    ctx.emit("sleeping", True)
    time.sleep(120)


# --------------------------------------------------------------------------------------------------- harness
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_harness_reports_failures_and_reaps_on_timeout() -> None:
    with launch_ranks("test_harness:_rank_misbehave", 2, timeout_s=START_S, spares=1) as ranks:
        assert len(ranks.pids) == 3
        assert ranks.wait_exit(2, START_S) == 0
        assert ranks.result(2, "spare") == [2, 2, "1"]
        assert ranks.wait_exit(0, START_S) == 1
        out = ranks.output(0)
        assert "rank 0 about to fail" in out and "ValueError: boom from rank 0" in out, out
        ranks.wait_emitted("sleeping", [1], timeout_s=START_S)
        with pytest.raises(TimeoutError, match=r"ranks \[1\] still running") as info:
            ranks.wait(timeout_s=0.5)
        assert "ValueError: boom from rank 0" in str(info.value)  # every rank's tail is in the message
        assert [ranks.poll(r) for r in range(3)] == [1, -signal.SIGKILL, 0]
        pids = ranks.pids
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} was not reaped"


# -------------------------------------------------------------------------------------------------- SIGKILL
@pytest.fixture(scope="module")
def sigkill_run() -> dict[str, Any]:
    """Kill rank 2 of 4 in a loop of all_reduces; set FAULT_KEY KEY_DELAY_S after its exit is seen. The collective
    timeout is SIGKILL_TIMEOUT_S: a survivor that only its timeout released would take that long."""
    victim, survivors = 2, [0, 1, 3]
    with launch_ranks("test_harness:_rank_ring", WORLD, args=(survivors,), timeout_s=START_S,
                      collective_timeout_s=SIGKILL_TIMEOUT_S) as ranks:
        sums = ranks.wait_emitted("sum", range(WORLD), timeout_s=START_S)
        ranks.wait_emitted("looping", range(WORLD), timeout_s=START_S)
        t_kill = time.monotonic()
        ranks.kill(victim)
        code = ranks.wait_exit(victim, 10)
        t_exit = time.monotonic()
        time.sleep(max(0.0, t_exit + KEY_DELAY_S - time.monotonic()))
        t_key = time.monotonic()
        ranks.set_fault(0)
        failures = ranks.wait_emitted("failure", survivors, timeout_s=2 * DETECT_BOUND_S)
        sums3 = ranks.wait_emitted("sum3", survivors, timeout_s=START_S)
        codes = ranks.wait(START_S)
        ranks.check_codes(codes, [0, 0, -signal.SIGKILL, 0])
        describe = ranks.describe()
    self_detected = sorted(r for r, f in failures.items() if not f["by_key"] and f["t"] < t_key)
    print(f"\nSIGKILL of rank {victim}: exit seen after {1e3 * (t_exit - t_kill):.1f} ms; per survivor "
          + ", ".join(f"rank {r}: {1e3 * (f['t'] - t_kill):.1f} ms after the kill"
                      f" ({'key' if f['by_key'] else 'self'}, {1e3 * (f['t'] - t_key):+.1f} ms vs the key)"
                      for r, f in sorted(failures.items()))
          + f"; {len(self_detected)} of {len(survivors)} raised by themselves before the key ({self_detected})")
    return {"victim": victim, "survivors": survivors, "code": code, "sums": sums, "failures": failures,
            "sums3": sums3, "t_kill": t_kill, "t_exit": t_exit, "t_key": t_key, "self_detected": self_detected,
            "describe": describe}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_reduce_sum_in_every_rank(sigkill_run: dict[str, Any]) -> None:
    want = float(sum(r + 1 for r in range(WORLD)))
    assert sigkill_run["sums"] == {r: [want, want] for r in range(WORLD)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_every_survivor_raises_peer_failure(sigkill_run: dict[str, Any]) -> None:
    """Every survivor raises, by the broken connection or by the key, in a tenth of the collective timeout: not
    released by the timeout. (Timestamps of one machine's CLOCK_MONOTONIC, comparable between processes.)"""
    run = sigkill_run
    assert run["code"] == -signal.SIGKILL
    assert sorted(run["failures"]) == run["survivors"]
    for r, f in run["failures"].items():
        assert f["iters"] >= 20, (r, f)
        assert f["t"] > run["t_kill"], (r, f)
        assert "no progress" not in f["msg"], (r, f)  # not a CollectiveTimeout
        # Either the survivor saw the broken connection itself (a ring neighbour), or the key released it.
        if f["by_key"]:
            assert f["t"] >= run["t_key"], (r, f)  # the key path cannot fire before the key exists
            assert f["t"] - run["t_key"] < DETECT_BOUND_S, (r, f, run["describe"])
        else:
            assert f["t"] - run["t_kill"] < DETECT_BOUND_S, (r, f, run["describe"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_survivors_reform_world_after_sigkill(sigkill_run: dict[str, Any]) -> None:
    want = float(sum(r + 1 for r in sigkill_run["survivors"]))
    for r, s in sigkill_run["sums3"].items():
        assert s == {"generation": 1, "size": 3, "min": want, "max": want}, (r, s)


# -------------------------------------------------------------------------------------------------- SIGSTOP
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigstop_survivors_raise_at_collective_timeout_then_reform() -> None:
    """A frozen rank: nothing closes, nobody sets the key; the survivors raise at their collective timeout, never
    before it (counted from the start of the collective that failed, in the survivor's own clock), and well before
    a second one would have passed since the stop."""
    victim, survivors, timeout_s = 1, [0, 2, 3], 2.0
    with launch_ranks("test_harness:_rank_ring", WORLD, args=(survivors,), timeout_s=START_S,
                      collective_timeout_s=timeout_s) as ranks:
        ranks.wait_emitted("looping", range(WORLD), timeout_s=START_S)
        t_stop = time.monotonic()
        ranks.stop(victim)
        failures = ranks.wait_emitted("failure", survivors, timeout_s=START_S)
        assert ranks.poll(victim) is None  # frozen, not dead: nobody may have set the fault key
        sums3 = ranks.wait_emitted("sum3", survivors, timeout_s=START_S)
        ranks.kill(victim)
        codes = ranks.wait(START_S)
        ranks.check_codes(codes, [0, -signal.SIGKILL, 0, 0])
        delays = {r: f["t"] - t_stop for r, f in failures.items()}
        print(f"\nSIGSTOP of rank {victim}, collective timeout {timeout_s} s: survivors raised after "
              + ", ".join(f"rank {r}: {d:.3f} s" for r, d in sorted(delays.items())))
        for r, f in failures.items():
            assert not f["by_key"], (r, f)
            assert "no progress" in f["msg"] or "Timed out" in f["msg"] or "timed out" in f["msg"], (r, f)
            assert f["t"] - f["started"] >= timeout_s, (r, f)  # order: not before its timeout
            assert delays[r] < 2 * timeout_s, (r, delays[r], ranks.describe())  # at it, not at a later one
        want = float(sum(r + 1 for r in survivors))
        for r, s in sums3.items():
            assert s == {"generation": 1, "size": 3, "min": want, "max": want}, (r, s)


# --------------------------------------------------------------------------------------------- threads as ranks
@pytest.mark.timeout(60)
def test_run_threads_all_reduce() -> None:
    def fn(m: Membership) -> list[float]:
        x = torch.full((8,), float(m.rank + 1))
        m.world().all_reduce(x)
        y = torch.full((3,), float(m.rank))
        m.world().broadcast(y, src=2)
        return [x[0].item(), y[0].item()]

    # Twice in CI (a full suite on 2 cores, an idle machine the second time) the first all-reduce of four fresh
    # thread-ranks made no progress for the whole collective timeout (5 s, then 20 s) on every rank: a stall of
    # gloo's in-process transport that 150 runs in a row and three runs of the modules before this one did not
    # reproduce. The ranks of the package's jobs are processes, where such a stall is a hang the recovery handles;
    # here it would fail CI. So the harness gets one more try and says so in the run's warnings; a harness that
    # never completes still fails.
    try:
        got = run_threads(4, fn, timeout_s=50, collective_timeout_s=20)
    except CollectiveTimeout as e:
        warnings.warn(f"run_threads' first all-reduce stalled ({e}); tried again", stacklevel=1)
        got = run_threads(4, fn, timeout_s=50, collective_timeout_s=20)
    assert got == [[10.0, 2.0]] * 4


@pytest.mark.timeout(120)
def test_run_threads_reraises_first_error_and_releases_the_others() -> None:
    """Rank 1 raises; the others, blocked in an all-reduce it never joins, are released by the fault key that
    `run_threads` sets (the message says so), in a tenth of the collective timeout they would otherwise wait."""
    timeout_s = 60.0
    raised: list[float] = []
    released: dict[int, tuple[float, str]] = {}

    def fn(m: Membership) -> None:
        world = m.world()  # formed by all (forming a group does not watch FAULT_KEY: it waits for every member)
        if m.rank == 1:
            raised.append(time.monotonic())
            raise ValueError("bad input on rank 1")
        try:
            world.all_reduce(torch.ones(4))  # blocks: rank 1 never joins
        except PeerFailure as e:
            released[m.rank] = (time.monotonic(), str(e))
            raise

    with pytest.raises(ValueError, match="bad input on rank 1") as info:
        run_threads(4, fn, timeout_s=2 * timeout_s, collective_timeout_s=timeout_s)
    assert any("thread rank 1 of 4" in note for note in getattr(info.value, "__notes__", []))
    assert sorted(released) == [0, 2, 3], released
    for r, (t, msg) in released.items():
        assert "the launcher reported a failed rank" in msg, (r, msg)
        assert raised[0] < t < raised[0] + timeout_s / 10, (r, t - raised[0])


@pytest.mark.timeout(60)
def test_run_threads_fails_when_a_rank_hangs() -> None:
    # Rank 0 hangs until the test releases it: a hang bounded by an event, not by a clock the test races
    # (a 1 s release raced the 0.3 s timeout and lost on a loaded CI machine).
    release = threading.Event()

    def fn(m: Membership) -> int:
        if m.rank == 0:
            release.wait(30)
        return m.rank

    try:
        with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 still running"):
            run_threads(2, fn, timeout_s=0.3)
    finally:
        release.set()
    # let the daemon thread finish before the leak check looks
    wait_until(lambda: not any(t.name == "rank0" for t in threading.enumerate()), 10, "thread rank0 to finish")


def test_fault_key_name_is_stable() -> None:
    # Launchers written elsewhere (and the harness) set this key; renaming it silently breaks detection.
    assert FAULT_KEY == "job/fault_generation"
