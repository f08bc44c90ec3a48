"""The cross-replica check at a step boundary (`integrity.every_n_steps`, and after every recovery): every rank
of the world gives the digests of its parameters and of its optimizer shard (`state.integrity.crc`), they are
all-gathered (32 bytes a rank), and the same verdict is reached everywhere (`state.integrity.judge`):

- ok: the last verified step moves here;
- repair: each rank in a minority receives the state of a majority rank holding the same shard, p2p, exactly as a
  replacement does (`RecoveryEngine.transfer`: one packed buffer, its sha256 checked); a rank found bad
  `fence_after` times is fenced: it ends its process, and the launcher replaces it like a crash;
- rollback: no majority says which copy is right (N = 2): every rank leaves `fit` and enters it again from the
  newest persistent checkpoint at or before the last verified step (`RestartFromCheckpoint`); without one, from
  the seeded initial state. Training is deterministic, so the run still ends equal to the fault-free one.

Each check that found something is one record (`records`): step, kind, ranks, digests, decision, what was
repaired or rolled back to. The number of checks and their cost are counted.

Every restore is verified before the first step trains on it (`IntegrityCheck.verify_restore`): after a p2p
recovery, each replaced rank's digests must equal its source's; after any restore (p2p or checkpoint), the copies
of every shard and every rank's parameters must agree and be finite. A restore that fails rolls back to the newest
checkpoint at or before the last verified step; a second failed restore in a row stops the job with the story
(`stop_job`) instead of looping.

Non-finite gradients (`NanGuard`): each rank's own gradient norm rides in the gradient all-reduce's side channel,
so every rank knows whose contribution is not finite before any update. The step is run again from its boundary
(same RNG, same batches); a NaN that does not come back was transient (the rank is suspect: a strike, fenced after
`fence_after`); one that does comes from the batch, and `nan_policy` applies: `stop` the job naming the batch's
samples, or `skip` the batch (no update; the data moves on) with a record.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import torch

from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.protocol import (
    INTEGRITY_EVERY_ENV,
    INTEGRITY_FENCE_ENV,
    INTEGRITY_RECORDS_KEY,
    NAN_POLICY_ENV,
    STOP_KEY,
    samples_key,
)
from nemo_checkpointless.restart.groups import PeerFailure
from nemo_checkpointless.restart.recovery import Decision, Participant, RecoveryEngine, RestartFromCheckpoint
from nemo_checkpointless.restart.session import env_number
from nemo_checkpointless.state.integrity import judge
from nemo_checkpointless.topology import ParallelDims, data_parallel_groups, replica_groups

log = logging.getLogger(__name__)


class Checked(Participant, Protocol):
    def integrity_digests(self) -> tuple[int, int, bool]:
        """(digest of the full parameters, digest of this rank's optimizer shard: parameter slice + state, whether
        both are all finite)."""
        ...


STOPPED_EXIT_CODE = 3  # a job the ranks stopped on purpose (`stop_job`)
DIGEST_SLOTS = 4  # a rank's per-step shard digest in a summed side channel: 4 slots, a byte each (exact in any float)


def encode_digest(digest: int) -> torch.Tensor:
    """A rank's 32-bit shard digest as `DIGEST_SLOTS` floats, for its own slots of a side channel that is summed
    over the ranks (the others' slots are 0 there: the sum carries every rank's digest exactly)."""
    return torch.tensor(list(digest.to_bytes(DIGEST_SLOTS, "little")), dtype=torch.float32)


def stop_job(store: Any, rank: int, message: str | None, exit_code: int = STOPPED_EXIT_CODE,
             wait_s: float = 30.0) -> NoReturn:
    """End this rank's process and the job on purpose: the story goes to the launcher (`STOP_KEY`), which ends
    the job with it instead of replacing the ranks that left. Every rank that reached the same verdict calls it;
    one that does not hold the story (`message` None: another rank knows the batch) first waits up to `wait_s` for
    it to be told, so that the launcher never takes its exit for a fault."""
    if message is not None:
        store.set(STOP_KEY, json.dumps({"rank": rank, "message": message, "exit_code": exit_code}))
    else:
        deadline = time.monotonic() + wait_s
        while not store.check([STOP_KEY]) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not store.check([STOP_KEY]):
            message = "another rank was to stop the job and did not say why"
            store.set(STOP_KEY, json.dumps({"rank": rank, "message": message, "exit_code": exit_code}))
    log.error(f"stopping the job: {message or json.loads(store.get(STOP_KEY))['message']}")
    os._exit(exit_code)


def publish_records(store: Any, records: list[dict[str, Any]]) -> None:
    """The job's integrity records so far, in the store (every rank that reached the verdict writes the same): a
    process that starts later as a rank (a replacement of rank 0, a restarted job) begins with them
    (`published_records`), so that `summary.json` tells every one. Written only when a record is made."""
    store.set(INTEGRITY_RECORDS_KEY, json.dumps(records))


def published_records(store: Any) -> list[dict[str, Any]]:
    """The records `publish_records` left in the store (none yet: [])."""
    if not store.check([INTEGRITY_RECORDS_KEY]):
        return []
    records: list[dict[str, Any]] = json.loads(store.get(INTEGRITY_RECORDS_KEY))
    return records


def checks_from_settings(engine: RecoveryEngine, dims: ParallelDims, rank: int, every: int | None,
                         policy: str | None, owner: str) -> tuple[IntegrityCheck, NanGuard]:
    """A rank's replicas' vote and NaN guard, from a door's arguments (`every`, `policy`; None: the launcher's
    settings in the environment, else 50 and "stop"), validated once for every door; `owner` names the door's class
    in the message of a bad value. The records made before this process started (a replacement, a restarted job)
    come from the store (`published_records`)."""
    if every is None:
        every = int(env_number(INTEGRITY_EVERY_ENV, 50))
    if every < 0:
        raise ConfigError(f"{owner}(integrity_every_n_steps=...)", every, "must be >= 0",
                          "use 0 (no check) or a number of steps, e.g. 50")
    fence_after = int(env_number(INTEGRITY_FENCE_ENV, 2))
    store = engine.membership.store
    check = IntegrityCheck(engine, dims, every, fence_after, records=published_records(store))
    policy = policy or os.environ.get(NAN_POLICY_ENV) or "stop"
    if policy not in ("stop", "skip"):
        raise ConfigError(f"{owner}(nan_policy=...)", policy, "must be one of stop, skip",
                          "use stop (end the job, naming the batch) or skip (drop that batch, with a record)")
    return check, NanGuard(store, rank, policy, fence_after, records=check.records)


def _fence(rank: int, why: str) -> None:
    log.error(f"{why}: fenced, its process ends and a spare takes its place")
    os.kill(os.getpid(), signal.SIGKILL)


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
    failed_restores: int = 0  # restores in a row that failed `verify_restore`
    # After a recovery: the boundary at which every rank checks, the end of the first step trained after it (the
    # same on survivors, which may be in the middle of that step, and on the ranks that joined)
    pending: int | None = None

    def _keep(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        publish_records(self.engine.membership.store, self.records)

    def _slices(self) -> list[Any]:
        """The ranks that hold the same tensor/pipeline-parallel slice of the model (equal parameters)."""
        return data_parallel_groups(self.dims, with_context_parallel=True)

    def due(self, step: int) -> bool:
        if self.pending is not None and step >= self.pending:
            return True
        return bool(self.every_n_steps and step and step % self.every_n_steps == 0)

    def copies_differ(self, slots: torch.Tensor, ranks: Any) -> bool:
        """Whether the copies of some shard differ, from every rank's `encode_digest` summed into `slots`
        (`DIGEST_SLOTS` a rank, in rank order): the per-step check; a difference calls for `run` (the vote)."""
        values = slots.to(torch.int64).view(-1, DIGEST_SLOTS).tolist()
        digest = {r: bytes(values[r]) for r in ranks}
        return any(len({digest[r] for r in group}) > 1 for group in replica_groups(self.dims))

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
                        replica_groups(self.dims), {r: bool(v[3]) for r, v in by_rank.items()},
                        self._slices())
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
        log.warning("integrity check at step %d: %s -> %s", step, verdict.reason, verdict.action)
        if verdict.action == "repair":
            decision = Decision("p2p", step, verdict.bad, dict(verdict.sources), verdict.reason)
            ok = self.engine.transfer(participant, decision)
            flags = torch.tensor([0 if ok else 1], dtype=torch.int64)
            world.all_reduce(flags)
            if not int(flags[0]):
                record["repaired_from"] = {str(r): s for r, s in verdict.sources.items()}
                self._keep(record)
                self.last_verified = step
                self.check_s += time.perf_counter() - t0
                for r in verdict.bad:
                    self.strikes[r] = self.strikes.get(r, 0) + 1
                if me in verdict.bad and self.strikes[me] >= self.fence_after:
                    _fence(me, f"integrity: this rank's copy was found bad {self.strikes[me]} times "
                               f"(integrity.fence_after={self.fence_after})")
                return "repair"
            record["decision"] = "rollback"
            record["reason"] += "; the repair failed its checksum"
        target = self.engine.checkpoints.latest(self.last_verified) if self.engine.checkpoints is not None else 0
        record["rolled_back_to"] = target
        # Training is deterministic: copies that disagree again at the same step after a rollback disagree by design
        # (or by a fault that is not transient), and another rollback would loop. The records carry over restarts.
        again = any(r.get("kind") == "replica_mismatch" and r.get("step") == step and r.get("decision") == "rollback"
                    for r in self.records)
        self.last_verified = target
        if again:
            record["decision"] = "stop"
            self._keep(record)
            stop_job(membership.store, me, f"integrity check at step {step}: {record['reason']}, again after a "
                                           f"rollback to step {target}: the replicas disagree every time this step is "
                                           "reached, so the job stops instead of looping. Check the ranks named "
                                           "(memory, the node) and the model's determinism")
        self._keep(record)
        self.check_s += time.perf_counter() - t0
        raise RestartFromCheckpoint(Decision("checkpoint", target, verdict.bad, {},
                                             f"integrity check at step {step}: {record['reason']}; rolling back to "
                                             f"the last verified state (step {target})"), membership.generation,
                                    recovery=False)

    def verify_restore(self, participant: Checked, step: int, sources: Mapping[int, int], how: str) -> None:
        """After a restore at boundary `step` (`how`: "p2p" with `sources`, replaced rank -> the rank it received
        from; "checkpoint"), before the first step trains on it; every rank of the world calls it. Returns when the
        restored state agrees with its sources and its replicas and is finite; else raises `RestartFromCheckpoint`
        (the newest checkpoint at or before the last verified step), or stops the job (`stop_job`) when the restore
        before this one failed too."""
        t0 = time.perf_counter()
        membership = self.engine.membership
        world = membership.world()
        params, shard, finite = participant.integrity_digests()
        outs = [torch.empty(5, dtype=torch.int64) for _ in range(world.size)]
        mine = [params, shard, int(finite), self.last_verified, self.failed_restores]
        world.all_gather(outs, torch.tensor(mine, dtype=torch.int64))
        by_rank = dict(zip(world.ranks, (o.tolist() for o in outs), strict=True))
        self.last_verified = max(v[3] for v in by_rank.values())
        failed_before = max(v[4] for v in by_rank.values())
        problems: list[str] = []
        bad: set[int] = set()
        # The verdict is the replicas' (`judge`, the same on every rank); the sources known here only name who
        # sent what (a rank that kept its own state does not know them).
        for dst, src in sorted(sources.items()):
            what = [name for name, i in (("parameters", 0), ("optimizer shard", 1))
                    if by_rank[dst][i] != by_rank[src][i]]
            if what:
                bad.add(dst)
                problems.append(f"rank {dst}'s restored {' and '.join(what)} differ from its source rank {src}'s")
        verdict = judge({r: v[0] for r, v in by_rank.items()}, {r: v[1] for r, v in by_rank.items()},
                        replica_groups(self.dims), {r: bool(v[2]) for r, v in by_rank.items()},
                        self._slices())
        if verdict.action != "ok":
            bad.update(verdict.bad)
            problems.append(verdict.reason)
        self.check_s += time.perf_counter() - t0
        if not problems:
            self.failed_restores = 0
            self.last_verified = max(self.last_verified, step)
            return
        self.failed_restores = failed_before + 1
        me = membership.rank
        # With the periodic check on, every checkpoint is written once the replicas agreed (the last verified step
        # is at or after it); with it off, a checkpoint is as good as its checksums.
        bound = min(self.last_verified, step) if self.every_n_steps else step
        target = self.engine.checkpoints.latest(bound) if self.engine.checkpoints is not None else 0
        story = (f"the {how} restore at step {step} failed its verification: {'; '.join(problems)}")
        record: dict[str, Any] = {"step": step, "kind": "restore_mismatch", "source": how, "ranks": sorted(bad),
                                  "digests": {str(r): [f"{v[0]:08x}", f"{v[1]:08x}"] for r, v in by_rank.items()},
                                  "reason": story}
        if failed_before:
            record["decision"] = "stop"
            self._keep(record)
            stop_job(membership.store, me, f"{story}; the restore before it failed too, so the job stops instead "
                                           "of looping. Check the ranks named (memory, the node) and the "
                                           "checkpoint, then restart the job from the checkpoint")
        record.update(decision="rollback", rolled_back_to=target)
        self._keep(record)
        log.warning("%s; rolling back to step %d", story, target)
        self.last_verified = target
        raise RestartFromCheckpoint(Decision("checkpoint", target, tuple(sorted(bad)), {},
                                             f"{story}; rolling back to the last verified state (step {target})"),
                                    membership.generation, recovery=False)

    def summary(self) -> dict[str, Any]:
        return {"every_n_steps": self.every_n_steps, "checks": self.checks, "check_s": round(self.check_s, 4),
                "digest_s": round(self.digest_s, 4), "bytes_digested": self.bytes_digested,
                "digest_gb_per_s": round(self.bytes_digested / self.digest_s / 1e9, 3) if self.digest_s else None,
                "records": self.records}


@dataclass
class NanGuard:
    """The verdict on one step's gradients from every rank's own gradient norm (see the module doc). `judge` is
    called by every rank with the same norms (they come from the gradient all-reduce), so every rank reaches the
    same verdict: "ok" (apply the step), "rerun" (discard it and run it again from its boundary), "skip" (discard
    it, count it as done: the batch is dropped). A reproduced NaN under policy `stop` ends the job (`stop_job`)."""

    store: Any
    rank: int
    policy: str = "stop"
    fence_after: int = 2
    records: list[dict[str, Any]] = field(default_factory=list)
    strikes: dict[int, int] = field(default_factory=dict)  # rank -> transient non-finite gradients it gave
    _first: tuple[int, list[int]] | None = None  # (step, ranks) of the step's first, non-finite attempt

    def _keep(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        publish_records(self.store, self.records)

    def judge(self, step: int, norms: Mapping[int, float], samples: Callable[[], Any]) -> str:
        """`norms`: rank -> its own gradient norm this step; `samples()`: what this rank trained on in the step
        (sample ids per micro-batch), asked only when a record needs it."""
        sick = sorted(r for r, n in norms.items() if not math.isfinite(n))
        first, self._first = self._first, None
        if first is None or first[0] != step:
            if not sick:
                return "ok"
            log.warning("step %d: non-finite gradient from rank(s) %s; running the step again", step, sick)
            self._first = (step, sick)
            return "rerun"
        record: dict[str, Any] = {"step": step, "kind": "nonfinite_gradient", "ranks": first[1],
                                  "norms": {str(r): norms[r] if math.isfinite(norms[r]) else str(norms[r])
                                            for r in first[1]}}
        if not sick:  # it did not come back: the rank(s), not the batch (silent corruption, a flaky device)
            record.update(reproduced=False, decision="rerun")
            for r in first[1]:
                self.strikes[r] = self.strikes.get(r, 0) + 1
            record["strikes"] = {str(r): self.strikes[r] for r in first[1]}
            self._keep(record)
            log.warning(f"integrity: step {step}: the non-finite gradient of rank(s) {first[1]} did not "
                  "come back when the step ran again: the rank(s) are suspect, not the batch")
            if self.strikes.get(self.rank, 0) >= self.fence_after:
                _fence(self.rank, f"integrity: this rank gave a non-finite gradient that did not reproduce "
                                  f"{self.strikes[self.rank]} times (integrity.fence_after={self.fence_after})")
            return "ok"
        record.update(reproduced=True, ranks=sick, decision=self.policy)
        # Each rank it came from tells what it trained on; every rank's record gets it (rank 0 writes the summary).
        if self.rank in sick:
            self.store.set(samples_key(step, self.rank), json.dumps(samples()))
        record["samples"] = {}
        for r in sick:
            try:
                self.store.wait([samples_key(step, r)], datetime.timedelta(seconds=30))
                record["samples"][str(r)] = json.loads(self.store.get(samples_key(step, r)))
            except RuntimeError:  # that rank died meanwhile: the record says so
                record["samples"][str(r)] = None
        self._keep(record)
        story = (f"step {step}: the gradient of rank(s) {sick} is not finite, and again when the step ran again "
                 "with the same batch: the batch gives it")
        if self.policy == "stop":  # the first rank it came from tells the story; the others wait for it
            named = "; ".join(f"rank {r}: {json.dumps(v)}" for r, v in record["samples"].items())
            stop_job(self.store, self.rank, f"{story} ({named}). integrity.nan_policy=stop: fix or drop those "
                                            "samples, or use --nan-policy skip, and restart from the checkpoint"
                     if self.rank == sick[0] else None)
        log.warning(f"integrity: {story}; integrity.nan_policy=skip: the step's update is dropped and "
              "the data moves on")
        return "skip"

    def summary(self) -> list[dict[str, Any]]:
        return self.records


__all__ = ["DIGEST_SLOTS", "STOPPED_EXIT_CODE", "Checked", "IntegrityCheck", "NanGuard", "PeerFailure",
           "checks_from_settings", "encode_digest", "publish_records", "published_records", "stop_job"]
