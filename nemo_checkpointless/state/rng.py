"""RNG states (Python, NumPy, torch CPU, CUDA where present) as JSON plus tensors: no pickle."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON-able part, tensors) of every RNG a training step may draw from."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    meta = {"python": [py_version, list(py_state), py_gauss],
            "numpy": [np_name, int(np_pos), int(np_has_gauss), float(np_gauss)]}
    tensors = {"rng.torch": torch.get_rng_state(),
               "rng.numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64))}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda{i}"] = state
    return meta, tensors


def restore_rng(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, tensors["rng.numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng.torch"])
    cuda = sorted(k for k in tensors if k.startswith("rng.cuda"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
