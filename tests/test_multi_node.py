"""Several nodes on one machine: each "node" is a network namespace made by the test (`ip netns` + veth pairs on
a bridge in a namespace of its own), with its own `checkpointless-run` agent; the store, where it runs on its own,
has a namespace too. A whole node is lost by SIGKILL of every process in its namespace (agent, ranks, spares at
once). Every run is the user's Lightning script (`tests/scripts/user_lightning.py`, 2 nodes x 2 ranks, N=2, one
spare per node) and ends compared with the fault-free run of the same script on one machine (4 ranks).

Traffic stays inside the test's namespaces (and loopback for the reference run and the bad-input checks). Needs
root and `ip netns`; skipped with the reason where the machine does not allow them.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from harness import child_env, finish_job, job_progress
from netns import Fabric, netns_error

from nemo_checkpointless.launcher.nodes import node_key

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
TIMEOUT_S = 240
STEPS = 30
SCRIPT_ARGS = ("--max-steps", str(STEPS), "--step-sleep", "0.05", "--devices", "2", "--num-nodes", "2")
PORT = 29400
# A node's lease and the ranks' collective timeout, as ratios to what a loaded 2-core machine does: an agent busy
# starting its processes went 1.5 s without a beat there (its node found lost at start-up), and the watchdog's
# deadline (10 x the p95 step, 5 s at least) must end a hang well before a collective times out.
LEASE_S = 5.0
COLLECTIVE_TIMEOUT_S = 30
# How a survivor says a collective of its ended by `launcher.collective_timeout_s` (`restart.groups`), not by a
# peer's closed socket or the launcher's word.
TIMED_OUT = "(launcher.collective_timeout_s)"


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    why = netns_error()
    if why:
        pytest.skip(why)
    f = Fabric(["store", "node0", "node1"])
    try:
        yield f
    finally:
        f.close()


def _agent(run_dir: Path, node: int, endpoint: str, backend: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nemo_checkpointless.cli.run", "--nnodes", "2", "--node-rank", str(node),
            "--rdzv-endpoint", endpoint, "--rdzv-backend", backend, "--nproc-per-node", "2", "--spares", "1",
            "--node-lease", str(LEASE_S), "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), "--run-dir", str(run_dir),
            *extra, str(SCRIPT), *SCRIPT_ARGS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fault-free run on one machine: 4 ranks, the same script and seed."""
    run_dir = tmp_path_factory.mktemp("mn") / "ref"
    args = [a if a != "2" else "4" for a in SCRIPT_ARGS[:-2]] + ["--num-nodes", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4",
                             "--run-dir", str(run_dir), "--collective-timeout", str(COLLECTIVE_TIMEOUT_S), str(SCRIPT),
                             *args],
                            env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    summary = finish_job(proc, run_dir, "user_rank{r}.json", TIMEOUT_S)
    assert summary["final_step"] == STEPS and summary["recoveries"] == []
    return summary


def _wait(agents: dict[int, subprocess.Popen[bytes]], logs: dict[int, Path], survivors: list[int]) -> str:
    """Every surviving agent exits 0; returns their output."""
    text = ""
    for node in survivors:
        code = agents[node].wait(timeout=TIMEOUT_S)
        text += f"--- node {node} (exit {code})\n{logs[node].read_text(errors='replace')[-4000:]}\n"
        assert code == 0, text
    return text


def _assert_equal(reference: dict[str, Any], run_dir: Path, out: str) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    ranks = {r: json.loads((run_dir / f"user_rank{r}.json").read_text()) for r in range(4)}
    assert summary["final_step"] == STEPS, out
    assert summary["state_sha256"] == reference["state_sha256"], json.dumps(summary["recoveries"], indent=1)
    for r in range(4):
        for key in ("params_sha256", "shard_sha256"):
            assert ranks[r][key] == reference["ranks"][r][key], (r, key, summary["recoveries"])
    return summary


def _detections(tmp_path: Path, run_dir: Path) -> list[tuple[int, str]]:
    """Each survivor's account of what ended its collective when it found a fault (`restart.recovery`: "[rank R
    gen G step S] WHAT; recovering"), from every process's log (rank 0's is its agent's output, node<i>.log)."""
    logs = [*tmp_path.glob("node*.log"), *(run_dir / "logs").glob("*.log")]
    text = "".join(p.read_text(errors="replace") for p in logs)
    return [(int(rank), what) for rank, what in re.findall(r"^\[rank (\d+)[^\]]*\] (.*); recovering$", text, re.M)]


