"""Pure parts of recovery: the decision, the packed state format, the fallback checkpoint store."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch

from nemo_checkpointless.restart.channel import SideChannel
from nemo_checkpointless.restart.recovery import GATHERING, REPLACEMENT, SURVIVOR, decide
from nemo_checkpointless.state.checkpoint import CheckpointStore
from nemo_checkpointless.state.hashing import HASH_BYTES
from nemo_checkpointless.state.packing import PackError, checksum, pack, unpack
from nemo_checkpointless.topology import ParallelDims

DIMS = ParallelDims(world_size=4, num_instances=2)


def report(role: int, step: int, phase: int = 0, digest: int = 7) -> list[int]:
    return [role, step, phase, step, digest]


def test_p2p_when_every_lost_shard_has_a_live_replica() -> None:
    d = decide(DIMS, [report(SURVIVOR, 11), report(REPLACEMENT, -1), report(SURVIVOR, 11), report(SURVIVOR, 11)],
               None)
    assert d.path == "p2p" and d.step == 11 and d.replaced == (1,) and d.sources == {1: 3}


def test_both_replicas_lost_falls_back(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, num_shards=2)
    for shard in range(2):
        store.save_shard(10, shard, {"x": torch.ones(2)}, {"step": 10})
    d = decide(DIMS, [report(SURVIVOR, 11), report(REPLACEMENT, -1), report(SURVIVOR, 11),
                      report(REPLACEMENT, -1)], store)
    assert d.path == "checkpoint" and d.step == 10 and "both replicas" in d.reason


@pytest.mark.parametrize(
    "reports",
    [
        # a survivor one step behind: its step disagrees, it must not be used
        [report(SURVIVOR, 11), report(REPLACEMENT, -1), report(SURVIVOR, 10), report(SURVIVOR, 11)],
        # a survivor past the gradient all-reduce of the step in flight
        [report(SURVIVOR, 11), report(REPLACEMENT, -1), report(SURVIVOR, 11, phase=2), report(SURVIVOR, 11)],
        # same step, different data digest
        [report(SURVIVOR, 11), report(REPLACEMENT, -1), report(SURVIVOR, 11, digest=8), report(SURVIVOR, 11)],
    ],
)
def test_disagreeing_replicas_are_never_used(reports: list[list[int]]) -> None:
    d = decide(DIMS, reports, None)
    assert d.path == "checkpoint" and d.step == 0 and "disagrees" in d.reason


def test_a_survivor_left_in_the_parameter_all_gather_is_rolled_forward() -> None:
    # Rank 1 lost after step 12's gradient all-reduce: its partner rank 0 updated its shard and waits in the
    # instance's all-gather (11, GATHERING); instance 1 (ranks 2, 3) completed step 12.
    reports = [report(SURVIVOR, 11, GATHERING), report(REPLACEMENT, -1), report(SURVIVOR, 12), report(SURVIVOR, 12)]
    d = decide(DIMS, reports, None, roll_forward=True)
    assert (d.path, d.step, d.replaced, d.rolled_forward, d.sources) == ("p2p", 12, (1,), (0,), {0: 2, 1: 3}), d
    assert "complete that step from a replica" in d.reason
    # A participant that cannot roll forward, a survivor behind that is not gathering, or two steps behind: the
    # checkpoint, at the step the furthest-behind survivor completed.
    for roll, behind in ((False, report(SURVIVOR, 11, GATHERING)), (True, report(SURVIVOR, 11, 1)),
                         (True, report(SURVIVOR, 10, GATHERING))):
        d = decide(DIMS, [behind, *reports[1:]], None, roll_forward=roll)
        assert d.path == "checkpoint" and d.rolled_forward == () and "disagrees" in d.reason, d
    # Rank 0's gradient all-reduce of step 12 failed while it completed on ranks 2 and 3 (gloo's ring ends on each
    # rank at its own time; seen in the full tier): its gradients went into it, so it completes step 12 too, its
    # shard's state included; in a shrunk world (ranks 0-2 of 4), where the sum also says whether to grow back,
    # the checkpoint.
    d = decide(DIMS, [report(SURVIVOR, 11), *reports[1:]], None, roll_forward=True)
    assert (d.path, d.step, d.rolled_forward, d.sources) == ("p2p", 12, (0,), {0: 2, 1: 3}), d
    d = decide(DIMS, [report(SURVIVOR, 11), *reports[1:3]], None, [0, 1, 2], roll_forward=True)
    assert d.path == "checkpoint" and "disagrees" in d.reason, d
    # Both copies of shard 0 unavailable at step 12 (rank 2 lost too): no replica to roll rank 0 forward from.
    d = decide(DIMS, [reports[0], report(REPLACEMENT, -1), report(REPLACEMENT, -1), report(SURVIVOR, 12)], None,
               roll_forward=True)
    assert d.path == "checkpoint" and "one step behind" in d.reason, d


def test_a_survivor_past_a_gradient_all_reduce_the_others_never_completed_is_rewound() -> None:
    # Rank 3 lost inside step 6's gradient all-reduce, which completed on rank 2 only (gloo's ring ends on each rank
    # at its own time): rank 2 updated its shard for step 6 and waits in its instance's all-gather (5, GATHERING);
    # ranks 0 and 1 never got the sum (5, 0). Rank 2 takes boundary 5 back from its replica, rank 0 (as seen in CI
    # with seed 177832023 of test_a_rank_killed_from_outside_at_a_random_moment_ends_equal).
    reports = [report(SURVIVOR, 5), report(SURVIVOR, 5), report(SURVIVOR, 5, GATHERING), report(REPLACEMENT, -1)]
    d = decide(DIMS, reports, None, roll_forward=True)
    assert (d.path, d.step, d.replaced, d.rewound, d.rolled_forward, d.sources) == (
        "p2p", 5, (3,), (2,), (), {2: 0, 3: 1}), d
    assert "take their boundary 5 back from a replica" in d.reason
    # A participant that can neither roll forward nor rewind; a data digest that disagrees: the checkpoint.
    for roll, ahead in ((False, reports[2]), (True, report(SURVIVOR, 5, GATHERING, digest=8))):
        d = decide(DIMS, [*reports[:2], ahead, reports[3]], None, roll_forward=roll)
        assert d.path == "checkpoint" and d.rewound == () and "disagrees" in d.reason, d
    # Both copies of shard 0 past the all-reduce (ranks 0 and 2): no replica holds boundary 5 of that shard.
    d = decide(DIMS, [report(SURVIVOR, 5, GATHERING), *reports[1:]], None, roll_forward=True)
    assert d.path == "checkpoint" and "whose gradient all-reduce the others never completed" in d.reason, d


def test_single_instance_has_no_replica() -> None:
    dims = ParallelDims(world_size=4, num_instances=1)
    d = decide(dims, [report(SURVIVOR, 5), report(SURVIVOR, 5), report(REPLACEMENT, -1), report(SURVIVOR, 5)], None)
    assert d.path == "checkpoint"


def test_no_survivor_restarts_from_checkpoint() -> None:
    d = decide(DIMS, [report(REPLACEMENT, -1)] * 4, None)
    assert d.path == "checkpoint" and d.step == 0


def test_pack_round_trip_and_corruption() -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7), "s": torch.tensor(2.5), "e": torch.empty(0, 3)}
    buf = pack(tensors, {"step": 3, "nested": {"k": [1, 2]}})
    out, meta = unpack(buf)
    assert meta == {"step": 3, "nested": {"k": [1, 2]}}
    for k, v in tensors.items():
        assert torch.equal(out[k], v) and out[k].dtype == v.dtype
    bad = buf.clone()
    bad[3] = 255  # header length
    with pytest.raises(PackError):
        unpack(bad)
    with pytest.raises(PackError):
        unpack(buf[: buf.numel() // 2])
    flipped = buf.clone()
    flipped[-1] ^= 1
    assert checksum(flipped) != checksum(buf)


def _with_header(buf: torch.Tensor, edit: Callable[[dict[str, Any]], Any]) -> torch.Tensor:
    """`buf` with its JSON header replaced by `edit(header)` (the tensor bytes kept)."""
    hlen = int(buf[:8].clone().view(torch.int64)[0])
    header = edit(json.loads(bytes(buf[8 : 8 + hlen].tolist()).decode()))
    raw = json.dumps(header).encode()
    size = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([size, torch.frombuffer(bytearray(raw), dtype=torch.uint8), buf[8 + hlen :]])


def _set(entry_key: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(header: dict[str, Any]) -> dict[str, Any]:
        header["tensors"][0][entry_key] = value
        return header
    return edit


@pytest.mark.parametrize("edit", [
    _set("shape", [4, 5]),         # more elements than its bytes hold
    _set("shape", [-1]),           # a negative size
    _set("offset", -4),            # before the body
    _set("dtype", "torch.complex64"),  # a dtype that is never packed
    _set("nbytes", "many"),        # not a number
    lambda h: {k: v for k, v in h.items() if k != "meta"},  # no meta
    lambda h: [h],                 # not an object
])
def test_unpack_rejects_a_malformed_header(edit: Callable[[dict[str, Any]], Any]) -> None:
    buf = pack({"a": torch.randn(3, 5)}, {"step": 1})
    unpack(_with_header(buf, lambda h: h))  # the rewrite alone keeps it valid
    with pytest.raises(PackError):
        unpack(_with_header(buf, edit))


def test_checkpoint_store_skips_incomplete_and_detects_corruption(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", num_shards=2)
    assert store.latest(100) == 0
    for shard in range(2):
        store.save_shard(5, shard, {"x": torch.full((4,), float(shard))}, {"step": 5})
    store.save_shard(10, 0, {"x": torch.zeros(4)}, {"step": 10})  # shard 1 of step 10 never written
    assert store.steps() == [5] and store.latest(100) == 5 and store.latest(4) == 0
    tensors, meta = store.load_shard(5, 1)
    assert meta == {"step": 5} and torch.equal(tensors["x"], torch.ones(4))
    path = tmp_path / "ckpt" / "step_00000005" / "shard_1.safetensors"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        store.load_shard(5, 1)


def _two_checkpoints(tmp_path: Path) -> tuple[CheckpointStore, Path]:
    """Steps 5 and 10 of a 2-shard store; returns the store and the newest checkpoint's shard 1 file."""
    store = CheckpointStore(tmp_path / "ckpt", num_shards=2)
    for step in (5, 10):
        for shard in range(2):
            store.save_shard(step, shard, {"x": torch.full((1000,), float(step + shard)), "n": torch.tensor(step)},
                             {"step": step})
    assert store.latest(100) == 10
    return store, tmp_path / "ckpt" / "step_00000010" / "shard_1.safetensors"


