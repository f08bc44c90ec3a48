"""A real (no mocks) distributed test harness for CPU: ranks as processes, or threads as ranks.

Processes (`launch_ranks`): the TEST process hosts a loopback TCPStore (as the launcher does) and starts one real
Python process per rank. Each runs `target` ("module:function", imported with `tests/` on `sys.path`) as
`function(ctx)` with a `RankContext`. Results travel back through the store as JSON (`ctx.emit`), never pickle.
The test plays the launcher: it can kill, stop and continue ranks and set keys such as `FAULT_KEY`::

    with launch_ranks("test_harness:_rank_allreduce", 4) as ranks:
        codes = ranks.wait()
        assert ranks.results("sum") == {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}

Threads (`run_threads`): for tests that only need collectives, one thread per rank over an in-process store, each
with its own `Membership` (real gloo groups over loopback).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch.distributed as dist

from nemo_checkpointless.launcher.local import host_store
from nemo_checkpointless.restart.groups import FAULT_KEY, Membership, connect_store, reap, wait_released
from nemo_checkpointless.restart.kin import die_with_parent
from nemo_checkpointless.restart.worker_env import WorkerEnv

__all__ = ["RankContext", "RankGroup", "launch_ranks", "run_threads"]

HOST = "127.0.0.1"
TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
COLLECTIVE_TIMEOUT_S = 5.0
_POLL_S = 0.005
_ENV_TARGET = "HARNESS_TARGET"
_ENV_ARGS = "HARNESS_ARGS"
_ENV_PARENT = "HARNESS_PARENT_PID"
_ENV_TIMEOUT = "HARNESS_COLLECTIVE_TIMEOUT_S"
_ENV_STORE_TIMEOUT = "HARNESS_STORE_TIMEOUT_S"
_ENV_PROCS = "HARNESS_NUM_PROCS"
_START_KEY = "harness/started"
_GO_KEY = "harness/go"
_BOOTSTRAP = f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); import harness; harness._rank_main()"
T = TypeVar("T")


def child_env(tests_on_path: bool = False) -> dict[str, str]:
    """The environment for a job a test starts: one thread per rank, unbuffered output, none of pytest's
    per-test variables; with `tests_on_path`, tests/ on PYTHONPATH (for `launcher.preload=[nemo_shim]`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    if tests_on_path:
        tests = str(Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    return env


# The built-in job of each engine (`checkpointless-train`): the Lightning engine's tiny Llama, and the NeMo engine's
# (megatron-core on gloo through the test-only CPU shim).
ENGINES: dict[str, list[str]] = {
    "lightning": ["recipe=tiny_llama_cpu"],
    "nemo": ["recipe=tiny_llama_nemo", "launcher.preload=[nemo_shim]"],
}


def train_builtin(run_dir: Path, engine: str, *overrides: str, timeout_s: float = 600) -> dict[str, Any]:
    """One `checkpointless-train` of `engine`'s built-in job; asserts it succeeded (else shows its output and every
    rank's log tail) and returns its summary."""
    argv = [sys.executable, "-m", "nemo_checkpointless.cli.train", f"run.dir={run_dir}", *ENGINES[engine],
            "trainer.progress_bar=false", *overrides]
    proc = subprocess.run(argv, env=child_env(tests_on_path=True), cwd=REPO_ROOT, capture_output=True,
                          timeout=timeout_s, check=False)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                     for p in sorted((run_dir / "logs").glob("*.log"))) if (run_dir / "logs").exists() else ""
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{out[-4000:]}\n{logs}"
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


def said(logs: str, rank: int, text: str) -> list[str]:
    """The lines of `logs` in which rank `rank` said `text` (`restart.logs`: `[rank R gen G step S] text...`)."""
    import re

    pattern = re.compile(rf"\[rank {rank}(?: [^\]]*)?\] {re.escape(text)}")
    return [line for line in logs.splitlines() if pattern.search(line)]


def train_failing(run_dir: Path, engine: str, exit_code: int, *overrides: str, timeout_s: float = 600) -> str:
    """One `checkpointless-train` of `engine`'s built-in job that must end with `exit_code`; returns its output."""
    argv = [sys.executable, "-m", "nemo_checkpointless.cli.train", f"run.dir={run_dir}", *ENGINES[engine],
            "trainer.progress_bar=false", *overrides]
    proc = subprocess.run(argv, env=child_env(tests_on_path=True), cwd=REPO_ROOT, capture_output=True,
                          timeout=timeout_s, check=False)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == exit_code, f"exit code {proc.returncode}, expected {exit_code}\n{out[-5000:]}"
    return out


def finish_job(proc: subprocess.Popen[bytes], run_dir: Path, rank_file: str, timeout_s: float,
               world_size: int = 4) -> dict[str, Any]:
    """Wait for a `checkpointless-run` job; assert it succeeded (else show its output and every rank's log tail);
    its summary.json with `ranks`: each rank's RUN_DIR/<rank_file with {r}> JSON, and `log`: its output."""
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Show what every rank was doing, not only pytest's frame: the launcher's log and each rank's log tail.
        timed_out = True
        proc.kill()
        out, _ = proc.communicate()
    log = out.decode(errors="replace")
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted((run_dir / "logs").glob("*.log"))) if (run_dir / "logs").exists() else ""
    assert not timed_out, f"the job did not end within {timeout_s} s\n{log[-5000:]}\n{logs}"
    assert proc.returncode == 0, f"exit code {proc.returncode}\n{log[-5000:]}\n{logs}"
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    summary["ranks"] = {r: json.loads((run_dir / rank_file.format(r=r)).read_text()) for r in range(world_size)}
    summary["log"] = log
    return summary


