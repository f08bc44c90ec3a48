#!/usr/bin/env python3
"""A user's own Lightning script: checkpointless-run vs. torchrun + Lightning DDP + ModelCheckpoint.

One invocation runs the same job (scripts/bench_user_job.py: the model and data of tests/scripts/user_lightning.py,
heavier; 4 CPU ranks) under both systems, so that every figure is a ratio within one run on one (noisy) machine:

  ours     `checkpointless-run --nproc-per-node 4 --spares 1`, CheckpointlessStrategy + CheckpointlessCallback
  ddp      `torchrun --max-restarts 3 --rdzv-backend c10d`, strategy="ddp" (gloo) + ModelCheckpoint every K steps;
           after a failure torchrun restarts every rank and the script resumes from ckpt/last.ckpt
  plain    (fault-free only) the ddp job without ModelCheckpoint: the strategy's fault-free cost against plain DDP

Per system: one fault-free run (--ff-runs) and --runs faulted runs, in which rank 1 is SIGKILLed from outside once
every rank's progress file shows step >= --kill-step. Each launcher is timed from start to exit
(time.perf_counter around the subprocess); each run must exit 0 and reach --max-steps.

  lost_s           faulted wall - fault-free wall (median, min, max over the runs)
  steps_lost       ddp: the step it was killed at - the checkpoint step Lightning resumed from;
                   ours: summary.json's recoveries[].steps_lost
  recover_s        ours: summary.json (fault -> first step completed after recovery);
                   ddp: fault -> Lightning's on_train_start in the restarted job (restart_to_train_s)
  overhead_pct     (ours fault-free train time / ddp's - 1) x 100, train time = t(last step) - t(step --t-from)
                   on rank 0 (process start-up excluded); also against plain DDP
  equal_to_fault_free   ours: summary.json state_sha256 (and rank 0's parameters); ddp: rank 0's parameters

    python scripts/bench_user_script.py --runs 2 --out docs/bench_user_script_<date>.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nemo_checkpointless.launcher.procs import rank_pids

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "scripts" / "bench_user_job.py"
WORLD = 4
KILL_RANK = 1
_DROP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "NCL_RUN_DIR", "NCL_SPARE_ID", "PYTEST_CURRENT_TEST")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def progress(run_dir: Path) -> list[int]:
    steps = []
    for r in range(WORLD):
        try:
            steps.append(int((run_dir / f"progress_rank{r}.txt").read_text() or 0))
        except (OSError, ValueError):
            steps.append(0)
    return steps


class Killer(threading.Thread):
    """SIGKILL rank KILL_RANK once every rank's progress file shows step >= at_step."""

    def __init__(self, run_dir: Path, at_step: int, t0: float, deadline_s: float) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.at_step, self.t0, self.deadline_s = run_dir, at_step, t0, deadline_s
        self.info: dict[str, Any] | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + self.deadline_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            if min(progress(self.run_dir)) >= self.at_step:
                pid = rank_pids(self.run_dir, run_dir_var="RUN_DIR").get(KILL_RANK)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    t_kill, wall_t = time.perf_counter(), time.time()
                    steps = progress(self.run_dir)
                    self.info = {"pid": pid, "at_s": round(t_kill - self.t0, 3), "time": wall_t,
                                 "progress": steps, "killed_at_step": max(steps)}
                    return
            time.sleep(0.005)


def step_times(run_dir: Path, max_steps: int) -> dict[str, Any]:
    """From rank 0's per-step log: the median step time of the run (consecutive steps of one process) and
    `excess_s`, the time from its first logged step to the last beyond (steps x median step time): restarts,
    redone steps, checkpoint saves, a slower phase after a recovery. Each run against its own step rate, so a
    machine that is busier during one run than another moves it less than it moves a difference of wall times."""
    path = run_dir / "steps_rank0.txt"
    if not path.exists():
        return {}
    rows = [(int(s), float(t), int(p)) for s, t, p in (line.split() for line in path.read_text().splitlines())]
    if len(rows) < 3:
        return {}
    dts = [b[1] - a[1] for a, b in itertools.pairwise(rows) if b[2] == a[2] and b[0] == a[0] + 1]
    median_dt = statistics.median(dts)
    span = rows[-1][1] - rows[0][1]
    steps = max_steps - rows[0][0]
    return {"median_step_ms": round(median_dt * 1000, 2), "step_span_s": round(span, 3),
            "excess_s": round(span - steps * median_dt, 3)}


