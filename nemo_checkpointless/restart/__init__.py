"""Fault tolerance at run time: process groups built from the launcher's store, with failure detection
(`groups`); the in-process recovery protocol, p2p transfer and checkpoint fallback (`recovery`); fault injection
(`faults`); what a fault cost (`cost`); the spare template (`template`); a worker's environment (`worker_env`).
Does not import `replication/` (the checkpoint store is `state.checkpoint`)."""

from nemo_checkpointless.restart.groups import Group, Membership, PeerFailure
from nemo_checkpointless.restart.worker_env import WorkerEnv

__all__ = ["Group", "Membership", "PeerFailure", "WorkerEnv"]
