#!/usr/bin/env python3
"""Hangs found by the progress watchdog, with a safe collective timeout: detection and downtime per kind of hang.

A user's own Lightning script (tests/scripts/user_lightning.py; 4 CPU ranks, 2 optimizer instances, 1 warm spare)
under `checkpointless-run --collective-timeout 60`, the watchdog's default deadline (max(5 s, 10 x p95 step time)).
Rank 1 hangs as it starts step --fault-step, in one of four ways (fault plan kinds):

  hang    SIGSTOP (state T)
  gil     blocked in a native call that holds the GIL (libc pause through ctypes.PyDLL)
  spin    an endless Python loop inside the step (busy, no progress)
  stall   asleep before the step's collectives (idle, behind the others)

Per kind, --runs runs: detect_s (fault -> the survivors start recovering), recover_s (fault -> every rank completed
a step again), back_s (fault -> every rank completed the fault step: the downtime), the path, and whether the run
ends bitwise-equal to the fault-free run (state_sha256). Medians and ranges in the JSON.

    python scripts/bench_hangs.py --runs 3 --out docs/bench_hangs_<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
KINDS = ("hang", "gil", "spin", "stall")


def run(run_dir: Path, flags: list[str], steps: int) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4", "--spares", "1",
           "--run-dir", str(run_dir), "--collective-timeout", "60", *flags, str(SCRIPT), "--max-steps", str(steps),
           "--step-sleep", "0.05"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT, capture_output=True,
                          timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr.decode()[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fault-step", type=int, default=15)
    parser.add_argument("--work", default="runs/bench_hangs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(args.work)
    reference = run(work / "ref", [], args.steps)
    out: dict[str, Any] = {"machine": f"{os.cpu_count()} cores", "collective_timeout_s": 60, "steps": args.steps,
                           "fault_step": args.fault_step, "kinds": {}}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for i in range(args.runs):
        for kind in KINDS:
            s = run(work / f"{kind}{i}", ["--fault", f"{kind}:1:{args.fault_step}"], args.steps)
            [rec] = s["recoveries"]
            row = {"detect_s": rec["detect_s"], "recover_s": rec["recover_s"], "back_s": rec["back_at_fault_step_s"],
                   "path": rec["path"], "why": rec.get("hang", {}).get("1"), "deadline_s": s["hang_deadline_s"],
                   "equal": s["state_sha256"] == reference["state_sha256"]}
            rows[kind].append(row)
            print(f"{kind} run {i}: {json.dumps(row)}", flush=True)
    for kind, rs in rows.items():
        def stat(key: str, rs: list[dict[str, Any]] = rs) -> dict[str, float]:
            values = [r[key] for r in rs]
            return {"median": statistics.median(values), "min": min(values), "max": max(values)}

        out["kinds"][kind] = {"detect_s": stat("detect_s"), "recover_s": stat("recover_s"), "back_s": stat("back_s"),
                              "paths": sorted({r["path"] for r in rs}), "all_equal": all(r["equal"] for r in rs),
                              "runs": rs}
    print(json.dumps({k: {m: v[m] for m in ("detect_s", "back_s", "all_equal")} for k, v in out["kinds"].items()},
                     indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
