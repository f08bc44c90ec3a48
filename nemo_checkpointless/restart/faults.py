"""Fault injection (`fault.plan`), one implementation for every worker: each fault fires once per job (a
replacement of the rank does not fire it again), and the launcher reads what fired from the store
(`injected_key`) to label its recovery records."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from nemo_checkpointless.protocol import injected_key


class InjectedFault(RuntimeError):
    """The `exception` fault of a fault plan."""


__all__ = ["InjectedFault", "fire_faults", "injected_key"]


def fire_faults(plan: Sequence[Any], rank: int, step: int, store: Any, corrupt: Callable[[], None],
                grow: Callable[[int], None] | None = None) -> None:
    """Fire the faults of `plan` (`FaultSpec`s) that name `rank` at 1-based `step`: `kill` (SIGKILL), `hang`
    (SIGSTOP), `spin` (a Python loop that never ends), `stall` (sleeps forever: idle, it never reaches the step's
    collectives), `gil` (blocks in a native call that holds the GIL: libc `pause` through `ctypes.PyDLL`),
    `corrupt` (calls `corrupt()`: the next state this rank sends is damaged), `grow` (calls `grow(step)`: a shrunk
    world grows back after this step, waiting for a spare if none is ready; not a fault, a test's way to fix the
    step) or `exception` (raises `InjectedFault`)."""
    for i, spec in enumerate(plan):
        if spec.rank != rank or spec.step != step or store.check([injected_key(i)]):
            continue
        store.set(injected_key(i), json.dumps({"t": time.time(), "kind": spec.kind, "rank": rank, "step": step}))
        print(f"[rank {rank}] injected fault: {spec.kind} at step {step}", flush=True)
        if spec.kind == "kill":
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
        elif spec.kind == "corrupt":
            corrupt()
        elif spec.kind == "grow":
            if grow is not None:
                grow(step)
        else:
            raise InjectedFault(f"injected fault: exception on rank {rank} at step {step}")
