"""In-process replacement on the NeMo path: what a rank does between two `fit`s of consecutive generations.

NeMo and megatron-core hold the default process group and groups derived from it in many places (parallel_state,
megatron DDP, its bucket groups, the distributed optimizer, modules' `pg_collection`). Rather than re-pointing each
handle, every rank leaves `fit` after a failure (in its own process: a survivor keeps its pid and memory) and enters
it again with a fresh Megatron setup on the next generation's default group:

- a survivor catches the failure out of `fit`, runs the recovery engine (`RecoveryEngine.recover`) with its
  `MegatronParticipant` (it sends its boundary state if it is a replacement's source), keeps its own boundary
  state in memory (`own_boundary_state`: views of the previous fit's tensors, no copy) and passes it as `resume=`
  to the next `CheckpointlessMegatronStrategy`;
- a replacement runs `RecoveryEngine.join` with a `ReceivedState` (it has no model yet), then passes the state it
  received as `resume=`;
- `abandon_default_group()` takes the failed default group and every group derived from it out of
  torch.distributed's tables and hands them to the reaper thread (`restart.groups.reap`), which destroys them
  off the training thread once nothing else holds them: a forgotten gloo group keeps its sockets and can leave
  its transport thread spinning on a core (see `restart.groups`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_checkpointless.nemo.adapter import MegatronParticipant, distributed_optimizers
from nemo_checkpointless.restart.groups import reap


def drop_megatron_groups() -> None:
    """Drop megatron-core's handles to its process groups (`destroy_model_parallel` destroys nothing), so that a
    generation's groups (and their threads) do not outlive it. Found on megatron-core 0.15.3, beyond what
    `destroy_model_parallel` resets: `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` and its gloo twin stay set, and
    `RotaryEmbedding.forward` is an `lru_cache` that keeps every instance it saw (and its `cp_group`) alive. If a
    later release renames them, there is nothing to reset and nothing breaks."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    for name in ("_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP", "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO"):
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)
    try:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    except ImportError:
        return
    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if callable(cache_clear):
        cache_clear()


# megatron-core's lists of a DistributedOptimizer's shards (0.15): each holds views of the model's params
_SHARD_LISTS = ("model_float16_groups", "model_fp32_groups", "shard_float16_groups", "shard_fp32_groups",
                "shard_fp32_from_float16_groups")


def release_fit(model: Any, optimizers: Sequence[Any]) -> None:
    """Let a failed `fit`'s megatron model, DDP, optimizer and groups be freed. Without this a survivor kept every
    generation's (measured: ~60 threads, 80 descriptors and ~20 MB more per recovery).

    Why they stayed: two reference cycles pass through C++, where Python's garbage collector cannot follow them,
    so they look referenced from outside and are never collected.
    - Megatron's DDP registers its backward hook (a closure over the DDP) on each param's grad accumulator and
      keeps the accumulators in `grad_accs`: DDP -> accumulator -> (C++) its hooks -> closure -> DDP.
    - megatron-core's `DistributedOptimizer` takes an fp32 param's shard as `model_param.view(-1)[start:end]`
      without `detach()`, so each shard carries an autograd graph that ends in that accumulator: optimizer ->
      shard -> (C++) graph -> accumulator -> hook -> DDP -> model config -> `finalize_model_grads_func` -> NeMo's
      optimizer module -> optimizer.
    Emptying `grad_accs`, the optimizer's shard lists and its torch optimizer's groups and state cuts both at their
    Python side. The boundary state kept for the next `fit` holds detached views of the same storage, so nothing
    it needs is freed."""
    import torch.nn as nn

    if isinstance(model, nn.Module):
        for module in model.modules():
            if isinstance(getattr(module, "grad_accs", None), list):
                setattr(module, "grad_accs", [])  # noqa: B010  (a megatron attribute torch.nn types as a Module)
    for optimizer in optimizers:
        for leaf in distributed_optimizers(optimizer):
            for name in _SHARD_LISTS:
                if isinstance(getattr(leaf, name, None), list):
                    setattr(leaf, name, [])
            inner = leaf.optimizer
            inner.state.clear()
            # the torch optimizer's groups, and the groups megatron built them from (not the same dicts once a
            # state was loaded)
            groups = [*inner.param_groups, *(r.get("orig_group", {}) for r in getattr(leaf, "opt_group_ranges", []))]
            for group in groups:
                if "params" in group:
                    group["params"] = []


