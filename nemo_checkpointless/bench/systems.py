"""How each system runs the benchmark job, and what one run of it measured.

Every system trains `bench.job` on the same number of data-parallel ranks, each by its own launcher and in its
own documented way (see each worker's docstring); the bench injects the same fault from outside: SIGKILL of the
process that is rank 1 (torchft: replica group 1) once its step log shows step `kill_step`. A run is timed from
the launcher's start to its exit, and its step logs give the rest (`measure`).
"""

from __future__ import annotations

import importlib.util
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_checkpointless.bench.job import JobSpec

KILL_RANK = 1
# Variables of an outer launcher that must not leak into the one a run starts.
_DROP_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "NCL_RUN_DIR", "NCL_SPARE_ID", "PYTEST_CURRENT_TEST", "REPLICA_GROUP_ID")


@dataclass(frozen=True)
class System:
    name: str
    title: str
    needs: str | None = None  # the module a peer needs (None: always here)
    faults: bool = True  # False: fault-free runs only (a baseline for the fault-free cost)


SYSTEMS = (
    System("job_restart", "torchrun + Lightning DDP + ModelCheckpoint, restarted whole from the checkpoint"),
    System("nvrx", "NVIDIA in-process Wrapper (nvidia-resiliency-ext), torch.save checkpoint, a reserve rank",
           needs="nvidia_resiliency_ext"),
    System("torchft", "torchft: one replica group per rank, the lost group restarted and healed from a live one",
           needs="torchft"),
    System("ours", "checkpointless-run: N=2 replicas, a warm spare, p2p recovery"),
    System("ours_checkpoint", "checkpointless-run: N=1 (no replica), a warm spare, the checkpoint fallback"),
    System("plain_ddp", "torchrun + Lightning DDP, no checkpoint (fault-free cost only)", faults=False),
)
BY_NAME = {s.name: s for s in SYSTEMS}


def missing(system: System) -> str | None:
    """Why `system` cannot run here (its peer package is not installed), or None."""
    if system.needs is not None and importlib.util.find_spec(system.needs) is None:
        return "not installed (pip install '.[bench]')"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_steps(run_dir: Path, rank: int) -> list[tuple[int, float, int]]:
    """(step, time, pid) for every step the processes of rank `rank` completed, in the order they did."""
    path = run_dir / f"steps_rank{rank}.txt"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), float(parts[1]), int(parts[2])))
    return out


def read_events(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    path = run_dir / f"events_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Killer(threading.Thread):
    """SIGKILL the process that is rank KILL_RANK once its step log reaches `at_step`."""

    def __init__(self, run_dir: Path, at_step: int) -> None:
        super().__init__(daemon=True, name="bench-killer")
        self.run_dir, self.at_step = run_dir, at_step
        self.info: dict[str, Any] | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            rows = read_steps(self.run_dir, KILL_RANK)
            if rows and rows[-1][0] >= self.at_step:
                step, _, pid = rows[-1]
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    time.sleep(0.005)
                    continue
                self.info = {"pid": pid, "t": time.time(), "step": step}
                return
            time.sleep(0.005)


def _env(run_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR")
    return env


def load_per_core() -> float:
    """The machine's 1-minute load average per core, at least 1: what the NVRx job's fixed timeouts are scaled by."""
    return round(max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)), 2)