def launch(system: str, run_dir: Path, a: argparse.Namespace, kill: bool) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh directory: no checkpoint of an earlier run
    run_dir.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RUN_DIR=str(run_dir), GLOO_SOCKET_IFNAME="lo")
    job = [str(JOB), "--max-steps", str(a.max_steps), "--hidden", str(a.hidden), "--t-from", str(a.t_from),
           "--run-dir", str(run_dir)]
    if system == "ours":
        cmd = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", str(WORLD), "--spares", "1",
               "--run-dir", str(run_dir), "--master-addr", "127.0.0.1", *job, "--mode", "checkpointless"]
    else:
        # torch 2.13: torchrun's restart of a gloo job hangs when workers share the rendezvous TCP store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--max-restarts", "3",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1",
               *job, "--mode", "ddp", "--ckpt-every", str(a.ckpt_every if system == "ddp" else 0)]
    load_before = round(os.getloadavg()[0], 2)  # the machine is shared: how busy it was, for the reader
    log = open(run_dir / "launcher.log", "wb")  # noqa: SIM115 (closed below, after the process)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    killer = Killer(run_dir, a.kill_step, t0, a.timeout) if kill else None
    if killer is not None:
        killer.start()
    hung = False
    try:
        rc = proc.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    log.close()
    if killer is not None:
        killer.stop.set()
        killer.join(timeout=1)
    out: dict[str, Any] = {"system": system, "faulted": kill, "wall_s": round(wall, 3), "rc": rc, "hung": hung,
                           "load_avg_1min": [load_before, round(os.getloadavg()[0], 2)], "run_dir": str(run_dir)}
    problems = []
    if hung:
        problems.append(f"no exit within {a.timeout} s (killed)")
    elif rc != 0:
        problems.append(f"exit code {rc}")
    done_path = run_dir / "done.json"
    done = json.loads(done_path.read_text()) if done_path.exists() else {}
    out["final_step"] = done.get("global_step")
    if done.get("global_step") != a.max_steps:
        problems.append(f"final step {done.get('global_step')} != {a.max_steps}")
    if done.get("t_from") is not None and done.get("t_last") is not None:
        out["train_s"] = round(done["t_last"] - done["t_from"], 3)  # steps t_from..max_steps of rank 0's process
    out["params_sha256"] = done.get("params_sha256")
    starts_path = run_dir / "starts_rank0.jsonl"
    starts = [json.loads(line) for line in starts_path.read_text().splitlines()] if starts_path.exists() else []
    if killer is not None:
        if killer.info is None:
            problems.append("rank 1 was not killed")
        else:
            out["kill"] = killer.info
    if system == "ours":
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        out["summary"] = {k: summary.get(k) for k in ("wall_s", "train_s", "final_step", "state_sha256")}
        out["recoveries"] = [{k: r.get(k) for k in ("failed_ranks", "path", "step", "resumed_from_step", "detect_s",
                                                       "state_restored_s", "recover_s", "back_at_fault_step_s",
                                                       "steps_lost", "lost_s", "bytes_received")}
                             for r in summary.get("recoveries", [])]
        if kill:
            out["steps_lost"] = sum(r["steps_lost"] or 0 for r in out["recoveries"]) if out["recoveries"] else None
            out["recover_s"] = out["recoveries"][0]["recover_s"] if out["recoveries"] else None
            if len(out["recoveries"]) != 1:
                problems.append(f"{len(out['recoveries'])} recoveries, expected 1")
    else:
        out["starts"] = [s["step"] for s in starts]
        if kill and killer is not None and killer.info is not None:
            out["torchrun_restarts"] = len(starts) - 1  # more than 1: a failure other than our kill
            if len(starts) < 2:
                problems.append(f"training started {len(starts)} time(s): no restart seen")
            else:
                resumed = starts[1]["step"]  # the restart that followed the kill
                out["resumed_from_step"] = resumed
                out["steps_lost"] = killer.info["killed_at_step"] - resumed
                out["restart_to_train_s"] = round(starts[1]["t"] - killer.info["time"], 3)
    out.update(step_times(run_dir, a.max_steps))
    out["problems"] = problems
    status = "ok" if not problems else "; ".join(problems)
    extra = f" killed at step {out['kill']['killed_at_step']}" if "kill" in out else ""
    print(f"bench: {system:5s} {'faulted' if kill else 'clean  '} wall {wall:6.2f} s{extra}: {status}",
          file=sys.stderr, flush=True)
    if problems:
        tail = (run_dir / "launcher.log").read_text(errors="replace")[-3000:]
        print(f"bench: {run_dir / 'launcher.log'} (tail):\n{tail}", file=sys.stderr, flush=True)
    return out


