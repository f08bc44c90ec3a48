"""`CheckpointlessMegatronStrategy.reduce` against Lightning's (`DDPStrategy.reduce`, `_sync_ddp`), on 3 real
processes and a gloo default group: the same values, in place, for every kind of `reduce_op` Lightning takes
(mean / avg on gloo: a sum divided by the world; an integer tensor divided as Lightning divides it), without the
barrier Lightning runs before its all-reduce."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import RankContext, emitted_by_ranks

WORLD = 3
OPS: list[Any] = ["mean", "avg", "sum", "max", "min", None, "SUM"]


def _rank(ctx: RankContext) -> None:
    from lightning.fabric.utilities.distributed import _sync_ddp

    from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy

    dist.init_process_group("gloo", store=dist.PrefixStore("reduce/", ctx.store), rank=ctx.rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=30))
    strategy = object.__new__(CheckpointlessMegatronStrategy)  # `reduce` reads nothing of the instance
    barrier = dist.barrier
    barriers: dict[str, int] = {"ours": 0, "lightning": 0}

    def counted(who: str, reduce: Any, *args: Any, **kwargs: Any) -> Any:
        """`reduce(...)` with torch.distributed.barrier counted under `who`."""
        def counting_barrier(*b_args: Any, **b_kwargs: Any) -> Any:
            barriers[who] += 1
            return barrier(*b_args, **b_kwargs)

        dist.barrier = counting_barrier  # type: ignore[assignment]
        try:
            return reduce(*args, **kwargs)
        finally:
            dist.barrier = barrier

    out: dict[str, Any] = {}
    for op in [*OPS, dist.ReduceOp.SUM]:
        for dtype in (torch.float32, torch.int64):
            values = torch.tensor([1.5 + ctx.rank, -2.0 * ctx.rank, 7.0]).to(dtype)
            ours, theirs = values.clone(), values.clone()
            got = counted("ours", strategy.reduce, ours, reduce_op=op)
            expected = counted("lightning", _sync_ddp, theirs, reduce_op=op if op is not None else "sum")
            out[f"{op}/{dtype}"] = [got.tolist(), expected.tolist(), got is ours, got.dtype == expected.dtype]
    out["not_a_tensor"] = strategy.reduce(3.0, reduce_op="sum")
    out["barriers"] = barriers
    ctx.emit("out", out)


@pytest.mark.nemo
@pytest.mark.timeout(240)
def test_reduce_equals_lightnings_without_its_barrier() -> None:
    outs = emitted_by_ranks("test_nemo_reduce:_rank", WORLD, timeout_s=180)
    for r, out in outs.items():
        barriers = out.pop("barriers")
        assert out.pop("not_a_tensor") == 3.0, (r, out)
        # The same count saw Lightning's barrier in each of its reduces: it would have seen one of ours.
        assert barriers == {"ours": 0, "lightning": len(out)}, (r, barriers)
        for case, (got, expected, in_place, same_dtype) in out.items():
            assert got == expected and in_place and same_dtype, (r, case, got, expected)
        assert out["mean/torch.float32"][0] == [2.5, -2.0, 7.0], out  # (1.5 + 2.5 + 3.5) / 3, ...
