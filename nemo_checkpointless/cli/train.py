"""`checkpointless-train [key=value ...]`: compose a recipe, prepare the data, launch the ranks, write the summary.

With no arguments it runs the recipe `tiny_llama_cpu` on 4 CPU ranks with the embedded default corpus.

With `script=PATH ['script_args=[ARG,...]']` it starts a user's own training script instead of the package's worker,
with the recipe's launch settings, exactly as `checkpointless-run` would (`cli.run.launch_script`): the recipe's
ranks, spares, replication, model-parallel layout, collective timeout, checkpoint cadence, fault plan, run dir and
preload modules. The script builds its own model, data and optimizer: the recipe's are not passed (`--cfg` shows
what is).
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
  trainer.num_nodes=N                nodes: one agent per node (launcher.node_rank=I launcher.rdzv_endpoint=
                                     HOST:PORT), or launcher.target=k8s|slurm writes the cluster's launch files
  launcher.preload=[MODULE]          modules every rank imports first (engine=nemo on CPU: the tests' shim)
  seed=S                             random seed
  data.path=PREFIX                   token data PREFIX.bin + PREFIX.idx (see checkpointless-tokenize)
  script=PATH                        run your own training script with the recipe's launch settings
  'script_args=[--max-steps,8]'      its arguments, each passed as written
  --cfg                              print the composed config (with script=: what the script gets) and exit
"""

# What a user's script does not get from the recipe (it builds its own model, data and optimizer).
NOT_PASSED_TO_SCRIPT = ("model", "data (all but data.cache_root)", "optim", "seed", "trainer.max_steps",
                        "trainer.accelerator", "trainer.precision", "trainer.accumulate_grad_batches",
                        "trainer.log_every_n_steps", "trainer.progress_bar", "parallel.ep",
                        "parallel.sequence_parallel")


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
    test suite's `tests/nemo_shim.py` is one), unless the job runs a user's script (which may patch them itself,
    as `tests/scripts/user_nemo.py` does)."""
    for i, name in enumerate(cfg.launcher.preload):
        if not importable(name):
            raise ConfigError(f"launcher.preload[{i}]", name, "is not an importable module here",
                              "put its directory on PYTHONPATH (e.g. PYTHONPATH=tests for nemo_shim)")
    if cfg.engine != "nemo":
        return
    t, recipe = cfg.trainer, cfg.recipe_name
    if t.accelerator == "gpu":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < t.devices:
            raise ConfigError("trainer.devices", t.devices, f"needs {t.devices} CUDA GPUs, this machine has {have}",
                              "use a GPU machine, or recipe=tiny_llama_nemo on CPU (docs/getting_started.md)")
    if not importable("nemo"):
        raise ConfigError("engine", "nemo", f"recipe={recipe} runs on NeMo 2, which is not installed here",
                          "pip install -e '.[nemo]' (nemo_toolkit 2.7.x; docs/getting_started.md)")
    if t.accelerator == "cpu" and not cfg.launcher.preload and cfg.script is None:
        raise ConfigError("launcher.preload", "[]", "engine=nemo on CPU needs megatron-core's CUDA-only calls "
                          "patched, which this package does not ship",
                          "use the test suite's CPU shim: PYTHONPATH=tests checkpointless-train "
                          f"recipe={recipe} launcher.preload=[nemo_shim]")


def check_nodes(cfg: Config) -> None:
    """Several nodes run one agent each, which finds the job's store at `launcher.rdzv_endpoint`."""
    t = cfg.trainer
    if (t.num_nodes > 1 or cfg.replication.spare_nodes) and not cfg.launcher.rdzv_endpoint:
        raise ConfigError("trainer.num_nodes", t.num_nodes, "needs one agent per node, each told where the job's "
                          "store is (launcher.rdzv_endpoint)",
                          f"write the cluster's launch files with launcher.target=k8s or launcher.target=slurm, or "
                          f"run on every node: checkpointless-train recipe={cfg.recipe_name} "
                          f"trainer.num_nodes={t.num_nodes} launcher.node_rank=I launcher.rdzv_endpoint=HOST:PORT "
                          "(docs/cluster.md)")


