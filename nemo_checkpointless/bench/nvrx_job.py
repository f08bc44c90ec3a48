"""The benchmark job under NVIDIA's in-process restart (`nvidia_resiliency_ext.inprocess.Wrapper`), as its docs and
examples run it: a plain PyTorch loop (DDP over gloo here, NCCL on GPUs) inside the wrapped function, which every
healthy rank enters again after a fault; the state comes back from a `torch.save` checkpoint written every
--ckpt-every steps by rank 0 (`call_wrapper.atomic()`), the data position from the checkpoint's step.

The bench starts WORLD_SIZE = ranks + 1 processes itself (the Wrapper is not compatible with torchrun, which stops
every local worker when one fails): one of them is a reserve rank (`MaxActiveWorldSize(ranks)` after
`ShiftRanks()`), which takes the place of a killed rank, as NVRx's hot spares do. Timeouts: the tightest that
worked here on an idle machine (the gloo timeout bounds how long a survivor stays blocked in a collective: NVRx
aborts only NCCL), times --timeout-scale: the bench passes the machine's load per core when it is above 1, since a
rank starved of CPU for longer than the heartbeat timeout is declared dead by NVRx and its restart then waits on the
survivors' gloo timeout, round after round (ours adapts its hang deadline to the steps it measures instead).
"""

# No `from __future__ import annotations`: the Wrapper finds the argument to pass its CallWrapper in by the
# annotation's class, which must not be a string.
import argparse
import datetime
import os
from pathlib import Path
from typing import Optional

import nvidia_resiliency_ext.inprocess as inprocess
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

from nemo_checkpointless.bench.job import JobSpec, StepLog, build_model, lm_loss, token_data, warmup

GLOO_TIMEOUT_S = 3.0


def train(spec: JobSpec, run_dir: str, ranks: int, timeout_scale: float,
          call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:  # noqa: UP045 (see above)
    assert call_wrapper is not None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert world == ranks, (world, ranks)
    log = StepLog(run_dir, rank)
    port = int(os.environ["MASTER_PORT"]) + 2 + call_wrapper.iteration
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port, world_size=world, is_master=rank == 0,
                          multi_tenant=True, wait_for_workers=True, use_libuv=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S * timeout_scale))
    model = build_model(spec)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup(spec))
    ckpt = Path(run_dir) / "checkpoint.pt"
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        torch.set_rng_state(state["rng"])
        step = int(state["step"])
    data = token_data(spec)
    sampler: DistributedSampler[int] = DistributedSampler(TensorDataset(data), num_replicas=world, rank=rank,
                                                          shuffle=True, seed=spec.seed)
    per_epoch = len(sampler) // spec.micro_batch
    log.event("train", step=step, iteration=call_wrapper.iteration)
    while step < spec.steps:
        epoch, at = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        order = list(sampler)
        batch = data[order[at * spec.micro_batch:(at + 1) * spec.micro_batch]]
        opt.zero_grad(set_to_none=True)
        lm_loss(ddp, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        sched.step()
        step += 1
        log.step(step)
        if step % spec.ckpt_every == 0:
            dist.barrier()
            if rank == 0:
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                         "rng": torch.get_rng_state(), "step": step}
                with call_wrapper.atomic():
                    torch.save(state, str(ckpt) + ".tmp")
                    os.replace(str(ckpt) + ".tmp", ckpt)
    dist.barrier()
    log.done(step, model)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--ranks", type=int, default=4, help="active ranks (the processes are one more)")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiplies the gloo, heartbeat, soft and hard timeouts (>= 1)")
    JobSpec().add_arguments(parser)
    args = parser.parse_args()
    spec = JobSpec.from_args(args)
    k = max(1.0, args.timeout_scale)

    def s(seconds: float) -> datetime.timedelta:
        return datetime.timedelta(seconds=seconds)

    wrapper = inprocess.Wrapper(
        store_kwargs={"port": int(os.environ["MASTER_PORT"]) + 1},
        rank_assignment=inprocess.Compose(inprocess.rank_assignment.MaxActiveWorldSize(args.ranks),
                                          inprocess.rank_assignment.ShiftRanks()),
        monitor_thread_interval=s(0.1), monitor_process_interval=s(0.1),
        heartbeat_interval=s(0.2), progress_watchdog_interval=s(0.1),
        soft_timeout=s(5 * k), hard_timeout=s(8 * k), heartbeat_timeout=s(2 * k),
        barrier_timeout=s(30), completion_timeout=s(30), last_call_wait=s(0.2),
        termination_grace_time=s(1))
    wrapper(train)(spec, args.run_dir, args.ranks, k)


if __name__ == "__main__":
    main()
