"""NeMo 2 integration.

`MegatronParticipant` (the recovery engine's view of Megatron's distributed-optimizer shards, from
`nemo_checkpointless.megatron`) needs megatron-core only. `CheckpointlessMegatronStrategy` (a NeMo
`MegatronStrategy`), `CheckpointlessCallback`, `MmapDataModule` (tier 2 for a user's data module) and `apply` (a
NeMo recipe made checkpointless) import NeMo, so they are imported on first use: the package imports without the
[nemo] extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nemo_checkpointless.megatron.participant import MegatronParticipant, distributed_optimizers

if TYPE_CHECKING:
    from nemo_checkpointless.nemo.callback import CheckpointlessCallback
    from nemo_checkpointless.nemo.data import MmapDataModule
    from nemo_checkpointless.nemo.recipe import apply
    from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy

__all__ = ["CheckpointlessCallback", "CheckpointlessMegatronStrategy", "MegatronParticipant", "MmapDataModule",
           "apply", "distributed_optimizers"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointlessMegatronStrategy":
        from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy

        return CheckpointlessMegatronStrategy
    if name == "CheckpointlessCallback":
        from nemo_checkpointless.nemo.callback import CheckpointlessCallback

        return CheckpointlessCallback
    if name == "MmapDataModule":
        from nemo_checkpointless.nemo.data import MmapDataModule

        return MmapDataModule
    if name == "apply":
        from nemo_checkpointless.nemo.recipe import apply

        return apply
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
