"""No spare left: the job shrinks to its whole optimizer instances and grows back when a spare is ready
(`replication.shrink`, `checkpointless-run --shrink`). Real processes and kills, a user's own Lightning script
(dropout, AdamW, an LR schedule, a shuffled DataLoader), compared with the fault-free run:

- the same samples in every global step (`data_sha256`, which hashes every rank's batch of every step, is the
  fault-free run's), a held-out loss curve within float tolerance of it;
- growing back is deterministic: a run that grew back when its spare was ready ends bitwise-equal to a run told
  to grow back at that same step (fault plan `grow`);
- a fault while shrunk grows the job back at once (the parked rank rejoins); the lost shard then has no live
  replica, so the job falls back to the checkpoint and says so;
- bad input: one clear message each, at start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import child_env, finish_job

from nemo_checkpointless.config import Config, ReplicationConfig
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.topology import ParallelDims
from nemo_checkpointless.topology.shrink import served_ranks, shrink_layout

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
TIMEOUT_S = 240
STEPS = 80
ARGS = ("--max-steps", str(STEPS), "--step-sleep", "0.05", "--eval-loss")
# Relative difference of the held-out loss allowed at any step: a shrunk world sums the same gradients in another
# order (two ranks, each adding two micro-batches, instead of four ranks), which changes the last bits only.
LOSS_RTOL = 1e-5


def test_shrink_keeps_whole_instances_and_serves_the_dropped_ranks() -> None:
    dims = ParallelDims(world_size=4, num_instances=2)  # instances {0, 1} and {2, 3}
    assert shrink_layout(dims, [1]) == (2, 3)
    assert [served_ranks(dims, (2, 3), r) for r in range(4)] == [(), (), (0, 2), (1, 3)]
    assert served_ranks(dims, None, 1) == (1,)
    assert shrink_layout(dims, [1, 2]) is None  # no instance is whole
    assert shrink_layout(ParallelDims(world_size=4, num_instances=1), [1]) is None  # nothing to shrink to
    four = ParallelDims(world_size=8, num_instances=4)  # instances {0,1} {2,3} {4,5} {6,7}
    # Three whole instances, but 3 does not divide 4: two go on, each serving one dropped instance's ranks.
    assert shrink_layout(four, [1]) == (2, 3, 4, 5)
    assert [served_ranks(four, (2, 3, 4, 5), r) for r in (2, 3, 4, 5)] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert shrink_layout(four, [1, 7]) == (2, 3, 4, 5)


def test_bad_shrink_settings_say_so_at_start_up() -> None:
    with pytest.raises(ConfigError, match=r"replication.shrink=True: needs replication.num_instances >= 2"):
        ReplicationConfig(num_instances=1, shrink=True)
    with pytest.raises(ConfigError, match=r"replication.replacement_timeout_s=-1: must be >= 0 seconds"):
        ReplicationConfig(replacement_timeout_s=-1)
    with pytest.raises(ConfigError, match=r"replication.shrink=True: is built for engine=lightning"):
        Config(engine="nemo", replication=ReplicationConfig(shrink=True))


def _launch(run_dir: Path, *args: str, script_args: tuple[str, ...] = ARGS) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           "--collective-timeout", "8", *args, str(SCRIPT), *script_args]
    return subprocess.Popen(cmd, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _run(run_dir: Path, *args: str, script_args: tuple[str, ...] = ARGS) -> dict[str, Any]:
    return finish_job(_launch(run_dir, *args, script_args=script_args), run_dir, "user_rank{r}.json", TIMEOUT_S)


def _curve(run_dir: Path, rank: int) -> dict[int, float]:
    lines = (line.split() for line in (run_dir / f"eval_loss_rank{rank}.txt").read_text().splitlines())
    return {int(step): float(loss) for step, loss in lines}


@pytest.mark.slow
@pytest.mark.timeout(4 * TIMEOUT_S)
def test_shrink_then_grow_trains_the_same_samples_and_grows_back_deterministically(tmp_path: Path) -> None:
    reference = _run(tmp_path / "ref")
    # No spare: the kill at step 5 shrinks the job to instance 1 (ranks 2, 3; rank 0 parks); the spare started for
    # rank 1 then warms up and the job grows back when it is ready.
    shrunk = _run(tmp_path / "shrunk", "--shrink", "--fault", "kill:1:5")
    brief = json.dumps(shrunk["recoveries"], indent=1)
    kinds = [(r["kind"], r["active_ranks"]) for r in shrunk["reshapes"]]
    assert kinds == [("shrink", [2, 3]), ("grow", None)], brief
    shrink, grow = shrunk["recoveries"]
    assert shrink["step"] == 5 and shrink["resumed_from_step"] == 4 and shrink["steps_lost"] == 0, brief
    assert shrink["replacement"] == {"1": "none: the job shrank"}, brief
    assert grow["failed_ranks"] == [0, 1] and grow["path"] == "p2p", brief
    grew_after = grow["resumed_from_step"]
    assert 5 <= grew_after <= STEPS, brief
    # Grown back when the spare was ready; or, on a machine slow to start it, after the last step (a shrunk world
    # does not end shrunk), when the spare may still be starting.
    spare = {"warm spare"} if grew_after < STEPS else {"warm spare", "starting spare"}
    assert grow["replacement"]["0"] == "parked survivor" and grow["replacement"]["1"] in spare, brief
    # Every survivor kept its process, the parked rank 0 too.
    assert [len(shrunk["pids"][str(r)]) for r in range(4)] == [1, 2, 1, 1], shrunk["pids"]
    assert shrunk["final_step"] == STEPS
    # The same samples in every global step as the fault-free run, shrunk or not.
    assert shrunk["data_sha256"] == reference["data_sha256"], brief
    # A loss curve within float tolerance of the fault-free run's, at every step.
    ref_curve, curve = _curve(tmp_path / "ref", 3), _curve(tmp_path / "shrunk", 3)
    assert sorted(curve) == sorted(ref_curve) == list(range(1, STEPS + 1))
    worst = max(abs(curve[s] - ref_curve[s]) / abs(ref_curve[s]) for s in ref_curve)
    assert worst < LOSS_RTOL, worst
    # The replicas agree again after growing back (every rank's parameters equal, each shard on both instances).
    ranks = shrunk["ranks"]
    assert len({ranks[r]["params_sha256"] for r in range(4)}) == 1
    assert ranks[0]["shard_sha256"] == ranks[2]["shard_sha256"] and ranks[1]["shard_sha256"] == ranks[3]["shard_sha256"]
    # Determinism: told to grow back after that same step, a run ends bitwise-equal.
    told = _run(tmp_path / "told", "--shrink", "--fault", "kill:1:5", "--fault", f"grow:2:{grew_after}")
    assert [(r["kind"], r["step"]) for r in told["reshapes"]] == [("shrink", 4), ("grow", grew_after)]
    assert told["state_sha256"] == shrunk["state_sha256"]
    for r in range(4):
        assert told["ranks"][r]["params_sha256"] == ranks[r]["params_sha256"]
        assert told["ranks"][r]["shard_sha256"] == ranks[r]["shard_sha256"]
    assert told["data_sha256"] == reference["data_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
def test_a_shrunk_world_grows_back_before_it_ends(tmp_path: Path) -> None:
    # Shrunk at step 5 of 8, and still shrunk when the last step is done. The job does not end shrunk: it grows
    # back after step 8, and every rank, the parked rank 0 too (the rank that saves the model in most scripts),
    # leaves `fit` with the final state and runs the rest of the script. The plan's `grow` at step 9 (never
    # reached) keeps the launcher from growing back when the spare is ready, however soon that is: without it, a
    # spare ready before step 8 grew the job back mid-run and the end was never tested.
    steps = 8
    summary = _run(tmp_path / "end", "--shrink", "--fault", "kill:1:5", "--fault", f"grow:2:{steps + 1}",
                   script_args=("--max-steps", str(steps), "--step-sleep", "0.05"))
    brief = json.dumps(summary["recoveries"], indent=1)
    assert [r["kind"] for r in summary["reshapes"]] == ["shrink", "grow"], brief
    grow = summary["recoveries"][1]
    assert grow["failed_ranks"] == [0, 1] and grow["path"] == "p2p", brief
    assert grow["resumed_from_step"] == steps, brief  # grown back after the last step, not before
    assert grow["replacement"]["0"] == "parked survivor", brief
    assert summary["final_step"] == steps
    assert [len(summary["pids"][str(r)]) for r in range(4)] == [1, 2, 1, 1], summary["pids"]
    ranks = summary["ranks"]  # every rank wrote its file after `fit`
    assert [ranks[r]["global_step"] for r in range(4)] == [steps] * 4, ranks
    assert len({ranks[r]["params_sha256"] for r in range(4)}) == 1
    assert ranks[0]["shard_sha256"] == ranks[2]["shard_sha256"] and ranks[1]["shard_sha256"] == ranks[3]["shard_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_fault_while_shrunk_grows_back_at_once_and_falls_back_when_no_replica_is_left(tmp_path: Path) -> None:
    # Rank 1 lost at step 5 (shrunk to ranks 2, 3); rank 2 lost at step 10, while shrunk: both copies of shard 0
    # (ranks 0, parked since step 4, and 2) are gone, so the job grows back at once and every rank reloads the
    # checkpoint of step 8, written by the instance that was training.
    # The plan's `grow` after the last step keeps the job shrunk until the second fault, however soon the spare
    # is ready (the launcher grows back at a planned step only).
    summary = _run(tmp_path / "twice", "--shrink", "--checkpoint-every", "4", "--fault", "kill:1:5",
                   "--fault", "kill:2:10", "--fault", f"grow:2:{STEPS}")
    brief = json.dumps(summary["recoveries"], indent=1)
    assert [r["kind"] for r in summary["reshapes"]] == ["shrink", "grow"], brief
    second = summary["recoveries"][1]
    assert second["step"] == 10 and second["path"] == "checkpoint" and second["resumed_from_step"] == 8, brief
    assert "shard" in second["reason"], brief
    assert second["failed_ranks"] == [0, 1, 2], brief
    assert summary["final_step"] == STEPS


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_shrink_refused_for_a_loader_it_cannot_serve(tmp_path: Path) -> None:
    cases = {
        "one_instance": (["--nproc-per-node", "4", "--shrink", "--num-instances", "1"], ["--max-steps", "4"]),
        "timeout": (["--nproc-per-node", "4", "--shrink", "--replacement-timeout", "-1"], ["--max-steps", "4"]),
        "mmap": (["--nproc-per-node", "2", "--shrink", "--run-dir", str(tmp_path / "mmap")],
                 ["--max-steps", "4", "--devices", "2", "--datamodule", "--mmap"]),
    }
    # All three at once: each only starts up, and one after the other they took more than 300 s on a loaded
    # 2-core machine (at once: 280 s there, the last one's two ranks importing Lightning).
    procs = {name: subprocess.Popen([sys.executable, "-m", "nemo_checkpointless.cli.run", *args, str(SCRIPT),
                                     *script_args], env=child_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
             for name, (args, script_args) in cases.items()}
    done = {name: (p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"), p.returncode)
            for name, p in procs.items()}

    out, code = done["one_instance"]
    assert code == 2 and "--shrink=True: needs --num-instances >= 2" in out, out
    out, code = done["timeout"]
    assert code == 2 and "--replacement-timeout=-1.0: must be >= 0 seconds" in out, out
    # The shared-memory cache serves each rank its own batches only: refused before any rank trains.
    out, code = done["mmap"]
    assert code != 0 and "replication.shrink (checkpointless-run --shrink)=True" in out, out
    assert "MmapDataModule" in out, out
