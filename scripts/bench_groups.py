#!/usr/bin/env python3
"""Group benchmark: re-forming the job's groups for a new generation vs. a fresh `init_process_group`, in one run.

The parent hosts the job's store (`launcher.local.host_store`, a TCPStore on 127.0.0.1) and starts max(--ranks)
worker processes, each a client of it (gloo over loopback, OMP_NUM_THREADS=1). The workers stay up for the whole
run; at world size W only ranks 0..W-1 take part. Per trial the parent sets `go/<trial>` after noting its wall
time; each rank waits for it, runs the operation and writes its wall time at completion; the trial's time is
max over ranks (done) - go. Modes, interleaved per trial (rotating order) so a slow moment hits each alike:

  fresh          dist.init_process_group("gloo", store=PrefixStore(<trial>, the rank's store client), rank, W)
                 + one 1-element all_reduce (what a restarted job does, minus the process start and the store
                 connect); dist.destroy_process_group() afterwards, not timed. Re-initialised in the same process
                 every trial.
  fresh_connect  the same, but first a new store client (`groups.connect_store`), as a restarted process would.
  reform         Membership.advance(generation + 1) (hands the previous generation's world group to the reaper
                 thread) + Membership.world() (a `ProcessGroupGloo` over a PrefixStore named by the generation)
                 + one all_reduce through `Group.all_reduce`; `wait_released` afterwards, not timed.

One warm-up trial per mode and W is not counted. Reported per W: median, min and max seconds over --trials, and
fresh / reform (ratio of the medians). Figures go to stdout and, with --out, to a JSON file.

    OMP_NUM_THREADS=1 python scripts/bench_groups.py --ranks 2,4,8,16 --trials 7 --out runs/bench/groups.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nemo_checkpointless.launcher.local import host_store
from nemo_checkpointless.restart.groups import Membership, connect_store, wait_released

HOST = "127.0.0.1"
MODES = ("fresh", "fresh_connect", "reform")
TIMEOUT_S = 120.0  # a collective or group formation; generous, 16 ranks share 2 cores
WAIT = datetime.timedelta(seconds=600)  # an idle rank waits for the larger world sizes


def schedule(ranks: list[int], trials: int) -> list[tuple[int, int, str]]:
    """(W, trial, mode) in the order run; trial 0 is the warm-up."""
    steps = []
    for w in ranks:
        for t in range(trials + 1):
            for i in range(len(MODES)):
                steps.append((w, t, MODES[(i + t) % len(MODES)]))
    return steps


def tag(w: int, t: int, mode: str) -> str:
    return f"W{w}/t{t}/{mode}"


def check_sum(x: torch.Tensor, w: int) -> None:
    if x.item() != w:
        raise RuntimeError(f"all_reduce gave {x.item()}, expected {w}")


def fresh(store: dist.Store, rank: int, w: int, name: str) -> float:
    """init_process_group + one all_reduce; returns the wall time at which the group was formed."""
    dist.init_process_group("gloo", store=dist.PrefixStore(f"ipg/{name}", store), rank=rank, world_size=w,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    formed = time.time()
    x = torch.ones(1)
    dist.all_reduce(x)
    check_sum(x, w)
    return formed


def worker(rank: int, port: int, ranks: list[int], trials: int) -> None:
    """One rank: run every step of the schedule it takes part in."""
    client = connect_store(HOST, port, TIMEOUT_S)
    client.set(f"up/{rank}", "1")
    memberships: dict[int, Membership] = {}
    for w, t, mode in schedule(ranks, trials):
        if rank >= w:
            continue
        name = tag(w, t, mode)
        client.wait([f"go/{name}"], WAIT)
        if mode != "reform":
            own = client if mode == "fresh" else connect_store(HOST, port, TIMEOUT_S)
            formed = fresh(own, rank, w, name)
            del own
        else:
            m = memberships.setdefault(w, Membership(client, rank, w, HOST, TIMEOUT_S))
            m.advance(m.generation + 1)
            world = m.world()
            formed = time.time()
            x = torch.ones(1)
            world.all_reduce(x)
            check_sum(x, w)
            del world
        client.set(f"done/{name}/{rank}", json.dumps([formed, time.time()]))
        # Not timed: leave nothing behind that could slow the next trial.
        if mode == "reform":
            if not wait_released(TIMEOUT_S):
                raise RuntimeError("released groups not destroyed in time")
        else:
            dist.destroy_process_group()  # with it goes fresh_connect's own store client
        client.set(f"ready/{name}/{rank}", "1")
    for m in memberships.values():
        m.advance(m.generation + 1)
    wait_released(TIMEOUT_S)


def wait_keys(store: dist.Store, keys: list[str], procs: list[subprocess.Popen[bytes]], poll_s: float = 0.0
              ) -> None:
    """Wait for `keys`, failing as soon as a worker has exited. poll_s > 0: poll (for a wait that may take long;
    a blocking wait that times out logs a warning each time), else block in the store (wakes at once)."""
    deadline = time.monotonic() + TIMEOUT_S * 2
    while True:
        try:
            if poll_s <= 0:
                store.wait(keys, datetime.timedelta(seconds=1))
                return
            if store.check(keys):
                return
            time.sleep(poll_s)
        except (RuntimeError, dist.DistStoreError):  # the blocking wait timed out: look at the workers
            pass
        dead = [(i, p.returncode) for i, p in enumerate(procs) if p.poll() is not None]
        if dead:
            sys.exit(f"bench: worker(s) exited early (rank, rc): {dead}")
        if time.monotonic() > deadline:
            sys.exit(f"bench: timed out waiting for {keys[:3]}...")


def summarize(samples: list[float]) -> dict[str, Any]:
    return {"median_s": round(statistics.median(samples), 4), "min_s": round(min(samples), 4),
            "max_s": round(max(samples), 4), "samples_s": [round(s, 4) for s in samples]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4,8,16", help="world sizes, comma-separated")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # worker mode
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    ranks = sorted({int(x) for x in args.ranks.split(",")})
    if args.rank is not None:
        worker(args.rank, args.port, ranks, args.trials)
        return

    t_start = time.perf_counter()
    store, port = host_store(HOST, TIMEOUT_S)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")  # fresh: gloo's default device on lo
    cmd = [sys.executable, os.path.abspath(__file__), "--ranks", args.ranks, "--trials", str(args.trials),
           "--port", str(port)]
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(max(ranks))]
    try:
        wait_keys(store, [f"up/{r}" for r in range(max(ranks))], procs, poll_s=0.1)
        spawn_s = time.perf_counter() - t_start
        times: dict[int, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in ranks}
        formed: dict[int, dict[str, list[float]]] = {w: {m: [] for m in MODES} for w in ranks}
        for w, t, mode in schedule(ranks, args.trials):
            name = tag(w, t, mode)
            go = time.time()
            store.set(f"go/{name}", repr(go))
            wait_keys(store, [f"done/{name}/{r}" for r in range(w)], procs)
            stamps = [json.loads(store.get(f"done/{name}/{r}")) for r in range(w)]
            if t > 0:
                formed[w][mode].append(max(s[0] for s in stamps) - go)
                times[w][mode].append(max(s[1] for s in stamps) - go)
            wait_keys(store, [f"ready/{name}/{r}" for r in range(w)], procs)
        for p in procs:
            if p.wait(timeout=TIMEOUT_S) != 0:
                sys.exit(f"bench: a worker exited with {p.returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

    results: dict[str, Any] = {}
    for w in ranks:
        row: dict[str, Any] = {m: summarize(times[w][m]) for m in MODES}
        row["formed"] = {m: summarize(formed[w][m]) for m in MODES}
        reform = row["reform"]["median_s"]
        row["ratio_fresh_over_reform"] = round(row["fresh"]["median_s"] / reform, 2)
        row["ratio_fresh_connect_over_reform"] = round(row["fresh_connect"]["median_s"] / reform, 2)
        results[str(w)] = row
    result = {"torch": torch.__version__, "cpus": os.cpu_count(), "trials": args.trials, "warmup_trials": 1,
              "workers_started_s": round(spawn_s, 2), "wall_s": round(time.perf_counter() - t_start, 2),
              "results": results}

    def cell(d: dict[str, Any]) -> str:
        return f"{d['median_s'] * 1e3:6.1f} [{d['min_s'] * 1e3:.1f}-{d['max_s'] * 1e3:.1f}]"

    print(f"{'W':>3}  {'fresh ms [min-max]':>22}  {'reform ms [min-max]':>22}  {'fresh/reform':>12}  "
          f"{'fresh+connect ms':>22}  {'(f+c)/reform':>12}")
    for w in ranks:
        r = results[str(w)]
        print(f"{w:>3}  {cell(r['fresh']):>22}  {cell(r['reform']):>22}  {r['ratio_fresh_over_reform']:>12.2f}  "
              f"{cell(r['fresh_connect']):>22}  {r['ratio_fresh_connect_over_reform']:>12.2f}")
    print("of which forming the group (max over ranks of formed - go), median ms:")
    print(f"{'W':>3}  " + "  ".join(f"{m:>13}" for m in MODES))
    for w in ranks:
        f = results[str(w)]["formed"]
        print(f"{w:>3}  " + "  ".join(f"{f[m]['median_s'] * 1e3:>13.1f}" for m in MODES))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
