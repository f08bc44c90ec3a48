#!/usr/bin/env bash
# Installs what the tests need, from scratch, and runs them (the README's test command; CI runs it too).
#
# Two virtual environments, because NeMo 2.7 pins older releases than the package's own range
# (lightning 2.4.0, hydra-core 1.3.2, megatron-core 0.15.x; docs/design.md, "Dependencies"):
#   .venv       the package with the newest dependencies it allows: every test (the `nemo` ones skip there)
#   .venv-nemo  the package with the [nemo] and [bench] extras: the `nemo`-marked tests (NeMo 2 + megatron-core on
#               gloo) and the `bench`-marked one (checkpointless-bench with its peers, NVRx and torchft; NeMo's own
#               extras already pull in nvidia-resiliency-ext, whose pynvml warns at every `import torch`)
# Each suite lists its 25 slowest tests at the end (where the CI time goes).
# torch==2.13.0 goes first in each (the CPU wheel) and is held there by a constraint: a bare `torch` requirement
# with no torch installed resolves to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
TORCH=torch==2.13.0
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" > "$constraints"

python3 -m venv .venv
.venv/bin/pip install -q "$TORCH"
.venv/bin/pip install -q -c "$constraints" -e ".[dev]"
# Slurm's controller and client, for tests/test_cluster_files.py (`sbatch --test-only` against a slurmctld it starts
# on loopback; about 10 s from Debian's packages). Without root or apt-get that test skips, saying why.
if ! { command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null || ! command -v sbatch >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmctld slurm-client; } >/dev/null || echo "scripts/test.sh: could not install Slurm; its test skips" >&2
  fi
fi
.venv/bin/python -m pytest -q --durations=25

python3 -m venv .venv-nemo
.venv-nemo/bin/pip install -q "$TORCH"
.venv-nemo/bin/pip install -q -c "$constraints" -e ".[dev,nemo,bench]"
.venv-nemo/bin/python -m pytest -q --durations=25 -m "nemo or bench"
