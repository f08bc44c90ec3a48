"""A job's processes as seen from outside it (from `/proc`, Linux): which live process is which rank, and
whether any process of a run is left. Used to kill ranks from outside (tests, benchmarks) and to check that none
outlives its launcher."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nemo_checkpointless.protocol import RUN_DIR_ENV, SPARE_ID_ENV
from nemo_checkpointless.restart.kin import REFILL_NICE as REFILL_NICE  # (a spare's too)
from nemo_checkpointless.restart.kin import forked_env, stat
from nemo_checkpointless.restart.kin import may_restore_priority as may_restore_priority  # (a spare's too)


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


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_state(pid: int) -> tuple[str, float] | None:
    """(scheduler state letter, CPU seconds user + system) of `pid`; None if unreadable."""
    fields = stat(pid)
    try:
        return (fields[0], (int(fields[11]) + int(fields[12])) / _TICK) if fields else None
    except (IndexError, ValueError):
        return None


PF_EXITING = 0x4  # a task's flag (/proc/<pid>/stat, field 9) from the moment its exit begins


def dying_status(pid: int) -> int | None:
    """The status a process that has begun to exit will be reaped with, as `Popen.returncode` gives it (-N: killed
    by signal N), when that is a failure; None while it runs, when it exits 0 or when /proc does not say.

    The kernel sets the flag and the exit code (field 52) before it frees the process's memory, and a parent can
    reap it, or its peers see its sockets close, only after: for a rank of 0.9 GB that took 0.19 s on a loaded
    2-core machine, for a GPU process with its CUDA context longer. A failure is known at the start of that."""
    fields = stat(pid)
    try:
        if fields is None or not int(fields[6]) & PF_EXITING:
            return None
        code = int(fields[49])
    except (IndexError, ValueError):  # a kernel before 3.5 has no exit code field
        return None
    if code == 0:
        return None
    return -(code & 0x7F) if code & 0x7F else code >> 8


def exit_status(proc: Any) -> int | None:
    """`proc.poll()`; for a process still being torn down, the failure it is exiting with (`dying_status`)."""
    code: int | None = proc.poll()
    if code is None and proc.pid > 0:
        code = dying_status(proc.pid)
    return code


def _parent(pid: int) -> int:
    fields = stat(pid)
    try:
        return int(fields[1]) if fields else 0
    except (IndexError, ValueError):
        return 0


def rank_pids(run_dir: str | os.PathLike[str], run_dir_var: str = RUN_DIR_ENV) -> dict[int, int]:
    """rank -> pid of the run's live training ranks (spares waiting for a rank excluded). A rank's own children
    (e.g. torch.compile's worker pool) inherit its environment: the rank is the one whose parent is not a process
    of the same rank."""
    candidates: dict[int, set[int]] = {}
    for pid, env in live_processes():
        if env.get(run_dir_var) != str(run_dir):
            continue
        env = {**env, **forked_env(run_dir, pid)}
        if "RANK" in env and SPARE_ID_ENV not in env:
            candidates.setdefault(int(env["RANK"]), set()).add(pid)
    out = {}
    for rank, pids in candidates.items():
        top = sorted(pid for pid in pids if _parent(pid) not in pids)
        if top:
            out[rank] = top[0]
    return out


def restore_priority(pid: int) -> None:
    """Every thread of `pid` back to nice 0 (Linux keeps a nice value per thread); nothing when not permitted or
    when the process is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tasks:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, int(tid), 0)
