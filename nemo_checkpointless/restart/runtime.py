"""`RankRuntime`: what every door does on a rank around its training step, whatever the framework.

A door (the Lightning strategy, the NeMo strategy, and the next ones) maps its framework's hooks onto these calls
and supplies a participant (`Steward`: its training state as the recovery engine and the checks see it). The
runtime owns the rest:

- the step boundary (`at_boundary`): the restore a (re)entered training loop starts from verified before the
  first step trains on it, else the replicas' vote when due and before every persistent checkpoint, then the
  checkpoint when due, by the ranks that write it;
- the per-step checks on what rode the step's collective: the copies of a shard that differ (`copies_differ`:
  the vote on the boundary's state), a non-finite gradient attributed to its rank (`judge_norms`);
- after a recovery (`recovered`): the decision kept, its record stamped, the replicas compared after the first
  step that follows;
- the end of training (`end_barrier`): the vote on the final state, then no rank leaves before every rank has
  completed the last step;
- the summary's `integrity` section.

What differs between doors stays in the door: where a failure is caught (in the step, or out of the training loop),
how the loop is entered again, where the data position lives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from nemo_checkpointless.restart import progress
from nemo_checkpointless.restart.integrity import Checked, IntegrityCheck, NanGuard, checks_from_settings
from nemo_checkpointless.restart.recovery import Decision
from nemo_checkpointless.restart.session import Session


class Steward(Checked, Protocol):
    """A door's participant as the runtime uses it, beyond the engine's `Participant` and `Checked`."""

    checkpoint_shared_prefix: str | None  # tensors equal on every shard, written by shard 0 only (None: none)

    def held_bytes(self) -> int:
        """The bytes a vote digests on this rank."""
        ...

    def adopt_loaded_rng(self) -> None:
        """A state was loaded at this boundary (a repair): its RNG is the boundary's, restored now."""
        ...

    def shard_digest(self) -> int:
        """The per-step replica digest of this rank's shard (`state.integrity.word_sum`)."""
        ...


