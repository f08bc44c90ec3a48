#!/usr/bin/env python3
"""Data benchmark (tier 2): the shared-memory batch cache vs. a plain `DataLoader`, ratios measured in one run.

On a synthetic token file (Megatron .bin/.idx, random uint16 tokens), one data-parallel rank of DP=8:

  first batch after a recovery at step R (median of --repeats):
    cache          a new `MmapBatchLoader` on the job's cache, which the failed rank's prefetcher had filled
    plain_rebuilt  a new `DataLoader(num_workers=2)` whose sampler starts at R by index arithmetic
    plain_replay   the same, but the sampler is replayed from step 0 and skipped to R (what most systems do)
  steady-state throughput (batches/s over --batches), no compute and with a simulated step of --step-ms:
    mmap (prefetch thread + cache) vs. plain DataLoader with 2 workers and with 0 workers

    python scripts/bench_data.py --out runs/bench/data.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_checkpointless.data.cache import BatchCache, data_version, remove_job_cache
from nemo_checkpointless.data.indexed import IndexedTokens, IndexedTokensWriter
from nemo_checkpointless.data.loader import MmapBatchLoader
from nemo_checkpointless.data.sampling import GlobalBatchPlan, RankBatchSampler, TokenSequences

DP, DP_RANK = 8, 0


class _ReplayedSampler(torch.utils.data.Sampler[list[int]]):
    """Iterates the plan from step 0 and drops the first `skip` micro-batches (a replayed position)."""

    def __init__(self, plan: GlobalBatchPlan, skip: int, end: int) -> None:
        self.inner = RankBatchSampler(plan, DP_RANK, 0, end)
        self.skip = skip

    def __iter__(self) -> Iterator[list[int]]:
        for i, ids in enumerate(self.inner):
            if i >= self.skip:
                yield ids

    def __len__(self) -> int:
        return len(self.inner) - self.skip


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _throughput(batches: Iterator[Any], n: int, step_s: float) -> float:
    next(batches)  # started (workers up, cache primed): steady state from here
    t0 = time.perf_counter()
    for _ in range(n):
        next(batches)
        if step_s:
            time.sleep(step_s)  # a training step (releases the GIL, as torch kernels do)
    return n / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 25, help="tokens in the synthetic file")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--step", type=int, default=1500, help="recovery step R")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--cache-root", default=None, help="default /dev/shm")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "tokens"
        rng = np.random.default_rng(0)
        with IndexedTokensWriter(prefix, np.uint16) as w:
            for _ in range(args.tokens // (1 << 20)):
                w.add_document(rng.integers(0, 50_000, 1 << 20, dtype=np.uint16))
        tokens = IndexedTokens(prefix)
        dataset = TokenSequences(tokens.tokens, args.seq_len)
        plan = GlobalBatchPlan(len(dataset), args.micro_batch, DP, seed=1)
        end = 1 << 40  # steps run on across epochs (the plan wraps them)
        R = args.step
        version = data_version(content=tokens.content_id(), seq_len=args.seq_len, micro=args.micro_batch, dp=DP)
        job = f"bench{int(time.time())}"
        root = args.cache_root

        def cache() -> BatchCache:
            return BatchCache(root, job, version, group=DP_RANK)

        try:
            # The rank that fails: it trains up to step R with its prefetcher running, then dies.
            failed = MmapBatchLoader(dataset, plan, DP_RANK, end, start_step=R - 4, cache=cache(), prefetch=16)
            for i, _ in enumerate(failed):
                time.sleep(0.01)
                if i == 4:
                    break
            failed.close()

            def first_cache() -> None:
                loader = MmapBatchLoader(dataset, plan, DP_RANK, end, start_step=R, cache=cache(), prefetch=16)
                batch = next(iter(loader))
                assert loader.first_batch["source"] == "cache"
                loader.close()
                assert batch.shape == (args.micro_batch, args.seq_len + 1)

            def first_plain(sampler: torch.utils.data.Sampler[list[int]]) -> None:
                dl = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2)
                it = iter(dl)
                next(it)
                del it  # shuts the workers down

            expected = dataset[int(plan.sample_ids(R, DP_RANK)[0])]
            check = MmapBatchLoader(dataset, plan, DP_RANK, end, start_step=R, cache=cache(), prefetch=0)
            assert torch.equal(next(iter(check))[0], expected)
            check.close()

            t_cache = _median_s(first_cache, args.repeats)
            t_rebuilt = _median_s(lambda: first_plain(RankBatchSampler(plan, DP_RANK, R, end)), args.repeats)
            t_replay = _median_s(lambda: first_plain(_ReplayedSampler(plan, R, end)), args.repeats)
        finally:
            remove_job_cache(root, job)

        results: dict[str, Any] = {
            "setup": {"tokens": args.tokens, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "dp": DP,
                      "batch_bytes": args.micro_batch * (args.seq_len + 1) * 8, "recovery_step": R,
                      "torch_threads": 1},
            "first_batch_after_recovery_ms": {"cache": round(1e3 * t_cache, 3),
                                              "plain_rebuilt": round(1e3 * t_rebuilt, 3),
                                              "plain_replay": round(1e3 * t_replay, 3)},
            "recovery_speedup_vs_plain_rebuilt": round(t_rebuilt / t_cache, 1),
            "recovery_speedup_vs_plain_replay": round(t_replay / t_cache, 1),
        }

        steady: dict[str, dict[str, float]] = {}
        for label, step_s in (("no_compute", 0.0), (f"step_{args.step_ms:g}ms", args.step_ms / 1e3)):
            row = {}
            job_s = f"{job}s{int(step_s * 1e6)}"
            loader = MmapBatchLoader(dataset, plan, DP_RANK, end, cache=BatchCache(root, job_s, version, DP_RANK),
                                     prefetch=16, verify=False)
            try:
                row["mmap"] = _throughput(iter(loader), args.batches, step_s)
            finally:
                loader.close()
                remove_job_cache(root, job_s)
            for workers in (2, 0):
                dl = torch.utils.data.DataLoader(dataset, batch_sampler=RankBatchSampler(plan, DP_RANK, 0, end),
                                                 num_workers=workers)
                row[f"plain_workers{workers}"] = _throughput(iter(dl), args.batches, step_s)
            steady[label] = {k: round(v, 1) for k, v in row.items()}
            steady[label]["ratio_mmap_vs_plain_workers2"] = round(row["mmap"] / row["plain_workers2"], 2)
            steady[label]["ratio_mmap_vs_plain_workers0"] = round(row["mmap"] / row["plain_workers0"], 2)
        results["steady_state_batches_per_s"] = steady

    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
