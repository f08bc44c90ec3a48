"""Tier 2 data path, in one process: the O(1) plan, the shared-memory batch cache and its fallbacks, the loader's
state and the exactly-once ledger. Every batch is compared with a direct read of the dataset."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nemo_checkpointless.data.cache import (
    BatchCache,
    CacheFallbackWarning,
    data_version,
    job_cache_dir,
    remove_job_cache,
    write_chunks,
)
from nemo_checkpointless.data.indexed import IndexedTokens
from nemo_checkpointless.data.loader import DataOrderError, LedgeredLoader, MmapBatchLoader
from nemo_checkpointless.data.sampling import GlobalBatchPlan, IndexPermutation, TokenSequences

pytestmark = pytest.mark.timeout(60)

VERSION = data_version(content="test", seq_len=16)


class CountingDataset(torch.utils.data.Dataset[torch.Tensor]):
    """Sample i is [i, i+1, ..., i+16] (int64); counts the reads."""

    def __init__(self, n: int = 400) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        return torch.arange(i, i + 17, dtype=torch.int64)


@pytest.fixture
def plan() -> GlobalBatchPlan:
    return GlobalBatchPlan(400, micro_batch_size=4, dp_size=2, seed=5)


def expected(ds: CountingDataset, plan: GlobalBatchPlan, step: int, dp_rank: int = 0) -> torch.Tensor:
    return torch.stack([torch.arange(i, i + 17) for i in plan.sample_ids(step, dp_rank).tolist()])


@contextlib.contextmanager
def loader_of(*args: Any, **kwargs: Any) -> Iterator[MmapBatchLoader]:
    loader = MmapBatchLoader(*args, **kwargs)
    try:
        yield loader
    finally:
        loader.close()


def consume(loader: MmapBatchLoader, steps: int | None = None, paced: bool = False) -> list[torch.Tensor]:
    """The loader's batches, cloned. `paced`: after each batch, wait for the prefetch thread to be ahead of the
    consumer (`prefetched`), as a training step's time lets it be; the tests that count cache hits and writes need
    it (a consumer that outruns a starved prefetch thread reads directly, and the thread skips to its step)."""
    out = []
    start = loader.start_step()
    for i, batch in enumerate(loader):
        out.append(batch.clone())
        if paced:
            prefetched(loader, start + i)
        if steps is not None and i + 1 == steps:
            break
    return out


def prefetched(loader: MmapBatchLoader, step: int) -> None:
    """Wait until the prefetch thread has taken in that the consumer is at `step`: the next step is written (or
    writing has stopped: a full filesystem); after the last step, the batches behind the look-back are discarded.
    No time is assumed: a prefetch thread that never gets there ends the test at its timeout."""
    cache = loader.cache
    assert cache is not None
    if step + 1 < loader.end_step:
        while cache.can_write and not cache.has(step + 1):
            time.sleep(0.001)
    else:
        while cache.can_write and min(cache.steps_on_disk(), default=step) < step - loader.lookback:
            time.sleep(0.001)


# ------------------------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 1000, 4097])
def test_index_permutation_is_a_bijection(n: int) -> None:
    images = IndexPermutation(n, seed=3, epoch=1)(np.arange(n))
    assert sorted(images.tolist()) == list(range(n))
    if n >= 64:
        assert not np.array_equal(images, np.arange(n))  # it does shuffle
        assert not np.array_equal(images, IndexPermutation(n, seed=3, epoch=2)(np.arange(n)))


def test_plan_covers_each_epoch_once_and_is_deterministic(plan: GlobalBatchPlan) -> None:
    epoch = [plan.sample_ids(s, r) for s in range(plan.steps_per_epoch) for r in range(plan.dp_size)]
    ids = np.concatenate(epoch)
    assert len(set(ids.tolist())) == len(ids) == plan.steps_per_epoch * plan.global_batch_size
    again = GlobalBatchPlan(400, 4, 2, 5)
    assert np.array_equal(again.sample_ids(123, 1), plan.sample_ids(123, 1))
    assert np.array_equal(GlobalBatchPlan(400, 4, 2, 5, shuffle=False).sample_ids(3, 1), np.arange(28, 32))
    assert plan.samples_consumed(10) == 80


def _best_of(fn: Any, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_resume_position_is_o1_at_step_10_and_step_1_000_000(tmp_path: Path) -> None:
    """A synthetic index of 4.3e9 tokens (a sparse .bin: nothing is written) -> 67M samples of 64 tokens; restoring
    the loader at step 10 and at step 1,000,000 (and a 10^12-sample plan) costs the same."""
    prefix = tmp_path / "huge"
    n_tokens = 1 << 32
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(n_tokens * 2)  # uint16, sparse
    # A valid index: one document per 2^30 tokens (int32 lengths), back to back.
    n_docs = 4
    lengths = np.full(n_docs, 1 << 30, dtype="<i4")
    pointers = np.arange(n_docs, dtype="<i8") * (1 << 31)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + np.array([1], "<u8").tobytes() + bytes([8])
                + np.array([n_docs, n_docs + 1], "<u8").tobytes())
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(n_docs + 1, dtype="<i8").tobytes())
    tokens = IndexedTokens(prefix)
    dataset = TokenSequences(tokens.tokens, 64)
    assert len(dataset) > 60_000_000
    plan = GlobalBatchPlan(len(dataset), micro_batch_size=8, dp_size=4, seed=1)
    assert plan.steps_per_epoch > 1_000_000

    def restore(step: int, p: GlobalBatchPlan = plan) -> None:
        with loader_of(dataset, p, 3, end_step=step + 5, cache=None) as loader:
            loader.load_state_dict({"version": 1, "data_version": "", "step": step,
                                    "samples_consumed": p.samples_consumed(step), "dp_size": 4,
                                    "micro_batch_size": 8})
            batch = next(iter(loader))
            assert batch.shape == (8, 65)

    restore(10)  # warm-up
    t10, t1m = _best_of(lambda: restore(10)), _best_of(lambda: restore(1_000_000))
    huge = GlobalBatchPlan(10**12, micro_batch_size=8, dp_size=4, seed=1)
    t_plan_small = _best_of(lambda: GlobalBatchPlan(1000, 8, 4, 1).sample_ids(10, 3))
    t_plan_huge = _best_of(lambda: huge.sample_ids(10**9, 3))
    # O(1) against O(steps): a resume that walked to step 1,000,000 would take 10^5 times the one at step 10, a plan
    # that touched its 10^12 samples 10^9 times the small one's. 50x leaves room for a loaded machine (the best of
    # 7 runs each; measured here: ratios 0.7-1.4).
    assert t1m < 50 * t10 and t10 < 50 * t1m, (t10, t1m)
    assert t_plan_huge < 50 * t_plan_small, (t_plan_small, t_plan_huge)


# ------------------------------------------------------------------------------------------------------ cache
def test_cached_batches_equal_the_dataset_and_a_replacement_is_served_from_the_cache(
        tmp_path: Path, plan: GlobalBatchPlan) -> None:
    ds = CountingDataset()
    cache = BatchCache(tmp_path, "job1", VERSION, group=0)
    with loader_of(ds, plan, 0, end_step=30, cache=cache, prefetch=4, lookback=2) as loader:
        got = consume(loader, paced=True)
    assert all(torch.equal(g, expected(ds, plan, s)) for s, g in enumerate(got))
    # Every step after the first was written ahead of the consumer (the first may race the thread's start).
    assert loader.stats["hits"] >= 29 and loader.stats["written"] >= 29, loader.stats
    # Look-back: only the last `lookback` + the current step remain.
    assert cache.steps_on_disk() == [27, 28, 29]
    # Privacy: directories 0700, files 0600.
    for d in (cache.job_dir, cache.dir):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in cache.dir.iterdir()} == {0o600}

    # A replacement of this rank at step 28 (the one its predecessor failed on): served without touching the data.
    replacement_ds = CountingDataset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to report
        with loader_of(replacement_ds, plan, 0, end_step=30, start_step=lambda: 28,
                       cache=BatchCache(tmp_path, "job1", VERSION, group=0), prefetch=0) as again:
            first = next(iter(again))
    assert torch.equal(first, expected(ds, plan, 28))
    assert again.first_batch["source"] == "cache" and replacement_ds.reads == 0

    assert remove_job_cache(tmp_path, "job1") and not cache.job_dir.exists()
    assert not remove_job_cache(tmp_path, "job1")


def test_random_access_by_step_prefetches_ahead_and_serves_a_replacement_from_the_cache(
        tmp_path: Path, plan: GlobalBatchPlan) -> None:
    """`batch(step)`: the access NeMo's data module makes (Megatron's sampler reads positions, not an iterator)."""
    ds = CountingDataset()
    cache = BatchCache(tmp_path, "job3", VERSION, group=0)
    with loader_of(ds, plan, 0, end_step=30, cache=cache, prefetch=4, lookback=2) as loader:
        for step in range(10):
            assert torch.equal(loader.batch(step), expected(ds, plan, step))
            prefetched(loader, step)
        while 12 not in cache.steps_on_disk():  # the end of the window at step 9 (the test's timeout bounds it)
            time.sleep(0.001)
        # The window moved with the reads: the step read last and the 3 after it (prefetch=4), 2 behind it.
        assert cache.steps_on_disk() == list(range(7, 13)), cache.steps_on_disk()
        with pytest.raises(IndexError, match="outside"):
            loader.batch(30)
    # A replacement that starts at step 10 reads it from its predecessor's cache, not from the data.
    replacement_ds = CountingDataset()
    with loader_of(replacement_ds, plan, 0, end_step=30, cache=BatchCache(tmp_path, "job3", VERSION, group=0),
                   prefetch=0) as again:
        assert torch.equal(again.batch(10), expected(ds, plan, 10))
    assert again.first_batch["source"] == "cache" and replacement_ds.reads == 0


def test_one_writer_two_readers_share_a_batch_group(tmp_path: Path, plan: GlobalBatchPlan) -> None:
    """A TP/CP group: three ranks need the same micro-batch; one prefetches, two read its files through mmap."""
    writer_ds, reader_ds = CountingDataset(), CountingDataset()
    caches = [BatchCache(tmp_path, "job2", VERSION, group=1) for _ in range(3)]
    # The readers wait for the writer's batch as long as the test may run (not the 2 s default, which a starved
    # prefetch thread can miss on a loaded machine): every batch they serve is then the writer's.
    wait = {"writer": False, "reader_wait_s": 30.0}
    with loader_of(writer_ds, plan, 1, end_step=20, cache=caches[0], prefetch=8) as writer, \
            loader_of(reader_ds, plan, 1, end_step=20, cache=caches[1], **wait) as r1, \
            loader_of(reader_ds, plan, 1, end_step=20, cache=caches[2], **wait) as r2:
        its = [iter(writer), iter(r1), iter(r2)]
        for step in range(20):
            batches = [next(it) for it in its]
            for b in batches:
                assert torch.equal(b, expected(writer_ds, plan, step, 1))
        assert r1.stats["hits"] == r2.stats["hits"] == 20
    assert reader_ds.reads == 0 and writer.stats["written"] == 20


def _corrupt_bin(cache: BatchCache, step: int) -> Path:
    path = cache.dir / f"{step:012d}.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _truncate_bin(cache: BatchCache, step: int) -> Path:
    path = cache.dir / f"{step:012d}.bin"
    os.truncate(path, path.stat().st_size // 2)
    return path


def _garble_index(cache: BatchCache, step: int) -> Path:
    path = cache.dir / f"{step:012d}.json"
    path.write_bytes(path.read_bytes()[:20])
    return path


def _other_job(cache: BatchCache, step: int) -> Path:
    path = cache.dir / f"{step:012d}.json"
    index = json.loads(path.read_text())
    index["job"] = "some-other-job"
    path.write_text(json.dumps(index))
    return path


def _other_data(cache: BatchCache, step: int) -> Path:
    path = cache.dir / f"{step:012d}.json"
    index = json.loads(path.read_text())
    index["version"] = data_version(content="other")
    path.write_text(json.dumps(index))
    return path


@pytest.mark.parametrize(("damage", "why"), [
    (_corrupt_bin, "checksum mismatch"), (_truncate_bin, "truncated"), (_garble_index, "corrupt or truncated"),
    (_other_job, "not this job"), (_other_data, "data version")])
def test_a_bad_cache_file_is_reported_once_and_read_directly(
        tmp_path: Path, plan: GlobalBatchPlan, damage: Any, why: str) -> None:
    ds = CountingDataset()
    with loader_of(ds, plan, 0, end_step=12, cache=BatchCache(tmp_path, "job3", VERSION, 0), prefetch=12,
                   lookback=12) as w:
        consume(w, paced=True)
    assert w.stats["written"] + w.stats["adopted"] >= 11, w.stats  # steps 1-11 at least; 3, 5, 7 are damaged next
    # Pretend the writer died: a replacement starts at step 2 and finds damaged files for steps 3, 5 and 7.
    cache = BatchCache(tmp_path, "job3", VERSION, 0)
    paths = [damage(cache, s) for s in (3, 5, 7)]
    with pytest.warns(CacheFallbackWarning) as caught, \
            loader_of(ds, plan, 0, end_step=12, start_step=2, cache=cache, prefetch=0) as loader:
        got = consume(loader)
    mine = [w for w in caught if issubclass(w.category, CacheFallbackWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert str(paths[0]) in str(mine[0].message) and why in str(mine[0].message)
    assert all(torch.equal(g, expected(ds, plan, s)) for s, g in zip(range(2, 12), got, strict=True))
    assert cache.rejected == 3 and loader.stats["direct"] == 3 and loader.stats["hits"] == 7


def test_a_full_cache_filesystem_is_reported_once_and_read_directly(tmp_path: Path, plan: GlobalBatchPlan) -> None:
    """ENOSPC through the write hook (the same code path a full /dev/shm takes)."""
    written: list[str] = []

    def fills_up(path: str, chunks: Sequence[memoryview]) -> None:
        if len(written) >= 6:  # 3 batches (.bin + .json each), then the filesystem is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write_chunks(path, chunks)
        written.append(path)

    ds = CountingDataset()
    cache = BatchCache(tmp_path, "job4", VERSION, 0, write_file=fills_up)
    with pytest.warns(CacheFallbackWarning, match="no space left") as caught, \
            loader_of(ds, plan, 0, end_step=15, cache=cache, prefetch=4) as loader:
        got = consume(loader, paced=True)
    assert len([w for w in caught if issubclass(w.category, CacheFallbackWarning)]) == 1
    assert all(torch.equal(g, expected(ds, plan, s)) for s, g in enumerate(got))
    assert cache.write_errors == 1 and not cache.can_write
    assert not [p for p in os.listdir(cache.dir) if ".tmp." in p]  # the partial write was removed


def test_a_write_in_flight_is_never_taken_for_a_dead_writers_leftover(tmp_path: Path) -> None:
    """`steps_on_disk` removes the temporaries of writers that died mid-write, never one a live process is writing:
    the prefetch thread's own (CI found a reader of `steps_on_disk` in the writer's process removing the batch the
    thread was about to commit: its write failed and prefetching stopped) or another live process's."""
    cache = BatchCache(tmp_path, "job7", VERSION, group=0)
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {"live": f"{0:012d}.bin.tmp.{os.getpid()}.0a1b2c3d", "parent": f"{0:012d}.json.tmp.{os.getppid()}.00",
             "dead": f"{1:012d}.bin.tmp.{dead.pid}.0a1b2c3d", "no_pid": f"{2:012d}.bin.tmp.x.0a"}
    for name in names.values():
        (cache.dir / name).write_bytes(b"partial")
    assert cache.steps_on_disk() == []
    left = sorted(p for p in os.listdir(cache.dir) if ".tmp." in p)
    assert left == sorted([names["live"], names["parent"]]), left


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "shm"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_real_full_tmpfs_falls_back(tiny_tmpfs: Path, plan: GlobalBatchPlan) -> None:
    big = GlobalBatchPlan(400, micro_batch_size=64, dp_size=1, seed=2)  # 64 x 17 x 8 = 8.7 KB per batch
    ds = CountingDataset()
    cache = BatchCache(tiny_tmpfs, "job5", VERSION, 0)
    with pytest.warns(CacheFallbackWarning, match="ENOSPC"), \
            loader_of(ds, big, 0, end_step=6, cache=cache, prefetch=6, lookback=6) as loader:
        got = consume(loader, paced=True)
    for s, g in enumerate(got):
        assert torch.equal(g, torch.stack([torch.arange(i, i + 17) for i in big.sample_ids(s, 0).tolist()]))
    assert not cache.can_write


