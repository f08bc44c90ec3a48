"""Raw gloo bandwidth on this machine: one flat buffer sent from one process to another with `send`/`recv` of a
plain `init_process_group("gloo")` group, the ceiling the p2p state transfer is compared with
(`transfer_efficiency`).

    python -m nemo_checkpointless.bench.bandwidth --bytes N      # prints {"bytes", "seconds": [...]} as JSON
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

import torch
import torch.distributed as dist


def _rank(rank: int, port: int, nbytes: int, repeats: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    buf = torch.zeros(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
    seconds = []
    for _ in range(repeats + 1):  # the first one connects: not counted
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        seconds.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    if rank == 1:
        print(json.dumps({"bytes": nbytes, "seconds": seconds[1:]}), flush=True)


def raw_send_recv_s(nbytes: int, repeats: int = 7) -> float:
    """The median time to move `nbytes` from one process to another over loopback gloo."""
    from nemo_checkpointless.bench.systems import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "nemo_checkpointless.bench.bandwidth", "--bytes", str(nbytes), "--port", str(port),
           "--repeats", str(repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return float(statistics.median(json.loads(outs[1])["seconds"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.rank is None:
        print(json.dumps({"bytes": args.bytes, "median_s": raw_send_recv_s(args.bytes, args.repeats)}))
    else:
        _rank(args.rank, args.port, args.bytes, args.repeats)


if __name__ == "__main__":
    main()
