"""Silent corruption caught by the replicas (`integrity.every_n_steps`, `checkpointless-run --integrity-every`): a
bit flipped in one rank's optimizer shard, in memory, by nobody's error. Real processes, a user's own Lightning
script, compared with the fault-free run:

- N=3 on 6 ranks: the flipped copy (and the parameters its instance gathered from it) is outvoted, repaired p2p
  from the majority at the next check, and the run ends bitwise-equal;
- N=2 on 4 ranks: two copies that differ cannot say which is right: the job rolls back to the newest checkpoint at
  or before the last verified step and ends bitwise-equal;
- the verdict itself (pure), and bad input.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import child_env, finish_job

from nemo_checkpointless.config import IntegrityConfig
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.state.integrity import crc, judge

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
TIMEOUT_S = 240


def test_the_majority_wins_and_two_copies_that_differ_roll_back() -> None:
    groups = [(0, 2, 4), (1, 3, 5)]  # 6 ranks, N=3: the replica groups of shards 0 and 1
    params = {r: 7 for r in range(6)}
    shards = {0: 1, 2: 1, 4: 1, 1: 2, 3: 2, 5: 2}
    assert judge(params, shards, groups).action == "ok"
    v = judge({**params, 4: 8, 5: 8}, {**shards, 4: 9}, groups)  # rank 4's shard flipped, its instance gathered it
    assert (v.action, v.bad, v.sources) == ("repair", (4, 5), {4: 0, 5: 1}), v
    two = [(0, 2), (1, 3)]  # 4 ranks, N=2
    v = judge({0: 7, 1: 7, 2: 7, 3: 7}, {0: 1, 2: 1, 1: 2, 3: 5}, two)
    assert v.action == "rollback" and "no majority" in v.reason, v
    v = judge({0: 7, 1: 7, 2: 8, 3: 8}, {0: 1, 2: 1, 1: 2, 3: 2}, two)  # a tie of the parameters
    assert v.action == "rollback", v
    v = judge({0: 7, 1: 9, 2: 7, 3: 7}, {0: 1, 2: 1, 1: 2, 3: 2}, two)  # one rank's parameters alone
    assert (v.action, v.bad, v.sources) == ("repair", (1,), {1: 3}), v


def test_the_digest_sees_one_flipped_bit() -> None:
    import torch

    t = torch.randn(1000)
    before = crc([t])
    t.view(torch.int32)[333] ^= 1 << 12
    assert crc([t]) != before


def test_bad_integrity_settings_say_so() -> None:
    with pytest.raises(ConfigError, match=r"integrity.every_n_steps=-1"):
        IntegrityConfig(every_n_steps=-1)
    with pytest.raises(ConfigError, match=r"integrity.fence_after=0"):
        IntegrityConfig(fence_after=0)
    proc = subprocess.run([sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4",
                           "--integrity-every", "-2", str(SCRIPT)], env=child_env(), cwd=ROOT, capture_output=True,
                          timeout=TIMEOUT_S, check=False)
    out = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 2 and "--integrity-every=-2: must be >= 0" in out, out
    proc = subprocess.run([sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4",
                           "--fault", "bitflip:7:3", str(SCRIPT)], env=child_env(), cwd=ROOT, capture_output=True,
                          timeout=TIMEOUT_S, check=False)
    out = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 2 and "fault.plan[0].rank=7: must name a rank in 0..3" in out, out


def _run(run_dir: Path, world: int, *args: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", str(world), "--run-dir",
           str(run_dir), "--collective-timeout", "8", "--integrity-every", "3", *args, str(SCRIPT), "--devices",
           str(world), "--max-steps", "18", "--step-sleep", "0.02"]
    proc = subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return finish_job(proc, run_dir, "user_rank{r}.json", TIMEOUT_S, world_size=world)


def _assert_equal(reference: dict[str, Any], summary: dict[str, Any], world: int) -> None:
    brief = json.dumps(summary["integrity"], indent=1)
    assert summary["final_step"] == 18, brief
    assert summary["state_sha256"] == reference["state_sha256"], brief
    for r in range(world):
        for key in ("params_sha256", "shard_sha256"):
            assert summary["ranks"][r][key] == reference["ranks"][r][key], (r, key, brief)


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_flipped_bit_is_outvoted_with_three_instances_and_rolled_back_with_two(tmp_path: Path) -> None:
    reference = _run(tmp_path / "ref6", 6, "--num-instances", "3")
    integrity = reference["integrity"]
    assert integrity["checks"] == 5 and integrity["records"] == [], integrity  # at steps 3, 6, ..., 15
    # N=3: rank 4's AdamW state flipped as it starts step 9; the check after step 9 finds rank 4's shard and the
    # parameters of its instance (ranks 4, 5: rank 5 gathered rank 4's slice) outvoted, and repairs both p2p.
    flipped = _run(tmp_path / "n3", 6, "--num-instances", "3", "--fault", "bitflip:4:9")
    _assert_equal(reference, flipped, 6)
    [record] = flipped["integrity"]["records"]
    assert record["step"] == 9 and record["decision"] == "repair" and record["ranks"] == [4, 5], record
    assert record["repaired_from"] == {"4": 0, "5": 1}, record
    assert flipped["recoveries"] == [], flipped["recoveries"]
    assert all(len(p) == 1 for p in flipped["pids"].values()), flipped["pids"]
    # N=2: rank 1's copy and rank 3's differ, nobody can say which is right: back to the checkpoint of step 6 (the
    # last verified one), trained again from there.
    reference4 = _run(tmp_path / "ref4", 4, "--checkpoint-every", "3")
    rolled = _run(tmp_path / "n2", 4, "--checkpoint-every", "3", "--fault", "bitflip:1:8")
    _assert_equal(reference4, rolled, 4)
    [record] = rolled["integrity"]["records"]
    assert record["step"] == 9 and record["decision"] == "rollback" and record["rolled_back_to"] == 6, record
    assert "no majority" in record["reason"], record


def test_non_finite_state_is_never_a_majority() -> None:
    groups = [(0, 2, 4), (1, 3, 5)]
    params = {r: 7 for r in range(6)}
    shards = {0: 1, 2: 1, 4: 1, 1: 2, 3: 2, 5: 2}
    v = judge(params, shards, groups, {r: r != 3 for r in range(6)})
    assert (v.action, v.bad) == ("repair", (3,)) and "non-finite" in v.reason, v
    v = judge(params, shards, groups, {r: False for r in range(6)})  # equal NaNs everywhere
    assert v.action == "rollback", v
