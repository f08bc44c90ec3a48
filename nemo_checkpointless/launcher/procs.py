"""A job's processes as seen from outside it (from `/proc`, Linux): which live process is which rank, and
whether any process of a run is left. Used to kill ranks from outside (tests, benchmarks) and to check that none
outlives its launcher."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from nemo_checkpointless.protocol import RUN_DIR_ENV, SPARE_ID_ENV


def live_processes() -> Iterator[tuple[int, dict[str, str]]]:
    """(pid, environment) of every live process whose environment this user can read (zombies skipped)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes().decode().split("\0")
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except (OSError, ValueError, UnicodeDecodeError, IndexError):
            continue
        yield int(entry.name), dict(kv.split("=", 1) for kv in raw if "=" in kv)


def job_pids(run_dir: str | os.PathLike[str], run_dir_var: str = RUN_DIR_ENV) -> list[int]:
    """Every live process of the run in `run_dir` (ranks, spares, the spare template)."""
    return [pid for pid, env in live_processes() if env.get(run_dir_var) == str(run_dir)]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def rank_pids(run_dir: str | os.PathLike[str], run_dir_var: str = RUN_DIR_ENV) -> dict[int, int]:
    """rank -> pid of the run's live training ranks (spares waiting for a rank excluded). A rank's own children
    (e.g. torch.compile's worker pool) inherit its environment: the rank is the one whose parent is not a process
    of the same rank."""
    candidates: dict[int, set[int]] = {}
    for pid, env in live_processes():
        if env.get(run_dir_var) == str(run_dir) and "RANK" in env and SPARE_ID_ENV not in env:
            candidates.setdefault(int(env["RANK"]), set()).add(pid)
    out = {}
    for rank, pids in candidates.items():
        top = sorted(pid for pid in pids if _parent(pid) not in pids)
        if top:
            out[rank] = top[0]
    return out