def stats(values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 3), "min": round(min(vals), 3), "max": round(max(vals), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="faulted runs per system")
    parser.add_argument("--ff-runs", type=int, default=1, help="fault-free runs per system")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--kill-step", type=int, default=None, help="default: max_steps // 3")
    parser.add_argument("--ckpt-every", type=int, default=40, help="ddp: ModelCheckpoint every_n_train_steps")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--t-from", type=int, default=10, help="train time: from this step to the last")
    parser.add_argument("--no-plain", action="store_true", help="skip the fault-free plain DDP run")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one launcher may run")
    parser.add_argument("--dir", default="runs/bench_user_script")
    parser.add_argument("--out", default=None, help="default: docs/bench_user_script_<date>.json")
    a = parser.parse_args()
    a.kill_step = a.kill_step if a.kill_step is not None else a.max_steps // 3
    base = Path(a.dir).absolute()
    out_path = Path(a.out or ROOT / "docs" / f"bench_user_script_{time.strftime('%Y-%m-%d')}.json")
    t_bench = time.perf_counter()

    # Interleaved (ddp, ours, ddp, ours, ...) so that a slow phase of the machine hits both systems alike.
    runs: dict[str, list[dict[str, Any]]] = {"ddp": [], "ours": [], "plain": []}
    for i in range(a.ff_runs):
        for system in ("ddp", "ours"):
            runs[system].append(launch(system, base / f"{system}-clean-{i}", a, kill=False))
    if not a.no_plain:
        runs["plain"].append(launch("plain", base / "plain-clean-0", a, kill=False))
    for i in range(a.runs):
        for system in ("ddp", "ours"):
            runs[system].append(launch(system, base / f"{system}-fault-{i}", a, kill=True))

    report: dict[str, Any] = {
        "bench": "user Lightning script: checkpointless-run vs torchrun + Lightning DDP + ModelCheckpoint",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "job": {"script": "scripts/bench_user_job.py", "world": WORLD, "max_steps": a.max_steps,
                "hidden": a.hidden, "kill": f"SIGKILL rank {KILL_RANK} once every rank is at step >= {a.kill_step}",
                "ddp_ckpt_every": a.ckpt_every, "ours_spares": 1, "t_from_step": a.t_from},
        "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                 "load_avg_1min_per_run": {f"{r['system']}:{Path(r['run_dir']).name}": r["load_avg_1min"]
                                           for rs in runs.values() for r in rs}},
    }
    ok = True
    per: dict[str, Any] = {}
    for system in ("ddp", "ours"):
        clean = [r for r in runs[system] if not r["faulted"]]
        faulted = [r for r in runs[system] if r["faulted"]]
        ok = ok and all(not r["problems"] for r in runs[system])
        ff_wall = statistics.median(r["wall_s"] for r in clean)
        ff_train = [r.get("train_s") for r in clean]
        ref_params = clean[0]["params_sha256"]
        excess = [r["excess_s"] for r in clean if r.get("excess_s") is not None]
        ff_excess = statistics.median(excess) if excess else None
        entry: dict[str, Any] = {
            "fault_free_wall_s": [r["wall_s"] for r in clean],
            "fault_free_train_s": ff_train,
            "faulted_wall_s": [r["wall_s"] for r in faulted],
            "lost_s": stats([r["wall_s"] - ff_wall for r in faulted]),
            "lost_s_per_run": [round(r["wall_s"] - ff_wall, 3) for r in faulted],
            "lost_s_step_times": stats([r["excess_s"] - ff_excess for r in faulted
                                        if r.get("excess_s") is not None and ff_excess is not None]),
            "median_step_ms": {"fault_free": [r.get("median_step_ms") for r in clean],
                               "faulted": [r.get("median_step_ms") for r in faulted]},
            "killed_at_step": [r.get("kill", {}).get("killed_at_step") for r in faulted],
            "steps_lost": [r.get("steps_lost") for r in faulted],
            "equal_to_fault_free": [r["params_sha256"] is not None and r["params_sha256"] == ref_params
                                    for r in faulted],
        }
        if system == "ddp":
            entry["resumed_from_step"] = [r.get("resumed_from_step") for r in faulted]
            entry["restart_to_train_s"] = [r.get("restart_to_train_s") for r in faulted]
            entry["torchrun_restarts"] = [r.get("torchrun_restarts") for r in faulted]
            entry["equal_by"] = "rank 0's parameters (sha256) vs the fault-free run's"
        else:
            ref_state = clean[0]["summary"]["state_sha256"]
            entry["recover_s"] = [r.get("recover_s") for r in faulted]
            entry["recovery_path"] = [[x["path"] for x in r["recoveries"]] for r in faulted]
            entry["summary_lost_s"] = [[x["lost_s"] for x in r["recoveries"]] for r in faulted]
            entry["summary_train_s"] = {"fault_free": [r["summary"]["train_s"] for r in clean],
                                        "faulted": [r["summary"]["train_s"] for r in faulted]}
            entry["equal_to_fault_free"] = [
                eq and r["summary"]["state_sha256"] is not None and r["summary"]["state_sha256"] == ref_state
                for eq, r in zip(entry["equal_to_fault_free"], faulted, strict=True)]
            entry["equal_by"] = "summary.json state_sha256 and rank 0's parameters vs the fault-free run's"
        per[system] = entry
    report["ddp"], report["ours"] = per["ddp"], per["ours"]
    lost_ddp, lost_ours = per["ddp"]["lost_s"]["median"], per["ours"]["lost_s"]["median"]
    report["ratio_lost_ddp_over_ours"] = (round(lost_ddp / lost_ours, 2) if lost_ddp is not None and lost_ours
                                          and lost_ours > 0 else None)
    st_ddp, st_ours = per["ddp"]["lost_s_step_times"]["median"], per["ours"]["lost_s_step_times"]["median"]
    report["ratio_lost_ddp_over_ours_step_times"] = (round(st_ddp / st_ours, 2) if st_ddp is not None and st_ours
                                                     and st_ours > 0 else None)

    def median_train(system: str) -> float | None:
        vals = [r.get("train_s") for r in runs[system] if not r["faulted"] and r.get("train_s")]
        return statistics.median(vals) if vals else None

    def median_step(system: str) -> float | None:
        vals = [r.get("median_step_ms") for r in runs[system] if not r["faulted"] and r.get("median_step_ms")]
        return statistics.median(vals) if vals else None

    ours_t, ddp_t, plain_t = median_train("ours"), median_train("ddp"), median_train("plain")
    ours_m, ddp_m, plain_m = median_step("ours"), median_step("ddp"), median_step("plain")
    report["fault_free"] = {
        "train_s": {"ours": ours_t, "ddp_with_modelcheckpoint": ddp_t, "plain_ddp": plain_t},
        "overhead_pct": round((ours_t / ddp_t - 1) * 100, 1) if ours_t and ddp_t else None,
        "overhead_pct_vs_plain_ddp": round((ours_t / plain_t - 1) * 100, 1) if ours_t and plain_t else None,
        "median_step_ms": {"ours": ours_m, "ddp_with_modelcheckpoint": ddp_m, "plain_ddp": plain_m},
        "overhead_pct_median_step": round((ours_m / ddp_m - 1) * 100, 1) if ours_m and ddp_m else None,
        "overhead_pct_median_step_vs_plain_ddp": round((ours_m / plain_m - 1) * 100, 1) if ours_m and plain_m
        else None,
        "wall_s": {"ours": per["ours"]["fault_free_wall_s"], "ddp": per["ddp"]["fault_free_wall_s"],
                   "plain_ddp": [r["wall_s"] for r in runs["plain"]]},
        "train_s_is": f"rank 0: time of the last step - time of step {a.t_from} (process start-up excluded)",
    }
    ok = ok and all(not r["problems"] for r in runs["plain"])
    report["problems"] = {f"{r['system']}:{Path(r['run_dir']).name}": r["problems"]
                          for rs in runs.values() for r in rs if r["problems"]}
    report["ok"] = ok
    report["bench_wall_s"] = round(time.perf_counter() - t_bench, 1)
    report["runs"] = runs
    text = json.dumps(report, indent=1)
    print(text)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(text + "\n")
    print(f"bench: written {out_path}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