def check_lightning_path(cfg: Config) -> None:
    p = cfg.parallel
    if (p.tp, p.cp, p.pp, p.ep) != (1, 1, 1, 1):
        raise ConfigError("parallel", f"tp={p.tp},cp={p.cp},pp={p.pp},ep={p.ep}",
                          "the plain-Lightning path is data-parallel only",
                          "set the parallel sizes to 1, or use a NeMo recipe for model parallelism")
    t = cfg.trainer
    for key, value, ok in (("trainer.accelerator", t.accelerator, "cpu"), ("trainer.precision", t.precision, "32-true"),
                           ("trainer.accumulate_grad_batches", t.accumulate_grad_batches, 1),
                           ("model.dropout", cfg.model.dropout, 0.0),
                           ("model.rope_scale_factor", cfg.model.rope_scale_factor, 0.0)):
        if value != ok:
            raise ConfigError(key, value, f"the plain-Lightning path supports only {key}={ok}",
                              f"use {key}={ok}, or a NeMo recipe (engine=nemo)")


def check_script_engine(cfg: Config) -> None:
    """engine=lightning with a user's script: `nemo_checkpointless.lightning.CheckpointlessStrategy` is
    data-parallel only, on one machine (engine=nemo: `check_engine`)."""
    p = cfg.parallel
    for key, value in (("parallel.tp", p.tp), ("parallel.cp", p.cp), ("parallel.pp", p.pp), ("parallel.ep", p.ep)):
        if value != 1:
            raise ConfigError(key, value, f"recipe={cfg.recipe_name} is engine=lightning, whose CheckpointlessStrategy "
                              "is data-parallel only", f"use {key}=1, or a NeMo recipe (engine=nemo) for a script "
                              "on CheckpointlessMegatronStrategy")


def script_launch(cfg: Config) -> list[str]:
    """A user's script under the recipe: the command every rank and spare runs (checkpointless-run's, with the
    recipe's `launcher.preload` imported first). The launcher adds the recipe's model-parallel layout
    (`protocol.LAYOUT_ENV`, which `CheckpointlessMegatronStrategy` takes) and `replication.num_instances` to every
    process's environment (`_Job.torchrun_env`)."""
    from nemo_checkpointless.cli.run import script_command

    assert cfg.script is not None
    return script_command(cfg.script, cfg.script_args, cfg.launcher.preload, key="script",
                          fix="give the path of your training script (relative to this directory)")


def script_environment(cfg: Config, command: list[str]) -> dict[str, str]:
    """The package's variables (`protocol`, NCL_*) rank 0 of the job gets, computed by the launcher's own
    `settings_env` and `torchrun_env` (the code that sets them); the store's address, known at launch, left out."""
    from typing import Any, cast

    from nemo_checkpointless.launcher.local import _Job
    from nemo_checkpointless.protocol import ENV_PREFIX, RUN_DIR_ENV

    run_dir = Path(cfg.run.dir).absolute()
    job = _Job(cfg, run_dir, store=cast(Any, None), port=0, worker_module="", command=command)
    env = {k: v for k, v in {**job.settings_env(), **job.torchrun_env(0)}.items() if k.startswith(ENV_PREFIX)}
    return dict(sorted({**env, RUN_DIR_ENV: str(run_dir)}.items()))


