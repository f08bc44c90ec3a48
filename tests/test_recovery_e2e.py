"""Recovery end to end: real processes, real SIGKILLs and exceptions, compared against a fault-free run.

Every faulted run must end with the same `state_sha256` (params + optimizer state) and `data_sha256` (the
sequence of global batches) as the fault-free run with the same seed.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 24
COMMON = [f"trainer.max_steps={STEPS}", "trainer.progress_bar=false", "checkpoint.every_n_steps=5",
          "launcher.collective_timeout_s=15", "model.n_layers=1", "data.seq_len=64", "data.micro_batch_size=4"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("recovery")


def run_job(workdir: Path, name: str, *overrides: str) -> dict[str, Any]:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", *COMMON, f"data.cache_dir={workdir / 'data'}",
           f"run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in sorted((run_dir / "logs").glob("*.log"))) if (run_dir / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:] + logs
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == STEPS
    return summary


@pytest.fixture(scope="module")
def reference(workdir: Path) -> dict[str, Any]:
    summary = run_job(workdir, "reference")
    assert summary["recoveries"] == []
    return summary


def assert_equal_to(reference: dict[str, Any], summary: dict[str, Any]) -> None:
    assert summary["state_sha256"] == reference["state_sha256"], json.dumps(summary["recoveries"], indent=1)
    assert summary["data_sha256"] == reference["data_sha256"], json.dumps(summary["recoveries"], indent=1)


def assert_healthy_kept_pids(summary: dict[str, Any]) -> None:
    failed = {r for rec in summary["recoveries"] for r in rec["failed_ranks"]}
    for rank, pids in summary["pids"].items():
        if int(rank) not in failed:
            assert len(pids) == 1, f"healthy rank {rank} changed process: {pids}"


def test_kill_every_rank_in_turn_recovers_p2p_from_a_replica(workdir: Path, reference: dict[str, Any]) -> None:
    """4 ranks, N=2, one hot spare (refilled): ranks 0, 1, 2, 3 are SIGKILLed at steps 4, 9, 14, 19."""
    plan = ",".join(f"{{kind:kill,rank:{r},step:{s}}}" for r, s in ((0, 4), (1, 9), (2, 14), (3, 19)))
    summary = run_job(workdir, "kill-each", "replication.num_instances=2", "replication.spares=1",
                      f"fault.plan=[{plan}]")
    assert_equal_to(reference, summary)
    recs = summary["recoveries"]
    assert [r["failed_ranks"] for r in recs] == [[0], [1], [2], [3]]
    assert [r["step"] for r in recs] == [4, 9, 14, 19]
    for rec in recs:
        assert rec["fault_kind"] == "kill" and rec["path"] == "p2p", rec
        assert rec["steps_lost"] == 0 and rec["bytes_received"] > 0, rec
        assert 0 < rec["recover_s"] < 30, rec
    for rank in range(4):
        assert len(summary["pids"][str(rank)]) == 2  # each rank replaced exactly once, the others kept theirs


def test_a_rank_lost_in_its_instances_all_gather_rolls_its_partner_forward(
        workdir: Path, reference: dict[str, Any]) -> None:
    """Rank 1 SIGKILLed after step 7's gradient all-reduce, as it enters its instance's parameter all-gather: its
    partner rank 0 holds its own updated shard of step 7 but not rank 1's, while ranks 2 and 3 completed step 7.
    Rank 0 completes step 7 from rank 2's parameters, the spare becomes rank 1 at step 7, nobody goes back a
    step. The same for rank 2 at step 16 (its partner rank 3 rolled forward from rank 1)."""
    summary = run_job(workdir, "kill-in-gather", "replication.num_instances=2", "replication.spares=1",
                      "fault.plan=[{kind:kill,rank:1,step:7,target:gather},{kind:kill,rank:2,step:16,target:gather}]",
                      "run.timeline=true")
    assert_equal_to(reference, summary)
    recs = summary["recoveries"]
    brief = json.dumps(recs, indent=1)
    assert [(r["failed_ranks"], r["step"], r["resumed_from_step"], r.get("rolled_forward")) for r in recs] == [
        ([1], 7, 7, [0]), ([2], 16, 16, [3])], brief
    assert all(r["path"] == "p2p" and r["steps_lost"] == 0 for r in recs), brief
    assert_healthy_kept_pids(summary)
    # Each recovery went through the Trainer's logger (rank 0's CSV), and the run drew its timeline.
    with open(workdir / "kill-in-gather" / "logs" / "metrics_rank0" / "metrics.csv") as f:
        logged = [row for row in csv.DictReader(f) if row.get("recovery/downtime_s")]
    assert [(row["recovery/path"], float(row["recovery/bytes"]) > 0) for row in logged] == [("0.0", True)] * 2, logged
    assert all(0 < float(row["recovery/downtime_s"]) < 30 for row in logged), logged
    assert (workdir / "kill-in-gather" / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_both_replicas_lost_falls_back_to_checkpoint_then_exception_recovers_p2p(
        workdir: Path, reference: dict[str, Any]) -> None:
    """Ranks 1 and 3 hold the same shard (N=2): losing both at step 12 leaves no replica -> checkpoint of step 10.
    Rank 3 fails by an exception, which takes longer to end its process than a SIGKILL: its death may interrupt
    the recovery from rank 1's loss, which must then start over with both replaced. Later an exception in rank 0's
    step recovers like a kill, from a replica."""
    summary = run_job(workdir, "both-replicas", "replication.num_instances=2", "replication.spares=2",
                      "fault.plan=[{kind:kill,rank:1,step:12},{kind:exception,rank:3,step:12},"
                      "{kind:exception,rank:0,step:18}]")
    assert_equal_to(reference, summary)
    first, second = summary["recoveries"]
    assert first["failed_ranks"] == [1, 3] and first["path"] == "checkpoint", first
    assert first["resumed_from_step"] == 10 and first["steps_lost"] == 1, first
    assert "both replicas" in first["reason"]
    assert second["failed_ranks"] == [0] and second["fault_kind"] == "exception", second
    assert second["path"] == "p2p" and second["steps_lost"] == 0, second
    assert_healthy_kept_pids(summary)


def test_a_transfer_that_fails_its_checksum_falls_back_to_checkpoint(
        workdir: Path, reference: dict[str, Any]) -> None:
    """Rank 3 (rank 1's replica) damages the state it sends; the replacement's sha256 check catches it."""
    summary = run_job(workdir, "corrupt", "replication.num_instances=2", "replication.spares=1",
                      "fault.plan=[{kind:corrupt,rank:3,step:2},{kind:kill,rank:1,step:13}]")
    assert_equal_to(reference, summary)
    (rec,) = summary["recoveries"]
    assert rec["failed_ranks"] == [1] and rec["path"] == "checkpoint", rec
    assert "checksum" in rec["reason"] and rec["resumed_from_step"] == 10 and rec["steps_lost"] == 2, rec
    assert_healthy_kept_pids(summary)


def test_a_hung_rank_is_found_by_the_watchdog_and_replaced(workdir: Path, reference: dict[str, Any]) -> None:
    """Rank 2 is SIGSTOPped: nobody sees a death. With the progress watchdog off, the backup: the survivors'
    collectives time out, they check in with the launcher, the one rank that never does is killed and replaced from
    its replica."""
    summary = run_job(workdir, "hang", "replication.num_instances=2", "replication.spares=1",
                      "launcher.collective_timeout_s=3", "launcher.hang_deadline_s=-1",
                      "fault.plan=[{kind:hang,rank:2,step:8}]")
    assert_equal_to(reference, summary)
    (rec,) = summary["recoveries"]
    assert rec["fault_kind"] == "hang" and rec["failed_ranks"] == [2] and rec["path"] == "p2p", rec
    assert rec["steps_lost"] == 0 and rec["detect_s"] >= 2.5 and "hang" not in rec, rec  # the 3 s timeout
    assert_healthy_kept_pids(summary)


def test_the_progress_watchdog_finds_hung_ranks_in_seconds(workdir: Path, reference: dict[str, Any]) -> None:
    """With a 30 s collective timeout, four hangs no socket reveals: rank 2 SIGSTOPped, rank 1 in a Python loop
    that never ends, rank 3 blocked in a native call that holds the GIL, rank 0 asleep before its step's
    collectives. The launcher's progress watchdog (the default deadline: its 5 s floor, 10 x p95 of these steps
    being far less) finds each from the ranks' beacons and /proc, kills it, and the job recovers p2p, ending
    equal; the downtime is at most the deadline + 1 s."""
    plan = "{kind:hang,rank:2,step:5},{kind:spin,rank:1,step:10},{kind:gil,rank:3,step:15},{kind:stall,rank:0,step:20}"
    summary = run_job(workdir, "watchdog", "replication.num_instances=2", "replication.spares=1",
                      "launcher.collective_timeout_s=30", f"fault.plan=[{plan}]")
    assert_equal_to(reference, summary)
    recs = summary["recoveries"]
    assert [(r["fault_kind"], r["failed_ranks"], r["path"]) for r in recs] == [
        ("hang", [2], "p2p"), ("spin", [1], "p2p"), ("gil", [3], "p2p"), ("stall", [0], "p2p")], recs
    why = [next(iter(r["hang"].values())) for r in recs]
    assert why[0].startswith("stopped (state T)") and why[1].startswith("busy without progress"), why
    for text, step in ((why[2], 15), (why[3], 20)):
        assert text.startswith(f"idle at step {step}, step start") and f"waits at step {step}" in text, why
    for rec in recs:
        assert rec["detect_s"] > 4.5 and rec["recover_s"] < 5 + 1, rec  # the deadline, not the collective timeout
        assert rec["steps_lost"] == 0, rec
    assert_healthy_kept_pids(summary)
    print(json.dumps([{k: r[k] for k in ("fault_kind", "detect_s", "recover_s", "hang")} for r in recs], indent=1))


def test_single_instance_falls_back_to_checkpoint_with_a_cold_replacement(
        workdir: Path, reference: dict[str, Any]) -> None:
    """N=1 keeps no replica: a kill falls back to the checkpoint; with no spare the launcher starts a process."""
    summary = run_job(workdir, "n1-cold", "replication.num_instances=1", "replication.spares=0",
                      "fault.plan=[{kind:kill,rank:2,step:8}]")
    assert_equal_to(reference, summary)
    (rec,) = summary["recoveries"]
    assert rec["path"] == "checkpoint" and rec["resumed_from_step"] == 5 and rec["steps_lost"] == 2, rec
    assert "no replica" in rec["reason"] or "replica" in rec["reason"], rec
    assert_healthy_kept_pids(summary)


def test_the_restart_budget_counts_failures_in_a_row_not_the_runs_recoveries(
        workdir: Path, reference: dict[str, Any]) -> None:
    """`launcher.max_restarts=2` and five kills, each recovered before the next: a job that recovers every time
    is never stopped by its budget (the budget counts faults whose recovery did not complete)."""
    plan = ",".join(f"{{kind:kill,rank:{r},step:{s}}}" for r, s in ((1, 3), (2, 7), (3, 11), (0, 15), (1, 19)))
    summary = run_job(workdir, "budget", "replication.num_instances=2", "replication.spares=1",
                      "launcher.max_restarts=2", f"fault.plan=[{plan}]")
    assert_equal_to(reference, summary)
    recs = summary["recoveries"]
    assert [r["failed_ranks"] for r in recs] == [[1], [2], [3], [0], [1]], recs
    assert all(r["path"] == "p2p" for r in recs), recs
