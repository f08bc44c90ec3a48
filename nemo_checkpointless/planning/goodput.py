"""Expected goodput of a job under failures: checkpoint-restart vs. checkpointless recovery with k hot spares.

Goodput = the fraction of the GPUs' wall time spent on training steps that are kept. The model and the figures
behind the defaults are in `docs/planning.md`:

    lambda      = failures per GPU-hour x GPUs                     (job failures per hour; MTBF = 1 / lambda)
    restart     : checkpoint every T = sqrt(2 C MTBF) (Young), each failure costs the restart R_restart plus
                  on average T/2 of lost work:  waste = C/T + lambda (T/2 + R_restart)
    checkpointless with k spare nodes: each failure costs the recovery R, plus a wait W for a node when no spare
                  is free. A used spare returns to the pool after F hours, so the spares busy when a failure
                  arrives are the failures of the last F hours, Poisson(mu = lambda F):
                  p_wait(k) = P(Poisson(mu) >= k);  waste = lambda (R + p_wait(k) W)
                  goodput(k) = G / (G + k g) x (1 - waste)   (idle spares are GPUs that do not train)
    recommended k = the smallest k that maximises goodput(k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, section 3.3.4): 466 job interruptions (419 unexpected,
# 47 planned) in a 54-day snapshot of pre-training on 16,384 H100 GPUs.
META_INTERRUPTIONS = 466
META_GPUS = 16_384
META_DAYS = 54
FAILURES_PER_GPU_HOUR = META_INTERRUPTIONS / (META_GPUS * META_DAYS * 24)  # 2.195e-5

RECOVERY_S = 60.0  # checkpointless recovery on a cluster (detection + communicator rebuild + state transfer)
RESTART_S = 15 * 60.0  # whole-job restart from a checkpoint (the low end of the published 15-60 min)
CHECKPOINT_SAVE_S = 60.0  # time a checkpoint save blocks training
NODE_WAIT_S = 10 * 60.0  # getting a new node from the scheduler when no hot spare waits
SPARE_REFILL_H = 2.0  # a used spare's slot is refilled (node repaired or swapped) after this long
MAX_SPARES = 64


@dataclass(frozen=True)
class GoodputInputs:
    gpus: int
    gpus_per_node: int
    failures_per_gpu_hour: float = FAILURES_PER_GPU_HOUR
    recovery_s: float = RECOVERY_S
    restart_s: float = RESTART_S
    checkpoint_save_s: float = CHECKPOINT_SAVE_S
    node_wait_s: float = NODE_WAIT_S
    spare_refill_h: float = SPARE_REFILL_H

    def __post_init__(self) -> None:
        for key in ("gpus", "gpus_per_node"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 1")
        for key in ("failures_per_gpu_hour", "recovery_s", "restart_s", "checkpoint_save_s", "node_wait_s",
                    "spare_refill_h"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 0")

    @property
    def failures_per_hour(self) -> float:
        return self.failures_per_gpu_hour * self.gpus

    @property
    def mtbf_h(self) -> float:
        return math.inf if self.failures_per_hour == 0 else 1.0 / self.failures_per_hour


@dataclass(frozen=True)
class RestartBaseline:
    checkpoint_interval_h: float
    waste: float

    @property
    def goodput(self) -> float:
        return max(0.0, 1.0 - self.waste)


@dataclass(frozen=True)
class SpareOption:
    spares: int  # hot spare nodes
    p_wait: float  # probability that a failure finds no spare free
    waste: float  # fraction of the training GPUs' time lost to recoveries
    goodput: float  # of all GPUs held, spares included


def restart_baseline(x: GoodputInputs) -> RestartBaseline:
    """Checkpoint-restart at Young's interval sqrt(2 C MTBF)."""
    lam = x.failures_per_hour
    if lam == 0:
        return RestartBaseline(math.inf, 0.0)
    c_h = x.checkpoint_save_s / 3600
    interval = math.sqrt(2 * c_h * x.mtbf_h)
    if interval == 0:
        return RestartBaseline(0.0, lam * x.restart_s / 3600)
    return RestartBaseline(interval, c_h / interval + lam * (interval / 2 + x.restart_s / 3600))


def poisson_tail(k: int, mu: float) -> float:
    """P(X >= k) for X ~ Poisson(mu)."""
    if k <= 0:
        return 1.0
    term, cdf = math.exp(-mu), 0.0
    for i in range(k):
        if i:
            term *= mu / i
        cdf += term
    return max(0.0, 1.0 - cdf)


def with_spares(x: GoodputInputs, spares: int) -> SpareOption:
    lam = x.failures_per_hour
    p_wait = poisson_tail(spares, lam * x.spare_refill_h)
    waste = lam * (x.recovery_s + p_wait * x.node_wait_s) / 3600
    held = x.gpus / (x.gpus + spares * x.gpus_per_node)
    return SpareOption(spares, p_wait, waste, held * max(0.0, 1.0 - waste))


def recommend_spares(x: GoodputInputs, max_spares: int = MAX_SPARES) -> tuple[SpareOption, list[SpareOption]]:
    """The smallest spare count with the best goodput, and the options 0..max_spares it was chosen from."""
    options = [with_spares(x, k) for k in range(max_spares + 1)]
    best = options[0]
    for o in options[1:]:
        if o.goodput > best.goodput + 1e-12:
            best = o
    return best, options
