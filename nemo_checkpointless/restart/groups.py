"""Process groups built from the launcher's store, and collectives that notice a failure anywhere in the job.

Why not `torch.distributed.init_process_group`: the default group is global state that cannot be replaced while a
collective is stuck in it, and its store lives on rank 0. Here every group is a `ProcessGroupGloo` object built
from a `PrefixStore` over the store that the launcher hosts (never a training rank), under a prefix that names the
generation; after a failure the survivors simply build the next generation's groups.

Failure news: on gloo only the dead rank's ring neighbours see a crash, and `abort()` does not unblock a stuck
collective. So every wait here polls the launcher's store for the job's fault key between short waits (5 ms) on the
collective's future; whichever comes first ends the wait. A send's or recv's work has no future: a helper thread
waits on it, and the caller polls the same way.

Releasing an abandoned generation (`release_groups`): a gloo group that is merely forgotten keeps its sockets and
its transport thread, and that thread can spin on a core for the rest of the run. When a collective fails on one
rank, gloo frees that rank's receive buffer; a peer that had already been told the buffer was ready still sends
into it, and the bytes arrive on a connection whose buffer is gone. gloo's loop then leaves them unread and polls
the (level-triggered) readable socket forever without a single `recv` (measured: 2.6 s of CPU per 3 s on the dead
rank's neighbour, a 26 % slower job). `ProcessGroupGloo.abort()` and `shutdown()` close nothing on torch 2.13.
What does close the sockets is destroying the group: its worker threads are joined, then its gloo context, pairs,
sockets and transport thread go. The destructor waits for a collective still stuck in it (up to the collective
timeout) and releases the GIL while it waits, so a daemon thread (`_Reaper`) destroys abandoned groups while the
rank trains on. Closing one rank's sockets also fails the peers' stuck collectives at once, so in practice every
rank's old groups go within milliseconds of the recovery.

Two planes (CUDA). A group's collectives on CUDA tensors (the gradient all-reduce, the parameter all-gather, a
user's `sync_dist` on a CUDA metric) go over a `ProcessGroupNCCL` of the same members, built under the same
generation's prefix at the first such collective; everything on CPU tensors (the recovery's agreement, the state
transfer, the integrity digests) stays on gloo. An NCCL collective is enqueued on the GPU and this thread polls its
`is_completed()` (which also turns true on an NCCL error) between short sleeps, with the fault key and the timeout
as for gloo; when they end the wait first, the communicator is aborted (`abort()`, which ends kernels stuck on a
dead peer) and the group is released like a gloo one. NCCL's own watchdog is set to clean up without ending the
process (`TORCH_NCCL_ASYNC_ERROR_HANDLING=2`, unless the user set it), so a peer's death is a `PeerFailure` here,
not an exit. `DEVICE_PLANE_ENV=gloo` routes every all-reduce, all-gather and broadcast over a second gloo group
waited the same way: the two-plane logic runs on a CPU machine (the tests), with gloo standing in for NCCL.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nemo_checkpointless.protocol import (
    DEVICE_PLANE_ENV,
    FAULT_KEY,
    alive_key,
    fault_ranks_key,
    group_prefix,
    hang_key,
)

__all__ = ["FAULT_KEY", "CollectiveTimeout", "Group", "Membership", "PeerFailure", "alive_key", "hang_key"]

POLL_S = 0.005
# How long a collective in flight may still complete once the launcher has declared a fault. The launcher declares it
# as soon as the dead rank's exit begins (`launcher.procs.exit_status`), before its sockets close, so a collective
# among live ranks may be a few milliseconds (on a loaded machine, tens) from completing: without this, a rank in
# its instance's parameter all-gather with a live partner left it a step behind, and a recovery that could roll
# forward went to the checkpoint. A collective that waits on the dead rank fails after this (or at once, by the
# closed socket, on its ring neighbours).
FAULT_GRACE_S = 0.2
# The same for a collective of a group that has a rank the launcher named failed among its members
# (`protocol.fault_ranks_key`): only what the dead rank sent before it died can still arrive, which takes
# milliseconds (on a loaded machine, tens). Without it, a survivor waiting in the step's all-reduce that is not the
# dead rank's ring neighbour (it sees no closed socket) waited the whole FAULT_GRACE_S.
DEAD_MEMBER_GRACE_S = 0.05

# This process's device-plane use: collectives completed there, and waits that ended in a failure (the tests read
# it; `device_plane_stats`).
_DEVICE_STATS = {"collectives": 0, "failed": 0}


def device_plane_stats() -> dict[str, int]:
    return dict(_DEVICE_STATS)


class PeerFailure(RuntimeError):
    """A collective could not complete because some rank of the job failed (or the launcher said so)."""


class CollectiveTimeout(PeerFailure):
    """A collective made no progress within the timeout and nobody reported a death: some rank hangs."""


class DeclaredFault:
    """The launcher's fault declaration as one wait sees it: `seen` when the wait first read it, due `FAULT_GRACE_S`
    later (the Lightning path's group waits; the NeMo path's `FaultWatch`), or `DEAD_MEMBER_GRACE_S` later for the
    wait of a collective over `members` (global ranks) of which the launcher named one failed."""

    def __init__(self, store: Any, generation: int, members: Sequence[int] | None = None) -> None:
        self.store, self.generation, self.members = store, generation, members
        self.seen: float | None = None
        self.grace_s = FAULT_GRACE_S

    def due(self, now: float) -> bool:
        if self.seen is None:
            declared = fault_generation(self.store)
            if declared >= self.generation:
                self.seen = now
                if self.members is not None and set(self.members) & set(failed_ranks(self.store, declared)):
                    self.grace_s = DEAD_MEMBER_GRACE_S
        return self.seen is not None and now - self.seen >= self.grace_s


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the launcher's store (every worker and spare is a client; the launcher is the server)."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def failed_ranks(store: dist.Store, generation: int) -> list[int]:
    """The ranks the launcher named failed when it declared `generation` failed (empty if it named none)."""
    key = fault_ranks_key(generation)
    if not store.check([key]):
        return []
    return [int(r) for r in json.loads(store.get(key))]


def fault_generation(store: dist.Store) -> int:
    """The generation the launcher has declared failed most recently (-1: none)."""
    if not store.check([FAULT_KEY]):
        return -1
    return int(store.get(FAULT_KEY))


@dataclass
class Group:
    """One gloo group over `ranks` (global ranks, in group-rank order) of generation `generation`.

    Every method is a collective over `ranks`: all members call it, in the same order, with same-shaped tensors.
    A method raises `PeerFailure` when the collective fails or when the launcher reports a fault of this
    generation or later; it never blocks past `timeout_s`.
    """

    store: dist.Store
    generation: int
    name: str
    ranks: tuple[int, ...]
    rank: int
    host: str
    timeout_s: float
    # How long the members may take to arrive (None: `timeout_s`); longer where a member may still be starting,
    # e.g. a cold replacement importing a user's script while the survivors wait in the recovery.
    arrive_timeout_s: float | None = None
    pg: Any = field(init=False)  # ProcessGroupGloo; its collective methods are untyped in torch's stubs
    # Collectives that did not complete (a failure or the fault key ended the wait): each holds the group's gloo
    # context (its sockets) until it is dropped, so the group owns them and `release` drops them with the group.
    unfinished: list[dist.Work] = field(init=False, default_factory=list)
    # The device plane (see the module docstring): built at the first collective routed to it.
    device_pg: Any = field(init=False, default=None)
    device_plane: str = field(init=False, default="")  # "" (CUDA tensors: NCCL) or "gloo" (every collective)
    prefix: str = field(init=False, default="")  # this group's keys in the store

    def __post_init__(self) -> None:
        self.prefix = group_prefix(self.generation, self.name, self.ranks)
        self.device_plane = os.environ.get(DEVICE_PLANE_ENV, "")
        if self.device_plane not in ("", "nccl", "gloo"):
            raise ValueError(f"{DEVICE_PLANE_ENV}={self.device_plane}: must be nccl or gloo")
        self._arrive(self.prefix)
        try:
            self.pg = self._gloo(self.prefix)
        except RuntimeError as e:  # a member died before connecting
            raise PeerFailure(f"forming group {self.name} of generation {self.generation}: {e}") from e

    def _gloo(self, prefix: str) -> Any:
        opts: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        opts._timeout = datetime.timedelta(seconds=self.timeout_s)
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, self.store), self.group_rank, len(self.ranks), opts)

    def _on_device_plane(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda or self.device_plane == "gloo"

    def _device(self) -> Any:
        """The device plane's process group, built at its first collective (every member gets there in the same
        collective, so each builds it at the same point)."""
        if self.pg is None:
            raise PeerFailure(f"group {self.name} of generation {self.generation} was released (a newer generation "
                              "replaced it)")
        if self.device_pg is None:
            prefix = f"{self.prefix}/device"
            self._arrive(prefix)
            try:
                if self.device_plane == "gloo":
                    self.device_pg = self._gloo(prefix)
                else:
                    # NCCL's watchdog cleans up an errored communicator without ending the process: the failure
                    # is this module's to report (`PeerFailure`), and the survivors recover.
                    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
                    opts: Any = dist.ProcessGroupNCCL.Options()
                    opts._timeout = datetime.timedelta(seconds=self.timeout_s + 1.0)  # ours ends the wait first
                    self.device_pg = dist.ProcessGroupNCCL(
                        dist.PrefixStore(prefix, self.store), self.group_rank, len(self.ranks), opts)
            except RuntimeError as e:
                raise PeerFailure(f"forming the device plane of group {self.name} (generation "
                                  f"{self.generation}): {e}") from e
        return self.device_pg

    def _wait_device(self, work: dist.Work, what: str) -> None:
        """Wait for a device-plane collective: poll `is_completed()` (true when done or failed), the fault key and
        the timeout; a wait that ends otherwise aborts the communicator, which ends the GPU's stuck kernels."""
        self.unfinished.append(work)
        error = self._poll_work(work, what)
        del work
        if error is not None:
            _DEVICE_STATS["failed"] += 1
            self._abort_device()
            raise error
        self.unfinished.pop()
        _DEVICE_STATS["collectives"] += 1

    def _poll_work(self, work: dist.Work, what: str) -> PeerFailure | None:
        now = time.monotonic()
        deadline, next_check = now + self.timeout_s, now + POLL_S
        # Short sleeps, doubling up to 1 ms: a completed collective is seen within a millisecond (the step waits on
        # it); the store is asked for the fault key every POLL_S only.
        # After the fault is declared, the collective still has FAULT_GRACE_S to complete (DEAD_MEMBER_GRACE_S if a
        # member is the failed rank): one among live ranks does, and a rank that completes its step's last
        # collective is not counted a step behind.
        pause = 5e-5
        fault = DeclaredFault(self.store, self.generation, self.ranks)
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_check:
                next_check = now + POLL_S
                if fault.due(now):
                    return PeerFailure(f"{what}: the launcher reported a failed rank (generation "
                                       f"{self.generation})")
                if now > deadline:
                    return CollectiveTimeout(f"{what}: no progress in {self.timeout_s:.0f} s "
                                             "(launcher.collective_timeout_s)")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        try:
            work.wait()  # raises the collective's error, if it failed
        except RuntimeError as e:
            return PeerFailure(f"{what}: {e}")
        return None

    def _abort_device(self) -> None:
        abort = getattr(self.device_pg, "abort", None)
        if abort is not None and self.device_plane != "gloo":  # gloo's abort closes nothing (module docstring)
            with contextlib.suppress(RuntimeError):  # already aborted by NCCL's watchdog
                abort()

    def _arrive(self, prefix: str) -> None:
        """Wait until every member is here, watching the fault key: gloo's own connect would block for the whole
        timeout if a member died before joining (e.g. a second failure during a recovery)."""
        key = f"{prefix}/arrived"
        self.store.add(key, 1)
        patience = self.arrive_timeout_s or self.timeout_s
        deadline = time.monotonic() + patience
        while self.store.add(key, 0) < len(self.ranks):
            if fault_generation(self.store) >= self.generation:
                raise PeerFailure(f"forming group {self.name}: the launcher reported a failed rank "
                                  f"(generation {self.generation})")
            if time.monotonic() > deadline:
                raise PeerFailure(f"forming group {self.name}: not every member arrived within {patience:.0f} s")
            time.sleep(0.001)

    @property
    def group_rank(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _wait(self, work: dist.Work, what: str) -> None:
        # The work moves into `unfinished` until it completes: the traceback of a PeerFailure keeps this frame
        # alive, and a frame holding the work would keep the abandoned group's sockets open.
        self.unfinished.append(work)
        error = self._wait_for(work, what)
        del work
        if error is not None:
            raise error
        self.unfinished.pop()

    def _wait_for(self, work: dist.Work, what: str) -> PeerFailure | None:
        done = threading.Event()
        try:
            work.get_future().add_done_callback(lambda _: done.set())
        except RuntimeError:
            # gloo's send/recv work has neither a future nor a meaningful is_completed(), and a wait with a short
            # timeout would fail the whole gloo context: a helper thread waits on it, and this thread polls.
            return self._wait_p2p(work, what)
        error = self._poll(done, what)
        if error is not None:
            return error
        try:
            work.wait()
        except RuntimeError as e:
            return PeerFailure(f"{what}: {e}")
        return None

    def _poll(self, done: threading.Event, what: str) -> PeerFailure | None:
        """Wait for `done` in `POLL_S` slices, checking the fault key between slices, up to the timeout."""
        deadline = time.monotonic() + self.timeout_s
        fault = DeclaredFault(self.store, self.generation, self.ranks)
        while not done.wait(POLL_S):
            if fault.due(time.monotonic()):
                return PeerFailure(f"{what}: the launcher reported a failed rank (generation {self.generation})")
            if time.monotonic() > deadline:
                return CollectiveTimeout(f"{what}: no progress in {self.timeout_s:.0f} s "
                                         "(launcher.collective_timeout_s)")
        return None

    def _wait_p2p(self, work: dist.Work, what: str) -> PeerFailure | None:
        """Wait for a send or recv: `work.wait` (which releases the GIL) on a helper thread, the fault key and the
        timeout on this one. When the fault key or the timeout ends the wait first, the helper thread stays in
        `work.wait` until the peer's sockets close (it died, or released the group) or gloo's own timeout, a
        second later than ours, and then ends; the work itself stays in `unfinished`, for `release_groups`."""
        done = threading.Event()
        failed: list[RuntimeError] = []

        def wait() -> None:
            try:
                work.wait(datetime.timedelta(seconds=self.timeout_s + 1.0))
            except RuntimeError as e:
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=wait, name=f"ncl-p2p-wait-{self.name}", daemon=True).start()
        error = self._poll(done, what)
        if error is not None:
            return error
        return PeerFailure(f"{what}: {failed[0]}") if failed else None

    @property
    def _pg(self) -> Any:
        if self.pg is None:
            raise PeerFailure(f"group {self.name} of generation {self.generation} was released (a newer generation "
                              "replaced it)")
        return self.pg

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the group."""
        what = f"all_reduce in {self.name}"
        if self._on_device_plane(tensor):
            self._wait_device(self._device().allreduce([tensor]), what)
        else:
            self._wait(self._pg.allreduce([tensor]), what)

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
        """outputs[i] <- tensor of group rank i (all tensors the same shape)."""
        what = f"all_gather in {self.name}"
        if self._on_device_plane(tensor):
            self._wait_device(self._device().allgather([list(outputs)], [tensor]), what)
        else:
            self._wait(self._pg.allgather([list(outputs)], [tensor]), what)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """tensor <- tensor of global rank `src` (a member)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.ranks.index(src)
        what = f"broadcast in {self.name}"
        if self._on_device_plane(tensor):
            self._wait_device(self._device().broadcast([tensor], opts), what)
        else:
            self._wait(self._pg.broadcast([tensor], opts), what)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self._wait(self._pg.send([tensor], self.ranks.index(dst), tag), f"send to rank {dst} in {self.name}")

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self._wait(self._pg.recv([tensor], self.ranks.index(src), tag), f"recv from rank {src} in {self.name}")

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))


