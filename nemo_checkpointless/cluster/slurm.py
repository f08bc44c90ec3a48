"""launcher.target=slurm: an `sbatch` script that runs the job's store on the batch host and one agent per node.

The script asks for num_nodes + spare_nodes whole nodes (`--exclusive`, `--mem=0`, one task each, `--gres=gpu:K`
with trainer.accelerator=gpu) and `--no-kill` (a lost node does not end the allocation: its ranks are recovered on
the others). It starts `checkpointless-store` in the background on the batch host (node 0 of the allocation; the
script's own node), waits until it listens, then `srun` starts one agent per node with `launcher.node_rank` from
`$SLURM_NODEID` and the store at `$SLURMD_NODENAME:29400`, `--kill-on-bad-exit=0` and `--wait=0` so that one
agent's exit does not end the others. The store is stopped when the script ends. Paths are those of the submitting
machine (`--chdir`: where checkpointless-train ran; the output under RUN_DIR/slurm): a shared filesystem is assumed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from nemo_checkpointless.cluster import job
from nemo_checkpointless.config import Config

NODE_RANK_VAR = "SLURM_NODEID"


def default_bin_dir() -> str:
    """The directory of this environment's `checkpointless-train` (put first on the nodes' PATH)."""
    found = shutil.which("checkpointless-train")
    return str(Path(found).parent if found else Path(sys.executable).parent)


def _node_agent(cfg: Config) -> str:
    """The per-node wrapper srun runs: a warning when the cache's filesystem is smaller than the cache may grow
    (the cache then falls back to direct reads), then the agent with this node's rank appended."""
    size = job.shm_size(cfg)
    need = size.limit_bytes if job.cache_in_shm(cfg) else size.cache_limit_bytes
    check = shlex.quote(job.cache_root(cfg))
    return (f'free=$(df --output=avail -B1 {check} 2>/dev/null | tail -n 1)\n'
            f'if [[ $free =~ ^[0-9]+$ ]] && (( free < {need} )); then\n'
            f'  echo "$(hostname): warning: "{check}" has $free bytes free, the job may use {need}" >&2\n'
            f'fi\n'
            f'exec "$@" "launcher.node_rank=${NODE_RANK_VAR}"')


def sbatch_script(cfg: Config, overrides: list[str], *, port: int = job.STORE_PORT, bin_dir: str | None = None,
                  cwd: str | None = None) -> str:
    """The batch script's text. `bin_dir` goes first on PATH (default: this environment's); `cwd` is the job's
    working directory (default: this one), where the overrides' relative paths (run.dir, script=, ...) resolve."""
    t, r = cfg.trainer, cfg.replication
    nodes = job.num_agents(cfg)
    run_dir = Path(cwd or os.getcwd(), cfg.run.dir)
    log_dir = run_dir / "slurm"
    gres = f"#SBATCH --gres=gpu:{t.devices}\n" if t.accelerator == "gpu" else ""
    srun_gres = f" --gres=gpu:{t.devices}" if t.accelerator == "gpu" else ""
    # The agent's arguments but its node rank, which the wrapper appends on each node; the store's host is known
    # when the script runs.
    store = "$STORE_HOST:$STORE_PORT"
    args = [a for a in job.agent_args(cfg, overrides, "", store) if not a.startswith("launcher.node_rank=")]
    agent = " ".join(["checkpointless-train", *(f'"{a}"' if a.endswith(f"={store}") else shlex.quote(a)
                                                for a in args)])
    env = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in job.rank_env(cfg).items())
    q = shlex.quote
    return f"""#!/bin/bash
{job.comment(f"Written by checkpointless-train launcher.target=slurm for recipe={cfg.recipe_name}: "
              f"{t.num_nodes} training node(s) + {r.spare_nodes} spare node(s), {t.devices} ranks each; one agent "
              f"per node, node ranks 0..{nodes - 1}.")}{job.comment(job.shm_size(cfg).formula(cfg))}\
# Submit: sbatch [--partition=P --time=T --account=A] {q(str(log_dir / "job.sbatch"))}
#SBATCH --job-name={job.job_name(cfg)}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --mem=0
{gres}#SBATCH --no-kill
#SBATCH --chdir={Path(cwd or os.getcwd())}
#SBATCH --output={log_dir}/%x-%j.out
set -euo pipefail

export PATH={q(bin_dir or default_bin_dir())}:"$PATH"
{env}
STORE_PORT={port}
STORE_HOST="${{SLURMD_NODENAME:-$(hostname)}}"  # the batch host: node 0 of the allocation
LOG_DIR={q(str(log_dir))}
mkdir -p "$LOG_DIR"

# The job's store, on the batch host, until this script ends.
checkpointless-store --host 0.0.0.0 --port "$STORE_PORT" > "$LOG_DIR/store-${{SLURM_JOB_ID:-0}}.log" 2>&1 &
STORE_PID=$!
trap 'kill "$STORE_PID" 2>/dev/null || true; wait "$STORE_PID" 2>/dev/null || true' EXIT
for ((tries = 0; ; tries++)); do  # every 0.2 s, up to launcher.start_timeout_s
  if (: < "/dev/tcp/127.0.0.1/$STORE_PORT") 2>/dev/null; then break; fi
  if ! kill -0 "$STORE_PID" 2>/dev/null; then
    echo "checkpointless-store exited; see $LOG_DIR/store-${{SLURM_JOB_ID:-0}}.log" >&2; exit 1
  fi
  if ((tries >= {max(1, round(5 * cfg.launcher.start_timeout_s))})); then
    echo "checkpointless-store not listening on port $STORE_PORT after {cfg.launcher.start_timeout_s:g} s" >&2
    exit 1
  fi
  sleep 0.2
done
echo "store at $STORE_HOST:$STORE_PORT"

# One agent per node, with its node rank (0..{nodes - 1}; from {t.num_nodes} on: the spare nodes).
NODE_AGENT={q(_node_agent(cfg))}
AGENT=({agent})
srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --cpus-per-task="${{SLURM_CPUS_ON_NODE:-1}}"{srun_gres} \\
  --no-kill --kill-on-bad-exit=0 --wait=0 bash -c "$NODE_AGENT" node-agent "${{AGENT[@]}}"
"""


def write(cfg: Config, overrides: list[str], out_dir: Path) -> list[Path]:
    """Write OUT/job.sbatch; return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "job.sbatch"
    path.write_text(sbatch_script(cfg, overrides))
    return [path]
