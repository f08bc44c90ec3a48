"""One way for a setting to reach a process: the config defines, defaults and validates it; the launcher's
`settings_env` carries it to every process of the job, whatever started it (the package's own worker or a user's
command; a rank or a spare; one node or several), and `Session.from_environ` reads it there.

The case that broke: `launcher.start_timeout_s` (how long the ranks wait for a peer that is still starting, e.g. a
cold replacement importing the script) reached a user's command only; the package's own Lightning worker waited its
own fallback of 120 s whatever the config said."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from nemo_checkpointless import protocol
from nemo_checkpointless.config import Config
from nemo_checkpointless.launcher.local import _Job
from nemo_checkpointless.launcher.nodes import ClusterJob, NodeSpec
from nemo_checkpointless.restart.session import Session
from nemo_checkpointless.topology import ParallelDims


def _config() -> Config:
    cfg = Config()
    cfg.trainer.devices = 2
    cfg.launcher.start_timeout_s = 37.0
    cfg.launcher.collective_timeout_s = 9.0
    cfg.checkpoint.every_n_steps = 6
    cfg.integrity.every_n_steps = 7
    cfg.integrity.nan_policy = "skip"
    cfg.launcher.verbose = True
    return cfg


WANT = {protocol.START_TIMEOUT_ENV: "37.0", protocol.COLLECTIVE_TIMEOUT_ENV: "9.0",
        protocol.CHECKPOINT_EVERY_ENV: "6", protocol.INTEGRITY_EVERY_ENV: "7", protocol.NAN_POLICY_ENV: "skip",
        protocol.NUM_INSTANCES_ENV: "2", protocol.VERBOSE_ENV: "1"}


def _jobs(tmp_path: Path) -> dict[str, Any]:
    cfg = _config()
    spec = NodeSpec(nnodes=2, node_rank=0, nproc=1, spares=0, spare_nodes=0, host="127.0.0.1", port=1,
                    backend="c10d", local_addr="127.0.0.1", lease_s=5.0)
    return {"our worker": _Job(cfg, tmp_path, store=None, port=1, worker_module="w"),  # type: ignore[arg-type]
            "a user's command": _Job(cfg, tmp_path, store=None, port=1, worker_module="",  # type: ignore[arg-type]
                                     command=["train.py"]),
            "our worker, several nodes": ClusterJob(cfg, tmp_path, store=None, port=1,  # type: ignore[arg-type]
                                                    worker_module="w", spec=spec),
            "a user's command, several nodes": ClusterJob(cfg, tmp_path, store=None, port=1,  # type: ignore[arg-type]
                                                          worker_module="", command=["train.py"], spec=spec)}


def test_every_process_of_every_launch_gets_the_jobs_settings(tmp_path: Path) -> None:
    for kind, job in _jobs(tmp_path).items():
        for who, env in (("rank 1", job._env(1)), ("a spare", job.spare_env())):
            got = {k: env.get(k) for k in WANT}
            assert got == WANT, (kind, who, got)


@pytest.mark.parametrize("kind", ["our worker", "a user's command"])
def test_a_rank_waits_for_a_starting_peer_as_long_as_the_config_says(kind: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The session a rank builds from the launcher's environment: the ranks wait for a member still starting (a
    cold replacement) for launcher.start_timeout_s (37 s here), not the collective timeout (9 s) or a fallback."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    job = _jobs(tmp_path)[kind]
    job.port = store.port
    for key, value in job._env(1).items():
        monkeypatch.setenv(key, value)
    session = Session.from_environ(lambda world: ParallelDims(world_size=world, num_instances=2))
    assert session.env.rank == 1 and session.membership.arrive_timeout_s == 37.0, session.membership
    assert session.membership.timeout_s == 9.0


def test_a_process_without_the_launchers_settings_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    job = _jobs(tmp_path)["our worker"]
    for key, value in job._env(1).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(protocol.START_TIMEOUT_ENV)
    with pytest.raises(RuntimeError, match=r"START_TIMEOUT_S \(launcher.start_timeout_s\) is not set"):
        Session.from_environ(lambda world: ParallelDims(world_size=world, num_instances=2))
