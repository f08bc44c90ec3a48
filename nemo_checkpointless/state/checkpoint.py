"""The persistent fallback checkpoint: used only when no live peer can restore the state.

Layout: `DIR/step_<NNNNNNNN>/shard_<p>.safetensors` (the shard's tensors; its JSON meta is one string of the
safetensors metadata, under "meta"; no pickle) with `shard_<p>.json` beside it (size and sha256 of the
.safetensors file, the shared prefix). Instance 0 writes it: the rank at checkpoint slot p (its TP/PP slice and
optimizer shard: `topology.rank_info(...).checkpoint_slot`; the shard position in a data-parallel job) writes
shard p.
Tensors that are equal on every shard (the full parameters of a data-parallel job) may be written by shard 0 only:
it names their prefix (`shared_prefix`), and `load_rank_state` adds them to every other shard it reads.

A step directory is listed by `steps` once every shard's two files exist (the side file is written last, so a
shard whose side file exists was written whole). `latest(max_step)` returns the newest listed step whose every
shard also verifies (its size and sha256 match the side file: every file is read), so a checkpoint that was
truncated or corrupted on disk is skipped, with one warning per skipped step.
Files are private to the user (0600, directories 0700) and written under temporary names, then renamed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

log = logging.getLogger(__name__)

FORMAT = "nemo_checkpointless.checkpoint/2"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt, or not one of ours."""


def _own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that each own their whole storage (safetensors refuses tensors sharing memory, e.g.
    an optimizer shard that aliases a slice of the flat parameters)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        storage = t.untyped_storage()
        whole = t.data_ptr() == storage.data_ptr() and t.numel() * t.element_size() == storage.nbytes()
        if t.numel() and (not whole or storage.data_ptr() in seen):
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` (mode 0600) under a temporary name, then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a writer that died left it (its mode is not ours to trust)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)


class CheckpointStore:
    def __init__(self, directory: str | os.PathLike[str], num_shards: int) -> None:
        self.dir = Path(directory)
        self.num_shards = num_shards
        self._warned: set[int] = set()  # steps `latest` has already said it skips

    def _step_dir(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}"

    def _paths(self, step: int, shard: int) -> tuple[Path, Path]:
        d = self._step_dir(step)
        return d / f"shard_{shard}.safetensors", d / f"shard_{shard}.json"

    def save_shard(self, step: int, shard: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                   shared_prefix: str | None = None) -> None:
        """Write shard `shard` of step `step` (one rank per shard calls this; no collective). With `shared_prefix`,
        the tensors named so are equal on every shard: shard 0 keeps them, the others drop them."""
        if shared_prefix is not None and shard != 0:
            tensors = {k: v for k, v in tensors.items() if not k.startswith(shared_prefix)}
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._step_dir(step).mkdir(mode=0o700, exist_ok=True)
        data = safetensors.torch.save(_own_storage(tensors), {"format": FORMAT, "meta": json.dumps(meta)})
        path, side = self._paths(step, shard)
        _write_private(path, data)
        # The side file last: its presence says the shard file is whole.
        _write_private(side, json.dumps({"step": step, "shard": shard, "nbytes": len(data),
                                         "sha256": hashlib.sha256(data).hexdigest(),
                                         "shared_prefix": shared_prefix}).encode())

    def _listed(self, step: int) -> bool:
        return all(p.exists() for shard in range(self.num_shards) for p in self._paths(step, shard))

    def steps(self) -> list[int]:
        """Steps whose every shard's files exist (not yet verified: see `latest`)."""
        if not self.dir.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.dir.iterdir())
        return sorted(int(m.group(1)) for m in found if m and self._listed(int(m.group(1))))

    def latest(self, max_step: int) -> int:
        """The newest checkpoint at or before `max_step` whose every shard is present and verifies (size and
        sha256; this reads every file of the checkpoints it tries); 0 (the seeded initial state) if none. A
        checkpoint that fails is skipped, with a warning (once per step and store)."""
        for step in reversed([s for s in self.steps() if s <= max_step]):
            try:
                for shard in range(self.num_shards):
                    self._read_verified(step, shard)
            except CheckpointError as e:
                if step not in self._warned:
                    self._warned.add(step)
                    log.warning("skipping the checkpoint of step %d: %s", step, e)
                continue
            return step
        return 0

    def _side(self, step: int, shard: int) -> dict[str, Any]:
        _, side_path = self._paths(step, shard)
        try:
            side = json.loads(side_path.read_text())
            if not isinstance(side, dict) or not isinstance(side["nbytes"], int) or not isinstance(side["sha256"],
                                                                                                   str):
                raise TypeError("not an object with nbytes and sha256")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"checkpoint side file {side_path} is unreadable ({e})") from e
        return side

    def _read_verified(self, step: int, shard: int) -> tuple[bytes, dict[str, Any]]:
        """The bytes of one shard file and its side file, checked against each other."""
        path, _ = self._paths(step, shard)
        side = self._side(step, shard)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"checkpoint {path} is unreadable ({e})") from e
        if len(data) != side["nbytes"]:
            raise CheckpointError(f"checkpoint {path} has {len(data)} bytes, its side file says {side['nbytes']} "
                                  "(truncated?)")
        if hashlib.sha256(data).hexdigest() != side["sha256"]:
            raise CheckpointError(f"checkpoint {path} does not match its checksum (corrupt)")
        return data, side

    def load_shard(self, step: int, shard: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Read and verify one shard; raises CheckpointError (a ValueError) on a size or checksum mismatch or a
        file that is not one of our checkpoints."""
        path, _ = self._paths(step, shard)
        data, _ = self._read_verified(step, shard)
        try:
            tensors = safetensors.torch.load(data)
            # safetensors' header: 8-byte little-endian length, then JSON (`load` has just parsed it).
            hlen = int.from_bytes(data[:8], "little")
            metadata = json.loads(data[8 : 8 + hlen]).get("__metadata__") or {}
            if metadata.get("format") != FORMAT:
                raise CheckpointError(f"checkpoint {path} has format {metadata.get('format')!r}, expected {FORMAT!r}")
            meta = json.loads(metadata["meta"])
        except (safetensors.SafetensorError, ValueError, KeyError, TypeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"checkpoint {path} is not a readable safetensors checkpoint ({e})") from e
        return tensors, meta

    def load_rank_state(self, step: int, shard: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A rank's whole state at `step`: its shard, plus the tensors shard 0 holds for every shard."""
        tensors, meta = self.load_shard(step, shard)
        if shard != 0:
            prefix = self._side(step, 0).get("shared_prefix")
            if prefix:
                shared, _ = self.load_shard(step, 0)
                tensors.update({k: v for k, v in shared.items() if k.startswith(prefix)})
        return tensors, meta
