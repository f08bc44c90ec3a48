"""Several nodes on one machine: each "node" is a network namespace made by the test (`ip netns` + veth pairs on
a bridge in a namespace of its own), with its own `checkpointless-run` agent; the store, where it runs on its own,
has a namespace too. A whole node is lost by SIGKILL of every process in its namespace (agent, ranks, spares at
once). Every run is the user's Lightning script (`tests/scripts/user_lightning.py`, 2 nodes x 2 ranks, N=2, one
spare per node) and ends compared with the fault-free run of the same script on one machine (4 ranks).

Traffic stays inside the test's namespaces (and loopback for the reference run and the bad-input checks). Needs
root and `ip netns`; skipped with the reason where the machine does not allow them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import child_env, finish_job, job_progress
from netns import Fabric, netns_error

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "user_lightning.py"
TIMEOUT_S = 240
STEPS = 30
SCRIPT_ARGS = ("--max-steps", str(STEPS), "--step-sleep", "0.05", "--devices", "2", "--num-nodes", "2")
PORT = 29400


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
            "--node-lease", "1.5", "--collective-timeout", "8", "--run-dir", str(run_dir), *extra, str(SCRIPT),
            *SCRIPT_ARGS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fault-free run on one machine: 4 ranks, the same script and seed."""
    run_dir = tmp_path_factory.mktemp("mn") / "ref"
    args = [a if a != "2" else "4" for a in SCRIPT_ARGS[:-2]] + ["--num-nodes", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "nemo_checkpointless.cli.run", "--nproc-per-node", "4",
                             "--run-dir", str(run_dir), "--collective-timeout", "8", str(SCRIPT), *args],
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


def _lose_node(fabric: Fabric, run_dir: Path, name: str) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while job_progress(run_dir) < 8:
        assert time.monotonic() < deadline, "the job did not reach step 8"
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
    killed = _lose_node(fabric, run_dir, "node1")
    assert killed >= 4  # the agent, two ranks, a spare
    out = _wait(agents, logs, [0])
    summary = _assert_equal(reference, run_dir, out)
    [rec] = summary["recoveries"]
    assert rec["failed_ranks"] == [2, 3] and rec["fault_kind"] == "node" and rec["path"] == "p2p", rec
    assert rec["steps_lost"] == 0, rec
    # Found by the lease (1.5 s, from the node's last beat), not by a collective timeout (8 s).
    assert 1.0 <= rec["detect_s"] < 8, rec
    assert all(len(summary["pids"][str(r)]) == 1 for r in (0, 1)), summary["pids"]  # the survivors kept theirs
    assert "node 1 is lost" in out


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
    _lose_node(fabric, run_dir, "node0")
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
    # ranks' progress beacons and /proc states, within the watchdog's deadline, not two collective timeouts.
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
    assert hang["detect_s"] < 8, hang  # the collective timeout is 8 s
    # The straggler report read every rank's beacon too, those of node 1 through its agent.
    assert sorted(summary["rank_busy_s"]) == ["0", "1", "2", "3"], summary["rank_busy_s"]


# ------------------------------------------------------------------------------------------------ bad input
def _run_agents(tmp_path: Path, flags: list[list[str]], timeout: float = 60) -> list[tuple[int, str]]:
    """Agents on loopback with per-node `flags`; each one's exit code and output."""
    procs = []
    for i, extra in enumerate(flags):
        argv = [sys.executable, "-m", "nemo_checkpointless.cli.run", "--run-dir", str(tmp_path / "run"),
                "--rdzv-conf", "join_timeout=8", *extra, str(SCRIPT), *SCRIPT_ARGS]
        procs.append(subprocess.Popen(argv, env=child_env(), cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        if i == 0:
            time.sleep(1.0)  # the first one hosts the store
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        out.append((p.returncode, text.decode(errors="replace")))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leftovers(tmp_path: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-af", str(tmp_path / "run")], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def test_nodes_that_disagree_stop_with_one_message(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    base = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--nproc-per-node", "2"]
    (c0, o0), (c1, o1) = _run_agents(tmp_path, [[*base, "--node-rank", "0"],
                                                ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--nproc-per-node",
                                                 "1", "--node-rank", "1"]])
    assert c1 == 2 and "--nproc-per-node=1: on node 1 differs from the job's other nodes (--nproc-per-node=2)" in o1, o1
    assert c0 == 2 and "another node stopped the job before it started" in o0, o0
    assert "Traceback" not in o0 + o1
    assert _leftovers(tmp_path) == []


def test_two_agents_claiming_one_node_rank(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    base = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--nproc-per-node", "2"]
    (c0, o0), (c1, o1) = _run_agents(tmp_path, [[*base, "--node-rank", "0"], [*base, "--node-rank", "0",
                                                                              "--rdzv-backend", "c10d"]])
    # The second agent of node 0 cannot host the store on the port the first one holds.
    assert c1 == 2 and "--rdzv-endpoint=" in o1 and "cannot be bound" in o1, o1
    assert c0 != 0 and "node(s) [1] did not join within" in o0, o0
    assert _leftovers(tmp_path) == []


def test_an_unreachable_endpoint_and_a_claimed_node_rank(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    [(code, out)] = _run_agents(tmp_path, [["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint,
                                            "--rdzv-backend", "external", "--nproc-per-node", "2",
                                            "--rdzv-conf", "join_timeout=3"]])
    assert code == 2 and f"--rdzv-endpoint={endpoint}: no store answered there within 3 s" in out, out
    assert "start checkpointless-store there first" in out and "Traceback" not in out and "socket.cpp" not in out
    store = subprocess.Popen([sys.executable, "-m", "nemo_checkpointless.cli.store", "--port",
                              endpoint.rsplit(":", 1)[1]], env=child_env(), stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)
        base = ["--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-backend", "external", "--nproc-per-node", "2"]
        (c0, o0), (c1, o1) = _run_agents(tmp_path, [[*base, "--node-rank", "1"], [*base, "--node-rank", "1"]])
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
        time.sleep(1.0)
        agents = [subprocess.Popen(_agent(run_dir, n, f"127.0.0.1:{port}", "external"), env=child_env(), cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in (0, 1)]
        deadline = time.monotonic() + TIMEOUT_S
        while job_progress(run_dir) < 5:
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "no progress"
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
        assert f"lost the job's store at 127.0.0.1:{port}" in out and "restart the job" in out, out[-3000:]
    print(f"store lost: every agent exited {waited:.2f} s later")
    assert waited < 30, waited  # not a collective timeout per rank, not a hang
    assert _leftovers(tmp_path) == []
