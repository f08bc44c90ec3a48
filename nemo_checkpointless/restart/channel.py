"""`SideChannel`: what rides a step's gradient all-reduce, for a door whose participant sums the gradients itself
(`replication.ShardedOptimizer`'s `side_channel`).

The tail of the flat gradient buffer is summed over the ranks like the gradients; each rank writes only its own
slots and leaves the others 0, so the sum carries every rank's value exactly (x + 0 = x), and the step needs no
collective of its own for them. Layout for a world of W ranks:

- `[0, 32 W)`: each rank's batch hash, a byte a slot (`state.hashing.encode_hash`): the step's data record;
- `32 W`: a shrunk world's "grow back" flag (any rank asking makes the sum positive: every rank sees it);
- `[32 W + 1, 33 W + 1)`: each rank's own gradient norm, written by the all-reduce's caller (`local_norm_at`):
  the NaN guard attributes a non-finite gradient without another collective;
- `[33 W + 1, 37 W + 1)`: each rank's 32-bit shard digest, a byte a slot (`restart.integrity.encode_digest`): the
  per-step comparison of the replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_checkpointless.restart.integrity import DIGEST_SLOTS, encode_digest
from nemo_checkpointless.state.hashing import HASH_BYTES, decode_hashes, encode_hash


@dataclass(frozen=True)
class SideChannel:
    world: int  # the job's world size (a shrunk world keeps the whole world's layout)

    @property
    def numel(self) -> int:
        return self.world * (HASH_BYTES + 1 + DIGEST_SLOTS) + 1

    @property
    def _flag(self) -> int:
        return self.world * HASH_BYTES

    def norm_at(self, rank: int) -> int:
        """Where rank `rank`'s own gradient norm goes."""
        return self._flag + 1 + rank

    def compose(self, hashes: dict[int, bytes], grow: bool) -> torch.Tensor:
        """This rank's contribution: the hash of the micro-batches it trained for each rank it serves (itself, or
        in a shrunk world the ranks it stands in for), and whether it asks to grow back."""
        side = torch.zeros(self.numel)
        for slot, digest in hashes.items():
            side[:self._flag] += encode_hash(digest, slot, self.world)
        if grow:
            side[self._flag] = 1.0
        return side

    def put_digest(self, side: torch.Tensor, rank: int, digest: int) -> None:
        at = self._flag + 1 + self.world + DIGEST_SLOTS * rank
        side[at:at + DIGEST_SLOTS] = encode_digest(digest)

    def hashes(self, summed: torch.Tensor) -> list[bytes]:
        """Every rank's batch hash, in rank order."""
        return decode_hashes(summed[:self._flag])

    def grow(self, summed: torch.Tensor) -> bool:
        return bool(summed[self._flag] > 0)

    def norms(self, summed: torch.Tensor, ranks: Sequence[int]) -> dict[int, float]:
        return {r: float(summed[self.norm_at(r)]) for r in ranks}

    def digests(self, summed: torch.Tensor) -> torch.Tensor:
        """The shard digests' slots (`RankRuntime.copies_differ` reads them)."""
        return summed[self._flag + 1 + self.world:]
