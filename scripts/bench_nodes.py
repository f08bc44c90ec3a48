"""Whole-node loss against a single-rank kill, on "nodes" that are network namespaces of this machine.

    sudo OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_nodes.py [--trials 3] [--out FILE]

The job: the user's Lightning script (`tests/scripts/user_lightning.py`), 2 nodes x 2 ranks, N=2, one spare per
node, the store on its own (`checkpointless-store` in a namespace of its own), `--node-lease 1.5`. Per trial, in
one run of this script (ratios; the machine is noisy): a fault-free run; node 1 killed whole (every process of its
namespace at once) at step 8; the same with a spare node (a third namespace whose agent holds 2 spares:
`--spare-nodes 1`); rank 3 killed alone at step 8 (the fault plan). Reports, per kind: `detect_s` (the
fault to the survivors told: for a node, from its last heartbeat, so it includes the lease), `recover_s` (the
fault to the first step completed by every rank), the job's wall time against the fault-free run's, and whether
the final state equals the fault-free run's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import job_progress  # noqa: E402
from netns import Fabric, netns_error  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
STEPS = 30
PORT = 29400
LEASE_S = 1.5


def run(fabric: Fabric, run_dir: Path, kill_node: bool, faults: tuple[str, ...] = (),
        spare_node: bool = False) -> dict[str, Any]:
    endpoint = f"{fabric.addr['store']}:{PORT}"
    agents = []
    extra = ("--spare-nodes", "1") if spare_node else ()
    for n in (0, 1, 2) if spare_node else (0, 1):
        argv = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nnodes", "2", "--node-rank", str(n), *extra,
                "--rdzv-endpoint", endpoint, "--rdzv-backend", "external", "--nproc-per-node", "2", "--spares", "1",
                "--node-lease", str(LEASE_S), "--collective-timeout", "8", "--run-dir", str(run_dir), *faults,
                str(SCRIPT), "--max-steps", str(STEPS), "--step-sleep", "0.05", "--devices", "2", "--num-nodes", "2"]
        run_dir.mkdir(parents=True, exist_ok=True)
        agents.append(fabric.start(f"node{n}", argv, run_dir.parent / f"{run_dir.name}.node{n}.log"))
    if kill_node:
        while job_progress(run_dir) < 8:
            time.sleep(0.01)
        fabric.kill_node("node1")
    for node, agent in enumerate(agents):
        if not (kill_node and node == 1) and agent.wait(timeout=300) != 0:
            raise SystemExit(f"the job failed: see {run_dir.parent}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--work", default="/tmp/bench_nodes")
    args = parser.parse_args()
    why = netns_error()
    if why:
        print(f"bench_nodes: {why}", file=sys.stderr)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict[str, Any]]] = {"fault_free": [], "node": [], "node_with_spare_node": [], "rank": []}
    for trial in range(args.trials):
        for kind in rows:
            fabric = Fabric(["store", "node0", "node1", "node2"])
            try:
                fabric.start("store", [sys.executable, "-m", "nemo_checkpointless.cli.store", "--host",
                                       fabric.addr["store"], "--port", str(PORT)], work / f"store{trial}{kind}.log")
                time.sleep(1.0)
                faults = ("--fault", "kill:3:8") if kind == "rank" else ()
                summary = run(fabric, work / f"{kind}{trial}", kind.startswith("node"), faults,
                              spare_node=kind == "node_with_spare_node")
            finally:
                fabric.close()
            rec = summary["recoveries"][0] if summary["recoveries"] else {}
            rows[kind].append({"wall_s": summary["wall_s"], "state_sha256": summary["state_sha256"],
                               **{k: rec.get(k) for k in ("fault_kind", "path", "detect_s", "recover_s",
                                                          "steps_lost", "failed_ranks", "replacement")}})
            print(kind, trial, json.dumps(rows[kind][-1]), flush=True)
    reference = rows["fault_free"][0]["state_sha256"]
    base = statistics.median(r["wall_s"] for r in rows["fault_free"])
    out: dict[str, Any] = {"lease_s": LEASE_S, "steps": STEPS, "trials": args.trials,
                           "fault_free_wall_s": base, "runs": rows}
    for kind in ("node", "node_with_spare_node", "rank"):
        runs = rows[kind]
        out[kind] = {"detect_s": statistics.median(r["detect_s"] for r in runs),
                     "recover_s": statistics.median(r["recover_s"] for r in runs),
                     "recover_s_range": [min(r["recover_s"] for r in runs), max(r["recover_s"] for r in runs)],
                     "job_time_lost_s": round(statistics.median(r["wall_s"] for r in runs) - base, 3),
                     "paths": sorted({r["path"] for r in runs}),
                     "equal_to_fault_free": all(r["state_sha256"] == reference for r in runs)}
    out["recover_ratio_node_over_rank"] = round(out["node"]["recover_s"] / out["rank"]["recover_s"], 2)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
