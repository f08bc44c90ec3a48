"""The job's store holds O(1) keys per step: a long job ends with as many keys as a short one, on both engines.

The store is the control plane of a job that may run 10^5 steps on thousands of ranks: a key written per step (or
per rank per step) would fill its memory. `summary.json["store_keys"]` is `TCPStore.num_keys()` as the job ends.
The NeMo engine once wrote `data/<step>/<rank>` for its data record (20 steps: 129 keys, 200 steps: 849); the record
now rides a small all-gather per step and travels with each rank's state.

Per engine: a 20-step job and a long one (300 steps on Lightning, in the PR tier; 2,000 on NeMo, ~4 min, in the
full tier), fault-free, the same settings otherwise. And the keys of the process groups of ended generations are
deleted: they do not grow with the recoveries either.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import train_builtin

pytestmark = [pytest.mark.slow]

LONG = [pytest.param("lightning", 300),
        pytest.param("nemo", 2000, marks=[pytest.mark.nemo, pytest.mark.timeout(1200)])]


@pytest.mark.parametrize(("engine", "steps"), LONG)
def test_a_long_job_ends_with_as_many_store_keys_as_a_short_one(engine: str, steps: int, tmp_path: Path) -> None:
    common = ["checkpoint.every_n_steps=0", "trainer.log_every_n_steps=50"]
    short = train_builtin(tmp_path / "short", engine, "trainer.max_steps=20", *common)
    long = train_builtin(tmp_path / "long", engine, f"trainer.max_steps={steps}", *common, timeout_s=1100)
    assert (short["final_step"], long["final_step"]) == (20, steps)
    assert long["store_keys"] == short["store_keys"], (short["store_keys"], long["store_keys"])


@pytest.mark.parametrize("engine", ["lightning", pytest.param("nemo", marks=[pytest.mark.nemo, pytest.mark.full,
                                                                         pytest.mark.timeout(1200)])])
def test_the_groups_keys_of_ended_generations_are_deleted(engine: str, tmp_path: Path) -> None:
    """Every recovery makes a new generation of process groups, each with its keys in the store; the launcher deletes
    the keys of a generation no rank uses any more (`forget_groups`: all but the two newest). A job recovered four
    times ends with as many group keys as one recovered twice, and both end equal to each other."""
    def kills(n: int) -> str:
        return "[" + ",".join(f"{{kind:kill,rank:{1 + i % 3},step:{3 + 2 * i}}}" for i in range(n)) + "]"

    common = ["trainer.max_steps=12", "checkpoint.every_n_steps=0"]
    twice = train_builtin(tmp_path / "twice", engine, *common, f"fault.plan={kills(2)}")
    four = train_builtin(tmp_path / "four", engine, *common, f"fault.plan={kills(4)}")
    assert (len(twice["recoveries"]), len(four["recoveries"])) == (2, 4)
    assert all(r["path"] == "p2p" for r in twice["recoveries"] + four["recoveries"]), four["recoveries"]
    assert twice["state_sha256"] == four["state_sha256"]
    assert 0 < four["store_group_keys"] == twice["store_group_keys"], (twice["store_group_keys"],
                                                                        four["store_group_keys"])
