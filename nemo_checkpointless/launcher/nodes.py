"""Several nodes: one agent per node; the job's decisions made once, by one agent (the leader), through the store.

Every node runs the same `checkpointless-run --nnodes N --node-rank i --rdzv-endpoint HOST:PORT ...` (or
`checkpointless-train ... launcher.node_rank=i launcher.rdzv_endpoint=HOST:PORT`). Its agent (`NodeAgent`):

- connects to the job's store (`rdzv_backend=external`: a `checkpointless-store` that no training node runs;
  `c10d`: node 0's agent hosts it, as torchrun does, and losing node 0 then ends the job), claims its node rank,
  checks that every node was started for the same job (`ctl/spec`) and waits until every node joined;
- beats: a thread adds 1 to `nodes/<i>/beat` every lease / 10, so the others know the agent is alive;
- starts and kills the processes it is told to (`nodes/<i>/cmd/<n>`) and reports their pids and exit codes
  (`nodes/<i>/procs`), giving each process its node's address for its sockets;
- fences itself: a node declared lost (`nodes/<i>/lost`: its beat stopped for a lease, so its ranks were
  recovered elsewhere) kills its processes and stops, even if it was only slow.

The leader is node 0 at the start, then the live node of lowest rank. It runs the one-machine launcher's
decisions (`local._Job`: replace a failed rank by a spare, generations, the restart budget, the check-in round,
records, the summary) over `RemoteProc` handles instead of child processes, and saves what it decided
(`ctl/state`, JSON) after every poll that changed it, so that the next leader continues from there. A lost node's
ranks are failed ranks (fault kind `node`), taken by spares of other nodes; its spares are started again elsewhere.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nemo_checkpointless import protocol
from nemo_checkpointless.config import Config
from nemo_checkpointless.data.cache import new_job_id, remove_job_cache
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.launcher.local import (
    WORKER_MODULES,
    LaunchError,
    _Job,
    _Proc,
    host_store,
    process_environ,
    start_process,
    stop_processes,
)
from nemo_checkpointless.launcher.procs import exit_status, proc_state
from nemo_checkpointless.launcher.watchdog import Reader
from nemo_checkpointless.protocol import GENERATION_KEY, JOB_ID_KEY, SPARE_ID_ENV
from nemo_checkpointless.restart.progress import Beacon, parse_beacon, read_beacon_bytes
from nemo_checkpointless.restart.template import SPARE_REFILL_ENV
from nemo_checkpointless.restart.worker_env import WorkerEnv

POLL_S = 0.01
PROGRESS_S = 0.1  # how often an agent reports its ranks' progress beacons to the leader
STATE_KEY = "ctl/state"  # the leader's decisions so far (`ClusterJob.snapshot`)
SPEC_KEY = "ctl/spec"  # what the first agent was started with; every other must match it
JOINED_KEY = "ctl/joined"  # agents that joined (a counter)
LEADER_KEY = "ctl/leader"  # the node rank of the agent that decides
DONE_KEY = "ctl/done"  # set by the leader when the job ended: {"code": exit code, "message": why}
ABORT_KEY = "ctl/abort"  # set by a node started for another job: every node stops before any rank starts


def node_key(node: int, what: str) -> str:
    return f"nodes/{node}/{what}"


def config_digest(cfg: Config) -> str:
    """The job's settings, less what differs from node to node (its rank, its address)."""
    import dataclasses
    import hashlib

    launcher = dataclasses.replace(cfg.launcher, node_rank=0, local_addr="")
    text = json.dumps(dataclasses.asdict(dataclasses.replace(cfg, launcher=launcher)), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NodeSpec:
    """What this node's agent was started with: the job's shape and where its store is."""

    nnodes: int  # training nodes
    node_rank: int
    nproc: int  # ranks per training node
    spares: int  # spares kept on each training node
    spare_nodes: int  # nodes that only hold spares (`nproc` each); their ranks are nnodes, nnodes + 1, ...
    host: str  # the store's
    port: int
    backend: str  # c10d: node 0 hosts the store; external: it runs on its own
    local_addr: str  # this node's address for the ranks' sockets
    lease_s: float

    @property
    def total_nodes(self) -> int:
        return self.nnodes + self.spare_nodes

    def quota(self, node: int) -> int:
        """The spares `node` keeps."""
        return self.spares if node < self.nnodes else self.nproc


def parse_endpoint(value: str, key: str = "--rdzv-endpoint") -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, value, "must be HOST:PORT", f"e.g. {key} 10.0.0.1:29400 (the job's store)")
    return host.strip("[]"), int(port)


