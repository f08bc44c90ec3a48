"""A distributed optimizer with N replicated instances (Megatron's `num_distributed_optimizer_instances`).

Layout. The parameters of each optimizer param group are moved into one flat fp32 buffer, padded to a multiple
of the data-parallel size (so the gradient all-reduce has the same shape, hence the same summation order, for
every N). The data-parallel ranks form N instances of S = DP / N ranks; inside an instance the flat buffer is
split into S equal shards and the rank at shard position p owns shard p: the wrapped torch optimizer updates only
that slice (a `Parameter` aliasing it) and keeps state only for it. The rank at position p of every other
instance owns an identical copy: that is the replica a replacement is restored from.

A step (every DP rank calls `step`, once per training step, in the same order):
  1. all-reduce the flat gradients over the DP group and divide by DP (plus an optional small side channel
     that rides in the same buffer, used for the per-step batch hashes);
  2. clip by the global norm, computed locally from the full averaged gradient (no extra collective);
  3. the wrapped optimizer updates this rank's shard;
  4. all-gather the shards inside the instance, so every rank again holds the full parameters.
The update is elementwise, so results do not depend on N: N=1, 2 and DP give bitwise-equal training.

Device. The flat buffers live where the module's parameters are (one device for all of them): on a GPU the two
collectives run on CUDA tensors (NCCL, `restart.groups`), and nothing in a step waits on the host except the
side channel, which comes back to the CPU once per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from nemo_checkpointless.state.integrity import word_sum


class Collectives(Protocol):
    """The two collectives the optimizer runs; `restart.groups.Group` is one (this package does not import it, so
    that `replication/` and `restart/` do not depend on each other)."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None: ...


@dataclass
class _FlatGroup:
    params: list[tuple[str, nn.Parameter]]
    offsets: list[int]
    flat: torch.Tensor  # full parameters, padded
    shard: nn.Parameter  # alias of this rank's slice of `flat`
    lo: int
    hi: int


