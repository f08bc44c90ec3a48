"""For tests/test_nemo_checks.py: `nemo_checkpointless.nemo.apply` on NeMo's own `llm.llama3_8b.pretrain_recipe`
(8 GPUs per node, TP=1, PP=1, CP=2: DP x CP = 8), and on the same recipe with arguments that break a rule. Prints one
JSON object. Nothing is started: no process group, no GPU."""

from __future__ import annotations

import json
import warnings

warnings.filterwarnings("ignore")

import fiddle as fdl  # noqa: E402
from nemo.collections import llm  # noqa: E402

from nemo_checkpointless.errors import ConfigError  # noqa: E402
from nemo_checkpointless.nemo import (  # noqa: E402
    CheckpointlessCallback,
    CheckpointlessMegatronStrategy,
    MmapDataModule,
    apply,
)


def recipe(tp: int = 1) -> object:
    made = llm.llama3_8b.pretrain_recipe(name="llama3", dir="/tmp/unused", num_nodes=1, num_gpus_per_node=8)
    made.trainer.strategy.tensor_model_parallel_size = tp
    return made


def error(make: object) -> str:
    try:
        make()  # type: ignore[operator]
    except ConfigError as e:
        return str(e)
    return ""


original = recipe()
before = dict(original.trainer.strategy.__arguments__)
data_before = original.data.__fn_or_cls__
applied = apply(original, num_instances=2)
strategy = applied.trainer.strategy
built = fdl.build(strategy)
again = len(apply(applied, num_instances=2).trainer.callbacks)
out = {
    "strategy": strategy.__fn_or_cls__ is CheckpointlessMegatronStrategy,
    "kept": {k: repr(getattr(strategy, k)) == repr(v) for k, v in before.items() if k != "ddp"},
    "instances": [built.num_instances, built.ddp_config.num_distributed_optimizer_instances],
    "overlap_param_gather": strategy.ddp.overlap_param_gather,
    "distributed_optimizer": applied.optim.config.use_distributed_optimizer,
    "callbacks": [c.__fn_or_cls__ is CheckpointlessCallback for c in applied.trainer.callbacks],
    "callbacks_after_second_apply": again,
    # (not built: NeMo's MockDataModule would fetch the recipe's tokenizer)
    "data": [applied.data.__fn_or_cls__ is MmapDataModule, applied.data.module.__fn_or_cls__ is data_before,
             apply(applied).data.module.__fn_or_cls__ is data_before],
    "three_instances": error(lambda: apply(recipe(), num_instances=3)),
    "tp3": error(lambda: apply(recipe(tp=3), num_instances=2)),
    "not_a_recipe": error(lambda: apply(recipe().trainer)),
}
print(json.dumps(out))
