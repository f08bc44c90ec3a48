"""A user's own Lightning script (`tests/scripts/user_lightning.py`) under `checkpointless-run`: real processes,
real signals from outside, every rank's parameters and optimizer shard compared with the fault-free run.

- DataLoader(shuffle=True) over a TensorDataset: a kill at a step boundary (fault plan), SIGKILL of a rank while
  it starts up, SIGSEGV of a rank in the middle of training (wherever it is: forward, backward, a collective);
- a LightningDataModule with dict batches and accumulate_grad_batches=2: a kill at a step boundary and SIGKILL of
  rank 0 in the middle of training; then through `MmapDataModule` (tier 2): the replacement's first batch comes
  from the shared-memory cache;
- bad input: one clear message and a non-zero exit each, nothing left running;
- the launcher killed: no rank or spare outlives it.

The script logs every step each of its processes completes (`--step-log`, read by tests/steplog.py): no step ran
twice or was skipped, ranks the test did not kill kept their process, and every step's batch is the fault-free
run's, all from the ranks' own records.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import steplog
from harness import child_env, finish_job, job_progress, said

from nemo_checkpointless.launcher.procs import job_pids, rank_pids

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    return child_env()


def _launch(run_dir: Path, *args: str, script: Path = SCRIPT, script_args: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           "--collective-timeout", "8", *args, str(script), *script_args]
    return subprocess.Popen(cmd, env={**_env(), **(env or {})}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen[bytes], run_dir: Path) -> dict[str, Any]:
    return {**finish_job(proc, run_dir, "user_rank{r}.json", TIMEOUT_S), "run_dir": run_dir}


def _run(run_dir: Path, *args: str, script_args: tuple[str, ...] = ()) -> dict[str, Any]:
    return _finish(_launch(run_dir, *args, script_args=script_args), run_dir)


def _progress(run_dir: Path) -> int:
    return job_progress(run_dir)


def _kill_when(run_dir: Path, rank: int, sig: int, at_step: int | None, done: list[str]) -> threading.Thread:
    """Send `sig` to rank `rank` as soon as it exists (at_step None: while it starts up) or once every rank has
    trained `at_step` steps."""

    def body() -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            pid = rank_pids(run_dir).get(rank)
            if pid is not None and (at_step is None or _progress(run_dir) >= at_step):
                os.kill(pid, sig)
                done.append(f"{signal.Signals(sig).name} rank {rank} pid {pid} at step {_progress(run_dir)}")
                return
            time.sleep(0.005)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def _assert_ran(summary: dict[str, Any], steps: int, killed: dict[int, int] | None = None,
                reference: dict[str, Any] | None = None) -> None:
    """From the ranks' own step logs (`steplog.assert_steps`): steps 1..`steps` once each per rank (less the one a
    replacement received done, when a kill from outside landed in a parameter all-gather), ranks not in `killed` in
    one process, the batches of `reference`'s run; and the process that wrote each rank's final record (its own
    `os.getpid()`) is the one that logged the rank's last step."""
    received = steplog.received_steps(Path(summary["run_dir"]), summary["recoveries"])
    logs = steplog.assert_steps(summary["run_dir"], steps, killed=killed, not_completed=received,
                                reference=reference["run_dir"] if reference else None)
    assert {r: logs[r][-1].pid for r in range(4)} == {r: summary["ranks"][r]["pid"] for r in range(4)}


def _assert_equal(reference: dict[str, Any], summary: dict[str, Any], steps: int) -> None:
    assert summary["final_step"] == steps, summary["recoveries"]
    assert summary["state_sha256"] == reference["state_sha256"], json.dumps(summary["recoveries"], indent=1)
    for r in range(4):
        for key in ("params_sha256", "shard_sha256"):
            assert summary["ranks"][r][key] == reference["ranks"][r][key], (r, key, summary["recoveries"])
        assert summary["ranks"][r]["global_step"] == steps


LOADER = ("--max-steps", "40", "--step-sleep", "0.03", "--step-log")
DICTS = ("--datamodule", "--accumulate", "2", "--max-steps", "30", "--step-sleep", "0.02", "--step-log")


