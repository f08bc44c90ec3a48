"""On the NeMo path, recoveries leave nothing behind: every survivor leaves `fit` and enters it again on a new
Megatron setup, and what the failed `fit` built (megatron's model, DDP, distributed optimizer and the generation's
gloo groups with their transport threads) must be freed. Read from /proc by the test while the job runs
(`procwatch`): on the processes that survive every fault, threads and descriptors after the last recovery equal
those after the first, CPU time per step and resident memory stay where they were; the run ends bitwise-equal.

Why after the first and not before it: the first recovery adds the recovery engine's own group of the new
generation (one gloo group here: 1 transport thread, 2 run-loop threads, 7 descriptors), which each later
generation replaces. Before the fix (`nemo.restart.release_optimizer`) a survivor kept every generation's
megatron model, optimizer and 27 groups: ~60 threads, ~80 descriptors and ~20 MB more per recovery.

Three SIGKILLs (ranks 1, 2, 1 at steps 20, 45, 70 of 95): ranks 0 and 3 survive all three. ~2.5 min on 2 cores.
Skipped without the [nemo] extra.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
from harness import child_env
from procwatch import train, window

pytestmark = [pytest.mark.nemo, pytest.mark.slow, pytest.mark.timeout(900)]

TESTS = Path(__file__).resolve().parent
STEPS = 95
FAULTS = [(1, 20), (2, 45), (1, 70)]  # (rank, step)
WINDOW = (14, 2)  # a window ends 2 steps before a fault (or the end) and spans 12 steps
NEMO = ["recipe=tiny_llama_nemo", "launcher.preload=[nemo_shim]", "model.dropout=0.1", f"trainer.max_steps={STEPS}",
        "launcher.collective_timeout_s=8", "checkpoint.every_n_steps=0", "trainer.progress_bar=false",
        "replication.spares=1", "launcher.max_restarts=3"]
# Tolerances, stated: threads and descriptors exactly as after the first recovery; CPU per step within 2x (measured
# with two other suites running: 10-12.5 ticks a step in each window, so 30 % was the machine's load between the
# windows; a forgotten group's transport thread that spins takes most of a core, 2.6 s per 3 s (`restart.groups`),
# several times a step's CPU here); resident memory within 96 MB of what it was after the first recovery (measured:
# +57 MB over the two later recoveries; the allocator keeps pages a recovery frees. The leak this guards against
# shows in threads first).
CPU_PER_STEP_FACTOR = 2.0
RSS_SLACK_KB = 96 * 1024


def _run(workdir: Path, name: str, *overrides: str, sample: bool = False
         ) -> tuple[dict[str, Any], dict[int, list[dict[str, float]]]]:
    return train(workdir / name, [*NEMO, f"data.cache_dir={workdir / 'data'}", *overrides], sample=sample,
                 env=child_env(tests_on_path=True), cwd=TESTS.parent)


def test_nemo_recoveries_free_what_each_failed_fit_built(tmp_path: Path) -> None:
    reference, _ = _run(tmp_path, "reference")
    plan = ",".join(f"{{kind:kill,rank:{r},step:{s}}}" for r, s in FAULTS)
    summary, samples = _run(tmp_path, "faulted", f"fault.plan=[{plan}]", sample=True)

    assert summary["final_step"] == STEPS
    assert summary["state_sha256"] == reference["state_sha256"]
    assert summary["data_sha256"] == reference["data_sha256"]
    recs = summary["recoveries"]
    assert [r["failed_ranks"] for r in recs] == [[1], [2], [1]], recs
    assert all(r["path"] == "p2p" and r["steps_lost"] == 0 for r in recs), recs

    with open(tmp_path / "faulted" / "steps.csv") as f:
        times = {int(row["step"]): float(row["last_t"]) for row in csv.DictReader(f)}
    steps = [s for _, s in FAULTS]
    for rank in (0, 3):
        [pid] = summary["pids"][str(rank)]  # healthy ranks keep their process through every recovery
        before = window(samples[pid], times, steps[0], WINDOW)
        first = window(samples[pid], times, steps[1], WINDOW)
        last = window(samples[pid], times, STEPS, WINDOW)
        where = (f"rank {rank} (pid {pid}): before the first fault {before}, after the first recovery {first}, "
                 f"after the last {last}")
        assert last["threads"] == first["threads"], where
        assert last["fds"] == first["fds"], where
        assert first["threads"] - before["threads"] <= 3 and first["fds"] - before["fds"] <= 8, where
        assert last["cpu_per_step"] <= CPU_PER_STEP_FACTOR * before["cpu_per_step"], where
        assert last["rss_kb"] <= first["rss_kb"] + RSS_SLACK_KB, where
        print(where)
