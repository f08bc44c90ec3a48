"""The NeMo path's `FaultWatch` (nemo.restart) on real processes, a real gloo default group and the launcher's
fault key set by the test: a survivor computing is stopped where it is; one in a collective outside its step's
computation gets the grace to complete it when its partner is alive, and is released soon after the grace when
the partner never comes. Rank 0 is the watched survivor; rank 1 its partner, alive with its sockets open until
rank 0 is done (so nothing but the watch, or the gloo timeout, can end rank 0's wait). Times are CLOCK_MONOTONIC,
one clock for every process of the machine.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import RankContext, emit_key, launch_ranks

from nemo_checkpointless.megatron.groups import FaultWatch
from nemo_checkpointless.restart import groups
from nemo_checkpointless.restart.groups import FAULT_GRACE_S, PeerFailure

GLOO_TIMEOUT_S = 20.0  # what a survivor would wait without the watch
# FAULT_GRACE_S in the "late" survivor: its partner arrives a whole default grace after it entered the collective,
# and a grace 25 times that holds however loaded the machine.
LATE_GRACE_S = 25 * FAULT_GRACE_S
START_S = 240  # bounds a hang while the ranks import torch (seconds each on a loaded 2-core machine), nothing else


def _fault_t(ctx: RankContext) -> float:
    return float(json.loads(ctx.wait_key("fault_t", timeout_s=START_S)))


def _rank(ctx: RankContext) -> None:
    (scenario,) = ctx.args
    if scenario == "late":
        groups.FAULT_GRACE_S = LATE_GRACE_S  # this process's; the watch reads it when it is made
    dist.init_process_group("gloo", store=dist.PrefixStore("fw/", ctx.store), rank=ctx.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    x = torch.full((1 << 16,), float(ctx.rank + 1))
    dist.all_reduce(x.clone())  # connected
    if ctx.rank == 1:
        ctx.emit("ready", True)
        if scenario == "late":  # alive: joins the collective within the grace
            ctx.wait_key(emit_key(0, "in_collective"), timeout_s=START_S)
            time.sleep(FAULT_GRACE_S)
            dist.all_reduce(x)
        ctx.wait_key(emit_key(0, "out"), timeout_s=4 * GLOO_TIMEOUT_S)
        return
    port = int(ctx.store.port)
    with FaultWatch(ctx.store, 0, keep_ports={port}) as watch:
        ctx.emit("ready", True)
        out: dict[str, object] = {}
        if scenario == "computing":
            a = torch.randn(256, 256)
            try:
                with watch.interruptible():
                    a = torch.tanh(a @ a)
                    ctx.emit("computing", True)  # inside the section, computing: the test declares the fault now
                    deadline = time.monotonic() + GLOO_TIMEOUT_S
                    while time.monotonic() < deadline:
                        a = torch.tanh(a @ a)
                out["raised"] = None
            except PeerFailure as e:
                out["raised"] = type(e).__name__
            out["interrupted"] = watch.interrupted
        else:
            _fault_t(ctx)
            ctx.emit("in_collective", True)
            try:
                dist.all_reduce(x)
                out["sum"] = float(x[0])
            except Exception as e:  # gloo's error for a closed peer
                out["error"] = type(e).__name__
            out["closed_before"] = watch.closed
            try:
                with watch.interruptible():
                    out["entered"] = True
            except PeerFailure:
                out["entered"] = False
        out["after_fault_s"] = time.monotonic() - _fault_t(ctx)
        out["closed"] = watch.closed
    ctx.emit("out", out)


def _run(scenario: str) -> dict[str, Any]:
    with launch_ranks("test_fault_watch:_rank", 2, args=(scenario,), timeout_s=START_S) as ranks:
        ranks.wait_emitted("ready", [0, 1], timeout_s=START_S)
        if scenario == "computing":
            ranks.wait_emitted("computing", [0], timeout_s=START_S)
        ranks.store.set("fault_t", json.dumps(time.monotonic()))
        ranks.set_fault(0)
        out = ranks.wait_emitted("out", [0], timeout_s=2 * GLOO_TIMEOUT_S)[0]
        codes = ranks.wait(START_S)
        assert codes == [0, 0], ranks.describe()
    return out


@pytest.mark.timeout(300)
def test_a_survivor_computing_is_stopped_where_it_is() -> None:
    out = _run("computing")
    # Raised inside its computation by the watch (not refused at the section's entry), long before the end of its
    # 20 s of computation.
    assert out["raised"] == "PeerFailure" and out["interrupted"] is True, out
    assert 0 <= out["after_fault_s"] < GLOO_TIMEOUT_S / 4, out
    assert out["closed"] >= 1, out  # its peers are released too


@pytest.mark.timeout(300)
def test_a_collective_with_a_live_partner_completes_within_the_grace() -> None:
    out = _run("late")
    assert out.get("sum") == 3.0, out  # 1 + 2: completed, not broken by the declaration
    assert out["closed_before"] == 0, out  # the watch shut nothing while the collective was in flight
    assert out["entered"] is False and out["closed"] >= 1, out  # the next step's computation is refused


@pytest.mark.timeout(300)
def test_a_collective_whose_partner_never_comes_is_released_after_the_grace() -> None:
    out = _run("absent")
    assert out.get("error"), out
    # Not before the grace (order: the watch saw the key after it was set), long before the gloo timeout.
    assert FAULT_GRACE_S <= out["after_fault_s"] < GLOO_TIMEOUT_S / 4, out
    assert out["entered"] is False and out["closed"] >= 1, out
