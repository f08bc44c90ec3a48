"""Thin Lightning adapter over the engine: strategy, callback, and the built-in Llama module."""

from nemo_checkpointless.lightning.callback import CheckpointlessCallback
from nemo_checkpointless.lightning.data import MmapDataModule
from nemo_checkpointless.lightning.module import LlamaLightningModule
from nemo_checkpointless.lightning.strategy import CheckpointlessStrategy

__all__ = ["CheckpointlessCallback", "CheckpointlessStrategy", "LlamaLightningModule", "MmapDataModule"]
