"""Tier 2 end to end: the mmap loader in real jobs. A fault-free run with the plain loader is the reference; one
run with the mmap loader kills a rank at 5 steps, including the first step after the prefetch window of the
start (`data.prefetch=4`: steps 0-3 are written before training starts; 0-based step 4, i.e. the 5th step, is the
first one written while training runs). The batch sequence (`data_sha256`) and the final state must be equal, and
each rank's own step log (tests/steplog.py) must show every step once, on the plain run's batch of that rank and
step, healthy ranks in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import steplog
from test_recovery_e2e import STEPS, assert_equal_to, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PREFETCH = 4
# (rank, 1-based step); step PREFETCH + 1 is the first step after the initial prefetch window rolls over.
KILLS = ((1, 3), (2, PREFETCH + 1), (3, 10), (0, 15), (1, 20))


def test_mmap_loader_kills_at_five_steps_equal_the_plain_loader_without_faults(tmp_path: Path) -> None:
    cache_root = tmp_path / "shm"
    cache_root.mkdir(mode=0o700)
    reference = run_job(tmp_path, "plain", "data.loader=plain")
    plan = ",".join(f"{{kind:kill,rank:{r},step:{s}}}" for r, s in KILLS)
    summary: dict[str, Any] = run_job(
        tmp_path, "mmap-kills", "data.loader=mmap", f"data.prefetch={PREFETCH}", "data.lookback=2",
        f"data.cache_root={cache_root}", "replication.num_instances=2", "replication.spares=2",
        f"fault.plan=[{plan}]", "launcher.verbose=true")  # the DEBUG lines: where each first batch came from
    assert_equal_to(reference, summary)
    assert [r["step"] for r in summary["recoveries"]] == [s for _, s in KILLS]
    assert all(r["path"] == "p2p" and r["steps_lost"] == 0 for r in summary["recoveries"]), summary["recoveries"]
    # The ranks' own logs: each step once per rank, on the batch the plain loader gave that rank at that step;
    # rank 1 in three processes (killed twice), the others in two.
    steplog.assert_steps(tmp_path / "mmap-kills", STEPS, killed={r: [k for k, _ in KILLS].count(r) for r, _ in KILLS},
                         reference=tmp_path / "plain")
    # Each replacement trained its first step on the batch its predecessor had cached (no dataset read).
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "mmap-kills" / "logs").glob("*.log"))
    served = [line for line in logs.splitlines() if "data: first batch at step" in line]
    assert len(served) >= 4 and all("from the cache" in line for line in served), served
    assert summary["state_sha256"] and not list(cache_root.iterdir())  # the launcher removed the job's cache