def abandon_default_group() -> int:
    """Take torch.distributed's default group and every group made from it out of its tables, so that
    `init_process_group` can run again (the next generation), and destroy them on the reaper thread (megatron's
    own handles to them are dropped first). Returns how many groups were abandoned."""
    from torch.distributed import distributed_c10d as c10d

    drop_megatron_groups()
    world: Any = c10d._world
    groups = list(world.pg_map.keys())
    c10d._update_default_pg(None)
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                  "pg_coalesce_state"):
        getattr(world, table).clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
    count = len(groups)
    reap(groups)
    del groups
    return count


def own_boundary_state(participant: MegatronParticipant) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A survivor's state at the boundary of the step the failure interrupted (params and optimizer state are still
    those of the boundary: no rank completed that step's gradient reduction). If the failure came between the
    previous optimizer step and this step's snapshot, the snapshot is taken now (nothing drew from RNG between)."""
    if participant.boundary_step != participant.completed_steps:
        participant.at_step_boundary(participant.completed_steps)
    return participant.boundary_state()


class ReceivedState:
    """The recovery engine's `Participant` for a replacement that has no model yet: it keeps what it receives."""

    def __init__(self) -> None:
        self.state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None

    def progress(self) -> tuple[int, int]:
        return -1, 0

    def data_digest_hex(self) -> str:
        return "0" * 64

    def boundary_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        raise RuntimeError("a replacement has no state to send")

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.state = (tensors, meta)


class FaultWatch:
    """While `fit` runs: when the launcher declares this generation failed (`FAULT_KEY`), make every collective
    stuck in the default group's sockets fail at once, instead of after the gloo timeout.

    On gloo only the dead rank's ring neighbours see the crash; the other survivors wait in a collective that
    `abort()` does not interrupt. This thread shuts down (`shutdown(SHUT_RDWR)`) this process's connected TCP
    sockets except those to `keep_ports` (the launcher's store), which gloo sees as a closed peer: the collective
    raises and the rank leaves `fit`. It acts only while `active` (cleared by the main thread, under the lock,
    as soon as `fit` has returned or raised), so it never touches the next generation's sockets. Linux only
    (/proc/self/fd); elsewhere the gloo timeout stays the detector.
    """

    def __init__(self, store: Any, generation: int, keep_ports: set[int], poll_s: float = 0.01) -> None:
        import threading

        self.store, self.generation, self.keep_ports, self.poll_s = store, generation, keep_ports, poll_s
        self.lock = threading.Lock()
        self.active = True
        self.fired_t: float | None = None
        self.closed = 0
        self._thread = threading.Thread(target=self._run, name="ncl-fault-watch", daemon=True)

    def __enter__(self) -> FaultWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.active = False

    def _run(self) -> None:
        import time

        from nemo_checkpointless.restart.groups import fault_generation

        while True:
            with self.lock:
                if not self.active:
                    return
                if fault_generation(self.store) >= self.generation:
                    self.fired_t = time.time()
                    self.closed = _shutdown_sockets(self.keep_ports)
                    self.active = False
                    return
            time.sleep(self.poll_s)


def _shutdown_sockets(keep_ports: set[int]) -> int:
    import os
    import socket

    closed = 0
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return 0
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                peer = sock.getpeername()
                if peer[1] not in keep_ports:
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
        except OSError:  # not connected (a listener), or already closed
            pass
        finally:
            sock.close()  # closes the duplicate only
    return closed
