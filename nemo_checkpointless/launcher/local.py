"""Single-machine launcher: the operator role on one machine.

It hosts the job's TCPStore (so no training rank hosts it), bound to the configured interface (loopback by
default); starts one worker process per rank plus `replication.spares` hot spares (imports done, waiting);
watches them with `waitpid`; and when a worker dies it declares the current generation failed (the survivors'
collectives return at once), hands each lost rank to a spare (or starts a fresh process), publishes the next
generation, refills the spare pool once the recovery is done, and at the end merges the summary with one record
per recovery. It never decides how state is restored: the ranks agree on that among themselves.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import torch.distributed as dist

from nemo_checkpointless import protocol
from nemo_checkpointless.config import Config
from nemo_checkpointless.data.cache import new_job_id, remove_job_cache
from nemo_checkpointless.launcher import procs
from nemo_checkpointless.launcher.spares import ForkedProcess, SpareFactory
from nemo_checkpointless.launcher.stragglers import StragglerWatch
from nemo_checkpointless.launcher.watchdog import HangWatch, Reader
from nemo_checkpointless.protocol import (
    ENV_PREFIX,
    FAULT_KEY,
    GENERATION_KEY,
    GROW_KEY,
    JOB_ID_KEY,
    LAUNCHER_PID_ENV,
    SPARE_ID_ENV,
    STEP_TIMES_KEY,
    TRAIN_START_KEY,
    alive_key,
    finished_key,
    generation_info_key,
    hang_key,
    injected_key,
    record_key,
    regroup_key,
    spare_assign_key,
    spare_ready_key,
    training_key,
)
from nemo_checkpointless.restart import script_runner
from nemo_checkpointless.restart.cost import RATE_WINDOW, StepTimes, fault_costs
from nemo_checkpointless.restart.kin import (
    become_child_subreaper,
    die_with_parent,
    is_child_subreaper,
    stop_being_child_subreaper,
)
from nemo_checkpointless.restart.progress import Beacon
from nemo_checkpointless.restart.template import SPARE_REFILL_ENV
from nemo_checkpointless.restart.worker_env import WorkerEnv
from nemo_checkpointless.topology.shrink import shrink_layout

WORKER_MODULE = "nemo_checkpointless.lightning.worker"
WORKER_MODULES = {"lightning": WORKER_MODULE, "nemo": "nemo_checkpointless.nemo.worker"}  # by `engine`
POLL_S = 0.005
# The watchdogs (a rank's report of a collective timeout, the progress and straggler watch, a shrunk world, spares
# to refill) look every WATCH_S, not at every poll: their deadlines are seconds, and each look costs a round trip
# to the store. A rank's death is still looked for at every poll.
WATCH_S = 0.025
# After the first death, how long to look for others before deciding. Deaths further apart are handled too: the
# later one interrupts the recovery in progress, which restarts at the next generation with both replaced.
GRACE_S = 0.01


class LaunchError(RuntimeError):
    """A worker failed and the job could not continue; `exit_code` is the failed worker's (1 if none)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def process_environ(threads: int, extra_env: dict[str, str]) -> dict[str, str]:
    """The environment of a rank or spare this launcher (or a node's agent) starts: its own, one thread count, and
    `extra_env` (the job's variables) on top."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               **{LAUNCHER_PID_ENV: str(os.getpid())}, **extra_env)
    return env


def start_process(argv: list[str], env: dict[str, str], log: Path | None, nice: int = 0
                  ) -> tuple[subprocess.Popen[bytes], IO[bytes] | None]:
    """A child that dies with this process, its output in `log` (a private file) or on this terminal (None), at
    nice value `nice` (its threads inherit it)."""
    out = os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") if log is not None else None

    def before_exec() -> None:
        die_with_parent()
        if nice:
            os.nice(nice)

    popen = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                             preexec_fn=before_exec)
    return popen, out


def host_store(host: str, timeout_s: float, port: int | None = None, key: str = "--master-port"
               ) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on `host` only (TCPStore alone would listen on every interface), on `port`
    (default: a free one). `key`: the flag that named the port, for the error when it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port or 0))
    except OSError as e:
        sock.close()
        from nemo_checkpointless.errors import ConfigError

        any_port = " (or leave --master-port out for any free one)" if key == "--master-port" else ""
        raise ConfigError(key if port else "launcher.host", f"{host}:{port or 0}",
                          f"cannot be bound for the job's store ({e.strerror})",
                          f"pick a free port{any_port}, on an interface of this machine") from None
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, port


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ProcessHandle(Protocol):
    """What the launcher does with a process: a child (`Popen`), a forked spare, or one on another node's agent."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self) -> int: ...


@dataclass
class _Proc:
    popen: subprocess.Popen[bytes] | ForkedProcess | ProcessHandle
    log: Path | None
    out: IO[bytes] | None


def _exit_status(popen: subprocess.Popen[bytes] | ForkedProcess | ProcessHandle) -> int | None:
    """A process of this machine: its exit code, or the failure it is exiting with (`procs.exit_status`). One on
    another node: what its agent reported (the agent reads that node's /proc; a pid means nothing here)."""
    if isinstance(popen, (subprocess.Popen, ForkedProcess)):
        return procs.exit_status(popen)
    return popen.poll()


