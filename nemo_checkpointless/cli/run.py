"""`checkpointless-run`: torchrun's command line for a user's own training script, with in-process recovery.

    checkpointless-run [--nproc-per-node K] [--nnodes 1] [--spares S] [--max-restarts M] [--run-dir D]
                       [--num-instances N] [--checkpoint-every K] [--collective-timeout T]
                       script.py ARGS...      (or -m module ARGS..., or --no-python program ARGS...)

    several nodes, one agent each (the same command on every node, its own --node-rank):
    checkpointless-run --nnodes N --node-rank I --rdzv-endpoint HOST:PORT [--rdzv-backend c10d|external]
                       [--local-addr ADDR] [--spare-nodes M] [--node-lease S] --nproc-per-node K ... script.py

It hosts the job's store (never on a training rank), starts K ranks with the variables torchrun sets (`RANK`,
`LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`, `TORCHELASTIC_RUN_ID`,
...) plus the package's own (`protocol`), keeps S hot spares (each runs the script up to `trainer.fit` and waits
there), replaces failed ranks, and exits with the training's exit code. A script on `CheckpointlessStrategy`
recovers in process: only the failed rank is replaced, from a live replica. Any other script (e.g. plain DDP with
`init_process_group`) gets tier 1: the launcher's store (`TORCHELASTIC_USE_AGENT_STORE`: rank 0 hosts nothing)
and, on a failure, every rank restarted at once with the store kept (the script resumes from its own checkpoint).

On several nodes (`launcher.nodes`), each node's agent starts and watches its ranks and spares; the job's
decisions are made once, by the leading agent, through the store at --rdzv-endpoint (hosted by node 0's agent
with c10d, as torchrun does, or by a `checkpointless-store` of its own with external); a node whose agent stops
beating for --node-lease seconds is lost, and its ranks are recovered on the others.

The arguments are `torch.distributed.run`'s own parser, extended; its flags for what this launcher does not do
(elastic node ranges, the etcd backends, numa binding, ...) are refused with one message each.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from nemo_checkpointless.cli import importable
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.protocol import WORKER_SUMMARY

PROG = "checkpointless-run"
# torchrun flags whose non-default values this launcher does not implement (dest -> default).
_REFUSED = {"event_log_handler": "null", "run_path": False, "local_ranks_filter": "",
            "numa_binding": None, "logs_specs": None, "virtual_local_rank": False}
# torchrun's rendezvous backends, as this launcher reads them: the job's store at --rdzv-endpoint is hosted by
# node 0's agent (static, c10d: as torchrun does) or runs on its own (external: a checkpointless-store).
_BACKENDS = {"static": "c10d", "c10d": "c10d", "external": "external"}


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = PROG
    parser.description = ("torchrun-compatible launcher with checkpointless recovery: hosts the job's store, "
                          "starts the ranks and hot spares, replaces failed ranks.")
    ours = parser.add_argument_group("checkpointless")
    ours.add_argument("--spares", type=int, default=0, help="hot spares kept warm (each runs the script up to fit)")
    ours.add_argument("--run-dir", "--run_dir", default=None,
                      help="logs, summary.json and the fallback checkpoint (default: runs/<script name>)")
    ours.add_argument("--num-instances", "--num_instances", type=int, default=None,
                      help="replicated optimizer instances for CheckpointlessStrategy (default: 2 if it divides "
                           "the data-parallel size, else 1)")
    ours.add_argument("--checkpoint-every", "--checkpoint_every", type=int, default=0,
                      help="persistent fallback checkpoint every N steps (0: none; the fallback is step 0)")
    ours.add_argument("--collective-timeout", "--collective_timeout", type=float, default=30.0,
                      help="seconds a collective may make no progress before it counts as a hang")
    ours.add_argument("--on-failure", "--on_failure", choices=("recover", "restart_all"), default="recover",
                      help="restart_all: restart every rank on a failure (the baseline a job restart gives)")
    ours.add_argument("--fault", action="append", default=[], metavar="KIND:RANK:STEP",
                      help="inject a fault (tests, benchmarks): kill, segfault, abort, sigterm, oom, exit0, "
                           "exception, hang, spin, stall, gil, slow, corrupt, bitflip or grow; KIND:RANK:STEP:TARGET "
                           "for bitflip (shard, param) and kill (gather: after the step's gradient all-reduce)")
    ours.add_argument("--straggler-factor", "--straggler_factor", type=float, default=1.5, metavar="F",
                      help="report a rank whose own work per step takes F x the other ranks' (never replaced; "
                           "0: off)")
    ours.add_argument("--spare-nodes", "--spare_nodes", type=int, default=0,
                      help="several nodes: nodes that hold only spares (--nproc-per-node each), with node ranks "
                           "from --nnodes on")
    ours.add_argument("--node-lease", "--node_lease", type=float, default=2.0, metavar="S",
                      help="several nodes: a node whose agent has not beaten for S seconds is lost, and its ranks "
                           "are recovered on other nodes")
    ours.add_argument("--hang-deadline", "--hang_deadline", type=float, default=0.0, metavar="S",
                      help="the progress watchdog's deadline: a rank without progress this long (stopped, busy, or "
                           "idle behind the others) is replaced; 0: max(5 s, 10 x p95 step time); < 0: off")
    ours.add_argument("--shrink", action="store_true",
                      help="when a rank fails and no spare is ready, go on with the whole optimizer instances (the "
                           "same global batch) and grow back when spares are ready")
    ours.add_argument("--replacement-timeout", "--replacement_timeout", type=float, default=0.0, metavar="S",
                      help="with --shrink: how long a fault waits for a spare that is still starting "
                           "(0: shrink at once)")
    ours.add_argument("--integrity-every", "--integrity_every", type=int, default=50, metavar="N",
                      help="compare the optimizer shards' replicas and every rank's parameters every N steps and "
                           "after every recovery (0: never)")
    ours.add_argument("--nan-policy", "--nan_policy", default="stop", metavar="POLICY",
                      help="a non-finite gradient that comes back when its step is run again: stop (end the job, "
                           "naming the batch's samples) or skip (drop that batch, with a record)")
    ours.add_argument("--verbose", action="store_true",
                      help="the ranks' DEBUG lines too (a re-entered fit's set-up times, where a replacement's "
                           "first batch came from)")
    parser.set_defaults(max_restarts=3)
    return parser


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def _nproc(value: str) -> int:
    if value in ("auto", "cpu"):
        return os.cpu_count() or 1
    try:
        n = int(value)
    except ValueError:
        raise ConfigError("--nproc-per-node", value, "must be a positive integer (or auto, cpu)",
                          "e.g. --nproc-per-node 4") from None
    if n < 1:
        raise ConfigError("--nproc-per-node", value, "must be >= 1", "e.g. --nproc-per-node 4")
    return n


def _join_timeout(conf: str) -> float | None:
    """torchrun's `--rdzv-conf join_timeout=S` (how long nodes, and ranks, may take to join); no other key."""
    out = None
    for item in filter(None, conf.split(",")):
        key, _, value = item.partition("=")
        if key != "join_timeout":
            raise ConfigError("--rdzv-conf", conf, f"sets {key}, which {PROG} does not read",
                              "only join_timeout=SECONDS is read (e.g. --rdzv-conf join_timeout=120)")
        try:
            out = float(value)
        except ValueError:
            out = -1.0
        if not out > 0:
            raise ConfigError("--rdzv-conf", conf, "join_timeout must be a number of seconds > 0",
                              "e.g. --rdzv-conf join_timeout=120")
    return out


