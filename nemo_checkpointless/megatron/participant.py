"""`MegatronParticipant`: Megatron's distributed-optimizer shards as the recovery engine's `Participant`.

The recovery engine (`restart.recovery`) moves one rank's state as named tensors + JSON. This adapter reads and
writes that state from megatron-core objects, whoever built them (NeMo's `MegatronStrategy`, or megatron-core
directly); it imports neither NeMo nor Lightning:

- the full model parameters (`model.<chunk>.<name>`; equal on every data-parallel rank at a step boundary);
- for every `DistributedOptimizer` (NeMo's optimizer wrapper and megatron's `ChainedOptimizer` are unwrapped), the
  wrapped torch optimizer's params: these are the fp32 main params of this rank's shard
  (`opt<i>.group<g>.param<j>.main`), and their per-parameter state, whatever its keys
  (`...state.<key>`: `exp_avg`, `exp_avg_sq`, `step` for torch AdamW on CPU; TE/apex FusedAdam keeps others and
  param-group counters). Non-tensor state values and param-group hyper-parameters travel in the JSON part;
- RNG at the step boundary: Python, NumPy, torch CPU (and CUDA where present) plus Megatron's RNG tracker states
  (`rng.megatron.<name>`);
- the step, the data digest and the data position.

The shard a rank holds is fixed by its position in its instance (`shard_index`); every rank at that position in
another instance (Megatron's inter-instance group) holds a bitwise-identical copy, which is what the engine sends.

Contract: `at_step_boundary` is called by the training loop before every step (all ranks), and `gathering` once
this rank's shard is updated, as its instance's parameter all-gather starts; `boundary_state` and `load_state` are
called by the engine only between the boundary snapshot and the step's gradient reduction, when params and
optimizer state are still those of the boundary (no big tensor is copied in the fault-free path), and
`rewind_step` only in `GATHERING`, `finish_step` there or in phase 0 of the step after a replica's.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from nemo_checkpointless.restart.recovery import GATHERING
from nemo_checkpointless.state.hashing import DataDigest
from nemo_checkpointless.state.integrity import crc, word_sum
from nemo_checkpointless.state.rng import capture_rng, restore_rng

log = logging.getLogger(__name__)

STATE_VERSION = 1
_JSON_SCALARS = (bool, int, float, str, type(None))


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The leaf megatron optimizers under `optimizer` (NeMo's `McoreDistributedOptimizer` -> megatron's
    `ChainedOptimizer` -> `DistributedOptimizer`s), in chain order. Each leaf has `.optimizer`, a torch optimizer
    over this rank's shard."""
    if hasattr(optimizer, "mcore_optimizer"):
        return distributed_optimizers(optimizer.mcore_optimizer)
    if hasattr(optimizer, "chained_optimizers"):
        return [leaf for o in optimizer.chained_optimizers for leaf in distributed_optimizers(o)]
    if not hasattr(optimizer, "optimizer") or not isinstance(optimizer.optimizer, torch.optim.Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not a megatron optimizer (no torch optimizer at .optimizer)")
    return [optimizer]


def _json_value(value: Any) -> Any:
    if isinstance(value, _JSON_SCALARS):
        return None if isinstance(value, float) and not math.isfinite(value) else value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _JSON_SCALARS) for v in value):
        return list(value)
    raise TypeError(type(value).__name__)


