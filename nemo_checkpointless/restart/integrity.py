"""The cross-replica check at a step boundary (`integrity.every_n_steps`, and after every recovery): every rank
of the world gives the digests of its parameters and of its optimizer shard (`state.integrity.crc`), they are
all-gathered (16 bytes a rank), and the same verdict is reached everywhere (`state.integrity.judge`):

- ok: the last verified step moves here;
- repair: each rank in a minority receives the state of a majority rank holding the same shard, p2p, exactly as a
  replacement does (`RecoveryEngine.transfer`: one packed buffer, its sha256 checked); a rank found bad
  `fence_after` times is fenced: it ends its process, and the launcher replaces it like a crash;
- rollback: no majority says which copy is right (N = 2): every rank leaves `fit` and enters it again from the
  newest persistent checkpoint at or before the last verified step (`RestartFromCheckpoint`); without one, from
  the seeded initial state. Training is deterministic, so the run still ends equal to the fault-free one.

Each check that found something is one record (`records`): step, kind, ranks, digests, decision, what was
repaired or rolled back to. The number of checks and their cost are counted.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from nemo_checkpointless.restart.groups import PeerFailure
from nemo_checkpointless.restart.recovery import Decision, Participant, RecoveryEngine, RestartFromCheckpoint
from nemo_checkpointless.state.integrity import judge
from nemo_checkpointless.topology import ParallelDims, replica_groups

log = logging.getLogger(__name__)


class Checked(Participant, Protocol):
    def integrity_digests(self) -> tuple[int, int, bool]:
        """(digest of the full parameters, digest of this rank's optimizer shard: parameter slice + state, whether
        both are all finite)."""
        ...


@dataclass
class IntegrityCheck:
    engine: RecoveryEngine
    dims: ParallelDims
    every_n_steps: int = 50
    fence_after: int = 2
    checks: int = 0
    check_s: float = 0.0  # the checks' whole time, the wait for the slowest rank in the all-gather included
    digest_s: float = 0.0  # of which this rank's digests
    bytes_digested: int = 0
    last_verified: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)
    strikes: dict[int, int] = field(default_factory=dict)  # rank -> times its copy was found bad
    # After a recovery: the boundary at which every rank checks, the end of the first step trained after it (the
    # same on survivors, which may be in the middle of that step, and on the ranks that joined)
    pending: int | None = None

    def due(self, step: int) -> bool:
        if self.pending is not None and step >= self.pending:
            return True
        return bool(self.every_n_steps and step and step % self.every_n_steps == 0)

    def run(self, participant: Checked, step: int, held_bytes: int) -> str:
        """The check at boundary `step` (every rank of the world calls it). Returns the action taken ("ok",
        "repair"); raises `RestartFromCheckpoint` on a rollback, `PeerFailure` if a peer fails meanwhile."""
        self.pending = None
        t0 = time.perf_counter()
        membership = self.engine.membership
        world = membership.world()
        params, shard, finite = participant.integrity_digests()
        self.digest_s += time.perf_counter() - t0
        # The last verified step rides along: a replacement knows none, its peers do (they check together).
        outs = [torch.empty(4, dtype=torch.int64) for _ in range(world.size)]
        world.all_gather(outs, torch.tensor([params, shard, self.last_verified, int(finite)], dtype=torch.int64))
        by_rank = dict(zip(world.ranks, (o.tolist() for o in outs), strict=True))
        self.last_verified = max(v[2] for v in by_rank.values())
        verdict = judge({r: v[0] for r, v in by_rank.items()}, {r: v[1] for r, v in by_rank.items()},
                        replica_groups(self.dims), {r: bool(v[3]) for r, v in by_rank.items()})
        self.checks += 1
        self.bytes_digested += held_bytes
        if verdict.action == "ok":
            self.last_verified = step
            self.check_s += time.perf_counter() - t0
            return "ok"
        me = membership.rank
        record: dict[str, Any] = {"step": step, "kind": "replica_mismatch", "ranks": list(verdict.bad),
                                  "digests": {str(r): [f"{v[0]:08x}", f"{v[1]:08x}"] for r, v in by_rank.items()},
                                  "decision": verdict.action, "reason": verdict.reason}
        log.warning("rank %d: integrity check at step %d: %s -> %s", me, step, verdict.reason, verdict.action)
        if verdict.action == "repair":
            decision = Decision("p2p", step, verdict.bad, dict(verdict.sources), verdict.reason)
            ok = self.engine.transfer(participant, decision)
            flags = torch.tensor([0 if ok else 1], dtype=torch.int64)
            world.all_reduce(flags)
            if not int(flags[0]):
                record["repaired_from"] = {str(r): s for r, s in verdict.sources.items()}
                self.records.append(record)
                self.last_verified = step
                self.check_s += time.perf_counter() - t0
                for r in verdict.bad:
                    self.strikes[r] = self.strikes.get(r, 0) + 1
                if me in verdict.bad and self.strikes[me] >= self.fence_after:
                    print(f"[rank {me}] integrity: this rank's copy was found bad {self.strikes[me]} times "
                          f"(integrity.fence_after={self.fence_after}): fenced, its process ends and a spare "
                          "takes its place", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return "repair"
            record["decision"] = "rollback"
            record["reason"] += "; the repair failed its checksum"
        target = self.engine.checkpoints.latest(self.last_verified) if self.engine.checkpoints is not None else 0
        record["rolled_back_to"] = target
        self.last_verified = target
        self.records.append(record)
        self.check_s += time.perf_counter() - t0
        raise RestartFromCheckpoint(Decision("checkpoint", target, verdict.bad, {},
                                             f"integrity check at step {step}: {record['reason']}; rolling back to "
                                             f"the last verified state (step {target})"), membership.generation,
                                    recovery=False)

    def summary(self) -> dict[str, Any]:
        return {"every_n_steps": self.every_n_steps, "checks": self.checks, "check_s": round(self.check_s, 4),
                "digest_s": round(self.digest_s, 4), "bytes_digested": self.bytes_digested,
                "digest_gb_per_s": round(self.bytes_digested / self.digest_s / 1e9, 3) if self.digest_s else None,
                "records": self.records}


__all__ = ["Checked", "IntegrityCheck", "PeerFailure"]