def _commands(name: str, run_dir: Path, spec: JobSpec, ranks: int,
              timeout_scale: float = 1.0) -> tuple[list[list[str]], list[dict[str, str]]]:
    """The processes a run of `name` starts (launchers; nvrx: its ranks), with their environments."""
    py, env = sys.executable, _env(run_dir)
    job = ["--run-dir", str(run_dir), *spec.as_args()]
    if name in ("ours", "ours_checkpoint"):
        ours = ["--num-instances", "2"] if name == "ours" else ["--num-instances", "1", "--checkpoint-every",
                                                                 str(spec.ckpt_every)]
        return [[py, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", str(ranks), "--spares", "1",
                 "--run-dir", str(run_dir), "--master-addr", "127.0.0.1", *ours,
                 "-m", "nemo_checkpointless.bench.lightning_job", "--mode", "ours", *job]], [env]
    if name in ("job_restart", "plain_ddp"):
        # torch 2.13: torchrun's restart of a gloo job hangs when workers share the rendezvous TCP store.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return [[py, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                 "--max-restarts", "3" if name == "job_restart" else "0", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1",
                 "-m", "nemo_checkpointless.bench.lightning_job",
                 "--mode", "ddp" if name == "job_restart" else "plain", *job]], [env]
    if name == "nvrx":
        port, world = free_port(), ranks + 1  # one reserve rank
        envs = [{**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                 "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
                for r in range(world)]
        cmd = [py, "-m", "nemo_checkpointless.bench.nvrx_job", "--ranks", str(ranks),
               "--timeout-scale", str(timeout_scale), *job]
        return [cmd] * world, envs
    if name == "torchft":
        lighthouse = free_port()
        cmds = [[shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(py), "torchft_lighthouse"),
                 "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
                 "--bind", f"127.0.0.1:{lighthouse}"]]
        envs = [env]
        for g in range(ranks):
            cmds.append([py, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "3",
                         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                         "-m", "nemo_checkpointless.bench.torchft_job", *job])
            envs.append({**env, "REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": str(ranks),
                         "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse}"})
        return cmds, envs
    raise ValueError(name)


