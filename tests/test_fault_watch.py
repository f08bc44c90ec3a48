"""The NeMo path's `FaultWatch` (nemo.restart) on real processes, a real gloo default group and the launcher's
fault key set by the test: a survivor computing is stopped where it is; one in a collective outside its step's
computation gets the grace to complete it when its partner is alive, and is released soon after the grace when
the partner never comes. Rank 0 is the watched survivor; rank 1 its partner."""

from __future__ import annotations

import datetime
import json
import time

import pytest
import torch
import torch.distributed as dist
from harness import RankContext, launch_ranks

from nemo_checkpointless.nemo.restart import FaultWatch
from nemo_checkpointless.restart.groups import FAULT_GRACE_S, PeerFailure

GLOO_TIMEOUT_S = 20.0  # what a survivor would wait without the watch


def _fault_t(ctx: RankContext) -> float:
    return float(json.loads(ctx.wait_key("fault_t")))


def _rank(ctx: RankContext) -> None:
    (scenario,) = ctx.args
    dist.init_process_group("gloo", store=dist.PrefixStore("fw/", ctx.store), rank=ctx.rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    x = torch.full((1 << 16,), float(ctx.rank + 1))
    dist.all_reduce(x.clone())  # connected
    if ctx.rank == 1:
        ctx.emit("ready", True)
        fault_t = _fault_t(ctx)
        if scenario == "late":  # alive: joins the collective within the grace
            time.sleep(max(0.0, fault_t + FAULT_GRACE_S / 4 - time.time()))
            dist.all_reduce(x)
        else:
            time.sleep(GLOO_TIMEOUT_S / 4)
        return
    port = int(ctx.store.port)
    with FaultWatch(ctx.store, 0, keep_ports={port}) as watch:
        ctx.emit("ready", True)
        out: dict[str, object] = {}
        if scenario == "computing":
            a = torch.randn(256, 256)
            try:
                with watch.interruptible():
                    deadline = time.monotonic() + GLOO_TIMEOUT_S
                    while time.monotonic() < deadline:
                        a = torch.tanh(a @ a)
                out["raised"] = None
            except PeerFailure as e:
                out["raised"] = type(e).__name__
        else:
            ctx.wait_key("fault_t")
            try:
                dist.all_reduce(x)
                out["sum"] = float(x[0])
            except Exception as e:  # gloo's error for a closed peer
                out["error"] = type(e).__name__
            try:
                with watch.interruptible():
                    out["entered"] = True
            except PeerFailure:
                out["entered"] = False
        out["after_fault_s"] = time.time() - _fault_t(ctx)
        out["closed"] = watch.closed
    ctx.emit("out", out)


def _run(scenario: str) -> dict[str, object]:
    with launch_ranks("test_fault_watch:_rank", 2, args=(scenario,), timeout_s=60) as ranks:
        ranks.wait_emitted("ready", [0, 1])
        time.sleep(0.05)
        ranks.store.set("fault_t", json.dumps(time.time()))
        ranks.set_fault(0)
        out = ranks.wait_emitted("out", [0], timeout_s=40)[0]
        codes = ranks.wait(30)
        assert codes == [0, 0], ranks.describe()
    return out


@pytest.mark.timeout(120)
def test_a_survivor_computing_is_stopped_where_it_is() -> None:
    out = _run("computing")
    assert out["raised"] == "PeerFailure", out
    assert out["after_fault_s"] < GLOO_TIMEOUT_S / 4, out  # not the end of its 20 s of computation
    assert out["closed"] >= 1, out  # its peers are released too


@pytest.mark.timeout(120)
def test_a_collective_with_a_live_partner_completes_within_the_grace() -> None:
    out = _run("late")
    assert out.get("sum") == 3.0, out  # 1 + 2: completed, not broken by the declaration
    assert out["entered"] is False, out  # then the next step's computation is refused: the rank leaves fit


@pytest.mark.timeout(120)
def test_a_collective_whose_partner_never_comes_is_released_after_the_grace() -> None:
    out = _run("absent")
    assert out.get("error"), out
    assert FAULT_GRACE_S * 0.9 <= out["after_fault_s"] < GLOO_TIMEOUT_S / 4, out
    assert out["entered"] is False and out["closed"] >= 1, out