def describe_script_launch(cfg: Config) -> str:
    """`--cfg` with script=: what the script is started with (YAML)."""
    from omegaconf import OmegaConf

    command = script_launch(cfg)
    t, r, lc, p = cfg.trainer, cfg.replication, cfg.launcher, cfg.parallel
    launch = {"trainer.devices": t.devices, "trainer.num_nodes": t.num_nodes, "ranks": t.world_size,
              "replication.spares": r.spares, "replication.num_instances": r.num_instances,
              "parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.cp": p.cp,
              "launcher.collective_timeout_s": lc.collective_timeout_s, "launcher.hang_deadline_s": lc.hang_deadline_s,
              "launcher.max_restarts": lc.max_restarts,
              "launcher.on_failure": lc.on_failure, "launcher.host": lc.host, "launcher.preload": list(lc.preload),
              "checkpoint.every_n_steps": cfg.checkpoint.every_n_steps, "checkpoint.dir": cfg.checkpoint.dir,
              "fault.plan": [f.as_dict() for f in cfg.fault.plan], "run.dir": cfg.run.dir}
    view = {"recipe": cfg.recipe_name, "engine": cfg.engine, "script": cfg.script,
            "script_args": list(cfg.script_args), "command": command, "launch": launch,
            "environment": script_environment(cfg, command), "not_passed": list(NOT_PASSED_TO_SCRIPT)}
    head = (f"# checkpointless-train recipe={cfg.recipe_name} script={cfg.script}: every rank runs `command` with "
            "torchrun's variables plus `environment`;\n# the script builds its own model, data and optimizer "
            "(`not_passed`: the recipe's settings it does not get)\n")
    return head + OmegaConf.to_yaml(OmegaConf.create(view))


def run_script(cfg: Config, show: bool) -> int:
    """`checkpointless-train recipe=NAME script=PATH ...`: print what the script gets (`show`), or check the job
    fits this machine and launch it as checkpointless-run does (a bad setting raises ConfigError first)."""
    if show:
        print(describe_script_launch(cfg))
        return 0
    command = script_launch(cfg)  # the script is not a file: the first thing to say
    check_nodes(cfg)
    if cfg.engine == "lightning":
        check_script_engine(cfg)
    check_engine(cfg)
    from nemo_checkpointless.cli.run import launch_script

    return launch_script(cfg, command, "checkpointless-train")


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
        if cfg.launcher.target != "local" and not show:  # k8s / slurm: write the launch files, start nothing here
            from nemo_checkpointless.cluster import write_launch_files

            return write_launch_files(cfg, args)
        if cfg.script is not None:
            return run_script(cfg, show)
        if show:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            return 0
        check_nodes(cfg)
        check_engine(cfg)
        if cfg.engine == "lightning":
            check_lightning_path(cfg)
        cfg = prepare_data(cfg)
    except ConfigError as e:
        print(f"checkpointless-train: error: {e}", file=sys.stderr)
        return 2
    from nemo_checkpointless.launcher import LaunchError, run_job

    run_dir = Path(cfg.run.dir).absolute()
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    for stale in ("summary.json", WORKER_SUMMARY):
        (run_dir / stale).unlink(missing_ok=True)
    save_run_config(cfg, run_dir)
    try:
        summary = run_job(cfg, run_dir)
    except LaunchError as e:
        print(f"checkpointless-train: error: {e}", file=sys.stderr)
        return e.exit_code  # as checkpointless-run: a job the ranks stopped on purpose ends with 3
    except KeyboardInterrupt:
        print("checkpointless-train: interrupted", file=sys.stderr)
        return 130
    if not summary:  # several nodes: another node's agent led at the end and wrote the summary
        print("checkpointless-train: done: this node's ranks finished (the summary is in the leading node's run dir)")
        return 0
    brief = {k: summary[k] for k in ("final_step", "wall_s", "steps_per_s", "state_sha256", "data_sha256")}
    print(f"checkpointless-train: done: {json.dumps(brief)}; summary in {run_dir / 'summary.json'}")
    if cfg.run.timeline:
        from nemo_checkpointless.bench.report import run_timeline_png

        if run_timeline_png(run_dir, summary, run_dir / "timeline.png"):
            print(f"checkpointless-train: the recovery timeline is in {run_dir / 'timeline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
