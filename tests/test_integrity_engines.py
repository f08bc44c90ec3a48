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
- the fault-free runs vote on the final state (a check, no record).

On the NeMo engine a repaired rank may have fed the step's forward (a shard's fp32 main params are the
parameters' own memory), so every rank leaves `fit` and enters it again at the boundary (no rank fails: the
generation stays, no spare is used). Six launches per engine (~40 s each on NeMo, ~10 s on Lightning).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness import train_builtin

pytestmark = [pytest.mark.slow]

STEPS = 14
ENGINE = [pytest.param("lightning"), pytest.param("nemo", marks=[pytest.mark.nemo, pytest.mark.timeout(900)])]


def _train(run_dir: Path, engine: str, *overrides: str) -> dict[str, Any]:
    return train_builtin(run_dir, engine, f"trainer.max_steps={STEPS}", "launcher.collective_timeout_s=8", *overrides)


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
def test_two_copies_that_differ_roll_back_to_the_last_verified_checkpoint_or_the_start(engine: str,
                                                                                      tmp_path: Path) -> None:
    reference = _train(tmp_path / "ref", engine, "checkpoint.every_n_steps=3")
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