class MegatronParticipant:
    """The recovery engine's view of one rank of a megatron-core job (see the module doc).

    Args:
        model: the model chunks (one per virtual pipeline stage; NeMo: `MegatronParallel`'s modules).
        optimizer: the optimizer as the training loop holds it (NeMo's wrapper, a `ChainedOptimizer`, or a
            `DistributedOptimizer`).
        dp_size: the data-parallel size the optimizer shards over (dp*cp), recorded to refuse a state of
            another layout.
        num_instances: `num_distributed_optimizer_instances`.
        shard_index: this rank's position inside its instance (`topology.rank_info(...).shard_index`).
        tp_rank, pp_rank: its tensor- and pipeline-parallel slice of the model (the same shapes on every TP rank:
            recorded, so that a state of another slice is refused rather than loaded).
        global_batch_size: samples per step, for the data position (`consumed_samples`).
    """

    def __init__(self, model: Sequence[nn.Module], optimizer: Any, *, dp_size: int, num_instances: int,
                 shard_index: int, tp_rank: int = 0, pp_rank: int = 0, global_batch_size: int = 0) -> None:
        self.model = list(model)
        self.optimizer = optimizer
        self.dp_size = dp_size
        self.num_instances = num_instances
        self.shard_index = shard_index
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.global_batch_size = global_batch_size
        self.completed_steps = 0
        # 0 until the step in flight has reduced its gradients (set by the training loop; only phase 0 can be
        # restored from a replica).
        self.phase = 0
        self.data_digest = DataDigest()
        self._boundary: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        self.boundary_step = -1  # the step whose boundary `_boundary` snapshots
        self._rng_to_restore: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None

    # ---------------------------------------------------------------------------------------- training loop
    def at_step_boundary(self, completed_steps: int) -> None:
        """Before each step, on every rank: restore RNG loaded by `load_state` (if any), then snapshot RNG."""
        if self._rng_to_restore is not None:
            _restore_all_rng(*self._rng_to_restore)
            self._rng_to_restore = None
        self.completed_steps = completed_steps
        self.phase = 0
        self._boundary = _capture_all_rng()
        self.boundary_step = completed_steps

    def gathering(self) -> None:
        """This rank's shard is updated for the step in flight and its instance's parameter all-gather starts (the
        engine's `GATHERING`: a survivor left here by a lost instance partner is rolled forward)."""
        self.phase = GATHERING

    def step_done(self, rank_batch_hashes: list[bytes] | None = None) -> None:
        """After the optimizer step: count it and extend the data digest with the step's per-rank batch hashes."""
        self.completed_steps += 1
        self.phase = 0
        if rank_batch_hashes is not None:
            self.data_digest.update(rank_batch_hashes)

    # ---------------------------------------------------------------------------- the engine's Participant
    def progress(self) -> tuple[int, int]:
        return self.completed_steps, self.phase

    def data_digest_hex(self) -> str:
        return self.data_digest.hexdigest

    def _shard_params(self) -> Iterator[tuple[str, torch.optim.Optimizer, dict[str, Any], torch.Tensor]]:
        for i, leaf in enumerate(distributed_optimizers(self.optimizer)):
            inner: torch.optim.Optimizer = leaf.optimizer
            for g, group in enumerate(inner.param_groups):
                for j, p in enumerate(group["params"]):
                    yield f"opt{i}.group{g}.param{j}", inner, group, p

    def model_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Every model parameter, as `model.<chunk>.<name>` (this rank's TP/PP slice, whole)."""
        for c, chunk in enumerate(self.model):
            for name, p in chunk.named_parameters():
                yield f"model.{c}.{name}", p

    def shard_tensors(self) -> list[torch.Tensor]:
        """This rank's shard as its replicas must hold it bitwise equal: each fp32 main param and its optimizer
        state tensors, in order."""
        out: list[torch.Tensor] = []
        for _, inner, _, p in self._shard_params():
            out.append(p.detach())
            out.extend(v.detach() for _, v in sorted(inner.state.get(p, {}).items()) if isinstance(v, torch.Tensor))
        return out

    def shard_digest(self) -> int:
        """The per-step replica digest of this rank's shard (`state.integrity.word_sum`)."""
        return word_sum(self.shard_tensors())

    def held_bytes(self) -> int:
        """The bytes a vote digests on this rank: its shard (its parameters are the shard's main params' copies)."""
        return sum(t.numel() * t.element_size() for t in self.shard_tensors())

    def integrity_digests(self) -> tuple[int, int, bool]:
        """For the replicas' vote (`restart.integrity.IntegrityCheck`): CRC-32 of this rank's parameters (its TP/PP
        slice, whole: equal on every data-parallel rank), of its shard, and whether both are finite."""
        params = [p.detach() for _, p in self.model_params()]
        shard = self.shard_tensors()
        finite = all(math.isfinite(float(t.sum())) for t in [*params, *shard] if t.is_floating_point())
        return crc(params), crc(shard), finite

    def flip_bit(self) -> None:
        """Fault plan kind `bitflip` (target shard): bit 12 of one element of this rank's first optimizer state
        tensor (AdamW's `exp_avg`; before the first step, its first main param), in memory, silently."""
        for _, inner, _, p in self._shard_params():
            state = {k: v for k, v in inner.state.get(p, {}).items() if isinstance(v, torch.Tensor) and v.numel() > 1}
            name, tensor = next(iter(sorted(state.items())), ("main param", p.detach()))
            flat = tensor.view(-1).view(torch.int32)
            flat[flat.numel() // 3] ^= 1 << 12
            log.info(f"bitflip: bit 12 of element {flat.numel() // 3} of the shard's {name}")
            return

    def boundary_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What a replica sends: this rank's state at the last step boundary (views, not copies: `pack` copies)."""
        if self._boundary is None:
            raise RuntimeError("boundary_state() before the first at_step_boundary(): no RNG snapshot yet")
        rng_meta, rng_tensors = self._boundary
        tensors: dict[str, torch.Tensor] = dict(rng_tensors)
        for name, param in self.model_params():
            tensors[name] = param.detach()
        scalars: dict[str, Any] = {}
        groups: dict[str, dict[str, Any]] = {}
        for name, inner, group, p in self._shard_params():
            tensors[f"{name}.main"] = p.detach()
            for key, value in inner.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"{name}.state.{key}"] = value.detach()
                else:
                    scalars[f"{name}.state.{key}"] = _json_value(value)
            gname = name.rsplit(".", 1)[0]
            if gname not in groups:
                groups[gname] = {k: _json_value(v) for k, v in group.items()
                                 if k != "params" and isinstance(v, (*_JSON_SCALARS, tuple, list))}
        meta = {
            "version": STATE_VERSION,
            "step": self.completed_steps,
            "dp_size": self.dp_size,
            "num_instances": self.num_instances,
            "shard_index": self.shard_index,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "state_scalars": scalars,
            "param_groups": groups,
            "rng": rng_meta,
            "data_digest": self.data_digest.to_json(),
            "data_position": {"step": self.completed_steps, "dp_size": self.dp_size,
                              "consumed_samples": self.completed_steps * self.global_batch_size},
        }
        return tensors, json.loads(json.dumps(meta))

    rolls_forward = True
    checkpoint_shared_prefix: str | None = None  # every tensor of a checkpoint shard is written by its own rank

    def finish_step(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The step in flight completed from a replica that completed it: this rank's instance lost a partner in the
        parameter all-gather, after this rank had updated its own shard (bitwise the replica's: the same reduced
        gradients, norm and optimizer); or its gradient reduction failed here and completed on the replica (phase
        0). The replica holds the same shard, the whole parameters of the step, and RNG, data digest and position
        at its end, which every data-parallel rank shares: its whole boundary state is this rank's at the end of
        the step, and is loaded as such."""
        if self.phase not in (0, GATHERING) or meta.get("step") != self.completed_steps + 1:
            raise ValueError(f"state of step {meta.get('step')} offered to finish step {self.completed_steps + 1} "
                             f"(phase {self.phase})")
        self.load_state(tensors, meta)

    def rewind_step(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """The step in flight undone from a replica at its boundary: this rank updated its shard for a step whose
        gradient reduction other survivors never completed. The replica's boundary state (parameters, shard,
        optimizer state, and RNG and data position, which every data-parallel rank shares) is this rank's at the
        boundary, and is loaded as such; the loop enters that step again."""
        if self.phase != GATHERING or meta.get("step") != self.completed_steps:
            raise ValueError(f"state of step {meta.get('step')} offered to undo step {self.completed_steps + 1} "
                             f"(phase {self.phase}): only a rank with its shard updated is rewound")
        self.load_state(tensors, meta)

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Overwrite this rank's params, shard, optimizer state, counters and (at the next boundary) RNG.

        Raises ValueError naming the mismatch when the state belongs to another layout or model."""
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"state version {meta.get('version')}, this build reads {STATE_VERSION}")
        for key in ("dp_size", "num_instances", "shard_index", "tp_rank", "pp_rank"):
            if meta.get(key, 0) != getattr(self, key):
                raise ValueError(f"state with {key}={meta[key]} offered to a rank with {key}={getattr(self, key)}: "
                                 "it belongs to another shard or layout")
        expected = {n for n, _ in self.model_params()} | {f"{n}.main" for n, *_ in self._shard_params()}
        missing = sorted(expected - set(tensors))
        if missing:
            raise ValueError(f"state lacks {len(missing)} tensor(s), e.g. {missing[:3]}: another model or optimizer")
        with torch.no_grad():
            for name, param in self.model_params():
                _copy_checked(name, param, tensors[name])
            for name, inner, group, p in self._shard_params():
                _copy_checked(f"{name}.main", p, tensors[f"{name}.main"])
                state: dict[str, Any] = {}
                prefix = f"{name}.state."
                old = inner.state.get(p, {})
                for key, t in tensors.items():
                    if key.startswith(prefix):
                        k = key[len(prefix):]
                        device = old[k].device if isinstance(old.get(k), torch.Tensor) else p.device
                        state[k] = t.to(device=device, copy=True)
                for key, value in meta["state_scalars"].items():
                    if key.startswith(prefix):
                        state[key[len(prefix):]] = value
                inner.state[p] = state
                for k, v in meta["param_groups"].get(name.rsplit(".", 1)[0], {}).items():
                    group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
        self._rng_to_restore = (meta["rng"], {k: v for k, v in tensors.items() if k.startswith("rng.")})
        self.data_digest = DataDigest(meta["data_digest"]["hexdigest"], meta["data_digest"]["steps"])
        self.completed_steps = meta["step"]
        self.phase = 0

    def adopt_loaded_rng(self) -> None:
        """The RNG loaded by `load_state` applied at once (otherwise at the next boundary): after a state was loaded
        at this boundary (a repair by the replicas' vote), its RNG is the boundary's."""
        if self._rng_to_restore is not None:
            _restore_all_rng(*self._rng_to_restore)
            self._boundary = self._rng_to_restore
            self._rng_to_restore = None


