"""The operator role: hosts (or joins) the job's store, starts the workers, watches them, replaces failed ones.

`run_job` runs one machine's job (`local.run_local`), or this node's agent of a job of several nodes
(`launcher.nodes.run_node`) when the job has more than one node or names its store's endpoint.
"""

from pathlib import Path
from typing import Any

from nemo_checkpointless.config import Config
from nemo_checkpointless.launcher.local import LaunchError, run_local


def multi_node(cfg: Config) -> bool:
    return cfg.trainer.num_nodes > 1 or cfg.replication.spare_nodes > 0 or bool(cfg.launcher.rdzv_endpoint)


def run_job(cfg: Config, run_dir: Path, worker_module: str | None = None, command: list[str] | None = None,
            port: int | None = None) -> dict[str, Any]:
    if multi_node(cfg):
        from nemo_checkpointless.launcher.nodes import run_node

        return run_node(cfg, run_dir, worker_module, command)
    return run_local(cfg, run_dir, worker_module, command, port)


__all__ = ["LaunchError", "multi_node", "run_job", "run_local"]
