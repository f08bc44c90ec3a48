"""NeMo 2 tiny Llama on 4 CPU ranks (gloo + the test-only shim), DistributedOptimizer with 2 instances.

Two launches of `tests/nemo_tiny_llama.py` (each ~35-80 s on 2 cores): a fault-free run, and a run in which rank 1
loses its whole state at a step boundary and gets it back from its inter-instance peer through
`MegatronParticipant` (`boundary_state` -> `pack` -> gloo -> checksum -> `unpack` -> `load_state`). Skipped
without the [nemo] extra (tests/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import child_env

pytestmark = [pytest.mark.nemo, pytest.mark.slow]

SCRIPT = Path(__file__).resolve().parent / "nemo_tiny_llama.py"
STEPS = 6
LAUNCH_TIMEOUT_S = 240


def _launch(out: Path, mode: str) -> dict[int, dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    env = child_env()
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), mode, str(STEPS)], env=env, cwd=SCRIPT.parent.parent,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=LAUNCH_TIMEOUT_S, check=False)
    log = proc.stdout.decode(errors="replace")
    assert proc.returncode == 0, f"{mode}: exit code {proc.returncode}\n{log[-6000:]}"
    results = {}
    for r in range(4):
        path = out / f"rank{r}.json"
        assert path.exists(), f"{mode}: rank {r} wrote no result\n{log[-6000:]}"
        results[r] = json.loads(path.read_text())
    return results


@pytest.fixture(scope="module")
def faultfree(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _launch(tmp_path_factory.mktemp("nemo-faultfree"), "faultfree")


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S)
def test_faultfree_two_instances(faultfree: dict[int, dict[str, Any]]) -> None:
    r0 = faultfree[0]
    assert r0["backend"] == "gloo" and r0["num_instances"] == 2
    assert r0["optimizer"] == ["DistributedOptimizer"] and r0["inner_optimizer"] == ["AdamW"]
    assert r0["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]  # torch AdamW's keys (FusedAdam's differ on GPU)
    assert all(r["step"] == STEPS and r["finite"] for r in faultfree.values())
    # Megatron's inter-instance groups pair the ranks holding the same shard: [0, 2] and [1, 3].
    assert {r: tuple(v["inter_instance_group"]) for r, v in faultfree.items()} == {
        0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}
    # Params bitwise-identical on every rank; each rank holds half the optimizer state (2 instances of 2 ranks).
    assert len({v["params_sha256"] for v in faultfree.values()}) == 1
    assert all(v["numel_exp_avg"] * 2 == v["numel_params"] for v in faultfree.values())
    # Inter-instance peers hold bitwise-identical shards (main params + optimizer state); the two shards differ.
    assert faultfree[0]["shard_sha256"] == faultfree[2]["shard_sha256"]
    assert faultfree[1]["shard_sha256"] == faultfree[3]["shard_sha256"]
    assert faultfree[0]["shard_sha256"] != faultfree[1]["shard_sha256"]


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_restore_shard_from_peer_ends_bitwise_equal(faultfree: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    restored = _launch(tmp_path / "restore", "restore")
    victim = restored[1]
    assert victim["nan_before"] == victim["numel_params"] and victim["nan_after"] == 0
    assert victim["received_from"] == 3 and victim["received_bytes"] == restored[3]["sent_bytes"] > 0
    for rank in range(4):
        for key in ("params_sha256", "shard_sha256", "rng_sha256"):
            assert restored[rank][key] == faultfree[rank][key], f"rank {rank}: {key} differs from the fault-free run"
