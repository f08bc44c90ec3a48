"""A long run with many recoveries leaves nothing behind: on every process that survived a recovery, the thread
count, open file descriptors, CPU time per step and resident memory after the last recovery are back to what
they were before its first one. Read from /proc by the test while the job runs, not from the job's own counters;
the run must still end bitwise-equal to the fault-free one, and each rank's own step log (tests/steplog.py) must
show every step once, on the fault-free run's batches, the ranks in as many processes as they were killed + 1.

Six SIGKILLs in five recoveries: rank 1 (a warm spare takes over), ranks 2 and 3 at the same step (the one spare
takes one, a cold start the other), then ranks 0, 1 and 2 in turn. Spares are forked from the job's warm template.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import steplog
from harness import child_env
from procwatch import train, window

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 480
FAULTS = [(1, 60), (2, 140), (3, 140), (0, 220), (1, 300), (2, 380)]  # (rank, step)
WINDOW = (25, 3)  # a window ends 3 steps before a fault (or the end) and spans 22 steps
COMMON = [f"trainer.max_steps={STEPS}", "trainer.progress_bar=false", "checkpoint.every_n_steps=0",
          "launcher.collective_timeout_s=15", "model.n_layers=1", "data.seq_len=64", "data.micro_batch_size=4",
          "replication.num_instances=2", "replication.spares=1", steplog.PRELOAD]
# Tolerances, stated: threads and descriptors exactly as before; CPU per step within 50 % (the fixed bug made the
# dead rank's neighbour use ~2.4x; a healthy run on a fresh CI machine once measured 1.38x: 44 against 32 clock
# ticks over 22 steps, while a refilled spare warmed up beside the ranks); resident memory within 64 MB (a state
# transfer here is ~0.5 MB).
CPU_PER_STEP_FACTOR = 1.5
RSS_SLACK_KB = 64 * 1024


def _run(workdir: Path, name: str, *overrides: str, sample: bool = False
         ) -> tuple[dict[str, Any], dict[int, list[dict[str, float]]]]:
    return train(workdir / name, [*COMMON, f"data.cache_dir={workdir / 'data'}", *overrides], sample=sample,
                 env=child_env(tests_on_path=True))


def test_many_recoveries_leave_threads_descriptors_cpu_and_memory_as_they_were(tmp_path: Path) -> None:
    reference, _ = _run(tmp_path, "reference")
    plan = ",".join(f"{{kind:kill,rank:{r},step:{s}}}" for r, s in FAULTS)
    summary, samples = _run(tmp_path, "faulted", f"fault.plan=[{plan}]", sample=True)

    assert summary["state_sha256"] == reference["state_sha256"]
    assert summary["data_sha256"] == reference["data_sha256"]
    recs = summary["recoveries"]
    assert [r["failed_ranks"] for r in recs] == [[1], [2, 3], [0], [1], [2]], recs
    assert all(r["path"] == "p2p" and r["steps_lost"] == 0 for r in recs), recs
    kinds = {kind for r in recs for kind in r["replacement"].values()}
    assert {"warm spare", "cold start"} <= kinds, kinds
    steplog.assert_steps(tmp_path / "faulted", STEPS, killed={r: [k for k, _ in FAULTS].count(r) for r, _ in FAULTS},
                         reference=tmp_path / "reference")

    with open(tmp_path / "faulted" / "steps.csv") as f:
        times = {int(row["step"]): float(row["last_t"]) for row in csv.DictReader(f)}
    fault_steps = sorted({s for _, s in FAULTS})
    checked = []
    for rank, pids in summary["pids"].items():
        pid = pids[-1]  # the process that is rank `rank` at the end
        started = 0 if len(pids) == 1 else max(s for r, s in FAULTS if r == int(rank))
        survived = [s for s in fault_steps if s > started]
        if not survived:
            continue
        before = window(samples[pid], times, survived[0], WINDOW)
        after = window(samples[pid], times, STEPS, WINDOW)
        where = f"rank {rank} (pid {pid}, survived the faults at steps {survived}): before {before}, after {after}"
        assert after["threads"] == before["threads"], where
        assert after["fds"] == before["fds"], where
        assert after["cpu_per_step"] <= CPU_PER_STEP_FACTOR * before["cpu_per_step"], where
        assert after["rss_kb"] <= before["rss_kb"] + RSS_SLACK_KB, where
        checked.append((int(rank), len(survived)))
        print(where)
    # Ranks 3, 0 and 1 end in processes that lived through 3, 2 and 1 recoveries.
    assert sorted(checked) == [(0, 2), (1, 1), (3, 3)], checked
