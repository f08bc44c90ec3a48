"""The launcher's side of the template (`restart.template`): processes forked from one warm process. Our own
workers' hot spares come from a template that ran a warm-up step; every rank and spare of a user's Python command
from one that imported torch and Lightning (`restart.script_runner`).

`SpareFactory.fork(...)` returns a `ForkedProcess` at once; the template forks it as soon as it is warm (requests
made earlier wait in its stdin). If the template cannot serve (it failed, or its warm-up left threads running),
each process not yet forked starts as a new interpreter instead, as one without a template does.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

TEMPLATE_MODULE = "nemo_checkpointless.restart.template"
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def become_child_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux), so that the forked spares are its children."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_child_subreaper() -> bool:
    flag = ctypes.c_int(0)
    try:
        ok = ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    return ok and bool(flag.value)


def stop_being_child_subreaper() -> None:
    """Orphans go to init again: once a job run in-process (`run_local` called from a program) has reaped its
    processes, the calling program adopts nothing of anyone else's."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class ForkedProcess:
    """A process forked by the template, with the part of `subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, factory: SpareFactory, request_id: int, spawn: Callable[[], subprocess.Popen[bytes]]) -> None:
        self.factory, self.request_id, self._spawn = factory, request_id, spawn
        self._pid: int | None = None
        self._spawned: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    def _resolve(self) -> None:
        if self._pid is None and self._spawned is None:
            pid = self.factory.pid_of(self.request_id)
            if pid is not None:
                self._pid = pid
            elif self.factory.failed:
                self._spawned = self._spawn()

    @property
    def pid(self) -> int:
        self._resolve()
        if self._spawned is not None:
            return self._spawned.pid
        return -1 if self._pid is None else self._pid

    def poll(self) -> int | None:
        self._resolve()
        if self.returncode is not None:
            return self.returncode
        if self._spawned is not None:
            self.returncode = self._spawned.poll()
        elif self._pid is not None:
            pid, status = os.waitpid(self._pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        self._resolve()
        if self._spawned is not None:
            self._spawned.kill()
        elif self._pid is not None and self.returncode is None:
            os.kill(self._pid, signal.SIGKILL)

    def wait(self) -> int:
        self._resolve()
        while self.returncode is None:
            if self._spawned is not None:
                self.returncode = self._spawned.wait()
            elif self._pid is not None:
                _, status = os.waitpid(self._pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            else:  # never forked and never spawned: nothing ran
                self.returncode = -signal.SIGKILL
        return self.returncode


class SpareFactory:
    """Starts the template (`python -m nemo_checkpointless.restart.template WORKER_MODULE`) and forks processes
    from it. `terminal`: the template may send a process's output to this launcher's own stdout and stderr."""

    def __init__(self, worker_module: str, env: dict[str, str], log: IO[bytes], terminal: bool = False) -> None:
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        self._next_id = 0
        self.ready = False
        self.failed: str | None = None
        argv = [sys.executable, "-m", TEMPLATE_MODULE, worker_module]
        fds: tuple[int, ...] = ()
        if terminal:
            fds = (os.dup(1), os.dup(2))  # what a child started with stdout=None would inherit
            argv += ["--terminal", f"{fds[0]},{fds[1]}"]
        try:
            self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        self._reader = threading.Thread(target=self._read, name="ncl-spare-template", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                message: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                if "pid" in message:
                    self._pids[int(message["id"])] = int(message["pid"])
                elif message.get("ready"):
                    self.ready = True
                else:
                    self.failed = str(message.get("why", "the template failed"))
                    print(f"launcher: the template cannot fork processes: {self.failed}; they start as new "
                          "interpreters", file=sys.stderr, flush=True)
        with self._lock:  # the template exited: whatever it has not forked, it never will
            if self.failed is None:
                self.failed = f"the template exited (code {self.proc.wait()})"

    def pid_of(self, request_id: int) -> int | None:
        with self._lock:
            return self._pids.get(request_id)

    def fork(self, env: dict[str, str], log: Path | None, spawn: Callable[[], subprocess.Popen[bytes]],
             replace_env: bool = False, nice: int = 0) -> ForkedProcess:
        """Ask for a process with `env` (added to the template's, or, with `replace_env`, the whole environment)
        and its output in `log` (None: this launcher's stdout and stderr), at nice value `nice`; forked when the
        template is warm. `spawn` starts it as a new interpreter if the template cannot."""
        with self._lock:
            request_id, self._next_id = self._next_id, self._next_id + 1
        if self.failed is None and self.proc.stdin is not None:
            request = {"id": request_id, "env": env, "log": None if log is None else str(log),
                       "replace_env": replace_env, "nice": nice}
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                with self._lock:
                    self.failed = self.failed or "the template is gone"
        return ForkedProcess(self, request_id, spawn)

    def close(self) -> None:
        """Stop the template; afterwards nothing is forked any more (every pid is known)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
