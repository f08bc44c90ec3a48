"""Run the NeMo tiny Llama under our launcher (4 ranks, 2 instances, hot spares), with or without a killed rank.

    python tests/nemo_recovery_run.py RUN_DIR STEPS [RANK:STEP ...]

Prints the launcher's summary (JSON). Each worker is `tests/nemo_recovery_worker.py`; see it for the recovery.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from nemo_checkpointless.config import Config, FaultConfig, FaultSpec, LauncherConfig, ReplicationConfig, TrainerConfig
from nemo_checkpointless.launcher.local import run_local

NUM_INSTANCES = 2
PG_TIMEOUT_S = 8.0  # the gloo timeout of NeMo's collectives: how long a rank away from the dead one waits


def main() -> None:
    run_dir, steps = Path(sys.argv[1]), int(sys.argv[2])
    faults = [FaultSpec("kill", int(r), int(s)) for r, s in (a.split(":") for a in sys.argv[3:])]
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = Config(recipe_name="tiny_llama_nemo_cpu", trainer=TrainerConfig(devices=4, max_steps=steps),
                 replication=ReplicationConfig(num_instances=NUM_INSTANCES, spares=1 if faults else 0),
                 fault=FaultConfig(plan=faults), launcher=LauncherConfig(collective_timeout_s=120))
    (run_dir / "nemo_job.json").write_text(json.dumps({
        "steps": steps, "num_instances": NUM_INSTANCES, "pg_timeout_s": PG_TIMEOUT_S, "engine_timeout_s": 120,
        "faults": [{"rank": f.rank, "step": f.step} for f in faults]}))
    # The workers run `python -m nemo_recovery_worker` (a `tests` package elsewhere on the path would shadow ours).
    here = Path(__file__).resolve().parent
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(here), str(here.parent),
                                                             os.environ.get("PYTHONPATH")]))
    summary = run_local(cfg, run_dir, worker_module="nemo_recovery_worker")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
