"""Network namespaces as the "nodes" of a job on one machine (tests/test_multi_node.py, scripts/bench_nodes.py):
each one an address on a bridge that lives in a namespace of its own, processes started inside, a whole-namespace
SIGKILL as a lost node. Needs root and `ip netns`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from harness import child_env

from nemo_checkpointless.launcher.procs import proc_state

ROOT = Path(__file__).resolve().parent.parent
SUBNET = "10.231.0"


def netns_error() -> str | None:
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    probe = f"nclp{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns is not allowed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class Fabric:
    """Namespaces `names` (each with one address on a shared bridge), processes started in them, whole-namespace
    kills, and everything removed at the end."""

    def __init__(self, names: list[str]) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.bridge_ns = f"ncl{self.tag}b"
        self.ns = {name: f"ncl{self.tag}{i}" for i, name in enumerate(names)}
        self.addr = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self.procs: list[subprocess.Popen[bytes]] = []
        self._ip("netns", "add", self.bridge_ns)
        self._ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            ns, inner, outer = self.ns[name], f"v{self.tag}{i}a", f"v{self.tag}{i}b"
            self._ip("netns", "add", ns)
            self._ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            self._ip("link", "set", inner, "netns", ns)
            self._ip("link", "set", outer, "netns", self.bridge_ns)
            self._ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", inner)
            self._ip("-n", ns, "link", "set", inner, "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", self.bridge_ns, "link", "set", outer, "master", "br0")
            self._ip("-n", self.bridge_ns, "link", "set", outer, "up")

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def start(self, name: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        out = open(log, "wb")  # noqa: SIM115 (the child writes to it until it exits)
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[name], *argv], env=child_env(), cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
        out.close()
        self.procs.append(proc)
        return proc

    def pids(self, name: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns[name]], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, name: str) -> int:
        """SIGKILL every process of the namespace, at once and until none is left; returns how many.

        Every process is stopped (SIGSTOP) before any is killed, as a node that vanishes says nothing more: else
        its agent, killed a moment after its ranks, could still report their exits (the launcher reads an exit
        from /proc as soon as it begins)."""
        pids = self.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any((proc_state(p) or ("T",))[0] not in "TZX" for p in pids):
            time.sleep(0.001)
        killed: set[int] = set()
        for _ in range(50):
            pids = self.pids(name)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        return len(killed)

    def close(self) -> None:
        for name in self.ns:
            self.kill_node(name)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for ns in [*self.ns.values(), self.bridge_ns]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
