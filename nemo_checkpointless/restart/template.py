"""The spare template: one warm process per job from which every hot spare is forked.

`python -m nemo_checkpointless.restart.template WORKER_MODULE`, started by the launcher. A spare started as a new
interpreter imports torch, Lightning (or NeMo) and the model code and runs a dummy step: seconds of CPU (a NeMo
spare ~25 s) taken from the training ranks when the spare pool is refilled after a recovery, which made the job
~20 % slower for those seconds. The template does that work once, when the job starts, and then forks a spare
for each request: a fork of a warm process costs milliseconds and shares its memory copy-on-write.

`WORKER_MODULE.spare_template()` warms up and returns the function a forked spare runs (it connects to the store,
says it is ready and waits for its rank). A fork is safe only from a single-threaded process: if the warm-up left
threads running, the template says so and the launcher starts spares as new interpreters instead.

Protocol, one line per message, JSON (no pickle) on the template's stdin/stdout:
  template -> launcher   {"ready": true} once warm, or {"ready": false, "why": "..."} (then it exits)
  launcher -> template   {"id": n, "env": {...}, "log": "path"}          fork spare n with these variables
  template -> launcher   {"id": n, "pid": p}                             spare n runs as process p
Each spare is forked twice (the middle process exits at once), so that it is re-parented to the launcher, which
is a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`): the launcher then waits on it like on any of its children.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _fork_spare(request: dict[str, Any], spare_main: Callable[[], None]) -> int:
    """Fork a spare for `request`; return its pid (a grandchild of this process, re-parented to the launcher)."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            _become_spare(request, spare_main)  # never returns
        os.write(write_end, str(pid).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        pid = int(f.read() or b"-1")
    os.waitpid(middle, 0)
    return pid


def _become_spare(request: dict[str, Any], spare_main: Callable[[], None]) -> None:
    code = 1
    try:
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.update(request["env"])
        spare_main()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m nemo_checkpointless.restart.template WORKER_MODULE")
    try:
        spare_main = importlib.import_module(sys.argv[1]).spare_template()
    except Exception as e:
        traceback.print_exc()
        _say({"ready": False, "why": f"warm-up failed: {type(e).__name__}: {e}"})
        return
    threads = _native_threads()
    if threads != 1:
        _say({"ready": False, "why": f"the warm-up left {threads} threads running; a fork is only safe with one"})
        return
    _say({"ready": True})
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            _say({"id": request["id"], "pid": _fork_spare(request, spare_main)})


if __name__ == "__main__":
    main()
