"""The replicas' vote on both engines, with the same assertions: `checkpointless-train` of the built-in tiny Llama
on the Lightning engine (`recipe=tiny_llama_cpu`) and on the NeMo engine (`recipe=tiny_llama_nemo`, megatron-core's
distributed optimizer with `num_distributed_optimizer_instances`), one bit of one rank's optimizer shard flipped
in memory (`bitflip`), every run compared with the fault-free one of the same engine:

- N=3 on 6 ranks, the default settings (`integrity.every_n_steps=50`, past the job's end): the flipped copy's
  digest differs from its two replicas' in the next step, before the optimizer step reads it; the replicas vote on
  the state of the step's boundary, the flipped rank is outvoted and repaired p2p from the majority, the step is
  trained again, and the run ends bitwise-equal with the flip in `summary.json["integrity"]`;
- N=2 on 4 ranks: two copies that differ cannot say which is right: the job rolls back to the newest persistent
  checkpoint at or before the last verified step (every checkpoint is voted on before it is written), or to the
  seeded initial state without one, and ends bitwise-equal;
- the fault-free runs vote on the final state (a check, no record);
- every restore verified before the first step trains on it: a p2p restore damaged after its checksum passed
  (`corrupt_restore`) is caught and rolled back to the last verified checkpoint, and ends equal; damaged twice in a
  row, the job stops with the story (exit code 3) instead of looping;
- a NaN in one rank's gradient (`nan`, once) is attributed to that rank (each rank's own norm, before the
  reduction, rides the step's record) and the step trained again: bitwise-equal; one that comes back with the
  batch (`nan_batch`) is skipped (`integrity.nan_policy=skip`: the data moves on) or stops the job naming it.

On the NeMo engine a repaired rank may have fed the step's forward (a shard's fp32 main params are the
parameters' own memory), so every rank leaves `fit` and enters it again at the boundary (no rank fails: the
generation stays, no spare is used). Twelve launches per engine (~40 s each on NeMo, ~10 s on Lightning).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness import train_builtin, train_failing

from nemo_checkpointless.restart.integrity import STOPPED_EXIT_CODE

pytestmark = [pytest.mark.slow]

STEPS = 14
ENGINE = [pytest.param("lightning"), pytest.param("nemo", marks=[pytest.mark.nemo, pytest.mark.timeout(900)])]


def _train(run_dir: Path, engine: str, *overrides: str) -> dict[str, Any]:
    return train_builtin(run_dir, engine, f"trainer.max_steps={STEPS}", "launcher.collective_timeout_s=8", *overrides)


_REFERENCES: dict[str, dict[str, Any]] = {}


def _reference(engine: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fault-free run of `engine` on 4 ranks, N=2, a checkpoint every 3 steps (once per module and engine)."""
    if engine not in _REFERENCES:
        _REFERENCES[engine] = _train(tmp_path_factory.mktemp(f"ref_{engine}"), engine, "checkpoint.every_n_steps=3")
    return _REFERENCES[engine]


def _assert_equal(reference: dict[str, Any], summary: dict[str, Any], restarted: bool = False) -> None:
    """Equal to the fault-free run, every step trained once in the end; `restarted`: the job restarted whole once
    (every rank asked for it), else no rank was replaced (a vote is no recovery)."""
    brief = json.dumps(summary["integrity"], indent=1)
    assert summary["final_step"] == STEPS, brief
    assert summary["state_sha256"] == reference["state_sha256"], brief
    assert summary["data_sha256"] == reference["data_sha256"], f"a batch was repeated or skipped\n{brief}"
    recoveries = [(r["fault_kind"], r["path"], r["resumed_from_step"]) for r in summary["recoveries"]]
    assert recoveries == ([("bitflip+restart_requested", "restart", 0)] if restarted else []), summary["recoveries"]


@pytest.mark.parametrize("engine", ENGINE)
def test_three_copies_outvote_a_flipped_bit_with_the_default_settings(engine: str, tmp_path: Path) -> None:
    six = ["trainer.devices=6", "replication.num_instances=3", "checkpoint.every_n_steps=0"]
    reference = _train(tmp_path / "ref", engine, *six)
    assert reference["integrity"]["every_n_steps"] == 50, reference["integrity"]
    assert reference["integrity"]["records"] == [] and reference["integrity"]["checks"] >= 1, reference["integrity"]
    # Rank 4's AdamW state flipped as step 9 starts; its replicas are ranks 0 and 2.
    flipped = _train(tmp_path / "flip", engine, *six, "fault.plan=[{kind:bitflip,rank:4,step:9}]")
    _assert_equal(reference, flipped)
    [record] = flipped["integrity"]["records"]
    assert (record["step"], record["decision"], record["ranks"]) == (8, "repair", [4]), record
    assert record["repaired_from"] == {"4": 0}, record


