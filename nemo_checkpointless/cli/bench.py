"""`checkpointless-bench [--quick] [--out DIR] [--systems A,B] ...`: the same job and the same fault under this
project and its peers, in one run on this machine, as ratios (`nemo_checkpointless.bench`).

Systems (`--systems`, default all): job_restart (torchrun + Lightning DDP + ModelCheckpoint), nvrx (NVIDIA's
in-process Wrapper), torchft, ours (p2p, a warm spare), ours_checkpoint (N=1: the checkpoint fallback), plain_ddp
(fault-free only: the baseline of the fault-free cost). The peers need `pip install '.[bench]'`; a peer that is not
installed gets a row that says so and the rest runs.

Each system runs the job --runs times with rank 1 SIGKILLed at --kill-step and once without a fault; ours also at
each rank count of --scaling (downtime at 2 and 8 ranks). Writes DIR/bench.json, DIR/bench.md and DIR/timeline.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from nemo_checkpointless.bench import report
from nemo_checkpointless.bench.job import JobSpec
from nemo_checkpointless.bench.systems import BY_NAME, SYSTEMS, launch, missing
from nemo_checkpointless.errors import ConfigError

PROG = "checkpointless-bench"


def _parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").split("\n\n", 1)
    ap = argparse.ArgumentParser(prog=PROG, description=doc[0], epilog=doc[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="one fault per system, a short job (about 12 minutes on 2 cores)")
    ap.add_argument("--out", default="runs/bench", help="where bench.json, bench.md and timeline.png go")
    ap.add_argument("--systems", default=",".join(s.name for s in SYSTEMS), help="comma-separated, of: "
                    + ", ".join(s.name for s in SYSTEMS))
    ap.add_argument("--runs", type=int, default=None, help="faulted runs per system (default 3; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps of the job (default 120; --quick 60)")
    ap.add_argument("--kill-step", type=int, default=None,
                    help="rank 1 is SIGKILLed once it completed this step (default: steps // 2 + 3)")
    ap.add_argument("--ranks", type=int, default=4, help="data-parallel ranks (default 4)")
    ap.add_argument("--scaling", default=None, help="rank counts of ours' extra faulted runs, on a job of "
                    "--kill-step + 15 steps (default 2,8): rto_scaling_8_over_2")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take before it is stopped")
    return ap


def _check(args: argparse.Namespace) -> tuple[list[str], JobSpec, int, list[int]]:
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    for name in names:
        if name not in BY_NAME:
            raise ConfigError("--systems", name, f"must name systems of {', '.join(BY_NAME)}",
                              "fix the name, or leave --systems out for all of them")
    steps = args.steps or (60 if args.quick else 120)
    spec = JobSpec(steps=steps)
    kill = args.kill_step if args.kill_step is not None else steps // 2 + 3
    if not spec.ckpt_every < kill < steps - 5:
        raise ConfigError("--kill-step", kill, f"must be after the first checkpoint (step {spec.ckpt_every}) and "
                          f"at least 5 steps before the end (--steps {steps})",
                          f"use a step in {spec.ckpt_every + 1}..{steps - 6}, or more --steps")
    if args.ranks < 2 or args.ranks % 2:
        raise ConfigError("--ranks", args.ranks, "must be even and >= 2 (ours keeps 2 optimizer instances)",
                          "use 2, 4 or 8")
    scaling = [int(x) for x in (args.scaling or "2,8").split(",") if x.strip()]
    for n in scaling:
        if n < 2 or n % 2:
            raise ConfigError("--scaling", n, "must list even rank counts >= 2", "e.g. --scaling 2,8")
    return names, spec, kill, scaling


def run(args: argparse.Namespace) -> dict[str, Any]:
    names, spec, kill, scaling = _check(args)
    runs_per = args.runs or (1 if args.quick else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    raw: dict[str, list[dict[str, Any]]] = {}
    systems: dict[str, Any] = {}
    t0 = time.time()
    for name in names:
        system = BY_NAME[name]
        why = missing(system)
        if why is not None:
            systems[name] = {"title": system.title, "why": why}
            print(f"{PROG}: {name}: {why}", file=sys.stderr, flush=True)
            continue
        runs: list[dict[str, Any]] = []
        # Interleaved with the fault-free run, so that a busier phase of the machine touches both.
        plan = [None] + ([kill] * runs_per if system.faults else [])
        for i, kill_step in enumerate(plan):
            record = launch(name, out / "runs" / f"{name}-{i}", spec, args.ranks, kill_step, args.timeout)
            runs.append(record)
            what = "fault-free" if kill_step is None else f"SIGKILL rank 1 at step {kill_step}"
            status = "; ".join(record["problems"]) or "ok"
            print(f"{PROG}: {name:16s} {what:26s} wall {record['wall_s']:7.2f} s  downtime "
                  f"{record.get('downtime_s')}  ({status})", file=sys.stderr, flush=True)
        raw[name] = runs
        faulted = [r for r in runs if r["faulted"]]
        clean = [r for r in runs if not r["faulted"]]
        systems[name] = {"title": system.title, **report.summarize(name, faulted, clean)}
    ratios = _ours_costs(args, names, spec, kill, scaling, raw, systems, out)
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()},
               "job": {**vars(spec), "ranks": args.ranks, "kill_step": kill, "runs_per_system": runs_per},
               "systems": systems, "ratios": ratios, "elapsed_s": round(time.time() - t0, 1), "runs": raw}
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(report.table(results))
    report.timeline_png(results, raw, out / "timeline.png")
    return results


def _ours_costs(args: argparse.Namespace, names: list[str], spec: JobSpec, kill: int, scaling: list[int],
                raw: dict[str, list[dict[str, Any]]], systems: dict[str, Any], out: Path) -> dict[str, Any]:
    """The ratios: peers' median downtime and job time lost over ours; ours' fault-free cost against plain DDP; its
    training state per rank against the theory; its p2p transfer rate against raw gloo; its downtime at the
    largest rank count of --scaling (and --ranks) over the smallest."""
    ours = systems.get("ours", {})
    ratios: dict[str, Any] = {}
    for peer in report.PEERS:
        s = systems.get(peer, {})
        ratios[f"rto_ratio_vs_{peer}"] = report.ratio(s.get("downtime_s"), ours.get("downtime_s"))
        # A fault costs the job at least its downtime less about one step; a smaller measured loss is the noise
        # of the step rate, so ours' loss counts as no less than its downtime here.
        floor = max(x for x in (ours.get("lost_s"), ours.get("downtime_s"), 0.0) if x is not None)
        ratios[f"lost_ratio_vs_{peer}"] = report.ratio(s.get("lost_s"), floor or None)
    plain = systems.get("plain_ddp", {})
    ours_rate, plain_rate = ours.get("fault_free_steps_per_s"), plain.get("fault_free_steps_per_s")
    ratios["overhead_pct"] = (round((plain_rate / ours_rate - 1) * 100, 2) if ours_rate and plain_rate else None)
    clean = next((r for r in raw.get("ours", []) if not r["faulted"] and "state_bytes" in r), None)
    if clean is not None:
        b = clean["state_bytes"]
        dp, n = args.ranks, 2
        theory = 4 * b["num_params"] * (1 + 1 + 2 * n / dp)  # fp32 params + grads + AdamW's 2 moments x N / DP
        ratios["memory_overhead_ratio"] = round((b["params"] + b["grads"] + b["optimizer"]) / theory, 4)
        ratios["memory_bytes"] = {**b, "theory": int(theory)}
    recs = [rec for r in raw.get("ours", []) if r["faulted"] for rec in r.get("recoveries", [])
            if rec.get("path") == "p2p" and rec.get("transfer_s")]
    if recs:
        from nemo_checkpointless.bench.bandwidth import raw_send_recv_s

        nbytes = int(recs[0]["bytes_received"])
        ours_s = sorted(rec["transfer_s"] for rec in recs)[len(recs) // 2]
        raw_s = raw_send_recv_s(nbytes)
        ratios["transfer_efficiency"] = round(raw_s / ours_s, 3)
        ratios["transfer"] = {"bytes": nbytes, "ours_s": ours_s, "raw_gloo_s": round(raw_s, 5),
                              "ours_gb_per_s": round(nbytes / ours_s / 1e9, 3),
                              "raw_gb_per_s": round(nbytes / raw_s / 1e9, 3)}
    if "ours" in names and "ours" in raw:
        downtime = {args.ranks: ours.get("downtime_s")}
        for n in scaling:
            if n == args.ranks:
                continue
            short = JobSpec(steps=kill + 15)
            record = launch("ours", out / "runs" / f"ours-{n}ranks", short, n, kill, args.timeout)
            raw.setdefault("ours_scaling", []).append(record)
            downtime[n] = record.get("downtime_s") if not record["problems"] else None
            print(f"{PROG}: ours at {n} ranks: downtime {downtime[n]} ({'; '.join(record['problems']) or 'ok'})",
                  file=sys.stderr, flush=True)
        ratios["downtime_by_ranks"] = {str(k): v for k, v in sorted(downtime.items())}
        lo, hi = min(downtime), max(downtime)
        ratios[f"rto_scaling_{hi}_over_{lo}"] = report.ratio(downtime[hi], downtime[lo])
        if (hi, lo) != (8, 2):
            ratios.setdefault("rto_scaling_8_over_2", None)
    return ratios


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        results = run(args)
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(report.table(results), end="")
    print(f"{PROG}: wrote {args.out}/bench.json, bench.md and timeline.png in {results['elapsed_s']} s")


if __name__ == "__main__":
    main()
