"""RNG states (Python, NumPy, torch CPU, and the current CUDA device's where the process uses CUDA) as JSON plus
tensors: no pickle.

The CUDA state is the current device's only (`rng.cuda`), and only once this process has initialized CUDA: a rank
that trains on CPU on a machine with GPUs does not create a CUDA context to read it, and a replacement restores it
into *its* current device, whichever index that is (a spare on another GPU of the node becomes the rank it
replaces, with that rank's CUDA stream of random numbers)."""

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
    if cuda_in_use():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()  # the current device's (a CPU byte tensor)
    return meta, tensors


def cuda_in_use() -> bool:
    """Whether this process has initialized CUDA (reading or setting a CUDA RNG state would otherwise create a
    context on device 0)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def restore_rng(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, tensors["rng.numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors:
        if not cuda_in_use():
            raise ValueError("a boundary state with a CUDA RNG state offered to a process that does not use CUDA "
                             "(the job's ranks must all train on the same kind of device)")
        torch.cuda.set_rng_state(tensors["rng.cuda"])
