"""Capacity planning for a recipe at a cluster size: memory per GPU with N optimizer instances, and goodput
under failures with hot spares (`checkpointless-plan`; formulas in docs/planning.md)."""

from nemo_checkpointless.planning.goodput import (
    GoodputInputs,
    RestartBaseline,
    SpareOption,
    poisson_tail,
    recommend_spares,
    restart_baseline,
    with_spares,
)
from nemo_checkpointless.planning.memory import (
    MemoryPlan,
    activation_bytes,
    padded_vocab,
    params_per_gpu,
    plan_memory,
    total_params,
)

__all__ = [
    "GoodputInputs",
    "MemoryPlan",
    "RestartBaseline",
    "SpareOption",
    "activation_bytes",
    "padded_vocab",
    "params_per_gpu",
    "plan_memory",
    "poisson_tail",
    "recommend_spares",
    "restart_baseline",
    "total_params",
    "with_spares",
]
