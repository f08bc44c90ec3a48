"""A rank's state as one flat byte buffer: named tensors + a JSON header, with a sha256 of the whole.

Used both for peer-to-peer transfer (one buffer on the wire instead of one message per tensor) and for the
persistent fallback checkpoint on disk. Only raw tensor bytes and JSON: nothing is unpickled on the way in.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

FORMAT = "nemo_checkpointless.state/1"

_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class PackError(ValueError):
    """A packed buffer is corrupt, truncated, or of another format version."""


def pack(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> torch.Tensor:
    """uint8 buffer: [8-byte header length][JSON header][tensor bytes, in header order]."""
    entries, chunks, offset = [], [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        entries.append({"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": offset,
                        "nbytes": raw.numel()})
        chunks.append(raw)
        offset += raw.numel()
    header = json.dumps({"format": FORMAT, "meta": meta, "tensors": entries}).encode()
    size = torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([size, torch.frombuffer(bytearray(header), dtype=torch.uint8), *chunks])


def unpack(buf: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inverse of `pack`; raises PackError on anything malformed (never returns a wrong tensor silently)."""
    if buf.dtype != torch.uint8 or buf.numel() < 8:
        raise PackError("buffer too short")
    hlen = int(buf[:8].clone().view(torch.int64)[0])
    if not 0 < hlen <= buf.numel() - 8:
        raise PackError(f"bad header length {hlen}")
    try:
        header = json.loads(bytes(buf[8 : 8 + hlen].tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackError(f"bad header: {e}") from e
    if header.get("format") != FORMAT:
        raise PackError(f"format {header.get('format')!r}, expected {FORMAT!r}")
    body = buf[8 + hlen :]
    out: dict[str, torch.Tensor] = {}
    for entry in header["tensors"]:
        start, n, dtype = entry["offset"], entry["nbytes"], entry["dtype"]
        if start + n > body.numel() or dtype not in _DTYPES:
            raise PackError(f"tensor {entry['name']} out of bounds or of unknown dtype")
        raw = body[start : start + n].clone()
        out[entry["name"]] = (raw.view(_DTYPES[dtype]).reshape(entry["shape"]) if n
                              else torch.empty(entry["shape"], dtype=_DTYPES[dtype]))
    return out, header["meta"]


def checksum(buf: torch.Tensor) -> str:
    return hashlib.sha256(buf.numpy().tobytes()).hexdigest()
