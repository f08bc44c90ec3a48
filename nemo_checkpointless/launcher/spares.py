"""The launcher's side of the template (`restart.template`): processes forked from one warm process. Our own
workers' hot spares come from a template that ran a warm-up step; every rank and spare of a user's Python command
from one that imported torch and Lightning (`restart.script_runner`).

`SpareFactory.fork(...)` returns a `ForkedProcess` at once; the template forks it as soon as it is warm (requests
made earlier wait in its stdin). If the template cannot serve (it failed, or its warm-up left threads running),
each process not yet forked starts as a new interpreter instead, as one without a template does.
"""

from __future__ import annotations

import contextlib
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


class ForkedProcess:
    """A process forked by the template, with the part of `subprocess.Popen`'s interface the launcher uses.

    Its pid is known once the template has answered. A `kill()` before that is kept, and the process is killed
    as soon as its pid is known (or never started, if the template cannot fork it): a kill that found no pid once
    left the process running while `wait()` then blocked on it (a whole restart right after a spare was asked
    for, on a loaded machine)."""

    def __init__(self, factory: SpareFactory, request_id: int, spawn: Callable[[], subprocess.Popen[bytes]]) -> None:
        self.factory, self.request_id, self._spawn = factory, request_id, spawn
        self._pid: int | None = None
        self._spawned: subprocess.Popen[bytes] | None = None
        self._killed = False
        self.returncode: int | None = None

    def resolve(self, block: bool = False) -> None:
        """Learn the pid (`block`: wait for the template's answer); when the template cannot fork, start the
        process as a new interpreter, or, once killed, record it as killed without starting it."""
        if self._pid is not None or self._spawned is not None or self.returncode is not None:
            return
        pid = self.factory.wait_pid(self.request_id) if block else self.factory.pid_of(self.request_id)
        if pid:
            self._pid = pid
            if self._killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        elif pid == 0 or self.factory.failed:
            if self._killed:
                self.returncode = -signal.SIGKILL  # never started
            else:
                self._spawned = self._spawn()

    @property
    def pid(self) -> int:
        self.resolve()
        if self._spawned is not None:
            return self._spawned.pid
        return -1 if self._pid is None else self._pid

    def poll(self) -> int | None:
        self.resolve()
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
        self._killed = True
        self.resolve()
        if self._spawned is not None:
            self._spawned.kill()
        elif self._pid is not None and self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)

    def wait(self) -> int:
        self.resolve(block=True)
        while self.returncode is None:
            if self._spawned is not None:
                self.returncode = self._spawned.wait()
            elif self._pid is not None:
                _, status = os.waitpid(self._pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            else:  # nothing was started (a `spawn` that started nothing)
                self.returncode = -signal.SIGKILL
        return self.returncode


class SpareFactory:
    """Starts the template (`python -m nemo_checkpointless.restart.template WORKER_MODULE`) and forks processes
    from it. `terminal`: the template may send a process's output to this launcher's own stdout and stderr."""

    def __init__(self, worker_module: str, env: dict[str, str], log: IO[bytes], terminal: bool = False) -> None:
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)  # a pid came, or the template failed
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
                if "pid" in message:  # 0: the template could not fork it
                    self._pids[int(message["id"])] = max(0, int(message["pid"] or 0))
                elif message.get("ready"):
                    self.ready = True
                else:
                    self.failed = str(message.get("why", "the template failed"))
                    print(f"launcher: the template cannot fork processes: {self.failed}; they start as new "
                          "interpreters", file=sys.stderr, flush=True)
                self._answered.notify_all()
        code = self.proc.wait()
        with self._lock:  # the template exited: whatever it has not forked, it never will
            if self.failed is None:
                self.failed = f"the template exited (code {code})"
            self._answered.notify_all()

    def pid_of(self, request_id: int) -> int | None:
        with self._lock:
            return self._pids.get(request_id)

    def wait_pid(self, request_id: int) -> int | None:
        """The pid of process `request_id` once the template has forked it; 0 if it could not, None if the
        template failed first."""
        with self._answered:
            self._answered.wait_for(lambda: request_id in self._pids or self.failed is not None)
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
                    self._answered.notify_all()
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
