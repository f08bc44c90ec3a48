"""Silent corruption caught by the replicas: a digest of what each rank holds, and the verdict from everyone's.

With N optimizer instances every shard lives on N ranks (its replica peers), bitwise equal, and every
data-parallel rank holds the same full parameters. So a rank's copy can be checked against its peers' at no
extra state: each rank digests its full parameters and its shard (the parameter slice and the optimizer state),
the digests are all-gathered (32 bytes a rank), and `judge` (pure, identical on every rank) says who disagrees:

- a value held by a strict majority of its copies wins; each rank in the minority is repaired p2p from a rank of
  the majority that holds the same shard (`Verdict.sources`);
- when no strict majority exists for some copy (N = 2 for a shard: two copies that differ; a tie), nothing says
  which one is right: the job rolls back to the last verified state (`Verdict.action == "rollback"`).

The digest is CRC-32 of the raw bytes (`zlib.crc32`): every flipped bit and every burst of up to 32 bits changes
it, and it runs at memory speed on one core, so a check costs a few milliseconds per GB held.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


def word_sum(tensors: Iterable[torch.Tensor]) -> int:
    """32 bits that every bitwise-equal copy of `tensors` shares: the sum of their 32-bit words (16-bit for 2-byte
    types, bytes for 1-byte ones), mod 2^32. One pass on the tensors' device, no copy, one host sync; any single
    flipped bit changes it. The per-step replica digest (`restart.integrity.IntegrityCheck.copies_differ`)."""
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        size = flat.element_size()
        if size >= 4 and flat.numel() * size % 4 == 0:
            words = flat.view(torch.int32)
        elif size == 2:
            words = flat.view(torch.int16)
        else:
            words = flat.view(torch.uint8)
        sums.append(words.sum(dtype=torch.int64))
    if not sums:
        return 0
    return int(torch.stack([x.to(sums[0].device) for x in sums]).sum()) & 0xFFFFFFFF


def crc(tensors: Iterable[torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes, in order (contiguous copies only where a tensor is not)."""
    value = 0
    for t in tensors:
        flat = t.detach().contiguous().view(-1).cpu()
        value = zlib.crc32(flat.view(torch.uint8).numpy().data, value)
    return value


@dataclass(frozen=True)
class Verdict:
    action: str  # "ok", "repair" or "rollback"
    bad: tuple[int, ...] = ()  # ranks whose copy disagrees with the majority (or, on a rollback, with a peer)
    sources: dict[int, int] = field(default_factory=dict)  # bad rank -> the majority rank it is repaired from
    reason: str = ""


def _majority(values: Mapping[int, int]) -> int | None:
    """The value a strict majority of `values` hold, else None."""
    value, count = Counter(values.values()).most_common(1)[0]
    return value if 2 * count > len(values) else None


def judge(params: Mapping[int, int], shards: Mapping[int, int], replica_groups: Sequence[Sequence[int]],
          finite: Mapping[int, bool] | None = None, param_groups: Sequence[Sequence[int]] | None = None) -> Verdict:
    """The verdict from every rank's digest of its parameters (`params`, rank -> digest; equal within each of
    `param_groups`, the ranks holding the same tensor/pipeline-parallel slice of the model; default: all ranks) and
    of its shard (`shards`; equal within each replica group: the ranks holding the same shard). A rank whose state is
    not all finite (`finite`) never counts with a majority: equal NaNs everywhere are no proof of health."""
    bad: set[int] = set()
    why: list[str] = []
    sick = sorted(r for r, ok in (finite or {}).items() if not ok)
    if sick:
        # A unique value per non-finite rank: it is outvoted where a finite majority exists, and rolls back otherwise.
        params = {r: (-1 - r if r in sick else v) for r, v in params.items()}
        shards = {r: (-1 - r if r in sick else v) for r, v in shards.items()}
        why.append(f"rank(s) {sick} hold non-finite values")
    for members in param_groups if param_groups is not None else [sorted(params)]:
        slice_params = {r: params[r] for r in members if r in params}
        if not slice_params:
            continue
        good_params = _majority(slice_params)
        if good_params is None:
            ranks = sorted(slice_params)
            return Verdict("rollback", tuple(ranks), {}, f"the parameters of ranks {ranks} disagree with no majority")
        odd = sorted(r for r, v in slice_params.items() if v != good_params)
        if odd:
            bad.update(odd)
            why.append(f"the parameters of rank(s) {odd} differ from the other {len(slice_params) - len(odd)} ranks'")
    for group in replica_groups:
        copies = {r: shards[r] for r in group}
        good = _majority(copies)
        if good is None:
            if len(set(copies.values())) > 1:
                return Verdict("rollback", tuple(sorted(group)), {},
                               f"the {len(group)} copies of one optimizer shard (ranks {list(group)}) differ and no "
                               "majority says which is right")
            continue
        odd = sorted(r for r, v in copies.items() if v != good)
        if odd:
            bad.update(odd)
            why.append(f"rank(s) {odd}' copy of the optimizer shard held by ranks {list(group)} differs")
    if not bad:
        return Verdict("ok")
    sources: dict[int, int] = {}
    for r in sorted(bad):
        group = next(g for g in replica_groups if r in g)
        peers = [p for p in group if p not in bad]
        if not peers:
            return Verdict("rollback", tuple(sorted(bad)), {},
                           f"every copy of the optimizer shard of rank {r} (ranks {list(group)}) is suspect")
        sources[r] = peers[0]
    return Verdict("repair", tuple(sorted(bad)), sources, "; ".join(why))