def route_addr(host: str, port: int) -> str:
    """This machine's address on its route to `host` (nothing is sent: a UDP socket's connect picks the route)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


def interface_of(addr: str) -> str | None:
    """The network interface holding IPv4 address `addr` (for `GLOO_SOCKET_IFNAME`), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                if socket.inet_ntoa(raw[20:24]) == addr:
                    return name
    return None


def wait_for_listener(host: str, port: int, timeout_s: float) -> bool:
    """Whether something listens at host:port within `timeout_s`, tried with plain connects (TCPStore's own retries
    print a C++ trace each). A connection to itself is not one: on loopback, a connect to a port of the
    ephemeral range where nobody listens yet can be given that very port as its source and succeed, and it
    would then hold the port the store is about to bind."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0) as s:
                if s.getsockname() != s.getpeername():
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ liveness
@dataclass
class Liveness:
    """Which agents are alive, from their beats: a beat that has not moved for the lease is a lost node (as is one
    the leader declared lost)."""

    store: dist.Store
    spec: NodeSpec
    lost: set[int] = field(default_factory=set)
    # node -> (beat value, monotonic time it last moved, wall time it last moved)
    seen: dict[int, tuple[int, float, float]] = field(default_factory=dict)

    def refresh(self) -> list[int]:
        """Read every live node's beat; returns the nodes found lost by this read. A node never finds itself lost
        (a beat delayed on a loaded machine would have it fence its own healthy ranks)."""
        now, wall = time.monotonic(), time.time()
        newly = []
        for n in range(self.spec.total_nodes):
            if n in self.lost or n == self.spec.node_rank:
                continue
            beat = int(self.store.add(node_key(n, "beat"), 0))
            last = self.seen.get(n)
            if last is None or beat != last[0]:
                self.seen[n] = (beat, now, wall)
            elif now - last[1] > self.spec.lease_s or self.store.check([node_key(n, "lost")]):
                self.lost.add(n)
                newly.append(n)
        return newly

    def alive(self) -> list[int]:
        return [n for n in range(self.spec.total_nodes) if n not in self.lost]

    def last_beat_t(self, node: int) -> float:
        return self.seen[node][2] if node in self.seen else time.time()


# ------------------------------------------------------------------------------------------------ the leader
class RemoteProc:
    """A process that some node's agent runs, as the leader sees it: `_Proc.popen` for `_Job`."""

    def __init__(self, job: ClusterJob, uid: str, node: int) -> None:
        self.job, self.uid, self.node = job, uid, node

    @property
    def pid(self) -> int:
        return self.job.pid_of(self.uid)

    def poll(self) -> int | None:
        return self.job.code_of(self.uid)

    def kill(self) -> None:
        if self.poll() is None:
            self.job.post(self.node, {"op": "kill", "uid": self.uid})

    def wait(self) -> int:
        while (code := self.poll()) is None:
            time.sleep(POLL_S)
            self.job.refresh()
        return code


