"""What the NeMo path checks before anything starts, written in a NeMo user's own terms. Imports neither NeMo nor
megatron-core, so that a missing or unsupported install is reported as one message instead of an ImportError
from deep inside NeMo.

- `check_versions`: nemo_toolkit and megatron-core within the ranges the NeMo path is built and tested on.
- `replication_knob`: `num_distributed_optimizer_instances` (Megatron's name) or `num_instances` (ours), one knob.
- `in_nemo_terms`: a topology `ConfigError` with NeMo's argument names (`tensor_model_parallel_size`, ...)
  instead of our Hydra keys (`parallel.tp`, ...).
"""

from __future__ import annotations

import re
from importlib import metadata

from nemo_checkpointless.errors import ConfigError

# [low, high) of (major, minor): NeMo 2.7 is the last release with NeMo 2's LLM collection; NeMo 2.7.3 breaks on
# megatron-core 0.16 (docs/design.md, "Dependencies").
NEMO_RANGE = ((2, 7), (3, 0))
MEGATRON_RANGE = ((0, 15), (0, 16))
INSTALL = "pip install 'nemo-checkpointless[nemo]' (nemo_toolkit 2.7.x with megatron-core 0.15.x)"

_KEYS = {
    "world_size": "world size (trainer devices x num_nodes)",
    "parallel.tp": "tensor_model_parallel_size",
    "parallel.cp": "context_parallel_size",
    "parallel.pp": "pipeline_model_parallel_size",
    "parallel.ep": "expert_model_parallel_size",
}


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_versions(nemo_version: str | None, megatron_version: str | None) -> None:
    """Raise `ConfigError` unless both are installed and within `NEMO_RANGE` and `MEGATRON_RANGE`."""
    for key, version, (low, high) in (("nemo_toolkit", nemo_version, NEMO_RANGE),
                                      ("megatron-core", megatron_version, MEGATRON_RANGE)):
        if version is None:
            raise ConfigError(key, "not installed", "the NeMo path needs it", INSTALL)
        parsed = _major_minor(version)
        if parsed is None or not low <= parsed < high:
            raise ConfigError(key, version, f"must be >= {low[0]}.{low[1]} and < {high[0]}.{high[1]} (the "
                              "releases the NeMo path is tested on)", INSTALL)


def installed_versions() -> tuple[str | None, str | None]:
    """The installed nemo_toolkit and megatron-core versions (None where not installed)."""
    found: list[str | None] = []
    for dist in ("nemo_toolkit", "megatron-core"):
        try:
            found.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            found.append(None)
    return found[0], found[1]


def replication_knob(num_instances: object, num_distributed_optimizer_instances: object) -> tuple[str, int]:
    """The replication factor and the name it was given by: either argument sets it; both must then agree."""
    given = {k: v for k, v in (("num_instances", num_instances),
                               ("num_distributed_optimizer_instances", num_distributed_optimizer_instances))
             if v is not None}
    if len(given) == 2 and num_instances != num_distributed_optimizer_instances:
        raise ConfigError("num_distributed_optimizer_instances", num_distributed_optimizer_instances,
                          f"is the same knob as num_instances={num_instances}, and they differ",
                          "pass only one of them")
    key, value = next(iter(given.items())) if given else ("num_instances", 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(key, value, "must be an integer >= 1", f"set {key} to the number of optimizer "
                          "instances that replicate each shard (2 to recover from a peer)")
    return key, value


def in_nemo_terms(error: ConfigError, instances_key: str) -> ConfigError:
    """`error` (from our topology) with the key a NeMo user wrote."""
    key = instances_key if error.key == "replication.num_instances" else _KEYS.get(error.key, error.key)
    return ConfigError(key, error.value, error.rule,
                       error.fix.replace("tp, cp, pp", "tensor, context and pipeline parallel sizes"))
