#!/usr/bin/env python3
"""Packing benchmark: `state.packing.pack` + `unpack` against `safetensors.torch.save` + `load`, in one run.

The state is shaped like a rank's: a few fp32 tensors of 1-50 MB (flat params, optimizer moments) and a few dozen
small ones (scalars, RNG states, step counters). Each repetition times, in turn:

  pack          pack(tensors, meta) -> uint8 tensor, then unpack(buffer) -> tensors, meta
  st_bytes      safetensors.torch.save(tensors, metadata) -> bytes, then safetensors.torch.load(bytes)
  st_tensor     the same, plus what the p2p transfer would add to use it: bytes -> a uint8 tensor to send, and the
                received uint8 tensor -> bytes for `load`

Reported: the median seconds of each over --repeats, and each safetensors variant's ratio to `pack` (> 1: slower).

    OMP_NUM_THREADS=1 python scripts/bench_packing.py --repeats 9 --out runs/bench/packing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from nemo_checkpointless.state.packing import pack, unpack

MB = 1 << 20


def rank_state(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, mb in (("param.flat", 50), ("shard.exp_avg", 12), ("shard.exp_avg_sq", 12), ("shard.main", 12),
                     ("grad.side", 1)):
        tensors[name] = torch.randn(mb * MB // 4, generator=g)
    for i in range(24):
        tensors[f"small.{i:02d}"] = torch.randn(1 + 7 * i, generator=g)
    tensors["rng.torch"] = torch.randint(0, 255, (5056,), dtype=torch.uint8, generator=g)
    tensors["step"] = torch.tensor(1234, dtype=torch.int64)
    meta = {"step": 1234, "lr_schedulers": [{"last_epoch": 1234, "base_lrs": [3e-4]}], "rng": {"python": [3, 1]}}
    return tensors, meta


def run_pack(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    out, _ = unpack(pack(tensors, meta))
    assert len(out) == len(tensors)


def run_st_bytes(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    data = safetensors.torch.save(tensors, {"meta": json.dumps(meta)})
    out = safetensors.torch.load(data)
    assert len(out) == len(tensors)


def run_st_tensor(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    data = safetensors.torch.save(tensors, {"meta": json.dumps(meta)})
    wire = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # what would be sent
    out = safetensors.torch.load(wire.numpy().tobytes())  # what the receiver would do with what it got
    assert len(out) == len(tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tensors, meta = rank_state()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    cases: dict[str, Callable[[dict[str, torch.Tensor], dict[str, Any]], None]] = {
        "pack": run_pack, "st_bytes": run_st_bytes, "st_tensor": run_st_tensor}
    for fn in cases.values():  # warm-up
        fn(tensors, meta)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.repeats):  # interleaved, so a slow moment of the machine hits every case alike
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn(tensors, meta)
            times[name].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "state_mb": round(total / MB, 1), "tensors": len(tensors), "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "median_s": {k: round(v, 4) for k, v in median.items()},
        "ratio_to_pack": {k: round(v / median["pack"], 2) for k, v in median.items() if k != "pack"},
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
