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
  launcher -> template   {"id": n, "env": {...}, "log": "path"}          fork process n with these variables
  template -> launcher   {"id": n, "pid": p}                             process n runs as p (0: not forked)
A request may also say `"replace_env": true` (the variables are the whole environment, not additions), `"nice":
k` (the process runs at nice k) and `"log": null`: the output goes to the launcher's own stdout and stderr, which
it passes to the template (`--terminal OUT,ERR`, two inherited descriptors).
Each process is forked twice (the middle process exits at once), so that it is re-parented to the launcher, which
is a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`): the launcher then waits on it like on any of its children;
once re-parented it asks for SIGKILL when the launcher dies (`PR_SET_PDEATHSIG`), as a rank the launcher starts
itself does.

The worker module `restart.script_runner` serves a user's Python command: the launcher forks every rank and spare
of such a job from a template that imported torch and Lightning once.

What a spare must still do after the fork (NeMo's model and trainer build, one step: ~5 s of CPU; a spare started
without a template: everything) it does at idle CPU priority when it refills the pool during training
(`warm_up_at_idle_priority`, the launcher sets `SPARE_REFILL_ENV`): the work runs on a thread whose policy is
`SCHED_IDLE` (Linux: the policy is per thread), which runs only on CPU time the training ranks leave unused. A
refilled spare therefore takes longer to be ready on a loaded machine; during a recovery, when the survivors
wait, it gets the cores. Threads the idle thread starts inherit its policy, so the work must not leave threads
that matter later; an unprivileged thread cannot leave `SCHED_IDLE` again, which is why it gets a thread of its
own. Spares started with the job warm up at normal priority.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from nemo_checkpointless.protocol import LAUNCHER_PID_ENV
from nemo_checkpointless.restart.kin import REFILL_NICE, die_with_parent, may_restore_priority

SPARE_REFILL_ENV = "NCL_SPARE_REFILL"  # "1": this spare refills the pool while the job trains


def warm_up_at_idle_priority(fn: Callable[[], Any]) -> None:
    """Run `fn()` on a `SCHED_IDLE` thread when this spare is a refill (else on this thread); re-raise its error."""
    if os.environ.get(SPARE_REFILL_ENV) != "1":
        fn()
        return
    error: list[BaseException] = []

    def body() -> None:
        with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted: normal priority
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread only
        try:
            fn()
        except BaseException as e:  # re-raised on the caller's thread
            error.append(e)

    thread = threading.Thread(target=body, name="ncl-idle-warm-up", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]


def warm_up_again_on_this_thread(fn: Callable[[], Any]) -> bool:
    """Run `fn()` on this thread in a spare forked from a template that warmed up (see `nemo.worker.run`): this
    thread, because glibc's allocator gives each thread an arena of its own and the pages to make the process's own
    are those of the thread that trains. A refill runs it at `REFILL_NICE` and then at its priority again, where this
    process may raise its priority back (`kin.may_restore_priority`), and skips it where it may not (never leaving
    the thread that trains niced). Whether it ran; an error in `fn` is re-raised."""
    if os.environ.get(SPARE_REFILL_ENV) != "1":
        fn()
        return True
    if not may_restore_priority():
        return False
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, REFILL_NICE)  # (Linux: this thread)
    try:
        fn()
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)
    return True


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# Native threads that survive a fork by design: jemalloc (bundled by pyarrow, which NeMo imports) re-creates its
# background threads in the child and guards its locks with pthread_atfork handlers.
_FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def _threads() -> list[str]:
    """The names of this process's native threads other than the calling one and the fork-safe ones."""
    names = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return ["(unknown: no /proc)"]
    for tid in tids:
        if int(tid) == threading.get_native_id():
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # just ended
            continue
        if name not in _FORK_SAFE_THREADS:
            names.append(name)
    return names


def _fork_spare(request: dict[str, Any], spare_main: Callable[[], None], terminal: tuple[int, int] | None = None
                ) -> int:
    """Fork a spare for `request`; return its pid (a grandchild of this process, re-parented to the launcher)."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            if request.get("nice"):
                # Before the fork, so that the process runs niced from its start: once its pid is known, the
                # launcher may set it back to 0 when it takes a rank, which a later os.nice() here would undo.
                os.nice(int(request["nice"]))
            pid = os.fork()
            if pid == 0:
                os.close(write_end)
                _become_spare(request, spare_main, terminal)  # never returns
            os.write(write_end, str(pid).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        pid = int(f.read() or b"0")  # 0: the middle process could not fork (the launcher starts it instead)
    os.waitpid(middle, 0)
    return pid


def _die_with_launcher(launcher: int) -> None:
    """Once re-parented to the launcher (the middle process exits at once), SIGKILL when it dies; exit if it is
    gone already. A death signal asked for earlier would fire when the middle process exits."""
    deadline = time.monotonic() + 10
    while os.getppid() != launcher and time.monotonic() < deadline:
        time.sleep(0.001)
    die_with_parent()
    if os.getppid() != launcher:
        os._exit(1)


def _become_spare(request: dict[str, Any], spare_main: Callable[[], None],
                  terminal: tuple[int, int] | None = None) -> None:
    code = 1
    try:
        launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
        if launcher:
            _die_with_launcher(launcher)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if request.get("log"):
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
        elif terminal is not None:
            os.dup2(terminal[0], 1)
            os.dup2(terminal[1], 2)
        if terminal is not None:
            os.close(terminal[0])
            os.close(terminal[1])
        if request.get("replace_env"):
            os.environ.clear()
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
    terminal: tuple[int, int] | None = None
    if len(sys.argv) == 4 and sys.argv[2] == "--terminal":
        out, err = sys.argv.pop(3).split(",")
        sys.argv.pop(2)
        terminal = (int(out), int(err))
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m nemo_checkpointless.restart.template WORKER_MODULE [--terminal OUT,ERR]")
    try:
        spare_main = importlib.import_module(sys.argv[1]).spare_template()
    except Exception as e:
        traceback.print_exc()
        _say({"ready": False, "why": f"warm-up failed: {type(e).__name__}: {e}"})
        return
    threads = _threads()
    if threads:
        _say({"ready": False, "why": f"the warm-up left threads running ({', '.join(sorted(threads))}); a fork is "
                                     "only safe from a single thread"})
        return
    _say({"ready": True})
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            _say({"id": request["id"], "pid": _fork_spare(request, spare_main, terminal)})


if __name__ == "__main__":
    main()
