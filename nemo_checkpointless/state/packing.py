"""A rank's state as one flat byte buffer: named tensors + a JSON header, with a sha256 of the whole.

Used for the peer-to-peer transfer of a rank's state (one buffer on the wire instead of one message per tensor);
the persistent checkpoint on disk is safetensors (`state.checkpoint`). Only raw tensor bytes and JSON: nothing is
unpickled on the way in. Why not safetensors bytes here too: measured by `scripts/bench_packing.py` (an 87 MB
rank-like state), `safetensors.torch.save` + `load` took 1.6x the time of `pack` + `unpack`, 2.8x with the
conversions between `bytes` and the uint8 tensor that is sent.

`DTYPES` is the one table of the dtypes the package writes as raw bytes (this buffer, the data cache).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

FORMAT = "nemo_checkpointless.state/1"



def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of `dtype` without "torch." ("float32"): its key in `DTYPES`, if `DTYPES` holds it."""
    return str(dtype).removeprefix("torch.")


# Every dtype stored as raw bytes with its name beside it, by `dtype_name`.
DTYPES: dict[str, torch.dtype] = {dtype_name(d): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


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
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise PackError(f"format {header.get('format') if isinstance(header, dict) else header!r}, "
                        f"expected {FORMAT!r}")
    body = buf[8 + hlen :]
    out: dict[str, torch.Tensor] = {}
    try:
        for entry in header["tensors"]:
            name, start, n, shape = entry["name"], int(entry["offset"]), int(entry["nbytes"]), entry["shape"]
            # The header names torch's dtype ("torch.float32"), as `pack` writes it.
            dtype = DTYPES.get(str(entry["dtype"]).removeprefix("torch."))
            if dtype is None or start < 0 or start + n > body.numel() or any(int(d) < 0 for d in shape):
                raise PackError(f"tensor {name} out of bounds or of unknown dtype")
            if n != _numel(shape) * torch.empty(0, dtype=dtype).element_size():
                raise PackError(f"tensor {name}: {n} bytes do not hold shape {shape} of {dtype}")
            raw = body[start : start + n].clone()
            out[name] = raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
        meta = header["meta"]
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, PackError):
            raise
        raise PackError(f"bad header entry: {e!r}") from e
    return out, meta


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def checksum(buf: torch.Tensor) -> str:
    return hashlib.sha256(buf.numpy().tobytes()).hexdigest()
