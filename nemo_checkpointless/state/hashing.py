"""Canonical hashes: of the training state (equal exactly when params and optimizer state are bitwise equal,
whatever the sharding) and of the sequence of global batches."""

from __future__ import annotations

import hashlib

import torch

HASH_BYTES = 32


def _update(h: hashlib._Hash, name: str, t: torch.Tensor) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def state_digest(params: dict[str, torch.Tensor], optimizer_state: dict[str, dict[str, torch.Tensor]]) -> str:
    """sha256 over parameters then per-parameter optimizer state, both in sorted-name order."""
    h = hashlib.sha256()
    for name in sorted(params):
        _update(h, f"param:{name}", params[name])
    for name in sorted(optimizer_state):
        for key in sorted(optimizer_state[name]):
            _update(h, f"state:{name}:{key}", optimizer_state[name][key])
    return h.hexdigest()


def batch_hash(batch: object) -> bytes:
    """32-byte digest of one rank's micro-batch. A tensor of token ids: its values as int64, row-major (the same
    digest on every engine). Anything else (a float tensor; a tuple, list or dict of tensors, nested): every
    tensor's name in the structure, dtype, shape and bytes; other leaves by their repr."""
    if isinstance(batch, torch.Tensor) and not (batch.is_floating_point() or batch.is_complex()):
        return hashlib.sha256(batch.detach().to(torch.int64).contiguous().cpu().numpy().tobytes()).digest()
    h = hashlib.sha256()

    def walk(path: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            _update(h, path, value)
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{path}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{path}[{i}]", item)
        else:
            h.update(f"{path}={value!r}|".encode())

    walk("batch", batch)
    return h.digest()


def encode_hash(digest: bytes, slot: int, slots: int) -> torch.Tensor:
    """A float32 vector of `slots * 32` zeros with the digest's bytes in `slot`: summing over ranks gathers them."""
    out = torch.zeros(slots * HASH_BYTES, dtype=torch.float32)
    out[slot * HASH_BYTES : (slot + 1) * HASH_BYTES] = torch.tensor(list(digest), dtype=torch.float32)
    return out


def decode_hashes(summed: torch.Tensor) -> list[bytes]:
    values = summed.to(torch.int64).tolist()
    return [bytes(values[i : i + HASH_BYTES]) for i in range(0, len(values), HASH_BYTES)]


class DataDigest:
    """A running digest of the global batches: d_s = sha256(d_{s-1} || sha256(hash(rank 0) || ... || hash(rank W-1))).

    Constant size, so it travels with the rest of a rank's step-boundary state.
    """

    def __init__(self, hexdigest: str = "0" * 64, steps: int = 0) -> None:
        self.hexdigest = hexdigest
        self.steps = steps

    def update(self, rank_hashes: list[bytes]) -> None:
        global_batch = hashlib.sha256(b"".join(rank_hashes)).digest()
        self.hexdigest = hashlib.sha256(bytes.fromhex(self.hexdigest) + global_batch).hexdigest()
        self.steps += 1

    def to_json(self) -> dict[str, object]:
        return {"hexdigest": self.hexdigest, "steps": self.steps}