def _lose_node(fabric: Fabric, run_dir: Path, name: str, agents: dict[int, subprocess.Popen[bytes]]) -> int:
    """Kill node `name` whole once the job has trained 8 steps. No clock: on a loaded machine the ranks' start took
    3 minutes here; an agent that exits first fails it, a job that never gets there ends at the test's timeout."""
    while job_progress(run_dir) < 8:
        assert all(a.poll() is None for a in agents.values()), "an agent exited before the job reached step 8"
        time.sleep(0.01)
    return fabric.kill_node(name)


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_a_whole_node_lost_is_recovered_p2p_on_the_other(fabric: Fabric, reference: dict[str, Any],
                                                         tmp_path: Path) -> None:
    """Node 1 (agent + ranks 2, 3 + its spare) killed at once; node 0 hosts the store (c10d, as torchrun)."""
    run_dir = tmp_path / "run"
    endpoint = f"{fabric.addr['node0']}:{PORT}"
    logs = {n: tmp_path / f"node{n}.log" for n in (0, 1)}
    agents = {n: fabric.start(f"node{n}", _agent(run_dir, n, endpoint, "c10d"), logs[n]) for n in (0, 1)}
    killed = _lose_node(fabric, run_dir, "node1", agents)
    assert killed >= 4  # the agent, two ranks, a spare
    out = _wait(agents, logs, [0])
    summary = _assert_equal(reference, run_dir, out)
    [rec] = summary["recoveries"]
    assert rec["failed_ranks"] == [2, 3] and rec["fault_kind"] == "node" and rec["path"] == "p2p", rec
    assert rec["steps_lost"] == 0, rec
    # The launcher found the node lost by its lease; the survivors' collectives ended on the dead ranks' sockets or
    # the launcher's word, not by a collective timeout: each survivor says what ended its collective.
    assert f"node 1 is lost (no heartbeat for {LEASE_S:g} s): ranks [2, 3] fail with it" in out, out
    found = _detections(tmp_path, run_dir)
    assert {r for r, _ in found} == {0, 1} and not any(TIMED_OUT in what for _, what in found), found
    assert all(len(summary["pids"][str(r)]) == 1 for r in (0, 1)), summary["pids"]  # the survivors kept theirs


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_losing_the_node_that_started_the_job_with_the_store_on_its_own(fabric: Fabric, reference: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    """Node 0 (the leader, where the job started) killed whole: node 1 takes over the decisions from the store
    and recovers ranks 0 and 1 p2p."""
    run_dir = tmp_path / "run"
    endpoint = f"{fabric.addr['store']}:{PORT}"
    store = fabric.start("store", [sys.executable, "-m", "nemo_checkpointless.cli.store", "--host",
                                   fabric.addr["store"], "--port", str(PORT)], tmp_path / "store.log")
    logs = {n: tmp_path / f"node{n}.log" for n in (0, 1)}
    agents = {n: fabric.start(f"node{n}", _agent(run_dir, n, endpoint, "external"), logs[n]) for n in (0, 1)}
    _lose_node(fabric, run_dir, "node0", agents)
    out = _wait(agents, logs, [1])
    summary = _assert_equal(reference, run_dir, out)
    [rec] = summary["recoveries"]
    assert rec["failed_ranks"] == [0, 1] and rec["fault_kind"] == "node" and rec["path"] == "p2p", rec
    assert all(len(summary["pids"][str(r)]) == 1 for r in (2, 3)), summary["pids"]
    assert "node 1 takes over from node 0" in out
    assert store.poll() is None  # the store outlives every node


@pytest.mark.timeout(3 * TIMEOUT_S)
def test_rank_kills_and_a_hang_refill_the_spares_across_nodes(fabric: Fabric, reference: dict[str, Any],
                                                         tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    endpoint = f"{fabric.addr['store']}:{PORT}"
    fabric.start("store", [sys.executable, "-m", "nemo_checkpointless.cli.store", "--host", fabric.addr["store"],
                           "--port", str(PORT)], tmp_path / "store.log")
    # Rank 2 (node 1) is SIGSTOPped, not killed: the leader on node 0 finds it from node 1's reports of its
    # ranks' progress beacons and /proc states, within the watchdog's deadline, before any collective times out.
    faults = ("--fault", "kill:1:6", "--fault", "hang:2:14", "--fault", "kill:3:22")
    logs = {n: tmp_path / f"node{n}.log" for n in (0, 1)}
    agents = {n: fabric.start(f"node{n}", _agent(run_dir, n, endpoint, "external", *faults), logs[n])
              for n in (0, 1)}
    out = _wait(agents, logs, [0, 1])
    summary = _assert_equal(reference, run_dir, out)
    recs = summary["recoveries"]
    assert [r["failed_ranks"] for r in recs] == [[1], [2], [3]], recs
    assert all(r["path"] == "p2p" and r["steps_lost"] == 0 for r in recs), recs
    assert all(r["replacement"][str(r["failed_ranks"][0])] != "cold start" for r in recs), recs
    hang = recs[1]
    assert hang["fault_kind"] == "hang" and "stopped (state T)" in hang["hang"]["2"], hang
    # Three survivors per fault, each saying what ended its collective: never the collective timeout (the hang's
    # survivors were told by the launcher once the watchdog had found rank 2 stopped).
    found = _detections(tmp_path, run_dir)
    assert len(found) >= 9 and not any(TIMED_OUT in what for _, what in found), found
    # The straggler report read every rank's beacon too, those of node 1 through its agent.
    assert sorted(summary["rank_busy_s"]) == ["0", "1", "2", "3"], summary["rank_busy_s"]


# ------------------------------------------------------------------------------------------------ bad input
# How long an agent waits for the job's other nodes where the test has them come: far beyond an agent's start on a
# loaded machine; a test that passes never waits it (the other agent arrives, or stops the job).
JOIN_WAIT_S = 120


def _listening(port: int) -> bool:
    """Whether a socket of this machine listens on `port`, read from /proc/net (a connect to find out would be a
    client of the store, and on loopback may be given the very port the store is about to bind)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f.readlines()[1:]]
        if any(int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == "0A" for row in rows):
            return True
    return False


def _await_listener(port: int, proc: subprocess.Popen[bytes]) -> None:
    """Until `proc` (a store, or an agent hosting one) listens on `port`; the test's timeout bounds it."""
    while not _listening(port):
        assert proc.poll() is None, f"exited with {proc.returncode} before it listened on {port}"
        time.sleep(0.01)


def _await_claim(port: int, node: int, proc: subprocess.Popen[bytes]) -> None:
    """Until the agent `proc` has joined the job as `node` (its claim is in the store): whatever the next agent
    does is then done second."""
    _await_listener(port, proc)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    try:
        while not store.check([node_key(node, "claim")]):
            assert proc.poll() is None, f"the first agent exited with {proc.returncode} before it joined"
            time.sleep(0.01)
    finally:
        del store


def _run_agents(tmp_path: Path, port: int, flags: list[list[str]], hold_first: bool = False
                ) -> list[tuple[int, str]]:
    """Agents on loopback (store at 127.0.0.1:`port`) with per-node `flags`; each one's exit code and output. The
    first one has joined before the others start; `hold_first`: it is stopped (SIGSTOP) while they run, so that
    it holds its port and its claim whatever their start takes, and continued once they have exited."""
    procs = []
    for i, extra in enumerate(flags):
        argv = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--run-dir", str(tmp_path / "run"),
                "--rdzv-conf", "join_timeout=8", *extra, str(SCRIPT), *SCRIPT_ARGS]
        procs.append(subprocess.Popen(argv, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        if i == 0:
            _await_claim(port, int(extra[extra.index("--node-rank") + 1]), procs[0])
            if hold_first:
                os.kill(procs[0].pid, signal.SIGSTOP)
    out: dict[int, tuple[int, str]] = {}
    try:
        for i, p in reversed(list(enumerate(procs))):  # the first one last: it may be held
            if i == 0 and hold_first:
                os.kill(p.pid, signal.SIGCONT)
            text, _ = p.communicate(timeout=JOIN_WAIT_S + 60)
            out[i] = (p.returncode, text.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait()
    return [out[i] for i in range(len(procs))]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leftovers(tmp_path: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(tmp_path / "run")], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_nodes_that_disagree_stop_with_one_message(tmp_path: Path) -> None:
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    base = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--nproc-per-node", "2"]
    # Node 0 has joined (hosting the store) before node 1 starts: node 1's flags are the ones that differ, and
    # node 0 waits for it as long as it takes to start.
    (c0, o0), (c1, o1) = _run_agents(tmp_path, port, [[*base, "--node-rank", "0", "--rdzv-conf",
                                                       f"join_timeout={JOIN_WAIT_S}"],
                                                      ["--nnodes", "2", "--rdzv-endpoint", endpoint,
                                                       "--nproc-per-node", "1", "--node-rank", "1"]])
    assert c1 == 2 and "--nproc-per-node=1: on node 1 differs from the job's other nodes (--nproc-per-node=2)" in o1, o1
    assert c0 == 2 and "another node stopped the job before it started" in o0, o0
    assert "Traceback" not in o0 + o1
    assert _leftovers(tmp_path) == []


def test_two_agents_claiming_one_node_rank(tmp_path: Path) -> None:
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    base = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--nproc-per-node", "2"]
    (c0, o0), (c1, o1) = _run_agents(tmp_path, port, [[*base, "--node-rank", "0"],
                                                      [*base, "--node-rank", "0", "--rdzv-backend", "c10d"]],
                                     hold_first=True)
    # The second agent of node 0 cannot host the store on the port the first one holds (held there, stopped,
    # until the second has exited).
    assert c1 == 2 and "--rdzv-endpoint=" in o1 and "cannot be bound" in o1, o1
    assert c0 != 0 and "node(s) [1] did not join within" in o0, o0
    assert _leftovers(tmp_path) == []


def test_an_unreachable_endpoint_and_a_claimed_node_rank(tmp_path: Path) -> None:
    port = _free_port()
    endpoint = f"127.0.0.1:{port}"
    alone = subprocess.run([sys.executable, "-m", "nemo_checkpointless.cli.run", "--run-dir", str(tmp_path / "run"),
                            "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint, "--rdzv-backend",
                            "external", "--nproc-per-node", "2", "--rdzv-conf", "join_timeout=3", str(SCRIPT),
                            *SCRIPT_ARGS], env=child_env(), cwd=ROOT, capture_output=True, timeout=120)
    code, out = alone.returncode, (alone.stdout + alone.stderr).decode(errors="replace")
    assert code == 2 and f"--rdzv-endpoint={endpoint}: no store answered there within 3 s" in out, out
    assert "start checkpointless-store there first" in out and "Traceback" not in out and "socket.cpp" not in out
    store = subprocess.Popen([sys.executable, "-m", "nemo_checkpointless.cli.store", "--port", str(port)],
                             env=child_env(), stderr=subprocess.PIPE)
    try:
        # The store listens before the first agent starts (which waits for it 8 s only), and the second agent
        # starts once the first has claimed node rank 1 (the claim stays in the store).
        _await_listener(port, store)
        base = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-backend", "external", "--nproc-per-node", "2"]
        (c0, o0), (c1, o1) = _run_agents(tmp_path, port, [[*base, "--node-rank", "1"], [*base, "--node-rank", "1"]])
        assert c1 == 2 and "--node-rank=1: is already claimed by another agent" in o1, o1
        assert c0 != 0 and "node(s) [0] did not join" in o0, o0
    finally:
        store.terminate()
        store.wait()
    assert _leftovers(tmp_path) == []


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_lost_store_stops_every_node_with_the_story(tmp_path: Path) -> None:
    """The store on its own, killed mid-run (loopback): the job cannot go on; every agent stops its ranks and
    exits non-zero saying why, and nothing is left running."""
    port = _free_port()
    store = subprocess.Popen([sys.executable, "-m", "nemo_checkpointless.cli.store", "--port", str(port)],
                             env=child_env(), stderr=subprocess.DEVNULL)
    run_dir = tmp_path / "run"
    try:
        _await_listener(port, store)
        agents = [subprocess.Popen(_agent(run_dir, n, f"127.0.0.1:{port}", "external"), env=child_env(), cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in (0, 1)]
        while job_progress(run_dir) < 5:  # the test's timeout bounds it (see `_lose_node`)
            assert all(a.poll() is None for a in agents), "an agent exited before the job reached step 5"
            time.sleep(0.01)
        store.kill()
        t_lost = time.monotonic()
        outs = [a.communicate(timeout=60)[0].decode(errors="replace") for a in agents]
        waited = time.monotonic() - t_lost
    finally:
        store.kill()
        store.wait()
    for agent, out in zip(agents, outs, strict=True):
        assert agent.returncode == 1, out[-3000:]
        # Found by the agent's own store call failing on the closed connection, not by a store timeout.
        why = re.search(rf"lost the job's store at 127\.0\.0\.1:{port} \((.+?)\); the job cannot go on without it; "
                        r"restart the job", out)
        assert why and "timeout" not in why.group(1).lower(), out[-3000:]
    print(f"store lost: every agent exited {waited:.2f} s later")
    # Each agent stopped its ranks itself: a store call that waited for its timeout, or ranks left to their
    # collective timeout, would take 30 s (measured: 2.2 s, on this 2-core machine with two other suites running).
    assert waited < COLLECTIVE_TIMEOUT_S / 2, waited
    assert _leftovers(tmp_path) == []
