"""The operator role on one machine: hosts the job's store, starts the workers, watches them."""

from nemo_checkpointless.launcher.local import LaunchError, run_local

__all__ = ["LaunchError", "run_local"]
