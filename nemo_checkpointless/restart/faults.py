"""Fault injection (`fault.plan`), one implementation for every worker: each fault fires once per job (a
replacement of the rank does not fire it again), and the launcher reads what fired from the store
(`injected_key`) to label its recovery records."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.protocol import corrupt_restore_key, injected_key

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """The `exception` fault of a fault plan."""


__all__ = ["SLOW_S", "InjectedFault", "Injector", "fire_faults", "injected_key", "slow_delay"]

SLOW_S = 0.2  # the `slow` fault: this much longer, every step from the one it fired at
OOM_HEADROOM = 32 << 20  # the `oom` fault: the address-space limit it sets, above what the process maps now
OOM_DEADLINE_S = 30.0  # the `oom` fault: a process still alive this long after it (stuck exiting) is ended
_slow_s = 0.0  # this process's extra sleep per step (`slow`, once it fired)


def slow_delay() -> None:
    """The callbacks call this at every step's start: a rank whose `slow` fault fired sleeps `SLOW_S` (a straggler,
    never replaced); every other rank returns at once."""
    if _slow_s:
        time.sleep(_slow_s)


def _no_core_dump() -> None:
    """A fault that dies of a signal whose default action dumps core (SIGSEGV, SIGABRT) writes no core file."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))


def _mapped_bytes() -> int:
    """The process's address space now (what RLIMIT_AS limits): VmSize, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _run_out_of_memory(rank: int, step: int) -> None:
    """The `oom` fault: limit this process's address space to just above what it maps now, then allocate past the
    limit. The MemoryError is raised as any allocation's would be, and ends the process with a non-zero code
    through its own error handling; should that handling get stuck (it runs with almost no memory left),
    faulthandler's watchdog thread, started before the limit, ends the process after `OOM_DEADLINE_S`."""
    import faulthandler
    import resource

    faulthandler.dump_traceback_later(OOM_DEADLINE_S, exit=True)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _mapped_bytes() + OOM_HEADROOM
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    hog = []
    while True:  # chunks of the headroom: the last one does not fit
        hog.append(bytearray(OOM_HEADROOM // 4))
        if len(hog) > 64:  # not reached: the limit stops it after about 4 chunks
            raise MemoryError(f"injected fault: oom on rank {rank} at step {step}")


def kill_in_gather(rank: int, step: int) -> None:
    """Where a `kill` with target `gather` lands: the strategy calls this after step `step`'s gradient all-reduce,
    before its instance's parameter all-gather (SIGKILL)."""
    log.info(f"killed after the gradient all-reduce of step {step}")
    os.kill(os.getpid(), signal.SIGKILL)


def fire_faults(plan: Sequence[Any], rank: int, step: int, store: Any, corrupt: Callable[[], None],
                grow: Callable[[int], None] | None = None, bitflip: Callable[[str], None] | None = None,
                nan: Callable[[int, bool], None] | None = None, gather: Callable[[int], None] | None = None
                ) -> None:
    """Fire the faults of `plan` (`FaultSpec`s) that name `rank` at 1-based `step`: `kill` (SIGKILL; with target
    `gather`, calls `gather(step)`: the participant kills itself after the step's gradient all-reduce), `hang`
    (SIGSTOP), `spin` (a Python loop that never ends), `stall` (sleeps forever: idle, it never reaches the step's
    collectives), `gil` (blocks in a native call that holds the GIL: libc `pause` through `ctypes.PyDLL`),
    `segfault` (a real segmentation fault in native code: `ctypes.string_at(0)` reads address 0; SIGSEGV),
    `abort` (`os.abort()`: SIGABRT; neither writes a core file), `sigterm` (SIGTERM sent to itself: what the
    process's handler does with it, Lightning's ends it), `oom` (limits its own address space, `RLIMIT_AS`, to just
    above its current use and allocates past it: a MemoryError that ends the process), `exit0` (leaves at once with
    exit status 0, `os._exit(0)`, before its training ended: a fault, not a success), `slow` (from this step on,
    sleeps `SLOW_S` more at every step's start, in `slow_delay()`, which the callbacks call: a straggler, reported,
    never replaced), `corrupt` (calls `corrupt()`: the next state this rank sends is damaged), `bitflip` (calls
    `bitflip(target)`: one bit of this rank's optimizer shard, or of a parameter, flipped in memory, silently; the
    integrity check must catch it), `nan` / `nan_batch` (calls `nan(step, persistent)`: a gradient element of this
    step made NaN, once / every time the step is computed), `corrupt_restore` (counts one more damaged restore for
    this rank in the store, `corrupt_restore_key`: the next state a process restores as this rank, after its
    checksum passed), `grow` (calls `grow(step)`: a shrunk world grows back after this step, waiting for a spare if
    none is ready; not a fault, a test's way to fix the step) or `exception` (raises `InjectedFault`)."""
    global _slow_s
    for i, spec in enumerate(plan):
        if spec.rank != rank or spec.step != step or store.check([injected_key(i)]):
            continue
        store.set(injected_key(i), json.dumps({"t": time.time(), "kind": spec.kind, "rank": rank, "step": step}))
        log.info(f"injected fault: {spec.kind} at step {step}")
        if spec.kind == "kill" and getattr(spec, "target", "") == "gather":
            if gather is None:
                raise ConfigError(f"fault.plan kill:{rank}:{step}:gather", "gather",
                                  "needs a strategy that stops in its parameter all-gather (CheckpointlessStrategy, "
                                  "CheckpointlessMegatronStrategy)",
                                  "drop the target (a kill at the step's start)")
            gather(step)
        elif spec.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif spec.kind == "spin":
            while True:
                pass
        elif spec.kind == "stall":
            while True:
                time.sleep(3600)
        elif spec.kind == "gil":
            import ctypes

            ctypes.PyDLL(None).pause()  # a native call that keeps the GIL: no thread of this rank runs again
        elif spec.kind == "segfault":
            import ctypes

            _no_core_dump()
            ctypes.string_at(0)  # reads address 0 in libc's memcpy: SIGSEGV
        elif spec.kind == "abort":
            _no_core_dump()
            os.abort()
        elif spec.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif spec.kind == "oom":
            _run_out_of_memory(rank, step)
        elif spec.kind == "exit0":
            os._exit(0)
        elif spec.kind == "slow":
            _slow_s = SLOW_S
        elif spec.kind == "corrupt":
            corrupt()
        elif spec.kind == "bitflip":
            if bitflip is not None:
                bitflip(getattr(spec, "target", "") or "shard")
        elif spec.kind in ("nan", "nan_batch"):
            if nan is not None:
                nan(step, spec.kind == "nan_batch")
        elif spec.kind == "corrupt_restore":
            store.add(corrupt_restore_key(rank), 1)
        elif spec.kind == "grow":
            if grow is not None:
                grow(step)
        else:
            raise InjectedFault(f"injected fault: exception on rank {rank} at step {step}")


class Injector:
    """One rank's fault plan (tests, benchmarks), for every door and the recovery engine: what a fired fault leaves
    for later is held here, and the code it lands in asks for it where it lands (the hooks below), so that no
    production type carries fault state of its own. One per process (the session's `faults`), across fits.

    The door's strategy gives it, once its session exists, how to flip a bit of its state and how to damage a state
    it restores (`attach`); its callback gives it the plan (`arm`) and calls `fire(step)` as each step starts.
    Then:
    - the door asks `kill_in_gather(step)` after the step's gradient reduction, `poisoned(step)` before it (a NaN in
      its own gradient), `flip_param_now()` at the step's end, `grow_asked(step)` (a shrunk world asks to grow);
    - the recovery engine asks `corrupt_send()` after it took the checksum of a state it sends, and calls
      `restored()` once this rank restored a state (the `corrupt_restore` count in the store says whether it is
      damaged: the door's `damage`)."""

    def __init__(self, rank: int, store: Any) -> None:
        self.rank, self.store = rank, store
        self.plan: list[Any] = []
        self._bitflip: Callable[[str], None] | None = None
        self._damage: Callable[[], None] | None = None
        self._gather: set[int] = set()
        self._poison: dict[int, bool] = {}  # step -> every time it is computed (nan_batch) or once (nan)
        self._grow: set[int] = set()
        self._corrupt_send = False
        self._flip_param = False

    def attach(self, bitflip: Callable[[str], None], damage: Callable[[], None] | None = None) -> None:
        """The door's hooks: `bitflip(target)` flips a bit of its state (`target`: "shard", "param"); `damage()`
        damages the state it just restored (default: `bitflip("shard")`)."""
        self._bitflip = bitflip
        self._damage = damage if damage is not None else lambda: bitflip("shard")

    def arm(self, plan: Sequence[Any]) -> None:
        """The plan this rank fires from (`FaultSpec`s), once per process: a plan armed again is the same plan."""
        self.plan = list(plan)

    def fire(self, step: int) -> None:
        """At the start of 1-based step `step` (`fire_faults`)."""
        if not self.plan:
            return
        fire_faults(self.plan, self.rank, step, self.store, self._set_corrupt_send, grow=self._grow.add,
                    bitflip=self._flip, nan=self._poison.__setitem__, gather=self._gather.add)

    def _set_corrupt_send(self) -> None:
        self._corrupt_send = True

    def _flip(self, target: str) -> None:
        if target == "param":
            self._flip_param = True  # at the end of the step in flight, after its all-gather
        elif self._bitflip is not None:
            self._bitflip(target)

    def kill_in_gather(self, step: int) -> None:
        """After step `step`'s gradient reduction, as its parameter all-gather starts: a `kill` with target
        `gather` ends the process here."""
        if step in self._gather:
            kill_in_gather(self.rank, step)

    def poisoned(self, step: int) -> bool:
        """Whether this rank's gradient of step `step` gets a NaN now (`nan`: once; `nan_batch`: every time)."""
        if step not in self._poison:
            return False
        if not self._poison[step]:
            del self._poison[step]
        return True

    def flip_param_now(self) -> bool:
        """At the end of the step in flight: a `bitflip` with target `param` flips a parameter now (once)."""
        flip, self._flip_param = self._flip_param, False
        return flip

    def grow_asked(self, step: int) -> bool:
        return step in self._grow

    def corrupt_send(self) -> bool:
        """The state being sent is damaged after its checksum (`corrupt`, once)."""
        corrupt, self._corrupt_send = self._corrupt_send, False
        return corrupt

    def restored(self) -> None:
        """This rank just restored a state, after its checksum passed: damaged if the store's `corrupt_restore`
        count for the rank says so (it counts restores by any process of the rank, so a replacement's is)."""
        key = corrupt_restore_key(self.rank)
        if self._damage is None or not self.store.check([key]) or self.store.add(key, 0) <= 0:
            return
        self.store.add(key, -1)
        log.info("injected fault: corrupt_restore (the state just restored is damaged)")
        self._damage()
