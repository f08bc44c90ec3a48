"""`checkpointless-plan [KEY=VALUE ...] [options]`: memory per GPU and expected goodput of a recipe at a cluster size.

Takes the same overrides as `checkpointless-train` (e.g. `recipe=llama3_70b trainer.num_nodes=16`), validates them
the same way, starts nothing, and prints: parameters, grads and optimizer state per GPU with N optimizer instances
(and what the replicas cost), an activation estimate, whether it fits each GPU size, and the goodput of
checkpoint-restart vs. checkpointless recovery with the recommended number of hot spare nodes. Formulas and the
figures behind the defaults: docs/planning.md.
"""

from __future__ import annotations

import argparse
import sys

from nemo_checkpointless.config import Config
from nemo_checkpointless.errors import ConfigError
from nemo_checkpointless.planning import (
    GoodputInputs,
    MemoryPlan,
    plan_memory,
    recommend_spares,
    restart_baseline,
    total_params,
)
from nemo_checkpointless.planning import goodput as g
from nemo_checkpointless.planning.memory import BYTES_PER_PARAM, GIB

PROG = "checkpointless-plan"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, description="Memory per GPU and expected goodput of a recipe at a cluster size (starts nothing).",
        epilog="example: checkpointless-plan recipe=llama3_70b trainer.num_nodes=16 replication.num_instances=2")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="the same overrides as checkpointless-train")
    ap.add_argument("--gpu-memory-gb", type=float, action="append", metavar="GB",
                    help="GPU memory to check against (repeatable; default: 80 and 141)")
    ap.add_argument("--reserve-gb", type=float, default=5.0, metavar="GB",
                    help="kept free for the CUDA context, NCCL buffers and fragmentation (default: 5)")
    ap.add_argument("--failure-rate", type=float, default=g.FAILURES_PER_GPU_HOUR, metavar="PER_GPU_HOUR",
                    help="failures per GPU-hour (default: %(default).3g, Llama 3's 466 interruptions in 54 days "
                         "on 16,384 GPUs)")
    ap.add_argument("--recovery-s", type=float, default=g.RECOVERY_S,
                    help="checkpointless recovery time per failure, seconds (default: %(default)g)")
    ap.add_argument("--restart-min", type=float, default=g.RESTART_S / 60,
                    help="whole-job restart from a checkpoint, minutes (default: %(default)g)")
    ap.add_argument("--checkpoint-save-s", type=float, default=g.CHECKPOINT_SAVE_S,
                    help="time a checkpoint save blocks training, seconds (default: %(default)g)")
    ap.add_argument("--node-wait-min", type=float, default=g.NODE_WAIT_S / 60,
                    help="wait for a new node when no hot spare is free, minutes (default: %(default)g)")
    ap.add_argument("--spare-refill-h", type=float, default=g.SPARE_REFILL_H,
                    help="hours until a used spare's slot is refilled (default: %(default)g)")
    return ap


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 10**8 else f"{n:,}"


