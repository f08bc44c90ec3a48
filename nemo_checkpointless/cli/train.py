"""`checkpointless-train [key=value ...]`: compose a recipe, prepare the data, launch the ranks, write the summary.

With no arguments it runs the recipe `tiny_llama_cpu` on 4 CPU ranks with the embedded default corpus.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from nemo_checkpointless.cli import importable
from nemo_checkpointless.config import Config, save_run_config
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.protocol import WORKER_SUMMARY

USAGE = """usage: checkpointless-train [KEY=VALUE ...] [--cfg]

Runs a recipe (default: recipe=tiny_llama_cpu) on local ranks and writes RUN_DIR/summary.json.
Common overrides:
  recipe=NAME                        a recipe from recipes/ ({recipes})
  trainer.max_steps=N                training steps
  trainer.devices=K                  local ranks (CPU processes)
  run.dir=PATH                       where logs, config and summary.json go
  replication.num_instances=N        replicated optimizer instances (must divide the data-parallel size)
  trainer.num_nodes=N                nodes (size cluster jobs with checkpointless-plan; 1 here)
  launcher.preload=[MODULE]          modules every rank imports first (engine=nemo on CPU: the tests' shim)
  seed=S                             random seed
  data.path=PREFIX                   token data PREFIX.bin + PREFIX.idx (see checkpointless-tokenize)
  --cfg                              print the composed config and exit
"""


def prepare_data(cfg: Config) -> Config:
    """Resolve `data.path` (build the embedded default corpus once) and check the data fits the model and batch."""
    from nemo_checkpointless.data.corpus import default_corpus
    from nemo_checkpointless.data.indexed import IndexedTokens

    path = cfg.data.path
    if path is None:
        path = default_corpus(cfg.data.cache_dir, max_bytes=cfg.data.default_corpus_bytes)
    tokens = IndexedTokens(path)
    samples = max(0, (tokens.num_tokens - 1) // cfg.data.seq_len)
    global_batch = cfg.data.micro_batch_size * cfg.dims().dp
    if samples < global_batch:
        raise ConfigError("data.path", path, f"holds {samples} samples of data.seq_len={cfg.data.seq_len} tokens, "
                          f"fewer than one global batch ({global_batch})", "use more data or a smaller batch")
    # Bounded check (the head of the file) so a huge corpus does not cost a full scan at start-up.
    head = np.asarray(tokens.tokens[: 1 << 24])
    if head.size and int(head.max()) >= cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size,
                          f"is smaller than a token id in data.path={path} (found {int(head.max())})",
                          "raise model.vocab_size or re-tokenize the data")
    return replace(cfg, data=replace(cfg.data, path=tokens.prefix))


def check_engine(cfg: Config) -> None:
    """engine=nemo: NeMo 2 must be installed, the job must fit this machine (the local launcher), and on CPU
    megatron-core's CUDA-only calls must be patched by a `launcher.preload` module (the package ships none; the
    test suite's `tests/nemo_shim.py` is one)."""
    for i, name in enumerate(cfg.launcher.preload):
        if not importable(name):
            raise ConfigError(f"launcher.preload[{i}]", name, "is not an importable module here",
                              "put its directory on PYTHONPATH (e.g. PYTHONPATH=tests for nemo_shim)")
    if cfg.engine != "nemo":
        return
    t, recipe = cfg.trainer, cfg.recipe_name
    if t.num_nodes != 1:
        raise ConfigError("trainer.num_nodes", t.num_nodes, "checkpointless-train launches the ranks of one machine",
                          f"size the cluster job with: checkpointless-plan recipe={recipe} "
                          f"trainer.num_nodes={t.num_nodes}; here use trainer.num_nodes=1")
    if t.accelerator == "gpu":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < t.devices:
            raise ConfigError("trainer.devices", t.devices, f"needs {t.devices} CUDA GPUs, this machine has {have}",
                              "use a GPU machine, or recipe=tiny_llama_nemo on CPU (docs/getting_started.md)")
    if not importable("nemo"):
        raise ConfigError("engine", "nemo", f"recipe={recipe} runs on NeMo 2, which is not installed here",
                          "pip install -e '.[nemo]' (nemo_toolkit 2.7.x; docs/getting_started.md)")
    if t.accelerator == "cpu" and not cfg.launcher.preload:
        raise ConfigError("launcher.preload", "[]", "engine=nemo on CPU needs megatron-core's CUDA-only calls "
                          "patched, which this package does not ship",
                          "use the test suite's CPU shim: PYTHONPATH=tests checkpointless-train "
                          f"recipe={recipe} launcher.preload=[nemo_shim]")


def check_lightning_path(cfg: Config) -> None:
    p = cfg.parallel
    if (p.tp, p.cp, p.pp, p.ep) != (1, 1, 1, 1):
        raise ConfigError("parallel", f"tp={p.tp},cp={p.cp},pp={p.pp},ep={p.ep}",
                          "the plain-Lightning path is data-parallel only",
                          "set the parallel sizes to 1, or use a NeMo recipe for model parallelism")
    if cfg.trainer.num_nodes != 1:
        raise ConfigError("trainer.num_nodes", cfg.trainer.num_nodes, "the local launcher runs on one machine",
                          "use trainer.num_nodes=1 here (several nodes are not supported yet; size a cluster "
                          "job with checkpointless-plan)")
    t = cfg.trainer
    for key, value, ok in (("trainer.accelerator", t.accelerator, "cpu"), ("trainer.precision", t.precision, "32-true"),
                           ("trainer.accumulate_grad_batches", t.accumulate_grad_batches, 1),
                           ("model.dropout", cfg.model.dropout, 0.0),
                           ("model.rope_scale_factor", cfg.model.rope_scale_factor, 0.0)):
        if value != ok:
            raise ConfigError(key, value, f"the plain-Lightning path supports only {key}={ok}",
                              f"use {key}={ok}, or a NeMo recipe (engine=nemo)")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        from nemo_checkpointless.cli.compose import recipe_names

        print(USAGE.format(recipes=", ".join(recipe_names())))
        return 0
    show = "--cfg" in args
    args = [a for a in args if a != "--cfg"]
    try:
        from nemo_checkpointless.cli.compose import compose

        cfg = compose(args)
        if show:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            return 0
        check_engine(cfg)
        if cfg.engine == "lightning":
            check_lightning_path(cfg)
        cfg = prepare_data(cfg)
    except ConfigError as e:
        print(f"checkpointless-train: error: {e}", file=sys.stderr)
        return 2
    from nemo_checkpointless.launcher import LaunchError, run_local

    run_dir = Path(cfg.run.dir).absolute()
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    for stale in ("summary.json", WORKER_SUMMARY):
        (run_dir / stale).unlink(missing_ok=True)
    save_run_config(cfg, run_dir)
    try:
        summary = run_local(cfg, run_dir)
    except LaunchError as e:
        print(f"checkpointless-train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("checkpointless-train: interrupted", file=sys.stderr)
        return 130
    brief = {k: summary[k] for k in ("final_step", "wall_s", "steps_per_s", "state_sha256", "data_sha256")}
    print(f"checkpointless-train: done: {json.dumps(brief)}; summary in {run_dir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
