"""`restart.objects`: torch's object collectives with JSON on the wire, on 3 real processes and a gloo default group,
with the test suite's `pickle_guard` installed in every rank (so a pickle anywhere fails the rank):

- outside `json_object_collectives()`, torch's `all_gather_object` is refused by the guard on every rank (the guard
  is live: the NeMo jobs that install it would fail on a pickle);
- inside, `all_gather_object` and `broadcast_object_list` return what torch's would: tuples, paths, nested lists
  and dicts, floats to the last bit; megatron-core's use (gather parameter-group keys, then `key not in own`);
  objects beyond the one-block size (`objects.INLINE`), on one rank of a gather and in a broadcast;
- an object that is not JSON on one rank stops the collective on every rank with a `TypeError` (its own rank
  names the type, the others name that rank), and the next collective of the group still works.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from harness import RankContext, emitted_by_ranks

from nemo_checkpointless.restart import objects

WORLD = 3


def _mine(rank: int) -> dict[str, Any]:
    return {"rank": rank, "key": (1.0, 0.1 + rank, False, rank == 1), "path": Path(f"/runs/{rank}"),
            "nested": [(rank, "a", None), [0.30000000000000004, -0.0], {"e": 1e-310}]}


def _error(fn: Any) -> str:
    try:
        fn()
    except (TypeError, AssertionError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _rank(ctx: RankContext) -> None:
    import pickle_guard

    pickle_guard.install()
    dist.init_process_group("gloo", store=dist.PrefixStore("oc/", ctx.store), rank=ctx.rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=20))
    out: dict[str, Any] = {}
    box: list[Any] = [None] * WORLD
    out["torch_refused"] = _error(lambda: dist.all_gather_object(box, {"rank": ctx.rank}))
    with objects.json_object_collectives():
        dist.all_gather_object(box, _mine(ctx.rank))
        out["gathered_equal"] = box == [_mine(r) for r in range(WORLD)]
        out["types"] = [type(box[1]["key"]).__name__, type(box[2]["path"]).__name__,
                        type(box[0]["nested"][0]).__name__]
        # megatron-core's get_megatron_optimizer: gather every rank's keys, add those it lacks
        own = [(1.0, 1.0, False, False)] + ([(0.0, 1.0, False, False)] if ctx.rank == 2 else [])
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, own)
        merged = list(own)
        for keys in gathered:
            merged += [k for k in keys if k not in merged]
        out["merged"] = [list(k) for k in merged]
        listed: list[Any] = [f"logs/{ctx.rank}", (ctx.rank, 2)]
        dist.broadcast_object_list(listed, src=1)
        out["broadcast_equal"] = listed == ["logs/1", (1, 2)]
        # beyond one block (objects.INLINE bytes of JSON): one rank's object, then a broadcast one, take two rounds
        big = [ctx.rank, "x" * (objects.INLINE + 100 if ctx.rank == 1 else 3)]
        dist.all_gather_object(box, big)
        out["big_gathered"] = box == [[r, "x" * (objects.INLINE + 100 if r == 1 else 3)] for r in range(WORLD)]
        huge: list[Any] = [("y" * (3 * objects.INLINE), ctx.rank)] if ctx.rank == 2 else [None]
        dist.broadcast_object_list(huge, src=2)
        out["big_broadcast"] = huge == [("y" * (3 * objects.INLINE), 2)]
        bad = {1, 2} if ctx.rank == 2 else ctx.rank
        out["bad_gather"] = _error(lambda: dist.all_gather_object(box, bad))
        out["bad_broadcast"] = _error(lambda: dist.broadcast_object_list([object()] if ctx.rank == 0 else [None], 0))
        dist.all_gather_object(box, ctx.rank)
        out["after"] = box
    ctx.emit("out", out)


@pytest.mark.timeout(120)
def test_object_collectives_send_json_and_refuse_what_is_not() -> None:
    outs = emitted_by_ranks("test_object_collectives:_rank", WORLD, timeout_s=60)
    for r, out in outs.items():
        assert out["torch_refused"].startswith("PickleCrossedProcesses"), (r, out)
        assert out["gathered_equal"] and out["broadcast_equal"], (r, out)
        assert out["big_gathered"] and out["big_broadcast"], (r, {k: v for k, v in out.items() if "big" in k})
        assert out["types"] == ["tuple", "PosixPath", "tuple"], (r, out)
        assert out["merged"] == [[1.0, 1.0, False, False], [0.0, 1.0, False, False]], (r, out)
        assert out["bad_gather"].startswith("TypeError"), (r, out)
        assert ("set" in out["bad_gather"]) if r == 2 else ("group rank 2" in out["bad_gather"]), (r, out)
        assert out["bad_broadcast"].startswith("TypeError") and "never a pickle" in out["bad_broadcast"], (r, out)
        assert out["after"] == [0, 1, 2], (r, out)


def test_json_round_trip_keeps_tuples_paths_and_floats() -> None:
    value = {"t": (1, (2.5, None), [True]), "p": Path("/a/b"), "f": [0.1, 1e308, -0.0, 5e-324]}
    back = objects.from_bytes(objects.to_bytes(value))
    assert back == value and isinstance(back["t"][1], tuple) and isinstance(back["p"], Path)
    assert str(back["f"][2]) == "-0.0"
    for bad in ({1}, {1: "a"}, b"x", object()):
        with pytest.raises(TypeError, match="never a pickle"):
            objects.to_bytes(bad)