def _replicas_across_nodes(cfg: Config) -> bool:
    """True when every optimizer shard's replicas sit on at least two nodes (a node loss keeps one)."""
    from nemo_checkpointless.topology import replica_groups

    per_node = cfg.trainer.devices
    return all(len({r // per_node for r in group}) > 1 for group in replica_groups(cfg.dims()))


def memory_lines(cfg: Config, mem: MemoryPlan, gpus_gb: list[float], reserve_gb: float) -> list[str]:
    pb, gb, ob = BYTES_PER_PARAM[mem.precision]
    n, s = mem.num_instances, mem.shard_group
    p = cfg.parallel
    sp = "SP" if p.sequence_parallel and p.tp > 1 else "no SP"
    grad_kind = "fp32 main grads" if mem.precision == "bf16-mixed" else "fp32 grads"
    opt_kind = "fp32 master + Adam m, v" if ob == 12 else "fp32 Adam m, v"
    rows = [
        ("params", f"{mem.precision}, {pb} B/param", mem.params),
        ("grads", f"{grad_kind}, {gb} B/param", mem.grads),
        ("optimizer", f"{opt_kind}, {ob} B/param / shard group {s} (N={n})", mem.optimizer),
        ("  replicas", f"extra for N={n} vs 1: {ob} B x (N-1)/(dp*cp) = {ob} B x {n - 1}/{mem.dp_cp}",
         mem.replication_extra),
        ("activations", f"ESTIMATE: 1F1B, no recompute, flash attn, {sp}", mem.activations),
        ("total", "", mem.total),
    ]
    unit, scale = ("GiB", GIB) if mem.total >= GIB else ("MiB", 1 << 20)
    head = f"memory per {'GPU' if cfg.trainer.accelerator == 'gpu' else 'rank'}, most loaded rank: " \
           f"{_count(mem.params_per_gpu)} parameters (tp={p.tp}, pp={p.pp}, vocab padded)"
    lines = [f"{head:<80}{unit:>8}"]
    lines += [f"  {label:<12} {desc:<66}{value / scale:8.2f}" for label, desc, value in rows]
    verdicts = [f"{cap:g} GB: {'fits' if mem.fits(cap, reserve_gb) else 'does NOT fit'}" for cap in gpus_gb]
    lines.append(f"  fits (keeping {reserve_gb:g} GB free)? " + "; ".join(verdicts))
    return lines


def goodput_lines(cfg: Config, mem: MemoryPlan, x: GoodputInputs) -> list[str]:
    base = restart_baseline(x)
    best, options = recommend_spares(x)
    mtbf = "never" if x.failures_per_hour == 0 else f"every {x.mtbf_h:.1f} h"
    lines = [
        f"failures: {x.failures_per_gpu_hour:.3g} per GPU-hour x {x.gpus} GPUs = {x.failures_per_hour:.4g}/h "
        f"(one {mtbf})",
        f"  checkpoint-restart: restart {x.restart_s / 60:g} min, save {x.checkpoint_save_s:g} s every "
        f"{base.checkpoint_interval_h:.2f} h (Young's interval){'':>17}goodput {base.goodput:7.3%}",
    ]
    for o in options[: max(4, best.spares + 2)]:
        mark = "  <- recommended" if o is best else ""
        lines.append(f"  checkpointless, {o.spares:>2} hot spare node(s) ({o.spares * x.gpus_per_node:>3} GPUs): "
                     f"recovery {x.recovery_s:g} s, no spare free {o.p_wait:7.2%}  goodput {o.goodput:7.3%}{mark}")
    lines.append(f"  recommended: replication.spares={best.spares * x.gpus_per_node} "
                 f"({best.spares} node(s) of {x.gpus_per_node} GPUs)")
    lines.append(f"  a replacement receives {mem.state_received_bytes / 1e9:.1f} GB (params + its optimizer shard) "
                 f"from a replica: {mem.state_received_bytes / 50e9:.1f} s at 50 GB/s (400 Gb/s)")
    if cfg.replication.num_instances == 1:
        lines.append("  warning: replication.num_instances=1 keeps no replica: every failure falls back to the "
                     "checkpoint (the checkpointless figures above do not apply)")
    elif not _replicas_across_nodes(cfg):
        lines.append("  warning: some optimizer shards have all their replicas on one node: a whole-node loss "
                     "falls back to the checkpoint (one failed GPU is still recovered from its peer)")
    return lines


def plan_text(cfg: Config, args: argparse.Namespace) -> str:
    d = cfg.dims()
    t, p, data = cfg.trainer, cfg.parallel, cfg.data
    gbs = data.micro_batch_size * d.dp * t.accumulate_grad_batches
    mem = plan_memory(cfg)
    x = GoodputInputs(gpus=t.world_size, gpus_per_node=t.devices, failures_per_gpu_hour=args.failure_rate,
                      recovery_s=args.recovery_s, restart_s=args.restart_min * 60,
                      checkpoint_save_s=args.checkpoint_save_s, node_wait_s=args.node_wait_min * 60,
                      spare_refill_h=args.spare_refill_h)
    head = [
        f"{PROG}: recipe {cfg.recipe_name} (engine {cfg.engine}, {t.precision}): "
        f"{_count(total_params(cfg.model))} parameters",
        f"cluster: {t.num_nodes} node(s) x {t.devices} {t.accelerator.upper()}s = {t.world_size}; "
        f"tp={p.tp} pp={p.pp} cp={p.cp} -> dp={d.dp}, dp*cp={d.dp_cp}; "
        f"replication.num_instances={d.num_instances} -> shard group {mem.shard_group}",
        f"global batch = micro {data.micro_batch_size} x DP {d.dp} x accumulation {t.accumulate_grad_batches} = "
        f"{gbs} sequences x {data.seq_len} tokens = {gbs * data.seq_len:,} tokens/step",
        "",
    ]
    gpus = args.gpu_memory_gb or [80.0, 141.0]
    return "\n".join(head + memory_lines(cfg, mem, gpus, args.reserve_gb) + [""] + goodput_lines(cfg, mem, x))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        for key in ("gpu_memory_gb",):
            for v in getattr(args, key) or []:
                if v <= 0:
                    raise ConfigError("--gpu-memory-gb", v, "must be > 0", "use e.g. 80 or 141")
        from nemo_checkpointless.cli.compose import compose

        cfg = compose(list(args.overrides))
        text = plan_text(cfg, args)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a negative option (GoodputInputs)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
