"""`apply(recipe)`: a NeMo 2 recipe (a `nemo_run` `Partial` of `llm.pretrain` / `llm.finetune` / `llm.train`, such as
`llm.llama3_8b.pretrain_recipe(...)`) made checkpointless, and validated without starting any process.

    from nemo.collections import llm
    import nemo_run as run
    from nemo_checkpointless.nemo import apply

    recipe = apply(llm.llama3_8b.pretrain_recipe(name="llama3", dir="/ckpt", num_nodes=1, num_gpus_per_node=8),
                   num_instances=2)
    if __name__ == "__main__":
        run.run(recipe, direct=True)   # in this process: start it with checkpointless-run --nproc-per-node 8

What it changes, and nothing else:
- `trainer.strategy`: NeMo's `MegatronStrategy` becomes `CheckpointlessMegatronStrategy` with the same arguments and
  `num_distributed_optimizer_instances=num_instances`; Megatron's DDP keeps the recipe's settings except
  `overlap_param_gather=False` (with it on, a rank holds last step's parameters until the next forward gathers
  them, so a step boundary would have no full, current parameters to send a replacement);
- `optim.config.use_distributed_optimizer=True` (the replicated shards are the distributed optimizer's; NeMo makes
  the DDP setting follow the optimizer's);
- `trainer.callbacks` gets a `CheckpointlessCallback` (once);
- with `mmap=True` (the default), `data` is wrapped in `MmapDataModule` (tier 2: its training batches through the
  job's shared-memory cache; once). A data module it cannot serve is refused with a `ConfigError` when the recipe
  is built (e.g. NeMo's `FineTuningDataModule`: its sampler's `dataloader_type` is 'batch'); `mmap=False` keeps it.

The recipe's data module keeps Megatron's data sampler, whose position the strategy restores in O(1) after a
recovery; its checkpointing (`log.ckpt`) and `resume` stay the recipe's (the persistent checkpoint a job falls back
to when no live replica can help is the strategy's, in the run directory).
"""

from __future__ import annotations

from typing import Any

from nemo_checkpointless.errors import ConfigError


def apply(recipe: Any, num_instances: int = 2, mmap: bool = True) -> Any:
    """Make `recipe` checkpointless in place (see the module doc) and return it, validated: the strategy is built
    (no process group) and its layout checked at the recipe's world size (`trainer.devices x trainer.num_nodes`),
    so a bad `num_instances` or parallel layout raises `ConfigError` here, in NeMo's argument names."""
    import nemo_run as run
    from nemo.lightning import MegatronStrategy

    from nemo_checkpointless.nemo.callback import CheckpointlessCallback
    from nemo_checkpointless.nemo.data import MmapDataModule
    from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy

    trainer = _attr(recipe, "trainer", "a NeMo recipe (llm.<model>.pretrain_recipe(...), a nemo_run Partial)")
    strategy = _attr(trainer, "strategy", "run.Config(nl.MegatronStrategy, ...)", "recipe.trainer")
    target = getattr(strategy, "__fn_or_cls__", None)
    if not (isinstance(target, type) and issubclass(target, MegatronStrategy)):
        raise ConfigError("recipe.trainer.strategy", getattr(target, "__name__", repr(strategy)),
                          "must be nl.MegatronStrategy (the strategy replicated optimizer shards need)",
                          "use a Megatron recipe (llm.<model>.pretrain_recipe or finetune_recipe)")
    arguments = dict(strategy.__arguments__)
    for knob in ("num_instances", "num_distributed_optimizer_instances"):
        arguments.pop(knob, None)
    ddp = arguments.get("ddp")
    if ddp is None or isinstance(ddp, str):
        arguments.pop("ddp", None)  # the strategy's own: Megatron DDP with the distributed optimizer
    else:
        ddp.overlap_param_gather = False
        ddp.use_distributed_optimizer = True
    optim = getattr(recipe, "optim", None)
    config = getattr(optim, "config", None)
    if config is not None and hasattr(config, "use_distributed_optimizer"):
        config.use_distributed_optimizer = True
    trainer.strategy = run.Config(CheckpointlessMegatronStrategy, num_distributed_optimizer_instances=num_instances,
                                  **arguments)
    callbacks = list(getattr(trainer, "callbacks", None) or [])
    if not any(getattr(c, "__fn_or_cls__", None) is CheckpointlessCallback for c in callbacks):
        callbacks.append(run.Config(CheckpointlessCallback))
    trainer.callbacks = callbacks
    data = getattr(recipe, "data", None)
    if mmap and data is not None and getattr(data, "__fn_or_cls__", None) is not MmapDataModule:
        recipe.data = run.Config(MmapDataModule, module=data)
    validate(recipe)
    return recipe


def validate(recipe: Any) -> None:
    """Build the recipe's strategy (no process group) and check its layout at the recipe's world size."""
    import fiddle as fdl

    trainer = recipe.trainer
    devices, nodes = getattr(trainer, "devices", 1), getattr(trainer, "num_nodes", 1) or 1
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError("recipe.trainer.devices", devices, "must be a number of processes per node",
                          "set recipe.trainer.devices to the GPUs per node (checkpointless-run --nproc-per-node)")
    strategy = fdl.build(trainer.strategy)
    strategy.job_dims(devices * nodes)


def _attr(obj: Any, name: str, what: str, where: str = "recipe") -> Any:
    value = getattr(obj, name, None)
    if value is None:
        raise ConfigError(f"{where}.{name}", None, f"is missing: apply() takes {what}",
                          "pass the recipe itself, e.g. llm.llama3_8b.pretrain_recipe(name=..., dir=...)")
    return value
