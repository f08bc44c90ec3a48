"""The benchmark job under torchft, as its `train_ddp.py` example runs it: one replica group per data-parallel rank
(groups of one process: torchft's DDP), each started by its own `torchrun --nproc-per-node 1 --max-restarts N`,
a `torchft_lighthouse` that forms the quorum of live groups every step, torchft's DDP wrapper +
`torchft.Optimizer` on a `ProcessGroupGloo`, and `PGTransport` for healing: a group restarted by its torchrun
pulls the model and optimizer state from a live group. The healthy groups go on without it meanwhile (fewer
replicas, a smaller global batch for those steps), and the data of the lost group for those steps is not trained.
The learning rate is a function of the manager's step, so nothing else needs healing.

The DDP wrapper is `torchft.ddp.PureDistributedDataParallel` (one fault-tolerant all-reduce per gradient), not the
recommended `torchft.DistributedDataParallel`: with torchft 0.2.0 on gloo, the latter's communication hook fails an
assertion (`assert fut._fut`, torchft/ddp.py) in every healthy group once an all-reduce errors, so a single kill
stopped every group and torchrun restarted them all (measured here).

    REPLICA_GROUP_ID=i NUM_REPLICA_GROUPS=G TORCHFT_LIGHTHOUSE=http://HOST:PORT torchrun --nproc-per-node 1 ...
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from nemo_checkpointless.bench.job import JobSpec, StepLog, build_model, lm_loss, token_data, warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", required=True)
    JobSpec().add_arguments(parser)
    args = parser.parse_args()
    spec = JobSpec.from_args(args)
    from torchft import DistributedSampler, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.ddp import PureDistributedDataParallel

    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    log = StepLog(args.run_dir, group)
    model = build_model(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"bench_{group}", timeout=timedelta(seconds=10),
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")))
    ddp = PureDistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, opt)
    data = TensorDataset(token_data(spec))
    sampler = DistributedSampler(data, replica_rank=group, num_replica_groups=groups, group_rank=0, num_replicas=1,
                                 shuffle=True, seed=spec.seed)
    loader = DataLoader(data, batch_size=spec.micro_batch, sampler=sampler)
    scale = warmup(spec)
    log.event("train", step=manager.current_step())
    epoch = 0
    while manager.current_step() < spec.steps:
        sampler.set_epoch(epoch)
        for (batch,) in loader:
            step = manager.current_step()
            for g in opt.param_groups:
                g["lr"] = spec.lr * scale(step)
            optimizer.zero_grad()
            lm_loss(ddp, batch).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            optimizer.step()
            if manager.current_step() > step:
                log.step(manager.current_step())
            if manager.current_step() >= spec.steps:
                break
        epoch += 1
    log.done(manager.current_step(), model)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