@dataclass
class RankRuntime:
    """One rank's per-step duties (see the module). `whole`: a callable, whether every rank of the layout takes
    part in this generation (a shrunk world has dropped copies: nothing to compare them with)."""

    session: Session
    integrity: IntegrityCheck
    nan_guard: NanGuard
    whole: Callable[[], bool] = lambda: True
    # The boundary the current training loop entered at with a restored state (-1: a fresh start), and how that
    # state was restored when it is still to be verified there ("p2p" or "checkpoint", and for p2p which rank each
    # replaced rank received from).
    entered_at: int = -1
    to_verify: tuple[str, dict[int, int]] | None = None
    from_checkpoint: bool = False  # the loop entered from the checkpoint of `entered_at` (not written again)
    writer_instance: int = 0  # the optimizer instance whose ranks write the persistent checkpoint
    step_digest_s: float = 0.0  # this rank's time on its per-step shard digests
    decisions: list[Decision] = field(default_factory=list)

    @classmethod
    def create(cls, session: Session, every: int | None, nan_policy: str | None, owner: str,
               whole: Callable[[], bool] | None = None) -> RankRuntime:
        """From a door's arguments (None: the launcher's settings), validated once for every door; `owner` names the
        door's class in the message of a bad value."""
        check, guard = checks_from_settings(session.engine, session.dims, session.env.rank, every, nan_policy, owner)
        return cls(session, check, guard, whole or (lambda: True))

    # --------------------------------------------------------------------------------------------- predicates
    @property
    def compares(self) -> bool:
        """The replicas can be compared: the world is whole and has more than one rank."""
        return self.whole() and self.session.env.world_size >= 2

    @property
    def votes(self) -> bool:
        """The periodic vote is on (and can run)."""
        return self.compares and bool(self.integrity.every_n_steps)

    def digests_every_step(self, num_instances: int) -> bool:
        """The per-step replica digest rides the step's collective: the vote is on and a shard has a replica."""
        return self.votes and num_instances >= 2

    def checkpoint_due(self, step: int) -> bool:
        every = self.session.checkpoint_every
        return bool(every and step and step % every == 0)

    def final_vote_due(self, step: int) -> bool:
        """The vote on the final state, unless the loop entered at that boundary (its restore was verified)."""
        return self.votes and step != self.entered_at

    # --------------------------------------------------------------------------------------- the boundary
    def entering(self, step: int, restored: tuple[str, dict[int, int]] | None, *, from_checkpoint: bool = False,
                 verify_now: Steward | None = None) -> None:
        """A training loop (re)enters at boundary `step` with a state restored `restored` ("p2p" or "checkpoint",
        and for p2p which rank each replaced rank received from; None: a fresh start). The restore is verified
        before the first step trains on it: now, with the peers that verify it at the same point (`verify_now`,
        the participant), else at the boundary (`at_boundary`, every rank of the generation entering there)."""
        self.entered_at = step if restored is not None else -1
        self.from_checkpoint = from_checkpoint
        self.to_verify = None
        if restored is None:
            return
        if verify_now is not None:
            how, sources = restored
            self.verify_restore(verify_now, step, sources, how)
        else:
            self.to_verify = restored

    def at_boundary(self, participant: Steward, step: int, *, writes_checkpoint: bool, slot: int) -> str | None:
        """Before step `step + 1` trains: the entry's restore verified (`IntegrityCheck.verify_restore`), else the
        replicas' vote when due or before a checkpoint (a checkpoint is written only once they agree); then this
        rank's checkpoint slot when due. Returns the vote's verdict ("ok", "repair"; None: no vote). Raises
        `RestartFromCheckpoint` (a rollback) and `PeerFailure` (a peer lost meanwhile) to the door."""
        checkpoint_due = self.checkpoint_due(step)
        verdict = None
        if step == self.entered_at:
            if self.to_verify is not None:
                how, sources = self.to_verify
                self.to_verify = None
                self.verify_restore(participant, step, sources, how)
        elif self.compares and (self.integrity.due(step) or (checkpoint_due and self.integrity.every_n_steps)):
            verdict = self.vote(participant, step)
        checkpoints = self.session.checkpoints
        if (checkpoint_due and writes_checkpoint and checkpoints is not None
                and not (self.from_checkpoint and step == self.entered_at)):
            self.session.beacon.mark(step, progress.CHECKPOINT)
            tensors, meta = participant.boundary_state()
            checkpoints.save_shard(step, slot, tensors, meta, shared_prefix=participant.checkpoint_shared_prefix)
        return verdict

    def vote(self, participant: Steward, step: int) -> str:
        """The replicas' vote on the state of boundary `step` (every rank of the world): "ok" or "repair" (this
        rank's state, RNG included, is now a majority rank's); a rollback raises `RestartFromCheckpoint`."""
        verdict = self.integrity.run(participant, step, participant.held_bytes())
        if verdict == "repair":
            participant.adopt_loaded_rng()
        return verdict

    def verify_restore(self, participant: Steward, step: int, sources: Mapping[int, int], how: str) -> None:
        """`IntegrityCheck.verify_restore` where the replicas can be compared (the periodic vote on or off)."""
        if self.compares:
            self.integrity.verify_restore(participant, step, sources, how)

    # ---------------------------------------------------------------------------------- the per-step checks
    def step_digest(self, participant: Steward) -> int:
        t0 = time.perf_counter()
        digest = participant.shard_digest()
        self.step_digest_s += time.perf_counter() - t0
        return digest

    def copies_differ(self, slots: torch.Tensor, ranks: Any) -> bool:
        """Whether some shard's copies differ, from every rank's per-step digest (`IntegrityCheck.copies_differ`)."""
        return self.integrity.copies_differ(slots, ranks)

    def judge_norms(self, step: int, norms: Mapping[int, float], samples: Callable[[], Any]) -> str:
        """The NaN guard's verdict on step `step`'s gradient norms, one a rank: "ok", "rerun" or "skip"."""
        return self.nan_guard.judge(step, norms, samples)

    # ------------------------------------------------------------------------------------- recovery, the end
    def recovered(self, decision: Decision) -> None:
        """After a recovery the door stayed in its step for: the decision kept, its record stamped at the first
        step after it, and nobody checks at the decision's boundary any more (the survivors that met the loss in
        that check left it, a replacement enters after it); the replicas are compared after the next step."""
        self.decisions.append(decision)
        self.session.stamps.track(self.session.membership.generation)
        self.integrity.pending = decision.step + 1
        self.entered_at = decision.step
        self.from_checkpoint = False

    def end_barrier(self, participant: Steward, step: int) -> None:
        """The end of training, every rank: the replicas vote on the final state before any rank hands it over
        (unless the loop entered at that boundary), then no rank leaves before every rank has completed the last
        step (a rank lost in it is recovered while its peers are all still here). Raises `PeerFailure`."""
        if self.final_vote_due(step):
            self.vote(participant, step)
            self.entered_at = step  # voted: a recovery in the barrier below does not vote again
        self.session.membership.world().all_reduce(torch.zeros(1))

    def integrity_summary(self, **extra: Any) -> dict[str, Any]:
        """`summary.json["integrity"]`: the checks and their records (`IntegrityCheck.summary`, the NaN guard's
        included) and this rank's time on the per-step digests, with what the door adds."""
        return {**self.integrity.summary(), "step_digest_s": round(self.step_digest_s, 4), **extra}
