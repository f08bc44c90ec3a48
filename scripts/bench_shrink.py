#!/usr/bin/env python3
"""No spare left: what a fault costs when the job shrinks (`--shrink`) against waiting for a cold replacement, and
against a warm spare, on a user's own Lightning script (tests/scripts/user_lightning.py: dropout, AdamW, an LR
schedule, a shuffled DataLoader; 4 CPU ranks, 2 optimizer instances).

One invocation, every figure a ratio within it (the machine is noisy). Per round, interleaved:

  fault_free   no fault
  warm_spare   --spares 1, rank 1 SIGKILLed at --kill-step (fault plan): p2p from its replica
  shrink       --shrink, no spare: the job goes on with ranks 2, 3 (rank 0 parked) and grows back p2p when the
               spare started for rank 1 is ready
  cold_start   no spare, no shrink: the job waits for a new process for rank 1 (imports, model, data) to join

  lost_s        the run's wall time - the fault-free run's of the same round (the job time the fault cost)
  recover_s     summary.json: fault -> every rank completed a step again (for shrink: the shrink's, and the grow's)
  shrunk_steps  steps trained on the shrunk world (grow step - shrink step)
  same_samples  data_sha256 equal to the fault-free run's (every rank's batch of every step)
  loss_max_rel  the largest relative difference of the held-out loss, over every step, from the fault-free run

    python scripts/bench_shrink.py --rounds 2 --out docs/bench_shrink_<date>.json
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

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
MODES = {
    "fault_free": [],
    "warm_spare": ["--spares", "1", "--fault", "kill:1:{k}"],
    "shrink": ["--shrink", "--fault", "kill:1:{k}"],
    "cold_start": ["--fault", "kill:1:{k}"],
}


def run(run_dir: Path, flags: list[str], steps: int, sleep: float) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4", "--run-dir", str(run_dir),
           "--collective-timeout", "30", *flags, str(SCRIPT), "--max-steps", str(steps), "--step-sleep", str(sleep),
           "--eval-loss"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, timeout=900, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout.decode()[-3000:]}"
                         f"{proc.stderr.decode()[-3000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    summary["wall"] = wall
    lines = (line.split() for line in (run_dir / "eval_loss_rank3.txt").read_text().splitlines())
    summary["curve"] = {int(s): float(v) for s, v in lines}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--work", default="runs/bench_shrink")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for i in range(args.rounds):
        ref: dict[str, Any] = {}
        for mode, flags in MODES.items():
            s = run(Path(args.work) / f"{mode}{i}", [f.format(k=args.kill_step) for f in flags], args.steps,
                    args.step_sleep)
            if mode == "fault_free":
                ref = s
            row: dict[str, Any] = {
                "wall_s": round(s["wall"], 3),
                "lost_s": round(s["wall"] - ref["wall"], 3),
                "final_step": s["final_step"],
                "same_samples": s["data_sha256"] == ref["data_sha256"],
                "equal_state": s["state_sha256"] == ref["state_sha256"],
                "loss_max_rel": max(abs(s["curve"][k] - ref["curve"][k]) / abs(ref["curve"][k]) for k in ref["curve"]),
                "recover_s": [r["recover_s"] for r in s["recoveries"]],
                "paths": [r["path"] for r in s["recoveries"]],
                "replacement": [r["replacement"] for r in s["recoveries"]],
                "reshapes": s["reshapes"],
            }
            if s["reshapes"]:
                steps = [r["step"] for r in s["reshapes"]]
                row["shrunk_steps"] = (steps[1] - steps[0]) if len(steps) > 1 else args.steps - steps[0]
            rows[mode].append(row)
            print(f"round {i} {mode}: {json.dumps(row)}", flush=True)
    out: dict[str, Any] = {"machine": f"{os.cpu_count()} cores", "steps": args.steps, "kill_step": args.kill_step,
                           "step_sleep_s": args.step_sleep, "rounds": rows, "median": {}}
    for mode in MODES:
        if mode == "fault_free":
            continue
        lost = [r["lost_s"] for r in rows[mode]]
        out["median"][mode] = {"lost_s": round(statistics.median(lost), 3), "lost_range_s": [min(lost), max(lost)],
                               "recover_s": [statistics.median(r["recover_s"][i] for r in rows[mode])
                                             for i in range(len(rows[mode][0]["recover_s"]))],
                               "same_samples": all(r["same_samples"] for r in rows[mode]),
                               "equal_state": all(r["equal_state"] for r in rows[mode]),
                               "loss_max_rel": max(r["loss_max_rel"] for r in rows[mode])}
    cold, shrink = out["median"]["cold_start"]["lost_s"], out["median"]["shrink"]["lost_s"]
    out["lost_ratio_cold_over_shrink"] = round(cold / shrink, 2) if shrink > 0 else None
    print(json.dumps(out["median"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