def _copy_checked(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"{name}: received {src.dtype}{list(src.shape)}, this rank has {dst.dtype}{list(dst.shape)}")
    dst.copy_(src)


def _tracker() -> Any:
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()


def _capture_all_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    meta, tensors = capture_rng()
    for name, state in _tracker().get_states().items():
        tensors[f"rng.megatron.{name}"] = state.detach().to("cpu", copy=True)
    meta["megatron_tracker"] = sorted(k[len("rng.megatron."):] for k in tensors if k.startswith("rng.megatron."))
    return meta, tensors


def _restore_all_rng(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    restore_rng(meta, tensors)
    tracker = _tracker()
    current = tracker.get_states()
    states = {}
    for name in meta.get("megatron_tracker", []):
        state = tensors[f"rng.megatron.{name}"]
        old = current.get(name)
        states[name] = state.to(old.device) if isinstance(old, torch.Tensor) else state
    tracker.set_states(states)


def own_boundary_state(participant: MegatronParticipant) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A survivor's state at the boundary of the step the failure interrupted (params and optimizer state are still
    those of the boundary: no rank completed that step's gradient reduction). If the failure came between the
    previous optimizer step and this step's snapshot, the snapshot is taken now (nothing drew from RNG between)."""
    if participant.boundary_step != participant.completed_steps:
        participant.at_step_boundary(participant.completed_steps)
    return participant.boundary_state()
