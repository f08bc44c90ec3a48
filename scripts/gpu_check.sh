#!/usr/bin/env bash
# The GPU check of `CheckpointlessStrategy` (issue 10, item 6), prepared for a machine with CUDA GPUs: the user's
# Lightning script (tests/scripts/user_lightning.py) on G = min(4, GPUs) ranks, one GPU each (NCCL for the training
# collectives, gloo for the recovery), fault-free and then with rank 1 killed at step 12 (a warm spare replaces it,
# p2p from its replica); every rank's parameters and optimizer shard must equal the fault-free run's.
#   bash scripts/gpu_check.sh [OUT_DIR]          (about 2 minutes once torch with CUDA is installed)
# Needs at least 2 GPUs (NCCL does not put two ranks of one communicator on one GPU); with one it runs the
# single-GPU part only (one rank, fault-free, on CUDA: the strategy's device path without a peer).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check}
rm -rf "$out" && mkdir -p "$out"
py=${PYTHON:-python3}
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
ranks=$(( gpus >= 4 ? 4 : gpus ))
[ "$ranks" -ge 1 ] || { echo "gpu_check: no CUDA GPU visible" >&2; exit 2; }
args=(tests/scripts/user_lightning.py --accelerator gpu --devices "$ranks" --max-steps 40 --step-sleep 0.01)
run() {  # run DIR [launcher flags...]
  local dir=$1; shift
  "$py" -m nemo_checkpointless.cli.run --nproc-per-node "$ranks" --run-dir "$dir" --collective-timeout 30 "$@" \
    "${args[@]}" > "$dir.log" 2>&1 || { tail -50 "$dir.log"; exit 1; }
}
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
run "$out/reference"
if [ "$ranks" -ge 2 ]; then
  run "$out/killed" --spares 1 --fault kill:1:12
fi
"$py" - "$out" "$ranks" <<'PY'
import json, sys
from pathlib import Path
out, ranks = Path(sys.argv[1]), int(sys.argv[2])
def ranks_of(d):
    return [json.loads((out / d / f"user_rank{r}.json").read_text()) for r in range(ranks)]
ref = ranks_of("reference")
print("reference:", [(r["device"], r["device_plane"]) for r in ref])
assert all(r["device"].startswith("cuda") for r in ref), ref
if ranks >= 2:
    killed = ranks_of("killed")
    summary = json.loads((out / "killed" / "summary.json").read_text())
    print("recoveries:", [(x["failed_ranks"], x["path"], x["steps_lost"], x.get("recover_s")) for x in summary["recoveries"]])
    for r in range(ranks):
        for key in ("params_sha256", "shard_sha256"):
            assert killed[r][key] == ref[r][key], (r, key)
    assert [x["path"] for x in summary["recoveries"]] == ["p2p"], summary["recoveries"]
    print(f"gpu_check: {ranks} GPUs, rank 1 killed at step 12, recovered p2p: every rank equal to the fault-free run")
else:
    print("gpu_check: 1 GPU: the fault-free run on CUDA only (no peer to recover from)")
PY
