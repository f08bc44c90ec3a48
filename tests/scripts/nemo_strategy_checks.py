"""For tests/test_nemo_checks.py: build `CheckpointlessMegatronStrategy` under a 4-device CPU `nl.Trainer` with the
arguments given as JSON objects on the command line and print, per case, one JSON line: the replication factor
it took, or the `ConfigError` its layout check (`job_dims`, what `setup_environment` runs before any process
group) raised. No process group is created."""

from __future__ import annotations

import json
import sys
import warnings

warnings.filterwarnings("ignore")

import nemo_shim  # noqa: E402

nemo_shim.install()

from nemo import lightning as nl  # noqa: E402

from nemo_checkpointless.errors import ConfigError  # noqa: E402
from nemo_checkpointless.nemo.strategy import CheckpointlessMegatronStrategy  # noqa: E402

for arg in sys.argv[1:]:
    kwargs = json.loads(arg)
    if isinstance(kwargs.get("ddp"), dict):
        from megatron.core.distributed import DistributedDataParallelConfig

        kwargs["ddp"] = DistributedDataParallelConfig(**kwargs["ddp"])
    try:
        strategy = CheckpointlessMegatronStrategy(ckpt_async_save=False, **kwargs)
        nl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, max_steps=1)
        dims = strategy.job_dims()
        megatron = strategy.ddp_config.num_distributed_optimizer_instances
        result = {"num_instances": strategy.num_instances, "megatron": megatron, "dp": dims.dp}
    except ConfigError as e:
        result = {"error": str(e)}
    print("RESULT " + json.dumps(result), flush=True)