@dataclass
class ClusterJob(_Job):
    """`_Job`'s decisions over the processes of every node (`RemoteProc`), made by the leader agent."""

    spec: NodeSpec | None = None
    live: Liveness | None = None
    reports: dict[int, dict[str, list[Any]]] = field(default_factory=dict)  # node -> uid -> [pid, code]
    # rank -> [beacon bytes (hex), state letter, CPU seconds, pid]: each node's agent reports its ranks' progress
    beacons: dict[int, list[Any]] = field(default_factory=dict)
    homes: dict[str, int] = field(default_factory=dict)  # uid -> node
    logs: dict[str, str] = field(default_factory=dict)  # uid -> log file name ("" : the agent's terminal)
    next_uid: int = 0
    t_start: float = 0.0  # wall time the job started (the summary's wall_s, whoever leads at the end)
    lost_t: float | None = None  # the last beat of a node just found lost: when its ranks' fault happened
    _node: int = 0  # where the next process starts (`start_rank`, `start_spare` -> `_start`)
    _saved: str = ""

    @property
    def nodes(self) -> NodeSpec:
        assert self.spec is not None
        return self.spec

    # -------------------------------------------------------------- the processes, as the agents report them
    def post(self, node: int, command: dict[str, Any]) -> None:
        seq = self.store.add(node_key(node, "ncmd"), 1)
        self.store.set(node_key(node, f"cmd/{seq}"), json.dumps(command))

    def refresh(self) -> None:
        """Read each live node's report; a node found lost takes its processes with it."""
        assert self.live is not None
        for node in self.live.refresh():
            self.node_down(node)
        for node in self.live.alive():
            key = node_key(node, "procs")
            if self.store.check([key]):
                self.reports[node] = json.loads(self.store.get(key))
            key = node_key(node, "progress")
            if self.store.check([key]):
                self.beacons.update({int(r): v for r, v in json.loads(self.store.get(key)).items()})

    def node_down(self, node: int) -> None:
        assert self.live is not None
        self.store.set(node_key(node, "lost"), "no heartbeat")  # fences the agent if it is only slow
        self.live.lost.add(node)
        self.lost_t = min(self.lost_t or float("inf"), self.live.last_beat_t(node))
        lost_ranks = sorted(r for r, p in self.ranks.items() if self._home(p) == node)
        lost_spares = [k for k, p in self.spares.items() if self._home(p) == node]
        print(f"checkpointless: node {node} is lost (no heartbeat for {self.nodes.lease_s:g} s): ranks {lost_ranks} "
              f"fail with it{f', and spares {lost_spares}' if lost_spares else ''}", file=sys.stderr, flush=True)
        self.node_lost.update(lost_ranks)
        for k in lost_spares:
            del self.spares[k]
            self.refill += 1  # started again on a live node once the recovery is done
        if not self.live.alive():
            raise LaunchError("every node is lost")

    def _home(self, proc: _Proc) -> int:
        assert isinstance(proc.popen, RemoteProc)
        return proc.popen.node

    def code_of(self, uid: str) -> int | None:
        node = self.homes[uid]
        entry = self.reports.get(node, {}).get(uid)
        code = entry[1] if entry is not None else None
        if code is None and self.live is not None and node in self.live.lost:
            return -9  # died with its node
        return code

    def pid_of(self, uid: str) -> int:
        deadline = time.monotonic() + 30
        while True:
            entry = self.reports.get(self.homes[uid], {}).get(uid)
            if entry is not None:
                return int(entry[0])
            if (self.live is not None and self.homes[uid] in self.live.lost) or time.monotonic() > deadline:
                return -1
            time.sleep(POLL_S)
            self.refresh()

    # -------------------------------------------------------------- `_Job`, on several nodes
    def _env(self, rank: int) -> dict[str, str]:
        spec = self.nodes
        env = WorkerEnv(rank, self.cfg.trainer.world_size, rank % spec.nproc, spec.host, spec.port,
                        str(self.run_dir)).to_environ()
        env["LOCAL_WORLD_SIZE"] = str(spec.nproc)  # a spare's LOCAL_RANK, once it has a rank, comes from it
        env.update(self.settings_env())
        if self.command is not None:
            env.update(self.torchrun_env(rank))
        return env

    def torchrun_env(self, rank: int) -> dict[str, str]:
        spec = self.nodes
        env = super().torchrun_env(rank)
        env.update(LOCAL_WORLD_SIZE=str(spec.nproc), GROUP_RANK=str(rank // spec.nproc),
                   GROUP_WORLD_SIZE=str(spec.nnodes), MASTER_ADDR=spec.host, MASTER_PORT=str(spec.port))
        return env

    def _start(self, extra_env: dict[str, str], log_name: str | None, nice: int = 0) -> _Proc:
        """On a node's agent; at normal priority (`nice` is for a spare of this machine, whose priority the
        launcher restores itself)."""
        uid = f"p{self.next_uid}"
        self.next_uid += 1
        argv = [sys.executable, "-m", self.worker_module] if self.command is None else self.command
        self.homes[uid], self.logs[uid] = self._node, log_name or ""
        self.post(self._node, {"op": "start", "uid": uid, "argv": argv, "env": extra_env, "log": log_name})
        return _Proc(RemoteProc(self, uid, self._node), self.run_dir / "logs" / log_name if log_name else None, None)

    def start_rank(self, rank: int, join_generation: int = 0, restart: bool = False) -> None:
        assert self.live is not None
        home = rank // self.nodes.nproc
        if home not in self.live.alive():  # a cold start: the live training node running the fewest ranks
            load = {n: sum(self._home(p) == n for p in self.ranks.values()) for n in self.live.alive()}
            home = min(load, key=lambda n: (load[n], n))
        self._node = home
        super().start_rank(rank, join_generation, restart)

    def start_spare(self, refill: bool = False) -> None:
        """A spare on the live node furthest below its quota (`NodeSpec.quota`)."""
        assert self.live is not None
        held = {n: sum(self._home(p) == n for p in self.spares.values()) for n in self.live.alive()}
        node = min(held, key=lambda n: (held[n] - self.nodes.quota(n), n))
        spare_id = self.next_spare
        self.next_spare += 1
        self._node = node
        env = {**self.spare_env(), SPARE_ID_ENV: str(spare_id), SPARE_REFILL_ENV: "1" if refill else "0"}
        self.spares[spare_id] = self._start(env, f"spare_{spare_id}.log")

    def replace(self, failed: list[int], codes: dict[int, int | None]) -> None:
        if self.command is not None and (self.cfg.launcher.on_failure == "restart_all"
                                         or not self.recovers_in_process()):
            raise LaunchError(f"rank(s) {failed} failed; a whole-job restart of a script is not done across nodes "
                              "(its MASTER_PORT store would live on one node): use CheckpointlessStrategy in the "
                              "script, or restart the job")
        super().replace(failed, codes)

    def progress_readers(self) -> tuple[Reader, Callable[[int], Beacon | None]]:
        """The beacons and /proc states each node's agent reports (`NodeAgent.report_progress`), for the watchdog
        and the straggler report that run here, on the leader."""

        def entry(rank: int) -> tuple[Beacon | None, tuple[str, float] | None, int]:
            raw = self.beacons.get(rank)
            if raw is None:
                return None, None, -1
            beacon = parse_beacon(bytes.fromhex(raw[0])) if raw[0] else None
            state = (str(raw[1]), float(raw[2])) if raw[1] else None
            return beacon, state, int(raw[3])

        def hang_read(rank: int, pid: int) -> tuple[Beacon | None, tuple[str, float] | None]:
            beacon, state, of = entry(rank)
            return beacon, state if of == pid else None

        return hang_read, lambda rank: entry(rank)[0]

    def tick(self) -> bool:
        self.refresh()
        done = super().tick()
        self.save()
        return done

    # -------------------------------------------------------------- what the next leader continues from
    def snapshot(self) -> dict[str, Any]:
        def proc(p: _Proc) -> str:
            assert isinstance(p.popen, RemoteProc)
            return p.popen.uid

        assert self.live is not None
        return {"generation": self.generation, "next_spare": self.next_spare, "next_uid": self.next_uid,
                "refill": self.refill, "unrecovered": self.unrecovered,
                "seen_injections": sorted(self.seen_injections), "hung": sorted(self.hung),
                "hang_handled": sorted(self.hang_handled), "node_lost": sorted(self.node_lost),
                "hang_reasons": {str(r): w for r, w in self.hang_reasons.items()}, "in_process": self.in_process,
                "finished_late": sorted(self.finished_late), "faults": self.faults, "t_start": self.t_start,
                "ranks": {str(r): proc(p) for r, p in self.ranks.items()},
                "spares": {str(k): proc(p) for k, p in self.spares.items()},
                "pids": {str(r): [proc(p) for p in ps] for r, ps in self.pids.items()},
                "homes": self.homes, "logs": self.logs,
                "lost": sorted(self.live.lost), "reports": {str(n): r for n, r in self.reports.items()}}

    def save(self) -> None:
        text = json.dumps(self.snapshot(), sort_keys=True)
        if text != self._saved:
            self.store.set(STATE_KEY, text)
            self._saved = text

    def restore(self, state: dict[str, Any]) -> None:
        self.homes, self.logs = dict(state["homes"]), dict(state["logs"])
        self.reports = {int(n): r for n, r in state["reports"].items()}

        def proc(uid: str) -> _Proc:
            log = self.logs.get(uid)
            return _Proc(RemoteProc(self, uid, self.homes[uid]), self.run_dir / "logs" / log if log else None, None)

        for key in ("generation", "next_spare", "next_uid", "refill", "unrecovered", "in_process", "t_start"):
            setattr(self, key, state[key])
        self.faults = list(state["faults"])
        self.seen_injections, self.hung = set(state["seen_injections"]), set(state["hung"])
        self.hang_handled, self.node_lost = set(state["hang_handled"]), set(state["node_lost"])
        self.finished_late = set(state["finished_late"])
        self.hang_reasons = {int(r): (str(w[0]), float(w[1])) for r, w in state["hang_reasons"].items()}
        self.ranks = {int(r): proc(u) for r, u in state["ranks"].items()}
        self.spares = {int(k): proc(u) for k, u in state["spares"].items()}
        self.pids = {int(r): [proc(u) for u in us] for r, us in state["pids"].items()}
        # A spare the previous leader assigned just before it was lost (its assignment is in the store, not in
        # the state): not a spare any more, so never handed out twice.
        for k in [k for k in self.spares if self.store.check([protocol.spare_assign_key(k)])]:
            self.spares.pop(k).popen.kill()
            self.refill += 1
        self._saved = json.dumps(self.snapshot(), sort_keys=True)

    def fault_seen_t(self) -> float:
        """A lost node's fault happened at its last beat, not when its lease ran out."""
        t, self.lost_t = min(time.time(), self.lost_t or float("inf")), None
        return t

    def summary_and_done(self) -> dict[str, Any]:
        summary = self.summary(round(time.time() - self.t_start, 3))
        self.store.set(DONE_KEY, json.dumps({"code": 0, "message": "done"}))
        return summary


# ------------------------------------------------------------------------------------------------ every node
class NodeAgent:
    """One node's agent: its processes, its beat, and the leader's role when it is its turn."""

    def __init__(self, cfg: Config, spec: NodeSpec, run_dir: Path, worker_module: str,
                 command: list[str] | None) -> None:
        self.cfg, self.spec, self.run_dir = cfg, spec, run_dir
        self.worker_module, self.command = worker_module, command
        self.procs: dict[str, _Proc] = {}
        self.codes: dict[str, list[Any]] = {}  # uid -> [pid, code]
        self.done_cmds = 0
        self.reported = ""
        self.next_progress = 0.0
        self.job: ClusterJob | None = None
        self.hosted: dist.TCPStore | None = None
        self.stop = threading.Event()
        self.beat_error: BaseException | None = None
        self.ifname = os.environ.get("GLOO_SOCKET_IFNAME") or interface_of(spec.local_addr)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.store = self._connect()
        self.live = Liveness(self.store, spec)

    # -------------------------------------------------------------- joining
    def _connect(self) -> dist.TCPStore:
        spec, timeout = self.spec, self.cfg.launcher.start_timeout_s
        where = f"{spec.host}:{spec.port}"
        if spec.backend == "c10d" and spec.node_rank == 0:
            self.hosted, _ = host_store(spec.host, timeout, spec.port, key="--rdzv-endpoint")
        who = ("node 0's agent hosts it (--rdzv-backend c10d): start node 0 first" if spec.backend == "c10d"
               else "start checkpointless-store there first")
        error = ConfigError("--rdzv-endpoint", where, f"no store answered there within {timeout:g} s",
                            f"check the address and port; {who}")
        if not wait_for_listener(spec.host, spec.port, timeout):
            raise error
        try:
            store = dist.TCPStore(spec.host, spec.port, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout))
        except (RuntimeError, OSError):
            raise error from None
        store.set_timeout(datetime.timedelta(seconds=max(30.0, 4 * spec.lease_s)))
        return store

    def job_spec(self) -> dict[str, Any]:
        cfg, spec = self.cfg, self.spec
        return {"--nnodes": spec.nnodes, "--nproc-per-node": spec.nproc, "--spares": spec.spares,
                "spare_nodes": spec.spare_nodes, "recipe": cfg.recipe_name,
                "--num-instances": cfg.replication.num_instances, "seed": cfg.seed,
                "command": [Path(a).name for a in (self.command or ["", self.worker_module])][1:],
                "--rdzv-backend": spec.backend, "the recipe's settings": config_digest(cfg)}

    def join(self) -> None:
        spec, store = self.spec, self.store
        if spec.node_rank >= spec.total_nodes:
            raise ConfigError("--node-rank", spec.node_rank, f"must be below the job's {spec.total_nodes} nodes "
                              f"({spec.nnodes} training + {spec.spare_nodes} spare)", "give each node 0, 1, ...")
        mine = json.dumps(self.job_spec(), sort_keys=True)
        first = store.compare_set(SPEC_KEY, "", mine).decode()
        if first != mine:
            theirs = json.loads(first)
            key = next(k for k, v in self.job_spec().items() if theirs.get(k) != v)
            error = ConfigError(key, self.job_spec()[key], f"on node {spec.node_rank} differs from the job's other "
                                f"nodes ({key}={theirs.get(key)})",
                                "start every node with the same job: the same flags (or recipe) and script")
            store.set(ABORT_KEY, str(error))
            raise error
        claim = store.compare_set(node_key(spec.node_rank, "claim"), "", self.token).decode()
        if claim != self.token:
            raise ConfigError("--node-rank", spec.node_rank, f"is already claimed by another agent ({claim})",
                              "give every node its own --node-rank, 0 to --nnodes - 1")
        store.set(node_key(spec.node_rank, "info"), json.dumps({"addr": spec.local_addr, "pid": os.getpid(),
                                                                  "host": socket.gethostname()}))
        threading.Thread(target=self._beat, daemon=True, name="ncl-beat").start()
        store.add(JOINED_KEY, 1)
        deadline = time.monotonic() + self.cfg.launcher.start_timeout_s
        while int(store.add(JOINED_KEY, 0)) < spec.total_nodes:
            if store.check([ABORT_KEY]):
                raise LaunchError(f"another node stopped the job before it started: {store.get(ABORT_KEY).decode()}",
                                  exit_code=2)
            if time.monotonic() > deadline:
                missing = [n for n in range(spec.total_nodes) if not store.check([node_key(n, "claim")])]
                raise LaunchError(f"node(s) {missing} did not join within launcher.start_timeout_s="
                                  f"{self.cfg.launcher.start_timeout_s:g} s (every node's agent must start)",
                                  exit_code=2)
            time.sleep(0.02)

    def _beat(self) -> None:
        store = dist.TCPStore(self.spec.host, self.spec.port, is_master=False,
                              timeout=datetime.timedelta(seconds=max(10.0, 4 * self.spec.lease_s)))
        key = node_key(self.spec.node_rank, "beat")
        try:
            while not self.stop.is_set():
                store.add(key, 1)
                self.stop.wait(self.spec.lease_s / 10)
        except (RuntimeError, OSError) as e:
            self.beat_error = e

    # -------------------------------------------------------------- the leader's start
    def start_job(self) -> None:
        """Node 0, once every node joined: the job's keys, its ranks and spares, and the leader's role."""
        cfg, spec = self.cfg, self.spec
        self.store.set(GENERATION_KEY, "0")
        self.store.set(JOB_ID_KEY, new_job_id())
        job = self._new_job()
        job.t_start = time.time()
        self.warn_placement()
        for rank in range(cfg.trainer.world_size):
            job.start_rank(rank)
        for node in range(spec.total_nodes):
            for _ in range(spec.quota(node)):
                job.start_spare()
        job.save()
        self.store.set(LEADER_KEY, str(spec.node_rank))
        self.job = job

    def _new_job(self) -> ClusterJob:
        return ClusterJob(self.cfg, self.run_dir, self.store, self.spec.port, self.worker_module,
                          command=self.command, run_id=f"ncl-{self.spec.host}-{self.spec.port}",
                          spec=self.spec, live=self.live)

    def warn_placement(self) -> None:
        warning = placement_warning(self.cfg)
        if warning:
            print(f"checkpointless: warning: {warning}", file=sys.stderr, flush=True)

    def take_over(self, old: int) -> None:
        """The leader's node is lost and this is the live node of lowest rank: continue from its saved state."""
        if self.store.compare_set(LEADER_KEY, str(old), str(self.spec.node_rank)).decode() != str(self.spec.node_rank):
            return
        print(f"checkpointless: node {self.spec.node_rank} takes over from node {old}, which is lost",
              file=sys.stderr, flush=True)
        job = self._new_job()
        state = json.loads(self.store.get(STATE_KEY))
        job.restore(state)
        for node in sorted(self.live.lost - set(state["lost"])):  # lost since it last saved: the old leader too
            job.node_down(node)
        stored = int(self.store.get(GENERATION_KEY))
        if job.generation > stored:  # it saved the next generation but did not live to publish it
            self.store.set(GENERATION_KEY, str(job.generation))
        self.job = job

    # -------------------------------------------------------------- this node's processes
    def serve(self) -> None:
        """Run the commands for this node, report its processes."""
        me = self.spec.node_rank
        n = int(self.store.add(node_key(me, "ncmd"), 0))
        for seq in range(self.done_cmds + 1, n + 1):
            self.execute(json.loads(self.store.get(node_key(me, f"cmd/{seq}"))))
        self.done_cmds = n
        for uid, proc in self.procs.items():
            if self.codes[uid][1] is None and (code := exit_status(proc.popen)) is not None:
                self.codes[uid][1] = code
                if proc.out is not None:
                    proc.out.close()
        text = json.dumps(self.codes)
        if text != self.reported:
            self.store.set(node_key(me, "procs"), text)
            self.reported = text
        self.report_progress()

    def report_progress(self) -> None:
        """Every PROGRESS_S: this node's ranks' progress beacons and /proc states, for the leader's watchdog and
        straggler report (`ClusterJob.progress_readers`). Only what changed is worth a write; one JSON value."""
        now = time.monotonic()
        if now < self.next_progress:
            return
        self.next_progress = now + PROGRESS_S
        pids = {code[0] for code in self.codes.values() if code[1] is None}
        out: dict[str, list[Any]] = {}
        for path in (self.run_dir / "progress").glob("rank*.bin"):
            raw = read_beacon_bytes(path)
            beacon = parse_beacon(raw) if raw is not None else None
            if beacon is None or beacon.pid not in pids:
                continue
            state = proc_state(beacon.pid)
            out[path.stem[4:]] = [raw.hex() if raw else "", state[0] if state else "", state[1] if state else 0.0,
                                  beacon.pid]
        if out:
            self.store.set(node_key(self.spec.node_rank, "progress"), json.dumps(out))

    def execute(self, command: dict[str, Any]) -> None:
        uid = command["uid"]
        if command["op"] == "kill":
            if uid in self.procs and self.procs[uid].popen.poll() is None:
                self.procs[uid].popen.kill()
            return
        node = {protocol.LOCAL_ADDR_ENV: self.spec.local_addr, "GROUP_RANK": str(self.spec.node_rank)}
        if self.ifname:
            node["GLOO_SOCKET_IFNAME"] = self.ifname
        env = process_environ(self.cfg.launcher.threads_per_rank, {**command["env"], **node})
        log = self.run_dir / "logs" / command["log"] if command["log"] else None
        popen, out = start_process(command["argv"], env, log)
        self.procs[uid] = _Proc(popen, log, out)
        self.codes[uid] = [popen.pid, None]

    # -------------------------------------------------------------- the loop
    def seen_the_end(self) -> None:
        """The job has ended (`DONE_KEY`): this agent stops beating and says it has seen the end. With
        `--rdzv-backend c10d` the store lives in node 0's agent and goes when it exits: node 0 waits until every
        node not lost has said so (at most max(10 s, 4 leases)), so that no agent is still reading the store when
        it goes and ends a finished job with "lost the job's store"."""
        self.stop.set()
        me, total = self.spec.node_rank, self.spec.total_nodes
        self.store.set(node_key(me, "ended"), "1")
        if self.spec.backend != "c10d" or me != 0:
            return
        deadline = time.monotonic() + max(10.0, 4 * self.spec.lease_s)
        waiting = [n for n in range(total) if n != me]
        while waiting and time.monotonic() < deadline:
            waiting = [n for n in waiting if not self.store.check([node_key(n, "ended")])
                       and not self.store.check([node_key(n, "lost")])]
            time.sleep(POLL_S)

    def leader(self) -> int:
        return int(self.store.get(LEADER_KEY)) if self.store.check([LEADER_KEY]) else 0

    def run(self) -> dict[str, Any]:
        """Join, then serve this node (and lead, when it is this node's turn) until the job ends."""
        me = self.spec.node_rank
        (self.run_dir / "logs").mkdir(mode=0o700, parents=True, exist_ok=True)
        summary: dict[str, Any] = {}
        try:
            self.join()
            if me == 0:
                self.start_job()
            while True:
                if self.beat_error is not None:
                    raise self.beat_error
                self.serve()
                if self.store.check([DONE_KEY]):
                    done = json.loads(self.store.get(DONE_KEY))
                    self.seen_the_end()
                    if done["code"]:
                        raise LaunchError(done["message"], exit_code=done["code"])
                    break
                if self.store.check([node_key(me, "lost")]):
                    raise LaunchError(f"node {me} was declared lost by the leader (no heartbeat for "
                                      f"{self.spec.lease_s:g} s): its ranks were recovered on other nodes; "
                                      "stopping this node's processes")
                if self.job is None:
                    self.live.refresh()
                    old = self.leader()
                    if old in self.live.lost and self.live.alive() and min(self.live.alive()) == me:
                        self.take_over(old)
                elif self.leader() != me:
                    self.job = None  # another node took over: this one was too slow, and is fenced next
                else:
                    try:
                        if self.job.tick():
                            summary = self.job.summary_and_done()
                            continue
                    except LaunchError as e:
                        self.store.set(DONE_KEY, json.dumps({"code": e.exit_code, "message": str(e)}))
                        raise
                time.sleep(POLL_S)
        except (RuntimeError, OSError) as e:
            if isinstance(e, LaunchError):
                raise
            why = ("node 0 hosted it (--rdzv-backend c10d), so the job ends with node 0" if self.spec.backend == "c10d"
                   else "the job cannot go on without it")
            raise LaunchError(f"lost the job's store at {self.spec.host}:{self.spec.port} "
                              f"({str(e).splitlines()[0][:200]}); {why}; restart the job (from its checkpoint)"
                              ) from None
        finally:
            self.stop.set()
            stop_processes(list(self.procs.values()))
            with contextlib.suppress(RuntimeError, OSError):
                if self.store.check([JOB_ID_KEY]):
                    remove_job_cache(self.cfg.data.cache_root, self.store.get(JOB_ID_KEY).decode())
        return summary


