"""Process groups without a store on a training rank; failure detection; (later) the in-process restart loop."""

from nemo_checkpointless.restart.groups import Group, Membership, PeerFailure
from nemo_checkpointless.restart.worker_env import WorkerEnv

__all__ = ["Group", "Membership", "PeerFailure", "WorkerEnv"]
