"""`MmapBatchLoader`: a data-parallel rank's batches, served from the shared-memory cache (`data.cache`).

A thread in the rank's process (the group's writer only) keeps the next `prefetch` batches written to the cache
and the last `lookback` ones kept, so a replacement of this rank finds the batch it must train on already there.
The position comes from `GlobalBatchPlan` by index arithmetic (O(1)); nothing before it is read or replayed.
Any batch the cache cannot serve (miss, corrupt, stale, full) is read from the dataset directly, and a cached
batch is used only after its header and checksum are verified, so the batches are the same with or without it.

`BatchLedger` is the exactly-once check: it records the fingerprint of the batch the loader produced for each step,
and `check(step, batch)` fails loudly when the trainer is about to train step s on anything else (a repeated or
skipped batch, or a position restored wrong after a recovery).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
from torch.utils.data import default_collate

from nemo_checkpointless.data.cache import Batch, BatchCache, fingerprint

LOADER_STATE_VERSION = 1
log = logging.getLogger(__name__)


class DataOrderError(RuntimeError):
    """The trainer was about to train a step on a batch other than the one the plan assigns to it."""


class BatchLedger:
    """step -> fingerprint of the batch produced for it, for the last `window` steps (constant memory).

    `record` is called by the loader when it yields a batch; `check` by the trainer side (a callback) just before
    the step trains. Both on the same rank; nothing is collective.
    """

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self._steps: OrderedDict[int, str] = OrderedDict()
        self.last_checked: int | None = None
        self.checked = 0

    def reset(self) -> None:
        """A new pass of the loader (a new `fit`, a restart): the next check may start at any step."""
        self._steps.clear()
        self.last_checked = None

    def record(self, step: int, digest: str) -> None:
        self._steps[step] = digest
        while len(self._steps) > self.window:
            self._steps.popitem(last=False)

    def check(self, step: int, batch: Batch) -> None:
        """Raise `DataOrderError` unless `batch` is the batch produced for `step` and steps follow one another."""
        expected = self._steps.get(step)
        got = fingerprint(batch)
        produced = f"steps {min(self._steps)}..{max(self._steps)}" if self._steps else "no step yet"
        if expected is None:
            raise DataOrderError(f"step {step}: the loader produced no batch for this step ({produced}): the data "
                                 "position does not match the trainer's step (a batch would be skipped or repeated)")
        if got != expected:
            other = [s for s, d in self._steps.items() if d == got]
            what = f"the batch of step {other[0]} (repeated or skipped)" if other else "an unknown batch"
            raise DataOrderError(f"step {step}: the trainer got {what}, not the batch the plan assigns to step {step}")
        if self.last_checked is not None and step != self.last_checked + 1:
            raise DataOrderError(f"step {step} follows step {self.last_checked}: "
                                 f"{'a step was skipped' if step > self.last_checked else 'a step is repeated'}")
        self.last_checked = step
        self.checked += 1


class BatchPlan(Protocol):
    """Which samples each data-parallel rank trains on at each step (`GlobalBatchPlan`, or a torch sampler's
    order: `lightning.data`)."""

    @property
    def dp_size(self) -> int: ...

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def global_batch_size(self) -> int: ...

    def sample_ids(self, step: int, dp_rank: int, cache: dict[int, Any]) -> np.ndarray: ...

    def samples_consumed(self, step: int) -> int: ...


class MmapBatchLoader:
    """An iterable of one data-parallel rank's batches for steps [start, `end_step`), for any map-style dataset.

    Args:
        dataset: map-style; `dataset[i]` returns tensors (a tensor, or a list/tuple/str-keyed dict of tensors).
        plan: which samples each rank trains on at each step (`GlobalBatchPlan`).
        dp_rank: this rank's data-parallel index.
        end_step: the first step not yielded (e.g. `trainer.max_steps`).
        start_step: the first step yielded: an int, or a callable read at each `iter()` (e.g. the session's data
            position, which a replacement's join or a checkpoint restart sets). `load_state_dict` fixes it.
        cache: the batch group's `BatchCache`, or None (read the dataset directly: the plain path).
        writer: this process prefetches into the cache (one rank per batch group); others only read.
        prefetch: batches written ahead of the step being consumed (K).
        lookback: batches kept behind it (L), so a replacement can be served the batch its rank failed on.
        collate_fn: samples -> batch (default: `torch.utils.data.default_collate`).
        verify: record each batch's fingerprint in `ledger` (`check_batch` then verifies the trainer's step).
        reader_wait_s: how long a non-writer waits for the writer to publish a batch before reading it directly.
        data_version: written into `state_dict` and checked by `load_state_dict`.
        name: prefix of this loader's log lines (e.g. "cache 3: "); a rank's lines name the rank already
            (`restart.logs`).

    Not thread-safe: iterate from one thread. Call `close()` when done (stops the prefetch thread).
    """

    def __init__(self, dataset: Any, plan: BatchPlan, dp_rank: int, end_step: int, *,
                 start_step: int | Callable[[], int] = 0, cache: BatchCache | None = None, writer: bool = True,
                 prefetch: int = 16, lookback: int = 4,
                 collate_fn: Callable[[list[Any]], Batch] = default_collate, verify: bool = True,
                 reader_wait_s: float = 2.0, data_version: str = "", name: str = "") -> None:
        if not 0 <= dp_rank < plan.dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for data-parallel size {plan.dp_size}")
        if prefetch < 0 or lookback < 0:
            raise ValueError(f"prefetch ({prefetch}) and lookback ({lookback}) must be >= 0")
        self.dataset = dataset
        self.plan = plan
        self.dp_rank = dp_rank
        self.end_step = end_step
        self._start = start_step
        self.cache = cache
        self.writer = writer
        self.prefetch = prefetch
        self.lookback = lookback
        self.collate_fn = collate_fn
        self.ledger = BatchLedger() if verify else None
        self.reader_wait_s = reader_wait_s
        self.data_version = data_version
        self.name = name
        self._perm_cache: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._cursor = 0  # the step the consumer asked for last
        self._stop = False
        self._thread: threading.Thread | None = None
        self.stats = {"hits": 0, "direct": 0, "written": 0, "adopted": 0}
        self.first_batch: dict[str, Any] = {}

    # --------------------------------------------------------------------------------------------- position
    def start_step(self) -> int:
        return self._start() if callable(self._start) else self._start

    def __len__(self) -> int:
        return max(0, self.end_step - self.start_step())

    def sample_ids(self, step: int) -> np.ndarray:
        return self.plan.sample_ids(step, self.dp_rank, self._perm_cache)

    def state_dict(self, completed_steps: int) -> dict[str, Any]:
        """The loader's resume state at a step boundary. `completed_steps` is the trainer's (a loader that is
        fetched ahead cannot know which of its batches were trained on)."""
        return {"version": LOADER_STATE_VERSION, "data_version": self.data_version, "step": completed_steps,
                "samples_consumed": self.plan.samples_consumed(completed_steps), "dp_size": self.plan.dp_size,
                "dp_rank": self.dp_rank, "micro_batch_size": self.plan.micro_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state["step"]` in O(1). Raises ValueError naming what does not match this job."""
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"data loader state version {state.get('version')!r}, this build reads "
                             f"{LOADER_STATE_VERSION}")
        mine = {"dp_size": self.plan.dp_size, "micro_batch_size": self.plan.micro_batch_size,
                "data_version": self.data_version}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(f"data loader state has {key}={state.get(key)!r}, this job has {key}={value!r}: "
                                 "the data position would not be exact (resume with the same data, "
                                 "data.micro_batch_size and data-parallel size)")
        if state["samples_consumed"] != self.plan.samples_consumed(state["step"]):
            raise ValueError(f"data loader state: {state['samples_consumed']} samples consumed is not "
                             f"step {state['step']} x global batch {self.plan.global_batch_size}")
        self._start = int(state["step"])

    # ------------------------------------------------------------------------------------------------ batches
    def _direct(self, step: int, ids: np.ndarray) -> Batch:
        self.stats["direct"] += 1
        return self.collate_fn([self.dataset[int(i)] for i in ids])

    def _get(self, step: int) -> tuple[Batch, str | None, str]:
        ids = self.sample_ids(step)
        cache = self.cache
        if cache is not None and cache.enabled:
            got = cache.read(step, ids)
            if got is None and not self.writer and self.reader_wait_s > 0:
                deadline = time.monotonic() + self.reader_wait_s
                while got is None and cache.enabled and time.monotonic() < deadline:
                    time.sleep(0.001)
                    got = cache.read(step, ids)
            if got is not None:
                self.stats["hits"] += 1
                return got[0], got[1], "cache"
        return self._direct(step, ids), None, "dataset"

    def __iter__(self) -> Iterator[Batch]:
        start = self.start_step()
        self._stop_thread()
        if self.ledger is not None:
            self.ledger.reset()
        self.first_batch = {}
        with self._cond:
            self._cursor = start
            self._stop = False
        self._start_prefetch(start)
        return self._iterate(start)

    def _iterate(self, start: int) -> Iterator[Batch]:
        try:
            for step in range(start, self.end_step):
                with self._cond:
                    self._cursor = step
                    self._cond.notify_all()
                yield self._serve(step)
        finally:
            self._stop_thread()

    def batch(self, step: int) -> Batch:
        """Random access, for a consumer that reads by step rather than iterating (NeMo's data module, behind
        Megatron's sampler): the batch of `step`, from the cache when it is there. Moves the prefetch window to
        `step`, starting the writer's prefetch thread on first use (`close()` stops it)."""
        if not 0 <= step < self.end_step:
            raise IndexError(f"step {step} is outside [0, {self.end_step})")
        with self._cond:
            self._cursor = step
            self._stop = False
            self._cond.notify_all()
        if self._thread is None:
            self._start_prefetch(step)
        return self._serve(step)

    def _start_prefetch(self, start: int) -> None:
        """Start the prefetch thread at `start` (the batch group's writer only, with a usable cache)."""
        if self.cache is not None and self.cache.enabled and self.writer and self.prefetch:
            self._thread = threading.Thread(target=self._prefetch, args=(start,), daemon=True,
                                            name=f"ncl-prefetch-g{self.cache.group}")
            self._thread.start()

    def _serve(self, step: int) -> Batch:
        """The batch of `step` for the consumer: noted as the first one served (where from, how long) and, with
        `verify`, recorded in the ledger."""
        t0 = time.perf_counter()
        batch, digest, source = self._get(step)
        if not self.first_batch:
            self.first_batch = {"step": step, "source": source, "s": time.perf_counter() - t0}
            if step:
                log.debug("%sdata: loader's first batch at step %d from the %s in %.2f ms", self.name, step, source,
                          1e3 * self.first_batch["s"])
        if self.ledger is not None:
            self.ledger.record(step, digest if digest is not None else fingerprint(batch))
        return batch

    def check_batch(self, step: int, batch: Batch) -> None:
        """Fail loudly (`DataOrderError`) unless `batch` is what this loader produced for `step` (needs `verify`)."""
        if self.ledger is not None:
            self.ledger.check(step, batch)

    # ----------------------------------------------------------------------------------------------- prefetch
    def _prefetch(self, start: int) -> None:
        cache = self.cache
        assert cache is not None
        try:
            on_disk = set(cache.steps_on_disk())  # adopt what a previous writer of this group left
            nxt = start
            while True:
                with self._cond:
                    while not self._stop and not (nxt < min(self._cursor + self.prefetch, self.end_step)):
                        self._trim(on_disk)
                        self._cond.wait(0.5)
                    if self._stop:
                        return
                    # Behind the consumer (it read those directly): jump to its step, which a replacement may need.
                    nxt = max(nxt, self._cursor)
                self._trim(on_disk)
                if nxt in on_disk and cache.has(nxt):
                    self.stats["adopted"] += 1
                else:
                    ids = self.sample_ids(nxt)
                    if cache.write(nxt, ids, self.collate_fn([self.dataset[int(i)] for i in ids])) is None:
                        return  # writing is disabled (e.g. ENOSPC, reported once): the consumer reads directly
                    self.stats["written"] += 1
                    on_disk.add(nxt)
                nxt += 1
        except Exception:  # never take training down: the consumer falls back to direct reads
            log.exception("%sdata: the prefetch thread failed; reading the dataset directly", self.name)

    def _trim(self, on_disk: set[int]) -> None:
        assert self.cache is not None
        cutoff = self._cursor - self.lookback
        old = [s for s in on_disk if s < cutoff]
        if old:
            self.cache.discard(old)
            on_disk.difference_update(old)

    def _stop_thread(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if thread is not threading.current_thread():
            thread.join()
        self._thread = None

    def close(self) -> None:
        """Stop the prefetch thread (the cache files stay: they belong to the job)."""
        self._stop_thread()


class LedgeredLoader:
    """Wraps an iterable that yields the batches of steps start, start+1, ... (e.g. a plain `DataLoader` with a
    positioned sampler) and records each in a `BatchLedger`, so `check_batch` works with the plain loader too."""

    def __init__(self, loader: Iterable[Batch], start_step: Callable[[], int]) -> None:
        self.loader = loader
        self._start = start_step
        self.ledger = BatchLedger()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        self.ledger.reset()
        step = self._start()
        for batch in self.loader:
            self.ledger.record(step, fingerprint(batch))
            step += 1
            yield batch

    def check_batch(self, step: int, batch: Batch) -> None:
        self.ledger.check(step, batch)

    def close(self) -> None:
        pass

