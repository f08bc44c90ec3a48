#!/usr/bin/env bash
# The package as a user installs it: builds the wheel and the sdist from this checkout, installs the wheel
# (non-editable, with the [cluster] extra) into a fresh virtual environment outside the checkout, and runs each
# console script's smallest real use from a directory where the checkout cannot be imported:
#   checkpointless-train       the main job (its embedded default) for a few steps on 4 ranks, and a recipe's --cfg
#   checkpointless-train       launcher.target=k8s and =slurm: a 16-node recipe's launch files
#   checkpointless-plan        a recipe's memory and goodput plan
#   checkpointless-run         a torchrun-style script of 2 ranks (gloo all-reduce)
#   checkpointless-tokenize    a text file into PREFIX.bin + PREFIX.idx
#   checkpointless-store       the job's store on loopback, reached by a client, stopped by SIGTERM
#   checkpointless-export      the one-line refusal of a run without a NeMo checkpoint (a real export needs a NeMo
#                              run: tests/test_export.py)
#   checkpointless-bench       --help (its smallest real use runs the peers: minutes; tests/test_bench.py)
# and checks that the sdist carries conf/, recipes/ and LICENSE.
#
#   bash scripts/wheel_check.sh [UV]     UV: the uv executable to use (default: uv on PATH)
# scripts/test.sh runs it in both tiers.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
UV=${1:-uv}
[[ $UV == */* ]] && UV=$(cd "$(dirname "$UV")" && pwd)/$(basename "$UV")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMP_NUM_THREADS=1
step() { echo "scripts/wheel_check.sh: [${SECONDS}s] $*"; }
fail() { echo "scripts/wheel_check.sh: FAILED: $*" >&2; exit 1; }

step "building the wheel and the sdist"
"$UV" build -q --out-dir "$work/dist" "$repo"
wheel=$(ls "$work"/dist/*.whl)
sdist=$(ls "$work"/dist/*.tar.gz)
members=$(tar -tzf "$sdist")
for f in conf/config.yaml recipes/llama3_8b.yaml recipes/tiny_llama_cpu.yaml LICENSE pyproject.toml README.md; do
  grep -q "^[^/]*/$f\$" <<<"$members" || fail "the sdist lacks $f"
done
wmembers=$(python3 -c 'import sys, zipfile; print("\n".join(zipfile.ZipFile(sys.argv[1]).namelist()))' "$wheel")
for f in nemo_checkpointless/_conf/config.yaml nemo_checkpointless/_recipes/llama3_70b.yaml nemo_checkpointless/py.typed; do
  grep -qx "$f" <<<"$wmembers" || fail "the wheel lacks $f"
done

step "installing $(basename "$wheel") into a fresh venv"
"$UV" venv -q "$work/venv"
# torch first, the CPU build where pip's configuration names a folder of wheels (scripts/test.sh says why)
find_links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
"$UV" pip install -q --python "$work/venv/bin/python" ${find_links:+--find-links "$find_links"} torch==2.13.0
echo torch==2.13.0 > "$work/constraints.txt"
"$UV" pip install -q --python "$work/venv/bin/python" ${find_links:+--find-links "$find_links"} \
  -c "$work/constraints.txt" "$wheel[cluster]"
bin=$work/venv/bin
mkdir "$work/cwd" && cd "$work/cwd"   # not the checkout: nothing imports from its source tree
where=$("$bin/python" -c 'import nemo_checkpointless, os; print(os.path.dirname(nemo_checkpointless.__file__))')
[[ $where == "$work/venv/"* ]] || fail "nemo_checkpointless imports from $where, not the installed wheel"

step "checkpointless-train: the main job, 3 steps"
"$bin/checkpointless-train" trainer.max_steps=3 trainer.progress_bar=false run.dir="$work/run" \
  data.cache_dir="$work/data" > "$work/train.out" 2>&1 || { tail -40 "$work/train.out"; fail "checkpointless-train"; }
grep -q '^checkpointless-train: done: .*"final_step": 3' "$work/train.out" || { tail -20 "$work/train.out"; fail "no done line"; }
[[ -s $work/run/summary.json ]] || fail "no summary.json"

step "checkpointless-train recipe=llama3_8b --cfg"
"$bin/checkpointless-train" recipe=llama3_8b --cfg > "$work/cfg.out"
grep -q "num_instances" "$work/cfg.out" || fail "--cfg printed no replication settings"

step "checkpointless-train launcher.target=k8s and slurm"
for target in k8s slurm; do
  "$bin/checkpointless-train" recipe=llama3_70b replication.spare_nodes=1 launcher.target=$target \
    run.dir="$work/$target" > "$work/$target.out" 2>&1 || { cat "$work/$target.out"; fail "launcher.target=$target"; }
  [[ -n $(find "$work/$target" -type f) ]] || fail "launcher.target=$target wrote no file"
done
grep -rq "kind: PyTorchJob" "$work/k8s" || fail "no PyTorchJob in the k8s files"
grep -rq "#SBATCH" "$work/slurm" || fail "no sbatch script in the slurm files"

step "checkpointless-plan recipe=llama3_8b"
"$bin/checkpointless-plan" recipe=llama3_8b > "$work/plan.out" || fail "checkpointless-plan"
grep -qi "goodput" "$work/plan.out" || fail "the plan printed no goodput"

step "checkpointless-run: a torchrun-style script of 2 ranks"
cat > "$work/allreduce.py" <<'EOF'
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(x)
assert x.tolist() == [3.0] * 4, x
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: all_reduce {x[0].item()}", flush=True)
dist.destroy_process_group()
EOF
"$bin/checkpointless-run" --nproc-per-node 2 --run-dir "$work/run-script" "$work/allreduce.py" > "$work/run.out" 2>&1 \
  || { cat "$work/run.out"; fail "checkpointless-run"; }
grep -q "rank 0 of 2: all_reduce 3.0" "$work/run.out" || { cat "$work/run.out"; fail "rank 0's output"; }

step "checkpointless-tokenize"
"$bin/checkpointless-tokenize" "$repo/README.md" --output "$work/tok/readme" > /dev/null
[[ -s $work/tok/readme.bin && -s $work/tok/readme.idx ]] || fail "checkpointless-tokenize wrote no .bin/.idx"

step "checkpointless-store"
port=$("$bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin/checkpointless-store" --host 127.0.0.1 --port "$port" > "$work/store.out" 2>&1 &
store=$!
"$bin/python" - "$port" <<'EOF'
import sys
from datetime import timedelta
import torch.distributed as dist

client = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
client.set("wheel_check", "ok")
assert client.get("wheel_check") == b"ok"
EOF
kill -TERM "$store"
wait "$store" || fail "checkpointless-store exited $? on SIGTERM"

step "checkpointless-export (refusal) and checkpointless-bench --help"
set +e
"$bin/checkpointless-export" --run-dir "$work/run" --out "$work/hf" > "$work/export.out" 2>&1
code=$?
set -e
[[ $code == 2 ]] || { cat "$work/export.out"; fail "checkpointless-export exited $code, not 2"; }
[[ $(wc -l < "$work/export.out") == 1 ]] && grep -q "^checkpointless-export: " "$work/export.out" \
  || { cat "$work/export.out"; fail "checkpointless-export: not one line"; }
"$bin/checkpointless-bench" --help > /dev/null

step "every console script ran from the installed wheel"