class _Reaper:
    """One daemon thread per process that destroys the gloo groups of abandoned generations (see the module
    docstring). What it is handed must have no other reference left: the last reference dies on this thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (once per process; `Membership` does, so that a recovery adds no thread)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ncl-group-reaper", daemon=True)
                self._thread.start()

    def put(self, objects: list[Any]) -> None:
        self.start()
        with self._lock:
            self._pending += 1
        self._queue.put(objects)

    def _run(self) -> None:
        while True:
            objects = self._queue.get()
            # The process group first (joins its worker threads once a stuck collective ends), then the unfinished
            # works, which hold the gloo context: the last reference to it closes the sockets and its loop thread.
            while objects:
                if objects.pop(0) is COLLECT:
                    gc.collect()
            del objects
            with self._lock:
                self._pending -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once everything handed over so far is destroyed (False if that takes longer than `timeout_s`)."""
        with self._lock:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)


_REAPER = _Reaper()


COLLECT = object()  # handed to the reaper: a full garbage collection there, after what came before it


def reap(obj: Any, collect: bool = False) -> None:
    """Drop the caller's last reference to `obj` (anything that holds gloo groups) on the reaper thread; `collect`:
    then run a full garbage collection there, for what still holds them from reference cycles (a failed `fit`'s
    objects): the groups they hold are destroyed on that thread too, and the caller goes on meanwhile (the collection
    holds the GIL, ~10 ms here, while the caller mostly waits for its peers with the GIL released)."""
    _REAPER.put([obj, COLLECT] if collect else [obj])