def placement_warning(cfg: Config) -> str | None:
    """What a whole-node loss would cost when some optimizer shard has every replica on one node (None: each
    shard's copies sit on at least two nodes, so a node loss leaves one)."""
    from nemo_checkpointless.topology.layout import replica_groups

    per_node = cfg.trainer.devices
    one_node = [g for g in replica_groups(cfg.dims()) if len({r // per_node for r in g}) == 1]
    if not one_node or cfg.trainer.num_nodes == 1:
        return None
    return (f"the replicas of {len(one_node)} optimizer shard(s) (e.g. ranks {list(one_node[0])}) all sit on node "
            f"{one_node[0][0] // per_node}: losing that node falls back to the checkpoint (replication."
            f"num_instances={cfg.replication.num_instances}; spread the data-parallel group over the nodes, e.g. a "
            "smaller parallel.pp or a larger replication.num_instances)")


def node_spec(cfg: Config) -> NodeSpec:
    lc = cfg.launcher
    if not lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", "''", f"is needed for trainer.num_nodes={cfg.trainer.num_nodes}",
                          "give every node the store's HOST:PORT (--rdzv-endpoint) and its own node rank")
    host, port = parse_endpoint(lc.rdzv_endpoint)
    local = lc.local_addr or (host if lc.rdzv_backend == "c10d" and lc.node_rank == 0 else route_addr(host, port))
    return NodeSpec(nnodes=cfg.trainer.num_nodes, node_rank=lc.node_rank, nproc=cfg.trainer.devices,
                    spares=cfg.replication.spares, spare_nodes=cfg.replication.spare_nodes, host=host, port=port,
                    backend=lc.rdzv_backend, local_addr=local, lease_s=lc.node_lease_s)


def run_node(cfg: Config, run_dir: Path, worker_module: str | None = None,
             command: list[str] | None = None) -> dict[str, Any]:
    """This node's agent of a job of several nodes: returns the summary where this node led at the end (else
    {})."""
    agent = NodeAgent(cfg, node_spec(cfg), run_dir, worker_module or WORKER_MODULES[cfg.engine], command)
    return agent.run()
