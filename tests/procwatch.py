"""What a job's processes hold, read from /proc while the job runs (not from the job's own counters): threads,
open file descriptors, CPU ticks and resident memory of every descendant of the launcher, sampled on a thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SAMPLE_S = 0.05


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            for k in kids:
                if k not in out:
                    out.add(k)
                    todo.append(k)
    return out


def sample(pid: int) -> dict[str, float] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        threads = len(os.listdir(f"/proc/{pid}/task"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024
    return {"t": time.time(), "threads": threads, "fds": fds, "cpu": int(fields[11]) + int(fields[12]),
            "rss_kb": int(fields[21]) * page_kb}


class Sampler(threading.Thread):
    """Samples every descendant of `root` every SAMPLE_S seconds, into `samples[pid]`."""

    def __init__(self, root: int) -> None:
        super().__init__(name="proc-sampler", daemon=True)
        self.root = root
        self.samples: dict[int, list[dict[str, float]]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for pid in descendants(self.root):
                s = sample(pid)
                if s is not None:
                    self.samples.setdefault(pid, []).append(s)
            self.stop.wait(SAMPLE_S)


def at(samples: list[dict[str, float]], t: float) -> dict[str, float]:
    return min(samples, key=lambda s: abs(s["t"] - t))


def window(samples: list[dict[str, float]], times: dict[int, float], end_step: int, span: tuple[int, int]
           ) -> dict[str, float]:
    """The process's state at the end of the window of steps `end_step - span[0]` to `end_step - span[1]`
    (`times`: step -> when it completed), and its CPU ticks per step over the window. Threads and descriptors are
    the fewest any sample in the window saw: a leak stays, while a descriptor open for a moment (a batch file the
    prefetch thread is writing, a store connection) is not one."""
    lo, hi = end_step - span[0], end_step - span[1]
    a, b = at(samples, times[lo]), at(samples, times[hi])
    steps = sum(1 for t in times.values() if a["t"] < t <= b["t"])
    assert steps >= 10 and b["t"] - a["t"] > 0.3, (lo, hi, a, b, steps)
    inside = [s for s in samples if a["t"] <= s["t"] <= b["t"]]
    least = {k: min(s[k] for s in inside) for k in ("threads", "fds")}
    return {**b, **least, "cpu_per_step": (b["cpu"] - a["cpu"]) / steps}


def train(run_dir: Path, overrides: list[str], *, sample: bool, env: dict[str, str] | None = None,
          cwd: Path | None = None, timeout_s: float = 400) -> tuple[dict[str, Any], dict[int, list[dict[str, float]]]]:
    """Run `checkpointless-train run.dir=<run_dir> <overrides>`, sampling its processes when `sample`; returns
    its summary.json and the samples per pid."""
    cmd = [sys.executable, "-m", "nemo_checkpointless.cli.train", f"run.dir={run_dir}", *overrides]
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = Sampler(proc.pid)
    if sample:
        sampler.start()
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        sampler.stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    return json.loads((run_dir / "summary.json").read_text()), sampler.samples
