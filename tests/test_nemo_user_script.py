"""A NeMo 2 user's own script (`tests/scripts/user_nemo.py`: its own tiny `llm.GPTModel(Llama3Config(...))`,
`MockDataModule`, `nl.MegatronOptimizerModule`, `nl.Trainer` with `CheckpointlessMegatronStrategy` and
`CheckpointlessCallback`, `llm.train`) under `checkpointless-run --nproc-per-node 4 --spares 1`:

- a rank chosen at random is SIGKILLed from the test at a random moment of training (the seed is printed: set
  NCL_TEST_SEED to replay it), with the data module wrapped in `MmapDataModule` (tier 2): the job ends
  bitwise-equal to the fault-free run without the wrapper (every rank's parameters, optimizer shard and RNG; the
  same global batches in the same order), the healthy ranks keep their pids, and the replacement's micro-batches
  came from the shared-memory cache;
- tensor and pipeline parallelism (TP=2 or PP=2, with DP=2, N=2): a kill at a step boundary of a run through
  `MmapDataModule` recovers p2p from the rank that holds the same TP/PP slice in the other optimizer instance, the
  replacement's first micro-batch comes from the cache, and it ends equal to the bare module's fault-free run of the
  same layout; with TP=2, both replicas of one slice lost at once fall back to the persistent checkpoint (one file
  per slice) and end equal too;
- one and two optimizer instances (N=1, N=2; DP=4), fault-free, end with the same `state_sha256`, and the
  parameters moved from their initial values;
- a strategy and a callback that do not pair (NeMo's own `MegatronStrategy` with our callback; our strategy without
  it) stop the job before training with one message.

The script logs every step each of its processes completes (`--step-log`, read by tests/steplog.py): the faulted
runs show from the ranks' own records that no step ran twice (but those a fallback repeats), that the ranks the test
did not kill kept their process, and the fault-free run's batches.

Ten launches (~15-60 s each on 2 cores). Skipped without the [nemo] extra.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import steplog
from harness import child_env, finish_job, job_progress, said

from nemo_checkpointless.launcher.procs import rank_pids

pytestmark = [pytest.mark.nemo, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_nemo.py"
STEPS = 12
TIMEOUT_S = 400


def _launch(run_dir: Path, *args: str, script_args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           "--collective-timeout", "8", "--max-restarts", "2", *args, str(SCRIPT), "--max-steps", str(STEPS),
           "--step-log", *script_args]
    return subprocess.Popen(cmd, env=child_env(tests_on_path=True), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[bytes], run_dir: Path) -> dict[str, Any]:
    return {**finish_job(proc, run_dir, "nemo_rank{r}.json", TIMEOUT_S), "run_dir": run_dir}


def _assert_ran(reference: dict[str, Any], summary: dict[str, Any], killed: dict[int, int],
                replays: list[tuple[int, int]] | None = None) -> None:
    """From the ranks' own step logs (`steplog.assert_steps`): every step once per rank (twice where `replays` says
    a fallback repeats it; not at all the one a replacement received done, when a kill from outside landed in a
    parameter all-gather: `steplog.received_steps`), ranks not in `killed` in one process, the reference's
    batches; and the process that wrote each rank's final record (its `os.getpid()`) is the one that logged the
    rank's last step."""
    received = steplog.received_steps(Path(summary["run_dir"]), summary["recoveries"])
    steplog.assert_steps(summary["run_dir"], STEPS, killed=killed, replays=replays or [], not_completed=received,
                         reference=reference["run_dir"],
                         final_pids={r: summary["ranks"][r]["pid"] for r in range(4)})


def _progress(run_dir: Path) -> int:
    return job_progress(run_dir)