def test_an_unsafe_cache_directory_is_not_used(tmp_path: Path, plan: GlobalBatchPlan) -> None:
    job_dir = job_cache_dir(tmp_path, "job6")
    job_dir.mkdir(mode=0o755)
    os.chmod(job_dir, 0o755)  # e.g. planted by someone else, or made readable to others
    ds = CountingDataset()
    with pytest.warns(CacheFallbackWarning, match="not private"):
        cache = BatchCache(tmp_path, "job6", VERSION, 0)
    assert not cache.enabled
    with loader_of(ds, plan, 0, end_step=3, cache=cache) as loader:
        assert all(torch.equal(g, expected(ds, plan, s)) for s, g in enumerate(consume(loader)))
    with pytest.raises(ValueError, match="job id"):
        job_cache_dir(tmp_path, "../escape")


def test_structured_batches_round_trip(tmp_path: Path) -> None:
    cache = BatchCache(tmp_path, "job7", VERSION, 0)
    batch = {"tokens": torch.arange(12).reshape(3, 4), "extra": (torch.ones(3, dtype=torch.bfloat16),
                                                                  [torch.tensor([True, False])])}
    digest = cache.write(0, np.array([1, 2, 3]), batch)
    got = cache.read(0, np.array([1, 2, 3]))
    assert got is not None and got[1] == digest
    out = got[0]
    assert torch.equal(out["tokens"], batch["tokens"]) and out["extra"][0].dtype == torch.bfloat16
    assert isinstance(out["extra"], tuple) and torch.equal(out["extra"][1][0], batch["extra"][1][0])
    out["tokens"] += 1  # copy-on-write: the cached file is unchanged
    again = cache.read(0, np.array([1, 2, 3]))
    assert again is not None and torch.equal(again[0]["tokens"], batch["tokens"])
    with pytest.warns(CacheFallbackWarning, match="other sample ids"):
        assert cache.read(0, np.array([1, 2, 4])) is None  # other sample ids than the plan's: never served