@pytest.fixture(scope="module")
def reference_loader(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("user") / "ref-loader"
    summary = _run(run_dir, script_args=LOADER)
    assert summary["recoveries"] == [] and summary["final_step"] == 40
    _assert_ran(summary, 40)
    # 512 samples, 4 ranks, batches of 8: 16 steps an epoch; 40 steps cross two epoch boundaries.
    assert summary["ranks"][0]["epoch"] == 3
    return summary


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_killed_at_start_up_at_a_boundary_and_mid_step_ends_equal(reference_loader: dict[str, Any],
                                                                 tmp_path: Path) -> None:
    run_dir = tmp_path / "faults"
    done: list[str] = []
    proc = _launch(run_dir, "--spares", "1", "--fault", "kill:1:12", script_args=LOADER)
    threads = [_kill_when(run_dir, 3, signal.SIGKILL, None, done),
               _kill_when(run_dir, 2, signal.SIGSEGV, 24, done),
               _kill_when(run_dir, 0, signal.SIGTERM, 32, done)]
    summary = _finish(proc, run_dir)
    for t in threads:
        t.join(timeout=1)
    assert len(done) == 3, done
    _assert_equal(reference_loader, summary, 40)
    recoveries = summary["recoveries"]
    brief = [(r["failed_ranks"], r["exit_codes"], r["step"], r["path"], r["replacement"]) for r in recoveries]
    assert len(recoveries) == 4, brief
    # Killed while it started (before any rank trained): the job starts again, whole; the kill at a step boundary,
    # the SIGSEGV in the middle of a step and the SIGTERM are recovered in process.
    assert recoveries[0]["failed_ranks"] == [3] and recoveries[0]["path"] == "restart", recoveries[0]
    boundary, mid = recoveries[1], recoveries[2]
    assert boundary["failed_ranks"] == [1] and boundary["path"] == "p2p" and boundary["steps_lost"] == 0, boundary
    assert mid["failed_ranks"] == [2] and mid["exit_codes"] == {"2": -signal.SIGSEGV}, mid
    assert mid["path"] == "p2p" and mid["steps_lost"] == 0, mid
    # SIGTERM: Lightning's handler stops the rank at its next step boundary; it is replaced like a crash.
    term = recoveries[3]
    assert term["failed_ranks"] == [0] and term["path"] == "p2p" and term["steps_lost"] == 0, term
    # From the ranks' own logs: every step once per rank; ranks 0, 1 and 2, killed once each after training had
    # started, in two processes each; rank 3 (killed before any step, the whole job started again) in one.
    _assert_ran(summary, 40, killed={0: 1, 1: 1, 2: 1}, reference=reference_loader)
    # Ranks 2 and 0 were replaced by spares refilled while the job trained, which start niced where the launcher
    # may restore their priority (`launcher.procs`): every rank trained at nice 0.
    assert [summary["ranks"][r]["nice"] for r in range(4)] == [0] * 4, summary["ranks"]


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_training_collectives_on_a_second_plane_recovered_equal(reference_loader: dict[str, Any],
                                                                tmp_path: Path) -> None:
    # What a GPU rank does (`restart.groups`: the training collectives on NCCL, the recovery on gloo), with gloo
    # standing in for NCCL (`NCL_DEVICE_PLANE=gloo`): a second group per generation, built at its first collective,
    # waited by polling, released after a fault. A kill at a step boundary and a SIGKILL wherever rank 2 is (its
    # peers then wait in a device-plane collective that fails): both p2p, and the run ends as the one-plane run does.
    run_dir = tmp_path / "planes"
    done: list[str] = []
    proc = _launch(run_dir, "--spares", "1", "--fault", "kill:1:12", script_args=LOADER,
                   env={"NCL_DEVICE_PLANE": "gloo"})
    thread = _kill_when(run_dir, 2, signal.SIGKILL, 24, done)
    summary = _finish(proc, run_dir)
    thread.join(timeout=1)
    assert done, "rank 2 was not killed"
    _assert_equal(reference_loader, summary, 40)
    recoveries = summary["recoveries"]
    assert [(r["failed_ranks"], r["path"], r["steps_lost"]) for r in recoveries] == [
        ([1], "p2p", 0), ([2], "p2p", 0)], recoveries
    _assert_ran(summary, 40, killed={1: 1, 2: 1}, reference=reference_loader)
    planes = {r: summary["ranks"][r]["device_plane"] for r in range(4)}
    # Every rank ran its step's collectives there (2 a step: the gradient all-reduce and the parameter
    # all-gather, plus the user's sync_dist log); a survivor of the SIGKILL saw a device-plane wait fail.
    assert all(p["collectives"] >= 40 for p in planes.values()), planes
    assert summary["ranks"][3]["device_plane"]["failed"] + summary["ranks"][0]["device_plane"]["failed"] >= 1, planes
    assert reference_loader["ranks"][0]["device_plane"] == {"collectives": 0, "failed": 0}


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_validation_and_bf16_mixed_recovered_equal(tmp_path: Path) -> None:
    args = ("--max-steps", "40", "--val-every", "6", "--precision", "bf16-mixed", "--step-sleep", "0.02", "--step-log")
    reference = _run(tmp_path / "ref-val", script_args=args)
    summary = _run(tmp_path / "faults-val", "--spares", "1", "--fault", "kill:1:14", script_args=args)
    _assert_equal(reference, summary, 40)
    [recovery] = summary["recoveries"]
    assert recovery["path"] == "p2p" and recovery["steps_lost"] == 0, recovery
    _assert_ran(summary, 40, killed={1: 1}, reference=reference)
    # Validation ran after batches 6 and 12 of each 16-batch epoch (5 times in 40 steps), 2 batches of its
    # 64 samples on each of the 4 ranks each time; a survivor validated as often in the faulted run.
    assert reference["ranks"][0]["val_batches"] == 5 * 2, reference["ranks"][0]
    assert summary["ranks"][2]["val_batches"] == reference["ranks"][2]["val_batches"]


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_datamodule_dict_batches_accumulation_recovered_equal(tmp_path: Path) -> None:
    reference = _run(tmp_path / "ref-dict", script_args=DICTS)
    assert reference["recoveries"] == [] and reference["final_step"] == 30
    run_dir = tmp_path / "faults-dict"
    done: list[str] = []
    proc = _launch(run_dir, "--spares", "1", "--fault", "kill:1:8", script_args=DICTS)
    thread = _kill_when(run_dir, 0, signal.SIGKILL, 18, done)
    summary = _finish(proc, run_dir)
    thread.join(timeout=1)
    assert done, "rank 0 was not killed"
    _assert_equal(reference, summary, 30)
    paths = [(r["failed_ranks"], r["path"], r["steps_lost"]) for r in summary["recoveries"]]
    assert paths == [([1], "p2p", 0), ([0], "p2p", 0)], json.dumps(summary["recoveries"], indent=1)
    _assert_ran(summary, 30, killed={1: 1, 0: 1}, reference=reference)  # both micro-batches of each step
    # Tier 2: the same DataModule through MmapDataModule trains on the same batches (the same end state as the
    # plain run), and rank 1's replacement reads its first batch (step 12's first micro-batch: 16 + 6) from the
    # job's shared-memory cache, where rank 1 had prefetched it before it was killed.
    run_dir = tmp_path / "faults-mmap"
    summary = _run(run_dir, "--spares", "1", "--fault", "kill:1:12", "--verbose", script_args=(*DICTS, "--mmap"))
    _assert_equal(reference, summary, 30)
    _assert_ran(summary, 30, killed={1: 1}, reference=reference)
    spare_logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("spare_*.log"))
    assert said(spare_logs, 1, "data: first batch (micro-batch 22 of the run) from the cache"), spare_logs[-3000:]


