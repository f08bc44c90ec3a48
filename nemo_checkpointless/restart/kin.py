"""A process's ties to the launcher (Linux): the death signal a rank asks for, the child subreaper the launcher
becomes so that processes forked by a template (`restart.template`) are its children, and the record a forked
process leaves of which rank or spare it is (`procs.rank_pids` reads it: its /proc environ is the template's).

Kept free of heavy imports: the template and every forked process load it before anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
from pathlib import Path

from nemo_checkpointless.protocol import RUN_DIR_ENV, SPARE_ID_ENV

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37

# RUN_DIR/forked/<pid>.json: what a forked process says it is.
FORKED_DIR = "forked"
_IDENTITY = ("RANK", SPARE_ID_ENV)


def _prctl(option: int, arg: int | ctypes._Pointer[ctypes.c_int] = 0) -> bool:
    """prctl(option, arg, 0, 0, 0); False where it fails or there is none (not Linux)."""
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (in a child before exec, or a forked process once re-parented)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def become_child_subreaper() -> bool:
    """Make this process adopt its orphaned descendants, so that the processes a template forks are its children."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def is_child_subreaper() -> bool:
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.pointer(flag)) and bool(flag.value)


def stop_being_child_subreaper() -> None:
    """Orphans go to init again: once a job run in-process (`run_local` called from a program) has reaped its
    processes, the calling program adopts nothing of anyone else's."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 0)


def stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, parent, ...); None if unreadable."""
    # os.open and os.read, not pathlib: the launcher reads each rank's stat 200 times a second (`procs.dying_status`).
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        fields = raw.decode(errors="replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


def _start_time(pid: int) -> str | None:
    fields = stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def register_forked() -> None:
    """In a forked process, once its environment is set: record the variables `procs.rank_pids` reads, with the
    process's start time (a record is trusted only for the process that wrote it, not a later one with its pid)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    folder = Path(run_dir) / FORKED_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    pid = os.getpid()
    record = {"env": {k: os.environ[k] for k in _IDENTITY if k in os.environ}, "start": _start_time(pid)}
    tmp = folder / f".{pid}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    tmp.replace(folder / f"{pid}.json")


def forked_env(run_dir: str | os.PathLike[str], pid: int) -> dict[str, str]:
    """What a forked process recorded about itself (`register_forked`); {} if it did not (or is another one)."""
    with contextlib.suppress(OSError, ValueError):
        record = json.loads((Path(run_dir) / FORKED_DIR / f"{pid}.json").read_text())
        if record.get("start") == _start_time(pid):
            return dict(record["env"])
    return {}


# A refilled spare (a new interpreter started while the job trains) runs at this nice value until it takes a rank:
# its imports and set-up then use the CPU the training ranks leave, not theirs. A forked one warms up at it again
# (`restart.template.warm_up_again_on_this_thread`).
REFILL_NICE = 19


def may_restore_priority() -> bool:
    """Whether this process may lower a nice value again, its own or a child's (root, or an RLIMIT_NICE that allows
    nice 0): the condition for lowering a spare's priority at all, since a rank must train at normal priority."""
    import resource

    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20
