"""The package's built-in job (`checkpointless-train`), one rank SIGKILLed from outside at a random moment of
training, as an operator or the kernel would: no fault plan, nothing inside the job knows it is coming.

The rank, the step and the moment within the step are drawn from a seed that the test prints (set `NCL_TEST_SEED`
to replay one). The faulted run must end bitwise-equal to the fault-free one (`state_sha256`, `data_sha256`), and
the ranks' own step logs (tests/steplog.py) must show every step once per rank, on the reference's batches, the
three other ranks in the process they started in and the killed rank in two processes, one after the other.
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
from harness import child_env

from nemo_checkpointless.launcher.procs import rank_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 16
COMMON = [f"trainer.max_steps={STEPS}", "trainer.progress_bar=false", "checkpoint.every_n_steps=5",
          "launcher.collective_timeout_s=15", "model.n_layers=1", "data.seq_len=64", "data.micro_batch_size=4",
          "replication.num_instances=2", "replication.spares=1", steplog.PRELOAD]


def _start(tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], Path]:
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", *COMMON, f"data.cache_dir={tmp_path / 'data'}",
           f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env(tests_on_path=True))
    return proc, run_dir


def _finish(proc: subprocess.Popen[str], run_dir: Path) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the job did not end: {out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == STEPS, summary["recoveries"]
    return summary


def _completed(run_dir: Path) -> int:
    """The step every rank has completed, from their own step logs (0 before each has logged one)."""
    try:
        logs = steplog.read(run_dir)
    except (ValueError, AssertionError):  # a line read half-written: look again
        return 0
    return min((lines[-1].step for lines in logs.values()), default=0) if len(logs) == 4 else 0


def test_a_rank_killed_from_outside_at_a_random_moment_ends_equal(tmp_path: Path) -> None:
    seed = int(os.environ.get("NCL_TEST_SEED") or random.SystemRandom().randrange(1 << 30))
    rng = random.Random(seed)
    victim, after_step, frac = rng.randrange(4), rng.randint(2, STEPS - 4), rng.random()
    print(f"\nNCL_TEST_SEED={seed}: rank {victim} SIGKILLed {frac:.2f} of a step after every rank completed step "
          f"{after_step}")
    reference = _finish(*_start(tmp_path, "reference"))
    steplog.assert_steps(tmp_path / "reference", STEPS)
    # The reference's steady step time, from its own logs: the moment within a step is a fraction of it.
    ref_logs = steplog.read(tmp_path / "reference")
    step_s = (ref_logs[0][-1].t - ref_logs[0][1].t) / (STEPS - 2)

    proc, run_dir = _start(tmp_path, "killed")
    pid = None
    while proc.poll() is None and _completed(run_dir) < after_step:
        time.sleep(0.005)
    if proc.poll() is None:
        time.sleep(frac * step_s)
        pid = rank_pids(run_dir).get(victim)
        assert pid is not None, f"rank {victim} has no live process to kill"
        os.kill(pid, signal.SIGKILL)
    summary = _finish(proc, run_dir)
    assert pid is not None, "the job ended before the kill"
    brief = json.dumps(summary["recoveries"], indent=1)
    assert summary["state_sha256"] == reference["state_sha256"], brief
    assert summary["data_sha256"] == reference["data_sha256"], brief
    [rec] = summary["recoveries"]
    assert rec["failed_ranks"] == [victim] and rec["exit_codes"] == {str(victim): -signal.SIGKILL}, brief
    assert rec["path"] == "p2p", brief
    # From the ranks themselves: every step once, on the reference's batches; the killed rank's first process is
    # the one the test killed, and the other ranks never changed process.
    logs = steplog.assert_steps(run_dir, STEPS, killed={victim: 1}, reference=tmp_path / "reference")
    assert logs[victim][0].pid == pid and logs[victim][-1].pid != pid, brief
