"""`checkpointless-store`: the job's store on a host of its own, so that no training node hosts it.

    checkpointless-store [--host ADDR] [--port PORT]

Listens on ADDR:PORT only (a TCPStore server) until SIGTERM or Ctrl-C. Every node's agent joins it with
`checkpointless-run --nnodes N --node-rank i --rdzv-endpoint ADDR:PORT --rdzv-backend external ...` (or
`checkpointless-train ... launcher.rdzv_endpoint=ADDR:PORT launcher.rdzv_backend=external`). Run it as a
Kubernetes Service's pod or on the Slurm batch host (docs/cluster.md). It holds the job's keys in memory: when it is
lost, the job cannot go on (every agent stops its ranks and exits non-zero) and is restarted from its checkpoint.
"""

from __future__ import annotations

import argparse
import signal
import sys

from nemo_checkpointless.errors import ConfigError

PROG = "checkpointless-store"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="the job's store, for the agents of every node")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=29400, help="the port to listen on (default: %(default)s)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from nemo_checkpointless.launcher.local import host_store

    try:
        store, port = host_store(args.host, 300.0, args.port, key="--port")
    except ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"{PROG}: listening on {args.host}:{port}", file=sys.stderr, flush=True)
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    while not stop["signal"]:
        signal.pause()
    del store
    print(f"{PROG}: stopped ({signal.Signals(stop['signal']).name})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