def launch(name: str, run_dir: Path, spec: JobSpec, ranks: int, kill_step: int | None,
           timeout_s: float) -> dict[str, Any]:
    """One run of `name`; `kill_step`: SIGKILL rank 1 there (None: fault-free). Returns `measure`'s record."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh directory: no checkpoint of an earlier run
    run_dir.mkdir(parents=True)
    scale = load_per_core() if name == "nvrx" else 1.0
    cmds, envs = _commands(name, run_dir, spec, ranks, scale)
    logs = [open(run_dir / f"launcher{i}.log", "wb") for i in range(len(cmds))]  # noqa: SIM115 (closed below)
    t_start = time.time()
    procs = [subprocess.Popen(c, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for c, e, log in zip(cmds, envs, logs, strict=True)]
    waited = procs[1:] if name == "torchft" else procs  # torchft: the lighthouse runs until the groups are done
    killer = Killer(run_dir, kill_step) if kill_step is not None else None
    if killer is not None:
        killer.start()
    deadline, hung = time.monotonic() + timeout_s, False
    for p in waited:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
    t_end = time.time()
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    for log in logs:
        log.close()
    if killer is not None:
        killer.stop.set()
        killer.join(timeout=1)
    record = measure(name, run_dir, spec, ranks, t_start, t_end, killer.info if killer is not None else None)
    record["faulted"] = kill_step is not None
    if name == "nvrx":
        record["timeout_scale"] = scale  # NVRx's timeouts, x the machine's load per core (nvrx_job)
    killed = killer.info["pid"] if killer is not None and killer.info else None
    codes = [p.returncode for p in waited if p.pid != killed]  # nvrx: the killed rank is a process started here
    if hung:
        record["problems"].append(f"no exit within {timeout_s:.0f} s (killed)")
    elif any(codes):
        record["problems"].append(f"exit codes {codes}")
    if kill_step is not None and record.get("fault") is None:
        record["problems"].append(f"rank {KILL_RANK} was not killed (its step log never reached {kill_step})")
    return record


def _first_at_or_after(rows: list[tuple[int, float, int]], t: float, step: int) -> float | None:
    return next((rt for s, rt, _ in rows if rt > t and s >= step), None)


def measure(name: str, run_dir: Path, spec: JobSpec, ranks: int, t_start: float, t_end: float,
            fault: dict[str, Any] | None) -> dict[str, Any]:
    """What a run shows: wall time, rank 0's step times, the final parameters; and for a faulted run: when every
    rank completed the fault step again (downtime), the steps redone, the steps a rank skipped, and the moments of
    the recovery the logs show (processes started again, training loop entered again, first step after)."""
    rows = {r: read_steps(run_dir, r) for r in range(ranks)}
    done_path = run_dir / "done_rank0.json"
    done = json.loads(done_path.read_text()) if done_path.exists() else {}
    record: dict[str, Any] = {"system": name, "ranks": ranks, "wall_s": round(t_end - t_start, 3),
                              "final_step": done.get("step"), "params_sha256": done.get("params_sha256"),
                              "problems": [], "run_dir": str(run_dir), "t_start": t_start}
    if done.get("step") != spec.steps:
        record["problems"].append(f"final step {done.get('step')} != {spec.steps}")
    if "state_bytes" in done:
        record["state_bytes"] = done["state_bytes"]
    zero = rows[0]
    record["steps"] = [[s, round(t - t_start, 4)] for s, t, _ in zero]  # rank 0: step, seconds since the start
    # The training span: rank 0's first step to the last step any rank completed. Without the interpreters' start
    # and exit (seconds of noise on a shared machine, the same in a faulted run as in a fault-free one), with
    # everything a fault costs in between: restarts, steps redone, a slower phase, a group still training late.
    last = max((r[-1][1] for r in rows.values() if r), default=None)
    if zero and last is not None:
        record["span_s"] = round(last - zero[0][1], 3)
    steady = [b[1] - a[1] for a, b in itertools.pairwise(zero) if b[2] == a[2] and b[0] == a[0] + 1
              and (fault is None or not a[1] < fault["t"] < b[1] + 5)]
    if steady:
        record["median_step_s"] = round(statistics.median(steady), 5)
    warm = [(s, t) for s, t, _ in zero if s >= spec.warmup_steps]
    if fault is None and len(warm) > 1:
        record["steps_per_s"] = round((warm[-1][0] - warm[0][0]) / (warm[-1][1] - warm[0][1]), 3)
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        record["state_sha256"] = summary.get("state_sha256")
        record["recoveries"] = [{k: r.get(k) for k in ("path", "detect_s", "state_restored_s", "transfer_s",
                                                       "recover_s", "back_at_fault_step_s", "steps_lost",
                                                       "bytes_received", "replacement")}
                                for r in summary.get("recoveries", [])]
    if fault is None:
        return record
    t_fault = fault["t"]
    step = fault["step"] + 1  # the step in flight on the killed rank
    record["fault"] = {"step": step, "t": round(t_fault - t_start, 4)}
    back = [t for t in (_first_at_or_after(rows[r], t_fault, step) for r in range(ranks)) if t is not None]
    record["downtime_s"] = round(max(back) - t_fault, 3) if len(back) == ranks else None
    # Steps redone: rank 0's first step after the fault that it had completed before (its log is in order), against
    # the furthest it had come (a step it logged just after the kill counts as done before it).
    record["steps_lost"] = 0
    furthest = 0
    for s, t, _ in zero:
        if t > t_fault and s <= furthest:
            record["steps_lost"] = furthest - (s - 1)
            break
        furthest = max(furthest, s)
    # Steps the killed rank never trained (its replica group was down while the others went on: torchft).
    seen = {s for s, _, _ in rows[KILL_RANK]}
    record["steps_skipped_by_rank1"] = sum(1 for s in range(step, spec.steps + 1) if s not in seen)
    # The moments the logs show in this recovery (until a second after the fault step was done everywhere: a
    # restart later in the run is another event): a process (re)started, a training loop (re)entered, the first
    # step after.
    until = t_fault + (record["downtime_s"] if record["downtime_s"] is not None else float("inf")) + 1.0
    events = [e for r in range(ranks) for e in read_events(run_dir, r) if t_fault < e["t"] <= until]
    marks: dict[str, float] = {}
    starts = [e["t"] for e in events if e["event"] == "start"]
    trains = [e["t"] for e in events if e["event"] == "train"]
    if starts:
        marks["processes_started"] = max(starts) - t_fault
    if trains:
        marks["training_resumed"] = max(trains) - t_fault
    first = [s_t for s_t in (_first_at_or_after(rows[r], t_fault, 0) for r in range(ranks)) if s_t is not None]
    if len(first) == ranks:
        marks["first_step_after"] = max(first) - t_fault
    for rec in record.get("recoveries", [])[:1]:  # ours: the recovery's own stamps, from the launcher
        for key, mark in (("detect_s", "detected"), ("state_restored_s", "state_restored")):
            if rec.get(key) is not None:
                marks[mark] = rec[key]
    record["marks"] = {k: round(v, 3) for k, v in marks.items()}
    return record
