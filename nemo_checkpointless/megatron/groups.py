"""A Megatron job's process groups across generations, on torch.distributed's default group: megatron-core only
(no NeMo, no Lightning), so any door that runs megatron-core (NeMo 2, Megatron-Bridge, Megatron-LM) leaves and
re-enters its training loop with them.

- `FaultWatch`: while a generation trains, a declared fault fails the collectives stuck in the default group's
  sockets at once and stops the step's computation where it is;
- `abandon_default_group` / `drop_megatron_groups`: a failed generation's default group and every group megatron
  derived from it leave torch.distributed's tables and are destroyed on the reaper thread (`restart.groups.reap`);
- `release_fit`: cut the reference cycles through C++ that kept a failed setup's model, DDP and optimizer alive;
- `one_gloo_group_per_member_set`: megatron's many gloo groups with the same members made once per generation.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist

from nemo_checkpointless.megatron.participant import distributed_optimizers
from nemo_checkpointless.restart.groups import PeerFailure, reap


@contextlib.contextmanager
def one_gloo_group_per_member_set(default_timeout: datetime.timedelta | None = None) -> Iterator[None]:
    """While megatron-core creates its groups: a gloo group asked for again with the same members, timeout and no
    options is the group made the first time. Megatron asks for 66 groups with 4 ranks (19 distinct member sets;
    each rank's own one-rank group 10 times, the world 5 times), each a connect through the launcher's store, and
    every generation's `fit` makes them again. Safe because every member of a group runs the same sequence of
    collectives on it whichever of megatron's names it uses (all ranks make the same calls in the same order, so
    the groups' names and store keys still agree). Groups of another backend (NCCL, created lazily) or with
    options are made as asked. A group asked for without a timeout gets `default_timeout` (megatron-core 0.15
    passes none for its expert groups, which then had torch's 30 minutes instead of the job's failure detector,
    and were two more connects of member sets already made)."""
    original = dist.new_group
    made: dict[tuple[Any, ...], Any] = {}

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None, pg_options: Any = None,
                  use_local_synchronization: bool = False, group_desc: str | None = None, **rest: Any) -> Any:
        if timeout is None:
            timeout = default_timeout
        args = dict(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                    use_local_synchronization=use_local_synchronization, group_desc=group_desc, **rest)
        name = str(backend) if backend is not None else str(dist.get_backend())
        if rest or pg_options is not None or use_local_synchronization or name.lower() != "gloo":
            return original(**args)
        key = (tuple(sorted(ranks)) if ranks is not None else None, timeout)
        if key not in made:
            made[key] = original(**args)
        return made[key]

    dist.new_group = new_group  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.new_group = original


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
    own handles to them are dropped first; the reaper then collects reference cycles, which free the handles a
    failed `fit`'s objects still hold). Returns how many groups were abandoned."""
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
    reap(groups, collect=True)
    del groups
    return count


class FaultWatch:
    """While `fit` runs: when the launcher declares this generation failed (`FAULT_KEY`), make every collective
    stuck in the default group's sockets fail at once, instead of after the gloo timeout, and stop the step's
    computation where it is.

    On gloo only the dead rank's ring neighbours see the crash; the other survivors wait in a collective that
    `abort()` does not interrupt. This thread shuts down (`shutdown(SHUT_RDWR)`) this process's connected TCP
    sockets except those to `keep_ports` (the launcher's store), which gloo sees as a closed peer: the collective
    raises and the rank leaves `fit`. It acts only while `active` (cleared by the main thread, under the lock,
    as soon as `fit` has returned or raised), so it never touches the next generation's sockets. Linux only
    (/proc/self/fd); elsewhere the gloo timeout stays the detector.

    A survivor that is computing when the fault is declared would only meet a closed socket at its next
    collective: with data parallelism alone that is the end of the backward, most of a step later. Inside
    `interruptible()` (the strategy opens it around the forward and backward, where no parameter, optimizer
    state, RNG snapshot or counter is written: a step interrupted there is redone whole) this thread also raises
    `PeerFailure` in the training thread (`PyThreadState_SetAsyncExc`), which Python delivers between two
    bytecodes: the rank leaves `fit` within one torch operation. Outside the section nothing is raised, and a
    raise that was pending when the section closed is taken back and raised by the section itself, so it never
    lands in the optimizer step.

    Outside the section (in the optimizer step, between steps) the sockets are shut only `FAULT_GRACE_S` after the
    declaration, or as soon as the rank enters the section (which then raises). The fault is declared as the dead
    rank's exit begins: a rank still receiving the end of the parameter all-gather that the dead rank completed
    finishes it, and stops at the next step's boundary with its partners (measured: without the grace, a kill at
    a step's start left two survivors one step behind, and the recovery went to the checkpoint).
    """

    def __init__(self, store: Any, generation: int, keep_ports: set[int], poll_s: float = 0.01) -> None:
        import threading

        from nemo_checkpointless.restart.groups import DeclaredFault

        self.keep_ports, self.poll_s = keep_ports, poll_s
        self.fault = DeclaredFault(store, generation)
        self.lock = threading.Lock()
        self.active = True
        self.closed = 0
        self._section: int | None = None  # the training thread's id while it is inside `interruptible()`
        self.interrupted = False  # a `PeerFailure` was raised in the training thread
        self._thread = threading.Thread(target=self._run, name="ncl-fault-watch", daemon=True)

    @property
    def fired(self) -> bool:
        """This watch has read the launcher's declaration."""
        return self.fault.seen is not None

    def __enter__(self) -> FaultWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.active = False

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """The training thread's computation that a declared fault may stop where it is (see the class)."""
        import threading

        with self.lock:
            if self.fired:
                if self.active:  # within the grace: the peers still waiting on this rank are released now
                    self._release()
                raise PeerFailure("the launcher declared a peer failed")
            self._section = threading.get_ident()
        try:
            yield
        finally:
            with self.lock:
                self._section = None
                interrupted = self.interrupted
            if interrupted:
                _set_async_exc(threading.get_ident(), None)  # still pending (not yet delivered): taken back
                raise PeerFailure("the launcher declared a peer failed while this rank was computing")

    def _release(self) -> None:
        """Shut this process's sockets (but the store's) and stop watching; under the lock."""
        self.closed = _shutdown_sockets(self.keep_ports)
        self.active = False

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.active:
                    return
                # Computing: stopped at once (its step is redone whole). In a collective outside the section (the
                # optimizer's parameter all-gather): it has FAULT_GRACE_S to complete among live ranks.
                if self.fault.due(time.monotonic()) or (self.fired and self._section is not None):
                    section = self._section
                    self._release()
                    if section is not None:
                        self.interrupted = _set_async_exc(section, PeerFailure) == 1
                    return
            time.sleep(self.poll_s)


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    """Raise `exc` in thread `thread_id` at its next bytecode (None: take back a raise not yet delivered); the number
    of threads it reached."""
    import ctypes

    arg = ctypes.py_object(exc) if exc is not None else ctypes.c_void_p(0)
    return int(ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), arg))


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
