"""The built-in Llama LightningModule: next-token cross-entropy, AdamW, warm-up + cosine schedule."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from typing_extensions import override

from nemo_checkpointless.config import OptimConfig
from nemo_checkpointless.models import LlamaConfig, LlamaModel


def lr_lambda(optim: OptimConfig, max_steps: int) -> Any:
    def factor(step: int) -> float:
        if step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
        floor = optim.min_lr / optim.lr
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class LlamaLightningModule(pl.LightningModule):
    def __init__(self, model: LlamaConfig, optim: OptimConfig, max_steps: int) -> None:
        super().__init__()
        self.model = LlamaModel(model)
        self.optim = optim
        self.max_steps = max_steps

    @override
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("loss", loss.detach(), prog_bar=True, on_step=True, batch_size=batch.shape[0])
        return loss

    @override
    def configure_optimizers(self) -> Any:
        o = self.optim
        optimizer = torch.optim.AdamW(self.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                      weight_decay=o.weight_decay, foreach=False)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, self.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
