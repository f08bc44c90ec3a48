"""Silent corruption caught by the replicas (`integrity.every_n_steps`, `checkpointless-run --integrity-every`): a
bit flipped in one rank's optimizer shard, in memory, by nobody's error. Real processes, a user's own Lightning
script, compared with the fault-free run:

- N=3 on 6 ranks, default settings: the flipped copy's digest differs from its replicas' in the next step's gradient
  all-reduce; it is outvoted and repaired p2p from the majority, the step runs again, and the run ends bitwise-equal;
- N=2 on 4 ranks: two copies that differ cannot say which is right: the job rolls back to the newest checkpoint at
  or before the last verified step and ends bitwise-equal;
- a flip in the parameters outside a rank's shard: repaired at the next periodic check, or by the vote on the final
  state before the job hands it over;
- a NaN in one rank's gradient (`nan`, once): attributed to that rank through the gradient all-reduce's side
  channel, the step run again, the run ends bitwise-equal; a batch that gives a NaN every time (`nan_batch`): named
  by its sample ids (checked against torch's own DistributedSampler), then skipped (`--nan-policy skip`: the data
  moves on, nothing is repeated or skipped in the data record) or the job stopped with the story (the default);
- every restore verified before the first step: a p2p restore damaged after its checksum passed
  (`corrupt_restore`) is caught and rolled back to the last verified checkpoint, and ends equal; damaged twice in a
  row, the job stops with the story instead of looping;
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
from nemo_checkpointless.restart.integrity import STOPPED_EXIT_CODE, NanGuard
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
    # TP=2 (NeMo): ranks 0, 2 hold one slice of the model and 1, 3 the other; their parameters differ by design.
    slices, tp_shards = [[0, 2], [1, 3]], [(0,), (2,), (1,), (3,)]
    assert judge({0: 7, 2: 7, 1: 8, 3: 8}, {0: 1, 2: 2, 1: 3, 3: 4}, tp_shards, param_groups=slices).action == "ok"
    v = judge({0: 7, 2: 7, 1: 8, 3: 8}, {0: 1, 2: 2, 1: 3, 3: 4}, tp_shards)  # compared across slices: no majority
    assert v.action == "rollback", v


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


def _cmd(run_dir: Path, world: int, *args: str, every: int | None = 3) -> list[str]:
    """`every`: --integrity-every (None: the default, 50, past the job's 18 steps)."""
    return [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", str(world), "--run-dir",
            str(run_dir), "--collective-timeout", "8", *(["--integrity-every", str(every)] if every else []), *args,
            str(SCRIPT), "--devices", str(world), "--max-steps", "18", "--step-sleep", "0.02"]


def _run(run_dir: Path, world: int, *args: str, every: int | None = 3) -> dict[str, Any]:
    proc = subprocess.Popen(_cmd(run_dir, world, *args, every=every), env=child_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return finish_job(proc, run_dir, "user_rank{r}.json", TIMEOUT_S, world_size=world)


def _stopped(run_dir: Path, *args: str) -> str:
    """A job that must stop itself: its exit code is 3 (`STOPPED_EXIT_CODE`); returns its output."""
    proc = subprocess.run(_cmd(run_dir, 4, *args), env=child_env(), cwd=ROOT, capture_output=True,
                          timeout=TIMEOUT_S, check=False)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == STOPPED_EXIT_CODE, f"exit code {proc.returncode}\n{out[-5000:]}"
    return out


@pytest.fixture(scope="module")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fault-free run on 4 ranks, N=2, a checkpoint every 3 steps."""
    summary = _run(tmp_path_factory.mktemp("integrity") / "ref4", 4, "--checkpoint-every", "3")
    assert summary["integrity"]["records"] == [] and summary["recoveries"] == [], summary["integrity"]
    return summary


def _assert_equal(reference: dict[str, Any], summary: dict[str, Any], world: int) -> None:
    brief = json.dumps(summary["integrity"], indent=1)
    assert summary["final_step"] == 18, brief
    assert summary["state_sha256"] == reference["state_sha256"], brief
    for r in range(world):
        for key in ("params_sha256", "shard_sha256"):
            assert summary["ranks"][r][key] == reference["ranks"][r][key], (r, key, brief)


@pytest.mark.slow
@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_flipped_bit_is_outvoted_with_three_instances_and_rolled_back_with_two(reference4: dict[str, Any],
                                                                                 tmp_path: Path) -> None:
    reference = _run(tmp_path / "ref6", 6, "--num-instances", "3")
    integrity = reference["integrity"]
    # At steps 3, 6, ..., 15, and once more on the final state (step 18) before the job hands it over.
    assert integrity["checks"] == 6 and integrity["records"] == [], integrity
    # N=3, the default interval (50, past the job's end): rank 4's AdamW state flipped as it starts step 9. Its
    # shard's digest, in step 9's gradient all-reduce, differs from its two replicas' before the update reads it: the
    # step's gradients are dropped, the replicas vote on the state of boundary 8 (rank 4 outvoted, repaired p2p from
    # rank 0), and every rank runs step 9 again. Caught by the defaults, it ends equal.
    flipped = _run(tmp_path / "n3", 6, "--num-instances", "3", "--fault", "bitflip:4:9", every=None)
    _assert_equal(reference, flipped, 6)
    [record] = flipped["integrity"]["records"]
    assert record["step"] == 8 and record["decision"] == "repair" and record["ranks"] == [4], record
    assert record["repaired_from"] == {"4": 0}, record
    assert flipped["integrity"]["every_n_steps"] == 50 and flipped["integrity"]["checks"] == 2, flipped["integrity"]
    assert flipped["integrity"]["step_digest_s"] > 0, flipped["integrity"]  # rank 0 took its digest every step
    assert flipped["recoveries"] == [], flipped["recoveries"]
    assert all(len(p) == 1 for p in flipped["pids"].values()), flipped["pids"]
    # N=2: rank 1's copy and rank 3's differ in step 8's digests, nobody can say which is right: back to the
    # checkpoint of step 6 (the last verified one), trained again from there.
    rolled = _run(tmp_path / "n2", 4, "--checkpoint-every", "3", "--fault", "bitflip:1:8")
    _assert_equal(reference4, rolled, 4)
    [record] = rolled["integrity"]["records"]
    assert record["step"] == 7 and record["decision"] == "rollback" and record["rolled_back_to"] == 6, record
    assert "no majority" in record["reason"], record
    # A bit of rank 1's parameters (outside its own shard: no digest of its covers it) flipped at rest, after step
    # 9's all-gather: outvoted by the three others at the check of step 9, before any forward uses it, and repaired
    # from rank 3. The same on rank 2 after the last step's all-gather: the vote on the final state repairs it from
    # rank 0 before the job hands the state over.
    param = _run(tmp_path / "param", 4, "--checkpoint-every", "3", "--fault", "bitflip:1:9:param", "--fault",
                 "bitflip:2:18:param")
    _assert_equal(reference4, param, 4)
    first, last = param["integrity"]["records"]
    assert (first["step"], first["decision"], first["ranks"]) == (9, "repair", [1]), first
    assert first["repaired_from"] == {"1": 3}, first
    assert (last["step"], last["decision"], last["ranks"]) == (18, "repair", [2]), last
    assert last["repaired_from"] == {"2": 0}, last


def test_the_per_step_digests_find_the_copy_that_differs() -> None:
    """`encode_digest` slots summed over the ranks (as the gradient all-reduce sums the side channel) carry every
    rank's 32-bit digest exactly; `copies_differ` compares them within each replica group."""
    import torch

    from nemo_checkpointless.restart.integrity import DIGEST_SLOTS, IntegrityCheck, encode_digest
    from nemo_checkpointless.topology import ParallelDims

    check = IntegrityCheck(engine=None, dims=ParallelDims(world_size=4, num_instances=2))  # type: ignore[arg-type]
    same = {0: 0xDEADBEEF, 1: 0x01020304, 2: 0xDEADBEEF, 3: 0x01020304}  # ranks 0, 2 and 1, 3 hold one shard each

    def summed(digests: dict[int, int]) -> torch.Tensor:
        out = torch.zeros(4 * DIGEST_SLOTS)
        for r, d in digests.items():
            part = torch.zeros(4 * DIGEST_SLOTS)
            part[r * DIGEST_SLOTS:(r + 1) * DIGEST_SLOTS] = encode_digest(d)
            out += part
        return out

    assert not check.copies_differ(summed(same), range(4))
    for bit in (0, 7, 8, 31):  # one bit of rank 3's digest, in each byte's edge
        assert check.copies_differ(summed({**same, 3: same[3] ^ (1 << bit)}), range(4)), bit


def test_non_finite_state_is_never_a_majority() -> None:
    groups = [(0, 2, 4), (1, 3, 5)]
    params = {r: 7 for r in range(6)}
    shards = {0: 1, 2: 1, 4: 1, 1: 2, 3: 2, 5: 2}
    v = judge(params, shards, groups, {r: r != 3 for r in range(6)})
    assert (v.action, v.bad) == ("repair", (3,)) and "non-finite" in v.reason, v
    v = judge(params, shards, groups, {r: False for r in range(6)})  # equal NaNs everywhere
    assert v.action == "rollback", v


@pytest.mark.slow
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_a_nan_is_attributed_rerun_or_named_by_its_samples(reference4: dict[str, Any], tmp_path: Path) -> None:
    import torch
    from torch.utils.data import DistributedSampler

    # Once, on rank 2 at step 7: the side channel names rank 2, every rank runs step 7 again from its boundary,
    # the NaN does not come back (the rank is suspect, not the batch), and the run is the fault-free one.
    once = _run(tmp_path / "once", 4, "--checkpoint-every", "3", "--fault", "nan:2:7")
    _assert_equal(reference4, once, 4)
    assert once["data_sha256"] == reference4["data_sha256"]
    [record] = once["integrity"]["records"]
    assert (record["step"], record["kind"], record["ranks"]) == (7, "nonfinite_gradient", [2]), record
    assert record["reproduced"] is False and record["strikes"] == {"2": 1}, record
    assert once["recoveries"] == [] and all(len(p) == 1 for p in once["pids"].values()), once["recoveries"]
    # Every time rank 1 computes step 5 (its batch gives it): reproduced, named by sample ids, skipped.
    skipped = _run(tmp_path / "skip", 4, "--checkpoint-every", "3", "--nan-policy", "skip", "--fault",
                   "nan_batch:1:5")
    [record] = skipped["integrity"]["records"]
    assert (record["step"], record["ranks"], record["reproduced"], record["decision"]) == (5, [1], True, "skip")
    # The sample ids of rank 1's step 5 (epoch 0, its 5th batch of 8), as torch's own sampler orders them.
    order = list(DistributedSampler(torch.arange(512), num_replicas=4, rank=1, shuffle=True, seed=1234))
    samples = record["samples"]["1"]
    assert samples["step"] == 5 and samples["sample_ids"] == [order[32:40]], samples
    assert skipped["final_step"] == 18 and skipped["data_sha256"] == reference4["data_sha256"]  # data moved on
    assert skipped["state_sha256"] != reference4["state_sha256"]  # one update fewer
    # The default policy: the job stops, with the story and the samples, instead of training on.
    out = _stopped(tmp_path / "stop", "--fault", "nan_batch:1:5")
    assert "rank 1 stopped the job: step 5: the gradient of rank(s) [1] is not finite" in out, out[-3000:]
    assert str(order[32:40]) in out and "integrity.nan_policy=stop" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_a_restore_damaged_after_its_checksum_is_caught_before_the_first_step(reference4: dict[str, Any],
                                                                             tmp_path: Path) -> None:
    # Rank 1 killed at step 8; its replacement's state (from rank 3, checksum passed) is damaged as it is loaded.
    # The verification before the first step sees rank 1's shard differ from rank 3's: back to the checkpoint of
    # step 6 (the last verified), which verifies, and the run ends equal.
    plan = ("--spares", "1", "--checkpoint-every", "3", "--fault", "corrupt_restore:1:8", "--fault", "kill:1:8")
    caught = _run(tmp_path / "caught", 4, *plan)
    _assert_equal(reference4, caught, 4)
    [record] = caught["integrity"]["records"]
    assert (record["step"], record["kind"], record["source"], record["decision"]) == (
        7, "restore_mismatch", "p2p", "rollback"), record
    assert record["rolled_back_to"] == 6 and record["ranks"] == [1, 3], record
    assert "rank 1's restored optimizer shard differ from its source rank 3's" in record["reason"], record
    # Damaged again when it loads that checkpoint: the second failed restore in a row stops the job with the story.
    out = _stopped(tmp_path / "twice", *plan[:4], "--fault", "corrupt_restore:1:8", *plan[4:])  # before the kill
    assert "the checkpoint restore at step 6 failed its verification" in out, out[-3000:]
    assert "the restore before it failed too, so the job stops instead of looping" in out, out[-3000:]


def test_the_nan_guard_attributes_and_decides() -> None:
    import datetime

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=5))
    guard = NanGuard(store=store, rank=0, policy="skip", fence_after=2)
    nan, ok = float("nan"), 1.0
    assert guard.judge(3, {0: ok, 1: ok}, lambda: None) == "ok"
    assert guard.judge(4, {0: ok, 1: nan}, lambda: None) == "rerun"
    assert guard.judge(4, {0: ok, 1: ok}, lambda: None) == "ok"  # gone when run again: rank 1 is suspect
    assert guard.records[-1]["reproduced"] is False and guard.strikes == {1: 1}
    assert guard.judge(6, {0: float("inf"), 1: ok}, lambda: None) == "rerun"
    assert guard.judge(6, {0: float("inf"), 1: ok}, lambda: {"sample_ids": [[1, 2]]}) == "skip"
    assert guard.records[-1]["samples"] == {"0": {"sample_ids": [[1, 2]]}}, guard.records[-1]


def test_bad_nan_and_bitflip_settings_say_so() -> None:
    with pytest.raises(ConfigError, match=r"integrity.nan_policy=ignore: must be one of stop, skip"):
        IntegrityConfig(nan_policy="ignore")
    for args, message in ((("--nan-policy", "ignore"), "integrity.nan_policy=ignore: must be one of stop, skip"),
                          (("--fault", "bitflip:1:3:moments"), "fault.plan[0].target=moments: must be one of shard, "
                                                               "param"),
                          (("--fault", "kill:1:3:param"), "fault.plan[0].target=param: must be one of gather"),
                          (("--fault", "hang:1:3:param"), "fault.plan[0].target=param: kind hang takes none")):
        proc = subprocess.run([sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4", *args,
                               str(SCRIPT)], env=child_env(), cwd=ROOT, capture_output=True, timeout=TIMEOUT_S,
                              check=False)
        out = (proc.stdout + proc.stderr).decode()
        assert proc.returncode == 2 and message in out, out
