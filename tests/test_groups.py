"""`Group.send` / `Group.recv` watch the job's fault key like the collectives do: a rank waiting for a peer that
will never send leaves as soon as the launcher declares a fault (after `FAULT_GRACE_S`), not at the collective
timeout. A collective whose members include the rank the launcher named failed is released after
`DEAD_MEMBER_GRACE_S`; one among live ranks keeps `FAULT_GRACE_S` to complete. Threads as ranks, real gloo groups
over loopback, an in-process store (`harness.run_threads`). Every time is this process's monotonic clock: the
tests assert order (a release after the declaration plus its grace) and ratios to what a wait must beat.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from harness import run_threads

from nemo_checkpointless.protocol import fault_ranks_key
from nemo_checkpointless.restart import groups
from nemo_checkpointless.restart.groups import (
    DEAD_MEMBER_GRACE_S,
    FAULT_GRACE_S,
    FAULT_KEY,
    Membership,
    PeerFailure,
)

TIMEOUT_S = 20.0  # the collective timeout: a wait that ignored the fault key would last this long


@pytest.mark.timeout(90)
def test_recv_from_a_peer_that_never_sends_returns_when_the_fault_key_is_set() -> None:
    receiving, recv_done = threading.Event(), threading.Event()
    key_set: list[float] = []

    def fn(m: Membership) -> dict[str, float | str]:
        world = m.world()
        # A transfer that completes, so the stuck one below is not a group that never worked.
        x = torch.arange(6.0)
        if m.rank == 0:
            world.send(x, 1, tag=1)
        else:
            got = torch.empty(6)
            world.recv(got, 0, tag=1)
            assert torch.equal(got, x)
        if m.rank == 1:
            # The peer that never sends: it stays alive (its sockets open), and the launcher declares a fault.
            assert receiving.wait(TIMEOUT_S)
            key_set.append(time.monotonic())
            m.store.set(FAULT_KEY, str(m.generation))
            assert recv_done.wait(TIMEOUT_S + 10)
            return {}
        receiving.set()
        try:
            world.recv(torch.empty(1 << 20), 1, tag=2)
        except PeerFailure as e:
            return {"t": time.monotonic(), "error": str(e)}
        finally:
            recv_done.set()
        return {"t": time.monotonic(), "error": ""}

    out = run_threads(2, fn, timeout_s=TIMEOUT_S + 30, collective_timeout_s=TIMEOUT_S)[0]
    assert "launcher reported a failed rank" in str(out["error"]), out
    waited = float(out["t"]) - key_set[0]
    # Not before the declaration's grace (order), and long before the collective timeout it must beat.
    assert FAULT_GRACE_S <= waited < TIMEOUT_S / 10, (waited, out)


LONG_GRACE_S = 20.0  # FAULT_GRACE_S in the next test: 400x the short grace, so no clock has to tell them apart


@pytest.mark.timeout(180)
def test_a_collective_with_the_failed_rank_among_its_members_leaves_after_the_short_grace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 stands for a dead rank that is nobody's ring neighbour here: it stays alive, silent, and the
    launcher names it failed. Ranks 0 and 1 wait in a world all-reduce (which cannot complete without rank 2) and
    leave DEAD_MEMBER_GRACE_S after the declaration, not FAULT_GRACE_S. Then their own pair's all-reduce, rank 1
    arriving well after the short grace has passed for rank 0's wait, still completes: a group of live ranks keeps
    the whole grace.

    FAULT_GRACE_S is LONG_GRACE_S here (each wait reads it when it begins), so the two graces differ by a factor of
    400, not 4: a release within a tenth of the long grace is the short one, however loaded the machine."""
    monkeypatch.setattr(groups, "FAULT_GRACE_S", LONG_GRACE_S)
    done, pair_waiting = threading.Event(), threading.Event()
    fault_t: list[float] = []

    def fn(m: Membership) -> dict[str, float | str]:
        world = m.world()
        pair = m.group("pair", [0, 1]) if m.rank < 2 else None
        world.all_reduce(torch.ones(1))  # the group works
        if m.rank == 2:
            fault_t.append(time.monotonic())
            m.store.set(fault_ranks_key(m.generation), json.dumps([2]))
            m.store.set(FAULT_KEY, str(m.generation))
            assert done.wait(4 * LONG_GRACE_S)
            return {}
        out: dict[str, float | str] = {}
        try:
            world.all_reduce(torch.ones(1))
            out["error"] = ""
        except PeerFailure as e:
            out["error"] = str(e)
        out["after_fault_s"] = time.monotonic() - fault_t[0]
        assert pair is not None
        if m.rank == 0:
            pair_waiting.set()
        else:
            # Rank 0 has been in the pair's all-reduce (the fault long declared) for 10 short graces at least.
            assert pair_waiting.wait(4 * LONG_GRACE_S)
            time.sleep(10 * DEAD_MEMBER_GRACE_S)
        x = torch.full((1,), float(m.rank + 1))
        try:
            pair.all_reduce(x)
            out["pair_sum"] = float(x[0])
        except PeerFailure as e:
            out["pair_error"] = str(e)
        if m.rank == 0:
            done.set()
        return out

    # The grace is part of a collective's wait, so below its timeout.
    outs = run_threads(3, fn, timeout_s=4 * LONG_GRACE_S, collective_timeout_s=2 * LONG_GRACE_S)
    for out in outs[:2]:
        assert "launcher reported a failed rank" in str(out["error"]), out
        assert DEAD_MEMBER_GRACE_S <= float(out["after_fault_s"]) < LONG_GRACE_S / 10, out
        assert out.get("pair_sum") == 3.0, out