def release_groups(groups: Sequence[Group]) -> None:
    """Destroy `groups` (all of an abandoned generation) on the reaper thread, without blocking the caller even
    when a collective is stuck in one of them. A released group raises `PeerFailure` if it is used again."""
    for group in groups:
        objects: list[Any] = [group.pg, group.device_pg, *group.unfinished]
        group.pg = group.device_pg = None
        group.unfinished = []
        _REAPER.put(objects)
        del objects


def wait_released(timeout_s: float) -> bool:
    """Wait until every released group is destroyed (for tests and for a clean exit)."""
    return _REAPER.wait_idle(timeout_s)


@dataclass
class Membership:
    """This rank's groups for the current generation."""

    store: dist.Store
    rank: int
    world_size: int
    host: str
    timeout_s: float
    generation: int = 0
    groups: dict[str, Group] = field(default_factory=dict)
    arrive_timeout_s: float | None = None  # see `Group.arrive_timeout_s`
    # The ranks that train in this generation (None: all of them); a shrunk world's (`topology.shrink`).
    active: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _REAPER.start()

    def group(self, name: str, ranks: Sequence[int]) -> Group:
        """The group `name` over `ranks` in the current generation (built on first use by each member)."""
        key = f"{name}:{','.join(map(str, ranks))}"
        if key not in self.groups:
            self.groups[key] = Group(self.store, self.generation, name, tuple(ranks), self.rank, self.host,
                                     self.timeout_s, self.arrive_timeout_s)
        return self.groups[key]

    def world(self) -> Group:
        """Every rank that trains in this generation (all ranks, or a shrunk world's)."""
        return self.group("world", self.active if self.active is not None else range(self.world_size))

    @property
    def lead(self) -> int:
        """The lowest rank that trains in this generation: rank 0 unless the job is shrunk without it."""
        return self.active[0] if self.active else 0

    def advance(self, generation: int, active: Sequence[int] | None = None) -> None:
        """Release every group of the current generation and move to `generation` (groups are rebuilt lazily,
        by name), in which the ranks `active` train (None: all)."""
        assert generation > self.generation, (generation, self.generation)
        release_groups(list(self.groups.values()))
        self.groups = {}
        self.generation = generation
        self.active = None if active is None else tuple(active)
