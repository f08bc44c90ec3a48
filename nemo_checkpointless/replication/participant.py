"""`ShardedParticipant`: a rank's `ShardedOptimizer` state as the recovery engine's participant (`restart.recovery`'s
`Participant`, `restart.integrity`'s `Checked`), whatever framework drives the training loop.

What a rank's state is at a step boundary: the full parameters (one flat buffer per param group), its optimizer
shard's state, the LR schedulers' and param groups' learning rates, the RNG taken at the boundary, the data digest
(every global batch so far) and the data position. The participant outlives a door's `fit`: the data digest and the
boundary RNG carry over when the training loop is entered again, and a door gives it the optimizer of each `fit`
(`sharded`). It copies no big tensor on the fault-free path: the boundary state is views of the live buffers, which
no rank changes before every rank has completed the step's gradient reduction.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from nemo_checkpointless.replication.sharded_optimizer import ShardedOptimizer
from nemo_checkpointless.state.hashing import DataDigest, state_digest
from nemo_checkpointless.state.integrity import crc
from nemo_checkpointless.state.rng import capture_rng, restore_rng

log = logging.getLogger(__name__)

STATE_VERSION = 1
RngState = tuple[dict[str, Any], dict[str, torch.Tensor]]


class Scheduler(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class Position(Protocol):
    step: int


class ShardedParticipant:
    """One rank's training state around a `ShardedOptimizer` (set per `fit`: `sharded`).

    Args:
        position: the data position a loaded state moves (its `step`).
        schedulers: the LR schedulers of the current `fit`, in order (a callable: a door rebuilds them per `fit`).
        dp_size, world_size, num_instances, shard_index: the layout a loaded state must match.
        host_copies: what is sent, checkpointed or kept is a host copy (the buffers live on a GPU).
    """

    rolls_forward = True
    checkpoint_shared_prefix: str | None = "param."  # the full parameters, equal on every shard: shard 0 writes them

    def __init__(self, position: Position, schedulers: Callable[[], Sequence[Scheduler]], *, dp_size: int,
                 world_size: int, num_instances: int, shard_index: int, host_copies: bool = False) -> None:
        self.position = position
        self.schedulers = schedulers
        self.dp_size, self.world_size = dp_size, world_size
        self.num_instances, self.shard_index = num_instances, shard_index
        self.host_copies = host_copies
        self.sharded: ShardedOptimizer | None = None
        self.data_digest = DataDigest()
        self.boundary: RngState | None = None  # the RNG at the boundary of the step in flight
        self.rng_to_restore: RngState | None = None  # a loaded state's RNG, restored at the next boundary

    @property
    def optimizer(self) -> ShardedOptimizer:
        assert self.sharded is not None, "no optimizer yet: the participant is given one when fit sets up"
        return self.sharded

    @property
    def completed_steps(self) -> int:
        return self.optimizer.completed_steps

    # ------------------------------------------------------------------------------------------ the boundary
    def at_step_boundary(self) -> None:
        """Before a step's first micro-batch: a loaded state's RNG comes back, and the boundary's RNG is taken."""
        if self.rng_to_restore is not None:
            restore_rng(*self.rng_to_restore)
            self.rng_to_restore = None
        self.boundary = capture_rng()

    def adopt_loaded_rng(self) -> None:
        """After a state was loaded at this boundary (a repair by the replicas' vote): its RNG is the boundary's,
        restored now and kept for a replay or a replacement."""
        if self.rng_to_restore is not None:
            self.boundary, self.rng_to_restore = self.rng_to_restore, None
            restore_rng(*self.boundary)

    def restore_boundary_rng(self) -> None:
        assert self.boundary is not None
        restore_rng(*self.boundary)

    # ----------------------------------------------------------------------- the recovery engine's view
    def progress(self) -> tuple[int, int]:
        # The sharded optimizer's phase 2 (its shard updated, the instance's all-gather in flight) is the engine's
        # `recovery.GATHERING`: the phase in which a survivor can be rolled forward.
        return self.optimizer.completed_steps, self.optimizer.phase

    def finish_step(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The step in flight completed from a replica that completed it. In `GATHERING` (this rank's instance lost a
        partner in the parameter all-gather, after this rank had updated its own shard, which the replica's equals;
        the integrity check compares them after the recovery): the parameters. In phase 0 (the gradient all-reduce
        completed on the replica, not here): the shard's state and the data digest too. Its RNG, schedule and data
        position are already the step's (its forward and backward ran; the scheduler steps after)."""
        sharded = self.optimizer
        if meta["step"] != sharded.completed_steps + 1:
            raise ValueError(f"parameters of step {meta['step']} offered to finish step {sharded.completed_steps + 1}")
        if sharded.phase == 0:
            self._load_shard(tensors)
            self.data_digest = DataDigest(meta["data_digest"]["hexdigest"], meta["data_digest"]["steps"])
        sharded.complete_from([tensors[f"param.group{i}"] for i in range(len(sharded.groups))])

    def rewind_step(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The step in flight undone from a replica at its boundary: this rank updated its shard (and its instance's
        all-gather may have written parts of the parameters) for a step whose gradient all-reduce other survivors
        never completed. The replica's parameters and shard state are the boundary's; this rank's RNG at the
        boundary, schedule and data position already are, so the step runs again from them (its gradients too:
        the all-reduce consumed them)."""
        sharded = self.optimizer
        if sharded.phase != 2 or meta["step"] != sharded.completed_steps:
            raise ValueError(f"state of step {meta['step']} offered to undo step {sharded.completed_steps + 1} "
                             f"(phase {sharded.phase}): only a rank with its shard updated is rewound")
        self.load_state(tensors, meta)
        self.rng_to_restore = None  # the boundary's RNG is this rank's own (`boundary`), restored by the replay
        sharded.rewind()

    def data_digest_hex(self) -> str:
        return self.data_digest.hexdigest

    def boundary_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        sharded = self.optimizer
        assert self.boundary is not None
        rng_meta, rng_tensors = self.boundary
        tensors: dict[str, torch.Tensor] = dict(rng_tensors)
        for i, g in enumerate(sharded.groups):
            tensors[f"param.group{i}"] = g.flat
        for name, t in sharded.shard_state().items():
            if not name.endswith(".param"):
                tensors[f"shard.{name}"] = t
        if self.host_copies:
            tensors = {name: t.to("cpu", copy=True) if t.is_cuda else t for name, t in tensors.items()}
        meta = {
            "version": STATE_VERSION,
            "step": sharded.completed_steps,
            "world_size": self.world_size,
            "num_instances": self.num_instances,
            "shard_index": self.shard_index,
            "lrs": [g["lr"] for g in sharded.optimizer.param_groups],
            "schedulers": json.loads(json.dumps([s.state_dict() for s in self.schedulers()])),
            "rng": rng_meta,
            "data_digest": self.data_digest.to_json(),
            "data_position": {"step": sharded.completed_steps, "dp_size": self.dp_size},
        }
        return tensors, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        sharded = self.optimizer
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"state version {meta.get('version')}, this build reads {STATE_VERSION}")
        if meta["data_position"]["dp_size"] != self.dp_size:
            raise ValueError(f"state saved with data-parallel size {meta['data_position']['dp_size']}, "
                             f"this job has {self.dp_size}: the data position would not be exact")
        if meta["shard_index"] != self.shard_index or meta["num_instances"] != self.num_instances:
            raise ValueError(f"state of shard {meta['shard_index']} (N={meta['num_instances']}) offered to shard "
                             f"{self.shard_index} (N={self.num_instances})")
        opt = sharded.optimizer
        for i, g in enumerate(sharded.groups):
            g.flat.copy_(tensors[f"param.group{i}"])
        self._load_shard(tensors)
        for group, lr in zip(opt.param_groups, meta["lrs"], strict=True):
            group["lr"] = lr
        for scheduler, sd in zip(self.schedulers(), meta["schedulers"], strict=True):
            scheduler.load_state_dict(sd)
        self.rng_to_restore = (meta["rng"], {k: v for k, v in tensors.items() if k.startswith("rng.")})
        self.data_digest = DataDigest(meta["data_digest"]["hexdigest"], meta["data_digest"]["steps"])
        sharded.completed_steps = meta["step"]
        self.position.step = meta["step"]

    def _load_shard(self, tensors: dict[str, torch.Tensor]) -> None:
        """The optimizer state of this rank's shard, from a state's `shard.*` tensors."""
        sharded = self.optimizer
        opt = sharded.optimizer
        for i, g in enumerate(sharded.groups):
            # Shard-shaped state goes to the shard's device; scalars (AdamW's `step`) stay on the host unless the
            # optimizer keeps them on the device (capturable / fused), as the optimizer itself would create them.
            on_device = bool(opt.param_groups[i].get("capturable") or opt.param_groups[i].get("fused"))
            opt.state[g.shard] = {name.split(".", 2)[2]: t.to(g.flat.device if on_device or t.shape == g.shard.shape
                                                              else "cpu", copy=True)
                                  for name, t in tensors.items() if name.startswith(f"shard.group{i}.")}

    # --------------------------------------------------------------------------------- the integrity checks
    def integrity_digests(self) -> tuple[int, int, bool]:
        sharded = self.optimizer
        flats = [g.flat for g in sharded.groups]
        shard = [t for _, t in sorted(sharded.shard_state().items())]
        # A NaN or an infinity anywhere makes the sum one: a pass that allocates nothing.
        finite = all(math.isfinite(float(t.sum())) for t in [*flats, *shard] if t.is_floating_point())
        return crc(flats), crc(shard), finite

    def shard_digest(self) -> int:
        """The per-step replica digest of this rank's shard (`ShardedOptimizer.shard_digest`)."""
        return self.optimizer.shard_digest()

    def held_bytes(self) -> int:
        """The bytes a vote digests on this rank: the full parameters and the shard's state."""
        sharded = self.optimizer
        return sum(g.flat.numel() * g.flat.element_size() for g in sharded.groups) + sum(
            t.numel() * t.element_size() for t in sharded.shard_state().values())

    def flip_bit(self, target: str = "shard") -> None:
        """Fault plan kinds `bitflip` and `corrupt_restore`: one bit flipped in memory, silently. `target` "shard":
        this rank's optimizer shard (the first optimizer state tensor, e.g. AdamW's exp_avg; before the first step,
        the shard's parameter slice); "param": this rank's copy of the parameters, outside its own shard (memory
        corrupted at rest, which the next forward would use)."""
        sharded = self.optimizer
        if target == "param":
            g = sharded.groups[0]
            index = (g.hi + g.flat.numel() // 3) % g.flat.numel()  # outside [lo, hi) when the shard is a part
            if g.lo <= index < g.hi:
                index = (g.hi + 1) % g.flat.numel()
            g.flat.view(torch.int32)[index] ^= 1 << 12
            log.info(f"bitflip: bit 12 of element {index} of the parameters")
            return
        state = sharded.shard_state()
        name = next((n for n in sorted(state) if not n.endswith(".param") and state[n].numel() > 1), None)
        flat = (state[name] if name is not None else state["group0.param"]).detach().view(-1).view(torch.int32)
        flat[flat.numel() // 3] ^= 1 << 12
        log.info(f"bitflip: bit 12 of element {flat.numel() // 3} of {name or 'group0.param'}")

    def poison_gradient(self) -> None:
        """Fault plan kinds `nan` and `nan_batch`: one element of this rank's gradient made NaN."""
        grad = next(p.grad for p in self.optimizer.parameters() if p.grad is not None)
        grad.view(-1)[0] = float("nan")

    # ------------------------------------------------------------------------------------------ the digests
    def rank_state_digests(self) -> dict[str, str]:
        """This rank's own view, no collective: sha256 of its full parameters and of its optimizer shard (state
        and parameter slice). Two runs agree on a rank exactly when that rank's state is bitwise equal."""
        sharded = self.optimizer
        params = {f"group{i}": g.flat for i, g in enumerate(sharded.groups)}
        return {"params_sha256": state_digest(params, {}),
                "shard_sha256": state_digest({}, {"shard": sharded.shard_state()})}

    def full_state_digest(self) -> str:
        """Hash of all params and optimizer state (collective over each instance; every rank gets its instance's)."""
        params, state = self.optimizer.full_state()
        return state_digest(params, state)