def _error(*args: str, script: Path = SCRIPT, script_args: tuple[str, ...] = ()) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "nemo_checkpointless.cli.run", *args, str(script), *script_args],
                          env=_env(), cwd=ROOT, capture_output=True, timeout=TIMEOUT_S, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).decode(errors="replace")


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_bad_input_gets_one_clear_message_and_leaves_nothing_running(tmp_path: Path) -> None:
    # The script with plain python: the strategy says how to start it.
    plain = subprocess.run([sys.executable, str(SCRIPT), "--max-steps", "1"], env=_env(), cwd=ROOT,
                           capture_output=True, timeout=TIMEOUT_S, check=False)
    assert plain.returncode != 0 and b"checkpointless-run --nproc-per-node" in plain.stderr, plain.stderr[-2000:]
    code, out = _error("--nproc-per-node", "4", "--no-such-flag")
    assert code == 2 and "unrecognized arguments: --no-such-flag" in out, out
    code, out = _error("--nproc-per-node", "4", "--spares", "-1")
    assert code == 2 and "--spares=-1" in out and "must be >= 0" in out, out
    code, out = _error("--nproc-per-node", "4", "--num-instances", "3")
    assert code == 2 and "--num-instances=3" in out and "divide" in out, out
    code, out = _error("--nnodes", "2", "--nproc-per-node", "4")
    assert code == 2 and "--rdzv-endpoint='': is needed for --nnodes 2" in out, out
    code, out = _error("--nnodes", "1:4", "--nproc-per-node", "4")
    assert code == 2 and "--nnodes=1:4: must be a fixed number of nodes" in out, out
    code, out = _error("--nnodes", "2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:2379")
    assert code == 2 and "--rdzv-backend=etcd-v2: must be static, c10d or external" in out, out
    code, out = _error("--nproc-per-node", "4", script=tmp_path / "missing.py")
    assert code == 2 and "is not a file" in out, out
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, out = _error("--nproc-per-node", "4", "--master-port", str(port), "--run-dir", str(tmp_path / "p"))
    assert code == 2 and f"--master-port=127.0.0.1:{port}" in out and "cannot be bound" in out, out
    # A script that exits non-zero: its exit code, its rank named, nothing left.
    run_dir = tmp_path / "exits"
    code, out = _error("--nproc-per-node", "4", "--spares", "1", "--run-dir", str(run_dir),
                       script=ROOT / "tests" / "scripts" / "exits_3.py")
    assert code == 3 and "failed before training (exit code 3)" in out, out
    assert job_pids(run_dir) == []
    # Trainer(devices=8) under 4 processes: the world check, from the rank's log.
    run_dir = tmp_path / "devices"
    code, out = _error("--nproc-per-node", "4", "--run-dir", str(run_dir), script_args=("--devices", "8"))
    assert code == 1 and "describes 8 processes; the launcher started 4" in out, out[-3000:]
    assert job_pids(run_dir) == []


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_no_rank_or_spare_outlives_the_launcher(tmp_path: Path) -> None:
    run_dir = tmp_path / "orphans"
    proc = _launch(run_dir, "--spares", "1", script_args=("--max-steps", "100000", "--step-sleep", "0.01"))
    deadline = time.monotonic() + TIMEOUT_S
    while _progress(run_dir) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(job_pids(run_dir)) >= 5  # 4 ranks and the spare
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while job_pids(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job_pids(run_dir) == []


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_an_unchanged_ddp_script_gets_the_launchers_store_and_a_whole_restart(tmp_path: Path) -> None:
    script = ROOT / "tests" / "scripts" / "plain_ddp.py"
    clean = tmp_path / "ddp-clean"
    proc = _launch(clean, script=script)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    reference = json.loads((clean / "ddp_final.json").read_text())
    run_dir = tmp_path / "ddp-fault"
    proc = _launch(run_dir, script=script)
    deadline = time.monotonic() + TIMEOUT_S
    progress = run_dir / "ddp_progress.txt"
    while time.monotonic() < deadline and not (progress.exists() and int(progress.read_text() or 0) >= 12):
        time.sleep(0.01)
    os.kill(rank_pids(run_dir)[1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    final = json.loads((run_dir / "ddp_final.json").read_text())
    # Every rank restarted and resumed from the script's own checkpoint (steps 10 or 15), then ended equal.
    assert final["resumed_from"] in (10, 15) and final["weights"] == reference["weights"], final
    [recovery] = json.loads((run_dir / "summary.json").read_text())["recoveries"]
    assert recovery["path"] == "restart" and recovery["failed_ranks"] == [1], recovery


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_second_death_during_the_recovery_is_recovered_too(reference_loader: dict[str, Any],
                                                             tmp_path: Path) -> None:
    # No spare: rank 1's replacement is a cold start, so the recovery lasts while it runs the script up to fit;
    # rank 2 is killed in that window (once the replacement's process exists). Ranks 1 and 2 hold different
    # shards, so both are restored p2p from ranks 3 and 0, in one recovery at the next generation.
    run_dir = tmp_path / "during"
    proc = _launch(run_dir, "--fault", "kill:1:12", script_args=LOADER)
    first: dict[int, int] = {}
    done: list[str] = []

    def second() -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            pids = rank_pids(run_dir)
            if 1 in pids and 2 in pids:
                first.setdefault(1, pids[1])
                if pids[1] != first[1]:  # rank 1's replacement is starting: the survivors are recovering
                    os.kill(pids[2], signal.SIGKILL)
                    done.append(f"rank 2 pid {pids[2]} at step {_progress(run_dir)}")
                    return
            time.sleep(0.005)

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    summary = _finish(proc, run_dir)
    thread.join(timeout=1)
    assert done, "rank 2 was not killed"
    _assert_equal(reference_loader, summary, 40)
    [recovery] = summary["recoveries"]
    assert recovery["failed_ranks"] == [1, 2] and recovery["path"] == "p2p", recovery
    assert recovery["steps_lost"] == 0 and recovery["step"] == 12, recovery
    _assert_ran(summary, 40, killed={1: 1, 2: 1}, reference=reference_loader)


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_slow_rank_is_reported_as_a_straggler_and_not_replaced(tmp_path: Path) -> None:
    """Rank 2 sleeps 60 ms in every training_step (before `self.log(sync_dist=True)`, where the others then wait
    for it): flagged in the log and summary.json, with every rank's own work per step; nothing replaced."""
    summary = _run(tmp_path / "slow", script_args=("--max-steps", "60", "--slow-rank", "2", "--slow-s", "0.06",
                                                    "--step-log"))
    assert summary["recoveries"] == [] and summary["final_step"] == 60
    _assert_ran(summary, 60)  # no rank replaced: one process each
    assert [e["rank"] for e in summary["stragglers"]] == [2], summary["stragglers"]
    assert summary["stragglers"][0]["factor"] >= 1.5
    busy = summary["rank_busy_s"]
    assert busy["2"] > 0.06 and all(busy[r] < busy["2"] / 2 for r in "013"), busy
    assert "rank 2 is a straggler" in summary["log"], summary["log"][-3000:]


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_slow_step_within_the_adapted_deadline_is_not_a_hang(tmp_path: Path) -> None:
    """Steps of about 0.8 s: the watchdog's default deadline follows them (10 x p95 = 8 s, above its 5 s floor).
    Rank 1's step 6 then takes 6 s longer (asleep, idle, while the others wait for it in the collective): longer
    than the floor, shorter than the adapted deadline, so it is not declared hung."""
    summary = _run(tmp_path / "slow-step", script_args=("--max-steps", "10", "--step-sleep", "0.8", "--slow-rank",
                                                         "1", "--slow-s", "6", "--slow-step", "6", "--step-log"))
    assert summary["recoveries"] == [] and summary["final_step"] == 10, summary["recoveries"]
    _assert_ran(summary, 10)  # no rank replaced: one process each
    assert "is hung" not in summary["log"], summary["log"][-3000:]
    # A 5 s floor would have declared it hung; the deadline followed the steps (and, after it, that slow step).
    assert summary["hang_deadline_s"] > 6, summary["hang_deadline_s"]
