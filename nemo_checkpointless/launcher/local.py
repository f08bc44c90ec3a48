"""Single-machine launcher. It hosts the job's TCPStore (so no training rank hosts it), bound to the configured
interface (loopback by default), starts one worker process per rank, watches them, and merges the summary.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from nemo_checkpointless.config import Config
from nemo_checkpointless.restart.groups import FAULT_KEY
from nemo_checkpointless.restart.worker_env import WorkerEnv

WORKER_MODULE = "nemo_checkpointless.lightning.worker"
POLL_S = 0.01


class LaunchError(RuntimeError):
    """A worker failed and the job could not continue."""


def host_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on `host` only (TCPStore alone would listen on every interface)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, port


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_local(cfg: Config, run_dir: Path, worker_module: str = WORKER_MODULE) -> dict[str, Any]:
    """Run the job described by `run_dir/config.yaml` on `cfg.trainer.devices` local ranks; return the summary.

    Rank 0 writes to this process's terminal; the others write to `run_dir/logs/rank_<r>.log`.
    """
    t0 = time.perf_counter()
    world = cfg.trainer.world_size
    store, port = host_store(cfg.launcher.host, cfg.launcher.start_timeout_s)
    log_dir = run_dir / "logs"
    log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes] | None] = []
    base_env = dict(os.environ)
    threads = str(cfg.launcher.threads_per_rank)
    base_env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    try:
        for rank in range(world):
            env = dict(base_env)
            env.update(WorkerEnv(rank, world, rank, cfg.launcher.host, port, str(run_dir)).to_environ())
            out: IO[bytes] | None = None
            if rank != 0:
                fd = os.open(log_dir / f"rank_{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                out = os.fdopen(fd, "wb")
            logs.append(out)
            procs.append(subprocess.Popen([sys.executable, "-m", worker_module], env=env, stdout=out,
                                          stderr=subprocess.STDOUT if out else None))
        pids = {str(r): [p.pid] for r, p in enumerate(procs)}
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                store.set(FAULT_KEY, "0")  # unblock the survivors at once instead of at their collective timeout
                rank = failed[0]
                log = log_dir / f"rank_{rank}.log"
                where = "above" if rank == 0 else f"in {log}:\n{_tail(log)}"
                raise LaunchError(f"rank {rank} exited with code {codes[rank]}; its output is {where}")
            if all(c == 0 for c in codes):
                break
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for f in logs:
            if f is not None:
                f.close()
    worker_summary = json.loads((run_dir / "worker_summary.json").read_text())
    summary: dict[str, Any] = {
        "recipe": cfg.recipe_name,
        "world_size": world,
        "num_instances": cfg.replication.num_instances,
        "seed": cfg.seed,
        "final_step": worker_summary["final_step"],
        "wall_s": round(time.perf_counter() - t0, 3),
        "train_s": worker_summary["train_s"],
        "steps_per_s": worker_summary["steps_per_s"],
        "state_sha256": worker_summary["state_sha256"],
        "data_sha256": worker_summary["data_sha256"],
        "recoveries": [],
        "pids": pids,
    }
    tmp = run_dir / ".summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(run_dir / "summary.json")
    return summary
