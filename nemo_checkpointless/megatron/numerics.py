"""Gradient reduction and gradient norm of megatron-core's distributed optimizer, made independent of N
(`num_distributed_optimizer_instances`). Imports megatron-core only inside `install`.

megatron-core 0.15 reduces a bucket's gradients with a reduce-scatter inside the optimizer instance, then (N > 1)
an all-reduce of the shard across instances (`_ParamAndGradBucketGroup.start_grad_sync`); the summation order of
every element depends on N. It then computes the global gradient norm from each rank's shard, summed over the
instance (`get_grad_norm_fp32` over the grad-stats group), again an order that depends on how the shards are cut.
Runs with N=1 and N=2 thus end with different parameters. `install` replaces both, on the objects of one setup
(instance attributes; no class or module of megatron is changed):

- each dense bucket group's `start_grad_sync` / `finish_grad_sync`: the bucket's unpadded gradients are scaled as
  megatron does, then all-reduced (SUM) over the whole data-parallel group (`dp_cp_group`) in one collective, as
  the Lightning path's `ShardedOptimizer` does; its shape and group do not depend on N, hence neither does its
  summation order. Every rank ends with the whole reduced bucket; the optimizer reads its own shard of it. With
  `overlap_grad_reduce` the all-reduces are issued asynchronously when the bucket group's grads are ready and
  waited for in `finish_grad_sync`, for every N (no CUDA side stream);
- the leaf optimizers' `get_grad_norm` / `clip_grad_norm` (and a `ChainedOptimizer`'s `get_grad_norm`): the norm
  is computed locally from the whole reduced gradients of this rank's model slice (the parameters megatron counts:
  not shared, not a TP duplicate), in buffer order, then summed over every rank, data-parallel rank 0 of each
  slice contributing it and the others zeros (the same sum for every N; and, like megatron's own norm, a collective
  no rank passes before every rank has finished the gradient reduction). Clipping itself is megatron's
  (`clip_grad_by_total_norm_fp32`, elementwise).

The cost: an all-reduce of the whole bucket instead of a reduce-scatter (N=1), on every rank.
Not covered (`install` returns False and leaves megatron's own reduction): expert-parallel buffers (MoE), and
`average_in_collective` (gloo has no AVG). The bucket's unpadded extent is the same for every N when the bucket
boundaries are: `bucket_size` is N-independent (megatron: from the whole DP size), and a bucket starts at a
multiple of lcm(DP/N, 128), which is 128 for every DP/N dividing 128.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# What the overrides rely on in megatron-core's objects (checked, so another version fails here, not silently).
_BUCKET_GROUP_ATTRS = ("buckets", "ddp_config", "grad_reduce_handle", "check_grads", "param_gather_dispatched",
                       "start_grad_sync", "finish_grad_sync")
_BUCKET_ATTRS = ("grad_data", "numel_unpadded", "gradient_scaling_factor", "params_list")


def ddp_chunks(model: Sequence[Any]) -> list[Any]:
    """The megatron `DistributedDataParallel` modules in `model` (each, or one it wraps through `.module`)."""
    chunks = []
    for module in model:
        while not hasattr(module, "bucket_groups") and hasattr(module, "module"):
            module = module.module
        if not hasattr(module, "bucket_groups"):
            raise TypeError(f"{type(module).__name__} is not megatron's DistributedDataParallel (no bucket_groups)")
        chunks.append(module)
    return chunks


def install(model: Sequence[Any], optimizer: Any, nan_check: bool = True) -> bool:
    """Install the N-independent gradient reduction on every dense bucket group of `model`'s DDP chunks and the
    matching gradient norm on `optimizer` (NeMo's wrapper, a `ChainedOptimizer` or a `DistributedOptimizer`).
    `nan_check` False: megatron's check of the local gradients for NaN and Inf before the reduction (which raises
    on the rank that has one) is left out, for the caller attributes them itself (`restart.integrity.NanGuard`).
    Returns False (nothing changed) where it does not apply; see the module's docstring."""
    chunks = ddp_chunks(model)
    for chunk in chunks:
        config = chunk.ddp_config
        if not config.use_distributed_optimizer or config.average_in_collective:
            return False
        if getattr(chunk, "expert_parallel_bucket_groups", None):
            return False
    for chunk in chunks:
        group = chunk.dp_cp_group
        for bucket_group in chunk.bucket_groups:
            missing = [a for a in _BUCKET_GROUP_ATTRS if not hasattr(bucket_group, a)]
            missing += [a for b in bucket_group.buckets for a in _BUCKET_ATTRS if not hasattr(b, a)]
            if missing:
                raise RuntimeError(f"megatron-core's bucket group lacks {sorted(set(missing))}: the N-independent "
                                   "gradient reduction (nemo_checkpointless.megatron.numerics) is built for 0.15.x")
            bucket_group.start_grad_sync = types.MethodType(_make_start(group, nan_check), bucket_group)
            bucket_group.finish_grad_sync = types.MethodType(_finish_grad_sync, bucket_group)
    norm = _make_grad_norm(chunks, dist.get_rank(chunks[0].dp_cp_group) == 0)
    for target in megatron_optimizers(optimizer):
        target.get_grad_norm = norm
        if hasattr(target, "chained_optimizers"):
            continue  # ChainedOptimizer.step takes the norm from its own get_grad_norm, then clips each leaf
        target.clip_grad_norm = types.MethodType(_make_clip(norm), target)
    return True


