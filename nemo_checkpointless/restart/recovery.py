"""The recovery protocol: agree on where everyone is, then restore the replaced ranks from a live replica or,
when no replica can help, everyone from the persistent checkpoint.

Who calls what (generation g+1 has been published by the launcher; see `launcher.local`):
- a survivor, on `PeerFailure` inside a step: `RecoveryEngine.recover(participant)`;
- a replacement (hot spare or fresh process), before its first step: `RecoveryEngine.join(participant)`.
Both then run the same collectives over the new generation's world group, in the same order:
  1. all-gather one small report per rank: role, completed steps, phase of the step in flight, data digest;
  2. every rank computes the same `Decision` from the reports (pure function `decide`);
  3. p2p: each source sends its packed state (one header + one flat buffer) to the replacement it serves; the
     replacement verifies the sha256 and loads it; 4. an all-reduce of "ok" flags: a bad checksum anywhere
     turns the decision into a checkpoint fallback for everyone.
A fault during these steps raises `PeerFailure` again; the engine moves to the next generation and starts over,
at most `max_attempts` times in a row, then raises `RecoveryError` saying so.

A generation may train on a shrunk world (`GenerationInfo.active`, see `topology.shrink`): a survivor left out of
it raises `Parked` and waits for the job to grow back (`wait_to_rejoin`); a survivor whose world changed shape
(shrunk or grown back) raises `Reshape` after the agreement, and enters `fit` again with its own state (nothing to
receive: it is at the step boundary), trained from then on in the new shape. Growing back without a fault starts
from `regroup`, at a step boundary the shrunk world agreed on.

A p2p recovery requires every survivor to be at the same step boundary R (completed R steps, the gradient
all-reduce of step R+1 not yet done on any rank) with the same data digest: a replica whose step disagrees is
never used. One exception, for a participant that can finish a step from a replica's parameters
(`Participant.rolls_forward`): a rank lost after the gradient all-reduce of step R and before its optimizer
instance's parameter all-gather leaves its instance partners one step behind, their own shards already updated
for step R (`GATHERING`), while the other instances completed step R. Those partners are rolled forward: each
receives the parameters of step R from a replica at R (`Participant.finish_step`), so nobody goes back a step.
The same for a survivor whose gradient all-reduce of step R failed (R-1 completed, phase 0) while it completed on
the others (its gradients went into it): it receives its shard's state and the parameters of step R.
The mirror case, for the same participants: a gloo all-reduce does not complete on every rank at once, so a rank
lost inside the gradient all-reduce of step R+1 may leave some survivors past it (their shards updated for R+1,
`GATHERING` with R completed) while the others never got its result (R completed, phase 0). Those ahead are rewound:
each takes its shard and parameters of boundary R back from a replica at R (`Participant.rewind_step`) and runs
step R+1 again with everyone. Anything else (survivors further apart, or a participant that cannot) goes to the
checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nemo_checkpointless.errors import RecoveryError
from nemo_checkpointless.protocol import (
    GENERATION_KEY,
    LAUNCHER_PID_ENV,
    STEP_TIMES_KEY,
    GenerationInfo,
    generation_info_key,
    record_key,
    regroup_key,
)
from nemo_checkpointless.restart.faults import Injector
from nemo_checkpointless.restart.groups import CollectiveTimeout, Membership, PeerFailure, alive_key, hang_key
from nemo_checkpointless.state.checkpoint import CheckpointStore
from nemo_checkpointless.state.packing import PackError, checksum, pack, unpack
from nemo_checkpointless.topology import ParallelDims, plan_recovery, rank_info

log = logging.getLogger(__name__)

SURVIVOR, REPLACEMENT = 0, 1
# The phase a participant reports when its own shard is updated for the step in flight and it waits for its
# optimizer instance's parameter all-gather (0: the step's gradient all-reduce has not completed).
GATHERING = 2
_REPORT = 5  # role, completed steps, phase, steps in the data digest (= completed steps), data digest prefix


class RecoveryStamps:
    """The timings a rank writes, which the launcher turns into `summary.json`: after a recovery, the first step it
    completes (`first_step`) and the step at which it is back where the fault interrupted it (`caught_up`, the
    generation's `target_step` when the launcher knows it); and on rank 0, the time every step completes
    (`STEP_TIMES_KEY`: one append to the launcher's store per step, about 0.1 ms), from which the launcher
    computes the job time a fault cost (`restart.cost`). A replacement of rank 0 carries on appending, and a
    restarted job appends the steps it redoes again."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store = store
        self.rank = rank
        self.pending: dict[int, bool] = {}  # generation -> first step already stamped?

    def track(self, generation: int) -> None:
        self.pending.setdefault(generation, False)

    lead: bool | None = None  # whether this rank appends the step times (None: rank 0 does)

    def stamp(self, completed_steps: int) -> None:
        """Call after every completed step (cheap when nothing is pending)."""
        now = time.time()
        if self.lead if self.lead is not None else self.rank == 0:
            self.store.append(STEP_TIMES_KEY, f"{completed_steps} {now:.6f};")  # type: ignore[attr-defined]
        if not self.pending:
            return
        for generation in list(self.pending):
            key = record_key(generation, self.rank)
            entry = json.dumps({"t": now, "step": completed_steps})
            if not self.pending[generation]:
                self.store.set(key + "/first_step", entry)
                self.pending[generation] = True
            info_key = generation_info_key(generation)
            if not self.store.check([info_key]):  # not published (e.g. generation 0): nothing to catch up to
                del self.pending[generation]
                continue
            target = GenerationInfo.from_json(self.store.get(info_key)).target_step
            if target is None or completed_steps >= target:
                self.store.set(key + "/caught_up", entry)
                del self.pending[generation]


class Participant(Protocol):
    """The training side, as the recovery engine sees it (the Lightning strategy, the NeMo adapter, ...)."""

    def progress(self) -> tuple[int, int]:
        """(completed steps, phase of the step in flight: 0 = its gradient all-reduce has not completed)."""
        ...

    def data_digest_hex(self) -> str: ...

    def boundary_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a replica sends: state at the last step boundary (params, own shard, step, scheduler, RNG, data)."""
        ...

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None: ...

    # Whether a survivor left in `GATHERING` can complete its step from a replica's parameters (`finish_step`)
    # or undo it from a replica's boundary state (`rewind_step`); the same on every rank of a job.
    rolls_forward: bool

    def finish_step(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Complete the step in flight from `boundary_state()` of a replica that completed it: its parameters only
        (this rank's own shard, RNG, schedule and data are already those of the step)."""
        ...

    def rewind_step(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Undo the step in flight from `boundary_state()` of a replica at its boundary: this rank updated its shard
        for a step whose gradient all-reduce other survivors never completed; it takes the boundary's parameters and
        shard back (its RNG, schedule and data position are the boundary's already) and runs the step again."""
        ...


@dataclass(frozen=True)
class Decision:
    path: str  # "p2p" or "checkpoint"
    step: int  # the step boundary every rank resumes from
    replaced: tuple[int, ...]
    sources: dict[int, int] = field(default_factory=dict)
    reason: str = ""
    rolled_forward: tuple[int, ...] = ()  # survivors that complete step `step` from a replica (`finish_step`)
    rewound: tuple[int, ...] = ()  # survivors past step `step + 1`'s gradient all-reduce, back at `step`


class Reshape(Exception):  # a control-flow signal, not an error
    """Raised out of the training step (or from `regroup`) on a survivor whose world changed shape: leave `fit`
    and enter it again at `decision.step` with this rank's own state, in generation `generation`'s shape."""

    def __init__(self, decision: Decision, generation: int, active: tuple[int, ...] | None) -> None:
        shape = "the whole world" if active is None else f"ranks {list(active)}"
        super().__init__(f"training goes on from step {decision.step} on {shape} (generation {generation})")
        self.decision = decision
        self.generation = generation
        self.active = active


class Parked(Exception):  # a control-flow signal, not an error
    """Raised out of the training step on a survivor that does not train in the shrunk generation `generation`:
    leave `fit` and wait (`RecoveryEngine.wait_to_rejoin`) until the job grows back."""

    def __init__(self, generation: int, active: tuple[int, ...]) -> None:
        super().__init__(f"parked: generation {generation} trains on ranks {list(active)} until the job grows back")
        self.generation = generation
        self.active = active


class RestartFromCheckpoint(Exception):  # a control-flow signal, not an error
    """Raised out of the training step on a survivor: leave `fit`, reload step `step` from the checkpoint."""

    def __init__(self, decision: Decision, generation: int, recovery: bool = True) -> None:
        super().__init__(f"restart from the checkpoint of step {decision.step}: {decision.reason}")
        self.decision = decision
        self.generation = generation
        self.recovery = recovery  # False: not a recovery of a generation (the integrity check's rollback)


def decide(dims: ParallelDims, reports: Sequence[Sequence[int]], checkpoints: CheckpointStore | None,
           ranks: Sequence[int] | None = None, roll_forward: bool = False) -> Decision:
    """The recovery decision from every rank's report (identical on every rank: a pure function). `reports[i]`
    is the report of global rank `ranks[i]` (default: rank i). `roll_forward`: survivors one step behind, in
    `GATHERING`, may complete that step from a replica, and survivors past the gradient all-reduce that others
    never completed may undo their step from one (see the module's docstring)."""
    ranks = list(range(len(reports))) if ranks is None else list(ranks)
    by_rank = dict(zip(ranks, reports, strict=True))
    replaced = tuple(r for r, rep in by_rank.items() if rep[0] == REPLACEMENT)
    survivors = [r for r, rep in by_rank.items() if rep[0] == SURVIVOR]
    if not survivors:
        return _fallback(replaced, 0, checkpoints, "no rank survived")
    step = max(by_rank[r][1] for r in survivors)
    at_step = [r for r in survivors if by_rank[r][1] == step and by_rank[r][2] == 0]
    absent = [r for r in range(dims.world_size) if r not in by_rank]  # not in this world (a shrunk one)
    # Behind in phase 0: the gradient all-reduce of step `step` completed on the others, so this rank's gradients
    # went into it; only in the whole world (a shrunk world's ranks also learn from its sum whether to grow back).
    behind = [r for r in survivors if roll_forward and at_step and by_rank[r][1] == step - 1
              and (by_rank[r][2] == GATHERING or (by_rank[r][2] == 0 and not absent))]
    ahead = [r for r in survivors if roll_forward and at_step and by_rank[r][1] == step
             and by_rank[r][2] == GATHERING]
    digest = {(by_rank[r][3], by_rank[r][4]) for r in (*at_step, *ahead)}
    bad = [r for r in survivors if r not in (*at_step, *behind, *ahead)] if len(digest) == 1 else survivors
    if bad:
        return _fallback(replaced, min(by_rank[r][1] for r in survivors), checkpoints,
                         f"survivors {bad} are not at the common step boundary {step} (a replica whose step "
                         "disagrees is never used)")
    plan = plan_recovery(dims, (*replaced, *behind, *ahead), exclude=absent)
    past = (f"survivors {ahead} updated their shards for step {step + 1}, whose gradient all-reduce the others never "
            "completed")
    if not plan.recoverable:
        if behind:
            return _fallback(replaced, step - 1, checkpoints, f"survivors {behind} are one step behind the others "
                             f"and {plan.reason}")
        if ahead:
            return _fallback(replaced, step, checkpoints, f"{past}, and {plan.reason}")
        return _fallback(replaced, step, checkpoints, plan.reason)
    reason = "every lost shard has a live replica"
    if behind:
        reason += (f"; survivors {behind} did not complete step {step} (its gradient all-reduce or parameter "
                   "all-gather lost a rank) and complete that step from a replica")
    if ahead:
        reason += f"; {past}, and take their boundary {step} back from a replica"
    return Decision("p2p", step, replaced, dict(plan.sources), reason, tuple(behind), tuple(ahead))


def _fallback(replaced: tuple[int, ...], step: int, checkpoints: CheckpointStore | None, why: str) -> Decision:
    at = checkpoints.latest(step) if checkpoints is not None else 0
    return Decision("checkpoint", at, replaced, {}, why)


class RecoveryEngine:
    """Runs the protocol above for one rank. Holds nothing of Lightning; see `Participant`."""

    def __init__(self, membership: Membership, dims: ParallelDims, checkpoints: CheckpointStore | None,
                 max_attempts: int = 3, verify_checksum: bool = True) -> None:
        self.membership = membership
        self.dims = dims
        self.checkpoints = checkpoints
        self.max_attempts = max_attempts
        self.verify_checksum = verify_checksum
        self.checkpoint_slot = rank_info(dims, membership.rank).checkpoint_slot
        self.bytes_received = 0
        self.transfer_s = 0.0  # the last state this rank received: from its first byte asked to the state loaded
        # How much longer than its collective timeout the launcher may take to publish a generation (a fault that
        # waits for a starting spare before the job shrinks: replication.replacement_timeout_s).
        self.extra_patience_s = 0.0
        # The fault plan's hooks (`restart.faults.Injector`: kinds corrupt and corrupt_restore); None: no plan.
        self.faults: Injector | None = None

    @property
    def store(self) -> dist.Store:
        return self.membership.store

    def _next_generation(self, after: int) -> int:
        """Block until the launcher publishes a generation newer than `after`; return the newest."""
        # A hang costs the launcher up to one more collective timeout to find and kill the hung rank.
        patience = 2 * self.membership.timeout_s + 10 + self.extra_patience_s
        deadline = time.monotonic() + patience
        while True:
            if self.store.check([GENERATION_KEY]):
                current = int(self.store.get(GENERATION_KEY))
                if current > after:
                    return current
            if time.monotonic() > deadline:
                raise RecoveryError(f"rank {self.membership.rank}: the launcher published no new generation within "
                                    f"{patience:.0f} s of a failure (is the launcher alive?)")
            time.sleep(0.002)

    def recover(self, participant: Participant, failure: PeerFailure) -> Decision:
        """Survivor side: called with the `PeerFailure` a collective raised. Returns a p2p decision (then retry the
        step in flight) or raises `RestartFromCheckpoint`."""
        t_detect = time.time()
        log.warning("%s; recovering", failure)
        generation = self.membership.generation
        self.store.set(alive_key(generation, self.membership.rank), json.dumps(t_detect))
        if isinstance(failure, CollectiveTimeout):
            self.store.set(hang_key(generation), json.dumps({"rank": self.membership.rank, "t": t_detect}))
        return self._run(participant, SURVIVOR, self.membership.generation, {"detect_t": t_detect})

    def join(self, participant: Participant, generation: int) -> Decision:
        """Replacement side: join `generation` (or a newer one) and receive state. Never raises
        `RestartFromCheckpoint`: a replacement loads the checkpoint itself when the decision says so."""
        return self._run(participant, REPLACEMENT, generation - 1, {})

    def regroup(self, participant: Participant) -> Decision:
        """Survivor side of growing back without a fault: the shrunk world agreed (in its last gradient
        all-reduce) to grow after the step it completed, and every rank left `fit` at that boundary. Raises
        `Reshape` (the world is whole again) once the replacements have their state."""
        generation = self.membership.generation
        self.store.set(regroup_key(generation), json.dumps({"rank": self.membership.rank, "t": time.time()}))
        return self._run(participant, SURVIVOR, generation, {"detect_t": time.time()})

    def wait_to_rejoin(self) -> int:
        """A parked rank's wait (no time limit: a job may stay shrunk for hours) for a generation in which it trains
        again; returns it. Exits when the launcher is gone."""
        rank, after = self.membership.rank, self.membership.generation
        launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
        while True:
            try:
                current = int(self.store.get(GENERATION_KEY))
                for g in range(after + 1, current + 1):
                    info = GenerationInfo.from_json(self.store.get(generation_info_key(g)))
                    if info.active is None or rank in info.active:
                        return g
                after = current
            except RuntimeError as e:
                raise SystemExit(f"rank {rank} (parked): the launcher's store is gone ({e}); exiting") from None
            if launcher and os.getppid() != launcher:
                raise SystemExit(f"rank {rank} (parked): the launcher is gone; exiting")
            time.sleep(0.05)

    def _run(self, participant: Participant, role: int, after: int, record: dict[str, Any]) -> Decision:
        attempts = 0
        while True:
            generation = self._next_generation(after)
            info = GenerationInfo.from_json(self.store.get(generation_info_key(generation)))
            active = None if info.active is None else tuple(info.active)
            before = self.membership.active
            self.membership.advance(generation, active)
            if active is not None and self.membership.rank not in active:
                raise Parked(generation, active)
            try:
                decision = self._agree_and_transfer(participant, role)
            except PeerFailure as e:
                attempts += 1
                log.warning("recovery at generation %d failed (%s); attempt %d of %d", generation, e, attempts,
                            self.max_attempts)
                if attempts >= self.max_attempts:
                    raise RecoveryError(f"rank {self.membership.rank}: {attempts} consecutive recovery attempts "
                                        f"failed (limit {self.max_attempts}); last: {e}") from e
                after = generation
                continue
            record.update(role="survivor" if role == SURVIVOR else "replacement", path=decision.path,
                          completed=participant.progress()[0] if role == SURVIVOR else None,
                          step=decision.step, replaced=list(decision.replaced),
                          rolled_forward=list(decision.rolled_forward), rewound=list(decision.rewound),
                          decided_t=time.time(),
                          bytes_received=self.bytes_received, transfer_s=round(self.transfer_s, 4),
                          reason=decision.reason)
            self.store.set(record_key(generation, self.membership.rank), json.dumps(record))
            if role == SURVIVOR and decision.path == "checkpoint":
                raise RestartFromCheckpoint(decision, generation)
            if role == SURVIVOR and active != before:
                raise Reshape(decision, generation, active)
            return decision

    def _agree_and_transfer(self, participant: Participant, role: int) -> Decision:
        world = self.membership.world()
        done, phase = participant.progress() if role == SURVIVOR else (-1, 0)
        digest = participant.data_digest_hex() if role == SURVIVOR else "0" * 64
        mine = torch.tensor([role, done, phase, done, int(digest[:15], 16)], dtype=torch.int64)
        reports = [torch.empty(_REPORT, dtype=torch.int64) for _ in range(world.size)]
        world.all_gather(reports, mine)
        decision = decide(self.dims, [r.tolist() for r in reports], self.checkpoints, world.ranks,
                          roll_forward=participant.rolls_forward)
        ok = True
        self.bytes_received, self.transfer_s = 0, 0.0
        if decision.path == "p2p":
            ok = self._transfer(participant, decision)
        flags = torch.tensor([0 if ok else 1], dtype=torch.int64)
        world.all_reduce(flags)
        if int(flags[0]) and decision.path == "p2p":
            decision = _fallback(decision.replaced, decision.step, self.checkpoints,
                                 "a transfer failed its checksum; falling back")
        if decision.path == "checkpoint" and role == REPLACEMENT:
            self.load_checkpoint(participant, decision.step)
        return decision

    def transfer(self, participant: Participant, decision: Decision) -> bool:
        """Send each `decision.sources` rank's boundary state to the rank it serves, over the current world (also
        the integrity check's repair). False on a checksum or format failure here."""
        return self._transfer(participant, decision)

    def _transfer(self, participant: Participant, decision: Decision) -> bool:
        """Sources send, replacements receive and verify. Returns False on a checksum or format failure."""
        world, me = self.membership.world(), self.membership.rank
        ok = True
        for dst in sorted(decision.sources):
            src = decision.sources[dst]
            if me == src:
                tensors, meta = participant.boundary_state()
                buf = pack(tensors, meta)
                digest = bytes.fromhex(checksum(buf))
                if self.faults is not None and self.faults.corrupt_send():
                    buf[buf.numel() // 2] ^= 0x10
                header = torch.tensor([buf.numel(), *(int.from_bytes(digest[i : i + 8], "little", signed=True)
                                                      for i in range(0, 32, 8))], dtype=torch.int64)
                world.send(header, dst, tag=1)
                world.send(buf, dst, tag=2)
            elif me == dst:
                t0 = time.perf_counter()
                header = torch.empty(5, dtype=torch.int64)
                world.recv(header, src, tag=1)
                buf = torch.empty(int(header[0]), dtype=torch.uint8)
                world.recv(buf, src, tag=2)
                self.bytes_received = buf.numel()
                expected = b"".join(int(v).to_bytes(8, "little", signed=True) for v in header[1:].tolist())
                if self.verify_checksum and bytes.fromhex(checksum(buf)) != expected:
                    log.error("state from rank %d failed its checksum", src)
                    ok = False
                    continue
                try:
                    tensors, meta = unpack(buf)
                except PackError as e:
                    log.error("state from rank %d is malformed: %s", src, e)
                    ok = False
                    continue
                if me in decision.rolled_forward:
                    participant.finish_step(tensors, meta)
                elif me in decision.rewound:
                    participant.rewind_step(tensors, meta)
                else:
                    participant.load_state(tensors, meta)
                self.transfer_s = time.perf_counter() - t0  # the source's packing, the bytes, the checks, the load
                self._maybe_damage_restored()
        return ok

    def _maybe_damage_restored(self) -> None:
        """Fault plan kind `corrupt_restore`: the state this rank just restored may be damaged, after its checksum."""
        if self.faults is not None:
            self.faults.restored()

    def load_checkpoint(self, participant: Participant, step: int) -> None:
        """Load this rank's shard of checkpoint `step` (0: nothing to load, the seeded initial state stands)."""
        if step == 0:
            return
        assert self.checkpoints is not None
        participant.load_state(*self.checkpoints.load_rank_state(step, self.checkpoint_slot))
        self._maybe_damage_restored()


class ReceivedState:
    """The recovery engine's `Participant` for a replacement that has no model yet: it keeps what it receives."""

    def __init__(self) -> None:
        self.state: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None

    def progress(self) -> tuple[int, int]:
        return -1, 0

    def data_digest_hex(self) -> str:
        return "0" * 64

    def boundary_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        raise RuntimeError("a replacement has no state to send")

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.state = (tensors, meta)

    rolls_forward = True  # as `MegatronParticipant`: every rank of a job decides alike

    def finish_step(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        raise RuntimeError("a replacement has no step in flight")

    def rewind_step(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        raise RuntimeError("a replacement has no step in flight")
