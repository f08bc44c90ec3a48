"""The benchmark's job, the same under every system: a small Llama-class decoder (the package's `LlamaModel` at
the `tiny_llama_cpu` size), AdamW with warm-up, gradient clipping, fixed-seed token sequences, the same global
batch and number of steps. Each system's worker builds it from here and reports through one `StepLog`.

What a worker writes into its run directory (all JSON or plain text, no pickle):
  steps_rank<r>.txt     one line per completed step: "<step> <time.time()> <pid>" (appended by every process that is
                        rank r, so a replacement or a restarted job continues the same file)
  events_rank<r>.jsonl  {"event": "start", "t", "pid"} when the process starts, {"event": "train", "step", "t",
                        "pid"} when its training loop starts (after a restart: at the step it resumed from)
  done_rank0.json       at the end: the final step, the sha256 of the parameters, time.time()
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from nemo_checkpointless.models import LlamaConfig, LlamaModel

_STARTED = time.time()  # when the worker's process imported this module: its start, near enough


@dataclass(frozen=True)
class JobSpec:
    steps: int = 120
    micro_batch: int = 8  # per rank
    seq_len: int = 64
    samples: int = 8192
    seed: int = 1234
    lr: float = 3e-3
    warmup_steps: int = 10
    grad_clip: float = 1.0
    ckpt_every: int = 10  # the peers' persistent checkpoint (ours keeps none: its replicas serve)

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(max_seq_len=self.seq_len)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        for name, value in asdict(self).items():
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> JobSpec:
        return cls(**{name: getattr(args, name) for name in asdict(cls())})

    def as_args(self) -> list[str]:
        return [x for name, value in asdict(self).items() for x in (f"--{name.replace('_', '-')}", str(value))]


def token_data(spec: JobSpec) -> torch.Tensor:
    """`samples` sequences of `seq_len + 1` tokens (inputs and shifted targets), the same on every rank and run: a
    random walk over the vocabulary, so that there is something to learn."""
    g = torch.Generator().manual_seed(7)
    vocab = spec.model_config().vocab_size
    steps = torch.randint(-3, 4, (spec.samples, spec.seq_len + 1), generator=g)
    start = torch.randint(0, vocab, (spec.samples, 1), generator=g)
    return (start + steps.cumsum(1)) % vocab


def build_model(spec: JobSpec) -> LlamaModel:
    torch.manual_seed(spec.seed)
    return LlamaModel(spec.model_config())


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def warmup(spec: JobSpec) -> Callable[[int], float]:
    """The learning-rate factor at a step: linear warm-up, then constant."""
    return lambda step: min(1.0, (step + 1) / spec.warmup_steps)


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class StepLog:
    """A worker's reports (see the module doc), for rank `rank` of the job."""

    def __init__(self, run_dir: str | os.PathLike[str], rank: int) -> None:
        self.dir = Path(run_dir)
        self.rank = rank
        self.dir.mkdir(parents=True, exist_ok=True)
        self._steps = open(self.dir / f"steps_rank{rank}.txt", "a", buffering=1)  # noqa: SIM115
        self.event("start", t=_STARTED)

    def event(self, name: str, **fields: object) -> None:
        record = {"event": name, "t": time.time(), "pid": os.getpid(), **fields}
        with open(self.dir / f"events_rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def step(self, step: int) -> None:
        self._steps.write(f"{step} {time.time():.6f} {os.getpid()}\n")

    def done(self, step: int, model: nn.Module, **extra: object) -> None:
        if self.rank != 0:
            return
        record = {"step": step, "params_sha256": params_sha256(model), "t": time.time(), **extra}
        tmp = self.dir / "done_rank0.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.dir / "done_rank0.json")
