"""A long run with many recoveries leaves nothing behind: on every process that survived a recovery, the thread
count, open file descriptors, CPU time per step and resident memory after the last recovery are back to what
they were before its first one. Read from /proc by the test while the job runs, not from the job's own counters;
the run must still end bitwise-equal to the fault-free one.

Six SIGKILLs in five recoveries: rank 1 (a warm spare takes over), ranks 2 and 3 at the same step (the one spare
takes one, a cold start the other), then ranks 0, 1 and 2 in turn. Spares are forked from the job's warm template.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 480
FAULTS = [(1, 60), (2, 140), (3, 140), (0, 220), (1, 300), (2, 380)]  # (rank, step)
WINDOW = (25, 3)  # a window ends 3 steps before a fault (or the end) and spans 22 steps
COMMON = [f"trainer.max_steps={STEPS}", "trainer.progress_bar=false", "checkpoint.every_n_steps=0",
          "launcher.collective_timeout_s=15", "model.n_layers=1", "data.seq_len=64", "data.micro_batch_size=4",
          "replication.num_instances=2", "replication.spares=1"]
# Tolerances, stated: threads and descriptors exactly as before; CPU per step within 30 % (the fixed bug made the
# dead rank's neighbour use ~2.4x); resident memory within 64 MB (a state transfer here is ~0.5 MB).
CPU_PER_STEP_FACTOR = 1.3
RSS_SLACK_KB = 64 * 1024
SAMPLE_S = 0.05


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            for k in kids:
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def _sample(pid: int) -> dict[str, float] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        threads = len(os.listdir(f"/proc/{pid}/task"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
    return {"t": time.time(), "threads": threads, "fds": fds, "cpu": int(fields[11]) + int(fields[12]),
            "rss_kb": int(fields[21]) * page_kb}


class _Sampler(threading.Thread):
    """Samples every descendant of the launcher every SAMPLE_S seconds."""

    def __init__(self, root: int) -> None:
        super().__init__(name="proc-sampler", daemon=True)
        self.root = root
        self.samples: dict[int, list[dict[str, float]]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in _descendants(self.root):
                s = _sample(pid)
                if s is not None:
                    self.samples.setdefault(pid, []).append(s)
            self.stop.wait(SAMPLE_S)


def _run(workdir: Path, name: str, *overrides: str, sample: bool = False
         ) -> tuple[dict[str, Any], dict[int, list[dict[str, float]]]]:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", *COMMON, f"data.cache_dir={workdir / 'data'}",
           f"run.dir={run_dir}", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = _Sampler(proc.pid)
    if sample:
        sampler.start()
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        sampler.stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    return json.loads((run_dir / "summary.json").read_text()), sampler.samples


def _at(samples: list[dict[str, float]], t: float) -> dict[str, float]:
    return min(samples, key=lambda s: abs(s["t"] - t))


def _window(samples: list[dict[str, float]], times: dict[int, float], end_step: int) -> dict[str, float]:
    """The process's state at the end of the window before `end_step`, and its CPU ticks per step over it."""
    lo, hi = end_step - WINDOW[0], end_step - WINDOW[1]
    a, b = _at(samples, times[lo]), _at(samples, times[hi])
    steps = sum(1 for t in times.values() if a["t"] < t <= b["t"])
    assert steps >= 10 and b["t"] - a["t"] > 0.3, (lo, hi, a, b, steps)
    return {**b, "cpu_per_step": (b["cpu"] - a["cpu"]) / steps}


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
        before = _window(samples[pid], times, survived[0])
        after = _window(samples[pid], times, STEPS)
        where = f"rank {rank} (pid {pid}, survived the faults at steps {survived}): before {before}, after {after}"
        assert after["threads"] == before["threads"], where
        assert after["fds"] == before["fds"], where
        assert after["cpu_per_step"] <= CPU_PER_STEP_FACTOR * before["cpu_per_step"], where
        assert after["rss_kb"] <= before["rss_kb"] + RSS_SLACK_KB, where
        checked.append((int(rank), len(survived)))
        print(where)
    # Ranks 3, 0 and 1 end in processes that lived through 3, 2 and 1 recoveries.
    assert sorted(checked) == [(0, 2), (1, 1), (3, 3)], checked
