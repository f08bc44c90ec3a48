"""nemo_checkpointless: checkpointless fault-tolerant training for NeMo / PyTorch Lightning.

The public surface is small; the names below load on first use, so importing the engine (`topology`, `state`,
`replication`, `restart`, `data`) never imports Lightning or NeMo.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "CheckpointlessCallback": "nemo_checkpointless.lightning.callback",
    "CheckpointlessStrategy": "nemo_checkpointless.lightning.strategy",
    "CheckpointlessMegatronStrategy": "nemo_checkpointless.nemo",
    "Config": "nemo_checkpointless.config",
    "ConfigError": "nemo_checkpointless.errors",
    "ParallelDims": "nemo_checkpointless.topology",
    "PeerFailure": "nemo_checkpointless.restart.groups",
    "RecoveryError": "nemo_checkpointless.errors",
    "RecoveryEngine": "nemo_checkpointless.restart.recovery",
    "ShardedOptimizer": "nemo_checkpointless.replication.sharded_optimizer",
    "run_local": "nemo_checkpointless.launcher.local",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'nemo_checkpointless' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
