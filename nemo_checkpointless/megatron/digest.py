"""The canonical digest of a Megatron job's state: equal for two runs exactly when every parameter and every
optimizer state value is bitwise equal, however the optimizer state is cut into shards (1 or N instances).

Each rank holds its TP/PP slice of the parameters in full and, of each parameter, the range its distributed-optimizer
shard covers (megatron-core's `_get_model_param_range_map`): the fp32 main copy and the torch optimizer's state of
that range. The ranks of one optimizer instance that hold the same slice (`topology.rank_info(...).shard_group`)
together cover every parameter; `slice_digest` gathers their ranges over that group and hashes, per parameter in
name order, the parameter and each state value whole. Imports megatron-core only through the optimizer it is given.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import torch

from nemo_checkpointless.megatron.participant import MegatronParticipant, distributed_optimizers

Piece = tuple[str, str, int, int, torch.Tensor]  # param name, state key, start, end (-1: a scalar), values


def shard_pieces(participant: MegatronParticipant, optimizer: Any) -> Iterator[Piece]:
    """This rank's ranges of every parameter's fp32 main copy (`main`) and optimizer state, by parameter name."""
    names = {id(p): name for name, p in participant.model_params()}
    for leaf in distributed_optimizers(optimizer):
        pairs = ((leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups),
                 (leaf.model_fp32_groups, leaf.shard_fp32_groups))
        for model_groups, shard_groups in pairs:
            for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
                for model_param, shard in zip(model_group, shard_group, strict=True):
                    if shard is None:
                        continue
                    span = leaf._get_model_param_range_map(model_param)["param"]
                    name = names[id(model_param)]
                    yield name, "main", span.start, span.end, shard.detach().reshape(-1)
                    for key, value in sorted(leaf.optimizer.state.get(shard, {}).items()):
                        if not isinstance(value, torch.Tensor):
                            continue
                        if value.numel() == shard.numel() and value.dim() > 0:
                            yield name, str(key), span.start, span.end, value.detach().reshape(-1)
                        else:
                            yield name, str(key), -1, -1, value.detach().reshape(-1)


def slice_digest(participant: MegatronParticipant, optimizer: Any, group: Any) -> str:
    """sha256 of this rank's TP/PP slice, whole: a collective over `group` (every rank of this instance that holds
    the same slice; a `restart.groups.Group`), which every member calls; every member gets the same digest."""
    pieces = list(shard_pieces(participant, optimizer))
    values = torch.cat([p[4].float() for p in pieces]) if pieces else torch.zeros(0)
    index = json.dumps([[n, k, a, b, p.numel()] for n, k, a, b, p in pieces]).encode()
    sizes = torch.tensor([values.numel(), len(index)], dtype=torch.int64)
    all_sizes = [torch.zeros_like(sizes) for _ in range(group.size)]
    group.all_gather(all_sizes, sizes)
    most_values, most_index = (max(int(s[i]) for s in all_sizes) for i in (0, 1))
    padded = torch.zeros(most_values)
    padded[: values.numel()] = values
    raw = torch.zeros(most_index, dtype=torch.uint8)
    raw[: len(index)] = torch.frombuffer(bytearray(index), dtype=torch.uint8) if index else raw[:0]
    all_values = [torch.zeros_like(padded) for _ in range(group.size)]
    all_raw = [torch.zeros_like(raw) for _ in range(group.size)]
    group.all_gather(all_values, padded)
    group.all_gather(all_raw, raw)
    params = dict(participant.model_params())
    whole: dict[tuple[str, str], torch.Tensor] = {}
    covered: dict[tuple[str, str], int] = {}
    for size, flat, raw_index in zip(all_sizes, all_values, all_raw, strict=True):
        offset = 0
        for name, key, start, end, numel in json.loads(bytes(raw_index[: int(size[1])].tolist()).decode() or "[]"):
            chunk = flat[offset: offset + numel]
            offset += numel
            if start < 0:  # a scalar (e.g. the step count): the same in every range
                whole.setdefault((name, key), chunk.clone())
                continue
            full = whole.setdefault((name, key), torch.zeros(params[name].numel()))
            full[start:end] = chunk
            covered[(name, key)] = covered.get((name, key), 0) + (end - start)
    for (name, key), count in covered.items():
        if count != params[name].numel():
            raise RuntimeError(f"{name}.{key}: the shards cover {count} of {params[name].numel()} values")
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].detach().float().contiguous().numpy().tobytes())
        for (pname, key) in sorted(k for k in whole if k[0] == name):
            h.update(key.encode())
            h.update(whole[(pname, key)].contiguous().numpy().tobytes())
    return h.hexdigest()