# -------------------------------------------------------------------------------------------- state + ledger
def test_loader_state_carries_version_and_dp_size(plan: GlobalBatchPlan) -> None:
    ds = CountingDataset()
    with loader_of(ds, plan, 1, end_step=40, data_version="v1") as loader:
        state = loader.state_dict(completed_steps=17)
        assert state["samples_consumed"] == 17 * 8 and state["dp_size"] == 2 and state["version"] == 1
    with loader_of(ds, plan, 1, end_step=40, data_version="v1") as resumed:
        resumed.load_state_dict(state)
        assert torch.equal(next(iter(resumed)), expected(ds, plan, 17, 1))
    bigger = GlobalBatchPlan(400, micro_batch_size=4, dp_size=4, seed=5)
    with loader_of(ds, bigger, 1, end_step=40, data_version="v1") as other, \
            pytest.raises(ValueError, match=r"dp_size=2, this job has dp_size=4"):
        other.load_state_dict(state)
    with loader_of(ds, plan, 1, end_step=40, data_version="v2") as other, \
            pytest.raises(ValueError, match="data_version"):
        other.load_state_dict(state)
    with loader_of(ds, plan, 1, end_step=40, data_version="v1") as other, pytest.raises(ValueError, match="version"):
        other.load_state_dict({**state, "version": 99})


def test_ledger_fails_loudly_on_a_repeated_or_skipped_batch(tmp_path: Path, plan: GlobalBatchPlan) -> None:
    ds = CountingDataset()
    with loader_of(ds, plan, 0, end_step=10, cache=BatchCache(tmp_path, "job8", VERSION, 0)) as loader:
        it = iter(loader)
        b0, b1, b2 = next(it), next(it), next(it)
        loader.check_batch(0, b0)
        with pytest.raises(DataOrderError, match="batch of step 0"):
            loader.check_batch(1, b0)  # repeated
        loader.check_batch(1, b1)
        with pytest.raises(DataOrderError, match="skipped"):
            loader.check_batch(3, next(it))  # step 2 never trained
        with pytest.raises(DataOrderError, match="no batch for this step"):
            loader.check_batch(9, b2)  # a position restored wrong
    # The plain loader records too.
    plain = LedgeredLoader([b0, b1], start_step=lambda: 4)
    it2 = iter(plain)
    plain.check_batch(4, next(it2))
    with pytest.raises(DataOrderError):
        plain.check_batch(5, b0)
