"""Object collectives without pickle: `torch.distributed.all_gather_object` and `broadcast_object_list` with JSON
on the wire.

torch's object collectives pickle each object and unpickle the bytes a peer sent; our rule is that no pickle
crosses a process boundary. Dependencies call them while `fit` sets up on the NeMo path: Lightning's
`DDPStrategy.broadcast` (`Trainer.log_dir`) and megatron-core's `get_megatron_optimizer` (every rank's
parameter-group keys, tuples of floats and booleans). The functions here take torch's arguments and send JSON:
None, booleans, numbers, strings, lists, string-keyed dicts, tuples and paths (tuples and paths are tagged and come
back as themselves: megatron compares the keys it gathers with its own tuples). Any other object stops the
collective on every rank with one `TypeError` naming its type and the rank that holds it (each rank sends the size
of what it encoded, or -1, with its first bytes: nobody waits for bytes that will not come).
`json_object_collectives()` puts them in place of torch's for a block.

One collective where the objects are small (up to `INLINE` bytes of JSON each, as in both uses above): the size
and the bytes travel in one fixed-size block, and only a larger object takes a second collective for the rest
(torch's take two or three). Each is a point where every rank waits for the last, and a re-entered `fit` runs
several.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed as dist

_TUPLE = "__ncl_tuple__"
_PATH = "__ncl_path__"
_RULE = ("object collectives send JSON here (None, bool, int, float, str, list, tuple, path, dict with str keys), "
         "never a pickle")


class _NotJson(TypeError):
    pass


def _encode(obj: Any) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(x) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x) for x in obj]
    if isinstance(obj, PurePath):
        return {_PATH: str(obj)}
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {k: _encode(v) for k, v in obj.items()}
    raise _NotJson(type(obj).__qualname__ if not isinstance(obj, dict) else "dict with a key that is not a str")


def _decode_hook(d: dict[str, Any]) -> Any:
    if len(d) == 1 and _TUPLE in d:
        return tuple(d[_TUPLE])
    if len(d) == 1 and _PATH in d:
        return Path(d[_PATH])
    return d


def to_bytes(obj: Any) -> bytes:
    """`obj` as JSON (tuples and paths tagged); `TypeError` for anything else."""
    try:
        return json.dumps(_encode(obj), separators=(",", ":")).encode()
    except _NotJson as e:
        raise TypeError(f"cannot send a {e}: {_RULE}") from None


def from_bytes(data: bytes) -> Any:
    return json.loads(data.decode(), object_hook=_decode_hook)


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encoded(obj: Any) -> tuple[torch.Tensor | None, str]:
    try:
        return torch.frombuffer(bytearray(to_bytes(obj)), dtype=torch.uint8), ""
    except TypeError as e:
        return None, str(e)


INLINE = 4088  # bytes of JSON that travel with the size (a block of 4 KiB)
_HEADER = 8  # the size, an int64 (-1: the object is not JSON)


def _block(payload: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The size of `payload` (-1 for None) and its first `INLINE` bytes, in one block."""
    block = torch.zeros(_HEADER + INLINE, dtype=torch.uint8)
    block[:_HEADER] = torch.tensor([payload.numel() if payload is not None else -1], dtype=torch.int64).view(
        torch.uint8)
    if payload is not None:
        head = payload[:INLINE]
        block[_HEADER:_HEADER + head.numel()] = head
    return block.to(device)


def _size(block: torch.Tensor) -> int:
    return int(block[:_HEADER].cpu().view(torch.int64).item())


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """`torch.distributed.all_gather_object`, with JSON: `object_list[i]` becomes rank i's `obj`."""
    device = _device(group)
    payload, error = _encoded(obj)
    world = dist.get_world_size(group)
    blocks = [torch.empty(_HEADER + INLINE, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(blocks, _block(payload, device), group=group)
    counts = [_size(b) for b in blocks]
    if error or -1 in counts:
        raise TypeError(error or f"all_gather_object: the object of group rank {counts.index(-1)} is not JSON: {_RULE}")
    top = max(counts)
    if top <= INLINE:
        datas = [b[_HEADER:_HEADER + n] for b, n in zip(blocks, counts, strict=True)]
    else:  # one object at least is larger: every rank sends the whole of its own, padded to the largest
        assert payload is not None
        padded = torch.zeros(top, dtype=torch.uint8, device=device)
        padded[: payload.numel()] = payload.to(device)
        outs = [torch.empty(top, dtype=torch.uint8, device=device) for _ in range(world)]
        dist.all_gather(outs, padded, group=group)
        datas = [out[:n] for out, n in zip(outs, counts, strict=True)]
    for i, data in enumerate(datas):
        object_list[i] = from_bytes(data.cpu().numpy().tobytes())


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """`torch.distributed.broadcast_object_list`, with JSON: every rank's `object_list` becomes `src`'s (`src` a
    global rank, or `group_src` a rank in `group`)."""
    if src is None:
        src = dist.get_global_rank(group, group_src) if group is not None and group_src is not None else 0
    dev = torch.device(device) if device is not None else _device(group)
    mine = dist.get_rank() == src
    payload, error = _encoded(list(object_list)) if mine else (None, "")
    block = _block(payload, dev) if mine else torch.empty(_HEADER + INLINE, dtype=torch.uint8, device=dev)
    dist.broadcast(block, src, group=group)
    n = _size(block)
    if n < 0:
        raise TypeError(error or f"broadcast_object_list: an object of rank {src} is not JSON: {_RULE}")
    if n <= INLINE:
        data = block[_HEADER:_HEADER + n]
    else:
        data = payload.to(dev) if payload is not None else torch.empty(n, dtype=torch.uint8, device=dev)
        dist.broadcast(data, src, group=group)
    if not mine:
        object_list[:] = from_bytes(data.cpu().numpy().tobytes())


@contextlib.contextmanager
def json_object_collectives() -> Iterator[None]:
    """Inside the block, `torch.distributed.all_gather_object` and `broadcast_object_list` are this module's."""
    saved = dist.all_gather_object, dist.broadcast_object_list
    dist.all_gather_object, dist.broadcast_object_list = all_gather_object, broadcast_object_list
    try:
        yield
    finally:
        dist.all_gather_object, dist.broadcast_object_list = saved
