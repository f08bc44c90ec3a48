"""An unchanged DDP script, as written for torchrun: `init_process_group("gloo")` from the environment, DDP,
its own checkpoint (torch.save of tensors, loaded with weights_only=True) every 5 steps, resumed at start.

Under `checkpointless-run` it gets tier 1: the launcher's store (rank 0 hosts none) and, when a rank dies, every
rank restarted with the store kept. At the end rank 0 writes RUN_DIR/ddp_final.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

STEPS = 30


def main() -> None:
    run_dir = os.environ["NCL_RUN_DIR"]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = os.path.join(run_dir, "ddp_ckpt.pt")
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        start = int(state["step"])
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=g)
        loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            with open(os.path.join(run_dir, "ddp_progress.txt"), "w") as f:
                f.write(str(step + 1))
            if (step + 1) % 5 == 0:
                torch.save({"model": model.module.state_dict(), "step": torch.tensor(step + 1)}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
        time.sleep(0.05)
    if rank == 0:
        weights = [p.detach().flatten().tolist() for p in model.module.parameters()]
        with open(os.path.join(run_dir, "ddp_final.json"), "w") as f:
            json.dump({"weights": weights, "resumed_from": start}, f)
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
