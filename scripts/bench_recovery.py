#!/usr/bin/env python3
"""Recovery benchmark: checkpointless p2p recovery vs. a whole-job restart from the persistent checkpoint.

Everything is measured in one invocation, on the same job (tiny Llama, 4 CPU ranks, N=2, checkpoint every 10
steps), with the same fault plan (K SIGKILLs, GAP steps apart, on rotating ranks):

  reference    fault-free run with replication, a hot spare and checkpoints (steps/s; the digests to match)
  plain        fault-free run with N=1, no spare, no checkpoint (the fault-free cost of being ready)
  p2p          launcher.on_failure=recover: healthy ranks stay, the failed one is replaced from a replica
  restart      launcher.on_failure=restart_all: every rank restarts from the newest checkpoint (today's practice)

For each fault: `recover_s` (fault -> first completed step after recovery), `back_at_fault_step_s` (fault -> the
step the fault interrupted is completed) and what the user pays: `lost_s`, the job's extra wall time charged to
that fault against the step rate just before it (`restart.cost`; it counts a slower job after the fault and the
steps a restart redoes), with the step rates over the 20 steps before and after. Per run, `lost_vs_reference_s`
is the same cost measured the other way: (training time - the fault-free reference's) / faults. Ratios are
restart / p2p of the medians. Figures go to stdout and to the JSON file given by --out.

    python scripts/bench_recovery.py --kills 5 --out runs/bench/recovery.json
    python scripts/bench_recovery.py --engine nemo --kills 3 --out runs/bench/recovery_nemo.json   # [nemo] extra
    python scripts/bench_recovery.py --engine nemo --kills 3 --target gather   # kills as the all-gather starts
    python scripts/bench_recovery.py --engine nemo --kills 3 --tp 2   # tensor parallel: DP=2, N=2

`--engine nemo` runs `recipe=tiny_llama_nemo` (NeMo 2 + megatron-core on gloo, with the test suite's CPU shim:
`launcher.preload=[nemo_shim]`, tests/ on PYTHONPATH) with kills GAP_NEMO steps apart.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GAP = 40  # steps between kills: time for the refilled spare to finish its imports on 2 busy cores
GAP_NEMO = 120  # a refilled NeMo spare needs ~25 s on 2 busy cores (imports, warm-up); a step is ~0.25 s
TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS.parent))
from nemo_checkpointless.restart.cost import StepTimes, fault_costs  # noqa: E402


def run(run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    # A fresh directory: a whole-job restart resumes from the newest checkpoint it finds there.
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", "trainer.progress_bar=false",
           f"run.dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"bench: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    summary["bench_wall_s"] = round(time.perf_counter() - t0, 2)
    return summary


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--dir", default="runs/bench")
    parser.add_argument("--out", default=None)
    parser.add_argument("--engine", choices=("lightning", "nemo"), default="lightning")
    parser.add_argument("--target", choices=("start", "gather"), default="start",
                        help="where each kill lands: the step's start, or after its gradient all-reduce as the "
                             "parameter all-gather starts (the killed rank's instance partners are rolled forward)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel size of every run (parallel.tp; 2 with 4 ranks: DP=2, N=2)")
    args = parser.parse_args()
    base = Path(args.dir).absolute() / args.engine
    gap = GAP_NEMO if args.engine == "nemo" else GAP
    steps = gap * args.kills + 10
    faults = [(15 + gap * i, (1 + i) % 4) for i in range(args.kills)]
    target = ",target:gather" if args.target == "gather" else ""
    plan = "[" + ",".join(f"{{kind:kill,rank:{r},step:{s}{target}}}" for s, r in faults) + "]"
    engine = ["recipe=tiny_llama_nemo", "launcher.preload=[nemo_shim]"] if args.engine == "nemo" else []
    if args.tp > 1:
        engine.append(f"parallel.tp={args.tp}")
    common = [*engine, f"trainer.max_steps={steps}", "checkpoint.every_n_steps=10", "replication.num_instances=2",
              "replication.spares=1"]
    results = {
        "reference": run(base / "reference", common),
        "plain": run(base / "plain", [*engine, f"trainer.max_steps={steps}", "replication.num_instances=1",
                                      "replication.spares=0", "checkpoint.every_n_steps=0"]),
        "p2p": run(base / "p2p", [*common, f"fault.plan={plan}"]),
        "restart": run(base / "restart", [*common, f"fault.plan={plan}", "launcher.on_failure=restart_all"]),
    }
    ref = results["reference"]
    report: dict[str, Any] = {"job": {"engine": args.engine, "steps": steps, "faults": faults, "target": args.target,
                                      "tp": args.tp, "world_size": ref["world_size"]}, "runs": {}}
    for name, s in results.items():
        recs = s["recoveries"]
        report["runs"][name] = {
            "steps_per_s": s["steps_per_s"],
            "wall_s": s["wall_s"],
            "equal_to_reference": s["state_sha256"] == ref["state_sha256"] and s["data_sha256"] == ref["data_sha256"],
            "paths": [r["path"] for r in recs],
            "rolled_forward": [r.get("rolled_forward", []) for r in recs],
            "recover_s": [r["recover_s"] for r in recs],
            "back_at_fault_step_s": [r["back_at_fault_step_s"] for r in recs],
            "detect_s": [r["detect_s"] for r in recs],
            "steps_lost": [r["steps_lost"] for r in recs],
            "lost_s": [r.get("lost_s") for r in recs],
            "steps_per_s_before": [r.get("steps_per_s_before") for r in recs],
            "steps_per_s_after": [r.get("steps_per_s_after") for r in recs],
            "after_over_before": [round(r["steps_per_s_after"] / r["steps_per_s_before"], 3)
                                  if r.get("steps_per_s_after") and r.get("steps_per_s_before") else None
                                  for r in recs],
            "replacement": [next(iter(r["replacement"].values()), None) for r in recs],
            "train_s": s["train_s"],
            "median_recover_s": median([r["recover_s"] for r in recs]),
            "median_back_at_fault_step_s": median([r["back_at_fault_step_s"] for r in recs]),
            "median_lost_s": median([r.get("lost_s") for r in recs]),
            "lost_vs_reference_s": (round((s["train_s"] - ref["train_s"]) / len(recs), 3)
                                    if recs and s["train_s"] and ref["train_s"] else None),
        }
    p2p, restart = report["runs"]["p2p"], report["runs"]["restart"]
    ratio = {}
    for key in ("median_recover_s", "median_back_at_fault_step_s", "median_lost_s", "lost_vs_reference_s"):
        if p2p[key] and restart[key] and p2p[key] > 0:
            ratio[key] = round(restart[key] / p2p[key], 1)
    report["restart_over_p2p"] = ratio
    # Both measures include the step in flight, which a fault-free run spends too: also compare the time beyond it.
    step_s = 1 / ref["steps_per_s"]
    extra = {name: round(report["runs"][name]["median_back_at_fault_step_s"] - step_s, 3)
             for name in ("p2p", "restart")}
    report["fault_free_step_s"] = round(step_s, 3)
    report["median_extra_over_a_step_s"] = extra
    if extra["p2p"] > 0:
        report["restart_over_p2p"]["extra_over_a_step"] = round(extra["restart"] / extra["p2p"], 1)
    # The noise floor of the rate comparison: the same before/after windows, at the same steps, in the fault-free
    # reference run.
    times = StepTimes.parse("".join(f"{row['step']} {row['first_t']};" for row in
                                    csv.DictReader((base / "reference" / "steps.csv").open())))
    noise = fault_costs(times, [step for step, _ in faults], ref["final_step"])
    report["reference_after_over_before"] = [round(c.rate_after / c.rate_before, 3)
                                             if c.rate_after and c.rate_before else None for c in noise]
    # The goal: a p2p fault costs the job at most twice its recovery window, and the job keeps its step rate.
    if p2p["median_lost_s"] is not None and p2p["median_recover_s"]:
        report["p2p_lost_over_recover"] = round(p2p["median_lost_s"] / p2p["median_recover_s"], 2)
    report["fault_free_overhead"] = round(results["plain"]["steps_per_s"] / ref["steps_per_s"] - 1, 3)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
