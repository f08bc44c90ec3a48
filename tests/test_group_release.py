"""An abandoned generation's gloo groups are released: no transport thread left spinning, no socket or thread left
behind, read from /proc (not from our own counters). Real processes, a real SIGKILL in the middle of a stream of
all_reduces.

Before the fix, the dead rank's ring neighbour kept the abandoned group's `gloo_tcp_loop` thread polling a socket
that held bytes for a receive buffer that gloo had already freed: ~0.85 s of CPU per second, for the rest of the
run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from harness import RankContext, launch_ranks

from nemo_checkpointless.restart.groups import PeerFailure, wait_released

WORLD = 4
NUMEL = 1 << 20  # 4 MB per all_reduce: big enough that a peer is mid-send when a rank dies
GENERATIONS = 3  # kill rank 1, then rank 2: two abandoned generations on every survivor
SETTLE_S = 1.0  # how long the idle survivors are watched for CPU use after the release


def _proc_snapshot() -> dict[str, Any]:
    """This process's threads (name -> CPU ticks), open fds, connected TCP sockets: from /proc."""
    threads: dict[str, list[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that just ended
            continue
        threads.setdefault(name, []).append(int(fields[11]) + int(fields[12]))
    fds = os.listdir("/proc/self/fd")
    sockets = sum(1 for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")
                  and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"))
    return {"threads": threads, "n_threads": sum(len(v) for v in threads.values()), "fds": len(fds),
            "sockets": sockets}


def _loop_ticks(snap: dict[str, Any]) -> int:
    return sum(snap["threads"].get("gloo_tcp_loop", []))


def _rank_stream_then_survive(ctx: RankContext) -> None:
    """all_reduces over the current generation until a PeerFailure, then the next generation over the survivors;
    args: (victims in kill order,). Emits a /proc snapshot of each generation's steady state."""
    (victims,) = ctx.args
    m = ctx.membership
    alive = list(range(ctx.world_size))
    for generation in range(GENERATIONS):
        group = m.group("world", alive)
        x = torch.ones(NUMEL)
        for _ in range(3):
            group.all_reduce(x)
        wait_released(30)
        time.sleep(0.3)
        before = _proc_snapshot()
        time.sleep(SETTLE_S)
        after = _proc_snapshot()
        ctx.emit(f"gen{generation}", {"snap": after, "loop_ticks_idle": _loop_ticks(after) - _loop_ticks(before),
                                      "size": len(alive)})
        if generation == GENERATIONS - 1:
            return
        ctx.emit(f"streaming{generation}", True)
        try:
            while True:
                group.all_reduce(x)
        except PeerFailure:
            pass
        alive.remove(victims[generation])
        m.advance(generation + 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_abandoned_generations_leave_no_thread_socket_or_busy_loop() -> None:
    victims = [1, 2]
    with launch_ranks("test_group_release:_rank_stream_then_survive", WORLD, args=(victims,),
                      timeout_s=90) as ranks:
        alive = list(range(WORLD))
        snaps: dict[int, dict[int, Any]] = {}
        for generation in range(GENERATIONS):
            snaps[generation] = ranks.wait_emitted(f"gen{generation}", alive, timeout_s=40)
            if generation == GENERATIONS - 1:
                break
            ranks.wait_emitted(f"streaming{generation}", alive, timeout_s=20)
            time.sleep(0.2)  # mid-stream
            ranks.kill(victims[generation])
            ranks.wait_exit(victims[generation], 10)
            ranks.set_fault(generation)
            alive.remove(victims[generation])
        codes = ranks.wait(30)
        describe = ranks.describe()
    assert [codes[r] for r in alive] == [0] * len(alive), describe
    for rank in alive:
        first, last = snaps[0][rank], snaps[GENERATIONS - 1][rank]
        # One live group: one transport thread, as in generation 0; nothing else grew.
        assert len(last["snap"]["threads"].get("gloo_tcp_loop", [])) == 1, (rank, last)
        assert last["snap"]["n_threads"] == first["snap"]["n_threads"], (rank, first, last)
        # Fewer peers now: each lost rank took one connection of the (full-mesh) group with it.
        assert last["snap"]["sockets"] == first["snap"]["sockets"] - len(victims), (rank, first, last)
        assert last["snap"]["fds"] == first["snap"]["fds"] - len(victims), (rank, first, last)
        # An idle rank's transport threads use (next to) no CPU: a busy loop would show ~85 ticks per second.
        assert last["loop_ticks_idle"] <= 5 * SETTLE_S, (rank, last)