def stop_processes(procs: list[_Proc]) -> None:
    """SIGKILL every process still running, then reap them all and close their logs."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
    for p in procs:
        p.popen.wait()
        if p.out is not None:
            p.out.close()


@dataclass
class _Job:
    cfg: Config
    run_dir: Path
    store: dist.TCPStore
    port: int
    worker_module: str
    # A user's command (checkpointless-run: `script.py ARGS`, `-m module ARGS`) instead of our worker module;
    # its ranks get torchrun's environment.
    command: list[str] | None = None
    run_id: str = ""
    # MASTER_PORT's store: the job's store for the first attempt; a fresh one for each whole restart (as
    # torchelastic does: `init_process_group` through the agent's store adds no per-attempt prefix).
    rdzv_store: tuple[dist.TCPStore, int] | None = None
    ranks: dict[int, _Proc] = field(default_factory=dict)
    spares: dict[int, _Proc] = field(default_factory=dict)
    pids: dict[int, list[_Proc]] = field(default_factory=dict)  # every process that was rank r, in order
    # Processes replaced while the kernel was still tearing them down (`procs.exit_status`): reaped once it is done.
    exiting: list[_Proc] = field(default_factory=list)
    factory: SpareFactory | None = None  # our own workers' spare template (warmed up)
    forker: SpareFactory | None = None  # the rank template: every rank, and a user's script's spares
    faults: list[dict[str, Any]] = field(default_factory=list)
    next_watch: float = 0.0  # when `tick` next runs the watchdogs (time.monotonic)
    next_spare: int = 0
    generation: int = 0
    refill: int = 0
    unrecovered: int = 0  # faults since the last recovery that completed (every rank finished a step after it)
    groups_forgotten_below: int = 0  # the generations whose groups' store keys are deleted (`forget_groups`)
    seen_injections: set[int] = field(default_factory=set)
    hang_deadline: float | None = None
    hang_handled: set[int] = field(default_factory=set)  # generations whose hang report was acted on
    # rank -> (generation, time.monotonic()) its replacement was given the rank, until it joins (`watch_joining`)
    joining: dict[int, tuple[int, float]] = field(default_factory=dict)
    hung: set[int] = field(default_factory=set)
    not_started: set[int] = field(default_factory=set)  # replacements killed by `watch_joining`
    progress: HangWatch | None = None  # the progress watchdog (`watch_progress`)
    stragglers: StragglerWatch | None = None  # the straggler report (`watch_progress`)
    progress_generation: int = -1
    # rank -> why the watchdog declared it hung, and the watchdog's deadline then
    hang_reasons: dict[int, tuple[str, float]] = field(default_factory=dict)
    finished_late: set[int] = field(default_factory=set)  # ranks that died after their training had ended
    in_process: bool = False  # a process of the job runs CheckpointlessStrategy (see `recovers_in_process`)
    node_lost: set[int] = field(default_factory=set)  # several nodes: ranks that died with their node
    # A shrunk world (replication.shrink, `topology.shrink`): the ranks that train (None: all), the survivors
    # left out of it (their processes wait inside `fit` for the job to grow back), the ranks with no process.
    active: list[int] | None = None
    parked: set[int] = field(default_factory=set)
    missing: set[int] = field(default_factory=set)
    actives: dict[int, list[int]] = field(default_factory=dict)  # generation -> its active ranks, when shrunk

    def process_env(self, extra_env: dict[str, str]) -> dict[str, str]:
        return process_environ(self.cfg.launcher.threads_per_rank, extra_env)

    def python_argv(self) -> list[str]:
        """What every rank runs, as the interpreter's arguments (after `python`)."""
        return self.command[1:] if self.command is not None else ["-u", "-m", self.worker_module]

    def _start(self, extra_env: dict[str, str], log_name: str | None, nice: int = 0) -> _Proc:
        if self.forker is not None:
            # Forked from the rank template, which imported torch and Lightning (and NeMo) once.
            log = self.run_dir / "logs" / log_name if log_name is not None else None
            env = {**self.process_env(extra_env), script_runner.ARGV_ENV: json.dumps(self.python_argv())}
            return _Proc(self.forker.fork(env, log, lambda: self._spawn(extra_env, log_name, nice)[0],
                                          replace_env=True, nice=nice), log, None)
        popen, log, out = self._spawn(extra_env, log_name, nice)
        return _Proc(popen, log, out)

    def _spawn(self, extra_env: dict[str, str], log_name: str | None, nice: int = 0
               ) -> tuple[subprocess.Popen[bytes], Path | None, IO[bytes] | None]:
        log = self.run_dir / "logs" / log_name if log_name is not None else None
        argv = [sys.executable, "-m", self.worker_module] if self.command is None else self.command
        popen, out = start_process(argv, self.process_env(extra_env), log, nice)
        return popen, log, out

    def _env(self, rank: int) -> dict[str, str]:
        world = self.cfg.trainer.world_size
        env = WorkerEnv(rank, world, rank, self.cfg.launcher.host, self.port, str(self.run_dir)).to_environ()
        env.update(self.settings_env())
        if self.command is not None:
            env.update(self.torchrun_env(rank))
        return env

    def settings_env(self) -> dict[str, str]:
        """The job's settings every process of it reads from its environment (`restart.session`, the strategies),
        whatever started it: the package's own workers and a user's command, a rank and a spare, on one node or
        several. The config defines, defaults and validates each (`config`); this is the one way it travels."""
        cfg = self.cfg
        env = {protocol.COLLECTIVE_TIMEOUT_ENV: str(cfg.launcher.collective_timeout_s),
               protocol.START_TIMEOUT_ENV: str(cfg.launcher.start_timeout_s),
               protocol.CHECKPOINT_EVERY_ENV: str(cfg.checkpoint.every_n_steps),
               # Always: a strategy built without num_instances takes this (1 too: `checkpointless-run
               # --num-instances 1` was once dropped, and the strategy's default of 2 trained instead).
               protocol.NUM_INSTANCES_ENV: str(cfg.replication.num_instances),
               protocol.INTEGRITY_EVERY_ENV: str(cfg.integrity.every_n_steps),
               protocol.INTEGRITY_FENCE_ENV: str(cfg.integrity.fence_after),
               protocol.NAN_POLICY_ENV: cfg.integrity.nan_policy,
               protocol.VERBOSE_ENV: "1" if cfg.launcher.verbose else "0"}
        if cfg.checkpoint.dir:
            env[protocol.CHECKPOINT_DIR_ENV] = cfg.checkpoint.dir
        if cfg.data.cache_root:
            env[protocol.CACHE_ROOT_ENV] = cfg.data.cache_root
        if cfg.replication.shrink:
            env[protocol.SHRINK_ENV] = "1"
            env[protocol.REPLACEMENT_TIMEOUT_ENV] = str(cfg.replication.replacement_timeout_s)
        return env

    def torchrun_env(self, rank: int) -> dict[str, str]:
        """What torchrun sets for a worker (one node), plus what only a user's command reads (a recipe's layout,
        the fault plan). The store is the launcher's: `TORCHELASTIC_USE_AGENT_STORE` makes `init_process_group` a
        client of it on every rank (rank 0 does not host one)."""
        world, launcher = self.cfg.trainer.world_size, self.cfg.launcher
        env = {"LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
               "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": launcher.host,
               "MASTER_PORT": str(self.rdzv_store[1] if self.rdzv_store else self.port),
               "TORCHELASTIC_RUN_ID": self.run_id, "TORCHELASTIC_RESTART_COUNT": str(self.generation),
               "TORCHELASTIC_MAX_RESTARTS": str(launcher.max_restarts), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        if self.cfg.script is not None:  # a recipe's script= run: the recipe's layout, for the user's strategy
            for name, key, _ in protocol.LAYOUT_ENV:
                env[name] = str(getattr(self.cfg.parallel, key.split(".")[1]))
        if self.cfg.fault.plan:
            env[protocol.FAULT_PLAN_ENV] = json.dumps([f.as_dict() for f in self.cfg.fault.plan])
        error_file = self.run_dir / "logs" / f"error_rank{rank}.{len(self.pids.get(rank, []))}.json"
        env.update(ROLE_RANK=str(rank), TORCHELASTIC_ERROR_FILE=str(error_file))
        return env

    def start_rank(self, rank: int, join_generation: int = 0, restart: bool = False) -> None:
        env = self._env(rank)
        if join_generation:
            env[f"{ENV_PREFIX}{'RESTART' if restart else 'JOIN'}_GENERATION"] = str(join_generation)
        self.ranks[rank] = self._start(env, None if rank == 0 else f"rank_{rank}.{len(self.pids.get(rank, []))}.log")
        self.pids.setdefault(rank, []).append(self.ranks[rank])

    def spare_env(self) -> dict[str, str]:
        env = self._env(0)
        for key in ("RANK", "LOCAL_RANK", "ROLE_RANK", "TORCHELASTIC_ERROR_FILE"):
            env.pop(key, None)
        return env

    def start_spare(self, refill: bool = False) -> None:
        """A hot spare; a `refill` (started while the job trains) warms up at idle CPU priority. A refill that is a
        new interpreter (a user's script: no template) runs niced as a whole, imports included, where this
        launcher may restore its priority when it takes a rank (`procs.may_restore_priority`): measured on 2 cores,
        its imports at normal priority cost the training ranks about 2 s of job time per recovery."""
        spare_id = self.next_spare
        self.next_spare += 1
        extra = {SPARE_ID_ENV: str(spare_id), SPARE_REFILL_ENV: "1" if refill else "0"}
        env = {**self.spare_env(), **extra}
        log_name = f"spare_{spare_id}.log"
        if self.factory is None:
            nice = procs.REFILL_NICE if refill and procs.may_restore_priority() else 0
            self.spares[spare_id] = self._start(env, log_name, nice)
            return
        # Forked from the warm template: no imports, no warm-up on the cores the ranks train on.
        log = self.run_dir / "logs" / log_name
        self.spares[spare_id] = _Proc(self.factory.fork(extra, log, spawn=lambda: self._spawn(env, log_name)[0]),
                                      log, None)

    def replace(self, failed: list[int], codes: dict[int, int | None]) -> None:
        """Declare the current generation failed, give each failed rank a process, publish the next generation."""
        t_seen = self.fault_seen_t()
        self.generation += 1
        self.hang_deadline = None  # a check-in round of the failed generation (`watch_hangs`) ends with it
        self.unrecovered += 1
        if self.unrecovered > self.cfg.launcher.max_restarts:
            raise LaunchError(f"rank(s) {failed} failed; {self.unrecovered - 1} faults in a row did not recover "
                              f"(launcher.max_restarts={self.cfg.launcher.max_restarts} counts faults whose recovery "
                              f"did not complete); giving up. {self.where(failed[0]) if failed else ''}",
                              exit_code=max(1, codes[failed[0]] or 1) if failed else 1)
        injected = self._injected(failed)
        # A process that failed before it ever trained (and was not made to) has a set-up error (an import, the
        # config, the machine), not a fault a replacement would survive: stop at once instead of replacing it
        # launcher.max_restarts times. Our workers say when they start training; a worker of one's own may not.
        # A death by a signal (SIGKILL, SIGSEGV, SIGTERM from outside) is a fault, whenever it comes; when one rank
        # died by a signal, the others' errors are its consequence.
        # A rank that must go back to the seeded initial state and cannot rebuild it in place asks for a restart of
        # the whole job (`RESTART_ALL_EXIT_CODE`); a replacement that was joining then fails with it, a consequence.
        asked_restart = any(codes.get(r) == protocol.RESTART_ALL_EXIT_CODE for r in failed)
        broken = [r for r in failed if r not in injected and r not in self.hung and r not in self.not_started
                  and not asked_restart and not self.store.check([training_key(self.ranks[r].popen.pid)])]
        by_signal = any((codes[r] or 0) < 0 for r in failed)
        if broken and self.command is not None:
            broken = [] if by_signal else [r for r in broken if (codes[r] or 0) > 0]
        if broken and (self.command is not None or self.worker_module in WORKER_MODULES.values()):
            raise LaunchError(f"rank(s) {failed} failed before training (exit code {codes[broken[0]]}); "
                              f"{self.where(broken[0])}", exit_code=codes[broken[0]] or 1)
        restart_all = (self.cfg.launcher.on_failure == "restart_all" or not self.recovers_in_process()
                       or asked_restart)
        if restart_all:
            # The baseline: stop every process, as a job restart does, and start the whole job again.
            for p in [*self.ranks.values(), *self.spares.values()]:
                if p.popen.poll() is None:
                    p.popen.kill()
            for p in [*self.ranks.values(), *self.spares.values()]:
                p.popen.wait()
            if self.command is not None:
                self.refill += len(self.spares)  # a user's script keeps its spares once the restart is done
            self.spares.clear()
            if self.command is not None:
                self.rdzv_store = host_store(self.cfg.launcher.host, self.cfg.launcher.start_timeout_s)
        how: dict[int, str] = {}
        reshape: str | None = None
        active: list[int] | None = None
        if not restart_all and self.active is not None:
            # A fault in a shrunk world: it grows back at once, every missing rank given a process and the parked
            # ones taking part as replacements (they receive their state like a spare would).
            reshape = "grow"
            rejoin = self._unshrink(how)
        elif not restart_all and self.cfg.replication.shrink and len(self._ready_spares(failed)) < len(failed):
            shrunk = shrink_layout(self.cfg.dims(), failed)
            if shrunk is not None:
                reshape, active = "shrink", list(shrunk)
        if reshape == "shrink":
            assert active is not None
            # No spare for them: the whole instances go on alone, and spares are started for the lost ranks (the
            # job grows back when they are ready, `tick`).
            for rank in failed:
                dead = self.ranks.pop(rank)
                self.exiting.append(dead)
                if dead.out is not None:
                    dead.out.close()
                how[rank] = "none: the job shrank"
            self.missing = set(failed)
            self.parked = {r for r in self.ranks if r not in active}
            self.active = active
            self.actives[self.generation] = active
            self.refill += max(0, len(failed) - len([p for p in self.spares.values() if p.popen.poll() is None]))
        for rank in [] if reshape == "shrink" else list(self.ranks) if restart_all else failed:
            dead = self.ranks.pop(rank)
            self.exiting.append(dead)
            if dead.out is not None:
                dead.out.close()
            if restart_all:
                self.start_rank(rank, join_generation=self.generation, restart=True)
                continue
            self.ranks[rank] = self._take_spare_or_start(rank, how)
        if reshape == "grow":
            failed = sorted({*failed, *rejoin})
        fault_t = min([t_seen, *(i["t"] for i in injected.values())])
        kinds = sorted({i["kind"] for i in injected.values()}
                       | {"hang" for r in failed if r in self.hung and r not in injected}
                       | {"start_timeout" for r in failed if r in self.not_started}
                       | {"node" for r in failed if r in self.node_lost}
                       | {"restart_requested" for r in failed if codes.get(r) == protocol.RESTART_ALL_EXIT_CODE}
                       ) or ["crash"]
        if not failed:
            kinds = ["timeout"]
        self.hung.difference_update(failed)  # their replacements start unsuspected
        self.not_started.difference_update(failed)
        self.node_lost.difference_update(failed)
        # The step the fault interrupted, when known (an injected fault says it): ranks stamp when they are
        # back there, which is how a recovery and a whole-job restart are compared.
        target = min((i["step"] for i in injected.values()), default=None)
        hung = {r: self.hang_reasons.pop(r) for r in failed if r in self.hang_reasons}
        self.faults.append({"generation": self.generation, "failed_ranks": failed, "fault_kind": "+".join(kinds),
                            "fault_t": fault_t, "exit_codes": {str(r): codes.get(r) for r in failed},
                            "target_step": target, "restart_all": restart_all,
                            "hang": {str(r): why for r, (why, _) in hung.items()},
                            "hang_deadline_s": max((deadline for _, deadline in hung.values()), default=None),
                            "replacement": {str(r): how.get(r, "whole-job restart") for r in failed},
                            **({"reshape": reshape, "active_ranks": active} if reshape else {})})
        if reshape:
            self.say_reshape(reshape, active)
        self.store.set(generation_info_key(self.generation),
                       protocol.GenerationInfo(failed, fault_t, target, active).to_json())
        self.store.set(GENERATION_KEY, str(self.generation))

    def _ready_spares(self, failed: list[int]) -> list[int]:
        """The spares ready to take a rank now; with replication.replacement_timeout_s, first waits that long for
        spares still starting to become ready (the survivors wait in their recovery meanwhile)."""
        deadline = time.monotonic() + self.cfg.replication.replacement_timeout_s
        starting = any(p.popen.poll() is None for p in self.spares.values())
        while starting and len(self._ready_spare_ids()) < len(failed) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return self._ready_spare_ids()

    def _ready_spare_ids(self) -> list[int]:
        return [k for k, p in self.spares.items() if p.popen.poll() is None and self.store.check([spare_ready_key(k)])]

    def _unshrink(self, how: dict[int, str]) -> list[int]:
        """Back to the whole world: a process for every missing rank (`how` says which); returns the ranks that
        rejoin (the missing and the parked ones), which receive their state like replacements."""
        for rank in sorted(self.missing):
            self.ranks[rank] = self._take_spare_or_start(rank, how)
        rejoin = sorted(self.missing | self.parked)
        self.missing.clear()
        self.parked.clear()
        self.active = None
        self.store.delete_key(GROW_KEY)  # a request of the shrunk world, which is over
        return rejoin

    def _take_spare_or_start(self, rank: int, how: dict[int, str]) -> _Proc:
        """A process for `rank` in the generation being published: a spare (ready first; one still starting is
        still ahead of a cold start), else a fresh process."""
        live = [k for k, p in self.spares.items() if p.popen.poll() is None]
        live.sort(key=lambda k: not self.store.check([spare_ready_key(k)]))
        if live:
            spare_id = live[0]
            how[rank] = "warm spare" if self.store.check([spare_ready_key(spare_id)]) else "starting spare"
            proc = self.spares.pop(spare_id)
            if isinstance(proc.popen, ForkedProcess):
                proc.popen.resolve(block=True)  # its pid (a warm template answers in milliseconds)
            if isinstance(proc.popen, (subprocess.Popen, ForkedProcess)):  # a refill started niced trains at 0
                procs.restore_priority(proc.popen.pid)
            self.store.set(spare_assign_key(spare_id), protocol.Assignment(rank, self.generation).to_json())
            self.pids.setdefault(rank, []).append(proc)
            self.refill += 1
            self.joining[rank] = (self.generation, time.monotonic())
            return proc
        how[rank] = "cold start"
        self.start_rank(rank, join_generation=self.generation)
        self.joining[rank] = (self.generation, time.monotonic())
        return self.ranks[rank]

    def say_reshape(self, kind: str, active: list[int] | None) -> None:
        if kind == "shrink":
            assert active is not None
            print(f"checkpointless: no spare for rank(s) {sorted(self.missing)}: the job goes on with ranks {active} "
                  f"(the same global batch; rank(s) {sorted(self.parked)} wait) and grows back when spares are "
                  "ready", file=sys.stderr, flush=True)
        else:
            print("checkpointless: the job grows back to every rank", file=sys.stderr, flush=True)

    def grow(self) -> None:
        """The shrunk world agreed to grow back and left `fit` at a step boundary (`regroup_key`): publish the next
        generation, the whole world, each missing rank given a spare, the parked ranks receiving their state."""
        self.generation += 1
        how: dict[int, str] = {}
        rejoin = self._unshrink(how)
        now = time.time()
        self.faults.append({"generation": self.generation, "failed_ranks": rejoin, "fault_kind": "grow",
                            "fault_t": now, "exit_codes": {}, "target_step": None, "restart_all": False, "hang": {},
                            "replacement": {str(r): how.get(r, "parked survivor") for r in rejoin},
                            "reshape": "grow", "active_ranks": None})
        self.say_reshape("grow", None)
        self.store.set(generation_info_key(self.generation),
                       protocol.GenerationInfo(rejoin, now, None, None).to_json())
        self.store.set(GENERATION_KEY, str(self.generation))

    def forget_groups(self) -> None:
        """The store keys of the process groups of generations no rank uses any more (all but the two newest:
        every rank has left a generation once the one after it was declared failed or grown), deleted: a job that
        recovers a thousand times holds the keys of two generations' groups, not of a thousand. The job's records
        (`job/...`) stay. Called once the newest generation's recovery completed (every rank trained a step in it)
        and at the end, not as a generation is published: the ranks then form its groups through this store."""
        if self.generation - 1 <= self.groups_forgotten_below:
            return
        for key in self.store.list_keys():
            generation = protocol.group_generation(key)
            if generation is not None and generation < self.generation - 1:
                self.store.delete_key(key)
        self.groups_forgotten_below = self.generation - 1

    def watch_shrunk(self) -> None:
        """A shrunk world: once a spare is ready for every missing rank, ask the ranks to grow back (they agree on
        the step in their gradient all-reduce and leave `fit` after it); when they have, publish it."""
        if self.active is None:
            return
        if self.store.check([regroup_key(self.generation)]):
            self.grow()
            return
        if any(f.kind == "grow" for f in self.cfg.fault.plan):
            return  # a test's fault plan fixes the steps at which the job grows back (`grow`), not the spares
        if len(self._ready_spare_ids()) >= len(self.missing) and not self.store.check([GROW_KEY]):
            self.store.set(GROW_KEY, str(self.generation))

    def fault_seen_t(self) -> float:
        """When the launcher saw the failure it is about to handle."""
        return time.time()

    def watch_hangs(self, codes: dict[int, int | None]) -> None:
        """The watchdog. A rank reported a collective timeout: every healthy rank checks in (it reaches recovery
        when its own collective times out or fails) within one collective timeout. The ranks that never do are
        hung: they are killed, which turns the hang into an ordinary failure. If every rank checked in, nobody is
        hung (a spurious timeout): the next generation is published with no rank replaced, and the ranks re-form
        their groups and retry."""
        g = self.generation
        if self.hang_deadline is None:
            # Once per generation: the killed rank may still look alive for a poll or two.
            if g not in self.hang_handled and self.store.check([hang_key(g)]):
                self.hang_deadline = time.monotonic() + self.cfg.launcher.collective_timeout_s
            return
        live = [r for r, c in codes.items() if c is None and r not in self.parked]
        silent = [r for r in live if not self.store.check([alive_key(g, r)])]
        if silent and time.monotonic() < self.hang_deadline:
            return
        self.hang_deadline = None
        self.hang_handled.add(g)
        if not silent:
            self.store.set(FAULT_KEY, str(g))
            self.replace([], codes)
            return
        for r in silent:
            self.hung.add(r)
            self.ranks[r].popen.kill()

    def watch_joining(self, codes: dict[int, int | None]) -> None:
        """A replacement that has not joined its generation (its recovery record: the ranks agreed and it received
        its state) within launcher.start_timeout_s of being given its rank (a spare that cannot start in time: a
        node too slow to start it, or a start that hangs) is killed, one collective timeout after the survivors
        stopped waiting for it (their own verdict comes first, as with a hang): an ordinary failure, replaced in the
        next generation (another spare if one is ready, else a fresh process)."""
        now = time.monotonic()
        limit = self.cfg.launcher.start_timeout_s + self.cfg.launcher.collective_timeout_s
        for rank, (generation, given) in list(self.joining.items()):
            if (generation != self.generation or codes.get(rank) is not None
                    or self.store.check([record_key(generation, rank)])):
                del self.joining[rank]  # it joined, it exited, or a later generation took over
            elif now - given > limit:
                del self.joining[rank]
                self.not_started.add(rank)
                print(f"checkpointless: rank {rank}'s replacement did not start within launcher.start_timeout_s="
                      f"{self.cfg.launcher.start_timeout_s:g} s: it is killed and replaced again", file=sys.stderr,
                      flush=True)
                self.ranks[rank].popen.kill()

    def exit_codes(self) -> dict[int, int | None]:
        """Each rank's exit code (None: running). A process that died after its training ended and its results were
        written (`finished_key`; e.g. killed while the interpreter exits) counts as finished: 0. One that exited 0
        before that, in a job that recovers in process, keeps its 0 but is a failure (`left_early`)."""
        codes = {r: _exit_status(p.popen) for r, p in self.ranks.items()}
        for r, c in codes.items():
            if c not in (None, 0) and self.store.check([finished_key(self.ranks[r].popen.pid)]):
                if r not in self.finished_late:
                    print(f"checkpointless: rank {r} exited with {c} after its training had ended and its results "
                          "were written: counted as finished", file=sys.stderr, flush=True)
                    self.finished_late.add(r)
                codes[r] = 0
        return codes

    def left_early(self, rank: int, code: int | None) -> bool:
        """A rank whose process exited 0 before its training ended (it never set `finished_key`; e.g. a library's
        `sys.exit(0)` in the middle of a step), in a job whose processes recover in process: a fault, replaced like
        a crash. A tier-1 script (the launcher alone) does not say when it finished: its exit 0 is a success."""
        return (code == 0 and not self.store.check([finished_key(self.ranks[rank].popen.pid)])
                and self.recovers_in_process())

    def watch_progress(self, codes: dict[int, int | None]) -> None:
        """The progress watchdog (`launcher.watchdog.HangWatch`): a rank it finds hung is killed, which the next
        poll handles as the rank's death (a fault of kind `hang`, replaced like a crash)."""
        if self.progress is None:
            lc = self.cfg.launcher
            hang_reader, beacon_reader = self.progress_readers()
            self.progress = HangWatch(self.run_dir, lc.hang_deadline_s, reader=hang_reader)
            self.stragglers = StragglerWatch(self.run_dir, lc.straggler_factor, lc.straggler_window,
                                             read=beacon_reader)
        assert self.stragglers is not None
        if self.progress_generation != self.generation:
            self.progress.reset()
            self.stragglers.reset()
            self.progress_generation = self.generation
        live = {r: self.ranks[r].popen.pid for r, c in codes.items()
                if c is None and r not in self.hung and r not in self.parked}
        for line in self.stragglers.observe(live):
            print(f"checkpointless: {line}", file=sys.stderr, flush=True)
        for rank, why in self.progress.check(live):
            print(f"checkpointless: rank {rank} is hung: {why} (no progress for longer than the "
                  f"{self.progress.deadline():.1f} s deadline); replacing it", file=sys.stderr, flush=True)
            self.hung.add(rank)
            self.hang_reasons[rank] = (why, round(self.progress.deadline(), 3))
            self.ranks[rank].popen.kill()

    def progress_readers(self) -> tuple[Reader | None, Callable[[int], Beacon | None] | None]:
        """How the watchdog and the straggler report read a rank's beacon and /proc (None: this machine's files)."""
        return None, None

    def recovers_in_process(self) -> bool:
        """Whether the job's processes recover in place (they run `CheckpointlessStrategy`). A user's script whose
        processes never said so (tier 1: the launcher alone, e.g. plain DDP; or a death before any rank reached
        `fit`) is restarted whole, from its own checkpoint, with the store kept and a fresh `MASTER_PORT` store."""
        if self.command is None or self.in_process:
            return True
        # Every rank runs the same script: once one process of the job said so, the job recovers in process
        # (a replacement still starting has not said so yet).
        self.in_process = any(self.store.check([protocol.checkpointless_key(p.popen.pid)])
                              for procs in self.pids.values() for p in procs)
        return self.in_process

    def where(self, rank: int) -> str:
        """Where a failed rank's error is: the last line of its log, and the log (rank 0 writes to this terminal)."""
        proc = self.ranks.get(rank)
        if proc is None or proc.log is None:
            return f"rank {rank}'s traceback is above"
        last = next((line.strip() for line in reversed(_tail(proc.log).splitlines()) if line.strip()), "(empty log)")
        # Whole up to 1000 characters: the last line is usually the error, and a ConfigError's fix is at its end
        # (cut at 300, "--shrink ... this loader uses MmapDataM" lost the loader's name and the fix).
        return f"rank {rank}: {last[:1000]} (log: {proc.log})"

    def _injected(self, failed: list[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for i, spec in enumerate(self.cfg.fault.plan):
            key = injected_key(i)
            if spec.rank in failed and i not in self.seen_injections and self.store.check([key]):
                self.seen_injections.add(i)
                out[spec.rank] = json.loads(self.store.get(key))
        return out

    def trained_in(self, generation: int) -> list[int]:
        """The ranks that train in `generation` (a shrunk one's, or all)."""
        return self.actives.get(generation) or list(range(self.cfg.trainer.world_size))

    def recovery_done(self, generation: int) -> bool:
        return all(self.store.check([record_key(generation, r) + "/first_step"]) for r in self.trained_in(generation))

    def _stamps(self, generation: int, kind: str) -> list[dict[str, Any]]:
        keys = [record_key(generation, r) + f"/{kind}" for r in self.trained_in(generation)]
        return [json.loads(self.store.get(k)) for k in keys if self.store.check([k])]

    def records(self) -> list[dict[str, Any]]:
        out = []
        superseded: list[dict[str, Any]] = []
        for fault in self.faults:
            g = fault["generation"]
            world = len(self.trained_in(g))
            recs = {r: json.loads(self.store.get(record_key(g, r))) for r in self.trained_in(g)
                    if self.store.check([record_key(g, r)])}
            if not recs and not fault["restart_all"] and fault is not self.faults[-1]:
                # A later failure interrupted this recovery; the next generation recovered both: one record.
                superseded.append(fault)
                continue
            if superseded:
                fault = {**fault,
                         "failed_ranks": sorted({r for f in [*superseded, fault] for r in f["failed_ranks"]}),
                         "fault_t": min(f["fault_t"] for f in [*superseded, fault]),
                         "fault_kind": "+".join(sorted({k for f in [*superseded, fault]
                                                        for k in f["fault_kind"].split("+")})),
                         "exit_codes": {k: v for f in [*superseded, fault] for k, v in f["exit_codes"].items()},
                         "replacement": {k: v for f in [*superseded, fault] for k, v in f["replacement"].items()},
                         "target_step": min((f["target_step"] for f in [*superseded, fault]
                                             if f["target_step"] is not None), default=None)}
                superseded = []
            stamps = {kind: self._stamps(g, kind) for kind in ("first_step", "caught_up")}
            survivors = [r for r in recs.values() if r["role"] == "survivor"]
            if fault["restart_all"]:
                path, step = "restart", stamps["first_step"][0]["step"] - 1 if stamps["first_step"] else None
            else:
                path = next((r["path"] for r in recs.values()), "unknown")
                step = next((r["step"] for r in recs.values()), None)
            in_flight = fault["target_step"]
            completed = max((r["completed"] for r in survivors), default=None)
            if in_flight is None and completed is not None:
                in_flight = completed + 1
            t0 = fault["fault_t"]
            rolled: list[int] = next((r["rolled_forward"] for r in recs.values() if r.get("rolled_forward")), [])
            rewound: list[int] = next((r["rewound"] for r in recs.values() if r.get("rewound")), [])

            def elapsed(ts: list[dict[str, Any]], t0: float = t0, world: int = world) -> float | None:
                return round(max(s["t"] for s in ts) - t0, 4) if len(ts) == world else None

            out.append({
                "fault_kind": fault["fault_kind"],
                "fault_t": round(t0, 3),  # when the launcher saw the fault (time.time())
                "failed_ranks": fault["failed_ranks"],
                "step": in_flight,
                "path": path,
                "resumed_from_step": step,
                "detect_s": round(max(r["detect_t"] for r in survivors) - t0, 4) if survivors else None,
                "state_restored_s": round(max(r["decided_t"] for r in recs.values()) - t0, 4) if recs else None,
                "recover_s": elapsed(stamps["first_step"]),
                "back_at_fault_step_s": elapsed(stamps["caught_up"]),
                # A step completed by rolling survivors forward (`restart.recovery`) resumes at the fault step itself.
                "steps_lost": max(0, in_flight - 1 - step) if in_flight is not None and step is not None else None,
                "bytes_received": sum(r["bytes_received"] for r in recs.values()),
                "transfer_s": max((r.get("transfer_s", 0.0) for r in recs.values()), default=0.0),
                "reason": next((r["reason"] for r in recs.values()), ""),
                # Survivors that completed the fault step from a replica's parameters (`restart.recovery`)
                **({"rolled_forward": rolled} if rolled else {}),
                # Survivors past the fault step's gradient all-reduce that took their boundary back from a replica
                **({"rewound": rewound} if rewound else {}),
                "exit_codes": fault["exit_codes"],
                "replacement": fault["replacement"],
                # why the watchdog declared it hung, and its deadline then (max(floor, 10 x p95 step) by default)
                **({"hang": fault["hang"], "hang_deadline_s": fault.get("hang_deadline_s")} if fault.get("hang")
                   else {}),
                # A change of the world's shape (replication.shrink): "shrink" (the ranks that went on) or "grow"
                **({"reshape": fault["reshape"], "active_ranks": fault["active_ranks"]} if fault.get("reshape")
                   else {}),
            })
        return out


    def tick(self) -> bool:
        """One poll of the job: a failed rank is replaced, hangs are looked for, spares refilled once a recovery
        is done, a shrunk world grown back. True once every rank (that trains) finished."""
        self.exiting = [p for p in self.exiting if p.popen.poll() is None]
        codes = self.exit_codes()
        for rank in [r for r in self.parked if codes.get(r) is not None]:
            # A parked rank that dies interrupts nobody: it is one more rank the job grows back with a spare.
            print(f"checkpointless: parked rank {rank} exited ({codes[rank]}); a spare will take its place",
                  file=sys.stderr, flush=True)
            self.parked.discard(rank)
            self.missing.add(rank)
            self.exiting.append(self.ranks.pop(rank))
            del codes[rank]
            self.refill += 1
        failed = [r for r, c in codes.items() if c not in (None, 0) or self.left_early(r, c)]
        done = [r for r, c in codes.items() if c == 0 and r not in failed]
        if failed and done:
            # Peers that finished cannot recover it (the job ends as a whole or not at all): stop, not wait.
            raise LaunchError(f"rank(s) {failed} failed after rank(s) {done} finished training; there is no "
                              f"peer left to recover them. {self.where(failed[0])}",
                              exit_code=max(1, abs(codes[failed[0]] or 1)))
        if failed and self.store.check([protocol.STOP_KEY]):
            stop = json.loads(self.store.get(protocol.STOP_KEY))  # the ranks stopped the job on purpose
            raise LaunchError(f"rank {stop['rank']} stopped the job: {stop['message']}", exit_code=stop["exit_code"])
        if failed:
            self.store.set(protocol.fault_ranks_key(self.generation), json.dumps(sorted(failed)))
            self.store.set(FAULT_KEY, str(self.generation))  # unblock the survivors' collectives at once
            time.sleep(GRACE_S)
            codes = self.exit_codes()
            failed = [r for r, c in codes.items() if c not in (None, 0) or self.left_early(r, c)]
            for r in [r for r in failed if codes[r] == 0]:
                print(f"checkpointless: rank {r} exited with status 0 before its training ended: a failure, "
                      "replaced like a crash", file=sys.stderr, flush=True)
            self.replace(failed, codes)
            return False
        if all(c == 0 for r, c in codes.items() if r not in self.parked):
            return True  # (a shrunk world grows back before its ranks end: none is parked here in practice)
        now = time.monotonic()
        if now < self.next_watch:
            return False
        self.next_watch = now + WATCH_S
        self.watch_hangs(codes)
        self.watch_joining(codes)
        self.watch_progress(codes)
        self.watch_shrunk()
        waiting = self.generation - 1 > self.groups_forgotten_below or self.unrecovered or self.refill
        if not waiting or not self.recovery_done(self.generation):  # read from the store once a tick at most
            return False
        self.forget_groups()
        self.unrecovered = 0  # the restart budget counts failures in a row, not the run's recoveries
        for _ in range(self.refill):
            self.start_spare(refill=True)
        self.refill = 0
        return False

    def summary(self, wall_s: float) -> dict[str, Any]:
        """The job's `summary.json` (written to the run dir, and returned), once every rank finished."""
        # What rank 0's CheckpointlessCallback reports; a worker without the callback (tier 1: the launcher alone)
        # reports nothing, and the summary says only what the launcher saw.
        cfg, run_dir, store = self.cfg, self.run_dir, self.store
        self.forget_groups()  # every rank has ended: the last recovery's old groups, if no tick deleted them yet
        path = run_dir / protocol.WORKER_SUMMARY
        worker_summary: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        train_s: float | None = None
        if "train_end_t" in worker_summary and store.check([TRAIN_START_KEY]):
            # From the first training step of the job to the end, across every recovery (not one process's view).
            train_s = round(worker_summary["train_end_t"] - json.loads(store.get(TRAIN_START_KEY)), 3)
        final_step = worker_summary.get("final_step")
        recoveries = self.records()
        if store.check([STEP_TIMES_KEY]):
            # The job time each fault cost, from rank 0's step times (not only the window around the fault).
            times = StepTimes.parse(store.get(STEP_TIMES_KEY).decode())
            times.write_csv(run_dir / "steps.csv")
            for record, cost in zip(recoveries, fault_costs(times, [r["step"] for r in recoveries], final_step),
                                    strict=True):
                record.update(cost.to_json())
        summary: dict[str, Any] = {
            "recipe": cfg.recipe_name,
            "world_size": cfg.trainer.world_size,
            "num_instances": cfg.replication.num_instances,
            "spares": cfg.replication.spares,
            "seed": cfg.seed,
            "final_step": final_step,
            "wall_s": wall_s,
            "train_s": train_s,
            "steps_per_s": round(final_step / train_s, 3) if final_step and train_s else None,
            "state_sha256": worker_summary.get("state_sha256"),
            "data_sha256": worker_summary.get("data_sha256"),
            # The cross-replica checks (restart.integrity): how many, their cost, a record per one that found something
            "integrity": worker_summary.get("integrity"),
            "rate_window_steps": RATE_WINDOW,
            "recoveries": recoveries,
            # Changes of the world's shape (replication.shrink): when the job shrank and grew back, and to whom.
            "reshapes": [{"kind": r["reshape"], "step": r["resumed_from_step"], "active_ranks": r["active_ranks"],
                          "failed_ranks": r["failed_ranks"]} for r in recoveries if r.get("reshape")],
            **(self.stragglers.summary() if self.stragglers else {"stragglers": [], "rank_busy_s": {}}),
            # The progress watchdog's deadline at the end (the fixed one, or what the step times made of it).
            "hang_deadline_s": round(self.progress.deadline(), 3) if self.progress and self.progress.enabled else None,
            "pids": {str(r): [p.popen.pid for p in procs] for r, procs in sorted(self.pids.items())},
            # How many keys the job's store holds at the end: bounded by the job's size and its recoveries, not by
            # its step count (what grows with the steps would fill the store's memory on a long job); of them, the
            # process groups' (two generations' at most, `forget_groups`: not growing with the recoveries either).
            "store_keys": store.num_keys(),
            "store_group_keys": sum(protocol.group_generation(k) is not None for k in store.list_keys()),
        }
        tmp = run_dir / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(run_dir / "summary.json")
        return summary


def run_local(cfg: Config, run_dir: Path, worker_module: str | None = None,
              command: list[str] | None = None, port: int | None = None) -> dict[str, Any]:
    """Run the job described by `run_dir/config.yaml` on `cfg.trainer.devices` local ranks; return the summary.
    Each rank runs `python -m worker_module` (default: the worker of `cfg.engine`), or `command` (a user's
    script under `checkpointless-run`, with torchrun's environment).

    Rank 0 writes to this process's terminal; the others write to `run_dir/logs/rank_<r>.<n>.log`.
    """
    t0 = time.perf_counter()
    store, port = host_store(cfg.launcher.host, cfg.launcher.start_timeout_s, port)
    (run_dir / "logs").mkdir(mode=0o700, parents=True, exist_ok=True)
    job = _Job(cfg, run_dir, store, port, worker_module or WORKER_MODULES[cfg.engine], command=command,
               run_id=f"ncl-{os.getpid()}-{int(time.time())}")
    store.set(GENERATION_KEY, "0")
    job_id = new_job_id()  # names the job's batch cache (data.loader=mmap); removed below when the job ends
    store.set(JOB_ID_KEY, job_id)
    world = cfg.trainer.world_size
    was_subreaper = is_child_subreaper()
    try:
        if script_runner.forkable([sys.executable, *job.python_argv()]) and become_child_subreaper():
            # Every rank (and a user's script's spares) forked from one template (restart.script_runner).
            log = os.fdopen(os.open(run_dir / "logs" / "rank_template.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                    0o600), "wb")
            env = {**job.process_env(job.spare_env()), **script_runner.template_env(cfg.launcher.preload, cfg.engine)}
            job.forker = SpareFactory(script_runner.__name__, env, log, terminal=True)
            log.close()
        for rank in range(world):
            job.start_rank(rank)
        # Our own workers have a spare template (restart.template); a worker module of one's own is not imported.
        if (cfg.replication.spares and command is None and job.worker_module in WORKER_MODULES.values()
                and become_child_subreaper()):
            log = os.fdopen(os.open(run_dir / "logs" / "spare_template.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                    0o600), "wb")
            job.factory = SpareFactory(job.worker_module, job.process_env(job.spare_env()), log)
            log.close()  # the template holds its own descriptor
        for _ in range(cfg.replication.spares):
            job.start_spare()
        while not job.tick():
            time.sleep(POLL_S)
    finally:
        for factory in (job.factory, job.forker):
            if factory is not None:
                factory.close()  # forks nothing more: every pid is known below
        stop_processes([*job.ranks.values(), *job.spares.values(), *job.exiting])
        if not was_subreaper:
            stop_being_child_subreaper()  # every process is reaped: adopt no one else's orphans
        remove_job_cache(cfg.data.cache_root, job_id)  # every rank has exited: nobody reads it any more
    return job.summary(round(time.perf_counter() - t0, 3))