class ShardedOptimizer:
    """Wraps a torch optimizer built over `module`'s parameters and shards it as described in the module doc.

    `dp_group()` and `instance_group()` return the current groups (they change after a recovery); the instance
    group's members must be listed in shard-position order.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        dp_size: int,
        num_instances: int,
        shard_index: int,
        dp_group: Callable[[], Collectives],
        instance_group: Callable[[], Collectives],
        grad_clip: float = 0.0,
        side_channel_numel: int = 0,
    ) -> None:
        if num_instances < 1 or dp_size % num_instances:
            raise ValueError(f"replication.num_instances={num_instances}: must divide the data-parallel size "
                             f"{dp_size}; choose a divisor of {dp_size}")
        self.optimizer = optimizer
        self.dp_size = dp_size
        # What the summed gradients are divided by: the ranks that take part in the all-reduce. A shrunk world
        # (`topology.shrink`) sets its own size: each of its ranks then trains the micro-batches of the ranks it
        # serves, with the loss scaled by their number, so the average is over the same samples.
        self.average_over = dp_size
        self.shard_size = dp_size // num_instances
        self.shard_index = shard_index
        self._dp_group = dp_group
        self._instance_group = instance_group
        self.grad_clip = grad_clip
        self.side_channel_numel = side_channel_numel
        self.completed_steps = 0
        self.local_norm_s = 0.0  # time spent on this rank's own gradient norm (`local_norm_at`)
        # How far the step in flight got: 0 before the gradient all-reduce completed, 1 after it, 2 after the
        # shard update. The recovery protocol reads it: only phase 0 can be retried from a replica.
        self.phase = 0
        if optimizer.state:
            raise ValueError("ShardedOptimizer must wrap a fresh optimizer (its state is not empty)")
        names = {id(p): n for n, p in module.named_parameters()}
        devices = {p.device for pg in optimizer.param_groups for p in pg["params"]}
        if len(devices) > 1:
            raise ValueError(f"ShardedOptimizer keeps its parameters on one device; got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.groups: list[_FlatGroup] = []
        for pg in optimizer.param_groups:
            params = [(names[id(p)], p) for p in pg["params"] if p.requires_grad]
            self.groups.append(self._flatten(params))
            pg["params"] = [self.groups[-1].shard]
        total = sum(g.flat.numel() for g in self.groups)
        self.flat_grad = torch.zeros(total + side_channel_numel, device=self.device)

    def _flatten(self, params: list[tuple[str, nn.Parameter]]) -> _FlatGroup:
        numel = sum(p.numel() for _, p in params)
        padded = -(-numel // self.dp_size) * self.dp_size
        for _, p in params:
            if p.dtype != torch.float32:
                raise TypeError(f"ShardedOptimizer keeps fp32 parameters; got {p.dtype}")
        flat = torch.zeros(padded, dtype=torch.float32, device=self.device)
        offsets, off = [], 0
        for _, p in params:
            flat[off : off + p.numel()].copy_(p.detach().view(-1))
            p.data = flat[off : off + p.numel()].view_as(p)
            offsets.append(off)
            off += p.numel()
        shard_len = padded // self.shard_size
        lo = self.shard_index * shard_len
        return _FlatGroup(params, offsets, flat, nn.Parameter(flat[lo : lo + shard_len]), lo, lo + shard_len)

    # ----------------------------------------------------------------------------------------------- a step
    def reduce_gradients(self, side_channel: torch.Tensor | None = None,
                         local_norm_at: int | None = None) -> torch.Tensor | None:
        """Phase 1+2 (collective over DP): average the gradients, clip them. Returns the summed side channel.

        With `local_norm_at`, the 2-norm of this rank's own gradients (before the all-reduce) is written at that
        index of the side channel, whose other ranks leave it 0: the sum tells every rank each rank's norm, exactly
        (x + 0 = x), so a non-finite contribution is attributed without another collective.

        The parameters' own `.grad` are kept until the all-reduce succeeds, so a failed step can be retried with
        the gradients this rank already computed.
        """
        off = 0
        for g in self.groups:
            for (_, p), p_off in zip(g.params, g.offsets, strict=True):
                view = self.flat_grad[off + p_off : off + p_off + p.numel()]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.view(-1))
            off += g.flat.numel()
        tail = self.flat_grad[off:]
        if side_channel is not None:
            tail.copy_(side_channel)
        else:
            tail.zero_()
        if local_norm_at is not None:
            t0 = time.perf_counter()
            tail[local_norm_at] = torch.linalg.vector_norm(self.flat_grad[:off])
            self.local_norm_s += time.perf_counter() - t0
        self._dp_group().all_reduce(self.flat_grad)
        for p in self.parameters():
            p.grad = None
        self.phase = 1
        grads = self.flat_grad[:off]
        grads.div_(self.average_over)
        if self.grad_clip > 0:
            norm = torch.linalg.vector_norm(grads)
            # min(coef, 1) on the device, no host sync; x * 1.0 == x exactly, so an unclipped step is unchanged.
            grads.mul_(torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0))
        return tail.to("cpu", copy=True) if side_channel is not None else None

    def update_shard(self) -> None:
        """Phase 3 (local): the wrapped optimizer steps on this rank's shard."""
        off = 0
        for g in self.groups:
            g.shard.grad = self.flat_grad[off + g.lo : off + g.hi]
            off += g.flat.numel()
        self.optimizer.step()
        for g in self.groups:
            g.shard.grad = None
        self.phase = 2

    def gather_params(self) -> None:
        """Phase 4 (collective over the instance): every rank gets the full updated parameters."""
        group = self._instance_group()
        for g in self.groups:
            n = g.hi - g.lo
            outs = [g.flat[i * n : (i + 1) * n] for i in range(self.shard_size)]
            # gloo reads the input while writing outputs: give it a copy of our own slice.
            group.all_gather(outs, g.shard.detach().clone())

    def step(self, side_channel: torch.Tensor | None = None) -> torch.Tensor | None:
        """One whole step (all DP ranks call it). Retry-safe from phase 0 only."""
        assert self.phase == 0, f"a step cannot be retried from phase {self.phase}"
        summed = self.reduce_gradients(side_channel)
        self.apply()
        return summed

    def apply(self) -> None:
        """Phases 3+4 after `reduce_gradients`: update this rank's shard, gather the parameters; the step is done."""
        assert self.phase == 1, f"no reduced gradients to apply (phase {self.phase})"
        self.update_shard()
        self.gather_params()
        self.completed_steps += 1
        self.phase = 0

    def complete_from(self, flats: list[torch.Tensor]) -> None:
        """The step's full parameters, one flat tensor per group, from a replica that completed the step; the step
        is done. After `update_shard`, when the instance's parameter all-gather failed (a partner was lost); or in
        phase 0, when the gradient all-reduce failed here but completed on the replica, whose shard state the
        caller loaded (`ShardedParticipant.finish_step`): this rank's own gradients went into it, and are dropped."""
        assert self.phase in (0, 2), f"a step in phase {self.phase} cannot be completed from a replica"
        for g, flat in zip(self.groups, flats, strict=True):
            g.flat.copy_(flat)
        if self.phase == 0:
            for p in self.parameters():
                p.grad = None
        self.completed_steps += 1
        self.phase = 0

    def rewind(self) -> None:
        """After `update_shard`, once the shard, its state and the parameters of the step's boundary were loaded
        back (`ShardedParticipant.rewind_step`): the step is to run again from its gradient computation."""
        assert self.phase == 2, f"no updated shard to undo (phase {self.phase})"
        self.flat_grad.zero_()
        self.phase = 0

    def discard(self, count_step: bool) -> None:
        """After `reduce_gradients`: drop the reduced gradients, the shard and its state untouched (a step to run
        again, or one skipped). `count_step`: the step counts as done (a skipped batch: the data moves on)."""
        assert self.phase == 1, f"no reduced gradients to discard (phase {self.phase})"
        self.flat_grad.zero_()
        if count_step:
            self.completed_steps += 1
        self.phase = 0

    # ------------------------------------------------------------------------------------------- state views
    def shard_digest(self) -> int:
        """32 bits that every copy of this rank's shard (its parameter slice and its optimizer state) shares: the sum
        of the shard's 32-bit words (16-bit for 2-byte types, bytes for 1-byte ones), mod 2^32. One pass over the
        shard and its state on the device, no copy, one host sync; any single flipped bit changes it. The
        integrity check compares it across the replicas every step (`restart.integrity.IntegrityCheck`)."""
        return word_sum(self.shard_state().values())

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state (and shard of the parameters), by name: what a replica must hold equal."""
        out: dict[str, torch.Tensor] = {}
        for i, g in enumerate(self.groups):
            out[f"group{i}.param"] = g.shard.detach()
            for key, value in self.optimizer.state.get(g.shard, {}).items():
                if torch.is_tensor(value):
                    out[f"group{i}.{key}"] = value
        return out

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
        """(params by name, optimizer state by param name and key), gathered over the instance (collective).

        Per-shard scalars (e.g. AdamW's `step`) are equal on every shard and are reported once per param.
        """
        group = self._instance_group()
        params = {name: p.detach() for g in self.groups for name, p in g.params}
        state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in params}
        for g in self.groups:
            n = g.hi - g.lo
            for key, value in sorted(self.optimizer.state.get(g.shard, {}).items()):
                if not torch.is_tensor(value):
                    continue
                if value.shape != g.shard.shape:
                    for name, _ in g.params:
                        state[name][key] = value.detach().clone()
                    continue
                full = torch.empty_like(g.flat)
                group.all_gather([full[i * n : (i + 1) * n] for i in range(self.shard_size)], value.detach().clone())
                for (name, p), off in zip(g.params, g.offsets, strict=True):
                    state[name][key] = full[off : off + p.numel()].view_as(p)
        return params, state

    def parameters(self) -> Iterable[nn.Parameter]:
        return (p for g in self.groups for _, p in g.params)