def _assert_equal(reference: dict[str, Any], summary: dict[str, Any]) -> None:
    assert summary["final_step"] == STEPS, summary["recoveries"]
    assert summary["state_sha256"] == reference["state_sha256"], json.dumps(summary["recoveries"], indent=1)
    assert summary["data_sha256"] == reference["data_sha256"], "a batch was repeated or skipped"
    for r in range(4):
        for key in ("params_sha256", "shard_sha256", "rng_sha256"):
            assert summary["ranks"][r][key] == reference["ranks"][r][key], (r, key, summary["recoveries"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("user_nemo") / "faultfree"
    # --params-digest (read-only: a hash of the parameters at the start and the end) for the N=1 against N=2 test
    summary = _finish(_launch(run_dir, script_args=("--params-digest",)), run_dir)
    assert summary["final_step"] == STEPS and summary["recoveries"] == []
    steplog.assert_steps(run_dir, STEPS)
    # DP=4, N=2: ranks r and r+2 hold the same shard (main params + optimizer state), bitwise; the two shards differ.
    shards = [summary["ranks"][r]["shard_sha256"] for r in range(4)]
    assert shards[0] == shards[2] != shards[1] == shards[3], shards
    return summary


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_killed_at_a_random_moment_ends_equal_and_survivors_keep_their_pids(reference: dict[str, Any],
                                                                            tmp_path: Path) -> None:
    seed = int(os.environ.get("NCL_TEST_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    # After at most step STEPS - 6 and 0.25 s: the kill lands inside training, whose last 6 steps take longer than
    # that (about 0.1 s a step here; in 0.5 s after step 5 of 12, a kill could land past the last step).
    victim, after_step, delay = rng.randrange(4), rng.randrange(2, STEPS - 5), rng.uniform(0.0, 0.25)
    print(f"NCL_TEST_SEED={seed}: SIGKILL rank {victim} {delay:.2f} s after every rank completed step {after_step}")
    run_dir = tmp_path / "killed"
    proc = _launch(run_dir, "--spares", "1", script_args=("--mmap",))
    deadline = time.monotonic() + TIMEOUT_S
    while _progress(run_dir) < after_step:
        assert proc.poll() is None and time.monotonic() < deadline, "the job ended before the kill"
        time.sleep(0.005)
    time.sleep(delay)
    before = rank_pids(run_dir)
    os.kill(before[victim], signal.SIGKILL)
    summary = _finish(proc, run_dir)
    _assert_equal(reference, summary)
    (record,) = summary["recoveries"]
    # The spare (started with the job: imports, model, warm-up) may still be starting when an early kill comes.
    assert record["failed_ranks"] == [victim], record
    assert record["replacement"][str(victim)] in ("warm spare", "starting spare"), record
    for r in range(4):
        if r != victim:
            assert summary["ranks"][r]["pid"] == before[r], f"rank {r} was restarted: {record}"
    assert summary["ranks"][victim]["pid"] != before[victim]
    _assert_ran(reference, summary, killed={victim: 1})  # through the cache, the bare module's batches
    assert summary["ranks"][victim]["data_cache"]["hits"] > 0, summary["ranks"][victim]


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2")], ids=["tp2", "pp2"])
def test_model_parallel_kill_recovers_p2p_and_ends_equal(layout: tuple[str, str], tmp_path: Path) -> None:
    reference = _finish(_launch(tmp_path / "faultfree", script_args=layout), tmp_path / "faultfree")
    run_dir = tmp_path / "killed"
    # The spare warms megatron's fused functions up for each TP rank's shapes (`warm_up_kernels`). Before it did,
    # the replacement's first step compiled them: 2 s here, 11 s once on a loaded machine, where the survivors' 8 s
    # collective timeout then declared a second failure. A longer timeout keeps this test on the one recovery it
    # is about should the warm-up fail.
    summary = _finish(_launch(run_dir, "--spares", "1", "--fault", "kill:1:6", "--collective-timeout", "30",
                              "--verbose", script_args=(*layout, "--mmap")), run_dir)
    _assert_equal(reference, summary)  # through the cache, equal to the bare module's fault-free run
    (record,) = summary["recoveries"]
    assert record["path"] == "p2p" and record["resumed_from_step"] == 5 and record["steps_lost"] == 0, record
    _assert_ran(reference, summary, killed={1: 1})
    # Tier 2 with model parallelism: rank 1's batch group is {0, 1} under TP=2 (rank 0 writes, rank 1 reads), {1, 3}
    # under PP=2 (rank 1 writes: its replacement adopts what it left). The replacement's first micro-batch is in
    # shared memory; the loader counts micro-batch steps (one micro-batch per DP rank: 8 / (2 x 2) per step).
    spare_logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("spare_*"))
    assert said(spare_logs, 1, f"data: first batch at step {5 * 8 // (2 * 2)} from the cache"), spare_logs[-3000:]
    assert summary["ranks"][1]["data_cache"]["hits"] > 0, summary["ranks"][1]
    # The replacement's first step compiled nothing: its spare compiled this layout's graphs, TP slices included.
    back = said(spare_logs, 1, "back in fit:")
    assert len(back) == 1 and back[0].endswith("(0 graphs compiled)"), back
    if layout[0] != "--tp":
        return
    # Both replicas of TP slice 1 (ranks 1 and 3) lost at once: the job falls back to the persistent checkpoint,
    # which holds one file per TP slice (before `checkpoint_slot`, the two slices of a step wrote one file).
    run_dir = tmp_path / "both"
    summary = _finish(_launch(run_dir, "--spares", "2", "--checkpoint-every", "2", "--fault", "kill:1:6", "--fault",
                              "exception:3:6", script_args=layout), run_dir)
    _assert_equal(reference, summary)
    (record,) = summary["recoveries"]
    assert record["failed_ranks"] == [1, 3] and record["path"] == "checkpoint", record
    assert record["resumed_from_step"] == 4 and record["steps_lost"] == 1 and "both replicas" in record["reason"]
    _assert_ran(reference, summary, killed={1: 1, 3: 1}, replays=[(6, 4)])  # step 5 twice, on every rank
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_00000004").iterdir()) == [
        "shard_0.json", "shard_0.safetensors", "shard_1.json", "shard_1.safetensors"]


@pytest.mark.timeout(3 * TIMEOUT_S)
@pytest.mark.parametrize(("flag", "message"), [
    ("--plain-strategy", "nl.Trainer(strategy=...)=MegatronStrategy: CheckpointlessCallback needs the checkpointless "
                         "strategy"),
    ("--no-callback", "CheckpointlessMegatronStrategy needs CheckpointlessCallback"),
], ids=["plain-strategy", "no-callback"])
def test_a_strategy_and_callback_that_do_not_pair_stop_before_training(flag: str, message: str,
                                                                       tmp_path: Path) -> None:
    proc = _launch(tmp_path / "bad", script_args=(flag,))
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    log = out.decode(errors="replace")
    assert proc.returncode != 0 and "failed before training" in log, log[-3000:]
    assert message in log, log[-3000:]
    assert not list((tmp_path / "bad").glob("progress_rank*.txt")), "a rank trained"


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_one_and_two_optimizer_instances_end_with_the_same_state(reference: dict[str, Any], tmp_path: Path) -> None:
    """N=1 and N=2 (DP=4), fault-free: the same `state_sha256` (`megatron.numerics`: one gradient all-reduce over the
    whole data-parallel group and a locally computed norm, whatever N), and the parameters moved from init. The
    N=2 run is the module's reference (the script's default N)."""
    run_dir = tmp_path / "n1"
    runs = {1: _finish(_launch(run_dir, script_args=("--instances", "1", "--params-digest")), run_dir), 2: reference}
    for n, summary in runs.items():
        run_dir = summary["run_dir"]
        assert summary["final_step"] == STEPS and summary["recoveries"] == []
        for r in range(4):
            digests = json.loads((run_dir / f"params_rank{r}.json").read_text())
            assert digests["init"] != digests["final"], (n, r)
    assert runs[1]["data_sha256"] == runs[2]["data_sha256"]
    assert runs[1]["state_sha256"] == runs[2]["state_sha256"]
    for r in range(4):
        assert runs[1]["ranks"][r]["params_sha256"] == runs[2]["ranks"][r]["params_sha256"], r
