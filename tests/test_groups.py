"""`Group.send` / `Group.recv` watch the job's fault key like the collectives do: a rank waiting for a peer that
will never send leaves as soon as the launcher declares a fault, not at the collective timeout. Threads as ranks,
real gloo groups over loopback, an in-process store (`harness.run_threads`)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from harness import run_threads

from nemo_checkpointless.restart.groups import FAULT_KEY, Membership, PeerFailure

TIMEOUT_S = 20.0  # the collective timeout: a wait that ignored the fault key would last this long
FAULT_AFTER_S = 0.3


@pytest.mark.timeout(90)
def test_recv_from_a_peer_that_never_sends_returns_when_the_fault_key_is_set() -> None:
    recv_done = threading.Event()

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
            time.sleep(FAULT_AFTER_S)
            m.store.set(FAULT_KEY, str(m.generation))
            assert recv_done.wait(TIMEOUT_S + 10)
            return {}
        t0 = time.monotonic()
        try:
            world.recv(torch.empty(1 << 20), 1, tag=2)
        except PeerFailure as e:
            return {"waited_s": time.monotonic() - t0, "error": str(e)}
        finally:
            recv_done.set()
        return {"waited_s": time.monotonic() - t0, "error": ""}

    out = run_threads(2, fn, timeout_s=TIMEOUT_S + 30, collective_timeout_s=TIMEOUT_S)[0]
    assert "launcher reported a failed rank" in str(out["error"]), out
    assert FAULT_AFTER_S - 0.05 <= float(out["waited_s"]) < 2.0, out