def megatron_optimizers(optimizer: Any) -> list[Any]:
    """`optimizer` unwrapped (NeMo's `mcore_optimizer`), then a `ChainedOptimizer` followed by its leaves."""
    if hasattr(optimizer, "mcore_optimizer"):
        return megatron_optimizers(optimizer.mcore_optimizer)
    if hasattr(optimizer, "chained_optimizers"):
        return [optimizer] + [o for child in optimizer.chained_optimizers for o in megatron_optimizers(child)]
    return [optimizer]


def _make_start(group: Any, nan_check: bool) -> Any:
    def start_grad_sync(self: Any) -> None:
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        config = self.ddp_config
        check_nan = bool(config.check_for_nan_in_grad and nan_check)
        if check_nan or config.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=check_nan, check_for_large=config.check_for_large_grads)
        overlap = bool(config.overlap_grad_reduce)
        works = []
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
            # The unpadded extent: the padding (zeros) depends on the instance size, the gradients do not.
            works.append(dist.all_reduce(bucket.grad_data[:bucket.numel_unpadded], op=dist.ReduceOp.SUM,
                                         group=group, async_op=overlap))
        self.grad_reduce_handle = works if overlap else None

    return start_grad_sync


def _finish_grad_sync(self: Any) -> None:
    self.param_gather_dispatched = False
    if not self.ddp_config.overlap_grad_reduce:
        self.start_grad_sync()
        return
    assert self.grad_reduce_handle is not None, (
        f"Communication call has not been issued for this bucket ({len(self.params_with_grad)}/{len(self.params)} "
        "params have grad available)")
    for work in self.grad_reduce_handle:
        work.wait()
    self.grad_reduce_handle = None


def _make_grad_norm(chunks: list[Any], contributes: bool) -> Any:
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    # Every counted parameter's whole gradient (a view into its bucket), in buffer order.
    grads: list[torch.Tensor] = []
    for chunk in chunks:
        for bucket_group in chunk.bucket_groups:
            for bucket in bucket_group.buckets:
                for param in bucket.params_list:
                    if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                        grads.append(param.main_grad)

    @torch.no_grad()
    def get_grad_norm(*_: Any) -> float:
        if grads:
            squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]).square().sum()
        else:
            squares = torch.zeros((), dtype=torch.float32)
        total = squares.reshape(1).to(grads[0].device if grads else "cpu")
        if not contributes:
            total.zero_()
        # Over every rank (the default group): each model slice's sum counted once (data-parallel rank 0's; the
        # other ranks add exact zeros, so the sum is that of the slices, in an order fixed by the world, not by
        # N). Spanning every rank, it is also the collective no rank passes unless every rank finished its
        # gradient reduction: a failure inside the reduction leaves no rank with an updated shard (as megatron's
        # own norm over the grad-stats group does), which the survivors' boundary state relies on.
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return float(total.item()) ** 0.5

    return get_grad_norm


def _make_clip(norm: Any) -> Any:
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    def clip_grad_norm(self: Any, clip_grad: float) -> float:
        grad_norm = norm()
        params = self.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, clip_grad, grad_norm,
                                         self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return float(grad_norm)

    return clip_grad_norm
