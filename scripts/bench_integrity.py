#!/usr/bin/env python3
"""The cross-replica integrity check's fault-free cost on the benchmark job (scripts/bench_user_job.py: 4 CPU ranks,
2 optimizer instances, a 1024-wide MLP), as ratios within one run.

Per round, interleaved: the job with the check every --every steps (the default interval), and with it off
(--integrity-every 0). Reported:

  overhead_pct    (train time with the check / without - 1) x 100, median over rounds (train time: summary.json
                  train_s, first to last step; noisy on a shared 2-core machine)
  check_pct       the checks' time (summary.json integrity.check_s, on rank 0: digests + the all-gather, whose wait
                  for the slowest rank the next collective would otherwise absorb) / train time x 100
  digest_pct      the digests' own time (integrity.digest_s) / train time x 100: the direct cost
  digest_gb_per_s bytes digested per second of digest (parameters + shard), and a CRC-32 of one 256 MB buffer
  nan_guard_pct   the NaN guard's own cost, always on (integrity.nan_guard_s: rank 0's gradient norm, every
                  step) / train time x 100; its other cost, one float a rank more in the gradient all-reduce, is
                  inside both runs' train times

    python scripts/bench_integrity.py --rounds 3 --out docs/bench_integrity_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nemo_checkpointless.state.integrity import crc

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "scripts" / "bench_user_job.py"


def run(run_dir: Path, every: int, steps: int) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           "--integrity-every", str(every), str(JOB), "--mode", "checkpointless", "--max-steps", str(steps)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True,
                          timeout=1200, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr.decode()[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=210)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--work", default="runs/bench_integrity")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    buf = torch.randn(64 << 20)  # 256 MB
    t0 = time.perf_counter()
    crc([buf])
    raw_gbps = buf.numel() * 4 / (time.perf_counter() - t0) / 1e9
    rows = []
    for i in range(args.rounds):
        on = run(Path(args.work) / f"on{i}", args.every, args.steps)
        off = run(Path(args.work) / f"off{i}", 0, args.steps)
        integ = on["integrity"]
        row = {"train_s_on": on["train_s"], "train_s_off": off["train_s"],
               "overhead_pct": round((on["train_s"] / off["train_s"] - 1) * 100, 2),
               "checks": integ["checks"], "check_s": integ["check_s"],
               "check_pct": round(integ["check_s"] / on["train_s"] * 100, 3),
               "digest_pct": round(integ["digest_s"] / on["train_s"] * 100, 3),
               "nan_guard_pct": round(off["integrity"]["nan_guard_s"] / off["train_s"] * 100, 3),
               "digest_gb_per_s": integ["digest_gb_per_s"], "bytes_per_check": integ["bytes_digested"] // max(
                   1, integ["checks"]), "equal": on["state_sha256"] == off["state_sha256"]}
        rows.append(row)
        print(f"round {i}: {json.dumps(row)}", flush=True)
    out = {"machine": f"{os.cpu_count()} cores", "steps": args.steps, "every_n_steps": args.every, "rounds": rows,
           "overhead_pct_median": statistics.median(r["overhead_pct"] for r in rows),
           "check_pct_median": statistics.median(r["check_pct"] for r in rows),
           "digest_pct_median": statistics.median(r["digest_pct"] for r in rows),
           "nan_guard_pct_median": statistics.median(r["nan_guard_pct"] for r in rows),
           "digest_gb_per_s_median": statistics.median(r["digest_gb_per_s"] for r in rows),
           "crc32_256mb_gb_per_s": round(raw_gbps, 3)}
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