def test_latest_skips_a_checkpoint_with_a_corrupt_byte(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, path = _two_checkpoints(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of a tensor: same size, same header
    path.write_bytes(bytes(data))
    assert store.steps() == [5, 10]  # the files are all there
    with caplog.at_level(logging.WARNING, logger="nemo_checkpointless.state.checkpoint"):
        assert store.latest(100) == 5
        assert store.latest(100) == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step 10" in warnings[0] and "checksum" in warnings[0], warnings
    assert store.latest(9) == 5
    tensors, meta = store.load_rank_state(5, 1)
    assert meta == {"step": 5} and torch.equal(tensors["x"], torch.full((1000,), 6.0))
    with pytest.raises(ValueError, match="checksum"):
        store.load_shard(10, 1)


def test_latest_skips_a_truncated_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store, path = _two_checkpoints(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    with caplog.at_level(logging.WARNING, logger="nemo_checkpointless.state.checkpoint"):
        assert store.latest(100) == 5
    assert any("truncated" in r.getMessage() for r in caplog.records), caplog.records
    with pytest.raises(ValueError, match="truncated"):
        store.load_shard(10, 1)
    # Both checkpoints broken: the seeded initial state.
    older = tmp_path / "ckpt" / "step_00000005" / "shard_0.safetensors"
    older.write_bytes(b"")
    assert store.latest(100) == 0


def test_checkpoint_shard_is_safetensors_with_json_meta(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", num_shards=1)
    flat = torch.arange(10.0)
    # An optimizer shard aliasing a slice of the flat parameters, as the strategy hands them over.
    tensors = {"param.flat": flat, "shard.main": flat[4:8], "bf": torch.ones(3, dtype=torch.bfloat16),
               "flag": torch.tensor(True), "empty": torch.empty(0, 4)}
    store.save_shard(3, 0, tensors, {"step": 3, "sched": [{"last_epoch": 3}]})
    path = tmp_path / "ckpt" / "step_00000003" / "shard_0.safetensors"
    plain = safetensors.torch.load_file(path)  # any safetensors reader opens it
    assert set(plain) == set(tensors) and torch.equal(plain["shard.main"], flat[4:8])
    with safetensors.safe_open(path, "pt") as f:
        assert json.loads(f.metadata()["meta"]) == {"step": 3, "sched": [{"last_epoch": 3}]}
    out, meta = store.load_shard(3, 0)
    assert meta == {"step": 3, "sched": [{"last_epoch": 3}]}
    for k, v in tensors.items():
        assert torch.equal(out[k], v) and out[k].dtype == v.dtype and out[k].shape == v.shape
    side = json.loads((path.parent / "shard_0.json").read_text())
    assert side["nbytes"] == path.stat().st_size
    assert not list(path.parent.glob(".*"))  # no temporary left


def test_checkpoint_store_shared_tensors_are_written_once_and_read_by_every_shard(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", num_shards=3)
    params = torch.arange(6.0)
    for shard in range(3):
        store.save_shard(4, shard, {"param.flat": params, "shard.m": torch.full((2,), float(shard))},
                         {"step": 4, "shard": shard}, shared_prefix="param.")
    assert "param.flat" not in store.load_shard(4, 2)[0]  # written by shard 0 only
    for shard in range(3):
        tensors, meta = store.load_rank_state(4, shard)
        assert meta["shard"] == shard and set(tensors) == {"param.flat", "shard.m"}
        assert torch.equal(tensors["param.flat"], params) and torch.equal(tensors["shard.m"], torch.full((2,), shard))
    # Without a shared prefix every shard is whole on its own (Megatron: params differ across TP/PP positions).
    store.save_shard(8, 1, {"model.w": torch.ones(2)}, {"step": 8})
    store.save_shard(8, 0, {"model.w": torch.zeros(2)}, {"step": 8})
    store.save_shard(8, 2, {"model.w": torch.full((2,), 2.0)}, {"step": 8})
    assert torch.equal(store.load_rank_state(8, 1)[0]["model.w"], torch.ones(2))


def test_the_side_channel_carries_every_ranks_values_exactly_through_a_sum() -> None:
    # Three ranks of a world of 4 (a shrunk one: rank 3 parked, rank 2 serving it); each writes its own slots, as
    # before the gradient all-reduce; the sum (the all-reduce's) gives every rank's value back.
    channel = SideChannel(world=4)
    hashes = {r: bytes([r + 1] * HASH_BYTES) for r in range(4)}
    sides = []
    for rank, served in ((0, [0]), (1, [1]), (2, [2, 3])):
        side = channel.compose({r: hashes[r] for r in served}, grow=rank == 1)
        channel.put_digest(side, rank, 0xFFFFFFFF - rank)
        side[channel.norm_at(rank)] = float("nan") if rank == 2 else 0.5 * rank
        sides.append(side)
    summed = torch.stack(sides).sum(0)
    assert summed.numel() == channel.numel == 4 * (HASH_BYTES + 1 + 4) + 1
    assert channel.hashes(summed) == [hashes[r] for r in range(4)]
    assert channel.grow(summed) and not channel.grow(sides[0])
    norms = channel.norms(summed, [0, 1, 2])
    assert norms[0] == 0.0 and norms[1] == 0.5 and norms[2] != norms[2], norms
    digests = channel.digests(summed).to(torch.int64).tolist()
    assert [int.from_bytes(bytes(digests[4 * r:4 * r + 4]), "little") for r in range(3)] == [
        0xFFFFFFFF, 0xFFFFFFFE, 0xFFFFFFFD]
