#!/usr/bin/env bash
# Installs what the tests need, from scratch, and runs them.
#
#   bash scripts/test.sh          the PR tier: the README's test command, which CI (.ci/run) runs; 20-30 minutes on
#                                 2 cores, installs included. Every fast test, and the multi-process tests that prove
#                                 the guarantees (tests/tiers.py: what the PR tier leaves out, and why that is safe).
#   bash scripts/test.sh --full   every test (about an hour on 2 cores): run it before resolving an issue that
#                                 touches recovery.
#
# Two virtual environments, because NeMo 2.7 pins older releases than the package's own range
# (lightning 2.4.0, hydra-core 1.3.2, megatron-core 0.15.x; docs/design.md, "Dependencies"):
#   .venv       the package with the newest dependencies it allows: every test (the `nemo` ones skip there)
#   .venv-nemo  the package with the [nemo] and [bench] extras: the `nemo`-marked tests (NeMo 2 + megatron-core on
#               gloo) and the `bench`-marked ones (checkpointless-bench with its peers, NVRx and torchft)
# and a third, throw-away one for scripts/wheel_check.sh: the wheel installed as a user installs it.
#
# uv installs them (pip would take 5-10 minutes of the run; uv about one). torch==2.13.0 goes first in each and is
# held there by a constraint: a bare `torch` requirement with no torch installed resolves to a multi-GB CUDA build.
# Where pip's configuration names a folder of wheels (find-links: the CPU build of torch on this kind of machine),
# uv is given it too; uv reads no pip configuration.
#
# In the PR tier a test's timeout is at most 300 s (600 s for `nemo` tests), so a hung test costs minutes, not the
# run. Each suite lists its 25 slowest tests at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
tier=pr
case "${1:-}" in
  "") ;;
  --full) tier=full ;;
  *) echo "usage: bash scripts/test.sh [--full]" >&2; exit 2 ;;
esac
TORCH=torch==2.13.0
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$TORCH" > "$constraints"
say() { echo "scripts/test.sh: [${SECONDS}s] $*"; }

say "installing (tier: $tier)"
python3 -m venv .venv
.venv/bin/python -m pip install -q uv
UV=$PWD/.venv/bin/uv
find_links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
install() {  # install VENV ARGS...: torch first, then ARGS, torch held at $TORCH
  local venv=$1
  shift
  "$UV" pip install -q --python "$venv/bin/python" ${find_links:+--find-links "$find_links"} "$TORCH"
  "$UV" pip install -q --python "$venv/bin/python" ${find_links:+--find-links "$find_links"} -c "$constraints" "$@"
}
install .venv -e ".[dev]"
"$UV" venv -q --allow-existing .venv-nemo
install .venv-nemo -e ".[dev,nemo,bench]"
# Slurm's controller and client, for tests/test_cluster_files.py (`sbatch --test-only` against a slurmctld it starts
# on loopback; about 10 s from Debian's packages). Without root or apt-get that test skips, saying why.
if ! { command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null || ! command -v sbatch >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmctld slurm-client; } >/dev/null || echo "scripts/test.sh: could not install Slurm; its test skips" >&2
  fi
fi

if [[ $tier == pr ]]; then
  select=(-m "not full" --timeout-cap=300 --timeout-cap-nemo=600)
  select_nemo=(-m "(nemo or bench) and not full" --timeout-cap=300 --timeout-cap-nemo=600)
else
  select=()
  select_nemo=(-m "nemo or bench")
fi
say "the suite in .venv"
.venv/bin/python -m pytest -q --durations=25 "${select[@]}"
say "the nemo and bench suite in .venv-nemo"
.venv-nemo/bin/python -m pytest -q --durations=25 "${select_nemo[@]}"
say "the wheel"
bash scripts/wheel_check.sh "$UV"
say "done (tier: $tier)"