def job_progress(run_dir: Path, world_size: int = 4) -> int:
    """The step every rank of a test script's job has completed (its RUN_DIR/progress_rank<r>.txt files)."""
    steps = []
    for p in run_dir.glob("progress_rank*.txt"):
        try:
            steps.append(int(p.read_text() or 0))
        except (OSError, ValueError):
            continue
    return min(steps) if len(steps) == world_size else 0


def emit_key(rank: int, key: str) -> str:
    """The store key under which `rank` emits `key`."""
    return f"emit/{rank}/{key}"


# ---------------------------------------------------------------------------------------------------- rank side
@dataclass
class RankContext:
    """What a rank function gets. Process index `rank` >= `world_size` is a spare (`spare` is True): its
    `membership` is built with its own index as rank, so it can join groups that list it explicitly, but not
    `membership.world()`."""

    rank: int
    world_size: int
    local_rank: int
    spare: bool
    store: dist.Store
    membership: Membership
    args: tuple[Any, ...]
    collective_timeout_s: float

    def emit(self, key: str, value: Any) -> None:
        """Publish a JSON-serialisable result for the test (`RankGroup.result(rank, key)`)."""
        self.store.set(emit_key(self.rank, key), json.dumps(value))

    def wait_key(self, key: str, timeout_s: float = 30.0) -> str:
        """Block until the test (or another rank) sets `key`; return its value."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: store key {key!r} not set within {timeout_s} s")
            time.sleep(_POLL_S)
        return self.store.get(key).decode()


def _die_with_parent(parent: int) -> None:
    """A rank must not outlive the test process (e.g. when pytest itself is killed)."""
    die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(3)


def _rank_main() -> None:
    """Entry point of a rank process (see `_BOOTSTRAP`); never returns."""
    code = 1
    try:
        _die_with_parent(int(os.environ[_ENV_PARENT]))
        wenv = WorkerEnv.from_environ()
        procs = int(os.environ[_ENV_PROCS])
        timeout_s = float(os.environ[_ENV_TIMEOUT])
        store = connect_store(wenv.store_host, wenv.store_port, float(os.environ[_ENV_STORE_TIMEOUT]))
        # Start barrier: imports take seconds and vary by rank on a loaded machine; without it the first group
        # formation could eat the (short) collective timeout.
        if store.add(_START_KEY, 1) == procs:
            store.set(_GO_KEY, "1")
        store.wait([_GO_KEY])
        module_name, _, fn_name = os.environ[_ENV_TARGET].partition(":")
        module = __import__(module_name, fromlist=[fn_name])
        fn = getattr(module, fn_name)
        membership = Membership(store, wenv.rank, wenv.world_size, wenv.store_host, timeout_s)
        ctx = RankContext(wenv.rank, wenv.world_size, wenv.local_rank, wenv.rank >= wenv.world_size, store,
                          membership, tuple(json.loads(os.environ[_ENV_ARGS])), timeout_s)
        fn(ctx)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit, not a normal exit: destroying a gloo group with a stuck collective (a retired group after a
        # failure) blocks until that collective's timeout.
        os._exit(code)


# ---------------------------------------------------------------------------------------------------- test side
def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


class RankGroup:
    """Real rank processes started by `launch_ranks`. Use it as a context manager: leaving it (normally or by an
    exception) kills and reaps every rank that is still running."""

    def __init__(self, target: str, world_size: int, spares: int, store: dist.TCPStore, port: int, log_dir: Path,
                 own_log_dir: bool, timeout_s: float) -> None:
        self.target = target
        self.world_size = world_size
        self.spares = spares
        self.store = store
        self.port = port
        self.log_dir = log_dir
        self.timeout_s = timeout_s
        self._own_log_dir = own_log_dir
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = False

    # -------------------------------------------------------------------------------------------- processes
    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def num_procs(self) -> int:
        return self.world_size + self.spares

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank_{rank}.log"

    def _signal(self, rank: int, sig: int) -> None:
        proc = self._procs[rank]
        if proc.poll() is None:
            os.kill(proc.pid, sig)

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (default SIGKILL) to process `rank` if it is still running."""
        self._signal(rank, sig)

    def stop(self, rank: int) -> None:
        """Freeze process `rank` (SIGSTOP): a hang, not a crash; its sockets stay open."""
        self._signal(rank, signal.SIGSTOP)

    def cont(self, rank: int) -> None:
        self._signal(rank, signal.SIGCONT)

    def poll(self, rank: int) -> int | None:
        return self._procs[rank].poll()

    def wait_exit(self, rank: int, timeout_s: float) -> int:
        """Wait for process `rank` to exit; return its code (raises TimeoutError with every rank's output)."""
        deadline = time.monotonic() + timeout_s
        while (code := self._procs[rank].poll()) is None:
            if time.monotonic() > deadline:
                self._fail(f"rank {rank} still running after {timeout_s} s")
            time.sleep(_POLL_S)
        return code

    def wait(self, timeout_s: float | None = None) -> list[int]:
        """Wait for every process; return the exit codes in rank order (negative: killed by that signal).

        On timeout, kills them all and raises TimeoutError with every rank's output tail."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self._procs):
            if time.monotonic() > deadline:
                running = [r for r, p in enumerate(self._procs) if p.poll() is None]
                self._fail(f"ranks {running} still running after {timeout_s} s")
            time.sleep(_POLL_S)
        return [p.returncode for p in self._procs]

    def _fail(self, what: str) -> None:
        self._reap()
        raise TimeoutError(f"{self.target} on {self.world_size} ranks: {what}\n{self.describe()}")

    # ---------------------------------------------------------------------------------------------- output
    def output(self, rank: int) -> str:
        """Everything process `rank` wrote to stdout and stderr so far."""
        try:
            return self.log_path(rank).read_text(errors="replace")
        except OSError:
            return ""

    def describe(self, lines: int = 30) -> str:
        """Every rank's exit code and output tail (for assertion messages)."""
        parts = []
        for r, p in enumerate(self._procs):
            parts.append(f"----- rank {r} (pid {p.pid}, exit code {p.poll()}) -----\n{_tail(self.output(r), lines)}")
        return "\n".join(parts)

    def check_codes(self, codes: Sequence[int], expected: Sequence[int]) -> None:
        assert list(codes) == list(expected), f"exit codes {list(codes)}, expected {list(expected)}\n{self.describe()}"

    # ----------------------------------------------------------------------------------------------- store
    def result(self, rank: int, key: str) -> Any:
        """What `rank` emitted under `key` (KeyError if it has not)."""
        k = emit_key(rank, key)
        if not self.store.check([k]):
            raise KeyError(f"rank {rank} did not emit {key!r}\n{self.describe()}")
        return json.loads(self.store.get(k))

    def results(self, key: str, ranks: Iterable[int] | None = None) -> dict[int, Any]:
        """{rank: value} for the ranks (default: all) that emitted `key`."""
        ranks = range(self.num_procs) if ranks is None else ranks
        return {r: json.loads(self.store.get(emit_key(r, key))) for r in ranks
                if self.store.check([emit_key(r, key)])}

    def wait_emitted(self, key: str, ranks: Iterable[int], timeout_s: float = 30.0) -> dict[int, Any]:
        """Block until every rank of `ranks` emitted `key`; fail early if one of them exits without it."""
        ranks = list(ranks)
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [r for r in ranks if not self.store.check([emit_key(r, key)])]
            if not missing:
                return self.results(key, ranks)
            dead = [r for r in missing if self._procs[r].poll() is not None]
            if dead:
                raise AssertionError(f"ranks {dead} exited without emitting {key!r}\n{self.describe()}")
            if time.monotonic() > deadline:
                self._fail(f"ranks {missing} did not emit {key!r} within {timeout_s} s")
            time.sleep(_POLL_S)

    def set_fault(self, generation: int) -> None:
        """Act as the launcher: declare `generation` failed (every group of it and before raises PeerFailure)."""
        self.store.set(FAULT_KEY, str(generation))

    # --------------------------------------------------------------------------------------------- cleanup
    def _reap(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()  # SIGKILL also ends a stopped process
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a process in uninterruptible sleep
                p.wait(timeout=10)

    def close(self, keep_logs: bool = False) -> None:
        """Kill and reap every rank; remove the logs unless `keep_logs` (or they are not ours)."""
        if self._closed:
            return
        self._closed = True
        self._reap()
        if self._own_log_dir and not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        keep = exc is not None
        self.close(keep_logs=keep)
        if keep and self._own_log_dir:
            sys.stderr.write(f"harness: rank logs of the failed test kept in {self.log_dir}\n")


def emitted_by_ranks(target: str, world_size: int, key: str = "out", timeout_s: float = 60) -> dict[int, Any]:
    """Run `world_size` ranks of `target` to the end (`launch_ranks`); what each emitted under `key`. Fails if a rank
    emits nothing or exits other than 0."""
    with launch_ranks(target, world_size, timeout_s=timeout_s) as ranks:
        outs = ranks.wait_emitted(key, range(world_size), timeout_s=timeout_s)
        assert ranks.wait(timeout_s) == [0] * world_size
    return outs


def launch_ranks(target: str, world_size: int, args: Sequence[Any] = (), timeout_s: float = 60,
                 env: dict[str, str] | None = None, spares: int = 0, *,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, log_dir: Path | None = None) -> RankGroup:
    """Start `world_size` (+ `spares`) processes, each running `target` ("module:function") as `function(ctx)`.

    Every process gets RANK/WORLD_SIZE/LOCAL_RANK and the address of a loopback TCPStore hosted by this process
    (the `NCL_*` variables of `WorkerEnv`), `OMP_NUM_THREADS=1`, and `env` on top of this process's environment.
    `args` must be JSON-serialisable. `timeout_s` bounds store waits and is `wait()`'s default. The ranks pass a
    store barrier before `function` runs, so its first collective does not wait for a slow import elsewhere.
    A rank exits 0 if `function` returns, 1 if it raises (the traceback goes to its output).
    """
    if world_size < 1 or spares < 0:
        raise ValueError(f"world_size={world_size}, spares={spares}: need world_size >= 1 and spares >= 0")
    store, port = host_store(HOST, timeout_s)
    own = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="ncl-ranks-")) if log_dir is None else log_dir
    logs.mkdir(parents=True, exist_ok=True)
    group = RankGroup(target, world_size, spares, store, port, logs, own, timeout_s)
    base = dict(os.environ)
    base.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    base.update(env or {})
    base.update({_ENV_TARGET: target, _ENV_ARGS: json.dumps(list(args)), _ENV_PARENT: str(os.getpid()),
                 _ENV_TIMEOUT: str(collective_timeout_s), _ENV_STORE_TIMEOUT: str(timeout_s),
                 _ENV_PROCS: str(world_size + spares)})
    try:
        for rank in range(world_size + spares):
            proc_env = dict(base)
            proc_env.update(WorkerEnv(rank, world_size, rank, HOST, port, str(logs)).to_environ())
            with open(group.log_path(rank), "wb") as out:
                group._procs.append(subprocess.Popen([sys.executable, "-c", _BOOTSTRAP], env=proc_env, stdout=out,
                                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                     cwd=REPO_ROOT))
    except BaseException:
        group.close()
        raise
    return group