@pytest.mark.parametrize("engine", ENGINE)
def test_two_copies_that_differ_roll_back_to_the_last_verified_checkpoint_or_the_start(
        engine: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = _reference(engine, tmp_path_factory)
    flip = "fault.plan=[{kind:bitflip,rank:3,step:9}]"
    # The checkpoints of steps 3 and 6 were voted on before they were written: the last verified step is 6.
    rolled = _train(tmp_path / "ckpt", engine, "checkpoint.every_n_steps=3", flip)
    _assert_equal(reference, rolled)
    [record] = rolled["integrity"]["records"]
    assert (record["step"], record["decision"], record["rolled_back_to"]) == (8, "rollback", 6), record
    assert 3 in record["ranks"], record
    # No checkpoint: back to the seeded initial state, trained again from step 1. The NeMo engine builds its model
    # again in every fit: in process. On the Lightning engine the user's script built it, before `fit`: every rank
    # asks the launcher to restart the job (`protocol.RESTART_ALL_EXIT_CODE`), and the record is the restarted
    # rank 0's.
    start = _train(tmp_path / "none", engine, "checkpoint.every_n_steps=0", flip)
    _assert_equal(reference, start, restarted=engine == "lightning")
    [record] = start["integrity"]["records"]
    assert (record["step"], record["decision"], record["rolled_back_to"]) == (8, "rollback", 0), record


@pytest.mark.parametrize("engine", ENGINE)
def test_a_restore_damaged_after_its_checksum_is_caught_and_rolled_back_twice_stops(
        engine: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = _reference(engine, tmp_path_factory)
    # Rank 1 killed at step 8; its replacement's state (from rank 3, checksum passed) is damaged as it is loaded.
    # The verification before the first step sees rank 1's shard differ from rank 3's: back to the checkpoint of
    # step 6 (the last verified), which verifies, and the run ends equal.
    common = ["checkpoint.every_n_steps=3", "replication.spares=1"]
    caught = _train(tmp_path / "caught", engine, *common,
                    "fault.plan=[{kind:corrupt_restore,rank:1,step:8},{kind:kill,rank:1,step:8}]")
    brief = json.dumps(caught["integrity"], indent=1)
    assert caught["final_step"] == STEPS and caught["state_sha256"] == reference["state_sha256"], brief
    assert caught["data_sha256"] == reference["data_sha256"], brief
    [record] = caught["integrity"]["records"]
    assert (record["step"], record["kind"], record["source"], record["decision"]) == (
        7, "restore_mismatch", "p2p", "rollback"), record
    assert record["rolled_back_to"] == 6 and record["ranks"] == [1, 3], record
    assert "rank 1's restored optimizer shard differ from its source rank 3's" in record["reason"], record
    # Damaged again when it loads that checkpoint: the second failed restore in a row stops the job with the story.
    out = train_failing(tmp_path / "twice", engine, STOPPED_EXIT_CODE, f"trainer.max_steps={STEPS}", *common,
                        "launcher.collective_timeout_s=8", "fault.plan=[{kind:corrupt_restore,rank:1,step:8},"
                        "{kind:corrupt_restore,rank:1,step:8},{kind:kill,rank:1,step:8}]")
    assert "the checkpoint restore at step 6 failed its verification" in out, out[-3000:]
    assert "the restore before it failed too, so the job stops instead of looping" in out, out[-3000:]


@pytest.mark.parametrize("engine", ENGINE)
def test_a_nan_is_attributed_and_trained_again_and_one_that_comes_back_is_skipped_or_stops_the_job(
        engine: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    reference = _reference(engine, tmp_path_factory)
    # Rank 2's gradient of step 6 made NaN once, before the reduction: every rank learns whose it is from the
    # norms each rank gave, no rank updates anything, the step is trained again, and the NaN does not come back.
    once = _train(tmp_path / "once", engine, "checkpoint.every_n_steps=3", "fault.plan=[{kind:nan,rank:2,step:6}]")
    _assert_equal(reference, once)
    [record] = once["integrity"]["records"]
    assert (record["step"], record["kind"], record["ranks"], record["reproduced"], record["decision"]) == (
        6, "nonfinite_gradient", [2], False, "rerun"), record
    # Every time step 6 is computed on rank 2: the batch gives it. skip: the step counts as done without an update,
    # the data moves on (the same batches as the fault-free run), so only the state differs.
    batch = "fault.plan=[{kind:nan_batch,rank:2,step:6}]"
    skipped = _train(tmp_path / "skip", engine, "checkpoint.every_n_steps=3", "integrity.nan_policy=skip", batch)
    assert skipped["final_step"] == STEPS and skipped["data_sha256"] == reference["data_sha256"]
    assert skipped["state_sha256"] != reference["state_sha256"], "step 6's update should be missing"
    [record] = skipped["integrity"]["records"]
    assert (record["step"], record["ranks"], record["reproduced"], record["decision"]) == (6, [2], True, "skip")
    assert record["samples"]["2"], record  # what rank 2 trained on in step 6, as its loader knows it
    # stop (the default): the job ends with exit code 3 and the story, naming the batch.
    out = train_failing(tmp_path / "stop", engine, STOPPED_EXIT_CODE, f"trainer.max_steps={STEPS}",
                        "launcher.collective_timeout_s=8", "checkpoint.every_n_steps=3", batch)
    assert ("step 6: the gradient of rank(s) [2] is not finite, and again when the step ran again with the same "
            "batch") in out, out[-3000:]