def _fault_plan(specs: list[str]) -> list[dict[str, Any]]:
    out = []
    for spec in specs:
        parts = spec.split(":")
        if len(parts) not in (3, 4) or not parts[1].isdigit() or not parts[2].isdigit():
            raise ConfigError("--fault", spec, "must be KIND:RANK:STEP[:TARGET] (a target for bitflip and kill)",
                              "e.g. --fault kill:1:20, --fault kill:1:20:gather, --fault bitflip:1:9:param")
        out.append({"kind": parts[0], "rank": int(parts[1]), "step": int(parts[2]),
                    **({"target": parts[3]} if len(parts) == 4 else {})})
    return out


# Run with `python -u -c` as: PRELOAD (comma-separated modules) SCRIPT ARGS... Imports the modules first (calling
# `install()` where a module has one, as the package's workers do with launcher.preload; not again where the rank
# template this process was forked from did, `restart.script_runner`), then runs SCRIPT as
# `python SCRIPT ARGS` would: `sys.argv`, `sys.path[0]` (the script's directory) and `__name__ == "__main__"`.
_PRELOAD_BOOTSTRAP = """import importlib, os, runpy, sys
_template = sys.modules.get("nemo_checkpointless.restart.script_runner")
for _name in sys.argv[1].split(","):
    if _template is not None and _template.already_installed(_name):
        continue
    _install = getattr(importlib.import_module(_name), "install", None)
    if callable(_install):
        _install()
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def script_command(script: str, args: Sequence[str], preload: Sequence[str] = (), key: str = "training_script",
                   fix: str = "give the path of the training script") -> list[str]:
    """What every rank (and spare) of a user's script file runs: `python -u SCRIPT ARGS`; with `preload` modules,
    a bootstrap that imports them before the script runs (same `sys.argv`, `__main__`). `key`, `fix`: how a
    missing file is named in the error (the flag or the override the user wrote)."""
    if not os.path.isfile(script):
        raise ConfigError(key, script, "is not a file", fix)
    if not preload:
        return [sys.executable, "-u", script, *args]
    return [sys.executable, "-u", "-c", _PRELOAD_BOOTSTRAP, ",".join(preload), script, *args]


def _command(args: argparse.Namespace) -> list[str]:
    script, rest = args.training_script, list(args.training_script_args)
    if args.no_python:
        if args.module:
            raise ConfigError("--no-python", True, "cannot be combined with -m", "drop one of the two")
        if shutil.which(script) is None and not os.path.exists(script):
            raise ConfigError("training_script", script, "is not a program on PATH or a file", "check the name")
        return [script, *rest]
    if args.module:
        if not importable(script):
            raise ConfigError("-m", script, "is not an importable module here", "check the name and PYTHONPATH")
        return [sys.executable, "-u", "-m", script, *rest]
    return script_command(script, rest)


def _config(args: argparse.Namespace) -> Any:
    from nemo_checkpointless.config import Config

    nnodes_text = str(args.nnodes)
    low, _, high = nnodes_text.partition(":")
    if not low.isdigit() or (high and high != low) or int(low) < 1:
        raise ConfigError("--nnodes", nnodes_text, "must be a fixed number of nodes (N or N:N)",
                          "e.g. --nnodes 2 (a job that shrinks or grows is not launched this way)")
    nnodes = int(low)
    backend = _BACKENDS.get(args.rdzv_backend)
    if backend is None:
        raise ConfigError("--rdzv-backend", args.rdzv_backend, "must be static, c10d or external",
                          "use c10d (node 0's agent hosts the store) or external (start checkpointless-store on a "
                          "host of its own; docs/cluster.md)")
    # torchrun's static rendezvous: several nodes find node 0 at --master-addr:--master-port
    endpoint = args.rdzv_endpoint or (f"{args.master_addr}:{args.master_port}"
                                      if args.master_port and (nnodes > 1 or args.spare_nodes) else "")
    if (nnodes > 1 or args.spare_nodes) and not endpoint:
        raise ConfigError("--rdzv-endpoint", "''", f"is needed for --nnodes {nnodes}",
                          "give every node the store's HOST:PORT, e.g. --rdzv-endpoint 10.0.0.1:29400, and its own "
                          "--node-rank")
    if args.spare_nodes < 0:
        raise ConfigError("--spare-nodes", args.spare_nodes, "must be >= 0", "use 0, 1, 2, ...")
    join_timeout = _join_timeout(args.rdzv_conf)
    if not args.node_lease > 0:
        raise ConfigError("--node-lease", args.node_lease, "must be > 0", "e.g. --node-lease 2")
    if endpoint:
        from nemo_checkpointless.launcher.nodes import parse_endpoint

        parse_endpoint(endpoint)
    elif int(args.node_rank) != 0:
        raise ConfigError("--node-rank", args.node_rank, "must be 0 on one node", "drop --node-rank")
    for dest, default in _REFUSED.items():
        if getattr(args, dest, default) != default:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(flag, getattr(args, dest), f"is a torchrun option {PROG} does not implement",
                              f"drop {flag}")
    if args.spares < 0:
        raise ConfigError("--spares", args.spares, "must be >= 0", "use 0 for no hot spare, or 1, 2, ...")
    if args.max_restarts < 0:
        raise ConfigError("--max-restarts", args.max_restarts, "must be >= 0", "e.g. --max-restarts 3")
    if args.checkpoint_every < 0:
        raise ConfigError("--checkpoint-every", args.checkpoint_every, "must be >= 0", "0 (none) or N steps")
    if args.collective_timeout <= 0:
        raise ConfigError("--collective-timeout", args.collective_timeout, "must be > 0", "e.g. 30")
    nproc = _nproc(str(args.nproc_per_node))
    world = nproc * nnodes
    instances = args.num_instances or (2 if world % 2 == 0 else 1)
    if instances < 1 or world % instances:
        raise ConfigError("--num-instances", instances, f"must divide the data-parallel size {world}",
                          f"use a divisor of {world}")
    if args.replacement_timeout < 0:
        raise ConfigError("--replacement-timeout", args.replacement_timeout, "must be >= 0 seconds",
                          "use 0 (shrink at once when no spare is ready) or the seconds a starting spare may take")
    if args.shrink and instances == 1:
        raise ConfigError("--shrink", True, "needs --num-instances >= 2: with one optimizer instance there is "
                          "nothing to shrink to", "use --num-instances 2, or drop --shrink")
    if args.shrink and nnodes > 1:
        raise ConfigError("--shrink", True, f"runs on one node in this release (--nnodes {nnodes})",
                          "drop --shrink, or keep spare nodes (--spare-nodes)")
    if args.integrity_every < 0:
        raise ConfigError("--integrity-every", args.integrity_every, "must be >= 0",
                          "use 0 (no check) or a number of steps, e.g. 50")
    plan = _fault_plan(args.fault)
    cfg = Config()
    script_name = Path(args.training_script).stem or "job"
    run_dir = args.run_dir or f"runs/{script_name}"
    from nemo_checkpointless.config import FaultSpec

    return replace(
        cfg, recipe_name=f"script:{script_name}", run=replace(cfg.run, dir=run_dir),
        trainer=replace(cfg.trainer, devices=nproc, num_nodes=nnodes, max_steps=1 << 30),
        replication=replace(cfg.replication, num_instances=instances, spares=args.spares,
                            spare_nodes=args.spare_nodes, shrink=args.shrink,
                            replacement_timeout_s=args.replacement_timeout),
        checkpoint=replace(cfg.checkpoint, every_n_steps=args.checkpoint_every),
        integrity=replace(cfg.integrity, every_n_steps=args.integrity_every, nan_policy=args.nan_policy),
        fault=replace(cfg.fault, plan=[FaultSpec(**f) for f in plan]),
        launcher=replace(cfg.launcher, host=args.master_addr, max_restarts=args.max_restarts,
                         collective_timeout_s=args.collective_timeout, on_failure=args.on_failure,
                         hang_deadline_s=args.hang_deadline, node_rank=int(args.node_rank),
                         rdzv_endpoint=endpoint, rdzv_backend=backend, local_addr=args.local_addr or "",
                         node_lease_s=args.node_lease, straggler_factor=args.straggler_factor,
                         start_timeout_s=join_timeout or cfg.launcher.start_timeout_s, verbose=args.verbose))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)  # unknown flags: argparse's one line, exit 2
    try:
        cfg = _config(args)
        command = _command(args)
    except ConfigError as e:
        return _fail(str(e))
    if args.log_dir:
        print(f"{PROG}: note: logs go to {Path(cfg.run.dir).absolute() / 'logs'} (--log-dir is not used)",
              file=sys.stderr)
    return launch_script(cfg, command, PROG, port=args.master_port)


def launch_script(cfg: Any, command: list[str], prog: str, port: int | None = None) -> int:
    """Run a user's `command` on the job `cfg` describes (`run_local`: ranks, spares, recovery) and return the exit
    code: checkpointless-run's launch, shared with `checkpointless-train recipe=NAME script=...`."""
    from nemo_checkpointless.launcher import LaunchError, run_job

    run_dir = Path(cfg.run.dir).absolute()
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(run_dir, 0o700)
    for stale in ("summary.json", WORKER_SUMMARY):
        (run_dir / stale).unlink(missing_ok=True)
    try:
        summary = run_job(cfg, run_dir, command=command, port=port)
    except LaunchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    if not summary:  # several nodes: another node's agent led at the end and wrote the summary
        print(f"{prog}: done: this node's ranks finished (the summary is in the leading node's run dir)",
              file=sys.stderr)
        return 0
    brief = {k: summary.get(k) for k in ("final_step", "wall_s", "state_sha256")}
    brief["recoveries"] = len(summary.get("recoveries", []))
    print(f"{prog}: done: {json.dumps(brief)}; summary in {run_dir / 'summary.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
