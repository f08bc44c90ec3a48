"""Models trained by the built-in recipes (plain PyTorch, no Lightning)."""

from nemo_checkpointless.models.llama import LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel"]