# ------------------------------------------------------------------------------------------------ threads as ranks
@dataclass
class _Outcome:
    result: Any = None
    error: BaseException | None = None
    when: float = 0.0
    membership: Membership | None = None


_DRAIN_AT_EXIT_S = 60.0


def _bury(obj: Any) -> None:
    """Hand the caller's last reference to `obj` to the package's reaper thread, which drops it there.

    Destroying a gloo group whose collective is stuck (a rank failed) blocks until that collective's timeout; done
    on the test's thread, it would stall a later, unrelated test at a random point (whenever the GC runs).
    """
    reap(obj)


@atexit.register
def _drain_grave() -> None:
    # A gloo group still being destroyed when the interpreter finalizes aborts the process ("terminate called
    # without an active exception", exit code 134), e.g. when the session's last test used run_threads.
    wait_released(_DRAIN_AT_EXIT_S)


def _clear_frames(error: BaseException | None) -> None:
    """Drop the locals (groups, tensors) of a finished exception's frames, keeping the traceback printable."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        _clear_frames(error.__cause__)
        error = error.__context__


def run_threads(world_size: int, fn: Callable[[Membership], T], timeout_s: float = 30,
                collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> list[T]:
    """Run `fn(membership)` in one thread per rank; return the results in rank order.

    The ranks share an in-process `HashStore`; each gets its own `Membership` (real gloo groups over loopback).
    When a rank raises, it sets `FAULT_KEY` (as the launcher would), so the others leave their collectives at
    once; the earliest exception is re-raised with a note naming its rank. Fails if a thread is still alive at
    `timeout_s` (the threads are daemons, so a stuck one cannot keep the interpreter alive). Results must not
    hold the membership's groups: those are destroyed on a background thread once every rank is done.
    """
    store = dist.HashStore()
    outcomes = [_Outcome() for _ in range(world_size)]

    def body(rank: int) -> None:
        out = outcomes[rank]
        out.membership = Membership(store, rank, world_size, HOST, collective_timeout_s)
        try:
            out.result = fn(out.membership)
        except BaseException as e:
            out.error, out.when = e, time.monotonic()
            store.set(FAULT_KEY, str(out.membership.generation))

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        store.set(FAULT_KEY, str(1 << 30))  # release any rank stuck in one of our collectives
        raise TimeoutError(f"run_threads: ranks {alive} of {world_size} still running after {timeout_s} s")
    failed = sorted((o.when, r) for r, o in enumerate(outcomes) if o.error is not None)
    first = outcomes[failed[0][1]].error if failed else None
    for o in outcomes:
        _clear_frames(o.error)
        if o.error is not first:
            _bury(o.error)
        _bury(o.membership)
        o.error = o.membership = None
    if first is not None:
        rank = failed[0][1]
        others = [r for _, r in failed[1:]]
        first.add_note(f"(raised in thread rank {rank} of {world_size}; ranks {others} failed after it)")
        raise first
    return [o.result for o in outcomes]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` every 5 ms; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(_POLL_S)
