"""Command-line entry points: checkpointless-train, -run, -tokenize, -plan."""

from __future__ import annotations

import importlib.util


def importable(module: str) -> bool:
    """Whether `module` can be imported here (found on the path), without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
