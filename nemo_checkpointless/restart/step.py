"""The optimizer step of a door whose participant sums the gradients itself (`replication.ShardedOptimizer`: the
Lightning door; a plain loop next), as the runtime drives it (`Summing`, `SummingParticipant`): the
gradient all-reduce with what rides it (`restart.channel.SideChannel`), the per-step checks on what it brought, the
update, and what a failure in it does. The door supplies what only it knows (`StepHooks`): how to compute the
step's gradients again from its boundary, how it recovers, whether the step made collectives of its own.

A failure (`PeerFailure`) in the step: the door recovers (`StepHooks.recover`: a p2p decision, or it leaves the
step by `RestartFromCheckpoint`); then the step is retried from its gradient all-reduce with the gradients this rank
still holds, or computed again first when the step made collectives of its own before it (a replacement makes them
for the first time) or this rank was rewound (its gradients went into an all-reduce the others never completed);
a rank rolled forward has the step done. A copy that differs from its replicas: the gradients are dropped, the
replicas vote on the boundary's state, the step runs again. A non-finite gradient: the NaN guard's verdict (run
again, skip the batch, or stop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nemo_checkpointless.restart.channel import SideChannel
from nemo_checkpointless.restart.faults import Injector
from nemo_checkpointless.restart.groups import Membership, PeerFailure
from nemo_checkpointless.restart.recovery import Decision
from nemo_checkpointless.restart.runtime import RankRuntime, Steward
from nemo_checkpointless.state.hashing import DataDigest


class Summing(Protocol):
    """The optimizer step of a participant that sums the gradients itself (`ShardedOptimizer`)."""

    completed_steps: int

    def reduce_gradients(self, side_channel: torch.Tensor | None = None,
                         local_norm_at: int | None = None) -> torch.Tensor | None: ...

    def discard(self, count_step: bool) -> None: ...

    def apply(self) -> None: ...


class SummingParticipant(Steward, Protocol):
    """A participant around a `Summing` optimizer (`replication.ShardedParticipant`)."""

    num_instances: int
    data_digest: DataDigest

    @property
    def optimizer(self) -> Summing: ...

    def flip_bit(self, target: str = "shard") -> None: ...


@dataclass(frozen=True)
class StepHooks:
    recompute: Callable[[], None]  # back to the step's boundary (RNG, no gradients), its micro-batches again
    recover: Callable[[PeerFailure], Decision]  # raises RestartFromCheckpoint when peers cannot help
    made_collectives: Callable[[], bool]  # the step made collectives of its own before its gradient all-reduce
    samples: Callable[[], Any]  # the sample ids of the step's micro-batches (for a NaN record)


def run_step(runtime: RankRuntime, participant: SummingParticipant, membership: Membership, faults: Injector,
             channel: SideChannel, side: torch.Tensor, step: int, hooks: StepHooks) -> bool:
    """Step `step` from its gradient all-reduce (this rank's gradients computed, `side` composed) to done: the
    participant's step counted, its data record extended. Returns whether a shrunk world agreed, in this step's
    sum, to grow back after it (every rank sees the same sum)."""
    sharded, rank = participant.optimizer, membership.rank
    compare = True  # the replicas' digests this step (off once a vote found equal states: never loop on it)
    replay = False
    summed: torch.Tensor | None = None
    while True:
        digests = compare and runtime.digests_every_step(participant.num_instances)  # the world may have shrunk
        summed = None  # until this attempt's gradient all-reduce completes here
        try:
            if replay:
                hooks.recompute()
                replay = False
            if digests:
                channel.put_digest(side, rank, runtime.step_digest(participant))
            summed = sharded.reduce_gradients(side, local_norm_at=channel.norm_at(rank))
            assert summed is not None
            ranks = membership.world().ranks
            if digests and runtime.copies_differ(channel.digests(summed), ranks):
                # A copy of an optimizer shard differs from its replicas before this step's update reads it: the
                # gradients are dropped, the replicas vote on the boundary's state (a repair, or a rollback that
                # leaves the step), and every rank runs the step again.
                sharded.discard(count_step=False)
                replay = True
                if runtime.vote(participant, step - 1) == "ok":  # equal states cannot give unequal sums
                    compare = False
                continue
            verdict = runtime.judge_norms(step, channel.norms(summed, ranks), hooks.samples)
            if verdict == "rerun":
                sharded.discard(count_step=False)
                replay = True
                continue
            if verdict == "skip":
                sharded.discard(count_step=True)
            else:
                faults.kill_in_gather(step)  # fault plan kind kill, target gather
                sharded.apply()
            break
        except PeerFailure as failure:
            replay = replay or hooks.made_collectives()
            decision = hooks.recover(failure)
            if sharded.completed_steps == step:  # rolled forward: completed from a replica (`finish_step`)
                break
            # Rewound (`rewind_step`): past the gradient all-reduce the others never completed, this rank's own
            # gradients went into it; it computes them again from the boundary.
            replay = replay or rank in decision.rewound
    if faults.flip_param_now():  # fault plan kind bitflip, target param
        participant.flip_bit("param")
    if summed is None:
        # The all-reduce failed here and completed on the others: the step came from a replica, its data record
        # with it (`finish_step`), in a whole world only (`recovery.decide`): nobody grows back.
        return False
    participant.data_digest.update(channel.hashes(summed))
    return membership.active is not None and channel.grow(summed)
