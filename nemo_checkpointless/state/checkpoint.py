"""The persistent fallback checkpoint: used only when no live peer can restore the state.

Layout: `DIR/step_<NNNNNNNN>/shard_<p>.bin` (a `state.packing` buffer: raw tensor bytes + JSON, no pickle) with
`shard_<p>.json` beside it (size and sha256). Instance 0 writes it: the rank at shard position p writes shard p.
Tensors that are equal on every shard (the full parameters of a data-parallel job) may be written by shard 0 only:
it names their prefix (`shared_prefix`), and `load_rank_state` adds them to every other shard it reads. A step
directory is usable only when every shard is present and verifies; `latest(max_step)` returns the newest such
step, so a half-written or corrupt checkpoint is skipped.
Files are private to the user (0600, directories 0700) and written under temporary names, then renamed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_checkpointless.state.packing import checksum, pack, unpack

_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointStore:
    def __init__(self, directory: str | os.PathLike[str], num_shards: int) -> None:
        self.dir = Path(directory)
        self.num_shards = num_shards

    def _step_dir(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}"

    def save_shard(self, step: int, shard: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                   shared_prefix: str | None = None) -> None:
        """Write shard `shard` of step `step` (one rank per shard calls this; no collective). With `shared_prefix`,
        the tensors named so are equal on every shard: shard 0 keeps them, the others drop them."""
        if shared_prefix is not None and shard != 0:
            tensors = {k: v for k, v in tensors.items() if not k.startswith(shared_prefix)}
        d = self._step_dir(step)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        buf = pack(tensors, meta)
        tmp = d / f".shard_{shard}.bin.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            buf.numpy().tofile(f)
        tmp.replace(d / f"shard_{shard}.bin")
        side = d / f".shard_{shard}.json.tmp"
        fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"step": step, "shard": shard, "nbytes": buf.numel(), "sha256": checksum(buf),
                       "shared_prefix": shared_prefix}, f)
        side.replace(d / f"shard_{shard}.json")

    def _complete(self, step: int) -> bool:
        d = self._step_dir(step)
        return all((d / f"shard_{p}.json").exists() and (d / f"shard_{p}.bin").exists()
                   for p in range(self.num_shards))

    def steps(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.dir.iterdir())
        return sorted(int(m.group(1)) for m in found if m and self._complete(int(m.group(1))))

    def latest(self, max_step: int) -> int:
        """The newest complete checkpoint at or before `max_step`; 0 (the seeded initial state) if none."""
        usable = [s for s in self.steps() if s <= max_step]
        return usable[-1] if usable else 0

    def load_shard(self, step: int, shard: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Read and verify one shard; raises ValueError on a size or checksum mismatch."""
        d = self._step_dir(step)
        side = json.loads((d / f"shard_{shard}.json").read_text())
        buf = torch.from_numpy(np.fromfile(d / f"shard_{shard}.bin", dtype=np.uint8))
        if buf.numel() != side["nbytes"] or checksum(buf) != side["sha256"]:
            raise ValueError(f"checkpoint {d / f'shard_{shard}.bin'} does not match its checksum")
        return unpack(buf)

    def load_rank_state(self, step: int, shard: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A rank's whole state at `step`: its shard, plus the tensors shard 0 holds for every shard."""
        tensors, meta = self.load_shard(step, shard)
        if shard != 0:
            side = json.loads((self._step_dir(step) / "shard_0.json").read_text())
            prefix = side.get("shared_prefix")
            if prefix:
                shared, _ = self.load_shard(step, 0)
                tensors.update({k: v for k, v in shared.items() if k.startswith(prefix)})
        return tensors, meta
